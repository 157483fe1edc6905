"""NW303 (exploding gradients) on healthy policy-gradient loops: a converging policy's
gradient norms are tiny, and a rare action's normalized advantage makes one step's norm
hundreds of times the recent ones, back to the size the run began with, while the update
still moves the weights by a sliver. That is no explosion, over 160 steps in sentinel and
in watch mode. Still an explosion: a norm far past the run's first level, an update that
moves the weights by a tenth of their size or more, a norm that keeps growing, and PPO
whose old log-probabilities came from another policy."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from nanwatch.records import StepTrace
from nanwatch.rules.testing import TraceBuilder, diagnose, stat
from tests.test_unseen_healthy_losses import LOOPS, Step, _loud, _mlp, _sgd_step, _watch

torch.set_num_threads(1)

# ------------------------------------------------------------------ healthy loops, long


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
@pytest.mark.parametrize("name", ["reinforce_bernoulli", "ppo_clipped"])
def test_nw303_a_converged_policys_rare_action_is_no_explosion(name: str, mode: str) -> None:
    """REINFORCE with a normalized advantage (Adam 1e-2) and PPO (Adam 3e-3): after about
    130 steps a rare action's advantage makes one step's norm 700x (12x for PPO) the
    median of the 32 before, about the norm of the first steps; the update moves the
    weights by a few percent of their norm. It was NW303 at step 132 (144 for PPO)."""
    torch.manual_seed(0)
    modules, step = LOOPS[name]()
    nw, alarms = _watch(modules, step, mode, steps=160)
    assert _loud(nw, alarms) == []


def _ppo_stale_old_log_probs(fault_at: int) -> tuple[list[nn.Module], Step]:
    """PPO (the healthy loop's policy, Adam 3e-3), whose rollout at step ``fault_at`` keeps
    old log-probabilities 15 nats too low (taken from another policy): the ratio
    exp(new - old) is about 3e6, and a negative advantage's unclipped term carries it."""
    policy = _mlp(8, 4)
    opt = torch.optim.Adam(policy.parameters(), lr=3e-3)
    rollout: dict[str, torch.Tensor] = {}

    def step(i: int) -> None:
        if i % 4 == 0:
            obs = torch.randn(64, 8)
            with torch.no_grad():
                dist = torch.distributions.Categorical(logits=policy(obs))
                act = dist.sample()
                old = dist.log_prob(act) - (15.0 if i == fault_at else 0.0)
            ret = (act == 2).float() + 0.1 * torch.randn(64)
            rollout.update(obs=obs, act=act, old=old, adv=(ret - ret.mean()) / ret.std())
        r = rollout
        dist = torch.distributions.Categorical(logits=policy(r["obs"]))
        ratio = torch.exp(dist.log_prob(r["act"]) - r["old"])
        surrogate = torch.min(ratio * r["adv"], torch.clamp(ratio, 0.8, 1.2) * r["adv"])
        _sgd_step(opt, -surrogate.mean() - 0.01 * dist.entropy().mean())

    return [policy], step


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_nw303_ppo_with_stale_old_log_probs_is_an_explosion(mode: str) -> None:
    torch.manual_seed(0)
    modules, step = _ppo_stale_old_log_probs(120)
    nw, _ = _watch(modules, step, mode, steps=121)
    found = [(t.step, d) for t in nw.history for d in t.diagnoses if d.code == "NW303"]
    assert [s for s, _ in found] == [120]
    assert "total gradient norm" in found[0][1].evidence[0]


# ------------------------------------------------------------------ what tells them apart

#: a policy net's weights: 320 values in two layers, ||w|| = 5
_SHAPES = {"0.weight": (32, 8), "2.weight": (1, 32)}
_WEIGHTS = {"weight_norms": {"0.weight": ("float32", 4.0), "2.weight": ("float32", 3.0)}}


def _trace(i: int, total: float, optimizer: str = "Adam", lr: float = 1e-2) -> StepTrace:
    """A step of a policy net: its total gradient norm ``total`` split over its two
    weights, and the optimizer that applied it."""
    b = TraceBuilder(i)
    net = b.call("Policy", root=True)
    b.input(net, stat(-2.0, 2.0, numel=256), shape=(32, 8))
    out = b.forward(net, stat(-3.0, 3.0, numel=32), shape=(32, 1))
    b.backward(out, stat(-total / 10, total / 10, numel=32))
    for name, shape in _SHAPES.items():
        b.gradient("Policy", name, total / math.sqrt(2), shape=shape, numel=math.prod(shape))
    groups = [{"group": 0, "params": 2, "names": list(_SHAPES), "dtypes": ["float32"], "lr": lr}]
    b.note("optimizer", optimizer, groups=groups, ident=1)
    return b.build(grad_norm=total, loss=0.01)


def _history(*late: float, optimizer: str = "Adam", lr: float = 1e-2) -> list[StepTrace]:
    """Four steps at the norm the run began with (about 0.75), 28 converged ones (about
    1.5e-3), then ``late``."""
    norms = [0.8, 0.7, 0.75, 0.72] + [1.5e-3 * (1 + 0.3 * math.sin(i)) for i in range(28)]
    return [_trace(i, g, optimizer, lr) for i, g in enumerate([*norms, *late])]


def _nw303(total: float, *late: float, optimizer: str = "Adam", lr: float = 1e-2) -> bool:
    """Whether NW303 fires on a step of total norm ``total`` after :func:`_history`."""
    hist = _history(*late, optimizer=optimizer, lr=lr)
    cur = _trace(len(hist), total, optimizer, lr)
    return any(d.code == "NW303" for d in diagnose(cur, hist, facts=_WEIGHTS))


def test_nw303_one_step_back_to_the_first_level_is_no_explosion() -> None:
    # 750x the converged median, 1.5x the first steps; Adam moves each value by about lr
    assert not _nw303(1.2)
    # without the weights read, nothing says the update is small: still NW303
    hist = _history()
    assert any(d.code == "NW303" for d in diagnose(_trace(len(hist), 1.2), hist))


def test_nw303_a_norm_far_past_the_first_level_still_explodes() -> None:
    assert _nw303(9.0)  # 12x the median of the first steps


def test_nw303_an_update_a_tenth_of_the_weights_still_explodes() -> None:
    # SGD moves the weights by lr x 1.2: 0.012 of ||w|| = 5 at lr 1e-2, 0.24 at lr 1
    assert not _nw303(1.2, optimizer="SGD", lr=1e-2)
    assert _nw303(1.2, optimizer="SGD", lr=1.0)
    # Adam's step of about lr per value: lr 0.5 x sqrt(320) is 1.8 times ||w||
    assert _nw303(1.2, optimizer="Adam", lr=0.5)


def test_nw303_a_norm_that_keeps_growing_still_explodes() -> None:
    # the step before was already 200x the level: 1.2 after it is no growth, 4x is
    assert not _nw303(1.2, 1.0)
    assert _nw303(1.2, 0.3)
