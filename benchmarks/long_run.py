"""Does a step's nanwatch cost stay flat over a long run? (issue 8)

The rules read the history (the last ``ring_size`` steps) every step. A state that lasts
(a layer whose gradients stay 0, NW304; weights that went NaN and stay so, with
``on_anomaly="warn"``) makes them ask about every step of it, every step: a scan that
walks every record of every kept step grows with the model's size times the history's
length. This measures ``nw.step()``'s CPU time (thread time: other processes do not add
to it) over the first steps and the last ones of such runs on a deep MLP, and the
growth between them.

    python benchmarks/long_run.py            # about a minute on 2 cores
    python benchmarks/long_run.py --quick    # seconds, for the smoke test

No target is asserted here; a growth near x1.0 is what to see.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch


@dataclass
class Growth:
    """One run: median ``nw.step()`` CPU ms over its first and last windows."""

    case: str
    mode: str
    steps: int
    first_ms: float
    last_ms: float

    @property
    def growth(self) -> float:
        return self.last_ms / self.first_ms if self.first_ms > 0 else float("nan")


def _mlp(depth: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])


def measure(case: str, mode: str, *, depth: int, steps: int, window: int) -> Growth:
    """``case``: ``"plain"`` (the deep MLP trained as it is: its gradients fade towards 0
    over the first tens of steps, and NW304 may speak); ``"dead"`` (the first layer's
    output multiplied by 0: its gradients are 0 every step, NW304 from the fifth);
    ``"nan"`` (a NaN in one batch early on, applied: every weight NaN from then on)."""
    width = 16
    model = _mlp(depth, width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, width), torch.randn(8, width)
    first = model[0]
    if case == "dead":
        first.register_forward_hook(lambda _m, _i, out: out * 0.0)
    times: list[float] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nw = nanwatch.watch(model, mode=mode, on_anomaly="warn")
        with nw:
            for i in range(steps):
                xi = x
                if case == "nan" and i == 2:
                    xi = x.clone()
                    xi[0, 0] = float("nan")
                F.mse_loss(model(xi), y).backward()
                opt.step()
                opt.zero_grad()
                t = time.thread_time()
                nw.step()
                times.append(time.thread_time() - t)
    head = times[window : 2 * window]  # after the first steps' one-time work
    tail = times[-window:]
    return Growth(case, mode, steps, statistics.median(head) * 1e3, statistics.median(tail) * 1e3)


def main(argv: Sequence[str] | None = None) -> list[Growth]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="few steps, a small model")
    args = ap.parse_args(argv)
    depth, steps, window = (4, 12, 3) if args.quick else (60, 80, 10)
    torch.set_num_threads(1)
    out = [
        measure(case, mode, depth=depth, steps=steps, window=window)
        for case in ("plain", "dead", "nan")
        for mode in ("watch", "sentinel")
    ]
    print(f"nw.step() CPU ms, MLP {depth}x(Linear(16)+ReLU), {steps} steps")
    print("| run | mode | steps | first | last | growth |")
    print("|---|---|---|---|---|---|")
    for g in out:
        print(
            f"| {g.case} | {g.mode} | {g.steps} | {g.first_ms:.2f} | {g.last_ms:.2f} "
            f"| x{g.growth:.2f} |"
        )
    return out


if __name__ == "__main__":
    main()
