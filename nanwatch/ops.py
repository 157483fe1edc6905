"""Op-level tracing: which aten op created a NaN or inf, where in the user's code.

:class:`OpChecker` is a ``TorchDispatchMode`` that looks at every aten op's floating
outputs, forward and backward, and records an :class:`~nanwatch.records.OpEvent` when an op
*creates* a non-finite value its inputs did not hold (``log`` of 0 -> -inf; ``0 * -inf`` ->
NaN; a float32 -> float16 cast of 70000 -> inf). Non-finite outputs are remembered (weakly)
so a later event names the earlier one as its cause: op-level data flow, not guesswork.

:func:`replay` re-runs a module's call on its inputs under the checker (its forward and
the user's forward hooks and pre-hooks on it, none of nanwatch's), with
``torch.no_grad()`` (once more with gradients on when the forward raised there for want
of them: one that differentiates itself), and puts RNG state, the module's state (buffers
such as BatchNorm's running statistics, tensors and numbers held as attributes) and
``.grad`` back, between the runs and after, so the replay changes nothing.
"""

from __future__ import annotations

import ast
import bisect
import builtins
import contextlib
import functools
import inspect
import linecache
import math
import operator
import os
import random
import re
import sys
import threading
import types
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _python_dispatch
from torch.utils._python_dispatch import TorchDispatchMode

from nanwatch import _copies, _frames
from nanwatch._compat import aminmax, as_called, autocast_as, set_versions
from nanwatch._domains import Domain, domain_of
from nanwatch._structure import iter_tensors, leaves
from nanwatch.localize import is_birth, mark_redrawn
from nanwatch.records import DIFFERENCE_OF, LOSS_PATH, OpEvent, Phase, TensorStat
from nanwatch.stats import brief, describe, device_name, dtype_name, has_values

_aten = torch.ops.aten

#: ops whose outputs are uninitialized memory or mere metadata: they hold no value of
#: their inputs
_FRESH_PACKETS = {
    _aten.empty,
    _aten.empty_like,
    _aten.empty_strided,
    _aten.new_empty,
    _aten.new_empty_strided,
    _aten.set_,
    _aten.resize_,
    _aten._local_scalar_dense,
}
#: ops never a "birth": those, and the ones that hand on their input's values unchanged
#: (with views, which :meth:`OpChecker._pass_on` links to the event that made the input)
_IGNORED_PACKETS = _FRESH_PACKETS | {
    _aten.detach,
    _aten.alias,
    _aten.lift_fresh,
    _aten.lift_fresh_copy,
    _aten.clone,
    _aten.contiguous,
}

#: ignored ops that do not link their output to their input's event in forward: fresh
#: memory, and the detach autograd makes of a tensor it saves for backward
_NOT_PASSED_IN_FORWARD = _FRESH_PACKETS | {
    _aten.detach,
    _aten.alias,
    _aten.lift_fresh,
    _aten.lift_fresh_copy,
}

#: in-place ops whose result does not read the values they overwrite: the old values of
#: ``self`` are no input of theirs (a copy into a tensor that held NaN makes no NaN).
_OVERWRITING = {_aten.copy_, _aten.fill_, _aten.zero_}

#: per op: (position, name, whether the op reads the old values) of each argument it
#: writes (``self`` of ``div_``, ``out=``), from the schema's alias annotations
_WRITES: dict[Any, tuple[tuple[int, str, bool], ...]] = {}


def _written_args(func: Any) -> tuple[tuple[int, str, bool], ...]:
    spec = _WRITES.get(func)
    if spec is None:
        schema = func._schema
        if not schema.is_mutable:
            spec = ()
        else:
            overwrites = func.overloadpacket in _OVERWRITING
            spec = tuple(
                (i, a.name, not (overwrites or getattr(a, "is_out", a.kwarg_only)))
                for i, a in enumerate(schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write
            )
        _WRITES[func] = spec
    return spec


def _storage(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage().data_ptr())
    except Exception:  # no storage (sparse, nested, a subclass): no alias found
        return None


@dataclass
class _Before:
    """What an op that writes its arguments had before it ran: a copy of each written
    argument whose old values it reads (``self`` of ``x.div_(n)``, and any input sharing
    its storage: ``x.div_(x)``), by ``id``; the written tensors (outputs as much as the
    op's return); the ids of those whose old values are no input (``out=``, ``copy_``)."""

    copies: dict[int, torch.Tensor] = field(default_factory=dict)
    written: list[torch.Tensor] = field(default_factory=list)
    no_input: set[int] = field(default_factory=set)

    def value(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as the op read it."""
        return self.copies.get(id(t), t)


def _before(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> _Before | None:
    """A :class:`_Before` for an op that writes an argument; None for the rest (no cost)."""
    spec = _written_args(func)
    if not spec:
        return None
    before = _Before()
    reads: list[torch.Tensor] = []
    for pos, name, read in spec:
        a = args[pos] if pos < len(args) else kwargs.get(name)
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if not isinstance(t, torch.Tensor):
                continue
            before.written.append(t)
            if read:
                reads.append(t)
            else:
                before.no_input.add(id(t))
    written = {id(t) for t in before.written}
    ptrs = {p for t in before.written if (p := _storage(t)) is not None}
    for t in leaves((list(args), kwargs)):
        if isinstance(t, torch.Tensor) and id(t) not in written and _storage(t) in ptrs:
            reads.append(t)  # reads memory the op writes (x.div_(x.detach()))
    budget = _COPY_BUDGET  # an optimizer's foreach step writes every weight: not copied
    with torch.no_grad():
        for t in reads:
            if id(t) in before.copies or not has_values(t):
                continue
            budget -= t.numel()
            if budget < 0:
                break  # the rest are read after the op, as before this was added
            try:
                before.copies[id(t)] = t.detach().clone()
            except RuntimeError:  # out of memory: its values are read after the op
                continue
    return before


#: elements an in-place op's old values may be copied up to (256 MB of float32): an
#: activation's ``x /= n`` fits; a fused optimizer step over all the weights does not,
#: and is checked from the values it wrote
_COPY_BUDGET = 1 << 26


#: thread-local state shared by every watcher: hooks stay quiet while a replay runs.
_tls = threading.local()

#: the autograd node running on this thread (None outside backward); torch without it
#: (older than 2.0) sees no node, and backward ops are reported as forward ones.
current_autograd_node: Callable[[], Any] = getattr(torch._C, "_current_autograd_node", lambda: None)


def replaying() -> bool:
    return bool(getattr(_tls, "replaying", 0))


def push_path(path: str) -> None:
    """Hooks call this during a replay so ops are attributed to the module running them."""
    stack = getattr(_tls, "paths", None)
    if stack is None:
        stack = _tls.paths = []
    stack.append(path)


def pop_path() -> None:
    stack = getattr(_tls, "paths", None)
    if stack:
        stack.pop()


def replay_path() -> str | None:
    stack = getattr(_tls, "paths", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def _replay_scope() -> Iterator[None]:
    """A replay runs: hooks know it (:func:`replaying`), and the warnings of code the user
    already ran (``std(): degrees of freedom is <= 0``) are not said a second time."""
    _tls.replaying = getattr(_tls, "replaying", 0) + 1
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        _tls.replaying -= 1


#: the compressed sparse layouts, whose ``values()`` hold what they store
_COMPRESSED = frozenset({torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc})


def _kinds(t: torch.Tensor) -> frozenset[str]:
    """Which non-finite kinds ``t`` holds; empty when finite. One pass in the common case."""
    if not has_values(t):
        return frozenset()
    v = t
    if v.layout is torch.sparse_coo:  # its stored values, as built (torch.sparse_coo_tensor)
        v = v._values()
    elif v.layout in _COMPRESSED:
        v = v.values()
    if v.is_complex():
        v = v.abs()
    if v.layout is not torch.strided or v.is_nested:
        return frozenset()
    with torch.no_grad():
        if v.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            v = v.float()
        mn, mx = aminmax(v)
        lo, hi = float(mn), float(mx)
        if math.isfinite(lo) and math.isfinite(hi):
            return frozenset()
        flags = torch.stack(
            (torch.isnan(v).any(), torch.isposinf(v).any(), torch.isneginf(v).any())
        ).tolist()
    return frozenset(
        k for k, present in zip(("NaN", "+inf", "-inf"), flags, strict=True) if present
    )


def _scalar_kinds(x: object) -> frozenset[str]:
    if isinstance(x, float):
        if math.isnan(x):
            return frozenset({"NaN"})
        if math.isinf(x):
            return frozenset({"+inf" if x > 0 else "-inf"})
    return frozenset()


_ORDER = {"NaN": 0, "+inf": 1, "-inf": 2}


#: boolean arguments an OpEvent keeps (as 0/1): those that decide whether a non-finite
#: output is meant (``_ctc_loss(..., zero_infinity=True)`` zeroes the +inf loss of a target
#: its input cannot align, which the op itself still returns)
_FLAGS = frozenset({"zero_infinity"})


def _join(kinds: frozenset[str]) -> str:
    return ", ".join(sorted(kinds, key=_ORDER.__getitem__))


#: ops that convert a tensor to another dtype (``x.to(torch.float16)``, ``y.copy_(x)``)
_CASTS = frozenset({"_to_copy", "to", "copy_", "copy", "_to_dtype", "_to_dtype_layout"})


def _cast_source(
    func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: torch.Tensor
) -> torch.Tensor | None:
    """The tensor a cast op converted to ``out``'s dtype: its first tensor argument of
    another dtype (``self`` of ``_to_copy``, ``src`` of ``copy_``); None for other ops."""
    parts = str(func).split(".")
    if len(parts) < 2 or parts[1] not in _CASTS:
        return None
    for a in leaves((list(args), kwargs)):
        if isinstance(a, torch.Tensor) and a.dtype != out.dtype:
            return a
    return None


def _briefs(tensors: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, TensorStat]]:
    out = []
    for name, t in tensors:
        s = brief(t)
        if s is not None:
            out.append((name, s))
    return out


#: outputs (by position) that are scratch an op leaves partly unwritten: ``_ctc_loss``'s
#: log_alpha table, saved for its backward, is written only up to each sample's input and
#: target lengths; the rest is whatever the allocator held (1e31, +inf, NaN, differing run
#: to run), which is no value the op made
_SCRATCH_OUTPUTS: dict[str, frozenset[int]] = {
    "_ctc_loss": frozenset({1}),
    "_cudnn_ctc_loss": frozenset({1}),
}


def _scratch(func: Any) -> frozenset[int]:
    """The positions of ``func``'s outputs that are partly unwritten scratch."""
    parts = str(func).split(".")
    return _SCRATCH_OUTPUTS.get(parts[1] if len(parts) > 1 else parts[0], frozenset())


def _named_outputs(func: Any, out: Any) -> list[tuple[str, TensorStat]]:
    """Statistics of every output of an op that returns several, by the schema's names
    (``output``, ``total_weight``); empty for a single output. Scratch outputs (see
    :data:`_SCRATCH_OUTPUTS`) are left out."""
    if not isinstance(out, (tuple, list)):
        return []
    names = [r.name for r in func._schema.returns]
    scratch = _scratch(func)
    found: list[tuple[str, TensorStat]] = []
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor) or i in scratch:
            continue
        s = brief(t)
        if s is not None:
            found.append((names[i] if i < len(names) and names[i] else f"output[{i}]", s))
    return found


def domain_counts(dom: Domain, t: torch.Tensor | None) -> dict[str, int]:
    """How many values of ``t`` lie outside ``dom`` (NaN there), on a pole endpoint and on
    a pole at a non-positive integer (inf there): ``n_outside``, ``n_edge``, ``n_pole``,
    the non-zero ones.

    >>> from nanwatch._domains import domain_of
    >>> domain_counts(domain_of("atanh"), torch.tensor([1.0, 1.5, 0.2, 2.0]))
    {'n_outside': 2, 'n_edge': 1}
    """
    if not isinstance(t, torch.Tensor) or not has_values(t) or t.is_complex():
        return {}
    with torch.no_grad():
        v = t.detach()
        if v.dtype not in (torch.float32, torch.float64):
            v = v.float()
        zero = torch.zeros((), dtype=torch.bool, device=v.device)
        outside = (v < dom.lo) | (v > dom.hi)
        edge = zero
        if "lo" in dom.edges:
            edge = edge | (v == dom.lo)
        if "hi" in dom.edges:
            edge = edge | (v == dom.hi)
        pole = (v <= 0) & (v == v.floor()) if dom.poles else zero
        counts = torch.stack([outside.sum(), edge.sum(), pole.sum()]).tolist()
    return {k: int(n) for k, n in zip(("n_outside", "n_edge", "n_pole"), counts, strict=True) if n}


#: ops that make a constant tensor: their NaN, picked by a ``where``, is a composite op's
#: "undefined here" (see :meth:`OpChecker._chosen_constant`)
_NAN_CONSTANT_OPS = frozenset({"scalar_tensor", "full", "full_like", "new_full", "fill", "fill_"})
#: the op whose output a ``where`` combines with a NaN constant -> the composite op it is
#: part of: torch.logdet is ``where(sign == -1, nan, logabsdet)`` of a slogdet
_COMPOSITES = {
    "aten._linalg_slogdet.default": "aten.logdet",
    "aten.linalg_slogdet.default": "aten.logdet",
}


def _make_traced() -> Callable[[], bool]:
    """Whether an op runs under tracing (``torch.export``, ``torch.compile``, ``make_fx``):
    a fake, proxy or functionalization mode is active, and its tensors hold no values (a
    statistic's ``.item()`` makes an unbacked symbol the tracer then fails on). One C call
    per mode where torch keeps them by key (2.2 and later), else a look at the mode stack."""
    key = getattr(torch._C, "_TorchDispatchModeKey", None)
    get_mode = getattr(torch._C, "_get_dispatch_mode", None)
    keys = [getattr(key, k) for k in ("FAKE", "PROXY", "FUNCTIONAL") if hasattr(key, k)]
    if len(keys) == 3 and get_mode is not None:  # every op asks: no generator, three C calls
        fake, proxy, functional = keys
        return lambda: (
            get_mode(fake) is not None
            or get_mode(proxy) is not None
            or get_mode(functional) is not None
        )
    if keys and get_mode is not None:
        return lambda: any(get_mode(k) is not None for k in keys)
    names = {"FakeTensorMode", "ProxyTorchDispatchMode", "FunctionalTensorMode"}

    def active() -> bool:
        stack = _python_dispatch._get_current_dispatch_mode_stack()
        return any(type(m).__name__ in names for m in stack)

    return active


_traced: Callable[[], bool] = _make_traced()


def _fake(types: Sequence[type]) -> bool:
    """A tensor argument holds no values: a FakeTensor or a FunctionalTensor (export's,
    compile's), met after its mode was left. ``types``: what ``__torch_dispatch__`` is
    given, the argument types that define their own dispatch (empty for plain tensors, so
    the check costs nothing on the ops of a training step)."""
    return any(t not in _PLAIN and _no_data(t) for t in types)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _no_data(t: type) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return issubclass(t, (FakeTensor, FunctionalTensor))


#: ``OpEvent.scalars`` key of an event the op checker records for a non-finite tensor with
#: no autograd history that the loss code read and no checked op made (see
#: :meth:`OpChecker._entered`): which argument of the op it was
ENTERED = "entered"

#: at most this many entered-data events while the checker's events are not taken
_ENTERED_MAX = 4

#: the packets whose results :class:`OpChecker` keeps a subtraction's operands' size of
#: (``add``: a number added to one, ``var + eps``)
_DIFFERENCES = frozenset((_aten.sub, _aten.rsub, _aten.add))

#: remembered non-finite tensors before the freed ones are first dropped
_SEEN_PRUNE = 4096


@dataclass
class _Seen:
    ref: weakref.ReferenceType[torch.Tensor]
    event: OpEvent | None
    #: the value is (made of) a non-finite parameter or buffer the replayed module already
    #: held: what ops make of it was not born in them (see :meth:`OpChecker.hold_state`)
    state: bool = False
    #: when ``event`` was recorded, in the checker's order of events (lower ran first): an
    #: op given several non-finite operands names the one made first as its cause
    seq: int = -1


#: how many ops deep a :class:`_Flow` keeps what made a value
_FLOW_DEPTH = 4


@dataclass(frozen=True, slots=True)
class _Flow:
    """What made a forward value, read from the ops that ran (no tensor is kept): the ops
    that made it, nearest first, lower-case as autograd names their nodes, followed through
    each one's first operand with a history (:func:`made_from` of a node given the value:
    ``("rsub", "sigmoid", "addmm")``), at most :data:`_FLOW_DEPTH`."""

    chain: tuple[str, ...]

    @staticmethod
    def of(packet: str, ins: Sequence[_Flow | None]) -> _Flow:
        """The flow of a value an aten op (``packet``: ``_log_softmax``) made of operands
        whose flows are ``ins``: ``("logsoftmax", ...)``."""
        first = next((f for f in ins if f is not None), None)
        below = first.chain[: _FLOW_DEPTH - 1] if first is not None else ()
        return _Flow((packet.replace("_", "").lower(), *below))


#: a value autograd accumulates a gradient into (a parameter): ``leaf``, as the graph ends
_LEAF = _Flow(("leaf",))
#: roots and powers: the first operand's lack of autograd history is recorded for them
#: (``history:self``), so the rules tell a constant or data from a prediction
_ROOT_PACKETS = frozenset({_aten.sqrt, _aten.rsqrt, _aten.pow})


def _first_cause(makers: Sequence[_Seen]) -> tuple[OpEvent | None, int]:
    """The event an op names as its cause, and its place in the order of events, from what
    made its non-finite operands (operand order): the first operand's maker; but when one
    of them is a birth (an inf that is an anomaly on its own: ``x / v``'s +inf) and another
    operand's maker ran before it, the one that ran first (``log(v) + x / v`` with
    ``v == 0``: log's -inf, not the division's +inf, whichever operand each is)."""
    if not makers:
        return None, -1
    first = makers[0]
    if any(is_birth(m.event) for m in makers if m.event is not None):
        first = min(makers, key=lambda m: m.seq)
    return first.event, first.seq


class OpChecker(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's base is untyped
    """Checks every aten op's floating outputs and records where non-finite values are born.

    ``current_path`` names the module running a forward op; in backward the module comes
    from the autograd node's metadata (stamped by :func:`stamp_graph`). A backward op's
    source line is the *forward* line that created its node (from the traceback anomaly mode
    keeps on every node, when it is on); ``backward_at`` says which ``backward()`` call ran
    it (found on this thread's stack, else asked of ``backward_site``: on accelerators the
    engine runs backward on threads with no Python stack of the user's).

    Example:
        >>> with OpChecker() as chk:
        ...     _ = torch.log(torch.zeros(2))
        >>> chk.events[0].op, chk.events[0].born
        ('aten.log.default', '-inf')
    """

    def __init__(
        self,
        *,
        current_path: Callable[[], str | None] | None = None,
        max_events: int = 32,
        on_error: Callable[[BaseException], None] | None = None,
        backward_site: Callable[[], tuple[str | None, str | None]] | None = None,
        nanwatch_calls: bool = False,
        param_of: Callable[[torch.Tensor], tuple[str, str] | None] | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        #: a watched parameter's qualified name and the type of the module that holds it,
        #: by identity (None for any other tensor): asked only when an event is recorded
        self._param_of = param_of
        #: record the ops nanwatch's own code runs too (a user's autograd node whose
        #: backward nanwatch runs again), not only the user's
        self._nanwatch_calls = nanwatch_calls
        self.events: list[OpEvent] = []
        #: the events (by id) whose non-finite values left a submodule's call in its output
        #: during a replay (see :class:`_SubmoduleOps`): a value a module returned
        self.left: set[int] = set()
        self.checked = 0
        self._current_path = current_path
        self._backward_site = backward_site
        #: set by :func:`replay`: its own frame (user frames above it ran the replay, not
        #: the code) and the line that called the replayed module, said for an op of code
        #: with no user line (a torch module's own forward)
        self.floor: types.FrameType | None = None
        self.call_site: tuple[str, str | None] | None = None
        self._max_events = max_events
        self._seen: dict[int, _Seen] = {}
        self._prune_at = _SEEN_PRUNE
        self._seq = 0  #: the next event's place in the order of events (see ``_Seen.seq``)
        self._on_error = on_error
        self._broken = False
        #: which module's code made each autograd node while this checker ran
        self.created = _Creations()
        #: this step's backward: an op that read a forward value holding NaN was recorded
        #: (the first; see :meth:`_hidden_nan`), a forward op made NaN (that op is named)
        self._hidden_said = False
        self._nan_made = False
        self._in_backward = False
        #: the last ops' floating outputs and the op that made each: a NaN constant that a
        #: ``where`` selects is named by the composite op it runs inside (logdet)
        self._made: deque[tuple[weakref.ReferenceType[torch.Tensor], str]] = deque(maxlen=16)
        #: the last forward subtractions of two tensors: each result and its operands'
        #: largest magnitude (see :data:`DIFFERENCE_OF`)
        self._differences: deque[tuple[weakref.ReferenceType[torch.Tensor], float]] = deque(
            maxlen=8
        )
        #: this backward's events born inside a node's formula, with their node, while a
        #: later op may still show the node masked them (see :meth:`_contain`)
        self._node_events: dict[int, tuple[OpEvent, Any]] = {}
        #: events taken back as masked, by id: where they stood in ``events``
        self._masked: dict[int, int] = {}
        #: what made each forward value, by id (see :class:`_Flow`): the data flow the
        #: autograd graph would show, known in a replay under ``no_grad`` too
        self._flows: dict[int, tuple[weakref.ReferenceType[torch.Tensor], _Flow]] = {}
        self._flows_prune_at = _SEEN_PRUNE

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if (types and _fake(types)) or _traced():  # export, compile: no values to check
            return func(*args, **kwargs)
        ignored = func.overloadpacket in _IGNORED_PACKETS or func.is_view
        before: _Before | None = None
        if not self._broken:
            try:
                self._note_creation(args, kwargs)
                if not ignored:  # an in-place op: what it reads, before it writes over it
                    before = _before(func, args, kwargs)
            except Exception as exc:  # nanwatch must never break the computation it watches
                self._broken = True
                if self._on_error is not None:
                    self._on_error(exc)
        out = func(*args, **kwargs)
        if self._broken:
            return out
        with contextlib.suppress(Exception):  # an unusual op: its data flow is left unknown
            self._note_flow(func, args, out)
        if ignored:
            # a view or copy of a remembered non-finite value holds it too; in forward not
            # autograd's own detach of what it saves (a backward op reading it is the node's),
            # which it makes only with grad on (a replay's full slice ``h[:, 0:]`` is an alias)
            packet = func.overloadpacket
            passes = (
                current_autograd_node() is not None
                or packet not in _NOT_PASSED_IN_FORWARD
                or (not torch.is_grad_enabled() and packet not in _FRESH_PACKETS)
            )
            if self._seen and passes:
                try:
                    self._pass_on(args, out)
                except Exception as exc:  # nanwatch must never break what it watches
                    self._broken = True
                    if self._on_error is not None:
                        self._on_error(exc)
            return out
        try:
            self._check(func, args, kwargs, out, before)
        except Exception as exc:  # nanwatch must never break the computation it watches
            self._broken = True
            if self._on_error is not None:
                self._on_error(exc)
        return out

    # -- internals -------------------------------------------------------------------
    def _backward_lines(
        self,
    ) -> tuple[tuple[str | None, str | None], tuple[str | None, str | None]]:
        """(the user's line that ran the op inside backward, the ``backward()`` call), each
        (None, None) when unknown. The first is set when the op ran in user code that the
        engine called back (a custom Function's ``backward``, a tensor hook, a checkpointed
        forward run again): the line of the op itself. The call is the user frame that
        entered the autograd engine; on threads with no such frame (accelerators), asked of
        ``backward_site``."""
        inner, call = _backward_frames(sys._getframe(1))
        ran = _frames.describe_frame(inner)
        at = _frames.describe_frame(call)
        if at[0] is None and self._backward_site is not None:
            at = self._backward_site()
        return ran, at

    def _note_creation(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Log which module's code creates the autograd nodes made from here on (forward,
        forensic): :func:`stamp_graph` reads it to give each node the module whose own code
        made it. Nodes made in backward (``create_graph=True``) belong to no module's
        forward: logged as unknown."""
        if self._current_path is None:
            return
        if current_autograd_node() is not None:
            self.created.note(_MADE_IN_BACKWARD, own_node=False)
            return
        path = self._current_path()
        if self.created.same(path):
            return
        # autograd made this op's node before dispatching it, when it records the op at all
        own = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in leaves((list(args), kwargs))
        )
        self.created.note(path, own_node=own)

    def _pass_on(self, args: Sequence[Any], out: Any) -> None:
        """A view, a copy or a detach of a non-finite value holds the same value: remember
        it with the event that made it, so the op that consumes it names its cause (in
        forward ``log(q)[None, :]``, then ``x - lq``; in backward ``SumBackward0``'s
        ``expand`` of a -inf gradient, then ``0 * -inf``)."""
        src = next(
            (
                seen
                for a in leaves(list(args))
                if isinstance(a, torch.Tensor) and (seen := self._lookup(a)) is not None
            ),
            None,
        )
        if src is None or (src.event is None and not src.state):
            return
        for t in leaves(out):
            if isinstance(t, torch.Tensor) and self._lookup(t) is None:
                self._remember(t, src.event, state=src.state, seq=src.seq)

    def hold_state(self, tensors: Iterable[torch.Tensor]) -> None:
        """Mark non-finite tensors the code reads that no op of it made (a module's
        parameters and buffers, written before the call): an op whose non-finite input is
        one of them, a view of one or made of one records no birth (``x @ E.t()`` of an
        embedding holding +inf and -inf makes NaN of them, but the NaN came in with E)."""
        for t in tensors:
            if has_values(t) and _kinds(t):
                self._remember(t, None, state=True)

    def _remember(
        self, t: torch.Tensor, event: OpEvent | None, *, state: bool = False, seq: int = -1
    ) -> _Seen:
        """Remember non-finite ``t`` with the event that made it (recorded ``seq``-th);
        entries of freed tensors are dropped when the table has doubled (a -inf mask made
        every step, forensic)."""
        seen = self._seen[id(t)] = _Seen(weakref.ref(t), event, state, seq)
        if len(self._seen) > self._prune_at:
            self._seen = {k: v for k, v in self._seen.items() if v.ref() is not None}
            self._prune_at = max(_SEEN_PRUNE, 2 * len(self._seen))
        return seen

    def maker(self, t: torch.Tensor) -> OpEvent | None:
        """The recorded op that made the non-finite values ``t`` holds, when this checker
        saw it made (an in-place ``w.div_(w.norm(...))`` of a weight: the weight itself, or
        a view's base); None otherwise."""
        seen = self._lookup(t)
        return seen.event if seen is not None else None

    def _lookup(self, t: torch.Tensor) -> _Seen | None:
        seen = self._seen.get(id(t))
        if seen is not None and seen.ref() is t:
            return seen
        return None

    def _check(
        self,
        func: Any,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        out: Any,
        before: _Before | None = None,
    ) -> None:
        """Record an event when ``func`` made a non-finite value its inputs did not hold.
        For an op that writes an argument (``x /= n``), ``before`` holds what it read: its
        written arguments are outputs, and their old values (not the new ones) inputs."""
        outs = [t for t in leaves(out) if isinstance(t, torch.Tensor)]
        if isinstance(out, (tuple, list)) and (scratch := _scratch(func)):
            unwritten = {id(t) for i, t in enumerate(out) if i in scratch}
            outs = [t for t in outs if id(t) not in unwritten]
        if before is not None:  # a written argument the op does not return (foreach ops)
            returned = {id(t) for t in outs}
            outs += [w for w in before.written if id(w) not in returned]
        outs = [t for t in outs if has_values(t)]
        if not outs:
            return
        self.checked += 1
        for t in outs:
            self._made.append((weakref.ref(t), str(func)))
        node_now: Any = current_autograd_node()
        backward = node_now is not None
        if not backward and func.overloadpacket in _DIFFERENCES:
            self._note_difference(func, args, outs)
        if backward != self._in_backward:
            self._in_backward = backward
            if not backward:  # a forward after a backward: the next step's evidence
                self._hidden_said = self._nan_made = False
                self._node_events.clear()
                self._masked.clear()
        out_kinds = [_kinds(t) for t in outs]
        if backward and self._node_events:
            self._contain(node_now, args, kwargs, finite=not any(out_kinds))
        if not any(out_kinds):
            return
        schema_args = func._schema.arguments
        inputs: list[tuple[str, torch.Tensor]] = []
        others: list[tuple[str, torch.Tensor]] = []
        scalars: dict[str, float | int | str] = {}
        scalar_kinds: frozenset[str] = frozenset()
        for i, a in enumerate(args):
            name = schema_args[i].name if i < len(schema_args) else f"arg{i}"
            scalar_kinds |= self._collect(name, a, inputs, scalars, others)
        for name, a in kwargs.items():
            scalar_kinds |= self._collect(name, a, inputs, scalars, others)
        read = inputs
        if before is not None:  # the values the op read; out= arguments are no input
            read = [(n, before.value(t)) for n, t in inputs if id(t) not in before.no_input]
            inputs = [(n, t) for n, t in inputs if id(t) not in before.no_input]
            others = [(n, t) for n, t in others if id(t) not in before.no_input]
        in_kinds: frozenset[str] = frozenset()
        makers: list[_Seen] = []  # what made each non-finite operand, in operand order
        state = False
        for (_, t), (_, v) in zip(inputs, read, strict=True):
            seen = self._lookup(t)
            k = _kinds(v)
            in_kinds |= k
            if k and seen is not None and seen.event is not None:
                makers.append(seen)
            state = state or bool(k and seen is not None and seen.state)
        cause, cause_seq = _first_cause(makers)
        all_out = frozenset().union(*out_kinds)
        born = all_out - in_kinds - scalar_kinds
        if not born and cause is None and not state and not backward:
            self._entered(func, inputs, read)
        chosen = None
        if not born and "NaN" in all_out and func.overloadpacket is _aten.where:
            chosen = self._chosen_constant(inputs, others)
            if chosen is not None:  # where() put a NaN constant in: the NaN is born here
                born = frozenset({"NaN"})
                cause = None  # the constant is part of this op, not an earlier cause
                read = [(n, t) for n, t in read if "NaN" not in _kinds(t)]
        if state and "NaN" in born:
            # NaN made of module state that already held infinities (inf - inf inside a
            # matmul with an embedding of +inf and -inf): not born here. An inf the state
            # passes on (x * scale, scale +inf) stays an event: its inputs show the state
            # held it, which the rules name (NW111's "did not make the inf").
            for t, k in zip(outs, out_kinds, strict=True):
                if k:
                    self._remember(t, None, state=True)
            return
        injected = (all_out & scalar_kinds) - in_kinds
        event: OpEvent | None = None
        if (
            not (born or injected)
            and "NaN" in all_out
            and "NaN" in in_kinds
            and not (self._hidden_said or self._nan_made)
            and len(self.events) < self._max_events
        ):
            event = self._hidden_nan(read, outs)
        if (born or injected) and len(self.events) < self._max_events:
            if not self._nanwatch_calls and _frames.called_by_nanwatch():
                # a hook's own statistics (|x| of a -inf)
                return
            node: Any = current_autograd_node()  # None outside backward
            backward_at: str | None = None
            by_grad = False
            if node is not None:
                phase = Phase.BACKWARD
                meta: dict[str, Any] = node.metadata
                path = meta.get("nanwatch.path")
                ran, (backward_at, backward_code) = self._backward_lines()
                by_grad = _by_grad(sys._getframe())
                # the op's own line when user code ran it in backward (the division in a
                # custom backward()); else the forward line that created the node
                source, code = ran if ran[0] is not None else forward_line(node)
                if source is None:  # made before anomaly mode was on: the call is all we know
                    source, code = backward_at, backward_code
                node_name = name_of(node)
                saved = _saved_forward(node)
            else:
                phase = Phase.FORWARD
                path = self._current_path() if self._current_path is not None else None
                if path is None and self.floor is None and _frames.in_optimizer_step():
                    # an optimizer's own arithmetic (LBFGS's cubic interpolation of a line
                    # search step overflowing): no op of the model or of the loss code; the
                    # weights it writes are checked as an update's (NW301)
                    for t, k in zip(outs, out_kinds, strict=True):
                        if k:
                            self._remember(t, None, state=True)
                    return
                if self.call_site is None:
                    source, code = _frames.describe_frame(_frames.user_frame())
                else:
                    f = _frames.user_frame_within(self.floor)
                    source, code = _frames.describe_frame(f) if f else self.call_site
                node_name = None
                saved = []
            first_bad = next(t for t, k in zip(outs, out_kinds, strict=True) if k)
            out_stat = describe(first_bad) or TensorStat(math.nan, math.nan, 0)
            kept = dict(list(scalars.items())[:6])
            dom = domain_of(str(func))
            if dom is not None:
                kept.update(domain_counts(dom, dict(read).get(dom.arg)))
            for name, t in read[:2]:
                size = self._difference_of(t)
                if size is not None:
                    kept[f"{DIFFERENCE_OF}:{name}"] = size
            src = _cast_source(func, args, kwargs, first_bad)
            if src is not None:  # what a cast read: an int64 count, a float32 loss
                kept["source_dtype"] = dtype_name(src.dtype)
            if chosen is not None:
                kept.update(chosen[1])
            if saved and (fdom := domain_of(node_op(node_name or ""))) is not None:
                # the forward op's own input against its domain: acos given exactly 1.0
                # (the backward's own op reads 1 - x², not the cosines)
                own_in = dict(saved).get(f"saved {fdom.arg}")
                kept.update({f"saved_{k}": n for k, n in domain_counts(fdom, own_in).items()})
                if fdom.steep_edges and own_in is not None:  # finite there, steep slope
                    ends = [e for e in {fdom.lo, fdom.hi} if math.isfinite(e)]
                    at = sum(_has(own_in, functools.partial(torch.eq, other=e)) for e in ends)
                    if at:
                        kept["saved_at_edge"] = at
            event = OpEvent(
                op=chosen[0] if chosen is not None else str(func),
                phase=phase,
                path=path,
                born=_join(born or injected),
                output=out_stat,
                inputs=[(name, describe(t)) for name, t in read[:6]],
                scalars=kept,
                source=source,
                code=code,
                node=node_name,
                dtype=dtype_name(first_bad.dtype),
                cause=cause,
                injected=not born,
                backward_at=backward_at,
                by_grad=by_grad,
                device=device_name(first_bad.device),
                # what the node saved in forward follows the op's own operands: the
                # acos's input, the sqrt's result, read by the rules as ``saved self``
                other_inputs=_briefs(others[:4]) + _briefs(saved),
                outputs=_named_outputs(func, out),
                params=self._params_in(inputs[:6]),
                made_from=operand_made_from(inputs[0][1]) if node is None and inputs else [],
                made_from_history=(
                    first_operands_history(inputs[0][1].grad_fn) if node is None and inputs else []
                ),
            )
            self.events.append(event)
            if phase is Phase.FORWARD:
                with contextlib.suppress(Exception):  # evidence only: the event stands
                    self._flow_facts(event, func, inputs)
            if phase is Phase.FORWARD and "NaN" in born:
                self._nan_made = True  # a backward NaN of it is that op's (hidden or not)
            if node is not None and born and cause is None and not state:
                # made of finite values inside a backward formula: watched until the formula
                # shows whether it masks it (see _contain)
                self._node_events[id(event)] = (event, node)
        # remember every non-finite output, so later ops can name their cause
        seq = cause_seq
        if event is not None:
            seq, self._seq = self._seq, self._seq + 1
        for t, k in zip(outs, out_kinds, strict=True):
            if k:
                seen = self._remember(t, event if event is not None else cause, seq=seq)
                base = t._base if before is not None and t._is_view() else None
                if isinstance(base, torch.Tensor) and self._lookup(base) is None:
                    # a view written in place (x[0].div_(n)): its base holds the value too
                    self._remember(base, seen.event, seq=seen.seq)

    def _note_flow(self, func: Any, args: Sequence[Any], out: Any) -> None:
        """Remember what made each floating output of a forward op (see :class:`_Flow`):
        its op, named as autograd names its node, and what made its operands. A copy, a
        detach or an alias holds its input's values: it hands on its input's flow."""
        if current_autograd_node() is not None:
            return
        outs = [t for t in leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not outs:
            return
        ins = [self.flow_of(a) for a in leaves(list(args)) if isinstance(a, torch.Tensor)]
        packet = func.overloadpacket
        if packet in _FRESH_PACKETS or packet.__name__.endswith("_like"):
            flow = None  # new values (zeros_like, empty): none of their input's
        elif packet in _IGNORED_PACKETS:
            flow = next((f for f in ins if f is not None), None)
        else:
            flow = _Flow.of(packet.__name__, ins)
        if flow is None:
            return
        for t in outs:
            self._flows[id(t)] = (weakref.ref(t), flow)
        if len(self._flows) > self._flows_prune_at:  # drop freed values' entries
            self._flows = {k: v for k, v in self._flows.items() if v[0]() is not None}
            self._flows_prune_at = max(_SEEN_PRUNE, 2 * len(self._flows))

    def flow_of(self, t: torch.Tensor) -> _Flow | None:
        """What made forward value ``t``, as this checker saw it made, else as its autograd
        graph shows (a value made before the checker was entered); None for data. A
        parameter is a leaf, as in the graph, whatever an optimizer's update wrote in it."""
        if t.requires_grad and t.grad_fn is None:
            return _LEAF
        got = self._flows.get(id(t))
        if got is not None and got[0]() is t:
            return got[1]
        fn = t.grad_fn
        if fn is None:
            return None
        base = name_of(fn).split("Backward")[0].lower()
        return _Flow((base, *made_from(fn, depth=_FLOW_DEPTH - 1)))

    def _flow_facts(self, event: OpEvent, func: Any, inputs: Sequence[tuple[str, Any]]) -> None:
        """A forward event's data flow, in the fields the autograd graph's events carry:
        ``made_from`` (what made its first operand, :func:`made_from`) and, for a division
        by zeros, ``other_made_from`` (what made the denominator, as :func:`_made_by` gives
        it), so the rules check what the user's line seems to say against what made the
        values."""
        flows = {n: f for n, t in inputs if isinstance(t, torch.Tensor) and (f := self.flow_of(t))}
        first = next((f for n, t in inputs if (f := flows.get(n)) is not None), None)
        if first is not None and not event.made_from:
            event.made_from = list(first.chain)
        den = flows.get("other")
        st = dict(event.inputs).get("other")
        zeros = st is not None and (st.zeros > 0 if st.zeros is not None else 0 in (st.min, st.max))
        if func.overloadpacket in (_aten.div, _aten.div_) and den is not None and zeros:
            event.scalars.setdefault("other_made_from", "<".join(den.chain))
        if func.overloadpacket is _aten.xlogy and zeros:  # the log operand: data or the model's
            t = dict(inputs).get("other")
            if den is not None:
                event.scalars.setdefault("other_made_from", "<".join(den.chain))
            elif isinstance(t, torch.Tensor) and t.requires_grad:
                event.scalars.setdefault("other_made_from", "leaf")
        base = inputs[0][1] if inputs else None
        if (
            func.overloadpacket in _ROOT_PACKETS
            and torch.is_grad_enabled()
            and isinstance(base, torch.Tensor)
            and base.is_floating_point()
            and not base.requires_grad
        ):  # a root of values no parameter went into (with grad on: not a replay's no_grad)
            event.scalars.setdefault("history:self", "none")
        if "sigmoid" in event.made_from and isinstance(base, torch.Tensor):
            at, code = _sigmoid_line(base.grad_fn)
            if at is not None and code is not None:  # the user's line that applied it
                event.scalars.setdefault("sigmoid_at", at)
                event.scalars.setdefault("sigmoid_code", code)

    def _params_in(self, inputs: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, str, str]]:
        """The op's inputs that are watched parameters: (schema name, qualified name, the
        holding module's type). Host-side lookups by identity, for an event alone."""
        if self._param_of is None:
            return []
        out: list[tuple[str, str, str]] = []
        for name, t in inputs:
            found = self._param_of(t)
            if found is not None:
                out.append((name, *found))
        return out

    def _note_difference(self, func: Any, args: Sequence[Any], outs: list[torch.Tensor]) -> None:
        """Keep the largest magnitude of a forward subtraction's two floating operands with
        its result (two reads, for ``sub`` and ``rsub`` alone: the checker reads every
        output anyway), so an op that meets the result outside its domain can tell a
        difference that cancelled to rounding noise from values negative in their own
        right. A number added to or taken from a kept result passes its entry on."""
        if len(outs) != 1 or not outs[0].is_floating_point():
            return
        ops_ = [a for a in args[:2] if isinstance(a, torch.Tensor) and has_values(a)]
        if len(ops_) == 1 and any(isinstance(a, (int, float)) for a in args[1:2]):
            # a number added to a difference (``var + eps``) shifts it by far less than
            # the operands' rounding step, not out of it: the result is that noise too
            size: float | None = self._difference_of(ops_[0])
            if size is not None:
                self._differences.append((weakref.ref(outs[0]), size))
            return
        if len(ops_) != 2 or func.overloadpacket is _aten.add:
            return
        with torch.no_grad():  # |x|'s max (operands may differ in dtype and device)
            size = max(float(torch.linalg.vector_norm(a.detach(), math.inf)) for a in ops_)
        if math.isfinite(size) and size > 0:
            self._differences.append((weakref.ref(outs[0]), size))

    def _difference_of(self, t: torch.Tensor) -> float | None:
        """The operands' largest magnitude of the subtraction that made ``t`` (or the base
        ``t`` is a view of), when it was one of the last few; None otherwise."""
        if not self._differences:
            return None
        base = t._base if t._is_view() else None
        for ref, size in self._differences:
            made = ref()
            if made is not None and (made is t or made is base):
                return size
        return None

    def _contain(
        self, node: Any, args: Sequence[Any], kwargs: dict[str, Any], *, finite: bool
    ) -> None:
        """An op inside a backward node's formula that made inf or NaN (the reciprocal of
        x² + y² in atan2's backward at the origin) is no birth when the node's formula masks
        it (a ``where`` that turns it into the gradient 0, all finite) and it never reaches
        another node: its event is taken back. One that a later node reads (the gradient the
        node passed on held it after all) is put back in place."""
        for t in leaves((list(args), kwargs)):
            if not isinstance(t, torch.Tensor):
                continue
            seen = self._lookup(t)
            ev = seen.event if seen is not None else None
            made = self._node_events.get(id(ev)) if ev is not None else None
            if made is None:
                continue
            if made[1] is not node:  # it left its node: a birth, whatever masked it there
                del self._node_events[id(ev)]
                at = self._masked.pop(id(ev), None)
                if at is not None and ev is not None:
                    self.events.insert(min(at, len(self.events)), ev)
            elif finite and id(ev) not in self._masked and _kinds(t):
                with contextlib.suppress(ValueError):
                    at = next(i for i, e in enumerate(self.events) if e is ev)
                    del self.events[at]
                    self._masked[id(ev)] = at

    def _entered(
        self,
        func: Any,
        inputs: Sequence[tuple[str, torch.Tensor]],
        read: Sequence[tuple[str, torch.Tensor]],
    ) -> None:
        """Record where a non-finite value entered the step: a forward op of code outside
        every watched module (the loss code) read a tensor holding NaN or +inf that no
        checked op made, with no autograd history (not a parameter, not computed from
        one) and not module state: data the loop handed in (a target with a missing
        label). The event is ``injected`` (no op made the value) with ``scalars[ENTERED]``
        the argument's schema name; it is no birth and no other event's cause. A -inf alone
        is left out: a mask made before the step holds it by design. Each tensor once, and
        a few a step at most; not in a replay (its inputs are the step's, copied)."""
        if self.floor is not None or len(self.events) >= self._max_events:
            return
        if self._current_path is None or self._current_path() is not None:
            # a module's own code: its inputs are recorded, its state is not data; with no
            # module known (a bare checker) nothing tells state from data
            return
        for (name, t), (_, v) in zip(inputs, read, strict=True):
            if t.grad_fn is not None or t.requires_grad or self._lookup(t) is not None:
                continue
            kinds = _kinds(v)
            if not (kinds & {"NaN", "+inf"}):
                continue
            if sum(ENTERED in e.scalars for e in self.events) >= _ENTERED_MAX:
                return
            if _frames.called_by_nanwatch() or _frames.in_optimizer_step():
                return  # nanwatch's statistics, an optimizer reading a gradient: no data
            self._remember(t, None)  # said once: the ops that read it again are not news
            stat = describe(v) or TensorStat(math.nan, math.nan, v.numel())
            if self.call_site is None:
                source, code = _frames.describe_frame(_frames.user_frame())
            else:
                f = _frames.user_frame_within(self.floor)
                source, code = _frames.describe_frame(f) if f else self.call_site
            scalars: dict[str, float | int | str] = {
                ENTERED: name,
                "entered_shape": str(tuple(t.shape)),  # no "[": see leaf_event
            }
            named, _ = _user_names(t)
            if named:
                scalars["entered_name"] = named
            self.events.append(
                OpEvent(
                    op=str(func),
                    phase=Phase.FORWARD,
                    path=None,
                    born=_join(kinds),
                    output=stat,
                    inputs=[(name, stat)],
                    scalars=scalars,
                    source=source,
                    code=code,
                    dtype=dtype_name(v.dtype),
                    injected=True,
                    device=device_name(v.device),
                )
            )
            return

    def _chosen_constant(
        self, inputs: Sequence[tuple[str, torch.Tensor]], others: Sequence[tuple[str, torch.Tensor]]
    ) -> tuple[str, dict[str, float | int | str]] | None:
        """For a ``where`` that selected a NaN an op made as a constant (``scalar_tensor``,
        ``full``, ``fill`` with NaN: a composite op's "undefined here", logdet's
        ``where(sign == -1, nan, logabsdet)``): the op to name (the composite when the other
        branch's producer tells it, else the where) and scalars saying what it did; None
        when the NaN came in any other way."""
        factory: str | None = None
        producers: list[str] = []
        for _, t in inputs:
            seen = self._lookup(t)
            ev = seen.event if seen is not None else None
            if (
                ev is not None
                and ev.injected
                and "NaN" in ev.born
                and [*str(ev.op).split("."), ""][1] in _NAN_CONSTANT_OPS
            ):
                factory = ev.op
                continue
            if "NaN" in _kinds(t):
                return None  # a NaN that was not a constant: it came in with the input
            producers += [op for ref, op in self._made if ref() is t]
        if factory is None:
            return None
        scalars: dict[str, float | int | str] = {"nan_from": factory}
        composite = next((_COMPOSITES[p] for p in producers if p in _COMPOSITES), None)
        if composite == "aten.logdet":
            cond = next((t for _, t in others if t.dtype is torch.bool), None)
            if cond is not None:
                scalars["negative_det"] = int(cond.sum())
                scalars["matrices"] = int(cond.numel())
        return composite or "aten.where.self", scalars

    def _hidden_nan(
        self, read: Sequence[tuple[str, torch.Tensor]], outs: Sequence[torch.Tensor]
    ) -> OpEvent | None:
        """The first backward op that made NaN only of the forward values its autograd node
        saved (its NaN inputs are all the node's saved tensors; its gradient inputs were
        finite): the forward value held NaN and never reached the loss (torch.where picked
        the other branch, a 0 mask hid it), and backward multiplies its gradient by it.
        The event is the node's, with what it saved (as the loss-graph check reads it);
        None in forward or when a NaN input is a gradient. Not called once a forward op
        of the step made NaN: that op is the cause, and its event says so."""
        node: Any = current_autograd_node()
        if node is None or _frames.called_by_nanwatch():
            return None
        saved: set[int] = set()
        for attr in (a for a in dir(node) if a.startswith("_saved_")):
            v = _saved(node, attr)
            if isinstance(v, torch.Tensor) and has_values(v):
                saved.add(v.untyped_storage().data_ptr())
        nan_in = [t for _, t in read if "NaN" in _kinds(t)]
        if not saved or not all(t.untyped_storage().data_ptr() in saved for t in nan_in):
            return None
        self._hidden_said = True
        bad = next(t for t in outs if "NaN" in _kinds(t))
        event = node_event(node, bad, name=name_of(node))
        event.path = node.metadata.get("nanwatch.path")
        ran, (backward_at, backward_code) = self._backward_lines()
        source, code = ran if ran[0] is not None else forward_line(node)
        if source is None:  # made before anomaly mode was on: the call is all we know
            source, code = backward_at, backward_code
        event.source, event.code, event.backward_at = source, code, backward_at
        event.by_grad = _by_grad(sys._getframe())
        event.device = device_name(bad.device)
        self.events.append(event)
        return event

    @staticmethod
    def _collect(
        name: str,
        a: Any,
        inputs: list[tuple[str, torch.Tensor]],
        scalars: dict[str, float | int | str],
        others: list[tuple[str, torch.Tensor]],
    ) -> frozenset[str]:
        """Sort one argument: floating tensors with values into ``inputs``, other tensors
        (integer, bool, empty) into ``others``, numbers and strings into ``scalars``; return
        the non-finite kinds of scalar arguments (a ``-inf`` fill value)."""
        if isinstance(a, torch.Tensor):
            (inputs if has_values(a) else others).append((name, a))
            return frozenset()
        if isinstance(a, (list, tuple)):
            kinds: frozenset[str] = frozenset()
            for j, x in enumerate(a):
                if isinstance(x, torch.Tensor):
                    (inputs if has_values(x) else others).append((f"{name}[{j}]", x))
                else:
                    kinds |= _scalar_kinds(x)
            return kinds
        if isinstance(a, bool):
            if name in _FLAGS:
                scalars[name] = int(a)
            return frozenset()
        if isinstance(a, (int, float)):
            scalars[name] = a
            return _scalar_kinds(a)
        if isinstance(a, str):
            scalars[name] = a
        return frozenset()

    def first(self) -> OpEvent | None:
        """The first birth (see :func:`nanwatch.localize.is_birth`: NaN, +inf, a gradient's
        -inf, a -inf an op that writes no mask made), else the first event."""
        for ev in self.events:
            if is_birth(ev):
                return ev
        for ev in self.events:
            if not ev.injected:
                return ev
        return self.events[0] if self.events else None


def _sigmoid_line(node: Any) -> tuple[str | None, str | None]:
    """The user's line (``file.py:42``, its text) of the sigmoid below autograd ``node``,
    followed through each node's first input for at most :data:`_FLOW_DEPTH` nodes (``log(1
    - p)`` with ``p = torch.sigmoid(z).squeeze(1)`` in a model's forward): read from the
    stack anomaly mode stored on it, so forensic mode alone; (None, None) otherwise."""
    for _ in range(_FLOW_DEPTH + 2):
        if node is None or accumulates_grad(node):
            break
        if name_of(node).startswith("SigmoidBackward"):
            return forward_line(node)
        nxt = getattr(node, "next_functions", ()) or ()
        node = next((n for n, _ in nxt if n is not None), None)
    return None, None


def forward_line(node: Any) -> tuple[str | None, str | None]:
    """The user's line that created autograd ``node`` in forward (``file.py:42``, its text):
    the innermost user frame of the stack anomaly mode stored on it; (None, None) when the
    node was made with anomaly mode off."""
    try:
        tb = node.metadata.get("traceback_")
    except Exception:  # a node without metadata (a C++ function's wrapper)
        return None, None
    return _frames.user_line_from_traceback(tb) if tb else (None, None)


_AUTOGRAD_DIR = os.path.join(os.path.dirname(torch.autograd.__file__), "")
#: the frames through which user code enters the autograd engine (``loss.backward()``,
#: ``torch.autograd.grad``): (file in torch/autograd/, function)
_ENGINE_ENTRIES = frozenset(
    {
        ("__init__.py", "backward"),
        ("__init__.py", "grad"),
        ("graph.py", "_engine_run_backward"),
    }
)


def _enters_engine(f: types.FrameType) -> bool:
    name = f.f_code.co_filename
    if not name.startswith(_AUTOGRAD_DIR):
        return False
    return (name[len(_AUTOGRAD_DIR) :], f.f_code.co_name) in _ENGINE_ENTRIES


def _by_grad(f: types.FrameType | None) -> bool:
    """The backward running on this thread was entered by ``torch.autograd.grad`` (a loop
    that takes its gradients with it), not ``backward()``: read from the engine's entry."""
    while f is not None:
        name = f.f_code.co_filename
        entry = name.startswith(_AUTOGRAD_DIR) and name[len(_AUTOGRAD_DIR) :] == "__init__.py"
        if entry and f.f_code.co_name in ("grad", "backward"):
            return f.f_code.co_name == "grad"
        f = f.f_back
    return False


def _backward_frames(
    start: types.FrameType | None,
) -> tuple[types.FrameType | None, types.FrameType | None]:
    """For an op running in backward: (the innermost user frame called back by the engine,
    the user frame that entered it), each None when absent. The engine runs user code for a
    custom Function's ``backward``, a tensor hook, a checkpointed forward; that frame is
    newer than the engine's entry. Without an entry on this thread's stack (the engine's
    own threads on accelerators) a user frame is one the engine called back."""
    inner: types.FrameType | None = None
    f = start
    while f is not None:
        if _enters_engine(f):
            return inner, _frames.user_frame(f)
        if inner is None and not _frames.is_internal(f.f_code.co_filename):
            inner = f
        f = f.f_back
    return inner, None


@dataclass
class _Creations:
    """Which module's code was running when each autograd node was made, by the node's
    sequence number (numbered per thread in order of creation): segments (first number,
    module path), in order. A node of an op is made just before the op is dispatched, so an
    op's own node is the one before the counter's value at dispatch."""

    starts: list[int] = field(default_factory=list)
    paths: list[str | None] = field(default_factory=list)
    seen: int = 0  #: the counter at the last op

    def same(self, path: str | None) -> bool:
        """Whether ``path`` runs on (the common case: no new segment); counts the op."""
        if not self.paths or self.paths[-1] != path:
            return False
        now = _next_sequence_nr()
        if now is not None:
            self.seen = now
        return True

    def note(self, path: str | None, *, own_node: bool) -> None:
        """An op is about to run in ``path``'s code; ``own_node``: autograd made a node for
        it (the last one made)."""
        now = _next_sequence_nr()
        if now is None:
            return
        if self.paths and self.paths[-1] == path:
            self.seen = now
            return
        # nodes made since the last op and before this op's own belong to the code before
        start = now - 1 if own_node and now > self.seen else now
        self.starts.append(start)
        self.paths.append(path)
        self.seen = now
        if len(self.starts) > _MAX_SEGMENTS:
            del self.starts[: _MAX_SEGMENTS // 2]
            del self.paths[: _MAX_SEGMENTS // 2]

    def owner(self, nr: int) -> tuple[bool, str | None]:
        """(known, path): the module running when node number ``nr`` was made."""
        if not self.starts or nr < self.starts[0] or nr >= max(self.seen, self.starts[-1] + 1):
            return False, None
        i = bisect.bisect_right(self.starts, nr) - 1
        path = self.paths[i]
        if path is _MADE_IN_BACKWARD:
            return False, None
        return True, path


_MAX_SEGMENTS = 16384
#: the "path" of nodes made while backward runs (a double backward): no module's forward
_MADE_IN_BACKWARD = "\x00backward"
_next_sequence_nr: Callable[[], int | None] = getattr(
    getattr(torch._C, "_autograd", None), "_get_sequence_nr", lambda: None
)


def _created_in(node: Any) -> tuple[bool, str | None]:
    """(known, module path) of the code that made ``node``, from the innermost op checker
    active on this thread (forensic mode and replays); (False, None) when none saw it made."""
    modes: list[Any] = getattr(_python_dispatch, "_get_current_dispatch_mode_stack", list)()
    checker = next((m for m in reversed(modes) if isinstance(m, OpChecker)), None)
    if checker is None:
        return False, None
    try:
        nr = int(node._sequence_nr())
    except Exception:  # older torch, or a node type without one
        return False, None
    return checker.created.owner(nr)


class NodeMarks:
    """Which autograd nodes were marked in this step, by a mark kept on the node itself.

    A node's Python object is not the node: torch before 2.13 makes a new one each time
    ``t.grad_fn`` or ``next_functions`` is read once the last one was freed, so ids of
    node objects that are no longer held are reused by other nodes. The mark lives in
    the node's ``metadata`` dict, which is the C++ node's own; a node without one (rare
    custom nodes) is held until :meth:`clear`, which the step boundary calls.
    """

    def __init__(self) -> None:
        self._key = f"nanwatch.mark.{id(self)}"
        self._token = object()
        self._held: dict[int, Any] = {}

    def clear(self) -> None:
        self._token = object()
        self._held = {}

    def add(self, node: Any) -> None:
        try:
            node.metadata[self._key] = self._token
        except Exception:  # no metadata dict on this node type: hold it instead
            self._held[id(node)] = node

    def __contains__(self, node: Any) -> bool:
        try:
            if node.metadata.get(self._key) is self._token:
                return True
        except Exception:
            pass
        return self._held.get(id(node)) is node


class GraphWalk:
    """Every autograd node reachable from ``roots``, each once, depth first; at most
    ``limit`` nodes are looked at (``truncated`` says the walk stopped there). A node for
    which ``prune`` is true counts as looked at but is neither yielded nor descended into.
    The nodes seen are held until the walk ends, so the ids it tells them apart by cannot be
    reused by other nodes' objects meanwhile (see :class:`NodeMarks`)."""

    def __init__(
        self,
        roots: Sequence[Any],
        *,
        prune: Callable[[Any], bool] | None = None,
        limit: int | None = None,
    ) -> None:
        self._stack: list[Any] = list(roots)
        self._prune = prune
        self._limit = limit
        self.truncated = False

    def __iter__(self) -> Iterator[Any]:
        stack, prune, limit = self._stack, self._prune, self._limit
        seen: dict[int, Any] = {}
        while stack:
            if limit is not None and len(seen) >= limit:
                self.truncated = True
                return
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen[id(node)] = node
            if prune is not None and prune(node):
                continue
            yield node
            stack.extend(n for n, _ in node.next_functions)


#: how source code writes the forward op of an autograd node (its name without
#: ``Backward<N>``): a statement found by data flow is named as the op's line only when its
#: text writes the op (see :func:`statement_line`)
_OP_WORDS: dict[str, re.Pattern[str]] = {
    base: re.compile(words)
    for base, words in {
        "Sqrt": r"\bsqrt\b",
        "Rsqrt": r"\brsqrt\b",
        "Pow": r"\*\*|\bpow\b",
        "Div": r"/|\bdiv(ide)?\b|\btrue_divide\b",
        "Reciprocal": r"\breciprocal\b|/",
        "Log": r"\blog\b",
        "Log2": r"\blog2\b",
        "Log10": r"\blog10\b",
        "Log1P": r"\blog1p\b",
        "LinalgVectorNorm": r"\b(vector_)?norm\b",
        "Norm": r"\bnorm\b",
        "Cdist": r"\bcdist\b",
        "Acos": r"\b(acos|arccos)\b",
        "Asin": r"\b(asin|arcsin)\b",
        "Atanh": r"\b(atanh|arctanh)\b",
        "Acosh": r"\b(acosh|arccosh)\b",
        "Atan2": r"\b(atan2|arctan2)\b",
        "Xlogy": r"\bxlogy\b",
        "Lgamma": r"\blgamma\b",
        "Digamma": r"\bdigamma\b",
        "Polygamma": r"\bpolygamma\b",
        "Erfinv": r"\berfinv\b",
        "SpecialEntr": r"\bentr\b",
        "Logsumexp": r"\blogsumexp\b",
        "Exp": r"\bexp\b",
    }.items()
}
_STORES = frozenset({"STORE_FAST", "STORE_NAME", "STORE_GLOBAL", "STORE_DEREF"})


class HeldNodes(dict[str, Any]):
    """:func:`held_nodes`' answer (name -> node), with what the frame could call through
    (``scope``: its other local objects, by weak reference, so that no step keeps them or
    makes a cycle of them; ``module``: the name of its module, whose globals are looked up
    when needed), for :func:`statement_line` to follow a call into the code that made a
    node (a loss ``step()`` that adds a model's penalty method)."""

    scope: dict[str, weakref.ReferenceType[Any]]
    module: str | None


#: local values that are data, not something code could be called through
_DATA = (torch.Tensor, list, tuple, dict, set, frozenset, str, bytes, int, float, complex, bool)


def held_nodes(frame: Any) -> dict[str, Any]:
    """The autograd nodes of the tensors ``frame`` binds to local names (name -> node):
    what :func:`statement_line` reads, taken while the frame runs (references, no read);
    a :class:`HeldNodes`, which also names the frame's other objects weakly."""
    out = HeldNodes()
    out.scope, out.module = {}, frame.f_globals.get("__name__")
    for k, v in list(frame.f_locals.items()):
        if not isinstance(k, str):
            continue
        if isinstance(v, torch.Tensor):
            fn = v.grad_fn
            if fn is not None:
                out[k] = fn
        elif v is not None and not isinstance(v, _DATA):
            with contextlib.suppress(TypeError):  # an object without weak references
                out.scope[k] = weakref.ref(v)
    return out


def statement_line(
    node: Any,
    held: dict[str, Any],
    code: types.CodeType,
    lineno: int,
    *,
    stop: Callable[[Any], bool] | None = None,
    limit: int = 4096,
) -> tuple[str, str] | None:
    """The user's line that created autograd ``node`` in forward, found without anomaly
    mode, from data flow: of the local names of the user's function ``code`` that called
    ``backward()`` at ``lineno`` (``held``: their tensors' nodes, see :func:`held_nodes`),
    the one whose graph reaches ``node`` before it reaches another's (the statement that
    assigned it made the node), at that name's latest assignment above ``lineno``, and the
    line of that statement that writes the node's op (``sqrt`` for a ``SqrtBackward0``).
    None when more than one name reaches it first, or the statement does not write the op
    (it called a helper that did: a line that does not hold the op is no answer), unless
    the code it called is read (see :func:`_op_in_callees`); when no name reaches it, the
    ``backward()`` call at ``lineno`` is that statement (``step().backward()``).
    ``stop``: nodes where the walk ends (the watched modules' outputs). Anomaly-time work:
    a walk per local tensor."""
    words = _OP_WORDS.get(re.sub(r"Backward\d*$", "", name_of(node)))
    if words is None:
        return None
    names: dict[int, list[str]] = {}
    fns: dict[int, Any] = {}
    for k, fn in held.items():
        names.setdefault(id(fn), []).append(k)
        fns[id(fn)] = fn
    owners: list[str] = []
    for key, fn in fns.items():

        def prune(n: Any, fn: Any = fn) -> bool:
            return (n is not fn and id(n) in fns) or accumulates_grad(n) or bool(stop and stop(n))

        if fn is node or any(n is node for n in GraphWalk([fn], prune=prune, limit=limit)):
            owners.extend(names[key])
            if len(owners) > len(names[key]):
                return None  # two locals reach it: which statement made it is not told
    if not owners:
        if isinstance(held, HeldNodes):
            # backward() on a value no local name holds (``step().backward()``,
            # ``focal(out, y).backward()``): the backward() statement computed it, and the
            # line that made the node is in the code that statement called
            return _op_in_callees(node, held, code.co_filename, lineno, targets=None, words=words)
        return None
    lines = []
    current: int | None = None  # before 3.11 an instruction knows only where a line starts
    try:
        for ins in _instructions(code):
            start = ins.starts_line
            if isinstance(start, int) and not isinstance(start, bool):
                current = start
            if ins.opname in _STORES and ins.argval in owners:
                pos = getattr(ins, "positions", None)
                line = pos.lineno if pos is not None and pos.lineno is not None else current
                if line is not None and line <= lineno:
                    lines.append(line)
    except Exception:  # code dis cannot read: no answer
        return None
    if not lines:
        return None
    found = _op_in_statement(code.co_filename, max(lines), set(owners), words)
    if found is None and isinstance(held, HeldNodes):
        # the statement called the code that made the node (``loss = step()``, whose
        # ``model.penalty()`` took the sqrt): the line there that writes the op
        found = _op_in_callees(
            node, held, code.co_filename, max(lines), targets=set(owners), words=words
        )
    return found


def _instructions(code: types.CodeType) -> list[Any]:
    import dis

    return list(dis.get_instructions(code))


def _op_in_statement(
    filename: str, lineno: int, targets: set[str], words: re.Pattern[str]
) -> tuple[str, str] | None:
    """The first line of the assignment to one of ``targets`` at ``lineno`` (the whole
    statement, over several lines) that writes the op ``words`` matches, as
    :func:`_frames.describe_line` says it."""
    first, last = lineno, lineno
    st = _assignment(_parsed(filename), lineno, targets)
    if st is not None:
        first, last = st.lineno, st.end_lineno or st.lineno
    for line in range(first, last + 1):
        raw = linecache.getline(filename, line).split("#", 1)[0]
        if words.search(raw):
            return _frames.describe_line(filename, line)  # type: ignore[return-value]
    return None


def _parsed(filename: str) -> ast.Module | None:
    """The syntax tree of ``filename`` (through :mod:`linecache`), None when unreadable."""
    return _parse("".join(linecache.getlines(filename)))


@functools.lru_cache(maxsize=8)
def _parse(text: str) -> ast.Module | None:
    try:
        return ast.parse(text) if text else None
    except (SyntaxError, ValueError):
        return None


def _assignment(
    tree: ast.Module | None, lineno: int, targets: set[str]
) -> ast.Assign | ast.AugAssign | ast.AnnAssign | None:
    """The assignment to one of ``targets`` whose statement spans ``lineno``."""
    for st in ast.walk(tree) if tree is not None else ():
        if not isinstance(st, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            continue
        if not st.lineno <= lineno <= (st.end_lineno or st.lineno):
            continue
        tgts = st.targets if isinstance(st, ast.Assign) else [st.target]
        if any(isinstance(n, ast.Name) and n.id in targets for t in tgts for n in ast.walk(t)):
            return st
    return None


#: how far calls are followed from the statement that assigned the loss, and how many
#: functions are read at most (anomaly-time work): past either, no line is claimed
_CALL_DEPTH = 4
_CALLEES = 32
#: the autograd nodes (lower case, no ``Backward<N>``) an operator makes
_BINOP_NODES: dict[type[ast.operator], frozenset[str]] = {
    ast.Add: frozenset({"add"}),
    ast.Sub: frozenset({"sub", "rsub"}),
    ast.Mult: frozenset({"mul"}),
    ast.Div: frozenset({"div"}),
    ast.Pow: frozenset({"pow"}),
}
#: how an operator writes an op of :data:`_OP_WORDS`
_BINOP_TEXT: dict[type[ast.operator], str] = {ast.Pow: "**", ast.Div: "/"}
#: tensor methods whose node is not named after them (a view, a cast, ``square``'s pow):
#: an operand made by one tells nothing of the node it feeds
_RENAMED = frozenset(
    {
        "view",
        "reshape",
        "flatten",
        "unflatten",
        "squeeze",
        "unsqueeze",
        "expand",
        "expand_as",
        "permute",
        "transpose",
        "contiguous",
        "clone",
        "to",
        "type",
        "float",
        "double",
        "half",
        "bfloat16",
        "square",
        "matmul",
        "einsum",
    }
)


@dataclass
class _Scope:
    """The names a function's code can be followed through: bound (its ``self``, its
    closure, the calling frame's objects) and its module's globals (builtins are not
    followed). Attributes are read statically: no property or ``__getattr__`` runs."""

    bound: dict[str, Any]
    globals: dict[str, Any]

    def resolve(self, expr: ast.expr) -> Any:
        if isinstance(expr, ast.Name):
            if expr.id in self.bound:
                return self.bound[expr.id]
            if expr.id in self.globals:
                return self.globals[expr.id]
            return getattr(builtins, expr.id, None)
        if isinstance(expr, ast.Attribute):
            base = self.resolve(expr.value)
            return None if base is None else _static_attr(base, expr.attr)
        return None


def _static_attr(obj: Any, name: str) -> Any:
    """``obj.name`` without running user code (a bound method of a function found on the
    class, a submodule of a module); None when it is not plain data."""
    if isinstance(obj, torch.nn.Module):
        sub = obj.__dict__.get("_modules", {}).get(name)
        if sub is not None:
            return sub
    try:
        v = inspect.getattr_static(obj, name)
    except AttributeError:
        return None
    if isinstance(v, staticmethod):
        return v.__func__
    if isinstance(v, classmethod):
        return types.MethodType(v.__func__, obj if isinstance(obj, type) else type(obj))
    if isinstance(v, types.FunctionType):
        plain = isinstance(obj, (type, types.ModuleType)) or name in getattr(obj, "__dict__", {})
        return v if plain else types.MethodType(v, obj)
    if isinstance(v, (property, types.MemberDescriptorType, types.GetSetDescriptorType)):
        return None
    return v


def _callee(obj: Any) -> tuple[types.FunctionType, dict[str, Any]] | None:
    """The user's function a call of ``obj`` runs, with the names bound for it (``self``,
    its closure); None for torch's, a library's, a class or a module call (a module's
    forward makes that module's nodes, not the loss code's)."""
    bound: dict[str, Any] = {}
    fn: Any = obj
    this: Any = None
    if isinstance(obj, types.MethodType):
        fn, this = obj.__func__, obj.__self__
    elif not isinstance(obj, (types.FunctionType, type, types.ModuleType, torch.nn.Module)):
        fn, this = inspect.getattr_static(type(obj), "__call__", None), obj
    if not isinstance(fn, types.FunctionType):
        return None
    code = fn.__code__
    if _frames.is_internal(code.co_filename):
        return None
    if this is not None and code.co_argcount:
        bound[code.co_varnames[0]] = this
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False):
        with contextlib.suppress(ValueError):  # a cell not yet filled
            bound[name] = cell.cell_contents
    return fn, bound


def _definition(code: types.CodeType) -> ast.AST | None:
    """The ``def`` (or ``lambda``) of ``code`` in its file's syntax tree."""
    for n in ast.walk(_parsed(code.co_filename) or ast.Module(body=[], type_ignores=[])):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            starts = {n.lineno, *(d.lineno for d in n.decorator_list)}
            if n.name == code.co_name and code.co_firstlineno in starts:
                return n
        elif (
            isinstance(n, ast.Lambda)
            and code.co_name == "<lambda>"
            and n.lineno == code.co_firstlineno
        ):
            return n
    return None


def _operand_nodes(expr: ast.expr, assigned: dict[str, list[ast.expr]]) -> frozenset[str] | None:
    """The autograd node names (see :data:`_BINOP_NODES`) that can have made the value of
    ``expr``; None when the code does not tell (a name assigned more than once, a call of
    the user's own). A name assigned once is followed to its value, once."""
    if isinstance(expr, ast.Name):
        values = assigned.get(expr.id, [])
        return _operand_nodes(values[0], {}) if len(values) == 1 else None
    if isinstance(expr, ast.BinOp):
        return _BINOP_NODES.get(type(expr.op))
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub):
        return frozenset({"neg"})
    if isinstance(expr, ast.Call):
        f = expr.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if not name or name in _RENAMED:
            return None
        torch_op = any(hasattr(m, name) for m in (torch, torch.Tensor, torch.nn.functional))
        return frozenset({name.replace("_", "").lower()}) if torch_op else None
    return None


def _fits(made: frozenset[str] | None, node: Any) -> bool | None:
    """Whether ``node``'s first input was made by one of ``made`` (``sum`` fits
    ``SumBackward1``, ``norm`` ``LinalgVectorNormBackward0``); None: not told."""
    if made is None:
        return None
    try:
        first = node.next_functions[0][0] if node.next_functions else None
    except Exception:  # an unusual node
        return None
    if first is None:
        return False
    base = re.sub(r"Backward\d*$", "", name_of(first)).rsplit("::", 1)[-1].lower()
    return bool(base) and any(m == base or (len(m) > 2 and m in base) for m in made)


def _writes_op(
    n: ast.AST, words: re.Pattern[str], scope: _Scope
) -> tuple[int, ast.expr | None] | None:
    """(its line, its operand) when ``n`` writes the op ``words`` matches: a call
    (``torch.sqrt(x)``, ``x.sqrt()``) or an operator (``x ** 0.5``)."""
    if isinstance(n, ast.BinOp):
        text = _BINOP_TEXT.get(type(n.op))
        if text is None or not words.search(text):
            return None
        return n.left.end_lineno or n.lineno, n.left
    if not isinstance(n, ast.Call):
        return None
    f = n.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    if not name or not words.search(name):
        return None
    line = f.end_lineno or n.lineno
    if isinstance(f, ast.Attribute) and not isinstance(scope.resolve(f.value), types.ModuleType):
        return line, f.value  # a method of the operand
    return line, n.args[0] if n.args else None


def _other_power(n: ast.AST, node: Any) -> bool:
    """``n`` raises to a number written in the code (``w ** 2``, ``x.pow(3)``) other than
    the exponent the ``PowBackward`` ``node`` saved: another power made it."""
    try:
        saved = node._saved_exponent
    except Exception:  # not a power by a number, or what it saved is gone
        return False
    if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow):
        e: ast.expr | None = n.right
    elif isinstance(n, ast.Call) and n.args and not n.keywords:
        e = n.args[-1]
    else:
        return False
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
        e = e.operand
        saved = -saved if isinstance(saved, (int, float)) else saved
    if not isinstance(e, ast.Constant) or not isinstance(e.value, (int, float)):
        return False
    return isinstance(saved, (int, float)) and not isinstance(saved, bool) and saved != e.value


def _op_in_callees(
    node: Any,
    held: HeldNodes,
    filename: str,
    lineno: int,
    *,
    targets: set[str] | None,
    words: re.Pattern[str],
) -> tuple[str, str] | None:
    """The line that made ``node`` in the user's code that the assignment to ``targets``
    at ``lineno`` called (``loss = step()``, ``step`` adding ``model.penalty()``, whose
    ``torch.sqrt`` made it), or, ``targets`` None, the value the ``backward()`` call at
    ``lineno`` was called on (``step().backward()``), followed by static reads of the
    objects the frame held (see
    :class:`HeldNodes`), of each function's ``self``, closure and globals. Of the lines
    there that write the op, the one whose operand's op made the node's input
    (``torch.sqrt(w.pow(2).sum(-1))`` for a ``SqrtBackward0`` of a ``SumBackward1``, not
    ``torch.sqrt(... + eps)`` in a branch that did not run). None when not exactly one line
    fits, or another could (its operand does not tell), or a function could not be read,
    or the reading reached its bounds. Anomaly-time work."""
    if targets is None:
        root = _backward_receiver(_parsed(filename), lineno)
    else:
        st = _assignment(_parsed(filename), lineno, targets)
        root = st.value if st is not None else None
    if root is None:
        return None
    module = sys.modules.get(held.module) if held.module else None
    objects = {k: v for k, r in held.scope.items() if (v := r()) is not None}
    top = _Scope(objects, vars(module) if module is not None else {})
    todo: list[tuple[str, ast.AST, _Scope, int]] = [(filename, root, top, 0)]
    done: set[types.CodeType] = set()
    lines: dict[tuple[str, int], bool | None] = {}
    while todo:
        file, tree, scope, depth = todo.pop()
        assigned = _assigned(tree)
        for n in ast.walk(tree):
            op = _writes_op(n, words, scope)
            if op is not None and not _other_power(n, node):
                line, operand = op
                fit = _fits(_operand_nodes(operand, assigned), node) if operand else None
                key = (file, line)
                if key not in lines or fit or (fit is None and lines[key] is False):
                    lines[key] = fit
            if not isinstance(n, ast.Call):
                continue
            target = scope.resolve(n.func)
            if target is None and _unknown_call(n.func, tree):
                return None  # code the reading cannot follow ran: the op may be there
            found = _callee(target)
            if found is None or found[0].__code__ in done:
                continue
            fn, bound = found
            definition = _definition(fn.__code__)
            if depth + 1 > _CALL_DEPTH or len(done) >= _CALLEES or definition is None:
                return None  # the user's code the op may be in, unread
            done.add(fn.__code__)
            todo.append(
                (fn.__code__.co_filename, definition, _Scope(bound, fn.__globals__), depth + 1)
            )
    strict = [k for k, fit in lines.items() if fit]
    if len(strict) != 1 or any(fit is None for fit in lines.values()):
        return None
    return _frames.describe_line(*strict[0])  # type: ignore[return-value]


def _backward_receiver(tree: ast.Module | None, lineno: int) -> ast.expr | None:
    """The ``backward()`` call in the statement that spans ``lineno``, with what it
    differentiates: the value it is called on (``step()`` of ``step().backward()``,
    ``scaler.scale(step()).backward()``) or given (``torch.autograd.backward(step())``,
    ``accelerator.backward(step())``, ``torch.autograd.grad(step(), params)``); None when
    the statement holds no such call, or several."""
    found: list[ast.expr] = []
    for st in ast.walk(tree) if tree is not None else ():
        if not isinstance(st, ast.stmt) or isinstance(st, _BLOCKS):
            continue
        if not st.lineno <= lineno <= (st.end_lineno or st.lineno):
            continue
        for n in ast.walk(st):
            if not isinstance(n, ast.Call) or not isinstance(n.func, ast.Attribute):
                continue
            if n.func.attr == "backward" or (n.func.attr == "grad" and n.args):
                found.append(n)
    return found[0] if len(found) == 1 else None


#: statements that hold others: the one that spans a line is the simple one inside
_BLOCKS = (
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.For,
    ast.AsyncFor,
    ast.While,
    ast.If,
    ast.With,
    ast.AsyncWith,
    ast.Try,
    ast.Match,
)


#: what code calls methods of besides tensors: data (``parts.append(x)``, ``d.items()``)
_DATA_TYPES = (torch.Tensor, list, dict, set, str, tuple, bytes)


def _unknown_call(func: ast.expr, tree: ast.AST) -> bool:
    """Whether a call of ``func``, which names nothing the reading found, may run code
    that was not read: a function held in a local or an argument, a callable picked from a
    container (``self.terms[0](w)``); not a method of a tensor or of data, nor a function
    ``tree`` defines itself (its body is read with it)."""
    if isinstance(func, ast.Attribute):
        return not any(hasattr(t, func.attr) for t in _DATA_TYPES)
    if isinstance(func, ast.Name):
        return not any(
            isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == func.id
            for n in ast.walk(tree)
        )
    return True


def _assigned(tree: ast.AST) -> dict[str, list[ast.expr]]:
    """The values each plain name is given in ``tree`` (a loop's or a ``with``'s target,
    a value the code does not tell)."""
    out: dict[str, list[ast.expr]] = {}
    unknown = ast.Constant(value=None)
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                for name in ast.walk(t):
                    if isinstance(name, ast.Name):
                        out.setdefault(name.id, []).append(n.value if name is t else unknown)
        elif isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name):
            out.setdefault(n.target.id, []).append(ast.BinOp(n.target, n.op, n.value))
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.setdefault(n.target.id, []).append(n.value or unknown)
        elif isinstance(n, ast.NamedExpr):
            out.setdefault(n.target.id, []).append(n.value)
        elif isinstance(n, (ast.For, ast.AsyncFor, ast.withitem, ast.comprehension)):
            target = n.optional_vars if isinstance(n, ast.withitem) else n.target
            for name in ast.walk(target) if target is not None else ():
                if isinstance(name, ast.Name):
                    out.setdefault(name.id, []).append(unknown)
    return out


def accumulates_grad(node: Any) -> bool:
    """The node that writes a leaf's ``.grad`` (the graph's end at a weight or input)."""
    return type(node).__name__ == "AccumulateGrad"


def stamp_graph(outputs: Sequence[torch.Tensor], path: str) -> None:
    """Label the autograd nodes a module's forward created with the module's path, so a
    backward op can be traced to its module (forensic mode). Stops at nodes already stamped
    (children complete before parents, so each node gets its innermost module).

    A child's walk also reaches nodes its parent's own code made before calling it (the
    ``sqrt`` whose result the parent passed to the child): where an op checker saw a node
    made, the node gets the module that was running then (the parent, whose call is still
    open), not the child."""
    if replaying():  # what the replay's submodule tracker reads (see _SubmoduleOps)
        _tls.stamped = (frozenset(id(t) for t in outputs), path)
    roots = [t.grad_fn for t in outputs]
    for node in GraphWalk(
        roots, prune=lambda n: "nanwatch.path" in n.metadata or accumulates_grad(n)
    ):
        known, owner = _created_in(node)
        if known and owner is None and path != LOSS_PATH:
            continue  # made by code outside every module: left for the loss code's walk
        node.metadata["nanwatch.path"] = owner if known and owner is not None else path


#: the node class torch makes for a Python ``torch.autograd.Function`` (``MySqrtBackward``)
_BACKWARD_CFUNCTION: type | None = getattr(
    getattr(torch.autograd, "function", None), "BackwardCFunction", None
)
#: the name of such a node: the Function's class name and ``Backward``, no number (torch's
#: own nodes are ``SqrtBackward0``; C++ helpers are ``torch::autograd::CopySlices``)
_CUSTOM_NODE = re.compile(r"^(?P<fn>[A-Za-z_]\w*?)Backward$")


def name_of(node: Any) -> str:
    """``node.name()`` (``"MulBackward0"``), or the node's class name when torch refuses the
    call: a Python custom Function's node whose graph was freed raises RuntimeError on
    ``name()`` in some torch releases (2.11), and a report is no place to crash.

    >>> name_of(torch.ones(1, requires_grad=True).mul(2).grad_fn)
    'MulBackward0'
    """
    try:
        return str(node.name())
    except RuntimeError:
        return type(node).__name__


def custom_function(node: Any) -> str | None:
    """The class name of the ``torch.autograd.Function`` whose backward ``node`` runs, for
    a node of a Python custom Function (``MySqrtBackward`` -> ``MySqrt``); None for torch's
    built-in nodes. ``node`` is the node or its name (a name alone is read by torch's naming
    rule: ``<Function>Backward``, where built-in nodes end in a number)."""
    if isinstance(node, str):
        m = _CUSTOM_NODE.match(node)
        return m.group("fn") if m else None
    if node is None:
        return None
    if _BACKWARD_CFUNCTION is not None and isinstance(node, _BACKWARD_CFUNCTION):
        cls = getattr(node, "_forward_cls", None)
        name = getattr(cls, "__name__", None)
        if isinstance(name, str):
            return name
    try:
        return custom_function(name_of(node))
    except Exception:  # not a node
        return None


def custom_backward_op(function: str) -> str:
    """The ``op`` of an event that names no aten op, only the custom Function whose backward
    made the value: ``MySqrt.backward`` (see :func:`custom_function`)."""
    return f"{function}.backward"


def node_op(name: str) -> str:
    """The forward op of an autograd node: ``PowBackward0`` -> ``aten.pow``,
    ``MseLossBackward0`` -> ``aten.mse_loss``. A node of a custom ``autograd.Function``
    ran the user's own backward, not an aten op: ``MySqrtBackward`` -> ``MySqrt.backward``
    (never a made-up ``aten.my_sqrt``)."""
    fn = custom_function(name)
    if fn is not None:
        return custom_backward_op(fn)
    base = re.sub(r"Backward\d*$", "", name)
    op = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", base).lower()
    if re.search(r"\d_", op) and not hasattr(torch.ops.aten, op):
        # a capital after a digit starts no word (``Log1PBackward0`` is ``aten.log1p``,
        # ``SpecialXlog1PyBackward0`` ``aten.special_xlog1py``): as aten names it
        joined = re.sub(r"(?<=\d)_", "", op)
        op = joined if hasattr(torch.ops.aten, joined) else op
    return "aten." + op


def _saved_order(attr: str) -> tuple[int, str]:
    return ({"_saved_self": 0, "_saved_other": 1}.get(attr, 2), attr)


#: prefix of the ``OpEvent.other_inputs`` names of what a backward op's autograd node saved
#: in forward (``saved self`` of AcosBackward0, ``saved result`` of SqrtBackward0)
SAVED = "saved "


def _saved_forward(node: Any, limit: int = 2) -> list[tuple[str, torch.Tensor]]:
    """The floating tensors autograd ``node`` saved in forward, the forward op's inputs
    (``saved self``) and result (``saved result``), named with :data:`SAVED`; at most
    ``limit``. Empty for a custom Function (it saves no ``_saved_*``)."""
    if custom_function(node) is not None:
        return []
    found: list[tuple[str, torch.Tensor]] = []
    for attr in sorted((a for a in dir(node) if a.startswith("_saved_")), key=_saved_order):
        v = _saved(node, attr)
        if isinstance(v, torch.Tensor) and has_values(v) and v.numel():
            found.append((SAVED + attr.removeprefix("_saved_"), v.detach()))
            if len(found) >= limit:
                break
    return found


def _node_domain_counts(dom: Domain, v: torch.Tensor) -> dict[str, int]:
    """:func:`domain_counts` of the input a backward node saved, with ``n_edge`` also
    counting a steep endpoint (acosh given exactly 1.0, where its derivative is infinite)."""
    counts = domain_counts(dom, v)
    if dom.steep_edges and "n_edge" not in counts and not v.is_complex():
        ends = [e for e in {dom.lo, dom.hi} if math.isfinite(e)]
        with torch.no_grad():
            at = sum(int(torch.eq(v.detach(), e).sum()) for e in ends)
        if at:
            counts["n_edge"] = at
    return counts


#: the ``_saved_*`` attribute names of each autograd node class (``dir`` is slow)
_SAVED_ATTRS: dict[type, tuple[str, ...]] = {}


def _saved_attrs(node: Any) -> tuple[str, ...]:
    cls = type(node)
    found = _SAVED_ATTRS.get(cls)
    if found is None:
        found = _SAVED_ATTRS[cls] = tuple(a for a in dir(node) if a.startswith("_saved_"))
    return found


class SavedNode:
    """An autograd node together with what it saved in forward, taken while autograd still
    held it (in the node's own hook, during backward): read later, after autograd freed its
    saved values, it answers as the node did then. The producers of its saved tensors (the
    log whose -inf a ``torch.where`` kept) are taken too, one level down, since their
    backward frees theirs later in the same pass. No tensor is read when it is taken: it
    holds references, so the memory stays in use until the snapshot is dropped;
    :attr:`nbytes` says how much.

    >>> x = torch.zeros(3, requires_grad=True)
    >>> node = torch.log(x).grad_fn
    >>> snap = SavedNode(node)
    >>> torch.equal(snap._saved_self, x), snap.name(), snap.nbytes
    (True, 'LogBackward0', 12)
    """

    __slots__ = ("_node", "_producers", "_saved", "_versions", "nbytes")

    def __init__(self, node: Any, *, depth: int = 1) -> None:
        self._node = node
        self._saved = {a: _saved(node, a) for a in _saved_attrs(node)}
        self._producers: dict[int, SavedNode] = {}
        tensors = [v for v in self._saved.values() if isinstance(v, torch.Tensor)]
        self._versions = [(t, t._version) for t in tensors]
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if depth > 0:
            for t in tensors:
                fn = t.grad_fn
                if fn is not None and fn is not node and id(fn) not in self._producers:
                    snap = SavedNode(fn, depth=depth - 1)
                    self._producers[id(fn)] = snap
                    self.nbytes += snap.nbytes

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_saved_"):
            if name in self._saved:
                return self._saved[name]
            raise AttributeError(name)
        return getattr(self._node, name)

    def __dir__(self) -> list[str]:
        return sorted({*dir(self._node), *self._saved})

    @property
    def node(self) -> Any:
        """The autograd node itself."""
        return self._node

    def producer(self, fn: Any) -> Any:
        """``fn`` (a saved tensor's ``grad_fn``) with what it saved, when it was taken."""
        return self._producers.get(id(fn), fn)

    def unchanged(self) -> bool:
        """No tensor it holds was written in place since it was taken (an optimizer's update
        of a weight the loss code read), its producers' included: their values are those
        the node saw."""
        return all(t._version == v for t, v in self._versions) and all(
            p.unchanged() for p in self._producers.values()
        )


def real_node(node: Any) -> Any:
    """The autograd node itself, for a :class:`SavedNode` or a node."""
    return node._node if isinstance(node, SavedNode) else node


def node_event(
    node: Any,
    grad: torch.Tensor | None,
    *,
    name: str,
    limit: int = 4,
    out: TensorStat | None = None,
    dtype: str = "",
) -> OpEvent:
    """An event for the autograd node whose backward just made the non-finite gradient
    ``grad``, built in the node's post-hook -- before autograd frees what the node saved
    in forward (its inputs, its result, its scalar arguments), which is the evidence:
    ``self`` with 10 exact zeros and ``exponent`` 0.5 for ``(1 - p) ** 0.5`` at p == 1.
    ``node`` may be None (torch without ``_current_autograd_node``): the name alone; or a
    :class:`SavedNode`, read after backward. Without ``grad`` (read late: a device flag
    said it was bad), ``out`` and ``dtype`` say what it made."""
    inputs: list[tuple[str, TensorStat | None]] = []
    scalars: dict[str, float | int | str] = {}
    path = None
    fn = custom_function(real_node(node)) if node is not None else custom_function(name)
    if node is not None:
        path = node.metadata.get("nanwatch.path")
    if node is not None and fn is None:  # a custom Function saves no ``_saved_*``: none read
        # the forward op's restricted domain (acosh's [1, inf); the logs are NW110's): how
        # many of its saved input lie on an edge or outside, counted exactly
        dom = domain_of(node_op(name))
        if dom is not None and dom.family == "log":
            dom = None
        for attr in sorted((a for a in dir(node) if a.startswith("_saved_")), key=_saved_order):
            try:
                v = getattr(node, attr)
            except Exception:  # freed, or modified in place since (autograd raises)
                v = _kept(node, attr)  # unless a snapshot kept it (saved_from)
                if v is _NOT_KEPT:
                    continue
            key = attr.removeprefix("_saved_")
            if isinstance(v, torch.Tensor):
                if len(inputs) < limit and has_values(v):
                    inputs.append((key, describe(v)))
                    if dom is not None and key == dom.arg:
                        scalars.update(_node_domain_counts(dom, v))
                    if v.grad_fn is not None and _kinds(v) - {"NaN"}:
                        scalars[f"{key}_made_by"] = name_of(v.grad_fn)  # whose inf it holds
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and len(scalars) < limit:
                scalars[key] = v
    if grad is not None:
        out = describe(grad) or TensorStat(math.nan, math.nan, 0)
        dtype = dtype_name(grad.dtype)
    elif out is None:
        out = TensorStat(math.nan, math.nan, 0)
    cause = _saved_cause(node) if node is not None and fn is None and out.has_nan else None
    return OpEvent(
        cause=cause,
        op=custom_backward_op(fn) if fn is not None else node_op(name),
        phase=Phase.BACKWARD,
        path=path,
        born=out.kinds(),
        output=out,
        inputs=inputs,
        scalars=scalars,
        node=name,
        dtype=dtype,
        made_from=made_from(node) if node is not None else [],
        made_from_history=operand_history(node) if node is not None else [],
    )


def _saved_cause(node: Any) -> OpEvent | None:
    """A backward node made NaN from a saved forward value holding an infinity (0 × -inf:
    torch.where's zero gradient times the log(0) it hid): the forward op that made the
    infinity, read from its own node's saved values (``LogBackward0``'s input of zeros);
    None when the value has no node (made from tensors that need no gradient)."""
    for attr in sorted((a for a in dir(node) if a.startswith("_saved_")), key=_saved_order):
        v = _saved(node, attr)
        if not isinstance(v, torch.Tensor) or not has_values(v):
            continue
        producer = v.grad_fn
        if producer is None or not (_kinds(v) - {"NaN"}):
            continue
        if isinstance(node, SavedNode):  # read after backward: the producer as it was
            producer = node.producer(producer)
        if attr == "_saved_result" or real_node(producer) is real_node(node):
            # the node's own forward made it (ExpBackward0 keeps exp's inf result): the
            # node's event already says that op overflowed in forward, then 0 x inf here
            continue
        try:
            return _node_event(producer, None, frozenset())
        except Exception:  # an unusual node: no cause
            return None
    return None


@dataclass
class ReplayResult:
    """What a replay found: the op events, and whether it ran clean (a transient suspect)."""

    events: list[OpEvent] = field(default_factory=list)
    error: str | None = None
    #: the replayed code drew random numbers (dropout, randint, ...): a clean replay then
    #: says nothing about the original run, whose draws were others
    random: bool = False
    attempts: int = 0  #: how many times the code was run
    #: the first attempt started from the generators' state the original forward started
    #: with (``rng`` of :func:`replay`): its draws were the original ones
    same_draws: bool = False
    #: the non-finite kinds the replayed forward's output held (``NaN``, ``+inf``, ``-inf``):
    #: a replay with no event whose output is non-finite made the value again from a
    #: non-finite tensor it read (a weight, a buffer), not a transient fault
    output: frozenset[str] = frozenset()
    #: the outputs of each call of ``keep`` (see :func:`replay`) in the last attempt, in order
    kept: list[Any] = field(default_factory=list)
    #: the events (by id) that the replayed forward's non-finite output was made of: the op
    #: that made each bad output value and the causes it named, back to the first
    reached: frozenset[int] = frozenset()

    @property
    def clean(self) -> bool:
        return not self.events and self.error is None

    @property
    def new_draws(self) -> bool:
        """The events' numbers come from random draws other than the original run's."""
        return self.random and not (self.same_draws and self.attempts == 1)

    @property
    def conclusive(self) -> bool:
        """A clean replay is evidence of a transient fault only if it ran the same
        computation: one that drew no random numbers."""
        return not (self.clean and self.random)

    def first(self) -> OpEvent | None:
        """The first birth (see :func:`nanwatch.localize.is_birth`) that the output was made
        of, or that a submodule's output was (the first module output to go bad, as watch
        mode's records would show), else the first birth, else the first event that is not
        injected. An inf that a later op absorbed (tanh's ``x**3`` term in GELU, saturating
        to 1) reached nothing: the NaN that did reach the output is born later. A NaN that
        an earlier child returned is its own, though later code drops it (a graph layer's
        isolated node, which the next layer's aggregation never reads) and the next child
        makes the output's NaN again by the same code."""
        for ev in self.events:
            if id(ev) in self.reached and is_birth(ev):
                return ev
        for ev in self.events:
            if is_birth(ev):
                return ev
        for ev in self.events:
            if not ev.injected:
                return ev
        return None


def _reached(chk: OpChecker, out: Any) -> frozenset[int]:
    """The ids of the events ``chk`` recorded that ``out``'s non-finite tensors were made
    of: the maker of each, and the causes each names, back to the first."""
    found: set[int] = set()
    for _, t in iter_tensors(out, ""):
        ev = chk.maker(t) if _kinds(t) else None
        while ev is not None and id(ev) not in found:
            found.add(id(ev))
            ev = ev.cause
    return frozenset(found)


def _note_left(chk: OpChecker, output: Any) -> None:
    """Adds to ``chk.left`` the events a submodule's ``output`` was made of (see
    :func:`_reached`). Only a tensor the checker saw made non-finite is read, with the
    dispatch modes off (the checker's own read is no op of the forward)."""
    try:
        made = [t for _, t in iter_tensors(output, "") if chk.maker(t) is not None]
        if made:
            with _python_dispatch._disable_current_modes():
                chk.left |= _reached(chk, made)
    except Exception:  # nanwatch must never break the replay it runs
        return


def _devices(objs: Sequence[Any]) -> set[torch.device]:
    return {t.device for t in leaves(list(objs)) if isinstance(t, torch.Tensor)}


@contextlib.contextmanager
def preserved_state(
    module: torch.nn.Module | None, devices: set[torch.device]
) -> Iterator[ModuleState]:
    """Save RNG state (CPU and the given CUDA devices) and the module's state (its buffers
    and what its submodules hold as plain attributes, see :class:`ModuleState`); put them
    back afterwards whatever happens. Yields the :class:`ModuleState`, whose
    :meth:`~ModuleState.restore` puts the state back in between (a second run of the
    forward starts from what the first one found).

    Buffers go back with their autograd version counters: the forward being replayed may
    have saved one for backward (``x / self.scale``, BatchNorm's running statistics in eval
    mode), and a restored buffer that looked modified in place would make the user's
    ``backward()`` raise. A buffer the replay left as it was is not written at all (where
    torch cannot set a version counter, that keeps the common case working)."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = {d: torch.cuda.get_rng_state(d) for d in devices if d.type == "cuda"}
    host_rng = _host_rng_states()
    state = ModuleState(module)
    try:
        yield state
    finally:
        state.restore()
        torch.set_rng_state(cpu_rng)
        for d, rng in cuda_rng.items():
            torch.cuda.set_rng_state(rng, d)
        _set_host_rng_states(host_rng)


class ModuleState:
    """What a forward may change of ``module`` and its submodules, saved now: the values of
    the buffers and of the tensors they hold as plain attributes and need no gradient
    (``self.count = torch.zeros(())`` that ``self.count += 1`` writes in place), each with
    its version counter; which object each attribute name is bound to (``self.last = y``,
    ``self.calls += 1``, a buffer, parameter or submodule rebound by name), and which names
    are bound at all (``self.cache = x`` set the first time the forward runs, a buffer
    registered lazily); and what each list and dict attribute holds (a cache the forward
    appends to). :meth:`restore` puts all of it back: a name the forward bound anew is
    deleted, one it rebound or deleted is bound again to what it held. Parameters are not
    copied: that would double the model's memory for the rare forward that writes its
    weights (``nn.Embedding(max_norm=...)`` renormalizes rows in place)."""

    def __init__(self, module: torch.nn.Module | None) -> None:
        self._values: list[tuple[torch.Tensor, torch.Tensor, int | None]] = []
        # each module's names and what they are bound to: its ``__dict__`` (less the tables
        # every module holds), and its tables of parameters, buffers and submodules
        self._names: list[tuple[dict[str, Any], dict[str, Any], frozenset[str]]] = []
        self._sets: list[tuple[set[Any], set[Any]]] = []
        self._containers: list[tuple[list[Any] | dict[Any, Any], Any]] = []
        if module is None:
            return
        tensors: dict[int, torch.Tensor] = {id(b): b for b in module.buffers()}
        for m in module.modules():
            attrs = vars(m)
            self._names.append(
                (attrs, {k: v for k, v in attrs.items() if k not in _MODULE_TABLES}, _MODULE_TABLES)
            )
            for key in ("_parameters", "_buffers", "_modules"):
                table = attrs.get(key)
                if isinstance(table, dict):  # a ScriptModule's are torch's own objects
                    self._names.append((table, dict(table), frozenset()))
            kept = attrs.get("_non_persistent_buffers_set")
            if type(kept) is set:
                self._sets.append((kept, set(kept)))
            for name, v in attrs.items():
                if name in _MODULE_TABLES:
                    continue
                if isinstance(v, torch.Tensor):
                    if (
                        not isinstance(v, torch.nn.Parameter)
                        and not v.requires_grad
                        and _plain_tensor(v)
                    ):
                        tensors.setdefault(id(v), v)
                elif type(v) is list:
                    self._containers.append((v, list(v)))
                elif type(v) is dict:
                    self._containers.append((v, dict(v)))
        with torch.no_grad():
            self._values = [
                (t, t.detach().clone(), _version(t)) for t in tensors.values() if not t.is_meta
            ]

    def restore(self) -> None:
        """Put the saved state back (and again each time it is called). A tensor whose
        values and version are as saved is not written at all."""
        for live, saved, tables in self._names:
            for name in [k for k in live if k not in saved and k not in tables]:
                del live[name]  # bound by the forward run since: it was not there
            for name, v in saved.items():
                if live.get(name, _MISSING) is not v:
                    live[name] = v
        for kept, names in self._sets:
            if kept != names:
                kept.clear()
                kept.update(names)
        for box, items in self._containers:
            if isinstance(box, list):
                if len(box) != len(items) or any(map(operator.is_not, box, items)):
                    box[:] = items
            elif box.keys() != items.keys() or any(box[k] is not v for k, v in items.items()):
                box.clear()
                box.update(items)
        changed: list[tuple[torch.Tensor, int]] = []
        with torch.no_grad():
            for t, copy, version in self._values:
                if version is not None and _version(t) == version and torch.equal(t, copy):
                    continue  # as it was: leave it, version and all
                # a kernel may write a buffer without counting it (batch_norm's running
                # statistics): restore whatever differs
                t.copy_(copy)
                if version is not None:
                    changed.append((t, version))
        set_versions([t for t, _ in changed], [v for _, v in changed])


def _plain_tensor(t: torch.Tensor) -> bool:
    """A dense tensor of torch's own that a copy and a compare can handle, and that code
    outside inference mode can write (an inference tensor it cannot)."""
    return (
        type(t) is torch.Tensor
        and t.layout is torch.strided
        and not (t.is_nested or t.is_meta or t.is_inference())
    )


_MISSING = object()

#: what every ``nn.Module`` holds in its ``__dict__`` (its tables of parameters, buffers,
#: children and hooks; ``training``): not state a forward changes
_MODULE_TABLES = frozenset(vars(torch.nn.Module()))


def _host_rng_states() -> list[tuple[str, Any]]:
    """The global generators a forward may draw from outside torch: Python's ``random``
    and, when the program imported it, NumPy's legacy global one (``np.random.rand``). A
    replay that draws from them must give the draws back, or the watched run trains on
    other numbers than the unwatched one."""
    states: list[tuple[str, Any]] = [("random", random.getstate())]
    np = sys.modules.get("numpy")
    if np is not None:
        with contextlib.suppress(Exception):
            states.append(("numpy", np.random.get_state()))
    return states


def _set_host_rng_states(states: list[tuple[str, Any]]) -> None:
    for kind, state in states:
        if kind == "random":
            random.setstate(state)
        else:
            with contextlib.suppress(Exception):
                sys.modules["numpy"].random.set_state(state)


def _same_host_state(a: tuple[str, Any], b: tuple[str, Any]) -> bool:
    if a[0] != b[0]:
        return False
    if a[0] == "random":
        return bool(a[1] == b[1])
    (name_a, keys_a, *rest_a), (name_b, keys_b, *rest_b) = a[1], b[1]
    return bool(name_a == name_b and (keys_a == keys_b).all() and rest_a == rest_b)


def _version(t: torch.Tensor) -> int | None:
    try:
        return int(t._version)
    except RuntimeError:  # an inference tensor: no version counter
        return None


def rng_states(devices: set[torch.device]) -> list[Any]:
    """The CPU generator's state, that of each CUDA device in ``devices``, and Python's
    and NumPy's global generators' (see :func:`_host_rng_states`)."""
    states: list[Any] = [torch.get_rng_state()]
    states += [torch.cuda.get_rng_state(d) for d in sorted(devices, key=str) if d.type == "cuda"]
    states += _host_rng_states()
    return states


def forward_rng(args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any] | None:
    """The CPU generator's state as a call on ``args``, ``kwargs`` begins, for
    :func:`replay`'s ``rng`` (one host-side copy, about 1 us: taken once per root call, so
    Python's and NumPy's generators, 10 to 50 us each, are not copied; a replay that draws
    from them is told apart by :func:`replay`); None when an input is on an accelerator,
    where watch mode does not replay."""
    devices = _devices([args, kwargs])
    if any(d.type != "cpu" for d in devices):
        return None
    return [torch.get_rng_state()]


def _autocast_or_not(state: tuple[tuple[str, torch.dtype], ...] | None) -> Any:
    """:func:`nanwatch._compat.autocast_as` ``state``; None: autocast left as it is."""
    return contextlib.nullcontext() if state is None else autocast_as(state)


def set_rng_states(states: list[Any], devices: set[torch.device]) -> bool:
    """Put back the generator states :func:`forward_rng` (the CPU generator's) or
    :func:`rng_states` took for the same ``devices``; False (and nothing set) when they do
    not match (another device, NumPy imported since)."""
    if not states or not isinstance(states[0], torch.Tensor):
        return False
    if len(states) == 1:  # forward_rng's: the CPU generator only
        if any(d.type != "cpu" for d in devices):
            return False
        torch.set_rng_state(states[0])
        return True
    cuda = [d for d in sorted(devices, key=str) if d.type == "cuda"]
    if len(states) != len(rng_states(devices)):
        return False
    torch.set_rng_state(states[0])
    for d, state in zip(cuda, states[1 : 1 + len(cuda)], strict=True):
        torch.cuda.set_rng_state(state, d)
    _set_host_rng_states(states[1 + len(cuda) :])
    return True


def _host_drew(before: list[Any]) -> bool:
    """Whether Python's or NumPy's generator moved since ``before`` (:func:`rng_states`,
    whose host states come last)."""
    after = _host_rng_states()
    then = before[len(before) - len(after) :] if len(before) >= len(after) else []
    return len(then) != len(after) or not all(
        _same_host_state(a, b) for a, b in zip(then, after, strict=True)
    )


def drew_random(before: list[Any], devices: set[torch.device]) -> bool:
    """Whether a generator moved since ``before`` (see :func:`rng_states`)."""
    after = rng_states(devices)
    if len(after) != len(before):  # NumPy was imported in between: it drew, as far as known
        return True
    for a, b in zip(before, after, strict=True):
        same = torch.equal(a, b) if isinstance(a, torch.Tensor) else _same_host_state(a, b)
        if not same:
            return True
    return False


def _user_hooks(hooks: dict[int, Any], after: int | None = None) -> list[tuple[int, Any]]:
    """The hooks of a module hook dictionary that are not nanwatch's own, in order; with
    ``after``, only those that come after the hook with that id."""
    items = list(hooks.items())
    if after is not None:
        ids = [k for k, _ in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    return [(k, h) for k, h in items if k not in _copies._ids]


def call_forward(
    module: torch.nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    *,
    pre_hooks: bool | int = True,
    modes: tuple[Any, ...] = (),
) -> Any:
    """``module(*args, **kwargs)`` as ``nn.Module.__call__`` runs it, with the user's forward
    pre-hooks and forward hooks (global and the module's) and none of nanwatch's: a hook
    that divides by a norm is part of the computation. ``pre_hooks``: True when ``args`` are
    what the caller passed; False when they are what ``forward`` got (pre-hooks already
    applied); a hook id: ``args`` are what that hook saw, so the pre-hooks after it run.
    It runs as the user's code ran (:func:`nanwatch._compat.as_called`): torch-function
    handling on, under ``modes`` (the call's TorchFunctionModes, such as the default
    device) again."""
    with as_called(modes):
        return _call_forward(module, args, kwargs, pre_hooks)


def _call_forward(
    module: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any], pre_hooks: bool | int
) -> Any:
    mm = torch.nn.modules.module
    args, kwargs = run_pre_hooks(module, args, kwargs, pre_hooks=pre_hooks)
    result = module.forward(*args, **kwargs)
    global_kw = getattr(mm, "_global_forward_hooks_with_kwargs", {})
    posts = _user_hooks(getattr(mm, "_global_forward_hooks", {}))
    posts += _user_hooks(module._forward_hooks)
    for hook_id, hook in posts:
        if hook_id in module._forward_hooks_with_kwargs or hook_id in global_kw:
            got = hook(module, args, kwargs, result)
        else:
            got = hook(module, args, result)
        if got is not None:
            result = got
    return result


def run_pre_hooks(
    module: torch.nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    *,
    pre_hooks: bool | int = True,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments ``module.forward`` gets from ``args``/``kwargs`` after the user's
    forward pre-hooks that ``pre_hooks`` selects (see :func:`call_forward`) ran."""
    mm = torch.nn.modules.module
    args = tuple(args)
    if pre_hooks is not False:
        after = None if isinstance(pre_hooks, bool) else pre_hooks
        pres = _user_hooks(module._forward_pre_hooks, after)
        if after is None:
            pres = _user_hooks(getattr(mm, "_global_forward_pre_hooks", {})) + pres
        with_kwargs = module._forward_pre_hooks_with_kwargs
        for hook_id, hook in pres:
            if hook_id in with_kwargs:
                got = hook(module, args, kwargs)
                if got is not None:
                    args, kwargs = got
                    args = tuple(args)
            else:
                got = hook(module, args)
                if got is not None:
                    args = got if isinstance(got, tuple) else (got,)
    return args, kwargs


class _SubmoduleOps:
    """During a replay, gives the forward ops a submodule ran (between its forward pre-hook
    and its forward hook) that submodule's path, where they got the enclosing module's: the
    watcher pushes no path for a module it watches from its forward hook alone (a norm, an
    activation), so a GroupNorm whose variance overflowed would be named by its parent. The
    path is the one the watcher stamped that very call's outputs with (:func:`stamp_graph`);
    a module that returns what it was given ran no op and keeps none. ``names``: the path of
    a submodule whose calls the watcher does not hook (sentinel mode hooks the roots alone),
    None for others: its calls push that path (:func:`push_path`) for the ops they run."""

    def __init__(
        self,
        module: torch.nn.Module,
        keep: torch.nn.Module | None = None,
        names: Callable[[torch.nn.Module], str | None] | None = None,
    ) -> None:
        self.checker: OpChecker | None = None
        self.keep = keep
        self.kept: list[Any] = []  # what each call of ``keep`` returned (see replay)
        self._names = names
        self._starts: list[int] = []
        self._pushed: list[bool] = []  # per open call: whether its pre-hook pushed a path
        self._depth = 0  # the path stack's depth as the attempt began (see unwind)
        self._handles: list[Any] = []
        for m in module.modules():
            if m is module:
                continue
            try:  # a scripted submodule takes no Python hooks: its ops keep the parent's path
                pre = m.register_forward_pre_hook(self._pre)
            except Exception:
                continue
            self._handles.append(pre)
            try:
                self._handles.append(m.register_forward_hook(self._post))
            except Exception:
                pre.remove()
                self._handles.remove(pre)

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        chk = self.checker
        self._starts.append(len(chk.events) if chk is not None else 0)
        path = self._names(module) if self._names is not None else None
        if path is not None:
            push_path(path)
        self._pushed.append(path is not None)

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        start = self._starts.pop() if self._starts else None
        if self._pushed and self._pushed.pop():
            pop_path()
        if module is self.keep:
            self.kept.append(output)
        chk, stamped = self.checker, getattr(_tls, "stamped", None)
        if chk is not None:
            _note_left(chk, output)
        _tls.stamped = None
        if chk is None or start is None or stamped is None:
            return
        ids, path = stamped
        try:
            outs = frozenset(id(t) for _, t in iter_tensors(output, ""))
        except Exception:  # nanwatch must never break the replay it runs
            return
        if not ids or ids != outs:
            return  # not this call's stamp (a module the watcher does not watch)
        enclosing = replay_path()
        for ev in chk.events[start:]:
            if ev.phase is Phase.FORWARD and ev.path == enclosing:
                ev.path = path

    def begin(self) -> None:
        """An attempt of the replay begins: no submodule call is open."""
        self._starts.clear()
        self._pushed.clear()
        self._depth = len(getattr(_tls, "paths", None) or ())

    def unwind(self) -> None:
        """An attempt ended: the paths pushed by submodule calls that raised (their forward
        hook never ran) are popped, so the stack is as the attempt found it."""
        stack = getattr(_tls, "paths", None)
        if stack is not None:
            del stack[self._depth :]
        self._starts.clear()
        self._pushed.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


@contextlib.contextmanager
def named_calls(
    modules: Sequence[torch.nn.Module], names: Callable[[torch.nn.Module], str | None]
) -> Iterator[None]:
    """While a replay runs ``modules`` through the user's own code (``nw.replay(step_fn)``),
    the calls of their submodules that ``names`` gives a path (those no hook names, see
    :class:`_SubmoduleOps`) push it for the ops they run; the hooks are removed, and the
    paths of calls that raised popped, on exit."""
    trackers: list[_SubmoduleOps] = []
    depth = len(getattr(_tls, "paths", None) or ())
    try:
        for m in modules:
            trackers.append(_SubmoduleOps(m, None, names))
        yield
    finally:
        for t in trackers:
            t.remove()
        stack = getattr(_tls, "paths", None)
        if stack is not None:
            del stack[depth:]


def replay(
    module: torch.nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    *,
    path: str,
    current_path: Callable[[], str | None] | None = None,
    on_error: Callable[[BaseException], None] | None = None,
    attempts: int = 8,
    pre_hooks: bool | int = True,
    hold: Callable[[torch.Tensor], bool] | None = None,
    call_site: tuple[str, str | None] | None = None,
    rng: list[Any] | None = None,
    keep: torch.nn.Module | None = None,
    autocast: tuple[tuple[str, torch.dtype], ...] | None = None,
    modes: tuple[Any, ...] = (),
    names: Callable[[torch.nn.Module], str | None] | None = None,
    param_of: Callable[[torch.Tensor], tuple[str, str] | None] | None = None,
) -> ReplayResult:
    """Re-run ``module(*args, **kwargs)`` (its forward and the user's hooks on it, see
    :func:`call_forward`) under :class:`OpChecker` with ``torch.no_grad()``; RNG state and
    the module's state (see :class:`ModuleState`) are restored afterwards. A forward that
    raised under ``no_grad`` for want of gradients (one that differentiates itself:
    ``torch.autograd.grad(..., create_graph=True)`` of a PINN's du/dx, a gradient penalty;
    see :func:`grad_caused`) is run once more, from the same state and draws, with
    gradients on as the user's ran (see :func:`_grad_mode`), the ``.grad`` of the
    parameters and of the inputs set aside (:func:`_grads_set_aside`): the backward ops it
    runs are checked, and what its result holds is theirs. Any other error is the code's
    own: ``result.error`` says it, and the forward is not run again. The module's
    non-finite parameters and buffers are held as given (:meth:`OpChecker.hold_state`), or
    only those ``hold`` says. Every watcher's hooks stay quiet during the replay (they only
    track which module is running).

    A forward that draws random numbers (dropout, ``torch.randint``) cannot repeat the
    original draws, which are gone: it is run again with new draws, up to ``attempts``
    times, until one reproduces a non-finite value; ``result.random`` says so. ``rng``: the
    generators' states as the original call began (:func:`rng_states` of the inputs'
    devices): the first attempt starts from them and repeats the original draws
    (``result.same_draws``); the events of an attempt with new draws are marked
    (:func:`nanwatch.localize.redrawn`), since their numbers are not the run's.
    ``call_site``: (``file.py:42``, its text), the line that called ``module``, given to an
    op that has no user line of its own (see :func:`call_line`); without it such an op
    gets the user's line that is running (right for a root replayed in its own hook).
    ``keep``: ``module`` or a submodule of it whose outputs are handed back
    (``result.kept``): a value read after its call ended was freed by then, and the replay
    made it again (anomaly-time work only). ``autocast``: the autocast state the original
    call ran under (:func:`nanwatch._compat.autocast_state`), for a replay made after it
    returned, outside the user's ``torch.autocast`` region; None: as it is now (a replay
    inside the call, under its autocast already). The forward runs with torch-function
    handling on, as the user's code ran (nanwatch's hooks turn it off for their own
    work), under ``modes``: the TorchFunctionModes the original call ran under
    (``torch.set_default_device``, a user's mode), those out of force now entered again
    (see :func:`nanwatch._compat.as_called`). ``names``: the path of each submodule whose
    calls no hook names during the replay (see :class:`_SubmoduleOps`), so that an op a
    child of ``module`` ran is told as that child's. ``param_of``: the name of a watched
    parameter an op reads (see :class:`OpChecker`)."""
    result = ReplayResult()
    floor = sys._getframe()
    devices = _devices([args, kwargs])
    tracker = _SubmoduleOps(module, keep if keep is not module else None, names)
    try:
        with preserved_state(module, devices) as state, _replay_scope():
            same = rng is not None and set_rng_states(rng, devices)
            # only the CPU generator was given back (forward_rng): the first attempt repeats
            # the original draws unless it drew from Python's or NumPy's generator too
            host_only_given = same and rng is not None and len(rng) == 1

            def run(grad: bool) -> tuple[OpChecker, Any, BaseException | None]:
                chk = OpChecker(
                    current_path=current_path or replay_path, on_error=on_error, param_of=param_of
                )
                tracker.checker = chk
                chk.floor, chk.call_site = floor, call_site
                chk.hold_state(
                    t for t in (*module.parameters(), *module.buffers()) if hold is None or hold(t)
                )
                tracker.kept = []
                push_path(path)
                tracker.begin()
                out: Any = None
                error: BaseException | None = None
                mode = _grad_mode() if grad else torch.no_grad()
                try:
                    with (
                        _grads_set_aside(module, args, kwargs, grad),
                        mode,
                        _autocast_or_not(autocast),
                        chk,
                    ):
                        out = call_forward(module, args, kwargs, pre_hooks=pre_hooks, modes=modes)
                except Exception as exc:
                    error = exc
                finally:
                    tracker.unwind()
                    pop_path()
                return chk, out, error

            for _ in range(max(1, attempts)):
                if result.attempts:
                    state.restore()  # each attempt starts from the state the first found
                before = rng_states(devices)
                chk, out, error = run(False)
                if error is not None and grad_caused(error):
                    # a forward that differentiates itself (``torch.autograd.grad`` of its
                    # own output, a PINN's du/dx) raises under no_grad: run it once more,
                    # from the same state and draws, with gradients on, as the user's ran
                    state.restore()
                    set_rng_states(before, devices)
                    again = run(True)
                    if again[2] is None or (again[0].events and not chk.events):
                        chk, out = again[0], again[1]
                        error = again[2] and error  # both raised: the first error is said
                result.error = None if error is None else f"{type(error).__name__}: {error}"
                result.events = chk.events
                result.output = frozenset().union(*(_kinds(t) for _, t in iter_tensors(out, "")))
                result.reached = _reached(chk, out) | chk.left
                result.kept = [out] if keep is module else tracker.kept
                result.attempts += 1
                drew = drew_random(before, devices)
                result.random = result.random or drew
                if result.attempts == 1:
                    result.same_draws = same and not (
                        host_only_given and drew and _host_drew(before)
                    )
                if drew and not (result.same_draws and result.attempts == 1):
                    mark_redrawn(chk.events, result.attempts)
                if not (drew and result.clean):
                    break
    finally:
        tracker.remove()
        _tls.stamped = None
    return result


@contextlib.contextmanager
def _grad_mode() -> Iterator[None]:
    """Gradients on, and each autograd node keeps the line that made it (anomaly mode, its
    NaN checks off): a backward op that the replayed forward runs is told by its line."""
    with torch.enable_grad(), torch.autograd.set_detect_anomaly(True, False):
        yield


@contextlib.contextmanager
def _grads_set_aside(
    module: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any], grad: bool
) -> Iterator[None]:
    """With ``grad`` (a replay run with gradients on), the ``.grad`` of the module's
    parameters and of the inputs' leaf tensors that require grad are set aside and put
    back afterwards, the same objects: what the replayed forward's own backward wrote there
    (a ``loss.backward()`` inside it) is dropped, and the user's gradients are as they
    were. ``torch.autograd.grad`` writes no ``.grad`` at all."""
    if not grad:
        yield
        return
    leaves_ = [t for _, t in iter_tensors([args, kwargs], "")]
    kept: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for t in (*module.parameters(), *leaves_):
        if t.requires_grad and t.is_leaf and id(t) not in kept:
            kept[id(t)] = (t, t.grad)
            t.grad = None
    try:
        yield
    finally:
        for t, g in kept.values():
            t.grad = g


#: what torch says when a tensor that should carry a graph has none: what grad mode off
#: makes of a forward that differentiates itself
_NO_GRAPH = re.compile(
    r"(does not|doesn't) require grad|(does not|doesn't) have a grad_fn|has no grad_fn",
    re.IGNORECASE,
)


def _differentiating_code() -> frozenset[types.CodeType]:
    """The code of torch's entry points that differentiate (``torch.autograd.grad``,
    ``torch.autograd.backward``, ``Tensor.backward``)."""
    found = set()
    for f in (torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward):
        code = getattr(inspect.unwrap(f), "__code__", None)
        if code is not None:
            found.add(code)
    return frozenset(found)


_DIFFERENTIATING = _differentiating_code()


def grad_caused(exc: BaseException) -> bool:
    """Whether grad mode off can be why ``exc`` was raised: it, or an exception it was
    raised from, says a tensor has no graph (``element 0 of tensors does not require grad
    and does not have a grad_fn``), or was raised inside ``torch.autograd.grad`` or a
    ``backward()`` the code called. Any other error is the code's own, and running it
    again with gradients on would only hide it."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if _NO_GRAPH.search(str(e)):
            return True
        tb = e.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code in _DIFFERENTIATING:
                return True
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    return False


def forward_again(
    module: torch.nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    *,
    grad: bool,
    state: ModuleState,
    devices: set[torch.device],
    pre_hooks: bool | int = True,
    modes: tuple[Any, ...] = (),
    retry: Callable[[], None] | None = None,
) -> Any:
    """:func:`call_forward` with gradients on or off (``grad``), retried as :func:`replay`
    retries: a forward that raised with gradients off for want of them (see
    :func:`grad_caused`) is run once more with gradients on (:func:`_grad_mode`, the
    ``.grad`` of its parameters and inputs set aside), from the module ``state`` (put back
    with :meth:`ModuleState.restore`) and the generators' states it began with; ``retry``
    is called first (a caller's own bookkeeping of the failed run). Any other error, and
    the first one when the second run raises too, is raised as it was."""
    before = rng_states(devices)
    try:
        with torch.set_grad_enabled(grad):
            return call_forward(module, args, kwargs, pre_hooks=pre_hooks, modes=modes)
    except Exception as exc:
        if grad or not grad_caused(exc):
            raise
        first = exc
    state.restore()
    set_rng_states(before, devices)
    if retry is not None:
        retry()
    try:
        with _grads_set_aside(module, args, kwargs, True), _grad_mode():
            return call_forward(module, args, kwargs, pre_hooks=pre_hooks, modes=modes)
    except Exception:  # the second run's error: the first one is the code's
        pass
    raise first


def call_line(parent: torch.nn.Module, attr: str) -> tuple[str, str | None] | None:
    """(``file.py:42``, its text): the one line of ``parent``'s forward that calls its
    child ``attr`` (``h = self.norm(x)``), read from the source; None when the forward is
    not the user's (a torch container), cannot be read, or calls it on several lines."""
    fwd = getattr(type(parent), "forward", None)
    try:
        lines, first = inspect.getsourcelines(fwd)  # type: ignore[arg-type]
        file = inspect.getsourcefile(fwd)  # type: ignore[arg-type]
        params = list(inspect.signature(fwd).parameters)  # type: ignore[arg-type]
    except (OSError, TypeError, ValueError):
        return None
    if file is None or _frames.is_internal(file) or not params:
        return None
    pattern = re.compile(rf"\b{re.escape(params[0])}\.{re.escape(attr)}\s*\(")
    hits = [first + i for i, ln in enumerate(lines) if pattern.search(ln)]
    if len(hits) != 1:
        return None
    return _frames.describe_line(file, hits[0])


# --------------------------------------------------------------------------- graph evidence
def _saved(node: Any, name: str) -> Any:
    try:
        return getattr(node, name)
    except Exception:  # freed, or modified in place since (autograd raises)
        kept = _kept(node, name)
        return None if kept is _NOT_KEPT else kept


_NOT_KEPT = object()


def _kept(node: Any, name: str) -> Any:
    """What ``node`` saved as ``name`` when a snapshot of it was taken, inside
    :func:`saved_from`; ``_NOT_KEPT`` when none was."""
    table: dict[int, SavedNode] | None = getattr(_tls, "saved", None)
    snap = table.get(id(node)) if table else None
    if snap is None or snap.node is not node or name not in snap._saved:
        return _NOT_KEPT
    return snap._saved[name]


@contextlib.contextmanager
def saved_from(snaps: Iterable[SavedNode]) -> Iterator[None]:
    """Read an autograd graph whose saved values backward has freed as it stood when
    ``snaps`` were taken (:class:`SavedNode`, their producers too): within the block, what
    a node saved is answered from its snapshot when autograd no longer holds it. A
    snapshot whose tensors were written in place since is left out (not what the node
    saw). The accelerator path reads the loss code's graph after backward so, when the
    forward's statistics had not landed as it began."""
    table: dict[int, SavedNode] = {}
    todo = list(snaps)
    while todo:
        snap = todo.pop()
        if id(snap.node) not in table and snap.unchanged():
            table[id(snap.node)] = snap
            todo.extend(snap._producers.values())
    before = getattr(_tls, "saved", None)
    _tls.saved = table
    try:
        yield
    finally:
        _tls.saved = before


def _has(t: Any, pred: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """How many of ``t``'s values ``pred`` holds for; integer tensors count too (a count
    of 0 as a denominator)."""
    if not isinstance(t, torch.Tensor) or t.is_complex() or t.is_sparse or t.numel() == 0:
        return 0
    if not (has_values(t) or t.dtype in _COUNTABLE):
        return 0
    with torch.no_grad():
        return int(pred(t.detach().float()).sum())


_Fn = Callable[..., torch.Tensor]

#: integer and bool dtypes whose values :func:`_has` counts
_COUNTABLE = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool})

#: autograd nodes of elementwise ops whose saved values are the op's inputs, so the output
#: can be recomputed and what was born read exactly: node -> (aten op, (schema name, saved
#: attribute) per argument, the op).
_ELEMENTWISE: dict[str, tuple[str, tuple[tuple[str, str], ...], _Fn]] = {
    "Log": ("aten.log", (("self", "_saved_self"),), torch.log),
    "Log2": ("aten.log2", (("self", "_saved_self"),), torch.log2),
    "Log10": ("aten.log10", (("self", "_saved_self"),), torch.log10),
    "Log1P": ("aten.log1p", (("self", "_saved_self"),), torch.log1p),
    "Acos": ("aten.acos", (("self", "_saved_self"),), torch.acos),
    "Asin": ("aten.asin", (("self", "_saved_self"),), torch.asin),
    "Acosh": ("aten.acosh", (("self", "_saved_self"),), torch.acosh),
    "Atanh": ("aten.atanh", (("self", "_saved_self"),), torch.atanh),
    "Erfinv": ("aten.erfinv", (("self", "_saved_self"),), torch.erfinv),
    "Cosh": ("aten.cosh", (("self", "_saved_self"),), torch.cosh),
    "Sinh": ("aten.sinh", (("self", "_saved_self"),), torch.sinh),
    "Lgamma": ("aten.lgamma", (("self", "_saved_self"),), torch.lgamma),
    "Digamma": ("aten.digamma", (("self", "_saved_self"),), torch.digamma),
    "Polygamma": (
        "aten.polygamma",
        (("n", "_saved_n"), ("self", "_saved_self")),
        torch.polygamma,
    ),
    "Logit": ("aten.logit", (("self", "_saved_self"), ("eps", "_saved_eps")), torch.logit),
    "Xlogy": ("aten.xlogy", (("self", "_saved_self"), ("other", "_saved_other")), torch.xlogy),
    "SpecialXlog1Py": (
        "aten.special_xlog1py",
        (("self", "_saved_self"), ("other", "_saved_other")),
        torch.special.xlog1py,
    ),
    "SpecialEntr": ("aten.special_entr", (("self", "_saved_self"),), torch.special.entr),
    "Div": ("aten.div", (("self", "_saved_self"), ("other", "_saved_other")), torch.div),
    "Pow": ("aten.pow", (("self", "_saved_self"), ("exponent", "_saved_exponent")), torch.pow),
    # 0 × -inf: autograd saves only the operand the other one's gradient needs; the other
    # is read from the node that made it (:func:`_produced`)
    "Mul": ("aten.mul", (("self", "_saved_self"), ("other", "_saved_other")), torch.mul),
    # -inf - (-inf): autograd saves neither operand (only alpha); both are read from the
    # nodes that made them (:func:`_produced`)
    "Sub": ("aten.sub", (("self", "_saved_self"), ("other", "_saved_other")), torch.sub),
    # F.mse_loss called as a function: (input - target)**2 past the dtype's largest value
    "MseLoss": (
        "aten.mse_loss",
        (("self", "_saved_self"), ("target", "_saved_target"), ("reduction", "_saved_reduction")),
        torch.ops.aten.mse_loss,
    ),
}

#: nodes that save only their result: (aten op, what an inf result means)
_RESULT_ONLY = {"Sqrt", "Rsqrt", "Exp", "Reciprocal"}


def _leaf(
    node: Any,
    i: int,
    values: Callable[[Any], torch.Tensor | None] | None = None,
    *,
    deep: bool = False,
) -> torch.Tensor | None:
    """The value of the node's ``i``-th input when autograd did not save it but it is a
    leaf (a parameter, an input that requires grad: AccumulateGrad holds it), or a tensor
    the caller holds for the node that made it (``values``: a watched module's output);
    ``deep``: else read from the node that made it (:func:`_produced`)."""
    try:
        nxt, nr = node.next_functions[i]
    except (IndexError, AttributeError, ValueError):
        return None
    if nxt is None:
        return None
    v = getattr(nxt, "variable", None)
    if v is None and values is not None:
        v = values(nxt)
    if v is None and deep:
        v = _produced(nxt, nr, values)
    return v if isinstance(v, torch.Tensor) else None


#: nodes whose output is their input's values reshaped: read through by :func:`_produced`
_RESHAPES = frozenset({"View", "UnsafeView", "Reshape", "ReshapeAlias", "Squeeze", "Unsqueeze"})
#: nodes whose output holds their input's values moved or kept: a -inf one of them holds
#: came from their input (log_softmax is -inf exactly where its input is, on a finite row)
_KEEPS_INF = _RESHAPES | {"Expand", "Gather", "Index", "Select", "Slice", "Clone", "LogSoftmax"}
#: nodes of a constant written into a tensor (the fill value is not saved)
_FILL_NODES = frozenset({"MaskedFill", "IndexFill", "Fill"})


def _shape_of(node: Any, nr: int) -> list[int] | None:
    try:
        return [int(d) for d in node._input_metadata[nr].shape]
    except Exception:  # a private attribute: older or newer torch may lack it
        return None


def _produced(
    node: Any, nr: int, values: Callable[[Any], torch.Tensor | None] | None, depth: int = 6
) -> torch.Tensor | None:
    """Output ``nr`` of autograd ``node``'s forward, read from what it saved (its result:
    log_softmax, exp; the operands of a gather) or, for a reshape or expand, from its
    input; None when it cannot be read. Called only for an event being reported."""
    if node is None or depth <= 0:
        return None
    v = getattr(node, "variable", None)
    if v is None and values is not None:
        v = values(node)
    if isinstance(v, torch.Tensor):
        return v.detach()
    r = _saved(node, "_saved_result") if nr == 0 else None
    if isinstance(r, torch.Tensor):
        return r.detach()
    base = name_of(node).split("Backward")[0]
    with torch.no_grad():
        if base == "Gather":
            x, dim, index = (_saved(node, f"_saved_{k}") for k in ("self", "dim", "index"))
            if isinstance(x, torch.Tensor) and isinstance(index, torch.Tensor):
                return torch.gather(x.detach(), _dim_of(dim, x.dim()), index)
            return None
        if base == "Flip":
            dims = _saved(node, "_saved_dims")
            try:
                src, snr = node.next_functions[0]
            except (IndexError, ValueError):
                return None
            x = _produced(src, snr, values, depth - 1)
            if x is None or not isinstance(dims, (list, tuple)):
                return None
            return torch.flip(x, [_dim_of(d, x.dim()) for d in dims])
        if base in _RESHAPES or base == "Expand":
            shape = _shape_of(node, nr)
            try:
                src, snr = node.next_functions[0]
            except (IndexError, ValueError):
                return None
            x = _produced(src, snr, values, depth - 1)
            if shape is None or x is None:
                return None
            return x.expand(shape) if base == "Expand" else x.reshape(shape)
    return None


def _fill_event(node: Any, i: int, kinds: frozenset[str], depth: int = 6) -> OpEvent | None:
    """An event for the constant fill (masked_fill) the infinities of the node's ``i``-th
    input came from, when every node between them only moves or keeps values; None when
    another op lies between (a log of 0 makes -inf too)."""
    try:
        cur = node.next_functions[i][0]
    except (IndexError, AttributeError, ValueError):
        return None
    while cur is not None and depth > 0:
        base = name_of(cur).split("Backward")[0]
        if base in _FILL_NODES:
            return OpEvent(
                op=f"aten.{re.sub(r'(?<=[a-z])(?=[A-Z])', '_', base).lower()}",
                phase=Phase.FORWARD,
                path=None,
                born=_join(kinds),
                output=TensorStat(math.nan, math.nan, 0),
                inputs=[],
                # what reached the multiplication through nodes that keep values: the fill
                scalars={"value": -math.inf} if kinds == {"-inf"} else {},
                node=name_of(cur),
                injected=True,
            )
        if base not in _KEEPS_INF or not cur.next_functions:
            return None
        cur = cur.next_functions[0][0]
        depth -= 1
    return None


def _python_number(v: Any) -> int | float | None:
    """The Python number autograd saved as a 0-dim "wrapped number" tensor (``loss / n``
    with ``n`` an int saves ``n`` as an int64 tensor), else None. A wrapped number defers
    to a 0-dim tensor of a narrower dtype of its kind in type promotion; a tensor the user
    made (``torch.tensor(0)``) does not."""
    if not isinstance(v, torch.Tensor) or v.dim() != 0 or v.requires_grad:
        return None
    probe = {torch.int64: torch.int8, torch.float64: torch.float16}.get(v.dtype)
    if probe is None:
        return None
    try:
        if torch.result_type(torch.empty((), dtype=probe), v) != probe:
            return None
        n = v.item()
    except Exception:  # a tensor subclass or a torch without this promotion: a tensor
        return None
    return n if isinstance(n, (int, float)) and not isinstance(n, bool) else None


#: ops whose result is 0 wherever the values they sum, multiply or move are all 0: a
#: denominator made by them from exp() terms is 0 when those exps underflowed
_CARRIES_ZERO = frozenset(
    {
        *("Sum", "Mean", "Mv", "Mm", "Bmm", "Dot", "Mul", "Add", "Cumsum", "Clone"),
        *("T", "Transpose", "Permute", "View", "UnsafeView", "Reshape", "Expand"),
        *("Unsqueeze", "Squeeze", "Select", "Slice", "Index", "ToCopy"),
    }
)
_EXP_NODES = frozenset({"Exp", "Exp2"})


def _log_operand_history(node: Any) -> dict[str, int | str]:
    """What made the log operand (``other``) of an xlogy node, read from the graph:
    ``other_made_from``, the ops that made it nearest first (``squeeze<relu<addmm``), or
    ``leaf`` for a parameter; nothing for a value with no history (data: a target). A
    distribution's log_prob takes xlogy of its value (Beta's) or of its parameter (Poisson's
    rate): this tells which one held the zeros. Called only for an event being reported."""
    try:
        first = node.next_functions[1][0]
    except (IndexError, AttributeError, RuntimeError):
        return {}
    if first is None:
        return {}
    if accumulates_grad(first):
        return {"other_made_from": "leaf"}
    base = name_of(first).split("Backward")[0].lower()
    return {"other_made_from": "<".join([base, *made_from(first, depth=3)])}


def _made_by(node: Any, i: int, depth: int = 4, budget: int = 32) -> dict[str, int | str]:
    """What made the ``i``-th input of ``node`` (a division's denominator), read from the
    autograd graph: ``other_made_by``, the chain of node names from its producer down to an
    exp() it sums or moves (``MvBackward0<ExpBackward0`` for ``a / (K @ v)`` with ``K =
    torch.exp(...)``), else the producer alone; with ``exp_zeros`` / ``exp_numel`` of that
    exp's saved result. Walks at most ``depth`` levels and ``budget`` nodes: called only for
    an event being reported."""
    try:
        first = node.next_functions[i][0]
    except (IndexError, AttributeError, RuntimeError):
        return {}
    if first is None or accumulates_grad(first):
        return {}
    seen = 0

    def walk(n: Any, level: int) -> list[Any] | None:
        nonlocal seen
        seen += 1
        base = re.sub(r"Backward\d*$", "", name_of(n))
        if base in _EXP_NODES:
            return [n]
        if level >= depth or base not in _CARRIES_ZERO:
            return None
        for nxt, _ in n.next_functions:
            if nxt is None or accumulates_grad(nxt) or seen >= budget:
                continue
            got = walk(nxt, level + 1)
            if got is not None:
                return [n, *got]
        return None

    try:
        chain = walk(first, 1)
    except Exception:  # an unusual node: the producer alone
        chain = None
    out: dict[str, int | str] = {"other_made_by": "<".join(name_of(n) for n in chain or [first])}
    # the ops that made it, nearest first (``add<elu<addmm`` for ``F.elu(raw) + 1``)
    below = made_from(first, depth=3)
    out["other_made_from"] = "<".join([name_of(first).split("Backward")[0].lower(), *below])
    r = _saved(chain[-1], "_saved_result") if chain else None
    if isinstance(r, torch.Tensor) and r.numel():
        out["exp_zeros"] = _has(r, lambda v: v == 0)
        out["exp_numel"] = r.numel()
    if name_of(first) == "MulBackward0":
        # a product (``(x2 - x1) * (y2 - y1)``): a factor that is 0 in every value, and what
        # made it (``sub<maximum``: a difference of two equal values)
        for k, attr in enumerate(("_saved_self", "_saved_other")):
            f = _saved(first, attr)
            if isinstance(f, torch.Tensor) and f.numel() and _has(f, lambda v: v != 0) == 0:
                out["other_zero_factor"] = k
                try:
                    nxt = first.next_functions[k][0]
                except (IndexError, AttributeError, RuntimeError):
                    nxt = None
                if nxt is not None and not accumulates_grad(nxt):
                    base = name_of(nxt).split("Backward")[0].lower()
                    out["other_zero_factor_from"] = "<".join([base, *made_from(nxt, depth=2)])
                break
    return out


#: nodes that move a norm's values without changing them (``n[:, None]``, ``n.expand_as(x)``)
_MOVES = frozenset({"Unsqueeze", "Squeeze", "View", "UnsafeView", "Reshape", "Expand", "Clone"})
#: autograd nodes of a vector norm
_NORM_NODES = frozenset({"LinalgVectorNorm", "Norm"})


def _own_norm(node: Any, depth: int = 4) -> dict[str, int | str]:
    """Whether a division ``node``'s denominator is the norm of its own numerator (``x /
    x.norm(dim=-1, keepdim=True)``, ``x / x.pow(2).sum(-1).sqrt()[:, None]``), read from
    the autograd graph: the norm's input is the very node that made the numerator. Gives
    ``other_norm_of_self`` (1) and ``norm_dim`` (the norm's dim, when one), else {}."""
    try:
        num, den = node.next_functions[0][0], node.next_functions[1][0]
    except (IndexError, AttributeError, RuntimeError):
        return {}
    if num is None or den is None or accumulates_grad(num):
        return {}

    def base(n: Any) -> str:
        return re.sub(r"Backward\d*$", "", name_of(n))

    def first(n: Any) -> Any:
        return next((m for m, _ in getattr(n, "next_functions", ()) or () if m is not None), None)

    cur = den
    for _ in range(depth):
        if cur is None or base(cur) not in _MOVES:
            break
        cur = first(cur)
    if cur is None:
        return {}
    if base(cur) in _NORM_NODES:
        normed = first(cur)
        dims = _saved(cur, "_saved_dim")
    elif base(cur) == "Sqrt":  # sqrt(sum(x ** 2)): a norm written out
        total = first(cur)
        square = first(total) if total is not None and base(total) == "Sum" else None
        if square is None or base(square) not in ("Pow", "Square"):
            return {}
        if base(square) == "Pow" and _plain(_saved(square, "_saved_exponent")) not in (2, 2.0):
            return {}
        normed = first(square)
        dims = _saved(total, "_saved_dim")
    else:
        return {}
    if normed is None or normed is not num:
        return {}
    out: dict[str, int | str] = {"other_norm_of_self": 1}
    if isinstance(dims, (tuple, list)) and len(dims) == 1 and isinstance(dims[0], int):
        d = dims[0]
        out["norm_dim"] = d - 2**64 if d >= 2**63 else d  # saved as an unsigned int
    return out


def _kinds_of(values: Sequence[Any]) -> frozenset[str]:
    out: frozenset[str] = frozenset()
    for v in values:
        out |= _kinds(v) if isinstance(v, torch.Tensor) else _scalar_kinds(v)
    return out


def _plain(v: Any) -> float | int | str | None:
    """A saved non-tensor value as a scalar of an OpEvent (SymInt -> int)."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float, str)):
        return v
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _node_meta(node: Any) -> tuple[str, str]:
    """dtype and device of the node's forward output (its gradient's metadata), or empty."""
    try:
        md = node._input_metadata[0]
        return dtype_name(md.dtype), device_name(md.device)
    except Exception:  # a private attribute: older or newer torch may lack it
        return "", ""


def _event(
    node: Any,
    op: str,
    born: frozenset[str] | str,
    why: str,
    *,
    inputs: Sequence[tuple[str, Any]] = (),
    result: torch.Tensor | None = None,
    out_numel: int | None = None,
    scalars: dict[str, float | int | str] | None = None,
    other_inputs: Sequence[tuple[str, torch.Tensor]] = (),
    outputs: Sequence[tuple[str, torch.Tensor]] = (),
) -> OpEvent:
    # integer and bool tensors (a count of 0 as denominator) hold no float values: their
    # min, max and numel are told among the other inputs
    other_inputs = [
        *other_inputs,
        *((n, t) for n, t in inputs if isinstance(t, torch.Tensor) and not has_values(t)),
    ]
    inputs = [(n, t) for n, t in inputs if not isinstance(t, torch.Tensor) or has_values(t)]
    tensors = [t for _, t in inputs if isinstance(t, torch.Tensor)]
    ref = result if result is not None else (tensors[0] if tensors else None)
    if result is not None:
        output = describe(result) or TensorStat(math.nan, math.nan, 0)
    else:
        n = out_numel or 0
        output = TensorStat(math.nan, math.nan, n, nan=n, posinf=0, neginf=0, zeros=0)
    kept: dict[str, float | int | str] = dict(scalars or {})
    dom = domain_of(op)
    if dom is not None:
        kept.update(domain_counts(dom, dict(inputs).get(dom.arg)))
    kept["evidence"] = why
    dtype, device = _node_meta(node)
    if ref is None and not dtype:  # older torch (2.4) keeps no metadata on the node: the op's
        # other operands (an empty mean's input) share its dtype
        ref = next((t for _, t in (*other_inputs, *outputs) if isinstance(t, torch.Tensor)), None)
    if ref is not None:
        dtype, device = dtype_name(ref.dtype), device_name(ref.device)
    return OpEvent(
        op=op,
        phase=Phase.FORWARD,
        path=None,
        born=born if isinstance(born, str) else _join(born),
        output=output,
        inputs=[(n, describe(t)) for n, t in inputs if isinstance(t, torch.Tensor)],
        scalars=kept,
        node=name_of(node),
        dtype=dtype,
        device=device,
        other_inputs=_briefs(other_inputs),
        outputs=_briefs(outputs),
    )


def _elementwise_event(
    node: Any,
    base: str,
    output: torch.Tensor | None,
    loss_kinds: frozenset[str],
    values: Callable[[Any], torch.Tensor | None] | None = None,
) -> OpEvent | None:
    op, args, fn = _ELEMENTWISE[base]
    vals = [(name, _saved(node, attr)) for name, attr in args]
    deep = base in ("Mul", "Sub")
    if base == "Sub" and _plain(_saved(node, "_saved_alpha")) not in (1, 1.0, None):
        return None  # x - alpha * y: not read here
    vals = [
        (name, v if v is not None else _leaf(node, i, values, deep=deep))
        for i, (name, v) in enumerate(vals)
    ]
    # ``loss / n`` with ``n`` a Python number: a number, as the op checker records it
    vals = [
        (name, n if name == "other" and (n := _python_number(v)) is not None else v)
        for name, v in vals
    ]
    if base == "Logit" and vals[1][1] is None:
        vals = vals[:1]  # logit(x) without eps
    rounding = _saved(node, "_saved_rounding_mode") if base == "Div" else None
    result = output
    if all(v is not None for _, v in vals):
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plain = [v.detach() if isinstance(v, torch.Tensor) else v for _, v in vals]
                kw = {"rounding_mode": rounding} if isinstance(rounding, str) else {}
                result = fn(*plain, **kw)
        except Exception:  # an overload this table does not know: read what is saved
            result = output
    in_kinds = _kinds_of([v for _, v in vals if v is not None])
    tensors = [(n, v) for n, v in vals if isinstance(v, torch.Tensor)]
    scalars = {
        n: p for n, v in vals if not isinstance(v, torch.Tensor) and (p := _plain(v)) is not None
    }
    if base == "Xlogy" and _has(dict(vals).get("other"), lambda v: v == 0):
        scalars.update(_log_operand_history(node))
    if base == "Div":
        den = dict(vals).get("other")
        zeros = _has(den, lambda v: v == 0)
        if isinstance(den, (int, float)) and not isinstance(den, bool) and den == 0:
            zeros = 1
        elif zeros:  # what made the zeros: an exp() that underflowed, summed (K @ v)
            scalars.update(_made_by(node, 1))
            scalars.update(_own_norm(node))
        if not zeros:  # a tiny denominator (a softmax probability of 1e-42): x/d overflows
            if result is None or not isinstance(result, torch.Tensor):
                return None
            if dict(vals).get("self") is None:
                return None  # the numerator is unknown: it may have held the NaN already
            made = _kinds(result) - in_kinds
            if not made:
                return None
            why = "denominator holds no zero; the quotient overflows"
            return _event(node, op, made, why, inputs=tensors, result=result, scalars=scalars)
        quot = _local_output(node) if result is None else None
        if quot is not None:  # the user's code holds the quotient (cls_loss = s / n)
            result = quot[1]
            scalars["result_local"] = quot[0]
        named = (
            _local_named(den)
            if isinstance(den, torch.Tensor) and den.numel() == 1 and den.grad_fn is None
            else None
        )
        if named is not None:  # the count's own name (num_pos), for its fix
            scalars["other_local"] = named
        if result is None:  # numerator not saved and not the loss itself: x/0 or 0/0
            born: frozenset[str] = loss_kinds
            why = f"denominator holds {zeros} zeros (the numerator was not saved)"
        elif quot is not None:
            born = _kinds(result) - in_kinds
            why = f"denominator holds {zeros} zeros; the quotient is {quot[0]}"
        else:
            born = _kinds(result) - in_kinds
            why = f"denominator holds {zeros} zeros"
        if not born:
            return None
        return _event(node, op, born, why, inputs=tensors, result=result, scalars=scalars)
    if result is None or not isinstance(result, torch.Tensor):
        return None
    born = _kinds(result) - in_kinds
    if not born:
        return None
    x = dict(vals).get("self")
    if base in ("Log", "Log2", "Log10"):
        why = (
            f"input holds {_has(x, lambda v: v == 0)} zeros and "
            f"{_has(x, lambda v: v < 0)} negatives"
        )
    elif base == "Log1P":
        why = (
            f"input holds {_has(x, lambda v: v == -1)} values of -1 and "
            f"{_has(x, lambda v: v < -1)} below -1"
        )
    elif base == "Pow":
        e = dict(vals).get("exponent")
        why = (
            f"{_has(x, lambda v: v < 0)} negative and {_has(x, lambda v: v == 0)} zero bases "
            f"with exponent {_plain(e) if not isinstance(e, torch.Tensor) else 'a tensor'}"
        )
    elif base == "MseLoss":
        held = [
            f"its {n} held {_join(k)}"
            for n, v in vals
            if isinstance(v, torch.Tensor) and (k := _kinds(v) - {"NaN"})
        ]
        # an infinity given to it (a log(0) target) came in: (x - inf) ** 2 is inf
        why = (
            " and ".join(held) + ", which came in: the square of an infinite difference is +inf"
            if held
            else "the squared differences overflow"
        )
    elif base == "Sub":
        if "NaN" not in born or not all(isinstance(v, torch.Tensor) for _, v in vals):
            return None  # an overflow, or an operand not read: other rules read it
        inf = "-inf - (-inf)" if "-inf" in in_kinds else "inf - inf"
        why = f"{inf}: both operands hold the same infinity at the same place"
        event = _event(node, op, born, why, inputs=tensors, result=result, scalars=scalars)
        for i, (_, v) in enumerate(vals):  # the mask (masked_fill) the infinity came from
            k = _kinds(v) - {"NaN"} if isinstance(v, torch.Tensor) else frozenset()
            if k and (fill := _fill_event(node, i, k)) is not None:
                event.cause = fill
                break
        return event
    elif base == "Mul":
        if "NaN" not in born:
            return None  # finite × inf is the inf's, or an overflow: other rules read it
        unread = [(i, n) for i, (n, v) in enumerate(vals) if v is None]
        if unread and not (in_kinds & {"+inf", "-inf"}):
            # an operand autograd did not save (``0.5 * x`` keeps only 0.5): no inf is
            # seen, so the NaN came in with it; the node that made it is named
            at, operand = unread[0]
            nxt = _next_node(node, at)
            by = f", made by {nxt}" if nxt else ""
            scalars[_CAME_IN] = operand
            if nxt:
                scalars[f"{operand}_made_by"] = nxt
            why = f"the NaN came in with its {operand}, which autograd did not save{by}"
            return _event(node, op, born, why, inputs=tensors, result=result, scalars=scalars)
        why = "0 × inf"
        event = _event(node, op, born, why, inputs=tensors, result=result, scalars=scalars)
        for i, (_, v) in enumerate(vals):
            k = _kinds(v) if isinstance(v, torch.Tensor) else frozenset()
            if k - {"NaN"}:
                event.cause = _fill_event(node, i, k - {"NaN"})
                break
        return event
    else:
        dom = domain_of(op)
        arg = dict(vals).get(dom.arg) if dom is not None else None
        counts = domain_counts(dom, arg) if dom is not None else {}
        outside = counts.get("n_outside", 0) + counts.get("n_edge", 0) + counts.get("n_pole", 0)
        what = dom.interval if dom is not None else "its domain"
        if dom is not None and dom.poles:
            why = f"{outside} of its inputs at a pole (0, -1, -2, ...)"
        else:
            why = f"{outside} of its inputs outside {what}"
    return _event(node, op, born, why, inputs=tensors, result=result, scalars=scalars)


#: ``OpEvent.scalars`` key of a backward-node event whose NaN came in with an operand
#: autograd did not save (its schema name): the node read it, no op of its made it
CAME_IN = _CAME_IN = "came_in"


def _next_node(node: Any, i: int) -> str | None:
    """The name of the autograd node that made ``node``'s ``i``-th input, or None."""
    try:
        nxt = node.next_functions[i][0]
    except (IndexError, AttributeError, ValueError):
        return None
    return None if nxt is None else name_of(nxt)


def _logdet_event(node: Any) -> OpEvent | None:
    """``torch.logdet`` runs as ``where(sign == -1, nan, logabsdet)`` of a slogdet: a
    ``WhereBackward0`` whose one branch has no history (the NaN constant) and whose other is
    a ``LinalgSlogdetBackward0``'s logabsdet. Its saved sign tells which matrices had a
    negative determinant: logdet is NaN there (and -inf where the determinant is 0)."""
    nexts = list(getattr(node, "next_functions", ()) or ())
    if len(nexts) != 2 or not any(n is None for n, _ in nexts):
        return None
    slog = next((n for n, nr in nexts if n is not None and nr == 1), None)
    if slog is None or name_of(slog).split("Backward")[0] != "LinalgSlogdet":
        return None
    sign, lu, a = (_saved(slog, k) for k in ("_saved_sign", "_saved_LU", "_saved_A"))
    if not isinstance(sign, torch.Tensor) or not isinstance(lu, torch.Tensor):
        return None
    with torch.no_grad():
        sign = sign.detach()
        neg = int((sign == -1).sum())
        if not neg:
            return None
        logabs = lu.detach().diagonal(dim1=-2, dim2=-1).abs().log().sum(-1)
        result = torch.where(sign == -1, torch.full_like(logabs, math.nan), logabs)
    why = f"{neg} of {sign.numel()} matrices have a negative determinant (slogdet sign -1)"
    inputs = [("self", a.detach())] if isinstance(a, torch.Tensor) else []
    return _event(
        node,
        "aten.logdet",
        "NaN",
        why,
        inputs=inputs,
        result=result,
        scalars={"negative_det": neg, "matrices": int(sign.numel())},
    )


def _result_only_event(node: Any, base: str) -> OpEvent | None:
    r = _saved(node, "_saved_result")
    if not isinstance(r, torch.Tensor):
        return None
    op = f"aten.{base.lower()}"
    bad = _has(r, lambda v: ~torch.isfinite(v))
    if base in ("Sqrt", "Rsqrt"):
        zeros = _has(r, lambda v: v == 0) if base == "Sqrt" else 0
        if bad:
            return _event(node, op, "NaN", f"{bad} results are not finite", result=r)
        if zeros:
            why = f"{zeros} results are 0: the gradient 1/(2 sqrt(x)) is inf"
            return _event(node, op, "+inf", why, result=r)
        return None
    inf = _has(r, torch.isinf)
    if inf:
        what = "exp overflowed" if base == "Exp" else "1/0"
        return _event(node, op, "+inf", f"{inf} results are inf ({what})", result=r)
    return None


def _dim_of(d: Any, ndim: int) -> int:
    """A dimension an autograd node saved, as an index into ``ndim`` dimensions: a negative
    one (``dim=-1``) is saved as an unsigned 64-bit integer (2**64 - 1).

    >>> _dim_of(2**64 - 1, 3), _dim_of(1, 3), _dim_of(-1, 2)
    (2, 1, 1)
    """
    i = int(d)
    if i >= 2**63:
        i -= 2**64
    return i % max(ndim, 1)


def _reduced(sizes: Sequence[int], dims: Any) -> tuple[int, int]:
    """(elements per output, number of outputs) of a reduction of a tensor of ``sizes``
    over ``dims`` (None or empty: all of them)."""
    shape = [int(s) for s in sizes]
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        picked = set(range(len(shape)))
    else:
        seq = dims if isinstance(dims, (list, tuple)) else [dims]
        picked = {_dim_of(d, len(shape)) for d in seq}
    per = math.prod(shape[d] for d in picked) if shape else 1
    outs = math.prod(s for d, s in enumerate(shape) if d not in picked)
    return per, outs


def _reduction_event(node: Any, base: str) -> OpEvent | None:
    """A mean over 0 elements, a std/var whose N - correction <= 0, an nll_loss mean whose
    total weight is 0: NaN from an empty reduction, read from what the node saved."""
    if base == "Mean":
        sizes = _saved(node, "_saved_self_sym_sizes")
        if sizes is None or _plain(_saved(node, "_saved_self_sym_numel")) != 0:
            return None
        _, outs = _reduced(sizes, _saved(node, "_saved_dim"))
        if outs == 0:
            return None
        empty = torch.zeros(0)
        return _event(
            node,
            "aten.mean",
            "NaN",
            f"the mean of 0 elements, into {outs} outputs",
            out_numel=outs,
            other_inputs=[("self", empty)],
        )
    if base in ("Std", "Var", "StdMean", "VarMean"):
        x = _saved(node, "_saved_self")
        if not isinstance(x, torch.Tensor):
            return None
        dims = _saved(node, "_saved_dim")
        if isinstance(dims, (list, tuple)):  # dim=-1 is saved as 2**64 - 1
            dims = tuple(_dim_of(d, x.dim()) for d in dims)
        c = _plain(_saved(node, "_saved_correction"))
        corr = 1 if c is None else c
        per, outs = _reduced(x.shape, dims)
        if not isinstance(corr, (int, float)) or per - corr > 0 or outs == 0:
            return None
        kw: dict[str, Any] = {"correction": corr, "keepdim": bool(_saved(node, "_saved_keepdim"))}
        name = {"Std": "std", "Var": "var", "StdMean": "std_mean", "VarMean": "var_mean"}[base]
        fn = torch.std if name.startswith("std") else torch.var
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "degrees of freedom is <= 0": the user saw it
            result = fn(x.detach(), dim=dims, **kw) if dims else fn(x.detach(), **kw)
        born = _kinds(result) - _kinds(x)
        if not born:
            return None
        why = f"{per} element(s) per output and correction {corr}: N - correction = {per - corr}"
        return _event(
            node,
            f"aten.{name}",
            born,
            why,
            inputs=[("self", x)],
            result=result,
            scalars={"correction": corr},
        )
    if _plain(_saved(node, "_saved_reduction")) == 1 and base not in ("NllLoss", "NllLoss2D"):
        x = _saved(node, "_saved_self")  # any other loss: a mean over an empty batch
        if not isinstance(x, torch.Tensor) or x.numel() != 0:
            return None
        op = "aten." + re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", base).lower()
        return _event(
            node,
            op,
            "NaN",
            "the mean of 0 elements",
            out_numel=1,
            scalars={"reduction": 1},
            other_inputs=[("self", x)],
        )
    if base in ("NllLoss", "NllLoss2D"):
        tw = _saved(node, "_saved_total_weight")
        if _plain(_saved(node, "_saved_reduction")) != 1 or not isinstance(tw, torch.Tensor):
            return None
        if tw.numel() != 1 or float(tw) != 0.0:
            return None
        ii = _plain(_saved(node, "_saved_ignore_index"))
        if isinstance(ii, int) and ii >= 2**63:  # saved as an unsigned 64-bit integer
            ii -= 2**64
        target = _saved(node, "_saved_target")
        weight = _saved(node, "_saved_weight")
        op = "aten.nll_loss_forward" if base == "NllLoss" else "aten.nll_loss2d_forward"
        return _event(
            node,
            op,
            "NaN",
            "the total weight of the targets is 0",
            inputs=[("self", _saved(node, "_saved_self")), ("weight", weight)],
            out_numel=1,
            scalars={"reduction": 1, **({"ignore_index": ii} if isinstance(ii, int) else {})},
            other_inputs=[("target", target)] if isinstance(target, torch.Tensor) else [],
            outputs=[("total_weight", tw)],
        )
    return None


def _node_event(
    node: Any,
    output: torch.Tensor | None,
    loss_kinds: frozenset[str],
    values: Callable[[Any], torch.Tensor | None] | None = None,
) -> OpEvent | None:
    """An OpEvent when the node's saved values show its op made a NaN or inf from finite
    inputs: a value outside the op's domain (log of 0, acos of 1.0000001, x/0), or a
    reduction over too few elements (the op semantics of PyTorch, not a list of
    scenarios). ``output`` is the node's forward result when known (the loss itself)."""
    base = name_of(node).split("Backward")[0]
    if base in _ELEMENTWISE:
        return _elementwise_event(node, base, output, loss_kinds, values)
    if base in _RESULT_ONLY:
        return _result_only_event(node, base)
    if base == "Where":
        return _logdet_event(node)
    if base in ("Softmax", "LogSoftmax"):
        return _softmax_event(node, base, values)
    return _reduction_event(node, base)


def _softmax_event(
    node: Any, base: str, values: Callable[[Any], torch.Tensor | None] | None = None
) -> OpEvent | None:
    """A softmax (or log-softmax) whose saved result is NaN across whole rows: each such
    row was -inf everywhere (a row a mask filled: no key, no valid class), softmax of all
    -inf being NaN. Its input is not saved; the rows are told from the result, and the
    input is rebuilt when it is a masked_fill of a tensor at hand (see
    :func:`_masked_input`)."""
    r = _saved(node, "_saved_result")
    d = _saved(node, "_saved_dim")
    if not isinstance(r, torch.Tensor) or not has_values(r) or r.dim() == 0 or d is None:
        return None
    dim = _dim_of(d, r.dim())
    with torch.no_grad():
        rows = torch.isnan(r).all(dim=dim)
        k, n = int(rows.sum()), int(rows.numel())
    if not k:
        return None
    op = "aten._softmax" if base == "Softmax" else "aten._log_softmax"
    why = f"{k} of {n} rows are NaN along dim {dim}: each was -inf everywhere in its input"
    x = _masked_input(node, rows, dim, values)
    return _event(
        node,
        op,
        "NaN",
        why,
        inputs=[("self", x)] if x is not None else (),
        result=r,
        scalars={"nan_rows": k, "rows": n},
    )


def _masked_input(
    node: Any, nan_rows: torch.Tensor, dim: int, values: Callable[[Any], torch.Tensor | None] | None
) -> torch.Tensor | None:
    """The input of softmax ``node`` when it is ``x.masked_fill(mask, -inf)`` of a tensor
    ``x`` at hand (a watched output, through ``values``): the fill value is not saved, but
    it is -inf when the rows the softmax made NaN are exactly those the mask covers whole,
    a row it covers in part is finite, and ``x`` is finite (a NaN or +inf fill would make
    the partly masked rows NaN too). None otherwise."""
    try:
        src = node.next_functions[0][0]
        if src is None or name_of(src).split("Backward")[0] != "MaskedFill":
            return None
        mask = _saved(src, "_saved_mask")
        below = src.next_functions[0]
        x = _produced(below[0], below[1], values) if below[0] is not None else None
        if not isinstance(mask, torch.Tensor) or x is None or not bool(torch.isfinite(x).all()):
            return None
        with torch.no_grad():
            m = mask.expand_as(x)
            whole, part = m.all(dim=dim), m.any(dim=dim) & ~m.all(dim=dim)
            if not torch.equal(whole, nan_rows.reshape(whole.shape)) or not bool(part.any()):
                return None
            return x.masked_fill(m, -math.inf)
    except Exception:  # an unusual graph: the rows alone are the evidence
        return None


def _in_run_order(nodes: list[Any]) -> list[Any]:
    """``nodes`` in the order their forward ops ran: autograd numbers each node as it is
    made (``_sequence_nr``), so of two branches of a loss (``mse + kl``) the op that ran
    first comes first, not the one nearest the inputs. A producer is always numbered
    before its consumers. ``nodes`` as given when a node has no number (older torch).

    >>> x = torch.ones(1, requires_grad=True)
    >>> a = x.exp()
    >>> b = x.log()
    >>> [name_of(n) for n in _in_run_order([b.grad_fn, a.grad_fn])]
    ['ExpBackward0', 'LogBackward0']
    """
    try:
        numbers = [int(n._sequence_nr()) for n in nodes]
    except Exception:  # a node type without a number: the walk's order
        return nodes
    return [n for _, n in sorted(zip(numbers, nodes, strict=True), key=lambda p: p[0])]


def graph_evidence(
    fn: Any,
    *,
    stop: Callable[[Any], bool] | None = None,
    limit: int = 512,
    output: torch.Tensor | None = None,
    values: Callable[[Any], torch.Tensor | None] | None = None,
    logs: list[list[str]] | None = None,
    unsaved: bool = True,
    powers: list[list[str]] | None = None,
) -> tuple[list[str], list[OpEvent]]:
    """Read the autograd graph below ``fn`` (a loss's ``grad_fn``) down to the nodes in
    ``stop`` (true for the grad_fns of watched outputs): the names of the ops it ran, and an
    OpEvent for every node whose saved values show its op made a NaN or inf (log of 0,
    division by 0, acos outside [-1, 1], a mean over nothing, ...) -- op-level evidence for
    code that no module wraps, without re-running it. Inputs are named by the op's schema
    (``self``, ``other``); ``output`` is ``fn``'s forward result (the loss), which tells
    what the last op made when its inputs were not saved; ``values`` gives the tensor a
    ``stop`` node made, for an input autograd did not save (the numerator of ``logits / t``
    is the model's output). Events come in the order their ops ran. ``logs``, when given,
    gets what each log of the graph was taken of (:func:`made_from`): ``log(p)`` beside
    ``log(1 - p)`` is a binary cross-entropy written by hand. ``unsaved``: when nothing
    the graph saved explains the loss's value, an operand with no history of a node that
    saves none (``pred - y``) is looked for among the user's locals (see
    :func:`_nonfinite_local`). ``powers``, when given, gets what each power of the graph
    was taken of: ``log(1 - p) * p ** 2`` weights the log by a power of ``p`` (a focal
    loss), not a plain binary cross-entropy."""
    names: list[str] = []
    events: list[OpEvent] = []
    order: list[Any] = []
    order.extend(
        GraphWalk(
            [fn],
            prune=lambda n: (stop is not None and stop(n)) or accumulates_grad(n),
            limit=limit,
        )
    )
    loss_kinds = _kinds(output) if isinstance(output, torch.Tensor) else frozenset()
    leaf_said = False
    pending: list[Any] = []  # nodes that save no operand (Sub, Add): asked last
    for node in _in_run_order(order[::-1]):  # producers before consumers
        base = name_of(node).split("Backward")[0]
        names.append(base.lower())
        if logs is not None and base in ("Log", "Log2", "Log10"):
            logs.append(made_from(node, stop, through=True))
        if powers is not None and base == "Pow":
            powers.append(made_from(node, stop, through=True))
        if not leaf_said:
            try:
                leaf = leaf_event(node)
            except Exception:  # an unusual node must not cost the rest of the evidence
                leaf = None
            if leaf is not None:
                leaf_said = True
                events.append(leaf)
        if not leaf_said and base in _UNSAVED_NODES:
            pending.append(node)
        own = output if node is fn else None
        try:
            event = _node_event(node, own, loss_kinds, values)
        except Exception:  # an unusual node must not cost the rest of the evidence
            event = None
        if event is not None:
            if event.source is None:  # the op's line, where anomaly mode kept it (forensic)
                event.source, event.code = forward_line(node)
            log = base in ("Log", "Log2", "Log10")
            event.made_from = made_from(node, stop, below=log, through=log)
            event.made_from_history = operand_history(node)
            events.append(event)
    if unsaved and not leaf_said and not events and loss_kinds:
        # nothing the graph saved explains the loss's value: an operand of a node that
        # saves none (pred - y) held it, when one local of the user's code holds such a value
        for node in pending:
            try:
                leaf = leaf_event(node, unsaved=True)
            except Exception:  # evidence only
                leaf = None
            if leaf is not None:
                events.append(leaf)
                break
    return names[::-1], events


def graph_selections(
    fn: Any, *, stop: Callable[[Any], bool] | None = None, limit: int = 512
) -> list[dict[str, Any]]:
    """The gathers of a loss's autograd graph (``logp.gather(1, a)``, a Categorical's
    ``log_prob(a)``) that picked NaN or inf entries out of a source holding some (a
    log-softmax of logits a mask set to -inf): what each picked, out of what, and what made
    its source (:func:`made_from`). A selection makes no infinity, it carries one the
    index points at: the evidence that the index (an action, a target) is an entry the
    mask forbids. Reads the saved source and index: anomaly-time work only.

    >>> x = torch.tensor([[0.0, float("-inf")], [0.0, 0.0]], requires_grad=True)
    >>> p = torch.log_softmax(x, 1).gather(1, torch.tensor([[1], [0]]))
    >>> [(s["picked"], s["rows"], s["made_from"][0]) for s in graph_selections(p.grad_fn)]
    [({'-inf': 1}, 2, 'logsoftmax')]
    """
    out: list[dict[str, Any]] = []
    walk = GraphWalk(
        [fn], prune=lambda n: (stop is not None and stop(n)) or accumulates_grad(n), limit=limit
    )
    for node in walk:
        if name_of(node).split("Backward")[0] != "Gather":
            continue
        src, index, dim = (_saved(node, f"_saved_{k}") for k in ("self", "index", "dim"))
        if not (isinstance(src, torch.Tensor) and isinstance(index, torch.Tensor)):
            continue
        if not src.is_floating_point() or not has_values(src) or not isinstance(dim, int):
            continue
        dim = _dim_of(dim, src.dim())
        try:
            with torch.no_grad():
                picked = torch.gather(src.detach(), dim, index)
                counts = {
                    k: int(c)
                    for k, c in (
                        ("NaN", picked.isnan().sum()),
                        ("+inf", (picked == math.inf).sum()),
                        ("-inf", (picked == -math.inf).sum()),
                    )
                    if c
                }
                if not counts:
                    continue
                held = int((~torch.isfinite(src)).sum())
        except Exception:  # an unusual gather: no evidence from it
            continue
        out.append(
            {
                "node": name_of(node),
                "picked": counts,
                "rows": int(index.numel()),
                "source_nonfinite": held,
                "source_numel": int(src.numel()),
                "dim": dim,
                "made_from": made_from(node, stop),
            }
        )
    return out


def graph_emptied_rows(
    fn: Any, *, stop: Callable[[Any], bool] | None = None, limit: int = 512
) -> list[dict[str, Any]]:
    """The row reductions of a loss's autograd graph (``torch.logsumexp(x, 1)``,
    ``x.amax(1)``) whose result holds -inf: each such value is a row of ``x`` that was -inf
    everywhere (a mask left it no entry; the log of an empty sum). A -inf a loss then
    subtracts is +inf. What each reduced, how many of its values are -inf, and what made
    its input (:func:`made_from`). Reads the saved result: anomaly-time work only.

    >>> x = torch.zeros(3, 2, requires_grad=True)
    >>> m = torch.tensor([[True, True], [False, True], [False, False]])
    >>> lse = torch.logsumexp(x.masked_fill(m, -math.inf), 1)
    >>> [(e["op"], e["rows"], e["of"], e["made_from"][0]) for e in graph_emptied_rows(lse.grad_fn)]
    [('logsumexp', 1, 3, 'maskedfill')]
    """
    out: list[dict[str, Any]] = []
    walk = GraphWalk(
        [fn], prune=lambda n: (stop is not None and stop(n)) or accumulates_grad(n), limit=limit
    )
    for node in walk:
        base = name_of(node).split("Backward")[0]
        if base not in ("Logsumexp", "Amax"):
            continue
        r = _saved(node, "_saved_result")
        if not isinstance(r, torch.Tensor) or not r.is_floating_point() or not has_values(r):
            continue
        try:
            with torch.no_grad():
                k = int((r == -math.inf).sum())
        except Exception:  # an unusual node: no evidence from it
            continue
        if not k:
            continue
        d = _saved(node, "_saved_dim")
        out.append(
            {
                "node": name_of(node),
                "op": base.lower(),
                "rows": k,
                "of": int(r.numel()),
                "dim": list(d) if isinstance(d, (list, tuple)) else d,
                "made_from": made_from(node, stop),
            }
        )
    return out


#: ops whose output holds values of their input unchanged (a view, a pick): a watched
#: output made by one (``torch.sigmoid(z).squeeze(1)`` returned by a model) is still what
#: made it below, which :func:`made_from` follows with ``through``
_SAME_VALUES = frozenset(
    {"view", "unsafeview", "reshape", "transpose", "permute", "unsqueeze", "squeeze"}
    | {"expand", "clone", "t", "alias", "select", "slice", "index"}
)


def made_from(
    node: Any,
    stop: Callable[[Any], bool] | None = None,
    depth: int = 4,
    *,
    below: bool = False,
    through: bool = False,
) -> list[str]:
    """The ops that made ``node``'s first input, nearest first, lower-case, followed through
    each one's first input for at most ``depth`` nodes: ``log(1 - p)`` gives ``["rsub",
    ...]``. A node in ``stop`` (a watched module's output) ends the chain as
    ``"watched:<op>"``; a leaf as ``"leaf"``. What a log or a division was given, for code no
    module wraps, read from the graph alone (no tensor is read). ``below``: a watched
    softmax is followed by what made its input in the module's own code
    (:func:`made_below`), each as ``"below:<op>"``. ``through``: a watched output that only
    moves its input's values (:data:`_SAME_VALUES`: a model returning ``sigmoid(z).squeeze(1)``)
    does not end the chain: the op below it made those values.

    >>> p = torch.sigmoid(torch.zeros(2, requires_grad=True))
    >>> made_from(torch.log(1 - p).grad_fn)
    ['rsub', 'sigmoid', 'leaf']
    """
    out: list[str] = []
    nxt = getattr(node, "next_functions", ()) or ()
    cur = next((n for n, _ in nxt if n is not None), None)
    while cur is not None and len(out) < depth:
        if accumulates_grad(cur):
            out.append("leaf")
            break
        base = name_of(cur).split("Backward")[0].lower()
        if stop is not None and stop(cur):
            out.append(f"watched:{base}")
            if below and base == "softmax":
                out.extend(f"below:{b}" for b in made_below(cur, stop))
            if not (through and base in _SAME_VALUES):
                break
        else:
            out.append(base)
        nxt = getattr(cur, "next_functions", ()) or ()
        cur = next((n for n, _ in nxt if n is not None), None)
    return out


#: ops that hand a -inf in their one input with a history on as a -inf (or a NaN): a
#: temperature (a scale by a number), a cast, a view
_KEEP_INF = frozenset(
    {"div", "mul", "tocopy", "view", "unsafeview", "reshape", "transpose", "permute"}
    | {"unsqueeze", "squeeze", "expand", "clone", "t", "alias"}
)


def made_below(node: Any, stop: Callable[[Any], bool] | None = None, depth: int = 4) -> list[str]:
    """What made the input of ``node`` (a watched output's ``grad_fn``: a softmax a module
    returned), nearest first, by the graph's node names alone: followed through the ops
    that keep a -inf (:data:`_KEEP_INF`: ``z / tau``, a cast, a view) to the first that
    makes values, which ends it. An add or a sub one operand of which has no history (a
    mask or noise made without gradient, or a number) is ``"add(constant)"``. A node in
    ``stop`` or a leaf ends it unnamed. No tensor is read.

    >>> z = torch.zeros(2, 3, requires_grad=True)
    >>> m = torch.tensor([[False, True, False]] * 2)
    >>> made_below(torch.softmax(z.masked_fill(m, -math.inf) / 2, -1).grad_fn)
    ['div', 'maskedfill']
    >>> made_below(torch.softmax(z + torch.zeros(3), -1).grad_fn)
    ['add(constant)']
    """
    out: list[str] = []
    nxt = getattr(node, "next_functions", ()) or ()
    cur = next((n for n, _ in nxt if n is not None), None)
    while cur is not None and len(out) < depth:
        if accumulates_grad(cur) or (stop is not None and stop(cur)):
            break
        nxt = getattr(cur, "next_functions", ()) or ()
        live = [n for n, _ in nxt if n is not None]
        base = name_of(cur).split("Backward")[0].lower()
        const = base in ("add", "sub") and len(live) == 1 and len(nxt) > 1
        out.append(f"{base}(constant)" if const else base)
        if base not in _KEEP_INF or len(live) != 1:
            break
        cur = live[0]
    return out


def operand_made_from(t: torch.Tensor, depth: int = 4) -> list[str]:
    """:func:`made_from` for a forward op that has no node yet (the op :class:`OpChecker`
    sees run): the ops that made its first operand ``t``, nearest first, read from ``t``'s
    own ``grad_fn``; ``["leaf"]`` for a leaf that requires grad, ``[]`` for a tensor with
    no history (data, or an op run under no_grad). No tensor is read.

    >>> z = torch.ones(2, 2, requires_grad=True)
    >>> operand_made_from(z @ z.t() / 0.01)
    ['div', 'mm', 'leaf']
    """
    fn = t.grad_fn
    if fn is None:
        return ["leaf"] if t.requires_grad else []
    return [name_of(fn).split("Backward")[0].lower(), *made_from(fn, depth=depth - 1)]


def operand_history(node: Any) -> list[bool]:
    """Whether each operand of the op that made ``node``'s first input has an autograd
    history, read from the graph alone (a ``None`` next function is an operand that needs
    no gradient: computed under no_grad, detached, or data); ``[]`` when that op is not a
    tensor-tensor one or ``node`` has no producer. No tensor is read.

    >>> a = torch.ones(2, requires_grad=True)
    >>> operand_history(torch.exp(a - torch.ones(2)).grad_fn)
    [True, False]
    """
    nxt = getattr(node, "next_functions", ()) or ()
    cur = next((n for n, _ in nxt if n is not None), None)
    return first_operands_history(cur)


def first_operands_history(fn: Any) -> list[bool]:
    """:func:`operand_history` of the node ``fn`` itself: one flag per operand of the op
    that made it, [] for a node of one operand or none."""
    if fn is None or accumulates_grad(fn):
        return []
    flags = [n is not None for n, _ in getattr(fn, "next_functions", ()) or ()]
    return flags if len(flags) == 2 else []


def _operands_finite(node: Any) -> bool | None:
    """Whether the forward operands ``node`` saved (``_saved_self``, ``_saved_mat2``; not
    its ``_saved_result``) are all finite: False when one already held a NaN or inf (the
    op was given it); None when the node saved no operand with values (a view, a tanh) or
    not every operand with a history (``x @ w`` with ``x`` data saves only ``x``): what
    it was given is not all known."""
    seen = tracked = 0
    for attr in dir(node):
        if not attr.startswith("_saved_") or attr.startswith("_saved_result"):
            continue
        v = _saved(node, attr)
        if not isinstance(v, torch.Tensor) or not has_values(v) or v.numel() == 0:
            continue
        seen += 1
        tracked += v.requires_grad
        if not _finite(v):
            return False
    inputs = sum(n is not None for n, _ in getattr(node, "next_functions", ()) or ())
    return True if seen and tracked >= inputs else None


@dataclass
class Birth:
    """What :func:`birth_event` found below a named node: ``carried`` is true when the
    node's own saved operands were non-finite already (its op carried a NaN it was given,
    it made none); ``event`` is the op found to make it from finite operands (None: the
    birth op is not known from the graph)."""

    carried: bool
    event: OpEvent | None = None


def birth_event(
    fn: Any,
    *,
    stop: Callable[[Any], bool] | None = None,
    values: Callable[[Any], torch.Tensor | None] | None = None,
    limit: int = 256,
) -> Birth:
    """The op that made the non-finite value ``fn`` (a tensor's ``grad_fn``) produced,
    when ``fn`` only carried it: a matmul whose saved operands hold the NaN a ``w / norm``
    of zero rows made before it. Walks back from ``fn`` through nodes that carried
    non-finite operands or saved none (views, transposes, a tanh's result) to the first one
    whose saved operands are finite and show its op made the value (:func:`_node_event`:
    0/0, log of 0, acos outside [-1, 1]); nodes for which ``stop`` is true (watched
    outputs) and leaves end a path. ``Birth.carried`` is false when ``fn``'s own operands
    were finite or not saved (it may have made the value itself); then nothing is walked
    unless it saved none."""
    own = _operands_finite(fn)
    if own is True:
        return Birth(carried=False)
    queue = deque([fn])
    seen: dict[int, Any] = {}
    while queue and len(seen) < limit:
        node = queue.popleft()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        if accumulates_grad(node) or (stop is not None and node is not fn and stop(node)):
            continue
        finite = _operands_finite(node)
        if finite is not False and node is not fn:
            try:
                event = _node_event(node, None, frozenset(), values)
            except Exception:  # an unusual node: read on
                event = None
            if event is not None and _CAME_IN not in event.scalars and not event.injected:
                if event.source is None:  # the forward line, where anomaly mode kept it
                    event.source, event.code = forward_line(node)
                return Birth(carried=own is False, event=event)
            if finite is True and event is None:
                continue  # finite operands and no op known to make it here: a dead end
        queue.extend(n for n, _ in getattr(node, "next_functions", ()) or ())
    return Birth(carried=own is False)


#: ``OpEvent.scalars`` key of an event made by :func:`leaf_event`: which operand was the leaf
LEAF = "leaf"


def leaf_event(node: Any, unsaved: bool = False) -> OpEvent | None:
    """An event for a leaf tensor (no autograd history: a parameter, a tensor made with
    ``requires_grad=True``) that already held NaN or inf when ``node``'s op read it: nothing
    this graph ran made the value, an update before the step wrote it (an optimizer built
    for a loss weight). The event names the op that read it (``injected``: its non-finite
    value came in from outside, no op made it); ``scalars[LEAF]`` is the operand's schema
    name, ``leaf_shape`` its shape, ``leaf_parameter`` 1 for an ``nn.Parameter``."""
    for i, (nxt, _) in enumerate(getattr(node, "next_functions", ()) or ()):
        if nxt is None:
            const = _constant_event(node, i, unsaved)
            if const is not None:
                return const
            continue
        if unsaved:
            continue
        if not accumulates_grad(nxt):
            continue
        v = getattr(nxt, "variable", None)
        if not isinstance(v, torch.Tensor) or not has_values(v):
            continue
        kinds = _kinds(v)
        if not kinds:
            continue
        base = name_of(node).split("Backward")[0]
        names = _ELEMENTWISE.get(base, ("", (), torch.mul))[1]
        role = names[i][0] if i < len(names) else f"input[{i}]"
        stat = describe(v) or TensorStat(math.nan, math.nan, v.numel())
        scalars: dict[str, float | int | str] = {
            LEAF: role,
            "leaf_shape": str(tuple(v.shape)),  # no "[": a summary's op part starts at " ["
            "leaf_parameter": int(isinstance(v, torch.nn.Parameter)),
            "leaf_version": int(v._version),
        }
        name, optimizer = _user_names(v)
        if name:
            scalars["leaf_name"] = name
        if optimizer:
            scalars["leaf_optimizer"] = optimizer
        return OpEvent(
            op=node_op(name_of(node)),
            phase=Phase.FORWARD,
            path=None,
            born=_join(kinds),
            output=stat,
            inputs=[(role, stat)],
            scalars=scalars,
            node=name_of(node),
            dtype=dtype_name(v.dtype),
            injected=True,
        )
    return None


#: ``OpEvent.scalars`` key of an event made by :func:`leaf_event` for an operand with no
#: autograd history (computed without gradients): which operand it was
CONSTANT = "constant"

#: nodes of arithmetic ops whose operand with no history is a weight or a scale the
#: graph applies (``w * loss``, ``loss / sigma**2``); a loss function's target is not one
_WEIGHT_NODES = frozenset({"Mul", "Div"})


def _constant_event(node: Any, i: int, unsaved: bool = False) -> OpEvent | None:
    """An event for the ``i``-th operand of an arithmetic node when it has no autograd
    history (no grad_fn, no requires_grad: computed under ``torch.no_grad``, from a buffer,
    a table lookup or data) and what the node saved of it holds NaN or inf: no op of the
    graph made the value, the code that computed the operand did (a loss weight
    ``min(snr, 5) / snr`` at ``snr = 0``, ``1 / sigma**2`` at ``sigma = 0``). ``unsaved``:
    also a node that saves no operand (``pred - y``), whose operand is then the one local
    of the user's frame that holds NaN or inf (see :func:`_nonfinite_local`): asked only
    when no other node of the graph explains the value."""
    base = name_of(node).split("Backward")[0]
    if base in _UNSAVED_NODES:
        if not unsaved:
            return None
        found = _nonfinite_local(lambda v: _fits_operand(node, i, v))
        if found is None:
            return None
        role, (name, v) = ("self", "other")[i] if i < 2 else f"input[{i}]", found
    elif base not in _WEIGHT_NODES:
        return None
    else:
        names = _ELEMENTWISE[base][1]
        if i >= len(names):
            return None
        role, attr = names[i]
        v = _saved(node, attr)
        name = None
    if not isinstance(v, torch.Tensor) or v.grad_fn is not None or v.requires_grad:
        return None
    if not has_values(v) or _python_number(v) is not None:
        return None  # a Python number: the op checker's scalars tell those
    kinds = _kinds(v)
    if not kinds:
        return None
    stat = describe(v) or TensorStat(math.nan, math.nan, v.numel())
    scalars: dict[str, float | int | str] = {
        CONSTANT: role,
        "constant_shape": str(tuple(v.shape)),  # no "[": a summary's op part starts at " ["
    }
    if name is None:
        name, _ = _user_names(v)
    if name:
        scalars["constant_name"] = name
    source, code = forward_line(node)
    return OpEvent(
        op=node_op(name_of(node)),
        phase=Phase.FORWARD,
        path=None,
        born=_join(kinds),
        output=stat,
        inputs=[(role, stat)],
        scalars=scalars,
        node=name_of(node),
        dtype=dtype_name(v.dtype),
        injected=True,
        source=source,
        code=code,
    )


#: elementwise arithmetic nodes of loss code whose operands may broadcast unintended
#: (:func:`column_broadcast`)
_BINARY_NODES = frozenset({"Sub", "Rsub", "Add", "Mul", "Div"})


@dataclass(frozen=True)
class ColumnBroadcast:
    """A binary elementwise node of loss code that broadcast a column against a row:
    ``pred - y`` with ``pred`` (N, 1) and ``y`` (N,) made (N, N). ``column`` is the index of
    the (N, 1) operand (0: the left one), ``shapes`` both operands' shapes (None for one
    with no autograd history, whose shape the graph does not keep), ``out`` the result's."""

    node: str
    column: int
    shapes: tuple[tuple[int, ...] | None, tuple[int, ...] | None]
    out: tuple[int, ...]


def column_broadcast(node: Any) -> ColumnBroadcast | None:
    """``node`` (Sub, Add, Mul, Div) broadcast an operand of shape (..., N, 1) against one of
    shape (..., N) -- or one with no autograd history, whose shape the graph does not keep --
    to (..., N, N): each prediction against every target, not its own (what NW506 says of
    an elementwise loss function). Read from the graph's shape metadata alone: no tensor is
    read. None otherwise, and for an operand that has the result's shape (a matrix the
    column is meant to broadcast against: ``margin - pos[:, None] + scores``).

    >>> p = torch.zeros(4, 1, requires_grad=True)
    >>> column_broadcast((p - torch.zeros(4)).grad_fn).out
    (4, 4)
    >>> column_broadcast((p.squeeze(1) - torch.zeros(4)).grad_fn) is None
    True
    """
    if name_of(node).split("Backward")[0] not in _BINARY_NODES:
        return None
    try:
        out = tuple(node._input_metadata[0].shape)
        shapes: list[tuple[int, ...] | None] = []
        for nxt, nr in node.next_functions:
            if nxt is None:
                shapes.append(None)
            elif accumulates_grad(nxt):
                shapes.append(tuple(nxt.variable.shape))
            else:
                shapes.append(tuple(nxt._input_metadata[nr].shape))
    except Exception:  # a node without shape metadata: nothing to say
        return None
    if len(shapes) != 2:
        return None
    for i, a in enumerate(shapes):
        b = shapes[1 - i]
        if a is None or len(a) < 2 or a[-1] != 1 or a[-2] < 2:
            continue
        if out != (*a[:-1], a[-2]) or (b is not None and b != a[:-1]):
            continue
        return ColumnBroadcast(name_of(node), i, (shapes[0], shapes[1]), out)
    return None


#: arithmetic nodes that save no operand (``pred - y``, ``pred + b``): an operand with no
#: history that held the NaN is found among the user's locals (:func:`_nonfinite_local`)
_UNSAVED_NODES = frozenset({"Sub", "Add"})

#: locals larger than this are not read for :func:`_nonfinite_local` (a dataset on the GPU)
_LOCAL_READ_LIMIT = 1 << 26


def _nonfinite_local(
    fits: Callable[[torch.Tensor], bool] | None = None,
) -> tuple[str, torch.Tensor] | None:
    """The one tensor with no autograd history (data: a batch's target, a mask, a table)
    that the innermost user frame binds to a local name and that holds NaN or inf, with that
    name: what a ``pred - y`` whose node saves no operand subtracted, when ``pred`` was
    finite. ``fits``: whether a local can be that operand by the graph's data flow (its
    shape, see :func:`_fits_operand`): the batch ``y`` was sliced from holds the NaN too,
    but the subtraction did not read it. None when no local, or more than one, holds such
    a value. Anomaly-time work: a read of each such local."""
    f = _frames.user_frame()
    if f is None:
        return None
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for k, v in list(f.f_locals.items()):
        if not isinstance(v, torch.Tensor) or not isinstance(k, str) or id(v) in seen:
            continue
        seen.add(id(v))
        if v.grad_fn is not None or v.requires_grad or not v.is_floating_point():
            continue
        if not has_values(v) or v.numel() > _LOCAL_READ_LIMIT:
            continue
        if (fits is not None and not fits(v)) or not _kinds(v):
            continue
        found.append((k, v))
    return found[0] if len(found) == 1 else None


def _local_output(node: Any) -> tuple[str, torch.Tensor] | None:
    """The tensor ``node`` made, with its name, when the innermost user frame binds it to a
    local (``cls_loss = focal.sum() / num_pos``): what a division whose numerator autograd
    did not save made, +inf or NaN, read from the value itself. Anomaly-time work."""
    f = _frames.user_frame()
    if f is None:
        return None
    for k, v in list(f.f_locals.items()):
        if not (isinstance(k, str) and isinstance(v, torch.Tensor) and v.grad_fn is node):
            continue
        if has_values(v) and v.numel() <= _LOCAL_READ_LIMIT:
            return k, v.detach()
    return None


def _local_named(t: torch.Tensor) -> str | None:
    """The one local name the innermost user frame binds to ``t`` (a saved operand: the
    same storage, shape and dtype), or None."""
    f = _frames.user_frame()
    if f is None:
        return None
    try:
        ptr = t.data_ptr()
        names = [
            k
            for k, v in list(f.f_locals.items())
            if isinstance(k, str)
            and isinstance(v, torch.Tensor)
            and v.dtype == t.dtype
            and v.shape == t.shape
            and has_values(v)
            and v.data_ptr() == ptr
        ]
    except Exception:  # a tensor without storage
        return None
    return names[0] if len(names) == 1 else None


def _fits_operand(node: Any, i: int, v: torch.Tensor) -> bool:
    """Whether ``v``, as the ``i``-th operand of the elementwise ``node`` (``pred - y``),
    broadcasts with the node's other operands to the shape of what the node made, as the
    graph recorded them (the node's output metadata; each other operand's, from the node
    that made it), itself or with a dimension of 1 added: a table or a batch whose slice is
    the operand does not. True when the graph does not say."""
    try:
        out = tuple(node._input_metadata[0].shape)
        others: list[tuple[int, ...]] = []
        for j, (nxt, nr) in enumerate(getattr(node, "next_functions", ()) or ()):
            if j == i or nxt is None:
                continue
            if accumulates_grad(nxt):
                others.append(tuple(nxt.variable.shape))
            else:
                others.append(tuple(nxt._input_metadata[nr].shape))
    except Exception:  # a node without metadata: the graph does not say
        return True
    own = tuple(v.shape)
    # the operand may be the local with a dimension of 1 added (y[:, None], y[None])
    return any(_broadcasts_to([s, *others], out) for s in (own, (*own, 1), (1, *own)))


def _broadcasts_to(shapes: Sequence[tuple[int, ...]], out: tuple[int, ...]) -> bool:
    """``shapes`` broadcast together to exactly ``out``."""
    got: list[int] = []
    for k in range(-max(len(s) for s in shapes), 0):
        sizes = {s[k] for s in shapes if len(s) >= -k} - {1}
        if len(sizes) > 1:
            return False  # shapes that do not broadcast together
        got.append(sizes.pop() if sizes else 1)
    return tuple(got) == out


def _user_names(t: torch.Tensor) -> tuple[str | None, str | None]:
    """The names the user's code binds ``t`` and the optimizer that updates it to, in the
    innermost user frame (its locals, then its globals), for a fix in the user's own names;
    None for what no name binds."""
    f = _frames.user_frame()
    if f is None:
        return None, None
    name = optimizer = None
    for scope in (f.f_locals, f.f_globals):
        for k, v in scope.items():
            if not k.isidentifier() or k.startswith("_"):
                continue
            if name is None and v is t:
                name = k
            elif (
                optimizer is None
                and isinstance(v, torch.optim.Optimizer)
                and any(p is t for g in v.param_groups for p in g["params"])
            ):
                optimizer = k
    return name, optimizer


def own_backward_event(
    module: torch.nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    *,
    path: str,
    pre_hooks: bool | int = True,
    names: Callable[[torch.nn.Module], str | None] | None = None,
    ends: Sequence[torch.Tensor] | None = None,
    grads: dict[str, torch.Tensor | TensorStat] | None = None,
    held: frozenset[str] | None = None,
) -> OpEvent | None:
    """The autograd node of a module's own code (the ops it runs between its children)
    whose backward makes a non-finite gradient from a finite one, with what it saved in
    forward and the user's line that made it. The original step's saved values are freed,
    so ``module`` is run again on its inputs (detached: its graph ends there) with
    gradients and anomaly mode on, and the backward of its own nodes alone is run (down to
    its submodules' outputs, its own parameters and its inputs) from a gradient of ones (or
    the step's own, ``grads``) at its outputs and at the values its own code gave the
    submodules it called, each node
    checked as :meth:`Watcher` checks the loss code's: a ``torch.where`` that
    hides ``log(0)`` gives 0 × -inf = NaN there whatever gradient arrives. No ``.grad`` is
    written; RNG state and buffers are restored. Anomaly-time work only: None when the
    replay makes no non-finite gradient.

    ``names``: the path of a submodule whose calls no hook watched (sentinel mode hooks the
    roots alone, see :class:`_SubmoduleOps`), None for the others: no gradient of its
    outputs was measured, so its backward is checked with the module's own, and a node its
    call made is told as its innermost such submodule's. ``ends``: the tensors whose
    gradients the backward is run for (a parameter whose gradient went bad: only the nodes
    on its way are run), in place of the module's own parameters and inputs.

    ``grads``: what the step's own backward gave the module's outputs, by their role
    (``output``, ``output[1]``, as the records name them): the tensor, or its statistics
    (see :func:`_seed`); any other output is given ones, and so is what the module gave its
    submodules. ``held``: the kinds the step's first bad gradient held, where it was seen.

    A node's backward at an infinite derivative makes inf from any gradient but 0 and NaN
    from 0 (a sqrt's at 0: the step's gradient there was 0 when the loss squared the
    sqrt's result), so the kind the replay's gradient made is told only when it is the
    step's: the replay was given the step's own gradients (``grads``); or the gradients the
    step wrote (a parameter's ``.grad`` among those the backward is run for, still
    non-finite) hold the kinds the replay's hold, from ones, zeros or minus ones at the
    outputs (the event is that run's); or the node makes NaN, or inf, whatever gradient
    reaches it (0 × -inf where a ``torch.where`` hid ``log(0)``); or ``held`` has no NaN
    and the node made inf (a NaN never becomes an inf). Otherwise the event says the node
    made :data:`UNKNOWN_KIND`, its values not counted."""
    # the submodules' outputs, by their node's id; the node is held so that id stays its
    # own (torch < 2.13 frees an unreferenced node's Python object, see NodeMarks)
    stops: dict[int, tuple[Any, torch.Tensor]] = {}
    # what the module's own code gave the submodules it called itself (``d = sqrt(...)``
    # then ``self.rbf(d)``): its gradient is part of the module's own backward too
    given: list[torch.Tensor] = []
    depth = [0]  # submodule calls open: 0 when the module's own code makes the call
    # the submodules checked with the module's own code (``names``): the nodes each call
    # made, by their id (held, as ``stops``), innermost call first; and per open call the
    # nodes of its inputs and the node counter as it began (see _Creations), where the
    # nodes its code made end
    owned: dict[int, tuple[Any, str]] = {}
    opened: list[tuple[list[Any], int | None]] = []

    def on_input(_m: torch.nn.Module, a: Any, kw: Any) -> None:
        if depth[0] == 0:
            given.extend(t for _, t in iter_tensors((a, kw), "") if t.grad_fn is not None)
        depth[0] += 1

    def on_output(_m: torch.nn.Module, _a: Any, out: Any) -> None:
        depth[0] -= 1
        for _, t in iter_tensors(out, ""):
            fn = t.grad_fn
            if fn is not None:
                stops[id(fn)] = (fn, t)

    def into(_m: torch.nn.Module, a: Any, kw: Any) -> None:
        came = [t.grad_fn for _, t in iter_tensors((a, kw), "") if t.grad_fn is not None]
        opened.append((came, _next_sequence_nr()))

    def made(m: torch.nn.Module, _a: Any, out: Any) -> None:
        came, start = opened.pop() if opened else ([], None)
        sub = names(m) if names is not None else None
        if sub is None:
            return
        ins, end = {id(n) for n in came}, _next_sequence_nr()

        def before(n: Any) -> bool:  # made before the call (a tensor the module holds)
            if id(n) in ins or accumulates_grad(n):
                return True
            if start is None or end is None:
                return False
            try:
                return not start <= int(n._sequence_nr()) < end
            except Exception:  # a node without a number: its place in the walk decides
                return False

        outs = [t.grad_fn for _, t in iter_tensors(out, "") if t.grad_fn is not None]
        for n in GraphWalk(outs, prune=before, limit=512):
            owned.setdefault(id(n), (n, sub))  # an inner call's are its own: it ended first

    def seen(m: torch.nn.Module) -> bool:
        return names is not None and names(m) is not None

    def leaf(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
            return t.detach().requires_grad_(t.requires_grad)
        return t

    args = tuple(leaf(a) for a in args)
    kwargs = {k: leaf(v) for k, v in kwargs.items()}
    found: list[OpEvent] = []
    inner = [m for m in module.modules() if m is not module]
    subs = [m for m in inner if not seen(m)]
    handles = [m.register_forward_hook(on_output) for m in subs]
    handles += [m.register_forward_pre_hook(on_input, with_kwargs=True) for m in subs]
    for m in inner:
        if seen(m):
            handles.append(m.register_forward_pre_hook(into, with_kwargs=True))
            handles.append(m.register_forward_hook(made))
    try:
        with preserved_state(module, _devices([args, kwargs])), _replay_scope():
            push_path(path)
            try:
                with torch.enable_grad(), torch.autograd.set_detect_anomaly(True, False):
                    out = call_forward(module, args, kwargs, pre_hooks=pre_hooks)
            except Exception:  # inputs not all at hand (a keyword or non-tensor argument)
                return None
            finally:
                pop_path()
            for h in handles:
                h.remove()
            named = [(r, t) for r, t in iter_tensors(out, "output") if t.grad_fn is not None]
            roots = [t for _, t in named]
            seeds = [_seed(t, (grads or {}).get(r)) for r, t in named]
            exact = bool(named) and all(s is not None for s in seeds)

            def stop(n: Any) -> bool:
                held = stops.get(id(n))
                return (held is not None and held[0] is n) or accumulates_grad(n)

            ids = {id(t) for t in roots}
            for t in given:  # the module's own values given to a submodule, once each
                if id(t) not in ids and t.requires_grad and not stop(t.grad_fn):
                    ids.add(id(t))
                    roots.append(t)
                    seeds.append(None)
                    exact = False  # what the submodule's backward gave it is not known

            nodes = list(GraphWalk([t.grad_fn for t in roots], prune=stop, limit=512))
            if ends is not None:
                wanted = [t for t in ends if _needs(t)]
            else:
                wanted = [t for _, t in stops.values() if t.requires_grad]
                wanted += [t for t in leaves([args, kwargs]) if _needs(t)]
                wanted += [p for p in module.parameters(recurse=False) if p.requires_grad]
            if not roots or not nodes or not wanted:
                return None

            # whether the first node found makes the same kind (NaN or inf) from any
            # gradient (see _same_kind_whatever_gradient), asked on the first run alone
            steady: list[bool] = []

            def check(node: Any, grad_inputs: Any, grad_outputs: Any) -> None:
                if found:
                    return
                bad = next((g for g in grad_inputs if g is not None and not _finite(g)), None)
                if bad is None or any(g is not None and not _finite(g) for g in grad_outputs):
                    return
                name = name_of(node)
                ev = node_event(node, bad, name=name)
                inner = None
                if len(grad_outputs) > 1 or custom_function(node) is not None:
                    # svd, eigh: which op of its formula made it; a custom Function: which
                    # op of its own backward(), at its line there
                    inner = _inner_backward_event(node, grad_outputs, name)
                    ev = inner or ev
                if not exact and not steady:
                    steady.append(_same_kind_whatever_gradient(node, grad_inputs, grad_outputs))
                if inner is None or custom_function(node) is None or not inner.source:
                    ev.source, ev.code = forward_line(node)
                held = owned.get(id(node))
                ev.path = held[1] if held is not None and held[0] is node else path
                found.append(ev)

            def run(
                seed: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
            ) -> tuple[OpEvent | None, Sequence[Any] | None]:
                """The backward from ``seed`` of each root: the first node found, and the
                gradients of ``wanted`` (None where it could not run to the end)."""
                found.clear()
                hooks = [n.register_hook(functools.partial(check, n)) for n in nodes]
                got: Sequence[Any] | None = None
                try:
                    got = torch.autograd.grad(
                        roots,
                        wanted,
                        grad_outputs=[seed(t, g) for t, g in zip(roots, seeds, strict=True)],
                        allow_unused=True,
                        retain_graph=True,  # run again from another gradient (see below)
                    )
                except RuntimeError:
                    # a node that cannot run under autograd.grad (a reentrant checkpoint's
                    # backward calls backward() itself): what was checked before it stands
                    pass
                finally:
                    for h in hooks:
                        h.remove()
                return (found[0] if found else None), got

            ev, got = run(lambda t, g: torch.ones_like(t) if g is None else g)
            if ev is None or exact:
                return ev
            # the kind the replay's gradient made, where it may not be the step's: the
            # gradients the step's backward wrote (a parameter's ``.grad``, read before the
            # update) say which gradient at the outputs gives what the step made
            real = [
                (i, _kinds(w.grad))
                for i, w in enumerate(wanted)
                if w.is_leaf and isinstance(w.grad, torch.Tensor) and not _finite(w.grad)
            ]
            if real:
                if _same_kinds(got, real):
                    return ev
                for seed in (_zeros_seed, _negated_seed):
                    other, got = run(seed)
                    if other is not None and other.node == ev.node and _same_kinds(got, real):
                        return other
            if steady and steady[0]:
                return ev
            if held is not None and "NaN" not in held and _family(_made(ev)) == {"inf"}:
                return ev  # a NaN never becomes an inf: the step's node made inf too
            ev.born, ev.output = UNKNOWN_KIND, TensorStat(math.nan, math.nan, 0)
            return ev
    finally:
        for h in handles:
            h.remove()


#: what :func:`own_backward_event` says a node made when the kind depends on the gradient
#: that reached it, which the replay does not know (a sqrt's backward at 0 makes +inf, -inf
#: or NaN as that gradient is positive, negative or zero)
UNKNOWN_KIND = "non-finite"


def _seed(t: torch.Tensor, real: torch.Tensor | TensorStat | None) -> torch.Tensor | None:
    """The gradient the step's backward gave ``t`` (a module's output made again), made
    from ``real``: the tensor itself; or from its statistics, a tensor of the one value
    every element held (min == max), else of ones, or minus ones, where every element was
    above, or below, 0 (the same signs and no zeros: the same kinds from a product or a
    quotient). None when ``real`` does not say it (another size, both signs or zeros,
    non-finite values: the gradient was bad before it got there)."""
    if isinstance(real, torch.Tensor):
        if tuple(real.shape) != tuple(t.shape) or not _finite(real):
            return None
        return real.detach().to(device=t.device, dtype=t.dtype)
    if not isinstance(real, TensorStat) or real.numel != t.numel() or not real.finite:
        return None
    if real.min == real.max:
        return torch.full_like(t, real.min)
    if real.min > 0 or real.max < 0:
        return torch.full_like(t, 1.0 if real.min > 0 else -1.0)
    return None


def _made(ev: OpEvent) -> frozenset[str]:
    return frozenset(k for k in ev.born.split(", ") if k in _ORDER)


def _zeros_seed(t: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    return torch.zeros_like(t)


def _negated_seed(t: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    return -torch.ones_like(t) if g is None else -g


def _same_kinds(got: Sequence[Any] | None, real: Sequence[tuple[int, frozenset[str]]]) -> bool:
    """The replay's gradients ``got`` hold the non-finite kinds the step's held, at each
    index of ``real``."""
    if got is None:
        return False
    return all(isinstance(got[i], torch.Tensor) and _kinds(got[i]) == kinds for i, kinds in real)


def _family(kinds: frozenset[str]) -> frozenset[str]:
    return frozenset("inf" if k.endswith("inf") else k for k in kinds)


def _same_kind_whatever_gradient(node: Any, grad_inputs: Sequence[Any], grad_outputs: Any) -> bool:
    """``node`` makes NaN, or inf, from a gradient of zeros and from the negation of
    ``grad_outputs`` as it made from ``grad_outputs`` (or nothing non-finite: then the
    step's value came with a gradient that was not 0): what it made depends on its saved
    forward values, not on the gradient that reached it (0 × -inf where a ``torch.where``
    hid ``log(0)``; an overflow of a product). A sqrt's backward at 0 makes inf from any
    gradient but 0, and NaN from 0. Run from the node's post-hook, where its saved values
    are alive. False when it cannot be run again."""
    made = [_family(_kinds(g)) if isinstance(g, torch.Tensor) else None for g in grad_inputs]
    for change in (torch.zeros_like, torch.neg):
        given = [change(g) if isinstance(g, torch.Tensor) else g for g in grad_outputs]
        try:
            with torch.no_grad():
                again = node(*given)
        except Exception:  # a node that cannot be called from Python: not known
            return False
        again = again if isinstance(again, (tuple, list)) else (again,)
        for was, g in zip(made, again, strict=False):
            kinds = _family(_kinds(g)) if isinstance(g, torch.Tensor) else frozenset()
            if was and kinds and kinds != was:
                return False
    return True


def _inner_backward_event(node: Any, grad_outputs: Sequence[Any], name: str) -> OpEvent | None:
    """The aten op inside the backward of ``node``, an op with several outputs (svd's U,
    S and Vh, eigh's eigenvalues and eigenvectors), that made a non-finite value from
    finite ones: its backward formula combines them through several ops (svd's and eigh's
    divide by the differences of the singular values or eigenvalues), and the node's saved
    values alone do not say which; or a custom autograd.Function's node, whose backward()
    is the user's code (the op's line is then the one inside it). The node's backward is
    run once more on the same gradients under an :class:`OpChecker`, from the node's
    post-hook (its saved values are alive there); the event is the one forensic mode
    records. None when it cannot run or no op made it."""
    # a custom Function's node is called through its apply (its backward() on itself)
    call = node.apply if custom_function(node) is not None else node
    try:
        with OpChecker(max_events=4, nanwatch_calls=True) as chk:
            call(*grad_outputs)
    except Exception:  # a node that cannot be called from Python: its own event stands
        return None
    ev = next(
        (e for e in chk.events if e.phase is Phase.BACKWARD and not e.injected and e.born),
        None,
    )
    if ev is not None:
        ev.node = name
        ev.backward_at = None
    return ev


def _needs(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all()) if t.is_floating_point() or t.is_complex() else True
