"""Overflow and inf-arithmetic fixes found by user testing: a float16 softmax by hand
subtracts the max over the dim a later line normalizes over; an empty mask filled with +inf
for a min (inf / inf) is guarded in the user's names, and a +inf fill's finite stand-in is
finfo.max."""

from __future__ import annotations

import ast

import torch
from torch import nn

from tests._diagnoses import code_lines
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


# ------------------------------ 1: exp on one line, normalized over dim 1 on the next


def _dice_probs(logits: torch.Tensor) -> torch.Tensor:
    e = torch.exp(logits)
    p = e / e.sum(1, keepdim=True)
    return p


def test_fp16_softmax_by_hand_subtracts_the_max_over_the_later_sums_dim() -> None:
    m = nn.Conv2d(2, 3, 1)
    with torch.no_grad():
        m.weight.fill_(8.0)
        m.bias.zero_()
    x = torch.ones(2, 2, 4, 6)

    def run() -> None:
        out = m(x).half()
        _dice_probs(out).float().sum().backward()

    d = _first(_raises(m, run, "forensic"), "NW101")
    first = d.fix.splitlines()[0].split("  #", 1)[0]
    assert first == "e = torch.exp(logits - logits.amax(dim=1, keepdim=True))", d.fix
    assert "dim=1" in d.fix.splitlines()[1]
    # pasted: finite probabilities (a max over the width axis underflows every class to 0)
    logits = m(x).half().detach()
    ns = {"torch": torch, "logits": logits}
    exec(first, ns)
    e = ns["e"]
    assert torch.isfinite(e / e.sum(1, keepdim=True)).all()


def _exp_only(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x)


def test_a_guessed_dim_says_so_and_does_not_promise_the_same_result() -> None:
    m = nn.Linear(3, 4)
    with torch.no_grad():
        m.weight.fill_(5.0)

    def run() -> None:
        e = _exp_only(m(torch.ones(2, 3)).half())
        (e / e.sum(0, keepdim=True)).float().sum().backward()

    d = _first(_raises(m, run, "forensic"), "NW101")
    ast.parse(code_lines(d.fix))
    assert "amax(dim=-1" in d.fix and "guess" in d.fix, d.fix
    assert "is the same" not in d.fix


# ------------------------------ 2: masked_fill(~mask, inf).amin(1) on an empty mask: inf / inf

_COORDS = torch.stack(
    [a.flatten() for a in torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")], 1
).float()


def _dist_map(mask: torch.Tensor) -> torch.Tensor:
    d = torch.cdist(_COORDS, _COORDS)
    d = d.masked_fill(~mask.flatten()[None, :], float("inf")).amin(1)
    return (d / d.max()).view(4, 4)


def test_an_empty_mask_filled_with_inf_for_a_min_is_guarded_in_the_users_names() -> None:
    m = nn.Linear(16, 16)
    mask = torch.zeros(4, 4, dtype=torch.bool)  # no foreground pixel on this slice

    def run() -> None:
        (m(torch.ones(1, 16)) * _dist_map(mask).flatten()).sum().backward()

    d = _first(_raises(m, run, "forensic"), "NW100")
    assert "inf / inf" in d.title
    assert "mask.any()" in d.explanation and "finfo(dtype).max" in d.explanation
    assert "-inf" not in d.explanation and "finfo(dtype).min, the most" not in d.explanation
    assert any("wrote +inf" in e and "amin" in e for e in d.evidence)
    first = code_lines(d.fix).splitlines()[0]
    assert first.startswith("return (d / d.max() if mask.any() else torch.zeros_like(d))")
    # pasted into the function: finite on the empty mask, unchanged on a kept one
    for keep in (mask, torch.eye(4, dtype=torch.bool)):
        dd = torch.cdist(_COORDS, _COORDS)
        dd = dd.masked_fill(~keep.flatten()[None, :], float("inf")).amin(1)
        ns = {"torch": torch, "d": dd, "mask": keep, "H": 4}
        exec(first.replace("return ", "out = ", 1), ns)
        assert torch.isfinite(ns["out"]).all()
        if keep.any():
            assert torch.equal(ns["out"], (dd / dd.max()).view(4, 4))
    alt = next(ln for ln in d.fix.splitlines() if "finfo" in ln)
    assert "torch.finfo(torch.float32).max" in alt
    ast.parse(alt.removeprefix("# or ").split("  #")[0].strip())


# ------------------------------ 3: any other +inf fill: finfo.max, never an empty fix


def _spread(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    s = x.masked_fill(~keep, float("inf"))
    return s - s.max()


def test_a_plus_inf_fill_is_told_finfo_max_and_the_fix_is_never_empty() -> None:
    m = nn.Linear(3, 4)
    keep = torch.tensor([[True, False, True, False]])

    def run() -> None:
        _spread(m(torch.ones(1, 3)), keep).sum().backward()

    d = _first(_raises(m, run, "forensic"), "NW100")
    assert "inf - inf" in d.title and d.fix.strip()
    assert "+inf" in d.explanation and "finfo(dtype).min, the most" not in d.explanation
    assert "s = x.masked_fill(~keep, torch.finfo(torch.float32).max)" in d.fix
    ast.parse(code_lines(d.fix))
