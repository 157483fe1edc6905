"""NW5xx: inputs stopped by a guard before the kernel ran (losses, embeddings, one_hot).

A guard (``nanwatch/guards.py``) that finds a bad input writes a ``"guard"``
:class:`~nanwatch.records.Note` and raises :class:`nanwatch.GuardError` (except, under
``on_anomaly="warn"``, for an input torch computes an inf or NaN loss from without an
error: then the note says ``raised=False``, its diagnosis is a warning and the call runs).
These rules turn that note into the step's :class:`~nanwatch.rules.Diagnosis`, so a
post-mortem report of the run says the same as the exception did (an error; a warning when
the program caught the GuardError and went on). One code per check; codes never change meaning.

Example:
    >>> from nanwatch.records import Note
    >>> note = Note("guard", "CrossEntropyLoss", {"code": "NW501", "problem": "target contains 255",
    ...             "fix": "nn.CrossEntropyLoss(ignore_index=255)", "explanation": ""})
    >>> diagnosis_from_note(note, step=3).headline
    'NW501 error: Class target out of range (CrossEntropyLoss, forward, step 3)'
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from nanwatch.ops import ColumnBroadcast
from nanwatch.records import LOSS_PATH, Note, Phase
from nanwatch.rules._evidence import paren
from nanwatch.rules.base import REGISTRY, Diagnosis, RuleContext, RuleFunc, rule

__all__ = ["CHECKS", "diagnosis_from_note", "unknown_id_hint", "unknown_row_fix"]

_FAMILY = "guards"
#: A guard error is the cause of the step's failure: it sorts before the diagnoses of any
#: consequence (a NaN loss, a dead CUDA context) of the same severity.
_PRIORITY = 5

#: code -> (title, summary)
CHECKS: dict[str, tuple[str, str]] = {
    "NW501": (
        "Class target out of range",
        "A loss target holds a class index outside [0, C) that is not the ignore_index "
        "(a 255 void label, labels numbered from 1, too few model outputs).",
    ),
    "NW502": (
        "Class target has the wrong dtype",
        "A class-index loss got a float, bool or int32 target; it needs int64 class indices.",
    ),
    "NW503": (
        "Class target shape does not match the input",
        "The target of CrossEntropyLoss/NLLLoss does not have the input's shape without the "
        "class dimension (classes last, a channel dim of 1, a resized mask).",
    ),
    "NW504": (
        "BCELoss input outside [0, 1]",
        "BCELoss got values outside [0, 1] (logits, or NaN): on a GPU the kernel asserts.",
    ),
    "NW505": (
        "Binary target outside [0, 1]",
        "A BCE-family loss got targets outside [0, 1] (a 0/255 mask, -1/1 labels).",
    ),
    "NW506": (
        "Input and target broadcast to a larger shape",
        "An elementwise loss got shapes like (N, 1) and (N,): it computes an N x N loss.",
    ),
    "NW507": (
        "Input and target shapes differ",
        "A BCE-family loss got an input and a target of different shapes (class indices, "
        "one per row, for a multi-label loss: a classifier given float labels).",
    ),
    "NW508": (
        "Loss tensors on different devices",
        "The input, target or a loss weight are on different devices.",
    ),
    "NW509": (
        "Loss target dtype not accepted",
        "The target's dtype is one the loss kernel rejects (an integer target for "
        "BCEWithLogitsLoss, a float16 target with a float32 input for BCELoss).",
    ),
    "NW510": (
        "Target is not 1 or -1",
        "A margin or embedding loss got targets other than 1 and -1 (often 0/1 labels).",
    ),
    "NW511": (
        "Probability target outside its range",
        "A target read as probabilities holds values outside [0, 1] (CrossEntropyLoss soft "
        "targets) or negative values (KLDivLoss); a KLDivLoss log-target holds -inf "
        "(log_target=True: exp(-inf) * -inf is NaN).",
    ),
    "NW512": (
        "CTC target contains the blank label",
        "A CTCLoss target uses the blank index, which CTC reserves for 'no label'.",
    ),
    "NW513": (
        "Index out of range",
        "Ids for an Embedding/EmbeddingBag (or F.one_hot values) outside [0, rows): a token "
        "id equal to the vocabulary size, padding written as -1 or -100, a sequence longer "
        "than the model's position table.",
    ),
    "NW514": (
        "Index has the wrong dtype",
        "Embedding ids, EmbeddingBag offsets or F.one_hot values that are not integers "
        "(int64 or int32; one_hot takes int64).",
    ),
    "NW515": (
        "EmbeddingBag offsets invalid",
        "EmbeddingBag offsets that do not start at 0, decrease, or point past the input "
        "(often the bags' ends, lengths.cumsum(0), instead of their starts).",
    ),
    "NW516": (
        "CTC target longer than its input can align",
        "A CTCLoss target needs more frames than its input has (its length plus one blank "
        "between each pair of equal adjacent labels): its loss is +inf without "
        "zero_infinity=True.",
    ),
    "NW517": (
        "Loss weight is inf, NaN or negative",
        "A loss's weight or pos_weight holds inf or NaN (n_neg / n_pos or 1 / counts where a "
        "class has no sample), or a negative weight: the loss is inf or NaN, or rewards errors.",
    ),
    "NW518": (
        "Target logit is -inf",
        "CrossEntropyLoss/NLLLoss got -inf at a row's target class (a mask that also covers "
        "the target, the log of a zero probability): that row's loss is +inf (NaN when the "
        "whole row is -inf). Also a loss's gather of a -inf log-probability (logp.gather(1, "
        "a), a Categorical's log_prob(a)): the index selects an entry the mask set to -inf.",
    ),
    "NW519": (
        "Loss input non-finite from a term without gradients",
        "CrossEntropyLoss/NLLLoss got +inf or NaN scores that no watched module and no op "
        "with a gradient made: a term computed without gradients (a log of a zero "
        "frequency as a sampling-bias correction) added to the scores holds them, and the "
        "loss is NaN.",
    ),
    "NW520": (
        "CTC log-probs are batch-first",
        "CTCLoss got (N, T, C) log-probabilities where it takes (T, N, C): input_lengths "
        "count dim 0 as the batch (an RNN with batch_first=True); transpose(0, 1).",
    ),
}


def unknown_id_hint(negative: Sequence[int], rows: int, *, above: bool) -> str:
    """NW513's words for category ids with no row (a table that is not a token table):
    a negative code is a missing or unknown category, not padding; an id past the last
    row is one the table was not sized for."""
    parts: list[str] = []
    if negative:
        codes = ", ".join(str(v) for v in sorted(set(negative))[:3])
        parts.append(
            f"{codes} is the code of a missing or unknown category (pandas' Categorical "
            "codes are -1 for NaN and for a level not in the categories), not a row"
        )
    if above:
        parts.append(
            f"ids >= {rows} were not seen when the table was sized (a category only in "
            "validation or new data)"
        )
    return " — " + "; ".join(parts) + ": give them an 'unknown' row of their own"


def unknown_row_fix(
    *,
    recv: str,
    rows: int,
    call: Callable[[str], str],
    grown: str | None,
    weight: str = "the weight",
    below: bool,
    above: bool,
    bigger: str | None = None,
) -> str:
    """NW513's fix for category ids with no row: one more row, ``rows``, kept for
    'unknown', and the ids without a row mapped onto it. ``recv`` is the user's ids
    expression (parenthesized when needed), ``call(expr)`` the user's line with the ids
    replaced by ``expr``, ``grown`` the table built again with ``rows + 1`` rows in the
    user's names (``self.store = nn.Embedding(46, 8)``; None for a functional call, whose
    ``weight`` is named instead), ``bigger`` the fix growing the table to every id, offered
    as the alternative when the ids past the end are new ones to learn.

    Example:
        >>> print(unknown_row_fix(recv="s", rows=45, call=lambda e: f"h = self.store({e})",
        ...       grown="self.store = nn.Embedding(46, 8)", below=False, above=True))
        self.store = nn.Embedding(46, 8)  # row 45: 'unknown', for ids the table has no row for
        h = self.store(s.clamp_max(45))  # ids >= 45 -> 45
    """
    if below and above:
        mapped = f"{recv}.masked_fill(({recv} < 0) | ({recv} >= {rows}), {rows})"
        said = f"ids < 0 or >= {rows} -> {rows}"
    elif above:
        mapped, said = f"{recv}.clamp_max({rows})", f"ids >= {rows} -> {rows}"
    else:
        mapped, said = f"{recv}.masked_fill({recv} < 0, {rows})", f"ids < 0 -> {rows}"
    line = call(mapped)
    if grown is not None:
        fix = (
            f"{grown}  # row {rows}: 'unknown', for ids the table has no row for\n{line}  # {said}"
        )
    else:
        fix = f"{line}  # {said}, once {weight} has {rows + 1} rows: row {rows} for 'unknown'"
    if above and bigger:
        first = bigger.splitlines()[0]
        if first.split("#")[0].strip() == (grown or "").strip():
            # the same table: growing it to every id is the 'unknown' row's table
            first = f"that table, with {recv} left as it is (no {rows} mapping)"
        fix += f"\n# or, if they are new ids to learn (the vocabulary grew): {first}"
    return fix


def diagnosis_from_note(note: Note, *, step: int | None = None) -> Diagnosis:
    """The Diagnosis for a ``"guard"`` note (the same words as the GuardError)."""
    data: dict[str, Any] = note.data
    code = str(data.get("code", "NW501"))
    registered = REGISTRY.get(code)
    title = registered.title if registered is not None else CHECKS.get(code, (code, ""))[0]
    evidence = [str(data.get("problem", ""))]
    positions = data.get("positions") or []
    if positions:
        shown = ", ".join("(" + ", ".join(str(i) for i in q) + ")" for q in positions)
        count = int(data.get("count", 0) or 0)
        within = data.get("positions_in")
        evidence.append(
            f"first positions: {shown}"
            + (f" (of {count:,})" if count > len(positions) else "")
            + (f" ({within})" if within else "")
        )
    if note.source:
        line = data.get("source_line")
        evidence.append(f"at {note.source}" + (f": {line}" if line else ""))
    return Diagnosis(
        code=code,
        title=title,
        severity="error",
        step=step,
        phase="forward",
        path=note.path,
        evidence=evidence,
        explanation=str(data.get("explanation", "")),
        fix=str(data.get("fix", "")),
        source=note.source,
        priority=registered.priority if registered is not None else _PRIORITY,
    )


def _found(ctx: RuleContext, code: str) -> Iterator[Diagnosis]:
    for note in ctx.trace.notes:
        if note.kind == "guard" and note.data.get("code") == code:
            d = diagnosis_from_note(note, step=ctx.step)
            compiled = note.data.get("compiled")
            if note.data.get("hand"):  # a hand-written loss's broadcast: told, not raised
                d.severity = "warning"
            elif compiled:
                # the guard could not run inside the compiled graph: it checked the inputs
                # again on the eager module once the compiled call had raised
                d.evidence.append(
                    f"the torch.compile'd call of {compiled} raised "
                    f"{note.data.get('compiled_error') or 'an error'}: a guard cannot run "
                    "inside a compiled graph, so nanwatch checked the same inputs on the eager "
                    "module after the error"
                )
                if ctx.trace.error is None:
                    d.severity = "warning"  # the program caught the error and went on
                    d.evidence.append("the error was caught and the step went on")
            elif note.data.get("raised") is False:
                # torch computes it without an error (an inf or NaN loss): under "warn" the
                # guard noted it and let the call run. When the step's first NaN/inf is that
                # loss, the note is its cause (an error, before the generic NW100), else
                # a warning (a loop skipped the non-finite loss)
                if not _made_the_anomaly(ctx, note):
                    d.severity = "warning"
                policy = note.data.get("on_anomaly", "warn")
                d.evidence.append(
                    f"on_anomaly={policy!r}: noted, and the call ran (torch computes it "
                    "without an error; the loss is inf or NaN, which a loop can skip)"
                )
            elif ctx.trace.error is None:
                # the program caught the GuardError and went on (skipping a bad batch): a
                # warning in the report, not a second error at the end of the step
                d.severity = "warning"
                d.evidence.append("the GuardError was caught and the step went on")
            yield d


def _made_the_anomaly(ctx: RuleContext, note: Note) -> bool:
    """The step's anomaly is a value born in the forward of the loss call the guard noted
    (a loss module at its path, or a functional loss in the loss code)."""
    a = ctx.anomaly
    if a is None or a.record.phase is not Phase.FORWARD:
        return False
    return a.path in (note.path, LOSS_PATH)


def _register(code: str) -> Callable[[RuleFunc], RuleFunc]:
    title, summary = CHECKS[code]
    return rule(
        code, title=title, severity="error", summary=summary, family=_FAMILY, priority=_PRIORITY
    )


@_register("NW501")
def class_target_out_of_range(ctx: RuleContext) -> Iterator[Diagnosis]:
    return _found(ctx, "NW501")


@_register("NW502")
def class_target_dtype(ctx: RuleContext) -> Iterator[Diagnosis]:
    return _found(ctx, "NW502")


@_register("NW503")
def class_target_shape(ctx: RuleContext) -> Iterator[Diagnosis]:
    return _found(ctx, "NW503")


@_register("NW504")
def bce_input_range(ctx: RuleContext) -> Iterator[Diagnosis]:
    return _found(ctx, "NW504")


@_register("NW505")
def binary_target_range(ctx: RuleContext) -> Iterator[Diagnosis]:
    return _found(ctx, "NW505")


@_register("NW506")
def silent_broadcast(ctx: RuleContext) -> Iterator[Diagnosis]:
    return _found(ctx, "NW506")


@_register("NW507")
def binary_shape_mismatch(ctx: RuleContext) -> Iterator[Diagnosis]:
    return _found(ctx, "NW507")


@_register("NW508")
def device_mismatch(ctx: RuleContext) -> Iterator[Diagnosis]:
    return _found(ctx, "NW508")


@_register("NW509")
def target_dtype(ctx: RuleContext) -> Iterator[Diagnosis]:
    return _found(ctx, "NW509")


@_register("NW510")
def target_not_sign(ctx: RuleContext) -> Iterator[Diagnosis]:
    return _found(ctx, "NW510")


@_register("NW511")
def probability_target_range(ctx: RuleContext) -> Iterator[Diagnosis]:
    return _found(ctx, "NW511")


@_register("NW512")
def ctc_blank_target(ctx: RuleContext) -> Iterator[Diagnosis]:
    return _found(ctx, "NW512")


@_register("NW513")
def index_out_of_range(ctx: RuleContext) -> Iterator[Diagnosis]:
    return _found(ctx, "NW513")


@_register("NW514")
def index_dtype(ctx: RuleContext) -> Iterator[Diagnosis]:
    return _found(ctx, "NW514")


@_register("NW515")
def embedding_bag_offsets(ctx: RuleContext) -> Iterator[Diagnosis]:
    return _found(ctx, "NW515")


@_register("NW516")
def ctc_target_too_long(ctx: RuleContext) -> Iterator[Diagnosis]:
    return _found(ctx, "NW516")


@_register("NW520")
def ctc_batch_first(ctx: RuleContext) -> Iterator[Diagnosis]:
    return _found(ctx, "NW520")


@_register("NW517")
def loss_weight_not_finite(ctx: RuleContext) -> Iterator[Diagnosis]:
    return _found(ctx, "NW517")


@_register("NW518")
def target_logit_neginf(ctx: RuleContext) -> Iterator[Diagnosis]:
    found = list(_found(ctx, "NW518"))
    if found:
        yield from found
        return
    picked = _picked_neginf(ctx)
    if picked is not None:
        yield picked


def _picked_neginf(ctx: RuleContext) -> Diagnosis | None:
    """A loss in loss code went non-finite and its graph shows a gather that picked -inf
    out of a log-probability that holds some (``log_softmax(logits).gather(1, a)``, a
    Categorical's ``log_prob(a)``, logits masked with -inf): no guard saw it, and the index
    of those rows (an action, a target) is an entry the mask forbids."""
    a = ctx.anomaly
    if a is None or a.path != LOSS_PATH or a.record.phase is not Phase.FORWARD:
        return None
    for note in ctx.notes("loss_graph"):
        for sel in note.data.get("selections", ()):
            n = int(sel.get("picked", {}).get("-inf", 0))
            if not n:
                continue
            rows, held = sel.get("rows", 0), sel.get("source_nonfinite", 0)
            total = sel.get("source_numel", 0)
            chain = [str(o).removeprefix("watched:") for o in sel.get("made_from", ())]
            masked = next((o for o in chain if o in ("maskedfill", "where", "indexput")), None)
            by = " <- ".join(["gather", *chain[: chain.index(masked) + 1]]) if masked else ""
            evidence = [
                f"the loss code's gather picked -inf in {n:,} of {rows:,} rows: its source "
                f"holds {held:,} non-finite of {total:,} values, and the index of those rows "
                "points at them" + (f" ({by}: entries a mask set to -inf)" if by else ""),
                "a log-probability of -inf is a probability of 0: the action or target "
                "selected there is one the mask forbids; its loss term is inf, and a sum of "
                "+inf and -inf terms (a signed advantage) is NaN",
            ]
            if note.source:
                evidence.append(f"at {note.source}")
            return ctx.diagnosis(
                # read from the graph, no guard stopped it: after the domain rules that
                # name the masked output itself (NW110's masked action of a policy module)
                priority=40,
                title="Gathered log-probability is -inf: the index selects a masked entry",
                path=LOSS_PATH,
                phase="forward",
                evidence=evidence,
                explanation=(
                    "The log-probabilities were computed from logits a mask set to -inf "
                    "(illegal actions, padding, excluded classes), and the index gathered "
                    "from them (the action taken, the target) points at such an entry in "
                    "some rows: the mask and the index disagree. That happens when the "
                    "actions come from an older mask (a replay buffer, a rollout from "
                    "another state), or when the target is one the mask covers."
                ),
                fix=(
                    "bad = ~legal.gather(1, a[:, None]).squeeze(1)   # a pattern, in your "
                    "names: legal the mask (True = allowed), a the gathered index\n"
                    "print(bad.nonzero().flatten().tolist())   # the rows: find where their "
                    "index was made (a stale action, a target the mask covers)\n"
                    "# then keep those rows out of the loss, or build the mask so it never "
                    "covers the index taken"
                ),
                source=note.source,
            )
    return None


@_register("NW519")
def loss_input_from_a_term_without_gradients(ctx: RuleContext) -> Iterator[Diagnosis]:
    return _found(ctx, "NW519")


_BINOPS = {"Sub": ast.Sub, "Rsub": ast.Sub, "Add": ast.Add, "Mul": ast.Mult, "Div": ast.Div}
_SIGNS = {ast.Sub: "-", ast.Add: "+", ast.Mult: "*", ast.Div: "/"}


def _one_binop(stmt: str, kind: type[ast.operator]) -> ast.BinOp | None:
    """The one operation of ``kind`` (``ast.Sub``) in ``stmt``; None for none or several."""
    try:
        tree = ast.parse(stmt.strip())
    except SyntaxError:
        return None
    ops = [n for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, kind)]
    return ops[0] if len(ops) == 1 else None


def _helper_binop(
    stmt: str, kind: type[ast.operator], names: Mapping[str, Any], scope: Mapping[str, Any]
) -> tuple[str, str, ast.BinOp, dict[str, str]] | None:
    """The loss made by a function the statement calls (``loss = mse(pred, y)``): (the
    function's line with its one operation of ``kind``, that line's ``file.py:N``, the
    operation, the function's parameters named by the call's argument names). None when
    the call is not of a plain Python function whose source holds one such operation."""
    import inspect

    try:
        tree = ast.parse(stmt.strip())
    except SyntaxError:
        return None
    found = [
        (n, f)
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and inspect.isfunction(f := names.get(n.func.id, scope.get(n.func.id)))
    ]
    if len(found) != 1:
        return None
    call, fn = found[0]
    try:
        lines, first = inspect.getsourcelines(fn)
        params = list(inspect.signature(fn).parameters)
    except (OSError, TypeError, ValueError):
        return None
    bound = {params[i]: ast.unparse(a) for i, a in enumerate(call.args) if i < len(params)} | {
        k.arg: ast.unparse(k.value) for k in call.keywords if k.arg
    }
    hits = []
    for i, text in enumerate(lines):
        op = _one_binop(text.strip().removeprefix("return "), kind)
        if op is not None:
            hits.append((text.strip(), f"{fn.__code__.co_filename}:{first + i}", op))
    if len(hits) != 1:
        return None
    return (*hits[0], bound)


def column_broadcast_words(
    found: ColumnBroadcast,
    site: str | None,
    names: Mapping[str, Any],
    scope: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """NW506's words for a hand-written loss that broadcast a column against a row (see
    :func:`nanwatch.ops.column_broadcast`): the statement that assigned the tensor
    ``backward()`` ran on (read above ``site``, the ``backward()`` line), or the line of the
    function it called (``loss = mse(pred, y)``), with its one operation of the node's
    kind; its two operands with their shapes and the fix in the user's names. An operand
    without autograd history is the local ``names`` binds to its text (through the call's
    arguments), and its shape must be the row's (a matrix the column is meant to broadcast
    against is no mistake). None when that cannot be told."""
    import linecache

    import torch

    from nanwatch.rules.domain import _assigned_before

    path, _, num = (site or "").rpartition(":")
    line = linecache.getline(path, int(num)).strip() if num.isdigit() else ""
    m = re.search(r"([A-Za-z_]\w*)\.backward\(", line)
    stmt = _assigned_before(site, m.group(1)) if m is not None else None
    if stmt is None:
        stmt = line if m is None else None
    if not stmt:
        return None
    kind = _BINOPS[found.node.split("Backward")[0]]
    op = _one_binop(stmt, kind)
    where = _line_no_site(site, stmt)
    bound: dict[str, str] = {}
    if op is None:
        helper = _helper_binop(stmt, kind, names, scope or {})
        if helper is None:  # several on the line: those whose operands' locals broadcast
            return _several_binops_words(found, stmt, where, kind, names=names, scope=scope or {})
        stmt, where, op, bound = helper
    sides = [ast.unparse(op.left), ast.unparse(op.right)]
    if found.node.startswith("Rsub"):
        sides.reverse()
    shapes = list(found.shapes)
    col = found.column
    row = 1 - col
    row_shape = found.shapes[col][:-1]  # type: ignore[index]
    if shapes[row] is None:  # no history: the local the line names, of the row's shape
        v = names.get(bound.get(sides[row], sides[row]))
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != row_shape:
            return None
        shapes[row] = row_shape
    for side, shape in zip(sides, shapes, strict=True):  # a local the line names: its shape
        v = names.get(bound.get(side, side))
        if isinstance(v, torch.Tensor) and tuple(v.shape) != shape:
            return None  # another operation of the loss code broadcast, not this line's
    dim = len(row_shape)
    n_out = math.prod(found.out)
    n_own = math.prod(row_shape)
    squeezed = [f"{paren(sides[col])}.squeeze({dim})" if i == col else sides[i] for i in (0, 1)]
    unsq = [f"{paren(sides[row])}.unsqueeze({dim})" if i == row else sides[i] for i in (0, 1)]
    sign = _SIGNS[kind]
    basis = stmt.strip().removeprefix("return ")
    old = ast.get_source_segment(basis, op) or f"{sides[0]} {sign} {sides[1]}"
    fixed = stmt.replace(old, f"{squeezed[0]} {sign} {squeezed[1]}", 1)
    return {
        "code": "NW506",
        "check": "broadcast",
        "problem": (
            f"{sides[col]} {_shape_text(found.shapes[col])} and {sides[row]} "
            f"{_shape_text(shapes[row])} broadcast to {_shape_text(found.out)} in "
            f"{sides[0]} {sign} {sides[1]}: each prediction meets every target ({n_out:,} "
            f"terms instead of {n_own:,}), not only its own"
        ),
        "expected": "operands of the same shape",
        "fix": (f"{fixed}   # or {unsq[0]} {sign} {unsq[1]}: the same shape on both sides"),
        "explanation": (
            f"A ({found.shapes[col][-2]}, 1) column against {row_shape[-1]} values in a row "  # type: ignore[index]
            "broadcasts to a square: the loss compares every prediction with every target. "
            "nn.MSELoss warns about it; code written by hand gets no warning, and the loss "
            "looks plausible and decreases while the model learns the mean of the targets."
        ),
        "count": n_out,
        "total": n_own,
        "source": where,
        "source_line": stmt,
    }


#: calls that keep their tensor argument's shape, for :func:`_elementwise_shape`
_ELEMENTWISE = frozenset(
    {
        "abs", "clamp", "clamp_max", "clamp_min", "clip", "detach", "double", "exp", "expm1",
        "float", "half", "log", "log10", "log1p", "log2", "logsigmoid", "neg", "pow", "relu",
        "rsqrt", "sigmoid", "softplus", "sqrt", "square", "tanh", "to",
    }
)  # fmt: skip


def _elementwise_shape(
    expr: ast.expr, names: Mapping[str, Any], scope: Mapping[str, Any]
) -> tuple[int, ...] | None:
    """The shape of ``expr`` when it is elementwise arithmetic and calls (``torch.log(1 -
    p)``, ``(1 - y)``) of locals that hold tensors of one shape (0-d ones and numbers
    aside): that shape. None for anything else (a reduction, an index, locals of several
    shapes, no tensor)."""
    import torch

    shapes: set[tuple[int, ...]] = set()
    for n in ast.walk(expr):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name not in _ELEMENTWISE:
                return None
        elif isinstance(n, ast.Subscript | ast.Lambda | ast.comprehension):
            return None
        elif isinstance(n, ast.Name):
            v = names.get(n.id, scope.get(n.id))
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                shapes.add(tuple(v.shape))
    return shapes.pop() if len(shapes) == 1 else None


def _several_binops_words(
    found: ColumnBroadcast,
    stmt: str,
    where: str | None,
    kind: type[ast.operator],
    *,
    names: Mapping[str, Any],
    scope: Mapping[str, Any],
) -> dict[str, Any] | None:
    """:func:`column_broadcast_words` for a statement with several operations of the node's
    kind (``-(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()``): those whose two
    operands, read from the locals they are made of, have the shapes the graph says
    broadcast (the column's and the row's), each named, and a fix that squeezes the column
    in each. None when none does."""
    col_shape = found.shapes[found.column]
    if col_shape is None or found.node.startswith("Rsub"):
        return None
    row_shape = col_shape[:-1]
    text = stmt.strip()
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    hits: list[tuple[ast.BinOp, int]] = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.BinOp) or not isinstance(n.op, kind):
            continue
        shapes = [_elementwise_shape(e, names, scope) for e in (n.left, n.right)]
        col = next((c for c in (0, 1) if shapes[c] == col_shape), None)
        if col is not None and shapes[1 - col] == row_shape:
            hits.append((n, col))
    spans = [(op, col, ast.get_source_segment(text, op)) for op, col in hits]
    if not hits or any(seg is None for _, _, seg in spans):
        return None
    dim = len(row_shape)
    sign = _SIGNS[kind]
    squeeze: list[tuple[int, int, str]] = []
    unsqueeze: list[tuple[int, int, str]] = []
    for op, col, _ in spans:
        sides = [op.left, op.right]
        for edits, e, how in ((squeeze, sides[col], "squeeze"), (unsqueeze, sides[1 - col], "unsqueeze")):  # fmt: skip  # noqa: E501
            span = _span(text, e)
            if span is None:
                return None
            edits.append((*span, f"{paren(ast.unparse(e))}.{how}({dim})"))
    squeezed, unsq = _edited(text, squeeze), _edited(text, unsqueeze)
    named = []
    for i, (op, col, seg) in enumerate(spans):
        c, r = ast.unparse([op.left, op.right][col]), ast.unparse([op.left, op.right][1 - col])
        if i == 0:
            c, r = f"{c} {_shape_text(col_shape)}", f"{r} {_shape_text(row_shape)} broadcast to "
            r += _shape_text(found.out)
        named.append(f"{c} and {r} in {seg}")
    n_out = math.prod(found.out)
    n_own = math.prod(row_shape)
    return {
        "code": "NW506",
        "check": "broadcast",
        "problem": (
            f"{', '.join(named)}: each prediction meets every target "
            f"({n_out:,} terms instead of {n_own:,}), not only its own"
        ),
        "expected": "operands of the same shape",
        "fix": f"{squeezed}   # or {unsq}: the same shape on both sides of each {sign}",
        "explanation": (
            f"A ({col_shape[-2]}, 1) column against {row_shape[-1]} values in a row "
            "broadcasts to a square: the loss compares every prediction with every target. "
            "nn.BCELoss refuses it and nn.MSELoss warns; code written by hand gets no warning, "
            "and the loss looks plausible and decreases while the model learns the mean of "
            "the targets."
        ),
        "count": n_out,
        "total": n_own,
        "source": where,
        "source_line": text,
    }


def _span(text: str, e: ast.expr) -> tuple[int, int] | None:
    """The columns of ``e`` in the one-line statement ``text``, with the parentheses around
    it that are its own (not a call's); None for an expression over several lines."""
    a, b = e.col_offset, e.end_col_offset
    if e.lineno != 1 or e.end_lineno != 1 or b is None:
        return None
    own = text[a - 1 : a] == "(" and text[b : b + 1] == ")"
    if own and not re.match(r"[\w)\]]", text[max(a - 2, 0) : a - 1]):
        return a - 1, b + 1
    return a, b


def _edited(text: str, edits: Sequence[tuple[int, int, str]]) -> str:
    """``text`` with each span ``(start, end)`` replaced by its new text."""
    for a, b, new in sorted(edits, reverse=True):
        text = f"{text[:a]}{new}{text[b:]}"
    return text


def _shape_text(shape: Sequence[int] | None) -> str:
    """``(16, 1)``, ``(16,)``: a shape as Python writes a tuple."""
    return str(tuple(shape or ()))


def _line_no_site(site: str | None, stmt: str) -> str | None:
    from nanwatch.rules.domain import _line_of

    if site is None:
        return None
    return _line_of(site, stmt) or site
