"""softplus written out by hand, log(1 + exp(x)): its exp overflows float32 at x > 88.7
where softplus is simply x. The fix is F.softplus on the user's own line, not a clamp
inside the hand-written formula (which changes every value above the clamp)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch


class BayesLinear(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.mu = nn.Parameter(torch.randn(8, 4) * 0.1)
        self.rho = nn.Parameter(torch.full((8, 4), -3.0))
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "log":
            sigma = torch.log(1 + torch.exp(self.rho))
        elif self.form == "log1p":
            sigma = torch.log1p(self.rho.exp())
        else:
            sigma = torch.exp(self.rho)
        return F.linear(x, self.mu + sigma * 0.01)


def _fix(form: str, mode: str) -> str:
    torch.manual_seed(0)
    m = BayesLinear(form)
    with torch.no_grad():
        m.rho[0, 0] = 100.0  # e^100 is past float32's 3.4e38
    with nanwatch.watch(m, mode=mode, on_anomaly="record", postmortem=False) as nw:
        m(torch.randn(4, 4)).pow(2).mean().backward()
        nw.step()
    d = nw.report.diagnoses[0]
    assert (d.code, d.op) == ("NW101", "aten.exp")
    return d.fix or ""


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
@pytest.mark.parametrize("form", ["log", "log1p"])
def test_softplus_by_hand_is_fixed_with_softplus(form: str, mode: str) -> None:
    first = _fix(form, mode).splitlines()[0].split("  #", 1)[0].strip()
    assert first == "sigma = F.softplus(self.rho)"
    rho = torch.tensor([-3.0, 0.0, 20.0, 100.0])
    ns: dict[str, Any] = {"F": F, "torch": torch, "self": type("S", (), {"rho": rho})()}
    exec(first, ns)
    assert torch.isfinite(ns["sigma"]).all()
    healthy = torch.log(1 + torch.exp(rho[:3]))
    assert torch.allclose(ns["sigma"][:3], healthy)  # the same function where it was finite


def test_a_plain_exp_keeps_its_bound_not_softplus() -> None:
    fix = _fix("exp", "watch")
    assert "softplus(self.rho)" not in fix.splitlines()[0]
    assert ".clamp(max=" in fix.splitlines()[0]
