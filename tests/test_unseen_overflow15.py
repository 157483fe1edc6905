"""NW101 fixes that were wrong when pasted: a logistic e / (1 + e) ** 2 in a custom
backward is no softmax (torch.sigmoid, not a max subtraction), and a softmax by hand on one
line shifts the numerator's exp and the sum's exp alike, over the sum's own dim."""

from __future__ import annotations

import ast
from typing import Any

import pytest
import torch
from torch import nn

import nanwatch
from tests._diagnoses import code_lines
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)

K = 25.0


# ------------------------- 1: exp in a logistic form (a sigmoid surrogate): torch.sigmoid


class _Surrogate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u):  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(u)
        return (u > 0).float()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        (u,) = ctx.saved_tensors
        e = torch.exp(-K * u)
        return g * K * e / (1 + e) ** 2


class _Neuron(nn.Module):
    def forward(self, cur: torch.Tensor) -> torch.Tensor:
        return _Surrogate.apply(cur - 1.0)


def _pasted(fix: str, u: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """What the fix's code computes, run where the user's backward ran."""
    body = code_lines(fix).replace("return ", "out = ")
    ast.parse(body)
    ns: dict[str, Any] = {"torch": torch, "K": K, "u": u, "g": g}
    exec(body, ns)
    return ns["out"]


def test_a_logistic_exp_in_a_custom_backward_gets_sigmoid_not_a_max_shift() -> None:
    fc, neuron = nn.Linear(3, 4), _Neuron()
    with torch.no_grad():
        fc.weight.zero_()
        fc.bias.fill_(-4.0)  # far below threshold: exp(-K * u) overflows
    m = nn.Sequential(fc, neuron)

    def run() -> None:
        m(torch.rand(2, 3)).sum().backward()

    d = _first(_raises(m, run, "forensic"), "NW101")
    assert "amax" not in d.fix and "the result is the same" not in d.fix
    assert ".clamp(" not in d.fix
    assert "s = torch.sigmoid(K * u)  # was: e = torch.exp(-K * u)" in d.fix
    assert "return g * K * s * (1 - s)" in d.fix
    assert "not a softmax" in d.explanation
    assert not any("in forward, aten.exp overflowed" in e for e in d.evidence)
    u = torch.tensor([[-0.5, 0.0, 0.02, 0.3], [-5.0, 0.1, -0.1, 0.05]])
    g = torch.full_like(u, 2.0)
    true = g * K * torch.sigmoid(K * u) * (1 - torch.sigmoid(K * u))
    assert torch.allclose(_pasted(d.fix, u, g), true)
    assert bool(torch.isfinite(_pasted(d.fix, u - 100.0, g)).all())


# ----------- 2: exp(b) / exp(b).sum(dim=2): both exps shifted by one max, over dim 2


class _Routing(nn.Module):
    def forward(self, b: torch.Tensor) -> torch.Tensor:
        c = torch.exp(b) / torch.exp(b).sum(dim=2, keepdim=True)
        return c * 2.0


def test_a_one_line_softmax_shifts_every_exp_over_the_sums_dim() -> None:
    m = _Routing()
    b = torch.zeros(2, 3, 4)
    b[0, 1, 2] = 120.0

    d = _first(_raises(m, lambda: m(b)), "NW101")
    line = code_lines(d.fix).splitlines()[0]
    assert line.count("amax(dim=2, keepdim=True)") == 2
    assert "torch.softmax(b, dim=2)" in d.fix
    torch.manual_seed(0)
    for x in (torch.randn(2, 3, 4) * 3, torch.randn(2, 3, 4) * 3 + 500.0):
        ns: dict[str, Any] = {"torch": torch, "b": x}
        exec(line, ns)
        assert bool(torch.isfinite(ns["c"]).all())
        assert torch.allclose(ns["c"], torch.softmax(x, dim=2), atol=1e-6)


# ------ 3: a fixed-point solve of the gradient (repeated autograd.grad) that diverges


class _Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Linear(4, 4, bias=False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.W(z))


class _Equilibrium(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = _Cell()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.f(x)
        z0 = z.detach().requires_grad_()
        f0 = self.f(z0)

        def solve(grad: torch.Tensor) -> torch.Tensor:
            g = grad
            for _ in range(80):  # g = J^T g + grad, J not a contraction
                g = torch.autograd.grad(f0, z0, g, retain_graph=True)[0] + grad
            return g

        z.register_hook(solve)
        return z


@pytest.mark.accelerator_weaker(
    reason="read after run() returned, the fix names the model model, not m"
)
def test_a_diverging_backward_fixed_point_loop_is_named_not_layernorm() -> None:
    torch.manual_seed(0)
    m = _Equilibrium()
    with torch.no_grad():
        m.f.W.weight.copy_(torch.eye(4) * 6.0)

    def run() -> None:
        m(torch.full((2, 4), 0.01)).sum().backward()

    d = _first(_raises(m, run, "forensic"), "NW101")
    assert "LayerNorm" not in d.fix and "h = self.norm(h)" not in d.fix
    assert any("the backward of f.W ran" in e and "diverges" in e for e in d.evidence)
    assert "contraction" in d.explanation
    line = code_lines(d.fix).split("#", 1)[0].strip()
    assert line == "m.f.W = torch.nn.utils.parametrizations.spectral_norm(m.f.W)"
    assert "residual" in d.fix
    ns: dict[str, Any] = {"torch": torch, "m": m}
    exec(line, ns)  # the pasted fix: the same loop now stays finite
    m(torch.full((2, 4), 0.01)).sum().backward()
    assert m.f.W.parametrizations.weight.original.grad is not None
    assert bool(torch.isfinite(m.f.W.parametrizations.weight.original.grad).all())


# ------ 4: one update moved an exp parametrization's parameter past exp's range: the lr


class _Exp(nn.Module):
    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return torch.exp(X)

    def right_inverse(self, W: torch.Tensor) -> torch.Tensor:
        return torch.log(W)


def test_an_exp_parametrization_that_one_update_overflowed_says_the_lr_first() -> None:
    import torch.nn.utils.parametrize as P

    torch.manual_seed(0)
    lin = nn.Linear(4, 1)
    with torch.no_grad():
        lin.weight.abs_().add_(1e-3)
    P.register_parametrization(lin, "weight", _Exp())
    opt = torch.optim.SGD(lin.parameters(), lr=30.0)
    x = torch.randn(16, 4)
    y = x.sum(1, keepdim=True) * 50

    def run() -> None:
        for _ in range(3):
            nn.functional.mse_loss(lin(x), y).backward()
            opt.step()
            opt.zero_grad()
            nw.step()

    try:
        with nanwatch.watch(lin, postmortem=False) as nw:
            run()
    except nanwatch.AnomalyError as e:
        err = e
    else:
        raise AssertionError("no anomaly")
    d = _first(err, "NW101")
    assert d.fix.splitlines()[0] == 'for g in opt.param_groups: g["lr"] = 3   # was 30 (SGD)'
    assert d.fix.index("lr") < d.fix.index("clamp")
    assert any(
        "parameter parametrizations.weight.original" in e
        and "one optimizer update (SGD lr 30)" in e
        for e in d.evidence
    )
    assert "learning rate is too large" in d.explanation
