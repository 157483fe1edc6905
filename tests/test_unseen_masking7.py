"""Found by user testing: a NaN target whose loss was NaN is not a NaN a mask hid (NW407);
poisoned BatchNorm statistics are re-estimated after the reset, not only reset (NW405); a
bad batch is called by the user's name for it, not by a torch module's forward parameter
(NW401)."""

from __future__ import annotations

import ast
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests._diagnoses import code_lines
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


# ------------------------------ 1: NaN target, NaN loss, backward recorded: NW401, not NW407


class _Reg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), y)


def test_a_nan_target_that_made_the_loss_nan_is_not_a_nan_hidden_by_a_mask() -> None:
    torch.manual_seed(0)
    m = _Reg()
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    y[2, 0] = float("nan")

    def step_fn() -> None:
        m.step(x, y).backward()

    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        step_fn()
        nw.step()
        nw.replay(step_fn)  # backward's MseLossBackward0 saved the NaN target
    t = next(t for t in nw.history if t.anomaly is not None)
    assert t.loss is not None and t.loss != t.loss  # the loss was NaN
    codes = [d.code for d in t.diagnoses]
    assert "NW407" not in codes
    assert codes[0] == "NW401"
    assert "target" in t.diagnoses[0].title


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = self.fc(x)
        mask = ~torch.isnan(y)
        return torch.where(mask, (p - y) ** 2, 0.0).mean()


def test_a_nan_a_where_hid_from_a_finite_loss_is_still_nw407() -> None:
    torch.manual_seed(0)
    m = _Masked()
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    y[2, 0] = float("nan")

    def step_fn() -> None:
        m.step(x, y).backward()

    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        step_fn()
        nw.step()
        nw.replay(step_fn)
    t = next(t for t in nw.history if t.anomaly is not None)
    assert [d.code for d in t.diagnoses][:1] == ["NW407"]


# ------------------------------ 2: poisoned BN running_var: reset, then re-estimate


def _bn_net() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 2),
    )


def test_a_poisoned_running_var_is_reset_and_re_estimated_on_clean_batches() -> None:
    torch.manual_seed(0)
    net = _bn_net()
    with torch.no_grad():
        net[4].running_mean.fill_(3.0)  # type: ignore[index]
        net[4].running_var[1] = float("nan")  # type: ignore[index]
    net.eval()

    def run() -> None:
        with torch.no_grad():
            net(torch.randn(2, 3, 6, 6))

    d = _first(_raises(net, run), "NW405")
    assert "net[4].reset_running_stats()" in d.fix
    assert "torch.optim.swa_utils.update_bn(loader, " in d.fix
    assert "clean checkpoint" in d.fix and "mean 0 / var 1" in d.fix
    code = code_lines(d.fix)
    ast.parse(code)
    # applied, then re-estimated on clean batches as it says: this model's statistics again
    exec(code.split("assert")[0], {"torch": torch, "net": net})
    assert torch.equal(net[4].running_var, torch.ones(4))  # type: ignore[index]
    torch.optim.swa_utils.update_bn([torch.randn(4, 3, 6, 6) for _ in range(3)], net)
    assert not net.training
    var = net[4].running_var  # type: ignore[index]
    assert torch.isfinite(var).all() and not torch.equal(var, torch.ones(4))
    with torch.no_grad():
        assert torch.isfinite(net(torch.randn(2, 3, 6, 6))).all()


def _raises_with(model: nn.Module, run: Callable[[Any], None]) -> nanwatch.AnomalyError:
    """The AnomalyError ``run(nw)`` raises with ``model`` watched."""
    try:
        with nanwatch.watch(model) as nw:
            run(nw)
    except nanwatch.AnomalyError as e:
        return e
    raise AssertionError("no anomaly")


# ------------------------------ 3: the user's name for the batch, not torch's `input`


def test_a_bad_batch_into_a_sequential_is_not_called_by_its_forward_parameter() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    batch = torch.randn(5, 4)
    batch[1, 2] = float("nan")
    d = _first(_raises(net, lambda: net(batch)), "NW401")
    assert "input =" not in d.fix and "isfinite(input)" not in d.fix
    assert "batch = torch.nan_to_num(batch" in d.fix  # the user's name, from the call
    ast.parse(code_lines(d.fix))


def test_the_call_site_names_the_batch_as_the_user_passed_it() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    calib = [torch.randn(5, 4) for _ in range(2)]
    calib[1][1, 2] = float("nan")

    def run(nw: Any) -> None:
        for xb in calib:
            nw.note("call_site", "Sequential", code="for xb in calib: net(xb)", callee="net")
            net(xb)

    d = _first(_raises_with(net, run), "NW401")
    assert "xb = torch.nan_to_num(xb, nan=0.0" in d.fix
    assert "torch.isfinite(xb)" in d.fix
    ast.parse(code_lines(d.fix))


def test_a_batch_passed_by_a_library_call_names_that_call() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    batch = torch.randn(5, 4)
    batch[1, 2] = float("nan")

    def run(nw: Any) -> None:
        nw.note(
            "call_site",
            "Sequential",
            code="model(input)",
            callee="model",
            library="torch.optim.swa_utils.update_bn",
            user_code="update_bn(loader, swa)",
            user_source="train.py:40",
        )
        net(batch)

    d = _first(_raises_with(net, run), "NW401")
    assert "update_bn(loader, swa) at train.py:40" in d.fix
    assert "input =" not in d.fix
    ast.parse(code_lines(d.fix))


# ------------------------------ 4: a NaN batch a BatchNorm took in train mode: restore it


def test_a_nan_batch_that_reached_a_batchnorm_resets_and_re_estimates_its_statistics() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 2),
    )
    calib = [torch.randn(4, 3, 6, 6) for _ in range(2)]
    calib[1][2, 0, 3, 3] = float("nan")
    net.train()  # a re-estimation of the statistics under no_grad
    with nanwatch.watch(net, on_anomaly="record", postmortem=False) as nw, torch.no_grad():
        for xb in calib:
            net(xb)
            nw.step()
    assert not torch.isfinite(net[1].running_var).all()  # type: ignore[index]
    t = next(t for t in nw.history if t.anomaly is not None)
    d = t.diagnoses[0]
    assert d.code == "NW401"
    assert "running_mean/var NaN" in d.fix
    assert "net[1].reset_running_stats()" in d.fix
    assert "torch.optim.swa_utils.update_bn(loader, " in d.fix
    code = code_lines(d.fix)
    ast.parse(code)
    fix = "\n".join(ln for ln in code.splitlines() if "running_stats" in ln)
    exec(fix, {"torch": torch, "net": net})
    assert torch.isfinite(net[1].running_var).all()  # type: ignore[index]
