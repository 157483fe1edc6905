"""NW103 (float16 logits approaching exp's bound) is quiet when the loss that takes them is a
stable one (cross-entropy subtracts the max) and takes them through a view -- the usual
language-model ``F.cross_entropy(logits.flatten(0, 1), y.flatten())``, under float16 autocast --
as it is when it takes the tensor itself; an exp taken of the view in float16 still warns."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch


def _codes(loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], mode: str) -> list[str]:
    """A float16 sequence classifier memorizing its batch: its logits grow past half of
    float16's exp bound (11.09) within 16 steps. ``loss_of(logits, y)`` computes the loss
    from the (batch, time, classes) logits."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4)).half()
    x, y = torch.randn(2, 4, 8).half(), torch.arange(8).view(2, 4) % 4
    opt = torch.optim.SGD(m.parameters(), 0.3)
    with nanwatch.watch(m, mode=mode, on_anomaly="record") as nw:
        for _ in range(16):
            loss = loss_of(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    return [d.code for d in nw.report.diagnoses]


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
@pytest.mark.parametrize(
    "loss_of",
    [
        lambda z, y: F.cross_entropy(z.flatten(0, 1), y.flatten()),
        lambda z, y: F.cross_entropy(z[:, 1:].reshape(-1, 4), y[:, 1:].reshape(-1)),
    ],
    ids=["flatten", "shifted"],
)
def test_a_cross_entropy_of_a_view_of_the_logits_is_no_exp_overflow_risk(
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], mode: str
) -> None:
    assert "NW103" not in _codes(loss_of, mode)


def test_an_exp_of_a_view_in_float16_still_warns() -> None:
    def loss_of(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = z.flatten(0, 1).exp()
        return F.nll_loss((p / p.sum(-1, keepdim=True)).float().log(), y.flatten())

    assert "NW103" in _codes(loss_of, "watch")
