"""An in-place op on an activation that autograd saved for backward.

In practice: ``gate.mul_(2)``, ``x += residual``, ``out[mask] = 0`` or an ``inplace=True``
activation applied to a tensor that an earlier op saved for its backward. Forward runs
fine; backward raises "one of the variables needed for gradient computation has been
modified by an inplace operation: ... output 0 of SigmoidBackward0, is at version 1",
which names an autograd node, not your module. nanwatch records each output's ``grad_fn``
and version counter (host-side, free) and names the module whose saved output changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanwatch.scenarios import Expected

TITLE = "In-place op on a saved activation breaks backward"
EXPECTED = Expected(raises=RuntimeError, diagnosis="NW403")

#: the module whose output was modified in place after autograd saved it
MUTATED = "block.act"


class GatedBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, d)
        self.act = nn.Sigmoid()
        self.value = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.act(self.gate_proj(x))
        gate.mul_(2)  # rescale gates to [0, 2] -- in place, on the tensor sigmoid saved
        return gate * self.value(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = GatedBlock(16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    model = Net()
    criterion = nn.MSELoss()
    with watch(model, criterion):
        x, y = torch.randn(8, 16), torch.randn(8, 1)
        loss = criterion(model(x), y)
        loss.backward()  # RuntimeError: ... modified by an inplace operation
