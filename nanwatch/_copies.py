"""Copies of a watched model carry none of nanwatch's hooks.

``copy.deepcopy(model)`` (an EMA or teacher model), ``torch.save(model)`` and
``pickle.dumps(model)`` all take a module's state from ``nn.Module.__getstate__``, which
returns its ``__dict__``: its hook dictionaries included. Without this, pickling a watched
model failed (the hooks are closures), and a deep copy kept hooks that recorded the copy's
calls as the watched model's, after the watcher was detached too.

While nanwatch owns at least one module hook, ``nn.Module.__getstate__`` is wrapped so the
state it returns leaves those hooks out (new dictionaries: the live module keeps its hooks).
The copy and the saved file hold plain ``OrderedDict``s of the user's own hooks: loading
needs no nanwatch. The wrapper goes with the last hook. A class with a ``__getstate__`` of
its own that does not call ``super()`` is not covered.

``torch.jit.script(model)`` compiles every forward hook and pre-hook it finds on the model's
modules; nanwatch's are Python closures TorchScript cannot compile (and must not: the
scripted copy is the user's). While nanwatch owns hooks,
``torch.jit._recursive.create_script_module`` is wrapped so nanwatch's hooks are out of the
modules' hook dictionaries while it runs (the same dictionaries are put back after it, in
their order): the scripted module carries the user's hooks alone.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["hide", "sweep", "unhide"]

#: the module hook dictionaries (id -> hook) and the id-keyed flags that go with them
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_FLAG_DICTS = (
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)

_ids: set[int] = set()
_lock = threading.Lock()
#: what ``nn.Module`` had as its own ``__getstate__`` before the wrapper (None: nothing)
_original: list[Callable[..., Any] | None] = []
#: ``torch.jit._recursive.create_script_module`` before the wrapper
_script_original: list[Callable[..., Any]] = []


def _strip(state: dict[str, Any]) -> dict[str, Any]:
    ids = _ids
    found = False
    for name in _HOOK_DICTS:
        d = state.get(name)
        if d and not ids.isdisjoint(d):
            state[name] = OrderedDict((k, v) for k, v in d.items() if k not in ids)
            found = True
    if found:
        for name in _FLAG_DICTS:
            d = state.get(name)
            if d and not ids.isdisjoint(d):
                state[name] = OrderedDict((k, v) for k, v in d.items() if k not in ids)
    return state


def _getstate(self: nn.Module) -> Any:
    original = _original[0] if _original else None
    state = original(self) if original is not None else self.__dict__.copy()
    if not isinstance(state, dict):
        return state
    return _strip(state.copy() if state is self.__dict__ else state)


_getstate._nanwatch_tap = True  # type: ignore[attr-defined]


def _create_script_module(nn_module: Any, *args: Any, **kwargs: Any) -> Any:
    original = _script_original[0] if _script_original else _recursive().create_script_module
    ids = _ids
    if not ids or not isinstance(nn_module, nn.Module):
        return original(nn_module, *args, **kwargs)
    saved: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for m in nn_module.modules():
            state = m.__dict__
            for name in (*_HOOK_DICTS, *_FLAG_DICTS):
                d = state.get(name)
                if d and not ids.isdisjoint(d):
                    saved.append((state, name, d))
                    state[name] = OrderedDict((k, v) for k, v in d.items() if k not in ids)
        return original(nn_module, *args, **kwargs)
    finally:
        for state, name, d in reversed(saved):
            state[name] = d


_create_script_module._nanwatch_tap = True  # type: ignore[attr-defined]


def _recursive() -> Any:
    return torch.jit._recursive


def hide(ids: Iterable[int]) -> None:
    """Leave the hooks with these handle ids out of every module's pickled or copied state."""
    with _lock:
        _ids.update(ids)
        if _ids and not _original:
            _original.append(vars(nn.Module).get("__getstate__"))
            nn.Module.__getstate__ = _getstate  # type: ignore[method-assign]
            rec = _recursive()
            _script_original.append(rec.create_script_module)
            rec.create_script_module = _create_script_module


def unhide(ids: Iterable[int]) -> None:
    """The hooks with these ids were removed; the wrapper goes with the last one."""
    with _lock:
        _ids.difference_update(ids)
        if _ids or not _original:
            return
        original = _original.pop()
        if _script_original:
            rec = _recursive()
            script = _script_original.pop()
            if getattr(rec.create_script_module, "_nanwatch_tap", False):
                rec.create_script_module = script
        if getattr(vars(nn.Module).get("__getstate__"), "_nanwatch_tap", False):
            if original is None:
                del nn.Module.__getstate__
            else:
                nn.Module.__getstate__ = original  # type: ignore[method-assign]


def sweep(modules: Iterable[nn.Module], hooks: Sequence[Callable[..., Any]]) -> None:
    """Remove ``hooks`` (functions nanwatch registered, whose handles are already removed)
    from the modules' hook dictionaries where they are still found under other ids: torch
    registers a replaced module's forward hooks again on its replacement (torch.ao's
    ``swap_module`` in ``prepare_qat`` and ``convert``, ``fuse_modules``, the sparsifier),
    handles nanwatch never saw. Entries whose id belongs to a live nanwatch handle (another
    watcher's, sharing a hook function) stay."""
    wanted = {id(f) for f in hooks}
    with _lock:
        keep = set(_ids)
    for m in modules:
        state = m.__dict__
        for name in ("_forward_pre_hooks", "_forward_hooks"):
            d = state.get(name)
            if not d:
                continue
            stale = [k for k, v in d.items() if id(v) in wanted and k not in keep]
            for k in stale:
                del d[k]
                for flags in _FLAG_DICTS:
                    f = state.get(flags)
                    if f is not None:
                        f.pop(k, None)
