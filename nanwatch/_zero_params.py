"""Exact zeros a log was given, traced back to the watched parameters they came from.

A log's input is exactly 0 wherever a factor of a product is (``rate = gain * softplus(z)``
with ``gain`` at 0): the autograd graph below the log says which leaves reach it through
ops that keep an operand's zeros (a product, a numerator, a view), and the leaves that are
watched parameters holding exact zeros are the source. What wrote a parameter to exactly
0 between two steps (a projection, ``gain.data.clamp_(min=0)``) is looked for in the
source of the function that ran ``backward()`` and in an optimizer's own ``step()``.
Anomaly-time work only: the parameters are read.
"""

from __future__ import annotations

import linecache
import re
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from nanwatch import ops
from nanwatch._frames import describe_line, is_internal

#: autograd nodes (base names) whose output is exactly 0 where an input is (a product of
#: any operand; a quotient's numerator, see _FIRST_ONLY; a view or copy of it)
_KEEPS_ZEROS = frozenset(
    {
        "Mul", "Div", "Expand", "View", "UnsafeView", "Reshape", "Clone", "Unsqueeze",
        "Squeeze", "Permute", "Transpose", "T", "Select", "Slice", "Index", "Repeat", "Cat",
        "Stack", "ToCopy", "Neg", "Abs", "AsStrided",
    }
)  # fmt: skip
#: of these, the nodes whose first input alone carries its zeros on (``a / b``: ``a``)
_FIRST_ONLY = frozenset({"Div"})
#: the logs whose input is followed
_LOGS = frozenset({"Log", "Log2", "Log10"})
#: graph nodes looked at, in all
_LIMIT = 512


def _base(node: Any) -> str:
    return re.sub(r"Backward\d*$", "", ops.name_of(node))


def _sources(node: Any, depth: int = 16) -> Iterator[tuple[Any, list[str]]]:
    """The leaves (their AccumulateGrad nodes) below ``node``'s first input that reach it
    through :data:`_KEEPS_ZEROS` nodes alone, with the ops on the way, nearest first."""
    nxt = getattr(node, "next_functions", ()) or ()
    stack: list[tuple[Any, list[str]]] = [(n, []) for n, _ in nxt[:1] if n is not None]
    seen: set[int] = set()
    while stack:
        cur, via = stack.pop()
        if id(cur) in seen or len(via) > depth:
            continue
        seen.add(id(cur))
        if ops.accumulates_grad(cur):
            yield cur, via
            continue
        base = _base(cur)
        if base not in _KEEPS_ZEROS:
            continue
        inputs = getattr(cur, "next_functions", ()) or ()
        if base in _FIRST_ONLY:
            inputs = inputs[:1]
        stack.extend((n, [*via, base.lower()]) for n, _ in inputs if n is not None)


def zero_params(fn: Any, params: Mapping[int, str]) -> list[dict[str, Any]]:
    """For each log of the autograd graph below ``fn`` (a loss's ``grad_fn``), the watched
    parameters (``params``: qualified names by ``id``) that hold exact zeros and reach the
    log's input through ops that keep them: ``node`` (the log's), ``parameter``, ``zeros``,
    ``numel``, ``via`` (the ops between, nearest the log first) and ``tensor`` (the
    parameter, for the caller to look at; not kept in a note). Reads the parameters."""
    out: list[dict[str, Any]] = []
    seen: set[tuple[int, int]] = set()
    walk = ops.GraphWalk([fn], prune=ops.accumulates_grad, limit=_LIMIT)
    for node in walk:
        if _base(node) not in _LOGS:
            continue
        for leaf, via in _sources(node):
            p = getattr(leaf, "variable", None)
            q = params.get(id(p)) if isinstance(p, torch.Tensor) else None
            if q is None or p is None or (id(node), id(p)) in seen:
                continue
            seen.add((id(node), id(p)))
            with torch.no_grad():
                zeros = int((p.detach() == 0).sum())
            if zeros:
                out.append(
                    {
                        "node": ops.name_of(node),
                        "parameter": q,
                        "zeros": zeros,
                        "numel": p.numel(),
                        "via": via,
                        "tensor": p,
                    }
                )
    return out


#: an in-place method call on a name (``gain.data.clamp_(``, ``w[m].zero_(``)
_IN_PLACE = r"(?:\.data)?(?:\[[^\]\n]*\])?\.(?!requires_grad_\b|share_memory_\b)\w+_\("
#: the in-place ops that set values exactly (a projection's bound, a fill): what an
#: optimizer's own step() does to its weights after the update, found without their names
_SETS_EXACTLY = re.compile(
    r"\.(?:clamp|clamp_min|clamp_max|clip|relu|threshold|fill|zero|masked_fill|copy)_\("
)


def _described(filename: str, lineno: int) -> tuple[str, str] | None:
    """:func:`describe_line` without the line's trailing comment."""
    where, text = describe_line(filename, lineno)
    if text is None:
        return None
    return where, re.sub(r"\s*#[^'\"]*$", "", text)


def _lines(code: types.CodeType, *, whole: bool = False) -> Iterator[tuple[int, str]]:
    """The line numbers and texts of ``code``'s source (a module's, or with ``whole``:
    the whole file)."""
    lines = linecache.getlines(code.co_filename)
    if not lines:
        return
    if whole or code.co_name == "<module>":
        first, last = 1, len(lines)
    else:
        numbers = [n for _, _, n in code.co_lines() if n is not None]
        if not numbers:
            return
        first, last = min(code.co_firstlineno, *numbers), max(numbers)
    for n in range(first, min(last, len(lines)) + 1):
        yield n, lines[n - 1]


def writing_statement(
    leaf: str, code: types.CodeType | None, *, whole: bool = False, moved: bool | None = None
) -> tuple[str, str] | None:
    """The statement of ``code`` (with ``whole``: of its file, a helper the loop calls) that
    writes a parameter named ``leaf`` in place (``model.gain.data.clamp_(min=0.0)``,
    ``gain.data = ...``): (``file.py:42``, its text); None when none does. Of several, the
    first whose kind fits ``moved`` (the parameter's version moved on since the update: a
    write through ``.data`` moves none, one under no_grad does), else the first."""
    if code is None or is_internal(code.co_filename):
        return None
    name = re.escape(leaf)
    pat = re.compile(rf"(?<![\w])(?:\w+\.)*{name}(?:{_IN_PLACE}|\.data(?:\[[^\]\n]*\])?\s*=(?!=))")
    hits = [n for n, text in _lines(code, whole=whole) if pat.search(text.split("#", 1)[0])]
    if not hits:
        return None
    if moved is not None:
        lines = linecache.getlines(code.co_filename)
        fits = [n for n in hits if (f"{leaf}.data" not in lines[n - 1]) == moved]
        hits = fits or hits
    return _described(code.co_filename, hits[0])


def own_step(optimizer: Any) -> tuple[str, types.CodeType] | None:
    """The ``step`` of ``optimizer``'s class when it is the user's code (a subclass of a
    torch optimizer that projects its weights after ``super().step()``): (``Class.step``,
    its code); None when torch's or a library's."""
    for cls in type(optimizer).__mro__:
        fn = cls.__dict__.get("step")
        if fn is None:
            continue
        fn = getattr(fn, "__wrapped__", fn)
        code = getattr(fn, "__code__", None)
        if not isinstance(code, types.CodeType) or is_internal(code.co_filename):
            return None
        return f"{cls.__name__}.step", code
    return None


def step_statement(code: types.CodeType) -> tuple[str, str] | None:
    """The first statement of a user's optimizer ``step`` (``code``) that sets its weights'
    values exactly in place (``p.clamp_(min=0.0)``): (``file.py:42``, its text)."""
    for n, text in _lines(code):
        if _SETS_EXACTLY.search(text.split("#", 1)[0]):
            return _described(code.co_filename, n)
    return None


def writer_of(
    leaf: str, frame_code: types.CodeType | None, optimizer: Any, *, moved: bool
) -> dict[str, Any]:
    """Where a parameter named ``leaf`` found at exactly 0 was written, as note data: the
    statement of ``frame_code`` (the code that ran ``backward()``) that writes it in place
    (``write_source``, ``write_code``); else, unless its version ``moved`` on since the
    update (then no step of the optimizer wrote it), a user-defined ``step`` of
    ``optimizer`` (the one that last updated it) and its statement that sets values
    exactly (``own_step``, ``write_source``, ``write_code``); else such a statement of
    ``frame_code``'s file. Empty when none is found."""
    found = writing_statement(leaf, frame_code, moved=moved)
    if found is not None:
        return {"write_source": found[0], "write_code": found[1]}
    own = own_step(optimizer) if optimizer is not None and not moved else None
    if own is not None:
        data: dict[str, Any] = {"own_step": own[0]}
        found = step_statement(own[1])
        if found is not None:
            data.update(write_source=found[0], write_code=found[1])
        return data
    found = writing_statement(leaf, frame_code, whole=True, moved=moved)
    if found is not None:  # elsewhere in that file: a helper the loop calls, likely
        return {"write_source": found[0], "write_code": found[1], "write_in_file": True}
    return {}


def version_moved(
    param: torch.Tensor, tables: tuple[Mapping[int, tuple[str, int, int]], ...]
) -> tuple[str | None, bool]:
    """The optimizer (by class name) that last updated ``param`` (the watcher's
    ``_stepped`` tables, newest first: (name, group, version after the update)), and
    whether ``param`` was written in place since (its version moved on)."""
    for table in tables:
        entry = table.get(id(param))
        if entry is not None and entry[2] != -1:
            return entry[0], param._version != entry[2]
    return None, False


def note_data(
    found: dict[str, Any],
    *,
    frame_code: types.CodeType | None,
    stepped: tuple[Mapping[int, tuple[str, int, int]], ...],
    optimizer_of: Callable[[torch.Tensor], Any],
) -> dict[str, Any]:
    """The ``"zero_param"`` note's data for one of :func:`zero_params`' finds."""
    p = found["tensor"]
    name, moved = version_moved(p, stepped)
    data = {k: v for k, v in found.items() if k != "tensor"}
    data.update(dtype=str(p.dtype).removeprefix("torch."), optimizer=name, written_after=moved)
    leaf = str(found["parameter"]).rsplit(".", 1)[-1]
    data.update(writer_of(leaf, frame_code, optimizer_of(p), moved=moved))
    return data
