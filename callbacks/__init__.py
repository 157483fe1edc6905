"""Framework callbacks. ``from nanwatch.callbacks import NanWatchCallback`` gives the
Lightning callback for the namespace this program imported (``lightning.pytorch`` when both
or neither are imported and it is installed, else ``pytorch_lightning``); for a namespace
explicitly, ``NanWatchCallback.for_namespace("pytorch_lightning")``,
``nanwatch.callbacks.pytorch_lightning.NanWatchCallback`` or
``nanwatch.callbacks.lightning.NanWatchCallback`` (``lightning.pytorch``). Lightning is
imported on first use; without it, ``ModuleNotFoundError`` names the ``pip install`` line.

Example:
    >>> from nanwatch.callbacks import NanWatchCallback                     # doctest: +SKIP
    >>> trainer = Trainer(callbacks=[NanWatchCallback(on_anomaly="stop")])  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .lightning import PIP_INSTALL, callback_class, default_namespace, step_metrics

__all__ = ["PIP_INSTALL", "NanWatchCallback", "callback_class", "default_namespace", "step_metrics"]

if TYPE_CHECKING:
    from .lightning import NanWatchCallback as NanWatchCallback
else:

    def __getattr__(name: str) -> Any:
        if name == "NanWatchCallback":
            return callback_class()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted([*globals(), "NanWatchCallback"])
