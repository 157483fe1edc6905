"""Manual static loss scaling of a float16 model: ``(loss * 2 ** 20).backward()``, the
gradients divided back, then ``clip_grad_norm_``. The loss backward runs on is huge on
purpose: autograd shows it is the loss times a number of Python's (MulBackward0 of one
tensor and a constant), so NW106 ("a term of the loss blows up") must not read the scale
as a term. The gradient overflow itself is still NW101. A term that really blows up is
still NW106 with a constant on the loss."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nanwatch


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 1)

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(self.emb(i).mean(1))))


def _run(mode: str, *, half: bool = True, scale: float = 2.0**20) -> list[nanwatch.Diagnosis]:
    torch.manual_seed(0)
    m = MLP().half() if half else MLP()
    crit = nn.MSELoss()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    with nanwatch.watch(m, crit, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            i = torch.randint(0, 50, (16, 6), generator=gen)
            y = torch.randn(16, 1, generator=gen) * 3
            loss = crit(m(i).float(), y)
            (loss * scale).backward()
            for p in m.parameters():
                assert p.grad is not None
                p.grad /= scale
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            nw.step()
    return [d for t in nw.history for d in t.diagnoses]


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_a_manually_scaled_loss_is_not_a_term_that_blows_up(mode: str) -> None:
    ds = _run(mode)
    first = [d for d in ds if d.step == 0]
    found = [d for d in first if d.code == "NW101"]
    assert found, [d.headline for d in ds]
    assert not [d for d in ds if d.code == "NW106"], [d.headline for d in ds]
    d = found[0]
    text = " ".join(d.evidence)
    assert "backward ran on the loss times 2 ** 20 (1.05e+06, a constant loss scale)" in text
    assert "dividing the gradients afterwards comes too late" in d.explanation
    assert d.fix.startswith("# lower the scale until the largest gradient fits float16")


@pytest.mark.accelerator_weaker(
    reason="the gradients' total norm is read later on this path: clip_grad_norm_ runs "
    "before it is known, and its inf norm is not told"
)
@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_the_clip_after_an_inf_total_norm_is_told(mode: str) -> None:
    ds = _run(mode)
    found = [d for d in ds if d.step == 0 and d.code == "NW101"]
    assert found, [d.headline for d in ds]
    text = " ".join(found[0].evidence)
    assert "clip_grad_norm_ at " in text and "test_unseen_m2_manual_scale.py:" in text
    assert "max_norm / inf = 0, so the finite ones become 0 and the inf ones NaN" in text


def test_a_grad_scaler_is_not_told_as_a_constant_scale() -> None:
    torch.manual_seed(0)
    m = MLP()  # GradScaler keeps float32 weights
    crit = nn.MSELoss()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    gen = torch.Generator().manual_seed(0)
    with nanwatch.watch(m, crit, on_anomaly="record", postmortem=False, scaler=scaler) as nw:
        for _ in range(2):
            i = torch.randint(0, 50, (16, 6), generator=gen)
            loss = crit(m(i).float(), torch.randn(16, 1, generator=gen) * 3)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            nw.step()
    ds = [d for t in nw.history for d in t.diagnoses]
    assert not [d for d in ds if "constant loss scale" in " ".join(d.evidence)]
    assert not [d for t in nw.history for d in t.notes if d.kind == "loss_factor"]


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_a_float32_model_scaled_by_hand_trains_clean(mode: str) -> None:
    ds = _run(mode, half=False)
    assert not [d for d in ds if d.severity in ("error", "warning")], [d.headline for d in ds]


def test_a_term_that_blows_up_is_still_said_under_a_constant() -> None:
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    with nanwatch.watch(m, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
        x = torch.randn(8, 4)
        z = torch.sigmoid(m(x)) * 1e-6 + 1e-12
        loss = (1.0 / z).mean()  # singular at 0: about 2e6, far past its values
        (loss * 4.0).backward()
        nw.step()
    ds = [d for t in nw.history for d in t.diagnoses]
    assert math.isfinite(loss.item())
    assert [d for d in ds if d.code == "NW106"], [d.headline for d in ds]
