"""The forms a training loop differentiates a loss in, besides ``loss.backward()``: a loss
made by a helper in another file and passed straight to ``torch.autograd.backward`` (alone
or in a list), to an ``Accelerator``-like object's ``backward`` (a library's method that
calls ``loss.backward()``), or scaled first (``scaler.scale(...).backward()``): the node
that made the NaN is named by the helper's line, as for ``focal(...).backward()``, not by
the ``backward`` line."""

from __future__ import annotations

import inspect
import operator
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


def _line(fn: Callable[..., Any], marker: str) -> str:
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, text in enumerate(lines) if marker in text)
    return f"{os.path.basename(inspect.getsourcefile(fn) or '')}:{start + offset}"


def _confident() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A classifier whose sigmoid is exactly 1 in float32 on every row."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    with torch.no_grad():
        model[2].bias.fill_(30.0)
    x, y = torch.randn(32, 10), torch.ones(32)
    y[:4] = 0
    return model, x, y


class _Accelerator:
    """What ``accelerate.Accelerator.backward(loss)`` does on one device: library code
    (here no Python code at all) that calls ``loss.backward()``."""

    backward = staticmethod(operator.methodcaller("backward"))


def _step(form: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    if form == "autograd.backward":
        torch.autograd.backward(focal(model(x).squeeze(-1), y))
    elif form == "autograd.backward([...])":
        torch.autograd.backward([focal(model(x).squeeze(-1), y)])
    elif form == "accelerator.backward":
        accelerator = _Accelerator()
        accelerator.backward(focal(model(x).squeeze(-1), y))
    else:
        raise AssertionError(form)


@pytest.mark.parametrize(
    "form", ["autograd.backward", "autograd.backward([...])", "accelerator.backward"]
)
@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_a_helpers_loss_passed_to_backward_is_named_by_the_helpers_line(
    mode: str, form: str
) -> None:
    model, x, y = _confident()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            _step(form, model, x, y)
            opt.step()
            opt.zero_grad()
            nw.step()
    a = nw.first_anomaly
    line = _line(_focal_loss.focal, "# the focal weight")
    assert a is not None and a.op is not None
    assert (a.op.node, a.op.path) == ("PowBackward0", LOSS_PATH)
    assert a.op.source is not None and a.op.source.endswith(line), a.op.source
    top = nw.history[0].diagnoses[0]
    assert top.code == "NW112"
    assert any(e.startswith("at ") and line in e for e in top.evidence), top.evidence
