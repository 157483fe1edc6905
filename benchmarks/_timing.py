"""Interleaved timing, robust per-step estimates, the page faults each step took, and how
busy the machine was meanwhile."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.variants import Runner

__all__ = [
    "Cell",
    "LoadMeter",
    "Samples",
    "bootstrap_median",
    "interleave",
    "minor_faults",
    "to_cells",
    "wait_quiet",
]


def minor_faults() -> int | None:
    """Minor page faults this process (all its threads) has taken so far: each is a fresh
    page the allocator got from the OS and the kernel mapped on first touch. None where the
    ``resource`` module is missing (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


@dataclass
class Samples:
    """The timed steps of one variant on one workload: (seconds, full step, round), and
    the minor page faults each step took, in the same order (empty where they cannot be
    counted)."""

    steps: list[tuple[float, bool, int]] = field(default_factory=list)
    faults: list[int] = field(default_factory=list)

    def faults_per_step(self, period: int = 1) -> float:
        """Minor page faults per step, weighted as :meth:`estimate` weights the times (the
        median; for ``sample_every=N`` full and sampled-out steps 1:(N-1)); NaN when they
        were not counted."""
        if not self.faults or len(self.faults) != len(self.steps):
            return math.nan
        as_steps = [
            (float(f), full, rnd) for f, (_, full, rnd) in zip(self.faults, self.steps, strict=True)
        ]
        return Samples(as_steps).estimate(period)

    def estimate(
        self, period: int = 1, rnd: int | None = None, *, stat: Callable[..., float] | None = None
    ) -> float:
        """Per-step time: the median (or ``stat``, e.g. ``min``); for ``sample_every=N`` the
        medians of full and of sampled-out steps weighted 1:(N-1) (the full-step median
        always over all rounds, since one round may hold none), or the mean when one kind
        is missing."""
        agg = stat or statistics.median
        pick = [s for s in self.steps if rnd is None or s[2] == rnd]
        if not pick:
            return math.nan
        if period == 1:
            return agg([dt for dt, _, _ in pick])
        full = [dt for dt, f, _ in self.steps if f]
        light = [dt for dt, f, _ in pick if not f]
        if full and light:
            return (agg(full) + (period - 1) * agg(light)) / period
        return statistics.fmean(dt for dt, _, _ in pick)


@dataclass
class Cell:
    """A variant's result on a workload."""

    ms: float  #: per-step milliseconds
    ratio: float  #: to its baseline's per-step time
    lo: float  #: lowest per-round ratio
    hi: float  #: highest per-round ratio
    n: int  #: timed steps
    #: the ratio of the fastest steps (min over the run): less sensitive to other processes
    #: taking the CPU, which only ever adds time
    min_ratio: float = math.nan
    #: 90% bootstrap interval of the ratio (the median of the per-round ratios)
    ci_lo: float = math.nan
    ci_hi: float = math.nan
    #: minor page faults per timed step (median; NaN where they cannot be counted)
    faults: float = math.nan


def interleave(
    runners: Sequence[Runner],
    workload_for: Callable[[Runner], Any],
    *,
    rounds: int,
    steps_for: Callable[[Runner], int],
    round_warmup: int | Callable[[Runner], int] = 1,
    sync: Callable[[], None] | None = None,
    deadline: float | None = None,
    min_rounds: int = 2,
) -> dict[str, Samples]:
    """Run ``rounds`` rounds; in each, every runner in turn (the order rotated by one each
    round: A B C, B C A, C A B) is attached, runs ``round_warmup`` untimed steps and
    ``steps_for(runner)`` timed ones, and is detached. ``sync`` (CUDA) runs before each
    clock read. Past ``deadline`` (a ``time.perf_counter()`` value) no new round starts
    once ``min_rounds`` are done: a busy machine shortens the run instead of stretching it.
    The minor page faults of each timed step are counted around it, outside the clock reads."""
    samples = {r.key: Samples() for r in runners}
    clock = time.perf_counter
    count_faults = minor_faults() is not None
    for rnd in range(rounds):
        if deadline is not None and rnd >= min_rounds and clock() > deadline:
            break
        shift = rnd % len(runners) if runners else 0
        for r in list(runners[shift:]) + list(runners[:shift]):
            w = workload_for(r)
            r.attach(w)
            try:
                for _ in range(round_warmup(r) if callable(round_warmup) else round_warmup):
                    r.step(w)
                n = steps_for(r)
                for _ in range(n):
                    if sync is not None:
                        sync()
                    f0 = minor_faults() if count_faults else None
                    t0 = clock()
                    full = r.step(w)
                    if sync is not None:
                        sync()
                    t1 = clock()
                    if f0 is not None:
                        samples[r.key].faults.append((minor_faults() or f0) - f0)
                    samples[r.key].steps.append((t1 - t0, full, rnd))
            finally:
                r.detach()
    return samples


def to_cells(
    runners: Sequence[Runner], samples: dict[str, Samples], rounds: int
) -> dict[str, Cell]:
    """Per-step time and ratio to each runner's baseline, with the per-round range. The
    ratio is the median of the per-round ratios (each pairs a variant with the baseline
    steps of the same round, so that a busy spell of the machine hits both) when there
    are three rounds or more, else the ratio of the medians."""
    out: dict[str, Cell] = {}
    for r in runners:
        if r.baseline not in samples:
            continue
        s, b = samples[r.key], samples[r.baseline]
        est_v, est_b = s.estimate(r.sample_every), b.estimate(1)
        done = {rnd for _, _, rnd in b.steps}
        per_round = [
            s.estimate(r.sample_every, k) / b.estimate(1, k) for k in range(rounds) if k in done
        ]
        per_round = [x for x in per_round if math.isfinite(x)] or [math.nan]
        low = s.estimate(r.sample_every, stat=min) / b.estimate(1, stat=min)
        ratio = statistics.median(per_round) if len(per_round) >= 3 else est_v / est_b
        lo_ci, hi_ci = bootstrap_median(per_round) if len(per_round) >= 3 else (ratio, ratio)
        out[r.key] = Cell(
            est_v * 1e3,
            ratio,
            min(per_round),
            max(per_round),
            len(s.steps),
            low,
            lo_ci,
            hi_ci,
            s.faults_per_step(r.sample_every),
        )
    return out


def bootstrap_median(xs: Sequence[float], *, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """5th and 95th percentiles of the median of ``xs`` resampled with replacement."""
    import random

    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return meds[int(0.05 * n)], meds[int(0.95 * n) - 1]


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy jiffies of the whole machine, jiffies of this process), from /proc (Linux)."""
    try:
        with open("/proc/stat") as f:
            parts = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        idle = parts[3] + (parts[4] if len(parts) > 4 else 0)  # idle + iowait
        return sum(parts[:8]) - idle, int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


class LoadMeter:
    """CPU (in cores) that *other* processes used between :meth:`start` and :meth:`stop`;
    None where /proc is not there."""

    def __init__(self) -> None:
        self._t0 = 0.0
        self._j0: tuple[int, int] | None = None

    def start(self) -> LoadMeter:
        self._t0, self._j0 = time.monotonic(), _cpu_jiffies()
        return self

    def stop(self) -> float | None:
        j1 = _cpu_jiffies()
        dt = time.monotonic() - self._t0
        if self._j0 is None or j1 is None or dt <= 0:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        foreign = (j1[0] - self._j0[0]) - (j1[1] - self._j0[1])
        return max(0.0, foreign / hz / dt)


def wait_quiet(
    max_wait: float, *, threshold: float = 0.15, report: Callable[[str], None] | None = None
) -> float | None:
    """Wait (up to ``max_wait`` seconds) for a 3-second window in which other processes use
    less than ``threshold`` cores; returns the last load seen."""
    deadline = time.monotonic() + max_wait
    while True:
        m = LoadMeter().start()
        time.sleep(3.0)
        load = m.stop()
        if load is None or load < threshold or time.monotonic() > deadline:
            return load
        if report is not None:
            report(f"waiting for a quiet machine: other processes use {load:.2f} cores")
