"""Runtime: an anomaly that a replay of the same step on the same inputs did not reproduce
(NW404). A deterministic bug reproduces; a clean replay points at the hardware, a race or
nondeterminism, and no layer should be blamed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from nanwatch.records import Phase, StepTrace
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
    # the forward wrote these buffers in place after reading them (an EMA codebook): they
    # were read holding the value and are finite now, and the replay, which started from
    # what was written, ran clean
    overwritten = bool(note.data.get("overwritten"))
    if overwritten:
        listed = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        evidence = [
            f"{a.path}'s forward read {listed} and then wrote {'them' if len(names) > 1 else 'it'} "
            f"in place ({', '.join(str(t['dtype']) for t in tensors[:1])} buffer"
            f"{'s' if len(names) > 1 else ''}): the non-finite value it read is no longer "
            "there",
            f"a replay of {a.path}'s forward on the same inputs, every aten op checked, ran "
            "clean: it started from the values the forward wrote, not the ones it read",
        ]
    else:
        evidence = [
            f"{a.path}.{t['name']} ({t['kind']}, {t['dtype']}) holds {t['stat']}"
            for t in tensors[:4]
        ]
        evidence.append(
            f"a replay of {a.path}'s forward on the same inputs, every aten op checked, made it "
            "again, but no op in it created it: it came in with the tensors above"
        )
    hooked = any(t["kind"] == "set by a forward pre-hook" for t in tensors)
    ref = _reach(ctx, a.path, a.record.call)
    t0 = tensors[0]
    owner, _, leaf = str(t0["name"]).rpartition(".")
    cls = _class_at(ctx, a.path, owner)
    # the tensor as the code that owns it reads it, and as the training loop can
    held = f"self.{leaf}" if leaf.isidentifier() else None
    parts = str(t0["name"]).split(".")
    # the fixes reach the module through ``ref`` itself and bind no name of their own
    # (comprehension variables stay inside): the user's model may be called ``m``, ``p``...
    reachable = ref is not None and all(p.isidentifier() or p.isdigit() for p in parts)
    outside = f"{ref}{_suffix(parts)}" if reachable else None
    holder = f"{ref}{_suffix(parts[:-1])}" if reachable else None  # the module that holds it
    if hooked:
        explanation = (
            f"{names[0]} is not a parameter: a forward pre-hook computes it from the real "
            "parameters before each call (weight_norm: g · v / ‖v‖, spectral_norm: W / σ). "
            "A zero row of v, or an all-zero W (σ = 0), makes it 0/0 = NaN on every call; "
            "nothing in the forward itself is wrong."
        )
        where = "" if ref is not None else f" (in {cls or 'its module'}'s code)"
        fix = (
            f"# the rows it divides by{where}: re-init the zero ones\n"
            "print([(n, (w.flatten(1).norm(dim=1) == 0).sum().item())\n"
            f"       for n, w in {ref or 'self'}.named_parameters() if w.dim() > 1])"
        )
    elif not overwritten and (absorbed := _absorbed_at(ctx, a.path, owner, tensors)):
        # a norm's running statistics: its training forward folded an earlier step's NaN
        # batch into them (the loop skipped that batch's backward, too late)
        cause, norm = absorbed
        what = f"{norm} ({cls})" if cls else norm
        cause_stat = cause.anomaly.record.stat if cause.anomaly is not None else None
        kinds = cause_stat.kinds() if cause_stat is not None else "a non-finite value"
        evidence.append(
            f"step {cause.step} ({_codes(cause)}): {kinds} reached {what} in its training "
            f"forward, which folded it into {' and '.join(names[:2])}"
        )
        owner_s = f"{cls}'s" if cls else "the norm's"
        explanation = (
            f"{names[0]} absorbed the bad batch of step {cause.step} in "
            f"{owner_s} training forward, "
            "which folds each batch's mean and variance into the running statistics "
            "(running = (1 - momentum) * running + momentum * batch) before any loss is "
            "computed: skipping that batch's backward or optimizer step does not undo it. "
            "NaN stays NaN at every later update, and every eval forward, which normalizes "
            "with the running statistics, is NaN. The layer's code is not at fault."
        )
        top = _reach(ctx, _root_path(ctx.trace, a.record.call) or a.path, a.record.call)
        lines = [
            "# check the batch before the forward, not the loss after it (x: the input your",
            "# loop feeds the model), in the training loop:",
            "if not torch.isfinite(x).all(): continue",
            "# then restore the running statistics, and recalibrate them on clean batches in",
            "# train mode (torch.optim.swa_utils.update_bn(loader, model) does both):",
        ]
        if top is not None:
            lines += [
                f"for m in {top}.modules():",
                '    if hasattr(m, "reset_running_stats"): m.reset_running_stats()',
            ]
        elif holder is not None:
            lines.append(f"{holder}.reset_running_stats()")
        # a consequence of that step's anomaly: listed after the diagnoses of it
        after = [d.priority + 1 for d in cause.diagnoses if d.severity == "error"]
        yield ctx.diagnosis(
            **anomaly_fields(a),
            evidence=evidence,
            explanation=explanation,
            fix="\n".join(lines),
            **({"priority": max(after)} if after else {}),
        )
        return
    elif not overwritten and _from_the_start(ctx, tensors):
        # non-finite at the first forward nanwatch saw, before any update: made so when the
        # module was built (its __init__: a register_buffer of a 0/0) or loaded
        kind = "buffer" if t0["kind"] == "buffer" else "tensor attribute"
        built = _owner_type(ctx, a.path, t0["name"])
        when = (
            "when nanwatch attached"
            if t0.get("finite_at_attach") is False
            else f"at the first forward nanwatch saw (step {ctx.step}, before any update)"
        )
        evidence.append(f"{names[0]} already held {t0['stat']} {when}")
        explanation = (
            f"{names[0]} ({kind}) already held {t0['stat']} {when}: it was computed so when "
            f"the module was built (in {built}) or loaded from a checkpoint, not by "
            "training; the forward only passed it on. A constant table built at init (a "
            "filterbank, a window, a positional table) normalized by a sum, a norm or a "
            "count that is 0 for one of its rows gets 0/0 = NaN there."
        )
        listed = ", ".join(repr(t["name"]) for t in tensors[:4])
        if ref is not None:
            fix = (
                "# right after building it (or loading its checkpoint):\n"
                f"print([n for n, t in [*{ref}.named_buffers(), *vars({ref}).items()]\n"
                f"       if torch.is_tensor(t) and not torch.isfinite(t).all()])   # {listed}\n"
            )
        elif held is not None:
            fix = (
                f"# in {built}, right after it computes {leaf}:\n"
                f"assert torch.isfinite({held}).all(), '{leaf} is {t0['stat']} from the start'\n"
            )
        else:
            fix = ""
        fix += (
            f"# then fix the code in {built} that computes it (or the checkpoint): "
            "keep its denominators off 0, e.g. x / x.sum(dim, keepdim=True).clamp_min(1e-12)"
        )
    else:
        running = any(t["name"].split(".")[-1].startswith("running_") for t in tensors)
        explanation = (
            f"{a.path}'s forward read its own buffers before writing them in place (an EMA "
            "update: mul_(decay).add_(...), a copy_ of avg / count under no_grad): the "
            "non-finite value it read was written by an earlier call (a division by a "
            "count that is 0 for an entry never used), and no op of this forward made it. "
            "The replay started from the values written since, so the value it read is "
            "gone. Check each buffer right after each write to find the one that makes it "
            "non-finite."
            if overwritten
            else f"{names[0]} was already {t0['stat']} when the forward ran, and no op of the "
            "forward made it so: it was written outside the forward (a buffer updated in "
            "place, a copy_ under no_grad, a tensor attribute your code assigns"
            + (", a running statistic" if running else "")
            + "), so the layer only passed it on. Check it right after each write to "
            "find the one that makes it non-finite."
        )
        lines = []
        if running and holder is not None:
            top = _reach(ctx, _root_path(ctx.trace, a.record.call) or a.path, a.record.call)
            lines += _restore_running(holder, top, cls)
        lines.append(
            f"# right after each line that writes {leaf} ("
            + (f"in {cls}'s methods or " if cls else "")
            + "your training loop), to catch the writer:"
        )
        # runnable where the fix's names are the user's: through m in the training loop,
        # else as the owning class's own code reads it
        if outside is not None:
            lines.append(
                f"assert torch.isfinite({outside}).all(), '{leaf} became {t0['stat']}'"
                + (f"   # in {cls}'s code: {held}" if cls and held else "")
            )
        elif held is not None:
            lines.append(
                f"assert torch.isfinite({held}).all(), '{leaf} became {t0['stat']}'"
                + (f"   # in {cls}" if cls else "")
            )
        fix = "\n".join(lines)
    yield ctx.diagnosis(**anomaly_fields(a), evidence=evidence, explanation=explanation, fix=fix)


_RUNNING = frozenset({"running_mean", "running_var"})


def _restore_running(holder: str, top: str | None, cls: str | None) -> list[str]:
    """The fix for running statistics that hold NaN/inf: reset them, then re-estimate them
    on clean batches, or reload them. A reset alone leaves mean 0 / var 1 for every channel:
    finite, but not the statistics the layer's weights were trained with, so the outputs
    are wrong."""
    model = top or "model"
    lines = [
        "# reload the running statistics from a clean checkpoint, or reset them and",
        "# re-estimate them on clean batches (a reset alone gives mean 0 / var 1: finite, wrong):",
        f"{holder}.reset_running_stats()",
    ]
    if cls is not None and "BatchNorm" in cls:
        # update_bn resets every BatchNorm and runs train-mode forwards under no_grad
        # with a cumulative average (momentum=None), then restores the mode
        lines.append(
            f"# then: torch.optim.swa_utils.update_bn(loader, {model})   (loader: your clean "
            "training batches; it restores eval mode)"
        )
    else:
        lines.append(
            f"# then, on clean batches: {model}.train(); with torch.no_grad(): {model}(x) "
            f"for each batch x; {model}.eval()"
        )
    return lines


def _absorbed_at(
    ctx: RuleContext, path: str, owner: str, tensors: list[dict[str, Any]]
) -> tuple[StepTrace, str] | None:
    """The earlier step (of the history, oldest first) whose non-finite forward value
    reached the norm that holds the non-finite running statistics ``tensors`` (``owner``
    below the module at ``path``), and that norm's path: a step whose first anomaly was
    seen before the norm ran in it (its input, an output upstream), or, where the norm's
    calls were not recorded (sentinel), in the input of the root that holds it. None when
    the tensors are not running statistics or no step of the history shows one."""
    if not all(str(t.get("name", "")).rpartition(".")[2] in _RUNNING for t in tensors):
        return None
    want = {path} if not owner else {owner, f"{path}.{owner}"}
    root = _root_path(ctx.trace, ctx.anomaly.record.call) if ctx.anomaly is not None else None
    for t in ctx.history:
        an = t.anomaly
        if an is None or an.record.phase not in (Phase.INPUT, Phase.FORWARD):
            continue
        norms = [c for c in t.calls if c.path in want]
        if norms:
            hit = next((c for c in norms if c.start >= an.record.index), None)
            if hit is not None:
                return t, hit.path
        elif (
            an.record.phase is Phase.INPUT
            and root is not None
            and _root_path(t, an.record.call) == root
        ):
            return t, f"{path}.{owner}" if owner else path
    return None


def _root_path(trace: StepTrace, call_id: int) -> str | None:
    """The path of the root call of ``trace`` that holds call ``call_id``."""
    call = trace.call(call_id)
    while call is not None and not call.root and call.parent is not None:
        call = trace.call(call.parent)
    return call.path if call is not None and call.root else None


def _codes(t: StepTrace) -> str:
    """``NW401`` (the error codes of step ``t``), or ``anomaly`` when it has none."""
    codes = list(dict.fromkeys(d.code for d in t.diagnoses if d.severity == "error"))
    return ", ".join(codes[:2]) if codes else "anomaly"


def _suffix(parts: list[str]) -> str:
    """``[".0", "fc"]`` -> ``[0].fc``: attribute and index access to a module's child."""
    return "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in parts)


def _from_the_start(ctx: RuleContext, tensors: list[dict[str, Any]]) -> bool:
    """The first non-finite tensor is a buffer or a plain attribute (not a running
    statistic) that was bad from the start: the attach check found it so (a note's
    ``finite_at_attach``, when the watcher records it), or it was bad at the first forward
    of the run, before any update (the first step, no history)."""
    t = tensors[0]
    if t.get("kind") not in ("buffer", "attribute") or str(t.get("name", "")).split(".")[
        -1
    ].startswith("running_"):
        return False
    at_attach = t.get("finite_at_attach")
    if at_attach is not None:
        return at_attach is False
    return not ctx.history and ctx.step == 0


def _reach(ctx: RuleContext, path: str, call_id: int) -> str | None:
    """The expression that reaches the module at ``path`` from the name the user's code
    gives it (``model.enc.fc``; ``criterion`` for a watched loss), when the fix's generic
    name stands for one watched root; None when it stands for none (a second model, one of
    several losses): a fix that named ``model`` there would name the wrong module."""
    call = ctx.trace.call(call_id)
    root = call
    while root is not None and not root.root:
        root = ctx.trace.call(root.parent) if root.parent is not None else None
    if call is None or root is None:
        return None
    same = {c.path for c in ctx.trace.calls if c.root and c.is_loss == root.is_loss}
    if len(same) != 1:
        return None
    here = call.root or path == root.path  # the root itself (named by its class)
    if root.is_loss:
        return "criterion" if here else None
    return module_ref(path, root=here)


def _class_at(ctx: RuleContext, path: str, sub: str) -> str | None:
    """The class of the module ``sub`` below the module at ``path`` (``path`` itself when
    ``sub`` is empty), from the step's calls; None when no call shows it."""
    want = {path} if not sub else {sub, f"{path}.{sub}"}
    return next((c.module_type for c in ctx.trace.calls if c.path in want and c.module_type), None)


def _owner_type(ctx: RuleContext, path: str, name: str) -> str:
    """``MelFrontend.__init__`` for a tensor ``name`` held by the module at ``path`` (its
    class from the step's calls); a generic phrase when a submodule holds it or the class
    is not known."""
    if "." not in name:
        for c in ctx.trace.calls:
            if c.path == path and c.module_type:
                return f"{c.module_type}.__init__"
    return "its module's __init__"
