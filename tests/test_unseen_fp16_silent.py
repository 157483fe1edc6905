"""A float16 overflow that leaves no NaN: a hand-written LayerNorm whose (x - mean) ** 2
passes finfo(float16).max makes its variance inf, and x / inf = 0 silently zeroes the
layer's output. Watch mode says so from its records (NW109): an output of exact zeros
from an input too wide to square in float16. Forensic mode names the op
(NW105). Healthy float16 models stay silent."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch


class HandLayerNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return self.g * (x - mu) / torch.sqrt(var + self.eps)


class Net(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 64)
        self.norm = norm
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc(x)))


def _run(model: nn.Module, x: torch.Tensor, mode: str = "watch") -> list[nanwatch.Diagnosis]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return [d for t in nw.history for d in t.diagnoses]


def test_watch_mode_says_a_float16_variance_overflow_zeroed_the_norm() -> None:
    torch.manual_seed(0)
    model = Net(HandLayerNorm(64)).half()
    x = (torch.randn(8, 16) * 1000).half()
    ds = _run(model, x)
    found = [d for d in ds if d.code == "NW109"]
    assert found, [d.headline for d in ds]
    d = found[0]
    assert d.path == "norm"
    text = " ".join(d.evidence)
    assert "norm (forward, output): all 512 values are exactly 0 in float16" in text
    assert "past 65504 (torch.finfo(torch.float16).max; a square overflows when |x| > 255.9)" in (
        text
    )
    assert "the gradient that reached fc's output through it is all 0 too" in text
    assert "x32 = x.float()" in d.fix
    assert "model.norm.float()" in d.fix


class ReluNet(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.fc(x))))


def test_a_norm_after_a_relu_is_said_too() -> None:
    # its input is >= 0: a ReLU keeps positive values, so the zeros are the norm's own
    torch.manual_seed(0)
    model = ReluNet(HandLayerNorm(64)).half()
    x = (torch.randn(8, 16) * 1000).half()
    found = [d for d in _run(model, x) if d.code == "NW109"]
    assert found and found[0].path == "norm"
    assert "spans 0 to " in " ".join(found[0].evidence)


def test_forensic_mode_names_the_op_and_not_twice() -> None:
    torch.manual_seed(0)
    model = Net(HandLayerNorm(64)).half()
    x = (torch.randn(8, 16) * 1000).half()
    codes = [d.code for d in _run(model, x, mode="forensic")]
    assert "NW105" in codes and "NW109" not in codes


@pytest.mark.parametrize("norm", ["hand", "nn"])
def test_healthy_float16_layer_norms_stay_silent(norm: str) -> None:
    torch.manual_seed(0)
    model = Net(HandLayerNorm(64) if norm == "hand" else nn.LayerNorm(64)).half()
    assert [d.code for d in _run(model, torch.randn(8, 16).half())] == []


def test_float16_nn_layer_norm_on_wide_inputs_is_not_zeroed() -> None:
    # nn.LayerNorm accumulates in float32: the same wide inputs give a normalized output
    torch.manual_seed(0)
    model = Net(nn.LayerNorm(64)).half()
    x = (torch.randn(8, 16) * 1000).half()
    assert "NW109" not in [d.code for d in _run(model, x)]


class Gate(nn.Module):
    """A zero-initialized residual gate (ReZero): all-zero output at first, by design."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.alpha * x


def test_a_zero_initialized_gate_on_wide_inputs_is_not_an_overflow() -> None:
    torch.manual_seed(0)
    model = Net(Gate()).half()
    x = (torch.randn(8, 16) * 1000).half()
    assert "NW109" not in [d.code for d in _run(model, x)]


def test_a_dead_relu_on_wide_negative_inputs_is_not_an_overflow() -> None:
    torch.manual_seed(0)
    model = Net(nn.ReLU()).half()
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.bias.copy_(torch.linspace(-3000.0, -10.0, 64))
    x = torch.randn(8, 16).half()
    assert "NW109" not in [d.code for d in _run(model, x)]
