"""NW110 for log(1 - sigmoid(z)) at p = 1 when the model's output is its child's very
tensor (an alias record, not measured itself): the loss graph's 1 - p is read, and the fix is
F.logsigmoid(-logits)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests._diagnoses import code_lines
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


# ------------------------------ 1: log(1 - p) at p = 1 behind a wrapper's aliased output


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Linear(4, 3)
        nn.init.constant_(self.cls.bias, 40.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cls(x)  # the wrapper's output is the child's very tensor


def test_log_one_minus_sigmoid_behind_an_aliased_output_gets_logsigmoid_of_minus() -> None:
    torch.manual_seed(0)
    m = _Head()

    def run() -> None:
        p = torch.sigmoid(m(torch.randn(4, 4)))
        (-torch.log(1 - p)).sum().backward()

    d = _first(_raises(m, run), "NW110")
    assert "F.logsigmoid(-logits)" in d.fix
    assert "F.logsigmoid(logits)," not in d.fix and "large negative logit" not in d.explanation


# ------------------------------ 2: an all-zero denominator that is the model's collapsed output


class _Box(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)
        with torch.no_grad():
            self.fc.weight[3].zero_()
            self.fc.bias[3] = -1.0  # the height head: relu(-1) = 0 for every box

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = self.fc(x)
        return torch.cat([o[:, :2], torch.relu(o[:, 2:])], 1)


@pytest.mark.parametrize(
    "mode",
    [
        "watch",
        pytest.param(
            "forensic",
            marks=pytest.mark.accelerator_weaker(
                reason="a finite root output keeps only its min and max read late: its "
                "zeros are not counted, so the collapse evidence is missing"
            ),
        ),
    ],
)
def test_all_zero_denominator_read_from_the_prediction_is_a_collapse_not_a_buffer(
    mode: str,
) -> None:
    torch.manual_seed(0)
    m = _Box()

    def run() -> None:
        p = m(torch.randn(4, 6))
        (torch.atan(p[:, 2] / p[:, 3]) ** 2).mean().backward()

    d = _first(_raises(m, run, mode), "NW111")
    said = " ".join(d.evidence)
    assert "model's output _Box" in said and "collapsed to 0" in said
    assert "never filled (a buffer" not in d.explanation and "collapsed to 0" in d.explanation
    assert "F.softplus(raw)" in d.fix and "created with torch.zeros" not in d.fix


# ------------------------------ 3: dice of an empty class is smoothed, not clamped to 0


class _Seg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).softmax(1)


class _Dice(nn.Module):
    def forward(self, prob: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
        inter = (prob * onehot).sum((0, 2, 3))
        denom = prob.sum((0, 2, 3)) + onehot.sum((0, 2, 3))
        score = 2 * inter / denom
        return 1 - score.mean()


def _dice_loss(pred: torch.Tensor, gt: torch.Tensor) -> torch.Tensor:
    inter = (pred.flatten(1) * gt.flatten(1)).sum(1)
    dice = 2 * inter / (pred.flatten(1).sum(1) + gt.flatten(1).sum(1))
    return (1 - dice).mean()


def test_dice_of_an_empty_class_is_smoothed_on_the_users_line() -> None:
    torch.manual_seed(0)
    m, crit = _Seg(), _Dice()
    onehot = torch.zeros(1, 3, 2, 2)
    onehot[:, 0] = 1.0
    keep = torch.ones(1, 3, 1, 1)
    keep[:, 2] = 0.0  # class 2: absent from the target and masked out of the prediction

    def run() -> None:
        crit(m(torch.randn(1, 2, 2, 2)) * keep, onehot).backward()

    err = None
    try:
        with nanwatch.watch(m, crit):
            run()
    except nanwatch.AnomalyError as e:
        err = e
    assert err is not None
    d = _first(err, "NW111")
    assert "overlap score" in d.title
    assert "score = (2 * inter + 1) / (denom + 1)" in d.fix
    assert "clamp_min" not in code_lines(d.fix) and "0/eps = 0" not in d.fix


def test_dice_in_an_unwatched_loss_function_is_smoothed_from_the_graph() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(2, 1, 1), nn.Sigmoid())
    gt = torch.zeros(2, 1, 3, 3)
    gt[0, :, :2, :2] = 1.0
    crop = torch.ones(2, 1, 1, 1)
    crop[1] = 0.0  # instance 1: an empty crop and an empty target

    def run() -> None:
        _dice_loss(m(torch.randn(2, 2, 3, 3)) * crop, gt).backward()

    d = _first(_raises(m, run), "NW111")
    assert "overlap score" in d.title and "1 - a ratio of sums" in " ".join(d.evidence)
    assert "+ 1) / (" in d.fix and "d.clamp_min(eps)" not in d.fix


def test_a_cosine_of_zero_vectors_is_no_overlap_score() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    with torch.no_grad():
        m[0].bias.fill_(-100.0)  # every output 0: a zero vector

    def run() -> None:
        a = m(torch.randn(2, 3))
        b = torch.ones(2, 4)
        cos = (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))
        cos.sum().backward()

    d = _first(_raises(m, run, "forensic"), "NW111")
    assert "overlap score" not in d.title


# ------------------------------ 4: a sqrt of a ratio product at 0, its line unknown


class _Ltrb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def test_sqrt_backward_with_its_line_unknown_does_not_claim_a_squared_difference() -> None:
    torch.manual_seed(0)
    m = _Ltrb()
    with torch.no_grad():
        m.fc.bias[0] = -50.0  # l = 0 everywhere: min(l, r) / max(l, r) = 0

    def run() -> None:
        left, t, r, b = m(torch.randn(6, 3)).unbind(-1)
        lr = torch.min(left, r) / torch.max(left, r).clamp(min=1e-6)
        tb = torch.min(t, b) / torch.max(t, b).clamp(min=1e-6)
        ((torch.sqrt(lr * tb) - 0.7) ** 2).mean().backward()

    d = _first(_raises(m, run), "NW112")
    assert "squared difference" not in d.explanation
    assert "product or ratio" in d.explanation
    assert "torch.sqrt(a.clamp_min(1e-12))" in d.fix


# ------------------------------ 5: a -inf box-regression target, log(gt_w / anchor_w) at gt_w = 0


def _encode(gt: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    aw = anchors[:, 2] - anchors[:, 0]
    gw = gt[:, 2] - gt[:, 0]
    return torch.stack([(gt[:, 0] - anchors[:, 0]) / aw, torch.log(gw / aw)], 1)


def test_log_ratio_target_with_a_degenerate_box_is_dropped_not_log1p() -> None:
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    anchors = torch.tensor([[0.0, 0.0, 4.0, 4.0]]).repeat(4, 1)
    gt = torch.tensor([[1.0, 1.0, 5.0, 6.0]]).repeat(4, 1)
    gt[2] = torch.tensor([2.0, 2.0, 2.0, 5.0])  # zero width

    def run() -> None:
        targets = _encode(gt, anchors)
        F.smooth_l1_loss(m(torch.randn(4, 3)), targets).backward()

    d = _first(_raises(m, run), "NW401")
    assert "log(gw / aw)" in " ".join(d.evidence) and "degenerate" in d.explanation
    assert "valid = (gw > 0)" in d.fix and "log1p(y)" not in d.fix
