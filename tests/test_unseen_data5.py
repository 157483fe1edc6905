"""Unseen data, round 5: a float16 exp overflow in the user's own soft-target code is the
op's overflow, not bad data (NW401), in watch and forensic modes; a constant operand's
summary names no domain-specific loss weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests._diagnoses import first_bad, text, top

torch.set_num_threads(1)


def _distill(mode: str, weight: float) -> nanwatch.Watcher:
    torch.manual_seed(0)
    teacher = nn.Linear(4, 3).half().eval()
    student = nn.Linear(4, 3)
    with torch.no_grad():
        teacher.weight.fill_(weight)
        teacher.bias.zero_()
    with nanwatch.watch(student, teacher, mode=mode, on_anomaly="record", postmortem=False) as nw:
        x = torch.ones(2, 4)
        with torch.no_grad():
            t = teacher(x.half()) / 2.0  # 20 in float16 at weight 10
            p = torch.exp(t)  # exp(20) > 65504: +inf
            p = (p / p.sum(-1, keepdim=True)).float()  # inf / inf = NaN
        loss = F.kl_div(F.log_softmax(student(x), -1), p, reduction="batchmean")
        loss.backward()
        nw.step()
    return nw


def test_forensic_fp16_exp_overflow_in_soft_targets_is_the_exp_not_bad_data() -> None:
    nw = _distill("forensic", 10.0)
    a = first_bad(nw).anomaly
    assert a is not None and a.op is not None and a.op.op.startswith("aten.exp"), a
    d = top(nw)
    assert d.code == "NW101", text(d)
    assert d.code != "NW401" and "loss targets" not in d.title
    assert "torch.exp(t" in d.fix and "y.std()" not in d.fix, d.fix


def test_watch_fp16_exp_overflow_in_soft_targets_is_not_called_bad_data() -> None:
    nw = _distill("watch", 10.0)
    a = first_bad(nw).anomaly
    assert a is not None and a.op is not None
    assert "(p)" in a.summary and "computed without gradients" in a.summary, a.summary
    # no domain-specific examples in a general message
    assert "snr" not in a.summary and "sigma" not in a.summary, a.summary
    d = top(nw)
    assert d.code != "NW401", text(d)
    assert "isfinite(p)" in d.fix and "y.std()" not in d.fix, d.fix


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_finite_soft_targets_stay_silent(mode: str) -> None:
    nw = _distill(mode, 1.0)
    assert all(t.anomaly is None for t in nw.history)
    assert not [d for t in nw.history for d in t.diagnoses if d.severity == "error"]


def test_a_nan_target_from_the_batch_is_still_bad_data() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        x, y = torch.randn(8, 3), torch.randn(8, 1)
        y[2] = float("nan")
        F.mse_loss(model(x), y).backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW401" and d.title == "NaN or inf in the loss targets", text(d)
