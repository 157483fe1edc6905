"""The data model: plain data, no torch, so a saved report loads and renders anywhere.

A *record* is one tensor seen at one moment: a module's output in forward, the gradient of
that output in backward, an input of a module, a parameter or a parameter's gradient.
Records of a step are kept in execution order (``index``); a *call* is one invocation of a
module, and groups the records it produced. The flight recorder keeps the last N steps.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

#: the path of a loss computed by code outside any module (seen when backward() is called).
LOSS_PATH = "(loss)"


class Phase(str, enum.Enum):
    """When a tensor was seen."""

    INPUT = "input"  #: an input of a module (of a root: the batch)
    FORWARD = "forward"  #: a module's output
    BACKWARD = "backward"  #: the gradient of a module's output
    GRADIENT = "gradient"  #: a parameter's gradient, after backward
    PARAMETER = "parameter"  #: a parameter's value

    def __str__(self) -> str:
        return self.value


@dataclass(slots=True)
class TensorStat:
    """Statistics of one tensor. ``min``/``max`` come from one fused pass (NaN propagates
    through them); the counts are filled only for tensors known to be bad, or in forensic
    mode, and are ``None`` otherwise."""

    min: float
    max: float
    numel: int
    nan: int | None = None
    posinf: int | None = None
    neginf: int | None = None
    zeros: int | None = None
    #: values with |x| >= finfo.max / 2 (finite): the overflow headroom is gone.
    near_max: int | None = None
    #: max |x| over the finite values only.
    finite_amax: float | None = None
    #: indices along dim 0 (samples of a batch) holding a non-finite value (first few).
    bad_rows: tuple[int, ...] | None = None
    bad_row_count: int | None = None
    #: L2 norm, for parameters and gradients (their min/max are then -norm/+norm, an upper
    #: bound of |x|, until counted).
    norm: float | None = None
    #: for a 2-D batch (rows of features): the columns holding a non-finite value (first
    #: few) and how many do (a missing-value column, a zero-std standardization).
    bad_cols: tuple[int, ...] | None = None
    bad_col_count: int | None = None
    #: NaN and inf values together, where they were not counted apart: a batch read after
    #: its calls (the accelerator path) and freed before it could be described, whose
    #: per-sample counts of non-finite values were kept.
    nonfinite: int | None = None

    def __post_init__(self) -> None:
        # An empty tensor reads min 0 and max 0; numel 0 with a NaN min or max is a
        # placeholder for a tensor whose values were never read (the output of an op whose
        # operands autograd did not save): zero counts there would claim "0 NaN of 0".
        if self.numel == 0 and (math.isnan(self.min) or math.isnan(self.max)):
            self.nan = self.posinf = self.neginf = self.zeros = self.near_max = None

    @property
    def placeholder(self) -> bool:
        """True when no value of the tensor was read (its size unknown, nothing counted)."""
        return self.numel == 0 and (math.isnan(self.min) or math.isnan(self.max))

    @property
    def counted(self) -> bool:
        return self.nan is not None

    @property
    def has_nan(self) -> bool:
        if self.nan is not None:
            return self.nan > 0
        return math.isnan(self.min) or math.isnan(self.max)

    @property
    def has_posinf(self) -> bool:
        if self.posinf is not None:
            return self.posinf > 0
        return self.max == math.inf

    @property
    def has_neginf(self) -> bool:
        if self.neginf is not None:
            return self.neginf > 0
        return self.min == -math.inf

    @property
    def bad_values(self) -> int | None:
        """How many values are NaN or inf, when known (counted, or :attr:`nonfinite`)."""
        if self.nan is not None:
            return self.nan + (self.posinf or 0) + (self.neginf or 0)
        return self.nonfinite

    @property
    def finite(self) -> bool:
        return (
            math.isfinite(self.min)
            and math.isfinite(self.max)
            and not (self.nan or self.posinf or self.neginf)
        )

    @property
    def only_neginf(self) -> bool:
        """Non-finite only through -inf: the signature of masking (and of log(0))."""
        return self.has_neginf and not self.has_nan and not self.has_posinf

    @property
    def amax(self) -> float:
        """max |x|; NaN when the tensor holds a NaN, inf when it holds an inf."""
        if self.has_nan:
            return math.nan
        return max(abs(self.min), abs(self.max))

    @property
    def magnitude(self) -> float:
        """max |x| over finite values when known, else max |x| (for trends and heatmaps)."""
        if self.finite_amax is not None:
            return self.finite_amax
        a = self.amax
        return a if math.isfinite(a) else math.nan

    def kinds(self) -> str:
        """'NaN', '+inf', '-inf' joined, or 'finite'."""
        parts = [
            name
            for name, present in (
                ("NaN", self.has_nan),
                ("+inf", self.has_posinf),
                ("-inf", self.has_neginf),
            )
            if present
        ]
        return ", ".join(parts) if parts else "finite"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"min": _num(self.min), "max": _num(self.max), "numel": self.numel}
        for name in (
            "nan", "posinf", "neginf", "zeros", "near_max", "bad_row_count", "bad_col_count",
            "nonfinite",
        ):  # fmt: skip
            v = getattr(self, name)
            if v is not None:
                d[name] = v
        if self.finite_amax is not None:
            d["finite_amax"] = _num(self.finite_amax)
        if self.norm is not None:
            d["norm"] = _num(self.norm)
        if self.bad_rows is not None:
            d["bad_rows"] = list(self.bad_rows)
        if self.bad_cols is not None:
            d["bad_cols"] = list(self.bad_cols)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorStat:
        rows = d.get("bad_rows")
        fa = d.get("finite_amax")
        norm = d.get("norm")
        return cls(
            min=_unnum(d["min"]),
            max=_unnum(d["max"]),
            numel=int(d["numel"]),
            nan=d.get("nan"),
            posinf=d.get("posinf"),
            neginf=d.get("neginf"),
            zeros=d.get("zeros"),
            near_max=d.get("near_max"),
            finite_amax=None if fa is None else _unnum(fa),
            bad_rows=None if rows is None else tuple(rows),
            bad_row_count=d.get("bad_row_count"),
            norm=None if norm is None else _unnum(norm),
            bad_cols=None if d.get("bad_cols") is None else tuple(d["bad_cols"]),
            bad_col_count=d.get("bad_col_count"),
            nonfinite=d.get("nonfinite"),
        )


@dataclass(slots=True, eq=False)
class Record:
    """One tensor seen at one moment of a step."""

    index: int  #: position in the step's execution order
    step: int
    phase: Phase
    path: str  #: module path (``encoder.layers.3.attn``), or a parameter's qualified name
    role: str  #: which tensor of the call: ``output``, ``output[1]``, ``input[0]``, ``weight``
    dtype: str  #: ``float16``, ``int64``, ...
    device: str  #: ``cpu``, ``cuda:0``
    shape: tuple[int, ...]
    stat: TensorStat | None = None  #: None for non-floating tensors and unchecked aliases
    call: int = -1  #: the module call that produced it (see ``StepTrace.calls``)
    #: the record holding the same tensor: for an input, the output it came from; for a
    #: gradient, the forward record it is the gradient of; for an alias, the original.
    source: int | None = None
    module_type: str = ""
    grad_fn: str | None = None  #: autograd node of an output (``SigmoidBackward0``)
    version: int | None = None  #: the tensor's version counter when it was recorded
    #: a gradient (``BACKWARD``) computed by ``torch.autograd.grad`` (an input saliency, a
    #: gradient penalty, an attack), not by the training ``backward()``
    by_grad: bool = False
    #: its place among the records of every watcher of the process, in the order they were
    #: made (host-side, not saved): nested watchers that read late are ordered by it
    seq: int = field(default=-1, repr=False)

    @property
    def bad(self) -> bool:
        return self.stat is not None and not self.stat.finite

    @property
    def where(self) -> str:
        return f"{self.path} ({self.phase.value}, {self.role})"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "index": self.index,
            "step": self.step,
            "phase": self.phase.value,
            "path": self.path,
            "role": self.role,
            "dtype": self.dtype,
            "device": self.device,
            "shape": list(self.shape),
            "call": self.call,
        }
        if self.stat is not None:
            d["stat"] = self.stat.to_dict()
        for name in ("source", "grad_fn", "version"):
            v = getattr(self, name)
            if v is not None:
                d[name] = v
        if self.module_type:
            d["module_type"] = self.module_type
        if self.by_grad:
            d["by_grad"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        stat = d.get("stat")
        return cls(
            index=int(d["index"]),
            step=int(d["step"]),
            phase=Phase(d["phase"]),
            path=d["path"],
            role=d["role"],
            dtype=d["dtype"],
            device=d["device"],
            shape=tuple(d["shape"]),
            stat=None if stat is None else TensorStat.from_dict(stat),
            call=int(d.get("call", -1)),
            source=d.get("source"),
            module_type=d.get("module_type", ""),
            grad_fn=d.get("grad_fn"),
            version=d.get("version"),
            by_grad=bool(d.get("by_grad", False)),
        )


@dataclass(slots=True, eq=False)
class Call:
    """One invocation of a module within a step."""

    id: int
    path: str
    module_type: str
    parent: int | None  #: the enclosing call (None for a root's call)
    start: int  #: index of the first record at or after the call began
    end: int = -1  #: index after the last record of the call; -1 while running
    #: the module cannot have created a non-finite value from finite inputs in this call
    #: (ReLU, reshapes, max pools; norms, dropout, smooth activations in float32): its
    #: outputs are not measured, and localization looks through it to its input's record.
    passthrough: bool = False
    is_loss: bool = False
    root: bool = False
    #: the module computes its outputs as sums of products of its inputs and weights
    #: (Linear, Conv, RNN): a -inf in its output is an overflow, never a mask
    arithmetic: bool = False
    #: its arguments were tensors alone, each recorded (no keywords, no Python values, no
    #: mask nanwatch does not record): the records rebuild the call exactly for a replay
    rebuildable: bool = False

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.id,
            "path": self.path,
            "module_type": self.module_type,
            "parent": self.parent,
            "start": self.start,
            "end": self.end,
        }
        for name in ("passthrough", "is_loss", "root", "arithmetic"):
            if getattr(self, name):
                d[name] = True
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Call:
        return cls(
            id=int(d["id"]),
            path=d["path"],
            module_type=d.get("module_type", ""),
            parent=d.get("parent"),
            start=int(d.get("start", 0)),
            end=int(d.get("end", -1)),
            passthrough=bool(d.get("passthrough", False)),
            is_loss=bool(d.get("is_loss", False)),
            root=bool(d.get("root", False)),
            arithmetic=bool(d.get("arithmetic", False)),
        )


#: ``OpEvent.scalars`` key prefix, ``difference_of:<input name>``: that input of the op was
#: the result of a forward subtraction of two tensors, and the value is the largest
#: magnitude among its operands (``E[x²] - E[x]²`` of values near 1000: about 1e6, whose
#: float32 rounding step is 0.06, so the "variance" is noise of that size, of either sign)
DIFFERENCE_OF = "difference_of"


@dataclass(slots=True, eq=False)
class OpEvent:
    """An aten op that produced a non-finite value its inputs did not hold."""

    op: str  #: ``aten.div.Tensor``
    phase: Phase  #: forward or backward
    path: str | None  #: the module whose code ran the op (None when unknown)
    born: str  #: what it created: ``NaN``, ``+inf``, ``-inf`` (comma-joined)
    output: TensorStat
    inputs: list[tuple[str, TensorStat | None]] = field(default_factory=list)
    #: scalar arguments that matter (``value=-inf`` of masked_fill, ``exponent=0.5``).
    scalars: dict[str, float | int | str] = field(default_factory=dict)
    source: str | None = None  #: the user's line, ``file.py:42``
    code: str | None = None  #: the text of that line
    node: str | None = None  #: autograd node in backward (``SqrtBackward0``)
    dtype: str = ""
    #: the earlier op event that produced the non-finite input this op consumed.
    cause: OpEvent | None = None
    #: True when the non-finite value came from a constant argument (masked_fill(-inf)).
    injected: bool = False
    #: backward ops: the ``backward()`` call that ran them (``train.py:57``); ``source`` is
    #: the forward line that created their autograd node.
    backward_at: str | None = None
    #: backward ops: ``backward_at`` is a ``torch.autograd.grad`` call, not ``backward()``
    by_grad: bool = False
    #: the device the op ran on (``cpu``, ``cuda:0``); empty when unknown.
    device: str = ""
    #: tensor arguments that ``inputs`` leaves out, by schema name: integer and bool ones (a
    #: target, an index: min, max and numel only) and empty ones (numel 0: a mean over
    #: nothing).
    other_inputs: list[tuple[str, TensorStat]] = field(default_factory=list)
    #: every output of an op that returns several, by schema name (nll_loss's ``output`` and
    #: ``total_weight``); empty for single-output ops (``output`` holds it).
    outputs: list[tuple[str, TensorStat]] = field(default_factory=list)
    #: events read from a loss's autograd graph: the ops that made its first input, nearest
    #: first, lower-case (``["rsub"]``), ending at a watched module's output as
    #: ``"watched:sigmoid"`` (the op that made that output); empty when not read.
    made_from: list[str] = field(default_factory=list)
    #: whether each operand of the op that made the first input (``made_from[0]``) has an
    #: autograd history (requires grad, or a ``grad_fn``), read from the graph when the
    #: event is made: ``exp(a - b)`` with ``b`` computed under no_grad or detached gives
    #: ``[True, False]``; empty when not read
    made_from_history: list[bool] = field(default_factory=list)
    #: the inputs that are watched parameters, read by identity: (schema name, qualified
    #: name, type of the module that holds it), ``("other", "scales.1", "ParameterList")``
    params: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def at(self) -> str:
        """Where the op ran, in words: ``at train.py:42`` (forward); ``in the backward of
        train.py:42`` (a backward op of the node that line created); ``in SqrtBackward0,
        backward() at train.py:57`` (the node's forward line unknown); "" when nothing is."""
        if self.phase is Phase.BACKWARD and self.source:
            if self.backward_at and self.backward_at == self.source:
                return f"in {self.node or 'backward'}, {self.backward_call} at {self.source}"
            return f"in the backward of {self.source}"
        return f"at {self.source}" if self.source else ""

    @property
    def backward_call(self) -> str:
        """The call that ran a backward op, as the user wrote it: ``backward()``, or
        ``autograd.grad()`` for a loop that takes its gradients with it."""
        return "autograd.grad()" if self.by_grad else "backward()"

    def chain(self) -> list[OpEvent]:
        """This event and its causes, oldest first."""
        out: list[OpEvent] = []
        ev: OpEvent | None = self
        while ev is not None and ev not in out:
            out.append(ev)
            ev = ev.cause
        return out[::-1]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "op": self.op,
            "phase": self.phase.value,
            "path": self.path,
            "born": self.born,
            "output": self.output.to_dict(),
            "inputs": [[r, None if s is None else s.to_dict()] for r, s in self.inputs],
            "scalars": {k: _num(v) if isinstance(v, float) else v for k, v in self.scalars.items()},
            "source": self.source,
            "code": None if self.code is None else str(self.code),  # a CodeLine: plain
            "node": self.node,
            "dtype": self.dtype,
            "cause": None if self.cause is None else self.cause.to_dict(),
            "injected": self.injected,
            "backward_at": self.backward_at,
        }
        if self.device:
            d["device"] = self.device
        if self.by_grad:
            d["by_grad"] = True
        if self.other_inputs:
            d["other_inputs"] = [[r, s.to_dict()] for r, s in self.other_inputs]
        if self.outputs:
            d["outputs"] = [[r, s.to_dict()] for r, s in self.outputs]
        if self.made_from:
            d["made_from"] = list(self.made_from)
        if self.made_from_history:
            d["made_from_history"] = list(self.made_from_history)
        if self.params:
            d["params"] = [list(p) for p in self.params]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OpEvent:
        return cls(
            op=d["op"],
            phase=Phase(d["phase"]),
            path=d.get("path"),
            born=d.get("born", ""),
            output=TensorStat.from_dict(d["output"]),
            inputs=[(r, None if s is None else TensorStat.from_dict(s)) for r, s in d["inputs"]],
            scalars={
                k: _unnum(v) if isinstance(v, (int, float)) or v in _SPECIAL else v
                for k, v in d.get("scalars", {}).items()
            },
            source=d.get("source"),
            code=d.get("code"),
            node=d.get("node"),
            dtype=d.get("dtype", ""),
            cause=None if d.get("cause") is None else OpEvent.from_dict(d["cause"]),
            injected=bool(d.get("injected", False)),
            backward_at=d.get("backward_at"),
            by_grad=bool(d.get("by_grad", False)),
            device=d.get("device", ""),
            other_inputs=[(r, TensorStat.from_dict(s)) for r, s in d.get("other_inputs", [])],
            outputs=[(r, TensorStat.from_dict(s)) for r, s in d.get("outputs", [])],
            made_from=[str(m) for m in d.get("made_from", [])],
            made_from_history=[bool(h) for h in d.get("made_from_history", [])],
            params=[(str(r), str(q), str(t)) for r, q, t in d.get("params", [])],
        )


class AnomalyKind(str, enum.Enum):
    """Where the first non-finite value was born."""

    INPUT = "input"  #: bad data: the batch itself held it
    FORWARD = "forward"  #: a module's forward computation
    BACKWARD = "backward"  #: a module's backward computation
    GRADIENT = "gradient"  #: a parameter's gradient
    PARAMETER = "parameter"  #: a weight, made non-finite by an update

    def __str__(self) -> str:
        return self.value


@dataclass(slots=True, eq=False)
class Anomaly:
    """The first place a value went bad in a step, and what it took with it."""

    step: int
    kind: AnomalyKind
    path: str  #: the producer: module path, or the parameter's qualified name
    record: Record  #: the first bad record, the evidence
    #: ``"module"``: the module's own code; ``"between-children"``: functional code in the
    #: module's forward between its children; ``"data"``, ``"parameter"``, ``"gradient"``;
    #: ``"computed-target"``: a loss target the user's code computed this step (a teacher).
    origin: str
    summary: str  #: one line a person can act on
    propagators: list[str] = field(default_factory=list)  #: modules that merely passed it on
    propagator_count: int = 0
    op: OpEvent | None = None  #: the aten op, when pinpointed
    #: the record where a -inf that this NaN/inf grew out of was first seen (log(0), a mask).
    neginf_source: Record | None = None
    #: for a backward anomaly: the module whose output gradient was still finite.
    consumer: str | None = None
    parameter: str | None = None
    #: when a replay of the same computation ran clean: a transient (hardware, race) suspect.
    transient: bool | None = None
    #: the module's own buffers (``vq.inv_scale``) its forward wrote in place when a replay
    #: of it ran clean: the replay started from what it wrote, not what it read (NW405)
    state_written: list[str] = field(default_factory=list)
    #: the type of the module at ``path`` when that is not the record's: a module sentinel
    #: does not hook, inside the root whose output was measured, found by a replay (``RNN``)
    module_type: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "kind": self.kind.value,
            "path": self.path,
            "record": self.record.to_dict(),
            "origin": self.origin,
            "summary": self.summary,
            "propagators": list(self.propagators),
            "propagator_count": self.propagator_count,
            "op": None if self.op is None else self.op.to_dict(),
            "neginf_source": None if self.neginf_source is None else self.neginf_source.to_dict(),
            "consumer": self.consumer,
            "parameter": self.parameter,
            "transient": self.transient,
            **({"state_written": list(self.state_written)} if self.state_written else {}),
            **({"module_type": self.module_type} if self.module_type else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Anomaly:
        return cls(
            step=int(d["step"]),
            kind=AnomalyKind(d["kind"]),
            path=d["path"],
            record=Record.from_dict(d["record"]),
            origin=d["origin"],
            summary=d["summary"],
            propagators=list(d.get("propagators", [])),
            propagator_count=int(d.get("propagator_count", 0)),
            op=None if d.get("op") is None else OpEvent.from_dict(d["op"]),
            neginf_source=None
            if d.get("neginf_source") is None
            else Record.from_dict(d["neginf_source"]),
            consumer=d.get("consumer"),
            parameter=d.get("parameter"),
            transient=d.get("transient"),
            state_written=list(d.get("state_written", [])),
            module_type=d.get("module_type", ""),
        )


@dataclass(slots=True, eq=False)
class Note:
    """Evidence that is not a tensor statistic, written by the parts of nanwatch that see
    more than a module's outputs (the loss guards) and read by rules.

    ``kind`` names the fact; ``data`` holds plain numbers and strings. Kinds in use:

    * ``"loss_input"``: one per guarded loss call. ``data``: ``loss`` (class or function
      name), ``input_dtype``, ``input_grad_fn`` (autograd node of the input:
      ``SigmoidBackward0`` means it came out of a sigmoid), ``input_activation`` (the first
      node under the input that is not a view or copy), ``input_source`` (index of the
      record that produced the input, when a watched module did), ``input_upcast_from``
      (the input is a widening copy of a recorded tensor, ``logits.float()``: that tensor's
      dtype; ``input_source`` is then its record), ``input_widened_from`` and
      ``input_widened_dtype`` (the input was computed, op after op of one tensor each, from
      such a copy: ``logits.float() / T``; the record and dtype of the narrower tensor),
      ``input_view_of`` (the input is a view of a recorded tensor, ``logits.flatten(0,
      1)``: that tensor's record; its values, or a part of them), ``input_min``,
      ``input_max``, ``probability_rows`` (True when every row is in [0, 1] and sums to 1),
      ``exact_zeros``/``exact_ones`` (inputs of BCE-style losses), ``ignore_index``,
      ``ignored`` (count of targets equal to it), ``ignored_amax``/``valid_amax`` (max |x|
      of the input at ignored and at trained positions), ``reduction``, ``value_clamped``
      (BCE: elements whose log hit the -100 clamp), ``input_shape``, ``target_dtype``,
      ``target_shape``, ``target_min``/``target_max`` (class losses: over the positions that
      are not ignore_index; regression losses: the whole target, NaN when it holds NaN).
    * ``"guard"``: a guard stopped a loss; written just before the GuardError. ``data``:
      ``code``, ``check``, ``loss``, ``problem``, ``expected``, ``fix``, ``explanation``,
      ``values``/``counts`` (most frequent first), ``count``, ``total``, ``positions`` (the
      first few), ``source_line``.
    * ``"loss_graph"``: the loss was computed outside any module; ``data["ops"]`` lists the
      ops of its autograd graph (``["neg", "mean", "mul", "log"]``); ``data["logs"]`` what
      each log in it was taken of (``[["rsub", "watched:sigmoid"], ["watched:sigmoid"]]``,
      see :func:`nanwatch.ops.made_from`); ``data["selections"]`` the gathers that picked
      an infinity out of their source (:func:`nanwatch.ops.graph_selections`).
    * ``"zero_param"``: a watched parameter that holds exact zeros reaches a log of that
      graph through a product or a view (``gain * softplus(z)``, ``gain`` at 0), see
      :mod:`nanwatch._zero_params`; ``path`` is its module. ``data``: ``node``,
      ``parameter``, ``zeros``, ``numel``, ``via``, ``dtype``, ``optimizer``,
      ``written_after`` (its version moved on since that update), and where told
      ``write_source``/``write_code`` (the statement that wrote it), ``own_step``.
    * ``"weight_sum"``: the loss is +inf and its graph takes a full sum of a power, a
      self-product or an absolute value of a watched float16 parameter (a weight penalty
      written by hand, see :mod:`nanwatch._penalty`); ``path`` is its module. ``data``:
      ``parameter``, ``form``, ``exponent``, ``dtype``, ``numel``, ``largest``, ``value``
      (the sum, from the parameter's values). NW101 reads it.
    * ``"graph"``: written at a watched module's forward for an output of a short-range
      dtype (float16, float8) made by a product or quotient (``MulBackward0``,
      ``DivBackward0``); ``path`` is the module. ``data``: ``record`` (the output's record),
      ``nodes`` (:func:`nanwatch._graph.digest`: the autograd nodes below it, each with its
      result's dtype; [] when none of them is a reduction). NW115 reads it.
    * ``"optimizer"``: one per optimizer step of watched weights, written before the
      update; ``path`` is the optimizer's class. ``data["groups"]``: per parameter group,
      ``params`` (how many watched), ``dtypes``, ``lr`` and ``eps`` when they are numbers.
    * ``"step_marked"``: on a step with an anomaly that began at the user's ``step()``
      (the automatic step rule did not draw its boundary); no data.
    * ``"distributed"``: written by the Lightning callback on the step where an anomaly was
      acted on across ranks. ``data``: ``rank``, ``world_size``, ``ranks`` (those that saw
      it), ``first_ranks`` (those that saw it first), ``action``.
    * ``"inplace_lines"``: at autograd's in-place error, what a second run of the root's
      forward saw (see :mod:`nanwatch._inplace`). ``data``: ``made_by`` (the op),
      ``made_at`` and ``made_code`` (the user's line), ``made_in`` (the library module that
      ran the op, or None); ``written_by``, ``written_at``, ``written_code``, ``written_in``
      for the in-place write (None: the forward wrote nothing at the saved version),
      ``rewrite`` (that line made out of place, or None), ``matches`` (tensors of that node
      and shape the forward made).
    """

    kind: str
    path: str  #: module path of the loss, or the functional call (``F.cross_entropy``)
    data: dict[str, Any] = field(default_factory=dict)
    source: str | None = None  #: the user's line for functional calls

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "path": self.path,
            "data": {k: _num(v) if isinstance(v, float) else v for k, v in self.data.items()},
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Note:
        data = {
            k: _unnum(v) if isinstance(v, str) and v in _SPECIAL else v
            for k, v in d.get("data", {}).items()
        }
        return cls(kind=d["kind"], path=d["path"], data=data, source=d.get("source"))


@dataclass(slots=True, eq=False)
class StepTrace:
    """Everything recorded in one step, plus the figures of the step's timeline."""

    step: int
    records: list[Record] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    ops: list[OpEvent] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)
    #: sampled: every module was watched (``watch``/``forensic`` steps); False in sentinel.
    full: bool = True
    loss: float | None = None
    grad_norm: float | None = None  #: total L2 norm of the parameter gradients
    max_logit: float | None = None  #: max |x| over the first root's outputs
    scale: float | None = None  #: GradScaler scale, when the watcher was given one
    #: calls skipped because autograd recomputed them (activation checkpointing).
    recomputed: int = 0
    anomaly: Anomaly | None = None
    diagnoses: list[Any] = field(default_factory=list)  #: list[Diagnosis]
    #: the exception that ended the step, classified (post-mortem).
    error: dict[str, Any] | None = None
    #: outputs modified in place after they were recorded: path, role, grad_fn and the
    #: version counter then and now (evidence for autograd's in-place error).
    mutations: list[dict[str, Any]] = field(default_factory=list)

    def figures(self, *, scaled: bool = False) -> dict[str, float]:
        """The step's figures, for a logger: ``max_logit`` (max |x| of the model's output),
        ``grad_norm`` (total L2 norm of the parameter gradients, already unscaled when a
        GradScaler is in use), ``loss_scale`` (GradScaler), the number of tensors holding
        NaN/inf by phase (``nonfinite_forward``, ``nonfinite_backward``,
        ``nonfinite_params``: parameter gradients and weights), and ``headroom``: the largest
        max |x| / ``finfo.max`` over the step's float16/bfloat16/float8 tensors (1.0 =
        overflow; ``scaled``: the gradients carry a GradScaler's scale and are left out).
        ``max_logit`` and ``grad_norm`` are NaN when unknown (a logger would otherwise repeat
        the last value); ``loss_scale`` and ``headroom`` appear only with a GradScaler and
        low-precision tensors.

        Example:
            >>> StepTrace(step=0, grad_norm=2.0).figures()["grad_norm"]
            2.0
        """
        from nanwatch.stats import dtype_limits

        nan = math.nan
        out: dict[str, float] = {
            "max_logit": self.max_logit if self.max_logit is not None else nan,
            "grad_norm": self.grad_norm if self.grad_norm is not None else nan,
        }
        if self.scale is not None:
            out["loss_scale"] = self.scale
        counts = {"forward": 0, "backward": 0, "params": 0}
        headroom: float | None = None
        for r in self.records:
            s = r.stat
            if s is None:
                continue
            if r.phase in (Phase.GRADIENT, Phase.PARAMETER):
                group = "params"
            elif r.phase is Phase.BACKWARD:
                group = "backward"
            else:
                group = "forward"
            if not s.finite:
                counts[group] += 1
            if r.phase is Phase.GRADIENT or (scaled and r.phase is Phase.BACKWARD):
                continue  # gradient records hold norms; scaled gradients overflow on purpose
            lim = dtype_limits(r.dtype)
            if lim is None or not lim.low_precision:
                continue
            amax = s.amax
            if math.isnan(amax):
                amax = s.finite_amax if s.finite_amax is not None else nan
            if not math.isnan(amax):
                ratio = amax / lim.max
                headroom = ratio if headroom is None else max(headroom, ratio)
        for group, n in counts.items():
            out[f"nonfinite_{group}"] = float(n)
        if headroom is not None:
            out["headroom"] = headroom
        return out

    def record(self, index: int) -> Record | None:
        """The record with this index (records are kept in index order)."""
        recs = self.records
        lo, hi = 0, len(recs)
        while lo < hi:
            mid = (lo + hi) // 2
            if recs[mid].index < index:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(recs) and recs[lo].index == index:
            return recs[lo]
        for r in recs:  # parameter records checked lazily sit before the forward ones
            if r.index == index:
                return r
        return None

    def call(self, call_id: int) -> Call | None:
        calls = self.calls
        if 0 <= call_id < len(calls) and calls[call_id].id == call_id:
            return calls[call_id]
        for c in calls:
            if c.id == call_id:
                return c
        return None

    def inputs_of(self, call_id: int) -> list[Record]:
        """The input records of one module call (aliases unresolved)."""
        return [r for r in self.records if r.call == call_id and r.phase is Phase.INPUT]

    def root_outputs(self) -> list[Record]:
        """The output records of the root calls that are not losses: what loss code
        outside the modules computes from."""
        roots = {c.id for c in self.calls if c.root and not c.is_loss}
        return [r for r in self.records if r.phase is Phase.FORWARD and r.call in roots]

    def resolve(self, rec: Record) -> Record:
        """Follow ``source`` links from an input or alias to the record that measured it."""
        seen = 0
        cur = rec
        while cur.stat is None and cur.source is not None and seen < 64:
            nxt = self.record(cur.source)
            if nxt is None:
                break
            cur = nxt
            seen += 1
        return cur

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "full": self.full,
            "loss": _num(self.loss),
            "grad_norm": _num(self.grad_norm),
            "max_logit": _num(self.max_logit),
            "scale": _num(self.scale),
            "recomputed": self.recomputed,
            "records": [r.to_dict() for r in self.records],
            "calls": [c.to_dict() for c in self.calls],
            "ops": [o.to_dict() for o in self.ops],
            "notes": [n.to_dict() for n in self.notes],
            "anomaly": None if self.anomaly is None else self.anomaly.to_dict(),
            "diagnoses": [d.to_dict() for d in self.diagnoses],
            "error": self.error,
            "mutations": list(self.mutations),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepTrace:
        from nanwatch.rules.base import Diagnosis

        return cls(
            step=int(d["step"]),
            records=[Record.from_dict(r) for r in d.get("records", [])],
            calls=[Call.from_dict(c) for c in d.get("calls", [])],
            ops=[OpEvent.from_dict(o) for o in d.get("ops", [])],
            notes=[Note.from_dict(n) for n in d.get("notes", [])],
            full=bool(d.get("full", True)),
            loss=_unnum_opt(d.get("loss")),
            grad_norm=_unnum_opt(d.get("grad_norm")),
            max_logit=_unnum_opt(d.get("max_logit")),
            scale=_unnum_opt(d.get("scale")),
            recomputed=int(d.get("recomputed", 0)),
            anomaly=None if d.get("anomaly") is None else Anomaly.from_dict(d["anomaly"]),
            diagnoses=[Diagnosis.from_dict(x) for x in d.get("diagnoses", [])],
            error=d.get("error"),
            mutations=list(d.get("mutations", [])),
        )


# JSON has no NaN/inf: they travel as strings.
_SPECIAL = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _num(v: float | None) -> float | str | None:
    if v is None:
        return None
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "Infinity" if v > 0 else "-Infinity"
    return v


def _unnum(v: float | str) -> float:
    if isinstance(v, str):
        return _SPECIAL[v]
    return float(v)


def _unnum_opt(v: float | str | None) -> float | None:
    return None if v is None else _unnum(v)
