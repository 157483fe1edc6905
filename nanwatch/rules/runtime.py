"""Runtime: an anomaly that a replay of the same step on the same inputs did not reproduce
(NW404). A deterministic bug reproduces; a clean replay points at the hardware, a race or
nondeterminism, and no layer should be blamed."""

from __future__ import annotations

from collections.abc import Iterator

from nanwatch.rules._evidence import anomaly_fields, module_ref
from nanwatch.rules.base import Diagnosis, RuleContext, rule


@rule(
    "NW404",
    title="Transient: a replay on the same inputs ran clean",
    severity="error",
    summary=(
        "The non-finite value did not come back when the same computation was replayed on "
        "the same inputs: a hardware fault, a race or nondeterminism, not a layer's bug."
    ),
    priority=1,
)
def transient(ctx: RuleContext) -> Iterator[Diagnosis]:
    a = ctx.anomaly
    if a is None or not a.transient:
        return
    s = a.record.stat
    yield ctx.diagnosis(
        **anomaly_fields(a),
        evidence=[
            f"first seen: {a.summary}",
            f"{a.record.where} held {s.kinds() if s else 'a non-finite value'} in "
            f"{a.record.dtype} on {a.record.device}",
            "a replay of the same computation on the same inputs, every aten op checked, "
            "produced no NaN or inf",
        ],
        explanation=(
            "A bug in the model's math reproduces on the same inputs; this one did not. "
            "Suspect what differs between two runs of the same code: a GPU memory or "
            "compute fault (check ECC errors, try another device), a data race (an "
            "in-place op on a tensor another stream still reads, a non-blocking copy read "
            "too early), or nondeterministic kernels. Blaming the layer it surfaced in "
            "would send you the wrong way."
        ),
        fix=(
            "torch.use_deterministic_algorithms(True)   # rule out nondeterministic kernels\n"
            "# CUDA_LAUNCH_BLOCKING=1 python train.py    # rule out async races\n"
            "# nvidia-smi -q -d ECC,PAGE_RETIREMENT      # rule out a failing GPU\n"
            "# rerun on another device with the same seed and batch"
        ),
    )


@rule(
    "NW405",
    title="Non-finite module state read by the forward",
    severity="error",
    summary=(
        "A replay of the module on the same inputs made the NaN/inf again, but no op in it "
        "created it: the forward read a non-finite tensor that is not an input (a weight "
        "a forward pre-hook such as weight_norm or spectral_norm computes, a buffer)."
    ),
    priority=5,
)
def module_state(ctx: RuleContext) -> Iterator[Diagnosis]:
    a = ctx.anomaly
    if a is None or a.transient:
        return
    note = next((n for n in ctx.trace.notes if n.kind == "module_state" and n.path == a.path), None)
    if note is None:
        return
    tensors = note.data.get("tensors") or []
    if not tensors:
        return
    names = [f"{a.path}.{t['name']}" for t in tensors]
    evidence = [
        f"{a.path}.{t['name']} ({t['kind']}, {t['dtype']}) holds {t['stat']}" for t in tensors[:4]
    ]
    evidence.append(
        f"a replay of {a.path}'s forward on the same inputs, every aten op checked, made it "
        "again, but no op in it created it: it came in with the tensors above"
    )
    hooked = any(t["kind"] == "set by a forward pre-hook" for t in tensors)
    call = ctx.trace.call(a.record.call)
    ref = module_ref(a.path, root=call is None or call.root)
    if hooked:
        explanation = (
            f"{names[0]} is not a parameter: a forward pre-hook computes it from the real "
            "parameters before each call (weight_norm: g · v / ‖v‖, spectral_norm: W / σ). "
            "A zero row of v, or an all-zero W (σ = 0), makes it 0/0 = NaN on every call; "
            "nothing in the forward itself is wrong."
        )
        fix = (
            f"m = {ref}   # the rows it divides by: re-init zeros\n"
            "for n, p in m.named_parameters():\n"
            "    if p.dim() > 1:\n"
            "        print(n, 'zero rows:', (p.flatten(1).norm(dim=1) == 0).sum().item())"
        )
    else:
        explanation = (
            f"{names[0]} was already non-finite when the forward ran: it was set or updated "
            "outside the forward (a buffer written in place, a tensor attribute assigned by "
            "your code, a running statistic), so the layer only passed it on."
        )
        running = any(t["name"].startswith("running_") for t in tensors)
        fix = (
            f"m = {ref}\n"
            "print([n for n, t in [*m.named_buffers(), *m.named_parameters(), *vars(m).items()]\n"
            "       if torch.is_tensor(t) and not torch.isfinite(t).all()])\n"
            + (
                "m.reset_running_stats()   # the running statistics start afresh\n"
                if running
                else ""
            )
            + "# then find the code that writes it"
        )
    yield ctx.diagnosis(**anomaly_fields(a), evidence=evidence, explanation=explanation, fix=fix)
