"""Sign targets of margin losses (found on unseen ranking models): ties from
``sign(rank_a - rank_b)`` are a deliberate 0 beside 1 and -1, not 0/1 labels."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch import GuardError


def _scores() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(32, requires_grad=True), torch.randn(32, requires_grad=True)


@pytest.mark.parametrize("margin", [0.0, 0.5])
def test_ranking_ties_from_sign_stay_silent(margin: float) -> None:
    """MarginRankingLoss with target = sign(ra - rb): a tie gives 0, scored as a constant
    with no gradient (the usual way to skip tied pairs). It stopped a healthy run."""
    a, b = _scores()
    ra, rb = torch.randint(0, 3, (32,)), torch.randint(0, 3, (32,))
    y = torch.sign(ra - rb).float()
    assert (y == 0).any() and (y == -1).any()
    crit = nn.MarginRankingLoss(margin=margin)
    with nanwatch.watch(crit) as nw:
        loss = crit(a, b, y)
        loss.backward()
        nw.step()
    assert torch.isfinite(loss)
    assert not [d for d in nw.report.diagnoses if d.code == "NW510"]


def test_zero_one_labels_are_still_stopped_with_the_sign_fix() -> None:
    a, b = _scores()
    y = (torch.arange(32) % 2).float()  # 0/1 labels: -1 never appears
    crit = nn.MarginRankingLoss(margin=1.0)
    with pytest.raises(GuardError) as info, nanwatch.watch(crit):
        crit(a, b, y)
    assert info.value.code == "NW510" and "0/1 labels" in str(info.value)
    assert "y * 2 - 1" in info.value.fix


def test_a_zero_hinge_embedding_target_is_still_stopped() -> None:
    """HingeEmbeddingLoss scores a 0 target as x + max(0, margin - x): not skipped."""
    x = torch.rand(8, requires_grad=True)
    y = torch.tensor([1.0, -1.0, 0.0, 1.0, -1.0, 1.0, 1.0, -1.0])
    crit = nn.HingeEmbeddingLoss()
    with pytest.raises(GuardError) as info, nanwatch.watch(crit):
        crit(x, y)
    assert info.value.code == "NW510"
