"""A pytest plugin: every Watcher takes the accelerator (CUDA) path on the CPU -- statistics
left "on the device" and read late (when backward begins if they have landed, before the
optimizer's update, at the step end) -- so the whole suite tells where that path
diagnoses differently from the CPU path, where each value is read as it is measured:

    python -m pytest -p tests._accelerator_path

Not part of the default run: some tests check CPU-only mechanics by design (a raise
inside the forward, reads made by hooks, counts of a tensor freed before a late read).
Stop 27: 266 failures at its start, 58 at its end (4a8da66). About 15 of those check
CPU-only mechanics or timing (test_hardening, test_hot_norms, test_clip_tap, a raise
expected inside the forward or backward); the rest are mostly a weaker diagnosis where a
value was freed before the late read (an output's NaN/inf counts, a node's saved values)."""

from __future__ import annotations

from typing import Any

import pytest

from nanwatch.watcher import Watcher

_attach = Watcher.attach


def _on_the_accelerator_path(self: Watcher) -> Watcher:
    self._defer_cpu = True
    return _attach(self)


Watcher.attach = _on_the_accelerator_path  # type: ignore[method-assign]


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Tests marked ``cpu_path`` check the CPU path's own mechanics (reads its hooks make,
    a raise inside the forward): skipped here. Tests marked ``accelerator_weaker`` get a
    weaker diagnosis on this path, a known gap: expected to fail (strictly: one that
    passes is a gap closed, and its mark must go)."""
    for item in items:
        mark = item.get_closest_marker("cpu_path")
        if mark is not None:
            item.add_marker(pytest.mark.skip(reason=f"the CPU path's own: {_reason(mark)}"))
        mark = item.get_closest_marker("accelerator_weaker")
        if mark is not None:
            item.add_marker(pytest.mark.xfail(strict=True, reason=_reason(mark)))


def _reason(mark: Any) -> str:
    return str(mark.kwargs.get("reason") or (mark.args[0] if mark.args else ""))
