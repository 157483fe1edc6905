"""Division fixes found by user testing: a line with several divisions rewrites the one
whose divisor can be 0 (or guards each when the zeros cannot tell them apart), not a
template in names the user never wrote; a mean over a mask that selected nothing is called
an empty selection (NW113) and its count is floored at 1, not at an eps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests._diagnoses import code_lines, text
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


# ------------------------------ 1: several divisions on the line: the one that can be 0


class _Squash(nn.Module):
    def forward(self, s: torch.Tensor) -> torch.Tensor:
        sq = (s**2).sum(dim=-1, keepdim=True)
        norm = torch.sqrt(sq)
        return (sq / (1 + sq)) * s / norm


def test_squash_with_two_divisions_fixes_the_norm_not_a_template() -> None:
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Unflatten(1, (2, 4)), _Squash())
    with torch.no_grad():
        m[0].bias[:4].fill_(-50.0)  # the first capsule is 0: 0/0

    def run() -> None:
        m(torch.rand(3, 4)).sum().backward()

    d = _first(_raises(m, run, "forensic"), "NW111")
    assert "only norm can be 0" in text(d) and "1 + sq" in text(d)
    assert "d.dtype" not in d.fix and "y = x /" not in d.fix
    fixed = code_lines(d.fix)
    assert fixed.startswith("norm = torch.sqrt(sq + 1e-8)")
    s = torch.zeros(2, 4, requires_grad=True)
    ns = {"torch": torch, "sq": (s**2).sum(-1, keepdim=True)}
    exec(compile(fixed, "<fix>", "exec"), ns)
    v = (ns["sq"] / (1 + ns["sq"])) * s / ns["norm"]
    v.sum().backward()
    assert torch.isfinite(v).all() and s.grad is not None and torch.isfinite(s.grad).all()


class _Ratio(nn.Module):
    def forward(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (a / (2.0 + a**2)) * a / w


def test_a_divisor_that_cannot_be_zero_is_passed_over_and_the_other_clamped() -> None:
    m = _Ratio()
    a, w = torch.tensor([0.0, 1.0]), torch.tensor([0.0, 2.0])
    d = _first(_raises(m, lambda: m(a, w), "forensic"), "NW111")
    fixed = code_lines(d.fix)
    assert "/ w.clamp_min(torch.finfo(w.dtype).eps)" in fixed
    assert "(2.0 + a**2)" in fixed and "d.dtype" not in fixed
    out = eval(fixed.split("return ", 1)[1].split("  #")[0], {"torch": torch, "a": a, "w": w})
    assert torch.isfinite(out).all()


class _Knots(nn.Module):
    def forward(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        b = (x - g[:-2]) / (g[1:-1] - g[:-2]) * x + (g[2:] - x) / (g[2:] - g[1:-1]) * x
        return b


@pytest.mark.parametrize("knots", [[0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 2.0]])
def test_two_divisions_that_both_can_be_zero_are_each_guarded(knots: list[float]) -> None:
    m = _Knots()
    g = torch.tensor(knots)  # repeated knots: differences of 0
    x = torch.zeros(3)
    d = _first(_raises(m, lambda: m(x, g), "forensic"), "NW111")
    assert "do not say which one" in text(d)
    fixed = code_lines(d.fix)
    assert fixed.count("torch.where(") == 2 and "d.dtype" not in fixed
    ns = {"torch": torch, "x": x, "g": g}
    exec(compile(fixed, "<fix>", "exec"), ns)
    assert torch.isfinite(ns["b"]).all()


# ------------------------------ 2: a mean over a mask that selected nothing


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_a_mean_over_an_empty_mask_is_an_empty_selection(mode: str) -> None:
    m = nn.Linear(3, 2)
    x, y = torch.rand(4, 3), torch.rand(4, 2)

    def run() -> None:
        out = m(x)
        keep = (y > 5).float()
        loss = ((out - y) ** 2 * keep).sum() / keep.sum()
        loss.backward()

    d = _first(_raises(m, run, mode), "NW113")
    assert "mask keep" in text(d) and "selected nothing" in text(d)
    assert "keep.sum().clamp_min(1)" in d.fix and "eps" not in d.fix
    fixed = code_lines(d.fix)
    out = m(x)
    keep = (y > 5).float()
    ns = {"out": out, "y": y, "keep": keep}
    exec(compile(fixed, "<fix>", "exec"), ns)
    assert torch.isfinite(ns["loss"]).all()


# ------------------------------ 3: an attribute made as a division by 0 is named there


class _Adapter(nn.Module):
    def __init__(self, r: object, alpha: float = 16.0) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.zeros(1, 4))
        self.B = nn.Parameter(torch.zeros(4, 1))
        self.scaling = alpha / r  # type: ignore[operator]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (x @ self.A.t() @ self.B.t()) * self.scaling


def test_an_attribute_divided_by_zero_is_named_where_it_is_made() -> None:
    import numpy as np

    with np.errstate(divide="ignore"):
        m = _Adapter(np.int64(0), alpha=np.float64(16.0))  # type: ignore[arg-type]
    d = _first(_raises(m, lambda: m(torch.rand(2, 4))), "NW111")
    assert "self.scaling = alpha / r" in d.title and "r is 0" in d.title
    assert "min(self.scaling" not in d.fix and "1 / (1 - p)" not in d.fix
    assert code_lines(d.fix).startswith("assert r != 0")
    compile(code_lines(d.fix), "<fix>", "exec")
