"""Bayes-by-backprop with the softplus written by hand, ``sigma = torch.log(1 +
torch.exp(self.rho))``, and ``rho`` initialized at 100 (sigma about 100): exp(100)
overflows float32 at step 0. NW101 said rho "is used as a log ... initialised to the
quantity itself" and told to initialise it to log(100), keeping the hand-written softplus
with a clamp inside. In log(1 + exp(rho)), rho is the quantity (softplus grows linearly):
the fix is F.softplus(self.rho), which gives the same sigma without the overflow, and
trains clean from the same init."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nanwatch

torch.set_num_threads(1)

MODES = ["sentinel", "watch", "forensic"]


class _BayesLinear(nn.Module):
    def __init__(self, n_in: int, n_out: int, rho0: float, fixed: bool) -> None:
        super().__init__()
        self.mu = nn.Parameter(torch.randn(n_out, n_in) * 0.1)
        self.rho = nn.Parameter(torch.full((n_out, n_in), rho0))
        self.fixed = fixed
        self.kl = torch.zeros(())

    def sigma(self) -> torch.Tensor:
        if self.fixed:
            return F.softplus(self.rho)
        sigma = torch.log(1 + torch.exp(self.rho))
        return sigma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sigma = self.sigma()
        w = self.mu + sigma * torch.randn_like(sigma)
        self.kl = (-torch.log(sigma) + 0.5 * (sigma**2 + self.mu**2) - 0.5).sum()
        return x @ w.t()


def _train(mode: str, fixed: bool) -> tuple[nanwatch.Watcher, float]:
    torch.manual_seed(0)
    l1, l2 = _BayesLinear(3, 16, 100.0, fixed), _BayesLinear(16, 1, 100.0, fixed)
    model = nn.Sequential(l1, nn.ReLU(), l2)
    x, y = torch.randn(32, 3), torch.randn(32, 1)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    losses: list[float] = []
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            loss = F.mse_loss(model(x), y) + 1e-3 * (l1.kl + l2.kl)
            losses.append(float(loss.detach()))
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw, losses[0]


@pytest.mark.parametrize("mode", MODES)
def test_a_hand_written_softplus_overflow_gets_f_softplus(mode: str) -> None:
    nw, _ = _train(mode, fixed=False)
    d = nw.report.diagnoses[0]
    assert d.code == "NW101", str(nw.report)
    assert d.fix.startswith("sigma = F.softplus(self.rho)"), d.fix
    text = " ".join([*d.evidence, d.explanation, d.fix])
    assert "used as a log" not in text
    assert "math.log(100.0)" not in text


@pytest.mark.parametrize("mode", MODES)
def test_f_softplus_from_the_same_init_trains_clean(mode: str) -> None:
    nw, loss = _train(mode, fixed=True)
    assert math.isfinite(loss)
    assert not [d for d in nw.report.diagnoses if d.severity in ("warning", "error")], str(
        nw.report
    )
