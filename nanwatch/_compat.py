"""What differs between the PyTorch versions nanwatch supports (``torch>=2.1``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

#: Whether dynamo is tracing the caller. Dynamo constant-folds this call, so a hook that
#: returns early on it leaves nothing of nanwatch in a compiled graph (and no graph break).
#: ``torch.compiler.is_compiling`` came in 2.3; before it, ``torch._dynamo.is_compiling``.
compiling: Callable[[], bool] = getattr(
    getattr(torch, "compiler", None), "is_compiling", None
) or (lambda: bool(getattr(torch, "_dynamo", None) and torch._dynamo.is_compiling()))
