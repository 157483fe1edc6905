"""Build step traces by hand, to test a rule without a model: rules are pure functions of
records, so a few lines of records are a complete test case.

Example:
    >>> b = TraceBuilder(step=2)
    >>> model = b.call("Net", root=True)
    >>> x = b.input(model, stat(-1.0, 1.0, numel=32), shape=(8, 4))
    >>> out = b.forward(model, stat(0.0, 70000.0, numel=16), dtype="float16", shape=(8, 2))
    >>> trace = b.build()
    >>> [d.code for d in diagnose(trace)]
    ['NW102']
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from nanwatch.records import Call, Note, OpEvent, Phase, Record, StepTrace, TensorStat
from nanwatch.rules.base import Diagnosis, evaluate

__all__ = ["TraceBuilder", "diagnose", "stat"]


def stat(
    lo: float,
    hi: float,
    *,
    numel: int = 16,
    counted: bool | None = None,
    **counts: Any,
) -> TensorStat:
    """A TensorStat from min and max. Non-finite or ``counted=True`` statistics get their
    counts (NaN, +inf, -inf, zeros, near_max: from ``counts`` or 0), as the watcher counts
    bad tensors; other keywords (``finite_amax``, ``bad_rows``, ``norm``) pass through."""
    s = TensorStat(min=lo, max=hi, numel=numel)
    bad = not (math.isfinite(lo) and math.isfinite(hi))
    if counted or (counted is None and bad):
        s.nan = int(counts.pop("nan", 1 if math.isnan(lo) or math.isnan(hi) else 0))
        s.posinf = int(counts.pop("posinf", 1 if hi == math.inf else 0))
        s.neginf = int(counts.pop("neginf", 1 if lo == -math.inf else 0))
        s.zeros = int(counts.pop("zeros", 0))
        s.near_max = int(counts.pop("near_max", 0))
    for k, v in counts.items():
        setattr(s, k, tuple(v) if k == "bad_rows" else v)
    return s


class TraceBuilder:
    """Appends calls and records to a :class:`~nanwatch.records.StepTrace` in execution
    order, the way the watcher does. ``build()`` closes the calls and, by default, runs the
    localizer so ``trace.anomaly`` is what the watcher would have found."""

    def __init__(self, step: int = 0) -> None:
        self.trace = StepTrace(step=step)
        self._open: list[Call] = []

    # -- calls --------------------------------------------------------------------
    def call(
        self,
        path: str,
        module_type: str = "",
        *,
        parent: Call | None = None,
        root: bool = False,
        is_loss: bool = False,
        passthrough: bool = False,
    ) -> Call:
        c = Call(
            id=len(self.trace.calls),
            path=path,
            module_type=module_type or path.rsplit(".", 1)[-1],
            parent=parent.id if parent is not None else None,
            start=len(self.trace.records),
            passthrough=passthrough,
            is_loss=is_loss,
            root=root,
        )
        self.trace.calls.append(c)
        self._open.append(c)
        return c

    # -- records ------------------------------------------------------------------
    def record(
        self,
        phase: Phase,
        path: str,
        s: TensorStat | None,
        *,
        role: str = "output",
        call: Call | None = None,
        dtype: str = "float32",
        shape: Sequence[int] = (16,),
        source: Record | int | None = None,
        grad_fn: str | None = None,
        version: int | None = None,
        module_type: str | None = None,
    ) -> Record:
        src = source.index if isinstance(source, Record) else source
        r = Record(
            index=len(self.trace.records),
            step=self.trace.step,
            phase=phase,
            path=path,
            role=role,
            dtype=dtype,
            device="cpu",
            shape=tuple(shape),
            stat=s,
            call=call.id if call is not None else -1,
            source=src,
            module_type=module_type
            if module_type is not None
            else (call.module_type if call else ""),
            grad_fn=grad_fn,
            version=version,
        )
        self.trace.records.append(r)
        return r

    def input(
        self, call: Call, s: TensorStat | None = None, *, role: str = "input[0]", **kw: Any
    ) -> Record:
        """An input of ``call``: measured (``s``) or linked to the record it came from
        (``source=``)."""
        return self.record(Phase.INPUT, call.path, s, role=role, call=call, **kw)

    def forward(self, call: Call, s: TensorStat | None = None, **kw: Any) -> Record:
        """An output of ``call`` (``role="output"``)."""
        kw.setdefault("version", 0)
        return self.record(Phase.FORWARD, call.path, s, call=call, **kw)

    def backward(self, fwd: Record, s: TensorStat, **kw: Any) -> Record:
        """The gradient of ``fwd``'s tensor."""
        call = self.trace.call(fwd.call)
        kw.setdefault("dtype", fwd.dtype)
        kw.setdefault("shape", fwd.shape)
        return self.record(Phase.BACKWARD, fwd.path, s, role=fwd.role, call=call, source=fwd, **kw)

    def gradient(
        self, path: str, parameter: str, norm: float, *, s: TensorStat | None = None, **kw: Any
    ) -> Record:
        """A parameter's gradient: min/max are -norm/+norm, as the watcher records them."""
        st = s if s is not None else TensorStat(-norm, norm, kw.pop("numel", 16), norm=norm)
        if s is not None and st.norm is None:
            st.norm = norm
        return self.record(Phase.GRADIENT, path, st, role=parameter, **kw)

    def parameter(self, path: str, parameter: str, s: TensorStat, **kw: Any) -> Record:
        """A weight's value (bad weights are recorded ahead of the step's forward)."""
        return self.record(Phase.PARAMETER, path, s, role=parameter, **kw)

    def note(self, kind: str, path: str, *, source: str | None = None, **data: Any) -> Note:
        n = Note(kind=kind, path=path, data=data, source=source)
        self.trace.notes.append(n)
        return n

    def op(self, event: OpEvent) -> OpEvent:
        self.trace.ops.append(event)
        return event

    # -- result -------------------------------------------------------------------
    def build(self, *, localize: bool = True, **fields: Any) -> StepTrace:
        """Close the calls; localize the first anomaly unless ``localize=False``; set other
        StepTrace fields (``loss=``, ``grad_norm=``, ``scale=``, ``error=``, ...)."""
        end = len(self.trace.records)
        for c in self._open:
            if c.end < 0:
                c.end = end
        self._open = []
        for k, v in fields.items():
            setattr(self.trace, k, v)
        if localize and self.trace.anomaly is None:
            from nanwatch.localize import localize as run_localize

            self.trace.anomaly = run_localize(self.trace)
        return self.trace


def diagnose(
    trace: StepTrace,
    history: Iterable[StepTrace] = (),
    *,
    facts: dict[str, Any] | None = None,
    ignore: Iterable[str] = (),
    **thresholds: Any,
) -> list[Diagnosis]:
    """Run every registered rule on ``trace`` as the watcher does (most important first).
    ``thresholds`` are :class:`nanwatch.Thresholds` fields."""
    from nanwatch.config import Thresholds

    return evaluate(
        trace,
        list(history),
        Thresholds(**thresholds),
        ignore=ignore,
        facts={"mode": "watch", **(facts or {})},
    )
