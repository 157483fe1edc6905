"""Forensic mode names the first op on the NaN's causal chain: when the op that made NaN
was given non-finite values that two ops made (log(v)'s -inf and x / v's +inf, v == 0), the
one that ran first is its cause and the step's origin, whatever the operand order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.ops import OpChecker
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


@pytest.mark.parametrize("log_first_operand", [True, False])
def test_the_op_checker_names_the_event_that_ran_first_as_the_cause(
    log_first_operand: bool,
) -> None:
    v = torch.zeros(4)
    with OpChecker() as chk:
        a = torch.log(v)  # -inf, made first
        b = torch.ones(4) / v  # +inf
        c = a + b if log_first_operand else b + a  # NaN
    assert c.isnan().all()
    nan = next(e for e in chk.events if "NaN" in e.born)
    assert [e.op.split(".")[1] for e in nan.chain()] == ["log", "add"]


class _MeanVar(nn.Module):
    def __init__(self, healthy: bool = False) -> None:
        super().__init__()
        self.healthy = healthy
        self.mu, self.var = nn.Linear(1, 1), nn.Linear(1, 1)
        with torch.no_grad():
            self.var.weight.zero_()
            self.var.bias.fill_(-1.0)  # ReLU of it: every variance exactly 0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raw = self.var(x)
        return self.mu(x), F.softplus(raw) + 1e-6 if self.healthy else F.relu(raw)


def _nll(net: _MeanVar, swapped: bool) -> None:
    x = torch.linspace(-3, 3, 8)[:, None]
    y = torch.sin(x)
    mu, var = net(x)
    if swapped:  # the log still runs first, as the right operand of the add
        lv = torch.log(var)
        loss = ((y - mu) ** 2 / (2 * var) + 0.5 * lv).mean()
    else:
        loss = (0.5 * torch.log(var) + (y - mu) ** 2 / (2 * var)).mean()
    loss.backward()


@pytest.mark.parametrize("swapped", [False, True])
def test_forensic_names_the_log_that_ran_before_the_division_not_the_division(
    swapped: bool,
) -> None:
    net = _MeanVar()
    err = _raises(net, lambda: _nll(net, swapped), "forensic")
    msg = str(err)
    assert "op aten.log" in msg and "which made -inf" in msg
    assert "aten.div" not in msg.splitlines()[0]
    d = err.diagnoses[0]
    assert d.code == "NW110"
    assert "F.softplus(raw) + 1e-6" in d.fix and "F.relu(raw)" in d.fix
    assert "clamp_min" not in d.fix
    # the fix it names (softplus in place of the ReLU) makes the whole loss finite
    healthy = _MeanVar(healthy=True)
    with nanwatch.watch(healthy, mode="forensic") as nw:
        _nll(healthy, swapped)
        nw.step()
    assert all(t.anomaly is None for t in nw.history)
