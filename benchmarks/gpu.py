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
