"""The gallery's seed failures (issue 2): each scenario's expected finding, with the exact
module path, phase and op."""

from __future__ import annotations

import pytest

from nanwatch import AnomalyKind, Phase, scenarios
from nanwatch.localize import inplace_suspects


def _line_of(name: str, text: str) -> int:
    """The line of a scenario's source holding ``text`` (scenarios get edited: no constants)."""
    import importlib
    import inspect

    source = inspect.getsource(importlib.import_module(scenarios.get(name).module))
    return next(i for i, line in enumerate(source.splitlines(), 1) if text in line)


@pytest.mark.parametrize("name", scenarios.names())
def test_every_scenario_is_found_as_expected(name: str) -> None:
    outcome = scenarios.run(scenarios.get(name))
    assert outcome.mismatches(with_diagnosis=False) == []


def test_every_scenario_says_where_it_comes_from_in_practice() -> None:
    for s in scenarios.all_scenarios():
        assert len(s.doc.split()) > 40, s.name
        assert "In practice" in s.doc, s.name


def test_unknown_scenarios_are_named_with_the_known_ones() -> None:
    with pytest.raises(Exception, match=r"known: .*div-by-zero"):
        scenarios.get("dvi-by-zero")


def test_bce_saturation_shows_as_a_massive_loss_not_a_nan() -> None:
    from nanwatch.scenarios import bce_saturated

    outcome = scenarios.run(scenarios.get("bce-saturated"))
    assert outcome.anomaly is None
    losses = [t.loss for t in outcome.history]
    assert all(loss is not None for loss in losses)
    # PyTorch clamps log at -100: a confidently wrong element costs 100
    assert losses[0] == pytest.approx(100 * bce_saturated.WRONG, rel=0.05)


def test_division_by_zero_is_pinned_to_the_module_op_and_line() -> None:
    a = scenarios.run(scenarios.get("div-by-zero")).anomaly
    assert a is not None
    assert (a.kind, a.path, a.record.phase) == (AnomalyKind.FORWARD, "norm", Phase.FORWARD)
    assert a.op is not None and a.op.op == "aten.div.Tensor"
    line = _line_of("div-by-zero", "return (x - lo) / (hi - lo)")
    assert a.op.source is not None and a.op.source.endswith(f"div_by_zero.py:{line}")
    assert a.op.code == "return (x - lo) / (hi - lo)"
    assert a.propagator_count >= 2


def test_fp16_overflow_names_the_producer_and_float16() -> None:
    outcome = scenarios.run(scenarios.get("fp16-seg-overflow"))
    a = outcome.anomaly
    assert a is not None and a.path == "SegLoss"
    assert a.op is not None and a.op.op == "aten.exp.default" and a.op.dtype == "float16"
    exp_in = a.op.inputs[0][1]
    assert exp_in is not None and exp_in.max > 11.09  # the overflow bound of float16 exp
    # the logit magnitude climbed for many steps before the overflow
    mags = [t.max_logit for t in outcome.history if t.step < a.step and t.max_logit]
    assert mags[-1] > 3 * mags[0]


def test_sqrt_at_zero_is_born_in_backward_at_that_module() -> None:
    outcome = scenarios.run(scenarios.get("sqrt-backward"))
    a = outcome.anomaly
    assert a is not None
    assert (a.kind, a.path, a.record.phase) == (AnomalyKind.BACKWARD, "distance", Phase.BACKWARD)
    forward = [r for r in outcome.history[a.step].records if r.phase is Phase.FORWARD]
    assert all(r.stat is None or r.stat.finite for r in forward)


def test_nan_in_one_sample_is_bad_data() -> None:
    from nanwatch.scenarios import nan_input

    a = scenarios.run(scenarios.get("nan-input")).anomaly
    assert a is not None and a.kind is AnomalyKind.INPUT and a.origin == "data"
    assert a.record.stat is not None and a.record.stat.bad_rows == (nan_input.BAD_SAMPLE,)


def test_inplace_error_propagates_unchanged_and_records_name_the_module() -> None:
    from nanwatch.scenarios import inplace_saved

    outcome = scenarios.run(scenarios.get("inplace-saved"))
    assert isinstance(outcome.error, RuntimeError)
    assert "modified by an inplace operation" in str(outcome.error)
    assert outcome.watcher is not None and not outcome.watcher.attached
    suspects = inplace_suspects(reversed(outcome.history), str(outcome.error))
    assert [r.path for r in suspects] == [inplace_saved.MUTATED]
    assert outcome.history[-1].error is not None
    assert outcome.history[-1].error["class"] == "autograd-inplace"


def test_lr_explosion_names_the_parameter_the_update_broke() -> None:
    a = scenarios.run(scenarios.get("lr-explode")).anomaly
    assert a is not None
    assert (a.kind, a.parameter, a.record.phase) == (
        AnomalyKind.PARAMETER,
        "proj.weight",
        Phase.PARAMETER,
    )
    assert a.record.dtype == "float16"


def test_a_nan_four_levels_deep_is_found_with_its_propagators() -> None:
    a = scenarios.run(scenarios.get("deep-nan")).anomaly
    assert a is not None and a.path == "encoder.blocks.3.mlp.act"
    assert a.op is not None and a.op.op.startswith("aten.pow")
    assert a.propagator_count >= 4
    assert "encoder.blocks.3.mlp.fc2" in a.propagators


@pytest.mark.parametrize(
    "name", ["healthy-fp32-large-logits", "healthy-fp16", "healthy-masked-attention"]
)
def test_healthy_controls_produce_no_anomaly(name: str) -> None:
    outcome = scenarios.run(scenarios.get(name))
    assert outcome.error is None and outcome.anomaly is None
    assert all(t.anomaly is None for t in outcome.history)


def test_a_fully_masked_row_is_still_found() -> None:
    a = scenarios.run(scenarios.get("fully-masked-row")).anomaly
    assert a is not None and a.path == "attn"
    assert a.op is not None and a.op.op == "aten._softmax.default"
    assert a.op.cause is not None and a.op.cause.op == "aten.masked_fill.Scalar"
