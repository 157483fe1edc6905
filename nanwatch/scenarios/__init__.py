"""The failure gallery: real training code that goes wrong, each with what nanwatch should
find. ``nanwatch demo`` runs it, the tests assert on it, and the docs quote it, so the
three cannot drift apart.

A scenario is a module in this package with a docstring saying where the failure comes from
in practice, ``TITLE``, ``EXPECTED`` (an :class:`Expected`) and ``train(watch)``: ordinary
training code that calls ``watch(model, criterion)`` where a user would call
:func:`nanwatch.watch`.

Example:
    >>> from nanwatch import scenarios
    >>> outcome = scenarios.run(scenarios.get("div-by-zero"))
    >>> outcome.anomaly.path
    'norm'
"""

from __future__ import annotations

import importlib
import pkgutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from nanwatch.errors import ConfigError
from nanwatch.records import Anomaly, AnomalyKind, Phase, StepTrace
from nanwatch.rules.base import SEVERITIES, Diagnosis, sort_key
from nanwatch.watcher import Watcher, watch

#: Gallery order: what `nanwatch demo` shows first comes first; scenario modules not
#: listed here follow in alphabetical order.
_ORDER = (
    "bce_saturated",
    "sigmoid_bce",
    "softmax_ce",
    "softmax_nll",
    "fp16_seg_overflow",
    "div_by_zero",
    "all_ignored",
    "angular_acos",
    "sqrt_backward",
    "focal_loss_backward",
    "nan_input",
    "target_255",
    "added_token",
    "inplace_saved",
    "broadcast_mse",
    "lr_explode",
    "deep_nan",
    "fully_masked_row",
    "healthy_fp32_large_logits",
    "healthy_fp16",
    "healthy_fp16_scaler",
    "healthy_masked_attention",
)


def _module_names() -> list[str]:
    found = {m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")}
    return [m for m in _ORDER if m in found] + sorted(found - set(_ORDER))


@dataclass(frozen=True)
class Expected:
    """What nanwatch should find. ``kind=None`` means no non-finite anomaly at all."""

    kind: AnomalyKind | None = None
    path: str | None = None  #: producer module path
    phase: Phase | None = None  #: phase of the first bad record
    op: str | None = None  #: prefix of the aten op (``aten.div``)
    parameter: str | None = None
    dtype: str | None = None  #: dtype where the value was born (the op's, else the record's)
    #: code of the top diagnosis (the rule engine's answer), when the rules know it
    diagnosis: str | None = None
    #: the user's own exception, which must come out unchanged
    raises: type[BaseException] | None = None
    #: a healthy control: no anomaly and no error-severity diagnosis
    healthy: bool = False


@dataclass(frozen=True)
class Scenario:
    name: str  #: ``div-by-zero``
    title: str
    doc: str  #: where the failure comes from in practice
    expected: Expected
    train: Callable[[Callable[..., Watcher]], Any]
    module: str

    @property
    def summary(self) -> str:
        return self.doc.strip().splitlines()[0] if self.doc.strip() else self.title


@dataclass
class Outcome:
    """What running a scenario under nanwatch produced."""

    scenario: Scenario
    watcher: Watcher | None
    error: BaseException | None
    seconds: float
    watchers: list[Watcher] = field(default_factory=list)

    @property
    def history(self) -> list[StepTrace]:
        return list(self.watcher.history) if self.watcher is not None else []

    @property
    def anomaly(self) -> Anomaly | None:
        return self.watcher.first_anomaly if self.watcher is not None else None

    @property
    def diagnoses(self) -> list[Diagnosis]:
        """Every distinct diagnosis of the run (first occurrence of each code, or its first
        more severe one), most important first; the anomaly's step first among equals."""
        seen: dict[str, Diagnosis] = {}
        steps = self.history
        a = self.anomaly
        if a is not None:
            steps = sorted(steps, key=lambda t: t.step != a.step)
        for t in steps:
            for d in t.diagnoses:
                kept = seen.setdefault(d.code, d)
                if SEVERITIES.index(d.severity) < SEVERITIES.index(kept.severity):
                    seen[d.code] = d  # grew more severe (a note, then a warning)
        return sorted(seen.values(), key=sort_key)

    @property
    def top(self) -> Diagnosis | None:
        ds = self.diagnoses
        return ds[0] if ds else None

    def mismatches(self, *, with_diagnosis: bool = True) -> list[str]:
        """How the outcome differs from ``EXPECTED``; empty when nanwatch got it right."""
        exp = self.scenario.expected
        out: list[str] = []
        if exp.raises is not None:
            if not isinstance(self.error, exp.raises):
                out.append(f"expected {exp.raises.__name__} to propagate, got {self.error!r}")
        elif self.error is not None:
            out.append(f"unexpected exception {type(self.error).__name__}: {self.error}")
        a = self.anomaly
        if exp.kind is None:
            if a is not None:
                out.append(f"expected no anomaly, found: {a.summary}")
        elif a is None:
            out.append(f"expected a {exp.kind.value} anomaly, found none")
        else:
            if a.kind is not exp.kind:
                out.append(f"kind: expected {exp.kind.value}, got {a.kind.value}")
            if exp.path is not None and a.path != exp.path:
                out.append(f"path: expected {exp.path}, got {a.path}")
            if exp.phase is not None and a.record.phase is not exp.phase:
                out.append(f"phase: expected {exp.phase.value}, got {a.record.phase.value}")
            if exp.op is not None and (a.op is None or not a.op.op.startswith(exp.op)):
                out.append(f"op: expected {exp.op}, got {a.op.op if a.op else None}")
            if exp.parameter is not None and a.parameter != exp.parameter:
                out.append(f"parameter: expected {exp.parameter}, got {a.parameter}")
            dtype = a.op.dtype if a.op is not None and a.op.dtype else a.record.dtype
            if exp.dtype is not None and dtype != exp.dtype:
                out.append(f"dtype: expected {exp.dtype}, got {dtype}")
        if exp.healthy:
            errors = [d for d in self.diagnoses if d.severity == "error"]
            if errors:
                out.append(f"healthy control got an error diagnosis: {errors[0].headline}")
        if with_diagnosis and exp.diagnosis is not None:
            top = self.top
            if top is None or top.code != exp.diagnosis:
                out.append(
                    f"top diagnosis: expected {exp.diagnosis}, got {top.code if top else None}"
                )
        return out


def _load(modname: str) -> Scenario:
    mod: ModuleType = importlib.import_module(f"{__name__}.{modname}")
    return Scenario(
        name=modname.replace("_", "-"),
        title=mod.TITLE,
        doc=mod.__doc__ or "",
        expected=mod.EXPECTED,
        train=mod.train,
        module=mod.__name__,
    )


def all_scenarios() -> list[Scenario]:
    """The gallery, in the order the demo shows it."""
    return [_load(m) for m in _module_names()]


def names() -> list[str]:
    return [m.replace("_", "-") for m in _module_names()]


def get(name: str) -> Scenario:
    key = name.replace("-", "_")
    if key not in _module_names():
        raise ConfigError(
            "scenario", name, f"no scenario named {name!r}; known: {', '.join(names())}."
        )
    return _load(key)


def run(scenario: Scenario, **options: Any) -> Outcome:
    """Run ``scenario`` under nanwatch. ``options`` go to every :func:`nanwatch.watch` call
    the scenario makes (default: ``on_anomaly="record"``, no post-mortem files). The
    scenario's own exceptions are caught and returned in the outcome."""
    opts: dict[str, Any] = {"on_anomaly": "record", "postmortem": False}
    opts.update(options)
    made: list[Watcher] = []

    def factory(*modules: Any, **kw: Any) -> Watcher:
        nw = watch(*modules, **{**kw, **opts})
        made.append(nw)
        return nw

    t0 = time.perf_counter()
    error: BaseException | None = None
    try:
        scenario.train(factory)
    except Exception as exc:
        error = exc
    return Outcome(
        scenario=scenario,
        watcher=made[-1] if made else None,
        error=error,
        seconds=time.perf_counter() - t0,
        watchers=made,
    )


__all__ = ["Expected", "Outcome", "Scenario", "all_scenarios", "get", "names", "run"]
