"""Where nanwatch's time goes, per module and per step (issue 8).

Three measurements, printed and written to ``benchmarks/HOOK_COST.md``:

1. **Per-module cost** on a model of many tiny modules (``Linear(8, 8)`` x 200, batch 4),
   where the kernels are negligible and the hooks dominate: the step time of each variant
   minus the unwatched one, divided by the number of modules, split into forward and
   backward. ``bare hooks`` registers no-op hooks of the same kinds nanwatch uses (forward
   pre-hook and forward hook with kwargs, a tensor hook on each output): the floor PyTorch's
   hook dispatch sets before nanwatch does any work.
2. **Per-hook cost**: nanwatch's hooks wrapped with a clock (the wrapper's own cost
   calibrated and subtracted): microseconds per call of the forward pre-hook, the forward
   hook, the gradient hook, the end-of-backward check and ``nw.step()``.
3. **Primitives**: what the hooks are made of, timed alone on the same tiny tensors
   (``torch.aminmax``, reading a 0-d tensor, ``Tensor.register_hook``, building a Record).
4. **Profile**: cProfile of watched W2 steps, nanwatch's functions by self time, with the
   torch built-ins nanwatch calls attributed to it (cProfile inflates Python-heavy code:
   compare its total with the measured overhead).
5. **Guards**: microseconds per call of each guard on W3 (its ``nn.Embedding`` and its
   ``CrossEntropyLoss``), the guard pre-hooks wrapped with the same clock as in 2.

Usage::

    python benchmarks/hook_cost.py            # about a minute
    python benchmarks/hook_cost.py --quick    # smoke setting
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime as _dt
import math
import os
import pstats
import statistics
import sys
import time
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `nanwatch` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

import nanwatch
from benchmarks._timing import LoadMeter
from benchmarks.workloads import build
from nanwatch._compat import aminmax

HERE = Path(__file__).resolve().parent
OUT = HERE / "HOOK_COST.md"
NANWATCH_DIR = os.path.dirname(nanwatch.__file__) + os.sep


# ---------------------------------------------------------------------------- 1. per module


class BareHooks:
    """No-op hooks of the kinds nanwatch registers: the floor of PyTorch's hook dispatch."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.handles: list[Any] = []
        self._n_module_handles = 2 * sum(1 for _ in model.modules())

    def attach(self) -> None:
        def pre(module: nn.Module, args: Any, kwargs: Any) -> None:
            return None

        def on_grad(g: torch.Tensor) -> None:
            return None

        def post(module: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
            if isinstance(out, torch.Tensor) and out.requires_grad:
                self.handles.append(out.register_hook(on_grad))

        for m in self.model.modules():
            self.handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            self.handles.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))

    def step(self) -> None:
        # tensor-hook handles of the step die with the step
        for h in self.handles[self._n_module_handles :]:
            h.remove()
        del self.handles[self._n_module_handles :]

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


@dataclass
class PerModule:
    variant: str
    fwd_ms: float
    bwd_ms: float
    fwd_us_per_module: float
    bwd_us_per_module: float
    step_us_per_module: float


def tiny_model(n: int, width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])


def _time_phases(
    model: nn.Module, x: torch.Tensor, end_step: Callable[[], Any], repeats: int
) -> tuple[list[float], list[float], list[float]]:
    """Seconds of forward, of backward, and of end_step(), for each of ``repeats`` steps."""
    fwd, bwd, ends = [], [], []
    clock = time.perf_counter
    for _ in range(repeats):
        t0 = clock()
        out = model(x)
        t1 = clock()
        out.sum().backward()
        t2 = clock()
        end_step()
        t3 = clock()
        for p in model.parameters():
            p.grad = None
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
        ends.append(t3 - t2)
    return fwd, bwd, ends


def per_module(n: int, repeats: int, rounds: int) -> list[PerModule]:
    """Step time of the tiny model per variant (interleaved rounds, medians), minus the
    unwatched one, per module."""
    model = tiny_model(n)
    x = torch.randn(4, 8)
    n_modules = sum(1 for _ in model.modules())
    variants: dict[str, tuple[Callable[[], Any], Callable[[], Any], Callable[[], Any]]] = {}
    bare = BareHooks(model)
    variants["unwatched"] = (lambda: None, lambda: None, lambda: None)
    variants["bare hooks"] = (bare.attach, bare.step, bare.detach)
    for mode in ("sentinel", "watch"):
        nw = nanwatch.watch(model, mode=mode)
        variants[f"nanwatch {mode}"] = (nw.attach, nw.step, nw.detach)
    times: dict[str, tuple[list[float], list[float], list[float]]] = {
        k: ([], [], []) for k in variants
    }
    keys = list(variants)
    for rnd in range(rounds + 1):
        for k in keys[rnd % len(keys) :] + keys[: rnd % len(keys)]:
            attach, end, detach = variants[k]
            attach()
            try:
                _time_phases(model, x, end, 3)  # warm-up
                f, b, e = _time_phases(model, x, end, repeats)
            finally:
                detach()
            if rnd:  # round 0 is a warm-up round
                times[k][0].extend(f)
                times[k][1].extend(b)
                times[k][2].extend(e)
    med = {k: tuple(statistics.median(v) for v in t) for k, t in times.items()}
    f0, b0, e0 = med["unwatched"]
    out = []
    for k, (f, b, e) in med.items():
        df, db, de = f - f0, b - b0, e - e0
        out.append(
            PerModule(
                k,
                f * 1e3,
                b * 1e3,
                df / n_modules * 1e6,
                db / n_modules * 1e6,
                (df + db + de) / n_modules * 1e6,
            )
        )
    return out


# ---------------------------------------------------------------------------- 2. per hook


@dataclass
class Clock:
    ns: list[int] = field(default_factory=list)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        ns = self.ns
        clock = time.perf_counter_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                ns.append(clock() - t0)

        return timed

    def us(self, overhead_ns: float) -> float:
        return (statistics.median(self.ns) - overhead_ns) / 1e3 if self.ns else float("nan")


def _wrapper_overhead() -> float:
    c = Clock()
    f = c.wrap(lambda *a, **k: None)
    for _ in range(20000):
        f(1, 2, 3)
    return float(statistics.median(c.ns))


def per_hook(model: nn.Module, x: torch.Tensor, mode: str, steps: int) -> dict[str, Any]:
    """Median microseconds per call of each of nanwatch's hooks on ``model`` (wrapped with
    a clock after attach; the gradient and end-of-backward hooks through the Watcher's
    bound methods, which the hooks look up on each call)."""
    nw = nanwatch.watch(model, mode=mode)
    clocks = {k: Clock() for k in ("pre-hook", "forward hook", "gradient hook", "end of backward")}
    nw.attach()
    try:
        for m in model.modules():
            for k, fn in list(m._forward_pre_hooks.items()):
                m._forward_pre_hooks[k] = clocks["pre-hook"].wrap(fn)
            for k, fn in list(m._forward_hooks.items()):
                m._forward_hooks[k] = clocks["forward hook"].wrap(fn)
        # instance attributes shadow the methods the hooks call (private API: a probe)
        nw._on_grad = clocks["gradient hook"].wrap(nw._on_grad)  # type: ignore[method-assign]
        nw._end_of_backward = clocks["end of backward"].wrap(nw._end_of_backward)  # type: ignore[method-assign]
        step_clock = Clock()
        for i in range(steps + 2):
            out = model(x)
            out.sum().backward()
            t0 = time.perf_counter_ns()
            trace = nw.step()
            if i >= 2:
                step_clock.ns.append(time.perf_counter_ns() - t0)
            for p in model.parameters():
                p.grad = None
            if i < 2:  # warm-up
                for c in clocks.values():
                    c.ns.clear()
    finally:
        nw.detach()
    overhead = _wrapper_overhead()
    calls = {k: len(c.ns) / steps for k, c in clocks.items()}
    us = {k: c.us(overhead) for k, c in clocks.items()}
    us["nw.step()"] = statistics.median(step_clock.ns) / 1e3
    calls["nw.step()"] = 1
    return {"us": us, "calls": calls, "records": len(trace.records), "wrapper_ns": overhead}


# ---------------------------------------------------------------------------- 5. guards


@dataclass
class GuardCost:
    module: str  # "embed (Embedding)"
    inputs: str  # its first input: "(16, 128) int64"
    calls: float  # per step
    us: float  # median per call, the clock's own cost subtracted


def _timed_guard(
    timed: Callable[..., Any], label: str, shapes: dict[str, str]
) -> Callable[..., Any]:
    """A guard pre-hook wrapped with a clock; notes its first input's shape (untimed)."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = args[0] if args else None
        if label not in shapes and isinstance(x, torch.Tensor):
            shapes[label] = f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
        return timed(module, args, kwargs)

    return hook


def guard_cost(workload: str, quick: bool, steps: int) -> list[GuardCost]:
    """Median microseconds per call of each guard pre-hook on ``workload``'s modules (under
    ``sentinel``, so the guard is the only hook of a non-root module), clock-wrapped."""
    w = build(workload, quick=quick)
    nw = nanwatch.watch(*w.modules(), mode="sentinel")
    clocks: dict[str, Clock] = {}
    shapes: dict[str, str] = {}
    named = [(n or type(m).__name__, m) for n, m in w.model.named_modules()]
    named.append((type(w.criterion).__name__, w.criterion))
    nw.attach()
    try:
        for name, m in named:
            for k, fn in list(m._forward_pre_hooks.items()):
                if getattr(fn, "__name__", "") != "guard_pre_hook":
                    continue
                label = f"{name} ({type(m).__name__})"
                clock = clocks.setdefault(label, Clock())
                m._forward_pre_hooks[k] = _timed_guard(clock.wrap(fn), label, shapes)
        for i in range(steps + 2):
            w.step()
            nw.step()
            if i < 2:  # warm-up
                for c in clocks.values():
                    c.ns.clear()
    finally:
        nw.detach()
    overhead = _wrapper_overhead()
    return [
        GuardCost(label, shapes.get(label, ""), len(c.ns) / steps, c.us(overhead))
        for label, c in clocks.items()
    ]


# ---------------------------------------------------------------------------- 3. primitives


def primitives(number: int) -> dict[str, float]:
    """Microseconds per call of the operations a hook is made of, on a (4, 8) tensor."""
    from nanwatch.records import Phase, Record, TensorStat

    t = torch.randn(4, 8, requires_grad=True)
    y = t * 2
    a, b = torch.aminmax(y.detach())

    def hook(g: torch.Tensor) -> None:
        return None

    def register() -> None:
        y.register_hook(hook).remove()

    def record() -> None:
        Record(
            index=0,
            step=0,
            phase=Phase.FORWARD,
            path="a.b",
            role="output",
            dtype="float32",
            device="cpu",
            shape=tuple(y.shape),
            stat=TensorStat(0.0, 1.0, 32),
        )

    import weakref

    big = torch.randn(64, 32, 32, 32)  # a W2 activation (2M floats)
    big16 = big.half()

    def no_grad_aminmax() -> None:
        with torch.no_grad():
            torch.aminmax(y)

    cases: dict[str, Callable[[], Any]] = {
        "torch.aminmax (4x8)": lambda: torch.aminmax(y.detach()),
        "torch.aminmax under no_grad (4x8)": no_grad_aminmax,
        "float(0-d tensor) x2": lambda: (float(a), float(b)),
        "Tensor.register_hook + remove": register,
        "weakref.ref(tensor)": lambda: weakref.ref(y),
        "Record + TensorStat": record,
        "t.is_floating_point(), t.requires_grad, t._version": lambda: (
            y.is_floating_point(),
            y.requires_grad,
            y._version,
        ),
        "torch.aminmax (64x32x32x32, a W2 activation)": lambda: torch.aminmax(big),
        "amin + amax (64x32x32x32), what nanwatch reads it with": lambda: (
            big.amin(),
            big.amax(),
        ),
        "torch.aminmax (64x32x32x32, float16)": lambda: torch.aminmax(big16),
        "amin + amax (64x32x32x32, float16)": lambda: (big16.amin(), big16.amax()),
    }
    out = {}
    for name, fn in cases.items():
        n = number if "64x32" not in name else max(20, number // 200)
        best = min(timeit.repeat(fn, number=n, repeat=5))
        out[name] = best / n * 1e6
    return out


# ---------------------------------------------------------------------------- 3b. W2 split


@dataclass
class Split:
    """A real workload's overhead under ``mode``, split: the statistics kernels alone vs
    the rest."""

    workload: str
    unwatched_ms: float
    watched_ms: float
    tensors: int  # tensors measured per step
    elements: int  # their elements
    aminmax_ms: float  # nanwatch's min-max reads of exactly those tensors, alone
    item_ms: float  # reading the results (.item() x 2 per tensor)
    #: ms per watched step spent in each part of nanwatch, measured inside training
    #: (exclusive times: a part's time excludes the parts it calls)
    parts: dict[str, float] = field(default_factory=dict)
    mode: str = "watch"
    grads: int = 0  # parameter gradients whose L2 norm is read per step
    grad_elements: int = 0  # their elements
    #: the L2 norms of exactly those gradients (nanwatch.stats.foreach_l2), alone, read
    #: again right after a backward wrote them and cache-hot (ms)
    grad_norm_ms: tuple[float, float] = (0.0, 0.0)


#: the Watcher methods whose exclusive time ``split`` measures, and what each is
_PARTS = {
    "_measure": "statistics reads (aminmax of each output and output gradient)",
    "_pre": "forward pre-hooks",
    "_post": "forward hooks (records, data flow)",
    "_on_grad": "gradient hooks",
    "_check_grads": "gradient norms (every parameter gradient, once)",
    "l2": "gradient norms read in backward (large gradients, while cache-hot)",
    "_check_params": "weight check (every weight, once)",
    "_evaluate": "rules",
    "_boundary": "step boundary (flush, localize)",
}


def _parts(nw: Any, step: Callable[[], None], steps: int) -> dict[str, float]:
    """Exclusive ms per step in each of ``_PARTS``, by wrapping the (detached) watcher's
    methods on the instance before it attaches, since its hooks bind them then (a probe of
    private methods: only for this measurement)."""
    totals = dict.fromkeys(_PARTS, 0.0)
    stack: list[list[float]] = []  # [start, time spent in children]

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack.append([time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                start, children = stack.pop()
                spent = time.perf_counter() - start
                totals[name] += spent - children
                if stack:
                    stack[-1][1] += spent

        return timed

    from nanwatch import watcher

    # ``l2`` is a module function the gradient hooks call, not a method: wrapped there
    methods = [name for name in _PARTS if name != "l2"]
    originals = {name: getattr(nw, name) for name in methods}
    hot_l2 = watcher.l2
    try:
        for name, fn in originals.items():
            setattr(nw, name, wrap(name, fn))
        watcher.l2 = wrap("l2", hot_l2)
        nw.attach()
        try:
            step()  # warm-up, not counted
            totals.update(dict.fromkeys(_PARTS, 0.0))
            for _ in range(steps):
                step()
        finally:
            nw.detach()
    finally:
        watcher.l2 = hot_l2
        for name in methods:
            with contextlib.suppress(AttributeError):
                delattr(nw, name)
    return {name: 1e3 * t / steps for name, t in totals.items()}


def split(workload: str, quick: bool, rounds: int, mode: str = "watch") -> Split:
    """Step time of ``workload`` unwatched and under ``mode`` (interleaved, medians), and the
    cost of the statistics kernels alone: the tensors nanwatch measured in one step (caught
    by wrapping ``Watcher._measure``, a private method: a probe) timed with torch.aminmax
    outside of training, on the same threads, and the L2 norms of the step's parameter
    gradients (every mode reads each once), timed alone right after a backward wrote them
    and again cache-hot."""
    w = build(workload, quick=quick)
    nw = nanwatch.watch(*w.modules(), mode=mode)
    clock = time.perf_counter
    times: dict[str, list[float]] = {"unwatched": [], mode: []}
    for rnd in range(rounds + 1):
        for key in ("unwatched", mode) if rnd % 2 else (mode, "unwatched"):
            if key == mode:
                nw.attach()
            try:
                for i in range(4):
                    t0 = clock()
                    w.step()
                    if key == mode:
                        nw.step()
                    if rnd and i:  # round 0 and each block's first step: warm-up
                        times[key].append(clock() - t0)
            finally:
                if key == mode:
                    nw.detach()

    def one() -> None:
        w.step()
        nw.step()

    parts = _parts(nw, one, max(2, rounds * 2))
    caught: list[torch.Tensor] = []
    nw.attach()
    try:
        measure = nw._measure

        def probe(rec: Any, t: torch.Tensor, **kw: Any) -> None:
            caught.append(t.detach())
            measure(rec, t, **kw)

        nw._measure = probe  # type: ignore[method-assign]
        w.step()
        nw.step()
    finally:
        nw.detach()
        del nw._measure
    floats = [t for t in caught if t.is_floating_point() and t.numel()]
    pairs = [aminmax(t) for t in floats]

    def kernels() -> None:
        for t in floats:
            aminmax(t)

    def reads() -> None:
        for a, b in pairs:
            a.item()
            b.item()

    kernels()
    k = min(timeit.repeat(kernels, number=3, repeat=5)) / 3
    r = min(timeit.repeat(reads, number=20, repeat=5)) / 20
    grads, norms = _grad_norm_floor(w, 3 if quick else 10)
    return Split(
        workload,
        statistics.median(times["unwatched"]) * 1e3,
        statistics.median(times[mode]) * 1e3,
        len(floats),
        sum(t.numel() for t in floats),
        k * 1e3,
        r * 1e3,
        parts,
        mode,
        len(grads),
        sum(g.numel() for g in grads),
        norms,
    )


def _grad_norm_floor(w: Any, repeats: int) -> tuple[list[torch.Tensor], tuple[float, float]]:
    """The workload's parameter gradients after one backward, and the medians (ms) of
    ``foreach_l2`` over them read right after a backward wrote them (each repeat runs
    forward and backward again, unwatched) and read again at once (cache-hot)."""
    from nanwatch.stats import foreach_l2, read_scalars

    params = [p for p in w.model.parameters() if p.requires_grad]
    fresh: list[float] = []
    hot: list[float] = []
    grads: list[torch.Tensor] = []
    for _ in range(repeats):
        w.optimizer.zero_grad(set_to_none=True)
        w.loss().backward()
        grads = [p.grad for p in params if p.grad is not None]
        t0 = time.perf_counter()
        read_scalars(foreach_l2(grads))
        t1 = time.perf_counter()
        read_scalars(foreach_l2(grads))
        t2 = time.perf_counter()
        fresh.append(t1 - t0)
        hot.append(t2 - t1)
    w.optimizer.zero_grad(set_to_none=True)
    return grads, (statistics.median(fresh) * 1e3, statistics.median(hot) * 1e3)


# ---------------------------------------------------------------------------- 4. profile


@dataclass
class Profile:
    workload: str
    mode: str
    steps: int
    step_ms: float  # under the profiler
    nanwatch_ms: float  # self time inside nanwatch/ + the built-ins it calls, per step
    top: list[tuple[str, int, float, float]]  # name, calls/step, self us/step, cum us/step
    builtins: list[tuple[str, int, float]]  # name, calls/step from nanwatch, us/step
    hooks: list[tuple[str, int, float]]  # entry points: name, calls/step, cumulative us/step


def _short(key: tuple[str, int, str]) -> str:
    file, line, func = key
    if file.startswith(NANWATCH_DIR):
        return f"{file[len(NANWATCH_DIR) :]}:{line}({func})"
    if file == "~":
        return func
    return f"{os.path.basename(file)}:{line}({func})"


def profile(workload: str, mode: str, steps: int, quick: bool) -> Profile:
    w = build(workload, quick=quick)
    nw = nanwatch.watch(*w.modules(), mode=mode)
    with nw:
        for _ in range(2):
            w.step()
            nw.step()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(steps):
            w.step()
            nw.step()
        prof.disable()
        wall = time.perf_counter() - t0
    st = pstats.Stats(prof)
    stats: dict[Any, Any] = st.stats  # type: ignore[attr-defined]
    ours = {k: v for k, v in stats.items() if k[0].startswith(NANWATCH_DIR)}
    self_total = sum(v[2] for v in ours.values())
    top = sorted(ours.items(), key=lambda kv: kv[1][2], reverse=True)[:15]
    tap = [k for k in ours if k[2] == "_tapped"]  # cumulative: the whole backward
    # built-ins (and torch Python functions) called directly from nanwatch's code
    called: list[tuple[str, int, float]] = []
    for k, (_, _, _, _, callers) in stats.items():
        if k[0].startswith(NANWATCH_DIR):
            continue
        if k[2] == "backward" and k[0].endswith(os.path.join("autograd", "__init__.py")):
            continue  # the user's backward, run through nanwatch's wrapper of it
        n, tt = 0, 0.0
        for ck, cv in callers.items():
            if ck[0].startswith(NANWATCH_DIR):
                n += cv[1]
                tt += cv[3]  # cumulative time of the calls made from nanwatch
        if n:
            called.append((_short(k), n // steps, tt / steps * 1e6))
    called.sort(key=lambda r: r[2], reverse=True)
    builtin_total = sum(r[2] for r in called) / 1e6 * steps
    hooks = []
    for name in ("pre_hook", "post_hook", "on_grad", "_end_of_backward", "step"):
        for k, v in ours.items():
            if k[2] == name and k[0].endswith("watcher.py"):
                hooks.append((name, v[1] // steps, v[3] / steps * 1e6))
    return Profile(
        workload,
        mode,
        steps,
        wall / steps * 1e3,
        (self_total + builtin_total) / steps * 1e3,
        [
            (
                _short(k),
                v[1] // steps,
                v[2] / steps * 1e6,
                math.nan if k in tap else v[3] / steps * 1e6,
            )
            for k, v in top
        ],
        called[:12],
        hooks,
    )


# ---------------------------------------------------------------------------- report


def render(
    *,
    mods: Sequence[PerModule],
    n: int,
    hooks: dict[str, dict[str, Any]],
    prims: dict[str, float],
    splits: Sequence[Split],
    profs: Sequence[Profile],
    guard_costs: Sequence[GuardCost] = (),
    guard_workload: str = "W3",
    load: float | None,
    wall: float,
    command: str,
) -> str:
    out: list[str] = []
    add = out.append
    add("# nanwatch hook cost (issue 8)\n")
    add("Generated by `benchmarks/hook_cost.py`; re-run it rather than editing.\n")
    add(f"- date: {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M UTC}")
    add(f"- torch {torch.__version__}, {torch.get_num_threads()} threads, Python "
        f"{sys.version.split()[0]}")  # fmt: skip
    if load is not None:
        add(f"- CPU used by other processes meanwhile: {load:.2f} cores")
    add(f"- wall time: {wall:.0f} s; reproduce: `{command}`\n")
    add(f"## 1. Per module: {n} x Linear(8, 8), batch 4 ({n + 1} modules with the container)\n")
    add("Overhead over the unwatched step divided by the number of modules (medians).\n")
    add("| variant | forward ms | backward ms | fwd µs/module | bwd µs/module | "
        "step µs/module (incl. nw.step) |")  # fmt: skip
    add("|---|---|---|---|---|---|")
    for m in mods:
        add(
            f"| {m.variant} | {m.fwd_ms:.2f} | {m.bwd_ms:.2f} | {m.fwd_us_per_module:.1f} | "
            f"{m.bwd_us_per_module:.1f} | {m.step_us_per_module:.1f} |"
        )
    for title, h in hooks.items():
        add(f"\n## 2. Per hook call: {title}\n")
        add(f"Clock-wrapped hooks (wrapper's own {h['wrapper_ns']:.0f} ns subtracted); "
            f"{h['records']} records per step.\n")  # fmt: skip
        add("| hook | calls/step | µs/call (median) | µs/step |")
        add("|---|---|---|---|")
        for k, us in h["us"].items():
            c = h["calls"][k]
            add(f"| {k} | {c:.0f} | {us:.1f} | {us * c:.0f} |")
    add("\n## 3. Primitives\n")
    add("| operation | µs/call |")
    add("|---|---|")
    for k, v in prims.items():
        add(f"| {k} | {v:.2f} |")
    for sp in splits:
        over = sp.watched_ms - sp.unwatched_ms
        add(f"\n## 3b. {sp.workload} under `{sp.mode}`: statistics kernels vs the rest\n")
        add(
            f"- step: unwatched {sp.unwatched_ms:.1f} ms, {sp.mode} {sp.watched_ms:.1f} ms: "
            f"overhead {over:.1f} ms (x{sp.watched_ms / sp.unwatched_ms:.3f})"
        )
        add(f"- tensors measured per step: {sp.tensors} ({sp.elements / 1e6:.1f} M elements)")
        add(
            "- the min-max reads (nanwatch._compat.aminmax) of exactly those tensors, alone: "
            f"{sp.aminmax_ms:.2f} ms "
            f"({sp.aminmax_ms / sp.unwatched_ms:.1%} of the unwatched step); reading the "
            f"results (.item() x 2 each): {sp.item_ms:.2f} ms"
        )
        fresh, hot = sp.grad_norm_ms
        add(
            f"- the L2 norms of the step's {sp.grads} parameter gradients "
            f"({sp.grad_elements / 1e6:.1f} M elements), alone: {fresh:.2f} ms right after "
            f"a backward wrote them, {hot:.2f} ms cache-hot"
        )
        kernels = sp.aminmax_ms + sp.item_ms + fresh
        add(f"- the rest of the overhead (Python in the hooks, register_hook, records, "
            f"flush and rules): {over - kernels:.1f} ms")  # fmt: skip
    for p in profs:
        add(f"\n## 4. Profile: {p.workload}, mode `{p.mode}`, {p.steps} steps under cProfile\n")
        add(f"Step under the profiler: {p.step_ms:.1f} ms; nanwatch's own Python plus the "
            f"built-ins it calls: {p.nanwatch_ms:.1f} ms per step (cProfile inflates "
            "Python-heavy code).\n")  # fmt: skip
        add("Hook entry points (cumulative, per step):\n")
        add("| function | calls/step | µs/step |")
        add("|---|---|---|")
        for name, c, us in p.hooks:
            add(f"| {name} | {c} | {us:.0f} |")
        add("\nnanwatch's functions by self time (per step):\n")
        add("| function | calls/step | self µs/step | cumulative µs/step |")
        add("|---|---|---|---|")
        for name, c, tt, ct in p.top:
            cum = "(the user's backward)" if math.isnan(ct) else f"{ct:.0f}"
            add(f"| `{name}` | {c} | {tt:.0f} | {cum} |")
        add("\nCalled from nanwatch (time of those calls, per step):\n")
        add("| function | calls/step | µs/step |")
        add("|---|---|---|")
        for name, c, us in p.builtins:
            add(f"| `{name}` | {c} | {us:.0f} |")
    if guard_costs:
        add(f"\n## 5. Guards: {guard_workload}, mode `sentinel`\n")
        add("Each guard pre-hook clock-wrapped (the clock's own cost subtracted): the checks "
            "in Python, the reductions and the one read of their results.\n")  # fmt: skip
        add("| guarded module | first input | calls/step | µs/call (median) |")
        add("|---|---|---|---|")
        for g in guard_costs:
            add(f"| {g.module} | {g.inputs} | {g.calls:.0f} | {g.us:.1f} |")
    return "\n".join(out) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/hook_cost.py",
        description=(
            "Measure nanwatch's per-module hook cost in microseconds (a model of many tiny "
            "modules), each hook's cost per call, the primitives they are made of, and a "
            "cProfile of watched W2 steps; print it and write benchmarks/HOOK_COST.md."
        ),
    )
    p.add_argument("--quick", action="store_true", help="smoke setting: seconds, no file")
    p.add_argument("--modules", type=int, default=200, help="tiny Linear modules (default 200)")
    p.add_argument("--repeats", type=int, default=20, help="steps per round (default 20)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--workload", default="W2", help="workload to profile (default W2)")
    p.add_argument(
        "--profile-modes",
        default="watch,sentinel",
        help="modes to profile (default watch,sentinel)",
    )
    p.add_argument("--profile-steps", type=int, default=10, help="profiled steps (default 10)")
    p.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default 2; --quick 1)"
    )
    p.add_argument("--out", type=Path, default=None, help=f"markdown output (default {OUT.name})")
    p.add_argument("--no-write", action="store_true", help="print only")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> str:
    from rich.console import Console
    from rich.markdown import Markdown

    args = parse_args(argv)
    torch.set_num_threads(args.threads if args.threads is not None else (1 if args.quick else 2))
    console = Console()
    q = args.quick
    n = 10 if q else args.modules
    t0 = time.perf_counter()
    meter = LoadMeter().start()
    with console.status("per-module cost ..."):
        mods = per_module(n, 2 if q else args.repeats, 1 if q else args.rounds)
    model, x = tiny_model(n), torch.randn(4, 8)
    with console.status("per-hook cost ..."):
        hooks = {
            f"{n} x Linear(8, 8), {mode}": per_hook(model, x, mode, 2 if q else 30)
            for mode in ("watch", "sentinel")
        }
        w2 = build(args.workload, quick=q)
        xw, yw = w2.x, w2.y

        class Step(nn.Module):  # the workload's model and loss as one module
            def __init__(self) -> None:
                super().__init__()
                self.model, self.criterion = w2.model, w2.criterion

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.criterion(self.model(x), yw)  # type: ignore[no-any-return]

        hooks[f"{args.workload}, watch"] = per_hook(Step(), xw, "watch", 2 if q else 10)
    with console.status("primitives ..."):
        prims = primitives(200 if q else 20000)
    with console.status(f"{args.workload}: statistics kernels vs the rest ..."):
        splits = [split(args.workload, q, 1 if q else args.rounds)]
    profs = []
    for mode in [m.strip() for m in args.profile_modes.split(",") if m.strip()]:
        with console.status(f"profiling {args.workload} ({mode}) ..."):
            profs.append(profile(args.workload, mode, 2 if q else args.profile_steps, q))
    with console.status("guards ..."):
        guard_costs = guard_cost("W3", q, 2 if q else 20)
    load = meter.stop()
    wall = time.perf_counter() - t0
    command = "python benchmarks/hook_cost.py " + " ".join(
        sys.argv[1:] if argv is None else list(argv)
    )
    md = render(
        mods=mods,
        n=n,
        hooks=hooks,
        prims=prims,
        splits=splits,
        profs=profs,
        guard_costs=guard_costs,
        load=load,
        wall=wall,
        command=command.strip(),
    )
    console.print(Markdown(md))
    if not args.no_write and (args.out is not None or not q):
        path = args.out or OUT
        path.write_text(md)
        console.print(f"wrote {path}")
    return md


if __name__ == "__main__":
    main()
