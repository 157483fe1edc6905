"""Post-mortem for backward() on a loss of many values ("grad can be implicitly created only
for scalar outputs"): a squared error not averaged, a loss made with reduction='none'. The
advice names the tensor's shape, the statement that made it (the branch that ran, told by
the tensor's autograd node) and that statement reduced with .mean(); the error reaches the
user unchanged."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.report import Report

HERE = os.path.basename(__file__)
MODES = ["sentinel", "watch"]
_X = torch.randn(16, 8)
_Y = torch.randint(0, 3, (16,))


def _line(fn: Callable[..., object], marker: str) -> str:
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, text in enumerate(lines) if marker in text)
    return f"{HERE}:{start + offset}"


def _error(tmp_path: Path, mode: str, step: Callable[[nn.Module], None]) -> dict[str, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    with (
        pytest.raises(RuntimeError, match="only for scalar outputs") as info,
        nanwatch.watch(model, mode=mode, report_dir=str(tmp_path)) as nw,
    ):
        step(model)
        nw.step()
    assert type(info.value) is RuntimeError
    (path,) = sorted(tmp_path.glob("*.json"))
    error = Report.load(path).error
    assert error is not None and error["message"] == str(info.value)
    return error


@pytest.mark.parametrize("mode", MODES)
def test_a_squared_error_not_averaged_is_reduced_where_it_is_made(
    tmp_path: Path, mode: str
) -> None:
    def step(model: nn.Module) -> None:
        out = model(_X)
        loss = (out - 1.0) ** 2  # made
        loss.backward()  # raised

    error = _error(tmp_path, mode, step)
    assert error["class"] == "non-scalar-backward"
    advice = str(error["advice"])
    assert _line(step, "# raised") in advice
    assert "a tensor of shape (16, 3) (48 values)" in advice
    assert _line(step, "# made") in advice
    assert "`loss = ((out - 1.0) ** 2).mean()`" in advice


def test_a_loss_made_with_reduction_none_is_told_so(tmp_path: Path) -> None:
    def step(model: nn.Module) -> None:
        losses = F.cross_entropy(model(_X), _Y, reduction="none")
        losses.backward()

    advice = str(_error(tmp_path, "sentinel", step)["advice"])
    assert "reduction='none' keeps one loss per element" in advice
    assert '`losses = F.cross_entropy(model(_X), _Y, reduction="none").mean()`' in advice


def test_the_branch_that_made_the_loss_is_named_not_the_last_one_above(tmp_path: Path) -> None:
    kind = "squared"

    def step(model: nn.Module) -> None:
        out = model(_X)
        if kind == "squared":
            loss = (out - 1.0) ** 2  # taken
        elif kind == "classes":
            loss = F.cross_entropy(out, _Y)
        else:
            raise ValueError(kind)
        loss.backward()

    advice = str(_error(tmp_path, "sentinel", step)["advice"])
    assert _line(step, "# taken") in advice and "cross_entropy" not in advice


def test_backward_on_an_unnamed_value_gets_the_general_reduction(tmp_path: Path) -> None:
    def step(model: nn.Module) -> None:
        model(_X).backward()

    advice = str(_error(tmp_path, "sentinel", step)["advice"])
    assert "a tensor of shape (16, 3)" in advice and "loss.mean().backward()" in advice


def test_the_reduced_loss_trains_with_nothing_to_report() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    with nanwatch.watch(model, mode="sentinel") as nw:
        for _ in range(3):
            out = model(_X)
            loss = ((out - 1.0) ** 2).mean()
            loss.backward()
            nw.step()
    assert nw.report.diagnoses == [] and nw.report.error is None
