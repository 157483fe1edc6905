"""Op-level tracing: which aten op created a NaN or inf, where in the user's code.

:class:`OpChecker` is a ``TorchDispatchMode`` that looks at every aten op's floating
outputs, forward and backward, and records an :class:`~nanwatch.records.OpEvent` when an op
*creates* a non-finite value its inputs did not hold (``log`` of 0 -> -inf; ``0 * -inf`` ->
NaN; a float32 -> float16 cast of 70000 -> inf). Non-finite outputs are remembered (weakly)
so a later event names the earlier one as its cause: op-level data flow, not guesswork.

:func:`replay` re-runs a module's forward on its inputs under the checker, with
``torch.no_grad()``, and puts RNG state and buffers (BatchNorm running statistics) back,
so the replay changes nothing.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nanwatch import _frames
from nanwatch.records import OpEvent, Phase, TensorStat
from nanwatch.stats import describe, dtype_name, has_values

_aten = torch.ops.aten

#: ops whose outputs are uninitialized memory or mere metadata: never a "birth".
_IGNORED_PACKETS = {
    _aten.empty,
    _aten.empty_like,
    _aten.empty_strided,
    _aten.new_empty,
    _aten.new_empty_strided,
    _aten.detach,
    _aten.alias,
    _aten.lift_fresh,
    _aten.lift_fresh_copy,
    _aten.set_,
    _aten.resize_,
    _aten._local_scalar_dense,
    _aten.clone,
    _aten.contiguous,
}

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
    _tls.replaying = getattr(_tls, "replaying", 0) + 1
    try:
        yield
    finally:
        _tls.replaying -= 1


def _kinds(t: torch.Tensor) -> frozenset[str]:
    """Which non-finite kinds ``t`` holds; empty when finite. One pass in the common case."""
    if not has_values(t):
        return frozenset()
    v = t
    if v.is_complex():
        v = v.abs()
    if v.layout is not torch.strided or v.is_nested:
        return frozenset()
    with torch.no_grad():
        if v.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            v = v.float()
        mn, mx = torch.aminmax(v)
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


def _join(kinds: frozenset[str]) -> str:
    return ", ".join(sorted(kinds, key=_ORDER.__getitem__))


@dataclass
class _Seen:
    ref: weakref.ReferenceType[torch.Tensor]
    event: OpEvent | None


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
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.events: list[OpEvent] = []
        self.checked = 0
        self._current_path = current_path
        self._backward_site = backward_site
        self._max_events = max_events
        self._seen: dict[int, _Seen] = {}
        self._on_error = on_error
        self._broken = False

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._broken or func.overloadpacket in _IGNORED_PACKETS or func.is_view:
            return out
        try:
            self._check(func, args, kwargs, out)
        except Exception as exc:  # nanwatch must never break the computation it watches
            self._broken = True
            if self._on_error is not None:
                self._on_error(exc)
        return out

    # -- internals -------------------------------------------------------------------
    def _backward_call(self) -> tuple[str | None, str | None]:
        here = _frames.describe_frame(_frames.user_frame())
        if here[0] is None and self._backward_site is not None:
            return self._backward_site()
        return here

    def _lookup(self, t: torch.Tensor) -> _Seen | None:
        seen = self._seen.get(id(t))
        if seen is not None and seen.ref() is t:
            return seen
        return None

    def _check(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and has_values(t)]
        if not outs:
            return
        self.checked += 1
        out_kinds = [_kinds(t) for t in outs]
        if not any(out_kinds):
            return
        schema_args = func._schema.arguments
        inputs: list[tuple[str, torch.Tensor]] = []
        scalars: dict[str, float | int | str] = {}
        scalar_kinds: frozenset[str] = frozenset()
        for i, a in enumerate(args):
            name = schema_args[i].name if i < len(schema_args) else f"arg{i}"
            scalar_kinds |= self._collect(name, a, inputs, scalars)
        for name, a in kwargs.items():
            scalar_kinds |= self._collect(name, a, inputs, scalars)
        in_kinds: frozenset[str] = frozenset()
        cause: OpEvent | None = None
        for _, t in inputs:
            seen = self._lookup(t)
            k = _kinds(t)
            in_kinds |= k
            if k and cause is None and seen is not None:
                cause = seen.event
        all_out = frozenset().union(*out_kinds)
        born = all_out - in_kinds - scalar_kinds
        injected = (all_out & scalar_kinds) - in_kinds
        event: OpEvent | None = None
        if (born or injected) and len(self.events) < self._max_events:
            node: Any = current_autograd_node()  # None outside backward
            backward_at: str | None = None
            if node is not None:
                phase = Phase.BACKWARD
                meta: dict[str, Any] = node.metadata
                path = meta.get("nanwatch.path")
                source, code = forward_line(node)
                backward_at, backward_code = self._backward_call()
                if source is None:  # made before anomaly mode was on: the call is all we know
                    source, code = backward_at, backward_code
                node_name = node.name()
            else:
                phase = Phase.FORWARD
                path = self._current_path() if self._current_path is not None else None
                source, code = _frames.describe_frame(_frames.user_frame())
                node_name = None
            first_bad = next(t for t, k in zip(outs, out_kinds, strict=True) if k)
            out_stat = describe(first_bad) or TensorStat(math.nan, math.nan, 0)
            event = OpEvent(
                op=str(func),
                phase=phase,
                path=path,
                born=_join(born or injected),
                output=out_stat,
                inputs=[(name, describe(t)) for name, t in inputs[:6]],
                scalars=dict(list(scalars.items())[:6]),
                source=source,
                code=code,
                node=node_name,
                dtype=dtype_name(first_bad.dtype),
                cause=cause,
                injected=not born,
                backward_at=backward_at,
            )
            self.events.append(event)
        # remember every non-finite output, so later ops can name their cause
        for t, k in zip(outs, out_kinds, strict=True):
            if k:
                self._seen[id(t)] = _Seen(weakref.ref(t), event if event is not None else cause)

    @staticmethod
    def _collect(
        name: str,
        a: Any,
        inputs: list[tuple[str, torch.Tensor]],
        scalars: dict[str, float | int | str],
    ) -> frozenset[str]:
        if isinstance(a, torch.Tensor):
            if has_values(a):
                inputs.append((name, a))
            return frozenset()
        if isinstance(a, (list, tuple)):
            kinds: frozenset[str] = frozenset()
            for j, x in enumerate(a):
                if isinstance(x, torch.Tensor):
                    if has_values(x):
                        inputs.append((f"{name}[{j}]", x))
                else:
                    kinds |= _scalar_kinds(x)
            return kinds
        if isinstance(a, bool):
            return frozenset()
        if isinstance(a, (int, float)):
            scalars[name] = a
            return _scalar_kinds(a)
        if isinstance(a, str):
            scalars[name] = a
        return frozenset()

    def first(self) -> OpEvent | None:
        """The first event that created NaN or +inf (the usual trigger), else the first."""
        for ev in self.events:
            if not ev.injected and ("NaN" in ev.born or "+inf" in ev.born):
                return ev
        for ev in self.events:
            if not ev.injected:
                return ev
        return self.events[0] if self.events else None


def forward_line(node: Any) -> tuple[str | None, str | None]:
    """The user's line that created autograd ``node`` in forward (``file.py:42``, its text):
    the innermost user frame of the stack anomaly mode stored on it; (None, None) when the
    node was made with anomaly mode off."""
    try:
        tb = node.metadata.get("traceback_")
    except Exception:  # a node without metadata (a C++ function's wrapper)
        return None, None
    return _frames.user_line_from_traceback(tb) if tb else (None, None)


def stamp_graph(outputs: Sequence[torch.Tensor], path: str) -> None:
    """Label the autograd nodes a module's forward created with the module's path, so a
    backward op can be traced to its module (forensic mode). Stops at nodes already stamped
    (children complete before parents, so each node gets its innermost module)."""
    stack: list[Any] = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        meta: dict[str, Any] = node.metadata
        if "nanwatch.path" in meta:
            continue
        if type(node).__name__ == "AccumulateGrad":
            continue
        meta["nanwatch.path"] = path
        stack.extend(n for n, _ in node.next_functions)


def node_op(name: str) -> str:
    """The forward op of an autograd node: ``PowBackward0`` -> ``aten.pow``,
    ``MseLossBackward0`` -> ``aten.mse_loss``."""
    base = re.sub(r"Backward\d*$", "", name)
    return "aten." + re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", base).lower()


def _saved_order(attr: str) -> tuple[int, str]:
    return ({"_saved_self": 0, "_saved_other": 1}.get(attr, 2), attr)


def node_event(node: Any, grad: torch.Tensor, *, name: str, limit: int = 4) -> OpEvent:
    """An event for the autograd node whose backward just made the non-finite gradient
    ``grad``, built in the node's post-hook -- before autograd frees what the node saved
    in forward (its inputs, its result, its scalar arguments), which is the evidence:
    ``self`` with 10 exact zeros and ``exponent`` 0.5 for ``(1 - p) ** 0.5`` at p == 1.
    ``node`` may be None (torch without ``_current_autograd_node``): the name alone."""
    inputs: list[tuple[str, TensorStat | None]] = []
    scalars: dict[str, float | int | str] = {}
    path = None
    if node is not None:
        path = node.metadata.get("nanwatch.path")
        for attr in sorted((a for a in dir(node) if a.startswith("_saved_")), key=_saved_order):
            try:
                v = getattr(node, attr)
            except Exception:  # freed, or modified in place since (autograd raises)
                continue
            key = attr.removeprefix("_saved_")
            if isinstance(v, torch.Tensor):
                if len(inputs) < limit and has_values(v):
                    inputs.append((key, describe(v)))
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and len(scalars) < limit:
                scalars[key] = v
    out = describe(grad) or TensorStat(math.nan, math.nan, 0)
    return OpEvent(
        op=node_op(name),
        phase=Phase.BACKWARD,
        path=path,
        born=out.kinds(),
        output=out,
        inputs=inputs,
        scalars=scalars,
        node=name,
        dtype=dtype_name(grad.dtype),
    )


@dataclass
class ReplayResult:
    """What a replay found: the op events, and whether it ran clean (a transient suspect)."""

    events: list[OpEvent] = field(default_factory=list)
    error: str | None = None
    #: the replayed code drew random numbers (dropout, randint, ...): a clean replay then
    #: says nothing about the original run, whose draws were others
    random: bool = False
    attempts: int = 0  #: how many times the code was run

    @property
    def clean(self) -> bool:
        return not self.events and self.error is None

    @property
    def conclusive(self) -> bool:
        """A clean replay is evidence of a transient fault only if it ran the same
        computation: one that drew no random numbers."""
        return not (self.clean and self.random)

    def first(self) -> OpEvent | None:
        for ev in self.events:
            if not ev.injected and ("NaN" in ev.born or "+inf" in ev.born):
                return ev
        for ev in self.events:
            if not ev.injected:
                return ev
        return None


def _devices(objs: Sequence[Any]) -> set[torch.device]:
    leaves = tree_flatten(list(objs))[0]
    return {t.device for t in leaves if isinstance(t, torch.Tensor)}


@contextlib.contextmanager
def preserved_state(module: torch.nn.Module | None, devices: set[torch.device]) -> Iterator[None]:
    """Save RNG state (CPU and the given CUDA devices) and the module's buffers; put them
    back afterwards whatever happens."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = {d: torch.cuda.get_rng_state(d) for d in devices if d.type == "cuda"}
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    if module is not None:
        with torch.no_grad():
            saved = [(b, b.detach().clone()) for b in module.buffers() if not b.is_meta]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, copy in saved:
                b.copy_(copy)
        torch.set_rng_state(cpu_rng)
        for d, state in cuda_rng.items():
            torch.cuda.set_rng_state(state, d)


def rng_states(devices: set[torch.device]) -> list[torch.Tensor]:
    """The CPU generator's state and that of each CUDA device in ``devices``."""
    states = [torch.get_rng_state()]
    states += [torch.cuda.get_rng_state(d) for d in sorted(devices, key=str) if d.type == "cuda"]
    return states


def drew_random(before: list[torch.Tensor], devices: set[torch.device]) -> bool:
    """Whether a generator moved since ``before`` (see :func:`rng_states`)."""
    return any(not torch.equal(a, b) for a, b in zip(before, rng_states(devices), strict=True))


def replay(
    module: torch.nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    *,
    path: str,
    current_path: Callable[[], str | None] | None = None,
    on_error: Callable[[BaseException], None] | None = None,
    attempts: int = 8,
) -> ReplayResult:
    """Re-run ``module.forward(*args, **kwargs)`` under :class:`OpChecker` with
    ``torch.no_grad()``; RNG state and buffers are restored afterwards. Every watcher's hooks
    stay quiet during the replay (they only track which module is running).

    A forward that draws random numbers (dropout, ``torch.randint``) cannot repeat the
    original draws, which are gone: it is run again with new draws, up to ``attempts``
    times, until one reproduces a non-finite value; ``result.random`` says so."""
    result = ReplayResult()
    devices = _devices([args, kwargs])
    with preserved_state(module, devices), _replay_scope():
        for _ in range(max(1, attempts)):
            chk = OpChecker(current_path=current_path or replay_path, on_error=on_error)
            before = rng_states(devices)
            push_path(path)
            try:
                with torch.no_grad(), chk:
                    module.forward(*args, **kwargs)
            except Exception as exc:
                result.error = f"{type(exc).__name__}: {exc}"
            finally:
                pop_path()
            result.events = chk.events
            result.attempts += 1
            drew = drew_random(before, devices)
            result.random = result.random or drew
            if not (drew and result.clean):
                break
    return result


# --------------------------------------------------------------------------- graph evidence
def _saved(node: Any, name: str) -> Any:
    try:
        return getattr(node, name)
    except Exception:  # freed, or modified in place since (autograd raises)
        return None


def _has(t: Any, pred: Callable[[torch.Tensor], torch.Tensor]) -> int:
    if not isinstance(t, torch.Tensor) or not has_values(t) or t.is_complex():
        return 0
    with torch.no_grad():
        return int(pred(t.detach().float()).sum())


def _domain_events(node: Any) -> tuple[str, str, str] | None:
    """(aten op, kinds born, why) when the node's saved tensors show a value outside its
    op's domain: log of 0 or of a negative, division by 0, sqrt of a negative, ... (the
    op semantics of PyTorch, not a list of scenarios)."""
    name = node.name()
    base = name.split("Backward")[0]
    if base in ("Log", "Log2", "Log10"):
        x = _saved(node, "_saved_self")
        zeros, neg = _has(x, lambda v: v == 0), _has(x, lambda v: v < 0)
        if zeros or neg:
            born = ", ".join(k for k, n in (("NaN", neg), ("-inf", zeros)) if n)
            return f"aten.{base.lower()}", born, f"input holds {zeros} zeros and {neg} negatives"
    elif base == "Log1p":
        x = _saved(node, "_saved_self")
        at, below = _has(x, lambda v: v == -1), _has(x, lambda v: v < -1)
        if at or below:
            born = ", ".join(k for k, n in (("NaN", below), ("-inf", at)) if n)
            return "aten.log1p", born, f"input holds {at} values of -1 and {below} below -1"
    elif base == "Div":
        den = _saved(node, "_saved_other")
        zeros = _has(den, lambda v: v == 0)
        if zeros:
            return "aten.div", "NaN, +inf, -inf", f"denominator holds {zeros} zeros"
    elif base in ("Sqrt", "Rsqrt"):
        r = _saved(node, "_saved_result")
        bad = _has(r, lambda v: ~torch.isfinite(v))
        zeros = _has(r, lambda v: v == 0) if base == "Sqrt" else 0
        if bad:
            return f"aten.{base.lower()}", "NaN", f"{bad} results are not finite"
        if zeros:
            return "aten.sqrt", "+inf", f"{zeros} results are 0: the gradient 1/(2 sqrt(x)) is inf"
    elif base == "Pow":
        x = _saved(node, "_saved_self")
        exp = _saved(node, "_saved_exponent")
        if isinstance(exp, (int, float)) and not float(exp).is_integer():
            neg = _has(x, lambda v: v < 0)
            if neg:
                return "aten.pow", "NaN", f"{neg} negative bases with exponent {exp}"
        if isinstance(exp, (int, float)) and exp < 0:
            zeros = _has(x, lambda v: v == 0)
            if zeros:
                return "aten.pow", "+inf", f"{zeros} zero bases with exponent {exp}"
    elif base in ("Exp", "Reciprocal"):
        r = _saved(node, "_saved_result")
        inf = _has(r, torch.isinf)
        if inf:
            what = "exp overflowed" if base == "Exp" else "1/0"
            return f"aten.{base.lower()}", "+inf", f"{inf} results are inf ({what})"
    elif base in ("Acos", "Asin"):
        x = _saved(node, "_saved_self")
        out = _has(x, lambda v: v.abs() > 1)
        if out:
            return f"aten.{base.lower()}", "NaN", f"{out} inputs outside [-1, 1]"
    return None


def graph_evidence(
    fn: Any, *, stop: set[int] | None = None, limit: int = 512
) -> tuple[list[str], list[OpEvent]]:
    """Read the autograd graph below ``fn`` (a loss's ``grad_fn``) down to the nodes in
    ``stop`` (ids of the grad_fns of watched outputs): the names of the ops it ran, and an
    OpEvent for every node whose saved tensors show a value outside its op's domain (log of
    0, division by 0, ...) -- op-level evidence for code that no module wraps, without
    re-running it. Events come nearest-to-the-inputs first."""
    names: list[str] = []
    events: list[OpEvent] = []
    seen: set[int] = set()
    order: list[Any] = []
    stack = [fn]
    stop = stop or set()
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if id(node) in stop or type(node).__name__ == "AccumulateGrad":
            continue
        order.append(node)
        stack.extend(n for n, _ in node.next_functions)
    for node in reversed(order):  # producers before consumers
        base = node.name().split("Backward")[0]
        names.append(base.lower())
        found = _domain_events(node)
        if found is None:
            continue
        op, born, why = found
        x = next(
            (
                _saved(node, a)
                for a in ("_saved_self", "_saved_other", "_saved_result")
                if isinstance(_saved(node, a), torch.Tensor)
            ),
            None,
        )
        inputs = [("self", describe(x) if isinstance(x, torch.Tensor) else None)]
        events.append(
            OpEvent(
                op=op,
                phase=Phase.FORWARD,
                path=None,
                born=born,
                output=TensorStat(math.nan, math.nan, 0),
                inputs=inputs,
                scalars={"evidence": why},
                node=node.name(),
                dtype=dtype_name(x.dtype) if isinstance(x, torch.Tensor) else "",
            )
        )
    return names[::-1], events
