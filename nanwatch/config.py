"""WatchConfig: what to watch, what to do on an anomaly, and the thresholds rules use."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from nanwatch.errors import ConfigError

Mode = Literal["sentinel", "watch", "forensic"]
OnAnomaly = Literal["raise", "warn", "record"]

MODES: tuple[str, ...] = get_args(Mode)
ON_ANOMALY: tuple[str, ...] = get_args(OnAnomaly)


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(
            name,
            value,
            f"`{name}` can be {', '.join(map(repr, allowed))}; got {value!r}.",
        )


def _positive_int(name: str, value: object, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(name, value, f"`{name}` must be an integer >= {minimum}; got {value!r}.")


def _positive_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(name, value, f"`{name}` must be a number > 0; got {value!r}.")


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    """Numbers the rules compare against. Dtype limits always come from ``torch.finfo``;
    these are only the factors and counts applied to them.

    Example:
        >>> Thresholds(headroom=0.25).headroom
        0.25
    """

    #: warn when max |x| of a low-precision tensor reaches this fraction of the dtype's
    #: largest finite value (0.5 = "within a factor of 2").
    headroom: float = 0.5
    #: warn when the exp/softmax input bound log(finfo.max) is within this factor.
    exp_headroom: float = 0.8
    #: a gradient norm this many times the median of the recent history is a spike.
    explode_factor: float = 10.0
    #: steps of history needed before the spike and trend rules speak.
    min_history: int = 4
    #: a module whose gradients are all exactly zero for this many recorded steps is dead.
    vanish_steps: int = 5
    #: a loss this many times the per-element clamp (BCE's 100) marks saturation.
    bce_saturated_fraction: float = 0.001
    #: GradScaler: this many consecutive skipped steps is a collapse.
    scaler_skips: int = 5
    #: predict overflow when the trend reaches the limit within this many steps.
    trend_horizon: int = 50
    #: NW206: max |logit| at ignore_index positions this many times the trained positions'.
    ignored_logit_factor: float = 1.5
    #: NW103/NW104 speak once a value reached this fraction of its limit.
    trend_floor: float = 0.25

    def __post_init__(self) -> None:
        for name in (
            "headroom",
            "exp_headroom",
            "explode_factor",
            "bce_saturated_fraction",
            "ignored_logit_factor",
            "trend_floor",
        ):
            _positive_float(name, getattr(self, name))
        for name in ("min_history", "vanish_steps", "scaler_skips", "trend_horizon"):
            _positive_int(name, getattr(self, name))
        for name in ("headroom", "exp_headroom", "trend_floor"):
            if getattr(self, name) > 1:
                raise ConfigError(
                    name,
                    getattr(self, name),
                    f"`{name}` is a fraction of the dtype's limit and must be in (0, 1]; "
                    f"got {getattr(self, name)!r}.",
                )


@dataclass(frozen=True, kw_only=True)
class WatchConfig:
    """Everything :func:`nanwatch.watch` accepts, validated once.

    Example:
        >>> cfg = WatchConfig(mode="sentinel", on_anomaly="warn")
        >>> cfg.mode, cfg.sample_every
        ('sentinel', 1)
    """

    #: ``"sentinel"``: roots' inputs and outputs (the loss), parameter gradients and
    #: weights; ``"watch"``: every module's outputs and output gradients;
    #: ``"forensic"``: watch plus a check after every aten op, forward and backward.
    mode: Mode = "watch"
    #: what to do when the first anomaly is known: raise :class:`nanwatch.AnomalyError`,
    #: warn once, or only record it for the report.
    on_anomaly: OnAnomaly = "raise"
    #: run ``mode`` every N steps and ``sentinel`` in between.
    sample_every: int = 1
    #: steps of records kept by the flight recorder (bounded memory).
    ring_size: int = 32
    #: where post-mortem reports go.
    report_dir: str = "nanwatch-reports"
    #: write a post-mortem report when the code inside ``watch`` raises.
    postmortem: bool = True
    #: module-path patterns (``fnmatch``) whose non-finite values are intended.
    allow: tuple[str, ...] = ()
    #: diagnosis codes to silence (``["NW201"]``).
    ignore: tuple[str, ...] = ()
    #: check the inputs of losses and embeddings before their kernels run.
    guards: bool = True
    #: also guard functional losses (``F.cross_entropy``), ``F.embedding`` and ``F.one_hot``
    #: (wrapped in ``torch.nn.functional`` while attached: other calls cost nothing).
    functional_guards: bool = True
    #: re-run the producing module under an op checker to name the aten op.
    pinpoint: bool = True
    #: a step is flushed early when it holds this many records (a loop without steps).
    max_records_per_step: int = 200_000
    thresholds: Thresholds = field(default_factory=Thresholds)

    def __post_init__(self) -> None:
        _choice("mode", self.mode, MODES)
        _choice("on_anomaly", self.on_anomaly, ON_ANOMALY)
        _positive_int("sample_every", self.sample_every)
        _positive_int("ring_size", self.ring_size)
        _positive_int("max_records_per_step", self.max_records_per_step, minimum=100)
        if not isinstance(self.report_dir, (str, os.PathLike)):
            raise ConfigError(
                "report_dir",
                self.report_dir,
                f"`report_dir` must be a path; got {type(self.report_dir).__name__}.",
            )
        object.__setattr__(self, "report_dir", os.fspath(self.report_dir))
        allow: object = self.allow
        if isinstance(allow, str):
            allow = (allow,)
        if not isinstance(allow, (tuple, list)) or not all(isinstance(p, str) for p in allow):
            raise ConfigError(
                "allow", self.allow, f"`allow` must be module-path patterns (str); got {allow!r}."
            )
        object.__setattr__(self, "allow", tuple(allow))
        ignore: object = self.ignore
        if isinstance(ignore, str):
            ignore = (ignore,)
        if not isinstance(ignore, (tuple, list)) or not all(isinstance(c, str) for c in ignore):
            raise ConfigError(
                "ignore",
                self.ignore,
                f"`ignore` must be diagnosis codes like 'NW201'; got {ignore!r}.",
            )
        codes = tuple(c.strip().upper() for c in ignore)
        bad = next((c for c in codes if not re.fullmatch(r"NW\d{3}", c)), None)
        if bad is not None:
            raise ConfigError(
                "ignore",
                self.ignore,
                f"`ignore` must be diagnosis codes like 'NW201' (`nanwatch rules` lists "
                f"them); got {bad!r}.",
            )
        object.__setattr__(self, "ignore", codes)
        for name in ("postmortem", "guards", "functional_guards", "pinpoint"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(
                    name,
                    value,
                    f"`{name}` must be True or False; got {value!r} ({type(value).__name__}).",
                )
        if not isinstance(self.thresholds, Thresholds):
            raise ConfigError(
                "thresholds",
                self.thresholds,
                "`thresholds` must be a nanwatch.Thresholds; "
                f"got {type(self.thresholds).__name__}.",
            )

    def replace(self, **changes: Any) -> WatchConfig:
        """A copy with ``changes`` applied (and validated)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            name = sorted(unknown)[0]
            raise ConfigError(
                name,
                changes[name],
                f"unknown option `{name}`; known: "
                f"{', '.join(f.name for f in dataclasses.fields(self))}.",
            )
        return dataclasses.replace(self, **changes)
