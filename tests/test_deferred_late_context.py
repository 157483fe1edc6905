"""The accelerator path (statistics read after the calls, ``_defer_cpu``) keeps what the CPU
path has at hand when it measures: a late replay runs in the autocast region the call ran
in; a guard that finds a non-finite loss input asks whether the watched modules' unread
statistics are bad before it blames a term without gradients; an anomaly raised at the
``with`` block's exit gets its post-mortem; and a watcher stopped by another's anomaly does
not claim that anomaly as its own when it reads its statistics only then."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch._compat import autocast_state


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
