"""A mean over groups divided by a count held in a float tensor (``torch.bincount(batch)
.float()``) with an empty group: the evidence says how many of the count's own entries are
0 -- "1 of its 4 counts is 0", the count's size, not the numerator's, with the verb agreeing
with the number -- and what shows it is a count, in words that read as a reason."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch

torch.set_num_threads(1)


class _Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 2)

    def forward(self, h: torch.Tensor, batch: torch.Tensor, num_graphs: int) -> torch.Tensor:
        s = torch.zeros(num_graphs, h.size(1)).index_add_(0, batch, h)
        n_nodes = torch.bincount(batch, minlength=num_graphs).float()
        return self.head(s / n_nodes[:, None])


def _run(batch: list[int], mode: str) -> nanwatch.Watcher:
    torch.manual_seed(0)
    m = _Pool()
    with nanwatch.watch(m, mode=mode, on_anomaly="record", postmortem=False) as nw:
        m(torch.randn(len(batch), 4), torch.tensor(batch), 4).sum().backward()
        nw.step()
    return nw


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_one_empty_group_of_four_is_said_of_the_counts(mode: str) -> None:
    d = _run([0, 0, 0, 2, 2, 3, 3], mode).report.diagnoses[0]
    assert d.code == "NW111", d.headline
    assert d.evidence[0] == (
        "denominator is a count held in a float32 tensor (min 0, max 3): 1 of its 4 counts "
        "is 0, a group with nothing in it; made as a count: n_nodes = "
        "torch.bincount(batch, minlength=num_graphs).float()"
    )
    assert d.fix.startswith("return self.head(s / n_nodes[:, None].clamp_min(1))")


def test_two_empty_groups_are_plural() -> None:
    d = _run([0, 0, 0, 2, 2, 2, 2], "watch").report.diagnoses[0]
    assert "2 of its 4 counts are 0, groups with nothing in them" in d.evidence[0]


def test_no_empty_group_stays_silent() -> None:
    assert _run([0, 1, 1, 2, 2, 3, 3], "watch").report.diagnoses == []
