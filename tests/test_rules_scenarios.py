"""Acceptance on the failure gallery (the same scenarios `nanwatch demo` shows): every seed
scenario gets the right code as its top diagnosis, the healthy controls get none, and each
diagnosis carries the numbers, the place and the fix a user acts on."""

from __future__ import annotations

import functools
from typing import Any

import pytest

import nanwatch
from nanwatch import scenarios
from nanwatch.rules import REGISTRY
from nanwatch.rules.base import Diagnosis

_GALLERY = scenarios.all_scenarios()
_DIAGNOSED = [s.name for s in _GALLERY if s.expected.diagnosis is not None]
_HEALTHY = [s.name for s in _GALLERY if s.expected.healthy]


@functools.cache
def outcome(name: str, **options: Any) -> scenarios.Outcome:
    return scenarios.run(scenarios.get(name), **options)


def line_of(module: str, text: str) -> str:
    """``file.py:N`` of the first line of a scenario module containing ``text``."""
    import importlib
    import inspect

    mod = importlib.import_module(f"nanwatch.scenarios.{module}")
    lines = inspect.getsource(mod).splitlines()
    n = next(i for i, line in enumerate(lines, 1) if text in line)
    return f"{module}.py:{n}"


def top(name: str) -> Diagnosis:
    d = outcome(name).top
    assert d is not None, f"{name}: no diagnosis"
    return d


def get(name: str, code: str) -> Diagnosis:
    found = [d for d in outcome(name).diagnoses if d.code == code]
    assert found, f"{name}: {code} missing; got {[d.code for d in outcome(name).diagnoses]}"
    return found[0]


def test_the_gallery_covers_every_seed_failure_and_the_healthy_controls() -> None:
    for name in (
        "bce-saturated",
        "sigmoid-bce",
        "softmax-ce",
        "softmax-nll",
        "fp16-seg-overflow",
        "div-by-zero",
        "sqrt-backward",
        "nan-input",
        "inplace-saved",
        "lr-explode",
        "deep-nan",
        "fully-masked-row",
    ):
        assert name in _DIAGNOSED
    assert len(_HEALTHY) >= 3


@pytest.mark.parametrize("name", _DIAGNOSED)
def test_every_seed_scenario_gets_the_right_top_diagnosis(name: str) -> None:
    out = outcome(name)
    assert out.mismatches() == []
    assert out.top is not None and out.top.code == out.scenario.expected.diagnosis
    assert out.top.code in REGISTRY


@pytest.mark.parametrize("name", _HEALTHY)
def test_healthy_controls_get_no_diagnosis_at_all(name: str) -> None:
    out = outcome(name)
    assert out.mismatches() == []
    assert [d.headline for d in out.diagnoses] == []


@pytest.mark.parametrize("name", _DIAGNOSED)
def test_every_top_diagnosis_is_complete(name: str) -> None:
    d = top(name)
    assert d.title and d.severity in ("error", "warning")
    assert d.step is not None and (d.path or d.parameter)
    assert d.evidence and d.explanation and d.fix
    assert d.silence.endswith(f'ignore=["{d.code}"])')


def test_ignoring_the_top_code_in_watch_silences_it() -> None:
    out = scenarios.run(scenarios.get("div-by-zero"), ignore=["NW111"])
    assert "NW111" not in [d.code for d in out.diagnoses]
    assert out.top is not None and out.top.code == "NW100"  # the catch-all still explains it


def test_an_error_diagnosis_without_a_nan_makes_watch_raise() -> None:
    out = scenarios.run(scenarios.get("bce-saturated"), on_anomaly="raise")
    assert isinstance(out.error, nanwatch.AnomalyError)
    assert out.error.diagnosis is not None and out.error.diagnosis.code == "NW201"
    assert out.error.anomaly is None


# ------------------------------------------------------------------ per scenario


def test_fp16_segmentation_names_the_ignored_pixels_and_the_exp_overflow() -> None:
    d = top("fp16-seg-overflow")
    text = " | ".join(d.evidence)
    assert d.code == "NW206" and d.severity == "error"
    assert "target == 255" in text and "11.09" in text and "float16" in text
    assert "logits.float()" in d.fix
    over = get("fp16-seg-overflow", "NW101")
    assert over.op == "aten.exp" and over.path == "SegLoss"
    assert over.source is not None and over.source.endswith(
        line_of("fp16_seg_overflow", "e = logits.exp()")
    )
    assert "e = logits.float().exp()" in over.fix


def test_fp16_segmentation_without_guards_still_names_the_overflow() -> None:
    out = outcome("fp16-seg-overflow", guards=False)
    assert out.top is not None and out.top.code == "NW101"


def test_fp16_segmentation_is_warned_about_many_steps_before_the_nan() -> None:
    out = outcome("fp16-seg-overflow")
    a = out.anomaly
    assert a is not None
    early = [
        t.step
        for t in out.history
        if t.step < a.step and any(d.code in ("NW103", "NW206") for d in t.diagnoses)
    ]
    assert early and a.step - min(early) >= 5
    warned = [d for t in out.history if t.step < a.step for d in t.diagnoses]
    assert all(d.severity == "warning" for d in warned)
    assert all(REGISTRY[d.code].early for d in warned)


def test_bce_saturation_is_the_massive_loss() -> None:
    d = top("bce-saturated")
    text = " | ".join(d.evidence)
    assert outcome("bce-saturated").anomaly is None
    assert "clamp" in text and "100" in text
    assert "BCEWithLogitsLoss" in d.fix


@pytest.mark.parametrize(
    ("name", "module", "words"),
    [
        ("sigmoid-bce", "act (Sigmoid)", "BCEWithLogitsLoss"),
        ("softmax-ce", "3 (Softmax)", "CrossEntropyLoss()"),
        ("softmax-nll", "out (Softmax)", "nn.LogSoftmax(dim=1)"),
    ],
)
def test_pairing_names_the_activation_module(name: str, module: str, words: str) -> None:
    d = top(name)
    # sigmoid-bce's warning leads with why it warns now (probabilities near 1)
    assert any(module in e for e in d.evidence), d.evidence
    assert words in d.fix
    assert outcome(name).anomaly is None


def test_division_by_zero_names_op_line_and_zero_over_zero() -> None:
    d = top("div-by-zero")
    assert (d.path, d.op, d.title) == ("norm", "aten.div.Tensor", "Division by zero (0/0)")
    assert d.source is not None and d.source.endswith(line_of("div_by_zero", "/ (hi - lo)"))
    assert "exact zero" in d.evidence[0]


def test_sqrt_backward_names_the_module_and_the_line_in_watch_mode() -> None:
    # a module with no watched children: its own backward is replayed on the anomaly path
    d = top("sqrt-backward")
    text = " | ".join(d.evidence)
    assert (d.code, d.path, d.phase) == ("NW112", "distance", "backward")
    assert "SqrtBackward0" in text and "exact zeros" in text
    assert d.source is not None and d.source.endswith(line_of("sqrt_backward", "torch.sqrt("))


def test_sqrt_backward_in_forensic_mode_names_the_line() -> None:
    d = outcome("sqrt-backward", mode="forensic").top
    assert d is not None and d.code == "NW112"
    assert d.source is not None and d.source.endswith(line_of("sqrt_backward", "torch.sqrt("))


def test_nan_input_names_the_sample() -> None:
    from nanwatch.scenarios import nan_input

    d = top("nan-input")
    assert f"sample {nan_input.BAD_SAMPLE} (1 of 32)" in d.evidence[0]


def test_weights_after_the_update_name_the_parameter_and_the_float16_limit() -> None:
    d = top("lr-explode")
    text = " | ".join(d.evidence)
    assert d.parameter == "proj.weight" and "65504" in text and "loss over the last steps" in text


def test_deep_nan_is_a_fractional_power_of_negatives_at_the_exact_module() -> None:
    d = top("deep-nan")
    assert d.path == "encoder.blocks.3.mlp.act" and d.op == "aten.pow.Tensor_Scalar"
    assert "1.5" in d.evidence[0]


def test_consequences_in_later_steps_do_not_outrank_the_cause() -> None:
    for name in ("nan-input", "deep-nan", "fp16-seg-overflow"):
        later = [d for d in outcome(name).diagnoses if d.code == "NW301"]
        assert later and "consequence" in later[0].title
        assert top(name).code != "NW301"


def test_fully_masked_row_names_the_mask_line() -> None:
    d = top("fully-masked-row")
    text = " | ".join(d.evidence)
    assert d.op == "aten._softmax" and "masked_fill" in text
    assert line_of("fully_masked_row", "scores.masked_fill(") in text


def test_inplace_error_names_the_module_whose_output_changed() -> None:
    from nanwatch.scenarios import inplace_saved

    d = top("inplace-saved")
    assert d.path == inplace_saved.MUTATED
    assert "Sigmoid" in d.evidence[0] and "version 1" in d.evidence[0]


def test_a_collapsing_grad_scaler_is_diagnosed_in_a_real_run() -> None:
    import torch
    from torch import nn

    torch.manual_seed(0)
    model, criterion = nn.Linear(4, 1), nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with nanwatch.watch(
        model, criterion, scaler=scaler, on_anomaly="record", postmortem=False
    ) as nw:
        for step in range(16):
            out = model(torch.randn(8, 4))
            if step >= 2:  # from here on every loss is inf: no scale can help
                out = out * float("inf")
            loss = criterion(out, torch.randn(8, 1))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            nw.step()
    last = nw.history[-1]
    assert last.scale is not None and last.scale <= 1.0
    d = next(d for d in last.diagnoses if d.code == "NW305")
    assert d.severity == "error"
    assert "skipped" in d.evidence[0] and "256" in d.evidence[0]
