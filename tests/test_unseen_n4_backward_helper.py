"""A training loop that calls backward through a helper of its own (``def backward(loss):
loss.backward()`` in a utility module): a NaN born in the loss code named only the
helper's ``loss.backward()`` line, the same for every loop that calls it; the line of the
loop that called the helper is named too."""

from __future__ import annotations

import inspect
import os

import pytest
import torch
from torch import nn

import nanwatch


def _backward(loss: torch.Tensor) -> None:
    loss.backward()  # the helper's line


def _rel_error(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((pred - target) / target).abs().mean()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))


def _train(model: nn.Module, bad_step: int | None) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(5):
        x, y = torch.randn(64, 8), torch.rand(64, 1) + 0.5
        if step == bad_step:
            y[7] = 0.0  # a target of 0: the relative error divides by it
        loss = _rel_error(model(x), y)
        _backward(loss)  # the loop's call
        opt.step()
        opt.zero_grad()


def _line(marker: str) -> str:
    lines, start = inspect.getsourcelines(_train if "loop" in marker else _backward)
    offset = next(i for i, text in enumerate(lines) if marker in text)
    return f"{os.path.basename(__file__)}:{start + offset}"


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_the_loops_call_of_a_backward_helper_is_named(mode: str) -> None:
    model = _model()
    with (
        pytest.raises(nanwatch.AnomalyError) as ei,
        nanwatch.watch(model, mode=mode, postmortem=False),
    ):
        _train(model, bad_step=3)
    summary = ei.value.anomaly.summary if ei.value.anomaly is not None else ""
    assert ei.value.diagnoses[0].code == "NW111"
    assert f"{_line('the helper')}, in _backward() called from " in summary
    assert summary.split("called from ")[1].split(";")[0].endswith(_line("the loop's call"))


def test_a_backward_helper_that_trains_clean_reports_nothing() -> None:
    model = _model()
    with nanwatch.watch(model, postmortem=False) as nw:
        _train(model, bad_step=None)
    assert not [d for t in nw.history for d in t.diagnoses]
