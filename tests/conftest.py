"""Shared fixtures. The autouse fixture fails any test that leaves a nanwatch hook behind."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.modules.module as module_mod
import torch.optim.optimizer as optim_mod
import torch.utils.hooks as torch_hooks

import nanwatch
from nanwatch.watcher import _grad_scaler_classes

_PKG_DIRS = (
    os.path.dirname(nanwatch.__file__) + os.sep,
    str(Path(__file__).resolve().parent.parent / "callbacks") + os.sep,
)
_SCENARIO_DIR = os.path.join(os.path.dirname(nanwatch.__file__), "scenarios") + os.sep
_GLOBAL_DICTS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


_OPTIM_DICTS = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")


def _created_by_nanwatch() -> bool:
    f: Any = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(_PKG_DIRS) and not name.startswith(_SCENARIO_DIR):
            return True
        if not name.startswith(os.path.dirname(torch.__file__)):
            return False
        f = f.f_back
    return False


@pytest.fixture(autouse=True)
def no_hooks_left_behind(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every RemovableHandle nanwatch creates during a test must be removed by its end, the
    global module hooks must be as they were, and no dispatch mode or anomaly mode may
    stay switched on."""
    ours: list[torch_hooks.RemovableHandle] = []
    original_init = torch_hooks.RemovableHandle.__init__

    def tracking_init(self: torch_hooks.RemovableHandle, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if _created_by_nanwatch():
            ours.append(self)

    monkeypatch.setattr(torch_hooks.RemovableHandle, "__init__", tracking_init)
    before = {name: dict(getattr(module_mod, name)) for name in _GLOBAL_DICTS}
    anomaly_before = torch.is_anomaly_enabled()
    backward_before = torch.autograd.backward
    grad_before = torch.autograd.grad
    scale_before = {cls: vars(cls)["scale"] for cls in _grad_scaler_classes()}
    functional_before = dict(vars(torch.nn.functional))
    optim_before = {name: dict(getattr(optim_mod, name)) for name in _OPTIM_DICTS}
    getstate_before = vars(torch.nn.Module).get("__getstate__")
    clip_before = torch.nn.utils.clip_grad_norm_
    yield
    leaked = []
    for h in ours:
        d = h.hooks_dict_ref()
        if d is not None and h.id in d:
            leaked.append(d[h.id])
    after = {name: dict(getattr(module_mod, name)) for name in _GLOBAL_DICTS}
    assert not leaked, f"nanwatch left {len(leaked)} hook(s) attached: {leaked[:3]}"
    assert after == before, "global module hooks changed during the test"
    optim_after = {name: dict(getattr(optim_mod, name)) for name in _OPTIM_DICTS}
    assert optim_after == optim_before, "global optimizer hooks changed during the test"
    assert torch.nn.utils.clip_grad_norm_ is clip_before, "clip_grad_norm_ left wrapped"
    assert torch.is_anomaly_enabled() == anomaly_before, "anomaly mode left switched"
    assert torch.autograd.backward is backward_before, "torch.autograd.backward left wrapped"
    assert torch.autograd.grad is grad_before, "torch.autograd.grad left wrapped"
    scale_after = {cls: vars(cls)["scale"] for cls in scale_before}
    assert scale_after == scale_before, "GradScaler.scale left wrapped"
    getstate_after = vars(torch.nn.Module).get("__getstate__")
    assert getstate_after is getstate_before, "nn.Module.__getstate__ left wrapped"
    changed = [
        k
        for k, v in vars(torch.nn.functional).items()
        # a warning issued from the module (torch 2.4's kl_div) adds Python's own registry
        if functional_before.get(k) is not v and k != "__warningregistry__"
    ]
    assert not changed, f"torch.nn.functional left changed: {changed[:5]}"
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    assert not _get_current_dispatch_mode_stack(), "a dispatch mode was left active"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _isolated_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs in its own empty directory: a report written to the default
    ./nanwatch-reports/ never lands in the repository."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def deferred(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every watcher the test attaches takes the accelerator path (statistics read late),
    driven on the CPU: tests of that path use it, as ``tests/_accelerator_path.py`` does for
    the whole suite."""
    from nanwatch.watcher import Watcher

    attach = Watcher.attach

    def on_device(self: Watcher) -> Watcher:
        self._defer_cpu = True
        return attach(self)

    monkeypatch.setattr(Watcher, "attach", on_device)


@pytest.fixture
def report_dir(tmp_path: Path) -> Path:
    d = tmp_path / "reports"
    return d


def pytest_configure(config: pytest.Config) -> None:
    warnings.filterwarnings("default", category=RuntimeWarning, module="nanwatch")
