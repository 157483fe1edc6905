"""NW301 for a weight restored between steps and broken again later: the NaN gradient SGD
applied at step 0 (a hand-written norm of an all-zero embedding row) went into the momentum
buffer as well as into the weight; the user restores the weight (``w.data[bad] = 0``) but not
the buffer, and a later update writes the NaN back, with no anomaly in between (sentinel reads
no weight until a forward looks the row up). The story names the earlier NaN gradient as the
state's origin, not a checkpoint load, and the fix resets the state with the weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch import Diagnosis

torch.set_num_threads(1)

_ROW3 = torch.tensor([0, 3, 1])
_CLEAN = torch.tensor([0, 1, 2])


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        with torch.no_grad():
            self.emb.weight[3] = 0.0  # an all-zero row: its hand-written norm's gradient is NaN

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return (self.emb(idx) ** 2).sum(-1).sqrt()


def _run(mode: str, *, reset_state: bool = False, nan2num: bool = False) -> nanwatch.Watcher:
    torch.manual_seed(0)
    m = _Bag()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    batches = [_ROW3, _CLEAN, _CLEAN, _CLEAN, _ROW3]  # the last looks the broken row up
    with nanwatch.watch(m, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for i, idx in enumerate(batches):
            m(idx).sum().backward()
            opt.step()
            opt.zero_grad()
            if i == 0:  # the repair, after the first breakage
                w = m.emb.weight
                if nan2num:
                    w.data.nan_to_num_(0.0)
                else:
                    w.data[~torch.isfinite(w.data)] = 0.0
                if reset_state:  # the fix: the state too
                    opt.state[w].clear()
            nw.step()
    return nw


def _nw301(nw: nanwatch.Watcher) -> tuple[int, Diagnosis]:
    for t in nw.history:
        for d in t.diagnoses:
            if d.code == "NW301":
                return t.step, d
    raise AssertionError([d.headline for t in nw.history for d in t.diagnoses])


@pytest.mark.parametrize("nan2num", [False, True])
def test_watch_names_the_earlier_nan_gradient_as_the_states_origin(nan2num: bool) -> None:
    step, d = _nw301(_run("watch", nan2num=nan2num))
    assert step == 1 and d.title == "Non-finite optimizer state"
    said = " ".join(d.evidence)
    assert "the gradient of emb.weight applied at step 0 was NaN (see NW112 at step 0)" in said
    assert "emb.weight was finite at the end of step 0: restored after that update" in said
    assert "load_state_dict" not in d.explanation
    assert "restoring the weight" in d.explanation
    assert "s.clear()" in d.fix and "optimizer.step()" not in d.fix.split("\n")[0]


def test_sentinel_names_it_when_a_later_forward_reads_the_row() -> None:
    step, d = _nw301(_run("sentinel"))
    assert step == 4 and d.title == "Non-finite optimizer state"
    said = " ".join(d.evidence)
    # (step 0's own diagnosis: NW112, or NW302 where nothing has landed as backward begins)
    assert "applied at step 0 was NaN (see NW" in said
    # no weight was read between: which later update wrote it is not known, nor the story
    assert "the update that broke it" not in said
    assert "load_state_dict" not in d.explanation


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_resetting_the_state_with_the_weight_keeps_it_finite(mode: str) -> None:
    nw = _run(mode, reset_state=True)
    found = [(t.step, d.code) for t in nw.history for d in t.diagnoses]
    # the NaN gradient of the zero row comes back when step 4 looks it up (NW112 says
    # so); the restored weight is never written NaN by the state again
    assert [st for st, _ in found] == [0, 4] and all(c != "NW301" for _, c in found)


def test_a_state_poisoned_with_no_nan_gradient_keeps_the_checkpoint_story() -> None:
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 4)
    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        for i in range(3):
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if i == 0:  # a state loaded from a bad checkpoint
                opt.state[m.weight]["momentum_buffer"][0, 0] = float("nan")
            nw.step()
    _, d = _nw301(nw)
    assert d.title == "Non-finite optimizer state"
    assert "load_state_dict" in d.explanation


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_data_write_after_the_update_is_not_blamed_on_sgd(mode: str) -> None:
    """Restored at step 0, the zero row is normalized through .data after step 3's update
    (0/0 = NaN) and looked up at step 4: torch's SGD makes no NaN from finite numbers, so
    the write after it is named, not the update."""
    torch.manual_seed(0)
    m = _Bag()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with nanwatch.watch(m, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for i, idx in enumerate([_ROW3, _CLEAN, _CLEAN, _CLEAN, _ROW3]):
            m(idx).sum().backward()
            opt.step()
            opt.zero_grad()
            w = m.emb.weight
            if i == 0:
                w.data[~torch.isfinite(w.data)] = 0.0
            if i == 3:
                w.data /= w.data.norm(dim=1, keepdim=True)
            nw.step()
    step, d = _nw301(nw)
    assert step == (3 if mode == "watch" else 4)
    assert d.title == "Non-finite weights written outside an optimizer step"
    said = " ".join(d.evidence)
    assert "has no division and no square root" in said and "through .data" in said
    assert "the update computed 0/0" not in d.explanation
    assert "clamp_min(1e-12)" in d.fix


def test_the_next_steps_read_points_back_to_the_step_that_found_it() -> None:
    """Found NaN at step 3's end (the .data write), the weight is read again before step 4's
    forward: step 3 told why, and step 4 says it was so since, not that an update applied a
    non-finite gradient (step 3's was finite)."""
    torch.manual_seed(0)
    m = _Bag()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        for i, idx in enumerate([_CLEAN, _CLEAN, _CLEAN, _CLEAN, _ROW3]):
            m(idx).sum().backward()
            opt.step()
            opt.zero_grad()
            if i == 3:
                m.emb.weight.data /= m.emb.weight.data.norm(dim=1, keepdim=True)
            nw.step()
    d = next(d for t in nw.history if t.step == 4 for d in t.diagnoses if d.code == "NW301")
    assert d.title == "Non-finite weights since an earlier step"
    said = " ".join(d.evidence)
    assert "was already NaN at the end of step 3" in said
    assert "step 3 diagnosed: NW301 Non-finite weights written outside an optimizer step" in said
    assert "applied a non-finite gradient" not in d.explanation
