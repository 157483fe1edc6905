"""The accelerator path (statistics left on the device, read once a step) driven on the CPU:
a bad value is read before the optimizer applies the step's gradients, so it is localized,
its op pinpointed and ``on_anomaly`` acted on while the weights are still the ones it was
computed with -- the diagnoses are those of the CPU path, where each value is read at once."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch import scenarios
from nanwatch.errors import AnomalyError
from nanwatch.watcher import Watcher


def _found(outcome: scenarios.Outcome) -> tuple[Any, ...]:
    a = outcome.anomaly
    top = outcome.top
    where = None
    if a is not None:
        dtype = a.op.dtype if a.op is not None and a.op.dtype else a.record.dtype
        where = (a.kind, a.path, a.record.phase, a.op.op if a.op else None, dtype)
    return where, top.code if top is not None else None, type(outcome.error)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["watch", "sentinel"])
@pytest.mark.parametrize("name", scenarios.names())
def test_the_gallery_is_diagnosed_alike_on_the_accelerator_path(
    name: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    scenario = scenarios.get(name)
    torch.manual_seed(0)
    at_once = _found(scenarios.run(scenario, mode=mode))
    attach = Watcher.attach

    def on_device(self: Watcher) -> Watcher:
        self._defer_cpu = True
        return attach(self)

    monkeypatch.setattr(Watcher, "attach", on_device)
    torch.manual_seed(0)
    late = _found(scenarios.run(scenario, mode=mode))
    assert late == at_once


def _div_model() -> nn.Module:
    class Norm(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x / x.sum(dim=1, keepdim=True)

    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), Norm(), nn.Linear(4, 1))


def _train(nw: nanwatch.Watcher, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(8, 4)
    x[3] = 0.0  # with no bias: a row of zeros, normalized by its sum of 0
    model(x).pow(2).mean().backward()
    opt.step()
    nw.step()


def test_raise_stops_the_update_on_the_accelerator_path(deferred: None) -> None:
    torch.manual_seed(0)
    model = _div_model()
    with torch.no_grad():
        model[0].bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(AnomalyError) as info, nanwatch.watch(model, postmortem=False) as nw:
        _train(nw, model, opt)
    a = info.value.anomaly
    assert a is not None and a.path == "2" and a.op is not None
    assert a.op.op.startswith("aten.div")
    # raised in optimizer.step(), before the update: the weights are as they were
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)
        assert math.isfinite(float(p.detach().abs().max()))


@pytest.mark.landed_only(
    reason="asserts the gradients' copy has landed by the update; GPU-bound it is read at the "
    "step end"
)
def test_the_update_waits_for_the_forward_alone_on_the_accelerator_path(
    deferred: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A healthy step: the statistics leave for the host when backward begins (the forward's)
    and when it has been enqueued (the gradients'), and are read before the update with no
    stream-wide read (read_scalars): on the CPU both have landed by then."""
    from nanwatch import watcher as w

    reads: list[int] = []
    real = w.read_scalars

    def counting(values: Any) -> list[float]:
        reads.append(len(values))
        return real(values)

    monkeypatch.setattr(w, "read_scalars", counting)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, nn.MSELoss(), mode="sentinel", postmortem=False) as nw:
        for _ in range(3):
            x, y = torch.randn(8, 4), torch.randn(8, 1)
            nn.functional.mse_loss(model(x), y).backward()
            assert nw._prefetched and not nw._pending  # on their way, not read
            reads.clear()
            opt.step()
            assert reads == [] and not nw._prefetched  # read, without a stream-wide wait
            opt.zero_grad()
            nw.step()
            assert reads == []  # sentinel: the step end had nothing left to read
    assert nw.first_anomaly is None


def _siamese_step(
    nw: nanwatch.Watcher, model: nn.Module, x1: torch.Tensor, x2: torch.Tensor
) -> None:
    d = torch.sqrt(((model(x1) - model(x2)) ** 2).sum(-1))  # a distance, written by hand
    (d - 1.0).pow(2).mean().backward()
    nw.step()


def test_a_loss_codes_nan_gradient_is_named_by_its_node_on_the_accelerator_path(
    deferred: None,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x1 = torch.randn(6, 4)
    x2 = x1.clone()
    x2[:3] += torch.randn(3, 4)  # rows 3..5: the same sample twice, a distance of 0
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        _siamese_step(nw, model, x1, x2)
    a = nw.first_anomaly
    assert a is not None and a.path == "(loss)" and a.record.phase.value == "backward"
    assert a.op is not None and a.op.op == "aten.sqrt" and a.op.node == "SqrtBackward0"
    codes = [d.code for d in nw.history[0].diagnoses]
    assert codes[0] == "NW112"
    # what the node saved, kept from its hook until the flag was read: read as on the CPU
    assert "3 exact zeros" in " ".join(nw.history[0].diagnoses[0].evidence)


def test_healthy_loss_code_leaves_no_flag_on_the_accelerator_path(deferred: None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            _siamese_step(nw, model, torch.randn(6, 4), torch.randn(6, 4))
            assert nw._pending_nodes == []  # read with the step's statistics
    assert nw.first_anomaly is None
    assert not [d for t in nw.history for d in t.diagnoses if d.severity == "error"]


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_backward_not_landed_before_the_update_is_read_at_the_step_end(
    mode: str, deferred: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU far behind: what backward made has not reached the host when the optimizer
    steps, so it is read at the step end, after the update. The NaN gradient is still the
    step's anomaly where backward made it, not the weights the update then broke."""
    from nanwatch.stats import HostRead

    monkeypatch.setattr(HostRead, "ready", lambda self: False)
    torch.manual_seed(0)
    outcome = scenarios.run(scenarios.get("sqrt-backward"), mode=mode)
    a = outcome.anomaly
    assert a is not None and a.kind.value in ("backward", "gradient")
    assert outcome.top is not None and outcome.top.code != "NW301"
