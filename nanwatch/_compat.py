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


def capturing() -> bool:
    """A CUDA graph is being captured on the current stream (``torch.cuda.graph``, the
    CUDA graphs of ``torch.compile(mode="reduce-overhead")``): no host read may happen then,
    it would invalidate the capture. False without CUDA, at the cost of one check.

    >>> capturing()
    False
    """
    initialized: bool = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    return initialized and torch.cuda.is_current_stream_capturing()


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


def _register_optimizer_hook(name: str, hook: Callable[..., None]) -> Any:
    """``torch.optim.optimizer.<name>(hook)`` (a hook on every optimizer's ``step``), or
    None where this torch has no such global hook."""
    from torch.optim import optimizer

    register = getattr(optimizer, name, None)
    return register(hook) if register is not None else None


def register_optimizer_step_pre_hook(hook: Callable[..., None]) -> Any:
    """Before every optimizer's ``step``; None where this torch cannot."""
    return _register_optimizer_hook("register_optimizer_step_pre_hook", hook)


def register_optimizer_step_post_hook(hook: Callable[..., None]) -> Any:
    """After every optimizer's ``step``; None where this torch cannot."""
    return _register_optimizer_hook("register_optimizer_step_post_hook", hook)


def _make_fake_mode_active() -> Callable[[], bool]:
    """Whether a FakeTensorMode is active on this thread (torch.compile, export, meta-device
    initialisation): tensors hold no values then. One C call where torch keeps infra modes
    by key (2.2 and later); before that, a look at the Python dispatch-mode stack."""
    key = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None)
    get_mode = getattr(torch._C, "_get_dispatch_mode", None)
    if key is not None and get_mode is not None:
        return lambda: get_mode(key) is not None
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    def active() -> bool:
        return any(type(m).__name__ == "FakeTensorMode" for m in _get_current_dispatch_mode_stack())

    return active


fake_mode_active: Callable[[], bool] = _make_fake_mode_active()


def _make_transforming() -> Callable[[], bool]:
    """Whether a torch.func transform (``vmap``, ``grad``, ``jacrev``, ``hessian``) is
    running: its tensors are wrappers that refuse ``.item()`` and data-dependent reads, and
    what runs under it is a function of the model, not its training step."""
    functorch = getattr(torch._C, "_functorch", None)
    level = getattr(functorch, "maybe_current_level", None)
    if level is None:
        return lambda: False
    return lambda: level() is not None


transforming: Callable[[], bool] = _make_transforming()


def no_values() -> bool:
    """The hooks step aside: a FakeTensorMode (no values) or a torch.func transform."""
    return fake_mode_active() or transforming()


def _make_values_hidden() -> Callable[[], bool]:
    """:func:`no_values`, or ``torch.jit.trace`` recording every op (a read would become a
    constant of the traced graph), asked by every hook call: one Python call of three C
    checks where torch has them all, else the same checks through their helpers."""
    key = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None)
    get_mode = getattr(torch._C, "_get_dispatch_mode", None)
    level = getattr(getattr(torch._C, "_functorch", None), "maybe_current_level", None)
    jit = getattr(torch._C, "_is_tracing", None)
    if key is None or get_mode is None or level is None or jit is None:
        jit_tracing = jit or (lambda: False)
        return lambda: no_values() or bool(jit_tracing())

    def hidden() -> bool:
        return get_mode(key) is not None or level() is not None or bool(jit())

    return hidden


values_hidden: Callable[[], bool] = _make_values_hidden()


#: From this many values on, a CPU float32/float64 tensor is read with ``amin`` and
#: ``amax`` (two vectorized passes) rather than ``torch.aminmax`` (one slower pass): on
#: torch 2.13's CPU kernels, two threads, the pair takes 0.72x the time at 2**20 values and
#: 0.86x at 2**18, and more below 2**17 (dispatch). float16/bfloat16 stay on ``aminmax``,
#: 2.5x to 3.8x faster there. Both propagate NaN the same way. Measure again with
#: ``python benchmarks/hook_cost.py`` (its primitives table).
SPLIT_MINMAX_NUMEL = 1 << 18
_SPLIT_DTYPES = frozenset({torch.float32, torch.float64})


def _make_aminmax() -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``torch.aminmax`` itself where it takes every CPU float dtype; older torch (2.1) has
    no CPU kernel for float16 (nor, in some builds, bfloat16): those tensors are read in
    float32 there, which holds their values exactly. Large float32/float64 CPU tensors are
    read with ``amin`` and ``amax`` (see :data:`SPLIT_MINMAX_NUMEL`)."""
    missing = set()
    for dtype in (torch.float16, torch.bfloat16):
        try:
            torch.aminmax(torch.zeros(2, dtype=dtype))
        except RuntimeError:
            missing.add(dtype)

    def aminmax(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not t.is_contiguous():
            t = storage_order(t)
        if t.device.type == "cpu":
            if t.dtype in missing:
                return torch.aminmax(t.float())
            if t.dtype in _SPLIT_DTYPES and t.numel() >= SPLIT_MINMAX_NUMEL:
                return t.amin(), t.amax()
        return torch.aminmax(t)

    return aminmax


def storage_order(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor laid out in another order than its shape's (channels_last, a
    transpose) as a flat view of its values in memory order, for a reduction over all of
    them: on the CPU ``torch.aminmax`` reads a channels_last activation about 7x slower
    than the same values in order. Any other tensor (a slice, an expanded one) is returned
    as it is.

    >>> x = torch.arange(6.0).reshape(2, 3).t()
    >>> storage_order(x).tolist(), storage_order(x[::2]).shape
    ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], torch.Size([2, 2]))
    """
    if t.dim() < 2 or t.layout is not torch.strided:
        return t
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda d: strides[d], reverse=True)
    p = t.permute(order)
    return p.view(-1) if p.is_contiguous() else t


#: one pass giving min and max (NaN propagates); see :func:`_make_aminmax`
aminmax = _make_aminmax()


#: the device types whose autocast state a late replay restores (see :func:`autocast_state`)
_AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """The device types autocast is enabled for now, each with its dtype: host-side flags,
    no device work. ``torch.is_autocast_enabled(device_type)`` came in 2.4; before it, one
    function per device.

    >>> autocast_state()
    ()
    """
    out: list[tuple[str, torch.dtype]] = []
    for dev in _AUTOCAST_DEVICES:
        try:
            on = torch.is_autocast_enabled(dev)
            dtype = torch.get_autocast_dtype(dev)
        except RuntimeError:  # a device type this build does not know
            continue
        except (TypeError, AttributeError):  # torch < 2.4
            cpu = dev == "cpu"
            on = torch.is_autocast_cpu_enabled() if cpu else torch.is_autocast_enabled()
            dtype = torch.get_autocast_cpu_dtype() if cpu else torch.get_autocast_gpu_dtype()
        if on:
            out.append((dev, dtype))
    return tuple(out)


def function_modes() -> tuple[Any, ...]:
    """The TorchFunctionModes in force, innermost last: ``torch.set_default_device`` and a
    ``with torch.device(...)`` block are one (they say where new tensors are made), and so
    is a user's own mode. Host-side: one call when none is on the stack.

    >>> function_modes()
    ()
    """
    if not torch._C._len_torch_function_stack():
        return ()
    from torch.overrides import _get_current_function_mode_stack

    return tuple(_get_current_function_mode_stack())  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def as_called(modes: tuple[Any, ...] = ()) -> Any:
    """Run the block as the user's code ran: torch-function handling on (nanwatch's hooks
    turn it off for their own statistics), and ``modes`` (see :func:`function_modes`,
    taken as the replayed call began) in force again. A mode is out of the stack while its
    own handler runs: a hook inside ``loss.backward()`` under ``torch.set_default_device
    ("cuda")`` would otherwise make the replay's new tensors on the CPU."""
    enable = getattr(torch._C, "_EnableTorchFunction", None)
    with contextlib.ExitStack() as stack:
        if enable is not None:
            stack.enter_context(enable())
        if modes:
            present = {id(m) for m in function_modes()}
            for mode in modes:
                if id(mode) not in present:
                    stack.enter_context(mode)
        yield


@contextlib.contextmanager
def autocast_as(state: tuple[tuple[str, torch.dtype], ...]) -> Any:
    """Run the block under the autocast ``state`` (see :func:`autocast_state`) that a call
    began with, whatever autocast holds now: a replay after the call ended (the accelerator
    path) then makes what the call made, in the dtypes it made them."""
    enabled = dict(state)
    with contextlib.ExitStack() as stack:
        for dev in _AUTOCAST_DEVICES:
            if dev in enabled:
                stack.enter_context(torch.autocast(dev, dtype=enabled[dev]))
            elif dev in dict(autocast_state()):
                stack.enter_context(torch.autocast(dev, enabled=False))
        yield
