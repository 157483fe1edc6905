"""Healthy training loops run for many steps, and what they showed.

A regression head that learns its own variance (GaussianNLLLoss, or -Normal.log_prob)
under Adam: as the variance shrinks the loss falls below 0 and the gradients grow as one
over it, noisily, batch by batch; NW303 took a batch's norm, 15 times the median of steps
from before that growth, for an explosion. Labels made the common way, ``y =
torch.zeros(n, dtype=torch.long)`` then ``y[mask] = 1``, are labels: NW210 took the
``torch.zeros`` for a target of one value (a minimax game's side, signed on purpose) and
stayed silent when the loss on them was negated or left unnegated."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical, Normal

import nanwatch

MODES = ("watch", "sentinel")

Loss = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def negated_weighted_ce(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = torch.zeros(x.shape[0], dtype=torch.long)
    y[x[:, 0] > 0] = 1
    y[x[:, 1] > 0.5] = 2
    w = torch.rand(x.shape[0])
    logits = model(x)
    loss = (w * F.cross_entropy(logits, y, reduction="none")).mean() * -1
    return loss


def weighted_ce(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = torch.zeros(x.shape[0], dtype=torch.long)
    y[x[:, 0] > 0] = 1
    y[x[:, 1] > 0.5] = 2
    w = torch.rand(x.shape[0])
    logits = model(x)
    loss = (w * F.cross_entropy(logits, y, reduction="none")).mean()
    return loss


def unnegated_log_prob(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = torch.zeros(x.shape[0], dtype=torch.long)
    y.masked_fill_(x[:, 0] > 0, 1)
    dist = Categorical(logits=model(x))
    loss = dist.log_prob(y).mean()
    return loss


def negative_log_prob(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = torch.zeros(x.shape[0], dtype=torch.long)
    y.masked_fill_(x[:, 0] > 0, 1)
    dist = Categorical(logits=model(x))
    loss = -dist.log_prob(y).mean()
    return loss


def _run(loss_of: Loss, mode: str, steps: int) -> list[nanwatch.Diagnosis]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error", nanwatch.NanwatchWarning)
        with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
            for _ in range(steps):
                loss = loss_of(model, torch.randn(32, 8))
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()
    return list(nw.report.diagnoses)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "case",
    [
        (
            negated_weighted_ce,
            weighted_ce,
            "Loss maximized: it is negated on its way to backward()",
            'loss = (w * F.cross_entropy(logits, y, reduction="none")).mean() * -1',
            'loss = (w * F.cross_entropy(logits, y, reduction="none")).mean()',
        ),
        (
            unnegated_log_prob,
            negative_log_prob,
            "Log-likelihood minimized: the minus sign of the loss is missing",
            "loss = dist.log_prob(y).mean()",
            "loss = -dist.log_prob(y).mean()",
        ),
    ],
    ids=["negated_ce", "log_prob_without_minus"],
)
def test_nw210_names_a_wrong_sign_on_labels_made_by_zeros_then_filled(
    case: tuple[Loss, Loss, str, str, str], mode: str
) -> None:
    wrong, right, title, line, fixed = case
    assert [(d.code, d.step) for d in _run(right, mode, 60)] == []
    found = [d for d in _run(wrong, mode, 6) if d.code == "NW210"]
    assert found, "a wrong sign on filled labels was not named"
    d = found[0]
    assert (d.step, d.title) == (1, title)
    assert any(line in e for e in d.evidence)
    assert d.fix.splitlines()[0].startswith(fixed + "   # was: ")


# ------------------------------------------------ NW303: a loss that learns its own scale


class _MeanAndLogVar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.mu, self.logvar = nn.Linear(64, 1), nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.mu(h), self.logvar(h)


def _gaussian_nll(model: _MeanAndLogVar, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    mu, logvar = model(x)
    return F.gaussian_nll_loss(mu, y, logvar.exp())


def _normal_log_prob(model: _MeanAndLogVar, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    mu, logvar = model(x)
    return -Normal(mu, torch.exp(0.5 * logvar)).log_prob(y).mean()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nll", [_gaussian_nll, _normal_log_prob], ids=["gaussian_nll", "normal"])
def test_a_learned_variance_shrinking_is_no_gradient_explosion(
    nll: Callable[[_MeanAndLogVar, torch.Tensor, torch.Tensor], torch.Tensor], mode: str
) -> None:
    torch.manual_seed(0)
    model = _MeanAndLogVar()
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", nanwatch.NanwatchWarning)
        with nanwatch.watch(model, mode=mode, on_anomaly="raise", postmortem=False) as nw:
            for _ in range(80):
                x = torch.rand(128, 1) * 4 - 2
                loss = nll(model, x, torch.sin(2 * x) + 0.1 * torch.randn_like(x))
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()
                losses.append(loss.item())
    assert [(d.code, d.step) for d in nw.report.diagnoses] == []
    assert sum(losses[-10:]) / 10 < losses[0] - 1  # it trained: the variance shrank
