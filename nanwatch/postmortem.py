"""Crash capture: classify the exception, write the report, survive a dead GPU.

(Interim: ``classify`` is final; ``capture`` and the signal handlers are completed by the
reports issue.)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanwatch.watcher import Watcher

#: (class, how to recognize it in the exception's type name and message)
_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cuda-device-assert", ("device-side assert",)),
    ("out-of-memory", ("OutOfMemoryError", "out of memory", "CUDA out of memory")),
    ("cuda-error", ("CUDA error", "AcceleratorError", "cuDNN error", "CUBLAS_STATUS")),
    ("autograd-inplace", ("modified by an inplace operation",)),
    ("anomaly", ("AnomalyError",)),
    ("guard", ("GuardError",)),
    (
        "shape-mismatch",
        (
            "size mismatch",
            "shapes cannot be multiplied",
            "must match the size",
            "mat1 and mat2 shapes",
            "Expected input batch_size",
            "doesn't match the broadcast shape",
            "size of tensor a",
        ),
    ),
    (
        "device-mismatch",
        (
            "Expected all tensors to be on the same device",
            "is on a different device",
            "device type",
        ),
    ),
    (
        "dtype-error",
        (
            "expected scalar type",
            "Expected object of scalar type",
            "should be the same",
            "dtype",
            "not implemented for",
        ),
    ),
    ("keyboard-interrupt", ("KeyboardInterrupt",)),
)


def classify(exc: BaseException) -> dict[str, Any]:
    """What kind of failure ``exc`` is, from its type and message only (no device access).

    Example:
        >>> classify(RuntimeError("CUDA error: device-side assert triggered"))["class"]
        'cuda-device-assert'
    """
    name = type(exc).__name__
    message = str(exc)
    text = f"{name}: {message}"
    cls = "other"
    for candidate, needles in _CLASSES:
        if any(n in text for n in needles):
            cls = candidate
            break
    return {
        "class": cls,
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": message[:4000],
        "device_lost": cls in ("cuda-device-assert", "cuda-error"),
    }


def capture(watcher: Watcher, exc: BaseException) -> Path | None:
    """Write the post-mortem report for ``exc``; never raises."""
    return None


def install_signal_handlers(watcher: Watcher) -> Callable[[], None]:
    """Install SIGTERM handling for the watcher's lifetime; returns the undo function."""
    return lambda: None
