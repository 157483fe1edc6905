"""nanwatch: find where and why a PyTorch model's numbers went wrong.

Example:
    >>> import torch, nanwatch
    >>> model = torch.nn.Linear(4, 2)
    >>> with nanwatch.watch(model) as nw:
    ...     _ = model(torch.randn(3, 4))
    >>> nw.first_anomaly is None
    True
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from nanwatch.config import Thresholds, WatchConfig
from nanwatch.errors import AnomalyError, ConfigError, NanwatchError, ReportFormatError
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
from nanwatch.rules import Diagnosis, Rule, RuleContext, rule
from nanwatch.watcher import Watcher, watch, watch_all

try:
    __version__ = version("nanwatch")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0+unknown"

__all__ = [
    "Anomaly",
    "AnomalyError",
    "AnomalyKind",
    "Call",
    "ConfigError",
    "Diagnosis",
    "NanwatchError",
    "Note",
    "OpEvent",
    "Phase",
    "Record",
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
