"""The GPU variant of the benchmark (issue 8): a GPT-2-small-sized decoder (12 layers,
d_model 768, 12 heads, vocabulary 50257, causal), one training step in bf16 autocast and
one in float16 autocast with a GradScaler, unwatched and under nanwatch.

This is what measures nanwatch's CUDA path (statistics left on the device, one
non-blocking copy into pinned memory a step). ``run.py --gpu`` calls :func:`run` when CUDA
is available. The code is device-agnostic so that the smoke test can run it on the CPU
with tiny shapes; only numbers taken on a GPU belong in RESULTS.md.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from benchmarks._timing import LoadMeter, interleave, to_cells
from benchmarks.variants import DetectAnomaly, Nanwatch, Runner, Unwatched

__all__ = ["Decoder", "DecoderWorkload", "run"]


class Decoder(nn.Module):
    """GPT-2-style: token + position embeddings, pre-norm causal blocks, final norm, head."""

    def __init__(
        self, *, vocab: int = 50257, d_model: int = 768, layers: int = 12, heads: int = 12,
        seq: int = 1024,
    ) -> None:  # fmt: skip
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        block = nn.TransformerEncoderLayer(
            d_model,
            heads,
            4 * d_model,
            dropout=0.1,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        pos = torch.arange(n, device=tokens.device)
        h = self.embed(tokens) + self.pos(pos)
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h)).flatten(0, 1)


class DecoderWorkload:
    """One step: autocast forward + loss, (scaled) backward, AdamW step, zero_grad."""

    functional = False

    def __init__(self, precision: str, *, device: str, batch: int, seq: int, **shape: Any) -> None:
        if precision not in ("bf16", "fp16"):
            raise ValueError(f"precision can be 'bf16' or 'fp16'; got {precision!r}")
        self.precision = precision
        self.device = torch.device(device)
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        torch.manual_seed(0)
        self.model = Decoder(seq=seq, **shape).to(self.device)
        self.criterion = nn.CrossEntropyLoss()
        vocab = self.model.head.out_features
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=False)
        self.x = torch.randint(0, vocab, (batch, seq), device=self.device)
        self.y = torch.randint(0, vocab, (batch * seq,), device=self.device)
        self.scaler: Any = None
        if precision == "fp16":
            self.scaler = torch.amp.GradScaler(self.device.type)

    def modules(self) -> tuple[nn.Module, ...]:
        return (self.model, self.criterion)

    def step(self) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=self.dtype):
            loss = self.criterion(self.model(self.x), self.y)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


def _runners() -> list[Runner]:
    return [
        Unwatched(),
        Nanwatch("sentinel", "nanwatch sentinel", mode="sentinel"),
        Nanwatch("watch", "nanwatch watch", mode="watch"),
        Nanwatch("watch-every10", "nanwatch watch, sample_every=10", mode="watch",
                 sample_every=10),
        DetectAnomaly(),
    ]  # fmt: skip


def run(
    *,
    batch: int = 16,
    seq: int = 1024,
    rounds: int = 5,
    steps: int = 4,
    device: str = "cuda",
    precisions: tuple[str, ...] = ("bf16", "fp16"),
    **shape: Any,
) -> dict[str, Any]:
    """Ratios to the unwatched step for each precision; ``shape`` overrides the decoder's
    size (``vocab``, ``d_model``, ``layers``, ``heads``) for smoke tests."""
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else None
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        name = f"{dev.type} (smoke run; not a GPU measurement)"
    out: dict[str, Any] = {
        "device": name,
        "description": (
            f"decoder {shape.get('layers', 12)} layers, d_model {shape.get('d_model', 768)}, "
            f"heads {shape.get('heads', 12)}, vocab {shape.get('vocab', 50257)}, seq {seq}, "
            f"batch {batch}, AdamW; ratios to the unwatched step of the same precision"
        ),
        "cells": {},
        "load": {},
    }
    t0 = time.perf_counter()
    for prec in precisions:
        w = DecoderWorkload(prec, device=device, batch=batch, seq=seq, **shape)
        runners = _runners()
        for r in runners:  # warm-up (cuDNN/cuBLAS autotuning, allocator growth)
            r.attach(w)
            try:
                for _ in range(2):
                    r.step(w)
            finally:
                r.detach()
        meter = LoadMeter().start()
        samples = interleave(
            runners, lambda r, w=w: w, rounds=rounds, steps_for=lambda r: steps, sync=sync
        )
        out["load"][prec] = meter.stop()
        out["cells"][prec if prec == "bf16" else "fp16+GradScaler"] = to_cells(
            runners, samples, rounds
        )
        del w
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    out["seconds"] = time.perf_counter() - t0
    return out


#: issue 8's GPU targets: the most a variant may cost, as a ratio to the unwatched step
TARGETS = {"sentinel": 1.01, "watch": 1.05}


def markdown(runs: dict[int, dict[str, Any]], command: str) -> str:
    """RESULTS-GPU.md: one table per batch size, the targets checked against each."""
    import datetime
    import platform

    from benchmarks.run import source_digest

    first = next(iter(runs.values()))
    out = [
        "# nanwatch GPU benchmark results (issue 8)\n",
        "Generated by `python -m benchmarks.gpu`; do not edit by hand, re-run it on a CUDA "
        "machine.\n",
        "## Machine\n",
        f"- GPU: {first['device']}",
        f"- torch {torch.__version__}, CUDA {torch.version.cuda}, Python "
        f"{platform.python_version()}",
        f"- date: {datetime.date.today().isoformat()}; nanwatch source digest {source_digest()}",
        f"- command: `{command}`",
        "",
        "Ratios are the median of per-round ratios to the unwatched step of the same "
        "precision, variants interleaved in one process (A B C A B C ...), each step "
        "ending with `torch.cuda.synchronize()`; the bracket is the 90% bootstrap interval. "
        "Targets: sentinel at most x1.01, watch at most x1.05, every mode 5x less overhead "
        "than detect_anomaly.\n",
    ]
    for batch, r in runs.items():
        out.append(f"## Batch {batch}\n")
        out.append(f"{r['description']}; peak GPU memory {r['peak_gib']:.1f} GiB.\n")
        precs = list(r["cells"])
        out.append("| variant | " + " | ".join(precs) + " |")
        out.append("|---|" + "---|" * len(precs))
        for key in next(iter(r["cells"].values())):
            row = []
            for prec in precs:
                c = r["cells"][prec].get(key)
                if c is None:
                    row.append("—")
                elif key == "unwatched":
                    row.append(f"{c.ms:.1f} ms/step")
                else:
                    row.append(f"x{c.ratio:.3f} [{c.ci_lo:.3f}, {c.ci_hi:.3f}] {c.ms:.1f} ms")
            out.append(f"| {key} | " + " | ".join(row) + " |")
        out.append("")
        for prec in precs:
            cells = r["cells"][prec]
            checks = []
            for key, bound in TARGETS.items():
                c = cells[key]
                verdict = "met" if c.ratio <= bound else "MISSED"
                checks.append(f"{key} x{c.ratio:.3f} vs x{bound} {verdict}")
            da = cells["detect_anomaly"].ratio - 1
            for key in ("sentinel", "watch", "watch-every10"):
                mine = cells[key].ratio - 1
                ok = mine <= 0 or da / mine >= 5
                factor = "no overhead" if mine <= 0 else f"{da / mine:.1f}x less"
                checks.append(f"{key} vs detect_anomaly {factor} {'met' if ok else 'MISSED'}")
            out.append(f"- {prec}: " + "; ".join(checks))
        out.append("")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json
    import sys
    from pathlib import Path

    p = argparse.ArgumentParser(description="GPU benchmark: writes benchmarks/RESULTS-GPU.md")
    p.add_argument("--batches", default="16", help="comma-separated batch sizes (default 16)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS-GPU.md"))
    p.add_argument("--json", type=Path, default=None, help="also write the raw cells here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu: no CUDA device here; nothing measured")
    runs: dict[int, dict[str, Any]] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        torch.cuda.reset_peak_memory_stats()
        r = run(batch=batch, seq=args.seq, rounds=args.rounds, steps=args.steps)
        r["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        runs[batch] = r
        print(f"batch {batch}: {gpu_line(r)}", flush=True)
    command = "python -m benchmarks.gpu " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.write_text(markdown(runs, command.strip()))
    print(f"wrote {args.out}")
    if args.json is not None:
        args.json.write_text(json.dumps(runs, default=vars, indent=1))


def gpu_line(r: dict[str, Any]) -> str:
    return "; ".join(
        f"{prec}: " + ", ".join(f"{k} x{c.ratio:.3f}" for k, c in cells.items() if k != "unwatched")
        for prec, cells in r["cells"].items()
    )


if __name__ == "__main__":
    main()
