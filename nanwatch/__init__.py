"""nanwatch: find where and why a PyTorch model's numbers went wrong.

The public names load on first use (PEP 562), so ``nanwatch --help`` and
``nanwatch report run.json`` start without importing torch.

Example:
    >>> import torch, nanwatch
    >>> model = torch.nn.Linear(4, 2)
    >>> with nanwatch.watch(model) as nw:
    ...     _ = model(torch.randn(3, 4))
    >>> nw.first_anomaly is None
    True
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("nanwatch")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0+unknown"

if TYPE_CHECKING:
    from nanwatch.config import Thresholds, WatchConfig
    from nanwatch.errors import (
        AnomalyError,
        ConfigError,
        GuardError,
        NanwatchError,
        NanwatchWarning,
        ReportFormatError,
    )
    from nanwatch.records import (
        Anomaly,
        AnomalyKind,
        Call,
        Note,
        OpEvent,
        Phase,
        Record,
        StepTrace,
        TensorStat,
    )
    from nanwatch.report import Report
    from nanwatch.rules import Diagnosis, Rule, RuleContext, rule
    from nanwatch.watcher import Watcher, watch, watch_all

_LAZY: dict[str, str] = {
    "Thresholds": "nanwatch.config",
    "WatchConfig": "nanwatch.config",
    "AnomalyError": "nanwatch.errors",
    "ConfigError": "nanwatch.errors",
    "GuardError": "nanwatch.errors",
    "NanwatchError": "nanwatch.errors",
    "NanwatchWarning": "nanwatch.errors",
    "ReportFormatError": "nanwatch.errors",
    "Anomaly": "nanwatch.records",
    "AnomalyKind": "nanwatch.records",
    "Call": "nanwatch.records",
    "Note": "nanwatch.records",
    "OpEvent": "nanwatch.records",
    "Phase": "nanwatch.records",
    "Record": "nanwatch.records",
    "StepTrace": "nanwatch.records",
    "TensorStat": "nanwatch.records",
    "Report": "nanwatch.report",
    "Diagnosis": "nanwatch.rules",
    "Rule": "nanwatch.rules",
    "RuleContext": "nanwatch.rules",
    "rule": "nanwatch.rules",
    "Watcher": "nanwatch.watcher",
    "watch": "nanwatch.watcher",
    "watch_all": "nanwatch.watcher",
}

__all__ = [
    "Anomaly",
    "AnomalyError",
    "AnomalyKind",
    "Call",
    "ConfigError",
    "Diagnosis",
    "GuardError",
    "NanwatchError",
    "NanwatchWarning",
    "Note",
    "OpEvent",
    "Phase",
    "Record",
    "Report",
    "ReportFormatError",
    "Rule",
    "RuleContext",
    "StepTrace",
    "TensorStat",
    "Thresholds",
    "WatchConfig",
    "Watcher",
    "__version__",
    "rule",
    "watch",
    "watch_all",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        if name in (
            "scenarios",
            "stats",
            "ops",
            "localize",
            "guards",
            "postmortem",
            "render",
            "report",
            "records",
            "rules",
            "config",
            "errors",
            "cli",
            "callbacks",
        ):
            return importlib.import_module(f"nanwatch.{name}")
        raise AttributeError(f"module 'nanwatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
