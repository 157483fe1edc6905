"""What differs between the PyTorch versions nanwatch supports (``torch>=2.1``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

#: Whether dynamo is tracing the caller. Dynamo constant-folds this call, so a hook that
#: returns early on it leaves nothing of nanwatch in a compiled graph (and no graph break).
#: ``torch.compiler.is_compiling`` came in 2.3; before it, ``torch._dynamo.is_compiling``.
compiling: Callable[[], bool] = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (
    lambda: bool(getattr(torch, "_dynamo", None) and torch._dynamo.is_compiling())
)


def set_versions(tensors: list[torch.Tensor], versions: list[int]) -> None:
    """Set autograd's version counters of ``tensors`` back to ``versions``, where this torch
    can (the private setter takes sequences in recent torch, one tensor in older ones)."""
    setter = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)
    if setter is None or not tensors:
        return
    try:
        setter(tuple(tensors), tuple(versions))
    except TypeError:
        with contextlib.suppress(TypeError, RuntimeError):
            for t, v in zip(tensors, versions, strict=True):
                setter(t, v)
    except RuntimeError:
        pass


def register_optimizer_step_pre_hook(hook: Callable[..., None]) -> Any:
    """``torch.optim.optimizer.register_optimizer_step_pre_hook`` (every optimizer's
    ``step``), or None where this torch has no such global hook."""
    try:
        from torch.optim.optimizer import register_optimizer_step_pre_hook as register
    except ImportError:
        return None
    return register(hook)
