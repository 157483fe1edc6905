"""Fixes found by running nanwatch on recommender, time-series and RL failures: the logQ
fix's floor, NW102 on a tensor already holding inf, NW101's advice for a huge target, the
post-mortem of a torch.distributions constraint error, NW513's wording for item tables."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical, Normal

import nanwatch
from nanwatch.postmortem import classify
from nanwatch.records import TensorStat
from nanwatch.rules.testing import TraceBuilder, diagnose, stat

torch.set_num_threads(1)


# --- NW519: a logQ correction's fix must use a floor a probability can have ---------------


def _logq_fix(q: torch.Tensor, gathered: bool) -> str:
    torch.manual_seed(0)
    model = nn.Embedding(10, 8)
    items = torch.tensor([1, 9, 3, 4])
    with pytest.raises(nanwatch.GuardError) as info, nanwatch.watch(model, postmortem=False):
        (_gathered_step if gathered else _indexed_step)(model, q, items)
    assert info.value.code == "NW519"
    assert info.value.fix is not None
    return info.value.fix


def _indexed_step(model: nn.Module, q: torch.Tensor, items: torch.Tensor) -> None:
    logits = torch.randn(4, 8) @ model(items).T
    logits = logits - torch.log(q[items])[None, :]
    F.cross_entropy(logits, torch.arange(4)).backward()


def _gathered_step(model: nn.Module, q: torch.Tensor, items: torch.Tensor) -> None:
    qb = q[items]  # the batch's frequencies: the table's size is not at hand
    logits = torch.randn(4, 8) @ model(items).T
    logits = logits - torch.log(qb)[None, :]
    F.cross_entropy(logits, torch.arange(4)).backward()


def _apply(fix: str, q: torch.Tensor) -> float:
    """Run the suggested line and return the loss it gives."""
    torch.manual_seed(0)
    items = torch.tensor([1, 9, 3, 4])
    qb = q[items]
    logits = torch.randn(4, 4)
    env = {"torch": torch, "logits": logits, "q": q, "items": items, "qb": qb}
    exec(fix.split("#", maxsplit=1)[0].strip(), env)
    return float(F.cross_entropy(env["logits"], torch.arange(4)))


@pytest.mark.parametrize("gathered", [False, True])
def test_logq_fix_floor_is_a_probability_not_finfo_tiny(gathered: bool) -> None:
    q = torch.tensor([0.2, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.0])  # item 9 never seen
    fix = _logq_fix(q, gathered)
    assert "tiny" not in fix
    if gathered:
        assert fix.startswith("logits = logits - torch.where(qb > 0, torch.log(qb), 0.0)")
    else:
        assert fix.startswith("logits = logits - torch.log(q[items].clamp_min(1.0 / q.numel()))")
    # the fixed line trains: the new item's score is not pushed up by ~87
    assert _apply(fix, q) < 10.0


# --- NW102: no "warning before it happens" about a tensor that already holds inf ----------


def _fp16_step(s: TensorStat) -> list[str]:
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-2.0, 2.0, numel=64), shape=(8, 8), dtype="float16")
    top = b.call("top", "Linear", parent=net)
    b.input(top, source=x, dtype="float16", shape=(8, 8))
    o = b.forward(top, s, dtype="float16", shape=(8, 4), grad_fn="AddmmBackward0")
    b.forward(net, source=o, dtype="float16", shape=(8, 4), grad_fn="AddmmBackward0")
    return [d.explanation for d in diagnose(b.build(localize=False), facts={}) if d.code == "NW102"]


def test_headroom_is_silent_on_a_tensor_that_already_overflowed() -> None:
    inf = math.inf
    overflowed = stat(-inf, inf, numel=32, posinf=3, neginf=2, finite_amax=65408.0, near_max=20)
    assert _fp16_step(overflowed) == []
    # the same finite values without the inf: the warning before it happens
    (why,) = _fp16_step(stat(-65408.0, 100.0, numel=32, counted=True, near_max=20))
    assert "No value is bad yet" in why


def test_headroom_next_to_a_mask_does_not_claim_no_value_is_bad() -> None:
    masked = stat(-math.inf, 65000.0, numel=32, neginf=8, finite_amax=65000.0)
    (why,) = _fp16_step(masked)
    assert "No value is bad yet" not in why
    assert "Apart from its -inf" in why


# --- NW101: a huge loss target is data to scale, not a layer to normalize ----------------


def test_overflow_from_an_unscaled_regression_target_says_scale_the_target() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    y = torch.full((16, 1), 2e19)  # raw values: the square of the error is past float32's max
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(model, postmortem=False):
        F.mse_loss(model(torch.randn(16, 4)), y).backward()
    (d,) = [d for d in info.value.diagnoses if d.code == "NW101"]
    assert "LayerNorm" not in d.fix and "LayerNorm" not in d.explanation
    assert d.fix.startswith("# scale the target")
    assert "torch.log1p(y)" in d.fix
    assert any("the huge operand is the target of aten.mse_loss" in e for e in d.evidence)


# --- post-mortem: a torch.distributions constraint error is classified and advised --------


def _dist_error(make: Any) -> ValueError:
    # validate_args=True at each call: a test elsewhere may turn the default off
    with pytest.raises(ValueError, match="to satisfy the constraint") as info:
        make()
    return info.value


def test_distribution_scale_constraint_advice_names_a_positive_parameterization() -> None:
    exc = _dist_error(
        lambda: Normal(torch.zeros(3), torch.tensor([-0.2, 0.1, 0.0]), validate_args=True)
    )
    info = classify(exc)
    assert info["class"] == "distribution-constraint"
    assert info["message"] == str(exc)
    advice = info["advice"]
    assert advice.startswith("Normal's parameter scale does not satisfy GreaterThan")
    assert "F.softplus(raw) + 1e-5" in advice and "log_std.clamp(-20, 2).exp()" in advice


def test_distribution_probs_and_nan_constraint_advice() -> None:
    probs = _dist_error(
        lambda: Categorical(probs=torch.tensor([[0.5, 0.7, -0.2]]), validate_args=True)
    )
    assert "logits=" in classify(probs)["advice"]
    nan = _dist_error(
        lambda: Normal(torch.zeros(2), torch.tensor([math.nan, 1.0]), validate_args=True)
    )
    advice = classify(nan)["advice"]
    assert "holds NaN" in advice and "Where it went wrong" in advice
    assert "softplus" not in advice


class _Gauss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mu = nn.Linear(3, 1)
        self.std = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mu(x), self.std(x)  # a raw Linear as the std: negative for some rows


def test_distribution_constraint_error_passes_through_with_its_advice(tmp_path: Any) -> None:
    torch.manual_seed(0)
    pol = _Gauss()
    with torch.no_grad():
        pol.std.bias.fill_(-5.0)  # negative for every row
    with pytest.raises(ValueError) as info, nanwatch.watch(pol, report_dir=tmp_path) as nw:
        mu, std = pol(torch.randn(16, 3))
        Normal(mu, std, validate_args=True).log_prob(torch.zeros(16, 1)).mean().backward()
    assert type(info.value) is ValueError and "to satisfy the constraint" in str(info.value)
    err = nw.report.error
    assert err is not None and err["class"] == "distribution-constraint"
    assert "F.softplus(raw) + 1e-5" in err["advice"]


# --- NW513: an id past an item table's rows is not blamed on a tokenizer -----------------


class _Items(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.item_emb = nn.Embedding(100, 8)
        self.mlp = nn.Linear(8, 4)

    def forward(self, items: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.item_emb(items))


@pytest.mark.parametrize("bad", [100, 150])
def test_item_id_out_of_range_is_worded_without_a_tokenizer(bad: int) -> None:
    model = _Items()
    items = torch.tensor([3, 7, bad])
    with pytest.raises(nanwatch.GuardError) as info, nanwatch.watch(model, postmortem=False):
        model(items)
    err = info.value
    assert err.code == "NW513"
    assert "tokenizer" not in str(err) and err.fix is not None and "tokenizer" not in err.fix
    assert "were not seen when the table was sized" in str(err)  # an unknown row first
