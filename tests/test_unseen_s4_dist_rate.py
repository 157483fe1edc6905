"""A count model whose Poisson rate is a ReLU output: ``-D.Poisson(rate).log_prob(y)`` is
+inf where the rate is exactly 0 and the count is above 0. Poisson's log_prob is
``value.xlogy(rate)``: the log operand is the model's rate, not the value. Forensic mode
said "the value given to Poisson.log_prob (y) sits on the edge of the support ... the
parameters are fine" and clamped the counts; sentinel told a probability put together by
hand. Now every mode names the model-made log operand (its producer, the relu) and the
fix (a softplus rate, or a log-rate); a Beta target at 0 or 1 keeps its value story, and
the softplus rate trains clean."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributions as D
from torch import nn
from torch.nn import functional as F

import nanwatch

torch.set_num_threads(1)

MODES = ["sentinel", "watch", "forensic"]


class _CountNet(nn.Module):
    def __init__(self, soft: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.soft = soft

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raw = self.net(x).squeeze(-1)
        return F.softplus(raw) + 1e-6 if self.soft else torch.relu(raw)


def _poisson(mode: str, soft: bool = False) -> tuple[nanwatch.Watcher, float]:
    torch.manual_seed(1)
    model = _CountNet(soft)
    x = torch.randn(64, 4)
    y = torch.poisson(torch.full((64,), 3.0))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    losses: list[float] = []
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            rate = model(x)
            loss = -D.Poisson(rate).log_prob(y).mean()
            losses.append(float(loss.detach()))
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw, losses[0]


@pytest.mark.parametrize("mode", MODES)
def test_a_relu_poisson_rate_at_zero_is_the_rate_not_the_counts(mode: str) -> None:
    nw, loss = _poisson(mode)
    assert math.isinf(loss)
    d = nw.report.diagnoses[0]
    assert d.code == "NW110", str(nw.report)
    text = " ".join([*d.evidence, d.explanation])
    assert "log operand" in text and "is the model's, made by relu" in text, text
    assert "the value passed to log_prob is not the bad operand" in d.explanation
    assert "The parameters are fine" not in text
    assert "sits on the edge of the support" not in text
    assert "F.softplus(raw) + 1e-6" in d.fix
    assert "log_input=True" in d.fix
    assert "clamp_min" not in d.fix  # no clamp of the counts


def test_forensic_names_the_distribution_and_its_argument() -> None:
    nw, _ = _poisson("forensic")
    d = nw.report.diagnoses[0]
    assert "inside Poisson.log_prob" in d.explanation
    assert "xlogy's log operand (rate) is the model's" in " ".join(d.evidence)
    assert "Poisson.log_prob takes the log of the rate, not of the value" in d.fix


@pytest.mark.parametrize("mode", MODES)
def test_the_softplus_rate_trains_clean(mode: str) -> None:
    nw, loss = _poisson(mode, soft=True)
    assert math.isfinite(loss)
    assert not [d for d in nw.report.diagnoses if d.severity in ("warning", "error")], str(
        nw.report
    )


class _BetaReg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = F.softplus(self.net(x)).unbind(-1)
        return a + 1e-3, b + 1e-3


@pytest.mark.parametrize("mode", MODES)
def test_a_beta_target_at_zero_keeps_the_value_story(mode: str) -> None:
    torch.manual_seed(0)
    model = _BetaReg()
    x = torch.randn(32, 3)
    y = torch.rand(32)
    y[3], y[7] = 0.0, 1.0
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        a, b = model(x)
        (-D.Beta(a, b).log_prob(y).mean()).backward()
        nw.step()
    d = nw.report.diagnoses[0]
    assert d.code == "NW110", str(nw.report)
    assert "sits on the edge of the support (0, 1)" in " ".join(d.evidence)
    assert "is the model's" not in " ".join(d.evidence)
