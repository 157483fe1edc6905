"""Run the failure gallery with its tensors on a device and say where nanwatch's answer
differs from the scenario's ``EXPECTED`` (issue 8: the CUDA path must diagnose as the CPU
path does). Each scenario runs under ``torch.set_default_device(DEVICE)``; scenarios that
draw from a CPU generator cannot run there and say so.

    python -m benchmarks.gallery_device cuda --mode watch
    python -m benchmarks.gallery_device cpu --mode sentinel --accelerator-path

``--accelerator-path`` drives the CUDA path's deferred reads on the CPU.
"""

from __future__ import annotations

import argparse
import json
import warnings
from typing import Any

import torch

from nanwatch import scenarios
from nanwatch.watcher import Watcher

#: scenarios whose failure kills a CUDA context if a guard misses it: run last
_LAST = ("target-255", "added-token", "train-crash")


def run(device: str, mode: str, *, accelerator_path: bool = False) -> list[dict[str, Any]]:
    """One row per scenario: what was found, the top diagnosis, how it differs."""
    attach = Watcher.attach
    if accelerator_path:

        def on_device(self: Watcher) -> Watcher:
            self._defer_cpu = True
            return attach(self)

        Watcher.attach = on_device  # type: ignore[method-assign]
    names = [n for n in scenarios.names() if n not in _LAST]
    names += [n for n in scenarios.names() if n in _LAST]
    rows: list[dict[str, Any]] = []
    try:
        for name in names:
            torch.manual_seed(0)
            torch.set_default_device(device)
            try:
                out = scenarios.run(scenarios.get(name), mode=mode)
            finally:
                torch.set_default_device(None)
            a, top = out.anomaly, out.top
            error = f"{type(out.error).__name__}: {out.error}"[:200] if out.error else None
            rows.append(
                {
                    "name": name,
                    "error": error,
                    "anomaly": None
                    if a is None
                    else [a.kind.value, a.path, a.record.phase.value, a.op.op if a.op else None],
                    "top": top.code if top is not None else None,
                    "mismatch": out.mismatches(),
                    "faults": [f for w in out.watchers for f in w.faults][:3],
                }
            )
    finally:
        Watcher.attach = attach  # type: ignore[method-assign]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("device", help="cuda, cuda:1, cpu, ...")
    p.add_argument("--mode", default="watch", choices=["sentinel", "watch", "forensic"])
    p.add_argument("--accelerator-path", action="store_true")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    rows = run(args.device, args.mode, accelerator_path=args.accelerator_path)
    for r in rows:
        verdict = (
            "ok"
            if not r["mismatch"] and not r["faults"]
            else "; ".join(r["mismatch"] + [f"fault: {f}" for f in r["faults"]])
        )
        print(f"{r['name']:28s} {r['top'] or '-':6s} {verdict}")
    good = sum(1 for r in rows if not r["mismatch"] and not r["faults"])
    print(f"{good} of {len(rows)} as expected ({args.device}, mode={args.mode})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
