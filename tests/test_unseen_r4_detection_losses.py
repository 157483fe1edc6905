"""Unseen models, detection losses: ``cls_loss = focal.sum() / num_pos`` and ``box_loss =
l1.sum() / num_pos`` with no positive anchors (num_pos == 0). The first non-finite value
is cls_loss's +inf (x/0), not box_loss's NaN (0/0); watch and sentinel read the loss graph
at backward(), where the numerators were not saved: the quotient is read from the local
that holds it, and the fix floors the count under its own name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch


class Det(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.cls_head = nn.Linear(32, 4)
        self.box_head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.backbone(x)
        return self.cls_head(f), self.box_head(f)


def _focal(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    p = torch.sigmoid(logits)
    ce = F.binary_cross_entropy_with_logits(logits, t, reduction="none")
    p_t = p * t + (1 - p) * (1 - t)
    return 0.25 * ce * (1 - p_t) ** 2


def _train(mode: str, *, fixed: bool, positives: bool = False) -> nanwatch.Watcher:
    torch.manual_seed(0)
    model = Det()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    nw = nanwatch.watch(model, mode=mode, postmortem=False)
    with nw:
        for _ in range(2):
            x = torch.randn(64, 16)
            labels = torch.zeros(64, 4)
            if positives:
                labels[::5, 1] = 1.0
            box_t = torch.randn(64, 4)
            pos = labels.sum(1) > 0
            num_pos = pos.sum().float()
            if fixed:
                num_pos = num_pos.clamp_min(1)
            cls_logits, box = model(x)
            cls_loss = _focal(cls_logits, labels).sum() / num_pos
            box_loss = F.l1_loss(box[pos], box_t[pos], reduction="sum") / num_pos
            loss = cls_loss + box_loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step(loss)
    return nw


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_first_division_named_with_its_count(mode: str) -> None:
    with pytest.raises(nanwatch.AnomalyError) as info:
        _train(mode, fixed=False)
    msg = str(info.value)
    head = msg.splitlines()[0]
    # the first non-finite value: cls_loss's +inf (x/0), then box_loss's NaN
    assert "+inf born" in head and "(then NaN)" in head, head
    assert "NW111" in msg
    assert "num_pos = num_pos.clamp_min(1)" in msg, msg
    assert "cls_loss = ... / num_pos" in msg, msg
    assert "0/0 = NaN" not in msg


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_fixed_count_trains_clean(mode: str) -> None:
    nw = _train(mode, fixed=True)
    assert not nw.report.anomalies
    nw = _train(mode, fixed=False, positives=True)
    assert not nw.report.anomalies


def test_zero_std_is_not_called_a_count() -> None:
    """A local denominator that is 0 but not made as a count (a std of constant targets):
    no clamp_min(1) under its name; a float denominator keeps the eps fix."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    nw = nanwatch.watch(model, postmortem=False)
    with pytest.raises(nanwatch.AnomalyError) as info, nw:
        x = torch.randn(8, 4)
        target = torch.full((8, 1), 3.0)
        scale = target.std()
        err = (model(x) - target) ** 2
        loss = err.sum() / scale
        loss.backward()
        nw.step(loss)
    msg = str(info.value)
    assert "NW111" in msg
    assert "scale = scale.clamp_min(1)" not in msg
    assert "a count made from the data" not in msg


# ------------------------------------------- CenterNet's heatmap focal loss, log(1 - p)
class Heat(nn.Module):
    def __init__(self, bias: float, logits: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 3, 3, padding=1)
        self.logits = logits
        with torch.no_grad():
            self.conv.bias.fill_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.conv(x)
        return z if self.logits else torch.sigmoid(z)


def _heatmap_focal(pred: torch.Tensor, gt: torch.Tensor) -> torch.Tensor:
    pos = gt.eq(1).float()
    neg = 1 - pos
    pos_loss = torch.log(pred) * (1 - pred) ** 2 * pos
    neg_loss = torch.log(1 - pred) * pred**2 * (1 - gt) ** 4 * neg
    return -(pos_loss.sum() + neg_loss.sum()) / pos.sum().clamp_min(1)


def _heatmap_focal_logits(z: torch.Tensor, gt: torch.Tensor) -> torch.Tensor:
    pred = torch.sigmoid(z)
    pos = gt.eq(1).float()
    neg = 1 - pos
    pos_loss = F.logsigmoid(z) * (1 - pred) ** 2 * pos
    neg_loss = F.logsigmoid(-z) * pred**2 * (1 - gt) ** 4 * neg
    return -(pos_loss.sum() + neg_loss.sum()) / pos.sum().clamp_min(1)


def _heat_train(mode: str, *, bias: float, logits: bool = False) -> nanwatch.Watcher:
    torch.manual_seed(0)
    model = Heat(bias, logits)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    nw = nanwatch.watch(model, mode=mode, postmortem=False)
    with nw:
        for _ in range(2):
            x = torch.randn(2, 8, 16, 16)
            gt = torch.rand(2, 3, 16, 16) * 0.9
            gt[:, :, 4, 4] = 1.0
            out = model(x)
            loss = _heatmap_focal_logits(out, gt) if logits else _heatmap_focal(out, gt)
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step(loss)
    return nw


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_focal_log_fix_is_logsigmoid_not_bce(mode: str) -> None:
    with pytest.raises(nanwatch.AnomalyError) as info:
        _heat_train(mode, bias=20.0)
    msg = str(info.value)
    assert "NW110" in msg
    assert "focal loss" in msg
    fix = msg.split("fix: ", 1)[1]
    assert fix.startswith("log_1mp = F.logsigmoid(-logits)"), fix
    assert "binary_cross_entropy_with_logits(logits, y)" not in msg
    full = [d for d in nw_diagnoses(info.value) if d.code == "NW110"]
    assert full and "Heat's forward returns a sigmoid's output" in full[0].fix, full


def nw_diagnoses(err: BaseException) -> list:
    return list(getattr(err, "diagnoses", []) or [])


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_focal_healthy_controls(mode: str) -> None:
    assert not _heat_train(mode, bias=0.0).report.anomalies
    assert not _heat_train(mode, bias=20.0, logits=True).report.anomalies
