"""A sentinel step's -inf out of a model whose last op cannot write a mask (a Sequential
ending in a Linear) is an overflow born in the model, not in the loss; a replay (the default
mode) names the op that made a float16 -inf by overflow, not the later op that made NaN."""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.ops import ReplayResult
from nanwatch.records import OpEvent, Phase, TensorStat


def _line() -> int:
    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno


def _overflowing_net() -> nn.Sequential:
    net = nn.Sequential(nn.Linear(1, 4), nn.ReLU(), nn.Linear(4, 1))
    with torch.no_grad():
        net[0].weight.fill_(1e20)
        net[0].bias.zero_()
        net[2].weight.fill_(-1e20)
        net[2].bias.zero_()
    return net


def test_sentinel_neginf_out_of_a_sequential_is_born_in_the_model() -> None:
    net = _overflowing_net()
    x, y = torch.ones(8, 1), torch.zeros(8, 1)
    with nanwatch.watch(net, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
        line = _line() + 1
        out = net(x)
        ((out - y) ** 2).mean().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None
    assert a.kind is nanwatch.AnomalyKind.FORWARD
    # sentinel hooks the root alone: its replay names the Linear whose addmm overflowed
    assert a.path == "2"
    assert a.summary.startswith(
        "-inf born in the forward of 2 (Linear), inside Sequential; first seen in Sequential"
    )
    assert "(loss)" not in a.summary.split(" [")[0]
    assert a.op is not None and a.op.op.startswith("aten.addmm")
    assert a.op.source is not None and a.op.source.endswith(f":{line}")


class _MaskedPolicy(nn.Module):
    """Returns logits with the illegal actions masked to -inf (an RL policy)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, x: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return self.body(x).masked_fill(~legal, -math.inf)


def test_sentinel_masked_logits_out_of_a_model_are_not_an_anomaly() -> None:
    torch.manual_seed(0)
    pol = _MaskedPolicy()
    legal = torch.tensor([[True, False, True, True]] * 5)
    with nanwatch.watch(pol, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
        logits = pol(torch.randn(5, 3), legal)
        F.cross_entropy(logits, torch.zeros(5, dtype=torch.long)).backward()
        nw.step()
    assert nw.first_anomaly is None


def _ev(op: str, born: str, *, injected: bool = False) -> OpEvent:
    return OpEvent(op, Phase.FORWARD, "m", born, TensorStat(-math.inf, 1.0, 4), injected=injected)


def test_replay_first_is_a_neginf_only_an_overflow_made() -> None:
    bmm, sub = _ev("aten.bmm.default", "-inf"), _ev("aten.sub.Tensor", "NaN")
    assert ReplayResult(events=[bmm, sub]).first() is bmm
    fill = _ev("aten.masked_fill.Scalar", "-inf", injected=True)
    log = _ev("aten.log.default", "-inf")
    assert ReplayResult(events=[fill, log, sub]).first() is sub  # a log of 0 may be a mask


class _Half(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.o = nn.Linear(8, 8)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        s = torch.bmm(a, b)  # float16: past -65504, -inf
        return self.o(s - s.amin())  # -inf - -inf: NaN


def test_default_mode_names_the_float16_product_that_overflowed_to_neginf() -> None:
    torch.manual_seed(0)
    m = _Half().half()
    a = torch.full((1, 8, 8), 300.0, dtype=torch.float16)
    b = torch.full((1, 8, 8), -300.0, dtype=torch.float16)
    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        m(a, b).float().sum().backward()
        nw.step()
    a_ = nw.first_anomaly
    assert a_ is not None
    assert a_.op is not None
    assert a_.op.op.startswith("aten.bmm"), a_.summary
    src = inspect.getsource(_Half.forward).splitlines()
    first = _Half.forward.__code__.co_firstlineno
    bmm_line = first + next(i for i, t in enumerate(src) if "torch.bmm" in t)
    assert a_.op.source is not None and a_.op.source.endswith(f":{bmm_line}")


def test_replay_names_the_float16_product_that_overflowed_to_neginf() -> None:
    m = _Half().half()
    a = torch.full((1, 8, 8), 300.0, dtype=torch.float16)
    b = torch.full((1, 8, 8), -300.0, dtype=torch.float16)
    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        m(a, b).float().sum().backward()
        nw.step()
        nw.replay(lambda: m(a, b).float().sum().backward())
    found = nw.first_anomaly
    assert found is not None and found.op is not None
    assert found.op.op.startswith("aten.bmm"), found.summary
