"""A NaN written into a weight through ``.data`` after ``optimizer.step()`` moves no version
counter: the weight check finds it after an update. When that update cannot make a NaN
from the finite numbers it read (SGD; Adam and its kin with eps > 0 and a finite state),
the NaN is told as a write after the update, in the headline and in NW301, not as the
update's doing; an update that can make one (Adam with eps=0 at a zero gradient) keeps
the blame."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch._updates import nan_free_update


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _train(
    mode: str,
    make_opt: Callable[[nn.Module], torch.optim.Optimizer],
    *,
    edit: Callable[[nn.Sequential], None] | None,
    steps: int = 6,
) -> nanwatch.Watcher:
    model = _model()
    opt = make_opt(model)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, mode=mode, on_anomaly="warn") as nw:
            for step in range(steps):
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                if step == 2 and edit is not None:
                    edit(model)
                nw.step()
    return nw


def _data_write(model: nn.Sequential) -> None:
    model[2].weight.data[0, 0] = float("nan")  # a hand edit autograd does not see


_ADAM = (lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), "Adam")
_SGD = (lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9), "SGD")
_RMS = (lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3), "RMSprop")


@pytest.mark.parametrize("opt", [_ADAM, _SGD, _RMS], ids=["adam", "sgd", "rmsprop"])
@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_data_write_after_the_update_is_not_blamed_on_the_update(
    mode: str, opt: tuple[Callable[[nn.Module], torch.optim.Optimizer], str]
) -> None:
    make, name = opt
    nw = _train(mode, make, edit=_data_write)
    a = nw.report.first_anomaly
    assert a is not None and a.parameter == "2.weight"
    # watch reads the weights at the step's end; sentinel finds them in the next forward
    assert a.step == (2 if mode == "watch" else 3)
    assert "a write after the last optimizer step that autograd does not see" in a.summary
    assert f"{name}'s update makes no NaN" in a.summary
    d = next(d for d in nw.report.diagnoses if d.code == "NW301")
    assert d.title == "Non-finite weights written outside an optimizer step"
    assert any(f"{name}'s update at step 2" in e for e in d.evidence)
    assert any("went through .data" in e for e in d.evidence)
    assert f"but {name} did not write it" in d.explanation


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_an_update_that_can_make_nan_keeps_the_blame(mode: str) -> None:
    # Adam with eps=0 divides 0 by 0 where a gradient is exactly 0 from the start
    def make(m: nn.Module) -> torch.optim.Optimizer:
        seq = m
        assert isinstance(seq, nn.Sequential)
        with torch.no_grad():
            seq[0].weight[0].zero_()
            seq[0].bias[0] = -1.0  # unit 0 never fires: its gradients are exactly 0
        return torch.optim.Adam(m.parameters(), lr=1e-3, eps=0.0)

    nw = _train(mode, make, edit=None, steps=2)
    a = nw.report.first_anomaly
    assert a is not None
    assert "made non-finite by the last update (optimizer step)" in a.summary
    assert "autograd does not see" not in a.summary
    assert all(
        d.title != "Non-finite weights written outside an optimizer step"
        for d in nw.report.diagnoses
    )


def test_which_updates_make_no_nan_from_finite_numbers() -> None:
    adam = {"lr": 1e-3, "eps": 1e-8, "betas": [0.9, 0.999]}
    assert nan_free_update("Adam", adam, True) is not None
    assert nan_free_update("Adam", adam, None) is None  # its state was not read
    assert nan_free_update("Adam", adam, False) is None  # a NaN in it
    assert nan_free_update("Adam", {**adam, "eps": 0.0}, True) is None
    assert nan_free_update("Adam", {**adam, "betas": [0.9, 1.0]}, True) is None  # 1 - 1**t
    assert nan_free_update("Adam", {**adam, "lr": float("nan")}, True) is None
    assert nan_free_update("Adam", adam, True, own=False) is None  # someone else's "Adam"
    assert nan_free_update("RMSprop", {"lr": 1e-2, "eps": 1e-8, "centered": True}, True) is None
    assert nan_free_update("SGD", {"lr": 0.1, "momentum": 0.9}, None) is not None
    assert nan_free_update("LBFGS", {"lr": 1.0}, True) is None
