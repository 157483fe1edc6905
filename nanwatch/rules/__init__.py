"""Diagnoses: the rule engine and the catalog. Importing this package registers the
built-in rule families; users add theirs with :func:`rule`.

Every module of this package is a rule *family* and registers itself by existing: it is
imported here automatically (``pkgutil``), except the engine (``base``), the catalog, the
trace builder for tests (``testing``) and private modules (``_name``). Code ranges:

* ``NW1xx`` numerics: overflow and headroom, math outside its domain (log, division, sqrt,
  acos, ...), means and variances over too few elements
* ``NW2xx`` losses: saturation, activation/loss pairing, ignore_index logits
* ``NW3xx`` gradients, weights, optimizer and loss scaler
* ``NW4xx`` data, masking, autograd, runtime
* ``NW5xx`` guard failures (checks of loss inputs before the kernel)
* ``NW9xx`` and above: free for your own rules

Example:
    >>> from nanwatch.rules import REGISTRY
    >>> REGISTRY["NW111"].title
    'Division by zero'
"""

from __future__ import annotations

import importlib
import pkgutil
import warnings

from nanwatch.rules.base import (
    REGISTRY,
    SEVERITIES,
    Diagnosis,
    Rule,
    RuleContext,
    Severity,
    catalog,
    evaluate,
    rule,
    sort_key,
)

__all__ = [
    "FAILED_FAMILIES",
    "REGISTRY",
    "SEVERITIES",
    "Diagnosis",
    "Rule",
    "RuleContext",
    "Severity",
    "catalog",
    "evaluate",
    "family_modules",
    "rule",
    "sort_key",
]

#: modules of this package that are not rule families
_NOT_FAMILIES = frozenset({"base", "catalog", "testing"})

#: family modules that failed to import: (module name, error). Their rules are off; the
#: test suite asserts this stays empty.
FAILED_FAMILIES: list[tuple[str, str]] = []


def family_modules() -> list[str]:
    """Names of the rule family modules of this package, sorted.

    >>> {"overflow", "losses", "gradients"} <= set(family_modules())
    True
    """
    return sorted(
        m.name
        for m in pkgutil.iter_modules(__path__)
        if not m.name.startswith("_") and m.name not in _NOT_FAMILIES and not m.ispkg
    )


def _import_families() -> None:
    for name in family_modules():
        try:
            importlib.import_module(f"{__name__}.{name}")
        except Exception as exc:  # one broken family must not take the others down
            FAILED_FAMILIES.append((name, f"{type(exc).__name__}: {exc}"))
            warnings.warn(
                f"nanwatch: the rule family nanwatch.rules.{name} failed to import "
                f"({type(exc).__name__}: {exc}); its diagnoses are off.",
                RuntimeWarning,
                stacklevel=2,
            )


_import_families()
