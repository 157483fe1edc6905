"""Found by user testing: an optimizer stepped directly while a GradScaler scales the loss
(scaler.step forgotten), a stiff ODE solver loop blamed on the inputs in sentinel mode, a
loss multiplied by a constant before backward() and never divided back, and a GradScaler
on a model converted to float16.

Each runs a tiny real model under ``nanwatch.watch`` on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests._diagnoses import top

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _reports(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)


# ------------------------------------------- 1: opt.step() instead of scaler.step(opt)


def _amp_run(bypass: bool) -> nanwatch.Watcher:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    grad_scaler = torch.amp.GradScaler("cpu")
    with nanwatch.watch(model, on_anomaly="warn") as nw:
        for _ in range(6):
            x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            grad_scaler.scale(loss).backward()
            if bypass:
                opt.step()
            else:
                grad_scaler.step(opt)
                grad_scaler.update()
            opt.zero_grad()
            nw.step()
    return nw


def test_optimizer_stepped_without_the_scaler_is_named() -> None:
    with pytest.warns(RuntimeWarning, match="NW301"):
        nw = _amp_run(bypass=True)
    d = top(nw)
    assert d.code == "NW301"
    assert "scaled gradients (scale 65536)" in d.title
    assert "consequence of an earlier anomaly" not in d.title
    assert "grad_scaler.step(opt)" in d.fix and "grad_scaler.update()" in d.fix


def test_scaler_stepping_the_optimizer_stays_silent() -> None:
    nw = _amp_run(bypass=False)
    assert not any(d.code == "NW301" for t in nw.history for d in t.diagnoses)


# ------------------------------------------- 2: sentinel: values grown inside the forward


class _Euler(nn.Module):
    """An explicit Euler loop on a stiff decay: dt * k = 3 is past its stability limit."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        for _ in range(90):
            y = y + 0.1 * (-30.0 * y + self.lin(y))
        return y


def test_sentinel_overflow_grown_in_a_loop_does_not_blame_the_inputs() -> None:
    torch.manual_seed(0)
    model = _Euler()
    y0 = torch.randn(4, 2)
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(model, mode="sentinel") as nw:
        model(y0).pow(2).mean().backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW101"
    said = "\n".join([*d.evidence, d.explanation, d.fix])
    assert "grew inside the model's forward" in said
    assert "the initial weights or the inputs put it there" not in said
    assert "inputs or the initial weights are this large" not in d.fix
    assert "mode='watch'" in d.fix


def test_first_step_overflow_from_huge_inputs_still_blames_the_inputs() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    x = torch.full((4, 2), 3e38)
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(model, mode="sentinel") as nw:
        model(x).sum().backward()
        nw.step()
    said = "\n".join([*top(nw).evidence, top(nw).fix])
    assert "grew inside the model's forward" not in said


# ------------------------------------------- 3: (loss * SCALE).backward(), never unscaled

_LOSS_SCALE = 4096.0


def _hand_scaled_run() -> nanwatch.Watcher:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with nanwatch.watch(model, on_anomaly="warn") as nw:
        for _ in range(12):
            x, y = torch.randn(16, 8), torch.randn(16, 1)
            loss = F.mse_loss(model(x), y)
            (loss * _LOSS_SCALE).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


def _hand_scaled_unscaled_run() -> nanwatch.Watcher:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with nanwatch.watch(model, on_anomaly="warn") as nw:
        for _ in range(12):
            x, y = torch.randn(16, 8), torch.randn(16, 1)
            loss = F.mse_loss(model(x), y)
            (loss * _LOSS_SCALE).backward()
            for p in model.parameters():
                p.grad.div_(_LOSS_SCALE)
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


def test_loss_scaled_by_hand_and_never_unscaled_is_named() -> None:
    with pytest.warns(RuntimeWarning, match="NW101"):
        nw = _hand_scaled_run()
    d = top(nw)
    assert d.code == "NW101"
    assert any("loss * _LOSS_SCALE" in e and "4096" in e for e in d.evidence)
    assert "p.grad.div_(_LOSS_SCALE)" in d.fix
    assert 'g["lr"]' not in d.fix  # a lower lr only hides it


def test_loss_scaled_and_unscaled_stays_silent() -> None:
    nw = _hand_scaled_unscaled_run()
    assert not [d for t in nw.history for d in t.diagnoses if d.severity == "error"]


# ------------------------------------------- 4: a GradScaler on a model.half()


def test_scaler_on_a_half_model_gets_advice() -> None:
    model = nn.Sequential(nn.Linear(4, 4)).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="unscale FP16"), nanwatch.watch(model) as nw:
        loss = model(torch.randn(2, 4).half()).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
    err = nw.report.error
    assert err is not None and err["class"] == "fp16-unscale"
    assert "torch.autocast(" in err["advice"] and "drop the scaler" in err["advice"]
