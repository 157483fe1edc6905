"""Math outside its domain: log of zero or of a negative number (NW110), division by zero
and 0/0 (NW111), sqrt and fractional powers at zero or below, forward and backward-only
(NW112). Each names the aten op and the user's line when the op checker saw it, and
otherwise the module and what to run to name the op.
"""

from __future__ import annotations

from collections.abc import Iterator

from nanwatch.records import Anomaly, AnomalyKind, OpEvent, Phase, Record
from nanwatch.rules._evidence import (
    anomaly_fields,
    cause_of,
    code_line,
    describe_stat,
    exact,
    first_input,
    fmt,
    has_zero,
    input_named,
    inputs_of,
    node_base,
    op_fields,
    packet,
    short_op,
    untraced_hint,
)
from nanwatch.rules.base import Diagnosis, RuleContext, rule


def _chain_evidence(ev: OpEvent, trigger: OpEvent, what: str) -> list[str]:
    out: list[str] = []
    line = code_line(ev)
    if line:
        out.append(line)
    if trigger is not ev:
        tline = f" {code_line(trigger)}" if code_line(trigger) else ""
        why = " (0 × inf, inf - inf and inf / inf are NaN)" if "NaN" in trigger.born else ""
        out.append(f"then {short_op(trigger.op)} turned the {what} into {trigger.born}{tline}{why}")
    return out


# ---------------------------------------------------------------------- NW110


@rule(
    "NW110",
    title="Log of zero or of a negative number",
    severity="error",
    summary=(
        "log/log1p/xlogy of 0 gave -inf (or of a negative number NaN); often log of a "
        "probability that underflowed to 0, and a NaN one op later (0 × -inf)."
    ),
    priority=12,
)
def log_of_zero(ctx: RuleContext) -> Iterator[Diagnosis]:
    a = ctx.anomaly
    if a is None or a.transient:
        return
    cause = cause_of(a)
    if cause is not None:
        if cause.kind == "log":
            yield _log_from_op(ctx, a, cause.event, cause.trigger)
        return
    src = a.neginf_source
    if src is None or a.kind is not AnomalyKind.FORWARD or _looks_like_mask(src):
        return
    yield ctx.diagnosis(
        **anomaly_fields(a),
        evidence=[
            f"a -inf first appeared in {src.where} ({src.dtype}): {describe_stat(src.stat)}",
            f"it grew into {a.record.stat.kinds() if a.record.stat else 'NaN'} in {a.record.where}",
            untraced_hint(ctx.facts.get("mode")),
        ],
        explanation=(
            "-inf is what log(0) returns; an arithmetic op on it (0 × -inf, -inf + inf) "
            "returns NaN. The op that made the -inf was not traced; when it is a log, the "
            "fix below applies (when it is an attention mask, see NW402)."
        ),
        fix=_LOG_FIX,
        priority=25,
    )


def _looks_like_mask(rec: Record) -> bool:
    text = f"{rec.path} {rec.module_type}".lower()
    return any(k in text for k in ("attn", "attention", "mask"))


_LOG_FIX = (
    "logp = F.log_softmax(logits, dim=-1)   # not torch.log(torch.softmax(logits, -1))\n"
    "logp = F.logsigmoid(logits)            # not torch.log(torch.sigmoid(logits))\n"
    "loss = F.binary_cross_entropy_with_logits(logits, y)  # not a hand-written BCE\n"
    "logp = torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))  # when only p exists"
)


def _log_from_op(ctx: RuleContext, a: Anomaly, ev: OpEvent, trigger: OpEvent) -> Diagnosis:
    x = first_input(ev)
    op = short_op(ev.op)
    name = packet(ev.op)
    evidence: list[str] = []
    at = "-1" if name == "log1p" else "0"
    if "-inf" in ev.born:
        evidence.append(f"{op} of {at} is -inf: its input holds {_zeros_text(x, name)}")
    if "NaN" in ev.born:
        evidence.append(
            f"{op} of a number below {at} is NaN: its input's minimum is "
            f"{fmt(x.min if x is not None else None)}"
        )
    evidence.append(f"input ({ev.dtype}): {describe_stat(x)}")
    evidence += _chain_evidence(ev, trigger, "-inf")
    if ev.phase is Phase.BACKWARD:
        evidence.append(f"in backward (autograd node {ev.node}): d/dx log(x) = 1/x is inf at 0")
    return ctx.diagnosis(
        **op_fields(ev, a),
        evidence=evidence,
        explanation=(
            f"{op} is -inf at {at} and NaN below it. Probabilities that underflow to exactly "
            "0 (softmax or sigmoid of a large negative logit, especially in float16) make "
            "log(p) = -inf, and the next multiplication by a zero weight or label gives "
            "0 × -inf = NaN. Computing the log from the logits (log_softmax, logsigmoid, "
            "the *_with_logits losses) never forms the 0."
        ),
        fix=_LOG_FIX,
    )


def _zeros_text(x: object, name: str) -> str:
    from nanwatch.records import TensorStat

    if not isinstance(x, TensorStat):
        return "such values"
    if name == "log1p":
        return f"values down to {fmt(x.min)}"
    if x.zeros:
        return f"{x.zeros:,} exact zero{'s' if x.zeros != 1 else ''} of {x.numel:,} values"
    return f"values down to {fmt(x.min)}"


# ---------------------------------------------------------------------- NW111


@rule(
    "NW111",
    title="Division by zero",
    severity="error",
    summary=(
        "aten.div with a zero denominator: x/0 is ±inf and 0/0 is NaN (a std, a range "
        "max - min or a count that is exactly 0 for one batch)."
    ),
    priority=12,
)
def division_by_zero(ctx: RuleContext) -> Iterator[Diagnosis]:
    a = ctx.anomaly
    if a is None or a.transient:
        return
    cause = cause_of(a)
    if cause is None or cause.kind != "div":
        return
    ev = cause.event
    name = packet(ev.op)
    num = input_named(ev, "self", "input")
    den = first_input(ev) if name == "reciprocal" else input_named(ev, "other")
    ins = inputs_of(ev)
    if den is None and len(ins) > 1:
        den = ins[1]
    evidence: list[str] = []
    zero_over_zero = "NaN" in ev.born and has_zero(num) and has_zero(den)
    if den is not None:
        zeros = (
            f"{den.zeros:,} exact zero{'s' if den.zeros != 1 else ''}"
            if den.zeros
            else "exact zeros"
        )
        evidence.append(f"denominator holds {zeros}: {describe_stat(den)}")
    elif "other" in ev.scalars:
        evidence.append(f"denominator: the scalar {ev.scalars['other']}")
    if num is not None and name != "reciprocal":
        evidence.append(f"numerator: {describe_stat(num)}")
    kinds = []
    if "NaN" in ev.born:
        kinds.append("0/0 = NaN" if zero_over_zero or num is None else "NaN")
    if "inf" in ev.born:
        kinds.append("x/0 = ±inf")
    evidence.append(f"{short_op(ev.op)} made {ev.born} in {ev.dtype}: {', '.join(kinds)}")
    evidence += _chain_evidence(ev, cause.trigger, ev.born)
    if ev.phase is Phase.BACKWARD:
        evidence.append(f"in backward (autograd node {ev.node})")
    yield ctx.diagnosis(
        **op_fields(ev, a),
        title="Division by zero (0/0)" if zero_over_zero else "Division by zero",
        evidence=evidence,
        explanation=(
            "A denominator that is almost never zero was exactly zero in this batch: a "
            "standard deviation or a range (max - min) of a feature that did not vary, a "
            "norm of an all-zero vector, a count of selected elements that was 0. x/0 is "
            "±inf and 0/0 is NaN, and the whole column or row goes bad from here."
        ),
        fix=(
            "eps = torch.finfo(d.dtype).eps\n"
            "y = x / d.clamp_min(eps)            # non-negative denominators (std, range, "
            "norm, count)\n"
            "y = x / torch.where(d == 0, torch.ones_like(d), d)   # any sign: leave x as is"
        ),
    )


# ---------------------------------------------------------------------- NW112

_ROOT_NODES = frozenset({"Sqrt", "Rsqrt", "Pow", "Cdist", "Norm", "LinalgVectorNorm"})


@rule(
    "NW112",
    title="sqrt or fractional power at zero or below",
    severity="error",
    summary=(
        "sqrt/pow(x, p<1) of a negative number is NaN; at exactly 0 the forward is finite "
        "but the gradient 1/(2·sqrt(0)) is inf (NaN after × 0): the backward-only NaN."
    ),
    priority=12,
)
def root_at_zero(ctx: RuleContext) -> Iterator[Diagnosis]:
    a = ctx.anomaly
    if a is None or a.transient:
        return
    cause = cause_of(a)
    if cause is not None:
        if cause.kind == "root":
            yield _root_from_op(ctx, a, cause.event, cause.trigger)
        return
    if a.kind is AnomalyKind.BACKWARD:
        yield from _root_backward_untraced(ctx, a)


def _root_from_op(ctx: RuleContext, a: Anomaly, ev: OpEvent, trigger: OpEvent) -> Diagnosis:
    x = first_input(ev)
    op = short_op(ev.op)
    e = ev.scalars.get("exponent")
    evidence: list[str] = []
    backward = ev.phase is Phase.BACKWARD
    if backward:
        node = node_base(ev.node)
        evidence.append(
            f"in backward, {ev.node} ({op}) made {ev.born}: the forward {node.lower()} was "
            "given exact zeros, and its derivative there is infinite "
            "(d/dx sqrt(x) = 1 / (2·sqrt(x)))"
        )
        for nm, s in ev.inputs[:2]:
            evidence.append(f"backward input {nm}: {describe_stat(s)}")
    else:
        what = f"{op} with exponent {e}" if e is not None else op
        if x is not None and x.min < 0:
            evidence.append(
                f"{what} of negative numbers is NaN: its input's minimum is {fmt(x.min)}"
            )
        elif x is not None and has_zero(x):
            evidence.append(f"{what} at 0 is inf (a negative exponent or rsqrt)")
        evidence.append(f"input ({ev.dtype}): {describe_stat(x)}")
    evidence += _chain_evidence(ev, trigger, ev.born)
    return ctx.diagnosis(
        **op_fields(ev, a),
        evidence=evidence,
        explanation=_ROOT_BACKWARD if backward else _root_forward_text(e),
        fix=_ROOT_FIX_BACKWARD if backward else _root_forward_fix(e),
    )


_ROOT_BACKWARD = (
    "sqrt(0) = 0 is a fine forward value, but the derivative 1 / (2·sqrt(x)) is inf at "
    "x = 0, and autograd multiplies it by the gradient of what fed the sqrt (0 for a "
    "squared difference of identical vectors): inf × 0 = NaN. Euclidean distances between "
    "identical samples, norms of zero vectors and x ** 0.5 all do this; the forward pass "
    "never shows a bad value, and the next optimizer step makes every weight NaN."
)

_ROOT_FIX_BACKWARD = (
    "d = torch.linalg.vector_norm(a - b, dim=-1)    # its gradient at 0 is 0\n"
    "d = F.pairwise_distance(a, b)                  # adds eps=1e-6 inside\n"
    "d = ((a - b) ** 2).sum(-1).clamp_min(1e-12).sqrt()   # keep the sqrt off exact 0"
)


def _root_forward_text(e: object) -> str:
    what = f"x ** {e}" if e is not None else "sqrt(x)"
    return (
        f"{what} is not a real number for negative x: PyTorch returns NaN. Values that "
        "should be non-negative come out slightly negative from rounding (a variance "
        "computed as E[x²] - E[x]²), and activations such as x ** 1.5 are simply undefined "
        "for the negative half of their input."
    )


def _root_forward_fix(e: object) -> str:
    if e is not None:
        return (
            f"y = x.sign() * x.abs() ** {e}     # a signed power, defined everywhere\n"
            f"y = torch.relu(x) ** {e}          # or only the positive part"
        )
    return (
        "y = torch.sqrt(v.clamp_min(0) + 1e-12)   # rounding made v slightly negative\n"
        "y = torch.rsqrt(v + eps)                 # eps as in LayerNorm"
    )


def _root_backward_untraced(ctx: RuleContext, a: Anomaly) -> Iterator[Diagnosis]:
    trace = ctx.trace
    calls = {c.id for c in trace.calls if c.path == a.path}
    hit: Record | None = None
    for r in trace.records:
        if r.phase is not Phase.FORWARD or r.call not in calls:
            continue
        node = node_base(r.grad_fn)
        if node in _ROOT_NODES:
            hit = r
            if r.stat is None or r.stat.min == 0.0 or r.stat.zeros:
                break
    if hit is None:
        return
    m = exact(trace, hit)
    s = m.stat if m is not None else None
    zeros = s is not None and (s.min == 0.0 or bool(s.zeros))
    g = a.record
    upstream = [
        r
        for r in trace.records
        if r.phase is Phase.BACKWARD and r.call in calls and r.stat is not None and r.stat.finite
    ]
    evidence = []
    if upstream:
        evidence.append(
            f"the gradient of {a.path}'s output was finite (max |g| "
            f"{fmt(upstream[0].stat.amax if upstream[0].stat else None)}); the gradient it "
            f"passed back to {g.path} ({g.role}) holds "
            f"{g.stat.kinds() if g.stat else 'NaN'}"
            + (f" ({g.stat.nan:,} NaN of {g.stat.numel:,})" if g.stat and g.stat.nan else "")
        )
    evidence.append(
        f"{a.path}'s {hit.role} was made by {hit.grad_fn}"
        + (f" and holds exact zeros (min {fmt(s.min)})" if zeros and s is not None else "")
        + ": d/dx sqrt(x) = 1/(2·sqrt(x)) is inf at 0, and inf × 0 = NaN"
    )
    evidence.append(untraced_hint(ctx.facts.get("mode")))
    yield ctx.diagnosis(
        **anomaly_fields(a),
        evidence=evidence,
        explanation=_ROOT_BACKWARD,
        fix=_ROOT_FIX_BACKWARD,
        priority=14 if zeros else 18,
    )
