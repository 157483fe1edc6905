"""Everyday loss code in sentinel mode (the default one users leave on) whose one risky
node is named by its kind alone, its saved values freed: the line that made it is still
told, from the names the user's frame holds, as watch tells it. An RMSE loss,
``torch.sqrt(F.mse_loss(out, y))``, on a batch the model fits exactly: the sqrt of 0 has an
infinite derivative, and its backward makes NaN."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import LOSS_PATH


def _line(fn: Callable[..., Any], marker: str) -> str:
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, text in enumerate(lines) if marker in text)
    return f"{os.path.basename(inspect.getsourcefile(fn) or '')}:{start + offset}"


def _rmse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(F.mse_loss(out, y))  # the root


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_an_rmse_at_a_perfect_fit_is_named_by_its_sqrt_line(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x = torch.randn(8, 4)
    with torch.no_grad():
        y = model(x)  # targets the model already hits exactly
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            loss = _rmse(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    a = nw.first_anomaly
    line = _line(_rmse, "# the root")
    assert a is not None and a.op is not None
    assert (a.op.node, a.op.path) == ("SqrtBackward0", LOSS_PATH)
    assert a.op.source is not None and a.op.source.endswith(line), a.op.source
    top = nw.history[0].diagnoses[0]
    assert top.code == "NW112"
    assert any(e.startswith("at ") and line in e for e in top.evidence), top.evidence
