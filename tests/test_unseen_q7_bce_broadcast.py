"""A hand-written binary cross-entropy with both products on one line,
``-(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()``, given the model's (N, 1)
probabilities and an (N,) target: both products broadcast to (N, N), the loss is finite and
decreases, and PyTorch says nothing. NW506 reads the line's two products (their operands'
shapes from the locals they are made of, checked against the graph's) and squeezes the
column in each; the same loss on matching shapes stays silent."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch

MODES = ["watch", "sentinel"]


def _bce(mode: str, target_shape: str) -> nanwatch.Watcher:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1), nn.Sigmoid())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    x = torch.randn(32, 5)
    y = (torch.rand(32) > 0.5).float()
    if target_shape == "column":
        y = y.unsqueeze(1)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            p = model(x)
            loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", MODES)
def test_both_products_of_a_hand_written_bce_are_named_with_the_fix(mode: str) -> None:
    nw = _bce(mode, "row")
    found = [d for d in nw.report.diagnoses if d.code == "NW506"]
    assert len(found) == 1, [d.headline for d in nw.report.diagnoses]
    d = found[0]
    assert d.severity == "warning"
    assert d.evidence[0] == (
        "torch.log(p) (32, 1) and y (32,) broadcast to (32, 32) in y * torch.log(p), "
        "torch.log(1 - p) and 1 - y in (1 - y) * torch.log(1 - p): each prediction meets "
        "every target (1,024 terms instead of 32), not only its own"
    ), d.evidence
    assert "loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()" in d.evidence[1]
    assert d.fix.startswith(
        "loss = -(y * torch.log(p).squeeze(1) + (1 - y) * torch.log(1 - p).squeeze(1)).mean()"
    ), d.fix
    assert "(1 - y).unsqueeze(1) * torch.log(1 - p)" in d.fix


def test_the_fixed_line_computes_the_per_sample_loss() -> None:
    """The fix's loss is the one nn.BCELoss computes on the squeezed probabilities."""
    nw = _bce("watch", "row")
    d = next(d for d in nw.report.diagnoses if d.code == "NW506")
    line = d.fix.split("   #")[0]
    torch.manual_seed(2)
    p = torch.rand(32, 1) * 0.98 + 0.01
    y = (torch.rand(32) > 0.5).float()
    scope: dict[str, object] = {"torch": torch, "p": p, "y": y}
    exec(line, scope)
    expected = nn.BCELoss()(p.squeeze(1), y)
    assert torch.allclose(scope["loss"], expected)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", MODES)
def test_the_same_loss_on_matching_shapes_stays_silent(mode: str) -> None:
    nw = _bce(mode, "column")
    assert nw.report.diagnoses == [], [d.headline for d in nw.report.diagnoses]
