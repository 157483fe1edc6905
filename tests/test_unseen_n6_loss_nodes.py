"""Loss code with several nodes whose backward can make a NaN from a finite gradient, two
of them at the point where their derivative is infinite: sentinel names the one whose
backward runs first (the one made last in forward), with its saved values and its line,
as watch does in each node's hook, not a generic NW100 or the ``backward()`` line. The
everyday forms: a hand-written BCE over ``torch.where`` whose probabilities reach exactly 0
and 1 in different rows, a distance's sqrt beside a log, ``log1p(-p)`` at p == 1, and a
group-lasso penalty on a weight beside its norm (the parameter's gradient is the first
bad value: no watched output lies between)."""

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
    """``file.py:N`` of the line of ``fn`` that holds ``marker``."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, text in enumerate(lines) if marker in text)
    return f"{os.path.basename(inspect.getsourcefile(fn) or '')}:{start + offset}"


def _sure() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A classifier whose sigmoid is exactly 0 on the 16 negative rows and exactly 1 on
    the 16 positive ones, in float32: right, and sure of it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    x, y = torch.randn(32, 10), torch.ones(32)
    y[:16] = 0
    x[:16, 0], x[16:, 0] = -1.0, 1.0
    with torch.no_grad():
        for layer in (model[0], model[2]):
            layer.weight.zero_()
            layer.bias.zero_()
        model[0].weight[0, 0], model[0].weight[1, 0] = 1.0, -1.0
        model[2].weight[0, 0], model[2].weight[0, 1] = 200.0, -200.0
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


def _named(nw: nanwatch.Watcher, node: str, line: str, code: str) -> list[str]:
    a = nw.first_anomaly
    assert a is not None and a.op is not None, a
    assert (a.op.node, a.op.path) == (node, LOSS_PATH)
    assert a.op.source is not None and a.op.source.endswith(line), a.op.source
    top = nw.history[0].diagnoses[0]
    assert top.code == code, (top.code, top.evidence)
    assert any(e.startswith("at ") and line in e for e in top.evidence), top.evidence
    return top.evidence


def _bce_by_hand(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    p = torch.sigmoid(logits)
    pos = torch.log(p)  # the positives' log
    neg = torch.log(1 - p)  # the negatives' log
    return -torch.where(y > 0, pos, neg).mean()


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_a_hand_written_bce_at_0_and_1_names_the_log_whose_backward_runs_first(
    mode: str,
) -> None:
    # log(p) at p == 0 on the negatives, log(1 - p) at 0 on the positives: both logs'
    # backward make 0 / 0 where torch.where gave them a 0 gradient; log(1 - p), made
    # last, runs first
    model, x, y = _sure()
    nw = _train(model, lambda: _bce_by_hand(model(x).squeeze(-1), y), mode)
    evidence = _named(nw, "LogBackward0", _line(_bce_by_hand, "# the negatives' log"), "NW110")
    assert "input (float32): min 0, max 1 (16 exact zeros; 32 values)" in evidence


def _distance_and_log(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    p = torch.sigmoid(logits)
    gap = torch.sqrt((p - y) ** 2)  # the distance
    ll = torch.where(y > 0, torch.log(p), 0.0)  # the log
    return gap.mean() - ll.mean()


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_a_sqrt_and_a_log_both_at_their_edge_name_the_one_that_runs_first(mode: str) -> None:
    # the sqrt of a distance of exactly 0 on every row, the log of p == 0 that the where
    # discards on the negatives: sentinel said NW100, the two nodes' kinds alone
    model, x, y = _sure()
    nw = _train(model, lambda: _distance_and_log(model(x).squeeze(-1), y), mode)
    _named(nw, "LogBackward0", _line(_distance_and_log, "# the log"), "NW110")


def _bce_log1p(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    p = torch.sigmoid(logits)
    return -torch.where(y > 0, torch.log(p), torch.log1p(-p)).mean()  # both logs


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_log1p_at_minus_one_is_named_as_the_log_at_its_edge(mode: str) -> None:
    # log1p(-p) at p == 1 (made after log(p), so its backward runs first): a node of the
    # kind that can make a NaN from a finite gradient, at -1, not below it
    model, x, y = _sure()
    nw = _train(model, lambda: _bce_log1p(model(x).squeeze(-1), y), mode)
    evidence = _named(nw, "Log1PBackward0", _line(_bce_log1p, "# both logs"), "NW110")
    assert evidence[0] == (
        "in backward, aten.log1p's gradient grad / (1 + x) is 0 / 0 = NaN: its input's "
        "minimum is -1 (none below), and the gradient arriving there is 0 (the forward's "
        "-inf was discarded, by a torch.where or a mask)"
    )
    assert evidence[-1] == (
        "in backward (autograd node Log1PBackward0): d/dx log1p(x) = 1/(1 + x) is inf at -1"
    )


def _lasso_and_norm(model: nn.Module, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    w = model[0].weight
    rows = torch.sqrt((w**2).sum(1)).sum()  # the group lasso
    return F.mse_loss(out, y) + 1e-3 * rows + 1e-3 * w.norm()


def _rows_and_columns(model: nn.Module, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    w = model[0].weight
    rows = torch.sqrt((w**2).sum(1)).sum()  # the rows
    cols = ((w**2).sum(0) ** 0.5).sum()  # the columns
    return F.mse_loss(out, y) + 1e-3 * (rows + cols)


def _pruned() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A model whose first weight has a row and a column of exact zeros (pruned units)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight[2].zero_()
        model[0].weight[:, 3].zero_()
    return model, torch.randn(16, 6), torch.randn(16, 1)


@pytest.mark.parametrize(
    ("penalty", "node", "marker"),
    [
        (_lasso_and_norm, "SqrtBackward0", "# the group lasso"),
        (_rows_and_columns, "PowBackward0", "# the columns"),
    ],
)
@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_a_penalty_on_a_weight_with_two_risky_nodes_names_the_one_at_its_edge(
    mode: str, penalty: Callable[..., torch.Tensor], node: str, marker: str
) -> None:
    # the weight's gradient is the first bad value; of the loss code's risky nodes on the
    # way to it (the sqrt of each row's norm, the whole weight's norm; or the rows' sqrt
    # and the columns' power, both at 0), the one at its edge that runs first is named
    model, x, y = _pruned()
    nw = _train(model, lambda: penalty(model, model(x), y), mode)
    _named(nw, node, _line(penalty, marker), "NW112")
