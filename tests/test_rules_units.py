"""Each built-in rule on hand-built step traces (rules are pure functions of records): a
case that fires it on its failure, a look-alike healthy case where it must stay silent, and
thresholds that come from the dtype at hand."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from nanwatch.records import Note, OpEvent, Phase, StepTrace, TensorStat
from nanwatch.rules import REGISTRY
from nanwatch.rules.testing import TraceBuilder, diagnose, stat
from nanwatch.stats import dtype_limits

NAN, INF = math.nan, math.inf
FP16 = dtype_limits("float16")
BF16 = dtype_limits("bfloat16")
FP32 = dtype_limits("float32")
assert FP16 is not None and BF16 is not None and FP32 is not None


@dataclass
class Case:
    trace: StepTrace
    history: list[StepTrace] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    def run(self, **thresholds: Any) -> list[Any]:
        return diagnose(self.trace, self.history, facts=self.facts, **thresholds)

    def codes(self, **thresholds: Any) -> list[str]:
        return [d.code for d in self.run(**thresholds)]

    def get(self, code: str) -> Any:
        found = [d for d in self.run() if d.code == code]
        assert found, f"{code} did not fire; got {self.codes()}"
        return found[0]


# ------------------------------------------------------------------ trace factories


def model_step(
    step: int = 0,
    *,
    dtype: str = "float32",
    out: tuple[float, float] = (-1.0, 1.0),
    out_shape: tuple[int, ...] = (8, 4),
    grad: float = 1.0,
    grad_out: tuple[float, float] | None = (-0.1, 0.1),
    loss: float = 1.0,
    localize: bool = True,
    criterion: str = "CrossEntropyLoss",
) -> StepTrace:
    """A two-layer model and a loss: Net(fc1, fc2) -> CrossEntropyLoss (or a custom loss
    module that is not an nn loss, like a hand-written soft Dice)."""
    b = TraceBuilder(step)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-2.0, 2.0, numel=64), shape=(8, 8), dtype=dtype)
    fc1 = b.call("fc1", "Linear", parent=net)
    b.input(fc1, source=x, dtype=dtype, shape=(8, 8))
    h = b.forward(
        fc1, stat(-3.0, 3.0, numel=128), dtype=dtype, shape=(8, 16), grad_fn="AddmmBackward0"
    )
    fc2 = b.call("fc2", "Linear", parent=net)
    b.input(fc2, source=h, dtype=dtype, shape=(8, 16))
    o = b.forward(fc2, stat(*out, numel=32), dtype=dtype, shape=out_shape, grad_fn="AddmmBackward0")
    b.forward(net, source=o, dtype=dtype, shape=out_shape, grad_fn="AddmmBackward0")
    ce = b.call(criterion, root=True, is_loss=criterion.endswith("Loss"))
    b.input(ce, source=o, dtype=dtype, shape=out_shape)
    lo = b.forward(ce, stat(loss, loss, numel=1), shape=(), grad_fn="NllLossBackward0")
    b.backward(lo, stat(1.0, 1.0, numel=1))
    if grad_out is not None:
        b.backward(o, stat(*grad_out, numel=32))
        b.backward(h, stat(grad_out[0] / 10, grad_out[1] / 10, numel=128))
    b.gradient("fc1", "fc1.weight", grad, dtype=dtype)
    b.gradient("fc2", "fc2.weight", grad, dtype=dtype)
    return b.build(localize=localize, loss=loss, grad_norm=grad * math.sqrt(2))


def anomaly_in_module(
    event: OpEvent | None,
    *,
    path: str = "block",
    module_type: str = "Block",
    dtype: str = "float32",
    bad: TensorStat | None = None,
) -> StepTrace:
    """A module whose own forward made a NaN from finite inputs, the op (if any) attached
    as the watcher's replay would."""
    b = TraceBuilder(3)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-1.0, 1.0), dtype=dtype)
    blk = b.call(path, module_type, parent=net)
    b.input(blk, source=x, dtype=dtype)
    b.forward(blk, bad or stat(NAN, NAN, nan=4), dtype=dtype)
    if event is not None:
        b.op(event)
    trace = b.build()
    assert trace.anomaly is not None and trace.anomaly.path == path
    if event is not None:
        trace.anomaly.op = event
    return trace


def ev(
    op: str,
    born: str,
    inputs: list[tuple[str, TensorStat]],
    *,
    dtype: str = "float32",
    phase: Phase = Phase.FORWARD,
    path: str | None = "block",
    cause: OpEvent | None = None,
    injected: bool = False,
    node: str | None = None,
    scalars: dict[str, Any] | None = None,
    source: str | None = "model.py:42",
    code: str | None = None,
) -> OpEvent:
    return OpEvent(
        op=op,
        phase=phase,
        path=path,
        born=born,
        output=stat(NAN if "NaN" in born else 0.0, INF if "inf" in born else 1.0, nan=1),
        inputs=list(inputs),
        scalars=dict(scalars or {}),
        source=source,
        code=code,
        node=node,
        dtype=dtype,
        cause=cause,
        injected=injected,
    )


def counted(lo: float, hi: float, **kw: Any) -> TensorStat:
    return stat(lo, hi, counted=True, **kw)


def history(n: int, factory: Callable[[int], StepTrace]) -> list[StepTrace]:
    return [factory(i) for i in range(n)]


# ------------------------------------------------------------------ the firing cases


def case_overflow_exp() -> Case:
    e = ev(
        "aten.exp.default",
        "+inf",
        [("self", counted(-17.0, 11.5))],
        dtype="float16",
        code="e = logits.exp()",
    )
    return Case(anomaly_in_module(e, dtype="float16"))


def case_hidden_overflow() -> Case:
    """A float16 sum past 65504 inside fc1, absorbed by the next op (x / inf = 0): no record
    is non-finite, the op checker (forensic, a replay) saw it."""
    t = model_step(dtype="float16", out=(-3.0, 4.0))
    t.ops.append(
        ev(
            "aten.sum.default",
            "+inf",
            [("self", counted(-9.5, 9.5, numel=2048))],
            dtype="float16",
            path="fc1",
            code="energy = (x * x).sum() / x.numel()",
        )
    )
    return Case(t)


def case_headroom() -> Case:
    return Case(model_step(dtype="float16", out=(-40000.0, 100.0)))


def case_huge_loss() -> Case:
    # a loss of 1e12 from values of at most |x| = 3: no sum of their squares comes near
    return Case(model_step(loss=1e12, criterion="KLByHand"))


def case_logits_exp_bound(criterion: str = "DiceLossByHand") -> Case:
    def step(i: int, top: float) -> StepTrace:
        return model_step(
            i, dtype="float16", out=(-1.0, top), out_shape=(8, 4), criterion=criterion
        )

    return Case(step(8, 10.0), [step(i, 2.0 + i) for i in range(8)])


def case_growth() -> Case:
    def step(i: int) -> StepTrace:
        return model_step(i, dtype="float16", out=(-1.0, 20000.0 + 2000.0 * i), out_shape=(8, 1))

    return Case(step(8), history(8, step))


def case_update_below_rounding() -> Case:
    # bfloat16 weights of RMS 0.1 (spaced 0.00049 apart there) stepped by AdamW at lr=1e-5
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0))
    b.forward(net, stat(-1.0, 1.0))
    group = {"group": 0, "params": 1, "names": ["fc.weight"], "dtypes": ["bfloat16"], "lr": 1e-5}
    b.note("optimizer", "AdamW", groups=[group])
    return Case(b.build(), facts={"weight_scales": {"fc.weight": (6.4, "norm", 4096)}})


def zeroed_norm(*, gate_grad: float = 0.0, lo: float = -2204.0, hi: float = 2012.0) -> StepTrace:
    """A hand-written float16 LayerNorm whose (x - mean) ** 2 overflowed: its output is all
    exact zeros from an input 4216 wide, its weight's gradient 0 (NW109)."""
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-2290.0, 2790.0, numel=128), dtype="float16")
    fc = b.call("fc", "Linear", parent=net)
    b.input(fc, source=x, dtype="float16")
    h = b.forward(fc, stat(lo, hi, numel=512), dtype="float16", grad_fn="AddmmBackward0")
    ln = b.call("norm", "LN", parent=net)
    b.input(ln, source=h, dtype="float16")
    out = b.forward(ln, stat(-0.0, -0.0, numel=512), dtype="float16", grad_fn="DivBackward0")
    b.forward(net, source=out, dtype="float16")
    b.backward(out, stat(-0.003, 0.003, numel=512), dtype="float16")
    b.backward(h, stat(0.0, 0.0, numel=512), dtype="float16")
    b.gradient("fc", "fc.weight", 0.0, dtype="float16")
    b.gradient("norm", "norm.g", gate_grad, dtype="float16")
    return b.build(loss=0.01, grad_norm=gate_grad)


def case_zeroed_by_overflow() -> Case:
    return Case(zeroed_norm())


def test_zeroed_output_is_silent_when_its_parameters_learn_or_its_input_is_narrow() -> None:
    assert "NW109" in Case(zeroed_norm()).codes()
    # a zero-initialized gate: its own parameter gets a gradient from the input it zeroes
    assert "NW109" not in Case(zeroed_norm(gate_grad=0.5)).codes()
    # an input of no positive value (a dead ReLU) or whose deviations square below finfo.max
    assert "NW109" not in Case(zeroed_norm(hi=-10.0)).codes()
    assert "NW109" not in Case(zeroed_norm(lo=2012.0 - 250.0)).codes()
    # a non-negative input (after a ReLU) too wide to square still zeroes a hand-written norm
    assert "NW109" in Case(zeroed_norm(lo=0.0)).codes()


def wide_norm(
    *,
    out: tuple[float, float] = (-2.766, 2.639),
    lo: float = -2204.0,
    hi: float = 2012.0,
    grad_fn: str = "DivBackward0",
) -> StepTrace:
    """A hand-written float16 LayerNorm whose input is too wide to square: its output is
    normalized (the rows whose (x - mean) ** 2 overflowed are 0, unseen in min and max)."""
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-2290.0, 2750.0, numel=128), dtype="float16", shape=(8, 16))
    fc = b.call("fc", "Linear", parent=net)
    b.input(fc, source=x, dtype="float16", shape=(8, 16))
    shape = (8, 64)
    h = b.forward(
        fc, stat(lo, hi, numel=512), dtype="float16", shape=shape, grad_fn="AddmmBackward0"
    )
    ln = b.call("norm", "LN", parent=net)
    b.input(ln, source=h, dtype="float16", shape=shape)
    o = b.forward(ln, stat(*out, numel=512), dtype="float16", shape=shape, grad_fn=grad_fn)
    b.forward(net, source=o, dtype="float16", shape=shape)
    b.backward(o, stat(-0.04, 0.04, numel=512))
    b.backward(h, stat(-0.07, 0.09, numel=512))
    b.gradient("fc", "fc.weight", 1.9, dtype="float16")
    b.gradient("norm", "norm.g", 0.38, dtype="float16")
    return b.build(loss=0.48, grad_norm=2.0)


def case_wide_norm() -> Case:
    return Case(wide_norm())


def test_wide_norm_input_is_silent_for_a_fused_norm_a_narrow_input_or_one_divisor() -> None:
    assert "NW115" in Case(wide_norm()).codes()
    # nn.LayerNorm's kernel and a statistic computed in float32 then cast back
    assert "NW115" not in Case(wide_norm(grad_fn="NativeLayerNormBackward0")).codes()
    assert "NW115" not in Case(wide_norm(grad_fn="ToCopyBackward0")).codes()
    # deviations whose squares fit float16
    assert "NW115" not in Case(wide_norm(lo=2012.0 - 250.0)).codes()
    # not normalized: past sqrt(64), of one sign (a softmax by hand), or within ±1 (x / its
    # L2 norm, which torch accumulates in float32)
    assert "NW115" not in Case(wide_norm(out=(-9.0, 2.6))).codes()
    assert "NW115" not in Case(wide_norm(out=(-0.36, 0.35))).codes()
    assert "NW115" not in Case(wide_norm(out=(0.0, 1.0))).codes()
    # x / 1000: min and max divided by one number
    assert "NW115" not in Case(wide_norm(out=(-2.204, 2.012))).codes()
    # an output of exact zeros is NW109's
    assert "NW115" not in Case(wide_norm(out=(0.0, 0.0))).codes()


def case_saved_rstd_overflow() -> Case:
    """A float16 LayerNorm with eps=1e-12 over an all-zero row: its forward saved 1 /
    sqrt(0 + 1e-12) = 1e6, inf in float16, and its backward made NaN of it (NW108)."""
    e = ev(
        "aten.native_layer_norm",
        "NaN",
        [
            ("input", counted(0.0, 2.0, zeros=8, numel=64)),
            ("result2", counted(0.5, INF, posinf=1, numel=8)),
        ],
        dtype="float16",
        phase=Phase.BACKWARD,
        node="NativeLayerNormBackward0",
        path="ln",
    )
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-1.0, 1.0), dtype="float16")
    ln = b.call("ln", "LayerNorm", parent=net)
    b.input(ln, source=x, dtype="float16")
    out = b.forward(ln, stat(-1.0, 1.0), dtype="float16", grad_fn="NativeLayerNormBackward0")
    b.backward(out, stat(-1.0, 1.0), dtype="float16")
    b.backward(x, counted(NAN, NAN, nan=8), dtype="float16")
    t = b.build()
    assert t.anomaly is not None
    t.anomaly.op = e
    return Case(t)


def case_log() -> Case:
    log = ev("aten.log.default", "-inf", [("self", counted(0.0, 1.0, zeros=3))])
    mul = ev(
        "aten.mul.Tensor",
        "NaN",
        [("self", counted(0.0, 1.0, zeros=2)), ("other", counted(-INF, 0.0, neginf=3))],
        cause=log,
    )
    return Case(anomaly_in_module(mul))


def case_div() -> Case:
    div = ev(
        "aten.div.Tensor",
        "NaN",
        [("self", counted(0.0, 5.0, zeros=9)), ("other", counted(0.0, 5.0, zeros=1))],
        code="return (x - lo) / (hi - lo)",
        path="norm",
    )
    return Case(anomaly_in_module(div, path="norm", module_type="MinMaxScale"))


def case_root() -> Case:
    pow_ = ev(
        "aten.pow.Tensor_Scalar",
        "NaN",
        [("self", counted(-1.7, 1.8))],
        scalars={"exponent": 1.5},
        code="return x**1.5",
        path="act",
    )
    return Case(anomaly_in_module(pow_, path="act", module_type="PowerAct"))


def bce_trace(*, note: bool, saturated: bool = True) -> StepTrace:
    b = TraceBuilder(0)
    net = b.call("Classifier", root=True)
    b.input(net, stat(-3.0, 3.0, numel=768), shape=(64, 12))
    lo, hi = (0.0, 1.0) if saturated else (0.02, 0.97)
    o = b.forward(net, stat(lo, hi, numel=64), shape=(64,), grad_fn="SqueezeBackward1")
    bce = b.call("BCELoss", root=True, is_loss=True)
    b.input(bce, source=o, shape=(64,))
    b.input(bce, stat(0.0, 1.0, numel=64), role="input[1]", shape=(64,))
    loss = 18.9 if saturated else 0.4
    lr = b.forward(bce, stat(loss, loss, numel=1), shape=(), grad_fn="BinaryCrossEntropyBackward0")
    b.backward(lr, stat(1.0, 1.0, numel=1))
    g = -1.56e10 if saturated else -0.5
    b.backward(o, stat(g, 0.02, numel=64))
    if note:
        b.note(
            "loss_input",
            "BCELoss",
            loss="BCELoss",
            input_dtype="float32",
            exact_zeros=52 if saturated else 0,
            exact_ones=10 if saturated else 0,
            value_clamped=12 if saturated else 0,
            reduction="mean",
        )
    return b.build(loss=loss)


def case_bce_saturated() -> Case:
    return Case(bce_trace(note=False))


def pairing_trace(loss: str, act_module: str | None, *, grad_fn: str | None = None) -> StepTrace:
    """Net(head -> act) -> loss; the activation as a module, or functional (grad_fn)."""
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-1.0, 1.0, numel=80), shape=(8, 10))
    head = b.call("head", "Linear", parent=net)
    b.input(head, source=x, shape=(8, 10))
    logits = b.forward(head, stat(-4.0, 4.0, numel=40), shape=(8, 5), grad_fn="AddmmBackward0")
    last = logits
    if act_module is not None:
        passthrough = act_module == "Sigmoid"
        act = b.call("act", act_module, parent=net, passthrough=passthrough)
        inp = b.input(act, source=logits, shape=(8, 5))
        fn = {"Sigmoid": "SigmoidBackward0", "Softmax": "SoftmaxBackward0"}.get(act_module)
        if passthrough:
            last = b.forward(act, source=inp, shape=(8, 5), grad_fn=fn)
        else:
            last = b.forward(act, stat(0.01, 0.9, numel=40), shape=(8, 5), grad_fn=fn)
    elif grad_fn is not None:  # functional: the root's own output
        last = b.forward(net, stat(0.01, 0.9, numel=40), shape=(8, 5), grad_fn=grad_fn)
    if last.call != net.id:
        last = b.forward(net, source=last, shape=(8, 5), grad_fn=last.grad_fn)
    crit = b.call(loss, root=True, is_loss=True)
    b.input(crit, source=last, shape=(8, 5))
    value = -0.2 if loss == "NLLLoss" else 1.5
    b.forward(crit, stat(value, value, numel=1), shape=())
    return b.build(loss=value)


def case_sigmoid_bce() -> Case:
    return Case(pairing_trace("BCELoss", "Sigmoid"))


def case_softmax_ce() -> Case:
    return Case(pairing_trace("CrossEntropyLoss", "Softmax"))


def case_softmax_nll() -> Case:
    return Case(pairing_trace("NLLLoss", "Softmax"))


def case_probabilities() -> Case:
    t = pairing_trace("CrossEntropyLoss", None)
    t.notes.append(
        _note("CrossEntropyLoss", loss="CrossEntropyLoss", probability_rows=True, input_min=0.0)
    )
    return Case(t)


def case_ctc_dropped() -> Case:
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0, numel=80), shape=(5, 2, 8))
    out = b.forward(net, stat(-3.0, -0.5, numel=60), shape=(5, 2, 6))
    crit = b.call("CTCLoss", root=True, is_loss=True)
    b.input(crit, source=out, shape=(5, 2, 6))
    b.forward(crit, stat(0.0, 0.0, numel=1), shape=())
    b.note("loss_input", "CTCLoss", loss="CTCLoss", ctc_dropped=2, ctc_samples=2)
    return Case(b.build(loss=0.0))


def case_softmax_dim() -> Case:
    t = pairing_trace("NLLLoss", None, grad_fn="LogSoftmaxBackward0")
    t.notes.append(
        _note(
            "NLLLoss",
            loss="NLLLoss",
            input_shape=[8, 5],
            input_activation="LogSoftmaxBackward0",
            input_softmax_dim=0,
        )
    )
    return Case(t)


def case_detached() -> Case:
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0, numel=80), shape=(8, 10))
    b.forward(net, stat(-2.0, 3.0, numel=40), shape=(8, 5), grad_fn="AddmmBackward0")
    crit = b.call("CrossEntropyLoss", root=True, is_loss=True)
    b.input(crit, stat(-2.0, 3.0, numel=40), shape=(8, 5))
    b.forward(crit, stat(1.5, 1.5, numel=1), shape=())
    b.gradient("Net", "weight", 0.0, shape=(5, 10))
    b.note(
        "loss_input",
        "CrossEntropyLoss",
        loss="CrossEntropyLoss",
        input_dtype="float32",
        input_shape=[8, 5],
        input_grad_fn=None,
        input_requires_grad=False,
        input_min=-2.0,
        input_max=3.0,
    )
    return Case(b.build(loss=1.5))


def case_target_maximized() -> Case:
    """A hand-weighted focal loss with alpha above 1: every term of target 0 got a negative
    gradient in two steps in a row (the guards' ``"loss_sign"`` notes)."""

    def step(n: int) -> StepTrace:
        t = model_step(n)
        t.notes.append(
            Note(
                "loss_sign",
                "F.binary_cross_entropy_with_logits",
                {
                    "loss": "F.binary_cross_entropy_with_logits",
                    "flipped": 0,
                    "flipped_terms": 9,
                    "trained": 1,
                    "terms": 16,
                },
                source="train.py:12",
            )
        )
        return t

    return Case(step(1), history=[step(0)])


def _note(path: str, **data: Any) -> Any:
    from nanwatch.records import Note

    return Note("loss_input", path, data)


def seg_trace(step: int, ignored_amax: float, *, overflow: bool = False) -> StepTrace:
    b = TraceBuilder(step)
    net = b.call("SegNet", root=True)
    b.input(net, stat(-1.0, 4.0, numel=3072), dtype="float16", shape=(4, 3, 16, 16))
    b.forward(
        net, stat(-ignored_amax, ignored_amax, numel=4096), dtype="float16", shape=(4, 4, 16, 16)
    )
    loss = b.call("SegLoss", root=True)
    b.note(
        "loss_input",
        "SegLoss.ce",
        loss="CrossEntropyLoss",
        input_dtype="float32",
        ignore_index=255,
        ignored=256,
        ignored_amax=ignored_amax,
        valid_amax=ignored_amax / 2.4,
    )
    if overflow:
        b.forward(loss, stat(NAN, NAN, numel=1, nan=1), shape=())
        exp = ev(
            "aten.exp.default",
            "+inf",
            [("self", counted(-ignored_amax, 11.5))],
            dtype="float16",
            path="SegLoss",
        )
        b.op(exp)
        trace = b.build()
        assert trace.anomaly is not None
        trace.anomaly.op = exp
        return trace
    b.forward(loss, stat(1.2, 1.2, numel=1), shape=())
    return b.build()


def case_ignored_logits() -> Case:
    return Case(seg_trace(20, 9.5))


def case_bad_weights() -> Case:
    hist = [model_step(0, dtype="float16", grad=110.0)]
    b = TraceBuilder(1)
    b.parameter(
        "fc1", "fc1.weight", counted(-INF, 32464.0, neginf=1, finite_amax=36384.0), dtype="float16"
    )
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0), dtype="float16")
    return Case(b.build(), hist)


def case_bad_grads() -> Case:
    b = TraceBuilder(2)
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0))
    b.forward(net, stat(-1.0, 1.0))
    b.gradient("fc1", "fc1.weight", NAN, s=counted(NAN, NAN, nan=3))
    b.gradient("fc2", "fc2.weight", 0.5)
    t = b.build()
    t.full = False
    return Case(t)


def case_exploding() -> Case:
    hist = history(6, lambda i: model_step(i, grad=1.0 + 0.1 * i))
    return Case(model_step(6, grad=60.0, grad_out=(-9.0, 9.0)), hist)


def case_vanishing() -> Case:
    def step(i: int) -> StepTrace:
        return model_step(i, dtype="float16", grad=0.0, grad_out=(0.0, 0.0))

    return Case(step(5), history(5, step))


def scaler_step(i: int, scale: float) -> StepTrace:
    t = model_step(i)
    t.scale = scale
    return t


def case_scaler() -> Case:
    scales = [65536.0 / 2**i for i in range(20)]
    hist = [scaler_step(i, s) for i, s in enumerate(scales)]
    cur = model_step(20, grad=INF)  # skipped too: a step with finite gradients is applied
    cur.scale = scales[-1] / 2
    return Case(cur, hist, {"scaler": True})


def case_weight_decay() -> Case:
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0))
    b.forward(net, stat(-1.0, 1.0))
    group = {"params": 2, "dtypes": ["float32"], "lr": 0.5, "weight_decay": 1000.0}
    b.note("optimizer", "SGD", groups=[group])
    return Case(b.build())


def case_stale_grads() -> Case:
    b = TraceBuilder(1)
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0))
    b.forward(net, stat(-1.0, 1.0))
    b.note("stale_grads", "SGD", source="train.py:12", variable="opt", group=0,
           names=["fc.weight", "fc.bias"], count=2, params=2)  # fmt: skip
    return Case(b.build())


def case_clip_to_nothing() -> Case:
    b = TraceBuilder(1)
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0))
    b.forward(net, stat(-1.0, 1.0))
    b.note("clip", "(gradients)", source="train.py:14", max_norm=0.0,
           code="torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)")  # fmt: skip
    return Case(b.build())


def case_clip_scaled() -> Case:
    b = TraceBuilder(1)
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0))
    b.forward(net, stat(-1.0, 1.0))
    b.note("clip", "(gradients)", source="train.py:14", max_norm=1.0, scale=65536.0,
           code="torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)")  # fmt: skip
    return Case(b.build())


def case_step_without_grads() -> Case:
    b = TraceBuilder(1)
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0))
    b.forward(net, stat(-1.0, 1.0))
    b.note("optimizer", "SGD", ident=1, grads_dropped=["fc.weight", "fc.bias"],
           grads_dropped_count=2, groups=[{"group": 0, "params": 2, "lr": 0.1}])  # fmt: skip
    return Case(b.build())


def case_unscaled_backward() -> Case:
    b = TraceBuilder(1)
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0))
    b.forward(net, stat(-1.0, 1.0))
    b.note("optimizer", "SGD", ident=1, unscaled_backward=65536.0,
           groups=[{"group": 0, "params": 2, "lr": 0.1}])  # fmt: skip
    return Case(b.build())


def case_foreign_optimizer() -> Case:
    def step(i: int) -> StepTrace:
        b = TraceBuilder(i)
        net = b.call("Net", root=True)
        b.input(net, stat(-1.0, 1.0))
        b.forward(net, stat(-1.0, 1.0))
        b.gradient("Net", "fc.weight", 0.5, numel=64)
        b.note("foreign_step", "SGD", params=2, same=True)
        return b.build(loss=1.0, grad_norm=0.5)

    return Case(step(2), [step(0), step(1)])


def case_lr_zero() -> Case:
    def step(i: int) -> StepTrace:
        b = TraceBuilder(i)
        b.gradient("fc", "fc.weight", 0.5, numel=64)
        b.note("optimizer", "AdamW", ident=1, scheduler="LambdaLR", scheduler_variable="sched",
               groups=[{"group": 0, "params": 1, "lr": 0.0, "initial_lr": 1e-3}],
               scheduler_lambdas=[{"code": "sched = LambdaLR(opt, lambda s: s // warm)",
                                   "at": "train.py:9"}])  # fmt: skip
        return b.build(loss=1.0, grad_norm=0.5)

    return Case(step(4), [step(i) for i in range(4)])


def case_loss_spike() -> Case:
    def step(i: int, loss: float, lr: float) -> StepTrace:
        b = TraceBuilder(i)
        b.gradient("fc", "fc.weight", 0.5, numel=64)
        b.note("optimizer", "AdamW", ident=1,
               groups=[{"group": 0, "params": 1, "names": ["fc.weight"], "lr": lr}])  # fmt: skip
        return b.build(loss=loss, grad_norm=0.5)

    return Case(step(2, 40.0, 1.0), [step(0, 1.1, 1e-3), step(1, 1.0, 1.0)])


def case_input() -> Case:
    b = TraceBuilder(1)
    net = b.call("Sequential", root=True)
    b.input(
        net, counted(NAN, NAN, nan=1, bad_rows=(13,), bad_row_count=1, numel=320), shape=(32, 10)
    )
    b.forward(net, counted(NAN, NAN, nan=3))
    return Case(b.build())


def case_masked() -> Case:
    fill = ev(
        "aten.masked_fill.Scalar",
        "-inf",
        [("self", counted(-1.3, 1.5))],
        injected=True,
        scalars={"value": -INF},
        code='scores = scores.masked_fill(pad, float("-inf"))',
    )
    soft = ev(
        "aten._softmax.default",
        "NaN",
        [("self", counted(-INF, 1.5, neginf=54, numel=144))],
        cause=fill,
        path="attn",
    )
    return Case(anomaly_in_module(soft, path="attn", module_type="SelfAttention"))


def case_hidden_nan() -> Case:
    """A NaN target hidden by torch.where in forward: the norm's backward saved it (NW407)."""
    e = ev(
        "aten.linalg_vector_norm.default",
        "NaN",
        [("self", counted(NAN, 0.9, nan=4, numel=32))],
        phase=Phase.BACKWARD,
        node="LinalgVectorNormBackward0",
        path=None,
        code="err = (pred - gt).norm(dim=-1)",
    )
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-1.0, 1.0))
    out = b.forward(net, stat(-1.0, 1.0))
    b.backward(out, counted(NAN, NAN, nan=4))
    b.backward(x, counted(NAN, NAN, nan=8))
    t = b.build(loss=0.5)
    assert t.anomaly is not None
    t.anomaly.op = e
    return Case(t)


INPLACE_MESSAGE = (
    "one of the variables needed for gradient computation has been modified by an inplace "
    "operation: [torch.FloatTensor [8, 16]], which is output 0 of SigmoidBackward0, is at "
    "version 1; expected version 0 instead."
)


def case_inplace() -> Case:
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-1.0, 1.0, numel=128), shape=(8, 16))
    act = b.call("block.act", "Sigmoid", parent=net, passthrough=True)
    inp = b.input(act, source=x, shape=(8, 16))
    b.forward(act, source=inp, shape=(8, 16), grad_fn="SigmoidBackward0", version=0)
    t = b.build(error={"class": "autograd-inplace", "message": INPLACE_MESSAGE})
    return Case(t)


def case_transient() -> Case:
    t = anomaly_in_module(None, path="encoder.ffn", module_type="Linear")
    assert t.anomaly is not None
    t.anomaly.transient = True
    return Case(t)


def case_module_state() -> Case:
    t = anomaly_in_module(None, path="proj", module_type="Linear")
    assert t.anomaly is not None
    t.notes.append(
        Note(
            kind="module_state",
            path="proj",
            data={
                "tensors": [
                    {
                        "name": "weight",
                        "kind": "set by a forward pre-hook",
                        "stat": "NaN",
                        "dtype": "float32",
                    }
                ]
            },
        )
    )
    return Case(t)


def case_absorbed_data() -> Case:
    b = TraceBuilder(1)
    net = b.call("Rnn", root=True)
    b.input(net, counted(-1.0, 1.0), shape=(4, 6, 3))
    b.forward(net, counted(-0.5, 0.5))
    b.note(
        "absorbed_data",
        "Rnn",
        role="input[0]",
        kinds="NaN",
        rows=[1, 2, 3],
        row_count=3,
        shape=[4, 6, 3],
    )
    return Case(b.build())


def case_catch_all() -> Case:
    odd = ev(
        "aten.special_zeta.default",
        "NaN",
        [("self", counted(0.5, 1.5)), ("other", counted(1.0, 2.0))],
    )
    return Case(anomaly_in_module(odd))


def case_too_few_elements() -> Case:
    std = ev(
        "aten.std.correction",
        "NaN",
        [("self", counted(-0.7, 0.5, numel=5))],
        scalars={"correction": 1},
        code="return (x - x.mean(0)) / x.std(0)",
        path="norm",
    )
    std.output = counted(NAN, NAN, nan=5, numel=5)
    return Case(anomaly_in_module(std, path="norm", module_type="Standardize"))


def case_outside_domain() -> Case:
    acos = ev(
        "aten.acos.default",
        "NaN",
        [("self", counted(0.2, 1.0000002, numel=8))],
        scalars={"n_outside": 3},
        code="return torch.acos(cos)",
        path="angle",
    )
    return Case(anomaly_in_module(acos, path="angle", module_type="Angular"))


CASES: dict[str, Callable[[], Case]] = {
    "NW100": case_catch_all,
    "NW101": case_overflow_exp,
    "NW102": case_headroom,
    "NW103": case_logits_exp_bound,
    "NW104": case_growth,
    "NW105": case_hidden_overflow,
    "NW106": case_huge_loss,
    "NW107": case_update_below_rounding,
    "NW108": case_saved_rstd_overflow,
    "NW109": case_zeroed_by_overflow,
    "NW110": case_log,
    "NW111": case_div,
    "NW112": case_root,
    "NW113": case_too_few_elements,
    "NW114": case_outside_domain,
    "NW115": case_wide_norm,
    "NW201": case_bce_saturated,
    "NW202": case_sigmoid_bce,
    "NW203": case_softmax_ce,
    "NW204": case_softmax_nll,
    "NW205": case_probabilities,
    "NW206": case_ignored_logits,
    "NW207": case_ctc_dropped,
    "NW208": case_softmax_dim,
    "NW209": case_detached,
    "NW210": case_target_maximized,
    "NW301": case_bad_weights,
    "NW302": case_bad_grads,
    "NW303": case_exploding,
    "NW304": case_vanishing,
    "NW305": case_scaler,
    "NW306": case_weight_decay,
    "NW307": case_stale_grads,
    "NW309": case_clip_to_nothing,
    "NW310": case_clip_scaled,
    "NW311": case_step_without_grads,
    "NW314": case_unscaled_backward,
    "NW315": case_foreign_optimizer,
    "NW312": case_lr_zero,
    "NW308": case_loss_spike,
    "NW401": case_input,
    "NW402": case_masked,
    "NW403": case_inplace,
    "NW404": case_transient,
    "NW405": case_module_state,
    "NW406": case_absorbed_data,
    "NW407": case_hidden_nan,
}


def test_every_builtin_rule_has_a_firing_case_here() -> None:
    mine = {r.code for r in REGISTRY.values() if r.builtin and r.family != "guards"}
    assert mine == set(CASES)


@pytest.mark.parametrize("code", sorted(CASES))
def test_rule_fires_on_its_failure_and_is_the_top_diagnosis(code: str) -> None:
    case = CASES[code]()
    ds = case.run()
    assert ds, f"{code}: nothing fired"
    assert ds[0].code == code, [d.headline for d in ds]
    d = ds[0]
    assert d.evidence and all(isinstance(e, str) and e for e in d.evidence)
    assert d.fix.strip() and d.explanation.strip()
    assert d.step == case.trace.step or code == "NW403"
    assert d.silence == f'nanwatch.watch(..., ignore=["{code}"])'


@pytest.mark.parametrize("code", sorted(CASES))
def test_ignoring_a_code_silences_it(code: str) -> None:
    case = CASES[code]()
    assert code not in [
        d.code for d in diagnose(case.trace, case.history, facts=case.facts, ignore=[code])
    ]


# ------------------------------------------------------------------ healthy look-alikes


def test_a_healthy_float32_step_gets_no_diagnosis() -> None:
    hist = history(8, lambda i: model_step(i, out=(-3000.0, 4000.0)))
    assert diagnose(model_step(8, out=(-3000.0, 4100.0)), hist) == []


def test_a_healthy_float16_step_gets_no_diagnosis() -> None:
    hist = history(8, lambda i: model_step(i, dtype="float16", out=(-3.0, 4.0)))
    assert diagnose(model_step(8, dtype="float16", out=(-3.0, 4.0)), hist) == []


# ------------------------------------------------------------------ NW101 overflow


def test_overflow_evidence_names_the_op_the_input_and_the_float16_bound() -> None:
    d = case_overflow_exp().get("NW101")
    text = " | ".join(d.evidence)
    assert d.op == "aten.exp" and d.path == "block" and d.source == "model.py:42"
    assert "11.5" in text and "11.09" in text and "65504" in text and "float16" in text
    assert "e = logits.float().exp()" in d.fix  # the user's own line, upcast


def test_overflow_bound_comes_from_the_dtype_not_a_constant() -> None:
    e = ev("aten.exp.default", "+inf", [("self", counted(0.0, 90.0))], dtype="bfloat16")
    d = Case(anomaly_in_module(e, dtype="bfloat16")).get("NW101")
    text = " | ".join(d.evidence)
    assert f"{BF16.exp_bound:.4g}" in text and "11.09" not in text


def test_overflow_of_a_matmul_and_of_a_cast() -> None:
    mm = ev(
        "aten.mm.default",
        "+inf",
        [("self", counted(-200, 200)), ("mat2", counted(-300, 300))],
        dtype="float16",
    )
    d = Case(anomaly_in_module(mm, dtype="float16")).get("NW101")
    assert "200" in d.evidence[0] and "300" in d.evidence[0] and "65504" in d.evidence[0]
    assert "autocast" in d.fix
    cast = ev("aten._to_copy.default", "+inf", [("self", counted(0.0, 70000.0))], dtype="float16")
    d = Case(anomaly_in_module(cast, dtype="float16")).get("NW101")
    assert "70000" in d.evidence[0] and "cast" in d.evidence[0]


def test_overflow_without_a_traced_op_says_how_to_find_it() -> None:
    t = anomaly_in_module(None, dtype="float16", bad=counted(-1.0, INF, posinf=2))
    d = Case(t).get("NW101")
    assert d.op is None and any('mode="forensic"' in e for e in d.evidence)


def test_a_nan_in_float32_without_an_op_is_not_called_an_overflow() -> None:
    codes = Case(anomaly_in_module(None)).codes()
    assert "NW101" not in codes and codes[0] == "NW100"


# ------------------------------------------------------------------ NW102-NW104 early


def test_headroom_threshold_is_a_fraction_of_each_dtypes_max() -> None:
    assert "NW102" in Case(model_step(dtype="float16", out=(-40000.0, 1.0))).codes()
    # the same numbers are nothing for float32 and bfloat16
    assert "NW102" not in Case(model_step(dtype="float32", out=(-40000.0, 1.0))).codes()
    assert "NW102" not in Case(model_step(dtype="bfloat16", out=(-40000.0, 1.0))).codes()
    # 30000 is below half of 65504: silent by default, loud with headroom=0.25
    quiet = Case(model_step(dtype="float16", out=(-30000.0, 1.0)))
    assert "NW102" not in quiet.codes()
    assert "NW102" in quiet.codes(headroom=0.25)


def test_headroom_evidence_gives_the_value_the_limit_and_the_fraction() -> None:
    d = case_headroom().get("NW102")
    assert d.severity == "warning" and d.path == "fc2"
    assert "40000" in d.evidence[0] and "65504" in d.evidence[0] and "61%" in d.evidence[0]


def test_logit_trend_predicts_the_steps_left_before_exp_overflows() -> None:
    d = case_logits_exp_bound().get("NW103")
    text = " | ".join(d.evidence)
    assert "11.09" in text and "steps" in text
    assert REGISTRY["NW103"].early


def test_growing_logits_that_only_feed_cross_entropy_are_not_a_warning() -> None:
    assert "NW103" not in case_logits_exp_bound("CrossEntropyLoss").codes()


def test_stable_large_float16_logits_are_not_a_warning() -> None:
    def step(i: int) -> StepTrace:
        return model_step(i, dtype="float16", out=(-1.0, 10.0), criterion="DiceLossByHand")

    assert "NW103" not in Case(step(8), history(8, step)).codes()


def test_a_regression_output_is_not_logits() -> None:
    def step(i: int, top: float) -> StepTrace:
        return model_step(
            i, dtype="float16", out=(-1.0, top), out_shape=(8, 1), criterion="DiceLossByHand"
        )

    assert "NW103" not in Case(step(8, 10.0), [step(i, 2.0 + i) for i in range(8)]).codes()


def test_growth_trend_names_the_tensor_and_the_steps_left() -> None:
    d = case_growth().get("NW104")
    assert d.path == "fc2"
    # 36000 now, +2000 per step, float16 stops at 65504: about 15 steps left
    assert "65504" in d.evidence[0] and "about 15 steps" in d.evidence[0]


def test_growth_far_beyond_the_horizon_is_silent() -> None:
    def step(i: int) -> StepTrace:
        return model_step(i, dtype="float16", out=(-1.0, 20000.0 + 10.0 * i), out_shape=(8, 1))

    assert "NW104" not in Case(step(8), history(8, step)).codes()


# ------------------------------------------------------------------ NW110-NW112 domain


def test_log_of_zero_follows_the_chain_to_the_log() -> None:
    d = case_log().get("NW110")
    text = " | ".join(d.evidence)
    assert d.op == "aten.log" and "3 exact zeros" in text and "aten.mul.Tensor" in text
    assert "log_softmax" in d.fix


def test_log_of_a_negative_number() -> None:
    e = ev("aten.log.default", "NaN", [("self", counted(-0.25, 1.0))])
    d = Case(anomaly_in_module(e)).get("NW110")
    assert "-0.25" in " ".join(d.evidence)


def test_division_names_denominator_zeros_and_zero_over_zero() -> None:
    d = case_div().get("NW111")
    assert d.title == "Division by zero (0/0)" and d.path == "norm" and d.op == "aten.div.Tensor"
    assert "1 exact zero" in d.evidence[0]
    assert "clamp_min" in d.fix


def test_a_division_that_overflowed_without_zeros_is_an_overflow() -> None:
    e = ev(
        "aten.div.Tensor",
        "+inf",
        [("self", counted(1.0, 5.0)), ("other", counted(1e-8, 1.0))],
        dtype="float16",
    )
    assert Case(anomaly_in_module(e, dtype="float16")).codes()[0] == "NW101"


def test_fractional_power_of_negatives() -> None:
    d = case_root().get("NW112")
    assert "-1.7" in d.evidence[0] and "1.5" in d.evidence[0]
    assert "x.abs() ** 1.5" in d.fix


def test_sqrt_backward_from_the_op_checker() -> None:
    e = ev(
        "aten.div.Tensor",
        "+inf",
        [("self", counted(1.0, 1.0)), ("other", counted(0.0, 2.8, zeros=1))],
        phase=Phase.BACKWARD,
        node="SqrtBackward0",
        path="distance",
    )
    b = TraceBuilder(2)
    net = b.call("Siamese", root=True)
    x = b.input(net, stat(-1.0, 1.0))
    dist = b.call("distance", "PairDistance", parent=net)
    b.input(dist, source=x)
    out = b.forward(dist, stat(0.0, 0.2), grad_fn="SqrtBackward0")
    b.backward(out, stat(0.06, 0.06))
    b.backward(x, counted(NAN, NAN, nan=8))
    t = b.build()
    assert t.anomaly is not None
    t.anomaly.op = e
    d = Case(t).get("NW112")
    assert d.phase == "backward" and "SqrtBackward0" in d.evidence[0]
    assert "vector_norm" in d.fix


def test_a_fractional_power_at_zero_in_backward_keeps_its_base_off_zero() -> None:
    # a focal-style (1 - p) ** 0.5 at p == 1: the fix is for the power, not a distance
    e = ev(
        "aten.pow.Tensor_Scalar",
        "+inf",
        [("self", counted(0.0, 1.0, zeros=10))],
        phase=Phase.BACKWARD,
        node="PowBackward0",
        path="loss",
    )
    e.scalars["exponent"] = 0.5
    b = TraceBuilder(2)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-1.0, 1.0))
    out = b.forward(net, stat(0.0, 1.0), grad_fn="PowBackward0")
    b.backward(out, stat(0.06, 0.06))
    b.backward(x, counted(NAN, NAN, nan=8))
    t = b.build()
    assert t.anomaly is not None
    t.anomaly.op = e
    d = Case(t).get("NW112")
    assert "x.clamp_min(eps) ** 0.5" in d.fix and "finfo(torch.float32)" in d.fix
    assert "vector_norm" not in d.fix


# ------------------------------------------------------------------ NW2xx losses


def test_bce_saturation_from_records_alone() -> None:
    d = case_bce_saturated().get("NW201")
    text = " | ".join(d.evidence)
    assert d.severity == "error" and d.path == "BCELoss"
    assert "18.9" in text and "1.56e+10" in text and "BCEWithLogitsLoss" in d.fix


def test_bce_saturation_from_the_guards_note() -> None:
    d = Case(bce_trace(note=True)).get("NW201")
    text = " | ".join(d.evidence)
    assert "62 of the 64 probabilities" in text and "12 elements hit the log clamp" in text


def test_bce_saturation_behind_an_unmeasured_sigmoid_module_reads_the_logits() -> None:
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-1.0, 1.0, numel=64), shape=(64, 1))
    head = b.call("head", "Linear", parent=net)
    b.input(head, source=x, shape=(64, 1))
    logits = b.forward(head, stat(-5.0, 30.0, numel=64), shape=(64, 1))
    act = b.call("act", "Sigmoid", parent=net, passthrough=True)
    inp = b.input(act, source=logits, shape=(64, 1))
    p = b.forward(act, source=inp, shape=(64, 1), grad_fn="SigmoidBackward0")
    bce = b.call("BCELoss", root=True, is_loss=True)
    b.input(bce, source=p, shape=(64, 1))
    b.forward(bce, stat(25.0, 25.0, numel=1), shape=())
    ds = Case(b.build(loss=25.0)).run()
    assert [d.code for d in ds] == ["NW201", "NW202"]
    one_at = math.log(2 / FP32.eps)
    assert f"{one_at:.4g}" in ds[0].evidence[0] and "30" in ds[0].evidence[0]
    assert ds[0].severity == "warning"  # no count from a guard and no gradient signature


def test_unsaturated_bce_is_silent() -> None:
    assert "NW201" not in Case(bce_trace(note=True, saturated=False)).codes()
    assert "NW201" not in Case(bce_trace(note=False, saturated=False)).codes()


def test_pairing_follows_the_data_flow_through_a_passthrough_sigmoid() -> None:
    d = case_sigmoid_bce().get("NW202")
    assert "act (Sigmoid)" in d.evidence[0]


def test_pairing_sees_a_functional_softmax_by_its_grad_fn() -> None:
    t = pairing_trace("CrossEntropyLoss", None, grad_fn="SoftmaxBackward0")
    d = Case(t).get("NW203")
    assert "SoftmaxBackward0" in d.evidence[0]


def test_pairing_is_silent_on_logits_and_on_log_softmax() -> None:
    assert Case(pairing_trace("CrossEntropyLoss", None)).codes() == []
    assert Case(pairing_trace("NLLLoss", "LogSoftmax")).codes() == []


def test_double_softmax_says_how_low_the_loss_can_go() -> None:
    d = case_softmax_ce().get("NW203")
    floor = math.log(math.e + 5 - 1) - 1
    assert f"{floor:.4g}" in d.evidence[1] and "C = 5" in d.evidence[1]


def test_nll_on_probabilities_shows_the_negative_loss() -> None:
    d = case_softmax_nll().get("NW204")
    assert "-0.2" in d.evidence[1] and "LogSoftmax" in d.fix


def test_probabilities_heuristic_on_records_for_nll() -> None:
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    o = b.forward(net, stat(0.0, 0.9, numel=40), shape=(8, 5))
    nll = b.call("NLLLoss", root=True, is_loss=True)
    b.input(nll, source=o, shape=(8, 5))
    d = Case(b.build()).get("NW205")
    assert "never above 0" in d.evidence[0]


def test_ignored_logits_warn_early_and_become_the_error_once_exp_overflows() -> None:
    early = Case(seg_trace(20, 9.5)).get("NW206")
    assert early.severity == "warning"
    assert "target == 255" in early.evidence[0] and "2.4×" in early.evidence[0]
    assert "11.09" in early.evidence[1]
    assert "logits.float()" in early.fix and "ignore_index=255" in early.fix
    late = Case(seg_trace(31, 17.2, overflow=True))
    ds = late.run()
    assert [d.code for d in ds[:2]] == ["NW206", "NW101"]
    assert ds[0].severity == "error"


def test_ignored_logits_far_from_the_bound_are_silent() -> None:
    assert "NW206" not in Case(seg_trace(5, 2.0)).codes()


# ------------------------------------------------------------------ NW3xx gradients


def test_bad_weights_name_the_parameter_and_the_update_that_broke_it() -> None:
    d = case_bad_weights().get("NW301")
    text = " | ".join(d.evidence)
    assert d.parameter == "fc1.weight" and d.phase == "parameter"
    assert "36384" in text and "56%" in text and "110" in text
    assert "clip_grad_norm_" in d.fix


def test_weights_broken_by_a_nan_gradient_are_a_consequence_not_a_cause() -> None:
    case = case_bad_weights()
    prev = case.history[0]
    g = next(r for r in prev.records if r.role == "fc1.weight")
    g.stat = counted(NAN, NAN, nan=3)
    d = case.get("NW301")
    assert d.priority > 90 and "consequence" in d.title


def test_bad_gradients_are_named_parameter_by_parameter() -> None:
    d = case_bad_grads().get("NW302")
    assert "fc1.weight" in d.evidence[0] and "fc2.weight" not in d.evidence[0]
    assert any('mode="watch"' in e for e in d.evidence)  # sentinel step: says how to see more


def test_exploding_gradients_compare_against_the_median() -> None:
    d = case_exploding().get("NW303")
    assert "median" in d.evidence[0] and d.severity == "warning"
    assert "clip_grad_norm_" in d.fix
    # per parameter and per module, the largest jump first, with its factor
    assert "parameter fc2.weight: gradient norm 60 vs median 1.25 (48×)" in d.evidence
    assert "module fc2: max |gradient of its output| 9 vs median 0.1 (90×)" in d.evidence
    assert (d.path, d.parameter) == ("fc2", "fc2.weight")


def test_steady_gradients_and_short_histories_do_not_explode() -> None:
    hist = history(6, lambda i: model_step(i, grad=1.0 + 0.1 * i))
    assert "NW303" not in Case(model_step(6, grad=2.0), hist).codes()
    assert "NW303" not in Case(model_step(2, grad=60.0), hist[:2]).codes()


def test_a_gradient_lost_in_the_rounding_of_the_total_norm_does_not_explode() -> None:
    """A conv bias before a BatchNorm has a true gradient of 0: what backward computes is
    rounding noise, and noise that is 12x its median is not an explosion. A gradient whose
    square is below float32's eps times the squared total is left out; one just above it
    still counts."""

    def step(i: int, bias: float) -> StepTrace:
        b = TraceBuilder(i)
        net = b.call("Net", root=True)
        b.input(net, stat(-1.0, 1.0))
        b.forward(net, stat(-1.0, 1.0))
        b.gradient("c1", "c1.weight", 1.0)
        b.gradient("c1", "c1.bias", bias)
        return b.build(grad_norm=math.hypot(1.0, bias))

    hist = history(6, lambda i: step(i, 7.6e-10))
    assert "NW303" not in Case(step(6, 9.3e-09), hist).codes()  # floor: sqrt(eps) = 3.5e-4
    hist = history(6, lambda i: step(i, 1e-3))
    d = Case(step(6, 1e-2), hist).get("NW303")
    assert d.parameter == "c1.bias"
    # a level that was noise is no level: its first real gradient (the norm's statistics
    # frozen) is no jump over it
    hist = history(6, lambda i: step(i, 1e-4))
    assert "NW303" not in Case(step(6, 1e-1), hist).codes()


@pytest.mark.parametrize(("dtype", "exact"), [("float32", False), ("float16", True)])
def test_a_gradient_norm_of_0_is_said_exactly(dtype: str, exact: bool) -> None:
    """Gradients of 1e-25 square to 0 in a float32 norm: "every gradient exactly 0" was
    wrong there. Only the norm is known, so the evidence gives the bound; a float16 value
    squared in float32 cannot underflow, so there a norm of 0 is exact."""

    def step(i: int) -> StepTrace:
        return model_step(i, dtype=dtype, grad=0.0, grad_out=(-1e-25, 1e-25))

    d = Case(step(5), history(5, step)).get("NW304")
    assert ("exactly 0" in d.evidence[0]) is exact
    if not exact:
        assert "gradient norm 0 for the last 5 steps" in d.evidence[0]
        assert "below 2.65e-23" in d.evidence[0] and "exactly" not in d.explanation


def test_vanishing_bfloat16_gradients_are_dead_units_not_underflow() -> None:
    """bfloat16 has float32's exponent: zero gradients there are not an underflow a
    GradScaler could fix (it was suggested, for a ReLU killed by bf16 rounding)."""

    def step(i: int) -> StepTrace:
        return model_step(i, dtype="bfloat16", grad=0.0, grad_out=(0.0, 0.0))

    d = Case(step(5), history(5, step)).get("NW304")
    assert "GradScaler" not in d.fix and "underflow" not in d.explanation
    # no ReLU ran in this step: the fix points at what stops the gradient, not LeakyReLU
    assert "saturated activation" in d.fix and "LeakyReLU" not in d.fix


def test_vanishing_float16_gradients_suggest_a_grad_scaler() -> None:
    d = case_vanishing().get("NW304")
    assert "GradScaler" in d.fix and "underflow" in d.explanation
    assert f"{FP16.tiny:.3g}" in " ".join(d.evidence)


def test_vanishing_float32_gradients_are_dead_units_and_need_enough_steps() -> None:
    def step(i: int) -> StepTrace:
        return model_step(i, grad=0.0, grad_out=(0.0, 0.0))

    d = Case(step(5), history(5, step)).get("NW304")
    assert "GradScaler" not in d.fix and "dead" in d.explanation
    assert "NW304" not in Case(step(2), history(2, step)).codes()


def test_scaler_collapse_needs_the_scaler_and_a_collapsing_scale() -> None:
    d = case_scaler().get("NW305")
    assert d.severity == "error" and "65536" in d.evidence[0]
    c = case_scaler()
    c.facts = {}
    assert "NW305" not in c.codes()
    # the usual skips at the start (the scale settling) are not a collapse
    scales = [65536.0, 32768.0, 16384.0, 8192.0, 4096.0, 2048.0, 2048.0, 2048.0]
    hist = [scaler_step(i, s) for i, s in enumerate(scales)]
    assert "NW305" not in Case(scaler_step(8, 2048.0), hist, {"scaler": True}).codes()


# ------------------------------------------------------------------ NW4xx


def test_bad_input_names_the_sample() -> None:
    d = case_input().get("NW401")
    assert "sample 13 (1 of 32)" in d.evidence[0] and d.path == "Sequential"


def test_bad_targets_are_called_targets() -> None:
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0, numel=8), shape=(8, 1))
    o = b.forward(net, stat(-1.0, 1.0, numel=8), shape=(8, 1))
    mse = b.call("MSELoss", root=True, is_loss=True)
    b.input(mse, source=o, shape=(8, 1))
    b.input(
        mse, counted(NAN, NAN, nan=1, bad_rows=(2,), bad_row_count=1), role="input[1]", shape=(8, 1)
    )
    b.forward(mse, counted(NAN, NAN, nan=1), shape=())
    d = Case(b.build()).get("NW401")
    assert d.title == "NaN or inf in the loss targets" and "sample 2" in d.evidence[0]


def test_a_bad_loss_input_from_unwatched_code_is_not_called_bad_data() -> None:
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0, numel=8), shape=(8, 1))
    b.forward(net, stat(-1.0, 1.0, numel=8), shape=(8, 1))
    mse = b.call("MSELoss", root=True, is_loss=True)
    b.input(
        mse, counted(-INF, INF, posinf=4, neginf=4, bad_rows=(0, 1), bad_row_count=8), shape=(8, 1)
    )
    d = Case(b.build()).get("NW401")
    assert d.title == "NaN or inf reached the loss from unwatched code"
    assert "forensic" in d.fix


def test_fully_masked_row_from_the_op_chain() -> None:
    d = case_masked().get("NW402")
    text = " | ".join(d.evidence)
    assert d.op == "aten._softmax" and "54 of 144" in text and "masked_fill" in text
    assert "finfo" in d.fix


def test_fully_masked_row_in_an_attention_module_without_ops() -> None:
    t = anomaly_in_module(None, path="mha", module_type="MultiheadAttention")
    assert Case(t).codes()[0] == "NW402"


def test_inplace_error_is_mapped_to_the_module() -> None:
    d = case_inplace().get("NW403")
    assert d.path == "block.act"
    assert "SigmoidBackward0" in d.evidence[0] and "version 0" in d.evidence[0]
    assert "y = y * 2" in d.fix and "gate" not in d.fix


def test_transient_anomaly_blames_no_layer() -> None:
    ds = case_transient().run()
    assert [d.code for d in ds] == ["NW404"]
    assert "replay" in " ".join(ds[0].evidence)


def test_catch_all_only_when_nothing_specific_fired() -> None:
    d = case_catch_all().get("NW100")
    assert d.op == "aten.special_zeta" and "aten.special_zeta made NaN in float32" in d.evidence[1]
    assert "NW100" not in case_div().codes()


# ------------------------------------------------------------------ NW312 lr stuck at 0


def _lr_step(i: int, lr: float, grad: float = 0.5) -> StepTrace:
    b = TraceBuilder(i)
    b.gradient("fc", "fc.weight", grad, numel=64)
    b.note("optimizer", "AdamW", ident=1,
           groups=[{"group": 0, "params": 1, "lr": lr}])  # fmt: skip
    return b.build(loss=1.0, grad_norm=grad)


def test_nw312_a_warmup_from_zero_that_rises_is_silent() -> None:
    lrs = [0.0, 1e-4, 2e-4, 3e-4, 4e-4, 5e-4]
    hist = [_lr_step(i, lr) for i, lr in enumerate(lrs[:-1])]
    assert "NW312" not in Case(_lr_step(5, lrs[-1]), hist).codes()


def test_nw312_four_steps_at_zero_are_not_enough_and_zero_gradients_are_nw304s() -> None:
    assert "NW312" not in Case(_lr_step(3, 0.0), [_lr_step(i, 0.0) for i in range(3)]).codes()
    hist = [_lr_step(i, 0.0, grad=0.0) for i in range(4)]
    assert "NW312" not in Case(_lr_step(4, 0.0, grad=0.0), hist).codes()


def test_nw312_a_schedule_that_ended_at_zero_says_it_was_above_0() -> None:
    hist = [_lr_step(0, 1e-3)] + [_lr_step(i, 0.0) for i in range(1, 6)]
    d = Case(_lr_step(6, 0.0), hist).get("NW312")
    assert any("it was 0.001 at step 0" in e for e in d.evidence)
    assert "number of steps" in d.fix
