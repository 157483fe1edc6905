"""A min-max feature scaler divides 0 by 0 when a feature is constant in the batch.

In practice: a hand-written normalization layer, ``(x - min) / (max - min)``, works for
months until a batch arrives where one feature never varies (a padding channel, a sensor
stuck at a value, a one-hot column absent from the batch). ``max - min`` is then exactly 0
and the division gives 0/0 = NaN for that whole column; the loss is NaN a few layers later.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanwatch.records import AnomalyKind, Phase
from nanwatch.scenarios import Expected

TITLE = "Division by zero in a custom normalization layer"
EXPECTED = Expected(
    kind=AnomalyKind.FORWARD,
    path="norm",
    phase=Phase.FORWARD,
    op="aten.div",
    dtype="float32",
    diagnosis="NW111",
)


class MinMaxScale(nn.Module):
    """Scales each feature of the batch to [0, 1]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lo = x.min(dim=0, keepdim=True).values
        hi = x.max(dim=0, keepdim=True).values
        return (x - lo) / (hi - lo)


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = MinMaxScale()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.norm(x))


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    model = Regressor()
    criterion = nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, criterion) as nw:
        for step in range(3):
            x = torch.randn(32, 8)
            if step == 2:
                x[:, 5] = 0.0  # this batch has no variation in feature 5
            y = x.sum(dim=1, keepdim=True)
            loss = criterion(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
