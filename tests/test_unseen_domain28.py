"""Domain fixes found by user testing: y * log(y / mu) with counts of 0 gets xlogy (0 · log 0
= 0), not "keep 0 out"; the sqrt-of-a-sum-of-squares template says its dim is a pattern; a
batch-of-one std fix quotes the eps its code adds."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


# ------------------------------ 1: a Poisson deviance y * log(y / mu), y a count that is 0


def _deviance_run(m: nn.Module) -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 4)
    y = torch.tensor([0.0, 1.0, 0.0, 3.0] * 4)
    mu = torch.exp(m(x).squeeze(-1))
    loss = 2 * (y * torch.log(y / mu) - y + mu).mean()
    loss.backward()


def test_a_deviance_with_zero_counts_gets_xlogy_on_the_users_line() -> None:
    m = nn.Linear(4, 1)
    d = _first(_raises(m, lambda: _deviance_run(m), "forensic"), "NW110")
    first = d.fix.splitlines()[0]
    assert first.startswith(
        "loss = 2 * (torch.xlogy(y, y) - torch.xlogy(y, mu) - y + mu).mean()   # "
    )
    assert "keep 0 out" not in d.fix and "0 · log 0 = 0" in d.fix
    # pasted, the value is finite and so is the gradient with respect to mu
    raw = torch.randn(16, requires_grad=True)
    ns: dict[str, Any] = {
        "torch": torch,
        "y": torch.tensor([0.0, 1.0, 0.0, 3.0] * 4),
        "mu": raw.exp(),
    }
    exec(first, ns)
    ns["loss"].backward()
    assert torch.isfinite(ns["loss"]) and raw.grad is not None and torch.isfinite(raw.grad).all()


def test_a_deviance_without_its_line_gets_the_xlogy_pattern() -> None:
    m = nn.Linear(4, 1)
    d = _first(_raises(m, lambda: _deviance_run(m), "sentinel"), "NW110")
    assert "keep 0 out" not in d.fix
    assert d.fix.startswith("term = torch.xlogy(y, y) - torch.xlogy(y, mu)   # a pattern")
    assert any("log <- div" in e for e in d.evidence)


def test_the_ratio_forms_of_a_kl_term_are_rewritten_in_the_users_names() -> None:
    from nanwatch.rules.domain import _xlogy_ratio_use

    cases = {
        "kl = (p * torch.log(p / q)).sum(-1)": (
            "kl = (torch.xlogy(p, p) - torch.xlogy(p, q)).sum(-1)"
        ),
        "d = torch.log(y / mu) * y": "d = torch.xlogy(y, y) - torch.xlogy(y, mu)",
        "kl = 3 * t * (torch.log(t) - logq)": None,  # (3 * t) multiplies: not t's own log
        "kl = (t * (t.log() - logq)).sum()": "kl = (torch.xlogy(t, t) - t * logq).sum()",
        "z = a * torch.log(b / c)": None,
    }
    for line, want in cases.items():
        use = _xlogy_ratio_use(line)
        got = use.fix.splitlines()[0].split("   #")[0] if use is not None else None
        assert got == want, line


# ------------------------------ 2: a sqrt of a sum of squares, line unknown: dim is a pattern


def test_the_norm_template_does_not_pick_a_dim_for_the_user() -> None:
    m = nn.Conv2d(2, 2, 1)
    with torch.no_grad():
        m.weight.zero_()
        m.bias.zero_()

    def run() -> None:
        d = m(torch.randn(2, 2, 3, 5))  # a (B, 2, H, W) flow error, all 0
        torch.sqrt((d**2).sum(dim=1)).mean().backward()

    d = _first(_raises(m, run), "NW112")
    first = d.fix.splitlines()[0]
    assert "a pattern" in first and "the dim your sum of squares runs over" in first


# ------------------------------ 5: a std over a batch of one: the comment quotes the code's eps


class _ZScore(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(0)) / (x.std(0) + 1e-6)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_batch_of_one_std_fix_quotes_the_eps_of_its_code() -> None:
    m = nn.Sequential(_ZScore(), nn.Linear(3, 1))

    def run() -> None:
        m(torch.randn(1, 3)).sum().backward()

    d = _first(_raises(m, run, "forensic"), "NW113")
    assert "(x.std(0, correction=0) + 1e-6)" in d.fix
    assert "+ 1e-6 keeps a division by it finite" in d.fix and "1e-5" not in d.fix


# ------------------------------ 4: a negative class probability of an ordinal head


class _CumLogit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(3, 1)
        self.b = nn.Parameter(torch.tensor([-1.0, 0.5, 0.2, 1.5]))  # not increasing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cum = torch.sigmoid(self.f(x) - self.b)  # P(y > k)
        ones = torch.ones_like(cum[:, :1])
        c = torch.cat([ones, cum, torch.zeros_like(ones)], 1)
        return c[:, :-1] - c[:, 1:]  # P(y = k)


def test_a_negative_difference_of_cumulative_probabilities_orders_the_thresholds() -> None:
    torch.manual_seed(0)
    m = _CumLogit()

    def run() -> None:
        p = m(torch.randn(32, 3))
        torch.log(p[:, 2]).mean().backward()  # class 2: sigmoid(f - 0.5) - sigmoid(f - 0.2) < 0

    d = _first(_raises(m, run, "forensic"), "NW110")
    assert "b = b0 + torch.cumsum(F.softplus(deltas), 0)" in d.fix
    assert "difference of two probabilities" in d.fix
    assert "a predicted positive quantity" not in d.fix
