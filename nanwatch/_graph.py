"""A small, plain-data digest of the autograd graph just below a tensor: the node names,
the dtype each node's forward result had, and which nodes feed which. Read at the forward
hook, host-side (no saved tensor is unpacked, nothing syncs), so that rules, which see
records and never tensors, can tell how a low-precision output was computed: a float16
product or quotient by a statistic of its input (a variance, a root mean square, a norm)
taken in float16, or one taken in float32 and cast back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: the products and quotients whose operands a digest is taken of: a normalization's last
#: op (``x / sqrt(var + eps)``, ``x * rsqrt(ms + eps)``, ``w * y``)
PRODUCTS = frozenset({"MulBackward0", "DivBackward0"})

#: nodes of a reduction: one value of many (a statistic of the tensor below it)
REDUCTIONS = frozenset(
    {
        "MeanBackward0", "MeanBackward1", "SumBackward0", "SumBackward1",
        "LinalgVectorNormBackward0", "NormBackward0", "NormBackward1", "NormBackward2",
        "NormBackward3", "VarBackward0", "VarMeanBackward0", "StdBackward0",
        "StdMeanBackward0",
    }
)  # fmt: skip


def _dtype(node: Any) -> str | None:
    """The dtype of the forward result ``node`` is the backward of (autograd keeps its
    metadata for the gradient it receives)."""
    try:
        return str(node._input_metadata[0].dtype).removeprefix("torch.")
    except Exception:  # no metadata on this node type, or a torch without it
        return None


def _exponent(node: Any, nexts: tuple[Any, ...]) -> float | None:
    """A power's exponent: ``PowBackward0``'s own, 2 for a product of a tensor with itself
    (``d * d``); None for other nodes."""
    name = node.name()
    if name == "PowBackward0":
        try:
            e = node._saved_exponent
        except Exception:
            return None
        return float(e) if isinstance(e, (int, float)) and not isinstance(e, bool) else None
    if name == "MulBackward0" and len(nexts) == 2 and nexts[0][0] is not None:
        (a, i), (b, j) = nexts
        return 2.0 if a is b and i == j else None
    return None


def digest(
    fn: Any, dtype: str, *, limit: int = 24, stop: Callable[[Any], bool] | None = None
) -> list[dict[str, Any]] | None:
    """The nodes below ``fn`` (the ``grad_fn`` of a module's output of ``dtype``), breadth
    first, at most ``limit`` of them; each ``{"op": name, "dtype": its result's dtype,
    "next": [the index of the node each operand was computed from, by position; None for
    one with no graph], "exponent": a power's}``, the first
    being ``fn``. A node for which ``stop`` is true (another watched module's output) is
    listed but not descended into.

    None unless ``fn`` is a product or quotient (``PRODUCTS``) of ``dtype``; [] when no
    reduction (``REDUCTIONS``) lies within the walk: nothing was scaled by a statistic.

    >>> import torch
    >>> x = torch.randn(2, 8, requires_grad=True)
    >>> y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    >>> [n["op"] for n in digest(y.grad_fn, "float32")]  # doctest: +NORMALIZE_WHITESPACE
    ['MulBackward0', 'torch::autograd::AccumulateGrad', 'RsqrtBackward0', 'AddBackward0',
     'MeanBackward1', 'PowBackward0']
    >>> digest(x.exp().grad_fn, "float32") is None
    True
    """
    try:
        if fn is None or fn.name() not in PRODUCTS or _dtype(fn) != dtype:
            return None
    except Exception:  # a node whose name torch refuses (a freed custom Function's)
        return None
    index: dict[int, int] = {id(fn): 0}
    held: list[Any] = [fn]  # held, so that ids are not reused by other nodes meanwhile
    out: list[dict[str, Any]] = []
    reduced = False
    at = 0
    while at < len(held):
        node = held[at]
        at += 1
        try:
            name = node.name()
            nexts = tuple(node.next_functions)
        except Exception:
            name, nexts = type(node).__name__, ()
        entry: dict[str, Any] = {"op": name, "dtype": _dtype(node), "next": []}
        e = _exponent(node, nexts) if nexts else None
        if e is not None:
            entry["exponent"] = e
        out.append(entry)
        reduced = reduced or name in REDUCTIONS
        if len(out) > 1 and stop is not None and stop(node):
            continue
        for child, _ in nexts:
            if child is not None and id(child) not in index and len(held) < limit:
                index[id(child)] = len(held)
                held.append(child)
            # by position: None for an operand with no graph (a batch, a number), or past
            # the limit
            entry["next"].append(None if child is None else index.get(id(child)))
    return out if reduced else []
