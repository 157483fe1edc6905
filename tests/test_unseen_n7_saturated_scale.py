"""A Gaussian (mixture density) head whose scale is built as ``F.elu(raw) + 1`` or
``torch.tanh(raw) + 1``: positive in exact arithmetic, but the function rounds to exactly -1
once ``raw`` is far enough below 0 (a bias driven down), and the +1 cancels it: the scale is
0 everywhere and ``(y - mu) / sigma`` divides by it. The division by zero says so, with the
bound from the dtype's eps and the measured pre-activation, not "a tensor never filled"; its
fix, a softplus with a floor, trains clean."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

torch.set_num_threads(1)

_EPS = torch.finfo(torch.float32).eps
#: below these, elu(x) and tanh(x) are exactly -1 in float32
BOUNDS = {"elu": math.log(_EPS / 4), "tanh": 0.5 * math.log(_EPS / 8)}


class GaussianHead(nn.Module):
    def __init__(self, scale: Callable[[torch.Tensor], torch.Tensor], bias: float) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(1, 32), nn.Tanh())
        self.mu = nn.Linear(32, 4)
        self.sig = nn.Linear(32, 4)
        self.scale = scale
        with torch.no_grad():
            self.sig.bias.fill_(bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.mu(h), self.scale(self.sig(h))


def _train(model: nn.Module, mode: str, steps: int = 2) -> nanwatch.Watcher:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(steps):
            y = torch.rand(64, 1, generator=gen) * 2 - 1
            x = y + 0.1 * torch.randn(64, 1, generator=gen)
            mu, sigma = model(x)
            nll = 0.5 * ((y - mu) / sigma) ** 2 + torch.log(sigma)
            nll.mean().backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


SCALES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "elu": lambda r: F.elu(r) + 1,
    "tanh": lambda r: torch.tanh(r) + 1,
}


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
@pytest.mark.parametrize("fn", ["elu", "tanh"])
def test_a_scale_made_as_f_plus_one_that_rounded_to_zero_says_so(fn: str, mode: str) -> None:
    torch.manual_seed(0)
    bound = BOUNDS[fn]
    nw = _train(GaussianHead(SCALES[fn], bias=bound - 3), mode)
    d = nw.report.diagnoses[0]
    assert (d.code, d.op, d.title) == (
        "NW111",
        "aten.div",
        f"Division by zero: {fn}(x) + 1 rounded to 0",
    )
    said = " ".join(d.evidence)
    assert f"the denominator is {fn}(x) + 1 (made by add <- {fn} <- addmm" in said, said
    assert f"{fn}(x) is exactly -1 in float32 for every x below {bound:.2f}" in said, said
    if mode == "watch":  # the pre-activation is measured: sig's output
        assert "x is sig (forward, output): at most" in said, said
    assert "never filled" not in d.explanation.replace("not a tensor never filled", "")
    assert d.fix.startswith(f"scale = F.softplus(x) + 1e-3   # was {fn}(x) + 1"), d.fix

    # the fix, in this model's names: the same pre-activation, a positive scale
    torch.manual_seed(0)
    model = GaussianHead(lambda r: F.softplus(r) + 1e-3, bias=bound - 3)
    nw = _train(model, mode, steps=5)
    assert not nw.report.diagnoses, [x.headline for x in nw.report.diagnoses]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_scale_that_did_not_round_to_zero_is_not_told() -> None:
    torch.manual_seed(0)
    nw = _train(GaussianHead(SCALES["elu"], bias=0.0), "watch", steps=3)
    assert not nw.report.diagnoses, [x.headline for x in nw.report.diagnoses]
