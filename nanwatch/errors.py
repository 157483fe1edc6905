"""The exceptions nanwatch raises. One base class, attributes a program can read."""

from __future__ import annotations

import copyreg
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanwatch.records import Anomaly


class NanwatchError(Exception):
    """Base class of every error nanwatch raises on purpose."""


NanwatchError.__module__ = "nanwatch"


class ConfigError(NanwatchError, ValueError):
    """A bad argument to :func:`nanwatch.watch` or :class:`nanwatch.WatchConfig`.

    ``.name`` is the argument, ``.value`` the value that was given.
    """

    def __init__(self, name: str, value: Any, message: str) -> None:
        super().__init__(message)
        self.name = name
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        # the default (cls(*args)) would call __init__ with the message alone
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


ConfigError.__module__ = "nanwatch"


class AnomalyError(NanwatchError):
    """Raised by ``on_anomaly="raise"`` at the point an anomaly is known.

    ``.anomaly`` is the localized :class:`~nanwatch.Anomaly` (or ``None`` when an
    error-severity diagnosis fired without a non-finite value), ``.diagnoses`` the
    diagnoses of that step, ``.diagnosis`` the top one, ``.module`` the module path.
    """

    def __init__(
        self, message: str, *, anomaly: Anomaly | None, diagnoses: list[Any] | None = None
    ) -> None:
        super().__init__(message)
        self.anomaly = anomaly
        self.diagnoses = list(diagnoses or [])

    def __reduce__(self) -> tuple[Any, ...]:
        # the default (cls(*args)) would miss the keyword-only ``anomaly``
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))

    @property
    def diagnosis(self) -> Any:
        return self.diagnoses[0] if self.diagnoses else None

    @property
    def module(self) -> str | None:
        if self.anomaly is not None:
            return self.anomaly.path
        d = self.diagnosis
        return getattr(d, "path", None) if d is not None else None


AnomalyError.__module__ = "nanwatch"


class ReportFormatError(NanwatchError, ValueError):
    """A saved report that this version of nanwatch cannot read."""


ReportFormatError.__module__ = "nanwatch"


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    """Unpickle an exception whose ``__init__`` takes more than its message."""
    err = cls.__new__(cls, *args)
    err.args = args
    err.__dict__.update(state)
    return err


class _GuardErrorType(type):
    """The metaclass of GuardError: a GuardError made on demand to also be torch's error type
    (:func:`guard_error_class`) pickles as that call, so another process (a DataLoader
    worker's main process, a multiprocessing pool) rebuilds the same class by its base."""


def _reduce_guard_error_type(cls: _GuardErrorType) -> Any:
    base = cls.__dict__.get("torch_error_type")
    if base is not None and _GUARD_CLASSES.get(base) is cls:
        return (guard_error_class, (base,))
    return cls.__qualname__  # a class defined in a module: by reference, as usual


class GuardError(NanwatchError, ValueError, metaclass=_GuardErrorType):
    """A loss or embedding input that would fail or silently go wrong, caught before the
    kernel ran.

    Raised by nanwatch's guards (``watch(..., guards=True)``, the default) instead of
    PyTorch's own error, which on a GPU is an unreadable ``device-side assert`` that kills
    the CUDA context. Everything in the message is also an attribute:

    * ``.loss``: the guarded class (``"CrossEntropyLoss"``, ``"Embedding"``) or functional
      call (``"F.cross_entropy"``, ``"F.embedding"``); ``.path``: its module path, or the
      functional call; ``.module``: the module path (``None`` for a functional call);
    * ``.source``: the user's line (``"train.py:42"``), ``.source_line``: its text;
    * ``.check``: which check failed (``"target-range"``, ``"index-range"``), ``.code``:
      its diagnosis code (``"NW501"``, ``"NW513"``);
    * ``.values``, ``.counts``: the offending values, most frequent first, and how often each
      occurs; ``.count``: offending elements in all, ``.total``: elements checked;
      ``.positions``: the first few offending positions (index tuples into the tensor);
    * ``.expected``: what the call accepts (``"0..99"``); ``.fix``: code to paste;
    * ``.diagnosis``: the same finding as a :class:`nanwatch.Diagnosis`.

    On the CPU, where torch's own check raises cleanly, the guard runs the call to learn
    that error, and the GuardError raised is also an instance of its type (an
    ``IndexError`` for a class target or an embedding index out of range): code that
    catches torch's error to skip a bad batch keeps working under nanwatch.
    ``.torch_error_type`` is that type (``None`` when torch would not have raised: a
    silently wrong call, or a GPU, where the call is not run).

    Example:
        >>> import torch
        >>> from nanwatch import watch
        >>> criterion = torch.nn.CrossEntropyLoss()
        >>> logits, target = torch.randn(4, 3), torch.tensor([0, 2, 255, 1])
        >>> try:
        ...     with watch(criterion, on_anomaly="record", postmortem=False):
        ...         criterion(logits, target)
        ... except GuardError as err:
        ...     print(err.check, err.values, err.counts, err.fix)
        target-range (255,) (1,) nn.CrossEntropyLoss(ignore_index=255)
    """

    #: the exception type torch raises for the stopped call, when this error is one too
    torch_error_type: type[BaseException] | None = None

    def __init__(
        self,
        message: str,
        *,
        loss: str = "",
        path: str = "",
        check: str = "",
        code: str = "",
        module: str | None = None,
        source: str | None = None,
        source_line: str | None = None,
        values: tuple[Any, ...] = (),
        counts: tuple[int, ...] = (),
        count: int = 0,
        total: int = 0,
        positions: tuple[tuple[int, ...], ...] = (),
        expected: str = "",
        fix: str = "",
        diagnosis: Any = None,
    ) -> None:
        super().__init__(message)
        self.loss = loss
        self.path = path
        self.check = check
        self.code = code
        self.module = module
        self.source = source
        self.source_line = source_line
        self.values = values
        self.counts = counts
        self.count = count
        self.total = total
        self.positions = positions
        self.expected = expected
        self.fix = fix
        self.diagnosis = diagnosis

    @property
    def where(self) -> str:
        """The loss and the user's line: ``"criterion (CrossEntropyLoss) at train.py:42"``."""
        if self.module is not None and self.module != self.loss:
            text = f"{self.module} ({self.loss})"
        else:
            text = self.loss or self.path
        return f"{text} at {self.source}" if self.source else text

    def __reduce__(self) -> tuple[Any, ...]:
        # keyword-only attributes survive pickling (multiprocessing, saved post-mortems);
        # a GuardError raised as torch's error type too keeps that type
        base = type(self).torch_error_type
        return (
            _rebuild_guard_error,
            (self.args[0] if self.args else "", dict(self.__dict__), base),
        )


GuardError.__module__ = "nanwatch"

_GUARD_CLASSES: dict[type, type[GuardError]] = {}


def guard_error_class(torch_error: type[BaseException]) -> type[GuardError]:
    """GuardError that is also ``torch_error``, the exception torch raises for the call a
    guard stopped (``IndexError`` for a target or an index out of range on the CPU): code
    written to catch torch's error (``except IndexError:`` to skip a bad batch) catches
    it as it would without nanwatch. Plain GuardError when the two cannot be combined.

    Example:
        >>> cls = guard_error_class(IndexError)
        >>> issubclass(cls, GuardError) and issubclass(cls, IndexError)
        True
    """
    if issubclass(GuardError, torch_error) or not issubclass(torch_error, Exception):
        return GuardError
    cls = _GUARD_CLASSES.get(torch_error)
    if cls is None:
        try:
            cls = type("GuardError", (GuardError, torch_error), {})
        except TypeError:  # an exception type with its own layout (OSError): no mix
            cls = GuardError
        else:
            cls.__module__ = "nanwatch"
            cls.__doc__ = GuardError.__doc__
            cls.torch_error_type = torch_error
        _GUARD_CLASSES[torch_error] = cls
    return cls


copyreg.pickle(_GuardErrorType, _reduce_guard_error_type)


def _rebuild_guard_error(
    message: str, state: dict[str, Any], base: type[BaseException] | None = None
) -> GuardError:
    cls = guard_error_class(base) if base is not None else GuardError
    err = cls(message)
    err.__dict__.update(state)
    return err


class NanwatchWarning(RuntimeWarning):
    """An early warning: a diagnosis of ``warning`` severity (overflow headroom nearly gone,
    logits growing toward the exp bound, a softmax fed to CrossEntropyLoss, ...), issued
    once per code and watcher, pointing at your line. Silence one code with
    ``watch(..., ignore=["NW103"])``, all of them with
    ``warnings.filterwarnings("ignore", category=nanwatch.NanwatchWarning)``;
    ``on_anomaly="record"`` issues none of these. The notices of what nanwatch cannot watch
    (a model run under ``torch.compile``, a CUDA graph capture, a module output of a type
    it cannot look into) are NanwatchWarnings too, issued once, in every mode: the same
    filter silences them. nanwatch's own internal errors stay ``RuntimeWarning``.
    """


NanwatchWarning.__module__ = "nanwatch"
