"""Domain fixes found by user testing: a log of -log(u) (Gumbel noise) whose zeros are a
uniform rounded to 1 in bfloat16 is floored at u's spacing below 1, which changes no valid
sample (not at eps x the argument's max), also when both logs are on one line."""

from __future__ import annotations

import ast

import torch
import torch.nn.functional as F
from torch import nn

from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises
from tests._diagnoses import text

torch.set_num_threads(1)


def _code(fix: str) -> str:
    """The first line of a fix, without its trailing comment."""
    return fix.splitlines()[0].split("   #", 1)[0].strip()


def _uniform() -> torch.Tensor:
    """A float32 uniform draw with a few values that round up to 1.0 in bfloat16."""
    g = torch.Generator().manual_seed(0)
    u = torch.rand(8, 16, generator=g)
    u[0, :3] = 0.9995  # above 1 - 2**-9: 1.0 in bfloat16
    return u


# ------------------------------ 1, 2: Gumbel noise -log(-log(U)) with U == 1 in bfloat16


class _NamedGumbel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 16).to(torch.bfloat16)
        self.u = _uniform()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        U = self.u.to(torch.bfloat16)
        a = -torch.log(U)
        g = -torch.log(a)
        return F.softmax(self.enc(x) + g, -1)


class _InlineGumbel(_NamedGumbel):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        U = self.u.to(torch.bfloat16)
        g = -torch.log(-torch.log(U))
        return F.softmax(self.enc(x) + g, -1)


def _check_gumbel_fix(m: _NamedGumbel, mode: str) -> str:
    x = torch.randn(8, 4, dtype=torch.bfloat16)
    d = _first(_raises(m, lambda: m(x).float().sum().backward(), mode), "NW110")
    line = _code(d.fix)
    ast.parse(line)
    assert "eps / 2" in line and "0.003906" in d.fix and "float32" in d.fix, d.fix
    assert "U == 1" in text(d) and "resolution" not in d.fix and "1e-1" not in d.fix
    U = m.u.to(torch.bfloat16)
    a = -torch.log(U)
    g = eval(line.split("=", 1)[1], {"torch": torch, "U": U, "a": a})
    assert torch.isfinite(g).all()
    valid = a > 0
    assert torch.equal(g[valid], (-torch.log(a))[valid])  # no valid sample changes
    return line


def test_a_log_of_a_named_negated_log_is_floored_at_the_uniforms_spacing() -> None:
    line = _check_gumbel_fix(_NamedGumbel(), "forensic")
    assert line == "g = -torch.log(a.clamp_min(torch.finfo(a.dtype).eps / 2))", line


def test_nested_logs_on_one_line_get_code_in_the_users_names() -> None:
    for mode in ("watch", "forensic"):
        line = _check_gumbel_fix(_InlineGumbel(), mode)
        assert line == "g = -torch.log((-torch.log(U)).clamp_min(torch.finfo(U.dtype).eps / 2))"


# ------------------------------ 3: log of a softplus intensity that underflowed to 0


def test_a_log_of_a_softplus_that_underflowed_is_named_and_taken_exactly() -> None:
    torch.manual_seed(0)
    head = nn.Linear(4, 1)
    w = torch.tensor(-0.5, requires_grad=True)  # a decaying intensity
    dt = torch.rand(8, 5) + 0.1
    dt[3, 2] = 400.0  # a long gap: softplus(base - 200) is exactly 0 in float32

    def run() -> None:
        base = head(torch.randn(8, 5, 4)).squeeze(-1)
        lam = F.softplus(base + w * dt)
        log_lam = torch.log(lam)
        (-log_lam.sum()).backward()

    for mode in ("watch", "forensic"):
        d = _first(_raises(head, run, mode), "NW110")
        words = text(d)
        assert "softplus" in words and "-104" in words, words
        assert "not from an underflow" not in words
        exact = next(ln for ln in d.fix.splitlines() if "torch.where(" in ln)
        code = exact.split("   #", 1)[0].strip()
        ast.parse(code)
        base = head(torch.randn(8, 5, 4)).squeeze(-1).detach()
        z = base + w.detach() * dt
        names = {"torch": torch, "F": F, "z": z, "base": base, "w": w.detach(), "dt": dt}
        got = eval(code.split("=", 1)[1], names)
        assert torch.isfinite(got).all()
        ok = z > -20  # where softplus is exact, the log is unchanged
        assert torch.allclose(got[ok], torch.log(F.softplus(z))[ok])
        if mode == "forensic":
            assert code.startswith("log_lam = torch.where((base + w * dt) < -20"), code


# ------------------------------ 5: beta / (alpha - 1) with alpha = softplus(a) + 1 == 1


class _NigHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        with torch.no_grad():
            self.lin.bias[0] = -40.0  # softplus(-40) = 4e-18: 1 + it is exactly 1

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.lin(h).chunk(2, -1)
        alpha = F.softplus(a) + 1
        beta = F.softplus(b)
        return alpha, beta


def test_a_difference_that_cancelled_to_zero_is_named_a_cancellation() -> None:
    torch.manual_seed(0)
    m = _NigHead()
    h = torch.randn(6, 3) * 0.01

    def run() -> None:
        alpha, beta = m(h)
        aleatoric = beta / (alpha - 1)
        aleatoric.mean().backward()

    for mode in ("watch", "forensic"):
        d = _first(_raises(m, run, mode), "NW111")
        words = text(d)
        assert "cancellation" in words and "5.96e-08" in words, words
        assert "never filled (a buffer" not in d.explanation and "torch.zeros" not in d.fix
        for ln in d.fix.splitlines():
            if not ln.lstrip().startswith("#"):
                ast.parse(ln.split("   #", 1)[0].strip())
        if mode == "forensic":
            assert "alpha - 1 is exactly F.softplus(a)" in d.fix, d.fix
