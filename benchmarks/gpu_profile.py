"""Where nanwatch's time goes on the GPU step (issue 8's "why" for the GPU targets).

For the GPT-2-small-sized decoder of :mod:`benchmarks.gpu`, per variant (unwatched,
sentinel, watch): the step's wall time (synchronized), the CPU time spent enqueueing the
training step and inside ``nw.step()``, the GPU kernel time (torch.profiler), and every
host synchronization with the nanwatch line that caused it
(``torch.cuda.set_sync_debug_mode``). A cProfile of ``nw.step()`` shows the Python work
the GPU waits for at the step's end.

Run on a CUDA machine: ``python benchmarks/gpu_profile.py [--batch 16] [--precision bf16]``.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import statistics
import time
import traceback
import warnings
from typing import Any

import torch

from benchmarks.gpu import DecoderWorkload
from benchmarks.variants import Nanwatch, Runner, Unwatched


def _sync_sites(fn: Any) -> collections.Counter[str]:
    """Run ``fn`` with CUDA's sync debug mode on; count the synchronizations by the
    innermost nanwatch (else benchmarks) frame that asked for them."""
    sites: collections.Counter[str] = collections.Counter()
    original = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, *a: Any, **k: Any) -> None:
        if "synchroniz" not in str(message):
            return original(message, category, filename, lineno, *a, **k)
        frames = traceback.extract_stack()[:-1]
        ours = [f for f in frames if "/nanwatch/" in f.filename]
        f = ours[-1] if ours else frames[-1]
        sites[f"{f.filename.rsplit('/', 2)[-2:][-1]}:{f.lineno} {f.name}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = original
    return sites


def _gpu_ms(fn: Any) -> tuple[float, int]:
    """Kernel time (ms) and kernel count of one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    total, count = 0.0, 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total += e.device_time
            count += 1
    return total / 1000.0, count


def profile_variant(r: Runner, w: DecoderWorkload, steps: int) -> dict[str, Any]:
    r.attach(w)
    try:
        for _ in range(2):
            r.step(w)
        torch.cuda.synchronize()
        enq, nws, tot = [], [], []
        nw = getattr(r, "nw", None)
        for _ in range(steps):
            t0 = time.perf_counter()
            w.step()
            t1 = time.perf_counter()
            if nw is not None:
                nw.step()
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            enq.append(t1 - t0)
            nws.append(t2 - t1)
            tot.append(t3 - t0)
        out: dict[str, Any] = {
            "enqueue_ms": 1e3 * statistics.median(enq),
            "nw_step_ms": 1e3 * statistics.median(nws),
            "step_ms": 1e3 * statistics.median(tot),
        }
        out["syncs_in_training"] = _sync_sites(w.step)
        out["syncs_in_nw_step"] = _sync_sites(nw.step) if nw is not None else {}

        def one() -> None:
            w.step()
            if nw is not None:
                nw.step()

        out["gpu_ms"], out["kernels"] = _gpu_ms(one)
        if nw is not None:
            w.step()
            torch.cuda.synchronize()
            pr = cProfile.Profile()
            pr.enable()
            nw.step()
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(25)
            out["nw_step_profile"] = s.getvalue()
    finally:
        r.detach()
    return out


def bandwidth(mib: int = 256) -> None:
    """How fast one statistics pass reads a tensor, against a copy (read + write): the
    floor of checking every output and gradient on the GPU."""
    from torch.utils.benchmark import Timer

    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(mib * 2**20 // torch.finfo(dtype).bits * 8, device="cuda").to(dtype)
        gb = x.numel() * x.element_size() / 1e9
        for name, stmt in (
            ("aminmax", "torch.aminmax(x)"),
            ("foreach_norm inf", "torch._foreach_norm([x], float('inf'))"),
            ("copy (read+write)", "y.copy_(x)"),
        ):
            y = torch.empty_like(x)
            t = Timer(stmt, globals={"torch": torch, "x": x, "y": y}).blocked_autorange(
                min_run_time=0.5
            )
            moved = 2 * gb if name.startswith("copy") else gb
            rate = moved / t.median
            print(f"  {dtype!s:15s} {name:18s} {t.median * 1e3:7.3f} ms  {rate:7.0f} GB/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--variants", default="unwatched,sentinel,watch")
    p.add_argument("--bandwidth", action="store_true", help="also time one statistics pass")
    args = p.parse_args()
    if args.bandwidth:
        bandwidth()
    w = DecoderWorkload(args.precision, device="cuda", batch=args.batch, seq=args.seq)
    runners: dict[str, Runner] = {
        "unwatched": Unwatched(),
        "sentinel": Nanwatch("sentinel", "nanwatch sentinel", mode="sentinel"),
        "watch": Nanwatch("watch", "nanwatch watch", mode="watch"),
        "watch-noguards": Nanwatch("watch-noguards", "watch, guards=False", mode="watch",
                                   guards=False),
    }  # fmt: skip
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {args}")
    for key in args.variants.split(","):
        res = profile_variant(runners[key], w, args.steps)
        print(
            f"\n== {key}: step {res['step_ms']:.1f} ms, enqueue {res['enqueue_ms']:.1f} ms, "
            f"nw.step {res['nw_step_ms']:.1f} ms, GPU kernels {res['gpu_ms']:.1f} ms "
            f"({res['kernels']} kernels)"
        )
        for what in ("syncs_in_training", "syncs_in_nw_step"):
            sites = res[what]
            print(f"  {what}: {sum(sites.values())}")
            for site, n in sorted(sites.items(), key=lambda kv: -kv[1]):
                print(f"    {n:4d}  {site}")
        if "nw_step_profile" in res:
            print(res["nw_step_profile"])


if __name__ == "__main__":
    main()
