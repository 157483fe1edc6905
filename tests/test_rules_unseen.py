"""Diagnoses for failures found by user testing: NaN made of two infinities (a fully masked
segment of a softmax written by hand; an op given infinities of unknown origin), a traced
sigmoid before NLLLoss, a log inside PoissonNLLLoss(log_input=False), fixes that must run
when pasted (a 1-D input, sparse gradients), and exp-overflow evidence that quotes the
argument that overflowed.

Each is checked on a tiny real model under ``nanwatch.watch`` on CPU or on hand-built
records, and every fix that claims to be code is executed."""

from __future__ import annotations

import contextlib
import io
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import OpEvent, Phase, StepTrace
from nanwatch.rules._evidence import (
    classify,
    inf_arithmetic,
    replace_neg_inf,
    rewrite_subtrahend,
)
from nanwatch.rules.base import Diagnosis
from nanwatch.rules.testing import TraceBuilder, diagnose, stat
from tests._diagnoses import counted, text, top

NAN, INF = math.nan, math.inf


# ---------------------------------------------------------------- NaN from two infinities


class SegSoftmax(nn.Module):
    """A softmax over graph segments written by hand: max per destination node, exp(e - max)."""

    def forward(self, e: torch.Tensor, dst: torch.Tensor, n: int) -> torch.Tensor:
        m = torch.full((n,), float("-inf")).scatter_reduce(0, dst, e, "amax")
        return torch.exp(e - m[dst])


class TwoModules(nn.Module):
    """The -inf mask is applied in the parent; the subtraction runs in the child."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(4, 1)
        self.soft = SegSoftmax()

    def forward(self, x: torch.Tensor, dst: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        e = self.score(x).squeeze(1).masked_fill(~keep, float("-inf"))
        return self.soft(e, dst, 3)


class GraphAttention(nn.Module):
    """GAT-style: mask, segment max, exp, normalize, all in one module."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, dst: torch.Tensor, edge_mask: torch.Tensor) -> torch.Tensor:
        e = self.lin(x).sum(1)
        e = e.masked_fill(~edge_mask, float("-inf"))
        m = torch.full((3,), float("-inf")).scatter_reduce(0, dst, e, "amax")
        p = torch.exp(e - m[dst])
        den = torch.zeros(3).index_add(0, dst, p)
        return p / den[dst]


DST = torch.tensor([0, 0, 1, 1, 2, 2])
KEEP = torch.tensor([True, True, True, True, False, False])  # node 2 has no edge left


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(
            "watch",
            marks=pytest.mark.cpu_path(
                reason="read late, the root's replay traces the parent's masked_fill, "
                "which the CPU path words as code nanwatch did not trace"
            ),
        ),
        "forensic",
    ],
)
def test_a_fully_masked_segment_in_a_child_module_is_not_a_log_of_zero(mode: str) -> None:
    """It was NW110 'Log of zero' with log_softmax fixes, and said 'the op that made the
    -inf was not traced' even in forensic mode, where the masked_fill was traced."""
    torch.manual_seed(0)
    net = TwoModules()
    with nanwatch.watch(net, mode=mode, on_anomaly="record", postmortem=False) as nw:
        net(torch.randn(6, 4), DST, KEEP).sum().backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW402" and d.title.startswith("Fully masked row or segment")
    assert d.op == "aten.sub.Tensor"
    assert "computed -inf - (-inf) = NaN" in d.evidence[0]
    assert "log_softmax" not in d.fix and "was not traced" not in text(d)
    assert "from finite inputs" not in text(d)
    assert "aten.full(fill_value=-inf) at " in text(d)  # the segment max starts at -inf
    # the fix skips empty segments on the user's own line
    assert "torch.exp(e - m[dst].clamp_min(torch.finfo(torch.float32).min))" in d.fix
    if mode == "forensic":
        assert "came from aten.masked_fill.Scalar(value=-inf)" in text(d)
        first = d.fix.splitlines()[0]
        assert "masked_fill(~keep, torch.finfo(torch.float32).min)" in first
    else:  # the mask ran in the parent, untraced: say where the -inf came in
        assert "a -inf first appeared in soft (input, input[0])" in text(d)
        assert 'mode="forensic" names it' in text(d)


def test_a_gat_segment_softmax_gets_the_mask_fix_on_its_own_line_and_it_works() -> None:
    """It was NW100 'aten.sub.Tensor made NaN in float32 from finite inputs' while its own
    evidence showed both inputs holding -inf."""
    torch.manual_seed(0)
    layer = GraphAttention()
    x = torch.randn(6, 4)
    with nanwatch.watch(layer, on_anomaly="record", postmortem=False) as nw:
        layer(x, DST, KEEP).sum().backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW402" and "from finite inputs" not in text(d)
    assert "input self holds 2 -inf; input other holds 2 -inf" in d.evidence[0]
    first = d.fix.splitlines()[0]
    assert first.startswith("e = e.masked_fill(~edge_mask, torch.finfo(torch.float32).min)"), first
    # the pasted line, run in the layer's place, leaves the empty segment finite
    ns: dict[str, Any] = {"torch": torch, "edge_mask": KEEP}
    with torch.no_grad():
        ns["e"] = layer.lin(x).sum(1)
        exec(first, ns)
        e = ns["e"]
        m = torch.full((3,), float("-inf")).scatter_reduce(0, DST, e, "amax")
        p = torch.exp(e - m[DST])
        out = p / torch.zeros(3).index_add(0, DST, p)[DST]
    assert torch.isfinite(out).all()


def sub_event(*, code: str | None = "y = x - m[idx]", **fields: Any) -> OpEvent:
    neg = counted(-INF, 1.0, neginf=2, numel=6)
    return OpEvent(
        "aten.sub.Tensor",
        Phase.FORWARD,
        "block",
        "NaN",
        counted(NAN, NAN, nan=2, numel=6),
        [("self", neg), ("other", neg)],
        source="model.py:9",
        code=code,
        dtype="float32",
        **fields,
    )


def module_anomaly(event: OpEvent, *extra: OpEvent) -> StepTrace:
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-1.0, 1.0))
    blk = b.call("block", "Block", parent=net)
    b.input(blk, source=x)
    b.forward(blk, counted(NAN, NAN, nan=2))
    for e in (*extra, event):
        b.op(e)
    t = b.build()
    assert t.anomaly is not None
    t.anomaly.op = event
    return t


def test_nan_from_two_infinities_of_unknown_origin_is_named_not_from_finite_inputs() -> None:
    t = module_anomaly(sub_event())
    d = diagnose(t)[0]
    assert d.code == "NW100"
    assert d.title == "NaN from arithmetic on infinities: -inf - (-inf)"
    assert "from finite inputs" not in text(d)
    assert "aten.sub.Tensor computed -inf - (-inf) = NaN" in d.evidence[1]
    assert "masked_fill" in d.explanation and "log of 0 (NW110)" in d.explanation
    assert 'mode="forensic"' in d.fix


def test_a_constant_minus_inf_times_zero_is_named_with_the_mask_line_rewritten() -> None:
    fill = OpEvent(
        "aten.masked_fill.Scalar",
        Phase.FORWARD,
        "block",
        "-inf",
        counted(-INF, 1.0, neginf=2, numel=6),
        [("self", counted(-1.0, 1.0, numel=6))],
        scalars={"value": -INF},
        source="model.py:7",
        code="s = s.masked_fill(pad, -math.inf)",
        injected=True,
    )
    mul = OpEvent(
        "aten.mul.Tensor",
        Phase.FORWARD,
        "block",
        "NaN",
        counted(NAN, NAN, nan=2, numel=6),
        [("self", counted(-INF, 1.0, neginf=2, numel=6)), ("other", counted(0.0, 1.0, zeros=3))],
        source="model.py:8",
        code="y = s * w",
        cause=fill,
        dtype="float32",
    )
    d = diagnose(module_anomaly(mul, fill))[0]
    assert d.code == "NW100" and d.title.endswith("0 × -inf")
    assert "came from aten.masked_fill.Scalar(value=-inf) at model.py:7" in text(d)
    assert d.fix.splitlines()[0].startswith(
        "s = s.masked_fill(pad, torch.finfo(torch.float32).min)"
    )
    assert "log_softmax" not in d.fix  # it is a mask, not a log


def test_an_untraced_minus_inf_made_by_a_log_node_stays_nw110() -> None:
    """The -inf came into the module from a record whose autograd node is a log: NW110."""
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    x = b.input(net, stat(0.0, 1.0, zeros=1, counted=True))
    lp = b.call("logp", "LogProbs", parent=net)
    b.input(lp, source=x)
    out = b.forward(lp, counted(-INF, 0.0, neginf=2), grad_fn="LogBackward0")
    blk = b.call("block", "Block", parent=net)
    b.input(blk, source=out)
    b.forward(blk, counted(NAN, NAN, nan=2))
    ev = sub_event()
    b.op(ev)
    t = b.build()
    assert t.anomaly is not None and t.anomaly.neginf_source is not None
    t.anomaly.op = ev
    d = diagnose(t)[0]
    assert d.code == "NW110"
    assert "autograd node LogBackward0 made it: a log of 0" in d.evidence[0]
    assert "-inf - (-inf)" in d.evidence[1]


def test_catch_all_says_what_the_inputs_held() -> None:
    sin = OpEvent(
        "aten.sin.default",
        Phase.FORWARD,
        "block",
        "NaN",
        counted(NAN, NAN, nan=1),
        [("self", counted(0.0, INF, posinf=1))],
        source="model.py:3",
        code="y = torch.sin(x)",
        dtype="float32",
    )
    d = diagnose(module_anomaly(sin))[0]
    assert d.code == "NW100"
    assert "aten.sin made NaN in float32 from inputs holding +inf" in d.evidence
    assert "from finite inputs" not in text(d)


@pytest.mark.parametrize(
    ("op", "inputs", "want"),
    [
        ("aten.sub.Tensor", [(-INF, 1.0), (-INF, 2.0)], "-inf - (-inf)"),
        ("aten.sub.Tensor", [(0.0, INF), (0.0, INF)], "inf - inf"),
        ("aten.add.Tensor", [(-INF, 1.0), (0.0, INF)], "-inf + inf"),
        ("aten.mul.Tensor", [(-INF, 1.0), (0.0, 1.0)], "0 × -inf"),
        ("aten.div.Tensor", [(0.0, INF), (0.0, INF)], "inf / inf"),
        ("aten.div.Tensor", [(-INF, 0.0), (0.0, 1.0)], None),  # 0/0 beside it: NW111's
        ("aten.sin.default", [(0.0, INF)], None),  # outside sin's domain, not arithmetic
    ],
)
def test_inf_arithmetic_names_the_undefined_operation(
    op: str, inputs: list[tuple[float, float]], want: str | None
) -> None:
    ins = [
        (nm, counted(lo, hi, zeros=1 if lo == 0.0 else 0))
        for nm, (lo, hi) in zip(("self", "other"), inputs, strict=False)
    ]
    ev = OpEvent(op, Phase.FORWARD, "m", "NaN", counted(NAN, NAN), ins)
    assert inf_arithmetic(ev) == want
    assert (classify(ev) == "inf-arith") is (want is not None)


def test_code_rewrites_for_the_mask_fix() -> None:
    assert (
        replace_neg_inf("a = torch.where(k, a, -float('inf'))", "M") == "a = torch.where(k, a, M)"
    )
    assert replace_neg_inf("a = a.masked_fill(k, float('-Infinity'))", "M") == (
        "a = a.masked_fill(k, M)"
    )
    assert replace_neg_inf("a = a - 1", "M") is None
    wrap = lambda r: f"{r}.clamp_min(L)"  # noqa: E731
    assert (
        rewrite_subtrahend("p = (s - mx.values).exp()", wrap)
        == "p = (s - mx.values.clamp_min(L)).exp()"
    )
    assert rewrite_subtrahend("y = a - b - c", wrap) is None  # which one: do not guess


# ---------------------------------------------------------------- a sigmoid before NLLLoss


@pytest.mark.parametrize("act", ["functional", "module"])
def test_nll_loss_on_sigmoid_outputs_is_diagnosed(act: str) -> None:
    """relu/exp outputs got NW205, sigmoid outputs nothing: a traced activation was skipped
    as if NW203/NW204 (softmax only) would name it."""
    torch.manual_seed(0)
    lin = nn.Linear(6, 4)
    model: nn.Module = nn.Sequential(lin, nn.Sigmoid()) if act == "module" else lin
    crit = nn.NLLLoss()
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        out = model(torch.randn(8, 6))
        out = out if act == "module" else torch.sigmoid(out)
        crit(out, torch.randint(0, 4, (8,))).backward()
        nw.step()
    ds = [d for d in nw.history[0].diagnoses if d.code == "NW205"]
    assert ds, [d.code for d in nw.history[0].diagnoses]
    d = ds[0]
    assert (
        "sigmoid" in d.evidence[0].lower()
        and "log-probabilities are never above 0" in d.evidence[1]
    )
    assert "-p(target) instead of -log p" in d.explanation
    assert "F.cross_entropy(logits, target)" in d.fix


def test_cross_entropy_on_sigmoid_outputs_is_diagnosed_and_log_softmax_is_not() -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    codes = {}
    for act in ("sigmoid", "log_softmax"):
        crit = nn.CrossEntropyLoss() if act == "sigmoid" else nn.NLLLoss()
        f = torch.sigmoid if act == "sigmoid" else (lambda t: F.log_softmax(t, dim=1))
        with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
            crit(f(model(torch.randn(8, 6))), torch.randint(0, 4, (8,))).backward()
            nw.step()
        codes[act] = [d.code for d in nw.history[0].diagnoses]
    assert "NW205" in codes["sigmoid"]
    assert codes["log_softmax"] == []  # the right input for NLLLoss


# ---------------------------------------------------------------- PoissonNLLLoss(log_input=False)


@pytest.mark.parametrize(("how", "mode"), [("module", "watch"), ("functional", "forensic")])
def test_a_log_inside_poisson_nll_loss_is_explained_as_rates_with_its_fix(
    how: str, mode: str
) -> None:
    """It explained softmax underflow and led with F.log_softmax."""
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    crit = nn.PoissonNLLLoss(log_input=False)
    y = torch.poisson(torch.ones(8, 4))
    watched = (model, crit) if how == "module" else (model,)
    with nanwatch.watch(*watched, mode=mode, on_anomaly="record", postmortem=False) as nw:
        rate = model(torch.randn(8, 6))
        if how == "module":  # noqa: SIM108 (the fix rewrites the functional call's own line)
            loss = crit(rate, y)
        else:
            loss = F.poisson_nll_loss(rate, y, log_input=False)
        loss.backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW110" and d.op == "aten.log"
    assert "with log_input=False computes input - target · log(input + eps)" in d.evidence[0]
    assert "rates are below 0" in d.evidence[0]
    assert "softmax" not in d.explanation and "log_softmax" not in d.fix
    assert "log_input=True" in d.fix and "F.softplus(" in d.fix
    if how == "functional":  # the user's own line, rewritten both ways; both run
        lines = [ln.split("   #")[0] for ln in d.fix.splitlines()]
        assert lines == [
            "loss = F.poisson_nll_loss(rate, y, log_input=True)",
            "loss = F.poisson_nll_loss(F.softplus(rate), y, log_input=False)",
        ]
        for ln in lines:
            ns = {"F": F, "rate": rate.detach(), "y": y}
            exec(ln, ns)
            assert torch.isfinite(ns["loss"])


def test_a_log_of_zero_in_other_loss_code_keeps_the_log_softmax_fix() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        p = torch.softmax(model(torch.randn(6, 4)) * 1e4, dim=-1)
        (-(torch.log(p) * F.one_hot(torch.arange(6) % 3, 3))).sum().backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW110" and "F.log_softmax" in d.fix and "log_input" not in d.fix


# ---------------------------------------------------------------- fixes that run when pasted


@pytest.mark.parametrize("shape", [(4,), (4, 3), (2, 3, 2)])
def test_bad_input_fix_runs_on_the_inputs_number_of_dimensions(shape: tuple[int, ...]) -> None:
    """`.flatten(1)` raised IndexError on a 1-D input (edge weights)."""

    class EdgeWeighted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(1, 2)

        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return self.lin(w.reshape(-1, 1))

    model = EdgeWeighted()
    w = torch.rand(shape)
    w.view(-1)[2] = float("nan")
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(w).sum().backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW401"
    buf = io.StringIO()
    ns: dict[str, Any] = {"torch": torch, "w": w.clone()}  # the forward's name for it
    with contextlib.redirect_stdout(buf):
        exec(d.fix, ns)
    assert buf.getvalue().strip() in ("[2]", "[0]")  # the element, or the sample holding it
    assert torch.isfinite(ns["w"]).all()
    assert ("flatten(1)" in d.fix) is (len(shape) >= 2)


class TwoTower(nn.Module):
    def __init__(self, *, sparse: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 8, sparse=sparse)
        self.head = nn.Linear(1, 1)

    def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return self.head((self.emb(u) - self.emb(i)).pow(2).sum(-1, keepdim=True).sqrt())


def grads_fix(sparse: bool) -> tuple[Diagnosis, TwoTower]:
    torch.manual_seed(0)
    model = TwoTower(sparse=sparse)
    u = torch.randint(0, 30, (16,))
    i = torch.randint(0, 30, (16,))
    i[3] = u[3]  # a distance of 0: sqrt's gradient is inf, times 0 is NaN
    with nanwatch.watch(model, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
        # called twice in the step: sentinel cannot tell which call's backward to replay
        # (once, it names the sqrt), and the gradients' own diagnosis stands
        (model(u, i) + model(u, i)).sum().backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW302", d.headline
    return d, model


def test_the_skip_update_fix_runs_on_sparse_gradients() -> None:
    """`torch.isfinite(p.grad)` raised NotImplementedError on a sparse gradient."""
    d, model = grads_fix(sparse=True)
    skip = d.fix.split("# skip the update when it happens:\n", 1)[1]
    stepped: list[bool] = []
    ns: dict[str, Any] = {
        "torch": torch,
        "model": model,
        "optimizer": type("Opt", (), {"step": lambda self: stepped.append(True)})(),
    }
    exec(skip, ns)  # the gradient holds NaN: no step
    assert stepped == []
    model.zero_grad(set_to_none=True)
    model.emb(torch.tensor([1, 2])).sum().backward()
    assert model.emb.weight.grad is not None and model.emb.weight.grad.is_sparse
    exec(skip, ns)  # finite sparse gradient: the step runs
    assert stepped == [True]


def test_the_skip_update_fix_for_dense_gradients_is_unchanged() -> None:
    d, _ = grads_fix(sparse=False)
    assert (
        "if all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None):"
        in d.fix
    )
    assert "coalesce" not in d.fix


# ---------------------------------------------------------------- exp overflow evidence


def test_exp_overflow_evidence_quotes_the_largest_argument_not_the_largest_magnitude() -> None:
    """exp(-E) with E in [-1056, 1107]: the argument that overflowed is 1056; -1107 gives 0.
    The evidence said 'reached 1107 (e^1107 ≈ 1e480)'."""
    exp = OpEvent(
        "aten.exp.default",
        Phase.FORWARD,
        "block",
        "+inf",
        counted(0.0, INF, posinf=10, numel=64),
        [("self", counted(-1107.0, 1056.0, numel=64))],
        source="model.py:11",
        code="w = torch.exp(-E)",
        dtype="float64",
    )
    d = diagnose(module_anomaly(exp))[0]
    assert d.code == "NW101"
    line = next(e for e in d.evidence if "argument reached" in e)
    assert line.startswith("exp's argument reached 1056 (e^1056 ≈ 1e458)"), line
    assert "1107" not in line


def test_float32_fallback_fix_names_a_numbered_submodule_with_get_submodule() -> None:
    # `model.layers.1.mlp.float()` is a SyntaxError; get_submodule takes any path
    from nanwatch.rules.testing import TraceBuilder, diagnose, stat

    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0), dtype="float16")
    mlp = b.call("layers.1.mlp", "Linear", parent=net)
    b.forward(mlp, stat(-40000.0, 100.0), dtype="float16")
    b.forward(net, stat(-1.0, 1.0), dtype="float16")
    (d,) = [d for d in diagnose(b.build()) if d.code == "NW102"]
    assert "model.get_submodule('layers.1.mlp').float()" in d.fix
    for line in d.fix.splitlines():  # every line of the fix parses
        code = line.split("#")[0].strip()
        if code and not code.endswith(":"):
            compile(code, "<fix>", "exec")


def test_the_bad_data_fix_also_clears_infinities() -> None:
    from nanwatch.rules.data import _find_samples_fix

    for shape in [(), (5,), (4, 3)]:
        fix = _find_samples_fix(shape, rows_known=True)
        assert "posinf=0.0, neginf=0.0" in fix  # nan=0.0 alone leaves +inf as 3.4e38
