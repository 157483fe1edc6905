"""nanwatch's overhead, measured against the tools people use today (issue 8).

One command measures, in one process, the cost of a training step (forward + loss +
backward + optimizer step) of three CPU workloads (see ``workloads.py``) under:

* ``unwatched``: the baseline every ratio is relative to;
* nanwatch ``sentinel``, ``watch``, ``watch`` with ``sample_every=10``, ``forensic``;
* ``torch.autograd.detect_anomaly(check_nan=True)``;
* transformers' ``DebugUnderflowOverflow`` (when transformers is installed);
* guards on/off (``sentinel`` with ``guards=False``: one loss-module call a step, and on W3
  its ``nn.Embedding``'s call too), and the functional-loss step (``F.mse_loss`` /
  ``F.cross_entropy``) unwatched, under ``watch`` with its functional guards (the default),
  and under ``watch`` with ``functional_guards=False``;

then peak RSS and the flight recorder's bytes per step, and, with ``--compile``, what
``torch.compile`` does with nanwatch attached. ``--gpu`` adds a GPT-2-small-sized decoder in
bf16 autocast and in float16 with a GradScaler, when CUDA is available.

How the timing stays honest: every variant is attached (and detached) outside the timed
region and stays attached for its whole block of steps, every watched step calls
``nw.step()``, the variants run in rounds interleaved with each other (A B C, B C A, ...),
warm-up steps are not timed, and each variant's step time is the median of its steps
(``sample_every=10``: the medians of its full and its sentinel steps, weighted 1:9). Ratios
are to the unwatched step of the same run; the bracket is the range of the per-round
ratios. CPU time taken by other processes during the run is measured from /proc/stat and
printed: ratios taken on a busy machine are not worth much. The minor page faults of each
timed step are counted too (``getrusage``): with glibc's default malloc, freed memory goes
back to the OS and is faulted in again, a cost that varies with the heap's layout;
``--malloc steady`` keeps it in the process, so the ratios are nanwatch's own cost.

Usage::

    python benchmarks/run.py                  # the full run (< 5 minutes on 2 cores)
    python benchmarks/run.py --quick          # smoke setting: tiny shapes, seconds
    python benchmarks/run.py --workloads W2 --variants unwatched,watch --rounds 9
    python benchmarks/run.py --compile        # adds torch.compile (slow: compiles)
    python benchmarks/run.py --malloc steady --results benchmarks/RESULTS-steady.md
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime as _dt
import gc
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import tracemalloc
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `nanwatch` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import nanwatch
from benchmarks._timing import Cell, LoadMeter, interleave, to_cells, wait_quiet
from benchmarks.variants import (
    LEAKS,
    NANWATCH_MODES,
    VARIANTS,
    Nanwatch,
    Runner,
    Unwatched,
    make_runners,
)
from benchmarks.workloads import WORKLOADS, Workload, build

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
MEMORY_VARIANTS = ("unwatched", "sentinel", "watch", "forensic", "detect_anomaly", "duo")

# ---------------------------------------------------------------------------- malloc

#: glibc's mallopt parameters (malloc.h: M_TRIM_THRESHOLD -1, M_TOP_PAD -2,
#: M_MMAP_THRESHOLD -3) and the values of ``--malloc steady``: no block below 128 MiB is
#: mmapped (so freeing one never unmaps it), the heap is trimmed only past 1 GiB free at its
#: top, and it grows 64 MiB at a time. Freed memory stays in the process and is reused, so
#: a step takes next to no page faults.
STEADY_MALLOC = (
    ("M_MMAP_THRESHOLD", -3, 128 << 20),
    ("M_TRIM_THRESHOLD", -1, 1 << 30),
    ("M_TOP_PAD", -2, 64 << 20),
)


def _glibc() -> tuple[Any, str] | None:
    """(the C library, its version) when it is glibc; None otherwise."""
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS; Windows: TypeError)
        return None
    version.restype = ctypes.c_char_p
    return libc, version().decode()


def malloc_env() -> dict[str, str]:
    """The environment variables that tune glibc's malloc, as set for this process."""
    return {
        k: v
        for k, v in sorted(os.environ.items())
        if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"
    }


def set_malloc(mode: str) -> tuple[str, bool]:
    """Apply ``--malloc``: ``default`` leaves the C library as it is; ``steady`` calls
    glibc's ``mallopt`` with :data:`STEADY_MALLOC` (process-wide and permanent). Returns
    the setting in effect, in words for RESULTS.md, and whether ``mode`` could be applied."""
    glibc = _glibc()
    lib = f"glibc {glibc[1]}" if glibc else f"not glibc ({platform.libc_ver()[0] or sys.platform})"
    env = malloc_env()
    env_note = "; environment: " + " ".join(f"{k}={v}" for k, v in env.items()) if env else ""
    if mode == "default":
        how = (
            "freed memory goes back to the OS and is faulted in again, so steps pay minor "
            "page faults that vary with the heap's layout: what a user on glibc's default "
            "malloc sees"
            if glibc and not env
            else "the C library's allocator as configured"
        )
        return f"default ({lib}, no mallopt: {how}){env_note}", True
    if glibc is None:
        return (
            f"steady was asked but NOT applied: {lib} has no glibc mallopt; the C library's "
            f"allocator as configured{env_note}",
            False,
        )
    mallopt = glibc[0].mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    failed = [name for name, param, value in STEADY_MALLOC if mallopt(param, value) == 0]
    settings = ", ".join(
        f"{name} {value >> 30} GiB" if value >= 1 << 30 else f"{name} {value >> 20} MiB"
        for name, _, value in STEADY_MALLOC
    )
    if failed:
        return (
            f"steady was asked but NOT fully applied: {lib} mallopt refused "
            f"{', '.join(failed)} (asked: {settings}){env_note}",
            False,
        )
    return (
        f"steady ({lib}, mallopt at start: {settings}: freed memory stays in the process, so "
        f"steps take next to no page faults and the ratios are nanwatch's own cost){env_note}",
        True,
    )


# ---------------------------------------------------------------------------- results


@dataclass
class WorkloadResult:
    name: str
    description: str
    n_modules: int
    cells: dict[str, Cell] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    foreign_load: float | None = None
    memory: dict[str, float] = field(default_factory=dict)  # variant -> peak RSS MiB
    memory_method: str = ""
    rounds: int = 0  #: rounds done (fewer than asked when the budget ran out)
    recorder: dict[str, tuple[float, int]] = field(default_factory=dict)  # bytes/step, records
    seconds: float = 0.0
    timing_s: float = 0.0
    #: where watch's overhead goes (benchmarks.hook_cost.split), when a target failed
    split: Any = None
    #: where sentinel's goes (the same, in sentinel mode), when its target failed
    sentinel_split: Any = None
    #: aten ops per step (forward, backward and optimizer): forensic checks each of them
    aten_ops: int | None = None
    #: µs of one aminmax of a 1 MiB activation just written by a Linear, and of the same
    #: tensor read again (cache-hot)
    read_us: tuple[float, float] | None = None


@dataclass
class Options:
    workloads: Sequence[str] = ("W1", "W2", "W3")
    variants: Sequence[str] = VARIANTS
    rounds: int = 7
    #: timed steps per variant and round, at most (fewer when the budget is short)
    steps: int = 8
    #: seconds of timed rounds per workload that choose the steps (None: always ``steps``)
    budget: float | None = 60.0
    warmup: int = 3
    round_warmup: int = 1
    quick: bool = False
    memory: bool = True
    threads: int = 2
    seed: int = 0


def measure_workload(name: str, opts: Options) -> WorkloadResult:
    """Time every selected variant on workload ``name``, interleaved in rounds; then its
    memory."""
    w = build(name, quick=opts.quick, seed=opts.seed)
    wf = dataclasses.replace(w, functional=True)  # the same model, optimizer and batch
    available = make_runners()
    res = WorkloadResult(name, w.description, w.n_modules)
    runners: list[Runner] = []
    for key in opts.variants:
        r = available[key]
        why = r.unavailable()
        if why is not None:
            res.skipped[key] = why
        else:
            runners.append(r)
    keys = {r.key for r in runners}
    for r in list(runners):  # a ratio needs its baseline in the same run
        if r.baseline not in keys:
            res.skipped[r.key] = f"its baseline {r.baseline!r} was not selected"
            runners.remove(r)
    if not runners:
        return res

    def wl(r: Runner) -> Workload:
        return wf if r.functional else w

    t_start = time.perf_counter()
    meter = LoadMeter().start()
    # warm-up pass (untimed), which also estimates each variant's step time
    est: dict[str, float] = {}
    for r in runners:
        r.attach(wl(r))
        try:
            ts = []
            for _ in range(max(1, opts.warmup)):
                t0 = time.perf_counter()
                r.step(wl(r))
                ts.append(time.perf_counter() - t0)
        finally:
            r.detach()
        est[r.key] = min(ts[1:] or ts)  # min: a busy spell only ever adds time
    n_steps = plan_steps(est, opts)
    base_t = est.get("unwatched", min(est.values()))
    deadline = None if opts.budget is None else time.perf_counter() + 1.25 * opts.budget
    samples = interleave(
        runners,
        wl,
        rounds=opts.rounds,
        steps_for=lambda r: n_steps[r.key],
        round_warmup=lambda r: opts.round_warmup if est[r.key] < 3 * base_t else 0,
        deadline=deadline,
    )
    res.rounds = len({rnd for _, _, rnd in samples[runners[0].key].steps})
    res.foreign_load = meter.stop()
    res.cells = to_cells(runners, samples, opts.rounds)
    res.timing_s = time.perf_counter() - t_start
    if opts.memory:
        measure_memory(w, runners, res, opts.quick)
    res.seconds = time.perf_counter() - t_start
    return res


def plan_steps(est: dict[str, float], opts: Options) -> dict[str, int]:
    """Timed steps per round for each variant: as many as ``opts.budget`` seconds allow
    (at most ``opts.steps``), fewer for slow variants (forensic; detect_anomaly on a big
    model), at least one."""
    base_t = est.get("unwatched", min(est.values()))

    def plan(s: int) -> dict[str, int]:
        return {k: max(1, min(s, round(s * 1.5 * base_t / t))) for k, t in est.items()}

    def warm(t: float) -> int:  # slow variants skip the per-round warm-up step
        return opts.round_warmup if t < 3 * base_t else 0

    best = plan(1)
    for s in range(1, opts.steps + 1):
        p = plan(s)
        per_round = sum((warm(t) + p[k]) * t for k, t in est.items())
        if opts.budget is not None and s > 1 and per_round * opts.rounds > opts.budget:
            break
        best = p
    return best


# ---------------------------------------------------------------------------- memory


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _reset_peak_rss() -> bool:
    """Linux: reset VmHWM (peak RSS) to the current RSS (``clear_refs`` 5, Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_memory(
    w: Workload, runners: Sequence[Runner], res: WorkloadResult, quick: bool
) -> None:
    """Peak RSS of two steps of each variant (VmHWM reset before each), and the Python bytes
    the flight recorder keeps per step (tracemalloc over fresh watchers)."""
    by_key = {r.key: r for r in runners}
    keys = ("unwatched", "watch") if quick else MEMORY_VARIANTS
    if _reset_peak_rss() and _status_kib("VmHWM") is not None:
        res.memory_method = "VmHWM reset by /proc/self/clear_refs before each variant"
        gc.collect()
        for key in keys:
            r = by_key.get(key)
            if r is None:
                continue
            _reset_peak_rss()
            r.attach(w)
            try:
                for _ in range(2):
                    r.step(w)
            finally:
                r.detach()
            peak = _status_kib("VmHWM")
            if peak is not None:
                res.memory[key] = peak / 1024
    else:
        import resource

        res.memory_method = "ru_maxrss of the whole process (no per-variant reset here)"
        res.memory["process"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for key in ("watch",) if quick else ("sentinel", "watch"):
        r = by_key.get(key)
        if not isinstance(r, Nanwatch):
            continue
        fresh = r.fresh()  # an empty flight recorder (ring_size 32 > the steps run here)
        k = 1 if quick else 3
        tracemalloc.start()
        try:
            fresh.attach(w)
            try:
                for _ in range(2):
                    fresh.step(w)
                gc.collect()
                m0 = tracemalloc.get_traced_memory()[0]
                for _ in range(k):
                    fresh.step(w)
                gc.collect()
                m1 = tracemalloc.get_traced_memory()[0]
            finally:
                fresh.detach()
        finally:
            tracemalloc.stop()
        assert fresh.nw is not None
        records = len(fresh.nw.history[-1].records) if fresh.nw.history else 0
        res.recorder[key] = ((m1 - m0) / k, records)


# ---------------------------------------------------------------------------- torch.compile


@dataclass
class CompileResult:
    workload: str
    backend: str
    refused: str = ""
    graphs_plain: int | None = None
    breaks_plain: int | None = None
    graphs_watched: int | None = None
    breaks_watched: int | None = None
    break_reasons: list[str] = field(default_factory=list)
    #: records of one watched step: eager, and per compiled variant (what nanwatch still sees)
    records_eager: int = 0
    records: dict[str, int] = field(default_factory=dict)
    cells: dict[str, Cell] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    compile_s: float = 0.0
    seconds: float = 0.0


def _dedupe(reasons: Sequence[str], limit: int = 6) -> list[str]:
    out: list[str] = []
    for r in reasons:
        line = " ".join(r.split())[:140]
        if line not in out:
            out.append(line)
    return out[:limit]


def measure_compile(name: str, opts: Options, backend: str, rounds: int) -> CompileResult:
    """What torch.compile does with nanwatch: (1) watch(compiled) is refused; (2) graph
    breaks of the model's forward with nanwatch's hooks on the eager modules, counted by
    ``torch._dynamo.explain``; (3) step ratios to the compiled unwatched step: nanwatch on
    the (uncompiled) loss module only, and nanwatch on ``compiled._orig_mod`` (hooks traced
    by dynamo)."""
    import logging

    log = logging.getLogger("torch._dynamo")
    level = log.level
    log.setLevel(logging.ERROR)  # dynamo logs the graph breaks it finds
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # and warns about tracing them
            return _measure_compile(name, opts, backend, rounds)
    finally:
        log.setLevel(level)


def _measure_compile(name: str, opts: Options, backend: str, rounds: int) -> CompileResult:
    import torch._dynamo as dynamo

    t_start = time.perf_counter()
    res = CompileResult(name, backend)
    w = build(name, quick=opts.quick, seed=opts.seed)
    compiled = torch.compile(w.model, backend=backend)
    try:
        nanwatch.watch(compiled, w.criterion)
        res.refused = "accepted (not refused)"
    except nanwatch.ConfigError as exc:
        res.refused = f"ConfigError: {exc}"
    dynamo.reset()
    ex = dynamo.explain(w.model)(w.x)
    res.graphs_plain, res.breaks_plain = ex.graph_count, ex.graph_break_count
    dynamo.reset()
    nw = nanwatch.watch(w.model, w.criterion, mode="watch", on_anomaly="warn")
    counters = dynamo.utils.counters
    counters["graph_break"].clear()
    with nw:
        ex = dynamo.explain(w.model)(w.x)
        nw.step()
    res.graphs_watched, res.breaks_watched = ex.graph_count, ex.graph_break_count
    reasons = [str(b.reason) for b in ex.break_reasons] or list(counters["graph_break"])
    res.break_reasons = _dedupe(reasons)
    dynamo.reset()
    with nw:  # what nanwatch records of an eager step, to compare with the compiled one
        w.step()
        res.records_eager = len(nw.step().records)

    cw = dataclasses.replace(w, model=compiled)  # the step calls the compiled model
    runners: list[Runner] = [
        Unwatched("compiled", "compiled, unwatched"),
        Nanwatch("compiled+loss-watch", "compiled model; nanwatch watch on the loss module",
                 mode="watch", modules=(w.criterion,)),
        Nanwatch("compiled+orig-watch", "compiled model; nanwatch watch on _orig_mod + loss",
                 mode="watch", on_anomaly="warn", modules=(w.model, w.criterion)),
    ]  # fmt: skip
    for r in runners:
        r.baseline = "compiled"
    t0 = time.perf_counter()
    for r in list(runners):  # the first calls compile (and recompile when hooks change)
        try:
            r.attach(cw)
            try:
                for _ in range(2):
                    r.step(cw)
            finally:
                r.detach()
        except Exception as exc:
            res.errors[r.key] = f"{type(exc).__name__}: {str(exc)[:200]}"
            runners.remove(r)
    res.compile_s = time.perf_counter() - t0
    for r in runners:
        if isinstance(r, Nanwatch) and r.nw is not None and r.nw.history:
            res.records[r.key] = len(r.nw.history[-1].records)
    samples = interleave(
        runners, lambda r: cw, rounds=rounds, steps_for=lambda r: min(opts.steps, 4), round_warmup=1
    )
    res.cells = to_cells(runners, samples, rounds)
    dynamo.reset()
    res.seconds = time.perf_counter() - t_start
    return res


# ---------------------------------------------------------------------------- report


def count_aten_ops(name: str, opts: Options) -> int:
    """The aten ops one training step of ``name`` runs (forward, backward, optimizer step):
    forensic mode checks the outputs of each one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            Count.n += 1
            return func(*args, **(kwargs or {}))

    w = build(name, quick=opts.quick, seed=opts.seed)
    w.step()
    with Count():
        w.step()
    return Count.n


def read_cost(repeats: int = 50) -> tuple[float, float]:
    """µs of ``torch.aminmax`` on a 1 MiB float32 activation right after a Linear wrote it
    (as in a training step), and on the same tensor read again (cache-hot): medians."""
    lin, x = torch.nn.Linear(1024, 1024), torch.randn(256, 1024)
    cold: list[float] = []
    hot: list[float] = []
    with torch.no_grad():
        for _ in range(repeats):
            y = lin(x)
            t0 = time.perf_counter()
            torch.aminmax(y)
            t1 = time.perf_counter()
            torch.aminmax(y)
            t2 = time.perf_counter()
            cold.append(t1 - t0)
            hot.append(t2 - t1)
    return sorted(cold)[repeats // 2] * 1e6, sorted(hot)[repeats // 2] * 1e6


def explain(results: Sequence[WorkloadResult], opts: Options) -> None:
    """For every workload with a failed target, measure where the overhead goes: the
    statistics kernels alone over exactly the tensors ``watch`` measures, the rest, and the
    aten ops forensic mode checks."""
    from benchmarks.hook_cost import split

    rounds = 1 if opts.quick else 3
    for r in results:
        failed = {title: cells.get(r.name, "") for title, cells in targets([r])}
        if not any(c.startswith("FAIL") for c in failed.values()):
            continue
        if "watch" in r.cells:
            r.split = split(r.name, opts.quick, rounds)
            r.read_us = read_cost(5 if opts.quick else 50)
        # a sampled-out step of sample_every=10 is a sentinel step: its split tells both
        sentinel_failed = any(
            c.startswith("FAIL")
            for t, c in failed.items()
            if t.startswith(("sentinel <=", "watch sample_every"))
        )
        if "sentinel" in r.cells and sentinel_failed:
            r.sentinel_split = split(r.name, opts.quick, rounds, mode="sentinel")
        if "forensic" in r.cells:
            r.aten_ops = count_aten_ops(r.name, opts)


def why_markdown(results: Sequence[WorkloadResult]) -> list[str]:
    """The 'why' of the failed targets, from the measurements of :func:`explain`."""
    from benchmarks.hook_cost import _PARTS

    out: list[str] = []
    for r in results:
        sp = r.sentinel_split
        if sp is not None:
            out.append(_sentinel_why(r.name, sp, _PARTS))
        sp = r.split
        if sp is not None:
            over = sp.watched_ms - sp.unwatched_ms
            out.append(
                f"- {r.name}, `watch`: {over:.1f} ms a step over {sp.unwatched_ms:.1f} ms "
                f"(x{sp.watched_ms / sp.unwatched_ms:.3f} in this measurement). "
                f"`torch.aminmax` over exactly the {sp.tensors} tensors watch reads a step "
                f"({sp.elements / 1e6:.1f} M elements: every module output and output "
                f"gradient it does not bound by an earlier record), timed alone outside "
                f"training: {sp.aminmax_ms:.2f} ms ({100 * sp.aminmax_ms / sp.unwatched_ms:.1f}"
                f"% of the unwatched step). Inside training, per step: "
                + "; ".join(
                    f"{what} {sp.parts[name]:.2f} ms"
                    for name, what in _PARTS.items()
                    if name in sp.parts
                )
                + ". The statistics reads are one read of each tensor, the floor for a tool "
                "that checks every module's output and gradient"
                + (
                    f"; in a training step the tensor was just written and is read cold: "
                    f"{r.read_us[0]:.0f} µs for a fresh 1 MiB activation against "
                    f"{r.read_us[1]:.0f} µs for the same read cache-hot, measured here."
                    if r.read_us is not None
                    else "."
                )
            )
        if r.aten_ops is not None:
            c = r.cells.get("forensic")
            out.append(
                f"- {r.name}, `forensic`: {r.aten_ops} aten ops a step, each through a "
                "Python TorchDispatchMode that reads its outputs and names the op and the "
                f"line (x{c.ratio:.2f} here): the mode for a replay of the failing step "
                "(`nw.replay`, the Lightning callback, `nanwatch run --mode forensic`), "
                "not for leaving on; 5x below detect_anomaly is out of its reach by design."
                if c is not None
                else f"- {r.name}, `forensic`: {r.aten_ops} aten ops a step."
            )
    return out


def _sentinel_why(name: str, sp: Any, parts: dict[str, str]) -> str:
    """Where sentinel's overhead goes on workload ``name`` (``sp``: a sentinel split): the
    kernels every step needs (one read of each gradient, the root's few tensors) against
    nanwatch's Python."""
    over = sp.watched_ms - sp.unwatched_ms
    fresh, hot = sp.grad_norm_ms
    floor = fresh + sp.aminmax_ms + sp.item_ms
    python = over - floor
    rest = (
        f"The rest, {python:.1f} ms, is Python."
        if python > 0.1 * over
        else "The overhead measured here is no more than those kernels: this split's own "
        "rounds cannot resolve the Python at this step length."
    )
    return (
        f"- {name}, `sentinel`: {over:.1f} ms a step over {sp.unwatched_ms:.1f} ms "
        f"(x{sp.watched_ms / sp.unwatched_ms:.3f} in this measurement). The kernels it "
        f"cannot skip, timed alone outside training: the L2 norms of the {sp.grads} "
        f"parameter gradients ({sp.grad_elements / 1e6:.1f} M elements) {fresh:.2f} ms right "
        f"after a backward wrote them ({hot:.2f} ms cache-hot), and the min-max of the "
        f"{sp.tensors} floating tensors it measures (the root calls' inputs and outputs, the "
        f"gradient of the model's output) {sp.aminmax_ms + sp.item_ms:.2f} ms: together "
        f"x{(sp.unwatched_ms + floor) / sp.unwatched_ms:.3f}, against the target's x1.02. "
        f"{rest} Inside training, per step (each part clock-wrapped, which adds to it): "
        + "; ".join(
            f"{what} {sp.parts[key]:.2f} ms"
            for key, what in parts.items()
            if key in sp.parts and sp.parts[key] >= 0.005
        )
        + ". A sampled-out step of `sample_every=10` is a sentinel step: nine in ten "
        "steps of that variant pay this."
    )


def source_digest() -> str:
    """A short hash of nanwatch's source as it was measured."""
    import hashlib

    h = hashlib.sha256()
    root = Path(nanwatch.__file__).resolve().parent
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def machine_info(opts: Options, digest: str, malloc: str | None = None) -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    try:
        import transformers

        tf = transformers.__version__
    except Exception:
        tf = "not installed"
    commit = "unknown"
    with contextlib.suppress(Exception):
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=HERE,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    info = {
        "cpu": cpu,
        "cores": f"{usable} usable ({os.cpu_count()} online), torch threads {opts.threads}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": tf,
        "nanwatch": f"{nanwatch.__version__}, commit {commit}, source digest {digest} "
        "(sha256 of nanwatch/**/*.py as measured: the working tree may differ from the commit)",
        "scheduling": f"nice {os.nice(0)}"
        + (
            " (raised priority: other processes on this machine got the CPU only when the "
            "benchmark left it idle)"
            if os.nice(0) < 0
            else ""
        ),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    if malloc is not None:
        info["malloc"] = malloc
    return info


def _fmt_ratio(c: Cell | None) -> str:
    return "—" if c is None else f"x{c.ratio:.3f}"


def _fmt_faults(c: Cell | None) -> str:
    return "—" if c is None or not math.isfinite(c.faults) else f"{c.faults:,.0f}"


#: what the page-fault figures are, for RESULTS.md and the README
FAULTS_NOTE = (
    "Minor page faults per timed step (median; `getrusage` `ru_minflt` around each step, "
    "all the process's threads). Each is a fresh 4 KiB page the allocator got from the OS "
    "and the kernel mapped on first touch, about 1 µs each on the 2-core AMD EPYC where "
    "this was measured; with glibc's default malloc the count depends on the heap's "
    "layout and varies between runs of the same code, and a variant's step pays it on top "
    "of its own cost (`--malloc steady` keeps freed memory in the process: next to no "
    "faults)."
)


def targets(results: Sequence[WorkloadResult]) -> list[tuple[str, dict[str, str]]]:
    """The issue's targets, pass/fail per workload."""
    rows: list[tuple[str, dict[str, str]]] = []

    def row(title: str, check: Callable[[WorkloadResult], tuple[bool, str] | None]) -> None:
        cells: dict[str, str] = {}
        for r in results:
            out = check(r)
            cells[r.name] = "n/a" if out is None else f"{'PASS' if out[0] else 'FAIL'} {out[1]}"
        rows.append((title, cells))

    def limit(key: str, bound: float) -> Callable[[WorkloadResult], tuple[bool, str] | None]:
        def check(r: WorkloadResult) -> tuple[bool, str] | None:
            c = r.cells.get(key)
            if c is None:
                return None
            note = ""
            if math.isfinite(c.ci_lo) and c.ci_lo <= bound < c.ci_hi:
                note = f" (within noise: 90% CI {c.ci_lo:.3f}–{c.ci_hi:.3f})"
            return (c.ratio <= bound, f"x{c.ratio:.3f}{note}")

        return check

    row("sentinel <= x1.02", limit("sentinel", 1.02))
    row("watch <= x1.10", limit("watch", 1.10))
    row("watch sample_every=10 <= x1.03", limit("watch-every10", 1.03))

    for key in NANWATCH_MODES:

        def vs_anomaly(r: WorkloadResult, key: str = key) -> tuple[bool, str] | None:
            c, a = r.cells.get(key), r.cells.get("detect_anomaly")
            if c is None or a is None:
                return None
            mine, theirs = c.ratio - 1, a.ratio - 1
            if theirs <= 0:  # nothing to be 5x below: only noise can be compared
                return None
            factor = theirs / mine if mine > 0 else math.inf
            return (factor >= 5, f"{factor:.1f}x less" if mine > 0 else "no overhead")

        row(f"{key}: overhead 5x below detect_anomaly", vs_anomaly)
    return rows


def render_markdown(
    *,
    results: Sequence[WorkloadResult],
    compile_res: Sequence[CompileResult],
    gpu: Any,
    info: dict[str, str],
    opts: Options,
    command: str,
    wall: float,
    walls: dict[str, float],
    leaks: dict[str, str],
) -> str:
    names = [r.name for r in results]
    labels = {k: r.label for k, r in make_runners().items()}
    out: list[str] = []
    add = out.append
    add("# nanwatch benchmark results (issue 8)\n")
    add("Generated by `benchmarks/run.py`; do not edit by hand, re-run it.\n")
    add("## Machine\n")
    for k, v in info.items():
        add(f"- {k}: {v}")
    loads = [f"{r.name} {r.foreign_load:.2f}" for r in results if r.foreign_load is not None]
    if loads:
        add(
            "- CPU used by other processes while timing (cores; 0 = a quiet machine): "
            + ", ".join(loads)
        )
    add(
        f"- wall time of the run: {wall:.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items())
        + ")\n"
    )
    if leaks:
        add("Global state a tool left changed after detaching (put back by the harness, so "
            "the variants after it were measured without it; a bug to fix):\n")  # fmt: skip
        for what, key in leaks.items():
            add(f"- {what} (first seen after `{key}`)")
        add("")
    add("Reproduce:\n")
    add(f"```\n{command}\n```\n")
    add("## Step time, as a ratio to the unwatched step\n")
    add(
        f"{opts.rounds} interleaved rounds asked"
        + (f" (done: {', '.join(f'{r.name} {r.rounds}' for r in results)})" if results else "")
        + "; in each, every variant is attached, runs "
        f"{opts.round_warmup} untimed step(s) (slow variants, over 3x the unwatched step: "
        f"none) and its timed steps (planned from a {opts.warmup}-step warm-up pass, at "
        f"most {opts.steps}, fewer for slow variants), and is detached. Ratio: the median of "
        "the per-round ratios (a variant's median step over the unwatched one's in the same "
        "round); brackets: their range; the targets table flags a verdict whose 90% "
        "bootstrap interval straddles the bound as within noise. The functional-loss rows "
        "are relative to the functional step unwatched.\n"
    )
    add("| variant | " + " | ".join(names) + " |")
    add("|---|" + "---|" * len(names))
    keys = [k for k in VARIANTS if any(k in r.cells or k in r.skipped for r in results)]
    for key in keys:
        cells = []
        for r in results:
            c = r.cells.get(key)
            if c is None:
                cells.append("skipped" if key in r.skipped else "—")
            else:
                cells.append(f"x{c.ratio:.3f} [{c.lo:.2f}–{c.hi:.2f}]")
        add(f"| {labels.get(key, key)} | " + " | ".join(cells) + " |")
    add(
        "\nMedian step time in ms (number of timed steps), and the ratio of the fastest "
        "steps (min/min: other processes only ever add time, so on a busy machine this is "
        "the better guess of the quiet-machine ratio):\n"
    )
    add("| variant | " + " | ".join(names) + " |")
    add("|---|" + "---|" * len(names))
    for key in keys:
        cells = []
        for r in results:
            c = r.cells.get(key)
            cells.append("—" if c is None else f"{c.ms:.1f} ms ({c.n}); min x{c.min_ratio:.3f}")
        add(f"| {labels.get(key, key)} | " + " | ".join(cells) + " |")
    if any(math.isfinite(c.faults) for r in results for c in r.cells.values()):
        add(f"\n{FAULTS_NOTE}\n")
        add("| variant | " + " | ".join(names) + " |")
        add("|---|" + "---|" * len(names))
        for key in keys:
            cells = [_fmt_faults(r.cells.get(key)) for r in results]
            add(f"| {labels.get(key, key)} | " + " | ".join(cells) + " |")
    elif any(r.cells for r in results):
        add("\nMinor page faults per step: not counted here (no `resource` module).")
    skipped = {k: v for r in results for k, v in r.skipped.items()}
    for k, why in skipped.items():
        add(f"\n- {labels.get(k, k)} skipped: {why}")
    add("\nWorkloads:\n")
    for r in results:
        add(f"- {r.name}: {r.description} ({r.n_modules} modules)")
    add("\n## Targets of issue 8\n")
    add("| target | " + " | ".join(names) + " |")
    add("|---|" + "---|" * len(names))
    for title, cells in targets(results):
        add(f"| {title} | " + " | ".join(cells.get(n, "n/a") for n in names) + " |")
    add(
        "\nGPU targets (`watch` <= x1.05, `sentinel` <= x1.01 on a GPT-2-small-sized step): "
        + (
            gpu_summary(gpu)
            if gpu
            else "not measured in this run (no `--gpu`, or no CUDA); see `RESULTS-GPU.md`."
        )
    )
    why = why_markdown(results)
    if why:
        add("\n### Where the overhead goes, for the targets missed (measured in this run)\n")
        out.extend(why)
    if any(r.memory or r.recorder for r in results):
        add("\n## Memory\n")
        method = next((r.memory_method for r in results if r.memory_method), "")
        add(f"Peak RSS over two steps of each variant ({method}), MiB:\n")
        mkeys = [k for k in MEMORY_VARIANTS if any(k in r.memory for r in results)]
        if mkeys:
            add("| variant | " + " | ".join(names) + " |")
            add("|---|" + "---|" * len(names))
            for k in mkeys:
                cells = []
                for r in results:
                    v, b = r.memory.get(k), r.memory.get("unwatched")
                    if v is None:
                        cells.append("—")
                    elif b is not None and k != "unwatched":
                        cells.append(f"{v:.0f} ({v - b:+.0f})")
                    else:
                        cells.append(f"{v:.0f}")
                add(f"| {labels.get(k, k)} | " + " | ".join(cells) + " |")
        add(
            "\nFlight recorder, Python bytes kept per step (tracemalloc over steps 3 to 5 of "
            "a fresh watcher; the ring keeps the last 32 steps):\n"
        )
        add("| mode | " + " | ".join(names) + " |")
        add("|---|" + "---|" * len(names))
        for k in ("sentinel", "watch"):
            cells = []
            for r in results:
                v = r.recorder.get(k)
                if v is None:
                    cells.append("—")
                else:
                    per, n = v
                    cells.append(
                        f"{per / 1024:.1f} KiB/step, {n} records; ring {per * 32 / 2**20:.2f} MiB"
                    )
            add(f"| {k} | " + " | ".join(cells) + " |")
    add("\n## torch.compile\n")
    if not compile_res:
        add("Not measured in this run (`--compile` adds it).")
    for c in compile_res:
        add(f"Workload {c.workload}, backend `{c.backend}` ({c.seconds:.0f} s, of which "
            f"{c.compile_s:.0f} s first calls/compiling):\n")  # fmt: skip
        add(f"- `nanwatch.watch(torch.compile(model))`: {c.refused}")
        add(
            f"- `torch._dynamo.explain(model)` without nanwatch: {c.graphs_plain} graph(s), "
            f"{c.breaks_plain} break(s); with nanwatch `watch` hooks on the eager modules: "
            f"{c.graphs_watched} graph(s), {c.breaks_watched} break(s)."
        )
        if c.break_reasons:
            add("- break reasons (first distinct ones):")
            for reason in c.break_reasons:
                add(f"  - {reason}")
        for k, cell in c.cells.items():
            add(f"- {k}: {cell.ms:.1f} ms/step, x{cell.ratio:.3f} of the compiled unwatched step "
                f"[{cell.lo:.2f}–{cell.hi:.2f}]")  # fmt: skip
        if c.records:
            add(
                f"- records nanwatch kept of one step: eager model {c.records_eager}; "
                + "; ".join(f"{k} {v}" for k, v in c.records.items())
                + " (modules inside a compiled graph are not watched: the hooks step aside while"
                " dynamo compiles, and nanwatch warns once that the compiled model is unwatched)"
            )
        for k, e in c.errors.items():
            add(f"- {k}: failed: {e}")
        add("")
    add("\n## GPU\n")
    add(gpu_markdown(gpu))
    return "\n".join(out) + "\n"


def gpu_summary(gpu: Any) -> str:
    if not gpu or not gpu.get("cells"):
        return "not measured."
    parts = []
    for prec, cells in gpu["cells"].items():
        parts.append(
            f"{prec}: sentinel x{cells['sentinel'].ratio:.3f}, watch x{cells['watch'].ratio:.3f}"
        )
    return "; ".join(parts)


def gpu_markdown(gpu: Any) -> str:
    if not gpu:
        return (
            "Not measured in this run (no `--gpu`, or no CUDA). The GPU numbers are in "
            "`RESULTS-GPU.md` (`python -m benchmarks.gpu --batches 16,64` on a CUDA "
            "machine: the GPT-2-small-sized decoder in bf16 autocast and in float16 with a "
            "GradScaler), and where the time goes on the GPU in `GPU_PROFILE.md`."
        )
    if gpu.get("skipped"):
        return f"Not measured: {gpu['skipped']}"
    lines = [f"Device: {gpu['device']}; {gpu['description']}\n"]
    lines.append("| variant | " + " | ".join(gpu["cells"]) + " |")
    lines.append("|---|" + "---|" * len(gpu["cells"]))
    keys = list(next(iter(gpu["cells"].values())))
    for k in keys:
        row = []
        for cells in gpu["cells"].values():
            c = cells.get(k)
            row.append("—" if c is None else f"x{c.ratio:.3f} {c.ms:.1f} ms")
        lines.append(f"| {k} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def print_table(console: Any, results: Sequence[WorkloadResult]) -> None:
    from rich.table import Table

    labels = {k: r.label for k, r in make_runners().items()}
    t = Table(title="step time / unwatched step: median (range of the per-round ratios)")
    t.add_column("variant")
    for r in results:
        t.add_column(r.name, justify="right")
    for key in VARIANTS:
        if not any(key in r.cells or key in r.skipped for r in results):
            continue
        row = [labels[key]]
        for r in results:
            c = r.cells.get(key)
            if c is None:
                row.append("skipped" if key in r.skipped else "—")
            elif key in ("unwatched", "f-unwatched"):
                row.append(f"{c.ms:.1f} ms/step")
            else:
                row.append(f"x{c.ratio:.3f} ({c.lo:.2f}–{c.hi:.2f})")
        t.add_row(*row)
    console.print(t)
    if any(math.isfinite(c.faults) for r in results for c in r.cells.values()):
        ft = Table(title="minor page faults per timed step (median)")
        ft.add_column("variant")
        for r in results:
            ft.add_column(r.name, justify="right")
        for key in VARIANTS:
            if any(key in r.cells for r in results):
                ft.add_row(labels[key], *(_fmt_faults(r.cells.get(key)) for r in results))
        console.print(ft)
    tt = Table(title="targets of issue 8")
    tt.add_column("target")
    for r in results:
        tt.add_column(r.name, justify="right")
    for title, cells in targets(results):
        styled = []
        for r in results:
            v = cells.get(r.name, "n/a")
            color = "green" if v.startswith("PASS") else "red" if v.startswith("FAIL") else "dim"
            styled.append(f"[{color}]{v}[/]")
        tt.add_row(title, *styled)
    console.print(tt)


# ---------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/run.py",
        description=(
            "Measure nanwatch's overhead per training step against the unwatched step, "
            "torch.autograd.detect_anomaly and transformers' DebugUnderflowOverflow, "
            "interleaved in one process, and write benchmarks/RESULTS.md."
        ),
        epilog=(
            "Variants: " + ", ".join(VARIANTS) + ". A variant whose baseline (unwatched, or "
            "f-unwatched for the functional-loss rows) is not selected is skipped. "
            "Example: python benchmarks/run.py --workloads W2 --variants unwatched,watch "
            "--rounds 9 --no-write"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke setting: tiny shapes, 1 round of 1 step; writes no RESULTS.md "
        "unless --results is given",
    )
    p.add_argument(
        "--workloads",
        default="W1,W2,W3",
        help="comma-separated subset of " + ",".join(WORKLOADS) + " (default: all)",
    )
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated subset of the variants (default: all)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="interleaved rounds (default 7; fewer when --budget runs out; --quick 1)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="at most this many timed steps per variant and round; slow variants get fewer, "
        "and all get fewer when --budget is short (default 8; --quick 1)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="seconds of timed rounds per workload, which set the steps per round "
        "(default 60: the full run takes about 4 minutes on 2 cores; 0: no budget, --steps)",
    )
    p.add_argument(
        "--no-why",
        action="store_true",
        help="skip measuring where the overhead goes when a target is missed",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps per variant before the rounds (default 3; --quick 1)",
    )
    p.add_argument(
        "--round-warmup",
        type=int,
        default=1,
        help="untimed steps after each attach, before the timed ones (default 1)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads (default 2; --quick 1, which a busy CI machine bears better)",
    )
    p.add_argument(
        "--no-memory",
        action="store_true",
        help="skip the peak-RSS and flight-recorder measurements",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also measure torch.compile with nanwatch (compiles: minutes)",
    )
    p.add_argument("--compile-workloads", default="W1", help="workloads for --compile (default W1)")
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend for --compile (default inductor; 'eager' "
        "traces with dynamo only, fast)",
    )
    p.add_argument(
        "--gpu",
        action="store_true",
        help="also run the GPT-2-small-sized decoder on CUDA (bf16 autocast, and "
        "float16 with GradScaler); skipped with a note when CUDA is absent",
    )
    p.add_argument("--gpu-batch", type=int, default=16, help="batch of the GPU run (default 16)")
    p.add_argument(
        "--gpu-seq", type=int, default=1024, help="sequence length of the GPU run (default 1024)"
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="first wait up to SECONDS for other processes to leave the CPU idle",
    )
    p.add_argument(
        "--results",
        type=Path,
        default=None,
        help=f"where to write the markdown (default {RESULTS.relative_to(HERE.parent)})",
    )
    p.add_argument("--no-write", action="store_true", help="print only; write no results file")
    p.add_argument(
        "--malloc",
        choices=("default", "steady"),
        default="default",
        help="default: the C library's allocator as it is (what a user on glibc's default "
        "malloc sees, page faults included); steady: glibc mallopt at start (mmap threshold "
        "128 MiB, trim threshold 1 GiB, top pad 64 MiB) so freed memory stays in the process "
        "and no step pays page faults: the ratios are nanwatch's own cost. Give --results "
        "to keep both files",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of models and batches (default 0)")
    return p.parse_args(argv)  # fmt: skip


def _split(value: str, allowed: Sequence[str], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise SystemExit(
            f"run.py: unknown {what} {', '.join(bad) or '(none given)'}; "
            f"choose from {', '.join(allowed)}"
        )
    return items


@dataclass
class RunOutput:
    results: list[WorkloadResult]
    compile: list[CompileResult]
    gpu: Any
    markdown: str
    wall: float
    path: Path | None
    malloc: str = ""  #: the malloc setting in effect, in words


def main(argv: Sequence[str] | None = None) -> RunOutput:
    from rich.console import Console

    args = parse_args(argv)
    console = Console()
    malloc, applied = set_malloc(args.malloc)  # first: before any workload is allocated
    if not applied:
        console.print(f"[yellow]warning: --malloc {args.malloc}: {malloc}")
    elif args.malloc != "default":
        console.print(f"[dim]malloc: {malloc}")
    q = args.quick
    opts = Options(
        workloads=_split(args.workloads, tuple(WORKLOADS), "workload"),
        variants=_split(args.variants, VARIANTS, "variant"),
        rounds=args.rounds if args.rounds is not None else (1 if q else 7),
        steps=args.steps if args.steps is not None else (1 if q else 8),
        budget=args.budget if args.budget > 0 else None,
        warmup=args.warmup if args.warmup is not None else (1 if q else 3),
        round_warmup=args.round_warmup,
        quick=q,
        memory=not args.no_memory,
        threads=args.threads if args.threads is not None else (1 if q else 2),
        seed=args.seed,
    )
    torch.set_num_threads(opts.threads)
    warnings.filterwarnings("ignore", message=".*[Aa]nomaly [Dd]etection.*")
    digest = source_digest()  # now: others may edit the tree while this runs
    if args.wait_quiet > 0:
        load = wait_quiet(args.wait_quiet, report=lambda m: console.print(f"[dim]{m}"))
        if load is not None:
            console.print(f"[dim]other processes use {load:.2f} cores; starting")
    t0 = time.perf_counter()
    results: list[WorkloadResult] = []
    for name in opts.workloads:
        with console.status(f"measuring {name} ..."):
            r = measure_workload(name, opts)
        results.append(r)
        load = "" if r.foreign_load is None else f", other processes {r.foreign_load:.2f} cores"
        console.print(
            f"[bold]{name}[/] done in {r.seconds:.0f} s (timing {r.timing_s:.0f} s, "
            f"{r.rounds} rounds){load}"
        )
        if r.foreign_load is not None and r.foreign_load > 0.2:
            console.print(
                f"[yellow]warning: other processes used {r.foreign_load:.2f} cores while {name} "
                "was timed; its ratios are unreliable (--wait-quiet helps)"
            )
    if not args.no_why:
        with console.status("where the overhead goes ..."):
            t1 = time.perf_counter()
            explain(results, opts)
    walls = {"workloads": time.perf_counter() - t0}
    if not args.no_why:
        walls["why"] = time.perf_counter() - t1
    compile_res: list[CompileResult] = []
    if args.compile:
        for name in _split(args.compile_workloads, tuple(WORKLOADS), "workload"):
            with console.status(f"torch.compile on {name} ..."):
                compile_res.append(
                    measure_compile(name, opts, args.compile_backend, max(1, opts.rounds - 2))
                )
            console.print(f"torch.compile on {name} done in {compile_res[-1].seconds:.0f} s")
    gpu: Any = None
    if args.gpu:
        from benchmarks import gpu as gpu_bench

        if torch.cuda.is_available():
            with console.status("GPU decoder ..."):
                gpu = gpu_bench.run(
                    batch=args.gpu_batch,
                    seq=args.gpu_seq,
                    rounds=opts.rounds,
                    steps=min(opts.steps, 4),
                )
        else:
            gpu = {"skipped": "--gpu was given but CUDA is not available on this machine."}
            console.print("[yellow]--gpu: CUDA is not available here; GPU variant skipped")
    wall = time.perf_counter() - t0
    if compile_res:
        walls["torch.compile"] = sum(c.seconds for c in compile_res)
    if isinstance(gpu, dict) and "seconds" in gpu:
        walls["GPU"] = gpu["seconds"]
    print_table(console, results)
    for c in compile_res:
        console.print(
            f"torch.compile {c.workload}: watch(compiled) -> {c.refused[:60]}...; graph breaks "
            f"{c.breaks_plain} unwatched, {c.breaks_watched} with nanwatch hooks; "
            + ", ".join(f"{k} x{v.ratio:.3f}" for k, v in c.cells.items())
        )
    for what, key in LEAKS.items():
        console.print(f"[red]leak: {what} (after {key}); put back by the harness")
    console.print(
        f"wall time: {wall:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in walls.items())})"
    )
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in malloc_env().items())
    prefix += f"nice -n {os.nice(0)} " if os.nice(0) else ""
    command = (
        prefix
        + "python benchmarks/run.py "
        + " ".join(sys.argv[1:] if argv is None else list(argv))
    )
    md = render_markdown(
        results=results,
        compile_res=compile_res,
        gpu=gpu,
        info=machine_info(opts, digest, malloc),
        opts=opts,
        command=command.strip(),
        wall=wall,
        walls=walls,
        leaks=dict(LEAKS),
    )
    path: Path | None = None
    if not args.no_write and (args.results is not None or not q):
        path = args.results or RESULTS
        path.write_text(md)
        console.print(f"wrote {path}")
    return RunOutput(results, compile_res, gpu, md, wall, path, malloc)


if __name__ == "__main__":
    main()
