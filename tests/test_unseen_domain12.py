"""NW110/NW111 for zeros that an underflow made where the old text blamed probabilities,
data or buffers: a softplus scale head at exactly 0 (a Gaussian NLL's log(sigma) and
/ sigma), a mixture density whose exp(-z²/2) underflowed for a far point (values above 1
are no sign of data: a density exceeds 1), and a noise level that is both logged and
divided by on one line."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises
from tests._diagnoses import text

torch.set_num_threads(1)


# ----------------------------------------------------------- a softplus scale head at 0


class _ScaleHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mu = nn.Linear(3, 1)
        self.sig = nn.Linear(3, 1)
        with torch.no_grad():
            self.sig.bias.fill_(-200.0)  # softplus(-200) = 0 in float32

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mu(x), self.sig(x)


def _gaussian_nll(net: _ScaleHead) -> None:
    x, y = torch.randn(16, 3) * 0.01, torch.randn(16, 1)
    mu, raw = net(x)
    sigma = F.softplus(raw)
    loss = (torch.log(sigma) + 0.5 * ((y - mu) / sigma) ** 2).mean()
    loss.backward()


def test_nw110_names_a_softplus_scale_that_underflowed() -> None:
    torch.manual_seed(0)
    net = _ScaleHead()
    d = _first(_raises(net, lambda: _gaussian_nll(net)), "NW110")
    assert "softplus output that underflowed to exactly 0" in d.explanation
    assert "F.softplus(raw) + 1e-6" in d.fix
    everything = text(d)
    assert "log_softmax" not in everything and "pixels" not in everything
    assert "-200" in everything  # the raw head's output, below softplus's underflow bound


def test_nw111_fixes_the_softplus_not_only_the_divisor() -> None:
    torch.manual_seed(0)
    net = _ScaleHead()
    err = _raises(net, lambda: _gaussian_nll(net), mode="forensic")
    d = err.diagnoses[0]
    assert d.code in ("NW110", "NW111")
    assert "sigma = F.softplus(raw) + 1e-6" in d.fix
    assert "clamp_min" not in d.fix  # a clamp on the divisor leaves log(sigma) = -inf
    assert "torch.zeros" not in d.explanation and "running statistics" not in d.explanation
    if d.code == "NW111":
        assert any("torch.log(sigma)" in e for e in d.evidence)
    # the fix works: sigma is positive where softplus alone is 0
    raw = torch.full((4,), -200.0)
    assert (F.softplus(raw) == 0).all() and (F.softplus(raw) + 1e-6 > 0).all()


# ------------------------------------------------- a mixture density's exp underflowing

_INV_SQRT_2PI = 1.0 / math.sqrt(2 * math.pi)


def _density(sigma: torch.Tensor, mu: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _INV_SQRT_2PI * torch.exp(-0.5 * ((y - mu) / sigma) ** 2) / sigma


class _Mdn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pi = nn.Linear(1, 3)
        self.sigma = nn.Linear(1, 3)
        self.mu = nn.Linear(1, 3)
        with torch.no_grad():
            self.sigma.weight.zero_()
            self.sigma.bias.fill_(math.log(0.1))  # sigma = 0.1: densities up to ~4
            self.mu.weight.zero_()
            self.mu.bias.zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.softmax(self.pi(x), 1), torch.exp(self.sigma(x)), self.mu(x)


def _mdn_step(net: _Mdn) -> None:
    x = torch.rand(8, 1)
    y = torch.zeros(8, 1)
    y[0] = 50.0  # 500 standard deviations from every component: its exp is 0
    pi, sigma, mu = net(x)
    prob = pi * _density(sigma, mu, y)
    nll = -torch.log(torch.sum(prob, dim=1))
    nll.mean().backward()


def test_nw110_mixture_density_zero_is_an_exp_underflow() -> None:
    for mode in ("watch", "forensic"):
        torch.manual_seed(0)
        net = _Mdn()
        d = _first(_raises(net, lambda n=net: _mdn_step(n), mode=mode), "NW110")
        everything = text(d)
        assert "not from an underflow" not in everything, mode
        assert "is not a probability" not in everything, mode
        assert "exp(a) is exactly 0" in d.explanation, mode
        assert "torch.logsumexp(torch.log(pi) + " in d.fix, mode
        assert ".log_prob(y)" in d.fix, mode


# -------------------------------------------- a noise level both logged and divided by


class _Score(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, sigma.log()], 1)) / sigma


def test_nw110_logged_and_divided_noise_level_must_stay_positive() -> None:
    torch.manual_seed(0)
    net = _Score()
    sigma = torch.linspace(1, 0, 8)[:, None]  # a schedule down to 0
    x = torch.randn(8, 2)
    d = _first(_raises(net, lambda: net(x, sigma).pow(2).mean().backward()), "NW110")
    assert "sigma_min" in d.fix and "sigma must be > 0" in d.fix
    assert "clamp_min" not in d.fix  # a floor on the log alone leaves x / sigma = inf
    everything = text(d)
    assert "pixels" not in everything and "log_softmax" not in everything
    assert "divides by sigma" in d.explanation
