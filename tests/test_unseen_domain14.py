"""NW112 for a fractional power of a negative base inside torch.where (not exact zeros) and
for a sqrt of a parameter an update drove below 0; NW111 for a removable 0/0 (theta /
sin(theta) at the identity); NW110 for a log of a target with missing entries, a log of an
exp, and a log of a ReLU rate whose values exceed 1."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._diagnoses import code_lines
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


# ------------------------------ 1: a negative base in torch.where's unused branch, not zeros


class _RePU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, x**1.5, torch.zeros_like(x))


def test_repu_where_nan_gradient_is_the_negative_base_not_exact_zeros() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(1, 8), _RePU(), nn.Linear(8, 1))

    def run() -> None:
        m(torch.randn(16, 1)).sum().backward()

    d = _first(_raises(m, run, "forensic"), "NW112")
    said = " ".join(d.evidence)
    assert "negative numbers" in said and "exact zeros are not the cause" in said
    assert "given exact zeros" not in said
    assert "0 × NaN" in d.explanation and "inf × 0" not in d.explanation
    fix = code_lines(d.fix)
    assert "torch.where(x > 0, x.clamp_min(0)**1.5, torch.zeros_like(x))" in fix
    assert "torch.where(x > 0, torch.where" not in fix
    # the pasted fix has a finite gradient where x < 0
    x = torch.linspace(-1.0, 1.0, 9, requires_grad=True)
    torch.where(x > 0, x.clamp_min(0) ** 1.5, torch.zeros_like(x)).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


# ------------------------------ 2: a sqrt of a parameter the optimizer pushed below 0


class _Speed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
        self.c2 = nn.Parameter(torch.tensor(0.05))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_sqrt_of_a_parameter_driven_below_zero_is_not_called_rounding() -> None:
    torch.manual_seed(0)
    model = _Speed()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)

    def run() -> None:
        for _ in range(3):
            u = model(torch.rand(8, 2))
            c = torch.sqrt(model.c2)
            loss = ((u - c) ** 2).mean() + c
            opt.zero_grad()
            loss.backward()
            opt.step()

    d = _first(_raises(model, run), "NW112")
    said = " ".join(d.evidence)
    assert "parameter c2" in said and "below 0" in said and "not measured" not in said
    assert "softplus(model.c2)" in d.fix
    assert "rounding" not in d.fix and "v.clamp_min(0)" not in d.fix


# ------------------------------ 3: theta / sin(theta) at 0 is a limit, not a zero denominator


class _So3Log(nn.Module):
    def forward(self, r: torch.Tensor) -> torch.Tensor:
        cos = ((r.diagonal(dim1=-2, dim2=-1).sum(-1) - 1) / 2).clamp(-1, 1)
        theta = torch.acos(cos)
        return (theta / (2 * torch.sin(theta)))[..., None] * r[..., 0]


def test_theta_over_sin_theta_at_zero_gets_a_taylor_branch_not_a_clamp() -> None:
    m = _So3Log()
    w = nn.Parameter(torch.eye(3).repeat(2, 1, 1))

    def run() -> None:
        m(w).sum().backward()

    d = _first(_raises(m, run), "NW111")
    assert "removable 0/0" in " ".join(d.evidence)
    fix = code_lines(d.fix)
    assert "clamp_min" not in fix
    assert "torch.acos(cos.clamp(-1 + eps, 1 - eps))" in fix
    assert "(1 + theta ** 2 / 6) / 2" in fix
    # the pasted lines run, and are finite in value and gradient at the identity
    r = torch.eye(3).repeat(2, 1, 1).requires_grad_()
    cos = ((r.diagonal(dim1=-2, dim2=-1).sum(-1) - 1) / 2).clamp(-1, 1)
    scope = {"torch": torch, "cos": cos, "r": r}
    body = [ln for ln in fix.splitlines() if not ln.startswith("return ")]
    exec("\n".join(body), scope)
    ret = next(ln for ln in fix.splitlines() if ln.startswith("return "))
    out = eval(ret.removeprefix("return ").split("   #")[0], scope)
    out.sum().backward()
    assert torch.isfinite(out).all() and r.grad is not None and torch.isfinite(r.grad).all()
    assert torch.allclose(out[..., 0, 0], torch.full((2,), 0.5))


def test_sin_x_over_x_at_zero_is_a_removable_limit() -> None:
    m = nn.Linear(3, 3)

    def run() -> None:
        x = m(torch.zeros(2, 3)) * 0.0
        y = torch.sin(x) / x
        y.sum().backward()

    d = _first(_raises(m, run, "forensic"), "NW111")
    assert "removable 0/0" in " ".join(d.evidence)
    assert "1 - x ** 2 / 6" in d.fix and "torch.sin(x_safe) / x_safe" in d.fix


# ------------------------------ 4: a log of a target whose 0 marks a missing value


class _Depth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softplus(self.net(x)).squeeze(-1) + 0.1


def test_log_of_a_target_with_zeros_masks_the_valid_entries() -> None:
    torch.manual_seed(0)
    model = _Depth()

    def run() -> None:
        gt = torch.rand(16) * 4 + 1
        gt[::4] = 0.0
        pred = model(torch.randn(16, 5))
        loss = (torch.log(pred) - torch.log(gt)).abs().mean()
        loss.backward()

    d = _first(_raises(model, run, "forensic"), "NW110")
    fix = code_lines(d.fix)
    assert "valid = (pred > 0) & (gt > 0)" in fix
    assert "loss = (torch.log(pred[valid]) - torch.log(gt[valid])).abs().mean()" in fix
    gt = torch.tensor([0.0, 2.0, 3.0])
    pred = torch.tensor([1.0, 2.5, 0.5], requires_grad=True)
    scope = {"torch": torch, "gt": gt, "pred": pred}
    exec(fix, scope)
    assert torch.isfinite(scope["loss"])


# ------------------------------ 5: log(exp(y)) is y


class _Decay(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.full((4,), 200.0))

    def forward(self, dt: torch.Tensor) -> torch.Tensor:
        d_a = torch.exp(-dt * self.a)
        log_da = torch.log(d_a)
        return log_da.cumsum(0)


class _Scan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.decay = _Decay()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.decay(F.softplus(self.inp(x)) + 1.0))


def test_log_of_an_exp_uses_the_exponent() -> None:
    torch.manual_seed(0)
    m = _Scan()

    def run() -> None:
        m(torch.ones(3, 4)).sum().backward()

    d = _first(_raises(m, run, "forensic"), "NW110")
    assert code_lines(d.fix).startswith("log_da = -dt * self.a")
    assert "log(exp(y)) = y" in d.fix and "Gaussian" not in d.fix


# ------------------------------ 6: a ReLU rate whose values exceed 1


class _Rate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 6), nn.ReLU())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z) * 3


def test_log_of_a_relu_rate_above_one_suggests_softplus() -> None:
    torch.manual_seed(0)
    model = _Rate()
    y = torch.poisson(torch.rand(32, 6) * 3)

    def run() -> None:
        mu = model(torch.randn(32, 5))
        nll = mu - y * torch.log(mu)
        nll.mean().backward()

    d = _first(_raises(model, run), "NW110")
    assert "ReLU output" in d.fix and "F.softplus(raw)" in d.fix
