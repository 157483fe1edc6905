"""A NaN in one sample of the batch: bad data, not a bad layer.

In practice: a missing value in a CSV parsed as NaN, a division by a zero standard
deviation in the preprocessing of one image, a corrupted file. The first layer turns the
NaN into NaN activations and the loss is NaN; layer-by-layer tools blame the first layer.
nanwatch checks the batch itself and names the sample.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanwatch.records import AnomalyKind, Phase
from nanwatch.scenarios import Expected

TITLE = "NaN in the input data"
EXPECTED = Expected(kind=AnomalyKind.INPUT, path="Sequential", phase=Phase.INPUT, diagnosis="NW401")

BAD_SAMPLE = 13


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with watch(model, criterion) as nw:
        for step in range(3):
            x = torch.randn(32, 10)
            y = torch.randint(0, 3, (32,))
            if step == 1:
                x[BAD_SAMPLE, 4] = float("nan")  # a missing value in one row of the data
            loss = criterion(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
