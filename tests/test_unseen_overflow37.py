"""Overflow stories found by user testing: a contrastive loss's exps of a similarity over a
small temperature overflow in every dtype (a float32 cast is no fix, the log-space loss
is), and a backward product overflowed by a gradient the loss code scaled by hand is not
blamed on the layer's inputs or initial weights."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import OpEvent, Phase, StepTrace
from nanwatch.rules.testing import TraceBuilder, diagnose, stat
from tests._diagnoses import text

torch.set_num_threads(1)

INF = math.inf
NAN = math.nan


# ------------------------------ 1: InfoNCE by hand, sim / tau with tau small


class _Enc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.net(x), dim=-1)


def _info_nce(dtype: torch.dtype | None, mode: str) -> nanwatch.Diagnosis:
    torch.manual_seed(0)
    m = _Enc()
    x = torch.randn(16, 12)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    with nanwatch.watch(m, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                z1, z2 = m(x), m(x + 0.01 * torch.randn_like(x))
                sim = z1 @ z2.t() / 0.01  # cosines over a temperature: up to 100
                e = torch.exp(sim)
                loss = -torch.log(e.diagonal() / e.sum(-1)).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    ds = nw.report.diagnoses
    assert ds, "no diagnosis"
    return ds[0]


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, None], ids=["bfloat16", "float32"])
def test_infonce_exp_past_float32s_bound_is_told_as_logits_over_a_temperature(
    dtype: torch.dtype | None, mode: str
) -> None:
    d = _info_nce(dtype, mode)
    assert d.code == "NW101"
    assert d.op == "aten.exp"
    t = text(d)
    # not a story of values that exploded, fixed by a clamp that changes the loss
    assert "the values themselves exploded" not in t
    assert "clamp(max=" not in d.fix
    assert "the graph below the exp: div <- mm" in t
    assert "a float32 exp overflows as well" in t
    assert "F.cross_entropy(logits, labels)" in d.fix
    assert "torch.arange(len(logits)" in d.fix  # the log's numerator picks the diagonal
    assert "torch.logsumexp(logits, dim=-1) - logits.diagonal()" in d.fix


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_infonce_float16_exp_is_not_fixed_by_a_float32_cast(mode: str) -> None:
    d = _info_nce(torch.float16, mode)
    assert d.code == "NW101"
    t = text(d)
    assert "e = x.float().exp()" not in d.fix
    assert "F.cross_entropy(logits, labels)" in d.fix
    # float16 made inf above 11.09: how far past it the argument went is not known
    assert "how far past 11.09 its argument went is not known" in t
    assert "float32's exp fits up to 88.72 only" in d.fix


# ------------------------------ 2: a backward matmul of a gradient scaled by hand


def _backward_addmm(*, at_model: float, at_layer: float, path: str = "fc") -> StepTrace:
    """A Linear's weight gradient overflowed in backward (the replay's event: its forward
    operands up to 40 and 0.001), in Linear ``path``; the gradients recorded at the model's
    output (``fc``'s) and at ``body``'s output are ``at_model`` and ``at_layer``."""
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-40.0, 40.0, numel=32), shape=(4, 8))
    body = b.call("body", "Linear", parent=net)
    b.input(body, source=x, shape=(4, 8))
    h = b.forward(body, stat(-40.0, 40.0, numel=32), shape=(4, 8), grad_fn="AddmmBackward0")
    fc = b.call("fc", "Linear", parent=net)
    b.input(fc, source=h, shape=(4, 8))
    out = b.forward(fc, stat(-0.16, 0.16), shape=(4, 4), grad_fn="AddmmBackward0")
    b.forward(net, source=out, shape=(4, 4))
    loss = b.call("(loss)", "functional", is_loss=True)
    b.forward(loss, stat(6.4e36, 6.4e36, numel=1), shape=(), grad_fn="MulBackward0")
    b.backward(out, stat(at_model, at_model))
    b.backward(h, stat(-at_layer, at_layer, numel=32))
    b.gradient(path, f"{path}.weight", INF, s=stat(-INF, INF, numel=32, posinf=24, neginf=8))
    t = b.build()
    assert t.anomaly is not None
    t.anomaly.op = OpEvent(
        op="aten.addmm.default",
        phase=Phase.BACKWARD,
        path=path,
        born="+inf, -inf",
        output=stat(-INF, INF, numel=32, posinf=24, neginf=8),
        inputs=[("mat1", stat(-40.0, 40.0, numel=32)), ("mat2", stat(0.001, 0.001, numel=32))],
        node="AddmmBackward0",
        dtype="float32",
    )
    return t


def _nw101(t: StepTrace) -> nanwatch.Diagnosis:
    d = next((d for d in diagnose(t) if d.code == "NW101"), None)
    assert d is not None, [x.code for x in diagnose(t)]
    return d


def test_backward_matmul_of_a_gradient_the_loss_scaled_names_the_gradient() -> None:
    d = _nw101(_backward_addmm(at_model=1e37, at_layer=1e37))
    t = text(d)
    assert d.phase == "backward"
    assert "the gradient arriving at fc's output is up to |g| = 1e+37" in t
    assert "the gradient of the model's output (Net) is already up to |g| = 1e+37" in t
    assert "the loss code scaled it (the loss is 6.4e+36), a manual loss scale" in t
    # the forward values are not the cause
    assert "their products, summed over the inner dimension" not in t
    assert "the initial weights or the inputs put it there" not in t
    assert "nn.LayerNorm" not in d.fix
    assert d.fix.startswith("loss.backward()")
    assert "torch.amp.GradScaler()" in d.fix


def test_backward_matmul_of_a_gradient_grown_in_backward_says_where_it_grew() -> None:
    d = _nw101(_backward_addmm(at_model=1.0, at_layer=1e37, path="body"))
    t = text(d)
    assert "the gradient arriving at body's output is up to |g| = 1e+37" in t
    assert "the gradient grew in backward: up to |g| = 1 at the model's output" in t
    assert "the loss code scaled it" not in t
    assert "the initial weights or the inputs put it there" not in t


def _loss_code_exp(top: float, *, scale: str = "div") -> StepTrace:
    """Float16 loss code: an exp of ``scale`` <- mm of the model's outputs, measured up to
    ``top`` (a replay kept its input), whose ratio the loss takes the log of."""
    b = TraceBuilder(0)
    net = b.call("Enc", root=True)
    b.input(net, stat(-2.0, 2.0, numel=192), shape=(16, 12))
    b.forward(net, stat(-0.7, 0.7, numel=256), dtype="float16", shape=(16, 16))
    loss = b.call("(loss)", "functional", is_loss=True)
    b.forward(loss, stat(NAN, NAN, numel=1), dtype="float16", shape=(), grad_fn="NegBackward0")
    b.note(
        "loss_graph",
        "(loss)",
        ops=["neg", "mean", "log", "div", "sum", "diagonal", "exp", scale, "mm", "t"],
        logs=[["div", "diagonal", "exp", scale]],
    )
    t = b.build()
    assert t.anomaly is not None
    t.anomaly.op = OpEvent(
        op="aten.exp.default",
        phase=Phase.FORWARD,
        path="(loss)",
        born="+inf",
        output=stat(250.0, INF, numel=256, posinf=200, finite_amax=3888.0),
        inputs=[("self", stat(5.5, top, numel=256))],
        dtype="float16",
        made_from=[scale, "mm", "watched:div"],
    )
    return t


def test_a_measured_argument_below_float32s_bound_is_not_said_to_overflow_float32() -> None:
    d = _nw101(_loss_code_exp(30.0, scale="mul"))
    t = text(d)
    assert "its argument reached 30: a float32 exp fits it" in t
    assert "a float32 exp overflows as well" not in t
    assert d.fix.startswith("logits = sim * scale")
    assert "float32's exp fits up to 88.72 only" in d.fix
    assert "F.cross_entropy(logits, labels)" in d.fix


def test_a_measured_argument_past_float32s_bound_in_float16() -> None:
    d = _nw101(_loss_code_exp(100.0))
    t = text(d)
    assert "its argument passed 88.72" in t
    assert "e = x.float().exp()" not in d.fix
    assert "float32's exp overflows above 88.72 too" in d.fix
