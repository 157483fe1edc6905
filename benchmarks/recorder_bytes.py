"""How many bytes the flight recorder keeps per step, for a 100-module model (issue 5).

The flight recorder is ``Watcher.history``: a deque of the last ``ring_size`` steps
(``StepTrace``: records, calls, op events, notes), plain Python objects. This script runs a
100-module transformer-like MLP under ``nanwatch.watch`` (watch mode, CPU), and measures:

* tracemalloc: Python bytes allocated and kept per recorded step (the ring is larger than
  the steps measured, so nothing is evicted), and that memory stays flat once the ring is
  full (``ring_size`` steps kept, older ones dropped);
* a deep ``sys.getsizeof`` walk of one recorded step, by object type (shared objects such
  as interned strings counted once), to see where the bytes go;
* the same step as JSON (what a saved report costs per step).

Usage::

    python benchmarks/recorder_bytes.py            # ~10 s on 2 cores
    python benchmarks/recorder_bytes.py --steps 50 --ring 32
    python benchmarks/recorder_bytes.py --write    # also refresh benchmarks/RECORDER.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import sys
import tracemalloc
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import nanwatch
from nanwatch.records import StepTrace


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.mix = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    """1 root + embed + blocks (ModuleList) + 12 blocks x 8 modules + head = 100 modules."""

    def __init__(self, d: int = 32, blocks: int = 12) -> None:
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def deep_size(roots: Iterable[Any], seen: set[int]) -> Counter[str]:
    """Bytes by type name of everything reachable from ``roots`` through nanwatch's record
    objects and the containers they hold (each object once)."""
    out: Counter[str] = Counter()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, type):
            continue
        seen.add(id(obj))
        out[type(obj).__name__] += sys.getsizeof(obj)
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__slots__") or hasattr(obj, "__dict__"):
            if hasattr(obj, "__dict__"):
                stack.extend(vars(obj).values())
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if hasattr(obj, name):
                        stack.append(getattr(obj, name))
    return out


def one_step(model: nn.Module, nw: nanwatch.Watcher, opt: torch.optim.Optimizer) -> None:
    x, y = torch.randn(8, 10, 16), torch.randn(8, 10, 4)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    nw.step(loss)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="steps measured (default 20)")
    p.add_argument("--ring", type=int, default=32, help="ring_size for the flat-memory check")
    p.add_argument("--write", action="store_true", help="write benchmarks/RECORDER.md")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Model()
    n_modules = len(list(model.modules()))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    # 1. bytes kept per step: the ring is larger than the steps measured
    nw = nanwatch.watch(model, ring_size=args.steps + 10, postmortem=False)
    with nw:
        for _ in range(3):
            one_step(model, nw, opt)
        gc.collect()
        tracemalloc.start()
        m0 = tracemalloc.get_traced_memory()[0]
        for _ in range(args.steps):
            one_step(model, nw, opt)
        gc.collect()
        m1 = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
    per_step = (m1 - m0) / args.steps
    trace: StepTrace = nw.history[-1]
    records, calls = len(trace.records), len(trace.calls)
    measured = sum(r.stat is not None for r in trace.records)

    # 2. where the bytes go (shared strings counted once, as in the ring)
    seen: set[int] = set()
    deep_size(list(nw.history)[:-1], seen)  # everything already kept by earlier steps
    by_type = deep_size([trace], seen)
    walked = sum(by_type.values())
    json_bytes = len(json.dumps(trace.to_dict(), separators=(",", ":")))

    # 3. flat once the ring is full (traced from the start: tracemalloc only sees what is
    # allocated while it runs, so the steps the ring drops must be traced ones)
    nw2 = nanwatch.watch(model, ring_size=args.ring, postmortem=False)
    tracemalloc.start()
    with nw2:
        for _ in range(args.ring + 2):
            one_step(model, nw2, opt)
        gc.collect()
        f0 = tracemalloc.get_traced_memory()[0]
        for _ in range(args.ring):
            one_step(model, nw2, opt)
        gc.collect()
        f1 = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    growth = (f1 - f0) / args.ring

    lines = [
        f"model: {n_modules} modules; watch mode, CPU; {args.steps} steps measured",
        f"one step: {records} records ({measured} with statistics), {calls} module calls",
        f"flight recorder (tracemalloc): {per_step / 1024:.1f} KiB per step, "
        f"{per_step / records:.0f} B per record",
        f"  default ring_size=32: {32 * per_step / 2**20:.2f} MiB kept",
        f"  ring full (ring_size={args.ring}): {growth:+.0f} B per further step (flat)",
        f"deep getsizeof walk of one step: {walked / 1024:.1f} KiB",
        *(
            f"  {name:12s} {size / 1024:8.1f} KiB  {100 * size / walked:5.1f} %"
            for name, size in by_type.most_common(10)
        ),
        f"the same step as JSON: {json_bytes / 1024:.1f} KiB",
    ]
    print("\n".join(lines))
    if args.write:
        out = Path(__file__).with_name("RECORDER.md")
        when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        out.write_text(
            "# Flight recorder bytes per step (issue 5)\n\n"
            "Generated by `python benchmarks/recorder_bytes.py --write`; re-run it rather "
            f"than editing.\n\ntorch {torch.__version__}, {when}\n\n```\n"
            + "\n".join(lines)
            + "\n```\n"
        )
    return {
        "modules": n_modules,
        "records": records,
        "bytes_per_step": per_step,
        "bytes_per_record": per_step / records,
        "flat_growth_per_step": growth,
        "json_bytes_per_step": json_bytes,
    }


if __name__ == "__main__":
    main()
