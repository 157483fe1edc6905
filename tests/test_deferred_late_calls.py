"""The accelerator path (statistics read after the calls) driven on the CPU, where the
calls that made a value are over when it is read: a computed batch freed by then, a
gradient freed after backward, a user's pre-hook, a submodule replayed through its root,
a -inf only a gradient told of, and the user's names in a closure that has returned.
Each gets the diagnosis the CPU path gives."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import AnomalyKind, Phase

torch.set_num_threads(1)


#: every watcher takes the accelerator path (the ``deferred`` fixture of conftest)
pytestmark = pytest.mark.usefixtures("deferred")


def _top(nw: Any) -> Any:
    trace = nw.first_bad_step
    assert trace is not None and trace.diagnoses
    return trace.diagnoses[0]


def test_an_attacks_batch_freed_before_the_read_is_still_told_from_data() -> None:
    """An L2 attack step divides each sample's input gradient by its norm; a blank sample's
    is 0 (no bias, then ReLU): 0/0 throughout. The attacked batch of the second iteration
    was freed with its graph before the read: the per-sample counts tell a whole sample."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.ReLU(), nn.Linear(6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for it in range(2):
            x, y = torch.rand(5, 4), torch.randint(0, 3, (5,))
            if it == 1:
                x[2] = 0.0
            d = torch.zeros_like(x)
            for _ in range(2):
                d.requires_grad_(True)
                (g,) = torch.autograd.grad(F.cross_entropy(model(x + d), y), d)
                d = d.detach() + 0.1 * g / g.norm(dim=1, keepdim=True)
            loss = F.cross_entropy(model((x + d).detach()), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
            if nw.first_anomaly is not None:
                break
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.INPUT
    s = a.record.stat
    assert s is not None and s.nan is None and s.nonfinite == 4 and s.bad_rows == (2,)
    d = _top(nw)
    assert d.title == "NaN in an input your code computed between two calls of Sequential"
    assert "clamp_min(eps)" in d.fix


def test_a_target_freed_with_its_gradient_is_counted_by_the_losss_guard() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x, y = torch.randn(50, 3), torch.randn(50, 1)
    y[[4, 9], 0] = float("nan")
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        F.mse_loss(model(x), y).backward()
        nw.step()
    note = next(n for n in nw.history[0].notes if n.kind == "loss_input")
    assert note.data["target_nonfinite"] == 2
    d = _top(nw)
    assert d.code == "NW401"
    assert "2 of its 50 values are NaN" in " ".join(d.evidence)


def _center(mod: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
    x = args[0]
    return (x / x.abs().amax(1, keepdim=True),)


def test_a_users_pre_hook_is_replayed_with_the_calls_own_code() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    model.register_forward_pre_hook(_center)
    x = torch.randn(3, 5)
    x[2] = 0.0  # 0 / 0
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(x).sum().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.path == "Sequential"
    assert a.op is not None and a.op.op == "aten.div.Tensor"
    data = next(r for r in nw.history[0].records if r.phase is Phase.INPUT)
    assert data.stat is not None and data.stat.finite  # the batch as passed


class _Gain(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("g", torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.g


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.gain, self.b = nn.Linear(4, 6), nn.Identity(), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.gain(self.a(x)))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_submodules_bad_buffer_replayed_through_its_root_is_its_state(bad: float) -> None:
    """Assigned after attach (it shares its path with the module it replaced); an inf one
    makes inf - inf in the next layer, after the value the anomaly is about."""
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with nanwatch.watch(net, on_anomaly="record", postmortem=False) as nw:
        for step in range(3):
            if step == 1:
                net.gain = _Gain(6)
                net.gain.g[2] = bad
                net.gain.g[3] = -bad
            net(torch.randn(4, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    d = _top(nw)
    assert (d.code, d.path) == ("NW405", "gain")
    assert d.evidence[0].startswith("gain.g (buffer, float32) holds")


class _Gaps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(2, 4, batch_first=True)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        gap = torch.diff(t, dim=1, prepend=torch.zeros_like(t[:, :1]))
        feat = torch.stack([torch.log(gap), t], -1)
        return self.rnn(feat)[0].sum()


def test_a_neginf_only_its_gradient_told_of_is_named_at_the_op_that_made_it() -> None:
    torch.manual_seed(0)
    m = _Gaps()
    t = torch.rand(2, 5).add(0.1).cumsum(1)
    t[1, 3] = t[1, 2]  # a gap of 0: log(0) = -inf
    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        m(t).backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.op == "aten.log.default", a.summary


def test_a_model_called_in_a_closure_that_returned_keeps_the_users_name() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    batch = torch.randn(5, 4)
    batch[1, 2] = float("nan")
    run = lambda: net(batch)  # noqa: E731
    with pytest.raises(nanwatch.AnomalyError) as info:
        _watched(net, run)
    d = info.value.diagnosis
    assert d is not None and d.code == "NW401"
    assert "batch = torch.nan_to_num(batch" in d.fix


def _watched(model: nn.Module, run: Any) -> None:
    with nanwatch.watch(model, postmortem=False):
        run()
