"""Sentinel reads no weight after an update: the next step's forward shows a bad one. The
run's last update has no next step, so its weights are read once at detach: a run must
not end with NaN weights (the checkpoint saved after it) and an empty report."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch


def _model() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=1e38), torch.randn(16, 4) * 100


@pytest.mark.parametrize("steps", [True, False], ids=["nw.step", "no-step-calls"])
def test_the_last_updates_weights_are_read_at_detach(steps: bool) -> None:
    model, opt, x = _model()
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(model, mode="sentinel", postmortem=False) as nw,
    ):
        model(x).pow(2).mean().backward()
        opt.step()  # lr 1e38: the weights overflow to inf
        opt.zero_grad()
        if steps:
            nw.step()
        assert nw.anomalies == []  # nothing read yet: sentinel reads no weight
    d = info.value.diagnosis
    assert d.code == "NW301" and d.title == "Non-finite weights after an optimizer step"
    assert any("updated at step 0 by SGD (lr 1e38" in e for e in d.evidence), d.evidence


def test_healthy_weights_at_detach_say_nothing() -> None:
    model, opt, x = _model()
    for g in opt.param_groups:
        g["lr"] = 1e-3
    with nanwatch.watch(model, mode="sentinel", postmortem=False) as nw:
        for _ in range(2):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    assert nw.anomalies == [] and len(nw.history) == 2


def test_a_users_exception_is_not_replaced_by_the_check_at_detach() -> None:
    model, opt, x = _model()
    with (
        pytest.raises(ValueError, match="the user's own"),
        nanwatch.watch(model, mode="sentinel", postmortem=False) as nw,
    ):
        model(x).pow(2).mean().backward()
        opt.step()
        nw.step()
        raise ValueError("the user's own")


def test_a_crash_after_an_update_that_broke_the_weights_leads_with_them() -> None:
    """A NaN learning rate (a schedule's 0/0) breaks the weights at an update; the loop
    raises its own error before the next forward, so sentinel never read them. The
    post-mortem leads with the NaN weights and the exception goes on unchanged."""
    model, opt, x = _model()
    for g in opt.param_groups:
        g["lr"] = 1e-3
    nw = nanwatch.watch(model, mode="sentinel", postmortem=False)
    with pytest.raises(ValueError, match="math domain error"), nw:
        for step in range(3):
            if step == 2:
                raise ValueError("math domain error")  # math.cos(nan) in the schedule
            model(x).pow(2).mean().backward()
            if step == 1:
                opt.param_groups[0]["lr"] = float("nan")
            opt.step()
            opt.zero_grad()
            nw.step()
    last = nw.history[-1]
    assert last.error is not None and last.diagnoses, last
    assert last.diagnoses[0].code == "NW301"
    assert "learning rate" in last.diagnoses[0].title
