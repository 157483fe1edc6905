"""NW101 for PPO's importance ratio ``exp(logp - old_logp)``: the old log-probabilities kept
from the rollout (under ``torch.no_grad()``, or ``.detach()``ed) carry no gradient, the
new ones do; a too-large lr over several epochs on one batch moves the policy far from
the one that collected it and the exp overflows. The graph shows exp(sub(a, b)) with b
without history (``OpEvent.made_from_history``): the message is the ratio's, not "a
log-variance or a temperature". Controls: the same PPO at a sane lr trains clean, and an
exp(a - b) whose operands both have a history keeps the generic message."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.distributions import Normal

import nanwatch
from nanwatch.ops import operand_history
from nanwatch.records import OpEvent

torch.set_num_threads(1)

MODES = ("sentinel", "watch", "forensic")


class _Actor(nn.Module):
    """A Gaussian policy with a state-independent log-std, started narrow."""

    def __init__(self, obs_dim: int = 8, act_dim: int = 4) -> None:
        super().__init__()
        self.mu = nn.Sequential(nn.Linear(obs_dim, 32), nn.Tanh(), nn.Linear(32, act_dim))
        self.log_std = nn.Parameter(torch.full((act_dim,), -3.0))

    def forward(self, obs: torch.Tensor) -> Normal:  # type: ignore[override]
        return Normal(self.mu(obs), self.log_std.exp())


def _ppo(lr: float, mode: str, *, detach: bool = False, epochs: int = 4) -> None:
    """PPO's clipped surrogate, several epochs over one rollout with exploration noise."""
    torch.manual_seed(0)
    actor = _Actor()
    opt = torch.optim.Adam(actor.parameters(), lr=lr)
    obs = torch.randn(64, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(actor, mode=mode, postmortem=False) as nw:  # type: ignore[arg-type]
            if detach:
                dist = actor(obs)
                act = (dist.sample() + torch.randn(64, 4)).detach()
                rollout_logp = dist.log_prob(act).sum(-1).detach()
            else:
                with torch.no_grad():
                    dist = actor(obs)
                    act = dist.sample() + torch.randn(64, 4)  # exploration noise
                    old_logp = dist.log_prob(act).sum(-1)
            adv = torch.randn(64)
            for _ in range(epochs):
                dist = actor(obs)
                if detach:
                    ratio = torch.exp(dist.log_prob(act).sum(-1) - rollout_logp)
                else:
                    logp = dist.log_prob(act).sum(-1)
                    ratio = (logp - old_logp).exp()
                loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()


def _text(d: nanwatch.Diagnosis) -> str:
    return "\n".join([*d.evidence, d.explanation, d.fix or ""])


@pytest.mark.parametrize("mode", MODES)
def test_ppo_ratio_overflow_is_the_importance_ratio(mode: str) -> None:
    with pytest.raises(nanwatch.AnomalyError) as info:
        _ppo(0.1, mode)
    d = info.value.diagnoses[0]
    assert d.code == "NW101"
    text = _text(d)
    assert "importance ratio" in d.explanation
    assert "moved far from the one that collected the batch" in d.explanation
    assert "Adam lr 0.1" in d.explanation
    assert "log-variance" not in text and "temperature" not in text
    assert "approx_kl" in (d.fix or "") and "target_kl" in (d.fix or "")
    first = (d.fix or "").splitlines()[0]
    assert first.startswith("ratio = (logp - old_logp).clamp(max=20).exp()")
    if mode == "forensic":  # the line is known: its own names
        assert "old_logp carries no gradient (computed under torch.no_grad() or detached)" in text
        assert "approx_kl = (old_logp - logp).mean().item()" in (d.fix or "")


@pytest.mark.parametrize("mode", MODES)
def test_ppo_ratio_of_detached_log_probs_names_the_line(mode: str) -> None:
    with pytest.raises(nanwatch.AnomalyError) as info:
        _ppo(0.1, mode, detach=True)
    d = info.value.diagnoses[0]
    assert d.code == "NW101"
    assert "importance ratio" in d.explanation
    assert "log-variance" not in _text(d)
    if mode == "forensic":
        first = (d.fix or "").splitlines()[0]
        assert first.startswith(
            "ratio = torch.exp((dist.log_prob(act).sum(-1) - rollout_logp).clamp(max=20))"
        )
        assert "rollout_logp carries no gradient" in _text(d)


@pytest.mark.parametrize("mode", MODES)
def test_healthy_ppo_at_a_sane_lr_stays_silent(mode: str) -> None:
    _ppo(3e-4, mode, epochs=10)


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 1)
        self.p = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q(x), self.p(x)


@pytest.mark.parametrize("mode", MODES)
def test_exp_of_a_difference_with_history_on_both_sides_keeps_the_generic_message(
    mode: str,
) -> None:
    """A KL between two predicted Gaussians, exp(logvar_q - logvar_p): both carry a
    gradient, no stored reference; a weight pushed far makes the difference pass 88.7."""
    torch.manual_seed(0)
    model = _TwoHeads()
    with torch.no_grad():
        model.q.bias.fill_(200.0)
    x = torch.randn(16, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with (
            pytest.raises(nanwatch.AnomalyError) as info,
            nanwatch.watch(model, mode=mode, postmortem=False) as nw,  # type: ignore[arg-type]
        ):
            logvar_q, logvar_p = model(x)
            kl = 0.5 * (torch.exp(logvar_q - logvar_p) - (logvar_q - logvar_p) - 1).mean()
            kl.backward()
            nw.step()
    d = info.value.diagnoses[0]
    assert d.code == "NW101"
    assert "importance ratio" not in _text(d)


def test_exp_of_a_difference_with_a_number_is_no_ratio_in_forensic() -> None:
    """``exp(x - 1.0)``: the graph shows an operand without history (the number), and the
    line shows it is a constant: no stored reference, the generic message."""
    torch.manual_seed(0)
    head = nn.Linear(4, 1)
    with torch.no_grad():
        head.bias.fill_(200.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with (
            pytest.raises(nanwatch.AnomalyError) as info,
            nanwatch.watch(head, mode="forensic", postmortem=False) as nw,
        ):
            log_rate = head(torch.randn(16, 4))
            loss = torch.exp(log_rate - 1.0).mean()
            loss.backward()
            nw.step()
    d = info.value.diagnoses[0]
    assert d.code == "NW101"
    assert "importance ratio" not in _text(d)


def test_operand_history_is_read_from_the_graph_and_kept_in_the_record() -> None:
    a = torch.ones(3, requires_grad=True)
    with torch.no_grad():
        b = a * 2
    assert operand_history(torch.exp(a - b).grad_fn) == [True, False]
    assert operand_history(torch.exp(a - a.detach()).grad_fn) == [True, False]
    assert operand_history(torch.exp(a - a * 2).grad_fn) == [True, True]
    assert operand_history(torch.exp(a).grad_fn) == []  # made by no op of two operands
    ev = OpEvent.from_dict(
        OpEvent(
            op="aten.exp.default",
            phase=nanwatch.records.Phase.FORWARD,
            path=None,
            born="+inf",
            output=nanwatch.records.TensorStat(0.0, 1.0, 1),
            made_from=["sub"],
            made_from_history=[True, False],
        ).to_dict()
    )
    assert ev.made_from_history == [True, False]
