"""Speech front-ends: a sinc filter written as sin(2 pi f t) / (pi t) over taps that include
t = 0 is 0/0 there; its limit is 2 f, which torch.sinc computes. The fix said before (a
where that divides by 1 at the zeros) put 0 at the centre tap, silently breaking the filter."""

from __future__ import annotations

import ast
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.rules.domain import _sinc_fix


class SincConv(nn.Module):
    def __init__(self, use_sinc: bool = False, n: int = 8, k: int = 33, sr: int = 16000) -> None:
        super().__init__()
        self.use_sinc = use_sinc
        self.low = nn.Parameter(torch.linspace(50, 4000, n) / sr)
        self.band = nn.Parameter(torch.full((n,), 200.0 / sr))
        self.register_buffer("t", torch.arange(-(k // 2), k // 2 + 1).float())
        self.register_buffer("win", torch.hamming_window(k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f1 = self.low.abs()[:, None]
        f2 = f1 + self.band.abs()[:, None]
        if self.use_sinc:
            lp2 = 2 * f2 * torch.sinc(2 * f2 * self.t)
            lp1 = 2 * f1 * torch.sinc(2 * f1 * self.t)
        else:
            lp2 = torch.sin(2 * math.pi * f2 * self.t) / (math.pi * self.t)
            lp1 = torch.sin(2 * math.pi * f1 * self.t) / (math.pi * self.t)
        filt = (lp2 - lp1) * self.win
        return F.conv1d(x, filt[:, None, :], padding=16)


class SincNet(nn.Module):
    def __init__(self, use_sinc: bool = False) -> None:
        super().__init__()
        self.sinc = SincConv(use_sinc)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.sinc(x.unsqueeze(1))).mean(-1))


def _train(model: nn.Module, mode: str) -> nanwatch.Watcher:
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:  # type: ignore[arg-type]
        for _ in range(2):
            loss = F.cross_entropy(model(torch.randn(2, 400)), torch.randint(0, 4, (2,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_a_sinc_filter_at_its_centre_tap_is_fixed_with_torch_sinc(mode: str) -> None:
    torch.manual_seed(0)
    nw = _train(SincNet(), mode)
    d = next(d for d in nw.report.diagnoses if d.code == "NW111")
    line = d.fix.splitlines()[0].split("   #")[0].strip()
    assert line == "lp2 = 2 * f2 * torch.sinc(2 * f2 * self.t)"
    assert "torch.where" not in d.fix and "clamp" not in d.fix
    # what it computes: the old line off the centre, its limit 2 f at t = 0, a finite gradient
    f2 = torch.tensor([[0.01], [0.2]], requires_grad=True)
    ns = {"torch": torch, "f2": f2, "self": SincConv()}
    exec(line, ns)
    t = ns["self"].t
    old = torch.sin(2 * math.pi * f2 * t) / (math.pi * t)
    off = t != 0
    assert torch.allclose(ns["lp2"][:, off], old[:, off], atol=1e-6)
    assert torch.allclose(ns["lp2"][:, ~off].flatten(), 2 * f2.detach().flatten())
    ns["lp2"].sum().backward()
    assert f2.grad is not None and bool(torch.isfinite(f2.grad).all())


def test_the_sinc_filter_written_with_torch_sinc_trains_clean() -> None:
    nw = _train(SincNet(use_sinc=True), "forensic")
    assert not nw.report.diagnoses


def _fix(line: str) -> str | None:
    div = next(
        n
        for n in ast.walk(ast.parse(line))
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)
    )
    found = _sinc_fix(line, div)
    return None if found is None else found.split("   #")[0]


def test_sinc_shapes_and_lines_that_are_no_sinc() -> None:
    assert _fix("y = torch.sin(x) / x") == "y = torch.sinc(x / torch.pi)"
    assert _fix("y = (w * x).sin() / x") == "y = w * torch.sinc((w * x) / torch.pi)"
    assert _fix("h = torch.sin(torch.pi * a * t) / (torch.pi * t)") == "h = a * torch.sinc(a * t)"
    # a denominator with a factor the sine's argument lacks, or a constant one: no sinc
    assert _fix("y = torch.sin(x) / y") is None
    assert _fix("y = torch.sin(2 * x) / (x * n)") is None
    assert _fix("y = torch.sin(math.pi * x) / math.pi") is None
    assert _fix("y = torch.cos(x) / x") is None
