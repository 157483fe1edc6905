"""A model that ends in nn.Sigmoid, trained with nn.BCELoss: fine today, fragile tomorrow.

In practice: the pairing of countless tutorials and ported Keras code -- a binary
classifier whose last layer is ``nn.Sigmoid()`` and whose loss is ``nn.BCELoss()``. It
trains, and nothing looks wrong, but the log of the probability is taken in two steps:
once the model grows confident the sigmoid rounds to exactly 0 or 1, PyTorch clamps the
log at -100, and those samples stop contributing any gradient (the "massive loss" of the
bce-saturated scenario). ``BCEWithLogitsLoss`` on the logits computes the same loss in one
stable step. nanwatch sees the Sigmoid module's output reach the loss in the data flow
(a note at the first step) and, a few steps of a brisk learning rate later, its largest
probabilities come within a few float32 eps of 1: the warning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanwatch.scenarios import Expected

TITLE = "nn.Sigmoid followed by nn.BCELoss"
EXPECTED = Expected(kind=None, diagnosis="NW202")


class Detector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 1))
        self.act = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.body(x))


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    model = Detector()
    criterion = nn.BCELoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-1)
    with watch(model, criterion) as nw:
        for _ in range(8):
            x = torch.randn(64, 20)
            y = (x[:, :1] + 0.5 * x[:, 1:2] > 0).float()
            loss = criterion(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
