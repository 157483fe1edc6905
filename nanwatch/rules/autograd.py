"""Autograd: the "modified by an inplace operation" error mapped to the module whose saved
output was changed, or to the buffer or parameter of a watched module that was (NW403).
PyTorch names an autograd node (``SigmoidBackward0``), or for a tensor no node made only
its type, shape and versions; nanwatch recorded each module output's ``grad_fn`` and version
counter, and at the error reads the watched modules' buffers' and parameters' version
counters (host-side), and matches them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from nanwatch.localize import inplace_suspects, parse_inplace_error
from nanwatch.records import Phase
from nanwatch.rules._evidence import node_base
from nanwatch.rules.base import Diagnosis, RuleContext, rule

#: generic patterns: ``y``, ``r`` and ``m`` stand for the user's tensors
_PATTERNS = (
    "y = y * 2                  # instead of y.mul_(2): out of place keeps the saved tensor\n"
    "y = y + r                  # instead of y += r\n"
    "y = y.masked_fill(m, 0)    # instead of y[m] = 0\n"
    "nn.ReLU(inplace=False)     # instead of inplace=True on a saved tensor\n"
    "y = y.clone(); y.mul_(2)   # or modify a copy"
)


def _state_of(m: dict[str, Any]) -> str:
    """``MoCo.queue (a buffer of MoCo, [8, 64])``."""
    return f"{m.get('name')} (a {m.get('kind')} of {m.get('path')}, {list(m.get('shape') or [])})"


@rule(
    "NW403",
    title="In-place op on a tensor autograd saved",
    severity="error",
    summary=(
        "backward raised 'modified by an inplace operation': names the module whose output, "
        "or the buffer or parameter, autograd saved and something then changed in place "
        "(x.mul_(), +=, inplace=True, a queue or memory bank written before backward)."
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
        what = (
            f"output {facts['output']} of {facts['grad_fn']} (a {facts['tensor_type']} of "
            f"shape {shape})"
            if facts["grad_fn"] is not None
            else f"a {facts['tensor_type']} of shape {shape} that no autograd node made (a "
            "buffer, a parameter, or a view of one)"
        )
        evidence.append(
            f"autograd saved {what} at version {facts['expected_version']}; when backward "
            f"needed it, it was at version {facts['version']}"
        )
    for r in suspects[:3]:
        evidence.append(
            f"{r.path} ({r.module_type}) returned that tensor: {r.dtype} {list(r.shape)}, made "
            f"by {r.grad_fn}, version {r.version} when recorded (step {r.step})"
        )
    if len(suspects) > 3:
        evidence.append(f"and {len(suspects) - 3} more calls matching it")
    fn = node_base(str(facts["grad_fn"] or "")) if facts is not None else ""
    for m in ctx.trace.mutations:
        if (
            m.get("kind") is None
            and node_base(str(m.get("grad_fn") or "")) == fn
            and (not suspects or m.get("path") == suspects[0].path)
        ):
            evidence.append(
                f"{m.get('path')}'s {m.get('role')} went from version "
                f"{m.get('recorded_version')} to {m.get('version')} after it was recorded"
            )
            break
    top = suspects[0] if suspects else None
    state = [m for m in ctx.trace.mutations if m.get("kind") in ("buffer", "parameter")]
    if top is None and state and facts is not None:
        yield _state_diagnosis(ctx, state, facts, evidence)
        return
    lines = next((n.data for n in ctx.trace.notes if n.kind == "inplace_lines"), None)
    if lines is not None:
        evidence.append(_lines_evidence(lines))
    elif top is None:
        evidence.append(
            "no watched module returned a tensor matching it, and no buffer or parameter of "
            "a watched module is at that version: functional code made it; "
            "torch.autograd.set_detect_anomaly(True) names the forward line"
        )
    where = (
        f"{top.path}'s output"
        if top is not None
        else f"output {facts['output']} of {facts['grad_fn']}"
        if facts is not None and facts["grad_fn"] is not None
        else "a tensor"
    )
    fix = _PATTERNS
    if lines is not None:
        fix = _lines_fix(lines)
    elif top is not None:
        fix = f"# {top.path}'s output ({top.module_type}) is the tensor; after it:\n" + fix
    yield ctx.diagnosis(
        path=top.path if top is not None else None,
        phase=Phase.BACKWARD.value,
        step=top.step if top is not None else ctx.step,
        source=lines.get("written_at") if lines is not None else None,
        evidence=evidence,
        explanation=(
            f"Autograd saved {where} during forward to compute a gradient later. Code after "
            "it changed that tensor in place (y.mul_(2), y += r, y[m] = 0, an inplace=True "
            "activation), so the saved value is gone and backward refuses to run. Forward "
            "gave no sign of it; the error names an autograd node, not your module."
        ),
        fix=fix,
    )


def _at(where: object) -> str:
    """``net.py:11``: a line's place by its file's name (the diagnosis's source has the
    path)."""
    return str(where).replace("\\", "/").rsplit("/", 1)[-1]


def _lines_evidence(lines: dict[str, Any]) -> str:
    """What a replay of the forward saw: ``h = torch.sigmoid(self.fc(x))`` (net.py:10) made
    the tensor with sigmoid; ``h += 1`` (net.py:11) then wrote it in place (add_). An op a
    library module ran (``nn.ReLU(inplace=True)``) is told by that module."""
    more = lines.get("matches") or 1
    others = (
        f" ({more - 1} more tensors of that node and shape were made, none written at that version)"
        if more > 1
        else ""
    )
    made_in, written_in = lines.get("made_in"), lines.get("written_in")
    made_by = lines.get("made_by")
    made = f"`{lines.get('made_code')}` ({_at(lines.get('made_at'))}) made it with {made_by}"
    if made_in:
        made = (
            f"{made_in['path']} ({made_in['type']}) made it with {made_by}, "
            f"called from `{lines.get('made_code')}` ({_at(lines.get('made_at'))})"
        )
    written = (
        f"`{lines.get('written_code')}` ({_at(lines.get('written_at'))}) then wrote it in place "
        f"({lines.get('written_by')})"
    )
    if lines.get("written_by") is None:
        return (
            f"the forward run again: {made}; nothing in the forward wrote it in place, so "
            "code that ran after the forward returned did (the loss code, a metric, a hook) "
            "before backward read it"
        )
    if written_in:
        inplace = ", inplace=True" if written_in.get("inplace") else ""
        written = (
            f"{written_in['path']} ({written_in['type']}{inplace}) then wrote it in place "
            f"({lines.get('written_by')}), called from `{lines.get('written_code')}` "
            f"({_at(lines.get('written_at'))})"
        )
    return f"the forward run again: {made}; {written}, before backward read it{others}"


def _lines_fix(lines: dict[str, Any]) -> str:
    """The in-place line made out of place, where it has a plain shape; the library
    module built with ``inplace=False``; else that line and the usual patterns."""
    at, code, new = _at(lines.get("written_at")), lines.get("written_code"), lines.get("rewrite")
    written_in = lines.get("written_in")
    if written_in and written_in.get("inplace"):
        return (
            f"nn.{written_in['type']}(inplace=False)   # {written_in['path']}, where the "
            "model builds it: out of place keeps the tensor autograd saved"
        )
    if new:
        return f"{new}   # instead of {code} ({at})"
    if lines.get("written_by") is None:
        return (
            f"# the tensor: `{lines.get('made_code')}` ({_at(lines.get('made_at'))}); after the "
            f"forward, change a copy of it, not it:\n{_PATTERNS}"
        )
    return f"# {at}: {code}   <- the in-place write; make it out of place:\n{_PATTERNS}"


def _state_diagnosis(
    ctx: RuleContext,
    state: list[dict[str, Any]],
    facts: dict[str, object],
    evidence: list[str],
) -> Diagnosis:
    """The saved tensor is a buffer or parameter of a watched module (or a view of one):
    written in place (a queue, a memory bank, an optimizer update) after forward used it
    and before backward ran."""
    top = state[0]
    name, attr, owner = str(top.get("name")), str(top.get("attr")), str(top.get("path"))
    kind = str(top.get("kind"))
    cls = str(top.get("owner_type") or owner)
    shape = list(facts["shape"]) if isinstance(facts["shape"], tuple) else facts["shape"]
    view = (
        f"; autograd saved a {shape} view of it (self.{attr}.t(), self.{attr}[...]: a view "
        "shares its version counter)"
        if top.get("view")
        else ""
    )
    evidence.append(
        f"{_state_of(top)} is at version {facts['version']}, the version the error reports: "
        f"it was written in place after autograd saved it at version "
        f"{facts['expected_version']}{view}"
    )
    if len(state) > 1:
        evidence.append(
            "also at that version, same size: " + ", ".join(_state_of(m) for m in state[1:])
        )
    renorm = _renormed_in_forward(ctx.trace, top) if kind == "parameter" else None
    if renorm is not None:
        line, tied = renorm
        evidence.append(line)
        user = f"{tied} (tied to {name})" if tied else f"the op that reuses {name}"
        explanation = (
            f"{owner} is an nn.Embedding, and {user} saved {name} for backward. "
            "nn.Embedding(max_norm=...) renormalises the rows it looks up in place, inside "
            f"its own forward: {owner} ran again after that save, with no backward in "
            f"between, and rewrote {name}, so the saved value is gone and backward refuses "
            "to run. No optimizer step is involved."
        )
        reuse = (
            f"logits = F.linear(x, {name}.clone())   # instead of {tied}(x); "
            "import torch.nn.functional as F"
            if tied
            else f"{name}.clone()   # instead of {name} where another op reads it"
        )
        fix = (
            f"# drop max_norm from {owner}'s nn.Embedding(...), or, as the nn.Embedding docs "
            "advise,\n"
            f"# let the tied layer read a copy, so the renorm cannot touch what it saved:\n"
            f"{reuse}"
        )
    elif kind == "parameter":
        explanation = (
            f"Forward used {name}, a parameter of {owner}, in an op that saves it for "
            "backward. Something wrote it in place before that backward ran: "
            "optimizer.step() between two backward() calls that share the graph (a GAN's "
            "generator and discriminator steps), or a weight update by hand, so the saved "
            "value is gone and backward refuses to run."
        )
        fix = (
            f"loss.backward()      # every backward that needs the old {name} first\n"
            f"optimizer.step()     # then the in-place update of {name}\n"
            "# or run the forward again after optimizer.step(), so autograd saves the new value"
        )
    else:
        explanation = (
            f"Forward used {name}, a buffer of {owner}, in an op that saves it for backward "
            f"(x @ self.{attr}: a matmul saves both operands). Code after it wrote the buffer "
            f"in place (self.{attr}[i:j] = ..., self.{attr}.index_copy_(...), a momentum update) "
            "before backward ran, so the saved value is gone and backward refuses to run."
        )
        fix = (
            f"loss.backward()     # first the backward, which needs the old {name}\n"
            f"...                 # then the code that writes {name} in place\n"
            f"# or, in {cls}.forward, let autograd save a copy of the buffer:\n"
            f"self.{attr}.clone()   # instead of self.{attr}"
        )
    return ctx.diagnosis(
        path=owner,
        phase=Phase.BACKWARD.value,
        step=ctx.step,
        evidence=evidence,
        explanation=explanation,
        fix=fix,
    )


def _renormed_in_forward(trace: Any, top: dict[str, Any]) -> tuple[str, str | None] | None:
    """Evidence that an nn.Embedding's own forward wrote its weight: ``max_norm`` makes it
    renormalise the looked-up rows in place (``embedding_renorm_``), and the embedding ran
    again after another call of the step, before any backward of the step (an optimizer
    update, or one by hand, comes after a backward). Also the call that likely saved the
    weight: a Linear mapping the embedding width to its vocabulary (a tied output layer),
    read from the recorded shapes."""
    if top.get("owner_type") != "Embedding" or top.get("max_norm") is None:
        return None  # only an Embedding with max_norm writes its weight in its forward
    owner = top.get("path")
    shape = list(top.get("shape") or [])
    backward = [r.index for r in trace.records if r.phase == Phase.BACKWARD]
    first_backward = min(backward, default=None)
    before: list[Any] = []
    by_id = {c.id: c for c in trace.calls}
    for c in trace.calls:
        if first_backward is not None and c.start >= first_backward:
            break
        if c.path != owner:
            before.append(c)
            continue
        outer, p = set(), c.parent
        while p is not None and p not in outer and p in by_id:  # the calls enclosing c
            outer.add(p)
            p = by_id[p].parent
        before = [b for b in before if b.id not in outer]
        if not before:
            continue
        tied = next((b for b in reversed(before) if _maps(trace, b, shape)), None)
        prior = tied or before[-1]
        line = (
            f"{owner} (Embedding) ran again (call {c.id}) after {prior.path} "
            f"({prior.module_type}, call {prior.id}) in the same forward, before any "
            f"backward: with max_norm set, that call rewrote {top.get('name')}"
        )
        return line, tied.path if tied is not None else None
    return None


def _maps(trace: Any, call: Any, shape: list[int]) -> bool:
    """``call`` is a Linear from the embedding width to the vocabulary: ``x @ weight.t()``
    with the embedding's weight (the recorded input's and output's last dimensions)."""
    if call.module_type != "Linear" or len(shape) != 2:
        return False
    rows = [r for r in trace.records if r.call == call.id]
    ins = [r for r in rows if r.role == "input[0]" and r.shape]
    outs = [r for r in rows if r.role == "output" and r.shape]
    return bool(ins and outs and ins[0].shape[-1] == shape[1] and outs[0].shape[-1] == shape[0])
