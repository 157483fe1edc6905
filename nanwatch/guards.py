"""Guards: check a loss's (or an embedding's) inputs before its kernel runs.

A class index of 255 under ``CrossEntropyLoss(ignore_index=-100)``, a ``BCELoss`` input
above 1, a token id equal to an ``nn.Embedding``'s number of rows, a ``(N, 1)`` prediction
against an ``(N,)`` target: on a GPU the first three end in "device-side assert triggered",
which kills the CUDA context; the last trains on an ``N x N`` loss with only a warning. A
guard sees the inputs first and raises a :class:`nanwatch.GuardError` that names the
values, their positions and the fix.

What is guarded is enumerated from torch, not hand-picked: every public ``_Loss`` subclass
of ``torch.nn.modules.loss`` and every module of ``torch.nn.modules.sparse``
(``Embedding``, ``EmbeddingBag``), through a forward pre-hook on each watched instance (see
:func:`attach`), and the functional each one calls (``F.cross_entropy``, ``F.embedding``),
by wrapping those functionals in ``torch.nn.functional`` while a watcher is attached (see
:class:`FunctionalGuards`), which also checks ``F.one_hot``. What each functional means by
its arguments (class indices, probabilities, +1/-1 labels, row indices) is the one table
written by hand, ``_SEMANTICS``; a loss it does not know still gets the device check and
its evidence.

Cost: one host sync per guarded call. Shapes, dtypes and devices are checked in Python;
every value check's reduction stays on the device until one stacked ``.tolist()`` (for an
embedding: the ids' ``aminmax``; on the CPU that read is no device sync at all). The same
read fills, for a loss, the ``"loss_input"`` :class:`~nanwatch.records.Note` the rules read
(``input_min``, ``probability_rows``, ``ignored``, ...). A guard only reads: the call it
lets through computes exactly what it would have computed without it; a call of any
other function costs nothing.

A guard cannot run inside a ``torch.compile``'d child (sentinel mode runs one compiled):
its hooks are traced away, and nothing of it enters the graph. When the compiled call
raises, the error goes on unchanged, and on the CPU the eager module runs again on the same
inputs with the guards on, so the report names the values as a guard would have (see
:func:`_explain_compiled`); on a GPU, whose context the assert killed, the error's advice
names the compiled child, the guarded modules in it and how to have them checked.

A check is silenced like a diagnosis: ``watch(..., ignore=["NW506"])`` lets calls that fail
only that check through (the loss then runs as PyTorch computes it).

Example:
    >>> import torch
    >>> from nanwatch import watch
    >>> from nanwatch.errors import GuardError, guard_error_class
    >>> criterion = torch.nn.MSELoss()
    >>> pred, y = torch.randn(8, 1), torch.randn(8)
    >>> try:
    ...     with watch(criterion, on_anomaly="record", postmortem=False):
    ...         criterion(pred, y)
    ... except GuardError as err:
    ...     print(err.code, err.check)
    NW506 broadcast
"""

from __future__ import annotations

import ast
import functools
import inspect
import io
import itertools
import linecache
import math
import os
import re
import sys
import threading
import tokenize
import types
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass as _is_wrapper

from nanwatch import _frames, ops
from nanwatch._compat import aminmax
from nanwatch._compat import capturing as _capturing
from nanwatch._compat import compiling as _compiling
from nanwatch._compat import transforming as _transforming
from nanwatch._structure import leaves
from nanwatch.errors import GuardError, guard_error_class
from nanwatch.stats import dtype_name

if TYPE_CHECKING:
    from nanwatch.records import Note
    from nanwatch.watcher import Watcher

__all__ = [
    "FunctionalGuards",
    "GuardSpec",
    "attach",
    "functional_specs",
    "index_classes",
    "loss_classes",
    "spec_for",
]

_MISSING: Any = object()
#: most ``"loss_input"`` notes kept per step (a loop of functional losses without steps).
_MAX_NOTES = 1024
#: labels people use for "no label" (VOC's 255, -1, Hugging Face's -100).
_IGNORE_LABELS = (255, -1, -100)
#: BCE clamps log(x) at -100: x below this contributes exactly 100 to the loss.
_BCE_LOG_FLOOR = math.exp(-100.0)
_POSITIONS = 3  #: offending positions named in the error
_VALUES = 3  #: distinct offending values named in the error


# ---------------------------------------------------------------------------- semantics
@dataclass(frozen=True)
class _Semantics:
    """What a functional loss means by its arguments.

    ``kind``: ``"class"`` (class-index targets), ``"ctc"``, ``"binary"`` (BCE family),
    ``"regression"`` (elementwise), ``"sign"`` (targets of 1 and -1), ``"embedding"`` (an
    embedding loss: no target), ``"index"`` (not a loss: the input indexes the rows of a
    table, ``F.embedding``, or the classes of ``F.one_hot``), ``"generic"`` (unknown:
    devices and evidence only). ``broadcast``: parameters whose shapes must not broadcast
    into a larger one. ``target_dtypes``: which target
    dtypes the kernel accepts (``"long-byte"``, ``"long"``, ``"same"`` as the input,
    ``"floating"``, ``"not-bool"``, ``"any"``): only dtypes PyTorch itself rejects are
    reported (a float64 target for MSELoss is promoted, and passes)."""

    kind: str
    broadcast: tuple[str, ...] = ()
    target_dtypes: str = "any"
    ignore_index: bool = False


_PAIR = ("input", "target")
_SEMANTICS: dict[str, _Semantics] = {
    "cross_entropy": _Semantics("class", target_dtypes="long-byte", ignore_index=True),
    "nll_loss": _Semantics("class", target_dtypes="long-byte", ignore_index=True),
    "linear_cross_entropy": _Semantics("class", target_dtypes="long-byte", ignore_index=True),
    "multi_margin_loss": _Semantics("class", target_dtypes="long"),
    "multilabel_margin_loss": _Semantics("class", target_dtypes="long"),
    "ctc_loss": _Semantics("ctc"),
    "binary_cross_entropy": _Semantics("binary", target_dtypes="same"),
    "binary_cross_entropy_with_logits": _Semantics("binary", target_dtypes="floating"),
    "mse_loss": _Semantics("regression", _PAIR),
    "l1_loss": _Semantics("regression", _PAIR, target_dtypes="not-bool"),
    "smooth_l1_loss": _Semantics("regression", _PAIR),
    "huber_loss": _Semantics("regression", _PAIR),
    "poisson_nll_loss": _Semantics("regression", _PAIR),
    "gaussian_nll_loss": _Semantics("regression", _PAIR),
    "kl_div": _Semantics("regression", _PAIR, target_dtypes="floating"),
    "multilabel_soft_margin_loss": _Semantics("binary", target_dtypes="not-bool"),
    "soft_margin_loss": _Semantics("sign", _PAIR),
    "hinge_embedding_loss": _Semantics("sign", _PAIR),
    "margin_ranking_loss": _Semantics("sign", ("input1", "input2", "target")),
    "cosine_embedding_loss": _Semantics("sign"),
    "triplet_margin_loss": _Semantics("embedding"),
    "triplet_margin_with_distance_loss": _Semantics("embedding"),
    "embedding": _Semantics("index"),
    "embedding_bag": _Semantics("index"),
    "one_hot": _Semantics("index"),
}
_GENERIC = _Semantics("generic")


# ---------------------------------------------------------------------------- enumeration
@dataclass(frozen=True, eq=False)
class GuardSpec:
    """One guarded functional of ``torch.nn.functional`` (a loss, or an index op such as
    ``F.embedding``) and the ``nn`` modules that call it.

    Example:
        >>> spec = spec_for(torch.nn.CrossEntropyLoss)
        >>> spec.call, spec.kind, spec.input, spec.target
        ('F.cross_entropy', 'class', 'input', 'target')
        >>> spec_for(torch.nn.EmbeddingBag).call
        'F.embedding_bag'
    """

    name: str  #: ``cross_entropy``
    func: Callable[..., Any]  #: ``F.cross_entropy``
    params: tuple[str, ...]  #: every parameter, in order
    positional: tuple[str, ...]  #: those that can be passed by position
    defaults: Mapping[str, Any]
    input: str  #: the first parameter (``input``, ``log_probs``, ``input1``, ``tensor``)
    target: str | None  #: ``target`` / ``targets``; None for losses without one
    classes: tuple[str, ...]  #: the nn modules that call it (``CrossEntropyLoss``)
    semantics: _Semantics = field(repr=False)

    @property
    def call(self) -> str:
        return f"F.{self.name}"

    @property
    def kind(self) -> str:
        return self.semantics.kind


def _public_classes(mod: types.ModuleType, base: type) -> list[type]:
    """The public subclasses of ``base`` that module ``mod`` defines, by name."""
    out: list[type] = []
    for name, obj in sorted(vars(mod).items()):
        if name.startswith("_") or not isinstance(obj, type):
            continue
        if issubclass(obj, base) and obj.__module__ == mod.__name__:
            out.append(obj)
    return out


def loss_classes() -> list[type[nn.modules.loss._Loss]]:
    """Every public loss module ``torch.nn`` defines: the ``_Loss`` subclasses of
    ``torch.nn.modules.loss``, by name.

    Example:
        >>> "CrossEntropyLoss" in [c.__name__ for c in loss_classes()]
        True
    """
    return _public_classes(nn.modules.loss, nn.modules.loss._Loss)


def index_classes() -> list[type[nn.Module]]:
    """Every public module of ``torch.nn.modules.sparse``: the lookup tables whose input
    indexes the rows of their weight.

    Example:
        >>> [c.__name__ for c in index_classes()]
        ['Embedding', 'EmbeddingBag']
    """
    return _public_classes(nn.modules.sparse, nn.Module)


_F_CALL = re.compile(r"\bF\.(\w+)\(")


def _forward_owner(cls: type) -> type | None:
    """The class in ``cls``'s MRO that defines the ``forward`` it runs."""
    for c in cls.__mro__:
        if "forward" in vars(c):
            return c
    return None


def _functional_name(cls: type) -> str | None:
    """The ``torch.nn.functional`` a torch module's forward calls, read from its source
    (``CrossEntropyLoss.forward`` -> ``cross_entropy``, ``Embedding.forward`` ->
    ``embedding``)."""
    owner = _forward_owner(cls)
    if owner is None:
        return None
    try:
        src = inspect.getsource(owner.forward)  # type: ignore[attr-defined]
    except (OSError, TypeError):
        return None
    for name in _F_CALL.findall(src):
        if callable(getattr(F, name, None)):
            return str(name)
    return None


def _signature(func: Callable[..., Any]) -> inspect.Signature | None:
    """``func``'s signature; for a builtin without one (``F.one_hot``), the one torch writes
    on the first line of its docstring (``one_hot(tensor, num_classes=-1) -> LongTensor``)."""
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):
        pass
    lines = (func.__doc__ or "").strip().splitlines()
    if not lines:
        return None
    try:
        node = ast.parse(f"def {lines[0].split(' -> ')[0]}: pass").body[0]
    except SyntaxError:
        return None
    if not isinstance(node, ast.FunctionDef):
        return None
    try:
        a = node.args
        pos = [*a.posonlyargs, *a.args]
        defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
        P = inspect.Parameter
        params = [
            P(
                arg.arg,
                P.POSITIONAL_OR_KEYWORD,
                default=P.empty if d is None else ast.literal_eval(d),
            )
            for arg, d in zip(pos, defaults, strict=True)
        ]
        params += [
            P(arg.arg, P.KEYWORD_ONLY, default=P.empty if d is None else ast.literal_eval(d))
            for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)
        ]
        return inspect.Signature(params)
    except (ValueError, TypeError):  # a default that is not a literal
        return None


@functools.cache
def _specs() -> tuple[dict[type, GuardSpec], dict[Any, GuardSpec]]:
    by_class: dict[type, GuardSpec] = {}
    by_func: dict[Any, GuardSpec] = {}
    users: dict[str, list[type]] = {}
    for cls in [*loss_classes(), *index_classes()]:
        name = _functional_name(cls)
        if name is not None:
            users.setdefault(name, []).append(cls)
    for name in _SEMANTICS:  # functionals no module calls (F.one_hot)
        if callable(getattr(F, name, None)):
            users.setdefault(name, [])
    for name, classes in users.items():
        func = getattr(F, name)
        if getattr(func, "_nanwatch_guard", False):  # attached now: the original it wraps
            func = func.__wrapped__
        sig = _signature(func)
        if sig is None:
            continue
        params = tuple(sig.parameters)
        positional = tuple(
            p.name
            for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        )
        defaults = {p.name: p.default for p in sig.parameters.values() if p.default is not p.empty}
        target = next((p for p in params if p in ("target", "targets")), None)
        spec = GuardSpec(
            name=name,
            func=func,
            params=params,
            positional=positional,
            defaults=types.MappingProxyType(defaults),
            input=params[0],
            target=target,
            classes=tuple(c.__name__ for c in classes),
            semantics=_SEMANTICS.get(name, _GENERIC),
        )
        by_func[func] = spec
        for cls in classes:
            by_class[cls] = spec
    return by_class, by_func


def spec_for(cls: type) -> GuardSpec | None:
    """The spec of a module class, or None when it is not guarded: not a loss or an
    embedding, or its forward is not one of torch's (a user's subclass that overrides
    ``forward`` is guarded only through the functionals it calls).

    Example:
        >>> spec_for(torch.nn.BCEWithLogitsLoss).call
        'F.binary_cross_entropy_with_logits'
        >>> spec_for(torch.nn.Linear) is None
        True
    """
    owner = _forward_owner(cls)
    return _specs()[0].get(owner) if owner is not None else None


def functional_specs() -> dict[Any, GuardSpec]:
    """``{F.cross_entropy: spec, ...}``: every functional an ``nn`` loss or embedding calls,
    and ``F.one_hot``.

    Example:
        >>> F.nll_loss in functional_specs(), F.one_hot in functional_specs()
        (True, True)
    """
    return dict(_specs()[1])


# ---------------------------------------------------------------------------- binding
class _ModuleBinding:
    """Maps a loss module's forward arguments and attributes onto its functional's
    parameters, so both forms are checked by the same code."""

    __slots__ = ("arg_names", "attrs", "kw_names", "spec")

    def __init__(self, module: nn.Module, spec: GuardSpec) -> None:
        self.spec = spec
        owner = _forward_owner(type(module))
        fwd = list(inspect.signature(owner.forward).parameters)[1:]  # type: ignore[union-attr]
        names: list[str] = []
        for i, n in enumerate(fwd):
            # PoissonNLLLoss.forward(log_input, target) passes log_input as F's `input`
            # (its own `log_input` is the flag attribute): map by name unless the module
            # has an attribute of that name, else by position.
            if n in spec.params and not hasattr(module, n):
                names.append(n)
            elif i < len(spec.positional):
                names.append(spec.positional[i])
            else:
                names.append(n)
        self.arg_names = tuple(names)
        self.kw_names = dict(zip(fwd, names, strict=True))
        consts = tuple(getattr(type(module), "__constants__", ()) or ())
        attrs: list[str] = []
        for n in (*spec.params, *consts):
            if n in self.arg_names or n in attrs or n in ("size_average", "reduce"):
                continue
            v = getattr(module, n, _MISSING)
            if v is _MISSING or inspect.ismethod(v):
                continue
            attrs.append(n)
        self.attrs = tuple(attrs)

    def bind(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        bound = dict(self.spec.defaults)
        for n in self.attrs:
            bound[n] = getattr(module, n)
        for n, a in zip(self.arg_names, args, strict=False):
            bound[n] = a
        for k, v in kwargs.items():
            bound[self.kw_names.get(k, k)] = v
        return bound


def _bind_functional(
    spec: GuardSpec, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    bound = dict(spec.defaults)
    for n, a in zip(spec.positional, args, strict=False):
        bound[n] = a
    bound.update(kwargs)
    return bound


# ---------------------------------------------------------------------------- state
_tls = threading.local()


def _module_stack() -> list[nn.Module]:
    stack: list[nn.Module] | None = getattr(_tls, "modules", None)
    if stack is None:
        stack = _tls.modules = []
    return stack


class _Health:
    """An internal error turns the guard off (with one warning) instead of breaking the
    training it watches; PyTorch's own checks still run."""

    __slots__ = ("broken", "watcher")

    def __init__(self, watcher: Watcher) -> None:
        self.watcher = watcher
        self.broken = False

    def fault(self, where: str, exc: BaseException) -> None:
        self.broken = True
        msg = f"{type(exc).__name__}: {exc}"
        self.watcher.faults.append((where, msg))
        warnings.warn(
            f"nanwatch: internal error in its {where} ({msg}); guards are off for the rest "
            "of the run and training goes on. Please report it with the traceback.",
            RuntimeWarning,
            stacklevel=4,
        )


def _quiet(watcher: Watcher) -> bool:
    return (
        _compiling()  # first: constant under dynamo, so nothing else traced
        or (not watcher.attached and getattr(_tls, "explaining", None) is not watcher)
        or ops.replaying()
        or torch._C._current_autograd_node() is not None  # checkpoint recomputation
        or torch._C._get_tracing_state() is not None  # torch.jit.trace
        or _transforming()  # torch.func: wrapped tensors, no reads
        or _capturing()  # a CUDA graph capture: a read would invalidate it
    )


# ---------------------------------------------------------------------------- failures
@dataclass
class _Failure:
    """What a check found wrong; becomes a ``"guard"`` note, a Diagnosis and the error."""

    code: str
    check: str
    problem: str  #: the sentence: what is wrong, with numbers, and what is accepted
    expected: str
    fix: str
    explanation: str
    values: tuple[Any, ...] = ()
    counts: tuple[int, ...] = ()
    count: int = 0
    total: int = 0
    positions: tuple[tuple[int, ...], ...] = ()
    #: torch computes the call without an error (its result is inf or NaN, which the
    #: watcher sees): under on_anomaly="warn" the guard notes it and lets it run (_LENIENT)
    torch_runs: bool = False


#: checks whose input torch accepts on every device, making an inf or NaN loss rather than
#: raising or asserting (a CTC target too long for its input, an inf or NaN loss weight, a
#: -inf target logit, a non-finite term without gradients): under on_anomaly="warn" the
#: guard notes them (a warning) and the call runs, so a loop that skips a non-finite loss
#: works watched. "record" keeps stopping them: it is the policy of a driver that acts
#: itself (the Lightning callback, whose GuardError ends fit). The rest stop the call
#: whatever on_anomaly says: torch would raise, a GPU would assert, or the result would be
#: finite and silently wrong (a broadcast, a target of 255 for BCE) with nothing for the
#: watcher to see.
_LENIENT = frozenset({"NW516", "NW517", "NW518", "NW519"})


class _Fail(Exception):
    """Internal control flow: a check found a failure (never escapes this module)."""

    def __init__(self, failure: _Failure) -> None:
        super().__init__(failure.problem)
        self.failure = failure


def _without_comment(line: str) -> str:
    """``line`` without its trailing ``# comment``, for a fix that adds its own."""
    if "#" not in line:
        return line
    try:
        for tok in tokenize.generate_tokens(io.StringIO(line).readline):
            if tok.type == tokenize.COMMENT:
                return line[: tok.start[1]].rstrip()
    except (tokenize.TokenError, SyntaxError):
        pass
    return line


def _n(x: float) -> str:
    """An integer with thousands separators (``3,912``)."""
    return f"{int(x):,}"


def _acc(device: torch.device) -> torch.dtype:
    """The dtype reductions are read in: float64 (exact counts), float32 where the device
    has no float64 (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _many(n: float, word: str) -> str:
    """``1 position``, ``3,912 positions``."""
    return f"{_n(n)} {word}{'' if int(n) == 1 else 's'}"


def _num(x: float) -> str:
    if isinstance(x, int) or (math.isfinite(x) and x == int(x) and abs(x) < 1e15):
        return str(int(x))
    return f"{x:.4g}"


def _plain(t: torch.Tensor) -> bool:
    """A tensor whose values can be read here: strided and materialized; not a fake tensor
    (tracing), a wrapper subclass (DTensor: values live elsewhere) or a functorch wrapper.
    Simple subclasses (torchvision's ``tv_tensors.Mask``) are read like tensors."""
    if t.is_meta or t.layout is not torch.strided or t.is_nested:
        return False
    if type(t) is not torch.Tensor and type(t) is not nn.Parameter:
        fake = sys.modules.get("torch._subclasses.fake_tensor")
        if fake is not None and isinstance(t, fake.FakeTensor):
            return False
        if _wrapper_subclass(t):
            return False
    return not torch._C._functorch.is_functorch_wrapped_tensor(t)


#: torch's TypeGuard, seen as a plain predicate (mypy cannot mix it with torch.Tensor)
_wrapper_subclass: Callable[[Any], bool] = _is_wrapper


def _readable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and _plain(t) and t.numel() > 0 and not t.is_complex()


def _positions(mask: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """The first few True positions of ``mask`` (failure path: a second read is fine)."""
    idx = mask.nonzero()[:_POSITIONS].tolist()
    return tuple(tuple(int(i) for i in row) for row in idx)


def _value_counts(values: torch.Tensor) -> tuple[tuple[Any, ...], tuple[int, ...]]:
    """Distinct values and their counts, most frequent first."""
    uniq, counts = torch.unique(values, return_counts=True)
    pairs = sorted(zip(uniq.tolist(), counts.tolist(), strict=True), key=lambda p: (-p[1], p[0]))
    return tuple(v for v, _ in pairs), tuple(int(c) for _, c in pairs)


def _describe_values(values: Sequence[Any], counts: Sequence[int]) -> str:
    parts = [
        f"{_num(v)} at {_n(c)} position{'s' if c != 1 else ''}"
        for v, c in zip(values[:_VALUES], counts[:_VALUES], strict=False)
    ]
    rest = len(values) - _VALUES
    if rest > 0:
        parts.append(f"{rest} other value{'s' if rest != 1 else ''}")
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


# ---------------------------------------------------------------------------- one call
#: read a CPU tensor's range as soon as it is computed (see :func:`_read_now`)
_CPU_READS_NOW = True


def _read_now(t: torch.Tensor) -> bool:
    """Whether a statistic of ``t`` is read when it is computed rather than with the call's
    one read: on the CPU a read is no host sync, and a range known at once spares the ops
    it makes needless (a target range without ignore_index needs no mask; an input without
    -inf needs no look at its target classes). An accelerator's values wait for the read."""
    return _CPU_READS_NOW and t.device.type == "cpu"


def _own_statement(tree: ast.Module, node: ast.expr) -> tuple[int, int] | None:
    """Byte offsets of the simple statement of a one-line ``tree`` that holds ``node``, when
    the line holds more than that statement: a fix rewrites that statement alone, without
    the ``if CE:`` or ``with autocast():`` before it or the statements beside it."""
    best: ast.stmt | None = None
    for stmt in ast.walk(tree):
        if (
            isinstance(stmt, ast.stmt)
            and not hasattr(stmt, "body")  # a compound statement's test holds the call
            and stmt.lineno == stmt.end_lineno == 1
            and stmt.end_col_offset is not None
            and node.end_col_offset is not None
            and stmt.col_offset <= node.col_offset
            and node.end_col_offset <= stmt.end_col_offset
        ):
            best = stmt
    if best is None or (len(tree.body) == 1 and tree.body[0] is best):
        return None
    assert best.end_col_offset is not None
    return best.col_offset, best.end_col_offset


class _Probe:
    """One guarded call: Python-side checks (shapes, dtypes, devices) first, then every
    reduction the value checks need, read together with one host sync."""

    def __init__(
        self,
        spec: GuardSpec,
        bound: dict[str, Any],
        *,
        is_module: bool,
        cls_name: str,
        frame: types.FrameType | None,
        order: Sequence[str] = (),
        kw_names: Mapping[str, str] | None = None,
        module: nn.Module | None = None,
        roots: Sequence[nn.Module] = (),
        known: Callable[[torch.Tensor], tuple[Any, Any] | None] | None = None,
        upstream: bool | Callable[[], bool] = False,
        from_module: Callable[[torch.Tensor], bool] | None = None,
        recorded: Callable[[Any], bool] | None = None,
        ops_checked: bool = False,
        in_module: bool = False,
        site: types.FrameType | None = None,
    ) -> None:
        self.spec = spec
        #: the frame of the code that made the guarded call (the first outside torch and
        #: nanwatch): an installed library's (transformers' loss) when it is not ``frame``
        self.site = site if site is not None else frame
        #: the watcher checks every aten op (forensic): it names the op that made a value
        self.ops_checked = ops_checked
        #: the call runs inside a watched module's forward: the watcher replays that module
        #: and names the op that made a bad value there, terms without gradients included
        self.in_module = in_module
        #: whether an autograd node made a tensor a watched module returned this step
        self.recorded = recorded or (lambda node: False)
        #: whether a tensor is a watched module's output (or a cast or view of one): a bad
        #: value an op made in it is traced to that op by the watcher
        self.from_module = from_module or (lambda t: False)
        #: the watcher already found a NaN/inf born earlier in this step: a non-finite loss
        #: input is its consequence, which the watcher's diagnosis explains. A callable is
        #: asked only when a check needs it (see :attr:`upstream`)
        self._upstream = upstream
        #: the min and max a watcher already measured for a tensor (a watched module's
        #: output, unchanged since), so the input is not read a second time
        self.known = known or (lambda t: None)
        #: the parameter names of the call's positional arguments, and of its keywords
        self.order = tuple(order)
        self.kw_names = dict(kw_names or {})
        self._span: tuple[int, int] | None = None  #: byte offsets of the call in ``line``
        #: byte offsets in ``line`` of the one statement that makes the call, when the line
        #: holds more (``if CE: loss = F.cross_entropy(x, y)``, ``a = 1; loss = crit(x, y)``)
        self._stmt: tuple[int, int] | None = None
        self.bound = bound
        self.is_module = is_module
        self.cls_name = cls_name
        self.frame = frame
        self.module = module  #: the guarded module (None for a functional call)
        self.roots = roots  #: the watched root modules (read only when a fix is worded)
        inp = bound.get(spec.input)
        assert isinstance(inp, torch.Tensor)
        self.input: torch.Tensor = inp
        tgt = bound.get(spec.target) if spec.target is not None else None
        self.target: torch.Tensor | None = tgt if isinstance(tgt, torch.Tensor) else None
        self._keys: list[str] = []
        self._pending: list[torch.Tensor] = []
        self._after: list[Callable[[dict[str, float]], None]] = []
        self.values: dict[str, float] = {}
        self.data: dict[str, Any] = {}

    @functools.cached_property
    def line(self) -> str | None:
        """The text of the user's line; read only when a failure is worded."""
        f = self.frame
        if f is None:
            return None
        return linecache.getline(f.f_code.co_filename, f.f_lineno).strip() or None

    @functools.cached_property
    def _running(self) -> tuple[int, int] | None:
        """Byte offsets in :attr:`line` of the call the user's frame is making now, from the
        code's positions (Python 3.11+): ``self.emb(ids)`` in ``self.out(self.emb(ids))``."""
        f = self.frame
        positions = getattr(f.f_code, "co_positions", None) if f is not None else None
        if f is None or positions is None or f.f_lasti < 0:
            return None
        try:
            pos = next(itertools.islice(positions(), f.f_lasti // 2, None))
        except StopIteration:
            return None
        start, end_line, col, end_col = pos
        if start != f.f_lineno or end_line != start or col is None or end_col is None:
            return None
        raw = linecache.getline(f.f_code.co_filename, f.f_lineno)
        lead = len(raw) - len(raw.lstrip())
        return col - lead, end_col - lead

    # -- words -------------------------------------------------------------------------
    def desc(self, **opts: Any) -> str:
        """``CrossEntropyLoss(ignore_index=-100)``, ``F.cross_entropy(..., ignore_index=-100)``."""
        args = ", ".join(f"{k}={v!r}" for k, v in opts.items())
        if self.is_module:
            return f"{self.cls_name}({args})" if args else self.cls_name
        return f"{self.spec.call}(..., {args})" if args else self.spec.call

    @functools.cached_property
    def _call(self) -> tuple[str | None, list[tuple[str | None, str, str]]]:
        """The guarded call on the user's line, when the line holds it: the callee's text
        and, per argument, (keyword as written or None, parameter name, expression text).
        ``loss = criterion(pred, y)`` -> ``("criterion", [(None, "input", "pred"), ...])``.
        A call matches when it has as many positional arguments and the same keywords as
        the call being checked (and, for a functional, the same name); of several, the one
        the frame is running (``self.emb(ids)`` in ``self.out(self.emb(ids))``), else the
        first."""
        line = self.line
        if not line:
            return None, []
        if self.is_module and _in_library(self):
            # a library's code called the module (BERT's token_type_embeddings inside
            # ``model(...)``): a call on the user's line that merely has as many arguments
            # (``torch.tensor([0, 1])``) is not it
            return None, []
        try:
            tree = ast.parse(line)
        except SyntaxError:
            return None, []
        found: list[tuple[ast.Call, str, list[tuple[str | None, str, str]]]] = []
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            if any(isinstance(a, ast.Starred) for a in node.args) or any(
                k.arg is None for k in node.keywords
            ):
                continue
            callee = ast.get_source_segment(line, node.func) or ast.unparse(node.func)
            order, kw_names = self.order, self.kw_names
            if self.is_module:
                if len(node.args) != len(order):
                    continue
                if sorted(k.arg or "" for k in node.keywords) != sorted(kw_names):
                    continue
            else:
                # torch hands a functional's every argument to the mode by keyword: the
                # line itself says which were positional
                if callee.rsplit(".", 1)[-1] != self.spec.name:
                    continue
                if len(node.args) > len(self.spec.positional):
                    continue
                order = self.spec.positional[: len(node.args)]
                kw_names = {k.arg or "": k.arg or "" for k in node.keywords}

            def text(n: ast.AST) -> str:
                return ast.get_source_segment(line, n) or ast.unparse(n)

            parts: list[tuple[str | None, str, str]] = [
                (None, n, text(a)) for n, a in zip(order, node.args, strict=True)
            ]
            parts += [(k.arg, kw_names[k.arg or ""], text(k.value)) for k in node.keywords]
            found.append((node, callee, parts))
        if not found:
            return None, []
        running = self._running if len(found) > 1 else None
        node, callee, parts = next(
            (c for c in found if (c[0].col_offset, c[0].end_col_offset) == running), found[0]
        )
        if node.end_col_offset is not None and node.lineno == node.end_lineno == 1:
            self._span = (node.col_offset, node.end_col_offset)
            self._stmt = _own_statement(tree, node)
        return callee, parts

    def arg(self, name: str, default: str | None = None) -> str:
        """The user's expression for parameter ``name`` (``pred``), else ``default`` (else
        the parameter's name)."""
        for _, n, text in self._call[1]:
            if n == name:
                return text
        return default if default is not None else name

    def has_arg(self, name: str) -> bool:
        """Whether :meth:`call_with` can replace parameter ``name``."""
        if self._call[0] is None:
            return any(n == name for _, n, _ in self._stand_ins())
        return any(n == name for _, n, _ in self._call[1])

    def _stand_ins(self) -> list[tuple[str | None, str, str]]:
        """The call's arguments when its line is unknown (a call inside a library): every
        argument it was given, by parameter name (``log_probs, targets, input_lengths,
        target_lengths, blank=blank``), so a fix that adds one keeps the others."""
        parts: list[tuple[str | None, str, str]] = [(None, n, n) for n in self.order]
        parts += [(k, n, k) for k, n in self.kw_names.items()]
        if any(n == self.spec.input for _, n, _ in parts):
            return parts
        names = [self.spec.input] + ([self.spec.target] if self.spec.target else [])
        return [(None, n, n) for n in names]

    def call_with(self, add: Mapping[str, Any] | None = None, /, **replace: str) -> str:
        """The user's line with the call's arguments replaced (and keywords ``add``ed):
        ``loss = criterion(pred.squeeze(-1), y)``; just the call when the line is unknown."""
        return self.call_with_suffix("", add, **replace)

    def call_with_suffix(
        self, suffix: str, add: Mapping[str, Any] | None = None, /, **replace: str
    ) -> str:
        """:meth:`call_with`, with ``suffix`` (``[..., :4]``) right after the call."""
        callee, parts = self._call
        if callee is None:
            callee = self.callee
            parts = self._stand_ins()
        texts = [(f"{kw}=" if kw else "") + replace.get(n, text) for kw, n, text in parts]
        texts += [f"{k}={v!r}" for k, v in (add or {}).items()]
        call = f"{callee}({', '.join(texts)}){suffix}"
        line, span = self.line, self._span
        if line is None or span is None:
            return call
        raw = line.encode()
        first, last = self._stmt or (0, len(raw))
        return (raw[first : span[0]] + call.encode() + raw[span[1] : last]).decode()

    @property
    def callee(self) -> str:
        """The user's name for the loss (``criterion``) or embedding, else a stand-in."""
        callee = self._call[0]
        if callee is not None:
            return callee
        if not self.is_module:
            return self.spec.call
        return "embedding" if self.spec.kind == "index" else "criterion"

    def construct(self, **opts: Any) -> str:
        """The fix for a module option, keeping the module's other settings:
        ``criterion = nn.CrossEntropyLoss(ignore_index=255)``."""
        callee, _ = self._call
        if callee is not None and not all(part.isidentifier() for part in callee.split(".")):
            callee = None  # a call expression, not a name: nothing to assign to
        name = callee or "criterion"
        keep: dict[str, str] = {}
        for k, v in self.bound.items():
            if k in opts or k not in self.spec.defaults or k in ("size_average", "reduce"):
                continue
            default = self.spec.defaults[k]
            if isinstance(v, torch.Tensor):
                keep[k] = f"{name}.{k}"
            elif v is not default and v != default and isinstance(v, (int, float, str, bool)):
                keep[k] = repr(v)
        args = ", ".join(
            [f"{k}={v}" for k, v in keep.items()] + [f"{k}={v!r}" for k, v in opts.items()]
        )
        made = f"nn.{self.cls_name}({args})"
        return f"{callee} = {made}" if callee else made

    @property
    def upstream(self) -> bool:
        """Whether a NaN/inf was born earlier in this step. Asked only once a check found a
        non-finite input: on accelerators the watcher's statistics are still on the device
        then, and finding a bad one costs a read that a healthy step must not pay."""
        up = self._upstream
        return bool(up() if callable(up) else up)

    def fail(self, f: _Failure) -> None:
        raise _Fail(f)

    # -- reads -------------------------------------------------------------------------
    def add(self, key: str, t: torch.Tensor) -> None:
        self._keys.append(key)
        self._pending.append(t)

    def add_minmax(self, prefix: str, t: torch.Tensor) -> None:
        """``{prefix}_min`` and ``{prefix}_max`` of ``t``: the watcher's own measurement when
        it has one (0-d device tensors still on their way, or floats already read), else
        one ``aminmax``."""
        known = self.known(t)
        lo, hi = known if known is not None else aminmax(t)
        if isinstance(lo, torch.Tensor) and _read_now(t):
            lo, hi = lo.item(), hi.item()
        for key, v in ((f"{prefix}_min", lo), (f"{prefix}_max", hi)):
            if isinstance(v, torch.Tensor):
                self.add(key, v)
            else:
                self.values[key] = float(v)

    def count(self, key: str, mask: torch.Tensor) -> None:
        """Queue the number of True elements of ``mask`` (exact: summed in float64)."""
        self.add(key, mask.sum(dtype=_acc(mask.device)))

    def then(self, fn: Callable[[dict[str, float]], None]) -> None:
        self._after.append(fn)

    def on_any(
        self,
        key: str,
        mask: torch.Tensor,
        fail: Callable[[dict[str, float], int, torch.Tensor], None],
    ) -> None:
        """Count the True elements of ``mask``; when there are any, ``fail(values, count,
        mask)`` words the failure (after the read)."""
        self.count(key, mask)

        def check(v: dict[str, float]) -> None:
            n = int(v[key])
            if n:
                fail(v, n, mask)

        self.then(check)

    def read(self) -> None:
        """The host sync: every pending reduction, stacked per device, one ``.tolist()``; then
        the callbacks. A callback may queue more reductions (evidence that only matters when
        the first read shows it could): they are read the same way, once more."""
        while self._pending or self._after:
            pending, keys = self._pending, self._keys
            self._pending, self._keys = [], []
            if pending:
                groups: dict[torch.device, list[int]] = {}
                for i, t in enumerate(pending):
                    groups.setdefault(t.device, []).append(i)
                out: list[float] = [math.nan] * len(pending)
                for dev, idx in groups.items():  # one group, except CTC's CPU targets
                    acc = _acc(dev)
                    items = [pending[i] for i in idx]
                    first = items[0].dtype
                    mixed = first != acc and any(t.dtype != first for t in items)
                    if dev.type == "cpu":  # a value each: cheaper than a stack (2-4x)
                        # the same values as the stack below: float64 when mixed, else as is
                        vals = [float(t.item()) if mixed else t.item() for t in items]
                    else:
                        if mixed:
                            # mixed dtypes: read them in acc (torch.stack promotes the rest
                            # to it); one dtype (an embedding's int64 min and max) as it is
                            items[0] = items[0].to(acc)
                        vals = torch.stack(items).tolist()
                    for i, v in zip(idx, vals, strict=True):
                        out[i] = v
                self.values.update(zip(keys, out, strict=True))
            after, self._after = self._after, []
            for fn in after:
                fn(self.values)


# ---------------------------------------------------------------------------- checks
def _check_devices(p: _Probe) -> None:
    if p.spec.kind == "ctc":  # CTC takes CPU targets and lengths with CUDA log-probs
        return
    if p.spec.kind == "index":  # torch's own error names the devices, and nothing asserts
        return
    dev = p.input.device
    for name, v in p.bound.items():
        if name == p.spec.input or not isinstance(v, torch.Tensor) or v.device == dev:
            continue
        if v.dim() == 0 and v.device.type == "cpu":
            continue  # a CPU scalar goes along with any device
        attr = p.is_module and name not in (p.spec.target, "input1", "input2", "var")
        where = f"{p.cls_name}.{name}" if attr else name
        if attr:
            fix = f"{p.callee}.to({_paren(p.arg(p.spec.input))}.device)  # moves the loss's buffers"
        elif p.has_arg(name):
            there = f"{_paren(p.arg(p.spec.input))}.device"
            fix = p.call_with(**{name: f"{_paren(p.arg(name))}.to({there})"})
        else:
            fix = f"pass {name}={name}.to({_paren(p.arg(p.spec.input))}.device)"
        p.fail(
            _Failure(
                code="NW508",
                check="device",
                problem=(
                    f"{where} is on {v.device} but {p.spec.input} is on {dev}; {p.desc()} needs "
                    "every tensor on one device"
                ),
                expected=f"every tensor on {dev}",
                fix=fix,
                explanation=(
                    "The loss kernel reads all its tensors on one device; PyTorch would stop "
                    "with a shorter error that does not say which tensor is where."
                ),
                values=(str(v.device),),
            )
        )


def _broadcast(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...] | None:
    """The broadcast shape, or None when the shapes do not broadcast."""
    ndim = max(len(s) for s in shapes)
    out: list[int] = []
    for i in range(-ndim, 0):
        sizes = {s[i] for s in shapes if len(s) >= -i} - {1}
        if len(sizes) > 1:
            return None
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


_WARNS = "PyTorch only warns ('Using a target size ... different to the input size'), and "
_SILENT = "PyTorch neither warns nor errs, and "
#: what PyTorch itself does when a loss's input and target broadcast (NW506's explanation)
_BROADCAST_SAYS = {
    "mse_loss": _WARNS,
    "l1_loss": _WARNS,
    "smooth_l1_loss": _WARNS,
    "huber_loss": _WARNS,
    "poisson_nll_loss": _SILENT,
    "gaussian_nll_loss": _SILENT,
    "kl_div": _SILENT,
    "hinge_embedding_loss": _SILENT,
}
#: losses with a further argument whose size must match the input's (GaussianNLLLoss's
#: var): a shape fix changes the target, never the input
_SIZED_BY_INPUT = frozenset({"gaussian_nll_loss"})


def _check_broadcast(p: _Probe) -> None:
    names = p.spec.semantics.broadcast
    tensors = [(n, p.bound.get(n)) for n in names]
    ts = [(n, t) for n, t in tensors if isinstance(t, torch.Tensor)]
    if len(ts) < 2 or all(t.shape == ts[0][1].shape for _, t in ts):
        return
    shape = _broadcast([tuple(t.shape) for _, t in ts])
    if shape is None:
        return  # not broadcastable: PyTorch's own error says so
    numel = math.prod(shape)
    biggest = max(t.numel() for _, t in ts)
    if numel <= biggest:
        return  # one side expands to the other (a scalar target): PyTorch warns, result as meant
    (n0, a), (n1, b) = ts[0], ts[-1]
    fix_args: dict[str, str] = {}
    ea, eb = p.arg(n0), p.arg(n1)
    if a.dim() == b.dim() + 1 and a.shape[-1] == 1 and a.shape[:-1] == b.shape:
        if p.spec.name in _SIZED_BY_INPUT:
            # var's size is checked against the input's
            fix_args[n1] = f"{_paren(eb)}.unsqueeze(-1)"
        else:
            fix_args[n0] = f"{_paren(ea)}.squeeze(-1)"
    elif b.dim() == a.dim() + 1 and b.shape[-1] == 1 and b.shape[:-1] == a.shape:
        fix_args[n1] = f"{_paren(eb)}.squeeze(-1)"
    elif a.numel() == b.numel():
        fix_args[n1] = f"{_paren(eb)}.view_as({ea})"
    fix = p.call_with(**fix_args) if fix_args else f"make {ea} and {eb} the same shape"
    shapes = " and ".join(f"{n} {_shape(t)}" for n, t in ts)
    p.fail(
        _Failure(
            code="NW506",
            check="broadcast",
            problem=(
                f"{shapes} broadcast to {tuple(shape)}: {p.desc()} compares each prediction with "
                f"every target ({_n(numel)} terms instead of {_n(biggest)}), not just its own"
            ),
            expected="input and target of the same shape",
            fix=fix,
            explanation=(
                "Elementwise losses broadcast their arguments: a (N, 1) prediction against a "
                "(N,) target becomes an N x N loss. "
                + _BROADCAST_SAYS.get(p.spec.name, "Left alone, ")
                + "the loss looks plausible and decreases while the model learns the mean "
                "of the targets."
            ),
            count=numel,
            total=biggest,
        )
    )


def _check_target_dtype(p: _Probe) -> None:
    rule = p.spec.semantics.target_dtypes
    t, x = p.target, p.input
    if t is None or rule == "any":
        return
    td, xd = dtype_name(t.dtype), dtype_name(x.dtype)
    if rule == "same" and t.dtype != x.dtype:
        need, cast = f"the input's dtype ({xd})", f".to({p.arg(p.spec.input)}.dtype)"
    elif rule == "floating" and not t.is_floating_point():
        need, cast = "a floating-point target", ".float()"
    elif rule == "not-bool" and t.dtype is torch.bool:
        need, cast = "a numeric target, not bool", ".float()"
    else:
        return
    target = p.spec.target or "target"
    fix = p.call_with(**{target: p.arg(target) + cast})
    p.fail(
        _Failure(
            code="NW509",
            check="target-dtype",
            problem=f"target is {td} and input is {xd}; {p.desc()} needs {need}",
            expected=need,
            fix=fix,
            explanation=(
                "PyTorch rejects this target dtype inside the kernel with a message that "
                "names neither the loss nor the tensor."
            ),
            values=(td,),
        )
    )


def _input_stats(p: _Probe) -> None:
    x = p.input
    if _readable(x) and x.dtype is not torch.bool:
        p.add_minmax("input", x)


def _target_stats(p: _Probe) -> None:
    t = p.target
    if t is not None and _readable(t) and t.dtype is not torch.bool:
        mn, mx = aminmax(t)
        p.add("target_min", mn)
        p.add("target_max", mx)
        if t.is_floating_point():

            def count(v: dict[str, float]) -> None:
                # a non-finite target: how many of its values are, counted while it is at
                # hand (a second read, only then): read after backward (the accelerator
                # path), the gradient that counts them on the CPU is freed
                if not (math.isfinite(v["target_min"]) and math.isfinite(v["target_max"])):
                    p.count("target_nonfinite", ~torch.isfinite(t))

            p.then(count)


# -- class targets ---------------------------------------------------------------------
def _class_layout(p: _Probe) -> tuple[int | None, int | None, tuple[int, ...] | None]:
    """(C, class dim of the input, expected class-index target shape) for a class loss."""
    x, name = p.input, p.spec.name
    if name == "linear_cross_entropy":
        w = p.bound.get("linear_weight")
        c = w.shape[0] if isinstance(w, torch.Tensor) and w.dim() else p.bound.get("num_classes")
        return (int(c) if isinstance(c, int) else None), None, None
    if x.dim() == 0:
        return None, None, None
    if name in ("multi_margin_loss", "multilabel_margin_loss"):
        return x.shape[-1], x.dim() - 1, None
    if x.dim() == 1:
        return x.shape[0], 0, ()
    return x.shape[1], 1, (x.shape[0], *x.shape[2:])


def _check_class(p: _Probe) -> None:
    t, x, spec = p.target, p.input, p.spec
    name = spec.name
    c, cdim, expected = _class_layout(p)
    ignore: int | None = None
    if spec.semantics.ignore_index:
        ii = p.bound.get("ignore_index", -100)
        ignore = -100 if ii is None else int(ii)
    if t is None or c is None:
        _input_stats(p)
        return
    soft_ok = name in ("cross_entropy", "linear_cross_entropy")
    probabilities = (
        soft_ok
        and t.is_floating_point()
        and (name == "linear_cross_entropy" or tuple(t.shape) == tuple(x.shape))
    )
    opts: dict[str, Any] = {"ignore_index": ignore} if ignore is not None else {}
    desc = p.desc(**opts)
    if not probabilities and expected is not None and tuple(t.shape) != expected:
        _class_shape_failure(p, c, expected, desc)
    if not probabilities:
        # uint8 passes the non-spatial kernels only (nll_loss2d and up need int64)
        byte_ok = spec.semantics.target_dtypes == "long-byte" and t.dim() <= 1
        allowed = (torch.int64, torch.uint8) if byte_ok else (torch.int64,)
        if t.dtype not in allowed:
            soft = f", or float probabilities shaped like the input {_shape(x)}" if soft_ok else ""
            need = "int64 class indices" + (" (or uint8)" if torch.uint8 in allowed else "")
            p.fail(
                _Failure(
                    code="NW502",
                    check="target-dtype",
                    problem=f"target is {dtype_name(t.dtype)}; {desc} needs {need}{soft}",
                    expected=need + soft,
                    fix=p.call_with(target=f"{p.arg('target')}.long()"),
                    explanation=(
                        "Class-index losses index the input with the target, so it must hold "
                        "integers (int64); a float target of the same shape as the input would "
                        "be read as probabilities."
                    ),
                    values=(dtype_name(t.dtype),),
                )
            )
    # values ------------------------------------------------------------------------
    per_position = (
        name in ("cross_entropy", "nll_loss")
        and cdim is not None
        and _readable(x)
        and x.is_floating_point()
    )
    _input_stats(p)
    ignored: dict[str, torch.Tensor | None] = {"mask": None}  # set below, read after the read
    if per_position and cdim is not None:
        p.then(lambda v: _class_evidence(p, v, cdim=cdim, ign=ignored["mask"]))
    if probabilities:
        if _readable(t):
            _target_stats(p)
            outside = t.clamp(0, 1) != t
            p.count("target_outside", outside)
            p.then(lambda v: _soft_target_result(p, v, outside))
        return
    if not _readable(t) or c < 1:
        return
    lo = -1 if name == "multilabel_margin_loss" else 0
    ign: torch.Tensor | None = None
    kept = t
    # on the CPU a read is no sync: the target's range is read first, and a range that
    # does not hold ignore_index needs no mask (three ops fewer a step)
    known: tuple[Any, Any] | None = None
    if _read_now(t):
        kmin, kmax = aminmax(t)
        known = (kmin.item(), kmax.item())
    if ignore is not None:
        if known is not None and not known[0] <= ignore <= known[1]:
            p.values["ignored"] = 0
        else:
            known = None
            ign = t == ignore
            ignored["mask"] = ign
            p.count("ignored", ign)
            kept = torch.where(ign, lo, t)  # the trained positions' labels (ignored: lo)
    # the range of the trained labels answers "any out of range?" without counting them
    if known is not None:
        p.values["target_min"], p.values["target_max"] = known
    else:
        kmin, kmax = aminmax(kept)
        p.add("target_min", kmin)
        p.add("target_max", kmax)
    p.then(lambda v: _class_result(p, v, c=c, lo=lo, ignore=ignore, ign=ign, desc=desc))
    if per_position and cdim is not None:
        low = p.values.get("input_min")  # already read (the watcher's, or on the CPU)
        if not (low is not None and low > -math.inf):
            # (an input with no -inf, its min read, has none at a target either)
            _check_target_logit(p, kept, ign, c=c, cdim=cdim)
        if not p.is_module:  # a module's input: checked by its early hook (see attach)
            p.then(lambda v: _nograd_input_result(p, v))


#: the losses whose input NW519 checks (:func:`_nograd_input_result`)
_NOGRAD_CHECKED = frozenset({"cross_entropy", "nll_loss"})


def _check_nograd_term(p: _Probe) -> None:
    """A loss module's input made by adding a term without gradients: NW519 alone, checked
    before the watcher's own pre-hook measures the input (see :func:`attach`)."""
    x = p.input
    if _readable(x) and x.is_floating_point() and x.dim() >= 2 and _nograd_add(x) is not None:
        _input_stats(p)
        p.then(lambda v: _nograd_input_result(p, v))


def _check_target_logit(
    p: _Probe, kept: torch.Tensor, ign: torch.Tensor | None, *, c: int, cdim: int
) -> None:
    """Queue the count of trained positions whose input is -inf at their target class (a
    mask that also covers the target, log 0): log_softmax there is -inf, so their loss is
    +inf (NaN for a row that is -inf everywhere). A gather of one value per position, read
    with the rest; PyTorch computes the inf without a word."""
    x = p.input
    at = x.gather(cdim, kept.clamp(0, c - 1).long().unsqueeze(cdim)).squeeze(cdim)
    neg = at == -math.inf
    if ign is not None:
        neg &= ~ign
    p.count("target_neginf", neg)

    def result(v: dict[str, float]) -> None:
        n = int(v["target_neginf"])
        if not n:
            return
        p.data["target_neginf"] = n
        hi = v.get("input_max", math.nan)
        if p.upstream or math.isnan(hi) or hi == math.inf:
            return  # born upstream (NaN or +inf too): the watcher's diagnosis names where
        if not _written_by_mask(p.input) and p.from_module(p.input):
            # an op of a watched module made the -inf (a float16 log_softmax that underflowed):
            # the loss turns +inf and the watcher traces it to that op, which says more
            return
        if _reduction(p.bound) in ("mean", "sum"):
            # reduction='none': the program may drop those rows (their gradient is finite)
            _target_logit_failure(p, v, n, neg, cdim=cdim)

    p.then(result)


#: autograd nodes of ops that write a constant where a mask says (masked_fill, where,
#: x[mask] = -inf): a -inf they put at a target is the mask's doing, which only this guard sees
_MASK_NODES = ("MaskedFill", "Where", "IndexPut", "MaskedScatter", "CopySlices")


def _written_by_mask(x: torch.Tensor) -> bool:
    """``x``'s -inf was written by a mask (its last op masks), or ``x`` has no graph to tell
    (data, no_grad): either way nothing upstream will name an op that made it."""
    node = x.grad_fn
    return node is None or type(node).__name__.startswith(_MASK_NODES)


def _functional_alias(frame: types.FrameType | None) -> str:
    """The user's name for ``torch.nn.functional`` (``F``), else the full path."""
    if frame is not None:
        for name, value in frame.f_globals.items():
            if value is F and name.isidentifier():
                return name
    return "torch.nn.functional"


def _mask_name(p: _Probe) -> str | None:
    """The user's name for the boolean mask of the ``masked_fill`` that made the loss input,
    when a variable of the user's frame holds it."""
    node, frame = p.input.grad_fn, p.frame
    if node is None or frame is None or not type(node).__name__.startswith("MaskedFill"):
        return None
    try:
        mask = getattr(node, "_saved_mask", None)
    except RuntimeError:  # freed by a backward
        return None
    if not isinstance(mask, torch.Tensor):
        return None
    for name, value in frame.f_locals.items():
        if (
            isinstance(value, torch.Tensor)
            and name.isidentifier()
            and value.dtype is torch.bool
            and value.shape == mask.shape
            and value.data_ptr() == mask.data_ptr()
        ):
            return str(name)
    return None


def _target_logit_failure(
    p: _Probe, v: dict[str, float], n: int, neg: torch.Tensor, *, cdim: int
) -> None:
    """Word the positions whose target input is -inf (the failure path: reads are fine)."""
    x, t = p.input, p.target
    assert t is not None
    nll = p.spec.name == "nll_loss"
    whole = int(((x == -math.inf).all(cdim) & neg).sum())
    total = t.numel() - int(v.get("ignored", 0))
    rows = "rows" if t.dim() <= 1 else "positions"
    inp, tgt = p.arg("input"), p.arg("target")
    node = type(x.grad_fn).__name__ if x.grad_fn is not None else ""
    masked = node.startswith("MaskedFill")
    if nll:
        what = f"{inp} (log-probabilities) is -inf at the target class"
        why = f"the loss is -{inp}[target], +inf there"
    else:
        what = f"{inp} is -inf at the target class"
        why = "log_softmax at the target is -inf there, so their loss is +inf"
    if whole:
        why += f" ({_n(whole)} of them -inf in every class: NaN)"
    hint = ""
    if masked:
        hint = f" — the masked_fill that made {inp} masks the target too"
    elif node.startswith("Log"):
        hint = " — the log of a probability of 0"
    result = "NaN" if whole else "+inf"
    problem = (
        f"{what} in {_n(n)} of {_n(total)} {rows}{hint}: {why}; {p.desc()} returns {result} "
        f"(reduction={_reduction(p.bound)!r})"
    )
    fn = _functional_alias(p.frame)
    mask = _mask_name(p) if masked else None
    one_hot = f"{fn}.one_hot({tgt}, {x.shape[cdim]}).bool()"
    if mask is not None and x.dim() == 2 and cdim == 1 and not int(v.get("ignored", 0)):
        fix = (
            f"{mask} = {mask} & ~{fn}.one_hot({tgt}, {mask}.shape[1]).bool()  # before the "
            f"masked_fill that makes {inp}: keeps each row's target unmasked"
        )
    elif masked:
        fix = (
            f"exclude each row's target class from the mask that sets {inp} to -inf "
            f"(mask & ~{one_hot} for that mask), or give those rows ignore_index"
        )
    elif nll and node.startswith("Log"):
        fix = (
            f"compute {inp} with {fn}.log_softmax on the scores, not as the log of "
            f"probabilities (or call {fn}.cross_entropy on the scores)"
        )
    else:
        fix = (
            f"keep the target class of every row finite in {inp} (a -inf mask must not cover "
            "it), or give those rows ignore_index; a -inf no mask wrote was born upstream: "
            "print(nw.report) names the op"
        )
    values, counts = _value_counts(t[neg])
    p.fail(
        _Failure(
            code="NW518",
            check="target-logit",
            problem=problem,
            expected="a finite input at every trained target",
            fix=fix,
            explanation=(
                "Cross-entropy is -log_softmax(input)[target]: an input of -inf at the target "
                "(a masked_fill with -inf whose mask also covers the target, the log of a zero "
                "probability) makes that term +inf, and a row that is -inf everywhere makes it "
                "NaN. -inf elsewhere in the row is fine. PyTorch computes the inf without a "
                "word."
            ),
            values=values,
            counts=counts,
            count=n,
            total=total,
            positions=_positions(neg),
        )
    )


#: autograd ops that make finite values of finite operands (short of a dtype's overflow):
#: on the gradient side of a loss input, an inf or NaN cannot have been born in them
_FINITE_OPS = frozenset(
    (
        "Add", "Sub", "Neg", "Cat", "Stack", "View", "Reshape", "UnsafeView", "Permute",
        "Transpose", "T", "Expand", "Slice", "Select", "Clone", "Squeeze", "Unsqueeze",
        "Split", "SplitWithSizes", "Unbind", "Narrow", "AsStrided", "Flatten", "Relu",
        "Sigmoid", "Tanh",
        "Mm", "Bmm", "Addmm", "Baddbmm", "Mv", "Dot", "Matmul", "Linear", "Embedding",
        "Mul", "Div", "Index", "IndexSelect", "Gather", "Softmax", "LogSoftmax", "Clamp",
        "ClampMin", "ClampMax", "Mean", "Sum", "Gelu", "Silu", "Abs", "Repeat", "ToCopy",
    )
)  # fmt: skip
#: nodes whose operands are added: a term without history among them carries its values
_ADDS = ("AddBackward0", "SubBackward0")
_NOGRAD_LIMIT = 256  #: autograd nodes looked at on the gradient side


def _saved_finite(node: Any) -> bool:
    """Every tensor ``node`` saved for its backward is finite (a division's divisor also
    non-zero): an op with such operands made no inf or NaN."""
    for name in dir(node):
        if not name.startswith("_saved_"):
            continue
        try:
            t = getattr(node, name)
        except RuntimeError:  # freed by a backward
            return False
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
            continue
        try:
            if not bool(torch.isfinite(t).all()):
                return False
            if name == "_saved_other" and type(node).__name__.startswith("Div") and (t == 0).any():
                return False
        except RuntimeError:  # a layout without plain values (sparse, meta)
            return False
    return True


def _finite_side(node: Any, recorded: Callable[[Any], bool]) -> bool:
    """The graph under ``node`` made only finite values: every op one of :data:`_FINITE_OPS`
    whose saved operands are finite, ending at watched modules' outputs (measured by the
    watcher) or at finite leaves; operands without history are not looked at (a term of
    an add is the caller's)."""
    walk = ops.GraphWalk([node], prune=recorded, limit=_NOGRAD_LIMIT)
    for fn in walk:
        if ops.accumulates_grad(fn):
            leaf = getattr(fn, "variable", None)
            if isinstance(leaf, torch.Tensor) and not bool(torch.isfinite(leaf).all()):
                return False
            continue
        name = type(fn).__name__
        if name.split("Backward")[0] not in _FINITE_OPS or not _saved_finite(fn):
            return False
        if (
            name not in _ADDS
            and any(n is None for n, _ in fn.next_functions)
            and not any(a.startswith("_saved_") for a in dir(fn))
        ):
            return False  # an operand without history that the node did not save
    return not walk.truncated


def _nograd_add(x: torch.Tensor) -> Any | None:
    """The autograd node of the add or subtract that made ``x`` (through views and copies)
    when one of its operands has no autograd history (a term computed without gradients);
    None otherwise. Reads no value."""
    fn = x.grad_fn
    for _ in range(8):  # views and copies between the add and the loss
        if fn is None or type(fn).__name__.split("Backward")[0] not in _SHAPE_ONLY:
            break
        nxt = [n for n, _ in fn.next_functions if n is not None]
        fn = nxt[0] if len(nxt) == 1 else None
    if fn is None or type(fn).__name__ not in _ADDS:
        return None
    if [n for n, _ in fn.next_functions].count(None) != 1:
        return None
    return fn


def _nograd_entry(x: torch.Tensor, recorded: Callable[[Any], bool]) -> str | None:
    """The add or subtract through which a loss input's inf or NaN entered from a term with
    no autograd history (``logits - torch.log(q)`` with ``q`` a count-based frequency that is
    0), when the rest of the graph provably made only finite values: ``"-"`` or ``"+"``.
    None when the graph cannot tell (then the watcher's diagnosis stands)."""
    fn = _nograd_add(x)
    if fn is None:
        return None
    sides = [n for n, _ in fn.next_functions]
    grad_side = next(n for n in sides if n is not None)
    if not (recorded(grad_side) or _finite_side(grad_side, recorded)):
        return None
    return "-" if type(fn).__name__.startswith("Sub") else "+"


_LOG_FUNCS = ("torch", "np", "numpy", "math")


def _log_term(p: _Probe) -> tuple[str, str, str] | None:
    """The user's line that adds a log to the loss input (``logits = logits -
    torch.log(q[items])[None, :]``), looked for from the loss line back through the lines
    of the function before it, that line made finite, and a comment for it; None when no
    such line is found. The floor is one a probability can have (the uniform 1/N of an
    indexed per-item table), or else no correction where the argument is 0: never the
    dtype's tiny, whose log (-87 in float32) would add 87 to the score and bury the loss."""
    f = p.frame
    name = p.arg(p.spec.input)
    if f is None:
        return None
    first = max(f.f_code.co_firstlineno, f.f_lineno - 40)
    for lineno in range(f.f_lineno, first - 1, -1):
        raw = linecache.getline(f.f_code.co_filename, lineno)
        line = _without_comment(raw.strip())
        if not line:
            continue
        try:
            tree = ast.parse(line)
        except SyntaxError:
            continue
        stmt = tree.body[0] if len(tree.body) == 1 else None
        if lineno != f.f_lineno and not (
            isinstance(stmt, (ast.Assign, ast.AugAssign))
            and any(
                ast.get_source_segment(line, t) == name
                for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])
            )
        ):
            continue
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "log"
            ):
                continue
            owner = ast.get_source_segment(line, node.func.value) or ""
            if owner in _LOG_FUNCS and len(node.args) == 1 and not node.keywords:
                arg = ast.get_source_segment(line, node.args[0])
                head = line[: node.args[0].col_offset]
                tail = line[node.args[0].end_col_offset or 0 :]
            elif owner and owner not in _LOG_FUNCS and not node.args and not node.keywords:
                arg = owner
                head = line[: node.func.value.col_offset] + "torch.log("
                tail = ")" + line[node.end_col_offset or 0 :]
            else:
                continue
            if not arg or owner in ("np", "numpy", "math"):
                continue
            a = arg if _NAME_EXPR.fullmatch(arg) else f"({arg})"
            table = _indexed_table(f, arg)
            if table is not None:  # q[items]: an item never counted gets the uniform 1/N
                fixed = f"{head}{a}.clamp_min(1.0 / {table}.numel()){tail}"
                return line, fixed, "an item never counted gets the uniform probability"
            start, end = node.col_offset, node.end_col_offset or node.col_offset
            fixed = f"{line[:start]}torch.where({a} > 0, torch.log({a}), 0.0){line[end:]}"
            return line, fixed, "no correction where the frequency is 0"
    return None


def _indexed_table(f: Any, arg: str) -> str | None:
    """``q`` when ``arg`` is ``q[...]`` and ``q`` names a 1-D floating tensor in the frame
    (looked up, never evaluated): a per-item probability table whose size is the number of
    items."""
    m = _INDEXED.fullmatch(arg)
    if m is None:
        return None
    base = m.group(1)
    obj = _looked_up(f, base)
    if isinstance(obj, torch.Tensor) and obj.dim() == 1 and obj.is_floating_point():
        return base
    return None


def _looked_up(f: Any, dotted: str) -> Any:
    """The object ``dotted`` (``buf_y``, ``self.buf.labels``) names in frame ``f``: looked
    up, never evaluated (instance attributes and a module's buffers; no property runs)."""
    head, *attrs = dotted.split(".")
    obj = f.f_locals.get(head, f.f_globals.get(head))
    for attr in attrs:
        found = getattr(obj, "__dict__", {}).get(attr)
        if found is None and isinstance(obj, torch.nn.Module):
            found = obj._buffers.get(attr, obj._parameters.get(attr))
        obj = found
    return obj


_INDEXED = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\[[^\[\]]*\]")


_NAME_EXPR = re.compile(r"[A-Za-z_][\w.]*(\[[^\[\]]*\])*")


def _nograd_input_result(p: _Probe, v: dict[str, float]) -> None:
    """A cross-entropy input holding +inf or NaN that no watched module made and no op with
    a gradient made: it entered through a term added without gradients (a logQ /
    sampling-bias correction ``logits - torch.log(q)`` where ``q`` is 0 for a new item).
    The watcher cannot name it (it never enters the autograd graph), so the guard does. A
    non-finite input a watched module made is the watcher's to trace."""
    hi, x = v.get("input_max", math.nan), p.input
    if p.upstream or p.ops_checked or not (math.isnan(hi) or hi == math.inf):
        return  # born upstream, or an op the forensic watcher names
    if p.in_module:
        return  # in a watched module's forward: its replay names the op
    if p.known(x) is not None or p.from_module(x):
        return  # a watched module's output: the watcher traces it to its op
    sign = _nograd_entry(x, p.recorded)
    if sign is None:
        return
    pos, neg, nan = (int(m.sum()) for m in (x == math.inf, x == -math.inf, x.isnan()))
    bad = ~torch.isfinite(x)
    parts = [f"{_n(c)} {w}" for c, w in ((pos, "+inf"), (neg, "-inf"), (nan, "NaN")) if c]
    inp = p.arg(p.spec.input)
    done, verb = ("subtracted", "subtracted from") if sign == "-" else ("added", "added to")
    problem = (
        f"{inp} holds {', '.join(parts)} of {_n(x.numel())} values, and no watched module "
        f"and no op with a gradient made them: they come from a term computed without "
        f"gradients (a correction or constant) {verb} the scores; {p.desc()} returns NaN"
    )
    found = _log_term(p)
    if found is not None:
        fix = f"{found[1]}   # {found[2]}"
    else:
        fix = (
            f"make the term {verb} {inp} finite before it is {done} (a log of a "
            "count-based frequency that is 0, a division by a zero count): clamp what it "
            "takes the log of, or divides by, away from 0"
        )
    values, counts = _value_counts(x[bad])
    p.fail(
        _Failure(
            code="NW519",
            check="nograd-term",
            problem=problem,
            expected="finite scores in every row",
            fix=fix,
            explanation=(
                "A +inf score makes its row's log-sum-exp +inf, so log_softmax at the target "
                "is -inf (NaN where the target's own score is +inf) and the loss is NaN. A "
                "term without gradients (logits - torch.log(q) as a sampling-bias "
                "correction, q a frequency that is 0 for an item never seen) never enters "
                "the autograd graph, so nothing upstream can name the op that made it."
            ),
            values=values,
            counts=counts,
            count=int(bad.sum()),
            total=x.numel(),
            positions=_positions(bad),
        )
    )


def _class_evidence(p: _Probe, v: dict[str, float], *, cdim: int, ign: torch.Tensor | None) -> None:
    """Evidence for the rules that only matters when the first read shows it could, read in
    a second round then: whether the rows are probabilities (all inputs in [0, 1]: a softmax
    before the loss), and the logit magnitude at ignored vs trained positions (targets equal
    to ignore_index exist)."""
    x = p.input
    lo, hi = v.get("input_min", math.nan), v.get("input_max", math.nan)
    if lo >= 0.0 and hi <= 1.0:  # rows that are probabilities sum to 1
        acc = torch.float32 if x.element_size() < 4 else None
        smin, smax = aminmax(x.sum(dim=cdim, dtype=acc))
        p.add("row_sum_min", smin)
        p.add("row_sum_max", smax)
    if ign is not None and v.get("ignored", 0.0) > 0:
        amax = x.detach().abs().amax(dim=cdim)  # max |x| over each position's classes
        if tuple(amax.shape) == tuple(ign.shape):
            p.add("ignored_amax", torch.where(ign, amax, 0).max())
            p.add("valid_amax", torch.where(ign, 0, amax).max())


#: autograd nodes of a view or reshape: their saved input sizes and output metadata say what
#: they made of which shape
_VIEW_NODES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})


def _batch_view(x: torch.Tensor, batch: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(its input's shape, its output's) of the view in ``x``'s autograd history that made a
    tensor of ``batch`` leading rows into one of ``x``'s, when its output rows are not a
    flattening of leading dimensions (``(8, 16, 4, 4)`` into ``(16, 128)``: values of one
    sample spread over rows, not ``(8, 5, 10)`` into ``(40, 10)``); None without a graph or
    such a view. Read only when the batch sizes already differ (the failure path)."""
    rows = x.shape[0]
    todo: list[Any] = [x.grad_fn]
    seen: set[Any] = set()
    while todo and len(seen) < 256:  # nearest the loss first
        node = todo.pop(0)
        if node is None or node in seen or ops.accumulates_grad(node):
            continue
        seen.add(node)
        if type(node).__name__ in _VIEW_NODES:
            try:
                before = tuple(int(d) for d in node._saved_self_sym_sizes)
                after = tuple(int(d) for d in node._input_metadata[0].shape)
            except Exception:  # older torch: no metadata on the node
                return None
            if before and after and before[0] == batch and after[0] == rows:
                flat = any(math.prod(before[:k]) == rows for k in range(1, len(before) + 1))
                return None if flat else (before, after)
        todo += [n for n, _ in getattr(node, "next_functions", ()) or ()]
    return None


def _class_shape_failure(p: _Probe, c: int, expected: tuple[int, ...], desc: str) -> None:
    t, x = p.target, p.input
    assert t is not None
    ts, xs = tuple(t.shape), tuple(x.shape)
    inp, tgt = p.arg("input"), p.arg("target")
    hint, fix = "", f"give {tgt} the shape {expected}"
    if ts == xs and x.dim() >= 2 and not t.is_floating_point() and not t.is_complex():
        hint = " — an integer target shaped like the input: one-hot rows, not class indices"
        fix = p.call_with(target=f"{_paren(tgt)}.argmax(1)")
        if p.spec.name == "cross_entropy":
            fix += f"  # or {_paren(tgt)}.float(), read as class probabilities"
        fix += "; several labels a row: F.binary_cross_entropy_with_logits, a float target"
    elif t.dim() == x.dim() and t.dim() >= 2 and ts[1] == 1 and ts[:1] + ts[2:] == expected:
        hint = " — the target has a channel dimension of size 1"
        fix = p.call_with(target=f"{_paren(tgt)}.squeeze(1)")
    elif x.dim() >= 3 and ts == xs[:-1]:
        hint = f" — the {xs[-1]} classes look like the last dimension"
        fix = p.call_with(input=f"{_paren(inp)}.movedim(-1, 1)")
        if x.dim() == 3:
            flat = {"input": f"{_paren(inp)}.flatten(0, 1)", "target": f"{_paren(tgt)}.flatten()"}
            fix += f"  # or {p.call_with(**flat)}"
    elif t.dim() >= 1 and x.dim() >= 1 and ts[0] != xs[0] and t.numel() == math.prod(expected):
        # logits flattened to (B*T, C) and targets left (B, T): one class a row, reshaped
        hint = f" — the target holds one class for each of the input's {xs[0]} rows, shaped {ts}"
        shape = "-1" if len(expected) == 1 else ", ".join(map(str, expected))
        fix = p.call_with(target=f"{_paren(tgt)}.reshape({shape})")
        fix += f"  # flattened like {inp}"
    elif t.dim() >= 1 and x.dim() >= 1 and ts[0] != xs[0]:
        hint = f" — the batch sizes differ ({xs[0]} vs {ts[0]})"
        fix = f"check that {inp} and {tgt} come from the same batch"
        moved = _batch_view(x, ts[0])
        if moved is not None:  # the model's own view spread each sample over several rows
            before, after = moved
            per = math.prod(before[1:])
            hint += (
                f": a view/reshape in the model made {before} into {after}, so its rows are "
                f"no longer samples (a sample has {math.prod(before[1:])} values, a row "
                f"{math.prod(after[1:])})"
            )
            fix = (
                f"flatten each sample on its own where the model reshapes {before}: "
                f"x.flatten(1) (or x.view(x.size(0), -1)), {per} values a sample"
                + (
                    f"; the layer after it then takes in_features={per}, not {after[1]}"
                    if len(after) == 2
                    else ""
                )
            )
    elif t.dim() == len(expected) and len(expected) >= 2:
        hint = f" — the spatial sizes differ ({expected[1:]} vs {ts[1:]})"
        size = f"{tgt}.shape[-{len(expected) - 1}:]"
        fix = p.call_with(input=f"F.interpolate({inp}, size={size}, mode='bilinear')")
        fix += "  # or resize the mask to the logits with mode='nearest'"
    p.fail(
        _Failure(
            code="NW503",
            check="target-shape",
            problem=(
                f"target has shape {ts} and input {xs}: {desc} reads the classes from dim 1 of "
                f"the input ({c} classes) and needs a target of shape {expected}{hint}"
            ),
            expected=f"target of shape {expected}",
            fix=fix,
            explanation=(
                "Class-index losses take the class scores in dimension 1 of the input and one "
                "index per remaining position in the target."
            ),
            values=(ts,),
        )
    )


def _loss_options(p: _Probe) -> str:
    """The loss's non-default options besides ignore_index and reduction, as keyword
    arguments of F.cross_entropy / F.nll_loss in the user's names: ``weight=criterion.weight,
    label_smoothing=0.1``."""
    parts = []
    w = p.bound.get("weight")
    if isinstance(w, torch.Tensor):
        parts.append(f"weight={p.callee}.weight" if p.is_module else f"weight={p.arg('weight')}")
    ls = p.bound.get("label_smoothing")
    if isinstance(ls, (int, float)) and not isinstance(ls, bool) and ls:
        parts.append(f"label_smoothing={ls!r}")
    return ", ".join(parts)


def _shifted_labels(p: _Probe, ignore: int) -> dict[str, Any] | None:
    """Every target of the loss is ignored, yet the watched model it runs inside was given
    an integer tensor of targets (labels) with some that count, all in the first position
    of the last dimension: the model shifts its labels by one before the loss (a causal
    LM predicts token t + 1 from tokens up to t), so the first position is never a target.
    The argument's name, shape and counting labels; None otherwise. Failure path only."""
    t = p.target
    if t is None or p.site is None or not p.roots:
        return None
    try:
        roots = {id(m) for m in p.roots}
        f: types.FrameType | None = p.site
        hops = 0
        while f is not None and f is not p.frame and hops < 64:
            hops += 1
            me = f.f_locals.get("self")
            if id(me) in roots:
                code = f.f_code
                n = code.co_argcount + code.co_kwonlyargcount
                args = [(k, f.f_locals.get(k)) for k in code.co_varnames[:n]]
                if code.co_flags & inspect.CO_VARKEYWORDS:
                    extra = f.f_locals.get(code.co_varnames[n + bool(code.co_flags & 4)])
                    if isinstance(extra, dict):
                        args += [(str(k), val) for k, val in extra.items()]
                for name, val in args:
                    if not (
                        isinstance(val, torch.Tensor)
                        and not val.is_floating_point()
                        and not val.is_complex()
                        and val.dim() >= 1
                        and val.shape[-1] >= 2
                        and val.numel() in (t.numel(), t.numel() + val.numel() // val.shape[-1])
                    ):
                        continue
                    counting = val != ignore
                    total = int(counting.sum())
                    if total and not bool(counting[..., 1:].any()):
                        return {"arg": name, "shape": list(val.shape), "counting": total}
                return None
            f = f.f_back
    except Exception:  # a frame that cannot be read: no evidence
        return None
    return None


def _class_result(
    p: _Probe,
    v: dict[str, float],
    *,
    c: int,
    lo: int,
    ignore: int | None,
    ign: torch.Tensor | None,
    desc: str,
) -> None:
    if ignore is not None:
        p.data["ignore_index"] = ignore
        ignored = int(v.get("ignored", 0))
        p.data["ignored"] = ignored
        if ignored and p.target is not None and ignored == p.target.numel():
            # every target ignored: the mean is 0/0, and a fix that rewrites the loss call
            # must keep the loss's other options (a label_smoothing, class weights)
            p.data["loss_options"] = _loss_options(p)
            by_one = _shifted_labels(p, ignore)
            if by_one is not None:
                p.data["labels_shifted"] = by_one
    if lo <= v["target_min"] and v["target_max"] < c:
        return
    t = p.target
    assert t is not None
    # failure path: count and locate (a second read is fine now)
    bad = (t < lo) | (t >= c)
    if ign is not None:
        bad &= ~ign
    nbad = int(bad.sum())
    values, counts = _value_counts(t[bad])
    total = t.numel()
    name = p.spec.name
    top = values[0]
    fix = ""
    if name == "multilabel_margin_loss":
        accepts = f"accepts -1..{c - 1} (-1 ends each row's labels)"
    else:
        accepts = f"accepts 0..{c - 1}"
    hint = ""
    if ignore is not None and top in _IGNORE_LABELS and top != ignore and _in_library(p):
        # a library's loss call (transformers' with -100): its ignore_index is not the
        # user's to change; the labels they pass in are
        hint, fix = _library_ignore(p, t, top, ignore)
    elif ignore is not None and top in _IGNORE_LABELS and top != ignore:
        hint = f" — did you mean ignore_index={top}?"
        fix = _option_fix(p, "ignore_index", top)
        if top < 0 and 2 * counts[0] > total:
            hint, fix = _unfilled_slots(p, top, counts[0], total, fix)
    elif all(val == c for val in values) and _one_based(t, ign, c, lo):
        hint = (
            f" — class indices start at 0: labels 1..{c} need `target - 1`, or the model "
            f"needs {c + 1} outputs"
        )
        tgt = p.arg("target")
        if ign is not None and int(v.get("ignored", 0)):
            # the shift must leave the ignore_index as it is (-100 - 1 is a label)
            shifted = f"torch.where({tgt} == {ignore}, {tgt}, {tgt} - 1)"
        else:
            shifted = f"{tgt} - 1"
        fix = p.call_with(target=shifted)
    elif all(val == c for val in values) and _smallest_label(t, ign) >= lo + 1:
        # no 0 among the labels, but too few distinct ones for a numbering from 1 (a
        # vocabulary: an end-of-sequence id from a tokenizer the model was not resized for)
        hint = (
            f" — {c} is one past the last class ({c - 1}): a class (a token id) the model has "
            f"no output for, so the model needs {c + 1} outputs"
        )
        fix = _more_outputs(p, c + 1, c)
    elif all(val == c for val in values):  # labels 0..c: one class more than outputs
        hint = f" — the labels run 0..{c}, so they need {c + 1} classes"
        fix = _more_outputs(p, c + 1, c)
    elif all(val < 0 for val in values):
        hint = " — negative values are not class indices"
        fix = (
            _option_fix(p, "ignore_index", top)
            if ignore is not None
            else "map negative labels to valid classes"
        )
    else:
        top_label = int(max(values))
        hint = f" — the largest label is {top_label}, so the labels need {top_label + 1} classes"
        fix = _more_outputs(p, top_label + 1, c)
    problem = (
        f"target contains {_describe_values(values, counts)} (of {_n(total)}); {desc} with "
        f"{c} classes {accepts}{hint}"
    )
    p.fail(
        _Failure(
            code="NW501",
            check="target-range",
            problem=problem,
            expected=accepts.removeprefix("accepts ")
            + (f", or ignore_index={ignore}" if ignore is not None else ""),
            fix=fix,
            explanation=(
                "A class index outside [0, C) reads past the class scores: on a GPU the "
                "kernel's assert kills the CUDA context, on the CPU PyTorch raises "
                "'Target ... is out of bounds' without saying where the value came from."
            ),
            values=values,
            counts=counts,
            count=nbad,
            total=total,
            positions=_positions(bad),
        )
    )


#: the ignore_index of torch's class losses, which libraries pass on (transformers' -100)
_IGNORE_DEFAULT = -100


def _library_ignore(
    p: _Probe, t: torch.Tensor, top: int, ignore: int, *, source: str | None = None
) -> tuple[str, str]:
    """(hint, fix) for labels marked with ``top`` to be skipped, given to a loss that a
    library calls with ``ignore_index=ignore`` (a Hugging Face model's ``labels``, skipped
    at -100): the labels change, in the user's tensor when one of theirs holds them.
    ``source``: the user's tensor the library made ``t`` from (a seq2seq model's decoder
    ids, shifted right from the labels, with -100 turned into padding on the way)."""
    name = source or _user_tensor(p.frame, t) or "labels"
    if source is not None:
        hint = (
            f" — the model shifted {source} right by one into this input, {top} and all: "
            f"mark the labels to skip with {ignore} (the ignore_index of torch's losses), "
            f"not {top}"
        )
        fix = f"{name} = {name}.masked_fill({name} == {top}, {ignore})   # before the model call"
        return hint, fix
    site = _site_name(p.site) if p.site is not None else "a library"
    hint = f" — {site} makes this call: mark the labels to skip with {ignore}, not {top}"
    fix = f"{name} = {name}.masked_fill({name} == {top}, {ignore})   # before the model call"
    return hint, fix


def _frame_tensors(frame: types.FrameType | None) -> list[tuple[str, torch.Tensor]]:
    """The tensors a user's frame holds, each with the expression that reads it: a local
    (``labels``), or an entry of a local mapping under a string key (``batch["labels"]``:
    the dict or ``BatchEncoding`` of a ``model(**batch)`` loop)."""
    if frame is None:
        return []
    found: list[tuple[str, torch.Tensor]] = []
    entries: list[tuple[str, torch.Tensor]] = []
    for key, v in list(frame.f_locals.items()):
        if not isinstance(key, str) or not key.isidentifier() or key == "self":
            continue
        if isinstance(v, torch.Tensor):
            found.append((key, v))
        elif isinstance(v, Mapping):
            try:
                items = list(v.items())
            except Exception:  # a mapping whose items cannot be listed
                continue
            entries += [
                (f"{key}[{k!r}]", t)
                for k, t in items
                if isinstance(k, str) and isinstance(t, torch.Tensor)
            ]
    return found + entries


def _made_from(p: _Probe, ids: torch.Tensor, neg: list[int]) -> str | None:
    """The user's integer tensor (``batch["labels"]``) that a library shifted right by one
    into the guarded ids (a seq2seq model's decoder inputs), when a library made the call,
    no tensor of the user's holds the ids, and the one negative value they have came with
    the shift (a failure path: reads are fine)."""
    if len(neg) != 1 or not _in_library(p) or _holds(p.frame, ids):
        return None
    found = [
        name
        for name, t in _frame_tensors(p.frame)
        if t is not ids
        and t.dtype == ids.dtype
        and t.device == ids.device
        and t.shape == ids.shape
        and t.shape[-1] >= 2
        and bool((t == neg[0]).any())
        and bool((ids[..., 1:] == t[..., :-1]).all())  # shifted right by one
    ]
    return found[0] if len(found) == 1 else None


def _user_tensor(frame: types.FrameType | None, t: torch.Tensor) -> str | None:
    """The name of a tensor variable of ``frame`` whose values ``t`` views (the user's
    ``labels``, which a library flattened with ``labels.view(-1)``, or ``batch["labels"]``
    of a ``model(**batch)`` call), if there is one."""
    if frame is None or not _plain(t):
        return None
    for key, v in _frame_tensors(frame):
        if (
            _plain(v)
            and v.dtype == t.dtype
            and v.device == t.device
            and v.numel() == t.numel()
            and v.data_ptr() == t.data_ptr()
        ):
            return key
    return None


def _unfilled_slots(p: _Probe, top: int, n: int, total: int, option: str) -> tuple[str, str]:
    """(hint, fix) for a negative sentinel label (-1) that fills most of the batch: rather
    the empty slots of a buffer sampled past its filled entries (a replay buffer made with
    ``torch.full(..., -1)``), or padding, than labels to skip. Evidence, when the target is
    ``buf[idx]`` and ``buf`` is a tensor in the user's frame: the slots of ``buf`` that
    hold only ``top`` (a run at its end: never filled) and the line that made ``idx``.
    ``ignore_index`` comes second: it hides the sampling bug, and a batch of only ``top``
    then has a mean over zero elements (NaN)."""
    tgt = p.arg("target")
    buf = idx = None
    try:
        node = ast.parse(tgt, mode="eval").body
    except SyntaxError:
        node = None
    if isinstance(node, ast.Subscript) and p.frame is not None:
        base = ast.unparse(node.value)
        if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", base):
            obj = _looked_up(p.frame, base)
            if isinstance(obj, torch.Tensor) and obj.dim() >= 1 and _plain(obj):
                buf = (base, obj)
        if isinstance(node.slice, ast.Name):
            idx = node.slice.id
    evidence = ""
    filled = None
    if buf is not None:
        base, obj = buf
        slots = (obj == top).reshape(obj.shape[0], -1).all(-1)
        empty = int(slots.sum())
        if empty:
            size = obj.shape[0]
            first = size - int(slots.flip(0).int().cumprod(0).sum())  # the trailing run
            if first < size and size - first == empty:
                filled = first
                evidence = f"; {base} holds {top} in its slots {first}..{size - 1}, never filled"
            else:
                evidence = f"; {base} holds {top} in {empty} of its {size} slots"
    made = _made_at(p, idx) if idx is not None else None
    if made is not None and p.frame is not None:
        file = os.path.basename(p.frame.f_code.co_filename)
        evidence += f"; {idx} is made at {file}:{made[0]}: {made[1]}"
    where = buf[0] if buf is not None else "the buffer"
    now = f" (now {filled})" if filled is not None else ""
    mean = _reduction(p.bound) in (None, "mean")
    nan = f"; a batch of only {top} then has a NaN mean (0/0)" if mean else ""
    hint = (
        f" — {top} fills {_n(n)} of {_n(total)} positions: it may mark unfilled slots or "
        f"padding of a buffer, not labels to skip{evidence}; sample only filled entries "
        f"(torch.randint(0, min(n_seen, capacity), ...)); ignore_index={top} would hide "
        f"them{nan}"
    )
    fix = (
        f"# sample only the filled slots of {where}: "
        f"{idx or 'idx'} = torch.randint(0, min(n_seen, capacity), ...)  # n_seen: filled "
        f"slots{now}\n{_without_comment(option)}  # only if {top} marks labels to skip"
        f"{nan}"
    )
    return hint, fix


def _one_based(t: torch.Tensor, ign: torch.Tensor | None, c: int, lo: int) -> bool:
    """Whether the trained labels look numbered from 1 (``1..C``): none below ``lo + 1``, and
    at least half of ``1..C`` present. A missing 0 alone says nothing when the labels are
    few against C (24 token ids of a 100-token vocabulary rarely include id 0). The failure
    path: a read is fine."""
    kept = t if ign is None else t[~ign]
    if not kept.numel() or float(kept.min()) < lo + 1:
        return False
    if c <= 1:
        return True
    distinct = int(torch.unique(kept).numel())
    return distinct >= 2 and 2 * distinct >= c


def _more_outputs(p: _Probe, k: int, c: int) -> str:
    """The fix for class targets that need ``k`` classes where the model has ``c`` outputs:
    a language model that can resize its output to its tokenizer
    (``model.resize_token_embeddings``) when its output embeddings have the ``c`` rows,
    else ``k`` outputs or labels remapped."""
    for root in p.roots:
        get = getattr(root, "get_output_embeddings", None)
        if not callable(get) or not callable(getattr(root, "resize_token_embeddings", None)):
            continue
        try:
            out = get()
        except Exception:  # a model that does not implement it
            continue
        w = getattr(out, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and int(w.shape[0]) == c:
            from nanwatch.watcher import _name_in_frame

            name = _name_in_frame(p.frame, root) or "model"
            return (
                f"{name}.resize_token_embeddings(len(tokenizer))  # an output for every "
                f"token id of the tokenizer that made the labels (at least {k}); or map "
                f"the ids >= {c} to ones the model has"
            )
    counted = _config_count(p, c)
    if counted is not None:
        from nanwatch.watcher import _name_in_frame

        root, key = counted
        name = _name_in_frame(p.frame, root) or "model"
        cls = type(root).__name__
        source = getattr(getattr(root, "config", None), "_name_or_path", None)
        if source and isinstance(source, str) and callable(getattr(root, "from_pretrained", None)):
            return (
                f"{name} = {cls}.from_pretrained({source!r}, {key}={k}, "
                f"ignore_mismatched_sizes=True)   # was {key}={c}: a head with {c} outputs; "
                f"or remap the labels to 0..{c - 1}"
            )
        held = _name_in_frame(p.frame, getattr(root, "config", None))
        if held is not None:
            return (
                f"{held}.{key} = {k}   # was {c}: then build {name} again from {held}; "
                f"or remap the labels to 0..{c - 1}"
            )
        return (
            f"# build {name} from a config with {key}={k} (it has {key}={c}), "
            f"or remap the labels to 0..{c - 1}"
        )
    return f"give the model {k} outputs, or remap the labels to 0..{c - 1}"


def _config_count(p: _Probe, c: int) -> tuple[nn.Module, str] | None:
    """The watched model and the one setting of its config that counts its classes
    (``num_labels``, ``num_classes``, a property or a plain attribute) when it equals the
    ``c`` outputs the loss got: the setting to change for labels that need more."""
    found: list[tuple[nn.Module, str]] = []
    for root in p.roots:
        config = getattr(root, "config", None)
        if config is None:
            continue
        keys = set(getattr(config, "__dict__", {}))
        keys |= {n for n in dir(type(config)) if isinstance(getattr(type(config), n), property)}
        for key in sorted(keys):
            if not re.search(r"(?:^|_)(?:labels|classes)$", key):
                continue
            try:
                value = getattr(config, key)
            except Exception:  # a property that needs what this config lacks
                continue
            if type(value) is int and value == c:
                found.append((root, key))
    return found[0] if len(found) == 1 else None


def _smallest_label(t: torch.Tensor, ign: torch.Tensor | None) -> float:
    """The smallest class target that is not ignored (a failure path: a read is fine)."""
    kept = t if ign is None else t[~ign]
    return float(kept.min()) if kept.numel() else math.inf


def _option_fix(p: _Probe, name: str, value: Any) -> str:
    if p.is_module:
        return p.construct(**{name: value})
    return _functional_option(p, name, value)


def _functional_option(p: _Probe, name: str, value: Any) -> str:
    if p.has_arg(name):
        return p.call_with(**{name: repr(value)})
    return p.call_with({name: value})


def _soft_target_rows(p: _Probe, t: torch.Tensor) -> torch.Tensor:
    """A probability target as rows of class weights (float64): one row per sample (and
    spatial position), classes last."""
    cdim = 1 if t.dim() > 1 and p.spec.name == "cross_entropy" else t.dim() - 1
    return t.detach().movedim(cdim, -1).reshape(-1, t.shape[cdim]).double()


def _two_hot(rows: torch.Tensor) -> bool:
    """Whether every row weighs at most two adjacent classes, summing to 1, and some row
    two of them: a two-hot encoding of a value between two bins (a distributional reward
    or value head). A one-hot target is not one."""
    if not rows.numel():
        return False
    nz = rows != 0
    count = nz.sum(-1)
    c = rows.shape[-1]
    first = nz.int().argmax(-1)
    last = c - 1 - nz.flip(-1).int().argmax(-1)
    sums_one = (rows.sum(-1) - 1).abs() <= 1e-3
    return bool(
        ((count >= 1) & (count <= 2) & (last - first <= 1) & sums_one).all() and (count == 2).any()
    )


def _soft_target_result(p: _Probe, v: dict[str, float], outside: torch.Tensor) -> None:
    """Words a probability target that is not one (the failure path: reads are fine). A
    NaN is bad data where the target is made, not a scale; rows that sum to 1 with a weight
    outside [0, 1] are an encoding extrapolated past its range (a two-hot value beyond the
    last bin); only rows that are no distribution at all (scores, counts) are rescaled."""
    n = int(v["target_outside"])
    if not n:
        return
    t = p.target
    assert t is not None
    desc = p.desc()  # ignore_index plays no part for probability targets
    tgt = p.arg("target")
    rows = _soft_target_rows(p, t)
    bad_row = rows.isnan().any(-1) | (rows.clamp(0, 1) != rows).any(-1)
    finite = torch.isfinite(t)
    n_nan = int(t.isnan().sum())
    n_inf = int(t.isinf().sum())
    made = _made_at(p, tgt)
    where = ""
    if made is not None and p.frame is not None:
        file = os.path.basename(p.frame.f_code.co_filename)
        where = f"; {tgt} is made at {file}:{made[0]}: {made[1]}"
    in_rows = f"{_many(int(bad_row.sum()), 'row')} of {_n(rows.shape[0])}"
    expected = "probabilities in [0, 1]"
    if n_nan or n_inf:
        kinds = " and ".join(
            f"{k} at {_many(m, 'position')}" for k, m in (("NaN", n_nan), ("inf", n_inf)) if m
        )
        problem = (
            f"target holds {kinds} (of {_n(t.numel())}, in {in_rows}){where}; bad data, "
            f"not a scale: {desc} with probability targets needs finite values in [0, 1]"
        )
        if _two_hot(rows[~bad_row]):
            problem += (
                "; its other rows are two-hot (two adjacent bins summing to 1): a value "
                "outside the bins' range puts both bin indices on the same edge bin, and its "
                "weight divides by their width, 0"
            )
            fix = (
                f"# where {tgt} is made: clamp the value into the bins' range before the "
                "two-hot encoding (value.clamp(bins[0], bins[-1])) and keep the upper index "
                "in [1, len(bins) - 1], so the two bins differ and no bin width is 0"
            )
        else:
            fix = (
                f"assert torch.isfinite({tgt}).all()   # where {tgt} is made: find the 0/0 "
                "(a zero width, count or norm) or log(0) that gave it, and repair it there"
            )
        values, counts = _value_counts(t[~finite])
        explanation = (
            "The target was NaN or inf before the loss saw it (0/0 gives NaN, x/0 inf): the "
            "loss and every gradient of the step would be NaN. A softmax or a clamp of the "
            "target cannot repair it: repair the entries where the target is made."
        )
    else:
        bad_rows = rows[bad_row]
        sums_one = bool(((bad_rows.sum(-1) - 1).abs() <= 1e-3).all())
        problem = (
            f"target probabilities outside [0, 1] at {_many(n, 'position')} "
            f"(of {_n(t.numel())}, in {in_rows}; min {_num(v['target_min'])}, "
            f"max {_num(v['target_max'])}){where}; {desc} with probability targets needs "
            "values in [0, 1]"
        )
        if sums_one and _two_hot(bad_rows):
            c = rows.shape[-1]
            cls = sorted({int(i) for i in bad_rows.nonzero()[:, 1].tolist()})
            side = (
                "beyond the last bin"
                if cls and min(cls) >= c - 2
                else "below the first bin"
                if cls and max(cls) <= 1
                else "outside its two bins"
            )
            problem += (
                f"; the rows sum to 1 over two adjacent classes ({', '.join(map(str, cls[:4]))}"
                f"{' …' if len(cls) > 4 else ''}): a two-hot encoding of a value {side}, "
                "its weights extrapolated"
            )
            fix = (
                f"# where {tgt} is made: clamp the value into the bins' range before the "
                "two-hot encoding (value.clamp(bins[0], bins[-1])), so both weights stay in "
                "[0, 1]"
            )
        elif sums_one:
            problem += (
                "; the rows sum to 1 but hold weights outside [0, 1]: a mixture extrapolated "
                "past its range (a smoothing or mixing weight outside [0, 1])"
            )
            fix = (
                f"# where {tgt} is made: keep every mixing weight in [0, 1] (clamp the value "
                "or weight before it is encoded), so the rows stay distributions"
            )
        elif float(v["target_min"]) >= 0:
            cdim = 1 if t.dim() > 1 and p.spec.name == "cross_entropy" else t.dim() - 1
            fix = (
                p.call_with(target=f"{_paren(tgt)} / {_paren(tgt)}.sum(dim={cdim}, keepdim=True)")
                + "  # if the targets are counts; or pass class indices (int64)"
            )
        else:
            fix = (
                p.call_with(target=f"{_paren(tgt)}.softmax(dim=1)")
                + "  # if the targets are scores (logits); or pass class indices (int64)"
            )
        values, counts = (v["target_min"], v["target_max"]), ()
        explanation = (
            "A float target shaped like the input is read as class probabilities; values "
            "outside [0, 1] (an extrapolated encoding, logits, counts) give a meaningless loss."
        )
    p.fail(
        _Failure(
            code="NW511",
            check="target-probabilities",
            problem=problem,
            expected=expected,
            fix=fix,
            explanation=explanation,
            values=values,
            counts=counts,
            count=int((outside | ~finite).sum()),
            total=t.numel(),
            positions=_positions(outside | ~finite),
        )
    )


# -- CTC -------------------------------------------------------------------------------
def _ctc_lengths(v: Any, n: int, device: torch.device) -> torch.Tensor | None:
    """CTC's ``input_lengths`` or ``target_lengths`` (a tensor of ``n`` or, unbatched, a 0-d
    one; a tuple or list of ints) as ``n`` integers on ``device``; None when they are not."""
    if isinstance(v, torch.Tensor):
        if not _plain(v) or v.is_floating_point() or v.is_complex() or v.dtype is torch.bool:
            return None
        lens = v.reshape(-1)
    elif isinstance(v, (tuple, list)):
        try:
            lens = torch.as_tensor(v)
        except (TypeError, ValueError, RuntimeError):
            return None
        if lens.dim() != 1 or lens.is_floating_point() or lens.dtype is torch.bool:
            return None
    else:
        return None
    if lens.shape[0] != n:
        return None
    # a CPU -> device copy may be asynchronous; a device -> CPU one must not be (unread)
    return lens.to(device, non_blocking=lens.device.type == "cpu")


def _ctc_short(
    t: torch.Tensor, tlens: torch.Tensor, ilens: torch.Tensor, used: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(short, need, repeats) per sample: whether its input has fewer frames than its target
    needs, the frames the target needs (its length plus its repeats: equal adjacent
    labels, each pair of which needs a blank between), and the repeats. ``t``: the padded
    ``(N, S)`` targets (``used`` marks their labels) or the 1-D concatenation. A few small
    ops on the targets' device; lengths torch itself rejects are left to its error, on the
    failure path (:func:`_ctc_lengths_valid`)."""
    if used is not None:
        repeats = ((t[:, 1:] == t[:, :-1]) & used[:, 1:]).sum(1)  # pairs (j - 1, j), j < L
    else:
        last = t.numel() - 1
        # upto[k]: repeats among the pairs (j - 1, j) with j <= k, over the concatenation
        upto = torch.cat([t.new_zeros(1), (t[1:] == t[:-1]).cumsum(0)])
        ends = tlens.cumsum(0)
        starts = (ends - tlens).clamp(0, last)
        # the pairs inside sample i: j in (start, end); clamped lengths are torch's error
        # (and a sample of length 0 needs nothing whatever this says)
        repeats = upto[(ends - 1).clamp(0, last)] - upto[starts]
    need = tlens + repeats
    return need > ilens, need, repeats


def _ctc_lengths_valid(
    x: torch.Tensor, t: torch.Tensor, tlens: list[int], ilens: list[int]
) -> bool:
    """Whether torch would compute the loss with these lengths at all (else its own error
    says what is wrong, and comes first)."""
    frames = x.shape[0]
    if any(n < 0 for n in tlens) or any(not 0 <= n <= frames for n in ilens):
        return False
    if t.dim() == 2:
        return max(tlens) <= t.shape[1]
    return sum(tlens) == t.numel()


def _ctc_probabilities(p: _Probe, v: dict[str, float]) -> None:
    """CTC takes log-probabilities (never above 0): an input in [0, 1] is read further, its
    rows' sums over the classes (the last dim), so the note's ``probability_rows`` says
    whether it holds probabilities (a softmax where a log_softmax belongs: the loss is
    finite, often negative, and meaningless). Torch accepts it: the note carries the
    evidence and ``probabilities_fix`` for a rule to warn on, as NW205 does for NLLLoss and
    KLDivLoss fed probabilities. A second read only when the first shows it could be."""
    x = p.input
    lo, hi = v.get("input_min", math.nan), v.get("input_max", math.nan)
    if not (lo >= 0.0 and hi <= 1.0 and hi > 0.0) or not x.is_floating_point() or x.dim() < 1:
        return
    acc = torch.float32 if x.element_size() < 4 else None
    smin, smax = aminmax(x.sum(dim=-1, dtype=acc))
    p.add("row_sum_min", smin)
    p.add("row_sum_max", smax)
    inp = p.arg(p.spec.input)
    p.data["probabilities_fix"] = (
        f"{inp} = {_functional_alias(p.frame)}.log_softmax(logits, dim=-1)  # was a softmax: "
        f"{p.desc()} takes log-probabilities"
    )


def _ctc_blank_failure(p: _Probe, blank: int, c: int) -> None:
    """CTCLoss with a blank index outside the log-probs' ``c`` classes (``blank=len(vocab)``
    with a head of ``len(vocab)`` outputs): torch refuses it ('blank must be in label
    range'); said here with the numbers and the two ways out."""
    if blank >= c:
        fix = (
            f"# the blank needs an output of its own: give the model {blank + 1} outputs "
            f"(the last layer's {c} -> {blank + 1}), class {blank} the blank; or the blank=0 "
            f"convention, labels shifted to 1..{c} (targets + 1) and {c + 1} outputs:\n"
            + _option_fix(p, "blank", 0)
        )
        why = f"blank={blank} names class {blank}, and the model has only {c} (0..{c - 1})"
    else:
        fix = _option_fix(p, "blank", c - 1) + f"  # the last of the {c} classes"
        why = f"blank={blank} is negative: CTC does not count it from the end"
    p.fail(
        _Failure(
            code="NW501",
            check="ctc-blank-range",
            problem=(
                f"blank index {blank} is outside the {c} classes of the log-probs (their last "
                f"dim); {p.desc(blank=blank)} needs 0 <= blank < {c}: {why}"
            ),
            expected=f"blank in 0..{c - 1}",
            fix=fix,
            explanation=(
                "CTC reads the blank's log-probability at every frame, so the blank is one of "
                "the model's outputs: with len(vocab) labels the head needs len(vocab) + 1 "
                "outputs. PyTorch refuses a blank outside them ('blank must be in label "
                "range')."
            ),
            values=(blank,),
            counts=(1,),
            count=1,
            total=1,
        )
    )


def _ctc_batch_first(p: _Probe, x: torch.Tensor, t: torch.Tensor) -> None:
    """CTC log-probs given batch-first, (N, T, C) where CTCLoss takes (T, N, C): the
    input_lengths (and padded targets, when 2-D) count dim 0 as the batch, dim 1 is not
    that size. Torch refuses it ('input_lengths must be of size batch_size'); said here
    with the shapes and the transpose. Host-side: shapes and lengths' sizes only."""
    if x.dim() != 3 or x.shape[0] == x.shape[1]:
        return
    il = p.bound.get("input_lengths")
    k = (
        il.numel()
        if isinstance(il, torch.Tensor)
        else len(il)
        if isinstance(il, (list, tuple))
        else -1
    )
    rows = t.shape[0] if t.dim() == 2 else None
    if k != x.shape[0] or rows not in (None, x.shape[0]):
        return
    n, frames, c = x.shape
    inp = p.arg(p.spec.input)
    also = f" and the targets {rows} rows" if rows is not None else ""
    p.fail(
        _Failure(
            code="NW520",
            check="ctc-layout",
            problem=(
                f"log_probs has shape {tuple(x.shape)}, which {p.desc()} reads as (T, N, C) ="
                f" ({n} frames, {frames} samples, {c} classes), but input_lengths has {k} "
                f"entries{also}: it is batch-first, (N, T, C) = ({n} samples, {frames} "
                f"frames, {c} classes)"
            ),
            expected="(T, N, C)",
            fix=p.call_with(**{p.spec.input: f"{_paren(inp)}.transpose(0, 1)"})
            + "  # (N, T, C) -> (T, N, C)",
            explanation=(
                "CTCLoss takes log-probabilities time first, (T, N, C). A batch-first "
                "tensor (an RNN built with batch_first=True, a transformer's (N, T, C) "
                "output) puts the samples where the frames belong: torch refuses it when "
                "the sizes differ, and aligns along the wrong axis without an error when "
                "they happen to match."
            ),
            values=(tuple(x.shape),),
            counts=(1,),
            count=1,
            total=1,
        )
    )


def _check_ctc(p: _Probe) -> None:
    x, t = p.input, p.target
    if x.dim() > 0:
        blank_opt = p.bound.get("blank", 0)
        if isinstance(blank_opt, int) and not 0 <= blank_opt < x.shape[-1]:
            _ctc_blank_failure(p, int(blank_opt), int(x.shape[-1]))
    _input_stats(p)
    p.then(lambda v: _ctc_probabilities(p, v))
    if t is None or x.dim() == 0 or not _readable(t):
        return
    _ctc_batch_first(p, x, t)
    c = x.shape[-1]
    blank = int(p.bound.get("blank", 0))
    unbatched = x.dim() == 2  # (T, C) log-probs with one target (S,) of exactly S labels
    n = 1 if unbatched else x.shape[1] if x.dim() == 3 else 0
    # (N, S) padded targets, or 1-D: the concatenation (an unbatched target: one sample)
    layout_ok = n > 0 and ((t.dim() == 2 and t.shape[0] == n) or t.dim() == 1)
    used: torch.Tensor | None = None
    tlens = _ctc_lengths(p.bound.get("target_lengths"), n, t.device) if layout_ok else None
    if tlens is not None and t.dim() == 2:
        used = torch.arange(t.shape[1], device=t.device) < tlens[:, None]
    # a target longer than its input has no alignment: +inf, unless zero_infinity drops it
    # (a loss of 0 and no gradient for that sample: counted for the note, NW207)
    short: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    ilens: torch.Tensor | None = None
    dropping = bool(p.bound.get("zero_infinity", False))
    if tlens is not None:
        ilens = _ctc_lengths(p.bound.get("input_lengths"), n, t.device)
        if ilens is not None:
            short = _ctc_short(t, tlens, ilens, used)
            p.count("ctc_short", short[0])
    out = (t < 0) | (t >= c)
    blanks = t == blank
    if used is not None:
        out = out & used
        blanks = blanks & used
    p.count("bad", out)
    p.count("blanks", blanks)
    if used is not None:
        p.count("labels", used)

    def result(v: dict[str, float]) -> None:
        total = int(v.get("labels", t.numel()))
        labels = f"{blank + 1}..{c - 1}" if blank == 0 else f"0..{c - 1} except {blank}"
        desc = p.desc(blank=blank)
        if v["bad"]:
            values, counts = _value_counts(t[out])
            p.fail(
                _Failure(
                    code="NW501",
                    check="target-range",
                    problem=(
                        f"targets contain {_describe_values(values, counts)} (of {_n(total)} "
                        f"labels); {desc} with {c} classes accepts {labels}"
                    ),
                    expected=labels,
                    fix=f"give the model {int(max(values)) + 1} outputs, or remap the labels",
                    explanation=(
                        "CTC indexes the log-probabilities with each label: one outside [0, C) "
                        "reads past them (a GPU assert; silent garbage on the CPU)."
                    ),
                    values=values,
                    counts=counts,
                    count=int(v["bad"]),
                    total=total,
                    positions=_positions(out),
                )
            )
        if v["blanks"]:
            p.fail(
                _Failure(
                    code="NW512",
                    check="ctc-blank",
                    problem=(
                        f"targets contain the blank index {blank} at "
                        f"{_many(v['blanks'], 'position')} (of {_n(total)} labels); {desc} "
                        f"reserves {blank} for 'no label', so targets take {labels}"
                    ),
                    expected=labels,
                    fix=(
                        f"shift the labels to {labels} (e.g. target + 1 for 0-based labels), or "
                        "set blank= to an index no label uses"
                    ),
                    explanation=(
                        "CTC treats the blank as the separator between labels: a blank inside "
                        "a target makes the alignment impossible or meaningless."
                    ),
                    values=(blank,),
                    counts=(int(v["blanks"]),),
                    count=int(v["blanks"]),
                    total=total,
                    positions=_positions(blanks),
                )
            )
        if dropping and short is not None and v["ctc_short"]:
            p.data["ctc_dropped"] = int(v["ctc_short"])
            p.data["ctc_samples"] = n
        elif short is not None and tlens is not None and ilens is not None and v["ctc_short"]:
            n_short = int(v["ctc_short"])
            _ctc_short_failure(p, n_short, short, tlens=tlens, ilens=ilens, unbatched=unbatched)

    p.then(result)


def _running_call(f: types.FrameType) -> ast.Call | None:
    """The call frame ``f`` is making now, parsed from its source (a call written over
    several lines too), from the code's positions (Python 3.11+); None when unknown."""
    positions = getattr(f.f_code, "co_positions", None)
    if positions is None or f.f_lasti < 0:
        return None
    pos = next(itertools.islice(positions(), f.f_lasti // 2, None), None)
    if pos is None or any(x is None for x in pos):
        return None
    start, end, col, end_col = pos
    name = f.f_code.co_filename
    raw = [linecache.getline(name, i).encode() for i in range(start, end + 1)]
    if not raw or not raw[-1]:
        return None
    raw[-1] = raw[-1][:end_col]
    raw[0] = raw[0][col:]
    try:
        node = ast.parse(b"".join(raw).decode(), mode="eval").body
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None
    return node if isinstance(node, ast.Call) else None


def _argument(call: ast.Call, name: str, params: Sequence[str]) -> ast.expr | None:
    """The expression ``call`` passes for parameter ``name`` (by keyword, else by position
    in ``params``)."""
    for k in call.keywords:
        if k.arg == name:
            return k.value
    if name in params and not any(isinstance(a, ast.Starred) for a in call.args):
        i = list(params).index(name)
        if i < len(call.args):
            return call.args[i]
    return None


def _library_option(p: _Probe, name: str, value: Any) -> str | None:
    """For a guarded call a library made, the setting of the user's object the library
    reads option ``name`` from: the call's source passes ``zero_infinity=zero_infinity``,
    its caller ``zero_infinity=self.config.ctc_zero_infinity``, so ``model.config.
    ctc_zero_infinity = True``. Followed through the library's frames while the expression
    is a parameter of the function that made the call; None when it ends elsewhere (a
    literal, an expression that is no attribute of an object)."""
    f, params, wanted = p.site, p.spec.params, name
    for _ in range(8):
        if f is None or f is p.frame:
            return None
        call = _running_call(f)
        expr = _argument(call, wanted, params) if call is not None else None
        if expr is None:
            return None
        if isinstance(expr, ast.Name):
            code = f.f_code
            n_params = code.co_argcount + code.co_kwonlyargcount
            if expr.id not in code.co_varnames[:n_params]:
                return None
            # a parameter of the library function: what its caller passed
            params, wanted = code.co_varnames[:n_params], expr.id
            f = _call_site(f.f_back)
            continue
        chain: list[str] = []
        node: ast.expr = expr
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if not chain or not isinstance(node, ast.Name) or node.id not in f.f_locals:
            return None
        from nanwatch.watcher import _name_in_frame

        owner = f.f_locals[node.id]
        who = _name_in_frame(p.frame, owner) or f"<the {type(owner).__name__}>"
        return f"{who}.{'.'.join(reversed(chain))} = {value!r}"
    return None


def _ctc_short_failure(
    p: _Probe,
    count: int,
    short: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    tlens: torch.Tensor,
    ilens: torch.Tensor,
    unbatched: bool,
) -> None:
    """Name the first samples whose target needs more frames than their input has (the
    failure path: a second read is fine)."""
    mask, need, repeats = short
    t = p.target
    assert t is not None
    if not _ctc_lengths_valid(p.input, t, tlens.tolist(), ilens.tolist()):
        return
    idx = [int(i) for i in mask.nonzero()[:_POSITIONS, 0].tolist()]
    sel = torch.tensor(idx, device=mask.device)
    needs, labels, reps, frames = (a[sel].tolist() for a in (need, tlens, repeats, ilens))
    parts = []
    for i, nd, lab, rep, fr in zip(idx, needs, labels, reps, frames, strict=True):
        who = "the target" if unbatched else f"sample {i}"
        lengths = "input_lengths" if unbatched else f"input_lengths[{i}]"
        what = _many(lab, "label") + (f" with {_many(rep, 'repeat')}" if rep else "")
        verb = "needs" if lab == 1 and not rep else "need"
        parts.append(f"{who}: {what} {verb} at least {_many(nd, 'frame')}, {lengths} = {_num(fr)}")
    n = mask.numel()
    if count > len(idx):
        parts.append(f"{_n(count - len(idx))} more")
    reduction = p.bound.get("reduction", "mean")
    whole = (
        f", so the {reduction} over the batch is +inf too"
        if reduction in ("mean", "sum") and not unbatched
        else ""
    )
    one = count == 1
    problem = (
        f"{_many(count, 'target')} of {_n(n)} {'is' if one else 'are'} longer than "
        f"{'its' if one else 'their'} input can align ({'; '.join(parts)}); "
        f"{p.desc(zero_infinity=False)} gives {'it' if one else 'them'} a loss of +inf{whole}"
    )
    drops = (
        "drops them; or filter out utterances whose labels are too long for their audio (or "
        "lower the time downsampling)"
    )
    setting = _library_option(p, "zero_infinity", True) if _in_library(p) else None
    if setting is not None and p.site is not None:
        fix = (
            f"{setting}  # {p.spec.call} in {_site_name(p.site)} takes zero_infinity from "
            f"it: {drops}"
        )
    else:
        fix = f"{_option_fix(p, 'zero_infinity', True)}  # {drops}"
    p.fail(
        _Failure(
            code="NW516",
            check="ctc-length",
            problem=problem,
            expected="input_lengths[i] >= target_lengths[i] + the repeated labels in target i",
            fix=fix,
            explanation=(
                "CTC aligns every label to at least one input frame, and two equal labels in "
                "a row need a blank frame between them: a target that needs more frames than "
                "its input has no alignment, so its loss is +inf and its gradient NaN. "
                "zero_infinity=True zeroes those losses and their gradients."
                + (
                    " With reduction='none', dropping the +inf losses afterwards "
                    "(loss[torch.isfinite(loss)]) does not help: CTC's backward still writes "
                    "NaN into those samples' gradients, even when their loss gets a gradient "
                    "of 0."
                    if reduction == "none"
                    else ""
                )
            ),
            values=tuple(needs),
            counts=(),
            count=count,
            total=n,
            positions=tuple((i,) for i in idx),
        )
    )


# -- BCE -------------------------------------------------------------------------------
def _check_binary(p: _Probe) -> None:
    x, t, name = p.input, p.target, p.spec.name
    if t is None:
        _input_stats(p)
        return
    if t.shape != x.shape:
        inp, tgt = p.arg("input"), p.arg("target")
        if x.dim() == t.dim() + 1 and x.shape[-1] == 1 and x.shape[:-1] == t.shape:
            fix = p.call_with(input=f"{_paren(inp)}.squeeze(-1)")
        elif t.dim() == x.dim() + 1 and t.shape[-1] == 1 and t.shape[:-1] == x.shape:
            fix = p.call_with(target=f"{_paren(tgt)}.squeeze(-1)")
        elif t.numel() == x.numel():
            fix = p.call_with(target=f"{_paren(tgt)}.view_as({inp})")
        else:
            fix = f"make {inp} and {tgt} the same shape"
        hint = ""
        if (indices := _class_indices_fix(p, x, t)) is not None:
            hint, fix = indices
        p.fail(
            _Failure(
                code="NW507",
                check="shape",
                problem=(
                    f"input {_shape(x)} and target {_shape(t)} differ; {p.desc()} needs equal "
                    f"shapes{hint}"
                ),
                expected=f"target of shape {_shape(x)}",
                fix=fix,
                explanation="Binary cross-entropy pairs each prediction with its own label.",
                values=(tuple(t.shape),),
            )
        )
    _check_target_dtype(p)
    bce = name == "binary_cross_entropy"
    if _readable(x) and x.is_floating_point():
        p.add_minmax("input", x)
        if bce:
            outside = x.clamp(0, 1) != x  # NaN included
            p.count("input_outside", outside)
            p.count("exact_zeros", x == 0)
            p.count("exact_ones", x == 1)
            if _readable(t) and t.is_floating_point() and t.shape == x.shape:
                # log(x) or log(1 - x) at PyTorch's -100 clamp, with a nonzero weight
                clamped = ((x <= _BCE_LOG_FLOOR) & (t > 0)) | ((x >= 1) & (t < 1))
                p.count("value_clamped", clamped)

            def input_result(v: dict[str, float]) -> None:
                for k in ("exact_zeros", "exact_ones", "value_clamped"):
                    if k in v:
                        p.data[k] = int(v[k])
                n_out = int(v["input_outside"])
                if n_out:
                    _bce_input_failure(p, v, n_out, outside)

            p.then(input_result)
    if _readable(t) and t.dtype is not torch.bool:
        _target_stats(p)
        p.on_any(
            "target_outside",
            t.clamp(0, 1) != t,
            lambda v, n, mask: _binary_target_failure(p, v, n, mask),
        )


def _class_indices_fix(p: _Probe, x: torch.Tensor, t: torch.Tensor) -> tuple[str, str] | None:
    """NW507's hint and fix for a target of one value per row against an input of C > 1
    columns, each value a whole number in ``[0, C)``: class indices (one class per row)
    given to a multi-label loss. A Hugging Face classifier does this itself when its
    labels are float: it sets ``config.problem_type = "multi_label_classification"`` from
    the first batch's dtype (and keeps it). One read, on this failure path only."""
    if not (
        x.dim() == t.dim() + 1
        and x.shape[:-1] == t.shape
        and x.shape[-1] > 1
        and t.numel() > 0
        and _readable(t)
    ):
        return None
    c = int(x.shape[-1])
    v = t.double()
    if not bool(((v == v.round()) & (v >= 0) & (v < c)).all()):
        return None
    hint = (
        f" — the target holds one class index per row (whole numbers in 0..{c - 1}) for the "
        f"{c} columns: one class per row needs int64 class indices and cross-entropy, not a "
        "multi-label loss"
    )
    problem_types = {getattr(getattr(r, "config", None), "problem_type", None) for r in p.roots}
    tgt = _held_as(p.frame, t) or p.arg("target")
    if "multi_label_classification" in problem_types and _in_library(p):
        return hint + f" ({tgt} is {dtype_name(t.dtype)})", (
            f"{tgt} = {_paren(tgt)}.long()   # int64 class indices: the model then uses "
            "CrossEntropyLoss\n"
            "model.config.problem_type = None   # transformers set it to "
            "'multi_label_classification' from the float labels of the first batch"
        )
    inp = p.arg("input")
    return hint, (
        f"F.cross_entropy({inp}, {_paren(tgt)}.long())   # one class per row\n"
        f"# or one-hot targets for a multi-label loss: F.one_hot({_paren(tgt)}.long(), {c}).float()"
    )


def _bce_input_failure(p: _Probe, v: dict[str, float], outside: int, mask: torch.Tensor) -> None:
    x = p.input
    nan = int(x.isnan().sum())  # failure path: a second read is fine
    if nan == outside:
        problem = (
            f"input contains NaN at {_many(nan, 'position')} (of {_n(x.numel())}); {p.desc()} "
            "needs values in [0, 1]"
        )
        fix = "find where the NaN is born: print(nw.report) names the first module and op"
        explanation = (
            "The NaN came from earlier in the model. On a GPU, BCELoss asserts on it and the "
            "CUDA context dies before anything can be inspected; stopping here keeps it alive."
        )
    else:
        extra = f", {_n(nan)} of them NaN" if nan else ""
        problem = (
            f"input has {_many(outside, 'value')} outside [0, 1] (of {_n(x.numel())}; min "
            f"{_num(v['input_min'])}, max {_num(v['input_max'])}{extra}); {p.desc()} takes "
            "probabilities — these look like logits: use BCEWithLogitsLoss on them"
        )
        if p.is_module:
            made = p.construct().replace(f"nn.{p.cls_name}(", "nn.BCEWithLogitsLoss(", 1)
            fix = f"{made}  # and give it the logits, before any sigmoid"
        else:
            fix = p.call_with().replace(f"{p.callee}(", "F.binary_cross_entropy_with_logits(", 1)
            fix += "  # on the logits, before any sigmoid"
        explanation = (
            "BCELoss takes log(x) and log(1 - x): outside [0, 1] they are NaN, and the GPU "
            "kernel asserts. BCEWithLogitsLoss takes logits and is numerically stable."
        )
    p.fail(
        _Failure(
            code="NW504",
            check="input-range",
            problem=problem,
            expected="probabilities in [0, 1]",
            fix=fix,
            explanation=explanation,
            values=(v["input_min"], v["input_max"]),
            count=outside,
            total=x.numel(),
            positions=_positions(mask),
        )
    )


def _binary_target_failure(
    p: _Probe, v: dict[str, float], outside: int, mask: torch.Tensor
) -> None:
    t = p.target
    assert t is not None
    bad = mask & ~t.isfinite()  # the failure path: a second read is fine
    if bool(bad.any()):
        _binary_target_nonfinite(p, bad)
    tmin, tmax = v.get("target_min", math.nan), v.get("target_max", math.nan)
    tgt = p.arg("target")
    hint, fix = "", f"scale {tgt} into [0, 1]"
    if tmin >= 0 and tmax == 255 and bool(((t == 0) | (t == 255)).all()):
        hint, fix = " — a 0/255 mask", p.call_with(target=f"{tgt} / 255")
    elif (tmin >= 0 and tmax == 255) or (tmin == -1 and tmax == 1 and bool((t == 0).any())):
        # 0/1 labels with a marker for the ones to ignore: 255 (segmentation masks) or -1
        # (anchor labels: 1 object, 0 background, -1 ignored); (t + 1) / 2 would make the
        # ignored ones background and the background 0.5
        marker = 255 if tmax == 255 else -1
        inp = p.arg("input")
        keep = f"({tgt} != {marker})"
        fn = (
            "binary_cross_entropy"
            if p.spec.name == "binary_cross_entropy"
            else ("binary_cross_entropy_with_logits")
        )
        hint = f" — {marker} among 0/1 labels: an 'ignore' marker, which BCE has no ignore for"
        fix = (
            f"per = F.{fn}({inp}, {_paren(tgt)}.clamp(0, 1), "
            f"reduction='none')\nloss = (per * {keep}).sum() / {keep}.sum().clamp_min(1)"
        )
    elif tmin == -1 and tmax == 1:
        hint, fix = " — labels of -1 and 1", p.call_with(target=f"({tgt} + 1) / 2")
    elif tmin >= 0 and tmax == int(tmax) and tmax > 1:
        hint = " — class indices, not binary labels"
        fix = f"use nn.CrossEntropyLoss for {int(tmax) + 1} classes, or one-hot the labels"
    values, counts = _value_counts(t[mask])
    p.fail(
        _Failure(
            code="NW505",
            check="target-range",
            problem=(
                f"target has {_many(outside, 'value')} outside [0, 1] (of {_n(t.numel())}; "
                f"{_describe_values(values, counts)}){hint}; {p.desc()} needs targets in [0, 1]"
            ),
            expected="targets in [0, 1]",
            fix=fix,
            explanation=(
                "Binary cross-entropy weighs log(p) by the target and log(1 - p) by 1 - target: "
                "a target outside [0, 1] makes the loss unbounded below."
            ),
            values=values,
            counts=counts,
            count=outside,
            total=t.numel(),
            positions=_positions(mask),
        )
    )


def _made_at(p: _Probe, name: str) -> tuple[int, str] | None:
    """The line (number, text) of the user's function that last assigned ``name`` before
    the guarded call, looked for up to 40 lines back; None when none is found."""
    f = p.frame
    if f is None or not name.isidentifier():
        return None
    first = max(f.f_code.co_firstlineno, f.f_lineno - 40)
    for lineno in range(f.f_lineno - 1, first - 1, -1):
        line = _without_comment(linecache.getline(f.f_code.co_filename, lineno).strip())
        try:
            tree = ast.parse(line)
        except SyntaxError:
            continue
        for stmt in tree.body:
            targets = (
                stmt.targets
                if isinstance(stmt, ast.Assign)
                else [stmt.target]
                if isinstance(stmt, (ast.AugAssign, ast.AnnAssign))
                else []
            )
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            if name in names:
                return lineno, line
    return None


def _binary_target_nonfinite(p: _Probe, bad: torch.Tensor) -> None:
    """A BCE target holding NaN or inf: bad data (a 0/0 where the target is computed), not
    a target on the wrong scale. BCELoss rejects it (as outside [0, 1]); BCEWithLogitsLoss
    computes a NaN loss without a word, so the guard follows on_anomaly for it."""
    t = p.target
    assert t is not None
    n_nan = int(t.isnan().sum())
    n_inf = int(bad.sum()) - n_nan
    kinds = " and ".join(
        f"{k} at {_many(n, 'position')}" for k, n in (("NaN", n_nan), ("inf", n_inf)) if n
    )
    values, counts = _value_counts(t[bad])
    tgt, inp = p.arg("target"), p.arg("input")
    logits = p.spec.name != "binary_cross_entropy"
    made = _made_at(p, tgt)
    where = ""
    if made is not None and p.frame is not None:
        file = os.path.basename(p.frame.f_code.co_filename)
        where = f"; {tgt} is made at {file}:{made[0]}: {made[1]}"
    cause = (
        "NaN is what 0/0 gives (a ratio of two zero sizes, such as min / max over a zero-width box)"
    )
    if n_inf:
        cause = "NaN is what 0/0 gives, inf what x/0 gives (a ratio with a zero size)"
    if logits:
        law = (
            f"{p.desc()} does not check its targets (its documentation asks for values in "
            "[0, 1]): it computes the loss, NaN, and every gradient of the step with it"
        )
    else:
        law = f"{p.desc()} rejects it (all elements of target should be between 0 and 1)"
    simple = _NAME_EXPR.fullmatch(tgt) is not None and not p.is_module
    if simple and not p.has_arg("weight") and not p.has_arg("pos_weight"):
        fix = f"valid = torch.isfinite({tgt})   # or repair {tgt} where it is made\n" + p.call_with(
            input=f"{_paren(inp)}[valid]", target=f"{tgt}[valid]"
        )
    else:
        fix = (
            f"assert torch.isfinite({tgt}).all()   # where {tgt} is made: drop or repair "
            "the entries that divide by zero"
        )
    p.fail(
        _Failure(
            code="NW505",
            check="target-nonfinite",
            problem=(
                f"target holds {kinds} (of {_n(t.numel())}){where}; bad data, not a scale: "
                f"{p.desc()} needs finite targets in [0, 1]"
            ),
            expected="finite targets in [0, 1]",
            fix=fix,
            explanation=(
                f"The target was {'non-finite' if n_inf else 'NaN'} before the loss saw it: "
                f"{cause}. {law}. Rescaling does not help: find the entries where the target "
                "is made, and drop or repair them."
            ),
            values=values,
            counts=counts,
            count=int(bad.sum()),
            total=t.numel(),
            positions=_positions(bad),
            torch_runs=logits,
        )
    )


# -- regression, sign, embedding ----------------------------------------------------------
def _check_regression(p: _Probe) -> None:
    _check_broadcast(p)
    _check_target_dtype(p)
    _input_stats(p)
    _target_stats(p)
    t = p.target
    if (
        p.spec.name == "kl_div"
        and not p.bound.get("log_target", False)
        and _readable(t)
        and t is not None
        and t.is_floating_point()
    ):
        p.on_any("target_negative", t < 0, lambda v, n, mask: _kl_failure(p, v, n, mask))
        p.then(lambda v: _kl_probabilities_input(p, v))
    elif (
        p.spec.name == "kl_div"
        and p.bound.get("log_target", False) is True
        and _readable(t)
        and t is not None
        and t.is_floating_point()
    ):
        p.on_any("target_neginf", t == -math.inf, lambda v, n, mask: _kl_log0(p, n, mask))
        p.data["log_target"] = True
        p.then(lambda v: _kl_probability_log_target(p, v))


def _kl_probabilities_input(p: _Probe, v: dict[str, float]) -> None:
    """An input with values above 0 and none below: probabilities where log-probabilities
    belong. Torch accepts it (NW205 warns): the note carries ``probabilities_fix``, the
    user's call with the input as log-probabilities (``F.softmax`` -> ``F.log_softmax``)."""
    lo, hi = v.get("input_min", math.nan), v.get("input_max", math.nan)
    if not (lo >= 0 and hi > 0):
        return
    inp = p.arg("input")
    log_in = _renamed_call(inp, "softmax", "log_softmax") or f"{_paren(inp)}.log()"
    p.data["probabilities_fix"] = (
        p.call_with(input=log_in) + "  # the input as log-probabilities, the target unchanged"
    )


def _kl_probability_log_target(p: _Probe, v: dict[str, float]) -> None:
    """log_target=True and a target with values above 0 and none below: probabilities
    (a softmax), which log-probabilities never are. Not an error (the loss is a number):
    the note carries the fix, and NW205 warns."""
    lo, hi = v.get("target_min", math.nan), v.get("target_max", math.nan)
    if not (lo >= 0 and hi > 0):
        return
    tgt = p.arg("target")
    if p.is_module:
        fix = (
            p.construct(log_target=False)
            + "  # the target is probabilities\n"
            + f"# or keep log_target=True and pass log-probabilities as {tgt} "
            "(F.log_softmax, not F.softmax)"
        )
    else:
        fix = (
            (
                p.call_with(log_target="False")
                if p.has_arg("log_target")
                else p.call_with({"log_target": False})
            )
            + "  # the target is probabilities\n"
            + f"# or keep log_target=True and pass log-probabilities as {tgt} "
            "(F.log_softmax, not F.softmax)"
        )
    p.data["log_target_fix"] = fix


_SOFTMAX_FUNCS = ("F", "torch", "nn.functional", "torch.nn.functional")


def _softmax_log(node: ast.expr) -> tuple[ast.Call, ast.expr] | None:
    """``(softmax call, its input)`` when ``node`` is the log of a softmax:
    ``F.softmax(z, dim=1).log()``, ``torch.log(torch.softmax(z, 1))``, ``z.softmax(1).log()``."""
    inner: ast.expr | None = None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        f = node.func
        if f.attr == "log" and not node.args and not node.keywords:
            inner = f.value  # (...).log()
        elif (
            f.attr == "log"
            and ast.unparse(f.value) == "torch"
            and len(node.args) == 1
            and not node.keywords
        ):
            inner = node.args[0]  # torch.log(...)
    if not (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute)):
        return None
    if inner.func.attr != "softmax":
        return None
    if ast.unparse(inner.func.value) in _SOFTMAX_FUNCS:
        if not inner.args:
            return None
        return inner, inner.args[0]  # F.softmax(z, dim=1)
    return inner, inner.func.value  # z.softmax(1)


def _log_softmax_fix(p: _Probe) -> tuple[int, str, str] | None:
    """The line that made the log-target as the log of a softmax (``t = F.softmax(z / T,
    dim=1).log()``), rewritten as a log-softmax (``t = F.log_softmax(z.float() / T,
    dim=1)``, in float32 when the target is a narrower float): finite where the softmax
    underflowed to 0. (line number, the line, its rewrite); None when not found."""
    t = p.target
    made = _made_at(p, p.arg("target"))
    if made is None or t is None:
        return None
    lineno, line = made
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None
    widen = t.is_floating_point() and torch.finfo(t.dtype).bits < 32
    for node in ast.walk(tree):
        found = _softmax_log(node) if isinstance(node, ast.expr) else None
        if found is None or not isinstance(node, ast.expr):
            continue
        sm, z = found
        assert isinstance(sm.func, ast.Attribute)

        def seg(n: ast.AST) -> str:
            return ast.get_source_segment(line, n) or ast.unparse(n)

        arg = seg(z)
        if widen:  # the scores in float32, before a temperature divides them
            if isinstance(z, ast.BinOp) and isinstance(z.op, (ast.Div, ast.Mult)):
                tail = line[z.left.end_col_offset or 0 : z.end_col_offset]  # " / T"
                arg = f"{_paren(seg(z.left))}.float(){tail}"
            else:
                arg = f"{_paren(arg)}.float()"
        owner = seg(sm.func.value)
        rest = [seg(a) for a in sm.args[1:]] + [seg(k) for k in sm.keywords]
        if owner in _SOFTMAX_FUNCS:
            call = f"{owner}.log_softmax({', '.join([arg, *rest])})"
        else:
            call = f"{_paren(arg)}.log_softmax({', '.join(rest)})"
        start, end = node.col_offset, node.end_col_offset or node.col_offset
        return lineno, line, line[:start] + call + line[end:]
    return None


def _kl_log0(p: _Probe, n: int, mask: torch.Tensor) -> None:
    """A log-target of -inf (log of a zero probability) with log_target=True: KLDivLoss
    computes exp(t) * (t - input) = 0 * -inf = NaN there. The fix makes the target a
    log-softmax where it is the log of a softmax (the root cause: the softmax underflowed),
    else passes probabilities and says log_target=False, in the call and (for a module) in
    the constructor together."""
    t = p.target
    assert t is not None
    made = _log_softmax_fix(p)
    if made is not None and p.frame is not None:
        file = os.path.basename(p.frame.f_code.co_filename)
        fix = (
            f"{made[2]}  # in place of {file}:{made[0]}: the log of a softmax is -inf where the "
            "softmax underflows to 0, log_softmax is finite"
        )
    elif p.is_module:
        made_as = p.construct(log_target=False)
        if " = " not in made_as.split("(", 1)[0]:  # the user's name is not known
            made_as = f"{p.callee} = {made_as}"
        fix = (
            f"{made_as}  # {p.desc(log_target=False)} takes probabilities: a zero one "
            "contributes 0\n" + p.call_with(target=f"{_paren(p.arg('target'))}.exp()")
        )
    else:
        fix = (
            p.call_with(target=f"{_paren(p.arg('target'))}.exp()", log_target="False")
            if p.has_arg("log_target")
            else p.call_with({"log_target": False}, target=f"{_paren(p.arg('target'))}.exp()")
        ) + "  # probabilities: a zero contributes 0"
    p.fail(
        _Failure(
            code="NW511",
            check="log-target-neginf",
            problem=(
                f"target holds {_many(n, 'value')} of -inf (of {_n(t.numel())}: the log of a "
                f"zero probability); {p.desc(log_target=True)} computes exp(t) * (t - input) "
                "there, which is 0 * -inf = NaN"
            ),
            expected="finite log-probabilities, or probabilities with log_target=False",
            fix=fix,
            explanation=(
                "With log_target=False a zero target probability contributes 0 * log 0 = 0; "
                "with log_target=True its log, -inf, gives NaN."
            ),
            values=(-math.inf,),
            count=n,
            total=t.numel(),
            positions=_positions(mask),
        )
    )


def _node_name(t: torch.Tensor) -> str:
    """``SoftmaxBackward0``: the autograd node that made ``t`` (empty when none)."""
    return type(t.grad_fn).__name__ if t.grad_fn is not None else ""


def _probability_rows(x: torch.Tensor) -> bool:
    """``x`` holds probabilities: values in [0, 1] that sum to 1 along some dim (read only
    when a failure is worded)."""
    if x.dim() == 0 or x.numel() == 0 or not x.is_floating_point():
        return False
    with torch.no_grad():
        if not bool(((x >= 0) & (x <= 1)).all()):
            return False
        return any(
            bool(torch.allclose(x.sum(d, dtype=torch.float32), x.new_ones(()).float(), atol=1e-3))
            for d in range(x.dim())
            if x.shape[d] > 1
        )


def _renamed_call(expr: str, old: str, new: str) -> str | None:
    """``F.softmax(s / T, dim=1)`` -> ``F.log_softmax(s / T, dim=1)`` (``old`` -> ``new``,
    as a function or a method); None when ``expr`` is not such a call."""
    try:
        node = ast.parse(expr.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call):
        return None
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name != old:
        return None
    text = expr.strip()
    end = f.end_col_offset or 0
    return text[: end - len(old)] + new + text[end:]


def _kl_swapped(p: _Probe, v: dict[str, float]) -> bool:
    """F.kl_div(probabilities, log-probabilities): the input is a softmax (its node, or
    rows in [0, 1] summing to 1) and the target log-probabilities (LogSoftmaxBackward0, or
    every value <= 0)."""
    t = p.target
    if t is None:
        return False
    log_target = _node_name(t).startswith("LogSoftmaxBackward") or v.get("target_max", 1) <= 0
    if not log_target:
        return False
    return _node_name(p.input).startswith("SoftmaxBackward") or _probability_rows(p.input)


def _kl_swapped_failure(p: _Probe, v: dict[str, float], n: int, mask: torch.Tensor) -> None:
    t = p.target
    assert t is not None
    inp, tgt = p.arg("input"), p.arg("target")
    log_in = _renamed_call(inp, "softmax", "log_softmax") or f"{_paren(inp)}.log()"
    prob_t = _renamed_call(tgt, "log_softmax", "softmax") or f"{_paren(tgt)}.exp()"
    p.fail(
        _Failure(
            code="NW511",
            check="target-probabilities",
            problem=(
                f"input and target are swapped: the input is probabilities (a softmax) and the "
                f"target log-probabilities ({_many(n, 'negative value')} of {_n(t.numel())}, "
                f"max {_num(v['target_max'])}); {p.desc(log_target=False)} takes "
                "log-probabilities as input and probabilities as target"
            ),
            expected="input: log-probabilities; target: probabilities",
            fix=p.call_with(input=log_in, target=prob_t)
            + "  # input: log-probabilities, target: probabilities",
            explanation=(
                "KLDivLoss computes target * (log(target) - input): input must be "
                "log-probabilities (F.log_softmax) and target probabilities (F.softmax). "
                "Swapped, the log of a negative target is NaN."
            ),
            values=(v["target_min"],),
            count=n,
            total=t.numel(),
            positions=_positions(mask),
        )
    )


def _paren(expr: str) -> str:
    """``x`` -> ``x``; ``a * b`` -> ``(a * b)``: an expression safe to call a method on."""
    e = expr.strip()
    try:
        node = ast.parse(e, mode="eval").body
    except SyntaxError:
        return f"({e})"
    simple = (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant)
    return e if isinstance(node, simple) else f"({e})"


def _kl_failure(p: _Probe, v: dict[str, float], n: int, mask: torch.Tensor) -> None:
    t = p.target
    assert t is not None
    if _kl_swapped(p, v):
        _kl_swapped_failure(p, v, n, mask)
    p.fail(
        _Failure(
            code="NW511",
            check="target-probabilities",
            problem=(
                f"target has {_many(n, 'negative value')} (of {_n(t.numel())}; min "
                f"{_num(v['target_min'])}); {p.desc(log_target=False)} takes probabilities, and "
                "the log of a negative target is NaN"
            ),
            expected="probabilities (>= 0), or log-probabilities with log_target=True",
            fix=p.call_with(target=f"{p.arg('target')}.softmax(-1)")
            + "  # or pass log-probabilities with log_target=True",
            explanation="KLDivLoss computes target * log(target): negative targets give NaN.",
            values=(v["target_min"],),
            count=n,
            total=t.numel(),
            positions=_positions(mask),
        )
    )


#: losses whose 0 target contributes a constant with no gradient (max(0, -0 * d + margin),
#: cosine embedding's neither-case): a 0 beside 1 and -1 is a tie skipped on purpose
_TIES_SKIPPED = frozenset({"margin_ranking_loss", "cosine_embedding_loss"})


def _check_sign(p: _Probe) -> None:
    _check_broadcast(p)
    _input_stats(p)
    t = p.target
    if t is None or not _readable(t) or t.dtype is torch.bool:
        return
    _target_stats(p)
    bad = t.abs() != 1
    p.count("bad", bad)

    def result(v: dict[str, float]) -> None:
        n = int(v["bad"])
        if not n:
            return
        values, counts = _value_counts(t[bad])
        tgt = p.arg("target")
        if p.spec.name in _TIES_SKIPPED and set(values) == {0.0} and bool((t == -1).any()):
            # sign(a - b) of ranks: ties give 0, which these losses score as a constant with
            # no gradient, the usual way to skip tied pairs; the 1/-1 convention is in use
            return
        if bool(((t == 0) | (t == 1)).all()):  # failure path
            hint, fix = " — these are 0/1 labels", p.call_with(target=f"{tgt} * 2 - 1")
        else:
            hint, fix = "", f"map {tgt} to 1 (similar) and -1 (dissimilar)"
        p.fail(
            _Failure(
                code="NW510",
                check="target-sign",
                problem=(
                    f"target contains {_describe_values(values, counts)} (of {_n(t.numel())}); "
                    f"{p.desc()} takes targets of 1 and -1{hint}"
                ),
                expected="1 or -1",
                fix=fix,
                explanation=(
                    "Margin and embedding losses multiply by the target's sign: a 0 target "
                    "silently contributes a constant (no gradient), other values scale the loss."
                ),
                values=values,
                counts=counts,
                count=n,
                total=t.numel(),
                positions=_positions(bad),
            )
        )

    p.then(result)


def _check_plain(p: _Probe) -> None:
    _input_stats(p)


# -- weights -----------------------------------------------------------------------------
#: a loss's weight-like parameters: class weights (``weight`` of CrossEntropyLoss, NLLLoss,
#: MultiMarginLoss, MultiLabelSoftMarginLoss), BCE's per-label ``pos_weight`` and the
#: elementwise ``weight`` of BCELoss, MSELoss, ... (an embedding's ``weight`` is its table)
_WEIGHT_PARAMS = ("weight", "pos_weight")
#: weight tensors found clean: id -> (the tensor, weakly; its version counter), so a weight
#: that does not change (a loss module's buffer) is read once, not on every call
_CLEAN_WEIGHTS: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
_MAX_CLEAN_WEIGHTS = 256
_clean_lock = threading.Lock()


def _version(t: torch.Tensor) -> int | None:
    try:
        return int(t._version)
    except RuntimeError:  # an inference tensor has no version counter: read it every call
        return None


def _known_clean(t: torch.Tensor) -> bool:
    entry = _CLEAN_WEIGHTS.get(id(t))
    return entry is not None and entry[0]() is t and entry[1] == _version(t)


def _remember_clean(t: torch.Tensor) -> None:
    version = _version(t)
    if version is None:
        return
    with _clean_lock:
        if len(_CLEAN_WEIGHTS) >= _MAX_CLEAN_WEIGHTS:  # dead or stale entries: start over
            _CLEAN_WEIGHTS.clear()
        _CLEAN_WEIGHTS[id(t)] = (weakref.ref(t), version)


def _per_class_weight(p: _Probe, name: str) -> bool:
    """Whether parameter ``name`` weighs classes (or labels) rather than elements."""
    return name == "pos_weight" or p.spec.kind == "class" or p.spec.name.startswith("multilabel")


def _check_weights(p: _Probe) -> None:
    """A loss's weight or pos_weight holding inf or NaN (``n_neg / n_pos`` or ``1 / counts``
    with a class absent from the counts) makes the loss inf or NaN, at once or the first
    time that class is a target; a negative weight (every torch loss that takes one has
    terms >= 0) turns its class's or element's loss into a reward the optimizer maximizes.
    Counted in the guard's one read; a weight read clean is not read again until it
    changes."""
    if p.spec.kind == "index":
        return
    for name in _WEIGHT_PARAMS:
        w = p.bound.get(name)
        if not isinstance(w, torch.Tensor) or not _readable(w) or not w.is_floating_point():
            continue
        if _known_clean(w):
            continue
        # one pass: clamping moves a negative or +-inf weight, and NaN != NaN
        bad = w.clamp(0, torch.finfo(w.dtype).max) != w
        p.count(f"{name}_bad", bad)
        p.then(functools.partial(_weight_result, p, name, w, True))


def _weight_result(
    p: _Probe, name: str, w: torch.Tensor, negative: bool, v: dict[str, float]
) -> None:
    n = int(v[f"{name}_bad"])
    if n:
        _weight_failure(p, name, w, n, negative=negative)
    else:
        _remember_clean(w)


def _latent_classes(p: _Probe, name: str, w: torch.Tensor) -> list[int] | None:
    """The classes whose class weight is inf or NaN when none of them is a target of this
    batch (ignore_index respected), so the loss is still finite: only class-index targets
    without label smoothing pick a class's weight by its target alone. None otherwise."""
    t = p.target
    ls = p.bound.get("label_smoothing")
    if (
        name != "weight"
        or p.spec.kind != "class"
        or w.dim() != 1
        or t is None
        or t.is_floating_point()
        or t.is_complex()
        or not _readable(t)
        or (isinstance(ls, (int, float)) and ls != 0)
        or (isinstance(ls, torch.Tensor) and bool(ls.ne(0).any()))
    ):
        return None
    if bool((w < 0).any()):  # a negative weight is worded as such
        return None
    t = t.reshape(-1)
    if p.spec.semantics.ignore_index:
        ii = p.bound.get("ignore_index", -100)
        t = t[t != (-100 if ii is None else int(ii))]
    bad = (~torch.isfinite(w)).cpu()
    present = torch.zeros_like(bad)
    t = t.cpu().long()
    t = t[(t >= 0) & (t < w.numel())]
    if not t.numel():  # every target ignored: the loss is NaN (0 / 0) whatever the weight
        return None
    present[t] = True
    if bool((bad & present).any()):
        return None
    if _reduction(p.bound) == "mean" and not bool(w.cpu()[present].ne(0).any()):
        return None  # the weighted mean divides by the targets' weights, all 0: 0 / 0 = NaN
    return [int(k) for k in bad.nonzero().flatten().tolist()]


#: calls that a weight vector is normalised by (``w / w.sum()``, ``w / w.max()``)
_NORMALIZERS = ("sum", "mean", "max", "norm", "amax")


def _divided_by_own(divisor: ast.expr) -> str | None:
    """``w`` when ``divisor`` is a reduction of the name ``w`` (``w.sum()``,
    ``torch.sum(w)``, ``w.norm(p=1)``): what a normalisation divides by; else None."""
    for n in ast.walk(divisor):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        if isinstance(f, ast.Attribute) and f.attr in _NORMALIZERS:
            if isinstance(f.value, ast.Name):
                return f.value.id
            if n.args and isinstance(n.args[0], ast.Name):  # torch.sum(w)
                return n.args[0].id
    return None


def _normalised_at(p: _Probe, name: str) -> tuple[str, int, str] | None:
    """Where the user's code normalised the weight it gives the loss as ``name``
    (``w = w / w.sum() * C``): the name divided by its own sum, and that line's number and
    text. The weight is the loss module's constructor argument (``crit =
    nn.CrossEntropyLoss(weight=w)``, ``crit`` the name on the user's line) or the
    functional's argument (a name); the line is the last assignment to it before. Read from
    the file of the user's frame, only when a failure is worded; None when not found."""
    f = p.frame
    if f is None or p._call[0] is None:
        return None
    lines = linecache.getlines(f.f_code.co_filename)
    try:
        tree = ast.parse("".join(lines))
    except (SyntaxError, ValueError):
        return None
    var: str | None = None
    before = f.f_lineno
    if p.is_module and p.module is not None:
        callee = p._call[0]
        sig = _signature(type(p.module))
        params = list(sig.parameters) if sig is not None else []
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and any(ast.unparse(t) == callee for t in node.targets)
            ):
                continue
            call = node.value
            arg = next((k.value for k in call.keywords if k.arg == name), None)
            if arg is None and name in params and params.index(name) < len(call.args):
                arg = call.args[params.index(name)]
            if isinstance(arg, ast.Name):
                var, before = arg.id, node.lineno
    elif p.has_arg(name) and p.arg(name).isidentifier():
        var = p.arg(name)
    if var is None:
        return None
    last: ast.stmt | None = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        assigned = any(
            isinstance(n, ast.Name) and n.id == var for t in targets for n in ast.walk(t)
        )
        if assigned and node.lineno < before and (last is None or node.lineno > last.lineno):
            last = node
    summed: str | None = None
    if isinstance(last, ast.AugAssign) and isinstance(last.op, ast.Div):
        summed = _divided_by_own(last.value)
    elif isinstance(last, (ast.Assign, ast.AnnAssign)) and last.value is not None:
        for n in ast.walk(last.value):
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div):
                summed = summed or _divided_by_own(n.right)
    if last is None or summed is None or last.end_lineno != last.lineno:
        return None
    return summed, last.lineno, _without_comment(lines[last.lineno - 1].strip())


def _collapsed_weight_fix(p: _Probe, name: str) -> str:
    """The fix for weights normalised by a sum that held inf or NaN: give a class with no
    sample weight 0 before the normalisation, on the user's lines when they are found."""
    zero = ".nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)"
    found = _normalised_at(p, name)
    if found is not None and p.frame is not None:
        w, lineno, line = found
        file = os.path.basename(p.frame.f_code.co_filename)
        return (
            f"{w} = {w}{zero}  # insert before {file}:{lineno}: a class with no sample gets "
            f"weight 0, not inf\n{line}"
        )
    return (
        "# where the weights are made, before they are normalised (weights / weights.sum()):\n"
        f"weights = weights{zero}  # a class with no sample gets weight 0, not inf"
    )


def _weight_failure(p: _Probe, name: str, w: torch.Tensor, n: int, *, negative: bool) -> None:
    """Word a weight holding inf, NaN (or, per class, a negative value); the failure path,
    so a second read is fine."""
    nonfinite = ~torch.isfinite(w)
    mask = nonfinite | (w < 0) if negative else nonfinite
    values, counts = _value_counts(w[mask])
    n_nonfinite = int(nonfinite.sum())
    per_class = _per_class_weight(p, name) and w.dim() == 1
    where = p.desc()
    what = f"{p.cls_name}.{name}" if p.is_module else name
    positions = _positions(mask)
    if per_class:
        label = name == "pos_weight" or p.spec.kind == "binary"
        units = ("label", "labels") if label else ("class", "classes")
        shown = ", ".join(f"{name}[{q[0]}] = {_num(w[q[0]].item())}" for q in positions)
        more = f" and {_n(n - len(positions))} more" if n > len(positions) else ""
        found = f"{shown}{more} (of {_n(w.numel())} {units[w.numel() != 1]})"
    else:
        found = f"{_describe_values(values, counts)} (of {_n(w.numel())})"
    finite = w[~nonfinite]
    # normalised by a sum that held inf (w / w.sum() * C): inf / inf = NaN and every finite
    # weight x / inf = 0; by one that held NaN, every weight NaN
    collapsed = bool(n_nonfinite) and w.numel() > 1 and not bool(finite.ne(0).any())
    latent = _latent_classes(p, name, w) if n_nonfinite and not collapsed else None
    if collapsed:
        if finite.numel():
            how = (
                f"and every other weight is 0 ({_n(finite.numel())} of {_n(w.numel())}): "
                "normalised by a sum that holds inf (weights / weights.sum()), the inf weight "
                "became inf / inf = NaN and zeroed every finite one (x / inf = 0)"
            )
        else:
            how = (
                "and so is every other weight: normalised by a sum that holds NaN or inf "
                "(weights / weights.sum()), all of them are"
            )
        if p.spec.kind == "class" and name == "weight" and _reduction(p.bound) == "mean":
            then = (
                f"{where} divides by the targets' weights, all 0 or NaN: its loss is NaN "
                "(0 / 0) for every batch"
            )
        else:
            then = f"{where} gives a loss of 0 (no gradient) or NaN with them"
        problem = f"{what} holds {found} {how}; {then}"
    elif latent:
        classes = ", ".join(str(k) for k in latent[:_POSITIONS])
        classes += f" and {_n(len(latent) - _POSITIONS)} more" if len(latent) > _POSITIONS else ""
        problem = (
            f"{what} holds {found}: a weight computed from counts (n_neg / n_pos, 1 / counts) "
            "is inf where a class has no sample (x / 0) and NaN for 0 / 0; "
            f"the loss is finite here only because no target in this batch is "
            f"{'class' if len(latent) == 1 else 'one of classes'} {classes}; the first batch "
            "with one makes it inf or NaN"
        )
    elif n_nonfinite:
        problem = (
            f"{what} holds {found}: a weight computed from counts (n_neg / n_pos, 1 / counts) "
            "is inf where a class has no sample (x / 0) and NaN for 0 / 0; "
            f"{where} gives an inf or NaN loss with it"
        )
    else:
        unit = (
            "class" if per_class and p.spec.kind == "class" else "label" if per_class else "element"
        )
        problem = (
            f"{what} holds {found}: a negative weight rewards the loss of its {unit} instead "
            f"of penalizing it (the optimizer makes those predictions worse, and the loss "
            f"falls without bound); {where} needs weights >= 0"
        )
    repair = ".nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)" if n_nonfinite else ""
    if negative and bool((w.nan_to_num(neginf=0.0) < 0).any()):
        repair += ".clamp_min(0)"
    why = (
        "  # weight 0 for a class absent from the counts; or divide by the counts "
        "clamped with .clamp_min(1) where the weight is computed"
        if n_nonfinite
        else "  # or compute the weights so that none is negative"
    )
    if collapsed:
        # zeroing the non-finite weight here leaves all of them 0: the weights must be
        # repaired before they are normalised
        fix = _collapsed_weight_fix(p, name)
    elif p.is_module:
        callee = p.callee
        if not all(part.isidentifier() for part in callee.split(".")):
            callee = "criterion"  # a call expression: nothing to assign to
        fix = f"{callee}.{name} = {callee}.{name}{repair}{why}"
    elif p.has_arg(name):
        expr = p.arg(name)
        simple = all(part.isidentifier() for part in expr.split("."))
        wrapped = expr if simple else f"({expr})"
        fix = p.call_with(**{name: f"{wrapped}{repair}"}) + why
    else:
        fix = f"pass {name}={name}{repair}{why}"
    p.fail(
        _Failure(
            code="NW517",
            check="weight",
            problem=problem,
            expected="finite weights" + (", none negative" if negative else ""),
            fix=fix,
            explanation=(
                "A loss multiplies each term by its weight: an inf weight makes the term inf "
                "(NaN where it meets a zero, 0 * inf), a NaN weight makes it NaN, and the mean "
                "over the batch carries it into every gradient. PyTorch accepts such weights "
                "without a word; the NaN shows up inside the loss kernel."
                if n_nonfinite
                else "A loss multiplies each term, never negative, by its weight: a negative "
                "weight makes the term negative, so the optimizer lowers the loss by making "
                "that prediction worse, and the loss can fall toward -inf while the model "
                "degrades. PyTorch accepts such weights without a word."
            ),
            values=values,
            counts=counts,
            count=n,
            total=w.numel(),
            positions=positions,
        )
    )


# -- index ops: embeddings, one_hot ------------------------------------------------------
#: index dtypes the embedding kernels take (F.one_hot takes int64 only)
_INDEX_DTYPES = (torch.int64, torch.int32)
_OFFSETS_FIX = "offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])"


def _check_index(p: _Probe) -> None:
    """Indices into a table: an embedding's ids (``F.embedding``, ``F.embedding_bag``) must
    be int64/int32 in ``[0, rows)``, rows being the weight's first dimension (so subclasses
    and tied weights are read as they are); ``F.one_hot``'s values int64 in
    ``[0, num_classes)``; an EmbeddingBag's offsets integers that start at 0, never decrease
    and stay within the input. One ``aminmax`` of the ids (and the offsets' ends) is read."""
    name, ids = p.spec.name, p.input
    rows: int | None = None
    if name == "one_hot":
        nc = p.bound.get("num_classes", -1)
        if isinstance(nc, int) and not isinstance(nc, bool) and nc >= 0:
            rows = nc
        dtypes: tuple[torch.dtype, ...] = (torch.int64,)
    else:
        w = p.bound.get("weight")
        if (
            name == "embedding_bag"
            and isinstance(w, torch.Tensor)
            and ids.is_floating_point()
            and not w.is_floating_point()
        ):
            w, ids = ids, w  # embedding_bag(weight, input): the old order, which torch swaps
            p.input = ids
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[0] < 1:
            return  # torch's own error says what is wrong with the weight
        rows = int(w.shape[0])
        dtypes = _INDEX_DTYPES
    if ids.dtype not in dtypes:
        _index_dtype_failure(p, p.spec.input, ids, dtypes)
    used: torch.Tensor | None = None
    offsets = p.bound.get("offsets") if name == "embedding_bag" else None
    if isinstance(offsets, torch.Tensor) and ids.dim() == 1 and offsets.dim() == 1:
        if offsets.dtype not in _INDEX_DTYPES:
            _index_dtype_failure(p, "offsets", offsets, _INDEX_DTYPES)
        used = _check_offsets(p, ids, offsets)
    if not _readable(ids):
        return
    kept = ids if used is None else torch.where(used, ids, 0)
    lo, hi = aminmax(kept)
    p.add("index_min", lo)
    p.add("index_max", hi)
    p.then(lambda v: _index_result(p, v, rows=rows, used=used))


def _index_dtype_failure(
    p: _Probe, param: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]
) -> None:
    need = " or ".join(dtype_name(d) for d in dtypes)
    what = "class values" if p.spec.name == "one_hot" else "indices"
    p.fail(
        _Failure(
            code="NW514",
            check="index-dtype",
            problem=f"{param} is {dtype_name(t.dtype)}; {p.desc()} needs {need} {what}",
            expected=need,
            fix=p.call_with(**{param: f"{p.arg(param)}.long()"}),
            explanation=(
                "Lookups index a table with integers: PyTorch rejects other dtypes with a "
                "message about 'indices' that names neither the module nor the tensor."
            ),
            values=(dtype_name(t.dtype),),
        )
    )


def _check_offsets(p: _Probe, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor | None:
    """Queue the offsets' checks; returns the mask of the ids the bags use (those before
    the last offset under ``include_last_offset=True``; None: all of them)."""
    if offsets.device != ids.device or not _readable(offsets):
        return None  # torch's own error says the devices differ
    n = ids.shape[0]
    p.add("offsets_first", offsets[0])
    p.add("offsets_last", offsets[-1])
    down = offsets[1:] < offsets[:-1]
    p.count("offsets_decreasing", down)
    ilo = bool(p.bound.get("include_last_offset", False))

    def result(v: dict[str, float]) -> None:
        first, last = int(v["offsets_first"]), int(v["offsets_last"])
        n_down = int(v["offsets_decreasing"])
        off = p.arg("offsets")
        desc = p.desc(include_last_offset=True) if ilo else p.desc()
        rule = "bag i is input[offsets[i]:offsets[i + 1]]"
        values: tuple[int, ...]
        positions: tuple[tuple[int, ...], ...]
        if first != 0:
            problem = f"offsets[0] is {first}; {desc} needs offsets that start at 0 ({rule})"
            fix = _OFFSETS_FIX
            if last == n:
                problem += " — these look like the bags' ends (lengths.cumsum(0)), not their starts"
                o = _paren(off)
                fix = p.call_with(
                    offsets=f"torch.cat([{o}.new_zeros(1), {o}{'' if ilo else '[:-1]'}])"
                )
            values, positions, count = (first,), ((0,),), 1
        elif last > n:
            problem = (
                f"offsets[-1] is {last} but input has {_many(n, 'id')}; {desc} needs offsets "
                f"within the input ({rule})"
            )
            values, positions, count, fix = (last,), ((offsets.shape[0] - 1,),), 1, _OFFSETS_FIX
        elif n_down:
            values = tuple(int(x) for x in offsets[1:][down][:_VALUES].tolist())
            positions = tuple((q[0] + 1,) for q in _positions(down))
            problem = (
                f"offsets decrease at {_many(n_down, 'position')} (of {_n(offsets.numel())}); "
                f"{desc} needs non-decreasing offsets ({rule})"
            )
            count, fix = n_down, _OFFSETS_FIX
        else:
            return
        p.fail(
            _Failure(
                code="NW515",
                check="offsets",
                problem=problem,
                expected=f"offsets that start at 0, never decrease and end at most at {n}",
                fix=fix,
                explanation=(
                    "An EmbeddingBag reads bag i from input[offsets[i]:offsets[i + 1]]: other "
                    "offsets read outside the input (garbage or an assert on a GPU; on the "
                    "CPU an error that does not say which offset)."
                ),
                values=values,
                count=count,
                total=offsets.numel(),
                positions=positions,
            )
        )

    p.then(result)
    if ilo:
        return torch.arange(n, device=ids.device) < offsets[-1]
    return None


def _looks_like_positions(ids: torch.Tensor) -> bool:
    """Consecutive along the last dimension (``arange(L)``, perhaps shifted): position ids."""
    return ids.dim() >= 1 and ids.shape[-1] >= 2 and bool((ids.diff(dim=-1) == 1).all())


#: a table's name that says it holds positions (``position_embeddings``, ``embed_positions``,
#: ``pos_emb``, GPT-2's ``wpe``)
_POSITION_NAME = re.compile(r"position|(?:^|_)pos(?:_|$)|^wpe$", re.IGNORECASE)


def _position_table_of(p: _Probe, rows: int) -> str | None:
    """How the guarded embedding is known to be a position table: by the config setting
    that sized it (``config.n_positions=16``) or by its own name (``pos_emb``); None when
    neither says so. Read only when a failure is worded."""
    if not p.is_module or p.module is None:
        key = _position_key(p.roots, rows)
        return None if key is None else f"config.{key}={rows}"
    return position_table_name(p.roots, p.module, rows)


def position_table_name(roots: Sequence[nn.Module], module: nn.Module, rows: int) -> str | None:
    """How ``module``, a table of ``rows`` rows under ``roots``, is known to hold positions:
    the config setting that sized it (``config.n_positions=16``) or its own name
    (``pos_emb``); None when neither says so (the guard's NW513 and the post-mortem)."""
    key = _position_key(roots, rows)
    if key is not None:
        return f"config.{key}={rows}"
    for root in roots:
        for name, mod in root.named_modules():
            if mod is module and _POSITION_NAME.search(name.rsplit(".", 1)[-1]):
                return str(name)
    return None


def _negative_positions(p: _Probe, ids: torch.Tensor, table: str) -> tuple[str, str]:
    """NW513's hint and fix for negative ids into a position table: no row of it is
    negative. A negative prefix of each row is left padding given positions by
    ``attention_mask.cumsum(-1) - 1``, which is -1 at every pad."""
    var = _held_as(p.frame, p.input) or (None if _in_library(p) else p.arg(p.spec.input))
    return negative_position_words(ids, table, var)


def negative_position_words(ids: torch.Tensor, table: str, var: str | None) -> tuple[str, str]:
    """The hint and fix for negative ids ``var`` into a position table (how ``table`` is
    known to hold positions): the guard's NW513 and the post-mortem's advice."""
    bad = ids < 0
    flat = bad.reshape(-1, bad.shape[-1]) if bad.dim() else bad.reshape(1, 1)
    prefix = bool((flat[:, 1:] <= flat[:, :-1]).all()) and not bool(flat.all(-1).any())
    hint = f" — these are positions ({table}), and no position is negative"
    if prefix:
        hint += (
            ": the negative ones open their rows, before the first real token (left "
            "padding: attention_mask.cumsum(-1) - 1 is -1 at every pad)"
        )
    fix = (
        f"{var} = {var}.clamp(min=0)   # a pad's position: any row, its output is masked"
        if var is not None
        else "# clamp the positions at 0 where they are made: .clamp(min=0) (a pad's "
        "position can be any row, its output is masked)"
    )
    if prefix:
        fix += (
            "\n# or as transformers makes them: (attention_mask.long().cumsum(-1) - 1)"
            ".masked_fill(attention_mask == 0, 1)"
        )
    return hint, fix


def _offset_positions(p: _Probe, ids: torch.Tensor, rows: int, lo: int) -> tuple[str, str] | None:
    """NW513's hint and fix for consecutive positions into a position table that the
    input is short enough for but that start past its first row (and past a padding row
    below it): the caller's positions carry an offset (a cache's past length, positions
    that keep counting across packed sequences). None when the input itself is too long."""
    table = _position_table_of(p, rows)
    if table is None:
        return None
    var = _held_as(p.frame, p.input) or (None if _in_library(p) else p.arg(p.spec.input))
    start = position_start(p.roots, rows, lo, _padding_row(p, rows))
    return offset_position_words(ids, rows, start, table, var)


def position_start(roots: Sequence[nn.Module], rows: int, lo: int, pad: int | None) -> int:
    """The first position of a table of ``rows`` rows whose smallest id given is ``lo``:
    past rows that are not positions (as NW513's branch for inputs too long)."""
    if pad is not None and lo == pad + 1:
        return lo  # RoBERTa: positions start past its padding row
    if 0 < lo < rows and _config_key_in(roots, rows) is None and _position_key(roots, rows - lo):
        return lo  # BART: max_position_embeddings + 2 rows, positions from 2
    return 0


def offset_position_words(
    ids: torch.Tensor, rows: int, start: int, table: str, var: str | None
) -> tuple[str, str] | None:
    """The hint and fix for consecutive positions ``var`` that start past ``start`` in a
    table of ``rows`` rows the input is short enough for (the guard's NW513 and the
    post-mortem's advice); None when the input itself is too long."""
    length = int(ids.shape[-1])
    first = ids[..., 0]
    if length > rows - start or int(first.max()) <= start:
        return None
    hint = (
        f" — these are positions ({table}): this input has only {length} tokens, but its "
        f"positions start at {int(first.max())} in a row: they carry an offset (positions "
        "that keep counting across packed sequences, or a cache's past length)"
    )
    plus = f" + {start}" if start else ""
    fix = (
        f"{var} = {var} - {var}[..., :1]{plus}   # each sequence's positions from {start}"
        if var is not None
        else f"# start each sequence's positions at {start}: positions - positions[..., :1]{plus}"
    )
    fix += (
        f"\n# generating with a cache: stop at {rows - start} tokens in all (the prompt and "
        "the new ones)"
    )
    return hint, fix


def _config_key(p: _Probe, rows: int) -> str | None:
    """The one setting of a watched model's config that sized the guarded table
    (``type_vocab_size``, ``max_position_embeddings``): an int equal to its rows under a
    name for a size or a count of positions; None when none or several match."""
    return _config_key_in(p.roots, rows)


def _config_key_in(roots: Sequence[nn.Module], rows: int) -> str | None:
    """:func:`_config_key` over the configs of ``roots``."""
    found: set[str] = set()
    for root in roots:
        config = getattr(root, "config", None)
        for key, value in getattr(config, "__dict__", {}).items():
            if (
                type(value) is int
                and value == rows
                and re.search(r"(?:_size|positions|_embeddings)$", key)
            ):
                found.add(key)
    return found.pop() if len(found) == 1 else None


def _config_sized(p: _Probe, key: str, rows: int, top: int) -> tuple[str, str]:
    """NW513's hint and fix for ids past a table a model's config sized: a position past
    its context (a generation loop whose KV cache grew past it), or a count the config
    fixes (BERT's ``type_vocab_size``): the ids must fit it, or the config must change."""
    if "position" in key:
        return (
            f" — these are positions: the model was built with {key}={rows}, and position "
            f"{top} is past it: the tokens so far (a KV cache's past plus this input) are "
            "longer than the model's context"
        ), (
            f"stop at {rows} tokens in all (the prompt plus new ones: generate(..., "
            f"max_length={rows})), or keep only the last {rows - 1} tokens in the cache"
        )
    var = _held_as(p.frame, p.input)
    hint = f" — the model's config sized this table: {key}={rows}, and the ids reach {top}"
    if var is None:
        fix = f"# give it ids in 0..{rows - 1} only"
    else:
        hint += f" (in {var})"
        fix = f"{var} = {var}.clamp_max({rows - 1})   # ids in 0..{rows - 1} only"
    return hint, (
        f"{fix}\n# or, training from scratch: build the model from a config with "
        f"{key}={top + 1} (a pretrained model's {key} is fixed)"
    )


def _padding_row(p: _Probe, rows: int) -> int | None:
    pad = p.bound.get("padding_idx")
    if not isinstance(pad, int) or isinstance(pad, bool):
        return None
    return pad + rows if pad < 0 else pad


def _input_embeddings_of(p: _Probe) -> bool:
    """Whether the guarded module is a watched Hugging Face model's input embeddings
    (``model.get_input_embeddings()``): ``resize_token_embeddings`` then resizes it."""
    for root in p.roots:
        get = getattr(root, "get_input_embeddings", None)
        if not callable(get) or not callable(getattr(root, "resize_token_embeddings", None)):
            continue
        try:
            emb = get()
        except Exception:  # a model that does not implement it
            continue
        # the same module, or one tied to its weight (a decoder's copy of the shared table)
        if emb is p.module or (
            emb is not None and getattr(emb, "weight", None) is getattr(p.module, "weight", 0)
        ):
            return True
    return False


def _bigger_table(p: _Probe, need: int) -> str:
    """The fix for ids past the last row: a table with ``need`` rows, built like this one."""
    w = p.bound["weight"]
    rows = int(w.shape[0])
    if not p.is_module or p.module is None:
        return f"give {p.arg('weight')} at least {need} rows (it has {rows}), or remap the ids"
    if _input_embeddings_of(p):
        return "model.resize_token_embeddings(len(tokenizer))  # a row for every token"
    return _table_like(p, need) + ("  # or len(tokenizer) rows" if _token_table(p) else "")


#: words in a table's name, or its ids' expression, that say it is indexed by tokens
_TOKEN_WORDS = re.compile(r"tok|word|vocab|wte|input_ids|subword|wordpiece|bpe", re.IGNORECASE)


def _token_table(p: _Probe) -> bool:
    """Whether the guarded embedding looks like a token embedding (a model's input
    embeddings, a watched model with an output head over as many classes as the table has
    rows -- a language model's vocabulary --, or a name, the table's or its ids', about
    tokens, words or a vocabulary): only then is a tokenizer the likely source of an id
    past its rows."""
    if p.is_module and _input_embeddings_of(p):
        return True
    rows = int(p.bound["weight"].shape[0])
    for root in p.roots:
        if any(isinstance(m, nn.Linear) and m.out_features == rows for m in root.modules()):
            return True
    names = [p._call[0] or "", p.arg(p.spec.input)]
    if not p.is_module:
        names.append(p.arg("weight"))
    return any(_TOKEN_WORDS.search(n or "") for n in names)


def _table_like(p: _Probe, rows: int, **opts: Any) -> str:
    """``self.emb = nn.Embedding(rows, dim, ...)``: the guarded module built again with
    ``rows`` rows, its other settings kept and ``opts`` set (``padding_idx=200``)."""
    assert p.module is not None
    dim = int(p.bound["weight"].shape[1])
    owner = _forward_owner(type(p.module)) or type(p.module)
    args = [str(rows), str(dim)]
    try:
        params = list(inspect.signature(owner).parameters.values())
    except (TypeError, ValueError):
        params = []
    for param in params:
        if param.name in ("num_embeddings", "embedding_dim", "device", "dtype", "_weight"):
            continue
        if param.name.startswith("_") or param.default is param.empty or param.name in opts:
            continue
        v = getattr(p.module, param.name, _MISSING)
        if v is _MISSING or v == param.default or not isinstance(v, (int, float, str, bool)):
            continue
        args.append(f"{param.name}={v!r}")
    args += [f"{k}={v!r}" for k, v in opts.items()]
    made = f"nn.{owner.__name__}({', '.join(args)})"
    target = _module_expr(p)
    if target is not None:
        made = f"{target} = {made}"
    return made


def _module_expr(p: _Probe) -> str | None:
    """The user's expression for the guarded module, from the callee on their line: the
    callee itself when it is that module (``self.emb``), the path down to it when the
    callee is a model holding it (``m`` calling a Sequential whose first layer is the
    table: ``m[0]``). None when the callee is no plain name or does not lead to it (the
    user's frame is read with getattr on names and modules only)."""
    callee = p._call[0]
    frame, module = p.frame, p.module
    if callee is None or frame is None or module is None:
        return None
    obj = _resolved(callee, frame)
    if obj is module:
        return callee
    if not isinstance(obj, nn.Module):
        return None
    path = next((q for q, m in obj.named_modules() if m is module), None)
    if not path:
        return None
    return callee + "".join(f"[{q}]" if q.isdigit() else f".{q}" for q in path.split("."))


def _resolved(expr: str, frame: types.FrameType) -> Any:
    """The object ``expr`` names in ``frame``: a name, then attributes and constant
    subscripts of modules only (``self.body["tok"]``, ``m[0]``: a container's lookup, which
    runs no user code); :data:`_MISSING` for anything else."""
    try:
        node = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return _MISSING
    chain: list[ast.Attribute | ast.Subscript] = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        chain.append(node)
        node = node.value
    if not isinstance(node, ast.Name):
        return _MISSING
    scope = frame.f_locals
    obj = scope[node.id] if node.id in scope else frame.f_globals.get(node.id, _MISSING)
    for link in reversed(chain):
        if not isinstance(obj, nn.Module):
            return _MISSING
        if isinstance(link, ast.Attribute):
            obj = getattr(obj, link.attr, _MISSING)
        elif isinstance(link.slice, ast.Constant) and isinstance(
            obj, (nn.Sequential, nn.ModuleList, nn.ModuleDict)
        ):
            key: Any = link.slice.value
            try:
                obj = obj[key]
            except (KeyError, IndexError, TypeError):
                return _MISSING
        else:
            return _MISSING
    return obj


def _own_padding_row(p: _Probe, text: str, rows: int) -> str:
    """The fix for padding that shares its row with a real id: a table with one more row,
    row ``rows``, kept for padding, and the negative ids mapped onto it."""
    recv = _paren(text)
    mapped = f"{recv}.masked_fill({recv} < 0, {rows})"
    if p.is_module and p.module is not None:
        made = _table_like(p, rows + 1, padding_idx=rows)
        call = _without_comment(p.call_with(input=mapped))
        return f"{made}  # row {rows} for padding alone\n{call}"
    if p.has_arg("padding_idx"):
        call = p.call_with(input=mapped, padding_idx=str(rows))
    else:
        call = p.call_with({"padding_idx": rows}, input=mapped)
    weight = p.arg("weight")
    return f"{_without_comment(call)}  # once {weight} has {rows + 1} rows: {rows} for padding"


def _drop_column(p: _Probe, nc: int) -> str:
    """``F.one_hot(idx, n + 1)[..., :n]``: the user's one_hot with a column for the value
    ``nc`` (a sentinel), sliced off again, so sentinel rows come out all zeros."""
    given = p.arg("num_classes", "")
    if not given or given.lstrip("-").isdigit():
        wider, keep = str(nc + 1), str(nc)
    else:
        wider, keep = f"{_paren(given)} + 1", given
    fix = p.call_with_suffix(f"[..., :{keep}]", num_classes=wider)
    return f"{_without_comment(fix)}  # rows of {nc} come out all zeros"


def _index_result(
    p: _Probe, v: dict[str, float], *, rows: int | None, used: torch.Tensor | None
) -> None:
    if v["index_min"] >= 0 and (rows is None or v["index_max"] < rows):
        return
    ids = p.input
    # failure path: count and locate (a second read is fine now)
    bad = (ids < 0) if rows is None else (ids < 0) | (ids >= rows)
    if used is not None:
        bad &= used
    values, counts = _value_counts(ids[bad])
    total = ids.numel() if used is None else int(used.sum())
    param = p.spec.input
    text = p.arg(param)
    neg = [int(x) for x in values if x < 0]
    big = [int(x) for x in values if x >= 0]
    top = max(big) if big else None
    if p.spec.name == "one_hot":
        nc = rows
        if nc is None:
            accepts = f"{p.desc()} accepts values >= 0"
            expected = ">= 0"
        else:
            accepts = f"{p.desc(num_classes=nc)} accepts 0..{nc - 1}"
            expected = f"0..{nc - 1}"
        label = next((x for x in (*neg, *big) if x in _IGNORE_LABELS), None)
        recv = _paren(text)
        if label is not None:
            hint = f" — {label} looks like an ignore label, and one_hot has none"
            cond = f"{recv} < 0" if label < 0 else f"{recv} == {label}"
            fix = _without_comment(p.call_with(tensor=f"{recv}.masked_fill({cond}, 0)"))
            fix += "  # and leave those positions out of the loss"
        elif top is not None and not neg:
            if nc is not None and all(x == nc for x in big) and v["index_min"] >= 1:
                # no 0 anywhere and nothing past nc: 1-based labels
                hint = f" — class values start at 0: labels 1..{nc} need `{recv} - 1`"
                hint += f", or num_classes={nc + 1}"
                fix = p.call_with(tensor=f"{recv} - 1")
            elif nc is not None and all(x == nc for x in big):
                # 0 is a real class too: the values are not shifted, nc marks a slot
                # beyond the classes (a dropped token, a padding class)
                hint = (
                    f" — 0 is a class too, so these are not 1-based labels: {nc} looks like "
                    f"a sentinel (a dropped or padding slot); give it a column and drop it "
                    f"(num_classes={nc + 1}, then [..., :{nc}])"
                )
                fix = _drop_column(p, nc)
            else:
                hint = f" — the largest value is {top}, so num_classes must be at least {top + 1}"
                fix = _functional_option(p, "num_classes", top + 1)
        else:
            hint, fix = "", f"map {text} to class indices 0..{(nc or 1) - 1}"
        explanation = (
            "F.one_hot sets one column per value: a value outside [0, num_classes) has no "
            "column. On a GPU that is a device-side assert (the CUDA kernel skips the range "
            "check to avoid a sync), which kills the CUDA context."
        )
    else:
        assert rows is not None
        table = p.cls_name if p.is_module else p.arg("weight")
        accepts = f"{table} has {rows} rows, so ids must be in 0..{rows - 1}"
        expected = f"0..{rows - 1}"
        if (
            neg
            and top is None
            and p.spec.name == "embedding"
            and (held := _position_table_of(p, rows))
        ):
            hint, fix = _negative_positions(p, ids, held)
        elif top is not None and not neg:
            if (
                p.spec.name == "embedding"
                and _looks_like_positions(ids)
                and (offset := _offset_positions(p, ids, rows, int(v["index_min"])))
            ):
                hint, fix = offset
            elif p.spec.name == "embedding" and _looks_like_positions(ids):
                length = int(ids.shape[-1])
                # rows below the first position are not positions: a padding row
                # (RoBERTa: positions start at padding_idx + 1), or an offset the config
                # leaves out (BART: max_position_embeddings + 2 rows, positions from 2)
                pad = _padding_row(p, rows)
                lo = int(v["index_min"])
                key = _config_key(p, rows)
                start, setting = 0, rows  # the first position, the config's value
                if pad is not None and lo == pad + 1:
                    start = lo
                elif 0 < lo < rows and key is None:
                    key = _position_key(p.roots, rows - lo)
                    if key is not None:
                        start, setting = lo, rows - lo
                usable = rows - start
                has = f"the {rows} positions the embedding has"
                if start:
                    has = f"the {usable} positions the embedding's {rows} rows hold from {start}"
                if key is not None:
                    has += f" (config.{key}={setting})"
                hint = (
                    f" — these are positions: the sequence ({length} tokens) is longer than " + has
                )
                grow = (
                    f"build the model with {key} >= {top + 1 - rows + setting} (a pretrained "
                    "model's is fixed)"
                    if key is not None
                    else f"give the position embedding {top + 1} rows"
                )
                fix = (
                    f"truncate the inputs to {usable} tokens (tokenizer(..., truncation=True, "
                    f"max_length={usable})), or {grow}"
                )
            elif (sized := _config_key(p, rows)) is not None and not _token_table(p):
                hint, fix = _config_sized(p, sized, rows, top)
            else:
                token = _token_table(p)
                if all(x == rows for x in big):
                    hint = f" — {rows} is one past the last row: " + (
                        "was a token added to the tokenizer after the embedding was built?"
                        if token
                        else "was an id added (a new item, user or category) after the "
                        "table was built?"
                    )
                else:
                    hint = f" — the largest id is {top}, so the ids need {top + 1} rows: " + (
                        "tokens added to the tokenizer, or ids from another tokenizer?"
                        if token
                        else "ids added after the table was built, or ids from another mapping?"
                    )
                fix = _bigger_table(p, top + 1)
                if not token and p.is_module and p.module is not None:
                    # a category id the table was not sized for: an 'unknown' row first
                    from nanwatch.rules.guards import unknown_id_hint, unknown_row_fix

                    recv = _paren(text)
                    hint = unknown_id_hint((), rows, above=True)
                    fix = unknown_row_fix(
                        recv=recv,
                        rows=rows,
                        call=lambda e: _without_comment(p.call_with(input=e)),
                        grown=_table_like(p, rows + 1),
                        below=False,
                        above=True,
                        bigger=fix,
                    )
        elif neg and top is None and -100 not in neg and (src := _made_from(p, ids, neg)):
            # a library made these ids from a tensor of the user's (decoder ids shifted
            # right from the labels): that tensor's negative values are the mistake
            hint, fix = _library_ignore(p, ids, neg[0], _IGNORE_DEFAULT, source=src)
        elif neg and top is None and -100 not in neg and _padding_row(p, rows) is None:
            from nanwatch.rules.guards import unknown_id_hint, unknown_row_fix

            recv = _paren(text)
            if _token_table(p):
                # token padding written as a negative id: a padding row of its own
                hint = " — padding written as a negative id? Give it a padding row"
                fix = _own_padding_row(p, text, rows)
            else:
                hint = unknown_id_hint(neg, rows, above=False)
                fix = unknown_row_fix(
                    recv=recv,
                    rows=rows,
                    call=lambda e: _without_comment(p.call_with(input=e)),
                    grown=_table_like(p, rows + 1)
                    if p.is_module and p.module is not None
                    else None,
                    weight=p.arg("weight"),
                    below=True,
                    above=False,
                )
        elif neg and top is None:
            if -100 in neg:
                hint = " — -100 is the loss's ignore_index: were the labels passed as ids?"
            else:
                hint = " — padding written as a negative id? Map it to the padding row"
            pad = _padding_row(p, rows)
            given = p.bound.get("padding_idx")
            back = 0  # how far a negative padding_idx counts back from the end
            if isinstance(given, int) and not isinstance(given, bool) and given < 0:
                back = -given
            real = 0
            if pad is not None and 0 <= pad < rows and -100 not in neg:
                taken = ids == pad
                real = int((taken & used).sum() if used is not None else taken.sum())
            if pad is not None and -100 not in neg and (real or back):
                # the padding row is a real item: mapping padding onto it merges the two,
                # and that item never trains (padding_idx gets no gradient)
                if real:
                    hint = (
                        f" — padding written as a negative id, and the padding row ({pad}) "
                        f"is also a real id here ({_many(real, 'position')}): padding needs a "
                        "row of its own"
                    )
                else:
                    hint = (
                        f" — padding_idx={given} means row {pad} to torch ({rows} - {back}), "
                        f"not id {given}, and row {pad} is a real id: padding needs a row "
                        "of its own"
                    )
                fix = _own_padding_row(p, text, rows)
            else:
                repl = str(pad) if pad is not None else "pad_id"
                recv = _paren(text)
                fix = _without_comment(p.call_with(input=f"{recv}.masked_fill({recv} < 0, {repl})"))
                fix += (
                    f"  # {pad} is the padding_idx"
                    if pad is not None
                    else "  # pad_id: a row kept for padding (padding_idx=pad_id)"
                )
                if pad == rows - 1 and p.is_module and p.module is not None:
                    # padding_idx=-1 is stored as the last row: not seen as a real id in
                    # this batch, but perhaps one
                    made = _table_like(p, rows + 1, padding_idx=rows)
                    fix += (
                        f"\n# if {pad} is also a real id (padding_idx=-1 is the last row), "
                        f"give padding a row of its own and map to {rows}:\n# {made}"
                    )
        elif all(x in _IGNORE_LABELS for x in neg):
            # a padding or ignore sentinel (-1, -100) beside ids past the end: two faults
            assert top is not None  # both kinds: some below 0, some past the end
            hint = f" — ids below 0 and above {rows - 1}"
            fix = (
                f"map the ids into 0..{rows - 1}: padding to the padding row, and a table with "
                f"a row for every id ({top + 1} or more)"
            )
        else:
            # ids on both sides of the table: no number of rows makes a negative id valid.
            # Ids spread below 0 and past the end are what quantizing a value from outside
            # the range the quantization assumes gives (audio not scaled to [-1, 1])
            lo, hi = int(v["index_min"]), int(v["index_max"])
            hint = (
                f" — ids below 0 and above {rows - 1} (min {lo}, max {hi}): a bigger table "
                "cannot hold a negative id; ids spread on both sides of the table are what "
                "quantizing a value from outside the range the quantization expects gives"
            )
            ids_at = _made_at(p, text)
            at = ""
            if ids_at is not None and p.frame is not None:
                file = os.path.basename(p.frame.f_code.co_filename)
                at = f", where {text} is made ({file}:{ids_at[0]}: {ids_at[1]})"
            fix = (
                f"scale the value quantized into {text} to the range the quantization expects "
                f"before quantizing it (e.g. int16 audio / 32768 for [-1, 1]){at}, so the ids "
                f"land in 0..{rows - 1}; not a bigger table"
            )
        explanation = (
            "An embedding returns row `id` of its weight: an id outside [0, rows) reads past "
            "the table. On a GPU the kernel's assert kills the CUDA context ('device-side "
            "assert triggered', reported at a later line); on the CPU PyTorch says 'index out "
            "of range in self' without naming the module or the id."
        )
    p.fail(
        _Failure(
            code="NW513",
            check="index-range",
            problem=(
                f"{param} contains {_describe_values(values, counts)} (of {_n(total)}); "
                f"{accepts}{hint}"
            ),
            expected=expected,
            fix=fix,
            explanation=explanation,
            values=values,
            counts=counts,
            count=int(sum(counts)),
            total=total,
            positions=_positions(bad),
        )
    )


_CHECKS: dict[str, Callable[[_Probe], None]] = {
    "class": _check_class,
    "ctc": _check_ctc,
    "binary": _check_binary,
    "regression": _check_regression,
    "sign": _check_sign,
    "embedding": _check_plain,
    "index": _check_index,
    "generic": _check_plain,
}


# ---------------------------------------------------------------------------- driver
def _source(frame: types.FrameType) -> str:
    """``train.py:42``: the frame's file relative to the working directory when inside it."""
    return f"{_frames._short(frame.f_code.co_filename)}:{frame.f_lineno}"


def _torch_loss_module(caller: Any, spec: GuardSpec) -> tuple[nn.Module, tuple[str, ...]] | None:
    """(the module, its forward's parameters) when ``caller`` is the ``forward`` of torch's
    own nn module for ``spec`` (``nn.CrossEntropyLoss`` calling ``F.cross_entropy``); None
    otherwise (the user's code, a subclass's own forward, a library's loss)."""
    if not isinstance(caller, types.FrameType) or caller.f_code.co_name != "forward":
        return None
    if not _frames.is_core(caller.f_code.co_filename):
        return None
    module = caller.f_locals.get("self")
    if not isinstance(module, nn.Module) or type(module).__name__ not in spec.classes:
        return None
    code = caller.f_code
    names = code.co_varnames[1 : code.co_argcount]  # forward(self, input, target)
    return module, tuple(names)


def _call_site(f: types.FrameType | None) -> types.FrameType | None:
    """The frame of the code that made a guarded call: the first above ``f`` that is not
    torch's, the standard library's or nanwatch's (an installed library's, when the call
    was made there: transformers' loss functions)."""
    while f is not None and _frames.is_core(f.f_code.co_filename):
        f = f.f_back
    return f


def _in_library(p: _Probe) -> bool:
    """Whether the guarded call was made by code other than the user's line (an installed
    library's loss, called from the user's ``model(...)``)."""
    return p.site is not None and p.frame is not None and p.site is not p.frame


def _site_name(f: types.FrameType) -> str:
    """``transformers/loss/loss_utils.py:42``: a library frame's file from its package on."""
    name = f.f_code.co_filename
    for part in _frames._LIBRARY_PARTS:
        if part in name:
            return f"{name.split(part, 1)[1]}:{f.f_lineno}"
    return _source(f)


def _holds(frame: types.FrameType | None, t: torch.Tensor) -> bool:
    """Whether a variable of ``frame`` (or an entry of a mapping it holds) is ``t`` (or the
    same values in the same layout)."""
    return _held_as(frame, t) is not None


def _held_as(frame: types.FrameType | None, t: torch.Tensor) -> str | None:
    """The expression of ``frame`` that holds ``t`` (or the same values in the same
    layout): ``token_type_ids``, or ``batch["token_type_ids"]``; None when none does."""
    for key, v in _frame_tensors(frame):
        if v is t:
            return key
        if (
            _plain(v)
            and v.shape == t.shape
            and v.stride() == t.stride()
            and v.dtype == t.dtype
            and v.device == t.device
            and v.data_ptr() == t.data_ptr()
        ):
            return key
    return None


def _positions_in(p: _Probe, failure: _Failure) -> str:
    """Where a failure's positions index, when that is not a tensor of the user's: a call
    made inside a library on a tensor it made (transformers flattens and shifts the
    labels before its cross-entropy), so the user's line holds no tensor they index."""
    if not failure.positions or not _in_library(p) or p.site is None:
        return ""
    if failure.check == "ctc-length":
        return ""  # sample indices: the rows of the user's batch
    name = p.spec.input
    if failure.check.startswith("target") or failure.check == "ctc-blank":
        name = p.spec.target or name
    t = p.bound.get(name)
    if not isinstance(t, torch.Tensor) or _holds(p.frame, t):
        return ""
    who = p.cls_name if p.is_module else p.spec.call
    return (
        f"in the {tuple(t.shape)} {name} that {who} got in {_site_name(p.site)}, not in your tensor"
    )


def _reduction(bound: Mapping[str, Any]) -> Any:
    size_average, reduce = bound.get("size_average"), bound.get("reduce")
    if size_average is not None or reduce is not None:
        from torch.nn import _reduction

        return _reduction.legacy_get_string(size_average, reduce, emit_warning=False)
    return bound.get("reduction")


def _guard(
    watcher: Watcher,
    spec: GuardSpec,
    bound: dict[str, Any],
    *,
    path: str,
    cls_name: str,
    is_module: bool,
    frame: types.FrameType | None,
    order: Sequence[str],
    kw_names: Mapping[str, str],
    module: nn.Module | None = None,
    call: Callable[[], Any] | None = None,
    site: types.FrameType | None = None,
    early: bool = False,
) -> None:
    """Check one guarded call; for a loss, write its ``"loss_input"`` note; raise GuardError
    on a failure. ``call``: the guarded call itself, run on a failure on the CPU to learn
    which error torch raises there (see :func:`_torch_error`). ``early``: a loss module's
    check before the watcher's pre-hook (NW519 alone, no note unless it fails)."""
    x = bound.get(spec.input)
    if not isinstance(x, torch.Tensor):
        return
    p = _Probe(
        spec,
        bound,
        is_module=is_module,
        cls_name=cls_name,
        frame=frame,
        order=order,
        kw_names=kw_names,
        module=module,
        roots=watcher.roots,
        known=watcher.measured_minmax,
        upstream=lambda: watcher.trace.anomaly is not None or watcher._unread_bad(),
        from_module=watcher.made_by_watched,
        recorded=lambda node: node in watcher._recorded_nodes,
        ops_checked=watcher._forensic,
        in_module=bool(watcher._stack),
        site=site,
    )
    failure: _Failure | None = None
    # DisableTorchFunction: our own reads need no torch-function mode (a FunctionalGuards
    # would otherwise see each of them) and no subclass handling
    with torch.no_grad(), torch._C.DisableTorchFunction():
        try:
            if early:
                _check_nograd_term(p)
            else:
                _check_devices(p)
                _CHECKS[spec.kind](p)
                _check_weights(p)
            p.read()
        except _Fail as fail:
            failure = fail.failure
        if not early and spec.kind != "index" and len(watcher.trace.notes) < _MAX_NOTES:
            source = _source(frame) if frame is not None else None
            data = _evidence(watcher, p)
            if frame is not None:
                # which call of the line is this loss (``0.5 * mse(a, b) + nll(c, d)``):
                # the rules rewrite that one
                data["call"] = _frames.running_call(frame)
            watcher.note("loss_input", path, source=source, **data)
            _tls.sign_tap = (
                _sign_tap(watcher, p, path, source, module, call=data.get("call"))
                if failure is None
                else None
            )
    if failure is None or failure.code in watcher.config.ignore:
        return
    source = _source(frame) if frame is not None else None
    policy = watcher.config.on_anomaly
    # torch would compute it (an inf or NaN the watcher then sees, or a loop skips with
    # math.isfinite): under "warn" the guard notes it and lets the call run
    lenient = (failure.torch_runs or failure.code in _LENIENT) and policy == "warn"
    note = watcher.note(
        "guard",
        path,
        source=source,
        code=failure.code,
        check=failure.check,
        loss=cls_name if is_module else spec.call,
        problem=failure.problem,
        expected=failure.expected,
        fix=failure.fix,
        explanation=failure.explanation,
        values=list(failure.values),
        counts=list(failure.counts),
        count=failure.count,
        total=failure.total,
        positions=[list(q) for q in failure.positions],
        positions_in=_positions_in(p, failure),
        source_line=p.line,
        raised=not lenient,
        on_anomaly=policy,
    )
    if lenient:
        return
    torch_error = _torch_error(watcher, bound, call)
    err = _error(note, failure, watcher.step_index, is_module=is_module, torch_error=torch_error)
    err._nanwatch_owner = id(watcher)  # type: ignore[attr-defined]  # nested watchers
    raise err


def _torch_error(
    watcher: Watcher, bound: Mapping[str, Any], call: Callable[[], Any] | None
) -> BaseException | None:
    """The exception torch itself raises for a call a guard stopped, found by running the
    call: the GuardError is then raised as that exception's type too, so code that catches
    it (``except IndexError:`` to skip a bad batch) behaves as without nanwatch.

    Only on the CPU: there the kernel's own check raises cleanly, where on a GPU it would
    trip the device-side assert the guard exists to prevent. Not for a call that writes to
    a weight before it checks its indices (an embedding with ``max_norm``). The watcher is
    paused meanwhile (a loss module's children record nothing) and the functional guards
    step aside; nothing is recorded, no gradient is made."""
    if call is None or bound.get("max_norm") is not None:
        return None
    tensors = [v for v in bound.values() if isinstance(v, torch.Tensor)]
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return None
    outer = getattr(_tls, "functional", False)
    _tls.functional = True
    try:
        with watcher.paused(), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            call()
    except Exception as exc:  # what torch raises: the point of the call
        return exc
    finally:
        _tls.functional = outer
    return None


#: autograd nodes that only move or copy values: the activation is behind them
_SHAPE_ONLY = (
    "View",
    "Reshape",
    "UnsafeView",
    "Squeeze",
    "Unsqueeze",
    "Permute",
    "Transpose",
    "T",
    "Expand",
    "Select",
    "Slice",
    "Clone",
    "ToCopy",
    "Contiguous",
    "AsStrided",
    "Flatten",
)


def _activation_node(fn: Any, depth: int = 8) -> str | None:
    """The first autograd node under a loss input that is not a view or a copy:
    ``torch.sigmoid(x).squeeze(1)`` is still a sigmoid output."""
    while fn is not None and depth > 0:
        name = type(fn).__name__
        if name.split("Backward")[0] not in _SHAPE_ONLY:
            return name
        nxt = [n for n, _ in fn.next_functions if n is not None]
        fn = nxt[0] if len(nxt) == 1 else None
        depth -= 1
    return None


#: autograd nodes that keep a tensor's shape and the meaning of each of its dims
_SAME_DIMS = frozenset(("ToCopyBackward0", "CloneBackward0", "AliasBackward0"))


def _softmax_dim(x: torch.Tensor) -> int | None:
    """The dim a softmax or log_softmax that made ``x`` (its own node, or under a cast or a
    clone) normalized over, counted from 0 in ``x``'s dims; None when ``x`` was not made
    so. Host-side: read from the autograd node, no tensor is touched."""
    fn = x.grad_fn
    while fn is not None and type(fn).__name__ in _SAME_DIMS:
        nxt = [n for n, _ in fn.next_functions if n is not None]
        fn = nxt[0] if len(nxt) == 1 else None
    if fn is None or type(fn).__name__ not in ("LogSoftmaxBackward0", "SoftmaxBackward0"):
        return None
    dim = getattr(fn, "_saved_dim", None)
    if not isinstance(dim, int) or x.dim() == 0:
        return None
    dim = dim - 2**64 if dim >= 2**63 else dim  # a negative dim, stored unsigned
    return dim % x.dim() if -x.dim() <= dim < x.dim() else None


def _softmax_of_one(fn: Any, depth: int = 8) -> dict[str, Any] | None:
    """The softmax or log_softmax under a loss input (down a chain of one-input nodes: a
    log, a clamp, a squeeze) that normalized over a dim of size 1: its output is exactly 1
    (or 0) whatever its input, and the loss does not depend on it. Its node, the dim and its
    result's shape; None otherwise. Host-side: the node's saved dim and its result's shape,
    no value is read."""
    while fn is not None and depth > 0:
        name = type(fn).__name__
        if name in ("LogSoftmaxBackward0", "SoftmaxBackward0"):
            dim = getattr(fn, "_saved_dim", None)
            try:
                shape = list(fn._saved_result.shape)
            except (AttributeError, RuntimeError):  # freed, or not kept by this build
                return None
            if not isinstance(dim, int) or not shape:
                return None
            dim = dim - 2**64 if dim >= 2**63 else dim  # a negative dim, stored unsigned
            if not -len(shape) <= dim < len(shape) or shape[dim] != 1 or 0 in shape:
                return None
            return {"node": name, "dim": dim % len(shape), "shape": shape}
        nxt = [n for n, _ in fn.next_functions if n is not None]
        fn = nxt[0] if len(nxt) == 1 else None
        depth -= 1
    return None


def _widens(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether a cast from ``src`` to ``dst`` keeps every value exactly (float16 and
    bfloat16 to float32, float32 to float64)."""
    if src == dst or not (src.is_floating_point and dst.is_floating_point):
        return False
    a, b = torch.finfo(src), torch.finfo(dst)
    return b.max >= a.max and b.eps <= a.eps and b.tiny <= a.tiny


def _upcast_source(watcher: Watcher, x: torch.Tensor) -> tuple[int, str] | None:
    """For a loss input that is a widening copy of a recorded tensor (``logits.float()``:
    autograd node ToCopyBackward0 over it), the index of that tensor's record and its dtype;
    None otherwise. The copy is a new tensor, so :meth:`Watcher.record_of` (by identity)
    does not know it; its node leads to the tensor's own node (a leaf's AccumulateGrad holds
    the tensor), which a recorded tensor, still alive and unchanged, shares."""
    fn = x.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or len(fn.next_functions) != 1:
        return None
    node, nr = fn.next_functions[0]
    if node is None:
        return None
    found, alive = _copied_from(watcher, node, nr, x.dtype)
    if found is not None or alive:
        return found
    return _dead_upcast_source(watcher, x, node, nr)


#: autograd nodes of views, reshapes and copies: the values of their input, moved (or a
#: part of them; a reshape of a slice copies it: UnsafeView over Clone)
_VIEW_NODES = frozenset(
    f"{op}Backward0"
    for op in (
        "View", "Reshape", "UnsafeView", "Slice", "Select", "Transpose", "T", "Permute",
        "Squeeze", "Unsqueeze", "Alias", "AsStrided", "Narrow", "Flatten", "Unflatten",
        "Clone",
    )
)  # fmt: skip


def _view_source(watcher: Watcher, x: torch.Tensor, depth: int = 6) -> int | None:
    """The index of the record of the tensor a loss input is a view of (``logits.flatten(0,
    1)``, ``logits[:, 1:].reshape(-1, V)``): the recorded tensor the input's autograd
    nodes reach through views and reshapes alone (a recorded tensor still alive shares its
    node), or, under no_grad, the input's base. None when it is no view of one."""
    base = x._base
    if base is not None and (rec := watcher.record_of(base)) is not None:
        return rec.index
    # the nodes the views were taken of, nearest first: one look at the live records for all
    below: list[tuple[Any, int]] = []
    fn = x.grad_fn
    for _ in range(depth):
        if fn is None or type(fn).__name__ not in _VIEW_NODES or len(fn.next_functions) != 1:
            break
        fn, nr = fn.next_functions[0]
        if fn is None:
            break
        below.append((fn, nr))
    if not below:
        return None
    order = {(id(n), nr): i for i, (n, nr) in enumerate(below)}
    best: tuple[int, int] | None = None
    for entry in list(watcher._known.values()):
        t = entry[0]()
        fn = t.grad_fn if t is not None else None
        at = order.get((id(fn), t.output_nr)) if fn is not None and t is not None else None
        if at is None or (best is not None and best[0] <= at):
            continue
        found = watcher.record_of(t) if t is not None else None
        if found is not None:
            best = (at, found.index)
    return best[1] if best is not None else None


def _copied_from(
    watcher: Watcher, node: Any, nr: int, dtype: torch.dtype
) -> tuple[tuple[int, str] | None, bool]:
    """The record (index, dtype) of the tensor a copy to ``dtype`` widened, output ``nr``
    of autograd node ``node``, found among the live tensors (a leaf's AccumulateGrad holds
    it; a recorded tensor still alive shares its node); and whether any such tensor is
    alive. When none is, the caller looks for the record of one that is gone."""
    leaf = getattr(node, "variable", None)
    if isinstance(leaf, torch.Tensor):
        candidates: list[torch.Tensor] = [leaf]
    else:
        candidates = [
            t
            for entry in list(watcher._known.values())
            if (t := entry[0]()) is not None and t.grad_fn is node and t.output_nr == nr
        ]
    for t in candidates:
        if _widens(t.dtype, dtype):
            rec = watcher.record_of(t)
            if rec is not None:
                return (rec.index, dtype_name(t.dtype)), True
    return None, bool(candidates) or leaf is not None


#: how many single-input autograd nodes a loss input may be computed through from a
#: widening copy (``(logits.float() / T).log_softmax(-1)``: two) for
#: :func:`_computed_after_upcast` to find it
_UPCAST_DEPTH = 8


def _computed_after_upcast(watcher: Watcher, x: torch.Tensor) -> tuple[int, str] | None:
    """For a loss input computed from a widening copy of a recorded tensor through ops of
    one tensor input each (``logits.float() / T``, a ``log_softmax`` of it: a scalar
    operand is no input), the index of that tensor's record and its dtype; None
    otherwise. Every op after the copy ran in the wider dtype: an exp among them (a
    softmax) is far from the narrow dtype's bound."""
    fn = x.grad_fn
    for _ in range(_UPCAST_DEPTH):
        if fn is None:
            return None
        nxt = [(n, nr) for n, nr in fn.next_functions if n is not None]
        if len(nxt) != 1:
            return None
        node = nxt[0][0]
        if type(node).__name__ == "ToCopyBackward0":
            below = [(n, k) for n, k in node.next_functions if n is not None]
            if len(below) != 1:
                return None
            src, src_nr = below[0]
            found, alive = _copied_from(watcher, src, src_nr, x.dtype)
            if found is not None or alive or src not in watcher._recorded_nodes:
                return found
            return _dead_copy_source(watcher, src, src_nr)
        fn = node
    return None


def _dead_copy_source(watcher: Watcher, src: Any, nr: int) -> tuple[int, str] | None:
    """The record of the tensor (output ``nr`` of autograd node ``src``) a widening copy
    was made of, when that tensor is gone (``model(x).float() / T``: the output was a
    temporary) and ``src`` is a node the watcher recorded this step: the latest forward
    record of the same node type, dtype and shape (the model's output, after its
    children's). The node's metadata gives the tensor's dtype and shape; None without it
    (torch < 2.5), or when no record matches."""
    try:
        meta = src._input_metadata[nr]
        dtype, shape = meta.dtype, tuple(meta.shape)
    except Exception:  # older torch: no metadata on the node
        return None
    name = type(src).__name__
    for r in reversed(watcher.trace.records):
        if (
            r.phase.value == "forward"
            and r.grad_fn == name
            and tuple(r.shape) == shape
            and r.dtype == dtype_name(dtype)
        ):
            return r.index, r.dtype
    return None


def _dead_upcast_source(
    watcher: Watcher, x: torch.Tensor, node: Any, nr: int
) -> tuple[int, str] | None:
    """The record of the tensor a widening copy was made of when that tensor is gone
    (``criterion(model(x).float(), y)``: the model's output was a temporary): a forward
    record of the same autograd node type, dtype and shape whose measured min and max are
    the copy's own (a widening cast keeps every value); None when none matches. The node's
    metadata gives the tensor's dtype and shape (torch >= 2.5); before that, a node the
    watcher recorded this step stands for it, with the copy's shape and any narrower dtype."""
    try:
        meta = node._input_metadata[nr]
        dtype, shape = meta.dtype, tuple(meta.shape)
    except Exception:  # older torch: no metadata on the node
        dtype, shape = None, tuple(x.shape)
        if node not in watcher._recorded_nodes:
            return None
    if dtype is not None and not _widens(dtype, x.dtype):
        return None
    if shape != tuple(x.shape) or x.numel() == 0:
        return None
    name = type(node).__name__
    found = [
        r
        for r in watcher.trace.records
        if r.phase.value == "forward"
        and r.grad_fn == name
        and tuple(r.shape) == shape
        and (
            r.dtype == dtype_name(dtype)
            if dtype is not None
            else isinstance(d := getattr(torch, r.dtype, None), torch.dtype) and _widens(d, x.dtype)
        )
    ]
    if not found:
        return None
    try:
        lo, hi = (float(v) for v in aminmax(x.detach()))
    except RuntimeError:  # a layout without plain values (sparse)
        return None
    for r in reversed(found):  # the latest: the model's output, after its children's
        if _measured(watcher, r.index) == (lo, hi):
            return r.index, r.dtype
    return None


def _measured(watcher: Watcher, index: int) -> tuple[float, float] | None:
    """The min and max a record measured this step (read, or still on the device)."""
    mm = watcher._minmax.get(index)
    if mm is not None:
        return float(mm[0]), float(mm[1])
    rec = watcher.trace.record(index)
    s = rec.stat if rec is not None else None
    if s is None or math.isnan(s.min) or math.isnan(s.max):
        return None
    return s.min, s.max


def _evidence(watcher: Watcher, p: _Probe) -> dict[str, Any]:
    x, v = p.input, p.values
    data: dict[str, Any] = {
        "loss": p.cls_name if p.is_module else p.spec.call,
        "input_dtype": dtype_name(x.dtype),
        "input_shape": list(x.shape),
        "input_grad_fn": type(x.grad_fn).__name__ if x.grad_fn is not None else None,
        "input_activation": _activation_node(x.grad_fn),
        "input_softmax_dim": _softmax_dim(x),
        "input_requires_grad": x.requires_grad,
        # a leaf that needs a gradient: a parameter, or values given a graph of their own
        # (argmax(...).float().requires_grad_()), whose gradient stops there
        "input_parameter": isinstance(x, nn.Parameter),
        "reduction": _reduction(p.bound),
    }
    one = _softmax_of_one(x.grad_fn)
    if one is not None:  # NW304: a softmax over one element, the loss is constant
        data["input_softmax_of_one"] = one
    rec = watcher.record_of(x)
    data["input_source"] = rec.index if rec is not None else None
    whole = _view_source(watcher, x) if rec is None else None
    if whole is not None:
        # a view of a recorded tensor (logits.flatten(0, 1), logits[:, :-1]): its values,
        # or a part of them, reshaped; not the same statistics, so not input_source
        data["input_view_of"] = whole
    if rec is None:
        up = _upcast_source(watcher, x)
        if up is not None:
            # the loss took a widening copy (logits.float()): the same values, seen in
            # input_dtype; the record holds them in the narrower input_upcast_from
            data["input_source"], data["input_upcast_from"] = up
        else:
            after = _computed_after_upcast(watcher, x)
            if after is not None:
                # computed in input_dtype from a widening copy (logits.float() / T, a
                # log_softmax of it): other values than the record's, in a wider dtype
                data["input_widened_from"], data["input_widened_dtype"] = after
    t = p.target
    if t is not None:
        data["target_dtype"] = dtype_name(t.dtype)
        data["target_shape"] = list(t.shape)
    keys = ("input_min", "input_max", "target_min", "target_max", "target_nonfinite")
    for k in (*keys, "ignored_amax", "valid_amax"):
        if k in v:
            data[k] = v[k]
    if "row_sum_min" in v:
        lo, hi = v.get("input_min", math.nan), v.get("input_max", math.nan)
        # CTC's (T, N, C): the classes are last
        ctc = p.spec.kind == "ctc"
        c = x.shape[-1] if ctc or x.dim() < 2 else x.shape[1]
        tol = min(0.1, 1e-3 + c * torch.finfo(x.dtype).eps / 2)
        dev = max(abs(v["row_sum_min"] - 1), abs(v["row_sum_max"] - 1))
        data["probability_rows"] = bool(lo >= 0 and hi <= 1 and dev <= tol)
    data.update(p.data)
    return data


def _format_positions(positions: Sequence[Sequence[int]], count: int) -> str:
    """``5, 6`` for a 1-d tensor, ``(0, 12, 40), (0, 12, 41)`` otherwise; ``… (N in all)``
    when more positions hold the value than are shown."""
    if all(len(q) == 1 for q in positions):
        shown = ", ".join(str(q[0]) for q in positions)
    else:
        shown = ", ".join("(" + ", ".join(str(i) for i in q) + ")" for q in positions)
    # "8, 9, 10 (of 8)" read as positions out of a range of 8: the count is of positions
    return shown + (f" … ({_n(count)} in all)" if count > len(positions) else "")


def _error(
    note: Note,
    failure: _Failure,
    step: int,
    *,
    is_module: bool,
    torch_error: BaseException | None = None,
) -> GuardError:
    from nanwatch.rules.guards import diagnosis_from_note

    diagnosis = diagnosis_from_note(note, step=step)
    loss = str(note.data["loss"])
    where = loss if not is_module or note.path == loss else f"{note.path} ({loss})"
    lines = [f"{where}{' at ' + note.source if note.source else ''}: {failure.problem}"]
    line = note.data.get("source_line")
    if line:
        lines.append(f"    {line}")
    if failure.positions:
        within = note.data.get("positions_in")
        lines.append(
            f"  first positions: {_format_positions(failure.positions, failure.count)}"
            + (f" ({within})" if within else "")
        )
    if failure.fix:
        lines.append("  fix: " + failure.fix.replace("\n", "\n       "))
    lines.append(
        f"  ({failure.code}: checked before the kernel ran, so nothing was computed and the "
        "device is still usable)"
    )
    cls = guard_error_class(type(torch_error)) if torch_error is not None else GuardError
    if cls.torch_error_type is not None:
        said = str(torch_error).strip().splitlines()
        first = said[0] if said else ""
        name = cls.torch_error_type.__name__
        lines.append(
            f"  (raised as {'an' if name[0] in 'AEIOU' else 'a'} {name} too: torch's own "
            f"error for this call{', ' + repr(first[:200]) if first else ''})"
        )
    return cls(
        "\n".join(lines),
        loss=loss,
        path=note.path,
        check=failure.check,
        code=failure.code,
        module=note.path if is_module else None,
        source=note.source,
        source_line=line,
        values=failure.values,
        counts=failure.counts,
        count=failure.count,
        total=failure.total,
        positions=failure.positions,
        expected=failure.expected,
        fix=failure.fix,
        diagnosis=diagnosis,
    )


# ---------------------------------------------------------------------------- modules
def attach(watcher: Watcher, modules: Sequence[tuple[nn.Module, str]]) -> list[Any]:
    """Register a forward pre-hook (``with_kwargs=True``) on each of ``modules`` that is a
    loss or an embedding whose forward is one of torch's (the others are skipped), that
    checks its inputs before the kernel runs; returns the handles (the watcher removes
    them at detach). A forward hook (``always_call``) closes the module's call, so that a
    functional guard does not check the ``F.*`` call inside it a second time.

    Example:
        >>> from nanwatch import watch
        >>> criterion = nn.CrossEntropyLoss()
        >>> with watch(criterion, postmortem=False) as nw:
        ...     loss = criterion(torch.randn(4, 3), torch.tensor([0, 1, 2, 1]))
        >>> nw.history[-1].notes[0].data["loss"]
        'CrossEntropyLoss'
    """
    health = _Health(watcher)
    handles: list[Any] = []
    try:
        for module, path in modules:
            spec = spec_for(type(module))
            if spec is None:
                continue
            binding = _ModuleBinding(module, spec)
            if spec.name in _NOGRAD_CHECKED:
                # before the watcher's own pre-hook (registered first, with prepend): a
                # +inf it measures in the input raises there, before the guard below runs,
                # and names no more than "born outside the watched modules"
                handles.append(
                    module.register_forward_pre_hook(
                        _make_early_hook(watcher, health, binding, path, module),
                        with_kwargs=True,
                        prepend=True,
                    )
                )
            handles.append(
                module.register_forward_pre_hook(
                    _make_pre_hook(watcher, health, binding, path, module), with_kwargs=True
                )
            )
            handles.append(
                module.register_forward_hook(_pop_hook, with_kwargs=True, always_call=True)
            )
        for module, path in modules:
            table = _position_table(module, watcher.roots)
            if table is not None:
                handles.append(
                    module.register_forward_pre_hook(
                        _make_position_hook(watcher, health, module, path, table),
                        with_kwargs=True,
                    )
                )
        for wrapper, path in _compiled_children(watcher, modules):
            pre, post = _make_compiled_hooks(watcher, health, wrapper, path)
            handles.append(wrapper.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(wrapper.register_forward_hook(post, with_kwargs=True, always_call=True))
    except BaseException:
        for h in handles:
            h.remove()
        raise
    return handles


def _make_pre_hook(
    watcher: Watcher,
    health: _Health,
    binding: _ModuleBinding,
    path: str,
    owner: nn.Module,
    *,
    early: bool = False,
) -> Callable[..., None]:
    """The guard's forward pre-hook of one module; ``early``: NW519 alone, called by the
    hook of :func:`_make_early_hook`."""
    spec = binding.spec
    ref = weakref.ref(owner)

    def guard_pre_hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> None:
        if _compiling():  # inside a compiled child: see _make_compiled_hooks
            return
        if kwargs is None or module is not ref():
            return  # a copy torch registered on a replacement module (see Watcher._make_pre)
        if not health.broken and not _quiet(watcher):
            try:
                bound = binding.bind(module, args, kwargs)
                frame = _frames.user_frame(sys._getframe(1))
                _guard(
                    watcher,
                    spec,
                    bound,
                    path=path,
                    cls_name=type(module).__name__,
                    is_module=True,
                    frame=frame,
                    order=binding.arg_names[: len(args)],
                    kw_names={k: binding.kw_names.get(k, k) for k in kwargs},
                    module=module,
                    call=lambda: module.forward(*args, **kwargs),
                    site=_call_site(sys._getframe(1)),
                    early=early,
                )
            except GuardError:
                raise
            except Exception as exc:  # nanwatch must never break the training it watches
                health.fault(_what(spec), exc)
        if not early:
            _module_stack().append(module)

    return guard_pre_hook


#: a config setting that fixes the number of positions (``max_position_embeddings``,
#: GPT-2's ``n_positions``, ``n_ctx``, ``max_seq_len``, ``block_size``)
_POSITION_KEY = re.compile(
    r"^(?!.*relative).*position|^n_ctx$|seq_len(?:gth)?$|^block_size$|^max_len$|context_length",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class _PositionTable:
    """A module's own learned position table: the child ``name``, its ``rows``, the
    ``usable`` positions (fewer than the rows when a padding row comes first: RoBERTa's
    positions start at ``padding_idx + 1``), its ``padding`` row, the config ``key``
    that sized it and the names of the holder's forward parameters (``params``)."""

    name: str
    rows: int
    usable: int
    padding: int | None
    key: str
    params: tuple[str, ...]


def _position_key(roots: Sequence[nn.Module], rows: int) -> str | None:
    """The one setting for positions, in the watched roots' configs, whose value is
    ``rows``; None for none or several."""
    keys = {
        key
        for root in roots
        for key, value in getattr(getattr(root, "config", None), "__dict__", {}).items()
        if type(value) is int and value == rows and _POSITION_KEY.search(key)
    }
    return keys.pop() if len(keys) == 1 else None


def _position_table(module: nn.Module, roots: Sequence[nn.Module]) -> _PositionTable | None:
    """The position table ``module`` holds as a child, when exactly one of its child
    ``nn.Embedding`` tables has as many rows as a watched model's config setting for
    positions (``max_position_embeddings``); None otherwise (a table of another size, a
    module without a config: the embedding guard checks the position ids themselves)."""
    if isinstance(module, nn.Embedding):
        return None
    found = []
    for name, child in module.named_children():
        if type(child) is not nn.Embedding or child.num_embeddings < 2:
            continue
        key = _position_key(roots, child.num_embeddings)
        if key is not None:
            found.append((name, child, key))
    if len(found) != 1:
        return None
    name, child, key = found[0]
    rows, pad = int(child.num_embeddings), child.padding_idx
    padded = isinstance(pad, int) and 0 <= pad < rows - 1
    try:
        params = tuple(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return None
    return _PositionTable(
        name=name,
        rows=rows,
        usable=rows - pad - 1 if padded and pad is not None else rows,
        padding=pad if padded else None,
        key=key,
        params=params,
    )


def _make_position_hook(
    watcher: Watcher, health: _Health, owner: nn.Module, path: str, table: _PositionTable
) -> Callable[..., None]:
    """The pre-hook of a module that holds a position table (see :func:`_position_table`):
    token ids longer than its positions stop the call before any kernel runs (a position
    past the table is a device-side assert on a GPU, where the positions are made inside
    the forward and first index a buffer: RoBERTa's ``torch.gather``). Shapes only, no
    device read, except when the table has a padding row and the ids are too long: then
    one read counts each row's ids that are not padding, which are what get positions."""
    ref = weakref.ref(owner)

    def position_pre_hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> None:
        if _compiling() or kwargs is None or module is not ref():
            return
        if health.broken or _quiet(watcher):
            return
        try:
            _check_positions(
                watcher, module=module, path=path, table=table, args=args, kwargs=kwargs
            )
        except GuardError:
            raise
        except Exception as exc:  # nanwatch must never break the training it watches
            health.fault("the position-table guard", exc)

    return position_pre_hook


def _check_positions(
    watcher: Watcher,
    *,
    module: nn.Module,
    path: str,
    table: _PositionTable,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    bound = dict(zip(table.params, args, strict=False))
    bound.update(kwargs)
    if any("position" in name and isinstance(v, torch.Tensor) for name, v in bound.items()) or any(
        isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 3
        for v in bound.values()
    ):
        return  # the caller's own positions, or embeddings given: nothing to count from ids
    ids = [
        (name, v)
        for name, v in bound.items()
        if isinstance(v, torch.Tensor)
        and v.dim() >= 2
        and not v.is_floating_point()
        and not v.is_complex()
        and v.dtype is not torch.bool
    ]
    if not ids:
        return
    arg, x = max(ids, key=lambda item: item[1].shape[-1])
    length = int(x.shape[-1])
    if length <= table.usable:
        return
    need = length
    if table.padding is not None:
        if not _readable(x):
            return
        with torch.no_grad(), torch._C.DisableTorchFunction():
            need = int((x != table.padding).sum(-1).max().item())
        if need <= table.usable:
            return
    if "NW513" in watcher.config.ignore:
        return
    frame = _frames.user_frame(sys._getframe(2))
    cls_name = type(module).__name__
    where = f"{path}.{table.name}" if path else table.name
    counted = (
        f"a row of {need} tokens besides padding (id {table.padding})"
        if table.padding is not None
        else f"{length} tokens"
    )
    size = (
        f"{table.rows} rows but {table.usable} positions (padding_idx={table.padding}: "
        f"positions start at {table.padding + 1})"
        if table.padding is not None
        else f"{table.rows} positions"
    )
    usable = table.usable
    failure = _Failure(
        code="NW513",
        check="positions",
        problem=(
            f"{arg} {_shape(x)} has {counted}, but {where} (Embedding) has {size} "
            f"(config.{table.key}={table.rows}): the sequence is longer than the model's "
            "position table"
        ),
        expected=f"at most {usable} tokens",
        fix=(
            f"truncate the inputs to {usable} tokens (tokenizer(..., truncation=True, "
            f"max_length={usable})), or slice the batch: {arg}[:, :{usable}] (and its "
            f"attention_mask and labels alike); longer inputs need a model built with "
            f"{table.key} >= {need + table.rows - usable} (a pretrained model's is fixed)"
        ),
        explanation=(
            "A learned position table has one row per position: each token past its last "
            "row has a position the model cannot look up (an index error, or a shape error "
            "where the model slices a buffer of positions; on a GPU, a device-side assert "
            "that kills the CUDA context)."
        ),
        count=max(need - usable, 0),
        total=need,
    )
    source = _source(frame) if frame is not None else None
    line = (
        linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip() or None
        if frame is not None
        else None
    )
    note = watcher.note(
        "guard",
        path,
        source=source,
        code=failure.code,
        check=failure.check,
        loss=cls_name,
        problem=failure.problem,
        expected=failure.expected,
        fix=failure.fix,
        explanation=failure.explanation,
        values=[],
        counts=[],
        count=failure.count,
        total=failure.total,
        positions=[],
        positions_in=None,
        source_line=line,
        raised=True,
        on_anomaly=watcher.config.on_anomaly,
    )
    torch_error = _torch_error(watcher, bound, lambda: module.forward(*args, **kwargs))
    err = _error(note, failure, watcher.step_index, is_module=True, torch_error=torch_error)
    err._nanwatch_owner = id(watcher)  # type: ignore[attr-defined]  # nested watchers
    raise err


def _make_early_hook(
    watcher: Watcher, health: _Health, binding: _ModuleBinding, path: str, owner: nn.Module
) -> Callable[..., None]:
    """The pre-hook that runs before the watcher's (see :func:`attach`): the guard's NW519
    check, only when the input's autograd node says a term without gradients was added to
    it (no read otherwise)."""
    guard = _make_pre_hook(watcher, health, binding, path, owner, early=True)
    name = binding.spec.input

    def nograd_pre_hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> None:
        if _compiling():  # no grad_fn to read under dynamo (a read would break the graph)
            return
        if kwargs is None:
            return  # a copy on a replacement module (see _make_pre_hook)
        x = args[0] if args else kwargs.get(name)
        if isinstance(x, torch.Tensor) and _nograd_add(x) is not None:
            guard(module, args, kwargs)

    return nograd_pre_hook


def _compiled_children(
    watcher: Watcher, modules: Sequence[tuple[nn.Module, str]]
) -> list[tuple[nn.Module, str]]:
    """The ``torch.compile`` wrappers of the watched roots' submodules (sentinel mode runs
    them compiled) that hold a guarded module, or call guarded functionals, each with the
    path its eager module is watched under."""
    from nanwatch.watcher import _is_compiled

    paths = {id(m): p for m, p in modules}
    out: list[tuple[nn.Module, str]] = []
    seen: set[int] = set()
    functional = watcher.config.functional_guards
    for root in watcher.roots:
        for _, m in root.named_modules():
            if id(m) in seen or not _is_compiled(m):
                continue
            seen.add(id(m))
            orig: nn.Module = m._orig_mod
            path = paths.get(id(orig))
            if path is None:
                continue
            if functional or any(spec_for(type(sub)) is not None for sub in orig.modules()):
                out.append((m, path))
    return out


def _make_compiled_hooks(
    watcher: Watcher, health: _Health, wrapper: nn.Module, path: str
) -> tuple[Callable[..., None], Callable[..., None]]:
    """The hooks on a compiled child's wrapper, which run in eager mode around the compiled
    call: the pre-hook keeps the call's inputs (references, no read) until the call ends;
    when the call raises, the forward hook explains the error (see :func:`_explain_compiled`)
    and the error goes on unchanged. A guard cannot run inside a compiled graph."""
    ref = weakref.ref(wrapper)
    calls = threading.local()

    def compiled_pre_hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> None:
        if _compiling() or kwargs is None or module is not ref():
            return
        stack: list[Any] | None = getattr(calls, "stack", None)
        if stack is None:
            stack = calls.stack = []
        # the error being handled as the call begins (a call made in an ``except`` block)
        stack.append((args, kwargs, sys.exc_info()[1]))

    def compiled_post_hook(module: nn.Module, args: tuple[Any, ...], *rest: Any) -> None:
        stack = getattr(calls, "stack", None)
        if _compiling() or not stack or module is not ref():
            return
        call_args, call_kwargs, handled = stack.pop()
        exc = sys.exc_info()[1]
        if rest[-1] is not None or exc is handled:
            return  # returned (always_call hooks run in torch's ``except`` when it raised)
        if not isinstance(exc, Exception) or health.broken or _quiet(watcher):
            return
        try:
            _explain_compiled(watcher, module, path, (call_args, call_kwargs), exc)
        except Exception as fault:  # the user's error is the one that matters
            health.fault("explanation of a compiled call", fault)

    return compiled_pre_hook, compiled_post_hook


def _explain_compiled(
    watcher: Watcher,
    wrapper: nn.Module,
    path: str,
    call: tuple[tuple[Any, ...], dict[str, Any]],
    exc: Exception,
) -> None:
    """The compiled call of ``wrapper`` (watched as ``path``) raised ``exc``, which goes on
    unchanged: its eager module runs again on the same inputs with the guards on (no
    gradient; RNG state and buffers put back), and a guard that stops a call there writes
    its ``"guard"`` note as if it had run in the compiled call, marked ``compiled``. Only
    on the CPU: on a GPU the error is an assert that left the device unusable, and a
    ``"compiled_call"`` note keeps what the host knows (the guarded modules inside, the
    tables' sizes, the integer inputs' dtypes and shapes) for the error's advice (see
    ``postmortem.step_advice``). ``call``: the call's positional and keyword arguments."""
    from nanwatch.errors import NanwatchError
    from nanwatch.postmortem import classify

    args, kwargs = call
    if isinstance(exc, NanwatchError):
        return  # a guard's own error: a functional one the graph called by name
    orig: nn.Module = wrapper._orig_mod  # type: ignore[assignment]
    tensors = [t for t in leaves([args, kwargs]) if isinstance(t, torch.Tensor)]
    if classify(exc)["device_lost"] or any(t.device.type != "cpu" for t in tensors):
        # no value can be read (a device-side assert kills the context; a GPU run is not
        # replayed): what is known on the host, for the error's advice
        guarded = [
            f"{path}.{q}" if q else path
            for q, m in orig.named_modules()
            if spec_for(type(m)) is not None
        ]
        sizes = [
            f"{type(m).__name__} {path}.{q}: {m.num_embeddings} rows"
            for q, m in orig.named_modules()
            if isinstance(getattr(m, "num_embeddings", None), int)
        ]
        ids = [
            f"{dtype_name(t.dtype)} {tuple(t.shape)}"
            for t in tensors
            if not (t.is_floating_point() or t.is_complex())
        ]
        watcher.note("compiled_call", path, guarded=guarded, sizes=sizes, ids=ids)
        return
    notes = watcher.trace.notes
    before = len(notes)
    outer = getattr(_tls, "explaining", None)
    _tls.explaining = watcher
    try:
        with (
            watcher.paused(),
            torch.no_grad(),
            ops.preserved_state(orig, set()),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            orig(*args, **kwargs)
    except Exception:  # a GuardError (its note is the explanation), or the error again
        pass
    finally:
        _tls.explaining = outer
    lines = str(exc).strip().splitlines()
    error = type(exc).__name__ + (f" ({lines[0].rstrip('.')})" if lines else "")
    for note in notes[before:]:
        if note.kind == "guard":
            note.data["raised"] = True
            note.data["compiled"] = path
            note.data["compiled_error"] = error


def _what(spec: GuardSpec) -> str:
    """``loss guard``, ``embedding guard``: which guard, in a fault's words."""
    if spec.kind != "index":
        return "loss guard"
    return "one_hot guard" if spec.name == "one_hot" else "embedding guard"


def _pop_hook(module: nn.Module, args: Any, *rest: Any) -> None:
    if _compiling():
        return
    stack = _module_stack()
    if stack and stack[-1] is module:
        stack.pop()
    if rest:
        _take_sign_tap(module, rest[-1])


# -- the sign of the gradient a per-element loss gets -------------------------------------
#: steps at which a per-element loss's gradient sign is checked: a weighting that makes some
#: terms rewards is there from the first step; later, a few steps now and then
_SIGN_FIRST, _SIGN_EVERY, _SIGN_RUN = 8, 100, 3
#: holds an entry once the check failed (an internal error): off for the process
_sign_off: list[bool] = []


@dataclass(frozen=True, eq=False)
class _SignTap:
    """A per-element loss call (``reduction="none"``) whose output gets a gradient hook:
    every term of these losses is >= 0, so the total's gradient on a term should be >= 0;
    a target value whose every term gets a negative one has its loss maximized, and so has
    the whole loss when every term does. A ``likelihood`` tap is a distribution's
    ``log_prob`` of data: its terms are to be maximized, so their gradients should be <= 0."""

    watcher: Watcher
    owner: nn.Module | None  #: the loss module, or None for a functional call
    path: str
    loss: str
    source: str | None
    classes: torch.Tensor  #: each term's target, rounded: 0 or 1 (all 0 but for binary)
    binary: bool = True  #: whether ``classes`` tells the target values apart
    likelihood: bool = False
    call: str | None = None  #: the source text of the call (``dist.log_prob(y)``)


def _sign_tap(
    watcher: Watcher,
    p: _Probe,
    path: str,
    source: str | None,
    module: nn.Module | None,
    *,
    call: str | None = None,
) -> _SignTap | None:
    """The tap for a per-element binary or class-index loss that trains something, on the
    steps the check runs; None otherwise (no cost). A class-index loss is told only when
    every term is maximized: a policy gradient weighs the cross-entropy of the actions it
    sampled by signed advantages, and an action that is always worse than the mean gets a
    negative weight every step, rightly (the rules read whether the target was sampled)."""
    if not _sign_step(watcher):
        return None
    t, x = p.target, p.input
    kind = p.spec.kind
    if kind not in ("binary", "class") or _reduction(p.bound) != "none" or t is None:
        return None
    if not x.requires_grad or not _readable(t):  # the output's own tells grad mode
        return None
    if kind == "binary" and (not t.is_floating_point() or t.shape != x.shape):
        return None
    if kind == "class" and (t.is_floating_point() or t.dim() != max(x.dim() - 1, 1)):
        return None  # class probabilities, or a target shape the output does not take
    return _SignTap(
        watcher=watcher,
        owner=module,
        path=path,
        loss=p.cls_name if p.is_module else p.spec.call,
        source=source,
        classes=(t >= 0.5).long() if kind == "binary" else torch.zeros_like(t, dtype=torch.long),
        binary=kind == "binary",
        call=call,
    )


def _sign_step(watcher: Watcher) -> bool:
    """Whether the gradient sign of per-element losses is checked at this step."""
    step = watcher.step_index
    return not _sign_off and not (step >= _SIGN_FIRST and step % _SIGN_EVERY >= _SIGN_RUN)


def _take_sign_tap(owner: nn.Module | None, out: Any) -> None:
    """After the guarded call: hook its output's gradient, when its guard left a tap."""
    tap: _SignTap | None = getattr(_tls, "sign_tap", None)
    if tap is None or tap.owner is not owner:
        return
    _tls.sign_tap = None
    if (
        isinstance(out, torch.Tensor)
        and out.requires_grad
        and out.shape == tap.classes.shape
        and not _compiling()
    ):
        hook = functools.partial(_sign_hook, tap)
        _keep(out.register_hook(hook))  # type: ignore[no-untyped-call]


def _sign_hook(tap: _SignTap, grad: torch.Tensor) -> None:
    """Count, per target value, the terms whose gradient has the wrong sign (negative; for
    a likelihood, positive): one read, a second only when some are. A ``"loss_sign"`` note
    when every term that got a gradient got the wrong sign (``flipped="all"``), or when
    every term of one target value did while the other got the right one."""
    try:
        with torch.no_grad(), torch._C.DisableTorchFunction():
            g = grad.reshape(-1)
            wrong = g > 0 if tap.likelihood else g < 0
            n_wrong = int(wrong.sum())
            if not n_wrong:
                return
            right = g < 0 if tap.likelihood else g > 0
            k = tap.classes.to(grad.device).reshape(-1)
            rows = torch.stack(
                [
                    torch.bincount(k, minlength=2),
                    torch.bincount(k[wrong], minlength=2),
                    torch.bincount(k[right], minlength=2),
                ]
            ).tolist()
        total, negs, poss = rows
        w = tap.watcher
        if len(w.trace.notes) >= _MAX_NOTES:
            return
        extra: dict[str, Any] = {"call": tap.call} if tap.call else {}
        if tap.likelihood:
            extra["likelihood"] = True
        if not any(poss):  # every term the total reached is pushed the wrong way
            w.note(
                "loss_sign",
                tap.path,
                source=tap.source,
                loss=tap.loss,
                flipped="all",
                flipped_terms=n_wrong,
                terms=sum(total),
                **extra,
            )
            return
        if not tap.binary or tap.likelihood:
            return
        flipped = [c for c in (0, 1) if total[c] and negs[c] == total[c]]
        if len(flipped) != 1 or not poss[1 - flipped[0]]:
            return  # no target value wholly maximized, or the other not minimized
        c = flipped[0]
        w.note(
            "loss_sign",
            tap.path,
            source=tap.source,
            loss=tap.loss,
            flipped=c,
            flipped_terms=total[c],
            trained=1 - c,
            terms=sum(total),
        )
    except Exception as exc:  # nanwatch must never break the training it watches
        _sign_off.append(True)
        _Health(tap.watcher).fault("loss sign check", exc)


# -- the log-likelihood of data: a distribution's log_prob --------------------------------
def _log_prob_classes() -> list[type]:
    """The classes of ``torch.distributions`` that define their own ``log_prob`` (a plain
    function: nothing else is wrapped)."""
    import torch.distributions as D

    out: list[type] = []
    for name in dir(D):
        cls = getattr(D, name)
        if (
            isinstance(cls, type)
            and issubclass(cls, D.Distribution)
            and isinstance(cls.__dict__.get("log_prob"), types.FunctionType)
            and cls not in out
        ):
            out.append(cls)
    return out


def _wrap_log_prob(
    original: Callable[..., Any], guards: Callable[[], list[FunctionalGuards]]
) -> Callable[..., Any]:
    """``original`` (a distribution's ``log_prob``), whose outermost call of a guarding
    thread taps the sign of the gradient its terms get (see :func:`_log_prob_tap`)."""

    @functools.wraps(original)
    def log_prob(self: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        if _compiling():
            return original(self, value, *args, **kwargs)
        caller = sys._getframe(1)
        # run from a copy of the caller's frame (see _as_caller): the ops inside keep the
        # user's line, and no frame of nanwatch sits between them and it
        call = _as_caller(caller)
        nested = getattr(_tls, "log_prob", False)
        _tls.log_prob = True
        try:
            out = call(original, (self, value, *args), kwargs)
        except BaseException as e:
            _skip_trampoline(e, call)
            raise
        finally:
            _tls.log_prob = nested
        if nested:
            return out  # Independent's log_prob calls its base's: the outer one is told
        me = threading.get_ident()
        for g in tuple(guards()):
            if g.thread == me:
                _log_prob_tap(g, self, value, out, caller)
                break
        return out

    log_prob._nanwatch_guard = True  # type: ignore[attr-defined]
    return log_prob


def _log_prob_tap(
    guards: FunctionalGuards, dist: Any, value: Any, out: Any, caller: types.FrameType
) -> None:
    """Hook the gradient of ``dist.log_prob(value)`` when ``value`` is data (no gradient
    reaches it: an observed label or a stored action, not a reparameterized sample) and the
    log-likelihood trains something, on the steps the sign check runs."""
    watcher = guards.watcher
    if guards.health.broken or _quiet(watcher) or not _sign_step(watcher):
        return
    if not isinstance(value, torch.Tensor) or value.requires_grad:
        return
    if not isinstance(out, torch.Tensor) or not out.requires_grad or not _readable(out):
        return
    if not out.is_floating_point() or out.numel() < 2:
        return
    try:
        frame = _frames.user_frame(caller)
        tap = _SignTap(
            watcher=watcher,
            owner=None,
            path=f"{type(dist).__name__}.log_prob",
            loss=f"{type(dist).__name__}.log_prob",
            source=_source(frame) if frame is not None else None,
            classes=torch.zeros(out.shape, dtype=torch.long, device=out.device),
            binary=False,
            likelihood=True,
            call=_frames.running_call(frame) if frame is not None else None,
        )
        _keep(out.register_hook(functools.partial(_sign_hook, tap)))  # type: ignore[no-untyped-call]
    except Exception as exc:  # nanwatch must never break the training it watches
        guards.health.fault("log_prob sign check", exc)


#: the sign hooks on tensors that may still be alive: removed with the last guard, so a
#: step that raised before its backward leaves none behind
_sign_handles: list[Any] = []


def _keep(handle: Any) -> None:
    """Hold ``handle`` (a tensor hook's) until the guards go; those of freed tensors go now."""
    _sign_handles[:] = [h for h in _sign_handles if h.hooks_dict_ref() is not None]
    _sign_handles.append(handle)


def _drop_sign_hooks() -> None:
    for h in _sign_handles:
        h.remove()
    _sign_handles.clear()


# ---------------------------------------------------------------------------- functional
class _FunctionalTap:
    """Wraps the guarded functionals of ``torch.nn.functional`` (``F.cross_entropy``,
    ``F.embedding``, ``F.one_hot``, ...) while at least one watcher guards them, and puts
    the originals back with the last one. Unlike a TorchFunctionMode, which runs Python for
    every torch call (3-4 µs each: a few percent of a small model's step, far more of a
    GPU step bound by launch overhead), it costs nothing outside the guarded calls.

    A name bound before the watcher was attached (``from torch.nn.functional import
    cross_entropy`` at import time) keeps the original function and is not guarded; the
    usual ``F.cross_entropy(...)`` and every nn module are."""

    def __init__(self) -> None:
        self._guards: list[FunctionalGuards] = []
        self._originals: dict[str, Callable[..., Any]] = {}
        self._log_probs: dict[type, Callable[..., Any]] = {}  #: each class's own log_prob
        self._lock = threading.Lock()

    def install(self, guards: FunctionalGuards) -> None:
        with self._lock:
            if not self._guards:
                for spec in _specs()[1].values():
                    original = getattr(F, spec.name, None)
                    if original is not spec.func:  # someone else wrapped it: leave it
                        continue
                    self._originals[spec.name] = original
                    setattr(F, spec.name, self._wrap(spec, original))
                for cls in _log_prob_classes():
                    own = cls.__dict__["log_prob"]
                    if getattr(own, "_nanwatch_guard", False):
                        continue
                    self._log_probs[cls] = own
                    cls.log_prob = _wrap_log_prob(own, lambda: self._guards)  # type: ignore[attr-defined]
            self._guards.append(guards)

    def remove(self, guards: FunctionalGuards) -> None:
        with self._lock:
            if guards not in self._guards:
                return
            self._guards.remove(guards)
            if self._guards:
                return
            for name, original in self._originals.items():
                if getattr(getattr(F, name, None), "_nanwatch_guard", False):
                    setattr(F, name, original)
            self._originals = {}
            for cls, own in self._log_probs.items():
                if getattr(cls.__dict__.get("log_prob"), "_nanwatch_guard", False):
                    cls.log_prob = own  # type: ignore[attr-defined]
            self._log_probs = {}
            _drop_sign_hooks()

    def _wrap(self, spec: GuardSpec, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            # constant under dynamo (the traced call is the original); a guarded functional
            # called by another (F.linear_cross_entropy -> F.cross_entropy) was checked
            if _compiling():
                return original(*args, **kwargs)
            caller = sys._getframe(1)
            call = _as_caller(caller)
            nested = getattr(_tls, "functional", False)
            if not nested:
                me = threading.get_ident()
                for g in tuple(self._guards):
                    if g.thread == me:
                        g.check(spec, args, kwargs, caller, original)
                _tls.functional = True
            try:
                out = call(original, args, kwargs)
            except BaseException as e:
                _skip_trampoline(e, call)
                raise
            finally:
                if not nested:
                    _tls.functional = False
            if not nested:
                _take_sign_tap(None, out)
            return out

        guarded._nanwatch_guard = True  # type: ignore[attr-defined]
        return guarded


_functional_tap = _FunctionalTap()

#: ``fn(*args, **kwargs)`` in one frame: copied per call site with the caller's file, line
#: and globals, so that a warning torch raises inside the original functional with
#: ``stacklevel=2`` (F.mse_loss's "Using a target size ...") names the user's line and goes
#: through the user's module's filters and registry, not ``guards.py``. Catching the
#: warnings instead (``warnings.catch_warnings``) would cost microseconds a call, swap the
#: process-wide filters under other threads, and reset every ``__warningregistry__`` (a
#: "default" warning would repeat each step).
_TRAMPOLINE = (lambda fn, args, kwargs: fn(*args, **kwargs)).__code__
_callers: dict[tuple[int, int], tuple[types.CodeType, Callable[..., Any]]] = {}


def _as_caller(frame: types.FrameType) -> Callable[..., Any]:
    """The trampoline for the call ``frame`` is making now, cached per code object and
    instruction (keyed by id, checked by identity: hashing a code object reads all of it)."""
    code = frame.f_code
    hit = _callers.get((id(code), frame.f_lasti))
    if hit is not None and hit[0] is code:
        return hit[1]
    if len(_callers) >= 4096:  # code made at run time (exec, lambdas): bounded
        _callers.clear()
    tramp = _TRAMPOLINE.replace(
        co_filename=code.co_filename, co_firstlineno=frame.f_lineno, co_name=code.co_name
    )
    fn = types.FunctionType(tramp, frame.f_globals)
    _callers[(id(code), frame.f_lasti)] = (code, fn)
    return fn


def _skip_trampoline(e: BaseException, call: Callable[..., Any]) -> None:
    """Leave the trampoline out of an error's traceback: it would repeat the user's line."""
    tb = e.__traceback__
    nxt = tb.tb_next if tb is not None else None
    if tb is not None and nxt is not None and nxt.tb_frame.f_code is call.__code__:
        tb.tb_next = nxt.tb_next


class FunctionalGuards:
    """Guards functional losses (``F.cross_entropy(...)``), ``F.embedding``,
    ``F.embedding_bag`` and ``F.one_hot`` called in the attaching thread while active.
    Calls made by a guarded module are not checked twice.

    Example:
        >>> from nanwatch import watch
        >>> nw = watch(nn.Linear(2, 2), postmortem=False, functional_guards=False).attach()
        >>> with FunctionalGuards(nw):
        ...     _ = F.mse_loss(torch.zeros(3), torch.ones(3))
        >>> nw.trace.notes[-1].path
        'F.mse_loss'
        >>> nw.detach()
    """

    def __init__(self, watcher: Watcher) -> None:
        self.watcher = watcher
        self.thread = threading.get_ident()
        self.health = _Health(watcher)
        self._active = False

    def __enter__(self) -> FunctionalGuards:
        if self._active:
            raise RuntimeError("FunctionalGuards is already active")
        self.thread = threading.get_ident()
        _functional_tap.install(self)
        self._active = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._active = False
        _functional_tap.remove(self)

    def check(
        self,
        spec: GuardSpec,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        caller: Any,
        original: Callable[..., Any] | None = None,
    ) -> None:
        """Check one call of a guarded functional; ``caller``: the frame that made it;
        ``original``: the functional itself."""
        watcher = self.watcher
        if self.health.broken or _quiet(watcher):
            return
        stack = getattr(_tls, "modules", None)
        if stack:
            return  # inside a guarded module its pre-hook already checked
        try:
            bound = _bind_functional(spec, args, kwargs)
            owner = _torch_loss_module(caller, spec)
            user = _frames.user_frame(caller)
            if owner is not None and user is not None and _call_site(caller) is user:
                # torch's nn.CrossEntropyLoss (a loss module the user did not hand to
                # watch()), called by the user's own line, made the call: checked and worded
                # as that module's call there, criterion(out, y), not as the F call inside
                # it (a library's loss, transformers', keeps the functional's wording)
                module, names = owner
                _guard(
                    watcher,
                    spec,
                    bound,
                    path=type(module).__name__,
                    cls_name=type(module).__name__,
                    is_module=True,
                    frame=user,
                    order=names,
                    kw_names={},
                    module=module,
                    call=None if original is None else lambda: original(*args, **kwargs),
                    site=_call_site(caller),
                )
                return
            _guard(
                watcher,
                spec,
                bound,
                path=spec.call,
                cls_name=spec.call,
                is_module=False,
                frame=_frames.user_frame(caller),
                order=spec.positional[: len(args)],
                kw_names={k: k for k in kwargs},
                call=None if original is None else lambda: original(*args, **kwargs),
                site=_call_site(caller),
            )
        except GuardError:
            raise
        except Exception as exc:
            self.health.fault(f"functional {_what(spec)}", exc)
