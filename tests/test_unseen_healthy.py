"""Healthy training that must stay silent (found by running ordinary, correct loops of many
families under the rules added on unseen models)."""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

import nanwatch


class _MaskedAttention(nn.Module):
    """Additive masks built the Hugging Face way: a causal mask plus a padding mask, both
    torch.finfo(dtype).min; where both apply their sum is -inf."""

    def __init__(self, d: int = 16, h: int = 2) -> None:
        super().__init__()
        self.qkv, self.o, self.h = nn.Linear(d, 3 * d), nn.Linear(d, d), h

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        sc = q @ k.transpose(-1, -2) / math.sqrt(d // self.h)
        mn = torch.finfo(sc.dtype).min
        causal = torch.zeros(t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), mn)
        padm = torch.zeros(b, 1, 1, t).masked_fill(pad[:, None, None, :], mn)
        a = (sc + causal + padm).softmax(-1)
        return self.o((a @ v).transpose(1, 2).reshape(b, t, d))


def test_summed_finfo_min_masks_are_no_hidden_overflow_in_forensic_mode() -> None:
    """finfo.min + finfo.min is -inf, which softmax weighs exactly as finfo.min: NW105 called
    it 'silently wrong values' and proposed casting float32 tensors to float32."""
    torch.manual_seed(0)
    model = _MaskedAttention()
    x = torch.randn(4, 10, 16)
    pad = torch.arange(10)[None] >= torch.tensor([10, 7, 5, 4])[:, None]
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", nanwatch.NanwatchWarning)
        with nanwatch.watch(model, mode="forensic") as nw:
            for _ in range(2):
                loss = model(x, pad).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()
    # the op checker did see the -inf sums: they are not reported
    assert any(ev.born.strip() == "-inf" for t in nw.history for ev in t.ops)
    assert not [d.code for d in nw.report.diagnoses]
