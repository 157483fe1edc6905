"""Sentinel hooks the roots alone: a loop that calls a submodule of the root, never the
root (Lightning's ``self.net(x)`` in training_step), gave no watched output a gradient,
so the end-of-backward check of the parameter gradients never ran. It runs after the
backward then."""

from __future__ import annotations

import torch
from torch import nn

import nanwatch


class _M(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_gradients_of_a_submodule_call_are_read_and_a_nan_one_caught() -> None:
    torch.manual_seed(0)
    m = _M()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with nanwatch.watch(m, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
        for i in range(2):
            out = m.net(torch.randn(8, 4))  # the submodule, never m itself
            # step 1: sqrt of exact zeros, a NaN gradient while the loss is finite
            zero = (out - out.detach()).pow(2).sum(1).sqrt().mean()
            loss = out.pow(2).mean() if i == 0 else zero
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    first, second = nw.history
    assert first.grad_norm is not None and first.grad_norm > 0  # read, and finite
    assert first.diagnoses == []
    # before the weights, and named: the loss code's sqrt at 0, the one node on the way
    # to the parameters whose backward can make it
    assert [d.code for d in second.diagnoses][:1] == ["NW112"]
