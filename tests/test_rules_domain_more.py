"""Math outside its domain beyond log / div / sqrt: reductions over too few elements
(NW113), functions with restricted real domains (NW114), the op evidence they read (from
the op checker and from the autograd graph of loss code), the catch-all with a known op
(NW100) and overflow fixes that fit the dtype and the device (NW101).

Each diagnosis is tested on hand-built op events (rules are pure functions of records),
on a tiny real model under ``nanwatch.watch`` on CPU, and on a healthy look-alike that
must stay silent."""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch import _domains
from nanwatch.ops import OpChecker, domain_counts, graph_evidence
from nanwatch.records import OpEvent, Phase, StepTrace, TensorStat
from nanwatch.rules import REGISTRY
from nanwatch.rules._evidence import classify, outside_domain, rewrite_call, shortfall
from nanwatch.rules.base import Diagnosis
from nanwatch.rules.testing import TraceBuilder, diagnose, stat
from nanwatch.stats import dtype_limits

NAN, INF = math.nan, math.inf
PLACEHOLDER = re.compile(r"<[a-z][a-z ]*>")


def counted(lo: float, hi: float, **kw: Any) -> TensorStat:
    return stat(lo, hi, counted=True, **kw)


def event(
    op: str,
    born: str,
    inputs: list[tuple[str, TensorStat]],
    *,
    dtype: str = "float32",
    path: str = "block",
    code: str | None = None,
    scalars: dict[str, Any] | None = None,
    out_numel: int = 1,
    cause: OpEvent | None = None,
    device: str = "cpu",
    **fields: Any,
) -> OpEvent:
    nan = out_numel if "NaN" in born else 0
    out = counted(NAN if nan else 0.0, INF if "inf" in born else 1.0, numel=out_numel, nan=nan)
    return OpEvent(
        op=op,
        phase=Phase.FORWARD,
        path=path,
        born=born,
        output=out,
        inputs=inputs,
        scalars=dict(scalars or {}),
        source="model.py:7" if code else None,
        code=code,
        dtype=dtype,
        cause=cause,
        device=device,
        **fields,
    )


def module_trace(
    ev: OpEvent, *, path: str = "block", module_type: str = "Block", dtype: str = "float32"
) -> StepTrace:
    """A model whose module ``path`` made a NaN from finite inputs; the op attached."""
    b = TraceBuilder(2)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-1.0, 1.0), dtype=dtype)
    blk = b.call(path, module_type, parent=net)
    b.input(blk, source=x, dtype=dtype)
    b.forward(blk, counted(NAN, NAN, nan=4), dtype=dtype)
    b.op(ev)
    trace = b.build()
    assert trace.anomaly is not None and trace.anomaly.path == path
    trace.anomaly.op = ev
    return trace


def top(trace: StepTrace, **kw: Any) -> Diagnosis:
    ds = diagnose(trace, **kw)
    assert ds, "nothing fired"
    return ds[0]


def text(d: Diagnosis) -> str:
    return " | ".join(d.evidence)


def no_placeholder(d: Diagnosis) -> None:
    assert not PLACEHOLDER.search(d.fix), d.fix
    assert "cuda" not in d.fix  # every event here ran on the CPU


# ====================================================================== op evidence


def test_the_checker_records_integer_and_empty_arguments_and_every_output() -> None:
    logits = torch.randn(6, 4)
    target = torch.full((6,), -100)
    with OpChecker() as chk:
        F.cross_entropy(logits, target)
    ev = next(e for e in chk.events if "nll_loss" in e.op)
    t = dict(ev.other_inputs)["target"]
    assert (t.min, t.max, t.numel) == (-100.0, -100.0, 6)
    assert dict(ev.outputs)["total_weight"].max == 0.0
    assert ev.device == "cpu" and ev.scalars["ignore_index"] == -100

    with OpChecker() as chk:
        torch.zeros(0, 3).mean(0)
    ev = chk.events[0]
    assert ev.op == "aten.mean.dim" and ev.inputs == []
    assert dict(ev.other_inputs)["self"].numel == 0 and ev.output.numel == 3


def test_the_checker_counts_inputs_outside_the_ops_domain() -> None:
    with OpChecker() as chk:
        torch.acos(torch.tensor([1.0000001, 0.5, -1.5, 1.0]))
    assert chk.events[0].scalars["n_outside"] == 2
    with OpChecker() as chk:
        torch.atanh(torch.tensor([1.0, -1.0, 0.3]))
    assert chk.events[0].scalars["n_edge"] == 2 and "n_outside" not in chk.events[0].scalars
    with OpChecker() as chk:
        torch.lgamma(torch.tensor([0.0, -3.0, 2.5, -2.5]))
    assert chk.events[0].scalars["n_pole"] == 2


def test_domain_counts_follow_the_table() -> None:
    dom = _domains.domain_of("aten.special_logit.default")
    assert dom is not None and dom.name == "logit" and dom.interval == "(0, 1)"
    assert domain_counts(dom, torch.tensor([0.0, 1.0, 1.2, 0.5])) == {
        "n_outside": 1,
        "n_edge": 2,
    }
    assert _domains.domain_of("aten.exp.default") is None


def test_an_op_event_with_the_new_fields_round_trips_through_json() -> None:
    ev = event(
        "aten.nll_loss_forward.default",
        "NaN",
        [("self", counted(-3.0, -0.1, numel=20))],
        other_inputs=[("target", stat(-100.0, -100.0, numel=5))],
        outputs=[("total_weight", counted(0.0, 0.0, numel=1, zeros=1))],
        device="cuda:0",
    )
    back = OpEvent.from_dict(ev.to_dict())
    assert back.device == "cuda:0"
    assert back.other_inputs[0][0] == "target" and back.other_inputs[0][1].min == -100.0
    assert back.outputs[0][1].zeros == 1
    # events written before these fields existed still load
    old = ev.to_dict()
    for k in ("device", "other_inputs", "outputs"):
        old.pop(k)
    assert OpEvent.from_dict(old).other_inputs == []


def test_graph_evidence_names_the_denominator_and_computes_what_the_division_made() -> None:
    per_tok = torch.rand(3, 4, requires_grad=True)
    mask = torch.zeros(3, 4)
    loss = (per_tok * mask).sum() / mask.sum()
    _, events = graph_evidence(loss.grad_fn, output=loss)
    (div,) = events
    assert div.op == "aten.div" and div.born == "NaN"  # 0/0, not "NaN, +inf, -inf"
    assert [n for n, _ in div.inputs] == ["other"]  # the numerator was not saved
    assert div.inputs[0][1] is not None and div.inputs[0][1].max == 0.0
    assert classify(div) == "div"

    x = torch.tensor([1.0, -2.0, 0.0], requires_grad=True)
    y = x / torch.tensor([0.0, 0.0, 1.0])
    _, events = graph_evidence(y.sum().grad_fn, output=y.sum())
    assert events[0].born == "+inf, -inf"  # 1/0 and -2/0: x is a leaf, read from the graph
    assert [n for n, _ in events[0].inputs] == ["self", "other"]

    h = x * 2  # not a leaf, not saved, and not the loss: what was born is the loss's kinds
    loss = (h / torch.zeros(3)).sum()
    _, events = graph_evidence(loss.grad_fn, output=loss)
    assert events[0].born == "NaN" and "numerator was not saved" in str(events[0].scalars)
    assert classify(events[0]) == "div"


def test_graph_evidence_reads_empty_means_variances_and_nll_without_targets() -> None:
    x = torch.rand(5, requires_grad=True)
    loss = x[x > 2].mean()
    _, (ev,) = graph_evidence(loss.grad_fn, output=loss)
    assert ev.op == "aten.mean" and dict(ev.other_inputs)["self"].numel == 0
    assert ev.dtype == "float32" and shortfall(ev) is not None

    with pytest.warns(UserWarning, match="degrees of freedom"):
        v = torch.randn(1, 6, requires_grad=True).var(0).sum()
    _, (ev,) = graph_evidence(v.grad_fn, output=v)
    sf = shortfall(ev)
    assert ev.op == "aten.var" and sf is not None and (sf.per_output, sf.correction) == (1, 1)

    ce = F.cross_entropy(torch.randn(4, 3, requires_grad=True), torch.full((4,), -100))
    _, (ev,) = graph_evidence(ce.grad_fn, output=ce)
    sf = shortfall(ev)
    assert ev.op == "aten.nll_loss_forward" and sf is not None and sf.all_ignored
    assert sf.ignore_index == -100


def test_graph_evidence_stays_silent_on_healthy_loss_code() -> None:
    x = torch.rand(4, 3, requires_grad=True)
    mask = torch.ones(4, 3)
    loss = (x * mask).sum() / mask.sum() + x.std(0).sum() + torch.acos(x.clamp(-1, 1)).mean()
    loss = loss + F.cross_entropy(x, torch.tensor([0, -100, 2, 1]))
    names, events = graph_evidence(loss.grad_fn, output=loss)
    assert events == [] and "div" in names and "acos" in names


# ====================================================================== classify


def test_a_division_by_zero_is_never_called_an_overflow() -> None:
    den = counted(0.0, 0.0, numel=1, zeros=1)
    guessed = event("aten.div", "NaN, +inf, -inf", [("other", den)])
    assert classify(guessed) == "div"
    by_scalar = event(
        "aten.div.Tensor", "+inf", [("self", counted(1.0, 2.0))], scalars={"other": 0}
    )
    assert classify(by_scalar) == "div"
    tiny = event(
        "aten.div.Tensor", "+inf", [("self", counted(1e30, 3e38)), ("other", counted(1e-3, 1.0))]
    )
    assert classify(tiny) == "overflow"


# ====================================================================== NW113


def nll_event(*, target: TensorStat, total: float, weight: TensorStat | None = None) -> OpEvent:
    inputs = [("self", counted(-3.2, -0.4, numel=40))]
    if weight is not None:
        inputs.append(("weight", weight))
    return event(
        "aten.nll_loss_forward.default",
        "NaN",
        inputs,
        path="CrossEntropyLoss",
        scalars={"reduction": 1, "ignore_index": -100},
        other_inputs=[("target", target)],
        outputs=[
            ("output", counted(NAN, NAN, numel=1, nan=1)),
            ("total_weight", counted(total, total, numel=1, zeros=int(total == 0))),
        ],
        code="loss = crit(logits.view(-1, 5), y.view(-1))",
    )


def test_nw113_every_target_ignored() -> None:
    ev = nll_event(target=stat(-100.0, -100.0, numel=40), total=0.0)
    d = top(module_trace(ev, path="CrossEntropyLoss", module_type="CrossEntropyLoss"))
    assert d.code == "NW113" and d.op == "aten.nll_loss_forward"
    assert "all 40 targets equal ignore_index=-100" in text(d)
    assert "reduction='sum'" in d.fix and "(t != -100).sum().clamp_min(1)" in d.fix
    assert "F.cross_entropy" in d.fix
    no_placeholder(d)


def test_nw113_class_weights_that_sum_to_zero() -> None:
    ev = nll_event(
        target=stat(0.0, 1.0, numel=40), total=0.0, weight=counted(0.0, 1.0, numel=5, zeros=2)
    )
    d = top(module_trace(ev, path="CrossEntropyLoss", module_type="CrossEntropyLoss"))
    assert d.code == "NW113"
    assert "class weights of this batch's targets sum to 0" in text(d)
    assert "w[t[t != -100]].sum().clamp_min(1e-12)" in d.fix


def test_nw113_unbiased_std_of_one_sample_rewrites_the_users_call() -> None:
    ev = event(
        "aten.std.correction",
        "NaN",
        [("self", counted(-0.7, 0.5, numel=5))],
        scalars={"correction": 1},
        out_numel=5,
        code="return (x - x.mean(0)) / x.std(0)",
    )
    d = top(module_trace(ev))
    assert d.code == "NW113" and d.op == "aten.std.correction"
    assert "reduced 1 element into each output" in text(d) and "N - correction = 0" in text(d)
    assert "return (x - x.mean(0)) / (x.std(0, correction=0) + 1e-5)" in d.fix


def test_nw113_variance_with_a_correction_larger_than_the_count() -> None:
    ev = event(
        "aten.var.correction",
        "NaN, +inf",
        [("self", counted(-1.0, 2.0, numel=6))],
        scalars={"correction": 3},
        out_numel=3,
    )
    d = top(module_trace(ev))
    assert d.code == "NW113" and "correction=3" in text(d) and "N - correction = -1" in text(d)


def test_nw113_mean_of_an_empty_selection() -> None:
    ev = event(
        "aten.mean.default",
        "NaN",
        [],
        other_inputs=[("self", TensorStat(0.0, 0.0, 0, nan=0, posinf=0, neginf=0, zeros=0))],
        code="loss = per_tok[mask].mean()",
    )
    d = top(module_trace(ev))
    assert d.code == "NW113" and "(0 values)" in text(d)
    assert "clamp_min(1)" in d.fix and "was: loss = per_tok[mask].mean()" in d.fix


def test_nw113_stays_silent_when_the_count_was_not_zero() -> None:
    enough = event(
        "aten.std.correction",
        "NaN",
        [("self", counted(-0.7, 0.5, numel=10))],
        scalars={"correction": 1},
        out_numel=5,
    )
    assert shortfall(enough) is None
    summed = nll_event(target=stat(-100.0, -100.0, numel=40), total=0.0)
    summed.scalars["reduction"] = 2
    assert shortfall(summed) is None
    weighed = nll_event(target=stat(-100.0, 3.0, numel=40), total=12.0)
    assert shortfall(weighed) is None
    for ev in (enough, summed, weighed):
        assert "NW113" not in [d.code for d in diagnose(module_trace(ev))]


# ====================================================================== NW114


def test_nw114_acos_of_a_cosine_rounded_above_one() -> None:
    ev = event(
        "aten.acos.default",
        "NaN",
        [("self", counted(0.2, 1.0000002, numel=8))],
        scalars={"n_outside": 3},
        out_numel=8,
        code="return torch.acos(cos)  # angle",
        path="angle",
    )
    d = top(module_trace(ev, path="angle", module_type="Angular"))
    assert d.code == "NW114" and d.op == "aten.acos" and d.path == "angle"
    assert "acos is defined on [-1, 1]: 3 of its 8 inputs lie outside" in text(d)
    assert "max 1.0000002 (8 values)" in text(d)  # not "max 1": the digits that matter
    assert "is 2e-07 above 1: 2 float32 rounding steps" in text(d)
    assert "eps = torch.finfo(torch.float32).eps" in d.fix
    assert "return torch.acos(cos.clamp(-1 + eps, 1 - eps))" in d.fix
    no_placeholder(d)


def test_nw114_eps_comes_from_the_dtype() -> None:
    ev = event(
        "aten.atanh.default",
        "+inf",
        [("self", counted(-0.5, 1.0, numel=8))],
        scalars={"n_edge": 1},
        dtype="bfloat16",
        out_numel=8,
    )
    d = top(module_trace(ev, dtype="bfloat16"))
    bf16 = dtype_limits("bfloat16")
    assert bf16 is not None
    assert d.code == "NW114" and "finfo(torch.bfloat16)" in d.fix
    assert f"{bf16.eps:.3g}" in d.fix and "(-1, 1)" in text(d) and "±inf at ±1" in text(d)
    assert "1 of its 8 inputs sit exactly on an endpoint" in text(d)
    assert "rounding step" not in text(d)  # exactly 1 is a saturated value, not 0 steps past


def test_nw114_poles_of_the_gamma_family() -> None:
    ev = event(
        "aten.lgamma.default",
        "+inf",
        [("self", counted(0.0, 3.5, numel=16, zeros=2))],
        scalars={"n_pole": 2},
        code="lp = torch.lgamma(alpha)",
    )
    d = top(module_trace(ev))
    assert d.code == "NW114" and "2 of its 16 inputs sit on a pole" in text(d)
    assert "softplus" in d.fix and "torch.lgamma(alpha.clamp_min(eps))" in d.fix


@pytest.mark.parametrize("dom", [d for d in _domains.domains() if d.family != "log"])
def test_nw114_fires_for_every_function_of_the_table(dom: _domains.Domain) -> None:
    bad = dom.hi + 0.5 if math.isfinite(dom.hi) else (dom.lo - 0.5 if math.isfinite(dom.lo) else 0)
    assert dom.outside_of(bad)
    ev = event(
        f"aten.{dom.name}.default", "NaN", [(dom.arg, counted(min(bad, 0.5), max(bad, 0.5)))]
    )
    assert outside_domain(ev) is not None
    d = top(module_trace(ev))
    assert d.code == "NW114" and dom.name in d.evidence[0]
    assert d.fix.strip() and d.explanation.strip()
    no_placeholder(d)


def test_nw114_stays_silent_inside_the_domain() -> None:
    ev = event("aten.acos.default", "NaN", [("self", counted(-1.0, 1.0))])
    assert outside_domain(ev) is None
    assert top(module_trace(ev)).code == "NW100"


def test_nw110_reads_the_log_argument_of_xlogy() -> None:
    ev = event(
        "aten.xlogy.Tensor",
        "-inf",
        [("self", counted(0.5, 3.0)), ("other", counted(0.0, 1.0, zeros=4))],
    )
    d = top(module_trace(ev))
    assert d.code == "NW110"
    assert "its input holds 4 exact zeros" in text(d) and "min 0, max 1" in text(d)


def test_logit_is_a_domain_error_not_a_log_of_zero() -> None:
    ev = event("aten.logit.default", "+inf", [("self", counted(0.1, 1.0))], scalars={"n_edge": 1})
    d = top(module_trace(ev))
    assert d.code == "NW114" and "torch.logit(p, eps=eps)" in d.fix


# ====================================================================== NW100 with an op


def test_catch_all_with_a_known_op_shows_the_op_and_does_not_ask_to_name_it() -> None:
    ev = event(
        "aten.special_zeta.default",
        "NaN",
        [("self", counted(0.3, 2.0, numel=8)), ("other", counted(1.0, 4.0, numel=8))],
        out_numel=8,
        code="z = torch.special.zeta(s, q)",
    )
    d = top(module_trace(ev))
    assert d.code == "NW100" and d.op == "aten.special_zeta" and d.source == "model.py:7"
    assert "aten.special_zeta made NaN in float32 from finite inputs" in text(d)
    assert "input self: min 0.3, max 2" in text(d)
    assert "forensic" not in d.fix and "detect_anomaly" not in d.fix
    assert "bad = ~torch.isfinite(z)" in d.fix and "print(s[bad])" in d.fix
    no_placeholder(d)


def test_catch_all_without_an_op_still_says_how_to_name_it() -> None:
    b = TraceBuilder(1)
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0))
    b.forward(net, counted(NAN, NAN, nan=2))
    d = top(b.build())
    assert d.code == "NW100" and d.op is None and "forensic" in d.fix


# ====================================================================== NW101


def exp_event(dtype: str, top_value: float, **kw: Any) -> OpEvent:
    return event("aten.exp.default", "+inf", [("self", counted(1.0, top_value))], dtype=dtype, **kw)


def test_nw101_float32_exp_clamps_the_argument_from_the_dtypes_bound() -> None:
    ev = exp_event("float32", 100.8, code="z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)")
    d = top(module_trace(ev, path="VAE", module_type="VAE"))
    fp32 = dtype_limits("float32")
    assert fp32 is not None
    cap = math.floor(fp32.exp_bound / 2 * 10) / 10
    assert d.code == "NW101" and "100.8" in text(d) and "values themselves exploded" in text(d)
    assert f"torch.exp((0.5 * logvar).clamp(max={cap}))" in d.fix
    assert "softplus" in d.fix
    assert "autocast" not in d.fix and ".float()" not in d.fix and "amax" not in d.fix
    no_placeholder(d)


def test_nw101_float64_bound_is_float64s() -> None:
    ev = exp_event("float64", 800.0, code="y = t.exp()")
    d = top(module_trace(ev, dtype="float64"))
    assert d.code == "NW101" and "y = t.clamp(max=354.8).exp()" in d.fix


def test_nw101_low_precision_still_upcasts() -> None:
    ev = exp_event("float16", 11.5, code="e = logits.exp()")
    d = top(module_trace(ev, dtype="float16"))
    assert d.code == "NW101" and "e = logits.float().exp()" in d.fix


def test_nw101_stable_softmax_only_when_the_exp_is_normalized() -> None:
    ex = exp_event("float32", 95.0, code="e = scores.exp()")
    div = event(
        "aten.div.Tensor",
        "NaN",
        [("self", counted(0.0, INF, posinf=2)), ("other", counted(1.0, INF, posinf=1))],
        cause=ex,
        code="p = e / e.sum(-1, keepdim=True)",
    )
    d = top(module_trace(div))
    assert d.code == "NW101" and "amax" in d.fix and "clamp(max=" not in d.fix


def test_nw101_float32_matmul_bounds_the_values_and_uses_no_autocast() -> None:
    mm = event(
        "aten.addmm.default",
        "+inf",
        [("self", counted(-0.1, 0.1)), ("mat1", counted(0.0, 2e38)), ("mat2", counted(0.0, 3.0))],
        code="out, _ = self.rnn(x)",
    )
    plain = top(module_trace(mm, path="enc.block", module_type="Linear"))
    assert plain.code == "NW101" and "autocast" not in plain.fix and "cuda" not in plain.fix
    assert "clip_grad_norm_" in plain.fix and "LayerNorm" in plain.fix
    assert "2e+38" in text(plain) and "59% of the float32 limit" in text(plain)
    rnn = top(module_trace(mm, path="enc.rnn", module_type="RNN"))
    assert "self.rnn.named_parameters()" in rnn.fix and "orthogonal_" in rnn.fix
    assert "weight_hh" in rnn.explanation


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_nw101_low_precision_code_names_the_ops_device(device: str) -> None:
    mm = event(
        "aten.mm.default",
        "+inf",
        [("self", counted(-300.0, 300.0)), ("mat2", counted(-300.0, 300.0))],
        dtype="float16",
        device=device,
    )
    d = top(module_trace(mm, dtype="float16"))
    kind = device.split(":", maxsplit=1)[0]
    assert f"device_type='{kind}'" in d.fix
    assert ("cuda" in d.fix) == (kind == "cuda")


def test_nw101_generic_op_has_no_placeholder() -> None:
    ev = event(
        "aten.cumprod.default",
        "+inf",
        [("self", counted(1.0, 300.0))],
        dtype="float16",
        code="g = torch.cumprod(r, dim=1)",
    )
    d = top(module_trace(ev, dtype="float16"))
    assert d.code == "NW101" and "torch.cumprod(r.float(), dim=1)" in d.fix
    no_placeholder(d)


def test_rewrite_call_finds_the_argument_of_method_and_function_forms() -> None:
    def clip(e: str) -> str:
        return f"clip({e})"

    assert rewrite_call("y = torch.special.erfinv(2 * p - 1)", ["erfinv"], clip) == (
        "y = torch.special.erfinv(clip(2 * p - 1))"
    )
    assert rewrite_call("y = f(x).acos() + 1", ["acos"], clip) == "y = clip(f(x)).acos() + 1"
    assert rewrite_call("y = myacos(x)", ["acos"], clip) is None


# ====================================================================== end to end


def run(model: nn.Module, step: Any, *args: Any) -> tuple[Diagnosis | None, StepTrace | None]:
    """Run ``step`` under watch (on_anomaly='record'); the anomaly step's top diagnosis."""
    with nanwatch.watch(*((model, *args)), on_anomaly="record") as nw:
        for i in range(3):
            step(i)
            nw.step()
    bad = [t for t in nw.history if t.anomaly is not None or t.diagnoses]
    if not bad:
        return None, None
    t = bad[0]
    return (t.diagnoses[0] if t.diagnoses else None), t


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def test_e2e_cross_entropy_over_a_batch_of_only_padding_is_nw113() -> None:
    torch.manual_seed(0)
    model, crit = Tagger(), nn.CrossEntropyLoss()

    def step(i: int) -> None:
        ids = torch.randint(0, 20, (3, 4))
        y = torch.randint(0, 5, (3, 4))
        if i == 2:
            y[:] = -100
        crit(model(ids).view(-1, 5), y.view(-1)).backward()

    d, t = run(model, step, crit)
    assert d is not None and t is not None and t.step == 2
    assert d.code == "NW113" and d.path == "CrossEntropyLoss" and d.op == "aten.nll_loss_forward"
    assert "all 12 targets equal ignore_index=-100" in text(d)
    assert "ignore_index=-100, reduction='sum'" in d.fix


def test_e2e_partly_ignored_targets_are_healthy() -> None:
    torch.manual_seed(0)
    model, crit = Tagger(), nn.CrossEntropyLoss()

    def step(i: int) -> None:
        y = torch.randint(0, 5, (3, 4))
        y[0] = -100
        crit(model(torch.randint(0, 20, (3, 4))).view(-1, 5), y.view(-1)).backward()

    assert run(model, step, crit) == (None, None)


class Standardize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(0)) / x.std(0)


def test_e2e_std_over_a_batch_of_one_is_nw113() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Standardize(), nn.Linear(4, 1))

    def step(i: int) -> None:
        model(torch.randn(1 if i == 1 else 6, 4)).pow(2).mean().backward()

    with pytest.warns(UserWarning, match="degrees of freedom"):
        d, t = run(model, step)
    assert d is not None and t is not None and t.step == 1
    assert d.code == "NW113" and d.path == "1" and d.op == "aten.std.correction"
    assert "N - correction = 0" in text(d) and "correction=0" in d.fix


def test_e2e_masked_mean_in_loss_code_is_nw113_and_sum_over_count_is_nw111() -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 1)

    def empty_mean(i: int) -> None:
        per = model(torch.randn(5, 6)).squeeze(-1).pow(2)
        keep = torch.rand(5) > (0.3 if i < 2 else 2.0)
        per[keep].mean().backward()

    d, _ = run(model, empty_mean)
    assert d is not None and d.code == "NW113" and d.path == "(loss)" and d.op == "aten.mean"
    assert "(0 values)" in text(d)

    def sum_over_count(i: int) -> None:
        per = model(torch.randn(5, 6)).squeeze(-1).pow(2)
        mask = (torch.rand(5) > (0.3 if i < 2 else 2.0)).float()
        ((per * mask).sum() / mask.sum()).backward()

    d, _ = run(model, sum_over_count)
    assert d is not None and d.code == "NW111" and d.path == "(loss)" and d.op == "aten.div"
    assert "0/0 = NaN" in text(d) and "denominator holds 1 exact zero" in text(d)
    no_placeholder(d)


def test_e2e_masked_mean_with_a_clamped_count_is_healthy() -> None:
    model = nn.Linear(6, 1)

    def step(i: int) -> None:
        per = model(torch.randn(5, 6)).squeeze(-1).pow(2)
        mask = torch.zeros(5)
        ((per * mask).sum() / mask.sum().clamp_min(1)).backward()

    assert run(model, step) == (None, None)


class Angular(nn.Module):
    def __init__(self, clamp: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.clamp = clamp

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        cos = F.cosine_similarity(self.proj(a), self.proj(b), dim=-1) * 1.0000001 + 1e-7
        if self.clamp:
            eps = torch.finfo(cos.dtype).eps
            cos = cos.clamp(-1 + eps, 1 - eps)
        return torch.acos(cos)


def test_e2e_acos_of_a_rounded_cosine_is_nw114_and_the_clamped_one_is_healthy() -> None:
    torch.manual_seed(0)
    a = torch.randn(6, 4)
    model = Angular(clamp=False)
    d, _ = run(model, lambda i: model(a, a.clone()).mean().backward())
    assert d is not None and d.code == "NW114" and d.path == "Angular" and d.op == "aten.acos"
    assert re.search(r"\d+ of its 6 inputs lie outside", text(d))
    assert re.search(r"max 1\.000000\d+", text(d))
    assert ".clamp(-1 + eps, 1 - eps))" in d.fix

    safe = Angular(clamp=True)
    assert run(safe, lambda i: safe(a, a.clone()).mean().backward()) == (None, None)


def test_e2e_a_domain_error_in_loss_code_is_read_from_the_graph() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh())

    def step(i: int) -> None:
        p = model(torch.randn(4, 3))
        torch.atanh(p.sign() * (1.0 if i == 1 else 0.5)).sum().backward()

    d, t = run(model, step)
    assert d is not None and t is not None and t.step == 1
    assert d.code == "NW114" and d.path == "(loss)" and d.op == "aten.atanh"
    assert "8 of its 8 inputs sit exactly on an endpoint" in text(d)


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(6, 4)
        self.dec = nn.Linear(2, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu, logvar = self.enc(x).chunk(2, -1)
        return self.dec(mu + torch.randn_like(mu) * torch.exp(0.5 * logvar))


def test_e2e_float32_exp_overflow_clamps_the_argument() -> None:
    torch.manual_seed(0)
    model = VAE()
    with torch.no_grad():
        model.enc.bias[2:] = 200.0
    x = torch.randn(8, 6)
    d, _ = run(model, lambda i: F.mse_loss(model(x), x).backward())
    assert d is not None and d.code == "NW101" and d.path == "VAE" and d.op == "aten.exp"
    m = re.search(r"largest value is ([\d.]+); exp overflows above 88.72", text(d))
    assert m is not None and 95 < float(m.group(1)) < 110  # 0.5 * (200 + a small x @ W)
    assert "torch.exp((0.5 * logvar).clamp(max=44.3))" in d.fix
    assert "autocast" not in d.fix and "amax" not in d.fix


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.RNN(4, 16, batch_first=True, nonlinearity="relu")
        self.fc = nn.Linear(16, 1)
        with torch.no_grad():
            self.rnn.weight_hh_l0.copy_(torch.eye(16) * 4.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.rnn(x)[0][:, -1])


def test_e2e_float32_rnn_explosion_points_at_the_recurrent_weights() -> None:
    torch.manual_seed(0)
    model = Recurrent()
    d, _ = run(model, lambda i: model(torch.rand(2, 80, 4)).pow(2).mean().backward())
    assert d is not None and d.code == "NW101" and d.path == "rnn"
    assert "at step 0, before any optimizer update" in text(d)
    assert "self.rnn.named_parameters()" in d.fix and "orthogonal_" in d.fix
    assert "autocast" not in d.fix and "cuda" not in d.fix


def test_e2e_float32_loss_overflow_from_exploded_outputs_is_nw101_with_clipping() -> None:
    # an MSE loss computed outside any module: its autograd node names aten.mse_loss, and the
    # model's outputs are past sqrt(finfo(float32).max), so their square is inf: values
    # exploded
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x, y = torch.randn(16, 4), torch.zeros(16, 1)

    def step(i: int) -> None:
        if i == 2:
            with torch.no_grad():
                model[2].weight.fill_(1e19)  # what a runaway learning rate leaves behind
        F.mse_loss(model(x), y).backward()

    d, t = run(model, step)
    assert d is not None and t is not None and t.step == 2
    assert d.code == "NW101" and d.path == "(loss)" and d.op == "aten.mse_loss"
    root = math.sqrt(torch.finfo(torch.float32).max)
    m = re.search(r"mse_loss made \+inf in float32 from inputs up to \|x\| = ([\d.e+]+)", text(d))
    assert m is not None and float(m.group(1)) >= root
    assert "the values grew during training" in text(d)
    assert d.fix.startswith("torch.nn.utils.clip_grad_norm_") and "autocast" not in d.fix


class RMSNorm(nn.Module):
    """T5's norm: w * x * rsqrt(mean(x²) + eps). For |x| past sqrt(finfo.max) the mean of
    squares is inf and rsqrt(inf) = 0: the forward stays finite. In backward, a large
    gradient times a large w is inf, and inf times that 0 is NaN."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("scale", [1e20, 1e3])
def test_e2e_a_norm_whose_forward_hid_x_squared_overflow_is_nw101_in_backward(
    scale: float,
) -> None:
    # what a runaway learning rate did to a T5 (lr 1e4): activations at 2.8e26, the final
    # RMS norm's forward finite, its backward NaN; NW100 said only "non-finite value"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), RMSNorm(8), nn.Linear(8, 1))
    x = torch.randn(16, 4)

    def step(i: int) -> None:
        if i == 2:
            with torch.no_grad():  # what a runaway learning rate leaves in the weights
                for name, p in model.named_parameters():
                    if name.endswith("weight"):
                        p.mul_(scale)
        model(x).pow(2).mean().backward()

    d, t = run(model, step)
    if scale < math.sqrt(torch.finfo(torch.float32).max):
        assert d is None  # large but far from the range: nothing to say
        return
    assert d is not None and t is not None and t.step == 2
    assert d.code == "NW101" and d.path == "1" and d.phase == "backward"
    assert "born in the backward of 1" in text(d) and "inf × 0 = NaN" in text(d)
    assert "past sqrt(3.4e+38)" in text(d) and "the values grew during training" in text(d)
    assert d.fix.startswith("torch.nn.utils.clip_grad_norm_")


def test_e2e_float32_exp_overflow_in_loss_code_is_named_by_its_op_not_by_magnitudes() -> None:
    # exp(100) overflows float32 although 100 is far below sqrt(max): the autograd graph
    # names the exp (its input is not kept: ExpBackward saves only the result), and the
    # record-only path, which needs inputs past sqrt(max), stays out of it
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    x = torch.randn(8, 4)

    def step(i: int) -> None:
        out = model(x) + (100.0 if i == 2 else 0.0)
        (out.exp().sum() * 0 + out.exp().sum()).backward()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d, t = run(model, step)
    assert not [w for w in caught if "raised" in str(w.message)]  # no rule fault
    assert d is not None and t is not None and t.step == 2
    assert d.code == "NW101" and d.op == "aten.exp" and d.path == "(loss)"
    assert "its input was not kept by autograd" in text(d) and "NaN" not in text(d)
    assert "past sqrt" not in text(d)


def test_e2e_a_nan_target_made_in_the_loop_for_a_functional_loss_is_bad_data() -> None:
    # targets standardized per batch: a batch of equal targets divides by a std of 0. No
    # module sees a functional loss's target; its guard read it, and NW401 names it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))

    def step(i: int) -> None:
        x = torch.randn(16, 3)
        y = x.sum(1, keepdim=True) if i < 2 else torch.full((16, 1), 2.0)
        y = (y - y.mean()) / y.std()
        F.mse_loss(model(x), y).backward()

    d, t = run(model, step)
    assert d is not None and t is not None and t.step == 2
    assert d.code == "NW401" and d.title == "NaN or inf in the loss targets"
    assert d.path == "F.mse_loss" and "test_rules_domain_more.py:" in d.evidence[0]
    assert "holds NaN" in d.evidence[0] and "was finite" in d.evidence[1]
    assert "std().clamp_min" in d.fix


def test_e2e_a_nan_prediction_with_a_finite_target_is_not_blamed_on_the_target() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))

    def step(i: int) -> None:
        x = torch.randn(16, 3)
        out = model(x)
        if i == 2:
            out = out / (out - out)  # 0/0 in loss code, not in the target
        F.mse_loss(out, torch.zeros(16, 1)).backward()

    d, t = run(model, step)
    assert d is not None and t is not None and t.step == 2
    assert d.code != "NW401"


def test_every_new_code_is_registered_with_the_next_free_numbers() -> None:
    assert REGISTRY["NW113"].title == "Mean or variance over too few elements"
    assert REGISTRY["NW114"].title == "Function outside its domain"
    assert REGISTRY["NW110"].title == "Log of zero or of a negative number"  # unchanged


def test_nw101_without_an_op_or_a_line_names_the_module_and_its_device() -> None:
    b = TraceBuilder(1)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-1.0, 1.0), dtype="float16")
    blk = b.call("enc.ffn", "FFN", parent=net)
    b.input(blk, source=x, dtype="float16")
    b.forward(blk, counted(-1.0, INF, posinf=3), dtype="float16")
    d = top(b.build())
    assert d.code == "NW101" and d.op is None
    assert (
        "model.enc.ffn.float()" in d.fix and "torch.autocast('cpu', dtype=torch.bfloat16)" in d.fix
    )
    no_placeholder(d)
    assert "..." not in d.fix

    ev = event("aten.cumsum.default", "+inf", [("self", counted(0.0, 9000.0))], dtype="float16")
    d = top(module_trace(ev, path="enc.ffn", dtype="float16"))
    assert d.code == "NW101" and "call cumsum on .float() inputs" in d.fix
    assert "model.enc.ffn's forward" in d.fix
    no_placeholder(d)


def test_catch_all_for_a_backward_op_with_its_forward_line_does_not_ask_for_it() -> None:
    ev = event(
        "aten.mul.Tensor",
        "NaN",
        [("self", counted(0.0, INF, posinf=1)), ("other", counted(0.0, 0.0, zeros=4))],
        code="y = torch.special.i1e(x)",
    )
    ev.phase, ev.node = Phase.BACKWARD, "SpecialI1EBackward0"
    d = top(module_trace(ev))
    assert d.code == "NW100" and "detect_anomaly" not in d.fix and "forensic" not in d.fix
    assert "SpecialI1EBackward0 is the backward of the forward op at model.py:7" in d.fix


@pytest.mark.parametrize("in_module", [True, False])
def test_e2e_a_loss_over_an_empty_selection_is_nw113(in_module: bool) -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 2)
    crit = nn.SmoothL1Loss()
    loss_fn = crit if in_module else F.smooth_l1_loss

    def step(i: int) -> None:
        p = model(torch.randn(4, 6))
        keep = torch.rand(4) > (0.2 if i < 2 else 2.0)  # step 2: nothing selected
        loss_fn(p[keep], torch.zeros_like(p[keep])).backward()

    d, t = run(model, step, *([crit] if in_module else []))
    assert d is not None and t is not None and t.step == 2
    assert d.code == "NW113" and d.op is not None and d.op.startswith("aten.smooth_l1_loss")
    assert d.path == ("SmoothL1Loss" if in_module else "(loss)")
    assert "with reduction='mean' of an empty tensor (0 values)" in text(d)
    if in_module:  # the user's own line, guarded: 0 (with a graph) when nothing is kept
        assert (
            "(loss_fn(p[keep], torch.zeros_like(p[keep])) if p[keep].numel() else "
            "p[keep].sum() * 0)" in d.fix
        )
    else:
        assert "F.smooth_l1_loss(pred, y, reduction='sum') / max(pred.numel(), 1)" in d.fix


def test_a_loss_with_reduction_sum_over_nothing_is_not_nw113() -> None:
    empty = TensorStat(0.0, 0.0, 0, nan=0, posinf=0, neginf=0, zeros=0)
    ev = event("aten.mse_loss.default", "NaN", [], other_inputs=[("self", empty)])
    assert shortfall(ev) is not None  # the schema default: reduction=mean
    ev.scalars["reduction"] = 2
    assert shortfall(ev) is None


def test_nw114_backward_of_acos_at_an_endpoint_replaces_the_exact_clamp() -> None:
    ev = event(
        "aten.rsqrt.default",
        "+inf",
        [("self", counted(0.0, 2.4e-07, numel=6, zeros=4))],
        code="return torch.acos(cos.clamp(-1, 1))",
    )
    ev.phase, ev.node = Phase.BACKWARD, "AcosBackward0"
    assert classify(ev) == "domain"  # not NW112's sqrt: the rsqrt is acos's derivative
    d = top(module_trace(ev))
    assert d.code == "NW114" and d.op == "aten.rsqrt"
    assert "the forward acos was given values on the edge of [-1, 1]" in text(d)
    assert "-1/sqrt(1 - x²)" in text(d)
    assert "return torch.acos(cos.clamp(-1 + eps, 1 - eps))" in d.fix


class ClampedAngle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        cos = F.cosine_similarity(self.proj(a), self.proj(b), dim=-1)
        return torch.acos(cos.clamp(-1, 1))  # finite forward, infinite gradient at 1


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_e2e_acos_clamped_exactly_to_one_is_nw114_in_backward(mode: str) -> None:
    torch.manual_seed(0)
    model = ClampedAngle()
    a = torch.randn(6, 4)
    with nanwatch.watch(model, on_anomaly="record", mode=mode) as nw:
        model(a, a.clone()).mean().backward()
        nw.step()
    t = next(t for t in nw.history if t.anomaly is not None)
    d = t.diagnoses[0]
    assert d.code == "NW114" and d.phase == "backward" and d.path == "ClampedAngle"
    assert "-1/sqrt(1 - x²)" in text(d)
    assert "clamp(-1 + eps, 1 - eps)" in d.fix
    if mode == "watch":  # the module's own backward, run again on its inputs (seeded with
        # the step's gradient at its output): the node
        assert d.op == "aten.acos" and "AcosBackward0 (aten.acos) made -inf" in text(d)
        assert "return torch.acos(cos.clamp(-1, 1))" in text(d)  # the user's line
    else:
        assert d.op == "aten.rsqrt" and "AcosBackward0" in text(d)


# ------------------------------------------------------------------ NW301: what the update was


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, **kw: Any) -> Any:
    """Train under watch (on_anomaly='record'); the first step with a diagnosis."""
    with nanwatch.watch(model, on_anomaly="record", **kw) as nw:
        for _ in range(steps):
            x = torch.randn(4, 4, dtype=next(model.parameters()).dtype)
            loss = F.cross_entropy(model(x).float(), torch.randint(0, 2, (4,)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return next((t for t in nw.history if t.diagnoses), None), nw


def test_weights_loaded_non_finite_are_not_blamed_on_an_update() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    sd = model.state_dict()
    sd["2.weight"][1, 3] = float("nan")  # a checkpoint saved after a run diverged
    model.load_state_dict(sd)
    t, _ = _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
    assert t is not None and t.step == 0
    d = t.diagnoses[0]
    assert d.code == "NW301" and d.title == "Non-finite weights before the first update"
    assert "2.weight" in d.evidence[0] and "no optimizer update had run" in d.evidence[-1]
    assert "torch.isfinite(t)" in d.fix
    assert "before any update nanwatch saw" in t.anomaly.summary


def test_a_nan_learning_rate_is_named_as_the_cause() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    zero = torch.tensor(0.0)  # warmup_steps = 0, in torch math: 0 / 0 = NaN
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: float(torch.tensor(float(s)) / zero))
    t, _ = _train(model, opt, 2)
    assert t is not None and t.step == 0
    d = t.diagnoses[0]
    assert d.code == "NW301" and d.title == "Non-finite learning rate"
    assert "AdamW's learning rate was NaN at the update of step 0" in d.evidence
    assert "math.isfinite(lr)" in d.fix


def test_an_adam_eps_that_is_zero_in_float16_weights_is_named() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).half()
    t, _ = _train(model, torch.optim.Adam(model.parameters(), lr=1e-3), 3)
    assert t is not None
    d = t.diagnoses[0]
    assert d.code == "NW301" and d.title == "Optimizer eps is 0 in the weights' dtype"
    tiny = torch.finfo(torch.float16).tiny * torch.finfo(torch.float16).eps
    assert f"Adam's eps=1e-8 is 0 in float16, whose smallest positive value is {tiny:.3g}" in (
        " ".join(d.evidence)
    )
    # the test's own lines: the model built without .half(), the optimizer with eps=1e-4
    assert d.fix.startswith("model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))")
    assert "torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)" in d.fix


def test_float16_adam_with_an_eps_that_float16_holds_stays_silent() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).half()
    t, nw = _train(model, torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4), 4)
    assert t is None and nw.anomalies == []
    notes = [n for n in nw.history[-1].notes if n.kind == "optimizer"]
    assert [n.path for n in notes] == ["Adam"]
    assert notes[0].data["groups"] == [
        {
            "group": 0,
            "params": 4,
            "dtypes": ["float16"],
            "names": ["0.weight", "0.bias", "2.weight", "2.bias"],
            "lr": 1e-3,
            "eps": 1e-4,
            "betas": [0.9, 0.999],
        }
    ]


def test_an_optimizer_of_other_weights_writes_no_note() -> None:
    torch.manual_seed(0)
    watched, other = nn.Linear(4, 2), nn.Linear(4, 2)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with nanwatch.watch(watched) as nw:
        watched(torch.randn(2, 4)).sum().backward()
        other(torch.randn(2, 4)).sum().backward()
        opt.step()
        nw.step()
    assert not [n for n in nw.history[-1].notes if n.kind == "optimizer"]


class LogProbs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.softmax(self.fc(x), dim=-1) + 1e-8)  # 1e-8 is 0 in float16


def test_a_loss_made_inf_from_the_models_neg_inf_output_is_traced_to_it() -> None:
    # the model returns log-probabilities with -inf (a mask, not yet an anomaly); nll_loss in
    # loss code makes +inf of it: the -inf's first record is the model's, and it is NW110
    torch.manual_seed(0)
    model = LogProbs().half()

    def step(i: int) -> None:
        x = (torch.randn(6, 4) * (1 if i < 2 else 300)).half()
        F.nll_loss(model(x).float(), torch.randint(0, 3, (6,))).backward()

    d, t = run(model, step)
    assert d is not None and t is not None and t.anomaly is not None and t.step == 2
    assert t.anomaly.neginf_source is not None and t.anomaly.neginf_source.path == "LogProbs"
    assert "from -inf first seen in LogProbs" in t.anomaly.summary
    assert d.code == "NW110" and "F.log_softmax" in d.fix


def test_a_log_of_a_softmax_plus_an_eps_float16_cannot_hold_is_taken_as_log_softmax() -> None:
    """The op pinpointed (forensic, or read late and replayed): the fix only raised the eps
    (1e-8 -> 1e-4) and never said log_softmax, which needs none and is exact."""
    torch.manual_seed(0)
    model = LogProbs().half()
    x = (torch.randn(6, 4) * 300).half()
    with nanwatch.watch(model, mode="forensic", on_anomaly="record", postmortem=False) as nw:
        F.nll_loss(model(x).float(), torch.randint(0, 3, (6,))).backward()
        nw.step()
    d = nw.history[0].diagnoses[0]
    assert (d.code, d.op) == ("NW110", "aten.log")
    first, alt = d.fix.splitlines()[:2]
    assert first.startswith("return F.log_softmax(self.fc(x), dim=-1)   # log(softmax(z))")
    assert alt.startswith("# or keep the softmax with an eps that float16 holds: return torch.log(")
    assert "Here the log is taken of a softmax: F.log_softmax computes it" in d.explanation
    with torch.no_grad():  # the pasted line: finite where the softmax underflowed to 0
        assert bool(torch.isfinite(F.log_softmax(model.fc(x), dim=-1)).all())
        assert not bool(torch.isfinite(model(x)).all())


def test_only_a_log_of_a_softmax_or_sigmoid_plus_the_eps_is_taken_in_log_space() -> None:
    from nanwatch.rules.domain import _log_of_activation

    got = _log_of_activation("lp = torch.log(1e-8 + z.sigmoid())", "1e-8")
    assert got == ("sigmoid", "F.logsigmoid", "lp = F.logsigmoid(z)")
    got = _log_of_activation("lp = (z.softmax(-1) + eps).log()", "eps")
    assert got == ("softmax", "F.log_softmax", "lp = z.log_softmax(-1)")
    # a mixture of softmaxes, a product: no single log_softmax is their log
    assert _log_of_activation("lp = torch.log(a.softmax(-1) * w + 1e-8)", "1e-8") is None
    assert (
        _log_of_activation("lp = torch.log(F.softmax(a, -1) + F.softmax(b, -1) + 1e-8)", "1e-8")
        is None
    )


def test_e2e_a_bfloat16_exp_overflow_is_bounded_not_upcast() -> None:
    """bfloat16 has float32's exponent: exp(100) is inf in both, so "compute it in float32,
    or train in bfloat16" was no fix for a bfloat16 model. The fix bounds the argument."""

    class Reparam(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mu, logvar = self.enc(x).chunk(2, -1)
            return mu + torch.exp(0.5 * logvar)

    model = Reparam().bfloat16()
    with torch.no_grad():
        model.enc.bias[4:].fill_(400.0)  # log-variance 400: exp(200) overflows
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(torch.rand(2, 8, dtype=torch.bfloat16)).float().sum().backward()
        nw.step()
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW101" and d.op is not None and d.op.startswith("aten.exp")
    assert ".clamp(max=" in d.fix and ".float()" not in d.fix
    assert "bfloat16" not in d.fix


@pytest.mark.parametrize("scale", [20.0, 25.0])
def test_e2e_a_kl_divided_by_tiny_probabilities_is_a_near_zero_division(scale: float) -> None:
    """KL(p || q) written as p * (p / q).log() with q = softmax of large logits: at x20 the
    forward is finite (q down to 1e-33) and the backward's -p/q² underflows q² to 0 (-inf);
    at x25 q reaches 7e-42 and p / q itself overflows. Neither denominator holds a zero:
    it was NW100 (backward: a -inf was not matched to its op) or "Division by zero, exact
    zeros: min 1.09e-33" (forensic), and NW101 "the values exploded" for the forward."""
    torch.manual_seed(0)
    model = nn.Linear(16, 10)
    x, p = torch.randn(32, 16), torch.randn(32, 10).softmax(-1)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        q = (model(x) * scale).softmax(-1)
        loss = (p * (p / q).log()).sum(-1).mean()
        loss.backward()
        nw.step()
    d = nw.history[0].diagnoses[0]
    assert (d.code, d.title, d.op) == ("NW111", "Division by a near-zero denominator", "aten.div")
    text = " ".join(d.evidence)
    assert "denominator holds no zero" in text and "exact zero" not in text
    if scale == 20.0:
        assert d.phase == "backward" and "-x/d²" in text and "rounds to 0" in text
    else:
        assert d.phase == "forward" and "x/d passes its largest value 3.4e+38" in text
    assert "log_softmax" in d.fix


@pytest.mark.parametrize(
    ("optimizer", "kw", "limit"),
    [
        (torch.optim.SGD, {}, 2.0),
        (torch.optim.SGD, {"momentum": 0.9}, 3.8),
        (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}, 2 * 1.9 / 2.8),
        (torch.optim.SGD, {"momentum": 0.9, "dampening": 0.5}, 7.6),
        (torch.optim.AdamW, {}, 2.0),
    ],
)
def test_the_weight_decay_limit_is_where_torch_optim_starts_to_diverge(
    optimizer: Any, kw: dict[str, Any], limit: float
) -> None:
    """NW306's limits on lr × weight_decay, checked against the optimizer itself: just
    below the limit a weight with a zero gradient decays, just above it grows."""
    from nanwatch.rules.gradients import _decay_growth

    def grows(a: float) -> bool:
        w = torch.nn.Parameter(torch.ones(1))
        opt = optimizer([w], lr=a, weight_decay=1.0, **kw)
        for _ in range(600):
            w.grad = torch.zeros(1)
            opt.step()
        return not abs(w.item()) <= 1

    group = {"lr": 1.0, "weight_decay": 1.0, **kw}
    name = optimizer.__name__
    assert not grows(limit * 0.99) and grows(limit * 1.01)
    assert _decay_growth(name, {**group, "lr": limit * 0.99}) is None
    found = _decay_growth(name, {**group, "lr": limit * 1.01})
    assert found is not None and found[0] == pytest.approx(limit, rel=1e-3) and found[1] > 1


def test_adams_coupled_weight_decay_is_normalized_and_never_diverges_by_itself() -> None:
    from nanwatch.rules.gradients import _decay_growth

    assert _decay_growth("Adam", {"lr": 1.0, "weight_decay": 1e3}) is None
    assert _decay_growth("Adam", {"lr": 1.0, "weight_decay": 1e3, "decoupled_weight_decay": True})


def test_e2e_a_weight_decay_meant_as_1e_3_given_as_1e3_is_named_at_the_first_step() -> None:
    """SGD(lr=0.5, weight_decay=1e3): each step multiplies the weights by -499; clipping
    cannot help (the decay is added inside step()). It was NW303 at step 4, then NW101
    'clip gradients' at step 7 with the clipping already in the loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, weight_decay=1e3)
    healthy = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=5e-4)
    with nanwatch.watch(model, criterion, postmortem=False) as nw:
        for o in (healthy, healthy):  # typical settings: nothing to say
            criterion(model(torch.randn(4, 8)), torch.tensor([0, 1, 2, 3])).backward()
            o.step()
            o.zero_grad()
            nw.step()
        criterion(model(torch.randn(4, 8)), torch.tensor([0, 1, 2, 3])).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with pytest.raises(nanwatch.AnomalyError) as caught:
            nw.step()
    d = caught.value.diagnosis
    assert (d.code, d.step) == ("NW306", 2)
    assert "lr 0.5 × weight_decay 1000 = 500, past 2" in d.evidence[0]
    assert "by up to 499 in size" in d.evidence[1]
    assert "weight_decay=0.01" in d.fix


def test_e2e_a_fully_padded_sample_in_multihead_attention_gets_a_key_padding_mask_fix() -> None:
    """nn.MultiheadAttention builds the -inf mask itself: "masked_fill with finfo.min" is
    code its user cannot change; the fix is in the key_padding_mask it is given."""
    attn = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(3, 5, 8)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[1] = True  # sample 1 has no real token
    with nanwatch.watch(attn, on_anomaly="record", postmortem=False) as nw:
        out, _ = attn(x, x, x, key_padding_mask=pad)
        out.sum().backward()
        nw.step()
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW402"
    assert "key_padding_mask[empty, 0] = False" in d.fix and "masked_fill" not in d.fix


def test_e2e_a_functional_mse_loss_that_overflows_names_its_op() -> None:
    """F.mse_loss on outputs of 1e20: (1e20)**2 is inf in float32. The module form named
    aten.mse_loss; the functional form (no module to re-run) said NW101 with no op."""
    model = nn.Linear(4, 8)
    with torch.no_grad():
        model.bias.fill_(1e20)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        F.mse_loss(model(torch.randn(2, 4)), torch.zeros(2, 8)).backward()
        nw.step()
    d = nw.history[0].diagnoses[0]
    assert (d.code, d.op, d.phase) == ("NW101", "aten.mse_loss", "forward")


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_e2e_a_minus_inf_computed_before_the_model_is_a_log_of_zero_not_an_overflow(
    mode: str,
) -> None:
    """A log-SNR of alpha_bar = 0 is -inf in the user's code; the first Linear turns it
    into ±inf. It was NW101 'values exploded, clip gradients' (the addmm was given a -inf,
    it did not overflow), and in forensic mode the op named was aten.abs: nanwatch's own
    |x| of the input, which the op checker saw."""
    torch.manual_seed(0)

    class TimeEmbedding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(1, 8)

        def forward(self, c: torch.Tensor) -> torch.Tensor:
            return torch.sin(self.lin(c[:, None]))

    model = nn.Sequential(TimeEmbedding(), nn.Linear(8, 1))
    alpha_bar = torch.rand(6) * 0.9 + 0.05
    alpha_bar[3] = 0.0
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        model(torch.log(alpha_bar / (1 - alpha_bar))).pow(2).mean().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.op.startswith("aten.addmm")
    d = nw.history[0].diagnoses[0]
    if mode == "forensic":  # the op checker saw the log itself, on the user's line
        assert d.code == "NW110" and d.op == "aten.log"
        assert d.evidence[0].startswith("aten.log of 0 is -inf")
        assert any("aten.addmm turned the -inf into +inf" in e for e in d.evidence)
        return
    assert d.code == "NW110" and "a -inf first appeared in" in d.evidence[0]
    assert "aten.addmm was given the -inf" in d.evidence[1]


def test_e2e_a_log_cosh_loss_on_an_outlier_names_cosh_and_clamps_both_sides() -> None:
    """log(cosh(pred - y)) with a target of 150 and predictions near 0: cosh(-150) is inf.
    It was NW100 with no op (cosh's node was not read), and forensic mode's fix clamped only
    from above (cosh(-150) stays inf) after quoting the input's largest value, 3."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    x = torch.randn(32, 8)
    y = 2 * x[:, 0]
    y[4] = 150.0
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        torch.log(torch.cosh(model(x).squeeze(-1) - y)).mean().backward()
        nw.step()
    d = nw.history[0].diagnoses[0]
    assert (d.code, d.op) == ("NW101", "aten.cosh")
    assert "from an input up to |x| = 15" in d.evidence[0]  # the -150, not the max
    # the same loss without cosh: a clamp inside cosh would zero the outlier's gradient
    assert "softplus(-2 * d.abs())" in d.fix.split("\n")[0] and "clamp(-44.3, 44.3)" not in d.fix


def test_e2e_an_exp_overflow_a_min_hid_in_forward_is_an_overflow_in_backward() -> None:
    """PPO's ratio exp(logp - old_logp) with a stale old_logp of -120: exp(~119) is inf,
    the clipped branch of the min hides it (the loss is finite), and ExpBackward0 makes
    0 × inf = NaN. It was NW100 'aten.exp made NaN from finite inputs' with a fix about
    sqrt and acos endpoints."""
    torch.manual_seed(0)
    policy = nn.Linear(8, 1)
    old_logp = torch.full((16,), -1.0)
    old_logp[7] = -120.0
    adv = torch.rand(16) + 0.5  # positive: min() takes the clipped branch where ratio is inf
    with nanwatch.watch(policy, on_anomaly="record", postmortem=False) as nw:
        logp = F.logsigmoid(policy(torch.randn(16, 8)).squeeze(-1))
        ratio = torch.exp(logp - old_logp)
        loss = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv).mean()
        assert torch.isfinite(loss)
        loss.backward()
        nw.step()
    d = nw.history[0].diagnoses[0]
    assert (d.code, d.op, d.phase) == ("NW101", "aten.exp", "backward")
    assert "in forward, aten.exp overflowed" in d.evidence[0] and "0 × inf" in d.evidence[1]
    # an importance ratio against stored log-probabilities (old_logp has no gradient):
    # the log-ratio bounded on the user's line, then the KL early stop (it was the generic
    # ".clamp(max=44.3)" of any exp)
    assert d.fix.startswith("ratio = torch.exp((logp - old_logp).clamp(max=20))"), d.fix
    assert "approx_kl = (old_logp - logp).mean().item()" in d.fix


def test_e2e_a_division_by_a_python_zero_gets_a_floor_not_a_tensor_clamp() -> None:
    """Gumbel-softmax with tau annealed to exactly 0.0, a Python float: 'd.clamp_min(eps)'
    was the fix, and there is no tensor d to clamp."""

    class Gumbel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)
            self.tau = 0.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(self.lin(x) / self.tau, dim=-1)

    model = Gumbel()
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(torch.randn(2, 4)).sum().backward()
        nw.step()
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW111" and "denominator: the scalar 0.0" in d.evidence[0]
    assert d.fix.startswith("return torch.softmax(self.lin(x) / max(self.tau, 1e-3), dim=-1)")
    assert "clamp_min" not in d.fix and "Python number" in d.explanation
