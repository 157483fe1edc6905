"""Domain fixes found by user testing: a divisor raised to a power is clamped whole, a
log1p fix rewrites the call whose argument reached -1, a log of a ratio gets a floor, the
floor quoted for log10 is log10's."""

from __future__ import annotations

import math

import torch
from torch import nn

from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


# ------------------------------ 1: g / (c * |x|) ** 2 in a custom backward: clamp the power


class _Spike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(x)
        return (x > 0).float()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        (x,) = ctx.saved_tensors
        return g / (10.0 * x.abs()) ** 2


class _Lif(nn.Module):
    def forward(self, cur: torch.Tensor) -> torch.Tensor:
        return _Spike.apply(cur - 1.0)


def test_a_power_of_the_divisor_is_clamped_whole_and_the_one_plus_form_is_named() -> None:
    fc, lif = nn.Linear(3, 4), _Lif()
    with torch.no_grad():
        fc.weight.zero_()
        fc.bias.fill_(1.0)
    m = nn.Sequential(fc, lif)

    def run() -> None:
        m(torch.rand(2, 3)).sum().backward()

    d = _first(_raises(m, run, "forensic"), "NW111")
    assert "g / ((10.0 * x.abs()) ** 2).clamp_min(" in d.fix
    assert ".eps) ** 2" not in d.fix
    assert "return g / (1 + 10.0 * x.abs()) ** 2" in d.fix


# ------------------------------ 2: log1p: the call whose argument reached -1, in its words


class _Artanh(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = torch.tanh(x).norm(dim=-1, keepdim=True)
        return 0.5 * (torch.log1p(v) - torch.log1p(-v))


def test_log1p_of_minus_v_at_v_one_rewrites_that_call_not_the_first() -> None:
    m = nn.Sequential(nn.Linear(4, 1), _Artanh())
    with torch.no_grad():
        m[0].weight.fill_(20.0)  # type: ignore[index]
        m[0].bias.fill_(20.0)  # type: ignore[index]

    def run() -> None:
        m(torch.ones(3, 4)).sum().backward()

    d = _first(_raises(m, run), "NW110")
    assert "torch.log1p(v) - torch.log1p(-v.clamp_max(1 - torch.finfo(v.dtype).eps))" in d.fix
    assert "counts and amounts" not in d.fix and "missing-value indicator" not in d.fix


class _MuLaw(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sign(x) * torch.log1p(255.0 * x) / math.log1p(255.0)


def test_signed_log1p_without_abs_gets_the_magnitude_inside() -> None:
    m = nn.Sequential(_MuLaw(), nn.Linear(8, 2))

    def run() -> None:
        m(torch.linspace(-1, 1, 16).reshape(2, 8)).sum().backward()

    d = _first(_raises(m, run), "NW110")
    assert "torch.sign(x) * torch.log1p(255.0 * x.abs())" in d.fix
    assert "clamp_min(0)" not in d.fix and "counts and amounts" not in d.fix


class _LogFeatures(nn.Module):
    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return torch.log1p(counts)


class _Counts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.feat, self.fc = _LogFeatures(), nn.Linear(3, 1)
        nn.init.constant_(self.fc.weight, -0.5)

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return self.fc(self.feat(counts))


def test_log1p_of_a_batch_sentinel_keeps_the_counts_wording() -> None:
    m = _Counts()
    batch = torch.tensor([[3.0, -1.0, 2.0], [0.0, 5.0, 1.0]])

    def run() -> None:
        m(batch).sum().backward()

    d = _first(_raises(m, run), "NW110")
    assert "return torch.log1p(counts.clamp_min(0))" in d.fix and "counts and amounts" in d.fix


# ------------------------------ 3, 4: log10 of a ratio with silence; log10's own floor


class _Db(nn.Module):
    def __init__(self, ref: float | None) -> None:
        super().__init__()
        self.ref = ref
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.db(x * x))

    def db(self, s: torch.Tensor) -> torch.Tensor:
        if self.ref is None:
            return 10.0 * torch.log10(s / s.amax(dim=-1, keepdim=True))
        return 10.0 * torch.log10(s / self.ref)


def _silent_batch() -> torch.Tensor:
    x = torch.randn(3, 4) * 3
    x[1, :2] = 0.0  # silent bins; every row keeps a nonzero maximum
    x[0, 0] = 0.0
    return x


def test_log10_of_a_ratio_to_the_max_with_silence_gets_a_floor_not_a_probability() -> None:
    m = _Db(None)

    def run() -> None:
        m(_silent_batch()).sum().backward()

    d = _first(_raises(m, run, "forensic"), "NW110")
    assert "torch.log10((s / s.amax(dim=-1, keepdim=True)).clamp_min(1e-10))" in d.fix
    assert "softmax" not in d.fix and "pixels" not in d.fix
    assert "ratio" in d.explanation


def test_the_floor_quoted_for_log10_is_log10_of_tiny() -> None:
    m = _Db(0.5)

    def run() -> None:
        m(_silent_batch()).sum().backward()

    d = _first(_raises(m, run, "forensic"), "NW110")
    assert "log10(tiny) = -37.93 in float32" in d.fix
    assert "-87.34" not in d.fix


# ------------------------------ 5: two logs on the line, one of a constant: rewrite the other


class _DbRef(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ref, self.fc = 2.0, nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x * x
        return self.fc(10.0 * torch.log10(s) - 10.0 * torch.log10(torch.tensor(self.ref)))


def test_of_two_logs_on_a_line_the_one_of_a_constant_is_left_alone() -> None:
    m = _DbRef()

    def run() -> None:
        m(_silent_batch()).sum().backward()

    d = _first(_raises(m, run, "forensic"), "NW110")
    assert (
        "10.0 * torch.log10(s.clamp_min(torch.finfo(s.dtype).tiny)) - 10.0 * "
        "torch.log10(torch.tensor(self.ref))"
    ) in d.fix


# ------------------------------ 6: squash of zero vectors: eps inside the sqrt above the line


def _squash(s: torch.Tensor) -> torch.Tensor:
    n2 = (s**2).sum(-1, keepdim=True)
    n = torch.sqrt(n2)
    return n2 / (1 + n2) * s / n


class _Caps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        nn.init.constant_(self.fc.bias, -50.0)  # every capsule dead: ReLU gives 0 vectors

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _squash(torch.relu(self.fc(x)).view(-1, 2, 4))


def test_squash_of_zero_vectors_puts_eps_inside_the_sqrt_of_the_norm() -> None:
    m = _Caps()

    def run() -> None:
        m(torch.randn(3, 4)).sum().backward()

    d = _first(_raises(m, run), "NW111")
    assert "n = torch.sqrt(n2 + 1e-8)" in d.fix
    assert "created with torch.zeros" not in d.fix and "never filled" not in d.explanation
