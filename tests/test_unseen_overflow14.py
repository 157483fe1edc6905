"""Overflow and zero-gradient diagnoses from user testing, round 14: a float16 pow's fix
casts the pow's own base (not a product elsewhere on the line, never .float().float()); a
float16 z-loss keeps the loss in float32; a float16 product whose sin/cos follows is cast
back after them; a hinge loss at exactly 0 is convergence (info); a backward overflow in a
module with huge weights names the weights."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.rules import overflow as ov
from nanwatch.rules._evidence import limits

# ------------------------------------------ 1: pow's base, not a product on the same line


def test_upcast_line_casts_the_overflowing_ops_operand_only_once() -> None:
    line = "dist = z.pow(2).sum(-1, keepdim=True) - 2 * z @ e.t() + e.pow(2).sum(-1)"
    assert ov.upcast_line(line, "pow") == (
        "dist = z.float().pow(2).sum(-1, keepdim=True) - 2 * z @ e.t() + e.pow(2).sum(-1)"
    )
    pasted = "d = z.pow(2).sum(-1) - 2 * z.float() @ e.t().float()"
    assert (
        ov.upcast_line(pasted, "pow")
        == "d = z.float().pow(2).sum(-1) - 2 * z.float() @ e.t().float()"
    )
    assert ov.upcast_line("d = (z ** 2).mean()", "pow") == "d = (z.float() ** 2).mean()"
    # a product already in float32 is not cast again; a matmul's own overflow still is
    assert ov.upcast_line("s = a.float() @ b.float()", "mm") is None
    assert ov.upcast_line("s = a @ b.float()", "mm") == "s = a.float() @ b.float()"
    assert ov.upcast_line("p = torch.exp(x.float())", "exp") is None  # not x.float.float()()


class _VQ(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.codebook = nn.Embedding(4, 8)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        e = self.codebook.weight
        dist = z.pow(2).sum(-1, keepdim=True) - 2 * z @ e.t() + e.pow(2).sum(-1)
        return dist


def test_float16_pow_overflow_casts_the_base_of_the_pow() -> None:
    model = _VQ().half()
    z = torch.full((2, 8), 300.0).half()
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(model) as nw:
        model(z)
    d = next(d for d in nw.report.diagnoses if d.code == "NW101")
    first = d.fix.splitlines()[0]
    assert first.startswith("dist = z.float().pow(2).sum(-1, keepdim=True) - 2 * z @ e.t()")
    assert ".float().float()" not in d.fix
    assert "exp overflows" not in d.fix  # a pow, not an exp


# ------------------------------------------------------- 2: a z-loss stays in float32


class _Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.w(x)
        z = torch.logsumexp(logits, dim=-1)
        zloss = (z**2).mean()
        return logits.softmax(-1), zloss


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = _Router()
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p, zl = self.router(x)
        return self.head(p), zl


def test_float16_zloss_overflow_keeps_the_loss_in_float32_no_output_hook() -> None:
    torch.manual_seed(0)
    net = _Net().half()
    with torch.no_grad():
        net.router.w.weight.fill_(100.0)
    x = torch.ones(4, 4).half()
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(net) as nw:
        net(x)
    d = next(d for d in nw.report.diagnoses if d.code == "NW101")
    assert d.fix.startswith("zloss = (z.float()**2).mean()")
    assert "out.to(" not in d.fix and "register_forward_hook" not in d.fix


def test_module_float32_fix_does_not_call_every_output_normalized() -> None:
    lim = limits("float16")
    fix = ov._fix("other", "mul", "float16", lim, "y = a * b", device="'cpu'", ref="model.block")
    assert "register_forward_hook" in fix
    assert "(a normalized value) is cast back" not in fix
    assert "right only for outputs that fit float16" in fix


# -------------------------------------------- 3: Fourier features cast back after sin/cos


class _Fourier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("B", torch.full((2, 4), 25.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        proj = 2 * math.pi * x @ self.B
        return torch.cat([torch.sin(proj), torch.cos(proj)], -1)


class _Fixed(_Fourier):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the fix's two lines, pasted
        proj = 2 * math.pi * x.float() @ self.B.float()
        return torch.cat([torch.sin(proj).to(torch.float16), torch.cos(proj).to(torch.float16)], -1)


def test_float16_fourier_product_is_cast_back_after_sin_cos() -> None:
    model = nn.Sequential(_Fourier(), nn.Linear(8, 2)).half()
    x = torch.full((3, 2), 300.0).half()  # pixel coordinates, not [0, 1]
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(model) as nw:
        model(x)
    d = next(d for d in nw.report.diagnoses if d.code == "NW101")
    lines = d.fix.splitlines()
    assert lines[0].startswith("proj = 2 * math.pi * x.float() @ self.B.float()")
    back = "torch.sin(proj).to(torch.float16), torch.cos(proj).to(torch.float16)"
    assert lines[1].startswith(f"return torch.cat([{back}], -1)")
    assert "normalized to [0, 1]" in d.fix
    fixed = nn.Sequential(_Fixed(), nn.Linear(8, 2)).half()  # the pasted fix runs
    assert fixed(x).dtype == torch.float16


def test_float16_product_without_a_later_bound_says_cast_back_on_its_line() -> None:
    fix = ov._fix_matmul(
        "h = a @ b", "float16", device="'cpu'", ref="model.f", loss=False, autocast=False
    )
    assert fix.splitlines()[0].startswith("h = a.float() @ b.float()  # was: h = a @ b   # float32")
    assert "cast back with .to(torch.float16)" in fix.splitlines()[0]


# -------------------------------------------------- 4: a hinge loss at 0 has converged


def test_margin_loss_exactly_zero_is_convergence_not_a_logit_scale() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    crit = nn.MultiMarginLoss(margin=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = torch.randn(30, 4), torch.randint(0, 3, (30,))
    x[torch.arange(30), y] += 6.0
    with nanwatch.watch(model, crit) as nw:
        for _ in range(15):
            loss = crit(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    d = next(d for d in nw.report.diagnoses if d.code == "NW304")
    assert d.severity == "info"
    assert "reached its minimum" in d.title
    assert any("MultiMarginLoss" in e for e in d.evidence)
    assert "logit_scale" not in d.fix and "GradScaler" not in d.fix


# --------------------------------------- 5: a backward overflow through huge weights


def test_float16_backward_overflow_names_the_modules_huge_weights() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 2)).half()
    with torch.no_grad():
        model[1].weight.mul_(3e4)  # weights of ~7500: the forward still fits float16
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(model) as nw:
        for _ in range(2):
            model(torch.randn(4, 8).half() * 0.05).float().pow(2).mean().backward()
            nw.step()
    d = next(d for d in nw.report.diagnoses if d.code == "NW101" and d.phase == "backward")
    assert "1's own weights" in d.explanation
    assert "not a large loss" in d.explanation
    assert d.fix.splitlines()[0].startswith("print(model[1].weight.abs().max())")
