"""Localization is a pure function of a step's records: tested here without a model."""

from __future__ import annotations

import math

from nanwatch.localize import (
    first_trigger,
    inplace_suspects,
    is_trigger,
    localize,
    parse_inplace_error,
)
from nanwatch.records import AnomalyKind, Call, Phase, Record, StepTrace, TensorStat

NAN, INF = math.nan, math.inf


def _stat(lo: float, hi: float, n: int = 4) -> TensorStat:
    return TensorStat(lo, hi, n)


class _Builder:
    def __init__(self) -> None:
        self.trace = StepTrace(step=7)

    def call(self, path: str, parent: int | None = None, **kw: bool) -> Call:
        c = Call(
            id=len(self.trace.calls),
            path=path,
            module_type=path.title(),
            parent=parent,
            start=len(self.trace.records),
            **kw,
        )
        self.trace.calls.append(c)
        return c

    def rec(
        self,
        phase: Phase,
        call: Call,
        stat: TensorStat | None,
        *,
        role: str = "output",
        source: int | None = None,
        path: str | None = None,
    ) -> Record:
        r = Record(
            index=len(self.trace.records),
            step=7,
            phase=phase,
            path=path or call.path,
            role=role,
            dtype="float32",
            device="cpu",
            shape=(4,),
            stat=stat,
            call=call.id,
            source=source,
        )
        self.trace.records.append(r)
        return r


def test_a_clean_step_has_no_anomaly() -> None:
    b = _Builder()
    root = b.call("Net", root=True)
    b.rec(Phase.INPUT, root, _stat(-1, 1), role="input[0]")
    b.rec(Phase.FORWARD, root, _stat(-3, 3))
    assert localize(b.trace) is None


def test_minus_inf_alone_is_a_mask_not_an_anomaly() -> None:
    b = _Builder()
    root = b.call("Net", root=True)
    attn = b.call("attn", root.id)
    b.rec(Phase.INPUT, attn, _stat(-INF, 2), role="input[0]")
    b.rec(Phase.FORWARD, attn, _stat(0, 1))
    assert first_trigger(b.trace) is None
    assert localize(b.trace) is None


def test_minus_inf_out_of_a_linear_is_an_overflow_not_a_mask() -> None:
    b = _Builder()
    root = b.call("Net", root=True)
    b.rec(Phase.INPUT, root, _stat(-1, 1), role="input[0]")
    scores = b.call("scores", root.id)  # code that may write a mask: -inf is allowed
    b.rec(Phase.FORWARD, scores, _stat(-INF, 2))
    assert first_trigger(b.trace) is None
    lin = b.call("proj", root.id, arithmetic=True)
    bad = b.rec(Phase.FORWARD, lin, _stat(-INF, -INF))
    assert first_trigger(b.trace) is bad
    a = localize(b.trace)
    assert a is not None and (a.kind, a.path) == (AnomalyKind.FORWARD, "proj")
    assert a.summary.startswith("-inf born in the forward of proj")


def test_minus_inf_in_a_gradient_or_a_loss_is_an_anomaly() -> None:
    b = _Builder()
    root = b.call("Net", root=True)
    loss = b.rec(Phase.FORWARD, root, TensorStat(-INF, -INF, 1))
    assert is_trigger(loss, b.trace)
    grad = b.rec(Phase.BACKWARD, root, _stat(-INF, 0), source=loss.index)
    assert is_trigger(grad, b.trace)
    assert not is_trigger(grad, b.trace, scaled_grads=True)  # a GradScaler expects those


def test_a_nan_born_in_a_module_with_finite_inputs() -> None:
    b = _Builder()
    root = b.call("Net", root=True)
    b.rec(Phase.INPUT, root, _stat(-1, 1), role="input[0]")
    fc = b.call("fc", root.id)
    x = b.rec(Phase.INPUT, fc, None, role="input[0]", source=0)
    out = b.rec(Phase.FORWARD, fc, _stat(-2, 2))
    act = b.call("act", root.id)
    b.rec(Phase.INPUT, act, None, role="input[0]", source=out.index)
    bad = b.rec(Phase.FORWARD, act, _stat(NAN, NAN))
    head = b.call("head", root.id)
    b.rec(Phase.INPUT, head, None, role="input[0]", source=bad.index)
    b.rec(Phase.FORWARD, head, _stat(NAN, NAN))
    b.rec(Phase.FORWARD, root, _stat(NAN, NAN))
    a = localize(b.trace)
    assert a is not None
    assert (a.kind, a.path, a.origin, a.step) == (AnomalyKind.FORWARD, "act", "module", 7)
    assert a.record is bad
    assert a.propagators == ["head", "Net"] and a.propagator_count == 2
    assert x.stat is None


def test_a_nan_made_by_functional_code_between_children_blames_the_parent() -> None:
    b = _Builder()
    root = b.call("Net", root=True)
    block = b.call("block", root.id)
    fc = b.call("block.fc", block.id)
    b.rec(Phase.FORWARD, fc, _stat(-1, 1))
    out = b.call("block.out", block.id)
    b.rec(Phase.INPUT, out, _stat(NAN, NAN), role="input[0]")  # measured: no module made it
    a = localize(b.trace)
    assert a is not None
    assert (a.kind, a.path, a.origin) == (AnomalyKind.FORWARD, "block", "between-children")
    assert "forward code of block itself" in a.summary


def test_nan_grown_out_of_minus_inf_names_where_the_minus_inf_came_from() -> None:
    b = _Builder()
    root = b.call("Net", root=True)
    log = b.call("log", root.id)
    neg = b.rec(Phase.FORWARD, log, _stat(-INF, 0))
    mul = b.call("mul", root.id)
    b.rec(Phase.INPUT, mul, None, role="input[0]", source=neg.index)
    b.rec(Phase.FORWARD, mul, _stat(NAN, NAN))
    a = localize(b.trace)
    assert a is not None and a.path == "mul"
    assert a.neginf_source is neg
    assert "from -inf first seen in log" in a.summary


def test_a_backward_anomaly_blames_the_consumer_seen_through_passthroughs() -> None:
    b = _Builder()
    root = b.call("Net", root=True)
    enc = b.call("enc", root.id)
    e = b.rec(Phase.FORWARD, enc, _stat(-1, 1))
    relu = b.call("relu", root.id, passthrough=True)
    b.rec(Phase.INPUT, relu, None, role="input[0]", source=e.index)
    r = b.rec(Phase.FORWARD, relu, None, source=e.index)
    dist = b.call("dist", root.id)
    b.rec(Phase.INPUT, dist, None, role="input[0]", source=r.index)
    d = b.rec(Phase.FORWARD, dist, _stat(0, 2))
    b.rec(Phase.BACKWARD, dist, _stat(1, 1), source=d.index)
    bad = b.rec(Phase.BACKWARD, enc, _stat(NAN, NAN), source=e.index)
    a = localize(b.trace)
    assert a is not None
    assert (a.kind, a.path, a.consumer) == (AnomalyKind.BACKWARD, "dist", "dist")
    assert a.record is bad


def test_parameters_and_their_gradients() -> None:
    b = _Builder()
    root = b.call("Net", root=True)
    w = Record(
        index=-1,
        step=7,
        phase=Phase.PARAMETER,
        path="fc",
        role="fc.weight",
        dtype="float16",
        device="cpu",
        shape=(2, 2),
        stat=_stat(-INF, 3),
    )
    b.trace.records.append(w)
    b.rec(Phase.FORWARD, root, _stat(NAN, NAN))
    b.trace.records.sort(key=lambda r: r.index)
    a = localize(b.trace)
    assert a is not None
    assert (a.kind, a.parameter, a.path) == (AnomalyKind.PARAMETER, "fc.weight", "fc")
    assert "last update" in a.summary

    g = _Builder()
    groot = g.call("Net", root=True)
    g.rec(Phase.FORWARD, groot, _stat(0, 1))
    g.rec(Phase.GRADIENT, groot, _stat(NAN, NAN), role="head.bias", path="head")
    ga = localize(g.trace)
    assert ga is not None and (ga.kind, ga.parameter) == (AnomalyKind.GRADIENT, "head.bias")


def test_allow_patterns_skip_matching_modules() -> None:
    b = _Builder()
    root = b.call("Net", root=True)
    pos = b.call("pos_encoding", root.id)
    b.rec(Phase.FORWARD, pos, _stat(0, INF))
    assert localize(b.trace, allow=["pos_*"]) is None
    assert localize(b.trace) is not None


_INPLACE_MSG = (
    "one of the variables needed for gradient computation has been modified by an inplace "
    "operation: [torch.FloatTensor [8, 16]], which is output 0 of SigmoidBackward0, is at "
    "version 1; expected version 0 instead. Hint: ..."
)


def test_parse_inplace_error_reads_the_facts() -> None:
    facts = parse_inplace_error(_INPLACE_MSG)
    assert facts == {
        "tensor_type": "FloatTensor",
        "shape": (8, 16),
        "output": 0,
        "grad_fn": "SigmoidBackward0",
        "version": 1,
        "expected_version": 0,
    }
    assert parse_inplace_error("something else") is None


def test_inplace_suspects_match_node_shape_and_version() -> None:
    b = _Builder()
    root = b.call("Net", root=True)
    act = b.call("block.act", root.id)
    r = b.rec(Phase.FORWARD, act, None)
    r.shape, r.grad_fn, r.version = (8, 16), "SigmoidBackward0", 0
    other = b.call("head.act", root.id)
    o = b.rec(Phase.FORWARD, other, None)
    o.shape, o.grad_fn, o.version = (8, 4), "SigmoidBackward0", 0
    found = inplace_suspects([b.trace], _INPLACE_MSG)
    assert [x.path for x in found] == ["block.act"]
    # newer PyTorch words it "output 0 of Sigmoid"
    assert [
        x.path
        for x in inplace_suspects([b.trace], _INPLACE_MSG.replace("SigmoidBackward0", "Sigmoid"))
    ] == ["block.act"]
