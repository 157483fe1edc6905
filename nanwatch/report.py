"""Report: what a person reads after the run, as plain data.

A :class:`Report` holds the flight recorder's steps (records, calls, op events, notes),
the anomalies, the diagnoses, the exception that ended the run (classified), the faults
nanwatch caught in itself, and the environment. It is built from host-side data only --
records are plain Python numbers -- so it can be built after the GPU context died. It
saves as versioned JSON (``schema_version``) that loads and renders on a machine without
the model, and as a self-contained HTML page; presentation lives in :mod:`nanwatch.render`.

Example:
    >>> import torch, nanwatch
    >>> model = torch.nn.Linear(4, 2)
    >>> with nanwatch.watch(model) as nw:
    ...     _ = model(torch.randn(3, 4))
    >>> report = nw.report
    >>> report.headline
    'No anomaly in 1 recorded step (step 0): every value nanwatch measured was finite'
    >>> Report.from_dict(report.to_dict()).headline == report.headline
    True
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import traceback
import weakref
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanwatch.errors import ReportFormatError
from nanwatch.localize import leaf_text, op_phrase
from nanwatch.records import (
    LOSS_PATH,
    Anomaly,
    AnomalyKind,
    Call,
    OpEvent,
    Phase,
    Record,
    StepTrace,
)
from nanwatch.rules.base import SEVERITIES, Diagnosis, sort_key

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderResult

    from nanwatch.watcher import Watcher

__all__ = ["SCHEMA_VERSION", "Environment", "Event", "Report"]

#: The JSON format's version. The loader reads any ``1.x`` (unknown fields are ignored) and
#: rejects another major version.
SCHEMA_VERSION = "1.0"
_MAJOR = SCHEMA_VERSION.split(".", maxsplit=1)[0]

#: anomalies kept in a report (the first ones matter; the count says how many there were)
_MAX_ANOMALIES = 50
#: traceback lines kept (head and tail of a very deep one)
_MAX_TRACEBACK_LINES = 400

#: plain words for the classes of :func:`nanwatch.postmortem.classify`
ERROR_LABELS: dict[str, str] = {
    "cuda-device-assert": "CUDA device-side assert",
    "cuda-error": "CUDA error",
    "out-of-memory": "out of memory",
    "peer-failure": "a peer rank failed first",
    "autograd-inplace": "autograd in-place error",
    "graph-freed": "backward through a freed graph",
    "no-graph": "backward on a tensor with no graph",
    "non-scalar-backward": "backward on a loss of many values",
    "packing-length": "a sequence of length 0 in packing",
    "ctc-input-lengths": "CTC input_lengths longer than the log-probabilities",
    "shorter-than-window": "an input shorter than one window",
    "norm-one-value": "a norm given one value per channel in training",
    "python-overflow": "Python float overflow",
    "empty-reduction": "min or max of an empty tensor",
    "view-layout": "view() of a non-contiguous tensor",
    "scalar-overflow": "a number too large for the tensor's dtype",
    "anomaly": "nanwatch anomaly",
    "guard": "nanwatch guard",
    "index-out-of-range": "index out of range",
    "shape-mismatch": "shape mismatch",
    "device-mismatch": "device mismatch",
    "dtype-error": "dtype error",
    "fp16-unscale": "GradScaler on float16 weights",
    "negative-variance": "a negative variance given to GaussianNLLLoss",
    "distribution-constraint": "distribution argument out of its support",
    "non-finite": "a check refused NaN/inf",
    "linalg": "linear algebra error",
    "keyboard-interrupt": "interrupted (Ctrl-C)",
    "signal": "terminated by a signal",
    "exit": "sys.exit",
    "user-raised": "raised by your code",
    "other": "exception",
}


@dataclass(slots=True)
class Environment:
    """Where the report was made: versions, devices and dtypes seen, mode and rank.

    ``amp_dtypes`` are the low-precision floating dtypes (float16, bfloat16, float8) seen in
    the records -- what autocast or ``.half()`` produced. ``dtype_limits`` maps each
    floating dtype seen to its largest finite value (``torch.finfo(dtype).max``), so a saved
    report can mark the limits without torch.

    Example:
        >>> env = Environment(torch="2.3.0", dtypes=["float16"], amp_dtypes=["float16"])
        >>> Environment.from_dict(env.to_dict()).amp_dtypes
        ['float16']
    """

    nanwatch: str = ""
    torch: str = ""
    cuda: str | None = None  #: CUDA version torch was built with (None: CPU build)
    python: str = ""
    platform: str = ""
    mode: str = ""
    devices: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    amp_dtypes: list[str] = field(default_factory=list)
    dtype_limits: dict[str, float] = field(default_factory=dict)
    modules: int = 0  #: modules watched
    scaler: bool = False  #: a GradScaler was given to the watcher
    rank: int | None = None  #: torch.distributed rank (or $RANK), None when not distributed
    world_size: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "nanwatch": self.nanwatch,
            "torch": self.torch,
            "cuda": self.cuda,
            "python": self.python,
            "platform": self.platform,
            "mode": self.mode,
            "devices": list(self.devices),
            "dtypes": list(self.dtypes),
            "amp_dtypes": list(self.amp_dtypes),
            "dtype_limits": dict(self.dtype_limits),
            "modules": self.modules,
            "scaler": self.scaler,
            "rank": self.rank,
            "world_size": self.world_size,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Environment:
        return cls(
            nanwatch=str(d.get("nanwatch", "")),
            torch=str(d.get("torch", "")),
            cuda=d.get("cuda"),
            python=str(d.get("python", "")),
            platform=str(d.get("platform", "")),
            mode=str(d.get("mode", "")),
            devices=list(d.get("devices", [])),
            dtypes=list(d.get("dtypes", [])),
            amp_dtypes=list(d.get("amp_dtypes", [])),
            dtype_limits={k: float(v) for k, v in d.get("dtype_limits", {}).items()},
            modules=int(d.get("modules", 0)),
            scaler=bool(d.get("scaler", False)),
            rank=d.get("rank"),
            world_size=d.get("world_size"),
        )


@dataclass(slots=True, eq=False)
class Event:
    """One thing that ran in a step, in execution order: the forward of a module call
    (``phase="forward"``), the backward through it (``"backward"``), or the check of the
    parameter gradients (``"gradient"``). ``running`` marks a call that had not returned
    when the exception was raised."""

    phase: str
    path: str
    module_type: str
    inputs: list[Record] = field(default_factory=list)
    outputs: list[Record] = field(default_factory=list)
    running: bool = False
    depth: int = 0


@dataclass(eq=False)
class Report:
    """The report of a watched run: plain data, saved as JSON or HTML, rendered by rich.

    Build it with :meth:`from_watcher` (``nw.report`` does), load a saved one with
    :meth:`load`. ``print(report)`` and ``rich.print(report)`` render it for the terminal;
    in a notebook cell it displays itself as HTML.

    Example:
        >>> report = Report(steps=[])
        >>> report.status
        'ok'
        >>> sorted(report.to_dict())[:3]
        ['anomalies', 'anomaly_count', 'config']
    """

    #: the flight recorder's steps, oldest first (the last may be ``partial``)
    steps: list[StepTrace]
    #: non-finite anomalies of the run, first first (at most 50; see ``anomaly_count``)
    anomalies: list[Anomaly] = field(default_factory=list)
    anomaly_count: int = 0
    #: distinct findings (the first occurrence of each code at each place, see
    #: :func:`finding_key`), most important first
    diagnoses: list[Diagnosis] = field(default_factory=list)
    #: code -> how many recorded steps it fired in (per finding: :meth:`steps_of`)
    diagnosis_steps: dict[str, int] = field(default_factory=dict)
    environment: Environment = field(default_factory=Environment)
    #: the exception or signal that ended the run: ``class``, ``type``, ``message``,
    #: ``device_lost``, ``advice``, ``step``, ``traceback`` (lines), ``cause``
    error: dict[str, Any] | None = None
    #: internal errors nanwatch caught in its own hooks: (where, message)
    faults: list[tuple[str, str]] = field(default_factory=list)
    #: the watcher's configuration (mode, on_anomaly, ring_size, ...)
    config: dict[str, Any] = field(default_factory=dict)
    created: str = ""  #: ISO 8601, UTC
    #: the step still being recorded when the report was made (not flushed), if included
    partial_step: int | None = None
    schema_version: str = SCHEMA_VERSION

    # ------------------------------------------------------------------ building
    @classmethod
    def from_watcher(
        cls, watcher: Watcher, exc: BaseException | None = None, *, reason: str | None = None
    ) -> Report:
        """The report of everything ``watcher`` recorded; ``exc`` is the exception that ended
        the run (its traceback is kept), ``reason`` a signal name (``"SIGTERM"``).

        Reads host-side data only: records, calls, the exception object. No tensor is
        touched, so it works after a CUDA error killed the context.

        Example:
            >>> with nanwatch.watch(torch.nn.Linear(2, 2)) as nw:   # doctest: +SKIP
            ...     ...
            >>> Report.from_watcher(nw).save("run.html")            # doctest: +SKIP
        """
        steps = list(watcher.history)
        partial: int | None = None
        current = watcher.trace
        if (current.records or current.calls) and all(t is not current for t in steps):
            steps.append(_snapshot(current, _pending_records(watcher)))
            partial = current.step
        anomalies = list(watcher.anomalies)
        first_step = anomalies[0].step if anomalies else None
        first_bad = watcher.first_bad_step
        if (
            first_bad is not None
            and first_bad.step == first_step
            and all(t.step != first_step for t in steps)
        ):  # the ring moved past the first anomaly: its step leads the report
            steps.insert(0, first_bad)
        error: dict[str, Any] | None = None
        scaler = getattr(watcher, "scaler", None) is not None
        if exc is not None:
            names = {id(prm): q for q, _, prm in getattr(watcher, "_params", ())}
            error = _error_info(
                exc, steps, watcher.step_index, names, scaler=scaler, mode=watcher.config.mode
            )
        elif reason is not None:
            from nanwatch.postmortem import classify_signal

            error = classify_signal(reason)
            error["step"] = steps[-1].step if steps else watcher.step_index
        else:
            for t in reversed(steps):
                if t.error is not None:
                    from nanwatch.postmortem import step_advice

                    error = {**t.error, "step": t.step}
                    step_advice(error, t, scaler=scaler)
                    _name_the_op(error, t, watcher.config.mode)
                    break
        if error is not None and reason is None:
            # the exception's own report and ``nw.report`` read after it: the same lead
            born = _before_raise(watcher, steps, error, scaled=scaler)
            if born is not None:  # the partial step's NaN, which no record held
                anomalies.append(born)
                if first_step is None:
                    first_step = born.step
        diagnoses, counts = _gather_diagnoses(steps, first_step)
        cfg = watcher.config
        return cls(
            steps=steps,
            anomalies=anomalies[:_MAX_ANOMALIES],
            anomaly_count=len(anomalies),
            diagnoses=diagnoses,
            diagnosis_steps=counts,
            environment=_environment(watcher, steps),
            error=error,
            faults=list(watcher.faults),
            config={
                "mode": cfg.mode,
                "on_anomaly": cfg.on_anomaly,
                "sample_every": cfg.sample_every,
                "ring_size": cfg.ring_size,
                "report_dir": cfg.report_dir,
                "allow": list(cfg.allow),
                "ignore": list(cfg.ignore),
                "guards": cfg.guards,
                "pinpoint": cfg.pinpoint,
            },
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            partial_step=partial,
        )

    # ------------------------------------------------------------------ queries
    @property
    def first_anomaly(self) -> Anomaly | None:
        return self.anomalies[0] if self.anomalies else None

    @property
    def rank(self) -> int | None:
        return self.environment.rank

    @property
    def status(self) -> str:
        """``"error"`` (the run raised or an error-severity diagnosis fired), ``"anomaly"``
        (a non-finite value), ``"warning"``, or ``"ok"``."""
        if self.error is not None or any(d.severity == "error" for d in self.diagnoses):
            return "error"
        if self.anomalies:
            return "anomaly"
        if any(d.severity == "warning" for d in self.diagnoses):
            return "warning"
        return "ok"

    @property
    def top(self) -> Diagnosis | None:
        """The most important diagnosis."""
        return self.diagnoses[0] if self.diagnoses else None

    def steps_of(self, d: Diagnosis) -> int:
        """How many of the recorded steps found ``d`` (the same code at the same place, see
        :func:`finding_key`, or a catch-all finding there that ``d`` explains); for a report
        built without its steps, how many fired its code.

        >>> Report(steps=[], diagnosis_steps={"NW110": 2}).steps_of(
        ...     Diagnosis("NW110", "t", "error", path="head"))
        2
        """
        mine = d.to_dict()
        own = next(
            (
                t
                for t in self.steps
                if t.step == d.step and any(x is d or x.to_dict() == mine for x in t.diagnoses)
            ),
            None,
        )
        key = finding_key(d, own)
        n = sum(
            1
            for t in self.steps
            if any(same_finding(finding_key(x, t), key) or _absorbs(d, x) for x in t.diagnoses)
        )
        return n if n > 0 else self.diagnosis_steps.get(d.code, 1)

    @property
    def step_range(self) -> tuple[int, int] | None:
        if not self.steps:
            return None
        return self.steps[0].step, self.steps[-1].step

    def step(self, number: int) -> StepTrace | None:
        """The recorded step with this number, if still in the flight recorder."""
        for t in self.steps:
            if t.step == number:
                return t
        return None

    @property
    def headline(self) -> str:
        """What went wrong, where, at which step, in one line.

        Example:
            >>> Report(steps=[]).headline
            'No step was recorded'
        """
        a = self.first_anomaly
        err = self.error
        if err is not None and err.get("class") != "anomaly":
            label = ERROR_LABELS.get(str(err.get("class")), "exception")
            short = str(err.get("type", "")).rsplit(".", 1)[-1]
            msg = _first_line(str(err.get("message", "")))
            where = self._error_where()
            head = f"{short} ({label})" if short and short != label else label
            text = f"{head}{where}{error_when(err)}"
            return f"{text}: {msg}" if msg else text
        if a is not None:
            return anomaly_headline(a)
        top = self.top
        if top is not None:
            return top.headline
        r = self.step_range
        if r is None:
            return "No step was recorded"
        n = len(self.steps)
        span = f"step {r[0]}" if r[0] == r[1] else f"steps {r[0]}-{r[1]}"
        plural = "s" if n != 1 else ""
        return (
            f"No anomaly in {n} recorded step{plural} ({span}): "
            "every value nanwatch measured was finite"
        )

    def _error_where(self) -> str:
        if self.error is not None and (self.error.get("during") or self.error.get("fetching")):
            return ""  # nothing watched ran: error_when says what did
        events = self.recent_events(limit=64)
        running = [e for e in events if e.running]
        if self.error is not None and self.error.get("class") == "autograd-inplace":
            found = self.culprit()
            state = next((m for m in found[0].mutations if m.get("name")), None) if found else None
            if state is not None:  # a buffer or parameter of the module, not its output
                return f" in backward: {state['name']}, saved by autograd, was modified in place"
            if found is not None:
                return f" in backward: the saved output of {found[1].path} was modified in place"
        if running:
            e = running[-1]
            return f" in {e.path}" + (f" ({e.module_type})" if e.module_type != e.path else "")
        opt = self.error.get("optimizer") if self.error is not None else None
        call = ""
        if isinstance(opt, dict) and opt.get("class"):  # the traceback goes through it
            call = f"{opt['class']}.{opt.get('method', 'step')}()"
            if not opt.get("in_closure"):  # raised by the optimizer's own code
                return f" inside {call}"
        if self.error is not None and self.error.get("in_backward"):
            return " during backward"  # autograd's engine raised it
        if events and events[-1].phase == "gradient":  # backward had ended
            if call:  # the optimizer's closure raised after its backward
                return f" in the closure of {call}"
            t = self.error_step()
            if t is not None and any(n.kind == "optimizer" for n in t.notes):
                return " after the optimizer step"
            return " after the backward pass"
        if events and events[-1].phase != "forward":
            return " during backward"
        if events:
            return f" after the forward of {events[-1].path}"
        return ""

    def error_step(self) -> StepTrace | None:
        """The step the exception ended (the last recorded one)."""
        if self.error is None or not self.steps:
            return None
        number = self.error.get("step")
        found = self.step(number) if isinstance(number, int) else None
        return found if found is not None else self.steps[-1]

    def culprit(self) -> tuple[StepTrace, Call] | None:
        """The step and the module call where the first anomaly was born; after a crash
        without one: the module whose saved output was modified in place, else the innermost
        call running when the exception was raised, else the module the top diagnosis of
        that step names."""
        a = self.first_anomaly
        if a is not None:
            trace = self.step(a.step)
            if trace is None:
                return None
            call = _call_of(trace, a)
            return (trace, call) if call is not None else None
        trace = self.error_step()
        if trace is None:
            return None
        for m in trace.mutations:
            rec = trace.record(int(m.get("index", -1)))
            if rec is not None:
                c = trace.call(rec.call)
                if c is not None:
                    return trace, c
        running = [c for c in trace.calls if c.end < 0]
        if running:
            return trace, running[-1]
        top = next((d for d in self.diagnoses if d.step == trace.step and d.path), None)
        if top is not None:  # the rules named the module (an in-place op found in backward)
            c = next((c for c in trace.calls if c.path == top.path), None)
            if c is not None:
                return trace, c
        return None

    def recent_events(self, trace: StepTrace | None = None, *, limit: int = 10) -> list[Event]:
        """The last things that ran in ``trace`` (default: the step the exception ended, else
        the last step), in execution order; calls still running come last, innermost last.

        After a CUDA error these are the candidates: kernels run asynchronously, so the
        failing one was launched by one of the last modules, not necessarily the line the
        traceback shows.

        Example:
            >>> [e.path for e in Report.load("crash.json").recent_events()]  # doctest: +SKIP
            ['encoder.2', 'encoder', 'head', 'Classifier', 'CrossEntropyLoss']
        """
        if trace is None:
            trace = self.error_step() or (self.steps[-1] if self.steps else None)
        if trace is None:
            return []
        return _events(trace)[-limit:] if limit > 0 else []

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "created": self.created,
            "environment": self.environment.to_dict(),
            "config": dict(self.config),
            "error": self.error,
            "anomalies": [a.to_dict() for a in self.anomalies],
            "anomaly_count": self.anomaly_count,
            "diagnoses": [d.to_dict() for d in self.diagnoses],
            "diagnosis_steps": dict(self.diagnosis_steps),
            "faults": [list(f) for f in self.faults],
            "partial_step": self.partial_step,
            "steps": [t.to_dict() for t in self.steps],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Report:
        """The report a :meth:`to_dict` produced (a ``1.x`` schema)."""
        _check_version(d, "the report")
        return cls(
            steps=[StepTrace.from_dict(t) for t in d.get("steps", [])],
            anomalies=[Anomaly.from_dict(a) for a in d.get("anomalies", [])],
            anomaly_count=int(d.get("anomaly_count", len(d.get("anomalies", [])))),
            diagnoses=[Diagnosis.from_dict(x) for x in d.get("diagnoses", [])],
            diagnosis_steps={k: int(v) for k, v in d.get("diagnosis_steps", {}).items()},
            environment=Environment.from_dict(d.get("environment", {})),
            error=d.get("error"),
            faults=[(str(w), str(m)) for w, m in d.get("faults", [])],
            config=dict(d.get("config", {})),
            created=str(d.get("created", "")),
            partial_step=d.get("partial_step"),
            schema_version=str(d["schema_version"]),
        )

    def to_json(self, *, indent: int | None = None) -> str:
        """The report as JSON text; NaN and inf travel as the strings ``"NaN"``,
        ``"Infinity"``, ``"-Infinity"``, so the file is strict JSON."""
        seps = (",", ":") if indent is None else (",", ": ")
        return json.dumps(
            _jsonable(self.to_dict()), indent=indent, separators=seps, allow_nan=False
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Report:
        """Read a report saved as JSON.

        Raises :class:`nanwatch.ReportFormatError` when the file cannot be read, is not a
        nanwatch report, is damaged, or has a schema major version this nanwatch does not read.

        Example:
            >>> Report.load("nanwatch-reports/run.json")            # doctest: +SKIP
        """
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise ReportFormatError(
                f"cannot read report {p}: {exc.strerror or exc}. Check the path "
                "(post-mortem reports are in ./nanwatch-reports/ by default)."
            ) from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ReportFormatError(
                f"{p} is not a nanwatch report: not valid JSON ({exc.msg} at line {exc.lineno}). "
                "Pass the .json file nanwatch wrote (not the .html)."
            ) from exc
        if not isinstance(data, dict):
            raise ReportFormatError(
                f"{p} is not a nanwatch report: the JSON holds a {type(data).__name__}, "
                "not an object with a schema_version."
            )
        _check_version(data, str(p))
        try:
            return cls.from_dict(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise ReportFormatError(
                f"{p} is a damaged nanwatch report ({type(exc).__name__}: {exc}); "
                "it cannot be rendered. Write it again from the run, or report the bug."
            ) from exc

    # ------------------------------------------------------------------ files
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the report to ``path``: JSON for ``.json``, a self-contained page for
        ``.html``/``.htm``. The write is atomic (a temporary file in the same directory,
        then a rename): a reader never sees half a file. Returns the path.

        Example:
            >>> nw.report.save("run.html")                            # doctest: +SKIP
            PosixPath('run.html')
        """
        from nanwatch.postmortem import atomic_write

        p = Path(path)
        suffix = p.suffix.lower()
        if suffix == ".json":
            return atomic_write(p, self.to_json())
        if suffix in (".html", ".htm"):
            return atomic_write(p, self.to_html())
        raise ReportFormatError(
            f"cannot save a report as {p.name!r}: the suffix {p.suffix or '(none)'!r} is not "
            "a format nanwatch writes. Use a .json (to re-render later) or .html (to read in "
            "a browser) path."
        )

    def save_all(self, directory: str | os.PathLike[str], stem: str) -> tuple[Path, Path]:
        """Write ``<directory>/<stem>.json`` and ``<directory>/<stem>.html`` (JSON first: it
        is what matters when time runs out); returns both paths.

        Example:
            >>> nw.report.save_all("reports", stem="run-3")          # doctest: +SKIP
            (PosixPath('reports/run-3.json'), PosixPath('reports/run-3.html'))
        """
        d = Path(directory)
        return self.save(d / f"{stem}.json"), self.save(d / f"{stem}.html")

    # ------------------------------------------------------------------ display
    def to_html(self, *, standalone: bool = True) -> str:
        """The report as HTML: a full page, or (``standalone=False``) a fragment with its
        own scoped style, as a notebook cell shows it."""
        from nanwatch.render import report_html

        return report_html(self, standalone=standalone)

    def _repr_html_(self) -> str:
        return self.to_html(standalone=False)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        from nanwatch.render import render_report

        yield from render_report(self, console, options)

    def __str__(self) -> str:
        from nanwatch.render import render_text

        return render_text(self)

    def __repr__(self) -> str:
        r = self.step_range
        steps = "no steps" if r is None else f"steps {r[0]}-{r[1]}"
        return f"<nanwatch.Report {self.status}: {steps}, {len(self.diagnoses)} diagnoses>"


# ---------------------------------------------------------------------- helpers
def anomaly_headline(a: Anomaly) -> str:
    """One line for an anomaly: what, where (module, op, source line), at which step.

    Example:
        >>> anomaly_headline(nw.first_anomaly)                     # doctest: +SKIP
        'NaN born in the forward of norm by aten.div.Tensor at train.py:32, step 2'
    """
    stat = a.record.stat
    kinds = stat.kinds() if stat is not None and not stat.finite else "non-finite value"
    then = ""
    # the op that made the first non-finite value: a log's -inf, not the neg after it
    op = a.op.chain()[0] if a.op is not None else None
    if op is not None and _unlike(op.born, kinds):  # log made -inf, the loss is +inf
        kinds, then = op.born, f" (then {kinds})"
    k = a.kind
    leaf = leaf_text(a.op)
    if leaf is not None:  # no op made it: a leaf the loss read held it (see the summary)
        return f"{kinds} {leaf}{then}, step {a.step}"
    if k is AnomalyKind.INPUT and a.origin == "between-calls":
        text = (
            f"{kinds} in {a.record.role} of {a.path}, computed by your code between two calls "
            f"of {a.path}"
        )
    elif k is AnomalyKind.INPUT and a.origin == "computed-target":
        text = (
            f"{kinds} in the target of {a.path} ({a.record.role}), computed by your code "
            "this step (a teacher or target network)"
        )
    elif k is AnomalyKind.INPUT and a.origin == "data-or-code":
        text = (
            f"{kinds} in the input data ({a.record.role} of {a.path}): the batch, or your "
            "code before the call"
        )
    elif k is AnomalyKind.INPUT:
        text = f"{kinds} in the input data ({a.record.role} of {a.path})"
    elif k is AnomalyKind.FORWARD and a.origin == "between-roots":
        text = f"{kinds} born in code outside the watched modules, in the input of {a.path}"
    elif k is AnomalyKind.FORWARD:
        text = f"{kinds} born in the forward of {a.path}"
    elif k is AnomalyKind.BACKWARD and a.origin in ("after-output", "between-roots"):
        text = f"{kinds} gradient born in the backward of code outside the watched modules"
    elif k is AnomalyKind.BACKWARD:
        text = f"{kinds} gradient born in the backward of {a.path}"
    elif k is AnomalyKind.GRADIENT:
        text = f"{kinds} in the gradient of {a.parameter or a.record.role}"
    else:
        when = "after an update"
        if "before any update" in a.summary:
            when = "before any update"
        elif "not by an optimizer step" in a.summary:  # written between two forwards
            when = "written in place between forwards"
        text = f"{kinds} in the weights {a.parameter or a.record.role} {when}"
    if op is not None:
        text += f" by {op_phrase(op)}"
    return f"{text}{then}, step {a.step}"


def _unlike(born: str, kinds: str) -> bool:
    """The op made values of other kinds than the record holds (``-inf`` against the loss's
    ``+inf`` after a minus sign; only ``+inf`` where a later product with negative values
    made the record ``+inf, -inf``): the headline names what the op made."""
    return (
        bool(born)
        and kinds != "non-finite value"
        and set(born.split(", ")) != set(kinds.split(", "))
    )


def _first_line(msg: str, limit: int = 160) -> str:
    line = next((ln.strip() for ln in msg.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _call_of(trace: StepTrace, a: Anomaly) -> Call | None:
    call = trace.call(a.record.call) if a.record.call >= 0 else None
    seen = 0
    c = call
    while c is not None and c.path != a.path and seen < 256:
        c = trace.call(c.parent) if c.parent is not None else None
        seen += 1
    if c is not None:
        return c
    return next((x for x in trace.calls if x.path == a.path), call)


def _snapshot(trace: StepTrace, pending: set[int]) -> StepTrace:
    """A copy of the step being recorded (its lists keep growing). Records whose statistics
    are still on the device (placeholders until the flush) lose them: they are unknown."""
    records = [replace(r, stat=None) if id(r) in pending else r for r in trace.records]
    return replace(
        trace,
        records=records,
        calls=list(trace.calls),
        ops=list(trace.ops),
        notes=list(trace.notes),
        diagnoses=list(trace.diagnoses),
        mutations=list(trace.mutations),
    )


def _pending_records(watcher: Watcher) -> set[int]:
    out: set[int] = set()
    for name in ("_pending", "_pending_grads"):
        for item in getattr(watcher, name, ()):
            out.add(id(item[0]))  # the record only; the tensors stay untouched
    return out


def _gather_diagnoses(
    steps: Sequence[StepTrace], first_step: int | None
) -> tuple[list[Diagnosis], dict[str, int]]:
    """The distinct findings of ``steps`` (the first occurrence of each, the first bad
    step's first) and, by code, how many steps each code fired in. A code found in two
    places (two modules, two ops, two parameters, or one module fed by two different
    origins of the bad value) is two findings: each is kept. A later occurrence that is
    more severe (a note, then a warning) replaces the first."""
    ordered = sorted(steps, key=lambda t: t.step != first_step)  # stable
    seen: dict[tuple[str | None, ...], Diagnosis] = {}
    counts: Counter[str] = Counter()
    for t in ordered:
        codes: set[str] = set()
        for d in t.diagnoses:
            key = finding_key(d, t)
            kept = next((k for k in seen if same_finding(key, k)), None)
            if kept is None:
                seen[key] = d
            elif SEVERITIES.index(d.severity) < SEVERITIES.index(seen[kept].severity):
                seen[kept] = d  # a finding that grew more severe (a note, then a warning)
            codes.add(d.code)
        counts.update(codes)
    return sorted(_explained(seen.values()), key=sort_key), dict(counts)


def same_finding(a: tuple[str | None, ...], b: tuple[str | None, ...]) -> bool:
    """Two :func:`finding_key` keys are one finding: equal, where an op that was not traced
    (None: a later step's, in a mode that pinpoints an op once) matches any op.

    >>> same_finding(("NW111", "forward", "m", "aten.div.Tensor", None, None),
    ...              ("NW111", "forward", "m", None, None, None))
    True
    >>> same_finding(("NW111", "forward", "m", "aten.div.Tensor", None, None),
    ...              ("NW111", "forward", "m", "aten.log.default", None, None))
    False
    """
    _op = 3
    return len(a) == len(b) and all(
        x == y or (i == _op and (x is None or y is None))
        for i, (x, y) in enumerate(zip(a, b, strict=True))
    )


def _explained(found: Iterable[Diagnosis]) -> list[Diagnosis]:
    """``found`` less the catch-all findings (a fallback rule's: "no specific rule matches")
    at a place (module, phase) a specific error diagnosis explains: the same anomaly seen
    again in a step where its evidence (the op) was not traced."""
    found = list(found)
    return [d for d in found if not any(_absorbs(x, d) for x in found)]


def _catch_all(d: Diagnosis) -> bool:
    from nanwatch.rules.base import REGISTRY

    r = REGISTRY.get(d.code)
    return r is not None and r.fallback


def _absorbs(d: Diagnosis, other: Diagnosis) -> bool:
    """``other`` is a catch-all finding at the place (module, phase) that ``d``, a specific
    error diagnosis, explains: the same anomaly, seen without its evidence."""
    return (
        d.severity == "error"
        and not _catch_all(d)
        and _catch_all(other)
        and (d.path, d.phase) == (other.path, other.phase)
    )


def finding_key(d: Diagnosis, trace: StepTrace | None = None) -> tuple[str | None, ...]:
    """What makes two diagnoses one finding: the same code at the same place (phase, module,
    op, parameter) and, for a diagnosis at the module where its step's anomaly was seen,
    the same origin of the bad value (the module where a -inf it grew out of was first
    seen): a NaN in ``head`` from a log(0) in ``a`` one step and in ``b`` the next is two
    problems. Numbers (evidence) and the step do not count: a problem that recurs is one.

    >>> a = Diagnosis("NW110", "t", "error", step=0, path="head")
    >>> finding_key(a) == finding_key(Diagnosis("NW110", "t", "error", step=3, path="head"))
    True
    >>> finding_key(a) == finding_key(Diagnosis("NW110", "t", "error", step=0, path="tail"))
    False
    """
    origin: str | None = None
    a = trace.anomaly if trace is not None else None
    if a is not None and d.path is not None and d.path == a.path:
        origin = a.neginf_source.path if a.neginf_source is not None else a.path
    return (d.code, d.phase, d.path, d.op, d.parameter, origin)


def _error_info(
    exc: BaseException,
    steps: Sequence[StepTrace],
    current: int,
    names: Mapping[int, str] | None = None,
    *,
    scaler: bool = False,
    mode: str = "",
) -> dict[str, Any]:
    from nanwatch.postmortem import classify, step_advice

    info = classify(exc, names)
    step = current
    raised: StepTrace | None = None
    for t in reversed(steps):
        if t.error is not None:
            step, raised = t.step, t
            break
    else:
        if steps:
            step, raised = steps[-1].step, steps[-1]
    info["step"] = step
    if _raised_fetching(exc):  # between two steps: the next batch's fetch, not the step
        ran = raised is not None and raised.step == step and bool(raised.calls or raised.records)
        updated = ran and raised is not None and any(n.kind == "optimizer" for n in raised.notes)
        info["fetching"] = "after-update" if updated else "after-step" if ran else "before-step"
    kept = raised.error if raised is not None else None
    if kept and kept.get("during"):
        info["during"] = kept["during"]
    if kept and kept.get("class") == info["class"] and kept.get("advice"):
        # the watcher's own advice, sharpened with what it saw (the layer a shape error
        # was raised in, its size against its input's)
        info["advice"] = kept["advice"]
    step_advice(info, raised, scaler=scaler)
    _name_the_op(info, raised, mode)
    lines = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).splitlines()
    if len(lines) > _MAX_TRACEBACK_LINES:
        half = _MAX_TRACEBACK_LINES // 2
        cut = len(lines) - 2 * half
        lines = [*lines[:half], f"... {cut} lines left out ...", *lines[-half:]]
    info["traceback"] = lines
    from nanwatch._frames import user_line_from_traceback

    info["source"], info["code"] = user_line_from_traceback("\n".join(lines) + "\n")
    if info.get("class") == "linalg" and "optimizer" not in info:
        from nanwatch.postmortem import linalg_advice

        info["advice"] = linalg_advice(str(info.get("message", "")), info.get("code"))
    cause = exc.__cause__
    info["cause"] = None if cause is None else f"{type(cause).__name__}: {_first_line(str(cause))}"
    return info


def _name_the_op(info: dict[str, Any], trace: StepTrace | None, mode: str) -> None:
    """A check that refused NaN or inf (``torch.multinomial``) when every value nanwatch
    watched in ``trace`` was finite and no op was traced: the value was made by code
    between the model and the check, and the advice's first sentence (the one the stderr
    summary prints) says how to name its op and line (``mode='forensic'``,
    ``nw.replay``). Not in forensic mode, which traced every op."""
    advice = str(info.get("advice") or "")
    if info.get("class") != "non-finite" or trace is None or mode == "forensic" or not advice:
        return
    if trace.anomaly is not None or trace.ops or not trace.records or "forensic" in advice:
        return
    if not all(r.stat is None or r.stat.finite for r in trace.records):
        return
    from types import SimpleNamespace

    from nanwatch.rules._evidence import untraced_hint

    hint = untraced_hint(SimpleNamespace(facts={"mode": mode}, trace=trace))
    end = advice.find(". ")
    head, rest = (advice.rstrip("."), "") if end < 0 else (advice[:end], advice[end + 1 :])
    info["advice"] = f"{head}; {hint}.{rest}"


def _raised_fetching(exc: BaseException) -> bool:
    """Whether ``exc`` went through a DataLoader iterator's ``__next__`` (a Dataset's
    ``__getitem__``, a collate_fn, a worker's re-raised error): raised while the loop fetched
    its next batch. The traceback's frames only."""
    data_dir = os.path.join("torch", "utils", "data") + os.sep
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "__next__" and data_dir in code.co_filename:
            return True
        tb = tb.tb_next
    return False


def error_when(err: Mapping[str, Any]) -> str:
    """When the exception of ``err`` (a report's ``error``) was raised, in words after its
    class: ``, step 16``; raised while the watching was paused (``err["during"]``, see
    :meth:`nanwatch.Watcher.close`), what ran then and the last step before it:
    `` during validation, after step 15``.

    Example:
        >>> error_when({"step": 16, "during": "validation"})
        ' during validation, after step 15'
    """
    step = err.get("step", "?")
    during = err.get("during")
    fetching = err.get("fetching")
    if fetching and not during and isinstance(step, int):
        said = " while the DataLoader fetched the next batch"
        if fetching == "after-update":
            return f"{said}, after step {step}'s update, before step {step + 1}'s forward"
        if fetching == "after-step":
            return f"{said}, after step {step}, before step {step + 1}"
        first = " while the DataLoader fetched the first batch"
        return f"{first if step == 0 else said}, before step {step}'s forward"
    if not during:
        return f", step {step}"
    if isinstance(step, int) and step > 0:
        return f" during {during}, after step {step - 1}"
    return f" during {during}, before step 0" if step == 0 else f" during {during}"


#: error classes whose exception is not an op's reaction to the values it got
_NOT_BY_VALUES = ("anomaly", "guard", "keyboard-interrupt", "signal", "exit", "peer-failure")


def _before_raise(
    watcher: Watcher, steps: list[StepTrace], error: dict[str, Any], *, scaled: bool = False
) -> Anomaly | None:
    """The step that raised had already made a NaN or inf before the exception (an op that
    was born non-finite, a non-finite record, its anomaly): ``error["before"]`` says where,
    and the advice leads with it, whatever the exception's class -- a cholesky that refuses
    a NaN matrix, an index_add_ given an index computed from NaN. When no record held the
    value (the op's result never reached a module's output), the step in ``steps`` is
    replaced by a copy whose anomaly is that op and whose diagnoses are the rules' on it;
    that anomaly is returned. ``scaled``: a GradScaler scales the gradients, whose inf and
    NaN it expects now and then (it skips that step): they are not what the exception
    followed from. Host-side data only (the records and op events)."""
    if error.get("class") in _NOT_BY_VALUES or not steps:
        return None
    number = error.get("step")
    at = next((i for i in range(len(steps) - 1, -1, -1) if steps[i].step == number), None)
    if at is None:
        return None
    trace = steps[at]
    if _after_earlier(watcher, steps, trace, error):
        return None
    made: Anomaly | None = None
    ev: OpEvent | None = None
    if trace.anomaly is not None:
        a = trace.anomaly
        ev = a.op.chain()[0] if a.op is not None else None
        kinds = (
            ev.born
            if ev is not None and ev.born
            else (a.record.stat.kinds() if a.record.stat is not None else "non-finite value")
        )
        where = _event_where(ev) if ev is not None else f"in {a.record.where}"
    else:
        from nanwatch.localize import is_birth

        grads = (Phase.BACKWARD, Phase.GRADIENT) if scaled else ()
        ev = next((e for e in trace.ops if is_birth(e) and e.phase not in grads), None)
        bad = next((r for r in trace.records if r.bad and r.phase not in grads), None)
        if ev is not None:
            kinds, where = ev.born, _event_where(ev)
            made = _op_anomaly(trace, ev)
        elif bad is not None and bad.stat is not None:
            kinds, where = bad.stat.kinds(), f"in {bad.where}"
        else:
            return None
    detail = _op_detail(ev) if ev is not None else ""
    many = ", " in kinds
    kinds = kinds.replace(", ", " and ")
    text = f"before it raised, {kinds} {'were' if many else 'was'} born {where}" + (
        f" ({detail})" if detail else ""
    )
    error["before"] = {
        "kinds": kinds,
        "where": where,
        "source": ev.source if ev is not None else None,
        "op": _short(ev.op) if ev is not None else None,
        "detail": detail,
        "text": text,
    }
    if made is not None:
        copy = replace(trace, anomaly=made, diagnoses=[])
        try:
            copy.diagnoses = watcher._evaluate(copy)
        except Exception as err:  # the report goes on without the rules' word
            watcher.faults.append(("post-mortem rules", f"{type(err).__name__}: {err}"))
        steps[at] = copy
        trace = copy
    codes = ", ".join(dict.fromkeys(d.code for d in trace.diagnoses if d.severity == "error"))
    lead = text[0].upper() + text[1:]
    error["advice"] = (
        f"{lead}: the exception is most likely a consequence of that value; fix it first"
        + (f" ({codes})" if codes else "")
        + ". "
        + str(error.get("advice", ""))
    ).strip()
    return made


def _after_earlier(
    watcher: Watcher, steps: list[StepTrace], trace: StepTrace, error: dict[str, Any]
) -> bool:
    """The run's first anomaly came at an earlier step (a "record" or "warn" run went on),
    and the step that raised made nothing new: no value of its own was born non-finite, or
    only its weights were, written by an earlier update (NW301). The advice leads with that
    first anomaly, whose consequence the exception most likely is, not with the weights.
    Returns whether it did."""
    first = getattr(watcher, "first_anomaly", None)
    if first is None or first.step >= trace.step:
        return False
    a = trace.anomaly
    own = a is not None and a.kind is not AnomalyKind.PARAMETER
    if own or (a is None and any(r.bad for r in trace.records if r.phase is not Phase.PARAMETER)):
        return False
    then = next((t for t in steps if t.step == first.step), None)
    codes = ", ".join(
        dict.fromkeys(d.code for d in (then.diagnoses if then else []) if d.severity == "error")
    )
    head = anomaly_headline(first)
    error["before"] = {"text": f"before it raised, at step {first.step}: {head}"}
    weights = " (the weights it made non-finite were used since)" if a is not None else ""
    error["advice"] = (
        f"The run's first anomaly came at step {first.step}, and training went on{weights}: "
        f"{head}{f' ({codes})' if codes else ''}. The exception is most likely a consequence: "
        "fix that first. " + str(error.get("advice", ""))
    ).strip()
    return True


def _event_where(ev: OpEvent) -> str:
    """``at train.py:17`` / ``in the backward of train.py:17`` / ``in <module>``."""
    where = ev.at
    if where:
        return where
    return f"in {ev.path}" if ev.path else "in code outside the watched modules"


def _short(op: str) -> str:
    """``aten.div.Tensor`` -> ``aten.div``."""
    parts = op.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else op


def _op_detail(ev: OpEvent) -> str:
    """``aten.div, 0/0`` for a division that made NaN from zeros, ``aten.div, x/0`` for one
    whose denominator held 0; else the op's name."""
    from nanwatch.rules._evidence import denominator, has_zero, input_named, packet

    op = _short(ev.op)
    if packet(ev.op).rstrip("_") not in ("div", "true_divide", "divide", "reciprocal"):
        return op
    den = denominator(ev)
    zero_den = has_zero(den) or any(
        isinstance(v, (int, float)) and v == 0 for k, v in ev.scalars.items() if k == "other"
    )
    if not zero_den:
        return op
    num = input_named(ev, "self", "input")
    if "NaN" in ev.born and has_zero(num):
        return f"{op}, 0/0"
    return f"{op}, x/0"


def _op_anomaly(trace: StepTrace, ev: OpEvent) -> Anomaly:
    """An anomaly for the op ``ev`` that made a NaN or inf which no record held (the step
    raised before the value reached a module's output): the rules read its cause from it."""
    running = [c for c in trace.calls if c.end < 0]
    call = running[-1] if running else None
    path = ev.path or (call.path if call is not None else LOSS_PATH)
    backward = ev.phase is Phase.BACKWARD
    record = Record(
        index=len(trace.records),
        step=trace.step,
        phase=Phase.BACKWARD if backward else Phase.FORWARD,
        path=path,
        role="output",
        dtype=ev.dtype,
        device=ev.device,
        shape=(ev.output.numel,),
        stat=ev.output,
        call=call.id if call is not None and call.path == path else -1,
        module_type=call.module_type if call is not None and call.path == path else "",
    )
    kind = AnomalyKind.BACKWARD if backward else AnomalyKind.FORWARD
    phase = "backward" if backward else "forward"
    inside = f"the {phase} of {path}" if ev.path else "code outside the watched modules"
    return Anomaly(
        step=trace.step,
        kind=kind,
        path=path,
        record=record,
        origin="module" if ev.path else "loss-code",
        summary=(
            f"{ev.born} born in {inside} by {op_phrase(ev)}; the step raised before the "
            "value reached a module's output"
        ),
        op=ev,
    )


def _environment(watcher: Watcher, steps: Sequence[StepTrace]) -> Environment:
    import torch

    from nanwatch.stats import dtype_limits

    devices: set[str] = set()
    dtypes: set[str] = set()
    for t in steps:
        for r in t.records:
            devices.add(r.device)
            if r.stat is not None or r.phase in (Phase.GRADIENT, Phase.PARAMETER):
                dtypes.add(r.dtype)
    limits: dict[str, float] = {}
    amp: list[str] = []
    for name in sorted(dtypes):
        lim = dtype_limits(name)
        if lim is None:
            continue
        limits[name] = lim.max
        if lim.low_precision:
            amp.append(name)
    rank, world = rank_of(watcher)
    try:
        from importlib.metadata import version

        nw_version = version("nanwatch")
    except Exception:
        nw_version = "0+unknown"
    return Environment(
        nanwatch=nw_version,
        torch=str(torch.__version__),
        cuda=torch.version.cuda,
        python=platform.python_version(),
        platform=platform.platform(terse=True),
        mode=watcher.config.mode,
        devices=sorted(devices, key=lambda d: (d != "cpu", d)),
        dtypes=sorted(limits) + sorted(dtypes - set(limits)),
        amp_dtypes=amp,
        dtype_limits=limits,
        modules=len(watcher.module_paths),
        scaler=watcher.scaler is not None,
        rank=rank,
        world_size=world,
    )


#: the last rank each watcher saw (a process group destroyed before the report is built,
#: in a ``finally`` inside the watched block, still names the rank it had)
_KNOWN_RANKS: weakref.WeakKeyDictionary[Watcher, tuple[int, int | None]] = (
    weakref.WeakKeyDictionary()
)


def rank_of(watcher: Watcher | None = None) -> tuple[int | None, int | None]:
    """The process's ``(rank, world_size)`` as :func:`_rank` finds it now; when it finds
    none, the last one ``watcher`` saw (at attach, or in an earlier report). Remembered for
    ``watcher`` whenever found.

    Example:
        >>> rank_of()          # doctest: +SKIP
        (None, None)
    """
    rank, world = _rank()
    if watcher is None:
        return rank, world
    try:
        if rank is not None:
            _KNOWN_RANKS[watcher] = (rank, world)
        elif watcher in _KNOWN_RANKS:
            return _KNOWN_RANKS[watcher]
    except TypeError:  # not weak-referenceable: nothing to remember
        pass
    return rank, world


def _rank() -> tuple[int | None, int | None]:
    """The process's rank: torch.distributed when initialized (host-side calls only), else
    the launcher's $RANK / $WORLD_SIZE (torchrun, SLURM via Lightning)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:
        pass
    rank = os.environ.get("RANK")
    world = os.environ.get("WORLD_SIZE")
    if rank is not None and rank.isdigit():
        return int(rank), int(world) if world is not None and world.isdigit() else None
    return None, None


def _events(trace: StepTrace) -> list[Event]:
    """Everything that ran in ``trace``, in the order it finished; open calls last."""
    by_key: dict[tuple[int, str], Event] = {}
    last: dict[tuple[int, str], int] = {}
    for r in trace.records:
        if r.phase is Phase.PARAMETER:
            continue
        if r.phase is Phase.GRADIENT:
            key = (-1, "gradient")
            ev = by_key.get(key)
            if ev is None:
                ev = by_key[key] = Event("gradient", "parameters", "")
            ev.outputs.append(r)
        else:
            phase = "backward" if r.phase is Phase.BACKWARD else "forward"
            key = (r.call, phase)
            ev = by_key.get(key)
            if ev is None:
                call = trace.call(r.call)
                ev = by_key[key] = Event(
                    phase,
                    r.path,
                    call.module_type if call is not None else r.module_type,
                    depth=_depth(trace, call),
                )
            (ev.inputs if r.phase is Phase.INPUT else ev.outputs).append(r)
        last[key] = r.index
    open_calls = {c.id for c in trace.calls if c.end < 0}
    for c in trace.calls:
        key = (c.id, "forward")
        if c.id in open_calls:
            ev = by_key.get(key)
            if ev is None:
                ev = by_key[key] = Event("forward", c.path, c.module_type)
            ev.running = True
            ev.depth = _depth(trace, c)
    big = 1 << 62

    def order(key: tuple[int, str]) -> tuple[int, int]:
        ev = by_key[key]
        if ev.running:
            return big, ev.depth
        return last.get(key, -1), 0

    return [by_key[k] for k in sorted(by_key, key=order)]


def _depth(trace: StepTrace, call: Call | None) -> int:
    d = 0
    while call is not None and call.parent is not None and d < 256:
        call = trace.call(call.parent)
        d += 1
    return d


def _check_version(d: dict[str, Any], what: str) -> None:
    v = d.get("schema_version")
    if not isinstance(v, str) or not v:
        raise ReportFormatError(
            f"{what} is not a nanwatch report: it has no schema_version field. "
            "Pass the .json file a nanwatch report was saved to."
        )
    major = v.split(".")[0]
    if major != _MAJOR:
        env = d.get("environment")
        writer = env.get("nanwatch") if isinstance(env, dict) else None
        by = f" (written by nanwatch {writer})" if writer else ""
        newer = major.isdigit() and int(major) > int(_MAJOR)
        fix = (
            "upgrade nanwatch (pip install -U nanwatch) to read it"
            if newer
            else f"render it with the nanwatch version that wrote it{by}"
        )
        raise ReportFormatError(
            f"{what} has report schema version {v}{by}; this nanwatch reads version "
            f"{_MAJOR}.x ({SCHEMA_VERSION}). Hint: {fix}."
        )


def _jsonable(obj: Any) -> Any:
    """Non-finite floats anywhere (a rule's note data, a config value) become strings."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return "NaN"
        if math.isinf(obj):
            return "Infinity" if obj > 0 else "-Infinity"
        return obj
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return str(obj)
