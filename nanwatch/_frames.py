"""Finding the user's line: the innermost frame that is neither torch nor nanwatch itself."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import itertools
import linecache
import os
import re
import site
import sys
import sysconfig
import types
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_NANWATCH_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# The scenario gallery lives inside the package but is user code: its lines are the answer.
_USER_INSIDE = (os.path.join(_NANWATCH_DIR, "scenarios") + os.sep,)
_SKIP_PREFIXES = (_TORCH_DIR, _NANWATCH_DIR)
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep
#: files of the frames that launched the code being watched (``nanwatch run``'s console
#: script, a ``python -c`` or test that called it): never the user's line while it runs.
_launchers: Counter[str] = Counter()


@functools.cache
def _framework_dirs() -> tuple[str, ...]:
    """Training frameworks call the user's code: their frames are not the user's line
    (found without importing them), nor are the frames of nanwatch's own callbacks."""
    dirs: list[str] = []
    # nanwatch.callbacks: inside the package in a wheel, but the repository's callbacks/
    # folder in an editable install
    for name in (
        "nanwatch.callbacks",
        "lightning",
        "pytorch_lightning",
        "lightning_fabric",
        "lightning_utilities",
    ):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(os.path.join(d, "") for d in spec.submodule_search_locations)
    return tuple(dirs)


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """Where installed packages live: the environment's ``site-packages`` (``purelib``,
    ``platlib``), the system's and the user's."""
    dirs: set[str] = set()
    paths = sysconfig.get_paths()
    for key in ("purelib", "platlib"):
        if paths.get(key):
            dirs.add(paths[key])
    with contextlib.suppress(AttributeError):  # site of an embedded or old virtualenv
        dirs.update(site.getsitepackages())
    with contextlib.suppress(AttributeError):
        dirs.add(site.getusersitepackages())
    return tuple(sorted(os.path.join(os.path.realpath(d), "") for d in dirs if d))


_LIBRARY_PARTS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


@functools.lru_cache(maxsize=4096)
def _in_library(filename: str) -> bool:
    """Whether ``filename`` belongs to an installed third-party package: code the user runs
    but does not edit (an editable install of their own project lives in its own folder)."""
    if any(part in filename for part in _LIBRARY_PARTS):
        return True
    return filename.startswith(_library_dirs()) or (
        os.path.isabs(filename) and os.path.realpath(filename).startswith(_library_dirs())
    )


def is_internal(filename: str) -> bool:
    """Whether a frame of ``filename`` is not the user's line: torch, nanwatch, the
    training frameworks, the standard library, an installed package (``transformers``'
    ``modeling_bert.py``: the user's line is the call into it), or what launched the run."""
    if filename.startswith(_USER_INSIDE):
        return False
    if _launchers and filename in _launchers:
        return True
    if filename.startswith(_SKIP_PREFIXES) or filename.startswith(_framework_dirs()):
        return True
    if filename.startswith("<"):  # <frozen ...>, <string>
        return True
    return filename.startswith(_STDLIB_DIR) or _in_library(filename)


def is_core(filename: str) -> bool:
    """Whether ``filename`` is the standard library's, torch's or nanwatch's own (not the
    scenario gallery's)."""
    if filename.startswith(_USER_INSIDE):
        return False
    if filename.startswith(_SKIP_PREFIXES):
        return True
    return filename.startswith(_STDLIB_DIR) and "site-packages" not in filename


@functools.cache
def _own_dirs() -> tuple[str, ...]:
    """nanwatch's own code: the package (not the scenario gallery) and its callbacks (the
    repository's callbacks/ folder in an editable install)."""
    dirs = [_NANWATCH_DIR]
    try:
        spec = importlib.util.find_spec("nanwatch.callbacks")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        dirs.extend(os.path.join(d, "") for d in spec.submodule_search_locations)
    return tuple(dirs)


def hide_own_frames(exc: BaseException | None) -> None:
    """Leave nanwatch's own frames (its hooks, its wrapper of ``backward``, the step end
    that raised) out of the traceback of its own :class:`~nanwatch.AnomalyError`, as
    pytest hides its frames: the traceback Python prints then runs from the user's line
    through torch's frames to where the hook ran. The frames before the first frame of
    another file (``nanwatch run``'s launcher, which calls the script) stay. Any other
    exception, the user's own, is left as it is."""
    from nanwatch.errors import AnomalyError

    if not isinstance(exc, AnomalyError):
        return
    try:
        kept: list[types.TracebackType] = []
        outside = False  # a frame of another file seen: nanwatch's frames from here on go
        tb = exc.__traceback__
        while tb is not None:
            name = tb.tb_frame.f_code.co_filename
            own = name.startswith(_own_dirs()) and not name.startswith(_USER_INSIDE)
            if not own or not outside:
                kept.append(tb)
            outside = outside or not own
            tb = tb.tb_next
        if not outside:  # raised by nanwatch's code called from the user's (nw.step())
            kept = []
        for i, t in enumerate(kept):
            after = kept[i + 1] if i + 1 < len(kept) else None
            if t.tb_next is not after:
                t.tb_next = after
        exc.__traceback__ = kept[0] if kept else None
    except Exception:  # never in the way of the user's run
        pass


@contextlib.contextmanager
def launched_here() -> Iterator[None]:
    """While the body runs, the frames that called it are nanwatch's launcher, not the
    user's code: ``nanwatch run`` runs a script from its console script (a file in the
    environment's ``bin/``), ``python -m nanwatch`` or any caller of ``cli.main``; a stack
    that reaches past the script (an autograd node made at module level, a warning raised
    outside any user frame) must not name them."""
    files: list[str] = []
    f: types.FrameType | None = sys._getframe(2)  # above contextlib's __enter__
    while f is not None:
        files.append(f.f_code.co_filename)
        f = f.f_back
    _launchers.update(files)
    try:
        yield
    finally:
        _launchers.subtract(files)
        for name in files:
            if _launchers[name] <= 0:
                del _launchers[name]


def user_frame(start: types.FrameType | None = None) -> types.FrameType | None:
    """The innermost frame of user code above ``start`` (default: the caller)."""
    f: types.FrameType | None = start if start is not None else sys._getframe(1)
    while f is not None:
        if not is_internal(f.f_code.co_filename):
            return f
        f = f.f_back
    return None


def user_frame_within(floor: types.FrameType | None) -> types.FrameType | None:
    """:func:`user_frame` of the caller, looked for only below ``floor`` (a frame of
    nanwatch that runs code again: a replay): a user frame above it ran the replay, not
    the code (a torch module's forward has no user line; the next module's call that
    triggered the replay is not it). None then."""
    f: types.FrameType | None = sys._getframe(1)
    while f is not None:
        if f is floor:
            return None
        if not is_internal(f.f_code.co_filename):
            return f
        f = f.f_back
    return None


def framework_between(start: types.FrameType | None = None) -> bool:
    """Whether a training framework's frame (Lightning's) lies between ``start`` (default:
    the caller) and the user's line: the framework made the call (its ``backward()``), and
    the user's line is what called the framework (``trainer.fit(...)``)."""
    f: types.FrameType | None = start if start is not None else sys._getframe(1)
    frameworks = _framework_dirs()
    while f is not None:
        name = f.f_code.co_filename
        if not is_internal(name):
            return False
        if name.startswith(frameworks) and not name.startswith(_NANWATCH_DIR):
            return True
        f = f.f_back
    return False


_OPS_FILE = os.path.join(_NANWATCH_DIR, "ops.py")
#: nanwatch's wrappers of the user's own calls: what runs under them is the user's work
#: (``loss.backward()`` through the backward tap, ``F.cross_entropy`` through its guard,
#: ``scaler.scale(loss)`` through the scaler tap)
_WRAPPERS = frozenset({"_tapped", "guarded", "scale"})


def called_by_nanwatch(start: types.FrameType | None = None) -> bool:
    """Whether the innermost code above ``start`` that is not torch's is nanwatch's own
    (its statistics, run from a hook), not the user's: what an op checker must not report.
    The checker's own frames (``ops.py``) are passed over; a module re-run by
    :func:`nanwatch.ops.replay` (torch's ``nn.RNN`` as much as the user's code) and what
    nanwatch's wrappers of the user's calls run are the user's."""
    f: types.FrameType | None = start if start is not None else sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(_USER_INSIDE):
            return False
        if name.startswith(_NANWATCH_DIR):
            if name != _OPS_FILE:
                return f.f_code.co_name not in _WRAPPERS
            if f.f_code.co_name == "replay":  # a module's forward, run again: its ops
                return False
        elif not name.startswith(_TORCH_DIR):
            return False
        f = f.f_back
    return False


_OPTIM_DIR = os.path.join(_TORCH_DIR, "optim", "")


def in_optimizer_step(start: types.FrameType | None = None) -> bool:
    """Whether the code above ``start`` (default: the caller) is an optimizer's own
    arithmetic: a frame of ``torch.optim`` (LBFGS's line search, Adam's update) or of the
    ``step`` of a ``torch.optim.Optimizer`` (a third-party or hand-written one) lies between
    it and the user's line. A closure the optimizer calls (LBFGS) is the user's line: what
    it runs is the model's and the loss code's."""
    f: types.FrameType | None = start if start is not None else sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(_OPTIM_DIR):
            return True
        if f.f_code.co_name == "step" and isinstance(f.f_locals.get("self"), torch.optim.Optimizer):
            return True
        if not is_internal(name):
            return False
        f = f.f_back
    return False


_CHECKPOINT_FILE = os.path.join(_TORCH_DIR, "utils", "checkpoint.py")


def in_checkpoint(start: types.FrameType, depth: int = 64) -> bool:
    """Whether ``torch.utils.checkpoint`` is on the stack above ``start``: a reentrant
    checkpoint runs its first pass under ``no_grad``, and those calls are the training
    step's, not an evaluation's."""
    f: types.FrameType | None = start
    while f is not None and depth > 0:
        if f.f_code.co_filename == _CHECKPOINT_FILE:
            return True
        f, depth = f.f_back, depth - 1
    return False


def call_kwargs(module: object, start: types.FrameType) -> dict[str, object]:
    """The keyword arguments of the ``Module.__call__`` running ``module``, read from its
    frame (``start`` is a global forward pre-hook's caller): torch gives such hooks the
    positional arguments alone, and a root called ``model(input_ids=..., inputs_embeds=...)``
    takes its data by keyword. Empty when the frame is not that call."""
    f: types.FrameType | None = start
    for _ in range(2):  # _call_impl, or the _wrapped_call_impl above it
        if f is None or not f.f_code.co_filename.startswith(_TORCH_DIR):
            return {}
        local = f.f_locals
        if local.get("self") is module:
            kwargs = local.get("kwargs")
            return kwargs if isinstance(kwargs, dict) else {}
        f = f.f_back
    return {}


class CodeLine(str):
    """A line of the user's source, stripped, that also knows which part of it the frame
    was running (``span``: its columns in the stripped text, Python 3.11's instruction
    positions): of ``torch.sqrt(a) if ok else torch.sqrt(b)``, the second call. A plain
    ``str`` everywhere else (a report, JSON); the span is lost by any string operation."""

    span: tuple[int, int] | None

    def __new__(cls, text: str, span: tuple[int, int] | None = None) -> CodeLine:
        obj = super().__new__(cls, text)
        obj.span = span
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled as the plain string: a checkpoint that holds a report (the Lightning
        # callback's state) loads with torch.load(weights_only=True), which takes no class
        return (str, (str(self),))


def _running_span(f: types.FrameType, raw: str) -> tuple[int, int] | None:
    """The columns, in ``raw.strip()``, of the expression frame ``f`` is running (the call
    into torch that is on the stack), when it lies on the frame's line alone."""
    positions = getattr(f.f_code, "co_positions", None)
    if positions is None or f.f_lasti < 0:
        return None
    try:
        pos = next(itertools.islice(positions(), f.f_lasti // 2, None), None)
    except (ValueError, TypeError):
        return None
    if pos is None:
        return None
    line, end_line, col, end_col = pos
    if line != f.f_lineno or end_line != line or col is None or end_col is None:
        return None
    indent = len(raw) - len(raw.lstrip())
    # the offsets count UTF-8 bytes: an ASCII line is where they are characters
    if not raw.isascii() or col < indent or end_col <= col:
        return None
    return col - indent, end_col - indent


#: (id of a code object, instruction) -> (that code object, the text of the call it makes
#: there): the guards ask once per loss call site, not once per call
_CALL_TEXTS: dict[tuple[int, int], tuple[types.CodeType, str | None]] = {}


def running_call(f: types.FrameType) -> str | None:
    """The source text of the call frame ``f`` is making now (``nll(logits, y)`` of
    ``loss = 0.5 * mse(r, y2) + 0.5 * nll(logits, y)``), when it lies on the frame's line;
    None otherwise. Cached per code object and instruction (keyed by id, checked by
    identity)."""
    code = f.f_code
    key = (id(code), f.f_lasti)
    hit = _CALL_TEXTS.get(key)
    if hit is not None and hit[0] is code:
        return hit[1]
    raw = linecache.getline(code.co_filename, f.f_lineno).rstrip("\n")
    span = _running_span(f, raw) if raw.strip() else None
    text = raw.strip()[span[0] : span[1]] if span is not None else None
    if len(_CALL_TEXTS) >= 4096:  # code made at run time (exec, lambdas): bounded
        _CALL_TEXTS.clear()
    _CALL_TEXTS[key] = (code, text)
    return text


def describe_frame(f: types.FrameType | None) -> tuple[str | None, str | None]:
    """(``file.py:42``, the source text of that line) for a frame; the text is a
    :class:`CodeLine` that knows the span the frame was running."""
    if f is None:
        return None, None
    filename = f.f_code.co_filename
    raw = linecache.getline(filename, f.f_lineno).rstrip("\n")
    line = raw.strip()
    if not line:
        return f"{_short(filename)}:{f.f_lineno}", None
    return f"{_short(filename)}:{f.f_lineno}", CodeLine(line, _running_span(f, raw))


def describe_line(filename: str, lineno: int) -> tuple[str, str | None]:
    """(``file.py:42``, the source text of that line), as :func:`describe_frame` says it."""
    return f"{_short(filename)}:{lineno}", linecache.getline(filename, lineno).strip() or None


def user_line() -> tuple[str | None, str | None]:
    return describe_frame(user_frame(sys._getframe(1)))


def helper_call(f: types.FrameType | None, value: object) -> str | None:
    """``backward() called from train.py:22`` when ``f`` runs a function of the user's that
    was given ``value`` as an argument (``def backward(loss): loss.backward()`` in a utility
    module): the line that called it, which says which of the loop's calls it was. None for
    module-level code, or a function that made ``value`` itself."""
    if f is None:
        return None
    code = f.f_code
    if code.co_name.startswith("<") or not code.co_argcount:
        return None
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    local = f.f_locals
    if not any(local.get(n) is value for n in names):
        return None
    at, _ = describe_frame(user_frame(f.f_back))
    return f"{code.co_name}() called from {at}" if at else None


_TB_HEADER = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')


def user_line_from_traceback(lines: list[str] | str) -> tuple[str | None, str | None]:
    """The innermost user frame of a formatted stack (what anomaly mode stores on a node:
    ``traceback.format_stack()``, outermost first). A frame without source text (``<frozen
    runpy>``) is a header with no code line after it."""
    text = lines if isinstance(lines, str) else "".join(lines)
    rows = text.splitlines()
    best: tuple[str | None, str | None] = (None, None)
    for i, row in enumerate(rows):
        m = _TB_HEADER.match(row)
        if m is None:
            continue
        filename = m.group("file")
        if is_internal(filename):
            continue
        nxt = rows[i + 1] if i + 1 < len(rows) else ""
        code = nxt.strip() if _TB_HEADER.match(nxt) is None else ""
        lineno = int(m.group("line"))
        code = code or linecache.getline(filename, lineno).strip()
        best = (f"{_short(filename)}:{lineno}", code or None)
    return best


def _short(filename: str) -> str:
    """A path relative to the working directory when inside it, else as is; a notebook
    cell by the name IPython gives it (``In[4]``)."""
    cell = _notebook_cell(filename)
    if cell is not None:
        return cell
    inside = _inside(filename, os.getcwd())
    if inside is None:
        return filename
    rel, full = inside
    _claim(rel, full)
    return rel


@functools.lru_cache(maxsize=512)
def _inside(filename: str, cwd: str) -> tuple[str, str] | None:
    """(``filename`` relative to ``cwd``, its absolute path) when it lies inside ``cwd``;
    None otherwise. Cached: the guards name the loss call's line at every call."""
    try:
        rel = os.path.relpath(filename, cwd)
    except ValueError:
        return None
    if rel.startswith(".."):
        return None
    return rel, os.path.normpath(os.path.join(cwd, filename))


def _claim(rel: str, full: str) -> None:
    """Make the relative name ``rel`` mean the file ``full`` in ``linecache``, by which the
    rules later read the lines of the places nanwatch names. linecache keys its cache by
    the name as given and never looks again at a name it has read: a ``train.py`` read
    from another working directory earlier in the process (two scripts run by ``nanwatch
    run`` in one session, a test suite) would be read in place of this one. A dict look-up
    when the entry is right already; the file read once when it is not."""
    entry = linecache.cache.get(rel)
    if entry is not None and len(entry) == 4 and entry[3] == full:
        return
    linecache.getlines(full)
    got = linecache.cache.get(full)
    if got is not None:
        linecache.cache[rel] = got
    else:
        linecache.cache.pop(rel, None)


_NO_FRAME_REGISTRY: dict[str | tuple[str, type[Warning], int], int] = {}


def warn_at_user(
    message: str,
    category: type[Warning] = RuntimeWarning,
    *,
    safe: bool = False,
    where: str | None = None,
    detail: str | None = None,
) -> None:
    """A warning that points at the user's line, wherever inside hooks it is raised.

    ``safe``: for nanwatch's own faults, which must never stop training: when warnings are
    turned into errors (``-W error``), the message goes to stderr instead of raising, with
    ``detail`` after it (the traceback of nanwatch's own error, for its report).
    ``where``: ``file.py:42``, the line the warning is about (the loss call a diagnosis
    names), said instead of the line running now (``nw.step()``); also what is named when
    no user code is on the stack (a step ended by ``nanwatch run`` after the script
    returned). Never nanwatch's own line."""
    import warnings

    f = user_frame(sys._getframe(1))
    file, _, line = (where or "").rpartition(":")
    try:
        if f is None or (file and line.isdigit()):
            warnings.warn_explicit(
                message,
                category,
                file or "nanwatch",
                int(line) if file and line.isdigit() else 0,
                module=f.f_globals.get("__name__", "nanwatch") if f is not None else "nanwatch",
                registry=_NO_FRAME_REGISTRY,
            )
            return
        registry = f.f_globals.setdefault("__warningregistry__", {})
        warnings.warn_explicit(
            message,
            category,
            f.f_code.co_filename,
            f.f_lineno,
            module=f.f_globals.get("__name__", "nanwatch"),
            registry=registry,
        )
    except Warning:
        if not safe:
            raise
        sys.stderr.write(f"{message}\n" + (detail or ""))


def _notebook_cell(filename: str) -> str | None:
    """``In[4]`` for the file IPython compiled a notebook cell into, else None."""
    if "ipykernel_" not in filename and "<ipython-input" not in filename:
        return None
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None) if ipython is not None else None
    shell = get() if get is not None else None
    fmt = getattr(getattr(shell, "compile", None), "format_code_name", None)
    if fmt is None:
        return None
    try:
        named = fmt(filename)
    except Exception:
        return None
    return str(named[1]) if named else None
