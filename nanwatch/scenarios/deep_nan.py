"""A NaN born four levels deep, in one block's experimental activation.

In practice: someone tries a new activation in one block of a deep model -- here a
"signed power" ``x ** 1.5`` that is NaN for negative inputs. The loss is NaN; every module
after the block passes the NaN on, and a hook that prints the first bad *output* it sees
in a wrapper module blames the wrong layer. nanwatch follows execution order and the data
flow down to the module where the value was born, and counts the modules that merely
propagated it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanwatch.records import AnomalyKind, Phase
from nanwatch.scenarios import Expected

TITLE = "NaN born deep inside a model (encoder.blocks.3.mlp.act)"
EXPECTED = Expected(
    kind=AnomalyKind.FORWARD,
    path="encoder.blocks.3.mlp.act",
    phase=Phase.FORWARD,
    op="aten.pow",
    diagnosis="NW112",
)


class PowerAct(nn.Module):
    """An experimental activation: x ** 1.5 (NaN for negative x)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x**1.5


class MLP(nn.Module):
    def __init__(self, d: int, act: nn.Module) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = act
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d: int, act: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = MLP(d, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Encoder(nn.Module):
    def __init__(self, d: int, depth: int) -> None:
        super().__init__()
        acts: list[nn.Module] = [nn.GELU() for _ in range(depth - 1)] + [PowerAct()]
        self.blocks = nn.ModuleList(Block(d, a) for a in acts)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class Model(nn.Module):
    def __init__(self, d: int = 16, depth: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.encoder = Encoder(d, depth)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    model = Model()
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with watch(model, criterion) as nw:
        for _ in range(2):
            x = torch.randn(4, 10, 16)
            y = torch.randint(0, 5, (4,))
            loss = criterion(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
