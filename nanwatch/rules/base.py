"""The rule engine: a Rule is a function of the step's records (and the history ring)
that returns zero or more Diagnosis. Built-in rules and user rules use the same decorator.

Rules are pure functions of :class:`~nanwatch.records.StepTrace` objects: they never touch a
tensor, so they run off the hot path (once per step, at the flush) and can be tested on
traces built by hand (:mod:`nanwatch.rules.testing`). A rule that raises is reported once
and disabled; the step goes on.

Example:
    >>> from nanwatch.rules import rule, Diagnosis
    >>> @rule("NW901", title="Loss above 1e4", severity="warning",
    ...       summary="The loss is larger than 1e4.")
    ... def huge_loss(ctx):
    ...     if ctx.trace.loss is not None and ctx.trace.loss > 1e4:
    ...         yield ctx.diagnosis(evidence=[f"loss = {ctx.trace.loss:.4g}"],
    ...                             explanation="The loss exploded.", fix="lower the lr")
    >>> del REGISTRY["NW901"]
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from nanwatch.errors import ConfigError
from nanwatch.records import Anomaly, Note, Phase, Record, StepTrace

if TYPE_CHECKING:
    from nanwatch.config import Thresholds

Severity = Literal["error", "warning", "info"]
SEVERITIES: tuple[str, ...] = ("error", "warning", "info")
_SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}
_CODE = re.compile(r"^NW\d{3,4}$")
_BUILTIN_PREFIX = "nanwatch.rules."

T = TypeVar("T")


def _under_cli() -> bool:
    """Whether this process runs a script under ``nanwatch run`` (its launcher's frames are
    registered by :func:`nanwatch._frames.launched_here`)."""
    from nanwatch import _frames

    return bool(_frames._launchers)


@dataclass(slots=True, eq=False)
class Diagnosis:
    """What went wrong, where, the numbers that show it, and the fix.

    Example:
        >>> d = Diagnosis("NW111", "Division by zero", "error", step=3, path="norm",
        ...               op="aten.div.Tensor")
        >>> d.headline
        'NW111 error: Division by zero (norm, aten.div.Tensor, step 3)'
        >>> d.silence
        'nanwatch.watch(..., ignore=["NW111"])'
    """

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
    #: made in a script run by ``nanwatch run``: silenced by its ``--ignore``, not by a
    #: ``watch()`` call the script does not have (kept in the saved report)
    cli: bool = field(default_factory=_under_cli)
    #: made by the watcher of a framework callback (``"lightning"``: the Lightning
    #: callback): silenced, and sent to forensic mode, through that callback's arguments
    front: str | None = None

    @property
    def silence(self) -> str:
        if self.cli:
            return f"nanwatch run --ignore {self.code} ..."
        if self.front == "lightning":
            return f'NanWatchCallback(..., ignore=["{self.code}"])'
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

    def brief(self, indent: str = "  ") -> list[str]:
        """The lines an error or a warning message gives it: the headline, then the fix,
        its continuation lines under its first.

        >>> Diagnosis("NW1", "t", "error", fix="a = 1\\nb = 2").brief()
        ['  NW1 error: t', '  fix: a = 1', '       b = 2']
        """
        lines = [f"{indent}{self.headline}"]
        if self.fix:
            first, *more = self.fix.splitlines()
            lines.append(f"{indent}fix: {first}")
            lines.extend(f"{indent}     {line}" for line in more)
        return lines

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
            **({"cli": True} if self.cli else {}),
            **({"front": self.front} if self.front else {}),
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
            cli=bool(d.get("cli", False)),
            front=d.get("front") if isinstance(d.get("front"), str) else None,
        )


#: Per-step summaries computed by rules from finished (history) steps, so that a rule
#: reading 32 steps of history does not walk 32 steps of records at every flush. Keyed by
#: id(trace), then by key; the trace itself is kept to check identity, and the entries of
#: steps that left the history are dropped at the next evaluation (memory stays bounded by
#: the ring).
_MEMO: dict[int, tuple[StepTrace, dict[str, Any]]] = {}


@dataclass(slots=True)
class RuleContext:
    """What a rule sees: the current step, the steps before it (oldest first), the
    thresholds, and a factory for diagnoses carrying the rule's code, title and severity.

    Example:
        >>> from nanwatch.config import Thresholds
        >>> ctx = RuleContext(trace=StepTrace(step=3), history=[], thresholds=Thresholds())
        >>> ctx.step, ctx.anomaly is None, ctx.thresholds.headroom
        (3, True, 0.5)
    """

    trace: StepTrace
    history: Sequence[StepTrace]
    thresholds: Thresholds
    rule: Rule | None = None
    #: extra facts the watcher knows (``scaler``: whether a GradScaler was given; ``mode``).
    facts: dict[str, Any] = field(default_factory=dict)
    #: the codes the user silenced (``ignore=``): a rule that leaves a case to another one
    #: speaks itself when that one is silenced
    ignored: frozenset[str] = frozenset()
    #: what :meth:`memo` computed for the current step in this evaluation
    _now: dict[str, Any] = field(default_factory=dict, repr=False)

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

    def notes(self, kind: str) -> list[Note]:
        """The current step's notes of this kind (``"loss_input"``, written by the guards)."""
        return [n for n in self.trace.notes if n.kind == kind]

    def memo(self, trace: StepTrace, key: str, compute: Callable[[StepTrace], T]) -> T:
        """``compute(trace)``, remembered for steps of the history (which no longer change).
        The current step is always computed afresh, and its latest value is kept: a step's
        last evaluation is the one at its end, so once it is history it is not computed
        again (the rules that compare a step with its history read every step twice
        otherwise). Within one evaluation the current step is computed once (six loss
        rules read its loss calls)."""
        now = trace is self.trace
        if now and key in self._now:
            found: T = self._now[key]
            return found
        slot = _MEMO.get(id(trace))
        if slot is None or slot[0] is not trace:
            slot = _MEMO[id(trace)] = (trace, {})
        kept = slot[1]
        if not now and key in kept:
            hit: T = kept[key]
            return hit
        value = compute(trace)
        kept[key] = value
        if now:
            self._now[key] = value
        return value

    def cached(self, trace: StepTrace, key: str) -> Any:
        """What :meth:`memo` kept for ``trace`` under ``key``, or None: nothing is
        computed (a rule that carries a value from one step to the next reads the last
        step's with it)."""
        if trace is self.trace:
            return self._now.get(key)
        slot = _MEMO.get(id(trace))
        if slot is None or slot[0] is not trace:
            return None
        return slot[1].get(key)

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
    can fire before any NaN exists (an early warning).

    ``fallback`` rules run after the others and only when none of them produced an
    error-severity diagnosis for the step (the catch-all that makes sure every anomaly gets
    a diagnosis). ``severity`` is the rule's usual severity; a diagnosis may carry another
    one when the evidence warrants it.
    """

    code: str
    title: str
    severity: Severity
    summary: str
    func: RuleFunc
    early: bool = False
    family: str = "user"
    priority: int = 50
    fallback: bool = False

    @functools.cached_property
    def builtin(self) -> bool:
        """Whether the rule ships with nanwatch (its function lives in ``nanwatch.rules``).
        Asked of every rule at every step (see :func:`evaluate`): found once."""
        return str(getattr(self.func, "__module__", "")).startswith(_BUILTIN_PREFIX)

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
    family: str | None = None,
    priority: int = 50,
    replace: bool = False,
    fallback: bool = False,
) -> Callable[[RuleFunc], RuleFunc]:
    """Register a rule. Codes are ``NW`` + 3 or 4 digits and never reused: registering a
    code twice is an error unless ``replace=True`` (for reloading your own rule).

    ``family`` defaults to the module name for rules that ship with nanwatch
    (``nanwatch.rules.overflow`` -> ``"overflow"``) and to ``"user"`` otherwise. ``early``
    says the rule can fire before any NaN exists: a rule that ships with nanwatch without it
    is skipped on a step where every recorded value is finite and nothing stopped or failed
    (a rule of yours runs on every step either way); ``priority`` orders diagnoses of
    equal severity (lower first: the most specific cause).

    Example:
        >>> @rule("NW902", title="Loss is negative", severity="warning",
        ...       summary="A negative loss: the loss function and its inputs disagree.")
        ... def negative_loss(ctx):
        ...     if ctx.trace.loss is not None and ctx.trace.loss < 0:
        ...         return ctx.diagnosis(evidence=[f"loss = {ctx.trace.loss:.4g}"])
        ...     return None
        >>> REGISTRY["NW902"].severity, REGISTRY["NW902"].early
        ('warning', False)
        >>> del REGISTRY["NW902"]
    """
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
        fam = family
        if fam is None:
            module = str(getattr(func, "__module__", ""))
            fam = module[len(_BUILTIN_PREFIX) :] if module.startswith(_BUILTIN_PREFIX) else "user"
        REGISTRY[code] = Rule(
            code=code,
            title=title,
            severity=severity,
            summary=summary,
            func=func,
            early=early,
            family=fam,
            priority=priority,
            fallback=fallback,
        )
        return func

    return decorate


def catalog() -> list[Rule]:
    """Every registered rule, by code.

    >>> [r.code for r in catalog()][:2]
    ['NW100', 'NW101']
    """
    _load_builtin()
    return sorted(REGISTRY.values(), key=lambda r: (len(r.code), r.code))


def _load_builtin() -> None:
    import nanwatch.rules  # noqa: F401  (importing the package registers the built-in families)


def sort_key(d: Diagnosis) -> tuple[int, int, str]:
    """Errors first, then warnings, then info; within a severity the lower ``priority``
    (the more specific cause) first.

    >>> ds = [Diagnosis("NW2", "w", "warning", priority=1), Diagnosis("NW1", "e", "error")]
    >>> [d.code for d in sorted(ds, key=sort_key)]
    ['NW1', 'NW2']
    """
    return (_SEVERITY_RANK.get(d.severity, 3), d.priority, d.code)


def _prune_memo(trace: StepTrace, history: Sequence[StepTrace]) -> None:
    """Drop what :meth:`RuleContext.memo` kept for steps that left the history. Only when
    it holds more entries than there are live steps: fewer can be stale too, but they are
    bounded by the history's length until then."""
    if len(_MEMO) <= len(history) + 1:
        return
    live = {id(t) for t in history}
    live.add(id(trace))
    for k in [k for k in _MEMO if k not in live]:
        del _MEMO[k]


def _healthy(trace: StepTrace) -> bool:
    """Nothing on ``trace`` a rule that needs a NaN could explain: no anomaly, no error, no
    in-place mutation, no op event, no guard stop, and every recorded value finite."""
    if trace.anomaly is not None or trace.error is not None or trace.mutations or trace.ops:
        return False
    if any(n.kind == "guard" for n in trace.notes):
        return False
    return all(r.stat is None or r.stat.finite for r in trace.records)


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
    reported once (a warning) and added to ``disabled``; it never breaks the step.

    Fallback rules run last, and only when no other rule produced an error-severity
    diagnosis. On a healthy step (every value finite, nothing stopped) only early rules and
    the user's own run: nanwatch's other rules explain a NaN or a stop, and most steps of a
    run have neither.

    Example:
        >>> from nanwatch.config import Thresholds
        >>> evaluate(StepTrace(step=0), [], Thresholds())
        []
    """
    _load_builtin()
    _prune_memo(trace, history)
    skip = set(ignore)
    dead = disabled if disabled is not None else set()
    out: list[Diagnosis] = []
    ctx = RuleContext(
        trace=trace,
        history=history,
        thresholds=thresholds,
        facts=dict(facts or {}),
        ignored=frozenset(skip),
    )
    healthy = _healthy(trace)
    rules = [
        r
        for r in REGISTRY.values()
        if r.code not in skip and not (healthy and not r.early and r.builtin)
    ]
    from nanwatch.rules._evidence import evaluating

    with evaluating(trace):  # the rules read the step's loss calls once
        for fallback in (False, True):
            if fallback and any(d.severity == "error" for d in out):
                break
            for r in rules:
                if r.fallback is not fallback or r.code in dead:
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
    # the optimizers an lr scheduler drives: a fix that lowers the lr also lowers what the
    # scheduler sets it from, or its next step() undoes it
    scheduled = [
        n
        for t in (*history[-1:], trace)
        for n in t.notes
        if n.kind == "optimizer" and "scheduler" in n.data
    ]
    for d in out:
        if d.fix and history and "lr" in d.fix:
            d.fix = _no_higher_lr(d.fix, history)
        if d.fix and scheduled:
            from nanwatch.rules._evidence import with_scheduler

            d.fix = with_scheduler(d.fix, scheduled)
        if d.fix and d.source:
            # a rewrite of one statement of a one-line compound statement goes back into
            # the user's whole line: under its ``else:`` / ``if c:``, beside its other
            # ``;`` statements (a pasted ``score = ...`` alone ran whatever the branch)
            from nanwatch.rules._evidence import on_its_line

            d.fix = on_its_line(d.source, d.fix)
        if d.cli:
            _for_cli(d)
        elif (facts or {}).get("front") == "lightning":
            d.front = "lightning"
            _for_lightning(d)
    return _birth_first(out, trace.anomaly)


#: a fix's new learning rate and the one it replaces: ``g["lr"] = 0.5   # was 5 (SGD)``
_LR_SET = re.compile(
    r"""(\[\s*["']lr["']\s*\]\s*=\s*)(\d[\d.]*(?:e[+-]?\d+)?)(\s+#\s*was\s+)"""
    r"(\d[\d.]*(?:e[+-]?\d+)?)(\s*\([^)\n]*\))?",
    re.I,
)


def _no_higher_lr(fix: str, history: Sequence[StepTrace]) -> str:
    """``fix`` with the lr it sets no higher than one an earlier diagnosis of the run
    already asked for in place of the same lr (of the same optimizer): a warning at step 1
    sized the lr from the update it measured, an error at step 14 that only divides the lr
    by 10 would give a second, higher number for the same change. The line says which
    diagnosis asked for it. Read only on a step that has a diagnosis with an lr line."""
    asked: dict[tuple[float, str], tuple[float, str, str, int]] = {}
    for t in history:
        for d in t.diagnoses:
            for m in _LR_SET.finditer(getattr(d, "fix", "") or ""):
                key = (float(m.group(4)), (m.group(5) or "").strip())
                new = float(m.group(2))
                if key not in asked or new < asked[key][0]:
                    asked[key] = (new, m.group(2), f"{d.code} {d.severity}", t.step)
    if not asked:
        return fix
    lines = fix.splitlines()
    for i, ln in enumerate(lines):
        at = _LR_SET.search(ln)
        if at is None:
            continue
        earlier = asked.get((float(at.group(4)), (at.group(5) or "").strip()))
        if earlier is None or earlier[0] >= float(at.group(2)):
            continue
        _, text, code, step = earlier
        m = at
        tail = m.group(5) or ""
        lines[i] = (
            f"{ln[: m.start(2)]}{text}{m.group(3)}{m.group(4)}{tail}; not {m.group(2)}: the "
            f"{code} of step {step} asked for {text} already, the lower of the two"
            f"{ln[m.end() :]}"
        )
    return "\n".join(lines)


#: what a script run by ``nanwatch run`` has not: a watcher ``nw`` and a ``step_fn``
_API_HINT = re.compile(
    r"mode='forensic' or nw\.replay\(step_fn\)|mode='forensic' \(or nw\.replay\(step_fn\)\)"
    r"|mode='forensic'(?= names)"
)


def cli_words(text: str) -> str:
    """``text`` for a script run by ``nanwatch run``, which has no ``nw`` to replay with:
    "mode='forensic' or nw.replay(step_fn)" becomes the command's ``--mode forensic``.

    >>> cli_words("mode='forensic' or nw.replay(step_fn) names it")
    'nanwatch run --mode forensic names it'
    >>> cli_words("; mode='forensic' names the line")
    '; nanwatch run --mode forensic names the line'
    """
    return _API_HINT.sub("nanwatch run --mode forensic", text)


#: a watcher made by hand, in a fix's code: under the Lightning callback there is none
_WATCH_CALL = re.compile(
    r"with nanwatch\.watch\([^\n]*?mode='forensic'\) as nw:[^\n]*(?:\n[ \t]+[^\n]*)*"
)


def lightning_words(text: str) -> str:
    """``text`` for a run watched by the Lightning callback, which has no ``nw`` of the
    user's to replay with nor a ``watch()`` call to change: the hints name the callback's
    own argument.

    >>> lightning_words("mode='forensic' or nw.replay(step_fn) names it")
    "NanWatchCallback(mode='forensic') names it"
    """
    text = _WATCH_CALL.sub(
        "trainer = Trainer(callbacks=[NanWatchCallback(mode='forensic')])   # every aten "
        "op checked",
        text,
    )
    return _API_HINT.sub("NanWatchCallback(mode='forensic')", text)


def _for_lightning(d: Diagnosis) -> None:
    d.explanation = lightning_words(d.explanation)
    d.fix = lightning_words(d.fix)
    d.evidence = [lightning_words(e) for e in d.evidence]


def _for_cli(d: Diagnosis) -> None:
    d.explanation = cli_words(d.explanation)
    d.fix = cli_words(d.fix)
    d.evidence = [cli_words(e) for e in d.evidence]


def _op_name(op: str) -> str:
    """``aten.exp.default`` / ``aten.exp`` -> ``exp`` (the op's packet, overload dropped)."""
    parts = op.split(".")
    return (parts[1] if len(parts) > 1 else parts[0]).rstrip("_")


def _birth_first(out: list[Diagnosis], anomaly: Anomaly | None) -> list[Diagnosis]:
    """Among diagnoses of the first severity, one that explains the op where the anomaly
    was born (the oldest op of its cause chain, which the step's headline names: it carries
    that op, or cites it in its evidence) comes first: a diagnosis that does neither (a loss
    whose value stayed finite) is second, whatever its priority. Its ``priority`` is
    lowered to say so, so that every later sort by :func:`sort_key` (the report's) keeps
    that order."""
    if anomaly is None or anomaly.op is None or len(out) < 2:
        return out
    birth = anomaly.op.chain()[0]
    name = _op_name(birth.op)
    top = out[0].severity

    cited = re.compile(rf"\baten\.{re.escape(name)}_?\b")

    def born_here(d: Diagnosis) -> bool:
        """``d`` is of the birth's op, or its evidence cites that op (a diagnosis of the
        cause upstream of it: the logits that grew until the exp overflowed)."""
        if d.severity != top:
            return False
        if d.op is not None:
            return _op_name(d.op) == name
        return any(cited.search(e) for e in d.evidence)

    if born_here(out[0]) or not any(born_here(d) for d in out):
        return out
    first = min(d.priority for d in out if d.severity == top) - 1
    for d in out:
        if born_here(d):
            d.priority = min(d.priority, first)
    out.sort(key=sort_key)
    return out
