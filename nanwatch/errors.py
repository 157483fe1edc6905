"""The exceptions nanwatch raises. One base class, attributes a program can read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanwatch.records import Anomaly


class NanwatchError(Exception):
    """Base class of every error nanwatch raises on purpose."""


NanwatchError.__module__ = "nanwatch"


class ConfigError(NanwatchError, ValueError):
    """A bad argument to :func:`nanwatch.watch` or :class:`nanwatch.WatchConfig`.

    ``.name`` is the argument, ``.value`` the value that was given.
    """

    def __init__(self, name: str, value: Any, message: str) -> None:
        super().__init__(message)
        self.name = name
        self.value = value


ConfigError.__module__ = "nanwatch"


class AnomalyError(NanwatchError):
    """Raised by ``on_anomaly="raise"`` at the point an anomaly is known.

    ``.anomaly`` is the localized :class:`~nanwatch.Anomaly` (or ``None`` when an
    error-severity diagnosis fired without a non-finite value), ``.diagnoses`` the
    diagnoses of that step, ``.diagnosis`` the top one, ``.module`` the module path.
    """

    def __init__(
        self, message: str, *, anomaly: Anomaly | None, diagnoses: list[Any] | None = None
    ) -> None:
        super().__init__(message)
        self.anomaly = anomaly
        self.diagnoses = list(diagnoses or [])

    @property
    def diagnosis(self) -> Any:
        return self.diagnoses[0] if self.diagnoses else None

    @property
    def module(self) -> str | None:
        if self.anomaly is not None:
            return self.anomaly.path
        d = self.diagnosis
        return getattr(d, "path", None) if d is not None else None


AnomalyError.__module__ = "nanwatch"


class ReportFormatError(NanwatchError, ValueError):
    """A saved report that this version of nanwatch cannot read."""


ReportFormatError.__module__ = "nanwatch"
