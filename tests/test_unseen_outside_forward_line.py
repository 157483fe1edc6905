"""A backward op of loss code run outside every module's forward, in a function that the
statement holding the loss called (a model's penalty method, called from a step function),
is named by the line that created its node, found by data flow into the called code, not by
the ``backward()`` call; where two lines could have made it, the ``backward()`` call stands."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import LOSS_PATH

HERE = os.path.basename(__file__)


def _line(fn: Callable[..., Any], marker: str) -> str:
    """``file.py:N`` of the line of ``fn`` that holds ``marker``."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, text in enumerate(lines) if marker in text)
    return f"{HERE}:{start + offset}"


class _TiedDecoder(nn.Module):
    """Tied input and output embeddings; row 0 (padding) of the table is zeros."""

    def __init__(self, smooth: bool = False) -> None:
        super().__init__()
        self.smooth = smooth
        self.table = nn.Embedding(12, 6, padding_idx=0)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 12, bias=False)
        self.head.weight = self.table.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.body(self.table(ids))))
        return out

    def row_norms(self) -> torch.Tensor:
        w = self.head.weight
        if self.smooth:  # not run: a sqrt of another operand, which is not the node's
            return torch.sqrt(w.pow(2).sum(-1) + 1e-8).mean()
        return torch.sqrt(w.pow(2).sum(-1)).mean()  # the penalty


class _TwinDecoder(_TiedDecoder):
    def row_norms(self) -> torch.Tensor:
        w = self.head.weight
        if self.smooth:  # not run, but it writes the same sqrt: which line ran is not told
            return torch.sqrt(w.pow(2).sum(-1)).amax()
        return torch.sqrt(w.pow(2).sum(-1)).mean()


def _setup(kind: type[_TiedDecoder] = _TiedDecoder) -> tuple[nn.Module, Callable[[], Any]]:
    torch.manual_seed(0)
    model = kind()
    ids, tgt = torch.randint(1, 12, (3, 4)), torch.randint(1, 12, (3, 4))

    def step() -> torch.Tensor:
        logits = model(ids)
        return F.cross_entropy(logits.flatten(0, 1), tgt.flatten()) + 0.1 * model.row_norms()

    return model, step


def _run(model: nn.Module, step: Callable[[], torch.Tensor]) -> Any:
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        loss = step()
        loss.backward()  # the backward call
        nw.step()
    return nw


def test_the_sqrt_line_of_a_penalty_method_called_outside_forward_is_named() -> None:
    model, step = _setup()
    nw = _run(model, step)
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.node == "SqrtBackward0"
    assert a.op.path == LOSS_PATH
    assert a.op.backward_at is not None and a.op.backward_at.endswith(_line(_run, "# the backward"))
    penalty = _line(_TiedDecoder.row_norms, "# the penalty")
    assert a.op.source is not None and a.op.source.endswith(penalty)
    top = nw.history[0].diagnoses[0]
    assert top.code == "NW112"
    assert any(e.startswith("at ") and penalty in e for e in top.evidence)
    # the user's line rewritten, not a list of patterns
    assert top.fix.splitlines()[0].startswith("return torch.sqrt(w.pow(2).sum(-1) + ")


def test_two_lines_that_could_have_made_the_node_leave_the_backward_call() -> None:
    model, step = _setup(_TwinDecoder)
    nw = _run(model, step)
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.node == "SqrtBackward0"
    assert a.op.source is not None and a.op.source.endswith(_line(_run, "# the backward"))


def _spread(w: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(w.pow(2).sum(-1)).std()  # made of the zero row: the NaN's op


class _ListedTerms(_TiedDecoder):
    """The penalty's terms are picked from a list: which code ran, the reading cannot tell."""

    def __init__(self) -> None:
        super().__init__()
        self.terms = [_spread]

    def row_norms(self) -> torch.Tensor:
        w = self.head.weight
        finite = torch.sqrt(w[1:].pow(2).sum(-1)).mean()  # rows 1.. are not zero
        return finite + self.terms[0](w)


def test_a_call_the_reading_cannot_follow_leaves_the_backward_call() -> None:
    model, step = _setup(_ListedTerms)
    nw = _run(model, step)
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.node == "SqrtBackward0"
    assert a.op.source is not None and a.op.source.endswith(_line(_run, "# the backward"))
