"""NW110 follow-ups: SAC's tanh-squash correction log(1 - tanh(u)^2) is named as such and
rewritten with the stable identity, not as a sigmoid/BCE; the log-prob of an action its
mask gave probability 0 is named as that, not as a log of an underflowed probability; a
logit written by hand, log(x) - log1p(-x), reports both of its -inf sources and is
rewritten with torch.logit."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical, Normal

import nanwatch

torch.set_num_threads(1)


def _diag(run) -> nanwatch.Diagnosis:
    with pytest.raises(nanwatch.AnomalyError) as info:
        run()
    return info.value.diagnoses[0]


def _line_of(snippet: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if snippet in line)


# ---------------------------------------------------------------- item 1: SAC tanh squash


class _Actor(nn.Module):
    def __init__(self, *, healthy: bool) -> None:
        super().__init__()
        self.net = nn.Linear(3, 4)
        self.healthy = healthy

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, log_std = self.net(obs).chunk(2, -1)
        dist = Normal(mu, log_std.clamp(-20, 2).exp())
        u = dist.rsample()
        a = torch.tanh(u)
        if self.healthy:
            logp = dist.log_prob(u) - 2 * (math.log(2) - u - F.softplus(-2 * u))
        else:
            logp = dist.log_prob(u) - torch.log(1 - a.pow(2))
        return a, logp.sum(-1)


def _sac(mode: str = "watch", *, healthy: bool = False) -> None:
    torch.manual_seed(0)
    actor = _Actor(healthy=healthy)
    with nanwatch.watch(actor, mode=mode) as nw:
        a, logp = actor(torch.randn(8, 3) * 30)  # unnormalized observations
        (0.2 * logp - a.sum(-1)).mean().backward()
        nw.step()


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_sac_tanh_correction_gets_the_stable_identity(mode: str) -> None:
    d = _diag(lambda: _sac(mode))
    assert d.code == "NW110"
    assert d.source is not None and d.source.endswith(f":{_line_of('torch.log(1 - a.pow(2))')}")
    assert "tanh-squash" in d.explanation and "sigmoid" not in d.explanation
    assert "logp = dist.log_prob(u) - 2 * (math.log(2) - u - F.softplus(-2 * u))" in d.fix
    assert "logits" not in d.fix and "binary_cross_entropy" not in d.fix
    assert "a = torch.tanh(u)" in "\n".join(d.evidence)


def test_stable_sac_correction_stays_silent() -> None:
    _sac(healthy=True)


# ------------------------------------------------- item 2: log_prob of a masked action


class _Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return self.body(obs).masked_fill(~legal, float("-inf"))


def _reinforce(mode: str, *, rollout_no_grad: bool, healthy: bool = False) -> None:
    torch.manual_seed(0)
    pi = _Policy()
    obs = torch.randn(4, 4)
    legal = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 1], [1, 1, 1]], dtype=torch.bool)
    a = torch.tensor([0, 0, 2, 1]) if healthy else torch.tensor([2, 0, 1, 1])
    adv = torch.tensor([1.0, 0.5, -1.0, 0.2])
    with nanwatch.watch(pi, mode=mode) as nw:
        if rollout_no_grad:
            with torch.no_grad():
                pi(obs, legal)
        logp = Categorical(logits=pi(obs, legal)).log_prob(a)
        loss = -(logp * adv).mean()
        loss.backward()
        nw.step()


@pytest.mark.parametrize("rollout_no_grad", [True, False])
@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_log_prob_of_a_masked_action_is_named(mode: str, rollout_no_grad: bool) -> None:
    d = _diag(lambda: _reinforce(mode, rollout_no_grad=rollout_no_grad))
    assert d.code == "NW110"
    assert "masked action" in d.title
    assert "probability 0" in d.explanation and "illegal actions" in d.explanation
    assert "log_softmax" not in d.fix and "binary_cross_entropy" not in d.fix
    assert "torch.finfo(torch.float32).min" in d.fix
    assert "legal.gather(-1, actions.unsqueeze(-1)).all()" in d.fix
    assert "Policy" in "\n".join(d.evidence)
    if mode == "forensic":  # the mask line is known: rewritten in the user's names
        assert "return self.body(obs).masked_fill(~legal, torch.finfo(torch.float32).min)" in d.fix


def test_legal_actions_stay_silent() -> None:
    _reinforce("watch", rollout_no_grad=True, healthy=True)


# ------------------------------------------------------ item 3: a logit written by hand


class _Logit(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x) - torch.log1p(-x)


def _flow(x: torch.Tensor) -> None:
    torch.manual_seed(0)
    flow = nn.Sequential(_Logit(), nn.Linear(8, 8))
    with nanwatch.watch(flow) as nw:
        loss = (0.5 * flow(x) ** 2).mean()
        loss.backward()
        nw.step()


_PIXELS = torch.tensor([[0, 17, 64, 128, 200, 255, 3, 90]] * 4, dtype=torch.float32) / 255


def test_hand_written_logit_reports_both_ends_and_uses_torch_logit() -> None:
    d = _diag(lambda: _flow(_PIXELS))
    assert d.code == "NW110"
    text = "\n".join(d.evidence)
    assert "where x is 0" in text and "where x is 1" in text
    assert "return torch.logit(x, eps=torch.finfo(x.dtype).eps)" in d.fix
    assert "log_softmax" not in d.fix and "logsigmoid" not in d.fix


def test_logit_of_pixels_inside_the_interval_stays_silent() -> None:
    _flow(_PIXELS.clamp(1e-3, 1 - 1e-3))
