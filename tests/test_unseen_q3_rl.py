"""Reinforcement learning with masked actions: a hand-written entropy, -(p * log p), of a
policy whose logits a mask set to -inf computes 0 × -inf = NaN at every masked entry
(no illegal action was taken: it was called "log-probability of a masked action", with a
fix that checks the actions); and a state whose every action is masked makes
``Categorical(logits=...)`` refuse its normalized logits (validate_args), whose
post-mortem spoke of scales and probs (the constraint ``IndependentConstraint(Real(), 1)``
was not parsed)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical

import nanwatch
from nanwatch.postmortem import classify
from nanwatch.report import Report

torch.set_num_threads(1)


def _line_of(snippet: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if snippet in line)


class _Policy(nn.Module):
    def __init__(self, *, finite_mask: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 4))
        self.finite_mask = finite_mask

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        logits = self.body(obs)
        if self.finite_mask:
            return logits.masked_fill(~legal, torch.finfo(logits.dtype).min)
        return logits.masked_fill(~legal, float("-inf"))


# ------------------------------------------------ a hand-written entropy of masked logits


def _a2c(mode: str, *, entropy: str = "hand") -> None:
    torch.manual_seed(0)
    pi = _Policy()
    opt = torch.optim.Adam(pi.parameters(), 1e-3)
    with nanwatch.watch(pi, mode=mode, postmortem=False) as nw:
        for _ in range(2):
            obs, legal = torch.randn(16, 6), torch.rand(16, 4) > 0.3
            legal[:, 0] = True  # every state keeps a legal action
            logits = pi(obs, legal)
            logp_all = F.log_softmax(logits, -1)
            probs = logp_all.exp()
            if entropy == "hand":
                ent = -(probs * logp_all).sum(-1)
            elif entropy == "clamped":
                ent = -(probs * logp_all.clamp_min(torch.finfo(torch.float32).min)).sum(-1)
            else:
                ent = Categorical(logits=logits).entropy()
            a = torch.multinomial(probs.detach(), 1).squeeze(1)
            logp = logp_all.gather(1, a.unsqueeze(1)).squeeze(1)
            loss = -(logp * torch.randn(16)).mean() - 0.01 * ent.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_entropy_of_masked_logits_is_0_times_minus_inf_not_an_illegal_action(mode: str) -> None:
    with pytest.raises(nanwatch.AnomalyError) as info:
        _a2c(mode)
    d = info.value.diagnoses[0]
    assert d.code == "NW110"
    assert "masked entry: 0 × -inf" in d.title and "action" not in d.title
    body = "\n".join(d.evidence)
    assert "0 × -inf = NaN" in body and "11 exact zeros beside the 11 -inf" in body
    assert "no masked action was taken" in d.explanation
    assert "legal.gather" not in d.fix and "sampler" not in d.fix
    assert "Categorical(logits=logits).entropy()" in d.fix
    assert "torch.finfo(torch.float32).min" in d.fix
    if mode == "forensic":  # the line is known: its -inf factor clamped, in the user's names
        assert f"test_unseen_q3_rl.py:{_line_of('ent = -(probs * logp_all).sum(-1)')}" in body
        fixed = "ent = -(probs * logp_all.clamp_min(torch.finfo(torch.float32).min)).sum(-1)"
        assert d.fix.splitlines()[0].startswith(fixed)
        assert "masked_fill(~legal, torch.finfo(torch.float32).min)" in d.fix
    else:
        assert d.fix.startswith("p_log_p = probs * log_probs.clamp_min(")


@pytest.mark.parametrize("entropy", ["clamped", "torch"])
def test_the_entropies_the_fix_gives_train_clean(entropy: str) -> None:
    _a2c("watch", entropy=entropy)


# ------------------------------------- every action of a state masked: the post-mortem


def _rollout(mode: str, tmp_path: Path, *, finite_mask: bool = False) -> dict[str, object] | None:
    torch.manual_seed(0)
    pi = _Policy(finite_mask=finite_mask)
    opt = torch.optim.Adam(pi.parameters(), 1e-3)
    with nanwatch.watch(pi, mode=mode, report_dir=str(tmp_path)) as nw:
        for it in range(3):
            obs, legal = torch.randn(16, 6), torch.rand(16, 4) > 0.3
            legal[:, 0] = True
            if it == 2:
                legal[5] = False  # a terminal state: no legal action
            dist = Categorical(logits=pi(obs, legal), validate_args=True)
            a = dist.sample()
            loss = -(dist.log_prob(a) * torch.randn(16)).mean() - 0.01 * dist.entropy().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    files = sorted(tmp_path.glob("*.json"))
    return Report.load(str(files[-1])).error if files else None


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_a_state_with_every_action_masked_is_named_in_the_post_mortem(
    mode: str, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="to satisfy the constraint") as info:
        _rollout(mode, tmp_path)
    assert type(info.value) is ValueError  # torch's own error, unchanged
    files = sorted(tmp_path.glob("*.json"))
    assert files, "no post-mortem report written"
    error = Report.load(str(files[-1])).error
    assert error is not None and error["class"] == "distribution-constraint"
    advice = str(error["advice"])
    assert "Categorical's parameter logits does not satisfy IndependentConstraint(Real(), 1)" in (
        advice
    )
    assert "every entry is -inf" in advice and "every action is masked" in advice
    assert "-inf - (-inf) = NaN" in advice and "(row 5 of the printed values)" in advice
    assert "torch.finfo(logits.dtype).min" in advice
    assert "scale or std" not in advice and "softplus" not in advice


def test_a_finite_mask_with_every_action_masked_trains_clean(tmp_path: Path) -> None:
    assert _rollout("watch", tmp_path, finite_mask=True) is None


def test_logits_advice_names_the_nan_rows_and_not_a_summarized_print() -> None:
    def error(logits: torch.Tensor) -> ValueError:
        with pytest.raises(ValueError, match="to satisfy the constraint") as info:
            Categorical(logits=logits, validate_args=True)
        return info.value

    small = torch.randn(6, 3)
    small[[1, 4]] = float("-inf")
    advice = classify(error(small))["advice"]
    assert "(rows 1, 4 of the printed values)" in advice
    big = torch.randn(3000, 3)
    big[7] = float("-inf")  # torch prints the first and last rows only: no row is named
    advice = classify(error(big))["advice"]
    assert "every entry is -inf" in advice and "printed values" not in advice


# ------------------------------- a replay buffer's float actions, a bool done flag


def _crash(run: Callable[[], None], root: nn.Module, tmp_path: Path) -> dict[str, Any]:
    with (
        pytest.raises(RuntimeError) as info,
        nanwatch.watch(root, report_dir=str(tmp_path)) as nw,
    ):
        run()
        nw.step()
    assert type(info.value) is RuntimeError  # torch's own error, unchanged
    files = sorted(tmp_path.glob("*.json"))
    assert files, "no post-mortem report written"
    error = Report.load(str(files[-1])).error
    assert error is not None
    return error


def test_float_actions_given_to_gather_get_the_line_with_long(tmp_path: Path) -> None:
    torch.manual_seed(0)
    q = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 3))
    actions = torch.zeros(64)  # a replay buffer allocated as floats
    actions[:16] = torch.randint(0, 3, (16,)).float()

    def step() -> None:
        s, a, target = torch.randn(16, 4), actions[:16], torch.randn(16)
        qsa = q(s).gather(1, a.unsqueeze(1)).squeeze(1)
        F.mse_loss(qsa, target).backward()

    error = _crash(step, q, tmp_path)
    advice = str(error["advice"])
    line = _line_of("qsa = q(s).gather(1, a.unsqueeze(1)).squeeze(1)")
    assert advice.startswith("q(s).gather(1, a.unsqueeze(1)) at ")
    assert f"test_unseen_q3_rl.py:{line} raised: its index a.unsqueeze(1) is a float" in advice
    assert "qsa = q(s).gather(1, a.unsqueeze(1).long()).squeeze(1)" in advice
    assert "torch.zeros(n, dtype=torch.long)" in advice
    assert "float64 batch" not in advice and "autocast" not in advice
    # the line the advice gives runs
    s, a = torch.randn(16, 4), actions[:16]
    qsa = q(s).gather(1, a.unsqueeze(1).long()).squeeze(1)
    assert qsa.shape == (16,)


def test_torch_gather_and_index_select_name_their_index() -> None:
    x, idx = torch.randn(4, 3), torch.zeros(4, 1)
    with pytest.raises(RuntimeError) as info:
        torch.gather(x, 1, idx)
    advice = classify(info.value)["advice"]
    assert "torch.gather(x, 1, idx.long())" in advice
    rows = torch.zeros(2)
    with pytest.raises(RuntimeError) as info:
        x.index_select(0, rows + 1)
    assert "x.index_select(0, (rows + 1).long())" in classify(info.value)["advice"]


def test_one_minus_a_bool_done_flag_gets_float_and_the_mask(tmp_path: Path) -> None:
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))
    dones = torch.zeros(8, dtype=torch.bool)
    dones[3] = True

    def step() -> None:
        values = critic(torch.randn(9, 4)).squeeze(-1)
        rewards, adv, last = torch.randn(8), torch.zeros(8), torch.zeros(())
        with torch.no_grad():
            for t in reversed(range(8)):
                nonterminal = 1 - dones[t]
                delta = rewards[t] + 0.99 * values[t + 1] * nonterminal - values[t]
                last = delta + 0.99 * 0.95 * nonterminal * last
                adv[t] = last
        ((values[:-1] - (adv + values[:-1].detach())) ** 2).mean().backward()

    error = _crash(step, critic, tmp_path)
    advice = str(error["advice"])
    assert advice.startswith("1 - dones[t] at ")
    assert f"test_unseen_q3_rl.py:{_line_of('nonterminal = 1 - dones[t]')} raised" in advice
    assert "dones[t] is a bool tensor" in advice
    assert "nonterminal = 1 - dones[t].float()" in advice and "~dones[t]" in advice
    assert "The last modules" not in advice


def test_a_subtraction_of_two_floats_gets_no_bool_advice() -> None:
    with pytest.raises(RuntimeError) as info:
        torch.randn(2, 3) - torch.randn(4)
    assert "bool" not in classify(info.value)["advice"]


# ------------------------------------------- a NaN in a bootstrapped target, counted


def test_a_nan_reward_in_a_td_target_is_counted_and_named_in_the_users_names() -> None:
    torch.manual_seed(0)
    q = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 3))
    tgt = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 3))
    r = torch.randn(32)
    r[7] = float("nan")  # a reward the environment returned as NaN
    with nanwatch.watch(q, on_anomaly="record", postmortem=False) as nw:
        s, a, s2 = torch.randn(32, 4), torch.randint(0, 3, (32,)), torch.randn(32, 4)
        with torch.no_grad():
            td_target = r + 0.99 * tgt(s2).max(1).values
        qsa = q(s).gather(1, a.unsqueeze(1)).squeeze(1)
        F.smooth_l1_loss(qsa, td_target).backward()
        nw.step()
    trace = next(t for t in nw.report.steps if t.anomaly is not None)
    d = trace.diagnoses[0]
    assert d.code == "NW401"
    body = "\n".join(d.evidence)
    assert "1 of its 32 values is non-finite, the others finite" in body
    line = _line_of("td_target = r + 0.99 * tgt(s2).max(1).values")
    assert (
        f"the target is computed at {__file__}:{line}: td_target = r + 0.99 * "
        "tgt(s2).max(1).values: the NaN is in one of r, s2, or made there (0 × inf)"
    ) in body
    assert "print((~torch.isfinite(td_target)).nonzero()[:10].tolist())" in d.fix
    assert "y.std()" not in d.fix and "(y" not in d.fix
    assert "bootstrapped" in d.explanation
