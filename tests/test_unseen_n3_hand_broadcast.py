"""A hand-written loss that broadcasts the model's (N, 1) output against an (N,) target,
``((pred - y) ** 2).mean()``: an N x N loss that is finite and decreases, of which PyTorch
says nothing (nn.MSELoss warns). The first backward() of a watch reads the loss code's graph
shapes once: NW506, a warning at the user's line with both shapes and the fix in the user's
names. Intended broadcasting (a (N, C) prediction against a (C,) mean, a column against a
matrix of scores or of targets) and the squeezed loss stay silent."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import nanwatch

torch.set_num_threads(1)

MODES = ["watch", "sentinel"]


def _net(out: int = 1) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, out))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(16, 4), torch.randn(16)


def _mse_by_hand(mode: str, squeeze: bool) -> nanwatch.Watcher:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = _data()
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            pred = model(x).squeeze(1) if squeeze else model(x)
            loss = ((pred - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", MODES)
def test_a_column_against_a_row_in_a_hand_written_mse_is_named_with_the_fix(mode: str) -> None:
    nw = _mse_by_hand(mode, squeeze=False)
    found = [d for d in nw.report.diagnoses if d.code == "NW506"]
    assert len(found) == 1, [d.headline for d in nw.report.diagnoses]  # once, not each step
    d = found[0]
    assert d.severity == "warning"
    assert d.evidence[0] == (
        "pred (16, 1) and y (16,) broadcast to (16, 16) in pred - y: each prediction meets "
        "every target (256 terms instead of 16), not only its own"
    )
    assert d.source is not None and d.source.endswith(":40")
    assert "loss = ((pred - y) ** 2).mean()" in d.evidence[1]
    assert d.fix.startswith("loss = ((pred.squeeze(1) - y) ** 2).mean()")
    assert "pred - y.unsqueeze(1)" in d.fix


@pytest.mark.parametrize("mode", MODES)
def test_the_squeezed_loss_trains_clean(mode: str) -> None:
    assert _mse_by_hand(mode, squeeze=True).report.diagnoses == []


def test_the_warning_reaches_the_user_at_the_end_of_the_step() -> None:
    model = _net()
    x, y = _data()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with nanwatch.watch(model, postmortem=False) as nw:
            pred = model(x)
            loss = ((pred - y) ** 2).mean()
            loss.backward()
            nw.step()
    said = [str(w.message) for w in seen if issubclass(w.category, nanwatch.NanwatchWarning)]
    assert any("NW506" in s and "pred (16, 1) and y (16,)" in s for s in said), said


def test_a_prediction_centered_by_its_mean_stays_silent() -> None:
    model = _net(3)
    x, _ = _data()
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        pred = model(x)  # (16, 3)
        mean = pred.detach().mean(0)  # (3,): over the batch, on purpose
        loss = ((pred - mean) ** 2).mean()
        loss.backward()
        nw.step()
    assert nw.report.diagnoses == []


def test_a_column_against_a_matrix_of_scores_stays_silent() -> None:
    model = _net(16)
    x, _ = _data()
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        s = model(x)  # (16, 16): in-batch scores
        pos = s.diagonal()[:, None]  # (16, 1), against the matrix on purpose
        loss = (1.0 - pos + s).clamp(min=0).mean()
        loss.backward()
        nw.step()
    assert nw.report.diagnoses == []


def test_a_column_against_a_matrix_target_stays_silent() -> None:
    model = _net()
    x, y = _data()
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        pred = model(x)  # (16, 1)
        target = y[:, None] * y[None, :]  # (16, 16) with no history: a matrix, on purpose
        loss = ((pred - target) ** 2).mean()
        loss.backward()
        nw.step()
    assert nw.report.diagnoses == []


def _mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((pred - target) ** 2).mean()


def test_a_loss_function_written_by_hand_is_read_through_its_call() -> None:
    model = _net()
    x, y = _data()
    with nanwatch.watch(model, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
        loss = _mse(model(x), y)
        loss.backward()
        nw.step()
    (d,) = nw.report.diagnoses
    assert d.code == "NW506"
    assert d.evidence[0].startswith("pred (16, 1) and target (16,) broadcast to (16, 16)")
    assert d.source is not None and d.source.endswith(":121")
    assert d.fix.startswith("return ((pred.squeeze(1) - target) ** 2).mean()")
