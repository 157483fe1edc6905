"""The catch-all (NW100): every anomaly gets a diagnosis. It runs only when no specific rule
produced an error-severity diagnosis for the step, says what is known (where it was born,
the op and its inputs when traced, how far it spread) and the most useful next step: with
the op known, how to find the elements it broke and the inputs that did it; without it,
how to name the op."""

from __future__ import annotations

import ast
import itertools
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from nanwatch.localize import CONSTANT, LEAF, constant_text, leaf_never_written, leaf_text
from nanwatch.records import (
    LOSS_PATH,
    Anomaly,
    AnomalyKind,
    OpEvent,
    Phase,
    StepTrace,
    TensorStat,
)
from nanwatch.rules._evidence import (
    InfSource,
    anomaly_fields,
    binary_operands,
    cause_of,
    classify,
    cli_rerun,
    code_line,
    describe_stat,
    device_type,
    exact,
    first_input,
    fmt,
    has_zero,
    inf_arithmetic,
    inf_evidence,
    inf_explanation,
    inf_fix,
    inf_source,
    inputs_of,
    limits,
    module_ref,
    node_base,
    op_fields,
    packet,
    paren,
    replace_pos_inf,
    rewrite_call,
    short_op,
    signed_max,
    statements,
    top_level,
    untraced_hint,
    wrapped_binop,
)
from nanwatch.rules.base import Diagnosis, RuleContext, rule

#: the first line of a template fix: the names in it are a pattern's, not the user's code
_ADAPT = "# adapt: your model, loss and batch"


def _through(roots: Sequence[str]) -> str:
    """`` (the model: Score)``: the watched roots the evidence names, for a template."""
    return f" (the model: {', '.join(roots)})" if roots else ""


def _forensic(criterion: bool, roots: Sequence[str] = ()) -> str:
    """Forensic mode around the failing step, a pattern to adapt (the criterion only when
    one was watched): the ``with`` line first, then the adapt note on the step's line."""
    if criterion:
        return (
            "with nanwatch.watch(model, criterion, mode='forensic') as nw:   # every aten op "
            "checked\n"
            f"    loss = criterion(model(x), y); loss.backward()   {_ADAPT}{_through(roots)}"
        )
    return (
        "with nanwatch.watch(model, mode='forensic') as nw:   # every aten op checked\n"
        f"    ...   # the same step: forward, loss, backward(); {_ADAPT[2:]}{_through(roots)}"
    )


def _replay(roots: Sequence[str] = ()) -> str:
    """nanwatch's own replay names a backward op and its forward line; detect_anomaly stops
    at the first node that returns NaN, a later one when an inf born earlier turns into
    NaN. A pattern to adapt: step_fn is the user's failing step, written by them."""
    return (
        f"{_ADAPT}{_through(roots)}\n"
        "def step_fn():   # the failing step again, on the same batch\n"
        "    loss = criterion(model(x), y)   # a pattern: write your forward and loss here\n"
        "    loss.backward()\n"
        "nw.replay(step_fn)   # every aten op checked, forward and backward\n"
        "print(nw.report)     # names the backward op and the forward line that made it"
    )


_REPLAY = _replay()


def _rerun() -> str:
    """Under ``nanwatch run``: the same command in forensic mode, which checks every aten op
    of forward and backward and names the op and the user's line."""
    return (
        f"{cli_rerun()}\n"
        "# checks every aten op, forward and backward, and names the op and your line that "
        "made it (slower: for finding it, not for training)"
    )


def _roots(ctx: RuleContext) -> list[str]:
    """The watched models of the step (root calls that are not a loss), by path."""
    return list(dict.fromkeys(c.path for c in ctx.trace.calls if c.root and not c.is_loss))


#: a forward NaN that no checked op made: a tensor the step read already held it
_READ_BAD = (
    "# every op was checked and none made it: a tensor the step read already held it\n"
    "for name, p in model.named_parameters():   # and each tensor your loss code reads\n"
    "    if not torch.isfinite(p).all():\n"
    "        print(name, p)"
)


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
    if a.op is not None and LEAF in a.op.scalars:
        yield _leaf(ctx, a, a.op)
        return
    if a.op is not None and CONSTANT in a.op.scalars:
        yield _constant(ctx, a, a.op)
        return
    if a.op is not None:
        yield _with_op(ctx, a)
        return
    if a.origin == "loss-code" and _compiled_below_loss(ctx.trace):
        yield _compiled(ctx, a)
        return
    evidence = [a.summary, f"{a.record.where}: {describe_stat(a.record.stat)}"]
    if a.kind is AnomalyKind.BACKWARD and a.origin == "module":
        evidence += _edge_inputs(ctx, a)
    if a.kind in (AnomalyKind.FORWARD, AnomalyKind.BACKWARD):
        evidence.append(untraced_hint(ctx))
    if a.neginf_source is not None:
        evidence.append(f"a -inf was first seen in {a.neginf_source.where}")
    if a.kind is AnomalyKind.FORWARD and ctx.facts.get("mode") == "forensic":
        fix = _READ_BAD  # every op was checked: never send a forensic run to forensic mode
    elif cli_rerun() is not None and a.kind in (AnomalyKind.FORWARD, AnomalyKind.BACKWARD):
        fix = _rerun()  # nanwatch run: the script has no nw to replay with, no watch to change
    elif a.kind is AnomalyKind.FORWARD:  # name the criterion only when one was watched
        fix = _forensic(_watched_criterion(ctx), _roots(ctx))
    elif a.kind is AnomalyKind.BACKWARD:
        fix = _replay(_roots(ctx))
    else:
        fix = "# inspect the named tensor; nw.report has the statistics"
    yield ctx.diagnosis(
        **anomaly_fields(a),
        evidence=evidence,
        explanation=(
            f"A non-finite value was born {_born_where(a)}. "
            "None of nanwatch's specific rules (overflow, log of 0, division by 0, sqrt at "
            "0, masking, bad data, weights) matches the evidence; the op checker names the "
            "exact op and line."
        ),
        fix=fix,
    )


def _compiled_below_loss(trace: StepTrace) -> bool:
    """The loss's autograd graph holds a torch.compile'd function's node: the model's
    forward ran compiled, where module hooks do not run (torch.compile traces them away)."""
    return any(
        str(op).startswith("compiledfunction")
        for n in trace.notes
        if n.kind == "loss_graph"
        for op in n.data.get("ops", ())
    )


def _compiled(ctx: RuleContext, a: Anomaly) -> Diagnosis:
    """NW100 for a NaN born outside every watched module's output while the loss's graph
    runs through a torch.compile'd function: the model ran compiled, so no module of it was
    watched; the birth is somewhere inside it, and only the eager model can say where."""
    roots = _roots(ctx)
    ran = [c.path for c in ctx.trace.calls if not c.is_loss]
    evidence = [
        f"{a.record.where}: {describe_stat(a.record.stat)}",
        "the loss's autograd graph runs through a torch.compile'd function "
        "(CompiledFunctionBackward)"
        + (
            f"; {len(ran)} watched module call{'s' if len(ran) != 1 else ''} ran eagerly"
            if ran
            else ": no watched module ran eagerly this step, so none had its output checked"
        ),
    ]
    return ctx.diagnosis(
        **anomaly_fields(a),
        title="Non-finite value inside a torch.compile'd model (its modules were not watched)",
        evidence=evidence,
        explanation=(
            f"The {a.record.stat.kinds() if a.record.stat is not None else 'non-finite value'} "
            "reached the loss from a model that ran under torch.compile. torch.compile traces "
            "module hooks away and runs fused kernels, so nanwatch saw neither the modules nor "
            "the ops inside it (forensic mode cannot trace a compiled graph either): the value "
            "was born somewhere in the compiled model, not in the loss code. Run the same step "
            "with the eager model and nanwatch names the module, the op and the line."
        ),
        fix=(
            "out = model(x)   # the eager module you watch, not torch.compile(model): its "
            "hooks run and name the module and op\n"
            "# (a compiled module's eager one is compiled._orig_mod)\n"
            f"# run the same step so, and compile again once it is fixed{_through(roots)}"
        ),
    )


def _born_where(a: Anomaly) -> str:
    """Where the anomaly's origin puts the bad value's birth, in a user's words (the
    localizer's origin codes, ``between-roots``, are not for users)."""
    role = a.record.role
    words = {
        "module": f"in the {a.kind.value} of {a.path}",
        "between-children": f"in the {a.kind.value} of {a.path}'s own code, between its submodules",
        "between-roots": (
            f"in code outside the watched modules, in the value passed to {a.path} ({role})"
        ),
        "between-calls": f"in your code between two calls of {a.path}, in its {role}",
        "data": f"in the input data ({role} of {a.path})",
        "computed-target": f"in the target of {a.path} ({role}), computed by your code this step",
        "loss-code": "on the way to the loss, outside every watched module",
        "after-output": f"in the {a.kind.value} of code after the output of {a.path}",
        "gradient": f"in the gradient of {a.path}",
        "parameter": f"in the parameter {a.parameter or a.path}",
    }
    return words.get(a.origin, f"in {a.path} ({a.kind.value})")


def _leaf(ctx: RuleContext, a: Anomaly, ev: OpEvent) -> Diagnosis:
    """The loss code read a leaf tensor (not a watched module's parameter) that already held
    NaN or inf: no op of the step made it; an update at an earlier step wrote it."""
    name = str(ev.scalars.get("leaf_name") or "")
    opt = str(ev.scalars.get("leaf_optimizer") or "")
    shown = name or "the loss-weight tensor"
    stat = ev.inputs[0][1] if ev.inputs else None
    evidence = [a.summary, f"{shown} ({ev.dtype}): {describe_stat(stat)}"]
    line = code_line(ev)
    if line:
        evidence.append(line)
    evidence.append(
        f"{short_op(ev.op)} read it as its {ev.scalars[LEAF]}; {shown} is no watched "
        "module's parameter, so nanwatch did not check it after the update that wrote it"
    )
    w = name or "loss_weights"  # the user's name when the frame bound one
    o = opt or "optimizer"
    holder = f"{w}_module"
    if leaf_never_written(ev):
        why = (
            "-inf is log(0): take the log of a positive initial value"
            if ev.born == "-inf"
            else "NaN is log of a negative, 0/0, or a NaN copied in"
        )
        evidence[-1] = (
            f"{short_op(ev.op)} read it as its {ev.scalars[LEAF]}; its version counter is 0: "
            f"no optimizer step and no in-place write touched {shown} since it was created"
        )
        return ctx.diagnosis(
            **anomaly_fields(a),
            op=short_op(ev.op),
            source=ev.source,
            title="Tensor created non-finite, read by the loss",
            evidence=evidence,
            explanation=(
                f"{leaf_text(ev)}. No update wrote it, so guarding the optimizer step "
                f"cannot help (its gradient may be finite; {ev.born} plus any finite step "
                f"stays {ev.born}): the value it was created from is the bug."
            ),
            fix=(
                f"# where {w} is created: initialise it from a finite value ({why})\n"
                f"assert torch.isfinite({w}).all(), {w}   # right after {w} is created"
            ),
        )
    fix = (
        f"# watch {w} too: nanwatch then checks it after every update and names the step\n"
        f"{holder} = torch.nn.Module()\n"
        f'{holder}.register_parameter("{w}", {w})\n'
        f"# nanwatch.watch(<your modules>, {holder})\n"
        f"# and skip the update of {w} when its gradient is not finite:\n"
        f"if {w}.grad is None or torch.isfinite({w}.grad).all():\n"
        f"    {o}.step()"
    )
    return ctx.diagnosis(
        **anomaly_fields(a),
        op=short_op(ev.op),
        source=ev.source,
        title="Non-finite value in a tensor the loss reads",
        evidence=evidence,
        explanation=(
            f"{leaf_text(ev) or 'a leaf held it'}. A weight the loss multiplies by (a task "
            "weight, a learned uncertainty) that its own optimizer updates goes NaN when one "
            "step's gradient for it is NaN (a ratio L/L0 with L0 = 0, a log of 0); the "
            "step after, every loss it weights is NaN."
        ),
        fix=fix,
    )


def _expression(text: str) -> bool:
    """``text`` parses as one Python expression (``adv[:, None]``)."""
    try:
        ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    return True


def _constant(ctx: RuleContext, a: Anomaly, ev: OpEvent) -> Diagnosis:
    """The loss code multiplied or divided by a tensor with no autograd history (a loss
    weight made under torch.no_grad, from a buffer or a table) that held NaN or inf: the
    code that computed it made the value, which no graph walk or replay of a module sees."""
    op = short_op(ev.op)
    role = str(ev.scalars[CONSTANT])
    name = str(ev.scalars.get("constant_name") or "")
    shown = name or f"the {role} operand of {op}"
    stat = ev.inputs[0][1] if ev.inputs else None
    evidence = [a.summary, f"{shown} ({ev.dtype}): {describe_stat(stat)}"]
    line = code_line(ev)
    if line:
        evidence.append(line)
    evidence.append(
        f"{op} read it as its {role}; it has no autograd history, so no op of the loss's "
        "graph made it: the code that computed it did"
    )
    made_by = "a ratio whose denominator reached 0, an exp that overflowed"
    if stat is not None and not stat.has_nan and (stat.has_posinf or stat.has_neginf):
        # inf and no NaN: a quotient x / 0 is the likelier (an overflow gives it too)
        fix = (
            "# where it is computed, keep the denominator that reaches 0 away from it:\n"
            "# num / den.clamp_min(torch.finfo(den.dtype).eps)  (den: that ratio's denominator)"
            "\n# or, if an exp or a product made the inf, compute it in float32 or bound its input"
        )
    else:
        # NaN: 0 / 0, inf / inf or inf - inf; nothing here shows which, nor a 0 denominator
        made_by = "an overflow to inf, then inf / inf or inf - inf; or 0 / 0"
        find = (
            # forensic mode traced every op it ran: the NaN was made where none is traced
            "# the op that made the NaN ran outside the traced ops (in a DataLoader worker, "
            "a numpy computation, or before nanwatch attached): check it where it is "
            "computed\n"
            if ctx.facts.get("mode") == "forensic"
            else "# where it is computed, find the op that made the NaN first: "
            "mode='forensic' or nw.replay(step_fn) names it and its line\n"
        )
        fix = find + (
            "# NaN is inf / inf, inf - inf or 0 / 0: an exp or a product that overflowed to "
            "inf (compute it in float32, or bound its input), or a denominator that reached 0"
        )
    log = _log_of_zero(stat, ev.code)
    if log is not None:
        # -inf and no NaN or +inf, among finite values that are not all 0 (a mask's): a
        # log of 0, not a ratio; the tensor is a target or a table, made without gradients
        made_by = "a log of 0: a target or a table made without gradients"
        evidence.append(log)
        fix = (
            "# where the target is made: -inf is log(0); keep what the log reads inside (0, 1)\n"
            "eps = 1e-6   # float32 resolves 1 - 1e-6\n"
            "y = y.clamp(eps, 1 - eps)   # y: the target whose log(y) / log(1 - y) is taken"
        )
    ratio = _spread_ratio(ev.source or ev.backward_at, name) if name and stat else None
    if ratio is not None and stat is not None and stat.numel > 1:
        # the name was made by a division by a std / norm / var over the batch: one that is
        # 0 (every value equal: a batch of all-zero rewards) makes every quotient 0/0
        stmt, den, fixed = ratio
        every = (
            stat.nan == stat.numel
            or (stat.nan or 0) + (stat.posinf or 0) + (stat.neginf or 0) == stat.numel
        )
        when = "every value is 0" if "norm" in den else "every value is equal"
        made_by = f"a division by {den}, which is 0 when {when}"
        evidence.append(
            f"{name} was made by `{stmt}`: it divides by {den}, a spread (std, var or norm) "
            + (
                f"over the batch, and all {stat.numel} of its values are "
                f"{'NaN' if stat.nan == stat.numel else 'non-finite'}: the pattern of a "
                f"batch where {when}, so {den} is 0 and every quotient 0/0"
                if every
                else f"that is 0 where {when} (0/0 there)"
            )
        )
        fix = (
            f"{fixed}   # an eps: {den} is 0 when {when}\n"
            f"# or skip the update when {den} == 0 (a batch with nothing to learn from)"
        )
    elif (
        stat is not None
        and stat.numel == 1
        and stat.nan == 1
        and (made := _single_nan_made_by(ev.source or ev.backward_at, name)) is not None
    ):
        # one value, NaN, and the statement that made it is known and takes no std or var:
        # it says where the NaN came from (a warmup of 0 steps: step / warmup is 0/0)
        evidence.append(made[0])
        fix = made[1] if made[2] else made[1] + fix  # a division guarded: nothing to find
    elif stat is not None and stat.numel == 1 and stat.nan == 1:
        # one value, NaN: the statistics of a batch of one (std/var with N - 1 = 0 degrees
        # of freedom is NaN, and clamping the denominator keeps a NaN a NaN)
        x = name or "x"
        evidence.append(
            "a single value, NaN: most likely a batch of one sample, whose std() or var() is "
            "NaN (N - 1 = 0 degrees of freedom; torch warns 'degrees of freedom is <= 0')"
        )
        fix = (
            f"# std of a single value is NaN; where {x} is normalized by its std, guard the "
            "batch of one (other batches unchanged):\n"
            f"# ({x} - {x}.mean()) / (({x}.std() if {x}.numel() > 1 else 1.0) + 1e-8)\n"
            "# or skip batches of 1 (DataLoader(drop_last=True), if len(batch) > 1)\n"
            f"# or {x}.std(correction=0) (0 for one value; it rescales every batch by "
            "sqrt(N/(N-1)))\n" + fix
        )
    bare = op.removeprefix("aten.").split(".")[0]
    unsaved = bare in ("sub", "add") and ratio is None and log is None
    if unsaved and name and stat is not None and stat.numel > 1:
        # pred - y: y may be data with some values missing (NaN in a CSV column)
        some = (stat.nan or 0) + (stat.posinf or 0) + (stat.neginf or 0)
        evidence.append(
            f"{some:,} of {name}'s {stat.numel:,} values are non-finite: data with missing "
            "values (a NaN in a CSV column, a label never filled), if it was loaded, not "
            "computed"
        )
        fix = (
            f"# {name} loaded with missing values: the loss over the values that are there\n"
            f"keep = torch.isfinite({name})\n"
            + _masked_loss(ctx, name, bare)
            + "# or drop those rows where the data is loaded (df.dropna(), a Dataset that skips "
            f"them); if {name} is computed:\n" + fix
        )
    if name and ratio is None and not unsaved:
        fix = (
            f"assert torch.isfinite({name}).all(), {name}   # right after {name} is computed\n"
            + fix
        )
    elif not name and ctx.facts.get("mode") == "forensic" and fix.startswith("# the op that"):
        # no name for it: the user's own expression for the operand, asserted before the
        # line that reads it; then the same check moved up to where it is computed
        expr = (binary_operands(ev) or {}).get(role)
        if expr is not None and _expression(expr):
            fix = (
                f"assert torch.isfinite({expr}).all()   # before {packet(ev.op)} reads it; "
                "move it up to where it is computed\n" + fix
            )
    return ctx.diagnosis(
        **anomaly_fields(a),
        op=op,
        source=ev.source,
        title="Non-finite tensor computed without gradients, read by the loss",
        evidence=evidence,
        explanation=(
            f"{constant_text(ev) or 'a constant operand held it'}. A tensor the loss reads "
            "that was computed without gradients (a per-sample weight or scale, a soft "
            "target, a table) is not part of the autograd graph: no node of the graph made "
            f"its NaN or inf, the code that computed it did ({made_by}), and every loss term "
            "it touches turns with it."
        ),
        fix=fix,
    )


#: reductions that measure a spread: a tensor of equal values has 0 of it
_SPREADS = frozenset({"std", "var", "norm", "vector_norm"})


#: the loss graph's ops above the difference (nearest the loss first) of the losses whose
#: masked form is one line: a squared and an absolute error, with their reduction
_ELEMENTWISE: dict[tuple[str, ...], str] = {
    ("mean", "pow"): "loss = ((pred - {y})[keep] ** 2).mean()",
    ("sum", "pow"): "loss = ((pred - {y})[keep] ** 2).sum()",
    ("mean", "abs"): "loss = (pred - {y})[keep].abs().mean()",
    ("sum", "abs"): "loss = (pred - {y})[keep].abs().sum()",
}


def _masked_loss(ctx: RuleContext, name: str, bare: str) -> str:
    """The loss over the finite values of ``name``, the operand of the difference ``bare``
    (``sub``) that a loss reads: the squared or absolute error itself when the loss graph
    shows one; otherwise (a pinball, a Huber, any other loss of the difference, as the
    graph shows) the mask applied to that loss's own terms, which only its code holds."""
    for note in ctx.notes("loss_graph"):
        ops = note.data.get("ops")
        if not isinstance(ops, list) or bare not in ops:
            continue
        above = tuple(str(o) for o in ops[: ops.index(bare)])
        known = _ELEMENTWISE.get(above)
        if known is not None:
            return f"{known.format(y=name)}   # pred: what {bare} took {name} from\n"
        chain = [str(o) for o in ops[: ops.index(bare) + 1]]
        ops_said = ", ".join(o for i, o in enumerate(chain) if i == 0 or chain[i - 1] != o)
        return (
            f"{name} = torch.nan_to_num({name})   # a finite stand-in, masked out below (NaN "
            "* 0 is still NaN)\n"
            f"# your loss's terms on this {name} before their mean (its ops from the loss "
            f"down: {ops_said}; not a squared error): each term times keep (broadcast to "
            "their shape), then\n"
            "loss = (terms * keep).sum() / keep.sum()   # terms: those per-element losses\n"
        )
    return f"loss = ((pred - {name})[keep] ** 2).mean()   # pred: what {bare} took {name} from\n"


def _spread(node: ast.expr) -> bool:
    """``r.std()``, ``torch.std(r, 0)``, ``ret.norm()``, ``torch.linalg.norm(x)``,
    ``r.var().sqrt()``, ``torch.sqrt(r.var())``: a spread of values, 0 when all are equal."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    attr = node.func.attr
    if attr in _SPREADS:
        return True
    if attr == "sqrt":  # x.var().sqrt(), torch.sqrt(x.var())
        inner = node.args[0] if node.args else node.func.value
        return _spread(inner)
    return False


def _spread_ratio(source: str | None, name: str, reach: int = 40) -> tuple[str, str, str] | None:
    """The last ``name = ... / spread`` above line ``source`` in the same function, the
    spread's text and the statement with an eps added to it: ``adv = (r - r.mean()) /
    r.std()`` -> ``(stmt, "r.std()", "adv = (r - r.mean()) / (r.std() + 1e-8)")``; None
    when the file cannot be read or no such division made ``name``."""
    stmt = _assigned(source, name, reach)
    return None if stmt is None else _eps_in_spread(stmt)


def _single_nan_made_by(source: str | None, name: str | None) -> tuple[str, str, bool] | None:
    """Evidence and fix lines for a single NaN value ``name`` whose assignment above
    ``source`` takes no std or var (so not a batch of one): a division there is 0/0 (its
    denominator was 0: ``beta = step / warmup_steps`` with 0 warmup steps), guarded in the
    user's statement (True: the fix is whole); any other statement is quoted as the one
    to check (False: the generic advice follows). None when the
    statement is not known or takes a std or var."""
    if not name:
        return None
    stmt = _assigned(source, name)
    if stmt is None:
        return None
    try:
        node = ast.parse(stmt).body[0]
    except (SyntaxError, IndexError):
        return None
    if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
        return None
    if _takes_spread(node.value):
        return None  # a std or var: a batch of one is the likely cause
    div = next(
        (b for b in ast.walk(node.value) if isinstance(b, ast.BinOp) and isinstance(b.op, ast.Div)),
        None,
    )
    if div is not None and isinstance(div.right, ast.Name):
        # y / s with s = x.std() a line above: s is NaN for one value, not 0
        made = _assigned(source, div.right.id)
        try:
            if made is not None and _takes_spread(ast.parse(made)):
                return None
        except SyntaxError:
            return None
    if div is None:
        return (
            f"{name} was made by `{stmt}`: one value, and no std or var there, so not a "
            "batch of one",
            f"# check {name} where it is made: {stmt}\n",
            False,
        )
    from nanwatch.rules.domain import _masked_division  # domain imports this module

    den = ast.get_source_segment(stmt, div.right) or ast.unparse(div.right)
    num = ast.get_source_segment(stmt, div.left) or ast.unparse(div.left)
    return (
        f"{name} was made by `{stmt}`: a single NaN out of {num} / {den} is 0/0, so {den} "
        "was 0 (a count or a length of 0: warmup steps, a cycle, items selected)",
        f"# {den} was 0: set it to at least 1 where it is made, or guard the division:\n"
        + _masked_division(stmt, div, den),
        True,
    )


def _takes_spread(tree: ast.AST) -> bool:
    """``tree`` calls a std or var (``x.std()``, ``torch.var(x)``, ``x.std_mean()``)."""
    return any(
        isinstance(c, ast.Call)
        and (c.func.attr if isinstance(c.func, ast.Attribute) else ast.unparse(c.func))
        in ("std", "var", "std_mean", "var_mean")
        for c in ast.walk(tree)
    )


def _assigned(source: str | None, name: str, reach: int = 40) -> str | None:
    """The last statement ``name = ...`` above line ``source`` in the same function; None
    when the file cannot be read, none is found, or branches assign it differently."""
    import linecache

    path, _, num = (source or "").rpartition(":")
    if not path or not num.isdigit() or not name.isidentifier():
        return None
    line = int(num)
    here = linecache.getline(path, line)
    indent = len(here) - len(here.lstrip())
    assign = re.compile(rf"^\s*{re.escape(name)}\s*=(?!=)")
    found: list[tuple[int, str]] = []  # (indentation, statement), nearest first
    for n in range(line - 1, max(0, line - reach), -1):
        text = linecache.getline(path, n)
        if not text.strip():
            continue
        depth = len(text) - len(text.lstrip())
        if re.match(r"\s*(?:async\s+)?def\s", text) and depth < indent:
            break  # the function's start
        found += [(depth, st.strip()) for st in reversed(statements(text)) if assign.match(st)]
        if found and found[0][0] <= indent:
            break  # assigned at the reading line's own level: the one that ran
    if not found:
        return None
    nested = [st for depth, st in found if depth > indent]
    if found[0][0] > indent and len(set(nested)) > 1:
        return None  # assigned differently in branches (if / else): which one ran is unknown
    return found[0][1]


def _eps_in_spread(stmt: str) -> tuple[str, str, str] | None:
    """``stmt`` with ``+ 1e-8`` added to the spread it divides by (see :func:`_spread_ratio`)."""
    try:
        node = ast.parse(stmt).body[0]
    except (SyntaxError, IndexError):
        return None
    if not isinstance(node, ast.Assign):
        return None
    for sub in ast.walk(node.value):
        if not (isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Div) and _spread(sub.right)):
            continue
        den = ast.get_source_segment(stmt, sub.right)
        start, end = sub.right.col_offset, sub.right.end_col_offset
        if den is None or end is None:
            return None
        if stmt[:start].rstrip().endswith("(") and stmt[end:].lstrip().startswith(")"):
            new = f"{den} + 1e-8"  # already in parentheses: / (r.std())
        else:
            new = f"({den} + 1e-8)"
        return stmt, den, stmt[:start] + new + stmt[end:]
    return None


def _log_of_zero(stat: TensorStat | None, code: str | None) -> str | None:
    """What says a tensor's -inf is a log of 0, or None: -inf its only non-finite kind
    and finite values not all 0 (a 0 / -inf mask is no log), all of them <= 0 (a log of
    values in (0, 1]: a probability, a proportion) or a ``log`` on its line."""
    if stat is None or not stat.only_neginf or not stat.finite_amax:
        return None
    if stat.max <= 0:
        return (
            f"every finite value is negative (max {fmt(stat.max)}) and the rest are -inf: "
            "the pattern of a log of values in (0, 1] (a probability, a proportion, 1 - y), "
            "-inf where a value was exactly 0 (a target of exactly 0 or 1)"
        )
    if re.search(r"\blog\w*\(|\.log\w*\(", code or ""):
        return "-inf is its only non-finite value and its line takes a log: log(0) is -inf"
    return None


#: nodes of log-probabilities: a value of -138 there is log(p) of a tiny p, which no
#: exp overflows on (a KLDivLoss input, an NLL input)
_LOG_PROBS = ("LogSoftmaxBackward", "LogSigmoidBackward")


def _edge_inputs(ctx: RuleContext, a: Anomaly) -> list[str]:
    """A backward NaN or inf born in a module's code, op not traced: its inputs at the
    edges where common ops have an infinite derivative or an infinite saved result (exact
    zeros: log, xlogy, sqrt; values past exp's overflow bound: a hand-written exp hidden by
    the next op in forward). What they would mean, not a verdict: the op is unknown."""
    trace = ctx.trace
    mine = [c for c in trace.calls if c.path == a.path]
    calls = {c.id for c in mine}
    out: list[str] = []
    # the exp clue only where an exp may run: the module's own code (a class of the user's,
    # which nanwatch does not see into) or an exp node among its outputs; a torch module
    # (Linear, Conv, Tanh) computes no hand-written exp, and torch's own silu, mish and
    # softplus never overflow
    exp_nodes = {
        str(r.grad_fn or "").split("Backward")[0]
        for r in trace.records
        if r.call in calls and r.grad_fn
    }
    zero_said = False
    exp_said = not (exp_nodes & _EXP_LIKE or any(not _torch_module(c.module_type) for c in mine))
    for r in trace.records:
        if r.call not in calls or r.phase is not Phase.INPUT:
            continue
        m = exact(trace, r)
        s = m.stat if m is not None else None
        if s is None or not s.finite:
            continue
        lim = limits(r.dtype)
        if not zero_said and has_zero(s) and s.min >= 0:
            zero_said = True
            out.append(
                f"{a.path}'s {r.role} holds exact zeros (min {fmt(s.min)}, max {fmt(s.max)}): "
                "log, xlogy, "
                "sqrt and x ** p with p < 1 have an infinite derivative at 0 (an entropy "
                "-xlogy(p, p) of a probability of 0, a norm of a zero vector)"
            )
        made_by = {str(x.grad_fn or "") for x in (r, m) if x is not None}
        if (
            not exp_said
            and lim is not None
            and s.amax > lim.exp_bound
            and not any(n.startswith(_LOG_PROBS) for n in made_by)
        ):
            exp_said = True
            out.append(
                f"{a.path}'s {r.role} reached {fmt(s.min if -s.min > s.max else s.max)} "
                f"({r.dtype}): exp of a value past {fmt(lim.exp_bound)} is inf; a hand-written "
                "exp (Swish x / (1 + exp(-x)), Mish, softplus) hides it in forward (x / inf = "
                "0) and backward turns it into NaN; torch.nn.functional.silu, mish and "
                "softplus never overflow"
            )
    return out


#: autograd nodes (``Backward`` dropped) of ops that take an exp of their input
_EXP_LIKE = frozenset(("Exp", "Exp2", "Expm1"))


def _torch_module(kind: str) -> bool:
    """``kind`` names a module class of ``torch.nn`` (``Linear``, ``Tanh``): its code is
    torch's, with no hand-written exp in it."""
    import torch.nn  # the rules run inside a watched step: torch is imported already

    return isinstance(getattr(torch.nn, kind, None), type)


def _watched_criterion(ctx: RuleContext) -> bool:
    """A loss module was passed to watch (a root call of one), not only loss code."""
    return any(c.root and c.is_loss and c.path != LOSS_PATH for c in ctx.trace.calls)


def _with_op(ctx: RuleContext, a: Anomaly) -> Diagnosis:
    assert a.op is not None
    saved = _saved_overflow(a.op)
    if saved is not None:
        return _exp_overflow(ctx, a, a.op, saved)
    par = parametrization(a.op.path or a.path)
    if par is not None and a.op.phase is Phase.FORWARD and "NaN" in a.op.born:
        found = _parametrized(ctx, a, a.op, par)
        if found is not None:
            return found
    if packet(a.op.op) == "logdet":
        return _logdet(ctx, a, a.op)
    if _CAME_IN in a.op.scalars:
        return _came_in(ctx, a, a.op)
    cause = cause_of(a)
    if cause is not None and cause.kind == "inf-arith":
        return _inf_arithmetic(ctx, a, cause.event, cause.trigger)
    ev = cause.event if cause is not None else a.op
    assert ev is not None
    hidden = _hidden_inf(ev)
    if hidden:
        return _hidden_inf_diagnosis(ctx, a, ev, hidden)
    op = short_op(ev.op)
    dtype = ev.dtype or a.record.dtype
    given = _given(ev)
    evidence = [a.summary, f"{op} made {ev.born} in {dtype}" + (f" {given}" if given else "")]
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
        f"{op} created {ev.born}{f' {given}' if given else ''}{where} ({node}{a.path}). "
        "nanwatch has no "
        "specific rule for this op's failure; its inputs above show the ranges it was "
        "given, and the elements it broke show which of them it does not accept."
    )
    return ctx.diagnosis(
        **op_fields(ev, a),
        evidence=evidence,
        explanation=explanation,
        fix=_inspect_fix(ev),
    )


#: ``OpEvent.scalars`` key of a backward-node event whose NaN came in with an operand autograd
#: did not save (see ``nanwatch.ops.CAME_IN``)
_CAME_IN = "came_in"


def _logdet(ctx: RuleContext, a: Anomaly, ev: OpEvent) -> Diagnosis:
    """torch.logdet of a matrix whose determinant is negative: log of a negative number, NaN
    (torch runs it as ``where(sign == -1, nan, logabsdet)`` of a slogdet: no op raises)."""
    neg = ev.scalars.get("negative_det")
    total = ev.scalars.get("matrices")
    evidence = [a.summary]
    if isinstance(neg, int) and neg:
        of = f" of {total}" if isinstance(total, int) else ""
        evidence.append(f"{neg}{of} matrices have a negative determinant (slogdet sign -1)")
    for nm, given in ev.inputs[:1]:
        if nm == "self":  # the matrix (read from the graph; the op checker sees where's)
            evidence.append(f"input {nm}: {describe_stat(given)}")
    line = code_line(ev)
    if line:
        evidence.append(line)
    got: list[str] = []

    def keep(e: str) -> str:
        got.append(e)
        return e

    for st in statements(ev.code):
        if rewrite_call(st, ["logdet"], keep) is not None and got:
            break
    arg = got[0] if got else "A"
    return ctx.diagnosis(
        **op_fields(ev, a),
        title="logdet of a matrix with a negative determinant",
        evidence=evidence,
        explanation=(
            "logdet(A) = log(det A) is NaN where det A < 0 (and -inf where det A = 0); torch "
            "returns NaN there instead of raising. A matrix meant to be positive definite (a "
            "covariance, a precision) built from learned values lost that property: a "
            "learned diagonal went negative."
        ),
        fix=(
            f"sign, logabsdet = torch.linalg.slogdet({arg})   # in place of torch.logdet({arg})\n"
            "assert (sign > 0).all(), 'matrix not positive definite'\n"
            "# or keep it positive definite: a positive learned diagonal, e.g.\n"
            "# torch.diag_embed(F.softplus(raw) + 1e-6), or L @ L.mT with exp() on L's diagonal"
        ),
    )


def _came_in(ctx: RuleContext, a: Anomaly, ev: OpEvent) -> Diagnosis:
    """A backward node's result is NaN but the operands it saved are finite and hold no
    inf: the NaN came in with an operand autograd did not save (``0.5 * x`` keeps only
    0.5), made upstream by the node named; this node did not make it."""
    name = str(ev.scalars[_CAME_IN])
    made = ev.scalars.get(f"{name}_made_by")
    op = short_op(ev.op)
    by = f", made by {made}" if made else ""
    evidence = [
        a.summary,
        f"{op}'s {name} already held NaN{by}: autograd did not save it, and no input of "
        f"{op} holds an inf",
    ]
    args = {k: v for k, v in ev.scalars.items() if k not in ("evidence", _CAME_IN)}
    args = {k: v for k, v in args.items() if not k.endswith("_made_by")}
    if args:
        evidence.append("arguments: " + ", ".join(f"{k}={_arg(v)}" for k, v in args.items()))
    evidence.append(untraced_hint(ctx))
    mode = ctx.facts.get("mode")
    if mode == "forensic":
        fix = _READ_BAD
    elif cli_rerun() is not None:
        fix = _rerun()
    else:
        fix = _forensic(_watched_criterion(ctx), _roots(ctx))
    return ctx.diagnosis(
        **op_fields(ev, a),
        evidence=evidence,
        explanation=(
            f"The NaN reached {op} through its {name}{by}; {op} did not make it. The op that "
            "made it ran earlier in the loss code and is not readable from the autograd "
            "graph; forensic mode checks every op and names it and its line."
        ),
        fix=fix,
    )


def _inf_arithmetic(ctx: RuleContext, a: Anomaly, ev: OpEvent, trigger: OpEvent) -> Diagnosis:
    """An op made NaN of the infinities it was given (-inf - (-inf), 0 × inf) and no
    specific rule knew where they came from (a log of 0 is NW110's, a fully masked row
    NW402's): name the operation, the inputs and the suspects."""
    src = inf_source(ctx.trace, a, ev)
    mode = ctx.facts.get("mode")
    evidence = [a.summary, *inf_evidence(ev, src, trigger, mode)]
    explanation = inf_explanation(ev, src)
    fix = inf_fix(ev, src, forensic=mode == "forensic")
    expr = inf_arithmetic(ev) or "arithmetic on infinities"
    empty = _empty_min(ev, src)
    plus = [m for m in src.masks if "+inf" in m.born and "-inf" not in m.born]
    name = packet(ev.op).rstrip("_")
    if empty is not None:
        evidence.append(empty.evidence())
        explanation = empty.explanation(expr)
        fix = empty.fix(ev)
    elif plus and len(plus) == len(src.masks) and name not in ("mul", "multiply"):
        # a +inf fill (a min's neutral value): the finite stand-in is finfo.max, not .min
        dtype = plus[0].dtype or ev.dtype or "float32"
        explanation = (
            f"{expr} has no value, so IEEE arithmetic returns NaN. Values masked to +inf met "
            "another infinity. Mask with torch.finfo(dtype).max, the largest finite value "
            "(a min then ignores it as inf did; not when something scales it up), or leave "
            "the masked values out of this op."
        )
        lines = [
            f"{fixed}   # not inf: a finite fill keeps {expr} from happening"
            for m in plus
            if (fixed := replace_pos_inf(m.code, f"torch.finfo(torch.{dtype}).max")) is not None
        ]
        fix = "\n".join(dict.fromkeys(lines)) or fix
    if not fix.strip():
        fix = _assert_finite(ev, expr)
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=f"NaN from arithmetic on infinities: {expr}",
        evidence=evidence,
        explanation=explanation,
        fix=fix,
    )


def _assert_finite(ev: OpEvent, expr: str) -> str:
    """The last resort fix: an assert, in the user's names (the op's operands as its line
    writes them), that stops at the first infinity before the op makes NaN of it."""
    ops = binary_operands(ev)
    held = [n for n, s in ev.inputs if s is not None and (s.has_posinf or s.has_neginf)]
    names = [ops[n] for n in held if ops is not None and n in ops]
    at = f" (line {ev.source.rpartition(':')[2]})" if ev.source else ""
    if not names:
        return (
            f"assert torch.isfinite(x).all(), 'x holds inf'   # x: each input of {short_op(ev.op)}"
            f"{at}, before it: {expr} = NaN"
        )
    return "\n".join(
        f"assert torch.isfinite({n}).all(), {n!r} + ' holds inf'   # before{at}: {expr} = NaN"
        for n in dict.fromkeys(names)
    )


#: reductions that keep a +inf fill when every value of a slice was masked: the min over
#: an empty set, whose neutral value the fill is
_MIN_REDUCTIONS = frozenset({"amin", "min", "cummin", "aminmax"})
#: calls and subscripts that reshape a mask without changing which values it holds:
#: ``mask.flatten()[None, :].any()`` is ``mask.any()``
_RESHAPES = frozenset(
    {"flatten", "view", "reshape", "unsqueeze", "squeeze", "contiguous", "expand", "bool"}
)


def _whole(node: ast.expr) -> ast.expr:
    """``mask`` of ``mask.flatten()[None, :]``: the tensor a reshaping chain starts from."""
    while True:
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _RESHAPES
        ):
            node = node.func.value
        elif isinstance(node, ast.Subscript) and all(
            (isinstance(i, ast.Constant) and i.value in (None, Ellipsis))
            or (isinstance(i, ast.Slice) and i.lower is i.upper is i.step is None)
            for i in (node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice])
        ):
            node = node.value
        else:
            return node


def _inf_literal(node: ast.expr) -> bool:
    """A +inf literal: ``float("inf")``, ``math.inf``, ``torch.inf``."""
    text = ast.unparse(node).replace("'", '"').replace(" ", "")
    return text in ('float("inf")', 'float("+inf")', "math.inf", "torch.inf", "np.inf")


@dataclass(frozen=True)
class _EmptyMin:
    """A +inf fill (masked_fill(m, inf), torch.where(keep, x, inf)) that a min reduced: a
    slice the mask kept no value of has the fill as its min, and that inf met another."""

    fill: OpEvent  #: the op that wrote the +inf
    keep: str  #: what holds True where a value is kept, for ``.any()``: ``mask``
    reduce: str  #: the min: ``amin``
    finite: str | None  #: the fill line with torch.finfo(dtype).max for the inf

    def evidence(self) -> str:
        out = self.fill.output
        where = f" at {self.fill.source}" if self.fill.source else ""
        n = f"{out.posinf:,} of {out.numel:,} values" if out is not None else "values"
        every = out is not None and out.posinf == out.numel
        kept = "no value at all" if every else "no value on some slices"
        return (
            f"{short_op(self.fill.op)}{where} wrote +inf into {n} and {self.reduce} reduced "
            f"them: {self.keep} kept {kept}, and the {self.reduce} of only the fill is +inf"
        )

    def explanation(self, expr: str) -> str:
        return (
            f"{expr} has no value, so IEEE arithmetic returns NaN. The +inf is the fill of "
            f"an empty mask: where {self.keep} keeps no value, every value {self.reduce} "
            "reduces is the +inf fill, so the min is inf, and it met another inf. "
            f" Guard the empty case ({self.keep}.any()). A "
            "finite fill for a min is torch.finfo(dtype).max, not finfo.min (which every min "
            "would pick)."
        )

    def fix(self, ev: OpEvent) -> str:
        guard = self._guarded(ev)
        lines = [guard] if guard is not None else []
        if guard is None:
            at = f" (line {self.fill.source.rpartition(':')[2]})" if self.fill.source else ""
            lines.append(
                f"assert {self.keep}.any(), {(self.keep + ' is empty')!r}   # before the "
                f"{self.reduce}{at}: its min is the inf fill"
            )
        if self.finite is not None:
            lines.append(
                f"# or {self.finite}   # a finite fill: an empty slice's min is then finite "
                "(the largest value), not inf"
            )
        return "\n".join(lines)

    def _guarded(self, ev: OpEvent) -> str | None:
        """The op's line computing its one binary expression only when the mask kept a
        value (0 otherwise), when the fill ran earlier in the same function and file."""
        kind = {"div": ast.Div, "true_divide": ast.Div, "divide": ast.Div, "sub": ast.Sub}.get(
            packet(ev.op).rstrip("_")
        )
        fpath, _, fnum = (self.fill.source or "").rpartition(":")
        path, _, num = (ev.source or "").rpartition(":")
        if kind is None or not ev.code or not fnum.isdigit() or not num.isdigit():
            return None
        if fpath != path or not 0 < int(num) - int(fnum) < 40 or _def_between(path, fnum, num):
            return None
        line = ev.code.split("  #", 1)[0].rstrip()
        try:
            tree = ast.parse(line.strip())
        except SyntaxError:
            return None
        found = [n for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, kind)]
        if len(found) != 1:
            return None
        stripped = line.strip()
        start, end = found[0].col_offset, found[0].end_col_offset or found[0].col_offset
        whole = stripped[start:end]
        shape = ast.get_source_segment(stripped, found[0].left) or "x"
        guarded = f"({whole} if {self.keep}.any() else torch.zeros_like({shape}))"
        if stripped[start - 1 : start] == "(" and stripped[end : end + 1] == ")":
            start, end = start - 1, end + 1
        return (
            f"{stripped[:start]}{guarded}{stripped[end:]}   # an empty {self.keep}: "
            "no kept value, choose what it should be (0 here)"
        )


def _def_between(path: str, start: str, end: str) -> bool:
    """A ``def`` line between two lines of ``path``: they are in different functions."""
    import linecache

    return any(
        re.match(r"\s*(?:async\s+)?def\s", linecache.getline(path, n))
        for n in range(int(start) + 1, int(end) + 1)
    )


def _empty_min(ev: OpEvent, src: InfSource) -> _EmptyMin | None:
    """The +inf fill a min reduced on the fill's line (``x.masked_fill(~m, inf).amin(1)``)
    when it is where the op's infinities came from; None otherwise."""
    for m in src.masks:
        if "+inf" not in m.born or "-inf" in m.born or not m.code:
            continue
        line = m.code.split("  #", 1)[0].strip()
        try:
            tree = ast.parse(line)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            reduce = _min_of(node)
            if reduce is None:
                continue
            fill, reduced = reduce
            keep = _kept(fill)
            if keep is None:
                continue
            dtype = m.dtype or ev.dtype or "float32"
            return _EmptyMin(
                m, keep, reduced, replace_pos_inf(line, f"torch.finfo(torch.{dtype}).max")
            )
    return None


def _min_of(node: ast.Call) -> tuple[ast.Call, str] | None:
    """(the +inf fill call, the min's name) when ``node`` is a min reduction of one:
    ``x.masked_fill(k, inf).amin(1)``, ``torch.amin(torch.where(k, x, inf), 1)``."""
    func = node.func
    if not isinstance(func, ast.Attribute) or func.attr not in _MIN_REDUCTIONS:
        return None
    is_torch = isinstance(func.value, ast.Name) and func.value.id == "torch"
    inner = node.args[0] if is_torch and node.args else None if is_torch else func.value
    while isinstance(inner, ast.Call | ast.Subscript) and not _is_fill(inner):
        inner = inner.value if isinstance(inner, ast.Subscript) else None
    if isinstance(inner, ast.Call) and _is_fill(inner):
        return inner, func.attr
    return None


def _is_fill(node: ast.expr) -> bool:
    return _kept(node) is not None if isinstance(node, ast.Call) else False


def _kept(call: ast.Call) -> str | None:
    """What holds True where a +inf fill call keeps the value: ``m`` of
    ``x.masked_fill(~m, inf)`` (``~(k)`` of ``masked_fill(k, inf)``), ``keep`` of
    ``torch.where(keep, x, inf)``; None for other calls."""
    func = call.func
    if not isinstance(func, ast.Attribute):
        return None
    if func.attr in ("masked_fill", "masked_fill_"):
        args = [*call.args, *(k.value for k in call.keywords if k.arg in ("mask", "value"))]
        if len(args) != 2 or not _inf_literal(args[1]):
            return None
        mask = args[0]
        if isinstance(mask, ast.UnaryOp) and isinstance(mask.op, ast.Invert | ast.Not):
            return ast.unparse(_whole(mask.operand))
        return f"(~{paren(ast.unparse(mask))})"
    if func.attr == "where" and len(call.args) == 3 and _inf_literal(call.args[2]):
        return ast.unparse(_whole(call.args[0]))
    return None


def _hidden_inf(ev: OpEvent) -> list[tuple[str, TensorStat]]:
    """The forward values a backward node saved that held an infinity and no NaN, when the
    node made NaN from them and no node of the graph made them (a constant to autograd:
    ``torch.log(y)`` of data): the gradient that reached them was 0 (torch.where picked the
    other branch, a mask zeroed them) and 0 × inf is NaN."""
    if ev.phase is not Phase.BACKWARD or not ev.node or "NaN" not in ev.born or ev.cause:
        return []
    if node_base(ev.node) not in ("Mul", "Div", "Addcmul", "Addcdiv"):
        return []
    ins = [(n, s) for n, s in ev.inputs if s is not None]
    if any(s.has_nan for _, s in ins):
        return []  # a NaN hidden in forward: NW402's
    return [(n, s) for n, s in ins if s.has_posinf or s.has_neginf]


#: autograd nodes of the ops that hide a value in forward (a branch not picked, a masked slot)
_HIDING_NODES = frozenset({"Where", "MaskedFill", "MaskedScatter", "IndexPut"})
#: autograd nodes of the ops whose result overflows to +inf (exp(90) in float32)
_OVERFLOW_NODES = frozenset({"Exp", "Exp2", "Expm1", "Pow"})
_HIDING_CODE = re.compile(r"\bwhere\(|masked_fill|\bmask")


def _hidden_inf_story(ev: OpEvent, held: list[tuple[str, TensorStat]]) -> str:
    """Which evidence tells where the hidden infinity came from: ``where`` (a where or mask
    node made it, or the user's line has one), ``overflow`` (an exp or pow node made it),
    ``constant`` (no node made it: a value computed without autograd history) or ``op``
    (another node made it: the event does not say more)."""
    made = [str(ev.scalars.get(f"{n}_made_by", "")) for n, _ in held]
    bases = {node_base(m) for m in made if m}
    if bases & _HIDING_NODES or _HIDING_CODE.search(ev.code or ""):
        return "where"
    if bases & _OVERFLOW_NODES:
        return "overflow"
    if not bases:
        return "constant"
    return "op"


def _hidden_inf_diagnosis(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, held: list[tuple[str, TensorStat]]
) -> Diagnosis:
    op = short_op(ev.op)
    kinds = " and ".join(k for k in ("-inf", "+inf") if any(k in s.kinds() for _, s in held))
    story = _hidden_inf_story(ev, held)
    evidence = [a.summary]
    for n, s in held[:2]:
        by = ev.scalars.get(f"{n}_made_by")
        evidence.append(
            f"{ev.node} saved its forward {n}: {describe_stat(s)}: it held {kinds} in forward"
            + (
                f", made by autograd node {by}"
                if by
                else ", made from tensors that need no gradient (data, a constant): no node "
                "of the graph made it"
            )
        )
    line = code_line(ev)
    if line and ev.phase is Phase.BACKWARD and not (ev.code or "").strip().endswith(".backward()"):
        evidence.append(line)
    if story == "where":
        evidence.append(
            f"the loss was finite: torch.where or a 0 mask kept the {kinds} out of it, but "
            f"backward multiplies their gradient (0) by them: 0 × {kinds} = NaN"
        )
    else:
        evidence.append(
            f"the loss was finite: an op after {op} kept the {kinds} out of it (a gather or "
            f"index that picked other elements, x / inf = 0, a min), so their gradient is 0, "
            f"and backward multiplies it by them: 0 × {kinds} = NaN"
        )
    evidence.append(untraced_hint(ctx))
    fields = op_fields(ev, a)
    if story == "where":
        return ctx.diagnosis(
            **fields,
            title=f"0 × {kinds} in backward: an infinity torch.where or a mask hid in forward",
            evidence=evidence,
            explanation=(
                f"torch.where(cond, f(x), 0) computes f(x) everywhere and picks afterwards: "
                f"where f(x) is {kinds} (log of 0, 1/0) the branch it did not pick still gets "
                f"a gradient of 0, which {op} multiplies by the saved {kinds}: 0 × {kinds} = "
                "NaN, and every weight gets it. Give f a value it accepts where cond is False "
                "(the double where), or clamp its input."
            ),
            fix=_WHERE_FIX,
        )
    if story == "overflow":
        by = next(str(ev.scalars[f"{n}_made_by"]) for n, _ in held if f"{n}_made_by" in ev.scalars)
        return ctx.diagnosis(
            **fields,
            title=f"0 × {kinds} in backward: {node_base(by).lower()} overflowed to {kinds} in "
            "forward",
            evidence=evidence,
            explanation=(
                f"{by} made {kinds} in forward: its result passed the largest "
                f"{ev.dtype or 'float'} value. The loss stayed finite because a later op "
                f"dropped it (x / inf = 0), so its gradient is 0, and {op}'s backward "
                f"multiplies that 0 by the saved {kinds}: NaN, and every weight gets it. "
                "Bound the argument so the result fits."
            ),
            fix=_EXP_FIX,
        )
    if story == "constant":
        what = (
            "a value computed without autograd history (from data or a constant: a per-class "
            "weight 1 / count with a count of 0 is +inf, a log of a 0 in the data is -inf)"
        )
        title = f"0 × {kinds} in backward: a constant operand held {kinds}"
    else:
        by = next(str(ev.scalars[f"{n}_made_by"]) for n, _ in held if f"{n}_made_by" in ev.scalars)
        what = (
            f"a value autograd node {by} made from an operand that already held {kinds} (a "
            "constant weight 1 / count with a count of 0) or that overflowed there"
        )
        title = f"0 × {kinds} in backward: a {kinds} from forward was dropped from the loss"
    return ctx.diagnosis(
        **fields,
        title=title,
        evidence=evidence,
        explanation=(
            f"{op} saved {what}. The loss stayed finite because a later op did not use those "
            f"elements (gather, indexing, x / inf = 0), so their gradient is 0, and {op}'s "
            f"backward multiplies it by the saved {kinds}: 0 × {kinds} = NaN, and every weight "
            f"gets it. Make the value finite where it is computed."
        ),
        fix=_WHERE_FIX
        if kinds == "-inf"
        else _COUNT_FIX
        if story == "constant"
        else f"{_COUNT_FIX}\n# or, where an exp made it:\n{_EXP_FIX}",
    )


_WHERE_FIX = (
    "safe = torch.where(cond, x, torch.ones_like(x))   # a value the op accepts where "
    "cond is False\n"
    "out = torch.where(cond, torch.log(safe), 0.0)     # finite, and so is its gradient\n"
    "# or: torch.log(x.clamp_min(torch.finfo(x.dtype).tiny))"
)
_COUNT_FIX = (
    "w = 1.0 / count.clamp_min(1)   # a weight from a count: a count of 0 gets a finite "
    "weight, not +inf"
)
_EXP_FIX = (
    "x = x.clamp(max=math.log(torch.finfo(x.dtype).max))   # before torch.exp(x): its "
    "result fits the dtype (import math)"
)


def _given(ev: OpEvent) -> str:
    """``from finite inputs``, or what the non-finite inputs held: the op checker records
    an op that made a kind of value its inputs did not hold (NaN from -inf, say). Empty
    when no input was seen (a backward node known by name only: what it saved was freed)."""
    if not ev.inputs:
        return ""
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
    if ev.phase is Phase.BACKWARD and ev.source and ev.source != ev.backward_at:
        # the node's forward line (anomaly mode): not the ``loss.backward()`` call itself
        return (
            f"# {ev.node or op} is the backward of the forward op at {ev.source}: its\n"
            f"# derivative is infinite or undefined at some of that op's inputs there\n"
            f"# (e.g. sqrt or acos at an endpoint): keep them off it, x.clamp(lo + eps, hi - eps)"
        )
    if ev.phase is Phase.BACKWARD:
        node = ev.node or op
        return (
            f"# {node} is the backward of a forward op whose derivative is infinite or\n"
            "# undefined at some of its inputs; a replay names that forward line:\n"
            + (_rerun() if cli_rerun() is not None else _REPLAY)
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
    head = re.match(r"\s*(?:async\s+)?def\s+(\w+)", ev.code or "")
    if head is not None:  # a one-line def: its body is what ran, and the code goes inside it
        where = f"in {head.group(1)}'s body ({ev.source or 'its line'}), before its return"
    inner = wrapped_binop(ev) if not calls else None
    if inner is not None:  # the line reduces the op's result: inspect the op's own expression
        expr, left, right = inner
        lines = [
            f"# {where}: the elements {op} made {ev.born}, and its inputs there",
            f"bad = ~torch.isfinite({expr})   # {op} alone, before the rest of the line",
        ]
        if len(ev.inputs) == 2 and all(
            s is not None and s.numel == ev.output.numel for _, s in ev.inputs
        ):
            lines.append(f"print({paren(left)}[bad], {paren(right)}[bad])")
        else:  # broadcast operands: the positions index the result's shape
            lines.append(f"print(bad.nonzero()[:8])   # then index {left} and {right} with them")
        return "\n".join(lines)
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


# ------------------------------------------------------- an exp that overflowed, hidden

#: autograd nodes whose backward multiplies the incoming gradient by the forward result
_EXP_NODES = {"Exp": "exp", "Exp2": "exp2", "Expm1": "expm1"}


def _saved_overflow(ev: OpEvent) -> TensorStat | None:
    """What an exp's node saved in forward, when its backward made the value and the saved
    result held +inf: the forward exp overflowed, and the next op hid it."""
    if ev.phase is not Phase.BACKWARD or node_base(ev.node) not in _EXP_NODES:
        return None
    return next((s for _, s in ev.inputs if s is not None and s.has_posinf), None)


def _forward_exp(ctx: RuleContext, ev: OpEvent, name: str) -> OpEvent | None:
    """The forward op event of the exp whose node ``ev`` ran (forensic mode records the
    forward +inf too, though it never reached a module's output)."""
    for o in ctx.trace.ops:
        if o.phase is not Phase.FORWARD or packet(o.op).rstrip("_") != name:
            continue
        if "+inf" in o.born and (o.source == ev.source or not (o.source and ev.source)):
            return o
    return None


def _exp_overflow(ctx: RuleContext, a: Anomaly, ev: OpEvent, saved: TensorStat) -> Diagnosis:
    name = _EXP_NODES[node_base(ev.node)]
    dtype = ev.dtype or a.record.dtype
    lim = limits(dtype)
    at = f" at {ev.source}" if ev.source else ""
    fwd = _forward_exp(ctx, ev, name)
    evidence = [
        a.summary,
        f"in forward, {name}{at} overflowed to +inf: the result autograd saved for "
        f"{ev.node} holds {describe_stat(saved)}",
    ]
    bound = f"{fmt(lim.exp_bound)} = log({fmt(lim.max)})" if lim is not None else None
    x = first_input(fwd) if fwd is not None else None
    top = signed_max(x)
    if bound is not None and not math.isnan(top):
        evidence.append(f"its argument reached {fmt(top)}; {name} overflows {dtype} above {bound}")
    elif bound is not None:
        evidence.append(f"{name} overflows {dtype} above {bound}")
    evidence.append(
        "the forward value stayed finite: the next op turned the inf into a number "
        "(x / inf = 0, tanh(inf) = 1), so no module output showed it"
    )
    zero_times = "NaN" in ev.born
    evidence.append(
        f"in backward, {ev.node} multiplies the incoming gradient by that result: "
        f"{short_op(ev.op)} made {ev.born}" + (" (0 × inf)" if zero_times else "")
    )
    line = code_line(ev)
    if line:
        evidence.append(line)
    explanation = (
        f"{name}(x) is +inf in {dtype} for x above "
        f"{fmt(lim.exp_bound) if lim is not None else 'log(finfo.max)'}. The line"
        f"{at} hid the overflow in forward (x / (1 + exp(-x)) is -0 for a very negative x, "
        "tanh(log(1 + exp(x))) is 1 for a large one), but autograd saved the inf, and the "
        f"backward of {name} multiplies the gradient by it: "
        + ("0 × inf = NaN. " if zero_times else f"{ev.born}. ")
        + "Activations written by hand with exp (Swish, Mish, softplus, sigmoid) do this; "
        "torch's own versions are computed so that they never overflow."
    )
    return ctx.diagnosis(
        **op_fields(fwd if fwd is not None else ev, a),
        title=f"{name} overflowed in forward (hidden), its backward made {ev.born}",
        evidence=evidence,
        explanation=explanation,
        fix=_exp_fix(ev.code, name, lim.exp_bound if lim is not None else None),
    )


_STABLE_TABLE = (
    "# the stable forms, by what the line computes:\n"
    "#   x / (1 + exp(-x)), x * sigmoid(x)  ->  torch.nn.functional.silu(x)\n"
    "#   x * tanh(log(1 + exp(x)))          ->  torch.nn.functional.mish(x)\n"
    "#   log(1 + exp(x))                    ->  torch.nn.functional.softplus(x)\n"
    "#   1 / (1 + exp(-x))                  ->  torch.sigmoid(x)"
)


def _exp_fix(code: str | None, name: str, exp_bound: float | None) -> str:
    """The user's line with its hand-written activation replaced by torch's stable one;
    else the line with exp's argument bounded (its result then stays finite even squared),
    and the table of stable forms."""
    plain = code.split("  #", 1)[0].strip() if code else ""
    was = f"   # was: {plain}" if plain else ""
    stable = _stable_form(plain)
    if stable is not None:
        fixed, fn = stable
        return f"{fixed}{was}\n# {fn} computes the same function without overflowing"
    cap = math.floor(exp_bound / 2) if exp_bound is not None else None
    bounded = (
        rewrite_call(plain, [name], lambda e: f"{paren(e)}.clamp(max={cap})")
        if cap is not None
        else None
    )
    if bounded is not None:
        return (
            f"{bounded}{was}\n"
            f"# {name}({cap}) stays finite even squared; or use a stable form:\n{_STABLE_TABLE}"
        )
    return _STABLE_TABLE


_TORCH_MODULES = frozenset({"torch", "torch.special", "F", "torch.nn.functional", "nn.functional"})


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _applied(node: ast.expr, names: tuple[str, ...]) -> ast.expr | None:
    """The argument of ``torch.f(a)`` or ``a.f()`` for ``f`` in ``names``."""
    if not isinstance(node, ast.Call) or node.keywords or not isinstance(node.func, ast.Attribute):
        return None
    f = node.func
    if f.attr not in names:
        return None
    if len(node.args) == 1 and _dotted(f.value) in _TORCH_MODULES:
        return node.args[0]
    if not node.args and _dotted(f.value) not in _TORCH_MODULES:
        return f.value
    return None


def _one(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value in (1, 1.0) and node.value is not True


def _one_plus(node: ast.expr) -> ast.expr | None:
    """``e`` of ``1 + e`` or ``e + 1``."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        if _one(node.left):
            return node.right
        if _one(node.right):
            return node.left
    return None


def _negated(node: ast.expr) -> ast.expr | None:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return node.operand
    return None


def _same(a: ast.expr | None, b: ast.expr | None) -> bool:
    return a is not None and b is not None and ast.dump(a) == ast.dump(b)


def _exp_of(node: ast.expr | None) -> ast.expr | None:
    return None if node is None else _applied(node, ("exp",))


def _softplus_of(node: ast.expr) -> ast.expr | None:
    """``x`` of ``log(1 + exp(x))`` or ``log1p(exp(x))``."""
    inner = _applied(node, ("log",))
    if inner is not None:
        return _exp_of(_one_plus(inner))
    return _exp_of(_applied(node, ("log1p",)))


def _sigmoid_of(node: ast.expr) -> ast.expr | None:
    """``x`` of ``1 / (1 + exp(-x))``."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and _one(node.left):
        return _negated(_exp_of(_one_plus(node.right)))  # type: ignore[arg-type]
    return None


def _stable_of(node: ast.expr) -> tuple[str, ast.expr] | None:
    """Which torch function ``node`` computes by hand with exp, and its argument."""
    if not isinstance(node, ast.BinOp):
        return _stable_call(node)
    if isinstance(node.op, ast.Div):  # x / (1 + exp(-x))
        den = _one_plus(node.right)
        x = _negated(_exp_of(den)) if den is not None else None  # type: ignore[arg-type]
        if _same(x, node.left):
            return "torch.nn.functional.silu", node.left
        x = _sigmoid_of(node)
        return ("torch.sigmoid", x) if x is not None else None
    if isinstance(node.op, ast.Mult):
        for v, other in ((node.left, node.right), (node.right, node.left)):
            t = _applied(other, ("tanh",))
            if t is not None and _same(_softplus_of(t), v):
                return "torch.nn.functional.mish", v
            if _same(_sigmoid_of(other), v):
                return "torch.nn.functional.silu", v
    return None


def _stable_call(node: ast.expr) -> tuple[str, ast.expr] | None:
    x = _softplus_of(node)
    return ("torch.nn.functional.softplus", x) if x is not None else None


def _stable_form(line: str) -> tuple[str, str] | None:
    """``line`` with its first hand-written exp activation (outermost first) replaced by
    torch's stable function, and that function's name; None when the line holds none or
    does not parse on its own (a part of a longer statement)."""
    if not line or not line.isascii():
        return None
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if not isinstance(node, ast.expr):
            continue
        hit = _stable_of(node)
        if hit is None:
            continue
        fn, arg = hit
        text = ast.get_source_segment(line, arg)
        if text is None or node.end_col_offset is None or node.lineno != node.end_lineno:
            return None
        return line[: node.col_offset] + f"{fn}({text})" + line[node.end_col_offset :], fn
    return None


# ------------------------------------------------------ inside a torch parametrization

_PARAMETRIZATION = re.compile(r"^(?:(?P<owner>.+)\.)?parametrizations\.(?P<name>\w+)\.\d+$")


def parametrization(path: str | None) -> tuple[str, str] | None:
    """``(owner, tensor)`` when ``path`` is a parametrization module of
    ``torch.nn.utils.parametrize`` (``0.parametrizations.weight.0`` -> ``("0", "weight")``;
    the owner is ``""`` for the root), else None. Rules whose fix edits the op's line can
    defer to NW100 there: the op ran in torch's code, the cause is in the stored tensor.

    >>> parametrization("enc.fc.parametrizations.weight.0"), parametrization("enc.fc")
    (('enc.fc', 'weight'), None)
    """
    m = _PARAMETRIZATION.match(path or "")
    return (m.group("owner") or "", m.group("name")) if m else None


def _parametrized(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, par: tuple[str, str]
) -> Diagnosis | None:
    """NaN made from finite values inside a parametrization (weight_norm, spectral_norm):
    the stored tensor it computes the weight from holds zeros it divides by a norm of."""
    owner, name = par
    path = ev.path or a.path
    trace = ctx.trace
    call = next((c for c in trace.calls if c.path == path), None)
    ins = [r for r in trace.inputs_of(call.id)] if call is not None else []
    stored = [(r.shape, f"original{i}" if len(ins) > 1 else "original") for i, r in enumerate(ins)]
    if not stored:  # sentinel: no call of it was recorded; the weights' names tell them
        stored = _stored_by_name(ctx, f"{owner}.parametrizations.{name}.".lstrip("."))
    if not stored or _given(ev) != "from finite inputs":
        return None
    zeros = [(nm, s) for nm, s in ev.inputs if s is not None and has_zero(s)]
    if not zeros:
        return None
    culprit = _stored_with(stored, zeros[0][1]) or stored[-1]
    plist = f"{module_ref(owner)}.parametrizations.{name}"
    kind = call.module_type if call is not None else (a.module_type or "parametrization")
    op = short_op(ev.op)
    what = f"{owner}'s {name}" if owner else name
    names = ", ".join(f"{o} {shape}" for shape, o in stored)
    evidence = [
        a.summary,
        f"{path} ({kind}) is a torch parametrization: every forward it computes {what} from "
        f"the tensors stored in {plist} ({names})",
        f"{op} made NaN from finite inputs; its input {zeros[0][0]} ({culprit[1]}) holds "
        f"exact zeros: {describe_stat(zeros[0][1])}",
    ]
    if ev.source:
        evidence.append(
            f"{ev.source} is where your code called the model: the op ran inside torch's "
            "parametrization code, which is not the place to fix it"
        )
    explanation = (
        f"{what} is not a parameter: {kind} computes it at every forward from "
        f"{plist}.{culprit[1]} (and the other tensors stored there), which the optimizer "
        "updates. weight_norm divides each row of v (original1) by its norm and spectral_norm "
        "divides the weight by its largest singular value, so a row -- or a whole weight -- "
        "of zeros (pruning, a mask, a zero init, a write under no_grad) gives 0/0 = NaN. "
        "The fix is in that stored tensor: find its rows of norm 0, and stop what zeroes "
        "them or give them a direction again."
    )
    t = f"{plist}.{culprit[1]}"
    if kind == "_SpectralNorm":
        explanation, fix = _spectral_fix(what, module_ref(owner), name, t)
        return ctx.diagnosis(
            **op_fields(ev, a),
            title=f"NaN in the spectral norm of {what}: sigma = 0 (a weight of zeros)",
            evidence=evidence,
            explanation=explanation,
            fix=fix,
        )
    fix = (
        f"t = {t}   # what {what} is computed from\n"
        "zero = t.detach().reshape(t.shape[0], -1).norm(dim=1) == 0   # rows of norm 0: 0/0\n"
        "print(zero.nonzero().flatten().tolist())\n"
        "with torch.no_grad():   # a small random direction; or keep pruning/masks off this "
        "layer\n"
        "    t[zero] = 1e-3 * torch.randn_like(t[zero])"
    )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=f"NaN in the parametrization of {what}: a norm of 0 in what it is computed from",
        evidence=evidence,
        explanation=explanation,
        fix=fix,
    )


def _spectral_fix(what: str, module: str, name: str, stored: str) -> tuple[str, str]:
    """spectral_norm of a weight of zeros: sigma is 0 (0/0), and its power-iteration vectors
    (the buffers _u and _v) became 0 (W @ u = 0) and stay 0 whatever the weight becomes, so
    the parametrization is registered again on a non-zero weight."""
    explanation = (
        f"{what} is not a parameter: spectral_norm computes it at every forward as "
        f"{stored} / sigma, sigma its largest singular value, estimated by power iteration "
        "from the vectors it keeps (the buffers _u and _v). A weight of zeros (a zero init, "
        "pruning, a write under no_grad) has sigma = 0, so 0/0 = NaN; and W @ u = 0 made _u "
        "and _v 0, where they stay after the weight is given values again. Remove the "
        "parametrization, initialize the weight to something non-zero, and register "
        "spectral_norm again (the parameter object is kept: the optimizer still updates it)."
    )
    arg = "" if name == "weight" else f", {name!r}"
    fix = (
        "from torch.nn.utils import parametrize\n"
        "from torch.nn.utils.parametrizations import spectral_norm\n"
        f"parametrize.remove_parametrizations({module}, {name!r}, leave_parametrized=False)\n"
        f"w = {module}.{name}\n"
        "with torch.no_grad():   # any non-zero init; spectral_norm cannot scale a zero weight\n"
        "    w.copy_(torch.randn_like(w) / w.shape[1] ** 0.5)\n"
        f"spectral_norm({module}{arg})   # with the arguments you used; _u, _v start again"
    )
    return explanation, fix


def _stored_by_name(ctx: RuleContext, prefix: str) -> list[tuple[tuple[int, ...], str]]:
    """The shapes of the tensors stored in a parametrization list (``original``,
    ``original0``, ...), in order, by the names of the watched weights (the fact
    ``param_shapes``, else the records of their gradients) that are ``prefix`` + that name."""
    shapes = ctx.facts.get("param_shapes")
    found: dict[str, tuple[int, ...]] = {}
    named = (
        list(shapes.items())
        if isinstance(shapes, Mapping)
        else [(r.role, r.shape) for r in ctx.trace.records if r.phase is Phase.GRADIENT]
    )
    for q, shape in named:
        rest = q[len(prefix) :] if q.startswith(prefix) else ""
        if re.fullmatch(r"original\d*", rest):
            found.setdefault(rest, tuple(shape))
    return [(found[k], k) for k in sorted(found, key=lambda k: (len(k), k))]


def _stored_with(
    stored: list[tuple[tuple[int, ...], str]], held: TensorStat
) -> tuple[tuple[int, ...], str] | None:
    """The stored tensor the op's input with zeros is (as many values, the first such)."""
    return next((x for x in stored if _numel(x[0]) == held.numel), None)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


# ------------------------------------------- an overflow inside a module, hidden by the next op


@rule(
    "NW105",
    title="Overflow hidden inside a module (silently wrong values)",
    severity="warning",
    summary=(
        "Forensic mode or a replay: an op overflowed to inf from finite inputs (a float16 "
        "sum, var, pow or matmul past finfo.max) and the next op turned the inf into a number "
        "(x / inf = 0), so no module output holds NaN or inf but the values are wrong; "
        "compute that op in float32."
    ),
    early=True,
    priority=20,
)
def hidden_overflow(ctx: RuleContext) -> Iterator[Diagnosis]:
    if ctx.anomaly is not None:
        return  # a non-finite value reached a record: the anomaly's rules say what it was
    seen: set[tuple[str, str | None]] = set()
    for ev in ctx.trace.ops:
        if ev.phase is not Phase.FORWARD or ev.cause is not None or ev.injected:
            continue
        key = (ev.op, ev.source)
        if key in seen or "NaN" in ev.born or classify(ev) != "overflow" or _mask_sum(ev):
            continue
        if _result_unused(ctx, ev):
            continue
        seen.add(key)
        alike = [o for o in ctx.trace.ops if (o.op, o.source) == key]
        yield _hidden_overflow(ctx, ev, len(alike), [o.path for o in alike if o.path])
        if len(seen) == 3:
            return


#: ops whose gradient multiplies by their own result (exp's is grad * exp(x)): an inf of
#: theirs that reached the loss makes the backward inf or NaN (g * inf, 0 * inf) at their line
_GRAD_OF_RESULT = frozenset({"exp", "exp_", "exp2", "expm1", "sinh", "cosh"})


def _result_unused(ctx: RuleContext, ev: OpEvent) -> bool:
    """An exp-like op whose whole line assigns its result to names (``lam = torch.exp(x)``),
    in a step whose backward ran through the op's code (its module's output got a gradient;
    loss code: the parameters did) and made no NaN or inf at that line: had the inf reached
    the loss, its gradient would have been g * inf there. The result fed nothing the loss
    depends on (computed and not used, a branch not taken): nothing was absorbed."""
    if packet(ev.op) not in _GRAD_OF_RESULT or not ev.source or not ev.code:
        return False
    try:
        tree = ast.parse(ev.code.strip())
    except SyntaxError:
        return False
    stmt = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(stmt, ast.Assign) or not isinstance(stmt.value, ast.Call):
        return False  # the result used on the line itself (1 / (1 + torch.exp(-x)))
    if any(isinstance(n, ast.Call) for a in stmt.value.args for n in ast.walk(a)):
        return False  # another op on the line: which of them overflowed is not known
    if any(o.phase is Phase.BACKWARD and o.source == ev.source for o in ctx.trace.ops):
        return False
    if _without_grad(ev.source):
        return False  # no gradient to show whether the inf was used
    if ev.path is None or ev.path == LOSS_PATH:
        return ctx.trace.grad_norm is not None and math.isfinite(ctx.trace.grad_norm)
    return any(r.phase is Phase.BACKWARD and r.path == ev.path for r in ctx.trace.records)


def _without_grad(source: str) -> bool:
    """The line at ``source`` (``file.py:42``) runs inside ``with torch.no_grad()`` /
    ``torch.inference_mode()``, or in a function decorated with one; unknown: True."""
    import linecache

    path, _, num = source.rpartition(":")
    if not path or not num.isdigit() or not linecache.getline(path, int(num)):
        return True
    here = linecache.getline(path, int(num))
    indent = len(here) - len(here.lstrip())
    off = re.compile(r"\b(?:no_grad|inference_mode|set_grad_enabled\(\s*False)\b")
    n = int(num) - 1
    while n > 0 and indent > 0:
        text = linecache.getline(path, n)
        n -= 1
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        ind = len(text) - len(text.lstrip())
        if ind >= indent:
            continue
        indent = ind
        if text.lstrip().startswith("with ") and off.search(text):
            return True
        if re.match(r"\s*(?:async\s+)?def\s", text):
            above = linecache.getline(path, n).strip()
            return above.startswith("@") and bool(off.search(above))
    return False


def _same_line(cls: str, mods: Sequence[str]) -> str:
    listed = ", ".join(mods[:6]) + (" ..." if len(mods) > 6 else "")
    return f"# the same line overflowed in every {cls} ({listed}): fix the class once"


def _each_of_class(fix: str, cls: str, mods: Sequence[str], *, root: str) -> str | None:
    """``fix``, written for one module reached as ``sub``, applied to every module of class
    ``cls`` of the model: its code lines in a loop over ``model.modules()``, its comments
    naming the class; one fix for all the modules ``mods`` the same line overflowed in.
    None when a code line of ``fix`` is not a call on ``sub`` (a rewrite of the forward's
    line: that already fixes every module of the class)."""
    body: list[str] = []
    notes: list[str] = []
    for raw in fix.splitlines():
        line = raw.replace("in sub's forward", f"in {cls}.forward").replace(
            "sub's", f"each {cls}'s"
        )
        (notes if line.lstrip().startswith("#") else body).append(line)
    if not body or not all(line.startswith("sub.") for line in body):
        return None
    loop = [
        f"for sub in {root}.modules():",
        f"    if type(sub).__name__ == {cls!r}:",
        *(f"        {line}" for line in body),
    ]
    return "\n".join([_same_line(cls, mods), *loop, *notes])


def _mask_sum(ev: OpEvent) -> bool:
    """Only -inf, from an input already at the dtype's most negative values: additive masks
    of finfo.min added together (a causal mask plus a padding mask, the Hugging Face way),
    whose -inf a softmax weighs exactly as it weighs finfo.min: nothing is wrong."""
    lim = limits(ev.dtype or "float32")
    if lim is None or ev.born.strip() != "-inf":
        return False
    return any(s.min <= -lim.max / 2 for s in inputs_of(ev) if not math.isnan(s.min))


def _hidden_overflow(
    ctx: RuleContext, ev: OpEvent, times: int, paths: Sequence[str] = ()
) -> Diagnosis:
    from nanwatch.rules import overflow as ov  # the fixes NW101 gives for the same overflow

    dtype = ev.dtype or "float32"
    lim = limits(dtype)
    name = packet(ev.op)
    op = short_op(ev.op)
    top = fmt(lim.max) if lim is not None else "finfo.max"
    power = ov._scalar_power(ev)
    big = max((s.magnitude for s in inputs_of(ev) if not math.isnan(s.magnitude)), default=math.nan)
    if power is not None:
        made = (
            f"{op} raised {fmt(power[0])} to the powers of its input: {fmt(power[0])} ** "
            f"{fmt(power[1])} = {fmt(power[2])}"
        )
    else:
        reach = ov._true_result(name, ev)
        made = f"{op} of inputs up to |x| = {fmt(big)}" + (
            f" (its exact result reaches {fmt(reach)})" if math.isfinite(reach) else ""
        )
    # every module the same line overflowed in this step (the RMSNorm of each block): a
    # fix for the first alone moves the warning to the next
    mods = list(dict.fromkeys([*([ev.path] if ev.path else []), *paths]))
    types = {c.path: c.module_type for c in ctx.trace.calls if c.path in mods and c.module_type}
    cls = types.get(mods[0]) if mods else None
    shared = len(mods) > 1 and cls is not None and all(types.get(p) == cls for p in mods)
    listed = ", ".join(mods[:6]) + (f" and {len(mods) - 6} more" if len(mods) > 6 else "")
    where = (
        f" in the forward of {len(mods)} modules: {listed}" + (f" (each a {cls})" if shared else "")
        if len(mods) > 1
        else f" in the forward of {ev.path}"
        if ev.path
        else ""
    )
    evidence = [
        f"{made}: the result is past {top} (torch.finfo(torch.{dtype}).max) and became "
        f"{ev.born}{where}" + (f" ({times} times this step)" if times > 1 else "")
    ]
    evidence += [f"input {nm}: {describe_stat(s)}" for nm, s in ev.inputs[:2]]
    line = code_line(ev)
    if line:
        evidence.append(line)
    evidence.append(
        "no module output, loss or gradient holds NaN or inf: a later op turned the inf "
        "into a number (x / inf = 0, exp(-inf) = 0), so these values are silently wrong"
    )
    call = next((c for c in ctx.trace.calls if c.path == ev.path), None)
    ref = module_ref(ev.path or "", root=call is None or call.root)

    def fix_for(ref: str) -> str:
        if power is not None:
            return ov._power_fix(ev.code, power, dtype, ref=ref)
        return ov._fix(
            ov._kind(name, ev, [ev], ctx.trace.ops),
            name,
            dtype,
            lim,
            ev.code,
            device=device_type(ev),
            ref=ref,
            # the loss code outside the modules, or a watched criterion's (nn.CTCLoss, the
            # user's loss module): not the model's forward
            loss=ev.path == LOSS_PATH or (call is not None and call.is_loss),
            autocast=ov._under_autocast(ctx, dtype),
            result=ov._true_result(name, ev),
        )

    fix = fix_for(ref)
    calls = [c for c in ctx.trace.calls if c.path in mods]
    if shared and cls is not None and calls and not any(c.root or c.is_loss for c in calls):
        # one fix for the class: the loop variable ``sub`` stands for each of its modules
        fix = _each_of_class(fix_for("sub"), cls, mods, root=module_ref("", root=True)) or (
            f"{_same_line(cls, mods)}\n{fix}"
        )
    explanation = (
        f"{name}'s result does not fit {dtype}, whose largest finite value is {top}, and "
        "became inf; the op after it absorbed the inf into an ordinary number instead of "
        "passing it on (a division by an infinite energy or variance gives 0, a frequency "
        "1 / inf is 0). Nothing downstream is NaN, so training goes on with those values "
        f"wrong: a normalization that outputs 0, positions that all look alike. Compute "
        f"{name} in float32 and cast only a bounded result back to {dtype}."
    )
    return ctx.diagnosis(
        **op_fields(ev),
        evidence=evidence,
        explanation=explanation,
        fix=fix,
    )
