"""Checks of loss inputs before the loss kernel runs. (Interim: completed by the guards
issue.)"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from nanwatch.watcher import Watcher


def attach(watcher: Watcher, loss_modules: Sequence[tuple[nn.Module, str]]) -> list[Any]:
    """Register a forward pre-hook on each loss module; returns the handles."""
    return []


class FunctionalGuards:
    """Guards functional losses (``F.cross_entropy``) while active."""

    def __init__(self, watcher: Watcher) -> None:
        self.watcher = watcher

    def __enter__(self) -> FunctionalGuards:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None
