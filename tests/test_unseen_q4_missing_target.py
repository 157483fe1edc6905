"""A forecasting target window with a missing value (NaN read from a CSV) in a loss that is
not a squared error: the fix masks the loss's own terms (a pinball loss over quantiles)
instead of offering an MSE in its place; a squared or absolute error keeps its one-line
masked form."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch

torch.set_num_threads(1)

MODES = ["sentinel", "watch"]
QS = torch.tensor([0.1, 0.5, 0.9])


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 6 * 3), nn.Unflatten(1, (6, 3))
    )


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 24, generator=g), torch.randn(8, 6, generator=g)
    y[5, 2] = float("nan")  # a missing reading in the target window
    return x, y


def _pinball(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    e = y.unsqueeze(-1) - pred
    return torch.max(QS * e, (QS - 1) * e)


def _diagnosis(mode: str, loss_fn):  # type: ignore[no-untyped-def]
    model = _net()
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        x, y = _batch()
        loss = loss_fn(model, x, y)
        loss.backward()
        nw.step()
    d = nw.report.diagnoses[0]
    assert d.title == "Non-finite tensor computed without gradients, read by the loss"
    return d


@pytest.mark.parametrize("mode", MODES)
def test_a_pinball_loss_with_a_missing_target_masks_its_own_terms(mode: str) -> None:
    d = _diagnosis(mode, lambda m, x, y: _pinball(m(x), y).mean())
    assert "keep = torch.isfinite(y)" in d.fix
    assert "** 2" not in d.fix  # no squared error offered in place of the user's loss
    assert "y = torch.nan_to_num(y)" in d.fix
    assert "loss = (terms * keep).sum() / keep.sum()" in d.fix
    assert "mean, maximum, mul, sub; not a squared error" in d.fix


@pytest.mark.parametrize("mode", MODES)
def test_an_absolute_error_with_a_missing_target_keeps_its_one_line(mode: str) -> None:
    d = _diagnosis(mode, lambda m, x, y: (m(x)[..., 1] - y).abs().mean())
    assert "loss = (pred - y)[keep].abs().mean()" in d.fix
    assert "** 2" not in d.fix


@pytest.mark.parametrize("mode", MODES)
def test_a_squared_error_with_a_missing_target_keeps_its_one_line(mode: str) -> None:
    d = _diagnosis(mode, lambda m, x, y: ((m(x)[..., 1] - y) ** 2).mean())
    assert "loss = ((pred - y)[keep] ** 2).mean()" in d.fix
    assert "terms * keep" not in d.fix


@pytest.mark.parametrize("mode", [*MODES, "forensic"])
def test_the_masked_pinball_loss_trains_clean(mode: str) -> None:
    model = _net()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with nanwatch.watch(model, mode=mode, postmortem=False) as nw:  # type: ignore[arg-type]
        for _ in range(3):
            x, y = _batch()
            keep = torch.isfinite(y)
            y = torch.nan_to_num(y)
            terms = _pinball(model(x), y)
            loss = (terms * keep.unsqueeze(-1)).sum() / keep.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    assert nw.report.diagnoses == []
