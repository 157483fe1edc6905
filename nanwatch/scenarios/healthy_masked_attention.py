"""Healthy control: attention masked with -inf, by hand and by nn.MultiheadAttention.

In practice: every transformer masks padding or future positions with -inf before the
softmax. Those -inf values are intended; a tool that reports them is a tool people switch
off. nanwatch must stay silent here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanwatch.scenarios import Expected

TITLE = "Healthy: masked attention with -inf"
EXPECTED = Expected(kind=None, healthy=True)


class MaskedAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.scale = 1 / math.sqrt(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(1, 2)) * self.scale
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


class Model(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.causal = MaskedAttention(d)
        self.mha = nn.MultiheadAttention(d, 4, batch_first=True)
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.causal(x)
        h, _ = self.mha(h, h, h, key_padding_mask=pad)
        return self.head(h.mean(dim=1))


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    model = Model()
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with watch(model, criterion) as nw:
        for _ in range(3):
            x = torch.randn(4, 7, 16)
            pad = torch.zeros(4, 7, dtype=torch.bool)
            pad[1, 5:] = True
            pad[3, 2:] = True
            loss = criterion(model(x, pad), torch.randint(0, 2, (4,)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
