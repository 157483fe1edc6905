"""nn.Softmax at the end of the model, then nn.CrossEntropyLoss: a softmax applied twice.

In practice: a classifier written to "output probabilities" ends in ``nn.Softmax(dim=1)``
and is trained with ``nn.CrossEntropyLoss``, which applies ``log_softmax`` itself. No error,
no NaN: the loss goes down a little and then plateaus far above zero, because the second
softmax only ever sees values in [0, 1] and the gradients shrink. Runs like this survive
for months as "a model that does not learn well". nanwatch follows the tensor the Softmax
module returned into the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanwatch.scenarios import Expected

TITLE = "nn.Softmax followed by nn.CrossEntropyLoss (double softmax)"
EXPECTED = Expected(kind=None, diagnosis="NW203")

CLASSES = 10


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64),
        nn.ReLU(),
        nn.Linear(64, CLASSES),
        nn.Softmax(dim=1),  # "the model outputs probabilities"
    )
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, criterion) as nw:
        for _ in range(4):
            x = torch.randn(32, 16)
            y = x[:, :CLASSES].argmax(dim=1)
            loss = criterion(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
