"""Overflow: an op exceeded the dtype's range (NW101), and the early warnings before it
does: headroom nearly gone (NW102), logits approaching the exp bound (NW103), and a
magnitude trend that reaches the dtype's limit within a few steps (NW104).

Every limit is read from ``torch.finfo`` of the tensor at hand (``nanwatch.stats.
dtype_limits``): float16's largest value is 65504 and exp overflows above log(65504) =
11.09; bfloat16 and float32 overflow exp above 88.7.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import itertools
import math
import re
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nanwatch import _graph
from nanwatch._updates import numbers as _numbers
from nanwatch.localize import custom_function
from nanwatch.records import (
    LOSS_PATH,
    Anomaly,
    AnomalyKind,
    Note,
    OpEvent,
    Phase,
    Record,
    StepTrace,
    TensorStat,
)
from nanwatch.rules._evidence import (
    CAST,
    EXP_LIKE,
    MATMUL,
    _calls_of,
    _loss_line_of,
    anomaly_fields,
    cause_of,
    code_line,
    count,
    describe_stat,
    device_type,
    first_input,
    first_root_outputs,
    fmt,
    fresh_name,
    group_holding,
    identifiers,
    input_named,
    inputs_of,
    limits,
    loss_input_rewrite,
    loss_kind,
    low_precision,
    model_call,
    module_ref,
    op_fields,
    operands,
    packet,
    param_named,
    paren,
    postfix_start,
    rewrite_call,
    scalar_base,
    short_op,
    signed_max,
    statements,
    untraced_hint,
    watched_params,
)
from nanwatch.rules.base import REGISTRY, Diagnosis, RuleContext, rule
from nanwatch.rules.gradients import (
    _SAFE_SHARE,
    _group_lrs,
    _growing_averages,
    _grown_outside,
    _normalized,
    _Oversize,
    _oversized_update,
    _round_down,
    _same_spike,
    _times,
    _user_scope,
    hyper,
    unreset_grads,
)
from nanwatch.stats import DtypeLimits

# ---------------------------------------------------------------------- NW101


@rule(
    "NW101",
    title="Floating-point overflow",
    severity="error",
    summary=(
        "An op made inf from finite inputs: exp, softmax, a matmul or a cast went past the "
        "dtype's largest value (float16: exp overflows above log(65504) = 11.09; in "
        "float32, values that exploded)."
    ),
    priority=15,
)
def overflow(ctx: RuleContext) -> Iterator[Diagnosis]:
    for d in _overflow(ctx):
        _told_loss_factor(ctx, d)
        yield d


def _told_loss_factor(ctx: RuleContext, d: Diagnosis) -> None:
    """A gradient that overflowed in a short-range dtype where backward ran on the loss
    times a constant (``(loss * 2 ** 20).backward()``, manual loss scaling; the
    ``"loss_factor"`` note): that constant multiplied every gradient, and it is what to
    lower. A ``clip_grad_norm_`` after it saw an inf total norm (the ``"clip_nonfinite"``
    note): its factor max_norm / inf is 0."""
    a = ctx.anomaly
    if a is None or d.phase not in (Phase.BACKWARD.value, Phase.GRADIENT.value):
        return
    lim = low_precision(a.record.dtype)
    factors = [
        float(n.data["factor"])
        for n in ctx.notes("loss_factor")
        if isinstance(n.data.get("factor"), float)
    ]
    if lim is None or not lim.short_range or not factors or abs(factors[-1]) < 2:
        return
    c, top, dtype = factors[-1], fmt(lim.max), a.record.dtype
    power = math.log2(abs(c))
    named = f"2 ** {int(power)}" if power.is_integer() else fmt(c)
    d.evidence.append(
        f"backward ran on the loss times {named} ({fmt(c)}, a constant loss scale): every "
        f"gradient is {fmt(abs(c))} times the loss's own, and in {dtype} those past {top} "
        "are inf"
    )
    clip = next(iter(ctx.notes("clip_nonfinite")), None)
    if clip is not None:
        at = f" at {clip.source}" if clip.source else ""
        d.evidence.append(
            f"clip_grad_norm_{at} then got a total norm of inf: it multiplies every "
            "gradient by max_norm / inf = 0, so the finite ones become 0 and the inf ones NaN "
            "(0 × inf), which the optimizer step writes into the weights"
        )
    d.explanation = (
        f"The gradients are the loss's times the constant {fmt(c)} backward ran on: in "
        f"{dtype} they pass {top}. A static scale that large overflows; dividing the "
        "gradients afterwards comes too late. " + d.explanation
    )
    d.fix = (
        f"# lower the scale until the largest gradient fits {dtype} (max {top}), or let "
        "torch.amp.GradScaler pick it: it skips a step whose gradients overflow and lowers "
        "the scale\n" + d.fix
    )


def _overflow(ctx: RuleContext) -> Iterator[Diagnosis]:
    a = ctx.anomaly
    if a is None or a.transient:
        return
    if _grown_outside(ctx, a) is not None:
        # weights no optimizer steps (an EMA copy) grew until this op overflowed: NW301
        # names the write; a lower lr, clipping or a float32 op would not touch them
        return
    cause = cause_of(a)
    if cause is not None and cause.kind != "overflow":
        made = _loss_code_product(ctx, a, cause.event)
        if made is not None:  # watch mode: the loss code's float16 product made the inf
            yield made
            return
    if cause is not None:
        if cause.kind == "overflow" and (piv := _zero_pivot(cause.event)) is not None:
            # not an overflow: a triangular / LU solve divided by a zero diagonal entry
            yield _zero_pivot_diagnosis(ctx, a, cause.event, piv)
        elif cause.kind == "overflow" and (zero := _zero_variance(cause.event)) is not None:
            # not an overflow: a normalization divided a constant row's 0 by sqrt(0 + eps)
            yield _zero_variance_diagnosis(ctx, a, cause.event, zero)
        elif cause.kind == "overflow":
            yield _from_op(ctx, a, cause.event, cause.trigger, cause.chain)
        elif cause.kind == "other":
            # an op with no rule of its own (a norm's variance) made NaN from finite values
            # so large that their square passes the dtype: the values exploded
            yield from _wide_from_record(ctx, a)
        return
    if (penalty := _weight_sum_overflow(ctx, a)) is not None:
        yield penalty  # watch / sentinel: a sum over float16 weights in the loss code
        return
    yield from _from_record(ctx, a)


def _weight_sum_overflow(ctx: RuleContext, a: Anomaly) -> Diagnosis | None:
    """Watch and sentinel mode, no op traced: the loss is +inf, and its graph sums a power
    (or a self-product, an absolute value) of watched float16 weights (a weight penalty
    written by hand; ``"weight_sum"`` notes) whose sum, computed from the weights' values,
    is past the dtype's largest value: each term fits, the sum held in float16 does not."""
    rec = a.record
    if a.kind is not AnomalyKind.FORWARD or a.path != LOSS_PATH or a.op is not None:
        return None
    if rec.stat is None or not rec.stat.has_posinf:
        return None
    notes = [n for n in ctx.notes("weight_sum") if isinstance(n.data.get("value"), float)]
    dtypes = {str(n.data.get("dtype")) for n in notes}
    if not notes or len(dtypes) != 1:
        return None
    dtype = dtypes.pop()
    lim = low_precision(dtype)
    if lim is None or not lim.short_range:
        return None
    values = [float(n.data["value"]) for n in notes]
    total = math.fsum(values)
    if not math.isfinite(total) or total <= lim.max:
        return None  # the weights' sums fit: something else made the inf
    if any(not math.isfinite(float(n.data.get("largest", math.nan))) for n in notes):
        return None  # a weight that is inf already: not the sum's doing
    top = fmt(lim.max)
    notes.sort(key=lambda n: -float(n.data["value"]))
    first = notes[0].data
    form, k = str(first.get("form")), float(first.get("exponent", 2.0))
    power = "2" if k == 2 else fmt(k)
    term = {"mul": "(p * p)", "abs": "p.abs()"}.get(form, f"(p ** {power})")
    fixed = {"mul": "(p.float() * p.float())", "abs": "p.float().abs()"}.get(
        form, f"p.float().pow({power})"
    )
    over = [n for n in notes if float(n.data["value"]) > lim.max]
    largest = max(float(n.data.get("largest", 0.0)) for n in notes)
    evidence = [
        f"the loss code sums {term} over {len(notes)} watched {dtype} weight"
        + ("s" if len(notes) > 1 else "")
        + f" (a weight penalty written by hand), and the sums are held in {dtype}: the "
        f"weights are finite, up to |w| = {fmt(largest)}",
    ]
    said = ", ".join(
        f"{n.data.get('parameter')} {fmt(float(n.data['value']))} "
        f"({int(n.data.get('numel', 0)):,} values)"
        for n in notes[:4]
    ) + (f", and {len(notes) - 4} more" if len(notes) > 4 else "")
    if over:
        evidence.append(
            f"{term}.sum() of each weight, from its values: {said}; "
            + (
                f"{over[0].data.get('parameter')}'s alone is past {top}"
                if len(over) == 1
                else f"{len(over)} of them are past {top} by themselves"
            )
            + f" (torch.finfo(torch.{dtype}).max): inf"
        )
    else:
        evidence.append(
            f"{term}.sum() of each weight fits {dtype} ({said}), but added up in {dtype} they "
            f"reach {fmt(total)}, past {top} (torch.finfo(torch.{dtype}).max): inf"
        )
    note_src = next((n.source for n in ctx.notes("loss_graph") if n.source), None)
    if note_src:
        evidence.append(f"the loss reached loss.backward() at {note_src} as +inf")
    evidence.append(untraced_hint(ctx))
    explanation = (
        f"{dtype} holds values up to {top}. The penalty sums {term} over "
        f"{sum(int(n.data.get('numel', 0)) for n in notes):,} {dtype} weights of ordinary "
        f"size and holds the sum in {dtype}: it reaches {fmt(total)} and becomes inf, so the "
        "loss is inf before backward (a coefficient applied after the sum comes too late). "
        "The weights are fine: a lower learning rate, clipping or a GradScaler does not help. "
        "Compute the penalty in float32 (its gradient still reaches the weights in "
        f"{dtype}), or let the optimizer apply the decay."
    )
    decay = (
        "# or drop the term and decay in the optimizer: weight_decay=2 * c (c: the penalty's "
        "coefficient; the gradient of c * p.pow(2).sum() is 2 * c * p)"
        if form != "abs" and k == 2
        else "# keep the rest of the loss in float32 from there"
    )
    fix = (
        f"penalty = sum({fixed}.sum() for p in model.parameters())   # was: a sum of "
        f"{term} in {dtype}; in float32 the sum, {fmt(total)}, fits\n{decay}"
    )
    fields = anomaly_fields(a)
    fields["op"] = "aten.sum"
    return ctx.diagnosis(**fields, evidence=evidence, explanation=explanation, fix=fix)


#: the class losses whose kernel (nll_loss, under cross_entropy too) keeps the sum of the
#: per-element losses, and for reduction='mean' the count it divides by, in its input's
#: dtype: in float16 a batch of ordinary losses sums past the max
_NLL_LOSSES = ("F.cross_entropy", "CrossEntropyLoss", "F.nll_loss", "NLLLoss")
_NLL_OPS = ("nll_loss_forward", "nll_loss2d_forward", "nll_loss", "nll_loss2d", "nll_loss_nd")


def _class_loss_sum(ctx: RuleContext, a: Anomaly, ev: OpEvent | None) -> Diagnosis | None:
    """A cross-entropy / NLL loss of finite low-precision input that is inf (or NaN): every
    per-element loss fits the dtype (its bound from the input's range), so the mean does
    too; the sum over the batch (and, for 'mean', the count) held in that dtype did not.
    ``ev``: the loss kernel's op event when traced; None in watch and sentinel mode, where
    the guard's ``"loss_input"`` note gives the input's range."""
    rec = a.record
    dtype = (ev.dtype if ev is not None else "") or rec.dtype
    lim = low_precision(dtype)
    if lim is None or not lim.short_range or a.kind is not AnomalyKind.FORWARD:
        return None
    if ev is not None and (packet(ev.op) not in _NLL_OPS or ev.phase is not Phase.FORWARD):
        return None
    call = next((c for c in ctx.trace.calls if c.id == rec.call), None)
    if ev is None and (call is None or not call.is_loss):
        return None
    notes = [
        n
        for n in ctx.notes("loss_input")
        if n.data.get("loss") in _NLL_LOSSES and n.data.get("input_dtype") == dtype
    ]
    if len(notes) != 1:
        return None  # no loss of that dtype, or several: which one summed is not known
    note = notes[0]
    d = note.data
    loss = str(d.get("loss"))
    reduction = d.get("reduction")
    shape, target = d.get("input_shape"), d.get("target_shape")
    if reduction not in ("mean", "sum") or not isinstance(target, list):
        return None
    n = math.prod(int(v) for v in target) - int(d.get("ignored") or 0)
    out = ev.output if ev is not None else rec.stat
    if out is None or n <= 0 or out.has_neginf:
        return None
    lo_in, hi_in = d.get("input_min"), d.get("input_max")
    if not isinstance(lo_in, (int, float)) or not isinstance(hi_in, (int, float)):
        return None
    if not (math.isfinite(lo_in) and math.isfinite(hi_in)):
        return None  # a non-finite input: not this loss's own sum
    x = first_input(ev) if ev is not None else None
    classes: int | None = None
    low: float | None = None
    if x is not None and x.finite and x.max <= 0:  # the kernel's input: log-probabilities
        high, low = -x.min, -x.max
    elif loss.endswith("cross_entropy") or loss == "CrossEntropyLoss":
        if not isinstance(shape, list) or not shape:
            return None
        classes = int(shape[1] if len(shape) > 1 else shape[0])
        # -log softmax(z)[y] = logsumexp(z) - z[y] <= (max - min) + log(C)
        high = (hi_in - lo_in) + math.log(max(classes, 1))
    elif hi_in <= 0:  # nll_loss of log-probabilities
        high, low = -lo_in, -hi_in
    else:
        return None
    if not math.isfinite(high) or high >= lim.max:
        return None  # one element's loss can pass the max by itself: not the sum's doing
    counted = reduction == "mean" and n > lim.max
    if not (out.has_posinf and n * high > lim.max) and not (out.has_nan and counted):
        return None
    top = fmt(lim.max)
    held = (
        f"the sum of their losses and their count are held in {dtype} before the division"
        if reduction == "mean"
        else f"the sum of their losses is held in {dtype}"
    )
    floor = low if low is not None and low > 0 else None
    evidence = [
        f"{loss} got {dtype} input (finite, {fmt(lo_in)} to {fmt(hi_in)}) for {n:,} "
        f"targets and computes in {dtype}: {held}",
        f"each per-element loss is at most {fmt(high)}"
        + (f" and at least {fmt(floor)}" if floor is not None else "")
        + ": their sum "
        + (
            f"is at least {fmt(n * floor)}"
            if floor is not None and n * floor > lim.max
            else f"can reach {fmt(n * high)}"
        )
        + f", past {top} (torch.finfo(torch.{dtype}).max): inf",
    ]
    if counted:
        evidence.append(f"the count, {n:,}, is past {top} too: inf / inf = NaN")
    if reduction == "mean":
        chance = (
            f" (a guess at chance over {classes:,} classes scores log({classes:,}) = "
            f"{fmt(math.log(classes))})"
            if classes is not None and classes > 1
            else ""
        )
        evidence.append(
            f"reduction='mean' divides only after that sum: the mean itself (at most "
            f"{fmt(high)}) fits {dtype}, but over {n:,} targets any mean above "
            f"{fmt(lim.max / n)} sums past {top}{chance}"
        )
    else:
        evidence.append(f"reduction='sum': the loss is that sum, and {dtype} cannot hold it")
    line = _loss_line_of(note)
    where = ev.source if ev is not None and ev.source else note.source
    if ev is not None and (at := code_line(ev)) is not None:
        evidence.append(at)
    elif where and line:
        evidence.append(f"at {where}: {line}")
    explanation = (
        f"{dtype} holds values up to {top}. {loss} of {dtype} input computes in {dtype}: "
        f"each per-element loss is small, but the sum over the batch"
        + (" and the count it is divided by are" if reduction == "mean" else " is")
        + f" held in {dtype} too, so {n:,} ordinary losses add up past {top}. The model "
        "and its values are fine: a lower learning rate, clipping or a GradScaler does not "
        "help, the loss is non-finite before backward. Give the loss float32 input; its "
        f"gradient still returns to the {dtype} model in {dtype}."
    )
    fname = (
        loss if loss.startswith("F.") else "F." + ("nll_loss" if "NLL" in loss else "cross_entropy")
    )
    new = loss_input_rewrite(note, lambda e: f"{paren(e)}.float()")
    first = (
        f"{new}  # was: {line}"
        if new is not None and line
        else f"loss = {fname}(logits.float(), target)   # the loss's input in float32"
    )
    device = device_type(ev, rec.device)
    fix = (
        f"{first}\n"
        f"# the loss in float32: the sum over {n:,} targets fits, and the gradient goes back "
        f"to the {dtype} model as {dtype}\n"
        f"# or keep float32 weights and run the forward under torch.autocast(device_type="
        f"{device}, dtype=torch.{dtype}): autocast computes {fname} in float32"
    )
    fields = op_fields(ev, a) if ev is not None else anomaly_fields(a)
    if ev is None and note.source:
        fields["source"] = note.source
    return ctx.diagnosis(**fields, evidence=evidence, explanation=explanation, fix=fix)


#: autograd nodes of the loss graph (``"loss_graph"`` notes, lowercased, no "Backward0")
#: that sum products over an inner dimension: a Gram matrix, a similarity, a projection
_GRAPH_PRODUCTS = ("bmm", "mm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "dot")
#: nodes that can overflow by themselves: with one in the graph, the product is not alone
_GRAPH_OVERFLOWS = ("exp", "exp2", "expm1", "pow", "cumprod", "prod", "sinh", "cosh")


def _loss_code_product(ctx: RuleContext, a: Anomaly, ev: OpEvent) -> Diagnosis | None:
    """Watch mode, the op untraced: the loss op (``mse_loss``) was given +inf, and no NaN,
    in float16, that no traced op made, while every watched output of the step was finite
    and of that dtype, and the loss code's graph multiplies them (``bmm``: a Gram matrix
    ``f @ f.transpose(1, 2)``) with no exp or power that could overflow instead: the
    product's sums passed the dtype's max in the loss code."""
    if ev.phase is not Phase.FORWARD or ev.cause is not None or ev.source is not None:
        return None
    if (ev.path or a.path) != LOSS_PATH:
        return None
    lim = limits(ev.dtype)
    if lim is None or not lim.short_range:
        return None  # bfloat16 has float32's range: float32 would overflow the same
    ins = [(n, st) for n, st in ev.inputs if st is not None]
    infs = [(n, st) for n, st in ins if st.has_posinf or st.has_neginf]
    if not infs or any(st.has_nan for _, st in ins):
        return None  # a NaN that came in is not an overflow
    graph = [
        str(op).lower()
        for n in ctx.notes("loss_graph")
        if isinstance(n.data.get("ops"), list)
        for op in n.data["ops"]
    ]
    products = [op for op in graph if op in _GRAPH_PRODUCTS]
    if not products or any(op in _GRAPH_OVERFLOWS for op in graph):
        return None
    losses = {c.id for c in ctx.trace.calls if c.is_loss}
    outs = [
        r
        for r in ctx.trace.records
        if r.phase is Phase.FORWARD
        and r.call not in losses
        and r.stat is not None
        and r.index < a.record.index
    ]
    if not outs or any(not r.stat.finite for r in outs if r.stat is not None):
        return None
    same = [r for r in outs if r.dtype == ev.dtype and r.stat is not None]
    if not same:
        return None
    big = max(r.stat.magnitude for r in same if r.stat is not None)
    top = max(same, key=lambda r: r.stat.magnitude if r.stat is not None else 0.0)
    op = packet(ev.op)
    name, st = infs[0]
    count = f"{st.posinf} +inf of {st.numel}" if st.posinf else st.kinds()
    chain = " <- ".join(graph[: graph.index(products[0]) + 1])
    prod = products[0]
    evidence = [
        f"{op}'s input {name} holds {count} in {ev.dtype}, and no NaN: values past "
        f"{fmt(lim.max)}, {ev.dtype}'s largest value, made in the loss code before {op}",
        f"the watched model's {ev.dtype} outputs were finite, up to |x| = {fmt(big)} "
        f"({top.role} of {top.path}): the inf was made after them",
        f"the loss code's graph, from the loss back: {chain}: {prod} sums products of those "
        f"values over its inner dimension, and a sum of more than "
        f"{math.ceil(lim.max / max(big * big, lim.tiny))} products of values up to "
        f"{fmt(big)} passes {fmt(lim.max)}",
        untraced_hint(ctx),
    ]
    explanation = (
        f"{ev.dtype} holds values up to {fmt(lim.max)}. The loss code multiplies the model's "
        f"{ev.dtype} outputs ({prod}: a Gram matrix or a similarity, f @ f.transpose(-1, -2)) "
        f"and sums the products in {ev.dtype}: the sums passed {fmt(lim.max)} and became "
        f"+inf, which {op} turned into NaN. A division after the product (/ (c * h * w)) comes "
        "too late. Compute the product in float32: the model can stay in "
        f"{ev.dtype}, and the loss's gradient still flows back to it."
    )
    fix = (
        f"y = a.float() @ b.float()   # was: y = a @ b, the product ({prod}) in the loss code "
        f"on the model's {ev.dtype} outputs (a Gram matrix: f.float() @ f.transpose(-1, "
        "-2).float())\n"
        "# keep the loss in float32 from there; mode='forensic' (or nw.replay(step_fn)) names "
        "the product's line\n"
        "# or train in bfloat16 (float32's range): "
        f"torch.autocast(device_type={device_type(ev, a.record.device)}, dtype=torch.bfloat16)"
    )
    fields = anomaly_fields(a)
    fields["op"] = f"aten.{prod}"
    return ctx.diagnosis(**fields, evidence=evidence, explanation=explanation, fix=fix)


#: normalizations that divide by sqrt(var + eps): a constant row has var 0, and with eps
#: 0 its 0 / sqrt(0) is NaN (the op's own eps argument is recorded in its scalars)
_VAR_NORMS = {
    "native_layer_norm": ("LayerNorm", "row"),
    "layer_norm": ("LayerNorm", "row"),
    "native_group_norm": ("GroupNorm", "group"),
    "group_norm": ("GroupNorm", "group"),
}
#: the eps torch's own normalization layers default to
_NORM_EPS = "1e-5"


@dataclass(frozen=True)
class _ZeroVariance:
    """A LayerNorm / GroupNorm that made NaN or inf from finite inputs of ordinary size,
    with an eps that does not keep 1 / sqrt(var + eps) finite."""

    layer: str  #: ``LayerNorm``
    unit: str  #: what is normalized: ``row``, ``group``
    eps: float
    big: float  #: the largest |input| (the data, the weight, the bias)
    data: tuple[str, TensorStat] | None  #: the data input (``input``) and its stats
    rows: int | None  #: how many rows' 1 / sqrt(var + eps) were inf (from the rstd output)
    of: int | None


def _zero_variance(ev: OpEvent) -> _ZeroVariance | None:
    """``ev`` is a normalization whose NaN/inf is not an overflow: every input finite, the
    largest small enough that its variance fits the dtype, and its eps 0 or so small that
    1 / sqrt(eps) passes the dtype's max (a row of equal values divides 0 by 0)."""
    if ev.phase is not Phase.FORWARD:
        return None
    kind = _VAR_NORMS.get(packet(ev.op).rstrip("_"))
    eps = ev.scalars.get("eps")
    lim = limits(ev.dtype)
    if kind is None or lim is None or isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return None
    stats = inputs_of(ev)
    if not stats or not all(s.finite for s in stats):
        return None
    big = max(s.magnitude for s in stats)
    if not math.isfinite(big) or (2 * big) ** 2 >= lim.max:
        return None  # a variance that large can overflow: NW101's own case
    eps = float(eps)
    if eps > 0 and 1 / math.sqrt(eps) < lim.max and float(torch.tensor(eps, dtype=torch.float32)):
        return None  # eps keeps 1 / sqrt(var + eps) finite: not what made it
    rstd = [s for n, s in ev.outputs if n.endswith("[2]") and s is not None]
    rows = rstd[0].posinf if rstd and rstd[0].posinf else None
    first = ev.inputs[0] if ev.inputs else None
    data = (first[0], first[1]) if first is not None and first[1] is not None else None
    return _ZeroVariance(kind[0], kind[1], eps, big, data, rows, rstd[0].numel if rstd else None)


def _eps_call(code: str, layer: str, eps: float, value: str) -> tuple[str, str] | None:
    """The call in ``code`` of ``nn.<layer>(...)`` (a constructor) or of ``F.layer_norm`` /
    ``F.group_norm`` whose ``eps=`` is ``eps`` as a literal (else the first whose eps is an
    expression: a config's), and that call with eps set to ``value``:
    ``('nn.LayerNorm(16, eps=0.0)', 'nn.LayerNorm(16, eps=1e-5)')``."""
    func = re.sub(r"(?<!^)([A-Z])", r"_\1", layer).lower()  # LayerNorm -> layer_norm
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return None
    lines = code.splitlines(keepends=True)
    found: list[tuple[int, int, str, str]] = []
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call) or call.lineno != call.end_lineno:
            continue
        if ast.unparse(call.func).rpartition(".")[2] not in (layer, func):
            continue
        kw = next((k for k in call.keywords if k.arg == "eps"), None)
        if kw is None:
            continue
        v = kw.value
        literal = isinstance(v, ast.Constant) and isinstance(v.value, (int, float))
        if literal and float(v.value) != eps:  # type: ignore[attr-defined]
            continue  # another layer's eps
        line = lines[call.lineno - 1]
        a, b = call.col_offset, call.end_col_offset or call.col_offset
        e0, e1 = v.col_offset, v.end_col_offset or v.col_offset
        found.append((0 if literal else 1, call.lineno, line[a:b], line[a:e0] + value + line[e1:b]))
    if not found:
        return None
    _, _, was, now = min(found)
    return was, now


def _eps_fix(ev: OpEvent, a: Anomaly, zero: _ZeroVariance) -> str:
    """Where the user sets the eps: the F.layer_norm call on the op's line, the
    ``nn.LayerNorm(..., eps=...)`` constructor in the op's file, or the module's attribute."""
    import linecache

    was = f"was eps={fmt(zero.eps)}"
    why = f"a {zero.unit} of equal values has variance 0; eps keeps 1 / sqrt(var + eps) finite"
    code = (ev.code or "").strip()
    on_line = _eps_call(code, zero.layer, zero.eps, _NORM_EPS) if code else None
    if on_line is not None:
        return f"{code.replace(on_line[0], on_line[1], 1)}   # {was}: {why}"
    path = (ev.source or "").rpartition(":")[0]
    text = "".join(linecache.getlines(path)) if path else ""
    built = _eps_call(text, zero.layer, zero.eps, _NORM_EPS) if text else None
    if built is not None:
        where = path.replace("\\", "/").rpartition("/")[2]
        return f"{built[1]}   # in {where}, {was}: {why}"
    ref = module_ref(ev.path or a.path)
    if a.record.module_type == zero.layer and ref != "model":
        return (
            f"{ref}.eps = {_NORM_EPS}   # once, after building the model ({was}): {why}\n"
            f"# better: nn.{zero.layer}(..., eps={_NORM_EPS}) where it is built"
        )
    return f"# pass eps={_NORM_EPS} to the {zero.layer} ({was}): {why}"


def _zero_variance_diagnosis(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, zero: _ZeroVariance
) -> Diagnosis:
    """NaN of a normalization with eps 0: a division by zero (NW111), not an overflow."""
    dtype = ev.dtype or a.record.dtype
    op = short_op(ev.op)
    lim = limits(dtype)
    top = f"{dtype}'s largest value {fmt(lim.max)}" if lim is not None else f"{dtype}'s max"
    rows = (
        f"{zero.rows:,} of {count(zero.of, zero.unit)}"
        if zero.rows is not None and zero.of is not None
        else f"a {zero.unit}"
    )
    data = zero.data
    if data is None:
        source = f"finite inputs up to |x| = {fmt(zero.big)}"
    elif data[1].min == 0 and data[1].max == 0:
        source = f"an input of all zeros ({data[1].numel:,} values)"
    else:
        source = f"an input up to |x| = {fmt(data[1].magnitude)}"
    evidence = [
        f"{op} made {ev.born} in {dtype} from {source}: not an overflow (the squares of its "
        f"inputs are at most {fmt(zero.big**2)}, far below {top})",
        f"{op} divides x - mean by sqrt(var + eps) with eps={fmt(zero.eps)}: {rows} held equal "
        "values (variance 0), so 1 / sqrt(0) = inf and (x - mean) × inf = 0 × inf = NaN",
    ]
    if data is not None:
        evidence.append(f"{data[0]}: {describe_stat(data[1])}")
    evidence += [
        f"{nm}: {describe_stat(s)}" if nm == "input" else f"input {nm}: {describe_stat(s)}"
        for nm, s in ev.inputs[:3]
        if data is None or nm != data[0]
    ]
    line = code_line(ev)
    if line is not None:
        evidence.append(line)
    return ctx.diagnosis(
        **op_fields(ev, a),
        code="NW111",
        title="Division by zero",
        priority=12,
        evidence=evidence,
        explanation=(
            f"{zero.layer} computes (x - mean) / sqrt(var + eps). A {zero.unit} whose values "
            "are all equal (a blank image, a padded token, a feature map a ReLU zeroed) has "
            f"variance exactly 0, and with eps={fmt(zero.eps)} that is 0 / 0. The values are "
            "not too large: a lower learning rate or gradient clipping would not help. eps is "
            "there for this case."
        ),
        fix=_eps_fix(ev, a, zero),
    )


#: linalg ops that divide by their matrix's diagonal (a triangular or Cholesky factor) or by
#: the pivots of its LU factorization: op -> (the matrix's schema name, its position in the
#: Python call, its keyword there, the Python names of the call, what it divides by)
_PIVOT_OPS: dict[str, tuple[str, int, str, tuple[str, ...], str]] = {
    "linalg_solve_triangular": ("self", 0, "A", ("solve_triangular",), "diagonal"),
    "triangular_solve": ("A", 1, "A", ("triangular_solve",), "diagonal"),
    "cholesky_solve": ("input2", 1, "input2", ("cholesky_solve",), "diagonal"),
    "cholesky_inverse": ("self", 0, "L", ("cholesky_inverse",), "diagonal"),
    "linalg_solve": ("A", 0, "A", ("solve",), "pivots"),
    "linalg_solve_ex": ("A", 0, "A", ("solve", "solve_ex"), "pivots"),
    "_linalg_solve_ex": ("A", 0, "A", ("solve", "solve_ex"), "pivots"),
    "linalg_inv": ("A", 0, "A", ("inv",), "pivots"),
    "linalg_inv_ex": ("A", 0, "A", ("inv", "inv_ex"), "pivots"),
    "inverse": ("self", 0, "A", ("inverse",), "pivots"),
    "linalg_lu_solve": ("LU", 0, "LU", ("lu_solve",), "pivots"),
    "lu_solve": ("LU_data", 1, "LU_data", ("lu_solve",), "pivots"),
}
#: modules whose attribute calls are functions (``torch.linalg.inv(A)``), not methods
_LINALG_MODULES = frozenset({"torch", "torch.linalg", "linalg", "LA", "la"})
#: wrappers that can make a diagonal entry exactly 0 (or underflow to it): the inner value
#: is what softplus should take
_ZEROING = frozenset({"relu", "clamp", "clip", "abs", "square", "exp", "sigmoid", "pow"})


@dataclass(frozen=True)
class _ZeroPivot:
    """A linalg solve / inverse that made inf from inputs of ordinary size: it divided by a
    zero (or underflowed) diagonal entry or pivot of its matrix."""

    name: str  #: the matrix's schema name (``self``)
    matrix: TensorStat | None
    by: str  #: ``diagonal`` or ``pivots``
    big: float
    arg: str | None  #: the matrix's expression on the user's line (``L``)
    built: tuple[str, str, str, str] | None  #: (line, statement, diag call, its fix)


def _zero_pivot(ev: OpEvent) -> _ZeroPivot | None:
    """``ev`` is a triangular / Cholesky / LU solve or inverse whose inf is not an
    overflow: every input finite and small enough that no product of two passes the
    dtype's max, so the inf is a division by a diagonal entry / pivot that is 0."""
    spec = _PIVOT_OPS.get(packet(ev.op))
    lim = limits(ev.dtype)
    if spec is None or lim is None or ev.scalars.get("unitriangular") is True:
        return None  # a unit-triangular solve never reads its diagonal
    stats = inputs_of(ev)
    if not stats or not all(s.finite for s in stats):
        return None
    big = max(s.magnitude for s in stats)
    if not math.isfinite(big) or big * big >= lim.max:
        return None  # values that large can overflow by themselves: NW101's own case
    name, pos, kw, calls, by = spec
    arg = _call_arg(ev.code, calls, pos, kw)
    built = _diag_built(ev, arg) if arg is not None and arg.isidentifier() else None
    return _ZeroPivot(name, input_named(ev, name), by, big, arg, built)


def _call_arg(code: str | None, calls: tuple[str, ...], pos: int, kw: str) -> str | None:
    """The expression of the matrix argument of the first ``torch.linalg.<call>(...)`` (or
    ``x.<call>(...)``, the receiver at position 0) on the line ``code``."""
    for stmt in statements(code):
        try:
            tree = ast.parse(stmt)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            if node.func.attr not in calls:
                continue
            args = list(node.args)
            if ast.unparse(node.func.value) not in _LINALG_MODULES:
                args.insert(0, node.func.value)  # a method: the receiver is ``self``
            found = next((k.value for k in node.keywords if k.arg == kw), None)
            if found is None and pos < len(args):
                found = args[pos]
            if found is not None:
                return ast.unparse(found)
    return None


def _diag_built(ev: OpEvent, name: str) -> tuple[str, str, str, str] | None:
    """Where ``name`` was assigned before the op's line in the same function, when that
    statement builds a diagonal from values that can be 0 (``torch.diag(torch.relu(d))``):
    (``file.py:17``, the statement, the diag call, the call with ``F.softplus(d) + 1e-5``)."""
    import linecache

    path, _, num = (ev.source or "").rpartition(":")
    if not path or not num.isdigit():
        return None
    lines = linecache.getlines(path)
    try:
        tree = ast.parse("".join(lines))
    except (SyntaxError, ValueError):
        return None
    at = int(num)
    scopes = [
        f
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        and f.lineno <= at <= (f.end_lineno or f.lineno)
    ]
    if not scopes:
        return None
    scope = max(scopes, key=lambda f: f.lineno)  # the innermost
    assigns = [
        s
        for s in ast.walk(scope)
        if isinstance(s, ast.Assign)
        and s.lineno == s.end_lineno
        and (s.end_lineno or s.lineno) < at
        and any(isinstance(t, ast.Name) and t.id == name for t in s.targets)
    ]
    if not assigns:
        return None
    stmt = max(assigns, key=lambda s: s.lineno)
    line = lines[stmt.lineno - 1]
    functional = re.search(r"^\s*import torch\.nn\.functional as F\b", "".join(lines), re.M)
    softplus = "F.softplus" if functional else "torch.nn.functional.softplus"
    for call in ast.walk(stmt.value):
        if not isinstance(call, ast.Call) or len(call.args) != 1:
            continue
        func = ast.unparse(call.func)
        if func.rpartition(".")[2] not in ("diag", "diag_embed", "diagflat"):
            continue
        inner = call.args[0]
        while isinstance(inner, ast.Call) and (
            ast.unparse(inner.func).rpartition(".")[2] in _ZEROING
        ):  # relu(d), d.clamp(min=0), torch.exp(d): softplus takes what they wrapped
            wrapped = inner.func.value if isinstance(inner.func, ast.Attribute) else None
            if inner.args and (wrapped is None or ast.unparse(wrapped) in _LINALG_MODULES):
                inner = inner.args[0]
            elif wrapped is not None and ast.unparse(wrapped) not in _LINALG_MODULES:
                inner = wrapped
            else:
                break
        if inner is call.args[0] and not isinstance(call.args[0], (ast.Name, ast.Attribute)):
            return None  # already something else (softplus(d) + eps): no rewrite to offer
        was = line[call.col_offset : call.end_col_offset]
        now = f"{func}({softplus}({ast.unparse(inner)}) + 1e-5)"
        where = f"{path.replace(chr(92), '/').rpartition('/')[2]}:{stmt.lineno}"
        return where, line.strip(), was, line.replace(was, now, 1).strip()
    return None


def _zero_pivot_diagnosis(ctx: RuleContext, a: Anomaly, ev: OpEvent, piv: _ZeroPivot) -> Diagnosis:
    """inf of a triangular / LU solve from modest inputs: a division by a zero diagonal
    entry or pivot (NW111), not an overflow."""
    dtype = ev.dtype or a.record.dtype
    op = short_op(ev.op)
    lim = limits(dtype)
    top = f"{dtype}'s largest value {fmt(lim.max)}" if lim is not None else f"{dtype}'s max"
    m = piv.arg or piv.name
    what = (
        f"each diagonal entry of {m}" if piv.by == "diagonal" else f"the pivots of {m}'s LU factors"
    )
    evidence = [
        f"{op} made {ev.born} in {dtype} from finite inputs up to |x| = {fmt(piv.big)}: not an "
        f"overflow (their products are at most {fmt(piv.big**2)}, far below {top})",
        f"{op} divides by {what}: a zero pivot (a diagonal entry that is exactly 0, or "
        "underflowed to it) gives ±inf, and the entries solved after it can become "
        "inf - inf = NaN",
    ]
    if piv.matrix is not None:
        note = ""
        if piv.by == "diagonal" and piv.matrix.zeros:
            note = "; the triangle the solve does not read counts among its zeros"
        evidence.append(f"{m} ({piv.name}): {describe_stat(piv.matrix)}{note}")
    if piv.built is not None:
        where, stmt, was, _ = piv.built
        evidence.append(f"{m} is built at {where}: {stmt}: {was} can put a 0 on the diagonal")
    line = code_line(ev)
    if line is not None:
        evidence.append(line)
    ridge = (
        f"{m} + 1e-5 * torch.eye({paren(m)}.shape[-1], dtype={paren(m)}.dtype, "
        f"device={paren(m)}.device)"
    )
    code = (ev.code or "").split("  #", 1)[0].strip()
    on_line = None
    if piv.arg and piv.arg.isidentifier():
        on_line = re.sub(rf"(?<![\w.]){piv.arg}(?!\w)", lambda _: ridge, code, count=1)
    elif piv.arg and piv.arg in code:
        on_line = code.replace(piv.arg, f"({ridge})", 1)
    on_line = on_line if on_line and on_line != code else None
    if piv.built is not None:
        _, _, was, now = piv.built
        fix = (
            f"{now}   # was {was}: keep the diagonal positive by construction, the solve "
            "divides by it"
        )
        if on_line:
            fix += f"\n# or add a ridge where it is solved: {on_line}"
    elif on_line:
        fix = (
            f"{on_line}   # a ridge keeps the {piv.by} off 0\n"
            "# better: keep the diagonal positive by construction: "
            "torch.diag(F.softplus(d) + 1e-5), not torch.diag(torch.relu(d))"
        )
    else:
        fix = (
            "# keep the diagonal positive by construction: torch.diag(F.softplus(d) + 1e-5), "
            f"not torch.diag(torch.relu(d)); or add a ridge: {ridge}"
        )
    return ctx.diagnosis(
        **op_fields(ev, a),
        code="NW111",
        title="Division by zero",
        priority=12,
        evidence=evidence,
        explanation=(
            f"{op} divides by {what}. One of them is 0 (the matrix is singular): the "
            "division gives inf, not an error. The values "
            "are not too large, so a lower learning rate or gradient clipping would not help. "
            "A diagonal made with relu, clamp(min=0) or abs reaches exactly 0 once its "
            "parameter crosses 0; softplus(d) + 1e-5 stays positive, and a small ridge "
            "(+ 1e-5 * I) keeps the matrix invertible."
        ),
        fix=fix,
    )


#: exp-like ops that overflow on both sides (cosh(-100) = inf, sinh(-100) = -inf)
_BOTH_SIDES = frozenset({"sinh", "cosh"})
#: exp-like ops that are not a softmax themselves: their own argument overflows
_BARE_EXP = frozenset({"exp", "exp_", "exp2", "expm1", "sinh", "cosh"})
#: ops that, after an exp, make it a softmax / logsumexp by hand (normalize, or log a sum)
_NORMALIZERS = frozenset({"div", "div_", "sum", "log", "log_", "true_divide", "reciprocal"})
_RECURRENT = frozenset({"RNN", "RNNCell", "LSTM", "LSTMCell", "GRU", "GRUCell"})


def _same_event(a: OpEvent, b: OpEvent) -> bool:
    """The same op event (identical, or equal in what identifies it: a loaded report)."""
    return a is b or (
        a.op == b.op and a.phase is b.phase and a.source == b.source and a.born == b.born
    )


def _followers(ev: OpEvent, ops: Sequence[OpEvent]) -> list[OpEvent]:
    """The step's later op events that consumed what ``ev`` made (``ev`` is in their
    cause chain): where an exp's inf went (the division by its own sum, two lines on)."""
    return [o for o in ops if not _same_event(o, ev) and any(_same_event(c, ev) for c in o.chain())]


_SOFTMAX_CODE = re.compile(r"\b(softmax|logsumexp)\b|\.(?:cum)?sum\(|torch\.(?:cum)?sum\(")


def _softmax_like(ev: OpEvent, chain: Sequence[OpEvent], ops: Sequence[OpEvent] = ()) -> bool:
    """Whether the overflowing exp is part of a softmax / logsumexp: a softmax op, or an
    exp whose inf a later op (of the chain, or of the step, on any line) normalized
    (divided by a sum, took a log), or whose line sums or normalizes it."""
    name = packet(ev.op)
    if name not in _BARE_EXP:
        return name in EXP_LIKE and name not in ("softplus",)
    if _logistic(ev) is not None:  # e / (1 + e): divided, but by no sum of exps
        return False
    later = list(chain[chain.index(ev) + 1 :]) if ev in chain else []
    later += _followers(ev, ops)
    if any(packet(e.op) in _NORMALIZERS for e in later):
        return True
    code = (ev.code or "").split("  #", 1)[0]
    if not _SOFTMAX_CODE.search(code):
        return _normalized_later(ev) is not None
    normalized = _exp_normalized(code)
    if normalized is None:
        return True
    return normalized or _normalized_later(ev) is not None


@dataclass(frozen=True)
class _Logistic:
    """An exp whose result is divided by a sum of itself and a term that is no exp
    (``e / (1 + e) ** 2``, ``e / (c + e)``): not a softmax, so not shift-invariant.
    ``lines``: when every denominator is ``1 + e`` (a logistic: a sigmoid or its
    derivative), the user's statements rewritten with torch.sigmoid, as (line number,
    the statement, its rewrite); empty when they cannot all be rewritten."""

    arg: str  #: the exp's argument
    shown: str  #: one such ratio, as the user wrote it
    lines: tuple[tuple[int, str, str], ...] = ()
    sigmoid: str = ""  #: the sigmoid the rewrite uses: ``torch.sigmoid(K * u)``


def _negated(arg: str) -> str | None:
    """``K * u`` for ``-K * u`` or ``-(a + b)``: the expression whose negation ``arg`` is
    (a leading minus of a product or of the whole); None when it is none."""
    try:
        node = ast.parse(arg.strip(), mode="eval").body
    except SyntaxError:
        return None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        text = ast.get_source_segment(arg.strip(), node.operand)
        return text if text is not None else None
    left = node
    while isinstance(left, ast.BinOp) and isinstance(left.op, (ast.Mult, ast.Div)):
        left = left.left
    if left is node or not (isinstance(left, ast.UnaryOp) and isinstance(left.op, ast.USub)):
        return None
    rest = arg.strip()[1:].strip()
    return rest if rest and not rest.startswith(("-", "+")) else None


def _logistic(ev: OpEvent, reach: int = 15) -> _Logistic | None:
    """Where the exp's result (its name, or the same exp call again) is divided by a sum
    holding it and a term that is no exp -- ``1 + e``, raised to a whole power or not --
    on its own line or a later line of its function (a custom Function's backward too):
    exp(a) / (1 + exp(a)) is sigmoid(a), 1 / (1 + exp(a)) is sigmoid(-a), and
    exp(a) / (1 + exp(a)) ** 2 is sigmoid(a) * (1 - sigmoid(a)). None when no line does."""
    import linecache

    op = packet(ev.op).rstrip("_")
    if op not in _BARE_EXP or not ev.code:
        return None
    path, _, num = (ev.source or "").rpartition(":")
    here = linecache.getline(path, int(num)) if path and num.isdigit() else ""
    stmts = [(int(num) if num.isdigit() else 0, st) for st in statements(ev.code)]
    args = [a for _, st in stmts for a in _exp_args(st, op)]
    if not args or not all(_same_expr(a, args[0]) for a in args):
        return None
    arg = args[0].strip()
    try:
        arg_dump = ast.dump(ast.parse(arg, mode="eval").body)
    except SyntaxError:
        return None
    names: set[str] = set()
    own: str | None = None  # the statement ``e = torch.exp(a)``, replaced by ``s = ...``
    for _, st in stmts:
        target = _assigned(st)
        value = st.split("=", 1)[1] if target is not None else ""
        if target is not None and (
            _same_expr(value, f"torch.{op}({arg})") or _same_expr(value, f"{paren(arg)}.{op}()")
        ):
            names.add(target)
            own = st
    later = (
        list(_later_statements(path, int(num), len(here) - len(here.lstrip()), reach))
        if names and here.strip()
        else []
    )

    def is_e(node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in names
        call = _call_of(node, op) if isinstance(node, ast.expr) else None
        return call is not None and not call[1] and ast.dump(call[0]) == arg_dump

    def holds_e(node: ast.AST) -> bool:
        return any(is_e(n) for n in ast.walk(node))

    def logistic_power(den: ast.expr) -> tuple[int, bool] | None:
        """(n, one) for ``(c + e) ** n``: one is True when c is the constant 1."""
        n = 1
        if isinstance(den, ast.BinOp) and isinstance(den.op, ast.Pow):
            k = den.right
            if not (isinstance(k, ast.Constant) and type(k.value) is int and 1 <= k.value <= 4):
                return None
            den, n = den.left, k.value
        if not (isinstance(den, ast.BinOp) and isinstance(den.op, ast.Add)):
            return None
        for e, c in ((den.left, den.right), (den.right, den.left)):
            if is_e(e) and not holds_e(c) and not _exp_args(ast.unparse(c), op):
                one = isinstance(c, ast.Constant) and c.value == 1
                return n, one
        return None

    other = _negated(arg)
    sig = f"torch.sigmoid({other if other is not None else arg})"
    used = {n for _, st in [*stmts, *((n, st) for n, _, st in later)] for n in _names_of(st)}
    s_name = (
        next((c for c in ("s", "sig", "sig_", "_s") if c not in used), "_nw_s")
        if own is not None
        else sig
    )

    def factor(k: int, m: int) -> list[str]:
        """sigmoid(a) ** m * (1 - sigmoid(a)) ** k, as factors."""
        if other is not None:  # sigmoid(-x) = 1 - sigmoid(x)
            k, m = m, k
        out = [s_name if m == 1 else f"{s_name} ** {m}"] if m else []
        if k:
            out.append(f"(1 - {s_name})" if k == 1 else f"(1 - {s_name}) ** {k}")
        return out

    shown = ""
    rewrites: list[tuple[int, str, str]] = []
    complete = True
    for n, st in [*stmts, *((n, st) for n, _, st in later)]:
        if st == own:
            continue
        try:
            tree = ast.parse(st)
        except SyntaxError:
            continue
        if not holds_e(tree):
            continue
        target = _assigned(st)
        spans: list[tuple[int, int, str]] = []
        matched: set[int] = set()
        for node in ast.walk(tree):
            if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)):
                continue
            power = logistic_power(node.right)
            if power is None:
                continue
            shown = shown or (ast.get_source_segment(st, node) or "")
            k, one = power
            facs = _factors(node.left)
            es = [f for f in facs if is_e(f)]
            rest = [f for f in facs if not is_e(f)]
            if not one or len(es) > k or any(holds_e(f) for f in rest):
                complete = False
                continue
            texts = [paren(ast.get_source_segment(st, f) or "") for f in rest]
            texts = [t for t in texts if t not in ("1", "1.0")]
            body = " * ".join([*texts, *factor(k - len(es), len(es))]) or "1"
            whole = isinstance(tree.body[0], (ast.Return, ast.Assign, ast.Expr)) and (
                getattr(tree.body[0], "value", None) is node
            )
            start = len(st.encode()[: node.col_offset].decode())
            end = len(st.encode()[: node.end_col_offset or 0].decode())
            spans.append((start, end, body if whole else f"({body})"))
            matched |= {id(m) for m in ast.walk(node)}
        if any(is_e(m) and id(m) not in matched for m in ast.walk(tree)):
            complete = False  # e used elsewhere: the rewrite would leave it undefined
        if spans:
            new = st
            for start, end, body in sorted(spans, reverse=True):
                if any(start < s0 < end for s0, _, _ in spans if s0 != start):
                    complete = False
                    break
                new = new[:start] + body + new[end:]
            rewrites.append((n, st, new))
        if target in names:
            break  # e reassigned: later lines see another value
    if not shown:
        return None
    if not complete or not rewrites:
        return _Logistic(arg, shown)
    lines = tuple(rewrites)
    if own is not None:
        lines = ((int(num) if num.isdigit() else 0, own, f"{s_name} = {sig}"), *lines)
    return _Logistic(arg, shown, lines, sig)


def _explain_logistic(dtype: str, lim: DtypeLimits) -> str:
    return (
        f"This exp feeds a logistic form, e / (1 + e) (a sigmoid, or its derivative e / (1 + "
        f"e)^2): the value is bounded, but exp of an argument above {fmt(lim.exp_bound)} is "
        f"inf in {dtype}, and inf / inf = NaN. torch.sigmoid computes the same values without "
        "that exp, for every input. It is not a softmax: subtracting a max from the argument "
        "would change the values, and a clamp would too."
    )


def _fix_logistic(logi: _Logistic) -> str:
    """The user's lines rewritten with torch.sigmoid, each with what it was."""
    a = logi.arg
    rows = [f"{new}  # was: {old}" for _, old, new in logi.lines]
    where = sorted({n for n, _, _ in logi.lines if n})
    at = f" (lines {', '.join(map(str, where))})" if len(where) > 1 else ""
    return "\n".join(
        [
            *rows,
            f"# with e = exp({a}){at}: e / (1 + e) = sigmoid({a}), 1 / (1 + e) = 1 - "
            f"sigmoid({a}), e / (1 + e) ** 2 = sigmoid({a}) * (1 - sigmoid({a})): the same "
            "values, and torch.sigmoid never overflows",
        ]
    )


def _names_of(stmt: str) -> set[str]:
    try:
        return _names(ast.parse(stmt))
    except SyntaxError:
        return set()


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _sum_of(node: ast.AST, derived: set[str]) -> bool:
    """``node`` holds a sum (``x.sum(1)``, ``torch.sum(x)``) of something made from
    ``derived`` names."""
    for n in ast.walk(node):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
            continue
        if n.func.attr not in ("sum", "nansum"):
            continue
        owner = n.func.value
        summed = (
            n.args[0] if isinstance(owner, ast.Name) and owner.id == "torch" and n.args else owner
        )
        if _names(summed) & derived:
            return True
    return False


@dataclass(frozen=True)
class _Normalized:
    """A later line of the exp's function that divides by, or takes the log of, a sum of
    what the exp made: the exp is a softmax (or log-sum-exp) written over several lines."""

    source: str  #: ``file.py:16``
    code: str  #: that line
    log: bool  #: the ratio or the sum goes into a log (a cross-entropy by hand)


def _normalized_later(ev: OpEvent, reach: int = 15) -> _Normalized | None:
    """Where a later line of the same function normalizes the exp's result: the name the
    exp's line assigns (``sim = torch.exp(...)``) is followed through the lines that use it
    (``pos = torch.diag(sim, n)``, ``denom = (sim * mask).sum(1)``) to a division by their
    sum (``pos / denom``) or a log of it; None when no line within ``reach`` does."""
    import linecache

    path, _, num = (ev.source or "").rpartition(":")
    if not path or not num.isdigit() or not ev.code or ev.phase is not Phase.FORWARD:
        return None
    if packet(ev.op) not in _BARE_EXP:
        return None
    start = int(num)
    here = linecache.getline(path, start)
    if not here.strip():
        return None
    indent = len(here) - len(here.lstrip())
    derived = {
        name
        for stmt in statements(ev.code)
        if re.search(rf"\b(?:{'|'.join(_EXP_CALLS)})\(", stmt)
        and (name := _assigned(stmt)) is not None
    }
    if not derived:
        return None
    # the exp's own line may assign the sum (``denom = (mask * torch.exp(x)).sum(1)``)
    sums = {
        name
        for stmt in statements(ev.code)
        if (name := _assigned(stmt)) is not None and _sums_an_exp(stmt)
    }
    for n, text, stmt in _later_statements(path, start, indent, reach):
        try:
            tree = ast.parse(stmt)
        except SyntaxError:
            continue
        target = _assigned(stmt)
        if not _names(tree) & derived:
            derived.discard(target or "")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                below = node.right
                if _sum_of(below, derived) or _names(below) & sums:
                    logged = re.search(r"\blog\(", stmt) is not None
                    return _Normalized(f"{path}:{n}", text.strip(), logged)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "log"
            ):
                inner = node.args[0] if node.args else node.func.value
                if _sum_of(inner, derived) or _names(inner) & sums:
                    return _Normalized(f"{path}:{n}", text.strip(), True)
        if target is not None:
            derived.add(target)
            if _sum_of(tree, derived):
                sums.add(target)
    return None


def _sums_an_exp(stmt: str) -> bool:
    """The statement sums (``.sum(d)``, ``torch.sum``) an expression holding an exp call."""
    try:
        tree = ast.parse(stmt)
    except SyntaxError:
        return False
    for n in ast.walk(tree):
        total = _call_of(n, "sum") if isinstance(n, ast.expr) else None
        if total is None:
            continue
        for m in ast.walk(total[0]):
            if isinstance(m, ast.expr) and _call_of(m, "exp") is not None:
                return True
    return False


_SUMMING = frozenset({"sum", "nansum", "cumsum", "logsumexp", "softmax", "log_softmax"})


def _exp_normalized(code: str) -> bool | None:
    """Whether the line sums or divides an exp's own result (``e.exp().sum(-1)``,
    ``torch.exp(x) / z``, ``torch.sum(torch.exp(x), 1)``), as a softmax does, rather than a
    sum of terms the exp is only a factor of (``(torch.exp(-s) * loss + s).sum()``: the
    sum is of products). None when the line does not parse or shows no exp call."""
    seen = False
    for stmt in statements(code):
        try:
            tree = ast.parse(stmt)
        except SyntaxError:
            return None
        if re.search(r"\b(softmax|logsumexp)\b", stmt):
            return True
        parents = {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        for n in ast.walk(tree):
            if not (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr in _EXP_CALLS
            ):
                continue
            seen = True
            up = parents.get(id(n))
            if isinstance(up, ast.BinOp) and isinstance(up.op, ast.Div):
                return True
            if isinstance(up, ast.Attribute) and up.attr in _SUMMING:
                return True  # torch.exp(x).sum(-1)
            if (
                isinstance(up, ast.Call)
                and isinstance(up.func, ast.Attribute)
                and up.func.attr in _SUMMING
                and n in up.args
            ):
                return True  # torch.sum(torch.exp(x), -1)
    return False if seen else None


#: special functions that grow like e^|x| (modified Bessel functions of the first kind),
#: and their scaled twins (i0e(x) = i0(x) · e^-|x|), which never overflow
_SCALED_TWIN = {"i0": "i0e", "i0_": "i0e", "special_i0": "i0e", "special_i1": "i1e", "i1": "i1e"}


def _log_twin(code: str | None, op: str, twin: str) -> str | None:
    """The user's ``log(i0(k))`` as ``log(i0e(k)) + |k|``; None when the line holds none."""
    line = code.split("  #", 1)[0].rstrip() if code else ""
    bare = op.removeprefix("special_").rstrip("_")
    m = re.search(rf"((?:torch\.)?log)\(\s*(?:torch\.special\.|torch\.|special\.)?{bare}\(", line)
    if m is None:
        return None
    inner_open = m.end() - 1
    inner_close = _closing(line, inner_open)
    outer_close = _closing(line, m.end(1))
    if inner_close is None or outer_close is None or line[inner_close + 1 : outer_close].strip():
        return None
    arg = line[inner_open + 1 : inner_close]
    new = f"({m[1]}(torch.special.{twin}({arg})) + {paren(arg)}.abs())"
    return line[: m.start()] + new + line[outer_close + 1 :]


def _from_twin(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, trigger: OpEvent, lim: DtypeLimits
) -> Diagnosis:
    """i0 / i1 overflowed: they grow like exp; their log is log(i0e(x)) + |x|."""
    name = packet(ev.op)
    twin = _SCALED_TWIN[name]
    bare = name.removeprefix("special_").rstrip("_")
    dtype = ev.dtype or a.record.dtype
    bound = lim.exp_bound  # torch computes e^|x| times a bounded factor
    x = first_input(ev)
    big = x.magnitude if x is not None else math.nan
    evidence = [
        f"{short_op(ev.op)} made {ev.born} in {dtype} from an input up to |x| = {fmt(big)}; "
        f"{bare}(x) grows like e^|x| (torch computes it as e^|x| times a bounded factor), "
        f"and e^|x| passes {fmt(lim.max)}, {dtype}'s largest value, above {fmt(bound)}: it "
        "overflows like exp"
    ]
    for nm, st in ev.inputs[:3]:
        evidence.append(f"input {nm}: {describe_stat(st)}")
    line = code_line(ev)
    if line:
        evidence.append(line)
    if trigger is not ev:
        evidence.append(f"then {short_op(trigger.op)} turned the inf into {trigger.born}")
    plain = ev.code.split("  #", 1)[0].strip() if ev.code else ""
    was = f"  # was: {plain}" if plain else ""
    fixed = _log_twin(ev.code, name, twin)
    if fixed is not None:
        fix = (
            f"{fixed}{was}\n"
            f"# log {bare}(x) = log({twin}(x)) + |x|: {twin}(x) = {bare}(x)·e^-|x| never "
            "overflows, and the log stays finite for any x"
        )
    else:
        fix = (
            f"log_{bare} = torch.log(torch.special.{twin}(x)) + x.abs()   # x: the argument of "
            f"{bare}{was}\n"
            f"# {bare}(x) itself does not fit {dtype} above {fmt(bound)}: keep it as its log, "
            f"or as torch.special.{twin}(x) with the factor e^|x| kept apart"
        )
    explanation = (
        f"torch.special.{bare} is a modified Bessel function: it grows like exp, so in "
        f"{dtype} it overflows above {fmt(bound)}, at arguments as moderate as exp's. A "
        "log-likelihood that takes its log (the von Mises normalizer log I0(κ)) needs only "
        f"the log: log({twin}(x)) + |x| is the same value and never overflows."
    )
    return ctx.diagnosis(**op_fields(ev, a), evidence=evidence, explanation=explanation, fix=fix)


@dataclass(frozen=True)
class _Target:
    """A loss op's ``target`` operand (data) that is the huge one, its prediction small."""

    op: str
    target: TensorStat
    others: float  #: the largest |x| among the op's other operands

    def line(self) -> str:
        return (
            f"the huge operand is the target of {self.op} (the data the loss compares with), "
            f"up to |y| = {fmt(self.target.magnitude)}, while the prediction is at most "
            f"{fmt(self.others)}: the target is unscaled"
        )


def _huge_target(ev: OpEvent, lim: DtypeLimits) -> _Target | None:
    """The operand named ``target`` (aten's loss ops: mse_loss, l1_loss, smooth_l1_loss,
    huber_loss, ...) is past sqrt(max) -- its square overflows -- and larger than every
    other operand: the data is unscaled, the model is not what grew."""
    tgt = input_named(ev, "target")
    if tgt is None or not tgt.finite or not tgt.magnitude >= math.sqrt(lim.max):
        return None
    rest = [s.magnitude for n, s in ev.inputs if n != "target" and s is not None]
    if not rest or any(not m < tgt.magnitude for m in rest):
        return None
    return _Target(short_op(ev.op), tgt, max(rest))


def _target_overflow(t: _Target, dtype: str, lim: DtypeLimits) -> tuple[str, str]:
    big = fmt(t.target.magnitude)
    explanation = (
        f"{dtype} holds values up to {fmt(lim.max)}, so a squared difference overflows "
        f"once it passes sqrt({fmt(lim.max)}) = {fmt(math.sqrt(lim.max))}. Here the target "
        f"reaches {big}: the regression target is in raw units, and even where it does not "
        f"overflow, its scale dwarfs the prediction (at most {fmt(t.others)}), so it "
        "dominates the loss and the gradients. Normalizing the model's inputs does not help: "
        "the target itself must be scaled, and the scaling undone on the predictions."
    )
    fix = (
        "# scale the target (statistics from the training data), train on that, undo it "
        "on predictions\n"
        "y_scaled = (y - y_mean) / y_std          # pred_raw = pred * y_std + y_mean\n"
        "# or, for positive values spanning orders of magnitude, predict the log:\n"
        "y_scaled = torch.log1p(y)                # pred_raw = torch.expm1(pred)"
    )
    return explanation, fix


@dataclass(frozen=True)
class _DataOperand:
    """An exp-like op whose argument is a sum or difference of a watched output (the
    model's prediction) and a tensor no watched module made (data: a target), where that
    tensor alone passes the op's overflow bound and nothing the model made or was given
    comes near it."""

    op: str
    arg: float  #: the op's largest |argument|
    made: str  #: the op that combined them (``sub``)
    model: float  #: the largest |x| of the model's output it was made from
    data: float  #: at least this large: the other operand (|arg| - model)
    others: float  #: the largest |x| of anything the model made or was given
    bound: float  #: the op's overflow bound

    def line(self) -> str:
        return (
            f"{self.op}'s argument is a {self.made} of the model's output (at most |x| = "
            f"{fmt(self.model)}) and a tensor no watched module made, at least |y| = "
            f"{fmt(self.data)}: data passed to the loss (the target) puts it at "
            f"{fmt(self.arg)}, past the bound {fmt(self.bound)}, while everything the model made "
            f"or was given is at most {fmt(self.others)}"
        )


#: ops that only add, subtract, negate or reshape: |result| <= the sum of the operands'
_ADDITIVE = frozenset({"sub", "rsub", "add", "neg"})
_SHAPE_ONLY = frozenset(
    {
        "view",
        "reshape",
        "unsafeview",
        "squeeze",
        "unsqueeze",
        "expand",
        "t",
        "transpose",
        "permute",
        "clone",
        "slice",
        "select",
    }
)


def _data_operand(ctx: RuleContext, ev: OpEvent, lim: DtypeLimits) -> _DataOperand | None:
    """See :class:`_DataOperand`: the loss graph's chain below the op (its ``made_from``)
    is additive ops down to a watched output, so |argument| <= |that output| + |the other
    operand|; the other operand is then at least their difference. None unless it alone
    passes the op's bound and everything recorded this step (the model's inputs, every
    watched output) stays below that bound."""
    name = packet(ev.op).rstrip("_")
    x = first_input(ev)
    if name not in _BARE_EXP or x is None or not x.finite or ev.phase is not Phase.FORWARD:
        return None
    chain = ev.made_from
    if not chain or not chain[-1].startswith("watched:"):
        return None
    steps = chain[:-1]
    if not steps or not all(c in _ADDITIVE or c in _SHAPE_ONLY for c in steps):
        return None
    made = next((c for c in steps if c in _ADDITIVE and c != "neg"), None)
    if made is None:
        return None
    node = chain[-1].split(":", 1)[1].replace("_", "")
    bound = lim.exp_bound + (math.log(2) if name in _BOTH_SIDES else 0.0)
    model = 0.0
    others = 0.0
    for r in ctx.trace.records:
        if r.phase is not Phase.FORWARD and r.phase is not Phase.INPUT:
            continue
        if r.path == LOSS_PATH:
            continue
        st = ctx.trace.resolve(r).stat
        if st is None or not st.finite or limits(r.dtype) is None:
            continue
        others = max(others, st.magnitude)
        fn = (r.grad_fn or "").split("Backward")[0].lower().replace("_", "")
        if r.phase is Phase.FORWARD and fn == node:
            model = max(model, st.magnitude)
    if model == 0.0 or others >= bound:
        return None
    data = x.magnitude - model
    if not data > bound:
        return None
    op = short_op(ev.op)
    return _DataOperand(op, x.magnitude, made, model, data, others, bound)


def _data_overflow(d: _DataOperand, dtype: str, lim: DtypeLimits) -> str:
    return (
        f"{dtype} holds values up to {fmt(lim.max)}: reaching that is not a precision "
        f"problem, and computing in a wider dtype only delays it. {d.op} overflows {dtype} "
        f"for |x| above {fmt(d.bound)}, and its argument combines the model's output (at "
        f"most {fmt(d.model)}) with data it never made, at least {fmt(d.data)}: the targets "
        "were never standardized, so the difference is in their raw units whatever the "
        "model predicts, at the first step and at every later one. Standardize the targets "
        "(and undo it on the predictions)."
    )


def _data_fix(code: str | None, log_cosh: bool) -> str:
    scale = (
        "y = (y - y_mean) / y_std   # standardize the target (mean and std of the training "
        "targets); pred * y_std + y_mean undoes it"
    )
    if log_cosh:
        return (
            f"{scale}\n"
            "log_cosh = d.abs() + F.softplus(-2 * d.abs()) - math.log(2)   # = "
            "torch.log(torch.cosh(d)), d what you pass to cosh: finite for every d\n"
            "# not torch.cosh(d.clamp(...)): past the clamp the loss stops growing and its "
            "gradient is 0, so the largest errors stop being learned"
        )
    return scale


def _from_op(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, trigger: OpEvent, chain: Sequence[OpEvent] = ()
) -> Diagnosis:
    lim = limits(ev.dtype)
    dtype = ev.dtype or a.record.dtype
    name = packet(ev.op)
    if name in _SCALED_TWIN and lim is not None and ev.phase is Phase.FORWARD:
        return _from_twin(ctx, a, ev, trigger, lim)
    if name in _NLL_OPS and (loss_sum := _class_loss_sum(ctx, a, ev)) is not None:
        return loss_sum  # a class loss's sum over the batch, not one value, passed the max
    op = short_op(ev.op)
    x = first_input(ev)
    evidence: list[str] = []
    big = max((s.magnitude for s in inputs_of(ev) if not math.isnan(s.magnitude)), default=math.nan)
    # a backward of exp: what the node holds is exp's result, not its argument (an exp a
    # custom Function's own backward() calls is an exp of its own argument)
    result_only = (
        ev.phase is Phase.BACKWARD and name in EXP_LIKE and custom_function(ev.node) is None
    )
    # a cast of an integer tensor (a count): its values are in other_inputs, not inputs
    ints = _integer_source(ev) if name in CAST else None
    src = ev.scalars.get("source_dtype")
    source = src if isinstance(src, str) else None
    power: tuple[float, float, float] | None = None
    tpow: _TensorPower | None = None
    cums: _CumsumExponent | None = None
    data: _DataOperand | None = None
    # the backward of a cast up (x.float()): the gradient is cast back to x's dtype
    back_cast = (name in CAST or name == "to_copy") and ev.phase is Phase.BACKWARD
    # a backward product into a low-precision gradient with an operand past that dtype's
    # range (a float32 1e10 met a float16 tensor: type promotion): a fixed large factor
    promoted = (
        ev.phase is Phase.BACKWARD
        and lim is not None
        and lim.short_range
        and name in ("mul", "div", "mm", "bmm", "matmul", "addmm", "addcmul", "addcdiv")
        and any(
            st is not None and st.finite_amax is not None and st.finite_amax > lim.max
            for _, st in ev.inputs
        )
    )
    if name in MATMUL and not promoted and lim is not None:
        grad = _arriving_gradient(ctx, a, ev, lim)
        if grad is not None:  # a backward product of a huge gradient, not of huge values
            return _gradient_product(ctx, a, ev, trigger, grad=grad, lim=lim)
    # a complex tensor's statistics are of |z|: exp's overflow is governed by Re(z) alone
    cplx = dtype.startswith("complex") and name in EXP_LIKE
    if lim is None:
        evidence.append(f"{op} made {ev.born} in {dtype}")
    elif result_only:
        evidence.append(
            f"in forward, {op} overflowed: the result autograd saved holds +inf "
            f"({describe_stat(x)}), which later ops left out of the loss (a min, a clamp, "
            "a where that chose the other branch, or a ReLU of what became -inf)"
        )
        evidence.append(
            f"in backward ({ev.node}) the gradient is multiplied by that result: 0 × inf = "
            f"{ev.born}"
        )
    elif name.rstrip("_") in _BOTH_SIDES and x is not None and not math.isnan(x.magnitude):
        evidence.append(
            f"{op} made {ev.born} in {dtype} from an input up to |x| = {fmt(x.magnitude)} "
            f"(min {fmt(x.min)}, max {fmt(x.max)}); it overflows for |x| above "
            f"{fmt(lim.exp_bound + math.log(2))} = log(2 × {fmt(lim.max)})"
        )
    elif name in EXP_LIKE and cplx:
        evidence.append(_complex_exp_line(op, ev.born, dtype, x, lim))
    elif name in EXP_LIKE:
        top = signed_max(x)
        given = (
            f"from an input whose largest value is {fmt(top)}"
            if not math.isnan(top)
            else "(its input was not kept by autograd)"
        )
        evidence.append(
            f"{op} made {ev.born} in {dtype} {given}; exp overflows above "
            f"{fmt(lim.exp_bound)} = log({fmt(lim.max)}), the largest finite {dtype} value"
        )
    elif name in MATMUL:
        mags = ", ".join(fmt(s.magnitude) for s in inputs_of(ev)[:3])
        evidence.append(
            f"{op} made {ev.born} in {dtype}: inputs up to |x| = {mags}; their products, "
            f"summed over the inner dimension, passed {fmt(lim.max)} (the largest finite "
            f"{dtype} value)"
        )
    elif name in CAST and ints is not None:
        evidence.append(
            f"{op} cast {_integer_values(ints, source)} to {dtype}, whose largest finite "
            f"value is {fmt(lim.max)}: it became {ev.born}"
        )
    elif back_cast:
        size = f" (up to |x| = {fmt(big)})" if not math.isnan(big) else ""
        cast_up = (
            "a .float() / .to()"
            if (ev.node or "ToCopy").startswith("ToCopy")
            else f"a {dtype} operand promoted to float32 by {ev.node}"
        )
        evidence.append(
            f"in backward{f' ({ev.node})' if ev.node else ''}, {op} cast the float32 gradient "
            f"of {cast_up} back to {dtype}, the dtype of the tensor cast up{size}: "
            f"it was past {fmt(lim.max)}, {dtype}'s largest finite value, and became {ev.born}"
            + ("" if size else " (the gradient's value itself was not measured)")
        )
    elif name in CAST:
        of = f"a {source} value" if source else "a value"
        size = f" of |x| = {fmt(big)}" if not math.isnan(big) else " (its value was not measured)"
        evidence.append(
            f"{op} cast {of}{size} to {dtype}, whose largest finite value "
            f"is {fmt(lim.max)}: it became {ev.born}"
        )
    elif (power := _scalar_power(ev)) is not None:
        base, e, value = power
        evidence.append(
            f"{op} raised {fmt(base)} to the powers of its input: {fmt(base)} ** {fmt(e)} = "
            f"{fmt(value)} > {fmt(lim.max)} ({dtype}'s max)"
        )
    elif (tpow := _tensor_power(ev, lim)) is not None:
        evidence.append(
            f"{op} raised bases up to {fmt(tpow.base)} to exponents up to "
            f"{fmt(tpow.exponent)}: {fmt(tpow.exponent)} · log({fmt(tpow.base)}) = "
            f"{tpow.log:.1f} > {fmt(lim.exp_bound)} = log({fmt(lim.max)}), {dtype}'s max"
        )
    else:
        reach = _true_result(name, ev)
        given = (
            f"from inputs up to |x| = {fmt(big)}"
            if not math.isnan(big)
            else "(its inputs were not measured)"
        )
        evidence.append(
            f"{op} made {ev.born} in {dtype} {given}"
            + (f" (its exact result reaches up to {fmt(reach)})" if math.isfinite(reach) else "")
            + f"; the largest finite {dtype} value is {fmt(lim.max)}"
        )
        added = _summed_count(name, ev)
        if added is not None and added * big > lim.max:  # no one value: their sum passed
            evidence.append(
                f"{op} adds {added:,} values into each result: values up to {fmt(big)} can "
                f"sum to {fmt(added * big)}, past {fmt(lim.max)}"
            )
    for nm, s in ev.inputs[:3]:
        evidence.append(f"input {nm}{' |z|' if cplx else ''}: {describe_stat(s)}")
    if ints is not None:
        evidence.append(f"input {ints[0]}{_paren_note(source)}: {describe_stat(ints[1])}")
    # float32 and up, and bfloat16 (float32's range: an upcast would not help it)
    wide = lim is not None and not lim.short_range
    subst = _substituted(ctx, a) if wide and not result_only and not cplx else None
    loop = (
        None
        if result_only or subst is not None
        else _recurrence(ctx.trace, ev.path or a.path, a.record.call)
    )
    if loop is None and ev.phase is Phase.BACKWARD and not result_only and subst is None:
        loop = _backward_recurrence(ctx.trace, ev.path or a.path)
    batch = _batch_jump(ctx, a) if not result_only and loop is None else None
    jump = (
        _jump(ctx, a) if not wide and batch is None and loop is None and not result_only else None
    )
    if jump is None and not wide and batch is None and loop is None and not result_only:
        jump = _drift(ctx, a)
    scaled_logits = (
        _scaled_logits(ctx, ev, x, lim)
        if lim is not None
        and name.rstrip("_") == "exp"
        and not result_only
        and not cplx
        and subst is None
        and loop is None
        and batch is None
        and jump is None
        else None
    )
    if (
        scaled_logits is not None
        and not scaled_logits.diagonal
        and not scaled_logits.summed
        and ev.code is not None
        and _normalized_later(ev) is not None
    ):
        # positives that are not the diagonal (NT-Xent's two views): the user's own line,
        # rewritten below in its names, says more than a template with labels = ...
        scaled_logits = None
    if scaled_logits is not None and lim is not None:  # a contrastive loss's exps, by hand
        return _scaled_logits_diagnosis(ctx, a, ev, trigger, lg=scaled_logits, lim=lim)
    if subst is not None:
        evidence.append(subst.line(ctx.step))
    elif loop is not None:
        evidence.append(loop.line())
    elif batch is not None:
        evidence.append(batch.line(ctx.step))
    elif jump is not None:
        evidence.append(jump.line(_lr_note(ctx, jump.path)))
        evidence += [] if jump.elsewhere else _setting_evidence(ctx)
    elif wide and not result_only and not cplx and (cums := _cumsum_exponent(ev)) is not None:
        evidence.append(
            f"the exponent {cums.arg} is a cumulative sum, made at {cums.source}: "
            f"{cums.code} -- a sum of one term per position, so it grows with the length "
            "summed over, not because any value exploded"
        )
    elif (
        wide
        and lim is not None
        and not result_only
        and not cplx
        and (data := _data_operand(ctx, ev, lim)) is not None
    ):
        evidence.append(data.line())
    elif (
        wide
        and lim is not None
        and name not in CAST
        and not result_only
        and tpow is None  # a power of ordinary operands: nothing grew past range
        and _huge_target(ev, lim) is None  # the data is unscaled: no growth to explain
        and (name in EXP_LIKE or not math.isnan(big))  # inputs unmeasured: nothing to tell
    ):
        evidence.append(
            _growth_line(
                ctx,
                a,
                name,
                math.nan if cplx else _overflowing(name, x, big),
                lim,
                complex_=cplx,
                holder=None if cplx else _exp_holder(ctx, a, ev),
            )
        )
        evidence += [] if _first_step(ctx) else _setting_evidence(ctx)
    arg = math.nan if cplx else _overflowing(name, x, big)
    f32 = _exp_bound("float32")
    if lim is not None and lim.short_range and name in _BARE_EXP and arg > f32 and not result_only:
        evidence.append(
            f"the argument {fmt(arg)} is past float32's exp bound {fmt(f32)} too: computing "
            "this exp in float32 or bfloat16 would overflow as well"
        )
    line = code_line(ev)
    if line:
        evidence.append(line)
    if trigger is not ev:
        why = " (inf - inf, inf / inf and 0 × inf are NaN)" if "NaN" in trigger.born else ""
        evidence.append(f"then {short_op(trigger.op)} turned the inf into {trigger.born}{why}")
    if a.record.stat is not None and a.record.dtype != dtype:
        evidence.append(
            f"the anomaly was first seen in {a.record.where}: {a.record.stat.kinds()} in "
            f"{a.record.dtype}"
        )
    fields = op_fields(ev, a)
    kind = _kind(name, ev, chain, ctx.trace.ops)
    init = (
        _log_init(ctx, ev, x, lim)
        if wide
        and lim is not None
        and not result_only
        and not cplx
        and subst is None
        and loop is None
        and batch is None
        and jump is None
        and kind == "exp"
        else None
    )
    arg_jump = (
        _arg_jump(ctx, ev, lim)
        if wide
        and lim is not None
        and kind == "exp"
        and not result_only
        and subst is None
        and loop is None
        and batch is None
        else None
    )
    fill = (
        _fill_arg(ctx, ev, x, lim)
        if wide
        and lim is not None
        and not result_only
        and not cplx
        and subst is None
        and loop is None
        and batch is None
        and jump is None
        else None
    )
    if fill is not None:
        evidence = [
            fill.evidence if e.startswith("exp's argument reached") else e for e in evidence
        ]
        init = arg_jump = None
    if arg_jump is not None and lim is not None:
        evidence = [
            arg_jump.line(lim.exp_bound) if e.startswith("exp's argument reached") else e
            for e in evidence
        ]
        init = None
    if init is not None:
        evidence = [
            init.evidence if e.startswith("exp's argument reached") else e for e in evidence
        ]
    norm = _normalized_later(ev) if kind == "softmax" and not cplx else None
    if norm is not None:
        evidence.append(
            f"the exp's result is normalized at {norm.source}: {norm.code} -- a "
            + (
                "log of a ratio of exps (a cross-entropy written by hand)"
                if norm.log
                else "softmax written by hand"
            )
        )
    if cplx and kind == "softmax":
        kind = "exp"  # a complex tensor has no max to subtract: bound its real part
    # an exp summed per segment by index (index_add_, scatter_add): a softmax per segment
    seg = _segment_sum(ev) if name in _BARE_EXP and not cplx and not result_only else None
    if seg is not None:
        kind = "softmax"
        evidence.append(
            f"the exp's result is summed per {seg.index} by {seg.call} at {seg.source}: a "
            f"softmax over each {seg.index} segment, whose max is the segment's own"
        )
    device = device_type(ev, a.record.device)
    # the module the op ran in: the record's, or one inside it that sentinel does not hook
    recurrent = (a.module_type or a.record.module_type) in _RECURRENT
    first = _first_step(ctx)
    if subst is not None and lim is not None:
        explanation = _explain_substituted(subst, dtype, lim)
        fix = _fix_substituted(ev.code)
    elif loop is not None:
        explanation = _explain_loop(loop, dtype)
        fix = _fix_loop(loop, module_ref(loop.path) if loop.backward else None)
    elif batch is not None:
        explanation = _explain_batch(batch, dtype)
        fix = _fix_batch(batch)
        pre = _prescaled(ev.code, ev.source) if kind == "matmul" else None
        if pre is not None:
            fix += (
                f"\n{pre[0]}   # and scale before the product: the result is the same, and "
                "its sums stay in range" + (f"\n{pre[1]}" if pre[1] else "")
            )
    elif jump is not None and lim is not None:
        explanation = _explain_jump(jump, dtype, lim, _setting_cause(ctx))
        fix = _fix_jump(ctx, jump)
    elif fill is not None and lim is not None:
        explanation, fix = fill.explanation(dtype, lim), fill.fix()
    elif arg_jump is not None and lim is not None:
        explanation = _explain_arg_jump(arg_jump, dtype, lim)
        fix = _fix_arg_jump(ctx, arg_jump, ev.code, lim)
    elif init is not None and lim is not None:
        explanation, fix = init.explanation(dtype, lim), init.fix(lim)
    elif cums is not None and lim is not None:
        explanation, fix = _cumsum_exp(cums, name.rstrip("_"), ev.code, dtype, lim)
    elif tpow is not None and lim is not None:
        explanation = _explain_tensor_power(tpow, dtype, lim)
        fix = _fix_tensor_power(tpow, lim)
    elif data is not None and lim is not None:
        explanation = _data_overflow(data, dtype, lim)
        fix = _data_fix(ev.code, name.rstrip("_") == "cosh" and _log_of_cosh(ctx, ev))
    elif wide and lim is not None and (target := _huge_target(ev, lim)) is not None:
        explanation, fix = _target_overflow(target, dtype, lim)
        evidence.append(target.line())
    elif wide and lim is not None:
        cause = "" if first else _setting_cause(ctx)
        small = (
            _grown_inside(ctx, _overflowing(name, x, big))
            if first and not cplx and kind == "other"
            else None
        )
        by_hand = _sigmoid_by_hand(ev.code) if kind == "exp" and not cplx and first else None
        explanation = _explain_wide(
            kind,
            dtype,
            lim,
            None if result_only else x,
            big,
            recurrent=recurrent,
            cause=cause or (_inside_cause(ctx, small) if small is not None else ""),
            complex_=cplx,
            op=name.rstrip("_"),
            sigmoid=by_hand is not None,
        )
        fix = _fix_wide(
            kind,
            name,
            dtype,
            lim,
            ev.code,
            recurrent=recurrent,
            first=first,
            ref=_called_ref(ev.code, a.path) if recurrent else _module_ref(ctx, a),
            update=_update_fix(ctx, _grown_path(ctx, a), clip_first=True),
            clip=_clip_line(ctx),
            setting=bool(cause),
            complex_=cplx,
            cast_input=_cast_input(ctx, ev) if kind == "cast" else None,
            inside=_inside_fix(ctx, small) if small is not None else None,
            source=ev.source,
        )
        if by_hand is not None:
            fix = (
                f"{by_hand}   # 1 / (1 + exp(-x)) is torch.sigmoid(x): same values, no "
                "overflow, a finite gradient"
            )
        produced = ""  # the line naming the exp's producer, when one is told
        if kind == "exp" and first and not cplx and not result_only and by_hand is None:
            # its argument unkept (watch, sentinel): the recorded output it is; inputs far
            # past a unit scale: the data, not the weights, put it past the bound
            made = _exp_producer(ctx, ev, lim) if x is None else None
            if made is not None:
                produced = _producer_line(made)
                evidence.append(produced)
                if not ev.code:  # the template's x: say which tensor it is
                    head, sep, rest = fix.partition("\n")
                    fix = f"{head}   # x: {made.path}'s {made.role}{sep}{rest}"
            # not an exp of a weight itself (a log-scale parameter): the data does not reach it
            own = bool(ev.params) or ev.made_from[:1] == ["leaf"]
            unscaled = None if own else _unscaled_input(ctx)
            if unscaled is not None:
                evidence = [
                    e.replace("the initial weights or the inputs put it there", "the inputs did")
                    for e in evidence
                ]
                evidence.append(unscaled.line())
                explanation = _explain_unscaled(unscaled, dtype, lim, made)
                fix = f"{unscaled.fix()}\n# and only as a guard: {fix}"
        big_step = (
            _oversized_update(ctx, ctx.history[-1])
            if kind == "exp" and not cplx and not first and not cause and ctx.history
            else None
        )
        if big_step is not None and ".clamp(" in fix.splitlines()[0]:
            # the update before this step moved the weights by their own size: the lr leads
            evidence.append(big_step.evidence())
            explanation, fix = _exp_after_big_step(big_step, dtype, lim, x, fix)
        stale = (
            _stale_ratio(ctx, ev, None if result_only else x)
            if kind == "exp" and name.rstrip("_") == "exp" and not cplx and by_hand is None
            else None
        )
        if stale is not None:  # exp(a - b), b without gradient: a ratio to stored values
            evidence = [e for e in evidence if e != produced]  # the graph says what it is
            evidence.append(stale.line())
            explanation, fix = stale.explanation(dtype, lim), stale.fix(ev.code, lim)
        spiked = (
            _spike_lr(ctx)
            if kind == "matmul"
            and not recurrent
            and not first
            and not cause
            and '["lr"]' not in fix
            else None
        )
        if spiked is not None:
            # the loss has stayed high since an oversized update made it spike (NW308): the
            # weights grew from that update, and the lr it named leads (a product's fix is
            # otherwise a normalization, an init and clipping: no lr)
            spike_at, line = spiked
            evidence.append(
                f"the loss has stayed high since step {spike_at}, where it spiked after an "
                "oversized update (NW308)"
            )
            explanation += (
                f" The loss spiked at step {spike_at}, right after an update that moved the "
                "weights by many times their own size (NW308), and has stayed high since: these "
                "values grew from that update, and every further one at that learning rate grows "
                "them again. Lower that learning rate first."
            )
            then = f"# the lr first (NW308 of step {spike_at}); then, if it still overflows:"
            fix = f"{line}\n{then}\n{fix}"
        if name.rstrip("_") == "cosh" and not cplx and _log_of_cosh(ctx, ev):
            # a log-cosh loss: the same loss without cosh, not a clamp that zeroes its
            # gradient (tanh(d)) past the bound
            fix = (
                "log_cosh = d.abs() + F.softplus(-2 * d.abs()) - math.log(2)   # = "
                "torch.log(torch.cosh(d)), d what you pass to cosh: finite for every d\n"
                "# not torch.cosh(d.clamp(...)): past the clamp the loss stops growing and its "
                "gradient is 0, so the largest errors stop being learned"
            )
        fn = custom_function(ev.node) if ev.phase is Phase.BACKWARD else None
        if fn is not None and math.isnan(big) and kind == "other":
            # its own backward() made it from a gradient that was not measured
            at = f" at {ev.source}" if ev.source else ""
            fix = (
                f"# {fn}.backward made {ev.born}: each factor it multiplies the gradient by "
                f"(what forward saved on ctx, the arguments of {fn}.apply{at}) must be "
                "finite and not huge\n"
                f"# torch.autograd.gradcheck({fn}.apply, inputs) on small float64 inputs checks "
                "the backward against the forward"
            )
    elif power is not None and lim is not None:
        explanation = (
            f"{fmt(power[0])} ** t grows with the exponent t, and {dtype} holds values up to "
            f"{fmt(lim.max)}: its largest exponent's power is {fmt(power[2])}, which became "
            "inf. Frequencies and scales built as base ** (i / d) (rotary embeddings, "
            "sinusoidal positions) are computed in float32 and only their bounded results "
            "(cos, sin) cast to the model's dtype."
        )
        fix = _power_fix(ev.code, power, dtype, ref=_module_ref(ctx, a))
    elif ints is not None and lim is not None:
        explanation, fix = _int_cast(ev.code, ints[1], source, dtype, lim)
    elif back_cast and lim is not None and (ev.node or "ToCopy").startswith("ToCopy"):
        explanation, fix = _cast_back(dtype, lim, ev.code)
    elif (back_cast or promoted) and lim is not None:  # type promotion: a low-precision
        # operand's gradient
        explanation = _explain_fixed_factor(dtype, lim, few=False)
        fix = _fix_fixed_factor(dtype, _module_ref(ctx, a), ev.code)
    else:
        explanation = _explain(kind, dtype, lim)
        fix = _fix(
            kind,
            name,
            dtype,
            lim,
            ev.code,
            device=device,
            ref=_module_ref(ctx, a),
            arg=math.nan if result_only else arg,
            scalar=x is not None and x.numel == 1,
            loss=(ev.path or a.path) == LOSS_PATH,
            autocast=_under_autocast(ctx, dtype),
            result=_true_result(name, ev),
            cast_input=_cast_input(ctx, ev) if kind == "cast" else None,
            operands=tuple(s.magnitude for _, s in ev.inputs if s is not None),
            # the op's inf is itself the module's output (a state it returns), not an
            # intermediate whose NaN followed: cast back, that output is inf again
            output_fits=not (
                trigger is ev
                and a.record.stat is not None
                and not a.record.stat.has_nan
                and a.record.bad
                and a.record.phase is Phase.FORWARD
                and a.record.role.startswith("output")
                and a.record.path == (ev.path or a.path)
            ),
            source=ev.source,
            # a Python number operand (x / tau): no .float() on it
            number_side=(
                "right" if "other" in ev.scalars else "left" if "self" in ev.scalars else None
            ),
            number=_as_float(ev.scalars.get("other")),
        )
        cast = (
            _cast_model(ctx, ev.path or a.path, dtype, lim, device)
            if kind == "matmul"
            and lim is not None
            and (ev.path or a.path) != LOSS_PATH
            and not _under_autocast(ctx, dtype)
            and _upcast_matmul(ev.code) is None
            else None
        )
        if cast is not None:  # the product ran in a library layer's forward: the cast model
            explanation += f" {cast[0]}"
            fix = cast[1]
        heavy = (
            _heavy_weights(ctx, a.path, lim, _module_ref(ctx, a))
            if kind == "backward" and lim
            else None
        )
        if heavy is not None:  # the module's own weights multiply the gradient past the max
            explanation += f" Here the likelier cause is {a.path}'s own weights: {heavy[0]}."
            fix = f"{heavy[1]}\n# or, if a large loss is the cause:\n{fix}"
    moved = _closure_moved(ctx) if wide and subst is None and loop is None else None
    if moved is not None and batch is None and jump is None and init is None:
        explanation += (
            f" Here it happened {_closure_words(moved)}: {moved[0]} evaluates the loss several "
            "times in one step() and updates the weights after each evaluation, so an lr "
            "too large for its iterations moves them past the overflow within a single step."
        )
        fix = "\n".join([*_closure_fix(moved), fix])
    if not wide and loop is None and batch is None and jump is None and kind != "backward":
        in_loss = _loss_module_fix(ctx, a, ev, dtype, lim)
        fix = in_loss if in_loss is not None else fix
        callee = _unwatched_callee(ev, lim) if in_loss is None else None
        if callee is not None and lim is not None:
            fix = _fix_unwatched_callee(callee, ev, dtype, lim)
        raw = (
            _raw_input(ctx, lim)
            if lim is not None
            and ev.phase is Phase.FORWARD
            and in_loss is None
            and not dtype.startswith("float8")  # a float8 cast quantizes: it takes a scale
            else None
        )
        if raw is not None and lim is not None:
            evidence.append(
                f"the model's input {raw.path} ({raw.role}) holds raw values up to "
                f"{fmt(raw.stat.magnitude if raw.stat else math.nan)}, far beyond the unit "
                f"scale of activations; {dtype}'s largest value is {fmt(lim.max)}"
            )
            explanation += (
                " The values that overflow come from the model's input: features fed raw "
                "(amounts, counts, coordinates in their own units) make every layer's values "
                "that large, so a clamp here only moves the overflow to the next op."
            )
            fix = _fix_raw_input(raw, dtype, device)
    weighted = (
        _weighted_lse_fix(ev.code, norm)
        if norm is not None and norm.log and name.rstrip("_") == "exp"
        else None
    )
    if weighted is not None and loop is None and batch is None and jump is None:
        fix = weighted
    elif norm is not None and norm.log and loop is None and batch is None and jump is None:
        got: list[str] = []

        def keep(e: str) -> str:
            got.append(e)
            return e

        _rewrite_calls(ev.code, name.rstrip("_"), keep)
        logits = got[0] if len(got) == 1 else "the exp's argument"
        fix += (
            f"\n# {norm.code} is a cross-entropy over the rows of {logits}: in log space "
            f"it neither overflows nor underflows: F.cross_entropy({logits}, <row's target "
            "index>), or F.log_softmax / torch.logsumexp over the same rows (masked entries "
            "set to -inf first)"
        )
    summed = _log_of_summed_exp(ctx) if not ev.code and name.rstrip("_") == "exp" else None
    if summed is not None and weighted is None and loop is None and batch is None and jump is None:
        fn = "logcumsumexp" if summed == "cumsum" else "logsumexp"
        fix = (
            f"y = torch.{fn}(x, dim)   # was: torch.log(torch.{summed}(torch.exp(x), dim))\n"
            f"# the loss takes the log of a {summed} of exps (the graph from the loss: log <- "
            f"{summed} <- exp): in log space it cannot overflow, and the loss is unchanged; a "
            "clamp of exp's argument would change it (a Cox loss clamped so becomes unbounded "
            "below)"
        )
    logi = _logistic(ev) if name in _BARE_EXP and not cplx and not result_only else None
    if logi is not None:
        evidence.append(
            f"the exp's result is divided by a sum of itself and a term that is no exp: "
            f"{logi.shown} -- not a softmax, so subtracting a max would change the value"
        )
    if logi is not None and logi.lines and lim is not None and subst is None and loop is None:
        explanation = _explain_logistic(dtype, lim)
        fix = _fix_logistic(logi)
    if seg is not None and loop is None and batch is None and jump is None:
        fix = _segment_fix(ev.code, name.rstrip("_"), seg) or fix
        explanation += (
            f" Here the sum is per segment ({seg.call}): the max to subtract is each "
            f"{seg.index} segment's own, not one over the whole tensor."
        )
    return ctx.diagnosis(**fields, evidence=evidence, explanation=explanation, fix=fix)


#: ops that move or cast values without changing them (between a scale and its product)
_VALUE_MOVERS = frozenset(
    {"t", "transpose", "permute", "view", "reshape", "unsqueeze", "squeeze", "expand",
     "clone", "contiguous", "to_copy", "_to_copy", "unsafe_view"}
)  # fmt: skip


@dataclass(frozen=True)
class _ScaledLogits:
    """An exp whose argument is a product divided (or multiplied) by a number -- a
    similarity over a temperature, ``z1 @ z2.t() / tau`` -- and whose result the loss
    normalizes and takes the log of: a softmax cross-entropy written by hand."""

    scale: str  #: the op that scaled the product: ``div`` or ``mul``
    product: str  #: the product: ``mm``, ``bmm``, ...
    diagonal: bool  #: the log's numerator picks the diagonal (positives at i == i)
    summed: bool  #: the log is of a sum of the exps (a logsumexp), not of a ratio
    arg: float  #: how far the argument is known to reach (a lower bound)
    wide: float  #: the exp bound of float32, the widest dtype autocast computes in
    past: bool  #: the argument is known to pass ``wide``: a float32 exp overflows too
    measured: bool  #: ``arg`` is the argument's measured maximum, not a bound from the result
    #: the line that takes the log, when the user's code told it (no loss graph was read)
    at: str | None = None


def _scaled_logits(
    ctx: RuleContext, ev: OpEvent, x: TensorStat | None, lim: DtypeLimits
) -> _ScaledLogits | None:
    """See :class:`_ScaledLogits`: read from the autograd graph, op by op. The chain below
    the exp (its ``made_from``) starts with a ``div`` or ``mul`` of a product of two
    tensors (``mm``, ``bmm``: a Gram matrix, a similarity); a log of the loss graph was
    taken of a ratio or a sum of that exp's results. How far the argument reached is its
    measured maximum, else the exp's result tells it: its largest finite value's log, and
    past the dtype's exp bound where it holds +inf."""
    if ev.phase is not Phase.FORWARD:
        return None
    below = [m.removeprefix("watched:") for m in ev.made_from]
    if len(below) < 2 or below[0] not in ("div", "mul"):
        return None
    rest = [m for m in below[1:] if m not in _VALUE_MOVERS]
    if not rest or rest[0] not in _GRAPH_PRODUCTS:
        return None
    found: list[str] | None = None
    for n in ctx.notes("loss_graph"):
        logs = n.data.get("logs")
        for raw in logs if isinstance(logs, list) else []:
            if not isinstance(raw, list) or "exp" not in raw:
                continue
            chain = [str(c) for c in raw]
            if chain[0] in ("div", "sum"):
                found = chain
                break
        if found is not None:
            break
    at: str | None = None
    if found is None:  # no loss graph was read (forensic mode): the user's lines tell it
        found, at = _normalized_by_log(ev)
    if found is None:
        return None
    wide = _exp_bound("float32")
    top = signed_max(x)
    past = top > wide
    measured = not math.isnan(top)
    if not measured:
        out = ev.output
        top = math.log(out.finite_amax) if out.finite_amax else -math.inf
        if out.has_posinf:
            top = max(top, lim.exp_bound)
            # +inf in a dtype of float32's range (bfloat16's bound is float32's, rounded)
            past = math.isclose(lim.exp_bound, wide, rel_tol=1e-3) or lim.exp_bound > wide
    if not math.isfinite(top):
        return None
    upto = found[: found.index("exp")]
    return _ScaledLogits(
        below[0], rest[0], "diagonal" in upto, found[0] == "sum", top, wide, past, measured, at
    )


def _normalized_by_log(ev: OpEvent) -> tuple[list[str] | None, str | None]:
    """The chain a loss graph's log would give (``["div", "diagonal", "exp"]``, or
    ``["sum", "exp"]`` for a log of the sum) when a later line of the exp's function takes
    the log of a ratio or a sum of its results (:func:`_normalized_later`), and that line
    (``file.py:26: loss = ...``); (None, None) when none does."""
    norm = _normalized_later(ev)
    if norm is None or not norm.log:
        return None, None
    diag = ["diagonal"] if re.search(r"\bdiag(?:onal)?\(", norm.code) else []
    chain = ["div", *diag, "exp"] if "/" in norm.code else ["sum", "exp"]
    return chain, f"{norm.source}: {norm.code}"


def _scaled_logits_diagnosis(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    trigger: OpEvent,
    *,
    lg: _ScaledLogits,
    lim: DtypeLimits,
) -> Diagnosis:
    """NW101 for the exps of a similarity over a temperature, normalized by hand: the
    fix is the same loss in log space, which no dtype's exp bound limits."""
    dtype = ev.dtype or a.record.dtype
    op = short_op(ev.op)
    scaled = "divided" if lg.scale == "div" else "multiplied"
    formula = "logits = sim / tau" if lg.scale == "div" else "logits = sim * scale"
    evidence = [
        f"{op} made {ev.born} in {dtype}; exp overflows above {fmt(lim.exp_bound)} = "
        f"log({fmt(lim.max)}), the largest finite {dtype} value"
        + (
            f"; {ev.output.posinf} of its {ev.output.numel} results are +inf"
            if ev.output.posinf
            else ""
        ),
        f"the exp's argument is a product of two tensors, then {scaled} (the graph below "
        f"the exp: {lg.scale} <- {lg.product}): a similarity over a temperature, whose "
        "range is |similarity| / temperature -- 100 for cosines over 0.01",
        f"the loss takes the log of {'a sum' if lg.summed else 'a ratio'} of these exps: a "
        "softmax cross-entropy written by hand" + (f" (at {lg.at})" if lg.at else ""),
    ]
    if lg.past:
        evidence.append(
            f"its argument passed {fmt(lg.wide)}, the exp bound of float32 and bfloat16 "
            "alike: a float32 exp overflows as well"
        )
    elif not lg.measured:
        evidence.append(
            f"how far past {fmt(lim.exp_bound)} its argument went is not known (autograd "
            f"kept the exp's result, not its argument): a float32 exp overflows above "
            f"{fmt(lg.wide)}, which a similarity over a small temperature passes as well"
        )
    else:
        evidence.append(
            f"its argument reached {fmt(lg.arg)}: a float32 exp fits it, until a smaller "
            f"temperature or closer pairs pass {fmt(lg.wide)}"
        )
    line = code_line(ev)
    if line:
        evidence.append(line)
    if trigger is not ev:
        why = " (inf - inf, inf / inf and 0 × inf are NaN)" if "NaN" in trigger.born else ""
        evidence.append(f"then {short_op(trigger.op)} turned the inf into {trigger.born}{why}")
    explanation = (
        f"The exp's argument is a similarity {scaled} by a temperature ({formula}): "
        "with a small temperature the logits reach |sim| / tau, which can pass the exp bound "
        "of every "
        f"float dtype ({fmt(lg.wide)} in float32 and bfloat16, {fmt(_exp_bound('float16'))} "
        "in float16). The loss normalizes the exps and takes the log: in log space that is "
        "a cross-entropy over the logits, which subtracts each row's max and cannot "
        "overflow in any dtype. A float32 cast moves the bound only to "
        f"{fmt(lg.wide)}, and a clamp of the logits changes the loss."
    )
    labels = (
        "labels = torch.arange(len(logits), device=logits.device)   # each row's positive: "
        "the diagonal"
        if lg.diagonal
        else "labels = ...   # each row's positive: its index along the last dim"
    )
    positives = (
        "logits.diagonal()" if lg.diagonal else "logits.gather(-1, labels[:, None]).squeeze(-1)"
    )
    fix = (
        f"{formula}   # the exp's argument (sim: the {lg.product}; the temperature as "
        "you wrote it)\n"
        f"{labels}\n"
        "loss = F.cross_entropy(logits, labels)   # log-softmax inside: no exp overflows\n"
        f"# or the same loss in log space: (torch.logsumexp(logits, dim=-1) - {positives}).mean()\n"
        + (
            f"# not torch.exp(logits.float()): float32's exp overflows above {fmt(lg.wide)} too"
            if lg.past
            else f"# not torch.exp(logits.float()): float32's exp fits up to {fmt(lg.wide)} "
            "only, which a small temperature passes"
        )
    )
    return ctx.diagnosis(**op_fields(ev, a), evidence=evidence, explanation=explanation, fix=fix)


@dataclass(frozen=True)
class _ArrivingGradient:
    """The gradient a backward product multiplied: the one that arrived at the module's
    output (its backward record), and the one at the model's output (the loss code's)."""

    path: str  #: the module whose output's gradient it is
    size: float  #: its largest magnitude
    model_path: str | None  #: the model whose output's gradient ``at_model`` is
    at_model: float  #: that gradient's largest magnitude (NaN when not recorded)

    @property
    def from_loss(self) -> bool:
        """The gradient was as large at the model's output: no layer's backward grew it."""
        return math.isfinite(self.at_model) and self.at_model * 10 >= self.size


def _arriving_gradient(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, lim: DtypeLimits
) -> _ArrivingGradient | None:
    """A backward matmul (a Linear's weight gradient: the arriving gradient times the
    layer's input, summed over the batch) whose recorded operands cannot pass ``lim.max``
    by themselves -- their largest magnitudes times the most terms a sum can have stay
    below it -- while the gradient recorded at the module's output (its backward record)
    times the largest operand over as many terms does: the gradient is what was huge."""
    if ev.phase is not Phase.BACKWARD:
        return None
    path = ev.path or a.path
    ins = [s for s in inputs_of(ev) if math.isfinite(s.magnitude)]
    if not path or len(ins) != len(ev.inputs) or not ins:
        return None  # an operand unmeasured or not finite: the records tell nothing more
    trace = ctx.trace
    grads = [
        r
        for r in trace.records
        if r.phase is Phase.BACKWARD
        and r.path == path
        and r.role.startswith("output")
        and r.stat is not None
        and math.isfinite(r.stat.magnitude)
        and r.index < a.record.index
    ]
    if not grads:
        return None
    g = max(grads, key=lambda r: r.stat.magnitude if r.stat is not None else 0.0)
    assert g.stat is not None
    size = g.stat.magnitude
    terms = max(*(s.numel for s in ins), g.stat.numel, 1)
    mags = sorted((s.magnitude for s in ins), reverse=True)
    own = mags[0] * (mags[1] if len(mags) > 1 else 1.0) * terms
    if own >= lim.max or size * mags[0] * terms < lim.max or size <= own:
        return None
    # the model's output: what the roots returned, and the records they were measured as
    outs = {r.index for r in trace.root_outputs()}
    outs |= {trace.resolve(r).index for r in trace.root_outputs()}
    at_model = [
        r
        for r in trace.records
        if r.phase is Phase.BACKWARD
        and r.source in outs
        and r.stat is not None
        and math.isfinite(r.stat.magnitude)
    ]
    top = max(at_model, key=lambda r: r.stat.magnitude if r.stat is not None else 0.0, default=None)
    model = next((r.path for r in trace.root_outputs() if top is not None), None)
    return _ArrivingGradient(
        path,
        size,
        model,
        top.stat.magnitude if top is not None and top.stat is not None else math.nan,
    )


def _gradient_product(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    trigger: OpEvent,
    *,
    grad: _ArrivingGradient,
    lim: DtypeLimits,
) -> Diagnosis:
    """NW101 for a backward product that a huge arriving gradient pushed past the max."""
    dtype = ev.dtype or a.record.dtype
    op = short_op(ev.op)
    mags = ", ".join(fmt(s.magnitude) for s in inputs_of(ev)[:3])
    at = f" ({ev.node})" if ev.node else ""
    evidence = [
        f"in backward{at}, {op} made {ev.born} in {dtype}: the gradient arriving at "
        f"{grad.path}'s output is up to |g| = {fmt(grad.size)}; times values up to {mags} "
        f"and summed over the inner dimension, it passed {fmt(lim.max)} (the largest finite "
        f"{dtype} value)",
    ]
    for nm, s in ev.inputs[:3]:
        evidence.append(f"input {nm}: {describe_stat(s)}")
    scaled = _scaled_backward(ctx) if grad.from_loss else None
    loss = next(
        (
            r.stat.magnitude
            for r in ctx.trace.records
            if r.path == LOSS_PATH and r.phase is Phase.FORWARD and r.stat is not None
        ),
        math.nan,
    )
    if grad.from_loss:
        where = f" ({grad.model_path})" if grad.model_path else ""
        evidence.append(
            f"the gradient of the model's output{where} is already up to |g| = "
            f"{fmt(grad.at_model)}, before any layer's backward: the loss code scaled it"
            + (f" (the loss is {fmt(loss)})" if math.isfinite(loss) else "")
            + ", a manual loss scale far too large"
        )
        if scaled is not None:
            evidence.append(scaled.line())
        explanation = (
            f"{dtype} holds values up to {fmt(lim.max)}. This product is a backward matmul: "
            f"a weight's gradient, the gradient arriving at {grad.path}'s output times the "
            "layer's input, summed over the batch. Its forward values are ordinary; the "
            f"gradient is not: it left the loss at {fmt(grad.at_model)}, so the loss code "
            "multiplied the loss (or its gradient) by a large factor -- a manual loss scale "
            "far too large. Every gradient carries that factor, and a sum over the batch "
            "passes the max."
        )
        fix = (
            f"loss.backward()   # was: {scaled.code}: drop the factor {scaled.const}"
            if scaled is not None
            else "loss.backward()   # drop the manual factor on the loss: backward() of the "
            "loss itself"
        )
        fix += (
            "\n# float16 gradients: scaler = torch.amp.GradScaler(); "
            "scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()"
            "\n# it picks the largest scale that fits, unscales before the step, and skips a "
            "step that overflowed"
        )
    else:
        evidence.append(
            f"the gradient grew in backward: up to |g| = {fmt(grad.at_model)} at the model's "
            f"output, {fmt(grad.size)} at {grad.path}'s output"
            if math.isfinite(grad.at_model)
            else "the gradient of the model's output was not recorded: where it grew is not known"
        )
        explanation = (
            f"{dtype} holds values up to {fmt(lim.max)}. This product is a backward matmul: "
            f"a weight's gradient, the gradient arriving at {grad.path}'s output times the "
            "layer's input, summed over the batch. Its forward values are ordinary; the "
            "gradient is not: the layers' backward between the loss and this module "
            "multiplied it past the max (exploding gradients)."
        )
        fix = (
            "self.norm = nn.LayerNorm(d)   # in __init__, after the layers whose backward "
            "grows the gradient\n"
            "nn.init.xavier_uniform_(w)    # initial weights of gain ~1, not larger"
        )
    line = code_line(ev)
    if line:
        evidence.append(line)
    if trigger is not ev:
        evidence.append(f"then {short_op(trigger.op)} turned the inf into {trigger.born}")
    return ctx.diagnosis(**op_fields(ev, a), evidence=evidence, explanation=explanation, fix=fix)


def _loss_module_fix(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, dtype: str, lim: DtypeLimits | None
) -> str | None:
    """The op overflowed inside a watched loss module (torch's own nn.GaussianNLLLoss,
    whose code the user cannot edit): call the loss on float32 inputs, on the user's line
    (``loss = crit(mu.float(), y.float(), var.float())``) when it shows the call."""
    call = ctx.trace.call(a.record.call)
    if call is None or not call.is_loss or lim is None or a.path == LOSS_PATH:
        return None
    inside = ev.path == call.path if ev.path else a.record.phase is not Phase.INPUT
    if not inside:
        return None  # the op ran before the loss call (a teacher's forward): not in the loss
    loss = a.record.module_type or ""
    cls = getattr(torch.nn, loss, None)
    if not (isinstance(cls, type) and cls.__module__.startswith("torch.nn.")):
        return None  # the user's own loss module: its forward is theirs to edit
    op = packet(ev.op).rstrip("_")
    top = fmt(lim.max)
    why = (
        f"# {op} inside {loss} passed {top}, {dtype}'s largest value: on float32 inputs the "
        f"loss computes in float32 (the model may stay in {dtype})"
    )
    n_in = sum(
        1
        for r in ctx.trace.records
        if r.call == call.id and r.phase is Phase.INPUT and (r.role or "").startswith("input[")
    )
    plain = ev.code.split("  #", 1)[0].strip() if ev.code else ""
    fixed = _float_call(ev.code, n_in) if n_in else None
    if fixed is not None:
        return f"{fixed}  # was: {plain}\n{why}"
    return (
        f"# where {loss} is called: give it .float() of each tensor argument, not the "
        f"{dtype} tensors\n{why}"
    )


#: ops a layer runs (a Linear, a convolution): made on a line that calls none of them
#: itself, they ran inside a callable the line calls
_LAYER_OPS = frozenset(
    {"addmm", "mm", "bmm", "baddbmm", "addmv", "mv", "matmul", "linear", "convolution"}
)
#: a line's own spelling of such an op: then the op may be the line's, not the callee's
_LAYER_CALLS = re.compile(
    r"@|\b(?:addmm|mm|bmm|baddbmm|addmv|mv|matmul|linear|conv\w*|einsum)\s*\("
)


def _unwatched_callee(ev: OpEvent, lim: DtypeLimits | None) -> str | None:
    """The callable on the op's line that ran it, outside every watched module: a layer op
    (addmm of a Linear) in float16 on a line that spells no product itself and calls one
    name that is neither torch's nor a builtin (``teacher`` in ``t = teacher(x.half())``:
    a module nanwatch does not watch)."""
    if ev.path is not None or ev.phase is not Phase.FORWARD or not ev.code:
        return None
    if lim is None or not lim.short_range or packet(ev.op).rstrip("_") not in _LAYER_OPS:
        return None
    plain = ev.code.split("#", 1)[0]
    if _LAYER_CALLS.search(plain):
        return None
    names: set[str] = set()
    for stmt in statements(ev.code):
        try:
            tree = ast.parse(stmt)
        except SyntaxError:
            return None
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Name) and not _library_name(f.id):
                names.add(f.id)
            elif (
                isinstance(f, ast.Attribute)
                and isinstance(f.value, ast.Name)
                and f.value.id == "self"
            ):
                names.add(f"self.{f.attr}")
    return next(iter(names)) if len(names) == 1 else None


def _library_name(name: str) -> bool:
    """A builtin's or a torch function's name (``len``, ``matmul`` imported bare)."""
    return hasattr(builtins, name) or hasattr(torch, name) or hasattr(torch.nn.functional, name)


def _fix_unwatched_callee(callee: str, ev: OpEvent, dtype: str, lim: DtypeLimits) -> str:
    """The op ran inside ``callee``, which nanwatch does not watch, in a short-range dtype:
    run it in float32 (or bfloat16, float32's range), or watch it so the layer is named."""
    op = packet(ev.op).rstrip("_")
    at = f" on {ev.source}" if ev.source else ""
    return (
        f"# {op} ran inside {callee}(...), called{at}: nanwatch does not watch it, and in "
        f"{dtype} its values passed {fmt(lim.max)}, {dtype}'s largest value\n"
        f"# run it in float32: {callee}.float(), called on float32 inputs (no .half() of "
        f"them); or in bfloat16, float32's range: {callee}.bfloat16()\n"
        f"# or watch it too, and nanwatch names its layer: nanwatch.watch(model, {callee}, ...)"
    )


def _float_call(code: str | None, n_args: int) -> str | None:
    """The user's statement with every positional argument of its one call of ``n_args``
    positional arguments that is not a torch function cast with ``.float()``."""
    for stmt in statements(code):
        try:
            tree = ast.parse(stmt)
        except SyntaxError:
            continue
        found = []
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or len(node.args) != n_args:
                continue
            root = node.func
            while isinstance(root, ast.Attribute):
                root = root.value
            if not isinstance(root, ast.Name) or root.id in ("torch", "F", "nn", "np", "math"):
                continue
            found.append(node)
        if len(found) != 1:
            continue
        out = stmt
        for arg in sorted(found[0].args, key=lambda x: x.col_offset, reverse=True):
            if isinstance(arg, (ast.Constant, ast.Starred)) or arg.end_col_offset is None:
                continue
            b, e = arg.col_offset, arg.end_col_offset
            raw = out.encode()
            text = raw[b:e].decode()
            out = (raw[:b] + f"{paren(text)}.float()".encode() + raw[e:]).decode()
        return out
    return None


def _complex_exp_line(
    op: str, born: str, dtype: str, x: TensorStat | None, lim: DtypeLimits
) -> str:
    """exp of a complex z: |exp(z)| = e^Re(z), so its real part passed the bound; what is
    recorded of a complex tensor is |z| only, an upper bound of Re(z), not Re(z) itself."""
    part = lim.name
    top = signed_max(x)
    known = (
        f"; nanwatch records only |z| of a complex tensor (here up to {fmt(top)}): an upper "
        "bound of Re(z), not its value"
        if not math.isnan(top)
        else ""
    )
    return (
        f"{op} made {born} in {dtype}: |exp(z)| = e^Re(z), so the real part of its input "
        f"passed {fmt(lim.exp_bound)} = log({fmt(lim.max)}), the largest finite {part} value "
        f"(each part of a {dtype} is a {part}){known}"
    )


def _integer_source(ev: OpEvent) -> tuple[str, TensorStat] | None:
    """The integer (or bool) tensor a cast read, by schema name: a cast of an int64 count
    has no floating input, its values are in ``other_inputs``; None for a floating one."""
    if inputs_of(ev):
        return None
    return next(((nm, s) for nm, s in ev.other_inputs if s.numel > 0), None)


def _paren_note(text: str | None) -> str:
    """`` (int64)`` for ``int64``; "" for None."""
    return f" ({text})" if text else ""


def _integer_magnitude(s: TensorStat) -> float:
    return max(abs(s.min), abs(s.max))


def _integer_values(ints: tuple[str, TensorStat], source: str | None) -> str:
    """``the int64 value 80000`` (one value) or ``int64 values up to |x| = 80000``."""
    _, s = ints
    kind = source or "integer"
    if s.numel == 1:
        return f"the {kind} value {fmt(s.max)}"
    mag = fmt(_integer_magnitude(s))
    return f"{kind} values up to |x| = {mag} (min {fmt(s.min)}, max {fmt(s.max)})"


def _call_end(line: str, dot: int) -> int | None:
    """The index just past the call that starts at ``dot`` (``.to(x.dtype)``)."""
    start = line.find("(", dot)
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(line)):
        if line[i] in "([{":
            depth += 1
        elif line[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _int_cast(
    code: str | None, s: TensorStat, source: str | None, dtype: str, lim: DtypeLimits
) -> tuple[str, str]:
    """An integer tensor (a token count, a length) cast to a low-precision dtype that
    cannot hold it: keep it in float32 (float64 past 2**24, where float32 stops holding
    integers exactly) and compute with it there; a clamp would silently change the count."""
    kind = source or "integer"
    mag = _integer_magnitude(s)
    exact = 2**24
    wide, method = ("float32", ".float()") if mag <= exact else ("float64", ".double()")
    holds = f"{wide} holds integers exactly up to {fmt(exact if wide == 'float32' else 2**53)}"
    explanation = (
        f"Casting to {dtype} turns every value beyond ±{fmt(lim.max)} into "
        f"{_past_max(dtype)}: an {kind} tensor (a count, a length, a step number) of "
        f"{fmt(mag)} does not fit {dtype}, whose largest value is {fmt(lim.max)}. {holds}; "
        "clamping it would make the count silently wrong."
    )
    line = code.split("  #", 1)[0].rstrip() if code else ""
    plain = line.strip()
    was = f"  # was: {plain}" if plain else ""
    at = _cast_receiver(plain) if plain else None
    end = _call_end(plain, at[1]) if at is not None else None
    why = (
        f"# {_integer_values(('', s), source)} is past {fmt(lim.max)}, {dtype}'s largest "
        f"value; {holds}"
    )
    how = (
        f"# and compute with it in {wide}: a one-value {wide} tensor combined with a {dtype} "
        f"tensor is computed in {dtype} again (type promotion), so give the other tensor "
        f"{method} too; cast to {dtype} only a result that fits (a ratio, a mean)"
        if s.numel == 1
        else f"# and keep what uses it in {wide}; cast to {dtype} only a result that fits (a "
        "ratio, a mean)"
    )
    if at is None or end is None:
        return explanation, (
            f"# keep the {kind} tensor in {wide} ({method}) instead of casting it to {dtype}"
            f"{was}\n{why}\n{how}"
        )
    indent = line[: len(line) - len(line.lstrip())]
    fixed = f"{indent}{plain[: at[1]]}{method}{plain[end:]}"
    kept = _assigned(fixed) or "it"
    how = how.replace("compute with it", f"compute with {kept}", 1)
    return explanation, f"{fixed}{was}\n{why}\n{how}"


def _under_autocast(ctx: RuleContext, dtype: str) -> bool:
    """Ops ran in ``dtype`` while the weights are wider (float32 weights, low-precision
    activations): autocast; False when a weight is of ``dtype`` itself (``model.half()``)
    or the weights' dtypes are unknown."""
    seen: set[str] = set()
    for t in (*ctx.history, ctx.trace):
        for n in t.notes:
            if n.kind == "optimizer":
                for g in n.data.get("groups", ()):
                    if isinstance(g, dict):
                        seen.update(str(d) for d in g.get("dtypes", ()))
        seen.update(r.dtype for r in t.records if r.phase in (Phase.GRADIENT, Phase.PARAMETER))
    return bool(seen) and dtype not in seen


def _scalar_power(ev: OpEvent) -> tuple[float, float, float] | None:
    """``number ** tensor`` (aten.pow.Scalar) that overflowed: the base, the exponent of
    the largest power among the input's extremes and that power (|base| ** e)."""
    base = scalar_base(ev)
    x = first_input(ev)
    if base is None or base == 0 or x is None:
        return None
    ends = [e for e in (x.min, x.max) if math.isfinite(e)]
    if not ends:
        return None

    def power(e: float) -> float:
        try:
            return math.pow(abs(base), e)
        except OverflowError:
            return math.inf

    e = max(ends, key=power)
    return base, e, power(e)


def _power_fix(code: str | None, power: tuple[float, float, float], dtype: str, *, ref: str) -> str:
    """The user's ``number ** t`` with the exponent in float32, and what uses the result
    kept there until it is back in the dtype's range."""
    base, e, value = power
    why = f"float32: {fmt(base)} ** {fmt(e)} = {fmt(value)} does not fit {dtype}"
    line, name = _float_exponent(code)
    if line is not None:
        what = name or "the result"
        keep = (
            f"# and keep what uses {what} in float32: cast only bounded results (its cos, "
            f"sin) to torch.{dtype}"
        )
        return f"{line}   # {why}\n{keep}"
    return (
        f"# in {ref}'s forward: compute base ** t from t.float() ({why})\n"
        f"# and cast only its bounded results (cos, sin) to torch.{dtype}"
    )


@dataclass(frozen=True)
class _TensorPower:
    """``base ** exponent`` with both tensors, each ordinary, whose power overflows:
    log|base| · exponent passed log(max)."""

    base: float  #: the largest |base|
    exponent: float  #: the largest exponent
    names: tuple[str, str] | None  #: the two operands on the user's line, when it shows one

    @property
    def log(self) -> float:
        return math.log(self.base) * self.exponent


def _tensor_power(ev: OpEvent, lim: DtypeLimits) -> _TensorPower | None:
    """A forward pow of a tensor by a tensor whose inputs are both far from the dtype's max,
    but whose largest base to its largest exponent is past it; None otherwise."""
    if packet(ev.op).rstrip("_") != "pow" or ev.phase is not Phase.FORWARD:
        return None
    stats = [st for _, st in ev.inputs if st is not None]
    if len(stats) != 2:
        return None
    b, e = stats
    base, top = b.magnitude, e.max
    if not (math.isfinite(base) and math.isfinite(top)) or base <= 1 or top <= 1:
        return None
    if math.log(base) * top <= lim.exp_bound or max(base, abs(top)) > math.sqrt(lim.max):
        return None
    if lim.short_range and math.log(base) * top <= _exp_bound("float32"):
        return None  # float16's range: the power fits float32, an upcast mends it
    names: tuple[str, str] | None = None
    line = ev.code.split("  #", 1)[0].strip() if ev.code else ""
    try:
        tree = ast.parse(line)
    except SyntaxError:
        tree = None
    pows = [
        (n.left, n.right)
        for n in (ast.walk(tree) if tree is not None else ())
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow)
    ]
    if len(pows) == 1:
        left = ast.get_source_segment(line, pows[0][0])
        right = ast.get_source_segment(line, pows[0][1])
        if left and right:
            names = (left, right)
    return _TensorPower(base, top, names)


def _cumsum_exp(
    c: _CumsumExponent, op: str, code: str | None, dtype: str, lim: DtypeLimits
) -> tuple[str, str]:
    """The explanation and fix of an exp of a cumulative sum: bound the length summed,
    or exponentiate only differences of the sum (a decay between two positions)."""
    plain = code.split("  #", 1)[0].strip() if code else ""
    explanation = (
        f"{op}'s argument {c.arg} is a cumulative sum: its value at position t is the sum "
        "of t terms, so it grows with the sequence or chunk length, and a long enough one "
        f"passes {fmt(lim.exp_bound)} = log({fmt(lim.max)}) in {dtype} even when every term "
        "is small. A gated linear attention or state-space decay written as "
        "exp(cs_t) · exp(-cs_s) overflows one factor and underflows the other; their "
        "product, the decay exp(cs_t - cs_s) between two positions, is at most 1. Clamping "
        "the exponent silently gives wrong decays."
    )
    dim = re.search(r"cumsum\((?:[^,()]+,\s*)?(?:dim\s*=\s*)?(-?\d+)\s*\)", c.code)
    n = c.name
    head = (
        f"# was: {plain}\n"
        f"# never exponentiate {n} alone: exponentiate differences, exp({n}_t - {n}_s), at "
        "most 1 for s <= t when the terms are log-decays (<= 0): a masked segment sum, "
        "Mamba-2's segsum\n"
    )
    if dim is not None and dim[1] == "1" and n.isidentifier():
        seg = (
            f"seg = {n}.unsqueeze(2) - {n}.unsqueeze(1)   # [b, t, s, ...] = {n}_t - {n}_s\n"
            "causal = torch.tril(torch.ones(seg.shape[1], seg.shape[1], dtype=torch.bool, "
            "device=seg.device))\n"
            "seg = seg.masked_fill(~causal.view(1, *causal.shape, *[1] * (seg.dim() - 3)), "
            "float('-inf'))\n"
            "decay = torch.exp(seg)   # every entry <= 1: weight each (t, s) pair with it\n"
        )
    elif dim is not None and dim[1] == "-1" and n.isidentifier():
        seg = (
            f"seg = {n}[..., :, None] - {n}[..., None, :]   # [..., t, s] = {n}_t - {n}_s\n"
            "causal = torch.tril(torch.ones(seg.shape[-1], seg.shape[-1], dtype=torch.bool, "
            "device=seg.device))\n"
            "decay = torch.exp(seg.masked_fill(~causal, float('-inf')))   # every entry <= 1\n"
        )
    else:
        seg = (
            f"# seg[t, s] = {n}_t - {n}_s over the dim {n} is summed on, -inf where s > t; "
            "decay = torch.exp(seg)\n"
        )
    fix = (
        head + seg + f"# or shorter chunks: within a chunk of C positions |{c.name}| stays below "
        f"C · max|term|, keep that under {fmt(lim.exp_bound / 2)}, and carry the state "
        "across chunks; or subtract each chunk's start value before the exp"
    )
    return explanation, fix


def _explain_tensor_power(p: _TensorPower, dtype: str, lim: DtypeLimits) -> str:
    return (
        f"Neither operand of this power is large: bases up to {fmt(p.base)}, exponents up "
        f"to {fmt(p.exponent)}. But base ** exponent = exp(exponent · log(base)), and "
        f"{fmt(p.exponent)} · log({fmt(p.base)}) = {p.log:.1f} is past log({fmt(lim.max)}) = "
        f"{fmt(lim.exp_bound)}, {dtype}'s limit: a power overflows when the exponent grows "
        "(a learned shape, a sharpness exp(raw)), even with a moderate base. Normalizing the "
        "inputs does not bound it; bounding the exponent, or staying in log space, does."
    )


def _fix_tensor_power(p: _TensorPower, lim: DtypeLimits) -> str:
    base, k = p.names if p.names is not None else ("base", "exponent")
    # half the dtype's exp bound: the power stays below sqrt(max), so a product still fits
    cap = math.floor(lim.exp_bound / 2 / math.log(p.base) * 10) / 10
    bounded = (
        f"{k} = {k}.clamp(max={cap})   # before {base} ** {k}"
        if p.names is not None and k.isidentifier()
        else f"# clamp the exponent before the power: {paren(k)}.clamp(max={cap})"
    )
    return (
        f"{bounded}\n"
        f"# {fmt(p.base)} ** {fmt(p.exponent)} = e^{p.log:.1f}, past e^{fmt(lim.exp_bound)}: "
        f"bound the exponent, not the values; {cap} keeps bases up to {fmt(p.base)} below "
        f"sqrt(max) = {fmt(math.sqrt(lim.max))}\n"
        "# or make the exponent bounded where it is made: 1 + F.softplus(raw) grows linearly "
        "and (k_max - 1) * torch.sigmoid(raw) + 1 is bounded, an exp(raw) is neither\n"
        f"# or stay in log space: log({base} ** {k}) = {paren(k)} * torch.log({base}); use "
        "it where the loss takes a log, and keep the base near 1 (rescale the data so it is)"
    )


def _float_exponent(code: str | None) -> tuple[str | None, str | None]:
    """The user's line with the tensor exponent of its one ``number ** t`` cast to float32,
    and the name the line assigns (None when it assigns no plain name)."""
    if not code:
        return None, None
    line = code.split("  #", 1)[0].strip()
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None, None
    hits = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.BinOp)
        and isinstance(n.op, ast.Pow)
        and isinstance(n.left, ast.Constant)
        and isinstance(n.left.value, (int, float))
    ]
    if len(hits) != 1:
        return None, None
    seg = ast.get_source_segment(line, hits[0].right)
    if seg is None:
        return None, None
    if f"({seg})" in line:  # already parenthesized
        seg = f"({seg})"
    at = line.rfind(seg)
    new = line[:at] + f"{paren(seg)}.float()" + line[at + len(seg) :]
    stmt = tree.body[0] if len(tree.body) == 1 else None
    name = (
        stmt.targets[0].id
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name)
        else None
    )
    return new, name


def _kind(name: str, ev: OpEvent, chain: Sequence[OpEvent], ops: Sequence[OpEvent] = ()) -> str:
    """``softmax``, ``exp`` (a bare exp), ``matmul``, ``cast``, ``backward`` or ``other``."""
    if name in EXP_LIKE:
        return "softmax" if _softmax_like(ev, chain, ops) else "exp"
    if name in MATMUL:
        return "matmul"
    if name in CAST:
        return "cast"
    return "other"


def _module_ref(ctx: RuleContext, a: Anomaly) -> str:
    """``model.rnn`` for the anomaly's module (``model`` when it is the root)."""
    call = ctx.trace.call(a.record.call)
    # the record may be a child's input that the root's own code made (``a.path`` is then
    # the root's, the record's call the child's): the root is reached as ``model``
    root = call is None or call.root or any(c.root and c.path == a.path for c in ctx.trace.calls)
    return module_ref(a.path, root=root)


def _called_ref(code: str | None, path: str) -> str | None:
    """How the user's own line names the module at ``path``: ``s.rnn`` in
    ``h, _ = s.rnn(s.emb(x))`` (its attribute called on a name the line binds); None when
    the line does not call it so, and a fix must not pretend a name (``model`` may not
    exist in the user's code)."""
    attr = path.rsplit(".", 1)[-1]
    if not code or not attr.isidentifier():
        return None
    found = re.search(rf"\b((?:[A-Za-z_]\w*\.)+{re.escape(attr)})\s*\(", code.split("#", 1)[0])
    return found.group(1) if found else None


def _first_step(ctx: RuleContext) -> bool:
    """No optimizer update came before this step (the first step nanwatch saw), nor inside
    it: a closure optimizer's own iterations (:func:`_closure_moved`) update the weights
    between the evaluations of one step()."""
    return not ctx.history and ctx.step == 0 and _closure_moved(ctx) is None


def _closure_moved(ctx: RuleContext) -> tuple[str, int, float | None] | None:
    """The anomaly came inside a closure optimizer's step() (LBFGS), after its closure had
    already run backward: the optimizer's class, how many backward passes came before the
    anomaly (each followed by one of its own updates), and its lr; None otherwise. One
    step() evaluates the loss several times and moves the weights between evaluations."""
    a = ctx.anomaly
    note = next(
        (n for n in ctx.trace.notes if n.kind == "optimizer" and n.path in _CLOSURE_OPTIMIZERS),
        None,
    )
    if a is None or note is None:
        return None
    passes: dict[str, int] = {}
    for r in ctx.trace.records:
        if r.phase is Phase.GRADIENT and r.index < a.record.index:
            passes[r.role] = passes.get(r.role, 0) + 1
    n = max(passes.values(), default=0)
    if n < 1:
        return None
    lrs = [
        float(g["lr"])
        for g in note.data.get("groups", ())
        if isinstance(g, dict) and isinstance(g.get("lr"), (int, float))
    ]
    return note.path, n, max(lrs) if lrs else None


def _closure_words(moved: tuple[str, int, float | None]) -> str:
    opt, n, lr = moved
    lr_s = f", lr {hyper(lr)}" if lr is not None else ""
    return (
        f"inside {opt}.step(){lr_s}: its closure had already run {n} backward "
        f"pass{'' if n == 1 else 'es'} in this step, and {opt}'s own iterations moved the "
        "weights between them"
    )


def _closure_fix(moved: tuple[str, int, float | None]) -> list[str]:
    opt, _, lr = moved
    lines = []
    if opt == "LBFGS":
        lines.append(
            'for g in optimizer.param_groups: g["line_search_fn"] = "strong_wolfe"   # or '
            'LBFGS(..., line_search_fn="strong_wolfe"): without a line search each inner '
            "iteration takes a full lr-sized step, even one that raises the loss"
        )
    if lr is not None:
        lines.append(
            f'for g in optimizer.param_groups: g["lr"] = {_lower(lr)}   # was {hyper(lr)} ({opt})'
        )
    return lines


@dataclass(frozen=True)
class _LogInit:
    """An exp of a module's own attribute (a parameter used as a log: exp(p) is the
    quantity) that already overflows at step 0, before any update: it was initialised to the
    quantity itself, not to its log."""

    arg: str  #: exp's argument as written: ``self.logit_scale``
    attr: str  #: the attribute's name: ``logit_scale``
    value: float  #: its initial value (every element holds it)
    numel: int
    code: str | None = None  #: the user's exp line
    op: str = "exp"

    @property
    def evidence(self) -> str:
        return (
            f"exp's argument {self.arg} is {fmt(self.value)} at step 0, before any optimizer "
            f"update: its initial value already overflows exp (e^{fmt(self.value)} ≈ "
            f"1e{int(self.value * math.log10(math.e))}); {self.arg} is used as a log (exp of it "
            f"is the quantity) but was initialised to the quantity itself"
        )

    def explanation(self, dtype: str, lim: DtypeLimits) -> str:
        return (
            f"exp overflows {dtype} above {fmt(lim.exp_bound)} = log({fmt(lim.max)}). "
            f"{self.arg} is used through exp({self.arg}), so it holds a log: "
            f"initialised to {fmt(self.value)}, it makes exp({self.arg}) = "
            f"e^{fmt(self.value)} on the very first forward. No update came before: nothing "
            f"drifted. Initialise it to log({fmt(self.value)}) = {fmt(math.log(self.value))}; "
            "a clamp of the argument at the overflow bound would only pin the parameter "
            "there, with zero gradient and huge values."
        )

    def fix(self, lim: DtypeLimits) -> str:
        v = repr(float(self.value))
        made = (
            f"torch.tensor(math.log({v}))"
            if self.numel == 1
            else f"torch.full_like(<initial tensor>, math.log({v}))"
        )
        cap = math.floor(lim.exp_bound / 2 * 10) / 10
        small = math.log(self.value) < cap
        hi = f"math.log({v})" if small else str(cap)
        most = fmt(self.value) if small else fmt(math.exp(cap))
        plain = self.code.split("  #", 1)[0].strip() if self.code else ""
        fixed = _rewrite_calls(self.code, self.op, lambda e: f"{paren(e)}.clamp(max={hi})")
        bound = (
            f"{fixed}   # was: {plain}"
            if fixed is not None
            else f"# and bound the log where it is used: exp({self.arg}.clamp(max={hi}))"
        )
        return (
            f"self.{self.attr} = nn.Parameter({made})   # in __init__: it is a log; was "
            f"initialised to {fmt(self.value)}, the quantity itself\n"
            f"{bound}\n"
            f"# the log is bounded at {hi}: exp({self.arg}) stays at most {most}, far under "
            f"{fmt(lim.max)}"
        )


def _log_init(
    ctx: RuleContext, ev: OpEvent, x: TensorStat | None, lim: DtypeLimits
) -> _LogInit | None:
    """The exp's argument is a module attribute (``self.p``, or a watched parameter the
    line names), taken as is, whose every value is the same number past exp's bound at
    step 0 before any update: an initial value, given as the quantity, not its log."""
    if packet(ev.op) not in _EXP_CALLS or ev.phase is not Phase.FORWARD or x is None:
        return None
    if not _first_step(ctx) or not (x.min == x.max and x.max > lim.exp_bound):
        return None
    found = _exp_argument(ev.code)
    if found is None or found[0] != found[1]:
        return None
    if ev.code and _softplus_by_hand(ev.code) is not None:
        return None  # log(1 + exp(p)): p is the quantity (softplus), not its log
    arg = found[0]
    params = watched_params((ctx.trace, *ctx.history))
    attr = arg.rsplit(".", 1)[-1]
    if not (arg.startswith("self.") or (params and param_named(params, arg) is not None)):
        return None
    return _LogInit(
        arg=arg,
        attr=attr,
        value=float(x.max),
        numel=x.numel,
        code=ev.code,
        op=packet(ev.op).rstrip("_"),
    )


#: calls that write one constant into a tensor: (the constant's position, its keyword)
_FILL_CALLS: dict[str, tuple[int, str]] = {
    "masked_fill": (1, "value"),
    "masked_fill_": (1, "value"),
    "fill_": (0, "value"),
    "full": (1, "fill_value"),
    "full_like": (1, "fill_value"),
    "new_full": (1, "fill_value"),
}
#: a fill value this large is a sentinel (a mask or padding value), not a computed one
_FILL_MIN = 1e4


@dataclass(frozen=True)
class _FillArg:
    """exp's argument reached a mask fill value: one of its operands holds one huge
    constant (``masked_fill(mask == 0, -1e9)``, ``torch.finfo(dtype).min``) at the positions
    it masks, and exp of that is e^1e9 -- the filled positions, not values that grew."""

    value: float  #: the fill value (``-1e9``)
    top: float  #: exp's largest argument, as measured
    positions: int | None  #: how many exp results overflowed: the filled positions
    numel: int
    operand: str | None = None  #: the name on the exp line that holds it (``old``)
    made: str | None = None  #: the statement that filled it
    made_at: str | None = None  #: where (``file.py:12``)
    constant: str | None = None  #: the constant as written there (``-1e9``)
    mask: str | None = None  #: the filled positions as written (``mask == 0``)
    no_grad: bool = False  #: filled under no_grad / detached: no autograd history
    arg: str | None = None  #: exp's argument as written (``lp - old``)
    code: str | None = None  #: the user's exp line
    op: str = "exp"

    @property
    def where(self) -> str:
        n = f"{self.positions} of {self.numel} positions" if self.positions else "its positions"
        return n

    @property
    def evidence(self) -> str:
        if self.operand is None:
            return (
                f"exp's argument is exactly {fmt(self.top)} at {self.where} (its results are "
                f"inf there): a round value of |x| >= {fmt(_FILL_MIN)} that no model computes "
                "-- a mask or padding fill value (masked_fill, torch.full), not values that grew"
            )
        hist = " under torch.no_grad() (no autograd history)" if self.no_grad else ""
        return (
            f"exp's argument reached {fmt(self.top)} at {self.where} because {self.operand} "
            f"holds the fill value {self.constant} there: {self.made_at}: {self.made}{hist} "
            "-- a mask fill, not values that grew"
        )

    def explanation(self, dtype: str, lim: DtypeLimits) -> str:
        who = self.operand or "an operand"
        return (
            f"exp overflows {dtype} above {fmt(lim.exp_bound)} = log({fmt(lim.max)}). {who} "
            f"holds the fill value {self.constant or fmt(self.value)} at the positions it "
            f"masks, so exp({self.arg or 'x'}) there is e^{fmt(self.top)} = inf, and a later "
            "multiplication by the mask does not remove it (inf × 0 = NaN). The fill value is "
            "meant to be ignored, but the exp runs before the mask: mask the argument before "
            "the exp (the masked positions get exp(0) = 1), or fill with 0. A clamp of the "
            "argument would hide the cause, not remove it."
        )

    def fix(self) -> str:
        plain = self.code.split("  #", 1)[0].strip() if self.code else ""
        fixed = (
            _rewrite_calls(self.code, self.op, lambda e: f"{paren(e)}.masked_fill({self.mask}, 0)")
            if self.mask is not None
            else None
        )
        lines = (
            [f"{fixed}   # was: {plain}"]
            if fixed is not None
            else [
                f"# mask the positions {self.operand or 'the operand'} fills with "
                f"{self.constant or fmt(self.value)} before the exp: "
                f"{self.op}(({self.arg or 'x'}).masked_fill(<masked positions>, 0))"
            ]
        )
        if self.made is not None and self.constant is not None:
            zero = self.made.replace(self.constant, "0.0", 1)
            if zero != self.made:
                lines.append(f"# or fill it with 0 instead of {self.constant}: {zero}")
        return "\n".join(lines)


def _fill_constant(node: ast.expr, lim: DtypeLimits) -> float | None:
    """The finite number ``node`` writes: a literal, negated or not, or a dtype's
    ``finfo(...).min`` / ``.max``; None for anything else."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _fill_constant(node.operand, lim)
        return None if v is None else (-v if isinstance(node.op, ast.USub) else v)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        v = float(node.value)
        return v if math.isfinite(v) and not isinstance(node.value, bool) else None
    if isinstance(node, ast.Attribute) and node.attr in ("min", "max"):
        inner = node.value
        if isinstance(inner, ast.Call) and ast.unparse(inner.func).endswith("finfo"):
            return -lim.max if node.attr == "min" else lim.max
    return None


def _fill_call(value: ast.expr, lim: DtypeLimits) -> tuple[float, ast.expr, ast.expr | None] | None:
    """The first call in ``value`` that fills a huge constant: (the constant, its node, the
    mask it fills, if any)."""
    for n in ast.walk(value):
        if not isinstance(n, ast.Call):
            continue
        attr = n.func.attr if isinstance(n.func, ast.Attribute) else None
        if attr in _FILL_CALLS:
            pos, kw = _FILL_CALLS[attr]
            node = n.args[pos] if len(n.args) > pos else None
            node = next((k.value for k in n.keywords if k.arg == kw), node)
            mask = n.args[0] if attr.startswith("masked_fill") and n.args else None
            candidates = [(node, mask)] if node is not None else []
        elif attr == "where" and len(n.args) == 3:  # where(cond, x, c): c where ~cond
            cond = n.args[0]
            candidates = [(n.args[1], cond), (n.args[2], ast.UnaryOp(ast.Invert(), cond))]
        else:
            continue
        for const, mask in candidates:
            v = _fill_constant(const, lim)
            if v is not None and abs(v) >= _FILL_MIN:
                return v, const, mask
    return None


def _fill_arg(
    ctx: RuleContext, ev: OpEvent, x: TensorStat | None, lim: DtypeLimits
) -> _FillArg | None:
    """exp's argument reached a fill value: a name on the exp line was last assigned (in
    the same function, or at module level) by a call that writes one constant of
    |c| >= 1e4 (masked_fill, where, full), and the argument's largest value is that
    constant's magnitude (within 1%). Without the source, an argument that is exactly a
    round huge number (1e9, the dtype's max) is read as a fill value too."""
    import linecache

    name = packet(ev.op).rstrip("_")
    if name not in ("exp", "exp2", "expm1") or ev.phase is not Phase.FORWARD or x is None:
        return None
    top = signed_max(x)
    if not (math.isfinite(top) and top > lim.exp_bound and top >= _FILL_MIN):
        return None
    out = ev.output
    positions = out.posinf if out is not None and out.posinf else None
    numel = out.numel if out is not None else x.numel
    arg = _exp_args(ev.code, name)
    path, _, num = (ev.source or "").rpartition(":")
    found = None
    if len(arg) == 1 and path and num.isdigit():
        found = _filled_operand(linecache.getlines(path), int(num), arg[0], top, lim)
    if found is not None:
        operand, stmt, at, value, const, mask, no_grad = found
        return _FillArg(
            value=value,
            operand=operand,
            made=stmt,
            made_at=f"{path}:{at}",
            constant=const,
            mask=mask,
            no_grad=no_grad,
            arg=arg[0],
            top=top,
            positions=positions,
            numel=numel,
            code=ev.code,
            op=name,
        )
    # no source: an argument of exactly a round huge value (1e9, 1e4·k, the dtype's max)
    mant = top / 10 ** math.floor(math.log10(top))
    dt = getattr(torch, ev.dtype or "float32", torch.float32)
    exact = float(torch.tensor(round(mant) * 10 ** math.floor(math.log10(top)), dtype=dt))
    if top not in (exact, lim.max):
        return None
    return _FillArg(
        value=top,
        arg=arg[0] if len(arg) == 1 else None,
        top=top,
        positions=positions,
        numel=numel,
        code=ev.code,
        op=name,
    )


def _filled_operand(
    lines: list[str], line: int, arg: str, top: float, lim: DtypeLimits
) -> tuple[str, str, int, float, str, str | None, bool] | None:
    """The name in ``arg`` whose last assignment above ``line`` fills a constant whose
    magnitude ``top`` is: (name, the statement, its line, the constant, as written, the
    mask, filled without autograd history)."""
    try:
        names = {n.id for n in ast.walk(ast.parse(arg, mode="eval")) if isinstance(n, ast.Name)}
        tree = ast.parse("".join(lines))
    except SyntaxError:
        return None
    parent: dict[ast.AST, ast.AST] = {}
    for p in ast.walk(tree):
        for c in ast.iter_child_nodes(p):
            parent[c] = p

    def scope(n: ast.AST) -> ast.AST | None:
        while n in parent:
            n = parent[n]
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                return n
        return None

    here = next(
        (
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.stmt) and n.lineno == line and not isinstance(n, ast.FunctionDef)
        ),
        None,
    )
    # the exp line's function, the functions around it (a closure), then the module
    chain: list[ast.AST | None] = [scope(here) if here is not None else None]
    while chain[-1] is not None:
        chain.append(scope(chain[-1]))
    best: dict[str, tuple[tuple[int, int], ast.stmt, ast.expr]] = {}
    for n in ast.walk(tree):
        if not isinstance(n, (ast.Assign, ast.Expr)) or n.lineno >= line:
            continue
        own = scope(n)
        if not any(own is c for c in chain):
            continue
        key = (-next(i for i, c in enumerate(chain) if own is c), n.lineno)  # innermost
        got: list[tuple[str, ast.expr]] = []
        if isinstance(n, ast.Assign):
            got = [(t.id, n.value) for t in n.targets if isinstance(t, ast.Name)]
        elif (
            isinstance(n.value, ast.Call)
            and isinstance(n.value.func, ast.Attribute)
            and isinstance(n.value.func.value, ast.Name)
            and n.value.func.attr in ("masked_fill_", "fill_")
        ):  # old.masked_fill_(mask == 0, -1e9): filled in place
            got = [(n.value.func.value.id, n.value)]
        for nm, value in got:
            if nm in names and (nm not in best or key > best[nm][0]):
                best[nm] = (key, n, value)
    hit = next(
        (
            (nm, stmt, value, fill)
            for nm, (_, stmt, value) in sorted(best.items())
            if (fill := _fill_call(value, lim)) is not None
            and abs(top - abs(fill[0])) <= 0.01 * abs(fill[0])
        ),
        None,
    )
    if hit is None:
        return None
    operand, stmt, value, fill = hit
    no_grad = ".detach()" in ast.unparse(value) or any(
        isinstance(p, ast.With)
        and any(re.search(r"no_grad|inference_mode", ast.unparse(i.context_expr)) for i in p.items)
        for p in _ancestors(stmt, parent)
    )
    text = ast.get_source_segment("".join(lines), stmt) or ast.unparse(stmt)
    const = ast.get_source_segment("".join(lines), fill[1]) or ast.unparse(fill[1])
    mask = None if fill[2] is None else ast.unparse(fill[2])
    return operand, " ".join(text.split()), stmt.lineno, fill[0], const, mask, no_grad


def _ancestors(n: ast.AST, parent: dict[ast.AST, ast.AST]) -> Iterator[ast.AST]:
    while n in parent:
        n = parent[n]
        yield n


def _overflowing(name: str, x: TensorStat | None, big: float) -> float:
    """The input value that overflowed: for exp and its kin the largest (signed) argument,
    since exp of a large negative number underflows to 0 and never overflows (sinh and cosh
    overflow on both sides: their largest |x|); for other ops the largest |x|."""
    if name in EXP_LIKE and name.rstrip("_") not in _BOTH_SIDES:
        top = signed_max(x)
        return top if not math.isnan(top) else big
    return big


#: a batch whose max |x| is this many times the largest of the earlier batches' is out of
#: the range the model was trained on (a forgotten /255 is 255 times)
_JUMP = 10.0


@dataclass(frozen=True)
class _Batch:
    """A root input (the batch) that put the values out of range."""

    rec: Record  #: its input record
    now: float  #: its max |x|
    before: float | None  #: the largest max |x| of the same input earlier (None: unknown)
    since: int | None  #: the first step of that comparison (None: this step's calls only)
    until: int | None  #: its last step
    lim: DtypeLimits
    onset: int | None = None  #: the step from which the batches were this large, if earlier
    #: the loop computed it: the input grew step after step, or the step took the gradient
    #: with respect to it (torch.autograd.grad) and it grew within the step -- samples
    #: updated from the model's own gradient (a Langevin sampler, an attack), not data
    fed: bool = False
    first: float | None = None  #: max |x| of the first measured batch of that input
    by_grad: bool = False  #: this step took the model's gradient with respect to it

    @property
    def huge(self) -> bool:
        """Its own square overflows: a missing-value marker or a corrupt value, not data
        (in float16, whose square root of the max is 256, a value that large is data)."""
        return not self.lim.short_range and self.now >= math.sqrt(self.lim.max)

    @property
    def name(self) -> str:
        return f"{self.rec.role} of {self.rec.path}"

    def line(self, step: int) -> str:
        lim = self.lim
        if self.fed:
            how = (
                "this step took the model's gradient with respect to it (torch.autograd.grad) "
                "and the input grew within the step"
                if self.by_grad
                else "it grew step after step"
            )
            return (
                f"the loop made the input: {self.name} holds max |x| = {fmt(self.now)} at step "
                f"{step}, up from {fmt(self.first)} in the first batch; {how}: samples "
                "updated and fed back, not data"
            )
        if self.huge:
            frac = self.now / lim.max
            share = f", {frac:.0%} of the {lim.name} limit" if frac >= 0.01 else ""
            earlier = (
                f" (at most {fmt(self.before)} in the batches before)"
                if self.before is not None
                else ""
            )
            return (
                f"the batch did it: {self.name} holds max |x| = {fmt(self.now)}{share}"
                f"{earlier}; past sqrt({fmt(lim.max)}) = {fmt(math.sqrt(lim.max))}, its "
                "square and its products overflow: a missing-value marker or a corrupt sample, "
                "not a measurement"
            )
        if self.since is None or self.until is None or self.since == step:
            when = "this step's earlier calls"
        elif self.since == self.until:
            when = f"step {self.since}"
        else:
            when = f"steps {self.since}-{self.until}"
        ratio = self.now / self.before if self.before else math.inf
        onset = (
            f" (the batches have been this large since step {self.onset})"
            if self.onset is not None and self.onset < step
            else ""
        )
        return (
            f"the batch did it: {self.name} holds max |x| = {fmt(self.now)} at step {step}, "
            f"against at most {fmt(self.before)} over {when} ({fmt(ratio)} times larger)"
            f"{onset}; the values grew with the input, not with training"
        )


def _root_inputs(trace: StepTrace, upto: float) -> list[Record]:
    """The finite, measured inputs of the step's root calls (the batches), before ``upto``."""
    roots = {c.id for c in trace.calls if c.root and not c.is_loss}
    return [
        r
        for r in trace.records
        if r.phase is Phase.INPUT
        and r.call in roots
        and r.source is None
        and r.index < upto
        and r.stat is not None
        and r.stat.finite
        and not math.isnan(r.stat.magnitude)
    ]


def _activation_max(trace: StepTrace, upto: float) -> float:
    """The largest finite max |x| of the step's module outputs (losses left out)."""
    losses = {c.id for c in trace.calls if c.is_loss}
    mags = [
        r.stat.magnitude
        for r in trace.records
        if r.phase is Phase.FORWARD
        and r.index < upto
        and r.call not in losses
        and r.stat is not None
        and r.stat.finite
        and not math.isnan(r.stat.magnitude)
    ]
    return max(mags, default=math.nan)


def _batch_jump(ctx: RuleContext, a: Anomaly) -> _Batch | None:
    """The batch, when it (not training) put the values out of range: one of its values is
    so large that its square overflows, or its max |x| is ``_JUMP`` times the largest of
    the same input's earlier batches while the activations grew no faster than such an
    input makes them (a polynomial of it: up to its cube; weights that exploded grow them
    far faster)."""
    upto = a.record.index
    current = _root_inputs(ctx.trace, upto)
    if not current:
        return None
    past = [(t.step, r) for t in ctx.history for r in _root_inputs(t, math.inf)]
    acts = [(t.step, _activation_max(t, math.inf)) for t in ctx.history]
    act_now = _activation_max(ctx.trace, upto)
    found: list[tuple[float, _Batch]] = []
    for i, r in enumerate(current):
        lim = limits(r.dtype)
        if lim is None or r.stat is None:
            continue
        now = r.stat.magnitude
        key = (r.path, r.role)
        earlier = [(s, m.stat.magnitude) for s, m in past if (m.path, m.role) == key and m.stat]
        earlier += [
            (ctx.step, m.stat.magnitude) for m in current[:i] if (m.path, m.role) == key and m.stat
        ]
        # batches that were already this large: the jump came at their first step (onset)
        onset = None
        earlier.sort(key=lambda e: e[0])
        k = len(earlier)
        while k > 0 and earlier[k - 1][1] * _JUMP > now and earlier[k - 1][0] < ctx.step:
            k -= 1
        if 0 < k < len(earlier):
            onset = earlier[k][0]
            earlier = earlier[:k]
        before = max((v for _, v in earlier), default=None)
        since = min((s for s, _ in earlier), default=None)
        until = max((s for s, _ in earlier), default=None)
        series = _series(ctx, r, upto)
        first = next(
            (
                m.stat.magnitude
                for t in (*ctx.history, ctx.trace)
                for m in _root_inputs(t, upto if t is ctx.trace else math.inf)
                if (m.path, m.role) == key and m.stat is not None
            ),
            None,
        )
        by_grad = first is not None and _fed_back(ctx, r, upto)
        fed = by_grad or (first is not None and _grew_over_steps(series))
        batch = _Batch(r, now, before, since, until, lim, onset, fed, first, by_grad)
        if batch.huge:
            found.append((math.inf, batch))
            continue
        if before is None or not before > 0 or now < _JUMP * before:
            continue
        gain = now / before
        act_before = max(
            (m for st, m in acts if not math.isnan(m) and (onset is None or st < onset)),
            default=math.nan,
        )
        if (
            math.isfinite(act_before)
            and act_before > 0
            and math.isfinite(act_now)
            and act_now / act_before > _JUMP * gain**3
        ):
            continue  # the activations outgrew the input: the weights grew too
        found.append((gain, batch))
    if not found:
        return None
    return max(found, key=lambda f: f[0])[1]


def _series(ctx: RuleContext, r: Record, upto: float) -> list[tuple[int, float]]:
    """Each step's largest max |x| of the root input ``r`` names (its path and role), the
    steps in order, this step's calls before ``upto`` ending it."""
    key = (r.path, r.role)
    per: dict[int, float] = {}
    for t, end in [*((t, math.inf) for t in ctx.history), (ctx.trace, upto)]:
        for m in _root_inputs(t, end):
            if (m.path, m.role) == key and m.stat is not None:
                per[t.step] = max(per.get(t.step, 0.0), m.stat.magnitude)
    return sorted(per.items())


def _grew_over_steps(series: list[tuple[int, float]]) -> bool:
    """The input grew step after step, by orders of magnitude (``_GREW``), most steps
    larger than the one before (``_GROWING``): no dataset does that; a loop that feeds its
    own outputs back does. Not when one step's jump made nearly all of it (all but less
    than ``_JUMP``): that is one batch larger than the others (timesteps given in steps
    where fractions were expected), not a growth step after step."""
    vals = [v for _, v in series]
    if len(vals) < 3 or not vals[0] > 0 or vals[-1] < _GREW * vals[0]:
        return False
    jumps = [y / x for x, y in itertools.pairwise(vals) if x > 0]
    if jumps and max(jumps) * _JUMP > vals[-1] / vals[0]:
        return False
    rises = sum(1 for x, y in itertools.pairwise(vals) if y > x)
    return rises >= _GROWING * (len(vals) - 1)


def _fed_back(ctx: RuleContext, r: Record, upto: float) -> bool:
    """This step took the gradient of the root's output with respect to the input ``r``
    names (a backward record of that input: torch.autograd.grad(e.sum(), x)), and the input
    grew within the step: this step's first such input was ``_JUMP`` times smaller."""
    key = (r.path, r.role)
    if not any(
        m.phase is Phase.BACKWARD and (m.path, m.role) == key and m.index < upto
        for m in ctx.trace.records
    ):
        return False
    now = [
        m.stat.magnitude
        for m in _root_inputs(ctx.trace, upto)
        if (m.path, m.role) == key and m.stat is not None
    ]
    return bool(now) and r.stat is not None and now[0] * _JUMP <= r.stat.magnitude


def _explain_batch(b: _Batch, dtype: str) -> str:
    if b.fed:
        return (
            f"{dtype} holds values up to {fmt(b.lim.max)}. The input reached max |x| = "
            f"{fmt(b.now)}, and the loop computed it, not the dataset: samples updated from "
            "the model's own gradient and fed back grew update after update. A sampler's "
            "step size too large or its sign flipped (x + step * dE/dx climbs the energy; "
            "x - step * dE/dx descends it), no clamp to the data's range after each update, "
            "or a replay buffer that keeps diverged samples and feeds them back."
        )
    usual = (
        f" ({fmt(b.now / b.before)} times the earlier batches')" if b.before and not b.huge else ""
    )
    return (
        f"{dtype} holds values up to {fmt(b.lim.max)}. This step's batch reached max |x| = "
        f"{fmt(b.now)}{usual}, and the layers carried it past that limit: the weights and "
        "the learning rate are not the cause, and clipping gradients cannot help a forward "
        "that overflows. A batch that skipped its normalization (a forgotten / 255 or "
        "standardization), a missing-value marker stored as a huge number (FLT_MAX, 1e38), "
        "or a corrupt sample."
    )


def _fix_batch(b: _Batch) -> str:
    if b.fed:
        top = _nice_bound(b.first) if b.first else 1.0
        rows = "x.abs().flatten(1).amax(dim=1)" if len(b.rec.shape) >= 2 else "x.abs()"
        return (
            f"x.data.clamp_(-{top!r}, {top!r})   # x: the samples, right after the loop "
            f"updates them ({b.name}): keep them in the data's range (the first batch held "
            f"max |x| = {fmt(b.first)})\n"
            f"keep = {rows} <= {_JUMP * top!r}   # before they go back into a buffer: keep "
            "only the samples that did not diverge (re-draw the others as fresh ones)\n"
            "# and check the update's sign and step size: x - step_size * grad descends the "
            "energy, x + step_size * grad climbs it"
        )
    cap = _JUMP * b.before if b.before else math.sqrt(b.lim.max)
    rows = "x.abs().flatten(1).amax(dim=1)" if len(b.rec.shape) >= 2 else "x.abs()"
    return (
        f"bad = {rows} > {fmt(cap)}   # x: the batch given to the model ({b.name})\n"
        "print(bad.nonzero().flatten().tolist())   # the samples out of range: trace them to "
        "the dataset\n"
        "# fix them where the data is made: normalize (x / 255, (x - mean) / std), replace "
        "missing-value markers"
    )


def _nice_bound(v: float) -> float:
    """The smallest of 1, 2, 5 times a power of ten at or above ``v``: a round data range."""
    if not (v > 0 and math.isfinite(v)):
        return 1.0
    p = 10.0 ** math.floor(math.log10(v))
    for m in (1.0, 2.0, 5.0, 10.0):
        if m * p >= v * (1 - 1e-9):
            return float(f"{m * p:.6g}")
    return float(f"{10 * p:.6g}")


# ---------------------------------------------------------------- a loop in one forward

#: calls of one module in one forward from which a trend of its outputs is read
_MANY_CALLS = 8
#: the share of successive calls whose output must be larger than the call before
_GROWING = 0.75
#: and the growth over the calls, first to last: orders of magnitude, not noise
_GREW = 1e3


@dataclass(frozen=True)
class _Loop:
    """One module called many times in one forward, its output growing call after call:
    a recurrence or an integrator (x = x + dt · f(x)) that is unstable."""

    path: str
    calls: int  #: calls of the module in this forward, the overflowing one included
    first: float  #: max |x| of the first measured output
    last: float  #: max |x| of the last finite output before the overflow
    factor: float  #: the growth per call (geometric mean)
    #: the backward of one forward call, run again and again in the step (autograd.grad in
    #: the user's own fixed-point loop): the gradient grew pass after pass, not the output
    backward: bool = False
    weighted: bool = False  #: the module has a weight of its own (Linear, Conv)

    def line(self) -> str:
        if self.backward:
            return (
                f"the backward of {self.path} ran {self.calls} times in this step for one "
                "forward call (autograd.grad or backward called again and again: a "
                "fixed-point or implicit solve) and the gradient it was given grew pass after "
                f"pass, from max |x| {fmt(self.first)} to {fmt(self.last)} (×"
                f"{fmt(self.factor)} per pass): an iteration that diverges"
            )
        return (
            f"{self.path} was called {self.calls} times in this forward and its output grew "
            f"call after call, from max |x| {fmt(self.first)} to {fmt(self.last)} (×"
            f"{fmt(self.factor)} per call): a recurrence or an integrator that diverges, "
            "not a deep stack of layers"
        )


def _recurrence(trace: StepTrace, path: str | None, upto: int) -> _Loop | None:
    """The module at ``path`` called at least ``_MANY_CALLS`` times in this forward up to
    the call ``upto`` (the overflowing one), its outputs (in call order) growing in most
    successive calls and by orders of magnitude overall; None otherwise."""
    if not path:
        return None
    calls = [c for c in trace.calls if c.path == path and c.id <= upto]
    if len(calls) < _MANY_CALLS:
        return None
    ids = {c.id for c in calls}
    first_out: dict[int, float] = {}
    for r in trace.records:
        if r.phase is Phase.FORWARD and r.call in ids and r.call not in first_out and r.stat:
            first_out[r.call] = r.stat.amax if r.stat.finite else math.nan
    mags = [first_out[c.id] for c in calls if c.id in first_out]
    mags = [m for m in mags if math.isfinite(m) and m > 0]  # the overflowing call left out
    if len(mags) < _MANY_CALLS:
        return None
    pairs = list(itertools.pairwise(mags))
    up = sum(1 for x, y in pairs if y > x)
    if up < _GROWING * len(pairs) or mags[-1] < _GREW * mags[0]:
        return None
    factor = (mags[-1] / mags[0]) ** (1 / (len(mags) - 1))
    return _Loop(path, len(calls), mags[0], mags[-1], factor)


def _backward_recurrence(trace: StepTrace, path: str | None) -> _Loop | None:
    """The backward of one call of the module at ``path`` run at least ``_MANY_CALLS``
    times in this step, the gradient of its output (in pass order) growing in most passes
    and by orders of magnitude overall: a fixed-point iteration on the gradient (an
    implicit layer's backward solved by repeated autograd.grad) that diverges."""
    if not path:
        return None
    passes: dict[int, list[float]] = {}
    for r in trace.records:
        if r.path == path and r.phase is Phase.BACKWARD and r.role == "output" and r.stat:
            passes.setdefault(r.call, []).append(r.stat.magnitude if r.stat.finite else math.nan)
    if not passes:
        return None
    call, mags = max(passes.items(), key=lambda kv: len(kv[1]))
    calls = len(mags)
    mags = [m for m in mags if math.isfinite(m) and m > 0]
    if len(mags) < _MANY_CALLS:
        return None
    pairs = list(itertools.pairwise(mags))
    up = sum(1 for x, y in pairs if y > x)
    if up < _GROWING * len(pairs) or mags[-1] < _GREW * mags[0]:
        return None
    factor = (mags[-1] / mags[0]) ** (1 / (len(mags) - 1))
    c = trace.call(call)
    weighted = c is not None and c.module_type in _SPECTRAL
    return _Loop(path, calls, mags[0], mags[-1], factor, backward=True, weighted=weighted)


#: modules ``torch.nn.utils.parametrizations.spectral_norm`` bounds by their ``weight``
_SPECTRAL = frozenset({"Linear", "Bilinear", "Conv1d", "Conv2d", "Conv3d"})


def _explain_loop(loop: _Loop, dtype: str) -> str:
    if loop.backward:
        return (
            f"The backward of the same module ran {loop.calls} times in one step, each pass "
            "fed the gradient the previous one made (g = J^T g + grad: the backward of an "
            "implicit or equilibrium layer solved by fixed-point iteration), and the gradient "
            f"grew by about ×{fmt(loop.factor)} per pass until it passed {dtype}'s largest "
            "value. Such an iteration converges only when the map is a contraction (its "
            "Jacobian's spectral norm below 1); this one is not. A normalization elsewhere, "
            "gradient clipping (it runs after backward) or a lower learning rate do not change "
            "it."
        )
    return (
        f"The same module ran {loop.calls} times in one forward pass, each call fed what "
        f"the previous one made, and the values grew by about ×{fmt(loop.factor)} per "
        f"call until they passed {dtype}'s largest value. That is a loop that amplifies: an "
        "explicit Euler step x + dt·f(x) with dt too large for the field (stable only "
        "while |1 + dt·λ| < 1 for its eigenvalues λ), or a recurrent cell whose weight has "
        "a gain above 1. The step 0 weights are not to blame, and normalization layers, "
        "initialization or gradient clipping do not change the loop's growth."
    )


def _fix_loop(loop: _Loop, ref: str | None = None) -> str:
    """``ref``: how the user's code names the looped module (``model.deq.f.W``)."""
    if loop.backward:
        spectral = (
            f"{ref} = torch.nn.utils.parametrizations.spectral_norm({ref})   # in __init__ "
            "or before training: its gain is then at most 1"
            if ref and loop.weighted
            else "# keep the map's gain below 1: torch.nn.utils.parametrizations.spectral_norm "
            "on its weight, or a smaller init of it"
        )
        return (
            f"# the iteration that runs the backward of {loop.path} ({loop.calls} passes) "
            f"grows ×{fmt(loop.factor)} per pass: it diverges; make the map a contraction\n"
            f"{spectral}\n"
            "# or a smaller init of that weight (std well below 1 / sqrt(fan_in)), and cap the "
            "iterations and check the residual: stop when (g_next - g).norm() stops shrinking "
            "instead of running a fixed count, and fall back to one plain backward step when "
            "it grows"
        )
    return (
        f"# the loop that calls {loop.path} ({loop.calls} times) grows ×{fmt(loop.factor)} "
        "per call: make each step contract\n"
        "# an integrator x = x + dt * f(x): a smaller dt (explicit Euler needs dt·|λ| < 2),\n"
        "#   or an implicit or adaptive solver: torchdiffeq.odeint(f, x0, t, "
        "method='dopri5') picks its own step\n"
        "# a recurrence h = cell(h): bound the state each call, h = torch.tanh(h) or "
        "h.clamp(-c, c),\n"
        "#   or keep the recurrent weight's gain below 1 "
        "(torch.nn.utils.parametrizations.spectral_norm)"
    )


# ---------------------------------------------------------------- substituted weights

#: a module's output grew this many times across calls of one step on inputs of the same
#: scale, its own weights unchanged: it multiplied by weights that were not its own
_SUBSTITUTED = 1e6
#: root inputs within this factor of each other are of the same scale
_SAME_SCALE = 10.0


@dataclass(frozen=True)
class _Subst:
    """A module whose outputs grew across the forwards of one step with no optimizer step
    between them and inputs of the same scale: the weights it used were passed in at call
    time (torch.func.functional_call, fast weights), not its own parameters."""

    path: str
    calls: int  #: its calls in this step up to the overflow, one per forward
    first: float  #: max |x| of its output in the first forward
    last: float  #: in the last forward before the overflow
    inputs: float  #: the largest root input of those forwards

    def line(self, step: int) -> str:
        return (
            f"{self.path} ran in {self.calls} forwards of step {step} with no optimizer step "
            f"between them, on inputs of the same scale (up to {fmt(self.inputs)}), and its "
            f"output grew from max |x| {fmt(self.first)} to {fmt(self.last)}: its own weights "
            "did not change, so the weights it multiplied by were substituted at call time "
            "(torch.func.functional_call, fast weights built by your own update p - lr * g)"
        )


def _root_of(trace: StepTrace, call: int) -> int | None:
    by_id = {c.id: c for c in trace.calls}
    c = by_id.get(call)
    while c is not None and c.parent is not None:
        c = by_id.get(c.parent)
    return c.id if c is not None else None


def _substituted(ctx: RuleContext, a: Anomaly) -> _Subst | None:
    """The watched Linear / conv (an affine map of its input by its own weights) whose
    output grew by ``_SUBSTITUTED`` or more across the forwards of this step up to the
    overflow, while no optimizer stepped in this step and the forwards' inputs stayed of one
    scale: the weights were not the module's own. None otherwise."""
    trace = ctx.trace
    if any(n.kind == "optimizer" for n in trace.notes):
        return None
    upto = a.record.call
    roots = [c for c in trace.calls if c.root and not c.is_loss and c.id <= upto]
    mags = [
        m.stat.magnitude
        for c in roots
        for m in (trace.resolve(r) for r in trace.inputs_of(c.id))
        if m.stat is not None and m.stat.finite and m.stat.magnitude > 0
    ]
    if len(roots) < 3 or not mags or max(mags) > _SAME_SCALE * min(mags):
        return None
    per: dict[str, dict[int, float]] = {}  # path -> root call -> first output's max |x|
    affine = {
        c.id: c
        for c in trace.calls
        if c.arithmetic and not c.root and c.module_type not in _RECURRENT and c.id < upto
    }
    for r in trace.records:
        c = affine.get(r.call)
        if c is None or r.phase is not Phase.FORWARD or r.stat is None or not r.stat.finite:
            continue
        root = _root_of(trace, c.id)
        if root is not None:
            per.setdefault(c.path, {}).setdefault(root, r.stat.amax)
    best: _Subst | None = None
    for path, outs in per.items():
        seq = [v for v in outs.values() if v > 0]
        if len(seq) < 3 or seq[-1] < _SUBSTITUTED * seq[0]:
            continue
        if best is None or seq[-1] / seq[0] > best.last / best.first:
            best = _Subst(path, len(seq), seq[0], seq[-1], max(mags))
    return best


def _explain_substituted(s: _Subst, dtype: str, lim: DtypeLimits) -> str:
    return (
        f"{dtype} holds values up to {fmt(lim.max)}. {s.path} gave outputs up to "
        f"{fmt(s.first)} and then {fmt(s.last)} on inputs of the same scale, with no "
        "optimizer step in between: the weights it multiplied by grew inside this step, so "
        "they were not its own parameters but weights passed in at call time. An inner loop "
        "that builds them by its own update (MAML's fast weights p - inner_lr * g, one per "
        "inner step) diverges when its lr is too high or it takes too many steps. The "
        "initial weights and the outer optimizer's learning rate did not make these values."
    )


_FUNCTIONAL_CALL = re.compile(r"\bfunctional_call\(\s*[\w.]+\s*,\s*([A-Za-z_]\w*)\s*[,)]")


def _fix_substituted(code: str | None) -> str:
    found = _FUNCTIONAL_CALL.search(code or "")
    weights = f"the weights in {found.group(1)}" if found else "the substituted weights"
    return (
        f"# {weights} grew in your inner loop: make the lr of the update that builds them "
        "(p - inner_lr * g) 10 times lower, or take fewer inner steps\n"
        "# or bound each inner step: clip the inner gradient, g = [gi * (1.0 / "
        "max(1.0, gi.norm().item())) for gi in g], before the update\n"
        "# not the initialization, not the outer optimizer's lr: the module's own weights "
        "did not make these values"
    )


# ---------------------------------------------------------------- values that jumped


def _module_mags(trace: StepTrace, upto: float) -> dict[str, tuple[float, float]]:
    """Per module path: the largest finite max |x| of its inputs and of its outputs, over
    the step's records up to index ``upto`` (losses left out)."""
    losses = {c.id for c in trace.calls if c.is_loss}
    ins: dict[str, float] = {}
    outs: dict[str, float] = {}
    for r in trace.records:
        if r.index > upto or r.call in losses or r.phase not in (Phase.INPUT, Phase.FORWARD):
            continue
        m = trace.resolve(r) if r.phase is Phase.INPUT else r
        mag = m.stat.magnitude if m.stat is not None else math.nan
        if not math.isfinite(mag):
            continue
        side = ins if r.phase is Phase.INPUT else outs
        side[r.path] = max(side.get(r.path, 0.0), mag)
    return {p: (ins.get(p, math.nan), o) for p, o in outs.items()}


@dataclass(frozen=True)
class _Jump:
    """A module whose outputs grew ``_JUMP`` times or more between two steps while its
    inputs did not: its weights changed (an optimizer update, or a write outside it)."""

    path: str
    before: float  #: max |x| of its outputs at ``since``
    now: float  #: at this step
    since: int  #: the earlier step
    step: int
    updates: int  #: optimizer steps recorded in between
    outside: str | None  #: a weight of it written outside the optimizer (its name)
    grew_in: float = 1.0  #: how much its inputs grew meanwhile
    steady: bool = False  #: this jump dwarfs the step-to-step changes recorded before it
    seen_optimizer: bool = True  #: an optimizer step of the watched weights was recorded
    #: grown update after update since the oldest recorded step, no step a jump by itself
    drift: bool = False

    @property
    def elsewhere(self) -> bool:
        """Its weights were written by code other than the optimizer the watcher saw."""
        return self.outside is not None or (not self.updates and self.seen_optimizer)

    @property
    def gain(self) -> float:
        return self.now / self.before if self.before > 0 else math.inf

    def line(self, lr: str) -> str:
        span = "in one step" if self.step - self.since == 1 else f"from step {self.since}"
        verb = "grew update after update" if self.drift else "jumped"
        head = (
            f"the values {verb} {span}: {self.path}'s outputs reached max |x| = "
            f"{fmt(self.now)} at step {self.step}, against {fmt(self.before)} at step "
            f"{self.since} (×{fmt(self.now / self.before)}), while its inputs "
            + (f"grew ×{fmt(self.grew_in)}" if self.grew_in >= 2 else "did not grow")
        )
        if self.outside is not None:
            return f"{head}: {self.outside} was written outside the optimizer"
        if self.drift:
            return f"{head}: the {self.updates} optimizer updates in between{lr} moved its weights"
        if self.updates:
            ups = "updates" if self.updates > 1 else "update"
            return (
                f"{head}: its weights changed, by the optimizer {ups} in between{lr}, or by "
                "code that wrote them outside it (a fill_ under no_grad, a loaded checkpoint)"
            )
        if self.seen_optimizer:
            return f"{head}, and no optimizer step ran in between: other code wrote its weights"
        return (
            f"{head}: its weights changed, and no torch.optim step was recorded (a manual "
            "update, or code that wrote them)"
        )


def _most_grown(
    before: dict[str, tuple[float, float]], now: dict[str, tuple[float, float]]
) -> tuple[float, str, float] | None:
    """The module whose outputs outgrew its inputs the most from ``before`` to ``now``
    (``_JUMP`` times or more): (that gain, its path, how much its inputs grew)."""
    best: tuple[float, str, float] | None = None
    for path, (i1, o1) in now.items():
        if path not in before:
            continue
        i0, o0 = before[path]
        if not (o0 > 0 and o1 > 0):
            continue
        grew_in = i1 / i0 if i0 > 0 and math.isfinite(i1) else 1.0
        gain = (o1 / o0) / max(grew_in, 1.0)
        if gain >= _JUMP and (best is None or gain > best[0]):
            best = (gain, path, grew_in)
    return best


def _jump(ctx: RuleContext, a: Anomaly, *, since: StepTrace | None = None) -> _Jump | None:
    """The module whose weights changed the most between ``since`` (default: the step
    before this one) and this step, read from its outputs' growth beyond its inputs' (the
    batch left out), when that growth is ``_JUMP`` times or more."""
    if not ctx.history:
        return None
    ref = since if since is not None else ctx.history[-1]
    before = _module_mags(ref, math.inf)
    now = _module_mags(ctx.trace, a.record.index)
    rec = a.record
    if rec.phase is Phase.FORWARD and rec.stat is not None and rec.path in before:
        mag = rec.stat.magnitude
        if math.isfinite(mag):  # the overflowing output itself: its finite part
            i, o = now.get(rec.path, (math.nan, 0.0))
            now[rec.path] = (i, max(o, mag))
    best = _most_grown(before, now)
    if best is None:
        return None
    _, path, grew_in = best
    earlier = [
        o
        for t in ctx.history
        if t.step < ref.step and (o := _module_mags(t, math.inf).get(path, (0.0, math.nan))[1]) > 0
    ]
    # one jump after steps that held steady (less than ×2 a step), not a drift that sped up
    seq = [*earlier, before[path][1]]
    drift = max((b / a for a, b in itertools.pairwise(seq) if a > 0), default=1.0)
    steady = bool(earlier) and drift < 2 and now[path][1] / before[path][1] >= _JUMP
    after = [t for t in ctx.history if t.step >= ref.step]
    updates = sum(1 for t in after for n in t.notes if n.kind == "optimizer")
    if _closure_optimizer(ctx):
        updates = max(updates, 1)  # it updates the weights between its closure's calls
    outside = next(
        (
            str(n.data.get("parameter"))
            for t in (*after, ctx.trace)
            for n in t.notes
            if n.kind == "weight_writer"
            and n.path == path
            and (n.data.get("optimizer") is None or n.data.get("after_optimizer"))
        ),
        None,
    )
    seen = any(n.kind == "optimizer" for t in (*ctx.history, ctx.trace) for n in t.notes)
    return _Jump(
        path,
        before[path][1],
        now[path][1],
        ref.step,
        ctx.step,
        updates,
        outside,
        grew_in,
        steady,
        seen,
    )


#: optimizer updates a drift needs before it is said to be training's (not one update's)
_DRIFT_UPDATES = 3


def _drift(ctx: RuleContext, a: Anomaly) -> _Jump | None:
    """A module whose outputs grew ``_JUMP`` times or more since the oldest recorded step,
    update after update, while its inputs did not and no step's growth alone was a jump:
    the optimizer drove the weights there (a learning rate too high for the start of
    training, no warmup). Short-range dtypes only: float16 overflows on such growth long
    before float32 would."""
    if len(ctx.history) < 2:
        return None
    j = _jump(ctx, a, since=ctx.history[0])
    if j is None or j.elsewhere or j.updates < _DRIFT_UPDATES or j.grew_in >= 2:
        return None
    return dataclasses.replace(j, drift=True)


def _grown_path(ctx: RuleContext, a: Anomaly) -> str | None:
    """With several param groups of different lrs: the module whose weights grew first
    (``_JUMP`` times beyond its inputs since the first recorded step): whose group's lr to
    lower."""
    steps = _lr_steps(ctx)
    if not steps or len(set(steps[-1].lrs)) < 2 or not ctx.history:
        return None
    # the first whose weights grew: the others may follow it (its outputs feed their
    # gradients), and grow further by the time the values overflow
    first = _module_mags(ctx.history[0], math.inf)
    for t in ctx.history[1:]:
        best = _most_grown(first, _module_mags(t, math.inf))
        if best is not None:
            return best[1]
    j = _jump(ctx, a, since=ctx.history[0])
    return j.path if j is not None else None


def _group_of(ctx: RuleContext, path: str) -> int | None:
    """The param group holding the weights of the module at ``path``: from the optimizer
    notes' ``names`` (qualified parameter names per group), or a ``weight_writer`` note."""
    prefix = f"{path}."
    for t in (*reversed(ctx.history), ctx.trace):
        for n in t.notes:
            group = n.data.get("group")
            if n.kind == "weight_writer" and n.path == path and isinstance(group, int):
                return group
            if n.kind != "optimizer":
                continue
            for g in n.data.get("groups", ()):
                names = g.get("names") if isinstance(g, dict) else None
                if (
                    isinstance(names, list)
                    and isinstance(g.get("group"), int)
                    and any(isinstance(q, str) and q.startswith(prefix) for q in names)
                ):
                    return int(g["group"])
    return None


def _explain_jump(j: _Jump, dtype: str, lim: DtypeLimits, cause: str = "") -> str:
    """``cause``: what the records say grew the update (an optimizer setting, NW306)."""
    if j.elsewhere:
        return (
            f"{j.path}'s outputs grew ×{fmt(j.gain)} between two steps while its inputs did "
            "not: its weights changed, and not by the optimizer. A weight set by hand (a "
            "fill_ or copy_ under no_grad, a loaded checkpoint from a diverged run) put the "
            f"values past {fmt(lim.max)}, {dtype}'s largest value; the dtype and the "
            "learning rate are not the cause."
        )
    head = (
        f"{j.path}'s outputs grew ×{fmt(j.gain)} in {j.step - j.since} step"
        f"{'s' if j.step - j.since > 1 else ''} while its inputs did not: the optimizer "
        "moved its weights that far. "
    )
    if cause:
        return head + cause
    if j.drift:
        return head + (
            "A learning rate too large for the start of training (no warmup, or a peak "
            "tuned for another model) grows the weights update after update; "
            f"{dtype} overflows first ({fmt(lim.max)} is its largest value), but a wider "
            "dtype or a GradScaler only delays it: lower the learning rate, or warm it up."
        )
    return head + (
        "A learning rate too large for this model (a typo: 1e3 for 1e-3) makes one update "
        f"jump the weights by orders of magnitude; {dtype} then overflows ({fmt(lim.max)} is "
        "its largest value), but a wider dtype or a GradScaler only delays it: lower the "
        "learning rate."
    )


def _fix_jump(ctx: RuleContext, j: _Jump) -> str:
    if j.elsewhere:
        what = j.outside or f"{j.path}'s weights"
        root = any(c.root and c.path == j.path for c in ctx.trace.calls)
        owner = "model" if root else f"model.get_submodule({j.path!r})"
        return (
            f"# {what} changed between step {j.since} and step {j.step} outside the optimizer:\n"
            "# find the code that writes it (a fill_ / copy_ under torch.no_grad(), a "
            "load_state_dict of a diverged checkpoint) and check the values it writes:\n"
            f"print(max(p.abs().max().item() for p in {owner}.parameters()))"
        )
    fix = _update_fix(ctx, j.path, clip_first=False)
    steps = _lr_steps(ctx)
    if j.drift and fix and steps and _lr_rise(steps) is None and _growing_setting(ctx) is None:
        fix.append(
            "# or warm the learning rate up over the first steps (torch.optim.lr_scheduler."
            "LinearLR, start_factor=0.01, total_iters=1000, stepped after each update)"
        )
    return "\n".join(fix)


#: optimizers whose step() takes a closure that computes the loss and its gradients: a
#: clip before step() runs once, before the closure recomputes them
_CLOSURE_OPTIMIZERS = frozenset({"LBFGS"})


def _closure_optimizer(ctx: RuleContext) -> bool:
    names = {n.path for t in (*ctx.history, ctx.trace) for n in t.notes if n.kind == "optimizer"}
    return bool(names & _CLOSURE_OPTIMIZERS)


def _hand_updated(ctx: RuleContext) -> bool:
    """Steps came before this one and no torch.optim step of the watched weights was
    recorded in any of them: the user's own code updates the weights (``p -= lr * p.grad``),
    and there is no ``optimizer`` to name in a fix."""
    if _first_step(ctx) or not ctx.history:
        return False
    return not any(n.kind == "optimizer" for t in (*ctx.history, ctx.trace) for n in t.notes)


def _unwatched_source(ctx: RuleContext) -> bool:
    """No optimizer stepped the watched weights (:func:`_hand_updated`) and this step ran no
    watched module but losses: what the loss was given came from code or weights nanwatch
    does not watch (a copy.deepcopy of a watched model carries no hooks)."""
    return _hand_updated(ctx) and not any(not c.is_loss for c in ctx.trace.calls)


#: what to say when the values came from no watched module and no update of watched weights
_UNWATCHED = (
    "# no optimizer stepped the watched weights, and the loss's input came from no watched "
    "module: it came from code or weights nanwatch does not watch; a copy.deepcopy of a "
    "watched model has no hooks: watch the clone too, nanwatch.watch(clone)"
)


def _growing_setting(ctx: RuleContext) -> Diagnosis | None:
    """NW306's diagnosis of a running-average setting (momentum, betas, alpha, rho at or
    past 1) in the latest step of each optimizer recorded: its update grows step after
    step whatever the learning rate, so a lower lr or clipping only delays the overflow."""
    latest: dict[str, Note] = {}
    for t in (*ctx.history, ctx.trace):
        for n in t.notes:
            if n.kind == "optimizer":
                latest[n.path] = n
    for n in latest.values():
        probe = RuleContext(
            StepTrace(step=ctx.step, notes=[n]), (), ctx.thresholds, rule=REGISTRY["NW306"]
        )
        found = next(_growing_averages(probe), None)
        if found is not None:
            return found
    return None


def _setting_evidence(ctx: RuleContext) -> list[str]:
    """NW306's evidence for an optimizer setting that makes the update grow: the group's
    value and what it does; NW307's first line for gradients never reset; a loss multiplied
    by a constant before backward() and never divided back; [] when none."""
    setting = _growing_setting(ctx)
    if setting is not None:
        return list(setting.evidence[:2])
    unreset = unreset_grads(ctx)
    if unreset is not None:
        return list(unreset.evidence[:1])
    scaled = _scaled_backward(ctx)
    return [scaled.line()] if scaled is not None else []


@dataclass(frozen=True)
class _ScaledBackward:
    """``(loss * SCALE).backward()`` in the user's code with ``SCALE`` a constant above 1
    that no line of the same function divides by: every gradient carries the factor."""

    code: str  #: the backward call, as written
    product: str  #: what it runs on (``loss * SCALE``)
    const: str  #: the factor as written (``SCALE``, ``1024.0``)
    factor: float
    where: str  #: file:line

    def line(self) -> str:
        f = fmt(self.factor)
        return (
            f"backward() runs on {self.product} at {self.where}: the loss times {f}, and no line "
            f"divides the gradients by {self.const} before the update: every step applies "
            f"gradients {f}× too large"
        )


def _number(node: ast.expr, consts: dict[str, ast.expr], depth: int = 0) -> float | None:
    """The value of a numeric literal, of a name assigned one once in the file, or of a
    product / power of those (``2.0 ** 12``); None otherwise."""
    if depth > 4:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return None if isinstance(node.value, bool) else float(node.value)
    if isinstance(node, ast.Name) and node.id in consts:
        return _number(consts[node.id], consts, depth + 1)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Pow)):
        a, b = _number(node.left, consts, depth + 1), _number(node.right, consts, depth + 1)
        if a is None or b is None or (isinstance(node.op, ast.Pow) and abs(b) > 64):
            return None
        return a * b if isinstance(node.op, ast.Mult) else a**b
    return None


def _scaled_backward(ctx: RuleContext) -> _ScaledBackward | None:
    """The backward root is the loss times a constant above 1 (its autograd node is a
    ``MulBackward0``, no GradScaler scaled it) and the user's function that runs the step
    calls ``(loss * C).backward()`` with no division by ``C`` anywhere in it: gradients
    scaled by hand and never unscaled."""
    traces = (*ctx.history[-2:], ctx.trace)
    if any(t.scale is not None for t in traces):
        return None
    if not any(
        r.path == LOSS_PATH and r.phase is Phase.FORWARD and r.grad_fn == "MulBackward0"
        for t in traces
        for r in t.records
    ):
        return None
    for source in dict.fromkeys(n.source for t in reversed(traces) for n in t.notes if n.source):
        found = _user_scope(source)
        if found is None:
            continue
        path, tree, scope = found
        assigned: dict[str, list[ast.expr]] = {}
        for node in ast.walk(tree):
            if (
                isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                and node.value is not None
            ):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for tg in targets:
                    if isinstance(tg, ast.Name):
                        kept = node.value if not isinstance(node, ast.AugAssign) else tg
                        assigned.setdefault(tg.id, []).append(kept)
        consts = {k: v[0] for k, v in assigned.items() if len(v) == 1}
        for node in ast.walk(scope):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "backward"
                and isinstance(node.func.value, ast.BinOp)
                and isinstance(node.func.value.op, ast.Mult)
            ):
                continue
            prod = node.func.value
            for const in (prod.right, prod.left):
                factor = _number(const, consts)
                if factor is None or not factor > 1 or not math.isfinite(factor):
                    continue
                written = ast.unparse(const)
                if _divides_by(scope, written):
                    return None
                return _ScaledBackward(
                    ast.unparse(node),
                    ast.unparse(prod),
                    written,
                    factor,
                    f"{path.rsplit('/', 1)[-1]}:{node.lineno}",
                )
    return None


def _divides_by(scope: ast.AST, written: str) -> bool:
    """Some line of ``scope`` divides by ``written`` (``g / SCALE``, ``p.grad /= SCALE``,
    ``p.grad.div_(SCALE)``) or multiplies by its inverse: the user unscales."""
    for node in ast.walk(scope):
        if isinstance(node, (ast.BinOp, ast.AugAssign)) and isinstance(node.op, ast.Div):
            right = node.right if isinstance(node, ast.BinOp) else node.value
            if ast.unparse(right) == written:
                return True
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("div_", "div", "true_divide_", "true_divide")
            and node.args
            and ast.unparse(node.args[0]) == written
        ):
            return True
    return False


def _scaled_fix(scaled: _ScaledBackward) -> list[str]:
    """Unscale the gradients before the update (or drop the factor)."""
    return [
        f"{scaled.code}",
        "for p in model.parameters():   # unscale before optimizer.step()",
        "    if p.grad is not None:",
        f"        p.grad.div_({scaled.const})",
        f"# (or drop the factor: {scaled.const} only guards float16 gradients from "
        "underflow; torch.amp.GradScaler unscales and skips inf steps for you)",
    ]


#: what let the values grow, when the gradients are never reset (NW307)
_UNRESET_CAUSE = (
    "What let them grow: gradients that are never reset (no zero_grad()). backward() adds "
    "to .grad, so every update applies the sum of all the gradients so far and the steps "
    "grow as training goes on; a lower learning rate or clipping only delays the overflow."
)


def _setting_cause(ctx: RuleContext) -> str:
    """NW306's explanation of an optimizer setting that makes the update grow, or what
    gradients never reset do (NW307), or a loss scaled by hand and never unscaled; ""."""
    setting = _growing_setting(ctx)
    if setting is not None:
        return setting.explanation
    if unreset_grads(ctx) is not None:
        return _UNRESET_CAUSE
    scaled = _scaled_backward(ctx)
    if scaled is not None:
        f = fmt(scaled.factor)
        return (
            f"What let them grow: backward() ran on the loss times {scaled.const} ({f}), so "
            f"every gradient is {f}× the loss's gradient, and nothing divides it back before "
            f"the update: each step is {f}× what the learning rate means. Loss scaling must "
            "be undone (the gradients divided by the same factor) before optimizer.step(); "
            "a lower learning rate only hides it."
        )
    return ""


def _normalizing(ctx: RuleContext) -> str | None:
    """The class of the latest optimizer recorded when it normalizes the gradient (Adam and
    its kin: each weight moves by about lr per step whatever the gradient, so clipping the
    gradients does not bound its step); None otherwise."""
    last = next(
        (
            n.path
            for t in reversed((*ctx.history, ctx.trace))
            for n in reversed(t.notes)
            if n.kind == "optimizer"
        ),
        None,
    )
    return last if last is not None and _normalized(last) else None


def _update_fix(ctx: RuleContext, path: str | None, *, clip_first: bool) -> list[str]:
    """What to change in the training update that grew the values, most effective first: an
    optimizer setting that makes the update grow whatever the lr (NW306); for Adam and its
    kin the learning rate alone (clipping cannot bound their step); otherwise clipping and
    a lower lr (of a hand-written update, said in words: there is no ``optimizer``)."""
    setting = _growing_setting(ctx)
    if setting is not None:
        return [
            *setting.fix.splitlines()[:1],
            "# a lower lr or gradient clipping only delays the overflow: this setting makes "
            "the update grow every step (NW306)",
        ]
    unreset = unreset_grads(ctx)
    if unreset is not None:
        return [
            unreset.fix.splitlines()[0],
            "# a lower lr or gradient clipping only delays the overflow: the gradients are "
            "never reset (NW307)",
        ]
    scaled = _scaled_backward(ctx)
    if scaled is not None:
        return _scaled_fix(scaled)
    if _unwatched_source(ctx):
        return [_UNWATCHED]
    lr = _lr_fix(ctx, path)
    opt = _normalizing(ctx)
    if opt is not None:
        return [
            *lr,
            f"# no gradient clipping: {opt} moves each weight by about lr per step whatever the "
            "gradient's size, so clipping cannot bound its step",
        ]
    clip = _clip_line(ctx)
    return [clip, *lr] if clip_first else [*lr, clip]


def _clip_line(ctx: RuleContext) -> str:
    """Gradient clipping where it acts: before step(), or inside a closure optimizer's
    closure, after its backward(), or before a hand-written update. Where clipping cannot
    bound the update, what does: the optimizer setting that makes it grow (NW306), or
    nothing ("") for Adam and its kin."""
    setting = _growing_setting(ctx)
    if setting is not None:
        return setting.fix.splitlines()[0]
    unreset = unreset_grads(ctx)
    if unreset is not None:
        return unreset.fix.splitlines()[0]
    if _unwatched_source(ctx):
        return ""  # the update that grew the values is not nanwatch's to see
    if _hand_updated(ctx):
        return (
            "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # right before "
            "your own update of the weights"
        )
    if _normalizing(ctx) is not None:
        return ""
    if _closure_optimizer(ctx):
        return (
            "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # inside the "
            "closure, right after loss.backward(): step() re-evaluates the closure"
        )
    return "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # before step()"


# ---------------------------------------------------------------- learning rate


@dataclass(frozen=True)
class _LrStep:
    step: int
    optimizer: str  #: the class (``SGD``)
    lrs: tuple[float, ...]  #: per param group
    groups: tuple[int, ...] = ()  #: their indices in ``optimizer.param_groups``
    #: which optimizer object (two of one class: a GAN's generator and discriminator)
    ident: int | None = None


def _lr_steps(ctx: RuleContext) -> list[_LrStep]:
    """The learning rates of the optimizer steps before this one (their ``"optimizer"``
    notes): this step's own update, if any, came after the values went bad."""
    out = []
    for t in ctx.history:
        for n in t.notes:
            if n.kind != "optimizer":
                continue
            pairs = [
                (float(g["lr"]), int(g.get("group", i)))
                for i, g in enumerate(n.data.get("groups", ()))
                if isinstance(g, dict)
                and isinstance(g.get("lr"), (int, float))
                and not isinstance(g.get("lr"), bool)
                and math.isfinite(g["lr"])
            ]
            if pairs:
                ident = n.data.get("ident")
                out.append(
                    _LrStep(
                        t.step,
                        n.path,
                        tuple(p[0] for p in pairs),
                        tuple(p[1] for p in pairs),
                        ident if isinstance(ident, int) else None,
                    )
                )
    return out


#: no optimizer trains with a learning rate this large: a typo (1e36 for 1e-3, 1000 for 1e-3)
_ABSURD_LR = 1e3
#: the learning rate rose across the recorded steps by more than this factor: a schedule
_ROSE = 1.5


def _lr_rise(steps: Sequence[_LrStep]) -> tuple[_LrStep, _LrStep] | None:
    """The first and the last step of the latest optimizer, when its lr rose (a warmup, a
    OneCycleLR) across the recorded steps."""
    if not steps:
        return None
    last = steps[-1]
    mine = [s for s in steps if s.optimizer == last.optimizer and s.ident == last.ident]
    first = min(mine, key=lambda s: max(s.lrs))
    if max(last.lrs) > _ROSE * max(first.lrs) and first.step < last.step:
        return first, last
    return None


def _lower(lr: float) -> str:
    """A learning rate to try instead of ``lr``."""
    return "1e-3" if lr >= _ABSURD_LR else hyper(lr / 10)


def _lr_fix(ctx: RuleContext, path: str | None = None) -> list[str]:
    """Lower the learning rate of the user's own optimizer, by the numbers nanwatch saw;
    with several param groups, only the one holding the weights of ``path`` (the module
    whose weights grew), when the records say which it is."""
    steps = _lr_steps(ctx)
    if not steps and _unwatched_source(ctx):
        return [_UNWATCHED]
    if not steps and _hand_updated(ctx):
        return [
            "# no torch.optim optimizer stepped: make the lr of your own update (p -= lr * "
            "p.grad) 10 times lower, or find the code that wrote the weights"
        ]
    if not steps:
        return ['for g in optimizer.param_groups: g["lr"] /= 10   # a learning rate 10 times lower']
    last = steps[-1]
    lr = max(last.lrs)
    rise = _lr_rise(steps)
    if rise is not None:
        first, _ = rise
        return [
            f"# {last.optimizer}'s lr rose from {hyper(max(first.lrs))} at step {first.step} to "
            f"{hyper(lr)} at step {last.step}: a scheduler raised it (a warmup, OneCycleLR),",
            f"# and the values exploded on the way up: lower the schedule's peak (OneCycleLR's "
            f"max_lr, the warmup's target) to {hyper(lr / 10)} or less",
        ]
    if len(set(last.lrs)) > 1:
        was = ", ".join(hyper(x) for x in last.lrs)
        group = _group_of(ctx, path) if path else None
        if group is not None and group in last.groups:
            mine = last.lrs[last.groups.index(group)]
            others = ", ".join(
                f"{g}: {hyper(x)}" for g, x in zip(last.groups, last.lrs, strict=True) if g != group
            )
            return [
                f'optimizer.param_groups[{group}]["lr"] = {_lower(mine)}   # was {hyper(mine)} '
                f"({last.optimizer}): the group holding {path}'s weights; leave the others "
                f"({others})"
            ]
        whose = f"{path}'s weights" if path else "the weights that grew"
        return [
            f"# {last.optimizer}'s param groups have lr {was}: lower the lr of the group "
            f"holding {whose}, not all of them; which group holds which weights:",
            'for i, g in enumerate(optimizer.param_groups): print(i, g["lr"], '
            '[n for n, p in model.named_parameters() if any(p is q for q in g["params"])])',
        ]
    if lr >= _ABSURD_LR:
        return [
            f'for g in optimizer.param_groups: g["lr"] = 1e-3   # was {hyper(lr)} '
            f"({last.optimizer}): far above any usable learning rate"
        ]
    if _normalized(last.optimizer) and lr > 1e-2:  # Adam's steps are about lr per weight
        return [
            f'for g in optimizer.param_groups: g["lr"] = 1e-3   # was {hyper(lr)} '
            f"({last.optimizer}: 1e-5 to 1e-2 is usual)"
        ]
    return [
        f'for g in optimizer.param_groups: g["lr"] = {hyper(lr / 10)}   # was {hyper(lr)} '
        f"({last.optimizer})"
    ]


def _lr_note(ctx: RuleContext, path: str | None = None) -> str:
    """``(SGD lr 0.336, up from 0.12 at step 0)`` for the growth line; "" when unknown.
    With several param groups, the lr of the one holding ``path``'s weights when known."""
    steps = _lr_steps(ctx)
    if not steps and _unwatched_source(ctx):
        return (
            " (no optimizer stepped the watched weights: the values came from code or "
            "weights nanwatch does not watch)"
        )
    if not steps and _hand_updated(ctx):
        return " (no torch.optim optimizer step was recorded: the weights are updated by hand)"
    if not steps:
        return ""
    last = steps[-1]
    group = _group_of(ctx, path) if path and len(set(last.lrs)) > 1 else None
    if group is not None and group in last.groups:
        mine = hyper(last.lrs[last.groups.index(group)])
        return f" ({last.optimizer} lr {mine} in param group {group}, which holds {path}'s weights)"
    lr = ", ".join(hyper(x) for x in dict.fromkeys(last.lrs))
    rise = _lr_rise(steps)
    up = f", up from {hyper(max(rise[0].lrs))} at step {rise[0].step}" if rise else ""
    return f" ({last.optimizer} lr {lr}{up})"


_EXP_CALLS = frozenset({"exp", "exp_", "exp2", "expm1"})


def _exp_argument(code: str | None) -> tuple[str, str] | None:
    """The argument of the one exp of the user's line and the name it is made of, a sign
    or a constant factor stripped: ``torch.exp(-log_vars)`` -> (``-log_vars``,
    ``log_vars``); None for an expression (``exp(x @ w)``) or several exps."""
    found: list[ast.expr] = []
    for stmt in statements(code):
        try:
            tree = ast.parse(stmt)
        except SyntaxError:
            return None
        for n in ast.walk(tree):
            if not isinstance(n, ast.Call) or not isinstance(n.func, ast.Attribute):
                continue
            if n.func.attr not in _EXP_CALLS:
                continue
            owner = ast.unparse(n.func.value)
            if owner in ("torch", "torch.special", "math", "np", "numpy") and n.args:
                found.append(n.args[0])
            elif owner not in ("torch", "torch.special", "math", "np", "numpy") and not n.args:
                found.append(n.func.value)
    if len(found) != 1:
        return None
    node = arg = found[0]
    while True:
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            node = node.operand
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
            if isinstance(node.right, ast.Constant):
                node = node.left
            elif isinstance(node.left, ast.Constant) and isinstance(node.op, ast.Mult):
                node = node.right
            else:
                return None
        else:
            break
    text = ast.unparse(node)
    return (ast.unparse(arg), text) if re.fullmatch(r"[A-Za-z_][\w.]*", text) else None


@dataclass(frozen=True)
class _CumsumExponent:
    """An exp whose argument is a cumulative sum (``cs = torch.cumsum(logdecay, dim=1)``
    then ``torch.exp(-cs)``): its exponent grows with the length summed over."""

    arg: str  #: the exp's argument on the user's line (``-cs``)
    name: str  #: the cumulative sum's name (``cs``)
    source: str  #: where it is made, ``file.py:16``
    code: str  #: that line


def _cumsum_exponent(ev: OpEvent, reach: int = 40) -> _CumsumExponent | None:
    """The earlier line of the exp's function that makes its argument by a cumsum, or the
    exp's own line when its argument is one (``torch.exp(x.cumsum(1))``); None otherwise."""
    import linecache

    if packet(ev.op) not in _BARE_EXP or ev.phase is not Phase.FORWARD:
        return None
    got = _exp_argument(ev.code)
    if got is None:
        got_all: list[str] = []

        def keep(e: str) -> str:
            got_all.append(e)
            return e

        _rewrite_calls(ev.code, packet(ev.op).rstrip("_"), keep)
        if len(got_all) == 1 and re.search(r"\bcumsum\(", got_all[0]):
            return _CumsumExponent(got_all[0], got_all[0], ev.source or "", ev.code or "")
        return None
    arg, name = got
    path, _, num = (ev.source or "").rpartition(":")
    if not path or not num.isdigit():
        return None
    start = int(num)
    for n in range(start - 1, max(0, start - reach), -1):
        text = linecache.getline(path, n)
        if re.match(r"\s*(?:async\s+)?def\s", text):
            return None
        for stmt in statements(text):
            if _assigned(stmt) != name:
                continue
            if re.search(r"\bcumsum\(", stmt):
                return _CumsumExponent(arg, name, f"{path}:{n}", text.strip())
            return None  # the name is made by something else
    return None


def _exp_holder(ctx: RuleContext, a: Anomaly, ev: OpEvent) -> str | None:
    """For an exp that overflowed: the parameter its argument is (``exp(-log_vars)``, read
    from the user's line, or, the line unknown, the only watched parameter of the exp's
    size) and the lr of the param group holding it; or that it is a tensor outside the
    model whose updating lr nanwatch does not know. None when the argument may be the
    model's own output (then the model's lr is the one to quote)."""
    if packet(ev.op) not in _EXP_CALLS or ev.phase is not Phase.FORWARD:
        return None
    if _ratio_to_stored(ev):  # exp(a - b), b without gradient: _StaleRatio says what it is
        return None
    n = ev.output.numel
    params = watched_params((ctx.trace, *reversed(ctx.history)))
    outputs = {r.stat.numel for r in first_root_outputs(ctx.trace) if r.stat is not None}
    found = _exp_argument(ev.code)
    qual: str | None = None
    how = ""
    if found is not None:
        arg, expr = found
        qual = param_named(params, expr)
        if qual is not None:
            ref = qual if expr == qual else f"{expr} ({qual})"
            how = f"exp's argument {arg} is made of the parameter {ref}"
        elif n in outputs:
            return None  # a model output, perhaps: the model's lr applies
        elif ev.path and ev.path != LOSS_PATH:
            return _in_module_holder(ctx, ev, arg)
        else:
            return (
                f"exp's argument {arg} is made of {expr}, no watched parameter or output: "
                "it grew during training, and the lr of the param group updating it is not "
                "known (nanwatch reads only the groups holding the watched model's weights)"
            )
    elif not ev.code and not ev.inputs and (ev.path or a.path) == LOSS_PATH:
        hits = [q for q, k in params.items() if k == n]
        lim = limits(ev.dtype)
        # a size alone is no evidence: the parameter itself must hold values past exp's
        # bound (its recorded |p|), or the argument may be any tensor of that many values
        big = _param_magnitude((*ctx.history, ctx.trace), hits[0]) if len(hits) == 1 else None
        if (
            len(hits) == 1
            and n not in outputs
            and lim is not None
            and big is not None
            and big > lim.exp_bound
        ):
            qual = hits[0]
            how = (
                f"the parameter {qual}, the only watched parameter of exp's "
                f"{count(n, 'value')}, holds values up to |p| = {fmt(big)}, past exp's bound "
                f"{fmt(lim.exp_bound)}"
            )
        elif n in outputs and not hits:
            return None  # a model output, perhaps: the model's lr applies
        elif hits:
            return (
                f"exp ran in the loss code on {count(n, 'value')} and its argument was not "
                "kept: whether a weight or an output grew in training, or a constant (a "
                "table, a log of 0) made it, is not known"
            )
        else:
            return (
                f"exp ran in the loss code on {count(n, 'value')}, the size of no watched "
                "parameter or model output: a tensor outside the model (a learned "
                "log-variance, a temperature) grew, or a constant (a table, a log of 0) made "
                "its argument; the lr of a param group updating it is not known"
            )
    if qual is None:
        return None
    held = group_holding((*ctx.history, ctx.trace), qual)
    if held is None:
        return (
            f"{how}, which drifted during training; the lr of the param group updating it "
            "is not known"
        )
    opt, group, lr = held
    return (
        f"{how}, which drifted during training ({opt} lr {hyper(lr)} in param group {group}, "
        "which holds it)"
    )


@dataclass(frozen=True)
class _ArgJump:
    """An exp's argument, a parameter (or the input of a parametrization, which is its
    parameter), that one optimizer update moved from well inside exp's range past it."""

    param: str  #: the parameter's qualified name
    before: float  #: the argument's largest value at the step before
    now: float  #: at this step
    since: int
    step: int
    lr: str  #: `` (SGD lr 30)``, "" when unknown

    def line(self, bound: float) -> str:
        return (
            f"exp's argument, the parameter {self.param}, reached max {fmt(self.now)} at step "
            f"{self.step} against {fmt(self.before)} at step {self.since}: one optimizer "
            f"update{self.lr} moved it past exp's bound {fmt(bound)}, by more than that whole "
            "range"
        )


#: ``enc.parametrizations.weight.0``: a parametrization of ``enc.weight`` (its input is
#: the parameter ``enc.parametrizations.weight.original``)
_PARAMETRIZATION = re.compile(r"(?P<owner>(?:.+\.)?parametrizations\.\w+)\.\d+")


def _arg_jump(ctx: RuleContext, ev: OpEvent, lim: DtypeLimits) -> _ArgJump | None:
    """The exp ran on its module's input, that input is a watched parameter (a
    parametrization's ``original``), and between the step before and this one an optimizer
    update moved its largest value from below half exp's bound to past the bound: the step
    itself is too large. None when any of it is not in the records (no earlier step, no
    optimizer step recorded, an input that is not a parameter)."""
    if ev.phase is not Phase.FORWARD or not ev.path or not ctx.history:
        return None
    m = _PARAMETRIZATION.fullmatch(ev.path)
    params = watched_params((ctx.trace, *reversed(ctx.history)))
    qual = (
        next(
            (q for q in (f"{m['owner']}.original", f"{m['owner']}.original0") if q in params),
            None,
        )
        if m
        else None
    )
    x = first_input(ev)
    prev = ctx.history[-1]
    if qual is None or x is None or not any(n.kind == "optimizer" for n in prev.notes):
        return None

    def arg_max(t: StepTrace) -> float | None:
        for r in t.records:
            if r.path == ev.path and r.phase is Phase.INPUT and r.role == "input[0]":
                return r.stat.max if r.stat is not None and r.stat.finite else None
        return None

    before, now = arg_max(prev), arg_max(ctx.trace)
    if before is None or now is None or not math.isclose(now, x.max, rel_tol=1e-6):
        return None
    bound = lim.exp_bound
    if not (before < bound / 2 < bound < now and now - before > bound):
        return None
    held = group_holding((*ctx.history, ctx.trace), qual)
    lr = f" ({held[0]} lr {hyper(held[2])})" if held is not None else ""
    return _ArgJump(qual, before, now, prev.step, ctx.step, lr)


def _spike_lr(ctx: RuleContext) -> tuple[int, str] | None:
    """The step and the lr line of the NW308 warning of the loss spike this step is still
    in (:func:`_same_spike`: no loss since fell back): the update it named grew what
    overflows now. None when there is none, or its fix sets no lr."""
    if not _same_spike(ctx):
        return None
    for t in reversed(ctx.history):
        for d in t.diagnoses:
            first = str(getattr(d, "fix", "") or "").split("\n", 1)[0]
            if getattr(d, "code", "") == "NW308" and '["lr"] = ' in first:
                return t.step, first
    return None


def _exp_after_big_step(
    big: _Oversize, dtype: str, lim: DtypeLimits, x: TensorStat | None, fix: str
) -> tuple[str, str]:
    """Explanation and fix of an exp whose argument overflowed right after an update that
    moved the weights by their own size or more (``big``, gradients' ``_Oversize``): the
    learning rate first, the clamp of ``fix``'s first line only as a guard after it."""
    arg = signed_max(x)
    reached = f"reached {fmt(arg)}" if not math.isnan(arg) else "passed it"
    what = "largest |value|" if big.kind == "max" else "RMS value"
    how = "lr × its gradient" if big.plain else "about lr, whatever the gradient"
    explanation = (
        f"exp overflows {dtype} above {fmt(lim.exp_bound)}; its argument {reached}, one "
        f"step after an update that moved {big.param} by {_times(big.ratio)} its {what} "
        f"({big.optimizer} moves each weight by {how}): the learning rate is too large for "
        "these weights, and every further update moves them as far again. A clamp on exp's "
        "argument keeps this step finite, but past the clamp its gradient is 0 and the "
        "weights keep taking such steps: lower the learning rate first."
    )
    new = _round_down(big.lr * _SAFE_SHARE / big.ratio)
    lines = [
        f'optimizer.param_groups[{big.group}]["lr"] = {hyper(new)}   # was {hyper(big.lr)} '
        f"({big.optimizer}): its update was {_times(big.ratio)} the size of {big.param}",
        f"# only as a guard, after the lr: {fix.splitlines()[0].strip()}",
    ]
    if not big.plain:
        lines.append(
            f"# no gradient clipping: {big.optimizer} moves each weight by about lr per step "
            "whatever the gradient's size, so clipping cannot bound its step"
        )
    return explanation, "\n".join(lines)


@dataclass(frozen=True)
class _StaleRatio:
    """An exp of a difference ``a - b`` whose ``b`` has no autograd history (computed under
    no_grad, detached, or data) while ``a`` has one, read from the graph: a ratio
    e^a / e^b of current values to stored ones -- PPO's importance ratio
    ``exp(logp - old_logp)`` with ``old_logp`` kept from the rollout. ``new`` and ``old``:
    the two operands' text on the line, when it is known and shows them."""

    new: str | None
    old: str | None
    arg: float  #: the argument's largest value (nan: not kept)
    lr: str  #: ``" (Adam lr 0.1)"``, "" when not known

    @property
    def diff(self) -> str:
        return f"{self.new} - {self.old}" if self.new and self.old else "a - b"

    def line(self) -> str:
        if self.new and self.old:
            return (
                f"the exp's argument is a difference {self.diff} (read from the autograd "
                f"graph): {self.old} carries no gradient (computed under torch.no_grad() or "
                f"detached) and {self.new} does, so exp({self.diff}) is a ratio of current "
                "values to stored ones"
            )
        return (
            "the exp's argument is a difference a - b (read from the autograd graph) whose "
            "b carries no gradient (computed under torch.no_grad() or detached, data, or a "
            "constant) while a does"
        )

    def explanation(self, dtype: str, lim: DtypeLimits) -> str:
        reached = (
            f"reached {fmt(self.arg)} (a ratio of e^{fmt(self.arg)})"
            if math.isfinite(self.arg)
            else "passed it"
        )
        moved = (
            "the policy being trained has moved far from the one that collected the batch: "
            f"too large a learning rate{self.lr}, or too many epochs or minibatch updates "
            "over one batch. PPO's clip does not stop it: the exp overflows before any clamp "
            "of the ratio, and torch.min keeps the unclipped term for a negative advantage."
        )
        if self.new and self.old:
            return (
                f"exp overflows {dtype} above {fmt(lim.exp_bound)}; its argument, the "
                f"difference {self.diff}, {reached}. {self.old} carries no gradient: "
                f"exp({self.diff}) is a ratio against stored values -- in a policy-gradient "
                f"loss, the importance ratio pi_new / pi_old, {self.old} the log-probabilities "
                f"kept from the rollout. A ratio this far from 1 means {moved} Bound the "
                "log-ratio so the step stays finite, and keep the policy close to the rollout's."
            )
        return (
            f"exp overflows {dtype} above {fmt(lim.exp_bound)}; its argument, a difference "
            f"a - b whose b carries no gradient, {reached}. When b holds stored "
            "log-probabilities -- PPO's old_logp, kept from the rollout -- exp(a - b) is the "
            "importance ratio pi_new / pi_old, and a ratio past e^"
            f"{fmt(lim.exp_bound)} means {moved} Bound the log-ratio so the step stays finite, "
            "and keep the policy close to the rollout's. mode='forensic' names the line."
        )

    def fix(self, code: str | None, lim: DtypeLimits) -> str:
        cap = min(20.0, math.floor(lim.exp_bound / 2 * 10) / 10)
        known = bool(self.new and self.old)
        guard = rewrite_call(code, ["exp"], lambda e: f"{paren(e)}.clamp(max={fmt(cap)})")
        why = f"a guard: e^{fmt(cap)} = {fmt(math.exp(cap))} is far past any clip range"
        other = ""
        if guard is None or not known:
            guard = f"ratio = (logp - old_logp).clamp(max={fmt(cap)}).exp()"
            why += "; in your exp(a - b), logp is a (with gradient), old_logp is b (without)"
            half = math.floor(lim.exp_bound / 2 * 10) / 10
            other = (
                "\n# b not stored log-probabilities (data, a constant): "
                f"torch.exp((a - b).clamp(max={fmt(half)})) as a guard, and find what grew a"
            )
        new, old = (self.new, self.old) if known else ("logp", "old_logp")
        return (
            f"{guard.strip()}   # {why}{other}\n"
            "# the fix: keep the new policy near the rollout's -- fewer epochs or minibatches "
            f"per batch, a smaller lr{self.lr}, and stop the epochs early:\n"
            f"approx_kl = ({old} - {new}).mean().item()   # after each minibatch\n"
            "if approx_kl > 1.5 * target_kl: break   # target_kl about 0.01-0.05"
        )


def _stale_ratio(ctx: RuleContext, ev: OpEvent, x: TensorStat | None) -> _StaleRatio | None:
    """:class:`_StaleRatio` for an exp whose input was made by a subtraction of a tensor with
    an autograd history and one without (``ev.made_from_history``); None otherwise."""
    if not _ratio_to_stored(ev):
        return None
    new = old = None
    parts = _sub_operands(ev.code)
    if parts is not None:
        new, old = parts
        if _number_text(old):  # x - 1.0: a constant, no stored reference
            return None
    return _StaleRatio(new, old, signed_max(x), _lr_note(ctx))


def _number_text(text: str) -> bool:
    """``text`` is a number literal (``1.0``, ``-3``, ``1e-8``)."""
    try:
        float(text.replace(" ", ""))
    except ValueError:
        return False
    return True


def _ratio_to_stored(ev: OpEvent) -> bool:
    """The op's input was made by ``a - b`` where ``a`` has an autograd history and ``b``
    none (read from the graph: ``ev.made_from_history``)."""
    return ev.made_from[:1] == ["sub"] and ev.made_from_history == [True, False]


def _sub_operands(code: str | None) -> tuple[str, str] | None:
    """The operands' text of the one ``exp(a - b)`` (``torch.exp``, ``.exp()``) on the line;
    None when the line holds no such exp or several.

    >>> _sub_operands("ratio = (logp - old_logp).exp()")
    ('logp', 'old_logp')
    >>> _sub_operands("r = torch.exp(dist.log_prob(a) - batch.logp)")
    ('dist.log_prob(a)', 'batch.logp')
    """
    if not code:
        return None
    text = code.split("  #", 1)[0].strip()
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    found: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if node.func.attr != "exp":
            continue
        if node.args:
            owner = node.func.value
            arg = node.args[0] if isinstance(owner, ast.Name) and owner.id == "torch" else None
        else:
            arg = node.func.value
        if isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Sub):
            a = ast.get_source_segment(text, arg.left)
            b = ast.get_source_segment(text, arg.right)
            if a and b:
                found.append((a, b))
    return found[0] if len(found) == 1 else None


def _explain_arg_jump(j: _ArgJump, dtype: str, lim: DtypeLimits) -> str:
    return (
        f"exp overflows {dtype} above {fmt(lim.exp_bound)}. Its argument is the parameter "
        f"{j.param}, and a single optimizer update moved it from {fmt(j.before)} to "
        f"{fmt(j.now)}, farther than exp's whole usable range: the learning rate is too "
        "large for it. Clamping exp's argument only moves the failure: the parameter keeps "
        "taking such steps, and past the clamp its gradient is 0, so it never comes back."
    )


def _fix_arg_jump(ctx: RuleContext, j: _ArgJump, code: str | None, lim: DtypeLimits) -> str:
    owner = j.param.split(".parametrizations.", 1)[0]
    lines = _update_fix(ctx, owner, clip_first=False)
    cap = math.floor(lim.exp_bound / 2 * 10) / 10
    guard = rewrite_call(code, ["exp"], lambda e: f"{paren(e)}.clamp(max={cap})")
    if guard is not None:
        lines.append(f"# only as a guard, after the lr: {guard.strip()}")
    return "\n".join(x for x in lines if x)


def _in_module_holder(ctx: RuleContext, ev: OpEvent, arg: str) -> str:
    """For an exp in a watched module's forward: its argument is computed there, from the
    module's input or its watched children's outputs; the child whose output's largest
    value is exactly the argument's is named (a slice of it: ``s, t = self.net(x).chunk(2)``),
    and the lr of the param group holding its weights is quoted."""
    top = signed_max(first_input(ev))
    path = ev.path or ""
    child: str | None = None
    if math.isfinite(top):
        for r in ctx.trace.records:
            if (
                r.phase is Phase.FORWARD
                and r.path.startswith(f"{path}.")
                and r.stat is not None
                and math.isclose(signed_max(r.stat), top, rel_tol=1e-6)
            ):
                child = r.path
                break
    if child is not None:
        return (
            f"exp's argument {arg} is computed in {path}'s forward from the output of its "
            f"child {child}, whose largest value is the same {fmt(top)}: its weights or its "
            f"input grew during training{_lr_note(ctx, child)}"
        )
    return (
        f"exp's argument {arg} is computed in {path}'s forward from the module's input or "
        f"its children's outputs: they grew during training{_lr_note(ctx, path)}"
    )


def _param_magnitude(traces: Sequence[StepTrace], qualname: str) -> float | None:
    """The latest recorded largest |value| of the watched parameter ``qualname``."""
    found: float | None = None
    for t in traces:
        for r in t.records:
            if r.phase is Phase.PARAMETER and r.role == qualname and r.stat is not None:
                found = r.stat.magnitude
    return found


def _heavy_weights(
    ctx: RuleContext, path: str, lim: DtypeLimits, ref: str
) -> tuple[str, str] | None:
    """When the module at ``path`` has recorded weights whose largest |w| is past
    sqrt(max) of the dtype (a gradient through them is multiplied by that much): what to
    say, and the fix lines. None when its weights are not recorded or are ordinary."""
    own: dict[str, float] = {}
    others: list[float] = []
    for t in [*ctx.history, ctx.trace]:
        for r in t.records:
            if r.phase is not Phase.PARAMETER or r.stat is None or not r.stat.finite:
                continue
            owner = r.role.rsplit(".", 1)[0] if "." in r.role else ""
            if owner == path:
                own[r.role] = r.stat.magnitude
            else:
                others.append(r.stat.magnitude)
    if not own:
        return _heavy_gain(ctx, path, lim, ref)
    role, big = max(own.items(), key=lambda kv: kv[1])
    if big <= math.sqrt(lim.max):
        return None
    rest = max(others, default=math.nan)
    beside = (
        f" (the model's other parameters at most {fmt(rest)})"
        if math.isfinite(rest) and rest < big / 100
        else ""
    )
    said = (
        f"{role} reaches {fmt(big)} in magnitude{beside}: backward multiplies the gradient of "
        f"the module's output by these weights, and past {fmt(lim.max)} it is inf"
    )
    fix = (
        f"# {role} reaches {fmt(big)}: find what made it that large (a checkpoint, an "
        "in-place .mul_, an update too large) and re-initialize it\n"
        f"nn.init.xavier_uniform_({ref}.{role.rsplit('.', 1)[-1]}.data)   # or reload it\n"
        f"{_clip_line(ctx)}"
    )
    return said, fix


def _heavy_gain(ctx: RuleContext, path: str, lim: DtypeLimits, ref: str) -> tuple[str, str] | None:
    """Without weight records: a weighted module (Linear, Conv) whose forward made its
    output's largest |x| more than sqrt(max) times its input's: weights that large, and
    its backward multiplies the gradient by the same weights. None otherwise."""
    trace = ctx.trace
    arithmetic = {c.id for c in trace.calls if c.path == path and c.arithmetic}
    measured = (
        trace.resolve(r)
        for r in trace.records
        if r.call in arithmetic and r.phase is Phase.INPUT and r.role == "input[0]"
    )  # an input is measured where it was made (the previous module's output)
    ins = [r.stat.magnitude for r in measured if r.stat is not None and r.stat.finite]
    outs = [
        r.stat.magnitude
        for r in trace.records
        if r.call in arithmetic
        and r.phase is Phase.FORWARD
        and r.role == "output"
        and r.stat is not None
        and r.stat.finite
    ]
    if not ins or not outs or max(ins) <= 0:
        return None
    gain = max(outs) / max(ins)
    if gain <= math.sqrt(lim.max):
        return None
    grads = [
        r.stat.magnitude
        for r in trace.records
        if r.call in arithmetic
        and r.phase is Phase.BACKWARD
        and r.role == "output"
        and r.stat is not None
        and r.stat.finite
    ]
    small = (
        f" (the gradient of its output is at most {fmt(max(grads))}: not a large loss)"
        if grads and max(grads) < math.sqrt(lim.max)
        else ""
    )
    said = (
        f"its forward turned inputs of at most {fmt(max(ins))} into outputs up to "
        f"{fmt(max(outs))}, {fmt(gain)} times larger: weights that large, and backward "
        f"multiplies the gradient of its output by the same weights{small}"
    )
    fix = (
        f"print({ref}.weight.abs().max())   # {path}'s weights: find what made them so (a "
        "checkpoint, an in-place .mul_, an update too large) and re-initialize them\n"
        f"{_clip_line(ctx)}"
    )
    return said, fix


#: how many times the model's inputs a value must be for "it grew inside the forward"
_GREW_INSIDE = 1e6


def _grown_inside(ctx: RuleContext, big: float) -> float | None:
    """At the first step: the largest |x| of the model's floating-point inputs, when all
    are known, finite and at least :data:`_GREW_INSIDE` times smaller than ``big``: the
    values grew inside the forward (a solver loop, a recurrence), not in the data. None
    otherwise."""
    if not _first_step(ctx) or not math.isfinite(big):
        return None
    root = model_call(ctx.trace)
    if root is None:
        return None
    mags = []
    for r in ctx.trace.inputs_of(root.id):
        m = ctx.trace.resolve(r)
        if m.stat is not None and limits(m.dtype) is not None:
            mags.append(m.stat.magnitude)
    if not mags or not all(math.isfinite(v) for v in mags):
        return None
    top = max(mags)
    return top if top * _GREW_INSIDE <= big else None


#: the largest |x| of inputs on a unit scale (standardized features, pixels in [0, 1]):
#: data past it by this much was not normalized
_UNIT_SCALE = 20.0


@dataclass(frozen=True)
class _UnscaledInput:
    """At the first step, an exp whose argument passed its bound, and the model's input on
    far more than a unit scale (raw pixel values, unstandardized features)."""

    role: str  #: ``input[0]``
    low: float
    high: float

    @property
    def top(self) -> float:
        return max(abs(self.low), abs(self.high))

    def line(self) -> str:
        return (
            f"the model's {self.role} spans [{fmt(self.low)}, {fmt(self.high)}]: inputs "
            f"{fmt(self.top)} times the unit scale a freshly initialized layer keeps (|x| "
            "about 1); its outputs start that large too"
        )

    def fix(self) -> str:
        whole = self.low >= 0 and self.high == int(self.high) and self.high > 1
        if whole:
            return (
                f"x = x / {int(self.high)}   # the inputs span [{fmt(self.low)}, "
                f"{fmt(self.high)}]: scale them to [0, 1] where the data is loaded (or "
                "transforms.Normalize(mean, std))"
            )
        return (
            "x = (x - x_mean) / x_std   # standardize the inputs where the data is loaded "
            "(mean and std of the training inputs; transforms.Normalize for images)"
        )


def _unscaled_input(ctx: RuleContext) -> _UnscaledInput | None:
    """At the first step, the model's floating-point input of largest |x| when that is past
    :data:`_UNIT_SCALE` (all inputs known and finite); None otherwise."""
    if not _first_step(ctx):
        return None
    root = model_call(ctx.trace)
    if root is None:
        return None
    best: tuple[str, TensorStat] | None = None
    for r in ctx.trace.inputs_of(root.id):
        m = ctx.trace.resolve(r)
        if m.stat is None or limits(m.dtype) is None:
            continue
        if not math.isfinite(m.stat.magnitude):
            return None
        if best is None or m.stat.magnitude > best[1].magnitude:
            best = (r.role, m.stat)
    if best is None or best[1].magnitude <= _UNIT_SCALE:
        return None
    return _UnscaledInput(best[0], best[1].min, best[1].max)


def _explain_unscaled(u: _UnscaledInput, dtype: str, lim: DtypeLimits, made: Record | None) -> str:
    """Why an exp overflowed at the first step from inputs that were not normalized."""
    arg = f"{made.path}'s output" if made is not None else "exp's argument"
    return (
        f"The model's inputs were not normalized: they reach |x| = {fmt(u.top)}, where a "
        "network's layers are initialized for inputs of about unit scale. Before any update "
        f"the layers carried that scale through, {arg} passed {fmt(lim.exp_bound)} and exp "
        f"of it overflowed {dtype} ({fmt(lim.max)}). Scale the inputs where the data is "
        "loaded; a clamp of the exponent only hides it."
    )


def _exp_producer(ctx: RuleContext, ev: OpEvent, lim: DtypeLimits) -> Record | None:
    """An exp whose argument autograd did not keep (its backward saves the result): the
    recorded module output that is that argument -- of exp's size and dtype, made by the
    op the graph names below the exp, past exp's bound, and whose min is the log of the
    result's min (exp is monotonic). The innermost module's record when one tensor was
    recorded by several (a child's output the model returns); None unless one matches."""
    out = ev.output
    if ev.inputs or not ev.made_from or math.isnan(out.min) or out.min <= 0:
        return None
    # every result inf: every argument is past the bound
    arg_min = math.log(out.min) if out.min < math.inf else math.inf
    below = ev.made_from[0].removeprefix("watched:")
    found: list[Record] = []
    for r in ctx.trace.records:
        s = r.stat
        if (
            r.phase is not Phase.FORWARD
            or s is None
            or s.numel != out.numel
            or r.dtype != ev.dtype
            or (r.grad_fn or "").split("Backward")[0].lower() != below
            or not (lim.exp_bound < s.max < math.inf)
            or (
                s.min <= lim.exp_bound
                if arg_min == math.inf
                else abs(s.min - arg_min) > 1e-3 * max(1.0, abs(arg_min))
            )
        ):
            continue
        found.append(r)
    if not found or any((r.stat, r.grad_fn) != (found[0].stat, found[0].grad_fn) for r in found):
        return None
    return found[0]  # recorded first: the innermost call finishes first


def _producer_line(rec: Record) -> str:
    s = rec.stat
    assert s is not None
    kind = f" ({rec.module_type})" if rec.module_type else ""
    return (
        f"exp's argument is {rec.path}'s {rec.role}{kind}: min {fmt(s.min)}, max "
        f"{fmt(s.max)} ({count(s.numel, 'value')})"
    )


def _inside_cause(ctx: RuleContext, small: float) -> str:
    """The explanation's cause for values grown inside the first forward (see
    :func:`_grown_inside`)."""
    where = (
        " In sentinel mode only the model's inputs and outputs are measured: mode='watch' "
        "names the module or loop whose calls grow them."
        if ctx.facts.get("mode") == "sentinel"
        else ""
    )
    return (
        f"The model's inputs were at most |x| = {fmt(small)}, and no update had run yet: the "
        "values grew inside its forward, where something is applied again and again and "
        "amplifies on every pass (a solver's step beyond its stability limit, a recurrence "
        f"of gain above 1).{where}"
    )


def _inside_fix(ctx: RuleContext, small: float) -> str:
    """The fix for values grown inside the first forward from small inputs."""
    lines = [
        f"# at step 0, before any update, from inputs of at most |x| = {fmt(small)}: the "
        "values grew inside the forward",
        "# shrink what the loop or recurrence applies on each pass (a smaller step size, a "
        "gain <= 1, a normalization inside it) or bound its state (x.clamp)",
    ]
    if ctx.facts.get("mode") == "sentinel":
        lines.append(
            "# rerun under nanwatch.watch(model, mode='watch'): it names the module or loop "
            "whose calls grow them"
        )
    return "\n".join(lines)


def _growth_line(
    ctx: RuleContext,
    a: Anomaly,
    name: str,
    big: float,
    lim: DtypeLimits,
    *,
    noun: str = "inputs",
    complex_: bool = False,
    holder: str | None = None,
) -> str:
    """For float32/float64: the values themselves exploded; say when. For an exp-like op,
    ``big`` is its largest argument (see :func:`_overflowing`); ``complex_``: of a complex
    argument, whose real part (unrecorded) passed the bound."""
    if name in EXP_LIKE and complex_:
        what = f"the real part of exp's argument passed {fmt(lim.exp_bound)}"
    elif name in EXP_LIKE and math.isfinite(big):
        base = 2.0 if name.rstrip("_") == "exp2" else math.e
        power = f"2^{fmt(big)}" if base == 2.0 else f"e^{fmt(big)}"
        what = f"exp's argument reached {fmt(big)} ({power} ≈ 1e{int(big * math.log10(base))})"
    elif name in EXP_LIKE:
        what = f"exp's argument passed {fmt(lim.exp_bound)}"  # (its input was not kept)
    else:
        frac = big / lim.max if math.isfinite(big) else math.nan
        what = (
            f"{noun} already at {fmt(big)} ({frac:.0%} of the {lim.name} limit)"
            if math.isfinite(frac) and frac >= 0.01
            else f"{noun} up to {fmt(big)}"
        )
    if (moved := _closure_moved(ctx)) is not None:
        when = f"at step {ctx.step}, {_closure_words(moved)}"
    elif _first_step(ctx) and (small := _grown_inside(ctx, big)) is not None:
        when = (
            f"at step 0, before any optimizer update, from model inputs of at most |x| = "
            f"{fmt(small)}: they grew inside the model's forward (a loop or a recurrence that "
            "amplifies on every pass), not in the inputs, nor by the learning rate"
        )
    elif _first_step(ctx):
        when = (
            "at step 0, before any optimizer update: the initial weights or the inputs put it "
            "there, not the learning rate"
        )
    elif (jump := _jump(ctx, a)) is not None and (
        jump.elsewhere or (jump.steady and jump.updates > 0)
    ):  # steady, then one jump: an update or a write outside the optimizer, not a drift
        return f"{what}: {jump.line(_lr_note(ctx, jump.path))}"
    elif holder is not None and name in EXP_LIKE and not math.isfinite(big):
        return f"{what} at step {ctx.step}: {holder}"  # its argument unknown: no claim
    elif holder is not None:
        when = f"at step {ctx.step}: {holder}"
    else:
        when = f"at step {ctx.step}: the values grew during training{_lr_note(ctx)}"
    return f"{what}: the values themselves exploded, {when}"


def _inputs_of_record(trace: StepTrace, rec: Record) -> list[Record]:
    """The measured records of what the call that made ``rec`` was given: a module's
    inputs, or for a loss computed outside any module, the model's outputs. An input that
    came through a pass-through module resolves to that module's input, an upper bound."""
    if rec.path == LOSS_PATH:
        return first_root_outputs(trace)
    resolved = (trace.resolve(r) for r in trace.inputs_of(rec.call))
    return [m for m in resolved if m.stat is not None]


def _forward_values_of(trace: StepTrace, path: str) -> list[Record]:
    """The measured inputs and outputs of every forward call of the module at ``path``:
    what its backward multiplies the incoming gradient by."""
    calls = {c.id for c in trace.calls if c.path == path}
    out = []
    for r in trace.records:
        if r.call in calls and r.phase in (Phase.INPUT, Phase.FORWARD):
            m = trace.resolve(r)
            if m.stat is not None:
                out.append(m)
    return out


def _op_elsewhere(a: Anomaly) -> bool:
    """The anomaly's forward op ran in another module than the record that saw its value:
    a child whose output went on through functional code (``conv(F.silu(norm(x)))``), so
    the record's own inputs are what the op made, not what it was given."""
    op = a.op
    return (
        a.kind is AnomalyKind.FORWARD
        and op is not None
        and op.phase is Phase.FORWARD
        and op.path is not None
        and op.path != a.record.path
    )


def _op_call(trace: StepTrace, a: Anomaly) -> int | None:
    """The id of the last call of the op's module that finished before the anomaly's
    record (a child's call; None for code still running around it, a parent's forward,
    whose own inputs are not what the op was given)."""
    path = a.op.path if a.op is not None else None
    at = a.record.index
    calls = [c for c in trace.calls if c.path == path and c.start <= at and 0 <= c.end <= at]
    return calls[-1].id if calls else None


def _wide_from_record(ctx: RuleContext, a: Anomaly) -> Iterator[Diagnosis]:
    """float32/float64, no op recorded: a NaN or inf made from finite values so large that
    a product of two of them passes the dtype's range (|x| >= sqrt(finfo.max)) -- values
    that exploded; smaller values leave the cause to the op (forensic mode). In forward the
    values are the call's inputs; in backward, what the module's forward took and gave,
    which its backward multiplies by (a norm's forward can hide x² = inf as rsqrt(inf) = 0;
    its backward makes inf × 0 = NaN)."""
    rec = a.record
    s = rec.stat
    if s is None or s.finite:
        return
    moved = _op_elsewhere(a)
    if moved:
        # the op that made the value ran in another module than the record that saw it
        # (a child whose output went on through functional code): that op's inputs count
        call = _op_call(ctx.trace, a)
        resolved = [] if call is None else [ctx.trace.resolve(r) for r in ctx.trace.inputs_of(call)]
        values = [m for m in resolved if m.stat is not None]
        if len(values) != len(resolved):
            values = []
    elif a.kind is AnomalyKind.FORWARD:
        values = _inputs_of_record(ctx.trace, rec)
    elif a.kind is AnomalyKind.BACKWARD:
        values = _forward_values_of(ctx.trace, a.path)
    else:
        return
    of_op = not values and a.op is not None and a.op.phase is Phase.FORWARD
    if of_op and a.op is not None:
        # inputs bounded by earlier records, not read (a residual sum): the op read them
        values = [
            Record(
                -1,
                rec.step,
                Phase.INPUT,
                a.path,
                name,
                a.op.dtype or rec.dtype,
                rec.device,
                (),
                st,
                rec.call,
                None,
                rec.module_type,
            )
            for name, st in a.op.inputs
            if st is not None
        ]
    if not values or any(r.stat is None or not r.stat.finite for r in values):
        return
    top = max(values, key=lambda r: r.stat.magnitude if r.stat is not None else -1.0)
    big = top.stat.magnitude if top.stat is not None else math.nan
    lim = limits(top.dtype) or limits(rec.dtype)
    if lim is None or lim.short_range or not big >= math.sqrt(lim.max):
        return
    square = f"past sqrt({fmt(lim.max)}) = {fmt(math.sqrt(lim.max))}, the product or square "
    if moved and a.op is not None:
        first = (
            f"{short_op(a.op.op)} in {a.path} made {a.op.born} in {a.op.dtype or rec.dtype} "
            f"from finite inputs up to |x| = {fmt(big)} (the {top.role} of {top.path}): "
            f"{square}of two such values is inf"
        )
    elif a.kind is AnomalyKind.FORWARD:
        # the op's own operand when the values came from it, not the module's input (a
        # root's: the token ids of a language model)
        owner = top.path
        if of_op and a.op is not None:
            owner = f"{short_op(a.op.op)} in {a.op.path or a.path}"
        first = (
            f"{rec.where} holds {s.kinds()} in {rec.dtype}, made from finite inputs up to "
            f"|x| = {fmt(big)} (the {top.role} of {owner}): {square}of two such values "
            "is inf"
        )
    else:
        first = (
            f"{rec.where} holds {s.kinds()}, born in the backward of {a.path}, whose "
            f"forward took and gave finite values up to |x| = {fmt(big)} (its {top.role}, "
            f"{top.dtype}): {square}of two such values is inf, which a forward can hide "
            "(rsqrt(inf) = 0) and its backward cannot (inf × 0 = NaN)"
        )
    noun = "inputs" if a.kind is AnomalyKind.FORWARD else "values"
    batch = _batch_jump(ctx, a)
    grew = batch.line(ctx.step) if batch else _growth_line(ctx, a, "", big, lim, noun=noun)
    evidence = [first, grew, *([] if batch or _first_step(ctx) else _setting_evidence(ctx))]
    exploded = next(
        (t.step for t in ctx.history for d in t.diagnoses if getattr(d, "code", "") == "NW303"),
        None,
    )
    if exploded is not None:
        evidence.append(f"the gradient norms exploded first, at step {exploded} (NW303)")
    if batch is not None:
        explanation = _explain_batch(batch, top.dtype)
        fix = _fix_batch(batch)
    else:
        cause = "" if _first_step(ctx) else _setting_cause(ctx)
        small = _grown_inside(ctx, big)
        explanation = _explain_wide(
            "other",
            top.dtype,
            lim,
            top.stat,
            big,
            recurrent=False,
            cause=cause or (_inside_cause(ctx, small) if small is not None else ""),
        )
        fix = _fix_wide(
            "other",
            "",
            top.dtype,
            lim,
            None,
            recurrent=False,
            first=_first_step(ctx),
            ref=_module_ref(ctx, a),
            update=_update_fix(ctx, _grown_path(ctx, a), clip_first=True),
            clip=_clip_line(ctx),
            setting=bool(cause),
            inside=_inside_fix(ctx, small) if small is not None else None,
        )
    fields = anomaly_fields(a)
    if moved and a.op is not None:
        fields["phase"] = a.op.phase.value  # the op's forward, not the record's input
    yield ctx.diagnosis(**fields, evidence=evidence, explanation=explanation, fix=fix, priority=20)


#: autograd nodes of exp ops: a value they hold is that exp's result
_EXP_NODES = {"ExpBackward0": "exp", "Exp2Backward0": "exp2", "Expm1Backward0": "expm1"}


def _exp_from_record(ctx: RuleContext, a: Anomaly) -> Diagnosis | None:
    """No op traced (watch, sentinel mode), but the autograd node of the first bad value is
    an exp, and the value holds +inf and nothing else non-finite: exp of finite values is
    +inf exactly where its argument passed the dtype's exp bound (float32: 88.72), so the
    exp overflowed, as forensic mode would pinpoint."""
    rec = a.record
    s = rec.stat
    name = _EXP_NODES.get(rec.grad_fn or "")
    lim = limits(rec.dtype)
    if (
        name is None
        or a.kind is not AnomalyKind.FORWARD
        or s is None
        or not s.has_posinf
        or s.has_nan
        or s.has_neginf
        or lim is None
        or lim.short_range
    ):
        return None
    src = ctx.trace.record(rec.source) if rec.source is not None else None
    src = ctx.trace.resolve(src) if src is not None else None
    if src is not None and src.stat is not None and not src.stat.finite:
        return None  # the inf came in: exp passed it on
    bound = lim.exp_bound / (math.log(2) if name == "exp2" else 1.0)
    made = (
        f"{name} made it ({rec.grad_fn}): {name} of finite values is +inf exactly where its "
        f"argument passed {fmt(bound)}, the {rec.dtype} exp bound "
        f"(log({fmt(lim.max)}))"
    )
    evidence = [a.summary, f"{rec.where}: {describe_stat(s)}", made]
    if src is not None and src.stat is not None:
        evidence.append(f"the {name} was computed from {src.where}: {describe_stat(src.stat)}")
    evidence.append(_growth_line(ctx, a, name, math.nan, lim))
    first = _first_step(ctx)
    evidence += [] if first else _setting_evidence(ctx)
    evidence.append(untraced_hint(ctx))
    cause = "" if first else _setting_cause(ctx)
    explanation = _explain_wide("exp", rec.dtype, lim, None, math.nan, recurrent=False, cause=cause)
    fix = _fix_wide(
        "exp",
        name,
        rec.dtype,
        lim,
        None,
        recurrent=False,
        first=first,
        ref=_module_ref(ctx, a),
    )
    if src is not None:  # no line traced: say which exp, in the first line's comment
        head, sep, rest = fix.partition("\n")
        which = f"the {name} feeding {rec.path} ({rec.role}), of {src.path}'s {src.role}"
        fix = f"{head}   # {which}{sep}{rest}"
    return ctx.diagnosis(
        **anomaly_fields(a), evidence=evidence, explanation=explanation, fix=fix, priority=20
    )


def _from_record(ctx: RuleContext, a: Anomaly) -> Iterator[Diagnosis]:
    rec = a.record
    if (made := _exp_from_record(ctx, a)) is not None:
        yield made
        return
    if (loss_sum := _class_loss_sum(ctx, a, None)) is not None:
        yield loss_sum  # a class loss's sum over the batch passed the max (or its count did)
        return
    lim = low_precision(rec.dtype)
    s = rec.stat
    if lim is None and limits(rec.dtype) is not None:
        yield from _wide_from_record(ctx, a)
        return
    if lim is not None and not lim.short_range:  # bfloat16: float32's range
        found = list(_wide_from_record(ctx, a))
        if found:
            yield from found
            return
    if lim is None or s is None or not (s.has_posinf or s.has_neginf):
        return
    if a.kind not in (AnomalyKind.FORWARD, AnomalyKind.BACKWARD, AnomalyKind.GRADIENT):
        return
    evidence = [
        f"{rec.where} holds {s.kinds()} in {rec.dtype}; its inputs were finite",
        f"statistics: {describe_stat(s)}; the largest finite {rec.dtype} value is "
        f"{fmt(lim.max)} (exp overflows above {fmt(lim.exp_bound)})",
        untraced_hint(ctx),
    ]
    backward = a.kind is not AnomalyKind.FORWARD
    kind = "backward" if backward else "other"
    device = device_type(None, rec.device)
    batch = _batch_jump(ctx, a)
    jump = _jump(ctx, a) if batch is None else None
    if batch is not None:
        evidence[-1] = batch.line(ctx.step)
        explanation, fix = _explain_batch(batch, rec.dtype), _fix_batch(batch)
    elif jump is not None:
        evidence[-1] = jump.line(_lr_note(ctx, jump.path))
        evidence += [] if jump.elsewhere else _setting_evidence(ctx)
        explanation = _explain_jump(jump, rec.dtype, lim, _setting_cause(ctx))
        fix = _fix_jump(ctx, jump)
    if batch is not None or jump is not None:
        yield ctx.diagnosis(
            **anomaly_fields(a), evidence=evidence, explanation=explanation, fix=fix, priority=20
        )
        return
    factor = _fixed_factor(s, lim) if backward else None
    if factor is not None:
        evidence.insert(
            2,
            f"the finite values are at most {fmt(factor)}, {fmt(lim.max / factor)} times below "
            f"{rec.dtype}'s max, yet {_inf_count(s)} overflowed: a few elements' gradient "
            "is many orders of magnitude above the rest",
        )
        yield ctx.diagnosis(
            **anomaly_fields(a),
            evidence=evidence,
            explanation=_explain_fixed_factor(rec.dtype, lim),
            fix=_fix_fixed_factor(rec.dtype, _module_ref(ctx, a)),
            priority=20,
        )
        return
    explanation = _explain(kind, rec.dtype, lim)
    fix = _fix(
        kind,
        "",
        rec.dtype,
        lim,
        None,
        device=device,
        ref=_module_ref(ctx, a),
        loss=a.path == LOSS_PATH,
    )
    heavy = _heavy_weights(ctx, a.path, lim, _module_ref(ctx, a)) if backward else None
    if heavy is not None:  # the module's own weights multiply the gradient past the max
        explanation += f" Here the likelier cause is {a.path}'s own weights: {heavy[0]}."
        fix = f"{heavy[1]}\n# or, if a large loss is the cause:\n{fix}"
    yield ctx.diagnosis(
        **anomaly_fields(a), evidence=evidence, explanation=explanation, fix=fix, priority=20
    )


def _cast_back(dtype: str, lim: DtypeLimits, code: str | None) -> tuple[str, str]:
    """A backward cast: the float32 gradient of the user's x.float() went back to x's
    dtype and did not fit -- a loss scale too large, or a large factor in the float32 part."""
    top = fmt(lim.max)
    plain = code.split("  #", 1)[0].strip() if code else ""
    at = f" (at: {plain})" if plain else ""
    explanation = (
        f"In backward, the gradient of x.float() (or x.to(torch.float32)) is cast back to "
        f"x's dtype, {dtype}. The float32 part of the graph made a gradient larger than "
        f"{top}, {dtype}'s largest value, so that cast made it inf{at}: a loss multiplied by "
        "a loss scale too large for these gradients, or a large factor in the float32 "
        f"computation. Computing more in float32 does not help; the gradient must fit {dtype} "
        "where it re-enters the model."
    )
    fix = (
        f"# the gradient reaching the .float() was past {top}: lower what multiplies the loss\n"
        "scaler = torch.amp.GradScaler()   # starts at 2**16, halves its scale on every "
        "overflow and skips that step; nanwatch.watch(model, scaler=scaler) expects those "
        "steps\n"
        "# a hand-written loss scale: start lower (2.0 ** 16, not 2.0 ** 24); if it lowers "
        "itself after an overflow by design, the first overflowing steps are expected\n"
        f"# or train in bfloat16 (float32's range): the cast back cannot overflow there"
    )
    return explanation, fix


def _inf_count(s: TensorStat) -> str:
    n = (s.posinf or 0) + (s.neginf or 0)
    return f"{n} of {s.numel:,}" if n else "some"


def _fixed_factor(s: TensorStat, lim: DtypeLimits) -> float | None:
    """A low-precision gradient where a few elements overflowed while every finite one is
    tiny (at most max / 2**16): no loss scale fits both, a fixed large factor in the graph
    (a 1e10 "infinite" interval, a 1e9 mask fill) multiplies those elements. The largest
    finite |x|, or None when the values do not show that."""
    if not lim.short_range or s.finite_amax is None or not math.isfinite(s.finite_amax):
        return None
    bad = (s.posinf or 0) + (s.neginf or 0)
    if not bad or (s.nan or 0) or bad * 2 > s.numel or s.finite_amax <= 0:
        return None
    return s.finite_amax if s.finite_amax <= lim.max / 2.0**16 else None


def _explain_fixed_factor(dtype: str, lim: DtypeLimits, *, few: bool = True) -> str:
    head = (
        f"A gradient exceeded {dtype}'s largest finite value {fmt(lim.max)} in a few "
        "elements while the rest stayed tiny: not a loss too large (that overflows every "
        "element alike), but a fixed large constant in the graph"
        if few
        else f"A gradient exceeded {dtype}'s largest finite value {fmt(lim.max)} on its way "
        f"back to a {dtype} operand of a float32 product: likely a large constant in the graph"
    )
    return head + (
        " -- a 1e10 'infinite' last "
        "interval, a 1e9 mask fill, a large weight on one term -- multiplying those "
        f"elements' gradient. A GradScaler cannot fix it: one scale for all gradients "
        "either overflows these or flushes the rest to zero, and it skips every step while "
        f"halving its scale. The gradient is cast back to {dtype} where a {dtype} tensor "
        "met the factor (type promotion computes the product in float32, its gradient "
        f"returns in {dtype})."
    )


def _fix_fixed_factor(dtype: str, ref: str, code: str | None = None) -> str:
    plain = code.split("  #", 1)[0].strip() if code else ""
    return (
        (f"# at: {plain}\n" if plain else "")
        + f"# compute where the constant meets the {dtype} tensor in float32: cast the {dtype} "
        "operand up before multiplying, e.g.\n"
        f"y = x.float() * c   # was: y = x * c, with x in {dtype} and c holding a large "
        "constant (1e10)\n"
        f"# and keep float32 back to where that gradient is consumed ({ref}'s output layer "
        f"in float32: {ref}.float() with its input cast up), or use a constant that fits "
        f"{dtype}: its gradient is that factor times the upstream one\n"
        "# not a GradScaler: it scales every gradient by one factor and only helps a loss "
        "whose gradients all under- or overflow together"
    )


def _explain(kind: str, dtype: str, lim: DtypeLimits | None) -> str:
    """Low precision (float16, bfloat16, float8): the dtype's range is the problem."""
    top = fmt(lim.max) if lim is not None else "its largest value"
    if kind == "backward":
        return (
            f"A gradient exceeded {dtype}'s largest finite value {top} and became inf. "
            f"{dtype} has 5 exponent bits: values above {top} do not exist, so a large loss "
            "or a large upstream gradient overflows in backward. A GradScaler detects such "
            "steps and skips them while lowering the scale; float32 master weights with "
            "autocast keep the update itself in range."
        )
    if kind in ("softmax", "exp") and lim is not None:
        return (
            f"exp(x) is larger than {top}, {dtype}'s largest finite value, for every x above "
            f"log({top}) = {fmt(lim.exp_bound)}: a hand-written softmax, an exp or a "
            f"logsumexp computed in {dtype} turns moderately large inputs into inf, and the "
            "next division or subtraction turns inf into NaN. Stable softmax subtracts the "
            "row maximum first; autocast runs softmax in float32 for this reason."
        )
    if kind == "matmul":
        return (
            f"A matmul sums many products: inputs of a few hundred in {dtype} give sums "
            f"beyond {top} (attention scores q·k before the 1/sqrt(d) scaling, T5-style "
            "un-normalized activations). bfloat16 has float32's range; float32 for this one "
            "op costs little."
        )
    if kind == "cast":
        return (
            f"Casting to {dtype} turns every value beyond ±{top} into {_past_max(dtype)}: a "
            f"tensor computed in float32 (a loss, an autocast output, a buffer) does not fit in "
            f"{dtype}"
            + (
                ". float8 holds a tensor only with a scale: divide by amax / finfo.max before "
                "the cast and multiply it back after."
                if dtype.startswith("float8")
                else "."
            )
        )
    return (
        f"A value exceeded {top}, the largest finite {dtype} value, and became inf; the "
        "NaN that followed (inf - inf, 0 × inf) is a consequence."
    )


def _explain_wide(
    kind: str,
    dtype: str,
    lim: DtypeLimits,
    x: TensorStat | None,
    big: float,
    *,
    recurrent: bool,
    cause: str = "",
    complex_: bool = False,
    op: str = "exp",
    sigmoid: bool = False,
) -> str:
    """float32 / float64: the range is vast, so the values themselves exploded; ``cause``,
    when the records name what grew them (an optimizer setting, NW306), says it instead of
    the usual suspects; ``complex_``: an exp of a complex tensor; ``op``: the exp-like op
    (cosh and sinh overflow on both sides, above log(2 × max) in |x|); ``sigmoid``: the
    exp is that of a sigmoid written by hand on the line (see :func:`_sigmoid_by_hand`)."""
    top = fmt(lim.max)
    head = (
        f"{dtype} holds values up to {top}: reaching that is not a precision problem, and "
        "computing in a wider dtype only delays it. "
    )
    if kind == "softmax":
        return head + (
            f"This exp is part of a softmax or logsumexp written by hand: exp of inputs "
            f"above {fmt(lim.exp_bound)} is inf, and the normalization then makes inf / inf "
            "= NaN. Subtracting the row maximum first keeps every exp at most 1 and gives the "
            "same result; torch.softmax and torch.logsumexp do it for you."
        )
    if kind == "exp" and complex_:
        return head + (
            f"For a complex z, |exp(z)| = e^Re(z): the imaginary part only turns the phase, "
            f"and the real part alone overflows {dtype} above {fmt(lim.exp_bound)}. A real "
            "part with no upper bound -- a learned decay or damping that went negative, a "
            "log-amplitude -- grows with it (a mode exp((-d + iω)·t) with d < 0 grows "
            "without limit in t). Keep the decay positive by construction (softplus), or "
            "bound the real part; a clamp of the complex tensor itself does not exist."
        )
    if kind == "exp" and op in _BOTH_SIDES:
        arg = x.magnitude if x is not None else math.nan
        reached = f"reached |x| = {fmt(arg)}" if not math.isnan(arg) else "passed it"
        return head + (
            f"{op} overflows {dtype} for |x| above {fmt(lim.exp_bound + math.log(2))}; its "
            f"argument {reached}. An argument with no bound -- a difference of values that "
            "grew, a learned quantity that drifted -- passes it: bound it, or write the "
            f"expression so that it never takes {op} of a large number."
        )
    if kind == "exp" and sigmoid:
        return head + (
            f"The line is a sigmoid written by hand, 1 / (1 + exp(-x)): exp(-x) overflows "
            f"{dtype} where x is below -{fmt(lim.exp_bound)}. The forward still gives 1 / inf "
            "= 0, but autograd saved the inf, and the backward multiplies the gradient reaching "
            "the exp by it: 1 / inf passes back a gradient of 0, and 0 × inf = NaN. "
            "torch.sigmoid is the same function, computed without forming a huge "
            "exp, and its gradient is finite everywhere. Large inputs are ordinary for a "
            "sigmoid: there is nothing to bound."
        )
    if kind == "exp":
        arg = signed_max(x)
        reached = f"reached {fmt(arg)}" if not math.isnan(arg) else "passed it"
        return head + (
            f"exp overflows {dtype} above {fmt(lim.exp_bound)}; its argument {reached}. "
            "An exponentiated quantity with no upper bound -- a "
            "predicted log-variance or log-scale, a temperature, a learned log-rate -- "
            "drifted up. Bound the argument (clamp), or parameterize the positive quantity "
            "with softplus, which grows linearly instead of exponentially."
        )
    if kind == "matmul":
        more = (
            " In a recurrence the hidden state is multiplied by the same weight_hh at every "
            "time step: a largest singular value above 1 grows it geometrically with the "
            "sequence length, and a ReLU recurrence has nothing that saturates it."
            if recurrent
            else " Activations multiplied by weights of gain above 1 in layer after layer "
            "grow geometrically when nothing normalizes them."
        )
        return head + f"The inputs of this product were already up to {fmt(big)}." + more
    if math.isnan(big):  # its inputs were not measured: how large they were is not known
        return head + (
            "Its inputs were not measured here (a custom Function's backward is given a "
            "gradient nanwatch does not read): find what made its result that large, a "
            "factor it multiplies by (a value saved in forward, a coefficient) or inputs that "
            "grew."
        )
    if cause:
        return head + f"The inputs reached {fmt(big)}. {cause}"
    return head + (
        f"The inputs reached {fmt(big)}: find what lets them grow (a learning rate too "
        "high, no gradient clipping, an un-normalized residual stream)."
    )


#: Detectron's ``bbox_xform_clip``: the largest log-ratio of a decoded box to its anchor
_BOX_CLIP = math.log(1000.0 / 16)


def _softplus_by_hand(code: str | None) -> str | None:
    """``code`` with each ``log(1 + exp(x))`` (``torch.log``, ``.log()``, ``log1p(exp(x))``,
    ``1 + exp`` either way round) written as ``F.softplus(x)``: softplus by hand, whose exp
    overflows where softplus is simply x. None when the line holds none.

    >>> _softplus_by_hand("sigma = torch.log(1 + torch.exp(s.rho)); w = s.mu + sigma")
    'sigma = F.softplus(s.rho); w = s.mu + sigma'
    >>> _softplus_by_hand("y = torch.log1p(x.exp())")
    'y = F.softplus(x)'
    """
    if not code:
        return None
    line = code.split("  #", 1)[0].rstrip()
    try:
        tree = ast.parse(line.strip())
    except SyntaxError:
        return None
    text = line.strip()

    def exp_arg(node: ast.AST) -> ast.expr | None:
        if not isinstance(node, ast.Call):
            return None
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "exp":
            if isinstance(f.value, ast.Name) and f.value.id in ("torch", "math", "np"):
                return node.args[0] if len(node.args) == 1 else None
            return f.value if not node.args else None  # x.exp()
        return None

    def one(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and node.value in (1, 1.0)

    found: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name, f = node.func.attr, node.func
        plain = isinstance(f.value, ast.Name) and f.value.id == "torch" and len(node.args) == 1
        inner = node.args[0] if plain else (f.value if not node.args else None)
        if inner is None:
            continue
        x: ast.expr | None = None
        if name == "log1p":
            x = exp_arg(inner)
        elif name == "log" and isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Add):
            if one(inner.left):
                x = exp_arg(inner.right)
            elif one(inner.right):
                x = exp_arg(inner.left)
        seg = ast.get_source_segment(text, x) if x is not None else None
        if seg is None or node.end_col_offset is None or node.end_lineno != node.lineno:
            continue
        found.append((node.col_offset, node.end_col_offset, f"F.softplus({seg})"))
    if not found:
        return None
    found.sort()
    out, at = [], 0
    for a, b, new in found:
        if a < at:  # nested in one already rewritten
            continue
        out.append(text[at:a] + new)
        at = b
    return "".join(out) + text[at:]


def _sigmoid_by_hand(code: str | None) -> str | None:
    """``code`` with each sigmoid written by hand as ``torch.sigmoid``: ``1 / (1 +
    exp(-x))`` (either way round, ``torch.exp`` or ``.exp()``, a ``1.0`` or a
    ``torch.reciprocal``) and ``exp(x) / (1 + exp(x))``, whose exp overflows where the
    sigmoid is simply 0 or 1. None when the line holds none.

    >>> _sigmoid_by_hand("p = 1 / (1 + torch.exp(-z))")
    'p = torch.sigmoid(z)'
    >>> _sigmoid_by_hand("p = 1.0 / (1.0 + (-(a - b)).exp())")
    'p = torch.sigmoid(a - b)'
    >>> _sigmoid_by_hand("w = 1 / (1 + torch.exp(s * d))")
    'w = torch.sigmoid(-(s * d))'
    >>> _sigmoid_by_hand("q = torch.exp(u) / (1 + torch.exp(u))")
    'q = torch.sigmoid(u)'
    """
    if not code:
        return None
    text = code.split("  #", 1)[0].strip()
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None

    def exp_arg(node: ast.AST) -> ast.expr | None:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            return None
        f = node.func
        if f.attr != "exp":
            return None
        if isinstance(f.value, ast.Name) and f.value.id == "torch":
            return node.args[0] if len(node.args) == 1 and not node.keywords else None
        return f.value if not node.args and not node.keywords else None

    def one(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and node.value in (1, 1.0) and node.value is not True

    def one_plus_exp(node: ast.AST) -> ast.expr | None:
        """x of ``1 + exp(x)`` or ``exp(x) + 1``."""
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)):
            return None
        if one(node.left):
            return exp_arg(node.right)
        if one(node.right):
            return exp_arg(node.left)
        return None

    def negated(x: ast.expr) -> str | None:
        """The source of -x, as simply as it can be written."""
        if isinstance(x, ast.UnaryOp) and isinstance(x.op, ast.USub):
            return ast.get_source_segment(text, x.operand)
        seg = ast.get_source_segment(text, x)
        if seg is None:
            return None
        simple = isinstance(x, (ast.Name, ast.Attribute, ast.Call, ast.Subscript))
        return f"-{seg}" if simple else f"-({seg})"

    found: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        arg: str | None = None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            x = one_plus_exp(node.right)
            if x is not None and one(node.left):  # 1 / (1 + exp(x)) = sigmoid(-x)
                arg = negated(x)
            elif (
                x is not None
                and (y := exp_arg(node.left)) is not None
                and ast.dump(x) == ast.dump(y)
            ):  # exp(x) / (1 + exp(x)) = sigmoid(x)
                arg = ast.get_source_segment(text, x)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "reciprocal"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
            and len(node.args) == 1
        ):
            x = one_plus_exp(node.args[0])
            arg = negated(x) if x is not None else None
        if (
            arg is None
            or not isinstance(node, ast.expr)
            or node.end_col_offset is None
            or node.end_lineno != node.lineno
        ):
            continue
        found.append((node.col_offset, node.end_col_offset, f"torch.sigmoid({arg})"))
    if not found:
        return None
    found.sort()
    out, at = [], 0
    for a, b, new in found:
        if a < at:
            continue
        out.append(text[at:a] + new)
        at = b
    return "".join(out) + text[at:]


def _rewrite_calls(code: str | None, op: str, wrap: Callable[[str], str]) -> str | None:
    """The user's line with the argument of EVERY call to ``op`` passed through ``wrap``
    (``rewrite_call`` rewrites the first): ``w = aw * torch.exp(a); h = ah * torch.exp(b)``
    gets both bounded. None when the line holds no such call."""
    line = code.split("  #", 1)[0].rstrip() if code else ""
    args: list[str] = []
    got: list[str] = []

    def keep(e: str) -> str:
        got.append(e)
        return f"_nw_arg{len(args)}_"

    for _ in range(16):
        got.clear()
        new = rewrite_call(line, [op], keep)
        if new is None or not got:
            break
        i = len(args)
        args.append(got[0])
        # hide this call from the next pass: rename the op next to its argument
        new = new.replace(f"{op}(_nw_arg{i}_)", f"_nw_call{i}_(_nw_arg{i}_)", 1)
        new = new.replace(f"_nw_arg{i}_.{op}(", f"_nw_arg{i}_._nw_call{i}_(", 1)
        if new == line or f"_nw_call{i}_" not in new:
            return None
        line = new
    if not args:
        return None
    for i, e in enumerate(args):
        line = line.replace(f"_nw_call{i}_", op).replace(f"_nw_arg{i}_", wrap(e))
    return line


def _exp_calls(code: str | None, op: str) -> tuple[int, int]:
    """How many calls to ``op`` the user's line makes, and how many of them are multiplied
    by a tensor factor that is not another such call (``aw * torch.exp(dw)``)."""
    line = _rewrite_calls(code, op, lambda e: "_nw_x_")
    if line is None:
        return 0, 0
    call = rf"(?:(?:torch\.)?{re.escape(op)}\(_nw_x_\)|_nw_x_\.{re.escape(op)}\(\))"
    n = len(re.findall(call, line))
    line = re.sub(call, "_nw_e_", line)
    # a tensor factor (a name, an index, a call), not a number nor another exp: aw * exp(dw)
    before = r"(?:\b(?!_nw_e_\b)[A-Za-z_]\w*|[\])])\s*\*\s*_nw_e_"
    after = r"_nw_e_\s*\*\s*(?!_nw_e_)[A-Za-z_(]"
    scaled = len({m.end() for m in re.finditer(before, line)}) + len(
        {m.start() for m in re.finditer(after, line)}
    )
    return n, min(scaled, n)


def _log_of_cosh(ctx: RuleContext, ev: OpEvent) -> bool:
    """The cosh's result goes into a log (a log-cosh loss): the loss graph shows a log taken
    of a cosh (its ``"loss_graph"`` note), or the op's line takes one."""
    for n in ctx.notes("loss_graph"):
        logs = n.data.get("logs")
        if isinstance(logs, list) and any(isinstance(c, list) and c[:1] == ["cosh"] for c in logs):
            return True
    code = (ev.code or "").replace(" ", "")
    return bool(re.search(r"log\((torch\.)?cosh\(|\.cosh\(\)\.log\(", code))


def _fix_wide(
    kind: str,
    name: str,
    dtype: str,
    lim: DtypeLimits,
    code: str | None,
    *,
    recurrent: bool,
    first: bool,
    ref: str | None,
    update: Sequence[str] = (),
    clip: str | None = None,
    setting: bool = False,
    complex_: bool = False,
    cast_input: str | None = None,
    inside: str | None = None,
    source: str | None = None,
) -> str:
    """``update``: what to change in the training update, in order (:func:`_update_fix`);
    ``clip``: the line that bounds it, placed among a product's fixes ("" for none);
    ``setting``: an optimizer setting makes the update grow (NW306), the cause itself;
    ``inside``: the fix when the values grew inside the first forward (:func:`_inside_fix`)."""
    plain = code.split("  #", 1)[0].strip() if code else ""
    was = f"  # was: {plain}" if plain else ""
    if kind == "softmax":
        op = name.rstrip("_")
        lse = _logsumexp_fix(code) if op == "exp" else None
        if lse is not None:
            return lse
        other = _other_dims(code, op, source) if op in _BARE_EXP else None
        if other is not None:
            return f"{_max_subtracted(code, op, over_all=True)}{was}\n{_global_max_note(other)}"
        if op in _BARE_EXP:
            return (
                f"{_max_subtracted(code, op, source=source)}{was}\n"
                f"{_row_max_note(code, op, source)}\n"
                "# or the whole softmax in one call, stable: "
                f"{_one_call_softmax(code, op, source)} (torch.logsumexp, F.log_softmax)"
            )
        return (
            f"x = x - x.amax(dim=-1, keepdim=True)   # subtract the row max before exp{was}\n"
            "probs = torch.softmax(x, dim=-1)       # or torch.logsumexp / log_softmax"
        )
    if kind == "exp":
        op = name.rstrip("_")
        bound = lim.exp_bound / (math.log(2) if op == "exp2" else 1.0)
        calls, scaled = _exp_calls(code, op)
        # two exps each times a factor (a box decode: w = aw * exp(dw), h = ah * exp(dh)):
        # half the dtype's bound leaves room for a product of two exps, not for the
        # factors (w * h still overflows): bound the box as detectors do
        box = scaled >= 2 and op == "exp" and not complex_
        cap = math.floor(bound / 2 * 10) / 10
        limit = f"{_BOX_CLIP:.3f}" if box else str(cap)
        bounds = f"-{limit}, {limit}" if op in _BOTH_SIDES else f"max={limit}"
        if complex_:  # no clamp for complex tensors: bound the real part, keep the phase

            def wrap(e: str) -> str:
                return f"torch.complex({paren(e)}.real.clamp({bounds}), {paren(e)}.imag)"

        else:

            def wrap(e: str) -> str:
                return f"{paren(e)}.clamp({bounds})"

        fixed = _rewrite_calls(code, op, wrap) if calls else None
        first_line = fixed if fixed is not None else f"y = torch.{op}({wrap('x')})"
        softplus = _softplus_by_hand(code) if op == "exp" and not complex_ else None
        if softplus is not None:
            # log(1 + exp(x)) written out: torch's softplus is the same function, computed
            # without forming exp(x) (x itself above its threshold of 20)
            return (
                f"{softplus}   # log(1 + exp(x)) is F.softplus(x): same values, no overflow\n"
                f"# or only bound the argument: {first_line.strip()}"
            )
        last = (
            "# log(cosh(d)), a log-cosh loss, without cosh: "
            "d.abs() + F.softplus(-2 * d.abs()) - math.log(2)"
            if op == "cosh" and not complex_
            else "# or bound the real part where it is made: a decay or damping passed "
            "through F.softplus (never negative) instead of a raw parameter"
            if complex_
            else "# or parameterize the positive quantity with F.softplus (it grows linearly), "
            "not exp"
        )
        what = "the real part" if complex_ else "the argument"
        if box:
            why = (
                f"# {limit} = math.log(1000 / 16), Detectron's bbox_xform_clip: a decoded size "
                "is at most 62.5 times its anchor, whatever the network predicts"
            )
            last = "# or predict log-sizes through a bounded head: dw = 4 * torch.tanh(raw)"
        else:
            why = (
                f"# {cap} = half of {fmt(lim.exp_bound)}: bounding {what} keeps |{op}| below "
                f"sqrt({fmt(lim.max)}) = {fmt(math.sqrt(lim.max))}"
                + (
                    ", but the factor it is multiplied by scales that bound too"
                    if scaled
                    else ", so a product of two still fits"
                    if calls <= 2
                    else ""
                )
            )
        unseen = (
            "\n# if this exp's sum or cumsum goes into a log (a Cox, CRF or contrastive loss): "
            "torch.logsumexp(x, dim) / torch.logcumsumexp(x, dim) instead -- a clamp there "
            "changes the loss"
            if fixed is None and op == "exp" and not complex_
            else ""
        )
        return f"{first_line}\n{why}\n{last}{unseen}"
    if kind == "cast":
        return _fix_cast(code, dtype, cast_input)
    if clip is None:
        clip = "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # before step()"
    if kind == "matmul" and recurrent:
        lines = [
            *(
                [
                    f"for name, w in {ref}.named_parameters():   # in __init__, after {ref} "
                    "is built: recurrent weights, gain <= 1",
                    "    if 'weight_hh' in name: nn.init.orthogonal_(w)",
                ]
                if ref
                else [
                    "# for each recurrent weight (weight_hh_l*) of the recurrent module: "
                    "nn.init.orthogonal_(w), gain <= 1"
                ]
            ),
            "# or nonlinearity='tanh' (saturates), or nn.LSTM / nn.GRU (gated)",
            clip,
        ]
    elif kind == "matmul":
        lines = [
            "self.norm = nn.LayerNorm(d)   # in __init__; h = self.norm(h) before this product",
            "nn.init.xavier_uniform_(w)    # initial weights of gain ~1, not larger",
            clip,
        ]
    elif first and inside is not None:  # small inputs: grown by the forward itself
        return inside
    elif first:  # no update yet: neither the learning rate nor clipping made these values
        return (
            "# at step 0, before any update: the inputs or the initial weights are this large\n"
            "# normalize what feeds this op (nn.LayerNorm, inputs scaled to unit range) or "
            "bound it (x.clamp)"
        )
    else:
        lines = list(update) or [clip, 'for g in optimizer.param_groups: g["lr"] /= 10']
    if first:
        return "\n".join(x for x in lines[:-1] if x)  # no update yet: clipping is no fix
    if kind != "other":  # grew in training: clipping first
        return "\n".join(x for x in [*lines[-1:], *lines[:-1]] if x)
    if setting or lines == [_UNWATCHED]:  # the cause is known: not an architecture's
        return "\n".join(lines)
    return "\n".join([*lines, "# and normalize what grows (nn.LayerNorm) before this op"])


_OPERAND = r"[A-Za-z_][\w.]*(?:\[[^\]]*\])?"
_UPCASTS = (
    (
        re.compile(
            rf"\b((?:torch|F)\.(?:exp|exp2|expm1|softmax|log_softmax|logsumexp))\(({_OPERAND})"
            r"(?![\w.(])"  # the whole operand: never x.float of x.float()
        ),
        r"\1(\2.float()",
    ),
    (
        re.compile(
            rf"\b(?!torch\.|F\.)({_OPERAND})\.(exp|exp2|expm1|softmax|log_softmax|logsumexp)\("
        ),
        r"\1.float().\2(",
    ),
)


#: ops whose overflow comes from one tensor operand, cast by :func:`upcast_line`
_ONE_OPERAND = frozenset({"pow", "square"})


def upcast_line(code: str | None, op: str | None = None) -> str | None:
    """The user's line with the overflowing operand cast to float32, when it is one of the
    usual shapes (``x.exp()``, ``torch.softmax(x, ...)``, ``a @ b``); else None. ``op``:
    the op that overflowed (``pow`` casts the base of ``z.pow(2)`` or ``z ** 2``, not a
    product elsewhere on the line); an operand already ``.float()`` is left as it is.

    >>> upcast_line("e = logits.exp()  # by hand")
    'e = logits.float().exp()'
    >>> upcast_line("d = z.pow(2).sum(-1) - 2 * z.float() @ e.t().float()", "pow")
    'd = z.float().pow(2).sum(-1) - 2 * z.float() @ e.t().float()'
    """
    if not code:
        return None
    line = code.split("#", 1)[0].strip()
    op = op.rstrip("_") if op else None
    if op is not None and op not in EXP_LIKE and op not in MATMUL:
        # the op's own operand (one tensor: z of z.pow(2)); a product elsewhere on the line
        # does not feed it, and an op of two tensors (a loss) is not this line's to cast
        if op not in _ONE_OPERAND:
            return None
        return (_upcast_operands(line, op) if op == "pow" else None) or _upcast_call(line, op)
    names = [op] if op is not None and op in EXP_LIKE else list(_UPCAST_EXPS)
    calls = list(_calls_of(code, names)) if op is None or op in EXP_LIKE else []
    if len(calls) > 1 and getattr(code, "span", None) is not None:
        # several exps on the line: the one that ran (the CodeLine's span), not the first
        return _upcast_exp_call(code, names)
    for pattern, repl in _UPCASTS:
        new, n = pattern.subn(repl, line, count=1)
        if n:
            return new
    if calls:
        # an argument that is a call itself (torch.exp(torch.abs(x))): cast the user's own
        # argument, whatever it is, never a name of the template's
        return _upcast_exp_call(code, names)
    return _upcast_matmul(line)


#: the exp-like calls :data:`_UPCASTS` casts the operand of
_UPCAST_EXPS = ("exp", "exp2", "expm1", "softmax", "log_softmax", "logsumexp")


def _upcast_exp_call(code: str, names: Sequence[str]) -> str | None:
    """``code`` (one line) with the argument of the exp-like call that ran cast to float32
    by :func:`rewrite_call`; None when it is already float32 or not found."""
    new = rewrite_call(code, names, lambda e: e if _is_float32(e) else f"{paren(e)}.float()")
    line = code.split("#", 1)[0].strip()
    new = new.strip() if new is not None else None
    return new if new and new != line else None


def _is_float32(expr: str) -> bool:
    """``x.float()``, ``x.double()``, ``x.to(torch.float32)``: already cast up."""
    return bool(
        re.search(r"\.(?:float|double)\(\)$|\.to\(torch\.(?:float32|float64|float|double)\)$", expr)
    )


def _upcast_call(line: str, op: str) -> str | None:
    """``line`` with the argument of its first ``op`` call (``z.pow(2)``, ``torch.pow(z, 2)``)
    cast to float32; None when there is none or it is already float32."""
    new = rewrite_call(line, [op], lambda e: e if _is_float32(e) else f"{paren(e)}.float()")
    return new if new is not None and new != line else None


def _log_of_summed_exp(ctx: RuleContext) -> str | None:
    """``"cumsum"`` or ``"sum"`` when the step's loss graph takes the log of a (cumulative)
    sum of exps, node after node (``log <- cumsum <- exp``: a Cox partial likelihood, a
    hand-written logsumexp), else None. What the graph shows when the op's line is not
    known (the loss code outside the modules, watch mode)."""
    for n in ctx.notes("loss_graph"):
        ops = n.data.get("ops")
        if not isinstance(ops, list):
            continue
        for i in range(len(ops) - 2):
            if ops[i] == "log" and ops[i + 1] in ("cumsum", "sum") and ops[i + 2] == "exp":
                return str(ops[i + 1])
    return None


def _fix(
    kind: str,
    name: str,
    dtype: str,
    lim: DtypeLimits | None,
    code: str | None,
    *,
    device: str,
    ref: str = "model",
    arg: float = math.nan,
    scalar: bool = False,
    loss: bool = False,
    autocast: bool = False,
    result: float = math.nan,
    cast_input: str | None = None,
    operands: tuple[float, ...] = (),
    output_fits: bool = True,
    source: str | None = None,
    number_side: str | None = None,
    number: float | None = None,
) -> str:
    """Low precision: compute the op in float32, or train in bfloat16 (float32's range).
    ``arg``: an exp's largest argument; ``scalar``: the exp's input is one value (a learned
    0-dim scale); ``loss``: the op ran in loss code, outside the modules; ``result``: the
    largest |result| the op's inputs allow (:func:`_true_result`), NaN when unknown;
    ``operands``: the largest |x| of each tensor input; ``output_fits``: False when the
    module's own output is what overflowed (cast back, it would be inf again)."""
    plain = code.split("#", 1)[0].strip() if code else ""
    was = f"  # was: {plain}" if plain else ""
    bf16 = f"# or train in bfloat16: torch.autocast({device}, dtype=torch.bfloat16)"
    if kind in ("softmax", "exp") and lim is not None and not lim.short_range:
        # float32/float64: no wider dtype to move to (bfloat16's range is float32's): bound
        # the argument, or subtract the row max
        return _fix_wide(
            kind, name, dtype, lim, code, recurrent=False, first=False, ref=ref, source=source
        )
    if kind in ("softmax", "exp") and lim is not None:
        bounded = _bounded_exp(kind, name, lim, code, arg=arg, scalar=scalar, source=source)
        if bounded is not None:
            return bounded
    if kind == "matmul":
        return _fix_matmul(
            code,
            dtype,
            device=device,
            ref=ref,
            loss=loss,
            autocast=autocast,
            operands=operands,
            top=lim.max if lim is not None else math.inf,
            source=source,
        )
    op = name.rstrip("_")
    lse = _logsumexp_fix(code) if kind == "softmax" and op == "exp" else None
    if lse is not None:
        return lse
    other = _other_dims(code, op, source) if kind == "softmax" and lim is not None else None
    f32 = _float32_exp(code, op) if other is not None else None
    if other is not None and f32 is not None and lim is not None:
        return _float32_exp_fix(f32, was, other, dtype, lim, arg=arg)
    if kind == "softmax" and op in _BARE_EXP:
        up = upcast_line(code)
        alt = (
            f"# or in float32: {up}, and divide by its sum in float32 too; only the "
            f"probabilities (at most 1) fit {dtype}: cast them back with .to(torch.{dtype})"
            if up is not None
            else "# or the whole softmax in one call, in float32: torch.softmax(x.float(), "
            f"dim=-1).to(torch.{dtype}) (probabilities fit {dtype})"
        )
        return (
            f"{_max_subtracted(code, op, source=source)}{was}\n"
            f"{_row_max_note(code, op, source)}; every exp fits {dtype}\n{alt}"
        )
    fixed = upcast_line(code, op)
    if fixed is not None and op not in EXP_LIKE | MATMUL and plain.startswith("return "):
        fixed = None  # the module's output itself would turn float32: cast at the module
    top = fmt(lim.max) if lim is not None else "its largest value"
    if fixed is not None and kind == "softmax":
        return (
            f"{fixed}{was}\n"
            f"# (a softmax in float32; its result, at most 1, fits {dtype}: cast it back with "
            f".to(torch.{dtype}))\n"
            "# or train in bfloat16, where exp overflows only above "
            f"{fmt(_exp_bound('bfloat16'))}"
        )
    if (
        fixed is not None
        and kind != "cast"
        and plain.startswith("return ")
        and not loss
        and ref != "model"
        and dtype in ("float16", "bfloat16")
    ):
        # the float32 value leaves the function: the module's next float16 op (a matmul
        # with a float16 tensor) would fail on the mixed dtypes. The whole module in
        # float32 runs; the line alone only when what it returns fits the dtype
        back = _returned_in(fixed, code, op, dtype)
        return (
            f"{ref}.float()   # once, after building the model: it computes in float32\n"
            f"{ref}.register_forward_pre_hook(lambda m, args: {_tree_cast('args', 'float32')})"
            f"   # its {dtype} inputs up to float32\n"
            f"{ref}.register_forward_hook(lambda m, args, out: {_tree_cast('out', dtype)})   "
            f"# its outputs back to {dtype}\n"
            f"# {op} passes {top} in {dtype} on this line, which returns its value to the rest "
            f"of {ref}'s forward: in float32 from the module's input to its output, every op "
            f"after it sees float32 too\n"
            f"# or, only if what this line returns fits {dtype} (a normalized value): "
            f"{back}{was}\n"
            + (
                "# or train in bfloat16, where exp overflows only above "
                f"{fmt(_exp_bound('bfloat16'))}"
                if op in EXP_LIKE or op in MATMUL
                else "# or train in bfloat16 (float32's range, values up to 3.4e38)"
            )
        )
    if fixed is not None and kind != "cast":
        return (
            f"{fixed}{was}\n"
            f"# keep the result in float32 where it is used: values above {top} do not fit "
            f"{dtype}, and casting them back makes the inf again\n"
            + (
                "# or train in bfloat16, where exp overflows only above "
                f"{fmt(_exp_bound('bfloat16'))}"
                if op in EXP_LIKE or op in MATMUL
                else "# or train in bfloat16 (float32's range, values up to 3.4e38)"
            )
        )
    if kind == "backward":
        return (
            "scaler = torch.amp.GradScaler()\n"
            f"with torch.autocast(device_type={device}, dtype=torch.float16):\n"
            "    loss = criterion(model(x), y)      # model weights stay float32\n"
            "scaler.scale(loss).backward()\n"
            "scaler.step(optimizer); scaler.update()\n"
            "nanwatch.watch(model, criterion, scaler=scaler)\n"
            "# the scaler skips a step whose gradients overflow and halves its scale until "
            "they fit\n"
            f"{bf16}"
        )
    if kind in ("softmax", "exp"):
        return (
            f"e = x.float().exp(){was}   # and keep e in float32 where it is used\n"
            f"probs = torch.softmax(x.float(), dim=-1).to(torch.{dtype})   # a softmax: "
            f"probabilities fit {dtype}\n"
            "# or train in bfloat16, where exp overflows only above "
            f"{fmt(_exp_bound('bfloat16'))}"
        )
    if kind == "cast":
        return _fix_cast(code, dtype, cast_input)
    op = name.rstrip("_")
    where = "in the loss code" if loss else f"in {ref}'s forward"
    no_autocast = f"(under autocast: inside torch.autocast(device_type={device}, enabled=False))"
    floored = (
        _floor_number_divisor(code, operands, lim, was=was, dtype=dtype, number=number)
        if op == "div" and number_side == "right" and lim is not None
        else None
    )
    if floored is not None:
        return f"{floored}\n{bf16}"
    mean = _mean_by_hand(code, dtype, operands[0], was=was) if op == "sum" and operands else None
    if mean is not None:  # a mean by hand: the sum passed the max, the mean fits
        return f"{mean}\n{bf16}"
    if op and op not in _BOUNDED_RESULT:
        # the op's own result is past the dtype's max (it became inf from finite inputs):
        # computed in float32 it fits, but casting it back makes the inf again
        mine = _upcast_operands(code, op, number_side=number_side) or rewrite_call(
            code, [op], lambda e: f"{paren(e)}.float()"
        )
        past = (
            f"{op}'s result reaches up to {fmt(result)}, past {top}"
            if math.isfinite(result) and lim is not None and result > lim.max
            else f"{op}'s result is past {top}"
        )
        later = (
            f"# cast with .to(torch.{dtype}) only a later value that fits {dtype} (a "
            "normalized output, a probability)"
        )
        if not loss and ref != "model":
            # in a submodule: float32 from its input to its output, the output cast back.
            # The line alone is not enough when the values it uses were made in the dtype
            # (a mean rounded to float16 in E[x^2] - E[x]^2 cancels to a negative variance).
            # Its inputs arrive in the dtype (nested too: an (h, c) state) and are cast up
            # with it; its outputs are cast back only when they fit
            if mine is not None and output_fits:
                mine = _returned_in(mine, code, op, dtype)
            alt = (
                f"# or in {ref}'s forward: {mine}, and the tensors this line uses made from "
                ".float() inputs too"
                if mine is not None
                else f"# or in {ref}'s forward: call {op} on .float() inputs, and keep every step "
                f"from the forward's input to here in float32"
            )
            back = (
                f"{ref}.register_forward_hook(lambda m, args, out: {_tree_cast('out', dtype)})   "
                f"# its outputs back to {dtype}\n"
                f"# {past}, {dtype}'s largest value: computed in float32 and cast back, it is "
                f"inf again; in float32 from the module's input to its output, the hook casts "
                f"back what it returns: right only for outputs that fit {dtype} (a normalized "
                f"value, a probability); an output that can pass {top} (a loss, a squared norm) "
                f"keep in float32: cast only the others back"
                if output_fits
                else f"# no hook casting its outputs back: {past}, {dtype}'s largest value, and "
                f"that value is {ref}'s output (a state it hands on): cast to {dtype} it is inf "
                f"again. Keep it in float32; cast to {dtype} only an output that fits where it "
                f"enters a {dtype} layer (head(h.to(torch.{dtype}))), or .float() those layers too"
            )
            return (
                f"{ref}.float()   # once, after building the model: it computes in float32\n"
                f"{ref}.register_forward_pre_hook(lambda m, args: {_tree_cast('args', 'float32')})"
                f"   # its {dtype} inputs up to float32, nested ones too (an (h, c) state)\n"
                f"{back}" + (f" {no_autocast}" if autocast else "") + f"\n{alt}\n{bf16}"
            )
        if mine is not None:
            kept = _assigned(mine) or "the result"
            return (
                f"{mine}{was}\n# keep {kept} in float32: {past}, {dtype}'s largest value, and "
                f"casting it back makes the inf again\n{later}\n{bf16}"
            )
        return (
            f"# {where}, call {op} on .float() inputs and keep the result in float32:\n"
            f"# {past}, {dtype}'s largest value, and casting it back makes the inf again\n"
            f"{later} {no_autocast}\n{bf16}"
        )
    mine = rewrite_call(code, [op], lambda e: f"{paren(e)}.float()") if op else None
    if mine is not None:
        return f"{mine}{was}\n# (compute it in float32; cast back with .to(torch.{dtype}))\n{bf16}"
    if op:
        return (
            f"# {where}, call {op} on .float() inputs and cast the result back\n"
            f"# with .to(torch.{dtype}) {no_autocast}\n"
            f"{bf16}"
        )
    if loss:  # the loss code, outside the modules: the model itself is not where it overflowed
        return (
            f"# in the loss code, compute the expression that overflowed in float32: .float() "
            f"on the model's {dtype} outputs before the arithmetic and the reduction, e.g. "
            f"(x.float() ** 2).sum() for (x ** 2).sum()\n"
            f"# a sum or product of many {dtype} values passes {top}; the float32 loss still "
            f"sends its gradients back to the {dtype} model\n"
            f"{bf16}"
        )
    return (
        f"{ref}.float()   # once, after building the model: this module computes in float32\n"
        f"# and give it x.float(); cast its output back with .to(torch.{dtype}) where needed\n"
        f"{bf16}"
    )


#: names on a line that are modules, not tensors: never the input whose dtype to keep
_NOT_TENSORS = frozenset({"self", "torch", "F", "nn", "math", "np", "numpy"})


def _returned_in(mine: str, code: str | None, op: str, dtype: str) -> str:
    """``mine``, the module's ``return`` line with ``op`` computed on .float() values, cast
    back to the dtype of the tensor ``op`` was given, so the module still returns ``dtype``
    (as Llama's RMSNorm does): ``return x * torch.rsqrt(x.float().pow(2).mean(-1)) * w`` ->
    ``return (x * torch.rsqrt(x.float().pow(2).mean(-1)) * w).to(x.dtype)``. ``mine`` as
    it is for a line that is not a ``return`` or when no tensor name is found.

    >>> _returned_in("return x.float().pow(2).mean(-1)", "return x.pow(2).mean(-1)", "pow",
    ...              "float16")
    'return (x.float().pow(2).mean(-1)).to(x.dtype)'
    """
    if dtype not in ("float16", "bfloat16"):
        return mine
    try:
        tree = ast.parse(mine)
    except (SyntaxError, ValueError):
        return mine
    ret = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(ret, ast.Return) or ret.value is None:
        return mine
    given: list[str] = []

    def keep(e: str) -> str:
        given.append(e)
        return e

    rewrite_call(code, [op], keep)
    plain = (code or "").split("  #", 1)[0].strip().removeprefix("return").strip()
    for expr in [*given[:1], plain]:  # the op's operand, else the whole returned value
        try:
            node = ast.parse(expr, mode="eval")
        except (SyntaxError, ValueError):
            continue
        names = [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
        name = next((n for n in names if n not in _NOT_TENSORS), None)
        if name is not None:
            value = ast.get_source_segment(mine, ret.value) or ast.unparse(ret.value)
            return f"return ({value}).to({name}.dtype)"
    return mine


def _tree_cast(tree: str, dtype: str) -> str:
    """Code casting every floating tensor of ``tree`` -- a module's args or output, with
    tensors nested in tuples, lists and dicts (an (h, c) state) -- to ``dtype``."""
    return (
        f"torch.utils._pytree.tree_map(lambda a: a.to(torch.{dtype}) if torch.is_tensor(a) "
        f"and a.is_floating_point() else a, {tree})"
    )


#: ops whose result is bounded whatever their inputs (normalizations, attention): an inf
#: they make comes from an intermediate, and their float32 result fits the dtype again
_BOUNDED_RESULT = frozenset(
    {
        "native_layer_norm",
        "layer_norm",
        "native_group_norm",
        "group_norm",
        "rms_norm",
        "_fused_rms_norm",
        "cosine_similarity",
        "normalize",
        "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    }
)


def _summed_count(name: str, ev: OpEvent) -> int | None:
    """How many values a forward sum added into each of its results (its input's size over
    its output's); None for another op or sizes not measured."""
    x = first_input(ev)
    if ev.phase is not Phase.FORWARD or name.rstrip("_") not in ("sum", "nansum") or x is None:
        return None
    out = ev.output.numel
    return x.numel // out if out and x.numel >= 2 * out else None


def _true_result(name: str, ev: OpEvent) -> float:
    """The largest |result| a forward op's inputs allow in exact arithmetic, from each
    input's largest |x|: |a|·|b| for mul, |a| + |alpha|·|b| for add and sub, |x|² for
    square, |x|^e for pow by a number; NaN when unknown (another op, an input not kept)."""
    if ev.phase is not Phase.FORWARD:
        return math.nan
    op = name.rstrip("_")
    mags = [s.magnitude for _, s in ev.inputs if s is not None]
    for key in ("other", "self"):
        v = ev.scalars.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and len(mags) == 1:
            mags.append(abs(float(v)))
    if not mags or any(not math.isfinite(m) for m in mags):
        return math.nan
    alpha = ev.scalars.get("alpha", 1)
    try:
        if op in ("mul", "multiply") and len(mags) == 2:
            return mags[0] * mags[1]
        if op in ("add", "sub", "subtract", "rsub") and len(mags) == 2:
            if not isinstance(alpha, (int, float)):
                return math.nan
            return mags[0] + abs(float(alpha)) * mags[1]
        if op == "square" and len(mags) == 1:
            return mags[0] ** 2
        e = ev.scalars.get("exponent")
        if op == "pow" and len(mags) == 1 and isinstance(e, (int, float)) and e > 0:
            return math.pow(mags[0], float(e))
    except OverflowError:
        return math.inf
    return math.nan


#: the Python operator of an elementwise op: ``a * b`` runs aten.mul
_OPERATORS: dict[str, type[ast.operator]] = {
    "mul": ast.Mult,
    "multiply": ast.Mult,
    "add": ast.Add,
    "sub": ast.Sub,
    "subtract": ast.Sub,
    "rsub": ast.Sub,
    "div": ast.Div,
    "true_divide": ast.Div,
    "divide": ast.Div,
    "pow": ast.Pow,
}


def _upcast_operands(code: str | None, op: str, *, number_side: str | None = None) -> str | None:
    """The user's line with the operands of its ``op`` operators (``*`` for mul) cast to
    float32: an operand that holds another such operator keeps its form (its inner operands
    are cast), a number is left as it is. None for a line without that operator, an
    in-place one (``x *= y``) or a line that does not parse. ``number_side``: ``"left"`` or
    ``"right"``, the operand the op got as a Python number (a ``tau`` bound to a float: no
    ``.float()`` method), left as it is when the line holds one such operator.

    >>> _upcast_operands("var = (x * x).mean(-1) - mu * mu  # E[x^2] - E[x]^2", "mul")
    'var = (x.float() * x.float()).mean(-1) - mu.float() * mu.float()'
    """
    kind = _OPERATORS.get(op)
    if not code or kind is None:
        return None
    line = code.split("  #", 1)[0].strip()
    if not line.isascii():  # ast offsets are in bytes
        return None
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None
    if len(tree.body) != 1 or isinstance(tree.body[0], ast.AugAssign):
        return None
    ops = [n for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, kind)]

    def holds_op(node: ast.expr) -> bool:
        return any(n in ops for n in ast.walk(node))

    python_number: set[int] = set()
    if number_side is not None and len(ops) == 1:
        python_number.add(id(ops[0].left if number_side == "left" else ops[0].right))

    def number(node: ast.expr) -> bool:
        if isinstance(node, ast.UnaryOp):
            node = node.operand
        return isinstance(node, ast.Constant) and isinstance(node.value, (int, float))

    spans = sorted(
        {
            (n.col_offset, n.end_col_offset)
            for b in ops
            for n in (b.left, b.right)
            if not holds_op(n)
            and not number(n)
            and id(n) not in python_number
            and n.end_col_offset is not None
            and not _is_float32(line[n.col_offset : n.end_col_offset])
        },
        reverse=True,
    )
    if not spans:
        return None
    for begin, end in spans:
        line = f"{line[:begin]}{paren(line[begin:end])}.float(){line[end:]}"
    return line


def _floor_number_divisor(
    code: str | None,
    operands: tuple[float, ...],
    lim: DtypeLimits,
    *,
    was: str,
    dtype: str,
    number: float | None,
) -> str | None:
    """``y = x / max(tau, 1e-3)`` for ``y = x / tau``: a division by a Python number (an
    annealed temperature) whose quotient passed the dtype's max. The floor is the smallest
    power of ten at least 4 times max|x| / max (room for larger numerators than this
    step's). When the line holds not exactly one ``/`` (the division is inside a library
    call given the number), a comment with the number and the floor; None when neither
    the numerator nor the number is known."""
    top = max((m for m in operands if math.isfinite(m)), default=math.nan)
    if not top > 0:
        return None
    floor = 10.0 ** math.ceil(math.log10(4 * top / lim.max))
    need = fmt(top / lim.max)
    right = _single_divisor(code)
    if right is None or code is None:
        if number is None or not math.isfinite(number) or number == 0:
            return None
        return (
            f"# the op divided values up to {fmt(top)} by the Python number {fmt(number)}: "
            f"the quotient passes {fmt(lim.max)}, {dtype}'s largest value, once that number is "
            f"below {need}; floor it at {floor:g} where it is computed or passed "
            f"(max(value, {floor:g})), or end its schedule above that"
        )
    line = code.split("  #", 1)[0].strip()
    begin, end = right
    text = line[begin:end]
    new = f"{line[:begin]}max({text}, {floor:g}){line[end:]}"
    return (
        f"{new}{was}\n# {text} is a Python number: divided into values up to {fmt(top)}, the "
        f"quotient passes {fmt(lim.max)} ({dtype}'s largest value) once {text} < {need}; a "
        f"floor of {floor:g} keeps it below (or end the schedule above it)"
    )


def _single_divisor(code: str | None) -> tuple[int, int] | None:
    """The span of the divisor of the one ``/`` of ``code`` (a one-statement line), when it
    is not a literal; None otherwise."""
    if not code:
        return None
    line = code.split("  #", 1)[0].strip()
    if not line.isascii():
        return None
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None
    divs = [n for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)]
    if len(divs) != 1 or isinstance(divs[0].right, ast.Constant):
        return None
    right = divs[0].right
    if right.end_col_offset is None:
        return None
    return right.col_offset, right.end_col_offset


def _as_float(value: object) -> float | None:
    """A recorded scalar argument as a float (None for a string or a missing one)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _mean_by_hand(code: str | None, dtype: str, big: float, *, was: str) -> str | None:
    """The fix for a low-precision sum that overflowed on a line dividing it by a number
    (``h.sum(1) / x.shape[1]``, a mean by hand): torch's mean, which accumulates in float32
    and returns the input's dtype, or the sum in float32 cast back after the division. None
    when the line does not divide a ``.sum(...)`` / ``torch.sum(...)`` call.

    >>> _mean_by_hand("p = h.sum(1) / n", "float16", 70.0, was="").splitlines()[0]
    'p = h.mean(1)'
    """
    line = code.split("  #", 1)[0].strip() if code else ""
    if not line or not line.isascii():
        return None
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)):
            continue
        call = node.left
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
            continue
        if call.func.attr != "sum" or call.keywords:
            continue
        recv = call.func.value
        if isinstance(recv, ast.Name) and recv.id == "torch":  # torch.sum(h, 1)
            if not call.args:
                continue
            base, dims = call.args[0], call.args[1:]
        else:
            base, dims = recv, call.args
        seg = ast.get_source_segment
        b, d = seg(line, base), seg(line, node.right)
        args = ", ".join(seg(line, a) or "" for a in dims)
        whole, summed = seg(line, node), seg(line, call)
        if not b or not d or not whole or not summed:
            continue
        mean = f"{paren(b)}.mean({args})"
        cast = f"({paren(b)}.float().sum({args}) / {d}).to(torch.{dtype})"
        # the division's text: keep what the line does around it
        start = line.index(whole)
        new = line[:start] + mean + line[start + len(whole) :]
        alt = line[:start] + cast + line[start + len(whole) :]
        return (
            f"{new}{was}\n"
            f"# when {d} is the count of the values summed: torch.mean adds them in float32 and "
            f"returns {dtype}; a mean of values up to {fmt(big)} fits {dtype}\n"
            f"# or, whatever {d} is: {alt}   # the sum in float32, cast back after the "
            "division, where its value fits"
        )
    return None


def _cast_model(
    ctx: RuleContext, path: str, dtype: str, lim: DtypeLimits, device: str
) -> tuple[str, str] | None:
    """(a sentence for the explanation, the fix) for a low-precision product that
    overflowed inside a layer whose forward is library code (``nn.Linear``, a
    transformers layer) multiplying by its own weights of that dtype, no autocast: the
    whole model was cast (``model.half()``), and no line of the user's computes the
    product. The fix is the model's dtype (bfloat16 has float32's range), or the float32
    modules its root model declares (transformers' ``_keep_in_fp32_modules``, which
    ``from_pretrained(..., dtype=torch.float16)`` honours and ``model.half()`` does not).
    None when the module's facts are unknown or do not show it."""
    known = ctx.facts.get("module_precision")
    try:
        facts = known[path] if known is not None else None
    except Exception:  # a fact that cannot be read leaves the generic fix
        return None
    if not facts or not facts.get("library") or facts.get("dtypes") != [dtype]:
        return None
    if not lim.short_range:
        return None
    ref = module_ref(path)
    kind = facts.get("type") or "layer"
    top = fmt(lim.max)
    said = (
        f"Here the product runs in {ref}'s forward ({kind}: library code, no line of yours) "
        f"with its own {dtype} weights and no autocast: the model's weights were cast to "
        f"{dtype} (model.half(), .to(torch.{dtype}))."
    )
    bf16 = (
        f"model.to(torch.bfloat16)   # instead of casting to {dtype}: float32's range "
        "(3.4e38) in 16 bits"
    )
    amp = (
        "# or keep the weights in float32 and run the forward under "
        f"torch.autocast(device_type={device}, dtype=torch.bfloat16)"
    )
    keep = facts.get("keep")
    if isinstance(keep, (tuple, list)) and len(keep) == 2:
        root, entry = keep
        said += (
            f" {root} declares '{entry}' must stay float32 (its _keep_in_fp32_modules): "
            f"from_pretrained(..., dtype=torch.{dtype}) keeps it there, model.half() does not."
        )
        return said, (
            f"for name, module in model.named_modules():   # after the cast: {root} keeps "
            f"'{entry}' in float32, as from_pretrained(..., dtype=torch.{dtype}) leaves it\n"
            f'    if ".{entry}." in f".{{name}}.":\n'
            "        module.float()\n"
            f"# or load it so: {root}.from_pretrained(..., dtype=torch.{dtype})\n"
            f"# or {bf16}"
        )
    return said, (
        f"{bf16}\n"
        f"# {ref} is {kind}: its {dtype} product has no room past {top}, and its forward is "
        "not yours to upcast\n"
        f"{amp}"
    )


def _assigned(line: str) -> str | None:
    """The plain name a one-statement line assigns (``var`` of ``var = ...``), else None."""
    try:
        tree = ast.parse(line.strip())
    except SyntaxError:
        return None
    stmt = tree.body[0] if len(tree.body) == 1 else None
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target = stmt.targets[0]
        if isinstance(target, ast.Name):
            return target.id
    return None


def _fix_matmul(
    code: str | None,
    dtype: str,
    *,
    device: str,
    ref: str,
    loss: bool,
    autocast: bool,
    operands: Sequence[float] = (),
    top: float = math.inf,
    source: str | None = None,
) -> str:
    """A low-precision product that overflowed: scale an operand first when the product is
    a similarity (``q @ k.transpose(-1, -2)``: attention scores), which fixes it in any
    dtype; else compute it in float32 and keep the result there until it is bounded again.
    ``operands``: each operand's largest |x|; ``top``: the dtype's largest value. When
    |a|max·|b|max alone passes ``top``, scaled scores pass it too (two rows alike in
    direction score |a|·|b|·sqrt(d) after the 1/sqrt(d)): no pre-scaling then."""
    plain = code.split("#", 1)[0].strip() if code else ""
    was = f"  # was: {plain}" if plain else ""
    bf16 = f"# or train in bfloat16: torch.autocast(device_type={device}, dtype=torch.bfloat16)"
    if _integer_codes(operands):
        # integer codes (int8 GEMM emulation): bfloat16's 8-bit mantissa rounds their sums
        bf16 = (
            f"# not bfloat16: operands up to {fmt(operands[0])} and {fmt(operands[1])} look "
            "like integer codes, and bfloat16 holds integers exactly only up to 256 (float32: "
            "up to 2**24)"
        )
    prescaled = None if loss else _prescaled(code, source)
    scaled = prescaled[0] if prescaled is not None else None
    pair = operands[0] * operands[1] if len(operands) == 2 else math.nan
    too_big = scaled is not None and math.isfinite(pair) and pair > top
    if prescaled is not None and not too_big:
        later = prescaled[1]
        return (
            f"{prescaled[0]}{was}\n"
            + (f"{later}\n" if later else "")
            + "# scale before the product, not after it: the result is the same, and its sums "
            f"stay in {dtype}'s range\n" + bf16
        )
    why = (
        f"# scaling by 1/sqrt(d) is not enough: inputs up to {fmt(operands[0])} and "
        f"{fmt(operands[1])}, and {fmt(operands[0])} x {fmt(operands[1])} = {fmt(pair)} "
        f"already passes {dtype}'s {fmt(top)} (rows alike in direction score that times "
        "sqrt(d), even scaled); float32 holds these scores\n"
        if too_big
        else ""
    )
    qk = (
        "# or bound q and k where they are made (QK-norm): q, k = self.q_norm(q), "
        "self.k_norm(k), with self.q_norm = nn.LayerNorm(head_dim) (and k_norm) in __init__\n"
        if too_big
        else ""
    )
    mine = _upcast_matmul(code)
    keep = (
        f"# the result is float32: keep what follows in float32 until the values are bounded "
        f"again (a softmax, a norm, a sin/cos), then cast with .to(torch.{dtype})"
    )
    if mine is not None:
        name = _assigned(mine)
        after = None if loss or name is None else _bounded_after(source, name, dtype)
        if after is not None:  # the later line that bounds it again, cast back there
            line, ops = after
            body = (
                f"{mine}{was}\n{line}   # {' and '.join(ops)} bound the values again (|x| <= 1): "
                f"back to {dtype} for the {dtype} layers after"
            )
            keep = ""
            if {"sin", "cos"} & set(ops) and len(operands) == 2 and max(operands) > 10:
                keep = (
                    f"# Fourier features: inputs up to {fmt(max(operands))}. Coordinates are "
                    "usually normalized to [0, 1] first (pixel indices divided by the image "
                    "size); the projection's scale then sets the frequencies"
                )
        else:
            body = mine + was
            if not loss:  # the cast back belongs on the user's code, not only in a comment
                body += (
                    f"   # float32 from here: cast back with .to(torch.{dtype}) after the op that "
                    f"bounds it again (a softmax, a norm, a sin/cos), before a {dtype} layer"
                )
                keep = ""
        if autocast:
            body = f"with torch.autocast(device_type={device}, enabled=False):\n    {body}"
        return f"{body}\n{why}{keep}{chr(10) if keep else ''}{qk}{bf16}"
    where = "in the loss code" if loss else f"in {ref}'s forward"
    return f"# {where}: compute this product on .float() operands{was}\n{why}{keep}\n{qk}{bf16}"


#: calls whose result is bounded whatever their input: the place to cast back down
_BOUNDING = ("sin", "cos", "tanh", "sigmoid", "softmax")


def _following_lines(source: str | None, reach: int = 20) -> Iterator[tuple[int, str]]:
    """The lines after ``source`` (``file.py:42``) in its block, as (line number, the line
    stripped of its trailing comment), for at most ``reach`` lines: blank and comment lines
    are skipped; a line indented less than ``source``'s, or a ``def``, ends them."""
    import linecache

    path, _, num = (source or "").rpartition(":")
    if not path or not num.isdigit():
        return
    here = linecache.getline(path, int(num))
    indent = len(here) - len(here.lstrip())
    for n in range(int(num) + 1, int(num) + reach):
        text = linecache.getline(path, n)
        if not text:
            return
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        if len(text) - len(text.lstrip()) < indent or re.match(r"\s*(?:async\s+)?def\s", text):
            return  # the function ended
        yield n, text.split("  #", 1)[0].strip()


def _bounded_after(source: str | None, name: str, dtype: str) -> tuple[str, list[str]] | None:
    """The first later line of the same function (read from ``source``, ``file.py:42``)
    that passes ``name`` through a bounded call (``torch.sin(proj)``, ``proj.softmax(-1)``),
    with each such call cast back to ``dtype``; and the calls' names. None when none does."""
    alt = "|".join(_BOUNDING)
    arg = r"(?:\s*,[^()]*(?:\([^()]*\)[^()]*)*)?"
    calls = re.compile(
        rf"(?<![\w.])(?:torch\.|F\.)({alt})\(\s*{re.escape(name)}\s*{arg}\)"
        rf"|(?<![\w.]){re.escape(name)}\.({alt})\([^()]*\)"
    )
    for _, line in _following_lines(source):
        ops = [m.group(1) or m.group(2) for m in calls.finditer(line)]
        if ops:
            new = calls.sub(lambda m: f"{m.group(0)}.to(torch.{dtype})", line)
            return new, list(dict.fromkeys(ops))
        if re.search(rf"(?<![\w.]){re.escape(name)}\b", line):
            return None  # used unbounded first: the result stays float32 there
    return None


_TRANSPOSED = re.compile(
    r"\.(?:transpose\(\s*-1\s*,\s*-2\s*\)|transpose\(\s*-2\s*,\s*-1\s*\)|mT|T|t\(\))$"
)
#: a divisor that is a square root: ``math.sqrt(d)``, ``d ** 0.5``, ``self.scale`` is not
_SQRT = re.compile(r"^(?:(?:math|torch|np|numpy)\.)?sqrt\(.*\)$|\*\*\s*\(?0?\.5\)?$")


def _divisor_moved(line: str) -> str | None:
    """``s = (q @ k.transpose(-1, -2)) / math.sqrt(d)`` with the division moved onto the
    left operand, before the product: ``s = (q / math.sqrt(d)) @ k.transpose(-1, -2)``;
    None for a line without a square-root division of such a product.

    >>> _divisor_moved("s = (q @ k.transpose(-1, -2)) / math.sqrt(self.d)")
    's = (q / math.sqrt(self.d)) @ k.transpose(-1, -2)'
    """
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None
    raw = line.encode()

    def at(n: int) -> int:
        return len(raw[:n].decode())

    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Div)
            and isinstance(node.left, ast.BinOp)
            and isinstance(node.left.op, ast.MatMult)
            and node.end_col_offset is not None
        ):
            continue
        a = ast.get_source_segment(line, node.left.left)
        b = ast.get_source_segment(line, node.left.right)
        d = ast.get_source_segment(line, node.right)
        if a is None or b is None or d is None or not _TRANSPOSED.search(b):
            continue
        if not _SQRT.search(d.strip()):
            continue
        new = f"({paren(a)} / {d}) @ {b}"
        return line[: at(node.col_offset)] + new + line[at(node.end_col_offset) :]
    return None


#: largest |x| of a model input that is plainly raw data, not features scaled for a network
_RAW_INPUT = 1e3


def _raw_input(ctx: RuleContext, lim: DtypeLimits) -> Record | None:
    """A floating input of a root module (not a loss) holding values past both
    :data:`_RAW_INPUT` and 1/1000 of the dtype's max: raw features (dollars, pixel counts)
    a low-precision forward cannot carry; None for bfloat16 and wider (float32's range)."""
    if not lim.short_range:
        return None
    roots = {c.id for c in ctx.trace.calls if c.root and not c.is_loss}
    bar = max(_RAW_INPUT, lim.max / 1e3)
    return next(
        (
            r
            for r in ctx.trace.records
            if r.phase is Phase.INPUT
            and r.call in roots
            and r.dtype.startswith(("float", "bfloat"))
            and r.stat is not None
            and math.isfinite(r.stat.magnitude)
            and r.stat.magnitude >= bar
        ),
        None,
    )


def _fix_raw_input(raw: Record, dtype: str, device: str) -> str:
    """Scale the model's input features, instead of clamping inside the model."""
    big = fmt(raw.stat.magnitude) if raw.stat is not None else "raw values"
    return (
        f"# scale the input features before they reach {raw.path} (values up to {big}): "
        "standardize each column with the training set's mean and std, (x - mean) / std, "
        "or log1p / quantile-transform heavy-tailed amounts\n"
        f"# a clamp to {dtype}'s range only moves the overflow to the next op\n"
        f"# or train in bfloat16 (float32's range): torch.autocast(device_type={device}, "
        "dtype=torch.bfloat16)"
    )


def _integer_codes(operands: Sequence[float]) -> bool:
    """Two operands whose largest |x| are the ends of signed integer codes (127 or 128 of
    int8, 7 or 8 of int4, 2**(b-1) - 1 or 2**(b-1)): a quantized GEMM kept in a float dtype,
    whose sums must stay exact integers, past bfloat16's 256."""
    if len(operands) != 2 or not all(math.isfinite(m) and m >= 7 for m in operands):
        return False
    ends = all(any(m in (2**b, 2**b - 1) for b in range(3, 17)) for m in operands)
    return ends and operands[0] * operands[1] > 256


def _prescaled(code: str | None, source: str | None) -> tuple[str, str | None] | None:
    """The user's product line with the factor its result is scaled by moved before the
    product, and what becomes of the later line that applied it (None: the line's own
    division moved); None when the code never scales the product (an int8 GEMM rescaled
    by ``acc.float() * s``, a bare ``q @ k^T``): pre-scaling would change what it computes."""
    line = code.split("  #", 1)[0].rstrip() if code else ""
    moved = _divisor_moved(line.strip()) if line else None
    if moved is not None:
        return moved, None
    name = _assigned(line)
    later = _later_scale(source, name) if name else None
    if later is None:
        return None
    sign, factor, after = later
    for begin, end, start, _ in _matmuls(line):
        left = line[begin : end + 1]
        new = f"({paren(left)} {sign} {paren(factor)})"
        fixed = f"{line[:begin]}{new} {line[end + 1 : start].strip()} {line[start:]}"
        return fixed.strip(), after
    return None


def _later_scale(source: str | None, name: str) -> tuple[str, str, str] | None:
    """The first later line of the same function that uses ``name`` (read from ``source``,
    ``file.py:42``), when it divides or multiplies ``name`` itself by a factor
    (``s = s / math.sqrt(d)``, ``s *= self.scale``, ``softmax(s * scale)``): the operator,
    the factor's text, and what to do with that line once the factor moved before the
    product. None when the first use of ``name`` is anything else."""
    for n, line in _following_lines(source):
        if not re.search(rf"(?<![\w.]){re.escape(name)}\b", line):
            continue
        try:
            tree = ast.parse(line)
        except SyntaxError:
            return None
        ops = {ast.Div: "/", ast.Mult: "*"}
        stmt = tree.body[0] if len(tree.body) == 1 else None
        if (
            isinstance(stmt, ast.AugAssign)
            and isinstance(stmt.target, ast.Name)
            and stmt.target.id == name
            and type(stmt.op) in ops
        ):
            factor = ast.get_source_segment(line, stmt.value)
            if factor is None:
                return None
            return ops[type(stmt.op)], factor, f"# and delete line {n} ({line}): the factor moved"
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.BinOp)
                and type(node.op) in ops
                and isinstance(node.left, ast.Name)
                and node.left.id == name
            ):
                factor = ast.get_source_segment(line, node.right)
                whole = ast.get_source_segment(line, node)
                if factor is None or whole is None or name in identifiers(factor):
                    return None
                rest = line.replace(whole, name, 1)
                if re.fullmatch(rf"{re.escape(name)}\s*=\s*\(?{re.escape(name)}\)?", rest):
                    return (
                        ops[type(node.op)],
                        factor,
                        (f"# and delete line {n} ({line}): the factor moved"),
                    )
                return ops[type(node.op)], factor, f"{rest}  # was: {line}"
        return None  # used first in some other way: nothing to move
    return None


def _scaled_scores(code: str | None) -> str | None:
    """The user's ``a @ b.transpose(-1, -2)`` (or ``b.mT``, ``b.T``, ``b.t()``) with ``a``
    scaled by ``a.shape[-1] ** -0.5`` before the product; None for other lines.

    >>> _scaled_scores("s = q @ k.transpose(-1, -2)")
    's = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)'
    """
    if not code:
        return None
    line = code.split("  #", 1)[0].rstrip()
    moved = _divisor_moved(line.strip())
    if moved is not None:
        return moved
    for begin, end, start, stop in _matmuls(line):
        right = line[start:stop]
        if not _TRANSPOSED.search(right):
            continue
        left = line[begin : end + 1]
        new = f"({left} * {paren(left)}.shape[-1] ** -0.5)"
        return f"{line[:begin]}{new} {line[end + 1 : start].strip()} {line[start:]}"
    return None


_CAST_CALL = re.compile(r"\.(?:to|type|half|bfloat16)\(")


def _cast_receiver(line: str) -> tuple[int, int] | None:
    """Where the tensor cast by the line's first ``.to(...)`` / ``.half()`` starts and ends."""
    for m in _CAST_CALL.finditer(line):
        begin = postfix_start(line, m.start() - 1) if m.start() > 0 else None
        if begin is not None:
            return begin, m.start()
    return None


def _fix_cast(code: str | None, dtype: str, cast_input: str | None = None) -> str:
    """The user's cast line, its tensor scaled (float8: a per-tensor scale, its largest
    value mapped to the dtype's max) or clamped into the dtype's range; its form kept. A
    line with no cast of its own (autocast casts a module's input) gets the clamp on
    ``cast_input``, the user's expression of the tensor cast, when it is known. A name
    the fix introduces never takes one the line uses."""
    line = code.split("  #", 1)[0].rstrip() if code else ""
    plain = line.strip()
    was = f"  # was: {plain}" if plain else ""
    at = _cast_receiver(plain) if plain else None
    indent = line[: len(line) - len(line.lstrip())]
    taken = identifiers(plain)
    if dtype.startswith("float8"):
        scale = fresh_name("scale", taken)
        if at is None:
            return (
                f"# the tensor cast to {dtype}, scaled first (a per-tensor scale: its largest "
                f"value maps to {dtype}'s max):\n"
                f"# {scale} = t.detach().abs().amax().clamp_min(1e-12) / "
                f"torch.finfo(torch.{dtype}).max, then (t / {scale}).to(torch.{dtype}); "
                f"dequantize with .float() * {scale}"
            )
        recv = plain[at[0] : at[1]]
        return (
            f"{indent}{scale} = {paren(recv)}.detach().abs().amax().clamp_min(1e-12) / "
            f"torch.finfo(torch.{dtype}).max   # per-tensor scale: the largest value maps to "
            f"{dtype}'s max\n"
            f"{indent}{plain[: at[0]]}({paren(recv)} / {scale}){plain[at[1] :]}{was}\n"
            f"# dequantize with .float() * {scale} (pass {scale} on with the float8 tensor)"
        )
    fin = fresh_name("fin", taken)
    if at is None:
        own = _clamped_input(plain, cast_input, f"{fin}.min, {fin}.max")
        if own is None or cast_input is None:
            return (
                f"{fin} = torch.finfo(torch.{dtype})\n"
                f"# clamp the tensor cast to {dtype} into its range before the cast: "
                f".clamp({fin}.min, {fin}.max){f' (on: {plain})' if plain else ''}\n"
                "# or keep this tensor in float32"
            )
        return (
            f"{indent}{fin} = torch.finfo(torch.{dtype})\n"
            f"{indent}{own}{was}\n"
            f"# autocast casts {cast_input} to {dtype}: better, scale it into a small range "
            "where it is made (pixels / 255, standardized features), or keep it in float32"
        )
    recv = plain[at[0] : at[1]]
    return (
        f"{indent}{fin} = torch.finfo(torch.{dtype})\n"
        f"{indent}{plain[: at[0]]}{paren(recv)}.clamp({fin}.min, {fin}.max){plain[at[1] :]}{was}\n"
        "# or keep this tensor in float32"
    )


def _clamped_input(plain: str, expr: str | None, bounds: str) -> str | None:
    """``plain`` with its one occurrence of the argument ``expr`` clamped; None when ``expr``
    is not exactly one call argument of the line."""
    if not plain or not expr:
        return None
    try:
        tree = ast.parse(plain)
    except SyntaxError:
        return None
    raw = plain.encode()
    hits = [
        arg
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for arg in node.args
        if ast.get_source_segment(plain, arg) == expr and arg.end_col_offset is not None
    ]
    if len(hits) != 1 or hits[0].end_col_offset is None:
        return None
    b, e = hits[0].col_offset, hits[0].end_col_offset
    return (raw[:b] + f"{paren(expr)}.clamp({bounds})".encode() + raw[e:]).decode()


def _cast_input(ctx: RuleContext, ev: OpEvent) -> str | None:
    """The user's expression of the tensor a cast took, when it is the input of a watched
    model called on the op's line (autocast casts a float32 input to float16 in the first
    layer): the root call's input record holds the very values the cast took, and the line
    has one call with that many positional arguments (``model(x + delta)``)."""
    x = input_named(ev, "self") or first_input(ev)
    if x is None or not ev.code:
        return None
    trace = ctx.trace
    for r in trace.records:
        if r.phase is not Phase.INPUT or r.stat is None:
            continue
        call = trace.call(r.call)
        if call is None or not call.root or call.is_loss:
            continue
        s = r.stat
        if (s.min, s.max, s.numel) != (x.min, x.max, x.numel):
            continue
        m = re.fullmatch(r"input\[(\d+)\]", r.role or "")
        if m is None:
            continue
        n_in = sum(
            1
            for q in trace.records
            if q.call == r.call and q.phase is Phase.INPUT and (q.role or "").startswith("input[")
        )
        return _call_argument(ev.code, n_in, int(m.group(1)))
    return None


def _call_argument(code: str, n_args: int, index: int) -> str | None:
    """Argument ``index`` of the line's one call with ``n_args`` positional arguments and
    no keywords that is not a torch function (``model(x + delta)`` in ``l = crit(model(x +
    delta), y)``); None when there is not exactly one."""
    for stmt in statements(code):
        try:
            tree = ast.parse(stmt)
        except SyntaxError:
            continue
        found = []
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or node.keywords or len(node.args) != n_args:
                continue
            root = node.func
            while isinstance(root, ast.Attribute):
                root = root.value
            if not isinstance(root, ast.Name) or root.id in ("torch", "F", "nn", "np", "math"):
                continue
            found.append(node)
        if len(found) == 1:
            return ast.get_source_segment(stmt, found[0].args[index])
    return None


def _bounded_exp(
    kind: str,
    name: str,
    lim: DtypeLimits,
    code: str | None,
    *,
    arg: float,
    scalar: bool,
    source: str | None = None,
) -> str | None:
    """The fix of a low-precision exp that a float32 upcast cannot mend: an argument past
    float32's exp bound too (bound the argument; a softmax subtracts its max), or a
    one-value argument (a learned scale), whose float32 result times a tensor of ``lim``'s
    dtype is computed in that dtype again (type promotion)."""
    f32 = _exp_bound("float32")
    plain = code.split("#", 1)[0].strip() if code else ""
    was = f"  # was: {plain}" if plain else ""
    op = name.rstrip("_")
    past = math.isfinite(arg) and arg > f32
    lse = _logsumexp_fix(code) if kind == "softmax" and past and op == "exp" else None
    if lse is not None:
        return lse
    other = _other_dims(code, op, source) if kind == "softmax" and past else None
    if other is not None:
        return f"{_max_subtracted(code, op, over_all=True)}{was}\n{_global_max_note(other)}"
    if kind == "softmax" and past:
        return (
            f"{_max_subtracted(code, op, source=source)}{was}\n"
            f"{_row_max_note(code, op, source)}; the argument reached {fmt(arg)}, past "
            f"float32's exp bound {fmt(f32)} too, so float32 or bfloat16 would still overflow\n"
            f"# or the whole softmax in one call, stable: {_one_call_softmax(code, op, source)}"
        )
    if kind != "exp" or not (past or scalar) or op not in _BARE_EXP:
        return None
    bound = lim.exp_bound / (math.log(2) if op == "exp2" else 1.0)
    cap = math.floor(bound / 2 * 10) / 10
    bounds = f"-{cap}, {cap}" if op in _BOTH_SIDES else f"max={cap}"
    fixed = rewrite_call(code, [op], lambda e: f"{paren(e)}.clamp({bounds})")
    first = fixed if fixed is not None else f"y = torch.{op}(x.clamp({bounds}))"
    why = (
        f"# {cap} = half of {fmt(lim.exp_bound)}: exp stays below sqrt({fmt(lim.max)}) = "
        f"{fmt(math.sqrt(lim.max))}, so a product of two still fits in {lim.name}"
    )
    if past:
        return (
            f"{first}{was}\n{why}\n"
            f"# the argument reached {fmt(arg)}, past float32's exp bound {fmt(f32)} too: "
            "float32 or bfloat16 would overflow as well; bound it"
        )
    return (
        f"{first}{was}\n{why}\n"
        f"# .float() alone does not help: a one-value (0-dim) float32 tensor times a "
        f"{lim.name} tensor is computed in {lim.name}; or compute the whole product in "
        "float32 (.float() on every tensor operand)"
    )


def _call_of(
    node: ast.expr, name: str
) -> tuple[ast.expr, list[ast.expr], list[ast.keyword]] | None:
    """``torch.name(x, *rest)`` or ``x.name(*rest)``: (x, rest, keywords), else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    if node.func.attr != name:
        return None
    base = node.func.value
    if isinstance(base, ast.Name) and base.id == "torch":
        if not node.args:
            return None
        return node.args[0], list(node.args[1:]), list(node.keywords)
    return base, list(node.args), list(node.keywords)


def _logsumexp_line(code: str | None) -> str | None:
    """The user's line with its hand-written ``log(sum(exp(x), dim))`` replaced by
    ``torch.logsumexp(x, dim)``: the same value, with no exp that can overflow. None when
    the line holds no such expression (or is unknown).

    >>> _logsumexp_line("z = torch.log(torch.exp(logits).sum(-1)) ** 2")
    'z = torch.logsumexp(logits, -1) ** 2'
    >>> _logsumexp_line("lse = torch.exp(s).sum(dim=1, keepdim=True).log()  # norm")
    'lse = torch.logsumexp(s, dim=1, keepdim=True)'
    >>> _logsumexp_line("e = torch.exp(x - x.amax(-1, keepdim=True))") is None
    True
    """
    line = code.split("  #", 1)[0].strip() if code else ""
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None
    raw = line.encode()
    for node in ast.walk(tree):
        if not isinstance(node, ast.expr) or node.end_col_offset is None:
            continue
        log = _call_of(node, "log")
        if log is None or log[1] or log[2]:
            continue
        weighted = _weighted_lse(line, log[0])  # log((mask * exp(x)).sum(d))
        if weighted is not None:
            start = len(raw[: node.col_offset].decode())
            end = len(raw[: node.end_col_offset].decode())
            return line[:start] + weighted + line[end:]
        # log(cumsum(exp(x), dim)) -- a Cox risk-set sum -- is torch.logcumsumexp
        total, stable = _call_of(log[0], "sum"), "logsumexp"
        if total is None:
            total, stable = _call_of(log[0], "cumsum"), "logcumsumexp"
        if total is None:
            continue
        exp = _call_of(total[0], "exp")
        if exp is None or exp[1] or exp[2]:
            continue
        arg = ast.get_source_segment(line, exp[0])
        rest = [ast.get_source_segment(line, a) for a in total[1]]
        kws = [
            f"{k.arg}={ast.get_source_segment(line, k.value)}" if k.arg else None for k in total[2]
        ]
        if arg is None or None in rest or None in kws:
            continue
        dims = [*rest, *kws]
        if not any(k.arg == "dim" for k in total[2]) and not rest:
            if stable != "logsumexp":
                continue  # a cumsum always names its dim
            call = f"torch.logsumexp({paren(arg)}.flatten(), 0)"  # a sum over every value
        else:
            call = f"torch.{stable}({', '.join([arg, *(d for d in dims if d)])})"
        start = len(raw[: node.col_offset].decode())
        end = len(raw[: node.end_col_offset].decode())
        return line[:start] + call + line[end:]
    return None


def _logsumexp_fix(code: str | None) -> str | None:
    """The fix of an exp whose row sum goes into a log: torch.logsumexp in its place (a
    softmax's max subtraction would change the value of log(sum(exp)))."""
    fixed = _logsumexp_line(code)
    if fixed is None:
        return None
    plain = code.split("  #", 1)[0].strip() if code else ""
    if "torch.logcumsumexp(" in fixed:
        return (
            f"{fixed}  # was: {plain}\n"
            "# torch.logcumsumexp computes log(cumsum(exp(x))) without overflow (a running "
            "max is subtracted inside and added back): the value is the same. Clamping the exp "
            "instead would change the loss (it becomes unbounded below)"
        )
    return (
        f"{fixed}  # was: {plain}\n"
        "# torch.logsumexp computes log(sum(exp(x))) without overflow (it subtracts the max "
        "inside and adds it back): the value is the same, every exp is at most 1"
    )


def _factors(node: ast.expr) -> list[ast.expr]:
    """The factors of a product ``a * b * c`` (one factor when ``node`` is no product)."""
    return operands(node, ast.Mult)


def _weighted_lse(line: str, node: ast.expr) -> str | None:
    """``torch.logsumexp(x + torch.log(w), dim)`` for ``node``, a weighted sum of one exp
    (``(w * torch.exp(x)[None, :]).sum(1)``, a risk-set or masked sum); None when ``node``
    is no such sum. log(sum(w * exp(x))) = logsumexp(x + log w): a weight 0 (a mask) is
    log 0 = -inf there, which leaves its entry out, and no exp can overflow.

    >>> _weighted_lse("d = (m * torch.exp(r)[None, :]).sum(1)", ast.parse(
    ...     "d = (m * torch.exp(r)[None, :]).sum(1)").body[0].value)
    'torch.logsumexp(r[None, :] + torch.log(m), 1)'
    """
    total = _call_of(node, "sum")
    if total is None or not (total[1] or any(k.arg == "dim" for k in total[2])):
        return None
    factors = _factors(total[0])
    exps: list[tuple[ast.expr, str]] = []
    weights: list[str] = []
    for f in factors:
        sub, inner = "", f
        while isinstance(inner, ast.Subscript):
            seg = ast.get_source_segment(line, inner.slice)
            if seg is None:
                return None
            sub = f"[{seg}]{sub}"
            inner = inner.value
        exp = _call_of(inner, "exp")
        if exp is not None and not exp[1] and not exp[2]:
            exps.append((exp[0], sub))
            continue
        text = ast.get_source_segment(line, f)
        if text is None or "exp" in text:
            return None
        weights.append(text)
    if len(exps) != 1 or not weights:
        return None
    arg = ast.get_source_segment(line, exps[0][0])
    rest = [ast.get_source_segment(line, a) for a in total[1]]
    kws = [f"{k.arg}={ast.get_source_segment(line, k.value)}" for k in total[2] if k.arg]
    if arg is None or None in rest:
        return None
    shifted = " + ".join([f"{paren(arg)}{exps[0][1]}", *(f"torch.log({w})" for w in weights)])
    return f"torch.logsumexp({', '.join([shifted, *(r for r in rest if r), *kws])})"


def _weighted_lse_fix(code: str | None, norm: _Normalized) -> str | None:
    """An exp line that assigns a weighted sum of exps (``denom = (at_risk *
    torch.exp(risk)[None, :]).sum(1)``) whose log a later line takes: the log of that sum
    computed by torch.logsumexp, named ``log_<name>``, to use in place of the log."""
    line = code.split("  #", 1)[0].strip() if code else ""
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assign):
        return None
    stmt = tree.body[0]
    if len(stmt.targets) != 1 or not isinstance(stmt.targets[0], ast.Name):
        return None
    name = stmt.targets[0].id
    lse = _weighted_lse(line, stmt.value)
    if lse is None:
        return None
    return (
        f"log_{name} = {lse}  # was: {line}\n"
        f"# then use log_{name} where {norm.source} takes torch.log({name}): {norm.code}\n"
        f"# log(sum(w * exp(x))) = logsumexp(x + log(w)): the same value with no exp that "
        "can overflow; a weight 0 (a mask) is log(0) = -inf there, which leaves its entry out. "
        "Clamping the exp or subtracting a max would change the loss"
    )


def _exp_args(code: str | None, op: str) -> list[str]:
    """The argument of every call to ``op`` on the user's line, in order."""
    got: list[str] = []

    def keep(e: str) -> str:
        got.append(e)
        return e

    _rewrite_calls(code, op, keep)
    return got


def _same_expr(a: str, b: str) -> bool:
    """Two source texts of one expression (``-K*u`` and ``-K * u``)."""
    try:
        return ast.dump(ast.parse(a.strip(), mode="eval")) == ast.dump(
            ast.parse(b.strip(), mode="eval")
        )
    except SyntaxError:
        return a.strip() == b.strip()


def _summed_dim(code: str | None, op: str) -> str | None:
    """The dim of the line's sum over an ``op`` call (``torch.exp(b).sum(dim=2)`` -> ``2``;
    ``torch.sum(torch.exp(b), -1)`` -> ``-1``), "" for a sum over every value, None when the
    line sums no such call: the dim a softmax by hand normalizes over."""
    line = code.split("  #", 1)[0].strip() if code else ""
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        total = _call_of(node, "sum") if isinstance(node, ast.expr) else None
        if total is None:
            continue
        if not any(isinstance(m, ast.expr) and _call_of(m, op) for m in ast.walk(total[0])):
            continue
        dims = [*total[1][:1], *(k.value for k in total[2] if k.arg == "dim")]
        if not dims:
            return ""
        return ast.get_source_segment(line, dims[0])
    return None


def _norm_dim(code: str | None, op: str, source: str | None) -> tuple[str | None, str]:
    """The dim a softmax by hand normalizes the ``op`` result over, and where it was read:
    ``("2", "line")`` from the line's own sum over the exp (:func:`_summed_dim`),
    ``("1", "later")`` from the one sum a later line divides the result by
    (:func:`_later_norm_dims`; not when the line transposes the result), ``(None, "")``
    when neither shows it. ``""`` is a sum over every value."""
    args = _exp_args(code, op)
    if not args or not all(_same_expr(a, args[0]) for a in args):
        return None, ""
    dim = _summed_dim(code, op)
    if dim is not None:
        return dim, "line"
    if op == "exp" and source and not _exp_transposed(code, op):
        later = _later_norm_dims(source, code)
        if len(later) == 1 and "?" not in later[0]:
            return later[0], "later"
    return None, ""


def _max_subtracted(
    code: str | None, op: str, *, over_all: bool = False, source: str | None = None
) -> str:
    """The user's exp line with the row max subtracted from the argument (a stable
    softmax by hand), or the same on a named placeholder when the line is unknown. Every
    exp of the same argument is shifted by the same max (the numerator's and the sum's:
    shifting one alone changes the ratio), over the dim the line's sum runs over, or else
    the dim a later line normalizes the result over (read from ``source``, :func:`_norm_dim`).

    >>> _max_subtracted("e = torch.exp(scores)", "exp")
    'e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))'
    >>> _max_subtracted("e = (q @ k).exp()  # scores", "exp")
    'e = ((q @ k) - (q @ k).amax(dim=-1, keepdim=True)).exp()'
    >>> _max_subtracted("c = torch.exp(b) / torch.exp(b).sum(2)", "exp").count(
    ...     "torch.exp(b - b.amax(dim=2, keepdim=True))")
    2
    """
    line = code.split("  #", 1)[0] if code else ""
    args = _exp_args(code, op)
    same = bool(args) and all(_same_expr(a, args[0]) for a in args)
    dim = "" if over_all else _norm_dim(code, op, source)[0] if same else None
    method = re.search(rf"(?<!\btorch)(?<!\bspecial)\.{re.escape(op)}\(", line) is not None

    def wrap(e: str) -> str:
        top = (
            f"{paren(e)}.max()" if dim == "" else f"{paren(e)}.amax(dim={dim or -1}, keepdim=True)"
        )
        shifted = f"{paren(e)} - {top}"
        return f"({shifted})" if method else shifted

    fixed = _rewrite_calls(code, op, wrap) if same else rewrite_call(code, [op], wrap)
    if fixed is not None:
        return fixed
    if over_all:
        return f"e = torch.{op}(x - x.max())   # x: this exp's argument"
    return f"e = torch.{op}(x - x.amax(dim=-1, keepdim=True))   # x: this exp's argument"


def _row_max_note(code: str | None, op: str, source: str | None = None) -> str:
    """What the max subtraction of :func:`_max_subtracted` subtracts, in words: the
    result is unchanged only where the normalization's dim was read."""
    args = _exp_args(code, op)
    dim, where = _norm_dim(code, op, source)
    if dim is not None:
        over = "every value" if dim == "" else f"dim={dim}"
        whose = "the line's sum" if where == "line" else "the sum a later line divides by"
        shifted = f"every exp of {args[0].strip()}" if len(args) > 1 else args[0].strip()
        return (
            f"# {shifted} is shifted by its max over {over}, the dim {whose} runs over: "
            "each exp is then at most 1, and the ratio is the same"
        )
    return (
        "# dim=-1 is a guess (no sum of this exp was found to read it from): use the dim "
        "whose sum you divide by. Only a ratio to a sum over that same dim is unchanged "
        "by the shift; any other use of the exp is scaled by exp(-max)"
    )


def _one_call_softmax(code: str | None, op: str, source: str | None = None) -> str:
    """``torch.softmax(b, dim=2)`` for a line ``exp(b) / exp(b).sum(dim=2, ...)`` (or an
    exp a later line divides by its sum over dim=2), else the generic
    ``torch.softmax(x, dim=-1)``."""
    args = _exp_args(code, op) if op == "exp" else []
    dim, where = _norm_dim(code, op, source) if args else (None, "")
    if len(args) == 1 and where != "later":
        dim = None  # a line that sums its one exp is no softmax in one call
    if dim and not dim.startswith(("(", "[")):
        return f"torch.softmax({args[0].strip()}, dim={dim})"
    return "torch.softmax(x, dim=-1)"


#: calls and attributes that swap a tensor's dims: a max over the argument's last dim is
#: then over another dim of the result than the one a later line normalizes over
_SWAPPING_CALLS = frozenset({"t", "transpose", "permute", "swapaxes", "swapdims", "movedim"})
_SWAPPED_ATTRS = frozenset({"T", "mT", "H", "mH"})


def _exp_transposed(code: str | None, op: str) -> bool:
    """The user's line transposes what its ``op`` call made (``torch.exp(x).t()``)."""
    line = code.split("  #", 1)[0].strip() if code else ""
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            inner = node.func.value if node.func.attr in _SWAPPING_CALLS else None
        elif isinstance(node, ast.Attribute) and node.attr in _SWAPPED_ATTRS:
            inner = node.value
        else:
            inner = None
        if inner is not None and any(
            isinstance(m, ast.expr) and _call_of(m, op) for m in ast.walk(inner)
        ):
            return True
    return False


def _later_norm_dims(source: str | None, code: str | None, reach: int = 15) -> list[str]:
    """The dims of the sums that later lines of the exp's function divide its result by
    (``Q /= Q.sum(dim=1, keepdim=True)`` -> ``"1"``; ``"" `` for a sum over every value),
    in order and each once: the dims the exp's result is normalized over."""
    import linecache

    path, _, num = (source or "").rpartition(":")
    if not path or not num.isdigit() or not code:
        return []
    here = linecache.getline(path, int(num))
    if not here.strip():
        return []
    derived = {
        name
        for stmt in statements(code)
        if re.search(rf"\b(?:{'|'.join(_EXP_CALLS)})\(", stmt)
        and (name := _assigned(stmt)) is not None
    }
    dims: list[str] = []
    if not derived:
        return dims
    indent = len(here) - len(here.lstrip())
    for _, _, stmt in _later_statements(path, int(num), indent, reach):
        try:
            tree = ast.parse(stmt)
        except SyntaxError:
            continue
        if not _names(tree) & derived:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                below: ast.AST = node.right
            elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Div):
                below = node.value
            else:
                continue
            for m in ast.walk(below):
                total = _call_of(m, "sum") if isinstance(m, ast.expr) else None
                if total is None or not _names(total[0]) & derived:
                    continue
                given = [*total[1][:1], *(k.value for k in total[2] if k.arg == "dim")]
                dim = (ast.get_source_segment(stmt, given[0]) or "?") if given else ""
                if dim not in dims:
                    dims.append(dim)
        target = _assigned(stmt)
        if target is not None:
            derived.add(target)
    return dims


def _other_dims(code: str | None, op: str, source: str | None) -> str | None:
    """How the exp's result is normalized over other dims than a max over its argument's
    last dim (a transpose on the line, sums over several dims: Sinkhorn-Knopp iterations),
    in words; None for a softmax by hand (the line's own sum, or one later sum over the
    same dim) or when no later line shows it. A max subtracted then is no longer divided
    out, and a shifted row whose exps all underflow to 0 divides 0 / 0."""
    if op != "exp" or _summed_dim(code, op) is not None:
        return None
    dims = _later_norm_dims(source, code)
    turned = _exp_transposed(code, op)
    if not turned and len(dims) < 2 and dims != [""]:
        return None
    if turned and dims and set(dims) <= {"0", "-2"}:
        return None
    words = ", ".join("every value" if d == "" else f"dim={d}" for d in dims)
    if turned:
        return "a transpose" + (f", then sums over {words}" if dims else "")
    return f"sums over {words}"


def _global_max_note(other: str) -> str:
    """Why one max over every value, not the row max, is subtracted: ``other`` says how
    the exp's result is normalized (:func:`_other_dims`)."""
    return (
        "# one shift for every value (the max over all of them): a constant factor, which "
        f"the normalization that follows ({other}) divides out; a row max is not divided "
        "out by a normalization over another dim, and changes the result\n"
        "# or stay in the log domain: normalize the argument with torch.logsumexp over each "
        "dim in turn, and take the exp at the end"
    )


def _float32_exp_fix(
    f32: str, was: str, other: str, dtype: str, lim: DtypeLimits, *, arg: float
) -> str:
    """The fix of a low-precision exp whose result is normalized over other dims than a
    row max would be (``other``, :func:`_other_dims`): the exp in float32, as the reference
    implementations of Sinkhorn-Knopp do, not a max subtracted in ``dtype``."""
    floor = -math.log(lim.tiny * lim.eps)  # exp(x) of x below -floor is 0 in dtype
    fits = (
        f"exp({fmt(arg)}) = {fmt(math.exp(arg))} fits float32"
        if math.isfinite(arg) and arg <= _exp_bound("float32")
        else f"float32 holds exp up to {fmt(_exp_bound('float32'))}"
    )
    return (
        f"{f32}{was}\n"
        f"# the exp in float32 ({fits}); keep its result in float32 through the "
        f"normalization that follows ({other}), and cast back to {dtype} only the "
        "normalized values\n"
        f"# not a row max subtracted in {dtype}: that normalization does not divide it "
        f"out, so the result changes, and exps more than {fmt(floor)} below the max "
        f"underflow to 0 in {dtype}: a row of zeros divides 0 / 0 = NaN\n"
        "# or stay in the log domain: normalize the argument with torch.logsumexp over each "
        "dim in turn, and take the exp at the end"
    )


def _float32_exp(code: str | None, op: str) -> str | None:
    """The user's line with every ``op`` call's argument computed in float32 from its first
    tensor operand on (``torch.exp(out.to(DT) / eps)`` -> ``torch.exp(out.to(DT).float()
    / eps)``: type promotion carries float32 through the rest); None when unknown."""

    def up(e: str) -> str:
        try:
            node = ast.parse(e.strip(), mode="eval").body
        except SyntaxError:
            return f"{paren(e)}.float()"
        while True:
            if isinstance(node, ast.BinOp):
                node = node.right if isinstance(node.left, ast.Constant) else node.left
            elif isinstance(node, ast.UnaryOp):
                node = node.operand
            else:
                break
        text = ast.get_source_segment(e.strip(), node)
        if text is None or isinstance(node, ast.Constant) or _is_float32(text):
            return e if text is not None and _is_float32(text) else f"{paren(e)}.float()"
        s, end = e.strip(), node.end_col_offset or 0
        return f"{s[: node.col_offset]}{paren(text)}.float(){s[end:]}"

    line = code.split("  #", 1)[0] if code else ""
    method = re.search(rf"(?<!\btorch)(?<!\bspecial)\.{re.escape(op)}\(", line) is not None
    fixed = _rewrite_calls(code, op, lambda e: paren(up(e)) if method else up(e))
    return fixed.strip() if fixed is not None and fixed.strip() != (code or "").strip() else None


# ------------------------------------------------------------- a softmax over segments

#: ops that sum their source into slots chosen by an index: a segment sum (a graph's
#: per-node neighbour sum); positional (dim, index, source) after the receiver
_SEGMENT_SUMS = frozenset(
    {"index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_"}
)


@dataclass(frozen=True)
class _Segment:
    """The call that sums an exp's result per segment (``torch.zeros(n).index_add_(0, dst,
    w)``): its receiver (what it sums into), dim, index, the call's text and where it is."""

    method: str
    receiver: str
    dim: str
    index: str
    call: str
    source: str


def _segment_call(stmt: str, names: set[str], source: str) -> _Segment | None:
    """The segment sum in ``stmt`` whose source uses one of ``names`` or calls exp."""
    try:
        tree = ast.parse(stmt)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        method = node.func.attr
        if method not in _SEGMENT_SUMS:
            continue
        args = list(node.args)
        owner = ast.unparse(node.func.value)
        if owner == "torch":  # torch.index_add(input, dim, index, source)
            if not args:
                continue
            recv, args = args[0], args[1:]
        else:
            recv = node.func.value
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        keys = ("dim", "index", "source" if method.startswith("index") else "src", "reduce")
        got = [args[i] if i < len(args) else kw.get(k) for i, k in enumerate(keys)]
        dim, index, src, reduce = got
        if dim is None or index is None or src is None:
            continue
        if method.startswith("scatter_reduce") and not (
            isinstance(reduce, ast.Constant) and reduce.value in ("sum", "mean")
        ):
            continue
        used = {n.id for n in ast.walk(src) if isinstance(n, ast.Name)}
        calls = any(
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr in _EXP_CALLS
            for n in ast.walk(src)
        )
        if not (used & names or calls):
            continue
        return _Segment(
            method=method,
            receiver=ast.unparse(recv),
            dim=ast.unparse(dim),
            index=ast.unparse(index),
            call=ast.get_source_segment(stmt, node) or ast.unparse(node),
            source=source,
        )
    return None


def _segment_sum(ev: OpEvent, reach: int = 15) -> _Segment | None:
    """Where the user sums an exp's result per segment by index (``index_add_``,
    ``scatter_add``, ``scatter_reduce(..., 'sum')``): on the exp's own line, or on a later
    line of the same block that uses the name the exp's line assigns. A softmax over each
    segment (a node's incoming edges) needs each segment's own max, not one over a dim."""
    import linecache

    path, _, num = (ev.source or "").rpartition(":")
    if not path or not num.isdigit() or not ev.code or ev.phase is not Phase.FORWARD:
        return None
    start = int(num)
    here = linecache.getline(path, start)
    if not here.strip():
        return None
    indent = len(here) - len(here.lstrip())
    names: set[str] = set()
    for stmt in statements(ev.code):
        found = _segment_call(stmt, set(), ev.source or "")
        if found is not None:
            return found
        if re.search(rf"\b(?:{'|'.join(_EXP_CALLS)})\(", stmt):
            name = _assigned(stmt)
            if name is not None:
                names.add(name)
    if not names:
        return None
    for n, _, stmt in _later_statements(path, start, indent, reach):
        found = _segment_call(stmt, names, f"{path}:{n}")
        if found is not None:
            return found
        if _assigned(stmt) in names:
            return None  # the exp's name is given another value first
    return None


def _later_statements(
    path: str, start: int, indent: int, reach: int
) -> Iterator[tuple[int, str, str]]:
    """The statements after line ``start`` of ``path`` in the function enclosing it, as
    (line number, the line stripped, a statement of it), for at most ``reach`` lines: a
    later line of a lower block (after an if / else) still sees the names; a line at the
    def's own indent ends the function. Blank and comment lines are skipped."""
    import linecache

    top = -1
    for n in range(start - 1, max(0, start - 200), -1):
        text = linecache.getline(path, n)
        depth = len(text) - len(text.lstrip())
        if re.match(r"\s*(?:async\s+)?def\s", text) and depth < indent:
            top = depth
            break
    for n in range(start + 1, start + reach):
        text = linecache.getline(path, n)
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        if len(text) - len(text.lstrip()) <= top:
            return  # the function ended
        for stmt in statements(text.strip()):
            yield n, text.strip(), stmt


def _segment_full(receiver: str) -> str:
    """A tensor like ``receiver`` (what the segment sum sums into) filled with -inf:
    ``torch.zeros(n)`` -> ``torch.full((n,), float('-inf'))``."""
    inf = "float('-inf')"
    try:
        node = ast.parse(receiver, mode="eval").body
    except SyntaxError:
        node = None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        attr, owner = node.func.attr, ast.unparse(node.func.value)
        kws = "".join(f", {ast.unparse(k)}" for k in node.keywords)
        args = [ast.unparse(a) for a in node.args]
        if attr == "zeros_like" and owner == "torch" and len(args) == 1:
            return f"torch.full_like({args[0]}, {inf}{kws})"
        if (
            attr in ("zeros", "new_zeros")
            and args
            and not any(isinstance(a, ast.Starred) for a in node.args)
        ):
            one = node.args[0]
            if len(args) > 1:
                size = f"({', '.join(args)})"
            elif isinstance(one, (ast.Tuple, ast.List)) or re.search(
                r"\.shape$|\.size\(\)$", args[0]
            ):
                size = args[0]
            else:
                size = f"({args[0]},)"
            if attr == "zeros" and owner == "torch":
                return f"torch.full({size}, {inf}{kws})"
            if attr == "new_zeros":
                return f"{owner}.new_full({size}, {inf}{kws})"
    return f"torch.full_like({receiver}, {inf})"


def _segment_fix(code: str | None, op: str, seg: _Segment) -> str | None:
    """The user's exp line with each segment's max subtracted (a stable softmax per
    segment), preceded by the line computing that max with ``scatter_reduce``."""
    arg: list[str] = []
    mname = fresh_name("m", identifiers(code) | identifiers(seg.call))
    scatter = seg.method.startswith("scatter")
    if scatter:
        pick = f"{mname}.gather({seg.dim}, {seg.index})"
    elif seg.dim == "0":
        pick = f"{mname}[{seg.index}]"
    else:
        pick = f"{mname}.index_select({seg.dim}, {seg.index})"
    line = code.split("  #", 1)[0] if code else ""
    function = re.search(rf"\b(?:torch\.special|torch|special)\.{re.escape(op)}\(", line)

    def wrap(e: str) -> str:
        arg.append(e)
        shifted = f"{paren(e)} - {pick}"
        return shifted if function else f"({shifted})"

    fixed = next(
        (f for s in statements(code) if (f := rewrite_call(s, [op], wrap)) is not None), None
    )
    if fixed is None or not arg:
        return None
    x = arg[0]
    plain = line.strip()
    lines = [
        f"{mname} = {_segment_full(seg.receiver)}.scatter_reduce({seg.dim}, {seg.index}, "
        f"{x}, 'amax', include_self=True)   # each segment's own max",
        f"{fixed}  # was: {plain}",
        f"# {seg.call} sums the exp per {seg.index}: a softmax over each segment, so "
        "subtract each segment's own max; a max over the whole dim (amax(dim=-1), "
        "torch.softmax(dim=-1)) makes a segment far below it all 0, then 0/0 = NaN",
    ]
    if not scatter and seg.dim == "0":
        lines.insert(
            2,
            f"# {x} of several columns (heads): give scatter_reduce "
            f"{seg.index}.view(-1, *[1] * ({x}.dim() - 1)).expand_as({x}) instead of {seg.index}",
        )
    return "\n".join(lines)


def _upcast_matmul(code: str | None) -> str | None:
    """The user's line with both operands of its first ``@`` cast to float32 (operands
    may be method calls: ``f @ f.transpose(1, 2)``); None when there is none.

    >>> _upcast_matmul("g = f @ f.transpose(1, 2)  # gram")
    'g = f.float() @ f.transpose(1, 2).float()'
    """
    if not code:
        return None
    line = code.split("  #", 1)[0].rstrip()
    for begin, end, start, stop in _matmuls(line):
        left, right = line[begin : end + 1], line[start:stop]
        if _is_float32(left) and _is_float32(right):
            continue  # already a float32 product: never x.float().float()
        left = left if _is_float32(left) else f"{paren(left)}.float()"
        right = right if _is_float32(right) else f"{paren(right)}.float()"
        return f"{line[:begin]}{left} {line[end + 1 : start].strip()} {right}{line[stop:]}"
    return None


def _matmuls(line: str) -> Iterator[tuple[int, int, int, int]]:
    """Each ``a @ b`` of a line whose operands are postfix expressions: where ``a`` begins
    and ends (inclusive), and where ``b`` starts and stops (exclusive)."""
    for m in re.finditer(r"(?<![@=])@(?![@=])", line):
        end = m.start() - 1
        while end >= 0 and line[end] == " ":
            end -= 1
        begin = postfix_start(line, end) if end >= 0 else None
        start = m.end()
        while start < len(line) and line[start] == " ":
            start += 1
        stop = _postfix_end(line, start)
        if begin is not None and stop is not None:
            yield begin, end, start, stop


def _postfix_end(line: str, start: int) -> int | None:
    """End (exclusive) of the postfix expression starting at ``start`` (``a.b(x)[0]``,
    ``(u * v).t()``); None when none starts there."""
    i = start
    while i < len(line):
        c = line[i]
        if c in "([":
            close = _closing(line, i)
            if close is None:
                return None
            i = close + 1
        elif c.isalnum() or c in "_.":
            i += 1
        else:
            break
    return i if i > start else None


def _closing(line: str, at: int) -> int | None:
    depth = 0
    for i in range(at, len(line)):
        if line[i] in "([{":
            depth += 1
        elif line[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return None


def _exp_bound(dtype: str) -> float:
    lim = limits(dtype)
    return lim.exp_bound if lim is not None else math.nan


# ---------------------------------------------------------------------- NW102


@functools.lru_cache(maxsize=16)
def _past_max(dtype: str) -> str:
    """What a CPU cast to ``dtype`` makes of a value beyond its largest one, asked of torch:
    ``±inf``, ``NaN``, or ``±448 (it saturates)`` (float8_e4m3fn)."""
    try:
        dt = getattr(torch, dtype)
        big = torch.tensor([torch.finfo(dt).max * 4.0], dtype=torch.float64)
        out = float(big.to(dt).double())
    except (AttributeError, TypeError, RuntimeError):
        return "±inf"
    if math.isnan(out):
        return "NaN"
    if math.isinf(out):
        return "±inf"
    return f"±{fmt(out)} (it saturates: larger values are clipped to it)"


def _measured(rec: Record, scaled: bool) -> bool:
    if rec.stat is None or rec.phase in (Phase.GRADIENT, Phase.INPUT):
        return rec.phase is Phase.INPUT and rec.stat is not None and rec.source is None
    return not (rec.phase is Phase.BACKWARD and scaled)


@rule(
    "NW102",
    title="Overflow headroom nearly gone",
    severity="warning",
    summary=(
        "A float16/bfloat16/float8 tensor's max |x| is within a factor of the dtype's "
        "largest value (thresholds.headroom): the next spike overflows. A tensor at exactly "
        "finfo.max or finfo.min (an additive attention mask, a sentinel, an amax-scaled "
        "float8 cast) is left alone."
    ),
    early=True,
    priority=40,
)
def headroom(ctx: RuleContext) -> Iterator[Diagnosis]:
    frac = ctx.thresholds.headroom
    scaled = bool(ctx.facts.get("scaler"))
    worst: dict[str, tuple[float, Record, DtypeLimits]] = {}
    for r in ctx.trace.records:
        lim = low_precision(r.dtype)
        if lim is None or not _measured(r, scaled) or r.stat is None:
            continue
        if r.stat.has_nan or r.stat.has_posinf:
            continue  # it already overflowed (or worse): a warning before it happens is late
        m = r.stat.magnitude
        if not math.isfinite(m) or m < frac * lim.max:
            continue
        if m == lim.max:
            # exactly finfo.max/min is put there, not grown there: an additive mask
            # ((1 - mask) * finfo.min), a sentinel fill, or a float8 scaled cast
            # (x / (amax / finfo.max)) -- a value growing toward overflow lands below it
            continue
        ratio = m / lim.max
        key = r.role if r.phase is Phase.PARAMETER else r.path
        if key not in worst or ratio > worst[key][0]:
            worst[key] = (ratio, r, lim)
    if not worst:
        return
    ranked = sorted(worst.values(), key=lambda t: -t[0])
    ratio, top, lim = ranked[0]
    evidence = []
    for ratio_i, r, lim_i in ranked[:5]:
        near = (
            f"; {count(r.stat.near_max, 'value')} within a factor of 2 of it"
            if r.stat is not None and r.stat.near_max
            else ""
        )
        evidence.append(
            f"max |x| = {fmt(r.stat.magnitude if r.stat else math.nan)} in {r.dtype} at "
            f"{r.where}: {ratio_i:.0%} of the largest finite {r.dtype} value "
            f"{fmt(lim_i.max)}{near}"
        )
    if len(ranked) > 5:
        evidence.append(f"and {len(ranked) - 5} more")
    param = top.role if top.phase is Phase.PARAMETER else None
    yield ctx.diagnosis(
        path=top.path,
        phase=top.phase.value,
        parameter=param,
        evidence=evidence,
        explanation=(
            f"{top.dtype} cannot hold values beyond {fmt(lim.max)}. A tensor already at "
            f"{ratio:.0%} of that becomes {_past_max(top.dtype)} on the next spike (a larger "
            "batch, a sharper input, one more optimizer step)"
            + (", and the inf becomes NaN downstream" if _past_max(top.dtype) == "±inf" else "")
            + (
                ". Apart from its -inf (a mask, or a log of 0), no value has overflowed yet: "
                if top.stat is not None and top.stat.has_neginf
                else ". No value is bad yet: "
            )
            + "this is the warning before it happens."
        ),
        fix=(
            "# give these values range: bfloat16 has float32's range\n"
            f"with torch.autocast(device_type={device_type(None, top.device)}, "
            "dtype=torch.bfloat16):\n"
            "    out = model(x)\n"
            f"# or keep {top.path} in float32: model.get_submodule({top.path!r}).float() "
            "and cast its input"
            if top.phase is not Phase.PARAMETER
            else "# weights growing toward the limit: lower the learning rate, add weight "
            "decay,\n# or keep float32 master weights: model.float() + torch.autocast(...)"
        ),
    )


# ---------------------------------------------------------------------- trends


@dataclass(frozen=True)
class Trend:
    slope: float  #: growth per step
    steps: float  #: steps until ``limit`` at this rate
    first: float
    last: float
    span: int  #: steps the fit covers


def predict(points: Sequence[tuple[int, float]], limit: float, *, min_points: int) -> Trend | None:
    """Linear growth of the last points (step, value) toward ``limit``: None unless the
    values grow steadily (at least 2/3 of the step-to-step changes are increases).

    >>> predict([(0, 1.0), (1, 2.0), (2, 3.0), (3, 4.0)], 10.0, min_points=4).steps
    6.0
    """
    pts = [(s, v) for s, v in points if math.isfinite(v)][-16:]
    if len(pts) < max(min_points, 3):
        return None
    ups = sum(b[1] > a[1] for a, b in itertools.pairwise(pts))
    if ups < (2 * (len(pts) - 1)) / 3:
        return None
    xs = [float(s) for s, _ in pts]
    ys = [v for _, v in pts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    if den == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den
    if slope <= 0:
        return None
    last = ys[-1]
    steps = max(0.0, (limit - last) / slope)
    return Trend(slope, steps, ys[0], last, int(xs[-1] - xs[0]))


def _class_scores(rec: Record) -> bool:
    """Shaped like class scores: (N, C, ...) with C >= 2 (a regression head's (N, 1) is not)."""
    return len(rec.shape) >= 2 and rec.shape[1] >= 2


def _logit_max(trace: StepTrace) -> tuple[float, str] | None:
    """Largest value of the model's low-precision class-score outputs, and their dtype."""
    best: tuple[float, str] | None = None
    for r in first_root_outputs(trace):
        if low_precision(r.dtype) is None or not _class_scores(r):
            continue
        v = signed_max(r.stat)
        if math.isfinite(v) and (best is None or v > best[0]):
            best = (v, r.dtype)
    return best


_STABLE_LOSSES = frozenset({"ce", "nll", "bce_logits"})


def _only_stable_losses(trace: StepTrace, rec: Record) -> bool:
    """Whether every recorded consumer of ``rec``'s tensor is a loss that never computes a
    plain exp of it in its low precision (cross-entropy and friends subtract the max), or
    takes a float32 copy of it (``F.cross_entropy(logits.float(), y)``)."""
    ids = {rec.index}
    ids.update(r.index for r in trace.records if r.phase is Phase.FORWARD and r.source in ids)
    # the modules that took it (a loss module, or any other), and the functional losses
    # (F.cross_entropy: their guard's note names the record of their input)
    kinds: list[str | None] = []
    for r in trace.records:
        if r.phase is Phase.INPUT and r.source in ids:
            call = trace.call(r.call)
            kinds.append(loss_kind(call.module_type) if call is not None and call.is_loss else None)
    for n in trace.notes:
        if n.kind != "loss_input":
            continue
        seen = n.data.get("input_dtype")
        if n.data.get("input_widened_from") in ids and isinstance(seen, str):
            # computed in float32 from a float32 copy of it (logits.float() / T): every exp
            # on the way ran in float32, far from the bound
            kinds.append("upcast" if not low_precision(seen) else None)
            continue
        if n.data.get("input_source") not in ids and n.data.get("input_view_of") not in ids:
            continue  # neither it nor a view of it (logits.flatten(0, 1))
        if n.data.get("input_upcast_from") and isinstance(seen, str) and not low_precision(seen):
            # the loss took a float32 copy (logits.float()): whatever exp it computes runs
            # in float32, far from the bound
            kinds.append("upcast")
        else:
            kinds.append(loss_kind(str(n.data.get("loss") or n.path)))
    return bool(kinds) and all(k in _STABLE_LOSSES or k == "upcast" for k in kinds)


@rule(
    "NW103",
    title="Logits approaching the exp overflow bound",
    severity="warning",
    summary=(
        "The model's float16/bfloat16 outputs grow toward log(finfo.max) (11.09 in "
        "float16): any exp or softmax computed on them in that dtype is about to overflow."
    ),
    early=True,
    priority=35,
)
def logits_exp_bound(ctx: RuleContext) -> Iterator[Diagnosis]:
    cur = ctx.memo(ctx.trace, "logit_max", _logit_max)
    if cur is None:
        return
    value, dtype = cur
    lim = low_precision(dtype)
    if lim is None:
        return
    bound = lim.exp_bound
    points = [(t.step, v[0]) for t in ctx.history if (v := ctx.memo(t, "logit_max", _logit_max))]
    points.append((ctx.step, value))
    min_hist = ctx.thresholds.min_history
    trend = predict(points, bound, min_points=min_hist + 1)
    near = value >= ctx.thresholds.exp_headroom * bound
    horizon = ctx.thresholds.trend_horizon
    floor = ctx.thresholds.trend_floor
    soon = trend is not None and value < bound and trend.steps <= horizon and value >= floor * bound
    if not ((near and trend is not None) or soon):
        return
    root = next(
        (r for r in first_root_outputs(ctx.trace) if r.dtype == dtype and _class_scores(r)),
        None,
    )
    if root is not None and _only_stable_losses(ctx.trace, root):
        return
    evidence = [
        f"largest {dtype} output value {fmt(value)}; exp overflows above {fmt(bound)} = "
        f"log({fmt(lim.max)}) in {dtype}"
    ]
    if trend is not None:
        evidence.append(
            f"it grew from {fmt(trend.first)} to {fmt(trend.last)} over {trend.span} steps "
            f"(+{fmt(trend.slope)} per step)"
            + (
                f": at this rate it passes {fmt(bound)} in about {math.ceil(trend.steps)} steps"
                if value < bound
                else ""
            )
        )
    yield ctx.diagnosis(
        path=root.path if root is not None else None,
        phase=Phase.FORWARD.value,
        evidence=evidence,
        explanation=(
            f"In {dtype}, exp(x) overflows for x above {fmt(bound)}. Logits that keep "
            "growing (nothing pulls them down: ignored pixels, padding, a rare class) reach "
            "that bound; a stable softmax or F.cross_entropy survives it, but any exp, "
            f"hand-written softmax or logsumexp computed in {dtype} returns inf, then NaN. "
            "Harmless if every exp on these logits runs in float32."
        ),
        fix=(
            "logits = model(x)\n"
            "probs = torch.softmax(logits.float(), dim=1)    # exp/softmax in float32\n"
            "loss = F.cross_entropy(logits.float(), target)  # the loss too"
        ),
    )


_Mags = dict[tuple[str, str, str], tuple[float, str]]


def _low_magnitudes(trace: StepTrace, scaled: bool) -> _Mags:
    out: _Mags = {}
    for r in trace.records:
        if low_precision(r.dtype) is None or not _measured(r, scaled) or r.stat is None:
            continue
        m = r.stat.magnitude
        if not math.isfinite(m):
            continue
        key = (r.phase.value, r.path, r.role)
        if key not in out or m > out[key][0]:
            out[key] = (m, r.dtype)
    return out


def _leap(points: Sequence[tuple[int, float]]) -> str:
    """``jumped from 1.3 at step 7 to 2.2e+04 at step 8, then reached 6.3e+04`` when one
    step-to-step rise of the last points is ``_JUMP`` times or more (a jump, not a steady
    growth); "" otherwise."""
    pts = [(st, v) for st, v in points if math.isfinite(v)][-16:]
    rises = [(b[1] / a[1], a, b) for a, b in itertools.pairwise(pts) if a[1] > 0]
    if not rises:
        return ""
    ratio, (s0, v0), (s1, v1) = max(rises, key=lambda r: r[0])
    if ratio < _JUMP:
        return ""
    then = f", then reached {fmt(pts[-1][1])} at step {pts[-1][0]}" if s1 != pts[-1][0] else ""
    return f"jumped from {fmt(v0)} at step {s0} to {fmt(v1)} at step {s1} (×{fmt(ratio)}){then}"


@rule(
    "NW104",
    title="Magnitude growing toward overflow",
    severity="warning",
    summary=(
        "A low-precision tensor's max |x| grows steadily over the recorded steps and, at "
        "this rate, passes the dtype's largest value within thresholds.trend_horizon steps."
    ),
    early=True,
    priority=36,
)
def growth_to_overflow(ctx: RuleContext) -> Iterator[Diagnosis]:
    scaled = bool(ctx.facts.get("scaler"))
    key = "low_mags_scaled" if scaled else "low_mags"
    current = ctx.memo(ctx.trace, key, lambda tr: _low_magnitudes(tr, scaled))
    if not current or len(ctx.history) < ctx.thresholds.min_history:
        return
    past = [(t.step, ctx.memo(t, key, lambda tr: _low_magnitudes(tr, scaled))) for t in ctx.history]
    horizon = ctx.thresholds.trend_horizon
    floor = ctx.thresholds.trend_floor
    min_hist = ctx.thresholds.min_history
    found: list[tuple[Trend, tuple[str, str, str], str, DtypeLimits, str]] = []
    for k, (value, dtype) in current.items():
        lim = low_precision(dtype)
        if lim is None or value < floor * lim.max:
            continue
        pts = [(s, m[k][0]) for s, m in past if k in m]
        pts.append((ctx.step, value))
        trend = predict(pts, lim.max, min_points=min_hist + 1)
        if trend is not None and trend.steps <= horizon:
            found.append((trend, k, dtype, lim, _leap(pts)))
    if not found:
        return
    found.sort(key=lambda f: f[0].steps)
    trend, (phase, path, role), dtype, lim, _ = found[0]
    evidence = [
        f"max |x| of {p} ({ph}, {ro}) in {d} "
        + (leap or f"grew from {fmt(t.first)} to {fmt(t.last)} over {t.span} steps")
        + f" (+{fmt(t.slope)} per step): it passes {fmt(li.max)} in about "
        f"{math.ceil(t.steps)} steps"
        for t, (ph, p, ro), d, li, leap in found[:5]
    ]
    yield ctx.diagnosis(
        path=path,
        phase=phase,
        parameter=role if phase == Phase.PARAMETER.value else None,
        evidence=evidence,
        explanation=(
            f"Nothing is inf yet, but {path}'s values grow every step and {dtype} stops at "
            f"{fmt(lim.max)}. Weights that grow without bound (a learning rate too high, no "
            "weight decay) or activations that nothing normalizes overflow on a predictable "
            "step; the trend says which."
        ),
        fix=(
            "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
            "optimizer = torch.optim.AdamW(model.parameters(), lr=lr / 10, weight_decay=0.01)\n"
            "# or give the values range: torch.autocast("
            f"{device_type(None, *(r.device for r in ctx.trace.records if r.path == path))}, "
            "dtype=torch.bfloat16)"
        ),
    )


# ---------------------------------------------------------------------- NW106


@dataclass(frozen=True)
class _LossScale:
    """What the values a loss could be computed from can make of it: ``values``, how many
    there are (the model's inputs and outputs, every watched module's output, the loss
    calls' inputs and targets), and ``scale``, the largest |x| among them (at least 1).
    A loss that sums the square of each of them reaches ``bound``. ``dtype``: the loss's
    own (its one-value output's; float32 when not recorded)."""

    values: int
    scale: float
    dtype: str

    @property
    def bound(self) -> float:
        return self.values * self.scale * self.scale


def _loss_scale(trace: StepTrace, below: float = math.inf) -> _LossScale | None:
    """The step's :class:`_LossScale`: its finite floating-point values measured in forward
    (an input measured elsewhere is that output, counted once), but not the loss itself (a
    loss call's output, a one-value output of a root, the loss computed outside any
    module), with the targets the guards read for functional losses. One pass, cut short
    (None) once ``_HUGE_LOSS_FLOOR`` × the bound passes ``below``: no loss under that is
    huge, whatever its dtype (a healthy step reads a few records)."""
    special = {c.id: c for c in trace.calls if c.is_loss or c.root}
    floating: dict[str, bool] = {}
    values = 0
    scale = 1.0
    dtype = "float32"
    for r in trace.records:
        st = r.stat
        if st is None or (r.phase is not Phase.FORWARD and r.phase is not Phase.INPUT):
            continue
        if r.phase is Phase.FORWARD:
            call = special.get(r.call)
            if r.path == LOSS_PATH or (call is not None and (call.is_loss or st.numel <= 1)):
                if st.numel == 1:  # the loss, not what it was made of
                    dtype = r.dtype
                continue
        wide = floating.get(r.dtype)
        if wide is None:
            wide = floating[r.dtype] = limits(r.dtype) is not None
        if not wide or not st.finite:
            continue
        values += st.numel
        scale = max(scale, st.magnitude)
        if _HUGE_LOSS_FLOOR * values * scale * scale > below:
            return None
    for n in trace.notes:
        if n.kind != "loss_input":
            continue
        for key in ("target_min", "target_max", "input_min", "input_max"):
            v = n.data.get(key)
            if isinstance(v, (int, float)) and math.isfinite(v):
                scale = max(scale, abs(float(v)))
    return _LossScale(max(values, 1), scale, dtype)


def _huge_loss(ctx: RuleContext, trace: StepTrace) -> tuple[float, _LossScale, str] | None:
    """The step's loss when it is finite and past ``1 / sqrt(eps)`` (of the loss's dtype)
    times :attr:`_LossScale.bound`: more than a sum of squares of every value it could be
    made of, by the middle (in orders of magnitude) between the loss's rounding and the
    loss itself. The loss, its scale and its dtype; None otherwise."""
    loss = trace.loss
    if loss is None or not math.isfinite(loss):
        return None
    size = abs(loss)
    for n in trace.notes:  # backward ran on loss * a number (manual loss scaling): the
        if n.kind == "loss_factor" and isinstance(n.data.get("factor"), float):
            size /= abs(n.data["factor"])  # number is no term of the loss
    if size < _HUGE_LOSS_FLOOR:  # below any bound (values >= 1, scale >= 1): most steps
        return None
    sc = _loss_scale(trace, size)
    if sc is None:
        return None
    lim = limits(sc.dtype)
    if lim is None:
        return None
    slack = 1.0 / math.sqrt(lim.eps)
    return (loss, sc, sc.dtype) if size >= slack * sc.bound else None


#: the smallest loss that can be huge: 1 / sqrt(eps) of the dtype with the largest eps a
#: loss is computed in (bfloat16), times the smallest bound (one value of scale 1)
_HUGE_LOSS_FLOOR = 1.0 / math.sqrt(torch.finfo(torch.bfloat16).eps)


@dataclass(frozen=True)
class _Singular:
    """A value the loss was computed from that sits near 0, all of one sign, whose gradient
    from the loss is at least 1 / |x|: a term of the loss singular at 0."""

    rec: Record
    low: float  #: its smallest |x|
    high: float  #: its largest |x|
    grad: float | None  #: the largest |gradient| the loss sent to it (None: not measured)

    def line(self) -> str:
        sign = "positive" if self.rec.stat is not None and self.rec.stat.min > 0 else "negative"
        grad = (
            f"; the loss's gradient with respect to it reaches {fmt(self.grad)}, about "
            f"1/x² at x = {fmt(1 / math.sqrt(self.grad))}"
            if self.grad is not None and self.grad > 0
            else ""
        )
        return (
            f"{self.rec.path} ({self.rec.role}) holds only tiny {sign} values, |x| from "
            f"{fmt(self.low)} to {fmt(self.high)}{grad}: the loss blows up as they go to 0"
        )


def _singular(trace: StepTrace) -> _Singular | None:
    """The model's value nearest 0 among those all of one sign and at most sqrt(eps) of
    their dtype, with a gradient from the loss (when measured) of at least 1 / |x|: a loss
    term like 1/x, log x, lgamma or digamma (≈ -1/x) of it. None when no value is so."""
    best: _Singular | None = None
    grads: dict[int, float] = {}
    for r in trace.records:
        if (
            r.phase is Phase.BACKWARD
            and r.source is not None
            and not r.by_grad
            and r.stat is not None
            and math.isfinite(r.stat.magnitude)
        ):
            grads[r.source] = max(grads.get(r.source, 0.0), r.stat.magnitude)
    for r in trace.records:
        if r.phase is not Phase.FORWARD or r.path == LOSS_PATH:
            continue
        s, lim = r.stat, limits(r.dtype)
        if s is None or lim is None or not s.finite or s.numel <= 1:
            continue
        if not (s.min > 0 or s.max < 0):
            continue
        low, high = min(abs(s.min), abs(s.max)), s.magnitude
        if high > math.sqrt(lim.eps):
            continue
        g = grads.get(r.index)
        if g is not None and g * high < 1:
            continue  # its gradient is not that of a term singular at 0
        if best is None or low < best.low:
            best = _Singular(r, low, high, g)
    return best


@rule(
    "NW106",
    title="Huge finite loss: a term of it blows up",
    severity="warning",
    summary=(
        "The loss is finite but past 1 / sqrt(finfo(loss dtype).eps) (2896 in float32) "
        "times what a sum of squares of every value it could be made of reaches (the "
        "model's inputs and outputs, the watched modules' outputs, the targets the losses "
        "were given): a term of it is singular (1/x, log x, lgamma or digamma of a value "
        "near 0, a Dirichlet or Gamma concentration), an exp of a large argument, or data "
        "the model never saw in raw units. Said once, at the first such step, before it "
        "turns into inf."
    ),
    early=True,
    priority=45,
)
def huge_loss(ctx: RuleContext) -> Iterator[Diagnosis]:
    found = _huge_loss(ctx, ctx.trace)
    if found is None:
        return
    hist = ctx.history
    if hist and hist[-1].step == ctx.step - 1 and _huge_loss(ctx, hist[-1]) is not None:
        return  # said at the first step of it
    loss, sc, dtype = found
    lim = limits(dtype)
    if lim is None:
        return
    read = any(n.kind == "loss_input" for n in ctx.trace.notes)
    made_of = "the model's inputs and outputs" + (
        ", its modules' outputs" if ctx.trace.full else ""
    )
    evidence = [
        f"loss {fmt(loss)} at step {ctx.step}: {_times_of(abs(loss) / sc.bound)} a sum of "
        f"squares of all {count(sc.values, 'value')} it could be made of, at most |x| = "
        f"{fmt(sc.scale)} each ({fmt(sc.bound)}): {made_of}"
        + (" and the targets the losses were given" if read else "")
    ]
    g = ctx.trace.grad_norm
    if g is not None and math.isfinite(g) and g > 0:
        evidence.append(f"total gradient norm {fmt(g)}")
    sing = _singular(ctx.trace)
    rounding = abs(loss) * lim.eps
    head = (
        f"{dtype} still holds this loss (up to {fmt(lim.max)}), but no sum of squares, "
        "products or logs of the values it was computed from comes near it: a term of the "
        "loss blows up. "
    )
    tail = (
        f" That term dwarfs the others (any term below {fmt(rounding)} is lost in the "
        f"loss's {dtype} rounding) and its gradient drives every update; a little further "
        "and it is inf, then NaN."
    )
    when = "at step 0, before any update" if _first_step(ctx) else f"at step {ctx.step}"
    if sing is not None:
        evidence.append(sing.line())
        where = f"{sing.rec.path} ({sing.rec.role})"
        src = _exp_source(ctx.trace, sing)
        made = (
            f"{src.path}'s output, from {fmt(src.stat.min)} to {fmt(src.stat.max)}"
            if src is not None and src.stat is not None
            else None
        )
        if made is not None:
            evidence.append(
                f"{made}: e^x of it spans the same range, so {where} is softplus or exp of "
                "it (softplus(x) ≈ e^x below -10)"
            )
        explanation = (
            head + f"The values of {where} are within {fmt(sing.high)} of 0, where a term like "
            "1/x, log x, or lgamma(x) and digamma(x) (≈ -log x and -1/x) is singular: the "
            "log-density or KL of a Dirichlet, Gamma or Beta takes both of its "
            "concentration, a Gaussian's of its variance. "
            + (
                f"It is softplus or exp of {made}: that far below 0 "
                if made is not None
                else "A positive quantity made by softplus or exp of a large negative "
                "number is that small "
            )
            + f"{when}."
            + tail
        )
        fix = (
            f"# a floor under the positive quantity {where} returns keeps the term finite\n"
            "x = F.softplus(raw) + 1e-3   # where it is F.softplus(raw); raw.exp() + 1e-3 "
            "where it is raw.exp()\n"
            + (
                f"# and bring {src.path}'s output near 0 (its initialization: a bias far below 0)"
                if src is not None
                else "# and find what makes raw that negative (an initialization: a bias "
                "far below 0)"
            )
        )
    else:
        explanation = (
            head + "The term is singular at a value that got near 0 (1/x, log x, lgamma or "
            "digamma of it, a log-det of a near-singular matrix), an exp of a large "
            "argument, or made of data the model never saw, in raw units (a target the "
            "loss compares with: its square is the loss)." + tail
        )
        fix = (
            f"# print each term of the loss at step {ctx.step}: the one near {fmt(loss)} "
            "is it\n"
            "# a term of x near 0 (1/x, log x, lgamma/digamma(x)): bound x away from 0, "
            "F.softplus(raw) + 1e-3 or x.clamp(min=1e-3)\n"
            "# a target in raw units: standardize it, y = (y - y_mean) / y_std "
            "(statistics from the training data; undo it on predictions)"
        )
    yield ctx.diagnosis(
        path=sing.rec.path if sing is not None else LOSS_PATH,
        phase=Phase.FORWARD.value,
        evidence=evidence,
        explanation=explanation,
        fix=fix,
    )


def _exp_source(trace: StepTrace, sing: _Singular) -> Record | None:
    """The watched module output, all below 0, whose e^x spans ``sing``'s range (each end
    within a factor e): the value softplus or exp made it from. None when none does."""
    if sing.rec.stat is None or sing.rec.stat.min <= 0:
        return None
    lo, hi = math.log(sing.low), math.log(sing.high)
    for r in trace.records:
        s = r.stat
        if r.phase is not Phase.FORWARD or r is sing.rec or s is None or not s.finite:
            continue
        if s.max < 0 and abs(s.min - lo) <= 1 and abs(s.max - hi) <= 1:
            return r
    return None


def _times_of(ratio: float) -> str:
    """``2.3e+06×``: how many times a bound the loss is."""
    return f"{fmt(ratio)}×"


# ---------------------------------------------------------------------- NW107


@rule(
    "NW107",
    title="Updates below the weights' rounding step: low-precision weights stop learning",
    severity="warning",
    summary=(
        "Weights held in float16/bfloat16 (no float32 master copy) get updates smaller than "
        "half the spacing of the dtype's numbers around them (finfo.eps × |w|: 2^-7 × |w| "
        "in bfloat16): w + Δ rounds back to w, and most values never change while every "
        "number stays finite. Adam-type steps are about lr, SGD's lr × |grad|. Said once."
    ),
    early=True,
    priority=20,
)
def update_below_rounding(ctx: RuleContext) -> Iterator[Diagnosis]:
    notes = [
        n
        for n in ctx.trace.notes
        if n.kind == "optimizer"
        and any(
            low_precision(d) is not None
            for g in n.data.get("groups", ())
            if isinstance(g, dict)
            for d in g.get("dtypes", ())
        )
    ]
    if not notes or ctx.trace.anomaly is not None:
        return  # the healthy path: float32 weights (autocast included) or no update; a
        # step whose values went bad has a worse problem than lost updates
    # the optimizers' lrs: a step with the same ones as the step before it is not looked
    # at again (the weights' sizes change slowly), so a run whose updates survive the
    # rounding pays for one look, and one more at each change of the lr; a stall told at
    # one lr is not told again while it lasts
    key = tuple(
        (
            n.path,
            n.data.get("ident"),
            tuple(
                (g.get("lr"), g.get("initial_lr"))
                for g in n.data.get("groups") or ()
                if isinstance(g, dict)
            ),
        )
        for n in notes
    )
    if ctx.history and ctx.cached(ctx.history[-1], _LOST_KEY) == key:
        ctx.memo(ctx.trace, _LOST_KEY, lambda t: key)
        return
    if any(getattr(d, "code", "") == "NW107" for t in ctx.history for d in t.diagnoses):
        return  # said once
    found = _lost_updates(ctx, notes)
    ctx.memo(ctx.trace, _LOST_KEY, lambda t: key)
    if found is not None:
        yield _lost_update_diagnosis(ctx, found)


#: the memo key of the optimizer lrs a step was looked at with (see NW107)
_LOST_KEY = "lost_update_lrs"


@dataclass(frozen=True)
class _LostWeight:
    """One low-precision weight whose update rounds away: its name, dtype, how many values
    it holds, its RMS value, the update per value, and the share of its values (estimated
    from a normal spread of that RMS) at or above ``floor``, the smallest |w| whose half
    rounding step exceeds the update."""

    name: str
    dtype: str
    numel: int
    rms: float
    update: float
    floor: float
    lost: float


@dataclass(frozen=True)
class _Lost:
    optimizer: str
    lr: float
    normalized: bool
    weights: tuple[_LostWeight, ...]  #: the low-precision weights of the group, largest first
    share: float  #: of the low-precision values whose update rounds away (estimated)
    values: int  #: the low-precision values the group updates


def _lost_updates(ctx: RuleContext, notes: list[Note]) -> _Lost | None:
    """The optimizer step of this trace whose low-precision weights lose half or more of
    their values' updates to rounding, or None. The lr is the larger of the group's lr and
    its scheduler's base lr (``initial_lr``): a warmup's first tiny steps are no stall."""
    scales = ctx.facts.get("weight_scales")
    scales = scales if isinstance(scales, dict) else {}
    norms = ctx.facts.get("weight_norms")
    grads: dict[str, float] | None = None
    for n in notes:
        low = n.path.lower()
        if n.path == "LBFGS" or "lamb" in low or "lars" in low:
            continue  # the step's size is set apart from the lr
        normalized = _normalized(n.path) or "lion" in low
        groups = _group_lrs(n)
        for g in groups.values():
            dtypes = [d for d in g.get("dtypes", ()) if isinstance(d, str)]
            if not any(low_precision(d) for d in dtypes):
                continue
            lr = max([_numbers(g.get("lr"))[0], *_numbers(g.get("initial_lr"))])
            names = [x for x in g.get("names", ()) if isinstance(x, str)]
            if grads is None:
                grads = {
                    r.role: r.stat.norm
                    for r in ctx.trace.records
                    if r.phase is Phase.GRADIENT
                    and r.stat is not None
                    and r.stat.norm is not None
                    and math.isfinite(r.stat.norm)
                }
            if len(notes) == 1 and len(groups) == 1:
                # the note lists a group's first names only: with one optimizer of one
                # group, every watched weight that got a gradient is its (a frozen base
                # model's weights are not)
                names = list(scales) or (list(norms) if isinstance(norms, Mapping) else [])
                names = [x for x in names if x in grads] if grads else names
            if not normalized:
                momentum = _numbers(g.get("momentum"))
                damp = _numbers(g.get("dampening"))
                m = momentum[0] if momentum and 0 <= momentum[0] < 1 else 0.0
                # the steady step of SGD with momentum: lr × g × (1 - dampening) / (1 - m)
                gain = (1 - (damp[0] if damp else 0.0)) / (1 - m)
            weights: list[_LostWeight] = []
            total = 0
            eps = min(x.eps for d in dtypes if (x := low_precision(d)) is not None)
            even = _keeps_from(lr, eps) if normalized else math.inf
            for name in names:
                scale = scales.get(name)
                if not (isinstance(scale, tuple) and len(scale) == 3 and scale[2] > 0):
                    continue
                size, kind, numel = scale
                if normalized:
                    update, floor = lr, even
                else:
                    gn = grads.get(name)
                    if gn is None:
                        continue
                    update = lr * gain * gn / math.sqrt(numel)
                    if not update > 0:
                        continue
                    floor = _keeps_from(update, eps)
                if kind == "max" and floor > size:
                    # even the largest value keeps its update: nothing to read
                    total += numel
                    continue
                w = _weight_size(name, dtypes, scale, norms)
                if w is None:
                    continue
                dtype, rms = w
                lim = low_precision(dtype)
                if lim is None or not rms > 0:
                    continue
                floor = _keeps_from(update, lim.eps)
                lost = math.erfc(floor / (rms * math.sqrt(2)))
                total += numel
                weights.append(_LostWeight(name, dtype, numel, rms, update, floor, lost))
            if not weights:
                continue
            share = sum(x.lost * x.numel for x in weights) / total
            if share >= 0.5:
                weights.sort(key=lambda x: (-x.numel * x.lost, x.name))
                return _Lost(n.path, lr, normalized, tuple(weights), share, total)
    return None


def _keeps_from(update: float, eps: float) -> float:
    """The smallest |w| whose update ``update`` rounds away: |w| in [2^k, 2^(k+1)) is
    spaced 2^k × eps apart, and w + Δ rounds back to w where Δ is below half of that."""
    return 2.0 ** (math.floor(math.log2(2 * update / eps)) + 1)


def _weight_size(
    name: str, dtypes: list[str], scale: tuple[float, str, int], norms: object
) -> tuple[str, float] | None:
    """``name``'s dtype and RMS value: from the attach check's L2 norm when it read one
    (and the group holds one dtype), else from ``facts["weight_norms"]`` (read once, when
    asked)."""
    value, kind, numel = scale
    if kind == "norm" and len(dtypes) == 1:
        return dtypes[0], value / math.sqrt(numel)
    if not isinstance(norms, Mapping):
        return None
    got = norms.get(name)
    if got is None:
        return None
    dtype, l2 = got
    return (dtype, l2 / math.sqrt(numel)) if math.isfinite(l2) else None


def _lost_update_diagnosis(ctx: RuleContext, found: _Lost) -> Diagnosis:
    big = found.weights[0]
    lim = low_precision(big.dtype)
    assert lim is not None
    step = lim.eps * 2.0 ** math.floor(math.log2(big.rms))
    per = (
        f"about lr = {hyper(found.lr)} per value ({found.optimizer} divides each gradient by "
        "its running size)"
        if found.normalized
        else f"lr × |grad| = {hyper(found.lr)} × {fmt(big.update / found.lr)} = "
        f"{fmt(big.update)} per value of {big.name} (RMS)"
    )
    values = found.values
    evidence = [
        f"{found.optimizer} updates {count(values, 'value')} held in {big.dtype}, with no "
        f"float32 copy: finfo({big.dtype}).eps = {fmt(lim.eps)}",
        f"{big.name}: typical |w| (RMS) = {fmt(big.rms)}, where {big.dtype} numbers are "
        f"{fmt(step)} apart: an update below {fmt(step / 2)} rounds back to w",
        f"{found.optimizer}'s update: {per}, {fmt(step / 2 / big.update)}× too small",
        f"every value with |w| >= {fmt(big.floor)} loses its whole update: about "
        f"{round(100 * found.share)}% of the values (a normal spread of each weight's RMS) "
        "never change",
    ]
    return ctx.diagnosis(
        path=None,
        parameter=big.name,
        evidence=evidence,
        explanation=(
            f"The weights are stored in {big.dtype}, which keeps "
            f"{round(-math.log2(lim.eps))} bits of mantissa: near |w| = {fmt(big.rms)} it "
            f"cannot represent a change smaller than {fmt(step / 2)}. Each optimizer step "
            f"computes w + Δ with Δ about {fmt(big.update)} and rounds the sum back to "
            f"{big.dtype}, which gives w again: the loss stays flat, every value is finite, "
            "and nothing raises. Mixed precision keeps the weights (and the optimizer's "
            "update) in float32 and computes in the low precision under autocast; raising "
            "the lr past the rounding step changes the training instead of fixing it."
        ),
        fix=(
            half_weights_fix(
                big.dtype,
                device_type(None, _first_device(ctx)),
                half_lines(big.dtype, optimizer=None, ident=None, eps=None),
                optimizer=found.optimizer,
                eps=None,
            )
            + f"\n# or keep {big.dtype} weights with an optimizer that carries a Kahan-summation "
            "compensation buffer"
            + (" or rounds stochastically" if big.dtype == "bfloat16" else "")
            + " (what the rounding drops is added back)"
        ),
    )


def _first_device(ctx: RuleContext) -> str | None:
    return next((r.device for r in ctx.trace.records if r.device), None)


# ------------------------------------------------ float16 / bfloat16 weights: the user's lines


@dataclass(frozen=True)
class _Lines:
    """The user's lines a fix for low-precision weights rewrites (each None when unseen):
    the cast of the model (``model.half()``) and its float32 version, the statements from
    the forward to the loss, the loss's name, the optimizer's name and its construction."""

    cast: tuple[str, str | None] | None = None  #: (the line, the line without the cast)
    forward: tuple[str, ...] = ()
    loss: str | None = None
    optimizer: str | None = None
    built: str | None = None  #: the optimizer's construction statement
    built_eps: str | None = None  #: that statement with ``eps=`` set for the dtype


_CAST_DTYPES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16"}


def _dtype_named(node: ast.expr, frame: Any = None) -> str | None:
    """``torch.float16`` / ``torch.half`` / ``torch.bfloat16`` -> the dtype's name; a name
    that holds a dtype in ``frame`` (``.to(dtype)``) too."""
    if isinstance(node, ast.Name) and frame is not None:
        value = _value_in(frame, node.id)
        return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "torch"
    ):
        return _CAST_DTYPES.get(node.attr)
    return None


def _cast_of(call: ast.Call, dtype: str, frame: Any = None) -> ast.Call | None:
    """The call itself when it casts its receiver to ``dtype`` (``.half()``,
    ``.bfloat16()``, ``.to(torch.float16)``, ``.to(device, dtype=torch.half)``)."""
    f = call.func
    if not isinstance(f, ast.Attribute):
        return None
    if f.attr in ("half", "bfloat16") and not call.args and not call.keywords:
        return call if _CAST_DTYPES[f.attr] == dtype else None
    if f.attr in ("to", "type"):
        named = [_dtype_named(a, frame) for a in call.args] + [
            _dtype_named(k.value, frame) for k in call.keywords if k.arg == "dtype"
        ]
        return call if dtype in named else None
    return None


def _uncast(call: ast.Call, dtype: str, frame: Any = None) -> ast.expr:
    """The call without its cast: ``net.half()`` -> ``net``, ``net.to(device,
    torch.half)`` -> ``net.to(device)``."""
    f = call.func
    assert isinstance(f, ast.Attribute)
    if f.attr in ("half", "bfloat16"):
        return f.value
    args = [a for a in call.args if _dtype_named(a, frame) != dtype]
    keywords = [k for k in call.keywords if not (k.arg == "dtype" and _dtype_named(k.value, frame))]
    if not args and not keywords:
        return f.value
    return ast.Call(func=f, args=args, keywords=keywords)


def _user_files() -> list[tuple[Any, str, ast.Module]]:
    """The running user frames, innermost first, each with its file's text and tree (one
    parse a file); [] when no user frame is on the stack (a report read later)."""
    import linecache
    import sys

    from nanwatch import _frames

    out: list[tuple[Any, str, ast.Module]] = []
    parsed: dict[str, tuple[str, ast.Module] | None] = {}
    f = _frames.user_frame(sys._getframe(1))
    while f is not None and len(out) < 16:
        path = f.f_code.co_filename
        if path not in parsed:
            text = "".join(linecache.getlines(path))
            try:
                parsed[path] = (text, ast.parse(text)) if text else None
            except (SyntaxError, ValueError):
                parsed[path] = None
        got = parsed[path]
        if got is not None:
            out.append((f, *got))
        f = _frames.user_frame(f.f_back)
    return out


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def _scope_of(frame: Any, tree: ast.Module) -> ast.AST | None:
    """The function (or the module) whose code ``frame`` runs."""
    code = frame.f_code
    if code.co_name == "<module>":
        return tree
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if first == code.co_firstlineno:
                return node
    return None


def _own_nodes(scope: ast.AST | None) -> Iterator[ast.AST]:
    """The nodes of ``scope``'s own code, not those of the functions and classes it
    defines (another test's ``model.half()`` in the same file is not this one)."""
    if scope is None:
        return
    todo = list(ast.iter_child_nodes(scope))[::-1]
    while todo:  # in source order
        node = todo.pop()
        if isinstance(node, _DEFS):
            continue
        yield node
        todo.extend(list(ast.iter_child_nodes(node))[::-1])


def _value_in(frame: Any, name: str) -> object:
    local = frame.f_locals
    return local[name] if name in local else frame.f_globals.get(name)


def _resolve(frame: Any, node: ast.expr) -> object:
    """The object a name or a chain of attributes (``self.net``) holds in ``frame``."""
    if isinstance(node, ast.Name):
        return _value_in(frame, node.id)
    if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute)):
        try:
            return getattr(_resolve(frame, node.value), node.attr, None)
        except Exception:  # a property that raises
            return None
    return None


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _source(text: str, node: ast.AST) -> str:
    """A statement's own text, its continuation lines dedented with it."""
    import textwrap

    seg = ast.get_source_segment(text, node, padded=True) or ast.unparse(node)
    return textwrap.dedent(seg).strip()


def _set_eps(text: str, call: ast.Call, stmt: ast.stmt, eps: str) -> str | None:
    """The statement holding ``call`` with the call's ``eps=`` set to ``eps``."""
    own = _source(text, stmt)
    lines = text.splitlines()
    if stmt.end_lineno is None or call.end_lineno is None or call.end_col_offset is None:
        return None
    if stmt.lineno != stmt.end_lineno:  # several lines: the rewrite is ast's
        new = ast.parse(own).body[0]
        for c in ast.walk(new):
            if isinstance(c, ast.Call) and ast.unparse(c) == ast.unparse(call):
                c.keywords = [k for k in c.keywords if k.arg != "eps"]
                c.keywords.append(ast.keyword(arg="eps", value=ast.Constant(float(eps))))
                return ast.unparse(new).replace(f"eps={float(eps)!r}", f"eps={eps}")
        return None
    row = lines[stmt.lineno - 1]
    old = next((k for k in call.keywords if k.arg == "eps"), None)
    if old is not None and old.value.end_col_offset is not None:
        row = row[: old.value.col_offset] + eps + row[old.value.end_col_offset :]
    else:
        at = call.end_col_offset - 1  # the call's closing parenthesis
        before = row[:at].rstrip()
        sep = "" if before.endswith(("(", ",")) else ", "
        sep = " " if before.endswith(",") else sep
        row = before + sep + f"eps={eps}" + row[at:]
    return row.strip()


def _loss_statements(
    block: list[ast.stmt], at: int, loss: ast.expr, frame: Any, text: str
) -> tuple[str, ...]:
    """The statements before ``block[at]`` that compute ``loss`` (a name, or the
    expression ``backward()`` is called on: then ``loss = <it>`` ends them), from the
    first that calls a module (the forward) on: what autocast must hold."""
    from torch import nn

    def calls_module(node: ast.AST) -> bool:  # model(x), self.net(x): not model.parameters()
        return any(
            isinstance(c, ast.Call) and isinstance(_resolve(frame, c.func), nn.Module)
            for c in ast.walk(node)
        )

    need = {n.id for n in ast.walk(loss) if isinstance(n, ast.Name)}
    found: list[tuple[ast.AST, str]] = []
    if not isinstance(loss, ast.Name):
        seg = ast.get_source_segment(text, loss)
        if seg is None or "\n" in seg:
            return ()
        found.append((loss, f"loss = {seg}"))
    for st in reversed(block[:at]):
        if not isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            break
        targets = st.targets if isinstance(st, ast.Assign) else [st.target]
        made = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        if not made & need or st.value is None:
            continue
        found.append((st, _source(text, st)))
        need |= {n.id for n in ast.walk(st.value) if isinstance(n, ast.Name)}
    found.reverse()
    first = next((i for i, (node, _) in enumerate(found) if calls_module(node)), None)
    if first is None:
        return ()
    return tuple(code for _, code in found[first:])


def half_lines(dtype: str, *, optimizer: str | None, ident: object, eps: str | None) -> _Lines:
    """What the user's running code says about weights kept in ``dtype``: see
    :class:`_Lines`. ``optimizer``: the optimizer's class name (``AdamW``), ``ident`` the
    ``id()`` the watcher noted for it; ``eps``: the eps to write into its construction.
    Nothing (the generic lines stand) when the source cannot be read or understood."""
    try:
        return _half_lines(dtype, optimizer=optimizer, ident=ident, eps=eps)
    except Exception:  # source that ast or a frame's values do not give as expected
        return _Lines()


def _half_lines(dtype: str, *, optimizer: str | None, ident: object, eps: str | None) -> _Lines:
    from torch import nn

    cast: tuple[str, str | None] | None = None
    forward: tuple[str, ...] = ()
    loss: str | None = None
    opt_name: str | None = None
    built: str | None = None
    built_eps: str | None = None
    for frame, text, tree in _user_files():
        parents: dict[int, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                parents[id(child)] = node

        def stmt_of(node: ast.AST, parents: dict[int, ast.AST] = parents) -> ast.stmt | None:
            n: ast.AST | None = node
            while n is not None and not isinstance(n, ast.stmt):
                n = parents.get(id(n))
            return n if isinstance(n, ast.stmt) else None

        for node in _own_nodes(_scope_of(frame, tree)):
            if not isinstance(node, ast.Call):
                continue
            st = stmt_of(node)
            if st is None:
                continue
            if cast is None and _cast_of(node, dtype, frame) is not None:
                targets = st.targets if isinstance(st, ast.Assign) else []
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                root = _root_name(node.func)
                if root is not None:
                    names.append(root)
                if any(isinstance(_value_in(frame, n), nn.Module) for n in names):
                    if isinstance(st, ast.Expr) and st.value is node:
                        cast = (_source(text, st), None)  # the whole line is the cast
                    else:  # the line without the cast (ast's spelling of it)
                        new = ast.parse(_source(text, st)).body[0]
                        for c in ast.walk(new):
                            if isinstance(c, ast.Call) and ast.unparse(c) == ast.unparse(node):
                                swapped = _uncast(c, dtype, frame)
                                for p in ast.walk(new):
                                    for field, value in ast.iter_fields(p):
                                        if value is c:
                                            setattr(p, field, swapped)
                                break
                        cast = (_source(text, st), ast.unparse(new))
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if built is None and optimizer is not None and name == optimizer:
                targets = st.targets if isinstance(st, ast.Assign) else []
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                mine = ident is None or any(id(_value_in(frame, n)) == ident for n in names)
                if not names or mine:
                    built = _source(text, st)
                    built_eps = _set_eps(text, node, st, eps) if eps is not None else None
                    opt_name = names[0] if names else None
            if (
                loss is None
                and isinstance(f, ast.Attribute)
                and f.attr == "backward"
                and isinstance(st, ast.Expr)
                and st.value is node
            ):
                block = next(
                    (
                        b
                        for p in (parents.get(id(st)),)
                        if p is not None
                        for b in (getattr(p, "body", None), getattr(p, "orelse", None))
                        if isinstance(b, list) and st in b
                    ),
                    None,
                )
                if block is not None:
                    got = _loss_statements(block, block.index(st), f.value, frame, text)
                    if got:
                        forward = got
                        loss = f.value.id if isinstance(f.value, ast.Name) else "loss"
        if opt_name is None and ident is not None:
            opt_name = next(
                (k for k, v in frame.f_locals.items() if id(v) == ident),
                next((k for k, v in frame.f_globals.items() if id(v) == ident), None),
            )
    return _Lines(cast, forward, loss, opt_name, built, built_eps)


def half_weights_fix(
    dtype: str, device: str, lines: _Lines, *, optimizer: str | None, eps: float | None
) -> str:
    """The fix for weights kept in ``dtype``: float32 weights (the user's cast line without
    the cast), the user's forward and loss under autocast, a GradScaler for float16; and,
    with ``eps``, the user's optimizer built with an eps that ``dtype`` holds."""
    out: list[str] = []
    keep = f"float32 weights, {dtype} in the forward only"
    if lines.cast is not None:
        old, new = lines.cast
        out.append(f"# delete {old}: {keep}" if new is None else f"{new}   # {keep}")
    else:
        out.append(f"model.float()   # before the optimizer is built: {keep}")
    # loss scaling keeps small gradients from underflowing where the dtype's smallest
    # normal is above float32's (float16's); bfloat16 has float32's range
    scaled = torch.finfo(getattr(torch, dtype)).tiny > torch.finfo(torch.float32).tiny
    if scaled:
        out.append(f"scaler = torch.amp.GradScaler({device})   # once, before the loop")
    out.append(f"with torch.autocast(device_type={device}, dtype=torch.{dtype}):")
    out.extend(
        "    " + ln
        for st in lines.forward or ("loss = criterion(model(x), y)",)
        for ln in st.splitlines()
    )
    if scaled:
        loss = lines.loss or "loss"
        opt = lines.optimizer or "optimizer"
        out += [
            f"scaler.scale({loss}).backward()   # was: {loss}.backward()",
            f"scaler.step({opt})   # was: {opt}.step()",
            "scaler.update()",
        ]
    if eps is not None:
        if lines.built_eps is not None:
            out.append(f"# or, keeping {dtype} weights: {lines.built_eps}")
        else:
            out.append(f"# or, keeping {dtype} weights: {optimizer}(params, eps={hyper(eps)})")
    return "\n".join(out)


# ---------------------------------------------------------------------- NW108


@rule(
    "NW108",
    title="Normalization eps too small for the dtype",
    severity="error",
    summary=(
        "A LayerNorm / GroupNorm in a low precision whose eps is below 1 / finfo.max² "
        "(float16: 2.33e-10): for a row of equal values the 1 / sqrt(var + eps) "
        "its forward saves is inf, and its backward multiplies by it: NaN gradients."
    ),
    priority=12,
)
def saved_rstd_overflow(ctx: RuleContext) -> Iterator[Diagnosis]:
    a = ctx.anomaly
    ev = a.op if a is not None else None
    if a is None or ev is None or ev.phase is not Phase.BACKWARD:
        return
    kind = _VAR_NORMS.get(packet(ev.op).rstrip("_"))
    lim = low_precision(ev.dtype)
    # the forward's saved outputs: (out, mean, rstd); rstd = 1 / sqrt(var + eps)
    rstd = next((s for n, s in ev.inputs if n == "result2" and s is not None), None)
    if kind is None or lim is None or rstd is None or not rstd.posinf:
        return
    layer, unit = kind
    floor = 1 / lim.max**2  # 1 / sqrt(eps) > max below it
    rows = f"{rstd.posinf:,} of {count(rstd.numel, unit)}"
    evidence = [
        f"{short_op(ev.op)}'s backward made {ev.born} in {ev.dtype}: the 1 / sqrt(var + eps) "
        f"its forward saved (rstd) is +inf for {rows}",
        f"1 / sqrt(var + eps) passes {ev.dtype}'s largest value {fmt(lim.max)} only when var "
        f"+ eps < 1 / {fmt(lim.max)}² = {fmt(floor)}: those {unit}s have variance 0 (equal "
        f"values) and the {layer}'s eps is below {fmt(floor)}",
        f"input rstd: {describe_stat(rstd)}",
    ]
    evidence += [f"input {n}: {describe_stat(s)}" for n, s in ev.inputs if n == "input"]
    line = code_line(ev)
    if line is not None:
        evidence.append(line)
    yield ctx.diagnosis(
        **op_fields(ev, a),
        evidence=evidence,
        explanation=(
            f"{layer} saves 1 / sqrt(var + eps) for its backward. A {unit} of equal values (a "
            "padded token's zero embedding, a blank image) has variance 0, and with an eps "
            f"below {fmt(floor)} its 1 / sqrt(eps) does not fit {ev.dtype}: "
            f"it is saved as inf. The forward still outputs 0 for that {unit}, so nothing "
            "looks wrong until backward multiplies by the saved value: 0 × inf = NaN. "
            f"torch's default eps {_NORM_EPS} keeps it at {fmt(float(_NORM_EPS) ** -0.5)}."
        ),
        fix=(
            f"for m in model.modules():   # eps below {fmt(floor)}: 1 / sqrt(eps) passes "
            f"{ev.dtype}'s {fmt(lim.max)}\n"
            f"    if isinstance(m, nn.{layer}) and m.eps < {fmt(floor)}:\n"
            f"        m.eps = {_NORM_EPS}\n"
            f"# or where it is built: nn.{layer}(..., eps={_NORM_EPS}); or run it in float32 "
            f"(autocast does: keep the weights float32, {ev.dtype} in the forward)"
        ),
    )


# ---------------------------------------------------------------------- NW109


@dataclass(frozen=True)
class _Zeroed:
    """A low-precision module output of exact zeros from an input that holds positive values
    and whose spread passes sqrt(finfo.max)."""

    out: Record  #: the module's output: every value 0
    src: Record  #: its input: max > 0, max - min > sqrt(finfo.max)
    lim: DtypeLimits
    grad_in: Record | None  #: the gradient that reached the input: every value 0, or None
    zeros: TensorStat  #: ``out``'s statistics
    wide: TensorStat  #: ``src``'s statistics


def _all_zero(s: TensorStat | None) -> bool:
    return s is not None and s.numel > 1 and s.min == 0 and s.max == 0


def _zeroed_outputs(ctx: RuleContext) -> list[_Zeroed]:
    """Watch mode's records alone (no op events): module outputs in a short-range dtype that
    are all exactly 0 while the module's input of that dtype held positive values, and values
    so far apart that a square of their difference, (x - mean) ** 2, passes finfo.max. A
    ReLU zeroes an input only when none of it is positive (a dead ReLU); a module whose own
    parameters got a non-zero gradient (a gate initialized at 0) is left alone."""
    trace = ctx.trace
    dtypes = {r.dtype for r in trace.records}
    if not any((lim := low_precision(d)) is not None and lim.short_range for d in dtypes):
        return []  # no float16 or float8 value this step (the common case): nothing to do
    calls = {c.id: c for c in trace.calls}
    traced = {ev.path for ev in trace.ops if ev.phase is Phase.FORWARD}
    found: list[_Zeroed] = []
    for r in trace.records:
        call = calls.get(r.call)
        if r.phase is not Phase.FORWARD or call is None or call.is_loss or call.passthrough:
            continue
        lim = low_precision(r.dtype)
        if lim is None or not lim.short_range or r.stat is None or r.path in traced:
            continue
        if not _all_zero(r.stat):
            continue
        wide = [
            (m, m.stat)
            for m in _inputs_of_record(trace, r)
            if m.dtype == r.dtype
            and m.stat is not None
            and m.stat.finite
            and m.stat.max > 0
            and (m.stat.max - m.stat.min) ** 2 > lim.max
        ]
        if not wide:
            continue
        grads = [g for g in trace.records if g.phase is Phase.GRADIENT and g.path == r.path]
        if any(g.stat is None or g.stat.magnitude != 0 for g in grads):
            continue  # its parameters learn from it: the zeros are the module's own
        src, ws = max(wide, key=lambda w: w[1].magnitude)
        back = [
            b
            for b in trace.records
            if b.phase is Phase.BACKWARD and b.source == src.index and _all_zero(b.stat)
        ]
        found.append(_Zeroed(r, src, lim, back[0] if back else None, r.stat, ws))
    return found


def _float32_statistic_fix(ref: str, form: str = "layer") -> str:
    """The fix for a variance or norm taken by hand in a short-range dtype (NW109, NW115):
    the statistic in float32, the result cast back; ``ref``: the module, as code; ``form``:
    the hand-written norm to show, ``"layer"`` (x - mean over its standard deviation),
    ``"rms"`` (x over its root mean square) or ``"l2"`` (x over its L2 norm)."""
    head = "# compute the statistic in float32 and cast the result back, e.g. "
    keep = f"{ref} in float32: {ref}.float() and cast its input"
    if form == "rms":
        return (
            f"{head}an RMSNorm:\n"
            f"x32 = x.float()   # in the forward of {ref}\n"
            "y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)\n"
            f"# or use nn.RMSNorm / F.rms_norm (they accumulate in float32), or keep {keep}"
        )
    if form == "l2":
        return (
            f"{head}an L2 normalization:\n"
            f"y = F.normalize(x.float(), dim=-1).to(x.dtype)   # in the forward of {ref}\n"
            f"# or keep {keep}"
        )
    return (
        f"{head}a hand-written LayerNorm:\n"
        f"x32 = x.float()   # in the forward of {ref}\n"
        "mu = x32.mean(-1, keepdim=True)\n"
        "var = ((x32 - mu) ** 2).mean(-1, keepdim=True)\n"
        "y = ((x32 - mu) / torch.sqrt(var + eps)).to(x.dtype)\n"
        "# or use nn.LayerNorm / F.layer_norm (they accumulate in float32), or keep "
        f"{keep}"
    )


def _more_paths(paths: list[str]) -> str:
    """The first three of ``paths`` and how many more."""
    return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


@rule(
    "NW109",
    title="Overflow zeroed a module's low-precision output (silently wrong values)",
    severity="warning",
    summary=(
        "Watch mode: a float16 module's output is all exact zeros while its input held "
        "positive values, so far apart that (x - mean) ** 2 passes finfo.max (|x - mean| > "
        "255.9 in float16): a variance or norm computed in float16 became inf and x / inf = "
        "0. No NaN appears; compute the statistic in float32."
    ),
    early=True,
    priority=22,
)
def zeroed_by_overflow(ctx: RuleContext) -> Iterator[Diagnosis]:
    if ctx.anomaly is not None:
        return  # a non-finite value reached a record: the anomaly's rules say what it was
    found = _zeroed_outputs(ctx)
    if not found:
        return
    z = found[0]
    out, src, lim = z.out, z.src, z.lim
    zs, ws = z.zeros, z.wide
    dtype = out.dtype
    spread = ws.max - ws.min
    root = math.sqrt(lim.max)
    evidence = [
        f"{out.where}: all {zs.numel:,} values are exactly 0 in {dtype}",
        f"its input ({src.where}) spans {fmt(ws.min)} to {fmt(ws.max)}: positive values, "
        f"which a ReLU would keep; values {fmt(spread)} apart square to "
        f"up to {fmt(spread**2)}, past {fmt(lim.max)} (torch.finfo(torch.{dtype}).max; "
        f"a square overflows when |x| > {fmt(root)})",
    ]
    if z.grad_in is not None:
        evidence.append(
            f"the gradient that reached {src.path}'s output through it is all 0 too: nothing "
            "flows back through the zeros"
        )
    if len(found) > 1:
        evidence.append("also zeroed: " + _more_paths([f.out.path for f in found[1:]]))
    evidence.append(
        "no module output, loss or gradient holds NaN or inf: the inf stayed inside "
        f"{out.path}'s forward"
    )
    yield ctx.diagnosis(
        path=out.path,
        phase=out.phase.value,
        evidence=evidence,
        explanation=(
            f"{dtype} holds values up to {fmt(lim.max)}, so a square passes it once |x| > "
            f"{fmt(root)}. A variance or norm computed by hand in {dtype} ((x - mean) ** 2, "
            "x.pow(2).sum(), x.norm()) overflows to inf on these inputs, and the division by "
            f"it turns every value into 0 (x / inf = 0): {out.path} outputs zeros, its "
            "gradients are 0, and training goes on without a NaN. (An input whose every row "
            "is constant would also give 0; its deviations would be 0.) mode='forensic' "
            "names the op and line (NW105)."
        ),
        fix=_float32_statistic_fix(module_ref(out.path)),
    )


# ---------------------------------------------------------------------- NW115


@dataclass(frozen=True)
class _Statistic:
    """A statistic of a module's input that its output was divided or multiplied by, as
    the autograd graph below the output shows it (see :func:`nanwatch._graph.digest`)."""

    kind: str  #: ``"square"`` (squares, then a mean or sum), ``"var"`` or ``"norm"``
    dtype: str | None  #: the dtype its squares (or the fused var / norm) were computed in
    centered: bool  #: squares of a difference (``(x - mean) ** 2``), not of the values
    reduce: str  #: the reduction node: ``MeanBackward1``, ``SumBackward1``, ...
    chain: tuple[str, ...]  #: the nodes from the output's down to the squares / the fused op
    divides: bool  #: the output's own node divides by it (not multiplies)


#: autograd nodes a statistic passes through on its way to the product or quotient that
#: normalizes (``sqrt``, ``rsqrt``, ``+ eps``, a clamp, a cast, a reshape, a power, a scalar
#: factor): anything else (a product of two tensors) ends the statistic's path
_STAT_STEPS = frozenset(
    {
        "SqrtBackward0", "RsqrtBackward0", "ReciprocalBackward0", "AddBackward0",
        "AddBackward1", "SubBackward0", "SubBackward1", "RsubBackward1", "ClampBackward0",
        "ClampBackward1", "ClampMinBackward0", "MaximumBackward0", "ExpandBackward0",
        "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "UnsqueezeBackward0",
        "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "CloneBackward0",
        "ToCopyBackward0", "PowBackward0", "PowBackward1",
    }
)  # fmt: skip
#: nodes between a mean or sum and the squares it reduces (a cast, a reshape)
_SHAPE_STEPS = frozenset(
    {
        "ToCopyBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
        "CloneBackward0", "ExpandBackward0", "UnsqueezeBackward0", "SqueezeBackward0",
        "SqueezeBackward1",
    }
)  # fmt: skip
#: reductions that square inside one kernel and give the statistic in the input's dtype
_FUSED_STATS = {
    "LinalgVectorNormBackward0": "norm",
    "NormBackward0": "norm",
    "NormBackward1": "norm",
    "NormBackward2": "norm",
    "NormBackward3": "norm",
    "VarBackward0": "var",
    "VarMeanBackward0": "var",
}
_SUMS = frozenset({"MeanBackward0", "MeanBackward1", "SumBackward0", "SumBackward1"})


def _statistics(nodes: Sequence[Mapping[str, Any]]) -> list[_Statistic]:
    """The statistics of squares (a variance, a mean square, a sum of squares, an L2 norm)
    that the output whose graph ``nodes`` digests (``nodes[0]``, a product or quotient) was
    multiplied or divided by: followed from the operands of its chain of products (``w *
    (x * r)``, ``g * d / s``: a quotient's divisor only) through ``sqrt``, ``rsqrt``, ``+
    eps``, casts and reshapes, down to a mean or sum of squares or a fused var / norm.
    Walks the digest only (its size bounds the walk).

    >>> x = {"op": "torch::autograd::AccumulateGrad", "dtype": "float16", "next": []}
    >>> nodes = [
    ...     {"op": "MulBackward0", "dtype": "float16", "next": [1, 2]}, x,
    ...     {"op": "RsqrtBackward0", "dtype": "float16", "next": [3]},
    ...     {"op": "MeanBackward1", "dtype": "float16", "next": [4]},
    ...     {"op": "PowBackward0", "dtype": "float16", "next": [1], "exponent": 2.0},
    ... ]
    >>> [(s.kind, s.dtype, s.centered, s.chain[-1]) for s in _statistics(nodes)]
    [('square', 'float16', False, 'PowBackward0')]
    """

    def op(i: int) -> str:
        return str(nodes[i].get("op", ""))

    def nexts(i: int) -> list[int]:
        return [j for j in nodes[i].get("next", ()) if isinstance(j, int) and 0 <= j < len(nodes)]

    def square_below(i: int, seen: set[int]) -> list[int] | None:
        """The squares a mean or sum at ``i`` reduces, with the casts and reshapes between
        (``[cast, ..., squares]``)."""
        for j in nexts(i):
            if j in seen:
                continue
            seen.add(j)
            if nodes[j].get("exponent") == 2.0:
                return [j]
            if op(j) in _SHAPE_STEPS:
                below = square_below(j, seen)
                if below is not None:
                    return [j, *below]
        return None

    found: list[_Statistic] = []

    def walk(i: int, path: tuple[int, ...], divides: bool, seen: set[int]) -> None:
        name = op(i)
        chain = (*path, i)
        kind = _FUSED_STATS.get(name)
        if kind is not None:
            names = tuple(op(k) for k in chain)
            found.append(
                _Statistic(kind, nodes[i].get("dtype"), kind == "var", name, names, divides)
            )
            return
        if name in _SUMS:
            steps = square_below(i, set())
            if steps is not None:
                sq = steps[-1]
                below = nexts(sq)
                centered = bool(below) and op(below[0]).startswith(("SubBackward", "RsubBackward"))
                names = tuple(op(k) for k in (*chain, *steps))
                found.append(
                    _Statistic("square", nodes[sq].get("dtype"), centered, name, names, divides)
                )
            return
        if name not in _STAT_STEPS and not (name in _graph.PRODUCTS and len(nexts(i)) == 1):
            return  # a product of two tensors, a leaf, another module's output: not a statistic
        for j in nexts(i):
            if j not in seen:
                seen.add(j)
                walk(j, chain, divides, seen)

    def products(i: int, path: tuple[int, ...]) -> None:
        kids = list(nodes[i].get("next", ()))  # by position: None for a batch or a number
        if op(i) not in _graph.PRODUCTS or len(kids) != 2 or nodes[i].get("exponent") == 2.0:
            return
        div = op(i) == "DivBackward0"
        for k, j in enumerate(kids):
            if not isinstance(j, int) or not 0 <= j < len(nodes):
                continue
            if op(j) in _graph.PRODUCTS and not (div and k == 1):
                products(j, (*path, i))  # w * (x * r), g * d / s: the chain of products
            elif not div or k == 1:
                walk(j, (*path, i), div, {j})

    if nodes:
        products(0, ())
    return found


def _graph_notes(ctx: RuleContext) -> dict[int, list[Mapping[str, Any]]]:
    """The digests of autograd graphs the watcher read this step (notes of kind ``"graph"``),
    by the index of the record whose tensor's graph it is."""
    out: dict[int, list[Mapping[str, Any]]] = {}
    for n in ctx.notes("graph"):
        idx, nodes = n.data.get("record"), n.data.get("nodes")
        if isinstance(idx, int) and isinstance(nodes, list):
            out[idx] = nodes
    return out


def _stat_reach(st: _Statistic, s: TensorStat, width: int, lim: DtypeLimits) -> tuple[float, float]:
    """How far ``s`` (the input's statistics) takes the statistic ``st``, and the bound past
    which it does not fit ``lim``: a square passes finfo.max once the value squared (a
    deviation: the input's spread; else its largest |x|) passes sqrt(finfo.max); a variance
    at most (spread / 2)² passes it once the spread passes 2·sqrt(finfo.max); an L2 norm of
    ``width`` values of |x| once |x| passes finfo.max / sqrt(width)."""
    root = math.sqrt(lim.max)
    if st.kind == "norm":
        return s.magnitude, lim.max / math.sqrt(max(width, 1))
    if st.kind == "var":
        return s.max - s.min, 2 * root
    return (s.max - s.min if st.centered else s.magnitude), root


@dataclass(frozen=True)
class _WideNorm:
    """A low-precision module output divided or multiplied, in that dtype, by a statistic
    of its input computed in that dtype (the autograd graph shows it: ``stat``; without a
    graph, a division whose output is normalized: values of both signs, max |y| between
    1 and sqrt(last dim)), from an input too wide for the statistic to fit the dtype."""

    out: Record  #: the module's output: finite, not all 0
    src: Record  #: its input of the same dtype, past the statistic's bound
    lim: DtypeLimits
    width: int  #: the output's last dim, the one a norm runs over
    normed: TensorStat  #: ``out``'s statistics
    wide: TensorStat  #: ``src``'s statistics
    stat: _Statistic | None = None  #: what the graph showed; None when no graph was read


#: the autograd node of a tensor-by-tensor division (x / std): an output it made was
#: computed in its own dtype, not cast from float32 (ToCopyBackward0) nor made by a fused
#: norm kernel that accumulates in float32 (NativeLayerNormBackward0)
_DIVISION = "DivBackward0"


def _one_divisor(out: TensorStat, src: TensorStat, eps: float) -> bool:
    """The output's min and max are the input's divided by one positive number (x / c, a
    constant scale): a per-row normalization divides rows by different numbers, and
    subtracting a mean moves min and max apart."""
    if src.min >= 0 or src.max <= 0:
        return False
    a, b = out.min / src.min, out.max / src.max
    return abs(a - b) <= 4 * eps * max(abs(a), abs(b))


def _wide_norms(ctx: RuleContext) -> list[_WideNorm]:
    """Watch mode's records alone: module outputs in a short-range dtype divided or
    multiplied by a statistic of their input computed in that dtype, whose input of that
    dtype is too wide for the statistic (a square past finfo.max). Where the watcher read
    the output's autograd graph (a ``"graph"`` note), the graph says it: a mean or sum of
    squares, a var or a norm taken in that dtype, on the path of a divisor or factor, with
    no cast from float32 after the squares; a statistic taken in float32 and cast back
    stays silent. Without a graph, a division in that dtype (its node) whose output is
    normalized (values of both signs, max |y| between 1 and sqrt of the last dim: what
    dividing by a row's standard deviation or root mean square gives) from an input
    spreading wider than sqrt(finfo.max). An all-zero output is NW109's."""
    trace = ctx.trace
    dtypes = {r.dtype for r in trace.records}
    if not any((lim := low_precision(d)) is not None and lim.short_range for d in dtypes):
        return []  # no float16 or float8 value this step (the common case): nothing to do
    calls = {c.id: c for c in trace.calls}
    traced = {ev.path for ev in trace.ops if ev.phase is Phase.FORWARD}
    graphs = _graph_notes(ctx)
    found: list[_WideNorm] = []
    for r in trace.records:
        call = calls.get(r.call)
        if r.phase is not Phase.FORWARD or call is None or call.is_loss or call.passthrough:
            continue
        s, lim = r.stat, low_precision(r.dtype)
        if lim is None or not lim.short_range or s is None or not s.finite or _all_zero(s):
            continue
        if r.path in traced or not r.shape or r.shape[-1] < 2:
            continue
        width = r.shape[-1]
        inputs = [
            m
            for m in _inputs_of_record(trace, r)
            if m.dtype == r.dtype and m.stat is not None and m.stat.finite
        ]
        nodes = graphs.get(r.index)
        if nodes is not None:  # the graph says what the output was scaled by
            short = [
                st
                for st in _statistics(nodes)
                if (sl := low_precision(st.dtype)) is not None and sl.short_range
            ]
            hits = [
                (st, m, m.stat)
                for st in short
                for m in inputs
                if m.stat is not None
                and (reach := _stat_reach(st, m.stat, width, lim))[0] > reach[1]
            ]
            if hits:
                st, src, ws = max(hits, key=lambda h: h[2].magnitude)
                found.append(_WideNorm(r, src, lim, width, s, ws, st))
            continue
        if r.grad_fn != _DIVISION:
            continue
        # a row divided by its standard deviation or root mean square has a mean square of
        # 1: some |y| >= 1, none past sqrt(width). A division by an L2 norm keeps |y| <= 1
        # (x / x.norm(): torch's norm accumulates in float32); a softmax is of one sign
        if not (s.min < 0 < s.max) or not 1 < s.magnitude <= math.sqrt(width):
            continue
        root = math.sqrt(lim.max)
        wide = [
            (m, m.stat)
            for m in inputs
            if m.stat is not None
            and m.stat.max - m.stat.min > root
            and not _one_divisor(s, m.stat, lim.eps)
        ]
        if wide:
            src, ws = max(wide, key=lambda w: w[1].magnitude)
            found.append(_WideNorm(r, src, lim, width, s, ws))
    return found


def _statistic_words(st: _Statistic) -> tuple[str, str]:
    """What the statistic is, in words and as code: ``("a variance", "(x - mean) ** 2")``."""
    if st.kind == "norm":
        return "an L2 norm", "x.norm()"
    if st.kind == "var":
        return "a variance", "x.var()"
    total = "mean" if st.reduce.startswith("Mean") else "sum"
    if st.centered:
        return "a variance", f"((x - mean) ** 2).{total}()"
    if total == "sum":
        return "a sum of squares", "x.pow(2).sum()"
    return "a mean square", "x.pow(2).mean()"


def _graph_evidence(z: _WideNorm, st: _Statistic) -> list[str]:
    """The evidence of an output the graph shows scaled by a low-precision statistic."""
    out, lim, ws = z.out, z.lim, z.wide
    dtype = out.dtype
    what, code = _statistic_words(st)
    how = "divided" if st.divides else "multiplied"
    made = (
        f"the squares ({st.chain[-1]}) are {st.dtype}"
        if st.kind == "square"
        else f"{st.chain[-1]} gives {st.dtype}"
    )
    if "ToCopyBackward0" in st.chain:
        made += ", cast only after"
    first = (
        f"{out.where} was {how} in {dtype} by a statistic of its input taken in {st.dtype}: "
        f"{what}, {code} (autograd graph: {' <- '.join(st.chain)}; {made})"
    )
    value, bound = _stat_reach(st, ws, z.width, lim)
    top = f"{fmt(lim.max)} (torch.finfo(torch.{dtype}).max)"
    src = z.src.where
    if st.kind == "norm":
        second = (
            f"its input ({src}) reaches |x| = {fmt(value)}: a row of {z.width} such values has "
            f"an L2 norm of {fmt(value * math.sqrt(z.width))}, past {top}; it overflows once "
            f"|x| > {fmt(bound)} throughout a row"
        )
    elif st.kind == "var":
        second = (
            f"its input ({src}) spans {fmt(ws.min)} to {fmt(ws.max)}: values {fmt(value)} "
            f"apart; a row's variance can reach ({fmt(value)} / 2)² = {fmt((value / 2) ** 2)}, "
            f"past {top}"
        )
    elif st.centered:
        second = (
            f"its input ({src}) spans {fmt(ws.min)} to {fmt(ws.max)}: values {fmt(value)} "
            f"apart; a deviation past {fmt(bound)} squares past {top}"
        )
    else:
        second = (
            f"its input ({src}) reaches |x| = {fmt(value)}: past {fmt(bound)}, x ** 2 passes "
            f"{top}, and the {'mean' if st.reduce.startswith('Mean') else 'sum'} of that row's "
            "squares is inf"
        )
    return [first, second]


def _statistic_form(st: _Statistic | None) -> str:
    """Which hand-written norm the fix shows: ``"layer"``, ``"rms"`` or ``"l2"``."""
    if st is None or st.centered:
        return "layer"
    if st.kind == "norm" or st.reduce.startswith("Sum"):
        return "l2"
    return "rms"


@rule(
    "NW115",
    title="Low-precision normalization of values too wide to square (rows can silently be 0)",
    severity="warning",
    summary=(
        "Watch mode: a module divides or multiplies its float16 input by a statistic of it "
        "taken in float16 (a variance, a mean square, a sum of squares, an L2 norm; told "
        "from the output's autograd graph, or without one from a float16 division whose "
        "output is normalized) while that input is too wide for it (a square passes "
        "finfo.max once |x| > 255.9 in float16): the statistic is inf in such a row and its "
        "output silently becomes 0. Compute the statistic in float32."
    ),
    early=True,
    priority=24,
)
def wide_norm_input(ctx: RuleContext) -> Iterator[Diagnosis]:
    if ctx.anomaly is not None:
        return  # a non-finite value reached a record: the anomaly's rules say what it was
    found = _wide_norms(ctx)
    if not found:
        return
    z = found[0]
    out, src, lim, st = z.out, z.src, z.lim, z.stat
    os_, ws = z.normed, z.wide
    dtype = out.dtype
    root = math.sqrt(lim.max)
    spread = ws.max - ws.min
    if st is not None:
        evidence = _graph_evidence(z, st)
        what, code = _statistic_words(st)
    else:
        evidence = [
            f"{out.where} was made by a {dtype} division ({_DIVISION}: not a cast from "
            f"float32, not a fused norm) and is normalized: {fmt(os_.min)} to {fmt(os_.max)}, "
            f"max |y| between 1 and sqrt({z.width}) = {fmt(math.sqrt(z.width))}, as a "
            "division by a standard deviation or root mean square over its last dim "
            f"({z.width}) gives",
            f"its input ({src.where}) spans {fmt(ws.min)} to {fmt(ws.max)}: values "
            f"{fmt(spread)} apart; a deviation past {fmt(root)} squares past {fmt(lim.max)} "
            f"(torch.finfo(torch.{dtype}).max)",
        ]
        what, code = "a variance", "(x - mean) ** 2, x.pow(2).mean()"
    noun = what.split(" ", 1)[1]
    multiplies = st is not None and not st.divides
    zeroed = "x * rsqrt(inf) = x * 0 = 0" if multiplies else "x / inf = 0"
    evidence.append(
        "watch mode reads each tensor's min and max, not its rows: a row zeroed this way "
        f"({noun} inf, {zeroed}) does not change them"
    )
    if len(found) > 1:
        evidence.append("also: " + _more_paths([f.out.path for f in found[1:]]))
    if st is not None and st.kind == "norm":
        bound = lim.max / math.sqrt(z.width)
        passes = (
            f"so the L2 norm of a row of {z.width} values passes it once they reach |x| > "
            f"{fmt(bound)}"
        )
        where_inf = f"where it passes {fmt(lim.max)}"
        by = "the division by it"
    else:
        passes = f"so a square passes it once |x| > {fmt(root)}"
        where_inf = (
            f"where it passes {fmt(lim.max)}"
            if st is not None and st.kind == "var"
            else "that holds a value whose square passes it"
        )
        by = "the multiplication by its rsqrt" if multiplies else "the division by its square root"
    yield ctx.diagnosis(
        path=out.path,
        phase=out.phase.value,
        evidence=evidence,
        explanation=(
            f"{dtype} holds values up to {fmt(lim.max)}, {passes}. {what[0].upper()}{what[1:]} "
            f"computed by hand in {dtype} ({code}) is inf for every row {where_inf}, and {by} "
            f"turns that row into exact 0s ({zeroed}) while the other rows stay right: "
            f"{out.path}'s min and max look normal, no NaN appears, and nothing flows back "
            "through the zeroed rows. mode='forensic' (or nw.replay(step_fn)) names the op and "
            "line when it happens (NW105)."
        ),
        fix=_float32_statistic_fix(module_ref(out.path), _statistic_form(st)),
    )
