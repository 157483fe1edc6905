"""Where a framework's training loop is -- the epoch and the batch of the Lightning Trainer
that runs the step -- found without importing the framework: for ``nanwatch run``, whose
script holds the Trainer (the Lightning callback is given its own). Only a framework the
program imported already is looked for, and only up the calling frames; nothing is read
from a tensor."""

from __future__ import annotations

import sys
import weakref
from typing import Any

#: the Lightning namespaces, each with its own Trainer class
_NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


def _trainer_classes() -> tuple[type, ...]:
    out = []
    for ns in _NAMESPACES:
        cls = getattr(sys.modules.get(ns), "Trainer", None)
        if isinstance(cls, type):
            out.append(cls)
    return tuple(out)


def _position(trainer: Any) -> tuple[int, int] | None:
    """The epoch and batch index of the training batch ``trainer`` runs; None while it does
    not train (its sanity check, a validation, ``trainer.test``)."""
    try:
        if not trainer.training or trainer.sanity_checking:
            return None
        return int(trainer.current_epoch), int(trainer.fit_loop.epoch_loop.batch_idx)
    except Exception:  # another version's loop: no position rather than a fault
        return None


def _running(trainer: Any) -> bool:
    return str(getattr(getattr(trainer.state, "status", None), "value", "")) == "running"


class TrainerProbe:
    """Finds the running Trainer once, up the frames of a module call (Lightning's
    ``Trainer.fit`` frames hold it as ``self``), and keeps it weakly."""

    def __init__(self) -> None:
        self._trainer: weakref.ref[Any] | None = None

    def trainer(self) -> Any | None:
        """The Trainer found last, while it lives."""
        return self._trainer() if self._trainer is not None else None

    def position(self, frame: Any) -> tuple[int, int] | None:
        """(epoch, batch index) of the Trainer training now, from ``frame`` up; None when
        no Trainer trains (or none of a Lightning the program imported)."""
        trainer = self.trainer()
        if trainer is not None and _running(trainer):
            return _position(trainer)
        classes = _trainer_classes()
        if not classes:
            return None
        f = frame
        while f is not None:
            obj = f.f_locals.get("self") if f.f_code.co_varnames[:1] == ("self",) else None
            if isinstance(obj, classes) and obj is not trainer:
                self._trainer = weakref.ref(obj)
                return _position(obj)
            f = f.f_back
        return None


def where(position: tuple[int, int] | None, step: int) -> str:
    """The words for a step's position in a training loop, as the Lightning callback says
    it: `` (epoch 2, batch 1)``; the epoch left out in the first, and nothing when the
    first epoch's batch index is the step.

    >>> where((2, 1), 9), where((0, 3), 5), where((0, 4), 4), where(None, 4)
    (' (epoch 2, batch 1)', ' (batch 3)', '', '')
    """
    if position is None:
        return ""
    epoch, batch = position
    if epoch:
        return f" (epoch {epoch}, batch {batch})"
    return f" (batch {batch})" if batch != step else ""


def scheduler_name(trainer: Any, optimizer: Any) -> tuple[Any, str] | None:
    """The lr scheduler ``trainer`` steps for ``optimizer`` (one ``configure_optimizers``
    returned), with the expression that reaches it; None when it holds none."""
    try:
        configs = list(getattr(trainer, "lr_scheduler_configs", None) or ())
    except Exception:
        return None
    for i, cfg in enumerate(configs):
        scheduler = getattr(cfg, "scheduler", None)
        if getattr(scheduler, "optimizer", None) is optimizer:
            return scheduler, f"trainer.lr_scheduler_configs[{i}].scheduler"
    return None
