"""Hand-written float16 norms whose statistic overflows (NW115), told from the autograd graph
below the module's output, not from its class: LLaMA's RMSNorm written by hand
(``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)``), a LayerNorm that multiplies by
``(var + eps).rsqrt()``, an L2 normalization by hand (``x / x.norm(...)``, ``x *
x.pow(2).sum(...).rsqrt()``): in the rows whose squares (or norm) pass finfo(float16).max the
statistic is inf and the row silently becomes 0. The forms that take the statistic in
float32 and cast it back (``x.float().pow(2).mean(-1).add(eps).rsqrt().to(x.dtype)``, Hugging
Face's LlamaRMSNorm) are safe and stay silent, a float16 division by such a statistic too."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch import _graph
from nanwatch.records import StepTrace
from nanwatch.rules.overflow import _statistics
from nanwatch.rules.testing import TraceBuilder, diagnose, stat

# ---------------------------------------------------------------- the norms, as users write them


class HandRMSNorm(nn.Module):
    """LLaMA's RMSNorm as the paper's code writes it, in the input's dtype."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class MulLayerNorm(nn.Module):
    """A LayerNorm that multiplies by the reciprocal standard deviation."""

    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) * (var + self.eps).rsqrt() * self.w


class VarLayerNorm(nn.Module):
    """A LayerNorm through torch.var, whose float16 result is inf past 65504."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5)


class NormL2(nn.Module):
    """An L2 normalization by hand: torch's norm of float16 values is float16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True)


class RsqrtL2(nn.Module):
    """An L2 normalization by hand through the sum of squares."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x.pow(2).sum(-1, keepdim=True).rsqrt()


class CastRMSNorm(HandRMSNorm):
    """The statistic in float32, cast back: the multiply is float16, the squares are not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = x.float().pow(2).mean(-1, keepdim=True).add(self.eps).rsqrt().to(x.dtype)
        return self.weight * (x * r)


class LlamaRMSNorm(HandRMSNorm):
    """transformers' LlamaRMSNorm.forward, verbatim."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return self.weight * hidden_states.to(input_dtype)


class CastDivNorm(nn.Module):
    """A float16 division by a root mean square taken in float32 and cast back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.float().pow(2).mean(-1, keepdim=True).add(1e-6).sqrt().to(x.dtype)


class Net(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 64)
        self.norm = norm
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc(x)))


class Retriever(nn.Module):
    """Wide features, L2-normalized, scored: a row of 1024 values of a few thousand has an
    L2 norm past 65504."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 1024)
        self.norm = norm
        self.head = nn.Linear(1024, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc(x)))


class Block(nn.Module):
    """Two pre-norm residual layers, as a LLaMA decoder stacks them: each norm reads the
    residual stream the parent's code adds up."""

    def __init__(self, norm: Callable[[int], nn.Module], d: int = 64) -> None:
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.norm1, self.mix = norm(d), nn.Linear(d, d)
        self.norm2, self.mlp = norm(d), nn.Linear(d, d)
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.mix(self.norm1(h))
        h = h + self.mlp(self.norm2(h))
        return self.head(h)


#: each form that squares in float16: (its maker, the model around it, the kind of statistic)
MISSES: dict[str, tuple[Callable[[], nn.Module], type[nn.Module], str]] = {
    "rms-by-hand": (lambda: HandRMSNorm(64), Net, "a mean square"),
    "layernorm-times-rsqrt": (lambda: MulLayerNorm(64), Net, "a variance"),
    "layernorm-by-var": (VarLayerNorm, Net, "a variance"),
    "x-over-norm": (NormL2, Retriever, "an L2 norm"),
    "x-times-rsqrt-sum": (RsqrtL2, Net, "a sum of squares"),
}
SAFE: dict[str, tuple[Callable[[], nn.Module], type[nn.Module]]] = {
    "float32-rsqrt-cast-back": (lambda: CastRMSNorm(64), Net),
    "hf-llama-rmsnorm": (lambda: LlamaRMSNorm(64), Net),
    "division-by-float32-rms": (CastDivNorm, Net),
}


def _batch(model: type[nn.Module]) -> torch.Tensor:
    """Four rows of ordinary size, four far larger: for Net, a thousand times (the squares
    of fc's outputs pass 65504); for Retriever, five thousand times (the L2 norms of fc's
    1024 outputs pass 65504)."""
    big = 5000.0 if model is Retriever else 1000.0
    return (torch.randn(8, 16) * torch.tensor([1.0] * 4 + [big] * 4)[:, None]).half()


def _run(model: nn.Module, x: torch.Tensor, steps: int = 2) -> list[nanwatch.Diagnosis]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for _ in range(steps):
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return [d for t in nw.history for d in t.diagnoses]


# ------------------------------------------------------- what happens, and what the graph shows


def _digest(
    make: Callable[[], nn.Module], model: type[nn.Module]
) -> tuple[list[dict[str, Any]], torch.Tensor]:
    torch.manual_seed(0)
    net = model(make()).half()
    x = _batch(model)
    y = net.norm(net.fc(x))
    nodes = _graph.digest(y.grad_fn, "float16")
    assert nodes, y.grad_fn
    return nodes, y


@pytest.mark.parametrize("form", list(MISSES))
def test_each_hand_written_norm_zeroes_its_wide_rows_and_squares_in_float16(form: str) -> None:
    make, model, _ = MISSES[form]
    nodes, y = _digest(make, model)
    # the failure itself: the large rows are exact 0s, the others are not, nothing is inf
    assert bool((y[4:] == 0).all()) and bool((y[:4] != 0).any(-1).all())
    assert bool(torch.isfinite(y).all())
    found = [s for s in _statistics(nodes) if s.dtype == "float16"]
    assert found, nodes


@pytest.mark.parametrize("form", list(SAFE))
def test_each_safe_form_keeps_its_rows_and_takes_no_float16_statistic(form: str) -> None:
    make, model = SAFE[form]
    nodes, y = _digest(make, model)
    assert bool((y != 0).any(-1).all())  # no row zeroed
    assert not [s for s in _statistics(nodes) if s.dtype == "float16"]


def test_a_digest_is_plain_data_and_stops_at_another_modules_output() -> None:
    torch.manual_seed(0)
    net = Net(HandRMSNorm(64)).half()
    h = net.fc(_batch(Net))
    y = net.norm(h)
    nodes = _graph.digest(y.grad_fn, "float16", stop=lambda n: n is h.grad_fn)
    assert nodes is not None
    ops = [n["op"] for n in nodes]
    assert ops[0] == "MulBackward0" and "AddmmBackward0" in ops
    fc_node = nodes[ops.index("AddmmBackward0")]
    assert fc_node["next"] == []  # fc's own graph is fc's
    assert not any(n["op"] == "TBackward0" for n in nodes)
    pow_node = nodes[ops.index("PowBackward0")]
    assert pow_node["dtype"] == "float16" and pow_node["exponent"] == 2.0
    assert _graph.digest(h.grad_fn, "float16") is None  # a matmul: no product to digest
    assert _graph.digest(y.grad_fn, "float32") is None  # not of the dtype asked
    assert _graph.digest((h * 2).grad_fn, "float16") == []  # a product, no statistic


# ------------------------------------------------------------- the rule, on records and a graph


def _trace(
    nodes: list[dict[str, Any]], out: tuple[float, float], src: tuple[float, float], grad_fn: str
) -> StepTrace:
    """Net's step as the watcher records it, with the graph note of norm's output."""
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-2290.0, 2750.0, numel=128), dtype="float16", shape=(8, 16))
    fc = b.call("fc", "Linear", parent=net)
    b.input(fc, source=x, dtype="float16", shape=(8, 16))
    shape = (8, 64)
    h = b.forward(fc, stat(*src, numel=512), dtype="float16", shape=shape, grad_fn="AddmmBackward0")
    norm = b.call("norm", "Norm", parent=net)
    b.input(norm, source=h, dtype="float16", shape=shape)
    o = b.forward(norm, stat(*out, numel=512), dtype="float16", shape=shape, grad_fn=grad_fn)
    b.note("graph", "norm", record=o.index, nodes=nodes)
    b.forward(net, source=o, dtype="float16", shape=shape)
    b.backward(o, stat(-0.04, 0.04, numel=512))
    b.backward(h, stat(-0.07, 0.09, numel=512))
    b.gradient("fc", "fc.weight", 1.9, dtype="float16")
    return b.build(loss=0.48, grad_norm=2.0)


def _nw115_for(make: Callable[[], nn.Module]) -> list[nanwatch.Diagnosis]:
    nodes, y = _digest(make, Net)
    out = (float(y.detach().min()), float(y.detach().max()))
    return [
        d
        for d in diagnose(_trace(nodes, out, (-2204.0, 2012.0), nodes[0]["op"]))
        if d.code == "NW115"
    ]


@pytest.mark.parametrize("form", [f for f in MISSES if MISSES[f][1] is Net])
def test_the_rule_reads_the_graph_note_of_a_multiplying_or_dividing_norm(form: str) -> None:
    make, _, what = MISSES[form]
    found = _nw115_for(make)
    assert found
    d = found[0]
    assert d.path == "norm"
    assert f"a statistic of its input taken in float16: {what}," in d.evidence[0]
    assert d.fix.startswith("# compute the statistic in float32 and cast the result back")
    assert "model.norm" in d.fix


@pytest.mark.parametrize("form", [f for f in SAFE if SAFE[f][1] is Net])
def test_the_rule_stays_silent_where_the_graph_shows_a_float32_statistic(form: str) -> None:
    assert not _nw115_for(SAFE[form][0])


def test_the_messages_of_an_rms_norm_by_hand() -> None:
    d = _nw115_for(lambda: HandRMSNorm(64))[0]
    assert d.evidence[0] == (
        "norm (forward, output) was multiplied in float16 by a statistic of its input taken "
        "in float16: a mean square, x.pow(2).mean() (autograd graph: MulBackward0 <- "
        "MulBackward0 <- RsqrtBackward0 <- AddBackward0 <- MeanBackward1 <- PowBackward0; "
        "the squares (PowBackward0) are float16)"
    )
    assert d.evidence[1] == (
        "its input (fc (forward, output)) reaches |x| = 2204: past 255.9, x ** 2 passes 65504 "
        "(torch.finfo(torch.float16).max), and the mean of that row's squares is inf"
    )
    assert "(x * rsqrt(inf) = x * 0 = 0)" in d.explanation
    assert d.fix.splitlines()[1:3] == [
        "x32 = x.float()   # in the forward of model.norm",
        "y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)",
    ]


def test_an_input_whose_squares_fit_stays_silent() -> None:
    nodes, y = _digest(lambda: HandRMSNorm(64), Net)
    t = _trace(
        nodes, (float(y.detach().min()), float(y.detach().max())), (-250.0, 240.0), "MulBackward0"
    )
    assert "NW115" not in {d.code for d in diagnose(t)}


# ------------------------------------------------------------------------- watch mode, whole


@pytest.mark.parametrize("form", list(MISSES))
def test_watch_mode_says_each_hand_written_float16_norm(form: str) -> None:
    make, model, what = MISSES[form]
    torch.manual_seed(0)
    ds = _run(model(make()).half(), _batch(model))
    found = [d for d in ds if d.code == "NW115"]
    assert found, [d.headline for d in ds]
    d = found[0]
    assert d.path == "norm" and d.severity == "warning"
    assert f"taken in float16: {what}," in d.evidence[0]
    assert d.fix.startswith("# compute the statistic in float32 and cast the result back")
    assert "in the forward of model.norm" in d.fix


@pytest.mark.parametrize("form", list(SAFE))
def test_watch_mode_stays_silent_for_a_statistic_taken_in_float32(form: str) -> None:
    make, model = SAFE[form]
    torch.manual_seed(0)
    codes = {d.code for d in _run(model(make()).half(), _batch(model), steps=4)}
    assert not {"NW105", "NW109", "NW115", "NW304"} & codes


@pytest.mark.parametrize("norm", [HandRMSNorm, LlamaRMSNorm], ids=["by-hand", "hf-llama"])
def test_the_norms_of_a_residual_stream(norm: Callable[[int], nn.Module]) -> None:
    torch.manual_seed(0)
    x = (torch.randn(8, 16) * torch.tensor([1.0] * 4 + [300.0] * 4)[:, None]).half()
    ds = _run(Block(norm).half(), x, steps=1)
    found = [d for d in ds if d.code == "NW115"]
    if norm is LlamaRMSNorm:  # its statistic is float32: silent
        assert not found, [d.headline for d in ds]
        return
    assert found, [d.headline for d in ds]
    d = found[0]
    assert d.path == "norm1"
    assert "also: norm2" in d.evidence
    assert "in the forward of model.norm1" in d.fix
