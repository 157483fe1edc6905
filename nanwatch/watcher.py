"""Watcher: hook registration and removal, step boundaries, flushing, localization.

The watcher knows modules and hooks, not rules: it turns module calls into records
(``records.py``) with statistics (``stats.py``), hands a finished step to the rule engine
and acts on what comes back.

Data flow, hook by hook:

* forward pre-hook (modules with children, roots, forensic mode): open a *call*; link each
  input tensor to the record that produced it, or measure it when no watched module did
  (functional code in the parent) -- so every module's inputs are known;
* forward hook (``always_call``): measure each output (one ``aminmax``; on CPU read at
  once, on accelerators kept on the device until the step's flush) and hook its gradient
  with a tensor hook (never ``register_full_backward_hook``: it breaks in-place modules);
* end of backward (an autograd callback queued by the first gradient hook): the L2 norm of
  every parameter gradient, with multi-tensor kernels;
* step boundary: flush, localize, run the rules, keep the step in the flight recorder.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import itertools
import keyword
import linecache
import math
import numbers
import os
import re
import sys
import threading
import traceback
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.nn.utils import parametrize

from nanwatch import _copies, _frames, _graph, _kept, _trainer, ops
from nanwatch._compat import (
    aminmax,
    autocast_state,
    capturing,
    compiling,
    function_modes,
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
    transforming,
    values_hidden,
)
from nanwatch._domains import domain_of
from nanwatch._structure import iter_tensors
from nanwatch._updates import nan_free_update
from nanwatch.config import WatchConfig
from nanwatch.errors import (
    AnomalyError,
    ConfigError,
    GuardError,
    NanwatchError,
    NanwatchWarning,
)
from nanwatch.localize import (
    adopt_backward_op,
    born_below,
    forward_birth,
    is_birth,
    is_trigger,
    localize,
    propagators,
    summarize,
)
from nanwatch.records import (
    LOSS_PATH,
    Anomaly,
    AnomalyKind,
    Call,
    Note,
    OpEvent,
    Phase,
    Record,
    StepTrace,
    TensorStat,
)
from nanwatch.stats import (
    HostRead,
    bad_row_counts,
    describe,
    device_name,
    dtype_name,
    foreach_absmax,
    foreach_finite_probe,
    foreach_l2,
    hot_l2_pays,
    join_streams,
    l2,
    minmax,
    note_stream,
    numel,
    read_minmax,
    read_scalars,
    rows_from_flags,
    whole_bad_rows,
)

if TYPE_CHECKING:
    from nanwatch.report import Report
    from nanwatch.rules.base import Diagnosis

__all__ = ["Watcher", "watch", "watch_all"]

#: Modules that cannot create a NaN or inf from finite inputs and do not raise magnitudes
#: (or bound them): their outputs are bounded by the record of their input, so they are not
#: measured and their gradients are not hooked. Exact types only: a subclass may override
#: ``forward``. TensorFlow's check_numerics keeps the same kind of "safe ops" list.
_PASSTHROUGH: frozenset[type] = frozenset(
    {
        nn.ReLU,
        nn.ReLU6,
        nn.Hardtanh,
        nn.Identity,
        nn.Flatten,
        nn.Unflatten,
        nn.Sigmoid,
        nn.Tanh,
        nn.Softsign,
        nn.Hardsigmoid,
        nn.MaxPool1d,
        nn.MaxPool2d,
        nn.MaxPool3d,
        nn.AdaptiveMaxPool1d,
        nn.AdaptiveMaxPool2d,
        nn.AdaptiveMaxPool3d,
    }
)
_PASSTHROUGH_NAMES = frozenset(t.__name__ for t in _PASSTHROUGH)
_FAST_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _types(*names: str) -> frozenset[type]:
    """torch.nn classes by name, those this PyTorch has (RMSNorm came in 2.4)."""
    return frozenset(getattr(nn, n) for n in names if isinstance(getattr(nn, n, None), type))


#: normalizations: finite-preserving (see _PRESERVING) only while the constant added to the
#: divisor is positive (``eps``; LocalResponseNorm's ``k``): with 0, a constant or all-zero
#: input makes 0/0
_NORMS: frozenset[type] = _types(
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "SyncBatchNorm",
    "LayerNorm",
    "GroupNorm",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "RMSNorm",
)

#: Modules that cannot create a NaN or inf from finite inputs unless a value overflows the
#: dtype: normalizations (eps > 0), dropout, averages, smooth activations, softmax (it
#: subtracts the max), resampling, padding, lookups. In a dtype whose range ends near 3e38
#: (float32, float64, bfloat16) that overflow would need values the records before them
#: already show as absurd, so their outputs are not measured there: the next measured record
#: (a Linear, a Conv, the loss) bounds them, and localization sees through them as it does
#: through ReLU. In float16 and float8, where overflow is their real risk, they are measured.
_PRESERVING: frozenset[type] = _NORMS | _types(
    "LocalResponseNorm",
    "Dropout",
    "Dropout1d",
    "Dropout2d",
    "Dropout3d",
    "AlphaDropout",
    "FeatureAlphaDropout",
    "AvgPool1d",
    "AvgPool2d",
    "AvgPool3d",
    "AdaptiveAvgPool1d",
    "AdaptiveAvgPool2d",
    "AdaptiveAvgPool3d",
    "GELU",
    "SiLU",
    "Mish",
    "ELU",
    "CELU",
    "SELU",
    "Softplus",
    "Hardswish",
    "LogSigmoid",
    "PReLU",
    "RReLU",
    "GLU",
    "Softshrink",
    "Hardshrink",
    "Tanhshrink",
    "Softmax",
    "Softmin",
    "LogSoftmax",
    "Softmax2d",
    "Upsample",
    "UpsamplingNearest2d",
    "UpsamplingBilinear2d",
    "PixelShuffle",
    "PixelUnshuffle",
    "ChannelShuffle",
    "ReflectionPad1d",
    "ReflectionPad2d",
    "ReflectionPad3d",
    "ReplicationPad1d",
    "ReplicationPad2d",
    "ReplicationPad3d",
    "ZeroPad1d",
    "ZeroPad2d",
    "ZeroPad3d",
    "CircularPad1d",
    "CircularPad2d",
    "CircularPad3d",
    "Embedding",
)


def _preserves(m: nn.Module) -> bool:
    """``m`` cannot make a NaN or inf of finite inputs (short of an overflow): its type is
    in ``_PRESERVING`` and, for a normalization, the constant guarding its divisor is > 0
    (RMSNorm's ``eps=None`` means the dtype's own eps)."""
    t = type(m)
    if t not in _PRESERVING:
        return False
    if t in _NORMS:
        eps = getattr(m, "eps", 0.0)
        if eps is None:
            return t.__name__ == "RMSNorm"
        return isinstance(eps, (int, float)) and eps > 0
    if t.__name__ == "LocalResponseNorm":
        k = getattr(m, "k", 0.0)
        return isinstance(k, (int, float)) and k > 0
    return True


#: dtypes whose range makes overflow of a finite-preserving module implausible
_WIDE = frozenset({torch.float32, torch.float64, torch.bfloat16})


#: autograd nodes of ops that cannot turn finite values into NaN or inf in a wide dtype short
#: of an overflow (sums, differences, negation, concatenation, views and copies): a tensor
#: functional code made this way from recorded tensors (a residual ``x + identity``) is
#: bounded by their records, like a finite-preserving module's output (Watcher._made_safely).
_SAFE_NODES = frozenset(
    f"{op}Backward{n}"
    for op in (
        "Add", "Sub", "Neg", "Cat", "Stack", "View", "Reshape", "UnsafeView", "Permute",
        "Transpose", "T", "Expand", "Slice", "Select", "Clone", "Squeeze", "Unsqueeze",
        "Split", "SplitWithSizes", "Unbind", "Chunk", "Narrow", "AsStrided", "Flatten",
        # the ops of the passthrough modules (an in-place ReLU relabels the tensor it took)
        "Relu", "Hardtanh", "LeakyRelu", "Threshold", "Sigmoid", "Tanh", "MaxPool2DWithIndices",
    )
    for n in (0, 1, 2)
)  # fmt: skip


def _wide(output: Any) -> bool:
    if isinstance(output, torch.Tensor):
        return output.dtype in _WIDE or not output.is_floating_point()
    return all(t.dtype in _WIDE or not t.is_floating_point() for _, t in iter_tensors(output, ""))


def _reads_running_stats(m: nn.Module) -> bool:
    """A norm with running statistics normalizes with them in this call (eval mode): a NaN
    or a 0 there makes NaN/inf of finite inputs, so its output is measured."""
    return not m.training and (
        getattr(m, "running_var", None) is not None or getattr(m, "running_mean", None) is not None
    )


def _read_state(m: nn.Module, name: str) -> bool:
    """Whether the forward of ``m`` may read the buffer ``name`` it wrote: not a norm's
    running statistic in training mode, which that forward only updates (it normalizes
    with the batch's statistics), so a value it held cannot explain a clean replay."""
    owner_path, _, leaf = name.rpartition(".")
    if leaf not in ("running_mean", "running_var"):
        return True
    try:
        owner = m.get_submodule(owner_path) if owner_path else m
    except AttributeError:
        return True
    return not owner.training


def _is_passthrough(m: nn.Module) -> bool:
    t = type(m)
    if t in _PASSTHROUGH:
        return True
    if isinstance(m, nn.LeakyReLU) and t is nn.LeakyReLU:
        return abs(m.negative_slope) <= 1.0
    return False


#: Modules whose outputs are sums of products of their inputs and weights: they cannot
#: write a mask, so a -inf in their output is an overflow (or a -inf weight).
_ARITHMETIC: tuple[type, ...] = (
    nn.Linear,
    nn.Bilinear,
    nn.modules.conv._ConvNd,
    nn.RNNBase,
    nn.RNNCellBase,
)


def _constant_factor(fn: Any) -> tuple[torch.Tensor, bool] | None:
    """The number ``fn`` (the grad_fn of the tensor backward runs on) multiplies or divides
    the loss by, when it is a product or quotient of one tensor with history and a number
    of Python's (``(loss * 2 ** 20).backward()``, manual loss scaling): the number as the
    CPU scalar autograd saved (not read here), and whether it divides. None for any other
    node. O(1): the node's name, its inputs and one saved attribute.

    >>> x = torch.ones(2, requires_grad=True)
    >>> [(float(c), d) for c, d in [_constant_factor((x.sum() * 1024.0).grad_fn)]]
    [(1024.0, False)]
    >>> _constant_factor((x.sum() * x.sum()).grad_fn) is None
    True
    """
    name = type(fn).__name__
    if name not in ("MulBackward0", "DivBackward0"):
        return None
    nxt: tuple[Any, ...] = getattr(fn, "next_functions", ()) or ()
    if len(nxt) != 2 or nxt[0][0] is None or nxt[1][0] is not None:
        return None
    try:
        c = fn._saved_other
    except Exception:  # freed
        return None
    if not isinstance(c, torch.Tensor) or c.dim() or c.device.type != "cpu":
        return None
    if c.dtype is not torch.float64:  # a Python float is wrapped as a float64 scalar; a
        return None  # GradScaler's scale is a float32 tensor: its own story
    return c, name == "DivBackward0"


def _version(t: torch.Tensor) -> int | None:
    if t.is_inference():
        return None
    try:
        return int(t._version)
    except RuntimeError:
        return None


class _ModInfo:
    """What the hooks of one module need to know, bound into their closures."""

    __slots__ = (
        "arithmetic",
        "first_root",
        "is_loss",
        "is_root",
        "params",
        "passthrough",
        "path",
        "post_only",
        "pre_id",
        "preserving",
        "reads_stats",
        "type_name",
    )

    def __init__(self, path: str, module: nn.Module, *, is_root: bool, first_root: bool) -> None:
        self.path = path
        self.type_name = type(module).__name__
        self.is_root = is_root
        self.first_root = first_root
        self.passthrough = _is_passthrough(module) and not is_root
        self.preserving = _preserves(module) and not is_root
        #: a norm with running statistics (BatchNorm, InstanceNorm(track_running_stats)):
        #: in eval it reads them, and a NaN or 0 there makes NaN/inf of finite inputs
        self.reads_stats = self.preserving and isinstance(module, nn.modules.batchnorm._NormBase)
        #: the id of this watcher's forward pre-hook on the module (None: none registered):
        #: the inputs it records are those before the user's pre-hooks that follow it
        self.pre_id: int | None = None
        #: leaves watched from their forward hook alone (no pre-hook: cheaper)
        self.post_only = self.passthrough or self.preserving
        self.is_loss = isinstance(module, nn.modules.loss._Loss)
        self.arithmetic = isinstance(module, _ARITHMETIC)
        self.params = tuple(n for n, _ in module.named_parameters(recurse=False))


class _Frame:
    """A module call on the stack; holds the call's inputs until the call returns (they are
    alive anyway in the caller's frame) so the producer can be replayed."""

    __slots__ = (
        "args",
        "autocast",
        "call",
        "inputs",
        "kwargs",
        "modes",
        "module",
        "rng",
        "site",
        "versions",
        "weights",
    )

    def __init__(
        self,
        call: Call,
        module: nn.Module,
        args: Any,
        kwargs: Any,
        *,
        owners: Sequence[tuple[str, dict[str, Any]]] | None = None,
    ) -> None:
        self.call = call
        self.module = module
        self.args = args
        self.kwargs = kwargs
        #: a root call's input tensors' version counters as it began (see _root_call_inputs)
        self.inputs: tuple[int | None, ...] | None = None
        #: a root call's CPU generator state as it began (ops.forward_rng): a replay of it
        #: repeats its random draws
        self.rng: list[Any] | None = None
        #: a root call's caller, as it stood when the call began (see _site_at), when its
        #: statistics are read after it returned (the accelerator path)
        self.site: _FrameAt | None = None
        #: a root call's watched weights' version counters as it began, when its statistics
        #: are read after it returned (see Watcher._weights_written_since)
        self.weights: tuple[tuple[int, int | None], ...] | None = None
        #: a root call's autocast state as it began (see _compat.autocast_state), when its
        #: statistics are read after it returned: a replay then runs under it again
        self.autocast: tuple[tuple[str, torch.dtype], ...] = ()
        #: a root call's TorchFunctionModes as it began (see _compat.function_modes): a
        #: replay runs under them again (the device torch.set_default_device names)
        self.modes: tuple[Any, ...] = ()
        # the version counters of the module's own buffers as the call began (host-side
        # metadata, no device read): a forward that writes its own state in place (an EMA
        # codebook, a step counter) shows in them, and a replay starts from what it wrote.
        # ``owners``: its submodules' too, when their calls are not watched (sentinel mode):
        # the ``_buffers`` of each, by its name's prefix (see Watcher._buffer_owners)
        if owners is None:
            owners = (("", module._buffers),)
        self.versions: tuple[tuple[str, torch.Tensor, int | None], ...] | None = (
            tuple((p + n, b, _version(b)) for p, d in owners for n, b in d.items() if b is not None)
            or None
        )

    def written(self) -> list[str]:
        """The module's own floating buffers the call has written in place so far."""
        return [
            n
            for n, b, v in self.versions or ()
            if _version(b) != v and (b.is_floating_point() or b.is_complex())
        ]


_SCRIPT_WARNED: set[int] = set()


def _name_modules(
    roots: Sequence[nn.Module],
    *,
    taken: set[str] | None = None,
    first: bool = True,
    compiled: bool = False,
) -> list[tuple[nn.Module, _ModInfo]]:
    """Name every submodule by its qualified name (``encoder.layers.3.attn``); a root is
    named by its class. A module reachable twice keeps its first name. When several roots
    are watched and two paths would collide, the later root's paths get its name as prefix.

    A ``torch.compile``'d submodule is refused (see :func:`_unwrap_compiled`), unless
    ``compiled`` (sentinel mode, which hooks only the roots): then its wrapper is skipped
    and what it wraps takes its name, so its weights are named as in the user's model
    (``blocks.2.weight``, not ``blocks.2._orig_mod.weight``)."""
    out: list[tuple[nn.Module, _ModInfo]] = []
    seen: set[int] = set()
    taken = set() if taken is None else set(taken)
    root_names: list[str] = [t for t in taken if "." not in t]
    for i, root in enumerate(roots):
        base = type(root).__name__
        same = sum(n == base or n.startswith(base + "#") for n in root_names)
        name = f"{base}#{same + 1}" if same else base
        root_names.append(name)
        subs = [(q, m) for q, m in root.named_modules(remove_duplicate=True) if q]
        prefix = ""
        if any(q in taken for q, _ in subs) or name in taken:
            prefix = name + "."
        skipped: list[str] = []
        wrappers: set[str] = set()  # the compiled submodules' paths (``compiled`` only)
        for q, m in [("", root), *subs]:
            if id(m) in seen:
                continue
            if any(q == s or q.startswith(s + ".") for s in skipped):
                continue
            if q and _is_compiled(m):
                if not compiled:
                    _unwrap_compiled(m, path=q, root=root)  # refused like a root
                wrappers.add(q)
                continue
            shown = q
            if wrappers:
                parts = q.split(".")
                shown = ".".join(
                    p
                    for j, p in enumerate(parts)
                    if not (p == "_orig_mod" and ".".join(parts[:j]) in wrappers)
                )
            if isinstance(m, torch.jit.ScriptModule):
                skipped.append(q)
                if id(m) not in _SCRIPT_WARNED:
                    _SCRIPT_WARNED.add(id(m))
                    warnings.warn(
                        f"nanwatch: {shown or name} is a torch.jit.ScriptModule; scripted modules "
                        "cannot be hooked from Python, so it and its submodules are not watched. "
                        "Watch the eager module instead.",
                        RuntimeWarning,
                        stacklevel=4,
                    )
                continue
            seen.add(id(m))
            path = name if not q else prefix + shown
            taken.add(path)
            out.append(
                (m, _ModInfo(path, m, is_root=not q, first_root=(first and i == 0 and not q)))
            )
    return out


def _is_compiled(m: nn.Module) -> bool:
    """Whether ``m`` is the wrapper ``torch.compile`` returns for a module."""
    return isinstance(getattr(m, "_orig_mod", None), nn.Module) and (
        type(m).__name__ == "OptimizedModule"
    )


def _unwrap_compiled(m: nn.Module, *, path: str = "", root: nn.Module | None = None) -> nn.Module:
    """``m`` itself; a ``torch.compile`` wrapper is refused with the line that unwraps it
    (``path``: its name inside the watched ``root``, "" for a root), written with the name
    the user's code gives the watched model, or in words when no name of it is found."""
    if not _is_compiled(m):
        return m
    orig: nn.Module = m._orig_mod  # type: ignore[assignment]
    if path and root is not None:
        where = f"the submodule {path} ({type(orig).__name__}) is"
        name = _user_name(root)
        if name is not None:
            how = f"{_unwrap_line(root, name, path)}   # while debugging; compile it again after"
        else:
            how = (
                f"set {path} of the {type(root).__name__} you watch to its ._orig_mod while "
                "debugging; compile it again after"
            )
        how += (
            '\nor use mode="sentinel": it hooks only the roots and runs a compiled submodule as is.'
        )
    else:
        where = f"{type(orig).__name__} is"
        name = _user_name(m)
        if name is not None:
            how = f"{name} = {name}._orig_mod   # and watch that; compile it after debugging"
        else:
            how = "watch its ._orig_mod (the eager module) instead; compile it after debugging"
    raise ConfigError(
        "modules",
        m,
        f"{where} wrapped by torch.compile; nanwatch's Python hooks would force graph "
        f"breaks in every module. Watch the eager code:\n    {how}",
    )


def _user_name(obj: object) -> str | None:
    """A name the user's code binds to ``obj``: a local, else a global, of the innermost
    user frame that has one (a wrapper of the user's around ``watch()`` holds the watcher,
    its caller the model): the variable a fix can be written with. None when none is found
    (the model was made in the call: ``watch(Net())``)."""
    f = _frames.user_frame()
    for _ in range(16):
        if f is None:
            return None
        for scope in (f.f_locals, f.f_globals):
            for k, v in list(scope.items()):
                if v is obj and isinstance(k, str) and k.isidentifier() and k[0] != "_":
                    return k
        f = _frames.user_frame(f.f_back)
    return None


def _unwrap_line(root: nn.Module, name: str, path: str) -> str:
    """The statement that puts back the eager module of the compiled submodule ``path`` of
    ``root`` (bound to ``name``), as Python that runs: ``net.blocks[2] = net.blocks[2]._orig_mod``
    for an index of a Sequential or ModuleList, ``net.heads["a-b"]`` for a ModuleDict's key
    that is no identifier, ``setattr``/``getattr`` for any other name."""
    expr, parent = name, root
    line = ""
    for part in path.split("."):
        if isinstance(parent, (nn.Sequential, nn.ModuleList)) and part.isdigit():
            step = f"{expr}[{part}]"
            line = f"{step} = {step}._orig_mod"
        elif part.isidentifier() and not keyword.iskeyword(part):
            step = f"{expr}.{part}"
            line = f"{step} = {step}._orig_mod"
        elif isinstance(parent, nn.ModuleDict):
            step = f"{expr}[{part!r}]"
            line = f"{step} = {step}._orig_mod"
        else:
            step = f"getattr({expr}, {part!r})"
            line = f"setattr({expr}, {part!r}, {step}._orig_mod)"
        expr = step
        child = parent._modules.get(part)
        parent = child if child is not None else parent
    return line


_PendingNode = tuple[
    str,
    str,
    str,
    tuple[str | None, str | None],
    tuple[str | None, str | None],
    dict[str, Any],
    list[str],
    "ops.SavedNode | None",
    torch.Tensor,
]
"""A loss-code node's flag on the device: (node name, loss path, dtype, backward site, its
forward line where anomaly mode kept it, the scalars it saved, the ops that made what a log
was taken of, what it saved, 0-d flag: 0 finite, else what was born: 1 NaN, 2 +inf, 4 -inf,
summed); see ``_flag_loss_nodes``."""

#: no line known
_NO_LINE: tuple[str | None, str | None] = (None, None)


@dataclasses.dataclass
class _Prefetch:
    """Statistics on their way to the host (see ``Watcher._prefetch``)."""

    rows: list[tuple[Record, torch.Tensor, torch.Tensor, int]]
    grads: list[tuple[Record, torch.Tensor, torch.Tensor]]
    nodes: list[_PendingNode]
    read: HostRead
    wait: bool  #: the update waits for it (the forward's); else read only once landed


class Watcher:
    """Watches modules for non-finite values, forward and backward; see :func:`watch`.

    Use as a context manager, or call :meth:`attach` and :meth:`detach` yourself.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        >>> with Watcher([model], WatchConfig()) as nw:
        ...     _ = model(torch.randn(2, 4)).sum().backward()
        ...     _ = nw.step()
        >>> nw.first_anomaly is None
        True
    """

    # state of the step being recorded (reset by _reset_step)
    _trace: StepTrace
    _idx: int
    #: id(tensor) -> (weakref, record index, version when recorded, gradient hooked)
    _known: dict[int, tuple[weakref.ReferenceType[torch.Tensor], int, int | None, bool]]
    _recorded_nodes: ops.NodeMarks
    _minmax: dict[int, tuple[Any, Any]]  #: record index -> the aminmax measured for it
    #: (data_ptr, dtype, numel) of a contiguous tensor measured this step -> (weakref to its
    #: base, record index, version then): a view of the same values reads these (see
    #: :meth:`_read_of`); valid while ``_minmax`` is the dict ``_reads_for`` names
    _reads: dict[tuple[int, torch.dtype, int], tuple[weakref.ReferenceType[torch.Tensor], int, int]]
    _reads_for: dict[int, tuple[Any, Any]] | None = None
    #: the step's loss was recorded as torch.autograd.grad(loss, params) began (a loop that
    #: trains without backward(); see _grad_loss): its calls are named so
    _loss_by_grad: bool = False
    _stack: list[_Frame]
    _pending: list[tuple[Record, torch.Tensor, torch.Tensor, int]]  #: + the numel
    #: statistics already on their way to the host (see :meth:`_prefetch`)
    _prefetched: list[_Prefetch]
    _pending_rows: list[tuple[Record, torch.Tensor]]
    _pending_grads: list[tuple[Record, torch.Tensor, torch.Tensor]]
    #: accelerators: (node name, loss path, dtype, site, 0-d flag: 0 finite, 1 inf born, 2
    #: NaN born) for the loss code's risky autograd nodes, read with the step's statistics
    _pending_nodes: list[_PendingNode]
    _new_trigger: Record | None
    _user_loss: torch.Tensor | float | None
    _grad_scale: torch.Tensor | None
    #: the children of each watched module at attach (see _check_tree); None: not followed
    _tree: list[tuple[Any, ...]] | None
    #: the step whose first root call compared the tree
    _tree_step: int
    #: each root's buffers' owners, by the root's id (see :meth:`_buffer_owners`)
    _owners: dict[int, tuple[nn.Module, list[tuple[str, dict[str, Any]]]]]
    #: the last tensor ``GradScaler.scale`` returned (the loss times the scale)
    _scaled_out: Callable[[], Any] | None
    #: the record of this step's loss that ``backward()`` ran on when it was scaler-scaled
    _scaled_loss: int | None
    _full: bool
    #: a call from outside every watched call ran with gradients on in this step
    _grad_call: bool
    #: forensic: the user's ``backward()`` line, (``file.py:57``, its text)
    _backward_site: tuple[str | None, str | None]
    #: a gradient made by the loss code's backward was seen non-finite this step
    _loss_node_bad: bool
    #: the loss code's nodes whose gradients go straight to the watched outputs (checked by
    #: the outputs' own hooks, not twice), when this step's loss graph was walked whole
    _loss_last: list[str] | None
    #: the loss code's nodes with what they saved, as backward began (_flag_loss_nodes)
    _loss_snaps: list[tuple[str, str, ops.SavedNode]]
    #: read late: the code, line and local tensors' nodes of the user's frame that called
    #: backward() on the loss code (see _flag_loss_nodes), for the op's forward line
    _loss_held: tuple[Any, int, dict[str, Any]] | None
    _late_loss: torch.Tensor | None
    _late_losses: dict[int, torch.Tensor]
    #: the nodes of the watched values alive as backward() began (see _hold_late_loss)
    _late_stops: list[Any]
    #: read late: the watched values the loss code read, unread as backward() began, by
    #: their records' indices (see _hold_loss_inputs)
    _late_values: dict[int, torch.Tensor]
    #: the loss code's graph is being read after an optimizer update (see
    #: :meth:`_pinpoint_loss_after_update`)
    _reading_after_update: bool = False
    _derived_fns: list[Any]
    _input_snaps: list[ops.SavedNode]
    #: sentinel: the loss that ``backward()`` was called on this step, while the user holds
    #: it (its graph names the loss code's nodes at anomaly time; nothing is checked)
    _loss_ref: Callable[[], torch.Tensor | None] | None
    #: sentinel on the accelerator path: the loss code's risky nodes (see
    #: :meth:`_loss_risky_nodes`), named at ``backward()``: the loss may be gone by the read
    _loss_risky: list[str] | None

    def __init__(
        self,
        modules: Sequence[nn.Module | Sequence[nn.Module]],
        config: WatchConfig | None = None,
        *,
        scaler: Any = None,
        global_hooks: bool = False,
    ) -> None:
        if isinstance(modules, nn.Module):  # Watcher(model): its children are not roots
            modules = [modules]
        # watch([q, q_target]): a list or tuple of modules given as one argument
        flat: list[Any] = []
        for item in modules:
            flat.extend(item if isinstance(item, (list, tuple)) and item else [item])
        modules = flat
        if not modules and not global_hooks:
            raise ConfigError(
                "modules", modules, "watch() needs at least one nn.Module: watch(model, criterion)."
            )
        if config is not None and not isinstance(config, WatchConfig):
            raise ConfigError(
                "config",
                config,
                f"`config` must be a nanwatch.WatchConfig; got {type(config).__name__} "
                f"({config!r:.60}). Or pass the options by keyword: watch(model, "
                "mode='sentinel').",
            )
        if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
            raise ConfigError(
                "scaler",
                scaler,
                f"`scaler` must be a torch.amp.GradScaler; got {type(scaler).__name__}. "
                "nanwatch finds a GradScaler by itself at its first scaler.scale(loss).",
            )
        for m in modules:
            if not isinstance(m, nn.Module):
                raise ConfigError(
                    "modules",
                    m,
                    f"watch() takes nn.Module objects; got {type(m).__name__} ({m!r:.60}). "
                    "Pass the model (and the loss module), e.g. watch(model, criterion).",
                )
        self.config = config if config is not None else WatchConfig()
        self.roots: list[nn.Module] = [_unwrap_compiled(m) for m in modules]
        self.scaler = scaler
        self._scaled_out = None
        self._tree = None
        self._tree_step = -1
        self._owners = {}
        #: optimizers that step none of the watched weights (see _note_foreign_step)
        self._foreign: dict[int, tuple[weakref.ReferenceType[Any], int, bool]] = {}
        #: each watched module's buffers and their versions when hooked: see _moved_state
        self._state_marks: dict[int, tuple[weakref.ReferenceType[torch.Tensor], int]] = {}
        #: global module hooks: every module called while attached is watched (nanwatch run)
        self.global_hooks = global_hooks
        #: nanwatch run: the script's Trainer, if one runs, says each step's epoch and batch
        self._trainer_probe = _trainer.TrainerProbe() if global_hooks else None
        self._positions: dict[int, tuple[int, int]] = {}
        self._forensic = self.config.mode == "forensic"
        self._infos: weakref.WeakKeyDictionary[nn.Module, _ModInfo] = weakref.WeakKeyDictionary()
        self.history: deque[StepTrace] = deque(maxlen=self.config.ring_size)
        #: id(step) -> (step, the weights it read non-finite): see _bad_weights_of
        self._bad_weights_cache: dict[int, tuple[StepTrace, frozenset[str]]] = {}
        #: :meth:`_read_graph`'s digests, by (module path, node type, dtype)
        self._digests: dict[tuple[str, str, str], list[dict[str, Any]] | None] = {}
        #: read late: what the risky nodes of each call's own code saved (see _kept)
        self._own_saved = _kept.OwnSaved()
        #: the step a :meth:`load_state_dict` resumed at: ``history``'s steps before it are
        #: the restored ones (-1: nothing restored)
        self._resumed_at = -1
        self._attach_versions: dict[int, int] = {}
        #: (what was replayed: "forward", "backward" or "gradient"; the path of the module
        #: that replay blamed, after any move into a child) for each anomaly replayed so far
        self._pinpointed: set[tuple[str, str]] = set()
        self._first_bad: StepTrace | None = None
        self._attach_order = -1  # see attach
        self.anomalies: list[Anomaly] = []
        self.first_anomaly: Anomaly | None = None
        #: internal errors caught in nanwatch's own hooks: (hook, message)
        self.faults: list[tuple[str, str]] = []
        self._attached = False
        #: a global watcher (nanwatch run): the watchers of named modules it stands aside
        #: for while they are attached (see :meth:`_stand_aside`)
        self._aside: weakref.WeakSet[Watcher] = weakref.WeakSet()
        self._handles: list[Any] = []
        self._tensor_handles: list[Any] = []
        #: post-accumulate-grad hooks on large CPU weights (see :meth:`_hook_params`), by id
        self._param_hooks: dict[int, Any] = {}
        #: the gradient norms those hooks read: id(param) -> (weakref to the .grad read,
        #: its version then, its L2 norm); taken by the next end-of-backward check
        self._hot_norms: dict[int, tuple[Any, int, torch.Tensor]] = {}
        self._modules: list[tuple[nn.Module, _ModInfo]] = []
        self._params: list[tuple[str, str, nn.Parameter]] = []
        self._param_ids: frozenset[int] = frozenset()  #: ids of ``_params`` (optimizer hook)
        self._param_types: list[str] = []  # the owner module's class, aligned with _params
        #: the parameters' names and owner types by id, for op events (see _param_of)
        self._param_table: tuple[list[Any], dict[int, tuple[nn.Parameter, str, str]]] | None = None
        #: what the parameters were collected from (see :meth:`_param_sig_of`)
        self._param_sig: list[tuple[Any, ...]] = []
        self._lazy_left = False  #: a lazy module's parameters are not materialized yet
        self._disabled_hooks: set[str] = set()
        self._disabled_rules: set[str] = set()
        self._announced: set[str] = set()  # warning codes said once already
        self._opaque_warned: set[type] = set()
        #: roots found by the global hooks, by the line that called them and what they are
        #: (see :meth:`_same_as_before`): a module made anew at each call (a loss built in
        #: the loop) keeps one name, and the one it replaces is let go
        self._site_roots: dict[tuple[Any, ...], tuple[weakref.ref[nn.Module], str]] = {}
        self._checker: ops.OpChecker | None = None
        #: forensic: how many of the op checker's events ran up to this step's last
        #: optimizer update; the ones after it (the next batch's rewards, computed before
        #: its first module call) belong to the step the automatic rule begins next
        self._ops_mark: int | None = None
        #: how many backward passes reached their end-of-backward check (see _BackwardTap)
        self._eob_count = 0
        self._functional_guards: Any = None
        self._restore_signals: Callable[[], None] | None = None
        self._anomaly_mode_prev: tuple[bool, bool] | None = None
        #: forensic: anomaly mode turned off to raise from inside backward (see _act)
        self._anomaly_paused = False
        #: on accelerators the loss code's gradients are checked (a sync per autograd node)
        #: only once a gradient from outside the modules was seen non-finite in this run
        self._loss_graph_armed = False
        self._gen = 0
        self._step = 0
        self._warned = False
        self._explicit = False
        #: the first step that began at the user's ``step()`` (each one after it did too:
        #: the automatic step rule is off once the user marks the steps); None before
        self._marked_from: int | None = None
        #: the framework callback that made this watcher (``"lightning"``), or None: its
        #: hints name that callback's arguments, not a ``watch()`` call the user has not
        self.front: str | None = None
        self._acted_step = -1
        self._device_dead = False
        self._compiled_warned = False
        #: the loss code's graph was looked at for a column broadcast against a row (once a
        #: watch: the shapes of a hand-written loss do not change, see _check_broadcast)
        self._broadcast_checked = False
        #: sentinel mode (which hooks only the roots): no root has run yet in a step that
        #: ran backward() (see :meth:`_probe_parts`); False once looked, or in other modes
        self._probe_due = self.config.mode == "sentinel" and not global_hooks
        #: the parts of the roots hooked for a while to find those the loop calls itself:
        #: id(module) -> the handles; None when not probing (see :meth:`_end_probe`)
        self._probing: dict[int, list[Any]] | None = None
        #: the paths of the parts found called from outside every watched call while their
        #: root is not: sentinel hooks them as roots, at each attach (see _hook_modules)
        self._called_alone: set[str] = set()
        #: the roots replayed to find a loss-code op in their forward (_replay_roots_for)
        self._kept_aside_replayed: set[str] = set()
        #: torch.compile's frame count when watch() attached, and when a look for a compiled
        #: model last found no evidence (see _warn_if_unwatched)
        self._dynamo_at_attach = 0
        self._dynamo_looked = -1
        self._capture_warned = False
        self._in_capture = False  # a CUDA graph capture began at the last outside call
        #: the optimizer stepping now applies a gradient your code wrote that is not finite
        self._written_bad = False
        self._quiet = False
        self._defer_cpu = False  # tests drive the accelerator path on CPU with this
        self._thread: int | None = None
        self._recorded_nodes = ops.NodeMarks()
        self._first_root_ran = False
        #: this is a forked child of the process that attached (a DataLoader worker): the
        #: watcher was detached there at the fork and does nothing in it
        self._forked = False
        #: an optimizer that updates watched weights (or any one given a closure) is inside
        #: its ``step()`` (between nanwatch's pre- and post-hook), and whether a root forward
        #: ran in it since: the closure of LBFGS evaluates the model several times in one step
        self._opt_running = False
        self._opt_forwarded = False
        #: the optimizer that last stepped each weight (by the weight's id): its state is
        #: read for that weight only once the weight is found non-finite
        self._stepped_by: dict[int, weakref.ReferenceType[Any]] = {}
        #: where each optimizer's last step fell: id -> (the step, how many calls of that
        #: step had begun), to tell a forward after the update from one before it (NW301)
        self._opt_calls: dict[int, tuple[int, int]] = {}
        #: the lr scheduler of each optimizer that has one (by the optimizer's id): its
        #: class and the user's name for it, found once in the frame that steps it
        self._schedulers: dict[int, tuple[str, str | None] | None] = {}
        #: the scheduler objects themselves, and the source of the lr lambdas of each
        #: (LambdaLR, MultiplicativeLR), read once when its lr is 0 (NW312)
        self._scheduler_refs: dict[int, weakref.ref[Any]] = {}
        self._lambda_sources: dict[int, list[dict[str, str]]] = {}
        #: each weight's data pointer right after the last optimizer step that updated it
        #: (by the weight's id): ``p.data = w / w.norm()`` after the step replaces the
        #: weight's tensor and moves no version (NW301: written after the update)
        self._stepped_ptr: dict[int, int] = {}
        #: each watched weight's gradient as the last optimizer step that updated it left
        #: it, followed through backward passes to see whether it was reset (NW307): id ->
        #: [weight, weak reference to its .grad, the .grad's version last seen, changed
        #: in place outside a backward since, a backward added to it without a reset]
        self._grad_marks: dict[int, list[Any]] = {}
        #: each weight's finiteness as the attach check read it (absent: not read)
        self._attach_finite: dict[int, bool] = {}
        #: each finite weight's size as the attach check read it, before any update under
        #: nanwatch: name -> (value, ``"max"`` for max |w| or ``"norm"`` for its L2 norm,
        #: numel). The rules weigh an update against it (NW308); no extra read
        self._attach_scales: dict[str, tuple[float, str, int]] = {}
        #: weights that held -inf, and no NaN or +inf, when nanwatch first read them (a
        #: CRF's forbidden transitions, a mask kept in a Parameter): id -> how many. Their
        #: -inf is a constraint, not an anomaly: they are checked apart (max |w| over the
        #: rest, and whether the count of -inf grew), see :meth:`_weight_maxima`
        self._neginf_at_start: dict[int, int] = {}
        #: the weights whose values a weight check has read (their first sight is past)
        self._weighed: set[int] = set()
        self._weighed_for: list[tuple[str, str, nn.Parameter]] | None = None
        self._checking_attach = False
        #: a training ``backward()`` is running (its depth): gradients recorded outside one
        #: come from ``torch.autograd.grad`` (``Record.by_grad``)
        self._in_backward = 0
        #: steps ended by the no_grad rule alone, since the last other boundary, that held
        #: only no_grad calls and nothing bad: (the step, its end index, the ``_stepped_prev``
        #: it was begun with). A grad-enabled call that follows shows they were the no_grad
        #: part (an EMA teacher, a key encoder) of one training step: they are folded back
        self._foldable: list[tuple[StepTrace, int, dict[int, tuple[str, int, int]]]] = []
        #: the number of the first of those steps, and the ``_stepped_prev`` it was begun with
        self._fold_from: tuple[int, dict[int, tuple[str, int, int]]] = (0, {})
        #: a step ended after a backward (the run trains): an evaluation between training
        #: steps does not shift their numbers (see :meth:`_fold`)
        self._trained = False
        #: steps the automatic rule ended after a backward, while no weight was updated
        #: twice (the first update cycle): (the step, its end index, its ``_stepped_prev``,
        #: what it updated); None once that cycle is over (see :meth:`_cycle_fold`)
        self._cycle: (
            list[tuple[StepTrace, int, dict[int, tuple[str, int, int]], frozenset[int]]] | None
        ) = []
        #: each weight's version (and the GradScaler's) when the last of those steps ended
        self._cycle_base: tuple[dict[int, int], tuple[int, ...]] | None = None
        #: no weight was updated twice in ``_cycle`` yet: its steps fold as they end; after
        #: that they are kept (as long as the ring) for the first ``nw.step()`` only
        self._cycle_open = True
        #: an optimizer updated watched weights in this run (see :meth:`_discarded`)
        self._ever_updated = False
        #: a gradient reached a watched value in this run: it trains (see _read_at_root_end)
        self._ever_backward = False
        #: backward() ran in this run (not only ``torch.autograd.grad``; see _trained_by_grad)
        self._ever_backward_called = False
        #: read late, the weights' version counters when a step's end last found them all
        #: finite (see :meth:`_weights_written_since`); None when not known
        self._weights_checked: tuple[tuple[int, int | None], ...] | None = None
        self._reset_step()

    # ------------------------------------------------------------------ public API
    @property
    def attached(self) -> bool:
        return self._attached

    @property
    def step_index(self) -> int:
        """The number of the step being recorded now (0-based)."""
        return self._step

    @property
    def trace(self) -> StepTrace:
        """The step being recorded now."""
        return self._trace

    @property
    def first_bad_step(self) -> StepTrace | None:
        """The finished step of the first anomaly, kept when ``history`` (the last
        ``ring_size`` steps) has moved past it: a run that records and goes on for hundreds
        of steps still reports where it first went wrong."""
        return self._first_bad

    @property
    def module_paths(self) -> list[str]:
        """The path of every watched module, in registration order."""
        return [info.path for _, info in self._modules]

    def attach(self) -> Watcher:
        """Register the hooks. Safe to call once; a second call is an error."""
        if self._attached or self._aside:
            raise NanwatchError("this Watcher is already attached; call detach() first.")
        # sentinel hooks only the roots: a compiled submodule runs compiled, and is no obstacle
        self._modules = _name_modules(self.roots, compiled=self.config.mode == "sentinel")
        self._infos = weakref.WeakKeyDictionary(self._modules)
        self._set_params()
        forensic = self._forensic
        try:
            self._hook_params()
            if self.global_hooks:
                mm = torch.nn.modules.module
                self._handles.append(mm.register_module_forward_pre_hook(self._global_pre))
                try:
                    post = mm.register_module_forward_hook(
                        self._global_post, with_kwargs=True, always_call=True
                    )
                except TypeError:  # torch < 2.2: no kwargs for global hooks (_global_post
                    # then gets (module, args, output) and takes kwargs as empty)
                    post = mm.register_module_forward_hook(self._global_post, always_call=True)
                self._handles.append(post)
            if not self.global_hooks:
                self._hook_modules(self._modules)
            if self.config.guards:
                from nanwatch import guards

                # losses and embeddings (the guards choose); under global hooks those found
                # later are guarded when they are discovered
                named = [(m, info.path) for m, info in self._modules]
                self._handles.extend(guards.attach(self, named))
                if self.config.functional_guards:
                    self._functional_guards = guards.FunctionalGuards(self)
                    self._functional_guards.__enter__()
            _copies.hide(h.id for h in self._handles)  # a copy or pickle of a model: no hooks
            if self.config.postmortem:
                from nanwatch import postmortem

                self._restore_signals = postmortem.install_signal_handlers(self)
            _backward_tap.install(self)
            _grad_tap.install(self)
            _scaler_tap.install(self)
            _clip_tap.install(self)
            handle = register_optimizer_step_pre_hook(self._on_optimizer_step)
            if handle is not None:
                self._handles.append(handle)
            handle = register_optimizer_step_post_hook(self._after_optimizer_step)
            if handle is not None:
                self._handles.append(handle)
            if forensic:
                self._anomaly_mode_prev = (
                    torch.is_anomaly_enabled(),
                    torch.is_anomaly_check_nan_enabled(),
                )
                torch.autograd.set_detect_anomaly(True, check_nan=False)
                self._checker = ops.OpChecker(
                    current_path=self._current_path,
                    on_error=self._checker_fault,
                    max_events=256,
                    backward_site=self._backward_site_of_step,
                    param_of=self._param_of,
                )
                self._checker.__enter__()  # type: ignore[no-untyped-call]
        except BaseException:
            self._remove_hooks()
            raise
        # every mode: a layer or loss added in sentinel mode has parameters and guards too
        self._tree = self._tree_of() if not self.global_hooks else None
        self._tree_step = -1
        self._owners = {}
        self._attached = True
        self._attach_order = next(_RECORD_ORDER)  # nested watchers read in this order
        _live.add(self)
        self._thread = threading.get_ident()
        self._dynamo_at_attach = _dynamo_frames() or 0
        self._dynamo_looked = -1
        self._gen += 1
        self._reset_step()
        self._check_loaded_weights()
        if self._cycle is not None:
            self._cycle_base = self._cycle_marks()
        _take_turns(self)
        return self

    def _hook_modules(self, modules: Iterable[tuple[nn.Module, _ModInfo]]) -> None:
        """Register the forward pre-hook and forward hook of each module (only the roots'
        in sentinel mode); the handles go to ``self._handles``."""
        full_hooks = self.config.mode != "sentinel"
        forensic = self._forensic
        marks = self._state_marks
        for module, info in modules:
            for b in module.buffers(recurse=False):
                marks[id(b)] = (weakref.ref(b), b._version)
            if not (info.is_root or full_hooks or info.path in self._called_alone):
                continue
            if not info.post_only or forensic:
                # first, so the call's inputs are what its caller passed: a user's pre-hook
                # (a standardization) is code of the call, replayed with it
                pre = module.register_forward_pre_hook(
                    self._make_pre(info, module), with_kwargs=True, prepend=True
                )
                info.pre_id = pre.id
                self._handles.append(pre)
            self._handles.append(
                module.register_forward_hook(
                    self._make_post(info, module), with_kwargs=True, always_call=True
                )
            )

    def _buffer_owners(self, module: nn.Module) -> list[tuple[str, dict[str, Any]]]:
        """``module`` and each of its submodules (once each, as ``named_buffers`` walks
        them): the prefix of its buffers' names and its ``_buffers`` dict, whose entries
        are read at each call (a buffer replaced or registered since shows). Kept while the
        model's tree stands (:meth:`_check_tree` drops them when it changes); walked afresh
        at each call when nothing watches the tree (global hooks)."""
        if self._tree is None:
            return [(f"{q}." if q else "", m._buffers) for q, m in module.named_modules()]
        got = self._owners.get(id(module))
        if got is None or got[0] is not module:
            walk = [(f"{q}." if q else "", m._buffers) for q, m in module.named_modules()]
            got = self._owners[id(module)] = (module, walk)
        return got[1]

    def _tree_of(self) -> list[tuple[Any, ...]]:
        """The children of every watched module, as (name, module) pairs: compared at each
        step's first call of a root, it tells that the model changed shape since attach."""
        return [tuple(m._modules.items()) for m, _ in self._modules]

    def _call_line(self, module: nn.Module) -> tuple[str, str | None] | None:
        """The line of its watched parent's forward that calls ``module`` (see
        :func:`ops.call_line`): where an op of a module with no code of the user's (a
        torch LayerNorm) ran; None for a root (replayed in its own hook, the user's line
        running then is its call) or when the parent's source does not say. Looked for
        only when a replay needs it."""
        for parent, _ in self._modules:
            for name, child in parent._modules.items():
                if child is module:
                    return ops.call_line(parent, name)
        return None

    def _moved_state(self, t: torch.Tensor) -> bool:
        """Whether a replay takes the non-finite values of module state ``t`` as given, not
        born in the ops that read them (see ``ops.OpChecker.hold_state``): parameters (the
        weight checks name an update that made them non-finite), and buffers written since
        they were hooked (an EMA codebook divided by a zero count). A buffer unchanged since
        then holds its infinities by design (a causal mask of +inf): the op that makes NaN
        of them (0 * inf) is the one to blame."""
        if isinstance(t, nn.Parameter):
            return True
        mark = self._state_marks.get(id(t))
        if mark is None or mark[0]() is not t:
            return True  # set after attach: nothing says it was written by design
        return t._version != mark[1]

    def _check_tree(self) -> None:
        """Once a step, at a root's call from outside: a module added under a watched one
        after attach (a layer inserted to grow the model, a head attached later) is named
        and hooked like those found at attach, a module moved by the change (the layers
        after an ``insert``) takes its current name, and one no longer in the model (a head
        replaced) is no longer watched. One look at each watched module's children; the
        model is walked again only when they changed."""
        self._tree_step = self._step
        tree = self._tree
        if tree is None or self._tree_of() == tree:
            self._refresh_params()
            return
        self._owners = {}  # buffers' owners are walked again (see _buffer_owners)
        fresh = _name_modules(self.roots, compiled=self.config.mode == "sentinel")
        live = {id(m) for m, _ in fresh}
        # a module replaced (``model.head = nn.Linear(...)``) or deleted: no longer watched,
        # so its name and its parameters' are the new module's alone
        self._unwatch([m for m, i in self._modules if id(m) not in live and not i.is_root])
        added: list[tuple[nn.Module, _ModInfo]] = []
        for m, info in fresh:
            known = self._infos.get(m)
            if known is None:
                self._infos[m] = info
                self._modules.append((m, info))
                added.append((m, info))
            elif known.path != info.path and not known.is_root:
                known.path = info.path  # the hooks' closures hold the info: renamed there too
        if added:
            before = len(self._handles)
            self._hook_modules(added)
            self._set_params()
            self._hook_params()
            if self.config.guards:
                from nanwatch import guards

                self._handles.extend(guards.attach(self, [(m, i.path) for m, i in added]))
            _copies.hide(h.id for h in self._handles[before:])
        else:
            self._set_params()  # the parameters' names follow their modules'
        self._tree = self._tree_of()

    def _check_loaded_weights(self) -> None:
        """Weights that are already NaN/inf when watching begins (a corrupted checkpoint, a
        NaN row of a pretrained embedding table that only a later batch looks up) are
        recorded ahead of the first step's records: no update under nanwatch made them,
        and NW301 says so, not that the learning rate did. One read of every weight."""
        if self._device_dead or not self._params or _tracing():
            return
        if any(p.is_meta for _, _, p in self._params):
            return  # deferred initialization: no values yet
        self._checking_attach = True
        try:
            with _NO_TORCH_FUNCTION(), torch.no_grad():
                self._check_params(at_end=False)
        except Exception as exc:  # a weight nanwatch cannot read: the steps still check
            self._fault("weights", "weight check at attach", exc)
        else:
            bad = {
                r.role
                for r in self._trace.records
                if r.phase is Phase.PARAMETER and r.stat is not None and not r.stat.finite
            }
            self._attach_finite = {id(p): q not in bad for q, _, p in self._params}
        finally:
            self._checking_attach = False
        # what the check saw: a weight written after it (an ActNorm's data-dependent init
        # in the first forward) was not loaded so
        self._attach_versions = {id(p): p._version for _, _, p in self._params}

    def detach(self) -> None:
        """Remove every hook this watcher registered. Safe to call twice."""
        _live.discard(self)
        if not self.global_hooks:
            for other in list(_live):  # a global watcher that stood aside for this one
                other._stand_aside(self, False)
        elif self._aside:  # its hooks are still registered: removed below
            self._aside = weakref.WeakSet()
            self._attached = True
        if not self._attached:
            return
        self._attached = False
        self._gen += 1
        self._remove_hooks()
        self._known.clear()
        self._stack.clear()
        self._loss_snaps = []  # what the loss code saved: no reference kept after detach
        self._own_saved = _kept.OwnSaved()  # and the modules' own code
        self._loss_held = None
        self._digests.clear()  # the model may change before the next attach
        self._late_loss = None
        self._late_losses = {}
        self._late_stops = []
        self._late_values = {}
        self._derived_fns, self._input_snaps = [], []

    def __enter__(self) -> Watcher:
        return self.attach()

    def _stand_aside(self, other: Watcher, aside: bool) -> None:
        """``other``, a watcher of named modules (the script's own ``nanwatch.watch(model)``
        under ``nanwatch run``, a Lightning callback's), was attached (``aside``) or detached
        while this global watcher is attached. While one is, this one steps aside as
        :meth:`paused` does, its hooks registered: that watcher alone records and reports,
        with the options the script gave it, so each problem is reported once, not once by
        each watcher (and at two different steps)."""
        if not self.global_hooks or other is self:
            return
        if aside:
            if not self._aside:
                self._attached = False
            self._aside.add(other)
            return
        if other not in self._aside:
            return
        self._aside.discard(other)
        if not self._aside:
            self._stack.clear()  # calls left open when it stepped aside: never closed
            if self._checker is not None:
                self._checker.events.clear()  # the ops of the other watcher's steps
                self._ops_mark = None
            self._attached = True

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing is recorded inside: every hook stays registered and steps aside (what a
        guard runs to learn torch's own error for a call it stopped).

        Example:
            >>> m = nn.Linear(2, 2)
            >>> with watch(m, postmortem=False) as nw:
            ...     with nw.paused():
            ...         _ = m(torch.zeros(1, 2))
            >>> nw.trace.calls
            []
        """
        was = self._attached
        self._attached = False
        try:
            yield
        finally:
            self._attached = was

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._forked:
            return  # a forked child: the parent's watcher reports, not this copy
        try:
            # torch.set_default_device("cuda") is a TorchFunctionMode: nanwatch's own
            # tensors (the stacked statistics of a read) are made where nanwatch says
            with _NO_TORCH_FUNCTION():
                from nanwatch.postmortem import interrupt_behind

                # an exit a framework made of a Ctrl-C reports the interrupt, and goes on
                interrupted = interrupt_behind(exc)
                if exc is None or (_deliberate_exit(exc) and interrupted is None):
                    self._quiet = exc is not None  # the exit must come out as it went in
                    try:
                        self._final_boundary()
                    except AnomalyError as err:  # read at the exit (the accelerator path)
                        _frames.hide_own_frames(err)
                        raise
                    finally:
                        self._quiet = False
                else:
                    self._on_exception(interrupted or exc)
        finally:
            self.detach()
            _frames.hide_own_frames(exc)  # after the post-mortem read it
        # returning None: never swallow the user's exception

    def step(self, loss: torch.Tensor | float | None = None) -> StepTrace:
        """End the current step: flush its statistics, localize, run the rules, and act per
        ``on_anomaly``. Returns the finished step.

        Call it once per training step, after ``optimizer.step()``. Without it, each call of
        the first watched module after a backward and an update (an optimizer step, changed
        weights, gradients reset by ``zero_grad``, or a GradScaler update that skipped the
        optimizer step) starts a new step, and with gradients
        disabled each call does: several forwards before one backward, and the
        micro-batches of gradient accumulation, are one step. The steps that rule made before
        the first call (an attack's backward passes, a discriminator's updates before the
        generator's) are folded into the step it ends, unless one of them held an anomaly.
        ``loss``, when given, is recorded for the timeline (functional losses are not seen by
        module hooks)."""
        if self._forked:
            return self._trace
        first = not self._explicit
        self._explicit = True
        if loss is not None:
            self._user_loss = loss
        with _NO_TORCH_FUNCTION():
            if first:  # the automatic steps before it were the user's first step
                self._fold_evaluations()
                self._cycle_fold(first_explicit=True)
            self._cycle = None
            try:
                done = self._boundary()
            except AnomalyError as err:  # raised at the user's nw.step(), not in nanwatch
                _frames.hide_own_frames(err)
                raise
            if self._marked_from is None:
                self._marked_from = self._step
            return done

    def check(self) -> Anomaly | None:
        """Localize what the current step recorded so far, without ending the step or acting
        on ``on_anomaly``: brings pending statistics to the host (one transfer) and checks
        the parameter gradients. For code that must decide before the optimizer step (the
        Lightning callback skips or stops there).

        Example:
            >>> loss.backward()                                   # doctest: +SKIP
            >>> if nw.check() is not None:                        # doctest: +SKIP
            ...     opt.zero_grad(set_to_none=True)               # skip this update
        """
        if not self._device_dead:
            with _NO_TORCH_FUNCTION():
                self._late_trigger(act=False)  # and pinpointed, as before an update
        trace = self._trace
        a = trace.anomaly
        if a is None:
            self._localize(trace)
        else:
            # found while the step ran: count what it took with it since (the step end does
            # the same), so that a warning said now quotes the count the report will
            props, n = propagators(trace, a.record, a.path)
            if n != a.propagator_count:
                a.propagators, a.propagator_count = props, n
                a.summary = self._front_words(summarize(a))
        return trace.anomaly

    def state_dict(self) -> dict[str, Any]:
        """What survives a checkpoint: the step counter, the flight recorder's per-step
        summaries (loss, gradient norm, max logit, scale, anomaly, diagnoses; no per-tensor
        records) and the anomalies (the first and the last 31).

        Example:
            >>> state = nw.state_dict()                         # doctest: +SKIP
            >>> fresh.load_state_dict(state)                    # doctest: +SKIP
        """
        steps = []
        for t in self.history:
            d = t.to_dict()
            d.update(records=[], calls=[], ops=[], mutations=[])
            steps.append(d)
        kept = (
            self.anomalies
            if len(self.anomalies) <= 32
            else (self.anomalies[:1] + self.anomalies[-31:])
        )
        state: dict[str, Any] = _plain(
            {
                "version": 1,
                "step": self._step,
                "anomaly_count": len(self.anomalies),
                "steps": steps,
                "anomalies": [a.to_dict() for a in kept],
            }
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (before attaching): step numbering continues and the
        report shows the history from before the resume."""
        if self._attached:
            raise NanwatchError(
                "load_state_dict() on an attached Watcher; call it before attach()."
            )
        version = state.get("version")
        if version != 1:
            raise NanwatchError(
                f"Watcher state version {version!r} is not supported (this nanwatch reads "
                "version 1); the checkpoint was written by another nanwatch version."
            )
        self.history.clear()
        self._first_bad = None
        for d in state.get("steps", []):
            self.history.append(StepTrace.from_dict(d))
        self.anomalies = [Anomaly.from_dict(a) for a in state.get("anomalies", [])]
        self.first_anomaly = self.anomalies[0] if self.anomalies else None
        self._step = int(state["step"])
        self._resumed_at = self._step
        self._reset_step()

    def close(self, exc: BaseException | None = None, *, during: str | None = None) -> Any:
        """End watching as the context manager's exit would: with ``exc``, classify it,
        finish the step from what is safe to read and write the post-mortem (returned as
        the path of its JSON file, or None); without, end the step. Always detaches.
        ``during``: what ran unwatched when ``exc`` was raised (``"validation"``, while a
        framework had paused the watching): the post-mortem says so, not that a step did."""
        if self._forked:
            return None
        path = None
        try:
            with _NO_TORCH_FUNCTION():  # see __exit__
                if exc is None:
                    self._final_boundary()
                else:
                    path = self._on_exception(exc, during=during)
        finally:
            self.detach()
            _frames.hide_own_frames(exc)  # after the post-mortem read it
        return path

    def _final_boundary(self) -> None:
        """End the run's last step. On the accelerator path an anomaly of that step is read
        only now, and raised from the exit: the CPU path raised it inside the ``with``
        block, whose exit wrote the post-mortem; this one writes it too."""
        try:
            self._boundary(final=True)
        except AnomalyError as err:
            if self._read_late() and getattr(err, "_nanwatch_owner", None) == id(self):
                self._on_exception(err)
            raise

    def note(self, kind: str, path: str, *, source: str | None = None, **data: Any) -> Note:
        """Add evidence to the current step for the rules (see :class:`nanwatch.Note`)."""
        n = Note(kind=kind, path=path, data=data, source=source)
        self._trace.notes.append(n)
        return n

    def record_of(self, t: torch.Tensor) -> Record | None:
        """The record of the current step that holds ``t`` (by identity and version), if a
        watched module produced or measured it."""
        entry = self._known.get(id(t))
        if entry is None or entry[0]() is not t or entry[2] != _version(t):
            return None
        return self._trace.record(entry[1])

    def measured_minmax(self, t: torch.Tensor) -> tuple[Any, Any] | None:
        """The min and max this step already measured for ``t`` (a watched module's output,
        unchanged since), so a guard need not read it again: 0-d tensors on ``t``'s device
        before the step's one transfer, floats on CPU. None when ``t`` was not measured as
        it is now."""
        entry = self._known.get(id(t))
        if entry is None or entry[0]() is not t or entry[2] != _version(t):
            return None
        return self._minmax.get(entry[1])

    def _unread_bad(self) -> bool:
        """The accelerator path: a statistic of this step still on the device is an anomaly
        the CPU path would have found when it measured it (:func:`is_trigger`, as in
        :meth:`_note_bad`: a -inf a loss module is given is no anomaly) -- a value the watched
        modules made (or their data) is bad, and the late read will trace it. One read, asked
        only by a guard that found a non-finite input (see ``guards._Probe.upstream``)."""
        pending = self._pending
        if not pending:
            return False
        with _NO_TORCH_FUNCTION(), torch.no_grad():
            got = read_scalars([x for _, lo, hi, _ in pending for x in (lo, hi)])
        for i, (rec, _, _, n) in enumerate(pending):
            lo, hi = got[2 * i], got[2 * i + 1]
            if math.isfinite(lo) and math.isfinite(hi):
                continue
            rec.stat = TensorStat(lo, hi, n)  # as it will be read; the read fills it again
            try:
                found = is_trigger(
                    rec, self._trace, allow=self.config.allow, scaled_grads=self._scaled
                )
            finally:
                rec.stat = None
            if found:
                return True
        return False

    def made_by_watched(self, t: torch.Tensor) -> bool:
        """``t`` is, or is a copy or view of, a tensor a watched module returned this step
        (its autograd node, through at most three casts and views, was recorded): a value
        bad in it is traced to that module by the step's localization."""
        node = t.grad_fn
        for _ in range(4):
            if node is None:
                return False
            if node in self._recorded_nodes:
                return True
            if type(node).__name__ not in _SAFE_NODES and not type(node).__name__.startswith(
                "ToCopy"
            ):
                return False
            nxt = node.next_functions
            node = nxt[0][0] if len(nxt) == 1 else None
        return False

    @property
    def report(self) -> Report:
        """The report of everything recorded so far (a rich renderable; ``.save(path)``)."""
        from nanwatch.report import Report

        return Report.from_watcher(self)

    def replay(
        self, fn: Callable[[], Any], *, rng_state: torch.Tensor | None = None
    ) -> ops.ReplayResult:
        """Run ``fn`` (the failing step's forward and backward, no optimizer step) again with
        every aten op checked, forward and backward, and the source line of the op that
        created the first NaN/inf. Gradients, buffers and RNG state are put back afterwards,
        so the replay changes nothing; ``rng_state`` (``torch.get_rng_state()`` taken at the
        start of the step) makes dropout masks repeat. The result also completes the last
        anomaly: its op, or ``transient`` when the replay ran clean.

        Example:
            >>> def step_fn():
            ...     criterion(model(x), y).backward()
            >>> result = nw.replay(step_fn)          # doctest: +SKIP
        """
        params = [p for _, _, p in self._params]
        saved_grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        devices = {p.device for p in params}
        result = ops.ReplayResult()
        prev = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
        with contextlib.ExitStack() as stack:
            for root in self.roots:
                stack.enter_context(ops.preserved_state(root, devices))
            if rng_state is not None:
                torch.set_rng_state(rng_state)
            stack.enter_context(ops._replay_scope())
            if self.config.mode == "sentinel" and not self.global_hooks:
                # the roots' children have no hooks: the replay names their ops itself
                stack.enter_context(ops.named_calls(self.roots, self._unhooked_path))
            torch.autograd.set_detect_anomaly(True, check_nan=False)
            stack.callback(torch.autograd.set_detect_anomaly, prev[0], check_nan=prev[1])
            chk = ops.OpChecker(
                current_path=ops.replay_path,
                on_error=self._checker_fault,
                max_events=256,
                param_of=self._param_of,
            )
            before = ops.rng_states(devices)
            try:
                with chk:
                    fn()
            except Exception as exc:
                result.error = f"{type(exc).__name__}: {exc}"
            finally:
                for p, g in zip(params, saved_grads, strict=True):
                    p.grad = g
            result.events = chk.events
            result.attempts = 1
            # with the step's own starting state the draws repeat: the replay is faithful
            result.random = rng_state is None and ops.drew_random(before, devices)
        last = self.anomalies[-1] if self.anomalies else None
        if last is not None and last.kind is AnomalyKind.GRADIENT:
            # a weight's gradient bad first (a gradient penalty's double backward): the
            # replay's traced backward op made it
            adopt_backward_op(last, result.events)
        # only a value born in forward or backward code can be reproduced or not by a replay:
        # bad data and broken weights are bad in the replay too, with no op to blame
        if last is not None and last.kind in (AnomalyKind.FORWARD, AnomalyKind.BACKWARD):
            phase = Phase.BACKWARD if last.kind is AnomalyKind.BACKWARD else Phase.FORWARD
            # is_birth: in backward a -inf is a result, not a mask (an inf/-x/d**2 at
            # d = 0); in forward, a -inf only an overflow could make (a float16 matmul)
            first = next(
                (e for e in result.events if e.phase is phase and is_birth(e)),
                result.first(),
            )
            if first is not None:
                last.op = first
                self._replayed_below(last)
            elif result.clean and result.conclusive:
                last.transient = True
            last.summary = summarize(last)
            for t in (self._trace, *reversed(self.history)):
                if t.anomaly is last:  # what the replay found changes the diagnosis
                    t.diagnoses = self._evaluate(t)
                    break
        return result

    # ------------------------------------------------------------------ hook factories
    # Every hook body runs with torch-function handling off: nanwatch's own statistics must
    # not pass through a user's TorchFunctionMode, which would both slow them down and show
    # them to the user's mode.
    # The hooks are bound to their module: torch.ao's module swaps (prepare_qat, convert),
    # fuse_modules and the sparsifier register a replaced module's forward hooks again on
    # its replacement, without kwargs. Such a copy does nothing (the replacement is hooked
    # at the next root call, see _check_tree) and is removed at detach (_copies.sweep).
    def _make_pre(self, info: _ModInfo, owner: nn.Module) -> Callable[..., None]:
        pre = self._pre
        ref = weakref.ref(owner)

        def pre_hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
        ) -> None:
            if _compiling() or kwargs is None or module is not ref():
                return
            with _NO_TORCH_FUNCTION():
                pre(info, module, args, kwargs)

        return pre_hook

    def _make_post(self, info: _ModInfo, owner: nn.Module) -> Callable[..., None]:
        post = self._post
        ref = weakref.ref(owner)

        def post_hook(module: nn.Module, args: tuple[Any, ...], *rest: Any) -> None:
            if _compiling() or len(rest) != 2 or module is not ref():
                return
            with _NO_TORCH_FUNCTION():
                post(info, module, args, rest[0], rest[1])

        return post_hook

    def _pre(
        self, info: _ModInfo, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if not self._attached:
            return
        if _tracing():
            if transforming():  # vmap/grad ran the model: no compiled one (see _on_backward)
                self._transformed = True
            return
        if not self._stack:  # once per call from outside every watched call
            self._in_capture = capturing()
            if self._in_capture:
                self._capture_aside()
                return
        if info.post_only and not self._forensic:
            return  # watched from its forward hook alone
        if ops.replaying():
            ops.push_path(info.path)
            return
        if "pre" in self._disabled_hooks:
            return
        try:
            if ops.current_autograd_node() is not None:
                # activation checkpointing recomputing in backward: not a call of the step,
                # and not the next step's first call (a model checkpointed whole)
                return
            outer_grad = not self._stack and torch.is_grad_enabled()
            if outer_grad and not self._grad_call:
                # the step's first call with gradients on, from outside every watched call
                if self._foldable:
                    self._fold(info.path)
                self._grad_call = True
            if info.first_root:
                self._first_root_ran = True
                self._maybe_begin_step()
            elif not self._stack and not self._first_root_ran:
                # the first root is never called (a LightningModule whose training_step
                # calls self.net): its parts called from outside mark the steps instead
                self._maybe_begin_step()
            elif (
                not self._stack
                and info.is_root
                and self._backward_called
                and not torch.is_grad_enabled()
            ):
                # another root called under no_grad after a training step (an EMA teacher, a
                # key encoder run before the model): it begins the next step
                self._maybe_begin_step(trained_only=True)
            elif not self._stack and info.is_root and self._updated and self._backward_called:
                # another root called from outside after this step's update: the next
                # iteration begins (a GAN's discriminator on real data, the generator watched
                # first), not only at the first root's call after that backward
                self._maybe_begin_step()
            if outer_grad:
                self._grad_call = True  # (again when this call began a new step)
            if not (self._full or info.is_root or not self._stack):
                return  # a sampled-out step watches the calls made from outside, as roots
            if info.is_root and not self._stack and self._tree_step != self._step:
                self._check_tree()
            call = self._open_call(info)
            owners = None if self._full else self._buffer_owners(module)
            frame = _Frame(call, module, args, kwargs, owners=owners)
            if call.parent in self._own_saved.starts:  # read late: see _kept
                self._own_saved.gave(call.parent, args, kwargs, stop=self._recorded_nodes)
            self._stack.append(frame)
            self._record_inputs(info, call, args, kwargs)
            if self._keeps_own_saved():
                self._own_saved.begin(info.path, call.id)
            if call.root:  # host-side counters only, once per root call
                frame.inputs = tuple(_version(t) for _, t in self._walk(args, "input", kwargs))
                frame.rng = ops.forward_rng(args, kwargs)
                frame.modes = function_modes()
                if self._read_late():
                    # a bad input or output is read after the call returned, when the
                    # user's line has moved on (to backward()): keep where it called the
                    # model (a few frames' lines, no read of any value)
                    frame.site = _site_at(sys._getframe(1))
                    frame.autocast = autocast_state()
                    frame.weights = self._weight_versions()
                    if self._params:  # a step run on a stream of the user's own
                        note_stream(self._params[0][2].device)
            if self._new_trigger is not None:
                if call.root:  # a bad input: the user's line that called the model, now
                    self._note_call_site(info, module)
                self._handle_trigger(None)
        except NanwatchError:
            raise
        except Exception as exc:
            self._fault("pre", "forward pre-hook", exc)

    def _capture_aside(self) -> None:
        """A CUDA graph is being captured (``torch.cuda.graph``,
        ``make_graphed_callables``): any host read, a step boundary's flush included, would
        invalidate the capture and fail the user's run, so the hooks step aside until the
        next eager call, and say once that the replays are not watched."""
        if self._capture_warned:
            return
        self._capture_warned = True
        _frames.warn_at_user(
            "nanwatch: a CUDA graph is being captured through the watched modules. nanwatch "
            "steps aside while it captures, and its replays run no Python hooks: the "
            "captured steps are not watched. To find a NaN, run the steps eagerly under "
            "nanwatch (no torch.cuda.graph, no mode='reduce-overhead') and capture after "
            "debugging.",
            NanwatchWarning,
            safe=True,
        )

    def _post(
        self,
        info: _ModInfo,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
    ) -> None:
        if not self._attached or _tracing() or self._in_capture:
            return
        forensic = self._forensic
        if ops.replaying():
            if not info.post_only or forensic:
                ops.pop_path()
            if output is not None:
                outs = [t for _, t in iter_tensors(output, "output")]
                ops.stamp_graph(outs, info.path)
            return
        if "post" in self._disabled_hooks:
            return
        try:
            if not (self._full or info.is_root or self._is_open(module)):
                return
            if ops.current_autograd_node() is not None:
                self._trace.recomputed += 1
                self._hook_recomputed(info, output)
                return
            pre_opened = not info.post_only or forensic
            frame: _Frame | None = None
            if pre_opened:
                stack = self._stack
                if stack and stack[-1].module is module:
                    frame = stack.pop()  # the innermost call returns (_pop_frame's common case)
                else:
                    frame = self._pop_frame(module)
            if pre_opened and frame is None:
                return  # the call began before attach(), or in a skipped step
            if output is None and sys.exc_info()[1] is not None:
                return  # forward raised; always_call ran us to keep the stack straight
            if frame is not None:
                call = frame.call
                if call.root:
                    # its inputs, for a replay after an anomaly in its backward (a
                    # non-tensor argument cannot be rebuilt from records): the step's
                    # latest call of each root, released at the step's end
                    self._root_frames[call.path] = frame
                if frame.versions is not None:
                    written = frame.written()
                    if written:
                        self._state_writes[call.id] = written
            else:
                call = self._open_call(info)
                self._record_inputs(info, call, args, kwargs, after=True)
            skip = info.passthrough or (
                info.preserving
                and not forensic
                and _wide(output)
                and not (info.reads_stats and _reads_running_stats(module))
            )
            call.passthrough = skip
            # a skipped module fed only data that needs no gradient (an embedding's ids): the
            # gradient of its output goes straight into its weights, and is hooked
            leaf = skip and not _needs_grad(args)
            if call.id in self._own_saved.starts:  # read late: see _kept
                self._own_saved.end(
                    info.path,
                    call.id,
                    args,
                    kwargs,
                    output,
                    stop=self._recorded_nodes,
                    risky=_steep_capable,
                )
            self._record_outputs(info, call, output, skip=skip, leaf=leaf)
            call.end = self._idx
            if self._lazy_left and info.is_root and not self._stack:
                # a lazy module's first forward materialized its parameters: their
                # gradients are checked from this backward on
                self._refresh_params()
            if forensic:
                outs = [t for _, t in iter_tensors(output, "output")]
                ops.stamp_graph(outs, info.path)
            if self._new_trigger is not None:
                self._handle_trigger((call, module, args, kwargs))
            elif call.root and not self._stack and self._read_at_root_end():
                self._late_trigger(act=True, current=(call, module, args, kwargs))
            if self._idx > self.config.max_records_per_step and not self._quiet:
                self._overflow_step()
        except NanwatchError:
            raise
        except Exception as exc:
            self._fault("post", "forward hook", exc)

    # ------------------------------------------------------------------ global hooks
    def _global_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if _compiling() or not self._attached:  # (standing aside: see _stand_aside)
            return
        with _NO_TORCH_FUNCTION():
            # torch passes global pre-hooks no keyword arguments: a root's (the batch of a
            # model called with input_ids=...) are read from the call's frame
            kwargs = {} if self._stack else _frames.call_kwargs(module, sys._getframe(1))
            info = self._info_for(module, args, kwargs, sys._getframe(1))
            if info is not None:
                self._pre(info, module, args, kwargs)

    def _global_post(self, module: nn.Module, args: tuple[Any, ...], *rest: Any) -> None:
        # (kwargs, output) normally; PyTorch calls always-call global hooks with (output)
        # alone when forward raised
        if _compiling():
            return
        kwargs, output = (rest[0], rest[1]) if len(rest) == 2 else ({}, rest[0])
        info = self._infos.get(module)
        if info is not None:
            with _NO_TORCH_FUNCTION():
                self._post(info, module, args, kwargs, output)

    def _info_for(
        self,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        caller: FrameType | None = None,
    ) -> _ModInfo | None:
        """The module's info; a module seen for the first time is named on the spot: from
        outside any watched call it is a new root (with all its submodules), from inside
        one it is named below the running module. ``caller``: the frame of the module's
        call (a new root takes the name of the one it replaces, see :meth:`_same_as_before`)."""
        info = self._infos.get(module)
        if info is not None or not self._attached or ops.replaying():
            return info
        if isinstance(module, torch.jit.ScriptModule):
            return None
        try:
            if self._stack:
                parent = self._stack[-1]
                rel = next((q for q, m in parent.module.named_modules() if m is module and q), None)
                path = f"{parent.call.path}.{rel or '<' + type(module).__name__ + '>'}"
                found = [(module, _ModInfo(path, module, is_root=False, first_root=False))]
            else:
                site, before = self._same_as_before(module, caller)
                if before is not None:
                    self._let_go(before[0]())
                taken = {i.path for _, i in self._modules}
                found = _name_modules([module], taken=taken, first=not self._modules)
                if before is not None:
                    old = found[0][1].path
                    for _, i in found:  # the name of the module it replaces
                        i.path = before[1] + i.path[len(old) :]
                if site is not None:
                    self._site_roots[site] = (weakref.ref(module), found[0][1].path)
                self.roots.append(module)
            self._register_found(found, args, kwargs)
        except GuardError:
            raise  # a guard of the module just found stopped its first call: not our fault
        except Exception as exc:
            self._fault("pre", "module discovery", exc)
            return None
        return self._infos.get(module)

    def _same_as_before(
        self, module: nn.Module, caller: FrameType | None
    ) -> tuple[tuple[Any, ...] | None, tuple[weakref.ref[nn.Module], str] | None]:
        """For a new root found by the global hooks: the key of its call site (the user's
        line that called it, the class and its plain settings), and what was found there
        before (a weak reference to the module and its name), or None. A module without
        parameters made anew at each call (``nn.CrossEntropyLoss()(out, y)`` in the loop)
        is one logical module: the same class called from the same line with the same
        settings. A module with parameters is not (heads in a list, each called by one
        line of a loop, train apart)."""
        frame = _frames.user_frame(caller) if caller is not None else None
        if frame is None or next(module.parameters(), None) is not None:
            return None, None
        plain = tuple(
            sorted(
                (k, v)
                for k, v in vars(module).items()
                if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None)))
            )
        )
        site = (frame.f_code, frame.f_lasti, type(module), plain)
        return site, self._site_roots.get(site)

    def _let_go(self, module: nn.Module | None) -> None:
        """Drop a root found by the global hooks that a module made at the same line
        replaces (see :meth:`_same_as_before`): its hooks are removed and nothing of the
        watcher holds it, so a loss made at each step does not pile up."""
        if module is None:
            return
        self._unwatch(list(module.modules()))
        self.roots = [r for r in self.roots if r is not module]

    def _unwatch(self, modules: list[nn.Module]) -> None:
        """Stop watching exactly ``modules`` (not their submodules, which may live on
        elsewhere): their hooks are removed and nothing of the watcher holds them."""
        gone = {id(m) for m in modules}
        dicts = {
            id(d)
            for m in modules
            for d in (m._forward_pre_hooks, m._forward_hooks, m._backward_hooks)
        }
        kept, removed, fns = [], [], []
        for h in self._handles:
            ref = getattr(h, "hooks_dict_ref", None)
            d = ref() if ref is not None else None
            if d is not None and id(d) in dicts:
                f = d.get(h.id)
                if f is not None:
                    fns.append(f)
                h.remove()
                removed.append(h.id)
            else:
                kept.append(h)
        self._handles = kept
        _copies.unhide(removed)
        if fns:  # the copies torch registered of them on a replacement (see _make_pre)
            _copies.sweep((m for r in self.roots for m in r.modules()), fns)
        self._modules = [(m, i) for m, i in self._modules if id(m) not in gone]
        for m in modules:
            self._infos.pop(m, None)

    def _register_found(
        self,
        found: list[tuple[nn.Module, _ModInfo]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        added: list[tuple[nn.Module, str]] = []
        for m, info in found:
            if m in self._infos:
                continue
            self._infos[m] = info
            self._modules.append((m, info))
            added.append((m, info.path))
        self._set_params()
        self._hook_params()
        if self.config.guards:
            from nanwatch import guards

            handles = guards.attach(self, added)
            if handles:
                self._handles.extend(handles)
                _copies.hide(h.id for h in handles)
                # this call's pre-hooks were chosen before these existed: run them now
                first = found[0][0]
                for h in handles:
                    hooks = h.hooks_dict_ref()
                    if hooks is first._forward_pre_hooks and h.id in hooks:
                        fn = hooks[h.id]
                        if h.id in first._forward_pre_hooks_with_kwargs:
                            fn(first, args, kwargs)
                        else:
                            fn(first, args)

    # ------------------------------------------------------------------ recording
    def _reset_step(self) -> None:
        self._trace = StepTrace(step=self._step)
        self._idx = 0
        self._known = {}
        self._minmax = {}
        self._recorded_nodes.clear()  # the autograd nodes of the step's recorded tensors
        #: a root call's outputs by their memory (data_ptr, shape, dtype): a root's input
        #: that ``.detach()`` cut from such an output shares its storage (see _detached_from)
        self._root_out_ptrs: dict[tuple[int, tuple[int, ...], torch.dtype], tuple[int, int]] = {}
        self._stack = []
        self._root_frames: dict[str, _Frame] = {}  # path -> its latest finished root call
        #: the functional loss's call and where backward() began on it (see _record_loss)
        self._loss_at: tuple[Call, _FrameAt | None] | None = None
        self._state_writes: dict[int, list[str]] = {}  # call id -> own buffers it wrote
        self._pending = []
        self._prefetched = []
        self._described_bad = 0  # records described in full this step (see _describe_bad)
        self._pending_grads = []
        self._pending_rows = []
        self._pending_nodes = []
        #: the gradients whose norms are still on their way (see _check_grads)
        self._grads_kept: list[torch.Tensor] | None = None
        self._kept_saved = 0  # bytes of flagged nodes' saved values kept (see _keep_saved)
        self._loss_snaps = []
        self._own_saved.reset()
        self._loss_held = None
        #: read late: the nodes of the roots' inputs the user's code computed from watched
        #: outputs this step, and what the nodes below them saved, kept as backward began
        #: (see _keep_derived)
        self._derived_fns: list[Any] = []
        self._input_snaps: list[ops.SavedNode] = []
        #: gradients your code wrote after backward, on the accelerator path: their norms,
        #: left on the device and read at the step end (see _read_written_later)
        self._written_reads: list[tuple[Any, dict[str, Any], list[str], list[Any], Any]] = []
        #: outputs recorded under no_grad, per module path: a reentrant checkpoint's first
        #: pass, whose recomputation in backward gets their gradient hooks
        self._unhooked: dict[str, list[Record]] = {}
        self._new_trigger = None
        self._pending_data: Anomaly | None = None  # bad data that has reached nothing yet
        #: the watched weights each optimizer step of this step (and the last) updated:
        #: id -> (optimizer class, param group index, the weight's version after the update)
        self._stepped_prev: dict[int, tuple[str, int, int]] = getattr(self, "_stepped", {})
        self._stepped: dict[int, tuple[str, int, int]] = {}
        self._backward_seen = False
        self._backward_called = False  # backward() (not autograd.grad) ran this step
        #: each backward() of this step that finished: the tensors it ran on (weakly) and the
        #: user's line that called it (see _backward_began); the one running, until it ends
        self._backwards_done: list[tuple[list[weakref.ReferenceType[torch.Tensor]], Any]] = []
        self._backward_now: tuple[list[weakref.ReferenceType[torch.Tensor]], Any] | None = None
        self._backward_via: str | None = None  # see _backward_began
        self._transformed = False  # a watched module was called under a torch.func transform
        self._grad_call = False  # a call from outside with gradients on was made this step
        self._updated = False  # an optimizer stepped this step
        self._applied = False  # and its update returned (the post-hook ran)
        self._applied_calls = 0  # len(trace.calls) when the step's last update returned
        #: the accelerator path: the weights as the forwards read late computed with them,
        #: taken before an update (see _on_optimizer_step); None when not needed
        self._before_update: (
            tuple[list[torch.Tensor], dict[int, Any], dict[int, Any], dict[int, int], int] | None
        ) = None
        self._versions: dict[int, int] | None = None  # see _check_before_update
        self._late = False  # a trigger read after its calls ended (see _late_trigger)
        self._ops_mark = None  # see __init__
        self._weights_at_grad: tuple[int, ...] | None = None  # versions after autograd.grad
        #: torch.autograd.grad returned gradients of watched weights (no create_graph):
        #: one of them, with its module and name there (see :meth:`_trained_by_grad`)
        self._weight_grads_taken: tuple[nn.Module, str, torch.Tensor | None] | None = None
        self._eob_queued = False
        self._grads_checked = False
        self._after_backward: tuple[int, ...] | None = None
        self._marks_at_backward: tuple[int, ...] | None = None  # see _discarded
        self._user_loss = None
        self._loss_factor: tuple[torch.Tensor, bool] | None = None
        self._grad_scale = None
        self._scaled_loss = None
        self._begun = False
        self._backward_site = (None, None)
        self._loss_node_bad = False
        self._loss_last = None
        self._loss_ref = None
        self._loss_risky = None
        #: the loss backward() ran on, when its code's saved values were kept (read late,
        #: the accelerator path): held until the step ends, so its graph can be read after
        #: backward if the forward's statistics had not landed as it began (ops.saved_from)
        self._late_loss = None
        #: each such loss of the step by its record's index: an optimizer's closure
        #: (LBFGS) runs backward on several losses in one step, all read at its end
        self._late_losses = {}
        self._late_stops = []
        self._late_values = {}
        self._flag_site: tuple[str | None, str | None] = (None, None)
        if self._anomaly_paused and self._attached:
            self._anomaly_paused = False
            torch.autograd.set_detect_anomaly(True, check_nan=False)
        for h in self._tensor_handles:
            h.remove()
        self._tensor_handles = []
        mode = self.config.mode
        self._full = mode != "sentinel" and self._step % self.config.sample_every == 0
        self._trace.full = self._full

    def _open_call(self, info: _ModInfo) -> Call:
        calls = self._trace.calls
        stack = self._stack
        # positional (id, path, module_type, parent, start, end, passthrough, is_loss, root,
        # arithmetic): this runs for every module call. A root, or a module called from code
        # outside every watched call (a LightningModule's training_step calling self.net):
        # its inputs are data
        call = Call(
            len(calls),
            info.path,
            info.type_name,
            stack[-1].call.id if stack else None,
            self._idx,
            -1,
            info.passthrough,
            info.is_loss,
            info.is_root or not stack,
            info.arithmetic,
        )
        calls.append(call)
        return call

    def _pop_frame(self, module: nn.Module) -> _Frame | None:
        stack = self._stack
        for i in range(len(stack) - 1, -1, -1):
            if stack[i].module is module:
                frame = stack[i]
                del stack[i:]  # frames above it belong to calls that raised (KeyboardInterrupt)
                return frame
        return None

    def _is_open(self, module: nn.Module) -> bool:
        """A call of ``module`` made from outside every watched call is open (the only
        frame on the stack)."""
        return len(self._stack) == 1 and self._stack[0].module is module

    def _current_path(self) -> str | None:
        return self._stack[-1].call.path if self._stack else None

    def _new_record(
        self,
        phase: Phase,
        path: str,
        role: str,
        t: torch.Tensor,
        call: int,
        *,
        source: int | None = None,
        module_type: str = "",
    ) -> Record:
        # positional: this runs for every tensor of every module call
        rec = Record(
            self._idx,
            self._step,
            phase,
            path,
            role,
            dtype_name(t.dtype),
            device_name(t.device),
            tuple(t.shape) if not t.is_nested else (t.size(0),),
            None,
            call,
            source,
            module_type,
        )
        rec.seq = next(_RECORD_ORDER)
        self._idx += 1
        self._trace.records.append(rec)
        return rec

    def _measure(self, rec: Record, t: torch.Tensor, *, rows: bool = False) -> None:
        """Statistics of ``t`` into ``rec``: read at once on CPU (no device to wait for),
        kept on the device until the flush elsewhere. Counts only for bad tensors. A view of
        values measured already in this step, unchanged since, is not read again."""
        if t.device.type != "cpu" or self._defer_cpu:
            n = numel(t)
            big = n >= _REREAD_NUMEL
            mm = self._read_of(t) if big and t._base is not None else None
            if mm is None:
                mm = minmax(t)
                if mm is None:
                    return
                if big:
                    self._remember_read(rec, t)
            # rec.stat stays None (not read yet) until the flush fills it
            self._pending.append((rec, mm[0], mm[1], n))
            self._minmax[rec.index] = mm
            if rows:  # the batch: which samples are bad (and how many of their values:
                # the batch may be freed by the read), read only if any is
                flags = bad_row_counts(t)
                if flags is not None:
                    self._pending_rows.append((rec, flags))
            return
        if self._forensic:
            rec.stat = describe(t, rows=rows)
            if rec.stat is not None and not rec.stat.finite:
                self._note_bad(rec)
            return
        if t.dtype in _FAST_DTYPES and t.layout is torch.strided and not t.is_nested:
            n = t.numel()
            if n == 0 or t.is_meta:
                return
            big = n >= _REREAD_NUMEL
            seen = self._read_of(t) if big and t._base is not None else None
            if seen is not None:
                lo, hi = seen
                self._minmax[rec.index] = seen
            else:
                try:
                    a, b = aminmax(t.detach())  # detach: cheaper than a no_grad block
                    lo, hi = a.item(), b.item()
                    self._minmax[rec.index] = (lo, hi)
                except RuntimeError:
                    if _has_no_data(t):
                        return  # a fake or functional tensor (tracing): nothing to measure
                    raise
                if big:
                    self._remember_read(rec, t)
        else:
            mm = minmax(t)  # complex, float8, sparse, nested
            if mm is None:
                return
            lo, hi, n = mm[0].item(), mm[1].item(), numel(t)
        if lo - lo == 0 and hi - hi == 0:  # both finite (inf - inf and NaN give NaN)
            rec.stat = TensorStat(lo, hi, n)
        else:
            rec.stat = describe(t, rows=rows)
            self._note_bad(rec)

    def _remember_read(self, rec: Record, t: torch.Tensor) -> None:
        """Keep where ``t``'s values lie, for :meth:`_read_of`: a contiguous tensor's memory
        is its first element's address and its number of elements (its values as they are
        stored: no lazy negation or conjugation). Its base is kept (weakly), not ``t``: a
        view's Python object is often gone by the time a view of the same base is seen
        (``self.head(h).flatten(0, 1)``), the base lives as long as any of its views."""
        if (
            t.layout is not torch.strided
            or not t.is_contiguous()
            or t.is_inference()
            or t.is_neg()
            or t.is_conj()
        ):
            return
        reads = self._reads if self._reads_for is self._minmax else None
        if reads is None:  # a new step (or one folded into the last): indices start again
            reads = self._reads = {}
            self._reads_for = self._minmax
        try:
            key = (t.data_ptr(), t.dtype, t.numel())
        except RuntimeError:  # no storage (a functional or wrapper tensor): nothing to share
            return
        base = t._base
        reads[key] = (weakref.ref(t if base is None else base), rec.index, t._version)

    def _read_of(self, t: torch.Tensor) -> tuple[Any, Any] | None:
        """The min and max this step read of exactly ``t``'s values: ``t`` is a view (a
        root's ``logits.flatten(0, 1)``, the gradient a reshape hands back) of the same
        memory as a tensor measured before, of the same base (alive, so that memory is
        not reused; its views share one version counter), and written by nothing since.
        None: ``t`` is to be read."""
        if (
            self._reads_for is not self._minmax
            or t.layout is not torch.strided
            or not t.is_contiguous()
            or t.is_inference()
            or t.is_neg()
            or t.is_conj()
        ):
            return None
        try:
            found = self._reads.get((t.data_ptr(), t.dtype, t.numel()))
        except RuntimeError:
            return None
        if found is None:
            return None
        ref, index, version = found
        base = t._base
        if ref() is not (t if base is None else base) or t._version != version:
            return None
        return self._minmax.get(index)

    def _note_bad(self, rec: Record) -> None:
        if (
            self._new_trigger is None
            and (self._trace.anomaly is None or self._trace.anomaly is self._pending_data)
            and is_trigger(rec, self._trace, allow=self.config.allow, scaled_grads=self._scaled)
        ):
            self._new_trigger = rec

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Global optimizer pre-hook: what each update of watched weights is made of (the
        learning rate, eps, weight decay and momentum, the weights' dtypes), as an
        ``"optimizer"`` note for the rules, and a ``"stale_grads"`` note when gradients it
        is about to apply still hold those of its last step (NW307, see
        :meth:`_grads_around_backward`).
        One dict per parameter group; no tensor is read."""
        if (
            "optimizer" in self._disabled_hooks
            or not self._attached
            or threading.get_ident() != self._thread
        ):
            return
        try:
            # accelerators: forwards since backward began (a second forward of the step, an
            # evaluation) are read only at the step end, after this update: what the update
            # is told from is kept now, and the weights' maxima computed on their devices
            # (no sync), so a NaN/inf read late in them is told from the weights they
            # computed with (see _check_before_update)
            before = (
                (dict(self._stepped), dict(self._opt_calls))
                if self._read_late() and self._pending and self._before_update is None
                else None
            )
            # what the weights were last written by before this update began (an entry a
            # step, empty when this is its first optimizer): the forward read before the
            # update (_flush_before_update) is judged with it, as a CPU trigger is
            prior = dict(self._stepped) if self._prefetched else None
            groups: list[dict[str, Any]] = []
            name = type(optimizer).__name__
            ref = weakref.ref(optimizer)
            qualnames: dict[int, str] | None = None
            marks = self._grad_marks
            stale: list[str] = []  # weights whose gradient was never reset since last step
            stale_group = -1
            # those backward added to with no visible reset: (name, group, the gradient's
            # norm before that backward, when a reset could have been invisible)
            added: list[tuple[str, int, torch.Tensor | None]] = []
            written: dict[str, tuple[str, torch.Tensor]] = {}  # see _grads_written
            in_place: dict[str, torch.Tensor] = {}
            # the weights whose gradients the last backward checked, now all None: reset
            # between backward() and this step (see _grads_written)
            # (this step's backward: an optimizer given a closure runs its own later)
            closure = any(map(callable, args)) or callable(kwargs.get("closure"))
            checked = getattr(self, "_grads_seen", None) if self._grads_checked else None
            dropped: list[Any] | None = [] if checked and not closure else None
            checked = checked or {}
            for gi, g in enumerate(getattr(optimizer, "param_groups", ())):
                every = g.get("params", ())
                for p in every:  # unwatched ones too: a weight watched later (a jit'd
                    # submodule's, found non-finite by a replay) is told what updated it
                    self._stepped[id(p)] = (name, gi, -1)
                    self._stepped_by[id(p)] = ref
                ps = [p for p in every if id(p) in self._param_ids]
                if not ps:
                    continue
                if dropped is not None:  # backward gave them gradients, none is left (NW311)
                    if any(p.grad is not None for p in ps):
                        dropped = None
                    else:
                        dropped += [p for p in ps if id(p) in checked]
                if qualnames is None:
                    qualnames = {id(p): q for q, _, p in self._params}
                for p in ps if marks else ():
                    m = marks.get(id(p))
                    if m is not None and m[4] and p.grad is m[1]():
                        added.append((qualnames[id(p)], gi, m[5]))
                self._grads_written(ps, qualnames, written, in_place)
                entry: dict[str, Any] = {
                    "group": gi,
                    "params": len(ps),
                    "names": [qualnames[id(p)] for p in ps[:8]],
                    "dtypes": sorted({dtype_name(p.dtype) for p in ps}),
                }
                for key in ("lr", "eps", "initial_lr"):
                    nums = _plain_numbers(g.get(key))
                    if nums:
                        entry[key] = nums[0] if len(nums) == 1 else nums
                if isinstance(g.get("centered"), bool):  # RMSprop
                    entry["centered"] = g["centered"]
                # the running averages' coefficients (NW306: one >= 1 grows the update):
                # SGD's momentum, Adam's betas, RMSprop's alpha, Adadelta's rho
                for key in ("momentum", "dampening", "betas", "alpha", "rho"):
                    nums = _plain_numbers(g.get(key))
                    if nums and (any(nums) or key not in ("momentum", "dampening")):
                        entry[key] = nums[0] if len(nums) == 1 else nums[:2]
                if g.get("nesterov") is True:
                    entry["nesterov"] = True
                # what the weight decay does to the update (NW306): only when it is on
                decay = _plain_numbers(g.get("weight_decay"))
                if decay and decay[0]:
                    entry["weight_decay"] = decay[0]
                    if g.get("decoupled_weight_decay") is True:
                        entry["decoupled_weight_decay"] = True
                groups.append(entry)
            if added and not capturing():  # reading the norms syncs: not in a CUDA graph
                stale, stale_group = _never_reset(added)
            if in_place:
                written.update(self._bad_in_place(in_place))
                if self._read_late() and not capturing() and _distributed() is None:
                    # not read here on accelerators (no sync): the norms are read at the
                    # step end, and a non-finite one told then as your code's write
                    self._read_written_later(
                        optimizer, {q: ("replaced", g) for q, g in in_place.items()}
                    )
            if groups and before is not None and not capturing() and not self._device_dead:
                weights = [p.detach() for _, _, p in self._params]
                versions = {id(p): p._version for _, _, p in self._params}
                self._before_update = (
                    self._weight_maxima(weights),
                    *before,
                    versions,
                    len(self._trace.calls),
                )
            if groups:  # it updates watched weights (another model's optimizer does not)
                self._after_backward = None  # an update: the next forward begins a step
                self._updated = True
                self._ever_updated = True
                self._opt_running = True
                self._opt_forwarded = False
            elif any(map(callable, args)) or callable(kwargs.get("closure")):
                # an optimizer of other tensors given a closure (LBFGS optimizing an image
                # through a frozen model): the forwards it makes are one step, as above
                self._opt_running = True
                self._opt_forwarded = False
            if groups and len(self._trace.notes) < 256:
                note = self.note(
                    "optimizer",
                    type(optimizer).__name__,
                    groups=groups,
                    averages=_averaged_keys(optimizer),
                    ident=id(optimizer),  # two optimizers of one class are two schedules
                )
                world = _distributed()  # NW301: another rank's gradient, all-reduced
                if world is not None:
                    note.data.update(rank=world[0], world=world[1])
                if any("initial_lr" in g for g in groups):  # a scheduler sets this lr
                    found = self._scheduler_of(optimizer)
                    if found is not None:
                        note.data.update(scheduler=found[0], scheduler_variable=found[1])
                        if all(g.get("lr") == 0 for g in groups) or any(
                            isinstance(g.get("lr"), float) and not math.isfinite(g["lr"])
                            for g in groups
                        ):  # NW312: what keeps it 0; NW301: what made it NaN/inf
                            lambdas = self._lambdas_of(optimizer)
                            if lambdas:
                                note.data["scheduler_lambdas"] = lambdas
                if self._bypasses_scaler(optimizer, kwargs):
                    note.data["scaled_step"] = True  # NW301: the GradScaler was bypassed
                elif self._scaled and self._backward_called and self._scaled_loss is None:
                    scale = self._unscaled_twice(optimizer)
                    if scale is not None:  # NW314: divided by a scale never multiplied in
                        note.data["unscaled_backward"] = scale
                if stale:
                    self._note_stale_grads(optimizer, stale, stale_group, groups)
                if written:
                    self._note_written_grads(optimizer, written)
                if dropped and qualnames is not None:
                    note.data["grads_dropped"] = [qualnames[id(p)] for p in dropped[:8]]
                    note.data["grads_dropped_count"] = len(dropped)
            if not groups and self._grads_checked and getattr(self, "_grads_seen", None):
                self._note_foreign_step(optimizer)
            if groups:
                with _NO_TORCH_FUNCTION():
                    self._flush_before_update(prior)
        except NanwatchError:
            raise  # on_anomaly="raise": the update does not run
        except Exception as exc:
            self._fault("optimizer", "optimizer hook", exc)

    def _flush_before_update(self, prior: dict[int, tuple[str, int, int]] | None = None) -> None:
        """Accelerators (statistics left on the device until read): an optimizer is about to
        apply this step's gradients. The forward's statistics, sent to the host when
        backward began (:meth:`_prefetch`), are read now -- having waited for the forward
        only, so the GPU stays busy with backward and no sync exposes the optimizer's own
        host time. A bad value is localized and its op pinpointed while the weights it was
        computed with are unchanged and the root's inputs are at hand, and ``on_anomaly``
        acts before the update writes it into the weights, as on the CPU. What backward
        made is read at the step end. ``prior``: which update last wrote each weight as the
        optimizer's pre-hook began (:attr:`_stepped` before it marked its own weights, which
        it has not written yet): a weight found bad now is told from it, as a trigger in
        the forward tells it on the CPU."""
        if (
            not self._prefetched
            or self._trace.anomaly is not None
            or self._device_dead
            or _tracing()
            or capturing()
        ):
            return
        now = self._stepped
        if prior is not None:
            self._stepped = prior
        try:
            self._late_trigger(act=True, prefetched_only=True)
        finally:
            self._stepped = now

    def _read_at_root_end(self) -> bool:
        """Read late, a run that only evaluates (no gradient and no update yet: a watch
        around ``trainer.test``, an inference loop) reads each root call's statistics as the
        call returns -- its step's one read, as its next call would make it -- while its
        inputs are at hand and the model as it ran: an inference tensor has no version to
        tell it unchanged later, and the loop may set the model up for its next batch
        before calling it."""
        return (
            self._read_late()
            and not torch.is_grad_enabled()
            and not self._ever_backward
            and not self._ever_updated
            and not self._device_dead
            and self._trace.anomaly is None
            and not capturing()
            and not _frames.in_checkpoint(sys._getframe(2))
        )

    def _late_trigger(
        self,
        *,
        act: bool,
        prefetched_only: bool = False,
        current: tuple[Call, nn.Module, Any, Any] | None = None,
    ) -> None:
        """Read the step's pending statistics (and check the gradients if backward ran;
        ``prefetched_only``: see :meth:`_flush_before_update`); a bad one is localized and
        pinpointed from the inputs still at hand (:meth:`_handle_trigger`, on finished
        calls, or ``current``: a root call returning now); ``act``: and acted on."""
        self._materialize(keep_trigger=True, prefetched_only=prefetched_only)
        if not prefetched_only and self._backward_seen and not self._grads_checked:
            self._check_grads()
            self._materialize(keep_trigger=True)
        if self._new_trigger is None:
            return
        self._late = True
        try:
            self._handle_trigger(current, act=act)
        finally:
            self._late = False

    def _bypasses_scaler(self, optimizer: Any, kwargs: Any) -> bool:
        """This step of ``optimizer`` applies gradients still multiplied by the GradScaler's
        scale: backward ran on ``scaler.scale(loss)`` this step, yet neither
        ``scaler.unscale_(optimizer)`` nor ``scaler.step(optimizer)`` ran for it since the
        last ``scaler.update()`` (the scaler's per-optimizer stage is still READY; inside
        ``scaler.step`` it is UNSCALED by the time the optimizer steps). A Python read of the
        scaler's state: no sync. An optimizer that unscales itself (``scaler.step`` hands it
        ``grad_scaler=`` or sets ``found_inf``) and a wrapper whose inner optimizer the scaler
        steps are not bypasses."""
        if not self._scaled or self._grad_scale is None:
            return False
        states = getattr(self.scaler, "_per_optimizer_states", None)
        if not isinstance(states, dict):
            return False
        if "grad_scaler" in (kwargs or {}) or hasattr(optimizer, "found_inf"):
            return False
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
            return False
        state = states.get(id(optimizer))
        stage = state.get("stage") if isinstance(state, dict) else None
        return stage is None or getattr(stage, "name", None) == "READY"

    def _note_foreign_step(self, optimizer: Any) -> None:
        """``optimizer`` steps none of the watched weights, after a backward that gave them
        gradients: a ``"foreign_step"`` note (NW315 when no optimizer steps them, step
        after step: one built on another instance of the model). Whether its tensors have
        the watched weights' shapes is found once per optimizer; nothing is read."""
        key = id(optimizer)
        known = self._foreign.get(key)
        if known is None or known[0]() is not optimizer:
            theirs = [p for g in getattr(optimizer, "param_groups", ()) for p in g["params"]]
            same = sorted(tuple(p.shape) for p in theirs) == sorted(
                tuple(p.shape) for _, _, p in self._params
            )
            known = self._foreign[key] = (weakref.ref(optimizer), len(theirs), same)
        if len(self._trace.notes) < 256:
            groups = getattr(optimizer, "param_groups", None) or [{}]
            lr = groups[0].get("lr") if isinstance(groups[0], dict) else None
            self.note(
                "foreign_step",
                type(optimizer).__name__,
                params=known[1],
                same=known[2],
                # the first group's lr, for a fix that builds the same optimizer again
                lr=lr if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None,
            )

    def _scale_read(self) -> float | None:
        """The GradScaler's current scale, read (a sync on an accelerator: only for a
        misuse found without reading it), when it multiplies anything (above 1)."""
        scale = getattr(self.scaler, "_scale", None)
        if not isinstance(scale, torch.Tensor):
            return None
        value = float(scale)
        return value if value > 1 else None

    def _unscaled_twice(self, optimizer: Any) -> float | None:
        """The scale the GradScaler has divided ``optimizer``'s gradients by this step
        (``scaler.step()`` or ``scaler.unscale_()``: its stage is UNSCALED), when the step's
        backward ran on the loss itself, not on ``scaler.scale(loss)``: the gradients were
        never multiplied by it. None otherwise. The scale is read only then."""
        states = getattr(self.scaler, "_per_optimizer_states", None)
        state = states.get(id(optimizer)) if isinstance(states, dict) else None
        stage = state.get("stage") if isinstance(state, dict) else None
        if getattr(stage, "name", None) != "UNSCALED":
            return None
        return self._scale_read()

    def _grads_written(
        self,
        ps: list[Any],
        qualnames: dict[int, str],
        out: dict[str, tuple[str, torch.Tensor]],
        in_place: dict[str, torch.Tensor],
    ) -> None:
        """The weights among ``ps`` whose ``.grad`` the optimizer is about to apply is not
        the one :meth:`_check_grads` read at the end of the last backward: ``"replaced"``
        (``p.grad = ...`` after it: GradNorm, PCGrad) or ``"unchecked"`` (no backward()
        gave it: ``torch.autograd.grad`` results set by hand), into ``out``. Those that are
        the tensor read but were written since (its version or its data moved:
        ``p.grad.copy_(...)`` of an A-GEM projection, ``p.grad.data = ...``, and a clip or
        an unscale too) go into ``in_place``, read by :meth:`_bad_in_place`. Identity and
        version only: no tensor is read."""
        seen = getattr(self, "_grads_seen", {})
        for p in ps:
            g = p.grad
            if g is None or not p.requires_grad:
                continue
            e = seen.get(id(p))
            if e is None or e[0]() is not g:
                out[qualnames[id(p)]] = ("unchecked" if e is None else "replaced", g)
            elif e[1] != g._version or e[2] != _data_ptr(g):
                in_place[qualnames[id(p)]] = g

    def _clipped(self, params: list[Any], max_norm: Any) -> None:
        """``clip_grad_norm_`` rescaled the gradients of ``params`` (see :class:`_ClipTap`):
        those read at the end of backward, all finite then (the step's total norm is), and
        written once since (the rescale), keep their check -- their new versions are noted.
        A NaN ``max_norm`` makes NaN of any gradient: those are read as before. A
        ``max_norm`` of 0 or less is noted for the rules (NW309): it scales every gradient
        to 0, or flips it."""
        bad_bound = isinstance(max_norm, (int, float)) and max_norm <= 0
        scale = self._still_scaled(params) if self._scaled else None
        if (bad_bound or scale is not None) and not _tracing():
            user = _frames.user_frame(sys._getframe(1))
            source, code = _frames.describe_frame(user) if user is not None else (None, None)
            bound = float(max_norm) if isinstance(max_norm, (int, float)) else None
            self.note(
                "clip",
                "(gradients)",
                source=source,
                max_norm=bound,
                code=str(code) if code else None,
                scale=scale,
            )
        seen = getattr(self, "_grads_seen", None)
        total = self._trace.grad_norm
        if total is not None and not math.isfinite(total) and not _tracing():
            # an inf total norm: max_norm / inf = 0 zeroes the finite gradients, NaN the inf
            user = _frames.user_frame(sys._getframe(1))
            source = _frames.describe_frame(user)[0] if user is not None else None
            self.note("clip_nonfinite", "(gradients)", source=source)
        if not seen or total is None or not math.isfinite(total):
            return
        try:
            if math.isnan(float(max_norm)):
                return
        except (TypeError, ValueError, RuntimeError):
            return
        for p in params:
            g = getattr(p, "grad", None)
            e = seen.get(id(p))
            if g is not None and e is not None and e[0]() is g and g._version == e[1] + 1:
                seen[id(p)] = (e[0], g._version, e[2])

    def _still_scaled(self, params: list[Any]) -> float | None:
        """The GradScaler's scale, when ``params``' gradients still hold it: backward ran on
        ``scaler.scale(loss)`` and ``scaler.unscale_(optimizer)`` has not run since the
        last ``scaler.update()`` for the optimizer that steps them (for any optimizer, when
        none is known yet). None otherwise. A read of the scaler's state, and of the scale
        only when they are (a sync on an accelerator, in that misuse alone)."""
        states = getattr(self.scaler, "_per_optimizer_states", None)
        if not isinstance(states, dict):
            return None
        refs = {id(r()): r for p in params if (r := self._stepped_by.get(id(p))) is not None}
        if refs:
            stages = [states.get(k, {}).get("stage") for k in refs]
        else:
            stages = [s.get("stage") for s in states.values() if isinstance(s, dict)] or [None]
        if not all(st is None or getattr(st, "name", None) == "READY" for st in stages):
            return None
        return self._scale_read()

    def _bad_in_place(
        self, in_place: dict[str, torch.Tensor]
    ) -> dict[str, tuple[str, torch.Tensor]]:
        """The gradients written in place after backward (see :meth:`_grads_written`) that
        hold NaN/inf now, as written after backward by the user's code (``"replaced"``):
        NW301 then names that code, not the optimizer. Most such writes are a clip or an
        unscale by a finite factor, so only the non-finite ones are told, and only where
        reading them costs no device sync (CPU gradients, outside a CUDA graph capture).
        Not when the square of the total gradient norm read at the end of backward was past
        the dtype's largest value: the norm computed in that dtype is inf, a rescale by it
        (``clip_grad_norm_``) inf / inf = NaN, which NW301 tells as such."""
        grads = list(in_place.values())
        if (
            self._defer_cpu
            or capturing()
            # a DDP all-reduce (or a hand-written one) writes every gradient in place after
            # backward: another rank's NaN is the all-reduce's, which NW301 names as such
            or (torch.distributed.is_available() and torch.distributed.is_initialized())
            or not all(g.device.type == "cpu" and g.layout is torch.strided for g in grads)
        ):
            return {}
        total = self._trace.grad_norm
        if total is not None and any(
            g.is_floating_point() and not total * total <= torch.finfo(g.dtype).max for g in grads
        ):
            return {}
        values = read_scalars(foreach_l2(grads))
        return {
            q: ("replaced", g)
            for (q, g), v in zip(in_place.items(), values, strict=True)
            if v - v != 0
        }

    def _note_written_grads(
        self, optimizer: Any, written: dict[str, tuple[str, torch.Tensor]]
    ) -> None:
        """A ``"grad_written"`` note: gradients the optimizer applies that nanwatch did not
        check (see :meth:`_grads_written`), for NW301. On the CPU (no device sync) the ones
        your code replaced or set are checked now, as the end of backward checks the rest;
        on accelerators they are not read (``nonfinite`` is None)."""
        frame = _frames.user_frame(sys._getframe(1))
        where, _ = _frames.describe_frame(frame)
        nonfinite: list[str] | None = None  # unknown: not read on an accelerator
        grads = [g for _, g in written.values()]
        if not self._defer_cpu and all(g.device.type == "cpu" for g in grads):
            dense = [(q, g) for q, (_, g) in written.items() if g.layout is torch.strided]
            values = read_scalars(foreach_l2([g for _, g in dense])) if dense else []
            nonfinite = [q for (q, _), v in zip(dense, values, strict=True) if v - v != 0]
        self._written_bad = bool(nonfinite)  # the weights are checked after the update
        note = self.note(
            "grad_written",
            type(optimizer).__name__,
            source=where,
            variable=_name_in_frame(frame, optimizer),
            how={q: how for q, (how, _) in list(written.items())[:64]},
            count=len(written),
            nonfinite=nonfinite,
            # a watched module ran under vmap/grad this step (per-sample gradients): those
            # calls are not watched, so what they made is only seen here
            transformed=self._transformed,
        )
        if nonfinite is None and self._read_late() and not capturing():
            self._read_written_later(optimizer, written, note)

    def _read_written_later(
        self, optimizer: Any, written: dict[str, tuple[str, torch.Tensor]], note: Any = None
    ) -> None:
        """The accelerator path of :meth:`_note_written_grads` and :meth:`_bad_in_place`:
        the norms of the gradients your code wrote are computed now, on their devices, and
        read with the step's statistics at its end (:meth:`_read_written`), so NW301 names
        your code as on the CPU, without a sync before the update. ``note``: the
        ``"grad_written"`` note to complete; None: gradients written in place, told in a note
        only if one is not finite."""
        dense = [(q, g) for q, (_, g) in written.items() if g.layout is torch.strided]
        if not dense:
            return
        meta: dict[str, Any] = {"how": {q: how for q, (how, _) in written.items()}}
        if note is None:
            frame = _frames.user_frame(sys._getframe(2))
            meta.update(
                path=type(optimizer).__name__,
                source=_frames.describe_frame(frame)[0],
                variable=_name_in_frame(frame, optimizer),
                transformed=self._transformed,
            )
        norms = foreach_l2([g for _, g in dense])
        dtypes = [g.dtype for _, g in dense]
        self._written_reads.append((note, meta, [q for q, _ in dense], dtypes, norms))

    def _read_written(self) -> None:
        """Read the norms :meth:`_read_written_later` left on the devices (the step end):
        the gradients that were not finite complete their note. Gradients rescaled in place
        after a total norm whose square overflowed (``clip_grad_norm_``'s inf / inf) are
        not, as on the CPU (see :meth:`_bad_in_place`)."""
        reads, self._written_reads = self._written_reads, []
        total = self._trace.grad_norm
        for note, meta, names, dtypes, norms in reads:
            values = read_scalars(norms)
            bad = [q for q, v in zip(names, values, strict=True) if v - v != 0]
            if note is not None:
                note.data["nonfinite"] = bad
                continue
            overflowed = total is not None and any(
                d.is_floating_point and not total * total <= torch.finfo(d).max for d in dtypes
            )
            if not bad or overflowed or len(self._trace.notes) >= 256:
                continue
            self.note(
                "grad_written",
                meta["path"],
                source=meta["source"],
                variable=meta["variable"],
                how={q: meta["how"][q] for q in bad[:64]},
                count=len(bad),
                nonfinite=bad,
                transformed=meta["transformed"],
            )

    def add_scheduler(self, scheduler: Any, *, name: str | None = None) -> None:
        """Tell the lr scheduler that drives its optimizer when no frame holds it (a
        framework's: Lightning's ``trainer.lr_scheduler_configs``), so a fix that lowers the
        lr keeps it (see :func:`nanwatch.rules._evidence.with_scheduler`); ``name``: the
        expression that reaches it from the user's code. The Lightning callback tells each
        scheduler the trainer holds.

        Example:
            >>> model = nn.Linear(2, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
            >>> nw = Watcher(model)
            >>> nw.add_scheduler(sched, name="trainer.lr_scheduler_configs[0].scheduler")
            >>> nw._scheduler_of(opt)
            ('LambdaLR', 'trainer.lr_scheduler_configs[0].scheduler')
        """
        optimizer = getattr(scheduler, "optimizer", None)
        if isinstance(scheduler, _SCHEDULERS) and optimizer is not None:
            self._schedulers[id(optimizer)] = (type(scheduler).__name__, name)
            self._scheduler_refs[id(optimizer)] = weakref.ref(scheduler)

    def _scheduler_of(self, optimizer: Any) -> tuple[str, str | None] | None:
        """The lr scheduler that drives ``optimizer``: its class and the user's name for it,
        as told (:meth:`add_scheduler`) or looked for once in the frame that steps the
        optimizer (its locals, ``self``'s attributes, its module's globals); None when none
        there does (a framework's that was not told)."""
        key = id(optimizer)
        if key in self._schedulers:
            return self._schedulers[key]
        frame = _frames.user_frame(sys._getframe(1))
        found: tuple[str, str | None] | None = None
        if frame is not None:
            local = frame.f_locals
            attrs = getattr(local.get("self"), "__dict__", None)
            scopes: list[tuple[Any, str]] = [(local, ""), (attrs, "self."), (frame.f_globals, "")]
            for names, prefix in scopes:
                if not hasattr(names, "items"):
                    continue
                for name, value in list(names.items()):
                    if isinstance(value, _SCHEDULERS) and value.optimizer is optimizer:
                        var = prefix + name if str(name).isidentifier() else None
                        found = (type(value).__name__, var)
                        self._scheduler_refs[key] = weakref.ref(value)
                        break
                if found is not None:
                    break
            # one level down: an attribute of a local object (``m._sched`` of a model or a
            # state object the loop keeps it on)
            for owner, value in list(local.items()) if found is None else ():
                try:  # a proxy's __dict__ or attribute may raise: that local is skipped
                    attrs = getattr(value, "__dict__", None)
                    if not isinstance(attrs, dict) or not str(owner).isidentifier():
                        continue
                    for name, held in list(attrs.items())[:256]:
                        if isinstance(held, _SCHEDULERS) and held.optimizer is optimizer:
                            var = f"{owner}.{name}" if str(name).isidentifier() else None
                            found = (type(held).__name__, var)
                            self._scheduler_refs[key] = weakref.ref(held)
                            break
                except Exception:
                    continue
                if found is not None:
                    break
        trainer = self._trainer_probe.trainer() if self._trainer_probe is not None else None
        if found is None and trainer is not None:
            # nanwatch run on a Lightning script: the trainer steps what configure_optimizers
            # returned, and no frame of the user's holds it
            held = _trainer.scheduler_name(trainer, optimizer)
            if held is not None and isinstance(held[0], _SCHEDULERS):
                found = (type(held[0]).__name__, held[1])
                self._scheduler_refs[key] = weakref.ref(held[0])
        self._schedulers[key] = found
        return found

    def _lambdas_of(self, optimizer: Any) -> list[dict[str, str]]:
        """The source of the lr lambdas of the scheduler that drives ``optimizer`` (LambdaLR,
        MultiplicativeLR), each with its ``file:line``; read once per optimizer, empty when
        it has none or their source cannot be read (a builtin, code typed at a prompt)."""
        key = id(optimizer)
        if key in self._lambda_sources:
            return self._lambda_sources[key]
        ref = self._scheduler_refs.get(key)
        sched = ref() if ref is not None else None
        found: list[dict[str, str]] = []
        for fn in getattr(sched, "lr_lambdas", None) or ():
            code = getattr(fn, "__code__", None)
            if code is None:
                continue
            try:
                text = inspect.getsource(fn)
            except Exception:  # no file, a builtin, source the tokenizer cannot read
                continue
            found.append(
                {"code": text.strip()[:500], "at": f"{code.co_filename}:{code.co_firstlineno}"}
            )
            if len(found) >= 4:
                break
        self._lambda_sources[key] = found
        return found

    def _note_stale_grads(
        self, optimizer: Any, stale: list[str], group: int, groups: list[dict[str, Any]]
    ) -> None:
        """A ``"stale_grads"`` note: ``optimizer`` is about to apply gradients that backward
        added to the ones of its previous step (NW307). The user's name for the optimizer
        is looked up in the frame that called ``step()``."""
        frame = _frames.user_frame(sys._getframe(1))
        where, _ = _frames.describe_frame(frame)
        self.note(
            "stale_grads",
            type(optimizer).__name__,
            source=where,
            variable=_name_in_frame(frame, optimizer),
            group=group,
            names=stale[:4],
            count=len(stale),
            params=sum(int(g["params"]) for g in groups),
        )

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Global optimizer post-hook: each watched weight's version right after the update,
        so a write after it (a load_state_dict, an in-place edit) is told from the update
        (NW301). No tensor is read."""
        if not self._attached or threading.get_ident() != self._thread:
            return
        self._opt_running = False
        self._applied = self._applied or self._updated
        if self._updated:
            self._applied_calls = len(self._trace.calls)
        if self._checker is not None:
            self._ops_mark = len(self._checker.events)
        self._opt_calls[id(optimizer)] = (self._step, len(self._trace.calls))
        try:
            stepped, marks, watched = self._stepped, self._grad_marks, self._param_ids
            if "grad_marks" in self._disabled_hooks:
                watched = frozenset()
            ref = weakref.ref
            with _NO_TORCH_FUNCTION():  # p.grad through a mode's __torch_function__: slow
                for gi, g in enumerate(getattr(optimizer, "param_groups", ())):
                    for p in g.get("params", ()):
                        key = id(p)
                        entry = stepped.get(key)
                        if entry is not None and entry[1] == gi:
                            stepped[key] = (entry[0], gi, p._version)
                            ptr = _data_ptr(p)
                            if ptr:
                                self._stepped_ptr[key] = ptr
                        if key in watched:  # marks: see _grads_around_backward
                            grad = p.grad
                            if grad is None:
                                marks.pop(key, None)
                            else:
                                marks[key] = [p, ref(grad), grad._version, False, False, None]
            if self._written_bad:
                self._written_bad = False
                with _NO_TORCH_FUNCTION():
                    self._check_written_update()
        except NanwatchError:
            raise
        except Exception as exc:
            self._fault("optimizer", "optimizer post-hook", exc)

    def _check_written_update(self) -> None:
        """The optimizer just applied a gradient your code wrote that is not finite (found
        by :meth:`_note_written_grads`): the weights are checked now, as the step's end
        checks them (NW301), and ``on_anomaly`` acts at this ``optimizer.step()``. A loop
        whose modules run only under ``vmap``/``grad`` (per-sample gradients, DP-SGD) has
        no step end before the next update, or none at all without ``nw.step()``."""
        if self._trace.anomaly is not None or self._device_dead or _tracing():
            return
        self._check_params(at_end=True)
        if self._new_trigger is not None:
            self._handle_trigger(None)

    def _grads_around_backward(self, before: bool) -> None:
        """Just ``before`` (or after) a ``backward()``: which gradients marked by the last
        optimizer step (each watched weight's ``.grad``, by weak reference, and its version)
        were reset since, and which this backward added to without a reset. A reset replaces
        the gradient (``zero_grad()``'s ``set_to_none``, ``p.grad = None``) or changes it in
        place outside backward (``grad.zero_()`` bumps its version, as
        ``zero_grad(set_to_none=False)`` does). A gradient added to without one holds the
        sum of every past gradient when the optimizer steps again (a forgotten
        ``optimizer.zero_grad()``, NW307). A reset through ``.data``
        (``p.grad.data.zero_()``) moves no version: for a gradient unchanged since the step,
        its norm before the backward is computed (on its device, not read), and the
        optimizer's next step reads it only if backward added to it (see ``_never_reset``).
        A mark ends with a reset, so a healthy loop pays one pass over its weights per
        optimizer step and reads nothing."""
        marks = self._grad_marks
        if not marks or not self._attached or threading.get_ident() != self._thread:
            return
        if ops.replaying() or "grad_marks" in self._disabled_hooks or capturing():
            return
        try:
            with _NO_TORCH_FUNCTION():
                self._follow_marks(marks, before)
        except Exception as exc:
            marks.clear()
            self._fault("grad_marks", "gradient reset check", exc)

    @staticmethod
    def _follow_marks(marks: dict[int, list[Any]], before: bool) -> None:
        """See :meth:`_grads_around_backward`. A mark is ``[weight, weakref to its .grad,
        the .grad's version, changed outside backward, added to by backward, its norm before
        the last backward that did not change it (a 0-d tensor) or None]``."""
        unseen: list[list[Any]] = []  # unchanged since the step: maybe reset through .data
        for key, m in list(marks.items()):
            g = m[0].grad
            if g is None or g is not m[1]():
                del marks[key]  # set to None or replaced: reset
            elif g._version != m[2]:
                m[2] = g._version
                if before:
                    m[3] = True  # changed outside backward: a zero_() (or a clip)
                elif m[3]:
                    del marks[key]  # changed, then backward added to it: reset
                else:
                    m[4] = True  # backward added to the last step's gradient
            elif before and not m[3] and not m[4]:
                unseen.append(m)  # its norm now, before this backward adds to it
        if unseen:
            grads = [m[0].grad for m in unseen]
            if all(g.layout is torch.strided for g in grads):
                for m, n in zip(unseen, foreach_l2(grads), strict=True):
                    m[5] = n

    def _found_scaler(self, scaler: Any, out: Any = None) -> None:
        """``scaler.scale(loss)`` ran while attached and returned ``out`` (see
        ``_ScalerTap``): the loss that ``backward()`` will run on is then ``out``, the real
        loss times the scale, and the timeline shows it divided by that scale."""
        if threading.get_ident() != self._thread:
            return
        if self.scaler is None:
            self.scaler = scaler
        if scaler is self.scaler and isinstance(out, torch.Tensor):
            self._scaled_out = weakref.ref(out)

    @property
    def _scaled(self) -> bool:
        s = self.scaler
        return s is not None and bool(getattr(s, "is_enabled", lambda: True)())

    def _record_inputs(
        self,
        info: _ModInfo,
        call: Call,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        after: bool = False,
    ) -> None:
        """Link each input to the record that produced it, or measure it (functional code
        made it). ``after``: recorded from the forward hook, once the call ran: a known
        tensor whose version moved was changed by the call itself (an in-place ReLU), so it is
        linked, not measured again."""
        known = self._known
        keep_ints = call.root or info.is_loss
        if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
            items: Iterable[tuple[str, torch.Tensor]] = (("input[0]", args[0]),)
            a = args[0]
            call.rebuildable = keep_ints or a.is_floating_point() or a.is_complex()
        else:
            items = self._walk(args, "input", kwargs)
            call.rebuildable = not kwargs and all(
                isinstance(a, torch.Tensor)
                and (keep_ints or a.is_floating_point() or a.is_complex())
                for a in args
            )
        for role, t in items:
            floating = t.is_floating_point() or t.is_complex()
            if not floating and not keep_ints:
                continue
            entry = known.get(id(t))
            if entry is not None and entry[0]() is t and (after or entry[2] == _version(t)):
                self._new_record(
                    Phase.INPUT,
                    info.path,
                    role,
                    t,
                    call.id,
                    source=entry[1],
                    module_type=info.type_name,
                )
                continue
            rec = self._new_record(
                Phase.INPUT, info.path, role, t, call.id, module_type=info.type_name
            )
            if entry is not None and entry[0]() is t:
                rec.source = entry[1]  # the same tensor, changed in place since it was seen
            if floating:
                hooked = False
                if call.root and t.grad_fn is not None and self._derived(t.grad_fn):
                    # computed by the user's code from a watched output (h / h.norm() between
                    # an encoder and a head): not data, whatever it holds
                    rec.grad_fn = _grad_fn_name(t)
                    rec.source = self._last_root_output()
                    if t.device.type != "cpu" or self._defer_cpu:  # read late: see _keep_derived
                        self._derived_fns.append(t.grad_fn)
                elif call.root and t.grad_fn is None and rec.source is None:
                    # a watched output passed on through .detach() (a GAN's fake.detach()
                    # given to the discriminator): no graph links it, its memory does
                    rec.source = self._detached_from(t)
                elif call.root and t.grad_fn is not None and self._from_params(t.grad_fn):
                    # computed from a watched weight outside every module's forward (logits /
                    # self.temperature in a calibration method): not data either
                    rec.grad_fn = _grad_fn_name(t)
                if call.root or self._forensic or not self._made_safely(t):
                    if rec.grad_fn is None and not call.root:
                        rec.grad_fn = _grad_fn_name(t)  # the code that made it (localize)
                    self._measure(rec, t, rows=call.root)
                    hooked = self._maybe_hook_grad(t, rec)
                known[id(t)] = (weakref.ref(t), rec.index, _version(t), hooked)
                self._remember_node(t)

    def _walk(
        self, args: Any, prefix: str, kwargs: dict[str, Any] | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        out = list(iter_tensors(args, prefix, on_opaque=self._opaque))
        if kwargs:
            for k, v in kwargs.items():
                out.extend(iter_tensors(v, f"{prefix}.{k}", on_opaque=self._opaque))
        return out

    def _opaque(self, typ: type) -> None:
        if typ not in self._opaque_warned and len(self._opaque_warned) < 16:
            self._opaque_warned.add(typ)
            _frames.warn_at_user(
                f"nanwatch: a module input or output of type {typ.__qualname__} holds no "
                "tensor nanwatch can see (not a tensor, tuple, list, dict, dataclass or "
                "namedtuple); tensors inside it are not watched.",
                NanwatchWarning,
                safe=True,
            )

    def _record_outputs(
        self, info: _ModInfo, call: Call, output: Any, *, skip: bool = False, leaf: bool = False
    ) -> None:
        """Record each output; ``skip``: the module cannot have made a non-finite value from
        finite inputs here, so its outputs are bounded by its input's record, not measured;
        ``leaf``: and no input of it needs a gradient."""
        if isinstance(output, torch.Tensor):
            items: Iterable[tuple[str, torch.Tensor]] = (("output", output),)
        else:
            items = self._walk(output, "output")
        known = self._known
        first_input: int | None = None
        if skip:
            for r in reversed(self._trace.records):
                if r.call != call.id:
                    break
                if r.phase is Phase.INPUT:
                    first_input = r.index
        recorded = self._recorded_nodes
        for role, t in items:
            entry = known.get(id(t))
            same = entry is not None and entry[0]() is t
            try:  # _version(t), inline: this runs for every output
                ver = None if t.is_inference() else t._version
            except RuntimeError:
                ver = None
            fn = t.grad_fn
            if same and entry is not None and entry[2] == ver:
                # an alias of a tensor already measured (a container returning its child's output)
                rec = self._new_record(
                    Phase.FORWARD,
                    info.path,
                    role,
                    t,
                    call.id,
                    source=entry[1],
                    module_type=info.type_name,
                )
                rec.grad_fn = None if fn is None else type(fn).__name__
                rec.version = ver
                if call.root:
                    self._remember_root_output(t, rec.index)
                    orig = self._trace.resolve(rec)
                    # measured already, maybe not read yet (the accelerator path): an alias
                    # measured again would look like a new tensor (_hooked reads it so)
                    if orig.stat is None and orig.index not in self._minmax:
                        self._measure(rec, t)  # a root's output is always measured: the logits
                    if not entry[3] and self._maybe_hook_grad(t, rec):
                        # the gradient the loss sends back is checked where it arrives, also
                        # when the child that made the output was not hooked (a final ReLU:
                        # its backward zeroes a NaN the loss sent, which no weight then shows)
                        known[id(t)] = (entry[0], entry[1], ver, True)
                continue
            rec = self._new_record(
                Phase.FORWARD, info.path, role, t, call.id, module_type=info.type_name
            )
            rec.grad_fn = None if fn is None else type(fn).__name__
            rec.version = ver
            if same and entry is not None:
                rec.source = entry[1]
            floating = t.is_floating_point() or t.is_complex()
            hooked = bool(same and entry is not None and entry[3])
            if floating:
                if skip:
                    if rec.source is None:
                        rec.source = first_input
                    if leaf and not hooked and _grad_ends_here(t):
                        # its gradient goes straight into weights (an embedding's output):
                        # no later record would see a NaN the code using it sends back
                        hooked = self._maybe_hook_grad(t, rec)
                else:
                    self._measure(rec, t)
                    if fn is not None and t.dtype in _SHORT_RANGE:
                        self._read_graph(rec, fn, info.path)
                    if not hooked:
                        hooked = self._maybe_hook_grad(t, rec)
                    if not hooked and not torch.is_grad_enabled():
                        self._unhooked.setdefault(info.path, []).append(rec)
            known[id(t)] = (weakref.ref(t), rec.index, ver, hooked)
            if fn is not None:
                recorded.add(fn)  # _remember_node(t)
            if call.root and floating:
                self._remember_root_output(t, rec.index)

    def _read_graph(self, rec: Record, fn: Any, path: str) -> None:
        """A ``"graph"`` note of the autograd nodes below a short-range output made by a
        product or quotient (see :func:`nanwatch._graph.digest`): host-side, no sync. A
        module's code makes the same graph each step: it is read once per module, node
        and dtype, and the note of later steps holds that digest."""
        key = (path, type(fn).__name__, rec.dtype)
        if key in self._digests:
            nodes = self._digests[key]
        else:
            try:
                nodes = _graph.digest(fn, rec.dtype, stop=self._recorded_nodes.__contains__)
            except Exception as exc:  # the output keeps its statistics; the rules, no graph
                self._fault("hooks", "reading an output's autograd graph", exc)
                nodes = None
            self._digests[key] = nodes
        if nodes is not None:
            self.note("graph", path, record=rec.index, nodes=nodes)

    def _remember_root_output(self, t: torch.Tensor, index: int) -> None:
        ptr = _memory_at(t)
        if ptr is not None:
            self._root_out_ptrs[(ptr, tuple(t.shape), t.dtype)] = (id(t), index)

    def _detached_from(self, t: torch.Tensor) -> int | None:
        """The record of this step's root output whose memory ``t`` is (same data_ptr,
        shape and dtype): ``t`` is that output detached, not data. Only while that output
        is alive: freed memory that a new batch took holds data."""
        ptrs = self._root_out_ptrs
        ptr = _memory_at(t) if ptrs else None
        found = ptrs.get((ptr, tuple(t.shape), t.dtype)) if ptr is not None else None
        if found is None:
            return None
        entry = self._known.get(found[0])
        out = entry[0]() if entry is not None else None
        if out is None or _memory_at(out) != ptr:
            return None
        return found[1]

    def _hook_recomputed(self, info: _ModInfo, output: Any) -> None:
        """A module's forward re-run inside backward (reentrant activation checkpointing,
        whose first pass ran under no_grad): its outputs now carry gradients, which belong
        to the records its first call made. Calls repeat in order, so the oldest waiting
        records of this module are this call's."""
        waiting = self._unhooked.get(info.path)
        if not waiting:
            return
        for role, t in self._walk(output, "output"):
            if not waiting:
                return
            if waiting[0].role != role or not (t.is_floating_point() or t.is_complex()):
                continue
            rec = waiting.pop(0)
            rec.grad_fn = _grad_fn_name(t)  # the op that made it, known only now
            self._maybe_hook_grad(t, rec)

    def _derived(self, fn: Any, limit: int = 256) -> bool:
        """``fn``'s graph reaches the node of a tensor recorded in this step (a watched
        module's output): a root's input computed from it. Walks at most ``limit`` nodes;
        a batch has no node at all and costs nothing."""
        if self._idx == 0:
            return False
        recorded = self._recorded_nodes
        # GraphWalk holds the nodes it saw: torch < 2.13 frees a node's Python object once
        # unreferenced, and a later node's object could take its id (a set of ids alone
        # then skips that node and all below it)
        return any(node in recorded for node in ops.GraphWalk([fn], limit=limit))

    def _from_params(self, fn: Any, limit: int = 64) -> bool:
        """``fn``'s graph reaches a watched parameter (its AccumulateGrad node) within
        ``limit`` nodes. Asked only of a root's input that has a graph none of whose nodes
        was recorded: a batch has no graph, and a model's output is recorded."""
        ids = self._param_ids
        for node in ops.GraphWalk([fn], limit=limit):
            var = getattr(node, "variable", None) if ops.accumulates_grad(node) else None
            if var is not None and id(var) in ids:
                return True
        return False

    def _last_root_output(self) -> int | None:
        """The latest forward record of a root call's output: what a root's derived input
        was most likely computed from."""
        trace = self._trace
        for rec in reversed(trace.records):
            if rec.phase is Phase.FORWARD:
                c = trace.call(rec.call)
                if c is not None and c.root and c.path == rec.path:
                    return rec.index
        return None

    def _remember_node(self, t: torch.Tensor) -> None:
        fn = t.grad_fn
        if fn is not None:
            self._recorded_nodes.add(fn)

    def _made_safely(self, t: torch.Tensor) -> bool:
        """Made by functional code from recorded tensors (or parameters) with an op that
        cannot turn finite values into NaN or inf in a wide dtype (a residual ``x + y``, a
        concatenation, a view): bounded by the records of its operands, like a
        finite-preserving module's output. Needs the autograd node: under no_grad nothing
        says how a tensor was made, and it is measured."""
        return t.dtype in _WIDE and self._safe_node(t.grad_fn, 3)

    def _safe_node(self, fn: Any, depth: int) -> bool:
        """``fn`` is a safe op whose operands are recorded tensors, parameters, or (a few
        levels down) safe ops of their own: ``relu_(a + b)`` from recorded ``a`` and ``b``."""
        if fn is None or type(fn).__name__ not in _SAFE_NODES:
            return False
        recorded = self._recorded_nodes
        for nxt, _ in fn.next_functions:
            if nxt is None:
                # an operand with no autograd history and no record (log(dt) of the data
                # under no_grad, a constant): nothing bounds it, so the result is measured
                return False
            if nxt in recorded or ops.accumulates_grad(nxt):
                continue
            if depth > 0 and self._safe_node(nxt, depth - 1):
                continue
            return False
        return True

    def _maybe_hook_grad(self, t: torch.Tensor, rec: Record) -> bool:
        """Hook the gradient of ``t``. A pre-hook on the autograd node that made it sees the
        same gradient (``grad_outputs[t.output_nr]``) and costs a seventh of a tensor hook;
        tensors without a node (leaves) get a tensor hook. The hook is :meth:`_on_grad`
        bound to what it needs (no closure made per call)."""
        if not (t.requires_grad and torch.is_grad_enabled()) or t.is_inference():
            return False
        node = t.grad_fn
        if node is not None:
            hook = functools.partial(self._on_grad, self._gen, self._step, rec, t.output_nr)
            self._tensor_handles.append(node.register_prehook(hook))
            return True
        if rec.phase is Phase.FORWARD and id(t) in self._param_ids:
            # a watched weight returned as an output (a learnable waypoint): its gradient
            # sums every use of it (the module's own forward too) and is checked as the
            # weight's; read here it would be taken for what the loss code sent back
            return False
        hook = functools.partial(self._on_grad, self._gen, self._step, rec, -1)
        self._tensor_handles.append(t.register_hook(hook))  # type: ignore[no-untyped-call]
        return True

    def _on_grad(self, gen: int, step: int, fwd: Record, nr: int, grads: Any) -> None:
        """The gradient hook of the tensor ``fwd`` recorded: ``grads`` is the ``grad_outputs``
        of the node that made it, the tensor's among them at ``nr``; ``nr`` -1: a tensor
        hook's, ``grads`` is the gradient itself."""
        if nr >= 0:
            g = grads[nr] if nr < len(grads) else None
            if g is None:
                return
        else:
            g = grads
        if not self._attached or gen != self._gen or ops.replaying() or _tracing():
            return
        if "grad" in self._disabled_hooks:
            return
        with _NO_TORCH_FUNCTION():
            try:
                self._backward_seen = True
                self._ever_backward = True
                if not self._eob_queued:
                    self._eob_queued = True
                    torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
                if step != self._step:
                    return  # the step was ended between forward and backward
                rec = self._new_record(
                    Phase.BACKWARD,
                    fwd.path,
                    fwd.role,
                    g,
                    fwd.call,
                    source=fwd.index,
                    module_type=fwd.module_type,
                )
                if not self._in_backward:
                    rec.by_grad = True  # torch.autograd.grad: a saliency, a penalty, an attack
                self._measure(rec, g)
                if self._new_trigger is not None:
                    self._handle_trigger(None)
            except NanwatchError:
                raise
            except Exception as exc:
                self._fault("grad", "gradient hook", exc)

    def _end_of_backward(self) -> None:
        self._eob_queued = False
        self._eob_count += 1
        if not self._attached or ops.replaying() or _tracing() or capturing():
            return
        try:
            with _NO_TORCH_FUNCTION():
                self._join_streams()
                self._check_grads()
                if self._pending or self._pending_grads or self._pending_nodes:
                    self._prefetch(wait=False)  # the accelerator path
                if not self._backward_called:  # autograd.grad: did it train? (see above)
                    self._weights_at_grad = tuple(p._version for _, _, p in self._params)
                if not self._explicit:  # only the automatic step rule reads the marks
                    marks = self._update_marks()
                    # no weight got a gradient (a frozen model, an input being optimized):
                    # nothing accumulates, and each forward after a backward is a step
                    grads = any(g != -1 for g in marks[1 : 3 * len(self._params) : 3])
                    self._after_backward = marks if grads else None
                    self._marks_at_backward = marks
            if self._new_trigger is not None:
                self._handle_trigger(None)
        except NanwatchError:
            raise
        except Exception as exc:
            self._fault("grad", "end-of-backward check", exc)

    def _grad_began(self, outputs: Any, inputs: Any = ()) -> None:
        """``torch.autograd.grad`` is about to run, in a loop that trains with it alone (no
        ``backward()`` in this run): a loss computed outside every watched module, taken
        the gradient of for watched weights, is recorded as ``backward()`` records it (a
        NaN born in the loss code is found in forward, where it was born, not as a gradient
        arriving at the model's output); on the accelerator path, the forward's statistics
        are read now if they have landed, as when ``backward()`` begins (see
        :meth:`_on_backward`): its update (``p.data -= lr * g``) has no hook before it."""
        if self._ever_backward_called or not self._attached:
            return
        if threading.get_ident() == self._thread and not (ops.replaying() or _tracing()):
            self._grad_loss(outputs, inputs)
        if not self._pending:
            return
        if threading.get_ident() != self._thread or ops.replaying() or _tracing():
            return
        try:
            with _NO_TORCH_FUNCTION():
                self._prefetch(wait=True)
                self._read_if_landed(outputs)
        except NanwatchError:
            raise
        except Exception as exc:
            self._fault("grad", "forward statistics read", exc)

    def _grad_loss(self, outputs: Any, inputs: Any) -> None:
        """The loss of a ``torch.autograd.grad(loss, params)`` step, recorded as a loss
        ``backward()`` runs on (:meth:`_record_loss`): a float scalar made outside the
        watched modules, taken the gradient of for a watched weight. Host-side checks by
        identity; the one read is the loss's, once a step, as backward's."""
        t = outputs if isinstance(outputs, torch.Tensor) else None
        if t is None and isinstance(outputs, (tuple, list)) and len(outputs) == 1:
            t = outputs[0] if isinstance(outputs[0], torch.Tensor) else None
        if t is None or t.grad_fn is None or t.numel() != 1 or not t.is_floating_point():
            return
        if "loss" in self._disabled_hooks or _tracing() or capturing() or self._device_dead:
            return
        entry = self._known.get(id(t))
        if entry is not None and entry[0]() is t:
            return  # a watched module made it (the criterion), or it was recorded already
        given = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        if not any(id(p) in self._param_ids for p in given):
            return  # a derivative for the inputs (a PINN's u_x, a saliency): not the step's
        self._loss_by_grad = True
        try:
            with _NO_TORCH_FUNCTION():
                self._record_loss(t)
        except NanwatchError:
            raise
        except Exception as exc:
            self._fault("loss", "autograd.grad tap", exc)

    def _grads_returned(self, inputs: Any, grads: Any, create_graph: bool) -> None:
        """``torch.autograd.grad`` returned ``grads`` for ``inputs``: those of watched
        weights are checked as a backward's ``.grad`` is (a loop that trains without
        ``backward()``: ``grads = torch.autograd.grad(loss, params)``, then its own update),
        once no ``backward()`` ran in this step (a gradient penalty's are not the step's
        gradients). No read when no watched weight is among ``inputs``."""
        if not self._attached or threading.get_ident() != self._thread or self._backward_called:
            return
        if "grad" in self._disabled_hooks or ops.replaying() or _tracing() or capturing():
            return
        if isinstance(inputs, torch.Tensor):
            inputs, grads = (inputs,), (grads,)
        if not isinstance(inputs, (tuple, list)) or not isinstance(grads, (tuple, list)):
            return
        ids = self._param_ids
        given = {
            id(t): g
            for t, g in zip(inputs, grads, strict=False)
            if id(t) in ids and isinstance(g, torch.Tensor)
        }
        if not given:
            return
        if not create_graph and self._weight_grads_taken is None:
            # (create_graph: a MAML inner step's, differentiated again in this step)
            self._weight_grads_taken = next(
                (
                    (m, name, p)
                    for m, _ in self._modules
                    for name, p in m._parameters.items()
                    if id(p) in given
                ),
                None,
            )
        try:
            with _NO_TORCH_FUNCTION():
                self._check_grads(given)
                if self._pending or self._pending_grads or self._pending_nodes:
                    self._prefetch(wait=False)  # the accelerator path
            if self._new_trigger is not None:
                self._handle_trigger(None)
        except NanwatchError:
            raise
        except Exception as exc:
            self._fault("grad", "autograd.grad gradient check", exc)

    def _backward_began(self, tensors: Any) -> None:
        """A ``backward()`` begins: the tensors it runs on (weakly) and the line of the user's
        code that called it, kept for the step (host-side: one walk up the stack). A second
        backward through a graph the first one freed is then told from a tensor carried over
        from an earlier step (see :meth:`_graph_freed_advice`)."""
        if not self._attached or threading.get_ident() != self._thread:
            return
        try:
            if isinstance(tensors, torch.Tensor):
                refs = [weakref.ref(tensors)]
            elif isinstance(tensors, (list, tuple)):
                refs = [weakref.ref(t) for t in tensors if isinstance(t, torch.Tensor)]
            else:
                refs = []
            f = _frames.user_frame(sys._getframe(1))
            self._backward_now = (refs, (f.f_code.co_filename, f.f_lineno) if f else None)
            # a helper of the user's given the loss (``def backward(loss)``): its caller
            self._backward_via = (
                _frames.helper_call(f, tensors) if isinstance(tensors, torch.Tensor) else None
            )
        except Exception:  # a hint for a post-mortem: never worth breaking backward for
            self._backward_now = self._backward_via = None

    def _backward_ended(self) -> None:
        """The ``backward()`` :meth:`_backward_began` saw finished."""
        now, self._backward_now = self._backward_now, None
        if now is not None and threading.get_ident() == self._thread:
            self._backwards_done.append(now)

    def _graph_freed_advice(self) -> str | None:
        """For "backward through the graph a second time" raised by a backward() of a step
        in which another one already finished: the two lines, and the fix for the same
        tensor differentiated twice, or for a second loss that reaches the graph the first
        one freed. None when no earlier backward() of this step finished (a tensor carried
        over from an earlier step: the general advice says it)."""
        now, done = self._backward_now, self._backwards_done
        if now is None or not done:
            return None

        def where(site: Any) -> str:
            return "an unknown line" if site is None else _frames.describe_line(*site)[0]

        refs, second = now
        failing = [t for t in (r() for r in refs) if t is not None]
        step = self._trace.step
        for earlier, first in reversed(done):
            if any(t is r() for t in failing for r in earlier):
                return (
                    f"backward() ran twice on the same tensor in step {step}: at "
                    f"{where(first)}, then at {where(second)}. The first one freed the "
                    "values its graph saved for backward: call backward() once; if the "
                    "second is meant, pass retain_graph=True to the first."
                )
        first = done[-1][1]
        return (
            f"The backward() at {where(second)} reached a part of the graph that an earlier "
            f"backward() freed: the one at {where(first)} in step {step}, when both losses "
            "come from the same forward (add them and call backward() once: "
            "(loss_a + loss_b).backward(), or pass retain_graph=True to the first only), or "
            "one of an earlier step, through a tensor carried over with its graph (detach it "
            "where it is carried: hidden = hidden.detach())."
        )

    def _no_graph_advice(self) -> str | None:
        """For backward() on a tensor with no autograd graph: frozen weights, the model's
        forward run with gradients off, or a graph cut between the model's output and the
        loss, told apart from the weights' ``requires_grad`` and the step's records of the
        model's outputs (their ``grad_fn``). Host-side data only."""
        params = [p for _, _, p in self._params]
        if params and not any(p.requires_grad for p in params):
            return (
                f"None of the {len(params)} watched weights requires grad (frozen with "
                "requires_grad_(False)), so nothing the model computes has a graph: unfreeze "
                "the ones to train (for p in model.head.parameters(): p.requires_grad_(True)) "
                "and give those to the optimizer."
            )
        trace = self._trace
        calls = {c.id: c for c in trace.calls}
        outs = [
            r
            for r in trace.records
            if r.phase is Phase.FORWARD
            and r.role.startswith("output")
            and (c := calls.get(r.call)) is not None
            and c.root
            and not c.is_loss
            and r.dtype.startswith(("float", "bfloat", "complex"))
        ]
        if not outs or not params:
            return None
        last = outs[-1]
        if all(r.grad_fn is None for r in outs if r.call == last.call):
            return (
                f"{last.path}'s output in step {trace.step} has no autograd graph although "
                "its weights require grad: its forward ran with gradients off, inside "
                "torch.no_grad() or torch.inference_mode() (an evaluation block or a "
                "decorator around the training step, or torch.set_grad_enabled(False) left "
                "on). Run the training forward outside it."
            )
        return (
            f"{last.path}'s output in step {trace.step} has a graph ({last.grad_fn}), but "
            "the tensor backward() ran on has none: your code cut it between the model's "
            "output and the loss (a .detach(), .item(), .numpy() or torch.tensor(...) of a "
            "value the loss is made of, or a loss computed under torch.no_grad()). Make the "
            "loss from the output with torch ops."
        )

    def _non_scalar_advice(self) -> str | None:
        """For backward() on a tensor of many values with no gradient given: its shape, and
        the statement that assigned the name backward() ran on (read from the source above
        the call), reduced with ``.mean()``. None when the call is not known."""
        now = self._backward_now
        if now is None or now[1] is None:
            return None
        refs, (filename, lineno) = now
        failing = [t for t in (r() for r in refs) if t is not None and t.numel() != 1]
        if not failing:
            return None
        t = failing[0]
        at, call = _frames.describe_line(filename, lineno)
        fn = t.grad_fn
        made = _assigned_above(filename, lineno, call, ops.name_of(fn) if fn is not None else None)
        what = (
            f"backward() at {at} ran on a tensor of shape {tuple(t.shape)} ({t.numel():,} "
            "values), not one number, and no gradient was given for it"
        )
        if made is None:
            return (
                f"{what}: reduce it to the mean (or sum) over the batch before backward(): "
                "loss.mean().backward()."
            )
        line, code, reduced = made
        none = re.search(r"reduction\s*=\s*['\"]none['\"]", code)
        why = (
            " reduction='none' keeps one loss per element; average them"
            if none
            else " the mean over the batch (.sum() adds them instead)"
        )
        return f"{what}. It was made at {line}: `{code}`. Reduce it there:{why}: `{reduced}`."

    def _on_backward(self, tensors: Any) -> None:
        try:
            self._tap_backward(tensors)
        finally:
            if self._pending and self._attached:  # the accelerator path
                try:
                    with _NO_TORCH_FUNCTION():
                        self._prefetch(wait=True)
                        self._read_if_landed(tensors)
                except NanwatchError:
                    raise  # on_anomaly="raise": before backward runs, as on the CPU
                except Exception as exc:
                    self._fault("grad", "forward statistics read", exc)

    def _read_if_landed(self, tensors: Any) -> None:
        """The forward's statistics, just sent (:meth:`_prefetch`), are read now if they
        have already landed -- the GPU has run the forward, which a step bound by the host
        usually has: no wait. A bad value is then localized with everything a CPU run has
        at this point: the loss code's autograd graph (the op that made a NaN in it), the
        inputs backward saved. Otherwise they are read before the update."""
        pf = self._prefetched[-1] if self._prefetched else None
        if pf is None or self._trace.anomaly is not None:
            return
        # inside an optimizer's step (a closure's evaluation, LBFGS): read now, waiting for
        # the forward if it must -- the optimizer updates the weights as soon as the
        # closure returns, with no hook before it; LBFGS's float(closure()) waits for the
        # device there anyway
        inside = self._opt_running
        if not (inside or pf.read.ready()):
            return
        # inside: the last evaluation's gradients too, unread ahead of the forward's
        self._materialize(keep_trigger=True, prefetched_only=not inside)
        if self._new_trigger is None:
            return
        t = tensors if isinstance(tensors, torch.Tensor) else None
        if t is None and isinstance(tensors, (tuple, list)) and len(tensors) == 1:
            t = tensors[0] if isinstance(tensors[0], torch.Tensor) else None
        self._late = True
        try:
            self._handle_trigger(None, loss=t if t is not None and t.grad_fn is not None else None)
        finally:
            self._late = False

    def _prefetch(self, *, wait: bool) -> None:
        """The statistics measured so far start their way to the host, in a copy enqueued
        behind the work that made them, and nothing waits: when backward is about to run
        (the forward's, the loss's too: ``wait``, the optimizer pre-hook waits for them,
        which is for the forward alone while the GPU runs backward) and when it has been
        enqueued (what backward made and the gradients' norms: read before the update only
        if they have landed by then, see :meth:`_flush_before_update`)."""
        if _tracing() or capturing() or self._device_dead or ops.replaying():
            return
        rows, grads, nodes = self._pending, self._pending_grads, self._pending_nodes
        if not (rows or grads or nodes):
            return
        self._pending, self._pending_grads, self._pending_nodes = [], [], []
        values = [x for r in rows for x in (r[1], r[2])]
        values += [x for _, a, b in grads for x in (a, b)]
        read = HostRead(values + [f for *_, f in nodes])
        self._prefetched.append(_Prefetch(rows, grads, nodes, read, wait))

    def _tap_backward(self, tensors: Any) -> None:
        """``backward()`` is about to run: a loss computed by code outside every watched
        module (``F.cross_entropy``, a hand-written log-loss) is recorded like a module's
        output, so a NaN born there is found in forward, where it was born."""
        if not self._attached or threading.get_ident() != self._thread or ops.replaying():
            return
        if _tracing() or capturing():
            return
        # a training backward: gradients go into .grad. torch.autograd.grad (a gradient
        # penalty, an input saliency, an adversarial example) is not one, and does not
        # end the step
        if not self._grad_call:  # a loss from unwatched modules, after no_grad calls
            if self._foldable:
                self._fold(LOSS_PATH)
            self._grad_call = True
        self._backward_called = True
        self._ever_backward_called = True
        self._loss_by_grad = False
        if "loss" in self._disabled_hooks:
            return
        try:
            if self._derived_fns:
                with _NO_TORCH_FUNCTION():
                    self._keep_derived()
            if self._forensic or self._loss_graph_armed:
                self._backward_site = _frames.user_line()
                if self._anomaly_paused:  # raised from an earlier backward, and caught
                    self._anomaly_paused = False
                    torch.autograd.set_detect_anomaly(True, check_nan=False)
            t = tensors if isinstance(tensors, torch.Tensor) else None
            if t is None and isinstance(tensors, (tuple, list)) and len(tensors) == 1:
                t = tensors[0] if isinstance(tensors[0], torch.Tensor) else None
            if t is None or t.numel() != 1 or not t.is_floating_point():
                return
            if not self._broadcast_checked and t.grad_fn is not None:
                self._broadcast_checked = True
                try:
                    with _NO_TORCH_FUNCTION():
                        self._check_broadcast(t)
                except Exception as exc:  # its own fault: the loss's hooks go on
                    self._fault("loss-broadcast", "loss broadcast check", exc)
            if self._probing is not None:
                self._end_probe()
            if (
                (not self._compiled_warned or self._probe_due)
                and not self._transformed
                and all(c.is_loss for c in self._trace.calls)
            ):
                # only the criterion, or nothing, ran in eager mode: a compiled model? (any
                # module call counts: checkpoint_sequential calls a root's children alone;
                # calls under vmap/grad are not watched, as documented, and say nothing)
                with _NO_TORCH_FUNCTION():
                    # sentinel hooks only the roots: children called one by one (by hand,
                    # checkpoint_sequential) leave no call, so only a compiled graph tells
                    if not self._compiled_warned:
                        self._warn_if_unwatched(t, compiled_only=not self._full)
                    if self._probe_due:
                        self._probe_parts(t)
            self._loss_factor = _constant_factor(t.grad_fn)  # O(1), no read
            entry = self._known.get(id(t))
            if entry is not None and entry[0]() is t:
                # a watched module (the criterion) produced it: already recorded; the
                # gradients its own code makes (xlogy at 0) are checked as a loss's are,
                # named by that module
                rec = self._trace.record(entry[1])
                call = self._trace.call(rec.call) if rec is not None else None
                if call is not None and self._full and not self._forensic:
                    with _NO_TORCH_FUNCTION():
                        self._hook_loss_graph(t, path=call.path)
                return
            with _NO_TORCH_FUNCTION():
                self._record_loss(t)
                if self._full and not self._forensic:
                    self._hook_loss_graph(t)
                    if self._loss_snaps and (t.device.type != "cpu" or self._defer_cpu):
                        self._hold_late_loss(t)
                elif not self._full:
                    self._loss_ref = weakref.ref(t)
                    if t.device.type != "cpu" or self._defer_cpu:
                        # read late, when the user may have dropped the loss: its nodes'
                        # names are taken now (a walk of the loss code alone, no sync),
                        # and what they saved (references, no read), which backward frees
                        self._loss_risky = self._loss_risky_nodes(keep=True)
                        self._hold_late_loss(t)
                    else:
                        self._keep_risky_saved(t)
                elif t.device.type != "cpu" or self._defer_cpu:
                    # forensic, read late: the loss code's graph as backward begins, as
                    # above (its ops' lines are on its nodes: anomaly mode is on)
                    self._loss_risky_nodes(keep=True, loss=t)
                    self._hold_late_loss(t)
        except NanwatchError:
            raise
        except Exception as exc:
            self._fault("loss", "backward tap", exc)

    def _check_broadcast(self, loss: torch.Tensor) -> None:
        """The first ``backward()`` of a watch: a hand-written loss that broadcast a column
        against a row (``((pred - y) ** 2).mean()``, ``pred`` (N, 1), ``y`` (N,): an N x N
        loss, of which PyTorch says nothing outside its loss functions) is told once, a
        warning of the report at the user's line (NW506, as the loss functions' guard says
        it). Read from the graph's shape metadata (:func:`ops.column_broadcast`) of the
        loss code's nodes, no tensor read; an operand without history is the local the
        statement names, whose shape must be the row's. Once a watch, not every step."""
        stop = self._recorded_nodes
        walk = ops.GraphWalk(
            [loss.grad_fn],
            prune=lambda n: (n in stop and n is not loss.grad_fn) or ops.accumulates_grad(n),
            limit=256,
        )
        found = [f for n in walk if (f := ops.column_broadcast(n)) is not None]
        frame = _frames.user_frame() if found else None
        if frame is None:
            return
        from nanwatch.rules.guards import column_broadcast_words

        site, _ = _frames.describe_frame(frame)
        told = (column_broadcast_words(f, site, frame.f_locals, frame.f_globals) for f in found)
        words = next((w for w in told if w is not None), None)
        if words is None:
            return
        # a warning of the step's report (told at the step's end, as every diagnosis is)
        self.note("guard", LOSS_PATH, source=words.pop("source"), hand=True, **words)

    def _hold_late_loss(self, t: torch.Tensor) -> None:
        """Hold the loss ``backward()`` runs on, recorded just now, until the step ends, when
        what its code's nodes saved was kept (see :attr:`_late_loss`); by its record, for
        a step that runs backward on several (an optimizer's closure)."""
        self._late_loss = t if self._loss_snaps else None
        entry = self._known.get(id(t))
        if self._late_loss is not None and entry is not None:
            self._late_losses[entry[1]] = t
        if self._late_loss is not None:
            # the nodes of the watched values alive now, where a walk of the loss code ends
            # (see _graph_stops): read after backward, some may be gone. Host-side, one
            # pass over the step's known tensors, only when loss code was kept
            self._late_stops += [x.grad_fn for x in self._watched_values(t)]

    def _hook_loss_graph(self, loss: torch.Tensor, *, path: str = LOSS_PATH) -> None:
        """Check the gradients that the backward of a loss computed outside the watched
        modules makes: the few autograd nodes between the loss and the watched outputs get
        a post-hook, so a NaN or inf born there (``(1 - p) ** 0.5`` at p == 1) is named by
        its node and by what the node saved in forward, read before autograd frees it.

        A check reads the gradient at once: free on CPU, a sync per node on accelerators,
        where it runs only after a gradient from outside the modules went bad earlier in
        the run (until then the anomaly's message says what names the op)."""
        if "loss-graph" in self._disabled_hooks or loss.grad_fn is None:
            return
        if capturing():
            return  # each check reads a gradient: a CUDA graph capture forbids it
        if (loss.device.type != "cpu" or self._defer_cpu) and not self._loss_graph_armed:
            self._flag_loss_nodes(loss, path)
            return
        if loss.device.type != "cpu" or self._defer_cpu:
            # an accelerator's backward runs the nodes' hooks on its own thread, where no
            # frame of the user's is on the stack: their names are taken now (see
            # _forward_line)
            self._hold_loss_names()
        stop = self._recorded_nodes
        nodes: list[Any] = []
        last: list[str] = []
        walk = ops.GraphWalk(
            [loss.grad_fn],
            # the loss's own node is recorded when a watched loss module made it
            prune=lambda n: (n in stop and n is not loss.grad_fn) or ops.accumulates_grad(n),
            limit=_LOSS_NODES,
        )
        budget = _LOSS_ELEMENTS
        beside: list[Any] = []  # the nodes of ``last``
        for node in walk:
            if type(node).__name__ in _GRAD_MOVERS:
                pass  # moving a finite gradient keeps it finite
            elif path == LOSS_PATH and _feeds_only(node, stop, 4):
                last.append(ops.name_of(node))  # what it makes is checked by the outputs' hooks
                beside.append(node)
            else:
                budget -= _grad_elements(node)
                if budget < 0:
                    walk.truncated = True
                    break
                nodes.append(node)
        if not walk.truncated and len(set(last)) > 1:
            # several kinds of node next to the outputs (x[:, 2] / x[:, 3] beside x[:, 0] - y):
            # the outputs' hooks see their sum, and which one made a NaN cannot be told from
            # it, so each gets a check of its own; one kind alone is named without one
            for node in beside:
                budget -= _grad_elements(node)
                if budget < 0:
                    break
                nodes.append(node)
        self._loss_last = None if walk.truncated else last
        check = self._on_loss_node
        gen, step = self._gen, self._step
        handles = self._tensor_handles
        for node in nodes:
            name = ops.name_of(node)

            def on_node(
                grad_inputs: tuple[torch.Tensor | None, ...],
                grad_outputs: tuple[torch.Tensor | None, ...],
                name: str = name,
            ) -> None:
                check(gen, step, name, grad_inputs, grad_outputs, path=path)

            handles.append(node.register_hook(on_node))

    def _flag_loss_nodes(self, loss: torch.Tensor, path: str) -> None:
        """Accelerators: the loss code's autograd nodes whose backward can make a NaN or
        inf from a finite gradient (a sqrt, a fractional power, a division; see
        :meth:`_loss_risky_nodes`) get a post-hook that leaves one flag on the device --
        did the node make a non-finite gradient from a finite one -- read with the step's
        other statistics (no sync here). The first node flagged is named by its op; what
        it saved in forward is freed by then, so the evidence is its name and line."""
        stop = self._recorded_nodes
        reached: list[Any] = []  # the watched values' nodes where the walk ends

        def prune(n: Any) -> bool:
            if n in stop and n is not loss.grad_fn:
                reached.append(n)
                return True
            return ops.accumulates_grad(n)

        walk = ops.GraphWalk([loss.grad_fn], prune=prune, limit=_LOSS_NODES)
        gen, step = self._gen, self._step
        # the user's backward() line, once (not a frame walk in each node's hook), and the
        # nodes of its frame's local tensors: read late, the function that computed the
        # loss (a helper's) may have returned, and its names say which line made a node
        self._flag_site = _frames.describe_frame(self._hold_loss_names())
        last: list[str] = []
        for node in walk:
            base = re.sub(r"Backward\d*$", "", type(node).__name__)
            # what it saved, while autograd holds it: a node no flag checks (0 x inf in a
            # Mul, (p - y) ** 2 of a NaN target) is found by it (see _saved_loss_node)
            snap = self._snapshot(node)
            if snap is not None:
                self._loss_snaps.append((ops.name_of(node), path, snap))
            if (
                type(node).__name__ not in _GRAD_MOVERS
                and path == LOSS_PATH
                and _feeds_only(node, stop, 4)
            ):
                # as on the CPU: the node next to the outputs is named when the outputs'
                # hooks see its gradient go bad and no flag names another (by name only)
                last.append(ops.name_of(node))
            if base not in _FLAGGED_BACKWARD and ops.custom_function(node) is None:
                continue  # a custom Function's backward is the user's: it can make anything
            e = _pow_exponent(node) if base == "Pow" else None
            if _whole_power(e):
                continue  # x ** 2: a finite derivative everywhere
            # the exponent, a number: read now, before autograd frees it
            scalars: dict[str, Any] = {"exponent": e} if e is not None else {}
            name = ops.name_of(node)
            # what a log was taken of (a softmax, 1 - a sigmoid), from the graph alone:
            # its saved input is freed before the flag is read
            made = (
                ops.made_from(node, lambda n: n in stop, below=True, through=True)
                if base in _LOGS
                else []
            )

            def on_node(
                grad_inputs: tuple[torch.Tensor | None, ...],
                grad_outputs: tuple[torch.Tensor | None, ...],
                name: str = name,
                scalars: dict[str, Any] = scalars,
                made: list[str] = made,
            ) -> None:
                if not self._attached or gen != self._gen or step != self._step:
                    return
                if "loss-graph" in self._disabled_hooks or ops.replaying():
                    return
                try:
                    with _NO_TORCH_FUNCTION(), torch.no_grad():
                        self._flag_loss_node(
                            name, path, scalars, grad_inputs, grad_outputs, chain=made
                        )
                except Exception as exc:
                    self._fault("loss-graph", "loss-code gradient check", exc)

            self._tensor_handles.append(node.register_hook(on_node))
        self._loss_last = None if walk.truncated else last
        if reached:
            self._hold_loss_inputs(loss, reached)

    def _hold_loss_inputs(self, loss: torch.Tensor, nodes: list[Any]) -> None:
        """Read late (nothing landed as backward began), the watched values the loss code
        read (``nodes``: theirs, where its graph's walk ended) are held, while unread, until
        their statistics are read: one found bad is then described in full (its NaN and
        inf counts, its largest finite value, see :meth:`_describe_bad`), as the CPU path
        describes it when measured, and not by its min and max alone because the user's
        code dropped it (a function's local). References, no read; within
        :data:`_KEEP_SAVED` bytes a step, shared with what the loss code's nodes saved."""
        ends = {id(n) for n in nodes}
        for x in self._watched_values(loss):
            entry = self._known.get(id(x))
            if entry is None or id(x.grad_fn) not in ends:
                continue
            rec = self._trace.record(entry[1])
            if rec is None or rec.stat is not None or rec.index not in self._minmax:
                continue  # read already, or nothing to read (an integer tensor)
            size = numel(x) * x.element_size()
            if self._kept_saved + size > _KEEP_SAVED:
                continue
            self._kept_saved += size
            self._late_values[entry[1]] = x

    def _flag_loss_node(
        self,
        name: str,
        path: str,
        scalars: dict[str, Any],
        grad_inputs: tuple[torch.Tensor | None, ...],
        grad_outputs: tuple[torch.Tensor | None, ...],
        *,
        chain: list[str],
    ) -> None:
        # one min/max pass over each gradient (NaN shows in both, an inf in one): a node of
        # a hand-written loss can hold a logits-sized gradient, read once, not per kind
        made = [m for g in grad_inputs if g is not None and (m := minmax(g)) is not None]
        got = [m for g in grad_outputs if g is not None and (m := minmax(g)) is not None]
        if not made:
            return
        lo = torch.stack([m[0].float() for m in made])
        hi = torch.stack([m[1].float() for m in made])
        nan = (lo.isnan() | hi.isnan()).any()
        pos = (hi == math.inf).any()
        neg = (lo == -math.inf).any()
        bad = nan | pos | neg
        if got:  # it arrived finite: born here
            ends = torch.stack([x.float() for m in got for x in m])
            bad = bad & torch.isfinite(ends).all()
        # which kinds were born, as on the CPU (a -inf is not called +inf): one bit each
        kinds = nan.to(torch.int8) + 2 * pos.to(torch.int8) + 4 * neg.to(torch.int8)
        flag = bad.to(torch.int8) * kinds
        dtype = next(g.dtype for g in grad_inputs if g is not None and g.is_floating_point())
        site = self._backward_site if self._backward_site[0] else self._flag_site
        node = ops.current_autograd_node()
        snap = self._keep_saved(node)
        # the node's forward line: kept on it in anomaly mode only (a string, no read)
        line = (
            ops.forward_line(node) if node is not None and torch.is_anomaly_enabled() else _NO_LINE
        )
        self._pending_nodes.append(
            (name, path, dtype_name(dtype), site, line, scalars, chain, snap, flag)
        )

    def _keep_derived(self) -> None:
        """Read late (the accelerator path), as ``backward()`` begins: what the nodes of the
        code between two roots saved (``w / w.norm()`` of a hypernetwork's output, passed to
        a loss module), below each root input that code computed (:meth:`_record_inputs`)
        down to the watched values, kept (references, no read, within :data:`_KEEP_SAVED`).
        A NaN born there is found after backward freed them; its op is then read from these
        (:meth:`_pinpoint_derived_input`), as the CPU path reads the live graph."""
        roots, self._derived_fns = self._derived_fns, []
        own = {id(fn): fn for fn in roots}
        stop = self._recorded_nodes
        walk = ops.GraphWalk(
            roots,
            prune=lambda n: (n in stop and own.get(id(n)) is not n) or ops.accumulates_grad(n),
            limit=_LOSS_NODES,
        )
        for node in walk:
            snap = self._snapshot(node)
            if snap is not None:
                self._input_snaps.append(snap)

    def _snapshot(self, node: Any) -> ops.SavedNode | None:
        """:meth:`_keep_saved` for a node of a walk as ``backward()`` begins; None for a node
        that only moves a gradient (a view, an expand: what it saved is no evidence)."""
        return None if type(node).__name__ in _GRAD_MOVERS else self._keep_saved(node)

    def _keep_saved(self, node: Any) -> ops.SavedNode | None:
        """What a flagged loss-code node saved in forward, kept until its flag is read:
        references taken in its hook, no read. Read late, the node's saved values are freed
        by then, and they are the evidence (the zeros a log was given, the -inf a
        ``torch.where`` kept), as the CPU path reads them in the hook. At most
        :data:`_KEEP_SAVED` bytes a step: a node over it is named by its name alone."""
        if node is None or ops.custom_function(node) is not None:
            return None
        for _, _, kept in self._loss_snaps:  # taken when backward began: the same values
            if kept.node is node:
                return kept
        try:
            snap = ops.SavedNode(node)
        except Exception:  # an unusual node: its name is the evidence
            return None
        if self._kept_saved + snap.nbytes > _KEEP_SAVED:
            return None
        self._kept_saved += snap.nbytes
        return snap

    def _read_loss_nodes(self, nodes: list[_PendingNode], flags: list[float]) -> None:
        """The first loss-code node flagged by :meth:`_flag_loss_node` becomes the op
        event of the step (by name: what it saved is freed), as :meth:`_check_loss_node`
        makes one on the CPU."""
        for (name, path, dtype, site, line, scalars, made, snap, _), flag in zip(
            nodes, flags, strict=True
        ):
            if not flag or self._loss_node_bad:
                continue
            self._loss_node_bad = True
            bits = int(flag)
            nan, pos, neg = bool(bits & 1), bool(bits & 2), bool(bits & 4)
            # nothing was counted: min and max alone say which kinds were born
            lo = -math.inf if neg else math.nan if nan else math.inf
            hi = math.inf if pos else math.nan if nan else -math.inf
            out = TensorStat(lo, hi, 0)
            ev = self._saved_node_event(snap, name, out, dtype) if snap is not None else None
            if ev is None:  # by name alone
                ev = _node_event(name, path, out, dtype, site, scalars=scalars)
                _place(ev, line, site)
            else:  # what it saved, kept in its hook: as the CPU path reads it there
                ev.path = path
                _place(ev, line, site)
                ev.scalars = {**scalars, **ev.scalars}
            ev.made_from = list(made) or ev.made_from
            if snap is not None and not ev.made_from_history:
                ev.made_from_history = ops.operand_history(snap.node)
            # anomaly mode's line is exact; without it, the names backward()'s frame held
            fwd = None if line[0] is not None else self._forward_line(snap.node if snap else None)
            if fwd is not None:
                ev.source, ev.code = fwd
            self._trace.ops.append(ev)
            return

    def _saved_node_event(
        self, snap: ops.SavedNode, name: str, out: TensorStat, dtype: str
    ) -> OpEvent | None:
        """The event of a flagged node from what it saved (see :meth:`_keep_saved`), when
        nothing written in place since changed it; None otherwise. Reads its saved values:
        anomaly-time work only."""
        if not snap.unchanged():
            return None
        try:
            with _NO_TORCH_FUNCTION(), torch.no_grad():
                return ops.node_event(snap, None, name=name, out=out, dtype=dtype)
        except Exception:  # an unusual node: its name is the evidence
            return None

    def _on_loss_node(
        self,
        gen: int,
        step: int,
        name: str,
        grad_inputs: tuple[torch.Tensor | None, ...],
        grad_outputs: tuple[torch.Tensor | None, ...],
        *,
        path: str = LOSS_PATH,
    ) -> None:
        if not self._attached or gen != self._gen or step != self._step or self._loss_node_bad:
            return
        if "loss-graph" in self._disabled_hooks or ops.replaying():
            return
        try:
            with _NO_TORCH_FUNCTION():
                self._check_loss_node(name, grad_inputs, grad_outputs, path=path)
        except NanwatchError:
            raise
        except Exception as exc:
            self._fault("loss-graph", "loss-code gradient check", exc)

    def _check_loss_node(
        self,
        name: str,
        grad_inputs: tuple[torch.Tensor | None, ...],
        grad_outputs: tuple[torch.Tensor | None, ...],
        *,
        path: str = LOSS_PATH,
    ) -> None:
        """The first node of the step whose gradient is not finite, while the gradient it
        received was: record an op event with what the node saved in forward (``path``: the
        loss module whose code made the node, or the loss code outside the modules)."""
        bad = next((g for g in grad_inputs if g is not None and not _finite(g)), None)
        if bad is None:
            return
        self._loss_node_bad = True  # later nodes only pass it on
        if any(o is not None and not _finite(o) for o in grad_outputs):
            return  # it arrived non-finite: not born here
        node = ops.current_autograd_node()
        ev = ops.node_event(node, bad, name=name)
        ev.path = path
        line = ops.forward_line(node) if node is not None else _NO_LINE
        if line[0] is None:
            # without anomaly mode a node holds no forward line: the user's frame that
            # called backward() tells it, from its locals' graphs, when the loss code ran there
            line = self._forward_line(node, _frames.user_frame()) or _NO_LINE
        _place(ev, line, self._loss_site())
        self._trace.ops.append(ev)

    def _hold_loss_names(self) -> Any:
        """As ``backward()`` begins on the loss code: the user's frame that called it, whose
        code, line and local tensors' nodes are kept for :meth:`_forward_line` (references,
        no read: a look at the frame's names, once a step)."""
        frame = _frames.user_frame()
        if frame is not None:
            self._loss_held = (frame.f_code, frame.f_lineno, ops.held_nodes(frame))
        return frame

    def _forward_line(self, node: Any, frame: Any = None) -> tuple[str, str] | None:
        """:func:`ops.statement_line` of a loss-code ``node``, the walk ending at the watched
        values: from ``frame`` (the user's, running ``backward()`` now), else, read late,
        from the names the frame that called ``backward()`` held then (see
        :meth:`_flag_loss_nodes`); None when it cannot tell (or fails: the backward() line
        stands)."""
        if node is None:
            return None
        stop = self._recorded_nodes
        try:
            if frame is not None:
                held = (frame.f_code, frame.f_lineno, ops.held_nodes(frame))
            elif self._loss_held is not None:
                held = self._loss_held
            else:
                return None
            code, line, nodes = held
            return ops.statement_line(node, nodes, code, line, stop=lambda n: n in stop)
        except Exception:
            return None

    def _saved_loss_node(self, anomaly: Anomaly) -> OpEvent | None:
        """Read late, a gradient from the loss code went bad at a watched output and no
        flag named a node: the first loss-code node, nearest the loss, that saved an operand
        holding a NaN or inf (kept when backward began, see :meth:`_flag_loss_nodes`), whose
        backward multiplies the gradient by it (0 x inf where a ``torch.where`` or a mask
        hid it), as the CPU path finds it in that node's hook. Reads the kept values:
        anomaly-time work only; None when none holds one."""
        stat = anomaly.record.stat or TensorStat(math.nan, math.nan, 0)
        site = self._loss_site()
        for name, path, snap in self._loss_snaps:
            # an operand its backward multiplies the gradient by: 0 x inf is NaN there (a
            # gather's or a view's saved input is only its shape; a result of NaN is its own
            # forward op's, log_softmax of a row of -inf, which the name-only event tells)
            factors = _GRAD_FACTORS.get(re.sub(r"Backward\d*$", "", name), ())
            if not factors or not snap.unchanged():
                continue
            held = [getattr(snap, a, None) for a in factors]
            if not any(isinstance(t, torch.Tensor) and _nonfinite_values(t) for t in held):
                continue
            ev = self._saved_node_event(snap, name, stat, anomaly.record.dtype)
            if ev is None:
                continue
            ev.path = path
            line = ops.forward_line(snap)
            if line[0] is None:
                line = self._forward_line(snap.node) or _NO_LINE
            _place(ev, line, site)
            return ev
        return None

    def _keep_risky_saved(self, loss: torch.Tensor) -> None:
        """Sentinel on the CPU, as ``backward()`` begins on loss code with several nodes
        that can make a non-finite gradient from a finite one (see
        :meth:`_loss_risky_nodes`; two logs of a hand-written BCE are two): what those
        nodes saved is kept (references, no read; within :data:`_KEEP_SAVED` bytes a step),
        which autograd frees before a watched output's gradient is checked. The one that
        made a NaN is then told by its saved values (see :meth:`_steep_loss_node`); one
        node alone is named by its name."""
        if loss.grad_fn is None:
            return
        stop = self._recorded_nodes
        walk = ops.GraphWalk(
            [loss.grad_fn],
            prune=lambda n: n in stop or ops.accumulates_grad(n),
            limit=_LOSS_NODES,
        )
        risky = [n for n in walk if _risky_backward(n)]
        if walk.truncated or len(risky) < 2:
            return
        for node in risky:
            snap = self._keep_saved(node)
            if snap is not None:
                self._loss_snaps.append((ops.name_of(node), LOSS_PATH, snap))

    def _steep_loss_node(
        self, anomaly: Anomaly, among: Sequence[Any] | None = None
    ) -> OpEvent | None:
        """A gradient from the loss code went bad at a watched output and no node was checked
        as it ran (sentinel), nor named alone: of the loss code's nodes whose saved values
        were kept as backward began, the one whose forward was given a point where its
        derivative is infinite (see :func:`_steep_count`: the exact zeros of
        ``(1 - p) ** 0.5`` at p == 1), named with those values and its line, as watch names
        it in its hook. When several were, the one whose backward ran first: the one made
        last in forward (autograd runs a ready node of a higher sequence number first, and
        a node's consumers are numbered after it), as a check in each node's hook finds it
        (the ``log(1 - p)`` of ``torch.where(y > 0, log(p), log(1 - p))``). ``among``: only
        these nodes (those on the way to a parameter). None when none. Reads the kept
        values: anomaly-time work only."""
        if self._loss_node_bad:
            return None
        steep = [
            (name, path, snap)
            for name, path, snap in self._loss_snaps
            if (among is None or any(n is snap.node for n in among))
            and _risky_backward(snap.node)
            and snap.unchanged()
            and _steep_count(snap)
        ]
        if not steep:
            return None
        order = ops._in_run_order([s.node for _, _, s in steep])
        name, path, snap = next(c for c in steep if c[2].node is order[-1])
        stat = anomaly.record.stat or TensorStat(math.nan, math.nan, 0)
        # read late (at the step end, even), the backward() line and the names its frame
        # held were taken as backward began
        late = self._late or self._read_late()
        site = self._flag_site if late and self._flag_site[0] else self._loss_site()
        ev = self._saved_node_event(snap, name, stat, anomaly.record.dtype)
        if ev is None:
            ev = _node_event(name, path, stat, anomaly.record.dtype, site)
        ev.path = path
        line = ops.forward_line(snap)
        if line[0] is None:
            frame = None if late else _frames.user_frame()
            line = self._forward_line(snap.node, frame) or _NO_LINE
        _place(ev, line, site)
        return ev

    def _last_loss_node(self, anomaly: Anomaly) -> OpEvent | None:
        """A gradient from outside the modules went bad at a watched output, and every
        gradient the loss code's checked nodes made was finite: the node that feeds the
        output directly made it, when there is one such node (by name only: what it saved
        was freed once it ran)."""
        last = self._loss_last
        if last is None and not self._full:
            last = self._loss_risky_names()
        if not last or len(set(last)) != 1 or self._loss_node_bad:
            return None
        name = last[0]
        stat = anomaly.record.stat or TensorStat(math.nan, math.nan, 0)
        site = self._loss_site()
        ev = _node_event(name, LOSS_PATH, stat, anomaly.record.dtype, site)
        node = self._loss_node_named(name)
        if node is not None:
            # the one node of that kind: the line that made it, from the names the user's
            # frame holds (an RMSE's ``torch.sqrt(F.mse_loss(out, y))`` in a helper)
            line = ops.forward_line(node)
            if line[0] is None:
                frame = None if self._late else _frames.user_frame()
                line = self._forward_line(node, frame) or _NO_LINE
            _place(ev, line, site)
        return ev

    def _held_loss(self) -> torch.Tensor | None:
        """The loss ``backward()`` was last called on, while the user holds it, else the one
        kept for a late read; None when neither is."""
        loss = self._loss_ref() if self._loss_ref is not None else None
        return loss if loss is not None else self._late_loss

    def _loss_node_named(self, name: str) -> Any:
        """The loss code's one autograd node called ``name`` (between the loss backward()
        ran on and the watched outputs); None when the loss is gone, its graph too large,
        or it holds none or several. A walk of the loss code: anomaly-time work only."""
        loss = self._held_loss()
        if loss is None or loss.grad_fn is None:
            return None
        stop = self._recorded_nodes
        walk = ops.GraphWalk(
            [loss.grad_fn],
            prune=lambda n: n in stop or ops.accumulates_grad(n),
            limit=_LOSS_NODES,
        )
        found = [n for n in walk if ops.name_of(n) == name]
        return found[0] if len(found) == 1 and not walk.truncated else None

    def _name_risky_loss_nodes(self, anomaly: Anomaly) -> None:
        """Sentinel: a gradient from the loss code went bad at a watched output, and the loss
        code holds several nodes whose backward can make it (see :meth:`_loss_risky_nodes`):
        the summary names their kinds, the candidates a guard goes on."""
        risky = self._loss_risky_names()
        if not risky or self._loss_node_bad:
            return
        kinds = list(dict.fromkeys(risky))
        listed = ", ".join(kinds[:4]) + (f" and {len(kinds) - 4} more" if len(kinds) > 4 else "")
        head = "the loss code between the model's output and backward()"
        if head not in anomaly.summary:
            return
        anomaly.summary = anomaly.summary.replace(
            head,
            f"{head}, whose nodes {listed} can each make a non-finite gradient from a finite "
            "one: an input at the edge of its domain, a division by 0",
            1,
        )

    def _loss_risky_names(self) -> list[str] | None:
        """Sentinel: :meth:`_loss_risky_nodes`, or what the accelerator path named at
        ``backward()`` (the loss may be gone when its values are read)."""
        if self._loss_risky is not None:
            return self._loss_risky
        return self._loss_risky_nodes() if self._loss_ref is not None else None

    def _loss_risky_nodes(
        self, *, keep: bool = False, loss: torch.Tensor | None = None
    ) -> list[str] | None:
        """Sentinel: the nodes of the loss code (between the loss ``backward()`` was called
        on and the watched outputs) whose backward can make a non-finite gradient from a
        finite one (a sqrt, a division, a fractional power); None when the loss is gone or
        its graph too large. By name only: the values they saved are freed. ``keep``: as
        ``backward()`` begins, every node's saved values are kept too (see
        :meth:`_keep_saved`), for a read after backward. ``loss``: the loss to walk from
        (else the one ``backward()`` was last called on, while the user holds it)."""
        if loss is None:
            loss = self._loss_ref() if self._loss_ref is not None else None
        if loss is None or loss.grad_fn is None:
            return None
        if keep:  # read late: the user's backward() line, while it runs (see _loss_site)
            self._flag_site = _frames.user_line()
        stop = self._recorded_nodes
        walk = ops.GraphWalk(
            [loss.grad_fn],
            prune=lambda n: n in stop or ops.accumulates_grad(n),
            limit=_LOSS_NODES,
        )
        found: list[str] = []
        for node in walk:
            snap = self._snapshot(node) if keep else None
            if snap is not None:
                self._loss_snaps.append((ops.name_of(node), LOSS_PATH, snap))
            typ = type(node).__name__
            base = re.sub(r"Backward\d*$", "", typ)
            if base == "Pow" and _whole_power(_pow_exponent(node)):
                continue  # x ** 2: a finite derivative everywhere
            # a custom autograd.Function's node (``<Function>Backward``, no number): its
            # backward is any code of the user's; a module's full backward hook is not one
            custom = typ.endswith("Backward") and typ != "BackwardHookFunctionBackward"
            if base in _RISKY_BACKWARD or custom:
                found.append(ops.name_of(node))
        if keep and found and self._loss_held is None:
            # read late, such a node may be named after backward (see _loss_node_of_param):
            # the line that made it is found from the names the user's frame holds now
            self._hold_loss_names()
        return None if walk.truncated else found

    def _loss_site(self) -> tuple[str | None, str | None]:
        """The user's ``backward()`` line of the step, for an event of the loss code: taken
        when backward began (the backward tap, forensic; the loss code's walk, read late),
        else the line running now -- on the CPU path, the ``backward()`` itself. Read late
        (before the update, at the step end) the line running now is another one."""
        if self._backward_site[0]:
            return self._backward_site
        if self._late and self._flag_site[0]:
            return self._flag_site
        return _frames.user_line()

    def _backward_site_of_step(self) -> tuple[str | None, str | None]:
        """The user's ``loss.backward()`` line, taken by the backward tap (forensic)."""
        return self._backward_site

    def _warn_if_unwatched(self, loss: torch.Tensor, *, compiled_only: bool = False) -> None:
        """backward() runs through watched parameters although no watched module ran in
        eager mode this step, and torch.compile ran: the model runs compiled (torch.compile
        traces hooks away). Say so once instead of watching nothing in silence.
        ``compiled_only``: only when the graph holds a compiled function's node.

        Only on evidence of compilation (a compiled graph's node below the loss, or a frame
        torch.compile compiled since ``watch()`` attached): a parameter read by a method
        that is not ``forward`` (temperature scaling's ``temperature_scale(logits)`` on
        cached logits) reaches backward with no module call, and nothing is compiled."""
        frames = _dynamo_frames()
        if frames is None or frames == self._dynamo_looked:
            return  # nothing compiled, or nothing since the last look found no evidence
        ours = {id(p) for _, _, p in self._params}
        nodes = list(ops.GraphWalk([loss.grad_fn], limit=10_000))
        compiled = any("CompiledFunction" in type(n).__name__ for n in nodes)
        if not compiled and frames <= self._dynamo_at_attach:
            # no compiled graph's node, and torch.compile ran no frame since watch(): a
            # parameter read outside forward; looked at again once torch.compile runs
            self._dynamo_looked = frames
            return
        if compiled_only and not compiled:
            self._compiled_warned = True  # eager children called one by one: decided, and
            return  # not walked again at every step
        for node in nodes:
            var = getattr(node, "variable", None)
            if var is not None and id(var) in ours:
                self._compiled_warned = True
                _frames.warn_at_user(
                    "nanwatch: backward() went through the watched model's parameters, but "
                    "none of its modules ran in eager mode this step: a model run under "
                    "torch.compile is not watched. Watch the eager model and compile it "
                    "after debugging.",
                    NanwatchWarning,
                    safe=True,
                )
                return

    def _probe_parts(self, loss: torch.Tensor) -> None:
        """Sentinel mode hooks only the roots, and ``backward()`` runs on a loss although no
        root ran this step: the loop calls parts of a root itself (a LightningModule's
        training_step calling ``self.net(x)``, a backbone and a head called one by one, a
        wrapper's ``model.module(x)``). Once per watcher: when the loss reaches watched
        weights, this step's localization is told (a ``"root_not_called"`` note: the root,
        and the smallest part that holds every watched weight the loss reached), and every
        part is hooked until the next ``backward()``, which keeps the hooks of the parts
        called from outside every watched call -- the real roots -- and removes the rest
        (see :meth:`_end_probe`). Host-side: one walk of the loss's graph, no read."""
        self._probe_due = False
        owners = {id(p): path for _, path, p in self._params}
        reached: set[str] = set()
        walk = ops.GraphWalk([loss.grad_fn], limit=10_000)
        for node in walk:
            var = getattr(node, "variable", None)
            if var is not None and id(var) in owners:
                reached.add(owners[id(var)])
            elif "CompiledFunction" in type(node).__name__:
                return  # a compiled model: hooks would only make torch.compile compile again
        if not reached:
            return  # not the watched model's loss
        root_of: dict[str, str] = {}
        root = ""
        for _, info in self._modules:
            if info.is_root:
                root = info.path
            root_of[info.path] = root
        roots = {root_of.get(p, "") for p in reached}
        if len(roots) != 1:
            return  # the weights of several roots: not one root left uncalled
        (root,) = roots
        parts = [p.split(".") for p in reached]
        common: list[str] = []
        for names in zip(*parts, strict=False):
            if len(set(names)) != 1:
                break
            common.append(names[0])
        part = ".".join(common)
        # (a walk cut short may not have reached every weight: no part is named then)
        part = part if part in root_of and part != root and not walk.truncated else ""
        self.note("root_not_called", root, part=part, front=self.front)
        compiled = {  # the modules inside a torch.compile'd submodule run compiled
            id(x) for r in self.roots for m in r.modules() if _is_compiled(m)
            for x in cast(nn.Module, m._orig_mod).modules()
        }  # fmt: skip
        probed: dict[int, list[Any]] = {}
        for module, info in self._modules:
            if info.is_root or info.post_only or root_of.get(info.path) != root:
                continue
            if id(module) in compiled:
                continue
            pre = module.register_forward_pre_hook(
                self._make_pre(info, module), with_kwargs=True, prepend=True
            )
            info.pre_id = pre.id
            post = module.register_forward_hook(
                self._make_post(info, module), with_kwargs=True, always_call=True
            )
            probed[id(module)] = [pre, post]
            self._handles += [pre, post]
        _copies.hide(h.id for hs in probed.values() for h in hs)
        self._probing = probed

    def _end_probe(self) -> None:
        """A ``backward()`` after :meth:`_probe_parts`: the parts called from outside every
        watched call since then are hooked as roots from now on (at each attach too); the
        other parts' hooks go, all of them when the root ran instead. Until a call of either,
        the hooks stay: they run only when a part runs, and the first part to run is called
        from outside."""
        probed = self._probing
        if probed is None:
            return
        roots = {info.path for _, info in self._modules if info.is_root}
        outer = {c.path for c in self._trace.calls if c.parent is None and not c.is_loss}
        if not outer:
            return  # no part ran yet, nor the root
        alone = outer - roots  # (none when the root ran instead: no part is kept)
        self._probing = None
        self._called_alone |= alone
        gone: list[Any] = []
        for module, info in self._modules:
            hs = probed.get(id(module))
            if hs is not None and info.path not in alone:
                gone += hs
                info.pre_id = None
        for h in gone:
            h.remove()
        dropped = {id(h) for h in gone}
        self._handles = [h for h in self._handles if id(h) not in dropped]
        _copies.unhide(h.id for h in gone)

    def _record_loss(self, t: torch.Tensor) -> None:
        self._begun = True
        call = self._open_call(_LOSS_INFO)
        call.parent = None
        rec = self._new_record(
            Phase.FORWARD, LOSS_PATH, "output", t, call.id, module_type="functional"
        )
        rec.grad_fn = _grad_fn_name(t)
        rec.version = _version(t)
        self._measure(rec, t)
        call.end = self._idx
        # read after backward() returned (the accelerator path, the post-mortem), the frame
        # that ran it (a helper's, whose ``model`` argument is its own) is gone: kept now,
        # as a root call's site is (a few frames' lines, once a step)
        self._loss_at = (call, _site_at(sys._getframe(1)))
        self._known[id(t)] = (weakref.ref(t), rec.index, rec.version, False)
        scaled = self._scaled_out
        if scaled is not None and scaled() is t:
            self._scaled_loss = rec.index  # the loss times the scale: see _summarize
        if self._forensic:  # its backward ops are the loss code's, not the model's
            ops.stamp_graph([t], LOSS_PATH)
        if self._new_trigger is not None:
            self._handle_trigger(None, loss=t)

    # ------------------------------------------------------------------ parameters
    def _set_params(self) -> None:
        self._params = self._collect_params()
        self._param_ids = frozenset(id(p) for _, _, p in self._params)
        owner_types = {info.path: info.type_name for _, info in self._modules}
        self._param_types = [owner_types.get(path, "") for _, path, _ in self._params]
        self._param_sig = self._param_sig_of()

    def _refresh_params(self) -> None:
        """The parameters collected again when what they were collected from changed (a
        parametrization registered or removed, a lazy module materialized, a parameter
        replaced); one host-side look otherwise."""
        if self._param_sig_of() != self._param_sig:
            self._set_params()
            self._hook_params()

    def _param_sig_of(self) -> list[tuple[Any, ...]]:
        """The class of every watched module and the identity and class of its own
        parameters (host-side, no tensor read): it changes when a parametrization is
        registered or removed (the module's class changes, its weight leaves
        ``_parameters``), when a lazy module is materialized, or when a parameter is
        replaced, and the parameters are collected again then (see :meth:`_check_tree`)."""
        return [
            (type(m), *[(id(p), type(p)) for p in m._parameters.values()]) for m, _ in self._modules
        ]

    def _collect_params(self) -> list[tuple[str, str, nn.Parameter]]:
        """(qualified name, owner module path, parameter), each parameter once: the leaves
        the optimizer steps. Read from each module's ``_parameters``, never through its
        attributes: a parametrized ``weight`` (``spectral_norm``, ``orthogonal``) is a
        property that runs the parametrization (a power iteration that writes its ``_u``)
        and returns a non-leaf; its leaf ``parametrizations.weight.original`` is watched
        instead, under the owner's path. A lazy module's parameters are skipped until its
        first forward materializes them."""
        seen: set[int] = set()
        out: list[tuple[str, str, nn.Parameter]] = []
        lazy = False
        root_paths = {id(m): info.path for m, info in self._modules if info.is_root}
        for module, info in self._modules:
            base = "" if info.is_root else info.path
            if info.is_root and len(root_paths) > 1 and info.path != type(module).__name__:
                base = info.path
            own: list[tuple[str, Any]] = list(module._parameters.items())
            plist = module._modules.get("parametrizations")
            if plist is not None and parametrize.is_parametrized(module):
                own.extend(plist.named_parameters(prefix="parametrizations"))
            for local, p in own:
                if not isinstance(p, torch.Tensor) or id(p) in seen:
                    continue
                if _uninitialized(p):
                    lazy = True
                    continue
                seen.add(id(p))
                qual = f"{base}.{local}" if base else local
                out.append((qual, info.path, p))  # type: ignore[arg-type]
        self._lazy_left = lazy
        return out

    def _hook_params(self) -> None:
        """A post-accumulate-grad hook on each large CPU weight reads its gradient's L2 norm
        the moment backward has written it, while it is still in the cache: read after
        backward, a large model's gradients come back from memory (see
        :func:`nanwatch.stats.hot_l2_pays`). The end-of-backward check takes these norms
        when the gradient is still the tensor the hook read, at the same version; otherwise
        it reads the gradient itself. Not in forensic mode (its op checker would see the
        read), not in distributed runs (a collective rewrites the gradient after the
        hook), not on torch without the hook (before 2.1)."""
        if self._forensic:
            return
        hot = self._hot_norms
        for _, _, p in self._params:
            if (
                id(p) in self._param_hooks
                or not p.requires_grad
                or not hot_l2_pays(p.detach())
                or not hasattr(p, "register_post_accumulate_grad_hook")
            ):
                continue

            def on_accumulated(param: torch.Tensor, key: int = id(p)) -> None:
                g = param.grad
                if g is None or _tracing() or ops.replaying() or not hot_l2_pays(g):
                    return
                if torch.distributed.is_available() and torch.distributed.is_initialized():
                    return
                try:
                    with torch.no_grad():
                        hot[key] = (weakref.ref(g), g._version, l2(g))
                except Exception:  # the end-of-backward check reads it instead
                    hot.pop(key, None)

            try:
                register = p.register_post_accumulate_grad_hook
                self._param_hooks[id(p)] = register(on_accumulated)  # type: ignore[no-untyped-call]
            except RuntimeError:  # a weight that cannot take the hook: read after backward
                continue

    def _check_grads(self, given: dict[int, torch.Tensor] | None = None) -> None:
        """The L2 norm of every parameter gradient: multi-tensor kernels, one host read
        (large CPU gradients: read by :meth:`_hook_params`'s hooks while backward ran).
        ``given``: the gradients ``torch.autograd.grad`` returned, by the weight's id, read
        instead of ``.grad`` (see :meth:`_grads_returned`)."""
        grads: list[torch.Tensor] = []
        metas: list[tuple[str, str, str]] = []
        # the gradients read here, by identity and version: the optimizer pre-hook tells a
        # .grad written after backward (PCGrad, GradNorm) from these (no tensor read);
        # autograd.grad's are no backward's: a .grad set from them is your code's
        seen: dict[int, tuple[Any, int, int]] = {}
        if given is None:
            self._grads_checked = True
            self._grads_seen = seen
        ref = weakref.ref
        hot = self._hot_norms  # the hooks' dict: emptied below, never replaced
        # the norm each gradient's hook read, where it still holds (None: read it now)
        known: list[torch.Tensor | None] = []
        for (q, path, p), owner_type in zip(self._params, self._param_types, strict=True):
            g = p.grad if given is None else given.get(id(p))
            # a weight frozen with requires_grad_(False) keeps the .grad it had (zeros
            # after zero_grad(set_to_none=False)): no backward wrote it, it is no gradient
            if g is not None and p.requires_grad:
                grads.append(g)
                metas.append((q, path, owner_type))
                seen[id(p)] = (ref(g), g._version, _data_ptr(g))
                entry = hot.get(id(p))
                if entry is not None and entry[0]() is g and entry[1] == g._version:
                    known.append(entry[2])
                else:
                    known.append(None)
        if given is None:  # the hooks' norms are of a backward's .grad
            hot.clear()
        if not grads:
            return
        if self._scaled:  # the scale these gradients were multiplied by (no sync: a copy)
            scale = getattr(self.scaler, "_scale", None)
            if isinstance(scale, torch.Tensor):
                self._grad_scale = scale.detach().clone()
        cold = [g for g, k in zip(grads, known, strict=True) if k is None]
        if all(g.layout is torch.strided for g in cold):
            cold_norms = iter(foreach_l2(cold))
        else:
            dense_norms = iter(foreach_l2([g for g in cold if g.layout is torch.strided]))
            cold_norms = iter(
                [
                    next(dense_norms)
                    if g.layout is torch.strided
                    else (g.coalesce() if g.is_sparse else g).values().float().norm()
                    for g in cold
                ]
            )
        norms = [k if k is not None else next(cold_norms) for k in known]
        records = self._trace.records
        idx, step = self._idx, self._step
        recs = []
        for g, (q, path, owner_type) in zip(grads, metas, strict=True):
            rec = Record(
                idx, step, Phase.GRADIENT, path, q, dtype_name(g.dtype),
                device_name(g.device), tuple(g.shape), None, -1, None, owner_type,
            )  # fmt: skip
            idx += 1
            recs.append(rec)
        self._idx = idx
        records.extend(recs)
        if not self._defer_cpu and all(g.device.type == "cpu" for g in grads):
            values = read_scalars(norms)  # float32 norms (float64 for float64)
            self._fill_grad_stats(recs, grads, values)
        else:
            for rec, n in zip(recs, norms, strict=True):  # rec.stat: None until read
                self._pending_grads.append((rec, n, n))
            # each gradient as checked: a norm read as non-finite looks at the gradient
            # itself if it is unchanged by then (squares past the dtype's max, not a NaN or
            # inf in it, as on the CPU); weak references, no tensor read now
            self._grads_at_check = {
                id(rec): (ref(g), g._version) for rec, g in zip(recs, grads, strict=True)
            }
            # and held until their norms are read: one read only at the step end (the GPU
            # still behind when the optimizer began) finds them after zero_grad() dropped
            # them; nothing is kept past that read, which a step boundary makes before the
            # next forward allocates
            self._grads_kept = grads

    def _grad_as_checked(self, rec: Record) -> torch.Tensor | None:
        """The gradient the deferred record ``rec`` measured (see :meth:`_check_grads`),
        if it is alive and unwritten since; None otherwise (its norm is all that is known)."""
        entry = getattr(self, "_grads_at_check", {}).get(id(rec))
        if entry is None:
            return None
        g = entry[0]()
        return g if g is not None and g._version == entry[1] else None

    def _fill_grad_stats(
        self, recs: list[Record], grads: Sequence[torch.Tensor | None], values: list[float]
    ) -> None:
        total = 0.0
        for rec, g, value in zip(recs, grads, values, strict=True):
            n = value
            numel = g.numel() if g is not None else rec_numel(rec)
            # positional: min, max, numel, nan, posinf, neginf, zeros, near_max,
            # finite_amax, bad_rows, bad_row_count, norm
            rec.stat = TensorStat(-n, n, numel, None, None, None, None, None, None, None, None, n)
            if n - n != 0:  # inf or NaN (or a norm that overflowed: the counts tell)
                if g is not None:
                    detail = describe(g)
                    if detail is not None:
                        if detail.finite:  # squares past the dtype's max: sum them in float64
                            n = _norm64(g)
                        detail.norm = n
                        rec.stat = detail
                if not rec.stat.finite:
                    self._note_bad(rec)
            total += n * n
        self._trace.grad_norm = math.sqrt(total) if math.isfinite(total) else total

    def _param_maxima(self) -> list[torch.Tensor]:
        """max |w| of every watched parameter, left on the devices (no sync). A small model
        on the CPU gets one max over all its weights instead (one kernel, not one a weight:
        only a non-finite weight is recorded, and then :meth:`_check_params` looks at each),
        followed by the value of each weight with -inf constraints (fewer values than
        weights: :meth:`_check_params` tells the two apart by that)."""
        params = [p.detach() for _, _, p in self._params]
        known = self._neginf_at_start
        counts = [known.get(id(p)) for _, _, p in self._params] if known else []
        plain = [p for p, n in zip(params, counts, strict=True) if n is None] if known else params
        if (
            len(plain) > 1
            and not self._forensic
            and all(p.device.type == "cpu" for p in params)
            and sum(p.numel() for p in params) <= _FLAT_WEIGHTS
        ):
            flat = torch.cat([p.reshape(-1) for p in plain]).abs().max()  # NaN propagates
            pairs = zip(params, counts, strict=False)  # counts is [] with no constraint
            cons = [_constrained_max(p, n) for p, n in pairs if n is not None]
            return [flat, *cons]
        return self._weight_maxima(params)

    def _weight_maxima(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """max |w| of each of ``params`` (the watched weights, detached, in order), on the
        devices; a weight with -inf constraints gets :func:`_constrained_max` instead.
        Outside forensic mode (which records every weight's max) only finiteness is asked
        of these values: a large CPU weight gets a cheaper probe, finite when it is
        (:func:`nanwatch.stats.foreach_finite_probe`), and :meth:`_check_each_param` looks
        closer at a weight whose probe is not."""
        maxima = foreach_absmax if self._forensic else foreach_finite_probe
        known = self._neginf_at_start
        counts = [known.get(id(p)) for _, _, p in self._params] if known else []
        if not any(n is not None for n in counts):
            return maxima(params)  # the common path: no weight carries -inf
        pairs = list(zip(params, counts, strict=True))
        plain = iter(maxima([p for p, n in pairs if n is None]))
        return [next(plain) if n is None else _constrained_max(p, n) for p, n in pairs]

    def _constraint_at_first_sight(self, param: nn.Parameter) -> TensorStat | None:
        """The weight ``param`` (non-finite): its statistics; None when this is the first
        time a weight check reads it and it holds -inf and no NaN or +inf: those -inf are
        constraints it was loaded or initialized with (a CRF's forbidden transitions),
        remembered and not an anomaly. A weight that was finite when first read has none:
        a -inf in it later is an anomaly, and so is a -inf more than it came with."""
        stat = describe(param.detach())
        if (
            id(param) not in self._weighed
            and param.dtype in _NEGINF_DTYPES
            and stat is not None
            and stat.only_neginf
            and stat.neginf
        ):
            self._neginf_at_start[id(param)] = stat.neginf
            return None
        return stat

    def _check_params(
        self, *, at_end: bool, all_records: bool = False, values: list[float] | None = None
    ) -> None:
        """Weights: max |w| of every parameter with multi-tensor kernels, one host read.

        On a trigger (``at_end=False``) the bad parameters are recorded ahead of the step's
        records: they were bad before its forward ran. At a step boundary (``at_end=True``)
        they are recorded after everything else: the step's own update broke them. Only bad
        parameters are recorded, except with ``all_records`` (forensic). ``values``: the
        maxima of :meth:`_param_maxima`, already read."""
        if not self._params:
            return
        params = [p.detach() for _, _, p in self._params]
        if values is not None and len(values) < len(params):  # one max over them all
            if all(math.isfinite(v) for v in values) and not all_records:
                self._mark_weighed()
                return
            values = None
        if values is None or len(values) != len(params):
            values = read_scalars(self._weight_maxima(params))
            if self._checking_attach:
                self._keep_attach_scales(params, values)
        try:
            self._check_each_param(params, values, at_end=at_end, all_records=all_records)
        finally:
            self._mark_weighed()

    def _keep_attach_scales(self, params: list[torch.Tensor], values: list[float]) -> None:
        """Keep the finite weights' sizes the attach check just read (``values``, of
        :meth:`_weight_maxima`: max |w|, or the L2 norm of a large CPU weight), by name."""
        neginf = self._neginf_at_start
        self._attach_scales = {
            q: (v, "max" if self._forensic or not hot_l2_pays(p) else "norm", p.numel())
            for (q, _, param), p, v in zip(self._params, params, values, strict=True)
            if math.isfinite(v) and id(param) not in neginf
        }

    def _mark_weighed(self) -> None:
        """The watched weights were read: a -inf found in them from here on is no
        constraint. Once for each list of weights (``_params`` is replaced, never changed)."""
        if self._weighed_for is not self._params:
            self._weighed.update(id(p) for _, _, p in self._params)
            self._weighed_for = self._params

    def _check_each_param(
        self, params: list[torch.Tensor], values: list[float], *, at_end: bool, all_records: bool
    ) -> None:
        """:meth:`_check_params` on the maxima ``values`` of the detached weights ``params``."""
        front: list[Record] = []
        seen: set[str] | None = None
        bad_state: dict[str, list[list[str]]] = {}
        for (q, path, param), p, owner_type, probe in zip(
            self._params, params, self._param_types, values, strict=True
        ):
            a = probe
            if a - a != 0 and not all_records and hot_l2_pays(p):
                # a probe's L2 norm (see _weight_maxima): finite values past the
                # square root of the dtype's max overflow it too; the max says which
                a = foreach_absmax([p])[0].item()
            if not (all_records or a - a != 0):  # keep only inf/NaN, unless asked for all
                continue
            if seen is None:
                seen = {r.role for r in self._trace.records if r.phase is Phase.PARAMETER}
            if q in seen:  # already recorded this step (bad before its forward)
                continue
            stat = TensorStat(-a, a, p.numel())
            if a - a != 0:
                first = self._constraint_at_first_sight(param)
                if first is None and id(param) in self._neginf_at_start:
                    continue  # -inf constraints it came with: not an anomaly
                stat = first or stat
            if at_end:
                rec = self._new_record(Phase.PARAMETER, path, q, p, -1, module_type=owner_type)
            else:
                rec = Record(
                    -1 - len(front), self._step, Phase.PARAMETER, path, q, dtype_name(p.dtype),
                    device_name(p.device), tuple(p.shape), None, -1, None, owner_type,
                )  # fmt: skip
                front.append(rec)
            rec.stat = stat
            if not stat.finite and len(self._trace.notes) < 256:
                # the weight's version when its values were taken (before the update, see
                # _check_before_update), else now
                version = param._version
                if self._versions is not None:
                    version = self._versions.get(id(param), version)
                # which optimizer step, if any, last wrote it (NW301: an EMA copy, a loaded
                # checkpoint, a pruning mask are written by no optimizer)
                # on a trigger, an update earlier in this step (an evaluation forward after
                # optimizer.step(); a closure's evaluation inside it, LBFGS) wrote it last;
                # else the last step's
                stepped = self._stepped.get(id(param))
                if stepped is None and not at_end:
                    stepped = self._stepped_prev.get(id(param))
                after = stepped is not None and stepped[2] not in (-1, version)
                if stepped is not None and stepped[2] != -1 and not after:
                    # a .data assignment after the update: a new tensor, the same version
                    ptr = self._stepped_ptr.get(id(param))
                    after = ptr is not None and ptr != _data_ptr(param)
                replaced = bool(after and stepped and stepped[2] == version)
                # a forward of this step ran with it finite after that update: written
                # since, in place and unseen by autograd (p.data.add_, a copy_ under no_grad)
                read_by = self._read_since_update(param, path) if stepped and not after else None
                after = after or read_by is not None
                at_attach = self._attach_versions.get(id(param))
                state_finite = None  # not read
                if stepped is not None and read_by is None:
                    state_finite = self._read_optimizer_state(q, param, bad_state)
                # forensic: the op that wrote it outside the update, and its line
                written = (
                    self._weight_writer_op(param, q, after=after)
                    if stepped is None or after
                    else None
                )
                by_op: dict[str, Any] = {}
                nan_only = stat.has_nan and not (stat.has_posinf or stat.has_neginf)
                if written is None and (stepped is None or after) and nan_only:
                    # NaN filling whole rows, the others finite: a per-row 0 / 0 in the write
                    # (w / w.norm(dim=1) of an all-zero row); read now, at anomaly time
                    try:
                        whole = whole_bad_rows(param)
                    except Exception:  # an unusual tensor must not cost the note
                        whole = None
                    if whole is not None:
                        by_op = {"nan_rows": list(whole[0]), "nan_row_count": whole[1]}
                if written is not None:
                    by_op = {
                        "op": written.op,
                        "op_born": written.born,
                        "op_source": written.source,
                        "op_code": written.code,
                        "op_scalars": dict(written.scalars),
                    }
                self.note(
                    "weight_writer",
                    path,
                    parameter=q,
                    **by_op,
                    # the update left another tensor in it (p.data = ... after the step)
                    replaced=replaced,
                    # the module whose forward ran with it finite after the update
                    read_finite_by=read_by,
                    optimizer=stepped[0] if stepped and not after else None,
                    group=stepped[1] if stepped and not after else None,
                    after_optimizer=stepped[0] if after and stepped else None,
                    # its optimizer state, read now: every tensor finite (True), one not
                    # (False: the "optimizer_state" note says which), or not read (None)
                    state_finite=state_finite,
                    # the update that last wrote it makes no NaN from the finite numbers it
                    # read (SGD; Adam and its kin with eps > 0 and a finite state)
                    update_nan_free=self._update_nan_free(param, q, stepped, state_finite)
                    if stepped and not after
                    else False,
                    # written since the attach check found it finite, by no optimizer
                    since_attach=(
                        stepped is None and at_attach is not None and at_attach != version
                    ),
                    # what the attach check read (a .data write bumps no version)
                    finite_at_attach=(
                        False if self._checking_attach else self._attach_finite.get(id(param))
                    ),
                    # the earliest step of an unbroken run of steps that read it non-finite
                    bad_since=self._bad_since(q),
                )
            if at_end and not stat.finite:
                self._note_bad(rec)
        for opt_name, pairs in bad_state.items():
            if len(self._trace.notes) < 256:
                self.note("optimizer_state", opt_name, optimizer_state_bad=pairs)
        if front:  # before the step's first record, in the order the model holds them
            for i, r in enumerate(front):
                r.index = -len(front) + i
            self._trace.records[:0] = front

    def _read_since_update(self, param: nn.Parameter, path: str) -> str | None:
        """The path of a module (``path``, the weight's owner, or a module holding it) whose
        call in this step began after the optimizer step that last updated ``param`` and
        ended with every output it recorded finite: that forward ran with the weight
        finite, so no optimizer wrote its NaN/inf. None when no such call is known, or when
        the records show that update itself left the weight non-finite (see
        :meth:`_update_left_bad`): a finite output proves a weight finite only where every
        value of it reaches that output, and ``torch.where(z > 0, torch.log(z), 0)``,
        ``masked_fill`` or an index drops a NaN of it. Anomaly-time work only."""
        ref = self._stepped_by.get(id(param))
        optimizer = ref() if ref is not None else None
        at = self._opt_calls.get(id(optimizer)) if optimizer is not None else None
        if at is None or at[0] > self._step:
            return None
        trace = self._trace
        calls = trace.calls[at[1] :] if at[0] == self._step else trace.calls
        roots: dict[str, nn.Module] = {
            info.path: m for m, info in self._modules if info.is_root and not info.is_loss
        }
        for c in calls:
            if c.end == -1 or c.is_loss or c.path == LOSS_PATH:
                continue
            if not (
                c.path == path
                or path.startswith(c.path + ".")
                or (c.root and c.path in roots and _holds(roots[c.path], param))
            ):
                continue
            outs = [
                r
                for r in trace.records
                if c.start <= r.index < c.end and r.phase is Phase.FORWARD and r.call == c.id
            ]
            if outs and all(r.stat is not None and r.stat.finite for r in outs):
                return None if self._update_left_bad(param, optimizer, at) else c.path
        return None

    def _bad_since(self, qualname: str) -> int | None:
        """The earliest step of the history from which every step up to the last one read
        weight ``qualname`` non-finite (its weight check, at the step's end or before its
        forward): the weight stayed so since, and no later update made it. None when the
        last step did not read it so. Host-side records only; anomaly-time work."""
        since = None
        for t in reversed(self.history):
            if qualname not in self._bad_weights_of(t):
                break
            since = t.step
        return since

    def _bad_weights_of(self, trace: StepTrace) -> frozenset[str]:
        """The weights a step of the history read non-finite, read from its records once:
        a model whose weights all went NaN asks this of every weight, every step, over the
        whole history (weights x steps x records: most of a broken run's step before)."""
        cache = self._bad_weights_cache
        kept = cache.get(id(trace))
        if kept is not None and kept[0] is trace:
            return kept[1]
        bad = frozenset(
            r.role
            for r in trace.records
            if r.phase is Phase.PARAMETER and r.stat is not None and not r.stat.finite
        )
        if len(cache) > 2 * (self.history.maxlen or 32):  # drop the steps the ring let go
            live = {id(t) for t in self.history}
            for key in [k for k in cache if k not in live]:
                del cache[key]
        cache[id(trace)] = (trace, bad)
        return bad

    def _update_left_bad(self, param: nn.Parameter, optimizer: Any, at: tuple[int, int]) -> bool:
        """The records of step ``at[0]``, whose update by ``optimizer`` (after its first
        ``at[1]`` calls) last wrote weight ``param``, show that update left it non-finite:
        the gradient it applied was NaN/inf (a NaN gradient applied is a NaN weight), the
        learning rate of its group was, or the weight check at that step's end found the
        weight so. The gradient applied is the one checked before the update, unless your
        code replaced it (a ``"grad_written"`` note says what that one held) or reset it
        (``grads_dropped``: a skipped update). Host-side records only; anomaly-time work."""
        qualname = next((q for q, _, p in self._params if p is param), None)
        if qualname is None:
            return False
        step, ncalls = at
        trace = (
            self._trace
            if step == self._step
            else next((t for t in reversed(self.history) if t.step == step), None)
        )
        if trace is None:
            return False
        stepped = self._stepped.get(id(param)) or self._stepped_prev.get(id(param))
        group = stepped[1] if stepped is not None else -1
        applied: bool | None = None  # the applied gradient was NaN/inf; None: as checked
        for n in trace.notes:
            how = n.data.get("how")
            if n.kind == "grad_written" and isinstance(how, dict) and qualname in how:
                bad = n.data.get("nonfinite")
                # replaced after the check: NaN/inf only if read so (None: not read)
                applied = isinstance(bad, list) and qualname in bad
            if n.kind != "optimizer" or n.data.get("ident") != id(optimizer):
                continue
            if n.data.get("grads_dropped"):
                applied = False  # every gradient it would apply was reset: none applied
            for g in n.data.get("groups", ()):
                lr = g.get("lr") if isinstance(g, dict) and g.get("group") == group else None
                if isinstance(lr, float) and not math.isfinite(lr):
                    return True  # an update by a NaN/inf learning rate
        # the records made before the update: those ahead of the first call after it
        later = trace.calls[ncalls:]
        limit = min(c.start for c in later) if later else None
        for r in trace.records:
            if r.role != qualname or r.stat is None or r.stat.finite:
                continue
            before = limit is None or r.index < limit
            if r.phase is Phase.GRADIENT and applied is None and before:
                return True  # the gradient the update applied
            if r.phase is Phase.PARAMETER and trace is not self._trace and r.index >= 0:
                return True  # found so at the end of the update's step, before this one
        return bool(applied)

    def _weight_writer_op(
        self, param: nn.Parameter, qualname: str, *, after: bool
    ) -> OpEvent | None:
        """Forensic: the op that made the NaN/inf of weight ``param`` (found non-finite,
        written by no optimizer, or ``after`` one): the op the checker saw write it in place
        (``w.div_(w.norm(...))`` under no_grad), else, for a write after the update, the
        first op since the update that made a non-finite tensor of the weight's size on a
        line that names the weight (``w.data = w.data / w.data.norm(...)`` replaces its
        tensor: the op made the new one). None when the checker recorded neither."""
        chk = self._checker
        if chk is None:
            return None
        made = chk.maker(param)
        if made is not None and made.phase is Phase.FORWARD and not made.injected:
            return made
        if not after or self._ops_mark is None:
            return None
        leaf = re.compile(rf"\b{re.escape(qualname.rsplit('.', 1)[-1])}\b")
        for ev in chk.events[self._ops_mark :]:
            if (
                ev.phase is Phase.FORWARD
                and not ev.injected
                and ev.output.numel == param.numel()
                and ev.code
                and leaf.search(ev.code)
            ):
                return ev
        return None

    def _update_nan_free(
        self,
        param: nn.Parameter,
        qualname: str,
        stepped: tuple[str, int, int],
        state_finite: bool | None,
    ) -> bool:
        """The optimizer update that last wrote ``param`` (``stepped``: class name, group,
        version after) cannot have made a NaN: torch's own optimizer whose update makes
        none from finite numbers (:func:`nanwatch._updates.nan_free_update`, on its group's
        settings now), its state read finite, and no gradient of it recorded non-finite in
        this step or the last, one of them read finite, and none your code wrote after
        backward unread or non-finite (a ``"grad_written"`` note). Anomaly-time only."""
        ref = self._stepped_by.get(id(param))
        optimizer = ref() if ref is not None else None
        groups = getattr(optimizer, "param_groups", None)
        if optimizer is None or not isinstance(groups, list) or stepped[1] >= len(groups):
            return False
        read_finite = False  # its gradient was read, and finite
        for t in (self._trace, *list(self.history)[-1:]):
            for r in t.records:
                if r.phase is Phase.GRADIENT and r.role == qualname and r.stat is not None:
                    if r.bad:
                        return False
                    read_finite = True
            for n in t.notes:  # your code replaced it after that read: what did it hold?
                how, bad = n.data.get("how"), n.data.get("nonfinite")
                if (
                    n.kind == "grad_written"
                    and isinstance(how, dict)
                    and qualname in how
                    and (not isinstance(bad, list) or qualname in bad)
                ):
                    return False
        if not read_finite:
            return False
        cls = type(optimizer)
        own = cls.__module__.startswith("torch.optim")
        group = groups[stepped[1]]
        if not isinstance(group, dict):
            return False
        return nan_free_update(cls.__name__, group, state_finite, own=own) is not None

    def _read_optimizer_state(
        self, qualname: str, param: nn.Parameter, out: dict[str, list[list[str]]]
    ) -> bool | None:
        """The non-finite tensors of the optimizer state of ``param`` (a weight found
        non-finite), as ``[qualname, key]`` pairs under the optimizer's class name in
        ``out``: a NaN in ``exp_avg_sq`` (a resumed checkpoint) makes every update NaN.
        Returns whether every tensor of that state is finite; None when it was not found."""
        ref = self._stepped_by.get(id(param))
        optimizer = ref() if ref is not None else None
        state = getattr(optimizer, "state", None)
        if optimizer is None or state is None or not hasattr(state, "get"):
            return None
        entry = state.get(param)
        if not isinstance(entry, dict):
            return None
        finite = True
        for key, value in entry.items():
            if (
                isinstance(value, torch.Tensor)
                and (value.is_floating_point() or value.is_complex())
                and not value.is_meta
                and not _finite(value.detach())
            ):
                out.setdefault(type(optimizer).__name__, []).append([qualname, str(key)])
                finite = False
        return finite

    # ------------------------------------------------------------------ steps
    def _maybe_begin_step(self, *, trained_only: bool = False) -> None:
        """Called when the first root is called from outside any watched call: begins a
        new step after a backward and an update (or on every call when gradients are
        disabled, except after the step's first grad-enabled call and before any gradient),
        unless steps are explicit. Once an optimizer has stepped in the run, a backward that
        no update followed does not end the step (see :meth:`_discarded`)."""
        if self._stack:
            return  # the root calling itself, or called from inside another watched module
        if self._opt_running:
            if self._opt_forwarded:
                return  # a closure's second evaluation (LBFGS): the same optimizer step
            self._opt_forwarded = True
        if self._begun and not self._explicit:
            if self._backward_called or self._trained_by_grad():
                # after an update only, with gradients on or off: a teacher called under
                # no_grad between the micro-batches of gradient accumulation is the same step.
                # An optimizer that stepped in this step ends it whatever backward ran after
                # (a GAN's generator watched first: the discriminator's backward on real
                # data, before the generator's call, is no accumulation): one step per update
                # cycle, never one that grows for the whole run
                if self._updated or (not self._accumulating() and not self._discarded()):
                    self._cycle_boundary()
            elif (
                not trained_only
                and self._evaluating()
                and not (self._grad_call and not self._backward_seen)
            ):
                # (a no_grad call after the step's first grad-enabled one, before any
                # gradient: the targets of a consistency loss, VAT's, is the same step)
                self._evaluation_boundary()
        self._begun = True
        if self._trainer_probe is not None:
            self._note_position()

    def _note_position(self) -> None:
        """The epoch and batch a running Trainer is at as the step's first call begins
        (``nanwatch run``): read now, since a late read names the step after its batch ended."""
        step = self._trace.step
        if step in self._positions or self._trainer_probe is None:
            return
        try:
            found = self._trainer_probe.position(sys._getframe(2))
        except Exception as exc:
            self._trainer_probe = None
            self._fault("trainer", "trainer position", exc)
            return
        if found is not None:
            self._positions[step] = found
            if len(self._positions) > self.config.ring_size:
                del self._positions[min(self._positions)]

    def _evaluation_boundary(self) -> None:
        """A call under no_grad after a step that did not train: the step ends (each call of
        an evaluation loop is a step). When the step held only no_grad calls and nothing bad,
        the boundary is remembered as foldable: a grad-enabled call next shows the no_grad
        calls were a training step's teacher (see :meth:`_fold`)."""
        trace = self._trace
        foldable = self._foldable
        keep = not self._grad_call and trace.anomaly is None and self._new_trigger is None
        prev = self._stepped_prev
        done = self._boundary()
        if keep and done.anomaly is None and done.error is None:
            if not foldable:
                self._fold_from = (done.step, prev)
            foldable.append((done, self._end_of(done), prev))
            if len(foldable) > self.config.ring_size:
                del foldable[0]  # gone from history: an evaluation's length holds no memory
            self._foldable = foldable

    @staticmethod
    def _evaluating() -> bool:
        """Gradients are off, and not for a reentrant checkpoint's first pass (whose
        segments are called one by one under ``no_grad``): each such call is a step."""
        return not torch.is_grad_enabled() and not _frames.in_checkpoint(sys._getframe(2))

    def _trained_by_grad(self) -> bool:
        """Gradients came from ``torch.autograd.grad`` alone and the weights were updated
        since (an optimizer step, or a hand-written ``p -= lr * g``): a training step done
        without ``backward()``. A gradient penalty or an input saliency updates nothing
        before the loss that trains, and stays in its step."""
        if not self._backward_seen:
            return False
        if self._updated:
            return True
        taken = self._weight_grads_taken
        if taken is not None and not self._ever_backward_called:
            # the run trains by autograd.grad alone, and took the weights' gradients (not
            # to differentiate them again): its update may write .data, which no version
            # shows (``p.data -= lr * g``), so the next forward with the weights in place
            # begins the next step (a MAML inner loop's functional_call swaps them out)
            module, name, p = taken
            if module._parameters.get(name) is p:
                return True
        before = self._weights_at_grad
        return before is not None and before != tuple(p._version for _, _, p in self._params)

    def _update_marks(self) -> tuple[int, ...]:
        """What an optimizer update or a ``zero_grad`` changes: each watched weight's
        version, and its gradient's identity and version; then the versions of the
        GradScaler's scale and growth tracker, which ``scaler.update()`` changes in place
        even when it skipped the optimizer step (no weight, no optimizer hook and, with
        ``zero_grad`` called before ``backward``, no gradient shows that update). Nothing
        reads a tensor."""
        out: list[int] = []
        for _, _, p in self._params:
            g = p.grad
            out += (p._version, -1, -1) if g is None else (p._version, id(g), g._version)
        scaler = self.scaler
        for name in ("_scale", "_growth_tracker"):
            t = getattr(scaler, name, None)
            out.append(t._version if isinstance(t, torch.Tensor) else -1)
        return tuple(out)

    def _accumulating(self) -> bool:
        """Since the last backward ended, no weight was updated and no gradient reset: the
        loop accumulates gradients over micro-batches, and this forward is the same step
        (without it, an accumulating loop that never calls ``nw.step()``, or its first
        step before the first call, counted each micro-batch as a step)."""
        marks = self._after_backward
        return marks is not None and marks == self._update_marks()

    def _discarded(self) -> bool:
        """Once an optimizer has updated the watched weights in this run, a ``backward()``
        that no update followed (no optimizer step, weight write or GradScaler update; its
        gradients reset or read: an attack's ``loss.backward(); g = delta.grad;
        model.zero_grad()``) does not end the step: the training step ends with its
        update."""
        if not (self._ever_updated and self._backward_called) or self._updated:
            return False
        marks = self._marks_at_backward
        if marks is None:
            return False
        now = self._update_marks()
        n = 3 * len(self._params)
        return len(now) == len(marks) and marks[0:n:3] == now[0:n:3] and marks[n:] == now[n:]

    def _cycle_marks(self) -> tuple[dict[int, int], tuple[int, ...]]:
        """Each watched weight's version by its id, and the GradScaler's marks."""
        marks = self._update_marks()
        n = 3 * len(self._params)
        return {id(p): p._version for _, _, p in self._params}, marks[n:]

    def _cycle_changes(self) -> frozenset[int]:
        """What the step now ending updated: the ids of the weights written or stepped by
        an optimizer, and -1 for a GradScaler update (see :meth:`_cycle_fold`)."""
        versions, scaler = now = self._cycle_marks()
        base = self._cycle_base
        stepped = self._stepped
        changed = {
            key
            for key, v in versions.items()
            if key in stepped or (base is not None and base[0].get(key, v) != v)
        }
        if base is not None and base[1] != scaler:
            changed.add(-1)
        self._cycle_base = now
        return frozenset(changed)

    def _cycle_fold(self, *, first_explicit: bool = False) -> frozenset[int] | None:
        """The steps the automatic rule made before the first update cycle ended belong to
        one training step: an attack's ``backward()`` calls before the first optimizer step
        (each was a step then). Called as a step ends: the steps recorded in ``_cycle`` (the
        last ones of ``history``) that updated nothing are folded into it when it updated
        something, while no weight was updated twice (the first cycle). At the first
        ``nw.step()``, all of them are folded, however many updates they hold (a
        discriminator's updates before the generator's, SAM's perturbed weights, a WGAN's
        critic updates), and also when no watched weight was updated (LBFGS's closure
        evaluations of an image optimized through a frozen model, a FedAvg server's clients
        trained on copies): from then on steps are the user's, and everything since attach
        is the user's first step. Returns what the step updated, or None once nothing is
        followed any more (an anomaly, a log as long as the ring: see
        :meth:`_cycle_boundary`)."""
        log = self._cycle
        if log is None:
            return None
        changed = self._cycle_changes()
        if self._cycle_open and changed & frozenset().union(*(e[3] for e in log)):
            self._cycle_open = False  # updated twice: the first cycle is over
        if not (first_explicit or self._cycle_open):
            return changed  # kept for the first nw.step(), if it comes
        if not (first_explicit or (changed and self._updated)):
            return changed  # the steps fold into the cycle of an optimizer's update
        cur = self._trace
        if (
            cur.anomaly is not None
            or cur.error is not None
            or self._new_trigger is not None
            or self._pending_data is not None
        ):
            return changed
        while log:
            prev, end, stepped_prev, updated = log[-1]
            if (
                (updated and not first_explicit)
                or not self.history
                or self.history[-1] is not prev
                or prev.step != self._trace.step - 1
            ):
                break
            log.pop()
            grad_norm, scale = cur.grad_norm, cur.scale
            self._merge_into(prev, end, stepped_prev, full=prev.full or self._full)
            prev.loss = prev.max_logit = None  # the step's figures: its last backward's
            prev.grad_norm, prev.scale = grad_norm, scale
            changed |= updated
            cur = prev
        return changed

    def _cycle_boundary(self) -> None:
        """End the step by the automatic rule after a backward (see :meth:`_cycle_fold`).
        The op checker's events recorded since the step's last optimizer update ran before
        the call that begins the next step (its data, its rewards): they are that step's."""
        changed = self._cycle_fold()
        stepped_prev = self._stepped_prev
        chk, mark = self._checker, self._ops_mark
        carried: list[OpEvent] = []
        if chk is not None and mark is not None and mark < len(chk.events):
            carried = chk.events[mark:]
            del chk.events[mark:]
        try:
            done = self._boundary()
        finally:
            if chk is not None and carried:
                chk.events[:0] = carried  # before those the next step records
        self._trained = True
        log = self._cycle
        if log is None:
            return
        if changed is None or done.anomaly is not None or done.error is not None:
            self._cycle = None
        elif len(log) + 2 >= self.config.ring_size:
            self._cycle = None  # no update for this long: not one training step
        else:
            log.append((done, self._end_of(done), stepped_prev, changed))

    @staticmethod
    def _end_of(done: StepTrace) -> int:
        """One past the last index a finished step used."""
        return max(
            [r.index + 1 for r in done.records] + [max(c.start, c.end) for c in done.calls],
            default=0,
        )

    def _fold(self, path: str) -> None:
        """The first grad-enabled call of a step begun by an evaluation boundary: the steps
        before it that held only no_grad calls (a teacher, a key encoder, a target network
        run first under ``torch.no_grad()``) are the same training step; they are folded
        into the current one, which takes the first one's number. A step that called the
        module called now is an evaluation of it: before any training (an evaluation loop of
        the model before training) it stays a step; between training steps (a validation)
        its steps, checked and found clean, leave ``history`` and the current step takes the
        first one's number, so the training steps are numbered as if it had not run (with a
        memory of one evaluation call, however long it is)."""
        foldable = self._foldable
        cur = self._trace
        if (
            self._trained
            and foldable
            and self.history
            and self.history[-1] is foldable[-1][0]
            and foldable[-1][0].step == cur.step - 1
            and cur.anomaly is None
            and cur.error is None
            and self._new_trigger is None
            and self._pending_data is None
            and not (self._backward_called or self._backward_seen or self._updated)
            and all(any(c.root and c.path == path for c in e[0].calls) for e in foldable)
        ):
            dropped = {id(e[0]) for e in foldable}
            while self.history and id(self.history[-1]) in dropped:
                self.history.pop()
            self._foldable = []
            number, self._stepped_prev = self._fold_from
            self._step = cur.step = number
            for r in cur.records:
                r.step = number
            return
        self._fold_back(
            lambda prev: (
                not (
                    self._backward_called
                    or self._backward_seen
                    or self._updated
                    or any(c.root and c.path == path for c in prev.calls)
                )
            )
        )

    def _fold_back(self, also: Callable[[StepTrace], bool]) -> None:
        """Merge the current step into the foldable steps before it (``_foldable``, the
        latest first), while each is the one just before it in ``history``, neither holds
        an anomaly or an error, nothing is pending, and ``also(prev)`` holds."""
        foldable = self._foldable
        while foldable:
            prev, end, stepped_prev = foldable[-1]
            cur = self._trace
            if (
                not self.history
                or self.history[-1] is not prev
                or prev.step != cur.step - 1
                or prev.anomaly is not None
                or prev.error is not None
                or cur.anomaly is not None
                or cur.error is not None
                or self._new_trigger is not None
                or self._pending_data is not None
                or not also(prev)
            ):
                break
            foldable.pop()
            self._merge_into(prev, end, stepped_prev, full=prev.full)

    def _fold_evaluations(self) -> None:
        """At the first ``nw.step()``: the steps the automatic rule began after a training
        update with no_grad calls (generation or a validation run inside the loop, before
        the loop's ``nw.step()``; each call was a step then) are that training step's, and
        are folded back into it (:meth:`_cycle_fold` then folds it with the update), so the
        user's steps are numbered from 0 as the loop counts them. Steps that held an
        anomaly stay."""
        if self._trained:
            self._fold_back(lambda prev: True)

    def _merge_into(
        self,
        prev: StepTrace,
        end: int,
        stepped_prev: dict[int, tuple[str, int, int]],
        *,
        full: bool,
    ) -> None:
        """Fold the current step into ``prev``, the last step of ``history``, whose records
        and calls used the indices below ``end``; ``stepped_prev`` is what ``prev`` was
        begun with. The merged step takes ``prev``'s number and goes on recording."""
        cur = self._trace
        self.history.pop()
        ncalls = len(prev.calls)
        for r in cur.records:
            r.index += end
            r.step = prev.step
            if r.call >= 0:
                r.call += ncalls
            if r.source is not None:
                r.source += end
        for c in cur.calls:
            c.id += ncalls
            if c.parent is not None:
                c.parent += ncalls
            c.start += end
            if c.end >= 0:
                c.end += end
        for n in cur.notes:
            for key in ("input_source", "input_widened_from"):
                src = n.data.get(key)
                if isinstance(src, int) and not isinstance(src, bool):
                    n.data[key] = src + end
        prev.records += cur.records
        prev.calls += cur.calls
        prev.ops += cur.ops
        prev.notes += cur.notes
        prev.mutations += cur.mutations
        prev.recomputed += cur.recomputed
        prev.diagnoses = []  # evaluated again, on the whole step, at its end
        prev.full = full
        self._known = {k: (v[0], v[1] + end, *v[2:]) for k, v in self._known.items()}
        self._minmax = {i + end: v for i, v in self._minmax.items()}
        self._idx += end
        self._step = prev.step
        self._stepped = {**self._stepped_prev, **self._stepped}
        self._stepped_prev = stepped_prev
        self._full = full
        self._trace = prev
        if self._first_bad is prev:
            self._first_bad = None

    def _boundary(self, *, final: bool = False) -> StepTrace:
        trace = self._trace
        self._foldable = []
        empty = not trace.records and not trace.calls
        if final and empty and self._user_loss is None:
            if not self._last_update_checked():
                return trace
            empty = False  # the weights the run's last update wrote are bad: said below
        if final and not self._explicit:
            self._cycle_fold()  # a run that ends with its first update cycle
        try:
            self._join_streams()
            self._flush(final=final)
        except NanwatchError:
            raise
        except Exception as exc:  # the step still ends; what was flushed is kept
            self._fault("flush", "step flush", exc)
        done = trace
        self.history.append(done)
        kept = self._first_bad
        if done.anomaly is not None and (kept is None or kept.anomaly is None):
            self._first_bad = done
        self._step += 1
        self._reset_step()
        self._act(done, kept=kept)
        return done

    def _last_update_checked(self) -> bool:
        """Sentinel (and a sampled-out watch step) reads no weight after an update: the next
        step's forward shows a bad one. The run's last update has no next step (at detach,
        when no step is open), and a step cut short by an exception before its loss shows
        nothing: there the weights are read once (one max per weight), and the bad ones
        recorded: True then, and that step is flushed like any other. A saved checkpoint of
        NaN weights must not end a run with an empty report, nor a crash it caused with a
        post-mortem that does not say so."""
        last = self.history[-1] if self.history else None
        if (
            # no step ended yet: a run of updates alone (per-sample gradients under vmap,
            # no watched forward, no nw.step()) whose gradients were not read before them
            # (accelerators read nothing before an update): its weights are read here
            (last is None and not (self._read_late() and self._ever_updated))
            or (last is not None and last.full)
            or self._weights_told()
            or not self._ever_updated
            or self._device_dead
            or _tracing()
            or not self._params
        ):
            return False
        try:
            with _NO_TORCH_FUNCTION(), torch.no_grad():
                values = read_scalars(self._param_maxima())
                if all(math.isfinite(v) for v in values):
                    return False
                # recorded as bad before a next step (as its forward would have found
                # them), written by the last step's update (``_stepped_prev``)
                self._check_params(at_end=False, values=values)
        except Exception as exc:  # a weight nanwatch cannot read: nothing more to say
            self._fault("weights", "weight check at detach", exc)
            return False
        return bool(self._trace.records)

    def _weights_told(self) -> bool:
        """Bad weights at the run's end follow from an anomaly told already: the last step
        that ended held one (a NaN update applied, and each step since said so). One the run
        recovered from (its update skipped, later steps clean) is no such story: the last
        update can break the weights anew, and only the read at the end can say so."""
        last = self.history[-1] if self.history else None
        return self._trace.anomaly is not None or (last is not None and last.anomaly is not None)

    def _overflow_step(self) -> None:
        _frames.warn_at_user(
            f"nanwatch: a single step recorded more than {self.config.max_records_per_step} "
            "tensors; it was ended early. Call nw.step() once per training step.",
            safe=True,
        )
        self._boundary()

    def _flush(self, *, final: bool = False) -> None:
        """Bring the step's statistics still on the devices to the host, check gradients and
        weights, localize, and run the rules. ``final``: the run's last step (detach),
        whose update's weights no next forward will read: checked in every mode."""
        trace = self._trace
        # what backward made, left unread past an update (a GPU-bound step): the next step
        # keeps what its modules' risky nodes save (see _kept); a step whose backward was
        # read before its update does not need it
        self._own_saved.wanted = self._applied and (
            bool(self._pending_grads) or any(not pf.wait for pf in self._prefetched)
        )
        if not self._device_dead and not _tracing():
            weigh = self._full or (final and self._updated and not self._weights_told())
            maxima = self._param_maxima() if weigh else []  # read with the rest
            # read with no update applied since (no optimizer, a GradScaler that skipped
            # it): the weights are still the step's, and a bad value is pinpointed as before
            # an update (see _flush_before_update)
            late = self._read_late() and not self._applied and trace.anomaly is None
            weights = self._materialize(maxima, keep_trigger=late)
            if not self._grads_checked and self._backward_seen:
                self._check_grads()
                self._materialize(keep_trigger=late)
            if self._written_reads:
                self._read_written()
            if late and self._new_trigger is not None:
                self._late = True
                try:
                    self._handle_trigger(None, act=False)  # the step end acts
                finally:
                    self._late = False
            self._new_trigger = None
            if self._applied and self._read_late():
                # before the weights this step's update wrote are recorded as its own:
                with contextlib.suppress(Exception):
                    if self._bad_after_update(trace):
                        # a call after the step's last update (an evaluation after
                        # optimizer.step()) computed a NaN/inf with the weights as they
                        # are now: bad ones were bad before that forward ran, as its
                        # trigger finds on the CPU
                        self._check_params(at_end=False)
                    else:
                        # one before it, read only now: judged by the weights it computed
                        # with, weighed before the update (see _on_optimizer_step)
                        self._check_before_update(trace)
            if weigh:  # weights made non-finite by this step's update
                self._check_params(at_end=True, all_records=self._forensic, values=weights)
                if self._read_late():
                    bad = any(r.phase is Phase.PARAMETER and r.bad for r in trace.records)
                    self._weights_checked = None if bad else self._weight_versions()
        else:  # the device is gone: statistics still on it are unknown, not NaN
            for rec, *_ in self._pending + self._pending_grads:
                rec.stat = None
            for pf in self._prefetched:
                for rec, *_ in pf.rows + pf.grads:
                    rec.stat = None
            self._pending, self._pending_grads, self._pending_rows = [], [], []
            self._pending_nodes, self._prefetched = [], []
            self._written_reads = []
            self._grads_kept = None
        self._drain_ops()
        self._summarize(trace)
        found = trace.anomaly
        if found is None:
            self._localize(trace)
            if self._applied and self._own_saved.snaps:
                with contextlib.suppress(Exception):
                    self._pinpoint_from_kept(trace)
            if self._applied and self._late_losses:
                with contextlib.suppress(Exception):
                    self._pinpoint_loss_after_update(trace)
        self._pending_data = None
        a = trace.anomaly
        if a is not None and a.kind is AnomalyKind.INPUT and not _reached(trace, a):
            self._absorbed(trace, a)  # the whole step ran: the bad data reached nothing
            return
        if found is not None and a is not None:  # found during the step: count what it
            # took with it since
            a.propagators, a.propagator_count = propagators(trace, a.record, a.path)
            a.summary = summarize(a)
        trace.diagnoses = self._evaluate(trace)

    def _forget(self, trace: StepTrace, anomaly: Anomaly) -> None:
        """Take back an anomaly localized in ``trace`` (absorbed, or about to be localized
        again with what a replay found)."""
        trace.anomaly = None
        if anomaly in self.anomalies:
            self.anomalies.remove(anomaly)
        if self.first_anomaly is anomaly:
            self.first_anomaly = self.anomalies[0] if self.anomalies else None

    def _absorbed(self, trace: StepTrace, anomaly: Anomaly) -> None:
        """Bad data that reached nothing the step computed (no output, loss, gradient or
        weight holds NaN/inf): not an anomaly; an ``"absorbed_data"`` note for the early
        warning (NW406)."""
        self._forget(trace, anomaly)
        rec = anomaly.record
        self.note(
            "absorbed_data",
            anomaly.path,
            role=rec.role,
            summary=anomaly.summary,
            kinds=rec.stat.kinds() if rec.stat is not None else "",
            rows=list(rec.stat.bad_rows or ()) if rec.stat is not None else [],
            row_count=rec.stat.bad_row_count if rec.stat is not None else None,
            shape=list(rec.shape),
        )
        trace.diagnoses = self._evaluate(trace)

    def _drain_ops(self) -> None:
        """Move the forensic op checker's events into the step."""
        if self._checker is not None and self._checker.events:
            self._trace.ops.extend(self._checker.events)
            self._checker.events.clear()
            if self._ops_mark is not None:
                self._ops_mark = 0  # what the checker records next ran after the update

    def _materialize(
        self,
        extra: Sequence[torch.Tensor] = (),
        *,
        keep_trigger: bool = False,
        prefetched_only: bool = False,
    ) -> list[float]:
        """One host transfer per device for everything measured on accelerators. ``extra``
        (0-d device tensors: the weights' maxima) rides along; its values are returned.
        ``keep_trigger``: the first bad record read stays the trigger, for
        :meth:`_late_trigger` to localize and pinpoint. ``prefetched_only``: only what
        :meth:`_prefetch` sent on its way, waiting for the forward's and taking the rest
        only if it has landed (see :meth:`_flush_before_update`)."""
        filled: list[Record] = []
        grads: list[tuple[list[Record], list[float]]] = []
        taken: list[_Prefetch] = []
        left = self._prefetched
        # waiting for a forward's waits for what was enqueued before it too (a backward's
        # gradients ahead of a second forward of the step): those are read with it
        upto = max((i for i, pf in enumerate(left) if pf.wait), default=-1)
        while left and (not prefetched_only or upto >= 0 or left[0].wait or left[0].read.ready()):
            taken.append(left.pop(0))  # in order: a later one is not read before
            upto -= 1
        for pf in taken:
            got = pf.read.wait()
            for i, (rec, _, _, n) in enumerate(pf.rows):
                rec.stat = TensorStat(got[2 * i], got[2 * i + 1], n)
                filled.append(rec)
            base = 2 * len(pf.rows)
            if pf.grads:
                grads.append(
                    (
                        [r for r, _, _ in pf.grads],
                        [got[base + 2 * i + 1] for i in range(len(pf.grads))],
                    )
                )
            if pf.nodes:
                self._read_loss_nodes(pf.nodes, got[base + 2 * len(pf.grads) :])
        out: list[float] = []
        if not prefetched_only:
            pending, pgrads, nodes = self._pending, self._pending_grads, self._pending_nodes
            self._pending, self._pending_grads, self._pending_nodes = [], [], []
            if pending or pgrads or extra or nodes:
                values = [x for r in pending for x in (r[1], r[2])]
                values += [x for _, a, b in pgrads for x in (a, b)]
                flat = read_scalars(values + list(extra) + [f for *_, f in nodes])
                if nodes:
                    self._read_loss_nodes(nodes, flat[len(flat) - len(nodes) :])
                    flat = flat[: len(flat) - len(nodes)]
                for i, (rec, _, _, n) in enumerate(pending):
                    rec.stat = TensorStat(flat[2 * i], flat[2 * i + 1], n)
                    filled.append(rec)
                base = 2 * len(pending)
                if pgrads:
                    maxima = [flat[base + 2 * i + 1] for i in range(len(pgrads))]
                    grads.append(([r for r, _, _ in pgrads], maxima))
                out = flat[base + 2 * len(pgrads) :]
        if filled:
            now = {id(r) for r in filled}
            flagged: list[tuple[Record, torch.Tensor]] = []
            kept: list[tuple[Record, torch.Tensor]] = []
            for rec, flags in self._pending_rows:
                (flagged if id(rec) in now else kept).append((rec, flags))
            self._pending_rows = kept
            for rec, flags in flagged:  # a second read, only for a bad batch
                if rec.stat is not None and not rec.stat.finite:
                    rec.stat.bad_rows, rec.stat.bad_row_count = rows_from_flags(flags)
                    # their values all told, in case the batch is freed before it can be
                    # described (a computed input whose graph is gone)
                    rec.stat.nonfinite = int(flags.sum())
            self._describe_bad(filled, {id(r) for r, _ in flagged})
            for rec in filled:  # read, and described if bad: held no longer
                self._late_values.pop(rec.index, None)
            for rec in filled:
                if rec.stat is not None and not rec.stat.finite:
                    self._note_bad(rec)
        for recs, maxima in grads:  # after the records: they ran first
            self._fill_grad_stats(recs, [self._grad_as_checked(r) for r in recs], maxima)
        if grads and not self._pending_grads and not any(pf.grads for pf in self._prefetched):
            self._grads_kept = None  # every norm read: see _check_grads
        if not keep_trigger:
            self._new_trigger = None  # the flush localizes the whole step itself
        return out

    def _describe_bad(self, filled: list[Record], batches: set[int]) -> None:
        """Records read non-finite after their calls (the accelerator path) hold min and max
        only; a tensor still alive and unchanged is described in full now, as the CPU path
        describes it when measured: its NaN/inf counts and, for a batch (``batches``: ids
        of records measured with rows), which samples and features hold them -- what tells
        bad data from a value the user's code computed. Anomaly-time work (a read per
        record), for a bounded number of records a step."""
        bad = [r for r in filled if r.stat is not None and not r.stat.finite]
        if not bad or self._described_bad >= _DESCRIBE_BAD:
            return
        alive: dict[int, tuple[weakref.ReferenceType[torch.Tensor], int | None]] = {
            idx: (ref, ver) for ref, idx, ver, _ in self._known.values()
        }
        for rec in bad:
            if self._described_bad >= _DESCRIBE_BAD:
                return
            entry = alive.get(rec.index)
            t = entry[0]() if entry is not None else None
            if t is None or entry is None or entry[1] != _version(t):
                continue  # freed, or written since: what it held then is not known
            self._described_bad += 1
            stat = describe(t, rows=id(rec) in batches)
            if stat is not None and not stat.finite:
                rec.stat = stat

    def _summarize(self, trace: StepTrace) -> None:
        s = self.scaler
        if s is not None and self._scaled and not self._device_dead:
            with contextlib.suppress(Exception):
                # the scale the gradients carried, not the one update() set afterwards
                g = self._grad_scale
                trace.scale = float(g) if g is not None else float(s.get_scale())
        loss = self._user_loss
        if loss is not None and not self._device_dead:
            trace.loss = (
                float(loss.detach().float().item())
                if isinstance(loss, torch.Tensor)
                else float(loss)
            )
        elif trace.loss is None:
            # backward() ran on scaler.scale(loss): the user's loss is that over the scale
            at = self._scaled_loss
            unscale = (at, trace.scale) if at is not None and trace.scale else None
            trace.loss = self._loss_from_records(trace, unscale=unscale)
        held, self._loss_factor = self._loss_factor, None
        if (
            held is not None
            and not self._scaled
            and trace.loss is not None
            and abs(trace.loss) > 10
        ):
            with contextlib.suppress(Exception):  # backward ran on loss * a number
                v = float(held[0])  # a CPU number of Python's: no sync
                if math.isfinite(v) and v != 0:
                    factor = 1.0 / v if held[1] else v
                    trace.notes.append(Note("loss_factor", LOSS_PATH, {"factor": factor}))
        first = next((info.path for _, info in self._modules if info.first_root), None)
        calls = {c.id for c in trace.calls if c.root and c.path == first}
        least = 0  # fewest values an output needs to count
        if not calls:  # the first root is never called itself (a LightningModule calling
            # self.net(x)): the first module called from the user's code is the model, and
            # a one-value output of it is a loss, not logits
            calls = {c.id for c in trace.calls if c.root and not c.is_loss}
            calls = {min(calls)} if calls else set()
            least = 2
        mags: list[float] = []
        named: list[float] = []  # outputs called logits (a ModelOutput's .logits)
        for r in trace.records:
            if r.phase is Phase.FORWARD and r.call in calls:
                m = trace.resolve(r)
                # a one-value output is a loss (a model that returns it), not logits
                if m.stat is not None and m.stat.numel >= max(least, 2):
                    mags.append(m.stat.magnitude)
                    if "logit" in r.role.rsplit(".", 1)[-1]:
                        named.append(m.stat.magnitude)
        mags = [m for m in (named or mags) if not math.isnan(m)]
        trace.max_logit = max(mags) if mags else None
        by_scaler = s is not None and self._scaled and not self._device_dead
        if by_scaler and trace.grad_norm is not None and trace.scale:
            trace.grad_norm = trace.grad_norm / trace.scale  # the unscaled norm

    @staticmethod
    def _loss_from_records(
        trace: StepTrace, *, unscale: tuple[int, float] | None = None
    ) -> float | None:
        """The step's loss: the last one-element output of a root (the criterion, or a model
        that returns its loss), else of a loss module. ``unscale``: (record index, scale)
        of a loss that holds the user's loss times a GradScaler's scale."""
        root_loss: float | None = None
        module_loss: float | None = None
        for r in trace.records:
            if r.phase is not Phase.FORWARD:
                continue
            m = trace.resolve(r)
            if m.stat is None or m.stat.numel != 1:
                continue
            call = trace.call(r.call)
            if call is None:
                continue
            value = math.nan if m.stat.has_nan else m.stat.max
            if unscale is not None and r.index == unscale[0]:
                value /= unscale[1]
            if call.root:
                root_loss = value
            elif call.is_loss:
                module_loss = value
        return root_loss if root_loss is not None else module_loss

    # ------------------------------------------------------------------ anomalies
    def _locate(self, trace: StepTrace, first: bool) -> Anomaly | None:
        """:func:`localize` with this watcher's settings (``first``: the run's first step)."""
        cfg = self.config
        return localize(
            trace,
            allow=cfg.allow,
            scaled_grads=self._scaled,
            first_step=first,
            forensic=self._forensic,
        )

    def _grads_by_grad(self) -> bool:
        """This step's gradients came from ``torch.autograd.grad`` (see
        :meth:`_grads_returned`), no ``backward()`` ran: its backward ops ran in that call."""
        return not self._backward_called and self._weight_grads_taken is not None

    def _localize(self, trace: StepTrace) -> Anomaly | None:
        if trace is self._trace:
            self._drain_ops()
            if self._grads_by_grad():
                for done in trace.ops:  # the step's gradients came from torch.autograd.grad
                    if done.phase is Phase.BACKWARD and done.backward_at:
                        done.by_grad = True
        # a resumed run's restored steps ran in another process: weights bad at its first
        # step came with what it loaded (a checkpoint), not from an update seen here
        first = not self.history or self.history[-1].step < self._resumed_at
        anomaly = self._locate(trace, first)
        if anomaly is None:
            return None
        if anomaly.kind is AnomalyKind.INPUT and trace is self._trace:
            notes = len(trace.notes)
            self._late_call_site(anomaly)
            if anomaly.origin == "data-or-code" and len(trace.notes) > notes:
                # the user's line, noted only now (read late): the headline may name the
                # line above it that computed the input, as NW401 does
                anomaly = self._locate(trace, first) or anomaly
        elif anomaly.kind is AnomalyKind.FORWARD and trace is self._trace:
            with contextlib.suppress(Exception):  # the rules do without it
                self._root_call_site(anomaly)
        if (
            anomaly.kind is not AnomalyKind.PARAMETER
            and not self._device_dead
            # read after an update (the accelerator path's step end): the weights now are
            # not those the step computed with, and the end of the step checks them itself;
            # unless the bad value's call began after the step's last update (an evaluation
            # after optimizer.step()): it computed with the weights as they are now
            and not (self._applied and self._read_late() and not self._after_update(trace, anomaly))
            # nor after a write of the weights with no optimizer (a hand-written update)
            and not self._weights_written_since(trace, anomaly)
        ):
            with contextlib.suppress(Exception):
                self._check_params(at_end=False)
            if any(r.phase is Phase.PARAMETER and r.bad for r in trace.records):
                anomaly = self._locate(trace, first) or anomaly
        if anomaly.origin == "after-output" and anomaly.op is None and trace is self._trace:
            ev = self._saved_loss_node(anomaly) if self._loss_snaps else None
            ev = ev or (self._steep_loss_node(anomaly) if self._loss_snaps else None)
            ev = ev or self._last_loss_node(anomaly)
            if ev is not None:
                trace.ops.append(ev)
                anomaly = self._locate(trace, first) or anomaly
            elif not self._full:
                self._name_risky_loss_nodes(anomaly)
        trace.anomaly = anomaly
        if anomaly.origin == "after-output":
            self._loss_graph_armed = True  # the next steps check the loss code's gradients
        self.anomalies.append(anomaly)
        if self.first_anomaly is None:
            self.first_anomaly = anomaly
        return anomaly

    def _check_before_update(self, trace: StepTrace) -> None:
        """:meth:`_check_params` on the weights' maxima taken before the step's update, when
        a forward before it recorded a NaN/inf, read late: the weights are judged as that
        forward's trigger judges them on the CPU, with what the update is told from then."""
        if self._before_update is None or trace.anomaly is not None:
            return
        maxima, stepped, opt_calls, versions, ncalls = self._before_update
        self._before_update = None
        calls = {c.id for c in trace.calls[:ncalls]}
        if not any(r.bad and r.phase is Phase.FORWARD and r.call in calls for r in trace.records):
            return
        values = read_scalars(maxima)
        if all(math.isfinite(v) for v in values):
            return
        now = self._stepped, self._opt_calls
        self._stepped, self._opt_calls, self._versions = stepped, opt_calls, versions
        try:
            self._check_params(at_end=False, values=values)
        finally:
            self._stepped, self._opt_calls = now
            self._versions = None

    def _bad_after_update(self, trace: StepTrace) -> bool:
        """A call that began after the step's last optimizer update recorded a NaN/inf."""
        later = {c.id for c in trace.calls[self._applied_calls :]}
        return bool(later) and any(r.bad and r.call in later for r in trace.records)

    def _weight_versions(self) -> tuple[tuple[int, int | None], ...]:
        """The watched weights, each with its version counter (host-side, no device read):
        an in-place write of a weight (``w.sub_(lr * w.grad)``, an optimizer's) moves it."""
        return tuple((id(p), _version(p)) for _, _, p in self._params)

    def _weights_written_since(self, trace: StepTrace, anomaly: Anomaly) -> bool:
        """Read late (the accelerator path's step end), the weights were written in place
        after the root call that recorded ``anomaly`` began (a hand-written update, no
        optimizer: nothing was read before it), and that call computed with the weights the
        last step's end found finite, unwritten since: the weights now are not those it
        computed with, and the end of the step checks them itself."""
        if trace is not self._trace or not self._read_late() or self._weights_checked is None:
            return False
        call = trace.call(anomaly.record.call)
        while call is not None and not call.root and call.parent is not None:
            call = trace.call(call.parent)
        frame = self._root_frame(call) if call is not None else None
        began = frame.weights if frame is not None else None
        if began is None or began != self._weights_checked:
            return False
        now = self._weight_versions()  # the same weights (a replay may add one), written
        return [i for i, _ in now] == [i for i, _ in began] and now != began

    def _after_update(self, trace: StepTrace, anomaly: Anomaly) -> bool:
        """The call that recorded ``anomaly`` began after the step's last optimizer update
        returned: the weights it computed with are those the watched modules hold now."""
        rec = anomaly.record
        if rec is None or trace is not self._trace:
            return False
        later = {c.id for c in trace.calls[self._applied_calls :]}
        return rec.call in later

    def _handle_trigger(
        self,
        current: tuple[Call, nn.Module, Any, Any] | None,
        *,
        loss: torch.Tensor | None = None,
        act: bool = True,
    ) -> None:
        """A record just turned out bad (CPU: known at once; accelerators: read before the
        update, :meth:`_late_trigger`). Localize now, pinpoint the op while the producer's
        inputs are at hand (for a functional loss: from the autograd graph it built), and
        act (unless not ``act``)."""
        rec, self._new_trigger = self._new_trigger, None
        trace = self._trace
        pending = self._pending_data
        if trace.anomaly is not None:
            if pending is not None and trace.anomaly is pending and rec is not None:
                # a value the step computed went bad after the bad data: localize again,
                # now that the calls have returned (data a module cleaned itself, with
                # nan_to_num, is not the origin), and act before an update spreads it
                self._pending_data = None
                self._forget(trace, pending)
            else:
                return
        first_of_run = self.first_anomaly is None
        if rec is not None and rec.phase in (Phase.BACKWARD, Phase.GRADIENT):
            with contextlib.suppress(Exception):
                self._note_user_hooks(rec)
        anomaly = self._localize(trace)
        if anomaly is None:
            return
        if anomaly.kind is AnomalyKind.INPUT and not _reached(trace, anomaly):
            # NaN padding a packed sequence never reads, missing values the model imputes:
            # data is only an error once it reaches something; the step end decides
            self._pending_data = anomaly
            return
        if self._forensic and anomaly.op is not None and anomaly.path == LOSS_PATH:
            # the op traced already (not by _pinpoint_loss): what gave a log its 0
            held = loss if loss is not None or not self._late else self._late_loss_of(anomaly)
            if held is not None and anomaly.kind is AnomalyKind.FORWARD:
                self._note_zero_params(held)
        if self.config.pinpoint and anomaly.kind is AnomalyKind.FORWARD and anomaly.op is None:
            # the loss code's graph is read at every anomaly (cheap); a module is replayed
            # at its first anomaly of the run only (warn/record runs go on with one a step),
            # see _replay_due
            late = loss is None and self._late and anomaly.path == LOSS_PATH
            if late and self._loss_snaps:
                # read after backward (the forward had not landed as it began): the graph
                # is read as it stood then, from what its nodes saved, kept at backward()
                loss = self._late_loss_of(anomaly)
            if loss is not None and anomaly.path == LOSS_PATH:
                kept = [snap for *_, snap in self._loss_snaps] if late else []
                with ops.saved_from(kept):
                    self._pinpoint_loss(anomaly, loss)
                src = anomaly.neginf_source
                if src is not None and (first_of_run or self._replay_due("forward", src.path)):
                    # the -inf it grew out of came from a watched module: replay that one
                    self._pinpointed.add(("forward", src.path))
                    self._pinpoint_neginf(anomaly, None, current, False)
                    anomaly.summary = summarize(anomaly)
            elif first_of_run or self._replay_due("forward", anomaly.path):
                try:
                    late_found = rec is not None and rec.phase in (Phase.BACKWARD, Phase.GRADIENT)
                    self._pinpoint(anomaly, current, in_backward=late_found)
                    self._pinpoint_derived_input(anomaly, current)
                finally:  # the module blamed, once the replay moved it into a child
                    self._pinpointed.add(("forward", anomaly.path))
        elif (
            self.config.pinpoint
            and anomaly.kind is AnomalyKind.BACKWARD
            and anomaly.origin in ("between-children", "module")
            and (anomaly.op is None or _line_unknown(anomaly.op, anomaly.path))
            and not self._forensic
            and (first_of_run or self._replay_due("backward", anomaly.path))
        ):
            try:
                self._pinpoint_own_backward(anomaly)
            finally:
                self._pinpointed.add(("backward", anomaly.path))
        elif (
            self.config.pinpoint
            and anomaly.kind is AnomalyKind.GRADIENT
            and anomaly.op is None
            and not self._forensic
            and (first_of_run or self._replay_due("gradient", anomaly.path))
        ):
            try:
                self._pinpoint_param_backward(anomaly)
            finally:
                self._pinpointed.add(("gradient", anomaly.path))
        if self._late and self.config.pinpoint and not self._forensic:
            self._pinpoint_named_node(anomaly)
        trace.diagnoses = self._evaluate(trace)
        if act:
            self._act(trace)

    def _replay_due(self, what: str, path: str) -> bool:
        """Whether an anomaly localized in the module at ``path`` is replayed; ``what``:
        "forward", "backward" (the module's own backward) or "gradient" (the backward
        behind a parameter's gradient). Each is replayed once a run for a module (its later
        anomalies of that kind are its code's again: a warn/record run goes on with one a
        step), keyed by the module the replay blamed: a parent whose replay moved the value
        into a child it did not measure is replayed again at its next one, which may come
        from its own code or another child. So is a module whose submodules' calls are not
        hooked (sentinel's roots): its path alone does not tell which code made it."""
        if (what, path) not in self._pinpointed:
            return True
        module = next((m for m, info in self._modules if info.path == path), None)
        if module is None:
            return False
        return any(self._unhooked_path(m) is not None for m in module.modules() if m is not module)

    def _late_loss_of(self, anomaly: Anomaly) -> torch.Tensor | None:
        """The loss held for a read after backward (see :meth:`_hold_late_loss`) whose
        record is ``anomaly``'s, else the step's last one."""
        at = anomaly.record
        loss = self._late_losses.get(at.index) if at is not None else None
        return self._late_loss if loss is None else loss

    def _pinpoint_loss_after_update(self, trace: StepTrace) -> None:
        """The step end read a NaN/inf born in the loss code after an optimizer update
        (LBFGS's closure runs backward and updates before anything is read): the modules are
        not replayed with weights the update changed, but the loss code's graph is read as
        backward found it, from what its nodes saved, which a write since invalidates.
        Sentinel: a parameter's bad gradient made in the loss code's backward is named there
        too (see :meth:`_loss_node_of_param`): not a replay, which the update prevents."""
        a = trace.anomaly
        if (
            a is not None
            and self.config.pinpoint
            and a.kind is AnomalyKind.GRADIENT
            and a.op is None
            and not self._full
            and not self._forensic
        ):
            param = next((p for q, _, p in self._params if q == a.record.role), None)
            self._late = self._reading_after_update = True
            try:
                ev = self._loss_node_of_param(a, param) if param is not None else None
            finally:
                self._late = self._reading_after_update = False
            if ev is not None:
                trace.ops.append(ev)
                adopt_backward_op(a, [ev])
            return
        if (
            a is None
            or not self.config.pinpoint
            or a.kind is not AnomalyKind.FORWARD
            or a.op is not None
            or a.path != LOSS_PATH
            or not self._loss_snaps
        ):
            return
        loss = self._late_loss_of(a)
        if loss is None:
            return
        self._late = self._reading_after_update = True
        try:
            with ops.saved_from([snap for *_, snap in self._loss_snaps]):
                self._pinpoint_loss(a, loss)
        finally:
            self._late = self._reading_after_update = False
        a.summary = summarize(a)

    def _keeps_own_saved(self) -> bool:
        """Read late (the accelerator path), in watch or sentinel mode with pinpointing on,
        in the run's first step and after one whose backward was read only after its update
        (see :meth:`_flush`): what the risky nodes of each call's own code save is kept (see
        :mod:`_kept`), for an anomaly of its backward read only after the update."""
        return (
            self._own_saved.wanted
            and self._read_late()
            and self.config.pinpoint
            and not self._forensic
            and torch.is_grad_enabled()
            and not ops.replaying()
        )

    def _pinpoint_from_kept(self, trace: StepTrace) -> None:
        """Read at the step's end after an optimizer's update (the GPU-bound step: nothing had
        landed before it), a gradient born non-finite in the backward of a module's own code
        (or reaching a parameter's gradient unwatched): the module cannot be replayed with
        the weights it ran with. Of the risky nodes its own code made, whose saved values
        were kept as its call returned (see :mod:`_kept`), the one whose forward was given
        a point where its derivative is infinite (:func:`_steep_count`) is named, with what
        it saved and its line, as the replay names it before an update. Reads the kept
        values: anomaly-time work only."""
        a = trace.anomaly
        if a is None or not self.config.pinpoint or self._forensic:
            return
        named = a.op  # by its name alone (a loss module's node flagged on the device)
        if named is not None and not _line_unknown(named, a.path):
            return
        if a.kind is AnomalyKind.BACKWARD and a.origin in ("between-children", "module"):
            paths = [a.path]
        elif a.kind is AnomalyKind.GRADIENT and named is None:
            # its module first, then those that hold it, innermost first (as
            # _pinpoint_param_backward replays them)
            owner = next((m for m, info in self._modules if info.path == a.record.path), None)
            holders = sorted(
                (sum(1 for _ in m.modules()), info.path)
                for m, info in self._modules
                if owner is not None and m is not owner and any(x is owner for x in m.modules())
            )
            paths = [a.record.path] + [p for _, p in holders]
        else:
            return
        for path in paths:
            ev = self._steep_kept_node(a, path)
            if ev is None:
                continue
            if named is not None:
                if ev.node != named.node:
                    return  # another node: the one its flag named stays
                # what the node made, as its flag read it, with what it saved and its line
                ev.output, ev.born = named.output, named.born
                trace.ops[:] = [o for o in trace.ops if o is not named]
            trace.ops.append(ev)
            if a.kind is AnomalyKind.GRADIENT:
                adopt_backward_op(a, [ev])
            else:
                a.op = ev
                a.summary = summarize(a)
            return

    def _steep_kept_node(self, anomaly: Anomaly, path: str) -> OpEvent | None:
        """:meth:`_pinpoint_from_kept` for the module at ``path``: the event of its own
        code's kept node whose saved values lie where its derivative is infinite, the one
        whose backward ran first when several of a call do (of its first call that has
        one); None when none does."""
        steep = [
            (call_id, snap, offset)
            for p, call_id, snap, offset in self._own_saved.snaps
            if p == path and snap.unchanged() and _steep_count(snap)
        ]
        if not steep:
            return None
        stop = self._recorded_nodes

        def below(top: Any) -> set[int]:
            def prune(n: Any) -> bool:  # ``top`` may be the module's output: recorded
                return (n in stop and n is not top) or ops.accumulates_grad(n)

            return {id(n) for n in ops.GraphWalk([top], prune=prune, limit=_LOSS_NODES)}

        first = None
        for cand in steep:
            # each call's own graph apart (a module called twice a step): the first call
            # with a node whose backward ran before its other ones'
            under = below(cand[1].node)
            if all(id(s.node) in under for c, s, _ in steep if c == cand[0]):
                first = cand
                break
        if first is None:
            return None
        call_id, snap, offset = first
        name = ops.name_of(snap.node)
        # what the node made depends on the gradient that reached it (a sqrt's backward at
        # 0 makes +inf, -inf or NaN as it was positive, negative or 0): a watched output's
        # gradient below it may hold what a later node made of it, and is not told as the
        # node's; a parameter's, which no watched output's came between, is
        told = anomaly.kind is AnomalyKind.GRADIENT and anomaly.record.stat is not None
        stat = anomaly.record.stat if told else None
        ev = self._saved_node_event(
            snap, name, stat or TensorStat(math.nan, math.nan, 0), anomaly.record.dtype
        )
        if ev is None:
            return None
        if not told:
            ev.born = ops.UNKNOWN_KIND
        ev.path = path
        site = self._loss_site()
        sub: list[str] = []
        line = self._kept_line(call_id, snap, offset, sub) or _NO_LINE
        _place(ev, line, site)
        if sub:  # made in a submodule whose calls no hook watched (sentinel): told as its
            ev.path = sub[0]
        return ev

    def _kept_line(
        self, call_id: int, snap: ops.SavedNode, offset: int, sub: list[str] | None = None
    ) -> tuple[str, str | None] | None:
        """The user's line that made the kept node ``snap``, ``offset`` nodes after its call
        began: the call is run again under anomaly mode on its inputs, still at hand or
        made again by its root on the root's own (the weights the update wrote give other
        values, the same ops), and the node made at the same place, of the same kind, tells
        its line. None when no inputs are found, the run fails, or the node there is
        another. ``sub`` gets the path of the innermost submodule whose calls no hook
        watched (see :meth:`_unhooked_path`) that made it, if one did. Anomaly-time work
        only."""
        call = self._trace.call(call_id)
        if call is None or _distributed() is not None:
            return None
        found = self._call_inputs(call, None, False, finished=True)
        held = self._own_saved.inputs.get(call_id)
        owner = next((m for m, info in self._modules if info.path == call.path), None)
        if found is None and held is not None and owner is not None:
            found = (owner, held[0], held[1], False)  # what its forward was given
        if found is None and not call.root:
            found = self._inputs_from_root(call.path, grad=True)
        if found is None:
            return None
        module, args, kwargs, hooks = found
        kind = type(snap.node).__name__
        devices = {t.device for _, t in self._walk(args, "input", kwargs)}
        # the node numbers each unwatched submodule's call spans: (first, end, its path)
        spans: list[tuple[int, int, str]] = []
        opened: list[int | None] = []

        def into(_m: nn.Module, _a: Any) -> None:
            opened.append(ops._next_sequence_nr())

        def made(m: nn.Module, _a: Any, _o: Any) -> None:
            first = opened.pop() if opened else None
            end, name = ops._next_sequence_nr(), self._unhooked_path(m)
            if first is not None and end is not None and name is not None:
                spans.append((first, end, name))

        inner = [m for m in module.modules() if m is not module and self._unhooked_path(m)]
        with contextlib.ExitStack() as stack:
            for m in inner:
                stack.callback(m.register_forward_pre_hook(into).remove)
                stack.callback(m.register_forward_hook(made).remove)
            stack.enter_context(ops.preserved_state(module, devices))
            stack.enter_context(ops._replay_scope())
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.set_detect_anomaly(True, False))
            start = ops._next_sequence_nr()
            try:
                out = ops.call_forward(
                    module, args, kwargs, pre_hooks=hooks, modes=self._call_modes(call)
                )
            except Exception:  # a call that cannot run again here: no line
                return None
            if start is None:
                return None
            want = start + offset
            roots = _kept.nodes_of(out)
            for node in ops.GraphWalk(
                roots,
                prune=lambda n: ops.accumulates_grad(n) or (_kept._nr(n) or -1) < start,
                limit=_LOSS_NODES,
            ):
                if _kept._nr(node) == want:
                    if type(node).__name__ != kind:
                        return None
                    spanned = [(s, p) for s, e, p in spans if s <= want < e]
                    if spanned and sub is not None:
                        sub.append(max(spanned)[1])  # the innermost: the latest to begin
                    src, code = ops.forward_line(node)
                    return (src, code) if src is not None else None
        return None

    def _note_user_hooks(self, trig: Record) -> None:
        """Note the hooks the user registered on the tensor whose gradient ``trig`` found
        bad (a ``register_hook`` or ``register_post_accumulate_grad_hook``, never
        nanwatch's own): what such a hook returns is the gradient nanwatch records, and
        ``torch.autograd.detect_anomaly`` does not check it. Anomaly-time work only."""
        t: torch.Tensor | None = None
        name = trig.role
        if trig.phase is Phase.BACKWARD and trig.source is not None:
            t = next(
                (ref() for ref, idx, _, _ in self._known.values() if idx == trig.source),
                None,
            )
            name = f"{trig.path}'s {trig.role}"
        elif trig.phase is Phase.GRADIENT:
            t = next((p for q, _, p in self._params if q == trig.role), None)
            name = trig.role
        if t is None:
            return
        ours = {getattr(h, "id", None) for h in self._tensor_handles}
        found: list[tuple[str, Any]] = []
        for key, fn in (getattr(t, "_backward_hooks", None) or {}).items():
            if key in ours:
                break  # hooks run in order: a later one did not make what nanwatch saw
            found.append(("register_hook", fn))
        for key, fn in (getattr(t, "_post_accumulate_grad_hooks", None) or {}).items():
            if key not in ours:
                found.append(("register_post_accumulate_grad_hook", fn))
        for how, fn in found:
            site = _hook_site(fn)
            if site is not None:
                self.note(
                    "user_hook",
                    trig.path,
                    tensor=name,
                    parameter=trig.phase is Phase.GRADIENT,
                    how=how,
                    **site,
                )

    def _pinpoint(
        self,
        anomaly: Anomaly,
        current: tuple[Call, nn.Module, Any, Any] | None,
        *,
        pre_hooks: bool | int = False,
        in_backward: bool = False,
    ) -> None:
        """Replay the module whose code made the anomaly on its inputs, every op checked.
        ``current``: a call whose inputs are at hand, with ``pre_hooks`` (see
        :func:`ops.call_forward`) saying which of its pre-hooks they went through;
        ``in_backward``: the value that told of it was a gradient."""
        trace = self._trace
        if anomaly.origin == "between-roots":
            return  # no module ran the code: forensic mode or nw.replay() traces it
        call = trace.call(anomaly.record.call)
        target = call
        if anomaly.origin == "between-children" and call is not None and call.parent is not None:
            target = trace.call(call.parent)
        if target is None:
            return
        found = self._call_inputs(target, current, pre_hooks, finished=False)
        meant = target
        if found is None and self._late and in_backward and anomaly.neginf_source is not None:
            # a -inf only its gradient told of: on the CPU that is found in backward, once
            # the call is over, and the code that made the -inf is replayed (below); the
            # whole call replayed now would name the first op the -inf went through
            self._pinpoint_neginf(anomaly, None, current, pre_hooks)
            if anomaly.op is not None:
                anomaly.summary = summarize(anomaly)
                return
        if found is None and self._late:
            late = self._late_inputs(target, current)
            if late is not None:
                target, found = late
        if found is None:
            if anomaly.op is None and anomaly.neginf_source is not None:
                # found at gradient time (a -inf input that the module's backward turned
                # into NaN): the call is over, but the code that made the -inf can be replayed
                self._pinpoint_neginf(anomaly, None, current, pre_hooks)
                anomaly.summary = summarize(anomaly)
            return
        module, args, kwargs, hooks = found
        # a value the module's own code made before one of its children's calls: on the CPU
        # that call is still open when it is found, and its replay runs the user's
        # pre-hooks under the checker with the rest of its code (a standardization there)
        own_code = anomaly.origin == "between-children" and target is meant
        if self._late and hooks is not False and not own_code:
            # read after the call ended, its inputs are those the pre-hooks got: they run
            # again first, outside the checked replay, as on the CPU, where the replay gets
            # what the forward got. What a pre-hook sets (the weight weight_norm computes)
            # is then the state the forward read, not an op of the forward
            with _NO_TORCH_FUNCTION():
                args, kwargs = ops.run_pre_hooks(module, args, kwargs, pre_hooks=hooks)
            hooks = False
        # on accelerators the replay syncs at each op: anomaly-time work, once per module
        world = _distributed()
        if world is not None:  # a module may call a collective (a gather layer,
            # SyncBatchNorm, DDP's forward): run on one rank alone it waits for the others
            # until the process group times out, while they wait in their own collectives
            rank, size = world
            self.note("replay", target.path, skipped="distributed", rank=rank, world=size)
            base, sep, rest = anomaly.summary.partition(" [")
            anomaly.summary = (
                f"{base} (not replayed: in a distributed run a replay on one rank could block "
                "in a collective; run this rank's step with mode='forensic' or reproduce it "
                f"in one process){sep}{rest}"
            )
            return
        # read late, the call's autocast region has ended: the replay runs under the state
        # the call began with (on the CPU path it runs inside the call, under it already)
        result = self._replay_of(
            target,
            module,
            args,
            kwargs,
            hooks,
            call_site=self._call_line(module) or self._late_line(target),
            rng=self._call_rng(target),
            keep=self._freed_producer(anomaly),
        )
        self._describe_replayed(anomaly, target, result)
        if target is not meant:
            # the root ran in place of the call whose inputs were gone (read late): only
            # the ops of that call's module made its value; what the root's code did with
            # it after the call (inf - inf in a later layer) is not where it began
            within = meant.path + "."
            kept = [
                e
                for e in result.events
                if e.path is None or e.path == meant.path or e.path.startswith(within)
            ]
            result = dataclasses.replace(result, events=kept)
        trace.ops.extend(result.events)
        first = result.first()
        if first is not None:
            anomaly.op = first
        elif (
            result.clean
            # the root's replay, run for ``meant`` with the original draws, made its bad
            # value only before it: ``meant``'s own code ran the same computation, clean
            and (result.conclusive or not result.new_draws)
            and self._blame_unmeasured_of(anomaly, meant, target, args, kwargs)
        ):
            return  # re-localized in the module that made its input, and pinpointed there
        elif result.clean and result.conclusive:
            if result.output and self._blame_weights(anomaly, module):
                return  # re-localized on the non-finite weights the replay read
            state = _bad_state(module)
            written = [] if state else self._own_writes(target)
            # read late, the root that ran the module was replayed in its place: state of
            # that module is told as its own, named below it, as when it is replayed itself
            owner, where = _state_owner(
                self._modules, module, target=target, meant=meant, state=state, written=written
            )
            if owner is not None:
                module, target = owner, meant
                state = [{**t, "name": n} for t in state if (n := where(t["name"]))]
                written = [n for w in written if (n := where(w))]
            if state:  # the forward read it: no op made it, and a replay cannot clear it
                self.note("module_state", target.path, tensors=state)
            elif not result.output:
                written = [n for n in written if _read_state(module, n)]
                if not written:
                    anomaly.transient = True
                else:
                    self._overwritten_state(anomaly, target, module, written)
                    return
        if result.random:
            self.note(
                "replay",
                target.path,
                random=True,
                attempts=result.attempts,
                reproduced=first is not None,
            )
        self._pinpoint_neginf(anomaly, target, current, pre_hooks)
        self._born_below(anomaly, meant)
        anomaly.summary = summarize(anomaly)

    def _replayed_below(self, anomaly: Anomaly) -> None:
        """:meth:`replay` traced the forward op that made the anomaly's value to a module
        whose calls are not hooked (sentinel) inside the one that recorded it: the anomaly
        moves there, as after the replay at the time it was found (:meth:`_born_below`)."""
        op = anomaly.op
        path = op.chain()[0].path if op is not None and op.phase is Phase.FORWARD else None
        if anomaly.kind is not AnomalyKind.FORWARD or path is None or path == anomaly.path:
            return
        outer = next((m for m, info in self._modules if info.path == anomaly.path), None)
        inner = next((m for m, info in self._modules if info.path == path), None)
        if outer is None or inner is None or self._unhooked_path(inner) is None:
            return
        if any(m is inner for m in outer.modules()):
            born_below(anomaly, path, type(inner).__name__)

    def _param_of(self, t: torch.Tensor) -> tuple[str, str] | None:
        """``t``'s qualified name and the type of the module that holds it, when ``t`` is a
        watched parameter (by identity), for an op event that reads it; None otherwise.
        Host-side and built on first ask after the parameters changed: anomaly-time work."""
        params = self._params
        if id(t) not in self._param_ids:
            return None
        table = self._param_table
        if table is None or table[0] is not params:
            names = {
                id(p): (p, q, kind)
                for (q, _, p), kind in zip(params, self._param_types, strict=False)
            }
            table = self._param_table = (params, names)
        found = table[1].get(id(t))
        return (found[1], found[2]) if found is not None and found[0] is t else None

    def _unhooked_path(self, module: nn.Module) -> str | None:
        """The path of ``module`` when the watcher does not hook its calls (sentinel mode
        hooks the roots alone), so that no hook of its names the ops a replay runs in it:
        the replay names them (see :func:`ops.replay`'s ``names``). None for the others."""
        if self.global_hooks or self.config.mode != "sentinel":
            return None  # every call is hooked, and its hooks name it during a replay
        info = self._infos.get(module)
        return None if info is None or info.is_root else info.path

    def _born_below(self, anomaly: Anomaly, meant: Call) -> None:
        """The replay of ``meant`` traced the op that made the anomaly's value to a module
        that ran inside that call (a root's children are not named after it, so the path
        alone does not tell): the anomaly names that innermost module (see
        :func:`nanwatch.localize.born_below`). Not when each of its calls there gave
        outputs measured finite: the value the op made did not leave it."""
        op = anomaly.op
        path = op.chain()[0].path if op is not None else None
        if path is None or path == meant.path:
            return
        outer = next((m for m, info in self._modules if info.path == meant.path), None)
        inner = next((m for m, info in self._modules if info.path == path), None)
        if outer is None or inner is None or not any(m is inner for m in outer.modules()):
            return  # not a module inside it (the op of a shared module, or unknown)
        trace = self._trace
        ids = {c.id for c in trace.calls if c.path == path and self._under(c, meant)}
        outs = [r for r in trace.records if r.call in ids and r.phase is Phase.FORWARD]
        if outs and all(r.stat is not None and r.stat.finite for r in outs):
            return
        born_below(anomaly, path, type(inner).__name__)

    def _freed_producer(self, anomaly: Anomaly) -> nn.Module | None:
        """Read late (the accelerator path), the bad output's counts and finite max are
        known only while it is alive (:meth:`_describe_bad`): when it was freed first, the
        module that made it, whose output the replay makes again (see
        :meth:`_describe_replayed`). None on the CPU path, where it was described as
        measured."""
        rec = anomaly.record
        if not self._late or rec.phase is not Phase.FORWARD or rec.stat is None:
            return None
        if rec.stat.counted or rec.stat.finite:
            return None
        call = self._trace.call(rec.call)
        if call is None:
            return None
        return next((m for m, info in self._modules if info.path == call.path), None)

    def _describe_replayed(self, anomaly: Anomaly, target: Call, result: ops.ReplayResult) -> None:
        """The bad output of :meth:`_freed_producer`, made again by the replay of ``target``
        on the same inputs and weights, is described from that copy, as the CPU path
        describes it when measured: its NaN/inf counts and finite max (what tells an
        overflow's size, or a value grown since the last step). Only a copy with the same
        draws and the same min and max as the one read stands for it."""
        rec = anomaly.record
        if not result.kept or result.new_draws or rec.stat is None or rec.stat.counted:
            return
        trace = self._trace
        call = trace.call(rec.call)
        if call is None:
            return
        # which call of the module, among those the replayed call ran (a module called
        # twice in a forward made an output each time)
        nth = 0
        if call.id != target.id:
            for c in trace.calls:
                if c.id >= call.id:
                    break
                if c.path == call.path and c.id > target.id and self._under(c, target):
                    nth += 1
        if nth >= len(result.kept):
            return
        t = dict(iter_tensors(result.kept[nth], "output")).get(rec.role)
        if t is None and isinstance(result.kept[nth], torch.Tensor) and rec.role == "output":
            t = result.kept[nth]
        if t is None:
            return
        stat = describe(t)
        old = rec.stat
        if stat is None or stat.numel != old.numel or not _same_ends(stat, old):
            return
        stat.bad_rows, stat.bad_row_count = old.bad_rows, old.bad_row_count
        stat.bad_cols, stat.bad_col_count = old.bad_cols, old.bad_col_count
        rec.stat = stat

    def _under(self, call: Call, top: Call) -> bool:
        """``call`` ran inside ``top`` (any depth)."""
        trace, seen = self._trace, set()
        up = call.parent
        while up is not None and up not in seen:
            if up == top.id:
                return True
            seen.add(up)
            parent = trace.call(up)
            up = parent.parent if parent is not None else None
        return False

    def _join_streams(self) -> None:
        """Work enqueued now waits for the streams of the user's own a watched call ran on
        (see :func:`nanwatch.stats.note_stream`): nothing to do unless one did."""
        if self._params:
            join_streams(self._params[0][2].device)

    def _read_late(self) -> bool:
        """The step's statistics are read after its calls (the accelerator path)."""
        return self._defer_cpu or any(p.device.type != "cpu" for _, _, p in self._params[:1])

    def _late_inputs(
        self, call: Call, current: tuple[Call, nn.Module, Any, Any] | None = None
    ) -> tuple[Call, tuple[nn.Module, Any, Any, bool | int]] | None:
        """For a trigger read after the step's calls ended (:meth:`_late_trigger`): the
        finished ``call``'s inputs if they are alive and unchanged, else the root call that
        ran it, with that root's own arguments (kept until the next call of the root, or
        ``current``: the root call returning now): a replay of the root checks every op of
        the submodule too, on the same weights."""
        found = self._call_inputs(call, None, False, finished=True)
        if found is not None:
            return call, found
        root = self._root_of(call)
        if root is None or not root.root or root is call:
            return None
        if current is not None and current[0] is root:
            return root, (current[1], current[2], current[3], False)
        found = self._root_call_inputs(root)
        return (root, found) if found is not None else None

    def _root_of(self, call: Call) -> Call | None:
        """The call of a root module that ran ``call`` (``call`` itself for a root's), up
        its parents; None when a parent is not recorded. The result need not be a root's
        call when the chain ends in a cycle (not a root: the caller checks)."""
        trace = self._trace
        root: Call | None = call
        seen: set[int] = set()
        while root is not None and not root.root and root.id not in seen:
            seen.add(root.id)
            root = trace.call(root.parent) if root.parent is not None else None
        return root

    def _call_rng(self, call: Call) -> list[Any] | None:
        """The CPU generator state ``call`` (a root call) began with, if still known."""
        frame = next((fr for fr in self._stack if fr.call is call), None)
        if frame is None:
            frame = self._root_frames.get(call.path)
        return frame.rng if frame is not None and frame.call is call else None

    def _replay_of(
        self, call: Call, module: nn.Module, args: Any, kwargs: Any, hooks: Any, **extra: Any
    ) -> ops.ReplayResult:
        """:func:`ops.replay` of ``call``'s module on the inputs found for it (with the
        pre-hooks that ran on them), under the state the call began with (its autocast
        region, its TorchFunctionModes), holding the module's state still and naming the
        modules the replay passes through as the watcher does; ``extra``: the line that
        made the call, its random draws, what to keep of the producer."""
        return ops.replay(
            module,
            args,
            kwargs,
            path=call.path,
            on_error=self._checker_fault,
            pre_hooks=hooks,
            hold=self._moved_state,
            autocast=self._call_autocast(call),
            modes=self._call_modes(call),
            names=self._unhooked_path,
            param_of=self._param_of,
            **extra,
        )

    def _call_autocast(self, call: Call) -> tuple[tuple[str, torch.dtype], ...] | None:
        """The autocast state the root call that ran ``call`` began with, for a replay made
        after it returned (the accelerator path); None when the replay runs in the call's
        own hook, under it already."""
        if not self._late:
            return None
        frame = self._root_frame(call)
        return frame.autocast if frame is not None else None

    def _call_modes(self, call: Call) -> tuple[Any, ...]:
        """The TorchFunctionModes the root call that ran ``call`` began under (see
        :func:`nanwatch._compat.as_called`); none when not known."""
        frame = self._root_frame(call)
        return frame.modes if frame is not None else ()

    def _root_frame(self, call: Call) -> _Frame | None:
        """The frame of the root call that ran ``call``, open or the root's last; None
        when the root is not known."""
        root = self._root_of(call)
        if root is None:
            return None
        frame = next((fr for fr in self._stack if fr.call is root), None)
        if frame is None:
            frame = self._root_frames.get(root.path)
        return frame if frame is not None and frame.call is root else None

    def _note_call_site(
        self, info: _ModInfo, module: nn.Module, site: Any = None, kind: str = "call_site"
    ) -> None:
        """Note where the user called the root ``info`` whose input is bad (NW401 names the
        batch as that line passed it). Anomaly time only: a frame walk (``site``: the
        frames as the call found them, see :meth:`_late_call_site`). ``kind``: the note's
        (``"root_call"``: a root whose own forward made the value, see
        :meth:`_root_call_site`)."""
        if any(n.kind == kind and n.path == info.path for n in self._trace.notes):
            return
        try:
            data = _call_site_data(module, site)
        except Exception:  # a frame nanwatch cannot read: the rule does without
            data = None
        if data is not None:
            self.note(kind, info.path, **data)

    def _late_site(self, call: Call | None) -> _FrameAt | None:
        """Where the user called the finished root ``call``, kept when it began (the
        accelerator path, see ``_Frame.site``)."""
        if call is None or not call.root:
            return None
        frame = self._root_frames.get(call.path)
        return frame.site if frame is not None and frame.call is call else None

    def _late_line(self, call: Call) -> tuple[str, str | None] | None:
        """The user's line that called the finished root ``call`` (see :meth:`_late_site`),
        for a replay of it after that line has moved on; None on the CPU path."""
        site = self._late_site(call)
        user = _frames.user_frame(site) if site is not None else None  # type: ignore[arg-type]
        if user is None:
            return None
        source, code = _frames.describe_frame(user)
        return (source, code) if source is not None else None

    def _late_call_site(self, anomaly: Anomaly, kind: str = "call_site") -> None:
        """Bad input data read after the root's call returned (the accelerator path): the
        user's line has moved on, so its call of the root is noted from the frames kept
        as the call began, as the pre-hook notes it on the CPU."""
        call = self._trace.call(anomaly.record.call)
        site = self._late_site(call)
        if call is None or site is None:
            return
        frame = self._root_frames[call.path]
        info = self._infos.get(frame.module)
        if info is not None:
            self._note_call_site(info, frame.module, site, kind)

    def _root_call_site(self, anomaly: Anomaly) -> None:
        """A value born in a root's own forward (a loss module's): note the user's line
        that called the root, whose arguments the fix may rewrite (``crit(torch.sigmoid(
        model(x)), y)``: the sigmoid taken out there). On the CPU, only while the root's
        call is still running (found in its own hooks): the frames below are its caller's;
        read late, from the frames kept as the call began. Anomaly time only."""
        call = self._trace.call(anomaly.record.call)
        if call is None or not call.root:
            return
        if self._read_late():
            self._late_call_site(anomaly, "root_call")
            return
        frame = self._root_frames.get(call.path)
        if frame is None or frame.call is not call:
            return
        f: Any = sys._getframe(1)
        for _ in range(64):  # nn.Module's call machinery running the root now
            if f is None or (
                f.f_code.co_filename.endswith(_MODULE_CALL)
                and f.f_locals.get("self") is frame.module
            ):
                break
            f = f.f_back
        else:
            return
        info = self._infos.get(frame.module)
        if f is not None and info is not None:
            self._note_call_site(info, frame.module, f, "root_call")

    def _own_writes(self, call: Call) -> list[str]:
        """The module's own floating buffers ``call`` wrote in place (so far, when open)."""
        for fr in self._stack:
            if fr.call is call:
                return fr.written()
        own = self._state_writes.get(call.id, [])
        if not self._late:
            return own
        # read after the calls ended (the accelerator path), a submodule whose inputs are
        # gone is replayed through the root that ran it: what that submodule wrote in place
        # is then the replayed call's state too, named from the replayed module
        trace = self._trace
        module = next((m for m, info in self._modules if info.path == call.path), None)
        if module is None:
            return own
        names = {id(m): n for n, m in module.named_modules()}
        found = list(own)
        for c in trace.calls:
            written = self._state_writes.get(c.id)
            if not written or c.id == call.id:
                continue
            up, seen = c.parent, set()
            while up is not None and up != call.id and up not in seen:
                seen.add(up)
                parent = trace.call(up)
                up = parent.parent if parent is not None else None
            sub = next((m for m, info in self._modules if info.path == c.path), None)
            if up != call.id or sub is None or id(sub) not in names:
                continue
            prefix = names[id(sub)]
            found += [f"{prefix}.{n}" if prefix else n for n in written if n not in found]
        return found

    def _overwritten_state(
        self, anomaly: Anomaly, target: Call, module: nn.Module, written: list[str]
    ) -> None:
        """A replay ran clean, but the forward wrote its own buffers in place (an EMA
        codebook ``self.embed.copy_(avg / count)``): the replay started from the values the
        forward left, not the ones it read, so it could not reproduce what it read. That is
        the module's state (NW405), not a transient fault: a value one forward wrote (a
        ``x / 0`` into a buffer) and the next one read."""
        kinds = anomaly.record.stat.kinds() if anomaly.record.stat is not None else "NaN/inf"
        bufs = dict(module.named_buffers())
        tensors = [
            {
                "name": n,
                "kind": "buffer",
                "stat": kinds,
                "dtype": dtype_name(bufs[n].dtype) if n in bufs else "",
            }
            for n in written
        ]
        self.note("module_state", target.path, tensors=tensors, overwritten=True)
        # a field, not words added to the summary: a later summary (the propagators counted
        # at the step's end) says it again
        anomaly.state_written = [f"{target.path}.{n}" for n in written]
        anomaly.summary = summarize(anomaly)

    def _pinpoint_own_backward(self, anomaly: Anomaly) -> None:
        """A gradient went bad in the backward of a module's own code, between its children
        (or in a module with no watched children, all its own code):
        the saved values that show why were freed as the backward ran, so the module is run
        again on its inputs and the backward of its own nodes checked node by node (see
        :func:`ops.own_backward_event`), as the loss code's nodes are on every step. A node
        its hook named already (a watched loss module's) is replaced by the replay's event
        of the same node, which has its forward line."""
        trace = self._trace
        if anomaly.origin == "module":
            # a module's own backward (a custom leaf that computes sqrt(sum((z - e) ** 2))
            # itself, a root's sqrt of a squared distance it gives its children): the replay
            # stops at its children's outputs, so only its own code is checked. Called once
            # in the step, so the call is known.
            calls = [c for c in trace.calls if c.path == anomaly.path]
            target = calls[0] if len(calls) == 1 and not calls[0].passthrough else None
            if target is None:
                return
        else:
            call = trace.call(anomaly.record.call)
            target = (
                trace.call(call.parent) if call is not None and call.parent is not None else None
            )
            # the child's output may be its parent's too (a Sequential's last child): the
            # code that used it is the ancestor's the localizer named, further up
            up = target
            while up is not None and up.path != anomaly.path and up.parent is not None:
                up = trace.call(up.parent)
            if up is not None and up.path == anomaly.path:
                target = up
        if target is None:
            return
        # read late (the accelerator path), backward has freed what it saved: an input only
        # its nodes held (a child's output, a checkpointed block's input) is made again from
        # the module that produced it, or the root's own inputs, checked against its records
        remake = anomaly.origin == "module" or self._late
        st = anomaly.record.stat
        held = frozenset(st.kinds().split(", ")) if st is not None and not st.finite else None
        ev = self._own_backward(target, target.path, remake=remake, held=held)
        if ev is None:
            return
        named = anomaly.op
        if named is not None and ev.node != named.node:
            return  # another node: the one its hook saw make the value stays
        at = next((i for i, o in enumerate(trace.ops) if o is named), None)
        if at is not None:
            trace.ops[at] = ev
        else:
            trace.ops.append(ev)
        anomaly.op = ev
        anomaly.summary = summarize(anomaly)

    def _pinpoint_named_node(self, anomaly: Anomaly) -> None:
        """Read late (the accelerator path), a node of a watched loss module's own code was
        named by its name alone (:meth:`_read_loss_nodes`: what it saved was freed before
        the read). That module's call is replayed as :meth:`_pinpoint_own_backward` replays
        one, and the node it finds, with what it saved, takes the name-only event's place,
        as the CPU path reads it in the node's hook. Anomaly-time work only."""
        ev = anomaly.op
        trace = self._trace
        if ev is None or ev.inputs or ev.output.numel:
            return  # no event, or one that read the node's values (numel 0: by name alone)
        if ev.phase is not Phase.BACKWARD or ev.path in (None, LOSS_PATH) or ev.node is None:
            return
        calls = [c for c in trace.calls if c.path == ev.path]
        if len(calls) != 1 or calls[0].passthrough:
            return  # called several times: which call made it is not known
        found = self._own_backward(calls[0], ev.path, remake=True)
        if found is None or found.node != ev.node:
            return  # another node: the flag named what the run made
        trace.ops[trace.ops.index(ev)] = found
        anomaly.op = found
        anomaly.summary = summarize(anomaly)

    def _pinpoint_param_backward(self, anomaly: Anomaly) -> None:
        """A parameter's gradient was the first bad value seen, the gradients of the
        watched modules' outputs finite: the backward of its module's own code (an svd or
        eigh of a weight at repeated singular values or eigenvalues) can make it from a
        finite gradient. That module's call is replayed as :meth:`_pinpoint_own_backward`
        replays one, and a node that makes it becomes the anomaly's op, as a traced one
        does in forensic mode (:func:`adopt_backward_op`). Anomaly-time work only."""
        trace = self._trace
        path = anomaly.record.path
        owner = next((m for m, info in self._modules if info.path == path), None)
        # its own module first, then the modules that hold it, innermost first: the code
        # of a parent that used the module's output (a root's ``acosh`` of a distance
        # between embeddings) is where the gradient went bad when no watched output
        # gradient between them carried it (sentinel watches the roots' alone)
        chain = [path]
        if owner is not None:
            holders = [
                (sum(1 for _ in m.modules()), info.path)
                for m, info in self._modules
                if m is not owner and any(x is owner for x in m.modules())
            ]
            chain += [p for _, p in sorted(holders)]
        # sentinel: the gradients of the submodules' outputs were not watched, so the
        # backward of those that ran between the parameter's module and the output (a
        # ``sqrt`` of a child at exactly 0) is checked with each holder's own, on the way
        # to the parameter alone, and a node is told as the innermost submodule that made it
        ends = [p for q, _, p in self._params if q == anomaly.record.role]
        for where in chain:
            calls = [c for c in trace.calls if c.path == where]
            if len(calls) == 1 and not calls[0].passthrough:
                ev = self._own_backward(
                    calls[0], where, remake=True, names=self._unhooked_path, ends=ends or None
                )
            elif not calls and not self._full:
                # sentinel: the module's calls are not watched; the root that holds it is
                # run again on its own inputs to give it its inputs
                ev = self._own_backward(
                    None, where, remake=False, names=self._unhooked_path, ends=ends or None
                )
            else:
                break  # called several times: which call made it is not known
            if ev is not None:
                trace.ops.append(ev)
                adopt_backward_op(anomaly, [ev])
                return
        if ends and not self._full:
            ev = self._loss_node_of_param(anomaly, ends[0])
            if ev is not None:
                trace.ops.append(ev)
                adopt_backward_op(anomaly, [ev])

    def _loss_node_of_param(self, anomaly: Anomaly, param: torch.Tensor) -> OpEvent | None:
        """Sentinel: no module's own backward, replayed, made the parameter's bad gradient,
        and the loss code's nodes are not checked as they run (watch checks them): the
        node of the loss code that made it, when the graph from the loss to ``param`` holds
        exactly one node whose backward can make a non-finite gradient from a finite one (a
        ``sqrt`` of a gradient penalty's norm at 0, see :data:`_RISKY_BACKWARD`), and it is
        in the loss code (not in a module's forward). Named with what it saved when that
        was kept as backward began (the accelerator path), else by its name alone: autograd
        freed it. None when the graph is gone, too large, or holds no such node or several.
        A walk of the graph: anomaly-time work only."""
        trace = self._trace
        if any(n.kind == "user_hook" and n.path == anomaly.record.path for n in trace.notes):
            return None  # a hook of the user's on it may have made it: no node is named
        loss = self._held_loss()
        if loss is None or loss.grad_fn is None:
            return None
        stop = self._recorded_nodes
        walk = ops.GraphWalk([loss.grad_fn], limit=_LOSS_NODES)
        nodes = list(walk)
        if walk.truncated:
            return None
        # the nodes whose gradient flows on to ``param`` other than through a watched
        # output, whose gradient was measured finite (else the anomaly would be there):
        # children before parents
        reach: set[int] = set()
        for node in _post_order(nodes):
            if ops.accumulates_grad(node):
                if getattr(node, "variable", None) is param:
                    reach.add(id(node))
            elif node not in stop and any(
                n is not None and id(n) in reach for n, _ in node.next_functions
            ):
                reach.add(id(node))
        risky = [n for n in nodes if id(n) in reach and _risky_backward(n)]
        if not risky or any(
            id(n) in reach and isinstance(n, torch.autograd.function.BackwardCFunction)
            for n in nodes
        ):
            # a custom Function's backward on the way is code of its own: it may have
            # made the NaN as well as the one op known to risk it
            return None
        if len(risky) > 1:
            # several (a group lasso's sqrt beside a norm): the one whose saved values, kept
            # as backward began, sit where its derivative is infinite
            return self._steep_loss_node(anomaly, among=risky) if self._loss_snaps else None
        node = risky[0]
        code = ops.GraphWalk(
            [loss.grad_fn],
            prune=lambda n: n in stop or ops.accumulates_grad(n),
            limit=_LOSS_NODES,
        )
        if not any(n is node for n in code):
            return None  # a module's forward made it: its replay is what names it
        name = ops.name_of(node)
        stat = anomaly.record.stat or TensorStat(math.nan, math.nan, 0)
        snap = next((s for _, _, s in self._loss_snaps if s.node is node), None)
        ev = self._saved_node_event(snap, name, stat, anomaly.record.dtype) if snap else None
        site = self._loss_site()
        if ev is None:
            ev = _node_event(name, LOSS_PATH, stat, anomaly.record.dtype, site)
        ev.path = LOSS_PATH
        line = ops.forward_line(snap if snap is not None else node)
        if line[0] is None:
            frame = None if self._late else _frames.user_frame()
            line = self._forward_line(node, frame) or _NO_LINE
        _place(ev, line, site)
        return ev

    def _inputs_from_root(
        self, path: str, *, grad: bool = False, redraw: bool = False
    ) -> tuple[nn.Module, Any, Any, bool | int] | None:
        """The module at ``path``, whose calls are not watched (sentinel mode hooks the
        roots alone), and its inputs, made again by running the root that holds it on that
        root call's own inputs, still alive and unchanged (see :meth:`_root_call_inputs`).
        None when it is not called exactly once there, or the root draws random numbers
        (dropout: other inputs) -- unless ``redraw``: the generators are then set back to
        their state as the root call began, when known, so it draws what it drew then.
        ``grad``: run with gradients on, so the inputs require gradients as the originals
        did. Anomaly-time work only."""
        owner = next((m for m, info in self._modules if info.path == path), None)
        if owner is None:
            return None
        found = next(
            (
                (c, f)
                for c in reversed(self._trace.calls)
                if c.root
                and (f := self._root_call_inputs(c)) is not None
                and any(m is owner for m in f[0].modules())
            ),
            None,
        )
        if found is None:
            return None
        root_call, (root, args, kwargs, hooks) = found
        devices = {t.device for _, t in self._walk(args, "input", kwargs)}
        seen: list[tuple[Any, Any]] = []

        def grab(_m: nn.Module, a: Any, kw: Any) -> None:
            seen.append((a, kw))

        # the last pre-hook: what the module's forward got
        handle = owner.register_forward_pre_hook(grab, with_kwargs=True)
        rng = self._call_rng(root_call) if redraw else None
        try:
            with ops.preserved_state(root, devices) as state, ops._replay_scope():
                # the generators as the root call began, when known: a dropout draws the
                # masks it drew then (see ops.replay's ``same_draws``)
                same = rng is not None and ops.set_rng_states(rng, devices)
                before = ops.rng_states(devices)
                # a root that differentiates itself (a PINN) runs again with gradients on
                ops.forward_again(
                    root,
                    args,
                    kwargs,
                    grad=grad,
                    state=state,
                    devices=devices,
                    pre_hooks=hooks,
                    modes=self._call_modes(root_call),
                    retry=seen.clear,
                )
                drew = ops.drew_random(before, devices)
                if drew and same and len(rng or ()) == 1:
                    drew = ops._host_drew(before)  # only the CPU generator was given back
                elif drew and same:
                    drew = False
        except Exception:  # a root that cannot run again here: nothing to replay
            return None
        finally:
            handle.remove()
        if drew or len(seen) != 1:
            return None
        return owner, seen[0][0], seen[0][1], False

    def _own_backward(
        self,
        target: Call | None,
        path: str,
        *,
        remake: bool,
        names: Callable[[nn.Module], str | None] | None = None,
        ends: Sequence[torch.Tensor] | None = None,
        held: frozenset[str] | None = None,
    ) -> OpEvent | None:
        """:func:`ops.own_backward_event` of the finished call ``target``, on its inputs
        if they are at hand (or, with ``remake``, made again); with no ``target``, of the
        module at ``path`` on inputs its root made again. None when it cannot run or finds
        no node. ``names`` and ``ends``: see :func:`ops.own_backward_event`."""
        if target is None:
            found = self._inputs_from_root(path)
        else:
            found = self._call_inputs(target, None, False, finished=True)
            if found is None and remake:
                found = self._recomputed_inputs(target)
            if found is None and remake:
                # an input the parent's own code made (``emb(tok) * mask``) and only the
                # backward held, freed by the time its gradient is seen: the root is run
                # again on its own inputs, and what the module got must match the records
                found = self._inputs_from_root(path, grad=True)
                if found is not None and not self._matches_inputs(target, found[1], found[2]):
                    found = None
        if found is None:
            return None
        module, args, kwargs, hooks = found
        # on accelerators the replay syncs at each op: anomaly-time work, once per module
        if _distributed() is not None:
            return None  # a replay on one rank could block in a collective (see _pinpoint)
        # the step's gradients at the call's outputs (their statistics): the replay seeds
        # its backward with them, so the kind it makes is the step's (see own_backward_event)
        grads = (
            {
                r.role: r.stat
                for r in self._trace.records
                if r.call == target.id and r.phase is Phase.BACKWARD and r.stat is not None
            }
            if target is not None
            else None
        )
        ev = ops.own_backward_event(
            module,
            args,
            kwargs,
            path=path,
            pre_hooks=hooks,
            names=names,
            ends=ends,
            grads=cast("dict[str, torch.Tensor | TensorStat] | None", grads),
            held=held,
        )
        if ev is None:
            return None
        ev.backward_at = _frames.user_line()[0]
        ev.by_grad = ops._by_grad(sys._getframe()) or self._grads_by_grad()
        if ev.cause is not None:
            ev.cause.path = ev.path
        return ev

    def _matches_inputs(self, call: Call, args: Any, kwargs: Any) -> bool:
        """``args`` and ``kwargs``, made again, are what ``call`` was given: every recorded
        input has a tensor of the same shape and range among them."""
        made = dict(self._walk(args, "input", kwargs))
        for rec in self._trace.inputs_of(call.id):
            t = made.get(rec.role)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(rec.shape):
                return False
            seen: Record | None = rec
            while seen is not None and seen.stat is None and seen.source is not None:
                seen = self._trace.record(seen.source)  # measured where it was made
            if seen is None or seen.stat is None or not (t.is_floating_point() or t.is_complex()):
                continue
            stat = describe(t.detach())
            if stat is None or (stat.min, stat.max) != (seen.stat.min, seen.stat.max):
                return False
        return True

    def _recomputed_inputs(self, call: Call) -> tuple[nn.Module, Any, Any, bool | int] | None:
        """The inputs of a finished ``call`` that are freed (an activation no backward node
        saved), made again by running the module that produced them on its own inputs,
        still alive (a Linear's input, saved for its weight's gradient) and unchanged:
        backward runs before the update, so its weights are those of the forward. Each made
        again must match the statistics recorded for it. Anomaly-time work only."""
        found = self._inputs_of_call(call, unchanged=True, remake=True)
        if found is None:
            return None
        _, module, args, kwargs = found
        return module, args, kwargs, self._pre_hooks_seen(module)

    def _remade_output(self, rec: Record) -> torch.Tensor | None:
        """``rec`` (a module's output) made again by its module, or None when that cannot be
        done faithfully (its inputs are gone, it draws random numbers, the values differ)."""
        producer = self._trace.call(rec.call)
        if rec.phase is not Phase.FORWARD or producer is None or rec.stat is None:
            return None
        found = self._inputs_of_call(producer, unchanged=True)
        if found is None:
            return None
        _, module, args, kwargs = found
        devices = {t.device for _, t in self._walk(args, "input", kwargs)}
        before = ops.rng_states(devices)
        try:
            with ops.preserved_state(module, devices) as state, ops._replay_scope():
                out = ops.forward_again(
                    module,
                    args,
                    kwargs,
                    grad=True,
                    state=state,
                    devices=devices,
                    pre_hooks=self._pre_hooks_seen(module),
                    modes=self._call_modes(producer),
                )
                drew = ops.drew_random(before, devices)
        except Exception:
            return None
        if drew:
            return None  # dropout: another mask, another value
        t = next((x for role, x in self._walk(out, "output") if role == rec.role), None)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(rec.shape):
            return None
        stat = describe(t.detach())
        if stat is None or (stat.min, stat.max) != (rec.stat.min, rec.stat.max):
            return None
        return t

    def _pre_hooks_seen(self, module: nn.Module) -> bool | int:
        """Which of ``module``'s forward pre-hooks a replay of the inputs this watcher's
        pre-hook recorded must run (see :func:`ops.call_forward`): those after it; none
        when the inputs were recorded by the forward hook (after every pre-hook)."""
        info = self._infos.get(module)
        if info is None or (info.post_only and not self._forensic):
            return False
        if self.global_hooks:
            return True  # a global pre-hook runs before every module's own
        return info.pre_id if info.pre_id is not None else False

    def _call_inputs(
        self,
        call: Call,
        current: tuple[Call, nn.Module, Any, Any] | None,
        pre_hooks: bool | int,
        *,
        finished: bool,
    ) -> tuple[nn.Module, Any, Any, bool | int] | None:
        """The module of ``call``, its inputs and which pre-hooks they went through: from
        ``current``, an open call's frame, or (``finished``) a finished call's inputs that
        are alive and unchanged since."""
        if current is not None and current[0] is call:
            return current[1], current[2], current[3], pre_hooks
        for fr in self._stack:
            if fr.call is call:
                return fr.module, fr.args, fr.kwargs, self._pre_hooks_seen(fr.module)
        if not finished or call.end < 0:
            return None
        rebuilt = self._inputs_of_call(call, unchanged=True)
        if rebuilt is None:
            return self._root_call_inputs(call)
        return rebuilt[1], rebuilt[2], rebuilt[3], self._pre_hooks_seen(rebuilt[1])

    def _root_call_inputs(self, call: Call) -> tuple[nn.Module, Any, Any, bool | int] | None:
        """A finished root ``call``'s own arguments (``model(z, pos, batch, 4, i, j)``: a
        non-tensor argument cannot be rebuilt from records), when every tensor among them
        was recorded and is unchanged since (same version counter)."""
        frame = self._root_frames.get(call.path)
        if frame is None or frame.call is not call or frame.inputs is None:
            return None
        now = tuple(_version(t) for _, t in self._walk(frame.args, "input", frame.kwargs))
        if now != frame.inputs or None in now:
            return None
        return frame.module, frame.args, frame.kwargs, self._pre_hooks_seen(frame.module)

    def _blame_weights(self, anomaly: Anomaly, module: nn.Module) -> bool:
        """The replay made the non-finite output again with no op creating it, and the
        module holds non-finite parameters nanwatch does not watch (a submodule assigned
        after attach, a ``torch.jit`` one): they are watched from now on, and the step is
        localized again, on them (NW301). Returns whether it moved."""
        info = self._infos.get(module)
        if info is None:
            return False
        base = "" if info.is_root else info.path
        added: list[tuple[str, str, nn.Parameter]] = []
        types: list[str] = []
        for name, p in module.named_parameters():
            if id(p) in self._param_ids or _finite(p.detach()):
                continue
            sub, _, _ = name.rpartition(".")
            qual = f"{base}.{name}" if base else name
            owner = f"{base}.{sub}" if base and sub else (sub or info.path)
            added.append((qual, owner, p))
            types.append(type(module.get_submodule(sub)).__name__ if sub else info.type_name)
        if not added:
            return False
        self._params = [*self._params, *added]
        self._param_ids = frozenset(id(p) for _, _, p in self._params)
        self._param_types = [*self._param_types, *types]
        self._weighed.update(id(p) for _, _, p in added)  # read: their -inf is no constraint
        trace = self._trace
        self._forget(trace, anomaly)
        moved = self._localize(trace)
        if moved is None or moved.kind is not AnomalyKind.PARAMETER:
            # not re-localized on them: the first anomaly stands, with what the replay read
            if moved is not None:
                self.anomalies.remove(moved)
                if self.first_anomaly is moved:
                    self.first_anomaly = None
            trace.anomaly = anomaly
            self.anomalies.append(anomaly)
            if self.first_anomaly is None:
                self.first_anomaly = anomaly
            return False
        return True

    def _pinpoint_neginf(
        self,
        anomaly: Anomaly,
        replayed: Call | None,
        current: tuple[Call, nn.Module, Any, Any] | None,
        pre_hooks: bool | int,
    ) -> None:
        """A -inf the anomaly grew out of was first seen in another module's output (or
        in a value a parent's code passed on): replay the code that made it too, so the op
        that made the -inf (a log of 0, erfinv of -1, a mask) is known, and link it as the
        cause of the first op of the anomaly's chain."""
        src = anomaly.neginf_source
        if src is None or anomaly.kind is not AnomalyKind.FORWARD:
            return
        trace = self._trace
        maker = trace.call(src.call)
        if src.phase is Phase.INPUT:  # measured there: the code of the caller made it
            if maker is None or maker.root or maker.parent is None:
                return  # data
            maker = trace.call(maker.parent)
        elif src.phase is not Phase.FORWARD:
            return
        if maker is None or maker is replayed or maker.path == LOSS_PATH:
            return
        found = self._call_inputs(maker, current, pre_hooks, finished=True)
        if found is None:
            return
        module, args, kwargs, hooks = found
        if _distributed() is not None:
            return  # a replay on one rank could block in a collective (see _pinpoint)
        result = self._replay_of(maker, module, args, kwargs, hooks)
        made = next((e for e in result.events if "-inf" in e.born), None)
        if made is None:  # a complex value is measured by |z|: a -inf part (the log of a
            # complex 0, -inf + 0j) is told as +inf, and view_as_real passes the -inf on
            made = next(
                (e for e in result.events if e.dtype.startswith("complex") and "+inf" in e.born),
                None,
            )
        if made is None:
            return
        trace.ops.extend(result.events)
        if anomaly.op is None:
            if replayed is None:  # the loss code's graph named no op: the -inf's maker
                anomaly.op = made
            return
        oldest = anomaly.op.chain()[0]
        given = any(s is not None and s.has_neginf for _, s in oldest.inputs)
        if oldest is not made and oldest.cause is None and given:
            oldest.cause = made

    def _blame_unmeasured_of(
        self, anomaly: Anomaly, meant: Call, target: Call, args: Any, kwargs: Any
    ) -> bool:
        """:meth:`_blame_unmeasured` for ``meant``, replayed clean as ``target`` on ``args``.
        Read late, with ``meant``'s inputs gone, its root ran in its place (``target``): the
        inputs ``meant`` got are made again by running that root once more, so a NaN one
        that no record measured (a LayerNorm's, freed by backward) is told as on the CPU,
        where the call's own inputs were at hand. Anomaly-time work only."""
        if target is meant:
            return self._blame_unmeasured(anomaly, target, args, kwargs)
        # the step's weights (no update applied since: see _flush), the root's own inputs
        # unchanged, its draws the original ones (see _inputs_from_root): what the call got
        remade = self._inputs_from_root(meant.path)
        redrawn = remade is None
        if redrawn:  # a dropout: the generators set back, it draws what it drew then
            remade = self._inputs_from_root(meant.path, redraw=True)
        if remade is None:
            return False
        # either way the root ran the original computation: its replay (with the original
        # draws, see _call_rng) makes the producer's freed inputs again
        return self._blame_unmeasured(
            anomaly, meant, remade[1], remade[2], remade_root=True, redrawn=redrawn
        )

    def _blame_unmeasured(
        self,
        anomaly: Anomaly,
        call: Call,
        args: Any,
        kwargs: Any,
        *,
        remade_root: bool = False,
        redrawn: bool = False,
    ) -> bool:
        """The replay made nothing because the module was given a NaN: an input that no
        record measured (the output of a module whose magnitude nanwatch bounds by its input
        instead of reading it, a LayerNorm whose variance overflowed in float32). That
        producer's output is measured now, the step is localized again (the anomaly moves
        to it) and the producer is replayed in turn. Returns whether it moved.
        ``remade_root``: ``args`` were made again by a run of the root that drew no random
        numbers, or drew them again from the generators' state as it began (``redrawn``;
        read late: see :meth:`_blame_unmeasured_of`), whose replay, in place of the
        producer's freed inputs, is its computation too. Redrawn, an op whose value came
        from another unmeasured module (a Dropout's ``inf * 0`` of a pool's inf) is not
        taken: the range of modules that could have made it is named, as on the CPU."""
        trace = self._trace
        inputs = {r.role: r for r in trace.inputs_of(call.id)}
        for role, t in self._walk(args, "input", kwargs):
            rec = inputs.get(role)
            if rec is None or not (t.is_floating_point() or t.is_complex()) or _finite(t):
                continue
            producer: Record | None = None
            cur: Record | None = rec
            while cur is not None and cur.stat is None and cur.source is not None:
                cur = trace.record(cur.source)
                if cur is not None and cur.phase is Phase.FORWARD and cur.stat is None:
                    producer = cur
                    break
            if producer is None:
                continue
            producer.stat = describe(t.detach()) or TensorStat(math.nan, math.nan, t.numel())
            self._forget(trace, anomaly)
            moved = self._localize(trace)
            if moved is None:
                return False
            found = self._replay_args(moved)
            if found is not None:
                self._pinpoint(moved, found, pre_hooks=self._pre_hooks_seen(found[1]))
            elif remade_root:  # read late, its input freed: its root runs again
                self._pinpoint(moved, None)  # (see _late_inputs)
                cause = moved.op.cause if moved.op is not None else None
                inside = (
                    cause is not None
                    and cause.path is not None
                    and (cause.path == moved.path or cause.path.startswith(moved.path + "."))
                )
                if redrawn and cause is not None and not inside:
                    moved.op = None  # made of a value born before this module
                    moved.summary = summarize(moved)
                if trace.anomaly is moved and moved.op is None:
                    self._name_unmeasured_range(trace, moved)
            else:
                self._name_unmeasured_range(trace, moved)
            return True
        return False

    def _name_unmeasured_range(self, trace: StepTrace, anomaly: Anomaly) -> None:
        """A forward anomaly moved onto a module nanwatch did not measure and cannot replay
        (its input is freed): the value may have been born in any unmeasured module between
        the last measured record and it. With more than one that could make it (not
        ReLU-like), the summary names them all rather than the last."""
        call = trace.call(anomaly.record.call)
        chain: list[Call] = []
        measured: Call | None = None
        seen: set[int] = set()
        while call is not None and call.id not in seen and call.passthrough:
            seen.add(call.id)
            chain.append(call)
            nxt: Call | None = None
            for r in trace.inputs_of(call.id):
                src = trace.record(r.source) if r.source is not None else None
                while src is not None and src.phase is Phase.INPUT and src.source is not None:
                    src = trace.record(src.source)
                if src is None or src.phase is not Phase.FORWARD:
                    continue
                owner = trace.call(src.call)
                if owner is None:
                    continue
                if src.stat is not None:
                    measured = owner
                else:
                    nxt = owner
                break
            call = nxt
        suspects = [c for c in reversed(chain) if c.module_type not in _PASSTHROUGH_NAMES]
        if measured is None or len(suspects) < 2:
            return
        names = ", ".join(f"{c.path} ({c.module_type})" for c in suspects)
        head, sep, tail = anomaly.summary.partition(" [")
        if " born in the forward of " not in head:
            return
        what = head.split(" born in the forward of ", 1)[0]
        anomaly.summary = (
            f"{what} born in the forward of one of {names}, after the finite output of "
            f"{measured.path} ({measured.module_type}) (their outputs are not measured); "
            "mode='forensic' names the op"
            f"{sep}{tail}"
        )

    def _replay_args(self, anomaly: Anomaly) -> tuple[Call, nn.Module, Any, Any] | None:
        """The call, module and a finished call's inputs (those still alive) of a forward
        anomaly's module, to replay it after its call ended."""
        call = self._trace.call(anomaly.record.call)
        if call is None or anomaly.kind is not AnomalyKind.FORWARD:
            return None
        return self._inputs_of_call(call)

    def _inputs_of_call(
        self, call: Call, *, unchanged: bool = False, remake: bool = False
    ) -> tuple[Call, nn.Module, Any, Any] | None:
        """The call, module and inputs (those still alive; ``unchanged``: and not written in
        place since they were recorded) of a finished call, as its records hold them;
        ``remake``: an input that is gone is made again by the module that produced it
        (:meth:`_remade_output`)."""
        trace = self._trace
        if not call.rebuildable:
            return None  # an argument no record holds (a bool mask, a number, a keyword)
        module = next((m for m, info in self._modules if info.path == call.path), None)
        if module is None:
            return None
        alive = {
            entry[1]: t
            for entry in self._known.values()
            if (t := entry[0]()) is not None and not (unchanged and _version(t) != entry[2])
        }
        args: list[torch.Tensor] = []
        for r in trace.inputs_of(call.id):
            if not r.role.startswith("input["):
                return None  # keyword inputs: not rebuilt
            key = r.source if r.source is not None else r.index
            if r.grad_fn is not None:
                # a root's input computed from a watched output (``p[keep]``, ``h / h.norm()``)
                # names that output as its source, another tensor: only its own record is it
                key = r.index
            t = alive.get(key)
            if t is None and remake:
                src = trace.record(key)
                t = self._remade_output(src) if src is not None else None
            if not isinstance(t, torch.Tensor):
                return None
            args.append(t)
        return (call, module, tuple(args), {}) if args else None

    def _pinpoint_derived_input(
        self, anomaly: Anomaly, current: tuple[Call, nn.Module, Any, Any] | None
    ) -> None:
        """The -inf a root's forward grew its NaN out of was first seen in that root's
        input, computed by the user's code from a watched output (``logits / temperature``
        between a model and its loss): the autograd graph below that input is read, as the
        loss code's is, and the op that made the inf (a division by 0) becomes the cause of
        the forward's op."""
        src = anomaly.neginf_source
        if src is None and anomaly.origin == "between-roots":
            # a NaN born in the user's code between two roots (w / w.norm() of a zero row
            # of a hypernetwork's output, then used in a matmul): the node that made the
            # value the anomaly's record holds is found below it
            src = anomaly.record
        if src is None or src.phase is not Phase.INPUT or src.grad_fn is None:
            return
        call = self._trace.call(src.call)
        if call is None or not call.root or src.source is None:
            return
        found = self._call_inputs(call, current, False, finished=True)
        if found is None:
            return
        _, args, kwargs, _ = found
        t = next((x for role, x in self._walk(args, "input", kwargs) if role == src.role), None)
        if t is None or t.grad_fn is None:  # (reading the graph's values syncs on accelerators:
            return  # anomaly-time work)
        # read late, after backward freed what the graph's nodes saved: as it stood then
        with ops.saved_from(self._input_snaps if self._late else []):
            self._derived_graph_op(anomaly, src, t)

    def _derived_graph_op(self, anomaly: Anomaly, src: Record, t: torch.Tensor) -> None:
        """See :meth:`_pinpoint_derived_input`: the op below ``t`` (``src``'s value)."""
        if src is anomaly.record:
            stop, value = self._graph_stops(t)
            birth = ops.birth_event(t.grad_fn, stop=stop, values=value)
            if birth.event is None:
                if birth.carried:
                    anomaly.summary += (
                        f" ({src.grad_fn} only carried it: its operands held it already; the "
                        f"op that made it is not known in {self.config.mode} mode)"
                    )
                return
            events = [birth.event]
        else:
            _, events = self._graph_evidence(t)
        if not events:
            return
        made = events[0]
        made.path = LOSS_PATH
        self._trace.ops.extend(events)
        if anomaly.op is None:
            anomaly.op = made
        else:
            oldest = anomaly.op.chain()[0]
            if oldest is not made and made not in anomaly.op.chain():
                oldest.cause = made
        anomaly.summary = summarize(anomaly)

    def _watched_values(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The step's watched values still alive, other than ``t``, that autograd made: the
        nodes where a walk of the graph below ``t`` ends (see :meth:`_graph_stops`)."""
        alive = (ref() for ref, *_ in self._known.values())
        return [x for x in alive if x is not None and x is not t and x.grad_fn is not None]

    def _graph_stops(
        self, t: torch.Tensor
    ) -> tuple[Callable[[Any], bool], Callable[[Any], torch.Tensor | None]]:
        """Where a walk of the graph below ``t`` ends (the nodes of the watched values
        other than ``t``), and the watched value each of those nodes made."""
        stop: dict[int, Any] = {}  # the nodes held, so their ids stay theirs
        made: dict[int, torch.Tensor] = {}  # and the watched outputs they made
        for x in self._watched_values(t):
            fn = x.grad_fn
            stop[id(fn)] = fn
            made[id(fn)] = x

        def value(n: Any) -> torch.Tensor | None:
            return made.get(id(n)) if stop.get(id(n)) is n else None

        if self._late and self._late_stops:
            # read after backward: the watched values alive as backward began ended the walk
            # then, and end it now, dropped since or not (a function's local)
            for fn in self._late_stops:
                stop.setdefault(id(fn), fn)
        if not self._reading_after_update:
            return (lambda n: stop.get(id(n)) is n), value
        # read after an update (see _pinpoint_loss_after_update): a watched output the user
        # dropped since (a closure's local) still ends the walk, at the node that made it,
        # with no value to tell: below it are the modules' weights, which the update wrote
        recorded, own = self._recorded_nodes, t.grad_fn
        return (lambda n: stop.get(id(n)) is n or (n is not own and n in recorded)), value

    def _graph_evidence(
        self,
        t: torch.Tensor,
        logs: list[list[str]] | None = None,
        powers: list[list[str]] | None = None,
    ) -> tuple[list[str], list[OpEvent]]:
        """:func:`ops.graph_evidence` below ``t``'s node, down to the watched outputs."""
        stop, value = self._graph_stops(t)
        return ops.graph_evidence(
            t.grad_fn,
            stop=stop,
            output=t,
            values=value,
            logs=logs,
            # forensic traced the op that read it, a guard measured the target: NW401 says it
            unsaved=not self._forensic and not self._guarded_bad_target(),
            powers=powers,
        )

    def _guarded_bad_target(self) -> bool:
        """A guarded loss call of this step measured a target holding NaN or inf (its
        ``loss_input`` note): the data story (NW401) is told from it."""
        for n in self._trace.notes:
            if n.kind != "loss_input":
                continue
            for key in ("target_min", "target_max"):
                v = n.data.get(key)
                if isinstance(v, (int, float)) and not math.isfinite(v):
                    return True
        return False

    def _pinpoint_loss(self, anomaly: Anomaly, loss: torch.Tensor) -> None:
        """The loss code is not a module and cannot be re-run; its autograd graph can be
        read: the ops it ran and the saved inputs that were outside an op's domain."""
        logs: list[list[str]] = []
        powers: list[list[str]] = []
        names, events = self._graph_evidence(loss, logs, powers)
        source, _ = self._loss_site() if self._late else _frames.user_line()
        via = self._backward_via  # a helper of the user's that ran backward(): its caller
        by_grad = ops._by_grad(sys._getframe()) or self._grads_by_grad() or self._loss_by_grad
        for ev in events:
            ev.path = LOSS_PATH
            ev.backward_at = source
            ev.by_grad = by_grad
        self._trace.ops.extend(events)
        data: dict[str, Any] = {"ops": names[:32], "logs": logs[:8]}
        if powers:  # log(1 - p) * p ** 2: a focal weight, not a plain cross-entropy
            data["powers"] = powers[:8]
        if not anomaly.record.stat or not anomaly.record.stat.finite:
            stop, _ = self._graph_stops(loss)
            picked = ops.graph_selections(loss.grad_fn, stop=stop)
            if picked:  # a gather that picked an infinity its source held (a masked entry)
                data["selections"] = picked[:4]
            emptied = ops.graph_emptied_rows(loss.grad_fn, stop=stop)
            if emptied:  # a logsumexp of a row a mask left empty: -inf, +inf once subtracted
                data["emptied"] = emptied[:4]
        self.note("loss_graph", LOSS_PATH, source=source, **data)
        self._note_zero_params(loss)
        if not events and anomaly.record.stat is not None and anomaly.record.stat.has_posinf:
            self._note_weight_sums(loss)
        if events:
            anomaly.op = forward_birth(events)  # not a sqrt of 0 before the log of it
            self._replay_roots_for(anomaly)
        if source:
            base = anomaly.summary.split(" [")[0]
            # the graph is read at backward(): its nodes keep no forward line, so the line
            # named is the backward call's, not the op's (forensic mode traces the op's)
            op = anomaly.op
            unknown = op is None or not op.source or op.source == source
            hint = (
                f"; the op's line is not known in {self.config.mode} mode: mode='forensic' "
                "or nw.replay(step_fn) names it"
                if unknown and not self._forensic
                else ""
            )

            if _frames.framework_between():  # Lightning's backward; the user's trainer.fit
                anomaly.summary = f"{base} (backward by Lightning, called from {source}{hint})"
            else:
                via = f", in {via}" if via else ""
                call = "torch.autograd.grad(loss, ...)" if by_grad else "loss.backward()"
                anomaly.summary = f"{base} ({call} at {source}{via}{hint})"
        anomaly.summary = summarize(anomaly)

    def _note_zero_params(self, loss: torch.Tensor) -> None:
        """A ``"zero_param"`` note for each watched parameter that holds exact zeros and
        reaches a log of ``loss``'s graph through a product or a view (``gain *
        softplus(z)`` with ``gain`` at 0; see :mod:`nanwatch._zero_params`), with what wrote
        it there when that is told. Anomaly-time work only: reads the parameters."""
        from nanwatch import _zero_params  # anomaly-time only

        if loss.grad_fn is None:
            return
        try:
            names = {id(p): q for q, _, p in self._params}
            paths = {q: path for q, path, _ in self._params}
            found = _zero_params.zero_params(loss.grad_fn, names)
            if not found:
                return
            frame = _frames.user_frame()
            held = self._loss_held[0] if self._loss_held is not None else None
            code = frame.f_code if frame is not None else held

            def optimizer_of(p: torch.Tensor) -> Any:
                ref = self._stepped_by.get(id(p))
                return ref() if ref is not None else None

            for f in found[:4]:
                data = _zero_params.note_data(
                    f,
                    frame_code=code,
                    stepped=(self._stepped, self._stepped_prev),
                    optimizer_of=optimizer_of,
                )
                self.note("zero_param", paths.get(f["parameter"], ""), **data)
        except Exception:  # an unusual graph or source: no more evidence, nothing lost
            return

    def _note_weight_sums(self, loss: torch.Tensor) -> None:
        """A ``"weight_sum"`` note for each full sum in ``loss``'s graph of a power, a
        self-product or an absolute value of a watched float16 parameter (a weight penalty
        written by hand; see :mod:`nanwatch._penalty`), with the sum it made. Anomaly-time
        work only: reads the parameters."""
        from nanwatch import _penalty  # anomaly-time only

        if loss.grad_fn is None:
            return
        try:
            names = {id(p): q for q, _, p in self._params}
            paths = {q: path for q, path, _ in self._params}
            for f in _penalty.weight_sums(loss.grad_fn, names)[:64]:
                self.note("weight_sum", paths.get(f["parameter"], ""), **f)
        except Exception:  # an unusual graph: no more evidence, nothing lost
            return

    def _replay_roots_for(self, anomaly: Anomaly) -> None:
        """The loss code's graph names the op that made the value (``aten.mean`` of an empty
        selection), but no watched call returned that value: it may be one a root's forward
        made and kept aside (``self.aux = ...``), which the loss then read. Each root call of
        the step is replayed on its own inputs, every op checked, with its random draws; the
        first whose replay makes the same op's non-finite value from finite operands ran it:
        the op gets that root's path and its line. Anomaly time only, once a run for each
        root; not where the weights moved since the call, nor in a distributed run (a root's
        forward may run a collective)."""
        op = anomaly.op
        if op is None or op.phase is not Phase.FORWARD or self._forensic:
            return
        if not self.config.pinpoint or _distributed() is not None:
            return
        name = ".".join(op.op.split(".")[:2])  # aten.mean (the graph knows no overload)
        for call in self._trace.calls:
            if not call.root or call.is_loss or call.end < 0:
                continue
            if call.path in self._kept_aside_replayed:
                continue
            frame = self._root_frames.get(call.path)
            if frame is None or frame.call is not call:
                continue
            if frame.weights is not None and frame.weights != self._weight_versions():
                continue  # read late, after an update: the replay would compute anew
            found = self._root_call_inputs(call)
            if found is None:
                continue
            self._kept_aside_replayed.add(call.path)
            module, args, kwargs, hooks = found
            result = self._replay_of(
                call,
                module,
                args,
                kwargs,
                hooks,
                call_site=self._call_line(module) or self._late_line(call),
                rng=self._call_rng(call),
            )
            first = result.first()
            if first is None or ".".join(first.op.split(".")[:2]) != name:
                continue
            if first.born != op.born or result.new_draws:
                continue  # another value, or other draws: not shown to be the same op
            self._trace.ops.extend(result.events)
            first.backward_at = op.backward_at
            anomaly.op = first
            return

    def _front_words(self, summary: str) -> str:
        """``summary``'s hints in the words of what the user runs: ``nanwatch run``'s options,
        the Lightning callback's arguments, else ``watch()``'s."""
        if self.global_hooks:  # nanwatch run: no nw, no step_fn
            from nanwatch.rules.base import cli_words

            return cli_words(summary)
        if self.front == "lightning":
            from nanwatch.rules.base import lightning_words

            return lightning_words(summary)
        return summary

    def _evaluate(self, trace: StepTrace) -> list[Diagnosis]:
        from nanwatch.rules import evaluate

        marked = self._marked_from
        if (
            trace.anomaly is not None
            and marked is not None
            and trace.step >= marked
            and not any(n.kind == "step_marked" for n in trace.notes)
        ):  # the rules read step boundaries as the user's, not the automatic rule's
            trace.notes.append(Note(kind="step_marked", path="step()"))
        history = [t for t in self.history if t.step < trace.step]
        found = evaluate(
            trace,
            history,
            self.config.thresholds,
            ignore=self.config.ignore,
            disabled=self._disabled_rules,
            facts={
                "scaler": self._scaled,
                "mode": self.config.mode,
                "ring_size": self.config.ring_size,
                "front": self.front,
                "forward_params": _ForwardParams(self._modules),
                "weight_scales": self._attach_scales,
                "weight_norms": _WeightNorms(self),
                "param_shapes": _ParamShapes(self._params),
                "module_precision": _ModulePrecision(self._modules),
                "module_training": _ModuleTraining(self._modules),
            },
        )
        if trace.anomaly is not None:
            trace.anomaly.summary = self._front_words(trace.anomaly.summary)
        if any(d.fix for d in found):
            try:
                self._in_users_names(found, trace)
            except Exception as exc:  # the fixes keep their generic names
                self._fault("rules", "user's names in fixes", exc)
        return found

    def _in_users_names(self, diagnoses: list[Diagnosis], trace: StepTrace | None = None) -> None:
        """The rules write fixes for a model called ``model``, an optimizer called
        ``optimizer`` and a loss called ``criterion`` where they cannot know better. The
        user's code (the frames that ran into the anomaly, innermost first: the model's
        forward, then the training loop that called it, each with its ``self`` and its
        module's globals) holds the watched model, its optimizer and its loss under its own
        names: the innermost frame that holds one names it in the fixes' code, unless that
        frame also defines the generic name. Comments are left as they are.

        Read after the calls (the accelerator path, the post-mortem), the line that called
        the model has moved on: the user's frame kept as the anomaly's root call began (or,
        for the loss code, as backward() began on it) comes first, as it would at the call
        (``trace``: the step read)."""
        frames: list[Any] = []
        anomaly = trace.anomaly if trace is not None else None
        if anomaly is not None and trace is self._trace:
            call = trace.call(anomaly.record.call)
            while call is not None and not call.root and call.parent is not None:
                call = trace.call(call.parent)
            site = self._late_site(call) if self._read_late() else None
            if site is None and self._loss_at is not None and self._loss_at[0] is call:
                site = self._loss_at[1]  # the loss code's: where backward() ran on it
            at_call = _frames.user_frame(site) if site is not None else None  # type: ignore[arg-type]
            if at_call is not None:
                frames.append(at_call)
        frame = _frames.user_frame(sys._getframe(1))
        while frame is not None and len(frames) < 32:
            frames.append(frame)
            frame = _frames.user_frame(frame.f_back)

        def scopes(f: Any) -> list[Any]:
            local = f.f_locals
            attrs = getattr(local.get("self"), "__dict__", None)
            return [n for n in (local, attrs, f.f_globals) if hasattr(n, "items")]

        roots = [(m, info) for m, info in self._modules if info.is_root]
        if not any(info.is_loss for _, info in roots) and not any(
            "criterion" in names for f in frames for names in scopes(f)
        ):
            # no loss module watched and no ``criterion`` in the user's code: a template's
            # ``loss = criterion(model(x), y)`` would call a name that does not exist
            for d in diagnoses:
                if d.fix and "criterion(" in d.fix:
                    d.fix = _without_criterion(d.fix, self._backward_site[0])
        if not frames:
            return

        wanted: dict[str, Any] = {}
        # one watched model, one loss: with several (a backbone and a head), "model" is
        # their composition, which has no name of its own
        models = [m for m, info in roots if not info.is_loss]
        if len(models) > 1:  # a loss written as a plain Module (no weights) is no model
            watched_ids = self._param_ids
            models = [m for m in models if any(id(p) in watched_ids for p in m.parameters())]
        losses = [m for m, info in roots if info.is_loss]
        if len(models) == 1:
            wanted["model"] = models[0]
        if len(losses) == 1:
            wanted["criterion"] = losses[0]
        watched = self._param_ids
        optimizers: dict[int, Any] = {}  # each one that steps watched weights, first found first
        for f in frames:
            for names in scopes(f):
                for value in list(names.values()):
                    if (
                        isinstance(value, torch.optim.Optimizer)
                        and id(value) not in optimizers
                        and any(id(p) in watched for g in value.param_groups for p in g["params"])
                    ):
                        optimizers[id(value)] = value
                        wanted.setdefault("optimizer", value)
        if "optimizer" not in wanted:
            # none steps the watched weights: the one built on another instance of the
            # model (NW315), whose variable the fix assigns again
            foreign = [r() for r, _, same in self._foreign.values() if same]
            if len(foreign) == 1 and foreign[0] is not None:
                wanted["optimizer"] = foreign[0]

        def defined_in(f: Any) -> set[str]:
            names = {k for names in scopes(f) for k in names if isinstance(k, str)}
            if isinstance(f, _FrameAt) and not f.running:
                # kept as the call began and returned since, its locals are gone; its code
                # still says which names are its own (a helper's ``model`` argument)
                names |= set(f.f_code.co_varnames) | set(f.f_code.co_cellvars)
            return names

        def users_name(generic: str, obj: Any) -> str | None:
            inner: set[str] = set()  # names of the frames nearer the anomaly than this one
            for f in frames:
                defined = defined_in(f)
                name = _name_in_frame(f, obj)
                if name is None:
                    inner |= defined
                    continue
                # (defined, here or in a frame nearer the anomaly: the user's code may mean
                # its own ``model``, a helper's argument that is a copy of the watched one)
                if name != generic and generic not in defined and generic not in inner:
                    return name
                return None
            return None

        renames: dict[str, str] = {}
        for generic, obj in wanted.items():
            name = users_name(generic, obj)
            if name is not None:
                renames[generic] = name
        # several optimizers (a GAN's G and D), several models: each fix names the one
        # that holds the weights its diagnosis is about, and no optimizer when none is known
        # (a fix that watches or replays keeps ``model``: all that is watched)
        several = {
            generic: objs
            for generic, objs in (("optimizer", list(optimizers.values())), ("model", models))
            if len(objs) > 1
        }
        if not renames and not several:
            return
        everyone = list(optimizers.values())
        for d in diagnoses:
            if d.fix:
                here = dict(renames)
                for generic, objs in several.items():
                    if generic == "model" and ("nanwatch." in d.fix or "nw." in d.fix):
                        continue
                    owner = self._owner_of(d, objs)
                    if generic == "model" and owner is not None:
                        # the model its optimizer trains alone (a GAN's G): with one
                        # optimizer over several models, ``model`` is their composition
                        trains = self._owner_of(d, everyone)
                        held = {id(p) for p in owner.parameters()}
                        if trains is None or not all(
                            id(p) in held for g in trains.param_groups for p in g["params"]
                        ):
                            owner = None
                    name = users_name(generic, owner) if owner is not None else None
                    if name is not None:
                        here[generic] = name
                    elif generic == "optimizer":
                        here.pop(generic, None)
                # a name on the user's own line is the user's (a helper's ``model`` argument,
                # not the watched model's name in the loop that called it)
                own = _names_on_line(d.source)
                kept = {k: v for k, v in here.items() if k not in own}
                if kept:
                    d.fix = _renamed(d.fix, kept)

    def _owner_of(self, d: Diagnosis, objs: list[Any]) -> Any:
        """The one of ``objs`` (optimizers, or models) that holds the weights ``d`` is about:
        its ``parameter``, else the weights of the module at its ``path``; None when no one
        of them holds them all, or ``d`` names no weight of the watched model."""
        params = [p for q, _, p in self._params if q == d.parameter]
        if not params and d.path:
            params = [p for q, _, p in self._params if q.startswith(d.path + ".")]
        if not params:
            return None
        ids = {id(p) for p in params}
        owners = []
        for obj in objs:
            if isinstance(obj, torch.optim.Optimizer):
                held = {id(p) for g in obj.param_groups for p in g["params"]}
            else:
                held = {id(p) for p in obj.parameters()}
            if ids <= held:
                owners.append(obj)
        return owners[0] if len(owners) == 1 else None

    def _act(self, trace: StepTrace, *, kept: StepTrace | None = None) -> None:
        """Apply ``on_anomaly`` once per step, to a localized anomaly or an error-severity
        diagnosis; say each early warning once. ``kept``: the first bad step before
        ``trace`` ended (see :meth:`_earlier_elsewhere`)."""
        if self._quiet or self._acted_step == trace.step:
            return
        self._announce(trace)
        anomaly = trace.anomaly
        errors = [d for d in trace.diagnoses if d.severity == "error"]
        if anomaly is None and not errors:
            return
        self._acted_step = trace.step
        message = self._message(trace)
        policy = self.config.on_anomaly
        if policy == "raise":
            if self._forensic and torch.is_anomaly_enabled():
                # raised inside backward, anomaly mode would add "Error detected in
                # <the node whose hook raised>" with that node's forward stack: the wrong
                # place. The next step (or detach) puts it back.
                self._anomaly_paused = True
                torch.autograd.set_detect_anomaly(False)
            err = AnomalyError(message, anomaly=anomaly, diagnoses=trace.diagnoses)
            err._nanwatch_owner = id(self)  # type: ignore[attr-defined]  # see _on_exception
            if anomaly is not None and self._read_late():
                earlier = self._earlier_elsewhere(trace, anomaly, kept)
                if earlier is not None:
                    raise earlier
            raise err

        if policy == "warn" and not self._warned:
            self._warned = True
            # safe: under -W error (a CI smoke test) the warning would raise inside a hook,
            # read as nanwatch's own fault, and switch the hook off for the rest of the run;
            # on_anomaly="warn" asked to go on, so it goes to stderr then
            _frames.warn_at_user(message, safe=True)

    def _earlier_elsewhere(
        self, trace: StepTrace, mine: Anomaly, kept: StepTrace | None
    ) -> AnomalyError | None:
        """Read late (before an update, at a step's end or the exit), ``mine`` is about to
        be raised; another watcher attached on this thread (nested watchers: a GAN's
        generator and discriminator, which see the same tensors) may hold unread statistics
        of the same step. On the CPU the first hook to see a bad value raised, and stopped
        the other watcher's run: so the others read theirs now, without acting, and the
        anomaly whose first bad record was made first is raised. When another's came
        first, this watcher takes back its own (``kept``: its first bad step before
        ``trace`` ended) and that one's error is returned; otherwise the others take back
        what they found, as they would when this one's error stops them."""
        if mine.record.seq < 0 or self._in_backward:
            return None  # inside backward: the hook that sees it first raises, as on the CPU
        here = threading.get_ident()
        found: list[tuple[Watcher, Anomaly]] = []
        for w in sorted(_live, key=lambda w: w._attach_order):
            held = w._trace.anomaly  # found already: its own step end acts on it
            if (
                w is self
                or not w._attached
                or w._forked
                or w._in_backward
                or w._thread != here
                or not w._read_late()
                or w.config.on_anomaly != "raise"
                or held is not None
            ):
                continue
            try:
                w._late_trigger(act=False)
            except Exception as exc:  # its statistics are read again at its step end
                w._fault("flush", "read at another watcher's anomaly", exc)
                continue
            a = w._trace.anomaly
            if a is not None and a.record.seq >= 0:
                found.append((w, a))
        first = min(found, key=lambda f: f[1].record.seq, default=None)
        theirs: AnomalyError | None = None
        winner: Watcher | None = None
        if first is not None and first[1].record.seq < mine.record.seq:
            try:
                first[0]._act(first[0]._trace)
            except AnomalyError as err:
                theirs, winner = err, first[0]
        for w, a in found:
            if w is not winner:
                w._forget(w._trace, a)
        if theirs is not None:
            self._forget(trace, mine)
            if self._first_bad is trace:
                self._first_bad = kept
            trace.diagnoses = self._evaluate(trace)
        return theirs

    def _announce(self, trace: StepTrace) -> None:
        """A :class:`nanwatch.NanwatchWarning` for each warning-severity code, the first time
        it fires: an early warning nobody reads until the post-mortem is no warning."""
        if self.config.on_anomaly == "record":
            return
        for d in trace.diagnoses:
            if d.severity != "warning" or d.code in self._announced:
                continue
            self._announced.add(d.code)
            lines = [f"nanwatch: step {trace.step}: {d.headline}"]
            lines += [f"  {e}" for e in d.evidence[:2]]
            if d.fix:
                first, *more = d.fix.splitlines()
                lines.append(f"  fix: {first}")
                lines.extend(f"       {line}" for line in more[:3])
            lines.append(f"  silence: {d.silence}")
            _frames.warn_at_user("\n".join(lines), NanwatchWarning, safe=True, where=d.source)

    def _message(self, trace: StepTrace) -> str:
        lines: list[str] = []
        a = trace.anomaly
        step = f"step {trace.step}{_trainer.where(self._positions.get(trace.step), trace.step)}"
        if a is not None:
            summary = a.summary
            if trace is self._trace and self.config.on_anomaly != "raise":
                # said while the step runs on: the modules it reaches later are not counted
                # yet, and the count the report gives at the step end would differ
                summary = _without_count(summary)
            lines.append(f"nanwatch: {step}: {summary}")
        top = trace.diagnoses[0] if trace.diagnoses else None
        if top is not None:
            if a is None:
                lines.append(f"nanwatch: {step}: {top.title}")
            lines.extend(top.brief())
        if self.global_hooks:  # nanwatch run: the script has no nw; the report is a file
            from nanwatch.postmortem import full_report_line

            lines.append(full_report_line(self.config.report_dir))
        else:
            lines.append("  full report: print(nw.report); nw.report.save('run.html')")
        return "\n".join(lines)

    # ------------------------------------------------------------------ faults and exits
    def _fault(self, key: str, where: str, exc: BaseException) -> None:
        msg = f"{type(exc).__name__}: {exc}"
        if key in self._disabled_hooks:  # said once already
            return
        self._disabled_hooks.add(key)
        self.faults.append((where, msg))
        _frames.warn_at_user(
            f"nanwatch: internal error in its {where} ({msg}); this hook is disabled for the "
            "rest of the run and training goes on. Please report it with the traceback "
            "(python -W error::RuntimeWarning).",
            safe=True,
            detail="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        )

    def _checker_fault(self, exc: BaseException) -> None:
        self.faults.append(("op checker", f"{type(exc).__name__}: {exc}"))
        _frames.warn_at_user(
            f"nanwatch: internal error in the op checker ({type(exc).__name__}: {exc}); op "
            "checks are off for the rest of the run.",
            safe=True,
        )

    def _remove_hooks(self) -> None:
        _backward_tap.remove(self)
        _grad_tap.remove(self)
        _scaler_tap.remove(self)
        _clip_tap.remove(self)
        if self._restore_signals is not None:
            restore, self._restore_signals = self._restore_signals, None
            restore()
        if self._functional_guards is not None:
            fg, self._functional_guards = self._functional_guards, None
            with contextlib.suppress(Exception):
                fg.__exit__(None, None, None)
        # the hook functions, for the copies torch registered of them (see _make_pre)
        fns = [
            f
            for h in self._handles
            if (d := h.hooks_dict_ref()) is not None and (f := d.get(h.id)) is not None
        ]
        for h in self._handles:
            h.remove()
        _copies.unhide(h.id for h in self._handles)
        self._handles = []
        if self._probing is not None:  # detached while probing: probed again after attach
            self._probing = None
            self._probe_due = True
        if fns:
            _copies.sweep((m for r in self.roots for m in r.modules()), fns)
        for h in self._param_hooks.values():
            h.remove()
        self._param_hooks = {}
        self._hot_norms.clear()
        for h in self._tensor_handles:
            h.remove()
        self._tensor_handles = []
        if self._checker is not None:
            checker, self._checker = self._checker, None
            with contextlib.suppress(Exception):
                checker.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        self._anomaly_paused = False
        if self._anomaly_mode_prev is not None:
            enabled, check_nan = self._anomaly_mode_prev
            self._anomaly_mode_prev = None
            torch.autograd.set_detect_anomaly(enabled, check_nan=check_nan)

    def _on_exception(self, exc: BaseException, *, during: str | None = None) -> Any:
        """The code inside ``watch`` raised: finish the step from what is safe to read, write
        the post-mortem, and let the exception go on unchanged (``during``: see
        :meth:`close`)."""
        from nanwatch import postmortem

        owner = getattr(exc, "_nanwatch_owner", None)
        if (owner is not None and owner != id(self)) or (
            # a global watcher (nanwatch run), after a watcher of the script's own wrote the
            # post-mortem of this exception: it stood aside while that one watched
            self.global_hooks and getattr(exc, "_nanwatch_reported", None) not in (None, id(self))
        ):
            # another watcher's AnomalyError or GuardError (nested watchers): that one
            # writes the post-mortem; this one's run was stopped without an anomaly of its
            # own, and a report of it would say 'stopped at the first anomaly' with none
            self._quiet = True
            known, first_bad = list(self.anomalies), self._first_bad
            try:
                done = self._boundary()
                found = done.anomaly
                if self._read_late() and found is not None and found not in known:
                    # read only now (the accelerator path): both watchers saw the same
                    # tensors (a gradient into the other's model), and on the CPU the
                    # first hook to see it raised before this one's ran. The anomaly is
                    # the other watcher's, which reported it
                    self._forget(done, found)
                    self._first_bad = first_bad
                    done.diagnoses = self._evaluate(done)
            except Exception as inner:
                self.faults.append(("post-mortem flush", f"{type(inner).__name__}: {inner}"))
            finally:
                self._quiet = False
            return None
        try:
            info = postmortem.classify(exc, {id(p): q for q, _, p in self._params})
            if during:
                info["during"] = during
            if info.get("class") == "shape-mismatch" and "optimizer" not in info:
                said = self._shape_advice(exc)
                if said is not None:
                    info["advice"] = said
            if info.get("class") in ("shape-mismatch", "guard") and info.get("advice") in (
                postmortem.ADVICE["shape-mismatch"],
                postmortem.ADVICE["guard"],
            ):
                said = self._rnn_layout_advice(exc)
                if said is not None:
                    info["advice"] = said
            if info.get("class") == "dtype-error" and not postmortem.index_dtype_advice(exc):
                said = _dtype_advice(exc, self._infos, self._is_model_input)
                if said is not None:
                    info["advice"] = said
            if info.get("class") == "norm-one-value":
                said = _one_value_advice(exc, self._infos)
                if said is not None:
                    info["advice"] = said
            if info.get("class") == "graph-freed":
                said = self._graph_freed_advice()
                if said is not None:
                    info["advice"] = said
            if info.get("class") == "no-graph":
                said = self._no_graph_advice()
                if said is not None:
                    info["advice"] = said
            if info.get("class") == "non-scalar-backward":
                said = self._non_scalar_advice()
                if said is not None:
                    info["advice"] = said
            if info.get("device_lost"):
                self._device_dead = True
            self._note_mutations()
            if info.get("class") == "autograd-inplace":
                self._note_saved_state(str(exc))
                self._note_inplace_lines(str(exc))
            ended = self._ended_step_of(exc)
            (ended or self._trace).error = info
        except Exception as inner:  # the user's exception matters more than ours
            ended = None
            self._fault("post-mortem", "post-mortem", inner)
        self._quiet = True
        try:
            if ended is None:
                if not self._updated and not isinstance(exc, NanwatchError):
                    # the step ran on the weights the last update wrote, which sentinel
                    # never read: a NaN there is what the post-mortem must lead with
                    self._last_update_checked()
                self._boundary()
        except Exception as inner:
            self.faults.append(("post-mortem flush", f"{type(inner).__name__}: {inner}"))
        finally:
            self._quiet = False
        if self.config.postmortem:
            try:
                path = postmortem.capture(self, exc)
            except Exception as inner:
                self._fault("post-mortem", "post-mortem", inner)
                return None
            if path is not None:  # a global watcher around this one writes none of its own
                with contextlib.suppress(Exception):
                    exc._nanwatch_reported = id(self)  # type: ignore[attr-defined]
            return path
        return None

    def _shape_advice(self, exc: BaseException) -> str | None:
        """For a shape error raised in a watched layer that fixes the size of its input (a
        Linear's in_features, a convolution's channels, a norm's features or shape): what it
        was built for against what it was given. The layer and its input are read from the
        traceback's frames (the innermost ``forward`` of a watched module: sentinel's
        submodules and the norms watched from their forward hook alone have no open call);
        the module that made the input, from the records when its call is recorded. None
        when the error is not that."""
        found = _raising_layer(exc, self._infos)
        if found is None:
            return None
        module, shape = found
        if isinstance(module, nn.RNNBase) and "input_size" not in str(exc):
            return None  # its hidden state's check (the tensor read is the state, not input)
        size = _size_mismatch(module, shape)
        if size is None:
            return None
        what, want, got, rebuilt = size
        path = self._infos[module].path
        kind = type(module).__name__
        trace = self._trace
        call = next((c for c in reversed(trace.calls) if c.path == path and c.end < 0), None)
        rec = (
            next(
                (
                    r
                    for r in trace.records
                    if r.call == call.id and r.phase is Phase.INPUT and r.role == "input[0]"
                ),
                None,
            )
            if call is not None
            else None
        )
        src = trace.record(rec.source) if rec is not None and rec.source is not None else None
        made = trace.call(src.call) if src is not None and src.call is not None else None
        by = (
            f", the output of {made.path} ({made.module_type})"
            if made is not None and call is not None and made.id != call.id and not made.root
            else ""
        )
        told = (
            f"{path} ({kind}) was built for {what} {want}, but its input (shape "
            f"{list(shape)}{by}) has {got}"
        )
        unbatched = self._unbatched_input(trace, module)
        if unbatched is not None:
            return f"{told}: {unbatched}"
        last = _channels_last(module, shape)
        if last is not None:
            return f"{told} at dim {last[0]} and {want} in its last dim: {last[1]}"
        swapped = _features_first(module, shape)
        if swapped is not None:
            return f"{told} in its last dim and {want} in dim 1: {swapped}"
        changed = self._batch_shape_changed(module, path, trace)
        if changed is not None:
            step, then, now = changed
            head = (
                f"{path} ({kind}) was built for {what} {want} and got it at step {step}, "
                f"when the model's input had shape {list(then)}; this step's has shape "
                f"{list(now)}, so its input (shape {list(shape)}{by}) has {got}"
            )
            if then[1:] == now[1:]:  # the batch size alone: a reshape that fixed it
                at = _fixed_batch_reshape(exc, then[0])
                where = f" ({at[0]}: {at[1]})" if at is not None else " (x.view(B, -1))"
                return (
                    f"{head}: only the batch size changed ({then[0]} to {now[0]}), so a "
                    f"reshape in the model writes the batch size in{where}: write "
                    "x.flatten(1) or x.view(x.size(0), -1) there; or pass drop_last=True to "
                    "the DataLoader if the last batch is the short one."
                )
            pool = (
                ", or put nn.AdaptiveAvgPool2d before the flatten so the model takes any size"
                if what == "in_features" and len(now) >= 4
                else ""
            )
            return (
                f"{head}: the batch's shape changed, not the model. Give every batch the "
                f"shape of the earlier ones (resize or crop in the dataset's transform){pool}."
            )
        return (
            f"{path} ({kind}) was built for {what} {want}, but its input (shape "
            f"{list(shape)}{by}) has {got}: build it as {rebuilt} where the model "
            f"creates {path}, or make what comes before it give {want}."
        )

    def _rnn_layout_advice(self, exc: BaseException) -> str | None:
        """A recurrent module built with ``batch_first=False`` whose input this step was
        recorded with shape (a, b, features), when the error says batch sizes a and b
        disagree (a loss's "batch sizes differ (10 vs 4)"): it read a batch of a as a
        steps, and what followed it got a batch of b. From the records of the step (watch
        mode), at the crash only."""
        from nanwatch import postmortem

        named = postmortem.batch_sizes_named(str(exc))
        rnns = {
            info.path: m
            for m, info in self._modules
            if named and isinstance(m, nn.RNNBase) and not m.batch_first
        }
        trace = self._trace
        for call in trace.calls if rnns else ():
            module = rnns.get(call.path)
            if module is None:
                continue
            rec = next(
                (
                    r
                    for r in trace.records
                    if r.call == call.id and r.phase is Phase.INPUT and r.role == "input[0]"
                ),
                None,
            )
            if rec is None or len(rec.shape) != 3:
                continue
            steps, batch = rec.shape[0], rec.shape[1]
            if {steps, batch} != named:
                continue
            return postmortem.rnn_batch_first_advice(
                f"{call.path} ({call.module_type})",
                module,
                tuple(rec.shape),
                f", and what follows it gets a batch of {batch} where {steps} is expected (the "
                "sizes the error names)",
            )
        return None

    def _is_model_input(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is the tensor the step's first model call was given first, or a view
        of it: its memory, while the step holds it (floating inputs); else its shape and
        dtype (an integer batch, whose tensor is not kept)."""
        rec = _root_input(self._trace)
        if rec is None:
            return False
        for ref, index, _, _ in self._known.values():
            if index == rec.index:
                held = ref()
                return held is not None and _shares_memory(t, held)
        return tuple(t.shape) == tuple(rec.shape) and dtype_name(t.dtype) == rec.dtype

    def _unbatched_input(self, trace: StepTrace, raised: nn.Module) -> str | None:
        """The model's input is one sample with no batch dim (``[3, 32, 32]``), which the
        model's first convolution took as an unbatched input, so the layers after it (a
        flatten, a Linear) read its channels as the batch: what to say. None otherwise."""
        now = _root_input_shape(trace)
        root = next((m for m, info in self._modules if info.is_root), None)
        if now is None or root is None:
            return None
        names = {id(m): n for n, m in root.named_modules()}
        conv = next((m for m in root.modules() if isinstance(m, nn.modules.conv._ConvNd)), None)
        if conv is None or conv is raised:
            return None
        dims = len(conv.kernel_size)
        if len(now) != dims + 1 or now[0] != conv.in_channels:
            return None
        info = self._infos.get(conv)
        where = info.path if info is not None else names.get(id(conv)) or type(conv).__name__
        return (
            f"the model's input has shape {list(now)}, one sample with no batch dim: "
            f"{where} ({type(conv).__name__}) took it as an unbatched input and gave an "
            "output with no batch dim, so the layers after it read its channels as the "
            "batch. Add the batch dim: x = x.unsqueeze(0) (or x[None]) for one sample; a "
            "DataLoader batches a dataset's samples."
        )

    def _batch_shape_changed(
        self, module: nn.Module, path: str, trace: StepTrace
    ) -> tuple[int, tuple[int, ...], tuple[int, ...]] | None:
        """(step, the model's input shape then, now) when an earlier step of the ring ran
        ``path`` on an input it fits, or ran the model on an input of another shape with no
        error: the layer was right for the batches before this one. None when no recorded
        step says so (the first step, or the model's input kept its shape)."""
        now = _root_input_shape(trace)
        if now is None:
            return None
        for past in reversed(self.history):
            then = _root_input_shape(past)
            if then is None or then == now or len(then) != len(now):
                continue
            ran = [
                r.shape
                for c in past.calls
                if c.path == path
                for r in past.records
                if r.call == c.id and r.phase is Phase.INPUT and r.role == "input[0]"
            ]
            if any(_size_mismatch(module, shape) is not None for shape in ran):
                continue  # it failed there too (a step the error did not end)
            return past.step, then, now
        return None

    def _ended_step_of(self, exc: BaseException) -> StepTrace | None:
        """The finished step an AnomalyError of ``nw.step()`` was raised for, when nothing
        was recorded since: the error is that step's, not the next one's (the post-mortem
        said "at step 3" for a diagnosis of step 2)."""
        if not isinstance(exc, AnomalyError) or self._trace.records or self._trace.calls:
            return None
        found = exc.anomaly if exc.anomaly is not None else exc.diagnosis
        step = getattr(found, "step", None)
        for t in reversed(self.history):
            if t.step == step:
                return t
        return None

    def _note_mutations(self) -> None:
        """Outputs changed in place after they were recorded (host-side version counters,
        no device access): the evidence for autograd's "modified by an inplace operation"."""
        trace = self._trace
        for ref, idx, ver, _ in self._known.values():
            t = ref()
            if t is None or ver is None:
                continue
            now = _version(t)
            if now is not None and now != ver:
                rec = trace.record(idx)
                if rec is not None:
                    trace.mutations.append(
                        {
                            "index": idx,
                            "path": rec.path,
                            "role": rec.role,
                            "grad_fn": rec.grad_fn,
                            "recorded_version": ver,
                            "version": now,
                        }
                    )

    def _note_saved_state(self, message: str) -> None:
        """autograd's in-place error names a tensor by type, shape and versions only: a
        buffer or parameter of a watched module (or a view of one, which shares its version
        counter) at the version the error reports is the one written in place after
        autograd saved it (MoCo's queue, a memory bank, a weight the optimizer updated before
        a second backward). Host-side metadata only: shapes, dtypes, version counters."""
        from nanwatch.localize import parse_inplace_error

        facts = parse_inplace_error(message)
        if facts is None:
            return
        shape = tuple(facts["shape"]) if isinstance(facts["shape"], tuple) else ()
        numel = math.prod(shape)
        now = facts["version"]
        kind_of = f"torch.{facts['tensor_type']}"
        same: list[dict[str, Any]] = []
        views: list[dict[str, Any]] = []
        seen: set[int] = set()
        for module, info in self._modules:
            state = [
                *(("buffer", n, t) for n, t in module.named_buffers(recurse=False)),
                *(("parameter", n, t) for n, t in module.named_parameters(recurse=False)),
            ]
            for kind, name, t in state:
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                if _version(t) != now or t.numel() != numel or t.type() != kind_of:
                    continue
                exact = tuple(t.shape) == shape
                (same if exact else views).append(
                    {
                        "path": info.path,
                        "role": f"{kind} {name}",
                        "grad_fn": facts["grad_fn"],
                        "recorded_version": facts["expected_version"],
                        "version": now,
                        "kind": kind,
                        "name": f"{info.path}.{name}",
                        "attr": name,
                        "owner_type": info.type_name,
                        "shape": list(t.shape),
                        "view": not exact,
                        # an nn.Embedding's max_norm: its forward renormalises the weight
                        "max_norm": getattr(module, "max_norm", None),
                    }
                )
        self._trace.mutations.extend((same or views)[:4])

    def _note_inplace_lines(self, message: str) -> None:
        """The lines behind autograd's in-place error: the root's forward runs once more,
        with gradients on as the user's ran, from the state and random draws it began with,
        under :class:`nanwatch._inplace.SavedTensorWatch`; it finds the op and line that made
        the tensor the error names and the line that then wrote it in place (an
        ``inplace_lines`` note). Error time only; a forward that cannot run again leaves
        nothing."""
        from nanwatch._inplace import SavedTensorWatch, bare, rewrite
        from nanwatch.localize import parse_inplace_error

        facts = parse_inplace_error(message)
        if facts is None or facts["grad_fn"] is None:
            return  # a buffer or parameter: _note_saved_state names it
        found = next(
            (
                (c, f)
                for c in reversed(self._trace.calls)
                if c.root and not c.is_loss and (f := self._root_call_inputs(c)) is not None
            ),
            None,
        )
        if found is None:
            return
        call, (root, args, kwargs, hooks) = found
        shape = facts["shape"] if isinstance(facts["shape"], tuple) else ()
        output = facts["output"] if isinstance(facts["output"], int) else None
        then = facts["expected_version"]
        watch = SavedTensorWatch(
            str(facts["grad_fn"]),
            output,
            shape,
            str(facts["tensor_type"]),
            then if isinstance(then, int) else 0,
        )
        devices = {t.device for _, t in self._walk(args, "input", kwargs)}
        rng = self._call_rng(call)
        try:
            with ops.preserved_state(root, devices), ops._replay_scope():
                if rng is not None:
                    ops.set_rng_states(rng, devices)
                with torch.enable_grad():
                    ops.call_forward(
                        root, args, kwargs, pre_hooks=hooks,
                        modes=(*self._call_modes(call), watch),
                    )  # fmt: skip
        except Exception:  # what the forward showed before it raised stands
            pass
        # the tensor the forward wrote at the saved version; else the one it made (the
        # write came after the forward returned: the loss code, a metric, a hook)
        hit = next((m for m in watch.made if m.writer is not None), None)
        if hit is None and len(watch.made) == 1:
            hit = watch.made[0]
        if hit is None:
            return
        names = {id(m): n for n, m in root.named_modules()}

        def where(m: nn.Module | None) -> dict[str, Any] | None:
            if m is None or id(m) not in names:
                return None
            info = self._infos.get(m)
            inplace = getattr(m, "inplace", None)
            return {
                "path": info.path if info is not None else names[id(m)] or type(m).__name__,
                "type": type(m).__name__,
                "inplace": inplace if isinstance(inplace, bool) else None,
            }

        self.note(
            "inplace_lines",
            call.path,
            source=hit.written_at,
            made_by=hit.op,
            made_at=hit.at,
            made_code=bare(hit.code),
            written_by=hit.writer,
            written_at=hit.written_at,
            written_code=bare(hit.written_code),
            rewrite=None if hit.written_in is not None else rewrite(hit.written_code, hit.mask),
            made_in=where(hit.module),
            written_in=where(hit.written_in),
            matches=len(watch.made),
        )


class _Tap:
    """A wrapper of a torch function, installed (:meth:`_patch`) with the first attached
    watcher and removed (:meth:`_unpatch`) with the last; a wrapper someone else installed
    after ours is left alone."""

    def __init__(self) -> None:
        self._watchers: list[Watcher] = []
        self._lock = threading.Lock()

    def install(self, watcher: Watcher) -> None:
        with self._lock:
            if not self._watchers:
                self._patch()
            self._watchers.append(watcher)

    def remove(self, watcher: Watcher) -> None:
        with self._lock:
            if watcher not in self._watchers:
                return
            self._watchers.remove(watcher)
            if not self._watchers:
                self._unpatch()

    def _patch(self) -> None:
        raise NotImplementedError

    def _unpatch(self) -> None:
        raise NotImplementedError


class _BackwardTap(_Tap):
    """A scoped wrapper of ``torch.autograd.backward`` (which ``Tensor.backward`` calls)."""

    def __init__(self) -> None:
        super().__init__()
        self._original: Callable[..., Any] | None = None
        self._wrapper = self._tapped  # one bound method, so `is` can recognize it

    def _patch(self) -> None:
        self._original = torch.autograd.backward
        torch.autograd.backward = self._wrapper

    def _unpatch(self) -> None:
        if self._original is not None:
            if torch.autograd.backward is self._wrapper:
                torch.autograd.backward = self._original
            self._original = None

    def _tapped(self, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        watchers = list(self._watchers)
        for w in watchers:
            w._backward_began(tensors)
            w._grads_around_backward(True)
            w._on_backward(tensors)
        original = self._original
        if original is None:  # removed while we were called: behave as the real one
            return torch.autograd.backward(tensors, *args, **kwargs)
        for w in watchers:
            w._in_backward += 1
        ended = [w._eob_count for w in watchers]
        try:
            out = original(tensors, *args, **kwargs)
        finally:
            for w in watchers:
                w._in_backward -= 1
        for w, n in zip(watchers, ended, strict=True):
            w._backward_ended()
            w._grads_around_backward(False)
            if w._eob_count == n and w._attached and threading.get_ident() == w._thread:
                # no watched output got a gradient (sentinel, and the loop called a
                # submodule of the root, never the root: Lightning's self.net(x)): the
                # end-of-backward check the output hooks queue did not run; run it now,
                # or the parameter gradients are never read
                w._end_of_backward()
        return out


_backward_tap = _BackwardTap()


class _GradTap(_Tap):
    """A scoped wrapper of ``torch.autograd.grad``: the gradients it returns for watched
    weights are checked (see :meth:`Watcher._grads_returned`)."""

    def __init__(self) -> None:
        super().__init__()
        self._original: Callable[..., Any] | None = None
        self._wrapper = self._tapped  # one bound method, so `is` can recognize it

    def _patch(self) -> None:
        self._original = torch.autograd.grad
        torch.autograd.grad = self._wrapper

    def _unpatch(self) -> None:
        if self._original is not None:
            if torch.autograd.grad is self._wrapper:
                torch.autograd.grad = self._original
            self._original = None

    def _tapped(self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        original = self._original
        if original is None:  # removed while we were called: behave as the real one
            return torch.autograd.grad(outputs, inputs, *args, **kwargs)
        if _frames.is_core(sys._getframe(1).f_code.co_filename):  # nanwatch's, torch's own
            return original(outputs, inputs, *args, **kwargs)
        if not isinstance(inputs, (torch.Tensor, tuple, list)):
            inputs = tuple(inputs)  # model.parameters(): read here once, as torch would
        for w in list(self._watchers):
            w._grad_began(outputs, inputs)
        out = original(outputs, inputs, *args, **kwargs)
        # create_graph: the fifth parameter (outputs, inputs, grad_outputs, retain_graph, ...)
        create = kwargs.get("create_graph", args[2] if len(args) > 2 else False)
        for w in list(self._watchers):
            w._grads_returned(inputs, out, bool(create))
        return out


_grad_tap = _GradTap()


def _grad_scaler_classes() -> list[type]:
    """GradScaler and every loaded subclass with a ``scale`` of its own (FSDP's
    ShardedGradScaler): the classes whose ``scale`` a training loop calls."""
    amp = getattr(torch, "amp", None)
    base = getattr(getattr(amp, "grad_scaler", None), "GradScaler", None)
    if base is None:  # torch < 2.3: only the CUDA one
        base = getattr(getattr(torch.cuda, "amp", None), "GradScaler", None)
    if not isinstance(base, type):
        return []
    out: list[type] = []
    todo = [base]
    while todo:
        cls = todo.pop()
        if cls is base or "scale" in vars(cls):
            out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def _never_reset(added: list[tuple[str, int, torch.Tensor | None]]) -> tuple[list[str], int]:
    """The weights among ``added`` (name, param group, norm before the backward that added
    to it) whose gradient still held the last step's when backward added to it, and the
    first one's group: a norm of 0 then was a reset no version showed
    (``p.grad.data.zero_()``). The norms are read here, in one transfer: only when a
    backward added to a gradient no visible reset cleared."""
    norms = [n for _, _, n in added if n is not None]
    values = iter(read_scalars(norms)) if norms else iter(())
    stale: list[str] = []
    group = -1
    for name, gi, n in added:
        if n is not None and next(values) == 0:
            continue  # zeroed through .data before that backward: reset
        stale.append(name)
        group = gi if group < 0 else group
    return stale, group


class _ForwardParams(Mapping[str, tuple[str, ...]]):
    """The names of each root's forward parameters, by path: the rules call a model's
    input by the name its forward gives it (``x``), not ``arg1``. Read (a signature each)
    only when a rule asks, not every step."""

    def __init__(self, modules: Sequence[tuple[nn.Module, _ModInfo]]) -> None:
        self._modules = modules
        self._names: dict[str, tuple[str, ...]] | None = None

    def _read(self) -> dict[str, tuple[str, ...]]:
        if self._names is None:
            from nanwatch.rules._evidence import forward_params

            self._names = {
                info.path: forward_params(m) for m, info in self._modules if info.is_root
            }
        return self._names

    def __getitem__(self, path: str) -> tuple[str, ...]:
        return self._read()[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())


class _ModuleTraining(Mapping[str, bool]):
    """Per module path, read only when a rule asks: whether the module is in training mode
    (a norm folds a batch into its running statistics only then; in eval mode it reads
    them)."""

    def __init__(self, modules: Sequence[tuple[nn.Module, _ModInfo]]) -> None:
        self._modules = modules

    def __getitem__(self, path: str) -> bool:
        module = next((m for m, info in self._modules if info.path == path), None)
        if module is None:
            raise KeyError(path)
        return bool(module.training)

    def __iter__(self) -> Iterator[str]:
        return (info.path for _, info in self._modules)

    def __len__(self) -> int:
        return len(self._modules)


class _ModulePrecision(Mapping[str, dict[str, Any]]):
    """Per module path, read only when a rule asks (an overflow's fix): ``library``, whether
    the module's forward is code the user does not edit (``nn.Linear``, an installed
    package's layer); ``dtypes``, those of its own weights; ``keep``, (the root's class, the
    entry) when its root model declares the module must stay float32 (transformers'
    ``_keep_in_fp32_modules``, which ``model.half()`` does not honour)."""

    def __init__(self, modules: Sequence[tuple[nn.Module, _ModInfo]]) -> None:
        self._modules = modules
        self._found: dict[str, dict[str, Any]] = {}

    def _roots(self) -> list[tuple[nn.Module, str]]:
        return [(m, info.path) for m, info in self._modules if info.is_root]

    def __getitem__(self, path: str) -> dict[str, Any]:
        if path in self._found:
            return self._found[path]
        module = next((m for m, info in self._modules if info.path == path), None)
        if module is None:
            raise KeyError(path)
        try:
            file = inspect.getsourcefile(type(module).forward) or ""
        except TypeError:
            file = ""
        keep = None
        for root, name in self._roots():
            wanted = getattr(root, "_keep_in_fp32_modules", None)
            if not isinstance(wanted, (list, tuple, set, frozenset)) or root is module:
                continue
            if not any(m is module for m in root.modules()):
                continue
            inner = path[len(name) + 1 :] if path.startswith(name + ".") else path
            hit = next(
                (w for w in sorted(map(str, wanted)) if w and f".{w}." in f".{inner}."), None
            )
            if hit is not None:
                keep = (type(root).__name__, hit)
                break
        found = {
            "library": bool(file) and _frames.is_internal(os.path.abspath(file)),
            "type": type(module).__name__,
            "dtypes": sorted(
                {str(p.dtype).removeprefix("torch.") for p in module.parameters(recurse=False)}
            ),
            "keep": keep,
        }
        self._found[path] = found
        return found

    def __iter__(self) -> Iterator[str]:
        return (info.path for _, info in self._modules)

    def __len__(self) -> int:
        return len(self._modules)


class _ParamShapes(Mapping[str, tuple[int, ...]]):
    """The shape of each watched weight, by parameter name: host-side metadata, for a rule
    that names weights no record of the step holds (a parametrization's stored tensors,
    in sentinel, when the anomaly stopped the step before backward). Read only when a rule
    asks."""

    def __init__(self, params: Sequence[tuple[str, str, nn.Parameter]]) -> None:
        self._params = params
        self._shapes: dict[str, tuple[int, ...]] | None = None

    def _read(self) -> dict[str, tuple[int, ...]]:
        if self._shapes is None:
            self._shapes = {q: tuple(p.shape) for q, _, p in self._params}
        return self._shapes

    def __getitem__(self, name: str) -> tuple[int, ...]:
        return self._read()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())


class _WeightNorms(Mapping[str, tuple[str, float]]):
    """The L2 norm of each watched weight, by parameter name, with its dtype: the scale a
    gradient's norm is compared with (NW303: a gradient at the rounding level of its
    weights is noise, not a level to jump from). Read (one multi-tensor norm, one host
    read) only when a rule asks, once per evaluation: never on a dead device, under
    tracing, nor of a weight that is not a plain dense tensor (a sharded DTensor's norm is
    a collective that only this rank would join)."""

    def __init__(self, watcher: Watcher) -> None:
        self._watcher = watcher
        self._norms: dict[str, tuple[str, float]] | None = None

    def _read(self) -> dict[str, tuple[str, float]]:
        if self._norms is None:
            self._norms = {}
            w = self._watcher
            if w._device_dead or _tracing():
                return self._norms
            plain = [
                (q, p.detach())
                for q, _, p in w._params
                if type(p.detach()) is torch.Tensor
                and p.is_floating_point()
                and p.layout is torch.strided
                and p.device.type != "meta"
            ]
            try:
                with _NO_TORCH_FUNCTION(), torch.no_grad():
                    values = read_scalars(foreach_l2([t for _, t in plain]))
            except Exception:  # a weight nanwatch cannot read: no scale, no floor
                return self._norms
            self._norms = {
                q: (dtype_name(t.dtype), v) for (q, t), v in zip(plain, values, strict=True)
            }
        return self._norms

    def __getitem__(self, name: str) -> tuple[str, float]:
        return self._read()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())


def _distributed() -> tuple[int, int] | None:
    """This process's rank and the world size when ``torch.distributed`` is initialized
    with more than one process; else None. A few attribute reads: no collective."""
    try:
        dist = torch.distributed
        if not dist.is_available() or not dist.is_initialized():
            return None
        size = int(dist.get_world_size())
        return (int(dist.get_rank()), size) if size > 1 else None
    except Exception:  # a backend without a default group, a torch without it
        return None


_CRITERION_LINE = re.compile(r"^(?P<indent>\s*)(?P<target>[A-Za-z_]\w*)\s*=\s*criterion\(")


def _without_criterion(code: str, backward_at: str | None) -> str:
    """``code`` (a template fix) with each line that assigns ``criterion(...)`` and says it
    is a pattern (the replay's ``step_fn``) made a placeholder for the user's own forward
    and loss: the user's code has no ``criterion``.

    >>> _without_criterion("    loss = criterion(model(x), y)   # a pattern: ...", None)
    '    loss = ...   # a pattern: write your forward and loss here, as in your training step'
    """
    out = []
    for line in code.split("\n"):
        cut = _comment_start(line)
        m = _CRITERION_LINE.match(line[:cut])
        if m is None or "a pattern" not in line[cut:]:
            out.append(line)
            continue
        where = f" (before its backward() at {backward_at})" if backward_at else ""
        out.append(
            f"{m.group('indent')}{m.group('target')} = ...   # a pattern: write your forward "
            f"and loss here, as in your training step{where}"
        )
    return "\n".join(out)


def _names_on_line(source: str | None) -> set[str]:
    """The names the user's line ``source`` (``train.py:42``) uses; empty when it cannot
    be read.

    >>> _names_on_line(None)
    set()
    """
    import linecache
    import re

    path, _, num = (source or "").rpartition(":")
    if not path or not num.isdigit():
        return set()
    text = linecache.getline(path, int(num))
    code = text[: _comment_start(text)]
    return set(re.findall(r"(?<![\w.])[A-Za-z_]\w*", code))


def _renamed(code: str, renames: dict[str, str]) -> str:
    """``code`` with each name of ``renames`` replaced where it stands as a name (not an
    attribute, a keyword argument, a parameter of a function or lambda of the code, or part
    of a longer name), in the code of each line but not in its comment: every target of an
    assignment or a loop, those a tuple unpacks included (``a, model = ...``,
    ``for x, y in loader:``). Code that parses is read by its syntax tree; other code (a
    template with a placeholder line) line by line, a ``name =`` taken for a keyword
    argument inside brackets or after a word (see :func:`_renamed_line`).

    >>> _renamed("model.float()  # the model in float32", {"model": "net"})
    'net.float()  # the model in float32'
    >>> _renamed("f(model=model, x=self.model)", {"model": "net"})
    'f(model=net, x=self.model)'
    >>> _renamed("    optimizer = SGD(lr=0.1)", {"optimizer": "opt"})
    '    opt = SGD(lr=0.1)'
    >>> _renamed("for x, y in loader:", {"y": "target"})
    'for x, target in loader:'
    """
    lines = code.split("\n")
    spots = _name_spots(lines, renames)
    if spots is None:
        return "\n".join(_renamed_line(line, renames) for line in lines)
    for row, col, old in sorted(spots, reverse=True):
        line = lines[row]
        lines[row] = line[:col] + renames[old] + line[col + len(old) :]
    return "\n".join(lines)


def _name_spots(lines: list[str], renames: dict[str, str]) -> list[tuple[int, int, str]] | None:
    """(line, column, name) of each use of a name of ``renames`` in the code ``lines`` as
    Python reads it, outside the functions and lambdas that take a parameter of that name;
    None when the code does not parse."""
    import ast

    filled = [ln for ln in lines if ln.strip()]
    margin = min((len(ln) - len(ln.lstrip()) for ln in filled), default=0)
    if any(ln[:margin] != filled[0][:margin] for ln in filled):
        return None  # indented with different whitespace: not one block
    body = [ln[margin:] if ln.strip() else "" for ln in lines]
    try:
        tree = ast.parse("\n".join(body))
    except (SyntaxError, ValueError):
        return None
    spots: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, bound: frozenset[str]) -> None:
        if isinstance(node, ast.Name):
            if node.id in renames and node.id not in bound:
                text = body[node.lineno - 1].encode()[: node.col_offset].decode()
                spots.append((node.lineno - 1, margin + len(text), node.id))
            return
        if isinstance(node, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
            inner = bound | {p.arg for p in params if p is not None}
            outer: list[ast.AST] = [*a.defaults, *(d for d in a.kw_defaults if d is not None)]
            if not isinstance(node, ast.Lambda):
                outer += node.decorator_list
            for child in outer:
                visit(child, bound)
            for child in node.body if isinstance(node.body, list) else [node.body]:
                visit(child, inner)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, bound)

    visit(tree, frozenset())
    return spots


def _renamed_line(line: str, renames: dict[str, str]) -> str:
    """:func:`_renamed` of one line of code that may not parse: a name followed by ``=``
    inside brackets, or after a word, is a keyword argument's, and stays."""
    import re

    pattern = re.compile(
        r"(?<![\w.'\"])(" + "|".join(map(re.escape, renames)) + r")(?![\w'\"])(\s*=(?!=))?"
    )
    cut = _comment_start(line)
    head, tail = line[:cut], line[cut:]

    def name(m: re.Match[str]) -> str:
        before = head[: m.start()].rstrip()
        depth = sum(before.count(c) for c in "([{") - sum(before.count(c) for c in ")]}")
        # a target stands first, or after another target (``a, model =``, ``*model``,
        # ``best = model =``); else ``model=`` is a keyword (``f(model=...)``, and in prose)
        if m.group(2) and (depth > 0 or (before and before[-1] not in ",*=")):
            return m.group(0)
        return renames[m.group(1)] + (m.group(2) or "")  # a name, or a statement's target

    return pattern.sub(name, head) + tail


def _comment_start(line: str) -> int:
    """Where the comment of a line of Python code starts (its length: none)."""
    quote: str | None = None
    for i, ch in enumerate(line):
        if quote is not None:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            return i
    return len(line)


#: the file of ``nn.Module.__call__``: the frames between a call and its pre-hooks
_MODULE_CALL = os.path.join("torch", "nn", "modules", "module.py")


class _FrameAt:
    """A frame as it stood at one moment (its line and instruction then), read after it
    has moved on: where the user called a root, when its values are read after the call
    returned (the accelerator path). The frame itself is not held: it would keep its
    locals (a step's logits on a GPU) alive until the root's next call. Its names are read
    from the frame of the same code still running when they are asked for (the training
    loop's own), or are not known (a ``training_step`` that has returned)."""

    __slots__ = ("f_back", "f_code", "f_globals", "f_lasti", "f_lineno")

    def __init__(self, f: Any, back: _FrameAt | None) -> None:
        self.f_code, self.f_globals = f.f_code, f.f_globals
        self.f_lasti, self.f_lineno = f.f_lasti, f.f_lineno
        self.f_back = back

    @property
    def running(self) -> bool:
        """A frame of the same code still runs (its names can be read)."""
        f: Any = sys._getframe(1)
        while f is not None and f.f_code is not self.f_code:
            f = f.f_back
        return f is not None

    @property
    def f_locals(self) -> Any:
        f: Any = sys._getframe(1)
        free = self.f_code.co_freevars
        outer: Any = None
        while f is not None and f.f_code is not self.f_code:
            if outer is None and free and any(c is self.f_code for c in f.f_code.co_consts):
                outer = f
            f = f.f_back
        if f is not None:
            return f.f_locals
        if outer is not None:
            # a closure that has returned (a lambda, the closure of optimizer.step): the
            # names it took from the function that defined it, which still runs
            names = outer.f_locals
            return {k: names[k] for k in free if k in names}
        return {}


def _site_at(start: Any) -> _FrameAt | None:
    """The frames from the first one outside nanwatch and nn.Module's call machinery up
    to the user's (see :func:`_call_site_data`), as they stand now."""
    f = start
    while f is not None and (
        f.f_globals.get("__name__", "").startswith("nanwatch")
        or f.f_code.co_filename.endswith(_MODULE_CALL)
    ):
        f = f.f_back
    chain: list[Any] = []
    while f is not None and len(chain) < 32:
        chain.append(f)
        if not _frames.is_internal(f.f_code.co_filename):
            break  # the user's frame: the frames above it are not read
        f = f.f_back
    site: _FrameAt | None = None
    for fr in reversed(chain):
        site = _FrameAt(fr, site)
    return site


def _call_site_data(module: nn.Module, start: Any = None) -> dict[str, Any] | None:
    """Where the user's code called the root ``module`` (from its forward pre-hook: the
    frames below are the call's): ``code``, the user's line; ``callee``, the name that line
    calls the module by; and, when a library function made the call (``update_bn``),
    ``library`` (its module and name), ``user_code`` and ``user_source`` (the user's line
    that called that function). ``start``: those frames as kept by :func:`_site_at`."""
    f: Any = start if start is not None else sys._getframe(1)
    while f is not None and (
        f.f_globals.get("__name__", "").startswith("nanwatch")
        or f.f_code.co_filename.endswith(_MODULE_CALL)
    ):
        f = f.f_back  # nanwatch's hooks and nn.Module's call machinery
    if f is None:
        return None
    user = _frames.user_frame(f)
    if user is None:
        return None
    if user is f:
        source, code = _frames.describe_frame(f)
        return {"code": str(code or ""), "source": source, "callee": _name_in_frame(f, module)}
    source, code = _frames.describe_frame(user)
    name = f.f_globals.get("__name__", "?")
    return {
        "code": str(_frames.describe_frame(f)[1] or ""),
        "library": f"{name}.{f.f_code.co_name}",
        "user_code": str(code or ""),
        "user_source": source,
        "callee": _name_in_frame(f, module),
    }


#: torch's lr schedulers (ReduceLROnPlateau is one since torch 2.2)
_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _name_in_frame(frame: Any, obj: Any) -> str | None:
    """The name ``frame`` holds ``obj`` under: a local, an attribute of its ``self``
    (``self.optimizer``), or a global of its module (a training function that uses the
    script's ``optimizer``)."""
    if frame is None:
        return None
    local = frame.f_locals  # a dict, or (python 3.13) a proxy with the same methods
    attrs = getattr(local.get("self"), "__dict__", None)
    scopes: list[tuple[Any, str]] = [(local, ""), (attrs, "self."), (frame.f_globals, "")]
    # a method of ``obj`` itself (its forward, ``def forward(s, x)``): the name of its
    # first argument is ``self`` under another name, not the caller's name for it
    code = frame.f_code
    receiver = code.co_varnames[0] if code.co_argcount else None
    method = getattr(type(obj), code.co_name, None)
    if getattr(method, "__code__", None) is not code:
        receiver = None
    for names, prefix in scopes:
        if not hasattr(names, "items"):
            continue
        for key, value in names.items():
            if (
                value is obj
                and isinstance(key, str)
                and key.isidentifier()
                and key != "self"
                and not (prefix == "" and names is local and key == receiver)
            ):
                return prefix + key
    return None


#: the group keys that weigh a running average (NW306: one >= 1 grows the update) in the
#: torch.optim classes (and their subclasses) where they mean that; the same keys in
#: another optimizer's groups (SAM's neighbourhood radius ``rho``, ASGD's ``alpha``) do not
_AVERAGED_BY: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("SGD",), ("momentum",)),
    (("RMSprop",), ("momentum", "alpha")),
    (("Adadelta",), ("rho",)),
    (("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "SparseAdam"), ("betas",)),
)
_averages_cache: dict[type, list[str]] = {}


def _averaged_keys(optimizer: Any) -> list[str]:
    """The keys of ``optimizer``'s groups that weigh a running average, by its class
    (see ``_AVERAGED_BY``); cached per class."""
    cls = type(optimizer)
    keys = _averages_cache.get(cls)
    if keys is None:
        keys = []
        for names, ks in _AVERAGED_BY:
            bases = tuple(c for n in names if isinstance(c := getattr(torch.optim, n, None), type))
            if bases and isinstance(optimizer, bases):
                keys += [k for k in ks if k not in keys]
        _averages_cache[cls] = keys
    return list(keys)


def _plain_numbers(v: Any) -> list[float]:
    """A hyperparameter as floats: a number (a numpy scalar too: ``np.float32`` from an
    ``lr_lambda`` is a real number), a CPU scalar tensor, or a tuple of numbers (Adafactor's
    eps); [] for anything else (a CUDA tensor is not read: no sync)."""
    items = v if isinstance(v, (tuple, list)) else (v,)
    out: list[float] = []
    for x in items:
        if isinstance(x, bool):
            return []
        cpu_scalar = isinstance(x, torch.Tensor) and x.numel() == 1 and x.device.type == "cpu"
        if not (isinstance(x, numbers.Real) or cpu_scalar):
            return []
        out.append(float(x))
    return out


class _ScalerTap(_Tap):
    """A scoped wrapper of ``GradScaler.scale``, installed while at least one watcher is
    attached: the first ``scaler.scale(loss)`` tells every watcher that was given no scaler
    which one is in use, so the inf/NaN gradients a scaler expects now and then (and skips
    the step for) are not reported as anomalies, and its scale is followed (NW305). A loop
    that forgets ``watch(..., scaler=scaler)`` -- and every script under ``nanwatch run`` --
    is then read as it runs."""

    def __init__(self) -> None:
        super().__init__()
        self._originals: dict[type, Callable[..., Any]] = {}

    def _patch(self) -> None:
        for cls in _grad_scaler_classes():
            original = vars(cls)["scale"]
            self._originals[cls] = original
            cls.scale = self._wrap(original)  # type: ignore[attr-defined]

    def _unpatch(self) -> None:
        for cls, original in self._originals.items():
            if getattr(vars(cls).get("scale"), "_nanwatch_tap", False):
                cls.scale = original  # type: ignore[attr-defined]
        self._originals = {}

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def scale(scaler: Any, outputs: Any) -> Any:
            out = original(scaler, outputs)
            for w in list(self._watchers):
                w._found_scaler(scaler, out)
            return out

        scale._nanwatch_tap = True  # type: ignore[attr-defined]
        return scale


_scaler_tap = _ScalerTap()


class _ClipTap(_Tap):
    """``torch.nn.utils.clip_grad_norm_``, wrapped while at least one watcher is attached.
    Its rescale multiplies every gradient by min(max_norm / (total + 1e-6), 1): a finite
    factor for finite gradients (0 when their norm overflows), so gradients the end of
    backward read as finite stay finite. Each watcher notes their new versions
    (:meth:`Watcher._clipped`), and the optimizer pre-hook does not read them again as
    gradients written after backward (:meth:`Watcher._bad_in_place`): on the CPU that read
    was a second pass over every gradient, each step of every loop that clips."""

    _modules = ("torch.nn.utils", "torch.nn.utils.clip_grad")

    def __init__(self) -> None:
        super().__init__()
        self._originals: dict[str, Callable[..., Any]] = {}

    def _patch(self) -> None:
        for name in self._modules:
            mod = sys.modules.get(name)
            original = getattr(mod, "clip_grad_norm_", None)
            if mod is None or original is None or getattr(original, "_nanwatch_tap", False):
                continue
            self._originals[name] = original
            mod.clip_grad_norm_ = self._wrap(original)  # type: ignore[attr-defined]

    def _unpatch(self) -> None:
        for name, original in self._originals.items():
            mod = sys.modules.get(name)
            if mod is not None and getattr(mod.clip_grad_norm_, "_nanwatch_tap", False):
                mod.clip_grad_norm_ = original  # type: ignore[attr-defined]
        self._originals = {}

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def clip_grad_norm_(parameters: Any, max_norm: Any, *args: Any, **kwargs: Any) -> Any:
            # a generator is read once: the list goes to torch, which lists it anyway
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            out = original(params, max_norm, *args, **kwargs)
            for w in list(self._watchers):
                try:
                    w._clipped(params, max_norm)
                except Exception as exc:  # nanwatch never breaks the loop it watches
                    w._fault("gradients", "clip_grad_norm_ tap", exc)
            return out

        clip_grad_norm_._nanwatch_tap = True  # type: ignore[attr-defined]
        return clip_grad_norm_


_clip_tap = _ClipTap()

#: the attached watchers of this process
_live: weakref.WeakSet[Watcher] = weakref.WeakSet()
#: the order records are made in, across the watchers of the process (``Record.seq``)
_RECORD_ORDER = itertools.count()


def _take_turns(attached: Watcher) -> None:
    """``attached`` was just attached: a global watcher (``nanwatch run``'s,
    :func:`watch_all`) stands aside while a watcher of named modules is attached too (see
    :meth:`Watcher._stand_aside`)."""
    for other in list(_live):
        if other is attached or other._forked:
            continue
        if attached.global_hooks and not other.global_hooks:
            attached._stand_aside(other, True)
        elif other.global_hooks and not attached.global_hooks:
            other._stand_aside(attached, True)


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, a multiprocessing fork) runs none of its
    parent's watching: every attached watcher removes its hooks there quietly, with no
    record, no guard, no step boundary and no report. The parent's watchers see the
    child's results (a batch, torch's own error) as they arrive."""
    for tap in (_backward_tap, _scaler_tap):
        tap._lock = threading.Lock()  # a lock another parent thread held stays held here
    for w in list(_live):
        w._forked = True
        w._quiet = True
        with contextlib.suppress(Exception):  # nothing in a child may stop its work
            w.detach()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


#: weights of at most this many values in all, on the CPU, are checked with one max over
#: their concatenation (copying them costs less than a kernel launch per weight)
_FLAT_WEIGHTS = 1 << 16

#: a loss computed outside the modules: at most this many of its autograd nodes (those
#: nearest the loss) are looked at for a gradient check in watch mode. Loss code written as
#: a loop over time steps (a hand-written CTC or HMM forward algorithm: about 8 nodes a
#: frame) makes thousands; the watched modules' own nodes are never walked. Measured on
#: CPU (one thread), each node costs about 10 us a step, walk, hook and check together,
#: about half of what the loss code's own forward and backward cost: a CTC over 200
#: frames (1,600 nodes) takes 42 ms a step unwatched, 69 ms watched (49 ms with 64 nodes)
_LOSS_NODES = 4096
#: bad records a step described in full after the accelerator path read them (a read each)
_DESCRIBE_BAD = 32
#: and at most this many gradient elements in all (each checked gradient is read once):
#: a model left unwatched behind a functional loss is not read through whole every step
_LOSS_ELEMENTS = 1 << 24
#: autograd nodes whose backward only moves, masks or spreads the gradient: finite in,
#: finite out, so their gradients need no check of their own
_GRAD_MOVERS = frozenset(
    f"{op}Backward{n}"
    for op in (
        "Neg", "Cat", "Stack", "View", "Reshape", "UnsafeView", "Permute", "Transpose", "T",
        "Slice", "Select", "Clone", "Squeeze", "Unsqueeze", "Split", "SplitWithSizes", "Unbind",
        "Chunk", "Narrow", "Flatten", "Sum", "Mean", "Relu", "Threshold",
    )
    for n in (0, 1, 2)
)  # fmt: skip

#: the call of a loss computed outside any module
_LOSS_INFO = _ModInfo(LOSS_PATH, nn.Identity(), is_root=True, first_root=False)
_LOSS_INFO.type_name = "functional"
_LOSS_INFO.is_loss = True


_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction
#: From this many values on, a view of values the step measured already is not read again
#: (see Watcher._read_of): below it the read costs less than keeping track of it.
_REREAD_NUMEL = 1 << 16
_compiling = compiling


def _dynamo_frames() -> int | None:
    """How many frames torch.compile (TorchDynamo) has compiled in this process, from its
    own counter, without importing it; None when it was never imported (nothing ran
    compiled). 0 on a torch whose counters are laid out otherwise: only a compiled graph's
    node is evidence there."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return None
    try:
        return int(utils.counters["frames"]["total"])
    except Exception:
        return 0


#: Under a FakeTensorMode (torch.compile, export, meta-device initialisation) tensors
#: hold no values, under a torch.func transform (per-sample gradients with vmap, a
#: Hessian) they are wrappers whose values cannot be read, and under ``torch.jit.trace``
#: every read would be recorded as a constant of the traced graph (a TracerWarning): the
#: hooks stay out of the way. One call of C checks: every hook call asks it.
_tracing: Callable[[], bool] = values_hidden


def _grad_elements(node: Any) -> int:
    """How many elements the gradients ``node`` receives hold (from the shapes autograd
    keeps for them; 1 when it keeps none)."""
    n = 0
    for meta in getattr(node, "_input_metadata", ()):
        try:
            n += math.prod(meta.shape)
        except Exception:  # a nested tensor has no single shape
            n += 1
    return max(n, 1)


#: dtypes whose range is far below float32's (float16, float8): their outputs made by a
#: product or quotient get their autograd graph read (a statistic taken in them overflows)
_SHORT_RANGE = frozenset(
    d
    for d in (
        torch.float16,
        getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e5m2", None),
        getattr(torch, "float8_e4m3fnuz", None),
        getattr(torch, "float8_e5m2fnuz", None),
    )
    if d is not None
)

#: autograd nodes whose backward can make inf or NaN from a finite gradient and finite
#: forward values (a derivative infinite at a point of the domain: sqrt at 0, 1/x at 0)
_RISKY_BACKWARD = frozenset(
    {
        "Sqrt", "Rsqrt", "Pow", "Div", "Reciprocal", "Log", "Log2", "Log10", "Log1P",
        "LinalgVectorNorm", "Norm", "Cdist", "Acos", "Asin", "Atanh", "Acosh", "Atan2",
        "Xlogy", "Lgamma", "Digamma", "Polygamma", "Erfinv",
        # -log(x) - 1 is inf at 0; exp(x - lse) is NaN where a whole row is -inf (a CTC's
        # or a masked attention's logsumexp whose -inf the loss code masks afterwards)
        "SpecialEntr", "Logsumexp",
    }
)  # fmt: skip

#: the nodes the accelerator path flags (see ``_flag_loss_nodes``): the risky ones, and
#: exp, whose gradient is 0 × inf = NaN where its forward overflowed and the loss code
#: discarded the inf (PPO's ratio under torch.min); the CPU checks every node instead
_FLAGGED_BACKWARD = _RISKY_BACKWARD | {"Exp"}
#: autograd nodes whose backward multiplies the incoming gradient by what they saved of
#: their operands (by the ``_saved_*`` name): a NaN or inf held there makes the gradient
#: NaN where it is 0 (a masked entry), inf elsewhere
_GRAD_FACTORS: dict[str, tuple[str, ...]] = {
    "Mul": ("_saved_self", "_saved_other"),
    "Div": ("_saved_self",),
    "Pow": ("_saved_self",),
    "Mm": ("_saved_self", "_saved_mat2"),
    "Bmm": ("_saved_self", "_saved_mat2"),
    "Addmm": ("_saved_mat1", "_saved_mat2"),
    "Addcmul": ("_saved_tensor1", "_saved_tensor2"),
    "Dot": ("_saved_self", "_saved_tensor"),
}
#: bytes of what flagged loss-code nodes saved, kept a step until their flags are read on
#: the accelerator path (see Watcher._keep_saved): a hand-written loss over a batch's
#: logits fits; a node past it is named by its name alone
_KEEP_SAVED = 64 << 20
#: the logs among them: a flag of one keeps what the graph says its input was made by
_LOGS = frozenset({"Log", "Log2", "Log10"})


def _pow_exponent(node: Any) -> int | float | None:
    """The number a ``PowBackward`` node saved as its exponent; None for a tensor one."""
    e = getattr(node, "_saved_exponent", None)
    return e if isinstance(e, (int, float)) and not isinstance(e, bool) else None


def _whole_power(e: int | float | None) -> bool:
    """``x ** e`` has a finite derivative everywhere (a whole power of at least 1)."""
    return e is not None and e >= 1 and float(e).is_integer()


def _same_ends(a: TensorStat, b: TensorStat) -> bool:
    """The two statistics read the same min and max (NaN equal to NaN)."""
    return all(
        x == y or (math.isnan(x) and math.isnan(y)) for x, y in ((a.min, b.min), (a.max, b.max))
    )


def _raising_layer(
    exc: BaseException, watched: Mapping[nn.Module, Any]
) -> tuple[nn.Module, tuple[int, ...]] | None:
    """The innermost watched module whose own method was running when ``exc`` was raised,
    with the shape of the tensor that method was given first (``forward(self, input)``,
    ``Conv2d._conv_forward(self, input, ...)``), read from the traceback's frames; None
    when no such frame holds a tensor."""
    calls = _watched_calls(exc, watched)
    return (calls[-1][0], tuple(calls[-1][1][0].shape)) if calls else None


def _watched_calls(
    exc: BaseException, watched: Mapping[nn.Module, Any]
) -> list[tuple[nn.Module, list[torch.Tensor]]]:
    """The watched modules whose own methods were running when ``exc`` was raised, outermost
    first, each with the tensors its method was given first, in order (read from the
    traceback's frames; a frame whose first argument is no tensor is left out)."""
    found: list[tuple[nn.Module, list[torch.Tensor]]] = []
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        owner = frame.f_locals.get("self")
        if not isinstance(owner, nn.Module) or owner not in watched:
            continue
        code = frame.f_code
        if code.co_argcount < 2:
            continue
        tensors: list[torch.Tensor] = []
        for name in code.co_varnames[1 : code.co_argcount]:
            a = frame.f_locals.get(name)
            if not isinstance(a, torch.Tensor):
                break
            tensors.append(a)
        if tensors:
            found.append((owner, tensors))
    return found


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # no storage (a functional or fake tensor)
        return a is b


def _dtype_advice(
    exc: BaseException, watched: Mapping[nn.Module, Any], batch: Callable[[torch.Tensor], bool]
) -> str | None:
    """For a dtype error raised in a watched layer: the dtype of its weights against its
    input's (a float64 batch from numpy into float32 weights, integer pixels or ids into a
    layer, a layer of another dtype than the rest of the model), and where to cast. The
    input is the batch when ``batch`` says it is the model's input this step (or a view of
    it). None when the error is not that (a loss's target is checked by the guards)."""
    calls = _watched_calls(exc, watched)
    if not calls:
        return None
    module, given = calls[-1]
    path, kind = watched[module].path, type(module).__name__
    x = given[0]
    weight = next((p for p in module.parameters(recurse=False) if p.is_floating_point()), None)
    if weight is None or x.dtype == weight.dtype:
        return None
    have, got = dtype_name(weight.dtype), dtype_name(x.dtype)
    head = f"{path} ({kind}) has {have} weights, but its input is {got}"
    batch_in = batch(x)
    like = ", the model's input" if batch_in else ""
    if not (x.is_floating_point() or x.is_complex()):
        return (
            f"{head} (raw pixel values, or token ids){like}: cast the batch where it is "
            "made, x = x.float() / 255 for pixels, or give ids to an nn.Embedding first."
        )
    if batch_in and weight.dtype == torch.float32 and x.dtype == torch.float64:
        return (
            f"{head}{like} (numpy's default dtype, through torch.from_numpy or torch.tensor): "
            "cast it where it is made, x = x.float() (or X.astype(np.float32) in the "
            "dataset). model.double() would run every step in float64, far slower."
        )
    if batch_in and weight.dtype == torch.float64:
        return (
            f"{head}{like}: the model is float64 (model.double(), or weights made from "
            "float64 arrays), so call model.float() once after building it, or cast the "
            "batch with x = x.double() if float64 is meant."
        )
    if batch_in:
        return (
            f"{head}{like}: cast the batch where it is made, x = x.to("
            f"{_dtype_ref(weight.dtype)}), or run the forward under torch.autocast, which "
            "casts each op's inputs itself."
        )
    return (
        f"{head}, made by the layers before it: the model mixes {have} and {got} weights. "
        f"Give it one dtype, model.to({_dtype_ref(x.dtype)}), or run the forward under "
        "torch.autocast, which casts each op's inputs itself."
    )


def _dtype_ref(dtype: torch.dtype) -> str:
    return f"torch.{dtype_name(dtype)}"


def _one_value_advice(exc: BaseException, watched: Mapping[nn.Module, Any]) -> str | None:
    """For a norm that refused one value per channel in training (see
    :func:`_raising_layer`): the layer, the shape it was given and what to change; None
    when no watched norm was running.

    >>> bn = nn.BatchNorm1d(8)
    >>> try:
    ...     bn(torch.randn(1, 8))
    ... except ValueError as e:
    ...     info = _ModInfo("head.bn", bn, is_root=False, first_root=False)
    ...     print(_one_value_advice(e, {bn: info})[:62])
    head.bn (BatchNorm1d) got an input of shape [1, 8] in training
    """
    found = _raising_layer(exc, watched)
    if found is None:
        return None
    module, shape = found
    path, kind = watched[module].path, type(module).__name__
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return (
            f"{path} ({kind}) got an input of shape {list(shape)} in training, a map of one "
            "element per channel, whose variance cannot be computed: give the model larger "
            f"inputs or fewer downsamplings before {path}, or use a GroupNorm there."
        )
    if not isinstance(module, nn.modules.batchnorm._BatchNorm):
        return None
    return (
        f"{path} ({kind}) got an input of shape {list(shape)} in training, one value per "
        "channel, whose variance cannot be computed: drop the epoch's short last batch "
        "(DataLoader(..., drop_last=True)) or skip batches of 1 (if x.shape[0] > 1). It is "
        "a batch of 1 sample, left over when the dataset's size is not a multiple of the "
        "batch size. Call model.eval() before predicting one sample; to train on batches of "
        "1, use GroupNorm or LayerNorm in its place."
    )


def _fixed_batch_reshape(exc: BaseException, batch: int) -> tuple[str, str] | None:
    """The user's line on the error's traceback that reshapes with the earlier batch size
    written as a number (``h.view(16, -1)``): (``file.py:9``, its text); None when none."""
    pattern = re.compile(rf"\.(view|reshape)\(\s*{batch}\s*,")
    found = None
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        name = frame.f_code.co_filename
        if _frames.is_internal(name):
            continue
        text = linecache.getline(name, lineno).split("#")[0].strip()
        if pattern.search(text):
            found = (f"{os.path.basename(name)}:{lineno}", text)  # the innermost one
    return found


#: the autograd node an expression's outermost operator makes (``a ** 2``: PowBackward0)
_BINOP_NODES = {
    ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div", ast.Pow: "pow",
    ast.MatMult: "matmul",
}  # fmt: skip


def _top_node(expr: ast.expr) -> str | None:
    """The autograd node ``expr``'s outermost operation makes, lowercase without
    underscores (``a ** 2``, ``x.pow(2)``: ``pow``; ``torch.log(p)``: ``log``); ``scalar``
    when it makes one number (``x.mean()``, a functional loss with its default reduction);
    None when the code does not say (a call of a module, of the user's own function, or
    of a functional loss made of other ops)."""
    if isinstance(expr, ast.BinOp):
        return _BINOP_NODES.get(type(expr.op))
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub):
        return "neg"
    if not isinstance(expr, ast.Call) or not isinstance(expr.func, ast.Attribute):
        return None
    name, owner = expr.func.attr, expr.func.value
    if name in ("mean", "sum") and not expr.args and not expr.keywords:
        return "scalar"
    if (isinstance(owner, ast.Name) and owner.id == "F") or (
        isinstance(owner, ast.Attribute) and owner.attr == "functional"
    ):
        reduction = next((k.value for k in expr.keywords if k.arg == "reduction"), None)
        kept = isinstance(reduction, ast.Constant) and reduction.value == "none"
        if (re.search(r"(loss|entropy|kl_div)$", name) and reduction is None) or (
            isinstance(reduction, ast.Constant) and not kept
        ):
            return "scalar"  # reduced by default: not the tensor of many values
        return None  # F.cross_entropy(..., reduction="none"): NllLossBackward0
    return name.replace("_", "").lower()


def _assigned_above(
    filename: str, lineno: int, call: str | None, node: str | None = None
) -> tuple[str, str, str] | None:
    """For ``NAME.backward()`` at ``lineno``: the latest single-line statement above it in
    the same function that assigns NAME (``NAME = EXPR``) and whose outermost operation can
    make ``node`` (the tensor's autograd node: ``PowBackward0``; an ``elif`` branch that
    made the loss otherwise is passed over), as (``file.py:N``, its text, the text with
    EXPR reduced by ``.mean()``); None when not found."""
    want = re.sub(r"Backward\d*$", "", node).replace("_", "").lower() if node else None
    m = re.search(r"([A-Za-z_]\w*)\s*\.\s*backward\s*\(", call or "")
    if m is None:
        return None
    name = m.group(1)
    here = linecache.getline(filename, lineno)
    indent = len(here) - len(here.lstrip())
    assign = re.compile(rf"^\s*{name}\s*=\s*(?P<expr>[^=].*)$")
    for n in range(lineno - 1, 0, -1):
        text = linecache.getline(filename, n)
        if not text.strip():
            continue
        if len(text) - len(text.lstrip()) < indent and text.lstrip().startswith(("def ", "class ")):
            return None  # the function's start: not assigned in it
        code = (
            text.split("#", 1)[0].strip() if "'" not in text and '"' not in text else text.strip()
        )
        found = assign.match(code)
        if found is None:
            continue
        expr = found.group("expr").strip()
        try:
            tree = ast.parse(expr, mode="eval").body
        except SyntaxError:
            return None  # a statement over several lines: not rewritten
        top = _top_node(tree)
        if top == "scalar" or (want is not None and top is not None and top != want):
            continue  # another branch's statement: it makes another node, or one number
        plain = isinstance(tree, (ast.Call, ast.Name, ast.Attribute, ast.Subscript))
        reduced = f"{name} = {expr}.mean()" if plain else f"{name} = ({expr}).mean()"
        return _frames.describe_line(filename, n)[0], code, reduced
    return None


def _root_input(trace: StepTrace) -> Record | None:
    """The record of the first input of the step's first model call (a root's, not a loss
    module's); None when none was recorded."""
    call = next((c for c in trace.calls if c.root and not c.is_loss), None)
    if call is None:
        return None
    return next(
        (
            r
            for r in trace.records
            if r.call == call.id and r.phase is Phase.INPUT and r.role == "input[0]"
        ),
        None,
    )


def _root_input_shape(trace: StepTrace) -> tuple[int, ...] | None:
    rec = _root_input(trace)
    return tuple(rec.shape) if rec is not None else None


def _size_mismatch(module: nn.Module, shape: tuple[int, ...]) -> tuple[str, int, int, str] | None:
    """(what, built for, given, the constructor that takes the input as it is) when
    ``module`` fixes a size of its input that ``shape`` does not have; None otherwise.

    >>> _size_mismatch(nn.Linear(6, 1), (2, 8))
    ('in_features', 6, 8, 'nn.Linear(8, 1)')
    >>> _size_mismatch(nn.Conv2d(3, 16, 3), (4, 1, 28, 28))[3]
    'nn.Conv2d(1, 16, kernel_size=(3, 3))'
    """
    if isinstance(module, nn.Linear) and shape:
        want, got = module.in_features, shape[-1]
        if want != got:
            bias = "" if module.bias is not None else ", bias=False"
            return "in_features", want, got, f"nn.Linear({got}, {module.out_features}{bias})"
        return None
    if isinstance(module, nn.modules.conv._ConvNd) and not isinstance(
        module, nn.modules.conv._ConvTransposeNd
    ):
        dims = len(module.kernel_size)
        if len(shape) not in (dims + 1, dims + 2):
            return None
        got = shape[1] if len(shape) == dims + 2 else shape[0]
        want = module.in_channels
        if want != got:
            cls = type(module).__name__
            k = tuple(module.kernel_size)
            return (
                "in_channels",
                want,
                got,
                f"nn.{cls}({got}, {module.out_channels}, kernel_size={k})",
            )
        return None
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and len(shape) >= 2:
        want, got = module.num_features, shape[1]
        if want != got:
            return "num_features", want, got, f"nn.{type(module).__name__}({got})"
        return None
    if isinstance(module, nn.RNNBase) and shape:
        want, got = module.input_size, shape[-1]  # a packed sequence's data: (values, features)
        if want != got:
            return "input_size", want, got, _rnn_rebuilt(module, got)
        return None
    if isinstance(module, nn.LayerNorm):
        ns = tuple(module.normalized_shape)
        got_ns = shape[-len(ns) :] if len(shape) >= len(ns) else shape
        if tuple(got_ns) != ns:
            want_s = ns[0] if len(ns) == 1 else list(ns)
            got_s = got_ns[0] if len(got_ns) == 1 else list(got_ns)
            return "normalized_shape", want_s, got_s, f"nn.LayerNorm({got_s})"  # type: ignore[return-value]
        return None
    return None


def _rnn_rebuilt(module: nn.RNNBase, size: int) -> str:
    """The constructor of ``module`` (an ``nn.RNN``/``LSTM``/``GRU``) for inputs of ``size``
    features, with the options it was built with.

    >>> _rnn_rebuilt(nn.LSTM(8, 16, num_layers=2, batch_first=True), 12)
    'nn.LSTM(12, 16, num_layers=2, batch_first=True)'
    """
    args = [str(size), str(module.hidden_size)]
    if module.num_layers != 1:
        args.append(f"num_layers={module.num_layers}")
    if isinstance(module, nn.RNN) and module.nonlinearity != "tanh":
        args.append(f"nonlinearity={module.nonlinearity!r}")
    if module.batch_first:
        args.append("batch_first=True")
    if module.bidirectional:
        args.append("bidirectional=True")
    if getattr(module, "proj_size", 0):
        args.append(f"proj_size={module.proj_size}")
    return f"nn.{type(module).__name__}({', '.join(args)})"


def _features_first(module: nn.Module, shape: tuple[int, ...]) -> str | None:
    """For a batch-first ``nn.RNN``/``LSTM``/``GRU`` given (batch, features, steps), the
    layout a 1-d convolution or a spectrogram gives: the transpose that puts the features
    last. None otherwise.

    >>> _features_first(nn.GRU(8, 16, batch_first=True), (4, 8, 50))[-27:]
    'x.transpose(1, 2) before it'
    >>> _features_first(nn.GRU(8, 16), (4, 8, 50)) is None  # (steps, batch, features): no
    True
    """
    if (
        not isinstance(module, nn.RNNBase)
        or not module.batch_first
        or len(shape) != 3
        or shape[1] != module.input_size
        or shape[2] == module.input_size
    ):
        return None
    return (
        "its features are in dim 1, as a 1-d convolution or a spectrogram gives (batch, "
        "features, steps): x = x.transpose(1, 2) before it"
    )


def _channels_last(module: nn.Module, shape: tuple[int, ...]) -> tuple[int, str] | None:
    """For a convolution given an input whose channels are its last dim (``[N, H, W, C]``,
    as PIL, NumPy and OpenCV images come): the dim the convolution reads its channels
    from, and the permute that puts them there. None otherwise.

    >>> dim, said = _channels_last(nn.Conv2d(3, 8, 3), (4, 32, 32, 3))
    >>> dim, "x = x.permute(0, 3, 1, 2)" in said
    (1, True)
    >>> _channels_last(nn.Conv2d(3, 8, 3), (3, 32, 32, 3)) is None  # a batch of 3 HWC images
    False
    """
    if not isinstance(module, nn.modules.conv._ConvNd):
        return None
    dims = len(module.kernel_size)
    batched = len(shape) == dims + 2
    if len(shape) not in (dims + 1, dims + 2) or shape[-1] != module.in_channels:
        return None
    if shape[1 if batched else 0] == module.in_channels:
        return None
    order = (0, dims + 1, *range(1, dims + 1)) if batched else (dims, *range(dims))
    return 1 if batched else 0, (
        "channels last, as images from PIL, NumPy or OpenCV come; put them first: "
        f"x = x.permute{order}{'' if batched else '.unsqueeze(0)'} before the model "
        "(transforms.ToTensor() does it for a PIL image or an HWC array)"
    )


def _nonfinite_values(t: torch.Tensor) -> bool:
    """``t`` holds a NaN or inf (a read; a tensor with no values to read holds none)."""
    return t.is_floating_point() and not _has_no_data(t) and not _finite(t)


def _risky_backward(node: Any) -> bool:
    """``node``'s backward can make a non-finite gradient from a finite one (see
    :data:`_RISKY_BACKWARD`; ``x ** 2`` cannot)."""
    base = re.sub(r"Backward\d*$", "", type(node).__name__)
    if base == "Pow" and _whole_power(_pow_exponent(node)):
        return False
    return base in _RISKY_BACKWARD


#: the saved value of a node (no restricted domain of its own, see :mod:`nanwatch._domains`)
#: at which its derivative is infinite: (the ``_saved_*`` attribute, the point). A
#: fractional power's base at 0 (``0.5 * 0 ** -0.5``), a sqrt's result at 0, a divisor at
#: 0, an rsqrt's or a reciprocal's result at inf (their input at 0)
_STEEP_AT: dict[str, tuple[str, float]] = {
    "Pow": ("_saved_self", 0.0),
    "Sqrt": ("_saved_result", 0.0),
    "Rsqrt": ("_saved_result", math.inf),
    "Reciprocal": ("_saved_result", math.inf),
    "Div": ("_saved_other", 0.0),
}


def _steep_count(snap: ops.SavedNode) -> int:
    """How many of the values a loss-code node saved lie where its derivative is infinite
    (:data:`_STEEP_AT`; a log's 0, an atanh's 1, an acos's endpoint, a pole of lgamma, from
    the op's domain): its backward makes inf, or NaN where the gradient is 0, from any
    finite gradient there. Reads them: anomaly-time work only."""
    name = ops.name_of(snap.node)
    dom = domain_of(ops.node_op(name))
    if dom is not None:
        v = getattr(snap, f"_saved_{dom.arg}", None)
        if not isinstance(v, torch.Tensor) or not v.is_floating_point() or _has_no_data(v):
            return 0
        counts = ops.domain_counts(dom, v)
        n = counts.get("n_edge", 0) + counts.get("n_pole", 0)
        if dom.steep_edges:
            with torch.no_grad():
                n += sum(int((v == e).sum()) for e in {dom.lo, dom.hi} if math.isfinite(e))
        return n
    spec = _STEEP_AT.get(re.sub(r"Backward\d*$", "", name))
    if spec is None:
        return 0
    attr, point = spec
    if attr == "_saved_self":  # a power: only below 1 (and not 0) is it steep at 0
        e = _pow_exponent(snap)
        if e is None or e >= 1 or e == 0:
            return 0
    v = getattr(snap, attr, None)
    if not isinstance(v, torch.Tensor) or not v.is_floating_point() or _has_no_data(v):
        return 0
    with torch.no_grad():
        return int((v == point).sum())


def _steep_capable(node: Any) -> bool:
    """``node``'s backward can make a non-finite gradient from a finite one (see
    :func:`_risky_backward`) at a point :func:`_steep_count` can find in what it saved: what
    is kept of it, read late, can tell (see :mod:`nanwatch._kept`)."""
    typ = type(node)
    known = _STEEP_KINDS.get(typ)
    if known is None:
        name = typ.__name__
        base = re.sub(r"Backward\d*$", "", name)
        steep = base in _STEEP_AT or domain_of(ops.node_op(name)) is not None
        known = _STEEP_KINDS[typ] = steep and base in _RISKY_BACKWARD
    return known and (typ.__name__ != "PowBackward0" or _risky_backward(node))


#: :func:`_steep_capable` by node type, but for a power's exponent
_STEEP_KINDS: dict[type, bool] = {}


def _post_order(nodes: Sequence[Any]) -> list[Any]:
    """``nodes`` (autograd nodes, each once) with every node after those it sends its
    gradient to, among them: an iterative depth-first walk (a graph thousands deep)."""
    among = {id(n): n for n in nodes}
    done: set[int] = set()
    out: list[Any] = []
    for first in nodes:
        if id(first) in done:
            continue
        stack: list[tuple[Any, bool]] = [(first, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                out.append(node)
                continue
            if id(node) in done:
                continue
            done.add(id(node))
            stack.append((node, True))
            for n, _ in node.next_functions:
                if n is not None and id(n) in among and id(n) not in done:
                    stack.append((n, False))
    return out


def _place(
    ev: OpEvent, line: tuple[str | None, str | None], site: tuple[str | None, str | None]
) -> None:
    """The lines of ``ev``, a loss-code node's backward event: ``line``, the forward line that
    created the node where anomaly mode kept it (``Trainer(detect_anomaly=True)``,
    ``torch.autograd.detect_anomaly()``), else the ``backward()`` call ``site``, which is
    always ``backward_at``."""
    ev.source, ev.code = line if line[0] is not None else site
    ev.backward_at = site[0]
    ev.by_grad = ops._by_grad(sys._getframe())


def _node_event(
    name: str,
    path: str,
    out: TensorStat,
    dtype: str,
    site: tuple[str | None, str | None],
    *,
    scalars: dict[str, Any] | None = None,
) -> OpEvent:
    """The event of a loss-code autograd node named by its name alone (what it saved was
    freed before it could be read): its op, what it made, the user's backward() line."""
    source, code = site
    return OpEvent(
        op=ops.node_op(name),
        phase=Phase.BACKWARD,
        path=path,
        born=out.kinds(),
        output=out,
        source=source,
        code=code,
        node=name,
        dtype=dtype,
        backward_at=source,
        scalars=dict(scalars or {}),
    )


def _feeds_only(node: Any, stop: ops.NodeMarks, depth: int) -> bool:
    """Every gradient ``node`` makes goes to a node in ``stop`` (or a leaf), directly or
    through nodes that only move gradients."""
    for nxt, _ in node.next_functions:
        if nxt is None or nxt in stop:
            continue
        name = type(nxt).__name__
        if name == "AccumulateGrad":
            continue
        if depth > 0 and name in _GRAD_MOVERS and _feeds_only(nxt, stop, depth - 1):
            continue
        return False
    return True


def _reached(trace: StepTrace, anomaly: Anomaly) -> bool:
    """Some value of the step other than the bad data itself (a module's output, the loss,
    a gradient, a weight) holds NaN/inf."""
    src = anomaly.record
    for r in trace.records:
        if r is src or not r.bad:
            continue
        if trace.resolve(r) is src:
            continue
        return True
    return False


def _state_owner(
    modules: Sequence[tuple[nn.Module, _ModInfo]],
    replayed: nn.Module,
    *,
    target: Call,
    meant: Call,
    state: list[dict[str, Any]],
    written: list[str],
) -> tuple[nn.Module | None, Callable[[str], str | None]]:
    """When the root ``target`` was replayed in place of the call ``meant`` (whose inputs
    were gone when the accelerator path read the step): ``meant``'s module and a map of the
    names below the root to names below it, if every bad or written tensor is its own;
    else ``(None, ...)``: the root's names stand. What other modules hold is left out: the
    module's forward read only its own state (its inputs were recorded finite)."""
    keep: Callable[[str], str | None] = lambda n: n  # noqa: E731
    if target is meant:
        return None, keep
    # the module of that path that the root runs now: a submodule assigned after attach
    # (model.scale = Scale()) shares its path with the one it replaced
    below = {id(m): n for n, m in replayed.named_modules()}
    sub, prefix = next(
        ((m, below[id(m)]) for m, info in modules if info.path == meant.path and id(m) in below),
        (None, None),
    )
    names = [t["name"] for t in state] + list(written)
    if sub is None or not prefix or not any(n.startswith(prefix + ".") for n in names):
        return None, keep
    return sub, lambda n: n[len(prefix) + 1 :] if n.startswith(prefix + ".") else None


def _bad_state(module: nn.Module) -> list[dict[str, Any]]:
    """The non-finite tensors a module's forward reads that are not its inputs: its
    parameters and buffers and those of its submodules (by their names below it:
    ``fc.weight``), and plain tensor attributes (the ``weight`` a forward pre-hook such as
    ``nn.utils.weight_norm`` or ``spectral_norm`` computes before each call)."""
    found: dict[str, tuple[str, torch.Tensor]] = {}
    for name, param in module.named_parameters():
        found[name] = ("parameter", param)
    for name, buf in module.named_buffers():
        found.setdefault(name, ("buffer", buf))
    for prefix, sub in module.named_modules():
        if isinstance(sub, torch.jit.ScriptModule):
            continue
        # a pre-hook of the user's (nanwatch's own set nothing)
        hooked = any(k not in _copies._ids for k in sub._forward_pre_hooks)
        for name, value in vars(sub).items():
            if not isinstance(value, torch.Tensor) or name.startswith("__"):
                continue
            qual = f"{prefix}.{name}" if prefix else name
            if qual not in found:
                found[qual] = ("set by a forward pre-hook" if hooked else "attribute", value)
    out: list[dict[str, Any]] = []
    for name, (kind, t) in found.items():
        if not (t.is_floating_point() or t.is_complex()) or t.is_meta:
            continue
        if t.is_floating_point() and _finite(t.detach()):
            continue  # one read of the common case
        stat = describe(t.detach())
        if stat is not None and not stat.finite:
            out.append(
                {"name": name, "kind": kind, "stat": stat.kinds(), "dtype": dtype_name(t.dtype)}
            )
    return out


def _data_ptr(t: torch.Tensor) -> int:
    """Where a tensor's data is (``t.data = ...`` moves it without a version bump); 0 for
    one without storage (sparse)."""
    try:
        return int(t.data_ptr())
    except RuntimeError:
        return 0


def _uninitialized(t: torch.Tensor) -> bool:
    """A lazy module's parameter or buffer before its first forward: it has no data, and
    any op on it (``detach``, ``_version``) raises."""
    return nn.parameter.is_lazy(t)


def _needs_grad(args: tuple[Any, ...]) -> bool:
    """Some positional tensor argument requires a gradient (one look for one tensor)."""
    if len(args) == 1 and isinstance(args[0], torch.Tensor):
        return args[0].requires_grad
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args) or not all(
        isinstance(a, (torch.Tensor, int, float, bool, str, type(None))) for a in args
    )


def _grad_ends_here(t: torch.Tensor) -> bool:
    """``t``'s gradient flows only into leaves (parameters): the output of an embedding,
    or of a passthrough module applied to data that needs no gradient."""
    fn = t.grad_fn if t.requires_grad else None
    if fn is None:
        return False
    return all(nxt is None or ops.accumulates_grad(nxt) for nxt, _ in fn.next_functions)


def _norm64(g: torch.Tensor) -> float:
    """The L2 norm of a finite gradient whose squares overflow its dtype (values past
    sqrt(finfo.max)), in float64; inf when even that overflows or it cannot be read."""
    try:
        with torch.no_grad():
            v = g.coalesce().values() if g.is_sparse else g
            return float(torch.linalg.vector_norm(v.detach().double()))
    except Exception:
        return math.inf


#: float dtypes whose -inf a weight may hold as a constraint (see ``_neginf_at_start``)
_NEGINF_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _holds(module: nn.Module, param: nn.Parameter) -> bool:
    """``param`` is one of the parameters of ``module`` (or of its submodules)."""
    return any(p is param for p in module.parameters())


def _constrained_max(p: torch.Tensor, neginf: int) -> torch.Tensor:
    """A weight with ``neginf`` -inf constraints: max |w| over its other entries (NaN and
    +inf propagate), or inf when it holds more -inf than that (an update made one)."""
    low = torch.isneginf(p)
    top = torch.where(low, torch.zeros((), dtype=p.dtype, device=p.device), p.abs()).max()
    return torch.where(low.sum() > neginf, torch.full_like(top, math.inf), top)


def _line_unknown(ev: OpEvent, path: str) -> bool:
    """``ev`` is a backward node of ``path``'s own code that its hook named while backward
    ran, with the line that called backward() for its line: a node keeps no forward line
    without anomaly mode, and a replay of the module's code can name it."""
    own = ev.phase is Phase.BACKWARD and ev.path == path
    # a custom Function's own backward(), named by its node alone: its op and line there
    inner = not ev.op.startswith("aten.") and ops.custom_function(ev.node) is not None
    return own and (not ev.source or ev.source == ev.backward_at or inner)


def _finite(t: torch.Tensor) -> bool:
    """All values of ``t`` finite (read now: a sync on accelerators)."""
    if not t.is_floating_point():
        return True
    mm = read_minmax(t)
    return mm is None or (math.isfinite(mm[0]) and math.isfinite(mm[1]))


def _has_no_data(t: torch.Tensor) -> bool:
    """Tensors that stand for values without holding them (FakeTensor under tracing,
    functional wrappers): their statistics cannot be read."""
    name = type(t).__name__
    return name in ("FakeTensor", "FunctionalTensor") or torch._is_functional_tensor(t)


def _deliberate_exit(exc: BaseException) -> bool:
    """``sys.exit(...)``, whatever its code (an argparse usage error is 2), ends a script on
    purpose, and ``GeneratorExit`` is how Python closes a generator its caller left (a
    ``break`` out of a training loop that yields): the run ends as if the block had, with no
    post-mortem of the exit itself; an anomaly recorded before it is in the report as usual."""
    return isinstance(exc, (SystemExit, GeneratorExit))


def _hook_site(fn: Any) -> dict[str, Any] | None:
    """``fn``'s name, ``file:line`` and first source line, for a Python function or method
    (lambdas included); None for anything else."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    line = linecache.getline(code.co_filename, code.co_firstlineno).strip()
    return {
        "fn": str(getattr(fn, "__qualname__", "?")).rsplit("<locals>.", 1)[-1],
        "at": f"{code.co_filename}:{code.co_firstlineno}",
        "code": line,
    }


def _plain(obj: Any) -> Any:
    """``obj`` (dicts, lists, tuples, strings, numbers) with every ``str`` subclass (a
    :class:`nanwatch._frames.CodeLine`) made a plain ``str``: a checkpoint holding it loads
    with ``torch.load(weights_only=True)``, which takes no class."""
    if isinstance(obj, str):
        return obj if type(obj) is str else str(obj)
    if isinstance(obj, dict):
        return {_plain(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    return obj


_COUNT = re.compile(r"(?:; )?passed on by \d+ modules?")


def _without_count(summary: str) -> str:
    """``summary`` without its "passed on by N modules" clause.

    >>> _without_count("NaN in x [op aten.log; passed on by 1 module]")
    'NaN in x [op aten.log]'
    >>> _without_count("NaN in x [passed on by 3 modules]")
    'NaN in x'
    """
    out = _COUNT.sub("", summary).replace("[; ", "[")
    return out.replace(" []", "")


def _memory_at(t: torch.Tensor) -> int | None:
    """Where ``t``'s values start in memory; None where it has no plain memory (sparse,
    meta, a fake tensor under tracing) or no values."""
    try:
        if t.is_nested or t.layout is not torch.strided or t.device.type == "meta":
            return None
        if not t.numel():
            return None
        ptr = t.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return ptr or None


def _grad_fn_name(t: torch.Tensor) -> str | None:
    fn = t.grad_fn
    return None if fn is None else type(fn).__name__


def rec_numel(rec: Record) -> int:
    n = 1
    for s in rec.shape:
        n *= s
    return n


def watch_all(**options: Any) -> Watcher:
    """Watch every module called in this process while attached, through PyTorch's global
    module hooks: what ``nanwatch run script.py`` uses, so a script is watched without a code
    change. A module first called outside any watched call becomes a root, named by its
    class (``Net``, ``CrossEntropyLoss``) with its submodules by qualified name. Global hooks
    slow every module of the process, so keep the scope tight. ``options`` are those of
    :func:`watch`; keyword inputs of modules are not seen by global pre-hooks.

    Example:
        >>> with watch_all(on_anomaly="record") as nw:
        ...     _ = nn.Linear(2, 2)(torch.ones(1, 2))
        >>> nw.module_paths
        ['Linear']
    """
    config = options.pop("config", None)
    scaler = options.pop("scaler", None)
    if config is None:
        config = _config(**options)
    elif options:
        raise ConfigError(
            "config",
            config,
            "pass either config= or keyword options, not both: "
            f"got config and {', '.join(sorted(options))}.",
        )
    return Watcher([], config, scaler=scaler, global_hooks=True)


def watch(
    *modules: nn.Module | Sequence[nn.Module],
    mode: str = "watch",
    on_anomaly: str = "raise",
    sample_every: int = 1,
    ring_size: int = 32,
    report_dir: str = "nanwatch-reports",
    allow: Sequence[str] = (),
    ignore: Sequence[str] = (),
    guards: bool = True,
    functional_guards: bool = True,
    pinpoint: bool = True,
    postmortem: bool = True,
    scaler: Any = None,
    config: WatchConfig | None = None,
) -> Watcher:
    """Watch ``modules`` (the model, and the loss module when there is one) for non-finite
    values, forward and backward; returns a :class:`Watcher` to use as a context manager.
    A list or tuple of modules counts as those modules: ``watch([q, q_target], criterion)``.

    ``mode``: ``"sentinel"`` (loss, gradients, weights: near zero cost), ``"watch"`` (every
    module), ``"forensic"`` (every aten op: slow, for replays). ``on_anomaly``: ``"raise"``
    :class:`nanwatch.AnomalyError`, ``"warn"`` once, or ``"record"``. ``allow``: module-path
    patterns whose non-finite values are intended. ``scaler``: the ``GradScaler`` in use, so
    its expected overflows are not reported as anomalies (found by itself at the first
    ``scaler.scale(loss)`` when not given). ``config`` replaces the keyword options at once.

    Example:
        >>> model, criterion = nn.Linear(4, 1), nn.MSELoss()
        >>> with watch(model, criterion) as nw:
        ...     loss = criterion(model(torch.randn(8, 4)), torch.randn(8, 1))
        ...     loss.backward()
        ...     _ = nw.step()
        >>> print(nw.first_anomaly)
        None
    """
    if config is not None:
        given = {
            "mode": mode,
            "on_anomaly": on_anomaly,
            "sample_every": sample_every,
            "ring_size": ring_size,
            "report_dir": report_dir,
            "allow": tuple(allow) if isinstance(allow, (list, tuple)) else allow,
            "ignore": tuple(ignore) if isinstance(ignore, (list, tuple)) else ignore,
            "guards": guards,
            "functional_guards": functional_guards,
            "pinpoint": pinpoint,
            "postmortem": postmortem,
        }
        default = WatchConfig()
        mixed = [k for k, v in given.items() if v != getattr(default, k)]
        if mixed:
            raise ConfigError(
                mixed[0],
                given[mixed[0]],
                f"watch() takes either config= or keyword options, not both; got config= "
                f"and {', '.join(mixed)}=. Put them in the config: "
                f"config.replace({mixed[0]}={given[mixed[0]]!r}).",
            )
    if config is None:
        config = _config(
            mode=mode,
            on_anomaly=on_anomaly,
            sample_every=sample_every,
            ring_size=ring_size,
            report_dir=report_dir,
            allow=allow,
            ignore=ignore,
            guards=guards,
            functional_guards=functional_guards,
            pinpoint=pinpoint,
            postmortem=postmortem,
        )
    return Watcher(list(modules), config, scaler=scaler)


def _config(**options: Any) -> WatchConfig:
    for key in ("allow", "ignore"):
        value = options.get(key)
        if isinstance(value, (list, set, frozenset)):
            options[key] = tuple(value)
    try:
        return WatchConfig(**options)
    except TypeError as exc:  # an unknown keyword
        known = ", ".join(f.name for f in dataclasses.fields(WatchConfig))
        raise ConfigError("options", options, f"{exc}; known options: {known}.") from None
