"""Step numbers of a loop that generates under no_grad after its update and before its
``nw.step()`` (an RL or text-generation loop): before the first ``nw.step()`` each no_grad
call began a step, and the user's steps were numbered from 4, not 1. They are folded into
the training step at the first ``nw.step()``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

torch.set_num_threads(1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(8, 8), nn.Linear(8, 8))


def _generate(m: nn.Module, idx: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(n):
            idx = torch.cat([idx, m(idx)[:, -1].argmax(-1, keepdim=True)], 1)
    return idx


def test_generation_after_the_update_is_part_of_the_loops_step() -> None:
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    seen = []
    with nanwatch.watch(m) as nw:
        for _ in range(3):
            x = torch.randint(0, 8, (2, 4))
            F.cross_entropy(m(x).reshape(-1, 8), x.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
            _generate(m, x[:, :2], 3)
            nw.step()
            seen.append(nw.step_index)
    assert seen == [1, 2, 3]
    assert [t.step for t in nw.history][-3:] == [0, 1, 2]
    assert sum(c.path == "Sequential" for c in nw.history[0].calls) == 4, "one step: all calls"


def test_an_anomaly_in_a_later_iteration_reports_the_loops_step() -> None:
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(m) as nw:
        for it in range(3):
            x = torch.randint(0, 8, (2, 4))
            if it == 2:
                with torch.no_grad():
                    m[1].bias[0] = float("nan")  # a NaN weight, read by the next forward
            F.cross_entropy(m(x).reshape(-1, 8), x.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
            _generate(m, x[:, :2], 3)
            nw.step()
    a = info.value.anomaly
    assert a is not None and a.step == 2
