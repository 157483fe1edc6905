"""Domain diagnoses found by user testing (learned compression, Gumbel sampling): a
likelihood made as a difference of CDFs is floored, not blamed on a ReLU of the same size;
a float16 floor that rounds to 0 is named; a tiny nonzero Python divisor in float16 is an
overflow; a root of a weighted sum of squares is clamped and its weights named; a power of
stacked values clamps the base in the user's names; a divisor read by several lines is
floored once."""

from __future__ import annotations

import ast
import math

import torch
from torch import nn

from tests._diagnoses import code_lines
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


def _parses(fix: str) -> None:
    ast.parse(code_lines(fix))


# ------------------------------ 1: a likelihood cdf(v + .5) - cdf(v - .5) that underflowed


def _cdf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * torch.erfc(-(2**-0.5) * x)


class _Conditional(nn.Module):
    def __init__(self, floor: float | None = None) -> None:
        super().__init__()
        self.floor = floor

    def forward(self, y: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        v = torch.abs(y)
        lik = _cdf((0.5 - v) / scales) - _cdf((-0.5 - v) / scales)
        return lik if self.floor is None else lik.clamp_min(self.floor)


class _Hyper(nn.Module):
    """A scale head ending in a ReLU (its output unmeasured) of the likelihood's size."""

    def __init__(self, floor: float | None = None) -> None:
        super().__init__()
        self.h = nn.Sequential(nn.Linear(6, 6), nn.ReLU())
        self.cond = _Conditional(floor)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.cond(y, self.h(y).clamp_min(0.11))


class _Rate(nn.Module):
    def forward(self, lik: torch.Tensor) -> torch.Tensor:
        return torch.log(lik).sum() / (-math.log(2) * lik.numel())


def _latents() -> torch.Tensor:
    y = torch.randn(4, 6) * 0.3
    y[0, :3] = 40.0  # far in the tail: both CDFs underflow to 0
    return y


def test_a_likelihood_difference_of_cdfs_is_floored_not_blamed_on_a_relu() -> None:
    torch.manual_seed(0)
    m, rate = _Hyper(), _Rate()
    y = _latents()

    def run() -> None:
        rate(m(y)).backward()

    d = _first(_raises(nn.ModuleList([m, rate]), run), "NW110")
    assert "ReLU" not in d.fix and "softplus" not in d.fix
    assert "subtraction" in " ".join(d.evidence)
    assert "torch.log(lik.clamp_min(1e-09))" in d.fix
    _parses(d.fix)
    with torch.no_grad():
        lik = m(y)
        assert torch.isfinite(torch.log(lik.clamp_min(1e-09))).all()


def test_a_float16_floor_that_rounds_to_0_is_named_and_the_bound_is_float32() -> None:
    torch.manual_seed(0)
    m, rate = _Hyper(floor=1e-9).half(), _Rate()
    y = _latents().half()

    def run() -> None:
        rate(m(y)).backward()

    d = _first(_raises(nn.ModuleList([m, rate]), run), "NW110")
    said = " ".join([*d.evidence, d.explanation])
    assert "float16" in said and "5.96e-08" in said and "ClampMin" in said
    assert "torch.log(lik.float().clamp_min(1e-09))" in d.fix
    assert "rounds to 0 in float16" in d.fix
    _parses(d.fix)
    with torch.no_grad():
        lik = m(y)
        assert torch.isfinite(torch.log(lik.float().clamp_min(1e-09))).all()
        assert not torch.isfinite(torch.log(lik.clamp_min(1e-09))).all()


# ------------------------------ 2: float16 x / tau with tau = 1.3e-4: an overflow, not x/0


class _Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 5)
        self.tau = 1.3e-4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.fc(x) / self.tau, dim=-1)


def test_a_tiny_nonzero_python_divisor_in_float16_is_an_overflow_not_a_division_by_zero() -> None:
    torch.manual_seed(0)
    m = _Tempered().half()
    with torch.no_grad():
        m.fc.bias.fill_(9.0)  # 9 / 1.3e-4 = 69,231 > 65504

    def run() -> None:
        m(torch.randn(4, 8).half()).float().sum().backward()

    err = _raises(m, run, "forensic")
    codes = [d.code for d in err.diagnoses]
    assert "NW111" not in codes
    d = _first(err, "NW101")
    assert "65504" in " ".join([*d.evidence, d.explanation])


# ------------------------------ 3: sqrt of a weighted sum of squares whose weights went < 0


class _Gdn(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.beta = nn.Parameter(torch.ones(c))
        self.gamma = nn.Parameter(0.1 * torch.eye(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        beta, gamma = self.beta, self.gamma.reshape(x.size(1), x.size(1), 1, 1)
        norm = nn.functional.conv2d(x**2, gamma, beta)
        norm = torch.sqrt(norm)
        return x / norm


def test_a_sqrt_of_a_weighted_sum_of_squares_is_clamped_and_its_weights_named() -> None:
    torch.manual_seed(0)
    m = _Gdn(3)
    with torch.no_grad():
        m.gamma[0, 0] = -5.0  # an update pushed a weight below 0
    x = torch.randn(2, 3, 4, 4)

    def run() -> None:
        m(x).sum().backward()

    d = _first(_raises(m, run), "NW112")
    assert "softplus(norm)" not in d.fix
    assert "norm = torch.sqrt(norm.clamp_min(0))" in d.fix
    assert "gamma.clamp_min(0)" in d.fix
    said = " ".join(d.evidence)
    assert "weighted sum of squares" in said and "gamma" in said
    _parses(d.fix)
    with torch.no_grad():  # the clamp keeps every healthy value: a model with gamma >= 0
        h = _Gdn(3)
        y = torch.randn(2, 3, 4, 4)
        norm = nn.functional.conv2d(y**2, h.gamma.reshape(3, 3, 1, 1), h.beta)
        assert torch.equal(torch.sqrt(norm.clamp_min(0)), torch.sqrt(norm))


# ------------------------------ 4: stacked similarities ** weights: the base is clamped


class _MultiScale(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        weights = torch.tensor([0.3, 0.3, 0.4])
        cs1 = (a * b).mean(-1)
        cs2 = (a[:, ::2] * b[:, ::2]).mean(-1)
        sim = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
        vals = torch.stack([cs1, cs2, sim], dim=0)
        return torch.prod(vals ** weights.view(-1, 1), dim=0).mean()


def test_a_fractional_power_of_stacked_values_clamps_the_base_in_the_users_names() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8))
    loss = _MultiScale()
    x = torch.randn(4, 8)

    def run() -> None:
        (1 - loss(m(x), -x)).backward()  # anti-correlated: negative similarities

    d = _first(_raises(nn.ModuleList([m, loss]), run), "NW112")
    assert "raw" not in d.fix and "w = " not in d.fix and "softplus(vals" not in d.fix
    assert "torch.prod(vals.clamp_min(0) ** weights.view(-1, 1), dim=0).mean()" in d.fix
    _parses(d.fix)
    weights = torch.tensor([0.3, 0.3, 0.4])
    vals = torch.tensor([[-0.5, 0.2], [0.3, -0.1], [0.9, 0.8]])
    assert torch.isfinite(torch.prod(vals.clamp_min(0) ** weights.view(-1, 1), dim=0)).all()


# ------------------------------ 5: a divisor read by two lines is floored once, for both


class _ZeroScale(nn.Module):
    def forward(self, y: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        v = torch.abs(y)
        upper = _cdf((0.5 - v) / scales)
        lower = _cdf((-0.5 - v) / scales)
        return upper - lower


def test_a_divisor_shared_by_two_lines_is_floored_where_both_read_it() -> None:
    torch.manual_seed(0)
    head, cond = nn.Sequential(nn.Linear(6, 6), nn.ReLU()), _ZeroScale()
    y = torch.randn(4, 6)

    def run() -> None:
        cond(y, head(y)).clamp_min(1e-9).log().sum().backward()

    d = _first(_raises(nn.ModuleList([head, cond]), run, "forensic"), "NW111")
    assert "torch.where" not in d.fix
    first = code_lines(d.fix).splitlines()[0]
    assert first.startswith("scales = scales.clamp_min(torch.finfo(scales.dtype).eps)")
    assert "divisor of 2 lines" in " ".join(d.evidence)
    _parses(d.fix)
    scales = head(y)
    assert (scales == 0).any()
    env = {"torch": torch, "scales": scales}
    exec(first, env)  # the fix, pasted before both lines
    v = torch.abs(y)
    lik = _cdf((0.5 - v) / env["scales"]) - _cdf((-0.5 - v) / env["scales"])
    lik.clamp_min(1e-9).log().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in head.parameters() if p.grad is not None)
