"""NW105 on an exp whose inf fed nothing; NW101's pre-scaled product only where the code
scales the product; NW101 on a float16 overflow of raw input features."""

from __future__ import annotations

import ast
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.rules.base import Diagnosis

# ------------------------------------------ 1: an exp's inf that nothing used (forensic)


def _nw105(loss_fn: Any, *, backward: bool) -> list[Diagnosis]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x = torch.randn(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, mode="forensic") as nw:
            loss = loss_fn(model(x))
            if backward:
                loss.backward()
            nw.step()
    return [d for t in nw.history for d in t.diagnoses if d.code == "NW105"]


def _unused(out: torch.Tensor) -> torch.Tensor:
    log_lam = out[:, 0] * 0 + 95.0  # exp(95) is past float32's max
    lam = torch.exp(log_lam)  # computed, never used: a branch not taken
    del lam
    return out.pow(2).mean()


def _absorbed(out: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        e = torch.exp(out * 0 + 95.0)
    return (out / e).sum() + out.pow(2).mean()  # x / inf = 0: silently wrong


def test_an_exp_whose_inf_reached_nothing_is_no_hidden_overflow() -> None:
    assert _nw105(_unused, backward=True) == []


def test_a_float32_hidden_exp_overflow_bounds_the_argument_not_an_upcast() -> None:
    ds = _nw105(_absorbed, backward=True)
    assert ds, "no NW105"
    fix = ds[0].fix
    assert ".float()" not in fix and "bfloat16" not in fix
    assert "clamp(max=44.3)" in fix.splitlines()[0]
    ast.parse(fix.splitlines()[0])


# ----------------------------------- 2: an int8 GEMM emulated in float16: no attention fix


class IntLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qx = torch.round(x * 127 / x.detach().abs().amax()).clamp(-127, 127)
        qw = torch.round(self.weight * 127 / self.weight.detach().abs().amax())
        acc = qx.half() @ qw.half().t()
        return acc.float() + self.bias


class Scores(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        s = q @ q.transpose(-1, -2)
        s = s / 8.0
        return s.softmax(-1)


def _nw101(model: nn.Module, x: torch.Tensor) -> Diagnosis:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
            model(x).float().sum().backward()
            nw.step()
    ds = [d for t in nw.history for d in t.diagnoses if d.code == "NW101"]
    assert ds, "no NW101"
    return ds[0]


def test_an_integer_gemm_in_float16_is_computed_in_float32_not_prescaled() -> None:
    torch.manual_seed(0)
    model = IntLinear(256, 8)
    x = torch.rand(4, 256)
    d = _nw101(model, x)
    assert "** -0.5" not in d.fix and "sqrt(d)" not in d.fix
    first = next(ln.strip() for ln in d.fix.splitlines() if ln.strip().startswith("acc = "))
    first = first.split("  # was:", 1)[0]
    assert ".float()" in first
    assert "bfloat16 holds integers exactly only up to 256" in d.fix
    qx = torch.round(x * 127 / x.abs().amax()).clamp(-127, 127)
    qw = torch.round(model.weight.detach() * 127 / model.weight.detach().abs().amax())
    ns: dict[str, Any] = {"qx": qx, "qw": qw}
    exec(first, ns)
    torch.testing.assert_close(ns["acc"], qx @ qw.t())


def test_prescaling_moves_a_later_lines_factor_before_the_product() -> None:
    torch.manual_seed(0)
    model = Scores().half()
    x = torch.randn(2, 8, 64).half() * 100
    d = _nw101(model, x)
    lines = d.fix.splitlines()
    assert lines[0].startswith("s = (q / 8.0) @ q.transpose(-1, -2)")
    assert "delete line" in lines[1] and "s = s / 8.0" in lines[1]
    with torch.no_grad():
        q = model.q(x)
        ns: dict[str, Any] = {"q": q}
        exec(lines[0].split("  # was:", 1)[0], ns)
        want = (q.float() @ q.float().transpose(-1, -2)) / 8.0
    assert bool(torch.isfinite(ns["s"]).all())
    torch.testing.assert_close(ns["s"].float(), want, rtol=2e-2, atol=4.0)


# ------------------------------------ 3: raw input features past float16 under autocast


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 8) / 8**0.5)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x[..., None] * self.weight
        return self.attn(t, t, t)[0].sum(1)


@pytest.mark.parametrize("raw", [True, False])
def test_raw_input_features_are_scaled_not_clamped(raw: bool) -> None:
    torch.manual_seed(0)
    model = Tokens()
    x = torch.rand(4, 3) * (2e6 if raw else 1.0)
    if not raw:
        with torch.no_grad():
            model.weight.mul_(1e6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            out.float().sum().backward()
            nw.step()
    ds = [d for t in nw.history for d in t.diagnoses if d.code == "NW101"]
    assert ds, "no NW101"
    if raw:
        assert "scale the input features" in ds[0].fix and "(x - mean) / std" in ds[0].fix
        assert "clamp(fin.min" not in ds[0].fix
        assert any("holds raw values up to 1.67e+06" in e for e in ds[0].evidence)
    else:  # values made large inside (weights): not the input's scale
        assert "scale the input features" not in ds[0].fix
