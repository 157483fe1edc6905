"""The accelerator path (driven on the CPU with ``_defer_cpu``) replays a bad module call
after it ended, when what the call had at hand is gone: the bad output it made (its NaN/inf
counts and finite max are told from the replay's copy), the autocast region it ran in (the
replay runs under it again), and the saved values of a loss module's own backward node
(its call is replayed and the node checked with them). The diagnoses are the CPU path's."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import nanwatch

torch.set_num_threads(1)


def _run(step: Any, *modules: nn.Module, deferred: bool) -> nanwatch.Watcher:
    nw = nanwatch.watch(*modules, on_anomaly="record", postmortem=False)
    nw._defer_cpu = deferred  # the accelerator path, driven on CPU
    with nw:
        step()
        nw.step()
    return nw


def _both(make: Any) -> tuple[nanwatch.Watcher, nanwatch.Watcher]:
    """The same run on the CPU path and on the accelerator path."""
    out = []
    for deferred in (False, True):
        torch.manual_seed(0)
        step, modules = make()
        out.append(_run(step, *modules, deferred=deferred))
    return out[0], out[1]


def _overflow() -> tuple[Any, tuple[nn.Module, ...]]:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).half()
    with torch.no_grad():
        model[0].weight.fill_(3e4)

    def step() -> None:
        model(torch.randn(64, 8).half()).float().mean().backward()

    return step, (model,)


def test_a_freed_overflowed_output_is_counted_from_the_replay() -> None:
    at_once, late = _both(_overflow)
    a, b = at_once.first_anomaly, late.first_anomaly
    assert a is not None and b is not None and a.path == b.path == "0"
    assert b.record.stat is not None and b.record.stat.counted  # freed before the read
    assert b.record.stat == a.record.stat
    assert late.history[0].diagnoses[0].code == at_once.history[0].diagnoses[0].code == "NW101"


def _autocast() -> tuple[Any, tuple[nn.Module, ...]]:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.rand(8, 4) * 1e6)  # past float16 when autocast casts it
        out.float().sum().backward()

    return step, (model,)


def test_a_replay_after_the_call_runs_under_the_autocast_it_ran_in() -> None:
    at_once, late = _both(_autocast)
    a, b = at_once.first_anomaly, late.first_anomaly
    assert a is not None and b is not None and a.op is not None and b.op is not None
    assert (b.path, b.op.op, b.op.dtype) == (a.path, a.op.op, a.op.dtype)
    assert late.history[0].diagnoses[0].code == at_once.history[0].diagnoses[0].code != "NW404"
    assert not torch.is_autocast_enabled("cpu")  # the replay left no autocast on


class _Subnormal(nn.Module):
    """A loss module whose log is finite in forward and whose backward 1/x overflows."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.1, 13.92]))  # exp(-0.5 * 13.92²): subnormal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -torch.log(torch.exp(-0.5 * (self.w * x) ** 2)).sum()


def _loss_module() -> tuple[Any, tuple[nn.Module, ...]]:
    m = _Subnormal()

    def step() -> None:
        m(torch.ones(2)).backward()

    return step, (m,)


def test_a_loss_modules_node_named_by_its_flag_is_checked_with_its_saved_values() -> None:
    at_once, late = _both(_loss_module)
    a, b = at_once.first_anomaly, late.first_anomaly
    assert a is not None and b is not None and a.op is not None and b.op is not None
    assert b.op.node == a.op.node == "LogBackward0"
    assert b.op.inputs and b.op.inputs[0][1] == a.op.inputs[0][1]  # what it saved in forward
    assert late.history[0].diagnoses[0].code == at_once.history[0].diagnoses[0].code
