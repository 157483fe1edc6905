"""Found by user testing: an overflow the watch mode localizes to a child module's op
(GroupNorm squaring activations of 1e21 inside a block whose forward goes on through
F.silu) is judged on that op's inputs, not on what the next layer received, and gets
NW101 as forensic mode does; an exp that overflowed into a loss module's input (var =
torch.exp(logvar) into nn.GaussianNLLLoss) is NW101 with the clamp at the dtype's exp
bound in watch and sentinel mode too, where no op is traced; and the catch-all NW100
says where a value was born in words, not in the localizer's origin codes.

Each runs a tiny real model under ``nanwatch.watch`` on CPU, or the rules on built
records."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.rules.testing import TraceBuilder, diagnose, stat
from tests._diagnoses import text, top

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _reports(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)


# ------------------------- 1: an op of a child module, its output sent on by functional code


class _Mid(nn.Module):
    def __init__(self, silu: bool) -> None:
        super().__init__()
        self.silu = silu
        self.norm1 = nn.GroupNorm(8, 8)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        return self.conv1(F.silu(h) if self.silu else h) + x


class _Net(nn.Module):
    def __init__(self, silu: bool) -> None:
        super().__init__()
        self.down = nn.Conv2d(1, 8, 8)  # 8x8 -> 1x1: one value per group
        self.mid = _Mid(silu)
        self.out = nn.Conv2d(8, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mid(self.down(x)))


@pytest.mark.parametrize("mode", ["watch", "forensic"])
@pytest.mark.parametrize("silu", [True, False], ids=["silu-between", "direct"])
def test_groupnorm_of_exploded_activations_is_an_overflow_of_its_own_inputs(
    mode: str, silu: bool
) -> None:
    torch.manual_seed(0)
    net = _Net(silu)
    with torch.no_grad():
        net.down.weight.mul_(1e21)  # activations ~1e21: x*x passes float32's max
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(net, mode=mode) as nw:
        net(torch.randn(4, 1, 8, 8)).pow(2).mean().backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW101", text(d)
    assert d.path == "mid.norm1" and d.phase == "forward"
    t = text(d)
    sqrt_max = math.sqrt(torch.finfo(torch.float32).max)
    assert f"sqrt(3.4e+38) = {sqrt_max:.3g}" in t
    assert "the output of down" in t  # what the norm was given, not conv1's NaN input
    assert "NaN in float32" in t


def test_healthy_groupnorm_block_raises_nothing() -> None:
    torch.manual_seed(0)
    net = _Net(True)
    with nanwatch.watch(net) as nw:
        net(torch.randn(4, 1, 8, 8)).pow(2).mean().backward()
        nw.step()
    assert all(t.anomaly is None for t in nw.history)


# ---------------------------------- 2: exp overflowed into a loss module's input, untraced


class _DeepAR(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(1, 32, batch_first=True)
        self.mu = nn.Linear(32, 1)
        self.logvar = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o, _ = self.lstm(x)
        return self.mu(o), self.logvar(o)


def _gnll_run(mode: str, dtype: torch.dtype, bias: float) -> nanwatch.Watcher:
    torch.manual_seed(0)
    m = _DeepAR().to(dtype)
    crit = nn.GaussianNLLLoss()
    with torch.no_grad():
        m.logvar.bias.fill_(bias)
    x = torch.sin(torch.arange(21.0) / 5 + torch.rand(8, 1) * 6).unsqueeze(-1).to(dtype)
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(m, crit, mode=mode) as nw:
        mu, lv = m(x[:, :-1])
        crit(mu, x[:, 1:], torch.exp(lv)).backward()
    return nw


def _cap(dtype: torch.dtype) -> float:
    return math.floor(math.log(torch.finfo(dtype).max) / 2 * 10) / 10


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_exp_overflow_into_a_loss_module_is_nw101_without_op_tracing(mode: str) -> None:
    d = top(_gnll_run(mode, torch.float32, 90.0))
    assert d.code == "NW101", text(d)
    t = text(d)
    assert "ExpBackward0" in t and "88.72" in t
    first = d.fix.splitlines()[0]
    assert f"torch.exp(x.clamp(max={_cap(torch.float32)}))" in first  # 44.3
    assert "GaussianNLLLoss (input[2])" in first  # which exp: the one feeding var
    assert "softplus" in d.fix
    assert "None of nanwatch's specific rules" not in t


def test_exp_overflow_bound_follows_the_dtype() -> None:
    d = top(_gnll_run("watch", torch.float64, 800.0))
    assert d.code == "NW101", text(d)
    bound = math.log(torch.finfo(torch.float64).max)
    assert f"passed {bound:.4g}, the float64 exp bound" in text(d)  # 709.8, not 88.72
    assert f"clamp(max={_cap(torch.float64)})" in d.fix  # 354.8
    assert "88.72" not in text(d)


def test_exp_node_holding_nan_is_not_called_an_exp_overflow() -> None:
    """exp of finite values makes only +inf: a NaN under ExpBackward0 is something else."""
    b = TraceBuilder()
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0))
    out = b.forward(net, stat(-3.0, 3.0), grad_fn="AddBackward0")
    loss = b.call("GaussianNLLLoss", root=True, is_loss=True)
    b.input(
        loss, stat(math.nan, math.nan, nan=16), role="input[2]", source=out, grad_fn="ExpBackward0"
    )
    ds = diagnose(b.build())
    assert ds and ds[0].code != "NW101"


# ---------------------------------------------- 3: the catch-all's words for where it was born


def test_catch_all_says_where_in_words_not_origin_codes() -> None:
    b = TraceBuilder()
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0))
    out = b.forward(net, stat(-3.0, 3.0), grad_fn="AddBackward0")
    loss = b.call("MyLoss", root=True, is_loss=True)
    b.input(
        loss,
        stat(math.nan, math.nan, nan=16),
        role="input[1]",
        source=out,
        grad_fn="MysteryBackward0",
    )
    trace = b.build()
    assert trace.anomaly is not None and trace.anomaly.origin == "between-roots"
    d = diagnose(trace)[0]
    assert d.code == "NW100"
    assert "origin" not in d.explanation and "between-roots" not in d.explanation
    assert "outside the watched modules" in d.explanation
    assert "MyLoss (input[1])" in d.explanation
