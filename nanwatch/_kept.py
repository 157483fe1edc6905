"""What the risky autograd nodes of each watched call's own code saved, kept for a read
after the optimizer's update.

On an accelerator whose step the GPU bounds, nothing has landed when ``backward()`` begins
and what backward made is read at the step's end, after ``optimizer.step()`` wrote the
weights: a module whose own backward made a NaN (a ``sqrt`` of a squared distance at 0, an
``acos`` at 1, a ``log`` at 0 under ``torch.where``) can no longer be replayed with the
weights it ran with, and backward freed what its nodes saved. So, read late, as each watched
call returns, the nodes of its own code (between its outputs, the values it gave the
submodules it called, and what existed before it began) whose backward can make a
non-finite gradient from a finite one at a point its saved values show (a sqrt's result
at 0, a log's input at 0, an acos's at 1) are found, and what they saved is kept, with the
call's inputs: references, no read, no sync, within :data:`BUDGET` bytes a step (held
until the step ends instead of freed as backward runs). A node whose saved values an
unpack hook gives back (a non-reentrant checkpoint, which would recompute its region) is not
kept. A module whose own code holds no such node is not walked again. At the anomaly, the
kept values tell which node's derivative was infinite, and the call run again on its kept
inputs tells the node's line (see ``Watcher._pinpoint_from_kept``).

>>> keep = OwnSaved()
>>> x = torch.zeros(3, requires_grad=True)
>>> keep.begin("m", 0)
>>> y = torch.sqrt(x * 2)
>>> keep.end("m", 0, (x,), {}, [y], stop=set(), risky=lambda n: "Sqrt" in type(n).__name__)
>>> [(p, ops.name_of(s.node)) for p, _, s, _ in keep.snaps]
[('m', 'SqrtBackward0')]
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Any

import torch

from nanwatch import ops
from nanwatch._structure import iter_tensors

#: bytes of saved values kept a step, over all calls: a node past it is not kept
BUDGET = 64 << 20
#: nodes a call's walk looks at: a larger own graph is walked that far
WALK = 1024


def _nr(node: Any) -> int | None:
    try:
        return int(node._sequence_nr())
    except Exception:  # a node without a number
        return None


#: the ``_raw_saved_*`` attributes of each node type
_RAW: dict[type, tuple[str, ...]] = {}


def _hooked(node: Any) -> bool:
    """Whether reading what ``node`` saved would run a saved-tensor unpack hook (a
    non-reentrant checkpoint's recomputes its whole region; an offload's copies back), or
    cannot be told (a torch whose saved tensors do not say): such a node is not kept."""
    attrs = _RAW.get(type(node))
    if attrs is None:
        attrs = _RAW[type(node)] = tuple(a for a in dir(node) if a.startswith("_raw_saved_"))
    for attr in attrs:
        try:
            raw = getattr(node, attr)
        except Exception:  # freed already: nothing to read
            return True
        for r in raw if isinstance(raw, (list, tuple)) else (raw,):
            if r is not None and getattr(r, "unpack_hook", True) is not None:
                return True
    return False


def nodes_of(tensors: Any) -> list[Any]:
    """The autograd nodes of ``tensors``: a tuple of tensors (a call's arguments), or any
    nesting of them."""
    if isinstance(tensors, tuple) and all(isinstance(t, torch.Tensor) for t in tensors):
        return [t.grad_fn for t in tensors if t.grad_fn is not None]
    return [t.grad_fn for _, t in iter_tensors(tensors, "") if t.grad_fn is not None]


def _own_nodes(
    roots: list[Any], start: int, stop: Container[Any], own: set[int]
) -> list[tuple[Any, int]]:
    """The nodes reachable from ``roots`` made since node number ``start``, with their
    numbers, short of the watched values in ``stop`` (but ``own``'s, by id) and of the
    leaves; at most :data:`WALK` looked at. A walk of what a call's own code made, on
    each step it keeps anything: the hot path, so written out."""
    seen: dict[int, Any] = {}  # held: an id stays its node's until the walk ends
    found: list[tuple[Any, int]] = []
    todo = list(roots)
    while todo and len(seen) < WALK:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        try:
            nr = int(node._sequence_nr())
        except Exception:  # a node without a number: not the call's
            continue
        if nr < start or type(node).__name__ == "AccumulateGrad":
            continue
        if id(node) not in own and node in stop:
            continue
        found.append((node, nr))
        todo.extend(n for n, _ in node.next_functions)
    return found


class OwnSaved:
    """The step's kept nodes (see the module's doc): ``snaps`` holds (module path, call id,
    :class:`ops.SavedNode`, the node's number counted from the call's first)."""

    def __init__(self) -> None:
        #: module path -> whether its own code held a risky node the last time it was walked
        self.risky: dict[str, bool] = {}
        #: whether the step keeps anything: its backward may be read after its update
        self.wanted = True
        self.reset()

    def reset(self) -> None:
        """A new step: nothing kept (no reference outlives the step)."""
        self.snaps: list[tuple[str, int, ops.SavedNode, int]] = []
        self.kept = 0
        #: call id -> the autograd node counter as the call began
        self.starts: dict[int, int | None] = {}
        #: call id -> the nodes of what its own code gave the submodules it called
        self.given: dict[int, list[Any]] = {}
        #: call id -> what its forward was given, for a call some of whose nodes were kept:
        #: the call runs again on them for the lines of those nodes (backward freed them)
        self.inputs: dict[int, tuple[Any, Any]] = {}

    def begin(self, path: str, call_id: int) -> None:
        """A watched call of the module at ``path`` begins (host-side: one counter read),
        unless its own code held no risky node when last walked."""
        if self.risky.get(path) is not False:
            self.starts[call_id] = ops._next_sequence_nr()

    def gave(self, parent_id: int, args: Any, kwargs: Any, *, stop: Container[Any]) -> None:
        """The call ``parent_id`` calls a submodule on ``args`` and ``kwargs``: those its own
        code made (not a watched value in ``stop``) are where its own code ends too
        (``log(z)`` given to a head)."""
        got = nodes_of(args) + (nodes_of(kwargs) if kwargs else [])
        got = [n for n in got if n not in stop]
        if got:
            self.given.setdefault(parent_id, []).extend(got)

    def end(
        self,
        path: str,
        call_id: int,
        args: Any,
        kwargs: Any,
        outputs: Any,
        *,
        stop: Container[Any],
        risky: Callable[[Any], bool],
    ) -> None:
        """The call ``call_id`` of the module at ``path``, whose forward was given ``args``
        and ``kwargs``, returns ``outputs`` (not yet recorded: an output in ``stop`` is a
        submodule's): keep what its own code's risky nodes saved, down to the watched
        values in ``stop``, its parameters, and the nodes made before it began; and, when
        one was kept, its inputs too."""
        start = self.starts.pop(call_id, None)
        given = self.given.pop(call_id, [])
        if start is None or self.risky.get(path) is False:
            return
        own = {id(n) for n in given}  # recorded as a submodule's input since
        found = False
        for node, nr in _own_nodes(nodes_of(outputs) + given, start, stop, own):
            if not risky(node):
                continue
            found = True
            if _hooked(node):
                continue
            try:
                # its producers' saved values are not taken: one may be a checkpoint's
                snap = ops.SavedNode(node, depth=0)
            except Exception:  # an unusual node: nothing kept
                continue
            if self.kept + snap.nbytes > BUDGET:
                continue
            self.kept += snap.nbytes
            self.snaps.append((path, call_id, snap, nr - start))
        if self.snaps and self.snaps[-1][1] == call_id:
            size = sum(t.numel() * t.element_size() for _, t in iter_tensors((args, kwargs), ""))
            if self.kept + size <= BUDGET:
                self.kept += size
                self.inputs[call_id] = (args, kwargs)
        # a large graph walked that far with none: not walked again either (its cost)
        self.risky[path] = found
