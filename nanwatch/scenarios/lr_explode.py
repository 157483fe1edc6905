"""A learning-rate typo blows the weights up: an optimizer step writes inf into them.

In practice: ``lr=1e3`` where ``1e-3`` was meant, a warm-up schedule that never decays, or
a model cast to float16 (``model.half()``) with hyper-parameters tuned in float32. Each
step over-corrects, the weights oscillate with growing amplitude, and one update no
longer fits in the dtype: the weight becomes inf *in the optimizer step*, between two
forward passes. The next step's loss is NaN and every layer-level tool blames whichever
layer multiplied by the weight first. nanwatch checks the weights and names the parameter
the update broke.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanwatch.records import AnomalyKind, Phase
from nanwatch.scenarios import Expected

TITLE = "A learning rate that blows the weights up"
EXPECTED = Expected(
    kind=AnomalyKind.PARAMETER,
    phase=Phase.PARAMETER,
    parameter="proj.weight",
    dtype="float16",
    diagnosis="NW301",
)


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    model = Regressor().half()  # float16 weights, hyper-parameters from a float32 run
    criterion = nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e3)  # meant 1e-3
    x = (0.05 * torch.randn(64, 8)).half()
    y = torch.randn(64, 1)
    with watch(model, criterion) as nw:
        for _ in range(14):
            loss = criterion(model(x).float(), y)  # the loss itself in float32
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
