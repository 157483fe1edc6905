"""Domain diagnoses found by user testing, second round: a negative power or rsqrt of exact
zeros (a graph node without edges, an all-zero padding row) is a pole, not a negative
base; a variance E[x²] - E[x]² that cancelled below 0 is rounding, not a negative
prediction; the gradient of entr at 0; and NW110's fix follows what the log was taken of
(p · log p, log(1 - p), a sigmoid, a softmax).

Each runs a tiny real model under ``nanwatch.watch`` on CPU (or hand-built records for a
threshold), and every fix line that claims to be code is executed."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import OpEvent, Phase
from nanwatch.rules.testing import TraceBuilder, diagnose
from tests._diagnoses import counted, text, top

NAN = math.nan


def watch(*modules: nn.Module, **kw: Any) -> Any:
    return nanwatch.watch(*modules, on_anomaly="record", postmortem=False, **kw)


def code(line: str) -> str:
    """A fix line without its trailing comment."""
    return line.split("  #", 1)[0].strip()


# ---------------------------------------------------------------- a negative power of 0


class NormAdj(nn.Module):
    """D^-1/2 A D^-1/2 of a directed graph: a node without incoming edges has degree 0."""

    def forward(self, ei: torch.Tensor, n: int) -> torch.Tensor:
        deg = torch.zeros(n).scatter_add_(0, ei[1], torch.ones(ei.shape[1]))
        dinv = deg.pow(-0.5)
        vals = dinv[ei[0]] * dinv[ei[1]]
        return torch.zeros(n, n).index_put((ei[0], ei[1]), vals, accumulate=True)


class GCN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = NormAdj()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, ei: torch.Tensor) -> torch.Tensor:
        return self.norm(ei, x.shape[0]) @ self.lin(x)


def test_a_negative_power_of_a_zero_degree_is_a_pole_and_the_fix_keeps_the_count() -> None:
    """It said 'x ** -0.5 is not a real number for negative x' (the degrees' minimum is 0)
    and its fix y = x.sign() * x.abs() ** -0.5 is still inf at 0."""
    torch.manual_seed(0)
    m = GCN()
    ei = torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 0]])
    ei[1, 4] = 1  # node 0 now has no incoming edge: degree 0
    with watch(m) as nw:
        F.cross_entropy(m(torch.randn(5, 4), ei), torch.randint(0, 3, (5,))).backward()
        nw.step()
    d = top(nw)
    assert (d.code, d.op, d.path) == ("NW112", "aten.pow.Tensor_Scalar", "norm")
    assert d.evidence[0].endswith(
        "with exponent -0.5 of 0 is inf (0 ** -0.5 = 1 / 0 ** 0.5): its input holds "
        "1 exact zero of 5 values and nothing below 0"
    )
    assert "negative x" not in d.explanation and "sign()" not in d.fix
    assert d.explanation.startswith("x ** -0.5 = 1 / x ** 0.5 is inf at x = 0")
    lines = d.fix.splitlines()
    assert code(lines[0]) == "dinv = deg.clamp_min(1).pow(-0.5)"
    assert code(lines[1]) == "dinv = dinv.masked_fill(deg == 0, 0)"
    assert code(lines[2]) == "dinv = (deg + 1e-6).pow(-0.5)"
    deg = torch.tensor([0.0, 1.0, 4.0])
    ns: dict[str, Any] = {"torch": torch, "deg": deg}
    exec(code(lines[0]) + "\n" + code(lines[1]), ns)
    assert ns["dinv"].tolist() == [0.0, 1.0, 0.5]
    exec(code(lines[2]), ns)
    assert torch.isfinite(ns["dinv"]).all()


def test_a_negative_power_written_with_the_operator_rewrites_its_base() -> None:
    ev = OpEvent(
        "aten.pow.Tensor_Scalar",
        Phase.FORWARD,
        "norm",
        "+inf",
        counted(0.5, math.inf, posinf=1, numel=4),
        [("self", counted(0.0, 4.0, zeros=1, numel=4))],
        scalars={"exponent": -1.0},
        source="gnn.py:7",
        code="w = lengths[:, None] ** -1.0  # per-bag mean",
        dtype="float32",
    )
    d = _diagnose_event(ev)
    assert d.code == "NW112"
    lines = [code(ln) for ln in d.fix.splitlines()]
    assert lines == [
        "w = lengths[:, None].clamp_min(1) ** -1.0",
        "w = w.masked_fill(lengths[:, None] == 0, 0)",
        "w = (lengths[:, None] + 1e-6) ** -1.0",
    ]
    ns: dict[str, Any] = {"lengths": torch.tensor([0.0, 2.0])}
    exec("\n".join(lines[:2]), ns)
    assert ns["w"].flatten().tolist() == [0.0, 0.5]


def _diagnose_event(ev: OpEvent) -> Any:
    b = TraceBuilder(1)
    net = b.call("Net", root=True)
    b.input(net, counted(-1.0, 1.0))
    call = b.call(ev.path or "block", parent=net)
    b.input(call, counted(-1.0, 1.0))
    b.forward(call, counted(NAN, NAN, nan=4, numel=4))
    t = b.build()
    assert t.anomaly is not None
    t.anomaly.op = ev
    return diagnose(t)[0]


# ---------------------------------------------------------------- rsqrt of exact zeros


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))
        self.eps = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ms = x.pow(2).mean(-1, keepdim=True)
        return self.w * (x * torch.rsqrt(ms + self.eps))


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8, padding_idx=0)
        self.norm = RMSNorm(8)
        self.out = nn.Linear(8, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.emb(ids)))


def test_rsqrt_of_an_all_zero_padding_row_is_a_pole_not_a_rounding_error() -> None:
    """It said 'not a real number for negative x ... slightly negative from rounding' and
    its first fix was torch.sqrt(v.clamp_min(0) + 1e-12)."""
    torch.manual_seed(0)
    m = Tagger()
    ids = torch.randint(1, 10, (2, 5))
    ids[1, 3:] = 0  # padding
    with watch(m) as nw:
        F.cross_entropy(m(ids).reshape(-1, 10), ids.reshape(-1)).backward()
        nw.step()
    d = top(nw)
    assert (d.code, d.op, d.path) == ("NW112", "aten.rsqrt", "norm")
    assert d.evidence[0] == (
        "aten.rsqrt of 0 is inf (rsqrt(0) = 1 / sqrt(0)): its input holds 2 exact zeros of "
        "10 values and nothing below 0"
    )
    assert d.explanation.startswith("rsqrt(x) = 1 / sqrt(x) is inf at x = 0")
    assert "rounding" not in text(d) and "negative x" not in text(d)
    first = code(d.fix.splitlines()[0])
    assert first == "return self.w * (x * torch.rsqrt(ms + self.eps + 1e-6))"
    assert d.fix.splitlines()[1].startswith("# or give self.eps a value above 0")
    src = "def forward(self, x):\n    ms = x.pow(2).mean(-1, keepdim=True)\n    " + first
    ns: dict[str, Any] = {"torch": torch}
    exec(src, ns)
    fixed = m.norm
    y = ns["forward"](fixed, torch.zeros(3, 8, requires_grad=True))
    assert torch.isfinite(y).all()


# ---------------------------------------------------------------- E[x²] - E[x]² cancellation


class HandLayerNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(d))
        self.eps = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mu * mu
        return self.g * (x - mu) / torch.sqrt(var + self.eps)


def test_a_variance_that_cancelled_below_zero_is_rounding_not_a_negative_prediction() -> None:
    """var = E[x²] - E[x]² of a row near 3000 is -1, one float32 step of x² ~ 9e6; it said
    'far below 0: not rounding ... a raw network output' and fixed it with softplus."""
    torch.manual_seed(0)
    m = nn.Sequential(HandLayerNorm(16), nn.Linear(16, 1))
    x = torch.randn(4, 16)
    x[2] = 3000.0 + 1e-2 * torch.randn(16, generator=torch.Generator().manual_seed(0))
    var = (x[2] * x[2]).mean() - x[2].mean() ** 2
    assert var.item() < 0  # the cancellation this test is about
    with watch(m) as nw:
        F.mse_loss(m(x), torch.zeros(4, 1)).backward()
        nw.step()
    d = top(nw)
    assert (d.code, d.op, d.path) == ("NW112", "aten.sqrt", "0")
    assert "not rounding" not in d.evidence[0]
    # seen op by op: the subtraction that made var (+ eps) had operands near 3000² = 9e6
    assert "float32 rounding step of the subtraction that made it" in d.evidence[0]
    assert "operands reach 9e+06" in d.evidence[0] and "cancellation" in d.evidence[0]
    assert "E[x²] - E[x]²" in d.explanation and "raw network output" not in d.explanation
    assert "softplus" not in d.fix
    lines = d.fix.splitlines()
    assert code(lines[0]) == "var = x.var(-1, keepdim=True, correction=0)"
    assert code(lines[1]) == "var = ((x - x.mean(-1, keepdim=True)) ** 2).mean(-1, keepdim=True)"
    assert code(lines[3]) == "return self.g * (x - mu) / torch.sqrt(var + self.eps + 1e-5)"
    ns: dict[str, Any] = {"torch": torch, "F": F, "x": x}
    for ln in lines[:3]:
        exec(code(ln), ns)
        assert torch.isfinite(ns["var"]).all() and (ns["var"] >= 0).all(), ln
    assert torch.isfinite(ns["y"]).all()


def _sqrt_in_module(module_max: float, sqrt_min: float) -> Any:
    ev = OpEvent(
        "aten.sqrt.default",
        Phase.FORWARD,
        "ln",
        "NaN",
        counted(NAN, NAN, nan=1, numel=4),
        [("self", counted(sqrt_min, 2.0, numel=4))],
        source="m.py:9",
        code="s = torch.sqrt(v)",
        dtype="float32",
    )
    b = TraceBuilder(1)
    net = b.call("Net", root=True)
    x = b.input(net, counted(-1.0, module_max))
    ln = b.call("ln", parent=net)
    b.input(ln, source=x)
    b.forward(ln, counted(NAN, NAN, nan=4, numel=4))
    t = b.build()
    assert t.anomaly is not None
    t.anomaly.op = ev
    return diagnose(t)[0]


def test_cancellation_is_bounded_by_the_rounding_steps_of_the_modules_squares() -> None:
    # eps · 1000² = 0.119: -1 is 8 steps (cancellation), -5 is 42 (a negative value)
    near = _sqrt_in_module(1000.0, -1.0)
    assert "8 float32 rounding steps of the squares" in near.evidence[0]
    assert code(near.fix.splitlines()[0]) == "v = x.var(-1, keepdim=True, correction=0)"
    far = _sqrt_in_module(1000.0, -5.0)
    assert far.evidence[0].endswith("its input's minimum is -5, far below 0: not rounding")
    assert "var(" not in far.fix


# ---------------------------------------------------------------- entr's gradient at 0


class Assign(nn.Module):
    """Soft assignment by normalized ReLU scores: exact zeros are common."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.relu(self.lin(x))
        return s / (s.sum(-1, keepdim=True) + 1e-6)


def test_the_gradient_of_entr_at_zero_is_named_and_its_fix_is_finite() -> None:
    """It was 'Log of zero' with the log_softmax/logsigmoid/BCE fixes."""
    torch.manual_seed(0)
    m = Assign()
    x = torch.randn(16, 8)
    with watch(m) as nw:
        p = m(x)
        assert (p == 0).any()
        torch.special.entr(p).sum(-1).mean().backward()
        nw.step()
    d = top(nw)
    assert (d.code, d.title, d.op) == ("NW110", "Gradient of entr at 0", "aten.special_entr")
    assert "-(log(x) + 1): +inf where x is 0" in d.evidence[0]
    assert "logsigmoid" not in d.fix and "binary_cross_entropy" not in d.fix
    first = code(d.fix.splitlines()[0])
    assert first == "ent = torch.special.entr(p.clamp_min(torch.finfo(p.dtype).tiny)).sum(-1)"
    m.zero_grad()
    ns: dict[str, Any] = {"torch": torch, "p": m(x)}
    exec(first, ns)
    ns["ent"].mean().backward()
    assert m.lin.weight.grad is not None and torch.isfinite(m.lin.weight.grad).all()


# ---------------------------------------------------------------- NW110: what the log is of


class HandBCE(nn.Module):
    def forward(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(z)
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


def test_a_hand_written_bce_leads_with_the_logits_loss_not_log_softmax() -> None:
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    with torch.no_grad():
        m.bias.fill_(40.0)  # sigmoid rounds to 1.0: 1 - p = 0
    crit = HandBCE()
    y = torch.tensor([[1.0], [0.0], [1.0]])
    with watch(m, crit) as nw:
        crit(m(torch.randn(3, 4)), y).backward()
        nw.step()
    d = top(nw)
    assert (d.code, d.op) == ("NW110", "aten.log")
    assert "log_softmax" not in d.fix
    assert "the log is of 1 - p: -inf where p is exactly 1 (with log(p) beside it" in text(d)
    lines = d.fix.splitlines()
    assert code(lines[0]) == "loss = F.binary_cross_entropy_with_logits(logits, y)"
    assert code(lines[1]) == "log_1mp = F.logsigmoid(-logits)"
    logits = m(torch.randn(3, 4))
    ns: dict[str, Any] = {"torch": torch, "F": F, "logits": logits, "y": y}
    exec(code(lines[0]) + "\n" + code(lines[1]), ns)
    assert torch.isfinite(ns["loss"]) and torch.isfinite(ns["log_1mp"]).all()
    body = code(lines[2])
    assert body.startswith("return -(y * torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))")
    src = f"def loss(p, y):\n    {body}"
    exec(src, ns)
    assert torch.isfinite(ns["loss"](torch.tensor([[1.0], [0.0]]), torch.tensor([[0.0], [1.0]])))


class Entropy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(self.enc(x) * 200, -1)
        ent = -(p * torch.log(p)).sum(-1)
        return ent


def test_an_entropy_p_log_p_is_fixed_with_xlogy_on_the_users_line() -> None:
    torch.manual_seed(0)
    m = Entropy()
    with watch(m) as nw:
        m(torch.randn(4, 8)).mean().backward()
        nw.step()
    d = top(nw)
    assert (d.code, d.op) == ("NW110", "aten.log")
    assert "the line multiplies p by its own log" in text(d)
    first = code(d.fix.splitlines()[0])
    assert first == (
        "ent = -(torch.special.xlogy(p, p.clamp_min(torch.finfo(p.dtype).tiny))).sum(-1)"
    )
    assert "log_softmax(logits" in d.fix.splitlines()[2]  # only as the softmax alternative
    m.zero_grad()
    ns: dict[str, Any] = {"torch": torch, "p": torch.softmax(m.enc(torch.randn(4, 8)) * 200, -1)}
    assert (ns["p"] == 0).any()
    exec(first, ns)
    ns["ent"].mean().backward()
    assert torch.isfinite(ns["ent"]).all()
    assert m.enc.weight.grad is not None and torch.isfinite(m.enc.weight.grad).all()


class ProbLoss(nn.Module):
    """A loss given probabilities: -log p of the target."""

    def forward(self, p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logp = torch.log(p)
        return -(logp * y).mean()


def test_a_log_of_a_sigmoid_made_upstream_leads_with_logsigmoid() -> None:
    """The loss module's input was made by a sigmoid (its autograd node): logsigmoid and
    the logits' BCE come first, not log_softmax."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 2), nn.Sigmoid())
    with torch.no_grad():
        m[0].bias.fill_(-120.0)  # sigmoid underflows to 0
    crit = ProbLoss()
    with watch(m, crit) as nw:
        crit(m(torch.randn(3, 4)), torch.tensor([[1.0, 0.0]] * 3)).backward()
        nw.step()
    d = top(nw)
    assert (d.code, d.op) == ("NW110", "aten.log")
    assert code(d.fix.splitlines()[0]) == "logp = F.logsigmoid(logits)"
    assert "log_softmax" not in d.fix


def test_a_log_of_a_softmax_on_the_line_becomes_log_softmax() -> None:
    ev = OpEvent(
        "aten.log.default",
        Phase.FORWARD,
        "head",
        "-inf",
        counted(-math.inf, 0.0, neginf=2, numel=8),
        [("self", counted(0.0, 1.0, zeros=2, numel=8))],
        source="m.py:4",
        code="logp = torch.log(torch.softmax(h / t, dim=-1))",
        dtype="float32",
    )
    d = _diagnose_event(ev)
    assert d.code == "NW110"
    first = code(d.fix.splitlines()[0])
    assert first == "logp = F.log_softmax(h / t, dim=-1)"
    ev.code = "lq = torch.log(1 - torch.sigmoid(z))"
    d = _diagnose_event(ev)
    assert code(d.fix.splitlines()[0]) == "lq = F.logsigmoid(-z)"
