"""A target with missing values (NaN read from a CSV column) in a hand-written loss,
``((pred - y) ** 2).mean()``: the subtraction's autograd node saves no operand, so the NaN
was "born on the way to the loss". The operand with no autograd history that held it is
found among the user's locals, named, and the fix is the loss over the values that are
there."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch

MODES = ["sentinel", "watch"]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_target_is_named_with_the_masked_loss(mode: str) -> None:
    model = _net()
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        y[3] = float("nan")  # a missing label
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        nw.step()
    d = nw.report.diagnoses[0]
    assert d.title == "Non-finite tensor computed without gradients, read by the loss"
    text = " | ".join(d.evidence)
    assert "other operand of sub (y)" in text
    assert "1 of y's 16 values are non-finite: data with missing values" in text
    assert d.fix.startswith("# y loaded with missing values")
    assert "keep = torch.isfinite(y)" in d.fix
    assert "loss = ((pred - y)[keep] ** 2).mean()" in d.fix


def test_the_masked_loss_trains_with_nothing_to_report() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with nanwatch.watch(model, mode="sentinel", postmortem=False) as nw:
        for _ in range(3):
            x, y = torch.randn(16, 4), torch.randn(16, 1)
            y[3] = float("nan")
            keep = torch.isfinite(y)
            loss = ((model(x) - y)[keep] ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    assert nw.report.diagnoses == []


def test_two_locals_holding_nan_name_neither() -> None:
    model = _net()
    with nanwatch.watch(model, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        y[3] = float("nan")
        # another local with a NaN, of a shape that fits the subtraction as well as y's:
        # which one is it? (one that does not fit, a table y was sliced from, is no answer)
        other = torch.full((16, 1), float("nan"))
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        nw.step()
    assert other.isnan().all()
    d = nw.report.diagnoses[0]
    assert "(y)" not in " | ".join(d.evidence)
