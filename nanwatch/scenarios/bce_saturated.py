"""BCELoss on probabilities that are exactly 0 and 1: a "massive loss", not a NaN.

In practice: a binary classifier that ends in ``torch.sigmoid`` and is trained with
``nn.BCELoss``. Once it grows confident, float32 sigmoid rounds to exactly 1.0 for logits
above about 17 and to exactly 0.0 below about -104. log(0) would be -inf, so PyTorch clamps
the log at -100: every confidently wrong prediction costs exactly 100, the loss jumps to
tens with no NaN anywhere, and the gradient through the clamp is 0, so the model cannot
recover. The fix is ``BCEWithLogitsLoss`` on the logits, which never rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanwatch.scenarios import Expected

TITLE = "BCELoss on saturated probabilities (the massive loss)"
EXPECTED = Expected(kind=None, diagnosis="NW201")

#: fraction of labels the confident model gets wrong: the loss is about 100 times this.
WRONG = 0.25


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.head(self.body(x))).squeeze(1)


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    model = Classifier()
    with torch.no_grad():
        model.head.weight.mul_(5000.0)  # an over-confident model: logits in the thousands
    criterion = nn.BCELoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with watch(model, criterion) as nw:
        for _ in range(3):
            x = torch.randn(64, 12)
            y = (model.head(model.body(x)).squeeze(1) > 0).float().detach()
            y[: int(WRONG * 64)] = 1 - y[: int(WRONG * 64)]  # noisy labels
            loss = criterion(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
