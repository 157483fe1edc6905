"""NW401 for whole samples gone NaN in a mode that traces no op: the batch or the user's
code before the call (a division by a per-sample speed of 0), so the fix leads with the
mode that names the op and the floor of a division, the data's repair after them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch

torch.set_num_threads(1)


def test_whole_samples_gone_nan_lead_with_the_mode_that_names_the_op() -> None:
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Flatten(), nn.Linear(8, 2))
    x = torch.randn(6, 4, 2)
    x[3] = 0.0  # a parked car: speed 0
    speed = (x[:, -1] - x[:, -2]).norm(dim=-1, keepdim=True)
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(enc):
        enc(x / speed[:, :, None]).sum().backward()
    d = info.value.diagnosis
    assert d is not None and d.code == "NW401"
    first = d.fix.splitlines()[0]
    assert 'mode="forensic"' in first, d.fix
    lines = d.fix.splitlines()
    code = next(i for i, ln in enumerate(lines) if "clamp_min" in ln)
    data = next(i for i, ln in enumerate(lines) if "nan_to_num" in ln)
    assert code < data, "the user's own division first, the data's repair after"
    assert "your code before the call" in d.explanation or "before the call" in d.explanation
    assert "cannot tell which" in d.explanation
