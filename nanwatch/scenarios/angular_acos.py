"""An angular loss takes ``acos`` of a cosine that rounding put just above 1.

In practice: ArcFace/CosFace-style margins, angle-based metric learning and geodesic
distances on the sphere compute ``torch.acos(F.cosine_similarity(a, b))``. For two
identical (or nearly parallel) embeddings the cosine comes out a rounding step above 1.0,
``acos`` of it is NaN, and the NaN spreads through the loss; the fix is a clamp with a
margin from ``torch.finfo``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanwatch.records import AnomalyKind, Phase
from nanwatch.scenarios import Expected

TITLE = "acos of a cosine rounded above 1 in an angular loss"
EXPECTED = Expected(
    kind=AnomalyKind.FORWARD,
    path="angle",
    phase=Phase.FORWARD,
    op="aten.acos",
    dtype="float32",
    diagnosis="NW114",
)


class Angle(nn.Module):
    """The angle between two embeddings, in radians."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        cos = F.cosine_similarity(a, b, dim=-1) * (1 + 2e-7)  # a margin term gone wrong
        return torch.acos(cos)


class Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 8))
        self.angle = Angle()

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return self.angle(self.encoder(x1), self.encoder(x2))


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    model = Siamese()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with watch(model) as nw:
        for step in range(3):
            x1 = torch.randn(16, 12)
            # positive pairs are augmented views; in the last batch the augmentation was off
            x2 = x1 + (0.1 * torch.randn_like(x1) if step < 2 else 0.0)
            loss = model(x1, x2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
