"""Fixes that were wrong when pasted, from user testing: an eps floor in a 16-bit float is
above many legitimate values (an int8 quantization scale of small weights), and the fix
says so with the dtype's limits; an exp in loss code whose log of a cumulative sum the
loss graph shows gets logcumsumexp, not a clamp that changes the loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch


def fake_quant(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().max() / 127
    q = (w / scale).round().clamp(-128, 127)
    return (w / scale + (q - w / scale).detach()) * scale


class QLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, fake_quant(self.weight), self.bias)


def _fix(dtype: torch.dtype) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(QLinear(8, 16), nn.ReLU(), QLinear(16, 3)).to(dtype)
    with torch.no_grad():
        model[2].weight.zero_()  # a zero-initialized projection: scale = 0, 0/0
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        x = torch.randn(4, 8, dtype=dtype)
        F.cross_entropy(model(x).float(), torch.tensor([0, 1, 2, 0])).backward()
        nw.step()
    d = next(d for d in nw.history[-1].diagnoses if d.code == "NW111")
    assert d.fix is not None
    return d.fix


@pytest.mark.parametrize(
    ("dtype", "name", "eps"),
    [(torch.float16, "float16", "0.000977"), (torch.bfloat16, "bfloat16", "0.007812")],
)
def test_an_eps_floor_in_a_16_bit_float_names_its_size_and_the_tiny_floor(
    dtype: torch.dtype, name: str, eps: str
) -> None:
    fix = _fix(dtype)
    assert fix.startswith("scale = (w.abs().max() / 127).clamp_min(torch.finfo(w.dtype).eps)")
    assert f"in {name} eps is {eps}: a legitimate scale below it is raised to it" in fix
    assert "torch.finfo(...).tiny" in fix and "compute scale in float32" in fix


def test_an_eps_floor_in_float32_says_nothing_more() -> None:
    fix = _fix(torch.float32)
    assert "clamp_min(torch.finfo(w.dtype).eps)" in fix
    assert "is raised to it" not in fix


def test_watch_mode_cox_loss_gets_logcumsumexp_from_the_loss_graph() -> None:
    # the exp runs in loss code, whose line watch mode does not know: the loss graph
    # (log <- cumsum <- exp) says what the clamp would break
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.fill_(30.0)
    x = torch.ones(6, 4)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        risk = model(x).squeeze(-1)
        loss = -(risk - torch.log(torch.cumsum(torch.exp(risk), 0))).mean()
        loss.backward()
        nw.step()
    d = next(d for d in nw.history[-1].diagnoses if d.code == "NW101")
    assert d.fix is not None
    assert d.fix.startswith("y = torch.logcumsumexp(x, dim)"), d.fix
    assert "clamp(max=" not in d.fix
