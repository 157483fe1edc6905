"""A LambdaLR whose lambda is inf at its first step (an inverse square root decay,
``torch.tensor(s).rsqrt()`` at s = 0): NW301's "Non-finite learning rate" names the
scheduler, its variable and the lambda's line, and checks the lr after that scheduler's
own step(), where it said "(scheduler.step())" and nothing of the LambdaLR."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import nanwatch
from tests._diagnoses import first_bad
from tests.zoo import TanhMLP


def _train(mode: str, decay: Callable[[int], float]) -> Any:
    torch.manual_seed(0)
    model, crit = TanhMLP(), nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    warm = torch.optim.lr_scheduler.LambdaLR(opt, decay)
    with nanwatch.watch(model, crit, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            x = torch.randn(32, 8)
            crit(model(x), x.sum(1, keepdim=True)).backward()
            opt.step()
            warm.step()
            opt.zero_grad()
            nw.step()
    return nw


def _rsqrt(s: int) -> float:
    return torch.tensor(float(s)).rsqrt().item()


def _rsqrt_from_1(s: int) -> float:
    return torch.tensor(float(max(s, 1))).rsqrt().item()


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_an_inf_lambda_names_the_lambdalr_and_its_line(mode: str) -> None:
    t = first_bad(_train(mode, _rsqrt))
    d = next(d for d in t.diagnoses if d.code == "NW301")
    assert d.title == "Non-finite learning rate"
    said = next(e for e in d.evidence if "is set by" in e)
    assert said.startswith("SGD's lr is set by the LambdaLR warm at each warm.step(), as its")
    assert "test_unseen_n9_scheduler_lr.py:" in said
    assert said.endswith("def _rsqrt(s: int) -> float:")
    assert "assert math.isfinite(lr), lr   # right after each change of the lr (warm.step())" in (
        d.fix
    )


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_the_decay_kept_off_step_0_trains_clean(mode: str) -> None:
    nw = _train(mode, _rsqrt_from_1)
    assert [d.headline for d in nw.report.diagnoses] == []
