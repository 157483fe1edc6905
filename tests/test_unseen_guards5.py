"""A +inf in a cross-entropy input that came from a term computed without gradients (a logQ
sampling-bias correction ``logits - torch.log(q)``, ``q`` 0 for a new item): it never
enters the autograd graph, so the watcher cannot name it; the guard does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

torch.set_num_threads(1)


def _step(q: torch.Tensor) -> None:
    torch.manual_seed(0)
    model = nn.Embedding(10, 8)  # the item tower
    with nanwatch.watch(model, postmortem=False):
        u = torch.randn(4, 8)
        items = torch.tensor([1, 9, 3, 4])
        logits = u @ model(items).T / 0.1
        logits = logits - torch.log(q[items])[None, :]
        loss = F.cross_entropy(logits, torch.arange(4))
        loss.backward()


def test_logq_correction_with_a_zero_frequency_is_stopped_by_the_guard() -> None:
    q = torch.tensor([0.2, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.0])  # item 9 never seen
    with pytest.raises(nanwatch.GuardError) as info:
        _step(q)
    err = info.value
    assert (err.code, err.check) == ("NW519", "nograd-term")
    msg = str(err)
    assert "logits holds 4 +inf of 16 values" in msg
    assert "computed without gradients" in msg and "subtracted from" in msg
    assert err.fix is not None
    # a floor that is a probability (uniform over the table), not finfo.tiny (log -87)
    assert err.fix.startswith("logits = logits - torch.log(q[items].clamp_min(1.0 / q.numel()))")
    assert err.source is not None and err.source.endswith(":25")


def test_logq_correction_with_positive_frequencies_is_silent() -> None:
    _step(torch.full((10,), 0.1))


class _LogTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)

    def forward(self, items: torch.Tensor) -> torch.Tensor:
        return -torch.log(self.emb(items).relu() * 0)  # +inf made inside a watched module


def test_inf_from_a_watched_module_is_left_to_the_watcher() -> None:
    torch.manual_seed(0)
    model = _LogTower()
    bias = torch.zeros(4)
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(model, postmortem=False):
        logits = model(torch.tensor([1, 2, 3, 4]))[:, :4] - bias
        F.cross_entropy(logits, torch.arange(4)).backward()
    assert not isinstance(info.value, nanwatch.GuardError)
