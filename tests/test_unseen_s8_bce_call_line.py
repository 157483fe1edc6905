"""A binary cross-entropy written by hand in a loss module, called as ``crit(torch.sigmoid(
model(xb)), yb)``: in watch and sentinel mode (no op line of the sigmoid's own) NW110's fix
first takes the sigmoid out of the user's line that called the loss module, as forensic
mode does, so that "p is now the logits" is true; a healthy run reports nothing."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import nanwatch


class HandBCE(nn.Module):
    def forward(self, p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


def _train(mode: str, *, lr: float, scale: float) -> nanwatch.Watcher:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    crit = HandBCE()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    xb = torch.randn(64, 4) * scale
    yb = (xb[:, :1] > 0).float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, crit, mode=mode, on_anomaly="record", postmortem=False) as nw:
            for _ in range(6):
                loss = crit(torch.sigmoid(model(xb)), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return nw


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_the_fix_takes_the_sigmoid_out_of_the_loss_modules_call(mode: str) -> None:
    nw = _train(mode, lr=5.0, scale=10.0)
    fix = next(d.fix for s in nw.history for d in s.diagnoses if d.code == "NW110")
    first, second = fix.splitlines()[:2]
    # before: the fix began with the second line, "p is now the logits" while the user's
    # line still passed torch.sigmoid(model(xb))
    assert first.startswith("loss = crit(model(xb), yb)   # first, at "), fix
    assert __file__ in first and "(was: loss = crit(torch.sigmoid(model(xb)), yb))" in first
    assert second.startswith("loss = torch.nn.functional.binary_cross_entropy_with_logits(p, y)"), (
        fix
    )


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_healthy_hand_written_bce_module_reports_nothing(mode: str) -> None:
    nw = _train(mode, lr=0.01, scale=0.5)
    assert not nw.anomalies
    assert not [d for s in nw.history for d in s.diagnoses]
