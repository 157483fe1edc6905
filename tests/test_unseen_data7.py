"""NW401 for a loss target (stop 24, value-based RL): the fix never sets a non-finite
target to 0 with nan_to_num, which trains the model toward 0 there."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch


def test_a_nan_target_is_asserted_where_it_is_made_not_zeroed() -> None:
    """A TD target made NaN by the loop (rewards normalized by a std of 0) reaches
    SmoothL1Loss: the old fix ended with y = torch.nan_to_num(y, nan=0.0, ...), which
    silently trains Q toward 0."""
    torch.manual_seed(0)
    q, crit = nn.Linear(4, 2), nn.SmoothL1Loss()
    s, r = torch.randn(8, 4), torch.zeros(8)
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(q, crit, postmortem=False) as nw,
    ):
        r = (r - r.mean()) / r.std()  # sparse rewards, all 0: 0/0
        y = r + 0.99 * q(s).max(1).values.detach()
        crit(q(s).gather(1, torch.zeros(8, 1, dtype=torch.long)).squeeze(1), y).backward()
        nw.step()
    (d,) = [d for d in info.value.diagnoses if d.code == "NW401"]
    assert "torch.nan_to_num" not in d.fix, d.fix
    assert "assert torch.isfinite(y).all()" in d.fix and "do not nan_to_num a target" in d.fix
