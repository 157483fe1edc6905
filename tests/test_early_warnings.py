"""Early warnings reach the user as they happen: each warning-severity code once, as a
``nanwatch.NanwatchWarning`` pointing at the user's line; ``on_anomaly="record"`` is silent."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch


def _distill_step(student: nn.Module, teacher: nn.Module) -> torch.Tensor:
    x = torch.randn(16, 10)
    p_student = F.softmax(student(x), dim=-1)
    p_teacher = F.softmax(teacher(x), dim=-1)
    return F.kl_div(p_student, p_teacher, reduction="batchmean")  # needs log-probabilities


def test_kl_div_on_probabilities_is_diagnosed_and_said_once_at_the_users_line() -> None:
    student, teacher = nn.Linear(10, 4), nn.Linear(10, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(student, teacher) as nw:
            for _ in range(3):
                loss = _distill_step(student, teacher)
                loss.backward()
                nw.step()
    assert float(loss) < 0  # what the user sees: a "divergence" below 0
    ours = [w for w in caught if issubclass(w.category, nanwatch.NanwatchWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]  # once, not once a step
    w = ours[0]
    # the line of the F.kl_div call, not the line of nw.step() that ended the step
    assert (w.filename, w.lineno) == (__file__, _distill_step.__code__.co_firstlineno + 4)
    text = str(w.message)
    assert "NW205" in text and "F.kl_div" in text and "never above 0" in text
    assert "F.log_softmax" in text and 'ignore=["NW205"]' in text
    d = next(d for d in nw.history[0].diagnoses if d.code == "NW205")
    assert d.severity == "warning" and "softmax" in " ".join(d.evidence)
    assert d.title == "Probabilities where log-probabilities are expected"  # not "logits"


def test_kl_div_on_log_probabilities_is_silent() -> None:
    student, teacher = nn.Linear(10, 4), nn.Linear(10, 4)
    with nanwatch.watch(student, teacher) as nw:
        x = torch.randn(16, 10)
        loss = F.kl_div(
            F.log_softmax(student(x), -1), F.softmax(teacher(x), -1), reduction="batchmean"
        )
        loss.backward()
        nw.step()
    assert float(loss) >= 0
    assert not nw.history[0].diagnoses


@pytest.mark.parametrize("policy", ["record", "raise"])
def test_record_keeps_early_warnings_in_the_report_only(policy: str) -> None:
    student, teacher = nn.Linear(10, 4), nn.Linear(10, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(student, teacher, on_anomaly=policy) as nw:
            _distill_step(student, teacher).backward()
            nw.step()
    ours = [w for w in caught if issubclass(w.category, nanwatch.NanwatchWarning)]
    assert len(ours) == (0 if policy == "record" else 1)
    assert any(d.code == "NW205" for d in nw.history[0].diagnoses)


def test_an_ignored_code_is_not_said() -> None:
    student, teacher = nn.Linear(10, 4), nn.Linear(10, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(student, teacher, ignore=["NW205"]) as nw:
            _distill_step(student, teacher).backward()
            nw.step()
    assert not [w for w in caught if issubclass(w.category, nanwatch.NanwatchWarning)]
    assert not nw.history[0].diagnoses
