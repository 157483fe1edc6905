"""Attention over a row where every key is masked: softmax of all -inf is NaN.

In practice: padding masks built from sequence lengths, where one sequence in the batch
is empty (length 0), or a causal mask combined with a padding mask that leaves a query
with nothing to attend to. ``masked_fill(mask, -inf)`` is the standard way to mask and
is *not* an error; but a row that is -inf everywhere has no maximum, and softmax returns
NaN for the whole row. nanwatch lets ordinary masks through and finds the row that broke.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanwatch.records import AnomalyKind
from nanwatch.scenarios import Expected

TITLE = "Fully masked attention row: softmax of all -inf"
# born in attn's own code (between its children), in the value passed to attn.out
EXPECTED = Expected(kind=AnomalyKind.FORWARD, path="attn", op="aten._softmax", diagnosis="NW402")


class SelfAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(pad[:, None, :], float("-inf"))  # mask padded keys
        return self.out(torch.softmax(scores, dim=-1) @ v)


class Tagger(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, d)
        self.attn = SelfAttention(d)
        self.head = nn.Linear(d, 3)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        pad = torch.arange(tokens.shape[1])[None, :] >= lengths[:, None]
        return self.head(self.attn(self.embed(tokens), pad))


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    model = Tagger()
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with watch(model, criterion) as nw:
        for step in range(3):
            tokens = torch.randint(0, 50, (4, 6))
            lengths = torch.tensor([6, 4, 3, 5])
            if step == 2:
                lengths[2] = 0  # an empty sequence reached the batch
            logits = model(tokens, lengths)
            loss = criterion(logits.reshape(-1, 3), torch.randint(0, 3, (24,)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
