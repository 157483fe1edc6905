"""Healthy control: a float16 model that is fine.

In practice: float16 training works for most models; values of a few hundred are far
from float16's limit of 65504 and exp's bound of 11.09 is only reached by logits that are
large *and* exponentiated. nanwatch must not warn about float16 as such.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanwatch.scenarios import Expected

TITLE = "Healthy: a float16 model"
EXPECTED = Expected(kind=None, healthy=True)


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64),
        nn.GELU(),
        nn.LayerNorm(64),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Linear(64, 4),
    ).half()
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with watch(model, criterion) as nw:
        for _ in range(4):
            x = torch.randn(32, 16).half()
            loss = criterion(model(x).float(), torch.randint(0, 4, (32,)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
