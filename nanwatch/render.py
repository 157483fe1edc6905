"""Presentation of reports: rich renderables for the terminal, a self-contained HTML page
with plots, the Jupyter display, the demo gallery's panels and the post-mortem's summary.

Nothing here prints on its own: renderers return rich renderables or strings, and the
functions that write take a :class:`rich.console.Console`. Widths follow the console;
colors too (``NO_COLOR`` is honored by rich, as nothing here forces colors). Styles are
theme keys namespaced ``nanwatch.*`` (``nanwatch.nan``, ``nanwatch.error``): a console
whose theme defines them keeps its own.

Example:
    >>> from rich.console import Console
    >>> from nanwatch.report import Report
    >>> console = Console(width=100, color_system=None, file=io.StringIO())
    >>> console.print(Report(steps=[]))
    >>> "No step was recorded" in console.file.getvalue()
    True
"""

from __future__ import annotations

import ast
import base64
import html
import io
import math
import os
import re
import shutil
import sys
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType
from rich.errors import MissingStyle
from rich.panel import Panel
from rich.rule import Rule
from rich.style import Style
from rich.table import Table
from rich.text import Text
from rich.theme import Theme

from nanwatch.localize import custom_function, other_births
from nanwatch.records import (
    Anomaly,
    AnomalyKind,
    Call,
    OpEvent,
    Phase,
    Record,
    StepTrace,
    TensorStat,
)
from nanwatch.report import ERROR_LABELS, Event, Report, anomaly_headline, error_when

if TYPE_CHECKING:
    from nanwatch.rules.base import Diagnosis
    from nanwatch.scenarios import Outcome

__all__ = [
    "STYLES",
    "THEME",
    "demo_summary",
    "print_summary",
    "render_report",
    "render_report_file",
    "render_text",
    "report_html",
    "report_summary",
]

#: The default look of every style nanwatch uses; a console's own theme wins.
STYLES: dict[str, str] = {
    "nanwatch.title": "bold",
    "nanwatch.error": "bold red",
    "nanwatch.warning": "bold yellow",
    "nanwatch.info": "bold blue",
    "nanwatch.ok": "bold green",
    "nanwatch.anomaly": "bold magenta",
    "nanwatch.nan": "bold magenta",
    "nanwatch.inf": "bold red",
    "nanwatch.culprit": "bold red",
    "nanwatch.path": "cyan",
    "nanwatch.op": "magenta",
    "nanwatch.code": "bold",
    "nanwatch.fix": "green",
    "nanwatch.label": "dim",
    "nanwatch.dim": "dim",
    "nanwatch.source": "blue",
}
THEME = Theme(STYLES)

_ICON = {"error": "✗", "anomaly": "✗", "warning": "!", "ok": "✓", "info": "i"}
_STATUS_STYLE = {
    "error": "nanwatch.error",
    "anomaly": "nanwatch.anomaly",
    "warning": "nanwatch.warning",
    "ok": "nanwatch.ok",
    "info": "nanwatch.info",
}

# how much the terminal shows before cutting (the HTML shows more, the JSON everything)
_MAX_DIAGNOSES = 6
_MAX_TIMELINE = 12
_MAX_EVENTS = 10
_MAX_SIBLINGS = 2  #: on each side of the culprit
_MAX_CHILDREN = 6
_MAX_HTML_TIMELINE = 200
_MAX_HEATMAP_ROWS = 40
_DEMO_FIX_LINES = 3


# ---------------------------------------------------------------------- numbers
def fmt(v: float | int | None) -> str:
    """A number as a person reads it: 4 significant digits, ``NaN``, ``inf``, ``–`` (none).

    Example:
        >>> fmt(65504.0), fmt(float("nan")), fmt(None), fmt(0.000123456)
        ('6.55e+04', 'NaN', '–', '0.0001235')
    """
    if v is None:
        return "–"
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.4g}"


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}


def _nbytes(r: Record) -> int:
    n = 1
    for s in r.shape:
        n *= s
    return n * _ITEMSIZE.get(r.dtype, 1 if r.dtype.startswith("float8") else 4)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


# ---------------------------------------------------------------------- derived views
@dataclass(slots=True)
class ModuleStat:
    """What the tree and the heatmap show for one module call: dtype, device, shape, max
    |x| over the finite values, NaN and inf counts (``None``: present, not counted)."""

    dtype: str = ""
    device: str = ""
    shape: str = ""
    amax: float | None = None
    nan: int | None = 0
    inf: int | None = 0
    bad: bool = False
    kinds: str = "finite"
    measured: bool = False
    #: a pass-through module (ReLU, Sigmoid, Dropout(0), ...) is not measured: the numbers
    #: are its input's, an upper bound of max |x| (NaN passes through; inf may not)
    bound: bool = False

    @property
    def amax_text(self) -> str:
        if not self.measured:
            return "–"
        return f"≤{fmt(self.amax)}" if self.bound and self.amax is not None else fmt(self.amax)

    @property
    def inf_text(self) -> str:
        return "–" if self.bound else _count(self.inf, self.measured)

    @property
    def nan_text(self) -> str:
        return _count(self.nan, self.measured)


def module_stat(records: Iterable[Record], trace: StepTrace) -> ModuleStat:
    """The statistics of a call's records (several outputs are summed up)."""
    out = ModuleStat()
    kinds: list[str] = []
    first = True
    for r in records:
        m = trace.resolve(r)
        if first:
            out.dtype, out.device, out.shape = r.dtype, r.device, _shape(r.shape)
            first = False
        s = m.stat
        if s is None:
            continue
        out.measured = True
        mag = s.magnitude
        if not math.isnan(mag):
            out.amax = mag if out.amax is None else max(out.amax, mag)
        if not s.finite:
            out.bad = True
            kinds.extend(k for k in s.kinds().split(", ") if k not in kinds)
        out.nan = _add_count(out.nan, s.nan, s.has_nan)
        inf = None if s.posinf is None or s.neginf is None else s.posinf + s.neginf
        out.inf = _add_count(out.inf, inf, s.has_posinf or s.has_neginf)
    out.kinds = ", ".join(kinds) if kinds else "finite"
    return out


def _add_count(total: int | None, count: int | None, present: bool) -> int | None:
    if count is None:
        count = None if present else 0
    if total is None or count is None:
        return None
    return total + count


def _count(c: int | None, measured: bool) -> str:
    if not measured:
        return "–"
    return "yes" if c is None else str(c)


@dataclass(slots=True)
class TreeRow:
    """One row of the culprit's tree: the guide drawn before the name, the call (None for
    a row saying how many were left out), its statistics."""

    guide: str
    name: str
    module_type: str
    stat: ModuleStat | None
    culprit: bool = False
    ancestor: bool = False
    note: str = ""


@dataclass(slots=True)
class _Node:
    call: Call | None
    children: list[_Node] = field(default_factory=list)
    note: str = ""


def tree_rows(report: Report) -> tuple[list[TreeRow], str]:
    """The culprit module in the tree of its ancestors, with its siblings (a window around
    it) and its children; each row with the call's statistics. The second value names the
    phase of the statistics (``forward`` outputs, or ``backward`` gradients)."""
    found = report.culprit()
    if found is None:
        return [], ""
    trace, culprit = found
    a = report.first_anomaly
    phase = Phase.FORWARD
    if a is not None and a.kind is AnomalyKind.BACKWARD:
        phase = Phase.BACKWARD
    by_call: dict[int, list[Record]] = {}
    forward: dict[int, list[Record]] = {}
    grad_of: dict[int, Record] = {}  #: forward record index -> the gradient recorded for it
    for r in trace.records:
        if r.phase is phase:
            by_call.setdefault(r.call, []).append(r)
        if r.phase is Phase.FORWARD:
            forward.setdefault(r.call, []).append(r)
        elif r.phase is Phase.BACKWARD and r.source is not None:
            grad_of.setdefault(r.source, r)

    def stat_of(call: Call) -> ModuleStat:
        recs = by_call.get(call.id)
        if recs and phase is Phase.BACKWARD:
            # one row, one tensor: the gradients of the call's outputs (the gradients it sent
            # back to its inputs have other shapes and counts: rows of their own)
            recs = [r for r in recs if not r.role.startswith("input")]
        if recs:
            st = module_stat(recs, trace)
            st.bound = call.passthrough and phase is Phase.FORWARD
            return st
        outs = forward.get(call.id, [])
        if phase is Phase.BACKWARD:  # a container: its output is its last child's tensor
            grads = [grad_of[m.index] for m in map(trace.resolve, outs) if m.index in grad_of]
            if grads:
                return module_stat(grads, trace)
        st = module_stat(outs, trace)  # dtype, device, shape only
        return ModuleStat(st.dtype, st.device, st.shape)

    children: dict[int | None, list[Call]] = {}
    for k in trace.calls:
        children.setdefault(k.parent, []).append(k)
    chain: list[Call] = []
    c: Call | None = culprit
    while c is not None and len(chain) < 256:
        chain.append(c)
        c = trace.call(c.parent) if c.parent is not None else None
    chain.reverse()

    def kids(call: Call) -> list[Call]:
        return [k for k in children.get(call.id, []) if k.path != call.path]

    culprit_node = _Node(culprit)
    own = kids(culprit)
    culprit_node.children = [_Node(k) for k in own[:_MAX_CHILDREN]]
    if len(own) > _MAX_CHILDREN:
        culprit_node.children.append(_Node(None, note=f"… {len(own) - _MAX_CHILDREN} more"))
    node = culprit_node
    if len(chain) >= 2:
        parent = chain[-2]
        sibs = kids(parent)
        i = next((j for j, s in enumerate(sibs) if s is culprit), 0)
        lo, hi = max(0, i - _MAX_SIBLINGS), min(len(sibs), i + _MAX_SIBLINGS + 1)
        level: list[_Node] = []
        if lo > 0:
            level.append(_Node(None, note=f"… {lo} before"))
        level.extend(culprit_node if s is culprit else _Node(s) for s in sibs[lo:hi])
        if hi < len(sibs):
            level.append(_Node(None, note=f"… {len(sibs) - hi} after"))
        node = _Node(parent, level)
        for anc in reversed(chain[:-2]):
            node = _Node(anc, [node])
    rows: list[TreeRow] = []
    ancestors = {x.id for x in chain[:-1]}

    def walk(n: _Node, parent: Call | None, guide: str, child_guide: str, nth: int) -> None:
        """``nth``: which call of its module, among the calls of its parent's, this one is
        (counting the calls a window around the culprit leaves out)."""
        call = n.call
        if call is None:
            rows.append(TreeRow(guide, n.note, "", None, note=n.note))
        else:
            name = call.path
            if parent is not None and name.startswith(parent.path + "."):
                name = name[len(parent.path) + 1 :]  # relative to the enclosing call
            if nth > 1:
                name += f" (call {nth})"
            rows.append(
                TreeRow(
                    guide,
                    name,
                    call.module_type,
                    stat_of(call),
                    culprit=call is culprit,
                    ancestor=call.id in ancestors,
                )
            )
            if call is culprit and phase is Phase.BACKWARD:
                more = child_guide + ("│  " if n.children else "   ")
                for r in by_call.get(call.id, []):
                    if not r.role.startswith("input"):
                        continue
                    st = module_stat([r], trace)
                    if st.bad or (a is not None and r is a.record):
                        rows.append(TreeRow(more, f"↳ {r.role}", "its gradient", st))
        ordinal: dict[int, int] = {}
        seen: dict[str, int] = {}
        for sib in kids(call) if call is not None else []:
            seen[sib.path] = seen.get(sib.path, 0) + 1
            ordinal[sib.id] = seen[sib.path]
        for j, k in enumerate(n.children):
            last = j == len(n.children) - 1
            walk(
                k,
                call,
                child_guide + ("└─ " if last else "├─ "),
                child_guide + ("   " if last else "│  "),
                ordinal.get(k.call.id, 1) if k.call is not None else 1,
            )

    walk(node, None, "", "", 1)
    return rows, phase.value


def _first_root_records(trace: StepTrace) -> list[Record]:
    root = next((c for c in trace.calls if c.root and not c.is_loss), None)
    if root is None:
        return []
    return [r for r in trace.records if r.call == root.id and r.phase is Phase.FORWARD]


def logit_cell(trace: StepTrace) -> str:
    """max |logit| of a step; the kind of value when the logits were not finite."""
    if trace.max_logit is not None:
        return fmt(trace.max_logit)
    st = module_stat(_first_root_records(trace), trace)
    return st.kinds if st.bad else "–"


def _step_note(trace: StepTrace, report: Report) -> str:
    parts: list[str] = []
    if trace.anomaly is not None:
        a = trace.anomaly
        kinds = a.record.stat.kinds() if a.record.stat is not None else "non-finite"
        first = report.first_anomaly is not None and report.first_anomaly.step == a.step
        parts.append(f"{'first ' if first else ''}{kinds} at {a.path}")
    codes = list(dict.fromkeys(d.code for d in trace.diagnoses))
    if codes:
        parts.append(" ".join(codes[:4]) + (" …" if len(codes) > 4 else ""))
    if trace.error is not None:
        parts.append(f"raised {str(trace.error.get('type', '')).rsplit('.', 1)[-1]}")
    if report.partial_step == trace.step:
        parts.append("in progress")
    if not trace.full:
        parts.append("sentinel")
    return "; ".join(parts)


def _io_text(recs: Sequence[Record], *, device: bool = True) -> str:
    if not recs:
        return ""
    r = recs[0]
    text = f"{_shape(r.shape)} {r.dtype}" + (f" {r.device}" if device else "")
    if len(recs) > 1:
        text += f" +{len(recs) - 1}"
    return text


# ---------------------------------------------------------------------- theme handling
def _theme_for(console: Console) -> Theme:
    styles: dict[str, Style | str] = {}
    for key, default in STYLES.items():
        try:
            styles[key] = console.get_style(key)
        except MissingStyle:
            styles[key] = default
    return Theme(styles, inherit=False)


class Themed:
    """Renders ``renderable`` with nanwatch's styles available (``nanwatch.*`` keys), keeping
    any the console's own theme defines.

    Example:
        >>> Console(file=io.StringIO()).print(Themed(Text("x", style="nanwatch.nan")))
    """

    def __init__(self, renderable: RenderableType) -> None:
        self.renderable = renderable

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Any]:
        console.push_theme(_theme_for(console))
        try:
            yield from console.render(self.renderable, options)
        finally:
            console.pop_theme()


# ---------------------------------------------------------------------- terminal
def render_report(report: Report, console: Console, options: ConsoleOptions) -> Iterator[Any]:
    """The report as rich renderables (what ``Report.__rich_console__`` yields): headline,
    what ended the run, diagnoses, where it went wrong (the module tree), the last steps,
    the environment.

    Example:
        >>> Console(width=100).print(nw.report)                     # doctest: +SKIP
    """
    console.push_theme(_theme_for(console))
    try:
        yield from _sections(report, options)
    finally:
        console.pop_theme()


def _sections(report: Report, options: ConsoleOptions) -> Iterator[RenderableType]:
    yield _headline_panel(report)
    if report.diagnoses:
        yield from _diagnoses_section(report)
    if report.error is not None and report.error.get("class") != "anomaly":
        yield from _error_section(report)
    yield from _where_section(report)
    if report.steps:
        yield from _timeline_section(report)
    yield from _environment_section(report)


def _rule(title: str) -> Rule:
    return Rule(Text(title, style="nanwatch.title"), align="left", style="nanwatch.dim")


def _headline_panel(report: Report) -> Panel:
    status = report.status
    style = _STATUS_STYLE[status]
    head = Text(f"{_ICON[status]} ", style=style)
    head.append(report.headline, style=style)
    head.no_wrap = True
    head.overflow = "ellipsis"
    bits: list[str] = []
    r = report.step_range
    if r is not None:
        ring = report.config.get("ring_size")
        bits.append(
            f"steps {r[0]}-{r[1]}" + (f" (last {ring} kept)" if ring else "")
            if r[0] != r[1]
            else f"step {r[0]}"
        )
    if report.rank is not None:
        bits.append(f"rank {report.rank}")
    if report.anomaly_count > 1:
        bits.append(f"{report.anomaly_count} steps with anomalies")
    if report.created:
        bits.append(report.created.replace("T", " ").replace("+00:00", " UTC"))
    return Panel(
        head,
        title=Text("nanwatch report", style="nanwatch.title"),
        title_align="left",
        subtitle=Text(" · ".join(bits), style="nanwatch.dim") if bits else None,
        subtitle_align="right",
        border_style=style,
        box=box.ROUNDED,
    )


def _error_section(report: Report) -> Iterator[RenderableType]:
    err = report.error
    assert err is not None
    cls = str(err.get("class", "other"))
    yield _rule(f"What ended the run: {ERROR_LABELS.get(cls, 'exception')}")
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="nanwatch.label", no_wrap=True)
    grid.add_column(overflow="fold")
    message = str(err.get("message", ""))
    lines = [ln for ln in message.splitlines() if ln.strip()]
    shown = "\n".join(lines[:6]) + (f"\n… {len(lines) - 6} more lines" if len(lines) > 6 else "")
    grid.add_row("exception", Text(f"{err.get('type', '')}: {shown}".rstrip(": ")))
    if err.get("source"):
        src = Text(str(err["source"]), style="nanwatch.source")
        if err.get("code"):
            src.append(f"  {err['code']}")
        grid.add_row("raised at", src)
    if err.get("cause"):
        grid.add_row("caused by", Text(str(err["cause"])))
    if err.get("device_lost"):
        grid.add_row("device", Text("lost: nothing was read from the GPU", style="nanwatch.error"))
    before = err.get("before")
    if isinstance(before, dict) and before.get("text"):
        grid.add_row("before it raised", Text(str(before["text"]), style="nanwatch.nan"))
    if err.get("advice"):
        grid.add_row("what to do", Text(str(err["advice"])))
    yield grid
    trace = report.error_step()
    if trace is not None and trace.mutations:
        yield _mutations_table(trace)
    if cls == "out-of-memory" and trace is not None:
        big = _largest(trace)
        if big is not None:
            yield big
    events = report.recent_events(limit=_MAX_EVENTS)
    if events:
        yield _events_table(events, _events_title(err))


def _events_title(err: dict[str, Any]) -> str:
    """The title of the table of the last module calls: an error raised inside an
    optimizer's step (not by its closure) came after all of them had finished."""
    opt = err.get("optimizer")
    if isinstance(opt, dict) and not opt.get("in_closure"):
        return f"Modules that ran before {opt.get('class')}.{opt.get('method')}() (all finished)"
    if err.get("device_lost"):
        return "Last modules that ran (kernels run asynchronously: the failing one is among these)"
    return "Last modules that ran"


def _mutations_table(trace: StepTrace) -> Table:
    t = Table(
        title="Outputs modified in place after autograd saved them",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        expand=False,
    )
    t.add_column("module", style="nanwatch.path", overflow="fold")
    t.add_column("tensor")
    t.add_column("saved by")
    t.add_column("version", justify="right")
    for m in trace.mutations[:8]:
        t.add_row(
            str(m.get("path", "")),
            str(m.get("role", "")),
            str(m.get("grad_fn") or "–"),
            f"{m.get('recorded_version')} → {m.get('version')}",
        )
    if len(trace.mutations) > 8:
        t.caption = f"… {len(trace.mutations) - 8} more"
    return t


def _largest(trace: StepTrace) -> Table | None:
    seen: set[tuple[str, str, str]] = set()
    recs: list[Record] = []
    for r in sorted(trace.records, key=_nbytes, reverse=True):
        key = (r.path, r.role, r.phase.value)
        if key in seen or r.source is not None:
            continue
        seen.add(key)
        recs.append(r)
        if len(recs) == 5:
            break
    if not recs:
        return None
    t = Table(title="Largest tensors of the last step", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("module", "tensor", "shape", "dtype", "size"):
        t.add_column(col, justify="right" if col == "size" else "left", overflow="fold")
    for r in recs:
        t.add_row(r.path, f"{r.phase.value} {r.role}", _shape(r.shape), r.dtype, _mib(_nbytes(r)))
    return t


def _one_device(events: Sequence[Event]) -> str | None:
    """The device every tensor of ``events`` is on, if there is one (then it is said once)."""
    devices = {r.device for e in events for r in (*e.inputs, *e.outputs)}
    return devices.pop() if len(devices) == 1 else None


def _events_table(events: Sequence[Event], title: str) -> Table:
    device = _one_device(events)
    if device is not None:
        title += f", all on {device}"
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    t.add_column("", justify="right", style="nanwatch.dim")
    t.add_column("phase", no_wrap=True)
    t.add_column("module", style="nanwatch.path", overflow="fold")
    t.add_column("type", overflow="fold")
    t.add_column("inputs", overflow="fold")
    t.add_column("outputs", overflow="fold")
    n = len(events)
    for i, e in enumerate(events):
        phase = Text("running", style="nanwatch.error") if e.running else Text(e.phase)
        t.add_row(
            str(i - n),
            phase,
            e.path,
            e.module_type,
            _io_text(e.inputs, device=device is None),
            _io_text(e.outputs, device=device is None),
            style="nanwatch.culprit" if e.running and i == n - 1 else None,
        )
    return t


def _diagnoses_section(report: Report) -> Iterator[RenderableType]:
    ds = report.diagnoses
    yield _rule(f"Diagnoses ({len(ds)})")
    for d in ds[:_MAX_DIAGNOSES]:
        yield _diagnosis_block(d, report.steps_of(d), _call_sites(report))
    if len(ds) > _MAX_DIAGNOSES:
        yield Text(
            f"… {len(ds) - _MAX_DIAGNOSES} more diagnoses in the HTML and JSON report",
            style="nanwatch.dim",
        )


def _diagnosis_block(d: Diagnosis, steps: int, sites: Collection[str] = ()) -> Table:
    sev = _STATUS_STYLE.get(d.severity, "nanwatch.info")
    head = Text()
    head.append(f"{d.severity} ", style=sev)
    head.append(d.code, style="nanwatch.code")
    head.append(f"  {d.title}", style="nanwatch.title")
    where = d.where
    if where:
        head.append(f"  ({where})", style="nanwatch.dim")
    if steps > 1:
        head.append(f"  in {steps} steps", style="nanwatch.dim")
    grid = Table.grid(padding=(0, 1))
    grid.add_column(width=2)
    grid.add_column(style="nanwatch.label", no_wrap=True)
    grid.add_column(overflow="fold")
    label, evidence = _diagnosis_lines(d, sites)
    for i, ev in enumerate(evidence):
        grid.add_row("", "evidence" if i == 0 else "", Text(f"• {ev}"))
    if d.source:
        grid.add_row("", label, Text(d.source, style="nanwatch.source"))
    if d.explanation:
        grid.add_row("", "why", Text(d.explanation))
    if d.fix:
        grid.add_row("", "fix", Text(d.fix, style="nanwatch.fix"))
    grid.add_row("", "silence", Text(d.silence, style="nanwatch.dim"))
    outer = Table.grid()
    outer.add_column()
    outer.add_row(head)
    outer.add_row(grid)
    return outer


_CALLED_AT = "backward() called at"


def _call_site(ev: OpEvent) -> bool:
    """True when the op's source is the ``backward()`` call that ran it, not its own line:
    a backward op whose node was made before anomaly mode was on (the forward line that
    created it is unknown)."""
    return ev.phase is Phase.BACKWARD and bool(ev.backward_at) and ev.source == ev.backward_at


def _call_sites(report: Report) -> set[str]:
    """The sources in ``report`` that are ``backward()`` call sites standing in for an op's
    line (see :func:`_call_site`)."""
    return {
        ev.source
        for a in report.anomalies
        if a.op is not None
        for ev in a.op.chain()
        if ev.source and _call_site(ev)
    }


def _diagnosis_lines(d: Diagnosis, sites: Collection[str]) -> tuple[str, list[str]]:
    """The label of the diagnosis's source (``line``, or ``backward() called at`` when it is
    the call site of the backward pass, not the op's line) and its evidence, where an item
    quoting that call site says so."""
    if not d.source or d.source not in sites or d.phase != Phase.BACKWARD.value:
        return "line", list(d.evidence)
    at = f"at {d.source}"
    evidence = [
        f"{_CALLED_AT} {x.removeprefix('at ')}" if x == at or x.startswith(at + ":") else x
        for x in d.evidence
    ]
    return _CALLED_AT, evidence


def _anomaly_text(a: Anomaly) -> Text:
    t = Text()
    t.append(f"step {a.step}: ", style="nanwatch.dim")
    t.append(a.summary)
    return t


def _op_grid(a: Anomaly) -> Table | None:
    op = a.op
    if op is None:
        return None
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="nanwatch.label", no_wrap=True)
    grid.add_column(overflow="fold")
    chain = op.chain()
    for i, ev in enumerate(chain):
        label = "op" if len(chain) == 1 else f"op {i + 1}/{len(chain)}"
        line = Text(ev.op, style="nanwatch.op")
        line.append(f" created {ev.born}")
        if ev.dtype:
            line.append(f" in {ev.dtype}")
        if ev.path:
            line.append(f" in {ev.path}", style="nanwatch.path")
        if ev.node:
            line.append(f" (backward node {_node_words(ev.node)})", style="nanwatch.dim")
        grid.add_row(label, line)
        if ev.source:
            src = Text(ev.source, style="nanwatch.source")
            if ev.code:
                src.append(f"  {ev.code}")
            grid.add_row(f"{ev.backward_call} called at" if _call_site(ev) else "line", src)
        if ev.backward_at and ev.backward_at != ev.source:
            grid.add_row(
                f"{ev.backward_call} called at", Text(ev.backward_at, style="nanwatch.source")
            )
        for role, s in ev.inputs[:4]:
            grid.add_row(f"input {role}", Text(_stat_text(s)))
        if ev.scalars:
            grid.add_row(
                "arguments", Text(", ".join(f"{k}={_scalar(v)}" for k, v in ev.scalars.items()))
            )
        grid.add_row("output", Text(_stat_text(ev.output, ev.born)))
    return grid


def _node_words(node: str) -> str:
    """``SqrtBackward0``; ``MySqrtBackward, the backward of custom autograd.Function MySqrt``."""
    fn = custom_function(node)
    return f"{node}, the backward of custom autograd.Function {fn}" if fn else node


def _scalar(v: float | int | str) -> str:
    return fmt(v) if isinstance(v, float) else str(v)


def _stat_text(s: TensorStat | None, born: str = "") -> str:
    if s is None:
        return "not measured"
    if s.placeholder:  # its values were never read: what the op created, nothing counted
        return f"{born or s.kinds()} (values not counted)"
    parts = [f"min {fmt(s.min)}", f"max {fmt(s.max)}"]
    if s.finite_amax is not None and not s.finite:
        parts.append(f"finite max |x| {fmt(s.finite_amax)}")
    if s.counted:
        parts.append(f"NaN {s.nan}, +inf {s.posinf}, -inf {s.neginf} of {s.numel}")
    else:
        parts.append(f"{s.numel} values")
    return ", ".join(parts)


def _neginf_line(a: Anomaly) -> str | None:
    """Where the -inf this anomaly grew out of first appeared (a log of 0, a mask), when that
    is another tensor than the anomaly's own: a -inf the anomaly's record holds itself, as
    an overflow makes, came from nowhere earlier and is not named twice."""
    n = a.neginf_source
    if n is None or (n.step, n.index) == (a.record.step, a.record.index):
        return None
    if n.phase is Phase.INPUT:
        where = f"{n.role} of {n.path}"
    elif n.phase is Phase.FORWARD:
        where = f"the {n.role} of {n.path}"
    elif n.phase is Phase.BACKWARD:
        where = f"the gradient of {n.path}'s {n.role}"
    elif n.phase is Phase.GRADIENT:
        where = f"the gradient of {n.path}"
    else:
        where = f"the weights {n.path}"
    s = a.record.stat
    what = f"The {s.kinds()}" if s is not None and not s.finite else "This value"
    return f"{what} grew out of a -inf that first appeared in {where} (step {n.step})."


def _also_born(report: Report, a: Anomaly) -> str | None:
    """The step's other births (see :func:`nanwatch.localize.other_births`), in one line."""
    trace = report.step(a.step)
    if trace is None:
        return None
    others = other_births(trace, a)
    if not others:
        return None
    where = "; ".join(
        f"{r.stat.kinds() if r.stat is not None else 'non-finite'} in the {r.role} of {r.path}"
        for r in others
    )
    return (
        f"Also born in step {a.step}, from finite inputs (a separate problem, not fed by "
        f"this one): {where}."
    )


def _where_section(report: Report) -> Iterator[RenderableType]:
    a = report.first_anomaly
    rows, phase = tree_rows(report)
    if a is None and not rows:
        return
    yield _rule("Where it went wrong" if a is not None else "Where it was")
    if a is not None:
        yield _anomaly_text(a)
        op = _op_grid(a)
        if op is not None:
            yield op
        neginf = _neginf_line(a)
        if neginf is not None:
            yield Text(neginf, style="nanwatch.dim")
        also = _also_born(report, a)
        if also is not None:
            yield Text(also, style="nanwatch.dim")
        if report.step(a.step) is None:
            yield Text(
                f"Step {a.step} is no longer in the flight recorder "
                f"(ring_size={report.config.get('ring_size', '?')}): its modules are not shown.",
                style="nanwatch.dim",
            )
        later = report.anomalies[1:]
        if later:
            firsts = ", ".join(f"step {x.step} at {x.path}{_other_origin(x, a)}" for x in later[:3])
            more = report.anomaly_count - 1 - min(3, len(later))
            yield Text(
                f"Later anomalies: {firsts}" + (f" and {more} more" if more > 0 else ""),
                style="nanwatch.dim",
            )
    if rows:
        yield _tree_table(rows, phase)


def _other_origin(later: Anomaly, first: Anomaly) -> str:
    """`` (from -inf in b)`` when ``later`` grew out of a -inf first seen somewhere else than
    the one ``first`` grew out of: the same module, fed by another problem."""
    src = later.neginf_source
    if src is None or src.path == later.path:
        return ""
    was = first.neginf_source
    if was is not None and was.path == src.path:
        return ""
    return f" (from -inf in {src.path})"


def _tree_table(rows: Sequence[TreeRow], phase: str) -> Table:
    backward = phase == "backward"
    what = "gradients of the outputs" if backward else "outputs"
    t = Table(
        title=f"The module and its ancestors ({what})",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    t.add_column("module", overflow="fold", ratio=None)
    t.add_column("type", overflow="fold")
    t.add_column("dtype", no_wrap=True)
    t.add_column("device", no_wrap=True)
    t.add_column("shape", overflow="fold")
    t.add_column("max |grad|" if backward else "max |x|", justify="right", no_wrap=True)
    t.add_column("NaN", justify="right", no_wrap=True)
    t.add_column("inf", justify="right", no_wrap=True)
    for r in rows:
        name = Text(r.guide, style="nanwatch.dim")
        if r.stat is None:
            name.append(r.name, style="nanwatch.dim")
            t.add_row(name)
            continue
        s = r.stat
        name.append(r.name, style="nanwatch.culprit" if r.culprit else "nanwatch.path")
        if r.culprit:
            name.append(" ◀", style="nanwatch.culprit")
        nan = Text(s.nan_text, style="nanwatch.nan" if s.nan != 0 else "")
        inf = Text(s.inf_text, style="nanwatch.inf" if s.inf != 0 and not s.bound else "")
        amax = s.amax_text
        t.add_row(name, r.module_type, s.dtype, s.device, s.shape, amax, nan, inf)
    return t


def _timeline_section(report: Report) -> Iterator[RenderableType]:
    steps = report.steps
    shown = steps[-_MAX_TIMELINE:]
    yield _rule("Last steps")
    yield _timeline_table(report, shown, len(steps) - len(shown))


def _timeline_table(report: Report, steps: Sequence[StepTrace], cut: int) -> Table:
    scaled = any(t.scale is not None for t in steps)
    t = Table(box=box.SIMPLE_HEAD)
    t.add_column("step", justify="right")
    t.add_column("loss", justify="right", no_wrap=True)
    t.add_column("grad norm", justify="right", no_wrap=True)
    t.add_column("max |logit|", justify="right", no_wrap=True)
    if scaled:
        t.add_column("scale", justify="right", no_wrap=True)
    t.add_column("", overflow="fold")
    for s in steps:
        cells: list[RenderableType] = [
            str(s.step),
            _num_text(s.loss),
            _num_text(s.grad_norm),
            _kinds_text(logit_cell(s)),
        ]
        if scaled:
            cells.append(fmt(s.scale))
        cells.append(_step_note(s, report))
        bad = s.anomaly is not None or s.error is not None
        t.add_row(*cells, style="nanwatch.culprit" if bad else None)
    if cut:
        t.caption = f"{cut} earlier step{'s' if cut != 1 else ''} left out (all are in the HTML)"
    return t


def _num_text(v: float | None) -> Text:
    s = fmt(v)
    return _kinds_text(s)


def _kinds_text(s: str) -> Text:
    if s == "NaN" or "NaN" in s.split(", "):
        return Text(s, style="nanwatch.nan")
    if "inf" in s:
        return Text(s, style="nanwatch.inf")
    return Text(s)


def environment_rows(report: Report) -> list[tuple[str, str]]:
    """(label, value) pairs describing where the report was made."""
    e = report.environment
    rows = [
        ("nanwatch", e.nanwatch or "?"),
        ("torch", e.torch + (f" (CUDA {e.cuda})" if e.cuda else "")),
        ("python", e.python),
        ("platform", e.platform),
        ("mode", e.mode or str(report.config.get("mode", ""))),
        ("devices", ", ".join(e.devices) or "–"),
        ("dtypes", ", ".join(e.dtypes) or "–"),
        ("low-precision dtypes", ", ".join(e.amp_dtypes) or "none (full precision)"),
    ]
    if e.scaler:
        rows.append(("GradScaler", "yes"))
    rows.append(("modules watched", str(e.modules)))
    if e.rank is not None:
        rows.append(("rank", f"{e.rank}" + (f" of {e.world_size}" if e.world_size else "")))
    if report.faults:
        rows.append(("nanwatch faults", f"{len(report.faults)} (hooks disabled themselves)"))
    return [(k, v) for k, v in rows if v]


def _environment_section(report: Report) -> Iterator[RenderableType]:
    yield _rule("Environment")
    rows = environment_rows(report)
    grid = Table.grid(padding=(0, 2))
    half = (len(rows) + 1) // 2
    for _ in range(2):
        grid.add_column(style="nanwatch.label", no_wrap=True)
        grid.add_column(overflow="fold")
    for i in range(half):
        left = rows[i]
        right = rows[half + i] if half + i < len(rows) else ("", "")
        grid.add_row(left[0], left[1], right[0], right[1])
    yield grid
    for where, msg in report.faults[:3]:
        yield Text(f"nanwatch fault in its {where}: {msg}", style="nanwatch.warning")


def render_text(report: Report, *, width: int | None = None, color: bool | None = None) -> str:
    """The report as terminal text (what ``print(report)`` shows): as wide as the terminal,
    colored when standard output is a terminal and ``NO_COLOR`` is not set.

    Example:
        >>> render_text(Report(steps=[]), width=40).splitlines()[1]
        '│ ✓ No step was recorded               │'
    """
    tty = bool(getattr(sys.stdout, "isatty", lambda: False)()) if color is None else color
    buf = io.StringIO()
    console = Console(
        file=buf,
        width=width or shutil.get_terminal_size((100, 24)).columns,
        force_terminal=tty,
        color_system="auto" if tty else None,
        highlight=False,
    )
    console.print(report)
    return buf.getvalue()


# ---------------------------------------------------------------------- demo and stderr
def demo_summary(outcome: Outcome) -> RenderableType:
    """A compact panel for one gallery scenario (``nanwatch demo``), in the order a person
    reads it: what went wrong and where (the first non-finite value with its op and source
    line, or the exception's message), the top diagnosis, the evidence that matters most,
    an earlier warning if one came before, and the fix as code; the border says whether
    nanwatch found what the scenario expects (``EXPECTED``) and how long the run took.

    Everything comes from the run: the anomaly, the exception, the diagnoses. Source paths
    are shown relative to the gallery's package (else to the working directory, else as
    ``file.py:line``); lines of code that do not fit the console have their comments moved
    above them instead of being wrapped mid-expression.

    Example:
        >>> from nanwatch import scenarios
        >>> panel = demo_summary(scenarios.run(scenarios.get("div-by-zero")))  # doctest: +SKIP
        >>> Console(width=80).print(panel)                                     # doctest: +SKIP
    """
    return Themed(_DemoPanel(_demo_view(outcome)))


@dataclass(slots=True)
class _DemoRow:
    """One row of a demo panel: a short label and a text, or lines of code (``code``) that
    are fitted to the console's width when the panel is rendered."""

    label: Text
    text: Text | None = None
    code: list[str] = field(default_factory=list)
    #: a line of the user's source, shown after ``text`` (on its own line when it does not
    #: fit beside it; its trailing comment dropped when it does not fit at all)
    line: str = ""


@dataclass(slots=True)
class _DemoView:
    name: str
    title: str
    rows: list[_DemoRow]
    verdict: Text
    border: str


class _DemoPaths:
    """Shortens ``path/to/file.py:42`` in a text: relative to the scenario's package when
    the file is in it, else to the working directory when inside it, else the file name."""

    def __init__(self, module: str) -> None:
        mod = sys.modules.get(module)
        file = getattr(mod, "__file__", None)
        self.package = os.path.dirname(os.path.abspath(file)) if file else None

    def path(self, path: str) -> str:
        full = os.path.abspath(path)
        if self.package is not None and full.startswith(self.package + os.sep):
            return os.path.relpath(full, self.package)
        try:
            rel = os.path.relpath(full)
        except ValueError:  # another drive (Windows)
            rel = os.pardir
        return os.path.basename(full) if rel.startswith(os.pardir) else rel

    def text(self, text: str) -> str:
        import re

        return re.sub(
            r"(?P<path>[^\s:'\"()\[\],]+\.py):(?P<line>\d+)",
            lambda m: f"{self.path(m['path'])}:{m['line']}",
            text,
        )


def _demo_view(outcome: Outcome) -> _DemoView:
    s = outcome.scenario
    paths = _DemoPaths(s.module)
    report = (
        Report.from_watcher(outcome.watcher, outcome.error) if outcome.watcher is not None else None
    )
    err = _demo_error(outcome, report)
    a = outcome.anomaly
    top = outcome.top  # the answer `mismatches()` judges
    rows: list[_DemoRow] = []
    event_step: int | None = None

    if a is not None:
        event_step = a.step
        what = Text(f"step {a.step}: ", style="nanwatch.dim")
        what.append(paths.text(a.summary.split(" [")[0]))
        rows.append(_DemoRow(Text("what", style="nanwatch.error"), what))
        if a.op is not None:
            at = Text(a.op.op, style="nanwatch.op")
            if a.op.source:
                at.append(f" in the backward, {_CALLED_AT} " if _call_site(a.op) else " at ")
                at.append(paths.text(a.op.source), style="nanwatch.source")
            rows.append(_DemoRow(Text("at", style="nanwatch.label"), at, line=a.op.code or ""))
    if err is not None:
        label = "what" if a is None else "raised"
        step = err.get("step")
        if a is None and isinstance(step, int):
            event_step = step
        what = Text(f"step {step}: " if isinstance(step, int) else "", style="nanwatch.dim")
        what.append(_demo_exception_head(err))
        message = paths.text(_demo_message(str(err.get("message", ""))))
        if message:
            what.append(f": {message}")
        rows.append(_DemoRow(Text(label, style="nanwatch.error"), what))
        source = paths.text(str(err["source"])) if err.get("source") else None
        if source is not None and source in what.plain:
            source = None  # the message names it already
        code = str(err.get("code") or "")
        if source is not None or code:
            at = Text(source or "", style="nanwatch.source")
            rows.append(_DemoRow(Text("at", style="nanwatch.label"), at, line=code))
    if a is None and err is None:
        if top is not None:  # no NaN or inf and no exception: the diagnosis is the news
            where = _demo_where(top, paths)
            code = _demo_code_line(top.source) if top.source else ""
            rows.append(_DemoRow(Text("where", style="nanwatch.label"), where, line=code))
        else:
            head = report.headline if report is not None else "the scenario never called watch()"
            ok = report is not None and report.status == "ok"
            style = "nanwatch.ok" if ok else "nanwatch.warning"
            rows.append(_DemoRow(Text("what", style=style), Text(head, style=style)))

    shown = "\n".join(f"{r.text.plain if r.text else ''} {r.line}" for r in rows)
    if top is not None:
        sev = _STATUS_STYLE.get(top.severity, "nanwatch.info")
        line = Text(top.title, style="nanwatch.title")
        extra = [x for x in (top.path, top.op) if x and not _demo_mentions(shown, x)]
        if event_step is not None and top.step is not None and top.step != event_step:
            extra.append(f"step {top.step}")
        if extra:
            line.append(f" (in {', '.join(extra)})", style="nanwatch.dim")
        rows.append(_DemoRow(Text(top.code, style=sev), line))
        evidence = _demo_evidence(top.evidence, shown, paths)
        if evidence is not None:
            rows.append(_DemoRow(Text(""), Text(evidence)))
    warned = _demo_warned(outcome, event_step)
    if warned is not None:
        rows.append(_DemoRow(Text("warned", style="nanwatch.warning"), warned))
    if top is not None and top.fix.strip():
        fix = [ln.rstrip() for ln in top.fix.strip().splitlines()]
        rows.append(_DemoRow(Text("fix", style="nanwatch.fix"), code=fix[:_DEMO_FIX_LINES]))
        if len(fix) > _DEMO_FIX_LINES:
            more = len(fix) - _DEMO_FIX_LINES
            rows.append(
                _DemoRow(
                    Text(""),
                    Text(
                        f"… {more} more line{'s' if more > 1 else ''} in the full report",
                        style="nanwatch.dim",
                    ),
                )
            )
    elif err is not None and err.get("advice"):
        hint = Text(_first_sentence(paths.text(str(err["advice"]))))
        rows.append(_DemoRow(Text("hint", style="nanwatch.label"), hint))

    mismatches = outcome.mismatches(with_diagnosis=True)
    located = not outcome.mismatches(with_diagnosis=False)
    for m in mismatches:
        rows.append(_DemoRow(Text("✗", style="nanwatch.error"), Text(m, style="nanwatch.error")))
    if not mismatches:
        verdict, border = Text("✓ as expected", style="nanwatch.ok"), "nanwatch.ok"
    elif located:
        verdict = Text("✓ localized, ✗ diagnosis differs", style="nanwatch.warning")
        border = "nanwatch.warning"
    else:
        verdict, border = (
            Text("✗ differs from the expected result", style="nanwatch.error"),
            "nanwatch.error",
        )
    verdict.append(f" · {outcome.seconds:.2f} s", style="nanwatch.dim")
    return _DemoView(s.name, s.title, rows, verdict, border)


def _demo_error(outcome: Outcome, report: Report | None) -> dict[str, Any] | None:
    """The exception that ended the scenario, as the report classified it (a nanwatch
    anomaly raised on purpose is the anomaly, not news of its own)."""
    if report is not None:
        err = report.error
        return None if err is None or err.get("class") == "anomaly" else err
    exc = outcome.error
    if exc is None:
        return None
    return {"type": type(exc).__qualname__, "message": str(exc), "class": "other"}


def _demo_exception_head(err: dict[str, Any]) -> str:
    short = str(err.get("type", "")).rsplit(".", 1)[-1] or "exception"
    label = ERROR_LABELS.get(str(err.get("class", "other")), "exception")
    return short if label in ("exception", short) else f"{short} ({label})"


def _demo_message(message: str, limit: int = 240) -> str:
    """The message's first line; a long one cut after a whole sentence, never inside one."""
    import re

    line = next((ln.strip() for ln in message.splitlines() if ln.strip()), "")
    if len(line) <= limit:
        return line
    sentences = re.split(r"(?<=[.?!])\s+(?=[A-Z])", line)
    out = sentences[0]
    for more in sentences[1:]:
        if len(out) + 1 + len(more) > limit:
            break
        out += " " + more
    return out


def _demo_where(d: Diagnosis, paths: _DemoPaths) -> Text:
    bits = [x for x in (d.path, d.op) if x]
    head = bits[0] if bits else ""
    if d.phase:
        head += f" ({d.phase})" if head else d.phase
    where = Text(head, style="nanwatch.path")
    if d.step is not None:
        where.append(f", step {d.step}" if head else f"step {d.step}", style="nanwatch.dim")
    if d.source:
        where.append(" at ")
        where.append(paths.text(d.source), style="nanwatch.source")
    return where


def _demo_code_line(source: str) -> str:
    """The text of ``file.py:42`` when the file can be read, else ''."""
    import linecache

    path, _, line = source.rpartition(":")
    return linecache.getline(path, int(line)).strip() if path and line.isdigit() else ""


def _demo_mentions(shown: str, name: str) -> bool:
    """True when ``name`` (a module path, an op) appears in ``shown`` as a whole name."""
    import re

    return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", shown) is not None


def _demo_evidence(evidence: Sequence[str], shown: str, paths: _DemoPaths) -> str | None:
    """The evidence line that matters most: the first with numbers in it that the panel
    does not show already (the source line and the exception's message are shown above)."""
    import re

    fresh: list[str] = []
    for ev in evidence:
        text = paths.text(ev).strip()
        if not text or text in shown or re.match(r"at \S+\.py:\d+", text):
            continue
        fresh.append(text)
    numbers = [t for t in fresh if any(ch.isdigit() for ch in t)]
    chosen = numbers or fresh
    return chosen[0] if chosen else None


def _demo_warned(outcome: Outcome, event_step: int | None) -> Text | None:
    """The earliest diagnosis in the flight recorder from a step before the one that went
    wrong: the early warning a user would have seen."""
    if event_step is None:
        return None
    for t in outcome.history:
        if t.step >= event_step or not t.diagnoses:
            continue
        d = sorted(t.diagnoses, key=_demo_severity)[0]
        n = event_step - t.step
        text = Text(d.code, style="nanwatch.code")
        text.append(f" {d.title}")
        text.append(
            f" (step {t.step}, {n} step{'s' if n != 1 else ''} before)", style="nanwatch.dim"
        )
        return text
    return None


def _demo_severity(d: Diagnosis) -> int:
    return {"error": 0, "warning": 1}.get(d.severity, 2)


def _demo_fit_code(lines: Sequence[str], width: int) -> list[str]:
    """Lines of code fitted to ``width``: a trailing comment that does not fit goes on its
    own line above its code, a long comment wraps as comment lines; code itself is never
    broken here (the console folds what is still too long)."""
    import textwrap

    out: list[str] = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
            continue
        indent = line[: len(line) - len(line.lstrip())]
        body = line.strip()
        code, comment = body, ""
        if body.startswith("#"):
            code, comment = "", body.lstrip("#").strip()
        elif "  #" in body:
            code, _, comment = body.partition("  #")
            code, comment = code.rstrip(), comment.lstrip("#").strip()
        if comment:
            room = max(width - len(indent) - 2, 20)
            out.extend(f"{indent}# {part}" for part in textwrap.wrap(comment, room))
        if code:
            out.append(indent + code)
    return out


_DEMO_LABEL_WIDTH = 6  #: "warned", "raised"


def _demo_append_line(text: Text, line: str, room: int) -> None:
    """``line`` (the user's source) after ``text``: beside it when both fit in ``room``,
    else on its own line; without its trailing comment when the whole does not fit."""
    last = text.plain.rsplit("\n", 1)[-1]
    if last and len(last) + 2 + len(line) <= room:
        text.append("  " + line)
        return
    if len(line) > room and "  #" in line:
        line = line.partition("  #")[0].rstrip()
    text.append(("\n" if text.plain else "") + line)


class _DemoPanel:
    """The demo panel, laid out for the console's width when it is rendered."""

    def __init__(self, view: _DemoView) -> None:
        self.view = view

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Any]:
        v = self.view
        width = options.max_width
        rows = list(v.rows)
        title = Text(v.name, style="nanwatch.title")
        if len(v.name) + len(v.title) + 9 <= width:
            title.append(f" · {v.title}", style="nanwatch.dim")
        else:  # the title does not fit in the border: it opens the panel instead
            rows.insert(0, _DemoRow(Text(""), Text(v.title, style="nanwatch.dim")))
        # one label width for every panel, so that a gallery of them reads as one column
        label_width = max(_DEMO_LABEL_WIDTH, *(len(r.label.plain) for r in rows))
        room = max(width - 4 - label_width - 1, 20)
        grid = Table.grid(padding=(0, 1))
        grid.add_column(no_wrap=True, width=label_width)
        grid.add_column(overflow="fold")
        for r in rows:
            if r.code:
                body = Text("\n".join(_demo_fit_code(r.code, room)), style="nanwatch.fix")
            else:
                body = r.text.copy() if r.text is not None else Text("")
                if r.line:
                    _demo_append_line(body, r.line, room)
            grid.add_row(r.label, body)
        yield Panel(
            grid,
            title=title,
            title_align="left",
            subtitle=v.verdict,
            subtitle_align="right",
            border_style=v.border,
            box=box.ROUNDED,
        )


def _in_report_file(sentence: str) -> str:
    """A sentence of advice that says something "is listed" (the last modules, the largest
    tensors) points at the report file when printed where nothing is listed (stderr)."""
    if sentence.endswith(" listed."):
        return sentence[:-1] + " in the report file."
    return sentence.replace(" listed, ", " listed in the report file, ", 1)


def _first_sentence(text: str) -> str:
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


#: what a fix sets up before its change: ``eps = torch.finfo(torch.float32).eps``, an import
_HELPER = re.compile(
    r"^(?:\w+\s*=\s*(?:torch\.finfo\(.*|[-+.\deE]+)|import \S.*|from \S+ import .*)$"
)


def key_line(fix: str) -> str:
    r"""The line of a fix a one-line summary shows: the rewrite of the user's line (``# was:``)
    if it has one, else its first line of code that is not a helper constant; a fix of
    comments only gives its first commented-out line of code, after the comment that
    introduces it ("...:"), else its first line.

    >>> key_line("eps = torch.finfo(torch.float32).eps\ny = x.clamp_min(eps) ** 0.75")
    'y = x.clamp_min(eps) ** 0.75'
    >>> key_line("# adapt: your loop\nloss = f(x)  # was: loss = g(x)")
    'loss = f(x)  # was: loss = g(x)'
    >>> key_line("# where x is normalized:\n# x / (x.std(correction=0) + 1e-8)\n# or skip it")
    '# where x is normalized: x / (x.std(correction=0) + 1e-8)'
    """
    lines = [ln.strip() for ln in fix.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    rewrite = next((ln for ln in lines if "# was:" in ln and not ln.startswith("#")), None)
    if rewrite is not None:
        return rewrite
    code = [ln for ln in lines if not ln.startswith("#")]
    main = [ln for ln in code if not _HELPER.match(ln.split("  #", 1)[0].strip())]
    if main or code:
        return (main or code)[0]
    # only comments: a comment that introduces code ("...: ") is no fix on its own line;
    # show it with the first commented-out line of code after it
    body = [ln.lstrip("#").strip() for ln in lines]
    at = next((i for i, b in enumerate(body) if _is_code(b)), None)
    if at is None:
        intro = lines[0].endswith(":") and len(lines) > 1
        return f"{lines[0]} {body[1]}" if intro else lines[0]
    if at > 0 and body[at - 1].endswith(":"):
        return f"{lines[at - 1]} {body[at].split('  #', 1)[0].strip()}"
    return lines[at]


def _is_code(text: str) -> bool:
    """Whether a comment's text is a line of Python (an expression or a statement with an
    operator or a call), not prose: ``(x - x.mean()) / x.std()`` is, ``skip batches of 1``
    is not."""
    src = text.split("  #", 1)[0].strip()
    if not src:
        return False
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return False
    if len(tree.body) != 1:
        return False
    node = tree.body[0]
    if isinstance(node, ast.Expr) and isinstance(node.value, (ast.Name, ast.Constant)):
        return False
    ops = (ast.Call, ast.BinOp, ast.Assign, ast.AugAssign)
    return any(isinstance(n, ops) for n in ast.walk(node))


def report_summary(report: Report, paths: Sequence[os.PathLike[str] | str]) -> RenderableType:
    """A few lines for stderr when a report was written: what happened (the exception, or
    the anomalies of a run that finished), the headline, the first hint, the files. The
    post-mortem prints it; so does ``nanwatch run`` at the end of a run with anomalies.

    Example:
        >>> Console().print(report_summary(nw.report, ["run.json"]))  # doctest: +SKIP
    """
    err = report.error
    head = Text("nanwatch: ", style="nanwatch.title")
    if err is not None:
        label = ERROR_LABELS.get(str(err.get("class", "other")), "exception")
        kind = str(err.get("type", "")).rsplit(".", 1)[-1]
        paused = err.get("during") or err.get("fetching")  # error_when says what ran then
        when = error_when(err) if paused else f" at step {err.get('step', '?')}"
        head.append(f"{kind} ({label}){when}; post-mortem report written")
    else:
        r = report.step_range
        n = report.anomaly_count
        what = f"{n} step{'s' if n != 1 else ''} with anomalies" if n else "no anomaly"
        span = f" in steps {r[0]}-{r[1]}" if r is not None else ""
        head.append(f"{what}{span}; report written")
    lines: list[Text] = [head]
    status = report.status
    line = Text(f"  {_ICON[status]} ", style=_STATUS_STYLE[status])
    line.append(report.headline)
    lines.append(line)
    before = err.get("before") if err is not None else None
    if isinstance(before, dict) and before.get("text"):  # the NaN the exception came from
        lines.append(Text(f"  ! {before['text']}", style="nanwatch.nan"))
    top = report.top
    if top is not None:
        hint = Text("  → ", style="nanwatch.dim")
        hint.append(f"{top.code} {top.title}")
        if top.fix:
            fix_lines = top.fix.strip().splitlines()
            more = " …" if len(fix_lines) > 1 else ""
            hint.append(f"; fix: {key_line(top.fix)}{more}", style="nanwatch.fix")
        lines.append(hint)
    elif err is not None and err.get("advice"):
        advice = str(err["advice"])
        said = str(before.get("text", "")) if isinstance(before, dict) else ""
        end = advice.find(". ", len(said))
        if said and advice[1:].startswith(said[1:]) and end > 0:
            advice = advice[end + 2 :]  # its first sentence is on its own line above
        hint_text = _in_report_file(_first_sentence(advice))
        lines.append(Text(f"  → {hint_text}", style="nanwatch.dim"))
    if top is None and err is not None and err.get("source"):
        # the user's line that raised: the first place to look when no diagnosis names one
        at = Text(f"  at {err['source']}", style="nanwatch.source")
        code = str(err.get("code") or "").strip()
        if code:
            at.append(f"  {code}", style="nanwatch.dim")
        lines.append(at)
    for p in paths:
        lines.append(Text(f"  {os.fspath(p)}", style="nanwatch.source"))
    return Themed(Group(*lines))


def print_summary(
    report: Report,
    paths: Sequence[os.PathLike[str] | str],
    *,
    console: Console | None = None,
) -> None:
    """Print :func:`report_summary` on ``console`` (default: stderr; paths never wrap, so
    they can be copied).

    Example:
        >>> paths = nw.report.save_all("reports", stem="run")           # doctest: +SKIP
        >>> print_summary(nw.report, paths)                              # doctest: +SKIP
    """
    if console is None:
        console = Console(stderr=True, highlight=False, soft_wrap=True)
    console.print(report_summary(report, paths), soft_wrap=True)


def render_report_file(
    path: str | os.PathLike[str], console: Console, html_out: str | os.PathLike[str] | None = None
) -> int:
    """``nanwatch report FILE.json [--html OUT]``: render a saved report on ``console`` and,
    with ``html_out``, write it as an HTML page too. Returns the exit status (0). A file that
    cannot be read, or is not a report this version reads, raises
    :class:`nanwatch.ReportFormatError` with the fix in its message.

    Example:
        >>> render_report_file("run.json", Console(), html_out="run.html")  # doctest: +SKIP
        0
    """
    from nanwatch.postmortem import atomic_write

    report = Report.load(path)
    console.print(report)
    if html_out is not None:
        written = atomic_write(html_out, report.to_html())
        console.print(Text(f"HTML report written to {written}", style="nanwatch.dim"))
    return 0


# ---------------------------------------------------------------------- HTML
_CSS = """
.nw{--fg:#1d2330;--muted:#5f6b7a;--bg:#ffffff;--card:#f6f8fa;--line:#d9dee5;--err:#c62828;
  --warn:#b26a00;--ok:#2e7d32;--nan:#a0189b;--info:#1f5fbf;--code:#0b3d91;
  font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);
  background:var(--bg);max-width:1100px;margin:0 auto;padding:20px 24px}
@media (prefers-color-scheme:dark){.nw{--fg:#e6e9ef;--muted:#9aa4b2;--bg:#14171c;
  --card:#1d2128;--line:#2f3540;--err:#ef6b6b;--warn:#f0b24a;--ok:#6fcf73;--nan:#e17be0;
  --info:#7fb0ff;--code:#a9c7ff}}
.nw h1{font-size:1.35em;margin:.2em 0 .1em;line-height:1.3}
.nw h2{font-size:1.1em;margin:1.6em 0 .5em;padding-bottom:.2em;
  border-bottom:1px solid var(--line)}
.nw h3{font-size:1em;margin:1em 0 .3em}
.nw .headline{border-left:6px solid var(--muted);background:var(--card);padding:12px 16px;
  border-radius:6px}
.nw .headline.error{border-color:var(--err)}
.nw .headline.anomaly{border-color:var(--nan)}
.nw .headline.warning{border-color:var(--warn)}
.nw .headline.ok{border-color:var(--ok)}
.nw .kicker{font-size:.8em;text-transform:uppercase;letter-spacing:.08em;color:var(--muted)}
.nw .meta{color:var(--muted);font-size:.88em;margin:0}
.nw code,.nw pre,.nw .mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;
  font-size:.9em}
.nw pre{background:var(--card);padding:8px 12px;border-radius:6px;overflow-x:auto;
  margin:.2em 0;white-space:pre-wrap;overflow-wrap:anywhere}
.nw .card{background:var(--card);border:1px solid var(--line);border-radius:8px;
  padding:10px 14px;margin:10px 0}
.nw .sev{display:inline-block;font-size:.75em;font-weight:700;text-transform:uppercase;
  padding:1px 7px;border-radius:10px;color:#fff;background:var(--muted);margin-right:6px;
  vertical-align:middle}
.nw .sev.error{background:var(--err)}
.nw .sev.warning{background:var(--warn)}
.nw .sev.info{background:var(--info)}
.nw .dcode{font-weight:700;font-family:ui-monospace,Menlo,monospace;margin-right:6px}
.nw .where{color:var(--muted);font-size:.9em}
.nw dl.kv{display:grid;grid-template-columns:max-content minmax(0,1fr);gap:2px 14px;
  margin:.4em 0}
.nw dl.kv dt{color:var(--muted)}
.nw dl.kv dd{margin:0}
.nw table{border-collapse:collapse;width:100%;font-size:.9em;margin:.4em 0}
.nw th{text-align:left;color:var(--muted);font-weight:600;
  border-bottom:1px solid var(--line);padding:4px 8px}
.nw td{border-bottom:1px solid var(--line);padding:3px 8px;vertical-align:top}
.nw td.num,.nw th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.nw tr.bad td{background:rgba(198,40,40,.08)}
.nw tr.culprit td{background:rgba(198,40,40,.14);font-weight:600}
.nw .guide{color:var(--muted);white-space:pre;font-family:ui-monospace,Menlo,monospace}
.nw .nan{color:var(--nan);font-weight:700}
.nw .inf{color:var(--err);font-weight:700}
.nw .fix{color:var(--ok)}
.nw .muted{color:var(--muted)}
.nw .path{font-family:ui-monospace,Menlo,monospace}
.nw figure{margin:.6em 0}
.nw figure img{max-width:100%;height:auto;background:#fff;border-radius:6px;
  border:1px solid var(--line)}
.nw figcaption{color:var(--muted);font-size:.85em}
.nw details summary{cursor:pointer;color:var(--muted)}
.nw .missing{background:var(--card);border:1px dashed var(--line);padding:8px 12px;
  border-radius:6px}
.nw footer{margin-top:2em;color:var(--muted);font-size:.85em}
"""


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def report_html(report: Report, *, standalone: bool = True) -> str:
    """The report as HTML: a self-contained page (``standalone``), or a ``<div>`` with its
    own scoped style for a notebook cell. Plots need matplotlib (the ``plot`` extra);
    without it the page says what to install.

    Example:
        >>> report_html(Report(steps=[]), standalone=False).startswith('<div class="nw"')
        True
    """
    parts: list[str] = [f'<div class="nw" id="nanwatch-report"><style>{_CSS}</style>']
    parts.append(_html_headline(report))
    if report.diagnoses:
        parts.append(_html_diagnoses(report))
    if report.error is not None and report.error.get("class") != "anomaly":
        parts.append(_html_error(report))
    parts.append(_html_where(report))
    if report.steps:
        parts.append(_html_timeline(report))
    parts.append(_html_environment(report))
    parts.append(
        "<footer>nanwatch report, schema "
        f"{_e(report.schema_version)}. Re-render in a terminal: "
        "<code>nanwatch report FILE.json</code>; all records are in the JSON file.</footer>"
    )
    parts.append("</div>")
    body = "\n".join(p for p in parts if p)
    if not standalone:
        return body
    title = _e(f"nanwatch: {report.headline}")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<meta name="generator" content="nanwatch {_e(report.environment.nanwatch)}">'
        f"<title>{title}</title>"
        "<style>body{margin:0;background:#ffffff}"
        "@media (prefers-color-scheme:dark){body{background:#14171c}}</style>"
        f"</head><body>\n{body}\n</body></html>\n"
    )


def _html_headline(report: Report) -> str:
    status = report.status
    meta: list[str] = []
    r = report.step_range
    if r is not None:
        meta.append(f"steps {r[0]}–{r[1]}" if r[0] != r[1] else f"step {r[0]}")
    if report.rank is not None:
        meta.append(f"rank {report.rank}")
    if report.anomaly_count > 1:
        meta.append(f"{report.anomaly_count} steps with anomalies")
    if report.created:
        meta.append(report.created.replace("T", " ").replace("+00:00", " UTC"))
    return (
        f'<header class="headline {status}" id="headline">'
        f'<div class="kicker">nanwatch report · {_e(status)}</div>'
        f"<h1>{_e(_ICON[status])} {_e(report.headline)}</h1>"
        f'<p class="meta">{_e(" · ".join(meta))}</p></header>'
    )


def _kv(rows: Iterable[tuple[str, str]], *, raw: bool = False) -> str:
    items = "".join(f"<dt>{_e(k)}</dt><dd>{v if raw else _e(v)}</dd>" for k, v in rows)
    return f'<dl class="kv">{items}</dl>'


def _html_error(report: Report) -> str:
    err = report.error or {}
    cls = str(err.get("class", "other"))
    rows: list[tuple[str, str]] = [
        ("exception", f"<code>{_e(err.get('type', ''))}</code>"),
        ("message", f"<pre>{_e(err.get('message', ''))}</pre>"),
    ]
    if err.get("source"):
        code = f" <code>{_e(err['code'])}</code>" if err.get("code") else ""
        rows.append(("raised at", f"<code>{_e(err['source'])}</code>{code}"))
    if err.get("cause"):
        rows.append(("caused by", _e(err["cause"])))
    if err.get("device_lost"):
        rows.append(("device", '<b class="inf">lost</b>: nothing was read from the GPU'))
    before = err.get("before")
    if isinstance(before, dict) and before.get("text"):
        rows.append(("before it raised", f'<b class="nan">{_e(before["text"])}</b>'))
    if err.get("advice"):
        rows.append(("what to do", _e(err["advice"])))
    out = [
        f'<section id="error"><h2>What ended the run: {_e(ERROR_LABELS.get(cls, cls))}</h2>',
        _kv(rows, raw=True),
    ]
    trace = report.error_step()
    if trace is not None and trace.mutations:
        body = "".join(
            f'<tr><td class="path">{_e(m.get("path"))}</td><td>{_e(m.get("role"))}</td>'
            f"<td>{_e(m.get('grad_fn') or '–')}</td>"
            f'<td class="num">{_e(m.get("recorded_version"))} → {_e(m.get("version"))}</td></tr>'
            for m in trace.mutations
        )
        out.append(
            "<h3>Outputs modified in place after autograd saved them</h3><table><thead><tr>"
            '<th>module</th><th>tensor</th><th>saved by</th><th class="num">version</th>'
            f"</tr></thead><tbody>{body}</tbody></table>"
        )
    events = report.recent_events(limit=20)
    if events:
        title = _events_title(err)
        device = _one_device(events)
        if device is not None:
            title += f", all on {device}"
        rows_html = []
        n = len(events)
        for i, e in enumerate(events):
            cls_attr = ' class="culprit"' if e.running and i == n - 1 else ""
            phase = '<b class="inf">running</b>' if e.running else _e(e.phase)
            rows_html.append(
                f'<tr{cls_attr}><td class="num">{i - n}</td><td>{phase}</td>'
                f'<td class="path">{_e(e.path)}</td><td>{_e(e.module_type)}</td>'
                f'<td class="mono">{_e(_io_text(e.inputs, device=device is None))}</td>'
                f'<td class="mono">{_e(_io_text(e.outputs, device=device is None))}</td></tr>'
            )
        out.append(
            f'<h3>{_e(title)}</h3><table><thead><tr><th class="num">#</th><th>phase</th>'
            "<th>module</th><th>type</th><th>inputs</th><th>outputs</th></tr></thead>"
            f"<tbody>{''.join(rows_html)}</tbody></table>"
        )
    tb = err.get("traceback")
    if tb:
        out.append(
            "<details><summary>Traceback</summary>"
            f"<pre>{_e(chr(10).join(str(x) for x in tb))}</pre></details>"
        )
    out.append("</section>")
    return "".join(out)


def _html_diagnoses(report: Report) -> str:
    cards: list[str] = []
    sites = _call_sites(report)
    for d in report.diagnoses:
        steps = report.steps_of(d)
        label, evidence = _diagnosis_lines(d, sites)
        head = (
            f'<span class="sev {_e(d.severity)}">{_e(d.severity)}</span>'
            f'<span class="dcode">{_e(d.code)}</span><b>{_e(d.title)}</b>'
        )
        where = d.where + (f" · in {steps} steps" if steps > 1 else "")
        if where:
            head += f' <span class="where">({_e(where)})</span>'
        rows: list[tuple[str, str]] = []
        if evidence:
            items = "".join(f"<li>{_e(x)}</li>" for x in evidence)
            rows.append(("evidence", f'<ul style="margin:0;padding-left:1.2em">{items}</ul>'))
        if d.source:
            rows.append((label, f"<code>{_e(d.source)}</code>"))
        if d.explanation:
            rows.append(("why", _e(d.explanation)))
        if d.fix:
            rows.append(("fix", f'<pre class="fix">{_e(d.fix)}</pre>'))
        rows.append(("silence", f"<code>{_e(d.silence)}</code>"))
        cards.append(
            f'<div class="card diagnosis" data-code="{_e(d.code)}">'
            f"{head}{_kv(rows, raw=True)}</div>"
        )
    return f'<section id="diagnoses"><h2>Diagnoses ({len(cards)})</h2>{"".join(cards)}</section>'


def _html_where(report: Report) -> str:
    a = report.first_anomaly
    rows, phase = tree_rows(report)
    if a is None and not rows:
        return ""
    out = [
        '<section id="where"><h2>'
        + ("Where it went wrong" if a is not None else "Where it was")
        + "</h2>"
    ]
    if a is not None:
        out.append(f'<p><span class="muted">step {a.step}:</span> {_e(a.summary)}</p>')
        if a.op is not None:
            for ev in a.op.chain():
                kv: list[tuple[str, str]] = [
                    (
                        "op",
                        f'<code>{_e(ev.op)}</code> created <b class="nan">{_e(ev.born)}</b>'
                        + (f" in {_e(ev.dtype)}" if ev.dtype else "")
                        + (f' in <span class="path">{_e(ev.path)}</span>' if ev.path else "")
                        + (
                            f' <span class="muted">(backward node {_e(_node_words(ev.node))})'
                            "</span>"
                            if ev.node
                            else ""
                        ),
                    )
                ]
                if ev.source:
                    code = f"<pre>{_e(ev.code)}</pre>" if ev.code else ""
                    label = _CALLED_AT if _call_site(ev) else "line"
                    kv.append((label, f"<code>{_e(ev.source)}</code>{code}"))
                if ev.backward_at and ev.backward_at != ev.source:
                    kv.append((_CALLED_AT, f"<code>{_e(ev.backward_at)}</code>"))
                kv.extend((f"input {role}", _e(_stat_text(s))) for role, s in ev.inputs)
                if ev.scalars:
                    kv.append(
                        (
                            "arguments",
                            _e(", ".join(f"{k}={_scalar(v)}" for k, v in ev.scalars.items())),
                        )
                    )
                kv.append(("output", _e(_stat_text(ev.output, ev.born))))
                out.append(f'<div class="card op">{_kv(kv, raw=True)}</div>')
        neginf = _neginf_line(a)
        if neginf is not None:
            out.append(f'<p class="muted">{_e(neginf)}</p>')
        also = _also_born(report, a)
        if also is not None:
            out.append(f'<p class="muted">{_e(also)}</p>')
        if report.step(a.step) is None:
            out.append(
                f'<p class="muted">Step {a.step} is no longer in the flight recorder '
                f"(ring_size={_e(report.config.get('ring_size', '?'))}).</p>"
            )
        if len(report.anomalies) > 1:
            items = "".join(f"<li>{_e(anomaly_headline(x))}</li>" for x in report.anomalies[1:10])
            more = report.anomaly_count - min(10, len(report.anomalies))
            extra = f"<li>… {more} more</li>" if more > 0 else ""
            out.append(
                f"<details><summary>Later anomalies</summary><ul>{items}{extra}</ul></details>"
            )
    if rows:
        what = "gradients of the outputs" if phase == "backward" else "outputs"
        body: list[str] = []
        for r in rows:
            guide = f'<span class="guide">{_e(r.guide)}</span>'
            if r.stat is None:
                body.append(
                    f'<tr><td colspan="8">{guide}<span class="muted">{_e(r.name)}</span></td></tr>'
                )
                continue
            s = r.stat
            cls = ' class="culprit"' if r.culprit else (' class="bad"' if s.bad else "")
            mark = " ◀" if r.culprit else ""
            nan_cls = " nan" if s.nan != 0 else ""
            inf_cls = " inf" if s.inf != 0 and not s.bound else ""
            body.append(
                f'<tr{cls}><td>{guide}<span class="path">{_e(r.name)}</span>{mark}</td>'
                f"<td>{_e(r.module_type)}</td><td>{_e(s.dtype)}</td><td>{_e(s.device)}</td>"
                f'<td class="mono">{_e(s.shape)}</td>'
                f'<td class="num">{_e(s.amax_text)}</td>'
                f'<td class="num{nan_cls}">{_e(s.nan_text)}</td>'
                f'<td class="num{inf_cls}">{_e(s.inf_text)}</td></tr>'
            )
        out.append(
            f'<h3>The module and its ancestors ({what})</h3><table class="tree"><thead><tr>'
            "<th>module</th><th>type</th><th>dtype</th><th>device</th><th>shape</th>"
            f'<th class="num">{"max |grad|" if phase == "backward" else "max |x|"}</th>'
            '<th class="num">NaN</th><th class="num">inf</th>'
            f"</tr></thead><tbody>{''.join(body)}</tbody></table>"
        )
    out.append("</section>")
    return "".join(out)


def _html_timeline(report: Report) -> str:
    out = ['<section id="timeline"><h2>How the values moved</h2>']
    out.append(_html_plots(report))
    steps = report.steps[-_MAX_HTML_TIMELINE:]
    cut = len(report.steps) - len(steps)
    scaled = any(t.scale is not None for t in steps)
    rows: list[str] = []
    for s in steps:
        bad = s.anomaly is not None or s.error is not None
        cells = [
            f'<td class="num">{s.step}</td>',
            _html_num(fmt(s.loss)),
            _html_num(fmt(s.grad_norm)),
            _html_num(logit_cell(s)),
        ]
        if scaled:
            cells.append(_html_num(fmt(s.scale)))
        cells.append(f"<td>{_e(_step_note(s, report))}</td>")
        row_cls = ' class="bad"' if bad else ""
        rows.append(f"<tr{row_cls}>{''.join(cells)}</tr>")
    head = (
        '<th class="num">step</th><th class="num">loss</th><th class="num">grad norm</th>'
        '<th class="num">max |logit|</th>'
        + ('<th class="num">scale</th>' if scaled else "")
        + "<th></th>"
    )
    out.append(
        "<h3>Steps in the flight recorder</h3>"
        f'<table class="timeline"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>"
    )
    if cut:
        out.append(f'<p class="muted">{cut} earlier steps left out; all are in the JSON.</p>')
    out.append("</section>")
    return "".join(out)


def _html_num(s: str) -> str:
    cls = " nan" if "NaN" in s else (" inf" if "inf" in s else "")
    return f'<td class="num{cls}">{_e(s)}</td>'


def _html_environment(report: Report) -> str:
    out = ['<section id="environment"><h2>Environment</h2>', _kv(environment_rows(report))]
    if report.faults:
        items = "".join(f"<li>{_e(w)}: {_e(m)}</li>" for w, m in report.faults)
        out.append(f"<h3>nanwatch faults</h3><ul>{items}</ul>")
    if report.config:
        cfg = ", ".join(f"{k}={v!r}" for k, v in report.config.items())
        out.append(f'<p class="muted">config: <code>{_e(cfg)}</code></p>')
    out.append("</section>")
    return "".join(out)


# ---------------------------------------------------------------------- plots
PLOT_INSTALL = 'pip install "nanwatch[plot]"'


@dataclass(slots=True)
class HeatmapData:
    """max |x| per module (rows) and step (columns); ``flags`` marks non-finite cells."""

    steps: list[int]
    rows: list[str]
    values: list[list[float | None]]
    flags: list[list[str]]
    #: True where the value is within a factor of 2 of its own dtype's largest value
    near: list[list[bool]]
    total_rows: int
    limit_dtype: str | None
    limit: float | None


def heatmap_data(report: Report, max_rows: int = _MAX_HEATMAP_ROWS) -> HeatmapData:
    """The numbers behind the heatmap: for each measured module output (and measured input)
    its max |x| in each recorded step; the dtype limit is that of the lowest-precision
    floating dtype seen, when it is a low-precision one."""
    steps = [t.step for t in report.steps]
    order: dict[str, int] = {}
    cells: dict[tuple[str, int], tuple[float | None, str]] = {}
    near: set[tuple[str, int]] = set()
    limits = report.environment.dtype_limits
    for j, t in enumerate(report.steps):
        for r in t.records:
            if r.phase not in (Phase.FORWARD, Phase.INPUT) or r.stat is None:
                continue
            key = r.path if r.phase is Phase.FORWARD else f"{r.path} (input)"
            if key not in order:
                order[key] = len(order)
            s = r.stat
            mag = s.magnitude
            v: float | None = None if math.isnan(mag) else mag
            flag = "" if s.finite else ("NaN" if s.has_nan else "inf")
            lim = limits.get(r.dtype)
            if v is not None and lim is not None and v >= lim / 2:
                near.add((key, j))
            old = cells.get((key, j))
            if old is not None:
                ov, of = old
                v = ov if v is None else (v if ov is None else max(v, ov))
                flag = of or flag
            cells[(key, j)] = (v, flag)
    names = sorted(order, key=order.__getitem__)
    limit_dtype: str | None = None
    limit: float | None = None
    env = report.environment
    if env.amp_dtypes:
        limit_dtype = min(env.amp_dtypes, key=lambda d: env.dtype_limits.get(d, math.inf))
        limit = env.dtype_limits.get(limit_dtype)
    if len(names) > max_rows:

        def score(name: str) -> tuple[int, float]:
            vals = [cells.get((name, j), (None, "")) for j in range(len(steps))]
            bad = any(f for _, f in vals)
            top = max((v for v, _ in vals if v is not None), default=0.0)
            return (0 if bad else 1, -top)

        keep = set(sorted(names, key=score)[:max_rows])
        names = [n for n in names if n in keep]
    values = [[cells.get((n, j), (None, ""))[0] for j in range(len(steps))] for n in names]
    flags = [[cells.get((n, j), (None, ""))[1] for j in range(len(steps))] for n in names]
    close = [[(n, j) in near for j in range(len(steps))] for n in names]
    return HeatmapData(steps, names, values, flags, close, len(order), limit_dtype, limit)


def _matplotlib() -> Any:
    """matplotlib's Figure class, or None when the ``plot`` extra is not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure


def _html_plots(report: Report) -> str:
    figure_cls = _matplotlib()
    if figure_cls is None:
        return (
            '<p class="missing" id="plots-missing">Plots of the trends and the heatmap of '
            f"max |x| need matplotlib: <code>{_e(PLOT_INSTALL)}</code></p>"
        )
    out: list[str] = []
    for name, draw in (("trends", _trend_figure), ("heatmap", _heatmap_figure)):
        try:
            fig_html = draw(report, figure_cls)
        except Exception as exc:
            fig_html = (
                f'<p class="missing">The {name} plot could not be drawn '
                f"({_e(type(exc).__name__)}: {_e(exc)}).</p>"
            )
        out.append(fig_html)
    return "".join(out)


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _svg(fig: Any) -> str:
    import matplotlib

    buf = io.BytesIO()
    with matplotlib.rc_context({"svg.hashsalt": "nanwatch"}):  # the same report, the same page
        fig.savefig(buf, format="svg", metadata={"Date": None})
    return "data:image/svg+xml;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _figure_html(fig_id: str, src: str, alt: str, caption: str) -> str:
    return (
        f'<figure id="{fig_id}"><img src="{src}" alt="{_e(alt)}">'
        f"<figcaption>{_e(caption)}</figcaption></figure>"
    )


def _series(values: Sequence[float | None]) -> tuple[list[float], list[bool]]:
    ys: list[float] = []
    bad: list[bool] = []
    for v in values:
        if v is None:
            ys.append(math.nan)
            bad.append(False)
        elif not math.isfinite(v):
            ys.append(math.nan)
            bad.append(True)
        else:
            ys.append(v)
            bad.append(False)
    return ys, bad


def _trend_figure(report: Report, figure_cls: Any) -> str:
    from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter

    steps = report.steps
    if len(steps) < 2:
        return '<p class="muted">One recorded step: no trend to draw yet.</p>'
    xs = [t.step for t in steps]
    logits: list[float | None] = []
    for t in steps:
        if t.max_logit is not None:
            logits.append(t.max_logit)
        else:
            st = module_stat(_first_root_records(t), t)
            logits.append(math.nan if st.bad else None)
    series = [
        ("loss", [t.loss for t in steps], False),
        ("total gradient norm", [t.grad_norm for t in steps], True),
        ("max |logit|", logits, True),
    ]
    fig = figure_cls(figsize=(9.5, 6.2), layout="constrained")
    axes = fig.subplots(3, 1, sharex=True)
    anomaly_steps = [t.step for t in steps if t.anomaly is not None]
    logit_dtype = next((r.dtype for t in reversed(steps) for r in _first_root_records(t)), None)
    for ax, (label, values, log) in zip(axes, series, strict=True):
        ys, bad = _series(values)
        ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.4, color="#1f5fbf")
        finite = [y for y in ys if not math.isnan(y)]
        if log and finite and min(finite) > 0 and max(finite) > 20 * min(finite):
            ax.set_yscale("log")
            # plain tick labels: the default ones go through mathtext, 10x slower to lay out
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        top = max(finite) if finite else 1.0
        bx = [x for x, b in zip(xs, bad, strict=True) if b]
        if bx:
            ax.plot(
                bx,
                [top] * len(bx),
                linestyle="none",
                marker="x",
                color="#c62828",
                markersize=7,
                label="NaN / inf",
            )
        for s in anomaly_steps:
            ax.axvline(s, color="#c62828", linestyle=":", linewidth=1)
        if label == "max |logit|" and logit_dtype in report.environment.amp_dtypes:
            lim = report.environment.dtype_limits.get(logit_dtype)
            if lim:
                ax.axhline(
                    math.log(lim),
                    color="#b26a00",
                    linestyle="--",
                    linewidth=1,
                    label=f"exp overflows above {math.log(lim):.2f} ({logit_dtype})",
                )
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_title(
        "Trends over the recorded steps (dotted red: steps with an anomaly)",
        fontsize=10,
        loc="left",
    )
    return _figure_html(
        "trends",
        _svg(fig),
        "loss, gradient norm and logit magnitude per step",
        "Loss, total gradient norm and max |logit| per recorded step; × marks a NaN or inf.",
    )


def _heatmap_figure(report: Report, figure_cls: Any) -> str:
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Rectangle

    data = heatmap_data(report)
    if not data.rows or not data.steps:
        return '<p class="muted">No measured module outputs to draw a heatmap of.</p>'
    nrows, ncols = len(data.rows), len(data.steps)
    vals = np.full((nrows, ncols), np.nan)
    for i, row in enumerate(data.values):
        for j, v in enumerate(row):
            if v is not None:
                vals[i, j] = math.log10(max(v, 1e-30))
    finite = vals[~np.isnan(vals)]
    vmin = float(finite.min()) if finite.size else 0.0
    vmax = float(finite.max()) if finite.size else 1.0
    limit_log = math.log10(data.limit) if data.limit else None
    if limit_log is not None:
        vmax = max(vmax, limit_log + 0.25)  # the limit's line inside the color bar
    if vmax - vmin < 1e-6:
        vmax = vmin + 1.0
    height = min(0.32 * nrows + 1.6, 14.0)
    width = min(max(6.5, 0.22 * ncols + 4.5), 13.0)
    fig = figure_cls(figsize=(width, height), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(
        np.ma.masked_invalid(vals),
        aspect="auto",
        cmap="viridis",
        vmin=vmin,
        vmax=vmax,
        interpolation="nearest",
    )
    bad = np.array([[1.0 if f else np.nan for f in flags] for flags in data.flags])
    ax.imshow(
        np.ma.masked_invalid(bad),
        aspect="auto",
        cmap=ListedColormap(["#d81b60"]),
        interpolation="nearest",
    )
    for i, near_row in enumerate(data.near):
        for j, close in enumerate(near_row):
            if close:
                ax.add_patch(
                    Rectangle(
                        (j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="#ff6f00", linewidth=1.8
                    )
                )
    if ncols * nrows <= 900:
        for i, flag_row in enumerate(data.flags):
            for j, f in enumerate(flag_row):
                if f:
                    ax.text(j, i, "×", ha="center", va="center", color="white", fontsize=8)
    ax.set_yticks(range(nrows))
    ax.set_yticklabels([_short_path(n) for n in data.rows], fontsize=8)
    step_ticks = list(range(ncols))
    if ncols > 25:
        stride = math.ceil(ncols / 25)
        step_ticks = step_ticks[::stride]
    ax.set_xticks(step_ticks)
    ax.set_xticklabels([str(data.steps[j]) for j in step_ticks], fontsize=8)
    ax.set_xlabel("step")
    cbar = fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02)
    cbar.set_label("log10 max |x|")
    if limit_log is not None:
        cbar.ax.axhline(limit_log, color="#d81b60", linewidth=2)
        cbar.ax.axhline(limit_log - math.log10(2), color="#ff6f00", linewidth=1, linestyle="--")
    title = "max |x| per module and step"
    if data.limit:
        title += f"; {data.limit_dtype} limit {fmt(data.limit)} (pink line), half of it (orange)"
    ax.set_title(title, fontsize=10, loc="left")
    shown = f"{nrows} of {data.total_rows}" if data.total_rows > nrows else f"all {nrows}"
    caption = (
        f"max |x| of {shown} measured module outputs per recorded step (log scale); "
        "pink × cells hold NaN or inf; orange frames: within a factor of 2 of the largest "
        "value of the tensor's dtype."
    )
    if data.limit:
        caption += (
            f" The {data.limit_dtype} limit {fmt(data.limit)} is the pink line on the color "
            "bar, half of it the orange one."
        )
    if data.total_rows > nrows:
        caption += " Rows left out are the smallest, all finite."
    return _figure_html("heatmap", _png(fig), "heatmap of max |x| per module and step", caption)


def _short_path(p: str, limit: int = 42) -> str:
    return p if len(p) <= limit else "…" + p[-(limit - 1) :]
