"""Detection and segmentation losses (stop 40, q5).

1. A box-regression target whose log of a ratio is -inf for a degenerate box is told in
   forensic mode as in watch mode (NW401: the target, the entries to drop), not as a log of
   a probability (NW110 with a floor that makes the target log(tiny) = -87).
2. A GIoU whose enclosing area ``(cx2 - cx1) * (cy2 - cy1)`` is 0 (boxes of zero width): a
   product with a factor 0 everywhere, read from the autograd graph, not "a tensor never
   filled"; the floor goes where the product is made.
3. A soft dice on an output upsampled to 32x32 against a 30x30 mask: the post-mortem names
   the two tensors of the line, their shapes, and the resize.
4. The loss line's own ``torch.log(gt_wh / anchors_wh)``: the degenerate entry is dropped
   with a mask, not floored at 1e-5 as a spectrogram's silence would be."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.report import Report

torch.set_num_threads(1)

MODES = ["forensic", "watch", "sentinel"]


def _first(nw: nanwatch.Watcher) -> nanwatch.Diagnosis:
    return next(d for h in nw.history for d in h.diagnoses)


# --------------------------------------------- a box encoding's log(gw / aw) at a zero width


def encode(gt: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Faster R-CNN's box regression targets, (x1, y1, x2, y2) against anchors."""
    aw, ah = anchors[:, 2] - anchors[:, 0], anchors[:, 3] - anchors[:, 1]
    gw, gh = gt[:, 2] - gt[:, 0], gt[:, 3] - gt[:, 1]
    dx, dy = (gt[:, 0] - anchors[:, 0]) / aw, (gt[:, 1] - anchors[:, 1]) / ah
    return torch.stack([dx, dy, torch.log(gw / aw), torch.log(gh / ah)], 1)


class BoxHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.reg = nn.Linear(32, 4)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return self.reg(self.body(f))


def _boxes(step: int, degenerate: bool) -> torch.Tensor:
    gt = torch.rand(6, 4) * 5
    gt[:, 2:] = gt[:, :2] + 1 + torch.rand(6, 2) * 5
    if degenerate and step == 1:
        gt[3, 2] = gt[3, 0]  # an annotation of zero width
    return gt


def _box_run(mode: str, *, functional: bool, degenerate: bool = True) -> nanwatch.Watcher:
    torch.manual_seed(0)
    net, crit = BoxHead(), nn.SmoothL1Loss()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    anchors = torch.tensor([[0.0, 0.0, 10.0, 10.0]]).repeat(6, 1)
    with nanwatch.watch(net, crit, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for step in range(2):
            gt = _boxes(step, degenerate)
            if functional:
                targets = encode(gt, anchors)
                loss = F.smooth_l1_loss(net(torch.randn(6, 16)), targets)
            else:
                loss = crit(net(torch.randn(6, 16)), encode(gt, anchors))
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    return nw


@pytest.mark.parametrize("functional", [False, True], ids=["module", "functional"])
@pytest.mark.parametrize("mode", MODES)
def test_a_box_target_made_minus_inf_by_a_log_is_the_target_in_every_mode(
    mode: str, functional: bool
) -> None:
    nw = _box_run(mode, functional=functional)
    a = nw.first_anomaly
    assert a is not None and a.step == 1
    d = _first(nw)
    loss = "F.smooth_l1_loss" if functional else "SmoothL1Loss"
    assert (d.code, d.title, d.path) == ("NW401", "NaN or inf in the loss targets", loss)
    text = "\n".join(d.evidence)
    assert "its input (the prediction) was finite" in text
    assert "log(gw / aw), log(gh / ah): a log of a ratio" in text, text
    assert "a box of zero width or height" in d.explanation
    assert d.fix.splitlines()[1].startswith("valid = (gw > 0) & (gh > 0)"), d.fix
    assert "tiny" not in d.fix and "log1p(" not in d.fix.splitlines()[1]
    if mode == "forensic":  # the op that made the -inf, and its line, are known
        assert "aten.log made the -inf from a 0, at " in text, text
        assert "torch.log(gw / aw)" in text
    codes = [x.code for x in nw.history[1].diagnoses]
    assert "NW110" not in codes, codes  # not a log of a probability or of silence


@pytest.mark.parametrize("functional", [False, True], ids=["module", "functional"])
def test_box_targets_of_boxes_with_area_stay_quiet_in_forensic(functional: bool) -> None:
    nw = _box_run("forensic", functional=functional, degenerate=False)
    assert nw.first_anomaly is None
    assert not any(h.diagnoses for h in nw.history)


# ------------------------------------------- a GIoU whose enclosing box has zero width


class FCOSBoxes(nn.Module):
    """Predicts distances (l, t, r, b) from a location through a ReLU; the bias was driven
    below 0, so every predicted box has collapsed to the location itself."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = F.relu(self.fc(x))
        cx, cy = x[:, 0], x[:, 1]
        return torch.stack([cx - d[:, 0], cy - d[:, 1], cx + d[:, 2], cy + d[:, 3]], 1)


def _iou_and_corners(p: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    ix1, iy1 = torch.max(p[:, 0], t[:, 0]), torch.max(p[:, 1], t[:, 1])
    ix2, iy2 = torch.min(p[:, 2], t[:, 2]), torch.min(p[:, 3], t[:, 3])
    inter = (ix2 - ix1).clamp(min=0) * (iy2 - iy1).clamp(min=0)
    area_p = (p[:, 2] - p[:, 0]) * (p[:, 3] - p[:, 1])
    area_t = (t[:, 2] - t[:, 0]) * (t[:, 3] - t[:, 1])
    union = area_p + area_t - inter + 1e-7  # the union floored, the enclosing area not
    cx1, cy1 = torch.min(p[:, 0], t[:, 0]), torch.min(p[:, 1], t[:, 1])
    cx2, cy2 = torch.max(p[:, 2], t[:, 2]), torch.max(p[:, 3], t[:, 3])
    return inter / union, union, cx1, cy1, cx2, cy2


def giou_loss(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    iou, union, cx1, cy1, cx2, cy2 = _iou_and_corners(p, t)
    enclose = (cx2 - cx1) * (cy2 - cy1)
    giou = iou - (enclose - union) / enclose
    return (1 - giou).mean()


def giou_loss_fixed(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    iou, union, cx1, cy1, cx2, cy2 = _iou_and_corners(p, t)
    enclose = ((cx2 - cx1) * (cy2 - cy1)).clamp_min(torch.finfo(cx2.dtype).eps)  # the advice
    giou = iou - (enclose - union) / enclose
    return (1 - giou).mean()


def _giou_run(mode: str, *, dead: bool, line_boxes: bool, floor: bool = False) -> nanwatch.Watcher:
    torch.manual_seed(0)
    net = FCOSBoxes()
    if dead:
        with torch.no_grad():
            net.fc.bias.fill_(-20.0)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with nanwatch.watch(net, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            x = torch.randn(6, 8)
            w = 0.0 if line_boxes else 1.5  # annotations of zero width: vertical lines
            t = torch.stack([x[:, 0], x[:, 1], x[:, 0] + w, x[:, 1] + 2.0], 1)
            loss = (giou_loss_fixed if floor else giou_loss)(net(x), t)
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", MODES)
def test_a_giou_enclosing_area_of_zero_width_is_a_factor_not_a_buffer_never_filled(
    mode: str,
) -> None:
    nw = _giou_run(mode, dead=True, line_boxes=True)
    a = nw.first_anomaly
    assert a is not None and a.step == 0 and a.op is not None, a
    d = _first(nw)
    assert d.code == "NW111" and d.op is not None and d.op.startswith("aten.div"), d.headline
    assert d.title == "Division by zero: a factor of a product is 0", d.title
    text = "\n".join(d.evidence)
    assert "is a product (autograd node MulBackward0)" in text, text
    assert "is 0 in all of its values, made by sub <- " in text, text
    assert "a difference of two equal values" in text
    told = d.explanation + d.fix
    assert "created with torch.zeros" not in told and "constant everywhere" not in told, told
    assert "box enclosing two boxes, of zero width or height" in d.fix, d.fix
    if mode == "forensic":
        assert "made as (cx2 - cx1) * (cy2 - cy1), and cx2 - cx1 is 0" in text, text
        assert d.fix.startswith(
            "enclose = ((cx2 - cx1) * (cy2 - cy1)).clamp_min(torch.finfo(cx2.dtype).eps)"
            "   # was enclose = (cx2 - cx1) * (cy2 - cy1)"
        ), d.fix
    else:
        assert 'mode="forensic" names your line' in d.fix, d.fix


@pytest.mark.parametrize("mode", MODES)
def test_the_floored_enclosing_area_trains_clean(mode: str) -> None:
    nw = _giou_run(mode, dead=True, line_boxes=True, floor=True)
    assert nw.first_anomaly is None
    assert not any(h.diagnoses for h in nw.history)


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_giou_of_boxes_with_area_stays_quiet(mode: str) -> None:
    nw = _giou_run(mode, dead=False, line_boxes=False)
    assert nw.first_anomaly is None
    assert not any(h.diagnoses for h in nw.history)


# ------------------------- a soft dice on an upsampled output one stride off the mask's size


class TinySeg(nn.Module):
    """Two stride-2 convolutions, then a fixed x4 upsampling: a 30x30 image comes back 32x32."""

    def __init__(self, fit: bool = False) -> None:
        super().__init__()
        self.enc = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        self.head = nn.Conv2d(8, 4, 1)
        self.fit = fit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.head(self.enc(x))
        if self.fit:
            return F.interpolate(z, size=x.shape[-2:], mode="bilinear", align_corners=False)
        return F.interpolate(z, scale_factor=4, mode="bilinear", align_corners=False)


def soft_dice(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    p = logits.softmax(1)
    t = F.one_hot(y, 4).permute(0, 3, 1, 2).float()
    inter = (p * t).sum((2, 3))
    return (1 - (2 * inter + 1) / (p.sum((2, 3)) + t.sum((2, 3)) + 1)).mean()


def _seg_step(model: nn.Module) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(2, 3, 30, 30), torch.randint(0, 4, (2, 30, 30))
    soft_dice(model(x), y).backward()


def test_a_spatial_size_mismatch_names_both_tensors_and_the_resize(tmp_path: Path) -> None:
    model = TinySeg()
    with (
        pytest.raises(RuntimeError, match="must match the size of tensor b"),
        nanwatch.watch(model, report_dir=str(tmp_path)) as nw,
    ):
        _seg_step(model)
        nw.step()
    files = sorted(tmp_path.glob("*.json"))
    assert files, "no post-mortem report written"
    error = Report.load(str(files[-1])).error
    assert error is not None and error["class"] == "shape-mismatch"
    advice = error["advice"]
    assert advice.startswith("p * t at "), advice
    assert (
        "raised: p is (2, 4, 32, 32) and t is (2, 4, 30, 30), and dimension 3 differs (32 vs 30)"
    ) in advice
    assert "Only the spatial sizes differ (32x32 vs 30x30)" in advice
    assert "p = F.interpolate(p, size=t.shape[-2:], mode='bilinear'" in advice
    assert "The last modules and their input shapes are listed" not in advice


def test_the_output_resized_to_the_input_trains_clean() -> None:
    model = TinySeg(fit=True)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        _seg_step(model)
        nw.step()
    assert nw.first_anomaly is None and not any(h.diagnoses for h in nw.history)


def test_a_batch_mismatch_names_the_tensors_without_a_resize(tmp_path: Path) -> None:
    head = nn.Linear(4, 1)

    def run() -> None:
        pred = head(torch.randn(8, 4)).squeeze(-1)
        weight = torch.ones(6)  # per-sample weights of another batch
        (pred * weight).mean().backward()

    with pytest.raises(RuntimeError), nanwatch.watch(head, report_dir=str(tmp_path)) as nw:
        run()
        nw.step()
    error = Report.load(str(sorted(tmp_path.glob("*.json"))[-1])).error
    assert error is not None
    advice = error["advice"]
    assert "pred is (8,) and weight is (6,), and dimension 0 differs (8 vs 6)" in advice, advice
    assert "interpolate" not in advice


# ------------------------------- the loss line's own log of a ratio: a degenerate box, dropped


class WHHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _wh_run(mode: str, *, degenerate: bool) -> tuple[nanwatch.Watcher, dict[str, object]]:
    torch.manual_seed(0)
    net = WHHead()
    x = torch.randn(6, 8)
    anchors_wh = torch.rand(6, 2) * 10 + 1
    gt_wh = torch.rand(6, 2) * 10 + 0.5
    if degenerate:
        gt_wh[2, 0] = 0.0  # a box clipped to the image border: zero width
    with nanwatch.watch(net, mode=mode, on_anomaly="record", postmortem=False) as nw:
        loss = F.smooth_l1_loss(net(x), torch.log(gt_wh / anchors_wh))
        loss.backward()
        nw.step()
    scope: dict[str, object] = {"F": F, "torch": torch, "net": net, "x": x}
    return nw, {**scope, "gt_wh": gt_wh, "anchors_wh": anchors_wh}


@pytest.mark.parametrize("mode", MODES)
def test_a_log_of_a_ratio_on_the_loss_line_drops_the_degenerate_entry(mode: str) -> None:
    nw, scope = _wh_run(mode, degenerate=True)
    d = _first(nw)
    assert (d.code, d.path, d.op) == ("NW110", "F.smooth_l1_loss", "aten.log"), d.headline
    text = "\n".join(d.evidence)
    assert "the log is of a ratio, gt_wh / anchors_wh: 0 wherever gt_wh is" in text, text
    assert "spectrogram" not in d.explanation and "a degenerate box" in d.explanation
    lines = d.fix.splitlines()
    assert lines[0].startswith("valid = gt_wh > 0   # a degenerate entry"), d.fix
    assert lines[1].startswith(
        "loss = F.smooth_l1_loss(net(x)[valid], torch.log(gt_wh / anchors_wh)[valid])   # "
    ), d.fix
    assert lines[2].startswith("# or, where a 0 of gt_wh is a legitimate value"), d.fix
    for line in lines[:2]:  # the advice, run on the batch that failed: finite
        exec(line.split("   #")[0], scope)
    assert torch.isfinite(scope["loss"]).all()  # type: ignore[call-overload]


@pytest.mark.parametrize("mode", MODES)
def test_a_log_of_a_ratio_of_boxes_with_area_stays_quiet(mode: str) -> None:
    nw, _ = _wh_run(mode, degenerate=False)
    assert nw.first_anomaly is None and not any(h.diagnoses for h in nw.history)
