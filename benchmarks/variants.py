"""The ways a step is run: unwatched, under nanwatch, under the tools people use today.

A :class:`Runner` is attached before a block of steps and detached after it, both outside
the timed region; :meth:`Runner.step` runs one training step (and, for nanwatch, ends it
with ``nw.step()``). A workload is anything with ``step()``, ``modules()`` and ``model``
(``workloads.Workload``, ``gpu.DecoderWorkload``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

import nanwatch

__all__ = [
    "LEAKS",
    "MAIN",
    "NANWATCH_MODES",
    "VARIANTS",
    "DebugUnderflowOverflow",
    "DetectAnomaly",
    "Nanwatch",
    "Runner",
    "Unwatched",
    "make_runners",
]


#: the real ``torch.autograd.backward``, taken before any watcher can wrap it
_REAL_BACKWARD = torch.autograd.backward
#: and ``torch.autograd.grad``
_REAL_GRAD = torch.autograd.grad
#: global state a variant left changed after ``detach()``: what, and which variant. The
#: harness puts it back (so that the next variant, the unwatched baseline included, is not
#: measured with it) and reports it: it is a bug of the tool that left it.
LEAKS: dict[str, str] = {}


def _check_clean(key: str) -> None:
    """After a detach: nothing global may stay changed; restore what can be restored."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if torch.autograd.backward is not _REAL_BACKWARD:
        LEAKS.setdefault("torch.autograd.backward was left wrapped after detach()", key)
        torch.autograd.backward = _REAL_BACKWARD
    if torch.autograd.grad is not _REAL_GRAD:
        LEAKS.setdefault("torch.autograd.grad was left wrapped after detach()", key)
        torch.autograd.grad = _REAL_GRAD
    if torch.is_anomaly_enabled():
        LEAKS.setdefault("anomaly mode was left enabled after detach()", key)
        torch.autograd.set_detect_anomaly(False)
    if _get_current_dispatch_mode_stack():
        LEAKS.setdefault("a TorchDispatchMode was left active after detach()", key)
    if torch.overrides._get_current_function_mode_stack():
        LEAKS.setdefault("a TorchFunctionMode was left active after detach()", key)
    mm = torch.nn.modules.module
    if mm._global_forward_hooks or mm._global_forward_pre_hooks:
        LEAKS.setdefault("global module hooks were left registered after detach()", key)


class Runner:
    """One way of running the step. ``attach``/``detach`` are never timed."""

    key = ""
    label = ""
    #: the variant this one's ratio is taken against
    baseline = "unwatched"
    #: run the workload's functional-loss step (``F.cross_entropy``) instead
    functional = False
    sample_every = 1

    def unavailable(self) -> str | None:
        """Why this variant cannot run here (None: it can)."""
        return None

    def attach(self, w: Any) -> None:
        pass

    def step(self, w: Any) -> bool:
        """One training step; returns whether it was a full (not sampled-out) step."""
        w.step()
        return True

    def detach(self) -> None:
        pass


class Unwatched(Runner):
    def __init__(
        self, key: str = "unwatched", label: str = "unwatched", *, functional: bool = False
    ) -> None:
        self.key, self.label, self.functional = key, label, functional
        if functional:
            self.baseline = "f-unwatched"


class Nanwatch(Runner):
    """A nanwatch Watcher, created once per workload (so ``sample_every`` counts steps
    across rounds, and the flight recorder fills as in a real run) and attached for each
    block of steps. ``modules``: what to watch (default: the workload's ``modules()``)."""

    def __init__(
        self,
        key: str,
        label: str,
        *,
        mode: str,
        sample_every: int = 1,
        guards: bool = True,
        functional_guards: bool = True,
        functional: bool = False,
        on_anomaly: str = "raise",
        modules: Any = None,
    ) -> None:
        self.key, self.label = key, label
        self.mode = mode
        self.sample_every = sample_every
        self.guards = guards
        self.functional_guards = functional_guards
        self.functional = functional
        self.on_anomaly = on_anomaly
        self.modules = modules
        if functional:
            self.baseline = "f-unwatched"
        self.nw: nanwatch.Watcher | None = None

    def fresh(self) -> Nanwatch:
        """The same variant with a new (empty) Watcher."""
        return Nanwatch(
            self.key,
            self.label,
            mode=self.mode,
            sample_every=self.sample_every,
            guards=self.guards,
            functional_guards=self.functional_guards,
            functional=self.functional,
            on_anomaly=self.on_anomaly,
            modules=self.modules,
        )

    def attach(self, w: Any) -> None:
        if self.nw is None:
            modules = self.modules if self.modules is not None else w.modules()
            self.nw = nanwatch.watch(
                *modules,
                mode=self.mode,
                sample_every=self.sample_every,
                guards=self.guards,
                functional_guards=self.functional_guards,
                on_anomaly=self.on_anomaly,
                scaler=getattr(w, "scaler", None),
            )
        self.nw.attach()

    def step(self, w: Any) -> bool:
        assert self.nw is not None, "attach() first"
        w.step()
        return self.nw.step().full

    def detach(self) -> None:
        if self.nw is not None:
            self.nw.detach()
        _check_clean(self.key)


class DetectAnomaly(Runner):
    key = "detect_anomaly"
    label = "torch detect_anomaly(check_nan=True)"

    def __init__(self) -> None:
        self._cm: Any = None

    def attach(self, w: Any) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled..."
            self._cm = torch.autograd.detect_anomaly(check_nan=True)
            self._cm.__enter__()

    def detach(self) -> None:
        if self._cm is not None:
            cm, self._cm = self._cm, None
            cm.__exit__(None, None, None)
        _check_clean(self.key)


class DebugUnderflowOverflow(Runner):
    """transformers' DebugUnderflowOverflow on the model. It keeps no handles (it registers a
    bound method on every module), so detaching removes the hooks bound to this instance."""

    key = "duo"
    label = "transformers DebugUnderflowOverflow"

    def __init__(self) -> None:
        self._duo: Any = None
        self._model: torch.nn.Module | None = None

    def unavailable(self) -> str | None:
        try:
            import transformers.debug_utils  # noqa: F401
        except Exception as exc:  # ImportError, or a broken install
            return f"transformers is not installed ({type(exc).__name__}); pip install transformers"
        return None

    def attach(self, w: Any) -> None:
        from transformers.debug_utils import DebugUnderflowOverflow as DUO

        self._model = w.model
        self._duo = DUO(w.model)

    def detach(self) -> None:
        duo, self._duo = self._duo, None
        if duo is None or self._model is None:
            return
        for m in self._model.modules():
            for k, fn in list(m._forward_hooks.items()):
                if getattr(fn, "__self__", None) is duo:
                    del m._forward_hooks[k]
                    m._forward_hooks_with_kwargs.pop(k, None)
                    m._forward_hooks_always_called.pop(k, None)


def make_runners() -> dict[str, Runner]:
    """Fresh runners of every CPU variant, by key, in table order."""
    rs: list[Runner] = [
        Unwatched(),
        Nanwatch("sentinel", "nanwatch sentinel", mode="sentinel"),
        Nanwatch("watch", "nanwatch watch", mode="watch"),
        Nanwatch("watch-every10", "nanwatch watch, sample_every=10", mode="watch",
                 sample_every=10),
        Nanwatch("forensic", "nanwatch forensic", mode="forensic"),
        DetectAnomaly(),
        DebugUnderflowOverflow(),
        Nanwatch("sentinel-noguards", "nanwatch sentinel, guards=False", mode="sentinel",
                 guards=False),
        Unwatched("f-unwatched", "functional loss: unwatched", functional=True),
        Nanwatch("f-watch", "functional loss: watch, functional_guards=False", mode="watch",
                 functional_guards=False, functional=True),
        Nanwatch("f-watch-fguards", "functional loss: watch (functional guards on: the default)",
                 mode="watch", functional_guards=True, functional=True),
    ]  # fmt: skip
    return {r.key: r for r in rs}


VARIANTS: tuple[str, ...] = tuple(make_runners())
MAIN = ("unwatched", "sentinel", "watch", "watch-every10", "forensic", "detect_anomaly", "duo")
NANWATCH_MODES = ("sentinel", "watch", "watch-every10", "forensic")
