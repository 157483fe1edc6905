"""Domain fixes found by user testing: a log of a subnormal value is named as one (its
gradient overflows; a sum of exps goes to logsumexp), a line with two log(1 - q) floors
both, a difference of two groups' means is skipped when a group is empty and a sum of
means falls back to sums in the user's names, and a saturated propensity is clipped."""

from __future__ import annotations

import ast
import math

import torch
from torch import nn

from tests._diagnoses import code_lines, text
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


# ------------------------------ 1: log of a subnormal mixture density: 1/x overflows


class _Mixture(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.1, 13.92]))  # exp(-0.5 * 13.92²) is subnormal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w * x
        p1 = torch.exp(-0.5 * w**2)
        p2 = torch.exp(-50.0 * w**2)
        return -torch.log(0.5 * p1 + 0.5 * p2).sum()


def test_log_of_a_subnormal_is_not_called_a_log_of_zero_and_the_mixture_goes_to_logsumexp() -> None:
    m = _Mixture()
    assert torch.isfinite(m(torch.ones(2)))  # the forward log is finite

    def run() -> None:
        m(torch.ones(2)).backward()

    for mode in ("watch", "forensic"):
        d = _first(_raises(m, run, mode), "NW110")
        said = text(d)
        assert "subnormal" in said and "4.2e-43" in said
        assert "of 0 is -inf" not in said and "inf at 0" not in said
        assert "overflows float32" in said
    fix = d.fix  # forensic: the line is known
    assert "torch.logsumexp(torch.stack([-0.5 * w**2 + math.log(0.5)" in fix
    ast.parse(code_lines(fix))
    w = m.w.detach().clone().requires_grad_(True)
    ns = {"torch": torch, "math": math, "w": w}
    exec(code_lines(fix).replace("return ", "out = ", 1), ns)
    ns["out"].backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()


# ------------------------------ 2: log(1 - exp(a)) - log(1 - exp(b)): floor both


class _Odds(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        lc, lr = z[0], z[1]
        return (lc - lr) - (torch.log(1 - torch.exp(lc)) - torch.log(1 - torch.exp(lr)))


def test_two_one_minus_logs_both_get_the_floor_and_log1mexp_is_named() -> None:
    lin = nn.Linear(3, 2)
    with torch.no_grad():
        lin.weight.zero_()
        lin.bias.copy_(torch.tensor([-0.5, 0.0]))  # lr = 0: 1 - exp(lr) = 0
    m = nn.Sequential(lin, _Odds())

    def run() -> None:
        m(torch.ones(3)).backward()

    d = _first(_raises(m, run, "forensic"), "NW110")
    assert "torch.log((1 - torch.exp(lr)).clamp_min(" in d.fix
    assert "torch.log((1 - torch.exp(lc)).clamp_min(" in d.fix
    assert "torch.log1p(-torch.exp(y))" in d.fix and "lr.clamp_max(-1e-6)" in d.fix
    ast.parse(code_lines(d.fix))


# ------------------------------ 3: a mean over an empty group


class _Ipm(nn.Module):
    def forward(self, r: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        ipm = ((r[t == 1].mean(0) - r[t == 0].mean(0)) ** 2).sum()
        return ipm


class _TwoMeans(nn.Module):
    def forward(self, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        loss = chosen.mean() + rejected.mean()
        return loss


def test_a_difference_of_two_groups_means_is_skipped_when_a_group_is_empty() -> None:
    lin, ipm = nn.Linear(3, 4), _Ipm()
    t = torch.zeros(5)  # no treated unit

    def run() -> None:
        ipm(lin(torch.randn(5, 3)), t).backward()

    d = _first(_raises(nn.ModuleList([lin, ipm]), run, "forensic"), "NW113")
    assert "if (t == 1).any() and (t == 0).any() else r.new_zeros(())" in d.fix
    assert "x * mask" not in d.fix and "wrong penalty" in d.fix
    r = torch.randn(5, 4)
    ns = {"r": r, "t": t}
    exec(code_lines(d.fix).split("\n")[0], ns)
    assert float(ns["ipm"]) == 0.0


def test_a_sum_of_means_falls_back_to_sums_in_the_users_names() -> None:
    lin, two = nn.Linear(3, 1), _TwoMeans()

    def run() -> None:
        y = lin(torch.randn(4, 3)).squeeze(-1)
        two(y, y[y > 1e9]).backward()  # nothing rejected this batch

    d = _first(_raises(nn.ModuleList([lin, two]), run, "forensic"), "NW113")
    assert "(rejected.mean() if rejected.numel() else rejected.sum())" in d.fix
    assert "x * mask" not in d.fix
    ns = {"chosen": torch.ones(3), "rejected": torch.ones(0)}
    exec(code_lines(d.fix), ns)
    assert float(ns["loss"]) == 1.0


# ------------------------------ 4: inverse-propensity weights: clip the propensity


class _Ipw(nn.Module):
    def forward(self, logit: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
        e = torch.sigmoid(logit)
        w = T / e + (1 - T) / (1 - e)
        return w.mean()


def test_a_saturated_propensity_is_clipped_not_divided_by_one() -> None:
    lin, ipw = nn.Linear(3, 1), _Ipw()
    with torch.no_grad():
        lin.weight.zero_()
        lin.bias.fill_(40.0)  # sigmoid(40) = 1.0 in float32
    T = torch.tensor([1.0, 0.0, 1.0])

    def run() -> None:
        ipw(lin(torch.ones(3, 3)).squeeze(-1), T).backward()

    d = _first(_raises(nn.ModuleList([lin, ipw]), run, "forensic"), "NW111")
    assert "e_clip = e.clamp(1e-3, 1 - 1e-3)" in d.fix
    assert "w = T / e_clip + (1 - T) / (1 - e_clip)" in d.fix
    assert "positivity" in d.fix and "0/0 gives 0" not in d.fix
    ns = {"e": torch.ones(3), "T": T}
    exec(code_lines(d.fix), ns)
    assert torch.isfinite(ns["w"]).all() and float(ns["w"].max()) > 100
