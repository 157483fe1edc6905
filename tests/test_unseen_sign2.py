"""NW210 on a loss minimized with the wrong sign: a per-element loss weighted by the batch
(sample weights, class weights picked by the labels) and then negated, and a
distribution's log-likelihood of observed labels (Bernoulli, Categorical, Normal) left
without its minus. Each is named in watch and in sentinel mode with the gradient evidence
and the user's line rewritten. Left alone: the same code with the right sign, a policy
gradient (log_prob of a sampled action times its cost, every cost above 0), and a
minimax game's side (a generator maximizing its discriminator's loss on a target of one
value)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Bernoulli, Categorical, Normal

import nanwatch

MODES = ("watch", "sentinel")

Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _nw210(loss_of: Loss, mode: str, classes: int, *, labels: str = "class") -> list[Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, classes))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
            for _ in range(6):
                x = torch.randn(32, 8)
                y = (
                    torch.randint(0, classes, (32,))
                    if labels == "class"
                    else (torch.rand(32) > 0.5).float()
                    if labels == "binary"
                    else torch.randn(32)
                )
                w = torch.rand(32)  # per-sample weights from the batch: >= 0
                loss = loss_of(model, x, y, w)
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()
    return [d for d in nw.report.diagnoses if d.code == "NW210"]


# ----------------------------------------------------------------- a: negated weighted sums


def batch_weighted_ce(model: nn.Module, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> Any:
    logits = model(x)
    loss = (w * F.cross_entropy(logits, y, reduction="none")).mean() * -1
    return loss


def class_weighted_nll(model: nn.Module, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> Any:
    class_w = torch.tensor([1.0, 2.0, 0.5])
    nll = F.nll_loss(F.log_softmax(model(x), dim=1), y, reduction="none")
    loss = -(class_w[y] * nll).mean()
    return loss


def weighted_bce(model: nn.Module, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> Any:
    logits = model(x).squeeze(1)
    loss = -(w * F.binary_cross_entropy_with_logits(logits, y, reduction="none")).mean()
    return loss


_NEGATED = [
    (
        batch_weighted_ce,
        3,
        "class",
        "F.cross_entropy",
        "'* -1'",
        'loss = (w * F.cross_entropy(logits, y, reduction="none")).mean() * -1',
        'loss = (w * F.cross_entropy(logits, y, reduction="none")).mean()',
    ),
    (
        class_weighted_nll,
        3,
        "class",
        "F.nll_loss",
        "'-'",
        "loss = -(class_w[y] * nll).mean()",
        "loss = (class_w[y] * nll).mean()",
    ),
    (
        weighted_bce,
        1,
        "binary",
        "F.binary_cross_entropy_with_logits",
        "'-'",
        'loss = -(w * F.binary_cross_entropy_with_logits(logits, y, reduction="none")).mean()',
        'loss = (w * F.binary_cross_entropy_with_logits(logits, y, reduction="none")).mean()',
    ),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spec", _NEGATED, ids=[c[0].__name__ for c in _NEGATED])
def test_nw210_names_a_batch_weighted_loss_that_the_code_negates(spec: Any, mode: str) -> None:
    case, classes, labels, loss, sign, line, fixed = spec
    found = _nw210(case, mode, classes, labels=labels)
    assert found, "a negated per-element loss was not named"
    d = found[0]
    assert d.step == 1
    assert d.title == "Loss maximized: it is negated on its way to backward()"
    assert d.path == loss
    assert d.evidence == [
        f"{loss}(..., reduction='none') has terms >= 0, but the total loss sent a negative "
        "gradient to every one of them: 64 terms over the last 2 steps, none spared",
        f"the code negates it with {sign}: {line}",
    ]
    assert d.fix == f"{fixed}   # was: {line}"


# ------------------------------------------------------- b: the log-likelihood of labels


def bernoulli_ll(model: nn.Module, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> Any:
    dist = Bernoulli(logits=model(x).squeeze(1))
    loss = dist.log_prob(y).mean()
    return loss


def categorical_ll(model: nn.Module, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> Any:
    log_lik = Categorical(logits=model(x)).log_prob(y)
    loss = log_lik.mean()
    return loss


def normal_ll(model: nn.Module, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> Any:
    mu, raw = model(x).unbind(1)
    return Normal(mu, F.softplus(raw) + 0.1).log_prob(y).mean()


_UNNEGATED = [
    (
        bernoulli_ll,
        1,
        "binary",
        "Bernoulli",
        "loss = dist.log_prob(y).mean()",
        "loss = -dist.log_prob(y).mean()",
    ),
    (categorical_ll, 3, "class", "Categorical", "loss = log_lik.mean()", "loss = -log_lik.mean()"),
    (
        normal_ll,
        2,
        "real",
        "Normal",
        "return Normal(mu, F.softplus(raw) + 0.1).log_prob(y).mean()",
        "return -Normal(mu, F.softplus(raw) + 0.1).log_prob(y).mean()",
    ),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spec", _UNNEGATED, ids=[c[0].__name__ for c in _UNNEGATED])
def test_nw210_names_a_log_likelihood_of_labels_left_without_its_minus(
    spec: Any, mode: str
) -> None:
    case, classes, labels, dist, line, fixed = spec
    found = _nw210(case, mode, classes, labels=labels)
    assert found, "a minimized log-likelihood was not named"
    d = found[0]
    assert d.step == 1
    assert d.title == "Log-likelihood minimized: the minus sign of the loss is missing"
    assert d.path == f"{dist}.log_prob"
    assert d.evidence == [
        f"{dist}.log_prob(y) is the log-likelihood of data (the target is no sample of the "
        "model): training should raise it, but the total loss sent a positive gradient to "
        "every one of its terms: 64 terms over the last 2 steps, none spared",
        f"nothing negates it on its way to the loss: {line}",
    ]
    assert d.fix == f"{fixed}   # was: {line}"


# ------------------------------------------------------------------------- left alone


def right_signs(model: nn.Module, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> Any:
    logits = model(x)
    ce = (w * F.cross_entropy(logits, y, reduction="none")).mean()
    return ce - Categorical(logits=logits).log_prob(y).mean()


def reinforce_costs(model: nn.Module, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> Any:
    # REINFORCE minimizing an expected cost (every cost > 0, no baseline): cost x log_prob,
    # with no minus. Each log_prob term gets a positive gradient, rightly: the action was
    # sampled from the policy itself, and a costly one is made less likely
    dist = Categorical(logits=model(x))
    actions = dist.sample()
    costs = 1.0 + w
    loss = (dist.log_prob(actions) * costs).mean()
    return loss


def generator_minimax(model: nn.Module, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> Any:
    # the saturating GAN generator: it maximizes the discriminator's loss on its fakes
    d_fake = model(x).squeeze(1)
    bce = F.binary_cross_entropy_with_logits(d_fake, torch.zeros(32), reduction="none")
    return -bce.mean()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("case", "classes"), [(right_signs, 3), (reinforce_costs, 3), (generator_minimax, 1)]
)
def test_nw210_leaves_right_signs_policy_gradients_and_minimax_alone(
    case: Loss, classes: int, mode: str
) -> None:
    assert _nw210(case, mode, classes) == []


def test_log_prob_is_given_back_after_the_watch() -> None:
    own = {c: c.__dict__["log_prob"] for c in (Bernoulli, Categorical, Normal)}
    with nanwatch.watch(nn.Linear(2, 2), postmortem=False):
        assert Bernoulli.__dict__["log_prob"] is not own[Bernoulli]
    assert {c: c.__dict__["log_prob"] for c in own} == own
