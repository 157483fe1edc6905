"""Walking the tensors inside a module's inputs and outputs, whatever their structure."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.distributions import Distribution


def iter_tensors(
    obj: Any,
    prefix: str,
    *,
    on_opaque: Callable[[type], None] | None = None,
    max_depth: int = 6,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(role, tensor)`` for every tensor in ``obj``: tensors, tuples, lists, dicts
    (``ModelOutput``-style dict subclasses included), dataclasses and namedtuples
    (``PackedSequence`` among them), ``torch.distributions`` objects (their parameters).
    Generators and iterators are never consumed; any other
    object is reported once through ``on_opaque`` and skipped."""
    return _walk(obj, prefix, 0, (set(), on_opaque, max_depth))


#: what :func:`_walk` carries down: the ids seen, the opaque-type callback, the depth limit
_How = tuple[set[int], Callable[[type], None] | None, int]


def _walk(o: Any, role: str, depth: int, how: _How) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`iter_tensors`' recursion, at module level: a nested function that calls
    itself is a reference cycle (the function and its closure cell) that only the garbage
    collector frees, and one a module call made the collector run several times a training
    step (issue 8)."""
    if isinstance(o, torch.Tensor):
        yield role, o
        return
    if o is None or isinstance(o, (str, bytes, int, float, bool, complex)):
        return
    seen, on_opaque, max_depth = how
    if depth >= max_depth or id(o) in seen:
        return
    if isinstance(o, Mapping):
        seen.add(id(o))
        attr_style = type(o) is not dict
        for k, v in list(o.items()):
            sub = f"{role}.{k}" if attr_style and isinstance(k, str) else f"{role}[{k!r}]"
            yield from _walk(v, sub, depth + 1, how)
        return
    if isinstance(o, tuple) and hasattr(o, "_fields"):  # namedtuple, PackedSequence
        seen.add(id(o))
        for name, v in zip(o._fields, o, strict=False):
            yield from _walk(v, f"{role}.{name}", depth + 1, how)
        return
    if isinstance(o, (tuple, list)):
        seen.add(id(o))
        for i, v in enumerate(o):
            yield from _walk(v, f"{role}[{i}]", depth + 1, how)
        return
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        seen.add(id(o))
        for f in dataclasses.fields(o):
            yield from _walk(getattr(o, f.name, None), f"{role}.{f.name}", depth + 1, how)
        return
    if isinstance(o, (set, frozenset, torch.dtype, torch.device, torch.Size)):
        return
    if isinstance(o, Distribution):
        seen.add(id(o))
        for name, v in _distribution_parts(o):
            yield from _walk(v, f"{role}.{name}", depth + 1, how)
        return
    if callable(o) or isinstance(o, torch.nn.Module) or _kv_cache(type(o)):
        return
    if on_opaque is not None:
        on_opaque(type(o))


def _kv_cache(typ: type) -> bool:
    """A key/value cache passed between attention layers (transformers' ``Cache``:
    ``DynamicCache``, ``EncoderDecoderCache``, ...): its tensors are what the attention's
    key and value projections returned, recorded there, so it is skipped without a warning
    (found by its class, without importing transformers)."""
    return any(
        c.__module__.startswith("transformers.") and c.__name__.endswith("Cache")
        for c in typ.__mro__
    )


def _distribution_parts(d: Distribution) -> Iterator[tuple[str, Any]]:
    """The parameters of a ``torch.distributions`` object (``loc``, ``scale``; ``probs`` or
    ``logits``, whichever it was given), and the distributions it is built from
    (``MixtureSameFamily``'s, ``Independent``'s ``base_dist``). Read from the instance's
    own attributes only: a lazy parameter (``probs`` of one given ``logits``) is not
    computed."""
    own = vars(d)
    try:
        names = list(d.arg_constraints)
    except NotImplementedError:  # a subclass that declares none
        names = []
    for name in names:
        v = own.get(name)
        if isinstance(v, torch.Tensor):
            yield name, v
    for name, v in own.items():
        if isinstance(v, Distribution):
            public = name.lstrip("_")  # MixtureSameFamily's property over _mixture_distribution
            yield (public if isinstance(getattr(type(d), public, None), property) else name), v


def leaves(obj: Any) -> list[Any]:
    """The leaves of an op's arguments or results, in ``tree_flatten``'s order: lists,
    tuples, dicts, namedtuples and ``torch.return_types`` are walked, anything else is a
    leaf (a tensor, a number, a ``torch.Size``, which ``tree_flatten`` splits into its ints: the
    callers read only the tensors). ``torch.utils._pytree.tree_flatten``
    recurses through a nested function, a reference cycle left for the garbage collector
    on every call: the op checker flattens every op's arguments, and those cycles made
    the collector run several times a step.

    >>> leaves(([1, (2, 3)], {"a": 4}))
    [1, 2, 3, 4]
    """
    out: list[Any] = []
    _leaves_into(obj, out)
    return out


def _leaves_into(obj: Any, out: list[Any]) -> None:
    kind = type(obj)
    if kind is list or kind is tuple:
        for x in obj:
            _leaves_into(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _leaves_into(x, out)
    elif isinstance(obj, tuple) and (hasattr(obj, "_fields") or hasattr(kind, "n_fields")):
        for x in obj:  # a namedtuple, a torch.return_types structseq
            _leaves_into(x, out)
    else:
        out.append(obj)
