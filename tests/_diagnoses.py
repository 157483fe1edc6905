"""Helpers shared by the rule tests: the first bad step of a watcher, its top diagnosis,
a diagnosis as one text, counted statistics, a fix as the code a user pastes, and the
AnomalyError a run raises with its diagnosis of a code."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

import nanwatch
from nanwatch.records import StepTrace, TensorStat
from nanwatch.rules.base import Diagnosis
from nanwatch.rules.testing import stat


def counted(lo: float, hi: float, **kw: Any) -> TensorStat:
    return stat(lo, hi, counted=True, **kw)


def first_bad(nw: Any) -> StepTrace:
    bad = [t for t in nw.history if t.anomaly is not None]
    assert bad, "no anomaly was found"
    return bad[0]


def top(nw: Any) -> Diagnosis:
    t = first_bad(nw)
    assert t.diagnoses, f"no diagnosis at step {t.step}"
    return t.diagnoses[0]


def text(d: Diagnosis) -> str:
    return "\n".join([d.title, *d.evidence, d.explanation, d.fix])


def code_lines(fix: str) -> str:
    """The fix without its comment-only lines, dedented: what a user pastes."""
    return "\n".join(ln.strip() for ln in fix.splitlines() if not ln.strip().startswith("#"))


def first_of(err: nanwatch.AnomalyError, code: str) -> nanwatch.Diagnosis:
    """The first of ``err``'s diagnoses with ``code``."""
    return next(d for d in err.diagnoses if d.code == code)


def raises(model: nn.Module, run: Callable[[], Any], mode: str = "watch") -> nanwatch.AnomalyError:
    """The AnomalyError ``run()`` raises with ``model`` watched in ``mode``."""
    try:
        with nanwatch.watch(model, mode=mode):  # type: ignore[arg-type]
            run()
    except nanwatch.AnomalyError as e:
        return e
    raise AssertionError("no anomaly")
