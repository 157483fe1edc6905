"""``NanWatchCallback`` for the ``pytorch_lightning`` namespace (the package
``pip install "nanwatch[lightning]"`` installs). Importing this module imports
``pytorch_lightning``; without it, ``ModuleNotFoundError`` names the ``pip install`` line.

Example:
    >>> import pytorch_lightning as pl                                           # doctest: +SKIP
    >>> from nanwatch.callbacks.pytorch_lightning import NanWatchCallback        # doctest: +SKIP
    >>> pl.Trainer(callbacks=[NanWatchCallback(on_anomaly="skip")])              # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lightning import _NanWatch, callback_class

__all__ = ["NanWatchCallback"]

if TYPE_CHECKING:
    from pytorch_lightning.callbacks import Callback as _Callback

    class NanWatchCallback(_NanWatch, _Callback):
        """The callback for ``pytorch_lightning``."""

else:
    NanWatchCallback = callback_class("pytorch_lightning")
