"""Runtime: an anomaly that a replay of the same step on the same inputs did not reproduce
(NW404). A deterministic bug reproduces; a clean replay points at the hardware, a race or
nondeterminism, and no layer should be blamed."""

from __future__ import annotations

from collections.abc import Iterator

from nanwatch.rules._evidence import anomaly_fields
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
