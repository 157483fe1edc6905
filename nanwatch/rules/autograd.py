"""Autograd: the "modified by an inplace operation" error mapped to the module whose saved
output was changed (NW403). PyTorch names an autograd node (``SigmoidBackward0``); nanwatch
recorded each module output's ``grad_fn`` and version counter, host-side, and matches them.
"""

from __future__ import annotations

from collections.abc import Iterator

from nanwatch.localize import inplace_suspects, parse_inplace_error
from nanwatch.records import Phase
from nanwatch.rules._evidence import node_base
from nanwatch.rules.base import Diagnosis, RuleContext, rule


@rule(
    "NW403",
    title="In-place op on a tensor autograd saved",
    severity="error",
    summary=(
        "backward raised 'modified by an inplace operation': names the module whose output "
        "autograd saved and something then changed in place (x.mul_(), +=, inplace=True)."
    ),
    priority=10,
)
def inplace_saved(ctx: RuleContext) -> Iterator[Diagnosis]:
    err = ctx.trace.error
    if not err or err.get("class") != "autograd-inplace":
        return
    message = str(err.get("message", ""))
    facts = parse_inplace_error(message)
    traces = [ctx.trace, *reversed(list(ctx.history))]
    suspects = inplace_suspects(traces, message)
    evidence: list[str] = []
    if facts is not None:
        shape = list(facts["shape"]) if isinstance(facts["shape"], tuple) else facts["shape"]
        evidence.append(
            f"autograd saved output {facts['output']} of {facts['grad_fn']} (a "
            f"{facts['tensor_type']} of shape {shape}) at version {facts['expected_version']}; "
            f"when backward needed it, it was at version {facts['version']}"
        )
    for r in suspects[:3]:
        evidence.append(
            f"{r.path} ({r.module_type}) returned that tensor: {r.dtype} {list(r.shape)}, made "
            f"by {r.grad_fn}, version {r.version} when recorded (step {r.step})"
        )
    if len(suspects) > 3:
        evidence.append(f"and {len(suspects) - 3} more calls matching it")
    fn = node_base(str(facts["grad_fn"])) if facts is not None else ""
    for m in ctx.trace.mutations:
        if node_base(str(m.get("grad_fn") or "")) == fn and (
            not suspects or m.get("path") == suspects[0].path
        ):
            evidence.append(
                f"{m.get('path')}'s {m.get('role')} went from version "
                f"{m.get('recorded_version')} to {m.get('version')} after it was recorded"
            )
            break
    top = suspects[0] if suspects else None
    if top is None:
        evidence.append(
            "no watched module returned a tensor matching it: functional code made it; "
            "torch.autograd.set_detect_anomaly(True) names the forward line"
        )
    where = (
        f"{top.path}'s output"
        if top is not None
        else f"output {facts['output']} of {facts['grad_fn']}"
        if facts is not None
        else "a tensor"
    )
    yield ctx.diagnosis(
        path=top.path if top is not None else None,
        phase=Phase.BACKWARD.value,
        step=top.step if top is not None else ctx.step,
        evidence=evidence,
        explanation=(
            f"Autograd saved {where} during forward to compute a gradient later. Code after "
            "it changed that tensor in place (gate.mul_(2), x += y, out[mask] = 0, an "
            "inplace=True activation), so the saved value is gone and backward refuses to "
            "run. Forward gave no sign of it; the error names an autograd node, not your "
            "module."
        ),
        fix=(
            "gate = gate * 2            # was: gate.mul_(2) -- out of place keeps the saved "
            "tensor\n"
            "x = x + residual           # was: x += residual\n"
            "nn.ReLU(inplace=False)     # in-place activations on saved tensors\n"
            "y = x.clone(); y.mul_(2)   # or modify a copy"
        ),
    )
