"""A hand-written focal loss raises ``(1 - p)`` to a fractional power: finite forward,
NaN gradient once a prediction is certain.

In practice: focal loss (detection, imbalanced classification) written as
``(1 - p) ** gamma * -log(p)`` with a gamma below 1, or any ``x ** 0.5`` in a loss. When the
model becomes certain of an example, ``p`` rounds to exactly 1.0, ``1 - p`` is 0, and the
power's derivative ``gamma * 0 ** (gamma - 1)`` is infinite: the loss value looks fine, the
gradient that reaches the model is NaN, and the next optimizer step ruins every weight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanwatch.records import AnomalyKind, Phase
from nanwatch.scenarios import Expected

TITLE = "Focal loss with gamma < 1: a NaN gradient from loss code"
EXPECTED = Expected(
    kind=AnomalyKind.BACKWARD,
    path="(loss)",
    phase=Phase.BACKWARD,
    op="aten.pow",
    dtype="float32",
    diagnosis="NW112",
)

GAMMA = 0.5


def focal_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(logits, dim=-1).gather(1, target[:, None]).squeeze(1)
    return (-((1 - p) ** GAMMA) * torch.log(p.clamp_min(1e-12))).mean()


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    head = nn.Linear(32, 3)
    with torch.no_grad():
        head.weight.mul_(60)  # a confident model: some probabilities round to 1.0
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), head)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model) as nw:
        for _ in range(3):
            x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
            loss = focal_loss(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            opt.zero_grad()
            nw.step()
