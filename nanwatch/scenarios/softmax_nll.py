"""nn.Softmax followed by nn.NLLLoss: the loss of probabilities, not log-probabilities.

In practice: ``NLLLoss`` is documented as taking log-probabilities (``nn.LogSoftmax``), but
its name says "negative log likelihood" and people hand it probabilities from
``nn.Softmax``. It computes ``-p[target]`` instead of ``-log p[target]``: the loss is
negative, bounded in [-1, 0], and its gradient does not grow for confidently wrong
predictions, so training crawls. Nothing raises; the first sign is a negative loss on the
dashboard. nanwatch sees the Softmax module's output reach NLLLoss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanwatch.scenarios import Expected

TITLE = "nn.Softmax followed by nn.NLLLoss (use LogSoftmax)"
EXPECTED = Expected(kind=None, diagnosis="NW204")

CLASSES = 5


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(12, 48), nn.Tanh())
        self.head = nn.Linear(48, CLASSES)
        self.out = nn.Softmax(dim=1)  # should be nn.LogSoftmax(dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.head(self.features(x)))


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    model = Classifier()
    criterion = nn.NLLLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with watch(model, criterion) as nw:
        for _ in range(4):
            x = torch.randn(48, 12)
            y = torch.randint(0, CLASSES, (48,))
            loss = criterion(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
