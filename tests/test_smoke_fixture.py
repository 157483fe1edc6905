"""The leak fixture itself must catch a leak (a test that cannot fail is a defect)."""

from __future__ import annotations

import pytest
from torch import nn

import nanwatch
from tests import conftest


def test_fixture_catches_a_watcher_left_attached() -> None:
    mp = pytest.MonkeyPatch()
    gen = conftest.no_hooks_left_behind.__wrapped__(mp)  # type: ignore[attr-defined]
    try:
        next(gen)
        model = nn.Linear(2, 2)
        nw = nanwatch.watch(model).attach()
        # the module's pre- and post-hook, and the global optimizer-step pre- and post-hook
        with pytest.raises(AssertionError, match=r"left 4 hook.*_on_optimizer_step"):
            next(gen)
        nw.detach()
        assert not model._forward_hooks and not model._forward_pre_hooks
    finally:
        mp.undo()
