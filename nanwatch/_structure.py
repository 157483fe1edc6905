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
    seen: set[int] = set()

    def walk(o: Any, role: str, depth: int) -> Iterator[tuple[str, torch.Tensor]]:
        if isinstance(o, torch.Tensor):
            yield role, o
            return
        if o is None or isinstance(o, (str, bytes, int, float, bool, complex)):
            return
        if depth >= max_depth or id(o) in seen:
            return
        if isinstance(o, Mapping):
            seen.add(id(o))
            attr_style = type(o) is not dict
            for k, v in list(o.items()):
                sub = f"{role}.{k}" if attr_style and isinstance(k, str) else f"{role}[{k!r}]"
                yield from walk(v, sub, depth + 1)
            return
        if isinstance(o, tuple) and hasattr(o, "_fields"):  # namedtuple, PackedSequence
            seen.add(id(o))
            for name, v in zip(o._fields, o, strict=False):
                yield from walk(v, f"{role}.{name}", depth + 1)
            return
        if isinstance(o, (tuple, list)):
            seen.add(id(o))
            for i, v in enumerate(o):
                yield from walk(v, f"{role}[{i}]", depth + 1)
            return
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            seen.add(id(o))
            for f in dataclasses.fields(o):
                yield from walk(getattr(o, f.name, None), f"{role}.{f.name}", depth + 1)
            return
        if isinstance(o, (set, frozenset, torch.dtype, torch.device, torch.Size)):
            return
        if isinstance(o, Distribution):
            seen.add(id(o))
            for name, v in _distribution_parts(o):
                yield from walk(v, f"{role}.{name}", depth + 1)
            return
        if callable(o) or isinstance(o, torch.nn.Module) or _kv_cache(type(o)):
            return
        if on_opaque is not None:
            on_opaque(type(o))

    yield from walk(obj, prefix, 0)


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
