"""The two lines behind autograd's "modified by an inplace operation" error: the forward line
that made the tensor the error names (by its autograd node, shape and dtype) and the line
that then wrote it in place, found by running the model's forward once more under a
:class:`~torch.overrides.TorchFunctionMode` that watches each op's result and each in-place
write to what such a result holds. Error time only: nothing here runs on a healthy step.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from nanwatch import _frames

#: in-place dunders: ``y += r``, ``y[m] = 0``
_INPLACE_DUNDERS = frozenset(
    {
        "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
        "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
        "__imatmul__", "__setitem__",
    }
)  # fmt: skip


@dataclass
class Made:
    """A tensor the replay made that matches the error's description, where it was made,
    and the first in-place write that moved it past the version autograd saved."""

    tensor: torch.Tensor
    op: str
    at: str | None
    code: str | None
    module: torch.nn.Module | None = None
    writer: str | None = None
    written_at: str | None = None
    written_code: str | None = None
    written_in: torch.nn.Module | None = None
    mask: bool = False


def _name(func: Any) -> str:
    return str(getattr(func, "__name__", "op"))


def _node_base(name: str) -> str:
    return re.sub(r"Backward\d*$", "", name)


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The tensor ``func`` writes in place, or None: ``x.add_(r)``, ``torch.relu_(x)``,
    ``y += r``, ``y[m] = 0``, ``F.relu(x, inplace=True)``, ``torch.add(a, b, out=y)``."""
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor):
        return out
    name = _name(func)
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if name in _INPLACE_DUNDERS or kwargs.get("inplace") is True:
        return first
    if name.endswith("_") and not name.endswith("__"):
        return first
    return None


def _library_module() -> torch.nn.Module | None:
    """The innermost module whose library ``forward`` (``nn.ReLU``'s) runs the op being
    handled; None when the user's own code calls it (their line says it all)."""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        if not _frames.is_internal(f.f_code.co_filename):
            return None
        if f.f_code.co_name == "forward":
            owner = f.f_locals.get("self")
            if isinstance(owner, torch.nn.Module):
                return owner
        f = f.f_back
    return None


def _storage(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage().data_ptr())
    except Exception:  # a tensor with no storage (a tensor subclass, a sparse one)
        return None


class SavedTensorWatch(TorchFunctionMode):
    """Watches a forward for the tensor the error names: ``output`` of an autograd node
    called ``node`` (``SigmoidBackward0``), of ``shape`` and tensor type ``tensor_type``
    (``FloatTensor``), then written in place while at ``saved_version``. Each op's result
    is matched by its ``grad_fn``, so the forward runs with gradients on."""

    def __init__(
        self,
        node: str,
        output: int | None,
        shape: tuple[int, ...],
        tensor_type: str,
        saved_version: int,
    ) -> None:
        super().__init__()
        self.node = _node_base(node)
        self.output = output
        self.shape = shape
        self.tensor_type = tensor_type
        self.saved_version = saved_version
        self.made: list[Made] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        target = _written(func, args, kwargs)
        if target is not None and self.made:
            self._note_write(func, target, args)
        out = func(*args, **kwargs)
        if target is None:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and self._matches(t):
                    at, code = _frames.user_line()
                    self.made.append(Made(t, _name(func), at, code, _library_module()))
        return out

    def _matches(self, t: torch.Tensor) -> bool:
        fn = t.grad_fn
        if fn is None or tuple(t.shape) != self.shape:
            return False
        if self.output is not None and t.output_nr != self.output:
            return False
        return bool(
            _node_base(type(fn).__name__) == self.node and t.type().endswith(self.tensor_type)
        )

    def _note_write(self, func: Any, target: torch.Tensor, args: tuple[Any, ...]) -> None:
        ptr = _storage(target)
        if ptr is None:
            return
        for m in self.made:
            # a view shares its base's version counter: the write that breaks the save is
            # the one that finds it at the saved version
            if (
                m.writer is None
                and _storage(m.tensor) == ptr
                and m.tensor._version == self.saved_version
            ):
                at, code = _frames.user_line()
                m.writer, m.written_at, m.written_code = _name(func), at, code
                m.written_in = _library_module()
                key = args[1] if len(args) > 1 else None
                m.mask = (
                    m.writer == "__setitem__"
                    and isinstance(key, torch.Tensor)
                    and key.dtype is torch.bool
                )


_AUGMENTED = re.compile(r"^(?P<lhs>[\w.\[\]]+)\s*(?P<op>[-+*/@%]|//|\*\*)=\s*(?P<rhs>.+)$")
_METHOD = re.compile(r"^(?P<lhs>[\w.]+)\.(?P<meth>[a-z][a-z0-9_]*[a-z0-9])_\((?P<rest>.*)$")


def bare(code: str | None) -> str | None:
    """A line of code without its trailing comment (when no string literal could hold a
    ``#``) and trailing semicolon.

    >>> bare("h += 1   # shift")
    'h += 1'
    """
    if code is None:
        return None
    text = code.split("#", 1)[0] if "'" not in code and '"' not in code else code
    return text.strip().rstrip(";").strip() or None


_SETITEM = re.compile(r"^(?P<lhs>[\w.]+)\[(?P<key>.+)\]\s*=\s*(?P<value>[^=].*)$")


def rewrite(code: str | None, mask: bool = False) -> str | None:
    """An out-of-place form of the in-place statement ``code``, or None when it is not one
    of the plain shapes (``y += r``, ``y.mul_(2)``, ``inplace=True``, ``y[i] = v``; ``mask``:
    the index of ``y[m] = v`` is a boolean tensor, and ``masked_fill`` writes a copy).

    >>> rewrite("h += 1")
    'h = h + 1'
    >>> rewrite("x.clamp_(min=0)")
    'x = x.clamp(min=0)'
    >>> rewrite("self.act = nn.ReLU(inplace=True)")
    'self.act = nn.ReLU(inplace=False)'
    >>> rewrite("h[m] = 0", mask=True)
    'h = h.masked_fill(m, 0)'
    >>> rewrite("h[:, 0] = 0")
    'h = h.clone(); h[:, 0] = 0'
    >>> rewrite("h = h * 2") is None
    True
    """
    text = bare(code)
    if text is None:
        return None
    if "inplace=True" in text:
        return text.replace("inplace=True", "inplace=False")
    m = _AUGMENTED.match(text)
    if m is not None and "[" not in m["lhs"]:
        return f"{m['lhs']} = {m['lhs']} {m['op']} {m['rhs']}"
    m = _METHOD.match(text)
    if m is not None:
        return f"{m['lhs']} = {m['lhs']}.{m['meth']}({m['rest']}"
    m = _SETITEM.match(text)
    if m is not None:
        if mask:
            return f"{m['lhs']} = {m['lhs']}.masked_fill({m['key']}, {m['value']})"
        return f"{m['lhs']} = {m['lhs']}.clone(); {text}"
    return None
