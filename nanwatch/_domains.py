"""The real domains of aten ops, from their math: where ``acos``, ``atanh``, ``erfinv``,
``logit``, ``lgamma``, the logs, ... are defined, and what they return outside.

One table for both sides: the op checker counts an op's input values outside its domain
when the op makes a NaN or inf (:mod:`nanwatch.ops`), and the rules word it
(:mod:`nanwatch.rules.domain`). Plain data, no torch.

Example:
    >>> d = domain_of("aten.acos.default")
    >>> d.interval, d.outside_of(1.0000001), d.outside_of(1.0)
    ('[-1, 1]', True, False)
    >>> domain_of("aten.arctanh_.default").name, domain_of("aten.special_psi.default").name
    ('atanh', 'digamma')
    >>> domain_of("aten.exp.default") is None
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Domain:
    """Where a function of one restricted argument is real and finite.

    ``[lo, hi]`` is the closed interval outside which the op returns NaN; an endpoint in
    ``edges`` is itself a pole (``atanh(1) = inf``); ``poles`` marks functions with poles at
    every non-positive integer (lgamma, digamma, polygamma).
    """

    name: str  #: the function as users write it: ``acos``
    arg: str  #: the schema name of the restricted argument (``other`` for xlogy's log)
    lo: float = -math.inf
    hi: float = math.inf
    #: endpoints that are poles: ``"lo"``, ``"hi"`` (the op returns ±inf there)
    edges: frozenset[str] = frozenset()
    poles: bool = False
    #: the family that explains it: ``"log"`` (NW110 speaks for the logs), or ``""``
    family: str = ""
    #: what the endpoints give, in words (``"±inf at ±1"``)
    at_edges: str = ""
    #: the derivative is infinite at the closed endpoints (acos, asin, acosh)
    steep_edges: bool = False
    #: the derivative, in words (``-1/sqrt(1 - x²)``)
    slope: str = ""
    #: what the op returns at its steep endpoints (acos: 0 at 1, π at -1): an output that
    #: holds them was given an endpoint, where the gradient is infinite
    edge_outputs: tuple[float, ...] = ()

    @property
    def interval(self) -> str:
        """``[-1, 1]``, ``(-1, 1)``, ``(0, inf)``, ``x != 0, -1, -2, ...``."""
        if self.poles:
            return "all x except 0, -1, -2, ..."
        left = "(" if "lo" in self.edges or math.isinf(self.lo) else "["
        right = ")" if "hi" in self.edges or math.isinf(self.hi) else "]"
        return f"{left}{_num(self.lo)}, {_num(self.hi)}{right}"

    def outside_of(self, x: float) -> bool:
        """Whether ``x`` gives NaN or ±inf (outside the interval, on a pole edge, a pole)."""
        if math.isnan(x):
            return False
        if x < self.lo or x > self.hi:
            return True
        if (x == self.lo and "lo" in self.edges) or (x == self.hi and "hi" in self.edges):
            return True
        return self.poles and x <= 0 and float(x).is_integer()

    def safe_bounds(self, eps: float) -> tuple[float | None, float | None]:
        """``(lo + eps, hi - eps)`` scaled to the endpoint (``None`` for an open side): the
        clamp that keeps the op and its gradient finite."""
        lo = None if math.isinf(self.lo) else self.lo + eps * max(1.0, abs(self.lo))
        hi = None if math.isinf(self.hi) else self.hi - eps * max(1.0, abs(self.hi))
        return lo, hi


def _num(x: float) -> str:
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return str(int(x)) if float(x).is_integer() else str(x)


_BOTH = frozenset({"lo", "hi"})
_LO = frozenset({"lo"})

_TABLE: dict[str, Domain] = {
    d.name: d
    for d in (
        Domain(
            "acos",
            "self",
            lo=-1.0,
            hi=1.0,
            steep_edges=True,
            slope="-1/sqrt(1 - x²)",
            edge_outputs=(0.0, math.pi),
        ),
        Domain(
            "asin",
            "self",
            lo=-1.0,
            hi=1.0,
            steep_edges=True,
            slope="1/sqrt(1 - x²)",
            edge_outputs=(-math.pi / 2, math.pi / 2),
        ),
        Domain(
            "acosh", "self", lo=1.0, steep_edges=True, slope="1/sqrt(x² - 1)", edge_outputs=(0.0,)
        ),
        Domain(
            "atanh",
            "self",
            lo=-1.0,
            hi=1.0,
            edges=_BOTH,
            at_edges="±inf at ±1",
            slope="1/(1 - x²)",
        ),
        Domain(
            "erfinv",
            "self",
            lo=-1.0,
            hi=1.0,
            edges=_BOTH,
            at_edges="±inf at ±1",
            slope="sqrt(π)/2 · exp(erfinv(x)²)",
        ),
        Domain("logit", "self", lo=0.0, hi=1.0, edges=_BOTH, at_edges="-inf at 0, +inf at 1"),
        Domain("ndtri", "self", lo=0.0, hi=1.0, edges=_BOTH, at_edges="-inf at 0, +inf at 1"),
        Domain("lgamma", "self", poles=True, at_edges="+inf at the poles"),
        Domain("digamma", "self", poles=True, at_edges="-inf at 0, NaN at -1, -2, ..."),
        Domain("polygamma", "self", poles=True, at_edges="inf or NaN at the poles"),
        Domain("log", "self", lo=0.0, edges=_LO, family="log", at_edges="-inf at 0"),
        Domain("log2", "self", lo=0.0, edges=_LO, family="log", at_edges="-inf at 0"),
        Domain("log10", "self", lo=0.0, edges=_LO, family="log", at_edges="-inf at 0"),
        Domain("log1p", "self", lo=-1.0, edges=_LO, family="log", at_edges="-inf at -1"),
        Domain("xlogy", "other", lo=0.0, edges=_LO, family="log", at_edges="-inf at 0"),
        Domain(
            "xlog1py",
            "other",
            lo=-1.0,
            edges=_LO,
            family="log",
            at_edges="-inf at -1",
        ),
        Domain("entr", "self", lo=0.0, family="log", at_edges="-inf below 0"),
    )
}

#: aten names that are the same function
_ALIASES = {
    "arccos": "acos",
    "arcsin": "asin",
    "arccosh": "acosh",
    "arctanh": "atanh",
    "special_erfinv": "erfinv",
    "special_logit": "logit",
    "special_ndtri": "ndtri",
    "special_gammaln": "lgamma",
    "special_psi": "digamma",
    "special_digamma": "digamma",
    "special_polygamma": "polygamma",
    "special_xlogy": "xlogy",
    "special_xlog1py": "xlog1py",
    "special_entr": "entr",
}


def function_name(op: str) -> str:
    """``aten.arctanh_.default`` -> ``atanh``; ``aten.div.Tensor`` -> ``div``."""
    parts = op.split(".")
    name = parts[1] if len(parts) > 1 and parts[0] == "aten" else parts[0]
    name = name.rstrip("_")
    return _ALIASES.get(name, name)


def domain_of(op: str) -> Domain | None:
    """The restricted domain of an aten op (``aten.acos.default``, ``aten.acos``, ``acos``),
    or None when it is defined everywhere (or not in the table)."""
    return _TABLE.get(function_name(op))


def domains() -> list[Domain]:
    """Every function of the table (for the catalog)."""
    return list(_TABLE.values())
