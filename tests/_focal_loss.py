"""A loss helper that lives in its own file, imported by a test's training loop (as a
project's ``losses.py`` is): a focal loss whose ``(1 - pt) ** gamma`` with ``gamma < 1``
has an infinite derivative where ``pt`` is exactly 1."""

from __future__ import annotations

import torch


def focal(logits: torch.Tensor, y: torch.Tensor, gamma: float = 0.5) -> torch.Tensor:
    p = torch.sigmoid(logits)
    pt = torch.where(y > 0, p, 1 - p)
    weight = (1 - pt) ** gamma  # the focal weight
    return (-weight * torch.log(pt.clamp_min(1e-8))).mean()
