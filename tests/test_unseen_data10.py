"""NW401 names the batch as the user's line passed it: the watcher notes the line that
called the root when its input is bad (at that moment only: no frame walk on healthy
steps), and a batch a library function passed (torch's update_bn) is traced to the user's
call of that function."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch

torch.set_num_threads(1)


def test_the_fix_names_the_users_own_variable() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    calib_x = torch.randn(6, 4)
    calib_x[2, 1] = float("nan")
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(net) as nw:
        net(calib_x).sum().backward()
    d = info.value.diagnosis
    assert d is not None and d.code == "NW401"
    assert "calib_x = torch.nan_to_num(calib_x" in d.fix, d.fix
    notes = [n for t in [*nw.history, nw.trace] for n in t.notes]
    note = next(n for n in notes if n.kind == "call_site")
    assert "net(calib_x)" in str(note.data["code"])


def test_a_batch_passed_by_update_bn_names_the_users_call_of_it() -> None:
    from torch.optim.swa_utils import AveragedModel, update_bn

    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    swa = AveragedModel(net)
    batches = [torch.randn(8, 4) for _ in range(3)]
    batches[1][3, 0] = float("nan")
    with nanwatch.watch(swa, on_anomaly="record") as nw:
        update_bn(batches, swa)
        nw.step()
    found = [d for t in nw.history for d in t.diagnoses]
    assert found, [(t.step, [n.kind for n in t.notes]) for t in nw.history]
    d = next(d for d in found if d.code == "NW401")
    assert "update_bn(batches, swa)" in d.fix, d.fix
    assert "torch.optim.swa_utils.update_bn" in d.fix
