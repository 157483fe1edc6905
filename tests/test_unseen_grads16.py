"""NW301 fixes found by user testing: weights an EMA update wrote before the EMA copy's
first forward are checked on that copy (the watched root that holds them), not on the
trained model; a hand-written warmup + cosine schedule whose decay phase has 0 steps is
named at its division, with the divisor kept at 1 or more."""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import nanwatch
from tests._diagnoses import code_lines
from tests._diagnoses import first_of as _first

torch.set_num_threads(1)


# ------------------------------ 1: an EMA copy written NaN: check that copy, not `model`


def _ema_run(fixed: bool) -> nanwatch.AnomalyError | None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    ema = copy.deepcopy(model)
    for p in ema.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with nanwatch.watch(model, ema, mode="watch") as nw:
            for i in range(2):
                model(torch.randn(5, 3)).pow(2).mean().backward()
                step = torch.tensor(float(i + 1 if fixed else i))  # 0 before the first step
                decay = torch.clamp(1 - 1 / step, max=0.999)  # -inf at step 0
                with torch.no_grad():
                    for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                        e.mul_(decay).add_(p, alpha=1 - float(decay))
                opt.step()
                opt.zero_grad()
                with torch.no_grad():
                    ema(torch.randn(5, 3))
                nw.step()
    except nanwatch.AnomalyError as e:
        return e
    return None


def test_weights_an_ema_update_wrote_are_checked_on_the_ema_root_not_on_model() -> None:
    assert _ema_run(fixed=True) is None  # the healthy twin raises nothing
    err = _ema_run(fixed=False)
    assert err is not None
    d = _first(err, "NW301")
    assert d.title == "Non-finite weights written outside an optimizer step"
    assert "Sequential#2" in d.path or "Sequential#2" in d.headline
    assert "model.named_parameters()" not in d.fix  # `model` is finite: it would catch nothing
    assert "module.named_parameters()" in d.fix
    assert "the watched Sequential#2" in d.fix
    code = code_lines(d.fix)
    compile(code, "<fix>", "exec")
    # pasted with `module` bound to the watched copy (the EMA), it catches the NaN weights
    torch.manual_seed(0)
    ema = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with torch.no_grad():
        ema[0].weight.fill_(float("nan"))  # type: ignore[index]
    with pytest.raises(AssertionError, match=r"0\.weight"):
        exec(code, {"torch": torch, "module": ema})


# ------------------------------ 2: warmup + cosine with total == warmup: 0/0 in the cosine

_BASE_LR = 1e-2
_WARMUP = np.int64(2)
_TOTAL = np.int64(2)  # "fine-tune for the warmup only": the cosine phase has 0 steps


def _schedule(optimizer: torch.optim.Optimizer, step: int) -> float:
    if step < _WARMUP:
        lr = _BASE_LR * step / _WARMUP
    else:
        progress = (step - _WARMUP) / (_TOTAL - _WARMUP)
        lr = 0.5 * _BASE_LR * (1.0 + math.cos(math.pi * float(progress)))
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def test_a_cosine_phase_of_zero_steps_is_named_at_its_division() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=_BASE_LR)
    err = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's 0/0
        try:
            with nanwatch.watch(model, mode="watch") as nw:
                for step in range(4):
                    _schedule(opt, step)
                    model(torch.randn(5, 3)).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()
                    nw.step()
        except nanwatch.AnomalyError as e:
            err = e
    assert err is not None
    d = _first(err, "NW301")
    assert d.title == "Non-finite learning rate"
    said = "\n".join(d.evidence)
    assert "in _schedule" in said and "_TOTAL - _WARMUP" in said
    assert "which is 0" in said and "_TOTAL = 2" in said and "_WARMUP = 2" in said
    assert "progress = (step - _WARMUP) / max(1, _TOTAL - _WARMUP)" in d.fix
    assert "step / max(1, warmup_steps)" not in d.fix  # the warmup is not what broke
    code = code_lines(d.fix)
    compile(code, "<fix>", "exec")
    # the fixed line gives a finite progress where the old one gave NaN
    ns = {"step": _TOTAL, "_WARMUP": _WARMUP, "_TOTAL": _TOTAL}
    exec(code.splitlines()[0], ns)
    assert math.isfinite(float(ns["progress"]))  # type: ignore[arg-type]
