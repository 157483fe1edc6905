"""Healthy: float16 autocast with a GradScaler that skips its first steps by design.

In practice: every mixed-precision loop on a GPU (``torch.amp.GradScaler``). The scaler
starts with a large scale; the first backward passes overflow float16 and produce inf
gradients, the scaler skips those optimizer steps and halves the scale until the
gradients fit. That is the scaler working, not an anomaly: nanwatch finds the scaler at
``scaler.scale(loss)`` without being told and stays quiet. (On the CPU, float16 autocast
and the GradScaler run too, so the gallery can show it.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanwatch.scenarios import Expected

TITLE = "Healthy: float16 autocast with a GradScaler skipping its first steps"
EXPECTED = Expected(healthy=True)


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    with watch(model, criterion) as nw:
        for _ in range(8):
            x, y = torch.randn(64, 32) * 4, torch.randint(0, 10, (64,))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = criterion(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            nw.step()
