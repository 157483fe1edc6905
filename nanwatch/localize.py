"""Localization: the first place, in execution order, where a value went bad.

A pure function of a step's records, testable without a model. The *trigger* is the first
record holding NaN or +inf (or any non-finite gradient or weight): -inf alone is how masks
are written (``masked_fill(mask, -inf)`` before a softmax) and is not an anomaly until it
turns into NaN or inf, reaches a loss, or comes out of a module that cannot write a mask
(a Linear, a Conv, an RNN: there it is an overflow). From the trigger, the data flow recorded by the
watcher (which tensor fed which module) names the *producer*: the module whose own code
created the value while everything it was computed from was finite.
"""

from __future__ import annotations

import fnmatch
import linecache
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from nanwatch.records import (
    LOSS_PATH,
    Anomaly,
    AnomalyKind,
    Call,
    OpEvent,
    Phase,
    Record,
    StepTrace,
    TensorStat,
)

_GRAD_PHASES = (Phase.BACKWARD, Phase.GRADIENT)


def allowed(path: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(path, p) for p in patterns)


def is_trigger(
    rec: Record, trace: StepTrace, *, allow: Sequence[str] = (), scaled_grads: bool = False
) -> bool:
    """Whether ``rec`` is an anomaly on its own (see the module docstring)."""
    s = rec.stat
    if s is None or s.finite:
        return False
    if allow and allowed(rec.path, allow):
        return False
    if rec.phase in _GRAD_PHASES:
        # a GradScaler expects inf/NaN in scaled gradients now and then: it skips the step.
        return not scaled_grads
    if rec.phase is Phase.PARAMETER:
        return True
    if s.has_nan or s.has_posinf:
        return True
    if rec.phase is not Phase.FORWARD:
        return False
    call = trace.call(rec.call)
    if call is None:
        return False
    if rec.role.startswith("output") and (call.arithmetic or _unwatched_product(trace, call, rec)):
        return True  # a Linear or a Conv writes no mask: its -inf is an overflow
    return s.numel == 1 and (call.is_loss or call.root)  # a loss of -inf


#: autograd nodes of ops that cannot write a mask (see :data:`_OVERFLOW_OPS`): a module
#: output they made holding -inf is an overflow (a last Linear's ``AddmmBackward0``)
_OVERFLOW_NODES = frozenset(
    {
        "Addmm",
        "Mm",
        "Bmm",
        "Baddbmm",
        "Addbmm",
        "Addmv",
        "Mv",
        "Dot",
        "Vdot",
        "Convolution",
        "ConvolutionBackwardOverrideable",
        "CudnnConvolution",
        "CudnnConvolutionTranspose",
        "MkldnnConvolution",
        "MkldnnLinear",
        "SlowConv2D",
        "SlowConvTranspose2D",
        "ScaledMm",
    }
)


def _unwatched_product(trace: StepTrace, call: Call, rec: Record) -> bool:
    """``rec``, an output of ``call`` (not a loss) whose modules inside recorded nothing (a
    sentinel step hooks only the roots: a Sequential's Linear is not watched; or a module
    with no children), was made by an op that cannot write a mask, as its autograd node
    says (``AddmmBackward0``): what the unwatched children or the module's own code computed
    overflowed. A -inf a mask wrote (``MaskedFillBackward0``, ``WhereBackward0``) or one
    made without autograd is left to become NaN or reach the loss first."""
    if call.is_loss or call.path == LOSS_PATH or rec.grad_fn is None:
        return False
    if _node_base(rec.grad_fn).lstrip("_") not in _OVERFLOW_NODES:
        return False
    return not any(c.parent == call.id for c in trace.calls)


def first_trigger(
    trace: StepTrace, *, allow: Sequence[str] = (), scaled_grads: bool = False
) -> Record | None:
    """The first trigger in execution order. An input whose NaN/inf its module absorbed
    (see :func:`_absorbed_input`) is passed over for a later forward value that went bad
    outside that call and was not that tensor: it was not made from it (a NaN target the
    loss code reads is not the NaN input the model cleaned). The input stays the trigger
    for what went bad inside the call (a child's NaN output a ``torch.where`` hid) and for
    a gradient or a weight (the backward runs through what the forward hid)."""
    absorbed: list[Record] = []
    for r in trace.records:
        if not is_trigger(r, trace, allow=allow, scaled_grads=scaled_grads):
            continue
        if _absorbed_input(trace, r):
            absorbed.append(r)
            continue
        if not absorbed:
            if r.phase is Phase.GRADIENT:
                return _first_accumulated(trace, r, allow=allow, scaled_grads=scaled_grads)
            return r
        if r.phase is not Phase.FORWARD and r.phase is not Phase.INPUT:
            return absorbed[0]
        src = trace.resolve(r)
        for a in absorbed:
            call = trace.call(a.call)
            if src is trace.resolve(a) or (call is not None and call.start <= r.index < call.end):
                return a
        return r
    return absorbed[0] if absorbed else None


def _first_accumulated(
    trace: StepTrace, first: Record, *, allow: Sequence[str], scaled_grads: bool
) -> Record:
    """Of the bad parameter gradients read with ``first`` (one end-of-backward check records
    them all, in ``parameters()`` order), the one backward wrote first: a parameter's
    gradient is made in its module's backward, which runs when the gradient of that
    module's output arrives, so the module whose output gradient was recorded earliest in
    this backward pass (the head of an MLP, before the first layer) made its gradient
    first. A gradient whose module recorded no output gradient keeps its place after those
    that did."""
    records = trace.records
    at = next((i for i, r in enumerate(records) if r is first), None)
    if at is None:
        return first
    lo = at
    while lo > 0 and records[lo - 1].phase is Phase.GRADIENT:
        lo -= 1
    hi = at
    while hi + 1 < len(records) and records[hi + 1].phase is Phase.GRADIENT:
        hi += 1
    bad = [
        r
        for r in records[at : hi + 1]
        if is_trigger(r, trace, allow=allow, scaled_grads=scaled_grads)
    ]
    if len(bad) < 2:
        return first
    start = lo
    while start > 0 and records[start - 1].phase is not Phase.GRADIENT:
        start -= 1  # this backward pass's records: back to the previous gradient check
    arrived: dict[str, int] = {}
    for r in records[start:lo]:
        if r.phase is Phase.BACKWARD:
            arrived.setdefault(r.path, r.index)
    if not any(r.path in arrived for r in bad):
        return first
    return min(bad, key=lambda r: (arrived.get(r.path, math.inf), r.index))


def _absorbed_input(trace: StepTrace, rec: Record) -> bool:
    """``rec`` is a module input holding NaN/inf that the module's call absorbed: the call
    returned, and every one of its outputs was measured finite (``torch.nan_to_num(x)`` or
    ``torch.where(torch.isnan(x), 0, x)`` first thing in ``forward``)."""
    if rec.phase is not Phase.INPUT:
        return False
    call = trace.call(rec.call)
    if call is None or call.end < 0:
        return False  # still running: what it returns is not known yet
    outs = [r for r in trace.records if r.call == call.id and r.phase is Phase.FORWARD]
    if not outs:
        return False
    for o in outs:
        s = trace.resolve(o).stat
        if s is None or not s.finite:
            return False
    return True


def _earliest_neginf(trace: StepTrace, recs: Iterable[Record], limit: int = 64) -> Record | None:
    """Walk back from ``recs`` through the data flow to the first record where a -inf
    appeared (its source was free of it)."""
    best: Record | None = None
    todo = list(recs)
    seen: set[int] = set()
    while todo and len(seen) < limit:
        r = todo.pop()
        if r.index in seen:
            continue
        seen.add(r.index)
        m = trace.resolve(r)
        if m.stat is None:
            todo.extend(_operands(trace, m))
            continue
        if not m.stat.has_neginf:
            continue
        if best is None or m.index < best.index:
            best = m
        todo.extend(_operands(trace, m))  # measured: the parent's code may have passed it on
        if m.phase is Phase.FORWARD:
            todo.extend(trace.inputs_of(m.call))
            call = trace.call(m.call)
            if call is not None:  # what its children made inside it (a flow's log-det terms)
                todo.extend(
                    r
                    for r in trace.records
                    if call.start <= r.index < m.index
                    and r.phase is Phase.FORWARD
                    and r.call != m.call
                    and r.stat is not None
                    and r.stat.has_neginf
                )
    return best


def _operands(trace: StepTrace, rec: Record) -> list[Record]:
    """What a module input that no record links (``rec``) can have been made of: the
    watcher leaves such an input unmeasured only when its parent's code made it with an op
    that cannot create a non-finite value (``x.chunk(2)``, a concatenation, a residual sum)
    from recorded tensors, so its values came from the parent's inputs or from the outputs
    of the parent's children that ran before it (a measured one may have come from them
    too: forensic mode measures every input). Empty for a linked record."""
    if rec.phase is not Phase.INPUT or rec.source is not None:
        return []
    parent = _parent(trace, trace.call(rec.call))
    if parent is None:
        return []
    return [
        r
        for r in trace.records
        if (r.call == parent.id and r.phase is Phase.INPUT)
        or (parent.start < r.index < rec.index and r.phase is Phase.FORWARD)
    ]


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _made_of(trace: StepTrace, rec: Record) -> int | None:
    """The record of the tensor an unlinked module input was most likely made from by a view
    or another op that cannot create a non-finite value (``conv(x).transpose(1, 2)`` passed
    to the next module): such an input is a new tensor, so the watcher links it to nothing,
    and it is bounded by its operands' records, so it is not measured either. Its source is
    inferred from the data flow: the latest module output recorded before it that holds as
    many values of its dtype (a view keeps both). None for a measured or linked input."""
    if rec.phase is not Phase.INPUT or rec.source is not None or rec.stat is not None:
        return None
    if not rec.dtype.startswith(("float", "bfloat", "complex")):
        return None  # an integer input outside a root or loss is not even kept
    n = _numel(rec.shape)
    for r in reversed(trace.records):
        if r.index >= rec.index or r.phase is not Phase.FORWARD:
            continue
        if r.dtype == rec.dtype and _numel(r.shape) == n:
            return r.index
    return None


def _consumers(trace: StepTrace, rec: Record, before: int | None = None) -> tuple[list[Call], bool]:
    """Module calls that took ``rec``'s tensor as an input, seeing through passthrough
    modules (ReLU and friends cannot create a non-finite gradient, so look past them); and
    whether the tensor (or what it passed through) was a root's output, which code outside
    every watched module (the loss) consumed. With no module taking the tensor itself, the
    ones that took a view of it (see :func:`_made_of`) and whose output gradient was
    recorded before the record ``before`` (the backward ran through them first)."""
    out, reached_root = _consumers_by(trace, rec, views=False)
    if not out and before is not None:
        views, _ = _consumers_by(trace, rec, views=True)
        out = [
            c
            for c in views
            if any(
                r.call == c.id and r.phase is Phase.BACKWARD and r.index < before
                for r in trace.records
            )
        ]
    return _outermost(trace, out), reached_root


def _outermost(trace: StepTrace, calls: list[Call]) -> list[Call]:
    """``calls`` less those nested inside another of them: a child given the same tensor as
    its parent (``self.enc(pts)`` in a module that also uses ``pts``) runs its backward
    inside the parent's, so the two are one consumer, the parent. A parent with no code of
    its own that could have made a gradient (a Sequential passing its input to its first
    child, see :func:`_pure_container`) is the one dropped: its child is the answer."""
    ids = {c.id for c in calls}

    def ancestors(c: Call) -> list[Call]:
        out: list[Call] = []
        up = _parent(trace, c)
        while up is not None:
            out.append(up)
            up = _parent(trace, up)
        return out

    pure = {c.id for c in calls if _pure_container(trace, c)}
    keep: list[Call] = []
    for c in calls:
        if any(up.id in ids and up.id not in pure for up in ancestors(c)):
            continue  # inside a consumer whose own code used the tensor too
        if c.id in pure and any(c in ancestors(d) for d in calls if d is not c):
            continue  # a container: the child given the tensor is the more specific one
        keep.append(c)
    return keep


_CONTAINERS = frozenset({"Sequential", "ModuleList", "ModuleDict"})


def _pure_container(trace: StepTrace, call: Call) -> bool:
    """``call``'s module has no code of its own between its input and its output: a
    ``nn.Sequential`` (or ``ModuleList``, ``ModuleDict``), or a module whose recorded
    children account for all of it: every output is a child's output returned unchanged,
    and every child's input is the module's input or a sibling's output, as it was (no
    code of the module made a value in between)."""
    if call.module_type in _CONTAINERS:
        return True
    kids = [c for c in trace.calls if c.parent == call.id]
    outs = [r for r in trace.records if r.call == call.id and r.phase is Phase.FORWARD]
    if not kids or not outs:
        return False
    kid_ids = {c.id for c in kids}
    for o in outs:
        src = trace.record(o.source) if o.source is not None else None
        if src is None or src.call not in kid_ids or src.phase is not Phase.FORWARD:
            return False
    given = {r.index for r in trace.records if r.call in kid_ids and r.phase is Phase.FORWARD}
    for r in trace.records:
        if r.call == call.id and r.phase is Phase.INPUT:
            given.add(r.index)
            if r.source is not None:
                given.add(r.source)
    for r in trace.records:
        if r.call not in kid_ids or r.phase is not Phase.INPUT:
            continue
        if r.source is None or _derived_link(r) or r.source not in given:
            return False
    return True


def _consumers_by(trace: StepTrace, rec: Record, *, views: bool) -> tuple[list[Call], bool]:
    out: list[Call] = []
    reached_root = False
    frontier = [rec.index]
    seen: set[int] = set()
    made_of = {r.index: _made_of(trace, r) for r in trace.records} if views else {}
    while frontier:
        idx = frontier.pop()
        if idx in seen:
            continue
        seen.add(idx)
        here = trace.record(idx)
        if here is not None and here.phase is Phase.FORWARD:
            owner = trace.call(here.call)
            if owner is not None and owner.root and owner.path != LOSS_PATH:
                reached_root = True
        for r in trace.records:
            if r.phase is Phase.INPUT and (r.source == idx or made_of.get(r.index) == idx):
                if _derived_link(r):
                    continue  # code between made what the module got: see _derived_users
                call = trace.call(r.call)
                if call is None:
                    continue
                if call.passthrough:
                    frontier.extend(
                        o.index
                        for o in trace.records
                        if o.call == call.id and o.phase is Phase.FORWARD
                    )
                elif all(c.id != call.id for c in out):
                    out.append(call)
            elif r.phase is Phase.FORWARD and r.source == idx:  # an alias (a container's output)
                frontier.append(r.index)
    return out, reached_root


def _derived_link(rec: Record) -> bool:
    """``rec`` is a module input linked to a watched output it was computed from, not to the
    very tensor (a root's input ``x * m`` the user's code made from another root's output
    ``m``): the watcher names the autograd node that made it (``grad_fn``)."""
    return rec.phase is Phase.INPUT and rec.source is not None and rec.grad_fn is not None


def _derived_users(trace: StepTrace, rec: Record, before: int) -> list[Record]:
    """The module inputs computed from ``rec``'s tensor (or an alias of it) by code outside
    the watched modules (see :func:`_derived_link`) whose own gradient was recorded finite
    before the record ``before``: the code between made the gradient that reached ``rec``."""
    ids = {rec.index}
    for r in trace.records:  # aliases: a container's output, the root's output
        if r.phase is Phase.FORWARD and r.source in ids:
            ids.add(r.index)
    grads = {
        r.source: r
        for r in trace.records
        if r.phase is Phase.BACKWARD and r.source is not None and r.index < before
    }
    out: list[Record] = []
    for r in trace.records:
        if not _derived_link(r) or r.source not in ids:
            continue
        g = grads.get(r.index)
        if g is not None and g.stat is not None and g.stat.finite:
            out.append(r)
    return out


def _returned_by(trace: StepTrace, call: Call, rec: Record) -> Record | None:
    """``call``'s output record of the very tensor ``rec`` holds (linked to it: returned
    unchanged), or None."""
    for r in trace.records:
        if r.call == call.id and r.phase is Phase.FORWARD and r.source == rec.index:
            return r
    return None


def _root_of(trace: StepTrace, call: Call | None) -> Call | None:
    while call is not None and not call.root:
        call = _parent(trace, call)
    return call


def _inside(trace: StepTrace, call: Call | None, near: Call) -> str:
    """`` (a Linear inside Sequential)``: the root a module ``call`` belongs to, when it is
    not ``near``'s (several roots are watched, and a bare ``2`` names none of them)."""
    root = _root_of(trace, call)
    if call is None or root is None or root is call or root is _root_of(trace, near):
        return ""
    return f" (a {call.module_type} inside {root.path})"


def _parent(trace: StepTrace, call: Call | None) -> Call | None:
    if call is None or call.parent is None:
        return None
    return trace.call(call.parent)


_HOOK_NODE = "BackwardHookFunctionBackward"  # a module's full backward hooks wrap its outputs


def _own_outputs(trace: StepTrace, call: Call) -> list[Record]:
    return [
        r
        for r in trace.records
        if r.call == call.id and r.phase is Phase.FORWARD and r.stat is not None
    ]


def _innermost_user(trace: StepTrace, fwd: Record, call: Call, trig: Record) -> Call:
    """The module whose backward sent the bad gradient ``trig`` to ``call``'s input ``fwd``: a
    module inside ``call`` given the same tensor (a feature layer of a PINN applied to the
    coordinates) is the one, when it is the only innermost one given it and the gradient of
    its output was finite (the hook on the input records it once, for the outermost
    module); the op checker's backward birth picks among several. Else ``call`` itself."""
    users: list[Call] = []
    for r in trace.records:
        if r.phase is not Phase.INPUT or r.call == call.id or r.source != fwd.index:
            continue
        c = trace.call(r.call)
        up = _parent(trace, c)
        while up is not None and up.id != call.id:
            up = _parent(trace, up)
        if c is not None and up is not None and c not in users:
            users.append(c)

    def below(c: Call, d: Call) -> bool:  # d is inside c
        up = _parent(trace, d)
        while up is not None and up.id != c.id:
            up = _parent(trace, up)
        return up is not None

    inner = [c for c in users if not any(below(c, d) for d in users if d is not c)]
    born = _backward_birth(trace.ops)
    if born is not None and born.path is not None:
        inner = [c for c in inner if born.path == c.path or born.path.startswith(c.path + ".")]
    if len(inner) != 1:
        return call
    outs = [
        r
        for r in trace.records
        if r.phase is Phase.BACKWARD
        and r.call == inner[0].id
        and r.index < trig.index
        and r.by_grad == trig.by_grad  # this backward pass's (see _other_pass_only)
    ]
    if outs and all(r.stat is not None and r.stat.finite for r in outs):
        return inner[0]
    return call


def _shared_input(
    trace: StepTrace, trig: Record, fwd: Record, cand: Call, *, forensic: bool
) -> tuple[str, str, str] | None:
    """The gradient ``trig`` of ``fwd``, a module input, is the sum over every use of that
    tensor (a hook on a leaf, or on the node that made it, sees the total), not only what
    ``cand``'s backward sent back: a leaf image a total-variation term reads beside the
    frozen network, a distance a module's own code divides by beside the RBF it feeds.
    When a traced backward op made the value outside ``cand``, that code is the producer:
    returns (origin, path, what follows "born in "). With no traced op, an input the
    records do not link (its other uses are not seen) gets ``cand`` hedged with that code;
    None when nothing speaks against ``cand``."""
    born = _backward_birth(trace.ops)
    sent = (
        f"the gradient of {cand.path}'s output was finite, and the gradient reaching "
        f"{trig.path}'s {trig.role} sums every use of that tensor, not only what "
        f"{cand.path} sent back"
    )
    if born is not None and born.path is not None:
        if born.path == cand.path or born.path.startswith(cand.path + "."):
            return None
        if born.path != LOSS_PATH:
            return (
                "module",
                born.path,
                f"the backward of {born.path}'s own code, which used {trig.path}'s "
                f"{trig.role} too: {sent}",
            )
        double = not trig.by_grad and any(
            r.phase is Phase.BACKWARD and r.by_grad and r.index < trig.index for r in trace.records
        )
        maker = _maker(trace, fwd)
        if double and maker is not None:
            owner, fn = maker
            return (
                "module",
                owner,
                f"the double backward of {owner}'s code (the graph that "
                "torch.autograd.grad(create_graph=True) built from its backward): the "
                f"gradient of {cand.path}'s output was finite, the gradient reaching "
                f"{trig.path}'s {trig.role} is not, and it sums every use of that tensor: "
                f"{owner}'s {fn} made it, and the derivative of that op's backward lands "
                f"there (or that of {cand.path}'s backward, which took it)",
            )
        return (
            "between-roots",
            LOSS_PATH,
            f"the backward of code outside the watched modules that used {trig.path}'s "
            f"{trig.role} too (the loss code): {sent}",
        )
    if forensic or fwd.source is not None:
        return None  # forensic traced every op: none outside made it; a linked input's
        # other users are recorded consumers
    maker = _maker(trace, fwd)
    who = (
        f"{maker[0]}'s own code, whose {maker[1]} made it"
        if maker is not None
        else "the loss code, or any other code given the same tensor"
    )
    return (
        "module",
        cand.path,
        f"the backward of {cand.path}{_HEDGE}{trig.path}'s {trig.role} too ({who}): the "
        f"gradient of {cand.path}'s output was finite, the gradient reaching {trig.path}'s "
        f"{trig.role} is not, and it sums every use of that tensor",
    )


def _maker(trace: StepTrace, fwd: Record) -> tuple[str, str] | None:
    """The module whose own code made ``fwd``, a module input no record links (the parent
    of its call), and the autograd node that made it (``LinalgVectorNormBackward0`` ->
    ``LinalgVectorNorm``); None for a root's input or one made without autograd."""
    parent = _parent(trace, trace.call(fwd.call))
    if parent is None or fwd.source is not None or not fwd.grad_fn:
        return None
    return parent.path, _node_base(fwd.grad_fn)


def _other_pass_only(trace: StepTrace, call: Call, trig: Record) -> bool:
    """The gradient of ``call``'s output was recorded before ``trig`` only in another
    backward pass than ``trig``'s (``torch.autograd.grad``'s against the training
    ``backward()``'s): a double backward reached ``trig`` without passing through it."""
    grads = [
        r
        for r in trace.records
        if r.phase is Phase.BACKWARD and r.call == call.id and r.index < trig.index
    ]
    return bool(grads) and all(r.by_grad != trig.by_grad for r in grads)


def _hooked(trace: StepTrace, call: Call) -> bool:
    """``call``'s module has a full backward hook (``register_full_backward_hook``, never
    nanwatch's): torch passes its output through a ``BackwardHookFunction``, a new tensor
    of the same shape its parent then records, before any other forward record."""
    outs = _own_outputs(trace, call)
    if not outs:
        return False
    last = max(o.index for o in outs)
    for r in trace.records:
        if r.index <= last or r.phase is not Phase.FORWARD:
            continue
        if r.grad_fn == _HOOK_NODE and r.source is None:
            return any(o.shape == r.shape and o.dtype == r.dtype for o in outs)
        if r.stat is not None or r.source is None:
            return False  # another tensor came first: the hook is not this module's
    return False


#: autograd nodes of views (``h[:, -k:]`` is an ``AliasBackward0`` when it keeps every
#: row): their backward only moves the gradient's values, so it makes nothing non-finite
_MOVING_NODES = frozenset(
    {
        "Alias",
        "View",
        "UnsafeView",
        "Reshape",
        "ReshapeAlias",
        "Squeeze",
        "Unsqueeze",
        "Slice",
        "Select",
        "Permute",
        "Transpose",
        "T",
        "Narrow",
    }
)

#: torch's own ``autograd.Function`` classes, named like a user's custom one: the
#: backward of reentrant activation checkpointing reruns the module's forward inside it
_TORCH_FUNCTIONS = frozenset({"CheckpointFunction"})


def _weak(call: Call, dtype: str) -> bool:
    """A module whose backward cannot plausibly make a non-finite gradient from a finite
    one: sums of products (Linear, Conv) in float32 or float64, where the finite values
    would have to reach ~1e38 (torch.finfo(float32).max) to overflow."""
    return call.arithmetic and dtype in ("float32", "float64")


def _between_suspect(
    trace: StepTrace, trig: Record, fwd: Record, cands: list[Call]
) -> tuple[str, str, str | None, str] | None:
    """The code that made a backward anomaly when the records show it ran between the
    modules that got a finite gradient and the producer's output, or inside one consumer
    in code the user wrote (none when the records say nothing more than the consumers):
    a consumer whose output a custom ``autograd.Function`` made (its backward is the
    user's), a consumer with a full backward hook, or a tensor a module received that the
    parent's code made after the producer's output, of as many values of its dtype (an
    elementwise op or a view of it, as :func:`_made_of` infers), whose own gradient was
    finite, recorded before the trigger (the gradient of that code's input is the bad one). Returns
    (origin, path, consumer, what follows "born in the backward of ")."""
    sent = f"the gradient sent back to {trig.path}'s {trig.role} is not"
    linked = next(
        (
            trace.record(r.source)
            for c in cands
            for r in trace.inputs_of(c.id)
            if r.source is not None and r.source != fwd.index
        ),
        None,
    )
    if (
        linked is not None
        and linked.phase is Phase.FORWARD
        and any(c.path == linked.path for c in cands)
    ):  # a module given its own earlier output back (a recurrent cell's state)
        sent = (
            f"the gradient sent back to {linked.path}'s inputs ({trig.path}'s {trig.role}, "
            f"and its own {linked.role} from the previous call) is not"
        )
    elif linked is not None and linked.path != trig.path and linked.phase is Phase.FORWARD:
        sent = (
            f"the gradient sent back to {linked.path}'s {linked.role} is not (seen at "
            f"{trig.path}'s {trig.role}, which {linked.path} passed it on to)"
        )
    strong: list[tuple[str, str, str | None, str]] = []
    for c in cands:
        fn = next(
            (custom_function(o.grad_fn) for o in _own_outputs(trace, c) if o.grad_fn),
            None,
        )
        if fn is not None:
            strong.append(
                (
                    "module",
                    c.path,
                    c.path,
                    (
                        f"the backward of {c.path}, its forward rerun by torch.utils.checkpoint"
                        f" ({fn}, use_reentrant=True): the "
                        if fn in _TORCH_FUNCTIONS
                        else f"the backward of custom autograd.Function {fn} in {c.path}: the "
                    )
                    + f"gradient of {c.path}'s output was finite, {sent}",
                )
            )
        elif _hooked(trace, c):
            strong.append(
                (
                    "module",
                    c.path,
                    c.path,
                    f"the backward hook of {c.path} (register_full_backward_hook): the "
                    f"gradient of {c.path}'s output was finite, {sent}; a hook that returns new "
                    "grad_input values (a rescale, a normalization g / g.norm() of a zero "
                    "gradient) makes what the module sends back",
                )
            )
    root = _root_of(trace, trace.call(fwd.call))
    grads = _grads_before(trace, trig)
    for o, fn in _later_outputs(trace, fwd, grads):
        if fn is None:
            continue
        # the producer used its own output in a custom Function before returning both
        strong.append(
            (
                "module",
                o.path,
                o.path,
                f"the backward of custom autograd.Function {fn} in {o.path}, which made its "
                f"{o.role} after its {fwd.role}: the gradient of {o.path}'s {o.role} was "
                f"finite, {sent}",
            )
        )
    for r in trace.records if cands else ():  # none: the parent's code is named already
        if r.phase is not Phase.INPUT or r.source is not None or r.stat is None:
            continue
        if r.index <= fwd.index or r.index >= trig.index:
            continue
        if r.dtype != fwd.dtype or _numel(r.shape) != _numel(fwd.shape):
            continue  # like _made_of: made from the producer's values, elementwise or a view
        call = trace.call(r.call)
        if call is None or call.root or _root_of(trace, call) is not root:
            continue
        g = grads.get(r.index)
        if g is None or g.stat is None or not g.stat.finite:
            continue
        if r.grad_fn and _node_base(r.grad_fn) in _MOVING_NODES:
            continue  # a view of what it was made from: its backward makes no NaN
        parent = _parent(trace, call)
        fn = custom_function(r.grad_fn)
        by = f" (custom autograd.Function {fn})" if fn else f" ({r.grad_fn})" if r.grad_fn else ""
        where = parent.path if parent is not None else call.path
        strong.append(
            (
                "between-children",
                where,
                call.path,
                f"the backward of the code in {where} that made {call.path}'s {r.role}{by}: "
                f"the gradient "
                f"{call.path} sent back to its {r.role} was finite, {sent}",
            )
        )
    if len(strong) > 1:
        # several tensors made after the producer's output: the one made inside a module
        # that took the output itself (a later block's input was made from its own input)
        inner = [
            e
            for e in strong
            if e[0] == "between-children"
            and any(e[1] == c.path or e[1].startswith(c.path + ".") for c in cands)
        ]
        if len(inner) == 1:
            strong = inner
    if len(strong) == 1:
        origin, path, consumer, text = strong[0]
        others = [
            c.path for c in cands if c.path not in (consumer, path) and not _weak(c, trig.dtype)
        ]
        if others:  # a module that could have made it too
            text += f" (or in the backward of {', '.join(others[:3])})"
        return origin, path, consumer, text
    return None


def _loss_code_birth(trace: StepTrace, cand: Call, reached_root: bool) -> bool:
    """The one module that took the tensor (``cand``: a loss module given the logits) is not
    where its gradient went bad: the tensor also reached code outside every watched module
    (``reached_root``: it is, or passed on, a root's output), and the first traced backward
    op that made the non-finite gradient ran a node that code created (``- 0.1 *
    entr(p).sum()`` beside ``crit(logits, y)``), not one inside ``cand``'s graph."""
    if not reached_root:
        return False
    born = _backward_birth(trace.ops)
    return born is not None and born.path == LOSS_PATH and cand.path != LOSS_PATH


def _loss_code_beside(trace: StepTrace, cand: Call, reached_root: bool) -> Record | None:
    """With no op traced: the record of a loss the user's code computed from more than the
    output of ``cand``, a loss module (``crit(logits, y) - 0.1 * entropy(logits)``), when
    the tensor whose gradient went bad also reached that code (``reached_root``): that
    code's backward may have made the gradient as well as ``cand``'s. None otherwise."""
    if not reached_root or not cand.is_loss or cand.path == LOSS_PATH:
        return None
    if _backward_birth(trace.ops) is not None:
        return None  # a traced op says whose it was
    return next(
        (
            r
            for r in trace.records
            if r.path == LOSS_PATH
            and r.phase is Phase.FORWARD
            and r.source is None
            and r.grad_fn is not None
        ),
        None,
    )


def _neginf_turned(trace: StepTrace, grad: Record) -> Record | None:
    """A parameter's non-finite gradient (``grad``) that its module's backward made of a
    -inf the module was given: a call of the module took a positional input holding -inf
    alone (not a trigger: -inf is how masks are written), returned finite outputs, and got
    finite gradients for them, yet the weight's gradient is not (a Linear's or a GRU's
    ``x.T @ g`` with 0 × -inf: NaN). The -inf was where it began: the first record where
    it appeared (see :func:`_earliest_neginf`), in the code that made the input. None
    when there is no such call."""
    s = grad.stat
    if grad.phase is not Phase.GRADIENT or s is None or s.finite:
        return None
    for c in trace.calls:
        if c.path != grad.path or c.end < 0 or c.is_loss or c.path == LOSS_PATH:
            continue
        fed = [
            r
            for r in trace.inputs_of(c.id)
            if r.role.startswith("input[")
            and (m := trace.resolve(r)).stat is not None
            and m.stat.only_neginf
        ]
        if not fed:
            continue
        outs = [
            trace.resolve(r).stat
            for r in trace.records
            if r.call == c.id and r.phase is Phase.FORWARD
        ]
        if not outs or any(o is None or not o.finite for o in outs):
            continue
        if any(
            r.call == c.id
            and r.phase is Phase.BACKWARD
            and r.index < grad.index
            and r.stat is not None
            and not r.stat.finite
            for r in trace.records
        ):
            continue  # a bad gradient came in from outside: not this module's making
        return _earliest_neginf(trace, fed) or fed[0]
    return None


def _neginf_maker(ops: Sequence[OpEvent], path: str) -> OpEvent | None:
    """The first traced forward op in ``path``'s code (or its children's) that made a -inf
    from finite values (``torch.log(dt)`` of a zero step): the op behind a -inf that a
    module's backward later turned into NaN."""
    for ev in ops:
        if ev.phase is not Phase.FORWARD or ev.injected or "-inf" not in ev.born.split(", "):
            continue
        if ev.path is not None and ev.path != path and not ev.path.startswith(path + "."):
            continue
        if any(s is not None and not s.finite for _, s in ev.inputs):
            continue
        return ev
    return None


def _grads_before(trace: StepTrace, trig: Record) -> dict[int | None, Record]:
    """The gradient records before ``trig``, by the forward record each is the gradient of."""
    return {
        r.source: r
        for r in trace.records
        if r.phase is Phase.BACKWARD and r.source is not None and r.index < trig.index
    }


def _later_outputs(
    trace: StepTrace,
    fwd: Record,
    grads: dict[int | None, Record],
    call: Call | None = None,
) -> list[tuple[Record, str | None]]:
    """The outputs the producer of ``fwd`` (a module output) returned after it, in the
    same call, whose gradient was recorded finite (``grads``: gradient records by the
    forward record they are of), with the custom ``autograd.Function`` that made each, if
    one did: code of the producer that may have used ``fwd``'s tensor before returning it
    (``p = relu(fc(h)); return p, XLogX.apply(p).sum(-1)``). ``call``: another call whose
    outputs to read (the parent that used ``fwd``, a child's output)."""
    if call is None:
        call = trace.call(fwd.call)
    if fwd.phase is not Phase.FORWARD or call is None or call.passthrough:
        return []
    out: list[tuple[Record, str | None]] = []
    for o in _own_outputs(trace, call):
        if o.index <= fwd.index or o.source is not None:
            continue
        g = grads.get(o.index)
        if g is None or g.stat is None or not g.stat.finite:
            continue
        out.append((o, custom_function(o.grad_fn)))
    for o, made in _returned_from_child(trace, call, fwd.index):
        g = grads.get(made.index)
        if g is not None and g.stat is not None and g.stat.finite:
            out.append((o, None))  # a Function there is the child's, not the producer's code
    return out


def _returned_from_child(trace: StepTrace, call: Call, after: int) -> list[tuple[Record, Record]]:
    """The outputs of ``call`` recorded after record ``after`` that are a child's output
    returned as it is (``return y_hat, self.lower_bound(lik)``), each with the child's
    output record (where the tensor's gradient is recorded): a value the producer's own
    code made, through that child, after the output ``after``."""
    out: list[tuple[Record, Record]] = []
    for o in trace.records:
        if o.call != call.id or o.phase is not Phase.FORWARD or o.index <= after:
            continue
        if o.stat is not None or o.source is None:
            continue
        made = trace.record(o.source)
        if made is None or made.phase is not Phase.FORWARD or made.call == call.id:
            continue
        inner = trace.call(made.call)
        while inner is not None and inner is not call:
            inner = _parent(trace, inner)
        if inner is call:  # made inside this call (by a child), not passed in from outside
            out.append((o, made))
    return out


def propagators(trace: StepTrace, after: Record, producer: str) -> tuple[list[str], int]:
    """Modules that merely passed the bad value on: later non-finite records in the same
    direction (forward for a forward anomaly, backward for a backward one)."""
    phase = Phase.BACKWARD if after.phase in (Phase.BACKWARD, Phase.GRADIENT) else Phase.FORWARD
    paths: list[str] = []
    for r in trace.records:
        if r.index <= after.index or r.phase is not phase:
            continue
        if r.stat is None or r.stat.finite or r.path == producer:
            continue
        if r.path not in paths:
            paths.append(r.path)
    return paths[:8], len(paths)


_CUSTOM_NODE = re.compile(r"^(?P<fn>[A-Za-z_]\w*?)Backward$")


def custom_function(node: str | None) -> str | None:
    """The class name of the ``torch.autograd.Function`` an autograd node belongs to, by
    torch's naming of such nodes (``MySqrtBackward`` -> ``MySqrt``); None for torch's
    built-in nodes, whose names end in a number (``SqrtBackward0``).

    >>> custom_function("MySqrtBackward"), custom_function("SqrtBackward0")
    ('MySqrt', None)
    """
    m = _CUSTOM_NODE.match(node or "")
    return m.group("fn") if m else None


def custom_backward(ev: OpEvent) -> str | None:
    """The custom ``autograd.Function`` whose backward made ``ev``'s value when the event
    names no aten op, only that Function (read from its node after it ran, without the op
    checker); else None."""
    if ev.phase is not Phase.BACKWARD or ev.op.startswith("aten."):
        return None
    return custom_function(ev.node)


def op_where(ev: OpEvent) -> str:
    """Where an op ran, in words (``OpEvent.at``), and for an op of a custom Function's own
    backward: its line there, whose Function, and the ``backward()`` call."""
    fn = custom_function(ev.node) if ev.phase is Phase.BACKWARD else None
    if fn is None or not ev.source:
        return ev.at
    text = f"in the backward of custom autograd.Function {fn}"
    if ev.backward_at and ev.backward_at == ev.source:
        return f"{text}, {ev.backward_call} at {ev.source}"
    call = f", {ev.backward_call} at {ev.backward_at}" if ev.backward_at else ""
    return f"at {ev.source} {text}{call}"


def op_phrase(ev: OpEvent) -> str:
    """``aten.div.Tensor at train.py:17 in the backward of ...``; for a custom Function's
    backward whose op was not traced: ``the backward of custom autograd.Function MySqrt``."""
    fn = custom_backward(ev)
    if fn is not None:
        call = f", {ev.backward_call} at {ev.backward_at}" if ev.backward_at else ""
        return f"the backward of custom autograd.Function {fn}{call}"
    return f"{ev.op} {op_where(ev)}".rstrip()


def _matching_op(
    ops: Sequence[OpEvent], phase: Phase, path: str | None, held: TensorStat | None = None
) -> OpEvent | None:
    """The op event of the trigger, from forensic tracing: the first NaN/+inf birth of the
    phase (in the producer when it is known). In backward a -inf counts too: no gradient is
    a mask, and the NaN or +inf seen downstream (softmax's backward) came from it; in
    forward a -inf an op that writes no mask made (see :func:`_overflow_op`). An event
    that names no aten op (a custom Function's backward seen from outside) is not one: see
    :func:`_matching_custom`. ``held``: what the trigger record holds; a forward op that
    made none of it, whose inputs already held all of it, did not make it (``x @ E.t()``
    made NaN of a +inf and a -inf that came in with ``E``, the record holds the infs)."""
    best: OpEvent | None = None
    for ev in ops:
        if ev.phase is not phase or ev.injected or custom_backward(ev) is not None:
            continue
        if phase is Phase.FORWARD and _came_in(ev, held):
            continue
        if not is_birth(ev):
            continue
        if path is None or ev.path is None or ev.path == path or ev.path.startswith(path + "."):
            return _earlier_nan(ops, ev, held)
        if best is None:
            best = ev
    return best if best is None else _earlier_nan(ops, best, held)


def _earlier_nan(ops: Sequence[OpEvent], ev: OpEvent, held: TensorStat | None) -> OpEvent:
    """``ev`` made an inf, not the NaN ``held`` holds; a later op made that NaN of ``ev``'s
    inf and of a non-finite value an op before ``ev`` made (``log(v) + x / v`` with
    ``v == 0``: log's -inf, then the division's +inf, then -inf + inf): that NaN's event,
    whose cause chain starts at the op that ran first, which the step names. ``ev`` when
    there is none."""
    if held is None or not held.has_nan or "NaN" in ev.born.split(", "):
        return ev
    order = {id(e): i for i, e in enumerate(ops)}
    at = order.get(id(ev))
    if at is None:
        return ev
    made = set(ev.born.split(", "))
    for later in ops[at + 1 :]:
        if later.phase is not ev.phase or later.injected or "NaN" not in later.born:
            continue
        given: set[str] = set()
        for _, s in later.inputs:
            given |= _stat_kinds(s)
        if not made <= given:
            continue  # not made of ev's value
        head = later.chain()[0]
        if head is not later and not head.injected and order.get(id(head), at) < at:
            return later
    return ev


#: aten ops that cannot write a mask: a -inf they make from finite inputs is an overflow (a
#: float16 product past -65504), not a ``masked_fill(-inf)`` or a ``log`` of a zero mask.
_OVERFLOW_OPS = frozenset(
    {
        "mm",
        "bmm",
        "matmul",
        "addmm",
        "addbmm",
        "baddbmm",
        "addmv",
        "mv",
        "dot",
        "vdot",
        "linear",
        "einsum",
        "tensordot",
        "convolution",
        "_convolution",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "cudnn_convolution",
        "mkldnn_convolution",
        "_scaled_mm",
        "pow",
        "sum",
        "cumsum",
        "mean",
        "prod",
        "cumprod",
    }
)


def is_birth(ev: OpEvent) -> bool:
    """Whether the op event ``ev`` made a value that is an anomaly on its own: NaN or +inf; in
    backward any non-finite value (no gradient is a mask); in forward a -inf an op of
    :data:`_OVERFLOW_OPS` made (``aten.bmm.default``: an overflow, not a mask) with no
    constant putting it in (see ``OpEvent.injected``)."""
    if ev.injected or not ev.born:
        return False
    if "NaN" in ev.born or "+inf" in ev.born or ev.phase is Phase.BACKWARD:
        return True
    parts = ev.op.split(".")
    name = parts[1] if len(parts) > 1 and parts[0] == "aten" else parts[0]
    return name in _OVERFLOW_OPS


def forward_birth(events: Sequence[OpEvent]) -> OpEvent | None:
    """The op of ``events`` (read from a loss's autograd graph, nearest the inputs first:
    :func:`nanwatch.ops.graph_evidence`) that made the loss's non-finite value in the
    forward. An event whose result is known and finite made nothing non-finite there: a
    sqrt of 0 is 0, only its gradient 1/(2 sqrt(x)) is inf; it is passed over for the op
    after it that made the value (the log of that 0, -inf). The first event when every
    one is such."""
    for ev in events:
        out = ev.output
        if ev.phase is Phase.FORWARD and out.numel > 0 and out.finite and not ev.injected:
            continue
        return ev
    return events[0] if events else None


def _stat_kinds(s: TensorStat | None) -> set[str]:
    return set() if s is None or s.finite else set(s.kinds().split(", "))


def _came_in(ev: OpEvent, held: TensorStat | None) -> bool:
    """``ev`` made none of the non-finite kinds ``held`` has, and its inputs held them all:
    the value the record saw came in with the inputs, it was not born in ``ev``."""
    kinds = _stat_kinds(held)
    if not kinds or kinds & set(ev.born.split(", ")):
        return False
    had: set[str] = set()
    for _, s in ev.inputs:
        had |= _stat_kinds(s)
    return kinds <= had


def _matching_custom(ops: Sequence[OpEvent], path: str | None) -> OpEvent | None:
    """The backward of a custom ``autograd.Function`` that made a non-finite gradient, seen
    from outside (its node's gradient; no aten op named), in ``path`` when known."""
    for ev in ops:
        if custom_backward(ev) is None or not ev.born or ev.injected:
            continue
        if path is None or ev.path is None or ev.path == path or ev.path.startswith(path + "."):
            return ev
    return None


def _hidden_forward_nan(ops: Sequence[OpEvent]) -> OpEvent | None:
    """The first traced forward op that made NaN (forensic mode), for a NaN gradient no
    traced backward op made: backward multiplied a gradient by a forward value that held
    NaN, which torch.where or a 0 mask had kept from the loss."""
    return next(
        (ev for ev in ops if ev.phase is Phase.FORWARD and not ev.injected and "NaN" in ev.born),
        None,
    )


def _grad_in_forward(ops: Sequence[OpEvent], path: str) -> OpEvent | None:
    """For a value born in the forward of ``path`` that no forward op made (forensic): the
    traced backward op, run for a node that ``path``'s forward made, that made a NaN or inf
    from finite values. A forward that differentiates its own output (a physics-informed loss,
    a gradient penalty: ``torch.autograd.grad(..., create_graph=True)``) runs backward ops
    inside it, and what they return (``x / sqrt(x**2)`` at 0 is 0/0) is a forward value."""
    ev = _matching_op(ops, Phase.BACKWARD, path)
    if ev is None or ev.path is None or not (ev.path == path or ev.path.startswith(path + ".")):
        return None
    # run by a differentiation inside the forward, not by the step's own backward() (whose
    # ops are traced too when the forward's statistics landed late: that birth came after)
    file, _, num = (ev.backward_at or "").rpartition(":")
    called = linecache.getline(file, int(num)) if file and num.isdigit() else ""
    if not called or ".backward(" in called or "autograd.backward(" in called:
        return None
    return ev


def _backward_birth(ops: Sequence[OpEvent]) -> OpEvent | None:
    """The first traced backward op that made a NaN or inf from finite values."""
    return _matching_op(ops, Phase.BACKWARD, None)


def adopt_backward_op(anomaly: Anomaly, ops: Sequence[OpEvent]) -> bool:
    """A parameter's gradient was the first bad value seen (no watched module's output
    gradient carried it: a gradient of a gradient through ``autograd.grad(...,
    create_graph=True)``, a parameter used outside its module), and a traced backward op
    made it (forensic mode, ``nw.replay``): the anomaly becomes a backward one, born in
    that op's code. Returns whether it did."""
    if anomaly.kind is not AnomalyKind.GRADIENT:
        return False
    ev = _backward_birth(ops)
    if ev is None:
        return False
    what = _kinds_text(anomaly.record)
    parameter = anomaly.parameter or _param_name(anomaly.record)
    if hook_op(ev) is not None and anomaly.record.path:  # a hook on the parameter
        anomaly.path, anomaly.origin, where = anomaly.record.path, "module", anomaly.record.path
    elif ev.path and ev.path != LOSS_PATH:
        anomaly.path, anomaly.origin, where = ev.path, "module", ev.path
    else:
        anomaly.path, anomaly.origin = LOSS_PATH, "loss-code"
        where = f"{LOSS_PATH}, the loss code computed outside the watched modules"
    anomaly.kind = AnomalyKind.BACKWARD
    anomaly.op = ev
    anomaly.parameter = parameter
    anomaly.summary = (
        f"{what} gradient born in the backward of {where}; it reached the gradient of "
        f"parameter {parameter} without passing through a watched module's output gradient"
    )
    anomaly.summary = summarize(anomaly)
    return True


def _kinds_text(rec: Record) -> str:
    return rec.stat.kinds() if rec.stat is not None else "non-finite"


def _rows_text(trig: Record) -> str:
    """`` in samples 2, 5 (2 of 8)``: the rows of a root's input that held the value."""
    s = trig.stat
    if s is None or not s.bad_rows:
        return ""
    more = "" if not s.bad_row_count or s.bad_row_count <= len(s.bad_rows) else ", ..."
    return (
        f" in sample{'s' if len(s.bad_rows) > 1 else ''} "
        + ", ".join(map(str, s.bad_rows))
        + more
        + (f" ({s.bad_row_count} of {trig.shape[0]})" if s.bad_row_count and trig.shape else "")
    )


def root_call_number(trace: StepTrace, call: Call | None) -> tuple[int, int] | None:
    """(which call of its root module ``call`` is in this step, counted from 1; how many
    calls of that root the step recorded) when the root ran more than once (gradient
    accumulation over micro-batches, a discriminator given real and fake batches); None
    for a root run once, or not a root's call."""
    if call is None or not call.root:
        return None
    calls = [c.id for c in trace.calls if c.root and c.path == call.path]
    if len(calls) < 2 or call.id not in calls:
        return None
    return calls.index(call.id) + 1, len(calls)


def _call_text(trace: StepTrace, call: Call | None) -> str:
    """``, in its 3rd call this step``: which batch of the step a sample number counts in."""
    n = root_call_number(trace, call)
    return f", in its {_ordinal(n[0])} call this step" if n is not None else ""


def _micro_batch_text(trace: StepTrace, call: Call | None, path: str) -> str:
    """``, in the 3rd call of model this step``: which call of its root the module call
    ``call`` belongs to, when the step called that root more than once (gradient
    accumulation over micro-batches, a discriminator given real then fake): a value born
    in a later forward or backward of the step. ``its`` when ``path`` is the root's."""
    root = _root_of(trace, call)
    n = root_call_number(trace, root)
    if n is None or root is None:
        return ""
    if root.path == path:
        return f", in its {_ordinal(n[0])} call this step"
    return f", in the {_ordinal(n[0])} call of {root.path} this step"


def _with_micro_batch(summary: str, nth: str) -> str:
    """``summary`` with ``nth`` (:func:`_micro_batch_text`) after the module it names as
    the birthplace (``... born in the forward of 1 (Blow)``), before what follows it."""
    if not nth or "this step" in summary:
        return summary
    m = re.search(r" born in the (?:forward|backward) (?:code )?of ", summary)
    if m is None:
        return summary
    ends = [summary.find(e, m.end()) for e in (":", ";", ", from ", ", then ", " [")]
    end = min((e for e in ends if e >= 0), default=len(summary))
    return summary[:end] + nth + summary[end:]


def _ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``11th``, ``22nd``."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _which_call(trace: StepTrace, call: Call | None) -> str:
    """``, at the 9th of 80 calls of odefunc in this step``: which call of a module the
    step called more than once (a solver's function, a recurrent cell) got the value, so
    the user sees which iteration blew up; the total only when the step's records go on
    past that call (a step stopped at the anomaly has no later calls). Empty for a module
    called once."""
    if call is None:
        return ""
    ids = [c.id for c in trace.calls if c.path == call.path]
    if len(ids) < 2 or call.id not in ids:
        return ""
    nth = ids.index(call.id) + 1
    if nth < len(ids):
        return f", at the {_ordinal(nth)} of {len(ids)} calls of {call.path} in this step"
    return f", at the {_ordinal(nth)} call of {call.path} in this step"


def _computed_input_line(
    trace: StepTrace, call: Call | None, trig: Record
) -> tuple[str, str] | None:
    """Where the user's code, just above the root call, computed the bad input ``trig`` as
    NW401 reads it from the source (see ``rules.data.computed_input``); None when it does
    not show or the source cannot be read. Run only when an anomaly is localized."""
    try:
        from nanwatch.rules.data import computed_input

        return computed_input(trace, call, trig)
    except Exception:  # unreadable source: the headline keeps its general wording
        return None


def _op_before(trace: StepTrace, call: Call, trig: Record) -> OpEvent | None:
    """A traced forward op of this step, outside ``call``, that made the non-finite value
    ``trig`` (``call``'s input) holds from finite values (forensic mode, ``nw.replay``): the
    input was computed, it is not data."""
    for ev in trace.ops:
        if ev.phase is not Phase.FORWARD or ev.injected or _came_in(ev, trig.stat):
            continue
        if not is_birth(ev):
            continue
        if ev.path is not None and (ev.path == call.path or ev.path.startswith(call.path + ".")):
            continue
        return ev
    return None


def _earlier_root(trace: StepTrace, call: Call, trig: Record) -> str | None:
    """The watched model (another root than ``call``, not a loss) that returned finite
    outputs in this step before ``call`` got its input ``trig``, a tensor no record links
    to anything: what ``call`` got was most likely computed from it by code that cut the
    graph (``.detach()``). None when ``trig`` is a loss's input (a target is data) or the
    same model ran before (micro-batches)."""
    if call.is_loss or call.path == LOSS_PATH or trig.source is not None:
        return None
    for c in trace.calls:
        if c.id == call.id or not c.root or c.is_loss or c.path in (LOSS_PATH, call.path):
            continue
        if c.end < 0 or c.end > trig.index:
            continue
        outs = _own_outputs(trace, c)
        if outs and all(o.stat is not None and o.stat.finite for o in outs):
            return c.path
    return None


def whole_samples_bad(rec: Record) -> bool:
    """Every value of each bad sample of ``rec`` is NaN or inf: a factor or a divisor of the
    whole sample, as ``x / x.norm()`` of a sample whose norm is 0 gives (0/0 = NaN where x
    is 0, inf where it is not), not a bad pixel or a missing feature of a loaded one, which
    leaves the rest of its sample finite."""
    s = rec.stat
    bad = s.bad_values if s is not None else None  # counted, or told apart by sample only
    if s is None or len(rec.shape) < 2 or not s.bad_row_count or bad is None:
        return False
    per_sample = _numel(rec.shape[1:])
    return per_sample > 1 and bad == s.bad_row_count * per_sample


def _computed_look(rec: Record) -> bool:
    """``rec``'s non-finite values fill whole samples, or whole feature columns of a 2-D
    input: a sample or a feature divided by a zero norm, speed or standard deviation, as
    the user's code or a preprocessing step makes. A missing value of loaded data spoils
    one value and leaves the rest of its sample and column finite."""
    if whole_samples_bad(rec):
        return True
    s = rec.stat
    if s is None or len(rec.shape) != 2 or not s.bad_col_count or s.nan is None:
        return False
    bad = s.nan + (s.posinf or 0) + (s.neginf or 0)
    return rec.shape[0] > 1 and bad == s.bad_col_count * rec.shape[0]


def _computed_between_calls(trace: StepTrace, call: Call, trig: Record) -> bool:
    """``trig``, an input of root ``call`` that no record links to anything, was most likely
    computed by the user's code from an earlier call of the same root in this step: that
    call got a finite input in the same place, of the same shape and dtype, and each bad
    sample is non-finite throughout (a sampling loop's ``x / alpha.sqrt()`` at alpha = 0,
    an attack's ``g / g.norm()``). Loaded data goes bad a value at a time."""
    if call.is_loss or call.path == LOSS_PATH or trig.source is not None:
        return False
    if not whole_samples_bad(trig):
        return False
    return earlier_finite_input(trace, trig, call.path, call.id) is not None


#: loss modules whose target is a distribution (soft labels): a teacher's softmax
SOFT_TARGET_LOSSES = frozenset({"KLDivLoss", "CrossEntropyLoss", "BCELoss", "BCEWithLogitsLoss"})
#: the half-precision dtypes, by name
HALF_DTYPES = frozenset({"float16", "bfloat16"})
_HALF = HALF_DTYPES
_WIDE = frozenset({"float32", "float64"})


class ComputedTarget(NamedTuple):
    """Why a loss target was computed in the step by the user's code (see
    :func:`computed_target`)."""

    model_input: Record  #: the watched model's first input this step, finite
    half: bool  #: the target is float16/bfloat16 while that input is float32/float64
    soft: bool  #: soft labels whose bad samples are NaN throughout, finite values in [-1, 1]


def computed_target(trace: StepTrace, rec: Record, call: Call | None) -> ComputedTarget | None:
    """The non-finite target ``rec`` of loss ``call`` was computed in this step by the
    user's code (a teacher or target network), not loaded: the watched model's own input
    this step was finite, and the target is float16/bfloat16 while that input is
    float32/float64 (a half-precision network made it), or each bad sample is NaN
    throughout while every finite value lies in [-1, 1] for a loss of soft labels (a
    softmax of a row holding inf is NaN in the whole row; loaded data goes bad a value at
    a time). None when nothing says so, when ``call`` is not a loss or ``rec`` is its
    ``input[0]`` (the prediction, not the target)."""
    if call is None or not call.is_loss or rec.role == "input[0]":
        return None
    if rec.source is not None or rec.stat is None:
        return None
    model_inputs = [
        r
        for c in trace.calls
        if c.root and not c.is_loss and c.id < call.id
        for r in trace.inputs_of(c.id)
        if r.stat is not None and r.dtype in (_HALF | _WIDE)
    ]
    if not model_inputs or any(r.bad for r in model_inputs):
        return None
    first = model_inputs[0]
    half = rec.dtype in _HALF and first.dtype in _WIDE
    s = rec.stat
    soft = (
        call.module_type in SOFT_TARGET_LOSSES
        and whole_samples_bad(rec)
        and not (s.posinf or s.neginf)
        and s.finite_amax is not None
        and s.finite_amax <= 1.0
    )
    if not (half or soft):
        return None
    return ComputedTarget(first, half, soft)


def earlier_finite_input(trace: StepTrace, rec: Record, path: str, before: int) -> Record | None:
    """The first input record of a call of root ``path`` in ``trace`` (call id below
    ``before``) in ``rec``'s place, with its shape and dtype, that was finite: what the
    user's code most likely computed ``rec`` from (a sampling loop, an attack's step)."""
    for c in trace.calls:
        if c.id >= before or not c.root or c.path != path:
            continue
        for r in trace.inputs_of(c.id):
            m = trace.resolve(r)
            if (
                r.role == rec.role
                and r.shape == rec.shape
                and r.dtype == rec.dtype
                and m.stat is not None
                and m.stat.finite
            ):
                return r
    return None


def _finite_grad_before(trace: StepTrace, trig: Record, parameter: str | None) -> bool:
    """``parameter``'s gradient was recorded finite and not all zero in this step, before
    ``trig`` found the weight bad: a backward gave it what an update uses."""
    return trig.index >= 0 and any(
        r.phase is Phase.GRADIENT
        and r.role == parameter
        and r.index < trig.index
        and r.stat is not None
        and r.stat.finite
        and r.stat.max > 0
        for r in trace.records
    )


def localize(
    trace: StepTrace,
    *,
    allow: Sequence[str] = (),
    scaled_grads: bool = False,
    first_step: bool = False,
    forensic: bool = False,
) -> Anomaly | None:
    """The step's first anomaly: producer, origin, propagators; None when the step is clean.
    ``first_step``: no earlier step ran under the watcher, so weights found bad before this
    step's forward were bad before any update it saw (loaded or initialized so).
    ``forensic``: the op checker traced the step (never tell it to run in forensic mode)."""
    trig = first_trigger(trace, allow=allow, scaled_grads=scaled_grads)
    if trig is None:
        return None
    turned = _neginf_turned(trace, trig)
    grad_trig: Record | None = None
    if turned is not None:  # the parameter's NaN grew out of a -inf its module was given
        grad_trig, trig = trig, turned
    what = _kinds_text(trig)
    call = trace.call(trig.call)
    neginf: Record | None = None
    consumer: str | None = None
    parameter: str | None = None
    double = False  # a double backward's pass: see _other_pass_only

    derived = trig.phase is Phase.INPUT and trig.grad_fn is not None and trig.source is not None
    if derived and call is not None and call.root:
        # a root's input the user's code computed from a watched output
        kind, origin = AnomalyKind.FORWARD, "between-roots"
        src = trace.record(trig.source) if trig.source is not None else None
        path = trig.path
        neginf = _earliest_neginf(trace, [trig])
        after = f" from the output of {src.path}" if src is not None else ""
        summary = (
            f"{what} born in code outside the watched modules, in the value passed to "
            f"{trig.path} ({trig.role}), computed{after} by {trig.grad_fn}"
        )
    elif (
        trig.phase is Phase.INPUT
        and call is not None
        and call.root
        and (
            (made_by := _op_before(trace, call, trig)) is not None
            or (earlier := _earlier_root(trace, call, trig)) is not None
        )
    ):
        # no autograd history links it to a watched output (``.detach()``, ``no_grad``), but
        # an op of this step made it, or it was given after another watched model ran
        kind, origin = AnomalyKind.FORWARD, "between-roots"
        path = trig.path
        rows = _rows_text(trig)
        if made_by is not None:
            summary = (
                f"{what} born in code outside the watched modules, in the value passed to "
                f"{trig.path} ({trig.role}{rows}): an op of this step made it, not the data"
            )
        else:
            summary = (
                f"{what} in {trig.path}'s {trig.role}{rows}, given to it after {earlier} ran "
                "in this step: most likely computed by your code between the calls, "
                "detached from the graph (.detach(), torch.no_grad), so the records do not "
                "link it to a watched output"
            )
            if not forensic:
                summary += (
                    "; mode='forensic' (nanwatch run --mode forensic) names the op that made "
                    "it and its line"
                )
    elif trig.phase is Phase.INPUT and (call is None or call.root):
        kind, origin = AnomalyKind.INPUT, "data"
        path = call.path if call is not None else trig.path
        rows = _rows_text(trig) + _call_text(trace, call)
        summary = f"{what} in the input data: {trig.role} of {path}{rows} (bad data, not a layer)"
        if computed_target(trace, trig, call) is not None:
            origin = "computed-target"
            summary = (
                f"{what} in the target of {path} ({trig.role}){rows}, computed by your code "
                "this step (a teacher or target network), not the data"
            )
        elif trig.grad_fn is not None:
            # an autograd history (``logits / self.temperature``): computed this step by
            # code outside the watched modules, from a parameter or a value that needs one
            origin, kind = "between-roots", AnomalyKind.FORWARD
            summary = (
                f"{what} born in code outside the watched modules, in the value passed to "
                f"{path} ({trig.role}{rows}), computed by {trig.grad_fn} this step (it has an "
                "autograd history: not the data)"
            )
            if not forensic:
                summary += (
                    "; mode='forensic' (nanwatch run --mode forensic) names the op that made "
                    "it and its line"
                )
        elif call is not None and _computed_between_calls(trace, call, trig):
            origin = "between-calls"
            summary = (
                f"{what} in {trig.role} of {path}{rows}, computed by your code between two "
                f"calls of {path} (not the data)"
            )
        elif not forensic and _computed_look(trig):
            # whole samples non-finite, as a division of each by a zero norm or speed makes:
            # without tracing, the batch cannot be told from the user's code that ran on it
            # before the call (no autograd history when nothing needs a grad)
            origin = "data-or-code"
            summary = (
                f"{what} in {trig.role} of {path}{rows}: the batch, or your code that ran on "
                "it before the model's call; mode='forensic' (nanwatch run --mode forensic) "
                "names the op if your code made it"
            )
            made_at = _computed_input_line(trace, call, trig)
            if made_at is not None:  # the line above the call that computed it, as NW401 says
                summary = (
                    f"{what} in {trig.role} of {path}{rows}: computed by your code at "
                    f"{made_at[0]} ({made_at[1]}), not the batch"
                )
    elif trig.phase is Phase.INPUT:
        parent = _parent(trace, call)
        kind, origin = AnomalyKind.FORWARD, "between-children"
        path = parent.path if parent is not None else trig.path
        neginf = _earliest_neginf(trace, [trig])
        summary = (
            f"{what} born in the forward code of {path} itself, in the value it passed to "
            f"{trig.path} ({trig.role}){_which_call(trace, call)}"
        )
    elif trig.phase is Phase.FORWARD:
        kind, origin = AnomalyKind.FORWARD, "module"
        path = trig.path
        ins = trace.inputs_of(trig.call)
        neginf = _earliest_neginf(trace, ins)
        if neginf is None and call is not None:  # a -inf made by a child, consumed inside
            for r in trace.records:
                if call.start <= r.index < trig.index and r.stat is not None and r.stat.has_neginf:
                    neginf = r
                    break
        if neginf is None and path == LOSS_PATH:  # loss code: what it was given is the model's
            neginf = _earliest_neginf(trace, trace.root_outputs())
        typ = f" ({call.module_type})" if call is not None and call.module_type else ""
        fed = ""
        if neginf is not None:
            fed = f", from -inf first seen in {neginf.path} ({neginf.phase.value}, {neginf.role})"
        if path == LOSS_PATH:
            origin = "loss-code"
            summary = (
                f"{what} born on the way to the loss, outside every watched module's output{fed}"
                f"{_root_not_called(trace)}"
            )
        else:
            summary = f"{what} born in the forward of {path}{typ}{fed}"
    elif trig.phase is Phase.BACKWARD:
        kind = AnomalyKind.BACKWARD
        fwd = trace.record(trig.source) if trig.source is not None else None
        cands: list[Call] = []
        reached_root = False
        if fwd is not None and fwd.phase is Phase.INPUT:
            c = trace.call(fwd.call)
            cands = [_innermost_user(trace, fwd, c, trig)] if c is not None else []
        elif fwd is not None:
            cands, reached_root = _consumers(trace, fwd, trig.index)
        between = (
            _between_suspect(trace, trig, fwd, cands)
            if fwd is not None and fwd.phase is Phase.FORWARD
            else None
        )
        # another backward pass over the graph (loss.backward() through what
        # autograd.grad(create_graph=True) built): the consumers' output gradients were seen
        # only in the other pass, so nothing says this pass's were finite
        other_pass = bool(cands) and all(_other_pass_only(trace, c, trig) for c in cands)
        if between is not None:
            origin, path, consumer, summary = between
            summary = f"{what} gradient born in {summary}"
        elif (
            other_pass
            and (born := _backward_birth(trace.ops)) is not None
            and born.path == LOSS_PATH
            and (root := _root_of(trace, trace.call(trig.call))) is not None
        ):
            origin, path, double = "after-output", root.path, True
            summary = (
                f"{what} gradient arrived at {trig.path}'s {trig.role} from code outside the "
                "watched modules (the loss computed after the model)"
            )
        elif (
            not cands
            and fwd is not None
            and fwd.phase is Phase.FORWARD
            and (users := _derived_users(trace, fwd, trig.index))
        ):
            # the modules got a tensor the user's code computed from this one (``x * m``):
            # their backward sent a finite gradient, the code between made the bad one
            u = users[0]
            src = trace.record(u.source) if u.source is not None else None
            origin, path = "between-roots", LOSS_PATH
            consumer = u.path
            summary = (
                f"{what} gradient born in the backward of code outside the watched modules, "
                f"between the output of {src.path if src is not None else fwd.path} and the "
                f"{u.role} of {u.path} that it computed ({u.grad_fn} made that {u.role}): the "
                f"gradient {u.path} sent back to its {u.role} was finite, the gradient "
                f"reaching {trig.path}'s {trig.role} is not"
            )
            if not forensic:
                summary += (
                    "; mode='forensic' (nanwatch run --mode forensic) names the op and its line"
                )
        elif (
            cands
            and not other_pass
            and fwd is not None
            and all(_weak(c, trig.dtype) for c in cands)
            and _finite_outputs(trace, cands, trig.index)
            and (later := _later_outputs(trace, fwd, _grads_before(trace, trig)))
        ):
            # the modules that took the tensor cannot have made it (a Linear's backward in
            # float32), and its producer made more outputs after it: the producer's own code
            # used the tensor (``p = relu(fc(h)); return p, entropy(p)``)
            origin, path = "module", fwd.path
            consumer = path
            o = later[0][0]
            names = ", ".join(c.path for c in cands[:3])
            kind_of = ", ".join(sorted({c.module_type for c in cands[:3] if c.module_type}))
            typ = f" ({kind_of} in {trig.dtype})" if kind_of else ""
            summary = (
                f"{what} gradient born in the backward of code in {path} that used its own "
                f"{fwd.role} before returning it (it made its {o.role} after it, whose "
                f"gradient was finite): the gradient it got back at its {fwd.role} is not, "
                f"and the backward of {names}{typ}, which took that {fwd.role}, cannot make "
                f"{what} from the finite gradient of {'its' if len(cands) == 1 else 'their'} "
                "output"
            )
        elif (
            len(cands) == 1
            and not other_pass
            and not _loss_code_birth(trace, cands[0], reached_root)
        ):
            origin, path = "module", cands[0].path
            consumer = path
            summary = (
                f"{what} gradient born in the backward of {path}: the gradient of its output "
                f"was finite, the gradient it sent back to {trig.path}'s {trig.role}"
                f"{_inside(trace, trace.call(trig.call), cands[0])} is not"
            )
            other = _loss_code_beside(trace, cands[0], reached_root)
            if other is not None and fwd is not None:
                # nothing traced says whose backward it was: the loss code used more than
                # the loss module's output, and the tensor reached that code too
                summary += (
                    f"; or in the backward of the loss code outside the watched modules, "
                    f"which computed the loss ({other.grad_fn}) from more than {path}'s output "
                    f"and was given {fwd.path}'s {fwd.role} too"
                )
            if fwd is not None and fwd.phase is Phase.INPUT:
                shared = _shared_input(trace, trig, fwd, cands[0], forensic=forensic)
                if shared is not None:
                    origin, path, text = shared
                    summary = f"{what} gradient born in {text}"
        elif not cands and reached_root and fwd is not None:
            owner = trace.call(fwd.call)
            root = owner
            while root is not None and not root.root:
                root = _parent(trace, root)
            origin = "after-output"
            path = root.path if root is not None else trig.path
            if forensic:
                advice = (
                    "the op checker traced the step, and no op it saw made it from finite values"
                )
            else:
                modes = "mode='forensic'" if trace.full else "mode='watch' or mode='forensic'"
                advice = (
                    f"run the step with {modes} (nanwatch run --mode forensic) to name the op "
                    "and its line"
                )
            summary = (
                f"{what} gradient arrived at the output of {path} from code outside the "
                "watched modules (the loss code between the model's output and backward()): "
                + advice
            )
        elif (
            fwd is not None
            and (born := _backward_birth(trace.ops)) is not None
            and born.path == LOSS_PATH
            and (root := _root_of(trace, trace.call(fwd.call))) is not None
        ):
            # the first backward op that made it ran a node the loss code created after
            # the module returned (an output nanwatch cannot see: a custom object holding
            # the tensors): the loss code's, not the module's
            origin, path = "after-output", root.path
            summary = (
                f"{what} gradient arrived at {root.path} from code outside the watched "
                "modules (the loss computed after the model)"
            )
        else:
            owner = trace.call(fwd.call) if fwd is not None else None
            parent = (
                _parent(trace, owner) if fwd is not None and fwd.phase is Phase.FORWARD else None
            )
            rec = fwd
            while parent is not None and rec is not None:
                # a container that returned the tensor as it was (a Sequential's last
                # child's output): the code that used it is its parent's
                up = _returned_by(trace, parent, rec)
                grand = _parent(trace, parent)
                if up is None or grand is None:
                    break
                rec, parent = up, grand
            origin = "between-children" if parent is not None else "module"
            path = parent.path if parent is not None else trig.path
            names = ", ".join(c.path for c in cands[:4])
            also = f" (the tensor also fed {names})" if cands else ""
            used = rec.path if rec is not None else trig.path
            summary = (
                f"{what} gradient born in the backward of code in {path} that used the output "
                f"of {used}{also}"
            )
            by_fn = (
                [
                    (o, f)
                    for o, f in _later_outputs(trace, rec, _grads_before(trace, trig), parent)
                    if f is not None
                ]
                if parent is not None and rec is not None
                else []
            )
            if len({f for _, f in by_fn}) == 1:
                # the parent's code passed that output to a custom Function, whose output
                # it returned: the Function's backward is the user's
                o, function = by_fn[0]
                summary = (
                    f"{what} gradient born in the backward of custom autograd.Function {function} "
                    f"in {path}, in code that used the output of {used}: the gradient of "
                    f"{path}'s {o.role} was finite, the gradient sent back to {used}'s "
                    f"{rec.role if rec is not None else trig.role} is not{also}"
                )
        hook = user_hook(trace, trig)
        if hook is not None and between is None:
            suspects = [c for c in cands if not _weak(c, trig.dtype)]
            if cands and not suspects and _finite_outputs(trace, cands, trig.index):
                names = ", ".join(c.path for c in cands[:3])
                consumer, path, origin = cands[0].path, trig.path, "module"
                summary = (
                    f"{what} gradient born in {_hook_phrase(hook, hook['tensor'])}, which "
                    f"returned it: the gradient reaching it was finite (the gradient of "
                    f"{names}'s output was finite, and {'its' if len(cands) == 1 else 'their'} "
                    f"backward cannot make {what} from it), what it returned is not "
                    f"({_NO_ANOMALY})"
                )
            else:
                summary += (
                    f"; or in {_hook_phrase(hook, hook['tensor'])}, which returned it "
                    f"({_NO_ANOMALY})"
                )
    elif trig.phase is Phase.GRADIENT:
        kind, origin = AnomalyKind.GRADIENT, "gradient"
        path = trig.path
        parameter = _param_name(trig)
        summary = f"{what} in the gradient of parameter {parameter} (after backward)"
        hook = user_hook(trace, trig)
        if hook is not None:
            outs = [
                r
                for r in trace.records
                if r.phase is Phase.BACKWARD and r.path == trig.path and r.index < trig.index
            ]
            if outs and all(r.stat is not None and r.stat.finite for r in outs):
                summary = (
                    f"{what} in the gradient of parameter {parameter}, returned by "
                    f"{_hook_phrase(hook, 'it')}: the gradient of {trig.path}'s output was "
                    f"finite, what the hook returned is not ({_NO_ANOMALY})"
                )
            else:
                summary += f"; {_hook_phrase(hook, 'it')} may have returned it ({_NO_ANOMALY})"
    else:
        kind, origin = AnomalyKind.PARAMETER, "parameter"
        path = trig.path
        parameter = _param_name(trig)
        writer = next(
            (
                n.data
                for n in reversed(trace.notes)
                if n.kind == "weight_writer" and n.data.get("parameter") == parameter
            ),
            None,
        )
        if writer is not None and writer.get("since_attach") and first_step:
            if _finite_grad_before(trace, trig, parameter):
                # written after a backward that gave it a finite gradient (NW301 says so)
                summary = (
                    f"{what} in the weights of {parameter}: written after this step's "
                    "backward by code outside an optimizer step (no torch.optim optimizer "
                    "updated it: a hand-written update, p -= lr * p.grad)"
                )
            else:
                summary = (
                    f"{what} in the weights of {parameter}: written in this step outside an "
                    "optimizer step (no optimizer updated it: a data-dependent init, an EMA "
                    "update, a copy_ under no_grad)"
                )
        elif (
            first_step
            and trig.index < 0
            and writer is not None
            and writer.get("finite_at_attach")
            and writer.get("optimizer")
        ):
            summary = (
                f"{what} in the weights of {parameter}: finite when nanwatch attached, made "
                f"non-finite by the last update ({writer['optimizer']} optimizer step)"
            )
        elif (
            first_step and trig.index < 0 and writer is not None and writer.get("finite_at_attach")
        ):
            summary = (
                f"{what} in the weights of {parameter}: finite when nanwatch attached, written "
                "since by code autograd does not see (a .data write: a hand-written "
                "p.data.add_ update, a copy into .data)"
            )
        elif first_step and trig.index < 0:  # recorded ahead of the first step's forward
            summary = (
                f"{what} in the weights of {parameter} before any update nanwatch saw: the "
                "model was loaded or initialized with it (a checkpoint, a custom init)"
            )
        else:
            by = "the last update (optimizer step)"
            if writer is not None and writer.get("after_optimizer"):
                by = "a write after the last optimizer step (not the update)"
                if writer.get("replaced"):
                    by = (
                        "a write after the last optimizer step (not the update) that replaced "
                        "its tensor (a .data assignment)"
                    )
            elif writer is not None and writer.get("optimizer") is None:
                by = (
                    "code outside an optimizer step (no torch.optim optimizer updated it: a "
                    "hand-written update, an EMA, a copy_)"
                )
            elif (
                writer is not None
                and writer.get("update_nan_free")
                and trig.stat is not None
                and trig.stat.has_nan
                and not (trig.stat.has_posinf or trig.stat.has_neginf)
            ):
                by = (
                    f"a write after the last optimizer step that autograd does not see (a "
                    f".data write): {writer['optimizer']}'s update makes no NaN from the "
                    "finite numbers it read"
                )
            summary = (
                f"{what} in the weights of {parameter}: made non-finite by {by}, not by this "
                "step's computation"
            )
            since = writer.get("bad_since") if writer is not None else None
            if isinstance(since, int) and since < trace.step:
                # read non-finite at every step since: no later update made it
                summary = (
                    f"{what} in the weights of {parameter}: non-finite since step {since} "
                    "(read so at that step and at every step since), not made by this step"
                )
            elif writer is not None and writer.get("read_finite_by"):
                # a forward of this step read it finite after the update: written since
                summary = (
                    f"{what} in the weights of {parameter}: written in place after "
                    f"{writer['read_finite_by']}'s forward ran with it finite this step, by "
                    "code autograd does not see (a .data write, a copy_ or add_ under "
                    "no_grad), not by an optimizer step"
                )
            if writer is not None and writer.get("op") and writer.get("op_source"):
                # forensic: the op that wrote it (0/0 of a w / w.norm() of a zero row)
                summary = (
                    f"{what} in the weights of {parameter}: made non-finite by {by}: "
                    f"{writer['op']} made {writer.get('op_born') or what} at "
                    f"{writer['op_source']}"
                )

    if grad_trig is not None:
        user = trace.call(grad_trig.call)
        typ = f" ({user.module_type})" if user is not None and user.module_type else ""
        neginf = neginf or trig
        summary += (
            f"; the backward of {grad_trig.path}{typ}, which took it, made "
            f"{_kinds_text(grad_trig)} of it in the gradient of parameter "
            f"{_param_name(grad_trig)} (0 × -inf in a weight's gradient): the -inf is where "
            "it began, though the output of the module was finite"
        )
    # a gradient from outside the modules was born in the loss code's backward: its op
    op = (
        _matching_op(
            trace.ops,
            Phase.BACKWARD if kind is AnomalyKind.BACKWARD else Phase.FORWARD,
            LOSS_PATH if origin == "after-output" else path,
            trig.stat,
        )
        if kind in (AnomalyKind.FORWARD, AnomalyKind.BACKWARD)
        else None
    )
    if op is None and kind is AnomalyKind.FORWARD and origin == "module":
        op = _grad_in_forward(trace.ops, path)
        if op is not None:
            summary += (
                f": made by the backward of {op.node or op.op} that torch.autograd.grad"
                "(create_graph=True) ran inside the forward"
                + (f" at {op.backward_at}" if op.backward_at else "")
            )
    custom = (
        _matching_custom(trace.ops, LOSS_PATH if origin == "after-output" else path)
        if kind is AnomalyKind.BACKWARD and op is None
        else None
    )
    if origin == "after-output" and op is not None:
        summary = (
            f"{what} gradient born in the backward of {LOSS_PATH}, the loss code computed "
            f"outside the watched modules, on its way to the output of {path}"
        )
        if double:
            summary = (
                f"{what} gradient born in the backward of {LOSS_PATH}, the loss code computed "
                f"outside the watched modules, reaching {trig.path}'s {trig.role} through "
                "the double backward of torch.autograd.grad(create_graph=True), not through "
                "a module's output gradient"
            )
        if op.backward_at and op.source == op.backward_at:  # the node's forward line unknown
            summary += "; mode='forensic' names the line that created it"
        consumer, path = path, LOSS_PATH  # the producer is the loss code, the model got it
    elif custom is not None:
        # the user's own backward made it: no aten op is known, only whose backward it was
        fn = custom_backward(custom)
        made = f"the backward of custom autograd.Function {fn} made {custom.born}"
        if origin == "after-output":
            summary = (
                f"{what} gradient born in the backward of {LOSS_PATH}, the loss code computed "
                f"outside the watched modules, on its way to the output of {path}: {made}"
            )
            consumer, path = path, LOSS_PATH
        else:
            summary = f"{summary}: {made}"
        if custom.backward_at:
            summary += f" ({custom.backward_call} at {custom.backward_at})"
        summary += (
            "; the op inside it was not traced: mode='forensic' or nw.replay(step_fn) "
            "names it and its line"
        )
    if grad_trig is not None and op is None:
        op = _neginf_maker(trace.ops, path)  # forensic: the op that made the -inf (a log of 0)
    if kind is AnomalyKind.BACKWARD and op is None and custom is None:
        op = _hidden_forward_nan(trace.ops)
        if op is not None:  # no backward op made it: the forward NaN the loss never saw did
            summary = (
                f"{what} gradient from a NaN born in forward that the loss did not see (a "
                f"torch.where or a 0 mask hid it; backward still runs through it), reaching "
                f"{consumer or path}"
            )
    if origin in ("module", "between-children"):
        summary = _with_micro_batch(summary, _micro_batch_text(trace, call, path))
    props, n = propagators(trace, trig, path)
    anomaly = Anomaly(
        step=trace.step,
        kind=kind,
        path=path,
        record=trig,
        origin=origin,
        summary=summary,
        propagators=props,
        propagator_count=n,
        op=op,
        neginf_source=neginf,
        consumer=consumer,
        parameter=parameter,
    )
    if kind is AnomalyKind.GRADIENT:
        adopt_backward_op(anomaly, trace.ops)
    anomaly.summary = summarize(anomaly)
    return anomaly


_NO_ANOMALY = "torch.autograd.detect_anomaly does not check hooks"


#: :func:`_root_not_called`'s words, and the root they name
_NOT_RUN = re.compile(r": (\S+) did not run this step")


def _root_not_called(trace: StepTrace) -> str:
    """Why sentinel mode saw no module make a value of this step: the loop called parts of
    a watched root itself, never the root, whose own call is all sentinel mode hooks (see
    ``Watcher._probe_parts``); empty when the step's root ran."""
    note = next((n for n in trace.notes if n.kind == "root_not_called"), None)
    if note is None:
        return ""
    root, part = note.path, note.data.get("part") or ""
    reached = f" (the loss reached the weights of {part} alone)" if part else ""
    if note.data.get("front") == "lightning":
        fix = ": NanWatchCallback(mode='watch'), which hooks every module"
    else:
        watch = f"pass {part} to nanwatch.watch" if part else "watch the parts the loop calls"
        fix = f", {watch}, or call {root}"
    return (
        f": {root} did not run this step{reached}, and sentinel mode hooks only {root}'s own "
        f"call: the parts the loop calls are hooked from the next step on; to watch them from "
        f"the start{fix}"
    )


def user_hook(trace: StepTrace, trig: Record) -> dict[str, Any] | None:
    """The hook the user registered on the tensor whose gradient ``trig`` found bad (the
    watcher's ``user_hook`` note: ``tensor``, ``how``, ``fn``, ``at``, ``code``,
    ``parameter``), the last registered when several; None when there is none."""
    tensor = trig.role if trig.phase is Phase.GRADIENT else f"{trig.path}'s {trig.role}"
    return next(
        (
            n.data
            for n in reversed(trace.notes)
            if n.kind == "user_hook" and n.path == trig.path and n.data.get("tensor") == tensor
        ),
        None,
    )


def _hook_phrase(hook: dict[str, Any], on: str) -> str:
    """``a hook you registered on h's output (register_hook, <lambda> at train.py:15)``."""
    return (
        f"a hook you registered on {on} ({hook.get('how')}, {hook.get('fn')} at {hook.get('at')})"
    )


def _finite_outputs(trace: StepTrace, cands: list[Call], before: int) -> bool:
    """Every output gradient of ``cands`` recorded before ``before`` was finite, and at
    least one was."""
    ids = {c.id for c in cands}
    grads = [
        r
        for r in trace.records
        if r.phase is Phase.BACKWARD
        and r.index < before
        and r.source is not None
        and (src := trace.record(r.source)) is not None
        and src.call in ids
        and src.phase is Phase.FORWARD
    ]
    return bool(grads) and all(r.stat is not None and r.stat.finite for r in grads)


def _param_name(rec: Record) -> str:
    """Parameter records carry the qualified parameter name (``encoder.fc.weight``) as role."""
    return rec.role


_HOOK_CALL = re.compile(
    r"\.(register_hook|register_full_backward_hook|register_full_backward_pre_hook|"
    r"register_post_accumulate_grad_hook|register_backward_hook)\("
)
_ACCUMULATE = ("torch::autograd::AccumulateGrad", "AccumulateGrad")


def hook_op(ev: OpEvent | None) -> str | None:
    """How a traced backward op ran in a hook the user registered, or None: its own line
    registers a hook (a lambda: ``h.register_hook(lambda g: g / g.norm())``), or it ran
    while autograd accumulated a leaf's gradient (AccumulateGrad runs no op that makes a
    NaN; a hook on the parameter does). detect_anomaly does not see such an op."""
    if ev is None or ev.phase is not Phase.BACKWARD or custom_function(ev.node) is not None:
        return None
    m = _HOOK_CALL.search(ev.code or "")
    if m is not None:
        return m.group(1)
    if ev.node in _ACCUMULATE and ev.source and ev.source != ev.backward_at:
        return "register_hook"
    return None


def _hook_text(anomaly: Anomaly, ev: OpEvent, how: str) -> str:
    what = _kinds_text(anomaly.record)
    rec = anomaly.record
    on = (
        f"parameter {anomaly.parameter or rec.role}"
        if rec.phase is Phase.GRADIENT or ev.node in _ACCUMULATE
        else f"{rec.path}'s {rec.role}"
    )
    kind = "module backward hook" if "backward" in how else "tensor hook"
    return (
        f"{what} gradient born in a {kind} you registered ({how}) at {ev.source}, on "
        f"{on}: the gradient reaching the hook was finite, what it returned is not "
        "(torch.autograd.detect_anomaly does not check hooks)"
    )


def _follow_op(anomaly: Anomaly, base: str) -> str:
    """A traced backward op (forensic mode, nw.replay) overrules the records' guess of whose
    backward made the value: a custom Function's backward or a hook the user registered is
    named in the headline (the records saw only the modules around it)."""
    ev = anomaly.op
    if ev is None or ev.phase is not Phase.BACKWARD:
        return base
    how = hook_op(ev)
    if how is not None:
        anomaly.origin = "module"
        return _hook_text(anomaly, ev, how)
    fn = custom_function(ev.node)
    if fn is None or f"the backward of custom autograd.Function {fn}" in base:
        return base
    what = _kinds_text(anomaly.record)
    rec = anomaly.record
    return (
        f"{what} gradient born in the backward of custom autograd.Function {fn}: the "
        f"gradient it sent back reached {rec.path}'s {rec.role}, while every watched "
        "module's output gradient before it was finite"
    )


def _last_node(anomaly: Anomaly, base: str) -> str:
    """``computed ... by MmBackward0`` names the autograd node that made the value handed
    over, the last op of the user's code; once the op that made the NaN/inf is pinned (the
    graph walk, a replay) and is another op (a division before the matmul), that node is
    only the last op: ``(last op MmBackward0)``, so the headline names one culprit."""
    rec, op = anomaly.record, anomaly.op
    tail = f" by {rec.grad_fn}"
    if op is None or not rec.grad_fn or not base.endswith(tail):
        return base
    parts = op.chain()[0].op.split(".")
    name = (parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[0]).rstrip("_")
    node = re.sub(r"Backward\d*$", "", rec.grad_fn)
    if name.replace("_", "").lower() == node.lower():
        return base  # the pinned op made the value handed over: "by" it is right
    return f"{base.removesuffix(tail)} (last op {rec.grad_fn})"


_HEDGE = ", or of code outside it that used "


#: the clause the loss graph's reading adds when it could not name the op's line
_LINE_UNKNOWN = re.compile(r"; the op's line is not known in \w+ mode: .*? names it")


def _drop_line_unknown(anomaly: Anomaly, base: str) -> str:
    """The clause saying the op's line is not known, once a replay (or forensic tracing)
    found the line: the summary then quotes it."""
    op = anomaly.op.chain()[0] if anomaly.op is not None else None
    if op is None or not op.source:
        return base
    m = _LINE_UNKNOWN.search(base)
    if m is None or base[: m.start()].endswith(op.source):
        return base  # the line found is the backward call's own, not the op's
    return base[: m.start()] + base[m.end() :]


def _drop_hedge(anomaly: Anomaly, base: str) -> str:
    """A module hedged with the other code that used its input (see :func:`_shared_input`)
    is the producer once a traced op of its own backward made the value (the watcher's
    replay of its backward, after localization)."""
    op, rec = anomaly.op, anomaly.record
    if _HEDGE not in base or op is None or op.phase is not Phase.BACKWARD or op.path is None:
        return base
    if op.path != anomaly.path and not op.path.startswith(anomaly.path + "."):
        return base
    return (
        f"{base.split(_HEDGE, 1)[0]}: the gradient of its output was finite, the gradient it "
        f"sent back to {rec.path}'s {rec.role} is not"
    )


#: op events a replay traced with new random draws, by id: (the event, the attempt). Events
#: are slotted (no weak references): the last few are kept, which is all a summary reads.
_REDRAWN: dict[int, tuple[OpEvent, int]] = {}
_REDRAWN_KEEP = 1024


def mark_redrawn(events: Sequence[OpEvent], attempt: int) -> None:
    for ev in reversed(events):  # the first (the birth) is dropped last
        _REDRAWN[id(ev)] = (ev, attempt)
    while len(_REDRAWN) > _REDRAWN_KEEP:
        del _REDRAWN[next(iter(_REDRAWN))]


def redrawn(ev: OpEvent) -> int | None:
    """The attempt of the replay that traced ``ev`` with random draws other than the
    original run's (its statistics are that draw's, not the values the run had), else None."""
    got = _REDRAWN.get(id(ev))
    return got[1] if got is not None and got[0] is ev else None


def summarize(anomaly: Anomaly) -> str:
    """The one-line summary, with the op and propagation when known."""
    base = anomaly.summary.split(" [")[0]
    base = _drop_hedge(anomaly, base)
    base = _drop_line_unknown(anomaly, base)
    base = _follow_op(anomaly, base)
    base = _last_node(anomaly, base)
    base = _neginf_birth(anomaly, base)
    base = _returned_overflow(anomaly, base)
    base = _in_child(anomaly, base)
    op = anomaly.op
    if (
        anomaly.origin == "loss-code"
        and op is not None
        and op.phase is Phase.FORWARD
        and op.path not in (None, LOSS_PATH)
        and " born on the way to the loss, " in base
        and not _neginf_returned_by(anomaly, op.path)
    ):  # a value a module made and kept aside (self.aux = ...), which the loss then used
        what = base.split(" born on the way to the loss, ")[0]
        alone = _NOT_RUN.search(base)
        if alone is not None:  # its output unseen: the loop called it, its root unhooked
            base = f"{what} born in the forward of {op.path}, called by the loop without {alone[1]}"
        else:
            base = (
                f"{what} born in the forward of {op.path}, in a value it did not return that "
                "the loss used"
            )
    leaf = leaf_text(op) or constant_text(op) if anomaly.origin == "loss-code" else None
    if leaf is not None and " born on the way to the loss, " in base:
        what, rest = base.split(" born on the way to the loss, ", 1)
        if op is not None and (CONSTANT in op.scalars or LEAF in op.scalars) and op.born:
            what = op.born  # what the operand held (+inf), which the loss turned into NaN
        rest = rest.removeprefix("outside every watched module's output")
        base = f"{what} {leaf}{rest}"
        op = None  # no op made it: the leaf held it before the op read it
    extra: list[str] = []
    if anomaly.state_written:
        extra.append(
            f"a replay ran clean, but the forward wrote {', '.join(anomaly.state_written[:4])} "
            "in place: the replay started from the values it wrote, not the ones it read"
        )
    if op is not None:
        op = op.chain()[0]  # the birth of the first non-finite value (log's -inf, not neg's +inf)
        base = _born_first(anomaly, op, base)
        made = _leading_kinds(base)
        unlike = op.born and made and (made != set(op.born.split(", ")) or " (then " in base)
        extra.append(f"op {op_phrase(op)}" + (f", which made {op.born}" if unlike else ""))
        attempt = redrawn(op)
        if attempt is not None:
            extra.append(
                f"traced by a replay that drew new random numbers (attempt {attempt}): the "
                "op's values quoted are from that draw, not the run's"
            )
    if anomaly.propagator_count:
        extra.append(
            f"passed on by {anomaly.propagator_count} module"
            f"{'s' if anomaly.propagator_count != 1 else ''}"
        )
    if anomaly.transient:
        extra.append("a replay on the same inputs ran clean")
    return base + (" [" + "; ".join(extra) + "]" if extra else "")


_KINDS = ("NaN", "+inf", "-inf")


def _born_first(anomaly: Anomaly, op: OpEvent, base: str) -> str:
    """A value whose op made other kinds than the record holds opens with what the op made,
    the record's kinds after it, as the headline does (:func:`nanwatch.report.anomaly_headline`):
    ``-inf born in the forward of (loss) ... (then +inf)`` for ``-log(p)`` of a saturated
    sigmoid (the log made -inf, the minus +inf), ``-inf gradient born in ... (then NaN)``
    for a sqrt's backward whose -inf a product turned into NaN, ``+inf born ... (then +inf,
    -inf)`` where a later product with negative values gave the record both signs."""
    stat = anomaly.record.stat
    if not op.born or stat is None or stat.finite:
        return base
    held = stat.kinds()
    lead = _leading_kinds(base)
    if lead != set(held.split(", ")) or set(op.born.split(", ")) == lead:
        return base  # the summary does not open with the record's kinds, or the op made them
    rest = base.split(" ", len(lead))[-1]
    return f"{op.born} {rest} (then {held})"


def _leading_kinds(text: str) -> set[str]:
    """The kinds a summary opens with: ``{"+inf", "-inf"}`` for ``+inf, -inf born in ...``."""
    out: set[str] = set()
    for raw in text.split(" "):
        word = raw.removesuffix(",")
        if word not in _KINDS:
            break
        out.add(word)
    return out


def _neginf_birth(anomaly: Anomaly, base: str) -> str:
    """A module's NaN or +inf made of a -inf that came in (a Linear's addmm given -inf: no
    mask-writing module is an overflow's producer) was born where the -inf was: when the
    traced ops show a computed -inf (an exp that overflowed, then a product; a log of 0)
    born from finite values in another module's code, that module is the producer and the
    anomaly moves to it. A -inf written on purpose (``masked_fill(mask, -inf)``: an
    injected event) or one whose op is not known leaves the anomaly where it is."""
    op, src = anomaly.op, anomaly.neginf_source
    if (
        op is None
        or src is None
        or anomaly.kind is not AnomalyKind.FORWARD
        or anomaly.origin not in ("module", "between-children")
        or op.phase is not Phase.FORWARD
    ):
        return base
    chain = op.chain()
    first = chain[0]
    if len(chain) < 2 or first.phase is not Phase.FORWARD or first.injected or not first.born:
        return base
    if any(e.injected for e in chain) or first.path is None:
        return base
    if any(s is not None and not s.finite for _, s in first.inputs):
        return base  # not born there from finite values
    if not any(s is not None and s.has_neginf for _, s in op.inputs):
        return base  # the op that made the anomaly's value was not given a -inf
    if first.path == anomaly.path or first.path.startswith(anomaly.path + "."):
        return base  # born inside the producer already named
    what = src.stat.kinds() if src.stat is not None and not src.stat.finite else "-inf"
    later = f"; it became {_kinds_text(anomaly.record)} in {anomaly.record.where}"
    anomaly.path = first.path
    if src.phase is Phase.INPUT and src.path != first.path:
        anomaly.origin = "between-children"
        return (
            f"{what} born in the forward code of {first.path} itself, in the value it passed "
            f"to {src.path} ({src.role}){later}"
        )
    anomaly.origin = "module"
    typ = f" ({src.module_type})" if src.path == first.path and src.module_type else ""
    return f"{what} born in the forward of {first.path}{typ}, in its {src.role}{later}"


def _returned_overflow(anomaly: Anomaly, base: str) -> str:
    """The loss code turned a module's -inf output into +inf or NaN (``F.nll_loss`` of a
    hand-written log-softmax), and the traced ops show that -inf made, inside that module,
    from a +inf or NaN its own code computed from finite values (``exp(x)`` overflowed,
    then ``x - log(inf)``): the first non-finite value was born there, not on the way to
    the loss, and the anomaly moves to that module. A -inf made as one (a log of 0, a
    mask) is a value the loss code made bad: :func:`summarize` keeps the loss code."""
    op, src = anomaly.op, anomaly.neginf_source
    if (
        op is None
        or src is None
        or anomaly.kind is not AnomalyKind.FORWARD
        or anomaly.origin != "loss-code"
        or op.phase is not Phase.FORWARD
        or src.phase is not Phase.FORWARD
    ):
        return base
    chain = op.chain()
    first = chain[0]
    if first.phase is not Phase.FORWARD or first.path is None or not first.born:
        return base
    if any(e.injected for e in chain):
        return base  # written on purpose
    if not {"NaN", "+inf"} & set(first.born.split(", ")):
        return base  # a -inf made as one: not an anomaly until the loss code used it
    if any(s is not None and not s.finite for _, s in first.inputs):
        return base  # not born there from finite values
    if first.path != src.path and not first.path.startswith(src.path + "."):
        return base  # not made by the module that returned the -inf
    typ = f" ({src.module_type})" if src.path == first.path and src.module_type else ""
    returned = src.stat.kinds() if src.stat is not None and not src.stat.finite else "-inf"
    anomaly.path, anomaly.origin = first.path, "module"
    return (
        f"{first.born} born in the forward of {first.path}{typ}, which turned it into "
        f"{returned} in its {src.role}; it became {_kinds_text(anomaly.record)} in "
        f"{anomaly.record.where}"
    )


def _in_child(anomaly: Anomaly, base: str, *, below: bool = False) -> str:
    """A value the parent's code passed to a child (``conv(F.silu(norm(x)))``) held NaN or
    inf, and the replay traced the op that made it from finite values to another child's
    code (the norm, whose output nanwatch bounds by its input instead of measuring it):
    that child is the producer, not the parent's own code. ``below``: the watcher found the
    op's module inside the parent's call (a root's children are not named after it)."""
    op, rec = anomaly.op, anomaly.record
    if (
        op is None
        or anomaly.kind is not AnomalyKind.FORWARD
        or anomaly.origin != "between-children"
        or rec.phase is not Phase.INPUT
    ):
        return base
    first = op.chain()[0]
    path = first.path
    if first.phase is not Phase.FORWARD or first.injected or not first.born or path is None:
        return base
    if not (below or path.startswith(anomaly.path + ".")) or path == rec.path:
        return base  # the parent's own code, or the child that was given it
    if any(s is not None and not s.finite for _, s in first.inputs):
        return base
    parent = anomaly.path
    anomaly.path, anomaly.origin = path, "module"
    return (
        f"{_kinds_text(rec)} born in the forward of {path}, then passed by the code of "
        f"{parent} to {rec.path} ({rec.role})"
    )


def born_below(anomaly: Anomaly, path: str, module_type: str) -> None:
    """The replay of the anomaly's module traced the op that made its value from finite
    values to ``path``, a module the watcher found inside that module's call (one whose
    output it did not measure: a norm bounded by its input, or code between its children):
    the anomaly moves to that innermost module, in its path and summary, which the rules
    then quote. A -inf that came in is :func:`_neginf_birth`'s; a mask's -inf written in
    ``path`` and turned into NaN there (see :func:`_grew_from_mask`) was born there too."""
    op, rec = anomaly.op, anomaly.record
    if op is None or anomaly.kind is not AnomalyKind.FORWARD or anomaly.neginf_source:
        return
    first = op.chain()[0]
    masked = first.injected and _grew_from_mask(op.chain(), path)
    if first.phase is not Phase.FORWARD or (first.injected and not masked) or not first.born:
        return
    if first.path != path or path == anomaly.path:
        return
    if not masked and any(s is not None and not s.finite for _, s in first.inputs):
        return  # not born there from finite values
    base, sep, rest = anomaly.summary.partition(" [")
    if anomaly.origin == "between-children":
        moved = _in_child(anomaly, base, below=True)
        if moved is not base:
            anomaly.summary = moved + sep + rest
        return
    head = " born in the forward of "
    if anomaly.origin != "module" or head not in base:
        return
    what = _kinds_text(rec) if masked else base.split(head, 1)[0]
    outer = anomaly.path
    anomaly.path, anomaly.module_type = path, module_type
    typ = f" ({module_type})" if module_type else ""
    nth = _NTH_CALL.search(base)  # which micro-batch of the step (see _micro_batch_text)
    anomaly.summary = (
        f"{what}{head}{path}{typ}, inside {outer}{nth[0] if nth else ''}; first seen in "
        f"{rec.where}{sep}{rest}"
    )


_NTH_CALL = re.compile(r", in (?:its|the) \d+(?:st|nd|rd|th) call (?:of \S+ )?this step")


def _grew_from_mask(chain: Sequence[OpEvent], path: str) -> bool:
    """The chain opens with a -inf written on purpose (``masked_fill(mask, -inf)``), and the
    op that first made NaN or +inf of it (a softmax of a row masked whole) ran in ``path``
    too, given no NaN or +inf: the mask is no anomaly, that op's NaN is, and both are the
    code of the module at ``path``."""
    for ev in chain:
        if ev.phase is not Phase.FORWARD or ev.path != path:
            return False
        if not {"NaN", "+inf"} & set(ev.born.split(", ")):
            continue
        return not any(s is not None and (s.has_nan or s.has_posinf) for _, s in ev.inputs)
    return False


def _neginf_returned_by(anomaly: Anomaly, path: str) -> bool:
    """The -inf the anomaly grew out of was seen in an output ``path`` returned (a flow
    layer's logdet of log(0)): the module's op made it, the loss code turned it into +inf
    or NaN; not a value the module kept aside."""
    src = anomaly.neginf_source
    return src is not None and src.phase is Phase.FORWARD and src.path == path


#: ``OpEvent.scalars`` key of a leaf event (see ``nanwatch.ops.leaf_event``)
LEAF = "leaf"


def leaf_text(op: OpEvent | None) -> str | None:
    """``in a tensor your code passes to the loss: a leaf ...``: the loss code read a leaf
    tensor that already held the non-finite value (see ``nanwatch.ops.leaf_event``); None
    for any other event."""
    if op is None or LEAF not in op.scalars:
        return None
    shape = op.scalars.get("leaf_shape")
    kind = "an nn.Parameter" if op.scalars.get("leaf_parameter") else "a tensor"
    of = f" of shape {shape}" if shape else ""
    name = op.scalars.get("leaf_name")
    if leaf_never_written(op):
        return (
            f"in {f'{name}, ' if name else ''}a tensor your code passes to the loss: a leaf "
            f"({kind} with requires_grad, not a watched module's parameter){of} that held "
            f"{op.born} when this step's {short_node(op)} read it, and nothing has written "
            "it since it was created (its version counter is 0: no in-place write, no "
            "optimizer step): it was created non-finite"
            + (
                " (log(0) = -inf: a log of an initial value of 0 makes it)"
                if op.born == "-inf"
                else ""
            )
        )
    return (
        f"in {f'{name}, ' if name else ''}a tensor your code passes to the loss: a leaf "
        f"({kind} with requires_grad, not a watched module's parameter){of} that already "
        f"held {op.born} before this step's "
        f"{short_node(op)} read it (no op of this step made it): an update at an earlier "
        "step wrote it, typically an optimizer you built for it (a GradNorm or "
        "uncertainty-weighting loss weight)"
    )


def leaf_never_written(op: OpEvent) -> bool:
    """The leaf of a leaf event was never written in place since it was created (its
    version counter, ``leaf_version``, is 0: no optimizer step, no ``.data`` or in-place
    write), so it was created holding what it holds."""
    return LEAF in op.scalars and op.scalars.get("leaf_version") == 0


#: ``OpEvent.scalars`` key of an event for an operand with no autograd history (see
#: ``nanwatch.ops.leaf_event``)
CONSTANT = "constant"


def constant_text(op: OpEvent | None) -> str | None:
    """``in the self operand of mul: a tensor computed without gradients ...``: the loss
    code multiplied or divided by a tensor with no autograd history (computed under
    ``torch.no_grad``) that held the non-finite value (see
    ``nanwatch.ops.leaf_event``); None for any other event."""
    if op is None or CONSTANT not in op.scalars:
        return None
    shape = op.scalars.get("constant_shape")
    name = op.scalars.get("constant_name")
    at = f" at {op.source}" if op.source else ""
    weight = " (a weight or scale computed under no_grad)" if short_node(op) in _MULTIPLIERS else ""
    return (
        f"in the {op.scalars[CONSTANT]} operand of {short_node(op)}{at}"
        f"{f' ({name})' if name else ''}, a tensor computed without gradients (no autograd "
        f"history){f', shape {shape}' if shape else ''}: it held {op.born} before "
        f"{short_node(op)} read it, so the code that computed it made the value, not an op "
        f"of the loss's graph{weight}"
    )


#: ops whose constant operand multiplies the loss (``w * loss``, ``loss / s``)
_MULTIPLIERS = frozenset({"mul", "div"})


def short_node(op: OpEvent) -> str:
    """``aten.mul`` -> ``mul``, the op in the user's words."""
    return op.op.removeprefix("aten.").split(".")[0]


def finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


_INPLACE = re.compile(
    r"modified by an inplace operation: \[(?:torch\.)?(?P<type>[\w.]+) \[(?P<shape>[\d, ]*)\]\],? "
    r"(?:which is output (?P<out>\d+) of (?P<fn>\w+), )?is at version (?P<now>\d+); "
    r"expected version (?P<then>\d+)"
)


def parse_inplace_error(message: str) -> dict[str, object] | None:
    """The facts in autograd's "modified by an inplace operation" error: the tensor's type
    and shape, which output of which autograd node it was (None for a tensor no node made:
    a buffer, a parameter or a view of one), and the versions."""
    m = _INPLACE.search(message)
    if m is None:
        return None
    shape = tuple(int(s) for s in m.group("shape").replace(" ", "").split(",") if s)
    return {
        "tensor_type": m.group("type"),
        "shape": shape,
        "output": int(m.group("out")) if m.group("out") is not None else None,
        "grad_fn": m.group("fn"),
        "version": int(m.group("now")),
        "expected_version": int(m.group("then")),
    }


def _node_base(name: str) -> str:
    return re.sub(r"Backward\d*$", "", name)


def inplace_suspects(traces: Iterable[StepTrace], message: str) -> list[Record]:
    """Module outputs that match autograd's in-place error: same autograd node and shape,
    recorded at the version autograd expected. Most recent step first."""
    facts = parse_inplace_error(message)
    if facts is None or facts["grad_fn"] is None:
        return []  # no node made it: no module output is it (a buffer or parameter is)
    fn = _node_base(str(facts["grad_fn"]))
    shape = facts["shape"]
    then = facts["expected_version"]
    out: list[Record] = []
    for trace in traces:
        for r in trace.records:
            if r.phase is not Phase.FORWARD or r.grad_fn is None:
                continue
            if _node_base(r.grad_fn) != fn or r.shape != shape:
                continue
            if r.version is not None and r.version != then:
                continue
            if r.source is not None:
                src = trace.record(r.source)
                if src is not None and src.grad_fn == r.grad_fn and src.phase is Phase.FORWARD:
                    continue  # an alias: the module that made it is already listed
            out.append(r)
        if out:
            break
    return out


def other_births(trace: StepTrace, anomaly: Anomaly, limit: int = 3) -> list[Record]:
    """Forward outputs of ``trace`` born non-finite elsewhere than ``anomaly``: a module call
    whose output went bad while every input it was given was finite (measured), that is not
    the anomaly's own call, nor one of its callers, nor the -inf source it grew out of, and
    whose children made nothing bad themselves. A second problem of the same step (a log(0)
    in another branch) that fixing the first one would only uncover. At most ``limit``."""
    if anomaly.kind is not AnomalyKind.FORWARD:
        return []
    own = trace.call(anomaly.record.call)
    skip: set[int] = set()
    c = own
    while c is not None and len(skip) < 256:  # the anomaly's call and its callers
        skip.add(c.id)
        c = trace.call(c.parent) if c.parent is not None else None
    src = anomaly.neginf_source
    if src is not None and src.step == trace.step:
        skip.add(src.call)
    bad_calls = {
        r.call
        for r in trace.records
        if r.phase is Phase.FORWARD and r.stat is not None and not r.stat.finite
    }
    out: list[Record] = []
    for r in trace.records:
        if r.phase is not Phase.FORWARD or r.stat is None or r.stat.finite or r.call in skip:
            continue
        call = trace.call(r.call)
        if call is None or call.is_loss or call.path == LOSS_PATH:
            continue
        if any(k.parent == call.id and k.id in bad_calls for k in trace.calls):
            continue  # a child made it: that child is the birth
        ins = [_measured(trace, i) for i in trace.inputs_of(call.id)]
        if not ins or any(i is None or i.stat is None or not i.stat.finite for i in ins):
            continue  # an input was bad, or not measured: not known to be born here
        if all(o.path != r.path for o in out):
            out.append(r)
        if len(out) >= limit:
            break
    return out


def _measured(trace: StepTrace, rec: Record) -> Record | None:
    """The record that measured input ``rec``: its link, or, for an unmeasured input made
    by an op that cannot create a non-finite value, the output it was made of (see
    :func:`_made_of`)."""
    got = trace.resolve(rec)
    if got.stat is not None:
        return got
    made = _made_of(trace, rec)
    return trace.record(made) if made is not None else None
