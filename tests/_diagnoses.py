"""Helpers shared by the rule tests: the first bad step of a watcher, its top diagnosis,
a diagnosis as one text, counted statistics, and a fix as the code a user pastes."""

from __future__ import annotations

from typing import Any

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
