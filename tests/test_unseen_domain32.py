"""Fixes found by user testing on linear attention: a float16 exp on a feature map's
``return`` line runs pasted (the module in float32, not a float32 value in float16 ops), a
log of a power is taken apart (n * log(a)) and its backward 0/0 is told as such, a 0/0
from exp() features that underflowed names the exp."""

from __future__ import annotations

import ast
import math

import torch
from torch import nn

from tests._diagnoses import code_lines
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


def _clear_hooks(m: nn.Module) -> None:
    for sub in m.modules():
        sub._forward_hooks.clear()
        sub._forward_pre_hooks.clear()


# ------------------------------ 1: float16 exp returned by a feature map: the fix runs


class _SplitFavor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, 4))
        self.v = nn.Linear(4, 4)

    def phi(self, x: torch.Tensor) -> torch.Tensor:
        wx = x @ self.w.t()
        h = (x * x).sum(-1, keepdim=True) / 2
        return torch.exp(wx) * torch.exp(-h) / 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, v = self.phi(x), self.v(x)
        kv = k.transpose(1, 2) @ v
        return k @ kv


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _SplitFavor()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


def test_a_float16_exp_returned_by_a_method_is_fixed_by_running_the_module_in_float32() -> None:
    model = _Outer().half()
    x = torch.full((1, 2, 4), 3.0, dtype=torch.float16)  # w.x = 12 > log(65504) = 11.09

    def run() -> None:
        model(x).float().sum().backward()

    d = _first(_raises(model, run), "NW101")
    assert "model.attn.float()" in d.fix
    assert "register_forward_pre_hook" in d.fix and "register_forward_hook" in d.fix
    # the line alone is offered only cast back, and only where the value fits
    assert ".to(wx.dtype)" in d.fix and "only if what this line returns fits float16" in d.fix
    assert "keep the result in float32 where it is used" not in d.fix
    pasted = code_lines(d.fix)
    ast.parse(pasted)
    model.zero_grad()
    try:
        exec(pasted, {"model": model, "torch": torch})
        y = model(x)
        y.float().sum().backward()
    finally:
        _clear_hooks(model)
    assert y.dtype == torch.float16 and torch.isfinite(y).all()


# ------------------------------ 2: log(gamma ** dist): n * log(gamma), and the backward 0/0


class _Decay(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(1))  # gamma = sigmoid(0) = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = torch.sigmoid(self.p)
        dist = torch.arange(200.0)
        log_decay = torch.log(gamma**dist)
        return x * log_decay.exp().sum()


def test_a_log_of_a_power_is_taken_apart_and_its_backward_nan_is_zero_over_zero() -> None:
    m = nn.Sequential(nn.Linear(2, 2), _Decay())

    def run() -> None:
        m(torch.ones(1, 2)).sum().backward()

    d = _first(_raises(m, run), "NW110")
    assert "log_decay = dist * torch.log(gamma)" in d.fix
    assert "log_softmax" not in d.fix and "softplus" not in d.fix
    assert not any("below 0 is NaN" in e for e in d.evidence)
    assert any("0 / 0 = NaN" in e and "none below 0" in e for e in d.evidence)
    ns = {"torch": torch, "gamma": torch.sigmoid(torch.zeros(1, requires_grad=True))}
    ns["dist"] = torch.arange(200.0)
    gamma = ns["gamma"]
    assert isinstance(gamma, torch.Tensor)
    gamma.retain_grad()
    exec(code_lines(d.fix), ns)
    out = ns["log_decay"]
    assert isinstance(out, torch.Tensor)
    out.exp().sum().backward()
    assert gamma.grad is not None and torch.isfinite(gamma.grad).all()
    assert math.isclose(float(out[3].detach()), 3 * math.log(0.5), rel_tol=1e-6)


# ------------------------------ 3: 0/0 of a sum of exp() features that underflowed


class _Favor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 4))
        self.v = nn.Linear(4, 4)

    def phi(self, x: torch.Tensor) -> torch.Tensor:
        a = x @ self.w.t() - (x * x).sum(-1, keepdim=True) / 2
        return torch.exp(a) / 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.phi(x), self.phi(x), self.v(x)
        num = q @ (k.transpose(1, 2) @ v)
        den = q @ k.sum(1, keepdim=True).transpose(1, 2)
        return num / den


def test_a_zero_denominator_of_underflowed_exp_features_names_the_exp() -> None:
    model = nn.Sequential(nn.Identity(), _Favor()).half()
    x = torch.full((1, 2, 4), 4.0, dtype=torch.float16)  # exponent -32: exp is 0 in float16

    def run() -> None:
        model(x).float().sum().backward()

    d = _first(_raises(model, run), "NW111")
    assert "exp() features underflowed" in d.title
    assert any("phi()" in e and "torch.exp(a) / 2.0" in e for e in d.evidence)
    assert any("-17.33" in e and "-9.704" in e for e in d.evidence)
    assert "a = a - a.amax(dim=(-2, -1), keepdim=True).detach()" in d.fix
    assert "model[1].float()" in d.fix
    assert "torch.where(den != 0" not in d.fix
    for line in code_lines(d.fix).splitlines():
        ast.parse(line)
