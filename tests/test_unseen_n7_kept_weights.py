"""A weight an update made NaN stays NaN: at the steps where its optimizer does not step (a
GAN's generator stepped every ``n_critic`` critic steps, a head trained every k steps), no
code wrote it, so NW301 says it has been non-finite since the step that made it, not that
code outside an optimizer step wrote it (an EMA, a load, a .data write); and in a run
longer than the ring, that wrong finding no longer leads the report ahead of the cause."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import nanwatch

torch.set_num_threads(1)

ELSEWHERE = "Non-finite weights written outside an optimizer step"


def _train(mode: str, steps: int, ring_size: int = 32) -> nanwatch.Watcher:
    torch.manual_seed(0)
    head, enc = nn.Linear(8, 1), nn.Linear(4, 8)
    opt_enc = torch.optim.SGD(enc.parameters(), lr=0.1)
    opt_head = torch.optim.SGD(head.parameters(), lr=0.1)
    with nanwatch.watch(
        head, enc, mode=mode, on_anomaly="record", postmortem=False, ring_size=ring_size
    ) as nw:
        for i in range(steps):
            x, y = torch.randn(16, 4), torch.randn(16, 1)
            if i == 1:
                y[0] = float("nan")  # a NaN target: both updates of this step apply NaN
            ((head(enc(x)) - y) ** 2).mean().backward()
            opt_enc.step()
            opt_enc.zero_grad()
            if i % 3 == 1:  # the head's optimizer steps every 3 steps
                opt_head.step()
                opt_head.zero_grad()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_weight_its_optimizer_did_not_step_is_bad_since_the_update_that_made_it(
    mode: str,
) -> None:
    nw = _train(mode, steps=6)
    later = [d for t in nw.history if t.step in (3, 4) for d in t.diagnoses]
    assert [d.code for d in later] == ["NW301", "NW301"]
    for d in later:
        assert d.title == "Non-finite weights since an earlier step", d.title
        said = " ".join(d.evidence)
        # read after step 1's update (watch) or before step 2's forward (sentinel)
        assert re.search(r"weight was already NaN at the (end of step 1|start of step 2)", said)
        assert "step 1 diagnosed: NW100" in said, said
        assert "no optimizer stepped it since" in d.explanation
        assert "resume from a checkpoint saved before step 1" in d.fix


def test_past_the_ring_the_cause_still_leads_the_report() -> None:
    nw = _train("watch", steps=9, ring_size=3)
    found = nw.report.diagnoses
    assert found[0].code == "NW100" and found[0].step == 1, [(d.code, d.step) for d in found]
    assert all(d.title != ELSEWHERE for d in found), [d.title for d in found]
