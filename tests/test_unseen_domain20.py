"""Domain fixes found by user testing: a Python-number divisor whose numerator is built from
it (a Huber loss over kappa = 0) is a limit case, not a floor; a negative power of a
probability is traced to the zero priorities that made it; a negative power that reached 0
is floored on the user's line, never relu'd or sign·|x|'d."""

from __future__ import annotations

import ast

import torch
from torch import nn

from tests._diagnoses import code_lines
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


# ------------------------------ 1: huber / kappa with kappa = 0: the limit, not a floor


def _quantile_huber(pred, target, tau, kappa):  # type: ignore[no-untyped-def]
    u = target[:, None, :] - pred[:, :, None]
    huber = torch.where(u.abs() <= kappa, 0.5 * u.pow(2), kappa * (u.abs() - 0.5 * kappa))
    loss = (tau[None, :, None] - (u.detach() < 0).float()).abs() * huber / kappa
    return loss.sum(1).mean()


def test_a_divisor_the_numerator_is_built_from_is_a_limit_case_not_a_floor() -> None:
    torch.manual_seed(0)
    m = nn.Linear(4, 8)
    x, tz, tau = torch.randn(16, 4), torch.randn(16, 8), (torch.arange(8) + 0.5) / 8

    def run() -> None:
        _quantile_huber(m(x), tz, tau, 0.0).backward()

    d = _first(_raises(m, run, "forensic"), "NW111")
    assert "max(kappa" not in d.fix
    assert (
        "huber = torch.where(" in d.evidence[0] and "built from the divisor kappa" in d.evidence[0]
    )
    assert "limit case" in d.explanation and "stops learning" in d.explanation
    line = code_lines(d.fix)
    assert "if kappa else" in line and "u.abs()" in line
    ast.parse(line)
    # the pasted line gives the L1 limit: a finite loss with a gradient
    env = {"tau": tau, "u": tz[:, None, :] - m(x)[:, :, None], "kappa": 0.0, "torch": torch}
    env["huber"] = torch.zeros_like(env["u"])
    exec(line, env)  # the fix a user pastes
    assert torch.isfinite(env["loss"]).all() and env["loss"].sum() > 0


# ------------------------------ 2: (N * P) ** -beta with P = 0: the priorities, not a count


def _per_weights(n_items: int) -> torch.Tensor:
    N = 64
    prio = torch.zeros(N)
    prio[:8] = 0.5
    alpha, beta = 0.6, 0.4
    P = prio**alpha / (prio**alpha).sum()
    idx = torch.arange(n_items)
    w = (N * P[idx]) ** -beta
    return w / w.max()


def test_a_negative_power_of_a_probability_names_the_zero_priorities() -> None:
    m = nn.Linear(2, 16)

    def run() -> None:
        (m(torch.randn(3, 2)) * _per_weights(16)).sum().backward()

    d = _first(_raises(m, run, "forensic"), "NW112")
    assert "clamp_min(1)" not in code_lines(d.fix)
    assert "a count" not in d.fix
    assert any("not a count" in e and "prio" in e for e in d.evidence)
    assert "priorities of exactly 0" in d.explanation and "inf / inf" in d.explanation
    assert "prio = torch.ones(N)" in d.fix
    ast.parse(code_lines(d.fix))


# ------------------------------ 4: eigenvalues ** -0.5 at 0: a floor on the user's line


class _Zca(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xc = x - x.mean(0, keepdim=True)
        C = xc.T @ xc / (x.shape[0] - 1)
        evals, evecs = torch.linalg.eigh(C)
        W = evecs @ torch.diag(evals.pow(-0.5)) @ evecs.T
        return xc @ W


class _ZcaRelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xc = x - x.mean(0, keepdim=True)
        C = xc.T @ xc / (x.shape[0] - 1)
        evals, evecs = torch.linalg.eigh(C)
        W = evecs @ torch.diag(torch.relu(evals) ** -0.5) @ evecs.T
        return xc @ W


def test_a_negative_power_of_eigenvalues_gets_a_floor_not_relu_nor_a_signed_power() -> None:
    torch.manual_seed(0)
    for zca in (_Zca(), _ZcaRelu()):
        m = nn.Sequential(nn.Linear(10, 32), zca)

        def run(m: nn.Module = m) -> None:
            m(torch.randn(16, 10)).sum().backward()

        d = _first(_raises(m, run, "forensic"), "NW112")
        line = "\n".join(ln.split("   #")[0] for ln in code_lines(d.fix).splitlines())
        assert "evals.clamp_min(1e-6) ** -0.5" in line
        assert "relu" not in line and "sign()" not in line and "clamp_min(1)" not in line
        ast.parse(line)
        evals = torch.tensor([-1e-7, 0.0, 2.0])
        exec(line, {"evecs": torch.eye(3), "evals": evals, "torch": torch})
