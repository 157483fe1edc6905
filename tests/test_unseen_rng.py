"""A forward that draws from Python's or NumPy's global generator (a ported augmentation, a
teacher-forcing coin flip) is replayed without taking the user's draws: the generators are
put back, the watched run trains on the same numbers as the unwatched one, and a replay
that drew is called random, never a hardware fault."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

import nanwatch


class _Noisy(nn.Module):
    def __init__(self, draw: Callable[[], int]) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.draw = draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = float(self.draw())  # 0 or 1
        return self.lin(x) / k  # k == 0: inf, every time it is drawn


DRAWS: dict[str, Callable[[], int]] = {
    "numpy": lambda: int(np.random.randint(0, 2)),
    "random": lambda: random.randint(0, 1),
}


def _sums(kind: str, watched: bool) -> tuple[list[float], list[str]]:
    torch.manual_seed(0)
    np.random.seed(2)
    random.seed(2)
    m = _Noisy(DRAWS[kind])
    out: list[float] = []
    codes: list[str] = []
    if not watched:
        return [m(torch.ones(2, 4)).sum().item() for _ in range(6)], codes
    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        for _ in range(6):
            out.append(m(torch.ones(2, 4)).sum().item())
            trace = nw.step()
            codes += [d.code for d in trace.diagnoses]
    return out, codes


@pytest.mark.parametrize("kind", ["numpy", "random"])
def test_a_replay_gives_back_the_host_generators_draws(kind: str) -> None:
    plain, _ = _sums(kind, watched=False)
    watched, codes = _sums(kind, watched=True)
    assert not all(torch.isfinite(torch.tensor(plain)))  # the failure happens
    assert str(watched) == str(plain)  # same draws, NaN and inf where they were
    assert "NW404" not in codes  # not "transient: suspect the hardware"
