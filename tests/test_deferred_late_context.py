"""The accelerator path (statistics read after the calls, ``_defer_cpu``) keeps what the CPU
path has at hand when it measures: a late replay runs in the autocast region the call ran
in; a guard that finds a non-finite loss input asks whether the watched modules' unread
statistics are bad before it blames a term without gradients; an anomaly raised at the
``with`` block's exit gets its post-mortem; and a watcher stopped by another's anomaly does
not claim that anomaly as its own when it reads its statistics only then; a replay runs
under the TorchFunctionModes the call ran under (the default device, a user's mode)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import nanwatch
from nanwatch._compat import as_called, autocast_state, function_modes


def _deferred(nw: nanwatch.Watcher) -> nanwatch.Watcher:
    nw._defer_cpu = True
    return nw


def test_a_late_replay_runs_in_the_autocast_region_of_the_call() -> None:
    # float16 autocast turns inputs past 65504 into inf in Conv2d's cast: a replay after
    # the call returned, outside autocast, computed in float32 and ran clean ("transient")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(64, 3))
    x = torch.rand(2, 3, 4, 4) * 1e5
    with _deferred(nanwatch.watch(model, on_anomaly="record", postmortem=False)) as nw:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), torch.tensor([0, 1]))
        loss.backward()
        nw.step()
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW101" and d.op is not None and d.op.startswith("aten._to_copy")
    assert autocast_state() == ()  # the replay left no region open


class _LogTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)

    def forward(self, items: torch.Tensor) -> torch.Tensor:
        return -torch.log(self.emb(items).relu() * 0)  # +inf made in a watched module


def test_a_guard_leaves_an_inf_of_a_watched_module_to_the_late_read() -> None:
    torch.manual_seed(0)
    model = _LogTower()
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        _deferred(nanwatch.watch(model, postmortem=False)),
    ):
        logits = model(torch.tensor([1, 2, 3, 4]))[:, :4] - torch.zeros(4)
        F.cross_entropy(logits, torch.arange(4)).backward()
    assert not isinstance(info.value, nanwatch.GuardError)


def test_an_anomaly_raised_at_the_exit_writes_its_post_mortem(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with (
        pytest.raises(nanwatch.AnomalyError),
        _deferred(nanwatch.watch(model, report_dir=str(tmp_path), guards=False)) as nw,
    ):
        model(torch.randn(5, 4)).sum().backward()
        nw.step()
        model(torch.full((5, 4), float("nan")))  # read only at the exit
    (path,) = sorted(tmp_path.glob("*.json"))
    report = nanwatch.Report.load(path)
    assert report.error is not None and report.error["class"] == "anomaly"


def test_a_watcher_stopped_by_another_does_not_claim_its_anomaly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    gen, disc = nn.Linear(2, 2), nn.Linear(2, 1)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
    with (
        pytest.raises(nanwatch.AnomalyError),
        _deferred(nanwatch.watch(gen, report_dir=str(tmp_path))) as nw_g,
        _deferred(nanwatch.watch(disc, report_dir=str(tmp_path))) as nw_d,
    ):
        fake = gen(torch.randn(3, 2))
        # sqrt(0): an inf gradient into fake, which disc's input gradient sums too
        (disc(fake).mean() + ((fake * 0.0) ** 2).sum().sqrt()).backward()
        opt_g.step()
    assert nw_g.first_anomaly is not None and nw_d.first_anomaly is None
    assert nw_d.first_bad_step is None
    assert len(list(tmp_path.glob("*.json"))) == 1


class _LogShifted(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return (z - 100).log()  # NaN made in the discriminator's forward


def test_the_watcher_whose_bad_value_came_first_claims_it_when_both_read_late(
    tmp_path: Path,
) -> None:
    # the discriminator's forward makes a NaN, which backward takes into the generator:
    # the generator's watcher reads it at its optimizer step, before the discriminator's
    # watcher reads its own forward; on the CPU that forward's hook raised first
    torch.manual_seed(0)
    gen, disc = nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 1), _LogShifted())
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        _deferred(nanwatch.watch(gen, report_dir=str(tmp_path))) as nw_g,
        _deferred(nanwatch.watch(disc, report_dir=str(tmp_path))) as nw_d,
    ):
        disc(gen(torch.randn(3, 2))).mean().backward()
        opt_g.step()
    assert nw_g.first_anomaly is None and nw_g.first_bad_step is None
    a = nw_d.first_anomaly
    assert a is not None and a.path == "1" and info.value.anomaly is a
    assert len(list(tmp_path.glob("*.json"))) == 1


class _Float16Linear(TorchFunctionMode):
    """A user's precision-emulation mode: every ``F.linear`` rounds its result to float16."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        return out.half().float() if func is F.linear else out


@pytest.mark.parametrize("deferred", [False, True], ids=["cpu", "accelerator"])
def test_a_replay_runs_under_the_users_torch_function_mode(deferred: bool) -> None:
    # nanwatch's hooks turn torch-function handling off for their own work, and a mode is
    # out of force while its own handler runs loss.backward(): a replay outside the mode
    # computed in float32, ran clean and said "transient" (NW404)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    nw = nanwatch.watch(model, on_anomaly="record", postmortem=False)
    nw._defer_cpu = deferred
    with nw, _Float16Linear():
        loss = F.cross_entropy(model(torch.rand(3, 4) * 1e6), torch.tensor([0, 1, 0]))
        loss.backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.path == "0"
    assert a.op is not None and a.op.op.startswith("aten._to_copy")  # the float16 cast
    assert nw.history[0].diagnoses[0].code == "NW101"
    assert function_modes() == ()  # the replay left no mode on the stack


def test_function_modes_and_as_called_put_the_default_device_back() -> None:
    assert function_modes() == ()
    torch.set_default_device("meta")
    try:
        modes = function_modes()
        assert [type(m).__name__ for m in modes] == ["DeviceContext"]
        with torch._C.DisableTorchFunction():  # as in nanwatch's hooks
            assert torch.arange(2).device.type == "cpu"
            with as_called():
                assert torch.arange(2).device.type == "meta"
    finally:
        torch.set_default_device(None)
    # a call's mode entered again after its block ended, and left as it was after
    with as_called(modes):
        assert torch.arange(2).device.type == "meta"
    assert torch.arange(2).device.type == "cpu" and function_modes() == ()
