"""NW101's fix for a training update that grew the values follows the update nanwatch saw:
a hand-written update (no torch.optim optimizer) gets no ``optimizer`` name; Adam and its
kin get the learning rate and no gradient clipping (their step is about lr per weight
whatever the gradient); an optimizer setting that makes the update grow (momentum >= 1)
is named first, not the lr. NW206 is silent when the loss took a float32 copy of float16
logits."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

pytestmark = pytest.mark.filterwarnings("ignore::nanwatch.NanwatchWarning")


def _mlp() -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    x = torch.randn(128, 8)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(128, 1)
    return model, nn.MSELoss(), x, y


def _code(fix: str) -> list[str]:
    return [line for line in fix.splitlines() if line and not line.startswith("#")]


def _hand_written(lr: float, steps: int) -> nanwatch.AnomalyError | None:
    model, crit, x, y = _mlp()
    try:
        with nanwatch.watch(model, crit, postmortem=False) as nw:
            for _ in range(steps):
                loss = crit(model(x), y)
                loss.backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p.sub_(lr * p.grad)  # p -= lr * p.grad
                        p.grad = None
                nw.step()
    except nanwatch.AnomalyError as e:
        e.model = model  # type: ignore[attr-defined]
        return e
    return None


def test_hand_written_update_fix_names_no_optimizer_and_runs() -> None:
    err = _hand_written(3.0, 40)
    assert err is not None
    d = err.diagnosis
    assert d.code == "NW101"
    assert "optimizer.param_groups" not in d.fix and "before step()" not in d.fix
    assert "p -= lr * p.grad" in d.fix and "10 times lower" in d.fix
    assert any("updated by hand" in e for e in d.evidence)
    model = err.model  # type: ignore[attr-defined]
    exec(d.fix, {"torch": torch, "nn": nn, "model": model})  # pasted: it runs


def test_hand_written_update_healthy_is_silent() -> None:
    assert _hand_written(0.01, 20) is None


def _adam(lr: float, steps: int) -> nanwatch.AnomalyError | None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 1),
    )
    crit = nn.MSELoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    try:
        with nanwatch.watch(model, crit, postmortem=False) as nw:
            for _ in range(steps):
                x = torch.randn(64, 8)
                loss = crit(model(x), x.sum(1, keepdim=True))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                nw.step()
    except nanwatch.AnomalyError as e:
        e.optimizer = optimizer  # type: ignore[attr-defined]
        return e
    return None


def test_adam_lr_fix_is_the_lr_without_clipping() -> None:
    err = _adam(1e4, 10)
    assert err is not None
    d = err.diagnosis
    assert d.code == "NW101"
    code = _code(d.fix)
    assert code[0].startswith('for g in optimizer.param_groups: g["lr"] = 1e-3')
    assert not any("clip_grad_norm_" in line for line in code)
    assert "clipping cannot bound its step" in d.fix
    optimizer = err.optimizer  # type: ignore[attr-defined]
    exec(d.fix, {"torch": torch, "optimizer": optimizer})
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)


def test_adam_healthy_is_silent() -> None:
    assert _adam(1e-3, 10) is None


def _momentum(momentum: float, steps: int, fix: str = "") -> nanwatch.AnomalyError | None:
    model, crit, x, y = _mlp()
    # weight_decay on: the watcher's optimizer note carries momentum (NW306 reads it)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.01, momentum=momentum, nesterov=True, weight_decay=1e-4
    )
    if fix:
        exec(fix, {"torch": torch, "optimizer": optimizer})
    try:
        # NW306 would stop it at step 0: ignored, the overflow comes (NW101)
        with nanwatch.watch(model, crit, postmortem=False, ignore=["NW306"]) as nw:
            for _ in range(steps):
                loss = crit(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                nw.step()
    except nanwatch.AnomalyError as e:
        return e
    return None


def test_momentum_past_1_fix_is_the_momentum_not_the_lr() -> None:
    err = _momentum(1.5, 200)
    assert err is not None
    d = err.diagnosis
    assert d.code == "NW101"
    code = _code(d.fix)
    assert code == ['optimizer.param_groups[0]["momentum"] = 0.9   # was 1.5 (SGD)']
    assert '["lr"]' not in d.fix and "clip_grad_norm_" not in d.fix
    assert "only delays the overflow" in d.fix
    assert any("momentum=1.5" in e for e in d.evidence)
    assert "momentum must be below 1" in d.explanation
    # pasted before the same training: it trains past the step that overflowed
    assert _momentum(1.5, d.step + 30, fix=d.fix) is None


def _segmentation_loss(upcast: bool) -> list[str]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3).half()
    x = torch.randn(16, 4).half()
    x[8:] *= 30  # the ignored positions: logits far past float16's exp bound
    y = torch.randint(0, 3, (16,))
    y[8:] = -100
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
            for _ in range(2):
                logits = model(x)
                loss = F.cross_entropy(logits.float() if upcast else logits, y)
                loss.backward()
                nw.step()
    return [d.code for d in nw.report.diagnoses]


def test_ignored_logits_silent_on_a_float32_copy() -> None:
    assert "NW206" in _segmentation_loss(upcast=False)  # float16 logits: the warning
    assert "NW206" not in _segmentation_loss(upcast=True)  # logits.float(): exp in float32
