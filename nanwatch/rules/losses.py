"""Losses: BCELoss saturation (NW201), activation/loss pairing from the data flow
(NW202 Sigmoid -> BCELoss, NW203 Softmax -> CrossEntropyLoss, NW204 Softmax -> NLLLoss,
NW205 probabilities where logits are expected) and large logits at ignore_index positions
under low precision (NW206).

The data flow comes from the records (a loss call's ``input[0]`` links, through ``source``,
to the module output it received; ``grad_fn`` names functional activations) and, when the
guards ran, from their ``loss_input`` notes.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Iterator
from typing import Any

from nanwatch.records import LOSS_PATH, Phase, Record, StepTrace
from nanwatch.rules._evidence import (
    Activation,
    LossUse,
    _call_name,
    _parsed,
    _statement_key,
    cause_of,
    describe_activation,
    fmt,
    full_statement,
    limits,
    loss_activation,
    loss_call_in,
    loss_input_rewrite,
    loss_uses,
    low_precision,
    module_ref,
    note_num,
    paren,
    statements,
)
from nanwatch.rules.base import Diagnosis, RuleContext, rule

#: PyTorch's BCE clamps log(p) and log(1 - p) at -100: a confidently wrong element costs 100.
BCE_LOG_CLAMP = 100.0
#: PyTorch's BCE backward divides by max(p·(1 - p), 1e-12): at p exactly 0 or 1 the input
#: gradient of a wrong element is about 1e12 / numel (mean reduction). A product of |grad|
#: and numel this large cannot come from any p that is not exactly 0 or 1 in float32 or wider.
_BCE_GRAD_SIGNATURE = 1e10


# ---------------------------------------------------------------------- NW201


@rule(
    "NW201",
    title="BCELoss on saturated probabilities (the massive loss)",
    severity="error",
    summary=(
        "BCELoss got probabilities exactly 0 or 1: PyTorch clamps log at -100, so each "
        "confidently wrong element costs 100 and its gradient is 0; use BCEWithLogitsLoss."
    ),
    early=True,
    priority=10,
)
def bce_saturated(ctx: RuleContext) -> Iterator[Diagnosis]:
    frac = ctx.thresholds.bce_saturated_fraction
    for use in loss_uses(ctx.trace):
        if use.kind != "bce":
            continue
        d = _bce_saturation(ctx, use, frac)
        if d is not None:
            yield d


def _bce_saturation(ctx: RuleContext, use: LossUse, frac: float) -> Diagnosis | None:
    s = use.input_stat
    loss = use.value
    clamped = note_num(use.note, "value_clamped")
    zeros = note_num(use.note, "exact_zeros")
    ones = note_num(use.note, "exact_ones")
    counted_by_guard = zeros is not None or ones is not None
    if counted_by_guard:  # the guard counted them: trust it over min/max
        exact = bool((zeros or 0) + (ones or 0))
    else:
        exact = s is not None and (s.min == 0.0 or s.max == 1.0)
    derived = (
        None if exact or s is not None or counted_by_guard else _sigmoid_saturation(ctx.trace, use)
    )
    if not (exact or derived):
        return None
    if clamped is not None and not clamped:
        # the guard counted the elements at the -100 clamp and found none: every saturated
        # probability is confidently right (p = 1 with target 1 costs 0), the loss is not
        # the massive loss
        return None
    grad = _input_grad_magnitude(ctx.trace, use)
    numel = s.numel if s is not None else _numel(use)
    signature = grad is not None and numel is not None and grad * numel >= _BCE_GRAD_SIGNATURE
    big_loss = loss is not None and math.isfinite(loss) and loss >= BCE_LOG_CLAMP * frac
    if not (clamped or signature or big_loss):
        return None
    evidence: list[str] = []
    if zeros is not None or ones is not None:
        n = int((zeros or 0) + (ones or 0))
        evidence.append(
            f"{n:,} of the {numel or '?'} probabilities are exactly 0 or 1 "
            f"({int(zeros or 0):,} zeros, {int(ones or 0):,} ones)"
        )
    elif derived:
        evidence.append(derived)
    elif s is not None:
        evidence.append(
            f"{use.path}'s input spans [{fmt(s.min)}, {fmt(s.max)}]: probabilities exactly "
            f"{'0 and 1' if s.min == 0.0 and s.max == 1.0 else ('0' if s.min == 0.0 else '1')}"
        )
    if clamped:
        share = ""
        if numel:
            share = f", {fmt(clamped * BCE_LOG_CLAMP / numel)} of the mean loss"
        evidence.append(
            f"{int(clamped):,} elements hit the log clamp at -{fmt(BCE_LOG_CLAMP)} "
            f"(each costs {fmt(BCE_LOG_CLAMP)}{share})"
        )
    if loss is not None:
        evidence.append(
            f"loss = {fmt(loss)}: {loss / BCE_LOG_CLAMP:.0%} of the elements at the clamp "
            f"would explain it ({fmt(BCE_LOG_CLAMP)} per confidently wrong element)"
        )
    if signature and grad is not None:
        evidence.append(
            f"the gradient at the loss input reaches {fmt(grad)}: BCE's backward divides by "
            "max(p·(1 - p), 1e-12), which only happens at p exactly 0 or 1"
        )
    strong = bool(clamped) or signature
    call = use.call
    dtype = use.input_dtype or "float32"
    lim = limits(dtype)
    one_at = fmt(math.log(2 / lim.eps)) if lim is not None else "?"
    return ctx.diagnosis(
        **_at_loss(use),
        severity="error" if strong else "warning",
        evidence=evidence,
        explanation=(
            "BCELoss takes probabilities. A sigmoid rounds to exactly 1.0 for logits above "
            f"log(2 / eps) = {one_at} in {dtype} and to 0.0 far below; log(0) would be "
            f"-inf, so PyTorch clamps it at -{fmt(BCE_LOG_CLAMP)}. Each confidently wrong "
            f"prediction then costs exactly {fmt(BCE_LOG_CLAMP)}: the loss jumps to tens "
            "with no NaN anywhere, and the gradient through the saturated sigmoid is 0, so "
            "the model cannot recover. BCEWithLogitsLoss works on the logits and never "
            "rounds."
            + ("" if call is not None else " (functional F.binary_cross_entropy: same fix)")
        ),
        fix=_bce_logits_fix(ctx.trace, use, loss_activation(ctx.trace, use)),
    )


def _numel(use: LossUse) -> int | None:
    if use.input is None:
        return None
    return math.prod(use.input.shape)


def _sigmoid_saturation(trace: StepTrace, use: LossUse) -> str | None:
    """When a pass-through nn.Sigmoid feeds the loss, its output is not measured: read its
    input (the logits) and the points where the sigmoid rounds to exactly 0 or 1 in that
    dtype (1 above log(2 / eps); 0 below the log of the smallest subnormal)."""
    if use.input is None:
        return None
    act = loss_activation(trace, use)
    if act is None or act.kind != "sigmoid":
        return None
    pre = trace.resolve(use.input)
    lim = limits(pre.dtype)
    if pre.stat is None or lim is None or not pre.stat.finite:
        return None
    one_at = math.log(2 / lim.eps)
    zero_at = math.log(lim.tiny * lim.eps)
    parts = []
    if pre.stat.max >= one_at:
        parts.append(f"up to {fmt(pre.stat.max)} (sigmoid rounds to exactly 1 above {fmt(one_at)})")
    if pre.stat.min <= zero_at:
        parts.append(f"down to {fmt(pre.stat.min)} (exactly 0 below {fmt(zero_at)})")
    if not parts:
        return None
    return f"the sigmoid's input ({pre.where}, {pre.dtype}) reaches " + " and ".join(parts)


def _input_grad_magnitude(trace: StepTrace, use: LossUse) -> float | None:
    m = use.measured
    if m is None:
        return None
    ids = {m.index}
    if use.input is not None:
        ids.add(use.input.index)
    best: float | None = None
    for r in trace.records:
        if r.phase is Phase.BACKWARD and r.source in ids and r.stat is not None:
            a = r.stat.magnitude
            if math.isfinite(a) and (best is None or a > best):
                best = a
    return best


# ---------------------------------------------------------------------- pairing


#: ``bce(...)``, ``self.criterion(...)``: the callee of the user's loss line
_CALLEE = re.compile(r"(?<![\w.])([A-Za-z_][\w.]*)\(")
#: a module BCELoss built on a line: ``bce = nn.BCELoss(reduction='sum')``
_BCE_BUILT = r"^(\s*){name}\s*=\s*((?:torch\.)?(?:nn\.)?)BCELoss\("


def _sigmoid_words(act: Activation | None) -> str:
    """The sigmoid as the user's code has it: the nn.Sigmoid module, or a torch.sigmoid call."""
    if act is not None and act.module_type == "Sigmoid":
        return f"the nn.Sigmoid ({act.path})" if act.path else "the final nn.Sigmoid"
    if act is not None and act.path:
        return f"the torch.sigmoid in {act.path}'s forward"
    return "the torch.sigmoid"


def _built_line(source: str | None, callee: str) -> str | None:
    """The line of the user's file that builds the BCELoss module ``callee`` names."""
    import linecache

    path = (source or "").rpartition(":")[0]
    if not path:
        return None
    pattern = re.compile(_BCE_BUILT.format(name=re.escape(callee)))
    for text in linecache.getlines(path):
        if pattern.match(text):
            return text.split("  #", 1)[0].strip()
    return None


#: the calls that apply a sigmoid: ``torch.sigmoid(x)``, ``F.sigmoid(x)``, ``x.sigmoid()``
_SIGMOID_CALLS = frozenset({"sigmoid", "expit"})


def _sigmoid_call(node: ast.expr) -> ast.expr | None:
    """The argument of ``node`` when it is a sigmoid call (its logit), else None."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return None
    if node.func.attr not in _SIGMOID_CALLS:
        return None
    owner = ast.unparse(node.func.value)
    if owner in ("torch", "F", "torch.nn.functional", "nn.functional", "torch.special"):
        return node.args[0] if len(node.args) == 1 and not node.keywords else None
    return node.func.value if not node.args and not node.keywords else None


def _forward_sigmoid(path: str, cls: str) -> tuple[str, str] | None:
    """In ``path``'s class ``cls``, the one line of its ``forward`` that applies a sigmoid:
    (that line, the line with the sigmoid removed: it yields the logit); None when the class
    or the line is not found, or several lines apply one."""
    import linecache

    text = "".join(linecache.getlines(path))
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    fwd = next(
        (
            f
            for c in ast.walk(tree)
            if isinstance(c, ast.ClassDef) and c.name == cls
            for f in c.body
            if isinstance(f, ast.FunctionDef) and f.name == "forward"
        ),
        None,
    )
    if fwd is None:
        return None
    hits = [
        (stmt, call, arg)
        for stmt in ast.walk(fwd)
        if isinstance(stmt, (ast.Assign, ast.Return, ast.AnnAssign))
        and stmt.lineno == stmt.end_lineno
        for call in ast.walk(stmt)
        if isinstance(call, ast.expr) and (arg := _sigmoid_call(call)) is not None
    ]
    if len(hits) != 1:
        return None
    stmt, call, arg = hits[0]
    line = linecache.getline(path, stmt.lineno)
    seg = ast.get_source_segment(text, arg)
    if call.lineno != stmt.lineno or call.end_col_offset is None or seg is None:
        return None
    inner = (
        seg if isinstance(arg, (ast.Call, ast.Name, ast.Attribute, ast.Subscript)) else f"({seg})"
    )
    fixed = line[: call.col_offset] + inner + line[call.end_col_offset :]
    return line.split("  #", 1)[0].strip(), fixed.split("  #", 1)[0].strip()


def _other_uses(source: str | None, name: str, reach: int = 15) -> str | None:
    """The first other statement near the loss line ``source`` that reads ``name`` (the
    probability the sigmoid made): ``h = T / g - (1 - T) / (1 - g)``."""
    import linecache

    path, _, num = (source or "").rpartition(":")
    if not path or not num.isdigit() or not name.isidentifier():
        return None
    line = int(num)
    for n in [*range(line + 1, line + reach), *range(line - 1, max(0, line - reach), -1)]:
        text = linecache.getline(path, n).split("  #", 1)[0].strip()
        if not text or text.startswith(("def ", "class ", "#")):
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        stmt = tree.body[0] if len(tree.body) == 1 else None
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in stmt.targets
        ):
            continue  # it is assigned here, not read
        if (
            stmt is not None
            and "binary_cross_entropy" not in text
            and any(
                isinstance(x, ast.Name) and x.id == name and isinstance(x.ctx, ast.Load)
                for x in ast.walk(stmt)
            )
        ):
            return text
    return None


def _producer_type(trace: StepTrace, use: LossUse) -> str | None:
    """The class of the module whose output the loss received (``OccNet``), followed from
    the loss's input record through its ``source`` links past the loss module's own call:
    the sigmoid that made the probabilities ran at the end of that module's forward."""
    rec = use.input
    for _ in range(64):
        if rec is None:
            return None
        call = trace.call(rec.call)
        if rec.phase is Phase.FORWARD and (call is None or not call.is_loss):
            return rec.module_type or None
        rec = trace.record(rec.source) if rec.source is not None else None
    return None


def _sigmoid_removal(
    trace: StepTrace, use: LossUse, act: Activation | None, code: str
) -> list[str]:
    """The first lines of the NW202 fix: remove the sigmoid where the model applies it (the
    nn.Sigmoid module, or the torch.sigmoid line of the module's forward), so the
    BCEWithLogits that follows gets logits, not a second sigmoid; and the loss input's
    other uses, which need the probability back."""
    lines: list[str] = []
    if act is not None and act.module_type == "Sigmoid" and act.path:
        ref = module_ref(act.path)
        lines.append(
            f"{ref} = nn.Identity()   # first: drop the nn.Sigmoid ({act.path}), so the "
            "model returns logits"
            if ref != "model"
            else f"# first: remove the nn.Sigmoid ({act.path}) so the model returns logits"
        )
    else:
        cls = act.path if act is not None and act.path else None
        cls = _producer_type(trace, use) if cls is None else cls
        path = (use.note.source if use.note is not None else None) or ""
        found = _forward_sigmoid(path.rpartition(":")[0], cls) if cls and path else None
        where = f"{cls}.forward" if cls else "the model's forward"
        if found is not None:
            lines.append(f"{found[1]}   # first, in {where}: return the logit (was: {found[0]})")
        else:
            lines.append(f"# first, in {where}: drop the torch.sigmoid and return the logit itself")
    # the loss's input as the user's line names it: it is the logit from now on
    arg = re.search(r"binary_cross_entropy\(\s*([A-Za-z_]\w*)\s*[,)]", code or "")
    m = _CALLEE.search(code.split("=", 1)[-1]) if code else None
    if arg is None and m is not None:
        arg = re.search(rf"{re.escape(m.group(1))}\(\s*([A-Za-z_]\w*)\s*[,)]", code)
    name = arg.group(1) if arg is not None else None
    other = _other_uses(use.note.source if use.note is not None else None, name) if name else None
    tail = (
        f"# {name} is a logit now: where the probability is used ({other}), use "
        f"torch.sigmoid({name}) there"
        if other is not None
        else "# torch.sigmoid(logits) wherever the probability itself is needed (at inference)"
    )
    return [*lines, "@@", tail]


#: the callee of a loss line that is the user's loss module (``crit``, ``self.bce``), not a
#: function of torch's
_MODULE_CALLEE = re.compile(r"(?!(?:torch|F|nn)\.)[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def _loss_statement(code: str | None) -> str:
    """The statement of the user's loss line that computes the loss: ``loss = crit(p, y)``
    of ``loss = crit(p, y); loss.backward(); opt.step()``."""
    stmts = statements(code)
    assigns = [s for s in stmts if (_statement_key(s) or ("",))[0] == "="]
    return (assigns or stmts or [""])[0]


def _bce_logits_fix(trace: StepTrace, use: LossUse, act: Activation | None) -> str:
    """BCEWithLogitsLoss in place of the user's BCE, keeping its arguments (reduction,
    weight): the functional call on the user's own line, the module where their code builds
    it, under the name their loss line calls it by. Its first line removes the sigmoid where
    the model applies it: pasted alone, the BCEWithLogits line would apply a sigmoid twice."""
    source = use.note.source if use.note is not None else None
    code = full_statement(source) if source else None
    line = _loss_statement(code)
    here = _sigmoid_on_line(line, use)
    if here is not None:
        return here
    head, _, tail = "\n".join(_sigmoid_removal(trace, use, act, line)).partition("\n@@\n")
    if "binary_cross_entropy(" in line:
        fixed = line.replace("binary_cross_entropy(", "binary_cross_entropy_with_logits(", 1)
        return f"{head}\n{fixed}   # on logits: the sigmoid inside, stably\n{tail}"
    m = _CALLEE.search(line.split("=", 1)[-1]) if line else None
    built = _built_line(source, m.group(1)) if m is not None else None
    if built is not None:
        fixed = built.replace("BCELoss(", "BCEWithLogitsLoss(", 1)
        return f"{head}\n{fixed}   # was BCELoss: takes logits, the sigmoid inside, stably\n{tail}"
    red = use.data("reduction")
    args = f"reduction={red!r}" if isinstance(red, str) and red != "mean" else ""
    # the loss line calls the watched BCELoss module by the user's name for it (``crit``)
    called = m is not None and use.call is not None and _MODULE_CALLEE.fullmatch(m.group(1))
    name = m.group(1) if called and m is not None else "criterion"
    return (
        f"{head}\n{name} = nn.BCEWithLogitsLoss({args})   # in place of your nn.BCELoss "
        f"(keep its weight=, if any): the sigmoid inside, stably\n{tail}"
    )


def _sigmoid_on_line(line: str, use: LossUse) -> str | None:
    """NW202's fix when the loss line itself applies the sigmoid to the loss call's input
    (``bce(torch.sigmoid(z), y)``, ``F.binary_cross_entropy(z.sigmoid(), y)``): that call
    on the logit, as BCEWithLogits; nothing to change in the model. None otherwise."""
    parsed = _parsed(line) if line else None
    if parsed is None or not line.isascii():
        return None
    tree, shift = parsed
    call = loss_call_in(tree, use.note)
    if call is None or not call.args or call.end_col_offset is None:
        return None
    logit = _sigmoid_call(call.args[0])
    if logit is None or call.lineno != call.end_lineno:
        return None
    seg = ast.get_source_segment(line[shift:], logit) or ast.unparse(logit)
    if not isinstance(logit, (ast.Call, ast.Name, ast.Attribute, ast.Subscript)):
        seg = f"({seg})"
    first, last = shift + call.col_offset, shift + call.end_col_offset
    arg = call.args[0]
    a0, a1 = shift + arg.col_offset, shift + (arg.end_col_offset or arg.col_offset)
    text = line[first:a0] + seg + line[a1:last]
    callee = ast.get_source_segment(line[shift:], call.func) or ast.unparse(call.func)
    if callee.rsplit(".", 1)[-1] == "binary_cross_entropy":
        text = text.replace("binary_cross_entropy(", "binary_cross_entropy_with_logits(", 1)
        return (
            f"{line[:first]}{text}{line[last:]}   # on the logit: BCEWithLogits applies the "
            "sigmoid inside, stably"
        )
    if not _MODULE_CALLEE.fullmatch(callee):
        return None
    built = _built_line(use.note.source if use.note is not None else None, callee)
    red = use.data("reduction")
    args = f"reduction={red!r}" if isinstance(red, str) and red != "mean" else ""
    made = (
        built.replace("BCELoss(", "BCEWithLogitsLoss(", 1)
        if built is not None
        else f"{callee} = nn.BCEWithLogitsLoss({args})"
    )
    return (
        f"{made}   # in place of the nn.BCELoss (keep its weight=, if any): the sigmoid "
        f"inside, stably\n{line[:first]}{text}{line[last:]}   # on the logit"
    )


#: the callers of a softmax as a function: ``torch.softmax(x, 1)``, ``F.softmax(x, dim=1)``
_SOFTMAX_OWNERS = ("torch", "F", "nn.functional", "torch.nn.functional", "torch.special")


def _softmax_on_line(use: LossUse, *, log: bool) -> str | None:
    """NW203's and NW204's fix when the loss line itself applies the softmax to the loss
    call's input (``F.cross_entropy(logits.softmax(-1), y)``): that statement with the
    softmax dropped (CrossEntropyLoss) or made a log_softmax (NLLLoss); the model is fine.
    None when the line does not show it there."""
    from nanwatch.rules._evidence import _loss_line_of

    line = _loss_line_of(use.note) if use.note is not None else None
    for stmt in statements(line):
        parsed = _parsed(stmt)
        if parsed is None or not stmt.isascii():
            continue
        tree, shift = parsed
        call = loss_call_in(tree, use.note)
        arg = call.args[0] if call is not None and call.args else None
        if not isinstance(arg, ast.Call) or not isinstance(arg.func, ast.Attribute):
            continue
        if arg.func.attr != "softmax" or arg.lineno != arg.end_lineno:
            continue
        owner = ast.unparse(arg.func.value)
        if owner in _SOFTMAX_OWNERS:
            if not arg.args:
                continue
            inner = arg.args[0]
        else:
            inner = arg.func.value
        a0, a1 = shift + arg.col_offset, shift + (arg.end_col_offset or arg.col_offset)
        if log:
            f0 = shift + (arg.func.end_col_offset or 0) - len("softmax")
            new = stmt[:f0] + "log_softmax" + stmt[f0 + len("softmax") :]
            return f"{new}   # NLLLoss takes log-probabilities"
        text = ast.get_source_segment(stmt[shift:], inner) or ast.unparse(inner)
        if not isinstance(inner, (ast.Call, ast.Name, ast.Attribute, ast.Subscript)):
            text = f"({text})"
        return (
            f"{stmt[:a0]}{text}{stmt[a1:]}   # on the logits: CrossEntropyLoss applies "
            "log_softmax itself"
        )
    return None


def _pairing(ctx: RuleContext, loss: str, act: str) -> Iterator[tuple[LossUse, str]]:
    for use in loss_uses(ctx.trace):
        if use.kind != loss:
            continue
        a = loss_activation(ctx.trace, use)
        if a is not None and a.kind == act:
            yield use, describe_activation(a)


def _classes(use: LossUse) -> int | None:
    shape = use.input.shape if use.input is not None else ()
    if len(shape) >= 2:
        return int(shape[1])
    if len(shape) == 1:
        return int(shape[0])
    return None


def _range(use: LossUse) -> str:
    s = use.input_stat
    if s is None:
        lo, hi = note_num(use.note, "input_min"), note_num(use.note, "input_max")
        if lo is None or hi is None:
            return ""
        return f"; its values span [{fmt(lo)}, {fmt(hi)}]"
    return f"; its values span [{fmt(s.min)}, {fmt(s.max)}]"


@rule(
    "NW202",
    title="Sigmoid followed by BCELoss",
    severity="warning",
    summary=(
        "A sigmoid output feeds BCELoss: a warning once its outputs come within a few eps "
        "of 1 (or below the smallest normal, or at the -100 log clamp), where the two-step "
        "log loses precision; a healthy run gets one info note. BCEWithLogitsLoss is stable."
    ),
    early=True,
    priority=20,
)
def sigmoid_bce(ctx: RuleContext) -> Iterator[Diagnosis]:
    for use, what in _pairing(ctx, "bce", "sigmoid"):
        fragile = _fragile(ctx.trace, use)
        ring = ctx.facts.get("ring_size")
        kept = ctx.history[-(ring - 1) :] if isinstance(ring, int) and ring > 1 else ctx.history
        if not fragile and any(
            d.code == "NW202" and d.path == use.path for t in kept for d in t.diagnoses
        ):
            continue  # healthy, and said at a step the report keeps after this one
        dtype = _probability_dtype(ctx.trace, use)
        lim = limits(dtype)
        one_at = fmt(math.log(2 / lim.eps)) if lim is not None else "?"
        healthy = (
            "It is exact while the probabilities stay away from 0 and 1, as they do here: "
            "a note, not repeated every step, that turns into a warning once they come "
            f"within {_NEAR_ONE_EPS} × eps of 1. "
            if not fragile
            else ""
        )
        yield ctx.diagnosis(
            **_at_loss(use),
            severity="warning" if fragile else "info",
            evidence=[*fragile, f"{use.path}'s input is {what}{_range(use)}"],
            explanation=(
                "BCELoss on sigmoid outputs computes log(sigmoid(x)) in two steps. "
                + healthy
                + "For confident predictions the sigmoid rounds to exactly 0 or 1 (1 above "
                f"x = log(2 / eps) = {one_at} in {dtype}), the log is clamped at -100, and "
                "the gradient vanishes (see NW201). BCEWithLogitsLoss fuses both with the "
                "log-sum-exp trick and stays exact for any logit."
            ),
            fix=_bce_logits_fix(ctx.trace, use, loss_activation(ctx.trace, use)),
        )


#: NW202 warns once the sigmoid's outputs come this many eps of their dtype close to 1:
#: 1 - p then has at most a few representable values left before the sigmoid rounds to
#: exactly 1 (float32: p above 1 - 4.8e-7, logits above 14.6; bfloat16: p above 0.969)
_NEAR_ONE_EPS = 4


def _probability_dtype(trace: StepTrace, use: LossUse) -> str:
    """The coarsest dtype the probabilities had on their way from the sigmoid to the loss
    (the largest eps): a bfloat16 sigmoid's output cast to float32 for the loss kept
    bfloat16's precision. Follows the loss input's ``source`` links to the sigmoid."""
    dtypes = [use.input_dtype or "float32"]
    cur = use.input
    for _ in range(64):
        if cur is None:
            break
        dtypes.append(cur.dtype)
        if cur.phase is Phase.FORWARD and (
            cur.module_type == "Sigmoid" or (cur.grad_fn or "").startswith("Sigmoid")
        ):
            break
        cur = trace.record(cur.source) if cur.source is not None else None
    known = [(lim.eps, d) for d in dtypes if (lim := limits(d)) is not None]
    return max(known)[1] if known else dtypes[0]


def _fragile(trace: StepTrace, use: LossUse) -> list[str]:
    """The evidence that BCELoss's two-step log of a sigmoid loses precision, or is about
    to: elements at the -100 log clamp (the guard's count), probabilities within
    :data:`_NEAR_ONE_EPS` eps of 1 (1 - p rounds to 0 next) or below the dtype's smallest
    normal (p itself loses precision on the way to exactly 0), read from the recorded range
    of the probabilities, else from the sigmoid's input (the logits). Empty when what was
    measured is healthy, or nothing was."""
    dtype = _probability_dtype(trace, use)
    lim = limits(dtype)
    if lim is None:
        return []
    margin = _NEAR_ONE_EPS * lim.eps
    near = f"{_NEAR_ONE_EPS} × eps = {fmt(margin)}"
    out: list[str] = []
    clamped = note_num(use.note, "value_clamped")
    if clamped:
        out.append(f"{int(clamped):,} elements hit BCELoss's log clamp at -{fmt(BCE_LOG_CLAMP)}")
    s = use.input_stat
    lo, hi = (
        (s.min, s.max)
        if s is not None
        else (note_num(use.note, "input_min"), note_num(use.note, "input_max"))
    )
    if lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi):
        if hi >= 1.0:
            out.append(
                f"{use.path}'s largest probability is exactly 1: log(1 - p) is clamped at "
                "-100, and a target of 0 there costs 100"
            )
        elif 1.0 - hi <= margin:
            out.append(
                f"{use.path}'s largest probability is 1 - {fmt(1.0 - hi)}: within {near} of 1 "
                f"in {dtype}, where 1 - p has a few values left before the sigmoid rounds to 1"
            )
        if lo <= 0.0:
            out.append(
                f"{use.path}'s smallest probability is exactly 0: log(p) is clamped at -100, "
                "and a target of 1 there costs 100"
            )
        elif lo < lim.tiny:
            out.append(
                f"{use.path}'s smallest probability is {fmt(lo)}, below the smallest normal "
                f"{dtype} ({fmt(lim.tiny)}): p loses precision on its way to exactly 0"
            )
        return out
    act = loss_activation(trace, use)
    if out or use.input is None or act is None or act.kind != "sigmoid":
        return out
    pre = trace.resolve(use.input)
    pre_lim = limits(pre.dtype)
    if pre.stat is None or not pre.stat.finite or pre_lim is None:
        return out
    one_at = math.log(1 / (_NEAR_ONE_EPS * pre_lim.eps))
    zero_at = math.log(pre_lim.tiny)
    if pre.stat.max >= one_at:
        out.append(
            f"the sigmoid's input ({pre.where}) reaches {fmt(pre.stat.max)}: above "
            f"log(1 / ({_NEAR_ONE_EPS} × eps)) = {fmt(one_at)} its output is within "
            f"{_NEAR_ONE_EPS} × eps of 1 in {pre.dtype}"
        )
    if pre.stat.min <= zero_at:
        out.append(
            f"the sigmoid's input ({pre.where}) reaches {fmt(pre.stat.min)}: below "
            f"log(tiny) = {fmt(zero_at)} its output is under the smallest normal {pre.dtype}"
        )
    return out


@rule(
    "NW203",
    title="Softmax followed by CrossEntropyLoss (double softmax)",
    severity="warning",
    summary=(
        "A softmax output feeds CrossEntropyLoss, which applies log_softmax itself: the "
        "model trains on squashed scores and its gradients shrink; pass the logits."
    ),
    early=True,
    priority=20,
)
def softmax_ce(ctx: RuleContext) -> Iterator[Diagnosis]:
    for use, what in _pairing(ctx, "ce", "softmax"):
        evidence = [f"{use.path}'s input is {what}{_range(use)}"]
        classes = _classes(use)
        loss = use.value
        if classes is not None and classes > 1:
            floor = math.log(math.e + classes - 1) - 1
            evidence.append(
                f"on probabilities CrossEntropyLoss cannot go below log(e + C - 1) - 1 = "
                f"{fmt(floor)} for C = {classes} classes"
                + (f"; the loss is {fmt(loss)}" if loss is not None else "")
                + " (on logits a perfect model reaches 0)"
            )
        yield ctx.diagnosis(
            **_at_loss(use),
            evidence=evidence,
            explanation=(
                "CrossEntropyLoss = log_softmax + NLLLoss: it expects raw logits. Given "
                "softmax probabilities it applies a second softmax to values in [0, 1], so "
                "the predicted distribution can never be confident, the loss plateaus well "
                "above 0, and the gradients are small: training is slow and stalls early. "
                "No error is raised, which is why this survives for months."
            ),
            fix=_softmax_on_line(use, log=False)
            or (
                "# remove the final nn.Softmax: the model returns logits\n"
                "criterion = nn.CrossEntropyLoss()      # applies log_softmax itself\n"
                "loss = criterion(logits, target)\n"
                "probs = logits.softmax(dim=1)          # only where probabilities are needed"
            ),
        )


@rule(
    "NW204",
    title="Softmax followed by NLLLoss (use LogSoftmax)",
    severity="warning",
    summary=(
        "A softmax output feeds NLLLoss, which expects log-probabilities: the loss is -p "
        "(negative, bounded in [-1, 0]); use nn.LogSoftmax."
    ),
    early=True,
    priority=20,
)
def softmax_nll(ctx: RuleContext) -> Iterator[Diagnosis]:
    for use, what in _pairing(ctx, "nll", "softmax"):
        evidence = [f"{use.path}'s input is {what}{_range(use)}"]
        loss = use.value
        if loss is not None and loss <= 0:
            evidence.append(
                f"loss = {fmt(loss)}: negative, as NLLLoss of probabilities is -p(target), "
                "bounded in [-1, 0]"
            )
        yield ctx.diagnosis(
            **_at_loss(use),
            evidence=evidence,
            explanation=(
                "NLLLoss only picks -input[target]: it expects log-probabilities "
                "(LogSoftmax). Fed probabilities it computes -p instead of -log p, a "
                "negative loss whose gradient does not grow for wrong predictions, so "
                "training crawls and the loss curve is meaningless."
            ),
            fix=_softmax_on_line(use, log=True)
            or (
                "self.out = nn.LogSoftmax(dim=1)    # was: nn.Softmax(dim=1)\n"
                "criterion = nn.NLLLoss()\n"
                "# or drop the activation and use nn.CrossEntropyLoss() on the logits"
            ),
        )


@rule(
    "NW205",
    title="Probabilities where logits are expected",
    severity="warning",
    summary=(
        "CrossEntropyLoss / NLLLoss input looks like probabilities (rows in [0, 1] "
        "summing to 1, non-negative NLLLoss input, a sigmoid output) though no softmax was "
        "traced; NLLLoss, KLDivLoss and CTCLoss input above 0 or of probabilities (they "
        "take log-probabilities); a sigmoid output fed to BCEWithLogitsLoss."
    ),
    early=True,
    priority=30,
)
def probabilities_as_logits(ctx: RuleContext) -> Iterator[Diagnosis]:
    min_hist = ctx.thresholds.min_history
    for use in loss_uses(ctx.trace):
        if use.kind == "kldiv":
            for d in (_kl_div_on_probabilities(ctx, use), _kl_div_probability_log_target(ctx, use)):
                if d is not None:
                    yield d
            continue
        if use.kind == "ctc":
            d = _ctc_on_probabilities(ctx, use) or _ctc_on_raw_scores(ctx, use)
            if d is not None:
                yield d
            continue
        if use.kind == "bce_logits":
            d = _bce_logits_on_sigmoid(ctx, use)
            if d is not None:
                yield d
            continue
        if use.kind not in ("ce", "nll"):
            continue
        act = loss_activation(ctx.trace, use)
        if act is not None and act.kind in _LOGIT_ACTIVATIONS:
            continue  # NW203/NW204 name a softmax; a log_softmax is what the loss takes
        if use.kind == "nll" and act is None:
            d = _nll_on_raw_scores(ctx, use)
            if d is not None:
                yield d
                continue
        s = use.input_stat
        lo = s.min if s is not None else note_num(use.note, "input_min")
        hi = s.max if s is not None else note_num(use.note, "input_max")
        rows = use.data("probability_rows")
        evidence: list[str] = []
        if act is not None:  # a sigmoid: each score squashed into (0, 1) on its own
            span = _range(use) if use.kind == "ce" else ""  # NLLLoss's range line follows
            evidence.append(f"{use.path}'s input is {describe_activation(act)}{span}")
        if rows is True:
            evidence.append(f"every row of {use.path}'s input is in [0, 1] and sums to 1")
        elif use.kind == "nll" and lo is not None and hi is not None and lo >= 0 and hi > 0:
            evidence.append(
                f"{use.path}'s input spans [{fmt(lo)}, {fmt(hi)}]; log-probabilities are "
                "never above 0"
            )
        elif act is not None and use.kind == "ce":
            evidence.append(
                f"CrossEntropyLoss takes raw logits and applies log_softmax itself: on "
                f"{act.kind} outputs, confined to (0, 1), it can never be confident"
            )
        elif (
            use.kind == "ce"
            and rows is None
            and lo is not None
            and hi is not None
            and lo >= 0
            and hi <= 1
            and _steady_unit_range(ctx, use.path, min_hist)
        ):
            evidence.append(
                f"{use.path}'s input has stayed in [0, 1] for {min_hist} steps "
                f"(now [{fmt(lo)}, {fmt(hi)}]): logits are rarely confined to [0, 1]"
            )
        if len(evidence) < (2 if act is not None else 1):
            continue
        name = "CrossEntropyLoss" if use.kind == "ce" else "NLLLoss"
        expects = "raw logits" if use.kind == "ce" else "log-probabilities (≤ 0)"
        if act is not None:
            explanation = (
                f"{name} expects {expects}, and its input went through a {act.kind}, which "
                "squashes each score into (0, 1) on its own: "
                + (
                    "NLLLoss then computes -p(target) instead of -log p, a loss bounded in "
                    "[-1, 0] whose gradient does not grow for wrong predictions"
                    if use.kind == "nll"
                    else "log_softmax of values in (0, 1) keeps every prediction close to "
                    "uniform, and the gradients shrink"
                )
                + "; training stalls without an error."
            )
            fix = (
                f"# drop the {act.kind} before the loss; on the logits:\n"
                "loss = F.cross_entropy(logits, target)   # = F.nll_loss(F.log_softmax(logits, "
                "dim=1), target)\n"
                "# 0/1 targets per class (multi-label): "
                "F.binary_cross_entropy_with_logits(logits, y.float())"
            )
        else:
            explanation = (
                f"{name} expects {expects}. Probabilities (a softmax applied somewhere "
                "nanwatch could not see, or probabilities loaded from a file) make the loss "
                "a poor objective: gradients shrink and training stalls without an error."
            )
            fix = (
                "loss = F.cross_entropy(logits, target)        # pass the logits\n"
                "loss = F.nll_loss(torch.log(probs.clamp_min(1e-12)), target)  # if only "
                "probabilities exist"
            )
        yield ctx.diagnosis(
            **_at_loss(use),
            evidence=evidence,
            explanation=explanation,
            fix=fix,
        )


def _ctc_on_probabilities(ctx: RuleContext, use: LossUse) -> Diagnosis | None:
    """CTC fed probabilities: the guard found every row of its input in [0, 1] summing to 1
    over the classes (its ``probability_rows``); torch computes a finite, often negative,
    meaningless loss."""
    if use.data("probability_rows") is not True:
        return None
    lo, hi = note_num(use.note, "input_min"), note_num(use.note, "input_max")
    span = f" (it spans [{fmt(lo)}, {fmt(hi)}])" if lo is not None and hi is not None else ""
    fix = use.data("probabilities_fix")
    loss = f"; the loss is {fmt(use.value)}" if use.value is not None else ""
    return ctx.diagnosis(
        **_at_loss(use),
        evidence=[
            f"every row of {use.path}'s input is in [0, 1] and sums to 1 over the classes "
            f"(the last dim){span}: probabilities{loss}"
        ],
        explanation=(
            "CTCLoss takes log-probabilities (log_softmax over the classes, never above 0). "
            "On probabilities it sums and multiplies the wrong quantities along the "
            "alignments: the loss stays finite, often goes negative, and the model learns "
            "nothing useful, without an error."
        ),
        fix=fix if isinstance(fix, str) else "log_probs = F.log_softmax(logits, dim=-1)",
    )


#: how far above 0 a log-probability may round (a hand-written x - x.logsumexp(-1))
_LOG_PROB_SLACK = 1e-3


def _ctc_on_raw_scores(ctx: RuleContext, use: LossUse) -> Diagnosis | None:
    """CTC fed unnormalized scores (the log_softmax forgotten): log-probabilities are never
    above 0, and a row of C of them whose smallest is ``lo`` sums exp to at least C·e^lo,
    which must not pass 1. Read from the guard's note only (its input min and max, the
    input's shape): no tensor is read again. Torch computes a finite, often negative loss
    on raw logits and the model learns a wrong objective without an error."""
    if use.data("probability_rows") is True:
        return None  # probabilities: _ctc_on_probabilities says so
    s = use.input_stat
    lo = s.min if s is not None else note_num(use.note, "input_min")
    hi = s.max if s is not None else note_num(use.note, "input_max")
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return None  # a non-finite input: the anomaly's own rules read it
    shape = use.data("input_shape")
    classes = shape[-1] if isinstance(shape, list) and shape else None
    evidence = []
    if hi > _LOG_PROB_SLACK:
        evidence.append(
            f"{use.path}'s input spans [{fmt(lo)}, {fmt(hi)}]: log-probabilities are never above 0"
        )
    elif isinstance(classes, int) and classes > 1 and classes * math.exp(lo) > 1.05:
        evidence.append(
            f"{use.path}'s input spans [{fmt(lo)}, {fmt(hi)}] over {classes} classes: every "
            f"row's probabilities sum to at least {classes}·e^{fmt(lo)} = "
            f"{fmt(classes * math.exp(lo))}, not 1"
        )
    else:
        return None
    if use.value is not None:
        evidence.append(f"the loss is {fmt(use.value)}")

    def normalize(e: str) -> str:
        return f"{paren(e)}.log_softmax(-1)"

    line = loss_input_rewrite(use.note, normalize, min_args=4) if use.note is not None else None
    fix = "log_probs = logits.log_softmax(-1)   # over the classes, the last dim of (T, N, C)"
    if line is not None:
        fix = f"{line}   # log_softmax over the classes, the last dim of (T, N, C)\n# or: {fix}"
    return ctx.diagnosis(
        **_at_loss(use),
        title="Raw scores where log-probabilities are expected (CTCLoss without log_softmax)",
        evidence=evidence,
        explanation=(
            "CTCLoss takes log-probabilities (log_softmax over the classes, never above 0) "
            "and does not normalize its input itself, unlike CrossEntropyLoss. On raw "
            "logits it sums scores that are not probabilities along the alignments: the "
            "loss stays finite, can go negative, and the model is pushed to inflate every "
            "score instead of learning the labels, without an error."
        ),
        fix=fix,
    )


def _bce_logits_on_sigmoid(ctx: RuleContext, use: LossUse) -> Diagnosis | None:
    """BCEWithLogitsLoss fed a sigmoid's output: it applies its own sigmoid to values in
    (0, 1), so every prediction lies in [0.5, 0.731]: the loss cannot go below
    log(1 + e^-1) for a positive nor log(2) for a negative, and training stalls."""
    act = loss_activation(ctx.trace, use)
    if act is None or act.kind != "sigmoid":
        return None
    hi = 1 / (1 + math.exp(-1))
    evidence = [
        f"{use.path}'s input is {describe_activation(act)}{_range(use)}",
        f"BCEWithLogitsLoss applies a sigmoid itself: on values in (0, 1) every prediction "
        f"is between 0.5 and {fmt(hi)}, so a positive costs at least {fmt(-math.log(hi))} "
        f"and a negative at least {fmt(math.log(2))}, however good the model",
    ]
    if use.value is not None:
        evidence.append(f"the loss is {fmt(use.value)}")
    line = _unwrapped_sigmoid(use)
    fix = (
        f"{line}   # the logits: BCEWithLogitsLoss applies the sigmoid itself"
        if line is not None
        else f"# remove {_sigmoid_words(act)} before the loss: BCEWithLogitsLoss takes the "
        "logits and applies the sigmoid itself\nloss = criterion(logits, target)"
    )
    return ctx.diagnosis(
        **_at_loss(use),
        title="Sigmoid output where logits are expected (BCEWithLogitsLoss after a sigmoid)",
        evidence=evidence,
        explanation=(
            "BCEWithLogitsLoss = sigmoid + BCELoss: it expects raw logits. Given sigmoid "
            "outputs it applies a second sigmoid to values in (0, 1), so no prediction can "
            "be confident, the loss plateaus well above 0 and the gradients are small: "
            "training stalls without an error."
        ),
        fix=fix,
    )


def _unwrapped_sigmoid(use: LossUse) -> str | None:
    """The loss line with the sigmoid around the loss call's input removed
    (``crit(torch.sigmoid(z), y)`` -> ``crit(z, y)``); None when the line does not apply
    the sigmoid there."""
    from nanwatch.rules._evidence import _loss_line_of

    line = _loss_line_of(use.note) if use.note is not None else None
    for stmt in statements(line):
        body = stmt.removeprefix("return ")
        try:
            tree = ast.parse(body.strip())
        except SyntaxError:
            continue
        exact = loss_call_in(tree, use.note)
        calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and c.args]
        for call in [exact] if exact is not None and exact.args else calls:
            logit = _sigmoid_call(call.args[0])
            if logit is None:
                continue
            old, new = ast.unparse(call.args[0]), ast.unparse(logit)
            text = ast.unparse(tree).replace(old, new, 1)
            return ("return " if stmt.startswith("return ") else "") + text
    return None


def _nll_on_raw_scores(ctx: RuleContext, use: LossUse) -> Diagnosis | None:
    """NLLLoss fed raw scores (the log_softmax forgotten): some are above 0, or a row of C
    of them whose smallest is ``lo`` sums exp to C·e^lo > 1, while some are below 0 (an
    input that is all >= 0 is probabilities: the caller says so). NLLLoss only picks
    -input[target]: the loss goes negative and falls without bound as the target's score
    grows, without an error."""
    s = use.input_stat
    lo = s.min if s is not None else note_num(use.note, "input_min")
    hi = s.max if s is not None else note_num(use.note, "input_max")
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)) or lo >= 0:
        return None
    shape = use.data("input_shape")
    if not isinstance(shape, list) and use.input is not None:
        shape = list(use.input.shape)
    # (N, C, ...) or an unbatched (C,): the classes are dim 1, or dim 0
    classes = (
        (shape[1] if len(shape) > 1 else shape[0]) if isinstance(shape, list) and shape else None
    )
    if hi > _LOG_PROB_SLACK:
        evidence = [
            f"{use.path}'s input spans [{fmt(lo)}, {fmt(hi)}]: log-probabilities are never above 0"
        ]
    elif isinstance(classes, int) and classes > 1 and classes * math.exp(lo) > 1.05:
        evidence = [
            f"{use.path}'s input spans [{fmt(lo)}, {fmt(hi)}] over {classes} classes: every "
            f"row's probabilities sum to at least {classes}·e^{fmt(lo)} = "
            f"{fmt(classes * math.exp(lo))}, not 1"
        ]
    else:
        return None
    value = use.value
    if value is not None and value < 0:
        evidence.append(f"the loss is {fmt(value)}: a negative log-likelihood is never below 0")

    def normalize(e: str) -> str:
        return f"{paren(e)}.log_softmax(1)"

    line = loss_input_rewrite(use.note, normalize) if use.note is not None else None
    fix = "loss = F.cross_entropy(logits, target)   # = F.nll_loss(logits.log_softmax(1), target)"
    if line is not None:
        fix = f"{line}   # log_softmax over the classes, dim 1\n# or: {fix}"
    return ctx.diagnosis(
        **_at_loss(use),
        title="Raw scores where log-probabilities are expected (NLLLoss without log_softmax)",
        evidence=evidence,
        explanation=(
            "NLLLoss takes log-probabilities (log_softmax over the classes, never above 0) and "
            "only picks -input[target]; unlike CrossEntropyLoss it does not normalize. On raw "
            "scores the loss rewards inflating the target's score without bound: it goes "
            "negative and keeps falling while the model learns nothing about the other "
            "classes, without an error, until the scores overflow."
        ),
        fix=fix,
    )


def _at_loss(use: LossUse) -> dict[str, Any]:
    """Where a diagnosis about a loss call points: the loss, in forward, at the user's line."""
    return {
        "path": use.path,
        "phase": Phase.FORWARD.value,
        "source": use.note.source if use.note is not None else None,
    }


#: activations whose output CrossEntropyLoss / NLLLoss may take, or that NW203 / NW204 name
_LOGIT_ACTIVATIONS = frozenset({"softmax", "log_softmax"})


def _kl_div_on_probabilities(ctx: RuleContext, use: LossUse) -> Diagnosis | None:
    """KLDivLoss(input, target) computes target · (log target - input): ``input`` must be
    log-probabilities, which are never above 0. A non-negative input with values above 0
    is probabilities (a softmax where a log_softmax belongs): the loss is wrong, often
    negative, and nothing raises."""
    s = use.input_stat
    lo = s.min if s is not None else note_num(use.note, "input_min")
    hi = s.max if s is not None else note_num(use.note, "input_max")
    if lo is None or hi is None or not (lo >= 0 and hi > 0):
        return None
    act = loss_activation(ctx.trace, use)
    evidence = [
        f"{use.path}'s input spans [{fmt(lo)}, {fmt(hi)}]; log-probabilities are never above 0"
    ]
    if act is not None:
        evidence.append(f"it is {describe_activation(act)}")
    if use.data("probability_rows") is True:
        evidence.append("and every row is in [0, 1] and sums to 1: probabilities")
    loss = use.value
    if loss is not None and loss < 0:
        evidence.append(f"the loss is {fmt(loss)}: a KL divergence is never negative")
    return ctx.diagnosis(
        title="Probabilities where log-probabilities are expected",
        **_at_loss(use),
        evidence=evidence,
        explanation=(
            "KLDivLoss (F.kl_div) takes the model's log-probabilities as its input and "
            "the target as probabilities (or log-probabilities with log_target=True). "
            "Given probabilities, it computes target · (log target - p): not a divergence, "
            "often negative, with gradients that do not push the distributions together; "
            "training goes on without an error."
        ),
        fix=_with_log_softmax(use.data("probabilities_fix"))
        or (
            "loss = F.kl_div(F.log_softmax(logits, dim=-1), p_target, reduction='batchmean')\n"
            "# or, with log-probabilities on both sides:\n"
            "loss = F.kl_div(logp, logp_target, reduction='batchmean', log_target=True)"
        ),
    )


def _with_log_softmax(fix: Any) -> str | None:
    """The guard's fix on the user's line; when it takes the log of the probabilities
    (``p.log()``: -inf wherever a probability underflowed to 0), a line more says where the
    stable form comes from."""
    if not isinstance(fix, str) or not fix:
        return None
    if "log_softmax" in fix:
        return fix
    return (
        f"{fix}\n# better, where the probabilities are made: F.log_softmax(logits, dim=-1) "
        "in place of F.softmax (a probability that underflowed to 0 has a log of -inf)"
    )


def _kl_div_probability_log_target(ctx: RuleContext, use: LossUse) -> Diagnosis | None:
    """KLDivLoss(log_target=True) reads the target as log-probabilities, which are never
    above 0. A target with values above 0 and none below is probabilities (a softmax): the
    loss computes exp(t) · (t - input), a wrong number, and nothing raises. The guard wrote
    the fix on the user's line into the note."""
    if use.data("log_target") is not True:
        return None
    lo, hi = note_num(use.note, "target_min"), note_num(use.note, "target_max")
    if lo is None or hi is None or not (lo >= 0 and hi > 0):
        return None
    evidence = [
        f"{use.path}'s target spans [{fmt(lo)}, {fmt(hi)}] with log_target=True; "
        "log-probabilities are never above 0: these are probabilities"
    ]
    loss = use.value
    if loss is not None:
        evidence.append(f"the loss, {fmt(loss)}, is not the KL divergence of these distributions")
    fix = use.data("log_target_fix") or (
        "loss = F.kl_div(logp, p_target, reduction='batchmean')   # log_target=False\n"
        "# or keep log_target=True and pass log-probabilities (F.log_softmax, not F.softmax)"
    )
    return ctx.diagnosis(
        title="Probabilities where log-probabilities are expected",
        **_at_loss(use),
        evidence=evidence,
        explanation=(
            "With log_target=True, KLDivLoss (F.kl_div) takes the target as "
            "log-probabilities and computes exp(t) · (t - input). Given probabilities, exp(t) "
            "is not the target distribution and the loss is a meaningless number, with "
            "gradients that pull the model toward the wrong distribution; training goes on "
            "without an error."
        ),
        fix=str(fix),
    )


def _steady_unit_range(ctx: RuleContext, path: str, steps: int) -> bool:
    past = list(ctx.history)[-(steps - 1) :] if steps > 1 else []
    if len(past) < steps - 1:
        return False
    for t in past:
        rng = ctx.memo(t, f"loss_range:{path}", lambda tr: _loss_range(tr, path))
        if rng is None or not (rng[0] >= 0 and rng[1] <= 1):
            return False
    return True


def _loss_range(trace: StepTrace, path: str) -> tuple[float, float] | None:
    for use in loss_uses(trace):
        if use.path == path and use.input_stat is not None:
            return use.input_stat.min, use.input_stat.max
    return None


# ---------------------------------------------------------------------- NW206


@rule(
    "NW206",
    title="Large logits at ignore_index positions under low precision",
    severity="warning",
    summary=(
        "Logits at positions the loss ignores (ignore_index) grow far beyond the trained "
        "ones, toward float16's exp bound: the segmentation overflow; compute the loss on "
        "logits.float()."
    ),
    early=True,
    priority=30,
)
def ignored_logits(ctx: RuleContext) -> Iterator[Diagnosis]:
    factor = ctx.thresholds.ignored_logit_factor
    head = ctx.thresholds.exp_headroom
    a = ctx.anomaly
    overflowed = False
    if a is not None:
        cause = cause_of(a)
        overflowed = cause is not None and cause.kind == "overflow"
    for use in loss_uses(ctx.trace):
        ign = note_num(use.note, "ignored_amax")
        val = note_num(use.note, "valid_amax")
        n_ign = note_num(use.note, "ignored")
        if ign is None or val is None or not n_ign or not math.isfinite(ign):
            continue
        dtype = _low_dtype(ctx.trace, use)
        lim = low_precision(dtype)
        if lim is None:
            continue
        ratio = ign / val if val > 0 else math.inf
        if ratio < factor:
            continue
        near = ign >= head * lim.exp_bound
        if not (near or overflowed):
            continue
        ignore_index = use.data("ignore_index")
        escalate = overflowed and ign >= head * lim.exp_bound
        evidence = [
            f"max |logit| at the {int(n_ign):,} ignored positions (target == {ignore_index}) "
            f"= {fmt(ign)}; at trained positions = {fmt(val)} ({ratio:.1f}×)",
            f"the model runs in {dtype}: exp overflows above {fmt(lim.exp_bound)} = "
            f"log({fmt(lim.max)})",
        ]
        if escalate and a is not None:
            evidence.append(f"and it did: {a.summary}")
        yield ctx.diagnosis(
            **_at_loss(use),
            severity="error" if escalate else "warning",
            priority=5 if escalate else 30,
            evidence=evidence,
            explanation=(
                f"The loss ignores targets equal to {ignore_index}, so nothing pulls the "
                "logits at those positions down: as the weights grow to fit the labeled "
                "positions, logits where the input is unusual (padding, void, borders) grow "
                f"with them, unchecked. In {dtype}, any exp or softmax on them overflows "
                f"once they pass {fmt(lim.exp_bound)}, and the loss turns NaN after "
                "hundreds of healthy steps."
            ),
            fix=(
                "# compute the loss (and any softmax/exp on the logits) in float32:\n"
                f"loss = F.cross_entropy(logits.float(), target, ignore_index={ignore_index})\n"
                "probs = torch.softmax(logits.float(), dim=1)\n"
                f"# a conditional upcast: logits = logits.float() if logits.dtype != "
                "torch.float32 else logits"
            ),
        )


def _low_dtype(trace: StepTrace, use: LossUse) -> str | None:
    """The low-precision dtype the logits live in: the loss input's own, the dtype of the
    record it came from, or the dtype of the model's outputs (autocast). None when the loss
    took a float32 (or float64) copy of them (``logits.float()``, the note's
    ``input_upcast_from``): its exp runs in that copy's range."""
    if use.data("input_upcast_from") is not None and use.input_dtype in ("float32", "float64"):
        return None
    for d in (use.input_dtype, use.measured.dtype if use.measured is not None else None):
        if low_precision(d) is not None:
            return d
    for r in trace.records:
        if r.phase is Phase.FORWARD and low_precision(r.dtype) is not None:
            return r.dtype
    return None


# ---------------------------------------------------------------------- NW207

#: the share of a batch CTCLoss(zero_infinity=True) may drop before NW207 speaks: a few
#: impossible alignments are what the option is for, most of a batch is a length bug
CTC_DROPPED_SHARE = 0.5


def ctc_dropped(use: LossUse) -> tuple[int, int] | None:
    """(dropped, samples) when ``use`` is a CTCLoss with zero_infinity=True whose guard
    found at least :data:`CTC_DROPPED_SHARE` of its samples with a target longer than the
    input can align (the note's ``ctc_dropped``, ``ctc_samples``); else None."""
    if use.kind != "ctc":
        return None
    dropped, n = note_num(use.note, "ctc_dropped"), note_num(use.note, "ctc_samples")
    if not dropped or not n or dropped < n * CTC_DROPPED_SHARE:
        return None
    return int(dropped), int(n)


@rule(
    "NW207",
    title="CTCLoss(zero_infinity=True) drops samples whose targets are too long",
    severity="warning",
    summary=(
        "CTCLoss with zero_infinity=True got, for half its samples or more, a target "
        "longer than the input can align: each such sample's loss and gradient are set to "
        "0, so the model learns from few samples or none, without an error."
    ),
    early=True,
    priority=20,
)
def ctc_zero_infinity_drops(ctx: RuleContext) -> Iterator[Diagnosis]:
    for use in loss_uses(ctx.trace):
        found = ctc_dropped(use)
        if found is None:
            continue
        dropped, n = found
        every = dropped >= n
        evidence = [
            f"{'every one' if every else dropped} of the {n} samples of {use.path} "
            f"{'has' if every else 'have'} a target longer than its input_lengths can align "
            "(one frame per label, and a blank between two equal labels)",
            "zero_infinity=True sets the loss of each such sample to 0 instead of +inf, and "
            "its gradient to 0",
        ]
        loss = ctx.trace.loss
        if every and loss is not None and loss == 0.0:
            evidence.append("the loss is exactly 0: nothing trains")
        yield ctx.diagnosis(
            **_at_loss(use),
            evidence=evidence,
            explanation=(
                "CTC sums over the alignments of the target to the input frames; a target "
                "that needs more frames than input_lengths gives has none, and its loss is "
                "+inf. zero_infinity=True hides that by zeroing those samples, so "
                + (
                    "the whole batch is dropped: the loss is 0 and no layer gets a gradient. "
                    if every
                    else "most of the batch is dropped and the model learns from the rest. "
                )
                + "Usually input_lengths counts the wrong frames (the audio's, or the "
                "lengths before the model's downsampling, divided too far), or "
                "target_lengths counts padding."
            ),
            fix=(
                "# input_lengths: the frames of the model's output (after its stride), one per "
                "sample; target_lengths: the real labels, without padding\n"
                "print((input_lengths - target_lengths).min())   # below 0: too few frames"
            ),
        )


# ---------------------------------------------------------------------- NW208


def _class_dim(use: LossUse) -> int | None:
    """The dim of ``use``'s input that holds the classes: 1 of NLLLoss's and
    CrossEntropyLoss's (N, C, ...) (0 of an unbatched (C,)), the last of CTCLoss's
    (T, N, C); None for other losses or an unknown shape."""
    shape = use.data("input_shape")
    if not isinstance(shape, list) or not shape:
        return None
    if use.kind == "ctc":
        return len(shape) - 1
    if use.kind in ("nll", "ce"):
        return 1 if len(shape) > 1 else 0
    return None


@rule(
    "NW208",
    title="Softmax over another dim than the classes",
    severity="warning",
    summary=(
        "The (log-)probabilities fed to NLLLoss, CTCLoss or CrossEntropyLoss were normalized "
        "over a dim that is not the classes (F.log_softmax without dim= takes dim 0 of a "
        "3-D input: CTC's time): the loss is finite and trains the wrong objective."
    ),
    early=True,
    priority=20,
)
def softmax_wrong_dim(ctx: RuleContext) -> Iterator[Diagnosis]:
    for use in loss_uses(ctx.trace):
        dim, classes = note_num(use.note, "input_softmax_dim"), _class_dim(use)
        if dim is None or classes is None or int(dim) == classes:
            continue
        shape = use.data("input_shape")
        node = str(use.data("input_activation", ""))
        fn = "log_softmax" if node.startswith("LogSoftmax") else "softmax"
        layout = "(T, N, C)" if use.kind == "ctc" else "(N, C, ...)" if len(shape) > 1 else "(C,)"
        evidence = [
            f"{use.path}'s input, shape {shape}, is a {fn} over dim {int(dim)}; "
            f"{use.path} reads the classes on dim {classes} of its {layout} input",
        ]
        if use.kind == "ctc" and int(dim) == 0:
            evidence.append(
                "F.log_softmax(x) without dim= picks dim 0 for a 3-D input: the time frames"
            )

        what = "log-probabilities" if use.kind != "ce" else "logits"
        line = None
        if use.note is not None and use.kind != "ce":
            line = _rewrite_softmax_dim(use.note, classes if use.kind != "ctc" else -1)
        fix = line or (
            f"log_probs = F.log_softmax(logits, dim={-1 if use.kind == 'ctc' else classes})"
            f"   # over the classes, dim {classes}"
        )
        if use.kind == "ce":
            fix = (
                "loss = F.cross_entropy(logits, target)   # on the logits: it normalizes over "
                "dim 1 itself"
            )
        yield ctx.diagnosis(
            **_at_loss(use),
            evidence=evidence,
            explanation=(
                f"{use.path} expects {what} normalized over the classes (dim {classes}); "
                f"these were normalized over dim {int(dim)}, across "
                + (
                    "the time frames"
                    if use.kind == "ctc" and int(dim) == 0
                    else "other samples or positions"
                )
                + ", so each class's score is weighed against those instead of the other "
                "classes and the loss trains a wrong objective: it stays finite and falls "
                "slowly, without an error."
            ),
            fix=fix,
        )


def _rewrite_softmax_dim(note: Any, dim: int) -> str | None:
    """The loss line with its ``log_softmax(...)`` call's dim set to ``dim`` (added when
    it had none); None when the line holds no such call."""
    from nanwatch.rules._evidence import _loss_line_of

    line = _loss_line_of(note)
    if line is None:
        return None
    for stmt in statements(line):
        try:
            tree = ast.parse(stmt.removeprefix("return ").strip())
        except SyntaxError:
            continue
        exact = loss_call_in(tree, note)
        for call in ast.walk(exact if exact is not None else tree):
            if (
                not isinstance(call, ast.Call)
                or ast.unparse(call.func).rsplit(".", 1)[-1] != "log_softmax"
            ):
                continue
            method = isinstance(call.func, ast.Attribute) and ast.unparse(call.func) not in (
                "F.log_softmax",
                "torch.log_softmax",
                "nn.functional.log_softmax",
                "torch.nn.functional.log_softmax",
            )
            pos = 0 if method else 1
            new = ast.Call(
                func=call.func,
                args=call.args[:pos] if len(call.args) > pos else call.args,
                keywords=[k for k in call.keywords if k.arg != "dim"]
                + [ast.keyword(arg="dim", value=ast.Constant(dim))],
            )
            old_src, new_src = ast.unparse(call), ast.unparse(new)
            text = ast.unparse(tree).replace(old_src, new_src, 1)
            prefix = "return " if stmt.startswith("return ") else ""
            return prefix + text if not text.startswith("return") else text
    return None


# ---------------------------------------------------------------------- NW209


def detached_input(trace: StepTrace, use: LossUse) -> Any:
    """The forward record of the module output ``use``'s input was cut from the graph of
    (``criterion(model(x).detach(), y)``, ``.data``): the loss input has no autograd node
    and does not require grad while autograd recorded, and a module output of this step
    with a node holds exactly its values (the same shape, dtype, min and max); else
    None. Read from the guard's note and the records."""
    if use.note is None or use.data("input_requires_grad", True) is not False:
        return None
    if use.data("input_grad_fn"):
        return None
    lo, hi = note_num(use.note, "input_min"), note_num(use.note, "input_max")
    shape, dtype = use.data("input_shape"), use.input_dtype
    if lo is None or hi is None or not isinstance(shape, list):
        return None
    rec = None
    for r in trace.records:
        s = r.stat
        if r.phase is not Phase.FORWARD or not r.grad_fn or s is None:
            continue
        if list(r.shape) == shape and r.dtype == dtype and s.min == lo and s.max == hi:
            rec = r
            break
    return rec


def rebuilt_leaf(trace: StepTrace, use: LossUse) -> Record | None:
    """The loss input is a leaf of its own that requires grad but is no parameter
    (``model(x).argmax(1).float().requires_grad_()``, ``torch.tensor(..., requires_grad=
    True)``): its gradient stops there. Returns the output of a watched (non-loss) module
    of this step that had an autograd node, the graph the loss was cut from; None when the
    input is not such a leaf or no module ran with autograd. Read from the guard's note."""
    if use.note is None or use.data("input_grad_fn") or use.data("input_requires_grad") is not True:
        return None
    if use.data("input_parameter", True) is not False:
        return None  # a parameter (or a note without the key): the loss trains it directly
    return _graph_root(trace)


def _no_grad_reached(trace: StepTrace) -> bool:
    """Whether no watched parameter got a nonzero gradient this step (none at all, or all
    exactly 0)."""
    grads = [r.stat for r in trace.records if r.phase is Phase.GRADIENT and r.stat is not None]
    return all(
        s.finite and (s.norm == 0.0 if s.norm is not None else s.min == 0.0 == s.max) for s in grads
    )


def _all_grads_zero(trace: StepTrace) -> bool:
    """Whether this step's backward gave every watched parameter a gradient of exactly 0
    (at least one measured)."""
    grads = [r.stat for r in trace.records if r.phase is Phase.GRADIENT and r.stat is not None]
    return bool(grads) and all(
        s.finite and (s.norm == 0.0 if s.norm is not None else s.min == 0.0 == s.max) for s in grads
    )


@rule(
    "NW209",
    title="Loss computed on a detached output",
    severity="warning",
    summary=(
        "A loss got a model output detached from the graph (.detach(), torch.no_grad(), "
        "argmax(...).float().requires_grad_()) while no watched parameter got a nonzero "
        "gradient: the loss trains nothing, without an error."
    ),
    early=True,
    priority=20,
)
def loss_on_detached(ctx: RuleContext) -> Iterator[Diagnosis]:
    if _no_grad_reached(ctx.trace):
        for use in loss_uses(ctx.trace):
            leaf = rebuilt_leaf(ctx.trace, use)
            if leaf is not None:
                yield _leaf_diagnosis(ctx, use, leaf)
        rebuilt = _rebuilt_loss(ctx)
        if rebuilt is not None:
            yield rebuilt
    if not _all_grads_zero(ctx.trace):
        return  # another term trains the model: a detached loss is a logged metric
    for use in loss_uses(ctx.trace):
        rec = detached_input(ctx.trace, use)
        if rec is None:
            continue
        line = _undetached(use)
        fix = "loss = criterion(model(x), y)   # on the output itself, not model(x).detach()"
        if line is not None:
            fix = f"{line}   # on the output itself, with its autograd graph"
        yield ctx.diagnosis(
            **_at_loss(use),
            evidence=[
                f"{use.path}'s input holds {rec.path}'s output, which had an autograd node "
                f"({rec.grad_fn}), but has none itself and does not require grad: it was "
                "detached from the model",
                "every parameter gradient of this step is exactly 0: whatever the backward "
                "ran through (a term like 0 * p.sum()) gives the model nothing",
            ],
            explanation=(
                f"{use.path} computes its loss on values cut from the graph (.detach(), a "
                "computation under torch.no_grad(), .data), so its gradient never reaches "
                "the model; the backward succeeds only through other terms, which here give "
                "every parameter 0. The loss moves with the data, the model never changes."
            ),
            fix=fix,
        )


def _rebuilt_loss(ctx: RuleContext) -> Diagnosis | None:
    """``backward()`` ran on a loss with no autograd node (``torch.tensor(total,
    requires_grad=True)`` of losses summed with ``.item()``) while a watched module ran with
    autograd and no parameter got a gradient: the loss holds the numbers, not the graph."""
    trace = ctx.trace
    loss = next(
        (r for r in trace.records if r.path == LOSS_PATH and r.phase is Phase.FORWARD), None
    )
    if loss is None or loss.grad_fn:
        return None
    root = _graph_root(trace)
    if root is None:
        frozen = _root_without_graph(trace)
        return _no_grad_forward(ctx, frozen) if frozen is not None else None
    return ctx.diagnosis(
        path=LOSS_PATH,
        phase=Phase.FORWARD.value,
        evidence=[
            "backward() ran on a loss with no autograd node: a new leaf, made from numbers "
            "(torch.tensor(total, requires_grad=True) of losses added up with .item())",
            f"{root.path}'s output had an autograd node ({root.grad_fn}) this step, but no "
            "watched parameter got a nonzero gradient",
        ],
        explanation=(
            "A Python number (.item(), float(loss)) carries no graph, and a tensor built from "
            "it is a leaf of its own: backward() gives it a gradient and stops. The loss "
            "goes up and down with the data, the optimizer steps with no gradient, and the "
            "model never changes."
        ),
        fix=(
            "losses.append(criterion(model(x), y))   # the loss tensors, not .item()\n"
            "loss = torch.stack(losses).mean()   # its graph reaches the model\n"
            "loss.backward(); total += loss.item()   # .item() only for logging, after"
        ),
    )


def _root_without_graph(trace: StepTrace) -> Record | None:
    """The output of a watched root module (not a loss) that had no autograd node this
    step, when none had one: the model ran under torch.no_grad() (or inference_mode)."""
    losses = {c.id for c in trace.calls if c.is_loss}
    found: Record | None = None
    for r in trace.records:
        if r.phase is not Phase.FORWARD or r.call in losses:
            continue
        call = trace.call(r.call)
        if call is None or not call.root:
            continue
        if r.grad_fn:
            return None
        found = found or r
    return found


def _no_grad_forward(ctx: RuleContext, out: Record) -> Diagnosis:
    """``backward()`` ran on a loss with no autograd node, and the model's forward made none
    either: it ran under ``torch.no_grad()``, and the loss was made to require grad by
    hand so that backward() would not raise."""
    return ctx.diagnosis(
        path=LOSS_PATH,
        phase=Phase.FORWARD.value,
        evidence=[
            "backward() ran on a loss with no autograd node that requires grad: a leaf made "
            "by hand (loss.requires_grad_(), torch.tensor(loss, requires_grad=True))",
            f"{out.path}'s output had no autograd node this step either: the forward ran "
            "under torch.no_grad() (or torch.inference_mode()), so nothing connects the loss "
            "to a weight, and no parameter got a gradient",
        ],
        explanation=(
            "backward() on a loss computed without a graph raises 'element 0 of tensors does "
            "not require grad'; making the loss require grad silences that error, and "
            "backward() then gives the loss itself a gradient and stops. The optimizer steps "
            "with no gradient and the model never changes."
        ),
        fix=(
            "out = model(x)   # the training forward outside torch.no_grad()\n"
            "loss = criterion(out, y)   # no .requires_grad_(): its graph reaches the model\n"
            "loss.backward()"
        ),
    )


def _graph_root(trace: StepTrace) -> Record | None:
    """The output of a watched root module (not a loss) that had an autograd node this
    step: the model ran with autograd."""
    losses = {c.id for c in trace.calls if c.is_loss}
    for r in trace.records:
        if r.phase is Phase.FORWARD and r.grad_fn and r.call not in losses:
            call = trace.call(r.call)
            if call is not None and call.root:
                return r
    return None


def _leaf_diagnosis(ctx: RuleContext, use: LossUse, rec: Record) -> Diagnosis:
    lo, hi = note_num(use.note, "input_min"), note_num(use.note, "input_max")
    values = f" (values {fmt(lo)} to {fmt(hi)})" if lo is not None and hi is not None else ""
    return ctx.diagnosis(
        **_at_loss(use),
        evidence=[
            f"{use.path}'s input{values} requires grad but has no autograd node and is no "
            "parameter: a new leaf, made by .requires_grad_() (or torch.tensor(..., "
            "requires_grad=True)) from values without a graph",
            f"{rec.path}'s output had an autograd node ({rec.grad_fn}) this step, but no "
            "watched parameter got a nonzero gradient: the loss's graph ends at that leaf",
        ],
        explanation=(
            f"Autograd sends {use.path}'s gradient to its input and stops: a leaf has no "
            "graph behind it. Marking a tensor as requiring grad does not connect it to the "
            "model that made its values; an argmax, a round, a comparison or an .item() has "
            "no gradient at all, so the values were cut from the model before. The backward "
            "runs without an error, the optimizer steps with no gradient, the model never "
            "changes."
        ),
        fix=(
            "# compute the loss on the model's scores, not on a hard choice made from them:\n"
            "loss = F.cross_entropy(logits, y)   # for class labels, in place of "
            "mse(logits.argmax(1).float().requires_grad_(), y)\n"
            "# or keep a differentiable expectation: "
            "(logits.softmax(1) * torch.arange(C)).sum(1), Gumbel-softmax with hard=True"
        ),
    )


def _undetached(use: LossUse) -> str | None:
    """The loss line with ``.detach()`` (or ``.data``) removed from the loss call's input;
    None when the line holds neither there."""
    from nanwatch.rules._evidence import _loss_line_of

    line = _loss_line_of(use.note) if use.note is not None else None
    for stmt in statements(line):
        # within the loss call, when the line says which it is (``mse(a.detach(), b) +
        # ce(c.detach(), y)``): the cut of this loss's input, not the first of the line
        first, last = _call_bounds(stmt, use.note) or (0, len(stmt))
        seg = stmt[first:last]
        for cut in (".detach()", ".data"):
            if cut in seg:
                return stmt[:first] + seg.replace(cut, "", 1) + stmt[last:]
    return None


def _call_bounds(stmt: str, note: Any) -> tuple[int, int] | None:
    """The offsets in ``stmt`` of the loss call of ``note`` (see :func:`loss_call_in`);
    None when it is not found there."""
    parsed = _parsed(stmt)
    if parsed is None:
        return None
    tree, shift = parsed
    call = loss_call_in(tree, note)
    if call is None or call.lineno != call.end_lineno or call.end_col_offset is None:
        return None
    if not stmt.isascii():
        return None  # the offsets count UTF-8 bytes
    return shift + call.col_offset, shift + call.end_col_offset


# ---------------------------------------------------------------------- NW210
#: terms of one target value that must all have got a negative gradient, over consecutive
#: checked steps (two at least), before NW210 speaks: were the signs a coin flip per sample
#: (a signed advantage), 16 in a row would come up once in 65,536
_SIGN_TERMS = 16
_SIGN_LOOKBACK = 8


def _flipped_run(ctx: RuleContext, note: Any) -> tuple[int, int] | None:
    """(steps, terms): the run of consecutive steps, this one last, in which the loss call
    of ``note`` (same path and line) had every term of the same target value get a
    negative gradient, and how many terms those were; None when the run is too short."""
    target = note.data.get("flipped")
    steps, terms = 1, int(note.data.get("flipped_terms", 0))
    for i, t in enumerate(reversed(list(ctx.history)[-_SIGN_LOOKBACK:]), start=1):
        if terms >= _SIGN_TERMS and steps >= 2:
            break
        if t.step != ctx.trace.step - i:
            break
        same = [
            n
            for n in t.notes
            if n.kind == "loss_sign"
            and n.path == note.path
            and n.source == note.source
            and n.data.get("flipped") == target
        ]
        if not same:
            break
        steps += 1
        terms += sum(int(n.data.get("flipped_terms", 0)) for n in same)
    return (steps, terms) if terms >= _SIGN_TERMS and steps >= 2 else None


def _assigned_name(source: str | None) -> str | None:
    """The name the loss line assigns (``ce`` of ``ce = F.binary_cross_entropy(...)``)."""
    code = full_statement(source) if source else None
    for stmt in statements(code):
        try:
            tree = ast.parse(stmt)
        except SyntaxError:
            continue
        node = tree.body[0] if tree.body else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                return target.id
    return None


#: calls that draw a sample: a target made by one of them from the loss's own input is an
#: action the model chose (a policy gradient), not a label
_SAMPLERS = frozenset(
    {"bernoulli", "multinomial", "sample", "rsample", "rand", "rand_like", "poisson"}
)


def _enclosing_code(source: str | None) -> tuple[ast.AST, int] | None:
    """The parsed function around line ``source`` (the whole file when the line is in no
    function), and the file line of the tree's line 1; None when it cannot be read."""
    import linecache
    import textwrap

    path, _, num = (source or "").rpartition(":")
    if not path or not num.isdigit():
        return None
    lines = linecache.getlines(path)
    at = int(num)
    if not 0 < at <= len(lines) or len(lines) > 20_000:
        return None
    indent = len(lines[at - 1]) - len(lines[at - 1].lstrip())
    for n in range(at - 1, 0, -1):
        text = lines[n - 1]
        own = len(text) - len(text.lstrip())
        if not text.strip() or own >= indent:
            continue
        indent = own  # the block this line opens holds the loss line
        if re.match(r"\s*(?:async\s+)?def\s", text):
            end = next(
                (
                    k
                    for k in range(at, len(lines))
                    if lines[k].strip() and len(lines[k]) - len(lines[k].lstrip()) <= own
                ),
                len(lines),
            )
            try:
                return ast.parse(textwrap.dedent("".join(lines[n - 1 : end]))), n
            except (SyntaxError, ValueError, RecursionError):  # not Python, or too deep
                return None
    try:
        return ast.parse("".join(lines)), 1
    except (SyntaxError, ValueError, RecursionError):
        return None


#: module names that hold functions, not values (``torch.rand``, ``F.sigmoid``)
_MODULES = frozenset({"torch", "F", "nn", "np", "math", "D", "dist", "distributions"})


def _loaded_names(node: ast.AST) -> set[str]:
    """The names an expression reads, leaving out the functions it calls by name and the
    modules it takes functions from."""
    called = {id(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)}
    return {
        n.id
        for n in ast.walk(node)
        if isinstance(n, ast.Name)
        and isinstance(n.ctx, ast.Load)
        and id(n) not in called
        and n.id not in _MODULES
    }


def _assignments(tree: ast.AST) -> dict[str, list[ast.expr]]:
    """Every value each plain name is given in ``tree`` (``x, y = batch`` gives both the
    whole ``batch``)."""
    out: dict[str, list[ast.expr]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for t in targets:
            pairs: list[tuple[ast.expr, ast.expr]] = [(t, value)]
            if (
                isinstance(t, ast.Tuple)
                and isinstance(value, ast.Tuple)
                and len(t.elts) == len(value.elts)
            ):
                pairs = list(zip(t.elts, value.elts, strict=True))  # ``x, y = a, b``: each its own
            for part, val in pairs:
                for n in ast.walk(part):
                    if isinstance(n, ast.Name):
                        out.setdefault(n.id, []).append(val)
    return out


def _expanded(
    node: ast.AST, defs: dict[str, list[ast.expr]], skip: set[str]
) -> tuple[set[str], list[ast.expr]]:
    """The names ``node`` reads, followed back through their assignments (not through
    ``skip``), and every expression met on the way."""
    names: set[str] = set()
    seen: list[ast.expr] = [node] if isinstance(node, ast.expr) else []
    todo = list(_loaded_names(node) - skip)
    while todo and len(names) < 200:
        name = todo.pop()
        if name in names:
            continue
        names.add(name)
        for value in defs.get(name, []):
            seen.append(value)
            todo.extend(_loaded_names(value) - skip - names)
    return names, seen


def _sign_by_design(note: Any) -> bool | None:
    """Whether the user's code gives every term of one target value its sign by design:
    the weight of the per-element loss is computed from the target (``alpha * y + (1 -
    alpha) * (1 - y)``, ``1 - 2 * y``) and the target is a label, not an action the model
    sampled from its own output (``torch.bernoulli(logits.sigmoid())``, ``dist.sample()``).
    False for a signed weight the target does not make (an advantage, a detached value)
    or a sampled target; None when the code cannot be read (the gradients alone speak)."""
    parsed = _enclosing_code(note.source)
    if parsed is None:
        return None
    tree, first = parsed
    line = int(str(note.source).rpartition(":")[2]) - first + 1
    stmt = next(
        (
            s
            for s in ast.walk(tree)
            if isinstance(s, ast.stmt)
            and not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and s.lineno <= line <= (s.end_lineno or s.lineno)
            and not any(isinstance(c, ast.stmt) and c is not s for c in ast.iter_child_nodes(s))
        ),
        None,
    )
    if stmt is None:
        return None
    data = dict(note.data)
    data.pop("call", None)
    call = loss_call_in(stmt, type(note)("loss_input", note.path, data))
    if call is None:
        # a loss module called by the user's own name (``crit(logits, y)``, whose forward
        # made the functional call): the outermost call of two positional arguments
        call = next(
            (c for c in ast.walk(stmt) if isinstance(c, ast.Call) and len(c.args) >= 2), None
        )
    if call is None:
        return None
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    inp = kw.get("input", call.args[0] if call.args else None)
    target = kw.get("target", call.args[1] if len(call.args) > 1 else None)
    if inp is None or target is None:
        return None
    defs = _assignments(tree)
    model_side = _expanded(inp, defs, set())[0]
    for e in _expanded(target, defs, set())[1]:
        for c in ast.walk(e):
            if not isinstance(c, ast.Call) or _call_name(c) not in _SAMPLERS:
                continue
            drawn = c.func.value if isinstance(c.func, ast.Attribute) else None
            parts = [*c.args, *(k.value for k in c.keywords), *([drawn] if drawn else [])]
            if any(_expanded(a, defs, set())[0] & model_side for a in parts):
                return False  # an action drawn from the model's own output is the target
    # what weighs the terms: the rest of the loss line, else the next statement that reads
    # the name the loss line gives them (``ce = F.bce(...)``, then ``(alpha_t * ce).mean()``)
    owner = [t.id for t in getattr(stmt, "targets", []) if isinstance(t, ast.Name)]
    skip = set(owner) | _loaded_names(inp)
    own = {id(n) for n in ast.walk(call)}
    reads = {
        n.id
        for n in ast.walk(stmt)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and id(n) not in own
    }
    weight_names, weight = _expanded(
        ast.Tuple([ast.Name(r, ast.Load()) for r in reads], ast.Load()), defs, skip
    )
    users = [
        s
        for s in ast.walk(tree)
        if isinstance(s, ast.stmt)
        and s.lineno > line
        and not any(isinstance(c, ast.stmt) for c in ast.iter_child_nodes(s))
        and set(owner) & _loaded_names(s)
    ]
    weigh: ast.AST = stmt
    if not weight_names and users:
        weigh = min(users, key=lambda s: s.lineno)
        weight_names, weight = _expanded(weigh, defs, skip)
    if not weight_names:
        return None  # no weight in sight: the caller weighs the terms
    centred = any(
        isinstance(b, ast.BinOp)
        and isinstance(b.op, ast.Sub)
        and any(isinstance(c, ast.Call) and _call_name(c) == "mean" for c in ast.walk(b.right))
        for e in [weigh, *weight]
        for b in ast.walk(e)
    )
    if centred:
        return False  # less its batch mean: an advantage, signed by the returns, not the target
    return bool(weight_names & _loaded_names(target))


# -- a loss negated on its way to backward(), or a log-likelihood left unnegated --------
#: calls that fill a tensor with one value: a target made by one is no label but a side of
#: a minimax game (a GAN generator's ``-bce(d(fake), zeros)``), signed on purpose
_FILLS = frozenset({"zeros", "ones", "full", "zeros_like", "ones_like", "full_like"})
#: in-place methods that write chosen elements (by a mask or an index): a tensor of one
#: value after them holds labels
_PLACED = frozenset(
    {
        "masked_fill_",
        "masked_scatter_",
        "index_fill_",
        "index_put_",
        "index_copy_",
        "index_add_",
        "scatter_",
        "scatter_add_",
        "scatter_reduce_",
        "put_",
    }
)


def _written_in_parts(tree: ast.AST) -> set[str]:
    """The names whose tensor ``tree`` writes in chosen elements after making it: a
    subscript store (``y[mask] = 1``, ``y[i] += 1``) or an in-place method of
    :data:`_PLACED` (``y.masked_fill_(m, 1)``, ``y.scatter_(...)``). A label tensor made by
    ``torch.zeros(n)`` and then filled this way holds the labels, not one value."""
    out: set[str] = set()
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _PLACED
            and isinstance(node.func.value, ast.Name)
        ):
            out.add(node.func.value.id)
        for t in targets:
            base = t
            while isinstance(base, ast.Subscript):
                base = base.value
                if isinstance(base, ast.Name):
                    out.add(base.id)
    return out


def _is_neg_const(node: ast.AST) -> float | None:
    """The value of a negative number literal (``-1``, ``-0.5``); None otherwise."""
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and isinstance(node.operand.value, (int, float))
        and not isinstance(node.operand.value, bool)
    ):
        return -float(node.operand.value)
    return None


def _flip(parent: ast.AST, child: ast.AST) -> bool:
    """Whether ``parent`` negates ``child``'s value (``-x``, ``x * -1``, ``a - x``,
    ``x.neg()``, ``torch.neg(x)``)."""
    if isinstance(parent, ast.UnaryOp):
        return isinstance(parent.op, ast.USub)
    if isinstance(parent, ast.BinOp):
        if isinstance(parent.op, ast.Sub):
            return parent.right is child
        if isinstance(parent.op, (ast.Mult, ast.Div)):
            other = parent.right if parent.left is child else parent.left
            if isinstance(parent.op, ast.Div) and other is parent.left:
                return False
            return _is_neg_const(other) is not None
        return False
    if isinstance(parent, ast.Call) and _call_name(parent) in ("neg", "negative"):
        f = parent.func
        own = isinstance(f, ast.Attribute) and f.value is child  # x.neg()
        return own or (child in parent.args and isinstance(f, ast.Attribute))  # torch.neg(x)
    return False


def _path(stmt: ast.stmt, start: ast.AST) -> list[tuple[ast.AST, ast.AST]]:
    """The (parent, child) pairs from ``start`` up to the value of ``stmt``, innermost
    first."""
    parents = {id(c): p for p in ast.walk(stmt) for c in ast.iter_child_nodes(p)}
    out: list[tuple[ast.AST, ast.AST]] = []
    node: ast.AST = start
    while id(node) in parents:
        parent = parents[id(node)]
        if isinstance(parent, ast.stmt):
            break
        out.append((parent, node))
        node = parent
    return out


def _negations(stmt: ast.stmt, start: ast.AST) -> list[ast.AST]:
    """The nodes of ``stmt`` that negate the value of ``start`` on its way to the
    statement's value, innermost first."""
    return [parent for parent, child in _path(stmt, start) if _flip(parent, child)]


def _simple(tree: ast.AST, line: int) -> ast.stmt | None:
    """The innermost statement of ``tree`` holding line ``line``."""
    return next(
        (
            s
            for s in ast.walk(tree)
            if isinstance(s, ast.stmt)
            and not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and s.lineno <= line <= (s.end_lineno or s.lineno)
            and not any(isinstance(c, ast.stmt) and c is not s for c in ast.iter_child_nodes(s))
        ),
        None,
    )


def _sign_chain(
    tree: ast.AST, stmt: ast.stmt, call: ast.Call
) -> list[tuple[ast.stmt, list[ast.AST]]]:
    """The statements the value of ``call`` goes through to the loss (the loss line, then
    each first later statement that reads the name the previous one assigned, four at
    most), each with the nodes that negate it there."""
    chain = [(stmt, _negations(stmt, call))]
    while len(chain) < 4:
        last = chain[-1][0]
        targets = getattr(last, "targets", None) or [getattr(last, "target", None)]
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        if len(names) != 1:
            break
        end = last.end_lineno or last.lineno
        users = sorted(
            (
                s
                for s in ast.walk(tree)
                if isinstance(s, ast.stmt)
                and s.lineno > end
                and not any(isinstance(c, ast.stmt) for c in ast.iter_child_nodes(s))
                and names[0] in _loaded_names(s)
            ),
            key=lambda s: s.lineno,
        )
        if not users or not isinstance(users[0], (ast.Assign, ast.AnnAssign, ast.Return)):
            break  # read by ``loss.backward()``, a log call: the loss is the last value
        nxt = users[0]
        reads = [
            n
            for n in ast.walk(nxt)
            if isinstance(n, ast.Name) and n.id == names[0] and isinstance(n.ctx, ast.Load)
        ]
        flips = [f for r in reads for f in _negations(nxt, r)]
        chain.append((nxt, flips))
        if names[0] in {
            n.id
            for t in getattr(nxt, "targets", [])
            for n in ast.walk(t)
            if isinstance(n, ast.Name)
        }:
            break  # ``loss = -loss``: no later reader is told apart from this one
    return chain


def _line_text(source: str | None, stmt: ast.stmt, first: int) -> tuple[str, int] | None:
    """The text of one-line statement ``stmt`` in the file of ``source`` (read at its
    indentation: the parsed code may be dedented), and the column shift from the parsed
    code to the file; None for a statement over several lines or with non-ASCII text."""
    import linecache

    if stmt.lineno != stmt.end_lineno or stmt.end_col_offset is None:
        return None
    path = (source or "").rpartition(":")[0]
    text = linecache.getline(path, stmt.lineno + first - 1).rstrip("\n")
    if not text.isascii():
        return None
    shift = len(text) - len(text.lstrip()) - stmt.col_offset
    return text, shift


def _unnegated(text: str, shift: int, flip: ast.AST) -> str | None:
    """``text`` with the negation ``flip`` taken out (``-x`` -> ``x``, ``x * -1`` -> ``x``,
    ``x * -0.5`` -> ``x * 0.5``, ``a - x`` -> ``a + x``, ``x.neg()`` -> ``x``)."""

    def span(n: ast.AST) -> tuple[int, int]:
        return n.col_offset + shift, (n.end_col_offset or 0) + shift  # type: ignore[attr-defined]

    a, b = span(flip)
    seg = text[a:b]
    if isinstance(flip, ast.UnaryOp):
        new = seg[1:].lstrip()
    elif isinstance(flip, ast.BinOp) and isinstance(flip.op, ast.Sub):
        _, lb = span(flip.left)
        ra, _ = span(flip.right)
        gap = text[lb:ra]
        cut = gap.rfind("-")
        if cut < 0:
            return None
        new = text[a:lb] + gap[:cut] + "+" + gap[cut + 1 :] + text[ra:b]
    elif isinstance(flip, ast.BinOp):
        neg_right = _is_neg_const(flip.right) is not None
        const = flip.right if neg_right else flip.left
        value = _is_neg_const(const)
        ca, cb = span(const)
        if value == -1.0:
            if neg_right:
                new = text[a:ca].rstrip()
                new = new[:-1].rstrip() if new.endswith(("*", "/")) else new
            else:
                new = text[cb:b].lstrip()
                new = new[1:].lstrip() if new.startswith("*") else new
        else:
            new = text[a:ca] + text[ca:cb][1:].lstrip() + text[cb:b]
    elif isinstance(flip, ast.Call):
        f = flip.func
        if isinstance(f, ast.Attribute) and not flip.args:
            m = re.match(r"^(.*)\.\s*(neg|negative)\(\s*\)$", seg, re.S)
            if m is None:
                return None
            new = m.group(1)
        elif flip.args:
            xa, xb = span(flip.args[0])
            new = paren(text[xa:xb])
        else:
            return None
    else:
        return None
    return text[:a] + new + text[b:]


def _negated(text: str, shift: int, stmt: ast.stmt) -> str | None:
    """``text`` with the value ``stmt`` assigns or returns negated (``loss = x.mean()`` ->
    ``loss = -x.mean()``)."""
    value = getattr(stmt, "value", None)
    if not isinstance(value, ast.expr) or value.end_col_offset is None:
        return None
    a, b = value.col_offset + shift, value.end_col_offset + shift
    seg = text[a:b]
    atom = isinstance(value, (ast.Call, ast.Attribute, ast.Name, ast.Subscript))
    return text[:a] + ("-" + seg if atom else f"-({seg})") + text[b:]


def _sign_words(flip: ast.AST) -> str:
    """How ``flip`` negates, as the code writes it: ``'* -1'``, ``'-1 *'``, ``'-'``,
    ``'.neg()'``."""
    if isinstance(flip, ast.BinOp) and not isinstance(flip.op, ast.Sub):
        op = "*" if isinstance(flip.op, ast.Mult) else "/"
        if _is_neg_const(flip.right) is not None:
            return f"'{op} {ast.unparse(flip.right)}'"
        return f"'{ast.unparse(flip.left)} {op}'"
    if isinstance(flip, ast.Call):
        method = isinstance(flip.func, ast.Attribute) and not flip.args
        return f"'.{_call_name(flip)}()'" if method else f"'{ast.unparse(flip.func)}'"
    return "'-'"


def _maximized(note: Any) -> dict[str, Any] | None:
    """What makes the loss of a ``flipped="all"`` note maximized, read from the user's
    code: a loss (terms >= 0) negated an odd number of times on its way to the loss, or a
    log-likelihood (``log_prob``) of data negated an even number of times (none).
    ``line``: the statement to rewrite, ``fixed``: that statement rewritten, ``sign``: the
    code that negates (None for a log-likelihood nothing negates). None when the code
    cannot be read, when the target was sampled from the model's own output (a policy
    gradient, signed by its advantages), when the weight is an advantage (a value less
    its batch mean), or when the target is one value filled in (a minimax game's side)."""
    parsed = _enclosing_code(note.source)
    if parsed is None:
        return None
    tree, first = parsed
    line = int(str(note.source).rpartition(":")[2]) - first + 1
    stmt = _simple(tree, line)
    if stmt is None:
        return None
    call = loss_call_in(stmt, type(note)("loss_input", note.path, dict(note.data)))
    likelihood = bool(note.data.get("likelihood"))
    if call is None:
        return None
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    if likelihood:
        inp = call.func.value if isinstance(call.func, ast.Attribute) else None
        target = kw.get("value", call.args[0] if call.args else None)
    else:
        inp = kw.get("input", call.args[0] if call.args else None)
        target = kw.get("target", call.args[1] if len(call.args) > 1 else None)
    if inp is None or target is None:
        return None
    defs = _assignments(tree)

    def names(node: ast.expr) -> set[str]:
        # a name read as a whole counts, even one spelled like a module (``dist``)
        own = {node.id} if isinstance(node, ast.Name) else set()
        return own | _expanded(node, defs, set())[0]

    model_side = names(inp)
    # a fill whose tensor is then written in parts (``y = torch.zeros(n); y[mask] = 1``)
    # makes labels, not one value
    labels = {id(v) for n in _written_in_parts(tree) for v in defs.get(n, [])}
    for made in _expanded(target, defs, set())[1]:
        if isinstance(made, ast.Call) and _call_name(made) in _FILLS and id(made) not in labels:
            return None  # a target of one value (``valid = torch.ones(n)``): a game's side
        for c in ast.walk(made):
            if not isinstance(c, ast.Call) or _call_name(c) not in _SAMPLERS:
                continue
            drawn = c.func.value if isinstance(c.func, ast.Attribute) else None
            parts = [*c.args, *(k.value for k in c.keywords), *([drawn] if drawn else [])]
            if any(names(a) & model_side for a in parts):
                return None  # an action drawn from the model's own output is the target
    chain = _sign_chain(tree, stmt, call)
    skip = _loaded_names(inp) | _loaded_names(target)
    # the negations on the loss's own way are no centring (``0 - loss.mean()``)
    own = {id(f) for _, fs in chain for f in fs}
    for s, _ in chain:
        for e in [s, *_expanded(s, defs, skip)[1]]:
            for b in ast.walk(e):
                if (
                    id(b) not in own
                    and isinstance(b, ast.BinOp)
                    and isinstance(b.op, ast.Sub)
                    and any(
                        isinstance(c, ast.Call) and _call_name(c) == "mean"
                        for c in ast.walk(b.right)
                    )
                ):
                    return None  # less its batch mean: an advantage, signed by the returns
    flips = [(s, f) for s, fs in chain for f in fs]
    if len(flips) % 2 != (0 if likelihood else 1):
        return None
    # nothing negates: the minus goes where the value is last computed (not ``return loss``)
    computed = [s for s, _ in chain if not isinstance(getattr(s, "value", None), ast.Name)]
    where, flip = flips[-1] if flips else ((computed or [stmt])[-1], None)
    found = _line_text(note.source, where, first)
    if found is None:
        return {"line": None, "fixed": None, "sign": None, "likelihood": likelihood}
    text, shift = found
    if flip is None:
        fixed = _negated(text, shift, where)
        sign = None
    else:
        fixed = _unnegated(text, shift, flip)
        sign = _sign_words(flip)
    return {
        "line": text.strip(),
        "fixed": fixed.strip() if fixed else None,
        "sign": sign,
        "likelihood": likelihood,
        "target": ast.unparse(target),
    }


def _maximized_diagnosis(
    ctx: RuleContext, note: Any, run: tuple[int, int], how: dict[str, Any]
) -> Diagnosis:
    steps, terms = run
    loss = str(note.data.get("loss", note.path))
    line, fixed, sign = how["line"], how["fixed"], how["sign"]
    if how["likelihood"]:
        title = "Log-likelihood minimized: the minus sign of the loss is missing"
        what = f"{loss}({how.get('target', 'y')})"
        evidence = [
            f"{what} is the log-likelihood of data (the target is no sample of the model): "
            f"training should raise it, but the total loss sent a positive gradient to every "
            f"one of its terms: {terms:,} terms over the last {steps} steps, none spared",
            f"nothing negates it on its way to the loss: {line}"
            if sign is None
            else f"it is negated an even number of times on its way to the loss: {line}",
        ]
        explanation = (
            "Minimizing the log-likelihood pushes the model away from the observed labels: "
            "the loss keeps falling, without bound, while every prediction gets worse, and "
            "no NaN warns. Maximum likelihood minimizes the negative log-likelihood, "
            "-log_prob(y).mean(). (A policy gradient on sampled actions, or a value less "
            "its batch mean, is left alone: there the sign is the advantage's.)"
        )
        fix = fixed or "loss = -log_prob.mean()   # the negative log-likelihood"
    else:
        title = "Loss maximized: it is negated on its way to backward()"
        evidence = [
            f"{loss}(..., reduction='none') has terms >= 0, but the total loss sent a "
            f"negative gradient to every one of them: {terms:,} terms over the last {steps} "
            "steps, none spared",
            f"the code negates it with {sign}: {line}" if line else "the code negates it",
        ]
        explanation = (
            f"The per-element {loss} is reduced by hand (weighted or not) and the result "
            "negated, so lowering the total raises every term: the optimizer pushes each "
            "prediction away from its label. The loss falls below 0 and keeps falling while "
            "the model gets worse, and no NaN warns. Per-sample or class weights must be >= "
            "0 and the sum they weigh is minimized as it is. (Maximizing a loss on purpose, "
            "as an adversary or to unlearn: silence this code.)"
        )
        fix = fixed or "loss = (weights * per_element_loss).mean()   # no minus sign"
    if fixed and line:
        fix = f"{fixed}   # was: {line}"
    return ctx.diagnosis(
        title=title,
        path=note.path,
        phase=Phase.BACKWARD.value,
        source=note.source,
        evidence=evidence,
        explanation=explanation,
        fix=fix,
    )


@rule(
    "NW210",
    title="Loss maximized: a negative weight or a wrong sign",
    severity="warning",
    summary=(
        "Every term of a per-element binary loss (reduction='none') whose target is 0 (or "
        "1) gets a negative gradient, step after step, while the others get positive "
        "ones: a weight applied by hand is negative there (a focal alpha above 1), so the "
        "optimizer makes those predictions worse. Also every term of a per-element loss "
        "that the code negates (-(w * ce).mean(), * -1), and every term of a "
        "distribution's log_prob of data that nothing negates (log_prob(y).mean()). A "
        "target sampled from the model (a policy gradient), a weight less its batch mean "
        "(an advantage) and a target of one value (a minimax game) are left alone."
    ),
    early=True,
    priority=20,
)
def loss_target_maximized(ctx: RuleContext) -> Iterator[Diagnosis]:
    done: set[tuple[str, str | None]] = set()
    for note in ctx.notes("loss_sign"):
        if (note.path, note.source) in done:
            continue
        run = _flipped_run(ctx, note)
        if run is not None and note.data.get("flipped") == "all":
            how = _maximized(note)
            if how is not None:
                done.add((note.path, note.source))
                yield _maximized_diagnosis(ctx, note, run, how)
            continue
        if run is None or _sign_by_design(note) is False:
            continue
        done.add((note.path, note.source))
        steps, terms = run
        d = note.data
        loss = str(d.get("loss", note.path))
        which, other = f"target {d.get('flipped')}", f"target {d.get('trained')}"
        name = _assigned_name(note.source) or "loss"
        weighted = _other_uses(note.source, name) if name != "loss" else None
        at = f": {weighted}" if weighted else ""
        if weighted:
            fix = (
                f"{weighted}   # every factor of {name} here must be >= 0: one is negative for "
                f"{which}\n# a balance weight alpha * y + (1 - alpha) * (1 - y) needs 0 <= "
                "alpha <= 1 (a focal loss's alpha: 0.25)"
            )
        else:
            fix = (
                "weight = weight.clamp_min(0)   # the factor that multiplies the per-element "
                f"loss: it is negative for {which}; or fix how it is computed"
            )
        yield ctx.diagnosis(
            title="Per-element loss maximized for one target value (a negative weight)",
            path=note.path,
            phase=Phase.BACKWARD.value,
            source=note.source,
            evidence=[
                f"{loss}(..., reduction='none') has terms >= 0, but the total loss sent a "
                f"negative gradient to every term of {which}: {terms:,} terms over the last "
                f"{steps} steps, none spared",
                f"the terms of {other} get positive ones: the sign follows the target, not "
                "the sample",
            ],
            explanation=(
                f"The per-element loss is weighted by hand before the reduction{at}. That "
                f"weight is negative for {which}, so lowering the total raises the loss of "
                "those terms: the optimizer pushes their predictions toward the wrong answer, "
                "and the total can fall below 0 while the model gets worse. A balance factor "
                "outside its range does this: alpha * y + (1 - alpha) * (1 - y) with alpha > "
                "1 (a focal loss's alpha is a fraction, 0.25), or 1 - w with w > 1. (A policy "
                "gradient whose targets are sampled actions, weighted by advantages, does it "
                "on purpose when one action always pays less than the mean.)"
            ),
            fix=fix,
        )
