"""Loss code outside every module with several nodes whose backward can make a NaN from a
finite gradient (a focal loss's fractional power beside its log, a distance's sqrt beside
a log): sentinel names the node whose saved forward values sit where its derivative is
infinite, with its line, as watch does in the node's hook, not a generic NW100; and a loss
helper imported from another file is named by its own line, also when ``backward()`` is
called on its result directly (no local name holds the loss)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.records import LOSS_PATH
from tests import _focal_loss
from tests._focal_loss import focal

HERE = os.path.basename(__file__)


def _line(fn: Callable[..., Any], marker: str) -> str:
    """``file.py:N`` of the line of ``fn`` that holds ``marker``."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, text in enumerate(lines) if marker in text)
    return f"{os.path.basename(inspect.getsourcefile(fn) or '')}:{start + offset}"


def _local_focal(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    p = torch.sigmoid(logits)
    pt = torch.where(y > 0, p, 1 - p)
    return (-((1 - pt) ** 0.5) * torch.log(pt.clamp_min(1e-8))).mean()  # the power


def _confident() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A classifier whose sigmoid is exactly 1 in float32 on every row."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    with torch.no_grad():
        model[2].bias.fill_(30.0)
    x, y = torch.randn(32, 10), torch.ones(32)
    y[:4] = 0
    return model, x, y


def _train(model: nn.Module, loss_of: Callable[[], torch.Tensor], mode: str) -> nanwatch.Watcher:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            loss = loss_of()
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


def _named(nw: nanwatch.Watcher, node: str, line: str) -> None:
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.node == node
    assert a.op.path == LOSS_PATH
    assert a.op.source is not None and a.op.source.endswith(line)
    top = nw.history[0].diagnoses[0]
    assert top.code == "NW112", top.code
    assert any(e.startswith("at ") and line in e for e in top.evidence)


def test_sentinel_names_the_fractional_power_of_a_focal_loss_as_watch_does() -> None:
    model, x, y = _confident()
    nw = _train(model, lambda: _local_focal(model(x).squeeze(-1), y), "sentinel")
    _named(nw, "PowBackward0", _line(_local_focal, "# the power"))
    evidence = nw.history[0].diagnoses[0].evidence
    assert "backward input self: min 0, max 1 (28 exact zeros; 32 values)" in evidence


def test_sentinel_names_the_power_of_a_focal_loss_imported_from_another_file() -> None:
    model, x, y = _confident()
    nw = _train(model, lambda: focal(model(x).squeeze(-1), y), "sentinel")
    _named(nw, "PowBackward0", _line(_focal_loss.focal, "# the focal weight"))


def _distance(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    gap = torch.sqrt(((out - y) ** 2).sum(-1))  # the distance
    return gap.mean() - torch.log(torch.sigmoid(out).clamp_min(1e-8)).mean()


def test_sentinel_names_a_sqrt_at_zero_beside_a_log() -> None:
    # the rows the model already fits exactly: a distance of exactly 0, where the sqrt's
    # derivative is infinite; the log of a clamped sigmoid beside it is finite
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    x, y = torch.randn(8, 4), torch.zeros(8, 3)
    nw = _train(model, lambda: _distance(model(x), y), "sentinel")
    _named(nw, "SqrtBackward0", _line(_distance, "# the distance"))


def _train_unnamed(
    model: nn.Module, loss_of: Callable[[], torch.Tensor], mode: str
) -> nanwatch.Watcher:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            loss_of().backward()  # no name holds the loss
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_backward_on_an_imported_helpers_result_names_the_helpers_line(mode: str) -> None:
    model, x, y = _confident()
    nw = _train_unnamed(model, lambda: focal(model(x).squeeze(-1), y), mode)
    _named(nw, "PowBackward0", _line(_focal_loss.focal, "# the focal weight"))
