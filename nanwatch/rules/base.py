"""The rule engine: a Rule is a function of the step's records (and the history ring)
that returns zero or more Diagnosis. Built-in rules and user rules use the same decorator.

Example:
    >>> from nanwatch.rules import rule, Diagnosis
    >>> @rule("NW901", title="Loss above 1e4", severity="warning",
    ...       summary="The loss is larger than 1e4.")
    ... def huge_loss(ctx):
    ...     if ctx.trace.loss is not None and ctx.trace.loss > 1e4:
    ...         yield ctx.diagnosis(evidence=[f"loss = {ctx.trace.loss:.4g}"],
    ...                             explanation="The loss exploded.", fix="lower the lr")
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from nanwatch.errors import ConfigError
from nanwatch.records import Anomaly, Phase, Record, StepTrace

if TYPE_CHECKING:
    from nanwatch.config import Thresholds

Severity = Literal["error", "warning", "info"]
SEVERITIES: tuple[str, ...] = ("error", "warning", "info")
_SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}
_CODE = re.compile(r"^NW\d{3,4}$")


@dataclass(slots=True, eq=False)
class Diagnosis:
    """What went wrong, where, the numbers that show it, and the fix."""

    code: str  #: stable, never reused: ``NW101``
    title: str
    severity: Severity
    step: int | None = None
    phase: str | None = None
    path: str | None = None  #: module path
    op: str | None = None  #: aten op, when pinpointed
    parameter: str | None = None
    evidence: list[str] = field(default_factory=list)  #: numbers with units
    explanation: str = ""
    fix: str = ""  #: code the user can paste
    source: str | None = None  #: the user's line, ``file.py:42``
    priority: int = 50  #: lower sorts first among diagnoses of equal severity

    @property
    def silence(self) -> str:
        return f'nanwatch.watch(..., ignore=["{self.code}"])'

    @property
    def where(self) -> str:
        parts = []
        if self.path:
            parts.append(self.path)
        if self.op:
            parts.append(self.op)
        if self.parameter and self.parameter != self.path:
            parts.append(self.parameter)
        if self.phase:
            parts.append(self.phase)
        if self.step is not None:
            parts.append(f"step {self.step}")
        return ", ".join(parts)

    @property
    def headline(self) -> str:
        """One line: ``NW101 error: <title> (<where>)``."""
        where = self.where
        return f"{self.code} {self.severity}: {self.title}" + (f" ({where})" if where else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "title": self.title,
            "severity": self.severity,
            "step": self.step,
            "phase": self.phase,
            "path": self.path,
            "op": self.op,
            "parameter": self.parameter,
            "evidence": list(self.evidence),
            "explanation": self.explanation,
            "fix": self.fix,
            "source": self.source,
            "priority": self.priority,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Diagnosis:
        return cls(
            code=d["code"],
            title=d["title"],
            severity=d["severity"],
            step=d.get("step"),
            phase=d.get("phase"),
            path=d.get("path"),
            op=d.get("op"),
            parameter=d.get("parameter"),
            evidence=list(d.get("evidence", [])),
            explanation=d.get("explanation", ""),
            fix=d.get("fix", ""),
            source=d.get("source"),
            priority=int(d.get("priority", 50)),
        )


@dataclass(slots=True)
class RuleContext:
    """What a rule sees: the current step, the steps before it (oldest first), the
    thresholds, and a factory for diagnoses carrying the rule's code, title and severity."""

    trace: StepTrace
    history: Sequence[StepTrace]
    thresholds: Thresholds
    rule: Rule | None = None
    #: extra facts the watcher knows (``scaler``: whether a GradScaler was given).
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def anomaly(self) -> Anomaly | None:
        return self.trace.anomaly

    @property
    def step(self) -> int:
        return self.trace.step

    def records(self, *phases: Phase) -> Iterable[Record]:
        if not phases:
            return iter(self.trace.records)
        want = set(phases)
        return (r for r in self.trace.records if r.phase in want)

    def diagnosis(self, **fields: Any) -> Diagnosis:
        """A Diagnosis pre-filled with this rule's code, title, severity and step."""
        rule = self.rule
        if rule is None:
            raise RuntimeError("RuleContext.diagnosis() is only available inside a rule")
        fields.setdefault("code", rule.code)
        fields.setdefault("title", rule.title)
        fields.setdefault("severity", rule.severity)
        fields.setdefault("step", self.trace.step)
        fields.setdefault("priority", rule.priority)
        return Diagnosis(**fields)


RuleFunc = Callable[[RuleContext], Iterable[Diagnosis] | Diagnosis | None]


@dataclass(frozen=True)
class Rule:
    """A registered rule: its stable code, title, severity, one-line summary, and whether it
    can fire before any NaN exists (an early warning)."""

    code: str
    title: str
    severity: Severity
    summary: str
    func: RuleFunc
    early: bool = False
    family: str = "user"
    priority: int = 50

    def __call__(self, ctx: RuleContext) -> list[Diagnosis]:
        """Run the rule; a single Diagnosis, None or any iterable of them is accepted, and
        anything that is not a Diagnosis is dropped."""
        result = self.func(ctx)
        if result is None:
            return []
        if isinstance(result, Diagnosis):
            return [result]
        return [d for d in result if isinstance(d, Diagnosis)]


REGISTRY: dict[str, Rule] = {}


def rule(
    code: str,
    *,
    title: str,
    severity: Severity,
    summary: str,
    early: bool = False,
    family: str = "user",
    priority: int = 50,
    replace: bool = False,
) -> Callable[[RuleFunc], RuleFunc]:
    """Register a rule. Codes are ``NW`` + 3 or 4 digits and never reused: registering a
    code twice is an error unless ``replace=True`` (for reloading your own rule)."""
    if not isinstance(code, str) or not _CODE.match(code):
        raise ConfigError(
            "code", code, f"a rule code is 'NW' and 3-4 digits, like 'NW901'; got {code!r}."
        )
    if severity not in _SEVERITY_RANK:
        raise ConfigError(
            "severity",
            severity,
            f"`severity` can be {', '.join(map(repr, SEVERITIES))}; got {severity!r}.",
        )

    def decorate(func: RuleFunc) -> RuleFunc:
        if code in REGISTRY and not replace and REGISTRY[code].func is not func:
            existing = REGISTRY[code]
            raise ConfigError(
                "code",
                code,
                f"rule code {code} is taken by {existing.title!r} ({existing.family}); "
                "pick an unused code (nanwatch rules lists them) or pass replace=True.",
            )
        REGISTRY[code] = Rule(
            code=code,
            title=title,
            severity=severity,
            summary=summary,
            func=func,
            early=early,
            family=family,
            priority=priority,
        )
        return func

    return decorate


def catalog() -> list[Rule]:
    """Every registered rule, by code."""
    _load_builtin()
    return sorted(REGISTRY.values(), key=lambda r: (len(r.code), r.code))


def _load_builtin() -> None:
    import nanwatch.rules  # noqa: F401  (importing the package registers the built-in families)


def sort_key(d: Diagnosis) -> tuple[int, int, str]:
    return (_SEVERITY_RANK.get(d.severity, 3), d.priority, d.code)


def evaluate(
    trace: StepTrace,
    history: Sequence[StepTrace],
    thresholds: Thresholds,
    *,
    ignore: Iterable[str] = (),
    disabled: set[str] | None = None,
    facts: dict[str, Any] | None = None,
) -> list[Diagnosis]:
    """Run every registered rule on ``trace``; most important first. A rule that raises is
    reported once (a warning) and added to ``disabled``; it never breaks the step."""
    _load_builtin()
    skip = set(ignore)
    dead = disabled if disabled is not None else set()
    out: list[Diagnosis] = []
    ctx = RuleContext(trace=trace, history=history, thresholds=thresholds, facts=dict(facts or {}))
    for r in list(REGISTRY.values()):
        if r.code in skip or r.code in dead:
            continue
        ctx.rule = r
        try:
            found = r(ctx)
        except Exception as exc:
            dead.add(r.code)
            warnings.warn(
                f"nanwatch: rule {r.code} ({r.title}) raised {type(exc).__name__}: {exc}; "
                "it is disabled for the rest of this run. The step goes on.",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        out.extend(found)
    out.sort(key=sort_key)
    return out
