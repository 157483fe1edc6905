"""Diagnoses: the rule engine and the catalog. Importing this package registers the
built-in rule families; users add theirs with :func:`rule`."""

from __future__ import annotations

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
    "REGISTRY",
    "SEVERITIES",
    "Diagnosis",
    "Rule",
    "RuleContext",
    "Severity",
    "catalog",
    "evaluate",
    "rule",
    "sort_key",
]
