"""The catch-all (NW100): every anomaly gets a diagnosis. It runs only when no specific rule
produced an error-severity diagnosis for the step, says what is known (where it was born,
the op when traced, how far it spread) and how to learn the rest."""

from __future__ import annotations

from collections.abc import Iterator

from nanwatch.records import AnomalyKind
from nanwatch.rules._evidence import (
    anomaly_fields,
    code_line,
    describe_stat,
    op_fields,
    short_op,
    untraced_hint,
)
from nanwatch.rules.base import Diagnosis, RuleContext, rule

_NEXT = {
    AnomalyKind.FORWARD: (
        "with nanwatch.watch(model, criterion, mode='forensic') as nw:   # every aten op "
        "checked\n"
        "    loss = criterion(model(x), y); loss.backward()"
    ),
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
        "A NaN or inf no specific rule explains: where it was born, the op when traced, "
        "and how far it spread (the catch-all; every anomaly gets a diagnosis)."
    ),
    priority=90,
    fallback=True,
)
def non_finite(ctx: RuleContext) -> Iterator[Diagnosis]:
    a = ctx.anomaly
    if a is None:
        return
    evidence = [a.summary]
    fields = anomaly_fields(a)
    if a.op is not None:
        ev = a.op
        fields.update(op_fields(ev, a))
        evidence.append(f"{short_op(ev.op)} made {ev.born} in {ev.dtype or a.record.dtype}")
        for nm, s in ev.inputs[:3]:
            evidence.append(f"input {nm}: {describe_stat(s)}")
        line = code_line(ev)
        if line:
            evidence.append(line)
    else:
        evidence.append(f"{a.record.where}: {describe_stat(a.record.stat)}")
        if a.kind in (AnomalyKind.FORWARD, AnomalyKind.BACKWARD):
            evidence.append(untraced_hint(ctx.facts.get("mode")))
    if a.neginf_source is not None:
        evidence.append(f"a -inf was first seen in {a.neginf_source.where}")
    fix = _NEXT.get(a.kind, "# inspect the named tensor; nw.report has the statistics")
    yield ctx.diagnosis(
        **fields,
        evidence=evidence,
        explanation=(
            f"A non-finite value was born in {a.path} ({a.kind.value}, origin {a.origin}). "
            "None of nanwatch's specific rules (overflow, log of 0, division by 0, sqrt at "
            "0, masking, bad data, weights) matches the evidence; the op checker names the "
            "exact op and line."
        ),
        fix=fix,
    )
