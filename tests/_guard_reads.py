"""Counting what the guards read: one entry per ``_Probe.read`` (the keys it read
together) and every host sync a guard's own code causes outside that read (on the CPU the
read takes its few values one ``.item()`` at a time, cheaper than a stack there)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanwatch import guards

#: aten ops that bring a device value to the host
_SYNCS = (
    torch.ops.aten._local_scalar_dense,
    torch.ops.aten.nonzero,
    torch.ops.aten._unique2,
    torch.ops.aten.is_nonzero,
)


def count_reads_and_syncs(monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[str]], list[str]]:
    """Patch the guards so that each read appends its keys to the first list and each
    host sync inside a guard (outside its one read too) appends the op to the second."""
    # the one read an accelerator makes: on the CPU some ranges are read as computed
    monkeypatch.setattr(guards, "_CPU_READS_NOW", False)
    reads: list[list[str]] = []
    syncs: list[str] = []
    real_read = guards._Probe.read
    real_guard = guards._guard

    reading = [False]

    def counting_read(self: guards._Probe) -> None:
        reads.append(list(self._keys))
        reading[0] = True
        try:
            real_read(self)
        finally:
            reading[0] = False

    class SyncCounter(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if func.overloadpacket in _SYNCS and not reading[0]:
                syncs.append(str(func))
            return func(*args, **(kwargs or {}))

    def counted_guard(*args: Any, **kwargs: Any) -> None:
        with SyncCounter():
            real_guard(*args, **kwargs)

    monkeypatch.setattr(guards._Probe, "read", counting_read)
    monkeypatch.setattr(guards, "_guard", counted_guard)
    return reads, syncs
