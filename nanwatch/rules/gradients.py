"""Gradients, weights and the optimizer: non-finite weights after an update (NW301),
non-finite parameter gradients (NW302), exploding gradients (NW303), vanishing or dead
gradients (NW304), a collapsing loss scaler (NW305), a weight decay that makes the update
diverge (NW306), gradients that are never reset between optimizer steps (NW307) and a loss
spike right after an oversized update (NW308).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import itertools
import math
import os
import re
import statistics
import sys
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from nanwatch import _frames
from nanwatch._updates import nan_free_update
from nanwatch._updates import numbers as _numbers
from nanwatch.localize import hook_op, localize, user_hook
from nanwatch.records import (
    LOSS_PATH,
    Anomaly,
    AnomalyKind,
    Note,
    Phase,
    Record,
    StepTrace,
    TensorStat,
)
from nanwatch.rules._evidence import (
    _loss_line_of,
    anomaly_fields,
    count,
    describe_stat,
    device_type,
    fmt,
    limits,
    loss_uses,
    low_precision,
    note_num,
    paren,
    statements,
)
from nanwatch.rules.base import REGISTRY, Diagnosis, RuleContext, rule, sort_key
from nanwatch.rules.generic import _REPLAY
from nanwatch.rules.losses import ctc_dropped, detached_input

# ---------------------------------------------------------------------- NW301


@rule(
    "NW301",
    title="Non-finite weights after an optimizer step",
    severity="error",
    summary=(
        "A parameter holds NaN/inf before this step's forward: the last optimizer update "
        "wrote it (learning rate too high, no gradient clipping, no loss scaler; a NaN "
        "learning rate; an eps that is 0 in float16 weights), or the weights were loaded "
        "so before the first update. Early: an optimizer stepped directly (not by "
        "scaler.step) on a GradScaler's scaled gradients, named at its first update."
    ),
    early=True,
    priority=10,
)
def bad_weights(ctx: RuleContext) -> Iterator[Diagnosis]:
    a = ctx.anomaly
    if a is None or a.kind is not AnomalyKind.PARAMETER:
        if _scaled_step(ctx.trace) and not _scaled_step_told(ctx):
            # from the first update: every one applies gradients x scale
            yield _scaler_bypass_diagnosis(ctx, a, ctx.trace, name=None, evidence=[])
            return
        grown = _grown_outside(ctx, a) if a is not None else None
        if a is not None and grown is not None:
            yield _grown_outside_diagnosis(ctx, a, grown)
        return
    bad = [r for r in ctx.trace.records if r.phase is Phase.PARAMETER and r.bad]
    name = a.parameter or a.record.role
    rec = a.record
    lim = low_precision(rec.dtype)
    evidence = []
    for r in bad[:5]:
        evidence.append(f"{r.role} ({r.dtype}, shape {list(r.shape)}): {describe_stat(r.stat)}")
    if len(bad) > 5:
        evidence.append(f"and {len(bad) - 5} more parameters")
    s = rec.stat
    if lim is not None and s is not None and s.finite_amax is not None:
        evidence.append(
            f"the largest finite value of {name} is {fmt(s.finite_amax)}: "
            f"{s.finite_amax / lim.max:.0%} of {rec.dtype}'s largest value {fmt(lim.max)}"
        )
    writer = _writer(ctx, name)
    hand = _hand_written(ctx, rec, name, writer)
    if hand is not None:
        yield _hand_update(ctx, a, hand, name=name, evidence=evidence)
        return
    kept = _kept_since(ctx, name, writer)
    if kept is not None and ctx.history:
        # no optimizer stepped it since the last read, which found it non-finite already
        # (a GAN's generator stepped every n_critic steps): nothing wrote it
        yield _bad_since_diagnosis(
            ctx, a, kept, ctx.history[-1], name=name, evidence=evidence, updated=False
        )
        return
    if writer is not None and writer.get("since_attach"):
        # written after the attach check found it finite, by no optimizer (an ActNorm's
        # data-dependent init in the first forward, a copy_ under no_grad)
        yield _written_elsewhere(ctx, a, name=name, evidence=evidence, after=None)
        return
    if not ctx.history and rec.index < 0 and _finite_at_attach(writer) is not True:
        # found ahead of the first step's forward: no update ran under the watcher
        yield ctx.diagnosis(
            **anomaly_fields(a),
            title="Non-finite weights before the first update",
            evidence=[
                *evidence,
                "they were already non-finite when the first step nanwatch watched began: "
                "no optimizer update had run under it",
            ],
            explanation=(
                f"{name} held NaN/inf before training under nanwatch began, so no "
                "computation of this run made it: the weights were loaded that way (a "
                "checkpoint saved after a run had already diverged, a corrupted file) or "
                "initialized that way (a custom init dividing by a zero fan-in or std). Every "
                "layer that multiplies by it produces NaN from the first batch."
            ),
            fix=(
                "sd = torch.load(path, map_location='cpu')   # check right after loading\n"
                "bad = [k for k, t in sd.items() if t.is_floating_point() and "
                "not torch.isfinite(t).all()]\n"
                "print(bad)   # load an earlier checkpoint, or re-initialize these"
            ),
        )
        return
    if writer is not None and writer.get("optimizer") is None:
        yield _written_elsewhere(
            ctx, a, name=name, evidence=evidence, after=writer.get("after_optimizer")
        )
        return
    # the update that broke it: this step's when it was found at the step's end, the last
    # step's when found before this step's forward
    at_end = _after_forward(ctx.trace, rec) or _update_without_forward(ctx.trace)
    prev = ctx.trace if at_end else (ctx.history[-1] if ctx.history else None)
    since = _bad_since(ctx, name, prev)
    if prev is not None and since is not None:
        yield _bad_since_diagnosis(ctx, a, since, prev, name=name, evidence=evidence)
        return
    consequence: str | None = None
    gnorm: float | None = None
    written = _written_grad(ctx, name, prev)
    if written is not None:
        nan_only = rec.stat is not None and not (rec.stat.has_posinf or rec.stat.has_neginf)
        if written[1] is True or (written[1] is None and nan_only):
            yield _written_grad_diagnosis(ctx, a, written, name=name, evidence=evidence)
            return
    if prev is not None and written is None:
        g = next((r for r in prev.records if r.phase is Phase.GRADIENT and r.role == name), None)
        if g is not None and g.stat is not None and not g.stat.finite:
            consequence = (
                f"the gradient of {name} applied at step {prev.step} was already {g.stat.kinds()}"
            )
        elif prev.anomaly is not None and prev is not ctx.trace:
            end = _read_bad_at_end(prev, name)
            if end is not None:  # found so at that step's end, its own anomaly said why
                yield _bad_since_diagnosis(
                    ctx, a, (prev, end, True), ctx.trace, name=name, evidence=evidence
                )
                return
            consequence = f"step {prev.step} already had an anomaly: {prev.anomaly.summary}"
        elif g is not None and g.stat is not None and g.stat.norm is not None:
            gnorm = g.stat.norm
            evidence.append(
                f"its gradient norm at step {prev.step}, the update that broke it: "
                f"{fmt(g.stat.norm)}"
            )
    if prev is not None and (_scaled_step(prev) or (consequence and _scaler_bypassed(prev))):
        more = [consequence] if consequence else []
        yield _scaler_bypass_diagnosis(ctx, a, prev, name=name, evidence=[*evidence, *more])
        return
    if consequence is not None:
        head, check = _grad_check(ctx, prev)
        yield ctx.diagnosis(
            **anomaly_fields(a),
            title="Non-finite weights (a consequence of an earlier anomaly)",
            evidence=[*evidence, consequence],
            explanation=(
                f"{name} became non-finite because the optimizer applied a non-finite "
                "gradient: this is the aftermath of the earlier step's anomaly, not a new "
                "cause. Fix that one; skipping updates with non-finite gradients keeps the "
                "weights intact meanwhile."
            ),
            fix=(
                f"{head}if all({check} for p in model.parameters()\n"
                "       if p.grad is not None):\n"
                "    optimizer.step()   # skip updates with NaN/inf gradients"
            ),
            priority=95,
        )
        return
    update = _last_update(ctx, rec.dtype, writer, prev)
    if update is not None:
        special = _update_itself(ctx, a, update, name=name, evidence=evidence)
        if special is not None:
            yield special
            return
    ranks = _other_rank(ctx, prev, rec, update, gnorm)
    if ranks is not None:
        yield _other_rank_diagnosis(ctx, a, update, ranks, gnorm, name=name, evidence=evidence)
        return
    state = _bad_state(ctx, name)
    origin = _state_origin(ctx, name) if state else None
    if state and origin is not None:  # an earlier step's NaN gradient: in the state since
        yield _state_from_grad(ctx, a, update, state, origin, name=name, evidence=evidence)
        return
    if state:
        yield _bad_state_diagnosis(ctx, a, update, state, name=name, evidence=evidence)
        return
    own = _own_optimizer_nan(ctx, a, update, prev, gnorm, name=name, evidence=evidence)
    if own is not None:
        yield own
        return
    losses = [(t.step, t.loss) for t in ctx.history if t.loss is not None][-4:]
    if len(losses) >= 2:
        evidence.append(
            "loss over the last steps: " + ", ".join(f"{fmt(v)} (step {st})" for st, v in losses)
        )
    total = prev.grad_norm if prev is not None else None
    yield _plain_update(ctx, a, update, gnorm, name=name, evidence=evidence, total=total)


def _optimizer_class(name: str) -> type | None:
    """The optimizer class called ``name`` that is not torch's own (a hand-written LAMB,
    Adafactor, Shampoo), found among the subclasses of ``torch.optim.Optimizer``: the last
    one defined. None when there is none, or when torch.optim has a class of that name and
    no other module defines one."""
    found: list[type] = []
    todo = list(torch.optim.Optimizer.__subclasses__())
    seen: set[type] = set()
    while todo and len(seen) < 4096:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        todo.extend(c.__subclasses__())
        if c.__name__ == name and not c.__module__.startswith("torch."):
            found.append(c)
    return found[-1] if found else None


#: ops of an optimizer's step that are inf at 0: their name, what they do at 0
_AT_ZERO = {"rsqrt": "rsqrt of 0 is inf", "reciprocal": "1 / 0 is inf"}
#: divisors that are 0 where a gradient, a weight or a running statistic is all 0
_ZERO_DIVISORS = frozenset({"norm", "vector_norm", "matrix_norm", "sqrt", "mean", "sum"})


def _negative(node: ast.expr) -> bool:
    """``-0.5``, ``-1.0 / p``: an exponent that is negative as written."""
    while isinstance(node, ast.BinOp):
        node = node.left
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)


def _call_name(node: ast.AST) -> str:
    if not isinstance(node, ast.Call):
        return ""
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _zero_divisor(node: ast.expr, assigned: dict[str, ast.expr]) -> bool:
    """A divisor with no eps that is 0 when what it is made of is all 0: a norm, a sqrt, a
    mean or sum (``u_norm``, assigned ``upd.norm()``), never ``x + eps`` nor a clamp."""
    if isinstance(node, ast.Name) and node.id in assigned:
        node = assigned[node.id]
    return _call_name(node) in _ZERO_DIVISORS


def _is_norm(node: ast.expr, assigned: dict[str, ast.expr]) -> bool:
    """A norm with no eps (``w_norm``, assigned ``p.norm()``; ``torch.linalg.vector_norm(p)``):
    never negative, 0 exactly when its tensor is all 0."""
    if isinstance(node, ast.Name) and node.id in assigned:
        node = assigned[node.id]
    return _call_name(node) in {"norm", "vector_norm", "matrix_norm"}


def _normalizes_itself(div: ast.BinOp) -> bool:
    """``x / x.norm()``: a tensor divided by its own norm, 0/0 where it is all 0."""
    r = div.right
    return (
        isinstance(r, ast.Call)
        and isinstance(r.func, ast.Attribute)
        and _call_name(r) in {"norm", "vector_norm"}
        and ast.dump(r.func.value) == ast.dump(div.left)
    )


#: how ``_zero_ops`` rewrites an op: floor its operand, guard a ratio of two norms with
#: torch.where (1 when either is 0, the LAMB/LARS convention), or add an eps to a norm a
#: tensor is divided by to normalize it
_Rewrite = Literal["clamp", "where", "eps"]


def _zero_ops(tree: ast.AST, lines: list[str]) -> list[tuple[int, str, str, str | None]]:
    """The ops in the methods ``tree`` holds that are inf or 0/0 at 0 with no eps (an
    ``x.rsqrt()``, ``ev.pow(-1 / p)``, ``w / u.norm()``): each one's line number in
    ``lines``, that line, what it does at 0, and the line with that op guarded (None when
    that does not parse on its own): its operand clamped away from 0 (``.clamp_min(1e-12)``),
    a ratio of two norms (a trust ratio) kept to 1 where either is 0 with ``torch.where``,
    ``x / (x.norm() + 1e-7)`` for a tensor normalized by its own norm."""
    assigned: dict[str, ast.expr] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            assigned[node.targets[0].id] = node.value
    guarded = {  # inside a torch.where(...): the user's own guard picks another value
        id(sub) for node in ast.walk(tree) if _call_name(node) == "where" for sub in ast.walk(node)
    }
    hits: list[tuple[ast.expr, str, _Rewrite]] = []
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        name = _call_name(node)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            on_torch = isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
            operand = node.args[0] if on_torch and node.args else node.func.value
            power = node.args[1:2] if on_torch else node.args[:1]
            if name in _AT_ZERO:
                hits.append((operand, _AT_ZERO[name], "clamp"))
            elif name == "pow" and power and _negative(power[0]):
                hits.append((operand, "a negative power of 0 is inf, of a negative NaN", "clamp"))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            if _negative(node.right):
                hits.append((node.left, "a negative power of 0 is inf, of a negative NaN", "clamp"))
        elif (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Div)
            and _zero_divisor(node.right, assigned)
        ):
            if _is_norm(node.left, assigned) and _is_norm(node.right, assigned):
                hits.append((node, "a ratio of two norms, inf or 0/0 where one is 0", "where"))
            elif _normalizes_itself(node):
                hits.append((node.right, "a tensor divided by its own norm, 0/0 at 0", "eps"))
            else:
                hits.append((node.right, "a division by a norm or mean that is 0", "clamp"))
    by_line: dict[int, list[tuple[ast.expr, str, _Rewrite]]] = {}
    for hit in hits:
        operand = hit[0]
        if operand.lineno == operand.end_lineno and 0 < operand.lineno <= len(lines):
            by_line.setdefault(operand.lineno, []).append(hit)
    out: list[tuple[int, str, str, str | None]] = []
    for num in sorted(by_line):
        row = lines[num - 1]
        edits: list[tuple[int, int, str]] = []  # replace row[lo:hi] with the text
        for operand, _, how in by_line[num]:
            lo, hi = operand.col_offset, operand.end_col_offset or operand.col_offset
            seg = row[lo:hi]
            if how == "where" and isinstance(operand, ast.BinOp):
                a = row[operand.left.col_offset : operand.left.end_col_offset]
                b = row[operand.right.col_offset : operand.right.end_col_offset]
                edits.append(
                    (
                        lo,
                        hi,
                        f"torch.where(({a} > 0) & ({b} > 0), {paren(a)} / {paren(b)}, "
                        f"torch.ones_like({a}))",
                    )
                )
            elif how == "eps":
                edits.append((lo, hi, f"({seg} + 1e-7)"))
            elif paren(seg) != seg and row[lo - 1 : lo] == "(" and row[hi : hi + 1] == ")":
                edits.append((lo - 1, hi + 1, f"({seg}).clamp_min(1e-12)"))  # its own parens
            else:
                edits.append((lo, hi, f"{paren(seg)}.clamp_min(1e-12)"))
        fixed = row
        end = len(row) + 1
        for lo, hi, text in sorted(edits, key=lambda e: (-e[0], e[1])):
            if hi > end:
                continue  # inside an op already rewritten on this line
            fixed = fixed[:lo] + text + fixed[hi:]
            end = lo
        try:
            ast.parse(fixed.strip())
        except SyntaxError:
            fixed = ""
        whats = ", ".join(dict.fromkeys(w for _, w, _ in by_line[num]))
        out.append((num, row.strip(), whats, fixed.strip() or None))
    return out


def _step_source(
    cls: type,
) -> tuple[str, int, list[tuple[int, str, str, str | None, str]]] | None:
    """Where ``cls.step`` is (its file, its first line) and the ops of ``step``, of the
    class's methods it calls (``self.inv_root``, ``Shampoo.inv_root``) and of the functions
    of the same file those call (``zeropower_via_newtonschulz5(g)``) that are inf or 0/0 at
    0, with their lines in that file. None when the source cannot be read."""
    import inspect
    import linecache

    fn = inspect.unwrap(getattr(cls, "step", None))  # type: ignore[arg-type]
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    path, line = code.co_filename, code.co_firstlineno
    try:
        tree = ast.parse("".join(linecache.getlines(path)))
    except (SyntaxError, ValueError):
        return None
    body = next(
        (
            c
            for c in ast.walk(tree)
            if isinstance(c, ast.ClassDef)
            and c.name == cls.__name__
            and c.lineno <= line <= (c.end_lineno or c.lineno)
        ),
        None,
    )
    if body is None:
        return None
    methods = {
        d.name: d for d in body.body if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    step = methods.get("step")
    if step is None:
        return path, line, []
    used = [step]
    for m in used:  # and the methods those call
        for node in ast.walk(m):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in methods
                and methods[node.attr] not in used
                and isinstance(node.value, ast.Name)
            ):
                used.append(methods[node.attr])
    lines = linecache.getlines(path)
    lines = [ln.rstrip("\n") for ln in lines]
    scopes: list[ast.AST] = []
    for m in used:  # and the functions of the file they call (a Newton-Schulz helper)
        scopes.extend(sc for sc in _scopes_with_callees(tree, m) if sc not in scopes)
    ops: list[tuple[int, str, str, str | None, str]] = []
    for sc in scopes:
        fn = f"{cls.__name__}.{sc.name}" if sc in used else getattr(sc, "name", cls.__name__)
        ops.extend((*op, fn) for op in _zero_ops(sc, lines))
    return path, step.lineno, sorted(set(ops))[:4]


def _own_optimizer_nan(
    ctx: RuleContext,
    a: Anomaly,
    u: _Update | None,
    prev: StepTrace | None,
    gnorm: float | None,
    *,
    name: str,
    evidence: list[str],
) -> Diagnosis | None:
    """An optimizer that is not torch's (a hand-written LAMB, Adafactor, Shampoo) wrote NaN
    from finite gradients and no non-finite state was seen: its step() divided by a norm
    that is 0, or took rsqrt / a negative power of 0, where a weight or its gradient is all
    0 (a zero-initialized head, a parameter the loss does not use, embedding rows no input
    selects). Names the class, its step() and the lines of it that do so, with an eps each.
    None for torch.optim's own classes, an inf, or no update seen."""
    s = a.record.stat
    if u is None or s is None or s.has_posinf or s.has_neginf:
        return None
    cls = _optimizer_class(u.optimizer)
    if cls is None:
        return None
    found = _step_source(cls)
    bad = {r.role for r in ctx.trace.records if r.phase is Phase.PARAMETER and r.bad}
    zero = [
        r.role
        for r in (prev.records if prev is not None else ())
        if r.phase is Phase.GRADIENT
        and r.role in bad
        and r.stat is not None
        and r.stat.finite
        and r.stat.norm == 0
    ]
    zero = list(dict.fromkeys(zero))
    evidence = [*evidence]
    where = f" ({_frames.describe_line(found[0], found[1])[0]})" if found is not None else ""
    who = f"{u.optimizer}.step(){where}"
    evidence.append(
        f"updated at step {u.step} by {who}, a class of your code (not torch.optim), whose "
        "state nanwatch did not find non-finite"
    )
    if zero:
        evidence.append(
            f"{', '.join(zero[:4])}{' and more' if len(zero) > 4 else ''}: gradient norm 0 "
            f"at step {prev.step if prev is not None else u.step}, NaN after the update"
        )
    part = s.counted and bool(s.nan) and (s.nan or 0) < s.numel
    if gnorm is not None and name not in zero and part:
        evidence.append(
            f"{s.nan} of {s.numel} values of {name} are NaN, the others finite: the "
            "entries where the update's denominator was 0 (entries whose gradient was 0, "
            "such as embedding rows no input selected)"
        )
    ops = found[2] if found is not None else []
    short = _frames.describe_line(found[0], 1)[0].rpartition(":")[0] if found else ""
    for num, row, what, _, fn in ops:
        evidence.append(f"{short}:{num}, in {fn}: {row}   ({what}; no eps)")
    if not zero and not ops:
        return None  # nothing says a 0 reached a division: the generic account stands
    explanation = (
        f"{name} was finite when the last step's forward ran and is not now: {who}, your "
        f"own optimizer, wrote NaN into it from finite gradients. A NaN with no inf is not an "
        "overflow: its update divided by a norm that is 0 or took rsqrt / a negative power "
        "of 0 (0/0, or inf × 0), which happens where a weight or its gradient is all 0 (a "
        "zero-initialized layer, a weight the loss does not use, embedding rows no input "
        "selects, a rank-deficient preconditioner). The learning rate is not the cause, and "
        "its running state was not seen non-finite: clearing it will not help. Add an eps "
        "to each such division or root, or guard it with torch.where (a trust ratio of 1 "
        "when a norm is 0)."
    )
    fixes: list[str] = []
    for num, row, what, fixed, _ in ops:
        fixes.append(f"# line {num}: {row}")
        fixes.append(fixed if fixed else f"#   {what}: add an eps there")
    if not fixes:
        fixes.append(
            "# add an eps to each division by a norm and each rsqrt / pow(-k):\n"
            "#   x / (x_norm + 1e-12), (v + 1e-30).rsqrt(), ev.clamp_min(1e-12).pow(-0.25)"
        )
    head = f"# in {u.optimizer}.step(){where}: keep every divisor and root away from 0\n"
    kinds = " ".join(op[2] for op in ops)
    # a ratio of two norms with one 0 is x/0 = inf, then inf × 0 = NaN in the update it
    # scales, or 0/0 when both are: the values seen do not tell which
    what = (
        "a ratio of norms with a norm of 0"
        if "ratio of two norms" in kinds and not ("own norm" in kinds and zero)
        else "0/0"
    )
    return ctx.diagnosis(
        **anomaly_fields(a),
        title=(
            f"Non-finite weights from {u.optimizer}, an optimizer of your code: {what} in its step"
        ),
        evidence=evidence,
        explanation=explanation,
        fix=head + "\n".join(fixes),
    )


def _scaler_bypassed(trace: StepTrace) -> bool:
    """The optimizer stepped at ``trace`` though a GradScaler scaled its loss and a
    gradient it applied was not finite: ``scaler.step(optimizer)`` skips such an update,
    so the optimizer was stepped directly, on gradients still multiplied by the scale."""
    if trace.scale is None or not any(n.kind == "optimizer" for n in trace.notes):
        return False
    return any(
        r.phase is Phase.GRADIENT and r.stat is not None and not r.stat.finite
        for r in trace.records
    )


def _scaled_step(trace: StepTrace) -> bool:
    """The optimizer stepped at ``trace`` on gradients a GradScaler scaled, with neither
    ``scaler.unscale_(optimizer)`` nor ``scaler.step(optimizer)`` run for it (the watcher's
    ``scaled_step`` mark on the ``"optimizer"`` note)."""
    return any(n.kind == "optimizer" and n.data.get("scaled_step") for n in trace.notes)


def _scaled_step_told(ctx: RuleContext) -> bool:
    """An earlier step of the window already had its bypass told: once per run is enough."""
    return any(_scaled_step(t) for t in ctx.history)


def _scaler_name(trace: StepTrace) -> str:
    """The user's name for the GradScaler: the ``X`` of ``X.scale(...)`` in the function
    of this step's lines (``scaler`` when not found)."""
    for source in dict.fromkeys(n.source for n in trace.notes if n.source):
        found = _user_scope(source)
        if found is None:
            continue
        for node in ast.walk(found[2]):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "scale"
                and isinstance(node.func.value, ast.Name)
                and len(node.args) == 1
            ):
                return node.func.value.id
    return "scaler"


def _scaler_bypass_diagnosis(
    ctx: RuleContext,
    a: Anomaly | None,
    prev: StepTrace,
    *,
    name: str | None,
    evidence: list[str],
) -> Diagnosis:
    """NW301 for an optimizer stepped by hand while a GradScaler scales the loss: at the
    first such update (``a`` None: the weights are still finite) or once a weight
    (``name``) overflowed."""
    scale = fmt(prev.scale) if prev.scale is not None else "the scale"
    notes = [n for n in prev.notes if n.kind == "optimizer"]
    marked = [n for n in notes if n.data.get("scaled_step")]
    opt = next((n.path for n in marked or notes), "the optimizer")
    var = _scaler_name(prev)
    names = ctx.memo(prev, "loop_names", _loop_names)
    optim = names.optimizer or "optimizer"
    if _scaled_step(prev):
        how = (
            f"{opt} stepped at step {prev.step} on those gradients with neither "
            f"{var}.unscale_({optim}) nor {var}.step({optim}) run since the last "
            f"{var}.update(): the optimizer was stepped directly"
        )
    else:
        how = (
            f"{opt} stepped at step {prev.step} with non-finite gradients: scaler.step() "
            "skips such an update, so the optimizer was stepped directly"
        )
    evidence = [
        *evidence,
        f"a GradScaler multiplies the loss by {scale}, yet {how} "
        f"({optim}.step(), not {var}.step({optim}))",
    ]
    if name is None:
        tail = (
            "every update applies gradients "
            f"{scale} times too large from the first one: the weights will overflow or the "
            "training diverges, whatever the learning rate."
        )
    else:
        tail = (
            f"every update applied gradients {scale} times too large until {name} "
            "overflowed. The earlier anomaly is this, not the learning rate."
        )
    fields: dict[str, Any] = (
        anomaly_fields(a)
        if a is not None
        else {"phase": "optimizer", "parameter": None, "path": None}
    )
    return ctx.diagnosis(
        **fields,
        title=f"Optimizer stepped with scaled gradients (scale {scale}): GradScaler bypassed",
        evidence=evidence,
        explanation=(
            f"{var}.scale(loss).backward() leaves every gradient multiplied by the scale "
            f"({scale}). {var}.step({optim}) divides them by it first and skips the update "
            f"when one is inf/NaN; {optim}.step() called directly does neither, so " + tail
        ),
        fix=(
            f"{var}.scale(loss).backward()\n"
            f"{var}.step({optim})   # unscales, skips the update when a gradient is inf/NaN\n"
            f"{var}.update()\n"
            f"{optim}.zero_grad()"
        ),
        priority=95,
    )


def _other_rank(
    ctx: RuleContext,
    prev: StepTrace | None,
    rec: Record,
    update: _Update | None,
    gnorm: float | None,
) -> tuple[int, int] | None:
    """This rank and the world size when the update that broke the weight ran in a
    distributed run (the ``"optimizer"`` note's ``rank``/``world``) and every gradient of
    this rank was finite at the end of its backward, which is before DDP's all-reduce
    averages in the other ranks' gradients: a NaN (or an inf this rank's own update could
    not reach) came from another rank's gradient. None otherwise."""
    if prev is None or gnorm is None:
        return None
    world = rank = None
    for n in prev.notes:
        if n.kind == "optimizer" and isinstance(n.data.get("world"), int):
            rank, world = n.data.get("rank"), n.data["world"]
    if not isinstance(world, int) or world < 2 or not isinstance(rank, int):
        return None
    grads = [r for r in prev.records if r.phase is Phase.GRADIENT]
    if not grads or any(r.stat is None or not r.stat.finite for r in grads):
        return None
    s = rec.stat
    if s is not None and (s.has_posinf or s.has_neginf):
        # an overflow: another rank's only when this rank's own step is far from one
        lim = limits(rec.dtype)
        lr = _lr_of(update)
        if lim is None or lr is None or lr * max(gnorm, 1.0) > math.sqrt(lim.max):
            return None
    return rank, world


def _other_rank_diagnosis(
    ctx: RuleContext,
    a: Anomaly,
    u: _Update | None,
    ranks: tuple[int, int],
    gnorm: float | None,
    *,
    name: str,
    evidence: list[str],
) -> Diagnosis:
    """The weights went bad at an update of a distributed run whose gradients were finite
    on this rank until DDP's all-reduce averaged in the other ranks' (README, "Several
    processes"): the rank whose own backward went bad names the cause in its report."""
    rank, world = ranks
    others = [r for r in range(world) if r != rank]
    files = (
        ", ".join(f"-rank{r}-" for r in others)
        if len(others) <= 3
        else f"-rank{others[0]}- to -rank{others[-1]}-"
    )
    opt = u.optimizer if u is not None else "the optimizer"
    step = u.step if u is not None else a.step
    kinds = a.record.stat.kinds() if a.record.stat is not None else "NaN/inf"
    evidence = [e for e in evidence if not e.startswith("its gradient norm at step ")]
    evidence += [
        f"rank {rank} of {world} (torch.distributed): every gradient of this rank was finite "
        f"at the end of its backward at step {step}"
        + (f" ({name}'s norm {fmt(gnorm)})" if gnorm is not None else "")
        + ", before DDP's all-reduce averaged in the other ranks' gradients",
        f"{opt} then wrote {kinds} into {name} at step {step}: the averaged gradient it "
        "applied was not finite",
        f"the other ranks' reports, in the same report directory: {files} in the file name",
    ]
    return ctx.diagnosis(
        **anomaly_fields(a),
        title="Non-finite weights from another rank's gradient (distributed all-reduce)",
        evidence=evidence,
        explanation=(
            f"{name} and this rank's own gradients were finite, yet {opt}'s update made "
            f"{name} non-finite. In a distributed run DDP averages every rank's gradients "
            "after backward (an all-reduce): one rank's NaN/inf gradient, from a bad sample "
            "in its batch or an overflow in its forward, becomes every rank's gradient, and "
            "every rank's weights go bad at the same update. The cause is in the rank whose "
            "own backward went bad, and its report names it. This rank's learning rate and "
            "optimizer state are not the cause (if every rank reports this, look for what "
            "they all share: the checkpoint they loaded)."
        ),
        fix=(
            "# read the other ranks' reports (" + files + " in the file name): the one whose "
            "own backward went bad names the cause\n"
            "# meanwhile skip an update whose averaged gradient is not finite (after DDP's "
            "all-reduce it is the same on every rank, so all ranks skip together):\n"
            "if all(torch.isfinite(p.grad).all() for p in model.parameters() "
            "if p.grad is not None):\n"
            "    optimizer.step()"
        ),
    )


def _written_grad(
    ctx: RuleContext, name: str, prev: StepTrace | None
) -> tuple[str, bool | None, str | None, str, int, str | None] | None:
    """How the gradient of ``name`` that the last update applied came to be, when it was
    not the one nanwatch checked at the end of backward (the watcher's ``"grad_written"``
    note): ``"replaced"`` after backward (``p.grad = ...``) or ``"unchecked"`` (set by
    hand, no backward() gave it); whether it held NaN/inf (None: not read, on an
    accelerator); the line of ``optimizer.step()``; the optimizer; the step; the user's
    name for the optimizer."""
    for t in (prev,) if prev is not None else (ctx.trace, *ctx.history[-1:]):
        for n in reversed(t.notes):
            if n.kind != "grad_written":
                continue
            how = n.data.get("how")
            if not isinstance(how, dict) or name not in how:
                continue
            bad = n.data.get("nonfinite")
            held = None if not isinstance(bad, list) else name in bad
            var = n.data.get("variable")
            var = var if isinstance(var, str) and var.isidentifier() else None
            opt = f"{n.path} ({var})" if var else n.path
            return str(how[name]), held, n.source, opt, t.step, var
    return None


def _user_scope(source: str | None) -> tuple[str, ast.Module, ast.AST] | None:
    """The file, its parsed module and the innermost function holding line ``source``
    (``train.py:42``) of the user's code; the module itself for a line outside any
    function. None when the file cannot be read or parsed."""
    import linecache

    path, _, num = (source or "").rpartition(":")
    if not path or not num.isdigit():
        return None
    try:
        tree = ast.parse("".join(linecache.getlines(path)))
    except (SyntaxError, ValueError):
        return None
    line = int(num)
    scope: ast.AST = tree
    for node in ast.walk(tree):
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.lineno <= line <= (node.end_lineno or node.lineno)
            and node.lineno >= getattr(scope, "lineno", 0)
        ):
            scope = node
    return path, tree, scope


def _scopes_with_callees(tree: ast.Module, scope: ast.AST) -> list[ast.AST]:
    """``scope`` and the functions of the same file it calls by name, and those they call
    (a ``pcgrad(...)`` helper that writes ``.grad``, its projection helper)."""
    defs = {d.name: d for d in tree.body if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef))}
    out = [scope]
    for sc in out:  # grows as it goes: the helpers' helpers too
        for node in ast.walk(sc):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                d = defs.get(node.func.id)
                if d is not None and d not in out and len(out) < 16:
                    out.append(d)
    return out


@dataclass(frozen=True)
class _GradWrite:
    """Where the user's code writes ``.grad`` by hand (``where``: ``file:line``; ``target``:
    ``p.grad``; ``code``: the statement), and a division by a dot product near it (a
    projection: ``divisor`` is ``gj @ gj``, ``division`` the whole ``a / b``)."""

    where: str
    target: str
    code: str
    divisor: str | None = None
    division: str | None = None
    proj_where: str | None = None
    own_divisor: str | None = None
    #: the divisor's value when the source fixes it (a literal, a name the function
    #: assigns a number once), and the numerator's factors (``g``, ``sigma``, ``C``)
    divisor_value: float | None = None
    factors: tuple[str, ...] = ()
    #: written into the tensor backward left in ``.grad`` (``p.grad.copy_(...)``,
    #: ``p.grad.data = ...``, ``p.grad /= n``), not a new tensor assigned to it
    in_place: bool = False
    #: the statement holding the projection's division, that division's divisor guarded
    #: (``ratio = a @ b / (b @ b).clamp_min(1e-12)``); None when it spans lines
    proj_fixed: str | None = None
    #: ``b`` when the divisor is ``b @ b`` / ``torch.dot(b, b)``: its squared norm
    proj_norm_of: str | None = None
    #: an unbiased std/var the written value takes (``g.std()``, ``torch.var(g)``): of a
    #: single element it divides by N - 1 = 0
    spread: str | None = None
    #: the ``for`` loop that holds the write and walks the weights by the name the write
    #: reads ``.grad`` of (``p``): its header (``for p in model.parameters():``), its line
    loop: str | None = None
    loop_where: str | None = None
    #: a name the write reads (``scale`` of ``p.grad.mul_(scale)``) traced to the
    #: assignment that divides by a norm (``scale = max_norm / unitwise_norm(p.grad)``):
    #: that division, its ``file:line``, and the statements with both norms floored
    traced: str | None = None
    traced_where: str | None = None
    traced_fixes: tuple[str, ...] = ()


def _normish(node: ast.AST) -> bool:
    """A call that computes a norm or a mean (``g.norm()``, ``unitwise_norm(p)``): 0 where
    its tensor is all 0."""
    name = _call_name(node)
    return name in _ZERO_DIVISORS or name.lower().endswith("norm")


def _reads_grad(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "grad" for n in ast.walk(node))


def _assigns_above(scope: ast.AST, name: str, before: int) -> list[ast.Assign]:
    """The single-line ``name = ...`` in ``scope`` above line ``before``, the last first
    (each branch of an ``if``)."""
    found = [
        n
        for n in ast.walk(scope)
        if isinstance(n, ast.Assign)
        and len(n.targets) == 1
        and isinstance(n.targets[0], ast.Name)
        and n.targets[0].id == name
        and n.lineno < before
        and n.end_lineno == n.lineno
    ]
    return sorted(found, key=lambda n: -n.lineno)


def _last_assign(scope: ast.AST, name: str, before: int) -> ast.Assign | None:
    """The last single-line ``name = ...`` in ``scope`` above line ``before``."""
    found = _assigns_above(scope, name, before)
    return found[0] if found else None


def _floored(text: str, stmt: ast.stmt, calls: Sequence[tuple[ast.expr, str]]) -> str | None:
    """The single-line ``stmt`` with each call of ``calls`` followed by its floor
    (``.clamp_min(1e-6)``); None when it does not parse."""
    row = text.splitlines()[stmt.lineno - 1]
    fixed = row
    for call, floor in sorted(calls, key=lambda c: -c[0].col_offset):
        hi = call.end_col_offset or call.col_offset
        fixed = fixed[:hi] + f".clamp_min({floor})" + fixed[hi:]
    fixed = fixed[stmt.col_offset : len(fixed) - (len(row) - (stmt.end_col_offset or len(row)))]
    try:
        ast.parse(fixed)
    except SyntaxError:
        return None
    return fixed


def _traced_division(
    text: str, scope: ast.AST, stmt: ast.stmt, target: ast.expr
) -> tuple[str, int, tuple[str, ...]] | None:
    """A name the ``.grad`` write ``stmt`` reads, traced to its assignment in ``scope``
    where it divides by a norm (AGC's ``scale = max_norm / unitwise_norm(p.grad)``): that
    division, its line, and the assignments with the norms floored, the gradient's
    (the divisor) by 1e-6 and a weight's the numerator is made of by 1e-3, as NFNets'
    AGC does (a weight of all 0 would otherwise keep a gradient of 0). None when the
    write reads no such name."""
    tnames = {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    names = [
        n.id
        for n in ast.walk(stmt)
        if isinstance(n, ast.Name) and n.id not in tnames and isinstance(n.ctx, ast.Load)
    ]
    for asg in (a for nm in dict.fromkeys(names) for a in _assigns_above(scope, nm, stmt.lineno)):
        for div in ast.walk(asg.value):
            if not (isinstance(div, ast.BinOp) and isinstance(div.op, ast.Div)):
                continue
            if not _normish(div.right):
                continue
            whole = ast.get_source_segment(text, div)
            if not whole:
                continue
            fixes: list[str] = []
            for ref in dict.fromkeys(
                n.id for n in ast.walk(div.left) if isinstance(n, ast.Name)
            ):  # the numerator's norms of a weight, through their assignment
                up = _last_assign(scope, ref, asg.lineno)
                if up is None:
                    continue
                weights = [
                    (c, "1e-3")
                    for c in ast.walk(up.value)
                    if isinstance(c, ast.Call) and _normish(c) and not _reads_grad(c)
                ]
                if weights:
                    got = _floored(text, up, weights)
                    if got:
                        fixes.append(got)
            own = [
                (c, "1e-3")
                for c in ast.walk(div.left)
                if isinstance(c, ast.Call) and _normish(c) and not _reads_grad(c)
            ]
            got = _floored(text, asg, [*own, (div.right, "1e-6")])
            if got:
                fixes.append(got)
            return whole, asg.lineno, tuple(fixes)
    return None


def _assigned_number(scope: ast.AST, name: str) -> float | None:
    """The number ``name`` is assigned in ``scope`` when every assignment of it there is
    a numeric literal (``B = 32``, ``C, delta, B = 1.0, 1e-5, 32``); None otherwise."""
    found: list[float] = []
    for node in ast.walk(scope):
        if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for tgt in targets:
            pairs: list[tuple[ast.expr, ast.expr | None]] = [(tgt, node.value)]
            if isinstance(tgt, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(tgt.elts, node.value.elts, strict=False))
            for t, v in pairs:
                if not (isinstance(t, ast.Name) and t.id == name):
                    continue
                if (
                    isinstance(node, ast.AugAssign)
                    or not isinstance(v, ast.Constant)
                    or not isinstance(v.value, (int, float))
                    or isinstance(v.value, bool)
                ):
                    return None
                found.append(float(v.value))
    return found[0] if len(set(found)) == 1 else None


def _assigns(scope: ast.AST, name: str) -> bool:
    return any(
        isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store)
        for n in ast.walk(scope)
    )


def _closure_number(tree: ast.AST, scope: ast.AST, name: str) -> float | None:
    """The number ``name`` holds where ``scope`` reads it: assigned in ``scope``, else in
    the innermost enclosing function (a closure) or the module that assigns it."""
    line = getattr(scope, "lineno", 0)
    outer = [
        f
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        and f is not scope
        and f.lineno <= line <= (f.end_lineno or f.lineno)
    ]
    outer.sort(key=lambda f: -f.lineno)  # innermost first
    for sc in (scope, *outer, tree):
        if _assigns(sc, name):
            return _assigned_number(sc, name)
    return None


def _factors(node: ast.expr, text: str) -> tuple[str, ...]:
    """The operands of the products and sums ``node`` is made of (``g``,
    ``torch.randn_like(g)``, ``sigma``, ``C`` for ``g + torch.randn_like(g) * sigma * C``)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add, ast.Sub)):
        return _factors(node.left, text) + _factors(node.right, text)
    seg = ast.get_source_segment(text, node)
    return (seg,) if seg and not isinstance(node, ast.Constant) else ()


_DOT_CALLS = frozenset({"dot", "vdot", "inner"})

#: in-place tensor methods that leave the values as they were or cannot make NaN/inf
_NOT_WRITES = frozenset({"zero_", "detach_", "requires_grad_", "nan_to_num_", "share_memory_"})


def _grad_of(node: ast.expr) -> ast.expr | None:
    """The ``x.grad`` that ``node`` writes into: ``x.grad``, ``x.grad.data``, a subscript of
    either (``x.grad[mask]``); None for anything else."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr == "data":
        node = node.value
    return node if isinstance(node, ast.Attribute) and node.attr == "grad" else None


def _write_of(stmt: ast.stmt) -> tuple[ast.expr, ast.expr | None, ast.expr | None, bool] | None:
    """What statement ``stmt`` writes into a ``.grad``: the ``x.grad`` written, the value
    written (or combined in), the divisor it is divided by in place (``p.grad /= n``,
    ``p.grad.div_(n)``), and whether the write is in place (into the tensor backward left
    there) rather than a new tensor assigned to ``x.grad``. None when it writes none."""
    if isinstance(stmt, ast.Assign):
        for tgt in stmt.targets:
            if isinstance(tgt, ast.Attribute) and tgt.attr == "grad":
                return tgt, stmt.value, None, False
            g = _grad_of(tgt)
            if g is not None:
                return g, stmt.value, None, True
    elif isinstance(stmt, ast.AugAssign):
        g = _grad_of(stmt.target)
        if g is not None:
            div = isinstance(stmt.op, ast.Div)
            return g, None if div else stmt.value, stmt.value if div else None, True
    elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        f = stmt.value.func
        if (
            isinstance(f, ast.Attribute)
            and f.attr.endswith("_")
            and not f.attr.startswith("_")
            and f.attr not in _NOT_WRITES
        ):
            g = _grad_of(f.value)
            args = stmt.value.args
            if g is not None:
                if f.attr == "div_" and args:
                    return g, None, args[0], True
                return g, args[0] if args else None, None, True
    return None


def _squared_norm_of(node: ast.expr, text: str) -> str | None:
    """``b`` when ``node`` is ``b @ b``, ``torch.dot(b, b)``, ``b.dot(b)``: the squared
    norm of ``b``; None otherwise."""
    pair: tuple[ast.expr, ast.expr] | None = None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        pair = (node.left, node.right)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if len(node.args) == 2 and isinstance(node.func.value, ast.Name):
            pair = (node.args[0], node.args[1])  # torch.dot(b, b)
        elif len(node.args) == 1:
            pair = (node.func.value, node.args[0])  # b.dot(b)
    elif isinstance(node, ast.Call) and len(node.args) == 2:
        pair = (node.args[0], node.args[1])  # dot(b, b)
    if pair is None or ast.dump(pair[0]) != ast.dump(pair[1]):
        return None
    return ast.get_source_segment(text, pair[0])


def _guarded_statement(text: str, stmt: ast.stmt, div: ast.BinOp) -> str | None:
    """The single-line statement ``stmt`` with the divisor of ``div`` guarded by
    ``.clamp_min(1e-12)``, as the user wrote the rest of it; None when it spans lines."""
    seg = ast.get_source_segment(text, stmt)
    den = ast.get_source_segment(text, div.right)
    if not seg or not den or "\n" in seg:
        return None
    lines = text.splitlines()
    row = lines[div.right.lineno - 1]
    lo, hi = div.right.col_offset, div.right.end_col_offset
    if hi is None or row[lo:hi] != den or div.right.lineno != stmt.lineno:
        return None
    new = row[:lo] + paren(den) + ".clamp_min(1e-12)" + row[hi:]
    fixed = new[stmt.col_offset : len(new) - (len(row) - (stmt.end_col_offset or len(row)))]
    try:
        ast.parse(fixed)
    except SyntaxError:
        return None
    return fixed


def _is_projection(node: ast.AST) -> bool:
    """``a / (b @ b)``, ``a / torch.dot(b, b)``: a division by a dot product."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)):
        return False
    r = node.right
    if isinstance(r, ast.BinOp):
        return isinstance(r.op, ast.MatMult)
    return isinstance(r, ast.Call) and (
        getattr(r.func, "attr", None) in _DOT_CALLS or getattr(r.func, "id", None) in _DOT_CALLS
    )


def _grad_write(source: str | None) -> _GradWrite | None:
    """The first write into ``.grad`` in the user's function that called
    ``optimizer.step()`` at ``source`` (or in a function of the same file it calls): a new
    tensor assigned (``p.grad = ...``) before one written in place (``p.grad.copy_(...)``,
    ``p.grad.data = ...``, ``p.grad.div_(n)``, ``p.grad[i] = ...``), with the first
    division by a dot product of gradients there when there is one (PCGrad's, A-GEM's
    projection)."""
    found = _user_scope(source)
    if found is None:
        return None
    import linecache

    path, tree, scope = found
    text = "".join(linecache.getlines(path))
    writes: list[tuple[bool, int, int, ast.AST, ast.stmt]] = []
    projs: list[tuple[int, int, ast.BinOp, ast.stmt]] = []
    for k, sc in enumerate(_scopes_with_callees(tree, scope)):
        for stmt in ast.walk(sc):
            if not isinstance(stmt, ast.stmt):
                continue
            w = _write_of(stmt)
            if w is not None:
                writes.append((w[3], k, len(writes), sc, stmt))
            for node in ast.iter_child_nodes(stmt):
                if isinstance(node, ast.stmt):
                    continue  # its own statement
                for sub in ast.walk(node):
                    if isinstance(sub, ast.BinOp) and _is_projection(sub):
                        projs.append((k, sub.lineno, sub, stmt))
    write = None
    for in_place, _, _, sc, stmt in sorted(writes, key=lambda q: (q[0], q[1], q[2])):
        seg = ast.get_source_segment(text, stmt) or ""
        if seg and "\n" not in seg:
            write = (in_place, sc, stmt, seg)
            break
    if write is None:
        return None
    in_place, sc, stmt, code = write
    tgt_node, value, own, _ = _write_of(stmt)  # type: ignore[misc]
    target = ast.get_source_segment(text, tgt_node) or ""
    if not target:
        return None
    den: str | None = None
    known: float | None = None
    factors: tuple[str, ...] = ()
    if own is None and isinstance(value, ast.BinOp) and isinstance(value.op, ast.Div):
        own, factors = value.right, _factors(value.left, text)
    elif own is not None:
        factors = (target,)
    if own is not None:
        den = ast.get_source_segment(text, own)
        known = (
            float(own.value)
            if isinstance(own, ast.Constant)
            and isinstance(own.value, (int, float))
            and not isinstance(own.value, bool)
            else _closure_number(tree, sc, own.id)
            if isinstance(own, ast.Name)
            else None
        )
    loop = _loop_over(sc, stmt, tgt_node)
    traced = _traced_division(text, sc, stmt, tgt_node)
    base = _GradWrite(
        f"{path}:{stmt.lineno}",
        target,
        code,
        own_divisor=den,
        divisor_value=known,
        factors=factors,
        in_place=in_place,
        spread=_unbiased_spread(stmt, text),
        loop=(ast.get_source_segment(text, loop) or "").split("\n", 1)[0] if loop else None,
        loop_where=f"{path}:{loop.lineno}" if loop else None,
        traced=traced[0] if traced else None,
        traced_where=f"{path}:{traced[1]}" if traced else None,
        traced_fixes=traced[2] if traced else (),
    )
    for _, _, div, pstmt in sorted(projs, key=lambda q: (q[0], q[1])):
        whole = ast.get_source_segment(text, div)
        divisor = ast.get_source_segment(text, div.right)
        if whole and divisor and "\n" not in whole:
            return dataclasses.replace(
                base,
                divisor=divisor,
                division=whole,
                proj_where=f"{path}:{div.lineno}",
                proj_fixed=_guarded_statement(text, pstmt, div),
                proj_norm_of=_squared_norm_of(div.right, text),
            )
    return base


_SPREADS = frozenset({"std", "var", "std_mean", "var_mean"})


def _unbiased_spread(stmt: ast.stmt, text: str) -> str | None:
    """The first ``x.std()`` / ``torch.var(x)`` (``std_mean``, ``var_mean`` too) in
    ``stmt`` that keeps torch's default Bessel correction (no ``unbiased=False``, no
    ``correction=0``): of one element it divides by N - 1 = 0. None when there is none."""
    for node in ast.walk(stmt):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if fname not in _SPREADS:
            continue
        kws = {k.arg: k.value for k in node.keywords if k.arg}
        off = kws.get("unbiased") or kws.get("correction")
        if isinstance(off, ast.Constant) and off.value in (False, 0):
            continue
        return ast.get_source_segment(text, node)
    return None


def _loop_over(scope: ast.AST, stmt: ast.stmt, grad: ast.expr) -> ast.For | None:
    """The innermost ``for`` in ``scope`` that holds ``stmt`` and whose target is the name
    whose ``.grad`` it writes (``for p in model.parameters():`` around ``p.grad...``)."""
    owner = grad.value if isinstance(grad, ast.Attribute) else None
    if not isinstance(owner, ast.Name):
        return None
    found: ast.For | None = None
    for node in ast.walk(scope):
        if (
            isinstance(node, ast.For)
            and isinstance(node.target, ast.Name)
            and node.target.id == owner.id
            and node.lineno < stmt.lineno <= (node.end_lineno or node.lineno)
            and (found is None or node.lineno > found.lineno)
        ):
            found = node
    return found


_OPTIMIZERS = frozenset(
    n
    for n in dir(torch.optim)
    if isinstance(getattr(torch.optim, n), type)
    and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
)


def _is_optimizer_call(node: ast.expr) -> bool:
    """``torch.optim.AdamW(...)``, ``optim.SGD(...)``, ``bnb.optim.Adam8bit(...)``."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Name):
        return f.id in _OPTIMIZERS
    return isinstance(f, ast.Attribute) and (
        f.attr in _OPTIMIZERS or "optim" in ast.unparse(f.value).split(".")
    )


@dataclass(frozen=True)
class _LoopNames:
    """The user's names for what a fix pastes into the training loop: the optimizer
    (``opt``) and the weights it updates (``m.parameters()``), read from the user's
    source; the placeholders ``optimizer`` / ``model.parameters()`` when not found."""

    optimizer: str = "optimizer"
    params: str = "model.parameters()"


def _loop_names(trace: StepTrace) -> _LoopNames:
    """The optimizer the user's loop steps and the weights it was built on: a variable
    the watcher saw call ``step()`` (its ``"grad_written"``/``"stale_grads"`` note), else
    the one optimizer assigned (``opt = torch.optim.SGD(m.parameters(), ...)``) in the
    file of this step's lines whose ``.step()`` the function of those lines calls."""
    named = next(
        (
            n.data["variable"]
            for n in trace.notes
            if n.kind in ("grad_written", "stale_grads")
            and isinstance(n.data.get("variable"), str)
            and str(n.data["variable"]).isidentifier()
        ),
        None,
    )
    sources = list(dict.fromkeys(n.source for n in trace.notes if n.source))
    for source in sources:
        found = _user_scope(source)
        if found is None:
            continue
        _, tree, scope = found
        made: dict[str, ast.expr] = {}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and _is_optimizer_call(node.value)
            ):
                made[node.targets[0].id] = node.value
        stepped = {
            node.func.value.id
            for node in ast.walk(scope)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "step"
            and isinstance(node.func.value, ast.Name)
        }
        if named is not None:
            pick = [named]
        else:
            pick = [v for v in made if v in stepped] or (list(made) if len(made) == 1 else [])
        if len(pick) != 1 or (pick[0] not in made and named is None):
            continue
        opt = pick[0]
        call = made.get(opt)
        arg = call.args[0] if isinstance(call, ast.Call) and call.args else None
        if any(
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_param_group"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == opt
            for node in ast.walk(tree)
        ):
            arg = None  # groups added later: the constructor's argument is not all it updates
        if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Name) and arg.func.id == "list":
            arg = arg.args[0] if arg.args else None
        if (
            isinstance(arg, ast.Call)
            and isinstance(arg.func, ast.Attribute)
            and arg.func.attr == "parameters"
            and not arg.args
        ):
            return _LoopNames(opt, ast.unparse(arg))
        return _LoopNames(opt, f'[p for g in {opt}.param_groups for p in g["params"]]')
    if named is not None:
        return _LoopNames(named, f'[p for g in {named}.param_groups for p in g["params"]]')
    return _LoopNames()


def _skip_step(var: str | None) -> str:
    """Pasteable lines that skip the update when a gradient is not finite, in the user's
    name for the optimizer; a comment when that name is not known."""
    if var is None:
        return (
            "# and skip the update when a gradient is not finite: call your optimizer's\n"
            "# step() only if torch.isfinite(p.grad).all() for every p in its param_groups"
        )
    return (
        "# and skip the update when a gradient your code wrote is not finite:\n"
        f"if all(torch.isfinite(p.grad).all() for g in {var}.param_groups "
        'for p in g["params"] if p.grad is not None):\n'
        f"    {var}.step()"
    )


def _written_grad_diagnosis(
    ctx: RuleContext,
    a: Anomaly,
    written: tuple[str, bool | None, str | None, str, int, str | None],
    *,
    name: str,
    evidence: list[str],
) -> Diagnosis:
    """The update applied a gradient the user's code wrote after backward, or set with no
    backward (a PCGrad projection, GradNorm's ``weights.grad = autograd.grad(...)``,
    DP-SGD's clipped and noised sum), which nanwatch's check at the end of backward never
    saw. The fix names the line that wrote ``.grad`` when the user's source shows it."""
    how, held, source, opt, step, var = written
    gw = _grad_write(source)
    if how == "in_place" or (how == "replaced" and gw is not None and gw.in_place):
        # the watcher tells a tensor swapped in and values written into the one backward
        # left apart only by identity; the user's line says which
        made = (
            f"replaced after backward by your code, in place: written into the tensor "
            f"backward left in {name}.grad"
            + (f" ({gw.code})" if gw is not None and gw.in_place else "")
        )
    elif how == "replaced":
        made = (
            f"replaced after backward by your code (a new tensor in {name}.grad)"
            if gw is not None
            else f"replaced after backward by your code ({name}.grad assigned or written in place)"
        )
    else:
        made = (
            "set by your code: no backward() gave it (a gradient assigned to .grad, from "
            "torch.autograd.grad, torch.func or your own code)"
        )
    what = (
        "and it held NaN/inf"
        if held
        else "not read on this device: nanwatch checks gradients at the end of backward"
    )
    evidence = [
        *evidence,
        f"the gradient of {name} that {opt} applied at step {step} was {made}, {what}",
    ]
    if source:
        evidence.append(f"the optimizer step at {source}")
    if gw is not None:
        evidence.append(f"your code writes the gradient at {gw.where}: {gw.code}")
    transformed = _written_under_transform(ctx, step)
    if transformed:
        evidence.append(
            "the model was called under a torch.func transform this step (vmap, grad, "
            "functional_call inside them): nanwatch does not watch those calls, so a NaN/inf "
            "their forward or backward made is first seen in the gradient your code wrote"
        )
    if gw is not None and gw.divisor is not None and gw.division is not None:
        when = (
            f"when {gw.proj_norm_of} is all zeros (its squared norm {gw.divisor} is then 0, "
            "and so is the numerator)"
            if gw.proj_norm_of
            else f"when a gradient in {gw.divisor} is exactly 0"
        )
        cause = (
            "your code computed it after backward with a projection (gradient surgery "
            f"such as PCGrad, A-GEM): {gw.division} at {gw.proj_where} is 0/0 {when}; a "
            "gradient is exactly 0 for a loss masked to 0, a task absent from the batch, an "
            "empty reference memory"
        )
        line = (gw.proj_where or "").rpartition(":")[2]
        head = (
            "# guard the division in your projection: a gradient of 0 gives 0/0\n"
            f"#   / {paren(gw.divisor)}.clamp_min(1e-12)   instead of   / {paren(gw.divisor)}\n"
            + (f"#   line {line}: {gw.proj_fixed}\n" if gw.proj_fixed else "")
        )
    elif gw is not None and gw.spread and _numel_of(ctx, name) == 1:
        return _one_element_spread(ctx, a, gw, name=name, evidence=evidence)
    elif gw is not None and gw.traced and gw.traced_where:
        line = gw.traced_where.rpartition(":")[2]
        evidence.append(f"what it writes is computed at {gw.traced_where}: {gw.traced}")
        cause = (
            f"your code computed it ({gw.code} at {gw.where}) from {gw.traced} (line "
            f"{line}), a division by a norm that is 0 where a gradient is all 0, and 0/0 "
            "where the norm it divides is of a weight that is all 0 too (a zero-initialized "
            "bias, a dead unit)"
        )
        head = (
            f"# line {line}, {gw.traced}, is 0/0 where a gradient is all 0: floor the norms\n"
            + "".join(f"{f}\n" for f in gw.traced_fixes)
            + "# skipping the update on a non-finite gradient is no fix here: the same 0/0\n"
            "# recurs at every step, so every update would be skipped and training stop"
        )
        return ctx.diagnosis(
            **anomaly_fields(a),
            title="Non-finite weights from a gradient your code wrote after backward",
            evidence=evidence,
            explanation=(
                f"{name} became non-finite at the update because the gradient {opt} applied "
                f"held NaN/inf: {cause}. The optimizer, its state and the learning rate are "
                "not the cause."
            ),
            fix=head,
        )
    elif gw is not None:
        cause = (
            f"your code computed it ({gw.code} at {gw.where}) and made NaN/inf there or in a "
            "value it reads: a division by a count or norm that is 0 (an empty batch, a "
            "zero gradient), a log of 0"
        )
        line = gw.where.rpartition(":")[2]
        st = a.record.stat
        den = ""
        if gw.own_divisor and st is not None and (st.has_posinf or st.has_neginf):
            named = ", ".join(gw.factors[:6])
            if gw.divisor_value == 0:
                den = f"# it divides by {gw.own_divisor}, which is 0 there: that gives inf\n"
            elif gw.divisor_value is not None:
                den = (
                    f"# it divides by {gw.own_divisor} = {fmt(gw.divisor_value)}, not 0: the "
                    f"inf is in what it divides ({named or 'the numerator'})\n"
                )
            else:
                den = (
                    f"# it divides by {gw.own_divisor}: inf if that is 0, or if one of "
                    f"{named or 'the numerator'} is inf\n"
                )
        head = (
            f"# line {line}, {gw.code}, wrote the NaN/inf;\n{den}"
            "# check it right after that line, and each value it reads:\n"
            f'assert torch.isfinite({gw.target}).all(), "{gw.target} is not finite"\n'
        )
    else:
        cause = (
            "your code computed it after or instead of backward (gradient surgery, "
            "per-sample clipping and noise, a manual average) and made NaN/inf there: a "
            "division by a count or norm that is 0, a log of 0"
        )
        head = (
            "# the code that sets p.grad made NaN/inf: check it before optimizer.step():\n"
            "#   assert torch.isfinite(p.grad).all()\n"
        )
    if transformed:
        cause += (
            ", or in the gradients it reads, made by the model under torch.func (a 0/0 in a "
            "module's forward on one sample): call the model directly on the same batch, "
            "model(x) and loss.backward(), under nanwatch (mode='forensic' names the op)"
        )
        head = (
            "# the model ran under torch.func (not watched): check its forward and backward\n"
            "# on this batch called directly, e.g. under nanwatch.watch(model, "
            "mode='forensic')\n" + head
        )
    return ctx.diagnosis(
        **anomaly_fields(a),
        title="Non-finite weights from a gradient your code wrote after backward",
        evidence=evidence,
        explanation=(
            f"{name} became non-finite at the update because the gradient {opt} applied "
            + ("held NaN/inf" if held else "was written after backward and never checked")
            + f": {cause}. The optimizer, its state and the learning rate are not the cause."
        ),
        fix=head + _skip_step(var),
    )


def _written_under_transform(ctx: RuleContext, step: int) -> bool:
    """The ``"grad_written"`` note of ``step`` says a watched module was called under a
    torch.func transform that step (per-sample gradients from ``vmap(grad(...))``)."""
    for t in (ctx.trace, *ctx.history[-1:]):
        if t.step == step:
            return any(n.kind == "grad_written" and n.data.get("transformed") for n in t.notes)
    return False


def _numel_of(ctx: RuleContext, name: str) -> int | None:
    """How many elements weight ``name`` has, from the shape of its records."""
    for t in (ctx.trace, *reversed(ctx.history[-1:])):
        for r in t.records:
            if r.role == name and r.phase in (Phase.PARAMETER, Phase.GRADIENT):
                return math.prod(r.shape)
    return None


def _one_element_spread(
    ctx: RuleContext, a: Anomaly, gw: _GradWrite, *, name: str, evidence: list[str]
) -> Diagnosis:
    """The gradient your code wrote takes an unbiased std/var of the weight's gradient, and
    the weight has one element (a learnable temperature, a scalar gate): torch divides by
    N - 1 = 0, so the gradient is NaN at every step. Skipping the update on a non-finite
    gradient would skip every one: the fix leaves 1-element weights out of that loop."""
    line = gw.where.rpartition(":")[2]
    var = gw.target.rpartition(".grad")[0] if gw.target.endswith(".grad") else "p"
    var = var if var.isidentifier() else "p"
    evidence = [
        *evidence,
        f"{name} has 1 element: {gw.spread} of its gradient is the unbiased (N - 1) estimate, "
        "0 / 0 for N = 1",
    ]
    where = (
        f" of that loop (line {gw.loop_where.rpartition(':')[2]}: {gw.loop})"
        if gw.loop and gw.loop_where
        else ""
    )
    return ctx.diagnosis(
        **anomaly_fields(a),
        title="Non-finite weights: your gradient code takes the std of a 1-element weight",
        evidence=evidence,
        explanation=(
            f"{name} has a single element, and your code rewrites its gradient with "
            f"{gw.spread} ({gw.code} at {gw.where}): torch's std and var divide by N - 1 "
            "(Bessel's correction), which is 0 for one element, so the result is NaN at every "
            "step, whatever the gradient. Skipping optimizer.step() when a gradient is not "
            "finite would skip every step and training would silently stop: leave "
            "1-element weights (a learnable temperature or scale, a scalar gate) out of "
            "that normalization. The optimizer and the learning rate are not the cause."
        ),
        fix=(
            f"# line {line}, {gw.code}: {gw.spread} of 1 element divides by N - 1 = 0\n"
            f"# first in the body{where}, skip 1-element weights:\n"
            f"if {var}.numel() <= 1:   # or {var}.dim() <= 1 to skip biases and gains too\n"
            "    continue"
        ),
    )


#: a fix that finds the non-finite entries of the optimizer's per-weight state (Adam's
#: exp_avg/exp_avg_sq, SGD's momentum_buffer) and resets them
_STATE_CHECK = (
    "names = {p: n for n, p in model.named_parameters()}\n"
    "for p, s in optimizer.state.items():   # e.g. right after optimizer.load_state_dict(...)\n"
    "    bad = [k for k, v in s.items() if torch.is_tensor(v) and not torch.isfinite(v).all()]\n"
    "    if bad:\n"
    "        print(names.get(p), bad)\n"
    "        s.clear()   # the optimizer starts this weight's state afresh at its next step"
)


def _normalized(optimizer: str) -> bool:
    """An optimizer that divides each gradient by a running estimate of its own size (Adam
    and its kin, RMSprop, Adagrad, Adadelta): each weight moves by about lr per step
    whatever the gradient's scale, so clipping the gradients does not bound the step."""
    low = optimizer.lower()
    return "adam" in low or low in {"rmsprop", "adagrad", "adadelta", "adafactor"}


def _lr_of(u: _Update | None) -> float | None:
    lrs = _numbers(u.group.get("lr")) if u is not None else []
    return lrs[0] if lrs and math.isfinite(lrs[0]) else None


def _group_of(u: _Update) -> int:
    g = u.group.get("group", 0)
    return g if isinstance(g, int) and not isinstance(g, bool) else 0


def _lr_line(u: _Update, lr: float) -> str:
    """Set the learning rate of the param group that updated the weight, on the user's own
    optimizer (never a new one: its class, groups and state stay)."""
    gi = _group_of(u)
    if u.optimizer == "LBFGS":
        new = 1.0 if lr > 1 else lr / 10  # LBFGS's own default is 1
    elif _normalized(u.optimizer) and lr > 1e-2:
        new = 1e-3  # Adam-family steps are about lr per weight: 1e-5 to 1e-2 is usual
    else:
        new = lr / 10
    return f'optimizer.param_groups[{gi}]["lr"] = {hyper(new)}   # was {hyper(lr)} ({u.optimizer})'


def _master_weights_line(dtype: str, device: str) -> str:
    return (
        f"# or train with float32 weights: model.float(), and {dtype} in the forward only "
        f"(torch.autocast(device_type={device_type(None, device)}, dtype=torch.{dtype}))"
    )


def _plain_update(
    ctx: RuleContext,
    a: Anomaly,
    u: _Update | None,
    gnorm: float | None,
    *,
    name: str,
    evidence: list[str],
    total: float | None = None,
) -> Diagnosis:
    """The optimizer's update wrote the NaN/inf and none of its settings is itself broken:
    what its size says (lr × gradient for SGD, about lr per weight for the Adam family, a
    quasi-Newton step for LBFGS), against the weights' dtype."""
    rec = a.record
    s = rec.stat
    lim = limits(rec.dtype)
    low = low_precision(rec.dtype) is not None
    lr = _lr_of(u)
    overflow = s is None or s.has_posinf or s.has_neginf
    who = "the optimizer step"
    if u is not None:
        rate = hyper(lr) if lr is not None else "?"
        who = f"{u.optimizer} (lr {rate}, param group {_group_of(u)})"
        evidence.append(f"updated at step {u.step} by {who}")
    grad = f" (norm {fmt(gnorm)})" if gnorm is not None else ""
    master = ("\n" + _master_weights_line(rec.dtype, rec.device)) if low else ""
    if not overflow:
        clipped = _clip_overflow(ctx, gnorm, total, rec.dtype, who, name=name, evidence=evidence)
        if clipped is not None:
            return ctx.diagnosis(**anomaly_fields(a), **clipped)
        unseen = _unseen_write(ctx, a, u, gnorm, name=name, evidence=evidence)
        if unseen is not None:  # the update makes no NaN from finite numbers: a .data write
            return unseen
        # NaN and no inf: no value grew past the dtype, so the update's size is not the
        # cause; the update made it from finite numbers, or read it from its state
        rms = u is not None and u.optimizer == "RMSprop" and u.group.get("centered") is True
        explanation = (
            f"{name} was finite when the last step's forward ran and is not now: {who} "
            f"wrote NaN into it from a finite gradient{grad}. A NaN with no inf is not an "
            "overflow, so the learning rate is not too high and clipping will not help: the "
            "update computed 0/0, inf - inf or the square root of a negative number, or read "
            "a NaN from the optimizer's running state (an optimizer.load_state_dict of a "
            "checkpoint saved after a run had gone bad)."
            + (
                " RMSprop(centered=True) takes sqrt(square_avg - grad_avg²), which rounding "
                "makes negative when a gradient barely changes from step to step."
                if rms
                else ""
            )
        )
        fix = (
            f'optimizer.param_groups[{_group_of(u)}]["centered"] = False   '
            "# it was built with centered=True\n"
            if rms and u is not None
            else ""
        ) + _STATE_CHECK
        return ctx.diagnosis(
            **anomaly_fields(a), evidence=evidence, explanation=explanation, fix=fix
        )
    dmax = f" ({rec.dtype} stops at {fmt(lim.max)})" if lim is not None else ""
    famax = s.finite_amax if s is not None and s.finite_amax is not None else 0.0
    if u is not None and u.optimizer == "LBFGS":
        explanation = (
            f"{name} was finite when the last step's forward ran and is not now: {who} "
            "wrote the inf. LBFGS moves the weights by lr × its quasi-Newton direction (the "
            "gradient divided by the curvature it estimated from past steps), whose size the "
            "gradient does not bound; without a line search nothing checks that the step "
            f"lowers the loss, and one step no longer fit in the dtype{dmax}."
        )
        fix = (
            f'optimizer.param_groups[{_group_of(u)}]["line_search_fn"] = "strong_wolfe"   '
            "# a line search picks each step's length"
            + (f"\n{_lr_line(u, lr)}" if lr is not None and lr > 1 else "")
            + master
        )
        return ctx.diagnosis(
            **anomaly_fields(a), evidence=evidence, explanation=explanation, fix=fix
        )
    if u is not None and lr is not None and lim is not None:
        # how far one update can move a weight: about lr for the Adam family (its step is
        # the gradient over its own running size), lr × |g| for SGD (× 10: momentum 0.9)
        step = (
            lr * 10
            if _normalized(u.optimizer)
            else (lr * gnorm * 10 if gnorm is not None else None)
        )
        if step is not None and (famax + step) * 1e3 < lim.max:
            return _unexplained_inf(
                ctx, a, u, name=name, evidence=evidence, step=step, master=master
            )
    if u is not None and _normalized(u.optimizer):
        reach = (
            f" At lr {hyper(lr)} a weight reaches {rec.dtype}'s largest value {fmt(lim.max)} "
            f"in about {fmt(lim.max / lr)} steps."
            if lim is not None and lr
            else ""
        )
        explanation = (
            f"{name} was finite when the last step's forward ran and is not now: {who} "
            f"wrote the inf. {u.optimizer} divides each gradient by a running estimate of "
            "its size, so every step moves each weight by about lr whatever the gradient: "
            f"clipping the gradients does not bound the step, only the lr does.{reach}"
        )
        fix = (
            _lr_line(u, lr) if lr is not None else 'for g in optimizer.param_groups: g["lr"] /= 10'
        ) + master
        return ctx.diagnosis(
            **anomaly_fields(a), evidence=evidence, explanation=explanation, fix=fix
        )
    lr_fix = (
        _lr_line(u, lr)
        if u is not None and lr is not None
        else 'for g in optimizer.param_groups: g["lr"] /= 10   # a learning rate 10 times lower'
    )
    size = (
        f" Each update is lr × gradient: {hyper(lr)} × {fmt(gnorm)} = {fmt(lr * gnorm)} here."
        if lr is not None and gnorm is not None
        else ""
    )
    return ctx.diagnosis(
        **anomaly_fields(a),
        evidence=evidence,
        explanation=(
            f"{name} was finite when the last step's forward ran and is not now: {who} "
            f"wrote the inf, not this step's computation.{size} When the learning rate is "
            "too high for these gradients each update over-corrects, the weights oscillate "
            "with growing amplitude (and their gradients with them), and one update no "
            f"longer fits in the dtype{dmax}. Every layer-level tool blames whichever layer "
            "multiplies by the weight first."
        ),
        fix=(
            "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # before "
            "optimizer.step()\n" + lr_fix + master
        ),
    )


def _clip_overflow(
    ctx: RuleContext,
    gnorm: float | None,
    total: float | None,
    dtype: str,
    who: str,
    *,
    name: str,
    evidence: list[str],
) -> dict[str, Any] | None:
    """A NaN update after gradients so large that the square of their norm overflows the
    dtype, clipped by ``clip_grad_norm_`` between ``backward()`` and ``step()``: torch
    computes the total norm in the gradients' dtype (``foreach`` or not), gets inf, and
    scales every gradient by ``max_norm / (inf + 1e-6)``: NaN for ``max_norm=inf`` (the
    logging idiom), 0 for a finite one. The fields of that diagnosis, else None."""
    lim = limits(dtype)
    sizes = [v for v in (gnorm, total) if v is not None and not math.isnan(v)]
    if lim is None or not sizes or max(sizes) <= math.sqrt(lim.max):
        return None
    clip = None
    for t in (ctx.trace, *reversed(ctx.history[-1:])):
        clip = _clip_before_step(t)
        if clip is not None:
            break
    if clip is None or not clip[2].startswith("clip_grad_norm"):
        return None
    where, max_norm, fname, first = clip
    if max_norm is not None and math.isfinite(max_norm):
        return None  # max_norm / inf is 0: the clip zeroed the gradients, wrote no NaN
    size = max(sizes)
    bound = math.sqrt(lim.max)
    limit = "max_norm=inf" if max_norm is not None else "a max_norm that is inf"
    evidence.append(
        f"gradient norm {fmt(size)} at the end of backward: above {fmt(bound)} = "
        f"sqrt({fmt(lim.max)}), the largest {dtype} whose square fits in {dtype}"
    )
    evidence.append(f"{fname} at {where} runs between backward() and step()")
    params = first or "model.parameters()"
    return {
        "title": "Non-finite weights: the gradient clip's norm overflowed and wrote NaN",
        "evidence": evidence,
        "explanation": (
            f"The gradients exploded (norm {fmt(size)}), and {fname} at {where} turned "
            f"them into NaN before {who} applied them to {name}. It computes the total "
            f"norm in the gradients' dtype ({dtype}, with foreach=True or False alike) "
            "from the squares of the gradients, which overflow: the norm is inf. It then "
            "multiplies every gradient by max_norm / (total_norm + 1e-6), clamped to at "
            f"most 1: with {limit} that is inf / inf = NaN, and every .grad is NaN when "
            "the optimizer reads it. With a finite max_norm the factor is max_norm / inf = "
            "0 instead: no NaN, but the update is silently zeroed. Compute the norm in "
            "float64, where its square fits, clip with a finite max_norm, and find why "
            "the gradients grow this large (a recurrent weight or an init gain too large, "
            "a learning rate too high)."
        ),
        "fix": (
            f"params = [p for p in {params} if p.grad is not None]\n"
            "total = torch.linalg.vector_norm(torch.stack(\n"
            "    [torch.linalg.vector_norm(p.grad, dtype=torch.float64) for p in params]))\n"
            f"print(total.item())   # the norm {fmt(size)}: float64 holds its square\n"
            "coef = (1.0 / (total + 1e-6)).clamp(max=1.0)   # max_norm=1.0, finite\n"
            "for p in params:\n"
            "    p.grad.mul_(coef.to(p.grad.dtype))   # instead of "
            f"{fname}(..., {'inf' if max_norm is not None else 'max_norm'})"
        ),
    }


def _unexplained_inf(
    ctx: RuleContext,
    a: Anomaly,
    u: _Update,
    *,
    name: str,
    evidence: list[str],
    step: float,
    master: str,
) -> Diagnosis:
    """An inf that an update of this size cannot write: the lr and the gradient are
    ordinary, so the update divided by a tiny denominator or read its state."""
    rec = a.record
    lim = limits(rec.dtype)
    assert lim is not None
    evidence.append(
        f"one update of {u.optimizer} at this lr moves a weight by at most about {fmt(step)}: "
        f"far below {rec.dtype}'s largest value {fmt(lim.max)}"
    )
    low = low_precision(rec.dtype) is not None
    return ctx.diagnosis(
        **anomaly_fields(a),
        evidence=evidence,
        explanation=(
            f"{name} was finite when the last step's forward ran and is not now, but an "
            f"update of {u.optimizer} with this learning rate and this gradient is far too "
            "small to overflow: the learning rate is not the cause and clipping will not "
            "help. The update read an inf from the optimizer's running state (an "
            "optimizer.load_state_dict of a checkpoint saved after a run had gone bad)"
            + (
                f", or divided by a second moment that underflowed to 0 in {rec.dtype} "
                "(sqrt(v) + eps with a tiny eps)"
                if low
                else ""
            )
            + "."
        ),
        fix=_STATE_CHECK + master,
    )


def _bad_state(ctx: RuleContext, name: str) -> list[str]:
    """The keys of the optimizer state of weight ``name`` that hold NaN/inf, from the
    watcher's ``"optimizer_state"`` note (``data["optimizer_state_bad"]``: ``[parameter,
    key]`` pairs, read when the non-finite weight was found), this step's or the last's."""
    keys: list[str] = []
    for t in (ctx.trace, *ctx.history[-1:]):
        for n in t.notes:
            if n.kind != "optimizer_state":
                continue
            for pair in n.data.get("optimizer_state_bad", ()):
                if (
                    isinstance(pair, (list, tuple))
                    and len(pair) == 2
                    and pair[0] == name
                    and str(pair[1]) not in keys
                ):
                    keys.append(str(pair[1]))
    return keys


def _bad_state_diagnosis(
    ctx: RuleContext,
    a: Anomaly,
    u: _Update | None,
    keys: list[str],
    *,
    name: str,
    evidence: list[str],
) -> Diagnosis:
    opt = u.optimizer if u is not None else "the optimizer"
    lr = _lr_of(u)
    return ctx.diagnosis(
        **anomaly_fields(a),
        title="Non-finite optimizer state",
        evidence=[
            *evidence,
            f"{opt}'s state for {name} holds NaN/inf: {', '.join(keys)}"
            + (f" (lr {hyper(lr)} is finite)" if lr is not None else ""),
        ],
        explanation=(
            f"{opt} computes each update of {name} from its running state "
            f"({', '.join(keys)}), not from the gradient alone: a NaN or inf there reaches "
            "the weight at every step, whatever the learning rate and the gradient. Such a "
            "state comes from an optimizer.load_state_dict of a checkpoint saved after a "
            "run had gone bad, or from a state that overflowed in float16. Lowering the "
            "learning rate or clipping the gradients does not remove it."
        ),
        fix=_STATE_CHECK,
    )


def _read_bad_at_end(t: StepTrace, name: str) -> Record | None:
    """The record of weight ``name`` that step ``t``'s weight check read non-finite after
    its forward (at the step's end, after its update); None when it read none so."""
    no_forward = _update_without_forward(t)
    return next(
        (
            r
            for r in t.records
            if r.phase is Phase.PARAMETER
            and r.role == name
            and r.bad
            and (no_forward or _after_forward(t, r))
        ),
        None,
    )


def _state_origin(ctx: RuleContext, name: str) -> StepTrace | None:
    """The earliest step of the history whose gradient of weight ``name``, checked before
    its update, was non-finite and was not dropped (no ``grads_dropped`` optimizer note):
    that update put the NaN/inf into the optimizer's running state as well as into the
    weight. None when no step of the history had one."""
    for t in ctx.history:
        bad = any(r.phase is Phase.GRADIENT and r.role == name and r.bad for r in t.records)
        dropped = any(n.kind == "optimizer" and n.data.get("grads_dropped") for n in t.notes)
        if bad and not dropped:
            return t
    return None


def _state_from_grad(
    ctx: RuleContext,
    a: Anomaly,
    u: _Update | None,
    keys: list[str],
    origin: StepTrace,
    *,
    name: str,
    evidence: list[str],
) -> Diagnosis:
    """NW301 for a weight the optimizer's NaN/inf state keeps writing: the state went bad
    when the update of step ``origin`` applied a non-finite gradient; a weight restored
    after it (``w.data[bad] = 0``, ``nan_to_num_``) is written NaN again by the next update
    that reads the state, however many steps later a forward reads it."""
    opt = u.optimizer if u is not None else "the optimizer"
    state = ", ".join(keys)
    g = next(r for r in origin.records if r.phase is Phase.GRADIENT and r.role == name)
    said = f" (see {origin.diagnoses[0].code} at step {origin.step})" if origin.diagnoses else ""
    restored = origin.full and not any(
        r.phase is Phase.PARAMETER and r.role == name and r.bad for r in origin.records
    )
    head, check = _grad_check(ctx, origin)
    return ctx.diagnosis(
        **anomaly_fields(a),
        title="Non-finite optimizer state",
        evidence=[
            # which later update wrote it is not the story: every one since reads the state
            *(e for e in evidence if not e.startswith("its gradient norm at step")),
            f"{opt}'s state for {name} holds NaN/inf: {state}",
            f"the gradient of {name} applied at step {origin.step} was "
            f"{g.stat.kinds() if g.stat else 'non-finite'}{said}: that update wrote it into "
            f"{state} as well as into the weight"
            + (
                f"; {name} was finite at the end of step {origin.step}: restored after that "
                "update, with the state left as it was"
                if restored
                else ""
            ),
        ],
        explanation=(
            f"{opt} computes each update of {name} from its running state ({state}), not "
            f"from the gradient alone. The non-finite gradient it applied at step "
            f"{origin.step} went into that state too, and stays there: restoring the weight "
            "(w.data[bad] = 0, nan_to_num_) does not restore the state, so the next update "
            "that reads it writes NaN/inf into the weight again, however many steps later. "
            "Reset the state with the weight, or skip the update whose gradient is "
            "non-finite so neither is written."
        ),
        fix=(
            "for p in model.parameters():   # where you restore the weights: the state too\n"
            "    s = optimizer.state.get(p, {})\n"
            "    if any(torch.is_tensor(v) and not torch.isfinite(v).all() for v in s.values()):\n"
            "        s.clear()   # the optimizer starts this weight's state afresh\n"
            f"{head}if all({check} for p in model.parameters()\n"
            "       if p.grad is not None):\n"
            "    optimizer.step()   # better: skip updates with NaN/inf gradients"
        ),
    )


def _nan_free_update(u: _Update, writer: dict[str, Any] | None) -> str | None:
    """What ``u``'s update is, when it cannot have made a NaN from the finite gradient it
    applied (:func:`nanwatch._updates.nan_free_update`, on the settings its group had at
    that update and the state read when the weight was found NaN). None otherwise."""
    own = _optimizer_class(u.optimizer) is None
    form = nan_free_update(u.optimizer, u.group, (writer or {}).get("state_finite"), own=own)
    eps = _numbers(u.group.get("eps"))
    return f"{form} (eps {hyper(eps[0])})" if form is not None and eps else form


def _unseen_write(
    ctx: RuleContext,
    a: Anomaly,
    u: _Update | None,
    gnorm: float | None,
    *,
    name: str,
    evidence: list[str],
) -> Diagnosis | None:
    """NW301 for a weight found NaN (no inf) after an update by one of torch's optimizers
    that make no NaN from finite numbers (:func:`_nan_free_update`: SGD, and Adam and its
    kin with eps > 0 and a finite state), from a finite gradient and a finite learning
    rate. Code after ``optimizer.step()`` that moved no version counter wrote it: a write
    through ``.data`` (``w.data /= w.data.norm(...)`` of an all-zero row). None for any
    other optimizer, or when a number it read is not known finite."""
    s = a.record.stat
    lr = _lr_of(u)
    if u is None or s is None or not s.has_nan or s.has_posinf or s.has_neginf:
        return None
    if gnorm is None or not math.isfinite(gnorm) or lr is None or not math.isfinite(lr):
        return None
    form = _nan_free_update(u, _writer(ctx, name))
    if form is None:
        return None
    opt = u.optimizer
    adaptive = opt != "SGD"
    state = "its state, read when the NaN was found, is finite" if adaptive else "a finite state"
    return ctx.diagnosis(
        **anomaly_fields(a),
        title="Non-finite weights written outside an optimizer step",
        evidence=[
            *(e for e in evidence if not e.startswith(("its gradient norm at", "updated at"))),
            f"{opt}'s update at step {u.step}, {form}: from the finite gradient it applied "
            f"(norm {fmt(gnorm)}), lr {hyper(lr)} and {state}, it makes no NaN",
            f"{name}'s version did not move since that update: the write that made the NaN "
            "went through .data (or a tensor sharing its storage), which autograd does not see",
        ],
        explanation=(
            f"{name} was finite when the last step's forward ran and holds NaN now, but {opt} "
            "did not write it: its update only "
            + (
                "divides by numbers of at least its eps"
                if adaptive
                else "multiplies and adds finite numbers"
            )
            + ". Code after optimizer.step() did, through .data: a projection or a "
            "normalization of the weights (w.data /= w.data.norm(dim=1, keepdim=True) is "
            "0/0 = NaN on an all-zero row), a copy from another tensor, a pruning mask, a "
            "manual edit."
        ),
        fix=(
            "optimizer.step()\n"
            "assert all(torch.isfinite(p).all() for p in model.parameters())   # passes: the "
            "NaN is written after it\n"
            "w.data /= w.data.norm(dim=1, keepdim=True).clamp_min(1e-12)   # for a "
            "normalization after the step (w: the weight): no 0/0 on an all-zero row"
        ),
    )


@dataclass
class _Update:
    optimizer: str
    step: int
    group: dict[str, object]


def _last_update(
    ctx: RuleContext,
    dtype: str,
    writer: dict[str, Any] | None = None,
    prev: StepTrace | None = None,
) -> _Update | None:
    """The last optimizer step (its ``"optimizer"`` note) that updated the weight: the
    optimizer and param group the watcher saw update it (``writer``), else one that updated
    weights of this dtype; in ``prev`` first, the step whose update broke it (the note is
    written before the update, so it holds the learning rate that update used, not the one
    a scheduler set since), then in this step or the one before."""
    order = (ctx.trace, *reversed(ctx.history[-1:]))
    if prev is not None:
        order = (prev, *(t for t in order if t is not prev))
    for t in order:
        for n in reversed(t.notes):
            if n.kind != "optimizer":
                continue
            if writer is not None and n.path != writer.get("optimizer"):
                continue
            for g in n.data.get("groups", ()):
                if not isinstance(g, dict):
                    continue
                if writer is not None and g.get("group") != writer.get("group"):
                    continue
                if writer is not None or dtype in g.get("dtypes", ()):
                    return _Update(n.path, t.step, g)
    return None


def _bad_since(
    ctx: RuleContext, name: str, prev: StepTrace | None
) -> tuple[StepTrace, Record, bool] | None:
    """The weight ``name`` was already non-finite before ``prev``'s update (the one NW301
    would blame): the trace, the record and whether it was read at its step's end (after
    that step's update) of the first read of the run of non-finite reads of it that ends
    before that update, step after step. A finite weight leaves no record, so a step of
    that run without one ends it (it may have been read finite there). None when there is
    no such run."""
    if prev is None:
        return None
    at = next((i for i, t in enumerate(ctx.history) if t is prev), len(ctx.history))
    if at == len(ctx.history) and prev is not ctx.trace:
        return None
    first: tuple[StepTrace, Record, bool] | None = None
    for t in (prev, *reversed(ctx.history[:at])):
        no_forward = _update_without_forward(t)
        reads = [
            (r, no_forward or _after_forward(t, r))
            for r in t.records
            if r.phase is Phase.PARAMETER and r.role == name and r.stat is not None
        ]
        if t is prev:
            reads = [(r, end) for r, end in reads if not end]  # read before that update
            if not reads:
                continue  # no read ahead of its forward: the step before tells
        if not reads:
            break
        for r, end in reversed(reads):
            if r.stat is None or r.stat.finite:
                return first
            first = (t, r, end)
    return first


def _kept_since(
    ctx: RuleContext, name: str, writer: dict[str, Any] | None
) -> tuple[StepTrace, Record, bool] | None:
    """No optimizer stepped weight ``name`` since the last check (``writer``, its
    ``"weight_writer"`` note, says none did), and every step since ``bad_since`` read it
    non-finite: nothing wrote it, it stayed so (its optimizer steps less often than the
    others: a GAN's generator, every ``n_critic`` steps). The trace, the record and whether
    it was read at its step's end, of its first non-finite read; None otherwise."""
    if writer is None or writer.get("optimizer") is not None or writer.get("after_optimizer"):
        return None
    since = writer.get("bad_since")
    if isinstance(since, bool) or not isinstance(since, int) or since >= ctx.trace.step:
        return None
    for t in ctx.history:
        if t.step != since:
            continue
        for r in t.records:
            if r.phase is Phase.PARAMETER and r.role == name and r.stat and not r.stat.finite:
                return t, r, _after_forward(t, r) or _update_without_forward(t)
    return None


def _bad_since_diagnosis(
    ctx: RuleContext,
    a: Anomaly,
    since: tuple[StepTrace, Record, bool],
    prev: StepTrace,
    *,
    name: str,
    evidence: list[str],
    updated: bool = True,
) -> Diagnosis:
    """NW301 for a weight that was already non-finite before the update it would blame:
    the steps since kept it so (a NaN weight stays NaN under ``w - lr * g``, a row no batch
    uses gets no gradient), so the cause is where it was first read non-finite. Not
    ``updated``: no optimizer stepped it since ``prev``, the last step, read it so."""
    t, r, at_end = since
    kinds = r.stat.kinds() if r.stat is not None else "non-finite"
    when = (
        f"the end of step {t.step} (read after that step's update)"
        if at_end
        else f"the start of step {t.step} (read before its forward)"
    )
    start = t.step if at_end else t.step - 1
    told = next(
        (
            d
            for h in ctx.history
            if start <= h.step <= prev.step
            for d in h.diagnoses
            if getattr(d, "severity", None) == "error"
        ),
        None,
    )
    more = [f"step {told.step} diagnosed: {told.code} {told.title}"] if told else []
    return ctx.diagnosis(
        **anomaly_fields(a),
        title="Non-finite weights since an earlier step",
        evidence=[
            *evidence,
            f"{name} was already {kinds} at {when}, and at every read of it since",
            *more,
        ],
        explanation=(
            (
                f"{name} held NaN/inf before the update of step {prev.step}, so that update "
                "did not make it"
                if updated
                else f"{name} held NaN/inf at step {prev.step} and no optimizer stepped it "
                "since, so nothing made it now"
            )
            + ": an update keeps a NaN weight NaN (w - lr * g), "
            "and a row no batch uses (an embedding's) gets no gradient to change it. The "
            f"cause is where it was first read non-finite, at step {t.step}"
            + (f" (see {told.code} at step {told.step})" if told else "")
            + ": fix that one. The weights stay non-finite until they are restored."
        ),
        fix=(
            'with nanwatch.watch(model, on_anomaly="raise") as nw:   # stop at the first anomaly\n'
            "    ...\n"
            f"# then resume from a checkpoint saved before step {start}: {name} was finite there"
        ),
        priority=95,
    )


def _after_forward(trace: StepTrace, rec: Record) -> bool:
    """``rec`` (a weight) was recorded after the step's computation, at its end (so this
    step's update broke it), not ahead of its forward."""
    for r in trace.records:
        if r is rec:
            return False
        if r.phase is not Phase.PARAMETER:
            return True
    return False


def _update_without_forward(trace: StepTrace) -> bool:
    """The step ran an optimizer update but no forward (DP-SGD with an empty batch, a
    gradient set by hand): its weights were recorded after that update, which broke them."""
    return all(r.phase is Phase.PARAMETER for r in trace.records) and any(
        n.kind == "optimizer" for n in trace.notes
    )


def _writer(ctx: RuleContext, name: str) -> dict[str, Any] | None:
    """What last wrote the non-finite weight ``name`` (its ``"weight_writer"`` note): the
    optimizer and param group, or ``optimizer: None`` for none."""
    for n in reversed(ctx.trace.notes):
        if n.kind == "weight_writer" and n.data.get("parameter") == name:
            return n.data
    return None


def _written_elsewhere(
    ctx: RuleContext, a: Anomaly, *, name: str, evidence: list[str], after: str | None
) -> Diagnosis:
    """No optimizer step updated the weight (or ``after``, the optimizer that did, left it
    finite and something wrote it again): other code wrote the NaN/inf. When the step's
    records place the write in this step's forward (a data-dependent init, ActNorm's
    ``logs = log(1 / std)``), that is what it says, with the op and line when known."""
    writer = _writer(ctx, name)
    read_by = (writer or {}).get("read_finite_by")
    if after and isinstance(read_by, str) and not (writer or {}).get("op"):
        return _written_between_forwards(
            ctx, a, name=name, evidence=evidence, after=after, read_by=read_by
        )
    how = (
        f"{after} updated {name} and left it finite; "
        + (
            "its tensor was replaced after that update (a .data assignment, which moves no version)"
            if (writer or {}).get("replaced")
            else "it was written again after that update (its version changed)"
        )
        if after
        else f"no optimizer step of the watched run updated {name} since the last check"
    )
    if not after and _finite_at_attach(writer) and not (writer or {}).get("since_attach"):
        how += (
            "; nanwatch's check at attach found it finite, and the write left its version "
            "unchanged (a write through .data or .detach())"
        )
    owner = a.record.path
    op = None if after else _forward_writer_op(ctx, a.record, name)
    if op is None:
        root = _root_path(ctx.trace, owner) or _root_of_name(ctx, name)
        holder, _, note = (_owner_expr(ctx, root) if root else "model").partition("  # ")
        zero = _zero_grad_before(ctx, name, a.record)
        if zero is not None and not (a.record.stat and a.record.stat.has_posinf):
            return _normalized_by_zero(ctx, a, zero, name=name, evidence=[*evidence, how])
        if writer is not None and writer.get("op") and writer.get("op_source"):
            return _written_by_op(ctx, a, writer, name=name, evidence=[*evidence, how])
        if writer is not None and writer.get("nan_rows"):
            return _written_by_rows(
                ctx, a, writer, name=name, holder=holder, evidence=[*evidence, how]
            )
        return ctx.diagnosis(
            **anomaly_fields(a),
            title="Non-finite weights written outside an optimizer step",
            evidence=[*evidence, how],
            explanation=(
                f"{name} became non-finite, and no optimizer updated it: other code wrote it. "
                "An average of weights (an EMA or torch.optim.swa_utils.AveragedModel, whose "
                "avg_fn can divide by 0 at its first update), a load_state_dict of a "
                "checkpoint that holds NaN, an in-place write (p.data.copy_, a pruning mask's "
                "weight_orig), a write in the model's own forward (a data-dependent init), "
                "or a weight tied to another module's. The learning rate is not the cause."
            ),
            fix=(
                "# right after each place that writes weights (an EMA update, a load):\n"
                f"bad = [n for n, p in {holder}.named_parameters() "
                "if not torch.isfinite(p).all()]"
                f"\nassert not bad, bad{f'   # {note}' if note else ''}"
            ),
        )
    leaf = name.rsplit(".", 1)[-1]
    evidence = [
        *evidence,
        how,
        f"{op.op} made {op.born} in {owner}'s forward at {op.source}"
        + (f": {op.code.strip()}" if op.code else "")
        + f" (the line that writes {leaf}), in this step",
    ]
    where = f"{owner}'s forward wrote it at {op.source} ({op.op} made {op.born})"
    expr = _written_expr(op.code, leaf)
    hint = _OP_HINTS.get(op.op.split(".")[1] if "." in op.op else "", "")
    check = expr or f"model.get_parameter({name!r})"
    fix = (
        f"# at {op.source}, in {owner}'s forward: {hint or 'keep what it writes finite'}\n"
        f"assert torch.isfinite({check}).all(), {check + ' non-finite'!r}"
        "   # right after the write"
    )
    return ctx.diagnosis(
        **anomaly_fields(a),
        source=op.source,
        title="Non-finite weights written in the model's forward",
        evidence=evidence,
        explanation=(
            f"{name} became non-finite, and no optimizer updated it: {where}. A "
            "data-dependent init in forward (ActNorm's logs = log(1 / std), a scale set to "
            "1 / std of the first batch) writes NaN/inf when a channel of that batch is "
            "constant (std = 0) and nothing adds an eps. The learning rate is not the cause."
        ),
        fix=fix,
    )


def _written_between_forwards(
    ctx: RuleContext, a: Anomaly, *, name: str, evidence: list[str], after: str, read_by: str
) -> Diagnosis:
    """A forward of this step (of ``read_by``, a module holding the weight) ran with
    ``name`` finite after the last update by ``after``, and no optimizer step ran since:
    code between that forward and this one wrote the NaN/inf in place, outside the
    optimizer and the autograd graph (a finite-difference step ``p.data.add_(v, alpha=R)``,
    a ``copy_`` under no_grad), which moves no version counter nanwatch could see."""
    s = a.record.stat
    what = "NaN" if s is None or s.has_nan else "inf"
    applied = _applied_bad_grad(ctx, a.record, name=name, after=after)
    if applied is not None:
        return _applied_bad_grad_diagnosis(
            ctx, a, applied, name=name, evidence=evidence, after=after, read_by=read_by
        )
    root = _root_path(ctx.trace, a.record.path) or _root_of_name(ctx, name)
    holder, _, note = (_owner_expr(ctx, root) if root else "model").partition("  # ")
    forensic = ctx.facts.get("mode") == "forensic"
    trace_hint = (
        "mode='forensic' traces ops inside the watched modules' forwards only, so it does "
        "not see a write made in the training loop between two forwards"
        if forensic
        else "mode='forensic' names the op and line when the write runs inside a watched "
        "module's forward"
    )
    return ctx.diagnosis(
        **anomaly_fields(a),
        title="Non-finite weights written in place between two forwards, not by an optimizer",
        evidence=[
            *evidence,
            f"{read_by}'s forward ran with {name} finite in step {ctx.step}, after the last "
            f"{after} update of it; no optimizer step ran since",
        ],
        explanation=(
            f"The {what} in {name} was written between that forward and the one that found it, "
            f"by code outside the optimizer and the autograd graph: a .data write "
            "(p.data.add_(v, alpha=r), p.data.copy_(...)) or an in-place op under "
            "torch.no_grad(), as a finite-difference step, a lookahead or a weight backup "
            "and restore do. Such a write moves no version counter and builds no graph. "
            f"{after}'s update and the learning rate are not the cause: look for a scale "
            "that is inf or NaN in that write (r / ||v|| with ||v|| = 0 gives inf, and "
            f"inf * 0 = NaN). {trace_hint[0].upper()}{trace_hint[1:]}."
        ),
        fix=(
            "# right after each in-place write to the weights between forwards (p.data.add_,\n"
            "# copy_ under no_grad): the first one that leaves a non-finite weight\n"
            f"bad = [n for n, p in {holder}.named_parameters() if not torch.isfinite(p).all()]"
            f"\nassert not bad, bad{f'   # {note}' if note else ''}"
        ),
    )


def _applied_bad_grad(
    ctx: RuleContext, rec: Record, *, name: str, after: str
) -> tuple[StepTrace, Record] | None:
    """The last update by the optimizer ``after`` (this step's when the weight ``rec`` was
    found at the step's end, else the last step's) had ``name`` in its param groups and
    applied a gradient of it that was already non-finite: that update wrote the NaN/inf,
    whatever a module's finite output seemed to say. The step and the gradient's record;
    None when the records do not show it."""
    prev = (
        ctx.trace if _after_forward(ctx.trace, rec) else (ctx.history[-1] if ctx.history else None)
    )
    if prev is None:
        return None
    updated = any(
        n.kind == "optimizer"
        and n.path == after
        and any(
            isinstance(g, dict) and name in g.get("names", ()) for g in n.data.get("groups", ())
        )
        for n in prev.notes
    )
    if not updated:
        return None
    g = next((r for r in prev.records if r.phase is Phase.GRADIENT and r.role == name), None)
    if g is None or g.stat is None or g.stat.finite:
        return None
    return prev, g


def _applied_bad_grad_diagnosis(
    ctx: RuleContext,
    a: Anomaly,
    applied: tuple[StepTrace, Record],
    *,
    name: str,
    evidence: list[str],
    after: str,
    read_by: str,
) -> Diagnosis:
    """NW301 for a weight that ``after``'s update wrote non-finite from a non-finite
    gradient, while ``read_by``'s output stayed finite: its forward drops the bad values
    (``torch.where(z > 0, torch.log(z), 0)`` of a NaN ``z`` is 0), so that output does not
    show the weight finite, and no write between forwards is needed to explain it."""
    prev, g = applied
    kinds = g.stat.kinds() if g.stat is not None else "non-finite"
    head, check = _grad_check(ctx, prev)
    return ctx.diagnosis(
        **anomaly_fields(a),
        title="Non-finite weights (a consequence of an earlier anomaly)",
        evidence=[
            *evidence,
            f"the gradient of {name} applied by {after}'s update at step {prev.step} was "
            f"already {kinds}",
            f"{read_by}'s output stayed finite in step {ctx.step} with {name} non-finite: "
            "its forward drops those values (a torch.where or masked_fill discards them) or "
            "does not use them, so that output does not show the weight finite",
        ],
        explanation=(
            f"{name} became non-finite because {after} applied a non-finite gradient at "
            f"step {prev.step}: this is the aftermath of that step's anomaly, not a write "
            "between forwards. Fix that one; skipping updates with non-finite gradients "
            "keeps the weights intact meanwhile."
        ),
        fix=(
            f"{head}if all({check} for p in model.parameters()\n"
            "       if p.grad is not None):\n"
            "    optimizer.step()   # skip updates with NaN/inf gradients"
        ),
        priority=95,
    )


def _written_by_rows(
    ctx: RuleContext,
    a: Anomaly,
    writer: dict[str, Any],
    *,
    name: str,
    holder: str,
    evidence: list[str],
) -> Diagnosis:
    """Weight ``name`` was written outside an optimizer step, and its NaN fill whole rows
    (the watcher's ``nan_rows``), every other row finite: a per-row write divided a row by
    0 (``w / w.norm(dim=1)`` of an all-zero row, a codebook's ``embed_sum / cluster_size``
    of an unused code). The line is not known outside forensic mode: the fix guards the
    row norm of the weight itself, and forensic mode names the line."""
    rows = [int(r) for r in writer["nan_rows"]]
    total = int(writer.get("nan_row_count") or len(rows))
    shape = a.record.shape
    listed = ", ".join(str(r) for r in rows) + (" ..." if total > len(rows) else "")
    its = "its" if total == 1 else "their"
    evidence = [
        *evidence,
        f"the NaN fill {count(total, 'whole row')} of {name} "
        f"({'row' if total == 1 else 'rows'} {listed}"
        + (f" of {shape[0]}" if shape else "")
        + f") and no other row holds one: each value of {its} row went NaN at once, as a "
        "row divided by 0 does",
    ]
    after = writer.get("after_optimizer")
    pad = " (an Embedding's padding_idx row)" if "Embedding" in (a.record.module_type or "") else ""
    w = f"{holder}.get_parameter({name!r})"
    return ctx.diagnosis(
        **anomaly_fields(a),
        title="Non-finite weights: a per-row write outside the optimizer divided a row by 0",
        evidence=evidence,
        explanation=(
            f"{name} became non-finite "
            + (f"after {after} updated it and left it finite" if after else "by no optimizer")
            + ", in code that writes it row by row. A renormalization "
            f"w / w.norm(dim=1, keepdim=True) divides an all-zero row{pad} by its norm 0, "
            "a codebook or centroid mean embed_sum / count an unused code by its count 0: "
            "0 / 0 = NaN for that row alone, and it stays NaN. The learning rate is not the "
            "cause: guard the divisor."
        ),
        fix=(
            f"w = {w}\n"
            "with torch.no_grad():   # in place of your renormalization: guard the norm\n"
            "    w /= w.norm(dim=1, keepdim=True).clamp_min(torch.finfo(w.dtype).eps)\n"
            "# a mean by a count: embed_sum / count.clamp_min(1)\n"
            f"# {_forensic_call(ctx.trace)} names the line that wrote it"
        ),
    )


def _written_by_op(
    ctx: RuleContext, a: Anomaly, writer: dict[str, Any], *, name: str, evidence: list[str]
) -> Diagnosis:
    """Forensic: weight ``name`` was written outside an optimizer step (after one, or with
    none) by the op the ``"weight_writer"`` note names, on the user's line ``op_code``: the
    fix is at that line. A division by a norm (a TransE renormalization ``w / w.norm(dim=1)``
    of an all-zero padding row: 0 / 0) gets the norm guarded in the line's own names."""
    op, source = str(writer["op"]), str(writer["op_source"])
    code = str(writer.get("op_code") or "").strip()
    born = writer.get("op_born") or "NaN/inf"
    after = writer.get("after_optimizer")
    leaf = name.rsplit(".", 1)[-1]
    evidence = [
        *evidence,
        f"{op} made {born} at {source}: {code} "
        + ("(the write after the update)" if after else f"(the line that wrote {leaf})"),
    ]
    guarded = _guard_norms(code) if code else None
    if guarded is not None:
        text, recv, normalize = guarded
        weight = _written_expr(code, leaf) or recv
        rows = weight.removesuffix(".data")
        pad = "Embedding" in (a.record.module_type or "")
        zero = "an all-zero row" + (" (an Embedding's padding_idx row)" if pad else "")
        fix = (
            f"# at {source}: a division by a norm that is 0 for {zero}: 0 / 0 = NaN. "
            "Guard the norm\n"
            f"{text}   # in place of yours\n"
            + (f"# or: {normalize}\n" if normalize else "")
            + (
                f"# or renormalize only the other rows ({rows}[1:] when row 0 is the padding row)"
                if pad
                else ""
            )
        ).rstrip()
        cause = f"it divides by a norm, and {zero} of {name} has norm 0: 0 / 0 = NaN"
    else:
        key = op.split(".")[1] if "." in op else op
        hint = _OP_HINTS.get(key, _OP_HINTS.get(key.rstrip("_"), ""))
        check = _written_expr(code, leaf) or f"model.get_parameter({name!r})"
        fix = (
            f"# at {source}: {hint or 'keep what it writes finite'}\n"
            f"assert torch.isfinite({check}).all(), {check + ' non-finite'!r}"
            "   # right after that line"
        )
        cause = f"{op} on that line made {born}"
    by = f"after {after} updated it and left it finite" if after else "by no optimizer"
    return ctx.diagnosis(
        **anomaly_fields(a),
        source=source,
        title="Non-finite weights written outside an optimizer step",
        evidence=evidence,
        explanation=(
            f"{name} became non-finite {by}: your code at {source} wrote it ({cause}). "
            "The learning rate is not the cause."
        ),
        fix=fix,
    )


#: torch functions that take the tensor whose norm they compute as their first argument
_NORM_FUNCS = {"norm", "vector_norm"}
#: calls that divide their receiver by their first argument
_DIV_CALLS = {"div", "div_", "true_divide", "true_divide_"}
_TORCH_NS = ("torch", "torch.linalg")


def _guard_norms(code: str) -> tuple[str, str, str | None] | None:
    """The user's line with each norm it divides by (``x / w.norm(dim=1, keepdim=True)``,
    ``w.div_(w.norm(...))``, ``torch.linalg.vector_norm(w, ...)``) clamped to the dtype's
    eps, the first norm's tensor, and, when the line is ``w / w.norm(dim=d)``, the same
    line with ``torch.nn.functional.normalize(w, dim=d)``; None when it divides by none."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    divisors: list[ast.expr] = []
    pairs: list[tuple[ast.expr, ast.expr, ast.expr]] = []  # (whole, numerator, divisor)
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            divisors.append(node.right)
            pairs.append((node, node.left, node.right))
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Div):
            divisors.append(node.value)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _DIV_CALLS
            and node.args
        ):
            divisors.append(node.args[-1])
            pairs.append((node, node.func.value if len(node.args) == 1 else node.args[0],
                          node.args[-1]))  # fmt: skip
    norms: list[tuple[ast.Call, ast.expr]] = []
    for d in divisors:
        for n in ast.walk(d):
            of = _norm_of(n) if isinstance(n, ast.Call) else None
            inside = any(_within(n, m) for m, _ in norms)
            if of is not None and isinstance(n, ast.Call) and not inside:
                norms.append((n, of))
    if not norms:
        return None

    def seg(n: ast.AST) -> str:
        return ast.get_source_segment(code, n) or ""

    text = code
    for n, of in sorted(norms, key=lambda x: (x[0].lineno, x[0].col_offset), reverse=True):
        start = _offset(code, n.lineno, n.col_offset)
        end = _offset(code, n.end_lineno or n.lineno, n.end_col_offset or 0)
        guard = f"{seg(n)}.clamp_min(torch.finfo({seg(of)}.dtype).eps)"
        text = text[:start] + guard + text[end:]
    normalize = None
    for whole, num, div in pairs:
        of = _norm_of(div)
        dim = _norm_dim(div) if isinstance(div, ast.Call) else None
        if of is None or dim is None or ast.dump(of) != ast.dump(num):
            continue
        call = f"torch.nn.functional.normalize({seg(num)}, dim={dim})"
        if isinstance(whole, ast.Call) and ast.unparse(whole.func).endswith("_"):
            call = f"{seg(num)}.copy_({call})"
        start = _offset(code, whole.lineno, whole.col_offset)
        end = _offset(code, whole.end_lineno or whole.lineno, whole.end_col_offset or 0)
        normalize = code[:start] + call + code[end:]
        break
    return text, seg(norms[0][1]), normalize


def _norm_of(node: ast.AST) -> ast.expr | None:
    """The tensor whose L2 norm ``node`` computes (``w.norm(...)``, ``torch.norm(w, ...)``,
    ``torch.linalg.vector_norm(w, ...)``), or None."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return None
    f = node.func
    if f.attr not in _NORM_FUNCS:
        return None
    if ast.unparse(f.value) in _TORCH_NS:
        return node.args[0] if node.args else None
    return f.value if f.attr == "norm" else None


def _norm_dim(call: ast.Call) -> str | None:
    """The ``dim`` of an L2 norm call, as source, when it is one (``p`` absent or 2)."""
    kw = {k.arg: ast.unparse(k.value) for k in call.keywords if k.arg}
    func = call.func
    method = not (isinstance(func, ast.Attribute) and ast.unparse(func.value) in _TORCH_NS)
    args = [ast.unparse(x) for x in call.args[0 if method else 1 :]]
    p = kw.get("p", kw.get("ord", args[0] if args else None))
    dim = kw.get("dim", args[1] if len(args) > 1 else None)
    return dim if p in (None, "2", "2.0") else None


def _within(node: ast.AST, outer: ast.AST) -> bool:
    """Whether ``node`` is ``outer`` or inside it."""
    return any(n is node for n in ast.walk(outer))


def _offset(code: str, line: int, col: int) -> int:
    """The character offset in ``code`` of an AST (line, UTF-8 column) position."""
    lines = code.splitlines(keepends=True)
    before = sum(len(s) for s in lines[: line - 1])
    return before + len(lines[line - 1].encode()[:col].decode(errors="ignore"))


def _zero_grad_before(ctx: RuleContext, name: str, rec: Record) -> float | None:
    """The step's total gradient norm (0 when unknown) when the last backward before weight
    ``name`` was found non-finite (``rec``) gave it a gradient of norm exactly 0, its
    forward and backward clean: this step's, or the last step's when it was found ahead of
    this step's forward. None otherwise."""
    trace = ctx.trace
    if rec.index < 0 and ctx.history and ctx.history[-1].anomaly is None:
        trace = ctx.history[-1]
    grads = _clean_grads(trace, name, rec)
    found = grads[-1] if grads else None
    if found is None or found.stat is None or found.stat.norm != 0 or not found.stat.finite:
        return None
    total = trace.grad_norm
    return total if total is not None and math.isfinite(total) else 0.0


def _normalized_by_zero(
    ctx: RuleContext, a: Anomaly, total: float, *, name: str, evidence: list[str]
) -> Diagnosis:
    """No optimizer wrote the NaN, and the backward just before it gave the weight a
    gradient of norm 0: code that scales by 1 / the gradient's norm (SAM's perturbation
    ``e_w = rho * g / ||g||``, a normalized-gradient step, LARS) computed 0/0."""
    losses = [t.loss for t in (ctx.trace, *ctx.history[-1:]) if t.loss is not None]
    at_min = (
        f" (the loss was {fmt(losses[0])}: nothing left to learn on this batch)"
        if (losses and losses[0] == 0)
        else ""
    )
    evidence = [
        *evidence,
        f"the backward just before it gave {name} a gradient of norm 0"
        + (f", and every watched weight too (total norm {fmt(total)})" if total == 0 else "")
        + at_min,
    ]
    return ctx.diagnosis(
        **anomaly_fields(a),
        title="Non-finite weights: an update outside the optimizer divided by a gradient norm of 0",
        evidence=evidence,
        explanation=(
            f"{name} became non-finite in a write outside any optimizer step, right after a "
            f"backward that gave it a gradient of exactly 0{at_min}. Code that moves the "
            "weights by the gradient divided by its norm (SAM's first step e_w = rho * g / "
            "||g||, a normalized-gradient or LARS-style update) computes 0 / 0 = NaN there. "
            "The learning rate is not the cause: add an eps to that norm."
        ),
        fix=(
            "# where your code divides by the gradient's norm (SAM's first_step):\n"
            "#   scale = rho / (grad_norm + 1e-12)   instead of   rho / grad_norm\n"
            "#   e_w = g / (g.norm() + 1e-12)        instead of   g / g.norm()"
        ),
    )


#: a module's output that grew this many times in one step while its input did not (by
#: more than ``_STEADY``) was made by weights that grew so
_GROWN = 1e3
_STEADY = 10.0


@dataclass(frozen=True)
class _Grown:
    """A watched module whose weights grew by orders of magnitude in one step while no
    optimizer updated them: its path, its root's, its output's size before and now, its
    input's, and the optimizers that did step (what they update)."""

    path: str
    root: str
    before: float
    now: float
    inp: float
    step: int
    optimizers: tuple[str, ...]


def _amax(stat: Any) -> float | None:
    if stat is None or not stat.finite:
        return None
    return float(max(abs(stat.min), abs(stat.max)))


def _root_path(trace: StepTrace, path: str) -> str | None:
    """The watched root whose call encloses the call of ``path``."""
    calls = {c.id: c for c in trace.calls}
    for c in trace.calls:
        if c.path != path:
            continue
        cur = c
        for _ in range(256):
            if cur.root or cur.parent is None or cur.parent not in calls:
                break
            cur = calls[cur.parent]
        return cur.path if cur.root else None
    return None


def _updated_names(traces: Sequence[StepTrace]) -> tuple[set[str], tuple[str, ...]]:
    """The parameter names the optimizers of ``traces`` updated, and those optimizers."""
    names: set[str] = set()
    opts: list[str] = []
    for t in traces:
        for n in t.notes:
            if n.kind != "optimizer":
                continue
            opts.append(n.path)
            for g in n.data.get("groups", ()):
                if isinstance(g, dict):
                    names.update(str(x) for x in g.get("names", ()))
    return names, tuple(dict.fromkeys(opts))


def _grown_outside(ctx: RuleContext, a: Anomaly) -> _Grown | None:
    """The anomaly was born in a forward, and a module of a root that no optimizer steps
    gave an output this step orders of magnitude (``_GROWN``) above its output of an
    earlier step of the history, from an input of about the same size (within
    ``_STEADY``): its weights grew so. The root is the anomaly's own, or the root whose
    output the anomaly's call read (an EMA copy's prediction overflowing in the loss). None
    of that root's parameters is one an optimizer of those steps updated (the optimizer
    notes name what each updates): they were written outside an optimizer step (an EMA or
    averaged copy with a decay past 1, a manual write). An output seen only every few
    steps (a copy evaluated every k steps) is compared with its earliest size in the
    history when it grew at each sighting between."""
    if a.record.phase is not Phase.FORWARD or not ctx.history:
        return None
    trace, prev = ctx.trace, ctx.history[-1]
    names, opts = _updated_names((prev, trace))
    if not opts:
        return None  # no optimizer seen: which weights one updates is not known
    roots = [_root_path(trace, a.path)]
    for r in trace.records:
        src = r.source if r.call == a.record.call and r.phase is Phase.INPUT else None
        if src is not None and 0 <= src < len(trace.records):
            roots.append(_root_path(trace, trace.records[src].path))
    # then any root that ran before it (its output sliced or reshaped by the user's code
    # on its way to the op that overflowed)
    roots += [c.path for c in trace.calls if c.root and c.start <= a.record.index]
    for root in dict.fromkeys(x for x in roots if x is not None):
        ids = {c.id for c in trace.calls if c.root and c.path == root}
        children = {c.path for c in trace.calls if c.parent in ids}
        if not children or any(n.startswith(c + ".") for n in names for c in children):
            continue  # no weights below it, or an optimizer updates weights of this root
        found = _grown_in(ctx, a, root, opts)
        if found is not None:
            return found
    return None


def _outputs_of(trace: StepTrace, path: str) -> tuple[float | None, float | None] | None:
    """The largest |x| of ``path``'s last output in ``trace`` and of its first input then;
    None when the step recorded no measured output of it."""
    out = None
    for r in trace.records:
        if r.phase is Phase.FORWARD and r.role == "output" and r.path == path and r.stat:
            out = r
    if out is None:
        return None
    inp = next(
        (
            _amax(trace.resolve(i).stat)
            for i in trace.records
            if i.phase is Phase.INPUT and i.path == path and i.role == "input[0]"
        ),
        None,
    )
    return _amax(out.stat), inp


def _grown_in(ctx: RuleContext, a: Anomaly, root: str, opts: tuple[str, ...]) -> _Grown | None:
    """A module of ``root`` whose output this step is ``_GROWN`` times its size at an
    earlier step of the history (see :func:`_grown_outside`), from an input as large."""
    trace = ctx.trace
    for r in trace.records:
        if r.index > a.record.index:
            break
        if r.phase is not Phase.FORWARD or r.role != "output" or r.stat is None:
            continue
        if r.path == root or _root_path(trace, r.path) != root:
            continue
        now, inp = _outputs_of(trace, r.path) or (None, None)
        if now is None or inp is None:
            continue
        seen = [(t.step, o) for t in ctx.history if (o := _outputs_of(t, r.path)) is not None]
        steady = [
            (st, out)
            for st, (out, x) in seen
            if out and x is not None and inp <= _STEADY * x and x <= _STEADY * inp
        ]
        if not steady:
            continue
        if now >= _GROWN * steady[-1][1]:
            st, before = steady[-1]  # in one step, or since its last sighting
        else:
            sizes = [out for _, out in steady] + [now]
            if len(steady) < 2 or now < _GROWN * sizes[0]:
                continue
            if any(b <= x for x, b in itertools.pairwise(sizes)):
                continue  # not a growth at every sighting: training, not a runaway average
            st, before = steady[0]
        return _Grown(r.path, root, before, now, inp, st, opts)
    return None


def _grown_outside_diagnosis(ctx: RuleContext, a: Anomaly, g: _Grown) -> Diagnosis:
    target = _owner_expr(ctx, g.root)
    if target == "model":
        # ``model`` is what the optimizer steps; this root is another one (its EMA copy)
        target = f"module  # module: the watched {g.root}"
    expr, _, note = target.partition("  # ")
    gap = ctx.step - g.step
    evidence = [
        f"{g.path}'s output reached {fmt(g.now)} at step {ctx.step}, from {fmt(g.before)} at "
        f"step {g.step}, for an input of about the same size ({fmt(g.inp)}): its weights "
        + (
            f"grew about {fmt(g.now / g.before)}x in one step"
            if gap <= 1
            else f"grew about {fmt(g.now / g.before)}x in {gap} steps "
            f"(x{fmt((g.now / g.before) ** (1 / gap))} per step: an average whose decay is "
            "past 1 grows so)"
        ),
        f"no optimizer updated {g.root}'s weights ({', '.join(g.optimizers)} update "
        "other parameters): they were written outside an optimizer step",
        f"then: {a.summary}" if a.summary else f"then the forward of {a.path} overflowed",
    ]
    return ctx.diagnosis(
        **anomaly_fields(a),
        op=a.op.op if a.op is not None else None,
        title="Weights written outside an optimizer step grew until the forward overflowed",
        priority=9,
        evidence=evidence,
        explanation=(
            f"The weights of {g.root} grew by orders of magnitude between two steps, and no "
            "optimizer updates them: code outside an optimizer step wrote them (an EMA or "
            "teacher update p_ema.mul_(d).add_(p, alpha=1 - d) with a decay d outside "
            "[0, 1], a manual copy or rescale under no_grad). Its forward then overflowed. "
            "Gradient clipping and the learning rate do not touch these weights: fix the "
            "write."
        ),
        fix=(
            f"# right after the code that writes {g.root}'s weights (an EMA update: its "
            "decay must be in [0, 1])\n"
            f"big = [n for n, p in {expr}.named_parameters() if not p.abs().max() < 1e4]\n"
            "assert not big, big" + (f"   # {note}" if note else "")
        ),
    )


#: what to do about a forward op that made a weight's NaN/inf, by its aten name
_OP_HINTS = {
    "reciprocal": "a division by 0: add an eps to the divisor (x + 1e-6)",
    "div": "a division by 0: add an eps to the divisor (x + 1e-6)",
    "log": "a log of 0: clamp its argument (x.clamp_min(1e-6))",
    "rsqrt": "a 1 / sqrt(0): add an eps under the root (x + 1e-6)",
}


def _forward_writer_op(ctx: RuleContext, rec: Record, name: str) -> Any:
    """The op of this step's forward that made the NaN/inf written into weight ``name``:
    the first op (``trace.ops``, forensic) that created one inside the weight's owner
    module, on a line that names the weight's attribute (``self.logs.data.copy_(...)``).
    None when the step recorded no such op."""
    leaf = name.rsplit(".", 1)[-1]
    pat = re.compile(rf"\b{re.escape(leaf)}\b")
    for op in ctx.trace.ops:
        if op.phase is not Phase.FORWARD or not op.born or op.injected:
            continue
        if op.path != rec.path or not op.source:
            continue
        return op if op.code and pat.search(op.code) else None
    return None


def _written_expr(code: str | None, leaf: str) -> str | None:
    """How the user's line names the weight it writes (``self.logs``), or None."""
    if not code:
        return None
    m = re.search(rf"((?:\w+\.)*{re.escape(leaf)})\b", code)
    return m.group(1) if m and "." in m.group(1) else None


def _finite_at_attach(writer: dict[str, Any] | None) -> bool | None:
    """Whether nanwatch's check at attach read the weight and found it finite (the
    ``"weight_writer"`` note's ``finite_at_attach``); None when the note does not say."""
    v = writer.get("finite_at_attach") if writer is not None else None
    return v if isinstance(v, bool) else None


def _used_grad(trace: StepTrace, name: str, before: Record | None) -> float | None:
    """The norm of the last finite, non-zero gradient of weight ``name`` in ``trace``, when
    every record up to it (and up to ``before``, when given) is finite: the step's forward
    and backward used the weight while it was finite. None otherwise."""
    grads = _clean_grads(trace, name, before)
    if grads is None:
        return None
    found: float | None = None
    for r in grads:
        s = r.stat
        if s is not None and s.finite:
            size = s.norm if s.norm is not None else max(abs(s.min), abs(s.max))
            found = size if size > 0 else found
    return found


def _clean_grads(trace: StepTrace, name: str, before: Record | None) -> list[Record] | None:
    """The gradient records of weight ``name`` in ``trace`` up to ``before`` (the whole
    step when None), in order; None when a record up to there is not finite (weights'
    records aside): the forward and backward that made them were clean."""
    out: list[Record] = []
    for r in trace.records:
        if r is before:
            break
        if r.phase is Phase.PARAMETER:
            continue
        if r.bad:
            return None
        if r.phase is Phase.GRADIENT and r.role == name:
            out.append(r)
    return out


def _hand_written(
    ctx: RuleContext, rec: Record, name: str, writer: dict[str, Any] | None
) -> tuple[StepTrace, float] | None:
    """A hand-written update (``p -= lr * p.grad``, ``p.data.add_(p.grad, alpha=-lr)``)
    wrote the weight: no optimizer updated it, and the write landed after a backward that
    gave it a finite, non-zero gradient, the forward and backward before it clean. The
    step that used it and the gradient's norm; None when that is not what the records say.
    """
    if writer is None or writer.get("optimizer") is not None or writer.get("after_optimizer"):
        return None
    if _finite_at_attach(writer) is False:
        return None  # already bad when nanwatch's check at attach read it
    if _after_forward(ctx.trace, rec):  # found at this step's end: written after its backward
        g = _used_grad(ctx.trace, name, rec)
        return (ctx.trace, g) if g is not None else None
    if rec.index >= 0:
        return None
    # found ahead of this step's records, at a trigger: a write through .data changes no
    # version, so the steps do not advance; the records before the trigger (the first bad
    # one) show the weight used while finite, and its gradient
    trigger = next((r for r in ctx.trace.records if r.phase is not Phase.PARAMETER and r.bad), None)
    if trigger is not None:
        g = _used_grad(ctx.trace, name, trigger)
        if g is not None:
            return ctx.trace, g
        return None
    if ctx.history and ctx.history[-1].anomaly is None:  # written after the last backward
        g = _used_grad(ctx.history[-1], name, None)
        if g is not None:
            return ctx.history[-1], g
    return None


def _hand_update(
    ctx: RuleContext,
    a: Anomaly,
    used: tuple[StepTrace, float],
    *,
    name: str,
    evidence: list[str],
) -> Diagnosis:
    """The weights' own training update, written by hand, wrote the NaN/inf."""
    trace, gnorm = used
    rec = a.record
    s = rec.stat
    lim = limits(rec.dtype)
    evidence.append(
        f"no torch.optim step updated {name}; it was written after the backward of step "
        f"{trace.step}, which gave it a finite gradient (norm {fmt(gnorm)}): a hand-written "
        "update (p -= lr * p.grad)"
    )
    norms = [
        (t.step, r.stat.norm)
        for t in (*ctx.history, ctx.trace)
        for r in t.records
        if r.phase is Phase.GRADIENT
        and r.role == name
        and r.stat is not None
        and r.stat.norm is not None
        and r.stat.finite
        and r.stat.norm > 0
    ]
    grew = len(norms) >= 3 and norms[-1][1] > 10 * norms[0][1]
    if grew:
        steps = f" (steps {norms[0][0]} to {norms[-1][0]})" if norms[0][0] != norms[-1][0] else ""
        evidence.append(
            f"its gradient norm grew from {fmt(norms[0][1])} to {fmt(norms[-1][1])} over "
            f"{len(norms)} backward passes{steps}"
        )
    low = low_precision(rec.dtype) is not None
    master = ("\n" + _master_weights_line(rec.dtype, rec.device)) if low else ""
    overflow = s is None or s.has_posinf or s.has_neginf
    head = (
        f"{name} was finite when step {trace.step}'s forward and backward used it, and no "
        "optimizer updated it: the code that updates the weights by hand wrote the "
        f"{'inf' if overflow else 'NaN'}."
    )
    if overflow:
        dmax = f" ({rec.dtype} stops at {fmt(lim.max)})" if lim is not None else ""
        explanation = (
            f"{head} Its learning rate is too high for these gradients: each update "
            "over-corrects, the weights oscillate with growing amplitude"
            + (" (their gradients with them)" if grew else "")
            + f", and one update lr × p.grad no longer fits in the dtype{dmax}."
        )
        fix = (
            "# your update p -= lr * p.grad: make lr 10 times lower, and clip before it:\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)" + master
        )
    else:
        explanation = (
            f"{head} A NaN with no inf is not an overflow: the update's own arithmetic made "
            "it from a finite gradient (a learning rate that is NaN, a division by 0 in it)."
        )
        fix = (
            "# right after your update (p -= lr * p.grad), the first weight it broke:\n"
            "bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]\n"
            "assert not bad, bad"
        )
    return ctx.diagnosis(
        **anomaly_fields(a),
        title="Non-finite weights after a hand-written update",
        evidence=evidence,
        explanation=explanation,
        fix=fix,
    )


@dataclass(frozen=True)
class _LrDivision:
    """A division in the user's learning-rate schedule (the code that writes
    ``g["lr"] = ...``) whose divisor can be 0: ``where`` (``file:line``), the function,
    the line, the divisor's source, the values of the names in it (when read), whether it
    is 0 now, and the line with the divisor kept at 1 or more (None when that does not
    parse)."""

    where: str
    func: str
    code: str
    divisor: str
    values: tuple[tuple[str, float], ...]
    zero: bool
    fixed: str | None


_ARITH = {ast.Add: float.__add__, ast.Sub: float.__sub__, ast.Mult: float.__mul__}


def _read_number(node: ast.expr, ns: dict[str, Any], seen: dict[str, float]) -> float | None:
    """The value of a divisor made of names, attributes, numbers, ``+ - *``, read from
    ``ns`` without running any code of the user's (attributes through ``vars``); the names
    read go to ``seen``. None when it is made of anything else or a name is not there."""
    if isinstance(node, ast.Constant):
        v = node.value
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        x = _read_number(node.operand, ns, seen)
        return None if x is None else (-x if isinstance(node.op, ast.USub) else x)
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        lhs, rhs = _read_number(node.left, ns, seen), _read_number(node.right, ns, seen)
        if lhs is None or rhs is None:
            return None
        return _ARITH[type(node.op)](lhs, rhs)
    if isinstance(node, (ast.Name, ast.Attribute)):
        value: Any
        if isinstance(node, ast.Name):
            if node.id not in ns:
                return None
            value = ns[node.id]
        else:
            base = node.value
            if not isinstance(base, ast.Name) or base.id not in ns:
                return None
            try:
                value = vars(ns[base.id]).get(node.attr)
            except TypeError:  # no __dict__
                return None
        if isinstance(value, bool) or (
            isinstance(value, torch.Tensor) and (value.numel() != 1 or value.device.type != "cpu")
        ):
            return None  # a CUDA tensor is not read: no sync
        try:
            number = float(value)  # an int, a float, a numpy scalar, a CPU scalar tensor
        except (TypeError, ValueError, RuntimeError):
            return None
        if not math.isfinite(number):
            return None
        seen[ast.unparse(node)] = number
        return number
    return None


def _count_divisor(node: ast.expr) -> bool:
    """A divisor that is a count or a difference of two (``warmup_steps``,
    ``total - warmup``, ``self.total_steps - self.warmup``): names, attributes and whole
    numbers joined by ``+ - *``, with at least one name. Not a guarded ``max(1, n)``."""
    names = False
    for sub in ast.walk(node):
        if isinstance(sub, (ast.Name, ast.Attribute)):
            names = True
        elif isinstance(sub, ast.Constant):
            if not isinstance(sub.value, int) or isinstance(sub.value, bool):
                return False
        elif not isinstance(
            sub,
            (ast.BinOp, ast.UnaryOp, ast.Load, ast.Add, ast.Sub, ast.Mult, ast.USub, ast.UAdd),
        ):
            return False
    return names


def _writes_lr(node: ast.AST) -> bool:
    """``node`` holds a write of a param group's learning rate: ``g["lr"] = ...``."""
    for sub in ast.walk(node):
        targets = (
            sub.targets
            if isinstance(sub, ast.Assign)
            else [sub.target]
            if isinstance(sub, ast.AugAssign)
            else []
        )
        for t in targets:
            if (
                isinstance(t, ast.Subscript)
                and isinstance(t.slice, ast.Constant)
                and t.slice.value == "lr"
            ):
                return True
    return False


def _own_names(scope: ast.AST) -> set[str]:
    """The names ``scope`` binds itself: its arguments and the names it assigns."""
    out: set[str] = set()
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = scope.args
        out |= {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
        out |= {x.arg for x in (a.vararg, a.kwarg) if x is not None}
    for sub in ast.walk(scope):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
            out.add(sub.id)
    return out


def _lr_divisions() -> list[_LrDivision]:
    """The divisions by a count or a difference of counts (``total_steps -
    warmup_steps``) in the user's learning-rate schedule: the functions of the files of the
    running user frames that write ``g["lr"] = ...``, and the functions of their file they
    call. Those whose divisor reads 0 now come first; [] when none is found (no user frame
    on the stack: a report read later)."""
    import linecache

    frames: list[Any] = []
    f = _frames.user_frame(sys._getframe(1))
    while f is not None and len(frames) < 32:
        frames.append(f)
        f = _frames.user_frame(f.f_back)
    out: list[_LrDivision] = []
    done: set[str] = set()
    for frame in frames:
        path = frame.f_code.co_filename
        if path in done:
            continue
        done.add(path)
        lines = [ln.rstrip("\n") for ln in linecache.getlines(path)]
        try:
            tree = ast.parse("\n".join(lines))
        except (SyntaxError, ValueError):
            continue
        writers: list[ast.AST] = [
            d
            for d in ast.walk(tree)
            if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)) and _writes_lr(d)
        ]
        # the innermost functions that write it (not the function that holds one)
        writers = [d for d in writers if not any(w is not d and w in ast.walk(d) for w in writers)]
        if not writers and _writes_lr(tree):  # a script's top-level loop writes it
            writers = [s for s in tree.body if _writes_lr(s)]
        scopes: list[ast.AST] = []
        for w in writers:
            scopes.extend(sc for sc in _scopes_with_callees(tree, w) if sc not in scopes)
        live = {id(fr.f_code): fr for fr in frames if fr.f_code.co_filename == path}
        for sc in scopes:
            func = getattr(sc, "name", "<module>")
            ns = dict(frame.f_globals)
            running = next(
                (
                    fr
                    for fr in live.values()
                    if fr.f_code.co_name == func
                    and (func == "<module>" or getattr(sc, "lineno", 0) == fr.f_code.co_firstlineno)
                ),
                None,
            )
            if running is not None:
                ns.update(running.f_locals)
            elif isinstance(sc, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for n in _own_names(sc):  # its own names hold the values of its last call
                    ns.pop(n, None)
            for node in ast.walk(sc):
                if not (
                    isinstance(node, ast.BinOp)
                    and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod))
                    and _count_divisor(node.right)
                ):
                    continue
                r = node.right
                if r.lineno != r.end_lineno or not 0 < r.lineno <= len(lines):
                    continue
                seen: dict[str, float] = {}
                value = _read_number(r, ns, seen)
                if value is not None and value != 0:
                    continue  # not 0 now: not this division
                row = lines[r.lineno - 1]
                lo, hi = r.col_offset, r.end_col_offset or r.col_offset
                if lo > 0 and row[lo - 1] == "(" and row[hi : hi + 1] == ")":
                    lo, hi = lo - 1, hi + 1  # the divisor's own parentheses
                fixed: str | None = (row[:lo] + f"max(1, {ast.unparse(r)})" + row[hi:]).strip()
                try:
                    ast.parse(fixed or "")
                except SyntaxError:
                    fixed = None
                out.append(
                    _LrDivision(
                        where=_frames.describe_line(path, r.lineno)[0],
                        func=func,
                        code=row.strip(),
                        divisor=ast.unparse(r),
                        values=tuple(seen.items()) if value is not None else (),
                        zero=value == 0,
                        fixed=fixed,
                    )
                )
    out.sort(key=lambda d: not d.zero)
    return out


def _lr_scheduler(ctx: RuleContext, optimizer: str, step: int) -> dict[str, Any] | None:
    """The data of the latest ``"optimizer"`` note of class ``optimizer`` that names the lr
    scheduler driving it, of the update's ``step`` first, then of this step or the last
    one; None when none does."""
    near = (ctx.trace, *ctx.history[-1:])
    for t in sorted(near, key=lambda t: t.step != step):
        for n in reversed(t.notes):
            if (
                n.kind == "optimizer"
                and n.path == optimizer
                and isinstance(n.data.get("scheduler"), str)
            ):
                return n.data
    return None


def hyper(x: float) -> str:
    """A hyperparameter (an lr, an eps) as code writes it: short, exact to 4 digits, in
    ``1e-3`` style below 0.01 and from a million up; every message writes an lr with it
    (one style, NW101's and NW306's alike).

    >>> hyper(0.001), hyper(3e-4), hyper(2.5e-5), hyper(0.1), hyper(0.336), hyper(30.0)
    ('1e-3', '3e-4', '2.5e-5', '0.1', '0.336', '30')
    >>> hyper(30000.0), hyper(1e30), hyper(0.0001234567), hyper(float("nan"))
    ('30000', '1e30', '1.235e-4', 'NaN')
    """
    if not math.isfinite(x) or x == 0:
        return fmt(x)
    if 1e-2 <= abs(x) < 1e4:
        return f"{x:.4g}"
    if 1e4 <= abs(x) < 1e6:
        return str(round(x))
    mantissa, _, exp = f"{x:.3e}".partition("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exp)}"


def eps_for(dtype: str) -> float:
    """An Adam eps that ``dtype`` holds as a normal number: the smallest power of 10 at
    or above ``finfo(dtype).tiny`` (1e-4 in float16, whose smallest normal is 6.1e-5)."""
    tiny = torch.finfo(getattr(torch, dtype)).tiny
    return 10.0 ** math.ceil(math.log10(tiny))


def _update_itself(
    ctx: RuleContext, a: Anomaly, u: _Update, *, name: str, evidence: list[str]
) -> Diagnosis | None:
    """The update's own hyperparameters broke the weights: a non-finite learning rate, or
    an eps that is 0 in the weights' dtype (Adam-style division by sqrt(v) + eps)."""
    dtype = a.record.dtype
    lrs = _numbers(u.group.get("lr"))
    bad_lr = next((x for x in lrs if not math.isfinite(x)), None)
    if bad_lr is not None:
        evidence = [
            *evidence,
            f"{u.optimizer}'s learning rate was {hyper(bad_lr)} at the update of step {u.step}"
            + (f" (param group {u.group['group']})" if u.group.get("group") else ""),
        ]
        sched = _lr_scheduler(ctx, u.optimizer, u.step) if "initial_lr" in u.group else None
        var = str(sched.get("scheduler_variable") or "scheduler") if sched else "scheduler"
        lambdas = [x for x in (sched or {}).get("scheduler_lambdas") or () if isinstance(x, dict)]
        if sched is not None:
            evidence.append(
                f"{u.optimizer}'s lr is set by the {sched['scheduler']} {var} at each "
                f"{var}.step()"
                + (
                    f", as its base lr times its lr_lambda at {lambdas[0].get('at')}: "
                    f"{str(lambdas[0].get('code', '')).splitlines()[0]}"
                    if lambdas
                    else ""
                )
            )
        check = (
            "import math\n"
            f"lr = optimizer.param_groups[{u.group.get('group', 0)}]['lr']\n"
            "assert math.isfinite(lr), lr   # right after each change of the lr"
            + (f" ({var}.step())" if "initial_lr" in u.group else "")
        )
        try:
            found = _lr_divisions() if math.isnan(bad_lr) or math.isinf(bad_lr) else []
        except Exception:  # unreadable source: the generic hints stand
            found = []
        div = found[0] if found else None
        where = ""
        if div is not None:
            now = ", ".join(f"{k} = {fmt(v)}" for k, v in div.values)
            where = f"{div.where}, in {div.func}: {div.code} divides by {div.divisor}" + (
                f", which is 0 ({now})" if div.zero and now else ", which can be 0"
            )
            evidence.append(where)
        hints = (
            "\n# warmup: step / max(1, warmup_steps), never step / warmup_steps"
            "\n# after a warmup: (step - warmup) / max(1, total - warmup): 0/0 when "
            "total == warmup"
            "\n# a decay: (1 - step / total) ** p needs step <= total: clamp the step"
        )
        if div is not None and div.fixed is not None:
            fix = (
                f"# {div.where}, in {div.func}: {div.divisor}"
                + (" is 0 here" if div.zero else " can be 0")
                + " (x/0 is inf, 0/0 NaN): keep it at 1 or more\n"
                + div.fixed
                + "\n"
                + check
            )
        else:
            fix = check + hints
        return ctx.diagnosis(
            **anomaly_fields(a),
            title="Non-finite learning rate",
            evidence=evidence,
            explanation=(
                f"The optimizer multiplied the gradient of {name} by a learning rate of "
                f"{hyper(bad_lr)}: every weight it touched became non-finite at once, whatever "
                "the gradients were. Learning-rate schedules written by hand produce it: a "
                "warmup of 0 steps divides 0 by 0, so does a decay phase of 0 steps (total "
                "steps equal to the warmup's) in (step - warmup) / (total - warmup), a "
                "decay past its last step takes a negative power or a log of 0."
                + (f" Here: {where}." if where else "")
            ),
            fix=fix,
        )
    if _normalized(u.optimizer) and 0.0 in _numbers(u.group.get("eps")):
        return _zero_eps(ctx, a, u, name=name, evidence=evidence)
    eps = [x for x in _numbers(u.group.get("eps")) if x > 0]
    lim = low_precision(dtype)
    if lim is None or not eps:
        return None
    tdtype = getattr(torch, dtype, None)
    if not isinstance(tdtype, torch.dtype):
        return None
    zero = [x for x in eps if float(torch.tensor(x, dtype=tdtype)) == 0.0]
    if not zero:
        return None
    tiny = lim.subnormal  # the smallest positive value
    return ctx.diagnosis(
        **anomaly_fields(a),
        title="Optimizer eps is 0 in the weights' dtype",
        evidence=[
            *evidence,
            f"{u.optimizer}'s eps={hyper(zero[0])} is 0 in {dtype}, whose smallest positive "
            f"value is {fmt(tiny)} (update of step {u.step})",
        ],
        explanation=(
            f"{u.optimizer} divides by sqrt(v) + eps, and with {dtype} weights it computes "
            f"in {dtype}: eps={hyper(zero[0])} rounds to 0 there, so a weight whose gradient "
            "history is 0 (or underflowed to 0) gets 0 / 0 = NaN, and a tiny one gets an "
            "enormous step. Low-precision training keeps float32 master weights for exactly "
            "this; the optimizer then runs in float32. Keeping the weights in "
            f"{dtype} needs an eps it holds as a normal number: at least "
            f"{fmt(lim.tiny)} (torch.finfo(torch.{dtype}).tiny), {hyper(eps_for(dtype))} "
            "as a power of 10."
        ),
        fix=_half_fix(ctx, u, dtype, a.record.device),
    )


def _half_fix(ctx: RuleContext, u: _Update, dtype: str, device: str) -> str:
    """NW301's fix for an optimizer whose eps is 0 in the weights' dtype, written on the
    user's own lines where their running code shows them: the cast of the model undone,
    the forward under autocast (a GradScaler for float16), or the optimizer's construction
    with an eps that the dtype holds."""
    from nanwatch.rules import overflow as ov  # overflow imports this module

    ident = next(
        (
            n.data.get("ident")
            for t in (ctx.trace, *reversed(ctx.history[-1:]))
            for n in reversed(t.notes)
            if n.kind == "optimizer" and n.path == u.optimizer
        ),
        None,
    )
    eps = eps_for(dtype)
    lines = ov.half_lines(dtype, optimizer=u.optimizer, ident=ident, eps=hyper(eps))
    return ov.half_weights_fix(
        dtype, device_type(None, device), lines, optimizer=u.optimizer, eps=eps
    )


def _zero_eps(
    ctx: RuleContext, a: Anomaly, u: _Update, *, name: str, evidence: list[str]
) -> Diagnosis:
    """The group's eps is 0 and the optimizer divides by sqrt(state) + eps: a weight whose
    gradient (and so its state) is exactly 0 gets 0 / 0 = NaN (a tiny one, inf)."""
    s = a.record.stat
    gi = _group_of(u)
    new = 1e-6 if u.optimizer == "Adadelta" else 1e-8  # torch's defaults
    evidence = [
        *evidence,
        f"{u.optimizer} param group {gi} has eps=0 (update of step {u.step})",
    ]
    if s is not None and s.counted and s.numel:
        bad = (s.nan or 0) + (s.posinf or 0) + (s.neginf or 0)
        evidence.append(
            f"{bad} of {s.numel} values of {name} are non-finite, the others are not: "
            "the entries whose gradient was exactly 0"
        )
    state = _bad_state(ctx, name)
    if state:
        evidence.append(
            f"its optimizer state ({', '.join(state)}) went non-finite in the same update: "
            "a consequence of the 0 / 0, not a loaded checkpoint"
        )
    return ctx.diagnosis(
        **anomaly_fields(a),
        title="Optimizer eps is 0: 0 / 0 where a gradient is exactly 0",
        evidence=evidence,
        explanation=(
            f"{u.optimizer} divides each update by the square root of its running average of "
            "squared gradients plus eps. With eps=0, an entry of "
            f"{name} whose gradient is exactly 0 (an input feature that is always 0, a "
            "class or token never seen, a unit that never fires) has that average exactly "
            "0, and its update is 0 / (sqrt(0) + 0) = NaN; a tiny gradient whose square "
            "underflows gives inf. The learning rate and the running state are not the "
            "cause: eps must be positive."
        ),
        fix=(
            "for g in optimizer.param_groups:\n"
            f'    g["eps"] = {hyper(new)}   # was 0 ({u.optimizer}); {name} already holds NaN:\n'
            "# restart from a checkpoint saved before it (or re-initialize it)"
        ),
    )


# ---------------------------------------------------------------------- NW302


@rule(
    "NW302",
    title="Non-finite parameter gradients",
    severity="error",
    summary=(
        "A parameter's gradient is NaN/inf after backward while the module outputs' "
        "gradients were finite (or were not watched): named parameter by parameter."
    ),
    priority=20,
)
def bad_param_grads(ctx: RuleContext) -> Iterator[Diagnosis]:
    a = ctx.anomaly
    if a is None or a.kind is not AnomalyKind.GRADIENT:
        return
    bad = [r for r in ctx.trace.records if r.phase is Phase.GRADIENT and r.bad]
    total = sum(1 for r in ctx.trace.records if r.phase is Phase.GRADIENT)
    evidence = [
        f"{count(len(bad), 'parameter')} of {total} have non-finite gradients: "
        + ", ".join(r.role for r in bad[:8])
        + (", ..." if len(bad) > 8 else "")
    ]
    for r in bad[:3]:
        evidence.append(f"{r.role} ({r.dtype}): {describe_stat(r.stat)}")
    low = any(low_precision(r.dtype) for r in bad)
    if not ctx.trace.full:
        evidence.append(
            "only parameter gradients were watched this step (sentinel mode or "
            'sample_every): mode="watch" names the module whose backward made it'
        )
    if low and any(r.stat is not None and r.stat.has_posinf for r in bad):
        evidence.append("float16 gradients with inf: an overflow in backward")
    head, check = _grad_check(ctx)
    names = ctx.memo(ctx.trace, "loop_names", _loop_names)
    explanation = (
        "Backward produced a NaN or inf in a parameter's gradient. The next optimizer "
        "step would write it into the weights (and Adam's moments keep it forever). "
        "With low-precision gradients an overflow is the usual cause; otherwise an op "
        "whose derivative is infinite at the current input (sqrt or pow at 0, log at 0, "
        "acos at ±1)."
    )
    first = _nw302_first(ctx, a)
    grew = _lr_divergence(ctx)
    if grew is not None and user_hook(ctx.trace, a.record) is None:
        # the gradients grew with each update up to this step: the lr, not an op, is the
        # cause (the op that overflowed is only where the growth ran out of range)
        evidence[1:1] = grew.evidence()
        explanation = (
            f"Backward produced a NaN or inf in a parameter's gradient after the gradients "
            f"grew {_times(grew.growth)} or more with each update. " + grew.explanation()
        )
        first = grew.fix(names.optimizer) + "\n"
    yield ctx.diagnosis(
        **anomaly_fields(a),
        evidence=evidence,
        explanation=explanation,
        fix=(
            first
            + (
                "scaler = torch.amp.GradScaler()        # low precision: skips overflowing steps\n"
                if low
                else ""
            )
            + "# skip the update when it happens:\n"
            + head
            + f"if all({check} for p in {names.params} if p.grad is not None):\n"
            f"    {names.optimizer}.step()"
        ),
    )


_NORM = re.compile(r"\.norm\(([^()]*)\)")


def _nw302_first(ctx: RuleContext, a: Anomaly) -> str:
    """NW302's first lines: a hook the user registered on the parameter (its NaN is not
    seen by detect_anomaly) guarded, or nanwatch's replay, which traces ops inside hooks
    and names the op where detect_anomaly names a later node (an inf turned NaN)."""
    hook = user_hook(ctx.trace, a.record)
    how = hook_op(a.op)
    if hook is None and how is None:
        return _REPLAY + "\n"
    name = a.parameter or a.record.role
    on = f'model.get_parameter("{name}")' if a.record.phase is Phase.GRADIENT else name
    code = str(hook.get("code", "")) if hook is not None else (a.op.code if a.op else "") or ""
    at = f" at {hook.get('at')}" if hook is not None else ""
    lam = _lambda_of(code)
    if lam is not None and _NORM.search(lam[1]):  # a division by a norm: 0 / 0 at zero
        arg, text = lam
        guarded = _NORM.sub(lambda m: f"{m.group(0)}.clamp_min(torch.finfo({arg}.dtype).eps)", text)
        return (
            f"# a hook you registered on {name}{at} returned NaN (a g / g.norm() of a zero "
            "gradient); detect_anomaly does not check hooks: guard the hook\n"
            f"{on}.register_hook({guarded})   # in place of yours\n"
        )
    return (
        f"# a hook you registered on {name}{at} returned a non-finite gradient; "
        "detect_anomaly does not check hooks: guard the hook (keep what it returns finite "
        "for every gradient, an all-zero one included), e.g.\n"
        f"{on}.register_hook(lambda g: torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0))"
        "   # after yours\n"
    )


def _lambda_of(code: str) -> tuple[str, str] | None:
    """The first one-argument lambda in a line of the user's code: (its argument, its
    text), or None."""
    try:
        tree = ast.parse(code.strip().rstrip(":"))
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Lambda) and len(node.args.args) == 1:
            return node.args.args[0].arg, ast.unparse(node)
    return None


def _sparse_grads(trace: StepTrace) -> bool:
    """Whether the step had sparse parameter gradients (nn.Embedding(sparse=True)): a
    gradient whose statistics cover fewer values than its shape holds (a sparse tensor's
    stored values), or an optimizer that only takes sparse gradients (SparseAdam)."""
    for r in trace.records:
        if r.phase is Phase.GRADIENT and r.stat is not None and 0 < r.stat.numel < _size(r):
            return True
    return any("sparse" in n.path.lower() for n in trace.notes if n.kind == "optimizer")


def _size(r: Record) -> int:
    return math.prod(r.shape) if r.shape else 1


_FINITE_SPARSE = (
    "def finite(g):   # torch.isfinite has no sparse kernel: check a sparse grad's values\n"
    "    return torch.isfinite(g.coalesce().values() if g.is_sparse else g).all()\n"
)


def _grad_check(ctx: RuleContext, *more: StepTrace | None) -> tuple[str, str]:
    """Code that tests one gradient ``p.grad``: a line to put first (empty for dense
    gradients) and the expression. With sparse gradients (nn.Embedding(sparse=True))
    ``torch.isfinite(p.grad)`` raises, so the test reads their stored values."""
    traces = [ctx.trace, *(t for t in more if t is not None)]
    if any(_sparse_grads(t) for t in traces):
        return _FINITE_SPARSE, "finite(p.grad)"
    return "", "torch.isfinite(p.grad).all()"


# ---------------------------------------------------------------------- NW303


@dataclass(frozen=True)
class _GradSummary:
    total: float | None
    params: dict[str, float]  #: parameter -> gradient L2 norm
    modules: dict[str, float]  #: module path -> max |gradient of its output|
    dtypes: frozenset[str] = frozenset()  #: the dtypes of the parameter gradients recorded


def _by_grad_only(trace: StepTrace) -> bool:
    """Whether the step's module-output gradients are to be read whatever made them: no
    training ``backward()`` recorded one. Otherwise those ``torch.autograd.grad`` computed
    (an input saliency, an R1 penalty: the seed of ``out.sum()`` is all ones) are not the
    training gradients, and the spike and vanishing rules leave them out."""
    return not any(r.phase is Phase.BACKWARD and not r.by_grad for r in trace.records)


def _grad_summary(trace: StepTrace) -> _GradSummary:
    """The step's parameter gradient norms and module output gradients (max |gradient| over
    finite values), in one pass over its records: NW303 reads it on every step. A module's
    gradients ``torch.autograd.grad`` computed count only when no training ``backward()``
    recorded one (:func:`_by_grad_only`)."""
    params: dict[str, float] = {}
    modules: dict[str, float] = {}
    by_grad: dict[str, float] = {}
    dtypes: set[str] = set()
    losses = {c.id for c in trace.calls if c.is_loss}
    trained = False
    gradient, backward = Phase.GRADIENT, Phase.BACKWARD
    for r in trace.records:
        phase = r.phase
        if phase is gradient:
            dtypes.add(r.dtype)
        elif phase is backward:
            trained = trained or not r.by_grad
        else:
            continue
        s = r.stat
        if s is None or r.call in losses:  # a loss's own gradient is 1 by definition
            continue
        if phase is gradient:
            if s.norm is not None and math.isfinite(s.norm):
                params[r.role] = s.norm
            continue
        # TensorStat.magnitude, without its property calls
        m = s.finite_amax
        if m is None:
            if (s.nan > 0) if s.nan is not None else (math.isnan(s.min) or math.isnan(s.max)):
                continue
            m = max(abs(s.min), abs(s.max))
        if math.isfinite(m):
            into = by_grad if r.by_grad else modules
            old = into.get(r.path)
            if old is None or m > old:
                into[r.path] = m
    return _GradSummary(trace.grad_norm, params, modules if trained else by_grad, frozenset(dtypes))


#: float32's machine epsilon: the norms are summed in float32 or wider
_EPS32 = torch.finfo(torch.float32).eps


def _above_rounding(cur: _GradSummary) -> dict[str, float]:
    """The parameters whose gradient counts in the step's total norm: a norm ``g`` with
    ``g**2 < eps * total**2`` is lost in the rounding of the squared total that clipping
    measures. Such a gradient is numerical noise (a conv bias before a BatchNorm, whose
    true gradient is 0), and ten times noise is still noise, not an explosion."""
    total = cur.total
    if total is None or not math.isfinite(total) or total <= 0:
        return cur.params
    floor = _EPS32 * total * total
    return {k: v for k, v in cur.params.items() if v * v >= floor}


def _share_of_largest(modules: dict[str, float], factor: float) -> dict[str, float]:
    """The modules whose largest output gradient is a share of the step's largest (the
    gradient backward carries from the loss) that can move the update: at least
    1 / factor**2 of it (1% at the default factor of 10). A module whose gradient is a
    sliver of that (an adaLN-Zero block whose zero-initialized gate is opening, a
    conditioning path behind one) grows by many times its own small past while healthy:
    even after such a jump it is too small to explode the update."""
    if not modules:
        return modules
    floor = max(modules.values()) / (factor * factor)
    return {k: v for k, v in modules.items() if v >= floor}


def _update_seen(cur: _GradSummary) -> bool:
    """Whether the step measured what the optimizer applies: the total gradient norm or a
    parameter's. A module's output gradient moves the update only through these, so when
    they are recorded a spike of that alone does not reach the weights."""
    return bool(cur.params) or (cur.total is not None and math.isfinite(cur.total))


def _times(ratio: float) -> str:
    """A ratio for a sentence: ``3.2×``, ``42×``, ``8.9e+28×`` (no 30-digit integers)."""
    if not math.isfinite(ratio):
        return "inf×" if ratio > 0 else "NaN×"
    if ratio >= 1e6:
        return f"{ratio:.2g}×"
    return f"{ratio:.0f}×" if ratio >= 10 else f"{ratio:.1f}×"


def _level(values: list[float], need: int) -> tuple[float, int]:
    """The recent level a gradient norm is compared with: the median of ``values`` (oldest
    first), or of their later half when the norm rose in a warm-up and then settled there
    (the later half's median over twice the earlier half's, and the later half no longer
    rising: its second quarter's median at most twice its first's). Gradients that grow
    as training starts (a queue of negatives filling, a loss leaving its plateau) leave an
    early median far below where they settled; a norm still rising keeps the whole median,
    so an instability that grows step after step is still measured from before it grew.
    Returns the level and how many of the last steps it is the median of."""
    med = statistics.median(values)
    if len(values) < 2 * need:
        return med, len(values)
    half = len(values) // 2
    early, late = values[:half], values[half:]
    q = len(late) // 2
    late_med = statistics.median(late)
    if late_med > 2 * statistics.median(early) and statistics.median(
        late[q:]
    ) <= 2 * statistics.median(late[:q]):
        return late_med, len(late)
    return med, len(values)


def _spikes(
    ctx: RuleContext,
    kind: str,
    current: dict[str, float],
    factor: float,
    need: int,
    *,
    window: _WindowMin | None,
    jump: bool = False,
) -> list[tuple[float, str, float, float]]:
    """Keys whose value is at least ``factor`` times their median over the history's
    steps where it was not exactly 0 (``need`` such steps at least). With ``jump``, also
    ``factor`` times each of their last ``need`` such steps: a jump, not a steady rise
    nor a noisy one. Without a spike of the total norm, a parameter or module whose gradient
    grows as it learns (a GAT's attention vectors from near-uniform attention at init, an
    MDN's means as its sigmas shrink) climbs to many times its own early steps while no
    step is many times the few before it; that is training, not an explosion.

    Runs every step, so it is built to be cheap: a key is a candidate only if its value
    reaches ``factor`` times its minimum over the history (``window``, carried from step to
    step by :func:`_window_mins`, when one is kept; the median is at least that), and only
    candidates read their history and get a median."""
    out = []
    rows: list[Mapping[str, float]] | None = None
    for key, v in current.items():
        if window is not None and v < factor * window.get(key):
            continue
        if rows is None:
            row = _grad_row(ctx, kind)
            rows = [ctx.memo(t, _ROW_TAG + kind, row) for t in ctx.history]
        seen = [x for r in rows if (x := r.get(key)) is not None]
        if len(seen) < need:
            continue
        if jump and v < factor * max(seen[-need:]):
            continue
        med, _ = _level(seen, need)
        if med <= 0 or v < factor * med:
            continue
        # past the largest level it had (see _peak); alone (``jump``), ``factor`` times
        # it: with the total no higher than before, one parameter's share of it shifting
        # back toward its early steps is training, not an explosion
        peak = _peak(seen, factor, need)
        if v >= factor * peak if jump else v > peak:
            out.append((v / med, key, v, med))
    out.sort(reverse=True)
    return out


def _peak(values: list[float], factor: float, need: int) -> float:
    """The largest of ``values`` (a gradient norm over the history, oldest first) that
    was no spike itself: a value after the first ``need`` counts only when below ``factor``
    times the median of the values before it. A norm that does not pass this peak returns
    to a level the run has already had and trained through, not an explosion: after an
    optimizer converged (LBFGS, a fit that has settled) the norm sits orders of magnitude
    below its first steps, and the next step that moves off the optimum is many times that
    median while still far below where the run began. A spike earlier in the history is
    left out of the peak, so a recurring explosion is still one each time."""
    top = 0.0
    for i, v in enumerate(values):
        if i >= need and v >= factor * statistics.median(values[:i]):
            continue
        top = max(top, v)
    return top


def _total_row(summary: _GradSummary) -> dict[str, float]:
    """The step's total gradient norm under the key ``_TOTAL``, when it is finite and not
    0 (a level to compare with); empty otherwise."""
    total = summary.total
    return {_TOTAL: total} if total is not None and math.isfinite(total) and total else {}


def _param_row(summary: _GradSummary) -> dict[str, float]:
    """The step's parameter gradient norms that are a level: not exactly 0 (not yet
    connected to the loss: a loss term weighted 0 during a warm-up, a gate initialized to
    0), nor lost in the rounding of that step's total (see :func:`_above_rounding`: a conv
    bias before a BatchNorm in training mode has a true gradient of 0, and once the norm's
    statistics are frozen, fine-tuning or QAT's freeze_bn_stats, its real gradient is no
    jump over that noise)."""
    total = summary.total
    if total is not None and math.isfinite(total) and total > 0:
        floor = _EPS32 * total * total
        return {k: x for k, x in summary.params.items() if x and x * x >= floor}
    return {k: x for k, x in summary.params.items() if x}


def _module_row(summary: _GradSummary) -> dict[str, float]:
    """The step's module output gradients (max |gradient|) that are not exactly 0."""
    return {k: x for k, x in summary.modules.items() if x}


#: what a step contributes to the history's level of each kind of gradient norm
_ROWS: dict[str, Callable[[_GradSummary], dict[str, float]]] = {
    "total": _total_row,
    "params": _param_row,
    "modules": _module_row,
}
_ROW_TAG = "nw303-row:"


def _grad_row(ctx: RuleContext, kind: str) -> Callable[[StepTrace], dict[str, float]]:
    """A step's row of ``kind`` (:data:`_ROWS`), from its memoized gradient summary."""
    fn = _ROWS[kind]
    return lambda t: fn(ctx.memo(t, "grad_summary", _grad_summary))


#: a step named by identity and number: a dropped step is not kept alive by what is carried
_Mark = tuple[int, int]


def _mark(t: StepTrace) -> _Mark:
    return id(t), t.step


class _WindowMin:
    """Each key's minimum over the rows of a window of steps (oldest first), kept as the
    window grows by a step and slides by one: per key, a queue of the values that can still
    become its minimum (each smaller than the ones after it, with its row's position), so a
    step costs one row, not a pass over the window."""

    __slots__ = ("_queues", "end", "marks")

    def __init__(self) -> None:
        self.marks: deque[_Mark] = deque()  #: the window's steps, oldest first
        self.end = 0  #: how many rows were pushed
        self._queues: dict[str, deque[tuple[int, float]]] = {}

    def push(self, mark: _Mark, row: Mapping[str, float]) -> None:
        """Add a step, newest, with its values (an absent key: no value that step)."""
        pos = self.end
        self.end += 1
        self.marks.append(mark)
        lo = self.end - len(self.marks)
        for key, v in row.items():
            q = self._queues.get(key)
            if q is None:
                self._queues[key] = deque(((pos, v),))
                continue
            while q and q[-1][1] >= v:
                q.pop()
            while q and q[0][0] < lo:
                q.popleft()
            q.append((pos, v))

    def drop(self) -> None:
        """Drop the window's oldest step."""
        self.marks.popleft()

    def get(self, key: str) -> float:
        """``key``'s minimum over the window; inf when no step of it has a value."""
        q = self._queues.get(key)
        if not q:
            return math.inf
        lo = self.end - len(self.marks)
        while q and q[0][0] < lo:
            q.popleft()
        return q[0][1] if q else math.inf


def _window_mins(
    ctx: RuleContext, tag: str, row: Callable[[StepTrace], Mapping[str, float]]
) -> _WindowMin:
    """Each key's minimum over the history's rows (``row``, memoized under ``tag``), kept
    with the history's newest step and carried to the next: when the history grew by a
    step, or slid by one (its oldest step dropped), only the new row is added. A pass over
    the history (steps x keys) otherwise costs most of NW303's time on every step."""
    hist = ctx.history
    n = len(hist)
    key = tag + ":window-min"

    def rebuild() -> _WindowMin:
        w = _WindowMin()
        for t in hist:
            w.push(_mark(t), ctx.memo(t, tag, row))
        return w

    def compute(last: StepTrace) -> _WindowMin:
        prev = ctx.cached(hist[-2], key) if n > 1 else None
        if not isinstance(prev, _WindowMin) or not prev.marks or prev.marks[-1] != _mark(hist[-2]):
            return rebuild()
        m = len(prev.marks)
        if m == n - 1 and prev.marks[0] == _mark(hist[0]):  # the history grew by this step
            prev.push(_mark(last), ctx.memo(last, tag, row))
            return prev
        if m == n and prev.marks[1] == _mark(hist[0]):  # it slid: its oldest step was dropped
            prev.drop()
            prev.push(_mark(last), ctx.memo(last, tag, row))
            return prev
        return rebuild()

    if not n:
        return _WindowMin()
    w: _WindowMin = ctx.memo(hist[-1], key, compute)
    # carried in place: the value kept with an older step may have moved on since
    if len(w.marks) != n or w.marks[-1] != _mark(hist[-1]) or w.marks[0] != _mark(hist[0]):
        w = rebuild()
    return w


# ------------------------------------------------- gradients that grow with each update


@dataclass(frozen=True)
class _Divergence:
    """Gradient norms that multiplied across consecutive updates of a plain (not
    Adam-family) optimizer: the signature of a learning rate above gradient descent's
    stable limit."""

    optimizer: str  #: the class (``SGD``)
    lrs: tuple[float, ...]  #: its param groups' learning rates at the last of those updates
    steps: tuple[int, ...]  #: the steps whose gradient norms are compared, oldest first
    norms: tuple[float, ...]  #: their total gradient norms
    losses: tuple[float | None, ...]  #: their losses (None where not recorded)

    @property
    def growth(self) -> float:
        """The smallest factor the gradient norm grew by across one of the updates."""
        return min(b / a for a, b in itertools.pairwise(self.norms))

    @property
    def lr(self) -> float:
        return max(self.lrs)

    def evidence(self) -> list[str]:
        n = len(self.norms) - 1
        norms = " → ".join(fmt(g) for g in self.norms)
        line = (
            f"total gradient norm {norms} at steps {self.steps[0]} to {self.steps[-1]}: "
            f"{_times(self.growth)} or more across each of {count(n, 'update')} of "
            f"{self.optimizer} lr {', '.join(hyper(x) for x in dict.fromkeys(self.lrs))}"
        )
        first, last = self.losses[0], self.losses[-1]
        if first is not None and last is not None and last > first:
            line += f"; the loss rose from {fmt(first)} to {fmt(last)}"
        size = self.lr * self.norms[-2]
        return [
            line,
            f"the update at step {self.steps[-2]} had norm {fmt(size)} "
            f"(lr {hyper(self.lr)} × gradient norm {fmt(self.norms[-2])})",
        ]

    def explanation(self) -> str:
        r = self.growth
        return (
            f"The gradients multiply after every update: {self.optimizer} moves the weights "
            "by lr × gradient, and a step longer than the loss's curvature allows "
            "overshoots the minimum, lands where the gradient is larger, and takes a longer "
            "step still. Gradient descent multiplies the gradient by about 1 - lr × "
            f"curvature per step: a growth of {_times(r)} means lr × curvature is about "
            f"{fmt(r + 1)}, and it is stable below 2, so the learning rate is about "
            f"{fmt((r + 1) / 2)} times too high. Clipping bounds the step, the lr is the "
            "cause."
        )

    def fix(self, optimizer: str) -> str:
        # the stable limit, lr × 2 / (growth + 1), and a tenth of it: at the limit itself
        # the loss oscillates instead of falling
        scale = 2 / (self.growth + 1)
        if len(set(self.lrs)) == 1:
            new = _round_down(self.lr * scale / 10)
            return (
                f'for g in {optimizer}.param_groups: g["lr"] = {hyper(new)}   # was '
                f"{hyper(self.lr)} ({self.optimizer}); the gradients grow above about "
                f"{self.lr * scale:.2g}"
            )
        return (
            f'for g in {optimizer}.param_groups: g["lr"] *= {fmt(_round_down(scale / 10))}   '
            f"# {self.optimizer}'s lrs were {', '.join(hyper(x) for x in self.lrs)}; the "
            f"gradients grow above about {scale:.2g} of them"
        )


def _round_down(x: float) -> float:
    """The largest 1, 2 or 5 × 10^k at or below ``x`` (> 0)."""
    k = math.floor(math.log10(x))
    for m in (5, 2, 1):
        if m * 10.0**k <= x * (1 + 1e-9):
            return float(f"{m * 10.0**k:.0e}")
    return float(f"{10.0 ** (k - 1):.0e}")


def _plain_lrs(trace: StepTrace) -> tuple[str, tuple[float, ...]] | None:
    """The optimizer that stepped at the end of ``trace`` and its groups' learning rates,
    when there is exactly one and it moves the weights by lr × gradient (not the Adam
    family, whose step is about lr whatever the gradient; not LBFGS; not Lion's sign nor
    LAMB's or LARS's trust ratio, which set the step's size apart from the gradient's)."""
    notes = [n for n in trace.notes if n.kind == "optimizer"]
    if len(notes) != 1 or _normalized(notes[0].path) or notes[0].path == "LBFGS":
        return None
    if any(k in notes[0].path.lower() for k in ("lion", "lamb", "lars")):
        return None
    lrs = [
        float(g["lr"])
        for g in notes[0].data.get("groups", ())
        if isinstance(g, dict)
        and isinstance(g.get("lr"), (int, float))
        and not isinstance(g.get("lr"), bool)
    ]
    if not lrs or not all(math.isfinite(x) and x > 0 for x in lrs):
        return None
    return notes[0].path, tuple(lrs)


def _lr_divergence(ctx: RuleContext) -> _Divergence | None:
    """The total gradient norm multiplied (``explode_factor`` or more) across each of the
    last updates before the step's latest finite norm (this step's, else the last
    recorded one: a NaN gradient now ends the growth), each update by the same plain
    optimizer. One such update is enough only when the loss rose across it too (a run
    whose lr is fine can meet one bad batch; its loss does not climb with the gradient).
    None otherwise."""
    factor = ctx.thresholds.explode_factor
    traces = list(ctx.history)
    g = ctx.trace.grad_norm
    if g is not None and math.isfinite(g):
        traces.append(ctx.trace)
    elif not traces or _plain_lrs(traces[-1]) is None:
        return None
    chain = [traces[-1]]
    opt: tuple[str, tuple[float, ...]] | None = None
    ratios: list[float] = []
    for prev in reversed(traces[:-1]):
        nxt = chain[0]
        a, b = prev.grad_norm, nxt.grad_norm
        here = _plain_lrs(prev)
        if (
            here is None
            or (opt is not None and here[0] != opt[0])
            or prev.step != nxt.step - 1
            or a is None
            or b is None
            or not (math.isfinite(a) and a > 0 and math.isfinite(b))
            or b < factor * a
        ):
            break
        r = b / a
        if max([*ratios, r]) > factor * min([*ratios, r]):
            # a fixed lr × curvature multiplies the gradient by about the same factor at
            # each update; a growth that began with a jump far larger (or smaller) than the
            # ones after it began elsewhere (a division by a tiny number, a bad batch), and
            # the lr only carried it on
            return None
        ratios.append(r)
        opt = opt or here
        chain.insert(0, prev)
    if opt is None:
        return None
    losses = tuple(t.loss if t.loss is not None and math.isfinite(t.loss) else None for t in chain)
    if len(chain) == 2 and (
        not (losses[0] is not None and losses[1] is not None and losses[1] > losses[0])
        or any(_plain_lrs(t) == opt for t in traces[: len(traces) - len(chain)])
    ):
        # one rise is the lr's only with the loss rising too, and only when no earlier
        # update at this lr kept the gradients level: a run that trained at it and then
        # jumped once met a bad batch, not its lr
        return None
    return _Divergence(
        opt[0],
        opt[1],
        tuple(t.step for t in chain),
        tuple(float(t.grad_norm or 0.0) for t in chain),
        losses,
    )


@rule(
    "NW303",
    title="Exploding gradients",
    severity="warning",
    summary=(
        "The gradient norm (total, per parameter or per module) jumped to many times its "
        "median over the recorded steps (thresholds.explode_factor) and past the largest "
        "level the run had before (a converged run moving off its optimum is no explosion, "
        "nor a fit whose loss sat at finfo(loss dtype).eps of where the run began going "
        "back to the gradient level it began with, nor a -log-probability loss (cross-"
        "entropy, NLL, BCE) whose batch, summed, costs less than one sample did at the "
        "start, rising by at most one sample's log(1 / finfo(loss dtype).eps): one flipped "
        "label in a memorized batch), and not small against the weights: a "
        "jump from rounding noise (below finfo(dtype).eps × the weights' norm: a loss at its "
        "floor) must pass explode_factor times that floor, and one to below sqrt(float32 "
        "eps) × the weights' norm explodes nothing; nor does one step of a small norm back "
        "below explode_factor times the norm the run began with (or met while the loss "
        "falls as the gradient level rises, a learned variance shrinking, at a loss no worse "
        "than the recorded steps began at), not growing, whose update "
        "(lr × the norm; about lr per value for Adam) moves the weights by under 1 / "
        "explode_factor of their norm (a converged policy meeting a rare action). Clip at "
        "a max_norm that binds, or lower "
        "the lr; right after an update that raised the lr explode_factor times or moved the "
        "weights by their own size, the lr is named (NW308 says it where the loss spiked). "
        "From the first step: a total norm past 1e-3 × sqrt(finfo(dtype).max) of the "
        "gradients' dtype (1.8e16 in float32 and bfloat16), whose square nearly overflows."
    ),
    early=True,
    priority=30,
)
def exploding(ctx: RuleContext) -> Iterator[Diagnosis]:
    # a jump over the recent level says more (its ratio, the parameter that jumped) than
    # the absolute size, which is for gradients huge from the first step on
    found = list(_jumped(ctx))
    if found:
        yield from found
        return
    huge = _huge_norm(ctx)
    if huge is not None:
        yield huge


def _call_paths(trace: StepTrace) -> frozenset[str] | None:
    """The modules (and the ``(loss)`` a loop computed outside any module) a full step
    called; None for a sampled-out step, which records no calls."""
    return frozenset(c.path for c in trace.calls) if trace.full and trace.calls else None


def _regime(ctx: RuleContext) -> Sequence[StepTrace] | None:
    """The history of the current regime: the steps from the last one that called a module
    or computed a loss term that no earlier step of the history had (a task switch adding
    an EWC penalty and a new head, a loss term switched on). Gradients of a new composition
    of the loss have no level yet: a jump over the steps before it is no explosion. None
    when the current step itself is the first of a new regime."""
    hist = ctx.history
    paths = [ctx.memo(t, "call_paths", _call_paths) for t in hist]
    paths.append(ctx.memo(ctx.trace, "call_paths", _call_paths))
    seen: set[str] = set()
    start = 0
    for i, p in enumerate(paths):
        if p is None or p <= seen:
            continue
        if seen:
            start = i
        seen |= p
    if start == len(hist):
        return None
    return hist[start:] if start else hist


def _candidates(
    ctx: RuleContext,
    cur: _GradSummary,
    params: Mapping[str, float],
    modules: Mapping[str, float],
    windows: Mapping[str, _WindowMin],
) -> bool:
    """Whether any norm of the step could be a spike (a necessary condition of
    :func:`_jumped`'s, checked before it reads the history): the total, or a parameter's
    (of ``params``) or, when the step measured no update, a module's (of ``modules``), at
    ``explode_factor`` times its minimum over the history or more (the median over any
    later part of the history, a regime, is at least that) and, without the total, as many
    times each of its last ``min_history`` values (a jump). A healthy step stops here."""
    factor = ctx.thresholds.explode_factor
    total = cur.total
    if (
        total is not None
        and math.isfinite(total)
        and total >= factor * windows["total"].get(_TOTAL)
    ):
        return True
    kinds = (
        [("params", params)] if _update_seen(cur) else [("params", params), ("modules", modules)]
    )
    for kind, current in kinds:
        w = windows[kind]
        found = [(k, v) for k, v in current.items() if v >= factor * w.get(k)]
        if found and _jumps(ctx, kind, found, factor):
            return True
    return False


def _jumps(ctx: RuleContext, kind: str, found: list[tuple[str, float]], factor: float) -> bool:
    """Whether any of ``found`` (key, value) is ``factor`` times each of its last
    ``min_history`` values in the history's rows of ``kind`` (where it had one), with that
    many values found."""
    need = ctx.thresholds.min_history
    row = _grad_row(ctx, kind)
    tag = _ROW_TAG + kind
    last: dict[str, list[float]] = {k: [] for k, _ in found}
    for t in reversed(ctx.history):
        r = ctx.memo(t, tag, row)
        for k, seen in last.items():
            if len(seen) < need and (x := r.get(k)) is not None:
                seen.append(x)
        if all(len(seen) >= need for seen in last.values()):
            break
    return any(len(last[k]) >= need and v >= factor * max(last[k]) for k, v in found)


@dataclass(frozen=True)
class _Start:
    """The first losses and total gradient norms recorded while watching (``min_history``
    of each at most, finite, oldest first): the level the run began at, carried from step
    to step long after the ring buffer dropped those steps."""

    losses: tuple[float, ...] = ()
    totals: tuple[float, ...] = ()

    def add(self, trace: StepTrace, need: int) -> _Start:
        losses, totals = self.losses, self.totals
        if len(losses) < need and trace.loss is not None and math.isfinite(trace.loss):
            losses = (*losses, trace.loss)
        g = trace.grad_norm
        if len(totals) < need and g is not None and math.isfinite(g) and g > 0:
            totals = (*totals, g)
        if losses is self.losses and totals is self.totals:
            return self
        return _Start(losses, totals)


def _run_start(ctx: RuleContext, need: int) -> _Start:
    """The run's :class:`_Start`, kept with the history's newest step and carried to the
    next (read from the history alone when the step before has none: the ring's oldest
    steps then stand for the start)."""
    hist = ctx.history
    key = "nw303-start"

    def compute(last: StepTrace) -> _Start:
        prev = ctx.cached(hist[-2], key) if len(hist) > 1 else None
        if isinstance(prev, _Start):
            return prev.add(last, need)
        start = _Start()
        for t in hist:
            start = start.add(t, need)
        return start

    return ctx.memo(hist[-1], key, compute) if hist else _Start()


def _settled(ctx: RuleContext, start: _Start, total: float | None, level: float | None) -> bool:
    """Whether the step's total gradient norm ``total``, many times its recent ``level``,
    is a fitted model moved off its optimum: the loss has sat at its floor (the history's
    median loss at or below finfo(loss dtype).eps × the loss the run began with: a fit
    exact to the loss's resolution), the gradient level is the rounding noise of that fit
    (at or below sqrt(eps) × the norm the run began with: a squared loss's gradient goes as
    its square root), and ``total`` is back at most to that beginning norm, a level the run
    trained through. One hard batch, one noisy label, does that to a converged fit; no
    update has grown."""
    need = ctx.thresholds.min_history
    if (
        total is None
        or level is None
        or not math.isfinite(total)
        or len(start.losses) < need
        or len(start.totals) < need
    ):
        return False
    loss0, total0 = statistics.median(start.losses), statistics.median(start.totals)
    if not (loss0 > 0 and total <= total0):
        return False
    losses = [t.loss for t in ctx.history if t.loss is not None]
    if len(losses) < need or not all(math.isfinite(x) and x >= 0 for x in losses):
        return False
    t = getattr(torch, _loss_dtype(ctx.trace), None)
    eps = torch.finfo(t).eps if isinstance(t, torch.dtype) and t.is_floating_point else _EPS32
    return statistics.median(losses) <= eps * loss0 and level <= math.sqrt(eps) * total0


#: losses that are -log of a probability the model gave, averaged (or summed) over samples
_LOG_PROB_LOSSES = frozenset({"ce", "nll", "bce", "bce_logits"})


def _samples(trace: StepTrace) -> tuple[int, bool] | None:
    """The step's one loss call that is a -log of probabilities (:data:`_LOG_PROB_LOSSES`):
    how many samples (target positions not ignored) it reduced over, and whether it
    averaged them (False: summed). None for another loss, several, or ``reduction="none"``."""
    # (the loss computed outside any module is a use of its own, of no kind)
    uses = [u for u in loss_uses(trace) if u.path != LOSS_PATH]
    if len(uses) != 1 or uses[0].kind not in _LOG_PROB_LOSSES:
        return None
    u = uses[0]
    reduction = u.data("reduction", "mean")
    if reduction not in ("mean", "sum"):
        return None
    shape = u.data("target_shape")
    if isinstance(shape, list) and all(isinstance(d, int) for d in shape):
        n = math.prod(shape)
    else:
        rec = u.measured or u.input
        if rec is None or not rec.shape:
            return None
        n = math.prod(rec.shape)
        if u.kind in ("ce", "nll") and len(rec.shape) > 1:
            n //= max(rec.shape[1], 1)  # the class dim
    ignored = u.data("ignored", 0)
    n -= int(ignored) if isinstance(ignored, (int, float)) else 0
    return (n, reduction == "mean") if n > 0 else None


def _one_sample_off(ctx: RuleContext, start: _Start, total: float | None) -> bool:
    """Whether the step's total gradient norm ``total`` (a spike over its recent level) is a
    fit that memorized its batch meeting one sample it does not fit (a flipped label), not
    an explosion. The loss is a -log of the probabilities the model gave (cross-entropy,
    NLL, BCE) over n samples; the history's losses, summed over the batch, are at most what
    one sample cost when the run began (every sample is fit); this step's loss rose above
    them by at most what one sample adds at a probability of finfo(loss dtype).eps, log(1 /
    eps) (its share of a mean: / n); and ``total`` is back at most to the largest norm the
    run began with, a level it trained through."""
    need = ctx.thresholds.min_history
    loss = ctx.trace.loss
    if (
        total is None
        or loss is None
        or not math.isfinite(total)
        or not math.isfinite(loss)
        or len(start.losses) < need
        or len(start.totals) < need
        or total > max(start.totals)
    ):
        return False
    got = _samples(ctx.trace)
    if got is None:
        return False
    n, mean = got
    losses = [t.loss for t in ctx.history if t.loss is not None]
    if len(losses) < need or not all(math.isfinite(x) and x >= 0 for x in losses):
        return False
    level = statistics.median(losses)
    per = n if mean else 1  # the loss in units of one sample's
    first = statistics.median(start.losses) / (1 if mean else n)  # one sample's, at first
    t = getattr(torch, _loss_dtype(ctx.trace), None)
    eps = torch.finfo(t).eps if isinstance(t, torch.dtype) and t.is_floating_point else _EPS32
    return level * per <= first and (loss - level) * per <= math.log(1 / eps)


def _stepped_notes(ctx: RuleContext) -> list[Note]:
    """The ``"optimizer"`` notes of the update this step's gradients go to: this step's,
    else (read before its update ran) the last step of the history that has one."""
    for t in (ctx.trace, *reversed(ctx.history)):
        notes = [n for n in t.notes if n.kind == "optimizer"]
        if notes:
            return notes
    return []


def _update_size(ctx: RuleContext, cur: _GradSummary) -> float | None:
    """About how far (an L2 norm) the update moves the weights that have a gradient this
    step: lr × the total gradient norm for an optimizer that steps by lr × gradient (SGD),
    about lr per value for Adam and its kin (:func:`_normalized`) and Lion's sign, whatever
    the gradient; the largest lr of the update's optimizers and param groups. None without
    a recorded lr or total, or when an optimizer sets its step's size apart from both
    (LBFGS's line search, LAMB's and LARS's trust ratio)."""
    total = cur.total
    notes = _stepped_notes(ctx)
    if total is None or not math.isfinite(total) or not notes:
        return None
    values = sum(
        math.prod(r.shape)
        for r in ctx.trace.records
        if r.phase is Phase.GRADIENT and r.role in cur.params
    )
    size = 0.0
    for n in notes:
        low = n.path.lower()
        if n.path == "LBFGS" or "lamb" in low or "lars" in low:
            return None
        lrs = [x for g in _group_lrs(n).values() for x in _numbers(g.get("lr"))[:1]]
        if not lrs:
            return None
        per_value = _normalized(n.path) or "lion" in low
        size = max(size, max(lrs) * (math.sqrt(values) if per_value else total))
    return size


#: a spike more than this many times the spiking steps right before it keeps growing
#: (the doubling that :func:`_level` reads as a norm still rising)
_GROWING = 2.0


def _sharpening(ctx: RuleContext) -> bool:
    """Whether the run's gradients grow because its loss sharpens, not because training
    diverges: over the history (``2 × min_history`` steps at least, oldest first) the
    median total gradient norm of the later half is above the earlier half's while the
    median loss of the later half is below the earlier half's, and this step's loss is at
    most the earlier half's median. A loss that learns its own scale (a Gaussian NLL's
    variance, a temperature) falls as that scale shrinks, and its gradients grow as one
    over it, with a batch's spread: a norm many times the older steps' median, met at a
    loss no worse than theirs, is that growth. A divergence raises the loss with the
    gradients."""
    need = ctx.thresholds.min_history
    loss = ctx.trace.loss
    if loss is None or not math.isfinite(loss):
        return False
    rows = [
        (t.grad_norm, t.loss)
        for t in ctx.history
        if t.grad_norm is not None
        and t.loss is not None
        and math.isfinite(t.grad_norm)
        and math.isfinite(t.loss)
    ]
    if len(rows) < 2 * need:
        return False
    half = len(rows) // 2
    early, late = rows[:half], rows[half:]
    early_loss = statistics.median(x for _, x in early)
    return (
        statistics.median(g for g, _ in late) > statistics.median(g for g, _ in early)
        and statistics.median(x for _, x in late) < early_loss
        and loss <= early_loss
    )


def _harmless_spike(
    ctx: RuleContext, start: _Start, cur: _GradSummary, level: float | None
) -> bool:
    """Whether the step's total gradient norm, ``explode_factor`` times its recent
    ``level`` or more, is a small norm's one-step jump that threatens nothing (a converged
    policy meeting a rare action whose normalized advantage is large): all of

    - measured from the level the run began at (the median of its first total norms,
      :class:`_Start`), it is no spike: below ``explode_factor`` times that, a size the
      run trained through; or the run is sharpening (:func:`_sharpening`): its gradient
      level rose as its loss fell, and this step's loss is no worse than the loss the
      recorded steps began at;
    - it does not keep growing: not over :data:`_GROWING` times the largest of the steps
      right before it that were already that far above the level;
    - the update it makes (:func:`_update_size`) moves the weights (their norm,
      ``facts["weight_norms"]``) by less than 1 / ``explode_factor`` of their size: not
      within ``explode_factor`` of a step as large as the weights (NW308's oversized one).

    False whenever one of these is not measured (no start level, lr or weights read)."""
    factor = ctx.thresholds.explode_factor
    total = cur.total
    if (
        total is None
        or level is None
        or not math.isfinite(total)
        or level <= 0
        or len(start.totals) < ctx.thresholds.min_history
        or (total >= factor * statistics.median(start.totals) and not _sharpening(ctx))
    ):
        return False
    before = 0.0
    for t in reversed(ctx.history):
        g = t.grad_norm
        if g is None or not math.isfinite(g) or g < factor * level:
            break
        before = max(before, g)
    if before and total > _GROWING * before:
        return False
    size = _update_size(ctx, cur)
    weights = ctx.memo(ctx.trace, "weight_scales", lambda t: _weight_scales(ctx, cur)).get(_TOTAL)
    return size is not None and weights is not None and factor * size < weights.norm


def _overshot(ctx: RuleContext) -> tuple[StepTrace, list[_Raise], _Oversize | None] | None:
    """The update just before this step (the history's last step's) when it was oversized
    as NW308 measures it: its lr raised ``explode_factor`` times at once, or a step as large
    as the weights it moved; with the lr raises and the weight moved the most. None
    otherwise."""
    hist = ctx.history
    if not hist or hist[-1].step != ctx.step - 1:
        return None
    update = hist[-1]
    raises = _lr_raises(ctx, update)
    big = _oversized_update(ctx, update)
    return (update, raises, big) if raises or big is not None else None


def _spike_told(ctx: RuleContext) -> bool:
    """Whether the loss spike NW308 diagnoses already says this jump of the gradients: NW308
    fires at this step, or fired at an earlier step of the same spike (:func:`_same_spike`)
    where the gradients had jumped with the loss (its evidence says they followed), or NW303
    has named the lr since then. Otherwise NW303 names the lr, once a spike; and always when
    the user silenced NW308 (``ignore=``), which then tells nothing."""
    if "NW308" in ctx.ignored:
        return False
    probe = dataclasses.replace(ctx, rule=REGISTRY["NW308"], _now={})
    if next(_loss_spike(probe), None) is not None:
        return True
    if not _same_spike(ctx):
        return False
    hist = list(ctx.history)
    last = max(i for i, t in enumerate(hist) if any(d.code == "NW308" for d in t.diagnoses))
    g = hist[last].grad_norm
    before = [
        x for t in hist[:last] if (x := t.grad_norm) is not None and math.isfinite(x) and x > 0
    ]
    if g is not None and before and g >= ctx.thresholds.explode_factor * max(before):
        return True
    return any(d.code == "NW303" for t in hist[last + 1 :] for d in t.diagnoses)


def _overshoot_diagnosis(
    ctx: RuleContext,
    over: tuple[StepTrace, list[_Raise], _Oversize | None],
    evidence: list[str],
    param: str | None,
    clip_line: str,
) -> Diagnosis:
    """NW303 for gradients that jumped right after an oversized update (the loss did not
    spike with them, or NW308 would say it): the lr is named, not a module."""
    update, raises, big = over
    why, fix, moved, clip = _overshoot_words(raises, big)
    lines = [
        f"the update at step {r.step} ({r.optimizer}, param group {r.group}) used lr "
        f"{fmt(r.new)}, {_times(r.new / r.old)} the {fmt(r.old)} of its update before"
        for r in raises[:2]
    ]
    if big is not None:
        lines.append(big.evidence())
    return ctx.diagnosis(
        parameter=moved or param,
        phase=Phase.BACKWARD.value,
        evidence=[*evidence[:1], *lines, *evidence[1:]],
        explanation=(
            f"The gradients jumped right after the update at step {update.step}: {why}. The "
            "update overshot, so the weights now compute with values training never had, "
            "where the gradient is many times the one it followed: the learning rate made "
            f"this jump, not a module's backward.{clip}"
        ),
        fix=fix if clip else f"{fix}\n{clip_line}   # and, to bound any one step",
    )


def _jumped(ctx: RuleContext) -> Iterator[Diagnosis]:
    """NW303 by the ratio of this step's gradient norms to their recent level, within the
    current regime (:func:`_regime`)."""
    factor = ctx.thresholds.explode_factor
    need = ctx.thresholds.min_history
    if len(ctx.history) < need:
        return
    cur = ctx.memo(ctx.trace, "grad_summary", _grad_summary)
    # a module's output gradient counts alone only when the step measured no update: its
    # window is kept only then (elsewhere its spikes read the history without one)
    kinds = ("total", "params") if _update_seen(cur) else tuple(_ROWS)
    windows = {k: _window_mins(ctx, _ROW_TAG + k, _grad_row(ctx, k)) for k in kinds}
    rounded = _above_rounding(cur)
    shared = _share_of_largest(cur.modules, factor)
    start = _run_start(ctx, need)
    if not _candidates(ctx, cur, rounded, shared, windows):
        return
    regime = _regime(ctx)
    if regime is None or len(regime) < need:
        return
    full = ctx
    if len(regime) < len(ctx.history):
        ctx = dataclasses.replace(ctx, history=regime)
    past = [ctx.memo(t, "grad_summary", _grad_summary) for t in ctx.history]
    evidence: list[str] = []
    totals = [p.total for p in past if p.total is not None and math.isfinite(p.total) and p.total]
    total_spike = False

    def scale(key: str) -> _WeightScale | None:
        # read from the weights only for a norm that jumped: not every step
        return ctx.memo(ctx.trace, "weight_scales", lambda t: _weight_scales(ctx, cur)).get(key)

    level: float | None = None
    if cur.total is not None and math.isfinite(cur.total) and len(totals) >= need:
        med, n = _level(totals, need)
        level = med
        if (
            med > 0
            and cur.total >= factor * med
            and cur.total > _peak(totals, factor, need)
            and not _small_for_weights(cur.total, med, factor, scale(_TOTAL))
        ):
            total_spike = True
            evidence.append(
                f"total gradient norm {fmt(cur.total)} at step {ctx.step}; median of the "
                f"previous {n} steps {fmt(med)} ({_times(cur.total / med)})"
            )
    # without a spike of the total, a parameter or module must jump above its recent level
    jump = not total_spike
    mods = _spikes(ctx, "modules", shared, factor, need, window=windows.get("modules"), jump=jump)
    params = [
        p
        for p in _spikes(ctx, "params", rounded, factor, need, window=windows["params"], jump=jump)
        if not _small_for_weights(p[2], p[3], factor, scale(p[1]))
    ]
    if not total_spike and not params and (not mods or _update_seen(cur)):
        # a module's output gradient alone is no explosion when the update is measured
        # and did not move: F.normalize of an all-zero row (1/eps, multiplied by the
        # zero input), an output layer initialized to 0 whose gradient grows from
        # nothing. Clipping would change nothing.
        return
    if _settled(ctx, start, cur.total, level) or _one_sample_off(ctx, start, cur.total):
        # a fit at its floor met a batch it does not fit: its gradients are back at a
        # level the run trained through, not many times anything the update can overshoot
        return
    clip = _clip_before_step(ctx.trace)
    if clip is not None and (clip[1] is None or cur.total is None or cur.total > clip[1]):
        # your loop clips between backward() and step(): the spike nanwatch measured at the
        # end of backward was rescaled before the optimizer applied it
        return
    for ratio, key, v, med in params[:3]:
        evidence.append(
            f"parameter {key}: gradient norm {fmt(v)} vs median {fmt(med)} ({_times(ratio)})"
        )
    for ratio, key, v, med in mods[:3]:
        evidence.append(
            f"module {key}: max |gradient of its output| {fmt(v)} vs median {fmt(med)} "
            f"({_times(ratio)})"
        )
    path = mods[0][1] if mods else None
    param = params[0][1] if params else None
    names = ctx.memo(ctx.trace, "loop_names", _loop_names)
    max_norm = "1.0"
    if total_spike and cur.total is not None:
        max_norm = _binding_max_norm(_peak(totals, factor, need), cur.total)
    clip_line = (
        f"torch.nn.utils.clip_grad_norm_({names.params}, max_norm={max_norm})  # before "
        f"{names.optimizer}.step()"
    )
    grew = _lr_divergence(ctx) if total_spike else None
    if grew is not None:
        yield ctx.diagnosis(
            path=path,
            parameter=param,
            phase=Phase.BACKWARD.value,
            evidence=[*grew.evidence(), *evidence[1:]],
            explanation=grew.explanation(),
            fix=grew.fix(names.optimizer) + "\n" + clip_line + "   # and, to bound any one step",
        )
        return
    over = _overshot(full)
    if over is not None:
        # the update before this step overshot: the lr made the jump, not a module's
        # backward; NW308 says so where the loss spiked with it
        if not _spike_told(full):
            yield _overshoot_diagnosis(ctx, over, evidence, param, clip_line)
        return
    # the module whose own backward multiplied the gradient past 1 / eps this step, and by
    # far more than it did while the norms were level: the jump began there
    amp = _amplified(ctx, (ctx.trace,), ctx.history)
    if amp is not None:
        lines, explanation, fix = _amplifier_text(ctx, amp, names)
        evidence[1:1] = lines
        yield ctx.diagnosis(
            path=amp.path,
            parameter=param,
            phase=Phase.BACKWARD.value,
            evidence=evidence,
            explanation=explanation,
            fix=fix,
        )
        return
    jumped = _gain_jump(ctx)
    if jumped is not None:
        g, top, n = jumped
        evidence.insert(
            1,
            f"module {g.path} ({g.module_type}) multiplied the gradient {_times(g.gain)} in its "
            f"own backward at step {g.step}: |gradient of its output| {fmt(g.out_grad)}, of "
            f"its input {fmt(g.in_grad)}; at most {fmt(top)}× in each of the "
            f"{count(n, 'step')} before",
        )
        yield ctx.diagnosis(
            path=g.path,
            parameter=param,
            phase=Phase.BACKWARD.value,
            evidence=evidence,
            explanation=(
                f"Module {g.path} ({g.module_type}) multiplied the gradient passing through "
                f"its backward by {_times(g.gain)}, {_times(g.gain / top)} more than in any "
                "step before: the jump began there. Its forward divides by something that "
                "became small for this batch (or takes its sqrt or log, whose derivative "
                "does): a variance or norm near 0 (a normalization of "
                "near-constant values, a variance as E[x²] - E[x]² that cancelled), where an "
                "eps keeps the result finite and the gradient is multiplied by about "
                "1 / sqrt(eps). Clipping bounds the update; the cause is in that forward or "
                "in what it was given."
            ),
            fix=(
                f"# in {g.path}'s forward ({g.module_type}): find what it divides by that "
                f"became small at step {g.step} (a variance, a norm); compute a variance as "
                "((x - mean) ** 2).mean() in float32, and a larger eps bounds the gain at "
                "1 / sqrt(eps)\n"
                f"torch.nn.utils.clip_grad_norm_({names.params}, max_norm={max_norm})  # "
                f"before {names.optimizer}.step(), until then"
            ),
        )
        return
    if _harmless_spike(ctx, start, cur, level):
        # a small norm's one-step jump back within the run's first level, whose update
        # moves the weights by a sliver: clipping would change nothing that matters
        return
    inside = _jumped_inside(ctx, cur, params) if not ctx.trace.full else None
    if inside is not None:
        owner, lines, explanation = inside
        yield ctx.diagnosis(
            path=owner,
            parameter=param,
            phase=Phase.BACKWARD.value,
            evidence=[*evidence, *lines],
            explanation=explanation,
            fix=(
                f"# rerun to step {ctx.step} under nanwatch.watch(model, mode='watch'): it "
                "names the module whose backward multiplied the gradient\n"
                f"torch.nn.utils.clip_grad_norm_({names.params}, max_norm={max_norm})  # "
                f"before {names.optimizer}.step(), until then"
            ),
        )
        return
    yield ctx.diagnosis(
        path=path,
        parameter=param,
        phase=Phase.BACKWARD.value,
        evidence=evidence,
        explanation=(
            "One step's gradients are an order of magnitude above their recent level: a "
            "bad batch, a loss spike, or an instability that grows (attention logits, a "
            "learning rate that is too high for this stage of training). Unclipped, one "
            "such update can undo many steps of training or push weights out of range."
        ),
        fix=clip_line + "\n# and/or lower the learning rate or lengthen the warm-up",
    )


#: the key of :func:`_weight_scales` for the total norm (no parameter is named so)
_TOTAL = ""


@dataclass(frozen=True)
class _WeightScale:
    """A weight's (or all the step's trainable weights') size, against which a gradient
    norm is small or not: ``norm`` (L2), ``noise`` (the gradient norm at its rounding
    level, finfo(dtype).eps × norm) and ``limit`` (sqrt(finfo(dtype).max): a norm past it
    squares past the dtype's range)."""

    norm: float
    noise: float
    limit: float


def _weight_scales(ctx: RuleContext, cur: _GradSummary) -> dict[str, _WeightScale]:
    """For each parameter with a gradient this step, and for them all (key ``_TOTAL``),
    the scale of its weights (:class:`_WeightScale`), from the fact ``weight_norms`` (read
    from the weights, when the watcher gives it; empty otherwise: rules run on records
    alone too)."""
    norms = ctx.facts.get("weight_norms")
    if not isinstance(norms, Mapping) or not cur.params:
        return {}
    out: dict[str, _WeightScale] = {}
    for name in cur.params:
        got = norms.get(name)
        if got is None:
            continue
        dtype, w = got
        t = getattr(torch, dtype, None)
        if isinstance(t, torch.dtype) and t.is_floating_point and math.isfinite(w) and w > 0:
            fi = torch.finfo(t)
            out[name] = _WeightScale(w, fi.eps * w, math.sqrt(fi.max))
    if out:
        each = list(out.values())
        out[_TOTAL] = _WeightScale(
            math.sqrt(sum(s.norm**2 for s in each)),
            math.sqrt(sum(s.noise**2 for s in each)),
            min(s.limit for s in each),
        )
    return out


def _small_for_weights(
    value: float, level: float, factor: float, scale: _WeightScale | None
) -> bool:
    """Whether a gradient norm ``value``, ``factor`` times or more its recent ``level``,
    is still no explosion by the size of its weights (``scale``), far from the dtype's
    limits:

    - from the rounding level: ``level`` at or below ``scale.noise`` (finfo.eps × ||w||),
      where the gradient is numerical noise against its weights (an update lr × g with
      lr <= 1 does not change their rounded values: a loss at its floor, ~0). Noise is no
      level to be many times: the level is that floor, and ``value`` must pass ``factor``
      times it;
    - to a norm still small against the weights: below sqrt(float32 eps) × ||w|| (the
      middle, in orders of magnitude, between float32 rounding noise and the weights
      themselves), where even an lr of 1 moves them by a sliver of their size.

    False without a scale (no weights read)."""
    if scale is None or not value < scale.limit:
        return False
    if level <= scale.noise and value < factor * scale.noise:
        return True
    return value < _SMALL_SHARE * scale.norm


#: a gradient norm below this share of its weights' norm is small against them
#: (sqrt(float32 eps), the middle between float32 rounding noise and the weights)
_SMALL_SHARE = math.sqrt(_EPS32)


def _median_ratio(ctx: RuleContext, kind: str, key: str, value: float) -> float | None:
    """``value`` over the median of ``key``'s recorded values of ``kind`` (``"params"``,
    ``"modules"``) in the history's steps (not 0, at least ``min_history`` of them)."""
    seen = [
        x
        for t in ctx.history
        if (x := getattr(ctx.memo(t, "grad_summary", _grad_summary), kind).get(key)) and x > 0
    ]
    if len(seen) < ctx.thresholds.min_history:
        return None
    med, _ = _level(seen, ctx.thresholds.min_history)
    return value / med if med > 0 else None


def _jumped_inside(
    ctx: RuleContext, cur: _GradSummary, params: list[tuple[float, str, float, float]]
) -> tuple[str, list[str], str] | None:
    """A step that measured only the root's output gradient and the parameters' (sentinel,
    a step ``sample_every`` left out): a parameter's gradient that jumped ``explode_factor``
    times more than the gradient the loss sent back into the model grew inside the model,
    between its output and that parameter's module: multiplied by a backward on the way,
    or by larger inputs to that module. That module, the evidence lines and the
    explanation; None when the jump is not past that, or the step has not one root whose
    output gradient has a level to compare with (two models: which one holds the
    parameter is not measured)."""
    if not params:
        return None
    factor = ctx.thresholds.explode_factor
    ratio, key, _, _ = params[0]
    rec = next((r for r in ctx.trace.records if r.phase is Phase.GRADIENT and r.role == key), None)
    entered = [
        (r, root, v)
        for root, v in cur.modules.items()
        if (r := _median_ratio(ctx, "modules", root, v)) is not None
    ]
    if rec is None or len(cur.modules) != 1 or len(entered) != 1:
        return None
    r_in, root, v_in = entered[0]
    if ratio < factor * max(r_in, 1.0):
        return None
    level = [
        (name, r)
        for name, v in _above_rounding(cur).items()
        if (r := _median_ratio(ctx, "params", name, v)) is not None and 1 / factor <= r < factor
    ]
    lines: list[str] = []
    if r_in < factor:  # a spike of it is in the evidence already
        lines.append(
            f"module {root}: max |gradient of its output| {fmt(v_in)} vs median "
            f"{fmt(v_in / r_in)} ({_times(r_in)}), the gradient the loss sent back into it"
        )
    if level:
        lines.append(
            "parameters whose gradient stayed near its level: "
            + ", ".join(f"{n} ({_times(r)})" for n, r in level[:3])
            + (", ..." if len(level) > 3 else "")
        )
    owner = rec.path
    came = (
        f"stayed near its level ({_times(r_in)})" if r_in < factor else f"rose only {_times(r_in)}"
    )
    explanation = (
        f"The gradient the loss sent back into {root} {came}, while the gradient of {key} "
        f"jumped {_times(ratio)}: the jump happened inside the model, between {root}'s "
        f"output and module {owner} ({rec.module_type}). Either a backward on that path "
        "multiplied the gradient (a forward that divides by a number near 0, with an eps "
        "that keeps it finite: a variance as E[x²] - E[x]² that cancelled, worst in "
        "float16 or bfloat16; x / norm(x) or 1 / x of a tiny x), or what "
        f"{owner} was applied to grew (a weight's gradient is its output's gradient times "
        "its input). Only the model's output gradient and its parameters' gradients were "
        "measured this step (sentinel mode or sample_every): mode='watch' measures each "
        "module's backward and names the one that multiplied it."
    )
    return owner, lines, explanation


def _binding_max_norm(level: float, total: float) -> str:
    """The ``max_norm`` the clip fix suggests, as written: the usual 1.0 where it clips
    this step's ``total``; below that (a clip at 1.0 does nothing to a spike from 1e-3 to
    0.2), the smallest 1, 2, 5 × 10^k at or above ``level`` (the largest total the run
    trained with, :func:`_peak`) and below ``total``, else ``level`` to two digits."""
    if total > 1.0:
        return "1.0"
    k = math.floor(math.log10(level)) if level > 0 else 0
    for e in (k, k + 1):
        for m in (1, 2, 5):
            c = m * 10.0**e
            if level <= c < total:
                return repr(float(f"{c:.0e}"))
    return repr(float(f"{level:.2g}"))


#: a total gradient norm past this share of sqrt(finfo(dtype).max) is huge whatever its
#: history: its square (what a norm sums) is within 1e-6 of the dtype's largest value
_HUGE_SHARE = 1e-3


@functools.lru_cache(maxsize=64)
def _norm_limit(dtypes: frozenset[str]) -> tuple[str, float] | None:
    """The widest of ``dtypes`` (a step's parameter gradients') and 1e-3 × sqrt(finfo.max)
    of it; None for float16 (its range is short: a norm that large is a GradScaler's scale)
    and when no gradient was recorded."""
    best: tuple[str, float] | None = None
    for d in dtypes:
        t = getattr(torch, d, None)
        if not isinstance(t, torch.dtype) or not t.is_floating_point or t == torch.float16:
            continue
        top = torch.finfo(t).max
        if best is None or top > best[1]:
            best = (d, top)
    return (best[0], _HUGE_SHARE * best[1] ** 0.5) if best is not None else None


def _huge_norm(ctx: RuleContext) -> Diagnosis | None:
    """The step's total gradient norm is past ``_HUGE_SHARE`` × sqrt(finfo.max) of the
    gradients' dtype, and no earlier recorded step's was: an explosion from the first
    step, which no median of its own past can show (that past is as huge)."""
    cur = ctx.memo(ctx.trace, "grad_summary", _grad_summary)
    total = cur.total
    lim = _norm_limit(cur.dtypes) if total is not None and math.isfinite(total) else None
    if total is None or lim is None or total < lim[1]:
        return None
    dtype, limit = lim
    for t in ctx.history:
        g = t.grad_norm
        if g is not None and (not math.isfinite(g) or g >= limit):
            return None  # said at the first step past it
    clip = _clip_before_step(ctx.trace)
    if clip is not None and (clip[1] is None or total > clip[1]):
        return None  # clipped before the optimizer applied it
    top = sorted(cur.params.items(), key=lambda kv: -kv[1])[:3]
    top_value = torch.finfo(getattr(torch, dtype)).max
    square = total * total
    evidence = [
        f"total gradient norm {fmt(total)} at step {ctx.step}: past {fmt(limit)}, 1e-3 × "
        f"sqrt(finfo({dtype}).max); its square {fmt(square)} is "
        + (
            f"past {dtype}'s largest value {fmt(top_value)}: a sum of squares in {dtype} is inf"
            if square >= top_value
            else f"within a factor {fmt(top_value / square)} of {dtype}'s largest value"
        )
    ]
    evidence += [f"parameter {k}: gradient norm {fmt(v)}" for k, v in top]
    names = ctx.memo(ctx.trace, "loop_names", _loop_names)
    grew = _lr_divergence(ctx)
    if grew is not None:
        return ctx.diagnosis(
            parameter=top[0][0] if top else None,
            phase=Phase.BACKWARD.value,
            evidence=[*grew.evidence(), *evidence],
            explanation=grew.explanation(),
            fix=(
                grew.fix(names.optimizer)
                + f"\ntorch.nn.utils.clip_grad_norm_({names.params}, max_norm=1.0)  # before "
                f"{names.optimizer}.step(), to bound any one step"
            ),
        )
    amp = _amplified(ctx, (*ctx.history, ctx.trace))
    over = _overshot(ctx) if amp is not None else None
    big = over[2] if over is not None else None
    if (
        amp is not None
        and over is not None
        and big is not None
        and big.param.startswith(f"{amp.path}.")
    ):
        # the update before this step moved this module's own weights by many times their
        # size: its backward multiplies the gradient by those weights, the lr made it
        # (NW308 says it where the loss spiked with it), not a division by a difference
        # that cancelled
        if _spike_told(ctx):
            return None
        clip_line = (
            f"torch.nn.utils.clip_grad_norm_({names.params}, max_norm=1.0)  # before "
            f"{names.optimizer}.step()"
        )
        param = top[0][0] if top else None
        return _overshoot_diagnosis(ctx, over, evidence, param, clip_line)
    if amp is not None:
        lines, explanation, fix = _amplifier_text(ctx, amp, names)
        evidence[1:1] = lines
        return ctx.diagnosis(
            path=amp.path,
            parameter=top[0][0] if top else None,
            phase=Phase.BACKWARD.value,
            evidence=evidence,
            explanation=explanation,
            fix=fix,
        )
    return ctx.diagnosis(
        parameter=top[0][0] if top else None,
        phase=Phase.BACKWARD.value,
        evidence=evidence,
        explanation=(
            f"The gradients are huge from this step on, not after a jump: a norm of "
            f"{fmt(total)} is far beyond any healthy training, and the sum of squares a "
            f"norm or clip computes reaches {dtype}'s overflow. Something between the "
            "loss and the weights multiplies the gradient enormously (an implicit or "
            "fixed-point layer whose backward diverges, a 1 / x of a tiny x, a loss scaled "
            "by hand). Unclipped, the next update throws the weights out of range."
        ),
        fix=(
            f"torch.nn.utils.clip_grad_norm_({names.params}, max_norm=1.0)  # before "
            f"{names.optimizer}.step()\n"
            "# and find what makes the gradient this large: a replay or mode='forensic' "
            "names the op"
        ),
    )


@dataclass(frozen=True)
class _Amplifier:
    """A module whose own backward multiplied the gradient passing through it by more
    than 1 / eps of the gradients' dtype: it divides by a number at the rounding level of
    what that number was computed from."""

    step: int
    path: str
    module_type: str
    out_grad: float  #: max |gradient of its output|
    in_grad: float  #: max |gradient of its input|
    dtype: str
    call: int = -1  #: the id of the call, in its step's trace

    @property
    def gain(self) -> float:
        return self.in_grad / self.out_grad

    def evidence(self) -> str:
        eps = torch.finfo(getattr(torch, self.dtype)).eps
        return (
            f"module {self.path} ({self.module_type}) multiplied the gradient "
            f"{_times(self.gain)} in its own backward at step {self.step}: |gradient of its "
            f"output| {fmt(self.out_grad)}, of its input {fmt(self.in_grad)}; past 1 / eps of "
            f"{self.dtype} ({fmt(1 / eps)})"
        )

    def explanation(self) -> str:
        return (
            f"Module {self.path} ({self.module_type}) multiplies the gradient passing "
            f"through its backward by {_times(self.gain)}, more than 1 / eps of "
            f"{self.dtype}: its forward divides by a number at the rounding level of "
            "what that number was computed from. The usual cause is a difference of "
            "nearly equal numbers that cancelled: a variance as E[x²] - E[x]² of values "
            "far from 0 (worst in float16 or bfloat16), 1 - x for x near 1; an eps added "
            "to it (sqrt(var + eps)) leaves no NaN, but the division by about sqrt(eps) "
            "is what is left. Clipping hides it; the fix is in that forward."
        )

    def fix(self, params: str, optimizer: str) -> str:
        return (
            f"# in {self.path}'s forward ({self.module_type}): compute what it divides by "
            "without cancellation and in float32, cast back after: the variance as "
            "((x - mean) ** 2).mean() of x = x.float(), the result .to() the input's dtype, "
            "or F.layer_norm(x.float(), x.shape[-1:]).to(x.dtype) for the whole "
            "normalization\n"
            f"torch.nn.utils.clip_grad_norm_({params}, max_norm=1.0)  # before "
            f"{optimizer}.step(), until then"
        )


def _tiny_input(trace: StepTrace, call: int) -> tuple[str, float, float] | None:
    """The input of ``call`` (role, min, max) whose values are all positive and whose
    smallest is at most finfo(dtype).eps times its largest (``alpha_bar`` of a noise
    schedule at 3.7e-33 next to 0.99), the smallest such ratio: a division by it makes the
    largest factor; None when no input is so (a sign-mixed input's smallest |x| is not
    known)."""
    best: tuple[str, float, float] | None = None
    for given in trace.inputs_of(call):
        r = trace.resolve(given)  # an input another module made: its output's statistics
        s = r.stat
        t = getattr(torch, r.dtype or "", None)
        if s is None or not (isinstance(t, torch.dtype) and t.is_floating_point):
            continue
        lo, hi = s.min, s.max
        if not (math.isfinite(lo) and math.isfinite(hi)) or not 0 < lo <= hi * torch.finfo(t).eps:
            continue
        if best is None or lo / hi < best[1] / best[2]:
            best = (given.role, lo, hi)
    return best


def _amplifier_text(
    ctx: RuleContext, amp: _Amplifier, names: _LoopNames
) -> tuple[list[str], str, str]:
    """The evidence lines, explanation and fix for a module whose own backward multiplied
    the gradient past 1 / eps: a cancelled difference it divides by (``amp``'s own text), or,
    when one of its inputs held positive values at the rounding level of its largest, a
    division by that input (or its sqrt): a floor under it, not a variance computed again."""
    trace = next((t for t in (ctx.trace, *ctx.history) if t.step == amp.step), None)
    tiny = _tiny_input(trace, amp.call) if trace is not None and amp.call >= 0 else None
    if tiny is None:
        return [amp.evidence()], amp.explanation(), amp.fix(names.params, names.optimizer)
    role, lo, hi = tiny
    m = re.fullmatch(r"input\[(\d+)\]", role)
    known = ctx.facts.get("forward_params")
    params = known.get(amp.path) if isinstance(known, Mapping) else None
    k = int(m.group(1)) if m is not None else -1
    name = str(params[k]) if isinstance(params, (list, tuple)) and 0 <= k < len(params) else ""
    label = f"{name} ({role})" if name else role
    var = name or "d"
    dtype = amp.dtype
    lines = [
        amp.evidence(),
        f"its input {label} holds values from {fmt(lo)} to {fmt(hi)}: the smallest is "
        f"{fmt(lo / hi)} of the largest, below eps of {dtype} "
        f"({fmt(torch.finfo(getattr(torch, dtype)).eps)}); dividing by it multiplies by up "
        f"to {fmt(1 / lo)}, by its sqrt up to {fmt(lo**-0.5)}",
    ]
    explanation = (
        f"Module {amp.path} ({amp.module_type}) multiplies the gradient passing through "
        f"its backward by {_times(amp.gain)}, and its input {label} holds values as small "
        f"as {fmt(lo)} next to {fmt(hi)}: a division by it, or by its square root, in "
        "that forward multiplies the value and its gradient by as much. Such values come "
        "from a quantity that reaches 0 at one end of its range and was rounded to a "
        "tiny number (a noise schedule's cumulative alpha at the last timestep, a "
        "variance, a weight or a probability of 0). Clipping hides it; the fix is a "
        "floor under what the forward divides by, or keeping those values out."
    )
    fix = (
        f"{var} = {var}.clamp_min(torch.finfo({var}.dtype).eps ** 0.5)   # first thing "
        f"in {amp.path}'s forward ({amp.module_type})"
        + ("" if name else f"; {var}: its {role}")
        + f": 1 / {var} stays under 1 / sqrt(eps), 1 / sqrt({var}) under eps ** -0.25\n"
        f"# or keep such values out where {var} is made (clip the schedule or the "
        "variance away from 0)\n"
        f"torch.nn.utils.clip_grad_norm_({names.params}, max_norm=1.0)  # before "
        f"{names.optimizer}.step(), until then"
    )
    return lines, explanation, fix


def _gains(trace: StepTrace) -> dict[str, _Amplifier]:
    """How much each call of a full step multiplied the gradient in its own backward, by
    the records' data flow (the gradient of the output its input came from, ``source``,
    over the gradient of its own output): the largest gain per module."""
    if not trace.full:
        return {}
    grad_of: dict[int, tuple[float, str]] = {}  # forward record index -> its gradient
    for r in trace.records:
        s = r.stat
        if r.phase is Phase.BACKWARD and not r.by_grad and r.source is not None and s is not None:
            m = s.magnitude
            if math.isfinite(m):
                grad_of[r.source] = (max(m, grad_of.get(r.source, (0.0, ""))[0]), r.dtype)
    if not grad_of:
        return {}
    out_grad: dict[int, float] = {}
    for r in trace.records:
        if r.phase is Phase.FORWARD and r.index in grad_of:
            out_grad[r.call] = max(out_grad.get(r.call, 0.0), grad_of[r.index][0])
    found: dict[str, _Amplifier] = {}
    for r in trace.records:
        if r.phase is not Phase.INPUT or r.source is None or r.source not in grad_of:
            continue
        g_out = out_grad.get(r.call)
        g_in, dtype = grad_of[r.source]
        c = trace.call(r.call)
        if not g_out or c is None or c.is_loss:
            continue
        t = getattr(torch, dtype, None)
        if not (isinstance(t, torch.dtype) and t.is_floating_point):
            continue
        amp = _Amplifier(trace.step, c.path, c.module_type, g_out, g_in, dtype, c.id)
        if c.path not in found or amp.gain > found[c.path].gain:
            found[c.path] = amp
    return found


def _amplifiers(trace: StepTrace) -> dict[str, _Amplifier]:
    """The calls of a full step whose backward multiplied the gradient past 1 /
    finfo(dtype).eps (see :func:`_gains`)."""
    return {
        k: a
        for k, a in _gains(trace).items()
        if a.in_grad * torch.finfo(getattr(torch, a.dtype)).eps > a.out_grad
    }


def _gain_jump(ctx: RuleContext) -> tuple[_Amplifier, float, int] | None:
    """The module whose own backward multiplied the gradient more than 1× this step and
    ``explode_factor`` times more than in each history step that measured it (at least
    ``min_history`` of them), the largest such jump: where a jump of the gradient norms
    began, though its gain stays below 1 / eps (a division by sqrt(eps) of a variance
    that became 0 multiplies by 1 / sqrt(eps)), and sent back a gradient of at least
    1 / explode_factor**2 of the step's largest. It, its largest gain before and how many
    steps measured it; None when no module's gain jumped."""
    factor = ctx.thresholds.explode_factor
    need = ctx.thresholds.min_history
    past = [ctx.memo(t, "gains", _gains) for t in ctx.history]
    # the gradient it sent back must be a share of the step's largest that moves the
    # update (see _share_of_largest): a large ratio of two slivers of gradient is no jump
    largest = max(ctx.memo(ctx.trace, "grad_summary", _grad_summary).modules.values(), default=0.0)
    best: tuple[_Amplifier, float, int] | None = None
    for path, g in ctx.memo(ctx.trace, "gains", _gains).items():
        if g.gain <= 1.0 or g.in_grad * factor * factor < largest:
            continue
        before = [p[path].gain for p in past if path in p]
        if len(before) < need or g.gain < factor * max(before):
            continue
        if best is None or g.gain / max(before) > best[0].gain / best[1]:
            best = (g, max(before), len(before))
    return best


def _amplified(
    ctx: RuleContext, traces: Sequence[StepTrace], level: Sequence[StepTrace] = ()
) -> _Amplifier | None:
    """The module whose backward multiplied the gradient the most in ``traces``, past 1 /
    eps of its dtype; with ``level`` (the steps whose gradients the jump is measured
    against), only one that multiplied it ``explode_factor`` times more than it did in
    each of those steps: a module that multiplied it as much while the norms stayed level
    did not make the jump."""
    factor = ctx.thresholds.explode_factor
    before = [ctx.memo(t, "amplifiers", _amplifiers) for t in level]
    best: _Amplifier | None = None
    for t in traces:
        for amp in ctx.memo(t, "amplifiers", _amplifiers).values():
            if any(
                (old := b.get(amp.path)) is not None and amp.gain < factor * old.gain
                for b in before
            ):
                continue
            if best is None or amp.gain > best.gain:
                best = amp
    return best


_CLIP_CALLS = frozenset(
    ("clip_grad_norm_", "clip_grad_norm", "clip_grad_value_", "clip_grads_with_norm_")
)


def _clip_before_step(trace: StepTrace) -> tuple[str, float | None, str, str | None] | None:
    """Where the user's code clips the gradients between ``backward()`` and the next
    ``.step()`` (``clip_grad_norm_``, ``clip_grad_value_``), read from the function of the
    user's lines this step's notes name (the loss line): the clip's ``file:line``, its
    ``max_norm`` when that is a number written there (None: a value clip, a variable;
    ``inf`` for ``float("inf")``), the function's name and its first argument's source.
    None when no such clip is found (a clip after ``step()`` clips nothing applied).
    With no such line (``loss = -flow(x).mean()`` calls no loss: the optimizer's note has
    no source), the user's line running the rules now: the loop's ``nw.step()`` or the
    next step's forward, in the function that also calls ``backward()`` and ``step()``."""
    seen: set[str] = set()
    sources: list[str | None] = [n.source for n in trace.notes if n.source]
    if not sources:
        sources = [_running_line()]
    for source in sources:
        if not source or source in seen:
            continue
        seen.add(source)
        found = _user_scope(source)
        if found is None:
            continue
        path, _, scope = found
        calls: list[tuple[int, int, str, ast.Call]] = []
        for node in ast.walk(scope):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            kind = "clip" if name in _CLIP_CALLS else name if name in ("backward", "step") else ""
            if kind:
                calls.append((node.lineno, node.col_offset, kind, node))
        calls.sort(key=lambda c: (c[0], c[1]))
        after_backward = False
        for lineno, _, kind, call in calls:
            if kind == "backward":
                after_backward = True
            elif kind == "step":
                after_backward = False
            elif after_backward:
                f = call.func
                fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                first = ast.unparse(call.args[0]) if call.args else None
                return f"{path}:{lineno}", _max_norm(call), fname, first
    return None


def _running_line() -> str | None:
    """``file:line`` of the innermost user frame on the stack (full path), or None."""
    f = _frames.user_frame(sys._getframe(1))
    return None if f is None else f"{f.f_code.co_filename}:{f.f_lineno}"


def _max_norm(call: ast.Call) -> float | None:
    """The ``max_norm`` a ``clip_grad_norm_`` call writes as a number, else None."""
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
    if not name.startswith("clip_grad_norm"):
        return None
    arg = next((k.value for k in call.keywords if k.arg == "max_norm"), None)
    if arg is None and len(call.args) >= 2:
        arg = call.args[1]
    if _infinite(arg):
        return math.inf
    try:
        v = ast.literal_eval(arg) if arg is not None else None
    except ValueError:
        return None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _infinite(node: ast.expr | None) -> bool:
    """``float("inf")``, ``math.inf``, ``torch.inf``, ``np.inf``: the max_norm of a clip
    written only to log the norm."""
    if isinstance(node, ast.Attribute):
        return node.attr == "inf"
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "float"
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return node.args[0].value.strip().lower().lstrip("+") in ("inf", "infinity")
    return False


# ---------------------------------------------------------------------- NW304


def _starved(trace: StepTrace) -> set[str]:
    """Modules every call of which this step got no samples: all its inputs, all its
    outputs or all its output gradients have 0 elements (``box_head(feats[pos])`` with no
    positive, an MoE expert routed no token). Such a call passes its weights a gradient of
    exactly 0 because it computed nothing, not because anything vanished."""
    shapes: dict[tuple[int, Phase], list[bool]] = {}
    paths: dict[int, str] = {}
    for r in trace.records:
        if r.call < 0 or r.phase not in (Phase.INPUT, Phase.FORWARD, Phase.BACKWARD):
            continue
        if r.phase is Phase.BACKWARD and not r.role.startswith("output"):
            continue  # the gradient a call passes back to its inputs, not one it got
        paths.setdefault(r.call, r.path)
        shapes.setdefault((r.call, r.phase), []).append(math.prod(r.shape) == 0)
    empty: dict[str, bool] = {}
    for call, path in paths.items():
        none = any(all(shapes.get((call, ph), [False])) for ph in Phase)
        empty[path] = empty.get(path, True) and none
    return {p for p, e in empty.items() if e}


def _zero_stat(s: TensorStat) -> bool:
    return s.norm == 0.0 or s.max == s.min == 0.0


def _input_zeroed(grads: Sequence[Record]) -> bool:
    """A layer's weight gradient is exactly 0 while its bias's is not: its input was exactly
    0 (a weight gradient is the input times the output gradient), so backward reached it and
    the layers before it got zeros this step, not a stale .grad."""
    zero_w = {
        r.path
        for r in grads
        if r.role.endswith(".weight") and r.stat is not None and _zero_stat(r.stat)
    }
    return any(
        r.path in zero_w
        and r.role.endswith(".bias")
        and r.stat is not None
        and not _zero_stat(r.stat)
        for r in grads
    )


def _low_precision_backward(trace: StepTrace) -> bool:
    """A root's output gradient this step is float16 or bfloat16: backward ran in a dtype
    whose small gradients underflow to exactly 0."""
    return any(
        r.phase is Phase.BACKWARD and r.dtype in ("float16", "bfloat16") for r in trace.records
    )


def _zero_grads(trace: StepTrace) -> tuple[set[str], set[str], dict[str, str], set[str]]:
    """Modules whose every output gradient was exactly zero this step, modules whose every
    parameter gradient was zero, each module's gradient dtype, and the modules of the
    second kind known to be zero only by a norm of 0 (the squares of values below
    :func:`_norm_floor` underflow: zero or tiny)."""
    seen: dict[str, bool] = {}
    pseen: dict[str, bool] = {}
    dtypes: dict[str, str] = {}
    by_norm: set[str] = set()
    zero = False  # any gradient exactly 0 (or of norm 0): none on most steps, nothing to do
    grad_phases = (Phase.BACKWARD, Phase.GRADIENT)
    for r in trace.records:
        s = r.stat
        if s is None:
            continue
        if s.has_nan or s.has_posinf:
            # a step with NaN says nothing of vanishing gradients: L1's sign(NaN) is 0, and a
            # gradient of 0 there is the NaN's doing, not dead units
            return set(), set(), dtypes, by_norm
        if not zero and r.phase in grad_phases:
            zero = (s.min == 0.0 and s.max == 0.0) or s.norm == 0.0
    if not zero:
        return set(), set(), dtypes, by_norm
    called = {r.path for r in trace.records if r.phase is Phase.FORWARD}
    # a module none of whose outputs has an autograd node ran outside the graph: its
    # parameters do not require grad (frozen with requires_grad_(False)) or it ran under
    # torch.no_grad(), so this backward gave them nothing; a zero .grad there is stale
    # (zero_grad(set_to_none=False)), not dead units
    graphed = {r.path for r in trace.records if r.phase is Phase.FORWARD and r.grad_fn}
    reached = {r.path for r in trace.records if r.phase is Phase.BACKWARD}
    called &= graphed | reached
    if not trace.full and called:
        # sentinel records the roots' calls only: the weights of a root whose forward ran
        # in the graph and got a backward are its modules' (a frozen weight keeps no .grad).
        # A module whose every weight gradient is exactly 0 counts only where the backward
        # ran in float16/bfloat16, whose gradients underflow, or was cut inside the model
        # (a layer whose weight gradient is 0 and its bias's is not: its input was 0). Else
        # its .grad may be stale (an unused head's after zero_grad(set_to_none=False)),
        # which sentinel cannot tell from a new one; a non-zero gradient is in the graph
        grads = [r for r in trace.records if r.phase is Phase.GRADIENT]
        if _low_precision_backward(trace) or _input_zeroed(grads):
            called |= {r.path for r in grads}
        else:
            called |= {r.path for r in grads if r.stat is not None and not _zero_stat(r.stat)}
    if trace.full and reached:
        # a module whose own output gradient was hooked (measured, with an autograd node)
        # but that no backward of this step reached: its output was not in the loss (an
        # auxiliary head added only every k steps), so a zero .grad is stale, not dead units
        hooked = {
            r.path
            for r in trace.records
            if r.phase is Phase.FORWARD and r.grad_fn and r.stat is not None and r.source is None
        }
        called -= hooked - reached
    # a module that got no samples this step (a 0-row input) is absent, not dead
    starved = _starved(trace)
    called -= starved
    every = _by_grad_only(trace)
    # the calls torch.autograd.grad differentiated (a gradient penalty's D(x_hat)): the
    # training backward reaches them through that gradient, a second derivative that is
    # exactly 0 through piecewise-linear layers; neither kind tells of dead units
    penalized = set() if every else {r.call for r in trace.records if r.by_grad}
    padded = _padding_lookups(trace)
    for r in trace.records:
        s = r.stat
        if s is None or not s.finite:
            continue
        if r.phase is Phase.BACKWARD:
            if (not every and (r.by_grad or r.call in penalized)) or r.path in starved:
                continue
            zero = s.min == 0.0 and s.max == 0.0
            seen[r.path] = seen.get(r.path, True) and zero
            dtypes.setdefault(r.path, r.dtype)
        elif r.phase is Phase.GRADIENT and r.path in called and r.path not in padded:
            zero = s.norm == 0.0 if s.norm is not None else (s.min == 0.0 and s.max == 0.0)
            pseen[r.path] = pseen.get(r.path, True) and zero
            dtypes.setdefault(r.path, r.dtype)
            if s.norm is not None:
                by_norm.add(r.path)
    out = {p for p, z in seen.items() if z}
    if penalized and any(not pseen.get(p, True) for p in out):
        # a module whose every output gradient was 0 while its parameters got a non-zero
        # gradient, in a step that differentiated calls with torch.autograd.grad: the
        # training gradients came through that derivative graph (a PINN's residual, with
        # create_graph=True), whose calls are left out above; the zeros seen (a boundary
        # term exactly 0 by construction) tell of no dead units this step, for any module
        out = set()
    return (
        out,
        {p for p, z in pseen.items() if z},
        dtypes,
        by_norm,
    )


#: lookups whose ``padding_idx`` row is 0 and gets no gradient
_EMBEDDINGS = frozenset(("Embedding", "EmbeddingBag"))


def _padding_lookups(trace: StepTrace) -> set[str]:
    """Embeddings whose every output this step was exactly 0: every id looked up was the
    ``padding_idx`` (its row is 0 and gets no gradient) or every bag was empty (a
    multi-hot feature absent from the whole batch: cold-start users). A weight gradient of
    0 there is the data's, not dead units; the next batch with a real id moves it."""
    zero: dict[str, bool] = {}
    for r in trace.records:
        if r.phase is Phase.FORWARD and r.module_type in _EMBEDDINGS:
            s = r.stat
            z = s is not None and s.finite and s.min == 0.0 and s.max == 0.0
            zero[r.path] = zero.get(r.path, True) and z
    return {p for p, z in zero.items() if z}


def _tiniest(dtype: str) -> float:
    """The smallest positive value of ``dtype`` (a subnormal); 0 when unknown."""
    lim = limits(dtype)
    return lim.subnormal if lim is not None else 0.0


def _norm_floor(dtype: str) -> float:
    """Below this, a value's square rounds to 0 where a gradient norm is summed (float32,
    or float64 for float64 gradients): a norm of 0 says every value is at most this."""
    lim = limits("float64" if dtype == "float64" else "float32")
    assert lim is not None
    # below half the smallest subnormal a square rounds to 0 (sqrt of each factor: the
    # product itself underflows for float64)
    return math.sqrt(lim.tiny) * math.sqrt(lim.eps / 2)


def _loss_end(trace: StepTrace) -> Record | None:
    """The first gradient backward computes from the loss: the first measured gradient of a
    module's output or input that is not the loss's own (the gradient of a one-value
    output, 1 by definition)."""
    every = _by_grad_only(trace)
    for r in trace.records:
        if r.phase is not Phase.BACKWARD or r.stat is None or (r.by_grad and not every):
            continue
        src = trace.record(r.source) if r.source is not None else None
        if src is not None:
            src = trace.resolve(src)
            if (src.stat is not None and src.stat.numel == 1) or src.shape == ():
                continue
        elif r.stat.numel == 1:
            continue
        return r
    return None


def _loss_dtype(trace: StepTrace) -> str:
    """The dtype the loss was computed in: its one-value output's (float32 if unknown)."""
    for r in trace.records:
        if r.phase is Phase.BACKWARD and r.source is not None:
            src = trace.record(r.source)
            if src is not None and src.shape == ():
                return src.dtype
    return "float32"


def _learned_scalar(trace: StepTrace) -> str | None:
    """A trained one-value parameter (a learnable logit scale or temperature): its name."""
    for r in trace.records:
        if r.phase is Phase.GRADIENT and math.prod(r.shape) == 1 and r.dtype.startswith("float"):
            if r.role.rsplit(".", 1)[-1] == "bias":
                continue  # a one-output layer's bias (Linear(d, 1)): no scale of logits
            return r.role
    return None


def _flat_loss(ctx: RuleContext, traces: list[StepTrace], names: str) -> Diagnosis | None:
    """The zero starts at the loss: the gradient leaving it is exactly 0 and the loss is
    exactly 0, step after step. The loss does not depend on the outputs (saturated, or
    divided by an inf): neither underflow along the layers nor dead units."""
    ends: list[Record] = []
    for t in traces:
        r = _loss_end(t)
        s = r.stat if r is not None else None
        if r is None or s is None or not (s.min == 0.0 and s.max == 0.0):
            return None
        ends.append(r)
    now = ctx.trace.loss
    # the same value step after step, and not 0: a loss that does not depend on the
    # outputs at all (1 - 2·inter / inf of a float16 dice), not one that reached a minimum
    const = now is not None and now != 0.0 and math.isfinite(now)
    const = const and all(t.loss == now for t in traces) and _inputs_moved(traces, ends)
    if now != 0.0 and not const:  # exactly 0 now; on the way there a saturating loss is tiny
        return None
    trace = ctx.trace
    end = ends[-1]
    src = trace.record(end.source) if end.source is not None else None
    out = trace.resolve(src) if src is not None else None
    ldtype = _loss_dtype(trace)
    llim = limits(ldtype) or limits("float32")
    assert llim is not None
    resolve = math.log(1 / llim.eps)
    f16 = limits("float16")
    assert f16 is not None
    evidence = [
        f"{names}: every gradient exactly 0 for the last {len(traces)} steps",
        f"the zero starts at the loss: the gradient of {end.path}'s {end.role}, the first "
        f"one backward computes from the loss, is exactly 0 ({end.dtype}, shape "
        f"{list(end.shape)})",
        (
            f"the loss is exactly {fmt(now)} at steps {traces[0].step} to {traces[-1].step}"
            + (": it does not move" if const else "")
            if all(t.loss == now for t in traces)
            else f"the loss at steps {traces[0].step} to {traces[-1].step}: "
            + ", ".join(fmt(t.loss) if t.loss is not None else "?" for t in traces)
            + ": exactly 0 now"
        ),
    ]
    spread: float | None = None
    if out is not None and out.stat is not None and out.stat.finite and out.stat.numel > 1:
        spread = out.stat.max - out.stat.min
        if spread > resolve:
            evidence.append(
                f"{out.path}'s output spans {fmt(out.stat.min)} to {fmt(out.stat.max)}: a "
                f"spread of {fmt(spread)}, past {fmt(resolve)} = log(1/eps) of {ldtype} (eps "
                f"{fmt(llim.eps)}), the loss's dtype: a softmax over it gives the target "
                "probability 1 exactly, and cross-entropy 0"
            )
    saturated = spread is not None and spread > resolve
    # the cross-entropy's own input (z1 @ z2.T / T): a scale or temperature applied after
    # the model may saturate the softmax where the model's outputs do not
    scaled = False
    span = None if saturated else _ce_input_span(trace)
    if span is not None and span[2] - span[1] > resolve:
        name, lo, hi = span
        evidence.append(
            f"{name}'s input spans {fmt(lo)} to {fmt(hi)}: a spread of {fmt(hi - lo)}, past "
            f"{fmt(resolve)} = log(1/eps) of float32, the softmax's precision: the target "
            "probability is 1 exactly, and cross-entropy 0"
            + (
                f"; {out.path}'s output spreads only {fmt(spread)}: what scales it on the way "
                "(a temperature, a logit scale) saturates the softmax"
                if out is not None and spread is not None
                else ""
            )
        )
        saturated = True
        scaled = spread is not None
    dtypes = [end.dtype, out.dtype if out is not None else None]
    dtypes += [
        str(n.data.get("input_upcast_from") or n.data.get("input_dtype"))
        for n in trace.notes
        if n.kind == "loss_input"
    ]
    low = [d for d in dtypes if (lim := low_precision(d)) is not None and lim.short_range]
    divided = bool(low) and not saturated
    if divided:
        dmax = low_precision(low[0]) or f16
        evidence.append(
            f"the loss's inputs are {low[0]}: a count or a sum taken in {low[0]} is inf past "
            f"{fmt(dmax.max)} (finfo({low[0]}).max), and x / inf = 0"
        )
    scalar = _learned_scalar(trace)
    margin = _margin_loss(trace)
    zero = all(t.loss == 0.0 for t in traces)
    factor = None if divided else _zero_factor(trace)
    if factor is not None and zero:
        # the loss function's own value is not 0, or cannot be: a factor after it is
        return _loss_times_zero(ctx, end, [*evidence, *factor[0]], factor[1], len(traces))
    one = _softmax_of_one(trace)
    plain = margin is None and scalar is None and not saturated  # no other way to 0 in sight
    if zero and not divided and (one is not None or (plain and _zero_from_start(ctx))):
        # no update brought it to 0: it was 0 before any could, or a softmax over one
        # element makes it so whatever the outputs
        before = _updates_before(ctx) if one is None else None
        if before is not None and before[1] > 0:
            # the model trained before the watch began: the loss came down to 0 then
            opt, count, total = before
            line = (
                f"{opt} made {count} updates before the watch began (its state's step count "
                f"is {total}, {total - count} of them watched): the loss came down to 0 before "
                "the watch could see it"
            )
            return _loss_at_minimum(ctx, end, [*evidence, line], margin, len(traces))
        moved = out if _inputs_moved(traces, ends) else None
        return _zero_from_the_start(
            ctx,
            end,
            evidence,
            moved,
            one=one,
            steps=len(traces),
            # (once told from the first step, it stays told as the window moves on)
            fresh=before is not None
            or any(
                d.code == "NW304" and d.title == _FROM_START
                for t in ctx.history
                for d in t.diagnoses
            ),
        )
    if (margin is not None or not (saturated or divided)) and scalar is None and zero:
        return _loss_at_minimum(ctx, end, evidence, margin, len(traces))
    if saturated and not (divided or scaled) and scalar is None and zero and _softmax_loss(trace):
        # a cross-entropy at 0 over logits spread past what its dtype resolves: each
        # target's probability rounds to 1, the loss's floor; nothing in it is learned
        return _loss_at_minimum(ctx, end, evidence, None, len(traces), floor=ldtype)
    sat = (
        "the loss is saturated to exactly 0: a softmax or cross-entropy whose logits spread "
        f"past what {ldtype} resolves (about {fmt(resolve)}) gives the target probability 1 "
        "exactly; a temperature too small, or a learnable scale or temperature that grew, "
        "does this (clamp it), and so does a margin or hinge satisfied everywhere"
    )
    inf = (
        "the loss was divided by inf: a count or sum taken in float16 passes "
        f"{fmt(f16.max)} (finfo(float16).max) and becomes inf, and x / inf = 0 (take it in "
        "float32)"
    )
    first, second = (inf, sat) if divided else (sat, inf)
    explanation = (
        "The gradient leaving the loss is already exactly 0, and the loss is "
        + (f"{fmt(now)} step after step" if const else "exactly 0")
        + ": the loss does not depend on the outputs, so no layer gets a gradient. This is "
        "neither underflow along the layers (a GradScaler multiplies 0 by its scale and "
        "still gets 0) nor dead units. "
        + (
            f"The usual causes: {first}; or {second}."
            if not const
            else f"The usual cause: {inf}."
            if divided
            else "The usual causes: a division by an inf, or a function saturated at every "
            "element (a clamp, a sigmoid at 0 or 1) between the outputs and the loss."
        )
    )
    if scalar is not None:
        clamp = (
            "clamp_(min=0.01)   # a learned temperature: keep it above 0.01"
            if "temp" in scalar.lower() or "tau" in scalar.lower()
            else "clamp_(0, math.log(100))   # CLIP's cap: a learned log-scale <= log(100)"
        )
        sat_fix = (
            "import math\n"
            "with torch.no_grad():   # after each optimizer.step()\n"
            f'    model.get_parameter("{scalar}").{clamp}'
        )
    else:
        sat_fix = (
            "# a learned logit scale or temperature that grew: clamp it after each step, as\n"
            "# CLIP does: with torch.no_grad(): logit_scale.clamp_(0, math.log(100))"
        )
    inf_fix = (
        "# a count or a sum in float16 is inf past 65504 and loss / inf = 0: take it in float32\n"
        "n = mask.sum().float()   # not mask.sum().to(x.dtype)\n"
        "s = x.float().sum()      # not x.sum() of a float16 tensor"
    )
    if divided:
        fix = (
            inf_fix
            + "\n# or, a saturated loss:\n"
            + "\n".join("# " + ln if not ln.startswith("#") else ln for ln in sat_fix.splitlines())
        )
    else:
        fix = (
            sat_fix
            + "\n# a margin or hinge loss at 0 everywhere: nothing is left to learn from it"
            + "\n# or, a loss divided by a float16 count: n = mask.sum().float()"
        )
    return ctx.diagnosis(
        title="Zero gradients: the loss does not depend on the outputs",
        path=end.path,
        phase=Phase.BACKWARD.value,
        evidence=evidence,
        explanation=explanation,
        fix=fix,
    )


_FROM_START = "Zero gradients: the loss is 0 from the first step, it never came down"
#: the same, where the watch began after training had (or may have): said of the watch only
_SINCE_WATCH = "Zero gradients: the loss is 0 at every step since the watch began"


def _updates_before(ctx: RuleContext) -> tuple[str, int, int] | None:
    """How many updates the model's optimizer made before the watch began: its class, the
    count, and its state's step count, read from the optimizer in the user's frames (the
    step count Adam, AdamW, RMSprop... keep per weight) less the updates the watch saw
    (its notes since step 0). None when it cannot be told (SGD keeps no count)."""
    traces = (*ctx.history, ctx.trace)
    if traces[0].step != 0:
        return None
    notes = [n for t in traces for n in t.notes if n.kind == "optimizer"]
    if not notes:
        return None
    ident = notes[-1].data.get("ident")
    seen = sum(1 for n in notes if n.data.get("ident") == ident)
    got = _held_as(lambda v: isinstance(v, torch.optim.Optimizer) and id(v) == ident)
    if got is None:
        return None
    counts: list[float] = []
    for state in list(getattr(got[1], "state", {}).values())[:64]:
        step = state.get("step") if isinstance(state, dict) else None
        if isinstance(step, torch.Tensor) and step.numel() == 1 and step.device.type == "cpu":
            counts.append(float(step.item()))
        elif isinstance(step, (int, float)):
            counts.append(float(step))
    if not counts:
        return None
    total = int(max(counts))
    return notes[-1].path, max(total - seen, 0), total


def _zero_from_start(ctx: RuleContext) -> bool:
    """Whether the loss was exactly 0 at every step since the watch began (its first step,
    step 0, is still in the history): no update brought it there. Once said, it stays said
    after the history's window moves past step 0."""
    hist = ctx.history
    if any(
        d.code == "NW304" and d.title.startswith((_FROM_START, _SINCE_WATCH))
        for t in hist
        for d in t.diagnoses
    ):
        return True
    first = hist[0] if hist else ctx.trace
    return first.step == 0 and all(t.loss == 0.0 for t in (*hist, ctx.trace))


def _softmax_of_one(trace: StepTrace) -> tuple[Note, dict[str, Any]] | None:
    """A loss call of this step whose input came from a softmax or log_softmax over a dim
    of size 1 (the guard read it from the autograd graph), with what the guard kept."""
    for n in trace.notes:
        one = n.data.get("input_softmax_of_one") if n.kind == "loss_input" else None
        if isinstance(one, dict) and isinstance(one.get("shape"), list):
            return n, one
    return None


def _class_dim(note: Note, shape: list[int], dim: int) -> tuple[int, int] | None:
    """The dim of a softmax's ``shape`` that holds the classes of ``note``'s loss: the one
    whose size is the loss input's class count (dim 1 of an (N, C, ...) input, the last of
    any other), nearest ``dim``; with that size. None when no other dim has it."""
    ishape = note.data.get("input_shape")
    if not isinstance(ishape, list) or not ishape:
        return None
    loss = str(note.data.get("loss", note.path)).lower()
    ce = "nll" in loss or "cross_entropy" in loss or "crossentropy" in loss
    c = ishape[1] if ce and len(ishape) > 1 else ishape[-1]
    dims = [i for i, n in enumerate(shape) if n == c and n > 1 and i != dim]
    return (min(dims, key=lambda i: abs(i - dim)), int(c)) if dims else None


def _same_arguments(note: Note | None) -> tuple[str, str] | None:
    """The loss line's loss call given one expression as both its input and its target
    (``F.mse_loss(pred, pred)``): that expression, and the call with ``target`` in its
    second place; None otherwise or when unknown."""
    line = _loss_line_of(note) if note is not None else None
    if line is None:
        return None
    try:
        tree = ast.parse(line.removeprefix("return ").strip())
    except SyntaxError:
        return None
    for c in ast.walk(tree):
        if isinstance(c, ast.Call) and len(c.args) >= 2:
            a, b = ast.unparse(c.args[0]), ast.unparse(c.args[1])
            if a == b:
                c.args[1] = ast.Name("target")
                return a, ast.unparse(c)
    return None


def _zero_from_the_start(
    ctx: RuleContext,
    end: Record,
    evidence: list[str],
    out: Record | None,
    *,
    one: tuple[Note, dict[str, Any]] | None,
    steps: int,
    fresh: bool = False,
) -> Diagnosis:
    """The loss is exactly 0, and its gradient with it, at every step since the watch
    began (or a softmax over a dim of size 1 makes it so): it did not come down to a
    minimum, it does not depend on the outputs. A warning: nothing trains. ``fresh``: the
    optimizer's state shows the watch began with its first update; without it, or a cause
    that makes the loss 0 whatever the weights, it is said of the watch only (a watch
    begun mid-training cannot see the loss come down)."""
    trace = ctx.trace
    evidence = [*evidence]
    first = ctx.history[0].step if ctx.history else trace.step
    start = _zero_from_start(ctx)
    since = len(evidence)
    if start:
        # (said of the whole run, in place of the window's line)
        evidence = [e for e in evidence if not e.startswith("the loss is exactly 0 at steps")]
        since = len(evidence)
        evidence.append(
            f"the loss is exactly 0 at every step since the watch began (steps {first} to "
            f"{trace.step}): no update brought it there, it started there"
        )
    structural = one is not None
    notes = [n for n in trace.notes if n.kind == "loss_input"]
    note = one[0] if one is not None else (notes[0] if notes else None)
    where = f" ({os.path.basename(note.source)})" if note is not None and note.source else ""
    line = _loss_line_of(note) if note is not None else None
    head = f"# the loss line{where}: {line}\n" if line is not None else ""
    if one is not None:
        n, data = one
        shape, dim = data["shape"], int(data["dim"])
        op = "log_softmax" if data.get("node") == "LogSoftmaxBackward0" else "softmax"
        value = "exactly 0 (log 1)" if op == "log_softmax" else "exactly 1 (its log 0)"
        evidence.append(
            f"{n.path}'s input comes from a {op} ({data.get('node')}) over dim {dim} of size "
            f"1 (its result's shape {shape}): a {op} over one element is {value} whatever the "
            "logits"
        )
        cls = _class_dim(n, shape, dim)
        if cls is not None:
            fix = (
                f"{head}# the {op} normalizes over dim {dim}, of size 1 (shape {shape}): "
                f"normalize over the classes, the dim of size {cls[1]}\n"
                f"p = torch.{op}(logits, dim={cls[0]})   # dim={cls[0]} of {shape}, not a dim "
                "of size 1"
            )
        else:
            fix = (
                f"{head}# the {op} normalizes over dim {dim}, of size 1 (shape {shape}): "
                "normalize over the dim that holds the classes"
            )
        why = (
            f" A {op} over a dim of size 1 is {value} for any input: the loss is the same "
            "whatever the model outputs."
        )
    else:
        same = _same_arguments(note)
        if same is not None and note is not None:
            structural = True
            evidence.append(
                f"{note.path} compares {same[0]} with itself (the loss line{where}): 0 "
                f"whatever {same[0]} is"
            )
        lo, hi = (
            (note_num(note, "input_min"), note_num(note, "input_max")) if note else (None, None)
        )
        if note is not None and lo is not None and lo == hi:
            structural = True
            evidence.append(
                f"{note.path}'s input is exactly {fmt(lo)} everywhere (shape "
                f"{note.data.get('input_shape')}): the same whatever the model outputs"
            )
        if out is not None:
            evidence.append(
                f"{out.path}'s output takes other values from step to step while the loss "
                "stays 0: the loss does not follow it"
            )
        fix = (
            f"{head}loss = {same[1]}   # the labels, not {same[0]} itself"
            if same is not None
            else f"{head}# the loss is 0 whatever the outputs: print what it is computed from, "
            "before loss.backward()\n"
            "print(loss.grad_fn, loss.grad_fn.next_functions)   # the ops between the outputs "
            "and the loss: a softmax over a dim of size 1, a target that is the prediction "
            "itself, a detach"
        )
        why = ""
    if start and not (structural or fresh):
        # the watch may have begun after training did (its first step is the watch's, not
        # training's): the loss may have come down to 0 before, unseen
        evidence[since] = (
            f"the loss is exactly 0 at every step since the watch began (steps {first} to "
            f"{trace.step}): no update since then moved it"
        )
        return ctx.diagnosis(
            title=f"{_SINCE_WATCH} (step {first}), it does not move",
            path=end.path,
            phase=Phase.BACKWARD.value,
            evidence=evidence,
            explanation=(
                f"The loss is exactly 0 for the last {steps} steps, and the gradient leaving "
                "it is exactly 0, so no layer gets a gradient. The steps before the watch "
                "began are not seen: if the loss came down to 0 then (a hinge, a "
                "relu(margin - score), met by every example), it is at its minimum and "
                "nothing is left to learn; if it was 0 from training's first step, it does "
                "not depend on the outputs and nothing trains. Neither underflow along the "
                "layers nor dead units."
            ),
            fix=fix.replace("# the loss is 0 whatever the outputs:", "# if it should not be 0:")
            + "\n# watched from training's first step, nanwatch tells the two apart",
        )
    return ctx.diagnosis(
        title=_FROM_START,
        path=end.path,
        phase=Phase.BACKWARD.value,
        evidence=evidence,
        explanation=(
            f"The loss is exactly 0 for the last {steps} steps, and the gradient leaving it "
            "is exactly 0"
            + (
                ", and it was 0 before any update could bring it down: it did not reach a minimum"
                if start
                else ""
            )
            + ". The loss does not depend on the outputs, so no layer gets a gradient and "
            f"nothing trains.{why} Neither underflow along the layers nor dead units."
        ),
        fix=fix,
    )


#: losses that are exactly 0 once every margin is met (a hinge), with their gradients
_MARGIN_LOSSES = frozenset(
    {
        "MultiMarginLoss",
        "MultiLabelMarginLoss",
        "HingeEmbeddingLoss",
        "MarginRankingLoss",
        "TripletMarginLoss",
        "TripletMarginWithDistanceLoss",
        "CosineEmbeddingLoss",
        "multi_margin_loss",
        "multilabel_margin_loss",
        "hinge_embedding_loss",
        "margin_ranking_loss",
        "triplet_margin_loss",
        "triplet_margin_with_distance_loss",
        "cosine_embedding_loss",
    }
)


def _margin_loss(trace: StepTrace) -> str | None:
    """The margin (hinge) loss this step computed, by its class or function name, when one
    is in evidence (a watched criterion, a guarded functional loss); else None."""
    for c in trace.calls:
        if c.module_type in _MARGIN_LOSSES:
            return c.module_type
    for n in trace.notes:
        loss = n.data.get("loss") if n.kind == "loss_input" else None
        if isinstance(loss, str) and loss.rsplit(".", 1)[-1] in _MARGIN_LOSSES:
            return loss.rsplit(".", 1)[-1]
    return None


def _loss_at_minimum(
    ctx: RuleContext,
    end: Record,
    evidence: list[str],
    margin: str | None,
    steps: int,
    *,
    floor: str | None = None,
) -> Diagnosis:
    """The loss is exactly 0 step after step with no sign of a division by inf: it
    reached its minimum, and a loss at its minimum has no gradient. Convergence (every
    margin met; with ``floor``, the dtype a cross-entropy was computed in, every target's
    probability rounded to 1), not a fault: an info."""
    if floor is not None:
        return _cross_entropy_floor(ctx, end, evidence, steps, floor)
    what = f"{margin}, a margin (hinge) loss," if margin is not None else "the loss"
    evidence = [*evidence]
    if margin is not None:
        evidence.append(f"the loss is {margin}: exactly 0 once every margin is met")
    fix = (
        "# nothing to fix if the model should fit this data: stop early (the loss is at its "
        "minimum)\n"
        + (
            "# to keep learning past the margin: a larger margin, or a loss that is never "
            "exactly 0\n"
            "criterion = nn.CrossEntropyLoss()   # instead of the margin loss: keeps pushing "
            "the margins apart"
            if margin is not None
            else "# if this loss should be above 0 here: check what it is multiplied by (a "
            "weight of 0, a mask that keeps nothing) and that it is not a saturated "
            "hinge, clamp(min=0) or relu of a satisfied margin"
        )
    )
    return _at_minimum(
        ctx,
        end,
        evidence,
        explanation=(
            f"{what[0].upper()}{what[1:]} is exactly 0 for the last {steps} steps, and the "
            "gradient leaving it is exactly 0: a loss at its minimum has no gradient, so no "
            "layer gets one. A margin or hinge loss does this as soon as every example "
            "meets its margin (separable data): the model fits the data, it is not broken. "
            "Neither underflow along the layers nor dead units."
        ),
        fix=fix,
    )


def _at_minimum(
    ctx: RuleContext, end: Record, evidence: list[str], *, explanation: str, fix: str
) -> Diagnosis:
    """NW304's info that the loss sits at its minimum, at ``end`` (the gradient leaving the
    loss): a margin loss every example meets, or a cross-entropy at its floor."""
    return ctx.diagnosis(
        title="Zero gradients: the loss reached its minimum (0), nothing is left to learn",
        severity="info",
        path=end.path,
        phase=Phase.BACKWARD.value,
        evidence=evidence,
        explanation=explanation,
        fix=fix,
    )


def _cross_entropy_floor(
    ctx: RuleContext, end: Record, evidence: list[str], steps: int, dtype: str
) -> Diagnosis:
    """A cross-entropy exactly 0 step after step over logits spread past log(1/eps) of
    ``dtype``: every target's probability rounds to 1, the loss's minimum, and its gradient
    (softmax - one-hot) rounds to 0. The model fits these examples: an info."""
    return _at_minimum(
        ctx,
        end,
        evidence,
        explanation=(
            f"Cross-entropy is exactly 0 for the last {steps} steps: the logits put each "
            f"target so far above the other classes that its probability rounds to 1 in "
            f"{dtype}, and log(1) = 0 is the loss's minimum. Its gradient, softmax - "
            "one-hot, rounds to 0 with it, so no layer gets one. The model fits (memorized) "
            "these examples; it is not broken, and the loss does depend on the outputs. "
            "Neither underflow along the layers nor dead units."
        ),
        fix=(
            "# nothing to fix if the model should fit this data: stop early (the loss is at "
            "its minimum)\n"
            "# to keep learning once the examples are fit, and keep the logits from growing:\n"
            + (
                "criterion = nn.CrossEntropyLoss(label_smoothing=0.1)"
                if any(u.kind == "ce" and u.call is not None for u in loss_uses(ctx.trace))
                else "loss = F.cross_entropy(logits, target, label_smoothing=0.1)"
            )
            + "   # its minimum is above 0 and its gradient never rounds to 0"
        ),
    )


def _inputs_moved(traces: list[StepTrace], ends: list[Record]) -> bool:
    """Whether the outputs the loss read (the forward record of each step's first loss
    gradient) took other values on some step: a loss that stays the same while they move
    does not depend on them."""
    seen: set[tuple[float, float]] = set()
    for t, end in zip(traces, ends, strict=True):
        src = t.record(end.source) if end.source is not None else None
        st = t.resolve(src).stat if src is not None else None
        if st is None or not st.finite:
            return False
        seen.add((st.min, st.max))
    return len(seen) > 1


def _ce_input_span(trace: StepTrace) -> tuple[str, float, float] | None:
    """The cross-entropy call of this step whose input spreads widest: its path, and the
    input's min and max (measured, or read by the guard)."""
    best: tuple[str, float, float] | None = None
    for u in loss_uses(trace):
        if u.kind != "ce":
            continue
        st = u.input_stat
        lo = st.min if st is not None else note_num(u.note, "input_min")
        hi = st.max if st is not None else note_num(u.note, "input_max")
        if lo is None or hi is None or not math.isfinite(hi - lo):
            continue
        if best is None or hi - lo > best[2] - best[1]:
            best = (u.path, lo, hi)
    return best


def _softmax_loss(trace: StepTrace) -> bool:
    """Whether this step's loss is a cross-entropy (a watched criterion, a guarded
    functional call): a loss whose only way to 0 is a target probability of 1."""
    return any(u.kind == "ce" for u in loss_uses(trace))


def _reached(trace: StepTrace, rec: Record) -> bool:
    """Whether the training backward of this step passed a gradient to ``rec``'s tensor."""
    return any(
        r.phase is Phase.BACKWARD and r.source == rec.index and not r.by_grad for r in trace.records
    )


def _zero_factor(trace: StepTrace) -> tuple[list[str], Note | None] | None:
    """Evidence that the loss is 0 because of what is applied to it after the loss
    function (a weight of 0, a mask that keeps nothing), not because the loss function
    reached its minimum, with the guard's note of that loss call: a loss call whose own
    output, which backward reached, is not 0; or a cross-entropy whose logits spread too
    little for any target's probability to round to 1 in their dtype (its only way to 0).
    None when neither is known."""
    uses = [u for u in loss_uses(trace) if u.path != LOSS_PATH]
    for u in uses:
        out = u.output
        s = out.stat if out is not None else None
        if out is None or s is None or not s.finite or (s.min == 0.0 and s.max == 0.0):
            continue
        if not _reached(trace, out):
            continue  # a loss computed beside the training one (a validation metric)
        span = fmt(s.max) if s.numel == 1 else f"{fmt(s.min)} to {fmt(s.max)}"
        return [
            f"{u.path} itself returns {span}, not 0 (its output, shape {list(out.shape)}): "
            f"the zero is made after it"
        ], u.note
    for u in uses:
        if u.kind != "ce":
            continue
        st = u.input_stat
        lo = st.min if st is not None else note_num(u.note, "input_min")
        hi = st.max if st is not None else note_num(u.note, "input_max")
        # a softmax over float16 or bfloat16 logits accumulates in float32 (CPU and CUDA)
        acc = "float64" if u.input_dtype == "float64" else "float32"
        lim = limits(acc)
        if lo is None or hi is None or lim is None or not math.isfinite(hi - lo):
            continue
        if u.measured is not None and not _reached(trace, u.measured):
            continue
        ignored, shape = note_num(u.note, "ignored"), u.data("target_shape")
        total = math.prod(shape) if isinstance(shape, list) else None
        if ignored and total and ignored == total:
            return [
                f"every target of {u.path} is its ignore_index "
                f"({fmt(note_num(u.note, 'ignore_index'))}): it has nothing to learn from, "
                f"and a reduction of {u.data('reduction', 'sum')} gives 0"
            ], u.note
        resolve = math.log(1 / lim.eps)
        if hi - lo <= resolve:
            return [
                f"{u.path}'s logits span {fmt(lo)} to {fmt(hi)}: a spread of {fmt(hi - lo)}, "
                f"within {fmt(resolve)} = log(1/eps) of {acc}, the softmax's precision; "
                "cross-entropy is 0 only where a target's probability rounds to 1, which needs "
                "a wider spread: "
                f"{u.path} itself is above 0, the zero is made after it"
            ], u.note
    return None


#: the operators a loss line applies to the loss function's value that can make it 0
_FACTOR_OPS = (ast.Mult,)


def _loss_factors(note: Note | None) -> list[str]:
    """The operands a loss line multiplies the loss call by (``w`` of ``loss = w *
    crit(p, y)``, ``mask`` of ``(crit(p, y) * mask).sum() / n``): the candidates for a
    factor of 0. Empty when the line is unknown."""
    line = _loss_line_of(note) if note is not None else None
    if line is None:
        return []
    fname = str(note.data.get("loss", note.path) if note is not None else "").rsplit(".", 1)[-1]
    try:
        tree = ast.parse(line.removeprefix("return ").strip())
    except SyntaxError:
        return []
    calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call)]  # outermost first
    named = [c for c in calls if ast.unparse(c.func).rsplit(".", 1)[-1] == fname]
    # a loss module called by the user's own name (crit(p, y)): the first call of two
    # or more positional arguments
    candidates = named or [c for c in calls if len(c.args) >= 2]
    if not candidates:
        return []
    loss = candidates[0]

    def calls_loss(node: ast.AST) -> bool:
        return any(c is loss for c in ast.walk(node))

    found: list[str] = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, _FACTOR_OPS)):
            continue
        for side, other in ((node.left, node.right), (node.right, node.left)):
            text = ast.unparse(side)
            if calls_loss(other) and not calls_loss(side) and text not in found:
                found.append(text)
    return found


def _loss_times_zero(
    ctx: RuleContext, end: Record, evidence: list[str], note: Note | None, steps: int
) -> Diagnosis:
    """The loss is exactly 0 step after step while the loss function's own value is not
    (or cannot be): what is applied to it afterwards is 0. A warning: nothing trains."""
    factors = _loss_factors(note)
    line = _loss_line_of(note) if note is not None else None
    where = f" ({os.path.basename(note.source)})" if note is not None and note.source else ""
    if factors:
        evidence = [
            *evidence,
            f"the loss line{where} multiplies the loss by {', '.join(factors)}: "
            + ("it is 0" if len(factors) == 1 else "one of them is 0"),
        ]
        fix = (
            f"print({', '.join(factors)})   # before loss.backward(): 0 here; a loss weight "
            "that never ramps up, a mask that keeps no element"
        )
    else:
        fix = (
            "# print each factor applied to the loss function's value before backward: a "
            "loss weight that never ramps up, a mask that keeps no element, targets that "
            "are all ignore_index"
        )
    if line is not None:
        fix = f"# the loss line{where}: {line}\n{fix}"
    return ctx.diagnosis(
        title="Zero gradients: the loss is multiplied by 0, not at its minimum",
        path=end.path,
        phase=Phase.BACKWARD.value,
        evidence=evidence,
        explanation=(
            f"The loss backward starts from is exactly 0 for the last {steps} steps, and so "
            "is every gradient, but the loss function itself is not at its minimum: the zero "
            "comes from what is applied to its value afterwards (a loss weight of 0, a "
            "warm-up factor that never ramps up, a mask or per-example weights that keep "
            "nothing in this batch). No layer gets a gradient, so nothing trains, without "
            "an error."
        ),
        fix=fix,
    )


def _zero_output(
    ctx: RuleContext, top: str, names: str, need: int, *, itself: bool = True
) -> Diagnosis | None:
    """The zero starts at a module whose output is exactly 0 everywhere while its input is
    not (and holds positive values: no dead ReLU): it receives a non-zero gradient and
    passes back 0. In float16 the usual maker is x / inf, a sum or a count past 65504."""
    trace = ctx.trace
    for inp, fed in _zero_output_candidates(trace, top, itself=itself):
        outs = [
            trace.resolve(r)
            for r in trace.records
            if r.phase is Phase.FORWARD and r.call == inp.call
        ]
        stats = [r.stat for r in outs if r.stat is not None]
        if not stats or not all(
            s.finite and s.min == 0.0 and s.max == 0.0 and s.numel > 1 for s in stats
        ):
            continue
        grads = [
            r.stat
            for r in trace.records
            if r.phase is Phase.BACKWARD and r.call == inp.call and r.stat is not None
        ]
        if not grads or not any(s.finite and (s.min < 0 or s.max > 0) for s in grads):
            continue
        m = outs[0]
        g = max(s.magnitude for s in grads)
        call = trace.call(inp.call)
        kind = f" ({call.module_type})" if call is not None and call.module_type else ""
        lim = low_precision(m.dtype)
        evidence = [
            f"{names}: every gradient exactly 0 for the last {need} steps",
            f"the zero starts at {m.path}: the gradient of its output is not 0 (up to "
            f"{fmt(g)}), the gradient it passes back to {top} is exactly 0",
            f"{m.path}'s output is exactly 0 everywhere ({m.dtype}, shape {list(m.shape)}) "
            f"while its input spans {fmt(fed.min)} to {fmt(fed.max)}: its output "
            "does not depend on its input",
        ]
        if m.path == top:  # the module that makes the zero is the dead one itself
            evidence[1] = (
                f"the zero starts at {top} itself: the gradient of its output is not 0 (up "
                f"to {fmt(g)}), its own weights' gradients are exactly 0"
            )
        if lim is not None and lim.short_range:
            evidence.append(
                f"{m.path} computes in {m.dtype}: a sum or a count past {fmt(lim.max)} "
                f"(finfo({m.dtype}).max) is inf, and x / inf = 0"
            )
            fix = (
                f"# in {m.path}{kind}'s forward: take sums and counts in float32 (or use "
                ".mean())\n"
                "s = x.float().sum()      # not x.sum() of a float16 tensor: inf past 65504\n"
                "n = mask.sum().float()   # a count in float32"
            )
            cause = (
                f"In {m.dtype} that is a division by an inf: a sum or count taken in "
                f"{m.dtype} (x.sum(), (x * x).sum() / n) passes {fmt(lim.max)} and becomes "
                "inf, and x / inf = 0. It is not underflow: a GradScaler scales a gradient, "
                "and x / inf stays 0."
            )
        else:
            fix = (
                f"# in {m.path}{kind}'s forward: find what makes its output 0 everywhere\n"
                "# (a mask or factor that is 0, a division by a huge or infinite value)"
            )
            cause = "A mask or factor that is 0 everywhere, or a division by an inf, does it."
            half = low_precision("float16")
            amax = fed.magnitude
            if half is not None and math.isfinite(amax) and amax * amax > half.max:
                # a cast inside the forward (x.half()) is not seen by the records: its input
                # tells whether squares of it fit float16
                root = math.sqrt(half.max)
                evidence.append(
                    f"its input reaches |x| = {fmt(amax)}: if {m.path} computes in float16 "
                    f"inside (x.half()), x ** 2 is inf above {fmt(root)} = sqrt({fmt(half.max)}"
                    "), and x / inf or rsqrt(inf) is 0"
                )
                fix += (
                    f"\n# if it casts to float16 inside: its input reaches {fmt(amax)}, whose "
                    f"square passes {fmt(half.max)}; take the mean of squares (a norm, a "
                    "variance) in float32: x.float().pow(2).mean(-1, keepdim=True)"
                )
        return ctx.diagnosis(
            title="Zero gradients: a module's output is exactly 0 whatever its input",
            path=m.path,
            phase=Phase.BACKWARD.value,
            evidence=evidence,
            explanation=(
                f"{m.path} returns exactly 0 for every value while its input is not 0, so "
                f"it passes no gradient back and everything before it ({top}) stops "
                f"learning. {cause}"
            ),
            fix=fix,
        )
    return None


def _zero_output_candidates(
    trace: StepTrace, top: str, *, itself: bool
) -> Iterator[tuple[Record, TensorStat]]:
    """The input records of the calls that may make a zero everywhere for the dead ``top``,
    with the finite, partly positive values they were given: each call that took ``top``'s
    output, then (``itself``) ``top``'s own call (a module with weights of its own whose
    output is 0: its weights' gradients are 0 too)."""
    fwd = next(
        (
            r
            for r in trace.records
            if r.phase is Phase.FORWARD and r.path == top and r.stat is not None
        ),
        None,
    )
    if fwd is not None and fwd.stat is not None and fwd.stat.finite and fwd.stat.max > 0:
        for inp in trace.records:
            if inp.phase is Phase.INPUT and inp.source == fwd.index and inp.path != top:
                yield inp, fwd.stat
    calls = {c.id for c in trace.calls if c.path == top} if itself else set()
    for inp in trace.records:
        if inp.phase is not Phase.INPUT or inp.call not in calls:
            continue
        st = trace.resolve(inp).stat
        if st is not None and st.finite and st.max > 0:
            yield inp, st
            return


def _loss_entries(trace: StepTrace) -> set[int]:
    """The forward records of the tensors the loss reads directly: a root's outputs (what
    loss code outside the modules computes from) and a loss module's inputs, with the
    records they alias (a container's output is its last child's). A passthrough module's
    output (a ReLU's) stands for another tensor than its input: the chain stops there."""
    out: set[int] = set()
    passthrough = {c.id for c in trace.calls if c.passthrough}
    starts = [r.index for r in trace.root_outputs()]
    losses = {c.id for c in trace.calls if c.is_loss}
    starts += [
        r.source
        for r in trace.records
        if r.phase is Phase.INPUT and r.call in losses and r.source is not None
    ]
    for i in starts:
        rec = trace.record(i)
        for _ in range(64):
            if rec is None or rec.phase is not Phase.FORWARD or rec.call in passthrough:
                break
            out.add(rec.index)
            rec = trace.record(rec.source) if rec.source is not None else None
    return out


def _nonzero_grads(trace: StepTrace) -> set[str]:
    """Modules with a non-zero gradient this step: an output gradient that is not exactly 0,
    or a parameter gradient whose norm is not 0."""
    found: set[str] = set()
    for r in trace.records:
        s = r.stat
        if s is None or not s.finite:
            continue
        if r.phase in (Phase.BACKWARD, Phase.GRADIENT) and (
            s.min < 0 or s.max > 0 or (s.norm or 0.0) > 0
        ):
            found.add(r.path)
    return found


def _loss_term_off(ctx: RuleContext, top: str) -> tuple[Record, Record] | None:
    """``top``'s output gradient is exactly 0 where the loss reads that output, while
    another output the loss reads gets a non-zero gradient: the zero comes from the loss
    itself (a term weighted 0, a mask with no labels in the batch, ``0.0 * p.sum()`` to
    keep DDP happy), not from the model's units. The zero record and a non-zero one."""
    trace = ctx.trace
    entries = _loss_entries(trace)
    every = _by_grad_only(trace)
    zero: Record | None = None
    other: Record | None = None
    for r in trace.records:
        s = r.stat
        if (
            r.phase is not Phase.BACKWARD
            or s is None
            or not s.finite
            or r.source not in entries
            or (r.by_grad and not every)
            or s.numel == 1
            or r.shape == ()
        ):
            continue  # a one-value output is a loss (its gradient is 1), not a term's input
        if s.min == 0.0 and s.max == 0.0:
            if r.path == top:
                zero = zero or r
        elif other is None:
            other = r
    return (zero, other) if zero is not None and other is not None else None


#: modules whose weight gradient is their input times their output's gradient (summed over
#: the batch): a weight gradient of exactly 0 under a non-zero output gradient says their
#: input was exactly 0
_PRODUCT_WEIGHTS = frozenset(
    {
        "Linear",
        "LazyLinear",
        "NonDynamicallyQuantizableLinear",
        "Conv1d",
        "Conv2d",
        "Conv3d",
        "LazyConv1d",
        "LazyConv2d",
        "LazyConv3d",
        "ConvTranspose1d",
        "ConvTranspose2d",
        "ConvTranspose3d",
    }
)


@dataclass(frozen=True)
class _ZeroFed:
    """A module given an input of exactly 0 (``taker``), told by its weight's gradient, and
    what made that zero when the records show it."""

    taker: str
    kind: str  #: the taker's module type
    weight: str  #: the weight whose gradient is exactly 0
    live: float  #: the largest non-zero gradient the taker got (its output's, its bias's)
    live_what: str
    maker: str | None = None  #: the module whose output is 0 (or whose forward ran the op)
    maker_kind: str = ""
    op: str | None = None  #: the autograd node of an op between modules that made the 0
    measured: bool = False  #: the maker's output itself was measured exactly 0
    fed: Record | None = None  #: the last measured non-zero tensor before the zero
    shape: tuple[int, ...] = ()
    others: tuple[str, ...] = ()  #: unmeasured modules beside the maker in the same span


def _zero_takers(trace: StepTrace, dead: set[str]) -> list[_ZeroFed]:
    """Modules outside ``dead`` whose every weight gradient is exactly 0 while a gradient
    they get is not (their output's, their bias's): their input was exactly 0."""
    weights: dict[str, tuple[str, bool]] = {}
    live: dict[str, tuple[float, str]] = {}
    kinds: dict[str, str] = {}
    for r in trace.records:
        s = r.stat
        if s is None or not s.finite or r.path in dead:
            continue
        if r.phase is Phase.GRADIENT and r.module_type in _PRODUCT_WEIGHTS:
            n = s.norm if s.norm is not None else max(abs(s.min), abs(s.max))
            kinds[r.path] = r.module_type
            if len(r.shape) >= 2:
                name, zero = weights.get(r.path, (r.role, True))
                weights[r.path] = (name, zero and n == 0.0)
            elif n > live.get(r.path, (0.0, ""))[0]:
                live[r.path] = (n, f"{r.role}'s gradient")
        elif r.phase is Phase.BACKWARD and not r.by_grad and r.role.startswith("output"):
            n = s.magnitude
            if n > live.get(r.path, (0.0, ""))[0]:
                live[r.path] = (n, "the gradient of its output")
    return [
        _ZeroFed(p, kinds[p], w, *live[p])
        for p, (w, zero) in weights.items()
        if zero and live.get(p, (0.0, ""))[0] > 0
    ]


def _zero_maker(trace: StepTrace, z: _ZeroFed) -> _ZeroFed | None:
    """Walk back from the taker's input to what made it exactly 0: a module whose measured
    output is 0 while its input is not, an op between modules (the input itself measured
    0, made by no module), or the unmeasured modules (passthroughs: a dropout, a ReLU)
    between the last measured non-zero tensor and the taker."""
    calls = {c.id for c in trace.calls if c.path == z.taker}
    rec = next(
        (r for r in trace.records if r.phase is Phase.INPUT and r.call in calls),
        None,
    )
    crossed: list[Record] = []
    for _ in range(64):
        if rec is None:
            return None
        s = rec.stat
        if s is not None:
            if not s.finite:
                return None
            if s.min == 0.0 and s.max == 0.0:
                if rec.phase is Phase.INPUT and rec.source is None:
                    parent = trace.call(rec.call)
                    up = trace.call(parent.parent) if parent and parent.parent is not None else None
                    return dataclasses.replace(
                        z,
                        maker=up.path if up is not None else None,
                        maker_kind=up.module_type if up is not None else "",
                        op=rec.grad_fn,
                        measured=True,
                        shape=rec.shape,
                    )
                if rec.phase is Phase.FORWARD:
                    ins = [trace.resolve(r) for r in trace.inputs_of(rec.call)]
                    fed = next(
                        (r for r in ins if r.stat is not None and r.stat.finite and r.stat.max > 0),
                        None,
                    )
                    call = trace.call(rec.call)
                    if fed is not None and call is not None:
                        return dataclasses.replace(
                            z,
                            maker=call.path,
                            maker_kind=call.module_type,
                            measured=True,
                            fed=fed,
                            shape=rec.shape,
                        )
                    rec = ins[0] if ins else None  # its input was 0 too: further back
                    continue
                return None
            if not crossed or s.max <= 0:
                return None  # a non-zero input, or nothing unmeasured to make the zero
            # the zero is made in the unmeasured span: a ReLU keeps the positive values
            # it is given, so it is not the maker where the span starts positive
            span = [c for c in crossed if c.grad_fn not in _RELU_NODES]
            if not span:
                return None
            first = span[0]
            call = trace.call(first.call)
            return dataclasses.replace(
                z,
                maker=first.path,
                maker_kind=call.module_type if call is not None else first.module_type,
                fed=rec,
                shape=first.shape,
                others=tuple(c.path for c in crossed if c is not first),
            )
        if rec.source is None:
            return None
        if rec.phase is Phase.FORWARD:
            crossed.insert(0, rec)
        rec = trace.record(rec.source)
    return None


def _too_wide_to_square(trace: StepTrace) -> Record | None:
    """The input or output in a short-range dtype (float16, float8) with the largest finite
    |x| whose square passes that dtype's finfo.max, if any: a variance or norm computed in
    that dtype from such values is inf, and dividing by it gives exactly 0."""
    best: tuple[float, Record] | None = None
    for r in trace.records:
        s = r.stat
        lim = low_precision(r.dtype)
        if r.phase not in (Phase.INPUT, Phase.FORWARD) or s is None or not s.finite:
            continue
        if lim is None or not lim.short_range or s.magnitude**2 <= lim.max:
            continue
        if best is None or s.magnitude > best[0]:
            best = (s.magnitude, r)
    return best[1] if best is not None else None


def _zeroed_input(
    ctx: RuleContext, dead: list[str], head: str, need: int, *, wide: Record | None = None
) -> Diagnosis | None:
    """A module after the dead ones gets an input of exactly 0 (its weight gradient is 0
    under a non-zero output gradient): a module or op before it returns 0 for every value
    (``nn.Dropout(p=1.0)``, a mask of zeros, ``x * 0``), and nothing before it gets a
    gradient. Names the maker where the records show it, and says so where they do not
    (sentinel records no layer's output). ``wide``: a float16 value whose square passes
    finfo.max, when the step holds one: a zero whose maker the records do not show is then
    told as an overflow's (x / inf = 0)."""
    trace = ctx.trace
    takers = _zero_takers(trace, set(dead))
    if not takers:
        return None
    found: _ZeroFed | None = None
    if trace.full:
        for z in takers:
            found = _zero_maker(trace, z)
            if found is not None:
                break
        if found is None:
            return None
    z = found or takers[0]
    evidence = [
        head,
        f"{z.taker}'s weight gradient ({z.weight}) is exactly 0 while {z.live_what} is not "
        f"(up to {fmt(z.live)}): a {z.kind}'s weight gradient is its input times the "
        f"gradient of its output, so {z.taker}'s input is exactly 0",
    ]
    maker = z.maker
    kind = f" ({z.maker_kind})" if z.maker_kind and z.maker_kind != maker else ""
    if maker is not None and z.op is not None:
        evidence.append(
            f"{z.taker}'s input is exactly 0 everywhere (shape {list(z.shape)}), made by "
            f"{z.op} in {maker}{kind}'s own forward, not by a module"
        )
        title = "Zero gradients: an op sets a layer's whole input to exactly 0"
        what = f"An op in {maker}'s forward ({z.op}) returns exactly 0 for every value"
        fix = (
            f"# in {maker}{kind}'s forward: the op ({z.op}) that makes {z.taker}'s input "
            "0 everywhere\n# a factor that is 0 (x * 0), a mask of all zeros: keep some of "
            "the values, or drop the op"
        )
    elif maker is not None:
        fed = z.fed.stat if z.fed is not None else None
        if z.measured:
            evidence.append(
                f"{maker}'s output is exactly 0 everywhere (shape {list(z.shape)}) while its "
                f"input spans {fmt(fed.min if fed else None)} to {fmt(fed.max if fed else None)}"
                ": its output does not depend on its input"
            )
        elif z.fed is not None and fed is not None:
            relus = [
                r.path
                for r in trace.records
                if r.phase is Phase.FORWARD and r.path in z.others and r.grad_fn in _RELU_NODES
            ]
            evidence.append(
                f"{maker}{kind}'s output is that 0 while what it is given is not: the last "
                f"tensor measured before it, {z.fed.path}'s {z.fed.role}, spans {fmt(fed.min)} "
                f"to {fmt(fed.max)}"
                + (
                    f"; {', '.join(relus)} (ReLU) zero{'es' if len(relus) == 1 else ''} only "
                    "the values below 0"
                    if relus
                    else ""
                )
            )
        title = "Zero gradients: a module's output is exactly 0 whatever its input"
        what = f"{maker}{kind} returns exactly 0 for every value"
        dropout = "Dropout" in z.maker_kind
        fix = (
            f"# {maker}{kind}: p is the share of values it zeroes; p=1.0 zeroes them all\n"
            "nn.Dropout(p=0.1)   # p < 1"
            if dropout
            else f"# in {maker}{kind}'s forward: find what makes its output 0 everywhere\n"
            "# (a mask or factor that is 0, x * 0, a dropout with p=1.0): keep some values"
        )
    else:
        title = "Zero gradients: a layer's input is exactly 0 at every step"
        what = f"What feeds {z.taker} returns exactly 0 for every value"
        evidence.append(
            "sentinel mode records no layer's output: watch mode names the module that makes the 0"
        )
        fix = (
            f"# what feeds {z.taker} returns 0 for every value: a dropout with p=1.0, a mask "
            "of zeros, x * 0, or ReLUs that never fire\n"
            'nanwatch.watch(model, mode="watch")   # names the module or op that makes it'
        )
    explanation = (
        f"{what}, so {z.taker} gets an input of exactly 0 and passes no gradient back: "
        f"everything before it ({', '.join(dead[:3])}{', ...' if len(dead) > 3 else ''}) "
        "stops learning, without an error."
        + (
            " Neither dead units nor underflow: they do not zero a whole output of a "
            "module whose input is not 0."
            if maker is not None
            else ""
        )
    )
    wlim = low_precision(wide.dtype) if wide is not None and wide.stat is not None else None
    if wide is not None and wide.stat is not None and wlim is not None and maker is None:
        dtype, amax, root = wide.dtype, wide.stat.magnitude, math.sqrt(wlim.max)
        evidence.append(
            f"{wide.where} reaches |x| = {fmt(amax)} in {dtype}: a square passes "
            f"{fmt(wlim.max)} (torch.finfo(torch.{dtype}).max) once |x| > {fmt(root)}, so a "
            f"variance or norm of such values computed in {dtype} is inf, and x / inf = 0"
        )
        explanation += (
            f" In {dtype} the usual maker is an overflow, not underflow: a variance or norm "
            f"taken in {dtype} ((x - mean) ** 2, x.pow(2).sum()) of values past {fmt(root)} "
            "is inf, and the division by it returns 0 for every value. A GradScaler does not "
            "help: it scales gradients, and x / inf stays 0."
        )
        fix = (
            f"# in {dtype}, a variance or norm of values past {fmt(root)} is inf and x / inf "
            "= 0: take it in float32, e.g. in a hand-written LayerNorm:\n"
            "x32 = x.float()\n"
            "y = ((x32 - x32.mean(-1, keepdim=True)) / torch.sqrt(x32.var(-1, keepdim=True, "
            "unbiased=False) + eps)).to(x.dtype)\n"
            "# or nn.LayerNorm (it accumulates in float32)\n" + fix
        )
    return ctx.diagnosis(
        title=title,
        path=maker or z.taker,
        phase=Phase.BACKWARD.value,
        evidence=evidence,
        explanation=explanation,
        fix=fix,
    )


def _backward_flow(trace: StepTrace) -> Record | None:
    """The gradient of a root's output in a float16-like dtype (a short range), where the
    step's records hold no layer's own (sentinel): the dtype backward runs in."""
    for r in trace.records:
        if r.phase is Phase.BACKWARD and not r.by_grad:
            lim = low_precision(r.dtype)
            if lim is not None and lim.short_range:
                return r
    return None


@rule(
    "NW304",
    title="Vanishing gradients: zero for many steps",
    severity="warning",
    summary=(
        "A module's gradients are all 0 (or too small for a float32 norm) for "
        "thresholds.vanish_steps steps in a row; "
        "in float16 that is underflow (use a GradScaler), otherwise dead units."
    ),
    early=True,
    priority=40,
)
def vanishing(ctx: RuleContext) -> Iterator[Diagnosis]:
    need = ctx.thresholds.vanish_steps
    if len(ctx.history) < need - 1:
        return
    out_now, par_now, dtypes, by_norm = ctx.memo(ctx.trace, "zero_grads", _zero_grads)
    now = out_now | par_now
    if not now:
        return
    past = [ctx.memo(t, "zero_grads", _zero_grads) for t in ctx.history][-(need - 1) :]
    dead = [p for p in now if all(p in o or p in q for o, q, _, _ in past)]
    if not dead:
        return
    order = {r.path: r.index for r in ctx.trace.records if r.phase is Phase.BACKWARD}
    dead.sort(key=lambda p: order.get(p, math.inf))  # nearest the loss first
    names = f"{', '.join(dead[:6])}{', ...' if len(dead) > 6 else ''}"
    # the module the last step's finding named while it is still dead: gradients that die
    # layer after layer towards the loss are one problem, said once, not one per step
    said = next(
        (
            d.path
            for t in ctx.history[-1:]
            for d in t.diagnoses
            if d.code == "NW304" and d.path in dead
        ),
        None,
    )
    top = said if said is not None else dead[0]
    dtype = dtypes.get(top, "")
    # sentinel hooks no layer's output: the gradient of a root's output tells the dtype
    # backward ran in (float16 under autocast), where the weights' own .grad is float32
    flow = None if ctx.trace.full or top in out_now else _backward_flow(ctx.trace)
    if flow is not None:
        dtype = flow.dtype
    lim = low_precision(dtype)
    if lim is not None and not lim.short_range:
        lim = None  # bfloat16 has float32's exponent: its gradients do not underflow sooner
    scaled = bool(ctx.facts.get("scaler"))
    # exact when a module's output gradients were 0 each step (their min and max say so);
    # a parameter gradient is known by its norm only, which is 0 for tiny values too
    exact = all(p in o for p in dead for o, _, _, _ in past) and all(p in out_now for p in dead)
    exact = exact or not any(p in by_norm for p in dead) or _tiniest(dtype) > _norm_floor(dtype)
    off = _loss_term_off(ctx, top)
    if off is not None:
        # the zero comes from the loss: silent when the term was on within the window (a
        # task present in some batches only), a note when it never was
        if not any(top in ctx.memo(t, "nonzero_grads", _nonzero_grads) for t in ctx.history):
            yield _loss_term_note(ctx, top, off, len(ctx.history) + 1)
        return
    traces = [*ctx.history[-(need - 1) :], ctx.trace] if need > 1 else [ctx.trace]
    if ctx.trace.loss == 0.0 and any(
        (d := ctc_dropped(u)) is not None and d[0] >= d[1] for u in loss_uses(ctx.trace)
    ):
        return  # CTCLoss(zero_infinity=True) dropped every sample: NW207 says so
    if any(detached_input(ctx.trace, u) is not None for u in loss_uses(ctx.trace)):
        return  # the loss was computed on a detached output: NW209 says so
    # the dead module's own output 0 whatever its input: unless one update threw its
    # weights there (the jolt, below, says which and by how much)
    itself = _jolt(ctx, set(dead)) is None
    found = _flat_loss(ctx, traces, names) or _zero_output(ctx, top, names, need, itself=itself)
    # sentinel, in float16: a layer's input of exactly 0 is an overflow's doing when the step
    # holds values whose squares pass finfo.max (a variance of them is inf, x / inf = 0), not
    # underflow's (watch mode measures the module that makes the 0: _zero_output, NW109)
    sentinel = not ctx.trace.full
    wide = _too_wide_to_square(ctx.trace) if lim is not None and sentinel else None
    if found is None and (lim is None or wide is not None):
        head = (
            f"{names}: every gradient exactly 0 for the last {need} steps"
            if exact
            else f"{names}: gradient norm 0 for the last {need} steps"
        )
        found = _zeroed_input(ctx, dead, head, need, wide=wide)
    if found is not None:
        yield found
        return
    factors = _zero_factors(traces, top) if lim is None else None
    if factors is not None:
        # the other dead modules whose factors are zero the same way (every adapter of a
        # model built by one helper): named beside the first, each gets its own fix line
        more = [d for d in dead if d != top and _zero_factors(traces, d) is not None]
        yield _zero_factors_diagnosis(ctx, top, need, *factors, more=more)
        return
    sat = _cut_inside(ctx.trace, dead, lim.tiny) if lim is not None and exact else None
    if sat is not None:
        yield _saturated(ctx, dead, names, need, sat)
        return
    if exact:
        evidence = [f"{names}: every gradient exactly 0 for the last {need} steps"]
    else:
        floor = _norm_floor(dtype)
        evidence = [
            f"{names}: gradient norm 0 for the last {need} steps (every gradient 0 or below "
            f"{fmt(floor)}, whose square underflows in the norm)"
        ]
    if lim is not None and flow is not None:
        evidence.append(
            f"backward runs in {dtype} (the gradient of {flow.path}'s {flow.role} is "
            f"{dtype}; sentinel mode records no layer's own): it holds values down to "
            f"{fmt(lim.subnormal)}, and values under {fmt(lim.subnormal / 2)} round to "
            "exactly 0" + ("" if scaled else "; no GradScaler was given")
        )
    elif lim is not None:
        evidence.append(
            f"gradients are {dtype}: it holds values down to {fmt(lim.subnormal)} (its "
            f"smallest subnormal; below {fmt(lim.tiny)}, its smallest normal, precision is "
            f"lost): values under {fmt(lim.subnormal / 2)} round to exactly 0"
            + ("" if scaled else "; no GradScaler was given")
        )
    if lim is not None:
        # the weights' own dtype: their gradients' (float32 under autocast, float16 after
        # model.half())
        wdtype = next(
            (r.dtype for r in ctx.trace.records if r.phase is Phase.GRADIENT and r.path == top),
            dtype,
        )
        dev = device_type(None, *(r.device for r in ctx.trace.records if r.path == top))
        explanation = (
            f"Gradients of {top} are exactly zero step after step. In {dtype} small "
            f"gradients underflow to 0 (below {fmt(lim.subnormal)}), so the layers far from "
            "the loss stop learning without any error. Loss scaling multiplies the loss "
            "before backward so the gradients stay representable, and divides them again "
            "before the update."
        )
        scaler_lines = (
            f"scaler = torch.amp.GradScaler({dev})\n"
            "scaler.scale(loss).backward()\n"
            "scaler.step(optimizer)\n"
            "scaler.update()   # nanwatch finds the scaler at scaler.scale(loss)"
        )
        if low_precision(wdtype) is not None:
            explanation += (
                f" The weights themselves are {wdtype}: a GradScaler refuses to unscale "
                f"{wdtype} gradients ('Attempting to unscale FP16 gradients'), and an update "
                f"that small is lost when it is added to a {wdtype} weight. Keep the weights "
                f"in float32 and run the forward in {wdtype} under autocast."
            )
            fix = (
                f"model = model.float()   # float32 weights; {wdtype} in the forward only\n"
                f"with torch.autocast(device_type={dev}, dtype=torch.{dtype}):\n"
                "    loss = criterion(model(x), y)\n" + scaler_lines
            )
        else:
            fix = scaler_lines
    else:
        # the ReLU and BCE lines only where the step shows a ReLU (a module, or an
        # output made by one) or a BCELoss; both when the step recorded no module calls
        kinds = {c.module_type for c in ctx.trace.calls}
        nodes = {r.grad_fn for r in ctx.trace.records if r.grad_fn}
        relu = kinds & {"ReLU", "ReLU6"} or nodes & {"ReluBackward0", "ThresholdBackward0"}
        mechanisms = [
            m
            for m, seen in (
                ("ReLUs that never fire", not kinds or relu),
                (
                    "a saturated sigmoid or tanh",
                    not kinds
                    or kinds & {"Sigmoid", "Tanh", "Hardtanh", "Hardsigmoid"}
                    or nodes & {"SigmoidBackward0", "TanhBackward0", "HardtanhBackward0"},
                ),
                ("a loss clamp", not kinds or "BCELoss" in kinds),
            )
            if seen
        ]
        dead_units = (
            f"its units are dead ({', '.join(mechanisms)})"
            if mechanisms
            else "it is dead: something between it and the loss outputs a constant (an "
            "exp() driven to 0, a saturated function, a clamp)"
        )
        explanation = (
            f"Gradients of {top} are {'exactly ' if exact else ''}zero step after step: "
            f"{dead_units} or it is cut off from the loss (a .detach(), an argmax, a mask "
            "that zeroes it). It stopped learning without any error."
        )
        fix = "# find what stops the gradient: a saturated activation, .detach(), a clamp"
        jolt = _jolt(ctx, set(dead))
        if jolt is not None:
            u, name, move, gmax = jolt
            lr = _lr_of(u) or 0.0
            evidence.append(
                f"the update at step {u.step} moved {name} by about {fmt(move)} in one step "
                f"(param group {_group_of(u)}, lr {hyper(lr)}"
                + ("" if _normalized(u.optimizer) else f" × its gradient {fmt(gmax)}")
                + "); every gradient has been 0 since"
            )
            explanation = (
                f"Gradients of {top} are {'exactly ' if exact else ''}zero step after step, "
                f"from right after one optimizer step moved {name} by about {fmt(move)} "
                f"(lr {hyper(lr)} in param group {_group_of(u)}): a weight thrown that far "
                "saturates what it feeds (an exp() to 0, a sigmoid to 0 or 1, every logit "
                "alike), and no gradient flows back through it to undo the step. It stopped "
                "learning without any error."
            )
            target = 0.1 / move * lr  # an lr that moves it by about 0.1
            new = 1e-3 if _normalized(u.optimizer) else 10 ** math.floor(math.log10(target))
            fix = (
                f'optimizer.param_groups[{_group_of(u)}]["lr"] = {hyper(new)}   # was '
                f"{hyper(lr)} ({u.optimizer}): moved {name} by {fmt(move)} in one step"
            )
        var = _relu_variance(ctx.trace) if relu else None
        if var is not None:
            # a leaky ReLU makes a variance negative (GaussianNLLLoss raises on var < 0)
            evidence.append(
                f"{var[0]}'s {var[1]} is a ReLU's output, 0 where its input is negative: "
                "no gradient flows back there"
            )
            fix += (
                f"\n{var[1]} = F.softplus(v) + 1e-6   # instead of F.relu(v): a {var[1]} "
                "must stay > 0 (a leaky ReLU makes it negative), and softplus has a gradient "
                "everywhere"
            )
        elif relu or not kinds:
            fix += "\nnn.LeakyReLU(0.01)        # instead of ReLU when units die"
        if not kinds or "BCELoss" in kinds:
            fix += "\nnn.BCEWithLogitsLoss()    # instead of sigmoid + BCELoss (clamped at -100)"
    yield ctx.diagnosis(
        path=top,
        phase=Phase.BACKWARD.value,
        evidence=evidence,
        explanation=explanation,
        fix=fix,
    )


#: autograd nodes of a ReLU's output
_RELU_NODES = frozenset(("ReluBackward0", "ThresholdBackward0"))
#: keyword names of a loss input that must stay positive (a variance, a scale)
_SCALE_KEYS = frozenset(("var", "scale", "std", "sigma"))


def _relu_variance(trace: StepTrace) -> tuple[str, str] | None:
    """The loss and the input's name (``GaussianNLLLoss``, ``var``) when a loss's variance
    or scale input (GaussianNLLLoss's third, or a keyword named var/scale/std/sigma) was
    made by a ReLU and is 0 somewhere: the ReLU cuts the gradient there, and a leaky ReLU
    would make the variance negative."""
    losses = {c.id: c for c in trace.calls if c.is_loss}
    for r in trace.records:
        c = losses.get(r.call)
        if c is None or r.phase is not Phase.INPUT:
            continue
        key = r.role.rpartition(".")[2] if r.role.startswith("input.") else ""
        gaussian = c.module_type == "GaussianNLLLoss" or c.path.endswith("gaussian_nll_loss")
        if not (key in _SCALE_KEYS or (gaussian and r.role == "input[2]")):
            continue
        cur: Record | None = r
        for _ in range(64):
            if cur is None or cur.grad_fn is not None or cur.source is None:
                break
            cur = trace.record(cur.source)
        if cur is None or cur.grad_fn not in _RELU_NODES:
            continue
        s = trace.resolve(cur).stat
        if s is None or s.min <= 0.0:
            return c.path, key or "var"
    return None


#: an optimizer step that moves one weight by more than this is a jolt: trained weights are
#: rarely past a few units in size, so it throws the weight far out of its working range
_JOLT = 10.0


def _moving_paths(trace: StepTrace) -> frozenset[str]:
    """The modules with a parameter that got a non-zero, finite gradient this step."""
    return frozenset(
        r.path
        for r in trace.records
        if r.phase is Phase.GRADIENT
        and r.stat is not None
        and r.stat.finite
        and (r.stat.min < 0 or r.stat.max > 0 or (r.stat.norm or 0.0) > 0)
    )


def _moving(ctx: RuleContext, trace: StepTrace, paths: set[str]) -> bool:
    """A parameter of ``paths`` got a non-zero, finite gradient in ``trace``. Read once a
    step (memoized): a layer dead for the whole history is asked about every step, and
    walking every record of every step of the history each time made a long-dead layer's
    step cost grow with the model's size times the history's length."""
    return not paths.isdisjoint(ctx.memo(trace, "moving_paths", _moving_paths))


def _jolt(ctx: RuleContext, dead: set[str]) -> tuple[_Update, str, float, float] | None:
    """The weight the last update before the gradients went to zero moved the most, when it
    moved it by more than ``_JOLT`` in one step: the update, the parameter, about how far
    (lr × its largest gradient; lr for Adam and its kin) and that gradient. From the last
    step with a non-zero gradient in ``dead`` and its optimizer note."""
    before = next((t for t in reversed(ctx.history) if _moving(ctx, t, dead)), None)
    if before is None:
        return None
    grads = {
        r.role: r.stat
        for r in before.records
        if r.phase is Phase.GRADIENT and r.stat is not None and r.stat.finite
    }
    best: tuple[_Update, str, float, float] | None = None
    for n in (n for n in before.notes if n.kind == "optimizer"):
        for g in n.data.get("groups", ()):
            if not isinstance(g, dict):
                continue
            u = _Update(n.path, before.step, g)
            lr = _lr_of(u)
            if lr is None or lr <= 0:
                continue
            for name in g.get("names", ()):
                s = grads.get(name)
                if s is None:
                    continue
                gmax = max(abs(s.min), abs(s.max))
                if gmax == 0:
                    continue
                move = lr if _normalized(n.path) else lr * gmax
                if best is None or move > best[2]:
                    best = (u, name, move, gmax)
    return best if best is not None and best[2] > _JOLT else None


def _zero_factors(traces: list[StepTrace], top: str) -> tuple[list[str], str] | None:
    """A module whose own parameters (two or more) got exactly zero gradients each step
    while its output's gradient was not zero, and whose output was, value for value in
    min and max, the output of a submodule it called: the term its parameters add is 0.
    Factors that are all zero and multiply each other (``x @ A.T @ B.T`` with A and B both
    zero) give that term, and each factor's gradient is the other factor: zero forever.
    Returns the parameters' names and the submodule's path."""
    params: list[str] = []
    child = ""
    for t in traces:
        grads = [r for r in t.records if r.phase is Phase.GRADIENT and r.path == top]
        names = list(dict.fromkeys(r.role for r in grads))
        if len(names) < 2 or any(
            r.stat is None or r.stat.norm not in (0.0, None) or r.stat.max != 0.0 for r in grads
        ):
            return None
        outgrads = [r for r in t.records if r.phase is Phase.BACKWARD and r.path == top]
        if not outgrads or not any(
            r.stat is not None and (r.stat.min != 0.0 or r.stat.max != 0.0) for r in outgrads
        ):
            return None
        calls = {c.id: c for c in t.calls}
        match = ""
        for out in (r for r in t.records if r.phase is Phase.FORWARD and r.path == top):
            c = calls.get(out.call)
            if out.stat is None or c is None or (out.stat.min == 0.0 and out.stat.max == 0.0):
                continue
            for r in t.records:
                rc = calls.get(r.call)
                if (
                    r.phase is Phase.FORWARD
                    and rc is not None
                    and rc.parent == c.id
                    and r.stat is not None
                    and r.shape == out.shape
                    and (r.stat.min, r.stat.max) == (out.stat.min, out.stat.max)
                ):
                    match = r.path
                    break
            if match:
                break
        if not match:
            return None
        params, child = names, match
    return (params, child) if params else None


def _prefixed(trace: StepTrace, root: str) -> bool:
    """The watched root ``root`` names its submodules with its own name as prefix
    (``Sequential#2.0``): a root watched after another whose paths it shares, whose
    variable name nanwatch does not know."""
    ids = {c.id for c in trace.calls if c.root and c.path == root}
    return "#" in root or any(
        c.parent in ids and c.path.startswith(root + ".") for c in trace.calls
    )


def _owner_expr(ctx: RuleContext, path: str) -> str:
    """An expression for the module at ``path`` in the user's words: ``model`` for the
    watched root, ``model.get_submodule('4')`` for a submodule of it. A root watched after
    another one that shares its paths (``Sequential#2``) has no known variable name: its
    modules are reached from a neutral ``module``, and a comment after two spaces names
    the root it stands for."""
    root = _root_path(ctx.trace, path) or _root_of_name(ctx, path)
    if root is None or not _prefixed(ctx.trace, root):
        if root is not None and path == root:
            return "model"
        return f"model.get_submodule({path!r})"
    if path == root:
        return f"module  # module: the watched {root}"
    rel = path[len(root) + 1 :] if path.startswith(root + ".") else path
    return f"module.get_submodule({rel!r})  # module: the watched {root}"


def _root_of_name(ctx: RuleContext, name: str) -> str | None:
    """The watched root a qualified name starts with (a prefixed root's names carry its
    name), when its owner made no call this step: a root that ran in this step or the one
    before, else any watched root (an EMA copy whose weights were written before its first
    forward)."""
    roots = [c.path for t in (*ctx.history[-1:], ctx.trace) for c in t.calls if c.root]
    watched = ctx.facts.get("forward_params")
    if isinstance(watched, Mapping):
        roots += [r for r in watched if isinstance(r, str) and r not in roots]
    return next((r for r in roots if name == r or name.startswith(r + ".")), None)


def _param_shapes(trace: StepTrace, path: str) -> dict[str, tuple[int, ...]]:
    """The shapes of the parameters of ``path`` whose gradients the step recorded, by name
    relative to it (``A`` for ``4.A``)."""
    out: dict[str, tuple[int, ...]] = {}
    for r in trace.records:
        if r.phase is Phase.GRADIENT and r.path == path:
            out.setdefault(_relative(r.role, path), r.shape)
    return out


def _relative(name: str, owner: str) -> str:
    """A parameter's qualified name relative to the module that owns it."""
    return name[len(owner) + 1 :] if name.startswith(owner + ".") else name


def _zero_factors_diagnosis(
    ctx: RuleContext,
    top: str,
    need: int,
    params: list[str],
    child: str,
    *,
    more: Sequence[str] = (),
) -> Diagnosis:
    listed = ", ".join(params)
    shapes = _param_shapes(ctx.trace, top)
    empty = {n: s for n, s in shapes.items() if 0 in s}
    others = f"; {', '.join(more)} are dead the same way" if more else ""
    evidence = [
        f"{top}: gradients of its parameters {listed} exactly 0 for the last {need} "
        f"steps, while the gradient of its output is not{others}",
        f"{top}'s output equals the output of its submodule {child} (same min and max "
        f"each step): the term that {listed} add is 0",
    ]
    if empty:
        sizes = ", ".join(f"{top}.{n} {tuple(s)}" for n, s in empty.items())
        evidence.append(f"rank-0 adapter: {sizes} {'are' if len(empty) > 1 else 'is'} empty")
        return ctx.diagnosis(
            path=top,
            phase=Phase.BACKWARD.value,
            evidence=evidence,
            explanation=(
                f"{top} is a rank-0 adapter: its factors {listed} have no elements "
                f"({sizes}), so their product is an empty sum, 0, and there is nothing to "
                "train. A rank computed from a fraction of a narrow layer's size rounds to "
                "0 (and alpha / r is then inf). Give every adapter a rank of at least 1."
            ),
            fix=(
                f"# rank-0 adapter: {top}'s {'/'.join(empty)} are empty; where its rank is "
                "computed, keep it at least 1\n"
                "# (max(1, round(...))): at rank 0 the adapter adds nothing and alpha / r is inf"
            ),
        )
    lines = []
    names: list[tuple[str, str]] = []  # (owner path, the factor to initialize)
    for path in (top, *more):
        grads = [r.role for r in ctx.trace.records if r.phase is Phase.GRADIENT and r.path == path]
        if grads:
            names.append((path, _relative(grads[0], path)))
    rest = ", ".join(_relative(p, top) for p in params[1:])
    keep = f"keep {rest} at zero" if rest else "keep the other factor at zero"
    owners = [_owner_expr(ctx, path) for path, _ in names]
    factor = names[0][1] if names else ""
    if (
        len(names) > 1
        and factor.isidentifier()
        and all(n == factor for _, n in names)
        and all(o.startswith("model.get_submodule(") and "#" not in o for o in owners)
    ):
        paths = ", ".join(repr(path) for path, _ in names)
        lines = [
            f"for name in ({paths}):  # before training; {keep}",
            f"    torch.nn.init.kaiming_uniform_(model.get_submodule(name).{factor}, "
            "a=math.sqrt(5))",
        ]
    for (_, name), owner in zip(names, owners, strict=True) if not lines else ():
        target, _, note = owner.partition("  # ")
        attr = f"{target}.{name}" if name.isidentifier() else f"{target}.get_parameter({name!r})"
        lines.append(
            f"torch.nn.init.kaiming_uniform_({attr}, a=math.sqrt(5))  # before training; {keep}"
            + (f"; {note}" if note else "")
        )
    return ctx.diagnosis(
        path=top,
        phase=Phase.BACKWARD.value,
        evidence=evidence,
        explanation=(
            f"The parameters {listed} of {top} add nothing to its output and receive exactly "
            "zero gradients. When parameters that are all zero multiply each other (a "
            "low-rank update x @ A.T @ B.T with both A and B initialized to zeros), each "
            "one's gradient is a product with the other, which is zero: none of them can "
            "ever move. Initialize one factor randomly and keep only the other at zero; "
            "the update then starts at 0 and still learns."
        ),
        fix="import math\n" + "\n".join(lines),
    )


def _cut_inside(
    trace: StepTrace, dead: list[str], floor: float
) -> tuple[str, float, list[tuple[str, float]]] | None:
    """A module that reads the same input as the dead ones (attention's v beside its q and
    k) whose output gradient reached at least ``floor`` (the dtype's smallest normal) while
    theirs were exactly 0: the zero is made inside the parent's forward, by an op that
    saturates, not by the dtype's range. Its path, that gradient's largest magnitude, and
    the dead modules' largest forward outputs."""
    rec = {(r.phase, r.path, r.role): r for r in trace.records}
    sources = {
        rec[(Phase.INPUT, p, "input[0]")].source
        for p in dead
        if (Phase.INPUT, p, "input[0]") in rec
    }
    sources.discard(None)
    if len(sources) != 1:
        return None
    src = sources.pop()
    for r in trace.records:
        if r.phase is not Phase.INPUT or r.source != src or r.path in dead:
            continue
        g = rec.get((Phase.BACKWARD, r.path, "output"))
        if g is None or g.stat is None or not g.stat.finite:
            continue
        top = max(abs(g.stat.min), abs(g.stat.max))
        if top >= floor:
            outs = []
            for p in dead:
                f = rec.get((Phase.FORWARD, p, "output"))
                if f is not None and f.stat is not None and f.stat.finite:
                    outs.append((p, max(abs(f.stat.min), abs(f.stat.max))))
            return r.path, top, outs
    return None


def _saturated(
    ctx: RuleContext,
    dead: list[str],
    names: str,
    need: int,
    sat: tuple[str, float, list[tuple[str, float]]],
) -> Diagnosis:
    """Exactly-zero gradients made by a saturated op (a softmax with one-hot rows) inside
    the parent's forward: no dtype holds them, so loss scaling cannot bring them back."""
    beside, size, outs = sat
    top = dead[0]
    parent = top.rpartition(".")[0] or "the model"
    dtype = next((r.dtype for r in ctx.trace.records if r.path == top), "")
    evidence = [
        f"{names}: every gradient exactly 0 for the last {need} steps",
        f"{beside}, which reads the same input, got output gradients up to {fmt(size)} this "
        f"step: far inside {dtype}'s range, so nothing on the way to {parent} underflowed",
    ]
    if outs:
        evidence.append(
            "their forward outputs reach "
            + ", ".join(f"|{p}| {fmt(v)}" for p, v in outs)
            + (
                f": one product of the two reaches {fmt(outs[0][1] * outs[1][1])}, and a "
                "softmax over logits that far apart has one-hot rows"
                if len(outs) >= 2
                else ""
            )
        )
    return ctx.diagnosis(
        title="Zero gradients made in the forward (a saturated softmax), not underflow",
        path=top,
        phase=Phase.BACKWARD.value,
        evidence=evidence,
        explanation=(
            f"The gradients of {names} are exactly 0 while {beside}, fed the same input "
            f"inside {parent}, gets gradients of ordinary size: the zero is made in "
            f"{parent}'s forward between them, not by {dtype}'s range. A softmax over "
            "logits hundreds apart (q @ k^T of large q and k) gives one-hot rows, whose "
            "gradient is exactly 0 in any dtype: float32 gives the same zeros, and a "
            "GradScaler cannot help (any scale times 0 is 0). Keep the logits small."
        ),
        fix=(
            "# QK-norm, in the attention's forward before q @ k.transpose(-2, -1):\n"
            "q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)   # |q . k| <= 1\n"
            "# then multiply the logits by a learned scale (init ~10) instead of "
            "1/sqrt(head_dim)"
        ),
    )


def _loss_term_note(
    ctx: RuleContext, top: str, off: tuple[Record, Record], steps: int
) -> Diagnosis:
    zero, other = off
    return ctx.diagnosis(
        title="Zero gradients: a loss term contributed nothing",
        severity="info",
        path=top,
        phase=Phase.BACKWARD.value,
        evidence=[
            f"{top}: every gradient exactly 0 on each of the {steps} steps recorded",
            f"the zero starts where the loss reads {zero.path}'s {zero.role}: its gradient "
            f"there is exactly 0, while {other.path}'s {other.role}, which the loss also "
            "reads, gets a non-zero gradient",
        ],
        explanation=(
            f"{top}'s loss term contributed nothing (weighted 0 or masked out) on these "
            "steps: the loss gives its output a gradient of exactly 0, so nothing in the "
            "model stops it and its units are not dead. A warm-up weight of 0, a batch "
            "with no labels for that task, or 0.0 * out.sum() (to keep DDP's unused "
            f"parameters in the graph) does this. {top} learns once the term is on."
        ),
        fix=(
            "# nothing to fix if the term is off on purpose (a warm-up, a task absent "
            "from these batches);\n"
            "# otherwise check the weight and the mask of its loss term"
        ),
    )


# ---------------------------------------------------------------------- NW314
@rule(
    "NW314",
    title="GradScaler divides gradients that backward never multiplied",
    severity="warning",
    summary=(
        "backward() ran on the loss itself, not on scaler.scale(loss), yet scaler.step() "
        "(or unscale_) divided the gradients by the scale: every update is 1/scale of what "
        "it should be (1/65536 at first), and the model barely moves."
    ),
    early=True,
    priority=12,
)
def unscaled_backward(ctx: RuleContext) -> Iterator[Diagnosis]:
    for n in ctx.trace.notes:
        scale = note_num(n, "unscaled_backward") if n.kind == "optimizer" else None
        if scale is None:
            continue
        var = _scaler_name(ctx.trace)
        optim = ctx.memo(ctx.trace, "loop_names", _loop_names).optimizer or "optimizer"
        yield ctx.diagnosis(
            path=None,
            evidence=[
                f"this step's backward() ran on the loss, not on {var}.scale(loss), and "
                f"{n.path} stepped inside {var}.step() after the gradients were divided "
                f"by the scale, {fmt(scale)}",
                f"every gradient it applied is {fmt(1 / scale)} times the real one: the "
                "weights barely move, and the scale keeps growing while no step overflows",
            ],
            explanation=(
                "A GradScaler multiplies the loss by its scale before backward, so small "
                "float16 gradients do not underflow, and divides the gradients by it again "
                f"in {var}.step(). Backward on the loss itself skips the multiplication but "
                "not the division. The result of scaler.scale(loss) is the tensor to call "
                "backward() on."
            ),
            fix=(
                f"{var}.scale(loss).backward()   # not loss.backward(): "
                f"{var}.step() divides by the scale\n"
                f"{var}.step({optim})\n"
                f"{var}.update()"
            ),
        )
        return


# ---------------------------------------------------------------------- NW315
#: steps in a row with gradients on the watched weights and no update of them
_FOREIGN_STEPS = 3


def _foreign_only(trace: StepTrace) -> Note | None:
    """The step's note of an optimizer that stepped none of the watched weights, tensors of
    their very shapes, when no optimizer stepped any of them (an ``"optimizer"`` note says
    one did) and backward gave them a gradient that is not 0. Another model's optimizer (a
    GAN's critic, stepped alone for several steps) has other shapes."""
    if any(n.kind == "optimizer" for n in trace.notes):
        return None
    norm = trace.grad_norm
    if norm is None or not norm > 0:
        return None
    return next((n for n in trace.notes if n.kind == "foreign_step" and n.data.get("same")), None)


@rule(
    "NW315",
    title="The optimizer never updates the watched model: it holds none of its weights",
    severity="warning",
    summary=(
        "Step after step, backward() gives the model's weights gradients and an optimizer "
        "steps, but its parameters are none of them: it was built on another instance of "
        "the model (re-created, reloaded or deep-copied after the optimizer was made)."
    ),
    early=True,
    priority=12,
)
def foreign_optimizer(ctx: RuleContext) -> Iterator[Diagnosis]:
    note = _foreign_only(ctx.trace)
    if note is None:
        return
    recent = ctx.history[-(_FOREIGN_STEPS - 1) :]
    if len(recent) < _FOREIGN_STEPS - 1 or not all(_foreign_only(t) for t in recent):
        return
    if ctx.history[: -(_FOREIGN_STEPS - 1)] and _foreign_only(ctx.history[-_FOREIGN_STEPS]):
        return  # said at the first step of the run
    count = note_num(note, "params")
    # the user's own optimizer class and lr (a torch.optim name; another class's
    # import is not known)
    known = note.path.isidentifier() and isinstance(getattr(torch.optim, note.path, None), type)
    cls = note.path if known else "SGD"
    lr = note_num(note, "lr")
    # the watched model's own class, when it is the user's (not a torch.nn container)
    types = {c.module_type for c in ctx.trace.calls if c.root and not c.is_loss}
    mine = types.pop() if len(types) == 1 else None
    user = mine is not None and mine.isidentifier() and not hasattr(torch.nn, mine)
    net, args = (mine, " (with your arguments)") if user and mine else ("Net", "")
    lr_arg = f"lr={hyper(lr)}" if known and lr is not None and math.isfinite(lr) else "lr=0.1"
    evidence = [
        f"for {_FOREIGN_STEPS} steps (to step {ctx.step}) backward() gave the watched "
        f"weights gradients and {note.path} stepped, but none of its "
        + (f"{int(count)} " if count is not None else "")
        + "parameters is a watched weight: no update reached the model",
        "its parameters have exactly the shapes of the model's weights: they are those of "
        "another instance of the model",
    ]
    yield ctx.diagnosis(
        path=None,
        evidence=evidence,
        explanation=(
            "An optimizer holds the tensors it was given when it was made. A model built "
            "again after that (a second model = Net(), a checkpoint loaded into a new "
            "instance, a deepcopy, a wrapper that copies the weights) trains with its own "
            "tensors, which the optimizer never touches: the loss never improves, and every "
            "value stays finite."
        ),
        fix=(
            f"model = {net}()   # the model as it will train{args}: built, loaded, wrapped\n"
            f"optimizer = torch.optim.{cls}(model.parameters(), {lr_arg}"
            ")   # then the optimizer, on its parameters"
        ),
    )


# ---------------------------------------------------------------------- NW305


@rule(
    "NW305",
    title="Loss scaler collapse",
    severity="error",
    summary=(
        "The GradScaler's scale keeps falling: step after step is skipped because the "
        "gradients are inf/NaN at any scale (the scaler is found at scaler.scale(loss))."
    ),
    early=True,
    priority=10,
)
def scaler_collapse(ctx: RuleContext) -> Iterator[Diagnosis]:
    if not ctx.facts.get("scaler"):
        return
    cur = ctx.trace.scale
    if cur is None:
        return
    # the scale is read at scaler.scale(loss): a fall from one step to the next is the
    # earlier step's skip; this step's own skip shows in its gradients (or is unknown)
    series = [(t.step, t.scale) for t in ctx.history if t.scale is not None]
    series.append((ctx.step, cur))
    skips = 0
    for (_, before), (_, after) in zip(reversed(series[:-1]), reversed(series[1:]), strict=True):
        if after is not None and before is not None and after < before:
            skips += 1
        else:
            break
    why, birth = ctx.memo(ctx.trace, "NW305.skip", _skip_cause)
    if why == "finite":
        return  # this step's gradients are finite: the scaler applies it, training goes on
    nan_born = why == "nan" and birth is not None
    if nan_born and _nan_born_before(ctx):
        skips = max(skips, 1)
    else:
        nan_born = False
    skipped_now = why in ("nan", "inf")
    need = ctx.thresholds.scaler_skips
    window = [s for _, s in series if s is not None]
    falls = sum(1 for x, y in itertools.pairwise(window) if y < x)
    collapsed = skips >= need and cur <= 1.0
    chronic = len(window) > 2 * need and falls >= len(window) // 2 and skips >= need
    if not (collapsed or chronic or nan_born):
        return
    if (
        not collapsed
        and not nan_born
        and (why in ("inf", "finite") or (why is None and _oversized(cur, birth)))
    ):
        return  # a scale coming down to a working value (each overflow halves it), or settled
    first = series[-1 - skips][1]
    known = len(window) - 1 + (1 if why is not None else 0)
    evidence = [
        f"scale fell from {fmt(first)} to {fmt(cur)} over the last {count(skips, 'step')}: each "
        "fall is a skipped optimizer step",
        f"{falls + skipped_now} of the last {known} steps were skipped",
    ]
    a = ctx.anomaly
    bad_grads = [
        r.role
        for r in ctx.trace.records
        if r.phase is Phase.GRADIENT and r.stat and not r.stat.finite
    ]
    if bad_grads:
        evidence.append("non-finite (scaled) gradients this step: " + ", ".join(bad_grads[:5]))
    head, check = _grad_check(ctx)
    fix = (
        "scaler.unscale_(optimizer)\n" + head + "bad = [n for n, p in model.named_parameters()\n"
        f"       if p.grad is not None and not {check}]\n"
        f"print(bad)   # then {_forensic_call(ctx.trace)} on one step"
    )
    explanation = (
        "A GradScaler halves its scale whenever the gradients contain inf/NaN and skips "
        "that step. A few skips at the start are normal; a scale that keeps falling "
        "means the gradients are non-finite whatever the scale: a NaN in the forward "
        "pass or the loss, not an overflow. Training has silently stopped: no step is "
        "applied."
    )
    path = a.path if a is not None else None
    source: str | None = None
    if why == "inf" and cur <= 1.0 and not nan_born:
        # the gradient records are the parameters' (float32 master weights); what overflows
        # is the low-precision backward in between: float16 unless a record says otherwise
        low = [r.dtype for r in ctx.trace.records if r.phase in _GRAD_RECORDS]
        dtype = next((d for d in low if low_precision(d) is not None), "float16")
        lim = limits(dtype)
        assert lim is not None
        dev = device_type(None, *(r.device for r in ctx.trace.records))
        if birth is not None:
            path = birth.path
            evidence.append(
                f"{birth.summary}: the gradients overflow to inf even at scale {fmt(cur)}, "
                f"past {dtype}'s max {fmt(lim.max)} unscaled"
            )
        fix = (
            "loss = criterion(out, y)   # reduction='mean' (not 'sum'), or divide the loss "
            "by the batch size\n"
            f"with torch.autocast({dev}, dtype=torch.bfloat16):   # float32's range: "
            "no GradScaler needed"
        )
        explanation = (
            f"A GradScaler halves its scale whenever the gradients contain inf/NaN and "
            f"skips that step. These gradients are inf, not NaN: {dtype} gradients "
            f"overflow even unscaled (at scale {fmt(cur)}), so the scale falls below 1 and "
            "no step is applied. The loss is too large for the dtype: a summed loss grows "
            "with the batch; a mean-reduced or smaller loss, or bfloat16 / float32, fits."
        )
    if nan_born and birth is not None:
        path = birth.op.path if birth.op is not None and birth.op.path else birth.path
        source = birth.op.source if birth.op is not None else None
        evidence.append(
            f"{birth.summary}: the first non-finite gradient holds NaN and no inf, from "
            "finite gradients; no scale makes a NaN, so every step is skipped whatever the "
            "scale"
        )
        named = _named_cause(ctx, birth)
        if named is not None:
            evidence.append(f"{named.code} {named.title}: " + "; ".join(named.evidence[:2]))
            fix = named.fix
            source = named.source or source
        else:
            fix = (
                "with torch.autograd.detect_anomaly():   # names the backward op that makes "
                "the NaN\n"
                "    scaler.scale(loss).backward()      # and the forward line it belongs to\n"
                f"# or {_forensic_call(ctx.trace)} on one step"
            )
        explanation = (
            "A GradScaler halves its scale whenever the gradients contain inf/NaN and skips "
            "that step. An inf can be the scale's doing (a scaled gradient past float16's "
            "max) and a smaller scale cures it; a NaN born in backward from finite "
            "gradients is not: the backward itself makes it (0 × inf, 0 / 0) at any "
            "scale, and the scaler hides it by skipping the step. Training has silently "
            "stopped: no step is applied."
        )
    yield ctx.diagnosis(
        step=ctx.step,
        path=path,
        severity="error" if collapsed or nan_born else "warning",
        evidence=evidence,
        explanation=explanation,
        fix=fix,
        source=source,
    )


def _nan_born_before(ctx: RuleContext) -> bool:
    """Whether the step before this one, under the scaler too, also made a NaN in backward
    from finite gradients: twice in a row is the model's doing, not a one-off batch."""
    prev = ctx.history[-1] if ctx.history else None
    if prev is None or prev.scale is None:
        return False
    why, birth = ctx.memo(prev, "NW305.skip", _skip_cause)
    return why == "nan" and birth is not None


def _forensic_call(trace: StepTrace) -> str:
    """``nanwatch.watch(model, criterion, mode="forensic")``, naming a criterion only when
    one was watched (a root loss module)."""
    crit = any(c.root and c.is_loss and c.path != LOSS_PATH for c in trace.calls)
    return f'nanwatch.watch(model{", criterion" if crit else ""}, mode="forensic")'


def _skip_cause(trace: StepTrace) -> tuple[str | None, Anomaly | None]:
    """Why this step's scaled gradients were (or were not) skipped, from its records
    localized as if no scaler ran (a scaler's step is not localized: it expects inf/NaN
    now and then): ``"nan"`` (the first non-finite gradient holds NaN and no inf, every
    gradient before it finite: the backward made it, 0 × inf or 0 / 0; a scale that is
    too large overflows to inf first, so a NaN is never the scale's fault), ``"inf"`` (a
    scaled gradient past its dtype's max: the scaler's job to find), ``"finite"`` (the
    gradients were measured and are finite: the step was applied), or None (unknown)."""
    b = localize(trace, scaled_grads=False)
    grads = [r for r in trace.records if r.phase in _GRAD_RECORDS and r.stat is not None]
    if b is None:
        return ("finite" if grads else None), None
    s = b.record.stat
    if b.record.phase not in _GRAD_RECORDS or s is None:
        return None, None
    if s.has_posinf or s.has_neginf:
        return "inf", b
    infs = any(r.stat is not None and (r.stat.has_posinf or r.stat.has_neginf) for r in grads)
    if (b.kind is AnomalyKind.BACKWARD or not infs) and not _overflow_made_nan(trace, b):
        return "nan", b
    return "inf", b


#: headroom below a dtype's max under which a scaled gradient entering an op cannot have
#: overflowed inside it: one backward op rarely amplifies a gradient 1024-fold
_OVERFLOW_HEADROOM = 2.0**10


def _overflow_made_nan(trace: StepTrace, b: Anomaly) -> bool:
    """The NaN-looking first bad gradient ``b`` may be the scale's doing: its values were not
    counted (the min and max alone, where a NaN hides any inf beside it) and the finite
    gradient that entered the op making it was within 1024x of the max of the
    low-precision dtype it was made in. float16's log_softmax backward at scale 2**40 does
    that on CUDA: -inf + inf = NaN beside +inf, all from one finite input of 1.1e12. A
    smaller scale cures it, so the scaler's halving is working, not the model failing."""
    s = b.record.stat
    if s is None or s.counted:
        return False  # counted: an inf beside the NaN would show, and none did
    lim = low_precision(b.record.dtype)
    if lim is None:
        return False  # a float32/bfloat16 gradient: no scale overflows its range
    # the gradient of the birth module's own output(s), else every finite gradient before it
    upstream = [
        r
        for r in trace.records
        if r.index < b.record.index
        and r.phase is Phase.BACKWARD
        and r.stat is not None
        and r.stat.finite
    ]
    entering = [r for r in upstream if r.path == b.path and r.role.startswith("output")]
    big = max((r.stat.magnitude for r in entering or upstream if r.stat), default=0.0)
    return big * _OVERFLOW_HEADROOM >= lim.max


_GRAD_RECORDS = (Phase.BACKWARD, Phase.GRADIENT)


def _oversized(scale: float, birth: Anomaly | None) -> bool:
    """A scale so large that any gradient the low-precision dtype holds as a normal number
    overflows at it (scale > finfo.max / finfo.tiny): a fall is certain."""
    lim = low_precision(birth.record.dtype if birth is not None else None) or limits("float16")
    assert lim is not None
    return scale > lim.max / lim.tiny


#: rule families that do not explain where a value was born: the training loop's (NW3xx:
#: weights, gradients, the optimizer) and the guards' (NW5xx, said at the user's line).
_NOT_A_BIRTH = ("NW3", "NW5")


def _named_cause(ctx: RuleContext, birth: Anomaly) -> Diagnosis | None:
    """The diagnosis the other rules give the NaN's birth (NW112 for a sqrt at 0), as they
    would without a scaler; None when only the catch-all would name it."""
    trace = dataclasses.replace(ctx.trace, anomaly=birth, diagnoses=[])
    sub = RuleContext(
        trace=trace, history=ctx.history, thresholds=ctx.thresholds, facts=dict(ctx.facts)
    )
    found: list[Diagnosis] = []
    for r in REGISTRY.values():
        if r.fallback or r.code.startswith(_NOT_A_BIRTH):
            continue
        sub.rule = r
        try:
            found.extend(d for d in r(sub) if d.severity == "error")
        except Exception:  # the main evaluation reports a broken rule
            continue
    found.sort(key=sort_key)
    return found[0] if found else None


# ---------------------------------------------------------------------- NW306


def _decay_growth(optimizer: str, g: dict[str, object]) -> tuple[float, float, str] | None:
    """For an update whose weight decay alone makes the weights grow: (the limit on
    lr × weight_decay, the factor |w| grows by each step, how the optimizer applies the
    decay); None when it is stable or when the decay is normalized away (Adam's L2 term is
    divided by sqrt(v) like the gradient, so it cannot diverge by itself).

    SGD adds weight_decay * w to the gradient: w <- (1 - a) w with a = lr * wd without
    momentum, stable for a < 2; heavy-ball momentum mu (dampening d) for a (1 - d) <
    2 (1 + mu); Nesterov for a < 2 (1 + mu) / (1 + 2 mu). AdamW (and decoupled_weight_decay)
    multiplies w by 1 - a before its step: stable for a < 2. Checked against torch.optim
    on a weight with a zero gradient."""
    lrs, wds = _numbers(g.get("lr")), _numbers(g.get("weight_decay"))
    if not lrs or not wds or not math.isfinite(lrs[0] * wds[0]):
        return None
    a = lrs[0] * wds[0]
    if optimizer == "SGD":
        mu = (_numbers(g.get("momentum")) or [0.0])[0]
        damp = (_numbers(g.get("dampening")) or [0.0])[0]
        if mu <= 0:
            limit, trace, det, how = 2.0, 1.0 - a, 0.0, "adds weight_decay * w to the gradient"
        elif g.get("nesterov") is True:
            limit = 2 * (1 + mu) / (1 + 2 * mu)
            trace, det = 1 - a * (1 + mu) + mu, mu * (1 - a)
            how = f"adds weight_decay * w to the gradient, with Nesterov momentum {fmt(mu)}"
        else:
            if damp >= 1:
                return None
            # dampening scales the decay's share of the momentum buffer by 1 - dampening
            limit, trace, det = 2 * (1 + mu) / (1 - damp), 1 - a * (1 - damp) + mu, mu
            how = f"adds weight_decay * w to the gradient, with momentum {fmt(mu)}"
    elif optimizer == "AdamW" or g.get("decoupled_weight_decay") is True:
        limit, trace, det, how = 2.0, 1.0 - a, 0.0, "multiplies w by 1 - lr * weight_decay"
    else:
        return None
    if a <= limit:
        return None
    # the larger root of z^2 - trace z + det: what |w| is multiplied by each step
    disc = trace * trace - 4 * det
    growth = (
        max(abs(trace + math.sqrt(disc)), abs(trace - math.sqrt(disc))) / 2
        if disc >= 0
        else math.sqrt(abs(det))
    )
    return limit, growth, how


@rule(
    "NW306",
    title="Weight decay makes the weights diverge",
    severity="error",
    summary=(
        "lr × weight_decay is past the limit where the decay overshoots 0 (2 for SGD and "
        "AdamW, 2(1 + momentum) with momentum): the weights grow geometrically whatever "
        "the gradients are."
    ),
    early=True,
    priority=12,
)
def diverging_decay(ctx: RuleContext) -> Iterator[Diagnosis]:
    yield from _growing_averages(ctx)
    worst: tuple[float, str, dict[str, object], float, str, float] | None = None
    for n in ctx.trace.notes:
        if n.kind != "optimizer":
            continue
        for g in n.data.get("groups", ()):
            if not isinstance(g, dict):
                continue
            found = _decay_growth(n.path, g)
            if found is not None and (worst is None or found[1] > worst[0]):
                limit, growth, how = found
                worst = (growth, n.path, g, limit, how, _numbers(g.get("lr"))[0])
    if worst is None:
        return
    growth, optimizer, g, limit, how, lr = worst
    wd = _numbers(g.get("weight_decay"))[0]
    gi = g.get("group", 0)
    gi = gi if isinstance(gi, int) and not isinstance(gi, bool) else 0
    listed = g.get("names")
    names = [x for x in listed if isinstance(x, str)] if isinstance(listed, list) else []
    held = ""
    if names:  # the watched weights the group holds, when the note names them
        held = f" ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
    elif isinstance(n_params := g.get("params"), int):
        held = f" ({count(n_params, 'weight')})"
    evidence = [
        f"{optimizer} param group {gi}{held}: lr {hyper(lr)} × weight_decay {fmt(wd)} = "
        f"{fmt(lr * wd)}, past {fmt(limit)}, the largest value for which its update stays "
        "bounded",
        f"{optimizer} {how}: each step multiplies the weights by up to {fmt(growth)} in size "
        f"(x{fmt(growth**10)} after 10 steps) before any gradient is added",
    ]
    if ctx.anomaly is not None:
        evidence.append(f"then, at step {ctx.step}: {ctx.anomaly.summary}")
    good = limit / 10 / lr
    explanation = (
        "Weight decay pulls each weight toward 0 by lr × weight_decay of itself per "
        f"step. Past {fmt(limit)} it overshoots 0 by more than the weight was, so the "
        "weights flip sign and grow geometrically, step after step, until they overflow. "
        "Clipping the gradients cannot stop it: the decay is applied inside "
        "optimizer.step(), after clipping."
    )
    if wd <= _USUAL_DECAY:
        # a usual decay: only a learning rate far past any usable one (> 20) goes past
        # the limit with it, and that lr throws the weights off by itself too
        new = 1e-3 if _normalized(optimizer) else min(0.1, _round_down(limit / 10 / wd))
        yield ctx.diagnosis(
            severity="error",
            evidence=evidence,
            explanation=explanation
            + f" weight_decay {fmt(wd)} is a usual value; the learning rate {hyper(lr)} is "
            "not"
            + (" (Adam-like optimizers: 1e-5 to 1e-2)" if _normalized(optimizer) else "")
            + ": even without the decay, a step that large throws the weights far from "
            "anything learned.",
            fix=(
                f'optimizer.param_groups[{gi}]["lr"] = {hyper(new)}   # was {hyper(lr)} '
                f"({optimizer}, weight_decay {fmt(wd)}): lr × weight_decay must stay well "
                f"below {fmt(limit)}"
            ),
        )
        return
    yield ctx.diagnosis(
        severity="error",
        evidence=evidence,
        explanation=explanation
        + " weight_decay is usually 1e-4 to 0.1; it was probably given where a learning "
        "rate or a decay factor was meant.",
        fix=(
            f"optimizer.param_groups[{gi}].update(weight_decay={fmt(min(good, 0.01))})   "
            f"# was {fmt(wd)} ({optimizer}, lr {hyper(lr)})\n"
            f"# keep lr * weight_decay well below {fmt(limit)} (typical: 1e-5 to 1e-3)"
        ),
    )


#: the largest weight decay in common use: past the divergence limit with one of these, the
#: learning rate is the value out of its range (over 2 / 0.1 = 20)
_USUAL_DECAY = 0.1


#: a running-average coefficient of an optimizer's group, what it averages, the largest
#: value that keeps the average bounded (inclusive when ``strict`` is False), the usual
#: value, and what goes wrong past it
_AVERAGES: tuple[tuple[str, int | None, str, float, bool, str, str], ...] = (
    ("momentum", None, "momentum", 1.0, True, "0.9",
     "the momentum buffer (buf = momentum * buf + grad) is multiplied by {v} each step and "
     "never decays: the update grows geometrically whatever the learning rate"),
    ("betas", 0, "beta1", 1.0, True, "(0.9, 0.999)",
     "the first moment never decays (beta1 > 1 grows it geometrically) and its bias "
     "correction 1 - beta1**step is 0 or negative"),
    ("betas", 1, "beta2", 1.0, True, "(0.9, 0.999)",
     "the second moment's bias correction 1 - beta2**step is 0 or negative: the update "
     "divides by 0 or takes the square root of a negative number"),
    ("alpha", None, "alpha", 1.0, True, "0.99",
     "the squared-gradient average (alpha * avg + (1 - alpha) * grad**2) never learns the "
     "gradient's size (alpha = 1) or turns negative (alpha > 1): the update divides by 0 or "
     "takes the square root of a negative number"),
    ("rho", None, "rho", 1.0, False, "0.9",
     "the running averages (rho * avg + (1 - rho) * x**2) turn negative: the square roots of "
     "the update are NaN"),
)  # fmt: skip


#: the keys that weigh a running average in each torch.optim class, for a note that does
#: not say (the watcher records them by the optimizer's class: ``averages``)
_AVERAGED_BY_NAME: dict[str, tuple[str, ...]] = {
    "SGD": ("momentum",),
    "RMSprop": ("momentum", "alpha"),
    "Adadelta": ("rho",),
    **dict.fromkeys(("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "SparseAdam"), ("betas",)),
}


def _averaged_keys(n: Note) -> tuple[str, ...]:
    """The group keys of the optimizer of note ``n`` that weigh a running average: those
    the watcher found by the optimizer's class, else those of the torch.optim class of its
    name. A key of another optimizer (SAM's neighbourhood radius ``rho``) is no decay."""
    listed = n.data.get("averages")
    if isinstance(listed, list):
        return tuple(k for k in listed if isinstance(k, str))
    return _AVERAGED_BY_NAME.get(n.path, ())


def _growing_averages(ctx: RuleContext) -> Iterator[Diagnosis]:
    """A running-average coefficient at or past 1 (SGD's momentum, Adam's betas, RMSprop's
    alpha, Adadelta's rho): the average grows instead of decaying, the update with it,
    whatever the learning rate. An error from the first step, before any overflow."""
    for n in ctx.trace.notes:
        if n.kind != "optimizer":
            continue
        averaged = _averaged_keys(n)
        for g in n.data.get("groups", ()):
            if not isinstance(g, dict):
                continue
            for key, pos, label, limit, strict, usual, why in _AVERAGES:
                if key not in averaged:
                    continue  # another meaning there: SAM's rho, ASGD's or Adamax's alpha
                nums = _numbers(g.get(key))
                if pos is not None:
                    nums = nums[pos : pos + 1]
                if not nums or not (nums[0] >= limit if strict else nums[0] > limit):
                    continue
                v = nums[0]
                gi = g.get("group", 0)
                gi = gi if isinstance(gi, int) and not isinstance(gi, bool) else 0
                evidence = [
                    f"{n.path} param group {gi}: {label}={fmt(v)}, "
                    f"{'at or past' if strict else 'past'} {fmt(limit)}",
                    why.format(v=fmt(v))
                    + (f" (x{fmt(v**10)} after 10 steps)" if v > 1 and key == "momentum" else ""),
                ]
                if ctx.anomaly is not None:
                    evidence.append(f"then, at step {ctx.step}: {ctx.anomaly.summary}")
                was = g.get(key)
                shown = tuple(was) if isinstance(was, list) else was
                yield ctx.diagnosis(
                    title=f"Optimizer {label} >= 1: the update grows instead of averaging",
                    severity="error",
                    # the cause of the non-finite weights or state NW301 finds after it
                    priority=9,
                    evidence=evidence,
                    explanation=(
                        f"{n.path}'s {label} weights a running average: below 1 the past "
                        f"fades and the average stays the size of the gradients. At {fmt(v)} "
                        "it never fades, so the update grows step after step until the "
                        "weights overflow. A lower learning rate or gradient clipping only "
                        f"delays it: {label} must be below 1 ({usual} is usual)."
                    ),
                    fix=(
                        f'optimizer.param_groups[{gi}]["{key}"] = {usual}   '
                        f"# was {shown} ({n.path})"
                    ),
                )
                return


# ---------------------------------------------------------------------- NW307


def _stale_note(ctx: RuleContext) -> Note | None:
    """This step's ``"stale_grads"`` note (see ``Watcher._grads_around_backward``), or for
    an overflow, one of the last few steps' (the anomaly can come before this step's
    optimizer step)."""
    steps = [ctx.trace]
    a = ctx.anomaly
    if a is not None and a.kind is not AnomalyKind.INPUT:
        steps += ctx.history[::-1][:3]
    for t in steps:
        for n in t.notes:
            if n.kind == "stale_grads":
                return n
    return None


@rule(
    "NW307",
    title="Gradients never reset: optimizer.zero_grad() is missing",
    severity="warning",
    summary=(
        "An optimizer stepped with gradients that backward() had added to those of its "
        "previous step, with no zero_grad() between: each update applies the sum of every "
        "past gradient, and grows until the weights overflow."
    ),
    early=True,
    priority=13,
)
def stale_grads(ctx: RuleContext) -> Iterator[Diagnosis]:
    yield from _stale_grads(ctx)


def _stale_grads(ctx: RuleContext) -> Iterator[Diagnosis]:
    n = _stale_note(ctx)
    if n is None:
        return
    d = n.data
    named = d.get("variable")
    opt = named if isinstance(named, str) and named else "optimizer"
    listed = d.get("names")
    names = [x for x in listed if isinstance(x, str)] if isinstance(listed, list) else []
    stale, total = d.get("count"), d.get("params")
    held = ", ".join(names[:3]) + (", ..." if isinstance(stale, int) and stale > 3 else "")
    if isinstance(stale, int) and isinstance(total, int) and total > 0:
        share = f"{stale} of the {total}" if stale < total else f"all {total}"
        held += f" ({share} weights it updates)"
    evidence = [
        f"{n.path}{f' ({opt})' if opt == named else ''} stepped with the .grad of {held} "
        "still holding its previous step's gradients: backward() added to them, and "
        "nothing reset them in between",
    ]
    if n.source:
        evidence.append(f"{opt if opt == named else n.path}.step() at {n.source}")
    a = ctx.anomaly
    born = a.record.stat if a is not None else None
    # the growing update is what overflowed: an inf, or a weight the update made non-finite
    grown = a is not None and (
        a.kind is AnomalyKind.PARAMETER
        or (
            a.kind is not AnomalyKind.INPUT
            and born is not None
            and (born.has_posinf or born.has_neginf)
        )
    )
    if a is not None:
        evidence.append(f"then, at step {ctx.step}: {a.summary}")
    yield ctx.diagnosis(
        severity="error" if grown else "warning",
        evidence=evidence,
        source=n.source,
        explanation=(
            "backward() adds each new gradient to .grad; only zero_grad() (or p.grad = None) "
            "resets it. Without it every update applies the sum of all the gradients so far: "
            "the steps grow as training goes on until the weights overflow, and clipping or "
            "a lower learning rate only delays it. To accumulate over micro-batches, call "
            "zero_grad() after each optimizer step."
        ),
        fix=(
            f"{opt}.zero_grad()   # right after {opt}.step(): backward() adds to .grad, "
            "it never resets it"
        ),
    )


def unreset_grads(ctx: RuleContext) -> Diagnosis | None:
    """NW307's diagnosis when gradients were never reset in this step or, for an anomaly,
    the last few (for another rule's fix: an overflow they led to is not cured by clipping or
    a lower learning rate); None otherwise."""
    probe = dataclasses.replace(ctx, rule=REGISTRY["NW307"], _now={})
    return next(_stale_grads(probe), None)


# ---------------------------------------------------------------------- NW309
#: the parameter names clip_grad_norm_ takes its bound by
_MAX_NORM_ARGS = ("max_norm",)


def _max_norm_text(code: str | None) -> str | None:
    """The user's expression for ``max_norm`` in their ``clip_grad_norm_`` call: its second
    positional argument or its keyword; None when the line does not show the call."""
    for stmt in statements(code):
        try:
            tree = ast.parse(stmt)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name not in ("clip_grad_norm_", "clip_grad_norm"):
                continue
            arg = next((k.value for k in node.keywords if k.arg in _MAX_NORM_ARGS), None)
            if arg is None and len(node.args) >= 2:
                arg = node.args[1]
            if arg is not None:
                return ast.get_source_segment(stmt, arg)
    return None


@rule(
    "NW309",
    title="Gradient clipping with max_norm 0 or below",
    severity="warning",
    summary=(
        "clip_grad_norm_ multiplies every gradient by max_norm / (total norm + 1e-6): with "
        "max_norm=0 every update is 0 and nothing trains; a negative max_norm flips every "
        "gradient, and the optimizer climbs the loss. It has no 'off' value."
    ),
    early=True,
    priority=12,
)
def clip_to_nothing(ctx: RuleContext) -> Iterator[Diagnosis]:
    note = next((n for n in ctx.trace.notes if n.kind == "clip"), None)
    if note is None:
        return
    bound = note.data.get("max_norm")
    if not isinstance(bound, float) or bound > 0:
        return
    code = note.data.get("code")
    code = code if isinstance(code, str) else None
    flipped = bound < 0
    evidence = [
        f"clip_grad_norm_ was given max_norm={fmt(bound)}"
        + (f" at {note.source}: {code}" if note.source and code else ""),
        "it multiplies every gradient by max_norm / (total norm + 1e-6)"
        + (
            f" = {fmt(bound)} / (norm + 1e-6), below 0 (clamped at 1 above only): every "
            "gradient points the other way, and each update climbs the loss"
            if flipped
            else " = 0: the optimizer applies zero gradients, and no weight moves"
        ),
    ]
    text = _max_norm_text(code)
    if code and text is not None and not _is_number(text):
        fix = (
            f"if {text} > 0:   # 0 or less: no clipping (clip_grad_norm_ has no 'off' value)\n"
            f"    {code.strip()}"
        )
    elif code and text is not None:
        fix = (
            f"{code.strip().replace(text, '1.0', 1)}   # a positive bound; or drop the call "
            "to train unclipped"
        )
    else:
        fix = (
            "if max_norm > 0:   # 0 or less: no clipping\n"
            "    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)"
        )
    yield ctx.diagnosis(
        path=None,
        severity="error" if flipped else "warning",
        evidence=evidence,
        explanation=(
            "torch.nn.utils.clip_grad_norm_ rescales the gradients so that their total norm "
            "is at most max_norm. It has no value that turns it off: max_norm=0 rescales "
            "them to 0, and a negative one flips them. Trainers whose configs read "
            "max_grad_norm=0 as 'no clipping' skip the call; a loop that calls it "
            "unconditionally with that setting trains nothing."
        ),
        fix=fix,
        source=note.source,
    )


@rule(
    "NW310",
    title="Gradients clipped while still multiplied by the GradScaler's scale",
    severity="warning",
    summary=(
        "clip_grad_norm_ ran before scaler.unscale_(optimizer): it measured the scaled "
        "gradients, whose norm is the scale (65536 at first) times the real one, so every "
        "step clips to max_norm / scale and the bound follows the scale, not the gradients."
    ),
    early=True,
    priority=12,
)
def clip_scaled(ctx: RuleContext) -> Iterator[Diagnosis]:
    note = next(
        (n for n in ctx.trace.notes if n.kind == "clip" and note_num(n, "scale") is not None),
        None,
    )
    if note is None:
        return
    scale = note_num(note, "scale")
    assert scale is not None
    bound = note.data.get("max_norm")
    code = note.data.get("code")
    code = code.strip() if isinstance(code, str) else None
    var = _scaler_name(ctx.trace)
    optim = ctx.memo(ctx.trace, "loop_names", _loop_names).optimizer or "optimizer"
    said = f"max_norm={fmt(bound)}" if isinstance(bound, float) else "its max_norm"
    evidence = [
        f"clip_grad_norm_({said}) ran"
        + (f" at {note.source}: {code}" if note.source and code else "")
        + f", before {var}.unscale_({optim}): the gradients it measured were still "
        f"multiplied by the GradScaler's scale, {fmt(scale)}",
        "the norm it compared with max_norm is "
        f"{fmt(scale)} times the real one: it clips once the real norm passes "
        + (
            f"{fmt(bound / scale)} (max_norm / scale)"
            if isinstance(bound, float)
            else "max_norm / scale"
        )
        + ", not max_norm, and that bound moves each time the scaler changes its scale",
    ]
    head = f"{var}.unscale_({optim})   # the real gradients: clip_grad_norm_ compares their norm"
    yield ctx.diagnosis(
        path=None,
        evidence=evidence,
        explanation=(
            "A GradScaler multiplies the loss, and so every gradient, by its scale, and "
            f"divides them back in {var}.step() or {var}.unscale_(). Anything that reads "
            "the gradients' values in between -- clipping, a norm you log -- sees them "
            f"scaled: clip_grad_norm_ then clips to max_norm / scale. {var}.unscale_() "
            f"first (once per optimizer per step; {var}.step() does not unscale twice)."
        ),
        fix=f"{head}\n{code}"
        if code
        else f"{head}\ntorch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)",
        source=note.source,
    )


@rule(
    "NW311",
    title="The optimizer stepped with no gradients: zero_grad() between backward() and step()",
    severity="warning",
    summary=(
        "Every weight the optimizer updates had a gradient when backward() returned, and "
        "none when step() ran: they were reset in between, so the update skips every "
        "weight and nothing trains."
    ),
    early=True,
    priority=12,
)
def step_without_grads(ctx: RuleContext) -> Iterator[Diagnosis]:
    for n in ctx.trace.notes:
        if n.kind != "optimizer" or not n.data.get("grads_dropped"):
            continue
        names = [x for x in n.data["grads_dropped"] if isinstance(x, str)]
        count = n.data.get("grads_dropped_count")
        count = count if isinstance(count, int) else len(names)
        loop = ctx.memo(ctx.trace, "loop_names", _loop_names)
        optim = loop.optimizer or "optimizer"
        shown = ", ".join(names[:3]) + (", ..." if count > 3 else "")
        yield ctx.diagnosis(
            path=None,
            evidence=[
                f"backward() gave gradients to the {count} weights {n.path} updates "
                f"({shown}); when {optim}.step() ran, every one of them was None",
                "an optimizer skips a weight whose .grad is None: this update changed nothing",
            ],
            explanation=(
                "zero_grad() resets the gradients (to None, by default): called after "
                "backward() and before step(), it drops the gradients backward just "
                "computed, and every step is empty. The loss never moves, yet every value "
                "stays finite. Reset them after the step (or before backward), not between."
            ),
            fix=(
                f"{optim}.zero_grad()   # before backward (or after step), not between them\n"
                "loss.backward()\n"
                f"{optim}.step()"
            ),
        )
        return


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------- NW312

#: optimizer steps in a row at lr exactly 0 before NW312 speaks: past any warmup that starts
#: at 0 for one step (transformers' get_linear_schedule_with_warmup)
_LR_ZERO_STEPS = 5


def _lr_zero(n: Note) -> bool:
    """Whether every param group of an ``"optimizer"`` note has an lr of exactly 0."""
    groups = n.data.get("groups")
    if not isinstance(groups, list) or not groups:
        return False
    return all(isinstance(g, dict) and g.get("lr") == 0 for g in groups)


def _grads_moved(trace: StepTrace) -> float | None:
    """This step's parameter gradients' total norm when it is above 0 (the largest
    parameter's when no total was kept); None when they were 0 or not measured."""
    if trace.grad_norm is not None and math.isfinite(trace.grad_norm):
        return trace.grad_norm if trace.grad_norm > 0 else None
    norms = [
        r.stat.norm
        for r in trace.records
        if r.phase is Phase.GRADIENT and r.stat is not None and r.stat.norm is not None
    ]
    top = max(norms, default=0.0)
    return top if top > 0 and math.isfinite(top) else None


def _floor_divisions(source: str) -> tuple[str, str, str] | None:
    """The lr lambda's source (``inspect.getsource``: the whole line of a lambda, or the
    ``def``) when it divides with ``//``: the first ``a // b``, its divisor ``b``, and the
    statement that holds it with every ``//`` of the function written ``/``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.Lambda, ast.FunctionDef))]
    for fn in funcs:
        divs = [
            n for n in ast.walk(fn) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.FloorDiv)
        ]
        if not divs:
            continue
        stmts = fn.body if isinstance(fn, ast.FunctionDef) else tree.body
        stmt = next((st for st in stmts if any(d in ast.walk(st) for d in divs)), None)
        if stmt is None:
            continue
        first = ast.unparse(divs[0])
        for d in divs:
            d.op = ast.Div()
        return first, ast.unparse(divs[0].right), ast.unparse(stmt)
    return None


@rule(
    "NW312",
    title="The lr is exactly 0: each optimizer step changes nothing",
    severity="warning",
    summary=(
        "Every param group of an optimizer had lr exactly 0 for 5 optimizer steps in a "
        "row while its gradients were not 0 (a warmup written with integer division, a "
        "schedule past its end, lr=0): the weights never move."
    ),
    early=True,
    priority=14,
)
def lr_stuck_at_zero(ctx: RuleContext) -> Iterator[Diagnosis]:
    need = _LR_ZERO_STEPS
    if len(ctx.history) < need - 1:
        return
    for n in ctx.trace.notes:
        if n.kind != "optimizer" or not _lr_zero(n):
            continue
        ident = n.data.get("ident")
        zero: list[tuple[StepTrace, float]] = []  # the steps it stepped at lr 0, latest first
        before: tuple[int, float] | None = None  # the latest step it had an lr above 0
        for t in (ctx.trace, *reversed(ctx.history)):
            m = next(
                (x for x in t.notes if x.kind == "optimizer" and x.data.get("ident") == ident),
                None,
            )
            if m is None:
                continue  # a step of gradient accumulation: no update
            if not _lr_zero(m):
                groups = m.data.get("groups") or []
                lrs = [g.get("lr") for g in groups if isinstance(g, dict)]
                top = max((x for x in lrs if isinstance(x, (int, float))), default=None)
                before = (t.step, float(top)) if top is not None else None
                break
            norm = _grads_moved(t)
            if norm is None:
                return  # no gradient to apply: nothing is lost to the lr (NW304 says why)
            zero.append((t, norm))
        if len(zero) < need:
            return
        yield _lr_zero_diagnosis(ctx, n, zero, before)
        return


def _held_as(found: Callable[[object], bool]) -> tuple[str, object] | None:
    """The user's expression for the first object ``found`` accepts in the frames of their
    code on the stack (innermost first): a local, an attribute of ``self``, a global, or one
    level into a local (an attribute, a dict's str key, a list's item: ``state["sched"]``,
    ``scheds[0]``), read from dicts, lists and ``__dict__`` only: no property runs."""
    f = _frames.user_frame(sys._getframe(1))
    depth = 0
    while f is not None and depth < 16:
        local = f.f_locals
        attrs = getattr(local.get("self"), "__dict__", None)
        loose: tuple[str, object] | None = None  # a loop's variable: the last item it took
        for names, prefix in ((local, ""), (attrs, "self."), (f.f_globals, "")):
            if not isinstance(names, Mapping):
                continue
            for key, value in list(names.items()):
                if isinstance(key, str) and key.isidentifier() and key != "self" and found(value):
                    if names is local and key in _loop_targets(f):
                        loose = loose or (key, value)
                        continue
                    return prefix + key, value
        for owner, value in list(local.items()):
            if not isinstance(owner, str) or not owner.isidentifier():
                continue
            inner: list[tuple[str, object]] = []
            try:  # a proxy's __dict__ may raise: that local is skipped
                if isinstance(value, dict):
                    inner = [
                        (f"[{k!r}]", v) for k, v in list(value.items())[:64] if isinstance(k, str)
                    ]
                elif isinstance(value, (list, tuple)):
                    inner = [(f"[{i}]", v) for i, v in enumerate(value[:64])]
                elif isinstance(fields := getattr(value, "__dict__", None), dict):
                    inner = [
                        (f".{k}", v)
                        for k, v in list(fields.items())[:256]
                        if isinstance(k, str) and k.isidentifier()
                    ]
            except Exception:
                continue
            for suffix, held in inner:
                if found(held):
                    return owner + suffix, held
        if loose is not None:
            return loose
        f = _frames.user_frame(f.f_back)
        depth += 1
    return None


def _loop_targets(f: Any) -> frozenset[str]:
    """The names the function running in frame ``f`` binds as ``for`` targets (``s`` of
    ``for s in scheds``): each holds one item of a collection, not the user's name for it."""
    found = _user_scope(f"{f.f_code.co_filename}:{f.f_lineno}")
    if found is None:
        return frozenset()
    return frozenset(
        n.id
        for node in ast.walk(found[2])
        if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension))
        for n in ast.walk(node.target)
        if isinstance(n, ast.Name)
    )


def _optimizer_named(ident: object) -> str | None:
    """The user's name for the optimizer whose ``id`` is ``ident`` (the optimizer note's)."""
    got = _held_as(lambda v: isinstance(v, torch.optim.Optimizer) and id(v) == ident)
    return got[0] if got is not None else None


def _scheduler_named(ident: object) -> tuple[str, str] | None:
    """The user's name for the lr scheduler that drives the optimizer ``ident``, and its
    class."""
    kinds = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    got = _held_as(lambda v: isinstance(v, kinds) and id(getattr(v, "optimizer", None)) == ident)
    return (got[0], type(got[1]).__name__) if got is not None else None


def _lr_zero_diagnosis(
    ctx: RuleContext,
    n: Note,
    zero: list[tuple[StepTrace, float]],
    before: tuple[int, float] | None,
) -> Diagnosis:
    groups = [g for g in n.data.get("groups") or [] if isinstance(g, dict)]
    base = [g.get("initial_lr") for g in groups]
    base_lr = next((x for x in base if isinstance(x, (int, float)) and x > 0), None)
    sched = n.data.get("scheduler")
    var = n.data.get("scheduler_variable")
    ident = n.data.get("ident")
    if (not isinstance(var, str) or not var) and (base_lr is not None or sched is not None):
        # the watcher looked where the optimizer is stepped; the scheduler may be held
        # elsewhere (a list of schedulers, a dict of state)
        held = _scheduler_named(ident)
        if held is not None and (sched is None or held[1] == sched):
            var, sched = held
    sname = var if isinstance(var, str) and var else None
    first, last = zero[-1][0].step, zero[0][0].step
    evidence = [
        f"{n.path}'s lr is exactly 0 for the last {len(zero)} optimizer steps (steps "
        f"{first} to {last}), in "
        + ("its one param group" if len(groups) == 1 else f"all {len(groups)} param groups"),
        f"its gradients are not 0 (total norm {fmt(zero[0][1])} at step {last}): the update "
        "is the lr times them, 0, and the weights do not move",
    ]
    if before is not None:
        evidence.append(
            f"it was {fmt(before[1])} at step {before[0]}: the schedule took it to 0 (a decay "
            "that ends at 0, a scheduler stepped past its total steps)"
        )
    fix = ""
    if isinstance(sched, str):
        evidence.append(
            f"{sched}{f' ({sname})' if sname else ''} sets it"
            + (f", from the base lr {hyper(base_lr)} (initial_lr)" if base_lr is not None else "")
        )
    lambdas = n.data.get("scheduler_lambdas")
    for lam in lambdas if isinstance(lambdas, list) else ():
        found = _floor_divisions(str(lam.get("code", ""))) if isinstance(lam, dict) else None
        if found is None:
            continue
        div, divisor, fixed = found
        at = str(lam.get("at", ""))
        where = f"{os.path.basename(at.rsplit(':', 1)[0])}:{at.rsplit(':', 1)[-1]}" if at else ""
        evidence.append(
            f"{sched}'s lr lambda ({where}) computes {div}, an integer division: 0 for every "
            f"step below {divisor}, so the factor it gives the lr is 0"
        )
        fix = f"{fixed}   # / not //: {div} is 0 until the step reaches {divisor}"
        break
    if not fix:
        if before is not None:
            fix = (
                f"# the schedule ends at 0 before training does: give {sname or 'its scheduler'} "
                "the run's real number of steps (num_training_steps, total_iters, T_max), or "
                "stop there"
            )
        elif isinstance(sched, str) and sname is not None:
            fix = (
                f"print({sname}.get_last_lr())   # 0: check the factor {sched} computes for "
                "the first steps (an integer division, a start at 0)"
            )
        elif isinstance(sched, str) or base_lr is not None:
            fix = (
                f"# {sched if isinstance(sched, str) else 'the scheduler'} of {n.path} sets "
                "its lr to 0"
                + (
                    f" (from its base lr {hyper(base_lr)}, initial_lr)"
                    if base_lr is not None
                    else ""
                )
                + ": print its get_last_lr() and check the factor it computes for the first "
                "steps (an integer division, a start at 0)"
            )
        else:
            # the user's name for it (in their frames, else their source); none found: the
            # line makes no assignment to a name they may not have
            loop = ctx.memo(ctx.trace, "loop_names", _loop_names).optimizer
            optim = _optimizer_named(ident) or (loop if loop != _LoopNames.optimizer else None)
            make = f"torch.optim.{n.path}(model.parameters(), lr=1e-3)"
            fix = (
                f"# {n.path} was made with lr=0 (or it was set to 0): give it a learning rate\n"
                + (f"{optim} = {make}" if optim else f"{make}   # where you make it, not lr=0")
            )
    return ctx.diagnosis(
        path=None,
        evidence=evidence,
        explanation=(
            f"An optimizer step moves each weight by the lr times what it makes of the "
            f"gradient: at lr 0 every step of {n.path} changes nothing, so nothing trains, "
            "while the loss and every value stay finite. A warmup that starts at 0 rises "
            "after its first step; this one stayed at 0."
        ),
        fix=fix,
    )


# ---------------------------------------------------------------------- NW308

#: the fix's lr puts the update at this share of the weight's size: a healthy update moves a
#: weight by about 1e-3 of itself; a hundredth still trains fast
_SAFE_SHARE = 1e-2


@dataclass(frozen=True)
class _Raise:
    """A param group whose lr the update before the spike raised ``explode_factor`` times or
    more over the update before it."""

    optimizer: str
    group: int
    old: float
    new: float
    step: int  #: the step of the update that used the raised lr


@dataclass(frozen=True)
class _Oversize:
    """A weight the update before the spike moved by as much as its own size or more."""

    optimizer: str
    group: int
    lr: float
    param: str
    move: float  #: about how far each of its values moved (lr, or lr × its gradient's RMS)
    size: float  #: the typical size of its values when watching began
    kind: str  #: ``"max"``: ``size`` is max |w|; ``"norm"``: its RMS
    plain: bool  #: lr × gradient (SGD), not about lr per value (Adam and its kin)
    step: int

    @property
    def ratio(self) -> float:
        return self.move / self.size

    def evidence(self) -> str:
        how = "lr × its gradient's RMS" if self.plain else "about lr, whatever the gradient"
        what = "largest |value|" if self.kind == "max" else "RMS value"
        return (
            f"the update at step {self.step} ({self.optimizer}, param group {self.group}, lr "
            f"{hyper(self.lr)}) moved {self.param} by {fmt(self.move)} per value ({how}): "
            f"{_times(self.ratio)} its {what} {fmt(self.size)} when watching began"
        )


def _group_lrs(n: Note) -> dict[int, dict[str, Any]]:
    """An ``"optimizer"`` note's param groups by index, those with a positive finite lr."""
    out: dict[int, dict[str, Any]] = {}
    for i, g in enumerate(n.data.get("groups", ())):
        if not isinstance(g, dict):
            continue
        lrs = _numbers(g.get("lr"))
        if lrs and math.isfinite(lrs[0]) and lrs[0] > 0:
            gi = g.get("group", i)
            out[gi if isinstance(gi, int) and not isinstance(gi, bool) else i] = g
    return out


def _lr_raises(ctx: RuleContext, update: StepTrace) -> list[_Raise]:
    """The param groups whose lr at ``update`` (the last step of the history, whose update
    wrote the weights the spiking loss was computed with) is ``explode_factor`` times or
    more the lr the same optimizer's group had at its update before."""
    factor = ctx.thresholds.explode_factor
    out: list[_Raise] = []
    for n in update.notes:
        if n.kind != "optimizer":
            continue
        before = next(
            (
                m
                for t in reversed(ctx.history[:-1])
                for m in t.notes
                if m.kind == "optimizer"
                and m.path == n.path
                and m.data.get("ident") == n.data.get("ident")
            ),
            None,
        )
        if before is None:
            continue
        old_groups = _group_lrs(before)
        for gi, g in _group_lrs(n).items():
            old = old_groups.get(gi)
            if old is None:
                continue
            new_lr, old_lr = _numbers(g.get("lr"))[0], _numbers(old.get("lr"))[0]
            if new_lr >= factor * old_lr:
                out.append(_Raise(n.path, gi, old_lr, new_lr, update.step))
    return out


def _oversized_update(ctx: RuleContext, update: StepTrace) -> _Oversize | None:
    """The update of ``update`` when it moved the weights of one param group by their own
    size or more (their size when watching began: the attach check's read,
    ``facts["weight_scales"]``): the weight holding the most values among those it moved so;
    None otherwise. Adam and its kin move each value by about lr (Lion by exactly lr); a
    plain optimizer by lr × the gradient (its RMS per value). It must be so for at least
    half the values the group updated: a weight initialized near 0 on purpose (a LayerScale
    gain of 1e-6) is moved by many times its size at every healthy step, and a weight that
    was exactly 0 (a bias, a zero-initialized gate) has no size to compare with. LBFGS, LAMB
    and LARS set the step's size apart from the lr."""
    scales = ctx.facts.get("weight_scales")
    if not isinstance(scales, Mapping) or not scales:
        return None
    grads = {
        r.role: r.stat.norm
        for r in update.records
        if r.phase is Phase.GRADIENT
        and r.stat is not None
        and r.stat.norm is not None
        and math.isfinite(r.stat.norm)
        and r.stat.norm > 0
    }
    notes = [n for n in update.notes if n.kind == "optimizer"]
    best: _Oversize | None = None
    for n in notes:
        low = n.path.lower()
        if n.path == "LBFGS" or "lamb" in low or "lars" in low:
            continue
        plain = not (_normalized(n.path) or "lion" in low)
        groups = _group_lrs(n)
        only = len(notes) == 1 and len(groups) == 1
        for gi, g in groups.items():
            lr = _numbers(g.get("lr"))[0]
            listed = [x for x in g.get("names", ()) if isinstance(x, str)]
            # the note lists a group's first names only: with one optimizer of one group,
            # every weight that got a gradient is its
            members = list(grads) if only else [x for x in listed if x in grads]
            total = 0
            moved: list[tuple[int, _Oversize]] = []
            for name in members:
                scale = scales.get(name)
                if not (isinstance(scale, tuple) and len(scale) == 3):
                    continue
                value, kind, numel = scale
                if not (value > 0 and numel > 0):
                    continue
                total += numel
                size = value if kind == "max" else value / math.sqrt(numel)
                move = lr * grads[name] / math.sqrt(numel) if plain else lr
                o = _Oversize(n.path, gi, lr, name, move, size, kind, plain, update.step)
                if math.isfinite(o.ratio) and o.ratio >= 1:
                    moved.append((numel, o))
            if not moved or 2 * sum(k for k, _ in moved) < total:
                continue
            _, o = max(moved, key=lambda m: (m[0], m[1].ratio))
            if best is None or o.ratio > best.ratio:
                best = o
    return best


def _spike_level(ctx: RuleContext) -> tuple[float, int] | None:
    """The largest |loss| of the history's steps and how many steps recorded one, when this
    step's loss is ``explode_factor`` times that or more and the last step of the history
    is the one before it (its update wrote the weights this loss was computed with)."""
    loss = ctx.trace.loss
    hist = ctx.history
    if loss is None or not math.isfinite(loss) or loss <= 0 or not hist:
        return None
    if hist[-1].step != ctx.step - 1:
        return None
    past = [abs(t.loss) for t in hist if t.loss is not None and math.isfinite(t.loss)]
    if not past:
        return None
    top = max(past)
    if top <= 0 or loss < ctx.thresholds.explode_factor * top:
        return None
    return top, len(past)


def _same_spike(ctx: RuleContext) -> bool:
    """The loss has stayed high since a step of the history that NW308 diagnosed (no loss
    since fell back below ``explode_factor`` times less than that step's): a loss that
    keeps multiplying as the weights diverge is one spike, said at its first step."""
    hist = list(ctx.history)
    last = next(
        (
            i
            for i in range(len(hist) - 1, -1, -1)
            if any(getattr(d, "code", "") == "NW308" for d in hist[i].diagnoses)
        ),
        None,
    )
    if last is None:
        return False
    first = hist[last].loss
    if first is None or not math.isfinite(first):
        return False
    floor = first / ctx.thresholds.explode_factor
    return all(t.loss is None or not (t.loss < floor) for t in hist[last:])


def _overshoot_words(
    raises: Sequence[_Raise], big: _Oversize | None
) -> tuple[str, str, str | None, str]:
    """What an oversized update did, for a sentence (``why``), the fix that lowers its lr,
    the weight it moved the most (None when the lr raise alone shows it) and, for an
    optimizer whose step is about lr whatever the gradient, why clipping does not bound it
    (empty otherwise)."""
    if raises:
        r = raises[0]
        why = (
            f"the lr of {r.optimizer}'s param group {r.group} was raised {_times(r.new / r.old)} "
            f"at once, to {fmt(r.new)}"
        )
        fix = (
            f'optimizer.param_groups[{r.group}]["lr"] = {hyper(r.old)}   # was {hyper(r.new)} '
            f"({r.optimizer}); raise it over many steps (a warm-up scheduler), not at once"
        )
        optimizer, param = r.optimizer, big.param if big is not None else None
    else:
        assert big is not None
        what = "largest |value|" if big.kind == "max" else "RMS value"
        why = (
            f"it moved {big.param} by {_times(big.ratio)} its {what} (lr {hyper(big.lr)} "
            f"with {big.optimizer}, param group {big.group})"
        )
        new = _round_down(big.lr * _SAFE_SHARE / big.ratio)
        fix = (
            f'optimizer.param_groups[{big.group}]["lr"] = {hyper(new)}   # was {hyper(big.lr)} '
            f"({big.optimizer}): its update was {_times(big.ratio)} the size of {big.param}"
        )
        optimizer, param = big.optimizer, big.param
    clip = (
        " Clipping the gradients does not bound this step: "
        f"{optimizer} moves each weight by about lr whatever the gradient."
        if _normalized(optimizer) or "lion" in optimizer.lower()
        else ""
    )
    return why, fix, param, clip


@rule(
    "NW308",
    title="Loss spike after an oversized update",
    severity="warning",
    summary=(
        "The loss jumped to many times (thresholds.explode_factor) the largest loss of the "
        "recorded steps right after an update that raised the lr as many times, or moved a "
        "weight by as much as its own size: the step overshot. Lower the lr of that group."
    ),
    early=True,
    priority=25,
)
def loss_spike(ctx: RuleContext) -> Iterator[Diagnosis]:
    yield from _loss_spike(ctx)


def _loss_spike(ctx: RuleContext) -> Iterator[Diagnosis]:
    """A loss spike is the update's when the loss is a multiple of its past and the update
    that came just before it was oversized: its lr raised many times at once, or its step
    as large as a weight. A loss spike alone is no warning: a loss near 0 multiplies by 100
    on one hard batch, and a warm-up raises it for a few steps; neither came from an update
    as large as the weights."""
    level = _spike_level(ctx)
    if level is None:
        return
    top, seen = level
    update = ctx.history[-1]
    if _same_spike(ctx):
        return
    raises = _lr_raises(ctx, update)
    big = _oversized_update(ctx, update)
    if not raises and big is None:
        return
    loss = float(ctx.trace.loss or 0.0)
    before = (
        "the loss of the step before"
        if seen == 1
        else f"the largest loss of the previous {count(seen, 'step')}"
    )
    evidence = [f"loss {fmt(loss)} at step {ctx.step}: {_times(loss / top)} {before} ({fmt(top)})"]
    for r in raises[:2]:
        evidence.append(
            f"the update at step {r.step} ({r.optimizer}, param group {r.group}) used lr "
            f"{fmt(r.new)}, {_times(r.new / r.old)} the {fmt(r.old)} of its update before"
        )
    if big is not None:
        evidence.append(big.evidence())
    g = ctx.trace.grad_norm
    norms = [t.grad_norm for t in ctx.history if t.grad_norm is not None]
    finite = [x for x in norms if math.isfinite(x) and x > 0]
    factor = ctx.thresholds.explode_factor
    if g is not None and math.isfinite(g) and finite and g >= factor * max(finite):
        evidence.append(
            f"total gradient norm {fmt(g)} at step {ctx.step}: {_times(g / max(finite))} the "
            f"largest of the previous steps ({fmt(max(finite))}); the gradients followed"
        )
    why, fix, param, clip = _overshoot_words(raises, big)
    yield ctx.diagnosis(
        parameter=param,
        phase=Phase.FORWARD.value,
        evidence=evidence,
        explanation=(
            f"The loss jumped right after the update at step {update.step}: {why}. The "
            "update overshot, far past where the gradient it followed still described the "
            "loss, so the weights now compute with values training never had. Left alone, "
            "such a step ends in NaN/inf or in units that no longer learn (NW304) a few "
            f"steps later.{clip}"
        ),
        fix=fix,
    )
