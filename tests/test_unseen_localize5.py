"""Localization where functional code between watched models made the value: a gradient born
in the code that computed a module's input from another model's output, a detached value
computed between two models, and the op chain's first birth in the one-line summary."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.localize import summarize
from nanwatch.records import Anomaly, AnomalyKind, OpEvent, Phase, Record, TensorStat


def _selector_step(mode: str) -> nanwatch.Anomaly:
    torch.manual_seed(0)
    sel, clf = nn.Linear(6, 6), nn.Linear(6, 2)
    x = torch.randn(4, 6) * 10
    with nanwatch.watch(sel, clf, mode=mode, on_anomaly="record") as nw:
        s = sel(x)
        first = F.softmax(s / 0.001, -1)  # saturates: exactly 1.0 at the top
        m = F.softmax(s + torch.log(1.0 - first), -1)  # log(0): -inf forward, NaN backward
        clf(x * m).sum().backward()
    a = nw.first_anomaly
    assert a is not None
    return a


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_a_gradient_born_in_code_between_two_models_is_not_the_consumers(mode: str) -> None:
    a = _selector_step(mode)
    assert a.kind is AnomalyKind.BACKWARD and a.origin == "between-roots"
    head = a.summary.split(" [")[0]
    assert "born in the backward of code outside the watched modules" in head
    assert "born in the backward of Linear#2" not in head  # its input gradient was finite
    assert "between the output of Linear and the input[0] of Linear#2" in head
    assert "MulBackward0" in head
    assert ("mode='forensic'" in head) is (mode != "forensic")
    if mode == "forensic":
        assert a.op is not None and a.op.phase is Phase.BACKWARD


def _tracker_step(mode: str) -> nanwatch.Anomaly:
    torch.manual_seed(0)
    pose, assoc = nn.Linear(4, 4), nn.Linear(1, 1)
    with nanwatch.watch(pose, assoc, mode=mode, on_anomaly="record") as nw:
        kp = pose(torch.randn(3, 4))
        k = kp.detach()
        k = torch.cat([k[:2], k[2:, :1].expand(1, 4)])  # a collapsed box: zero area
        area = (k[:, 1] - k[:, 0]) * (k[:, 3] - k[:, 2])
        iou = area / (area + area)  # 0 / 0 for the collapsed one
        out = assoc(iou[:, None])
        (kp.pow(2).mean() + out.mean()).backward()
    a = nw.first_anomaly
    assert a is not None
    return a


def test_a_detached_value_computed_after_a_model_ran_is_not_bad_data() -> None:
    a = _tracker_step("watch")
    assert a.kind is AnomalyKind.FORWARD and a.origin == "between-roots"
    assert "bad data" not in a.summary and "input data" not in a.summary
    assert "after Linear ran" in a.summary and "detached" in a.summary
    assert "mode='forensic'" in a.summary


def test_forensic_names_the_op_that_made_a_detached_root_input() -> None:
    a = _tracker_step("forensic")
    assert a.kind is AnomalyKind.FORWARD and a.origin == "between-roots"
    assert "not the data" in a.summary and "bad data" not in a.summary
    assert a.op is not None and a.op.op.startswith("aten.div")
    assert "[op aten.div" in a.summary and "mode='forensic'" not in a.summary


def test_nan_in_the_batch_of_the_first_model_stays_data() -> None:
    pose, assoc = nn.Linear(4, 4), nn.Linear(4, 1)
    x = torch.randn(3, 4)
    x[1, 2] = math.nan
    with nanwatch.watch(pose, assoc, on_anomaly="record") as nw:
        assoc(pose(x)).sum().backward()
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.INPUT and a.origin == "data"
    assert "bad data, not a layer" in a.summary


def test_the_summary_names_the_op_that_made_the_first_non_finite_value() -> None:
    s = TensorStat(math.inf, math.inf, 1)
    log = OpEvent(
        op="aten.log.default",
        phase=Phase.FORWARD,
        path="(loss)",
        born="-inf",
        output=TensorStat(-math.inf, -math.inf, 1),
        source="train.py:16",
    )
    neg = OpEvent(
        op="aten.neg.default",
        phase=Phase.FORWARD,
        path="(loss)",
        born="+inf",
        output=s,
        source="train.py:16",
        cause=log,
    )
    rec = Record(
        index=3,
        step=3,
        phase=Phase.FORWARD,
        path="(loss)",
        role="output",
        dtype="float32",
        device="cpu",
        shape=(),
        stat=s,
        call=1,
    )
    a = Anomaly(
        step=3,
        kind=AnomalyKind.FORWARD,
        path="(loss)",
        record=rec,
        origin="loss-code",
        op=neg,
        summary="+inf born on the way to the loss, outside every watched module's output",
    )
    text = summarize(a)
    assert "[op aten.log.default at train.py:16, which made -inf]" in text
    assert "aten.neg" not in text
    # the report's headline names the same op
    from nanwatch.report import anomaly_headline

    head = anomaly_headline(a)
    assert "by aten.log.default" in head and "aten.neg" not in head, head
