"""An optimizer built before the model was deep-copied steps the old tensors: NW315's fix
builds that same optimizer (its class and lr, under the user's variable) on the model as
it trains, where it pasted ``optimizer = torch.optim.SGD(model.parameters(), lr=0.1)``
for an ``opt = Adam(..., lr=1e-2)`` and ``model = Net()`` for the user's own class."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import nanwatch


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _run(mode: str, *, copied: bool) -> Any:
    torch.manual_seed(0)
    net = Tagger()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    if copied:
        net = copy.deepcopy(net)  # opt holds the old tensors
    crit = nn.MSELoss()
    with nanwatch.watch(net, crit, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(5):
            x = torch.randn(32, 8)
            crit(net(x), x.sum(1, keepdim=True)).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_the_fix_rebuilds_the_users_own_optimizer_on_the_users_model(mode: str) -> None:
    nw = _run(mode, copied=True)
    d = next(d for d in nw.report.diagnoses if d.code == "NW315")
    lines = [ln.split("  #", 1)[0].strip() for ln in d.fix.splitlines()]
    assert lines == ["net = Tagger()", "opt = torch.optim.Adam(net.parameters(), lr=0.01)"]
    assert "(with your arguments)" in d.fix


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_the_optimizer_built_on_the_model_it_trains_is_silent(mode: str) -> None:
    nw = _run(mode, copied=False)
    assert [d.headline for d in nw.report.diagnoses] == []
