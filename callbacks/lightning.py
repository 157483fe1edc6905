"""NanWatchCallback: nanwatch in a PyTorch Lightning ``Trainer``.

A thin adapter: it translates Lightning's events into :class:`nanwatch.Watcher` calls and
holds no diagnosis logic of its own. One callback class is built per Lightning namespace
(``lightning.pytorch`` and ``pytorch_lightning`` have different ``Callback`` classes); both
share the implementation below.

=============================  ==========================================================
Lightning event                what the callback does
=============================  ==========================================================
``setup("fit")``               build the Watcher; reports go to ``trainer.log_dir``
``setup`` (other stages)       nothing: validate, test and predict run unwatched
``on_train_start``             restore a checkpoint's summary; attach (GradScaler read)
``on_train_batch_start``       keep the batch, its index and the RNG state (for a replay)
``on_before_optimizer_step``   ``nw.check()`` (a new anomaly: replay the batch to pinpoint
                               the op); reduce the decision across ranks; then every rank
                               stops, skips, raises or warns
``on_after_backward``          the gradients are read at the step's check (sentinel
                               mode sees no backward of a submodule called alone)
``on_train_batch_end``         (accumulating: ``nw.check()``) ``nw.step(loss)``; say its
                               early warnings; log the step's figures; write the report
                               of a stop
``on_validation_start/end``    detach / attach again (validation is not a training step)
``on_validation_batch_start``  keep the batch and the RNG state (no hook)
``on_validation_batch_end``    read the returned and logged values (one host read); a
                               non-finite one: name its cause (a norm's running statistic,
                               a replay of the batch in eval mode), warn once per cause
                               ("raise": raise AnomalyError)
``on_train_end``, ``teardown`` write the report of a skip/warn run, or of one with early
                               warnings; detach
``on_exception``               post-mortem report (any crash), detach
``state_dict``                 the flight recorder's per-step summary and the counters
=============================  ==========================================================

Example:
    >>> from nanwatch.callbacks import NanWatchCallback            # doctest: +SKIP
    >>> trainer = Trainer(callbacks=[NanWatchCallback(on_anomaly="skip")])  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast, get_args

import torch

from nanwatch import ops
from nanwatch._frames import warn_at_user
from nanwatch.config import WatchConfig
from nanwatch.errors import AnomalyError, ConfigError, GuardError
from nanwatch.postmortem import write_report
from nanwatch.records import Anomaly, AnomalyKind, Phase, Record, StepTrace
from nanwatch.watcher import Watcher

if TYPE_CHECKING:
    from nanwatch.rules.base import Diagnosis

__all__ = [
    "ACTIONS",
    "NAMESPACES",
    "PIP_INSTALL",
    "callback_class",
    "default_namespace",
    "step_metrics",
]

_T = TypeVar("_T")
Action = Literal["stop", "skip", "raise", "warn"]
ACTIONS: tuple[str, ...] = get_args(Action)
#: the Lightning namespaces, in order of preference
NAMESPACES: tuple[str, ...] = ("lightning.pytorch", "pytorch_lightning")
PIP_INSTALL = 'pip install "nanwatch[lightning]"'
_ALIASES = {
    "lightning": "lightning.pytorch",
    "lightning.pytorch": "lightning.pytorch",
    "pytorch_lightning": "pytorch_lightning",
}
#: the module each namespace's class lives in (pickle finds it there: ddp_spawn)
_HOME = {
    "lightning.pytorch": "nanwatch.callbacks.lightning",
    "pytorch_lightning": "nanwatch.callbacks.pytorch_lightning",
}
#: how many anomalies a checkpoint keeps (the first, then the latest)
_KEPT_ANOMALIES = 32
_STATE_VERSION = 1


# ---------------------------------------------------------------------- namespaces
def _namespace(name: str) -> str:
    ns = _ALIASES.get(name)
    if ns is None:
        raise ConfigError(
            "namespace",
            name,
            f"`namespace` can be 'lightning.pytorch' or 'pytorch_lightning'; got {name!r}.",
        )
    return ns


def _missing(ns: str) -> ModuleNotFoundError:
    other = "pip install lightning" if ns == "lightning.pytorch" else PIP_INSTALL
    return ModuleNotFoundError(
        f"NanWatchCallback for {ns} needs {ns}, which is not installed. Install it with: {other}",
        name=ns,
    )


def _import(ns: str) -> ModuleType:
    try:
        return importlib.import_module(ns)
    except ModuleNotFoundError as exc:
        if exc.name is None or not ns.startswith(exc.name):
            raise  # Lightning is there but one of its own dependencies is not
        raise _missing(ns) from None


def _installed(ns: str) -> bool:
    top = ns.split(".", maxsplit=1)[0]
    if top in sys.modules:
        return sys.modules[top] is not None
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def default_namespace() -> str:
    """The namespace ``from nanwatch.callbacks import NanWatchCallback`` builds for: the one
    this program already imported (``lightning.pytorch`` when both are), else the one
    installed, preferring ``lightning.pytorch``.

    Example:
        >>> default_namespace() in NAMESPACES                          # doctest: +SKIP
        True
    """
    for ns in NAMESPACES:
        if sys.modules.get(ns) is not None:
            return ns
    for ns in NAMESPACES:
        if _installed(ns):
            return ns
    raise ModuleNotFoundError(
        "NanWatchCallback needs PyTorch Lightning (lightning.pytorch or pytorch_lightning), and "
        f"neither is installed. Install it with: {PIP_INSTALL}",
        name="pytorch_lightning",
    )


_CLASSES: dict[type, type[_NanWatch]] = {}


def callback_class(namespace: str | None = None) -> type[_NanWatch]:
    """The ``NanWatchCallback`` class for a Lightning namespace (``"lightning.pytorch"``,
    ``"pytorch_lightning"``; ``None``: :func:`default_namespace`). Built once per namespace;
    a missing namespace raises ``ModuleNotFoundError`` with the ``pip install`` line.

    Example:
        >>> PLCallback = callback_class("pytorch_lightning")          # doctest: +SKIP
        >>> pytorch_lightning.Trainer(callbacks=[PLCallback(on_anomaly="skip")])  # doctest: +SKIP
    """
    ns = default_namespace() if namespace is None else _namespace(namespace)
    base = _import(ns).Callback
    cls = _CLASSES.get(base)
    if cls is None:
        cls = cast(
            "type[_NanWatch]",
            type(
                "NanWatchCallback",
                (_NanWatch, base),
                {
                    "__module__": _HOME[ns],
                    "__qualname__": "NanWatchCallback",
                    "__doc__": _NanWatch.__doc__,
                    "namespace": ns,
                },
            ),
        )
        _CLASSES[base] = cls
    return cls


# ---------------------------------------------------------------------- figures
def step_metrics(trace: StepTrace, *, scaled: bool = False) -> dict[str, float]:
    """The figures of a finished step that the callback logs: :meth:`StepTrace.figures`
    under ``nanwatch/`` names (``nanwatch/max_logit``, ``nanwatch/grad_norm``, ...).

    Example:
        >>> step_metrics(StepTrace(step=0, grad_norm=2.0))["nanwatch/grad_norm"]
        2.0
    """
    return {f"nanwatch/{k}": v for k, v in trace.figures(scaled=scaled).items()}


# ---------------------------------------------------------------------- helpers
def _loss_of(outputs: Any) -> torch.Tensor | None:
    """The loss in what ``training_step`` returned (a tensor, or a dict's ``"loss"``)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, dict):
        loss = outputs.get("loss")
        return loss if isinstance(loss, torch.Tensor) else None
    return None


def _step_loss(trainer: Any, pl_module: Any, outputs: Any) -> torch.Tensor | None:
    """The batch's loss as ``training_step`` returned it. Under automatic optimization
    Lightning hands ``on_train_batch_end`` the loss divided by ``accumulate_grad_batches``
    (``ClosureResult.from_training_step_output``: the backward of a micro-batch): multiplied
    back, it is the value the user computed and logged."""
    loss = _loss_of(outputs)
    if loss is None or not pl_module.automatic_optimization:
        return loss
    n = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
    return loss.detach() * n if n > 1 else loss


def _grads_finite(optimizer: Any) -> bool:
    """Whether every gradient of the optimizer's parameters is finite (one host read)."""
    flags = []
    for group in getattr(optimizer, "param_groups", ()):
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                g = g.coalesce().values()
            flags.append(torch.isfinite(g).all())
    return not flags or bool(torch.stack(flags).all())


def _has_error(trace: StepTrace) -> bool:
    return any(getattr(d, "severity", None) == "error" for d in trace.diagnoses)


def _found(trace: StepTrace) -> bool:
    return trace.anomaly is not None or _has_error(trace)


def _nonfinite(rec: Record) -> int | None:
    """How many NaN/inf values a record holds; None when not counted (an accelerator's
    gradient, read as its norm only)."""
    st = rec.stat
    if st is None or not st.counted:
        return None
    return (st.nan or 0) + (st.posinf or 0) + (st.neginf or 0)


def _step_args(fn: Callable[..., Any], batch: Any, batch_idx: int) -> tuple[Any, ...] | None:
    """The arguments Lightning passes to ``training_step``; None when it cannot be replayed
    from a kept batch (a ``dataloader_iter`` step)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return (batch, batch_idx)
    if "dataloader_iter" in params:
        return None
    kinds = [p.kind for p in params.values()]
    if inspect.Parameter.VAR_POSITIONAL in kinds or len(params) >= 2:
        return (batch, batch_idx)
    return (batch,)


@contextlib.contextmanager
def _no_logging(pl_module: Any) -> Iterator[None]:
    """``self.log`` / ``self.log_dict`` do nothing while the step is replayed (the replayed
    loss is not a new measurement)."""

    def _skip(*args: Any, **kwargs: Any) -> None:
        return None

    d = pl_module.__dict__
    saved = {k: d[k] for k in ("log", "log_dict") if k in d}
    d["log"] = _skip
    d["log_dict"] = _skip
    try:
        yield
    finally:
        for k in ("log", "log_dict"):
            d.pop(k, None)
        d.update(saved)


def _log_dir(trainer: Any) -> str:
    """``trainer.log_dir`` (rank 0's, broadcast: call on every rank), else the root dir."""
    try:
        d = trainer.log_dir
    except Exception:
        d = None
    return str(os.fspath(d) if d else os.fspath(trainer.default_root_dir))


def _warn(message: str, *, fault: bool = True) -> None:
    """A RuntimeWarning at the user's line (``trainer.fit(...)``), not at Lightning's loop
    or this module. A ``fault`` of nanwatch's own goes to stderr when warnings are errors:
    inside ``on_exception`` a raise would replace the user's exception."""
    warn_at_user(message, safe=fault)


def _ranks_text(ranks: Sequence[int], world: int) -> str:
    if world <= 1:
        return ""
    names = ", ".join(str(r) for r in ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {names} of {world}"


# ---------------------------------------------------------------------- validation
def _val_values(trainer: Any, outputs: Any) -> list[tuple[str, torch.Tensor]]:
    """The values a validation batch made, by the name the user knows them by: what
    ``validation_step`` returned (a tensor, a dict's tensors) and what it logged
    (``self.log("val_loss", ...)``: Lightning's accumulated value, which turns non-finite at
    the batch that made it so and stays so for the epoch)."""
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(outputs, torch.Tensor):
        out.append(("the loss validation_step returned", outputs))
    elif isinstance(outputs, dict):
        out += [
            (f"validation_step's {k!r}", v)
            for k, v in outputs.items()
            if isinstance(v, torch.Tensor)
        ]
    try:  # Lightning's result collection of the running loop (private: read defensively)
        results = trainer._results
        metrics = list(results.values()) if results is not None else []
    except Exception:
        metrics = []
    for m in metrics:
        meta = getattr(m, "meta", None)
        if not getattr(m, "is_tensor", False) or meta is None:
            continue
        if "validation" not in str(getattr(meta, "fx", "")):
            continue
        only_step = getattr(meta, "on_step", False) and not getattr(meta, "on_epoch", True)
        value = getattr(m, "_forward_cache" if only_step else "value", None)
        if isinstance(value, torch.Tensor):
            out.append((str(getattr(meta, "name", "a logged value")), value))
    return [(n, v.detach()) for n, v in out if v.is_floating_point() or v.is_complex()]


def _bad_running_stats(pl_module: Any) -> list[tuple[str, list[str], str, str]]:
    """The norms in eval mode whose running statistics (``running_mean``/``running_var``)
    hold NaN/inf: (module path, the bad buffers, module class, what they hold). Read only
    while a non-finite validation value is being diagnosed."""
    found = []
    for path, m in pl_module.named_modules():
        if m.training:
            continue
        bufs = [
            (leaf, buf)
            for leaf in ("running_mean", "running_var")
            if isinstance(buf := getattr(m, leaf, None), torch.Tensor) and buf.is_floating_point()
        ]
        bad = [(leaf, buf) for leaf, buf in bufs if not bool(torch.isfinite(buf).all())]
        if bad:
            n = int(sum(int((~torch.isfinite(b)).sum()) for _, b in bad))
            total = sum(b.numel() for _, b in bad)
            kinds = ", ".join(dict.fromkeys(k for _, b in bad for k in _kinds(b).split(", ")))
            what = f"{kinds} ({n} of {total} values)"
            found.append((path, [leaf for leaf, _ in bad], type(m).__name__, what))
    return found


def _kinds(t: torch.Tensor) -> str:
    t = t.detach().float()
    kinds = [
        k
        for k, hit in (
            ("NaN", t.isnan()),
            ("+inf", t == float("inf")),
            ("-inf", t == float("-inf")),
        )
        if bool(hit.any())
    ]
    return ", ".join(kinds) or "non-finite"


def _fitting(trainer: Any) -> bool:
    """Whether the Trainer runs ``fit`` (its validation is checked; ``trainer.validate`` of a
    callback that watched an earlier fit is not)."""
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return fn is None or str(getattr(fn, "value", fn)) == "fit"


def _self_ref(path: str) -> str:
    """The expression for module ``path`` inside the LightningModule's own code."""
    if not path:
        return "self"
    return "self" + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path.split("."))


# ---------------------------------------------------------------------- the callback
def _skip_clipping_once(pl_module: Any) -> None:
    """Lightning clips the gradients right after ``on_before_optimizer_step``, through
    ``pl_module.configure_gradient_clipping``: on an update dropped by setting every gradient
    to None, ``clip_grad_value_`` raises on the empty list (norm clipping returns 0). That
    hook is shadowed on the instance for this one call, by a no-op that removes itself;
    :func:`_unskip_clipping` removes it if no clipping came (another precision plugin)."""
    if "configure_gradient_clipping" in vars(pl_module):
        return  # the user's own per-instance override, or ours already

    def _no_clipping(*args: Any, **kwargs: Any) -> None:
        _unskip_clipping(pl_module)

    _no_clipping._nanwatch_drop = True  # type: ignore[attr-defined]
    object.__setattr__(pl_module, "configure_gradient_clipping", _no_clipping)


def _unskip_clipping(pl_module: Any) -> None:
    fn = vars(pl_module).get("configure_gradient_clipping")
    if getattr(fn, "_nanwatch_drop", False):
        del vars(pl_module)["configure_gradient_clipping"]


class _NanWatch:
    """Watches a LightningModule's training for NaN/inf, fp16 overflow and bad loss inputs;
    pinpoints the op by replaying the failing batch; stops, skips, raises or warns.

    Use ``from nanwatch.callbacks import NanWatchCallback`` (the Lightning namespace your
    program imported), ``NanWatchCallback.for_namespace("pytorch_lightning")`` or
    ``nanwatch.callbacks.pytorch_lightning.NanWatchCallback`` for the other one.

    ``on_anomaly`` (decided before the optimizer step, with the parameters unchanged):

    * ``"stop"`` (default): drop this update (and the later ones of the same batch under
      manual optimization), set ``trainer.should_stop``, write the report;
    * ``"skip"``: drop this update (every gradient set to ``None``, so the optimizer and a
      GradScaler leave the weights alone), append the batch to
      ``nanwatch-skipped-rank<r>.jsonl`` in the report directory, and go on. Under manual
      optimization only the stepped optimizer's gradients are dropped, and a later
      optimizer of the same batch (a GAN's generator) is skipped only when its own
      gradients are non-finite; the batch is listed once. The warning is said again for
      an anomaly of another cause (another module, origin or diagnosis), not for the same
      one in a later batch;
    * ``"raise"``: raise :class:`nanwatch.AnomalyError` (the post-mortem report is written);
    * ``"warn"``: warn once and go on (the update is applied).

    Early warnings (warning-severity diagnoses: gradients never reset, float16 logits near
    ``exp``'s bound, ...) are said as :func:`nanwatch.watch` says them, once per code as a
    :class:`nanwatch.NanwatchWarning`, whatever ``on_anomaly`` says; they never stop or skip
    training, are counted (each said once) in the logged ``nanwatch/warnings`` and make
    the run write its report at the end. Under gradient accumulation a micro-batch that
    only adds to a gradient an earlier one of its window made NaN is not blamed: the
    window's update is decided by (and listed under) the batch that made it.

    A guard's :class:`nanwatch.GuardError` (a class index of 255, a BCE input above 1, an
    (N, 1) prediction against an (N,) target, in a loss module or an ``F.*`` loss) is raised
    inside ``training_step``, before the loss exists: whatever ``on_anomaly`` says, it comes
    out of ``trainer.fit`` unchanged, the weights keep the last update, and the post-mortem
    report is written (``on_exception``). ``guards=False`` / ``functional_guards=False``
    leave the loss to PyTorch.

    Under DDP the decision is reduced across ranks (any rank -> every rank acts at the same
    step) and each rank writes its own report, named by rank, saying which ranks saw it.
    The other options are :func:`nanwatch.watch`'s (``config`` replaces them at once);
    ``report_dir`` defaults to ``trainer.log_dir``; ``max_replays`` bounds the forensic
    replays of failing batches (0: none); ``log_metrics`` logs per-step figures
    (:func:`step_metrics`) with ``pl_module.log``, so ``log_every_n_steps`` applies.

    The replay calls ``training_step`` once more on the kept batch, with ``self.log`` muted
    and no optimizer step: a ``training_step`` with other side effects should set
    ``max_replays=0``. Manual optimization, ``dataloader_iter`` steps and SyncBatchNorm
    under DDP are not replayed.

    Only training is watched. The validation inside ``fit`` runs with no hook and no guard
    and adds nothing to the history or the report, but what each ``validation_step``
    returns and logs (``self.log("val_loss", ...)``) is read once per batch: a value that
    turns NaN/inf is said once per cause, with where it came from -- a norm's running
    statistic that holds NaN (named, with the fix), else the first module whose eval
    forward went bad or the op of ``validation_step``'s own code that made it (a replay of
    that batch in eval mode under a watcher of its own: no grad, logging muted, the RNG
    and buffers put back; at most ``max_replays``). "raise" raises
    :class:`nanwatch.AnomalyError` after that batch; the other actions warn and training
    goes on. ``trainer.validate``, ``trainer.test`` and ``trainer.predict`` are not
    watched: a NaN born only in ``test_step`` shows in the loop's
    metrics alone (``test_loss`` nan), with no warning from this callback. To find where,
    wrap the call: ``with nanwatch.watch(model): trainer.test(model)`` raises
    :class:`nanwatch.AnomalyError` naming the module and the op, and writes its report.
    An exception raised in ``fit``'s validation, the sanity check's included, still leaves
    the post-mortem, which says it was raised there. An lr scheduler returned by
    ``configure_optimizers`` is named in a fix that lowers the lr, as
    ``trainer.lr_scheduler_configs[i].scheduler``.

    Example:
        >>> from nanwatch.callbacks import NanWatchCallback                   # doctest: +SKIP
        >>> cb = NanWatchCallback(on_anomaly="skip")                          # doctest: +SKIP
        >>> Trainer(callbacks=[cb]).fit(model)                                # doctest: +SKIP
        >>> cb.skipped[0]["batch_idx"], cb.watcher.first_anomaly.summary      # doctest: +SKIP
    """

    #: the Lightning namespace of this class (set on the concrete classes)
    namespace: str = ""

    def __init__(
        self,
        *,
        on_anomaly: Action = "stop",
        mode: Literal["sentinel", "watch", "forensic"] = "watch",
        sample_every: int = 1,
        ring_size: int = 32,
        report_dir: str | os.PathLike[str] | None = None,
        allow: Sequence[str] = (),
        ignore: Sequence[str] = (),
        guards: bool = True,
        functional_guards: bool = True,
        pinpoint: bool = True,
        postmortem: bool = True,
        max_replays: int = 3,
        log_metrics: bool = True,
        config: WatchConfig | None = None,
    ) -> None:
        super().__init__()
        if on_anomaly not in ACTIONS:
            raise ConfigError(
                "on_anomaly",
                on_anomaly,
                f"`on_anomaly` can be {', '.join(map(repr, ACTIONS))}; got {on_anomaly!r}.",
            )
        if isinstance(max_replays, bool) or not isinstance(max_replays, int) or max_replays < 0:
            raise ConfigError(
                "max_replays",
                max_replays,
                f"`max_replays` must be an integer >= 0; got {max_replays!r}.",
            )
        if config is None:
            config = WatchConfig(
                mode=mode,
                sample_every=sample_every,
                ring_size=ring_size,
                allow=tuple(allow) if not isinstance(allow, str) else (allow,),
                ignore=tuple(ignore) if not isinstance(ignore, str) else (ignore,),
                guards=guards,
                functional_guards=functional_guards,
                pinpoint=pinpoint,
                postmortem=postmortem,
            )
        elif not isinstance(config, WatchConfig):
            raise ConfigError(
                "config",
                config,
                f"`config` must be a nanwatch.WatchConfig; got {type(config).__name__}.",
            )
        self.on_anomaly: Action = on_anomaly
        #: the watcher's configuration; the callback acts itself, so on_anomaly="record"
        self.config = config.replace(on_anomaly="record")
        self.report_dir = None if report_dir is None else os.fspath(report_dir)
        self.max_replays = max_replays
        self.log_metrics = log_metrics
        #: the Watcher of the current (or last) fit; None before ``setup("fit")``
        self.watcher: Watcher | None = None
        #: one entry per dropped update: epoch, batch_idx, global_step, step, ranks, what
        self.skipped: list[dict[str, Any]] = []
        #: reports written by this callback (JSON paths; the HTML page sits beside each)
        self.report_paths: list[Path] = []
        #: the nanwatch step at which "stop" stopped training
        self.stopped_at: int | None = None
        self.replays = 0
        #: early warnings said in the run (a NanwatchWarning each, one per code: a code that
        #: fires again at later steps is not counted again), a checkpoint's included
        self.warning_count = 0
        self._anomalies_before = 0  # anomalies of earlier runs no longer kept (checkpoints)
        self._restored = (0, 0)  # anomalies and skips that came from a checkpoint
        self._state: dict[str, Any] | None = None
        #: validation: the batch being validated, its RNG state, the values found
        #: non-finite in this validation run, the causes said, the replays made
        self._vbatch: tuple[Any, int, int] | None = None
        self._vrng: torch.Tensor | None = None
        self._val_bad: set[str] = set()
        self._val_causes: set[tuple[str, ...]] = set()
        self._val_replays = 0
        self._val_off = False  # an internal error stopped the validation checks
        #: the replay's anomaly and diagnoses, for the AnomalyError of "raise"
        self._val_found: tuple[Anomaly | None, list[Diagnosis]] = (None, [])
        self._reset_run()

    def _reset_run(self) -> None:
        self._paused = False
        self._replayable = True
        self._batch: Any = None
        self._batch_idx = -1
        self._window = -1  # the first batch of the accumulation window (its update's batches)
        self._rng: torch.Tensor | None = None
        self._cuda_rng: tuple[torch.device, torch.Tensor] | None = None
        self._opt_stepped = False
        #: (step, batch_idx) with findings whose update is not applied yet / was applied
        self._pending: list[tuple[int, int]] = []
        self._late: list[tuple[int, int]] = []
        #: the epoch of each step with findings (its batch index counts from 0 in each)
        self._epochs: dict[int, int] = {}
        self._decided = -1
        self._report_due = False
        self._warned = False
        self._causes: set[tuple[str, ...]] = set()  # the causes a skip warning said
        self._warnings = False  # this run said an early warning (the report is written)
        #: the step whose only non-finite values are gradients an earlier micro-batch of
        #: the accumulation window made bad (see _inherited)
        self._inherits = -1
        self._broken = False  # an internal error stopped the watching
        #: the figures known at some step of this run (see _log)
        self._known: set[str] = set()

    @classmethod
    def for_namespace(cls, namespace: str) -> type[_NanWatch]:
        """The class for another Lightning namespace.

        Example:
            >>> NanWatchCallback.for_namespace("pytorch_lightning")          # doctest: +SKIP
            <class 'nanwatch.callbacks.pytorch_lightning.NanWatchCallback'>
        """
        return callback_class(namespace)

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return  # validate/test/predict are not watched
        directory = self.report_dir or _log_dir(trainer)
        if self.watcher is not None:
            self.watcher.detach()
        self.watcher = Watcher([pl_module], self.config.replace(report_dir=directory))
        self.watcher.front = "lightning"  # hints name this callback, not a watch() call
        self.skipped = []
        self.report_paths = []
        self.stopped_at = None
        self.replays = 0
        self.warning_count = 0
        self._anomalies_before = 0
        self._restored = (0, 0)
        self._val_causes = set()
        self._val_replays = 0
        self._val_off = False
        self._reset_run()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # attached here rather than in setup: modules built in configure_model exist now,
        # a checkpoint's summary is loaded, and the sanity check's validation has run
        nw = self.watcher
        if nw is None or nw.attached:
            return
        if self._state is not None:
            self._restore(nw, self._state)
            self._state = None
        nw.scaler = getattr(trainer.precision_plugin, "scaler", None)
        for i, cfg in enumerate(getattr(trainer, "lr_scheduler_configs", None) or ()):
            # returned by configure_optimizers: no frame that steps the optimizer holds it
            nw.add_scheduler(cfg.scheduler, name=f"trainer.lr_scheduler_configs[{i}].scheduler")
        self._replayable = bool(pl_module.automatic_optimization) and not (
            trainer.world_size > 1
            and any(isinstance(m, torch.nn.SyncBatchNorm) for m in pl_module.modules())
        )  # SyncBatchNorm's forward is a collective: a replay on one rank would hang it
        nw.attach()
        nw._explicit = True  # steps are this callback's (on_train_batch_end), from the first

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        nw = self.watcher
        self._val_bad = set()  # the values found non-finite in this validation run
        if nw is not None and nw.attached:
            nw.detach()
            self._paused = True

    def on_validation_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        # no hook: only the batch and the RNG state are kept, for a replay if it goes bad
        if self.watcher is None or self._broken or self._val_off or not _fitting(trainer):
            return
        self._vbatch = (batch, batch_idx, dataloader_idx)
        self._vrng = torch.get_rng_state() if self.max_replays else None

    def on_validation_batch_end(  # noqa: PLR0917  (Lightning passes them by position)
        self,
        trainer: Any,
        pl_module: Any,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.watcher is None or self._broken or self._val_off or not _fitting(trainer):
            return
        try:
            message = self._check_validation(trainer, pl_module, outputs)
        except Exception as exc:  # nanwatch's own failure: the training watching goes on
            self._val_off = True
            msg = f"{type(exc).__name__}: {exc}"
            self.watcher.faults.append(("lightning validation check", msg))
            _warn(
                f"nanwatch: internal error in NanWatchCallback's validation check ({msg}); "
                "validation is no longer checked in this run, training is still watched. "
                "Please report it with the traceback (python -W error::RuntimeWarning)."
            )
            return
        finally:
            self._vbatch, self._vrng = None, None
        if message is None:
            return
        if self.on_anomaly == "raise":
            anomaly, diagnoses = self._val_found
            raise AnomalyError(
                message + "  raising AnomalyError.", anomaly=anomaly, diagnoses=diagnoses
            )
        _warn(message + "  training goes on (a validation value changes no weight).", fault=False)

    def _check_validation(self, trainer: Any, pl_module: Any, outputs: Any) -> str | None:
        """One host read of the batch's returned and logged values; for a value that turned
        non-finite, the message (once per cause), else None."""
        values = [(n, v) for n, v in _val_values(trainer, outputs) if n not in self._val_bad]
        if not values:
            return None
        by_device: dict[torch.device, list[int]] = {}
        for i, (_, v) in enumerate(values):
            by_device.setdefault(v.device, []).append(i)
        ok = [True] * len(values)
        for idx in by_device.values():  # one transfer per device (one in practice)
            flags = torch.stack([torch.isfinite(values[i][1]).all() for i in idx]).tolist()
            for i, flag in zip(idx, flags, strict=True):
                ok[i] = bool(flag)
        if all(ok):
            return None
        bad = [nv for nv, fine in zip(values, ok, strict=True) if not fine]
        self._val_found = (None, [])
        self._val_bad.update(n for n, _ in bad)
        cause, lines = self._val_diagnose(trainer, pl_module, bad[0][0])
        if cause in self._val_causes:
            return None
        self._val_causes.add(cause)
        _, batch_idx, dl = self._vbatch or (None, -1, 0)
        epoch = int(getattr(trainer, "current_epoch", 0) or 0)
        where = "the sanity check" if getattr(trainer, "sanity_checking", False) else "validation"
        at = f"{where} batch {batch_idx}" + (f" of epoch {epoch}" if epoch else "")
        if dl:
            at += f" (dataloader {dl})"
        names = ", ".join(f"{n} is {_kinds(v)}" for n, v in bad[:3])
        return f"nanwatch: {at}: {names}.\n" + "".join(f"  {ln}\n" for ln in lines)

    def _val_diagnose(
        self, trainer: Any, pl_module: Any, name: str
    ) -> tuple[tuple[str, ...], list[str]]:
        """(the cause, the lines that say it): the running statistics a norm normalizes
        with in eval mode, read first; then a replay of the batch's validation_step in eval
        mode under a watcher of its own (no grad, logging muted, the RNG of the batch's
        start, buffers put back), which names the first module whose output went bad, or
        the op of validation_step's own code that made the value."""
        lines: list[str] = []
        stats = _bad_running_stats(pl_module)
        if stats:
            path, leaves, cls, what = stats[0]
            named = ", ".join(f"{path}.{leaf}" for leaf in leaves)
            more = f" (and {len(stats) - 1} more norms)" if len(stats) > 1 else ""
            lines.append(
                f"{named} ({cls}) hold{'s' if len(leaves) == 1 else ''} {what}{more}: in eval "
                "mode the layer normalizes with its running statistics, so every validation "
                "forward is non-finite from there on; training normalizes with each batch's "
                "own statistics and stays finite."
            )
            nw = self.watcher
            first = nw.first_anomaly if nw is not None else None
            if first is not None and first.kind in (AnomalyKind.INPUT, AnomalyKind.FORWARD):
                lines.append(
                    f"training step {first.step} had {first.summary.partition(' [')[0]}; its "
                    "train-mode forward folded it into the running statistics before any "
                    "loss, and skipping that update does not undo it."
                )
            refs = [_self_ref(p) for p, *_ in stats[:3]]
            lines += [
                "fix: # keep non-finite batches out of train-mode forwards (check the batch "
                "before self(x), not the loss after),",
                "     # then reset the statistics and re-estimate them on clean batches:",
                *(f"     {r}.reset_running_stats()" for r in dict.fromkeys(refs)),
                "     # torch.optim.swa_utils.update_bn(train_loader, self)   (or reload a "
                "clean checkpoint)",
            ]
            return ("running_stats", path, *leaves), lines
        if self._vbatch is None or self._val_replays >= self.max_replays:
            lines.append(
                "not replayed (max_replays); run the batch under nanwatch.watch(model) to "
                "find where."
            )
            return ("unreplayed", name), lines
        if int(getattr(trainer, "world_size", 1) or 1) > 1 and any(
            isinstance(m, torch.nn.SyncBatchNorm) for m in pl_module.modules()
        ):
            return ("unreplayed", name), ["not replayed: SyncBatchNorm under DDP."]
        self._val_replays += 1
        return self._val_replay(trainer, pl_module, name)

    def _val_replay(
        self, trainer: Any, pl_module: Any, name: str
    ) -> tuple[tuple[str, ...], list[str]]:
        assert self._vbatch is not None
        batch, batch_idx, dl = self._vbatch
        args = _step_args(pl_module.validation_step, batch, batch_idx)
        if args is None:
            return ("unreplayed", name), ["not replayed: a dataloader_iter step."]
        if dl or len(getattr(trainer, "num_val_batches", ()) or ()) > 1:
            args = (*args, dl)
        mode = "watch" if self.config.mode == "sentinel" else self.config.mode
        vw = Watcher(
            [pl_module],
            self.config.replace(mode=mode, on_anomaly="record", postmortem=False),
        )
        vw.front = "lightning"
        plugin = trainer.precision_plugin
        devices = {p.device for p in pl_module.parameters()}
        rng = self._vrng

        def step_fn() -> None:
            with torch.no_grad(), _no_logging(pl_module), plugin.val_step_context():
                pl_module.validation_step(*args)

        error: Exception | None = None
        with ops.preserved_state(pl_module, devices):
            if rng is not None:
                torch.set_rng_state(rng)
            vw.attach()
            try:
                step_fn()
            except GuardError as exc:  # a loss guard saw a bad target in the validation data
                error = exc
            except Exception as exc:
                error = exc
            finally:
                try:
                    done = vw.step()
                finally:
                    vw.detach()
        a = done.anomaly
        self._val_found = (a, list(done.diagnoses))
        if a is not None:
            lines = [f"first bad in the eval forward: {a.summary}"]
            if done.diagnoses:
                lines += done.diagnoses[0].brief()
            code = str(done.diagnoses[0].code) if done.diagnoses else ""
            return (a.kind.value, a.path, a.origin, code), lines
        if isinstance(error, GuardError):
            head = str(error).strip().splitlines()
            return ("guard", type(error).__name__, head[0] if head else ""), head[:6]
        # every watched output finite: validation_step's own code made it (a metric)
        result = vw.replay(step_fn, rng_state=rng)
        ev = result.first()
        if ev is None:
            said = [
                f"every module's eval forward was finite and a replay of validation_step ran "
                f"clean: {name} was made non-finite outside it (on_validation_batch_end, a "
                "metric object's state)."
            ]
            return ("outside", name), said
        at = f" at {ev.source}" if ev.source else ""
        code = f": {ev.code.strip()}" if ev.code else ""
        lines = [
            f"every module's eval forward was finite: validation_step's own code made "
            f"{ev.born} in {ev.op}{at}{code}",
        ]
        if "div" in ev.op:
            lines.append(
                "fix: keep the denominator off 0 in that line: a count: .clamp_min(1); "
                "a float: .clamp_min(torch.finfo(x.dtype).eps) (or torchmetrics' "
                "zero_division)"
            )
        return ("op", ev.op, ev.source or ""), lines

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        nw = self.watcher
        if nw is not None and self._paused:
            self._paused = False
            nw.attach()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        nw = self.watcher
        if nw is None:
            return
        try:
            new = len(nw.anomalies) > self._restored[0] or len(self.skipped) > self._restored[1]
            if (new or self._warnings) and not self.report_paths:
                # a skip/warn run, or one with early warnings (a stop wrote its report)
                self._write_report()
        finally:
            nw.detach()
            self._paused = False

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and self.watcher is not None:
            self.watcher.detach()
            self._paused = False
        self._batch = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning calls this inside its `except`: anything raised here would come out of
        # trainer.fit in place of the user's exception, so nanwatch's own failure is a warning
        nw = self.watcher
        if nw is None:
            return
        try:
            # the sanity check's validation runs before on_train_start attaches the watcher:
            # what it raises is told as the validation's, before step 0
            sanity = not nw.attached and bool(getattr(trainer, "sanity_checking", False))
            if nw.attached or self._paused or sanity:
                # classifies, flushes what is safe to read, writes the post-mortem, detaches;
                # paused, the validation raised it: no training step did
                during = {"during": "the sanity check"} if sanity else {}
                if self._paused:
                    during = {"during": "validation"}
                path = nw.close(exception, **during)
                if path is not None:
                    self.report_paths.append(path)
        except Exception as exc:
            msg = f"{type(exc).__name__}: {exc}"
            nw.faults.append(("post-mortem", msg))
            _warn(
                f"nanwatch: the post-mortem report could not be written ({msg}); the original "
                f"{type(exception).__name__} follows unchanged. Please report it with the "
                "traceback (python -W error::RuntimeWarning)."
            )
        finally:
            with contextlib.suppress(Exception):
                nw.detach()  # (close detached already, unless it failed before)
            self._paused = False
            self._batch = None

    # ------------------------------------------------------------------ steps
    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        nw = self.watcher
        if nw is None or not nw.attached:
            return
        self._batch, self._batch_idx = batch, batch_idx
        if self._window < 0:
            self._window = batch_idx
        self._opt_stepped = False
        if self._replayable and self.replays < self.max_replays:
            self._rng = torch.get_rng_state()
            dev = pl_module.device
            self._cuda_rng = (dev, torch.cuda.get_rng_state(dev)) if dev.type == "cuda" else None

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        nw = self.watcher
        if nw is None or not (nw.attached or self._broken):
            return  # (broken: no more watching, but every decision is still taken together)
        self._opt_stepped = True
        if not self._broken:
            self._guarded(self._check, trainer, pl_module)
        self._decide(trainer, pl_module, optimizer)

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        # the watcher reads the gradients (their norm: ``nanwatch/grad_norm``; NaN/inf in
        # them) after a backward that reached a watched module's output. In sentinel mode
        # only the LightningModule's own call is watched, and a training_step that calls
        # ``self.net(x)`` never makes one: the gradients would go unread, and a NaN born in
        # backward would be found only in the weights after the update. Lightning calls
        # this hook after every backward, so the backward is known to have run.
        nw = self.watcher
        if nw is not None and nw.attached and not self._broken:
            nw._backward_seen = True

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        nw = self.watcher
        if nw is None or not (nw.attached or self._broken):
            return
        _unskip_clipping(pl_module)
        done = None if self._broken else self._guarded(self._end_step, trainer, pl_module, outputs)
        if not pl_module.automatic_optimization and not self._opt_stepped:
            self._decide(trainer, pl_module, None)
        if done is not None and not self._broken:
            if self.log_metrics and trainer.loggers:
                self._guarded(self._log, pl_module, done)
            if self._report_due:
                self._report_due = False
                self._write_report()
        self._batch = None
        if self._opt_stepped or not pl_module.automatic_optimization:
            self._window = -1

    def _end_step(self, trainer: Any, pl_module: Any, outputs: Any) -> StepTrace:
        nw = self.watcher
        assert nw is not None
        if not self._opt_stepped:  # accumulating gradients, or manual optimization
            self._check(trainer, pl_module)
        done = self._step(loss=_step_loss(trainer, pl_module, outputs))
        known = done.step == self._decided or any(s == done.step for s, _ in self._pending)
        if _found(done) and not known:
            # found at the step's end (a rule): the update was applied already, unless no
            # optimizer step ran in this batch (gradient accumulation)
            found = (done.step, self._batch_idx)
            (self._late if self._opt_stepped else self._pending).append(found)
            self._epochs[done.step] = int(trainer.current_epoch)
        self._announce(done)
        return done

    def _step(self, loss: torch.Tensor | None = None) -> StepTrace:
        """``nw.step()``; a micro-batch that only added to gradients an earlier one of its
        accumulation window made non-finite (:meth:`_inherited`) ends with no anomaly and no
        diagnosis of its own: its records stay, and the window's finding is the earlier
        batch's."""
        nw = self.watcher
        assert nw is not None
        done = nw.step(loss=loss)
        if done.step == self._inherits:
            self._inherits = -1
            if done.anomaly is not None:
                nw._forget(done, done.anomaly)
            done.diagnoses = nw._evaluate(done)
        return done

    def _announce(self, done: StepTrace) -> None:
        """Say the step's early warnings (warning-severity diagnoses) as ``nanwatch.watch``
        does: each code once, a :class:`nanwatch.NanwatchWarning` at the user's line, by the
        watcher's own announcement. They never stop or skip anything; they are counted (the
        logged ``nanwatch/warnings``: the warnings said, one per code, not the steps a code
        fired at again) and make the run write its report at the end."""
        nw = self.watcher
        assert nw is not None
        if not any(d.severity == "warning" for d in done.diagnoses):
            return
        self._warnings = True
        before = len(nw._announced)
        # the watcher's policy is "record" (this callback acts on anomalies itself), which
        # keeps warnings silent: announce under the policy the user chose
        config = nw.config
        nw.config = config.replace(on_anomaly="warn")
        try:
            nw._announce(done)
        finally:
            nw.config = config
            self.warning_count += len(nw._announced) - before

    def _guarded(self, fn: Callable[..., _T], *args: Any) -> _T | None:
        """Run nanwatch's part of a hook; an internal error (a nanwatch bug) must not end
        the run: warn once, stop watching, keep taking part in the ranks' decisions."""
        try:
            return fn(*args)
        except AnomalyError:
            raise
        except Exception as exc:
            self._broken = True
            self._pending, self._late = [], []
            msg = f"{type(exc).__name__}: {exc}"
            nw = self.watcher
            if nw is not None:
                nw.faults.append(("lightning callback", msg))
                nw.detach()
            _warn(
                f"nanwatch: internal error in NanWatchCallback ({msg}); it stops watching for "
                "the rest of this run and training goes on. Please report it with the "
                "traceback (python -W error::RuntimeWarning)."
            )
            return None

    # ------------------------------------------------------------------ decisions
    def _check(self, trainer: Any, pl_module: Any) -> None:
        """``nw.check()`` the step so far; a new anomaly joins the pending findings and, when
        it is the first since the last update, its batch is replayed (later ones in the same
        accumulation window inherit its gradients: their replay would mislead)."""
        nw = self.watcher
        assert nw is not None
        step = nw.step_index
        anomaly = nw.check()
        if anomaly is None or step == self._decided or any(s == step for s, _ in self._pending):
            return  # (decided: a later optimizer of the same batch, manual optimization)
        if self._inherited(step):
            self._inherits = step
            return
        first = not self._pending
        self._pending.append((step, self._batch_idx))
        self._epochs[step] = int(trainer.current_epoch)
        # a replay can name the op of a value born in forward or backward code; bad data and
        # broken weights have no op to name
        if first and anomaly.kind in (AnomalyKind.FORWARD, AnomalyKind.BACKWARD):
            self._replay(trainer, pl_module)

    def _inherited(self, step: int) -> bool:
        """Whether the current step, a micro-batch after one whose finding is pending in
        the same accumulation window, found nothing of its own: its only non-finite records
        are parameter gradients that were non-finite at the previous micro-batch's end, with
        no more non-finite values than then. Its backward was finite; it added to a
        ``.grad`` that held the earlier batch's NaN (NaN + x is NaN)."""
        nw = self.watcher
        assert nw is not None
        if not self._pending or self._pending[0][0] >= step:
            return False
        prev = next((t for t in reversed(nw.history) if t.step == step - 1), None)
        if prev is None:
            return False
        before = {(r.path, r.role): r for r in prev.records if r.phase is Phase.GRADIENT and r.bad}
        bad = [r for r in nw.trace.records if r.bad]
        if not bad:
            return False
        for r in bad:
            old = before.get((r.path, r.role)) if r.phase is Phase.GRADIENT else None
            if old is None:
                return False
            now, then = _nonfinite(r), _nonfinite(old)
            if now is not None and then is not None and now > then:
                return False  # new NaN/inf of its own
        return True

    def _decide(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """One decision per optimizer step, the same on every rank: reduce whether any rank
        found something, then every rank acts."""
        nw = self.watcher
        assert nw is not None
        local = bool(self._pending or self._late)
        # another optimizer stepped in a batch decided already (manual optimization)
        again = not local and optimizer is not None and self._decided == nw.step_index
        if again:
            local = self._drops_again(optimizer)
        world = int(getattr(trainer, "world_size", 1) or 1)
        fired = local
        if world > 1:
            fired = bool(trainer.strategy.reduce_boolean_decision(local, all=False))
        if not fired:
            return
        if again:  # recorded, reported and warned at the batch's first decision
            self._drop(pl_module, optimizer)
            return
        unapplied, late = self._pending, self._late
        self._pending, self._late = [], []
        found = sorted(unapplied + late)
        first = found[0][0] if found else -1
        ranks, first_ranks, drop = self._who(trainer, world, bool(unapplied), bool(late), first)
        if world > 1 and not self._broken:
            nw.note(
                "distributed",
                "trainer",
                rank=int(trainer.global_rank),
                world_size=world,
                ranks=ranks,
                first_ranks=first_ranks,
                action=self.on_anomaly,
            )
        # the step decided: at a batch's end (manual optimization, no optimizer step) the
        # step has ended already, and the next one must be decided on its own
        self._decided = nw.step_index - (optimizer is None and not self._broken)
        self._act(trainer, pl_module, optimizer, drop=drop, ranks=ranks, world=world, found=found)

    def _drops_again(self, optimizer: Any) -> bool:
        """Whether a later optimizer step of a batch whose anomaly was decided drops its
        update too: "stop" keeps every weight as the failing batch found it; "skip" drops
        only an update whose own gradients are non-finite (a GradScaler skips those itself),
        so a clean update of another optimizer (a GAN's generator) goes through."""
        if self.on_anomaly == "stop":
            return True
        if self.on_anomaly != "skip":
            return False
        scaler = self.watcher.scaler if self.watcher is not None else None
        if scaler is not None and getattr(scaler, "is_enabled", lambda: True)():
            return False
        return not _grads_finite(optimizer)

    @staticmethod
    def _drop(pl_module: Any, optimizer: Any) -> None:
        """Drop the update of the optimizer about to step: its parameters' gradients set to
        None (torch optimizers and GradScaler.step skip grad-less parameters); under
        automatic optimization every gradient of the module."""
        params: dict[int, Any] = {}
        if pl_module.automatic_optimization:
            params.update((id(p), p) for p in pl_module.parameters())
        for group in getattr(optimizer, "param_groups", ()):
            for p in group["params"]:
                params[id(p)] = p
        for p in params.values():
            p.grad = None
        if pl_module.automatic_optimization:
            _skip_clipping_once(pl_module)

    def _who(
        self, trainer: Any, world: int, unapplied: bool, late: bool, first: int
    ) -> tuple[list[int], list[int], bool]:
        """(ranks that found something, those that found it earliest, whether any rank's
        pending update is bad): one all-reduce of a small table, only on a step that fired."""
        if world <= 1:
            return [0], [0], unapplied
        rank = int(trainer.global_rank)
        table = torch.zeros(world, 3, dtype=torch.long, device=trainer.strategy.root_device)
        table[rank, 0], table[rank, 1], table[rank, 2] = int(unapplied), int(late), first
        rows: list[list[int]] = trainer.strategy.reduce(table, reduce_op="sum").tolist()
        ranks = [r for r, (u, lt, _) in enumerate(rows) if u or lt]
        earliest = min((rows[r][2] for r in ranks), default=-1)
        first_ranks = [r for r in ranks if rows[r][2] == earliest]
        return ranks, first_ranks, any(u for u, _, _ in rows)

    def _act(
        self,
        trainer: Any,
        pl_module: Any,
        optimizer: Any,
        *,
        drop: bool,
        ranks: list[int],
        world: int,
        found: list[tuple[int, int]],
    ) -> None:
        nw = self.watcher
        assert nw is not None
        action = self.on_anomaly
        steps = [s for s, _ in found]
        dropped = drop and optimizer is not None and action in ("skip", "stop")
        if dropped:
            self._drop(pl_module, optimizer)
        if action == "skip" and dropped:
            self._record_skip(trainer, ranks, world, found)
        if action == "stop":
            trainer.should_stop = True
            self.stopped_at = nw.step_index
            self._report_due = True
        if action == "raise":
            done = None if self._broken else self._guarded(self._step)
            at = nw.step_index - (done is not None)
            raise AnomalyError(
                self._message(at, ranks, world, found, dropped=False, trainer=trainer),
                anomaly=self._earliest(steps),
                diagnoses=self._diagnoses(steps, done),
            )
        # "skip" keeps the weights clean: a later anomaly of another cause (what went bad,
        # where, its diagnosis) is news of its own, said once; the same cause again is only
        # listed (at most 8 causes are said). "warn" applies the bad update: what follows is
        # its consequence
        cause = self._cause(steps) if action == "skip" else None
        new = cause is not None and cause not in self._causes and len(self._causes) < 8
        if not self._warned or new:
            self._warned = True
            if cause is not None:
                self._causes.add(cause)
            message = self._message(
                nw.step_index, ranks, world, found, dropped=dropped, trainer=trainer
            )
            _warn(message, fault=False)

    def _cause(self, steps: list[int]) -> tuple[str, ...]:
        """What the earliest found step's anomaly is, as the skip warning tells causes apart:
        its kind, module, origin and first diagnosis's code (not its summary, whose counts
        differ from batch to batch); () for another rank's."""
        nw = self.watcher
        assert nw is not None
        a = self._earliest(steps)
        first = min(steps, default=None)
        top = next(
            (t.diagnoses[0] for t in [*nw.history, nw.trace] if t.step == first and t.diagnoses),
            None,
        )
        code = "" if top is None else str(top.code)
        if a is None:
            return () if first is None else ("", "", "", code)
        return (a.kind.value, a.path, a.origin, code)

    def _diagnoses(self, steps: list[int], done: StepTrace | None) -> list[Diagnosis]:
        """The diagnoses of the earliest step found (the one the error names); the ended
        step's when that one is no longer kept."""
        nw = self.watcher
        assert nw is not None
        first = min(steps, default=None)
        trace = next((t for t in nw.history if t.step == first), None)
        if trace is not None and trace.diagnoses:
            return list(trace.diagnoses)
        return list(done.diagnoses) if done is not None else []

    def _earliest(self, steps: list[int]) -> Anomaly | None:
        nw = self.watcher
        assert nw is not None
        return next((a for a in nw.anomalies if a.step in steps), None)

    def _what(self, steps: list[int]) -> str:
        nw = self.watcher
        assert nw is not None
        a = self._earliest(steps)
        if a is not None:
            return a.summary
        for t in [*nw.history, nw.trace]:
            if t.step in steps:
                errors = [d for d in t.diagnoses if getattr(d, "severity", None) == "error"]
                if errors:
                    return str(errors[0].headline)
        return "an anomaly"

    def _message(
        self,
        step: int,
        ranks: list[int],
        world: int,
        found: list[tuple[int, int]],
        *,
        dropped: bool,
        trainer: Any,
    ) -> str:
        """The warning or error: the step and batch where it was found (with gradient
        accumulation the decision comes at a later batch's optimizer step), and the
        optimizer step, as Lightning counts it, that it concerns."""
        nw = self.watcher
        assert nw is not None
        seen = _ranks_text(ranks, world)
        steps = [s for s, _ in found]
        if found:
            first, batch = min(found)
            opt_step = int(getattr(trainer, "global_step", 0) or 0)
            epoch = self._epochs.get(first, 0)
            of = f"epoch {epoch}, " if epoch else ""  # batch 3 of epoch 2, not of the first
            where = (
                f" ({of}batch {batch}, optimizer step {opt_step})"
                if first != batch or (first != opt_step)
                else ""
            )
            head = f"nanwatch: step {first}{where}: {self._what(steps)}"
            if seen:
                head += f" (seen on {seen})"
        else:
            head = (
                f"nanwatch: step {step}: {seen or 'another rank'} saw an anomaly (see its report)"
            )
        window = self._window
        of = f" of batches {window}-{self._batch_idx}" if 0 <= window < self._batch_idx else ""
        doing = {
            "stop": "training stops" + (f" (this update{of} is dropped)" if dropped else ""),
            "skip": (f"this update{of} is dropped; " if dropped else "")
            + "updates with anomalies are skipped; the run goes on",
            "raise": "raising AnomalyError",
            "warn": "training goes on (warn: the update is applied)",
        }[self.on_anomaly]
        every = "every rank: " if world > 1 else ""
        # the diagnosis and its fix, as nanwatch.watch says them: the report is for later
        said = self._top_lines(steps)
        return (
            f"{head}\n{said}  {every}{doing}.\n  report: {nw.config.report_dir} "
            "(nanwatch report <file>.json to read it again)"
        )

    def _top_lines(self, steps: list[int]) -> str:
        """The earliest found step's first diagnosis (its headline) and fix, one line each
        and the fix's continuation lines indented, ending in a newline; "" when the step has
        none (another rank's anomaly)."""
        nw = self.watcher
        assert nw is not None
        first = min(steps, default=None)
        top = next(
            (t.diagnoses[0] for t in [*nw.history, nw.trace] if t.step == first and t.diagnoses),
            None,
        )
        return "" if top is None else "\n".join(top.brief()) + "\n"

    def _replay(self, trainer: Any, pl_module: Any) -> None:
        """Re-run the failing batch's training_step and backward under the op checker, with
        the RNG state of the batch's start and the precision plugin's autocast; the watcher
        puts gradients, buffers and RNG back, and completes the anomaly (op or transient)."""
        nw = self.watcher
        assert nw is not None
        if not self._replayable or self.replays >= self.max_replays or self._rng is None:
            return
        args = _step_args(pl_module.training_step, self._batch, self._batch_idx)
        if args is None:
            return
        self.replays += 1
        plugin = trainer.precision_plugin
        scaler = nw.scaler
        cuda_rng = self._cuda_rng

        def step_fn() -> None:
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng[1], cuda_rng[0])
            with _no_logging(pl_module), plugin.train_step_context():
                out = pl_module.training_step(*args)
            loss = _loss_of(out)
            if loss is None or not loss.requires_grad:
                return
            if scaler is not None and getattr(scaler, "is_enabled", lambda: True)():
                loss = scaler.scale(loss)
            loss.backward()

        try:
            nw.replay(step_fn, rng_state=self._rng)
        except Exception as exc:  # nanwatch's own failure must not end the run
            _warn(
                f"nanwatch: the replay of the failing batch failed ({type(exc).__name__}: "
                f"{exc}); the anomaly is reported without its op."
            )

    # ------------------------------------------------------------------ outputs
    def _log(self, pl_module: Any, done: StepTrace) -> None:
        nw = self.watcher
        assert nw is not None
        figures = step_metrics(done, scaled=nw.scaler is not None)
        # a figure is NaN on a step where it is unknown (a logger would repeat the last
        # value); one never known in this run (max_logit in sentinel mode when only a
        # submodule is called) is left out, not logged as a column of NaN
        if done.max_logit is not None:
            self._known.add("nanwatch/max_logit")
        if done.grad_norm is not None:
            self._known.add("nanwatch/grad_norm")
        for name in ("nanwatch/max_logit", "nanwatch/grad_norm"):
            if name not in self._known:
                figures.pop(name, None)
        figures["nanwatch/anomalies"] = float(self._anomalies_before + len(nw.anomalies))
        figures["nanwatch/warnings"] = float(self.warning_count)
        figures["nanwatch/skipped"] = float(len(self.skipped))
        for name, value in figures.items():
            pl_module.log(
                name, value, on_step=True, on_epoch=False, prog_bar=False, logger=True, batch_size=1
            )

    def _record_skip(
        self, trainer: Any, ranks: list[int], world: int, found: list[tuple[int, int]]
    ) -> None:
        nw = self.watcher
        assert nw is not None
        rank = int(getattr(trainer, "global_rank", 0) or 0)
        steps = [s for s, _ in found]
        entry = {
            "epoch": int(trainer.current_epoch),
            "batch_idx": int(self._batch_idx),
            "bad_batches": [b for _, b in found],
            "global_step": int(trainer.global_step),
            "step": nw.step_index,
            "rank": rank,
            "ranks": ranks,
            "what": self._what(steps) if steps else f"an anomaly on {_ranks_text(ranks, world)}",
        }
        self.skipped.append(entry)
        path = Path(nw.config.report_dir) / f"nanwatch-skipped-rank{rank}.jsonl"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
        except OSError as exc:
            _warn(
                f"nanwatch: could not append to the skip list {str(path)!r} ({exc}); the "
                "skipped batches are in callback.skipped."
            )

    def _write_report(self) -> Path | None:
        nw = self.watcher
        assert nw is not None
        path = write_report(nw, announce=False)
        if path is not None:
            self.report_paths.append(path)
        return path

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The flight recorder's per-step summary (loss, gradient norm, max logit, scale,
        anomaly, diagnoses; no per-tensor records) and the counters."""
        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "skipped": [dict(e) for e in self.skipped],
            "replays": self.replays,
            "stopped_at": self.stopped_at,
            "warnings": self.warning_count,
        }
        nw = self.watcher
        if nw is None:
            if self._state is not None:
                keys = ("step", "anomaly_count", "steps", "anomalies")
                state.update({k: self._state[k] for k in keys if k in self._state})
            return state
        ws = nw.state_dict()
        for step in ws["steps"]:  # of the notes, only which ranks saw an anomaly is kept
            step["notes"] = [n for n in step.get("notes", []) if n.get("kind") == "distributed"]
        state.update(
            step=ws["step"],
            anomaly_count=self._anomalies_before + ws["anomaly_count"],
            steps=ws["steps"],
            anomalies=ws["anomalies"],
        )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        version = state_dict.get("version")
        if version != _STATE_VERSION:
            _warn(
                f"nanwatch: the checkpoint's NanWatchCallback state has version {version!r}, "
                f"this nanwatch reads {_STATE_VERSION}; the run's history starts empty."
            )
            return
        self.skipped = [dict(e) for e in state_dict.get("skipped", [])]
        self.replays = int(state_dict.get("replays", 0))
        self.warning_count = int(state_dict.get("warnings", 0))
        self.stopped_at = state_dict.get("stopped_at")
        self._state = dict(state_dict)  # applied to the watcher when it attaches

    def _restore(self, nw: Watcher, state: dict[str, Any]) -> None:
        nw.load_state_dict(
            {
                "version": 1,
                "step": int(state.get("step", 0)),
                "steps": state.get("steps", []),
                "anomalies": state.get("anomalies", []),
            }
        )
        self._anomalies_before = max(0, int(state.get("anomaly_count", 0)) - len(nw.anomalies))
        self._restored = (len(nw.anomalies), len(self.skipped))


if TYPE_CHECKING:
    from lightning.pytorch.callbacks import Callback as _Callback

    class NanWatchCallback(_NanWatch, _Callback):
        """The callback for ``lightning.pytorch`` (built on first use)."""

else:

    def __getattr__(name: str) -> Any:
        if name == "NanWatchCallback":
            return callback_class("lightning.pytorch")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
