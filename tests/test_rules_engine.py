"""The rule engine: registration with the same decorator the built-in rules use, ordering,
the catch-all, a raising rule reported once and disabled, and rule families that register
themselves by existing."""

from __future__ import annotations

import importlib
import math
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.config import Thresholds
from nanwatch.errors import ConfigError
from nanwatch.records import StepTrace
from nanwatch.rules import FAILED_FAMILIES, REGISTRY, family_modules
from nanwatch.rules.base import Diagnosis, Rule, RuleContext, evaluate, rule, sort_key
from nanwatch.rules.testing import TraceBuilder, diagnose, stat


@pytest.fixture
def registry() -> Iterator[dict[str, Rule]]:
    """Leaves the registry as it found it (user rules registered by a test go away)."""
    before = dict(REGISTRY)
    yield REGISTRY
    REGISTRY.clear()
    REGISTRY.update(before)


def _clean_trace(step: int = 0, loss: float = 1.0) -> StepTrace:
    b = TraceBuilder(step)
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0))
    b.forward(net, stat(-1.0, 1.0))
    return b.build(loss=loss)


#: codes and titles of the built-in rules: a code never changes meaning (the title may be
#: reworded, but never to something else) and is never removed or reused.
CODES = {
    "NW100": "Non-finite value",
    "NW101": "Floating-point overflow",
    "NW102": "Overflow headroom nearly gone",
    "NW103": "Logits approaching the exp overflow bound",
    "NW104": "Magnitude growing toward overflow",
    "NW110": "Log of zero or of a negative number",
    "NW111": "Division by zero",
    "NW112": "sqrt or fractional power at zero or below",
    "NW201": "BCELoss on saturated probabilities (the massive loss)",
    "NW202": "Sigmoid followed by BCELoss",
    "NW203": "Softmax followed by CrossEntropyLoss (double softmax)",
    "NW204": "Softmax followed by NLLLoss (use LogSoftmax)",
    "NW205": "Probabilities where logits are expected",
    "NW206": "Large logits at ignore_index positions under low precision",
    "NW207": "CTCLoss(zero_infinity=True) drops samples whose targets are too long",
    "NW208": "Softmax over another dim than the classes",
    "NW209": "Loss computed on a detached output",
    "NW301": "Non-finite weights after an optimizer step",
    "NW302": "Non-finite parameter gradients",
    "NW303": "Exploding gradients",
    "NW304": "Vanishing gradients: zero for many steps",
    "NW305": "Loss scaler collapse",
    "NW401": "NaN or inf in the input data",
    "NW402": "Fully masked attention row",
    "NW403": "In-place op on a tensor autograd saved",
    "NW404": "Transient: a replay on the same inputs ran clean",
}


def test_builtin_codes_keep_their_meaning() -> None:
    for code, title in CODES.items():
        assert code in REGISTRY, f"{code} disappeared: codes are never removed"
        assert REGISTRY[code].title == title
        assert REGISTRY[code].builtin


def test_codes_follow_the_family_ranges() -> None:
    ranges = {
        "overflow": 1,
        "domain": 1,
        "generic": 1,
        "losses": 2,
        "gradients": 3,
        "data": 4,
        "masking": 4,
        "autograd": 4,
        "runtime": 4,
        "guards": 5,
    }
    for r in REGISTRY.values():
        if r.builtin:
            assert r.family in ranges, r.family
            assert r.code[2] == str(ranges[r.family]), (r.code, r.family)


def test_every_family_module_imports_and_registers_itself() -> None:
    assert FAILED_FAMILIES == []
    families = family_modules()
    assert {"overflow", "domain", "losses", "gradients", "data", "masking", "autograd"} <= set(
        families
    )
    for name in families:
        importlib.import_module(f"nanwatch.rules.{name}")
        assert any(r.family == name for r in REGISTRY.values()), name
    assert "base" not in families and "catalog" not in families and "_evidence" not in families


def test_early_warnings_are_marked() -> None:
    early = {r.code for r in REGISTRY.values() if r.early and r.builtin}
    assert {"NW102", "NW103", "NW104", "NW202", "NW203", "NW204", "NW303", "NW304"} <= early
    assert "NW101" not in early and "NW111" not in early


def test_a_user_rule_uses_the_same_decorator_and_reaches_the_watchers_step(
    registry: dict[str, Rule],
) -> None:
    @rule(
        "NW901",
        title="Loss above 3",
        severity="warning",
        summary="The loss is larger than 3.",
        early=True,
    )
    def big_loss(ctx: RuleContext) -> Iterator[Diagnosis]:
        if ctx.trace.loss is not None and ctx.trace.loss > 3:
            yield ctx.diagnosis(evidence=[f"loss = {ctx.trace.loss:.3g}"], fix="lower the lr")

    assert REGISTRY["NW901"].family == "user" and not REGISTRY["NW901"].builtin
    model, criterion = nn.Linear(4, 1), nn.MSELoss()
    with nanwatch.watch(model, criterion, on_anomaly="record", postmortem=False) as nw:
        loss = criterion(model(torch.randn(8, 4)), torch.full((8, 1), 10.0))
        loss.backward()
        trace = nw.step()
    codes = [d.code for d in trace.diagnoses]
    assert codes == ["NW901"]
    d = trace.diagnoses[0]
    assert (d.title, d.severity, d.step) == ("Loss above 3", "warning", 0)
    assert d.evidence[0].startswith("loss = ")


def test_a_rule_that_raises_is_reported_once_and_disabled(
    registry: dict[str, Rule],
) -> None:
    calls = []

    @rule("NW902", title="Broken rule", severity="error", summary="Raises.")
    def broken(ctx: RuleContext) -> None:
        calls.append(ctx.step)
        raise KeyError("oops")

    model, criterion = nn.Linear(4, 1), nn.MSELoss()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(model, criterion, on_anomaly="raise", postmortem=False) as nw:
            for _ in range(3):
                loss = criterion(model(torch.randn(8, 4)), torch.randn(8, 1))
                loss.backward()
                nw.step()
    mine = [w for w in caught if "NW902" in str(w.message)]
    assert len(mine) == 1
    assert "disabled for the rest of this run" in str(mine[0].message)
    assert "KeyError" in str(mine[0].message)
    assert calls == [0]  # never called again
    assert len(nw.history) == 3  # training went on; no diagnosis of the broken rule
    assert all(d.code != "NW902" for t in nw.history for d in t.diagnoses)


def test_a_raising_rule_does_not_stop_the_others() -> None:
    disabled: set[str] = set()

    @rule("NW903", title="Broken", severity="error", summary="Raises.", replace=True)
    def broken(ctx: RuleContext) -> None:
        raise ValueError("bad")

    try:
        b = TraceBuilder(0)
        net = b.call("Net", root=True)
        b.input(net, stat(math.nan, math.nan, nan=1, bad_rows=(3,), bad_row_count=1))
        trace = b.build()
        with pytest.warns(RuntimeWarning, match="NW903"):
            ds = evaluate(trace, [], Thresholds(), disabled=disabled)
        assert "NW903" in disabled
        assert [d.code for d in ds][:1] == ["NW401"]
    finally:
        del REGISTRY["NW903"]


def test_rule_codes_and_severities_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"'NW' and 3-4 digits.*'W901'"):
        rule("W901", title="t", severity="error", summary="s")
    with pytest.raises(
        ConfigError, match="`severity` can be 'error', 'warning', 'info'; got 'fatal'"
    ):
        rule("NW904", title="t", severity="fatal", summary="s")  # type: ignore[arg-type]


def test_a_taken_code_is_refused_unless_replaced(registry: dict[str, Rule]) -> None:
    def f(ctx: RuleContext) -> None:
        return None

    with pytest.raises(ConfigError, match="NW111 is taken by 'Division by zero'") as info:
        rule("NW111", title="Mine", severity="info", summary="s")(f)
    assert info.value.name == "code"
    rule("NW111", title="Mine", severity="info", summary="s", replace=True)(f)
    assert REGISTRY["NW111"].title == "Mine"


def test_a_rule_may_return_one_diagnosis_none_or_an_iterable(
    registry: dict[str, Rule],
) -> None:
    @rule("NW905", title="One", severity="info", summary="s")
    def one(ctx: RuleContext) -> Diagnosis:
        return ctx.diagnosis(evidence=["x"])

    @rule("NW906", title="None", severity="info", summary="s")
    def none(ctx: RuleContext) -> None:
        return None

    @rule("NW907", title="Mixed", severity="info", summary="s")
    def mixed(ctx: RuleContext) -> list[object]:
        return [ctx.diagnosis(), "not a diagnosis", None]

    codes = [d.code for d in diagnose(_clean_trace())]
    assert codes == ["NW905", "NW907"]


def test_diagnoses_sort_by_severity_then_priority() -> None:
    ds = [
        Diagnosis("NW1", "w", "warning", priority=1),
        Diagnosis("NW2", "e late", "error", priority=90),
        Diagnosis("NW3", "e first", "error", priority=5),
        Diagnosis("NW4", "i", "info", priority=0),
    ]
    assert [d.code for d in sorted(ds, key=sort_key)] == ["NW3", "NW2", "NW1", "NW4"]


def test_the_catch_all_runs_only_when_no_specific_error_fired(
    registry: dict[str, Rule],
) -> None:
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0))
    blk = b.call("blk", "Block", parent=net)
    b.forward(blk, stat(math.nan, math.nan, nan=2))
    trace = b.build()
    assert [d.code for d in diagnose(trace)] == ["NW100"]
    d = diagnose(trace)[0]
    assert d.path == "blk" and "mode='forensic'" in d.fix

    @rule("NW908", title="Explains it", severity="error", summary="s")
    def explains(ctx: RuleContext) -> Diagnosis | None:
        return ctx.diagnosis() if ctx.anomaly is not None else None

    assert [d.code for d in diagnose(trace)] == ["NW908"]


def test_history_summaries_are_computed_once_and_released(
    registry: dict[str, Rule],
) -> None:
    from nanwatch.rules import base

    seen: list[int] = []

    def summary(t: StepTrace) -> int:
        seen.append(t.step)
        return t.step

    @rule("NW909", title="Memo", severity="info", summary="s")
    def memo(ctx: RuleContext) -> None:
        for t in ctx.history:
            ctx.memo(t, "nw909", summary)
        ctx.memo(ctx.trace, "nw909", summary)

    hist = [_clean_trace(i) for i in range(4)]
    diagnose(_clean_trace(4), hist)
    diagnose(_clean_trace(5), hist)
    assert seen == [0, 1, 2, 3, 4, 5]  # history once, the current step each time
    diagnose(_clean_trace(6), hist[2:])
    assert not any(t is hist[0] for t, _ in base._MEMO.values())  # left the ring: dropped


def test_rules_read_the_configured_thresholds() -> None:
    ctx = RuleContext(trace=StepTrace(step=0), history=[], thresholds=Thresholds(headroom=0.25))
    assert ctx.thresholds.headroom == 0.25
    assert ctx.notes("loss_input") == []


def test_diagnosis_round_trips_through_json_data() -> None:
    d = Diagnosis(
        "NW111",
        "Division by zero",
        "error",
        step=2,
        phase="forward",
        path="norm",
        op="aten.div.Tensor",
        evidence=["denominator holds 1 exact zero"],
        fix="y = x / d.clamp_min(eps)",
        source="model.py:3",
        priority=12,
    )
    back = Diagnosis.from_dict(d.to_dict())
    assert back.to_dict() == d.to_dict()
    assert back.headline == "NW111 error: Division by zero (norm, aten.div.Tensor, forward, step 2)"


def test_a_step_is_summarized_once_not_again_when_it_is_history(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rules that compare a step with its history (exploding and vanishing gradients)
    used to summarize every step twice: as the current step, then as history."""
    from collections import Counter

    from nanwatch.rules import gradients

    calls: Counter[int] = Counter()
    real = gradients._grad_summary

    def counted(trace: Any) -> Any:
        calls[trace.step] += 1
        return real(trace)

    monkeypatch.setattr(gradients, "_grad_summary", counted)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with nanwatch.watch(model) as nw:
        for _ in range(8):
            model(torch.randn(16, 4)).pow(2).mean().backward()
            nw.step()
    assert len(nw.history) == 8 and nw.first_anomaly is None
    assert sorted(calls) == list(range(8)) and set(calls.values()) == {1}


def test_nanwatchs_rules_that_need_a_nan_skip_a_healthy_step(
    registry: dict[str, Rule],
) -> None:
    """On a step where every value is finite and nothing stopped, only early rules and the
    user's run: nanwatch's other rules explain a NaN, and most steps have none. A step with
    a NaN runs them all."""
    import dataclasses

    ran: list[str] = []

    def counting(r: Rule) -> Rule:
        inner = r.func

        def func(ctx: RuleContext) -> Any:
            ran.append(r.code)
            return inner(ctx)

        func.__module__ = inner.__module__  # still a built-in rule
        return dataclasses.replace(r, func=func)

    for code in ("NW101", "NW103"):  # NW101 needs an overflow; NW103 is an early warning
        REGISTRY[code] = counting(REGISTRY[code])
    assert REGISTRY["NW101"].builtin and not REGISTRY["NW101"].early

    @rule("NW909", title="Mine", severity="info", summary="s")
    def mine(ctx: RuleContext) -> None:
        ran.append("NW909")

    diagnose(_clean_trace())
    assert ran == ["NW103", "NW909"]

    ran.clear()
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0))
    b.forward(net, stat(-math.inf, 1.0, neginf=1))
    diagnose(b.build())
    assert sorted(ran) == ["NW101", "NW103", "NW909"]
