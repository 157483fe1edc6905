"""Data: NaN or inf in the batch itself (NW401), named by sample index."""

from __future__ import annotations

import ast
import builtins
import keyword as keyword_module
import linecache
import math
import re
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from nanwatch.localize import (
    HALF_DTYPES,
    computed_target,
    earlier_finite_input,
    is_birth,
    root_call_number,
    whole_samples_bad,
)
from nanwatch.records import (
    LOSS_PATH,
    AnomalyKind,
    Call,
    Note,
    OpEvent,
    Phase,
    Record,
    StepTrace,
    TensorStat,
)
from nanwatch.rules._evidence import (
    anomaly_fields,
    code_line,
    describe_stat,
    fmt,
    log_into_target,
    module_loss_target,
    module_ref,
    packet,
    replace_neg_inf,
    replace_pos_inf,
    short_op,
    statements,
    target_log,
    under_views,
    untraced_hint,
)
from nanwatch.rules.base import Diagnosis, RuleContext, rule


@rule(
    "NW401",
    title="NaN or inf in the input data",
    severity="error",
    summary=(
        "The batch itself holds NaN/inf (bad data, not a bad layer): names the samples and "
        "which input or target."
    ),
    priority=10,
)
def bad_input_data(ctx: RuleContext) -> Iterator[Diagnosis]:
    a = ctx.anomaly
    if a is not None and a.kind is AnomalyKind.FORWARD and a.path == LOSS_PATH:
        said = list(_bad_functional_target(ctx))
        yield from said or _entered_data(ctx)
        return
    if a is not None and module_loss_target(ctx.trace, a) is not None:
        yield from _bad_functional_target(ctx, path=a.path)
        return
    if a is None or a.kind is not AnomalyKind.INPUT:
        return
    trace = ctx.trace
    rec = a.record
    call = trace.call(rec.call)
    target = call is not None and call.is_loss
    what = "targets" if target and rec.role != "input[0]" else "inputs"
    evidence: list[str] = []
    bad = [r for r in trace.inputs_of(rec.call) if r.bad and r.source is None] or [rec]
    for r in bad[:4]:
        s = r.stat
        rows = ""
        if s is not None and s.bad_rows:
            n = s.bad_row_count if s.bad_row_count is not None else len(s.bad_rows)
            more = ", ..." if n > len(s.bad_rows) else ""
            total = r.shape[0] if r.shape else "?"
            rows = (
                f": sample{'s' if n != 1 else ''} "
                + ", ".join(map(str, s.bad_rows))
                + more
                + f" ({n:,} of {total})"
            )
        if s is not None and s.bad_cols and len(r.shape) == 2:
            n = s.bad_col_count if s.bad_col_count is not None else len(s.bad_cols)
            more = ", ..." if n > len(s.bad_cols) else ""
            rows += (
                f"; feature column{'s' if n != 1 else ''} "
                + ", ".join(map(str, s.bad_cols))
                + more
                + f" ({n:,} of {r.shape[1]})"
            )
        evidence.append(
            f"{r.role} of {a.path} ({r.dtype}, shape {list(r.shape)}) holds "
            f"{s.kinds() if s else 'NaN'}{rows}"
        )
        evidence.append(f"{r.role}: {describe_stat(s)}")
    nth = root_call_number(trace, call)
    if nth is not None:  # micro-batches: the sample numbers count within one of them
        evidence.append(
            f"{a.path} ran {nth[1]} times in this step (micro-batches of gradient "
            f"accumulation, or several batches): the bad one is its call {nth[0]} of "
            f"{nth[1]}, and the sample numbers count within that call's batch"
        )
    if a.propagator_count:
        evidence.append(
            f"{a.propagator_count} module{'s' if a.propagator_count != 1 else ''} merely "
            "passed it on: no layer is at fault"
        )
    s = rec.stat
    rows_known = s is not None and bool(s.bad_rows)
    if target and rec.role == "input[0]":
        yield ctx.diagnosis(
            **anomaly_fields(a),
            title="NaN or inf reached the loss from unwatched code",
            evidence=evidence,
            explanation=(
                f"{a.path}'s input was computed by code nanwatch does not watch (between the "
                "model and the loss: a reshape, a cast, a functional op, a custom scaling), "
                "and it already held the non-finite value there; no watched module produced "
                "it. Watch the module that computes it, or run the step in forensic mode to "
                "name the op."
            ),
            fix=(
                "with nanwatch.watch(model, criterion, mode='forensic') as nw:\n"
                "    loss = criterion(postprocess(model(x)), y)   # names the op and line"
            ),
        )
        return
    made = None if target else _made_between_calls(ctx, rec, call)
    if made is not None:
        yield _computed_input(ctx, evidence, made)
        return
    computed = _computed_target(ctx, rec, call) if target and what == "targets" else None
    if computed is not None:
        yield _computed_target_diagnosis(ctx, evidence, computed)
        return
    data_fix = _find_samples_fix(
        bad[0].shape,
        rows_known=rows_known,
        role=bad[0].role,
        owner=a.path,
        target=target,
        sparse=_sparse(bad[0]),
        params=_forward_params(ctx, call),
        site=_call_site(ctx, call),
    )
    norms = [] if target else _norms_reached(ctx, rec)
    if norms:
        data_fix += "\n" + _restore_norms(norms)
    rooted = None if target else _rooted_input(ctx, call, rec.role)
    if rooted is not None:
        yield _rooted_input_diagnosis(ctx, evidence, rooted)
        return
    times_inf = None if target or not _may_hold_nan(rec.stat) else _inf_product(ctx, call, rec)
    if times_inf is not None:
        yield _inf_product_diagnosis(ctx, evidence, times_inf)
        return
    if a.origin == "data-or-code":
        yield _data_or_code(ctx, evidence, what, data_fix, rec=bad[0], name=_fix_name(data_fix))
        return
    extra = {"title": "NaN or inf in the loss targets"} if what == "targets" else {}
    yield ctx.diagnosis(
        **anomaly_fields(a),
        **extra,
        evidence=evidence,
        explanation=(
            f"The {what} of this batch already held the non-finite value when "
            f"{a.path} was called: a missing value parsed as NaN, a division by a zero "
            "standard deviation in preprocessing, a corrupted file. The first layer turns "
            "it into NaN activations and the loss into NaN; every layer downstream is "
            "innocent."
        ),
        fix=data_fix,
    )


def _data_or_code(
    ctx: RuleContext,
    evidence: list[str],
    what: str,
    data_fix: str,
    *,
    rec: Record | None = None,
    name: str | None = None,
) -> Diagnosis:
    """NW401 for a NaN that fills whole samples (or whole columns) of a root's input in a
    mode that traces no op: the pattern of a division by a zero norm, speed or std of each
    sample in the user's code before the call as much as of a bad file. Which one, forensic
    mode tells: it names the op if the user's code made it. Whole feature columns of a 2-D
    ``rec`` (finite in the other columns) are told as such: a per-feature scaling whose
    divisor is 0 for a constant column, not a per-sample one."""
    a = ctx.anomaly
    assert a is not None
    cols = _whole_columns(rec) if rec is not None else None
    if cols is not None:
        return _whole_columns_diagnosis(ctx, evidence, what, cols, name or "x")
    return ctx.diagnosis(
        **anomaly_fields(a),
        evidence=[
            *evidence,
            "whole samples are non-finite: the pattern of a division by a per-sample norm, "
            "speed or std that is 0 in your code before the call, or of bad data",
        ],
        explanation=(
            f"The {what} held the non-finite value when {a.path} was called, and every layer "
            "after it only passed it on. Either the batch itself is bad (a corrupted file, a "
            "missing value parsed as NaN) or your code that ran on it before the call made it "
            "(x / x.norm(), x / speed, (x - mean) / std with a zero for a sample); this mode "
            "traces no op outside the modules, so it cannot tell which."
        ),
        fix=(
            f"# {untraced_hint(ctx)}\n"
            "# if your code divided by a per-sample norm, speed or std that is 0, floor it "
            "there: x / s.clamp_min(1e-6)\n"
            f"# if the data is bad:\n{data_fix}"
        ),
    )


def _fix_name(data_fix: str) -> str | None:
    """The name the batch goes by in ``data_fix`` (:func:`_find_samples_fix`'s last line,
    ``x = torch.nan_to_num(x, ...)``); None when it does not show one."""
    last = data_fix.rstrip().splitlines()[-1] if data_fix.strip() else ""
    m = re.match(r"\s*(.+?) = torch\.nan_to_num\(", last)
    return m.group(1) if m else None


def _whole_columns(rec: Record) -> str | None:
    """The feature columns (``2`` or ``2, 5``) of a 2-D ``rec`` whose every value is NaN or
    inf while its other columns are finite (and not whole samples: a sample of one
    feature is both); None otherwise."""
    s = rec.stat
    if s is None or len(rec.shape) != 2 or not s.bad_cols or s.nan is None:
        return None
    if whole_samples_bad(rec) or rec.shape[0] < 2:
        return None
    n = s.bad_col_count if s.bad_col_count is not None else len(s.bad_cols)
    if n >= rec.shape[1] or s.nan + (s.posinf or 0) + (s.neginf or 0) != n * rec.shape[0]:
        return None
    more = ", ..." if n > len(s.bad_cols) else ""
    return ", ".join(map(str, s.bad_cols)) + more


def _whole_columns_diagnosis(
    ctx: RuleContext, evidence: list[str], what: str, cols: str, x: str
) -> Diagnosis:
    """NW401 for whole feature columns non-finite in every sample, the other columns finite,
    in a mode that traces no op: a per-feature standardization ``(x - mean) / std`` (or a
    min-max scaling) whose divisor is 0 for a column that does not vary, or a column the
    data lacks throughout."""
    a = ctx.anomaly
    assert a is not None
    one = "," not in cols
    col = f"feature column {cols} is" if one else f"feature columns {cols} are"
    whole = "A whole feature column is" if one else "Whole feature columns are"
    return ctx.diagnosis(
        **anomaly_fields(a),
        evidence=[
            *evidence,
            f"{col} non-finite in every sample and the other columns are finite: the pattern "
            "of a per-feature scaling, (x - mean) / std or (x - min) / (max - min), whose "
            "divisor is 0 for a column that does not vary (0/0 = NaN), or of a column the "
            "data lacks",
        ],
        explanation=(
            f"The {what} held the non-finite value when {a.path} was called, and every layer "
            f"after it only passed it on. {whole} non-finite while the others are finite: a "
            "standardization "
            "whose statistics hold a constant column gives exactly that (its std is 0 and "
            "x - mean is 0 there: 0/0 = NaN), in your preprocessing or in your code before "
            "the call, and so does a feature missing from every row; this mode traces no op "
            "outside the modules, so it cannot tell which."
        ),
        fix=(
            f"# {untraced_hint(ctx)}\n"
            "# where the features are scaled (std or max - min, in your names), divide a "
            "constant column by 1, as sklearn's StandardScaler does:\n"
            "std = torch.where(std > 0, std, torch.ones_like(std))   # that column becomes "
            "0, not 0/0\n"
            "# if the data lacks the column, the columns non-finite in every row:\n"
            f"print((~torch.isfinite({x})).all(dim=0).nonzero().flatten().tolist())"
        ),
    )


#: the calls whose argument has a restricted domain (NaN for a negative value, -inf at 0)
_ROOTS_AND_LOGS = frozenset({"sqrt", "rsqrt", "log", "log2", "log10"})
#: calls that only select or reshape a table's values
_SELECTS = frozenset({"view", "reshape", "unsqueeze", "squeeze", "expand", "to", "float"})


@dataclass(frozen=True)
class _RootedInput:
    """A root input the user's line passes by a name assigned just above, from a sqrt or a
    log (``xt = ab.sqrt() * x0 + ...``): computed in the step, not loaded."""

    name: str  #: ``xt``
    stmt: str  #: ``xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise``
    at: str  #: ``train.py:41``
    calls: tuple[str, ...]  #: ``("ab.sqrt()", "(1 - ab).sqrt()")``
    ops: tuple[str, ...]  #: ``("sqrt",)``
    #: (statement, its line, the table read) when a root's operand is a name assigned by
    #: indexing a table: ``ab = alpha_bar[t][:, None]`` reads ``alpha_bar``
    table: tuple[str, str, str] | None


def _domain_calls(node: ast.AST) -> list[tuple[ast.Call, str, ast.expr]]:
    """The sqrt/log calls in ``node``: (the call, the op, its operand)."""
    out: list[tuple[ast.Call, str, ast.expr]] = []
    for c in ast.walk(node):
        if not isinstance(c, ast.Call) or not isinstance(c.func, (ast.Attribute, ast.Name)):
            continue
        op = c.func.attr if isinstance(c.func, ast.Attribute) else c.func.id
        if op not in _ROOTS_AND_LOGS:
            continue
        if isinstance(c.func, ast.Attribute) and not c.args and not c.keywords:
            out.append((c, op, c.func.value))  # x.sqrt()
        elif c.args:  # torch.sqrt(x)
            out.append((c, op, c.args[0]))
    return out


def _table_read(lines: list[str], line: int, name: str) -> tuple[str, str, str] | None:
    """(the statement, its line number, the table) when ``name`` is assigned above ``line``
    by indexing a tensor, through views: ``ab = alpha_bar[t][:, None]``."""
    found = _assignment_above(lines, line, name)
    if found is None:
        return None
    i, node = found
    node, seen = under_views(node, _SELECTS)
    if not seen or not isinstance(node, (ast.Name, ast.Attribute)):
        return None
    return lines[i].strip(), str(i + 1), ast.unparse(node)


def _site_names(
    ctx: RuleContext, call: Call | None, role: str
) -> tuple[str, list[str], int, set[str | None]] | None:
    """(the file, its lines, the line number, the names it may pass input ``role`` by) of
    the user's line that called the root of ``call``; None when it cannot be read."""
    root = call
    while root is not None and not root.root and root.parent is not None:
        root = ctx.trace.call(root.parent)
    if root is None:
        return None
    note = next((n for n in ctx.trace.notes if n.kind == "call_site" and n.path == root.path), None)
    if note is None or not note.source:
        return None
    path, _, num = note.source.rpartition(":")
    if not path or not num.isdigit():
        return None
    lines = linecache.getlines(path)
    line = int(num)
    names = {_site_arg(note.data, role)}
    code = note.data.get("code")
    if note.data.get("callee") is None and isinstance(code, str):
        # read after the call returned (its frame gone): the name the line calls the root
        # by is not known: the argument of any call on the line (the callers keep the
        # names whose assignment shows what they look for, when one alone does)
        try:
            calls = [c for c in ast.walk(ast.parse(code.strip())) if isinstance(c, ast.Call)]
        except SyntaxError:
            calls = []
        names = {_site_arg({**note.data, "callee": ast.unparse(c.func)}, role) for c in calls}
    return path, lines, line, names


def _rooted_input(ctx: RuleContext, call: Call | None, role: str) -> _RootedInput | None:
    """The bad root input ``role``, when the user's line passes it by a name that a
    statement just above assigns with a sqrt or a log (see :class:`_RootedInput`); read
    from the source file, None when it cannot be read or shows none."""
    site = _site_names(ctx, call, role)
    if site is None:
        return None
    path, lines, line, names = site
    picked: list[tuple[str, list[tuple[ast.Call, str, ast.expr]]]] = []
    for name in names:
        made = _assigned_above(lines, line, name) if name and name.isidentifier() else None
        found = _domain_calls(made) if made is not None else []
        if found and name:
            picked.append((name, found))
    if len(picked) != 1:
        return None
    name, found = picked[0]
    at = next(
        (
            i + 1
            for i in range(line - 2, -1, -1)
            if re.match(rf"{re.escape(name)}\s*=[^=]", lines[i].strip())
        ),
        None,
    )
    if at is None:
        return None
    operands = {ast.unparse(x) for _, _, x in found}
    bases = sorted({n.id for _, _, x in found for n in ast.walk(x) if isinstance(n, ast.Name)})
    table = _table_read(lines, at, bases[0]) if len(bases) == 1 and bases[0] in operands else None
    return _RootedInput(
        name,
        lines[at - 1].strip(),
        f"{path}:{at}",
        tuple(dict.fromkeys(ast.unparse(c) for c, _, _ in found)),
        tuple(dict.fromkeys(op for _, op, _ in found)),
        table,
    )


#: an infinite number written as such: ``float("-inf")``, ``-math.inf``, ``torch.inf``
_INF_WRITTEN = re.compile(
    r"""-?\s*(?:float\(\s*(['"])[+-]?inf(?:inity)?\1\s*\)|(?:math|torch|np|numpy)\.inf)""",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class _InfProduct:
    """A root input the user's line passes by a name that a statement just above assigns
    as a product with an infinite number: ``ext = (1.0 - mask[:, None, None, :]) *
    float("-inf")``, NaN wherever the other factor is 0 (0 x inf)."""

    name: str  #: ``ext``
    stmt: str  #: the statement, as written
    at: str  #: ``train.py:22``
    literal: str  #: ``float('-inf')``
    fixed: str | None  #: the statement with the dtype's finite extreme for the literal


def _may_hold_nan(s: TensorStat | None) -> bool:
    """The input holds NaN, or its counts are not known apart (read late)."""
    return s is None or s.nan is None or s.nan > 0


def _inf_product(ctx: RuleContext, call: Call | None, rec: Record) -> _InfProduct | None:
    """The bad root input ``rec``, when the user's line passes it by a name assigned just
    above by a product with an infinite literal (see :class:`_InfProduct`); None when the
    source cannot be read or shows none."""
    site = _site_names(ctx, call, rec.role)
    if site is None:
        return None
    path, lines, line, names = site
    picked: list[_InfProduct] = []
    for name in names:
        if not name or not name.isidentifier():
            continue
        found = _assignment_above(lines, line, name)
        if found is None:
            continue
        i, value = found
        literal = next(
            (
                ast.unparse(side)
                for node in ast.walk(value)
                if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)
                for side in (node.left, node.right)
                if _INF_WRITTEN.fullmatch(ast.unparse(side))
            ),
            None,
        )
        if literal is None:
            continue
        stmt = lines[i].strip()
        dtype = f"torch.{rec.dtype}" if rec.dtype else f"{name}.dtype"
        fixed = replace_neg_inf(stmt, f"torch.finfo({dtype}).min") or replace_pos_inf(
            stmt, f"torch.finfo({dtype}).max"
        )
        picked.append(_InfProduct(name, stmt, f"{path}:{i + 1}", literal, fixed))
    return picked[0] if len(picked) == 1 else None


def computed_input(trace: StepTrace, call: Call | None, rec: Record) -> tuple[str, str] | None:
    """(``train.py:22``, the statement) of the user's line just above the root call that
    computed the bad root input ``rec`` in a way NW401 names (a sqrt or a log, a product
    with an infinite literal): the localization's headline names that line, as the
    diagnosis does. None when the source cannot be read or shows none."""
    from nanwatch.config import Thresholds

    ctx = RuleContext(trace=trace, history=[], thresholds=Thresholds())
    rooted = _rooted_input(ctx, call, rec.role)
    if rooted is not None:
        return rooted.at, rooted.stmt
    times_inf = _inf_product(ctx, call, rec) if _may_hold_nan(rec.stat) else None
    return (times_inf.at, times_inf.stmt) if times_inf is not None else None


def _inf_product_diagnosis(ctx: RuleContext, evidence: list[str], p: _InfProduct) -> Diagnosis:
    """NW401 for a root input the user's code made by multiplying by an infinite number:
    0 x inf is NaN, so the product is NaN wherever the other factor is 0 (a 0/1 mask
    turned additive with ``* float("-inf")``). The data is not blamed; the fix writes the
    dtype's finite extreme for the literal, on the user's own line."""
    a = ctx.anomaly
    assert a is not None
    lines = [
        *evidence,
        f"{p.name} is not the batch as loaded: your code computed it at {p.at}: {p.stmt} -- a "
        f"product with {p.literal}, and 0 x inf is NaN: NaN wherever the other factor is 0",
    ]
    fix = (
        f"{p.fixed}   # finite: 0 x it is 0, not NaN; a masked entry still gets exp(it) = 0"
        if p.fixed
        else f"# write the dtype's finite extreme, torch.finfo({p.name}.dtype).min, for "
        f"{p.literal} at {p.at}"
    )
    return ctx.diagnosis(
        **anomaly_fields(a),
        title=f"NaN in an input your code multiplied by {p.literal}",
        evidence=lines,
        explanation=(
            f"The NaN was in {p.name} when {a.path} was called, and every layer after it only "
            f"passed it on. {p.name} is computed by your code in this step as a product with "
            f"{p.literal}: x x inf is inf, but 0 x inf is NaN, so a 0/1 mask turned into an "
            "additive one this way is NaN at every position it keeps (its factor is 0) and "
            "inf only where it masks. The dtype's most negative finite value masks the same "
            "positions and keeps 0 x it at 0. Replacing the NaN afterwards (nan_to_num) would "
            "also turn the masking infinities into 0 and unmask them."
        ),
        fix=fix,
    )


def _rooted_input_diagnosis(ctx: RuleContext, evidence: list[str], r: _RootedInput) -> Diagnosis:
    """NW401 for a root input the user's code computed in the step with a sqrt or a log:
    which line, and the table the root's operand was read from; the data is not blamed."""
    a = ctx.anomaly
    assert a is not None
    ops = " and ".join(r.ops)
    calls = ", ".join(r.calls)
    lines = [
        *evidence,
        f"{r.name} is not the batch as loaded: your code computed it at {r.at}: {r.stmt} "
        f"-- with {calls}; {ops} of a negative value is NaN"
        + (", of 0 is -inf" if any(o.startswith("log") for o in r.ops) else ""),
    ]
    if r.table is not None:
        stmt, num, table = r.table
        path = r.at.rpartition(":")[0]
        lines.append(
            f"{stmt} (at {path}:{num}) reads {table} by index: a bad entry spreads to every "
            "sample that picks it"
        )
    where = r.table[2] if r.table is not None else None
    check = where or next(iter(r.calls)).rsplit(".", 1)[0]
    fix = [
        f"assert ({check} >= 0).all(), {check}.min()   # "
        + (
            f"right where {where} is built: the {ops} of a negative entry is NaN"
            if where
            else f"before {r.stmt.split('=', 1)[0].strip()} = ...: the {ops} of a negative "
            "value is NaN"
        ),
        f"# then fix the formula that builds {where}, not this line"
        if where
        else "# then fix the code that makes it negative",
        f"# {untraced_hint(ctx)}",
    ]
    return ctx.diagnosis(
        **anomaly_fields(a),
        title=f"NaN in an input your code computed with {ops}",
        evidence=lines,
        explanation=(
            f"The NaN was in {r.name} when {a.path} was called, and every layer after it only "
            f"passed it on. {r.name} is computed by your code in this step, with {ops}, which "
            "is NaN for a negative value"
            + (
                f"; what the {ops} is taken of is read from {where}"
                + (
                    f", and {r.name} has no autograd history: {where} is a constant your "
                    "code built (a schedule, a table), nothing is learned there, and a clamp "
                    "would only hide the wrong entries"
                    if a.record.grad_fn is None
                    else ""
                )
                if where
                else ""
            )
            + ". This mode does not trace ops outside the modules, so the values are not "
            "measured: the check below, or forensic mode, shows them."
        ),
        fix="\n".join(fix),
    )


def _computed_target(ctx: RuleContext, rec: Record, call: Call | None) -> list[str] | None:
    """Why the non-finite target ``rec`` of loss ``call`` was computed in this step by
    the user's code (a teacher or target network), not loaded (see
    :func:`nanwatch.localize.computed_target`, which the headline reads too): the reasons,
    in words; None when nothing says so."""
    found = computed_target(ctx.trace, rec, call)
    if found is None:
        return None
    first = found.model_input
    reasons: list[str] = []
    if found.half:
        reasons.append(
            f"the target is {rec.dtype} while the model's input ({first.role} of "
            f"{first.path}) is {first.dtype}: a {rec.dtype} network computed it, not the "
            "data loader"
        )
    if found.soft and rec.stat is not None:
        reasons.append(
            "every value of each bad sample is NaN and every finite value lies in "
            f"[-1, 1] (largest |value| {fmt(rec.stat.finite_amax)}): whole distributions gone "
            "NaN, as a softmax makes of a row of logits holding inf; a missing value in "
            "loaded data spoils one value, not a whole row"
        )
    reasons.append(
        f"the model's input this step ({first.role} of {first.path}) was finite: the target "
        "was computed from the batch, by code outside the watched modules"
    )
    return reasons


def _computed_target_diagnosis(
    ctx: RuleContext, evidence: list[str], reasons: list[str]
) -> Diagnosis:
    """NW401 for a loss target the user's code computed this step (a teacher's softmax, a
    target network's values) that went non-finite: the network that made it is at fault,
    not the data; nan_to_num would train on made-up targets."""
    a = ctx.anomaly
    assert a is not None
    s = a.record.stat
    kinds = s.kinds().replace(", ", " or ") if s is not None and not s.finite else "NaN or inf"
    half = a.record.dtype in HALF_DTYPES
    return ctx.diagnosis(
        **anomaly_fields(a),
        title=f"{kinds} in a loss target your code computed (a teacher or target network)",
        evidence=[*evidence[:2], *reasons, *evidence[2:]],
        explanation=(
            f"The target of {a.path} was not loaded with the batch: code outside the "
            "watched modules computed it in this step from the batch, typically a teacher "
            "or target network run under torch.no_grad and a softmax of its logits. That "
            "network made the non-finite value (a float16 activation past 65504 is inf, "
            "and a softmax of a row holding inf is NaN in the whole row); nanwatch does not "
            "watch it, so it cannot name the layer. Replacing the NaN (nan_to_num) would "
            "train on made-up targets: fix the network that computes them."
        ),
        fix=(
            "# watch the network that computes the target too: nanwatch then names its layer\n"
            "# nanwatch.watch(model, criterion, teacher)   # teacher: that network\n"
            + (
                "teacher = teacher.float()   # float16 overflows past 65504; or run it under "
                "torch.autocast(device_type, dtype=torch.bfloat16)"
                if half
                else "# if it runs in float16 (teacher.half()): teacher = teacher.float(), "
                "or run it under torch.autocast(device_type, dtype=torch.bfloat16)"
            )
        ),
    )


def _made_between_calls(
    ctx: RuleContext, rec: Record, call: Call | None
) -> tuple[Record, bool, bool] | None:
    """The bad input is not the step's batch: the same root was called earlier in this step
    with a finite input in the same place, of the same shape and dtype (the clean batch an
    attack or a perturbation starts from), and the bad samples are NaN throughout. Returns
    that earlier input, whether it was in this step (else in the step before), and whether
    a gradient was computed between the calls.

    Before any optimizer update in the run, the automatic step rule cannot tell an attack's
    ``backward()`` from a training step's and ends the step there: the bad input is then
    the next step's first, and the step before, with a backward and no update, is looked
    at too. A step that began at the user's ``nw.step()`` (a ``"step_marked"`` note) began
    where the user said: the step before is another batch's."""
    trace = ctx.trace
    if call is None or not call.root or rec.source is not None or not whole_samples_bad(rec):
        return None
    found = _earlier_input(trace, rec, call.path, call.id, rec.index)
    if found is not None:
        return found[0], True, found[1]
    if not ctx.history or any(n.kind == "optimizer" for t in ctx.history for n in t.notes):
        return None
    if ctx.notes("step_marked"):
        return None
    prev = ctx.history[-1]
    if prev.step != trace.step - 1 or any(c.root and c.id < call.id for c in trace.calls):
        return None
    if not any(r.phase is Phase.BACKWARD for r in prev.records):
        return None
    found = _earlier_input(prev, rec, call.path, len(prev.calls), None)
    return (found[0], False, True) if found is not None else None


def _earlier_input(
    trace: StepTrace, rec: Record, path: str, before: int, until: int | None
) -> tuple[Record, bool] | None:
    """The first finite input of a call of root ``path`` in ``trace`` (before call id
    ``before``) in ``rec``'s place with its shape and dtype, and whether a gradient was
    computed after the last call of that root (before index ``until``): an attack's step
    takes one, a sampling loop under ``torch.no_grad`` does not."""
    calls = [c for c in trace.calls if c.id < before and c.root and c.path == path]
    if not calls:
        return None
    last = calls[-1].start
    grad = any(
        x.phase is Phase.BACKWARD and x.index >= last and (until is None or x.index < until)
        for x in trace.records
    )
    found = earlier_finite_input(trace, rec, path, before)
    return (found, grad) if found is not None else None


def _computed_input(
    ctx: RuleContext, evidence: list[str], made: tuple[Record, bool, bool]
) -> Diagnosis:
    """NW401 for an input the user's code computed between two calls of the root. With a
    gradient taken between the calls it is an attack's or a perturbation's per-sample
    normalization; without one (a sampling or refinement loop under ``torch.no_grad``) the
    op is not known in this mode, and forensic mode names it."""
    a = ctx.anomaly
    assert a is not None
    clean, same, grad = made
    rec = a.record
    s = rec.stat
    n = s.bad_row_count if s is not None and s.bad_row_count else 1
    # the counts, else min and max (a batch read late and freed before it was counted)
    has_inf = s is not None and (s.has_posinf or s.has_neginf)
    has_nan = s is None or s.has_nan
    kinds = "NaN or inf" if has_inf and has_nan else "inf" if has_inf else "NaN"
    samples = f"sample{'s' if n != 1 else ''}"
    called = (
        f"{a.path} was called "
        + ("earlier in this step" if same else f"in step {clean.step}, before any update,")
        + f" with a finite {clean.role} of the same shape {list(clean.shape)}: this "
        f"{rec.role} was computed after that call, by your code"
    )
    title = f"{kinds} in an input your code computed between two calls of {a.path}"
    if not grad:
        found = s.kinds() if s is not None else kinds
        return ctx.diagnosis(
            **anomaly_fields(a),
            title=title,
            evidence=[
                *evidence[:2],
                called + " (no gradient was taken between the two calls: a sampling loop?)",
                f"every value of the bad {samples} is {found.replace(', ', ' or ')}: a factor "
                "applied to the whole sample is infinite, or its divisor is 0",
                *evidence[2:],
            ],
            explanation=(
                f"{a.path}'s input was finite when it was first called; the input of this "
                "later call was computed by your code after it, with no gradient taken in "
                "between: a sampling or denoising loop, an iterative refinement under "
                "torch.no_grad. A whole sample turned non-finite at once "
                "is a scalar coefficient of the update that is infinite, as 1 / x.sqrt() "
                "or 1 / (1 - x).sqrt() is where x is exactly 0 or 1 (a schedule's last "
                "value). The data are not at fault, and torch.nan_to_num would only hide "
                "the division. This mode does not see code outside the modules; forensic "
                "mode names the op and its line."
            ),
            fix=(
                "with nanwatch.watch(model, mode='forensic') as nw:   # or: nanwatch run "
                "--mode forensic script.py\n"
                "    ...   # the loop that computes the next input: names the op and line\n"
                "# then keep its divisor away from 0, e.g. a noise schedule's betas: "
                "betas.clamp(max=0.999)"
            ),
        )
    evidence = [
        *evidence[:2],
        called + " (a gradient was computed between the two calls)",
        f"every value of the bad {samples} is "
        + (
            "NaN: a 0/0 over the whole sample, as a division by its norm gives when that norm is 0"
            if not has_inf
            else "NaN or inf: the whole sample divided by 0, as a division by its norm gives "
            "when that norm is 0 (or underflows to 0)"
        ),
        *evidence[2:],
    ]
    return ctx.diagnosis(
        **anomaly_fields(a),
        title=title,
        evidence=evidence,
        explanation=(
            f"The batch was finite when {a.path} was first called on it; the input of this "
            "later call was computed from it by your code (an adversarial attack, "
            "a perturbation, an augmentation), and that computation made the "
            f"{kinds}. A whole sample of {kinds} is what a per-sample normalization makes of "
            "a sample whose norm is 0: g / g.norm() where the input gradient of that sample "
            "is exactly 0 (a blank image, a saturated or dead input), as in PGD's L2 step or "
            "VAT's _l2_normalize. The data are not at fault, and torch.nan_to_num would only "
            "hide the division."
        ),
        fix=(
            "def l2_normalize(g, eps=1e-12):   # per sample; a zero gradient stays 0, not NaN\n"
            "    return g / g.flatten(1).norm(dim=1).clamp_min(eps).view(-1, *[1] * (g.ndim - 1))\n"
            "# use it where your code divides by a per-sample norm: g = l2_normalize(grad)\n"
            "# (or add the eps: d / (d.flatten(1).norm(dim=1).view(-1, 1, 1, 1) + 1e-8))"
        ),
    )


def _find_samples_fix(
    shape: tuple[int, ...],
    *,
    rows_known: bool,
    role: str = "input[0]",
    owner: str = "",
    target: bool = False,
    sparse: bool = False,
    params: Sequence[str] = (),
    site: Mapping[str, object] | None = None,
) -> str:
    """Code that lists the bad samples of the bad input and clears them, for its number of
    dimensions: ``flatten(1)`` needs two, a 1-D input's samples are its elements, a 0-d one
    is a value; a sparse one (fewer values measured than its shape holds) is read through
    its stored values. ``role`` (``input[1]``, ``input.adj``) names the tensor in the
    code: a keyword's name, ``x`` (``y`` for a loss's target) or ``argK`` for the K-th
    positional argument of ``owner``'s call, or the name ``owner``'s forward gives it
    (``params``, its positional parameters). ``site``: the user's call of the root (see
    :func:`_call_site`): the expression passed there names the tensor; a call made inside a
    library (``update_bn(loader, model)``) names that library call instead."""
    x, note = _input_name(role, owner=owner, target=target, params=params)
    passed = _site_arg(site, role) if site is not None and not target else None
    if passed is not None:
        x, note = passed, ""
    elif site is not None and not target and site.get("library") and site.get("user_code"):
        lib, code = str(site["library"]), str(site["user_code"]).strip()
        at = f" at {site['user_source']}" if site.get("user_source") else ""
        note = (
            f"# the bad batch came through {code}{at}: {lib} calls {owner or 'the model'} on "
            f"each batch of the data you pass it;\n# check those batches before that call "
            f"({x}: each batch it is given), not a name inside {lib}"
        )
    last = (
        f"{x} = torch.nan_to_num({x}, nan=0.0, posinf=0.0, neginf=0.0)  # or fix/drop them in "
        "Dataset.__getitem__"
    )
    if target:
        # a target set to 0 is a label the model is trained toward: never nan_to_num it.
        # It was loaded so (a missing label) or computed so by the loop (rewards divided
        # by a std of 0, a target network's values): fix it where it is made, or drop it
        last = (
            f"assert torch.isfinite({x}).all()   # where {x} is made: a missing label in the "
            f"data, or your code computing {x} (a division by a std of 0, a target network's "
            "values); drop those samples, do not nan_to_num a target"
        )
    head = f"{note}\n" if note else ""
    if sparse:
        find = (
            f"v = {x}.coalesce()  # sparse: check its stored values\n"
            "bad = ~torch.isfinite(v.values())\n"
            "print(v.indices()[:, bad].t().tolist()[:10])  # where: trace them to the data"
        )
        last = (
            f"{x} = torch.nan_to_num({x}, nan=0.0, posinf=0.0, neginf=0.0)  # or fix where "
            f"{x} is built"
        )
        return f"{head}{find}\n{last}"
    if len(shape) == 0:
        return f"{head}print(torch.isfinite({x}).item())   # a single value: False here\n{last}"
    if len(shape) == 1:
        find = (
            f"bad = ~torch.isfinite({x})                 # 1-D: each element is a sample\n"
            "print(bad.nonzero().flatten().tolist())  # trace them to the dataset"
        )
    else:
        find = (
            f"bad = ~torch.isfinite({x}).flatten(1).all(dim=1)   # samples with NaN/inf\n"
            "print(bad.nonzero().flatten().tolist())         # trace them to the dataset"
        )
    return f"{head}{find}\n{last}" + (
        "" if rows_known else "\n# (sample indices need the batch on dim 0)"
    )


_ROLE = re.compile(r"input(?:\[(\d+)\]|\.([A-Za-z_]\w*))?(.*)")


def _forward_params(ctx: RuleContext, call: Call | None) -> tuple[str, ...]:
    """The positional parameter names of the forward of ``call``'s module, when the watcher
    gave them (the fact ``forward_params``: ``{call path: names}``)."""
    known = ctx.facts.get("forward_params")
    if call is None or not isinstance(known, Mapping):
        return ()
    names = known.get(call.path)
    if not isinstance(names, (list, tuple)):
        return ()
    return tuple(str(n) for n in names)


def _norms_reached(ctx: RuleContext, rec: Record) -> list[Call]:
    """The BatchNorm calls of the step that ran after the bad input ``rec`` was recorded,
    in the same root call (the watcher let the forward go on: ``on_anomaly`` "record",
    "warn", a Lightning skip): in train mode each folded the batch's NaN into its running
    statistics."""
    call = ctx.trace.call(rec.call)
    root = call
    while root is not None and not root.root and root.parent is not None:
        root = ctx.trace.call(root.parent)
    if root is None:
        return []
    out: list[Call] = []
    modes = ctx.facts.get("module_training")  # an eval-mode norm reads its statistics only
    for c in ctx.trace.calls:
        if "BatchNorm" not in c.module_type or c.start < rec.index or c.id == root.id:
            continue
        if modes is not None and modes.get(c.path, True) is False:
            continue
        up: Call | None = c
        while up is not None and up.id != root.id and up.parent is not None:
            up = ctx.trace.call(up.parent)
        if up is not None and up.id == root.id and c.path not in {n.path for n in out}:
            out.append(c)
    return out


def _restore_norms(norms: list[Call]) -> str:
    """The fix's lines for BatchNorms the bad batch reached: in train mode (``model.train()``,
    a statistics re-estimation under no_grad, ``update_bn``) their running mean and variance
    took its NaN, and every later eval forward is NaN: reset them, then re-estimate them on
    clean batches."""
    refs = [module_ref(c.path) for c in norms]
    named = ", ".join(f"{c.module_type} '{c.path}'" for c in norms[:3])
    more = f" and {len(refs) - 3} more" if len(refs) > 3 else ""
    lines = [
        f"# the bad batch reached {named}{more}: in train mode (model.train(), a",
        "# re-estimation of the statistics, update_bn) it made their running_mean/var NaN,",
        "# and every later eval forward is NaN: reset them, then re-estimate on clean batches",
        *(f"{r}.reset_running_stats()" for r in refs[:3]),
    ]
    if len(refs) > 3:
        lines += [
            "for m in model.modules():",
            '    if hasattr(m, "reset_running_stats"): m.reset_running_stats()',
        ]
    lines.append(
        "# then: torch.optim.swa_utils.update_bn(loader, model)   (loader: your clean batches)"
    )
    return "\n".join(lines)


def _call_site(ctx: RuleContext, call: Call | None) -> Mapping[str, object] | None:
    """The user's call of the root that holds ``call``: the ``call_site`` note of its path
    (``code``: the line, ``callee``: the name the line calls the root by; ``library``,
    ``user_code``, ``user_source``: a call made inside a library function, and the user's
    line that called that function). None when no note says."""
    root = call
    while root is not None and not root.root and root.parent is not None:
        root = ctx.trace.call(root.parent)
    if root is None:
        return None
    note = next((n for n in ctx.trace.notes if n.kind == "call_site" and n.path == root.path), None)
    return note.data if note is not None else None


def _site_arg(site: Mapping[str, object], role: str) -> str | None:
    """The expression the user's line passes as input ``role`` (``input[0]``, ``input.adj``)
    in its call of ``site["callee"]``: ``calib_x`` of ``net(calib_x)``, when it is a name
    the fix can assign to (a name, an attribute, a subscript); None otherwise."""
    code, callee = site.get("code"), site.get("callee")
    m = _ROLE.fullmatch(role)
    if not isinstance(code, str) or not isinstance(callee, str) or m is None or site.get("library"):
        return None
    index, keyword, rest = m.groups()
    for stmt in statements(code):
        try:
            tree = ast.parse(stmt)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or ast.unparse(node.func) != callee:
                continue
            arg: ast.expr | None = None
            if keyword:
                arg = next((k.value for k in node.keywords if k.arg == keyword), None)
            else:
                k = int(index) if index is not None else 0
                if k < len(node.args) and not any(
                    isinstance(a, ast.Starred) for a in node.args[: k + 1]
                ):
                    arg = node.args[k]
            if isinstance(arg, (ast.Name, ast.Attribute, ast.Subscript)):
                return ast.unparse(arg) + (rest or "")
            return None
    return None


def _input_name(
    role: str, *, owner: str, target: bool, params: Sequence[str] = ()
) -> tuple[str, str]:
    """The name the fix calls the input ``role`` by, and a comment line saying which
    argument that is when the name is a stand-in: ``input.adj`` -> ``adj`` (the keyword),
    ``input[0]`` -> ``x``, a loss's ``input[1]`` -> ``y``, ``input[2]`` -> ``arg2``. A
    model's positional input is called by its forward's parameter name when ``params``
    holds it (``forward(self, c, x)``: ``input[1]`` -> ``x``)."""
    m = _ROLE.fullmatch(role)
    if m is None:
        return "x", ""
    index, keyword, rest = m.groups()
    k = int(index) if index is not None else 0
    named = params[k] if not target and not keyword and k < len(params) else ""
    if hasattr(builtins, named):
        # a torch module's ``forward(self, input)``: not a name the user's code gives the
        # batch, and assigning it would shadow the builtin
        named = ""
    if keyword:
        base, note = keyword, ""
    elif named.isidentifier() and not keyword_module.iskeyword(named):
        base, note = named, ""
        if k:
            nth = {1: "2nd", 2: "3rd"}.get(k, f"{k + 1}th")
            of = f" to {owner}" if owner else ""
            note = f"# {named}: the {nth} argument you pass{of} (its forward's `{named}`)"
    elif index is None or index == "0":
        base, note = "x", ""
    elif index == "1" and target:
        base, note = "y", ""
    else:
        nth = {1: "2nd", 2: "3rd"}.get(k, f"{k + 1}th")
        of = f" to {owner}" if owner else ""
        base, note = f"arg{k}", f"# arg{k}: the {nth} argument you pass{of} (input[{k}])"
    return base + (rest or ""), note


def _sparse(rec: Record) -> bool:
    """Fewer values were measured than the shape holds: a sparse tensor's stored values."""
    s = rec.stat
    return s is not None and len(rec.shape) >= 1 and 0 <= s.numel < math.prod(rec.shape)


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


_ELEMENTWISE_LOSSES = {"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss"}


def _passed_on_target(op: OpEvent) -> TensorStat | None:
    """The op the anomaly names is the loss itself, which did not make the non-finite
    value but read it in its target (the graph walk's op for ``F.mse_loss(pred, y)`` with a
    -inf in ``y``): the target's statistics, else None."""
    if op.cause is not None or op.injected:
        return None
    target = [st for name, st in op.inputs if name == "target"]
    others = [st for name, st in op.inputs if name != "target"]
    if len(target) != 1 or target[0] is None or target[0].finite:
        return None
    if any(st is None or not st.finite for st in others):
        return None
    return target[0]


def _prediction_grad(ctx: RuleContext, n: Note) -> TensorStat | None:
    """The gradient of an elementwise loss's prediction, when it has the target's shape:
    the prediction is finite, so it is non-finite exactly where the target is (counted)."""
    fname = str(n.data.get("loss", "")).rsplit(".", 1)[-1]
    src, shape = n.data.get("input_source"), n.data.get("target_shape")
    if fname not in _ELEMENTWISE_LOSSES or not isinstance(src, int) or not shape:
        return None
    if n.data.get("input_shape") != shape:
        return None
    if sum(m.data.get("input_source") == src for m in ctx.notes("loss_input")) != 1:
        return None  # another loss read the prediction too: its gradient sums both
    told = n.data.get("target_nonfinite")
    for r in ctx.trace.records:
        if (
            r.phase is Phase.BACKWARD
            and src in (r.index, r.source)
            and list(r.shape) == list(shape)
            and r.stat is not None
        ):
            if r.stat.nan is not None:
                return r.stat
            if not r.stat.finite and isinstance(told, (int, float)):
                # read after backward freed it (the accelerator path): the same count, as
                # the loss's guard counted it in the target
                s = r.stat
                return TensorStat(s.min, s.max, s.numel, nonfinite=int(told))
    return None


def _bad_functional_target(ctx: RuleContext, path: str | None = None) -> Iterator[Diagnosis]:
    """A loss computed outside any module (``F.mse_loss(model(x), y)``) went non-finite,
    and its guard read a finite input but a non-finite target: the target was bad before
    the loss saw it (no module records a functional loss's target). ``path``: the loss
    module whose note to read (its target's -inf, see :func:`module_loss_target`)."""
    a = ctx.anomaly
    assert a is not None
    bad: list[Note] = [
        n
        for n in ctx.notes("loss_input")
        if (path is None or n.path == path)
        and "target_min" in n.data
        and not (_finite(n.data.get("target_min")) and _finite(n.data.get("target_max")))
        and _finite(n.data.get("input_min"))
        and _finite(n.data.get("input_max"))
    ]
    if not bad:
        return
    counted = _passed_on_target(a.op) if a.op is not None else None
    logged = log_into_target(ctx.trace, a) if a.op is not None and counted is None else None
    if a.op is not None and counted is None and logged is None:
        # an op made the value in this step (forensic mode's or the graph walk's op, or a
        # constant operand the loss code computed without gradients): the op-level rules
        # name it (NW101 for an exp overflow); bad data would send the user to the dataset
        return
    if logged is not None and a.op is not None:  # forensic: a log made the target's -inf
        counted = next(st for name, st in a.op.inputs if name == "target")
    n = bad[0]
    if path is None and target_log(n) is not None:
        return  # the loss line took the log of a target holding 0: NW110 says so
    loss = str(n.data.get("loss", n.path))
    at = f" at {n.source}" if n.source else ""
    lo, hi = n.data.get("target_min"), n.data.get("target_max")
    nan = not (_finite(lo) or _finite(hi)) and not (lo == -math.inf and hi == math.inf)
    neg = lo == -math.inf and not nan
    kinds = "NaN" if nan else "-inf" if neg and _finite(hi) else "+inf" if _finite(lo) else "inf"
    if counted is None:
        counted = _prediction_grad(ctx, n)
    evidence = [
        f"the target of {loss}{at} (shape {n.data.get('target_shape', '?')}) holds "
        f"{kinds}: min {fmt(lo) if isinstance(lo, (int, float)) else '?'}, max "
        f"{fmt(hi) if isinstance(hi, (int, float)) else '?'}",
    ]
    evidence.append(
        f"its input (the prediction) was finite: [{fmt(n.data['input_min'])}, "
        f"{fmt(n.data['input_max'])}]"
    )
    if counted is not None and a.op is not None:
        evidence.append(f"target: {describe_stat(counted)}")
    elif counted is not None:
        bad_n = counted.bad_values or 0
        evidence.append(
            f"{bad_n:,} of its {counted.numel:,} values {'is' if bad_n == 1 else 'are'} "
            f"{counted.kinds().replace(', ', ' or ')}, counted in the gradient of the "
            "prediction (an elementwise loss's gradient is non-finite exactly where its "
            "target is)"
        )
    told = n.data.get("target_nonfinite")
    shape = n.data.get("target_shape")
    numel = math.prod(shape) if isinstance(shape, list) else None
    if counted is None and isinstance(told, (int, float)) and numel and 0 < told < numel:
        # counted by the loss's guard, while the target was at hand
        evidence.append(
            f"{int(told):,} of its {numel:,} values {'is' if told == 1 else 'are'} non-finite, "
            "the others finite"
        )
    if logged is not None:
        line = code_line(logged)
        evidence.append(
            f"{short_op(logged.op)} made the -inf from a 0{f', {line}' if line else ''}; "
            "the loss then read it in its target"
        )
    if len(bad) > 1:
        evidence.append(f"{len(bad) - 1} more loss call(s) this step got a non-finite target")
    fields = anomaly_fields(a)
    fields["path"] = loss
    ratios = _log_ratio_target(n, loss) if kinds == "-inf" else []
    if not ratios and logged is not None and logged.code:  # the log's own line, traced
        try:
            ratios = _log_ratios(ast.parse(logged.code.strip()))
        except SyntaxError:
            ratios = []
    made_here = False
    where = _loss_target(n, loss)
    y = (_target_name(where[2]) if where is not None else None) or "y"
    if ratios:
        tops = list(dict.fromkeys(top for top, _ in ratios))
        shown = ", ".join(f"log({top} / {bottom})" for top, bottom in ratios)
        evidence.append(
            f"the target is made as {shown}: a log of a ratio (such as a box-regression encoding), "
            f"-inf where {' or '.join(tops)} is 0"
        )
        cause = (
            f"A target whose only non-finite values are -inf is what log(0) gives, and this "
            f"one is a log of a ratio, {shown}: a degenerate entry (a box of zero width or "
            "height, an annotation with x1 == x2) makes the numerator 0. Drop or repair "
            "those entries; log1p would change the encoding, which then no longer matches "
            "the exp() that decodes the prediction."
        )
        keep = " & ".join(f"({t} > 0)" for t in tops)
        remedy = (
            f"valid = {keep}   # where the target is made: keep degenerate entries out of "
            "the loss (index the prediction and the target with it)\n"
            f"# or repair them where the boxes are read: {tops[0]}.clamp_min(1) (a one-pixel "
            "minimum, in pixel units); not log1p, which no exp() decoder inverts\n"
        )
    elif kinds == "-inf" and (made := _log_made_target(n, loss)) is not None:
        evidence.append(
            f"the target is made in your code at {made['where']}: {made['log']}, which is "
            f"-inf where {made['arg']} is 0"
        )
        cause = (
            "A target whose only non-finite values are -inf is what log(0) gives, and this "
            f"one is a log your code takes, {made['log']} at {made['where']}: the log made "
            f"the -inf wherever {made['arg']} is 0, not the dataset. Keep 0 out of the log: "
            + (
                "log1p (log(1 + x)) for a count or a duration that can be 0, or a floor "
                "(clamp_min) for a magnitude such as a spectrogram's power."
                if made["counts"]
                else "a floor (clamp_min) for a magnitude that can be 0 (the silence in a "
                "spectrogram), or log1p (log(1 + x)) for a count or a duration."
            )
        )
        remedy = f"{made['fixed']}   # at {made['where']}: log(0) = -inf; or {made['other']}\n"
        if made["name"]:
            remedy += (
                f"assert torch.isfinite({made['name']}).all(), "
                f'"{made["name"]} holds -inf"   # before the loss\n'
            )
        made_here = True
    elif kinds == "-inf":
        cause = (
            "A target whose only non-finite values are -inf is what log(0) gives: a log "
            "transform of a target holding zeros (a count, a duration or a power of 0)."
        )
        remedy = (
            f"{y} = torch.log1p({y})   # a count or a duration; or torch.log({y}.clamp_min(1e-5)) "
            "for a magnitude: log(0) = -inf\n"
        )
    else:
        cause = (
            "Targets made in the training loop or read from the data are the usual "
            "source: a missing reading or label parsed as NaN, a standardization by a "
            "batch's standard deviation that is 0 (every target equal), a corrupted file; "
            "a target computed from other tensors (a bootstrapped r + gamma * next_value) "
            "carries a NaN of any of them and makes one of 0 × inf (mode='forensic' names "
            "that op)."
        )
        computed = _target_operands(n, where, y, kinds)
        if computed is not None:
            evidence.append(computed)
        some = (
            counted is not None
            and (counted.nan if counted.nan is not None else counted.nonfinite or 0) < counted.numel
        ) or (
            counted is None
            and isinstance(told, (int, float))
            and numel is not None
            and told < numel
        )
        remedy = (
            f"print((~torch.isfinite({y})).nonzero()[:10].tolist())   # where: trace them "
            "to the data\n"
            if some
            else f"{y} = ({y} - {y}.mean()) / {y}.std().clamp_min(1e-6)   # a batch of equal "
            "targets has std 0\n"
        )
    yield ctx.diagnosis(
        **fields,
        title="NaN or inf in the loss targets",
        evidence=evidence,
        explanation=(
            f"The prediction reaching {loss} was finite and its target was not: the loss is "
            f"{'NaN' if nan else 'non-finite'} because of the target, and no layer is at "
            f"fault. {cause}"
        ),
        fix=(
            remedy.rstrip("\n")
            if made_here
            else f"assert torch.isfinite({y}).all(), {y}   # where the target is made, before "
            "the loss\n" + remedy + "# or fix/drop the samples in Dataset.__getitem__"
        ),
    )


#: ``OpEvent.scalars`` key of the op checker's event for a non-finite tensor with no
#: autograd history that the loss code read and no checked op made (``nanwatch.ops.ENTERED``)
_ENTERED = "entered"

#: the Python operator of an aten arithmetic op, to find its operands on the user's line
_BINOPS: dict[str, type[ast.operator]] = {
    "add": ast.Add,
    "sub": ast.Sub,
    "mul": ast.Mult,
    "div": ast.Div,
    "true_divide": ast.Div,
    "pow": ast.Pow,
    "floor_divide": ast.FloorDiv,
    "remainder": ast.Mod,
    "matmul": ast.MatMult,
}


def _entered_event(ctx: RuleContext) -> OpEvent | None:
    """Forensic mode's event for a non-finite tensor that entered the step in the loss
    code (no op made it, it has no autograd history), when it explains the anomaly: no
    forward op of the step made a NaN or +inf, and the tensor holds the anomaly's kind
    (or an infinity, which arithmetic turns into NaN)."""
    a = ctx.anomaly
    if a is None or a.op is not None:
        return None
    if any(ev.phase is Phase.FORWARD and is_birth(ev) for ev in ctx.trace.ops):
        return None  # an op made it: the op-level rules name it
    s = a.record.stat
    want = set(s.kinds().split(", ")) if s is not None and not s.finite else {"NaN"}
    for ev in ctx.trace.ops:
        if ev.phase is not Phase.FORWARD or _ENTERED not in ev.scalars:
            continue
        have = set(ev.born.split(", "))
        if have & want or "+inf" in have:
            return ev
    return None


def _operands(ev: OpEvent) -> tuple[str, str | None] | None:
    """The source text of the operand ``ev`` read the bad tensor as, and of its other
    operand, from the op's line: ``(ys[i], pred)`` for ``other`` of ``aten.sub`` on
    ``((pred - ys[i]) ** 2).mean()``; the name the code bound it to when known; None when
    the line is not known or holds no single such operand."""
    role = str(ev.scalars.get(_ENTERED, ""))
    named = str(ev.scalars.get("entered_name") or "")
    if not ev.code:
        return (named, None) if named else None
    try:
        tree = ast.parse(ev.code.strip())
    except SyntaxError:
        try:
            tree = ast.parse(ev.code.strip().rstrip(":,\\(") or "pass")
        except SyntaxError:
            return (named, None) if named else None
    op = _BINOPS.get(packet(ev.op).removesuffix("_"))
    found: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        pair: tuple[ast.expr, ast.expr] | None = None
        if op is not None and isinstance(node, ast.BinOp) and isinstance(node.op, op):
            pair = (node.left, node.right)
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).rsplit(".", 1)[-1] == packet(ev.op)
            and len(node.args) == 2
        ):
            pair = (node.args[0], node.args[1])
        if pair is None:
            continue
        if role in ("self", "input"):
            found.add((ast.unparse(pair[0]), ast.unparse(pair[1])))
        elif role == "other":
            found.add((ast.unparse(pair[1]), ast.unparse(pair[0])))
    if len(found) == 1:
        mine_text, other_text = found.pop()
        if not named or named == mine_text:
            return mine_text, other_text
    return (named, None) if named else None


def _entered_data(ctx: RuleContext) -> Iterator[Diagnosis]:
    """NW401 for a NaN or inf that entered the step in data the loss code read (forensic
    mode): a hand-written loss (``((pred - y) ** 2).mean()``) read a target holding NaN
    that no op of the step made and that has no autograd history."""
    a = ctx.anomaly
    ev = _entered_event(ctx)
    if a is None or ev is None:
        return
    role = str(ev.scalars[_ENTERED])
    s = ev.inputs[0][1] if ev.inputs else ev.output
    shape = str(ev.scalars.get("entered_shape", "")).strip("()").rstrip(",")
    dims = [int(d) for d in shape.split(",") if d.strip().isdigit()]
    at = f" at {ev.source}" if ev.source else ""
    kinds = s.kinds() if s is not None and not s.finite else ev.born
    counts = describe_stat(s)
    bad_n = None
    if s is not None:
        bad_n = (s.nan or 0) + (s.posinf or 0) + (s.neginf or 0) or None
    holds = f"{bad_n:,} {kinds.replace(', ', ' or ')}" if bad_n else kinds
    names = _operands(ev)
    evidence = [
        a.summary,
        f"`{role}` of aten.{packet(ev.op)}{at} holds {holds} ({ev.dtype}, shape {dims}): {counts}",
    ]
    line = code_line(ev)
    if line:
        evidence.append(line)
    evidence.append(
        f"every op of the step was checked and none made it; the tensor has no autograd "
        f"history (no gradient flows into it) and {short_op(ev.op)} was the first op to "
        "read it: it came into the step with the data"
    )
    x = names[0] if names else "y"
    note = (
        ""
        if names
        else f"# y: the `{role}` operand of {short_op(ev.op)} on that line (your target)\n"
    )
    if len(dims) >= 2:
        keep = f"keep = torch.isfinite({x}).flatten(1).all(dim=1)   # samples (dim 0) to keep"
    elif len(dims) == 1:
        keep = f"keep = torch.isfinite({x})   # 1-D: each element is a sample"
    else:
        keep = ""
    pred = names[1] if names and names[1] else "pred"
    use = (
        f"\n# then compute the loss on those samples only: {pred}[keep] and {x}[keep]"
        if keep
        else ""
    )
    yield ctx.diagnosis(
        **anomaly_fields(a),
        title=f"{kinds.split(', ')[0]} entered the step in data your loss code read",
        op=short_op(ev.op),
        source=ev.source,
        evidence=evidence,
        explanation=(
            f"The loss is {a.record.stat.kinds() if a.record.stat else 'non-finite'} because "
            f"{short_op(ev.op)}{at} read a tensor that already held {kinds}: no layer and no "
            "op of the step made it, and it has no autograd history, so it was handed in "
            "with the batch (a target with a missing label parsed as NaN, a corrupted "
            "sample). Fix or drop those samples where the data is loaded; masking them in "
            "the loss keeps training on the rest."
        ),
        fix=(
            f"{note}print((~torch.isfinite({x})).nonzero()[:10].tolist())   # where: trace "
            "them to the dataset\n"
            + (f"{keep}{use}\n" if keep else "")
            + "# or fix/drop the samples in Dataset.__getitem__"
        ),
    )


def _log_ratio_target(n: Note, loss: str) -> list[tuple[str, str]]:
    """The logs of ratios a functional loss's target is made of, as (numerator, denominator)
    source texts: the loss line's target, or the value assigned to its name above, or the
    body of the function in the same file that value calls (``targets = encode(gt, a)``
    with ``torch.log(gw / aw)`` in ``encode``). Empty when none is seen."""
    where = _loss_target(n, loss)
    if where is None:
        return []
    lines, line, target = where
    found = _log_ratios(target)
    if found:
        return found
    if isinstance(target, ast.Call) and isinstance(target.func, ast.Name):
        # made on the loss line by a function of the file: ``crit(pred, encode(gt, a))``
        body = _function_body(lines, target.func.id)
        return _log_ratios(body) if body is not None else []
    if not isinstance(target, ast.Name):
        return found
    value = _assigned_above(lines, line, target.id)
    if value is None:
        return []
    found = _log_ratios(value)
    if found or not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)):
        return found
    body = _function_body(lines, value.func.id)
    return _log_ratios(body) if body is not None else []


def _loss_target(n: Note, loss: str) -> tuple[list[str], int, ast.expr] | None:
    """(the file's lines, the loss line's number, the target argument of the loss call on
    it) for a functional loss's note; None when the line or the call is not readable."""
    path, _, num = (n.source or "").rpartition(":")
    if not path or not num.isdigit():
        return None
    lines = linecache.getlines(path)
    line = int(num)
    if not 0 < line <= len(lines):
        return None
    fname = loss.rsplit(".", 1)[-1]
    try:
        tree = ast.parse(lines[line - 1].strip())
    except SyntaxError:
        return None
    calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call)]
    named = [c for c in calls if ast.unparse(c.func).rsplit(".", 1)[-1] == fname]
    if not named and fname[:1].isupper():
        # a loss module (its class's name) is called by the name the user gave it
        # (``crit(pred, y)``): the outermost call of two or more arguments not torch's own
        named = [
            c
            for c in calls
            if (len(c.args) > 1 or any(k.arg == "target" for k in c.keywords))
            and ast.unparse(c.func).split(".", 1)[0] not in ("torch", "F", "np", "math")
        ][:1]
    for call in named:
        kw = {k.arg: k.value for k in call.keywords if k.arg}
        target = kw.get("target", call.args[1] if len(call.args) > 1 else None)
        return (lines, line, target) if target is not None else None
    return None


def _target_name(target: ast.expr) -> str | None:
    """The name of the tensor a loss target reads: ``y`` for ``y``, ``y[mask]``, ``y.float()``."""
    node = target
    while isinstance(node, (ast.Subscript, ast.Attribute, ast.Call)):
        if isinstance(node, ast.Call) and (
            isinstance(node.func, ast.Name)
            or ast.unparse(node.func).rsplit(".", 1)[0] in ("torch", "F", "np", "math")
        ):
            # a function's result (``encode(gt, a)``, ``torch.log(d)``): no name holds it
            return None
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


#: calls that keep 0 out of a log's argument: ``x.clamp(min=...)``, ``torch.maximum(x, eps)``
_FLOORS = frozenset({"clamp", "clamp_min", "clip", "maximum", "max", "fmax"})


def _bare_log(node: ast.AST) -> tuple[ast.Call, ast.expr, bool] | None:
    """The first log call in ``node`` whose argument nothing keeps above 0 (no floor, no
    ``+ 1``): (the call, its argument, whether it is the method form ``x.log()``)."""
    for c in ast.walk(node):
        if not isinstance(c, ast.Call):
            continue
        name = ast.unparse(c.func)
        if name in ("torch.log", "np.log", "math.log", "log") and len(c.args) == 1:
            arg, method = c.args[0], False
        elif isinstance(c.func, ast.Attribute) and c.func.attr == "log" and not c.args:
            if ast.unparse(c.func.value) in ("torch", "np", "math"):
                continue
            arg, method = c.func.value, True
        else:
            continue
        if isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Add):
            continue
        if any(
            isinstance(f, ast.Call)
            and isinstance(f.func, (ast.Attribute, ast.Name))
            and (f.func.attr if isinstance(f.func, ast.Attribute) else f.func.id) in _FLOORS
            for f in ast.walk(arg)
        ):
            continue
        return c, arg, method
    return None


#: casts that say a log's argument held integers (a count, a duration in frames)
_INT_CAST = re.compile(r"\.(?:float|double|half)\(\)$|\.to\((?:torch\.)?(?:float|double)")


def _log_made_target(n: Note, loss: str) -> dict[str, str] | None:
    """Where the user's code took the log that made a -inf target: the loss line's target
    itself, the value assigned to its name above, or the body of the function in the same
    file that value calls (``mel_t = mel_spectrogram(wav)`` with ``torch.log(mel)`` in it).
    ``name`` (the target's name on the loss line, "" if none), ``where`` (``file.py:12``),
    ``log`` and ``arg`` (the call and its argument as written, less a cast from integers),
    ``fixed`` (that line with a log that stays finite at 0: log1p for a cast count, else a
    floor), ``other`` (the other remedy) and ``counts``; None when not seen."""
    found = _loss_target(n, loss)
    if found is None:
        return None
    lines, line, target = found
    path = (n.source or "").rpartition(":")[0]
    name = _target_name(target) or ""
    places: list[int] = [line]
    value = _assigned_above(lines, line, name) if name else None
    if value is not None:
        places += [
            i + 1
            for i in range(line - 2, max(-1, line - 42), -1)
            if re.match(rf"{re.escape(name)}\s*=[^=]", lines[i].strip())
        ][:1]
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
            places += _function_lines(lines, value.func.id)
    for num in places:
        text = lines[num - 1].strip()
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        hit = _bare_log(tree)
        if hit is None:
            continue
        call, arg, method = hit
        seg = ast.get_source_segment(text, call)
        a = ast.unparse(arg)
        if seg is None:
            continue
        floor = (
            f"{a}.clamp_min(1e-5).log()" if method else f"torch.log({_paren(a)}.clamp_min(1e-5))"
        )
        plus = f"{a}.log1p()" if method else f"torch.log1p({a})"
        cast = _INT_CAST.search(a)
        first, other = (plus, floor) if cast else (floor, plus)
        start = text.index(seg)
        return {
            "name": name,
            "where": f"{path}:{num}",
            "log": seg,
            "arg": a[: cast.start()] if cast else a,
            "fixed": text[:start] + first + text[start + len(seg) :],
            "other": other,
            "counts": "1" if cast else "",
        }
    return None


def _paren(expr: str) -> str:
    try:
        node = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return f"({expr})"
    simple = (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant)
    return expr if isinstance(node, simple) else f"({expr})"


def _function_lines(lines: list[str], fname: str) -> list[int]:
    """The line numbers of ``def fname(...)``'s body in the file."""
    for i, text in enumerate(lines):
        m = re.match(rf"(\s*)def {re.escape(fname)}\(", text)
        if m is None:
            continue
        indent, out = len(m.group(1)), []
        end = i + 1
        while end < len(lines) and (
            not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent
        ):
            if lines[end].strip():
                out.append(end + 1)
            end += 1
        return out
    return []


def _log_ratios(node: ast.AST) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for c in ast.walk(node):
        if not isinstance(c, ast.Call):
            continue
        name = ast.unparse(c.func)
        arg: ast.expr | None = None
        if name in ("torch.log", "np.log", "math.log", "log") and c.args:
            arg = c.args[0]
        elif isinstance(c.func, ast.Attribute) and c.func.attr == "log" and not c.args:
            arg = c.func.value
        if isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Div):
            out.append((ast.unparse(arg.left), ast.unparse(arg.right)))
    return out


def _target_operands(
    n: Note, where: tuple[list[str], int, ast.expr] | None, name: str, kinds: str = "NaN"
) -> str | None:
    """``the target is computed at train.py:31: td = r + 0.99 * q2``... when the loss's
    target is a name that a statement above the loss line assigns from other tensors (an
    arithmetic of two or more names): a NaN in it comes from one of them, or is made
    there. None otherwise (a target read from the data as it is)."""
    if where is None or _target_name(where[2]) != name:
        return None
    lines, line, _ = where
    found = _assignment_above(lines, line, name)
    if found is None:
        return None
    i, value = found
    called = {id(c.func) for c in ast.walk(value) if isinstance(c, ast.Call)}
    names = list(
        dict.fromkeys(
            v.id
            for v in ast.walk(value)
            if isinstance(v, ast.Name)
            and id(v) not in called
            and v.id not in ("torch", "F", "np", "math", name)
        )
    )
    if len(names) < 2 or not any(isinstance(v, ast.BinOp) for v in ast.walk(value)):
        return None
    path = (n.source or "").rpartition(":")[0]
    return (
        f"the target is computed at {path}:{i + 1}: {lines[i].strip()}: the {kinds} is in "
        f"one of {', '.join(names)}, or made there (0 × inf)"
    )


def _assigned_above(lines: list[str], line: int, name: str, reach: int = 40) -> ast.expr | None:
    """The value last assigned to ``name`` on a line above ``line`` (one statement a line)."""
    found = _assignment_above(lines, line, name, reach)
    return found[1] if found is not None else None


def _assignment_above(
    lines: list[str], line: int, name: str, reach: int = 40
) -> tuple[int, ast.expr] | None:
    """(the line's index in ``lines``, the value) of the last single-target assignment to
    ``name`` on a line above ``line`` (one statement a line); None when the nearest
    statement that assigns it is another kind, or none does within ``reach`` lines."""
    for i in range(line - 2, max(-1, line - 2 - reach), -1):
        text = lines[i].strip()
        if not re.match(rf"{re.escape(name)}\s*=[^=]", text):
            continue
        try:
            stmt = ast.parse(text).body[0]
        except (SyntaxError, IndexError):
            return None
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            return i, stmt.value
        return None
    return None


def _function_body(lines: list[str], fname: str) -> ast.AST | None:
    """The parsed ``def fname(...)`` of the file, its body up to the next line indented as
    little as the def."""
    for i, text in enumerate(lines):
        m = re.match(rf"(\s*)def {re.escape(fname)}\(", text)
        if m is None:
            continue
        indent = len(m.group(1))
        end = i + 1
        while end < len(lines) and (
            not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent
        ):
            end += 1
        try:
            return ast.parse(textwrap.dedent("".join(lines[i:end])))
        except SyntaxError:
            return None
    return None


@rule(
    "NW406",
    title="NaN or inf in the input data that nothing used",
    severity="warning",
    summary=(
        "The batch holds NaN/inf, but no output, loss, gradient or weight of the step did: "
        "padding a packed sequence skips, missing values the model masks. Said once; the "
        "step is not an anomaly."
    ),
    early=True,
    priority=60,
)
def absorbed_input_data(ctx: RuleContext) -> Iterator[Diagnosis]:
    if ctx.anomaly is not None:
        return
    note = next((n for n in ctx.trace.notes if n.kind == "absorbed_data"), None)
    if note is None:
        return
    d = note.data
    rows = list(d.get("rows") or ())
    count = d.get("row_count") or len(rows)
    shape = d.get("shape") or []
    where = f"{d.get('role', 'input')} of {note.path}"
    samples = ""
    if rows:
        more = ", ..." if count and count > len(rows) else ""
        of = f" ({count} of {shape[0]})" if count and shape else ""
        samples = f" in samples {', '.join(map(str, rows))}{more}{of}"
    yield ctx.diagnosis(
        path=note.path,
        phase="input",
        evidence=[
            f"{where} holds {d.get('kinds') or 'NaN/inf'}{samples}",
            "every output, the loss, every gradient and every weight of the step stayed finite",
        ],
        explanation=(
            "The NaN/inf in this batch never reached a value the step computed: the model "
            "skips it (padding that pack_padded_sequence or a mask leaves out, missing values "
            "it replaces). That is fine while it lasts; a change that reads those positions "
            "(another pooling, a mask that is off by one) turns it into NaN losses."
        ),
        fix=(
            "# padding: pad with a finite value, the mask still says which positions are real\n"
            "x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)\n"
            "# missing values the model imputes itself (torch.where(torch.isnan(x), fill, x)):\n"
            "# nothing to fix; keep the warning out with nanwatch.watch(..., ignore=['NW406'])"
        ),
    )
