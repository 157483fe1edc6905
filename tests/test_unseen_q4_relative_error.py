"""sMAPE on intermittent demand: 2|pred - y| / (|pred| + |y|) is 0/0 on a zero-demand day
predicted as 0 (a ReLU head). That is a relative error of two zeros, an exact prediction,
not an overlap score of two empty masks: the fix floors the denominator (error 0 there)
instead of smoothing both sides with +1 (which charges the exact prediction an error of 1)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from tests._diagnoses import code_lines
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1), nn.ReLU())


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 10, generator=g), torch.rand(16, 1, generator=g) * 100
    y[::3] = 0.0  # zero-demand days
    return x, y


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    pred = model(x)
    loss = (2 * (pred - y).abs() / (pred.abs() + y.abs())).mean()
    loss.backward()


def _zero_where_no_demand(model: nn.Sequential) -> None:
    with torch.no_grad():  # the ReLU head predicts 0 for the zero-demand rows
        x, y = _batch()
        h = model[:3](x).squeeze(-1)
        model[2].bias.sub_(h[(y == 0).squeeze(-1)].max() + 0.1)


def test_smape_of_two_zeros_floors_the_denominator_not_a_dice_smoothing() -> None:
    model = _net()
    _zero_where_no_demand(model)
    x, y = _batch()
    d = _first(_raises(model, lambda: _step(model, x, y), "forensic"), "NW111")
    assert d.title.endswith("in a relative error of two zeros (sMAPE)")
    assert "overlap" not in d.title and "+ 1) / (" not in d.fix
    assert any("is a relative error: the difference of pred and y" in e for e in d.evidence)
    assert "exact" in d.explanation
    assert d.fix.startswith("loss = (2 * (pred - y).abs() / (pred.abs() + y.abs()).clamp_min(")
    # the fix, pasted, gives a finite loss and finite gradients, 0 error at the zero rows
    model.zero_grad()
    pred = model(x)
    env = {"torch": torch, "pred": pred, "y": y}
    exec(code_lines(d.fix), env)
    env["loss"].backward()
    assert torch.isfinite(env["loss"])
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_smape_of_two_zeros_without_the_line_is_a_division_by_zero(mode: str) -> None:
    model = _net()
    _zero_where_no_demand(model)
    x, y = _batch()
    err = _raises(model, lambda: _step(model, x, y), mode)
    d = _first(err, "NW111")
    assert "overlap" not in d.title


def test_dice_of_two_empty_masks_is_still_an_overlap_score() -> None:
    """The control: a constant factor on a product of two tensors is still a dice."""

    class Seg(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 1, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.conv(x))

    torch.manual_seed(0)
    m = Seg()
    with torch.no_grad():
        m.conv.bias.fill_(-10.0)
    x, t = torch.rand(2, 1, 4, 4), torch.zeros(2, 1, 4, 4)

    def run() -> None:
        p = m(x)
        dice = 2 * (p * t).sum() / (p.sum() + t.sum())
        (1 - dice).backward()

    d = _first(_raises(m, run, "forensic"), "NW111")
    assert "overlap score" in d.title and "+ 1) / (" in d.fix


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_healthy_floored_smape_trains_clean(mode: str) -> None:
    model = _net()
    _zero_where_no_demand(model)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with nanwatch.watch(model, mode=mode) as nw:  # type: ignore[arg-type]
        for _ in range(3):
            x, y = _batch()
            pred = model(x)
            den = (pred.abs() + y.abs()).clamp_min(torch.finfo(pred.dtype).eps)
            loss = (2 * (pred - y).abs() / den).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    assert all(t.anomaly is None for t in nw.history)
