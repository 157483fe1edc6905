"""Healthy control: a float32 classifier with large but perfectly safe logits.

In practice: logits in the thousands are alarming to read but harmless in float32 (exp
overflows only above 88.7, and cross-entropy never calls exp on raw logits). A tool with
thresholds written for float16 would cry wolf here; nanwatch derives every limit from the
dtype at hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanwatch.scenarios import Expected

TITLE = "Healthy: float32 MLP with large logits"
EXPECTED = Expected(kind=None, healthy=True)


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    head = nn.Linear(64, 10)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), head)
    with torch.no_grad():
        head.weight.mul_(500.0)  # logits around a few thousand
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    with watch(model, criterion) as nw:
        for _ in range(4):
            x = torch.randn(32, 20)
            loss = criterion(model(x), torch.randint(0, 10, (32,)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
