"""NW110 on a projected distribution (stop 24, C51): a probability computed in float32
can end a few ulps above 1 and is still one; its zeros' log is named NW110 with the xlogy
way out, not 'not a probability'."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch


def test_a_distribution_a_few_ulps_above_one_is_still_a_probability() -> None:
    torch.manual_seed(0)
    q = nn.Linear(4, 5)
    m = torch.tensor([[0.0, 0.25, 0.75, 0.0, 0.0], [0.0, 0.0, 1.0000001, 0.0, 0.0]])
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(q, mode="forensic", postmortem=False) as nw,
    ):
        logp = q(torch.randn(2, 4)).log_softmax(-1)
        logm = m.log()
        loss = (m * (logm - logp)).sum(-1).mean()
        loss.backward()
        nw.step()
    d = next(d for d in info.value.diagnoses if d.code == "NW110")
    assert "not a probability" not in " ".join([d.explanation, *d.evidence])
    assert "torch.special.xlogy(p, p)" in d.fix
