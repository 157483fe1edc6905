"""Guards found by user testing on two-hot targets and replay buffers: a NaN probability
target is named as NaN, not "outside [0, 1]"; ignore_index is not quoted for probability
targets; a fix rewrites only the statement that calls the loss (not an ``if flag:`` before
it); a two-hot target extrapolated past its bins is repaired where it is made, never by a
softmax; a -1 that fills most of a batch sampled from a buffer is named as its unfilled
slots before ignore_index is offered."""

from __future__ import annotations

import ast
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests._diagnoses import code_lines

torch.set_num_threads(1)

BINS = torch.linspace(-5, 5, 41)


def _two_hot(x: torch.Tensor, fixed: bool = False) -> torch.Tensor:
    """A distributional head's target: weights on the two bins around ``x``."""
    if fixed:
        x = x.clamp(BINS[0], BINS[-1])
    above = torch.searchsorted(BINS, x).clamp(1 if fixed else 0, len(BINS) - 1)
    below = (above - 1).clamp(0, len(BINS) - 1)
    w_above = (x - BINS[below]) / (BINS[above] - BINS[below])
    return (
        F.one_hot(below, len(BINS)) * (1 - w_above)[..., None]
        + F.one_hot(above, len(BINS)) * w_above[..., None]
    )


def _ce_error(target: torch.Tensor, use_ce: bool = True) -> nanwatch.GuardError:
    logits = torch.randn(target.shape[0], target.shape[1])
    nw = nanwatch.watch(nn.Identity(), postmortem=False)
    with pytest.raises(nanwatch.GuardError) as info, nw:
        if use_ce: loss = F.cross_entropy(logits, target)  # fmt: skip # noqa: E701, F841
    return info.value


def _no_softmax_no_ignore(err: nanwatch.GuardError) -> None:
    assert err.fix is not None
    assert "softmax" not in err.fix and "ignore_index" not in str(err)
    assert "if use_ce" not in err.fix
    ast.parse(err.fix)  # valid Python (a comment that says where to repair)


# ------------------------------ 1: two-hot targets


def test_a_nan_two_hot_target_is_named_nan_and_repaired_where_it_is_made() -> None:
    torch.manual_seed(0)
    r = torch.randn(8) * 2
    r[5] = -300.0  # below the first bin: both indices 0, bin width 0 -> NaN weights
    target = _two_hot(r)
    err = _ce_error(target)
    msg = str(err)
    assert err.code == "NW511"
    assert "target holds NaN at 41 positions (of 328, in 1 row of 8)" in msg
    assert "min nan" not in msg and "outside [0, 1] at" not in msg
    assert "two-hot" in msg and "width, 0" in msg
    _no_softmax_no_ignore(err)
    assert "clamp the value into the bins' range before the two-hot encoding" in err.fix
    # applying it (clamp, indices kept apart) leaves a finite target in range
    fixed = _two_hot(r, fixed=True)
    with nanwatch.watch(nn.Identity(), postmortem=False):
        assert bool(torch.isfinite(F.cross_entropy(torch.randn(8, 41), fixed)))


def test_an_extrapolated_two_hot_target_is_not_softmaxed() -> None:
    torch.manual_seed(0)
    r = torch.randn(8) * 2
    r[3] = 5.7  # beyond the last bin: weights 3.8 and -2.8
    err = _ce_error(_two_hot(r))
    msg = str(err)
    assert err.code == "NW511"
    assert "outside [0, 1] at 2 positions (of 328, in 1 row of 8; min -2.8, max 3.8)" in msg
    assert "sum to 1 over two adjacent classes (39, 40)" in msg
    assert "beyond the last bin" in msg
    _no_softmax_no_ignore(err)
    assert "value.clamp(bins[0], bins[-1])" in err.fix
    with nanwatch.watch(nn.Identity(), postmortem=False):
        F.cross_entropy(torch.randn(8, 41), _two_hot(r, fixed=True))


def test_a_mixture_outside_its_range_says_the_rows_sum_to_one() -> None:
    y1 = F.one_hot(torch.tensor([0, 1, 2, 3]), 6).float()
    y2 = F.one_hot(torch.tensor([5, 4, 5, 0]), 6).float()
    lam = 1.5  # a mixup weight outside [0, 1]
    err = _ce_error(lam * y1 + (1 - lam) * y2)
    assert err.code == "NW511"
    assert "sum to 1 but hold weights outside [0, 1]" in str(err)
    _no_softmax_no_ignore(err)


def test_a_score_target_fix_rewrites_only_the_statement_that_calls_the_loss() -> None:
    scores = torch.tensor([[2.0, -1.0, 0.5], [0.1, 3.0, -2.0]])
    err = _ce_error(scores)
    assert err.code == "NW511" and err.fix is not None
    assert "ignore_index" not in str(err)
    call = code_lines(err.fix).split("  #")[0]
    assert call == "loss = F.cross_entropy(logits, target.softmax(dim=1))"
    ns: dict[str, Any] = {"F": F, "logits": torch.randn(2, 3), "target": scores}
    with nanwatch.watch(nn.Identity(), postmortem=False):
        exec(call, ns)
    assert bool(torch.isfinite(ns["loss"]))


# ------------------------------ 2: a replay buffer's empty slots hold -1


def test_a_buffer_sampled_past_its_filled_slots_is_named_before_ignore_index() -> None:
    torch.manual_seed(0)
    model, crit = nn.Linear(4, 3), nn.CrossEntropyLoss()
    cap, n_seen = 50, 4
    buf_x = torch.zeros(cap, 4)
    buf_y = torch.full((cap,), -1, dtype=torch.long)
    buf_x[:n_seen], buf_y[:n_seen] = torch.randn(n_seen, 4), torch.tensor([0, 1, 2, 1])
    idx = torch.randint(0, cap, (16,))
    with pytest.raises(nanwatch.GuardError) as info, nanwatch.watch(model, crit, postmortem=False):
        crit(model(buf_x[idx]), buf_y[idx])
    err = info.value
    msg = str(err)
    assert err.code == "NW501"
    n = int((buf_y[idx] == -1).sum())
    assert f"-1 fills {n} of 16 positions: it may mark unfilled slots" in msg
    assert "buf_y holds -1 in its slots 4..49, never filled" in msg
    assert "idx is made at test_unseen_guards11.py:" in msg
    assert msg.index("sample only filled entries") < msg.index("ignore_index=-1 would")
    assert "a batch of only -1 then has a NaN mean" in msg
    assert err.fix is not None
    ast.parse(err.fix)
    first, second = err.fix.splitlines()
    assert first.startswith("# sample only the filled slots of buf_y: idx = torch.randint(")
    assert second.startswith("crit = nn.CrossEntropyLoss(ignore_index=-1)  # only if -1")
    # applying the first: sampling the filled slots only passes
    idx = torch.randint(0, min(n_seen, cap), (16,))
    with nanwatch.watch(model, crit, postmortem=False):
        crit(model(buf_x[idx]), buf_y[idx])


def test_a_few_minus_ones_still_ask_for_ignore_index() -> None:
    model, crit = nn.Linear(4, 3), nn.CrossEntropyLoss()
    y = torch.tensor([0, 1, 2, -1, 1, 0, 2, 1])
    with pytest.raises(nanwatch.GuardError) as info, nanwatch.watch(model, crit, postmortem=False):
        crit(model(torch.randn(8, 4)), y)
    err = info.value
    assert err.code == "NW501" and "did you mean ignore_index=-1?" in str(err)
    assert "unfilled" not in str(err)
    assert err.fix == "crit = nn.CrossEntropyLoss(ignore_index=-1)"
