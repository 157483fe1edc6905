"""Data blame, found by user testing: a NaN target a hand-written loss reads is named as
data in forensic mode (the op and argument that read it), a target a float16 teacher
computed is not called bad data, and ``torch.export`` inside a forensic block runs."""

from __future__ import annotations

import ast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests._diagnoses import code_lines, text

torch.set_num_threads(1)


def _diagnoses(err: nanwatch.AnomalyError) -> list[str]:
    return [d.code for d in err.diagnoses]


# ------------------------------ 1: a NaN target read by a hand-written loss (forensic)


def _regression(mode: str, *, bad: bool = True) -> nanwatch.AnomalyError | None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    xs, ys = torch.randn(2, 16, 4), torch.randn(2, 16, 1)
    if bad:
        ys[1, 5, 0] = float("nan")  # a missing label in the csv
    try:
        with nanwatch.watch(model, mode=mode) as nw:  # type: ignore[arg-type]
            for i in range(2):
                pred = model(xs[i])
                loss = ((pred - ys[i]) ** 2).mean()
                loss.backward()
                nw.step()
    except nanwatch.AnomalyError as e:
        return e
    return None


def test_a_nan_target_a_hand_written_loss_reads_is_named_as_data_in_forensic_mode() -> None:
    err = _regression("forensic")
    assert err is not None
    d = err.diagnoses[0]
    assert d.code == "NW401", _diagnoses(err)
    t = text(d)
    assert "entered the step in data your loss code read" in d.title
    assert "`other` of aten.sub at " in t and "holds 1 NaN" in t
    assert "loss = ((pred - ys[i]) ** 2).mean()" in t
    assert "nan_to_num" not in d.fix
    ast.parse(d.fix)
    assert "torch.isfinite(ys[i])" in d.fix
    # the mask the fix computes leaves the bad sample out, and the loss on the rest is finite
    torch.manual_seed(0)
    ys = torch.randn(2, 16, 1)
    ys[1, 5, 0] = float("nan")
    i = 1
    keep_line = next(ln for ln in code_lines(d.fix).splitlines() if ln.startswith("keep ="))
    scope = {"torch": torch, "ys": ys, "i": i}
    exec(keep_line, scope)
    keep = scope["keep"]
    assert not bool(keep[5]) and int(keep.sum()) == 15
    assert torch.isfinite(((torch.zeros(16, 1)[keep] - ys[i][keep]) ** 2).mean())


def test_an_op_that_makes_the_nan_in_the_loss_code_is_not_blamed_on_data() -> None:
    model = nn.Linear(4, 1)

    def run() -> None:
        pred = model(torch.randn(8, 4))
        y = torch.zeros(8, 1)
        (torch.log(y - 1.0) * pred).mean().backward()  # log of a negative: the op's NaN

    with pytest.raises(nanwatch.AnomalyError) as err, nanwatch.watch(model, mode="forensic"):
        run()
    assert "NW401" not in _diagnoses(err.value)


# ------------------------------ 2: a float16 teacher's overflow is not the data's NaN


def test_a_target_a_float16_teacher_computed_is_not_called_bad_data() -> None:
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
    teacher.append(nn.Linear(64, 10))
    with torch.no_grad():
        for layer in teacher:
            if isinstance(layer, nn.Linear):
                layer.weight.mul_(60)
    teacher.eval().half()
    student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
    kd = nn.KLDivLoss(reduction="batchmean")
    x = torch.randn(32, 16) * 3
    with torch.no_grad():
        assert not torch.isfinite(teacher(x.half())).all()  # the setup overflows
    try:
        with nanwatch.watch(student, kd):
            with torch.no_grad():
                t_logits = teacher(x.half()).float()
            kd(F.log_softmax(student(x) / 4.0, 1), F.softmax(t_logits / 4.0, 1)).backward()
    except nanwatch.AnomalyError as e:
        d = e.diagnoses[0]
    else:
        raise AssertionError("no anomaly")
    assert d.code == "NW401"
    assert "your code computed (a teacher or target network)" in d.title
    t = text(d)
    assert "every value of each bad sample is NaN" in t
    assert "model's input this step (input[0] of Sequential) was finite" in t
    assert "nan_to_num" not in d.fix and "Dataset" not in d.fix
    assert "nanwatch.watch(model, criterion, teacher)" in d.fix
    ast.parse(d.fix)
    # what the fix says: the teacher in float32 gives finite targets
    with torch.no_grad():
        assert torch.isfinite(F.softmax(teacher.float()(x) / 4.0, 1)).all()


def test_a_soft_target_with_one_missing_value_is_still_bad_data() -> None:
    student = nn.Linear(4, 3)
    kd = nn.KLDivLoss(reduction="batchmean")
    y = torch.full((8, 3), 1 / 3)
    y[2, 1] = float("nan")  # one value of a loaded soft label
    try:
        with nanwatch.watch(student, kd):
            kd(F.log_softmax(student(torch.randn(8, 4)), 1), y).backward()
    except nanwatch.AnomalyError as e:
        d = e.diagnoses[0]
    else:
        raise AssertionError("no anomaly")
    assert d.code == "NW401"
    assert "teacher" not in d.title and d.title == "NaN or inf in the loss targets"


# ------------------------------ 5: torch.export inside a forensic block


def test_torch_export_inside_a_forensic_block_runs_and_matches() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 4)
    with nanwatch.watch(m, mode="forensic") as nw:
        F.cross_entropy(m(x), torch.tensor([0, 1, 0, 1])).backward()
        nw.step()
        m.eval()
        ep = torch.export.export(m, (x[:2],))
        assert torch.equal(ep.module()(x[:2]), m(x[:2]))
    assert not nw.anomalies
