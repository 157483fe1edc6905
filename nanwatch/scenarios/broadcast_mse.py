"""An (N, 1) prediction against an (N,) target: MSELoss broadcasts them to N x N.

In practice: a regression head ``nn.Linear(d, 1)`` returns shape (N, 1); the targets come
from a dataframe column or a 1-d label tensor with shape (N,). ``nn.MSELoss`` broadcasts
(N, 1) - (N,) to (N, N): every prediction is compared with every target of the batch, not
with its own. PyTorch only emits a UserWarning, easily lost in a log; the loss decreases
and looks plausible while the model learns to predict the batch mean (R² near 0). nanwatch
stops at the first step with a GuardError and the fix: ``criterion(pred.squeeze(-1), y)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanwatch.errors import GuardError
from nanwatch.scenarios import Expected

TITLE = "MSELoss on (N, 1) vs (N,): silent N x N broadcasting"
EXPECTED = Expected(raises=GuardError, diagnosis="NW506")

FEATURES = 8
BATCH = 64


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    true_w = torch.randn(FEATURES)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 1))
    criterion = nn.MSELoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with watch(model, criterion) as nw:
        for _ in range(5):
            x = torch.randn(BATCH, FEATURES)
            y = x @ true_w + 0.1 * torch.randn(BATCH)  # shape (BATCH,)
            pred = model(x)  # shape (BATCH, 1)
            loss = criterion(pred, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
