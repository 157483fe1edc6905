"""A gradient born in the backward of a module's own code, between its children: default
watch mode names the autograd node and what it saved (the log of zeros behind
``torch.where(p > 0, p * p.log(), 0)``, a ``dot / den`` at den == 0) as it does for the loss
code, by running the module again and checking the backward of its own nodes -- only once
a gradient went bad."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch import ops

torch.set_num_threads(1)
HERE = os.path.basename(__file__)


def _line(fn: Callable[..., Any], marker: str) -> str:
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, text in enumerate(lines) if marker in text)
    return f"{HERE}:{start + offset}"


class Entropy(nn.Module):
    """Attention-style scores over a padded row, and the entropy of their softmax."""

    def __init__(self, valid: int) -> None:
        super().__init__()
        self.score = nn.Linear(8, 8)
        self.valid = valid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.score(x)
        p = s.masked_fill(torch.arange(8) >= self.valid, float("-inf")).softmax(-1)
        return -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1)  # entropy


class Cosine(nn.Module):
    """A cosine score 'made safe' with torch.where for a zero (padding) query."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)

    def forward(self, qx: torch.Tensor, cx: torch.Tensor) -> torch.Tensor:
        q, c = self.proj(qx), self.proj(cx)
        dot = (q * c).sum(-1)
        den = q.norm(dim=-1) * c.norm(dim=-1)
        return torch.where(den > 0, dot / den, torch.zeros_like(dot))  # cosine


def _run(model: nn.Module, *inputs: torch.Tensor) -> nanwatch.AnomalyError | None:
    try:
        with nanwatch.watch(model, postmortem=False):
            model(*inputs).mean().backward()
    except nanwatch.AnomalyError as e:
        return e
    return None


def test_where_hidden_log_of_zero_between_children_is_named() -> None:
    torch.manual_seed(0)
    err = _run(Entropy(valid=5), torch.randn(4, 8))
    assert err is not None
    d = err.diagnosis
    assert d.code == "NW110"
    op = err.anomaly.op
    assert op is not None and op.node == "MulBackward0" and op.path == "Entropy"
    assert op.cause is not None and op.cause.op == "aten.log"
    assert f"{_line(Entropy.forward, '# entropy')}" in (op.source or "")
    assert "log_softmax" in d.fix


def test_where_guarded_division_between_children_is_named() -> None:
    torch.manual_seed(0)
    qx = torch.randn(3, 4)
    qx[0] = 0.0  # a padding query: its projection is all zeros
    err = _run(Cosine(), qx, torch.randn(3, 4))
    assert err is not None
    d = err.diagnosis
    assert d.code == "NW111"
    op = err.anomaly.op
    assert op is not None and op.op == "aten.div" and op.node == "DivBackward0"
    assert _line(Cosine.forward, "# cosine") in (op.source or "")
    assert "dot / torch.where(den > 0, den, 1)" in d.fix


def test_healthy_twins_stay_silent_and_replay_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = ops.own_backward_event

    def counted(*a: Any, **k: Any) -> Any:
        calls.append(k.get("path", ""))
        return real(*a, **k)

    monkeypatch.setattr(ops, "own_backward_event", counted)
    torch.manual_seed(0)
    assert _run(Entropy(valid=8), torch.randn(4, 8)) is None
    assert _run(Cosine(), torch.randn(3, 4), torch.randn(3, 4)) is None
    assert calls == []


def test_own_backward_replay_writes_no_grad() -> None:
    torch.manual_seed(0)
    m = Entropy(valid=5)
    ev = ops.own_backward_event(m, (torch.randn(4, 8),), {}, path="ent")
    assert ev is not None and ev.node == "MulBackward0" and ev.path == "ent"
    assert all(p.grad is None for p in m.parameters())
