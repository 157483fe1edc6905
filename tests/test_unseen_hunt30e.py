"""Vision, generative and RL training steps, diagnosed in watch and sentinel mode: the
place, the op and the cause, and a fix that works."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

torch.set_num_threads(1)


class BoxHead(nn.Module):
    """Predicts a box as its corner plus a ReLU'd width and height; the size bias was
    driven below 0 by earlier updates, so every predicted box has zero area."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = F.relu(self.fc(x))[:, 2:]
        corner = x[:, :2]
        return torch.cat([corner, corner + size], 1)


class IoULoss(nn.Module):
    """1 - IoU of (x1, y1, x2, y2) boxes, the union held in a name."""

    def forward(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x1 = torch.max(p[:, 0], t[:, 0])
        y1 = torch.max(p[:, 1], t[:, 1])
        x2 = torch.min(p[:, 2], t[:, 2])
        y2 = torch.min(p[:, 3], t[:, 3])
        inter = (x2 - x1).clamp(min=0) * (y2 - y1).clamp(min=0)
        ap = (p[:, 2] - p[:, 0]) * (p[:, 3] - p[:, 1])
        at = (t[:, 2] - t[:, 0]) * (t[:, 3] - t[:, 1])
        union = ap + at - inter
        iou = inter / union
        return (1 - iou).mean()


class InlineIoULoss(nn.Module):
    """The same loss with the union written inside the division."""

    def forward(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x1 = torch.max(p[:, 0], t[:, 0])
        y1 = torch.max(p[:, 1], t[:, 1])
        x2 = torch.min(p[:, 2], t[:, 2])
        y2 = torch.min(p[:, 3], t[:, 3])
        inter = (x2 - x1).clamp(min=0) * (y2 - y1).clamp(min=0)
        ap = (p[:, 2] - p[:, 0]) * (p[:, 3] - p[:, 1])
        at = (t[:, 2] - t[:, 0]) * (t[:, 3] - t[:, 1])
        iou = inter / (ap + at - inter)
        return (1 - iou).mean()


class FixedIoULoss(nn.Module):
    """The advised fix: the union floored at eps where it is made."""

    def forward(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x1 = torch.max(p[:, 0], t[:, 0])
        y1 = torch.max(p[:, 1], t[:, 1])
        x2 = torch.min(p[:, 2], t[:, 2])
        y2 = torch.min(p[:, 3], t[:, 3])
        inter = (x2 - x1).clamp(min=0) * (y2 - y1).clamp(min=0)
        ap = (p[:, 2] - p[:, 0]) * (p[:, 3] - p[:, 1])
        at = (t[:, 2] - t[:, 0]) * (t[:, 3] - t[:, 1])
        union = (ap + at - inter).clamp_min(torch.finfo(inter.dtype).eps)
        iou = inter / union
        return (1 - iou).mean()


def _box_step(criterion: nn.Module, mode: str, *, dead: bool, points: bool) -> nanwatch.Watcher:
    torch.manual_seed(0)
    net = BoxHead()
    if dead:
        with torch.no_grad():
            net.fc.bias[2:].fill_(-10.0)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    size = torch.zeros(4, 2) if points else torch.rand(4, 2) + 0.5
    t = torch.cat([x[:, :2], x[:, :2] + size], 1)  # points: boxes of zero area
    with nanwatch.watch(net, criterion, mode=mode, on_anomaly="record") as nw:
        loss = criterion(net(x), t)
        loss.backward()
        opt.step()
        opt.zero_grad()
        nw.step()
    return nw


@pytest.mark.parametrize("criterion", [IoULoss(), InlineIoULoss()], ids=["named", "inline"])
@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_an_iou_of_zero_area_boxes_is_every_term_zero_not_a_cancellation(
    mode: str, criterion: nn.Module
) -> None:
    nw = _box_step(criterion, mode, dead=True, points=True)
    a = nw.first_anomaly
    assert a is not None and a.path == type(criterion).__name__, a
    assert a.op is not None and a.op.op.startswith("aten.div"), a.op
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW111" and d.op is not None and d.op.startswith("aten.div"), d.headline
    # union = ap + at - inter with inter (the numerator) 0 everywhere: ap + at is 0 too,
    # the boxes have no area; nothing cancelled after rounding
    assert "every term of a difference is 0" in d.title, d.title
    assert any(
        "subtracts the numerator inter, itself 0 in every value: ap + at is 0 everywhere too" in e
        for e in d.evidence
    ), d.evidence
    text = " ".join([d.title, *d.evidence, d.explanation])
    assert "cancelled to 0" not in text and "are equal after rounding" not in text, text
    assert "a box of zero width or height" in d.fix, d.fix
    if isinstance(criterion, IoULoss):
        assert (
            "union = (ap + at - inter).clamp_min(torch.finfo(inter.dtype).eps)   # was "
            "union = ap + at - inter"
        ) in d.fix, d.fix
    else:
        assert "iou = inter / (ap + at - inter).clamp_min(torch.finfo(" in d.fix, d.fix
    fixed = _box_step(FixedIoULoss(), mode, dead=True, points=True)
    assert fixed.first_anomaly is None


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_an_iou_of_boxes_with_area_stays_quiet(mode: str) -> None:
    nw = _box_step(IoULoss(), mode, dead=False, points=False)
    assert nw.first_anomaly is None
    assert all(not t.diagnoses for t in nw.history)


class VAE(nn.Module):
    """A Gaussian VAE whose encoder's log-variance drifted up (its bias at 95); ``bound``
    clamps the log-variance where it is made, the advised fix."""

    def __init__(self, bound: float | None = None) -> None:
        super().__init__()
        self.enc = nn.Linear(16, 8)
        self.dec = nn.Linear(4, 16)
        self.bound = bound
        with torch.no_grad():
            self.enc.bias[4:].fill_(95.0)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu, logvar = self.enc(x).chunk(2, -1)
        if self.bound is not None:
            logvar = logvar.clamp(max=self.bound)
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        return self.dec(z), mu, logvar


def _vae_step(mode: str, bound: float | None = None) -> nanwatch.Watcher:
    torch.manual_seed(0)
    vae = VAE(bound)
    opt = torch.optim.Adam(vae.parameters(), lr=1e-3)
    x = torch.randn(8, 16)
    with nanwatch.watch(vae, mode=mode, on_anomaly="record") as nw:
        recon, mu, logvar = vae(x)
        kl = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
        loss = F.mse_loss(recon, x) + kl
        loss.backward()
        opt.step()
        opt.zero_grad()
        nw.step()
    return nw


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_vae_kl_whose_logvar_exp_overflowed_first_names_the_exp_not_the_later_mse(
    mode: str,
) -> None:
    nw = _vae_step(mode)
    a = nw.first_anomaly
    # logvar.exp() overflowed on the kl line, before the mse_loss line squared the huge
    # reconstruction: the exp ran first, and is the op named
    assert a is not None and a.path == "(loss)", a
    assert a.op is not None and a.op.op == "aten.exp", a.op
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW101" and d.op == "aten.exp", d.headline
    assert "mse_loss" not in d.headline, d.headline
    assert "a predicted log-variance or log-scale" in d.explanation, d.explanation
    assert "clamp(max=44.3)" in d.fix, d.fix
    assert "loop or recurrence" not in d.fix, d.fix
    fixed = _vae_step(mode, bound=44.3)  # the bound the fix gives, where logvar is made
    assert fixed.first_anomaly is None
