"""A pytest plugin: the accelerator path of :mod:`tests._accelerator_path` with a GPU that is
always behind the host, as in a step the GPU bounds (a large batch): the forward's
statistics have never landed when ``backward()`` begins, so nothing is read there, and
everything is read before the optimizer's update or at the step's end -- after backward
freed what the loss code saved.

    python -m pytest -p tests._gpu_bound

CI runs it after the accelerator-path pass (.ci/run). Marks, on top of that plugin's:
``landed_only`` (a test of the read made when backward begins: skipped here),
``gpu_bound_weaker`` (a known weaker diagnosis when nothing has landed: expected to fail,
strictly). ``accelerator_weaker`` tests are expected to fail here too, not strictly."""

from __future__ import annotations

from typing import Any

import pytest

import tests._accelerator_path as _path
from nanwatch.stats import HostRead

_path_ready = HostRead.ready


def _never_landed(self: HostRead) -> bool:
    return False


HostRead.ready = _never_landed  # type: ignore[method-assign]


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    for item in items:
        mark = item.get_closest_marker("cpu_path") or item.get_closest_marker("landed_only")
        if mark is not None:
            item.add_marker(pytest.mark.skip(reason=f"not this path's: {_path._reason(mark)}"))
        mark = item.get_closest_marker("accelerator_weaker")
        if mark is not None:
            item.add_marker(pytest.mark.xfail(strict=False, reason=_path._reason(mark)))
        mark = item.get_closest_marker("gpu_bound_weaker")
        if mark is not None:
            item.add_marker(pytest.mark.xfail(strict=True, reason=_path._reason(mark)))
