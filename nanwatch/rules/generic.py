"""The catch-all (NW100): every anomaly gets a diagnosis. It runs only when no specific rule
produced an error-severity diagnosis for the step, says what is known (where it was born,
the op and its inputs when traced, how far it spread) and the most useful next step: with
the op known, how to find the elements it broke and the inputs that did it; without it,
how to name the op."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

from nanwatch.records import LOSS_PATH, Anomaly, AnomalyKind, OpEvent, Phase
from nanwatch.rules._evidence import (
    anomaly_fields,
    cause_of,
    code_line,
    describe_stat,
    fmt,
    inf_arithmetic,
    inf_evidence,
    inf_explanation,
    inf_fix,
    inf_source,
    op_fields,
    packet,
    rewrite_call,
    short_op,
    statements,
    top_level,
    untraced_hint,
)
from nanwatch.rules.base import Diagnosis, RuleContext, rule

_FORENSIC = {
    True: (
        "with nanwatch.watch(model, criterion, mode='forensic') as nw:   # every aten op "
        "checked\n"
        "    loss = criterion(model(x), y); loss.backward()"
    ),
    False: (
        "with nanwatch.watch(model, mode='forensic') as nw:   # every aten op checked\n"
        "    ...   # the same step: forward, loss, backward()"
    ),
}
_NEXT = {
    AnomalyKind.BACKWARD: (
        "with torch.autograd.detect_anomaly():          # or mode='forensic'\n"
        "    loss.backward()                            # names the backward op"
    ),
}


@rule(
    "NW100",
    title="Non-finite value",
    severity="error",
    summary=(
        "A NaN or inf no specific rule explains: where it was born, the op and its inputs "
        "when traced, and how far it spread (the catch-all; every anomaly gets a diagnosis)."
    ),
    priority=90,
    fallback=True,
)
def non_finite(ctx: RuleContext) -> Iterator[Diagnosis]:
    a = ctx.anomaly
    if a is None:
        return
    if a.op is not None:
        yield _with_op(ctx, a)
        return
    evidence = [a.summary, f"{a.record.where}: {describe_stat(a.record.stat)}"]
    if a.kind in (AnomalyKind.FORWARD, AnomalyKind.BACKWARD):
        evidence.append(untraced_hint(ctx.facts.get("mode")))
    if a.neginf_source is not None:
        evidence.append(f"a -inf was first seen in {a.neginf_source.where}")
    if a.kind is AnomalyKind.FORWARD:  # name the criterion only when one was watched
        fix = _FORENSIC[_watched_criterion(ctx)]
    else:
        fix = _NEXT.get(a.kind, "# inspect the named tensor; nw.report has the statistics")
    yield ctx.diagnosis(
        **anomaly_fields(a),
        evidence=evidence,
        explanation=(
            f"A non-finite value was born in {a.path} ({a.kind.value}, origin {a.origin}). "
            "None of nanwatch's specific rules (overflow, log of 0, division by 0, sqrt at "
            "0, masking, bad data, weights) matches the evidence; the op checker names the "
            "exact op and line."
        ),
        fix=fix,
    )


def _watched_criterion(ctx: RuleContext) -> bool:
    """A loss module was passed to watch (a root call of one), not only loss code."""
    return any(c.root and c.is_loss and c.path != LOSS_PATH for c in ctx.trace.calls)


def _with_op(ctx: RuleContext, a: Anomaly) -> Diagnosis:
    cause = cause_of(a)
    if cause is not None and cause.kind == "inf-arith":
        return _inf_arithmetic(ctx, a, cause.event, cause.trigger)
    ev = cause.event if cause is not None else a.op
    assert ev is not None
    op = short_op(ev.op)
    dtype = ev.dtype or a.record.dtype
    given = _given(ev)
    evidence = [a.summary, f"{op} made {ev.born} in {dtype} {given}"]
    for nm, s in ev.inputs[:3]:
        evidence.append(f"input {nm}: {describe_stat(s)}")
    for nm, s in ev.other_inputs[:2]:
        evidence.append(f"input {nm}: {_brief(s)}")
    for nm, s in ev.outputs[:3]:
        evidence.append(f"output {nm}: {describe_stat(s)}")
    args = {k: v for k, v in ev.scalars.items() if k not in ("evidence", "backward_at")}
    if args:
        evidence.append("arguments: " + ", ".join(f"{k}={_arg(v)}" for k, v in args.items()))
    line = code_line(ev)
    if line:
        evidence.append(line)
    trigger = cause.trigger if cause is not None else ev
    if trigger is not ev:
        evidence.append(f"then {short_op(trigger.op)} turned it into {trigger.born}")
    if a.neginf_source is not None:
        evidence.append(f"a -inf was first seen in {a.neginf_source.where}")
    backward = ev.phase is Phase.BACKWARD
    where = f" at {ev.source}" if ev.source else ""
    node = f"backward, autograd node {ev.node}, " if backward and ev.node else ""
    explanation = (
        f"{op} created {ev.born} {given}{where} ({node}{a.path}). nanwatch has no "
        "specific rule for this op's failure; its inputs above show the ranges it was "
        "given, and the elements it broke show which of them it does not accept."
    )
    return ctx.diagnosis(
        **op_fields(ev, a),
        evidence=evidence,
        explanation=explanation,
        fix=_inspect_fix(ev),
    )


def _inf_arithmetic(ctx: RuleContext, a: Anomaly, ev: OpEvent, trigger: OpEvent) -> Diagnosis:
    """An op made NaN of the infinities it was given (-inf - (-inf), 0 × inf) and no
    specific rule knew where they came from (a log of 0 is NW110's, a fully masked row
    NW402's): name the operation, the inputs and the suspects."""
    src = inf_source(ctx.trace, a, ev)
    mode = ctx.facts.get("mode")
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=f"NaN from arithmetic on infinities: {inf_arithmetic(ev)}",
        evidence=[a.summary, *inf_evidence(ev, src, trigger, mode)],
        explanation=inf_explanation(ev, src),
        fix=inf_fix(ev, src, forensic=mode == "forensic"),
    )


def _given(ev: OpEvent) -> str:
    """``from finite inputs``, or what the non-finite inputs held: the op checker records
    an op that made a kind of value its inputs did not hold (NaN from -inf, say)."""
    held = [s.kinds() for _, s in ev.inputs if s is not None and not s.finite]
    if not held:
        return "from finite inputs"
    kinds = [k for k in ("NaN", "+inf", "-inf") if any(k in h.split(", ") for h in held)]
    return f"from inputs holding {' and '.join(kinds)}"


def _brief(s: object) -> str:
    from nanwatch.records import TensorStat

    if not isinstance(s, TensorStat):
        return "not measured"
    if s.numel == 0:
        return "empty (0 values)"
    return f"min {fmt(s.min)}, max {fmt(s.max)} ({s.numel:,} values)"


def _arg(v: object) -> str:
    return fmt(v) if isinstance(v, float) else str(v)


def _target(stmt: str) -> str | None:
    """The first assigned name of a statement (``a, _ = attn(...)`` -> ``a``; ``y += f(x)``
    -> ``y``; ``self.h: Tensor = ...`` -> ``self.h``), None when it assigns nothing usable."""
    eqs = [
        i
        for i in top_level(stmt, "=")
        if stmt[i + 1 : i + 2] != "=" and stmt[i - 1 : i] not in ("=", "!", "<", ">", ":")
    ]
    if not eqs:
        return None
    lhs = stmt[: eqs[0]].rstrip()
    lhs = re.sub(r"(?:\*\*|//|>>|<<|[-+*/%@&|^])$", "", lhs).rstrip()  # augmented: y += ...
    colon = top_level(lhs, ":")
    if colon:
        lhs = lhs[: colon[0]].rstrip()  # an annotation
    if lhs[:1] in "([" and _close_at(lhs) == len(lhs) - 1:
        lhs = lhs[1:-1]
    cuts = [-1, *top_level(lhs, ","), len(lhs)]
    for a, b in itertools.pairwise(cuts):
        name = lhs[a + 1 : b].strip().lstrip("*")
        if name != "_" and _TARGET.match(name):
            return name
    return None


_TARGET = re.compile(r"^[A-Za-z_][\w.]*(?:\[[^\]]*\])?$")


def _close_at(text: str) -> int:
    depth = 0
    for i, c in enumerate(text):
        depth += c in "([{"
        depth -= c in ")]}"
        if depth == 0:
            return i
    return -1


def _inspect_fix(ev: OpEvent) -> str:
    """Code that finds the elements the op broke and prints the inputs there: pasted right
    after the op's line, it runs whatever the line assigns (one name, a tuple, nothing)."""
    op = short_op(ev.op)
    if ev.phase is Phase.BACKWARD and ev.source:
        return (
            f"# {ev.node or op} is the backward of the forward op at {ev.source}: its\n"
            f"# derivative is infinite or undefined at some of that op's inputs there\n"
            f"# (e.g. sqrt or acos at an endpoint): keep them off it, x.clamp(lo + eps, hi - eps)"
        )
    if ev.phase is Phase.BACKWARD:
        node = ev.node or op
        return (
            f"# {node} is the backward of a forward op whose derivative is infinite or\n"
            "# undefined at some of its inputs; anomaly mode names that forward line:\n"
            "with torch.autograd.detect_anomaly():\n"
            "    loss.backward()"
        )
    name = packet(ev.op).rstrip("_")
    names = [name, name.removeprefix("special_")]
    stmts = statements(ev.code)
    calls = [st for st in stmts if rewrite_call(st, names, lambda e: e) is not None]
    stmt = calls[0] if calls else next((st for st in stmts if _target(st)), None)
    if stmt is None and stmts:
        stmt = stmts[-1]
    if stmt is None:  # the line is unknown: a function to call where the op runs
        return (
            f"def inspect(y, x):   # call with {op}'s output and input, where it runs\n"
            "    bad = ~torch.isfinite(y)\n"
            f"    print(x[bad])   # the values {op} does not accept"
        )
    got: list[str] = []

    def keep(e: str) -> str:
        got.append(e)
        return e

    rewrite_call(stmt, names, keep)
    first = ev.inputs[0][1] if ev.inputs else None
    same_shape = first is not None and first.numel == ev.output.numel
    where = f"right after {ev.source}" if ev.source else f"where {op} runs"
    lines = [f"# {where}: the elements {op} made {ev.born}, and its input there"]
    out = _target(stmt)
    if out is None:
        expr = re.sub(r"^return\b", "", stmt).strip()
        lines.append(f"out = {expr}")
        out = "out"
    if calls:  # the op itself made the value: a tensor
        lines.append(f"bad = ~torch.isfinite({out})")
    else:  # a module's call: a tensor, or a tuple whose first item is the output
        lines.append(f"bad = ~torch.isfinite({out}[0] if isinstance({out}, tuple) else {out})")
    arg = got[0] if got and same_shape else None
    if arg is not None and re.search(rf"(?<![\w.]){re.escape(out)}(?!\w)", arg) is None:
        lines.append(f"print({arg}[bad])   # the values {op} does not accept")
    else:
        lines.append(f"print(bad.nonzero()[:8])   # then index {op}'s inputs with them")
    return "\n".join(lines)
