"""Sums over weights in the loss code: a hand-written penalty (``sum((p ** 2).sum() for p in
model.parameters())``) whose reduction ran in a short-range dtype (float16).

A full ``sum()`` of an elementwise power, a self-product or an absolute value of a leaf
parameter is read from the loss's autograd graph; the sum it made is computed again in
float64 from the parameter's values, so a sum past the dtype's largest value (65504 for
float16) is told even where no op was traced. Anomaly-time work only: the parameters are
read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from nanwatch import ops

#: graph nodes looked at, in all
_LIMIT = 512


def _base(node: Any) -> str:
    return re.sub(r"Backward\d*$", "", ops.name_of(node))


def _leaf(node: Any) -> Any:
    """The AccumulateGrad node ``node``'s inputs all come from, or None."""
    live = [n for n, _ in getattr(node, "next_functions", ()) or () if n is not None]
    if not live or any(n is not live[0] for n in live) or not ops.accumulates_grad(live[0]):
        return None
    return live[0]


def _term(node: Any) -> tuple[str, torch.Tensor, float] | None:
    """``node`` (what a full sum was given) as ``(form, parameter, exponent)``: ``p ** k``
    (``pow``), ``p * p`` (``mul``) or ``p.abs()`` (``abs``) of one leaf parameter."""
    base = _base(node)
    leaf = _leaf(node)
    if leaf is None:
        return None
    p = getattr(leaf, "variable", None)
    if not isinstance(p, torch.Tensor) or not p.is_floating_point():
        return None
    if base == "Pow":
        k = ops._saved(node, "_saved_exponent")
        if isinstance(k, bool) or not isinstance(k, (int, float)) or k <= 0:
            return None
        return "pow", p, float(k)
    if base == "Mul" and len(getattr(node, "next_functions", ()) or ()) == 2:
        return "mul", p, 2.0
    if base == "Abs":
        return "abs", p, 1.0
    return None


def weight_sums(fn: Any, params: Mapping[int, str]) -> list[dict[str, Any]]:
    """For each full ``sum()`` of the graph below ``fn`` (a loss's ``grad_fn``) taken of a
    power, a self-product or an absolute value of a watched parameter (``params``:
    qualified names by ``id``) of a dtype narrower in range than float32: ``parameter``,
    ``form`` (``pow``, ``mul``, ``abs``), ``exponent``, ``dtype``, ``numel``, ``largest``
    (its largest |value|) and ``value`` (the sum, computed in float64). Reads the
    parameters."""
    top = torch.finfo(torch.float32).max
    out: list[dict[str, Any]] = []
    seen: set[int] = set()
    for node in ops.GraphWalk([fn], prune=ops.accumulates_grad, limit=_LIMIT):
        if ops.name_of(node) != "SumBackward0":
            continue
        inner = next((n for n, _ in getattr(node, "next_functions", ()) or () if n), None)
        term = _term(inner) if inner is not None else None
        if term is None:
            continue
        form, p, k = term
        if id(p) in seen or id(p) not in params or torch.finfo(p.dtype).max >= top:
            continue
        seen.add(id(p))
        with torch.no_grad():
            x = p.detach().double().abs()
            value = float(x.pow(k).sum())
            largest = float(x.max()) if x.numel() else 0.0
        out.append(
            {
                "parameter": params[id(p)],
                "form": form,
                "exponent": k,
                "dtype": str(p.dtype).removeprefix("torch."),
                "numel": int(p.numel()),
                "largest": largest,
                "value": value,
            }
        )
    return out
