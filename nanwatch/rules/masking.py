"""Masking: a fully masked attention row (NW402). ``masked_fill(mask, -inf)`` before a
softmax is normal and never reported; a row that is -inf everywhere has no maximum, and
softmax returns NaN for the whole row. A softmax written by hand over rows or segments
(graph attention: a node whose every edge is masked) fails the same way one op earlier, at
x - max = -inf - (-inf)."""

from __future__ import annotations

from collections.abc import Iterator

from nanwatch.records import Anomaly, AnomalyKind, OpEvent
from nanwatch.rules._evidence import (
    anomaly_fields,
    cause_of,
    code_line,
    describe_stat,
    first_input,
    fmt,
    inf_arithmetic,
    inf_evidence,
    inf_fix,
    inf_source,
    op_fields,
    short_op,
    untraced_hint,
)
from nanwatch.rules.base import Diagnosis, RuleContext, rule

_FIX = (
    "scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)  # not -inf\n"
    "attn = torch.softmax(scores, dim=-1)\n"
    "attn = attn.masked_fill(mask.all(dim=-1, keepdim=True), 0.0)  # rows with no key\n"
    "# and find why a row has nothing to attend to (an empty sequence, length 0)"
)

#: torch.nn modules that mask with -inf inside, from a key_padding_mask the user passes
_TORCH_ATTENTION = frozenset(
    {
        "MultiheadAttention",
        "TransformerEncoderLayer",
        "TransformerDecoderLayer",
        "TransformerEncoder",
        "TransformerDecoder",
        "Transformer",
    }
)

_FIX_TORCH = (
    "empty = key_padding_mask.all(dim=-1)   # samples with no key to attend to (length 0)\n"
    "key_padding_mask[empty, 0] = False     # un-mask one key each: a finite, meaningless row\n"
    "# and leave those samples out of the loss, or drop them from the batch"
)


def _fix_for(ctx: RuleContext, call_id: int) -> str:
    """A torch.nn attention module builds the -inf mask itself from key_padding_mask, so
    the fix is in what it is given; hand-written attention gets the masking fix."""
    call = ctx.trace.call(call_id)
    while call is not None:
        if call.module_type in _TORCH_ATTENTION:
            return _FIX_TORCH
        call = ctx.trace.call(call.parent) if call.parent is not None else None
    return _FIX


_EXPLAIN = (
    "softmax(x) = exp(x - max(x)) / sum(...): on a row where every score is -inf the max "
    "is -inf, x - max is -inf - (-inf) = NaN, and the whole row is NaN. Masking with -inf "
    "is fine as long as every query keeps at least one key; a padding mask for an empty "
    "sequence (length 0), or a causal mask combined with a padding mask, leaves a row with "
    "none. Using the dtype's most negative finite value instead of -inf keeps such rows "
    "finite."
)


@rule(
    "NW402",
    title="Fully masked attention row",
    severity="error",
    summary=(
        "A softmax got a row that is -inf everywhere (every key masked): softmax of all "
        "-inf is NaN, as is x - max(x) in one written by hand over rows or graph segments "
        "(-inf - (-inf)); mask with finfo.min or drop empty rows."
    ),
    priority=10,
)
def fully_masked_row(ctx: RuleContext) -> Iterator[Diagnosis]:
    a = ctx.anomaly
    if a is None or a.transient:
        return
    cause = cause_of(a)
    if cause is not None:
        if cause.kind == "inf-arith":
            yield from _masked_by_hand(ctx, a, cause.event, cause.trigger)
            return
        if cause.kind != "masked-softmax":
            return
        ev = cause.event
        x = first_input(ev)
        evidence = []
        if x is not None:
            evidence.append(
                f"{short_op(ev.op)} input: {x.neginf or 'some':,} of {x.numel:,} scores are "
                "-inf and none is NaN or +inf: at least one row is -inf everywhere"
                if isinstance(x.neginf, int)
                else f"{short_op(ev.op)} input holds -inf and no NaN or +inf"
            )
            evidence.append(f"input: {describe_stat(x)}")
        if ev.output.nan:
            evidence.append(f"output: {ev.output.nan:,} NaN of {ev.output.numel:,} values")
        mask = next((e for e in cause.chain if e.injected), None)
        if mask is not None:
            val = mask.scalars.get("value")
            line = code_line(mask)
            evidence.append(
                f"the -inf came from {short_op(mask.op)}"
                + (f"(value={fmt(val) if isinstance(val, float) else val})" if val else "")
                + (f" {line}" if line else "")
            )
        line = code_line(ev)
        if line:
            evidence.append(line)
        fix = _fix_for(ctx, a.record.call)
        yield ctx.diagnosis(**op_fields(ev, a), evidence=evidence, explanation=_EXPLAIN, fix=fix)
        return
    if a.kind is not AnomalyKind.FORWARD:
        return
    s = a.record.stat
    text = f"{a.path} {a.record.module_type}".lower()
    if s is None or s.has_posinf or s.has_neginf or "atten" not in text:
        return
    call = ctx.trace.call(a.record.call)
    typ = call.module_type if call is not None else a.record.module_type
    yield ctx.diagnosis(
        **anomaly_fields(a),
        evidence=[
            f"NaN (and no inf) born in the attention module {a.path} ({typ}) from finite "
            "inputs: the signature of a softmax over a fully masked row",
            untraced_hint(ctx.facts.get("mode")),
        ],
        explanation=_EXPLAIN,
        fix=_fix_for(ctx, a.record.call),
        priority=20,
    )


_EXPLAIN_BY_HAND = (
    "A row or segment whose every value is masked to -inf (a node with no unmasked edge, an "
    "empty sequence, a causal mask combined with a padding mask) has max = -inf, and "
    "subtracting that max, as a softmax written by hand does, computes -inf - (-inf) = NaN. "
    "Masking with -inf is fine as long as every row or segment keeps one unmasked value; "
    "the dtype's most negative finite value, torch.finfo(dtype).min, keeps empty ones "
    "finite, or skip them."
)


def _masked_by_hand(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, trigger: OpEvent
) -> Iterator[Diagnosis]:
    """x - max(x) over a row or segment that a constant -inf masked everywhere: the
    subtraction of a softmax written by hand (scatter_reduce amax, a segment max)."""
    if inf_arithmetic(ev) != "-inf - (-inf)":
        return
    src = inf_source(ctx.trace, a, ev)
    if src.kind != "mask":
        return
    mode = ctx.facts.get("mode")
    yield ctx.diagnosis(
        **op_fields(ev, a),
        title="Fully masked row or segment: -inf - (-inf) = NaN",
        evidence=inf_evidence(ev, src, trigger, mode),
        explanation=_EXPLAIN_BY_HAND,
        fix=inf_fix(ev, src, forensic=mode == "forensic"),
    )
