"""Localization of loss code that reads a module's unseen output, leaves created non-finite,
and weights an optimizer step made non-finite before an evaluation found them."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.distributions import Normal

import nanwatch
from nanwatch.localize import leaf_text
from nanwatch.records import OpEvent, Phase, TensorStat

torch.set_num_threads(1)


class _PolicyOut:  # a plain object: nanwatch sees no tensor in it
    def __init__(self, mu: torch.Tensor, std: torch.Tensor) -> None:
        self.mu, self.std = mu, std


class _Actor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mu = nn.Linear(3, 2)
        self.log_std = nn.Parameter(torch.zeros(2))

    def forward(self, obs: torch.Tensor) -> _PolicyOut:
        return _PolicyOut(self.mu(obs), self.log_std.exp())


def _ppo(old_logp_value: float, mode: str = "watch") -> None:
    torch.manual_seed(0)
    actor = _Actor()
    opt = torch.optim.SGD(actor.parameters(), lr=1e-3)
    obs, act, adv = torch.randn(8, 3), torch.randn(8, 2), torch.rand(8) + 0.1
    old_logp = torch.full((8,), old_logp_value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(actor, mode=mode, postmortem=False) as nw:  # type: ignore[arg-type]
            out = actor(obs)
            logp = Normal(out.mu, out.std).log_prob(act).sum(-1)
            ratio = torch.exp(logp - old_logp)
            loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_ppo_ratio_overflow_after_an_unseen_output_is_the_loss_codes(mode: str) -> None:
    with pytest.raises(nanwatch.AnomalyError) as info:
        _ppo(-200.0, mode)
    a = info.value.anomaly
    assert a is not None and a.path == "(loss)"
    assert "born in the backward of (loss), the loss code" in a.summary
    assert "code in _Actor" not in a.summary
    assert "on its way to the output of _Actor" in a.summary
    d = info.value.diagnoses[0]
    assert d.code in ("NW100", "NW101")
    assert "exp" in (d.fix or "")


def test_healthy_ppo_with_an_unseen_output_stays_silent() -> None:
    _ppo(-3.0)


def _sac(init_alpha: float) -> None:
    torch.manual_seed(0)
    actor, critic = nn.Linear(3, 1), nn.Linear(3, 1)
    a_opt = torch.optim.Adam(actor.parameters(), 1e-3)
    c_opt = torch.optim.Adam(critic.parameters(), 1e-3)
    log_alpha = torch.tensor(
        math.log(init_alpha) if init_alpha > 0 else -math.inf, requires_grad=True
    )
    al_opt = torch.optim.Adam([log_alpha], lr=3e-4)
    with nanwatch.watch(actor, critic, postmortem=False) as nw:
        for _ in range(3):
            o = torch.randn(16, 3)
            c_loss = critic(o).pow(2).mean()
            c_opt.zero_grad()
            c_loss.backward()
            c_opt.step()
            logp = actor(o).squeeze(-1)
            a_loss = (log_alpha.exp().detach() * logp).mean()
            a_opt.zero_grad()
            a_loss.backward()
            a_opt.step()
            al_loss = -(log_alpha * (logp.detach() + 1.0)).mean()
            al_opt.zero_grad()
            al_loss.backward()
            al_opt.step()
            nw.step()


def test_a_sac_temperature_created_as_minus_inf_is_named_by_the_value_it_holds() -> None:
    with pytest.raises(nanwatch.AnomalyError) as info:
        _sac(0.0)
    a = info.value.anomaly
    assert a is not None
    assert a.summary.startswith("-inf in log_alpha")
    assert not a.summary.startswith("NaN")


def test_healthy_sac_temperature_stays_silent() -> None:
    _sac(0.1)


def _leaf_event(version: int | None) -> OpEvent:
    stat = TensorStat(-math.inf, -math.inf, 1)
    scalars: dict[str, float | int | str] = {
        "leaf": "self",
        "leaf_shape": "()",
        "leaf_parameter": 0,
        "leaf_name": "log_alpha",
        "leaf_optimizer": "al_opt",
    }
    if version is not None:
        scalars["leaf_version"] = version
    return OpEvent(
        op="aten.mul.Tensor",
        phase=Phase.FORWARD,
        path=None,
        born="-inf",
        output=stat,
        inputs=[("self", stat)],
        scalars=scalars,
        node="MulBackward0",
        dtype="float32",
        injected=True,
    )


def test_a_leaf_never_written_is_said_to_be_created_non_finite() -> None:
    text = leaf_text(_leaf_event(0)) or ""
    assert "created non-finite" in text and "log(0)" in text
    assert "an update at an earlier step wrote it" not in text
    # a leaf an update did write keeps the update's story
    written = leaf_text(_leaf_event(3)) or ""
    assert "an update at an earlier step wrote it" in written
    assert "created non-finite" not in (leaf_text(_leaf_event(None)) or "")


def test_the_rule_for_a_leaf_never_written_fixes_the_init_not_the_step() -> None:
    from nanwatch.config import Thresholds
    from nanwatch.records import Anomaly, AnomalyKind, Record, StepTrace
    from nanwatch.rules.base import REGISTRY, RuleContext
    from nanwatch.rules.generic import non_finite

    ev = _leaf_event(0)
    rec = Record(0, 1, Phase.FORWARD, "(loss)", "output", "float32", "cpu", ())
    a = Anomaly(
        step=1,
        kind=AnomalyKind.FORWARD,
        path="(loss)",
        record=rec,
        origin="loss-code",
        summary="-inf in log_alpha",
        op=ev,
    )
    ctx = RuleContext(
        trace=StepTrace(step=1, anomaly=a),
        history=[],
        thresholds=Thresholds(),
        rule=REGISTRY["NW100"],
    )
    (d,) = non_finite(ctx)
    assert "created non-finite" in d.explanation
    assert "al_opt.step()" not in (d.fix or "")
    assert "assert torch.isfinite(log_alpha).all(), log_alpha" in (d.fix or "")
    assert "log of a positive initial value" in (d.fix or "")


def test_an_evaluation_after_the_update_names_the_optimizer_in_the_summary() -> None:
    from tests.test_unseen_watcher4 import _dp_sgd

    def adam(ps):  # type: ignore[no-untyped-def]
        return torch.optim.Adam(ps, lr=1e-3, eps=0.0)

    with pytest.raises(nanwatch.AnomalyError) as info:
        _dp_sgd(adam, bad=False, evaluate=True, zero_col=True)
    a = info.value.anomaly
    assert a is not None and a.parameter == "0.weight"
    assert "code autograd does not see" not in a.summary
    assert ".data write" not in a.summary
    assert "Adam optimizer step" in a.summary
    (d,) = [d for d in info.value.diagnoses if d.code == "NW301"]
    assert "eps is 0" in d.title


class _Score(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, padding_idx=0)

    def forward(self, q_ids: torch.Tensor, c_ids: torch.Tensor) -> torch.Tensor:
        q, c = self.emb(q_ids), self.emb(c_ids)
        dot = (q * c).sum(-1)
        den = q.norm(dim=-1) * c.norm(dim=-1)
        return torch.where(den > 0, dot / den, torch.zeros_like(dot))


def _score(q0: int, mode: str = "watch", calls: int = 1) -> None:
    m = _Score()
    q, c = torch.tensor([q0, 2, 3]), torch.tensor([1, 4, 5])
    with nanwatch.watch(m, postmortem=False, mode=mode):
        sum(m(q, c) for _ in range(calls)).sum().backward()


def test_the_replay_template_is_marked_as_a_pattern() -> None:
    """Where sentinel cannot replay a module's backward (the root was called twice in the
    step: which call made the NaN?) its fix is the replay template, whose names are a
    pattern's. (Called once, sentinel and watch replay the root's own backward and name
    the torch.where-guarded division itself.)"""
    with pytest.raises(nanwatch.AnomalyError) as info:
        _score(0, mode="sentinel", calls=2)  # a padding query: 0/0 in the backward of dot / den
    (d,) = [d for d in info.value.diagnoses if "nw.replay(step_fn)" in (d.fix or "")]
    lines = (d.fix or "").splitlines()
    assert lines[0].startswith("# adapt: your model, loss and batch")
    # the pattern's names are said to be a pattern's, not presented as the user's code
    assert "your forward and loss" in lines[2] and "a pattern" in lines[2]
    with pytest.raises(nanwatch.AnomalyError) as info:
        _score(0)
    (d,) = [d for d in info.value.diagnoses if d.code == "NW111"]
    assert "torch.where(den > 0, den, 1)" in d.fix


def test_a_missing_target_masked_by_a_multiply_is_named() -> None:
    torch.manual_seed(0)
    net, q = nn.Linear(4, 3), torch.tensor([0.1, 0.5, 0.9])
    x, y = torch.randn(16, 4), torch.randn(16)
    y[5] = float("nan")  # a missing target, masked by a multiply
    mask = ~torch.isnan(y)
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(net, postmortem=False) as nw,
    ):
        diff = y[:, None] - net(x)
        pinball = torch.maximum(q * diff, (q - 1) * diff)
        loss = (pinball * mask[:, None]).sum() / mask.sum()
        loss.backward()
        nw.step()
    (d,) = [d for d in info.value.diagnoses if d.code == "NW100"]
    # the subtraction saves no operand: the missing target is named among the locals (the
    # one that holds a NaN), with the loss over the values that are there; a multiply by
    # the mask keeps the NaN (NaN * 0 is NaN)
    assert "operand of sub (y)" in " | ".join(d.evidence)
    assert "keep = torch.isfinite(y)" in (d.fix or "")


def test_the_forensic_template_is_marked_as_a_pattern_when_no_local_holds_the_nan() -> None:
    """The target reached the loss from a batch dict, not a local name: nothing names it,
    and the forensic rerun template is given, marked as a pattern."""
    torch.manual_seed(0)
    net, q = nn.Linear(4, 3), torch.tensor([0.1, 0.5, 0.9])
    batch = {"x": torch.randn(16, 4), "y": torch.randn(16)}
    batch["y"][5] = float("nan")
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(net, postmortem=False) as nw,
    ):
        diff = batch["y"][:, None] - net(batch["x"])
        pinball = torch.maximum(q * diff, (q - 1) * diff)
        loss = pinball.mean()
        loss.backward()
        nw.step()
    (d,) = [d for d in info.value.diagnoses if d.code == "NW100"]
    assert (
        (d.fix or "")
        .splitlines()[1]
        .endswith(
            "# the same step: forward, loss, backward(); adapt: your model, loss and batch "
            "(the model: Linear)"
        )
    )


def test_healthy_score_stays_silent() -> None:
    _score(7)
