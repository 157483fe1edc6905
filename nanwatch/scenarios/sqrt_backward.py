"""A Euclidean distance of exactly 0: finite forward, infinite gradient in backward.

In practice: contrastive and metric-learning losses compute ``sqrt(((a - b) ** 2).sum())``.
When an anchor and its positive are the same sample (duplicates in the data, or the same
image drawn twice in a batch), the distance is exactly 0. sqrt(0) = 0 is fine, but its
derivative 1 / (2 sqrt(0)) is inf, and inf * 0 (the gradient of the squared difference)
is NaN: every parameter is NaN after the next optimizer step, while the forward pass never
showed a single bad value. ``torch.autograd.detect_anomaly`` names ``SqrtBackward0``;
nanwatch names the module and the line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanwatch.records import AnomalyKind, Phase
from nanwatch.scenarios import Expected

TITLE = "sqrt at zero: an infinite gradient born in backward"
EXPECTED = Expected(
    kind=AnomalyKind.BACKWARD, path="distance", phase=Phase.BACKWARD, diagnosis="NW112"
)


class PairDistance(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(((a - b) ** 2).sum(dim=-1))


class Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
        self.distance = PairDistance()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.distance(self.encoder(a), self.encoder(b))


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    model = Siamese()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model) as nw:
        for step in range(3):
            anchor = torch.randn(16, 16)
            positive = anchor + 0.1 * torch.randn(16, 16)
            if step == 2:
                positive[3] = anchor[3]  # the same sample drawn twice
            loss = model(anchor, positive).mean()  # pull positives together
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step(loss=loss)
