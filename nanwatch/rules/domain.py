"""Math outside its domain: log of zero or of a negative number (NW110), division by zero
and 0/0 (NW111), sqrt and fractional powers at zero or below, forward and backward-only
(NW112), a mean or variance over too few elements (NW113), and every other function with
a restricted real domain -- acos, atanh, erfinv, logit, lgamma, ... (NW114, from the table
in :mod:`nanwatch._domains`). Each names the aten op and the user's line when the op
checker saw it, and otherwise the module and what to run to name the op.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

from nanwatch._domains import Domain, domain_of
from nanwatch.records import (
    DIFFERENCE_OF,
    LOSS_PATH,
    Anomaly,
    AnomalyKind,
    Note,
    OpEvent,
    Phase,
    Record,
    TensorStat,
)
from nanwatch.rules._evidence import (
    DomainHit,
    InfSource,
    LoggedTarget,
    LossUse,
    Shortfall,
    _calls_of,
    activation_of,
    anomaly_fields,
    call_argument,
    cause_of,
    code_line,
    count,
    denominator,
    describe_stat,
    exact,
    first_input,
    first_root_outputs,
    flow_disagrees,
    fmt,
    fresh_name,
    full_statement,
    group_holding,
    has_zero,
    identifiers,
    inf_arithmetic,
    inf_inputs,
    inf_source,
    infinities,
    input_named,
    integer_denominator,
    last_gradient,
    limits,
    log_into_target,
    loss_kind,
    loss_uses,
    lost_eps,
    low_precision,
    model_call,
    module_loss_target,
    module_ref,
    node_base,
    node_domain,
    nonfinite_scalars,
    note_num,
    op_fields,
    operand_flow,
    operands,
    other_input,
    outside_domain,
    packet,
    param_named,
    paren,
    postfix_start,
    replace_neg_inf,
    rewrite_call,
    rewrite_divisor,
    scalar_base,
    scalar_num,
    short_op,
    shortfall,
    smallest_magnitude,
    statements,
    target_log,
    under_views,
    untraced_hint,
    watched_params,
)
from nanwatch.rules.base import Diagnosis, RuleContext, rule
from nanwatch.rules.generic import parametrization
from nanwatch.rules.masking import _DOMAIN_SAFE, _domain_arg, _double_where, forward_nan_hidden
from nanwatch.stats import dtype_limits

#: name prefix of what a backward node saved in forward, at the end of an op event's
#: ``other_inputs`` (``saved self``: acos's input; ``saved result``: sqrt's output; see
#: ``nanwatch.ops.SAVED``)
_SAVED = "saved "


#: a rule whose fixes keep the rest of the user's line (:func:`on_its_line`)


def _chain_evidence(ev: OpEvent, trigger: OpEvent, what: str) -> list[str]:
    out: list[str] = []
    line = code_line(ev)
    if line:
        out.append(line)
    if trigger is not ev:
        tline = f" {code_line(trigger)}" if code_line(trigger) else ""
        why = " (0 × inf, inf - inf and inf / inf are NaN)" if "NaN" in trigger.born else ""
        out.append(f"then {short_op(trigger.op)} turned the {what} into {trigger.born}{tline}{why}")
    return out


# ---------------------------------------------------------------------- NW110


@rule(
    "NW110",
    title="Log of zero or of a negative number",
    severity="error",
    summary=(
        "log/log1p/xlogy of 0 gave -inf (or of a negative number NaN); often log of a "
        "probability that underflowed to 0, and a NaN one op later (0 × -inf)."
    ),
    priority=12,
)
def log_of_zero(ctx: RuleContext) -> Iterator[Diagnosis]:
    a = ctx.anomaly
    if a is None or a.transient:
        return
    cause = cause_of(a)
    if cause is None and a.kind is AnomalyKind.BACKWARD:
        kl = _kl_target_untraced(ctx, a)
        if kl is not None:  # KLDivLoss's target gradient, op not traced: xlogy(t, t) at 0
            yield kl
            return
    if cause is None and a.kind is AnomalyKind.FORWARD and a.path == LOSS_PATH:
        logged = _logged_target(ctx)
        if logged is not None:  # F.l1_loss(S.log(), T.log()): log(0) of the target, untraced
            yield _log_of_target(ctx, a, logged)
            return
    # the op pinned is the one that put the -inf in (a mask's masked_fill, found by the
    # loss graph's walk), not the one that made NaN of it, which is untraced
    made_inf = cause is not None and cause.kind == "injected" and "NaN" not in cause.event.born
    if cause is not None and not made_inf:
        if cause.kind == "log":
            if log_into_target(ctx.trace, a) is cause.event:
                return  # a loss read the log's -inf in its target: NW401 says so, as in watch
            logged = _logged_target(ctx) if a.path == LOSS_PATH else None
            if logged is not None and not logged.both and _ratio_of(logged.base) is not None:
                yield _log_of_target(ctx, a, logged)  # the loss line's log(gw / aw), as in watch
                return
            yield _log_from_op(ctx, a, cause.event, cause.trigger)
            return
        if cause.kind not in ("neginf-input", "inf-arith"):
            return
    src = a.neginf_source
    if src is None or a.kind is not AnomalyKind.FORWARD:
        return
    if module_loss_target(ctx.trace, a) is not None:
        return  # a loss module's target held the -inf the user's code made: NW401 says where
    origin = inf_source(ctx.trace, a, cause.event if cause is not None else None)
    nan_op = cause.event if cause is not None and not made_inf else None
    masked = _masked_logprob(ctx, a, src, origin, nan_op)
    if masked is not None:  # log_prob of an action its mask gave probability 0
        yield masked
        return
    if _looks_like_mask(src):
        return
    if origin.kind == "mask":
        return  # a constant -inf was put in (a mask): NW402 or NW100 say so, not a log
    if cause is not None and cause.kind == "inf-arith" and origin.kind != "log":
        return  # NaN from two infinities of unknown origin: NW100 names both suspects
    if _passed_on_constant(src, origin):  # a module's own -inf (forbidden transitions): no log
        if cause is None:  # NW100 names the op in forensic mode
            yield _constant_neginf(ctx, a, src, origin)
        return
    if (
        origin.kind != "log"
        and not _log_in_sight(ctx, cause.event if cause else None)
        and _may_be_overflow(ctx, src)
    ):
        return  # no log op, node or line, and an overflow fits as well: no guess of a log
    grew = f"it grew into {a.record.stat.kinds() if a.record.stat else 'NaN'} in {a.record.where}"
    if cause is not None:  # the op that was given it is known (a Linear's addmm)
        ev = cause.event
        grew += f": {short_op(ev.op)} was given the -inf and made {ev.born}"
        expr = inf_arithmetic(ev)
        if expr is not None:
            grew += f" ({expr})"
        line = code_line(ev)
        if line:
            grew += f" ({line})"
    first = f"a -inf first appeared in {src.where} ({src.dtype}): {describe_stat(src.stat)}"
    if origin.kind == "log" and origin.node:
        first += f"; autograd node {origin.node} made it: a log of 0"
        why = f"{origin.node} made the -inf: log(0) = -inf"
    else:
        why = (
            "The op that made the -inf was not traced; when it is a log, the fix below "
            "applies (when it is a mask, mask with torch.finfo(dtype).min instead of -inf, "
            "as in NW402)"
        )
    yield ctx.diagnosis(
        **anomaly_fields(a),
        evidence=[
            first,
            grew,
            *([] if cause is not None else [untraced_hint(ctx)]),
        ],
        explanation=(
            "-inf is what log(0) returns; an arithmetic op on it (0 × -inf, -inf + inf) "
            f"returns NaN. {why}."
        ),
        fix=_LOG_FIX,
        priority=25,
    )


#: autograd nodes of a log (the evidence module's set): a -inf they made is a log of 0
_LOG_NODE_NAMES = frozenset(
    {"Log", "Log2", "Log10", "Log1P", "LogSoftmax", "Xlogy", "SpecialXlog1Py", "LogSigmoid"}
)
_LOG_CALL = re.compile(
    r"\blog(?:_softmax|sigmoid|1p|2|10|_prob|_sum_exp|it)?\s*\(|\bxlogy\s*\(|\.log\b"
)


def _log_in_sight(ctx: RuleContext, event: OpEvent | None) -> bool:
    """Something of the step shows a log: a record made by a log node (a loss input's
    ``LogSoftmaxBackward0``, in a note too), or a log call on the user's line of the op that
    was given the -inf. A -inf with none of these (a float16 Linear that overflowed under
    no_grad) is not called a log of 0."""
    nodes = [r.grad_fn for r in ctx.trace.records if r.stat is not None and r.stat.has_neginf]
    nodes += [
        str(n.data.get(k))
        for n in ctx.trace.notes
        if n.kind == "loss_input" and n.data.get("input_min") == -math.inf
        for k in ("input_grad_fn", "input_activation")
    ]
    nodes += [
        str(op) for n in ctx.trace.notes if n.kind == "loss_graph" for op in n.data.get("ops", ())
    ]
    if any(node_base(n) in _LOG_NODE_NAMES for n in nodes if n):
        return True
    line = full_statement(event.source) if event is not None else None
    return bool(line and _LOG_CALL.search(line))


def _may_be_overflow(ctx: RuleContext, src: Record) -> bool:
    """The -inf first seen in ``src`` may as well be an overflow: no finite value beside it
    to judge by, finite values near its dtype's max, or a float16/bfloat16 value that held
    a -inf before it (a half-precision Linear whose weights blew up, cast to float32)."""
    s, lim = src.stat, limits(src.dtype)
    if s is None or lim is None or s.finite_amax is None:
        return True
    if s.near_max or s.finite_amax > lim.max / 64:
        return True
    return any(
        r.index <= src.index
        and r.dtype in ("float16", "bfloat16")
        and r.stat is not None
        and r.stat.has_neginf
        for r in ctx.trace.records
    )


#: autograd nodes that pass a -inf operand on (-inf + x = -inf) and make none of their own
#: short of an overflow
_PASS_ON_NODES = frozenset({"Add", "Sub", "Cat", "Stack", "Index", "Clone", "Expand", "View"})


def _passed_on_constant(src: Record, origin: InfSource) -> bool:
    """The record where the -inf was first seen was made by an op that only passes one on
    (``self.w + self.c`` with a buffer ``c`` of forbidden transitions at -inf), its values
    nowhere near the dtype's limit (no overflow): the -inf was a constant the module held,
    made by no log."""
    s = src.stat
    if origin.kind not in ("unknown", "state") or s is None or not s.has_neginf:
        return False
    if node_base(origin.node) not in _PASS_ON_NODES:
        return False
    lim = limits(src.dtype)
    big = s.finite_amax if s.finite_amax is not None else None
    return lim is not None and big is not None and big < lim.max / 1e6 and not s.near_max


def _constant_neginf(ctx: RuleContext, a: Anomaly, src: Record, origin: InfSource) -> Diagnosis:
    """NaN from a -inf the module held as a constant (a constraint or mask: a CRF's
    forbidden transitions in a buffer, added to its weights), the op untraced: no log made
    it, so NW100's story (0 × -inf) with the fix of a multiply-by-mask, not a log fix."""
    s = src.stat
    assert s is not None
    node = origin.node or "an add"
    return ctx.diagnosis(
        **anomaly_fields(a),
        code="NW100",
        title="NaN from arithmetic on infinities: a constant -inf times 0",
        evidence=[
            f"a -inf first appeared in {src.where} ({src.dtype}): {describe_stat(s)}",
            f"autograd node {node} made it: it passes a -inf operand on and makes none "
            f"(its finite values, at most {fmt(s.finite_amax or 0)}, are nowhere near the "
            f"{src.dtype} limit: no overflow), so the module combined its own -inf constant "
            "(a buffer or parameter of forbidden entries), made by no log",
            f"it grew into {a.record.stat.kinds() if a.record.stat else 'NaN'} in {a.record.where}",
            untraced_hint(ctx),
        ],
        explanation=(
            "A constraint or mask held as -inf (a CRF's forbidden transitions, a bias that "
            "forbids positions) is safe while it is only added, maxed and logsumexp-ed, but "
            "a multiply by 0, such as a padding mask applied as x * mask, computes 0 × -inf "
            "= NaN (and -inf + inf is NaN too). Select with torch.where instead of "
            "multiplying by the mask, or hold the constraint as the dtype's most negative "
            "finite number, which 0 × keeps at 0."
        ),
        fix=(
            "y = torch.where(mask, x, 0.0)   # not x * mask: 0 × -inf is NaN (x: what the "
            "mask multiplied)\n"
            "c[forbidden] = torch.finfo(c.dtype).min   # or the constraint (c: the module's "
            '-inf buffer) as a finite value, not float("-inf")\n'
            '# mode="forensic" names the op and line'
        ),
        priority=25,
    )


def _masked_logprob(
    ctx: RuleContext, a: Anomaly, src: Record, origin: InfSource, ev: OpEvent | None
) -> Diagnosis | None:
    """NaN born in loss code from scores a mask set to -inf (masked_fill(~legal, -inf) on a
    policy's logits): the -inf is the log-probability of an entry the mask gave probability
    0, taken by log_prob / a gather of an action the mask forbids. Evidence: the autograd
    node or a traced op put the -inf in (a mask), or, untraced, the record holds -inf and
    otherwise only finite values; not an attention module (NW402 speaks for those)."""
    s = src.stat
    if a.path != LOSS_PATH or s is None or not s.has_neginf or s.has_nan or s.has_posinf:
        return None
    if isinstance(s.neginf, int) and s.neginf >= s.numel:
        return None
    text = f"{src.path} {src.module_type}".lower()
    if "attn" in text or "attention" in text:
        return None
    if not (origin.kind == "mask" or (origin.kind == "unknown" and origin.node is None)):
        return None  # a node that is not a mask made it (an overflow, a log): not this
    mask = next((e for e in origin.events if e.injected), None)
    if origin.kind == "unknown":
        how = "no autograd node says what made it (made under no_grad, or untraced)"
    elif origin.node:
        how = f"{origin.node} put it in: a mask"
    else:
        how = "a mask put it in"
    n_inf = f"{s.neginf:,} of {s.numel:,} values" if isinstance(s.neginf, int) else "some values"
    evidence = [
        f"{src.where} ({src.dtype}) holds -inf at {n_inf} and only finite values elsewhere "
        f"(no NaN, no +inf): masked scores; {how}",
    ]
    if mask is not None and code_line(mask):
        evidence.append(f"the -inf came from {short_op(mask.op)} {code_line(mask)}")
    dtype = src.dtype or "float32"
    low = f"torch.finfo(torch.{dtype}).min"
    own = replace_neg_inf(mask.code, low) if mask is not None else None
    if ev is not None and inf_arithmetic(ev) == "0 × -inf":
        return _masked_p_log_p(ctx, a, ev, evidence, own=own, low=low)
    grew = f"the NaN was born in loss code ({a.record.where})"
    if ev is not None:
        grew += f": {short_op(ev.op)} was given the -inf and made {ev.born}"
        line = code_line(ev)
        if line:
            grew += f" ({line})"
    evidence.append(
        grew + ": a log-probability of -inf was used, so log_prob was taken of an entry the "
        "mask gave probability 0"
    )
    if ev is None:
        evidence.append(untraced_hint(ctx))
    legal = "legal"
    if mask is not None and mask.code:
        m = re.search(r"masked_fill_?\(\s*~\s*([A-Za-z_][\w.]*)\s*,", mask.code)
        if m is not None:
            legal = m.group(1)
    fix = (
        f"# check the data before log_prob: {legal}.gather(-1, actions.unsqueeze(-1)).all() "
        f"must hold (actions: what log_prob was given; {legal}: True where allowed, the "
        "rollout's mask); fix the sampler (epsilon-greedy, replay) or the mask where it fails\n"
        + (f"{own}   # finite: no -inf log-prob\n" if own else "")
        + f"# {'or ' if own else ''}mask with {low} instead of -inf: an illegal action then "
        "gets a very negative, finite log-prob"
    )
    return ctx.diagnosis(
        **anomaly_fields(a),
        title="Log-probability of a masked action",
        evidence=evidence,
        explanation=(
            "Masking logits with -inf gives those entries probability 0 and log-probability "
            "-inf; log_prob (Categorical(logits=...).log_prob(a), a gather of log_softmax) of "
            "such an entry is -inf, and the loss's arithmetic turns it into ±inf and NaN "
            "(-inf × advantage, then a mean of +inf and -inf). The data has actions the mask "
            "forbids: the behaviour policy sampled illegal actions (epsilon-greedy, a random "
            "or scripted policy), or the mask at update time differs from the one at rollout. "
            "This is not a probability that underflowed."
        ),
        fix=fix,
        priority=20,
    )


def _masked_p_log_p(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, evidence: list[str], *, own: str | None, low: str
) -> Diagnosis:
    """NaN a multiply made of a masked entry's log-probability (-inf) and a factor that is
    0 there (its probability, exp(-inf) = 0: p * log p in an entropy or a KL written by
    hand): no action the mask forbids was taken, so the data is not at fault (as it is
    for a log_prob of a masked action). ``evidence``: the mask's lines so far; ``own``:
    the mask's line with a finite fill, when known; ``low``: the dtype's finfo.min."""
    zero = next((s for _, s in ev.inputs if s is not None and not s.has_neginf), None)
    inf = next((s for _, s in ev.inputs if s is not None and s.has_neginf), None)
    pair = ""
    if zero is not None and inf is not None and isinstance(inf.neginf, int):
        z = zero.zeros if isinstance(zero.zeros, int) else None
        pair = f": its other factor holds {z:,} exact zero{'s' if z != 1 else ''}" if z else ""
        pair += f" beside the {inf.neginf:,} -inf"
    line = code_line(ev)
    evidence.append(
        f"{short_op(ev.op)} computed 0 × -inf = NaN in loss code ({a.record.where})"
        + (f" {line}" if line else "")
        + pair
        + ": the masked entries' probability (exp(-inf) = 0) times their log-probability"
    )
    if line is None:
        evidence.append(untraced_hint(ctx))
    rewrite = _clamped_factor(ev, low)
    fix = (
        (
            f"{rewrite}   # 0 × finfo.min = 0: a masked entry adds 0, with a finite gradient\n"
            if rewrite
            else f"p_log_p = probs * log_probs.clamp_min({low})   # 0 × finfo.min = 0: a "
            "masked entry adds 0, with a finite gradient\n"
        )
        + "# or entropy = Categorical(logits=logits).entropy(), which clamps the same way\n"
        + "# not torch.where(legal, probs * log_probs, 0.0): its backward still computes "
        "0 × -inf\n"
        + (
            f"{own}   # or mask with a finite value"
            if own
            else f"# or mask with {low} instead of -inf"
        )
    )
    return ctx.diagnosis(
        **anomaly_fields(a),
        title="Probability times log-probability of a masked entry: 0 × -inf",
        evidence=evidence,
        explanation=(
            "Masking logits with -inf gives the masked entries probability exp(-inf) = 0 and "
            "log-probability -inf. A term that multiplies the two -- p * log p in an entropy "
            "or a KL written by hand, a loss weighted by the policy's own probabilities -- "
            "computes 0 × -inf = NaN at every masked entry, although no masked action was "
            "taken: the data is fine. torch's Categorical.entropy() clamps the "
            "log-probabilities at the dtype's most negative finite value before multiplying "
            "for this reason."
        ),
        fix=fix,
        priority=20,
    )


def _clamped_factor(ev: OpEvent, low: str) -> str | None:
    """The user's statement of a multiply that computed 0 × -inf with its -inf factor
    clamped at ``low`` (``probs * logp`` -> ``probs * logp.clamp_min(low)``), when the
    statement holds one ``*`` and the factor is a plain name or attribute; None otherwise."""
    code = full_statement(ev.source) if ev.source else None
    if not code:
        return None
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    muls = [n for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult)]
    if len(muls) != 1:
        return None
    which = next((k for k, s in ev.inputs if s is not None and s.has_neginf), None)
    if which not in ("self", "other"):
        return None
    node = muls[0].left if which == "self" else muls[0].right
    if not isinstance(node, (ast.Name, ast.Attribute)):
        return None
    text = ast.unparse(node)
    setattr(
        muls[0],
        "left" if which == "self" else "right",
        ast.parse(f"{text}.clamp_min({low})", mode="eval").body,
    )
    return ast.unparse(tree)


def _logged_target(ctx: RuleContext) -> LoggedTarget | None:
    """The first functional loss call of the step with a finite prediction and a
    non-finite target, when a log on the loss line made that target -inf (NW401 speaks
    for the other bad targets)."""
    for n in ctx.notes("loss_input"):
        lo, hi = note_num(n, "target_min"), note_num(n, "target_max")
        if lo is None or hi is None or (math.isfinite(lo) and math.isfinite(hi)):
            continue
        ins = [note_num(n, "input_min"), note_num(n, "input_max")]
        if all(v is not None and math.isfinite(v) for v in ins):
            return target_log(n)
    return None


def _log_of_target(ctx: RuleContext, a: Anomaly, t: LoggedTarget) -> Diagnosis:
    d = t.note.data
    src = t.note.source
    at = f" at {src}" if src else ""
    hi = note_num(t.note, "target_max")
    lo_in, hi_in = note_num(t.note, "input_min"), note_num(t.note, "input_max")
    evidence = [
        f"the target of {t.loss}{at} (shape {d.get('target_shape', '?')}) holds -inf and no "
        f"NaN: min -inf, max {fmt(hi)}, what log(0) returns",
        (
            f"{t.how}: {t.target} is -inf wherever {t.base} is exactly 0"
            if t.line is not None
            else f"{t.how}: a log made it, and log(0) = -inf"
        ),
        f"its input (the prediction) was finite: [{fmt(lo_in)}, {fmt(hi_in)}]",
    ]
    bad = [
        n
        for n in ctx.notes("loss_input")
        if n is not t.note and target_log(n) is not None and n.source == t.note.source
    ]
    if bad:
        evidence.append(f"{len(bad)} more call(s) of that line this step got a -inf target")
    fields = anomaly_fields(a)
    fields.update(path=t.loss, op="aten.log", source=src)
    of = t.base if t.line is not None else "the target"
    fix = (
        f"{t.line}   # log(0) = -inf: a floor of {t.floor} under "
        + ("both logs" if t.both else "the log")
        + f"\n# or torch.log1p({of}): log(1 + x) is 0 at 0, and needs no floor"
        if t.line is not None
        else f"target = torch.log(x.clamp_min({t.floor}))   # x: what the target's log is "
        "taken of; log(0) = -inf\n# or torch.log1p(x): 0 at 0"
    )
    ratio = _ratio_of(t.base) if t.line is not None and not t.both else None
    if ratio is not None:  # log(gw / aw): a box encoding's degenerate entry, or silence
        top, bottom = ratio
        evidence.insert(
            2,
            f"the log is of a ratio, {top} / {bottom}: 0 wherever {top} is, such as a "
            "box-regression encoding's width or height of a degenerate box",
        )
        masked = _masked_loss_line(t)
        fix = (
            f"valid = {paren(top)} > 0   # a degenerate entry (a box of zero width or height, "
            "x1 == x2): keep it out of the loss; a floor or log1p gives it a target that the "
            "exp() decoding the prediction never inverts\n"
            + (
                f"{masked}   # the prediction and the target indexed with it\n"
                if masked is not None
                else "# index the prediction and the target with it: pred[valid], y[valid]\n"
            )
            + f"# or, where a 0 of {top} is a legitimate value (silence in a magnitude): "
            f"{t.line}"
        )
    return ctx.diagnosis(
        **fields,
        evidence=evidence,
        explanation=(
            f"The target data is finite: the -inf is made on the loss line, by the log of "
            f"{of}, and log(0) = -inf. "
            + (
                f"It is a ratio, 0 wherever {ratio[0]} is: in a box-regression encoding "
                f"(log of a ground-truth width over an anchor's) that is a degenerate box, "
                "of zero width or height, an entry to drop, not to floor: the floored target "
                "log(1e-5) is a box the model is then trained to predict. Where a 0 is a "
                "legitimate value (silence in a magnitude), a floor under the log is right. "
                if ratio is not None
                else "An exact 0 there (digital silence in a spectrogram's magnitude, an "
                "empty frequency bin, a zero count or intensity) makes the log target -inf "
                "and the loss inf. "
            )
            + (
                "The target does not require grad, so no op of the graph records the log: the "
                "line does."
                if a.op is None
                else f"The op trace shows it: aten.log made the -inf on that line, and "
                f"{short_op(a.op.op)} read it in its target."
            )
            + (
                ""
                if ratio is not None
                else " Put a floor under what the log is taken of (the prediction's log needs "
                "it as much), or use log1p."
            )
        ),
        fix=fix,
    )


def _masked_loss_line(t: LoggedTarget) -> str | None:
    """The loss statement with its prediction and its target indexed by ``valid``
    (``loss = F.smooth_l1_loss(net(x)[valid], torch.log(gt_wh / anchors_wh)[valid])``);
    None when the line or the call is not read."""
    import linecache

    call = t.note.data.get("call")
    path, _, num = (t.note.source or "").rpartition(":")
    if not isinstance(call, str) or not path or not num.isdigit():
        return None
    stmt = linecache.getline(path, int(num)).strip()
    try:
        node = ast.parse(call, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or len(node.args) < 2 or call not in stmt:
        return None
    pred, target = (paren(ast.unparse(x)) for x in node.args[:2])
    rest = [ast.unparse(x) for x in (*node.args[2:], *node.keywords)]
    args = ", ".join([f"{pred}[valid]", f"{target}[valid]", *rest])
    return stmt.replace(call, f"{ast.unparse(node.func)}({args})", 1)


def _ratio_of(text: str) -> tuple[str, str] | None:
    """(numerator, denominator) of ``text`` when it is one division (``gt_wh / anchors_wh``),
    as written; None otherwise."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args:
        node = node.func.value  # (a / b).float()
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return ast.unparse(node.left), ast.unparse(node.right)
    return None


def _looks_like_mask(rec: Record) -> bool:
    text = f"{rec.path} {rec.module_type}".lower()
    return any(k in text for k in ("attn", "attention", "mask"))


_LOG_FIX = (
    "logp = F.log_softmax(logits, dim=-1)   # not torch.log(torch.softmax(logits, -1))\n"
    "logp = F.logsigmoid(logits)            # not torch.log(torch.sigmoid(logits))\n"
    "loss = F.binary_cross_entropy_with_logits(logits, y)  # not a hand-written BCE\n"
    "logp = torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))  # when only p exists\n"
    "var = F.softplus(raw) + 1e-6            # a predicted variance or scale: never 0"
)


def _log_from_op(ctx: RuleContext, a: Anomaly, ev: OpEvent, trigger: OpEvent) -> Diagnosis:
    if ev.phase is Phase.BACKWARD and node_base(ev.node) == "Xlogy":
        return _xlogy_backward(ctx, a, ev, trigger)
    if ev.phase is Phase.BACKWARD and node_base(ev.node) == "SpecialEntr":
        return _entr_backward(ctx, a, ev, trigger)
    dom = domain_of(ev.op)
    x = (input_named(ev, dom.arg) if dom is not None else None) or first_input(ev)
    if ev.phase is Phase.BACKWARD and node_base(ev.node) == "Log" and "div" in ev.op:
        x = input_named(ev, "other") or x  # grad / self: the divisor is the log's input
    op = short_op(ev.op)
    if ev.phase is Phase.BACKWARD and node_base(ev.node) == "Log":
        op = "aten.log"  # its backward's div: the words are the log's
    name = "log1p" if dom is not None and dom.lo == -1.0 else packet(ev.op)
    if ev.phase is Phase.FORWARD and ev.dtype.startswith("complex") and has_zero(x):
        return _complex_log(ctx, a, ev, trigger, x)
    backward_log = ev.phase is Phase.BACKWARD and node_base(ev.node) == "Log"
    if backward_log and x is not None and _subnormal(x, ev.dtype):
        return _log_grad_overflow(ctx, a, ev, trigger, x)
    evidence: list[str] = []
    at = "-1" if name == "log1p" else "0"
    # a NaN made by the log's backward on a line that discards the log's -inf in forward
    # (torch.where(z > 0, torch.log(z), 0)): the double where is the fix
    discarded = _discarded_log(ev) if backward_log and "NaN" in ev.born else None
    if x is None and backward_log:
        # named by its node alone (what it saved was freed before the read): say what its
        # gradient makes, not which input it had
        lim = dtype_limits(ev.dtype or "float32") or dtype_limits("float32")
        assert lim is not None
        evidence.append(
            f"in backward (autograd node {ev.node}), the log's gradient grad / x made "
            f"{ev.born or 'a non-finite value'}; its input x was freed before it could be "
            f"read: 1/x is inf where x is 0, or below {ev.dtype or 'float32'}'s smallest "
            f"normal number {fmt(lim.tiny)} (a probability that underflowed), and NaN "
            "where x is below 0"
        )
    elif "-inf" in ev.born and (ev.phase is Phase.FORWARD or has_zero(x) or x is None):
        evidence.append(f"{op} of {at} is -inf: its input holds {_zeros_text(x, name)}")
    if x is None and backward_log:
        pass  # said above: its input is not known
    elif "NaN" in ev.born and backward_log and x is not None and x.min >= 0 and has_zero(x):
        # nothing below 0: the NaN is log's backward, grad / x, at 0 / 0
        evidence.append(
            f"in backward, {op}'s gradient grad / x is 0 / 0 = NaN: its input holds "
            f"{_zeros_text(x, name)} (none below 0), and the gradient arriving there is 0 "
            + (
                f"({discarded.by} on that line discarded the forward's -inf there, and its "
                "backward gives the discarded entries a 0 gradient)"
                if discarded is not None
                else "(the forward's -inf was discarded later, as exp(-inf) = 0 does)"
            )
        )
    elif (
        "NaN" in ev.born and ev.phase is Phase.BACKWARD and x is not None and x.min == -1.0
    ) and name == "log1p":
        # at -1, not below: log1p's backward, grad / (1 + x), at 0 / 0
        evidence.append(
            f"in backward, {op}'s gradient grad / (1 + x) is 0 / 0 = NaN: its input's "
            "minimum is -1 (none below), and the gradient arriving there is 0 (the "
            "forward's -inf was discarded, by a torch.where or a mask)"
        )
    elif "NaN" in ev.born:
        evidence.append(
            f"{op} of a number below {at} is NaN: its input's minimum is "
            f"{fmt(x.min if x is not None else None)}"
        )
    evidence.append(f"input ({ev.dtype}): {describe_stat(x)}")
    evidence += _chain_evidence(ev, trigger, "-inf")
    if ev.phase is Phase.BACKWARD:
        evidence.append(
            f"in backward (autograd node {ev.node}): d/dx log1p(x) = 1/(1 + x) is inf at -1"
            if name == "log1p"
            else f"in backward (autograd node {ev.node}): d/dx log(x) = 1/x is inf at 0"
        )
    lost = (
        lost_eps(ev.code, ev.dtype, "log", zeros=has_zero(x))
        if ev.phase is Phase.FORWARD and "-inf" in ev.born and name != "log1p"
        else None
    )
    if lost is not None:  # the line has an eps, and in this dtype it is 0
        evidence.insert(1, lost.words(f"the input of {op}"))
        exact = _log_of_activation(ev.code, lost.text)
        return ctx.diagnosis(
            **op_fields(ev, a),
            evidence=evidence,
            explanation=(
                f"{op} is -inf at 0. The eps added on this line is meant to keep its input "
                f"off 0, but {ev.dtype} cannot hold it: a number below half of "
                f"{ev.dtype}'s smallest subnormal is stored as 0, so 0 + eps is still 0. "
                + (
                    f"Here the log is taken of a {exact[0]}: {exact[1]} computes it from the "
                    "logits, exactly and with no eps, never forming the probability that "
                    "underflowed to 0."
                    if exact is not None
                    else "Use an eps the dtype can hold, or compute this line in a wider dtype."
                )
            ),
            fix=(
                lost.fix()
                if exact is None
                else f"{exact[2]}   # log({exact[0]}(z)) without forming the 0: no eps needed\n"
                f"# or keep the {exact[0]} with an eps that {ev.dtype} holds: {lost.fix()}"
            ),
        )
    poisson = _poisson_use(ctx, a, ev, x) if ev.phase is Phase.FORWARD else None
    if poisson is not None:
        return _log_in_poisson(ctx, a, ev, x, use=poisson, evidence=evidence)
    if name == "log1p" and ev.phase is Phase.FORWARD:
        return _log1p_below(ctx, a, ev, x, evidence=evidence)
    use = _log_of_param(ctx, a, ev, x) if ev.phase is Phase.FORWARD else None
    if use is None and ev.phase is Phase.FORWARD:  # a factor that is a parameter at 0
        from nanwatch.rules._zero_param import zero_param_story

        zp = zero_param_story(ctx, ev, x)
        if zp is not None:
            use = _LogUse("zero-param", zp.fix, zp.why, zp.evidence, zp.title)
    if use is None and ev.phase is Phase.FORWARD:
        use = _xlogy_model_operand_use(ctx, ev, x)
    if use is None and ev.phase is Phase.FORWARD:
        use = _dist_value_use(ctx, ev, x)
    if use is None and ev.phase is Phase.FORWARD and x is not None and x.min <= 0:
        use = _det_use(ctx, ev)
    forward_line = ev.phase is Phase.FORWARD or (ev.code and ev.source != ev.backward_at)
    if use is None and discarded is not None:
        use = _discarded_use(discarded)
    if use is None and forward_line:  # in backward: the line that made the log's node
        use = _log_use(ctx, a, ev)
    if use is None and ev.phase is Phase.FORWARD and x is not None:
        use = _relu_zero_use(ctx, ev, x)
    if use is None and ev.phase is Phase.FORWARD and x is not None:
        use = _softplus_zero_use(ctx, ev, x)
    if use is None and ev.phase is Phase.FORWARD and x is not None:
        use = _exp_chain_use(ctx, ev, x)
    if use is None and ev.phase is Phase.FORWARD and x is not None:
        use = _divided_too_use(ev, x)
    if use is None and ev.phase is Phase.FORWARD and x is not None:
        use = _product_underflow_use(ctx, ev, x)
    logged = (
        _log_argument(ev)
        if use is None and ev.phase is Phase.FORWARD and has_zero(x) and x is not None
        else None
    )
    lk = _table_lookup(ev, logged[3]) if logged is not None and x is not None else None
    if lk is not None and x is not None and x.min >= 0:  # log(alpha_bar[t]) at a 0 entry
        return _table_zero(
            ctx,
            a,
            ev,
            x,
            lk,
            evidence=evidence,
            title=ctx.rule.title if ctx.rule is not None else "Log of zero",
            operand="the input of the log",
            effect="log(0) is -inf",
        )
    if use is None and ev.phase is Phase.FORWARD and x is not None:
        use = _unknown_log_use(ctx, ev, x)
    if use is None and x is None:  # named by its node alone: the graph says what it took
        use = _unread_log_use(ctx, ev)
    if use is not None and use.evidence:
        evidence.insert(len(evidence) - len(_chain_evidence(ev, trigger, "-inf")), use.evidence)
    return ctx.diagnosis(
        **op_fields(ev, a),
        evidence=evidence,
        explanation=(
            f"{op} is -inf at {at} and NaN below it. "
            + (
                use.why
                if use is not None and use.why
                else "Probabilities that underflow to exactly 0 (softmax or sigmoid of a large "
                "negative logit, especially in float16) make log(p) = -inf, and the next "
                "multiplication by a zero weight or label gives 0 × -inf = NaN. Computing the "
                "log from the logits (log_softmax, logsigmoid, the *_with_logits losses) "
                "never forms the 0."
            )
        ),
        fix=use.fix if use is not None else _LOG_FIX,
        **({"title": use.title} if use is not None and use.title else {}),
    )


#: autograd nodes (base names) of a product along a dimension
_PRODUCTS = {"Cumprod": "cumprod", "Prod": "prod"}


def _product_underflow_use(ctx: RuleContext, ev: OpEvent, x: TensorStat) -> _LogUse | None:
    """The log's argument, in [0, 1] with exact zeros, is read from a watched output made
    by a product along a dimension (``torch.cumprod(1 - h, -1)``: a survival curve,
    ``p.prod(-1)``: a sequence likelihood) that holds the same exact zeros: a product of many
    factors below 1 underflows to 0 past the dtype's smallest subnormal. The log of the
    product is the sum of the logs, which never forms the 0."""
    if not (has_zero(x) and x.min == 0 and x.max <= 1):
        return None
    for r in ctx.records(Phase.FORWARD):
        kind = _PRODUCTS.get(node_base(r.grad_fn or ""))
        st = r.stat
        if kind is None or not r.role.startswith("output") or st is None:
            continue
        if not (st.min == 0 and st.max <= 1 and st.numel >= x.numel and has_zero(st)):
            continue
        lim = limits(r.dtype)
        if lim is None:
            continue
        zeros = f"{st.zeros:,} exact zeros" if st.zeros else "exact zeros"
        made = (
            f"{r.path}'s output is a {kind} ({r.grad_fn}) of factors in [0, 1] and holds "
            f"{zeros} (max {fmt(st.max)})"
        )
        sums = "torch.cumsum" if kind == "cumprod" else "torch.sum"
        halves = math.ceil(-math.log2(lim.subnormal)) + 2  # 0.5 ** halves is below it: 0
        if kind == "cumprod":
            ways = (
                "log_s = torch.cumsum(F.logsigmoid(-z), dim=-1)   # for torch.cumprod(1 - "
                "torch.sigmoid(z), dim=-1): logsigmoid(-z) is log(1 - sigmoid(z))\n"
                "log_s = torch.cumsum(torch.log1p(-h), dim=-1)    # for torch.cumprod(1 - h, "
                "dim=-1) of a probability h\n"
            )
        else:
            ways = (
                "log_s = torch.log(p).sum(-1)   # for p.prod(-1) of probabilities p\n"
                "log_s = F.log_softmax(logits, -1).gather(-1, idx).sum((-2, -1))   # for picks "
                "of a softmax, p = softmax(logits).gather(-1, idx): the logs from the logits\n"
            )
        return _LogUse(
            "product",
            fix=(
                f"# in {r.path}'s forward: take the log before the {kind}, and sum: "
                f"log({kind}(p)) = {sums}(log(p))\n{ways}"
                "# then use log_s where the code takes torch.log of the product; not a floor: "
                f"{_log_tiny(ev.dtype, ev.op)} is a wrong value with no gradient"
            ),
            why=(
                f"Its input holds {_zeros_text(x, 'log')}, and {made}. A product of many "
                f"factors below 1 shrinks geometrically: past {fmt(lim.subnormal)}, the "
                f"smallest {r.dtype} value, it is exactly 0 (0.5 ** {halves} already is in "
                f"{r.dtype}), so its log is -inf even though every factor is positive. The log "
                "of a product is the sum of the logs of its factors: computed that way it "
                "stays finite (a sum of many negative numbers) and keeps its gradient."
            ),
            evidence=f"{made}: a product that underflowed, below {fmt(lim.subnormal)} in {r.dtype}",
            title="Log of a product that underflowed to 0",
        )
    return None


def _unread_log_use(ctx: RuleContext, ev: OpEvent) -> _LogUse | None:
    """A log whose input was not read (its node named by its name alone, what it saved
    freed), taken of a softmax or a sigmoid, or of 1 - a sigmoid, as the loss graph shows
    below it (:attr:`OpEvent.made_from`): the fix from the logits; None otherwise."""
    made = _chain_producer(ev.made_from)
    zeros = "values that underflowed to 0 or to a subnormal number (its input was not read)"
    known = not _line_unknown(ev)
    if made in ("softmax", "sigmoid"):
        return _probability_made_use(
            made,
            "the log's argument",
            zeros,
            None,
            ev.dtype,
            op=ev.op,
            known=known,
            picked=_picks(ev.made_from),
            masked=_mask_below(ev.made_from),
        )
    if made == "one-minus-sigmoid":
        return _one_minus_sigmoid_use(ctx, "the log's argument", zeros, ev, known=known)
    return None


def _subnormal(x: TensorStat | None, dtype: str) -> bool:
    """``x`` holds no 0 but values below ``dtype``'s smallest normal number (subnormals)."""
    lim = dtype_limits(dtype) if dtype.startswith(("float", "bfloat")) else None
    if x is None or lim is None or has_zero(x):
        return False
    low = min(abs(x.min), abs(x.max)) if x.min > 0 or x.max < 0 else 0.0
    return 0.0 < low < lim.tiny


def _log_grad_overflow(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, trigger: OpEvent, x: TensorStat
) -> Diagnosis:
    """The backward of a log whose input is subnormal: log(x) is finite, 1/x overflows."""
    dtype = ev.dtype or "float32"
    lim = dtype_limits(dtype) or dtype_limits("float32")
    assert lim is not None
    low = x.min if x.min > 0 else x.max
    evidence = [
        f"the log's input is subnormal: values down to {fmt(low)}, below {dtype}'s smallest "
        f"normal number {fmt(lim.tiny)}, and none is 0",
        f"the forward log is finite (log({fmt(low)}) = {fmt(math.log(abs(low)))}), but in "
        f"backward (autograd node {ev.node}) d/dx log(x) = 1/x = {fmt(1 / abs(low))} overflows "
        f"{dtype} (max {fmt(lim.max)}) to inf",
        f"input ({dtype}): {describe_stat(x)}",
        *_chain_evidence(ev, trigger, "inf"),
    ]
    use = _exp_chain_use(ctx, ev, x, backward=True)
    made = _chain_producer(ev.made_from) if use is None else None
    if made in ("softmax", "sigmoid"):  # log(softmax(z)): a probability that underflowed
        zeros = f"values down to {fmt(low)}, none 0"
        use = _probability_made_use(
            made, "the log's argument", zeros, x, dtype, op=ev.op, picked=_picks(ev.made_from)
        )
    if use is not None and use.evidence:
        evidence.insert(2, use.evidence)
    return ctx.diagnosis(
        **op_fields(ev, a),
        evidence=evidence,
        explanation=(
            f"The log's input got so small that {dtype} holds it only as a subnormal number: "
            "the log itself is finite, but its gradient 1/x is larger than the dtype's "
            "largest value, so it is inf, and the chain rule turns that into NaN. A value "
            "this small is almost always an exp that underflowed (a density of a point far "
            "from every component). "
            + (
                use.why
                if use is not None and use.why
                else "Compute the log in log space (logsumexp of the exponents, log_softmax, "
                "a distribution's log_prob) so the tiny value is never formed."
            )
        ),
        fix=(
            use.fix
            if use is not None
            else "logp = torch.logsumexp(a, dim)   # log(torch.exp(a).sum(dim)) in log space, "
            "a the exponents\n"
            "logp = torch.logsumexp(torch.stack([a1 + math.log(c1), a2 + math.log(c2)]), 0)   "
            "# log(c1 * torch.exp(a1) + c2 * torch.exp(a2)): a mixture's log density\n"
            f"logp = torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))   # when only p exists: "
            f"a floor at {fmt(lim.tiny)} keeps 1/p finite"
        ),
    )


def _log_argument(ev: OpEvent) -> tuple[str, int, int, str] | None:
    """The statement of the user's line that takes one log, with that call's (start,
    end, argument); None when the line is unknown or takes several logs."""
    for stmt in statements(ev.code):
        calls = _log_calls(stmt)
        if len(calls) > 1:  # the one of this op's kind whose argument is not a constant
            name = packet(ev.op).rstrip("_")
            calls = [
                c
                for c in calls
                if _log_name(stmt[c[0] : c[1]]) in (name, None)
                and not _constant(c[2])
                and not _kept_above_zero(c[2])
            ]
        if len(calls) == 1:
            start, end, arg = calls[0]
            return stmt, start, end, arg
    return None


_FLOORS = ("clamp", "clamp_min", "clip", "maximum", "fmax")


def _kept_above_zero(arg: str) -> bool:
    """The log's argument as written cannot be 0: clamped from below (``torch.clamp(x,
    min=1e-5)``, ``x.clamp_min(eps)``) or shifted by a positive constant (``d + 1``). On a
    line with several logs (``log(x.clamp_min(eps)) if ok else log(x)``), not the one."""
    try:
        node = ast.parse(arg.strip(), mode="eval").body
    except SyntaxError:
        return False
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return any(
            isinstance(c, ast.Constant) and isinstance(c.value, (int, float)) and c.value > 0
            for c in (node.left, node.right)
        )
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    if name not in _FLOORS:
        return False
    if name in ("clamp", "clip"):  # a clamp with only a max does not floor
        given = {k.arg for k in node.keywords}
        on_torch = isinstance(f, ast.Attribute) and ast.unparse(f.value) == "torch"
        return "min" in given or len(node.args) > (1 if on_torch else 0)
    return True


def _cast_of(arg: str) -> str | None:
    """``d`` of ``d.float()`` / ``d.to(torch.float32)`` / ``d.type(torch.float)``: a value
    cast to a floating dtype, as written; None when the argument is no such cast."""
    try:
        node = ast.parse(arg.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    attr = node.func.attr
    floating = attr in ("float", "double", "half", "bfloat16") and not node.args
    if attr in ("to", "type") and len(node.args) == 1:
        floating = (
            re.fullmatch(r"torch\.(?:float\d*|double|half|bfloat16)", ast.unparse(node.args[0]))
            is not None
        )
    if not floating:
        return None
    return ast.get_source_segment(arg.strip(), node.func.value)


def _whole_counts(arg: str | None, x: TensorStat) -> bool:
    """The log's argument is a count (whole numbers >= 0): its values have an integer
    maximum, and the line casts it to float from another dtype (``dur.float()``) or names
    it as a count (``lengths``, ``x.sum(1)``)."""
    if arg is None or x.min < 0 or not math.isfinite(x.max) or not float(x.max).is_integer():
        return False
    inner = _cast_of(arg)
    return inner is not None or (_count_base(arg) and _NAME.fullmatch(arg.strip()) is not None)


def _resolution_floor(x: TensorStat, dtype: str | None) -> str:
    """A floor for a log of non-negative data at the dtype's resolution at the data's
    scale: eps × max, rounded up to a power of ten (``1e-05`` for float32 data up to 72):
    values below it are rounding noise next to the largest one."""
    lim = limits(dtype) or limits("float32")
    assert lim is not None
    scale = x.max if math.isfinite(x.max) and x.max > 0 else 1.0
    exp = math.ceil(math.log10(max(lim.eps * scale, lim.tiny)))
    return f"1e{exp:+03d}".replace("e+0", "e").replace("e-0", "e-") if exp else "1.0"


def _data_log_fix(ev: OpEvent, x: TensorStat, what: str) -> tuple[str, str] | None:
    """The user's line with a log of non-negative data kept finite at its zeros: a count
    logged as ``log1p`` (``log(0 + 1) = 0``), continuous data floored at its resolution
    (:func:`_resolution_floor`); with the comment, and a sentence for the explanation.
    None when the line or its one log is unknown."""
    found = _log_argument(ev)
    if found is None:
        return None
    stmt, start, end, arg = found
    call = stmt[start:end]
    name = _log_name(call) or packet(ev.op).rstrip("_")
    what = _cast_of(arg) or what
    rest = (
        f"\n# or, where a 0 means missing: keep it out where {what} is made, or mask it out "
        "of the loss"
    )
    if _whole_counts(arg, x):
        if name == "log":
            new = f"torch.log1p({arg})" if call.startswith("torch.") else f"{paren(arg)}.log1p()"
        else:
            new = _with_arg(call, f"{arg} + 1" if call.startswith("torch.") else f"({arg} + 1)")
        line = f"{stmt[:start]}{new}{stmt[end:]}"
        said = "log(x + 1)" if name == "log" else f"{name}(x + 1)"
        return (
            f"{line}   # {what} counts (whole numbers >= 0, max {fmt(x.max)}): {said} is 0 at "
            f"a count of 0; what is compared with it must use the same {said} (at inference: "
            f"{'expm1' if name == 'log' else 'the inverse'} of the prediction){rest}",
            f"It holds whole numbers from 0 to {fmt(x.max)}, a count or a duration, and a "
            f"count of 0 is a legitimate value: {said} maps it to 0, the usual transform of "
            "a count target; the same transform must be inverted where the prediction is used.",
        )
    if name != "log" or _is_ratio(arg):
        return None  # decibels and ratios to a reference: their floor is the scale's bottom
    floor = _resolution_floor(x, ev.dtype)
    line = f"{stmt[:start]}{_with_arg(call, f'{paren(arg)}.clamp_min({floor})')}{stmt[end:]}"
    low = fmt(_LOG_BASES.get(name, math.log)(float(floor)))
    tiny = f"{stmt[:start]}{_with_arg(call, f'{paren(arg)}.clamp_min({_tiny(arg)})')}{stmt[end:]}"
    return (
        f"{line}   # a floor at {floor}, {ev.dtype or 'float32'}'s resolution at {what}'s "
        f"scale (eps × max {fmt(x.max)}): a 0 becomes {name}({floor}) = {low}, not -inf\n"
        f"# to leave every positive value as it is, floor at the dtype's tiny instead: {tiny}"
        f"   ({_log_tiny(ev.dtype, ev.op)}){rest}",
        f"A floor at the data's resolution ({floor}: eps × its max {fmt(x.max)}) keeps it "
        f"finite at {name}({floor}) = {low}, right where a 0 means 'almost nothing' "
        "(silence, an empty bin); a floor at the dtype's tiny would make it "
        f"{_log_tiny(ev.dtype, ev.op).split(' in ')[0]}, far below every real value. Where a 0 "
        "means missing, keep it out of the loss with a mask instead.",
    )


def _log_name(call: str) -> str | None:
    """``log10`` for ``torch.log10(x)`` / ``x.log10()``; None when the text shows none."""
    m = re.match(r"torch\.(log(?:2|10)?)\(", call) or re.search(r"\.(log(?:2|10)?)\(\s*\)$", call)
    return m.group(1) if m else None


_CONSTANT_TENSOR = re.compile(r"^torch\.(?:tensor|as_tensor|scalar_tensor)\(")


def _constant(arg: str) -> bool:
    """``2.0``, ``torch.tensor(ref)``: an argument that holds no zeros the batch made (a
    literal, or a tensor made from a Python number on the line)."""
    try:
        ast.literal_eval(arg)
    except (ValueError, SyntaxError):
        return _CONSTANT_TENSOR.match(arg.strip()) is not None
    return True


_LOG_BASES: dict[str, Callable[[float], float]] = {
    "log2": math.log2,
    "log10": math.log10,
}


def _log_tiny(dtype: str | None, op: str | None = None) -> str:
    """``log10(tiny) = -37.93 in float32``: the log the op takes (log, log2, log10; log1p and
    the rest read as log) of the dtype's smallest normal number, what a floor at tiny turns
    log(0) into."""
    lim = limits(dtype) or limits("float32")
    assert lim is not None
    name = packet(op).rstrip("_") if op else "log"
    fn = _LOG_BASES.get(name)
    name, fn = (name, fn) if fn is not None else ("log", math.log)
    return f"{name}(tiny) = {fmt(fn(lim.tiny))} in {dtype or 'float32'}"


def _floored_line(ev: OpEvent) -> str | None:
    """The user's line with the log's argument floored at the dtype's tiny."""
    found = _log_argument(ev)
    if found is None:
        return None
    stmt, start, end, arg = found
    floor = f"{paren(arg)}.clamp_min({_tiny(arg)})"
    return f"{stmt[:start]}{_with_arg(stmt[start:end], floor)}{stmt[end:]}"


_RELU_NODES = ("Relu", "Threshold", "Relu6", "Hardtanh")


def _unmeasured_relu_zero_use(
    ctx: RuleContext, ev: OpEvent, r: Record, x: TensorStat
) -> _LogUse | None:
    """The log's zeros are the output ``r`` of a ReLU that was not measured (watch mode
    links a ReLU's output to its input, measured where it was made), whose input, of the
    log input's size, is <= 0 in every value: the ReLU makes all of it exactly 0."""
    if not (node_base(r.grad_fn or "") in _RELU_NODES or r.module_type == "ReLU"):
        return None
    if x.max != 0:
        return None
    pre = ctx.trace.resolve(r)
    ps = pre.stat
    if pre is r or ps is None or ps.numel != x.numel or ps.max > 0 or not math.isfinite(ps.min):
        return None
    of = f"{pre.path}'s {pre.role}" + (f" ({pre.module_type})" if pre.module_type else "")
    made = (
        f"{r.path}'s output is a ReLU of {of}, which is negative or 0 in every value "
        f"(max {fmt(ps.max)})"
    )
    if r.module_type == "ReLU":
        swap = (
            f"# {r.path} is an nn.ReLU: for a predicted positive quantity put nn.Softplus() in "
            "its place (or F.softplus(raw) + 1e-6 in a forward): positive, never exactly 0"
        )
    else:
        swap = (
            f"# {r.path}'s output is a ReLU output: for a predicted positive quantity use "
            "F.softplus(raw) + 1e-6 in place of F.relu(raw): positive, never exactly 0"
        )
    return _LogUse(
        "relu",
        fix=(
            f"{swap}\n# not a floor on the log: {_log_tiny(ev.dtype, ev.op)} is a wrong "
            "value, and the ReLU's gradient is still 0"
        ),
        why=(
            f"Its input holds {_zeros_text(x, 'log')}, and {made}: the ReLU makes all "
            f"{ps.numel:,} values exactly 0. A ReLU is exactly 0 for every negative input, "
            "so a predicted positive quantity (a mean, a rate, a scale) made with it is 0 "
            "whenever its pre-activation is negative, and its gradient there is 0 too: it "
            "never recovers. Softplus is positive everywhere and keeps a gradient."
        ),
        evidence=f"{made}: the ReLU makes all {ps.numel:,} values exactly 0",
    )


def _relu_zero_use(ctx: RuleContext, ev: OpEvent, x: TensorStat) -> _LogUse | None:
    """The log's zeros are a watched module's output that is exactly 0 everywhere, made by
    a ReLU: its autograd node is one (``ReluBackward0``), the module is an ``nn.ReLU``, or
    the module inside it that feeds it (same size) output only values <= 0. A predicted
    positive quantity (a rate, a mean, a scale) is 0 wherever the ReLU's input is negative:
    softplus keeps it positive."""
    if x.min < 0 or not has_zero(x):
        return None
    for r in ctx.records(Phase.FORWARD):
        if r.role.startswith("output") and r.stat is None:
            use = _unmeasured_relu_zero_use(ctx, ev, r, x)
            if use is not None:
                return use
    outs = [r for r in ctx.records(Phase.FORWARD) if r.role.startswith("output") and r.stat]
    for r in outs:
        st = r.stat
        assert st is not None
        if not (st.min == 0 and st.max == 0 and st.numel == x.numel):
            continue
        feeder = next(
            (
                c
                for c in outs
                if c.path.startswith(f"{r.path}.")
                and c.stat is not None
                and c.stat.numel == st.numel
                and c.stat.max <= 0
                and math.isfinite(c.stat.min)
            ),
            None,
        )
        relu_node = node_base(r.grad_fn or "") in _RELU_NODES
        if not (relu_node or r.module_type == "ReLU" or feeder is not None):
            continue
        where = f"{r.path}'s {r.role}" if r.role != "output" else f"{r.path}'s output"
        if feeder is not None and feeder.stat is not None:
            attr = feeder.path[len(r.path) + 1 :]
            made = (
                f"{where} is a ReLU (or a clamp at 0) of {feeder.path}'s output "
                f"({feeder.module_type}), which is negative or 0 in every value (max "
                f"{fmt(feeder.stat.max)})"
            )
            fix = (
                f"# in {r.module_type}.forward: F.softplus(self.{attr}(...)) + 1e-6 in place "
                f"of F.relu(self.{attr}(...)): positive, never exactly 0\n"
                f"# not a floor on the log: {_log_tiny(ev.dtype, ev.op)} is a wrong "
                "value, and the ReLU's gradient is still 0"
            )
        else:
            made = f"{where} is made by a ReLU ({r.grad_fn or r.module_type})"
            fix = (
                f"# {where} is a ReLU output: for a predicted positive quantity use "
                "F.softplus(raw) + 1e-6 in place of F.relu(raw): positive, never exactly 0\n"
                f"# not a floor on the log: {_log_tiny(ev.dtype, ev.op)} is a wrong "
                "value, and the ReLU's gradient is still 0"
            )
        return _LogUse(
            "relu",
            fix=fix,
            why=(
                f"Its input holds {_zeros_text(x, 'log')}, and {made}: the watched output "
                f"is exactly 0 in all {st.numel:,} values. A ReLU is exactly 0 for every "
                "negative input, so a predicted positive quantity (a mean, a rate, a scale) "
                "made with it is 0 whenever its pre-activation is negative, and its "
                "gradient there is 0 too: it never recovers. Softplus is positive "
                "everywhere and keeps a gradient."
            ),
            evidence=f"{made}: exactly 0 in all {st.numel:,} values",
        )
    return None


def _graph_ops(ctx: RuleContext) -> Iterator[list[str]]:
    """The ops of each ``"loss_graph"`` note of the step (the nodes from the loss back to
    the model's output, as the watcher walked them), oldest first."""
    for n in ctx.notes("loss_graph"):
        ops = n.data.get("ops")
        if isinstance(ops, list):
            yield [str(o) for o in ops]


#: autograd nodes (base names) that make a watched output in [0, 1] with exact zeros, and
#: what they say the log's argument is
_UNIT_MAKERS = {
    "Softmax": "softmax",
    "LogSoftmax": "softmax",
    "Sigmoid": "sigmoid",
    "Relu": "relu",
    "Threshold": "relu",
    "Relu6": "relu",
    "Hardtanh": "relu",
}


def _relu_of(ctx: RuleContext, r: Record, x: TensorStat) -> bool:
    """The unmeasured ReLU output ``r`` holds the values ``x``: its own pre-activation (the
    record its ``source`` links lead to: the ReLU's input, measured) has ``x``'s size, its
    positive maximum and, below 0, a minimum that the ReLU makes ``x``'s 0. Another
    tensor of the same size (a likelihood computed from the ReLU's output) is not it."""
    if r.source is None or math.prod(r.shape) != x.numel:
        return False
    pre = ctx.trace.resolve(r)
    st = pre.stat
    if pre is r or st is None or st.numel != x.numel or not st.max > 0:
        return False
    if st.max == x.max and max(st.min, 0.0) == x.min:
        return True
    return st.min < 0 and x.min == 0 and _scaled_by_caller(ctx, r, x)


def _clipped_output(ctx: RuleContext, x: TensorStat) -> Record | None:
    """The measured module output whose values are ``x`` with the negatives made 0 (a relu
    or a ``clamp(min=0)`` applied to it in code no module wraps, ``F.relu(self.s(h))``):
    the same size and the same positive maximum, a minimum below 0 where ``x``'s is 0. The
    exact float maximum shared is the evidence; the last such output when several."""
    if not (x.min == 0 and x.max > 0 and math.isfinite(x.max)):
        return None
    found = [
        r
        for r in ctx.records(Phase.FORWARD)
        if r.role.startswith("output")
        and r.stat is not None
        and r.stat.numel == x.numel
        and r.stat.max == x.max
        and r.stat.min < 0
    ]
    return found[-1] if found else None


def _scaled_by_caller(ctx: RuleContext, r: Record, x: TensorStat) -> bool:
    """The ReLU output ``r`` scaled into ``x`` by the module around it (``self.net(z) *
    3``): a measured output of ``x``'s very values, made by a multiplication or division
    (which keeps the ReLU's zeros), of a call that encloses the ReLU's, and no other output
    of that size measured in between."""
    for o in ctx.records(Phase.FORWARD):
        st = o.stat
        if o.index <= r.index or not o.role.startswith("output") or st is None:
            continue
        if st.numel != x.numel:
            continue
        if (st.min, st.max) != (x.min, x.max) or node_base(o.grad_fn) not in ("Mul", "Div"):
            return False
        call = ctx.trace.call(r.call)
        while call is not None and call.id != o.call:
            call = ctx.trace.call(call.parent) if call.parent is not None else None
        return call is not None
    return False


def _unit_producer(ctx: RuleContext, ev: OpEvent, x: TensorStat) -> str | None:
    """What made a log's argument in [0, 1] with exact zeros, from op evidence: the watched
    output holding its very values (its autograd node or module: ``softmax``, ``sigmoid``,
    ``relu``), or, in loss code, the loss graph's op after a log (``rsub``: 1 - something;
    ``erf`` below it: a Normal cdf, ``cdf``); None when nothing says."""
    outs = [r for r in ctx.records(Phase.FORWARD) if r.role.startswith("output")]
    for r in outs:
        st = r.stat
        relu = _UNIT_MAKERS.get(node_base(r.grad_fn or "")) == "relu" or r.module_type == "ReLU"
        if st is None and relu and _relu_of(ctx, r, x):
            return "relu"
        if st is None or st.numel != x.numel or st.min != x.min or st.max != x.max:
            continue
        kind = _UNIT_MAKERS.get(node_base(r.grad_fn or ""))
        if kind is None and r.module_type in ("ReLU", "Softmax", "Sigmoid"):
            kind = r.module_type.lower()
        if kind is not None:
            return kind
    chained = _chain_producer(ev.made_from)
    if chained is not None:  # the graph says what made the log's own input
        return chained
    if ev.code or ev.path != LOSS_PATH:
        return None
    # a watched output that may be the log's input (unmeasured, or of its very values)
    # hides from the loss graph's op list: the op after a log may then be another branch's.
    # An output that is another's very tensor (a wrapper returning its child's output) is
    # known by the record that measured it (not across a pass-through module: a Sigmoid's
    # output is not its input)
    found_at = [exact(ctx.trace, r) for r in outs]
    measured = [m.stat if m is not None else None for m in found_at]
    if any(
        math.prod(r.shape) == x.numel and (st is None or (st.min == x.min and st.max == x.max))
        for r, st in zip(outs, measured, strict=True)
    ):
        return None
    found: set[str] = set()
    for ops in _graph_ops(ctx):
        for i, o in enumerate(ops):
            if o != "log" or i + 1 >= len(ops):
                continue
            below = ops[i + 1 : i + 6]
            if below[0] == "rsub":
                found.add("cdf" if "erf" in below else "one-minus")
            elif below[0] in ("softmax", "sigmoid"):
                found.add(str(below[0]))
    if len(found) == 1:
        return found.pop()
    return None


#: :data:`_UNIT_MAKERS` by the lower-case names of :attr:`OpEvent.made_from`
_CHAIN_MAKERS = {k.lower(): v for k, v in _UNIT_MAKERS.items()}
#: ops of :attr:`OpEvent.made_from` whose output values are some of their input's, unchanged
_PICKS = frozenset(
    {"gather", "index", "select", "slice", "squeeze", "unsqueeze", "view", "unsafeview"}
    | {"reshape", "expand", "clone", "t", "transpose", "permute", "take", "maskedselect"}
)


def _picks(chain: Sequence[str]) -> list[str]:
    """The leading ops of a ``made_from`` chain that only pick or move values (``p.gather(1,
    a).squeeze(1)``): ``["squeeze", "gather"]``; [] when the first op computes.

    >>> _picks(["squeeze", "gather", "watched:softmax"]), _picks(["watched:softmax"])
    (['squeeze', 'gather'], [])
    """
    out: list[str] = []
    for o in chain:
        if o.startswith("watched:") or o not in _PICKS:
            break
        out.append(o)
    return out


def _chain_producer(chain: Sequence[str]) -> str | None:
    """What made a log's input, from the ops the loss graph shows below it (see
    :func:`nanwatch.ops.made_from`): a softmax, sigmoid or ReLU itself; ``1 - x`` (rsub)
    of a sigmoid (``one-minus-sigmoid``: the complement of a saturated sigmoid), of a
    Normal cdf (``cdf``: erf below it) or of anything else (``one-minus``); None when the
    chain says none of these.

    >>> _chain_producer(["rsub", "watched:sigmoid"]), _chain_producer(["watched:softmax"])
    ('one-minus-sigmoid', 'softmax')
    >>> _chain_producer(["mul", "leaf"]) is None
    True

    Ops that pick or move values without changing them (a gather of the taken action's
    probability, a squeeze, an index) are looked through: they hand on the maker's values.

    >>> _chain_producer(["squeeze", "gather", "watched:softmax"])
    'softmax'
    >>> _chain_producer(["rsub", "squeeze", "watched:sigmoid"])
    'one-minus-sigmoid'
    """
    ops = [o.removeprefix("watched:") for o in chain]
    ops = ops[len(_picks(ops)) :]  # a watched squeeze too: a model returning p.squeeze(1)
    if not ops:
        return None
    kind = _CHAIN_MAKERS.get(ops[0])
    if kind is not None:
        return kind
    if ops[0] == "sub" and ops[1:2] == ["sigmoid"]:
        return "sigmoid-difference"  # sigmoid(a) - sigmoid(b): a logistic cdf's bin mass
    if ops[0] != "rsub":
        return None
    if "erf" in ops[1:]:
        return "cdf"
    rest = ops[1:]  # 1 - p with p a sigmoid's output squeezed or indexed: still its values
    while rest and rest[0] in _PICKS:
        rest = rest[1:]
    if rest[:2] in (["pow", "tanh"], ["mul", "tanh"]):  # 1 - tanh(u) ** 2: a tanh squash
        return "one-minus-tanh2"
    return "one-minus-sigmoid" if rest[:1] == ["sigmoid"] else "one-minus"


def _loss_log_line(ctx: RuleContext, ev: OpEvent) -> OpEvent | None:
    """A log that made the loss on a line not recorded (watch mode: loss code runs outside
    every module), with its line: the statement that assigned the tensor ``backward()`` was
    called on, read above that call, when it takes the one log of this op's kind and the
    loss graph holds one such log; None otherwise."""
    if ev.code or not ev.backward_at or ev.path != LOSS_PATH or ev.phase is not Phase.FORWARD:
        return None
    name = packet(ev.op).rstrip("_")
    graphs = list(_graph_ops(ctx))
    if len(graphs) != 1 or graphs[0].count(name) != 1:
        return None
    import linecache

    path, _, num = ev.backward_at.rpartition(":")
    if not num.isdigit():
        return None
    m = re.search(r"([A-Za-z_]\w*)\.backward\(", linecache.getline(path, int(num)))
    made = _assigned_before(ev.backward_at, m.group(1)) if m is not None else None
    if made is None:
        return None
    calls = [c for c in _log_calls(made) if _log_name(made[c[0] : c[1]]) in (name, None)]
    if len(calls) != 1:
        return None
    return replace(ev, code=made, source=_line_of(ev.backward_at, made) or ev.backward_at)


def _difference_of_probabilities(ctx: RuleContext, x: TensorStat) -> bool:
    """A log's argument below 0 is read from a watched output that a subtraction made
    (SubBackward0), within [-1, 1] and down to the argument's minimum: a difference of two
    probabilities (cumulative ones of an ordinal head), negative where they are out of order."""
    for r in ctx.records(Phase.FORWARD):
        st = r.stat
        if not r.role.startswith("output") or st is None or node_base(r.grad_fn or "") != "Sub":
            continue
        if -1.0 <= st.min <= x.min < 0 and st.max <= 1.0:
            return True
    return False


#: the autograd nodes of a floor (``clamp_min``, ``torch.maximum``, ``clamp``)
_FLOOR_NODES = ("ClampMin", "Clamp", "Maximum", "Max")

#: a likelihood's usual floor (compressai's ``likelihood_bound``): log(1e-9) = -20.7, about
#: 30 bits for a symbol, where float32's tiny would charge 126 bits
_LIKELIHOOD_FLOOR = 1e-9


def _likelihood_maker(ctx: RuleContext, x: TensorStat) -> tuple[Record, str] | None:
    """The watched output holding a log argument's very values (in [0, 1], with exact
    zeros), when a subtraction (``Sub``: a difference of two probabilities, cdf(upper) -
    cdf(lower)) or a floor (``ClampMin``: a floor that left zeros) made it; None when no
    such output holds them or outputs of both kinds do."""
    if x.min != 0 or not 0 < x.max <= 1 or not has_zero(x):
        return None
    found: dict[str, Record] = {}
    for r in ctx.records(Phase.FORWARD):
        st = r.stat
        if not r.role.startswith("output") or st is None:
            continue
        if (st.numel, st.min, st.max) != (x.numel, x.min, x.max):
            continue
        if x.zeros is not None and st.zeros is not None and st.zeros != x.zeros:
            continue
        base = node_base(r.grad_fn)
        kind = "sub" if base == "Sub" else "floor" if base in _FLOOR_NODES else None
        if kind is not None:
            found.setdefault(kind, r)
    if len(found) != 1:
        return None
    ((kind, rec),) = found.items()
    return rec, kind


def _likelihood_use(
    ctx: RuleContext, ev: OpEvent, x: TensorStat, *, what: str, arg: str | None, zeros: str
) -> _LogUse | None:
    """A log of a likelihood made by hand that is exactly 0: a difference of two cumulative
    probabilities that underflowed (both 0) or cancelled (both rounded to 1), or a floor
    that the dtype rounds to 0. The answer is a floor the dtype holds (float32 when it
    holds none): the likelihood bound of an entropy model."""
    made = _likelihood_maker(ctx, x)
    lim = limits(ev.dtype) or limits("float32")
    if made is None or lim is None:
        return None
    rec, kind = made
    dtype = ev.dtype or "float32"
    held = lim.subnormal <= _LIKELIHOOD_FLOOR
    sub = f"{dtype}'s smallest subnormal is {fmt(lim.subnormal)}"
    if held:
        floor, note = f"clamp_min({_LIKELIHOOD_FLOOR:g})", "a likelihood bound"
    else:
        floor = f"float().clamp_min({_LIKELIHOOD_FLOOR:g})"
        note = f"a likelihood bound, in float32: {_LIKELIHOOD_FLOOR:g} rounds to 0 in {dtype}"
    found = _log_argument(ev)
    made_by = f"{rec.path} {rec.role}" if rec.path else rec.role
    tail = ""
    if found is not None:
        stmt, start, end, a = found
        line = f"{stmt[:start]}{_with_arg(stmt[start:end], f'{paren(a)}.{floor}')}{stmt[end:]}"
    else:  # no line: a pattern in placeholder names, not a name presented as the user's
        line = f"logp = torch.log(p.{floor})"
        note = (
            f"a pattern, in your names: p, the log's argument ({made_by}); if p is a "
            f"likelihood, {note}"
        )
        tail = (
            "\n# if it is p * log(p) of a distribution with zeros (an entropy, a "
            "straight-through sample): torch.special.xlogy(p, p) is 0 there, not 0 * -inf = NaN"
            f"\n{_FORENSIC_LINE}"
        )
    if kind == "sub":
        fix = (
            f"{line}   # {note}\n"
            "# where both cumulative probabilities round to 1 (the upper tail), the symmetric "
            "form cdf(0.5 - |v|) - cdf(-0.5 - |v|) keeps them in the lower tail, where they are "
            f"exact{tail}"
        )
        why = (
            f"Its input lies in [0, 1] (min 0, max {fmt(x.max)}) with {zeros}, and a "
            "subtraction made it. A likelihood formed as a difference of two cumulative "
            "probabilities (cdf(v + 0.5) - cdf(v - 0.5)) is exactly 0 where both underflow "
            "to 0 or both round to 1, though the true value is small, not 0. Its log is "
            "-inf. A floor on the likelihood (an entropy model's likelihood bound) keeps "
            "every valid value and bounds the rate of the rest."
        )
        evidence = (
            f"{what} is {made_by} (a watched output of the same values), made by a "
            f"subtraction (SubBackward0) within [0, 1]: a difference of two probabilities "
            "that underflowed or cancelled to 0"
        )
    else:
        fix = f"{line}   # {note}\n# or compute the likelihood in float32 (outside autocast){tail}"
        why = (
            f"Its input lies in [0, 1] (min 0, max {fmt(x.max)}) with {zeros}, though a "
            f"floor (a clamp) made it: the floor is 0 or below what {dtype} can hold "
            f"({sub}; half of it rounds to 0), so it keeps nothing out of the log. A floor "
            f"the dtype holds, or a likelihood computed in float32, does."
        )
        evidence = (
            f"{what} is {made_by} (a watched output of the same values), made by a floor "
            f"({rec.grad_fn}) that left {zeros} in {dtype}: {sub}"
        )
    return _LogUse("likelihood", fix=fix, why=why, evidence=evidence)


def _negated_log(expr: str) -> str | None:
    """``u`` of ``-torch.log(u)`` / ``-u.log()`` / ``torch.log(u).neg()`` /
    ``torch.neg(torch.log(u))``: a negated natural log, as written; None otherwise."""
    text = _unwrapped(expr)
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    inner: ast.expr | None = None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = node.operand
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr == "neg" and not node.args:
            inner = node.func.value
        elif ast.unparse(node.func) == "torch.neg" and len(node.args) == 1:
            inner = node.args[0]
    if not isinstance(inner, ast.Call) or not isinstance(inner.func, ast.Attribute):
        return None
    f = inner.func
    if ast.unparse(f) == "torch.log" and len(inner.args) == 1 and not inner.keywords:
        u = inner.args[0]
    elif f.attr == "log" and not inner.args and ast.unparse(f.value) != "torch":
        u = f.value
    else:
        return None
    return ast.get_source_segment(text, u)


def _log_of_negated_log(ev: OpEvent) -> tuple[str, int, int, str, str] | None:
    """The user's line takes the log of ``-log(u)`` (Gumbel noise, -log(-log(u))), written
    there or assigned to the log's argument earlier in the function: (statement, the outer
    log call's start and end, its argument, u). ``-log(u)`` is exactly 0 where ``u`` is 1,
    and at least -log(1 - eps/2) > eps/2 everywhere else (no value of u in (0, 1) is closer
    to 1 than eps/2 of its dtype). None when the line shows no such log, or several."""
    found: list[tuple[str, int, int, str, str]] = []
    for stmt in statements(ev.code):
        for start, end, arg in _log_calls(stmt):
            if _log_name(stmt[start:end]) not in ("log", None):
                continue
            u = _negated_log(arg)
            if u is None and _NAME.fullmatch(arg.strip()) and "." not in arg:
                made = _assigned_value(ev.source, arg.strip())
                u = _negated_log(made) if made is not None else None
            if u is not None:
                found.append((stmt, start, end, arg, u))
    return found[0] if len(found) == 1 else None


def _negated_log_use(ev: OpEvent, x: TensorStat, zeros: str) -> _LogUse | None:
    """A log of ``-log(u)`` whose zeros are where ``u`` rounded to exactly 1 (a uniform
    draw cast to a low-precision dtype: ``torch.rand(n).to(torch.bfloat16)`` rounds values
    within eps/4 of 1 up to 1.0). The floor is u's resolution below 1 (eps/2), which no
    other value of -log(u) is below: only the zeros change; the cure is a draw in float32."""
    if x.min < 0 or x.max <= 0:
        return None
    found = _log_of_negated_log(ev)
    if found is None:
        return None
    stmt, start, end, arg, u = found
    dtype = ev.dtype or "float32"
    lim = limits(dtype) or limits("float32")
    assert lim is not None
    on = u if u in identifiers(stmt) and _NAME.fullmatch(u) else arg
    floor = f"torch.finfo({paren(on)}.dtype).eps / 2"
    line = f"{stmt[:start]}{_with_arg(stmt[start:end], f'{paren(arg)}.clamp_min({floor})')}"
    line += stmt[end:]
    low = lim.eps / 2
    cast = (
        f"; in {dtype}, torch.rand(...).to({dtype}) rounds every draw above 1 - "
        f"{fmt(lim.eps / 4)} up to 1.0"
        if low_precision(dtype) is not None
        else ""
    )
    fix = (
        f"{line}   # -log({u}) is 0 only where {u} == 1; every other value is at least "
        f"eps / 2 = {fmt(low)} ({u}'s spacing below 1 in {dtype}), so only the zeros change "
        f"(to -log({fmt(low)}) = {fmt(-math.log(low))})\n"
        f"# better, where {u} is drawn: draw it and compute the noise in float32, then cast "
        "the noise, not the uniform: g = -torch.log(-torch.log(torch.rand(shape).clamp(1e-6, "
        f"1 - 1e-6))).to(dtype){cast}"
    )
    why = (
        f"Its input is -log({u}), which is exactly 0 where {u} is exactly 1 ({zeros}): "
        f"a uniform draw is in [0, 1), but one rounded or cast to {dtype} reaches 1.0. "
        f"No other value of -log({u}) is below eps / 2 = {fmt(low)} of {dtype} (the "
        f"largest value below 1 is 1 - eps / 2), so a floor there changes the zeros only; "
        "a floor at the argument's scale would change valid samples, and one at the dtype's "
        "tiny would turn a 0 into a sample of -log(tiny), far above every real one. Drawing "
        "the uniform in float32, clamped inside (0, 1), and casting the result keeps every "
        "sample exact."
    )
    evidence = (
        f"{arg} is -log({u}): 0 exactly where {u} == 1 ({zeros}, max {fmt(x.max)}), "
        f"a uniform that rounded to 1 in {dtype}"
    )
    return _LogUse("negated-log", fix=fix, why=why, evidence=evidence)


#: layers whose output is an affine map of their input: any real number
_AFFINE = frozenset(
    {"Linear", "LazyLinear", "Bilinear", "Conv1d", "Conv2d", "Conv3d", "LazyConv1d",
     "LazyConv2d", "LazyConv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"}
)  # fmt: skip


def _raw_layer_output(ctx: RuleContext, ev: OpEvent, x: TensorStat) -> tuple[str, str] | None:
    """(path, type) of the affine layer (a Linear, a convolution) whose output is, value for
    value, the log's input: the loss graph shows the log took a watched output itself
    (:attr:`OpEvent.made_from` ``["watched:..."]``) and one module's measured output has its
    very statistics; the innermost module when a parent returned it as is."""
    chain = ev.made_from
    if not chain or not chain[0].startswith("watched:"):
        return None
    found: list[Record] = []
    for r in ctx.records(Phase.FORWARD):
        st = r.stat
        if not r.role.startswith("output") or st is None or st.numel != x.numel:
            continue
        if st.min == x.min and st.max == x.max:
            found.append(r)
    if not found:
        return None
    inner = max(found, key=lambda r: (r.module_type in _AFFINE, r.path.count(".")))
    if inner.module_type not in _AFFINE:
        return None
    return inner.path, inner.module_type


def _abs_operand(arg: str | None) -> str | None:
    """The operand of ``arg`` when it is an absolute value (``torch.abs(v)``, ``v.abs()``,
    ``abs(v)``), as written; None otherwise.

    >>> _abs_operand("torch.abs(1 + psi @ u)"), _abs_operand("det.abs()"), _abs_operand("p")
    ('1 + psi @ u', 'det', None)
    """
    try:
        node = ast.parse((arg or "").strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call):
        return None
    name = ast.unparse(node.func)
    if name in ("torch.abs", "abs", "torch.absolute") and len(node.args) == 1:
        return ast.unparse(node.args[0])
    if isinstance(node.func, ast.Attribute) and node.func.attr in ("abs", "absolute"):
        return None if node.args else ast.unparse(node.func.value)
    return None


def _det_operand(v: str | None) -> str | None:
    """The matrix of a determinant as the line writes it (``torch.det(W)``,
    ``torch.linalg.det(W)``, ``W.det()``: ``W``); None for anything else."""
    try:
        node = ast.parse((v or "").strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call):
        return None
    if ast.unparse(node.func) in ("torch.det", "torch.linalg.det") and len(node.args) == 1:
        return ast.unparse(node.args[0])
    if isinstance(node.func, ast.Attribute) and node.func.attr == "det" and not node.args:
        return ast.unparse(node.func.value)
    return None


def _log_abs_det(ev: OpEvent, m: str, what: str, x: TensorStat) -> _LogUse:
    """log|det(M)| with exact zeros: det is the product of M's pivots, which leaves the
    dtype's range (to exactly 0) for a large M that is invertible as easily as for a
    singular one; slogdet sums the pivots' logs and is finite for every invertible M."""
    lim = dtype_limits(ev.dtype or "float32")
    dtype = ev.dtype or "float32"
    low = fmt(lim.subnormal) if lim is not None else "its smallest subnormal"
    zeros = _zeros_text(x, "log")
    found = _log_argument(ev)
    own = (
        f"{found[0][: found[1]]}torch.linalg.slogdet({m}).logabsdet{found[0][found[2] :]}"
        if found is not None and _log_name(found[0][found[1] : found[2]]) == "log"
        else None
    )
    line = (
        f"{own}   # log|det {m}| from the logs of its LU pivots: finite for every invertible {m}"
        if own
        else f"torch.linalg.slogdet({m}).logabsdet   # in place of torch.log(torch.abs("
        f"torch.det({m}))): finite for every invertible {m}"
    )
    return _LogUse(
        "magnitude",
        fix=(
            f"{line}\n"
            f"# if it is still -inf, {m} is singular: keep it invertible by construction "
            f"(an LU parameterization, Glow's W = P @ L @ (U + torch.diag(s)), log|det| = "
            "log|s|.sum())\n"
            "# not an eps inside the log: log(eps) replaces the true log|det|, a wrong value"
        ),
        why=(
            f"Its input is |det({m})| with {zeros}. det({m}) is the product of {m}'s pivots "
            f"(its LU factorization): for a large matrix that product leaves {dtype}'s range, "
            f"to exactly 0 below {low}, even when {m} is invertible and well conditioned "
            "(n singular values of 0.7 multiply to 0.7^n), or it is 0 because the matrix is "
            "singular. torch.linalg.slogdet sums the logs of the pivots instead: log|det| is "
            "then an ordinary finite number for every invertible matrix, -inf only for a "
            "singular one."
        ),
        evidence=f"{what} is |det({m})|: the log of a determinant that is exactly 0 in {dtype}",
        title="Log of a determinant that reached 0",
    )


def _log_of_abs(
    ev: OpEvent, made_ev: OpEvent, arg: str | None, what: str, x: TensorStat
) -> _LogUse | None:
    """A log whose argument is an absolute value (the user's line, or the loss graph's op
    below the log: ``abs``), with exact zeros: log|v| is -inf where v is 0, a value that
    changes sign (a Jacobian determinant of a flow, a signal), not a probability that
    underflowed. None when the argument is no absolute value."""
    operand = _abs_operand(arg)
    chain = [o.removeprefix("watched:") for o in made_ev.made_from]
    if operand is None and chain[len(_picks(chain)) :][:1] != ["abs"]:
        return None
    v = operand or "v"
    zeros = _zeros_text(x, "log")
    det = _det_operand(operand)
    if det is None and operand is None and chain[len(_picks(chain)) :][1:2] == ["linalgdet"]:
        det = "M"  # the graph shows abs(det(.)) below the log; the line is unknown
    if det is not None:
        return _log_abs_det(ev, det, what, x)
    lim = dtype_limits(ev.dtype or "float32")
    eps = fmt(lim.eps) if lim is not None else "1e-6"
    tiny_log = _log_tiny(ev.dtype, ev.op)
    found = _log_argument(ev) if operand is not None else None
    kept = f"{paren(v)}.abs() + {eps}"
    line = (
        f"{found[0][: found[1]]}{_with_arg(found[0][found[1] : found[2]], kept)}"
        f"{found[0][found[2] :]}   # finite: log({eps}) at a 0"
        if found is not None
        else f"torch.log({kept})   # in place of torch.log(torch.abs({v})): log({eps}) at a 0"
    )
    return _LogUse(
        "magnitude",
        fix=(
            f"# log|{v}| is -inf where {v} is exactly 0: keep it off 0 by construction where "
            "it is made; for a normalizing flow's log|det J|, a transform that stays "
            "invertible (a planar flow's u constrained so that w·u > -1; a coupling layer's "
            "scale as exp(s), whose log|det| is s.sum(-1) with no log taken)\n"
            f"{line}; not a floor at tiny: {tiny_log}"
        ),
        why=(
            f"Its input is an absolute value |{v}| with {zeros}: log|{v}| is -inf where {v} "
            "is exactly 0, a value that can take either sign passing through 0 (a Jacobian "
            "determinant that vanished: the transform is not invertible there), not a "
            f"probability that underflowed. Its gradient 1/({v}) is infinite there too. The "
            "cure is a quantity that cannot reach 0; an eps inside the log only keeps the "
            "line finite."
        ),
        evidence=f"{what} is an absolute value, |{v}|: the log of a magnitude that reached 0",
        title="Log of an absolute value that reached 0",
    )


def _unknown_log_use(ctx: RuleContext, ev: OpEvent, x: TensorStat) -> _LogUse | None:
    """What the evidence shows when nothing names what the log was taken of: a negative
    argument is a domain error (no floor or probability recipe fixes it); exact zeros in
    values that are not probabilities come from the data or the code that made them; only
    zeros within [0, 1] may be probabilities that underflowed. In watch mode a log that made
    the loss is read on the loss's line (:func:`_loss_log_line`)."""
    lined = _loss_log_line(ctx, ev)
    read = f"the loss was made at {lined.source}: {lined.code}" if lined is not None else None
    made_ev, ev = ev, lined or ev
    found = _log_argument(ev)
    arg = found[3] if found is not None else None
    what = arg or "the log's argument"
    tiny_log = _log_tiny(ev.dtype, ev.op)
    if x.min < 0 and _within_eps_below_zero(x, ev.dtype):
        return _rounded_below_zero(ev, x, what, arg)
    if x.min < 0 and _difference_of_probabilities(ctx, x):
        return _LogUse(
            "negative",
            fix=(
                f"# {what} reached {fmt(x.min)}, and the model output it comes from was made "
                "by a subtraction, within [-1, 1]: a difference of two probabilities\n"
                "# cumulative probabilities sigmoid(f - b) (an ordinal / CORAL / cumulative-"
                "logit head): P(y = k) = c[k] - c[k + 1] is negative where the thresholds b "
                "are not increasing; order them:\n"
                "b = b0 + torch.cumsum(F.softplus(deltas), 0)   # a pattern, in your names: "
                "b0 the first threshold, deltas the raw gaps (nn.Parameter)\n"
                f"# not a clamp at a tiny value: {tiny_log} is a wrong value, not a small one"
            ),
            why=(
                f"Its input is negative (min {fmt(x.min)}, max {fmt(x.max)}) and was made by a "
                "subtraction of values in [0, 1]: a probability formed as a difference of "
                "cumulative probabilities (sigmoid(f - b[k]) - sigmoid(f - b[k + 1])) is "
                "negative wherever b[k] > b[k + 1]. Thresholds learned freely are not kept "
                "in order; build them as a first value plus a cumulative sum of positive gaps."
            ),
            evidence=f"{what} holds negative values, down to {fmt(x.min)}, and a watched "
            "output made by a subtraction (SubBackward0) holds them, within [-1, 1]",
        )
    made_at = _positive_where_made(ev, arg) if x.min < 0 else None
    if made_at is not None:  # rate = m(x) above the line: a model's output, unconstrained
        name, value, positive, where, unpacked = made_at
        log_link = (
            f"{name} = {name}.exp(), {value} then predicting log {name}"
            if unpacked
            else f"{name} = {value}.exp(), {value} then predicting its log"
        )
        return _LogUse(
            "negative",
            fix=(
                f"{name} = {positive} + 1e-6   # {_made_at(made_at)}: above 0 "
                f"for every use of it; or {log_link}\n"
                f"# not a clamp at a tiny value: {tiny_log} is a wrong value, not a small one"
            ),
            why=(
                f"Its input is negative (min {fmt(x.min)}, max {fmt(x.max)}): {name} is made "
                f"at {where} {'from' if unpacked else 'as'} {value}, a model's output, which "
                "can be any real number. A "
                "quantity that must be positive (a rate, a scale, a variance) needs a "
                "positive map where it is made: softplus, or exp of a predicted log. A floor "
                f"at a tiny value would turn the NaN into {tiny_log}, finite and wrong, and "
                "leave no gradient to move the output back."
            ),
            evidence=f"{name} is made at {where}: {unpacked or f'{name} = {value}'}, a "
            "model's output that nothing keeps above 0",
        )
    raw = _raw_layer_output(ctx, made_ev, x) if x.min < 0 else None
    if raw is not None:
        path, kind = raw
        ref = module_ref(path)
        f = "torch.nn.functional." if _lacks_f(made_ev.backward_at or made_ev.source) else "F."
        return _LogUse(
            "negative",
            fix=(
                f"# {what} is what {path} ({kind}) returns, unconstrained, and it reached "
                f"{fmt(x.min)}: make it positive where it is made\n"
                f"positive = {f}softplus({ref}(h)) + 1e-6   # a pattern, in your names: h, what "
                f"{path} is given; or {ref}(h).exp(), {path} then predicting its log\n"
                f"# not a clamp at a tiny value: {tiny_log} is a wrong value, not a small one"
            ),
            why=(
                f"Its input is negative (min {fmt(x.min)}, max {fmt(x.max)}): the very values "
                f"{path} ({kind}) returned, and a {kind}'s output can be any real number. A "
                "quantity that must be positive (a variance, a scale, a rate) needs a positive "
                "map after the layer: softplus, or exp of a predicted log. A floor at a tiny "
                f"value would turn the NaN into {tiny_log}, finite and wrong, and leave no "
                "gradient to move the layer back."
            ),
            evidence=f"{what} is the output of {path} ({kind}) itself (the same "
            f"{x.numel:,} values, min {fmt(x.min)}, max {fmt(x.max)}): a {kind}'s output is "
            "any real number, and a log needs one above 0",
        )
    if x.min < 0:
        return _LogUse(
            "negative",
            fix=(
                f"# {what} must be > 0 for a log, and it reached {fmt(x.min)}: find what makes "
                "it negative where it is computed\n"
                "# a predicted positive quantity (a scale, a rate, a variance): F.softplus(raw) "
                "+ 1e-6 or raw.exp(), not the raw output\n"
                f"# not a clamp at a tiny value: {tiny_log} is a wrong value, not "
                "a small one"
            ),
            why=(
                f"Its input is negative (min {fmt(x.min)}, max {fmt(x.max)}): that is a domain "
                "error, not an underflow. No probability underflows below 0, and a floor at a "
                f"tiny value would turn the NaN into {tiny_log}, finite and wrong. "
                "The quantity the log is taken of is not positive: the code that computes it "
                "is what to fix."
            ),
            evidence=f"{what} holds negative values, down to {fmt(x.min)}: not an underflow",
        )
    if not has_zero(x):
        return None
    magnitude = _log_of_abs(ev, made_ev, arg, what, x)
    if magnitude is not None:  # log|v|: v crossed 0, no probability
        return magnitude
    own = _floored_line(ev)
    zeros = _zeros_text(x, "log")
    made = _unit_producer(ctx, made_ev, x)
    # a ReLU seen past a watched squeeze (a model returning F.relu(z).squeeze(-1)): the
    # measured output it clipped is named as when the graph showed nothing
    past = made == "relu" and any(o.startswith("watched:") for o in made_ev.made_from[:-1])
    clipped = _clipped_output(ctx, x) if made is None or past else None
    if made == "relu" and clipped is None:  # a ReLU's zeros, whatever its maximum
        return _unit_made_use(made, what, zeros, x, ev.dtype, op=ev.op)
    if clipped is not None:  # a measured output with its negatives zeroed: a relu of it
        use = _unit_made_use("relu", what, zeros, x, ev.dtype, op=ev.op)
        st = clipped.stat
        assert st is not None
        return replace(
            use,
            evidence=f"{what} holds the values of {clipped.path}'s {clipped.role} "
            f"({clipped.module_type}: min {fmt(st.min)}, max {fmt(st.max)}, "
            f"{count(st.numel, 'value')}) with its negatives set to 0: a relu (or a clamp at "
            "0) of it",
        )
    negated = _negated_log_use(ev, x, zeros) if made is None else None
    if negated is not None:  # -log(u) is 0 where u rounded to 1 (Gumbel noise)
        return negated
    above = _above_one(x.max, ev.dtype)
    if above and (masked := _masked_log_ratio(ctx, ev, x)) is not None:
        return _LogUse(
            "zero",
            fix=masked,
            why=(
                f"Its input holds exact zeros and is not a probability (values up to "
                f"{fmt(x.max)}), and it is not what the model returned: this line compares "
                "logs of a prediction and a target, and a target of 0 marks an entry with no "
                "value (no depth, no count, a padded or missing label). Its log is -inf, so "
                "the loss is inf. Keep those entries out of the loss with a mask; a floor "
                "would train the prediction toward log(tiny) there."
            ),
            evidence=f"{what} holds {zeros} (values up to {fmt(x.max)}), and the model's "
            "output is not it: a target with entries that hold no value",
        )
    data_fix = _data_log_fix(ev, x, what) if above else None
    if data_fix is not None:
        fix, said = data_fix
        return _LogUse(
            "zero",
            fix=fix,
            why=(
                f"Its input holds exact zeros and is not a probability (values up to "
                f"{fmt(x.max)}): the 0 comes from the data or the code that makes it, not "
                f"from a probability that underflowed. {said}"
            ),
            evidence=f"{what} is not a probability: it holds {zeros}, and values up to "
            f"{fmt(x.max)}",
        )
    if above:
        head = (
            f"# {what} holds {zeros} (min 0, max {fmt(x.max)}): keep 0 out where {what} is "
            "made or sampled"
        )
        guard = f"{own}   # or a floor, when a 0 is legitimate there: {tiny_log}" if own else None
        return _LogUse(
            "zero",
            fix="\n".join(line for line in (head, guard) if line),
            why=(
                f"Its input holds exact zeros and is not a probability (values up to "
                f"{fmt(x.max)}): the 0 comes from the data or the code that makes it (a noise "
                "level, a scale or a count that can be 0; an exp, softplus or sigmoid of an "
                f"argument below {_underflow_bound(ev.dtype)} underflows to exactly 0 too), "
                "not from a probability that underflowed. Keep 0 out "
                f"of the log where the value is made; a floor keeps it finite at "
                f"{tiny_log}, which is only right where a 0 means 'almost nothing'."
            ),
            evidence=f"{what} is not a probability: it holds {zeros}, and values up to "
            f"{fmt(x.max)}",
        )
    lik = _likelihood_use(ctx, ev, x, what=what, arg=arg, zeros=zeros) if made is None else None
    if lik is not None:
        return lik
    if made == "one-minus-sigmoid":
        return _one_minus_sigmoid_use(ctx, what, zeros, ev, known=not _line_unknown(ev))
    if made == "sigmoid-difference":
        return _sigmoid_difference_use(what, zeros, ev.dtype)
    if made is not None and made not in ("softmax", "sigmoid"):
        return _unit_made_use(made, what, zeros, x, ev.dtype, op=ev.op)
    masked = _mask_below(made_ev.made_from)
    inside = _own_code_zeros(ctx, x) if made == "softmax" and masked is None else None
    if inside is not None:  # the module's own code made the zeros: no underflow of its input
        soft, fed, st, floor = inside
        return _own_code_zeros_use(what, zeros, soft, fed, st=st, floor=floor)
    filled = _own_code_fill(ctx, made_ev, x, what) if made == "softmax" and masked is None else None
    if filled is not None:  # the graph below the watched softmax: its own code's -inf
        return filled
    if made in ("softmax", "sigmoid"):
        return _probability_made_use(
            made,
            what,
            zeros,
            x,
            ev.dtype,
            op=ev.op,
            known=not _line_unknown(ev),
            picked=_picks(made_ev.made_from) if made_ev.made_from else (),
            masked=masked,
        )
    if made is None and arg is not None and _is_ratio(arg):
        return _unit_ratio_use(ev, what, zeros, x)
    if made is None:
        softmax = (
            f"# if {what} is a softmax/sigmoid probability: take the log from the "
            "logits, F.log_softmax(logits, dim=-1) or F.logsigmoid(logits)"
        )
        mixture = (
            f"# if {what} is a mixture (w * p + (1 - w) * q, a copy distribution scattered "
            "into a vocabulary): it is 0 where every component is, a label none can give; "
            "floor it, or map such labels to one the model can produce"
        )
        entropy = (
            "# if it is p * log(p) of a distribution with zeros (an entropy, a KL's "
            "target term): torch.special.xlogy(p, p) is 0 there, not 0 * -inf = NaN"
        )
        lines = (
            [f"{own}   # finite: {tiny_log}", softmax, entropy, mixture]
            if own
            else [
                f"# if {what} is a ratio or a normalized energy (x / x.max(), a / b): it "
                f"is 0 where the numerator is; a floor, {paren(arg or 'r')}.clamp_min"
                + (
                    "(1e-10) (-100 dB for 10 * log10 of a power)"
                    if packet(ev.op).rstrip("_") == "log10"
                    else f"(torch.finfo({paren(arg or 'r')}.dtype).tiny)"
                ),
                softmax,
                entropy,
            ]
        )
        return _LogUse(
            "unit",
            fix="\n".join(lines),
            why=(
                f"Its input lies in [0, 1] (min 0, max {fmt(x.max)}) with {zeros}, and what "
                "made it is not seen: no watched softmax or sigmoid output holds these "
                "values. A probability put together by hand is exactly 0 where each of its "
                "parts is: a mixture of distributions (a sum of weights times probabilities) "
                "at a label no component gives, a ratio or a fraction k/n where its "
                "numerator is 0 (silence, an empty class). Its log is -inf; a floor keeps it "
                "finite at a chosen bottom value. A probability that underflowed to 0 is "
                "better computed from its logits."
            ),
            evidence=read or "",
        )
    lines = []
    if own:
        lines.append(f"{own}   # finite: {tiny_log}")
    lines += [
        f"# {what} is a softmax/sigmoid probability: take the log from the logits instead, "
        "F.log_softmax(logits, dim=-1) or F.logsigmoid(logits), not torch.log(p)",
        f"# {what} is data in [0, 1] (pixels, fractions): keep it inside (0, 1), "
        f"{paren(arg or 'p')}.clamp(eps, 1 - eps) or dequantize",
    ]
    return _LogUse(
        "unit",
        fix="\n".join(lines),
        why=(
            f"Its input lies in [0, 1] (min 0, max {fmt(x.max)}) with {zeros}. Either it is "
            "a probability that underflowed to exactly 0 (a softmax or sigmoid of a large "
            "negative logit): computing the log from the logits (log_softmax, logsigmoid, "
            "the *_with_logits losses) never forms the 0; or it is data with exact zeros "
            "(black pixels, a fraction k/n with k = 0), which must be kept inside (0, 1)."
        ),
    )


def _is_ratio(arg: str) -> bool:
    """``S / S.amax(-1, keepdim=True)``, ``(a / b)``: the log's argument is a quotient."""
    try:
        tree = ast.parse(arg.strip(), mode="eval")
    except SyntaxError:
        return False
    node = tree.body
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args:
        node = node.func.value  # (a / b).float()
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)


def _unit_ratio_use(ev: OpEvent, what: str, zeros: str, x: TensorStat) -> _LogUse:
    """A log of a quotient in [0, 1] with exact zeros (an energy over its maximum, a
    fraction): 0 where the numerator is, and a floor (``amin``) is the usual answer."""
    found = _log_argument(ev)
    db = packet(ev.op).rstrip("_") == "log10"
    amin = "1e-10" if db else f"torch.finfo({paren(what)}.dtype).tiny"
    note = "amin = 1e-10: -100 dB for 10 * log10 of a power" if db else "a floor"
    if found is not None:
        stmt, start, end, arg = found
        floor = f"{paren(arg)}.clamp_min({amin})"
        fix = f"{stmt[:start]}{_with_arg(stmt[start:end], floor)}{stmt[end:]}   # {note}"
    else:
        fix = f"y = torch.log10(r.clamp_min({amin}))   # r = {what}: {note}"
    return _LogUse(
        "ratio",
        fix=fix,
        why=(
            f"Its input is a ratio in [0, 1] (min 0, max {fmt(x.max)}) with {zeros}: 0 "
            "wherever the numerator is 0 (silence, an empty band, an all-zero frame), not a "
            "probability. The log of that 0 is -inf; a floor on the ratio (amin, the "
            "bottom of the dB scale) keeps it finite, as torchaudio's AmplitudeToDB and "
            "librosa's power_to_db do."
        ),
        evidence=f"{what} is a quotient in [0, 1] holding {zeros}",
    )


def _masked_log_ratio(ctx: RuleContext, ev: OpEvent, x: TensorStat) -> str | None:
    """The user's line that compares several logs (``log(pred) - log(gt)``, a log-depth or
    log-count loss) with each log's argument indexed by a mask of the entries where all are
    > 0, when the log's input (exact zeros, nothing below 0) is not the model's measured
    output of its size: a target whose 0 marks a missing value. None otherwise."""
    if x.min < 0 or not has_zero(x):
        return None
    for r in first_root_outputs(ctx.trace):
        st = r.stat
        if st is not None and st.numel == x.numel and (st.min, st.max) == (x.min, x.max):
            return None  # the model's own output: its zeros are made there
    for stmt in statements(ev.code):
        calls = _log_calls(stmt)
        args = list(dict.fromkeys(arg for _, _, arg in calls))
        if len(args) < 2 or not all(_NAME.fullmatch(a) for a in args):
            continue
        if "=" not in stmt.split("(", 1)[0]:
            continue  # an assignment keeps the rewritten line pasteable
        taken = set(re.findall(r"(?<![\w.])[A-Za-z_]\w*", stmt))
        valid = fresh_name("valid", taken)
        out, last = [], 0
        for start, end, arg in calls:
            text = stmt[start:end]
            at = text.find(arg)
            if at < 0:
                return None
            out += [stmt[last:start], text[:at], f"{arg}[{valid}]", text[at + len(arg) :]]
            last = end
        out.append(stmt[last:])
        cond = " & ".join(f"({a} > 0)" for a in args)
        return (
            f"{valid} = {cond}   # the entries with a value: a target of 0 holds none\n"
            + "".join(out)
        )
    return None


def _within_eps_below_zero(x: TensorStat, dtype: str | None) -> bool:
    """The most negative value is a few rounding steps below 0 at the values' scale (at
    least 1): -1.19e-07 of 1 - x in float32, not a value negative in its own right."""
    lim = limits(dtype) or limits("float32")
    assert lim is not None
    scale = max(abs(x.max) if math.isfinite(x.max) else 1.0, 1.0)
    return x.min >= -8 * lim.eps * scale


def _rounded_below_zero(ev: OpEvent, x: TensorStat, what: str, arg: str | None) -> _LogUse:
    """A log's argument whose negative values are one rounding below 0 (1 - x with x a sum
    of probabilities that rounded above 1: -1.19e-07 in float32): its true value is 0 or a
    little above, not a quantity that is negative in its own right."""
    dt = ev.dtype or "float32"
    lim = limits(dt) or limits("float32")
    assert lim is not None
    own = _floored_line(ev)
    floor = (
        f"{own}   # a floor: the rounding below 0 and any exact 0 give {_log_tiny(ev.dtype, ev.op)}"
        if own
        else "# torch.log(p.clamp_min(torch.finfo(p.dtype).tiny)), p the log's argument: the "
        f"rounding below 0 and any exact 0 give {_log_tiny(ev.dtype, ev.op)}"
    )
    return _LogUse(
        "rounding",
        fix=(
            f"{floor}\n"
            "# or form 1 - x as the sum of the terms x leaves out (a reversed cumsum of the "
            "probabilities), which never rounds below 0"
        ),
        why=(
            f"Its input dips below 0 by {fmt(-x.min)} only, within a few {dt} eps "
            f"({fmt(lim.eps)}) of its scale (max {fmt(x.max)}): that is rounding, not a "
            "negative value. 1 - x where x is a sum of probabilities that should reach at "
            "most 1 (a cumsum of a softmax) lands one rounding step below 0 when x rounds "
            "above 1. Floor it at a tiny positive value, or compute the complement without "
            "the subtraction."
        ),
        evidence=f"{what} reached {fmt(x.min)}, within a few eps ({fmt(lim.eps)}) of its scale: "
        "a rounding error below 0, not a negative value",
    )


#: the last line of a fix written as a pattern because the op's line is not known
_FORENSIC_LINE = '# mode="forensic" names your line, and nanwatch rewrites it'


def _line_unknown(ev: OpEvent) -> bool:
    """The op's own line is not known (sentinel and watch modes read the loss graph at
    backward(): its nodes keep no forward line)."""
    return not ev.code or not ev.source or ev.source == ev.backward_at


def _probability_made_use(
    made: str,
    what: str,
    zeros: str,
    x: TensorStat | None,
    dtype: str,
    *,
    op: str | None = None,
    known: bool = True,
    picked: Sequence[str] = (),
    masked: str | None = None,
) -> _LogUse:
    """A log's argument with exact zeros that op evidence shows a softmax or a sigmoid made
    (a watched output of its very values, or the loss graph's ``log <- softmax``): a
    probability that underflowed; the log from the logits, a floor the only alternative.
    ``masked``: the loss graph shows the logits filled through a mask just below it (see
    :func:`_mask_below`): its zeros are the mask's, not an underflow."""
    dt = dtype or "float32"
    call, not_call = (
        ("F.log_softmax(logits, dim=-1)", "torch.log(F.softmax(logits, dim=-1))")
        if made == "softmax"
        else ("F.logsigmoid(logits)", "torch.log(torch.sigmoid(logits))")
    )
    if masked is not None:
        return _masked_probability_use(
            made, what, zeros, x, dtype, call=call, mask=masked, op=op, picked=picked
        )
    pick = ""
    if picked:  # log(p.gather(1, a)): the log of every probability, then the same pick
        pick = (
            f"\n# then pick from logp as the code picks from the {made}'s output "
            f"({' <- '.join(picked)}): logp.gather(-1, idx) in place of torch.log(p.gather("
            "-1, idx)); the log of a picked probability is the picked log-probability"
        )
    return _LogUse(
        made,
        fix=(
            f"logp = {call}   # a pattern, in your names: logits, the {made}'s input; not "
            f"{not_call}; never 0{pick}\n"
            f"# or keep the {made} and floor it: torch.log(p.clamp_min(torch.finfo(p.dtype)"
            f".tiny)), {_log_tiny(dtype, op)} at the zeros"
            + ("" if known else f"\n{_FORENSIC_LINE}")
        ),
        why=(
            f"Its input is {'picked from ' if picked else ''}a {made} output with {zeros}"
            + (f" (max {fmt(x.max)})" if x is not None else "")
            + f": the {made} of a "
            f"logit far below the others underflows to exactly 0 in {dt}, and its log is "
            f"-inf, although the true log-probability is finite. {call} computes it from the "
            "logits without forming the 0."
        ),
        evidence=(
            f"{what} is picked from a {made} output (log <- {' <- '.join(picked)} <- {made})"
            if picked
            else f"{what} is a {made} output (log <- {made})"
        )
        + ": a probability that underflowed"
        + (" to 0" if x is None or has_zero(x) else ""),
    )


#: ops of :attr:`OpEvent.made_from` that fill a tensor through a mask: ``masked_fill(m,
#: -inf)``, ``torch.where(keep, z, -inf)``, by their lower-case node names
_FILL_OPS = {"maskedfill": "masked_fill", "where": "torch.where"}


def _mask_below(chain: Sequence[str]) -> str | None:
    """The masking op (``masked_fill``, ``torch.where``) that the loss graph shows right
    below the softmax or sigmoid of a ``made_from`` chain (after the ops that only pick
    values): the logits were filled through a mask before the probability was taken; None
    when the chain shows none, or the softmax is a watched output (what made its input is
    not in the chain).

    >>> _mask_below(["softmax", "maskedfill", "addmm"]), _mask_below(["watched:softmax"])
    ('masked_fill', None)
    >>> _mask_below(["squeeze", "gather", "softmax", "where", "leaf"])
    'torch.where'
    """
    ops = list(chain[len(_picks(chain)) :])
    if len(ops) < 2 or _CHAIN_MAKERS.get(ops[0]) not in ("softmax", "sigmoid"):
        return None
    return _FILL_OPS.get(ops[1])


def _fill_mask(args: str | None, obj: str | None) -> tuple[str, str] | None:
    """The mask of a softmax's input filled through one on the same line, and the op that
    filled it: ``args``, the text of ``F.softmax(...)``'s arguments, or ``obj``, what
    ``.softmax()`` is called on. ``z.masked_fill(m, -inf)`` gives ``m``;
    ``torch.where(keep, z, -inf)`` gives ``~keep``; None for anything else.

    >>> _fill_mask('z.masked_fill(~legal, float("-inf")), -1', None)
    ('~legal', 'masked_fill')
    >>> _fill_mask(None, "torch.where(keep, z, -1e9)"), _fill_mask("z, -1", None)
    (('~keep', 'torch.where'), None)
    """
    try:
        if args is not None:
            call = ast.parse(f"f({args})", mode="eval").body
            assert isinstance(call, ast.Call)
            if not call.args:
                return None
            x = call.args[0]
        elif obj is not None:
            x = ast.parse(obj, mode="eval").body
        else:
            return None
    except (SyntaxError, AssertionError):
        return None
    if not isinstance(x, ast.Call) or not isinstance(x.func, ast.Attribute):
        return None
    if x.func.attr == "masked_fill" and len(x.args) == 2:
        return ast.unparse(x.args[0]), "masked_fill"
    if x.func.attr == "where" and len(x.args) == 3:
        keep = ast.unparse(x.args[0])
        return (f"~{keep}" if _NAME.fullmatch(keep) else f"~({keep})"), "torch.where"
    return None


def _earlier_fill(ctx: RuleContext, ev: OpEvent) -> tuple[str, str] | None:
    """The mask of a masked_fill or a torch.where traced before the log ``ev`` (forensic:
    every op is an event) that made as many -inf as the log's input holds zeros (the
    softmax of those -inf is those zeros), read from that op's line: what
    :func:`_fill_mask` reads when the mask is on the log's own line; None when no such op
    ran, or its line does not say the mask."""
    x = first_input(ev)
    ops = ctx.trace.ops
    at = next(
        (
            i
            for i, o in enumerate(ops)
            if o is ev
            or (o.op, o.phase, o.source, o.output) == (ev.op, ev.phase, ev.source, ev.output)
        ),
        None,
    )
    if x is None or not x.zeros or at is None:
        return None
    for o in reversed(ops[:at]):
        name = packet(o.op)
        if o.phase is not Phase.FORWARD or name not in ("masked_fill", "where"):
            continue
        if o.output is None or o.output.neginf != x.zeros:
            continue
        for stmt in statements(o.code):
            try:
                tree = ast.parse(stmt.strip())
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    text = ast.get_source_segment(stmt.strip(), node)
                    found = _fill_mask(None, text) if text else None
                    if found is not None:
                        return found
        return None
    return None


def _own_code_zeros(
    ctx: RuleContext, x: TensorStat
) -> tuple[Record, Record, TensorStat, float] | None:
    """The watched softmax output holding ``x``'s very values, made in its module's own code,
    and the one output of that module's children of its size (what the softmax was computed
    from), finite and spanning too little for a softmax of it to be exactly 0 anywhere:
    each entry is at least exp(-(max - min)) / n, n the largest dimension, above the
    dtype's smallest subnormal. Returns (softmax output, child output, its statistics, that
    floor); None when the records do not show all of it (sentinel measures no module
    output)."""
    if not has_zero(x):
        return None
    outs = [
        r
        for r in ctx.records(Phase.FORWARD)
        if r.role.startswith("output")
        and r.stat is not None
        and node_base(r.grad_fn or "") == "Softmax"
        and (r.stat.min, r.stat.max, r.stat.numel) == (x.min, x.max, x.numel)
    ]
    lim = dtype_limits(outs[0].dtype) if len(outs) == 1 else None
    if lim is None or not outs[0].shape:
        return None
    r = outs[0]
    kids = {c.id for c in ctx.trace.calls if c.parent == r.call}
    feeds = []
    for o in ctx.records(Phase.FORWARD):
        if o.call not in kids or not o.role.startswith("output"):
            continue
        st = o.stat if o.stat is not None else ctx.trace.resolve(o).stat
        if st is not None and st.numel == x.numel:
            feeds.append((o, st))
    if len(feeds) != 1 or not feeds[0][1].finite:
        return None
    f, st = feeds[0]
    floor = math.exp(-(st.max - st.min)) / max(r.shape)
    return (r, f, st, floor) if floor > lim.subnormal else None


def _own_code_zeros_use(
    what: str, zeros: str, r: Record, f: Record, *, st: TensorStat, floor: float
) -> _LogUse:
    """A log of a module's softmax output whose zeros its own code made (see
    :func:`_own_code_zeros`): a -inf put into the logits (a mask, noise by hand) or a
    scale, not an underflow; the log from the logits is -inf there too."""
    span = f"{f.path}'s output (min {fmt(st.min)}, max {fmt(st.max)})"
    return _LogUse(
        "softmax",
        fix=(
            f"# in {r.module_type}.forward: return the log-probabilities beside the "
            "probabilities, with the masked entries at 0\n"
            "logp = F.log_softmax(z, dim=-1).masked_fill(mask, 0.0)   # a pattern, in your "
            "names: z, the logits given the -inf; mask, where they are -inf\n"
            "# then p * logp (an entropy) is 0 there; a picked or target entry the mask forbids "
            "is a bug in the mask or the data\n"
            "# noise by hand: -torch.log(-torch.log(u)) is -inf at u = 0: "
            "u = torch.rand_like(z).clamp_min(torch.finfo(z.dtype).tiny), or F.gumbel_softmax\n"
            "# a temperature, no -inf: F.log_softmax(z / tau, dim=-1), not torch.log of the "
            "softmax"
        ),
        why=(
            f"Its input is {r.path}'s softmax output with {zeros}, but the softmax was taken "
            f"in {r.module_type}'s own code of {span}, and a softmax of those values is at "
            f"least {fmt(floor)} everywhere: the zeros are no underflow of it. The code "
            f"between {f.path} and the softmax made them: a -inf put into the logits (a "
            "mask, masked_fill(mask, -inf) of illegal actions or padding; noise by hand, "
            "-log(-log(u)) at a draw u = 0) or a scale (a temperature) large enough. The log "
            "of an entry whose logit is -inf is -inf whether it is computed as torch.log(p) "
            "or F.log_softmax(z): those entries have to leave the log, and the loss."
        ),
        evidence=f"{what} is {r.path}'s softmax output (log <- softmax, in its own code); "
        f"{span} spans {fmt(st.max - st.min)}: its softmax is at least "
        f"{fmt(floor)}, so the zeros are no underflow of it",
        title=f"Log of a softmax that {r.path}'s own code set to 0",
    )


#: the op that :func:`nanwatch.ops.made_below` ends with below a watched softmax, when it
#: can put a -inf into the logits: a fill through a mask, or an add of a tensor with no
#: gradient (an additive mask, noise by hand)
_OWN_FILLS = {
    "maskedfill": "masked_fill",
    "where": "torch.where",
    "add(constant)": "add",
    "sub(constant)": "sub",
}


def _own_code_fill(ctx: RuleContext, ev: OpEvent, x: TensorStat, what: str) -> _LogUse | None:
    """A log of a watched softmax output with exact zeros whose logits its module's own code
    filled through a mask (masked_fill, torch.where) or added a tensor with no gradient to,
    as the autograd graph below the watched output shows (the ``below:`` ops of
    :attr:`OpEvent.made_from`, names only): the softmax is exactly 0 where that put a -inf.
    What sentinel mode can tell (it measures no child output, see :func:`_own_code_zeros`);
    an add is not said where a measured child output spans enough to underflow. None
    otherwise."""
    chain = ev.made_from
    picked = _picks(chain)
    ops = chain[len(picked) :]
    below = [o.removeprefix("below:") for o in ops[1:] if o.startswith("below:")]
    fill = _OWN_FILLS.get(below[-1]) if below and ops[0] == "watched:softmax" else None
    lim = dtype_limits(ev.dtype or "float32")
    if fill is None or lim is None or not has_zero(x):
        return None
    outs = [
        r
        for r in ctx.records(Phase.FORWARD)
        if r.role.startswith("output")
        and node_base(r.grad_fn or "") == "Softmax"
        and (
            picked  # a pick of it: another size
            or (
                (r.stat.min, r.stat.max, r.stat.numel) == (x.min, x.max, x.numel)
                if r.stat is not None
                else math.prod(r.shape) == x.numel
            )
        )
    ]
    r = max(outs, key=lambda o: o.path.count(".")) if outs else None
    added = fill in ("add", "sub")
    if added and r is not None and not picked:  # what the softmax was taken of, if measured
        kids = {c.id for c in ctx.trace.calls if c.parent == r.call}
        for o in ctx.records(Phase.FORWARD):
            st = (
                ctx.trace.resolve(o).stat
                if o.call in kids and o.role.startswith("output")
                else None
            )
            if st is None or st.numel != x.numel or not st.finite or not r.shape:
                continue
            if math.exp(-(st.max - st.min)) / max(r.shape) <= lim.subnormal:
                return None  # a softmax of it can underflow to 0 there
    who = ("picked from " if picked else "") + (f"{r.path}'s" if r is not None else "the model's")
    own = f"{r.module_type}'s" if r is not None else "the model's"
    fwd = f"{r.module_type}.forward" if r is not None else "the model's forward"
    trail = " <- ".join(["log", *picked, "softmax", *(_OWN_FILLS.get(b, b) for b in below)])
    gap = fmt(-math.log(lim.subnormal))
    dt = ev.dtype or "float32"
    done = (
        f"filled the logits through a mask ({fill}) before the softmax: it is exactly 0 "
        f"wherever the fill put -inf (or a number so negative that its exp is 0 in {dt}), by "
        "construction, not by underflow"
        if not added
        else f"added a tensor with no gradient to the logits ({fill}) before the softmax (an "
        "additive mask of 0 and -inf; noise by hand, -log(-log(u)), -inf at a draw u = 0): "
        "it is exactly 0 wherever that put a -inf; without one, a logit underflows to 0 "
        f"only about {gap} below the largest of its row (exp(-{gap}) is {dt}'s smallest "
        "value)"
    )
    mask = (
        "mask, where they are -inf"
        + (" (torch.where(keep, z, -inf): ~keep)" if fill == "torch.where" else "")
        + (" (an additive mask m: m == float('-inf'))" if added else "")
    )
    fix = [
        f"# in {fwd}: return the log-probabilities beside the probabilities, with "
        "the masked entries at 0",
        "logp = F.log_softmax(z, dim=-1).masked_fill(mask, 0.0)   # a pattern, in your names: "
        f"z, the logits given the -inf; {mask}",
        "# then p * logp (an entropy) is 0 there; a picked or target entry the mask forbids "
        "is a bug in the mask or the data",
    ]
    if added:
        fix.append(
            "# noise by hand: -torch.log(-torch.log(u)) is -inf at u = 0: "
            "u = torch.rand_like(z).clamp_min(torch.finfo(z.dtype).tiny), or F.gumbel_softmax"
        )
    return _LogUse(
        "softmax",
        fix="\n".join(fix),
        why=(
            f"Its input is {who} softmax output with {_zeros_text(x, 'log')}, and the autograd "
            f"graph below it shows that {own} own code {done}. The log of an entry whose "
            "logit is -inf is -inf whether it is computed as torch.log(p) or "
            "F.log_softmax(z): those entries have to leave the log, and the loss."
            + (
                f" The code picks its zeros ({' <- '.join(picked)}): an entry the mask "
                "forbids (a taken action, a label) is a bug in the mask or the data."
                if picked
                else ""
            )
        ),
        evidence=f"{what} is {who} softmax output, and its own code "
        + ("added a tensor with no gradient to its logits" if added else "filled its logits")
        + f" ({trail}, from the autograd graph): exactly 0 where that put a -inf",
        title=f"Log of a softmax that {r.path if r is not None else 'the model'}'s own code "
        "set to 0",
    )


def _masked_probability_use(
    made: str,
    what: str,
    zeros: str,
    x: TensorStat | None,
    dtype: str,
    *,
    call: str,
    mask: str,
    op: str | None = None,
    picked: Sequence[str] = (),
) -> _LogUse:
    """A log of a softmax (or sigmoid) whose logits were filled through a mask just before
    it (``log <- softmax <- masked_fill``): its zeros are the masked positions, exactly 0 by
    construction (a fill of -inf, or of a number so negative that its exp is 0). The log
    from the logits is -inf there too: the masked positions must leave the log, and the
    loss."""
    dt = dtype or "float32"
    return _LogUse(
        made,
        fix=(
            f"logp = {call}.masked_fill(mask, 0.0)   # a pattern, in your names: logits, the "
            f"{mask}'s output, and mask, its mask (for torch.where(keep, z, -inf): ~keep); 0, "
            "not -inf, at the masked positions, and no gradient through them\n"
            + (
                f"# then pick from logp as the code picks ({' <- '.join(picked)}): a picked "
                "entry the mask forbids (a taken action, a label) is a bug in the mask or the "
                "data, whatever the log: its log-probability is -inf\n"
                if picked
                else ""
            )
            + "# and keep the masked positions out of the loss: a target (a label, a teacher's "
            "distribution) with mass there has an infinite loss whatever the log; give it 0 "
            "there (p.masked_fill(mask, 0), renormalized)\n"
            f"# or a floor, finite but a made-up value at every masked position: "
            f"torch.log(p.clamp_min(torch.finfo(p.dtype).tiny)), {_log_tiny(dtype, op)}"
        ),
        why=(
            f"Its input is a {made} of logits filled through a mask ({mask}), with {zeros}"
            + (f" (max {fmt(x.max)})" if x is not None else "")
            + f": the {made} is exactly 0 at every masked position (a fill of -inf, or of a "
            f"number so negative that its exp is 0 in {dt}), by construction, not by "
            "underflow. The log-probability of a masked entry is -inf, so computing it from "
            f"the logits ({call}) is -inf there too, and the next op that weighs it (a "
            "target with mass there, p * log p) makes inf or NaN. The masked positions have "
            "to leave the log, and the loss."
        ),
        evidence=f"{what} is a {made} of masked logits (log <- {made} <- {mask}): exactly 0 at "
        "the masked positions by construction, not a probability that underflowed",
        title=f"Log of a masked {made}: -inf at the masked positions",
    )


def _unit_made_use(
    made: str, what: str, zeros: str, x: TensorStat, dtype: str, *, op: str | None = None
) -> _LogUse:
    """A log's argument in [0, 1] with exact zeros that op evidence shows is no softmax or
    sigmoid probability: a ReLU output (0 by construction), 1 - a Normal cdf (the Gaussian
    survival, 0 once cdf rounds to 1), or 1 - something else that reached 1."""
    tiny_log = _log_tiny(dtype, op)
    dt = dtype or "float32"
    if made == "relu":
        return _LogUse(
            "relu",
            fix=(
                f"# {what} is a ReLU output: for a predicted positive quantity (a rate, a "
                "scale, a concentration) use F.softplus(raw) + 1e-6 in place of F.relu(raw): "
                "positive, never exactly 0\n"
                f"# not a floor on the log: {tiny_log} is a wrong value, and the "
                "ReLU's gradient is still 0"
            ),
            why=(
                f"Its input holds {zeros} (max {fmt(x.max)}), and a ReLU made it: a ReLU is "
                "exactly 0 for every negative input, so a positive quantity made with it is 0 "
                "by construction, not a probability that underflowed; its gradient there is "
                "0 too, so it never recovers. Softplus is positive everywhere and keeps a "
                "gradient."
            ),
            evidence=f"{what} is a ReLU output (a watched output of the same values): "
            "0 for every negative input",
        )
    if made == "one-minus-tanh2":
        lim = dtype_limits(dt) or dtype_limits("float32")
        assert lim is not None
        edge = 0.5 * math.log(8 / lim.eps)  # tanh(u) ** 2 rounds to 1 above it
        return _LogUse(
            "tanh",
            fix=(
                "log_det = 2 * (math.log(2) - u - F.softplus(-2 * u))   # a pattern, in your "
                "names: u, the tanh's input (the action before the squash); equal to "
                "torch.log(1 - torch.tanh(u) ** 2), and finite for every u\n"
                "# not torch.log(1 - a.pow(2) + 1e-6): finite, but wrong where tanh(u) "
                "rounds to ±1, and its gradient there is 0"
            ),
            why=(
                f"Its input is 1 - tanh(u)² (the loss graph takes the log of 1 - the square "
                f"of a tanh) with {zeros}: tanh(u)² rounds to exactly 1 in {dt} once |u| > "
                f"{fmt(edge)}, so 1 - tanh(u)² is 0 and its log is -inf, although the true "
                "value, about 2·log(2) - 2|u|, is finite. That is the log-Jacobian of a tanh-"
                "squashed action (a SAC policy's log-probability correction) whose "
                "pre-squash action grew large; the same quantity written from u, without "
                "forming tanh(u), stays exact."
            ),
            evidence="the loss graph takes the log of 1 - tanh(u)² (log <- rsub <- "
            f"square <- tanh): tanh(u)² rounds to 1 for |u| > {fmt(edge)} in {dt}",
            title="Log of 1 - tanh(u)² that rounded to 0",
        )
    if made == "cdf":
        return _LogUse(
            "cdf",
            fix=(
                "log_sf = torch.special.log_ndtr(-z)   # log(1 - Phi(z)), not "
                "torch.log(1 - Normal(0, 1).cdf(z)): finite for every z\n"
                "# log(Phi(z)) likewise: torch.special.log_ndtr(z)"
            ),
            why=(
                f"Its input is 1 - cdf(z) of a Normal (the loss graph takes the log of 1 - "
                f"a value made with erf), with {zeros}: the cdf rounds to exactly 1 in {dt} "
                "once z is a few standard deviations out (about 5.4 in float32), so the "
                "survival 1 - cdf(z) is 0 and its log is -inf, although the true value is "
                "finite. torch.special.log_ndtr computes log(Phi(z)) without forming the "
                "rounded cdf: log_ndtr(-z) is the log survival."
            ),
            evidence="the loss graph takes the log of 1 - x with x made by erf (a Normal "
            "cdf): log <- rsub <- ... erf",
        )
    return _LogUse(
        "one-minus",
        fix=(
            f"# {what} is 1 - p with p reaching 1: compute log(1 - p) without forming the 0, "
            "F.logsigmoid(-logits) for p = sigmoid(logits), torch.log1p(-p) for a small p\n"
            f"# or keep p below 1 where it is made: p.clamp_max(1 - torch.finfo(p.dtype).eps)"
        ),
        why=(
            f"Its input is 1 - p (the loss graph takes the log of 1 - something) with "
            f"{zeros}: p rounded to exactly 1 in {dt}, so 1 - p is 0. That is a complement "
            "that lost its precision, not a probability of 0: compute it in a form that "
            "never subtracts from 1 (logsigmoid of the negated logit, log1p)."
        ),
        evidence="the loss graph takes the log of 1 - x (log <- rsub)",
    )


def _drop_sigmoid(ctx: RuleContext, ev: OpEvent | None = None) -> tuple[str, list[str]]:
    """How to name the sigmoid: the one nn.Sigmoid module whose output the step recorded,
    else "a sigmoid"; and the fix's first line, which drops that module so the model returns
    logits; or, with no such module, the user's line that applied the sigmoid (forensic
    mode's ``sigmoid_at`` of ``ev``: ``return torch.sigmoid(z).squeeze(1)`` in a model's
    forward) with the sigmoid taken out; none when neither is known."""
    paths = {
        r.path
        for r in ctx.records(Phase.FORWARD)
        if r.role.startswith("output") and r.module_type == "Sigmoid"
    }
    module = paths.pop() if len(paths) == 1 else None
    maker = f"the nn.Sigmoid ({module})" if module is not None else "a sigmoid"
    lines = []
    if module is not None:
        ref = module_ref(module)
        lines.append(
            f"{ref} = nn.Identity()   # first: drop {maker}, so the model returns logits"
            if ref != "model"
            else f"# first: remove {maker}, so the model returns logits"
        )
    elif ev is not None and paths == set():
        at, code = ev.scalars.get("sigmoid_at"), ev.scalars.get("sigmoid_code")
        fixed = _without_sigmoid(code) if isinstance(code, str) else None
        if isinstance(at, str) and fixed is not None:
            lines.append(
                f"{fixed}   # first, at {at}: return the logit, the sigmoid taken out "
                f"(was: {str(code).split('  #', 1)[0].strip()})"
            )
        elif "sigmoid" in ev.made_from:
            # no line of the sigmoid's own (watch, sentinel): the user's line that called the
            # module the op ran in (a loss module), when that line applied the sigmoid
            site = _caller_site(ctx, ev.path)
            fixed = _without_sigmoid(site[1]) if site is not None else None
            if site is not None and fixed is not None:
                lines.append(
                    f"{fixed}   # first, at {site[0]}: pass the logits, the sigmoid taken out "
                    f"(was: {site[1].split('  #', 1)[0].strip()})"
                )
    return maker, lines


def _caller_site(ctx: RuleContext, path: str | None) -> tuple[str, str] | None:
    """(``file.py:42``, its code) of the user's line that called the root module whose
    call ran module ``path`` (the watcher's ``root_call`` note); None when not noted."""
    for n in ctx.notes("root_call"):
        code, source = n.data.get("code"), n.source
        if path is None or not (path == n.path or path.startswith(f"{n.path}.")):
            continue
        if isinstance(code, str) and isinstance(source, str) and code and "library" not in n.data:
            return source, code
    return None


def _without_sigmoid(code: str) -> str | None:
    """``code``, one statement, with its one sigmoid call replaced by its argument (``return
    z.squeeze(1)`` of ``return torch.sigmoid(z).squeeze(1)``); None when the statement does
    not parse or applies no sigmoid or several."""
    from nanwatch.rules.losses import _sigmoid_call

    line = code.split("  #", 1)[0].strip()
    if not line.isascii():
        return None
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None
    hits = [
        (call, arg)
        for call in ast.walk(tree)
        if isinstance(call, ast.expr) and (arg := _sigmoid_call(call)) is not None
    ]
    if len(tree.body) != 1 or len(hits) != 1:
        return None
    call, arg = hits[0]
    seg = ast.get_source_segment(line, arg)
    if seg is None or call.end_col_offset is None or call.lineno != call.end_lineno:
        return None
    inner = (
        seg if isinstance(arg, (ast.Call, ast.Name, ast.Attribute, ast.Subscript)) else f"({seg})"
    )
    return line[: call.col_offset] + inner + line[call.end_col_offset :]


def _one_minus_sigmoid_use(
    ctx: RuleContext, what: str, zeros: str, ev: OpEvent, *, known: bool
) -> _LogUse:
    """A log of ``1 - p`` that the loss graph shows a sigmoid made p for (log <- rsub <-
    sigmoid), read without the user's line: the complement of a saturated sigmoid, fixed
    from the logits (binary_cross_entropy_with_logits for a hand-written binary
    cross-entropy, the loss graph taking a second log; logsigmoid(-logits) otherwise), and
    the nn.Sigmoid module that made p dropped so the model returns them."""
    dt = ev.dtype or "float32"
    f = "torch.nn.functional." if _lacks_f(ev.backward_at) else "F."
    # log(p) of the same sigmoid beside log(1 - p): a binary cross-entropy written by hand
    # (through ops that only pick or move its values: p = torch.sigmoid(z).squeeze(1))
    bce = any(
        isinstance(chain, list) and _sigmoid_side([str(o) for o in chain]) == "sigmoid"
        for n in ctx.notes("loss_graph")
        for chain in n.data.get("logs", ())
    )
    # the logs weighted by a power of p or 1 - p (CenterNet's (1 - p) ** a * log(p)): a
    # focal loss, whose terms binary_cross_entropy_with_logits does not compute
    focal = any(
        isinstance(chain, list) and _sigmoid_side([str(o) for o in chain]) is not None
        for n in ctx.notes("loss_graph")
        for chain in n.data.get("powers", ())
    )
    maker, lines = _drop_sigmoid(ctx, ev)
    if focal:
        model = None
        if not lines:  # a module's forward that ends in torch.sigmoid (not an nn.Sigmoid)
            ends = {
                r.path
                for r in ctx.records(Phase.FORWARD)
                if r.role.startswith("output") and str(r.grad_fn).startswith("SigmoidBackward")
            }
            if len(ends) == 1:
                (end,) = ends
                model = (
                    f"# {end}'s forward returns a sigmoid's output: return the logits it "
                    "was given, for these logs"
                )
        return _focal_log_use(
            ev, f, maker, lines, what=what, zeros=zeros, known=known, both=bce, model=model
        )
    bce_line = (
        f"loss = {f}binary_cross_entropy_with_logits(logits, y)   # a pattern, in your "
        "names: logits, what the sigmoid was given; y, the targets: the binary "
        "cross-entropy from the logits, never -inf"
    )
    log_line = f"log_1mp = {f}logsigmoid(-logits)   # log(1 - sigmoid(logits)), never -inf"
    lines += [bce_line, log_line] if bce else [log_line, bce_line]
    lines.append("# torch.sigmoid(logits) wherever the probability itself is needed")
    if not known:
        lines.append(_FORENSIC_LINE)
    limit = _SIGMOID_ONE.get(dt, _SIGMOID_ONE["float32"])
    return _LogUse(
        "bce" if bce else "one-minus",
        title=(
            "Log of zero in a hand-written binary cross-entropy: the sigmoid saturated at 1"
            if bce
            else "Log of zero: 1 - sigmoid, with the sigmoid saturated at 1"
        ),
        fix="\n".join(lines),
        why=(
            f"Its input is 1 - p with p made by {maker} ({zeros}): a sigmoid of a logit above "
            f"about {limit} rounds to exactly 1.0 in {dt}, so 1 - p is 0 and its log is -inf, "
            "although the true log(1 - p) is finite"
            + ("; with the label's weight of 0 on that term, 0 × -inf is NaN. " if bce else ". ")
            + "binary_cross_entropy_with_logits and logsigmoid(-logits) work from the logit "
            "and never form the 0."
        ),
        evidence=f"{what} is 1 - p, p the output of {maker} ({_sigmoid_chain(ev.made_from)}): "
        "0 where p rounded to 1"
        + (
            "; the loss takes the log of p as well: a hand-written binary cross-entropy"
            if bce
            else ""
        ),
    )


def _focal_log_use(
    ev: OpEvent,
    f: str,
    maker: str,
    lines: list[str],
    *,
    what: str,
    zeros: str,
    known: bool,
    both: bool,
    model: str | None = None,
) -> _LogUse:
    """:func:`_graph_one_minus_sigmoid`'s story when the loss weights its logs by powers of
    the same sigmoid's output (a focal loss, CenterNet's heatmap loss): each log is taken
    from the logits with logsigmoid, the weights stay as they are."""
    dt = ev.dtype or "float32"
    lines.append(f"log_1mp = {f}logsigmoid(-logits)   # log(1 - sigmoid(logits)), never -inf")
    if both:
        lines.append(f"log_p = {f}logsigmoid(logits)      # log(sigmoid(logits)), never -inf")
    lines.append(
        "# the weights ((1 - p) ** a, p ** a) stay as they are, with p = torch.sigmoid(logits)"
    )
    if model is not None:
        lines.append(model)
    if not known:
        lines.append(_FORENSIC_LINE)
    limit = _SIGMOID_ONE.get(dt, _SIGMOID_ONE["float32"])
    return _LogUse(
        "one-minus",
        title="Log of zero in a focal loss: 1 - sigmoid, with the sigmoid saturated at 1",
        fix="\n".join(lines),
        why=(
            f"Its input is 1 - p with p made by {maker} ({zeros}): a sigmoid of a logit above "
            f"about {limit} rounds to exactly 1.0 in {dt}, so 1 - p is 0 and its log is -inf, "
            "although the true log(1 - p) is finite; its weight is 0 there, and 0 × -inf is "
            "NaN. logsigmoid(-logits) works from the logit and never forms the 0; the loss "
            "weights its logs by powers of p (a focal loss), so it is not "
            "binary_cross_entropy_with_logits: only its logs change."
        ),
        evidence=f"{what} is 1 - p, p the output of {maker} ({_sigmoid_chain(ev.made_from)}): "
        "0 where p rounded to 1; the loss weights its logs by powers of p or 1 - p "
        "(a focal loss), not a plain binary cross-entropy",
    )


def _sigmoid_chain(chain: Sequence[str]) -> str:
    """The data flow from a log down to the sigmoid below it, as the graph shows it.

    >>> _sigmoid_chain(["rsub", "squeeze", "watched:sigmoid", "addmm"])
    'log <- rsub <- squeeze <- sigmoid'
    >>> _sigmoid_chain([])
    'log <- rsub <- sigmoid'
    """
    ops = [o.removeprefix("watched:") for o in chain]
    if "sigmoid" not in ops:
        return "log <- rsub <- sigmoid"
    return " <- ".join(["log", *ops[: ops.index("sigmoid") + 1]])


def _bce_parts(stmt: str, q: str) -> tuple[str | None, str, str]:
    """(the name the statement assigns, the label that multiplies ``log(q)``, the
    ``reduction=`` argument of binary_cross_entropy_with_logits for the statement's last
    reduction) of a binary cross-entropy written by hand, in the user's names; ``y`` when
    the label is not read."""
    try:
        tree = ast.parse(stmt.strip())
    except SyntaxError:
        return None, "y", ""
    lhs = None
    body = tree.body[0] if len(tree.body) == 1 else None
    if isinstance(body, ast.Assign) and len(body.targets) == 1:
        lhs = ast.unparse(body.targets[0])
    label = "y"
    for n in ast.walk(tree):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult):
            for this, other in ((n.left, n.right), (n.right, n.left)):
                logged = _log_of(this)
                if logged is not None and ast.unparse(logged[1]) == q:
                    label = ast.unparse(other)
    rhs = stmt.split("=", 1)[1] if lhs else stmt
    reduction = (
        ""
        if re.search(r"\.mean\(\s*\)\s*$", rhs.strip())
        else ', reduction="sum"'
        if re.search(r"\.sum\(\s*\)\s*$", rhs.strip())
        else ', reduction="none"'
    )
    return lhs, label, reduction


def _sigmoid_side(chain: Sequence[str]) -> str | None:
    """``sigmoid`` when a ``made_from`` chain shows a sigmoid made the value (through ops
    that only pick or move values), ``one-minus-sigmoid`` for 1 minus such a value; None
    otherwise.

    >>> _sigmoid_side(["rsub", "squeeze", "sigmoid"]), _sigmoid_side(["watched:squeeze"])
    ('one-minus-sigmoid', None)
    """
    ops = [o.removeprefix("watched:") for o in chain]
    minus = ops[:1] == ["rsub"]
    rest = [o for o in ops[1 if minus else 0 :] if o not in _PICKS]
    if rest[:1] != ["sigmoid"]:
        return None
    return "one-minus-sigmoid" if minus else "sigmoid"


def _called(text: str) -> str | None:
    """``D`` of ``D(fake.detach())``: what a call expression calls; None for anything else."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    return ast.unparse(node.func) if isinstance(node, ast.Call) else None


def _labelled_bce_by_flow(ctx: RuleContext, ev: OpEvent, stmt: str) -> _LogUse | None:
    """A binary cross-entropy with fixed labels written by hand, ``log(D(real)) + log(1 -
    D(fake))`` (a GAN discriminator's loss): every log of the line takes ``f(a)`` or ``1 -
    f(b)`` of one callee f, and the data flow shows the 0 is 1 minus a sigmoid's output: f
    returns probabilities. The fix drops the sigmoid and takes logsigmoid of the logits,
    ``F.logsigmoid(D(real))`` and ``F.logsigmoid(-D(fake))``. None for any other line."""
    calls = _log_calls(stmt)
    if len(calls) < 2:
        return None
    callees, parts, last = set(), [], 0
    f = "torch.nn.functional." if _lacks_f(ev.source) else "F."
    for start, end, arg in calls:
        m = _ONE_MINUS.match(arg)
        inner = m.group(1).strip() if m is not None else arg
        callees.add(_called(inner))
        new = f"{f}logsigmoid(-{paren(inner)})" if m is not None else f"{f}logsigmoid({inner})"
        parts += [stmt[last:start], new]
        last = end
    if len(callees) != 1 or None in callees:
        return None
    (fn,) = callees
    own = "".join(parts) + stmt[last:]
    dt = ev.dtype or "float32"
    maker, lines = _drop_sigmoid(ctx, ev)
    lines.append(
        f"{own}   # {fn} now returns logits z: log(sigmoid(z)) and log(1 - sigmoid(z)) "
        "without forming the 0"
    )
    lines.append(
        f"# every other log of {fn}'s output too: torch.log({fn}(x)) -> {f}logsigmoid({fn}(x)); "
        f"torch.sigmoid({fn}(x)) wherever the probability itself is needed"
    )
    chain = " <- ".join(["log", *(o.removeprefix("watched:") for o in ev.made_from)])
    one = _SIGMOID_ONE.get(dt, _SIGMOID_ONE["float32"])
    return _LogUse(
        "bce",
        title="Log of zero in a hand-written binary cross-entropy: the sigmoid saturated at 1",
        fix="\n".join(lines),
        why=(
            f"The line is a binary cross-entropy with fixed labels written by hand, the log "
            f"of {fn}(...) and of 1 - {fn}(...), and {fn}'s output was made by {maker}: in "
            f"{dt} a sigmoid of a logit above about {one} rounds to exactly 1, so 1 - p is 0 "
            "and its log -inf (a confident discriminator does this). logsigmoid computes the "
            "same terms from the logits and never forms the 0; a clamp would leave the loss "
            "flat there, with no gradient."
        ),
        evidence=f"the op is log(1 - p), p made by {maker} (data flow: {chain}): the line "
        f"takes the log of {fn}(...) and of 1 - {fn}(...), a binary cross-entropy with "
        "fixed labels",
    )


def _bce_by_flow(ctx: RuleContext, ev: OpEvent, stmt: str, args: list[str]) -> _LogUse | None:
    """A binary cross-entropy written by hand (the line takes log(q) and log(1 - q)) whose
    q the data flow shows a sigmoid made, where the line does not show it (``p = model(x)``,
    the model ending in an nn.Sigmoid): the loss from the logits, the Sigmoid dropped. None
    when the flow shows no sigmoid below the log, or the code shows the sigmoid (its own
    reading names the logits)."""
    made = _sigmoid_side(ev.made_from)
    if made is None:
        return None
    qs = [m.group(1).strip() for a in args if (m := _ONE_MINUS.match(a))]
    q = next((q for q in qs if q in args), None)
    if q is None and made == "one-minus-sigmoid":
        return _labelled_bce_by_flow(ctx, ev, stmt)
    if q is None or _producer_of(q, ev.source)[0] == "sigmoid":
        return None
    dt = ev.dtype or "float32"
    f = "torch.nn.functional." if _lacks_f(ev.source) else "F."
    maker, lines = _drop_sigmoid(ctx, ev)
    lhs, label, reduction = _bce_parts(stmt, q)
    lines.append(
        f"{lhs or 'loss'} = {f}binary_cross_entropy_with_logits({q}, {label}{reduction})   "
        f"# in place of the hand-written one: {q} is now the logits; never -inf"
    )
    lines.append(f"# torch.sigmoid({q}) wherever the probability itself is needed")
    low = made == "sigmoid"
    side = f"log({q})" if low else f"log(1 - {q})"
    chain = " <- ".join(["log", *(o.removeprefix("watched:") for o in ev.made_from)])
    where = (
        f"{q} is exactly 0 where its logit is below {_underflow_bound(dt)} (the sigmoid "
        "underflowed)"
        if low
        else f"{q} is exactly 1 where its logit is above about "
        f"{_SIGMOID_ONE.get(dt, _SIGMOID_ONE['float32'])} (the sigmoid rounded to 1)"
    )
    return _LogUse(
        "bce",
        title=(
            "Log of zero in a hand-written binary cross-entropy: the sigmoid saturated at "
            + ("0" if low else "1")
        ),
        fix="\n".join(lines),
        why=(
            f"The line is a binary cross-entropy written by hand, log({q}) and log(1 - {q}), "
            f"and {q} was made by {maker}: in {dt}, {where}, so {side} is -inf, and the "
            "label's weight of 0 on that term makes 0 × -inf = NaN. "
            "binary_cross_entropy_with_logits computes the same loss from the logits and "
            "never forms the 0 or the 1."
        ),
        evidence=f"the op is {side}, and {q} was made by {maker} (data flow: {chain}): "
        f"the line takes log({q}) and log(1 - {q}), a hand-written binary cross-entropy",
    )


def _underflow_at(dtype: str | None) -> float:
    """The x below which exp(x) (and softplus(x) = log1p(exp(x))) is exactly 0 in ``dtype``."""
    lim = limits(dtype) or limits("float32")
    assert lim is not None
    return math.log(lim.subnormal / 2)


def _underflow_bound(dtype: str | None) -> str:
    return fmt(_underflow_at(dtype))


_SOFTPLUS_RHS = re.compile(
    r"^(?:torch\.nn\.functional|F|torch)\.softplus\((.+)\)$|^(.+)\.softplus\(\s*\)$"
)
#: autograd nodes (loss graph names) other than softplus that turn finite values into exact
#: zeros by saturating or underflowing; with one of them in the graph, softplus is not the
#: only suspect
_ZERO_MAKERS = frozenset(
    {
        "softmax",
        "sigmoid",
        "exp",
        "exp2",
        "relu",
        "threshold",
        "hardtanh",
        "relu6",
        "clamp",
        "clampmin",
        "clampmax",
        "maskedfill",
        "where",
        "sqrt",
    }
)


def _unwrapped(expr: str) -> str:
    """``expr`` without whitespace and the parentheses around all of it."""
    out = expr.strip()
    while out.startswith("(") and _closing(out, 1) == len(out) - 1:
        out = out[1:-1].strip()
    return out


def _is_softplus(expr: str) -> bool:
    """``expr`` is one softplus call and nothing else (``F.softplus(raw)``, not
    ``F.softplus(raw) + 1e-6``)."""
    m = _SOFTPLUS_RHS.match(expr)
    if m is None:
        return False
    if m.group(1) is not None:
        return _closing(expr, expr.index("(") + 1) == len(expr) - 1
    return True


def _softplus_made_it(
    ctx: RuleContext, ev: OpEvent, *, divisor: bool = False
) -> tuple[str, str | None] | None:
    """Evidence that a softplus made the exact zeros ``ev`` read (a scale or std head whose
    F.softplus(raw) underflowed: exactly 0 for raw below log of half the smallest
    subnormal): from the op's own ``*_made_by`` scalars, the user's line (the operand is
    ``F.softplus(raw)`` or a name an earlier line assigned one), or, the line unknown, the
    loss graph (another event of the step whose zero operand a softplus made, or a
    softplus, no other op that saturates to 0, and a watched output of the log input's
    size below softplus's underflow bound). Returns (evidence, the statement that made it
    when known)."""
    for k, v in ev.scalars.items():
        if k.endswith("_made_by") and node_base(str(v).split("<")[0]) == "Softplus":
            return f"autograd node {str(v).split('<')[0]} (F.softplus) made the zeros", None
    found = None if divisor else _log_argument(ev)
    args = _divisors(ev.code) if divisor else [found[3]] if found is not None else []
    for written in args:
        arg = _unwrapped(written)
        if _is_softplus(arg):
            return f"{arg} is a softplus output", None
        if _NAME.fullmatch(arg):
            made = _assigned_before(ev.source, arg)
            rhs = made.split("=", 1)[1].strip() if made else ""
            if made is not None and _is_softplus(rhs):
                return f"{arg} was made by {made}", made
    if ev.code or ev.path != LOSS_PATH:
        return None
    for n in ctx.notes("loss_graph"):
        ops = n.data.get("ops")
        if not isinstance(ops, list) or "softplus" not in ops:
            continue
        named = any(
            k.endswith("_made_by") and node_base(str(v).split("<")[0]) == "Softplus"
            for o in ctx.trace.ops
            for k, v in o.scalars.items()
        )
        if named:
            return "another op of this step divides by zeros a softplus made", None
        x = first_input(ev)
        low = x is not None and any(
            r.role.startswith("output")
            and r.stat is not None
            and r.stat.numel == x.numel
            and r.stat.min < _underflow_at(ev.dtype)
            # every value below the bound: softplus of it is 0 everywhere, so is the input
            and (r.stat.max >= _underflow_at(ev.dtype) or x.zeros == x.numel)
            for r in ctx.records(Phase.FORWARD)
        )
        # the log's argument is one the graph computed (a log in it), with a few exact
        # zeros: the softplus of an argument that a term not watched (w * dt) drove low
        few = (
            not divisor
            and "log" in ops
            and x is not None
            and x.zeros is not None
            and 0 < x.zeros < x.numel
            and x.min == 0
        )
        if (low or few) and not (_ZERO_MAKERS & set(ops)):
            return (
                "the loss graph computes a softplus, and no other op that saturates to exactly 0",
                None,
            )
    return None


def _softplus_head(
    ctx: RuleContext, ev: OpEvent, x: TensorStat, *, divisor: bool = False
) -> tuple[str, str, str]:
    """Evidence, explanation and fix for a softplus scale head that underflowed to 0."""
    dtype = ev.dtype or "float32"
    bound = _underflow_bound(dtype)
    found = _softplus_made_it(ctx, ev, divisor=divisor)
    assert found is not None
    said, made = found
    raw = [
        r
        for r in ctx.records(Phase.FORWARD)
        if r.role.startswith("output")
        and r.stat is not None
        and r.stat.numel == x.numel
        and math.isfinite(r.stat.max)
        and r.stat.max < _underflow_at(dtype)
        and x.zeros == x.numel
    ]
    evidence = f"{said}: F.softplus(raw) is exactly 0 for raw below {bound} in {dtype}"
    if raw and raw[0].stat is not None:
        evidence += (
            f"; {raw[0].path}'s output, of the same {count(x.numel, 'value')}, is at most "
            f"{fmt(raw[0].stat.max)}"
        )
    why = (
        f"Its input is a softplus output that underflowed to exactly 0: F.softplus(raw) = "
        f"log1p(exp(raw)), and exp(raw) is 0 in {dtype} for raw below {bound}, which a "
        "scale or std head's raw output reaches (a large negative bias, a diverging "
        "layer). Softplus keeps a scale positive only in exact arithmetic; a small constant "
        "added to it keeps it off 0 in every dtype, for the log and for any division by it."
    )
    lhs = made.split("=", 1)[0].strip() if made else "sigma"
    rhs = made.split("=", 1)[1].strip() if made else "F.softplus(raw)"
    fix = (
        f"{lhs} = {rhs} + 1e-6   # a scale/std: never exactly 0, F.softplus is 0 below "
        f"{bound} in {dtype}"
        + ("" if made else "; raw the network's output")
        + "\n# not a clamp on the log or on the divisor alone: the scale itself is 0, fix it "
        "where it is made"
    )
    return evidence, why, fix


def _softplus_zero_use(ctx: RuleContext, ev: OpEvent, x: TensorStat) -> _LogUse | None:
    """The log's exact zeros were made by a softplus (a predicted scale) that underflowed."""
    if x.min < 0 or not has_zero(x) or _softplus_made_it(ctx, ev) is None:
        return None
    evidence, why, fix = _softplus_head(ctx, ev, x)
    exact = _log_softplus_line(ctx, ev)
    if exact is not None:
        fix += (
            f"\n{exact}   # or keep the softplus"
            + (" (z its argument)" if exact.startswith("log_rate = torch.where(z ") else "")
            + " as it is and take its log exactly: log "
            "softplus(z) = z + log1p(exp(z)) is z to within exp(z) below -20, where softplus "
            "is 0 or inexact"
        )
        why += (
            " Its log needs no floor at all: log softplus(z) is z itself (to within exp(z)) "
            "for z below -20, which torch.where selects without forming the 0."
        )
    return _LogUse("softplus-zero", fix=fix, why=why, evidence=evidence)


def _softplus_arg(expr: str) -> str | None:
    """``z`` of ``F.softplus(z)`` / ``z.softplus()`` (the call and nothing else)."""
    text = _unwrapped(expr)
    if not _is_softplus(text):
        return None
    m = _SOFTPLUS_RHS.match(text)
    assert m is not None
    return (m.group(1) or m.group(2)).strip()


def _log_softplus_line(ctx: RuleContext, ev: OpEvent) -> str | None:
    """The user's log of a softplus rewritten as the exact log-softplus, ``torch.where(z <
    -20, z, torch.log(F.softplus(z.clamp_min(-20))))`` (the clamp keeps the branch where
    does not take finite, so its gradient is not 0 * inf); on the log's line when known,
    else a pattern in the softplus's names. None for a log other than the natural one."""
    if packet(ev.op).rstrip("_") != "log":
        return None
    found = _softplus_made_it(ctx, ev)
    made = found[1] if found is not None else None
    line = _log_argument(ev)
    if line is not None and any(
        re.search(rf"(?<![\w.]){re.escape(line[3])}(?![\w(])", d) for d in _divisors(ev.code)
    ):
        return None  # the line divides by it too (a scale): its log alone is not the fix
    z = _softplus_arg(made.split("=", 1)[1]) if made else None
    if z is None and line is not None:
        z = _softplus_arg(line[3])
    name = z or "z"
    p = paren(name)
    exact = f"torch.where({p} < -20, {name}, torch.log(F.softplus({p}.clamp_min(-20))))"
    if line is not None and z is not None:
        stmt, start, end, _ = line
        return f"{stmt[:start]}{exact}{stmt[end:]}"
    return f"log_rate = {exact}"


_EXP_ONLY = re.compile(r"(?<![\w.])(?:torch\.)?exp\(|\.exp\(\s*\)")
#: loss-graph ops through which an exp's value reaches a log unchanged in kind (products,
#: quotients, sums): log(Σ π·exp(-z²/2)/σ) is a log of an exp
_EXP_CARRIERS = frozenset(
    {
        "sum",
        "mul",
        "div",
        "add",
        "mean",
        "unsqueeze",
        "view",
        "expand",
        "squeeze",
        "clone",
        "to",
        "index",
        "select",
        "permute",
    }
)


def _calls_exp(path: str, text: str) -> bool:
    """``text`` computes an exp: it calls one, or calls a function defined at the top level
    of ``path`` whose body does."""
    import linecache

    if _EXP_ONLY.search(text):
        return True
    lines = linecache.getlines(path)
    for fname in re.findall(r"(?<![\w.])([A-Za-z_]\w*)\(", text):
        for i, line in enumerate(lines):
            if not re.match(rf"\s*def\s+{re.escape(fname)}\s*\(", line):
                continue
            indent = len(line) - len(line.lstrip())
            for body in lines[i + 1 : i + 60]:
                if body.strip() and len(body) - len(body.lstrip()) <= indent:
                    break
                if _EXP_ONLY.search(body):
                    return True
            break
    return False


def _exp_operand(expr: str) -> str | None:
    """``y`` of ``torch.exp(y)`` / ``y.exp()`` when ``expr`` is that one call; else None."""
    try:
        node = ast.parse(expr.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or node.keywords:
        return None
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    if name != "exp":
        return None
    if len(node.args) == 1 and (
        isinstance(f, ast.Name)
        or (isinstance(f, ast.Attribute) and ast.unparse(f.value) in ("torch", "math"))
    ):
        y = node.args[0]
    elif not node.args and isinstance(f, ast.Attribute):
        y = f.value
    else:
        return None
    return ast.get_source_segment(expr.strip(), y) or ast.unparse(y)


_SUM_DIM_KEYWORDS = frozenset({"dim", "keepdim"})


def _sum_exp_call(expr: str) -> tuple[str, str, str] | None:
    """``(fn, y, dims)`` when ``expr`` is a sum or a running sum of one exp (``torch.cumsum(
    torch.exp(y), 0)``, ``y.exp().sum(dim=1)``): ``fn`` the log-space call that replaces the
    log of it (``torch.logcumsumexp``, ``torch.logsumexp``) and ``dims`` its arguments after
    ``y``, in the user's words; None for any other expression."""
    text = expr.strip()
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return None
    name, f = node.func.attr, node.func
    if name not in ("sum", "cumsum") or any(k.arg not in _SUM_DIM_KEYWORDS for k in node.keywords):
        return None
    if isinstance(f.value, ast.Name) and f.value.id == "torch":
        if not node.args:
            return None
        summand, rest = node.args[0], [*node.args[1:], *node.keywords]
    else:
        summand, rest = f.value, [*node.args, *node.keywords]
    y = _exp_operand(ast.get_source_segment(text, summand) or ast.unparse(summand))
    if y is None:
        return None
    dims = ", ".join(ast.get_source_segment(text, a) or ast.unparse(a) for a in rest)
    if name == "cumsum":
        return ("torch.logcumsumexp", y, dims) if dims else None
    if not dims:  # a sum over every element: one dim after flattening
        return "torch.logsumexp", paren(y) + ".flatten()", "0"
    return "torch.logsumexp", y, dims


def _exp_chain_use(
    ctx: RuleContext, ev: OpEvent, x: TensorStat, *, backward: bool = False
) -> _LogUse | None:
    """The log's argument is made by an exp, directly or through products and sums (a
    density exp(-z²/2)/σ, a mixture Σ π·N(y)): its exact zeros are that exp underflowing,
    whatever its largest value (a density exceeds 1). Read from the line and the lines
    above it, else from the loss graph (log, then only products and sums, then exp)."""
    if x.min < 0 or not (has_zero(x) or backward):
        return None
    summed = product = False
    found = _log_argument(ev)
    if found is not None:
        _, _, _, arg = found
        path = (ev.source or "").rpartition(":")[0]
        hit = _calls_exp(path, arg)
        summed = "sum(" in arg
        if not hit:
            for name in dict.fromkeys(re.findall(r"(?<![\w.])([A-Za-z_]\w*)(?![\w(])", arg)):
                made = _assigned_before(ev.source, name)
                if made is not None and _calls_exp(path, made.split("=", 1)[1]):
                    hit = True
                    summed = summed or "sum(" in made
                    product = "*" in made.split("=", 1)[1]
                    break
        if not hit:
            return None
        said = f"the log's argument {arg} is made by exp() through products and sums"
        made = _assigned_before(ev.source, arg) if _NAME.fullmatch(arg) else None
        summed_exp = _sum_exp_call(made.split("=", 1)[1] if made is not None else arg)
        if summed_exp is not None:
            return _summed_exp_use(ev, found, summed_exp)
        terms = _weighted_exps(arg, ev.source)
        if terms is not None:
            return _weighted_exps_use(ev, found, terms)
        product = product or "*" in arg or (made is not None and "*" in made.split("=", 1)[1])
        inner = _exp_operand(arg)
        if inner is None and _NAME.fullmatch(arg):
            made = _assigned_before(ev.source, arg)
            inner = _exp_operand(made.split("=", 1)[1]) if made is not None else None
        if inner is not None:  # log(exp(y)) = y: the exp need not be formed at all
            stmt, start, end, _ = found
            bare = not stmt[end:].strip() and re.search(r"=\s*$", stmt[:start]) is not None
            direct = stmt[:start] + (inner if bare else paren(inner)) + stmt[end:]
            bound = _underflow_bound(ev.dtype or "float32")
            return _LogUse(
                "exp-underflow",
                fix=(
                    f"{direct}   # log(exp(y)) = y: never form the exp, which is 0 for y "
                    f"below {bound} in {ev.dtype or 'float32'}"
                ),
                why=(
                    f"Its input is exp({inner}), and exp(y) is exactly 0 for y below {bound} in "
                    f"{ev.dtype or 'float32'}: the log of that 0 is -inf, and its gradient "
                    "1/0 is inf. The log undoes the exp: log(exp(y)) = y exactly, so use the "
                    "exponent itself, which is finite everywhere and keeps its gradient."
                ),
                evidence=f"the log's argument {arg} is exp({inner}): log(exp(y)) = y, and "
                f"exp(y) = 0 for y below {bound} in {ev.dtype or 'float32'}",
            )
    elif (not ev.code and ev.path == LOSS_PATH) or (backward and ev.backward_at == ev.source):
        said = ""
        for ops in _graph_ops(ctx):
            logs = [i for i, o in enumerate(ops) if o == "log"]
            chains = []
            for i in logs:
                j = i + 1
                while j < len(ops) and (ops[j] in _EXP_CARRIERS or ops[j] == "cumsum"):
                    j += 1
                chains.append(ops[i + 1 : j] if j < len(ops) and ops[j] == "exp" else None)
            if logs and all(c is not None for c in chains):
                summed = any("sum" in (c or []) for c in chains)
                said = (
                    "the loss graph takes the log of an exp through products and sums ("
                    + " <- ".join(["log", *(chains[0] or []), "exp"])
                    + ")"
                )
                break
        if not said:
            return None
    else:
        return None
    dtype = ev.dtype or "float32"
    bound = _underflow_bound(dtype)
    tiny_log = _log_tiny(dtype, ev.op)
    for chain, fn in (("cumsum", "logcumsumexp"), ("sum", "logsumexp")):
        if said.endswith(f"(log <- {chain} <- exp)"):  # log(sum(exp(a))): one call
            return _LogUse(
                "exp-underflow",
                fix=(
                    f"# torch.log(torch.{chain}(torch.exp(a), dim)) is torch.{fn}(a, dim): "
                    f"use it where the loss takes this log; each exp is 0 for a below {bound} "
                    f"in {dtype}"
                ),
                why=(
                    f"Its input is a {chain} of exp(a), and exp(a) is exactly 0 for a below "
                    f"{bound} in {dtype}: where every exponent summed is that low the "
                    f"{chain} is 0 and its log is -inf; the gradient through it is NaN. "
                    f"torch.{fn}(a, dim) computes the same log by shifting by the largest "
                    "exponent first: finite for any finite input, with its gradient."
                ),
                evidence=f"{said}: exp(a) = 0 for a below {bound} in {dtype}",
            )
    if said.endswith("(log <- exp)"):  # the log of the exp itself: log(exp(y)) = y
        return _LogUse(
            "exp-underflow",
            fix=(
                "# torch.log(torch.exp(y)) is y: use the exponent y itself where the loss "
                f"takes this log; the exp is 0 for y below {bound} in {dtype}"
            ),
            why=(
                f"Its input is exp(y), and exp(y) is exactly 0 for y below {bound} in "
                f"{dtype}: the log of that 0 is -inf. The log undoes the exp: log(exp(y)) = y "
                "exactly, so use the exponent itself, finite everywhere and with its gradient."
            ),
            evidence=f"{said}: log(exp(y)) = y, and exp(y) = 0 for y below {bound} in {dtype}",
        )
    why = (
        f"Its input is made by exp(), directly or through products and sums (a density "
        f"exp(-0.5·z²)/σ, a mixture Σ π·N(y)), and exp(a) is exactly 0 for a below {bound} "
        f"in {dtype}: -0.5·z² gets there for a point about "
        f"{fmt(math.sqrt(-2 * _underflow_at(dtype)))} standard deviations from every component. "
        "That 0 is an underflow even where other values exceed 1: a density can. Compute "
        "the log in log space, never forming the exp; a floor gives "
        f"{tiny_log}, finite but wrong, with no gradient toward the far point."
    )
    if summed and found is not None and not product:  # a sum of exps, not spelled as one
        fix = (
            f"# log of a sum of exps: torch.logsumexp(a, dim) for log(torch.sum(torch.exp(a), "
            "dim)), torch.logcumsumexp(a, dim) for a running sum: never form the exp, which is "
            f"0 for a below {bound} in {dtype}"
        )
    elif summed:
        fix = (
            "log_lik = torch.logsumexp(torch.log(pi) + torch.distributions.Normal(mu, sigma)"
            ".log_prob(y), dim=1)   # log Σ π·N(y | mu, sigma) in log space: pi the mixture "
            "weights (F.log_softmax of their logits is better still), dim the component dim\n"
            "# not torch.log(torch.sum(pi * density, 1)): each density's exp is 0 for a far "
            "point"
        )
    else:
        fix = (
            "log_p = torch.log(c) + a   # log(c · exp(a)) in log space, a the exponent; for a "
            "Gaussian density: torch.distributions.Normal(mu, sigma).log_prob(y)\n"
            "# not torch.log(c * torch.exp(a)): exp(a) is 0 for a below "
            f"{bound} in {dtype}"
        )
    return _LogUse(
        "exp-underflow",
        fix=fix,
        why=why,
        evidence=f"{said}: exp(a) = 0 for a below {bound} in {dtype}",
    )


def _weighted_exps(arg: str, source: str | None) -> list[tuple[str | None, str]] | None:
    """``[(c, y), ...]`` when ``arg`` is a sum of two or more exps, each maybe times a
    weight (``pi * torch.exp(a) + (1 - pi) * p2`` with ``p2 = torch.exp(b)`` above):
    ``c`` the weight's text (None for none), ``y`` the exponent; else None."""
    try:
        node = ast.parse(arg.strip(), mode="eval").body
    except SyntaxError:
        return None
    text = arg.strip()
    summands = operands(node, ast.Add)
    if len(summands) < 2:
        return None

    def exponent(n: ast.expr) -> str | None:
        seg = ast.get_source_segment(text, n) or ast.unparse(n)
        y = _exp_operand(seg)
        if y is None and isinstance(n, ast.Name):
            made = _assigned_before(source, n.id)
            y = _exp_operand(made.split("=", 1)[1]) if made is not None else None
        return y

    terms: list[tuple[str | None, str]] = []
    for n in summands:
        y = exponent(n)
        if y is not None:
            terms.append((None, y))
            continue
        if not isinstance(n, ast.BinOp) or not isinstance(n.op, ast.Mult):
            return None
        for e, c in ((n.right, n.left), (n.left, n.right)):
            y = exponent(e)
            if y is not None:
                terms.append((ast.get_source_segment(text, c) or ast.unparse(c), y))
                break
        else:
            return None
    return terms


def _weighted_exps_use(
    ev: OpEvent, found: tuple[str, int, int, str], terms: list[tuple[str | None, str]]
) -> _LogUse:
    """The log of a weighted sum of exps (a mixture of densities): logsumexp of the
    exponents plus the log weights, stacked."""
    stmt, start, end, arg = found
    dtype = ev.dtype or "float32"
    bound = _underflow_bound(dtype)
    parts = [y if c is None else f"{y} + math.log({c})" for c, y in terms]
    call = f"torch.logsumexp(torch.stack([{', '.join(parts)}]), 0)"
    weighted = any(c is not None for c, _ in terms)
    return _LogUse(
        "exp-underflow",
        fix=(
            f"{stmt[:start]}{call}{stmt[end:]}   # log of a sum of exps in log space"
            + ("; torch.log(c) for a weight c that is a tensor" if weighted else "")
            + f"\n# not torch.log({arg}): each exp is 0 (or subnormal) for exponents below "
            f"{bound} in {dtype}"
        ),
        why=(
            f"Its input is a sum of exps ({', '.join(f'exp({y})' for _, y in terms)}). "
            f"Where every exponent is far below 0 each exp is subnormal or exactly 0 in "
            f"{dtype}: the log is then -inf, or finite with a gradient 1/x that overflows. "
            "torch.logsumexp of the exponents (plus the log weights) computes the same log "
            "by shifting by the largest exponent first: finite for any finite input, with "
            "its gradient."
        ),
        evidence=f"the log's argument {arg} is a sum of exps: exp(a) is 0 or subnormal for a "
        f"far below 0 in {dtype}",
    )


def _summed_exp_use(
    ev: OpEvent, found: tuple[str, int, int, str], summed_exp: tuple[str, str, str]
) -> _LogUse:
    """The log of a sum (or a running sum) of one exp: every exp underflowed to 0 where the
    exponents sit far below 0, and logsumexp / logcumsumexp compute the same log without
    forming the exps."""
    fn, y, dims = summed_exp
    stmt, start, end, arg = found
    dtype = ev.dtype or "float32"
    bound = _underflow_bound(dtype)
    call = f"{fn}({y}, {dims})"
    running = fn.endswith("logcumsumexp")
    what = "a running sum (cumsum)" if running else "a sum"
    return _LogUse(
        "exp-underflow",
        fix=(
            f"{stmt[:start]}{call}{stmt[end:]}   # log of {what} of exp in log space: "
            f"exp({y}) is 0 for values below {bound} in {dtype}"
        ),
        why=(
            f"Its input is {what} of exp({y}). exp(a) is exactly 0 for a below {bound} in "
            f"{dtype}, so where every exponent summed is that low the sum is 0 and its "
            f"log is -inf; the gradient through it is NaN. {fn}({y}, {dims}) computes the "
            "same log by shifting by the largest exponent first: finite for any finite "
            "input, with its gradient."
        ),
        evidence=f"the log's argument {arg} is {what} of exp({y}): exp(a) = 0 for a below "
        f"{bound} in {dtype}",
    )


def _divided_too_use(ev: OpEvent, x: TensorStat) -> _LogUse | None:
    """The log's argument is also a divisor on the same line (``f(log(s)) / s``, a noise
    level, a scale): a floor on the log alone leaves x / 0 = inf there. The value must be
    kept above 0 where it is made."""
    if x.min < 0 or not has_zero(x):
        return None
    found = _log_argument(ev)
    if found is None:
        return None
    stmt, _, _, arg = found
    if arg not in {d.strip().strip("()").strip() for d in _divisors(stmt)}:
        return None
    return _LogUse(
        "divided-too",
        fix=(
            f"# {arg} must be > 0 where it is made: this line takes its log and divides by it, "
            f"so a floor on the log alone leaves x / {arg} = inf\n"
            f"# a noise level from a schedule: start the schedule at a sigma_min > 0 "
            "(torch.linspace(sigma_max, sigma_min, n), not down to 0)\n"
            f"# a predicted scale: F.softplus(raw) + 1e-6, never exactly 0"
        ),
        why=(
            f"Its input {arg} holds {_zeros_text(x, 'log')}, and the same line divides by "
            f"{arg}: both the log (-inf) and the quotient (inf) need {arg} > 0. A noise level "
            "or scale of exactly 0 (a schedule that runs down to 0, a scale head that "
            f"collapsed) is the bug; keep {arg} above 0 where it is made, not only inside "
            "the log."
        ),
        evidence=f"{arg} is both the log's argument and a divisor on this line: a 0 makes "
        "-inf and inf",
    )


_DET = re.compile(r"^(?:torch\.(?:linalg\.)?det\((.+)\)|(.+)\.det\(\s*\))$")


def _det_use(ctx: RuleContext, ev: OpEvent) -> _LogUse | None:
    """A log of a determinant (``torch.log(torch.det(W))``, from the line, or log <-
    linalg_det in the loss graph or the op evidence): det is negative for an invertible
    matrix that flips orientation, so the log is NaN; log|det| is slogdet's."""
    why = (
        "Its input is a determinant. det(W) is negative for any invertible matrix that "
        "flips orientation (an orthogonal init from QR has det +1 or -1), so log(det W) is "
        "NaN for a perfectly valid W, and -inf for a singular one. A change of variables "
        "(a flow's log-likelihood) needs log|det W|: torch.linalg.slogdet returns it, with "
        "the sign apart, and without det's overflow for large matrices. A clamp at a tiny "
        f"value gives {_log_tiny(ev.dtype, ev.op)}: finite and wrong."
    )
    for stmt in statements(ev.code):
        for start, end, arg in _log_calls(stmt):
            m = _DET.match(arg)
            if m is None:
                continue
            w = (m.group(1) or m.group(2)).strip()
            own = f"{stmt[:start]}torch.linalg.slogdet({w}).logabsdet{stmt[end:]}"
            return _LogUse(
                "det",
                fix=(
                    f"{own}   # log|det {w}|: det < 0 is a valid invertible matrix\n"
                    f"# torch.linalg.slogdet({w}).sign is the sign, when it matters"
                ),
                why=why,
                evidence=f"the log's argument {arg} is a determinant: det < 0 for a matrix "
                "that flips orientation",
            )
    in_graph = any(
        isinstance(ops := n.data.get("ops"), list)
        and any(ops[i : i + 2] in (["log", "linalgdet"], ["log", "det"]) for i in range(len(ops)))
        for n in ctx.notes("loss_graph")
    )
    in_ops = not ev.code and any("linalg_det" in o.op for o in ctx.trace.ops)
    if not (in_graph or in_ops):
        return None
    return _LogUse(
        "det",
        fix=(
            "logdet = torch.linalg.slogdet(W).logabsdet   # not torch.log(torch.det(W)): "
            "W the matrix; det < 0 is a valid invertible matrix\n"
            '# mode="forensic" names your line, and nanwatch rewrites it'
        ),
        why=why,
        evidence="the autograd graph takes the log of a determinant (log <- linalg_det)",
    )


def _dist_value_use(ctx: RuleContext, ev: OpEvent, x: TensorStat | None) -> _LogUse | None:
    """xlogy(concentration - 1, value) inside a torch.distributions log_prob (Beta,
    Dirichlet, Gamma) with the VALUE on the edge of the support: exactly 0 (or 1, for
    Beta's 1 - value), where the density's log is ±inf. The parameters are fine."""
    if packet(ev.op) != "xlogy" or x is None or not has_zero(x):
        return None
    stmt = _log_prob_statement(ctx, ev)
    graph = not ev.code and any(
        isinstance(ops := n.data.get("ops"), list) and "xlogy" in ops and "lgamma" in ops
        for n in ctx.notes("loss_graph")
    )
    if stmt is None and not (_in_distribution(ev) or graph):
        return None
    call = re.search(r"\.log_prob\(([^()]+)\)", stmt or "")
    value = call.group(1).strip() if call else None
    made = re.search(r"(?<!\w)(\w+)\((?:[^()]|\([^()]*\))*\)\.log_prob\(", stmt or "")
    dist = made.group(1) if made else None
    unit = dist in ("Beta", "Dirichlet", "ContinuousBernoulli") or (dist is None and x.max <= 1)
    v = value or "y"
    eps = f"torch.finfo({paren(v)}.dtype).eps"
    clamp = f"{paren(v)}.clamp({eps}, 1 - {eps})" if unit else f"{paren(v)}.clamp_min({eps})"
    support = "(0, 1)" if unit else "(0, inf)"
    if stmt is not None and value is not None and call is not None:
        fix = f"{stmt[: call.start(1)]}{clamp}{stmt[call.end(1) :]}   # a value inside {support}"
    else:
        fix = (
            f"y = {clamp}   # y: the value passed to log_prob; keep it inside {support}\n"
            '# mode="forensic" names your line, and nanwatch rewrites it'
        )
    if unit:
        fix += "\n# or shrink fractions k/n into (0, 1): (k + 0.5) / (n + 1)"
    name = f"{dist}.log_prob" if dist else "log_prob"
    return _LogUse(
        "dist-value",
        fix=fix,
        why=(
            f"The log is inside {name}, which computes xlogy(concentration - 1, value): the "
            f"value passed to log_prob sits exactly on the edge of the support {support}, "
            "where the log-density is ±inf (the support check accepts the edge). The "
            "parameters are fine and no probability underflowed; a target that is exactly "
            "0 or 1 (a fraction k/n with k = 0 or k = n, a clipped label) is the bad operand: "
            "keep it inside the open interval."
        ),
        evidence=(
            f"the value given to {name}"
            + (f" ({value})" if value else "")
            + f" sits on the edge of the support {support}: xlogy's log operand holds "
            f"{_zeros_text(x, 'log')} (min {fmt(x.min)}, max {fmt(x.max)})"
        ),
    )


#: autograd nodes (lower-case, as ``made_from`` names them) that move or copy values
_MOVES = frozenset(
    {"squeeze", "unsqueeze", "view", "unsafeview", "reshape", "expand", "select", "slice"}
    | {"clone", "tocopy", "t", "transpose", "permute", "leaf"}
)


def _xlogy_model_operand_use(ctx: RuleContext, ev: OpEvent, x: TensorStat | None) -> _LogUse | None:
    """xlogy(a, b) = a·log(b) whose log operand ``b`` holds exact zeros and was computed by
    the model (it has an autograd history: ``other_made_from``), not given as data: a
    distribution's parameter at 0 (Poisson's log_prob is ``value.xlogy(rate)``, Gamma's
    ``xlogy(concentration, rate)``), -inf wherever ``a`` > 0. A value on the edge of the
    support (Beta's ``xlogy(concentration - 1, value)``, data) is :func:`_dist_value_use`'s."""
    made = ev.scalars.get("other_made_from")
    if packet(ev.op) != "xlogy" or x is None or not has_zero(x) or not isinstance(made, str):
        return None
    factor = dict(ev.inputs).get("self")
    if factor is not None and factor.min == 0 == factor.max:
        return None  # 0 · log(0) = 0: its infinity is not this product's
    stmt = _log_prob_statement(ctx, ev) or ""
    ctor = re.search(r"(?<!\w)(\w+)\(([^()]*)\)\.log_prob\(", stmt)
    dist = ctor.group(1) if ctor else None
    if dist in ("Beta", "Dirichlet"):
        return None  # their xlogy's log operand is the value: _dist_value_use's
    args = [t.strip() for t in ctor.group(2).split(",")] if ctor else []
    arg = next((t for t in args if t and "=" not in t), "") if len(args) == 1 else ""
    where = f"{dist}.log_prob" if dist else "log_prob"
    chain = [c for c in made.split("<") if c not in _MOVES]
    relu = bool(chain) and chain[0] in ("relu", "threshold", "clamp", "clampmin", "hardtanh")
    if not (dist or _in_distribution(ev) or relu or made == "leaf"):
        return None  # a softmax or an exp that underflowed: the log-space stories say it
    param = arg or "rate"
    source = (
        "a parameter"
        if made == "leaf"
        else f"made by {' <- '.join(chain[:3]) or made.split('<')[0]}"
    )
    relu_words = (
        " A relu (or a clamp at 0) is exactly 0 for every negative input, so a positive "
        "quantity made by it is 0 about half the time at initialization."
        if relu
        else ""
    )
    fix = (
        f"{param} = F.softplus(raw) + 1e-6   # raw: the layer output that made {param}"
        + (" (before the relu)" if relu else "")
        + "; never exactly 0\n"
        f"# or predict its log: {param} = log_{param}.exp()"
        + (
            f", or for counts F.poisson_nll_loss(log_{param}, y, log_input=True)"
            if dist in (None, "Poisson")
            else ""
        )
        + f"\n# not a clamp of the target: {where} takes the log of the {param}, not of the value"
    )
    return _LogUse(
        "dist-parameter",
        fix=fix,
        why=(
            f"The log is an xlogy(a, b) = a·log(b){f' inside {where}' if dist else ''} whose "
            f"log operand b is a value the model computed ({source}), not the data: "
            f"it holds {_zeros_text(x, 'log')}, and a·log(0) is -inf wherever a > 0 (a "
            f"Poisson rate of exactly 0 for an observed count above 0; the support check "
            f"accepts a rate of 0).{relu_words} Make it positive by construction where it is "
            "made; the value passed to log_prob is not the bad operand."
        ),
        evidence=(
            "xlogy's log operand"
            + (f" ({param})" if arg else "")
            + f" is the model's, {source}: it holds {_zeros_text(x, 'log')} "
            f"(min {fmt(x.min)}, max {fmt(x.max)})"
            + (f"; its factor reaches {fmt(factor.max)}" if factor is not None else "")
        ),
    )


def _log_prob_statement(ctx: RuleContext, ev: OpEvent) -> str | None:
    """The user's statement that calls ``.log_prob(``: the op's line, else (loss code,
    graph only) the statement that assigned the tensor ``.backward()`` was called on."""
    for stmt in statements(ev.code):
        if ".log_prob(" in stmt:
            return stmt
    if ev.code or ev.path != LOSS_PATH:
        return None
    for n in ctx.notes("loss_graph"):
        line = full_statement(n.source) or ""
        m = re.search(r"(?<![\w.])([A-Za-z_]\w*)\.backward\(", line)
        made = _assigned_before(n.source, m.group(1)) if m else None
        if made and ".log_prob(" in made:
            return made
    return None


def _complex_log(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, trigger: OpEvent, x: TensorStat | None
) -> Diagnosis:
    """log of a complex tensor holding exact zeros: log(0) = -inf+0j. nanwatch measures a
    complex tensor by |z|, so the -inf reads as +inf (|log 0| = inf). A complex tensor has
    no clamp_min: its zeros are replaced (torch.where), not clamped."""
    op = short_op(ev.op)
    evidence = [
        f"{op} of a complex 0 is -inf+0j: its input holds {_zeros_text(x, 'log')} "
        "(nanwatch measures complex tensors by |z|, so it reports |log(0)| = +inf)",
        f"input |z| ({ev.dtype}): {describe_stat(x)}",
        *_chain_evidence(ev, trigger, "-inf"),
    ]
    lost = lost_eps(ev.code, ev.dtype, "log", zeros=True)
    if lost is not None:
        evidence.insert(1, lost.words(f"the input of {op}"))

    args: list[str] = []

    def nonzero(e: str) -> str:
        z = paren(e)
        args.append(z)
        return f"torch.where({z} == 0, torch.finfo({z}.dtype).eps, {z})"

    own = rewrite_call(ev.code, ["log", "log2", "log10"], nonzero)
    z = args[0] if own is not None and args else "z"
    fix = (
        f"{lost.line}   # {lost.text} is 0 here: a positive eps keeps every bin off 0"
        if lost is not None
        else f"{own}   # a complex 0 becomes eps + 0j: its log is finite"
        if own is not None
        else f"logz = torch.log({nonzero(z)})   # z: the complex tensor"
    )
    fix += (
        f"\n# a complex tensor has no clamp_min; a real log-magnitude: "
        f"torch.log({z}.abs().clamp_min(1e-5))"
    )
    return ctx.diagnosis(
        **op_fields(ev, a),
        evidence=evidence,
        explanation=(
            "The complex log is log|z| + i·arg(z): at z = 0, log|z| = -inf. An exactly zero "
            "spectrum bin (a silent frame, digital silence, a zero-padded or masked signal) "
            "makes it, and the next op (an inverse FFT, a sum, a product) turns it into "
            "NaN. Replace the exact zeros before the log: a complex tensor cannot be "
            "clamped."
        ),
        fix=fix,
    )


def _sigmoid_difference_use(what: str, zeros: str, dtype: str) -> _LogUse:
    """The log of ``sigmoid(a) - sigmoid(b)`` (a discretized logistic's bin, an ordinal
    model's class between two cut points) that is 0 where both sigmoids rounded to the same
    value: the same log in a form that never subtracts them."""
    lim = dtype_limits(dtype) or dtype_limits("float32")
    assert lim is not None
    edge = -math.log(lim.eps / 2)  # sigmoid(x) rounds to 1 above it
    return _LogUse(
        "sigmoid-difference",
        fix=(
            "log_p = F.logsigmoid(a) + F.logsigmoid(-b) + torch.log(-torch.expm1(b - a))   "
            "# = log(sigmoid(a) - sigmoid(b)) for a > b, finite where both sigmoids round to 1\n"
            f"# or a floor, where a 0 may stand: torch.log({what if what.isidentifier() else 'd'}"
            ".clamp_min(1e-12))"
        ),
        why=(
            f"Its input is a difference of sigmoids, sigmoid(a) - sigmoid(b) (the loss graph "
            f"takes the log of a sub of a sigmoid), with {zeros}: in {dtype} sigmoid(x) "
            f"rounds to exactly 1 for x above {fmt(edge)}, so two cut points both above it give "
            "0, and its log is -inf "
            "although the mass between them is not 0. That is the bin of a discretized "
            "logistic likelihood or the class of a cumulative (ordinal) model far from its "
            "center; written without subtracting the sigmoids it stays exact."
        ),
        evidence="the loss graph takes the log of a difference of sigmoids (log <- sub <- "
        f"sigmoid): sigmoid(x) rounds to 1 for x > {fmt(edge)} in {dtype}",
        title="Log of a difference of sigmoids that rounded to 0",
    )


@dataclass(frozen=True)
class _LogUse:
    """What the log was taken of, from the user's line (``p * torch.log(p)``, ``torch.log(1
    - p)``, ``torch.log(torch.softmax(z, -1))``) or from the autograd node that made the
    module's input (a softmax, a sigmoid), and the fix that suits it."""

    kind: str  #: ``entropy``, ``one-minus``, ``bce``, ``sigmoid``, ``softmax``
    fix: str
    why: str = ""
    evidence: str = ""
    #: the diagnosis's title, when the use says more than the rule's own
    title: str = ""


_LOG_CALL = re.compile(r"(?<![\w.])torch\.(log(?:2|10)?)\(|\.(log(?:2|10)?)\(\s*\)")


def _log_calls(stmt: str) -> list[tuple[int, int, str]]:
    """Each ``torch.log(a)`` / ``a.log()`` of a statement: (start, end, the argument a)."""
    out: list[tuple[int, int, str]] = []
    for m in _LOG_CALL.finditer(stmt):
        if m.group(1) is not None:
            close = _closing(stmt, m.end())
            if close is not None:
                out.append((m.start(), close + 1, stmt[m.end() : close].strip()))
            continue
        begin = postfix_start(stmt, m.start() - 1)
        if begin is None:
            continue
        recv = stmt[begin : m.start()]
        if recv.startswith("(") and _closing(stmt, begin + 1) == m.start() - 1:
            recv = recv[1:-1]
        out.append((begin, m.end(), recv.strip()))
    return out


def _closing(text: str, start: int) -> int | None:
    depth = 1
    for i in range(start, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return None


_SIGMOID = re.compile(
    r"^(?:(?:torch|F|torch\.nn\.functional)\.sigmoid\((.+)\)|(.+)\.sigmoid\(\s*\))$"
)
_SOFTMAX = re.compile(
    r"^(?:(?:torch|F|torch\.nn\.functional)\.softmax\((.+)\)|(.+)\.softmax\((.*)\))$"
)


def _tiny(p: str) -> str:
    return f"torch.finfo({paren(p)}.dtype).tiny"


def _log_of_activation(code: str | None, eps: str) -> tuple[str, str, str] | None:
    """A log of a softmax or sigmoid plus ``eps`` on the user's line
    (``torch.log(torch.softmax(z, -1) + 1e-8)``): the activation's name, the log-space
    function that replaces both, and the statement with it (``F.log_softmax(z, -1)``);
    None when the log's argument is anything else."""
    for stmt in statements(code):
        for start, end, arg in _log_calls(stmt):
            rest = _without_term(arg, eps)
            if rest is None:
                continue
            sig, soft = _SIGMOID.match(rest), _SOFTMAX.match(rest)
            if sig is not None and _one_call(rest):
                inner = f"F.logsigmoid({sig.group(1) or sig.group(2)})"
                kind, fn = "sigmoid", "F.logsigmoid"
            elif soft is not None and _one_call(rest):
                inner = (
                    f"F.log_softmax({soft.group(1)})"
                    if soft.group(1) is not None
                    else f"{soft.group(2)}.log_softmax({soft.group(3)})"
                )
                kind, fn = "softmax", "F.log_softmax"
            else:
                continue
            return kind, fn, f"{stmt[:start]}{inner}{stmt[end:]}"
    return None


def _without_term(expr: str, term: str) -> str | None:
    """``expr`` without ``term`` added at its top level (``a + 1e-8`` -> ``a``); None when
    ``term`` is not one of its two operands."""
    try:
        tree = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.BinOp) or not isinstance(tree.op, ast.Add):
        return None
    left, right = ast.get_source_segment(expr, tree.left), ast.get_source_segment(expr, tree.right)
    if right is not None and right.strip() == term:
        return left.strip() if left is not None else None
    if left is not None and left.strip() == term:
        return right.strip() if right is not None else None
    return None


def _one_call(expr: str) -> bool:
    """``expr`` is one call whose argument list closes at its end (``f(a)``, not
    ``f(a) * g(b)``)."""
    try:
        tree = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return False
    return isinstance(tree, ast.Call) and ast.get_source_segment(expr, tree) == expr


_NAME = re.compile(r"[A-Za-z_][\w.]*")


def _param_values_match(ctx: RuleContext, qual: str, x: TensorStat) -> bool:
    """Whether the watched parameter ``qual``'s recorded values are those of ``x`` (a log's
    input whose line is unknown): its latest value record's largest magnitude equals
    ``x``'s, and its min and max do where counted."""
    amax = max(abs(x.min), abs(x.max))
    for t in (ctx.trace, *reversed(ctx.history)):
        for r in t.records:
            if r.phase is Phase.PARAMETER and r.role == qual and r.stat is not None:
                s = r.stat
                if s.counted:
                    return s.min == x.min and s.max == x.max
                return max(abs(s.min), abs(s.max)) == amax
    return False


def _log_of_param(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, x: TensorStat | None
) -> _LogUse | None:
    """A log taken of a watched parameter that must stay positive (``torch.log(model.sigma)``
    of an uncertainty weight, a scale, a temperature) which an update pushed to 0 or below:
    named from the line, or, the line unknown, as the only watched parameter of the log
    input's size in loss code. The fix trains it unconstrained and maps it positive."""
    if x is None or x.min > 0:
        return None
    params = watched_params((ctx.trace, *reversed(ctx.history)))
    expr: str | None = None
    stmt = ""
    for st in statements(ev.code):
        args = [arg for _, _, arg in _log_calls(st)]
        if len(args) == 1:
            stmt, expr = st, args[0]
            break
    qual: str | None = None
    if expr is not None:
        qual = param_named(params, expr) if _NAME.fullmatch(expr) else None
    elif not ev.code and (ev.path or a.path) == LOSS_PATH:
        hits = [q for q, n in params.items() if n == x.numel]
        outputs = {r.stat.numel for r in first_root_outputs(ctx.trace) if r.stat is not None}
        # a size alone proves nothing (a sigmoid output of 8 values is no bias of 8 values):
        # values below 0 (no probability, no activation that saturated to 0) or the
        # parameter's own recorded values must say so too
        said = x.min < 0 or _param_values_match(ctx, hits[0], x) if hits else False
        if len(hits) == 1 and x.numel not in outputs and said:
            qual = hits[0]
    if qual is None:
        return None
    ref = expr or module_ref(qual)
    how = (
        f"the log's input {ref} is the parameter {qual}"
        if expr
        else f"the log's {count(x.numel, 'value')} match the parameter {qual}, the only watched "
        f"parameter of {count(x.numel, 'value')}"
    )
    where = "to 0" if x.min == 0 else f"below 0 (min {fmt(x.min)})"
    evidence = f"{how}: an optimizer update pushed it {where}"
    grad = last_gradient(tuple(reversed(ctx.history)), qual)
    held = group_holding((*ctx.history, ctx.trace), qual)
    if grad is not None and held is not None:
        opt, group, lr = held
        size = grad.norm if grad.norm is not None else grad.magnitude
        evidence += (
            f"; its last gradient had norm {fmt(size)}, and {opt} lr {fmt(lr)} (param group "
            f"{group})"
            + (f": lr × gradient norm = {fmt(lr * size)} in one step" if opt == "SGD" else "")
        )
    fix = _positive_param_fix(
        qual, ref, stmt, x.numel, eps=" + 1e-6", finite=lambda pos: f"torch.log({pos})"
    )
    return _LogUse(
        "param",
        fix=fix,
        why=(
            "Its input is a parameter trained as it is, one that must stay positive (a "
            "standard deviation or uncertainty weight, a scale, a temperature). Nothing keeps "
            "it above 0: one update larger than its value takes it to 0 or below, where the "
            "log is -inf or NaN. This is not a probability that underflowed. Train an "
            "unconstrained parameter and map it to a positive value (softplus, or exp of a "
            "log-parameter)."
        ),
        evidence=evidence,
    )


def _log_expanded(node: ast.expr, log: str, top: bool = True) -> str | None:
    """``log`` of ``node`` with the logarithm's identities applied, in the user's names:
    log(a ** n) = n * log(a), log(exp(z)) = z (natural log only), log(a * b) = log(a) +
    log(b), log(a / b) = log(a) - log(b). None when no power or exp is there to take apart
    (a plain product is left to the other rules).

    >>> _log_expanded(ast.parse("gamma ** dist", mode="eval").body, "log")
    'dist * torch.log(gamma)'
    >>> _log_expanded(ast.parse("torch.exp(-z) * w", mode="eval").body, "log")
    '-z + torch.log(w)'
    >>> _log_expanded(ast.parse("2 * math.pi * s * torch.sqrt(v)", mode="eval").body, "log")
    >>> _log_expanded(ast.parse("2 * math.pi * s ** 2", mode="eval").body, "log")
    'math.log(2 * math.pi) + 2 * torch.log(s)'
    """
    if top and not _holds_power_or_exp(node, log):
        return None
    value = _numeric_value(node)
    if value is not None and value > 0:  # numbers only: torch.log takes no Python number
        text = ast.unparse(node)
        fn = {"log": "math.log", "log2": "math.log2", "log10": "math.log10"}.get(log)
        if fn is not None and "math." in text:  # the line imports math already
            return f"{fn}({text})"
        return repr(getattr(math, log, math.log)(value))
    powered = _operands_of(node, "pow")
    exped = _operands_of(node, "exp") if log == "log" else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, n = node.left, node.right
    elif powered is not None:
        if len(powered) != 2:
            return None
        base, n = powered
    elif exped is not None:
        return ast.unparse(exped[0]) if len(exped) == 1 else None
    elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
        left = _log_expanded(node.left, log, top=False)
        right = _log_expanded(node.right, log, top=False)
        if top and left is None and right is None:
            return None
        lt = left if left is not None else f"torch.{log}({ast.unparse(node.left)})"
        rt = right if right is not None else f"torch.{log}({ast.unparse(node.right)})"
        if isinstance(node.op, ast.Div):
            return f"{lt} - ({rt})" if right is not None else f"{lt} - {rt}"
        return f"{lt} + {rt}"
    else:
        return None
    inner = _log_expanded(base, log, top=False)
    lb = f"({inner})" if inner is not None else f"torch.{log}({ast.unparse(base)})"
    exp = ast.unparse(n)
    if not isinstance(n, (ast.Name, ast.Constant, ast.Attribute, ast.Subscript, ast.Call)):
        exp = f"({exp})"
    return f"{exp} * {lb}"


def _operands_of(node: ast.expr, name: str) -> list[ast.expr] | None:
    """The operands of a call of ``name`` written as a function or a method, without
    keywords: ``[a, n]`` for ``torch.pow(a, n)`` and ``a.pow(n)``; None for anything else."""
    if (
        not isinstance(node, ast.Call)
        or not isinstance(node.func, ast.Attribute)
        or node.func.attr != name
        or node.keywords
    ):
        return None
    on_torch = isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
    return list(node.args) if on_torch else [node.func.value, *node.args]


def _holds_power_or_exp(node: ast.expr, log: str) -> bool:
    """``node`` is a product or quotient with a power or (for the natural log) an exp in
    it: what :func:`_log_expanded` takes apart."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr == "pow" or (log == "log" and node.func.attr == "exp")
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
        return _holds_power_or_exp(node.left, log) or _holds_power_or_exp(node.right, log)
    return False


_MATH_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau}


def _numeric_value(node: ast.expr) -> float | None:
    """The value of a product, quotient or power of numbers and ``math.pi`` / ``math.e`` /
    ``math.tau`` (``2 * math.pi``); None for anything that holds a name."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return float(node.value) if not isinstance(node.value, bool) else None
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "math"
        and node.attr in _MATH_CONSTANTS
    ):
        return _MATH_CONSTANTS[node.attr]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div, ast.Pow)):
        a, b = _numeric_value(node.left), _numeric_value(node.right)
        if a is None or b is None:
            return None
        try:
            if isinstance(node.op, ast.Mult):
                return a * b
            if isinstance(node.op, ast.Div):
                return a / b if b else None
            return float(a**b)
        except (OverflowError, ZeroDivisionError, TypeError, ValueError):
            return None
    return None


def _log_identity_use(stmt: str, calls: list[tuple[int, int, str]], dtype: str) -> _LogUse | None:
    """A log of a power, an exp, or a product of them (``torch.log(gamma ** dist)``): the
    power underflows to 0 (0.5 ** 150 in float32) and log(0) = -inf, while the identity
    ``dist * torch.log(gamma)`` is exact and forms no 0 -- nor a NaN gradient."""
    for start, end, arg in calls:
        try:
            node = ast.parse(arg.strip(), mode="eval").body
        except SyntaxError:
            continue
        log = _log_name(stmt[start:end]) or "log"
        new = _log_expanded(node, log)
        if new is None:
            continue
        whole = (
            re.fullmatch(r"\s*(?:return\s+|[\w.\[\], ]+=\s*)?", stmt[:start])
            and not stmt[end:].strip()
        )
        line = f"{stmt[:start]}{new if whole else f'({new})'}{stmt[end:]}"
        lim = limits(dtype) or limits("float32")
        tiny = f" (below {fmt(lim.tiny)} in {dtype})" if lim is not None else ""
        return _LogUse(
            "identity",
            f"{line}   # was: {stmt}\n"
            f"# the log of a power or an exp, taken apart: exact, and the value whose log is "
            f"taken never underflows to 0",
            why=(
                f"Here the log is taken of {arg}: a power (or exp) of many factors underflows, "
                f"past the dtype's smallest normal number{tiny} and its subnormals, to exactly "
                "0, "
                "and log(0) = -inf; its gradient 1/x is then inf, or NaN (0/0) where the "
                "incoming gradient is 0. The logarithm's identities (log(a ** n) = n * log(a), "
                "log(exp(z)) = z, log(a * b) = log(a) + log(b)) give the same value without "
                "forming the tiny number."
            ),
        )
    return None


@dataclass(frozen=True)
class _Discarded:
    """A log on the user's line whose result an op of the same line discards in part
    (``torch.where(z > 0, torch.log(z), 0)``): what discards it, and the line rewritten so
    the discarded entries reach the log as a value it is finite at."""

    by: str  #: ``torch.where``, ``masked_fill``, ``the index``
    line: str


def _discarded_log(ev: OpEvent) -> _Discarded | None:
    """The log of ``ev`` (its backward made NaN) sits, on its line, inside a branch of a
    ``torch.where``, or is the receiver of a ``masked_fill`` or the value indexed: that op
    drops the log's -inf at 0 in forward, but its backward sends the dropped entries a 0
    gradient, and the log's backward divides it by 0. The rewrite passes the log's argument
    through the same selection with a safe value (the "double where"); None when the line
    shows none of these around the log."""
    if not ev.code:
        return None
    names = ["log"]  # its backward is LogBackward0's: the op may be named by its div
    guarded = _double_where(replace(ev, op="aten.log"), set())
    if guarded is not None:
        return _Discarded("torch.where", guarded)
    safe = _DOMAIN_SAFE["log"]
    for stmt in statements(ev.code):
        try:
            tree = ast.parse(stmt)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if getattr(node, "lineno", 0) != getattr(node, "end_lineno", -1):
                continue  # one line: the rewrite splices columns
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("masked_fill", "masked_fill_")
                and node.args
            ):
                # the log itself is filled (elementwise, so the mask fits its input too)
                arg = _domain_arg(node.func.value, names)
                mask = ast.get_source_segment(stmt, node.args[0])
                text = ast.get_source_segment(stmt, arg) if arg is not None else None
                if arg is None or mask is None or text is None or arg.end_col_offset is None:
                    continue
                inner = text if _NAME.fullmatch(text) else f"({text})"
                return _Discarded(
                    "masked_fill",
                    f"{stmt[: arg.col_offset]}{inner}.masked_fill({mask}, {safe})"
                    f"{stmt[arg.end_col_offset :]}",
                )
            if isinstance(node, ast.Subscript):  # torch.log(z)[z > 0]: log(z[z > 0])
                arg = _domain_arg(node.value, names)
                index = ast.get_source_segment(stmt, node.slice)
                text = ast.get_source_segment(stmt, arg) if arg is not None else None
                if arg is None or index is None or text is None:
                    continue
                log, end = node.value, node.value.end_col_offset
                if arg.end_col_offset is None or end is None or node.end_col_offset is None:
                    continue
                inner = text if _NAME.fullmatch(text) else f"({text})"
                return _Discarded(
                    "the index",
                    f"{stmt[: node.col_offset]}{stmt[log.col_offset : arg.col_offset]}"
                    f"{inner}[{index}]{stmt[arg.end_col_offset : end]}"
                    f"{stmt[node.end_col_offset :]}",
                )
    return None


def _discarded_use(d: _Discarded) -> _LogUse:
    """The fix for a log whose -inf the line's ``torch.where`` (``masked_fill``, index)
    discards, while its backward still divides by the 0: the line rewritten so the log never
    sees the discarded entries."""
    by = d.by
    if by == "the index":
        how = "index before the log: it never sees the entries the index drops"
        select = "Index the log's input instead, so that the log never sees the 0"
    else:
        how = (
            f"the entries {by} discards reach the log as {_DOMAIN_SAFE['log']}, not 0: "
            "their gradient is 0 / 1 = 0, not 0 / 0"
        )
        select = (
            "Select the log's input too, with a value the log is finite at, so that it "
            "never sees the 0"
        )
    return _LogUse(
        "discarded",
        fix=f"{d.line}   # {how}",
        why=(
            f"On its line, {by} keeps the log only where its input is valid, but the log "
            "is still computed everywhere: at 0 it is -inf, which the forward drops, and in "
            f"backward {by} gives the dropped entries a 0 gradient that the log's backward "
            f"divides by 0: 0 / 0 = NaN. {select} (a nan_to_num after the log does not "
            "reach the backward)."
        ),
        title=f"Log of zero discarded by {by}: NaN in its backward",
    )


def _log_use(ctx: RuleContext, a: Anomaly, ev: OpEvent) -> _LogUse | None:
    """The log's use, read from its line; else from the activation that made the input
    of the module the log ran in; None when neither says."""
    for stmt in statements(ev.code):
        calls = _log_calls(stmt)
        if not calls:
            continue
        identity = _log_identity_use(stmt, calls, ev.dtype)
        if identity is not None:
            return identity
        logit = _logit_by_hand(stmt, ev)
        if logit is not None:
            return logit
        for start, end, arg in calls:
            lse = _logsumexp_use(stmt, start, end, arg, ev.dtype)
            if lse is None and _NAME.fullmatch(arg):
                lse = _logsumexp_of_name(stmt, start, end, arg, ev)
            if lse is not None:
                return lse
        ratio = _xlogy_ratio_use(stmt, subtracted=_subtracted_log_zero(a, ev), ev=ev)
        if ratio is not None:
            return ratio
        for start, end, arg in calls:
            ent = _entropy_use(stmt, start, end, arg)
            if ent is not None:
                return ent
        args = [arg for _, _, arg in calls]
        flowed = _bce_by_flow(ctx, ev, stmt, args)
        if flowed is not None:
            return flowed
        for start, end, arg in calls:
            m = _ONE_MINUS.match(arg)
            sq = _tanh_of_square(m.group(1), ev.source) if m is not None else None
            if sq is not None:
                return _tanh_squash_use(stmt, start, end, arg, sq, dtype=ev.dtype, source=ev.source)
        # the line's distinct 1 - q logs: the op's input stats cannot say which one held
        # the 0, so each gets the floor
        qs = list(dict.fromkeys(m.group(1).strip() for a_ in args if (m := _ONE_MINUS.match(a_))))
        for _, _, arg in calls:
            m = _ONE_MINUS.match(arg) if flow_disagrees(ev, arg) is None else None
            if m is not None:
                return _one_minus_use(
                    stmt,
                    calls,
                    m.group(1).strip(),
                    others=tuple(qs[1:]),
                    bce=m.group(1).strip() in args,
                    source=ev.source,
                    low=x.min if (x := first_input(ev)) is not None else None,
                )
        for start, end, arg in calls:
            if flow_disagrees(ev, arg) is not None:
                continue  # the op ran on another call of the line
            sig = _SIGMOID.match(arg)
            if sig is not None:
                z = (sig.group(1) or sig.group(2)).strip()
                own = f"{stmt[:start]}F.logsigmoid({z}){stmt[end:]}"
                return _LogUse(
                    "sigmoid",
                    f"{own}   # log(sigmoid(z)) without forming the 0\n"
                    f"# or keep the sigmoid and floor it: "
                    f"{stmt[:start]}{_floor_text(arg, ev.dtype)}{stmt[end:]}",
                )
            soft = _SOFTMAX.match(arg)
            if soft is not None:
                inner = (
                    f"F.log_softmax({soft.group(1)})"
                    if soft.group(1) is not None
                    else f"{soft.group(2)}.log_softmax({soft.group(3)})"
                )
                filled = _fill_mask(soft.group(1), soft.group(2)) or _earlier_fill(ctx, ev)
                if filled is not None:  # log(softmax(z.masked_fill(m, -inf))): -inf either way
                    mask, fill = filled
                    own = f"{stmt[:start]}{inner}.masked_fill({mask}, 0.0){stmt[end:]}"
                    use = _masked_probability_use(
                        "softmax",
                        "the log's argument",
                        "exact zeros",
                        None,
                        ev.dtype,
                        call="F.log_softmax(logits, dim=-1)",
                        mask=fill,
                        op=ev.op,
                    )
                    first = use.fix.split("\n", 1)[1]
                    return replace(
                        use,
                        fix=f"{own}   # 0, not -inf, at the masked positions, and no gradient "
                        f"through them\n{first}",
                    )
                own = f"{stmt[:start]}{inner}{stmt[end:]}"
                return _LogUse(
                    "softmax",
                    f"{own}   # log(softmax(z)) without forming the 0\n"
                    f"# or keep the softmax and floor it: "
                    f"{stmt[:start]}{_floor_text(arg, ev.dtype)}{stmt[end:]}",
                )
        break
    hand = _naive_softplus_use(ctx, ev)
    if hand is not None:
        return hand
    if not ev.code and _graph_logs_exp_sum(ctx, ev):
        return _LogUse(
            "logsumexp",
            "y = torch.logsumexp(torch.stack([x1, x2, x3]), dim=0)   # not "
            "torch.log(torch.exp(x1) + torch.exp(x2) + torch.exp(x3)): x1, x2, x3 the "
            "exponents\n"
            "y = torch.logsumexp(x, dim=-1)   # not torch.log(torch.exp(x).sum(-1))\n"
            '# mode="forensic" names your line, and nanwatch rewrites it',
            why=_lse_why(ev.dtype),
            evidence="the loss graph takes the log of a sum of exp() terms (log <- add <- exp)",
        )
    if _graph_xlogy(ctx, ev):
        return _LogUse(
            "xlogy",
            "term = torch.xlogy(y, y) - torch.xlogy(y, mu)   # a pattern, in your names: "
            "y * torch.log(y / mu) is 0 where y is 0 (0 · log 0 = 0), a y of 0 is legitimate\n"
            "term = torch.xlogy(t, t) - t * q   # t * (torch.log(t) - q), the same\n"
            '# mode="forensic" names your line, and nanwatch rewrites it',
            why=_XLOGY_WHY,
            evidence="the loss graph multiplies the log by something (mul <- log) and the "
            "log is taken of a quotient (log <- div): a y · log(y / mu) term, 0 × -inf = NaN "
            "where y is 0",
        )
    kind = _input_activation(ctx, a, ev)
    if kind == "sigmoid":
        return _LogUse("sigmoid", _SIGMOID_FIX)
    if kind == "softmax":
        return _LogUse("softmax", _LOG_FIX)
    return None


def _floor_text(p: str, dtype: str | None) -> str:
    """``torch.log(p.clamp_min(torch.finfo(<dtype>).tiny))`` for the probability ``p`` as
    written, of the log's dtype."""
    dt = f"torch.{dtype}" if dtype and re.fullmatch(r"[a-z]+\d*", dtype) else f"{paren(p)}.dtype"
    return f"torch.log({paren(p)}.clamp_min(torch.finfo({dt}).tiny))"


def _log_of(node: ast.expr) -> tuple[str, ast.expr] | None:
    """(``log`` or ``log1p``, x) of ``torch.log(x)`` / ``x.log()`` / ``torch.log1p(x)`` /
    ``x.log1p()``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    if node.func.attr not in ("log", "log1p"):
        return None
    if ast.unparse(node.func.value) == "torch" and len(node.args) == 1:
        return node.func.attr, node.args[0]
    if not node.args and not node.keywords:
        return node.func.attr, node.func.value
    return None


def _logit_by_hand(stmt: str, ev: OpEvent | None = None) -> _LogUse | None:
    """``log(x) - log1p(-x)`` or ``log(x) - log(1 - x)`` on the user's line: a logit written
    by hand (a flow's logit preprocessing of pixels in [0, 1], a diffusion schedule's log
    signal-to-noise ratio), -inf at x = 0 from the first log and +inf at x = 1 from the
    second; the line with ``torch.logit(x, eps=...)``. When the lines above ``ev`` read x
    from a table by index (``ab = self.alphas_bar[t]``, see :func:`_table_lookup`), the
    story is that table's entries, not pixels."""
    try:
        tree = ast.parse(stmt.strip())
    except SyntaxError:
        return None
    lines = stmt.strip()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub)):
            continue
        left, right = _log_of(node.left), _log_of(node.right)
        if left is None or right is None or left[0] != "log":
            continue
        x = ast.unparse(left[1])
        inner = right[1]
        if right[0] == "log1p":
            ok = isinstance(inner, ast.UnaryOp) and isinstance(inner.op, ast.USub)
            ok = ok and ast.unparse(inner.operand) == x  # type: ignore[attr-defined]
        else:
            m = _ONE_MINUS.match(ast.unparse(inner))
            ok = m is not None and m.group(1).strip() in (x, f"({x})")
        if not ok or node.end_col_offset is None:
            continue
        second = "torch.log1p(-x)" if right[0] == "log1p" else "torch.log(1 - x)"
        second = second.replace("x", paren(x))
        eps = f"torch.finfo({paren(x)}.dtype).eps"
        own = (
            lines[: node.col_offset] + f"torch.logit({x}, eps={eps})" + lines[node.end_col_offset :]
        )
        lk = _table_lookup(ev, x) if ev is not None else None
        if lk is not None:
            built = f" where it is built ({lk.made_at})" if lk.made_at else ""
            return _LogUse(
                "logit",
                fix=(
                    f"{own}   # logit with {x} clamped into [eps, 1 - eps]: finite at 0 and 1\n"
                    f"# or keep {lk.table}'s entries inside (0, 1){built}: "
                    f".clamp({eps.replace(paren(x), lk.table)}, 1 - "
                    f"{eps.replace(paren(x), lk.table)})"
                ),
                why=(
                    f"The line is a logit written by hand, log({x}) - log(1 - {x}): log({x}) "
                    f"is -inf where {x} is exactly 0 and {second} is -inf where {x} is exactly "
                    f"1, which the subtraction turns into +inf. {x} is read from the table "
                    f"{lk.table} at the indices {lk.index} ({lk.lookup}): an entry of exactly "
                    "0 or 1 there gives it (a noise schedule whose alpha_bar reaches 0 at its "
                    "last steps, or is 1 at its first). torch.logit with eps clamps the input "
                    "into [eps, 1 - eps] first; the derivative is finite there too."
                ),
                evidence=(
                    f"the line computes log({x}) - log(1 - {x}), a logit of {lk.lookup}: "
                    f"-inf from log({x}) where the entry is 0, and +inf from -{second} where "
                    "it is 1 (log of 1 - 1 = 0)"
                ),
            )
        return _LogUse(
            "logit",
            fix=(
                f"{own}   # logit with {x} clamped into [eps, 1 - eps]: finite at 0 and 1\n"
                f"# or dequantize first, when {x} is 8-bit pixels / 255: {x} = ({x} * 255 + "
                f"torch.rand_like({x})) / 256 never reaches exactly 0 or 1"
            ),
            why=(
                f"The line is a logit written by hand, log({x}) - log(1 - {x}): log({x}) is "
                f"-inf where {x} is exactly 0 and {second} is -inf where {x} is exactly 1, "
                "which the subtraction turns into +inf. Pixels scaled to [0, 1] (black and "
                "white pixels, no dequantization) or fractions hold both ends. torch.logit "
                "with eps clamps the input into [eps, 1 - eps] first; the derivative is finite "
                "there too."
            ),
            evidence=(
                f"the line computes log({x}) - log(1 - {x}), a logit: -inf from log({x}) "
                f"where {x} is 0, and +inf from -{second} where {x} is 1 (log of 1 - 1 = 0)"
            ),
        )
    return None


def _lse_why(dtype: str | None) -> str:
    lim = limits(dtype) or limits("float32")
    assert lim is not None
    return _LSE_WHY.format(bound=fmt(math.log(lim.subnormal / 2)), dtype=dtype or "float32")


_LSE_WHY = (
    "The log was taken of a sum of exp() terms, and every term underflowed to 0: exp(x) is "
    "0 for x below {bound} in {dtype}, which x / temperature reaches "
    "for a small temperature (a soft-min -g·log(Σ exp(-x / g)), a hand-written "
    "logsumexp). torch.logsumexp subtracts the largest exponent before exponentiating, so "
    "the result is exact and finite; clamping the sum at a tiny value keeps it finite but "
    "wrong (the soft-min becomes a constant and its gradient 0)."
)


def _exp_terms(node: ast.expr) -> list[ast.expr] | None:
    """The exponents of ``exp(x1) + exp(x2) + ...`` (``torch.exp(x)`` or ``x.exp()``)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _exp_terms(node.left), _exp_terms(node.right)
        return left + right if left is not None and right is not None else None
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "exp"
    ):
        if ast.unparse(node.func.value) == "torch" and len(node.args) == 1:
            return [node.args[0]]
        if not node.args and not node.keywords:
            return [node.func.value]
    return None


def _exp_sum_dim(node: ast.expr) -> tuple[ast.expr, str] | None:
    """``exp(x).sum(d)`` / ``torch.exp(x).sum(dim=d)``: the exponent x and the dim text."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    if node.func.attr != "sum":
        return None
    inner = _exp_terms(node.func.value)
    dim = (
        node.args[0]
        if node.args
        else next((k.value for k in node.keywords if k.arg == "dim"), None)
    )
    if inner is None or len(inner) != 1 or dim is None:
        return None
    return inner[0], ast.unparse(dim)


def _logsumexp_use(
    stmt: str, start: int, end: int, arg: str, dtype: str | None = None
) -> _LogUse | None:
    """``log(exp(a) + exp(b) + ...)`` or ``log(exp(x).sum(d))`` on the user's line: the
    line with ``torch.logsumexp`` in its place."""
    try:
        node = ast.parse(arg, mode="eval").body
    except SyntaxError:
        return None
    terms = _exp_terms(node)
    if terms is not None and len(terms) >= 2:
        xs = ", ".join(ast.unparse(t) for t in terms)
        lse = f"torch.logsumexp(torch.stack([{xs}]), dim=0)"
    else:
        found = _exp_sum_dim(node)
        if found is None:
            return None
        lse = f"torch.logsumexp({ast.unparse(found[0])}, dim={found[1]})"
    own = f"{stmt[:start]}{lse}{stmt[end:]}"
    return _LogUse(
        "logsumexp",
        f"{own}   # log of a sum of exps, exact where every exp underflows to 0\n"
        "# not torch.log(s.clamp_min(tiny)): finite, but not the log of the sum",
        why=_lse_why(dtype),
        evidence=f"the log's argument {arg} is a sum of exp() terms",
    )


def _logsumexp_of_name(stmt: str, start: int, end: int, arg: str, ev: OpEvent) -> _LogUse | None:
    """``torch.log(s)`` where an earlier line of the function made ``s = exp(a) + exp(b) +
    ...`` (a hand-written soft-min or logsumexp): the log's line with ``torch.logsumexp`` of
    those exponents in its place."""
    found = _assigned_expr(ev.source, arg)
    if found is None:
        return None
    made, node = found
    terms = _exp_terms(node)
    if terms is None or len(terms) < 2:
        return None
    xs = ", ".join(ast.unparse(t) for t in terms)
    lse = f"torch.logsumexp(torch.stack([{xs}]), dim=0)"
    return _LogUse(
        "logsumexp",
        f"{stmt[:start]}{lse}{stmt[end:]}   # was torch.log({arg}) of {made}: exact where every "
        "exp underflows to 0\n"
        f"# not torch.log({arg}.clamp_min(tiny)): finite, but not the log of the sum",
        why=_lse_why(ev.dtype),
        evidence=f"{arg} was made by {made}: a sum of exp() terms, exactly 0 where every exp "
        "underflowed to 0",
    )


def _exp_sum_logs(ops: Sequence[object]) -> tuple[int, int]:
    """How many logs a loss graph's op list (depth first: a unary op's input follows it)
    holds, and how many of them take the log of a sum of exps (``log`` then ``add``/``sum``
    then ``exp``). A log the list's end cuts short (``log``, ``add`` at its end: it holds
    32 ops at most) is left out of both counts: its input is not known."""
    logs = [
        i
        for i, o in enumerate(ops)
        if o == "log" and not (len(ops) >= 32 and ops[i + 1 :] in ([], ["add"], ["sum"]))
    ]
    summed = [i for i in logs if ops[i + 1 : i + 3] in (["add", "exp"], ["sum", "exp"])]
    return len(logs), len(summed)


def _graph_logs_exp_sum(ctx: RuleContext, ev: OpEvent) -> bool:
    """The loss graph walked from the loss (default mode, no line) shows that the failing
    log's own input is a sum of exps whose terms underflowed: every log of its op list is
    ``log`` then ``add``/``sum`` then ``exp`` (so the failing one is), and the log's input
    is exactly 0 there (a sum of exps is 0 only where every term is)."""
    if ev.path != LOSS_PATH:
        return False
    x = first_input(ev)
    if x is None or not has_zero(x) or x.min < 0:
        return False
    for n in ctx.notes("loss_graph"):
        ops = n.data.get("ops")
        if isinstance(ops, list):
            logs, summed = _exp_sum_logs(ops)
            if logs and summed == logs:
                return True
    return False


def _softplus_exponent(expr: str) -> str | None:
    """x of a softplus written by hand: ``torch.log(1 + torch.exp(x))``, ``(1 + x.exp()).log()``
    (either order of the sum); None otherwise."""
    try:
        node = ast.parse(expr.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    if node.func.attr != "log":
        return None
    if ast.unparse(node.func.value) == "torch" and len(node.args) == 1:
        inner = node.args[0]
    elif not node.args and not node.keywords:
        inner = node.func.value
    else:
        return None
    if not (isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Add)):
        return None
    for one, other in ((inner.left, inner.right), (inner.right, inner.left)):
        terms = _exp_terms(other)
        if isinstance(one, ast.Constant) and one.value == 1 and terms and len(terms) == 1:
            return ast.unparse(terms[0])
    return None


def _naive_softplus_use(ctx: RuleContext, ev: OpEvent) -> _LogUse | None:
    """The log's input is a softplus written as log(1 + exp(x)): 1 + exp(x) rounds to 1 for
    x below log(eps / 2), so it is exactly 0 there and its log -inf. From the line (the
    log's argument, or the earlier line of the function that assigned it), else from the
    loss graph (a log <- add <- exp beside the failing log, whose input is exactly 0)."""
    x = first_input(ev)
    if x is None or not has_zero(x) or x.min < 0:
        return None
    lim = limits(ev.dtype) or limits("float32")
    assert lim is not None
    dtype = ev.dtype or "float32"
    bound = fmt(math.log(lim.eps / 2))
    why = (
        f"Its input is a softplus written by hand, log(1 + exp(x)): in {dtype}, 1 + exp(x) "
        f"rounds to exactly 1 once exp(x) is below half of eps ({fmt(lim.eps / 2)}), that is "
        f"for x below {bound}, so the softplus is exactly 0 and its log -inf (a Bayesian "
        "layer's sigma = log(1 + exp(rho)) with rho initialized at -20 or trained down "
        "there). F.softplus computes log1p(exp(x)) without the rounding: it is exp(x) for a "
        "very negative x, small but not 0; a floor keeps it off 0 when exp(x) underflows."
    )
    found = _log_argument(ev)
    if found is not None:
        stmt, start, end, arg = found
        xs = _softplus_exponent(arg)
        if xs is not None:
            soft = f"F.softplus({xs}) + 1e-6"
            own = f"{stmt[:start]}{_with_arg(stmt[start:end], paren(soft))}{stmt[end:]}"
            return _LogUse(
                "softplus",
                fix=f"{own}   # not log(1 + exp({xs})), which is exactly 0 below {bound}",
                why=why,
                evidence=f"the log's argument {arg} is a softplus written by hand: 0 wherever "
                f"{xs} < {bound} in {dtype}",
            )
        if _NAME.fullmatch(arg):
            made = _assigned_before(ev.source, arg)
            rhs = made.split("=", 1)[1] if made else None
            xs = _softplus_exponent(rhs) if rhs else None
            if made is not None and xs is not None:
                return _LogUse(
                    "softplus",
                    fix=(
                        f"{arg} = F.softplus({xs}) + 1e-6   # was {made}: exactly 0 for {xs} "
                        f"below {bound} in {dtype}"
                    ),
                    why=why,
                    evidence=f"{arg} was made by {made}: a softplus written by hand, exactly 0 "
                    f"wherever {xs} < {bound} in {dtype}",
                )
        return None
    if ev.code or ev.path != LOSS_PATH:
        return None
    for ops in _graph_ops(ctx):
        logs, summed = _exp_sum_logs(ops)
        if summed and logs > summed:
            return _LogUse(
                "softplus",
                fix=(
                    "sigma = F.softplus(rho) + 1e-6   # not torch.log(1 + torch.exp(rho)): "
                    f"rho the raw parameter; exactly 0 below {bound} in {dtype}\n"
                    "y = torch.logsumexp(x, dim=-1)   # or, when that log <- add <- exp is a "
                    "log of a sum of exps: not torch.log(torch.exp(x).sum(-1))\n"
                    '# mode="forensic" names your line, and nanwatch rewrites it'
                ),
                why=why,
                evidence="the failing log's input is exactly 0, and the loss graph also "
                "computes a log(a + exp(x)) (log <- add <- exp) whose result can be that 0: "
                f"log(1 + exp(x)) is exactly 0 for x below {bound} in {dtype}",
            )
    return None


_XLOGY_WHY = (
    "A term y · log(y / mu) (a Poisson or Gamma deviance, a KL divergence p · log(p / q), "
    "t · (log(t) - log q)) tends to 0 as y -> 0, and y = 0 is legitimate there (a count "
    "of 0, a probability of 0): computed as written it is 0 × log(0) = 0 × -inf = NaN. "
    "torch.xlogy(y, z) = y · log(z) is 0 where y is 0 (0 · log 0 = 0 by convention); "
    "xlogy(y, y) - xlogy(y, mu) is the same value with the ratio split, so no log sees a "
    "0 made by a division (xlogy(y, y / mu) would: its gradient with respect to mu is "
    "0/0 = NaN where y is 0)."
)


def _xlogy_terms(
    f: ast.expr,
    g: ast.expr,
    seg: Callable[[ast.expr], str],
    log_b: Callable[[str], str] | None = None,
) -> str | None:
    """``xlogy(A, A) - xlogy(A, B)`` for a product ``A * g`` whose ``g`` is ``log(A / B)``
    or ``log(A) - log(B)`` (``xlogy(A, A) - A * R`` for ``log(A) - R``); None otherwise.
    ``log_b`` given (the 0 is in B, not A): ``xlogy(A, A) - A * log_b(B)``, a log of B
    that is finite where B is 0."""
    a = ast.unparse(f)
    logged = _log_of(g)
    if logged is not None and logged[0] == "log":
        arg = logged[1]
        ratio = isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Div)
        if ratio and log_b is None and ast.unparse(arg.left) == a:  # type: ignore[attr-defined]
            b = seg(arg.right)  # type: ignore[attr-defined]
            return f"torch.xlogy({seg(f)}, {seg(f)}) - torch.xlogy({seg(f)}, {b})"
        return None
    if isinstance(g, ast.BinOp) and isinstance(g.op, ast.Sub):
        first = _log_of(g.left)
        if first is None or first[0] != "log" or ast.unparse(first[1]) != a:
            return None
        second = _log_of(g.right)
        if log_b is not None:
            if second is None or second[0] != "log":
                return None
            rest = f"{paren(seg(f))} * {log_b(seg(second[1]))}"
        else:
            rest = (
                f"torch.xlogy({seg(f)}, {seg(second[1])})"
                if second is not None and second[0] == "log"
                else f"{paren(seg(f))} * {paren(seg(g.right))}"
            )
        return f"torch.xlogy({seg(f)}, {seg(f)}) - {rest}"
    return None


def _subtracted_log_zero(a: Anomaly, ev: OpEvent) -> bool:
    """The failing log is the subtracted one of ``log(A) - log(B)``: the op that read its
    -inf (the next event of the anomaly's chain) is a subtraction whose ``other`` holds the
    -inf while its ``self`` (the first log) is finite, so the 0 was in B, not in A."""
    chain = a.op.chain() if a.op is not None else []
    after = [chain[i + 1] for i, e in enumerate(chain[:-1]) if e is ev]
    if not after or packet(after[0].op) != "sub":
        return False
    ins = dict(after[0].inputs)
    left, right = ins.get("self"), ins.get("other")
    if left is None or right is None or not right.neginf:
        return False
    return not left.neginf and math.isfinite(left.min) and math.isfinite(left.max)


_SOFTMAX_NAMES = ("softmax", "log_softmax")


def _log_softmax_of(rhs: ast.expr, text: str) -> str | None:
    """``text`` (a right-hand side that is a softmax call: ``z.softmax(-1)``,
    ``F.softmax(z, dim=-1)``, ``torch.softmax(z, -1)``) as the log_softmax of the same
    logits; None when it is not one."""
    if not isinstance(rhs, ast.Call):
        return None
    func = rhs.func
    name = (
        func.attr
        if isinstance(func, ast.Attribute)
        else func.id
        if isinstance(func, ast.Name)
        else ""
    )
    if name != "softmax" or func.end_col_offset is None:
        return None
    # the call's own name ends where its argument list starts
    head = text[: func.end_col_offset]
    if not head.endswith("softmax"):
        return None
    return f"{head[: -len('softmax')]}log_softmax{text[func.end_col_offset :]}"


def _subtracted_log_fix(ev: OpEvent, b: str) -> tuple[str, str | None]:
    """The log of ``b`` (the second log's argument, exactly 0 somewhere) taken finite: the
    log_softmax of its logits when ``b`` is a name assigned a softmax earlier in the
    function (returned with that new assignment), else ``b`` floored at the dtype's
    smallest normal number."""
    floor = f"torch.log({paren(b)}.clamp_min({_tiny(b)}))"
    if not re.fullmatch(r"[A-Za-z_]\w*", b):
        return floor, None
    found = _assigned_expr(ev.source, b)
    if found is None:
        return floor, None
    made, rhs = found
    text = made.split("=", 1)[1].strip()
    logs = _log_softmax_of(rhs, text)
    if logs is None:
        return floor, None
    return f"log_{b}", f"log_{b} = {logs}   # next to {made}: log {b} without forming the 0"


def _xlogy_ratio_use(
    stmt: str, *, subtracted: bool = False, ev: OpEvent | None = None
) -> _LogUse | None:
    """``y * torch.log(y / mu)`` (or ``log(y / mu) * y``, ``t * (torch.log(t) - q)``): the
    log's argument is a ratio, or a difference of logs, whose numerator is the factor that
    multiplies the log, 0 where that factor is: xlogy gives 0 · log 0 = 0. ``subtracted``
    (the 0 is in the second log's argument, ``q`` of ``p * (log(p) - log(q))``): xlogy
    only for ``p · log p``, and ``log q`` taken where it is finite."""
    s = stmt.strip()
    try:
        tree = ast.parse(s)
    except SyntaxError:
        return None
    if "\n" in s:
        return None
    raw = s.encode()

    def seg(n: ast.expr) -> str:
        return raw[n.col_offset : n.end_col_offset].decode()

    made: list[str] = []
    logged: list[str] = []

    def log_b(b: str) -> str:
        assert ev is not None
        text, line = _subtracted_log_fix(ev, b)
        made[:] = [line] if line is not None else []
        logged[:] = [b]
        return text

    parents = {id(c): n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
            continue
        for f, g in ((node.left, node.right), (node.right, node.left)):
            terms = _xlogy_terms(f, g, seg, log_b if subtracted and ev is not None else None)
            if terms is None:
                continue
            up = parents.get(id(node))
            bare = isinstance(up, ast.BinOp) and (
                isinstance(up.op, ast.Add) or (isinstance(up.op, ast.Sub) and up.left is node)
            )
            bare = bare or isinstance(up, (ast.Assign, ast.AugAssign, ast.Return, ast.Expr))
            start = len(raw[: node.col_offset].decode())
            end = len(raw[: node.end_col_offset or 0].decode())
            bare = bare or (s[start - 1 : start] == "(" and s[end : end + 1] == ")")
            new = terms if bare else f"({terms})"
            own = s[:start] + new + s[end:]
            y = seg(f)
            if logged:
                return _zero_in_second_log(own, y, logged[0], made, ev)
            return _LogUse(
                "xlogy",
                fix=(
                    f"{own}   # {y} · log(...) is 0 where {y} is 0 (0 · log 0 = 0): a {y} of 0 "
                    f"is legitimate, no floor needed\n"
                    f"# if {y} requires grad: torch.xlogy({y}, {paren(y)}.clamp_min("
                    f"{_tiny(y)})) for the first term, whose gradient is {y} / {y} otherwise"
                ),
                why=_XLOGY_WHY,
                evidence=f"the line multiplies the log by {y}, the numerator of what the log "
                f"is taken of: {y} · log({y} / ...) at {y} = 0 is 0 × -inf = NaN",
            )
    return None


def _zero_in_second_log(own: str, y: str, b: str, made: list[str], ev: OpEvent | None) -> _LogUse:
    """The fix of ``y * (log(y) - log(b))`` where ``b`` (not ``y``) holds the 0: a
    reference distribution that underflowed (a KL penalty to a frozen model's softmax)."""
    dtype = (ev.dtype if ev is not None else "") or "float32"
    lim = limits(dtype) or limits("float32")
    assert lim is not None
    low = fmt(-math.log(lim.subnormal / 2))
    x = first_input(ev) if ev is not None else None
    zeros = f"{x.zeros:,} of its {x.numel:,} values" if x is not None and x.zeros else "values"
    if made:
        lines = [
            made[0],
            f"{own}   # log {b} is finite where {b} underflowed to 0",
            f"# no logits at hand: torch.log({paren(b)}.clamp_min({_tiny(b)})) for "
            f"torch.log({b}), a floor (it understates the term where {b} is 0)",
        ]
    else:
        lines = [
            f"{own}   # log {b} floored at the dtype's smallest normal number: finite where "
            f"{b} underflowed to 0",
            f"# where {b} is a softmax, take the log_softmax of its logits instead: exact, "
            "and never 0",
        ]
    return _LogUse(
        "xlogy",
        fix="\n".join(lines),
        why=(
            f"Here the 0 is in {b}, the second log's argument, not in {y}: {b} is exactly 0 "
            f"where {y} is not, so {y} · (log {y} - log {b}) = {y} · +inf = inf, and "
            f"torch.xlogy({y}, {b}) is -inf there as well (xlogy is 0 only where its first "
            f"argument is). A softmax underflows to exactly 0 in {dtype} for a logit more "
            f"than {low} below its row's largest (a confident reference model): "
            f"its true log is finite. log_softmax of the same logits gives it without forming "
            f"the 0; torch.xlogy({y}, {y}) keeps {y} · log {y} = 0 where {y} is 0."
        ),
        evidence=f"the log that made -inf is log({b}), the subtracted one (log({y}) is finite "
        f"there): {b} is exactly 0 in {zeros}",
    )


def _graph_xlogy(ctx: RuleContext, ev: OpEvent) -> bool:
    """The loss graph (no line known) shows the failing log as ``mul <- log <- div``, the
    loss graph's only log: a ``y * log(y / mu)`` term written by hand, likely."""
    if ev.code or ev.path != LOSS_PATH:
        return False
    x = first_input(ev)
    if x is None or not has_zero(x) or x.min < 0:
        return False
    for ops in _graph_ops(ctx):
        logs = [i for i, o in enumerate(ops) if o == "log"]
        if len(logs) == 1 and 0 < logs[0] < len(ops) - 1:
            i = logs[0]
            if ops[i - 1] == "mul" and ops[i + 1] == "div":
                return True
    return False


def _entropy_use(stmt: str, start: int, end: int, arg: str) -> _LogUse | None:
    """``p * torch.log(p)`` (or ``torch.log(p) * p``): an entropy term, 0 × -inf at p = 0."""
    call = stmt[start:end]
    a = re.escape(arg)
    m = re.search(rf"(?<![\w.])(?:{a}|\({a}\))\s*\*\s*{re.escape(call)}", stmt) or re.search(
        rf"{re.escape(call)}\s*\*\s*(?:{a}|\({a}\))(?![\w.(\[])", stmt
    )
    if m is None:
        return None
    xlogy = f"torch.special.xlogy({arg}, {paren(arg)}.clamp_min({_tiny(arg)}))"
    own = stmt[: m.start()] + xlogy + stmt[m.end() :]
    return _LogUse(
        "entropy",
        fix=(
            f"{own}   # 0 where {arg} is 0, with a finite gradient\n"
            f"# or -torch.special.entr({paren(arg)}.clamp_min({_tiny(arg)})), the same: plain "
            f"xlogy({arg}, {arg}) or entr({arg}) is finite at 0 but its gradient is not\n"
            "logp = F.log_softmax(logits, dim=-1); ent = -(logp.exp() * logp).sum(-1)"
            "   # when p is a softmax of logits"
        ),
        why=(
            "An entropy term p · log(p) tends to 0 as p -> 0, but computed as written it is "
            "0 × log(0) = 0 × -inf = NaN wherever a probability is exactly 0 (a softmax of "
            "spread-out logits underflows, a ReLU-normalized score is 0). torch.special.xlogy "
            "defines 0 · log(0) as 0; keeping its second argument off 0 keeps the gradient "
            "finite too."
        ),
        evidence=f"the line multiplies {arg} by its own log: {arg} · log({arg}) at {arg} = 0 "
        "is 0 × -inf = NaN",
    )


def _with_arg(call: str, arg: str) -> str:
    """``torch.log2(p)`` or ``p.log2()`` with ``arg`` in place of ``p``."""
    if call.startswith("torch."):
        return f"{call[: call.index('(')]}({arg})"
    return arg + call[call.rindex(".") :]


def _producer_of(q: str, source: str | None) -> tuple[str, str | None, str | None]:
    """What made the probability ``q`` of a log(1 - q), read from the user's code:
    ("sigmoid", its logit, None) for a sigmoid on the line or assigned to q's name in the
    function; ("cumsum", None, the assignment) for a cumulative sum (a CDF of a softmax's
    bins); ("unknown", None, the assignment or None) otherwise."""
    sig = _SIGMOID.match(q)
    if sig is not None:
        return "sigmoid", (sig.group(1) or sig.group(2)).strip(), None
    head = re.match(r"[A-Za-z_]\w*", q)
    found = _assigned_expr(source, head.group(0)) if head is not None else None
    if found is None:
        return "unknown", None, None
    made, rhs = found
    for n in ast.walk(rhs):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            owner = ast.unparse(n.func.value)
            if n.func.attr == "sigmoid":
                if owner in ("torch", "F", "torch.nn.functional") and len(n.args) == 1:
                    return "sigmoid", ast.unparse(n.args[0]), made
                if not n.args:
                    return "sigmoid", owner, made
            if n.func.attr in ("cumsum", "cumsum_"):
                return "cumsum", None, made
    return "unknown", None, made


def _bce_target(stmt: str, q: str) -> tuple[str, str] | None:
    """(the name the statement assigns, the targets) of a hand-written binary cross-entropy
    ``stmt``: the factor that multiplies log(``q``) (``yb`` of ``yb * torch.log(p)``), as
    written; None when the statement is no such assignment or has no such product.

    >>> _bce_target("loss = -(yb * torch.log(p) + (1 - yb) * torch.log(1 - p)).mean()", "p")
    ('loss', 'yb')
    """
    try:
        tree = ast.parse(stmt.strip())
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], (ast.Assign, ast.AnnAssign)):
        return None
    node = tree.body[0]
    lhs = node.targets[0] if isinstance(node, ast.Assign) else node.target
    if not isinstance(lhs, (ast.Name, ast.Attribute)) or (
        isinstance(node, ast.Assign) and len(node.targets) != 1
    ):
        return None
    text = stmt.strip()
    try:  # q as ast writes it, to compare with the statement's expressions
        q = ast.unparse(ast.parse(q.strip(), mode="eval").body)
    except SyntaxError:
        return None

    def log_of_q(e: ast.expr) -> bool:
        if not isinstance(e, ast.Call) or not isinstance(e.func, ast.Attribute):
            return False
        if e.func.attr != "log":
            return False
        if e.args and len(e.args) == 1:
            return ast.unparse(e.args[0]) == q
        return not e.args and ast.unparse(e.func.value) == q

    for n in ast.walk(node):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult):
            for this, other in ((n.left, n.right), (n.right, n.left)):
                if log_of_q(this) and q not in ast.unparse(other):
                    y = ast.get_source_segment(text, other)
                    if y:
                        return ast.unparse(lhs), y.strip()
    return None


def _one_minus_use(
    stmt: str,
    calls: list[tuple[int, int, str]],
    q: str,
    *,
    bce: bool,
    source: str | None = None,
    low: float | None = None,
    others: tuple[str, ...] = (),
) -> _LogUse:
    """log(1 - p) (and log(p) beside it: a hand-written binary cross-entropy) of a
    probability that reached exactly 1 (or, by rounding, above it: ``low``, the log's
    input minimum, below 0). A sigmoid is named only when the code shows one."""
    out, last = [], 0
    for start, end, arg in calls:
        out.append(stmt[last:start])
        m = _ONE_MINUS.match(arg)
        if arg == q or (m is not None and m.group(1).strip() in (q, *others)):
            each = m.group(1).strip() if m is not None else q
            out.append(_with_arg(stmt[start:end], f"{paren(arg)}.clamp_min({_tiny(each)})"))
        else:
            out.append(stmt[start:end])
        last = end
    clamped = "".join(out) + stmt[last:]
    kind, z, made = _producer_of(q, source)
    above = low is not None and low < 0
    f = "torch.nn.functional." if _lacks_f(source) else "F."
    if kind == "sigmoid" and z is not None and not above:
        target = _bce_target(stmt, q) if bce else None
        if made is not None and bce and target is not None:  # the user's operands
            name, y = target
            lead = (
                f"{name} = {f}binary_cross_entropy_with_logits({z}, {y})   # in place of the "
                f"hand-written one: from the logits, not {made}; never -inf\n"
            )
        elif made is not None and bce:  # a hand-written BCE of p = sigmoid(...) made above
            lead = (
                f"loss = {f}binary_cross_entropy_with_logits(logits, y)   # {q} = "
                "torch.sigmoid(logits): the loss from the logits\n"
                f"log_1mp = {f}logsigmoid(-logits)   # log(1 - sigmoid(logits)), never -inf\n"
            )
        else:
            own: list[str] = []
            last = 0
            for start, end, arg in calls:
                m = _ONE_MINUS.match(arg)
                hit = m is not None and m.group(1).strip() == q
                new = f"{f}logsigmoid(-{paren(z)})" if hit else stmt[start:end]
                own += [stmt[last:start], new]
                last = end
            lead = "".join(own) + stmt[last:] + f"   # log(1 - sigmoid({z})), never -inf\n"
            if made is None:
                lead += (
                    f"{target[0] if target else 'loss'} = {f}binary_cross_entropy_with_logits("
                    f"{z}, {target[1] if target else 'y'})   # a BCE of the logits\n"
                )
        return _LogUse(
            "bce" if bce else "one-minus",
            fix=f"{lead}{clamped}   # when only {q} exists",
            why=(
                f"The log of 1 - {q} is -inf where {q} is exactly 1: a sigmoid of a logit "
                f"above about {_SIGMOID_ONE['float32']} rounds to 1.0 in float32 (about "
                f"{_SIGMOID_ONE['float16']} in float16, {_SIGMOID_ONE['bfloat16']} in "
                "bfloat16), so 1 - p = 0"
                + (
                    ", and the label's zero weight on that term makes 0 × -inf = NaN. "
                    if bce
                    else ". "
                )
                + "logsigmoid(-z) = log(1 - sigmoid(z)) and binary_cross_entropy_with_logits "
                "work from the logit and never form the 0."
            ),
            evidence=f"the log is of 1 - {q}: -inf where {q} is exactly 1"
            + (f" (with log({q}) beside it: a hand-written binary cross-entropy)" if bce else "")
            + (f"; {q} is a sigmoid ({made})" if made else ""),
        )
    what = (
        f"{q} rounded to 1 or just above it (the log's input reached {fmt(low)})"
        if above
        else f"{q} reached exactly 1"
    )
    if kind == "cumsum":
        why = (
            f"The log of 1 - {q} is -inf where {q} is exactly 1 and NaN where it is above 1. "
            f"{q} is a cumulative sum of probabilities ({made}): the total of a softmax is 1 "
            "only up to rounding, so at the late bins the running sum rounds to 1.0 or a few "
            "eps above it, and 1 - it is 0 or negative. Compute the survival from the bins "
            "after t (a reversed cumsum, or a logsumexp of log_softmax over them) instead of "
            "1 minus the cumulative sum; else keep 1 - cdf above 0."
        )
        extra = (
            "# better: S(t) as the sum of the bins after t, not 1 - cumsum: "
            "surv = pmf.flip(1).cumsum(1).flip(1) - pmf, or "
            "torch.logsumexp of F.log_softmax(logits, 1) over those bins"
        )
    else:
        why = (
            f"The log of 1 - {q} is -inf where {q} is exactly 1"
            + (" and NaN where it is above 1 (rounding)" if above else "")
            + f": nothing keeps {q} below 1. Keep 1 - {q} above 0 (a clamp), or compute the "
            "log of the complement from what made it: log1p(-p) is exact for small p but "
            "-inf at p = 1 too."
        )
        extra = (
            f"# if {q} is a sigmoid of z: F.logsigmoid(-z) = log(1 - sigmoid(z)), never -inf"
            if not above
            else f"# {q} went above 1: it is not a sigmoid (a sigmoid never exceeds 1)"
        )
    ys = [y for y in map(_exp_operand, (q, *others)) if y is not None]
    if ys:  # log(1 - exp(y)): log1mexp, exact in log space, still -inf at y = 0
        extra = (
            "# log(1 - exp(y)) in log space: torch.log1p(-torch.exp(y)) for y below -0.69, "
            "torch.log(-torch.expm1(y)) above; both are -inf at y = 0, so keep y below 0: "
            + ", ".join(f"{paren(y)}.clamp_max(-1e-6)" for y in ys)
        )
    both = f"1 - {q}" + "".join(f" and 1 - {o}" for o in others)
    return _LogUse(
        "bce" if bce else "one-minus",
        fix=f"{clamped}   # {both} kept above 0"
        + (": the op's input does not say which one held the 0" if others else "")
        + f"\n{extra}",
        why=why,
        evidence=f"the log is of {both}: {what}"
        + (f"; {q} is a cumulative sum ({made})" if kind == "cumsum" else "")
        + (f" (with log({q}) beside it: a hand-written binary cross-entropy)" if bce else ""),
    )


#: the logit above which sigmoid rounds to exactly 1.0: 1 - sigmoid(z) ~ exp(-z) falls
#: below half of the dtype's eps, so z > log(2 / eps) (16.6 in float32, 7.6 in float16,
#: 5.5 in bfloat16: autocast to bfloat16 saturates at a logit of 6)
_SIGMOID_ONE = {
    name: f"{math.log(2 / lim.eps):.2g}"
    for name in ("float32", "float16", "bfloat16")
    if (lim := dtype_limits(name)) is not None
}


def _tanh_argument(node: ast.expr) -> ast.expr | None:
    """u of ``torch.tanh(u)`` / ``F.tanh(u)`` / ``u.tanh()``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    if node.func.attr != "tanh":
        return None
    owner = ast.unparse(node.func.value)
    if owner in ("torch", "F", "torch.nn.functional") and len(node.args) == 1:
        return node.args[0]
    if not node.args and not node.keywords:
        return node.func.value
    return None


def _squared(node: ast.expr) -> ast.expr | None:
    """x of ``x ** 2``, ``x.pow(2)``, ``torch.pow(x, 2)``, ``x.square()``,
    ``torch.square(x)``, ``x * x``."""
    two = (ast.Constant(2), ast.Constant(2.0))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return node.left if ast.dump(node.right) in map(ast.dump, two) else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return node.left if ast.dump(node.left) == ast.dump(node.right) else None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    owner, attr, args = ast.unparse(node.func.value), node.func.attr, node.args
    if owner == "torch" and attr == "pow" and len(args) == 2:
        return args[0] if ast.dump(args[1]) in map(ast.dump, two) else None
    if owner == "torch" and attr == "square" and len(args) == 1:
        return args[0]
    if attr == "pow" and len(args) == 1 and ast.dump(args[0]) in map(ast.dump, two):
        return node.func.value
    if attr == "square" and not args:
        return node.func.value
    return None


@dataclass(frozen=True)
class _TanhSquare:
    u: str  #: the pre-squash value, as the user wrote it
    made: str | None  #: ``a = torch.tanh(u)`` when the square was of a name assigned so


def _tanh_of_square(q: str, source: str | None) -> _TanhSquare | None:
    """q is tanh(u)**2 (of tanh(u) on the line, or of a name an earlier line of the function
    set to tanh(u)): log(1 - q) is the tanh-squash correction of a squashed Gaussian."""
    try:
        base = _squared(ast.parse(q.strip(), mode="eval").body)
    except SyntaxError:
        return None
    if base is None:
        return None
    u = _tanh_argument(base)
    if u is not None:
        return _TanhSquare(ast.unparse(u), None)
    if not isinstance(base, ast.Name):
        return None
    found = _assigned_expr(source, base.id)
    if found is None:
        return None
    made, rhs = found
    u = _tanh_argument(rhs)
    return _TanhSquare(ast.unparse(u), made) if u is not None else None


def _imported_names(source: str | None) -> set[str] | None:
    """The names the file of ``source`` (``file.py:42``) binds with an import statement
    (``import math``, ``import torch.nn.functional as F``, ``from math import log``): a fix
    may spell ``math.`` only where ``math`` is among them; None when the file cannot be
    read or parsed."""
    import linecache

    path = (source or "").rpartition(":")[0]
    text = "".join(linecache.getlines(path)) if path else ""
    if not text:
        return None
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name != "*":
                    names.add(alias.asname or alias.name.split(".")[0])
    return names


def _tanh_squash_use(
    stmt: str,
    start: int,
    end: int,
    arg: str,
    sq: _TanhSquare,
    *,
    dtype: str | None,
    source: str | None = None,
) -> _LogUse:
    """log(1 - tanh(u)**2) written as it reads: tanh(u) rounds to exactly ±1 for a large |u|,
    so the log is -inf; 2·(log 2 - u - softplus(-2u)) is the same value, finite for every u."""
    lim = limits(dtype) or limits("float32")
    assert lim is not None
    dt = dtype or "float32"
    bound = 0.5 * math.log(8 / lim.eps)  # 1 - tanh(u) ~ 2·exp(-2u) < eps/4: rounds to 1
    u = paren(sq.u)
    bound_names = _imported_names(source)
    has_math = bound_names is None or "math" in bound_names
    has_f = bound_names is None or "F" in bound_names or _binds_f(source)
    log2 = "math.log(2)" if has_math else f"{math.log(2)!r}"
    softplus = "F.softplus" if has_f else "torch.nn.functional.softplus"
    stable = f"2 * ({log2} - {u} - {softplus}(-2 * {u}))"
    # the file unread: its imports unknown, the names the fix uses are said
    needs_line = (
        "# needs: import math; import torch.nn.functional as F\n" if bound_names is None else ""
    )
    log2_note = "" if has_math else f" ({math.log(2)!r} = log 2)"
    call = stmt[start:end]
    own = f"{stmt[:start]}{stable}{stmt[end:]}"
    floor = math.log(lim.tiny)
    at = 10.0
    true = 2 * (math.log(2) - at - math.log1p(math.exp(-2 * at)))
    made = f" ({sq.made})" if sq.made else ""
    return _LogUse(
        "tanh-squash",
        fix=(
            f"{own}   # = {call}, exact and finite for every {sq.u}{log2_note}\n"
            f"{needs_line}"
            f"# not a clamp of 1 - tanh^2 at tiny: log(tiny) = {fmt(floor)} in {dt} where the "
            f"true value is -2|{sq.u}| + 2 log 2 ({fmt(true)} at {fmt(at)}), with 0 gradient"
        ),
        why=(
            f"{arg} is the tanh-squash correction of a squashed Gaussian policy (SAC: a = "
            f"tanh(u), log p(a) = log p(u) - log(1 - tanh(u)^2)). tanh(u) rounds to exactly "
            f"±1.0 in {dt} for |u| above about {fmt(bound)}, so 1 - tanh(u)^2 is 0 and its log "
            "-inf (the log-prob +inf): a wide std or unnormalized observations push u there. "
            "log(1 - tanh(u)^2) = 2·(log 2 - u - softplus(-2u)) is the same value computed "
            "from u, never forms the 0, and keeps the gradient."
        ),
        evidence=f"the log is of {arg}, with {sq.u} squashed by tanh{made}: 1 - tanh^2 is "
        f"exactly 0 where |{sq.u}| > {fmt(bound)} in {dt}, since tanh rounds to ±1",
    )


_SIGMOID_FIX = (
    "logp = F.logsigmoid(logits)            # not torch.log(torch.sigmoid(logits))\n"
    "log_1mp = F.logsigmoid(-logits)        # not torch.log(1 - torch.sigmoid(logits))\n"
    "loss = F.binary_cross_entropy_with_logits(logits, y)  # not a hand-written BCE\n"
    "logp = torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))  # when only p exists"
)


def _input_activation(ctx: RuleContext, a: Anomaly, ev: OpEvent) -> str | None:
    """``softmax`` or ``sigmoid`` when one made an input of the module the log ran in (a
    loss module given probabilities), from the autograd node or module that made it."""
    trace = ctx.trace
    paths = {p for p in (ev.path, a.path) if p}
    calls = {c.id for c in trace.calls if c.path in paths}
    kinds = {
        act.kind
        for r in trace.records
        if r.phase is Phase.INPUT and r.call in calls
        for act in [activation_of(trace, r)]
        if act is not None
    }
    return next(iter(kinds)) if len(kinds) == 1 and kinds <= {"sigmoid", "softmax"} else None


def _entr_backward(ctx: RuleContext, a: Anomaly, ev: OpEvent, trigger: OpEvent) -> Diagnosis:
    """entr(x) = -x·log(x) is 0 at x = 0, but its derivative -(log(x) + 1) is +inf there:
    the entropy of a distribution with exact zeros (a ReLU-normalized or sparse one, or
    probabilities that underflowed)."""
    x = input_named(ev, "self")
    evidence = [
        f"in backward (autograd node {ev.node}), the gradient of entr(x) = -x·log(x) is "
        f"-(log(x) + 1): {ev.born} where x is 0",
        *([f"x (self): {describe_stat(x)}"] if x is not None else []),
        *_chain_evidence(ev, trigger, ev.born),
    ]
    return ctx.diagnosis(
        **op_fields(ev, a),
        title="Gradient of entr at 0",
        evidence=evidence,
        explanation=(
            "torch.special.entr(x) = -x·log(x) is defined as 0 at x = 0, so the forward "
            "value is finite, but its derivative -(log(x) + 1) is +inf there, and the "
            "backward of what made x (a softmax, a normalization: x × (g - ...)) turns "
            "0 × inf into NaN: an entropy over probabilities that are exactly 0 (scores "
            "cut to 0 by a ReLU, a sparse assignment, a softmax that underflowed). Keeping "
            "entr's argument off 0, or computing the entropy from log-probabilities, keeps "
            "every gradient finite."
        ),
        fix=(
            "ent = torch.special.entr(p.clamp_min(torch.finfo(p.dtype).tiny)).sum(-1)"
            "   # the gradient at 0 stays finite\n"
            "logp = F.log_softmax(logits, dim=-1)\n"
            "ent = -(logp.exp() * logp).sum(-1)   # when p = softmax(logits)\n"
            "ent = torch.distributions.Categorical(logits=logits).entropy()   # the same"
        ),
    )


def _log1p_below(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, x: TensorStat | None, *, evidence: list[str]
) -> Diagnosis:
    """log1p of -1 or below: not a probability's log but counts or amounts that went
    negative (a -1/-2 missing-value sentinel, a difference), or log(1 - p) at p = 1."""
    own = _log1p_fix(ctx, ev, x)
    if own is not None and not own[1]:  # a tensor the model computed: not data
        return ctx.diagnosis(
            **op_fields(ev, a),
            evidence=evidence,
            explanation=(
                "log1p(x) = log(1 + x) is -inf at x = -1 and NaN below it. Its argument is "
                "computed by the model, not read from the data: log1p(-v) is log(1 - v), -inf "
                "once v reaches 1 (a norm or probability that rounded to 1, artanh at |v| = "
                "1); log1p(c * v) of a signed v goes below -1 for negative v."
            ),
            fix=own[0],
        )
    first = (
        own[0]
        if own is not None
        else "y = torch.log1p(x.clamp_min(0))   # counts and amounts are >= 0"
    )
    return ctx.diagnosis(
        **op_fields(ev, a),
        evidence=evidence,
        explanation=(
            "log1p(x) = log(1 + x) is -inf at x = -1 and NaN below it. It is used on counts "
            "and amounts (log1p(clicks), log1p(price)), and a value of -1 or less is one of: "
            "a signed quantity (a refund, a net loss, a difference), which needs the signed "
            "transform sign(x) · log1p(|x|); a missing-value sentinel (-1, -999) or an error "
            "upstream; or log(1 - p) of a probability that reached 1."
        ),
        fix=(
            f"{first}\n"
            "# a sentinel: where the data is made, turn it into a missing-value indicator "
            "column and a neutral value\n"
            "# log(1 - p) of a probability p: torch.log1p(-p.clamp_max(1 - "
            "torch.finfo(p.dtype).eps))"
        ),
    )


_NAMESPACES = frozenset({"torch", "math", "np", "numpy", "torch.special", "special"})


def _log1p_calls(tree: ast.AST) -> list[tuple[ast.Call, ast.expr]]:
    """The ``torch.log1p(v)`` / ``v.log1p()`` calls of ``tree``, each with its argument."""
    out: list[tuple[ast.Call, ast.expr]] = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        if isinstance(f, ast.Name) and f.id == "log1p" and len(n.args) == 1:
            out.append((n, n.args[0]))
        elif isinstance(f, ast.Attribute) and f.attr in ("log1p", "log1p_"):
            if ast.unparse(f.value) in _NAMESPACES:
                if len(n.args) == 1 and ast.unparse(f.value) not in ("math", "np", "numpy"):
                    out.append((n, n.args[0]))
            elif not n.args:
                out.append((n, f.value))
    return sorted(out, key=lambda c: (c[0].col_offset, c[0].end_col_offset or 0))


def _inside(node: ast.AST, outer: ast.AST) -> bool:
    return any(n is node for n in ast.walk(outer))


def _failing_log1p(
    ctx: RuleContext, ev: OpEvent, x: TensorStat | None, tree: ast.AST
) -> tuple[ast.Call, ast.expr] | None:
    """The log1p call of the line whose argument reached -1: the only one; else the one on
    the side of a binary operator (``log1p(x) - log1p(-x)``) that the next op on the line
    received its -inf or NaN from; else the only one with a negated argument when every value
    it received is <= 0 (``-v`` of a v >= 0). None when that leaves it open."""
    calls = _log1p_calls(tree)
    if len(calls) <= 1:
        return calls[0] if calls else None
    use = next((o for o in ctx.trace.ops if o.cause is ev and o.source == ev.source), None)
    if use is not None and len(use.inputs) == 2:
        bad = [
            r
            for r, st in use.inputs
            if st is not None and (st.has_nan or st.has_posinf or st.has_neginf)
        ]
        ops = {"sub": ast.Sub, "add": ast.Add, "mul": ast.Mult, "div": ast.Div}
        kind = ops.get(packet(use.op).rstrip("_"))
        if len(bad) == 1 and kind is not None:
            for b in ast.walk(tree):
                if not (isinstance(b, ast.BinOp) and isinstance(b.op, kind)):
                    continue
                side = b.left if bad[0] == "self" else b.right
                other = b.right if bad[0] == "self" else b.left
                here = [c for c in calls if _inside(c[0], side)]
                if len(here) == 1 and any(_inside(c[0], other) for c in calls):
                    return here[0]
    negated = [c for c in calls if isinstance(c[1], ast.UnaryOp) and isinstance(c[1].op, ast.USub)]
    if len(negated) == 1 and x is not None and x.max <= 0:
        return negated[0]
    return None


def _fed_from_batch(ctx: RuleContext, ev: OpEvent, arg: ast.expr) -> bool:
    """log1p's argument is a plain name and the module running it took its input straight
    from the batch (a root's input, not another watched module's output): data, not a
    tensor the model computed."""
    if not isinstance(arg, ast.Name) or ev.path is None:
        return False
    by_index = {r.index: r for r in ctx.trace.records}
    ins = [r for r in ctx.records(Phase.INPUT) if r.path == ev.path]
    return bool(ins) and all(
        r.source is None or (src := by_index.get(r.source)) is None or src.phase is Phase.INPUT
        for r in ins
    )


def _sign_of(tree: ast.AST) -> set[str]:
    """The tensors whose sign the line takes: ``torch.sign(x)`` / ``x.sign()``."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "sign":
            if ast.unparse(n.func.value) in _NAMESPACES and len(n.args) == 1:
                out.add(ast.unparse(n.args[0]))
            elif not n.args:
                out.add(ast.unparse(n.func.value))
    return out


def _log1p_fix(ctx: RuleContext, ev: OpEvent, x: TensorStat | None) -> tuple[str, bool] | None:
    """The user's line with the log1p whose argument reached -1 kept above it, and whether
    that argument is data (read from the batch): ``sign(x) * log1p(mu * x)`` takes
    ``x.abs()`` (mu-law forgot the abs); ``log1p(-v)`` keeps v below 1; data is clamped
    to 0 (counts and amounts); a computed tensor is kept above -1. None when the line
    does not show which call."""
    for stmt, tree in _parsed(ev.code):
        hit = _failing_log1p(ctx, ev, x, tree)
        if hit is None:
            continue
        arg = hit[1]
        text = ast.get_source_segment(stmt, arg) or ast.unparse(arg)
        signed = [
            n
            for n in ast.walk(arg)
            if isinstance(n, (ast.Name, ast.Attribute)) and ast.unparse(n) in _sign_of(tree)
        ]
        if len(signed) == 1:
            v = ast.unparse(signed[0])
            a0, b0 = signed[0].col_offset - arg.col_offset, signed[0].end_col_offset
            b0 = (b0 or signed[0].col_offset) - arg.col_offset
            fixed = f"{text[:a0]}{v}.abs(){text[b0:]}"
            return (
                f"{_spliced(stmt, arg, fixed)}   # sign({v}) * log1p(c * |{v}|): the "
                f"magnitude goes into log1p, the sign outside",
                False,
            )
        if isinstance(arg, ast.UnaryOp) and isinstance(arg.op, ast.USub):
            v = ast.get_source_segment(stmt, arg.operand) or ast.unparse(arg.operand)
            fixed = f"-{paren(v)}.clamp_max(1 - torch.finfo({paren(v)}.dtype).eps)"
            return (
                f"{_spliced(stmt, arg, fixed)}   # log1p(-{v}) = log(1 - {v}): {v} reached 1; "
                f"below 1 it stays finite",
                False,
            )
        if _fed_from_batch(ctx, ev, arg):
            fixed = f"{paren(text)}.clamp_min(0)"
            call = hit[0]
            signed_call = f"torch.sign({text}) * torch.log1p({paren(text)}.abs())"
            whole = any(
                isinstance(n, (ast.Return, ast.Assign, ast.AnnAssign, ast.Expr)) and n.value is call
                for n in ast.walk(tree)
            )
            return (
                f"{_spliced(stmt, arg, fixed)}   # counts and amounts are >= 0\n"
                f"{_spliced(stmt, call, signed_call if whole else f'({signed_call})')}"
                "   # signed values (refunds, losses, differences): the sign outside, log1p "
                "of the magnitude",
                True,
            )
        fixed = f"{paren(text)}.clamp_min(-1 + torch.finfo({paren(text)}.dtype).eps)"
        return (
            f"{_spliced(stmt, arg, fixed)}   # log1p is finite above -1; find why "
            f"{text} reached -1",
            False,
        )
    return None


def _xlogy_backward(ctx: RuleContext, a: Anomaly, ev: OpEvent, trigger: OpEvent) -> Diagnosis:
    """xlogy(x, y) is 0 at x = 0 whatever y, but its gradient with respect to y is x / y:
    0/0 = NaN where y is 0 too (the entropy term xlogy(p, p) of a probability of 0)."""
    x = input_named(ev, "self")
    y = input_named(ev, "other")
    note = _kl_note(ctx, ev.path or a.path, ev.source, y) if has_zero(y) else None
    if note is not None:  # KLDivLoss's own xlogy(target, target)
        evidence = [
            f"in backward (autograd node {ev.node}), the gradient of {note.path}'s "
            f"xlogy(target, target) with respect to the target is target / target: 0/0 = NaN "
            "where the target is 0",
            f"the target: {describe_stat(y)}",
            *_chain_evidence(ev, trigger, ev.born),
        ]
        return _kl_target_grad(ctx, note, evidence, op_fields(ev, a))
    where = "where x and y are both 0" if "NaN" in ev.born else "where y is 0"
    value = "0/0 = NaN" if "NaN" in ev.born else "x/0 = ±inf"
    evidence = [
        f"in backward (autograd node {ev.node}), the gradient of xlogy(x, y) with respect "
        f"to y is x / y: {value} {where}",
        f"x (self): {describe_stat(x)}",
        f"y (other): {describe_stat(y)}",
        *_chain_evidence(ev, trigger, ev.born),
    ]
    return ctx.diagnosis(
        **op_fields(ev, a),
        title="Gradient of xlogy at 0",
        evidence=evidence,
        explanation=(
            "xlogy(x, y) = x·log(y) is defined as 0 where x = 0, so the forward value is "
            "finite, but its derivative with respect to y, x / y, is 0/0 = NaN where y is 0 "
            "as well: an entropy -xlogy(p, p).sum() over probabilities that underflowed to "
            "exactly 0 (a softmax of spread-out logits). Computing it from log-probabilities "
            "keeps every term finite."
        ),
        fix=(
            "logp = F.log_softmax(logits, dim=-1)\n"
            "ent = -(logp.exp() * logp).sum(-1)   # finite where p underflows to 0\n"
            "ent = torch.distributions.Categorical(logits=logits).entropy()   # the same\n"
            "ent = -torch.special.xlogy(p, p.clamp_min(torch.finfo(p.dtype).tiny)).sum(-1)"
            "   # when only p exists"
        ),
    )


def _kl_note(
    ctx: RuleContext, path: str | None, source: str | None, y: TensorStat | None = None
) -> Note | None:
    """The guard's note of the KL-divergence loss call (KLDivLoss or F.kl_div, probabilities
    as target) whose target holds exact zeros: the module at ``path``, the functional call
    on line ``source``, else the step's only such call. ``y``: the tensor the op took as
    the target, whose range and size the note's target must have."""

    def same(n: Note) -> bool:
        if y is None:
            return True
        shape = n.data.get("target_shape")
        size = math.prod(shape) if isinstance(shape, list) else None
        return note_num(n, "target_max") == y.max and (size is None or size == y.numel)

    kls = [
        n
        for n in ctx.notes("loss_input")
        if loss_kind(str(n.data.get("loss", n.path))) == "kldiv"
        and n.data.get("log_target") is not True
        and note_num(n, "target_min") == 0.0
        and same(n)
    ]
    for n in kls:
        if n.path == path or (source and n.source == source):
            return n
    return kls[0] if len(kls) == 1 else None


def _kl_target_untraced(ctx: RuleContext, a: Anomaly) -> Diagnosis | None:
    """A NaN gradient born in the backward of a KLDivLoss module, on its target (input[1]),
    op not traced: the target requires grad (it has an autograd node) and holds exact
    zeros, where the target gradient of xlogy(target, target) is 0/0."""
    rec = a.record
    if a.op is not None or rec.phase is not Phase.BACKWARD or rec.role != "input[1]":
        return None
    if loss_kind(rec.module_type) != "kldiv" or rec.stat is None or not rec.stat.has_nan:
        return None
    fwd = next(
        (
            r
            for r in ctx.trace.records
            if r.call == rec.call and r.phase is Phase.INPUT and r.role == "input[1]"
        ),
        None,
    )
    m = exact(ctx.trace, fwd) if fwd is not None else None
    node = fwd.grad_fn if fwd is not None else None
    t = m.stat if m is not None else None
    if node is None or t is None or not (t.finite and t.min == 0.0):
        return None
    note = _kl_note(ctx, a.path, None)
    if note is None:
        return None
    evidence = [
        a.summary,
        f"{a.path}'s target (input[1]) requires grad (autograd node {node}) and holds exact "
        f"zeros: {describe_stat(t)}",
        f"{a.path} computes xlogy(target, target) - target · input: its gradient with respect "
        "to the target holds target / target, 0/0 = NaN where the target is 0",
    ]
    fields = anomaly_fields(a)
    fields.update(source=note.source)
    return _kl_target_grad(ctx, note, evidence, fields)


def _kl_target_grad(
    ctx: RuleContext, note: Note, evidence: list[str], fields: dict[str, object]
) -> Diagnosis:
    loss = str(note.data.get("loss", note.path))
    functional = loss.startswith("F.") or note.path.startswith("F.")
    reduction = note.data.get("reduction")
    fixes = _kl_fixes(full_statement(note.source), functional, reduction)
    if fixes is None:
        fix = (
            f"# {loss}(input, target): pass target.detach() when the target is fixed (a "
            "teacher's or a clean prediction)\n"
            "# or pass log-probabilities (F.log_softmax, not F.softmax) as the target with "
            "log_target=True: finite gradient at a probability of 0"
        )
    else:
        detached, logged = fixes
        fix = f"{detached}   # a fixed target: no gradient through it"
        if logged:
            fix += f"\n# or keep the target's gradient: log-probabilities on both sides\n{logged}"
    return ctx.diagnosis(
        **fields,
        title=f"Gradient of {loss}'s target at 0",
        evidence=evidence,
        explanation=(
            f"{loss}(input, target) computes target · (log(target) - input) as xlogy(target, "
            "target) - target · input: 0 where the target is 0, so the loss is finite, but "
            "its gradient with respect to the target holds target / target, 0/0 = NaN there. "
            "The target requires grad (it was computed from the model and not detached) and "
            "holds exact zeros (a softmax of confident logits underflows to 0). Detach it "
            "when it is a fixed target, or pass log-probabilities with log_target=True, "
            "whose gradient is finite everywhere."
        ),
        fix=fix,
    )


def _callee(node: ast.Call) -> str:
    """``kl_div`` of ``F.kl_div(...)``, ``softmax`` of ``z.softmax(1)``."""
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _kl_fixes(stmt: str | None, functional: bool, reduction: object) -> tuple[str, str] | None:
    """The user's KL-divergence statement with its target detached, and (when the target is
    a softmax) the statement with log-probabilities and log_target=True (for a module, its
    construction with log_target=True above it); None when the line shows no such call."""
    if not stmt:
        return None
    try:
        tree = ast.parse(stmt)
    except SyntaxError:
        return None
    raw = stmt.encode()
    call: ast.Call | None = None
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or any(isinstance(x, ast.Starred) for x in node.args):
            continue
        kw = {k.arg for k in node.keywords}
        if functional:
            if _callee(node) == "kl_div":
                call = node
                break
            continue
        root = node.func
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id in ("torch", "F", "nn", "np", "math"):
            continue
        if len(node.args) + len(kw & {"input", "target"}) == 2 and kw <= {"input", "target"}:
            call = node
            break
    if call is None:
        return None
    kws = {k.arg: k.value for k in call.keywords if k.arg}
    tgt = kws.get("target", call.args[1] if len(call.args) > 1 else None)
    if tgt is None or tgt.end_col_offset is None:
        return None

    def seg(n: ast.AST) -> str:
        return ast.get_source_segment(stmt, n) or ""

    def edit(edits: list[tuple[int, int, str]]) -> str:
        out = raw
        for b, e, text in sorted(edits, reverse=True):
            out = out[:b] + text.encode() + out[e:]
        return out.decode()

    t0, t1 = tgt.col_offset, tgt.end_col_offset
    detached = edit([(t0, t1, f"{paren(seg(tgt))}.detach()")])
    if not (isinstance(tgt, ast.Call) and _callee(tgt) == "softmax"):
        return detached, ""
    f = tgt.func
    end = f.end_col_offset or 0
    name_at = end - len("softmax")
    edits = [(name_at, end, "log_softmax")]
    red = f"reduction={reduction!r}, " if isinstance(reduction, str) else ""
    if functional:
        flag = next((k for k in call.keywords if k.arg == "log_target"), None)
        if flag is not None and flag.value.end_col_offset is not None:
            edits.append((flag.value.col_offset, flag.value.end_col_offset, "True"))
        else:
            close = (call.end_col_offset or 1) - 1
            edits.append((close, close, ", log_target=True"))
        return detached, edit(edits)
    if isinstance(call.func, ast.Call):  # nn.KLDivLoss(...)(input, target) on the line
        close = (call.func.end_col_offset or 1) - 1
        sep = ", " if call.func.args or call.func.keywords else ""
        edits.append((close, close, f"{sep}log_target=True"))
        return detached, edit(edits)
    crit = seg(call.func)
    return detached, f"{crit} = nn.KLDivLoss({red}log_target=True)\n{edit(edits)}"


def _poisson_use(ctx: RuleContext, a: Anomaly, ev: OpEvent, x: TensorStat | None) -> LossUse | None:
    """The PoissonNLLLoss call (module or F.poisson_nll_loss) whose log this is: the loss
    module the op ran in, the functional call on the op's line, or the step's only one when
    the line is unknown; and the log's argument is that loss's input (the rates of
    log_input=False), not its target (the Stirling term of full=True)."""
    uses = [u for u in loss_uses(ctx.trace) if "poisson" in _loss_name(u).lower()]
    for u in uses:
        in_call = u.call is not None and u.path in (ev.path, a.path)
        on_line = u.note is not None and bool(ev.source) and u.note.source == ev.source
        lone = u.call is None and a.path == LOSS_PATH and not ev.source and len(uses) == 1
        if not (in_call or on_line or lone):
            continue
        s = u.input_stat
        lo = s.min if s is not None else note_num(u.note, "input_min")
        t = note_num(u.note, "target_min")
        if x is not None and lo is not None and t is not None and abs(x.min - t) < abs(x.min - lo):
            continue  # the log of the target
        return u
    return None


def _loss_name(u: LossUse) -> str:
    if u.call is not None:
        return u.call.module_type
    name = u.data("loss")
    return name if isinstance(name, str) else u.path


def _log_in_poisson(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    x: TensorStat | None,
    *,
    use: LossUse,
    evidence: list[str],
) -> Diagnosis:
    loss = _loss_name(use)
    functional = use.call is None
    n = scalar_num(ev, "n_outside")
    below = (
        f"{int(n):,} of its {x.numel:,} rates are below 0"
        if n is not None and x is not None
        else f"its smallest rate is {fmt(x.min if x is not None else None)}"
    )
    evidence.insert(
        0,
        f"{loss} with log_input=False computes input - target · log(input + eps): its input "
        f"must be a positive rate, and {below}",
    )
    raw = use.data("input_activation") or use.data("input_grad_fn")
    if isinstance(raw, str):
        evidence.append(f"the rates come from autograd node {raw}: nothing keeps them above 0")
    call = _poisson_call(ev.code) if functional else None
    if call is not None:
        log_rate = call.replace("log_input=False", "log_input=True")
        soft = rewrite_call(call, ["poisson_nll_loss"], lambda e: f"F.softplus({e})") or ""
        fix = (
            f"{log_rate}   # the raw output is a log-rate: exp(input) - target · input\n"
            f"{soft}   # or rates made positive"
        )
    elif functional:
        fix = (
            "loss = F.poisson_nll_loss(out, y, log_input=True)   # the raw output is a "
            "log-rate; rate = out.exp()\n"
            "loss = F.poisson_nll_loss(F.softplus(out), y, log_input=False)   # or a "
            "positive rate"
        )
    else:
        fix = (
            "criterion = nn.PoissonNLLLoss(log_input=True)   # the raw output is a log-rate\n"
            "loss = criterion(out, y)                        # predicted rate: out.exp()\n"
            "# or keep log_input=False and make the rate positive:\n"
            "loss = nn.PoissonNLLLoss(log_input=False)(F.softplus(out), y)"
        )
    return ctx.diagnosis(
        **op_fields(ev, a),
        evidence=evidence,
        explanation=(
            f"{loss} with log_input=False takes rates λ > 0 and computes their log: a rate "
            "below 0 gives NaN (and exactly 0 gives log(eps)). A model's raw output (a "
            "Linear) is negative about half the time. With log_input=True (the default) "
            "the loss takes the raw output as log λ and computes exp(input) - target · "
            "input, defined for every input; or keep rates and make them positive with "
            "softplus."
        ),
        fix=fix,
    )


def _poisson_call(code: str | None) -> str | None:
    """The user's line when it calls F.poisson_nll_loss with log_input=False."""
    if not code:
        return None
    line = code.split("  #", 1)[0].strip()
    if "poisson_nll_loss(" in line and re.search(r"log_input\s*=\s*False", line):
        return re.sub(r"log_input\s*=\s*False", "log_input=False", line)
    return None


def _zeros_text(x: object, name: str) -> str:
    from nanwatch.records import TensorStat

    if not isinstance(x, TensorStat):
        return "such values"
    if name == "log1p":
        return f"values down to {fmt(x.min)}"
    if x.zeros:
        return f"{x.zeros:,} exact zero{'s' if x.zeros != 1 else ''} of {x.numel:,} values"
    return f"values down to {fmt(x.min)}"


# ------------------------------------------------------------- a table read by index

#: calls that pass a tensor's values on unchanged, or as a root of them: a value read
#: from a table is still that entry (or 0 where the entry is 0) through them
_PASSING = frozenset(
    {
        "sqrt",
        "rsqrt",
        "float",
        "double",
        "half",
        "bfloat16",
        "to",
        "view",
        "reshape",
        "unsqueeze",
        "squeeze",
        "expand",
        "expand_as",
        "flatten",
        "contiguous",
        "clone",
        "detach",
        "type_as",
        "view_as",
        "reshape_as",
    }
)
#: calls that read entries of their first argument at the indices of another one
_GATHERS = {"gather": 2, "index_select": 2, "take": 1, "take_along_dim": 1}


@dataclass(frozen=True)
class _Lookup:
    """An operand of the op that the user's lines read from a table by index: ``ab =
    s.ab[t][:, None]``, then ``/ ab.sqrt()``. ``one``: the operand is 1 - the entry, so an
    entry of exactly 1 is its zero. ``made``: the statement that built the table as a
    cumulative product (``s.register_buffer("ab", torch.cumprod(1 - betas, 0))``), with
    the factor's ``1 - x`` name (``betas``) or the factor itself when it is no ``1 - x``."""

    operand: str  #: the op's operand as its line writes it: ``ab.sqrt()``
    table: str
    index: str
    lookup: str  #: the indexing expression: ``s.ab[t]``
    stmt: str | None  #: the statement that holds it when it is not the op's own line
    one: bool
    made: str | None = None
    made_at: str | None = None
    beta: str | None = None  #: ``betas`` of ``cumprod(1 - betas)``
    factor: str | None = None  #: the factor of ``cumprod(alphas)`` when it is no 1 - x


def _is_one(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value in (1, 1.0) and node.value is not True


def _passed(node: ast.expr) -> tuple[ast.expr, bool]:
    """``node`` without the calls that keep its zeros (sqrt, casts, reshapes, a ``[:,
    None]``) and with one ``1 - x`` taken off: (x, whether a 1 - was)."""
    one = False
    for _ in range(16):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            torch_fn = isinstance(f.value, ast.Name) and f.value.id == "torch"
            if torch_fn and f.attr in ("sqrt", "rsqrt") and len(node.args) == 1:
                node = node.args[0]
                continue
            if not torch_fn and f.attr in _PASSING:
                node = f.value
                continue
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Pow)
            and isinstance(node.right, ast.Constant)
        ):
            node = node.left
            continue
        if isinstance(node, ast.Subscript) and _only_slices(node.slice):
            node = node.value
            continue
        if (
            not one
            and isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Sub)
            and _is_one(node.left)
        ):
            node, one = node.right, True
            continue
        break
    return node, one


def _only_slices(s: ast.expr) -> bool:
    """A subscript that adds or keeps dimensions: ``[:, None]``, ``[..., None]``."""
    parts = s.elts if isinstance(s, ast.Tuple) else [s]
    return all(
        isinstance(p, ast.Slice)
        or (isinstance(p, ast.Constant) and (p.value is None or p.value is Ellipsis))
        for p in parts
    )


def _table_read(node: ast.expr, source: str | None) -> tuple[str, str, str] | None:
    """(table, index, the expression) when ``node`` reads entries of a named table at the
    indices of a named tensor: ``s.ab[t]``, ``ab.gather(0, t)``, ``torch.gather(ab, 0, t)``,
    ``ab.index_select(0, t)``, or a function of the user's file that does one of those with
    its first two arguments (``extract(self.ab, t, x.shape)``)."""

    def named(n: ast.expr) -> bool:
        while isinstance(n, ast.Attribute):
            n = n.value
        return isinstance(n, ast.Name)

    def index(n: ast.expr) -> bool:  # a tensor of indices: no number, slice or mask
        return named(n) or (isinstance(n, ast.Call) and named(n.func))

    if isinstance(node, ast.Subscript):
        if named(node.value) and index(node.slice) and not _only_slices(node.slice):
            return ast.unparse(node.value), ast.unparse(node.slice), ast.unparse(node)
        return None
    if not isinstance(node, ast.Call):
        return None
    f = node.func
    if isinstance(f, ast.Attribute) and f.attr in _GATHERS:
        own = isinstance(f.value, ast.Name) and f.value.id == "torch"
        args = node.args if own else [f.value, *node.args]
        at = _GATHERS[f.attr]
        if len(args) > at and named(args[0]) and index(args[at]):
            return ast.unparse(args[0]), ast.unparse(args[at]), ast.unparse(node)
        return None
    fn = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if fn is None or len(node.args) < 2 or not (named(node.args[0]) and index(node.args[1])):
        return None
    if _gathering_function(source, fn):
        return ast.unparse(node.args[0]), ast.unparse(node.args[1]), ast.unparse(node)
    return None


def _gathering_function(source: str | None, fn: str) -> bool:
    """A function ``fn`` of the user's file whose first argument it reads at the indices of
    its second (``def extract(a, t, shape): return a.gather(-1, t).reshape(...)``)."""
    parsed = _source_tree(source)
    if parsed is None:
        return False
    for d in ast.walk(parsed[0]):
        if not isinstance(d, ast.FunctionDef) or d.name != fn:
            continue
        params = [a.arg for a in d.args.args if a.arg not in ("self", "cls")]
        if len(params) < 2:
            continue
        for n in ast.walk(d):
            got = _table_read(n, None) if isinstance(n, (ast.Subscript, ast.Call)) else None
            if got is not None and got[:2] == (params[0], params[1]):
                return True
    return False


def _table_lookup(ev: OpEvent, operand: str | None) -> _Lookup | None:
    """The table ``operand`` (an operand of ``ev``, as the user's line writes it) was read
    from by index, following the names the line uses to the lines above that assigned
    them (``ab = s.ab[t][:, None]``); with the statement that built the table when it is
    a cumulative product in the user's file. None when the lines show no such read."""
    if operand is None or ev.phase is not Phase.FORWARD:
        return None
    try:
        node: ast.expr = ast.parse(_unwrapped(operand), mode="eval").body
    except SyntaxError:
        return None
    one, stmt = False, None
    for _ in range(4):
        node, flipped = _passed(node)
        one ^= flipped
        got = _table_read(node, ev.source)
        if got is not None:
            table, index, lookup = got
            if "." not in table:
                return None  # a tensor the function was given or computed (h[keep])
            return _built(ev, _Lookup(_unwrapped(operand), table, index, lookup, stmt, one))
        if not isinstance(node, ast.Name):
            return None
        made = _assigned_before(ev.source, node.id)
        if made is None:
            return None
        try:
            node = ast.parse(made.split("=", 1)[1].strip(), mode="eval").body
        except SyntaxError:
            return None
        stmt = made
    return None


def _built(ev: OpEvent, found: _Lookup) -> _Lookup:
    """``found`` with the statement of the user's file that builds its table, when that is
    a cumulative product (``self.ab = torch.cumprod(1 - betas, 0)``, ``register_buffer("ab",
    ...)``, or through an ``alphas = 1 - betas`` of the same function)."""
    parsed = _source_tree(ev.source)
    attr = found.table.rpartition(".")[2]
    if parsed is None or "." not in found.table:
        return found
    import linecache

    tree, line = parsed
    path = (ev.source or "").rpartition(":")[0]
    text = "".join(linecache.getlines(path))
    around = [  # the class whose method reads the table: its own attribute
        c
        for c in ast.walk(tree)
        if isinstance(c, ast.ClassDef) and c.lineno <= line <= (c.end_lineno or c.lineno)
    ]
    if not around:
        return found
    for fn in ast.walk(min(around, key=lambda c: (c.end_lineno or c.lineno) - c.lineno)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        local: dict[str, ast.expr] = {}
        for st in ast.walk(fn):
            if not isinstance(st, (ast.Assign, ast.Expr)):
                continue
            value: ast.expr | None = None
            if isinstance(st, ast.Assign):
                for t in st.targets:
                    if isinstance(t, ast.Name):
                        local[t.id] = st.value
                    elif isinstance(t, ast.Attribute) and t.attr == attr:
                        value = st.value
            elif (
                isinstance(st.value, ast.Call)
                and isinstance(st.value.func, ast.Attribute)
                and st.value.func.attr == "register_buffer"
                and len(st.value.args) >= 2
                and isinstance(st.value.args[0], ast.Constant)
                and st.value.args[0].value == attr
            ):
                value = st.value.args[1]
            if value is None:
                continue
            factor = _cumprod_factor(value, local)
            if factor is None:
                continue
            stmt = ast.get_source_segment(text, st) or ast.unparse(st)
            beta = None
            f_node = factor
            if isinstance(f_node, ast.Name) and f_node.id in local:
                f_node = local[f_node.id]
            if (
                isinstance(f_node, ast.BinOp)
                and isinstance(f_node.op, ast.Sub)
                and _is_one(f_node.left)
            ):
                beta = _segment(text, f_node.right)
            return replace(
                found,
                made=" ".join(stmt.split()),
                made_at=f"{path}:{st.lineno}",
                beta=beta,
                factor=_segment(text, factor),
            )
    return found


def _segment(text: str, node: ast.expr) -> str:
    """``node`` as the file writes it, on one line (``1e-4``, not ``0.0001``)."""
    return " ".join((ast.get_source_segment(text, node) or ast.unparse(node)).split())


def _cumprod_factor(value: ast.expr, local: Mapping[str, ast.expr]) -> ast.expr | None:
    """The factors of the cumulative product ``value`` is (``torch.cumprod(x, 0)``,
    ``x.cumprod(0)``, maybe under a sqrt or cast), or a local name assigned one."""
    for _ in range(3):
        node, one = _passed(value)
        if one:
            return None
        if isinstance(node, ast.Name) and node.id in local:
            value = local[node.id]
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr != "cumprod":
                return None
            own = isinstance(node.func.value, ast.Name) and node.func.value.id in ("torch", "np")
            if own:
                return node.args[0] if node.args else None
            return node.func.value
        return None
    return None


def _index_input(ctx: RuleContext, ev: OpEvent, a: Anomaly, n: int) -> str | None:
    """Evidence that the indices are the module's own integer input of ``n`` values (the
    batch's timesteps): one entry read per index."""
    path = ev.path or a.path
    for r in ctx.records(Phase.INPUT):
        if r.path == path and r.dtype.startswith(("int", "uint")) and math.prod(r.shape) == n:
            return (
                f"{path} was given an integer tensor of {count(n, 'value')} ({r.role}, "
                f"{r.dtype}), as many as the values read"
            )
    return None


def _table_zero(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    x: TensorStat,
    lk: _Lookup,
    *,
    evidence: list[str],
    title: str,
    operand: str,
    effect: str,
) -> Diagnosis:
    """The op's zero operand was read from a table by index (a noise schedule's alpha_bar
    at the batch's timesteps): the table holds 0 there (or 1, where the line takes 1 - it),
    and every item that draws such an index meets it. Said with the table, the indices,
    the statement that built the table, and fixes where it is built and where it is read."""
    dtype = ev.dtype or "float32"
    lim = limits(dtype) or limits("float32")
    assert lim is not None
    bad = "1" if lk.one else "0"
    zeros = f"{x.zeros:,} of the {count(x.numel, 'value')}" if x.zeros else "values"
    said = [
        f"{operand} {lk.operand} is "
        + ("1 - an entry" if lk.one else "an entry")
        + f" of the table {lk.table} read at the indices {lk.index}"
        + (f" ({lk.stmt})" if lk.stmt else ""),
        f"{zeros} are exactly 0: the entries of {lk.table} read for them are {bad}"
        + (", and 1 - 1 = 0" if lk.one else ""),
    ]
    if lk.made is not None:
        said.append(f"{lk.table} is a cumulative product, built at {lk.made_at}: {lk.made}")
    idx = _index_input(ctx, ev, a, x.numel)
    if idx is not None:
        said.append(idx)
    evidence[1:1] = said
    eps = f"torch.finfo(torch.{dtype}).eps"
    beta = lk.beta if lk.beta is not None and _NAME.fullmatch(lk.beta) else None
    if lk.made is not None:
        if lk.one:
            how = (
                f"A cumulative product is exactly 1 until its first factor below 1: "
                f"{lk.table} is 1 at its first indices while "
                + (f"{beta} is 0 there" if beta else "their betas are 0")
                + ", and 1 - 1 = 0."
            )
        else:
            how = (
                "A cumulative product is exactly 0 from its first factor of 0 on: "
                + (f"1 - {beta} = 0 where {beta} = 1" if beta else "a factor of 0, a beta of 1")
                + " (a schedule that ends at beta = 1, as a cosine schedule does without "
                f"clipping), or where the product falls below {dtype}'s smallest subnormal "
                f"({fmt(lim.subnormal)}): the last indices of {lk.table} are 0."
            )
    else:
        how = (
            f"The table itself holds {bad} there (a noise schedule's alpha_bar that reaches "
            + ("1 at its first timesteps" if lk.one else "0 at its last timesteps")
            + ", built with betas that reach "
            + ("0)." if lk.one else "1).")
        )
    explanation = (
        f"{operand[0].upper()}{operand[1:]} is {'1 - ' if lk.one else ''}an entry of "
        f"{lk.table} picked by {lk.index}, "
        f"and the entries picked for some items are {bad}: {effect} for every item that "
        f"draws such an index. {how} Keep every entry "
        + ("below 1" if lk.one else "above 0")
        + " where the table is built, or leave those indices out of the draw."
    )
    lines: list[str] = []
    if lk.made is not None:
        f = lk.factor or ""
        floor = f"{paren(f)}.clamp(max=1 - {eps})" if lk.one else f"{paren(f)}.clamp(min=1e-3)"
        new, at = lk.made, f"at {lk.made_at}"
        if re.fullmatch(r"[A-Za-z_]\w*", f):  # alphas = 1 - betas above: floored before
            new, at = f"{f} = {floor}", f"before {lk.made_at}"
        elif lk.beta is not None:  # cumprod(1 - betas): the betas clipped in place
            clip = (
                f"{paren(lk.beta)}.clamp(min={eps})"
                if lk.one
                else f"{paren(lk.beta)}.clamp(max=0.999)"
            )
            new = re.sub(
                rf"\b1(?:\.0*)?\s*-\s*{re.escape(lk.beta)}(?![\w.(\[])",
                lambda _: f"1 - {clip}",
                lk.made,
                count=1,
            )
        if new == lk.made and f and f in lk.made:
            new = lk.made.replace(f, floor, 1)
        if new != lk.made:
            lines.append(
                f"{new}   # {at}: "
                + (
                    f"every factor below 1, so no entry of {lk.table} is 1"
                    if lk.one
                    else f"every factor at least 0.001 (improved DDPM's max beta), so no "
                    f"entry of {lk.table} is 0"
                )
            )
        span = (
            f"draw {lk.index} from int(({lk.table} == 1).sum()) on"
            if lk.one
            else f"draw {lk.index} below int(({lk.table} > 0).sum())"
        )
        lines.append(f"# or leave those indices out: {span}")
    clamp = f".clamp(max=1 - {eps})" if lk.one else f".clamp(min={eps})"
    target = lk.stmt or (ev.code or "").split("  #", 1)[0].strip()
    if lk.lookup in target:
        fixed = target.replace(lk.lookup, f"{lk.lookup}{clamp}", 1)
        lines.append(
            ("# or clamp the value read: " if lines else "")
            + f"{fixed}"
            + ("" if lines else f"   # an entry of {bad} read as {'1 - eps' if lk.one else 'eps'}")
        )
    if lk.made is None:
        built = "betas above 0" if lk.one else "betas clipped to <= 0.999"
        lines.append(
            f"# better, where {lk.table} is built: keep every entry "
            f"{'below 1' if lk.one else 'above 0'} ({built} before a cumprod); the indices "
            f"to look at: ({lk.table} == {bad}).nonzero().flatten()"
        )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=f"{title}: {'1 - ' if lk.one else ''}{lk.table}[{lk.index}] is 0 for some {lk.index}",
        evidence=evidence,
        explanation=explanation,
        fix="\n".join(lines),
    )


# ---------------------------------------------------------------------- NW111


def _near_zero_division(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    *,
    num: TensorStat | None,
    den: TensorStat,
    closest: float,
) -> Iterator[Diagnosis]:
    """No zero in the denominator: a tiny one made x/d, or in backward x/d², too large for
    the dtype (a KL divergence written as p / q with q = softmax of large logits)."""
    lim = limits(ev.dtype)
    if lim is None:
        return
    evidence = [f"denominator holds no zero: {describe_stat(den)}"]
    if num is not None:
        evidence.append(f"numerator: {describe_stat(num)}")
    if ev.phase is Phase.BACKWARD:
        square = closest * closest
        fate = (
            f"below {ev.dtype}'s smallest value {fmt(lim.subnormal)}: it rounds to 0"
            if square < lim.subnormal / 2
            else f"and x/d² passes {ev.dtype}'s largest value {fmt(lim.max)}"
        )
        evidence.append(
            f"in backward (autograd node {ev.node}) the gradient with respect to d is -x/d²: "
            f"d² = {fmt(square)}, {fate}, so it is {ev.born}"
        )
        where = "its derivative -x/d² does not fit"
    else:
        evidence.append(
            f"{short_op(ev.op)} made {ev.born} in {ev.dtype}: x/d passes its largest value "
            f"{fmt(lim.max)} for |x| above {fmt(closest * lim.max)}"
        )
        where = "the quotient does not fit"
    line = code_line(ev)
    if line:
        evidence.append(line)
    yield ctx.diagnosis(
        **op_fields(ev, a),
        title="Division by a near-zero denominator",
        evidence=evidence,
        explanation=(
            f"The denominator is not zero but so close to it that {where} in {ev.dtype}: "
            "a probability from a softmax or sigmoid of large logits (1e-33 is ordinary "
            "there), a variance or a norm near 0. Dividing by probabilities is the usual "
            "source; in log space the same quantity is a subtraction and stays finite."
        ),
        fix=(
            "y = x / d.clamp_min(torch.finfo(d.dtype).eps)   # keeps x/d and x/d² in range\n"
            "# a ratio of probabilities: subtract logs instead of dividing\n"
            "log_ratio = torch.log(p) - F.log_softmax(logits, dim=-1)\n"
            'kl = F.kl_div(F.log_softmax(logits, dim=-1), p, reduction="batchmean")'
        ),
    )


@rule(
    "NW111",
    title="Division by zero",
    severity="error",
    summary=(
        "aten.div with a zero denominator: x/0 is ±inf and 0/0 is NaN (a std, a range "
        "max - min or a count that is exactly 0 for one batch)."
    ),
    priority=12,
)
def division_by_zero(ctx: RuleContext) -> Iterator[Diagnosis]:
    a = ctx.anomaly
    if a is None or a.transient:
        return
    cause = cause_of(a)
    if cause is not None and cause.kind == "inf-input":
        if nonfinite_scalars(cause.event):
            yield _scalar_given(ctx, a, cause.event, cause.trigger)
        else:
            yield _inf_given(ctx, a, cause.event, cause.trigger)
        return
    if cause is None or cause.kind != "div":
        return
    ev = cause.event
    if ev.phase is Phase.FORWARD and parametrization(ev.path or a.path) is not None:
        return  # spectral_norm's W / sigma: the cause is the stored tensor (NW100 says it)
    name = packet(ev.op)
    num = input_named(ev, "self", "input")
    den = denominator(ev)
    number = scalar_num(ev, "other")
    if den is None and number and "other" not in dict(ev.inputs):
        return  # a Python divisor that is not 0 (x / 1e-4 past the max): not x/0
    closest = smallest_magnitude(den)
    if closest is not None and den is not None and name != "reciprocal":
        yield from _near_zero_division(ctx, a, ev, num=num, den=den, closest=closest)
        return
    spectral = _SPECTRAL.get(node_base(ev.node)) if ev.phase is Phase.BACKWARD else None
    if spectral is not None:
        yield _spectral_backward(ctx, a, ev, spectral, cause.trigger)
        return
    evidence: list[str] = []
    zero_over_zero = "NaN" in ev.born and has_zero(num) and has_zero(den)
    integer = den is not None and den is integer_denominator(ev)
    unmeasured = den is None and any(n == "other" and s is None for n, s in ev.inputs)
    counted = (
        _float_count(ev, den) if den is not None and not integer and name != "reciprocal" else None
    )
    if integer and den is not None:
        evidence.append(
            f"denominator is an integer tensor (a count) holding 0: min {fmt(den.min)}, "
            f"max {fmt(den.max)} ({count(den.numel, 'value')})"
        )
    elif counted is not None and den is not None:
        # the counts that are 0 are groups with nothing in them: said of the count's own
        # entries (its numel, not the numerator's), with the verb agreeing with the number
        none_in = (
            f"{den.zeros:,} of its {den.numel:,} counts {'is' if den.zeros == 1 else 'are'} 0"
            if den.zeros is not None
            else f"some of its {den.numel:,} counts are 0"
        )
        evidence.append(
            f"denominator is a count held in a {ev.dtype} tensor (min 0, max {fmt(den.max)}): "
            f"{none_in}, "
            + ("a group with nothing in it" if den.zeros == 1 else "groups with nothing in them")
            + f"; {counted}"
        )
        integer = True
    elif den is not None:
        zeros = (
            f"{den.zeros:,} exact zero{'s' if den.zeros != 1 else ''}"
            if den.zeros
            else "exact zeros"
        )
        evidence.append(f"denominator holds {zeros}: {describe_stat(den)}")
    elif _python_count(ev):
        evidence.append(
            f"denominator: the scalar {ev.scalars['other']}, a Python int (a count), not a tensor"
        )
        if not ev.source:
            evidence.append(untraced_hint(ctx))
    elif "other" in ev.scalars:
        evidence.append(f"denominator: the scalar {ev.scalars['other']}")
    elif unmeasured:
        evidence.append(
            "denominator: an integer or bool tensor (a count), whose values this mode does "
            'not record; mode="forensic" records its min and max'
        )
    if num is not None and name != "reciprocal":
        evidence.append(f"numerator: {describe_stat(num)}")
    kinds = []
    if "NaN" in ev.born:
        kinds.append("0/0 = NaN" if zero_over_zero or num is None else "NaN")
    if "inf" in ev.born:
        kinds.append("x/0 = ±inf")
    evidence.append(f"{short_op(ev.op)} made {ev.born} in {ev.dtype}: {', '.join(kinds)}")
    evidence += _chain_evidence(ev, cause.trigger, ev.born)
    if ev.phase is Phase.BACKWARD:
        evidence.append(f"in backward (autograd node {ev.node})")
    title = "Division by zero (0/0)" if zero_over_zero else "Division by zero"
    renorm = (
        _renormalization(ev)
        if ev.phase is Phase.FORWARD
        and not integer
        and num is not None
        and num.min >= 0
        and den is not None
        and has_zero(den)
        and den.max > 0  # not every sum 0 (a dead layer: its own story below)
        else None
    )
    if renorm is not None:  # w = a / a.sum(-1, keepdim=True) with a row of a all 0
        x, d, fixed = renorm
        made = ev.scalars.get("other_made_from")
        flow = f" (data flow: {made.replace('<', ' <- ')})" if isinstance(made, str) else ""
        evidence.insert(
            1,
            f"the line divides {x} by its own sum, {d}{flow}: a renormalization to weights "
            "that sum to 1, not a count",
        )
        yield ctx.diagnosis(
            **op_fields(ev, a),
            title=f"{title} in a renormalization: a row whose weights are all 0",
            evidence=evidence,
            explanation=(
                f"The line divides {x} by its own sum to make weights that sum to 1, and a "
                f"row of {x} was all 0 (a mask that removed every entry, weights that were "
                "all cut to 0): its sum is 0 and 0/0 is NaN, in that row and in every "
                "gradient through the sum. The sum is not a count: its values are weights, "
                "and a sum below 1 is normal, so a floor of 1 (clamp_min(1)) would change "
                "those rows. A floor of the dtype's eps keeps an all-0 row 0 (and its "
                "gradient finite) and leaves every sum above it as it is."
            ),
            fix=fixed,
        )
        return
    limit = _removable_ratio(ev) if zero_over_zero and ev.phase is Phase.FORWARD else None
    if limit is not None:  # x / sin(x) at x = 0: a limit, not a zero to clamp
        said, why, fix = limit
        evidence.insert(0, said)
        yield ctx.diagnosis(
            **op_fields(ev, a), title=title, evidence=evidence, explanation=why, fix=fix
        )
        return
    under_scale = _underflowed_scale(ev, num) if _one_zero(ev, den) else None
    if under_scale is not None:  # amax / 127 below the dtype's smallest subnormal: 0
        said, why, fix = under_scale
        evidence.insert(0, said)
        yield ctx.diagnosis(
            **op_fields(ev, a), title=title, evidence=evidence, explanation=why, fix=fix
        )
        return
    off = _off_switch(ev.code) if _one_zero(ev, den) else None
    if off is not None:  # tanh(x / c) * c with c = 0: 0 means off, a floor keeps it 0
        name, guarded = off
        yield ctx.diagnosis(
            **op_fields(ev, a),
            title=title,
            evidence=evidence,
            explanation=(
                f"The denominator {name} is one number that also multiplies the "
                "result (like a soft cap, tanh(x / c) * c), and it was 0: a setting "
                "where 0 means the operation is off (a config's 'disabled'), not a "
                "value to divide by. x/0 is ±inf and 0/0 is NaN (in the backward too, "
                "where a forward multiplied by 0 shows nothing). A floor on the divisor "
                f"would keep the division finite, but the product with {name} = 0 "
                "leaves the output 0 and its gradient 0 forever: the model cannot "
                "learn. Skip the operation when it is 0."
            ),
            fix=f"{guarded}   # {name} = 0 means off: the operation is skipped",
        )
        return
    ball = _ball_factor(ev) if ev.phase is Phase.FORWARD else []
    if ball:  # 1 - |x|²: a point of the Poincaré ball on (or past) its boundary
        evidence.insert(
            0,
            "the denominator is made from 1 - |x|², the conformal factor of the unit "
            f"(Poincaré) ball: {'; '.join(made for _, made in ball)}; it is 0 for a point on "
            "the ball's boundary and negative outside it",
        )
        yield ctx.diagnosis(
            **op_fields(ev, a),
            title="Division by zero: a point on the boundary of the Poincaré ball",
            evidence=evidence,
            explanation=(
                "A hyperbolic model keeps its points strictly inside the unit ball, where "
                "1 - |x|² > 0; an optimizer step (plain SGD or Adam, not a Riemannian one) "
                "moved a point to |x| = 1 or beyond, so the factor is 0 and the distance "
                "divides by it. A guard that returns 0 there would call that point close to "
                "every other: project the points back inside after each step, and keep the "
                "factor off 0 (a margin below 1, as geoopt's PoincareBall does)."
            ),
            fix=_ball_fix(ctx, ball),
        )
        return
    vanish = (
        _limit_case(ev)
        if _one_zero(ev, den) and (num is None or (num.min == 0 and num.max == 0))
        else None
    )
    if vanish is not None:  # huber / kappa with huber built from kappa: 0/0, a limit
        c = vanish.name
        evidence.insert(
            0,
            f"the numerator is built from the divisor {c} too: {vanish.made}"
            + (f" ({vanish.where.rpartition('/')[2]})" if vanish.where else "")
            + f", which is 0 when {c} is 0",
        )
        yield ctx.diagnosis(
            **op_fields(ev, a),
            title="Division by zero (0/0)",
            evidence=evidence,
            explanation=(
                f"The divisor {c} is a Python number set to 0, and the numerator is made "
                f"from {c} as well, so it is 0 too: the line computes 0/0 = NaN. {c} = 0 is "
                "the limit case of the formula (like a Huber loss divided by its kappa, "
                "which becomes the plain L1/quantile loss as kappa -> 0), not a value to "
                "divide by. A floor "
                f"on {c} (max({c}, 1e-3)) would divide 0 by 1e-3: the result is exactly 0, "
                "its gradient is 0, and the model silently stops learning. Compute the limit "
                f"when {c} is 0, or require {c} > 0."
            ),
            fix=vanish.fix,
        )
        return
    empty = (
        _empty_selection(ctx, a, ev)
        if (has_zero(den) or unmeasured) and not _python_count(ev)
        else None
    )
    if empty is not None:
        yield _empty_selection_diagnosis(ctx, a, ev, empty, evidence=evidence)
        return
    gone = (
        _normalize_eps_lost(ev.code, ev.dtype)
        if ev.phase is Phase.FORWARD and has_zero(den) and not integer
        else None
    )
    if gone is not None:  # F.normalize's own eps (1e-12 by default) is 0 in this dtype
        yield _normalize_eps_diagnosis(ctx, a, ev, gone, evidence=evidence, title=title)
        return
    lost = (
        lost_eps(ev.code, ev.dtype, "div", zeros=has_zero(den))
        if ev.phase is Phase.FORWARD and not integer
        else None
    )
    if lost is not None:  # the line keeps the denominator off 0 with an eps that is 0 here
        evidence.insert(1, lost.words("the denominator"))
        known = lost.value
        if known is None:
            held = _attribute_value(ev.source, lost.text)
            if held is not None and 0 < held[0] <= lost.lim.subnormal / 2:
                known = held[0]
                evidence.insert(
                    2,
                    f"{lost.text} is {held[1]}: {fmt(known)}, which rounds to 0 in {lost.dtype}",
                )
        yield ctx.diagnosis(
            **op_fields(ev, a),
            title=(
                f"{title}: eps={fmt(known)} rounds to 0 in {lost.dtype}"
                if known is not None
                else title
            ),
            evidence=evidence,
            explanation=(
                "The eps added to the denominator on this line is meant to keep it off 0 "
                f"(a standard deviation or a norm of constant input is 0), but {ev.dtype} "
                f"cannot hold it: a number below half of {ev.dtype}'s smallest subnormal is "
                "stored as 0, so 0 + eps is still 0 and x/0 is ±inf, 0/0 NaN. Use an eps the "
                "dtype can hold, or compute the normalization in a wider dtype."
            ),
            fix=lost.fix(),
        )
        return
    under = (
        (_exp_underflow(ev) or _graph_underflow(ev)) if den is not None and not integer else None
    )
    if under is not None:
        yield _underflowed_denominator(ctx, a, ev, under, evidence=evidence, title=title)
        return
    minus = _exp_minus_one(ev) if den is not None and not integer and has_zero(den) else None
    if minus is not None:
        yield _exp_minus_one_denominator(ctx, a, ev, minus, evidence=evidence, title=title)
        return
    shrunk = (
        _shrinking_maker(ev)
        if den is not None and not integer and has_zero(den) and ev.phase is Phase.FORWARD
        else None
    )
    sat = _saturated_sum(ctx, ev) if shrunk is not None and shrunk.kind == "elu" else None
    if sat is not None and den is not None:  # the divisor is elu(x) + 1 itself, not a sum of it
        yield _saturated_sum_denominator(
            ctx,
            a,
            ev,
            den,
            sat,
            evidence=evidence,
            title=title,
            made=shrunk.made if shrunk else None,
            at=1,
        )
        return
    if shrunk is not None and den is not None:
        yield _shrunk_denominator(ctx, a, ev, den, shrunk, evidence=evidence, title=title)
        return
    if (
        den is not None
        and not integer
        and has_zero(den)
        and ev.phase is Phase.FORWARD
        and _softplus_made_it(ctx, ev, divisor=True) is not None
    ):
        yield _softplus_denominator(ctx, a, ev, den, evidence=evidence, title=title)
        return
    diff = _narrow_difference(ev) if den is not None and not integer else None
    if diff is not None:
        yield _cancelled_denominator(ctx, a, ev, diff, evidence=evidence, title=title)
        return
    # alpha_bar[t] of a schedule that reaches 0 (a float16 1 - ab that rounded: above)
    table = (
        _table_lookup(ev, next(iter(_divisors(ev.code)), None))
        if den is not None and not integer and has_zero(den) and den.min >= 0
        else None
    )
    if table is not None and den is not None:
        yield _table_zero(
            ctx,
            a,
            ev,
            den,
            table,
            evidence=evidence,
            title=title,
            operand="the denominator",
            effect="x/0 is ±inf (0/0 NaN)",
        )
        return
    if _in_distribution(ev):
        evidence.append(
            "the division is inside torch.distributions: it divides by the distribution's "
            "scale or its square (Normal.log_prob: (x - loc)² / (2·scale²))"
        )
        yield ctx.diagnosis(
            **op_fields(ev, a),
            title=title,
            evidence=evidence,
            explanation=_scale_text(ev.dtype),
            fix=_SCALE_FIX,
        )
        return
    if _python_count(ev):
        yield ctx.diagnosis(
            **op_fields(ev, a),
            title=title,
            evidence=evidence,
            explanation=_count_text(ev),
            fix=_count_fix(ev),
        )
        return
    if den is None and scalar_num(ev, "other") == 0 and "other" not in dict(ev.inputs):
        yield ctx.diagnosis(
            **op_fields(ev, a),
            title=title,
            evidence=evidence,
            explanation=(
                "The denominator is a Python number, not a tensor, and it was 0 at this step: "
                "a temperature, a scale or another hyperparameter that a schedule annealed to "
                "0 (0.07 * max(0, 1 - step / T) is 0 from step T on; tau = max(1 - 0.1 * step, "
                "0) is 0 at step 10), or that was set to 0. Every element is divided by it: "
                "x/0 is ±inf and 0/0 is NaN."
                + (
                    _scaled_scalar_text(ev)
                    or " Give the number a floor above 0, or end the schedule above 0."
                )
            ),
            fix=_div_fix(ev, scalar=True, count=False),
        )
        return
    norm_twice = (
        _norm_second_derivative(ev)
        if ev.phase is Phase.BACKWARD and node_base(ev.node) in _NORM_NODES
        else None
    )
    norm_node = _norm_divided_twice(ctx, a, ev, den) if norm_twice is None else None
    if norm_node is not None:
        norm_twice = _NORM_TWICE_TEMPLATE
    if norm_twice is not None:
        evidence.insert(
            0,
            f"the division is inside {ev.node}, the norm's own backward (x / ‖x‖): its "
            "gradient went NaN at a norm of 0, which the first backward masks to 0; only a "
            "second derivative (torch.autograd.grad(..., create_graph=True)) differentiates "
            "that division again"
            if norm_node is None
            else f"the division ({ev.node}) ran in a second backward "
            "(torch.autograd.grad(..., create_graph=True) built its graph), and its zero "
            f"denominator has the size of a norm's result ({norm_node}, "
            f"{count(den.numel, 'value') if den else '?'}): "
            "the norm's backward x / ‖x‖ differentiated again at a norm of 0",
        )
        yield ctx.diagnosis(
            **op_fields(ev, a),
            title=f"{title} in the second derivative of a norm at 0",
            evidence=evidence,
            explanation=(
                "The gradient of ‖x‖ is x / ‖x‖, which autograd sets to 0 where the norm is "
                "0; differentiating it again (forces from an energy, a gradient penalty, "
                "a PINN's Laplacian) divides by that 0 norm: 0/0 = NaN. A clamp on the norm "
                "(.clamp_min(eps)) or torch.linalg.vector_norm does not help, the norm's own "
                "backward still runs at 0. Keep the squared norm off exact 0 before the "
                "sqrt, with a where that gives the sqrt 1 there (the double-where trick)."
            ),
            fix=norm_twice,
        )
        return
    guard = _where_guard(ev.code) if ev.phase is Phase.BACKWARD else None
    if guard is not None:
        cond, fixed = guard
        evidence.insert(
            0,
            f"the line guards the division with torch.where({cond}, ...): the forward is "
            "finite, the NaN is in its gradient",
        )
        yield ctx.diagnosis(
            **op_fields(ev, a),
            title=f"{title} in the gradient of a torch.where-guarded division",
            evidence=evidence,
            explanation=(
                "torch.where does not stop the gradient of the branch it discards: the "
                "division is computed everywhere, the zero denominators included, and in "
                "backward the gradient of the discarded quotient is 0, multiplied by the "
                "inf of x/0 (or of -x/d²): 0 * inf = NaN. The guard hides the zeros from "
                "the forward only. Divide by a denominator that is never 0 inside the "
                "where (the double-where trick)."
            ),
            fix=f"{fixed}   # 1 where the guard discards the quotient: its gradient is 0, not NaN",
        )
        return
    learn = (
        _learnable_divisor(ctx, ev, ev.path or a.path)
        if ev.phase is Phase.FORWARD
        and den is not None
        and not integer
        and den.min >= 0
        and has_zero(den)
        else None
    )
    if learn is not None:  # LSQ's step size: clamp_min would freeze it at 0
        yield _learnable_diagnosis(ctx, a, ev, learn, evidence=evidence, title=title)
        return
    param = _divisor_parameter(ev) if den is not None and not integer and has_zero(den) else None
    if param is not None and den is not None:  # the op divided by a watched parameter itself
        yield _parameter_divisor(ctx, a, ev, den, param, evidence=evidence, title=title)
        return
    every = den is not None and not integer and den.numel > 1 and den.zeros == den.numel
    fix = _div_fix(
        ev,
        scalar=den is None and "other" in ev.scalars,
        count=integer or unmeasured,
        floating=den is not None and not integer,
        den=den,
    )
    named = _named_count_fix(ev, den) if _line_unknown(ev) else None
    if named is not None:  # the line unknown, the count's own name known (num_pos)
        said, fix = named
        evidence.insert(1, said)
    if (
        ev.phase is Phase.BACKWARD
        and node_base(ev.node) == "Div"
        and (not ev.source or ev.source == ev.backward_at)
        and _second_backward(ctx, a)
    ):  # the line unknown: a norm's backward differentiated again is the usual one
        fix += (
            "\n# in a second backward (create_graph=True), a norm's own backward x / ‖x‖ "
            "divides by the norm, and a clamp after the norm does not help; compute it as\n"
            "# d2 = (v ** 2).sum(dim=-1); d = torch.where(d2 > 0, torch.where(d2 > 0, d2, 1)"
            ".sqrt(), 0)"
        )
    graphed = (
        _graph_normalization(ctx, ev)
        if not integer and den is not None and has_zero(den) and _line_unknown(ev)
        else None
    )
    if graphed is not None and den is not None:  # x / x.norm() read from the graph
        yield _zero_vector_normalized(
            ctx, a, ev, graphed, den=den, fix=graphed.fix or fix, evidence=evidence, title=title
        )
        return
    if every and den is not None:  # no exp in sight (those returned above): 0 everywhere
        yield _all_zero_denominator(ctx, a, ev, den, evidence=evidence, title=title, fix=fix)
        return
    score = _overlap_score(ctx, ev) if "NaN" in ev.born and not integer else None
    if score is not None and score[0].endswith(_BOX_AREAS):
        said, fixed = score
        evidence.insert(1, said)
        yield ctx.diagnosis(
            **op_fields(ev, a),
            title=f"{title} in an IoU of two boxes of zero size",
            evidence=evidence,
            explanation=(
                "The division is an IoU of boxes, an intersection area over a union area, "
                "each a width times a height: where both boxes have zero size (a degenerate "
                "annotation with x1 == x2, a predicted box that collapsed to a point, both at "
                "the same place) it is 0/0 = NaN. Areas are in the coordinates' units, so "
                "the smoothing of 1 a dice of pixel masks uses is not small against them "
                "(areas of normalized coordinates are below 1): an eps under each division "
                "by an area is the usual remedy (torchvision's generalized_box_iou_loss adds "
                "1e-7), with boxes of zero size kept out of the loss."
            ),
            fix=fixed,
        )
        return
    if score is not None:
        said, smoothed = score
        evidence.insert(1, said)
        yield ctx.diagnosis(
            **op_fields(ev, a),
            title=f"{title} in an overlap score (dice, IoU) of two empty masks",
            evidence=evidence,
            explanation=(
                "The division is an overlap ratio, an intersection over the sizes of the "
                "two sets (dice 2|A∩B| / (|A| + |B|), IoU, F1): where the prediction and "
                "the target are both empty (a class absent from the batch, a masked-out "
                "instance) it is 0/0 = NaN. A clamp on the denominator turns it into 0, the "
                "worst score, so 1 - ratio charges a loss of 1 for a case that is perfectly "
                "predicted. The usual remedy is smoothing, (2·inter + s) / (sizes + s) with "
                "s = 1: 1 when both are empty, and almost unchanged elsewhere."
            ),
            fix=smoothed,
        )
        return
    evidence[1:1] = _which_division(ev) if not integer else []
    normed = _self_normalization(ev) if not integer and den is not None else None
    if normed is not None and den is not None:  # x / x.norm(): a zero vector, not a distance
        yield _zero_vector_normalized(
            ctx, a, ev, normed, den=den, fix=fix, evidence=evidence, title=title
        )
        return
    dist = (
        _distance_made(ctx, ev, den) if not integer and den is not None and has_zero(den) else None
    )
    if dist is not None:  # 1 / d of a pair distance: two points at the same place
        evidence.insert(1, dist)
        yield ctx.diagnosis(
            **op_fields(ev, a),
            title=f"{title} at a distance of 0",
            evidence=evidence,
            explanation=(
                "The denominator is a norm or distance, and it was exactly 0: two points "
                "at the same place (a duplicated atom or sample, the same coordinates "
                "written twice) or a self-pair i == j in the list of pairs. 1/d is inf "
                "there (and a distance written as sqrt(sum of squares) has a NaN gradient "
                "at 0; torch's norm and cdist give 0 there). Remove the cause "
                "where the pairs are built (drop i == j pairs, deduplicate the points); "
                "the fix keeps the line finite meanwhile."
            ),
            fix=f"{fix}\n# where the pairs are built: keep = i != j (no self-pairs), and "
            "drop duplicate points from the data",
        )
        return
    shared = (
        _shared_divisor(ev)
        if ev.phase is Phase.FORWARD
        and not integer
        and den is not None
        and den.min >= 0
        and "every division by" not in fix  # floored where it is made already
        else None
    )
    if shared is not None:
        name, lines = shared
        evidence.append(f"{name} is the divisor of {len(lines)} lines: {', '.join(lines)}")
        fix = (
            f"{name} = {name}.clamp_min(torch.finfo({name}.dtype).eps)   # once, before the "
            f"lines that divide by {name} ({', '.join(lines)}): each of them is finite, and "
            f"every {name} above the floor is unchanged\n"
            f"# or floor {name} where it is made (a lower bound on a predicted scale)"
        )
    rel = _relative_error(ev) if "NaN" in ev.born and not integer else None
    if rel is not None:  # sMAPE: |p - y| / (|p| + |y|) with p = y = 0, an exact prediction
        evidence.insert(1, rel)
        yield ctx.diagnosis(
            **op_fields(ev, a),
            title=f"{title} in a relative error of two zeros (sMAPE)",
            evidence=evidence,
            explanation=(
                "The division is a relative error, the absolute difference of two values "
                "over their sizes (sMAPE 2|p - y| / (|p| + |y|), a relative or Canberra "
                "distance): where both are 0 (a zero-demand day predicted as 0) it is 0/0 "
                "= NaN. The prediction is exact there, so its error is 0: a floor on the "
                "denominator gives 0/eps = 0 and leaves every other ratio as it was. A "
                "smoothing of 1 on both sides, as a dice uses, would charge that exact "
                "prediction an error of 1."
            ),
            fix=fix,
        )
        return
    yield ctx.diagnosis(
        **op_fields(ev, a),
        title=title,
        evidence=evidence,
        explanation=(
            "A denominator that is almost never zero was exactly zero in this batch: a "
            "standard deviation or a range (max - min) of a feature that did not vary, a "
            "norm of an all-zero vector, a count of selected elements that was 0. x/0 is "
            "±inf and 0/0 is NaN, and the whole column or row goes bad from here."
        ),
        fix=fix,
    )


def _relative_error(ev: OpEvent) -> str | None:
    """The evidence that the user's one division is a relative error: its numerator holds
    the absolute value of a difference (``(pred - y).abs()``, ``torch.abs(a - b)``) and its
    denominator is a sum over both of its terms (``pred.abs() + y.abs()``), so its 0/0 is
    two zeros, an exact match; None otherwise."""
    one = _one_division(ev.code)
    if one is None:
        return None
    stmt, div = one

    def differences(node: ast.AST) -> list[ast.BinOp]:
        found = []
        for n in ast.walk(node):
            if not isinstance(n, ast.Call):
                continue
            inner: ast.AST | None = None
            if isinstance(n.func, ast.Attribute) and n.func.attr == "abs" and not n.args:
                inner = n.func.value
            elif ast.unparse(n.func) in ("torch.abs", "abs") and len(n.args) == 1:
                inner = n.args[0]
            if isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Sub):
                found.append(inner)
        return found

    below = div.right
    if not (isinstance(below, ast.BinOp) and isinstance(below.op, ast.Add)):
        return None
    summed = _tensor_names(below)
    for diff in differences(div.left):
        a, b = _tensor_names(diff.left), _tensor_names(diff.right)
        if a and b and a <= summed and b <= summed:
            num = ast.get_source_segment(stmt, div.left) or ast.unparse(div.left)
            den = ast.get_source_segment(stmt, below) or ast.unparse(below)
            return (
                f"the ratio {num} / ({den}) is a relative error: the difference of "
                f"{ast.unparse(diff.left)} and {ast.unparse(diff.right)} over their sizes, "
                "0/0 only where both are 0"
            )
    return None


def _shared_divisor(ev: OpEvent) -> tuple[str, list[str]] | None:
    """The divisor of the user's line when it is a plain name that other lines of the same
    function divide by too (``upper = cdf((0.5 - v) / scales)``, ``lower = cdf((-0.5 - v) /
    scales)``): its name and those lines (``file.py:131``), in order. A guard on this line
    alone leaves the others dividing by 0; a floor on the name, before them all, does not."""
    seen: list[str] = []

    def keep(d: str) -> str:
        seen.append(d)
        return d

    if rewrite_divisor(ev.code, keep) is None or len(seen) != 1:
        return None
    name = seen[0].strip()
    if not re.fullmatch(r"[A-Za-z_]\w*", name):
        return None
    path = (ev.source or "").rpartition(":")[0]
    divides = re.compile(rf"(?<=[\w\)\]]) / {re.escape(name)}(?![\w.(\[])")
    lines = [
        f"{path.rpartition('/')[2]}:{n}"
        for n, text in _function_lines(ev.source)
        if divides.search(text.split("#", 1)[0])
    ]
    return (name, lines) if len(lines) > 1 else None


def _divisor_parameter(ev: OpEvent) -> tuple[str, str] | None:
    """The qualified name and holding module's type of the watched parameter that is the
    division's denominator itself (read by identity when the event was recorded: a
    ``ParameterList`` entry the line indexes, ``s.scales[1]``); None when it is not one."""
    role = "self" if packet(ev.op).rstrip("_") == "reciprocal" else "other"
    return next(((q, kind) for r, q, kind in ev.params if r == role), None)


def _parameter_access(qual: str, kind: str) -> str:
    """Python that reads the parameter ``qual`` from the model: ``scales.1`` ->
    ``model.scales[1]``, ``heads.a.scale`` -> ``model.heads.a.scale``; a key of a
    ``ParameterDict`` (``kind``), or one that is no identifier, subscripted
    (``model.scales["b"]``)."""
    parts = qual.split(".")
    out = "model"
    for i, part in enumerate(parts):
        if part.isdigit():
            out += f"[{part}]"
        elif part.isidentifier() and not (kind == "ParameterDict" and i == len(parts) - 1):
            out += f".{part}"
        else:
            out += f'["{part}"]'
    return out


def _parameter_divisor(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    den: TensorStat,
    held: tuple[str, str],
    *,
    evidence: list[str],
    title: str,
) -> Diagnosis:
    """NW111 when the denominator is a watched parameter itself (by identity, not by the
    line's text): named, with a fix that acts on it, its init and a floor that keeps its
    gradient (a clamp_min floor passes none below eps: the parameter would stay at 0)."""
    qual, kind = held
    owner = f" ({kind})" if kind else ""
    zeros = (
        "0 everywhere"
        if den.zeros == den.numel
        else f"0 in {den.zeros:,} of its {count(den.numel, 'value')}"
        if den.zeros
        else "0"
    )
    evidence.insert(0, f"the denominator is the parameter {qual}{owner}, which holds {zeros}")
    access = _parameter_access(qual, kind)
    fix = (
        f"with torch.no_grad():   # where {qual} is initialized: a divisor starts away from 0\n"
        f"    {access}.fill_(1.0)"
    )
    if den.min >= 0:  # a floor in value that keeps the gradient (not for a signed divisor)

        def floor(d: str) -> str:
            return f"({d} + ({d}.clamp_min(torch.finfo({d}.dtype).eps) - {d}).detach())"

        seen: list[str] = []

        def named(d: str) -> str:
            seen.append(d)
            return floor("d")

        line = _rewrite_divisor(ev.code, named)
        line = f"d = {seen[0]}\n{line}" if line and seen else f"d = {access}\ny = x / {floor('d')}"
        fix += f"\n{line}   # floored at eps in value, the gradient still reaches {qual}"
    fix += (
        f"\n# or keep {qual} positive while it trains: store its log and divide by its exp "
        "(or by F.softplus of it)"
    )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=f"{title}: the parameter {qual} is 0",
        evidence=evidence,
        explanation=(
            f"The op divides by the parameter {qual} itself, and it holds 0: a learnable "
            "divisor (a scale, a temperature) initialized to 0, set to 0, or trained to 0. "
            "x/0 is ±inf and 0/0 is NaN. A clamp_min(eps) on the line makes it finite but "
            f"passes no gradient below eps, so {qual} would stay at 0: start it away from 0, "
            "and floor its value without stopping its gradient, or keep it positive by "
            "parameterization."
        ),
        fix=fix,
    )


def _learnable_diagnosis(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, lv: _Learnable, *, evidence: list[str], title: str
) -> Diagnosis:
    """A zero divisor that is (made from) a learnable parameter: a floor by clamp_min passes
    no gradient below eps, so the parameter would stay 0; a straight-through floor keeps it."""
    made = (
        f"the divisor {lv.divisor} is made from {lv.attr}, a learnable parameter"
        if lv.name is not None
        else f"the divisor {lv.divisor} is a learnable parameter"
    )
    evidence.insert(
        0,
        f"{made} ({lv.qual}, an nn.Parameter of the module whose forward holds the line)",
    )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=f"{title}: a learnable divisor is 0",
        evidence=evidence,
        explanation=(
            f"The divisor is learnable and it was exactly 0 ({lv.attr} initialized from the "
            "data, like LSQ's step size 2·mean|x|/sqrt(Qp), is 0 on an all-zero first batch). "
            f"A clamp_min(eps) floor would make the line finite but passes no gradient below "
            f"eps: {lv.attr} would never move from 0 and the layer's output stays about 0. "
            "abs() + eps does not help either (the gradient of abs at 0 is 0). Floor its "
            "value but let the gradient through (x + (x.clamp_min(eps) - x).detach()), and "
            "start it above 0 where it is initialized."
        ),
        fix=_learnable_fix(ev, lv),
    )


def _norm_operand(node: ast.expr) -> ast.expr | None:
    """The tensor a norm call is taken of: ``x`` of ``x.norm(dim=-1)``,
    ``torch.linalg.vector_norm(x, dim=-1)``; None for anything else."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr == "norm":
        if ast.unparse(func.value) in ("torch", "torch.linalg"):
            return node.args[0] if node.args else None
        return func.value
    if ast.unparse(func) in _NORM_FUNCS and node.args:
        return node.args[0]
    return None


@dataclass(frozen=True)
class _Normalized:
    """A division of a tensor by its own norm on the user's line (``q / q.norm(...)``)."""

    stmt: str  #: the statement that holds the division
    x: str  #: the tensor normalized, as written
    divisor: str  #: the divisor, as written (a norm call, or a name assigned one)
    made: str | None  #: the assignment of that name, when the divisor is a name
    #: read from the autograd graph, the line unknown: what made the vector, and the fix
    maker: str | None = None
    fix: str | None = None


def _self_normalization(ev: OpEvent) -> _Normalized | None:
    """The user's division when its divisor is the norm of its own numerator (``x /
    x.norm(dim=-1, keepdim=True)``, or ``x / n`` with ``n = x.norm(...)`` above): a
    normalization, whose 0/0 is a zero vector, not two points at the same place."""
    picked = _picked_division(ev)
    if picked is None:
        return None
    stmt, div, _ = picked
    right: ast.expr = div.right
    made = None
    if isinstance(right, ast.Name):
        value = _unconditional_assignment(ev, right.id)
        if value is None:
            return None
        made = _assigned_before(ev.source, right.id)
        right = value
    while True:  # a norm moved into place: n[:, None], n.unsqueeze(-1), n.expand_as(x)
        if isinstance(right, ast.Subscript):
            right = right.value
        elif (
            isinstance(right, ast.Call)
            and isinstance(right.func, ast.Attribute)
            and right.func.attr in ("unsqueeze", "view", "reshape", "expand", "expand_as")
        ):
            right = right.func.value
        else:
            break
    operand = _norm_operand(right)
    if operand is None or ast.unparse(operand) != ast.unparse(div.left):
        return None
    x = ast.get_source_segment(stmt, div.left) or ast.unparse(div.left)
    d = ast.get_source_segment(stmt, div.right) or ast.unparse(div.right)
    return _Normalized(stmt=stmt, x=x, divisor=d, made=made)


def _graph_normalization(ctx: RuleContext, ev: OpEvent) -> _Normalized | None:
    """A division whose line is unknown (watch and sentinel modes read the loss graph) when
    the graph shows its divisor is the norm of its own numerator (``other_norm_of_self``,
    see :func:`nanwatch.ops._own_norm`): ``x / x.norm()``, with the watched module whose
    output is ``x`` (``made_from``: the numerator's producer) when one is."""
    if not ev.scalars.get("other_norm_of_self"):
        return None
    dim = ev.scalars.get("norm_dim")
    d = f"dim={dim}" if isinstance(dim, int) else ""
    maker = None
    num = input_named(ev, "self", "input")
    chain = ev.made_from
    if num is not None and chain and chain[0].startswith("watched:"):
        op = chain[0].removeprefix("watched:")
        outs = [  # the watched outputs the numerator is: its values, or its node and size
            r
            for r in ctx.records(Phase.FORWARD)
            if r.role.startswith("output")
            and (
                (r.stat.numel, r.stat.min, r.stat.max) == (num.numel, num.min, num.max)
                if r.stat is not None
                else node_base(r.grad_fn).lower() == op and math.prod(r.shape) == num.numel
            )
        ]
        roots = {r.call for r in ctx.trace.root_outputs()}
        if outs:
            inner = max(outs, key=lambda r: (r.call not in roots, r.path.count(".")))
            maker = (
                f"{inner.path} ({inner.module_type})"
                if inner.call not in roots
                else f"the model ({inner.module_type})"
            )
    said = f"the output of {maker}" if maker else "the tensor normalized"
    divisor = f"x.norm({d}, keepdim=True)" if d else "x.norm()"
    fix = (
        f"x = F.normalize(x, {d})   # a pattern, in your names: x, {said}; in place of "
        f"x / {divisor}: it divides by max(norm, 1e-12), so a zero vector stays 0, not NaN"
        if d
        else f"x = x / x.norm().clamp_min(1e-12)   # a pattern, in your names: x, {said}: "
        "a zero tensor stays 0, not NaN"
    ) + f"\n{_FORENSIC_LINE}"
    return _Normalized(
        stmt="",
        x="x",
        divisor=divisor,
        made=None,
        maker=maker,
        fix=fix,
    )


def _function_lines(source: str | None, reach: int = 200) -> list[tuple[int, str]]:
    """The lines (number, text) of the function that holds line ``source``
    (``file.py:42``), read from the file; [] when it cannot be read."""
    import linecache

    path, _, num = (source or "").rpartition(":")
    if not path or not num.isdigit():
        return []
    line = int(num)
    here = linecache.getline(path, line)
    indent = len(here) - len(here.lstrip())
    start = None
    for n in range(line - 1, max(0, line - reach), -1):
        text = linecache.getline(path, n)
        if re.match(r"\s*(?:async\s+)?def\s", text) and len(text) - len(text.lstrip()) < indent:
            start = n
            break
    if start is None:
        return []
    top = linecache.getline(path, start)
    depth = len(top) - len(top.lstrip())
    out: list[tuple[int, str]] = []
    for n in range(start + 1, start + reach):
        text = linecache.getline(path, n)
        if not text:
            break
        if text.strip() and len(text) - len(text.lstrip()) <= depth:
            break
        out.append((n, text))
    return out


def _same_normalizations(ev: OpEvent, x: str) -> list[tuple[int, str, str]]:
    """The other hand-written L2 normalizations (``k = k / k.norm(dim=-1, keepdim=True)``)
    in the function of the user's line, each (line number, tensor, its F.normalize
    rewrite): the same 0/0 waits there for the next run once this line is fixed."""
    line = int((ev.source or "").rpartition(":")[2] or 0)
    out: list[tuple[int, str, str]] = []
    for n, text in _function_lines(ev.source):
        if n == line:
            continue
        for stmt in statements(text.split("  #", 1)[0].strip()):
            if not stmt.isascii():
                continue
            try:
                tree = ast.parse(stmt)
            except SyntaxError:
                continue
            for div in ast.walk(tree):
                if not (isinstance(div, ast.BinOp) and isinstance(div.op, ast.Div)):
                    continue
                operand = _norm_operand(div.right)
                if operand is None or ast.unparse(operand) != ast.unparse(div.left):
                    continue
                fixed = _normalize_fix(stmt, div)
                name = ast.unparse(div.left)
                if fixed is not None and name != x:
                    out.append((n, name, fixed))
    return out


def _zero_vector_normalized(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    normed: _Normalized,
    *,
    den: TensorStat,
    fix: str,
    evidence: list[str],
    title: str,
) -> Diagnosis:
    """``x / x.norm()`` at a zero vector: 0/0. F.normalize divides by max(norm, eps)."""
    zeros = den.zeros or 0
    said = f"{zeros:,} of {count(den.numel, 'norm')} {'is' if zeros == 1 else 'are'} 0"
    how = f"{normed.divisor}, assigned {normed.made}" if normed.made else normed.divisor
    if normed.stmt:
        evidence.insert(
            1,
            f"the divisor {how} is the norm of the numerator {normed.x} itself: a "
            f"normalization, and {said} (an all-zero vector of {normed.x})",
        )
    else:  # read from the graph: the norm's input is the numerator's own autograd node
        of = f", the output of {normed.maker}" if normed.maker else ""
        evidence.insert(
            1,
            "the autograd graph shows the divisor is the norm of the numerator itself"
            f"{of}: a normalization x / {normed.divisor}, and {said} (an all-zero vector)",
        )
    relu = normed.maker is not None and _chain_producer(ev.made_from) == "relu"
    others = _same_normalizations(ev, normed.x)
    if others:
        head, sep, rest = fix.partition("\n")
        more = "\n".join(
            f"{fixed}   # line {n}: the same normalization of {name}, 0/0 at a zero vector too"
            for n, name, fixed in others
        )
        fix = f"{head}\n{more}{sep}{rest}"
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=f"{title} normalizing a zero vector",
        evidence=evidence,
        explanation=(
            f"{normed.x} / ‖{normed.x}‖ is 0/0 = NaN for a vector that is all zeros: "
            + (
                f"here the output of {normed.maker}"
                + ("" if "(ReLU)" in (normed.maker or "") else ", made by a ReLU")
                + ": all zeros for a sample whose every unit is off (each pre-activation "
                "below 0), and with no gradient to turn them back on. "
                if relu
                else "a token or embedding that is exactly 0 (a cls token or padding row "
                "initialised to zeros, a padding_idx embedding, a masked-out position, a "
                "layer without bias fed zeros). "
            )
            + "F.normalize divides by max(‖x‖, eps) instead, so a zero vector "
            "stays 0 and its gradient is finite; elsewhere the result is unchanged."
        ),
        fix=_before_forensic_line(
            fix,
            "# and a ReLU right before a normalization zeroes whole vectors: F.gelu or "
            "F.leaky_relu there keeps them nonzero and trainable"
            if relu
            else "",
        ),
    )


def _before_forensic_line(fix: str, line: str) -> str:
    """``fix`` with ``line`` added, above its closing hint to run forensic mode if any."""
    if not line:
        return fix
    head, sep, tail = fix.rpartition(f"\n{_FORENSIC_LINE}")
    return f"{head}\n{line}{sep}{tail}" if sep and not tail else f"{fix}\n{line}"


#: autograd nodes of a norm or a distance (``LinalgVectorNormBackward0``, ``CdistBackward0``)
_DISTANCE_NODES = frozenset(
    {"LinalgVectorNorm", "Norm", "LinalgNorm", "Cdist", "EuclideanDist", "Dist"}
)
#: calls that return a norm or a distance
_DISTANCE_CALLS = frozenset({"norm", "vector_norm", "cdist", "dist", "pairwise_distance"})


def _distance_made(ctx: RuleContext, ev: OpEvent, den: TensorStat) -> str | None:
    """Evidence that the zero denominator of ``ev`` is a norm or a distance: the autograd
    nodes that made it (``*_made_by``: a norm node, or a sqrt of a sum of squares), a
    module output of this step with the same statistics that a norm node made, else the
    user's line (the divisor, or the statement above that assigned a name it uses, calls
    ``.norm()``, ``torch.cdist``, ``torch.sqrt((a - b) ** 2).sum(-1))``...). None when
    none shows one."""
    for k, v in ev.scalars.items():
        if not (k.endswith("_made_by") and isinstance(v, str)):
            continue
        nodes = v.split("<")
        bases = [node_base(n) for n in nodes]
        hit = next((n for n in nodes if node_base(n) in _DISTANCE_NODES), None)
        if hit is None and "Sqrt" in bases:
            rest = bases[bases.index("Sqrt") + 1 :]
            squares = ("Pow", "Square", "Mul")
            if "Sum" in rest and any(b in squares for b in rest[rest.index("Sum") :]):
                hit = nodes[bases.index("Sqrt")]
        if hit is not None:
            return f"the denominator was made by autograd node {hit} (a norm or distance)"
    for r in ctx.trace.records:  # the same values, output by a module: its autograd node
        s = r.stat
        if (
            r.phase is Phase.FORWARD
            and node_base(r.grad_fn) in _DISTANCE_NODES
            and s is not None
            and (s.numel, s.min, s.max) == (den.numel, den.min, den.max)
            and s.zeros in (None, den.zeros)
        ):
            return (
                f"the denominator has the values of {r.path}'s {r.role}, which "
                f"{r.grad_fn} made (a norm or distance): {describe_stat(s)}"
            )
    for div in _divisors(ev.code):
        texts = [div]
        for name in dict.fromkeys(re.findall(r"(?<![\w.])([A-Za-z_]\w*)(?![\w(])", div)):
            made = _assigned_before(ev.source, name)
            if made is not None:
                texts.append(made)
        for text in texts:
            if _is_distance(text, ev.source):
                said = "the divisor" if text is div else text.split("=", 1)[0].strip()
                return f"{said} is a norm or distance: {text}"
    return None


def _difference(node: ast.expr, source: str | None) -> bool:
    """``node`` is made by a subtraction (``p[i] - p[j]``, ``x[:, None] - x[None]``,
    ``a.sub(b)``), or is a name assigned one above line ``source``."""
    if isinstance(node, ast.Name):
        made = _assigned_before(source, node.id)
        if made is None:
            return False
        try:
            node = ast.parse(made.split("=", 1)[1].strip(), mode="eval").body
        except SyntaxError:
            return False
    return any(
        (isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub))
        or (isinstance(n, ast.Call) and ast.unparse(n.func).rpartition(".")[2] == "sub")
        for n in ast.walk(node)
    )


def _is_distance(text: str, source: str | None = None) -> bool:
    """``text`` (an expression or an assignment) computes a norm or distance at its top or
    through scalings: ``(p[i] - p[j]).norm(dim=-1)``, ``torch.cdist(a, b)``,
    ``torch.sqrt(((a - b) ** 2).sum(-1))``, ``d / cutoff``; a norm only of a difference
    (``x.norm()`` alone is a length, not a distance)."""
    try:
        tree = ast.parse(text.strip())
    except SyntaxError:
        return False
    body = tree.body[0] if len(tree.body) == 1 else None
    node: ast.AST | None = (
        body.value if isinstance(body, (ast.Assign, ast.Expr, ast.AnnAssign)) else None
    )
    while node is not None:
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
            # a distance scaled by a number: d / cutoff, 2 * d
            node = node.left if not isinstance(node.left, ast.Constant) else node.right
            continue
        if isinstance(node, ast.Subscript):  # d[:, None]
            node = node.value
            continue
        if not isinstance(node, ast.Call):
            return False
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else ast.unparse(func)
        if name in ("norm", "vector_norm"):  # a distance is the norm of a difference
            operand = _norm_operand(node)
            return operand is not None and _difference(operand, source)
        if name in _DISTANCE_CALLS:
            return True
        if name == "sqrt":
            arg = (
                node.args[0]
                if node.args
                else func.value
                if isinstance(func, ast.Attribute)
                else None
            )
            return arg is not None and _sum_of_squares(arg)
        if name in ("clamp", "clamp_min", "float", "unsqueeze", "squeeze", "view", "reshape"):
            node = func.value if isinstance(func, ast.Attribute) else None
            continue
        return False
    return False


def _sum_of_squares(node: ast.expr) -> bool:
    """``((a - b) ** 2).sum(-1)``, ``x.pow(2).sum(1)``, ``torch.sum(v * v, -1)``,
    ``dx ** 2 + dy ** 2``."""

    def square(n: ast.expr) -> bool:
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow):
            return isinstance(n.right, ast.Constant) and n.right.value == 2
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult):
            return ast.unparse(n.left) == ast.unparse(n.right)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            if n.func.attr == "square":
                return True
            if n.func.attr == "pow" and n.args:
                a0 = n.args[-1]
                return isinstance(a0, ast.Constant) and a0.value == 2
        return False

    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):  # dx ** 2 + dy ** 2
        return square(node.right) and (square(node.left) or _sum_of_squares(node.left))
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "sum":
            inner = node.args[0] if ast.unparse(func.value) == "torch" and node.args else func.value
            return square(inner)
    return False


#: names that call a ratio an overlap score
_OVERLAP_NAMES = re.compile(
    r"(?<![A-Za-z])(?:inter|intersection|intersect|union|dice|[gdc]?iou|jaccard|tversky"
    r"|overlap|f1|tp)(?![A-Za-z])",
    re.I,
)


def _earlier_value(ev: OpEvent, stmt: str, name: str) -> ast.expr | None:
    """The value of the last ``name = value`` in the statements of the user's line before
    ``stmt`` (``inter = (p * t).sum(); return 1 - 2 * inter / ...``), else of the last one
    above the line that runs whenever it does."""
    value = None
    for earlier in statements(ev.code):
        if earlier == stmt:
            break
        try:
            node = ast.parse(earlier).body
        except SyntaxError:
            continue
        if len(node) == 1 and isinstance(node[0], ast.Assign) and len(node[0].targets) == 1:
            target = node[0].targets[0]
            if isinstance(target, ast.Name) and target.id == name:
                value = node[0].value
    return value if value is not None else _unconditional_assignment(ev, name)


def _sum_of(ev: OpEvent, node: ast.expr, stmt: str) -> bool:
    """Whether ``node``, or the value assigned to it earlier on the line (before ``stmt``)
    or above it when it is a name, is a sum or difference at its top (``a.sum() + b.sum()``,
    ``area_a + area_b - inter``): sizes of two sets added, not a product of norms."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr not in ("clamp", "clamp_min", "clamp_", "clamp_min_", "float"):
            break
        node = node.func.value
    if isinstance(node, ast.Name):
        value = _earlier_value(ev, stmt, node.id)
        if value is not None:
            node = value
    return isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub))


def _tensor_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id not in _MODULES}


def _expanded(ev: OpEvent, node: ast.expr, stmt: str) -> tuple[set[str], bool]:
    """The tensor names ``node`` (of the line's statement ``stmt``) is made of, each name
    assigned earlier on the line or above it in the line's function replaced by the names of
    its value (one level); and whether a product is among them."""
    names: set[str] = set()

    def tensors_product(n: ast.AST) -> bool:  # a * b, not 2 * |p - y| (a scaled difference)
        return (
            isinstance(n, ast.BinOp)
            and isinstance(n.op, ast.Mult)
            and not isinstance(n.left, ast.Constant)
            and not isinstance(n.right, ast.Constant)
        )

    product = any(tensors_product(n) for n in ast.walk(node))
    for name in _tensor_names(node):
        value = _earlier_value(ev, stmt, name)
        if value is None:
            names.add(name)
            continue
        names |= _tensor_names(value) or {name}
        product = product or any(tensors_product(n) for n in ast.walk(value))
    return names, product


def _overlap_terms(ev: OpEvent, stmt: str, div: ast.BinOp) -> list[str]:
    """The tensors a division's numerator multiplies and its denominator sums (``2 * (p *
    t).sum() / (p.sum() + t.sum())``: p and t), two or more: a ratio of two overlapping sums,
    whose 0/0 means both sets are empty; [] otherwise (``(x * m).sum() / m.sum()``, a mean
    over a mask, shares one)."""
    top, product = _expanded(ev, div.left, stmt)
    low, _ = _expanded(ev, div.right, stmt)
    shared = top & low
    return sorted(shared) if len(shared) >= 2 and product and _sum_of(ev, div.right, stmt) else []


#: the evidence that an overlap score's terms are areas of boxes (see :func:`_box_areas`)
_BOX_AREAS = (
    "of box areas, a width times a height made of coordinate differences (not counts of "
    "elements): two boxes of zero size, 0/0"
)


def _box_areas(ev: OpEvent, stmt: str, div: ast.BinOp) -> bool:
    """Whether the ratio's terms (or the values assigned to their names on the line or above
    it) hold an area, a product of two differences (``(x2 - x1).clamp(min=0) * (y2 -
    y1).clamp(min=0)``), and no sum: sizes of boxes in the coordinates' units, not counts
    of elements as a dice of masks sums."""
    nodes: list[ast.AST] = [div.left, div.right]
    for node in (div.left, div.right):
        for name in _tensor_names(node):
            value = _earlier_value(ev, stmt, name)
            if value is not None:
                nodes.append(value)

    def difference(n: ast.AST) -> bool:
        while isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            if n.func.attr not in ("clamp", "clamp_min", "clip", "abs", "float"):
                return False
            n = n.func.value
        return isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub)

    summed = any(
        isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "sum"
        for n in nodes
        for c in ast.walk(n)
    )
    area = any(
        isinstance(c, ast.BinOp)
        and isinstance(c.op, ast.Mult)
        and difference(c.left)
        and difference(c.right)
        for n in nodes
        for c in ast.walk(n)
    )
    return area and not summed


def _overlap_score(ctx: RuleContext, ev: OpEvent) -> tuple[str, str] | None:
    """A 0/0 that is an overlap score of two empty sets (dice, IoU, F1): the user's one
    division whose numerator is a product of the tensors its denominator sums (or names
    call it so: ``inter``, ``union``, ``dice``, ``iou``), or, the line unknown, a loss graph
    of 1 - a ratio of sums of products. (evidence, fix) with the smoothed ratio; None
    otherwise."""
    one = _one_division(ev.code)
    if one is not None:
        stmt, div = one
        num = ast.get_source_segment(stmt, div.left)
        d = ast.get_source_segment(stmt, div.right)
        if num is None or d is None:
            return None
        shared = _overlap_terms(ev, stmt, div)
        named = _OVERLAP_NAMES.search(stmt) is not None
        if not (named or shared):
            return None
        why = (
            f"the ratio's numerator {num} is made of {', '.join(shared)}, which its "
            f"denominator {d} sums: an overlap score"
            if shared
            else f"the line names an overlap score: {stmt.strip()}"
        )
        if not shared and _box_areas(ev, stmt, div):
            # areas in the coordinates' units: a smoothing of 1 is not small against them
            unit = d if d.isidentifier() else f"({d})"
            fixed = _spliced(
                stmt, div.right, f"({d} + torch.finfo({unit}.dtype).eps)", grouped=True
            )
            return (
                f"{why}; {_BOX_AREAS}",
                f"{fixed}   # an eps under {d}: 0, not NaN, where both boxes have zero "
                "size, every other ratio as it was (a smoothing of 1 would move those of "
                "areas not much larger than 1 in your units)\n"
                "# the same eps under each later division by an area (GIoU's enclosing box)\n"
                "# and keep boxes of zero width or height (x2 <= x1 or y2 <= y1) out of the "
                "loss: they are bad annotations or collapsed predictions",
            )
        smoothed = _spliced(stmt, div, f"({num} + 1) / ({d} + 1)")
        return why, (
            f"{smoothed}   # smoothing s = 1: two empty sets score 1, not NaN (a clamp would "
            "score them 0, the worst)"
        )
    if ev.code or ev.path != LOSS_PATH:
        return None
    for ops in _graph_ops(ctx):
        for i in range(len(ops) - 1):
            if ops[i] != "rsub":
                continue
            j = i + 1 + (ops[i + 1] in ("mean", "sum"))
            if j >= len(ops) or ops[j] != "div":
                continue
            below = ops[j + 1 : j + 16]
            if "add" in below and below.count("sum") >= 2 and "mul" in below:
                return (
                    "the loss is 1 - a ratio of sums (autograd ops rsub, div, add, sum, mul): "
                    "an overlap score, dice or IoU, of sums of products",
                    "score = (2 * (pred * target).sum(dims) + 1) / (pred.sum(dims) + "
                    "target.sum(dims) + 1)   # smoothing s = 1, on your ratio's own terms: "
                    "two empty sets score 1, not NaN (a clamp would score them 0, the worst)\n"
                    "# IoU: (inter + 1) / (union + 1)",
                )
    return None


_NARROW = ("float16", "bfloat16")


@dataclass(frozen=True)
class _Difference:
    """A zero denominator made by a subtraction on the user's line, in a 16-bit dtype."""

    divisor: str  #: the user's denominator (``(1 - ab).sqrt()``)
    left: str  #: the subtraction's operands (``1``, ``ab``)
    right: str
    cast: str | None  #: the user's line with the subtraction's tensor operands in float32
    #: the name the denominator reads, assigned the difference on an earlier line (``var``)
    name: str | None = None
    #: that assignment computed two-pass (``var = ((x - m) ** 2).mean(-1)``), when the
    #: difference is a variance as E[x²] - E[x]²; and the values it is the variance of
    two_pass: str | None = None
    values: str | None = None


def _narrow_difference(ev: OpEvent) -> _Difference | None:
    """The zero denominator of a forward float16/bfloat16 division is (a function of) a
    difference ``a - b`` on the user's line: 0 where a and b round to the same 16-bit
    number."""
    if ev.phase is not Phase.FORWARD or ev.dtype not in _NARROW:
        return None
    got = _divisors(ev.code)
    if not got:
        return None
    divisor = got[0]
    try:
        tree = ast.parse(divisor.strip(), mode="eval")
    except SyntaxError:
        return None
    sub = next(
        (n for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub)),
        None,
    )
    if sub is None:
        return _named_difference(ev, divisor, tree)
    left, right = ast.unparse(sub.left), ast.unparse(sub.right)
    consts = [isinstance(o, ast.Constant) for o in (sub.left, sub.right)]
    if all(consts):
        return None

    def wide(o: ast.expr, text: str) -> str:
        return text if isinstance(o, ast.Constant) else f"{paren(text)}.float()"

    seg = ast.get_source_segment(divisor.strip(), sub)
    cast = None
    if seg:
        widened = f"{wide(sub.left, left)} - {wide(sub.right, right)}"
        cast = _rewrite_divisor(ev.code, lambda d: d.replace(seg, widened, 1))
    return _Difference(divisor, left, right, cast)


def _named_difference(ev: OpEvent, divisor: str, tree: ast.AST) -> _Difference | None:
    """The denominator reads a name that an earlier line of the function assigned a
    difference of tensors (``var = (x * x).mean(-1) - mean * mean`` before
    ``/ torch.sqrt(var)``)."""
    names = [
        n.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Name) and n.id not in ("torch", "math", "F", "self")
    ]
    for name in dict.fromkeys(names):
        value = _assigned_value(ev.source, name)
        try:
            node = ast.parse(value.strip(), mode="eval").body if value else None
        except SyntaxError:
            continue
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub)):
            continue
        if isinstance(node.left, ast.Constant) and isinstance(node.right, ast.Constant):
            continue
        left, right = ast.unparse(node.left), ast.unparse(node.right)
        var = _two_pass_variance(name, node.left, node.right)
        return _Difference(
            divisor,
            left,
            right,
            None,
            name=name,
            two_pass=var[0] if var else None,
            values=var[1] if var else None,
        )
    return None


def _two_pass_variance(name: str, left: ast.expr, right: ast.expr) -> tuple[str, str] | None:
    """``name = ((x - m) ** 2).mean(dims)`` for ``name = (x * x).mean(dims) - m * m``: the
    variance as the mean of squared deviations, never negative and exact for nearly
    constant x, where E[x²] - E[x]² subtracts two nearly equal numbers; and ``x``."""
    if not (
        isinstance(left, ast.Call)
        and isinstance(left.func, ast.Attribute)
        and left.func.attr == "mean"
    ):
        return None
    xs, ms = _squared(left.func.value), _squared(right)
    if xs is None or ms is None:
        return None
    x, m = ast.unparse(xs), ast.unparse(ms)
    args = ", ".join([ast.unparse(a) for a in left.args] + [ast.unparse(k) for k in left.keywords])
    return f"{name} = (({x} - {m}) ** 2).mean({args})", x


def _cancelled_denominator(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, d: _Difference, *, evidence: list[str], title: str
) -> Diagnosis:
    """A 16-bit difference of nearly equal numbers cancelled to exactly 0 (``1 - ab`` with
    ab = 0.9999 stored as 1.0 in float16): the zero is the dtype's, not the data's."""
    lim = limits(ev.dtype)
    assert lim is not None
    half = fmt(lim.eps / 4)  # below 1 the step is eps / 2: within half of it rounds to 1
    names = [o for o in (d.left, d.right) if _NAME.fullmatch(o) and o not in ("self", "torch")]
    state: list[str] = []
    for o in names:
        if o.startswith("self."):
            state.append(o)
            continue
        value = _assigned_value(ev.source, o)
        m = re.search(r"(?<![\w.])self\.[A-Za-z_]\w*", value or "")
        if m:
            state.append(f"{o} is read from {m.group(0)}")
    if d.two_pass is not None:
        return _cancelled_variance(ctx, a, ev, d, d.two_pass, evidence=evidence, title=title)
    made = f"reads {d.name} = {d.left} - {d.right}, made" if d.name else "is made by"
    evidence.insert(
        1,
        f"the denominator {d.divisor} {made} {d.left} - {d.right} in {ev.dtype}: it is 0 "
        f"where the two are equal in {ev.dtype}, whose eps is {fmt(lim.eps)}: numbers less than "
        f"eps·|x| apart can round to the same value (every x within {half} of 1 is 1.0)",
    )
    if state:
        evidence.insert(2, "; ".join(state))
    lines = []
    if d.cast:
        lines.append(
            f"{d.cast}   # the difference in float32: exact when its operands are float32 "
            "where they are made"
        )
    if state:
        lines.append(
            f"# {', '.join(state)}: the {ev.dtype} cast of the model (.half(), .to(torch."
            f"{ev.dtype})) rounded that buffer too; keep it float32 -- set it again from "
            "float32 values after the cast (a float16 copy cast back keeps the rounding)"
        )
    else:
        lines.append(
            f"# keep what {d.left} - {d.right} is computed from in float32 (a noise schedule, "
            f"a momentum near 1): in {ev.dtype} every x within {half} of 1 is 1.0"
        )
    lines.append("# not .clamp_min(eps): it divides by eps instead of the true difference")
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=f"{title}: a {ev.dtype} difference cancelled to 0",
        evidence=evidence,
        explanation=(
            f"The denominator is a difference, {d.left} - {d.right}, computed in {ev.dtype}, "
            f"and it is exactly 0 because {ev.dtype} cannot tell the two apart: with eps "
            f"{fmt(lim.eps)}, every number within {half} of 1 is stored as 1.0, so 1 - x "
            f"is 0 in {ev.dtype} for such an x (1 - 0.9999 is 1e-4 in float32): 1 - ᾱ of a "
            "diffusion schedule at the first timesteps, 1 - β of a momentum near 1. x/0 is "
            "±inf. The zero is the dtype's, not the data's: compute that difference, and the "
            "values it is made from, in float32."
        ),
        fix="\n".join(lines),
    )


def _cancelled_variance(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    d: _Difference,
    two_pass: str,
    *,
    evidence: list[str],
    title: str,
) -> Diagnosis:
    """The zero denominator is the square root of a variance computed as E[x²] - E[x]² in a
    16-bit dtype: two nearly equal numbers, each rounded by more than the variance when the
    mean is large against the spread, cancel to 0 (or below it: sqrt is NaN)."""
    lim = limits(ev.dtype)
    assert lim is not None
    assert d.name is not None
    x = d.values or "x"
    evidence.insert(
        1,
        f"the denominator {d.divisor} reads {d.name} = {d.left} - {d.right} in {ev.dtype}: a "
        f"variance as E[x²] - E[x]², two nearly equal numbers when the mean is large against "
        f"the spread; {ev.dtype} rounds each by up to {fmt(lim.eps / 2)} of itself (eps "
        f"{fmt(lim.eps)} / 2), more than the variance, so it cancels to 0",
    )
    name = re.escape(d.name)
    floor = f"{d.name} + 1e-5"
    div = re.sub(rf"\(\s*{name}\s*\)", f"({floor})", d.divisor, count=1)
    if div == d.divisor:
        div = re.sub(rf"(?<![\w.]){name}(?!\w)", f"({floor})", d.divisor, count=1)
    eps_line = _rewrite_divisor(ev.code, lambda t: t.replace(d.divisor.strip(), div.strip(), 1))
    lines = [
        f"{two_pass}   # two-pass: the mean of squared deviations, never negative, exact for "
        "values that barely vary",
        (
            f"{eps_line}   # and an eps inside the sqrt (LayerNorm's 1e-5): a row that does "
            "not vary at all has variance 0"
            if eps_line and eps_line != ev.code
            else f"# and an eps inside the sqrt ({floor}, LayerNorm's): a row that does not "
            "vary at all has variance 0"
        ),
        f"# or F.layer_norm({paren(x)}.float(), {paren(x)}.shape[-1:]).to({paren(x)}.dtype) for "
        "the whole normalization (over the last dim): float32 statistics, two-pass, with "
        f"eps, cast back to {ev.dtype} for the layers after it (a model cast to {ev.dtype} "
        "takes no float32 input)",
        "# not .clamp_min(eps) on the denominator: it divides by eps instead of the true spread",
    ]
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=f"{title}: a {ev.dtype} variance as E[x²] - E[x]² cancelled to 0",
        evidence=evidence,
        explanation=(
            f"The denominator is the square root of a variance computed as E[x²] - E[x]² in "
            f"{ev.dtype}. When the mean is large against the spread (activations far from 0 "
            f"that vary little), E[x²] and E[x]² are nearly equal, and {ev.dtype}, with eps "
            f"{fmt(lim.eps)}, rounds each by more than their difference: the variance comes "
            "out 0, or negative (sqrt of it is NaN), for rows that do vary. x/0 is ±inf and "
            "0/0 NaN. The mean of squared deviations, ((x - mean) ** 2).mean(), subtracts "
            "before squaring and has no such cancellation (torch.var and LayerNorm compute it "
            "so); float32 statistics and an eps inside the sqrt make it safe."
        ),
        fix="\n".join(lines),
    )


def _softplus_denominator(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    den: TensorStat,
    *,
    evidence: list[str],
    title: str,
) -> Diagnosis:
    """The zero denominator is a softplus output (a predicted scale or std) that
    underflowed: F.softplus(raw) + eps where it is made, not a clamp on the divisor (a log
    of the same scale on the line is -inf as well)."""
    said, why, fix = _softplus_head(ctx, ev, den, divisor=True)
    evidence.insert(1, said)
    got = _divisors(ev.code)
    d = got[0].strip().strip("()").strip() if got else None
    logged = d is not None and any(
        arg == d for stmt in statements(ev.code) for _, _, arg in _log_calls(stmt)
    )
    if logged:
        evidence.insert(
            2, f"the same line takes torch.log({d}): -inf there too, before the division"
        )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=title,
        evidence=evidence,
        explanation=(
            "The denominator is exactly 0. "
            + why.replace("Its input is", "It is", 1)
            + (
                f" This line also takes the log of {d}, which is -inf at 0: a clamp on the "
                "divisor alone leaves that -inf."
                if logged
                else ""
            )
        ),
        fix=fix,
    )


def _made_as_sum(source: str | None, name: str, const: float) -> str | None:
    """The other addends of ``name = <terms> + const`` in the user's file (``alpha =
    F.softplus(a) + 1`` with ``const`` 1 gives ``F.softplus(a)``), when every assignment of
    ``name`` there is such a sum; None otherwise, or when the file cannot be read."""
    parsed = _source_tree(source)
    if parsed is None:
        return None
    tree = parsed[0]
    found: set[str] = set()
    for n in ast.walk(tree):
        if not isinstance(n, ast.Assign) or not any(ast.unparse(t) == name for t in n.targets):
            continue
        terms = operands(n.value, ast.Add)
        rest = [
            t
            for t in terms
            if not (isinstance(t, ast.Constant) and isinstance(t.value, (int, float)))
            or float(t.value) != const
        ]
        if len(rest) != len(terms) - 1:
            return None
        loose = (ast.IfExp, ast.Lambda, ast.BoolOp, ast.Compare, ast.NamedExpr)
        found.add(
            " + ".join(
                f"({ast.unparse(t)})" if isinstance(t, loose) else ast.unparse(t) for t in rest
            )
        )
    return found.pop() if len(found) == 1 else None


def _attribute_value(source: str | None, text: str) -> tuple[float, str] | None:
    """The number ``self.<attr>`` holds (``self.variance_epsilon``), read from the user's
    file: the class around line ``source`` assigns it a literal, or a parameter of its
    ``__init__`` whose default is one (when every assignment agrees). The value and how it
    was found, in words; None otherwise."""
    m = re.fullmatch(r"self\.(\w+)", text.strip())
    parsed = _source_tree(source) if m is not None else None
    if m is None or parsed is None:
        return None
    tree, line = parsed
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        if not cls.lineno <= line <= (cls.end_lineno or cls.lineno):
            continue
        found: set[tuple[float, str]] = set()
        for fn in cls.body:
            if not isinstance(fn, ast.FunctionDef):
                continue
            args = fn.args.args[len(fn.args.args) - len(fn.args.defaults) :]
            defaults = dict(zip((x.arg for x in args), fn.args.defaults, strict=True))
            for n in ast.walk(fn):
                if not isinstance(n, ast.Assign) or not any(
                    ast.unparse(t) == f"self.{m.group(1)}" for t in n.targets
                ):
                    continue
                v = n.value
                how = f"set to {ast.unparse(v)}"
                if isinstance(v, ast.Name) and v.id in defaults:
                    dflt = ast.unparse(defaults[v.id])
                    how = f"{v.id}={dflt}, the default of {cls.name}.{fn.name}"
                    v = defaults[v.id]
                if not isinstance(v, ast.Constant) or not isinstance(v.value, (int, float)):
                    return None
                found.add((float(v.value), how))
        return found.pop() if len(found) == 1 else None
    return None


def _all_zero_difference(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    den: TensorStat,
    divisor: str | None,
    *,
    evidence: list[str],
    title: str,
) -> Diagnosis | None:
    """A denominator that a subtraction made (``alpha - 1``, ``x - mu``) and that is 0
    everywhere: its two operands are equal after rounding, a cancellation, not a tensor
    never filled. ``c + small`` is exactly ``c`` once ``small`` is below half of c's
    spacing (eps/2 at 1.0 in float32: 5.96e-8), so ``(F.softplus(a) + 1) - 1`` is 0 where
    the softplus is small; the difference is computed exactly from its source."""
    node: ast.expr | None = None
    via: tuple[str, str] | None = None  # (name, its assignment) when a name held the difference
    if divisor is not None:
        try:
            node = ast.parse(_unwrapped(divisor), mode="eval").body
        except SyntaxError:
            return None
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub)):
            held = _difference_held(ev.source, node)
            if held is None:
                return None
            name, made_by, diff = held
            if _norm_of(node) == name:
                return _zero_norm_difference(
                    ctx,
                    a,
                    ev,
                    den,
                    _unwrapped(divisor),
                    name=name,
                    made=made_by,
                    diff=diff,
                    evidence=evidence,
                    title=title,
                )
            node = diff
            via = (name, made_by)
    elif node_base(str(ev.scalars.get("other_made_by", "")).split("<")[0]) != "Sub":
        return None
    if isinstance(node, ast.BinOp) and divisor is not None:
        zero = _zero_terms(ev, node)
        if zero is not None:
            return _zero_terms_denominator(
                ctx,
                a,
                ev,
                den,
                _unwrapped(divisor),
                node=node,
                terms=zero,
                via=via,
                evidence=evidence,
                title=title,
            )
    dtype = ev.dtype or "float32"
    lim = limits(dtype) or limits("float32")
    assert lim is not None
    half = fmt(lim.eps / 2)
    if node is None or divisor is None:
        evidence.insert(
            2, "a subtraction (SubBackward0) made the denominator: its operands are equal"
        )
        left, right, made = "a", "b", None
    elif via is not None:
        assert isinstance(node, ast.BinOp)
        return _cancelled_name(
            ctx,
            a,
            ev,
            den=den,
            divisor=divisor,
            node=node,
            via=via,
            evidence=evidence,
            title=title,
            half=half,
        )
    else:
        assert isinstance(node, ast.BinOp)
        divisor = _unwrapped(divisor)
        left, right = ast.unparse(node.left), ast.unparse(node.right)
        const = node.right.value if isinstance(node.right, ast.Constant) else None
        made = (
            _made_as_sum(ev.source, left, float(const))
            if isinstance(const, (int, float)) and _NAME.fullmatch(left)
            else None
        )
        evidence.insert(
            2,
            f"the denominator {divisor} is a difference, 0 in all {den.numel:,} values: "
            f"{left} equals {right} there after rounding (a cancellation)"
            + (f"; {left} is made as {made} + {right}" if made else ""),
        )
    floor = _rewrite_divisor(
        ev.code, lambda d: f"{paren(d)}.clamp_min(torch.finfo({paren(left)}.dtype).eps)"
    )
    lines = []
    if made is not None:
        lines.append(
            f"# {divisor} is exactly {made}: compute it from there, not by subtracting, e.g. "
            f"return {made} from where {left} is made and divide by it"
        )
        direct = _rewrite_divisor(ev.code, lambda d: paren(made))
        if direct is not None and _NAME.fullmatch(made) is not None:
            lines.insert(0, direct)
    if floor is not None:
        lines.append(f"{floor}   # or floor the difference: finite, though {left} stays = {right}")
    if not lines or made is None:
        lines.append(
            f"# {left} - {right} is 0 where {left} rounded to {right}: a value built as "
            "c + small (alpha = F.softplus(raw) + 1, then alpha - 1) is exactly c once small "
            f"is below eps/2 x |c| (eps/2 = {half} in {dtype}); compute the small part (the "
            "difference) directly and divide by it, or add a margin the dtype holds "
            "(F.softplus(raw) + 1 + 1e-6 at 1.0)"
        )
    why = (
        f" A subtraction made it: {left} - {right} is exactly 0 where the two are equal after "
        "rounding, a cancellation, not a tensor never filled. A value built as c + "
        f"something small is exactly c in {dtype} once the small part is below half c's "
        f"spacing (eps/2 = {half} at 1.0), and all of the difference is lost. Computing "
        "the difference from what it is made of (the small part itself) keeps it exact; a "
        "floor only keeps the quotient finite."
    )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=title,
        evidence=evidence,
        explanation=(
            "Every value of this denominator is exactly 0, not a few: x/0 is ±inf and 0/0 is "
            "NaN everywhere it divides." + why
        ),
        fix="\n".join(lines),
    )


def _zero_terms(ev: OpEvent, diff: ast.BinOp) -> tuple[str, str] | None:
    """A difference that subtracts the division's own numerator (``union = ap + at - inter``
    for ``iou = inter / union``) where that numerator is 0 in every value: the difference
    is 0 everywhere, so its other operand is exactly 0 everywhere too (``x - 0 == 0`` only
    at ``x == 0``). Every term is 0, not two equal values that cancelled after rounding.
    The numerator's text and the other operand's; None otherwise."""
    one = _one_division(ev.code)
    num = dict(ev.inputs).get("self")
    if one is None or num is None or not (num.min == 0 and num.max == 0):
        return None
    text = ast.unparse(one[1].left)
    left, right = ast.unparse(diff.left), ast.unparse(diff.right)
    if right == text:
        return text, left
    if left == text:
        return text, right
    return None


def _zero_terms_denominator(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    den: TensorStat,
    divisor: str,
    *,
    node: ast.BinOp,
    terms: tuple[str, str],
    via: tuple[str, str] | None,
    evidence: list[str],
    title: str,
) -> Diagnosis:
    """0/0 where the denominator subtracts the numerator and both are 0 everywhere (an IoU
    or Jaccard ``inter / (a + b - inter)`` of empty masks or boxes of zero area): the
    terms are all 0, not cancelled. A floor (torchvision's box losses add eps to the
    union) makes the quotient 0 there; the fix is in what left every term at 0."""
    num, other = terms
    diff = ast.unparse(node)
    if via is not None:
        name, made = via
        at = _line_of(ev.source, made)
        where = f" ({at.rpartition('/')[2]})" if at else ""
        what = f"{name}, made as {made}{where},"
    else:
        name, made, what = divisor, None, f"{divisor}"
    evidence.insert(
        2,
        f"the denominator {what} is 0 in all {den.numel:,} values, and it subtracts the "
        f"numerator {num}, itself 0 in every value: {other} is 0 everywhere too, every term "
        "is 0 (not a cancellation of equal values)",
    )
    typed = next(
        (
            n.id
            for n in ast.walk(node)
            if isinstance(n, ast.Name) and n.id not in ("torch", "F", "math", "np")
        ),
        None,
    )
    dt = f"{typed}.dtype" if typed is not None else f"torch.{ev.dtype or 'float32'}"
    if made is not None:
        rhs = made.split("=", 1)[1].strip()
        floor: str | None = (
            f"{name} = {paren(rhs)}.clamp_min(torch.finfo({dt}).eps)   # was {made}: "
            f"{num} / eps is 0 where every term is 0; every use of {name} stays finite"
        )
    else:
        floor = _rewrite_divisor(ev.code, lambda d: f"{paren(d)}.clamp_min(torch.finfo({dt}).eps)")
        if floor is not None:
            floor += f"   # {num} / eps is 0 where every term is 0"
    lines = [floor] if floor is not None else []
    lines.append(
        f"# {other} and {num} are 0 in every value: find why every term is 0 (an empty mask, "
        "a box of zero width or height, a ReLU output 0 everywhere)"
    )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=f"{title}: every term of a difference is 0",
        evidence=evidence,
        explanation=(
            f"Every value of this denominator is exactly 0, and so is the numerator: 0/0 is "
            f"NaN everywhere it divides. {diff} subtracts the numerator {num}, which is 0 in "
            f"every value, so {other} is exactly 0 as well: nothing cancelled after rounding, "
            "every term is 0 (an overlap ratio of empty masks or of boxes of zero area). A "
            "floor on the denominator, as torchvision's box IoU losses add eps to the union, "
            "makes the ratio 0 there; why every term is 0 is what to fix."
        ),
        fix="\n".join(lines),
    )


def _difference_held(source: str | None, node: ast.expr) -> tuple[str, str, ast.BinOp] | None:
    """A name of the divisor (``2 * one_m``) that an earlier line of the function assigned a
    difference (``one_m = 1 - rho ** 2``): the name, that assignment and its difference."""
    for n in ast.walk(node):
        if not isinstance(n, ast.Name):
            continue
        found = _assigned_expr(source, n.id)
        if found is None:
            continue
        made, rhs = found
        if isinstance(rhs, ast.BinOp) and isinstance(rhs.op, ast.Sub):
            return n.id, made, rhs
    return None


_SATURATING = {"tanh": "(-1 + {e}, 1 - {e})", "sigmoid": "({e}, 1 - {e})"}


def _saturated_square(source: str | None, node: ast.BinOp) -> tuple[str, str, str, str] | None:
    """``1 - t ** 2`` (or ``1 - t``) where ``t`` was assigned a tanh (a sigmoid): the name,
    its assignment, the squashing function and its argument; the difference is 0 where the
    function rounded to +-1."""
    if not (isinstance(node.left, ast.Constant) and node.left.value == 1):
        return None
    base = node.right
    if isinstance(base, ast.BinOp) and isinstance(base.op, ast.Pow):
        if not (isinstance(base.right, ast.Constant) and base.right.value == 2):
            return None
        base = base.left
    elif isinstance(base, ast.BinOp) and isinstance(base.op, ast.Mult):
        if ast.unparse(base.left) != ast.unparse(base.right):
            return None
        base = base.left
    if not isinstance(base, ast.Name):
        return None
    found = _assigned_expr(source, base.id)
    for _ in range(3):  # past ``rho = rho.clamp(...)`` under an if: the value it was made from
        if found is None or base.id not in {
            n.id for n in ast.walk(found[1]) if isinstance(n, ast.Name)
        }:
            break
        at = _line_of(source, found[0])
        found = _assigned_expr(at, base.id) if at is not None else None
    if found is None:
        return None
    made, call = found
    if not isinstance(call, ast.Call):
        return None
    f = call.func
    fn = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
    if fn not in _SATURATING or call.keywords:
        return None
    on_value = isinstance(f, ast.Attribute) and ast.unparse(f.value) not in ("torch", "F")
    args = [f.value] if on_value and isinstance(f, ast.Attribute) else list(call.args)
    if len(args) != 1 or (fn == "sigmoid" and node.right is not base):
        return None
    return base.id, made, fn, ast.unparse(args[0])


_NORMS = {"norm", "vector_norm"}


def _valid_python(code: str) -> bool:
    try:
        ast.parse(code)
    except SyntaxError:
        return False
    return True


def _norm_of(node: ast.expr) -> str | None:
    """The name whose vector norm ``node`` is (``b2.norm(dim=-1)``, ``torch.linalg.norm(b2)``,
    ``torch.norm(b2, dim=1)``, ``LA.vector_norm(b2)``); None for anything else."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return None
    f = node.func
    if f.attr not in _NORMS:
        return None
    root = ast.unparse(f.value)
    if root in ("torch", "torch.linalg", "linalg", "LA", "F"):
        arg = node.args[0] if node.args else None
    elif f.attr == "norm":
        arg = f.value
    else:
        return None
    return arg.id if isinstance(arg, ast.Name) else None


def _zero_norm_difference(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    den: TensorStat,
    divisor: str,
    *,
    name: str,
    made: str,
    diff: ast.BinOp,
    evidence: list[str],
    title: str,
) -> Diagnosis:
    """The divisor is the norm of a vector made as a difference (Gram-Schmidt's
    ``b2 = a2 - (b1 * a2).sum(-1, keepdim=True) * b1``) and it is 0: the vector is 0. A
    floor belongs on the norm, which cannot be negative; a floor on the signed vector
    changes every healthy output."""
    left, right = ast.unparse(diff.left), ast.unparse(diff.right)
    right_names = {n.id for n in ast.walk(diff.right) if isinstance(n, ast.Name)}
    others = sorted(right_names - {left, "torch", "F", "math", "np"})
    if isinstance(diff.left, ast.Name) and left in right_names and len(others) == 1:
        cause = (
            f"{left} is 0 or parallel to {others[0]} (its projection on {others[0]} is all of it)"
        )
    else:
        cause = f"{left} is 0 there or equal to {right}"
    at = _line_of(ev.source, made)
    where = f" ({at.rpartition('/')[2]})" if at else ""
    evidence.insert(
        2,
        f"the denominator {divisor} is 0 in all {den.numel:,} values: it is the norm of "
        f"{name}, made as {made}{where}, so {name} is the zero vector: {cause}",
    )
    eps = f"torch.finfo({name}.dtype).eps"
    code = (ev.code or "").strip()
    fixed = code.replace(divisor, f"{paren(divisor)}.clamp_min({eps})", 1)
    lines = []
    if code and fixed != code and _valid_python(fixed):
        lines.append(f"{fixed}   # was {code}: the norm floored, not the vector")
    else:
        lines.append(
            f"... / {paren(divisor)}.clamp_min({eps})   # the norm floored, not the vector"
        )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=f"{title}: the norm of {name} is 0",
        evidence=evidence,
        explanation=(
            f"Every value of this denominator is exactly 0: {name} = {left} - {right} is the "
            f"zero vector, and x/0 is ±inf, 0/0 NaN. That happens when {cause}: a degenerate "
            "input to the normalization (check how the vectors are taken from the prediction, "
            "e.g. its layout). Floor the norm, which cannot be negative, not the signed "
            f"vector: clamping {name} element-wise changes every healthy output. The floor "
            "keeps degenerate rows finite; it does not make them meaningful."
        ),
        fix="\n".join(lines),
    )


def _cancelled_name(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    *,
    den: TensorStat,
    divisor: str,
    node: ast.BinOp,
    via: tuple[str, str],
    evidence: list[str],
    title: str,
    half: str,
) -> Diagnosis:
    """The denominator uses a name assigned a difference that cancelled to 0 everywhere
    (``one_m = 1 - rho ** 2`` with ``rho = torch.tanh(r)`` rounded to 1): floor the name
    where it is made, which covers every use of it, and keep a saturating function off
    its limits."""
    name, made = via
    dtype = ev.dtype or "float32"
    left, right = ast.unparse(node.left), ast.unparse(node.right)
    at = _line_of(ev.source, made)
    where = f" ({at.rpartition('/')[2]})" if at else ""
    evidence.insert(
        2,
        f"the denominator {_unwrapped(divisor)} is 0 in all {den.numel:,} values: {name} is "
        f"made as {made}{where}, a difference whose operands are equal after rounding (a "
        "cancellation)",
    )
    uses = len(re.findall(rf"(?<![\w.]){re.escape(name)}(?![\w(])", ev.code or ""))
    sat = _saturated_square(ev.source, node)
    lines: list[str] = []
    why = ""
    if sat is not None:
        t, t_made, fn, arg = sat
        lim = limits(dtype) or limits("float32")
        assert lim is not None
        e = f"torch.finfo({paren(arg)}.dtype).eps"
        rhs = t_made.split("=", 1)[1].strip()
        bound = 0.5 * math.log(8 / lim.eps) if fn == "tanh" else math.log(4 / lim.eps)
        limit, size = ("±1", f"|{arg}|") if fn == "tanh" else ("1", arg)
        lines.append(
            f"{t} = {paren(rhs)}.clamp{_SATURATING[fn].format(e=e)}   # was {t_made}: "
            f"{fn}({arg}) is exactly {'±1' if fn == 'tanh' else '1'} in {dtype} for "
            f"{'|' + arg + '|' if fn == 'tanh' else arg} above about {fmt(bound)}, and "
            f"{left} - {right} is then 0"
        )
        evidence.insert(
            3,
            f"{t} is made as {t_made}: {fn} rounds to exactly {limit} in {dtype} once "
            f"{size} exceeds about {fmt(bound)}",
        )
        why = (
            f" Here {t} = {fn}({arg}) saturated: {fn} is exactly "
            f"{'±1' if fn == 'tanh' else '1'} in {dtype} beyond about {fmt(bound)}, so "
            f"{left} - {right} is 0. Clamping {t} inside its open interval keeps the "
            f"difference at least about 2 · eps wherever it is used."
        )
    operands = [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
    typed = next((n for n in operands if n not in ("torch", "F", "math", "np")), None)
    dt = f"{typed}.dtype" if typed is not None else f"torch.{dtype}"
    own = f"{name} = {paren(made.split('=', 1)[1].strip())}.clamp_min(torch.finfo({dt}).eps)"
    lines.append(
        f"{'# or ' if sat is not None else ''}{own}   # was {made}: floored where it is made, "
        f"so every use of {name} ({uses} on the failing line) stays finite"
    )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=f"{title}: a difference cancelled to 0",
        evidence=evidence,
        explanation=(
            "Every value of this denominator is exactly 0, not a few: x/0 is ±inf and 0/0 is "
            f"NaN everywhere it divides. {name} = {left} - {right} is exactly 0 where the two "
            "are equal after rounding (a cancellation, not a tensor never filled; eps/2 = "
            f"{half} at 1.0 in {dtype})." + why + " A floor on the name where it is made "
            "covers every use of it; flooring one use leaves the others at 0."
        ),
        fix="\n".join(lines),
    )


def _all_zero_denominator(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    den: TensorStat,
    *,
    evidence: list[str],
    title: str,
    fix: str | None = None,
) -> Diagnosis:
    """Every value of a floating denominator is 0 and neither the line nor the graph shows
    an exp: not a feature that did not vary in one batch but a tensor that is 0 everywhere;
    module state read as it is (``self.running_var``) is named when the code shows it; a
    line that divides a tensor by its own norm (not a difference's: Gram-Schmidt) normalizes
    zero vectors, and ``fix`` (the division's fix) is kept for it."""
    got = _divisors(ev.code)
    divisor = got[0] if got else None
    state = _module_state(ev, divisor) if divisor is not None else []
    evidence.insert(
        1,
        f"every one of the denominator's {den.numel:,} values is 0: not one row or feature "
        "that did not vary, a tensor that is 0 everywhere",
    )
    if state:
        evidence.insert(
            2,
            "the denominator is read from module state, not computed from this batch: "
            + ", ".join(f"{n} is {v}" if n != v else v for n, v in state),
        )
    cancelled = (
        None
        if state
        else _all_zero_difference(ctx, a, ev, den, divisor, evidence=evidence, title=title)
    )
    if cancelled is not None:
        return cancelled
    saturated = None if state else _saturated_sum(ctx, ev)
    if saturated is not None:
        named = divisor is not None and re.fullmatch(r"[A-Za-z_]\w*", divisor.strip())
        return _saturated_sum_denominator(
            ctx,
            a,
            ev,
            den,
            saturated,
            evidence=evidence,
            title=title,
            made=_assigned_before(ev.source, divisor.strip()) if named and divisor else None,
        )
    normed = None if fix is None else _self_normalization(ev)
    if normed is not None and fix is not None:  # x / x.norm() of all-zero vectors
        if state:  # the module's own tensor normalized before anything filled it
            names = ", ".join(dict.fromkeys(v for _, v in state))
            fix += (
                f"\n# {names}: 0 everywhere means it was created with torch.zeros and read "
                "before anything filled it (a queue or memory bank of embeddings): start it "
                "from random unit vectors, F.normalize(torch.randn(...), dim=...), or read "
                "only its filled part"
            )
        return _zero_vector_normalized(
            ctx, a, ev, normed, den=den, fix=fix, evidence=evidence, title=title
        )
    summed = None if state else _zero_sum_source(ctx, ev, divisor)
    if summed is not None:
        evidence.insert(2, summed)
    collapsed = None if state or summed is not None else _collapsed_prediction(ctx, ev, den)
    if collapsed is not None:
        return _collapsed_denominator(ctx, a, ev, collapsed, evidence=evidence, title=title)
    if not state and summed is None and "other_zero_factor" in ev.scalars:
        # a product, one factor of it 0 everywhere: (x2 - x1) * (y2 - y1) of a zero width
        return _zero_factor_denominator(ctx, a, ev, den, divisor, evidence=evidence, title=title)
    sqrt = divisor is not None and re.search(r"(?<![\w.])(?:torch\.)?sqrt\(|\.sqrt\(", divisor)
    own = None
    if sqrt and divisor is not None:
        inside = rewrite_call(divisor, ["sqrt"], lambda e: f"({e} + 1e-5)")
        if inside is not None:
            own = _rewrite_divisor(ev.code, lambda d: inside)
            if own is not None:
                own += "   # eps inside the sqrt, as nn.BatchNorm does: finite at a variance of 0"
    norm = None if own is not None or state else _sqrt_made_divisor(ev)
    if norm is not None:
        own = (
            f"{norm}   # eps inside the sqrt: a zero vector gets norm 1e-4, and x / n is 0, not 0/0"
        )
    several = _zero_divisions(ev) if own is None and _one_division(ev.code) is None else None
    if several is not None and len(several.divisions) > 1:
        own = _guard_each(ev, several)
        evidence[2:2] = _which_division(ev)
    if own is None:
        clamp = _rewrite_divisor(
            ev.code, lambda d: f"{paren(d)}.clamp_min(torch.finfo({_power_base(d)}.dtype).eps)"
        )
        own = (
            f"{clamp}   # keeps the quotient finite; the zeros themselves are the bug"
            if clamp is not None
            else _div_fix(ev, scalar=False, count=False, floating=True)
        )
        surrogate = _one_plus_power(ev.code)
        if surrogate is not None:
            own += (
                f"\n{surrogate}   # the usual form of this surrogate gradient: "
                "g / (1 + c*|x|)**2 is finite, and largest, at x = 0"
            )
    if state:
        names = ", ".join(dict.fromkeys(v for _, v in state))
        own += (
            f"\n# {names}: 0 everywhere means it was created with torch.zeros and read before "
            "any update; a variance, scale or count starts at torch.ones"
        )
    elif summed is not None:
        own += (
            "\n# the sum is 0 where every value summed is 0: find why they are all 0 (a ReLU "
            "output 0 everywhere: a dead head; softplus keeps a density or weight positive)"
        )
    elif norm is None:
        own += (
            "\n# find what left the denominator 0 everywhere: a buffer or parameter created "
            "with torch.zeros and never updated, an input that is constant everywhere"
        )
    why = (
        " It is a norm, the sqrt of a sum of squares, of vectors that are all zero: a "
        "zero vector is a legitimate input (a capsule or feature that a ReLU left at 0), "
        "and its direction x / |x| is 0/0. An eps inside the sqrt keeps the norm positive."
        if norm is not None
        else (
            f" It comes from {', '.join(dict.fromkeys(v for _, v in state))}, module state read as "
            "it is: a buffer created with torch.zeros and used before any update fills it (a "
            "running variance read in eval mode before training updated it) is 0 everywhere."
            if state
            else " It was computed in this step, a sum (or mean) of values that are all 0: every "
            "term is 0, such as a ReLU output that is 0 everywhere (a dead ReLU head, its inputs "
            "or bias pushed below 0 for every sample) or weights that are all 0, not a buffer "
            "never filled."
            if summed is not None
            else " That is a tensor never filled (a buffer or parameter created with torch.zeros "
            "and read before any update, running statistics used in eval mode), or the spread "
            "of an input that is constant everywhere."
        )
    )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=title,
        evidence=evidence,
        explanation=(
            "Every value of this denominator is exactly 0, not a few: x/0 is ±inf and 0/0 is "
            "NaN everywhere it divides." + why + " An eps inside a sqrt, or a clamp, keeps "
            "the quotient finite; the zeros are what to fix."
        ),
        fix=own,
    )


def _zero_factor_denominator(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    den: TensorStat,
    divisor: str | None,
    *,
    evidence: list[str],
    title: str,
) -> Diagnosis:
    """An all-zero denominator that the autograd graph shows is a product one factor of
    which is 0 in every value (``ops._made_by``'s ``other_zero_factor``): an area ``(x2 -
    x1) * (y2 - y1)`` whose width is 0 (the enclosing box of a GIoU over boxes of zero
    width), not a tensor never filled. The factor as written when the line, or the
    assignment of the divisor's name above it, shows the product."""
    k = int(ev.scalars.get("other_zero_factor", 0))
    made_from = str(ev.scalars.get("other_zero_factor_from", ""))
    diff = made_from.split("<", 1)[0] == "sub"
    name = divisor.strip() if divisor is not None else None
    made: str | None = None
    product: ast.expr | None = None
    if name is not None and re.fullmatch(r"[A-Za-z_]\w*", name):
        found = _assigned_expr(ev.source, name)
        if found is not None:
            made, product = found
    elif name is not None:
        try:
            product = ast.parse(name, mode="eval").body
        except SyntaxError:
            product = None
    factor = None
    if isinstance(product, ast.BinOp) and isinstance(product.op, ast.Mult):
        factor = ast.unparse(product.left if k == 0 else product.right)
    which = factor or ("its first factor" if k == 0 else "its second factor")
    by = f", made by {made_from.replace('<', ' <- ')}" if made_from else ""
    evidence.insert(
        2,
        f"the denominator{f' {name}' if name else ''} is a product (autograd node MulBackward0)"
        + (f", made as {made.split('=', 1)[1].strip()}" if made else "")
        + f", and {which} is 0 in all of its values{by}: "
        + ("a difference of two equal values, " if diff else "")
        + "not a tensor never filled",
    )
    dt = f"torch.{ev.dtype or 'float32'}"
    ops = [n.id for n in ast.walk(product) if isinstance(n, ast.Name)] if product else []
    ops = [o for o in ops if o not in ("torch", "F", "math", "np")]
    if ops:
        dt = f"{ops[0]}.dtype"
    lines: list[str] = []
    if made is not None and name is not None:
        rhs = made.split("=", 1)[1].strip()
        lines.append(
            f"{name} = {paren(rhs)}.clamp_min(torch.finfo({dt}).eps)   # was {made}: floored "
            f"where it is made, so every use of {name} stays finite"
        )
    else:
        floor = _rewrite_divisor(ev.code, lambda d: f"{paren(d)}.clamp_min(torch.finfo({dt}).eps)")
        lines.append(
            f"{floor}   # keeps the quotient finite"
            if floor is not None
            else "y = x / d.clamp_min(torch.finfo(d.dtype).eps)   # d the product, floored "
            "where it is made"
        )
    if not ev.code:
        lines.append('# mode="forensic" names your line, and nanwatch rewrites it')
    lines.append(
        f"# {which} is 0 in every value: find why"
        + (
            " the two values it subtracts are equal (a box, or the box enclosing two boxes, "
            "of zero width or height: a predicted box collapsed to a point, an annotation "
            "with x1 == x2)"
            if diff
            else " it is 0 everywhere"
        )
    )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=f"{title}: a factor of a product is 0",
        evidence=evidence,
        explanation=(
            "Every value of this denominator is exactly 0, not a few: x/0 is ±inf and 0/0 is "
            f"NaN everywhere it divides. It is a product, and {which} is 0 in every value"
            + (
                ": a difference of two equal values, such as a width x2 - x1 or a height of "
                "zero (an area, or the area of the box enclosing two boxes, when both are "
                "degenerate in the same direction)"
                if diff
                else ""
            )
            + ", so the product is 0 whatever the other factor holds; it was computed this "
            "step, not a tensor never filled. A floor on the product where it is made keeps "
            "the quotient finite (torchvision's generalized_box_iou_loss adds eps to the "
            "enclosing area); why the factor is 0 is what to fix."
        ),
        fix="\n".join(lines),
    )


#: functions that round to exactly -1 far below 0, so that ``f(x) + 1`` (a positive scale, a
#: rate: ``F.elu(raw) + 1``) is exactly 0 there: the bound below which they do, from the
#: dtype's eps (the floats just above -1 are eps/2 apart: ``-1 + d`` is -1 once d < eps/4;
#: elu and celu are ``-1 + exp(x)``, tanh is ``-1 + 2 exp(2x) / (1 + exp(2x))``)
_TO_MINUS_ONE: dict[str, Callable[[float], float]] = {
    "elu": lambda eps: math.log(eps / 4),
    "celu": lambda eps: math.log(eps / 4),
    "tanh": lambda eps: 0.5 * math.log(eps / 8),
}


@dataclass
class _Saturated:
    fn: str  #: the function that rounded to -1: elu, celu, tanh
    bound: float  #: below it, the function is exactly -1 in the dtype
    dtype: str
    #: the watched output it was applied to, all of it below ``bound``: its place and max
    given: tuple[str, float, int] | None


def _saturated_sum(ctx: RuleContext, ev: OpEvent) -> _Saturated | None:
    """An all-zero denominator that the autograd graph shows was made as ``f(x) + c`` with f
    one of :data:`_TO_MINUS_ONE` (``other_made_from`` ``"add<elu<addmm"``): positive in exact
    arithmetic, 0 where f rounded to -1 and the constant cancelled it. With the measured
    module output f was applied to when one lies wholly below the bound (watch mode)."""
    chain = str(ev.scalars.get("other_made_from", "")).split("<")
    if len(chain) < 2 or chain[0] != "add" or chain[1] not in _TO_MINUS_ONE:
        return None
    dtype = ev.dtype or "float32"
    lim = limits(dtype)
    if lim is None:
        return None
    bound = _TO_MINUS_ONE[chain[1]](lim.eps)
    given = None
    made = chain[2].removeprefix("watched:") if len(chain) > 2 else ""
    if made and made != "leaf":
        for r in ctx.trace.records:
            if r.phase is not Phase.FORWARD or not r.role.startswith("output"):
                continue
            st = r.stat
            if st is None or not st.numel or not st.finite or st.max >= bound:
                continue
            if node_base(r.grad_fn).lower() == made:
                given = (r.where, st.max, st.numel)
                break
    return _Saturated(chain[1], bound, dtype, given)


def _saturated_sum_denominator(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    den: TensorStat,
    sat: _Saturated,
    *,
    evidence: list[str],
    title: str,
    made: str | None = None,
    at: int = 2,
) -> Diagnosis:
    """NW111 for a denominator built as ``f(x) + 1`` that is 0 (everywhere, or where x is
    below the bound): f rounded to -1 (see :data:`_TO_MINUS_ONE`), not a tensor never filled.
    ``made``: the statement that built it (``sigma = F.elu(self.sig(h)) + 1``), when the
    code shows it, so the fix rewrites the user's own line; ``at``: where in ``evidence``
    the facts go."""
    fn, bound = sat.fn, fmt(sat.bound)
    every = den.zeros is None or den.zeros >= den.numel
    evidence.insert(
        at,
        f"the denominator is {fn}(x) + 1 (made by "
        f"{' <- '.join(str(ev.scalars.get('other_made_from', '')).split('<'))}): "
        f"{fn}(x) is exactly -1 in {sat.dtype} for every x below {bound}, and -1 + 1 is 0",
    )
    if sat.given is not None:
        where, top, n = sat.given
        evidence.insert(
            at + 1,
            f"x is {where}: at most {fmt(top)}, all {n:,} values below {bound}",
        )
    zeros = (
        "Every value of this denominator is exactly 0"
        if every
        else f"{den.zeros:,} of this denominator's {den.numel:,} values are exactly 0"
    )
    own = _softplus_scale(made, fn)
    was = f"{made.strip()}" if own is not None and made else f"{fn}(x) + 1"
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=f"{title}: {fn}(x) + 1 rounded to 0",
        evidence=evidence,
        explanation=(
            f"{zeros}: x/0 is ±inf and 0/0 is NaN wherever it divides. It is a positive "
            f"quantity (a scale, a rate) built as "
            f"{fn}(x) + 1, which is above 0 in exact arithmetic but not in {sat.dtype}: "
            f"{fn}(x) rounds to exactly -1 once x is below {bound}, and the +1 cancels it, "
            "not a tensor never filled. Its gradient there is about 0 too, so x does not "
            "come back by itself. An eps added after the +1 only turns the 0 into eps, "
            "and dividing by eps gives a huge loss; softplus, or exp of a predicted log-scale, "
            "stays positive for every x."
        ),
        fix=(
            f"{own or 'scale = F.softplus(x) + 1e-3'}   # was {was}: exactly 0 in "
            f"{sat.dtype} for x below {bound}; 1e-3: the smallest scale your targets need\n"
            "# or predict the log-scale: scale = torch.exp(log_scale)\n"
            "# and find what drove x that low (an init, a bias pushed down by a large update)"
        ),
    )


def _softplus_scale(made: str | None, fn: str) -> str | None:
    """``sigma = F.softplus(self.sig(h)) + 1e-3`` for ``sigma = F.elu(self.sig(h)) + 1``:
    the statement that made the scale with its ``fn(...)`` + constant rewritten, or None
    when it is not one assignment of that form."""
    try:
        tree = ast.parse((made or "").strip())
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assign):
        return None
    st = tree.body[0]
    val = st.value
    if not (isinstance(val, ast.BinOp) and isinstance(val.op, ast.Add)):
        return None
    call = next(
        (
            c
            for c in (val.left, val.right)
            if isinstance(c, ast.Call)
            and (c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", ""))
            == fn
            and len(c.args) == 1
        ),
        None,
    )
    if call is None:
        return None
    targets = " = ".join(ast.unparse(t) for t in st.targets)
    return f"{targets} = F.softplus({ast.unparse(call.args[0])}) + 1e-3"


#: autograd nodes that take part of a tensor (or all of it, reshaped): a denominator made by
#: one is read out of a larger tensor, such as one column of a model's prediction
_PART_NODES = frozenset(
    {
        "Select",
        "Slice",
        "Index",
        "Unbind",
        "Split",
        "SplitWithSizes",
        "Chunk",
        "Narrow",
        "View",
        "Reshape",
        "UnsafeView",
        "Squeeze",
        "Unsqueeze",
        "Alias",
        "AsStrided",
        "Expand",
        "Clone",
        "Relu",
        "Threshold",
        "Hardtanh",
        "Clamp",
        "ClampMin",
    }
)


@dataclass(frozen=True)
class _Collapsed:
    """A watched model output that holds the zeros an all-zero denominator is read from."""

    where: str
    numel: int
    zeros: int | None
    made_by: str
    divisors: list[str]


def _line_divisors(code: str | None) -> list[str]:
    """The subscripted divisors of the user's line (``p[:, 3]`` in ``w / p[:, 3]``), each
    division's; the one division's divisor when it is not a subscript."""
    got = _divisors(code)
    if got:
        return [got[0].strip()]
    line = (code or "").split("  #", 1)[0]
    return list(dict.fromkeys(re.findall(r"(?<=[\w\)\]]) / ([A-Za-z_][\w.]*\[[^\[\]]*\])", line)))


def _collapsed_prediction(ctx: RuleContext, ev: OpEvent, den: TensorStat) -> _Collapsed | None:
    """The model's output an all-zero denominator is (part of), when the evidence says so:
    the denominator was read out of a tensor (its autograd producer is a select, slice or
    ReLU, or the user's divisor is a subscript) and the model's forward of the step returned
    at least as many exact zeros. None otherwise (a buffer, a constant input)."""
    made = str(ev.scalars.get("other_made_by", "")).split("<")[0]
    divisors = _line_divisors(ev.code)
    # an autograd producer at all: computed from parameters, not a buffer or the data
    took = node_base(made) in _PART_NODES
    if not (took or any("[" in d for d in divisors)):
        return None
    root = model_call(ctx.trace)
    if root is None or not den.numel:
        return None
    for r in ctx.trace.records:
        if r.call != root.id or r.phase is not Phase.FORWARD or not r.role.startswith("output"):
            continue
        m = exact(ctx.trace, r)
        st = m.stat if m is not None else None
        if st is None or st.numel <= 0:
            continue
        if st.zeros is not None:
            if st.zeros < den.numel:
                continue
        elif not (took and st.min <= 0 <= st.max):  # uncounted: its range must hold 0
            continue
        return _Collapsed(r.path or r.where, st.numel, st.zeros, made, divisors)
    return None


def _collapsed_denominator(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    c: _Collapsed,
    *,
    evidence: list[str],
    title: str,
) -> Diagnosis:
    """An all-zero denominator read out of the model's prediction: the prediction (a width,
    a height, a scale) collapsed to exactly 0, as a ReLU on it does for every negative
    pre-activation; fixed by predicting it positive, or a floor on the prediction."""
    by = f" (autograd node {c.made_by})" if c.made_by else ""
    held = (
        f"which holds {c.zeros:,} exact zeros in its {c.numel:,} values"
        if c.zeros is not None
        else "whose values reach 0"
    )
    evidence.insert(
        2,
        f"the denominator is read out of a tensor computed this step{by}, and the model's "
        f"output {c.where} {held}: the prediction collapsed to 0, not a buffer never filled",
    )
    if len(c.divisors) == 1:
        d = c.divisors[0]
        floor = _rewrite_divisor(ev.code, lambda _: f"{paren(d)}.clamp_min(1e-6)")
        at = (
            f"{floor}   # or a floor on the prediction at the division"
            if floor is not None
            else f"# or a floor on the prediction at the division: {paren(d)}.clamp_min(1e-6)"
        )
    elif c.divisors:
        at = (
            "# or a floor on the prediction at the division, the one of "
            f"{', '.join(c.divisors)} that the model predicted: <it>.clamp_min(1e-6)"
        )
    else:
        at = "# or a floor on the prediction at the division: pred.clamp_min(1e-6)"
    fix = (
        f"# {c.where} returned exactly 0 where this denominator is read: predict a positive "
        "quantity (a width, a height, a scale) positive where the model makes it\n"
        "wh = F.softplus(raw) + 1e-3   # or raw.exp(), in place of torch.relu(raw) or a clamp "
        "at 0; import torch.nn.functional as F\n" + at
    )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=title,
        evidence=evidence,
        explanation=(
            "Every value of this denominator is exactly 0, and it is read out of what the "
            f"model returned ({c.where}): the model's prediction collapsed to 0, not a tensor "
            "never filled. A ReLU (or a clamp at 0) on a predicted width, height, scale or "
            "count is exactly 0 for every negative pre-activation, and its gradient there is "
            "0 too, so it does not recover by itself; x/0 is ±inf and 0/0 is NaN. Softplus "
            "or exp keeps the prediction positive and its gradient alive."
        ),
        fix=fix,
    )


_REDUCE_NODES = frozenset({"Sum", "Mean", "Cumsum", "Mm", "Mv", "Bmm", "Matmul", "Dot"})


def _zero_sum_source(ctx: RuleContext, ev: OpEvent, divisor: str | None) -> str | None:
    """Evidence that an all-zero denominator was computed this step as a sum of zeros (its
    autograd producer, ``other_made_by``, is a reduction, or the user's divisor is a
    ``.sum(...)``), with the watched module output that is 0 everywhere when one is; None
    when neither shows a computation."""
    made = str(ev.scalars.get("other_made_by", "")).split("<")[0]
    written = divisor is not None and re.search(r"\.(?:sum|mean)\(|torch\.(?:sum|mean)\(", divisor)
    if node_base(made) not in _REDUCE_NODES and not written:
        return None
    by = f" (autograd node {made})" if made else f" ({divisor})"
    text = (
        f"the denominator was computed this step{by}: a sum of values that are all 0, not a "
        "buffer never filled"
    )
    for r in ctx.trace.records:
        if r.phase is not Phase.FORWARD or r.path == LOSS_PATH or not r.role.startswith("output"):
            continue
        m = exact(ctx.trace, r)
        st = m.stat if m is not None else None
        if st is not None and st.numel and st.min == 0 and st.max == 0:
            text += f"; {r.where} is 0 everywhere ({st.numel:,} values)"
            break
    return text


def _module_state(ev: OpEvent, divisor: str) -> list[tuple[str, str]]:
    """The module attributes (``self.running_var``) a divisor reads: written in it, or
    assigned to one of its names on an earlier line of the function (``m, v =
    self.running_mean, self.running_var``). (name, attribute) pairs."""
    out: list[tuple[str, str]] = []
    for attr in re.findall(r"(?<![\w.])self\.[A-Za-z_]\w*(?![\w(])", divisor):
        out.append((attr, attr))
    for name in dict.fromkeys(re.findall(r"(?<![\w.])([A-Za-z_]\w*)(?![\w(])", divisor)):
        if name in ("self", "torch"):
            continue
        value = _assigned_value(ev.source, name)
        if value is not None and re.fullmatch(r"self\.[A-Za-z_]\w*", value):
            out.append((name, value))
    return out


def _assigned_value(source: str | None, name: str, reach: int = 40) -> str | None:
    """The expression last assigned to ``name`` above line ``source`` in the same function,
    plain or unpacked (``a, b = x, y`` gives ``b`` the ``y``); None when none is seen."""
    import linecache

    path, _, num = (source or "").rpartition(":")
    if not path or not num.isdigit():
        return None
    line = int(num)
    here = linecache.getline(path, line)
    indent = len(here) - len(here.lstrip())
    for n in range(line - 1, max(0, line - reach), -1):
        text = linecache.getline(path, n)
        if not text.strip():
            continue
        if re.match(r"\s*(?:async\s+)?def\s", text) and len(text) - len(text.lstrip()) < indent:
            return None
        for stmt in reversed(statements(text)):
            try:
                tree = ast.parse(stmt)
            except SyntaxError:
                continue
            node = tree.body[0] if len(tree.body) == 1 else None
            if not isinstance(node, ast.Assign) or len(node.targets) != 1:
                continue
            target, value = node.targets[0], node.value
            if isinstance(target, ast.Name) and target.id == name:
                return ast.get_source_segment(stmt, value)
            if (
                isinstance(target, ast.Tuple)
                and isinstance(value, ast.Tuple)
                and len(target.elts) == len(value.elts)
            ):
                for t, v in zip(target.elts, value.elts, strict=True):
                    if isinstance(t, ast.Name) and t.id == name:
                        return ast.get_source_segment(stmt, v)
    return None


_EXP_CALL = re.compile(
    r"(?<![\w.])(?:torch\.|F\.|torch\.special\.)?(?:exp|softmax)\(|\.(?:exp|softmax)\("
)


@dataclass(frozen=True)
class _Underflow:
    """A denominator made of exp() terms: the expression on the user's line, or a name it
    uses and the earlier line of the same function that assigned it an exp."""

    denominator: str  #: the user's denominator (``(K @ v)``)
    name: str | None  #: the name the exp was assigned to (``K``), None when it is inline
    made: str  #: the code that made the exp (``K = torch.exp(-C / eps)``)
    exponent: str | None  #: the exp's argument (``-C / eps``)
    #: read from the autograd graph, no line known: the nodes from the denominator's
    #: producer down to the exp (``MvBackward0<ExpBackward0``) and the exp result's exact
    #: zeros and size
    graph: tuple[str, ...] = ()
    zeros: tuple[int, int] | None = None
    #: the method whose ``return`` made the exp (``phi`` of ``q = self.phi(x)``, a feature
    #: map), with that return's line (``file.py:25``); None when the exp is on a line
    via: str | None = None
    via_at: str | None = None


def _method_exp(source: str | None, made: str) -> tuple[str, str, str] | None:
    """An exp made inside a method that ``made`` calls (``self.phi(self.q(x))``): its name,
    its ``return`` statement that calls exp (``return torch.exp(a) / math.sqrt(self.m)``)
    and that line (``file.py:25``), read from the same file; None when none is seen."""
    import linecache

    path, _, num = (source or "").rpartition(":")
    if not path or not num.isdigit():
        return None
    lines = linecache.getlines(path)
    # the class that holds the line: self.phi is its own phi, not another class's
    line = min(int(num), len(lines)) - 1
    indent = len(lines[line]) - len(lines[line].lstrip()) if 0 <= line < len(lines) else 0
    lo, hi = 0, len(lines)
    for n in range(line, -1, -1):
        text = lines[n]
        if re.match(r"\s*class\s", text) and len(text) - len(text.lstrip()) < indent:
            lo, depth = n, len(text) - len(text.lstrip())
            hi = next(
                (
                    k
                    for k in range(n + 1, len(lines))
                    if lines[k].strip() and len(lines[k]) - len(lines[k].lstrip()) <= depth
                ),
                len(lines),
            )
            break
    for name in dict.fromkeys(re.findall(r"(?<![\w])self\.([A-Za-z_]\w*)\(", made)):
        for i in range(lo, hi):
            text = lines[i]
            if not re.match(rf"\s*def\s+{re.escape(name)}\s*\(", text):
                continue
            depth = len(text) - len(text.lstrip())
            found: list[tuple[int, str, str]] = []
            for j in range(i + 1, min(len(lines), i + 200)):
                body = lines[j]
                if body.strip() and len(body) - len(body.lstrip()) <= depth:
                    break
                for stmt in statements(body):
                    if stmt.startswith("return ") and _EXP_CALL.search(stmt):
                        found.append((len(body) - len(body.lstrip()), stmt, f"{path}:{j + 1}"))
            if found:  # the function's own path (least indented), the last one of those
                top = min(f[0] for f in found)
                _, stmt, at = [f for f in found if f[0] == top][-1]
                return name, stmt, at
    return None


def _exp_underflow(ev: OpEvent) -> _Underflow | None:
    """The zero denominator of a forward division is a sum of exp() terms (``exp(x).sum()``,
    a softmax, ``K @ v`` with ``K = torch.exp(...)`` assigned earlier in the function), read
    from the user's line and the lines above it; None when the code shows no exp."""
    if ev.phase is not Phase.FORWARD or _flow_not_exp(ev) is not None:
        return None
    got = _divisors(ev.code)
    if not got:
        return None
    den = got[0]
    if _EXP_CALL.search(den):
        return _Underflow(den, None, den, _exp_argument(den))
    for name in dict.fromkeys(re.findall(r"(?<![\w.])([A-Za-z_]\w*)(?![\w(])", den)):
        made = _assigned_before(ev.source, name)
        if made is not None and _EXP_CALL.search(made):
            return _Underflow(den, name, made, _exp_argument(made))
    # one step further: den = q @ k.sum(1), q = self.phi(x) and phi returns an exp (a
    # linear attention's feature map): sums and products of exps, made in a method
    for name in dict.fromkeys(re.findall(r"(?<![\w.])([A-Za-z_]\w*)(?![\w(])", den)):
        made = _assigned_before(ev.source, name)
        if made is None:
            continue
        line = _line_of(ev.source, made)
        texts = [made]
        value = made.split("=", 1)[1]
        for inner in dict.fromkeys(re.findall(r"(?<![\w.])([A-Za-z_]\w*)(?![\w(])", value)):
            held = _assigned_value(line, inner) if line is not None else None
            if held is not None:
                texts.append(held)
        for text in texts:
            hit = _method_exp(ev.source, text)
            if hit is not None:
                fn, ret, at = hit
                return _Underflow(den, name, ret, _exp_argument(ret), via=fn, via_at=at)
    return None


#: ops whose result is 0 wherever the exp() values they sum, multiply, scale or move are
#: (lower-case autograd names, as the data flow gives them)
_EXP_CARRIERS = frozenset(
    {"sum", "mean", "mv", "mm", "bmm", "dot", "mul", "add", "cumsum", "clone", "neg", "div"}
    | {"t", "transpose", "permute", "view", "unsafeview", "reshape", "expand", "unsqueeze"}
    | {"squeeze", "select", "slice", "index", "tocopy"}
)
_EXP_MAKERS = frozenset({"exp", "exp2", "softmax"})


def _flow_not_exp(ev: OpEvent) -> str | None:
    """The op that made a division's denominator out of other ops' values without carrying
    an exp's zeros (the ``sub`` of ``exp(z) - 1``: 0 where exp(z) rounds to 1, not where it
    underflows), as the data flow below the denominator shows it; None when the flow
    reaches an exp through sums, products and moves alone, ends at a parameter, or is
    unknown. The line may show an exp that did not make the zero."""
    made = ev.scalars.get("other_made_by")
    if isinstance(made, str) and node_base(made.split("<")[-1]) in ("Exp", "Exp2"):
        return None
    for op in operand_flow(ev, "other") or ():
        o = op.removeprefix("watched:")
        if o in _EXP_MAKERS or o == "leaf":
            return None
        if o not in _EXP_CARRIERS:
            return o
    return None


@dataclass(frozen=True)
class _ExpMinusOne:
    """A denominator made by subtracting 1 and an exp() (``exp(z) - 1``), as the data flow
    shows it (``sum <- sub <- exp``)."""

    flow: str  #: the data flow below the denominator, ``sum <- sub <- exp``
    written: str | None = None  #: ``torch.exp(z) - 1`` as the code writes it, when read
    exponent: str | None = None  #: ``z``
    stmt: str | None = None  #: the statement that holds it (the line, or an earlier one)


def _exp_minus_one_text(code: str) -> tuple[str, str] | None:
    """(``torch.exp(z) - 1`` as written, ``z``) of the first exp minus 1 (or 1 minus an exp)
    of ``code``; None when it shows none.

    >>> _exp_minus_one_text("y = w / (torch.exp(z) - 1).sum(-1)")
    ('torch.exp(z) - 1', 'z')
    >>> _exp_minus_one_text("d = 1.0 - x.exp()")
    ('1.0 - x.exp()', 'x')
    """
    for stmt in statements(code):
        try:
            tree = ast.parse(stmt.strip())
        except SyntaxError:
            continue
        for n in ast.walk(tree):
            if not (isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub)):
                continue
            sides = (n.left, n.right)
            one = [isinstance(o, ast.Constant) and o.value in (1, 1.0) for o in sides]
            if one.count(True) != 1:
                continue
            call = sides[one.index(False)]
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
                continue
            if call.func.attr != "exp":
                continue
            owner = ast.unparse(call.func.value)
            if owner == "torch" and len(call.args) == 1:
                z = ast.unparse(call.args[0])
            elif not call.args and owner != "torch":
                z = owner
            else:
                continue
            seg = ast.get_source_segment(stmt.strip(), n)
            if seg:
                return seg, z
    return None


def _exp_minus_one(ev: OpEvent) -> _ExpMinusOne | None:
    """A forward division whose zero denominator the data flow shows a subtraction made of
    an exp() (``(torch.exp(z) - 1).sum()``: ``sum <- sub <- exp``): exp(z) - 1, 0 where
    exp(z) rounds to 1, read with the code that writes it (the line, or the earlier line
    that assigned a name the divisor uses) when it shows one; None otherwise."""
    if ev.phase is not Phase.FORWARD:
        return None
    flow = [o.removeprefix("watched:") for o in operand_flow(ev, "other") or ()]
    made = _flow_not_exp(ev)
    if made not in ("sub", "rsub") or flow[flow.index(made) + 1 : flow.index(made) + 2] != ["exp"]:
        return None
    said = " <- ".join(flow[: flow.index(made) + 2])
    texts: list[tuple[str, str | None]] = [(d, None) for d in _divisors(ev.code)[:1]]
    for d, _ in list(texts):
        for name in dict.fromkeys(re.findall(r"(?<![\w.])([A-Za-z_]\w*)(?![\w(])", d)):
            made_as = _assigned_before(ev.source, name)
            if made_as is not None:
                texts.append((made_as, made_as))
    for text, stmt in texts:
        got = _exp_minus_one_text(text)
        if got is not None:
            return _ExpMinusOne(said, got[0], got[1], stmt or (ev.code or "").strip())
    return _ExpMinusOne(said)


def _exp_minus_one_denominator(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    m: _ExpMinusOne,
    *,
    evidence: list[str],
    title: str,
) -> Diagnosis:
    """exp(z) - 1 cancelled to exactly 0 in a denominator: exp(z) rounds to 1 for z within
    half an eps of 0, the exp did not underflow; torch.expm1 computes it without the
    subtraction."""
    dtype = ev.dtype or "float32"
    lim = limits(dtype) or limits("float32")
    assert lim is not None
    small = fmt(lim.eps / 2)
    z = m.exponent or "z"
    evidence.append(
        f"the denominator was made from an exp() by subtracting 1 ({m.flow}"
        + (f": {m.written}" if m.written else "")
        + f"): exp({z}) rounds to exactly 1 in {dtype} for |{z}| below about {small}, so "
        f"exp({z}) - 1 is 0 there; the exp did not underflow"
    )
    lines: list[str] = []
    if m.written is not None and m.stmt is not None:
        sign = "-" if m.written.lstrip("(").strip().startswith("1") else ""
        new = f"{sign}torch.expm1({z})"
        old = f"({m.written})" if f"({m.written})" in m.stmt else m.written
        lines.append(
            f"{m.stmt.replace(old, new, 1)}   # exp({z}) - 1 without the subtraction: "
            f"about {z} for tiny {z}, not 0"
        )
    else:
        lines.append("torch.expm1(z)   # in place of torch.exp(z) - 1: about z for tiny z, not 0")
    lines.append(
        f"# where {z} is exactly 0, expm1 is 0 too: keep such terms out of the denominator"
    )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=f"{title}: exp(x) - 1 cancelled to 0",
        evidence=evidence,
        explanation=(
            f"The denominator is exp({z}) - 1 (summed or moved). exp({z}) is 1 + {z} + ..., "
            f"and {dtype} rounds it to exactly 1.0 for |{z}| below about {small}: the "
            f"subtraction of two equal numbers leaves 0, though the true value is about {z}, "
            "and x/0 is ±inf, 0/0 NaN. This is cancellation, not an exp that underflowed: "
            "logsumexp or a clamp does not help. torch.expm1 computes exp(x) - 1 directly, "
            "exact for tiny x."
        ),
        fix="\n".join(lines),
    )


def _graph_underflow(ev: OpEvent) -> _Underflow | None:
    """The zero denominator of a forward division was made from an exp() whose result holds
    exact zeros, through ops that sum or move values (``a / (K @ v)``, ``exp(x).sum()``),
    read from the autograd graph (``other_made_by``) when the line is unknown."""
    chain = ev.scalars.get("other_made_by")
    z, n = ev.scalars.get("exp_zeros"), ev.scalars.get("exp_numel")
    if ev.phase is not Phase.FORWARD or not isinstance(chain, str):
        return None
    if not isinstance(z, int) or not isinstance(n, int) or z <= 0:
        return None
    nodes = tuple(chain.split("<"))
    if node_base(nodes[-1]) not in ("Exp", "Exp2"):
        return None
    return _Underflow("", None, "", None, graph=nodes, zeros=(z, n))


_COUNT_CODE = re.compile(
    r"\b(?:bincount|count_nonzero|histc|ones_like|new_ones|ones|index_add_?|scatter_add_?|"
    r"degree|len)\(|\.sum\("
)
_COUNT_NAME = re.compile(
    r"(?<![\w.])(?:n|cnt\w*|counts?|\w+_counts?|counts?_\w+|num_\w+|n_\w+|\w*lengths?|"
    r"\w*_lens?|lens?|deg|degrees?|\w+_deg)(?![\w(])"
)


_ONE_MINUS = re.compile(r"^\s*\(?\s*1(?:\.0*)?\s*-\s*(?P<rest>.+)$")
_SQUARE = re.compile(r"\*\*\s*2(?!\d)|\.pow\(\s*2\s*\)|\.square\(\)|torch\.square\(")
_REDUCE = re.compile(r"\.sum\(|torch\.sum\(|norm\(|\.dot\(|\.pow\(\s*2\s*\)\.sum")


def _squared_norm_gap(text: str) -> bool:
    """``text`` computes 1 - a squared norm: ``1 - (x ** 2).sum(-1)``, ``1 - x.norm(dim=-1)
    ** 2``, ``1 - x.pow(2).sum(dim=-1, keepdim=True)``."""
    m = _ONE_MINUS.match(text)
    return m is not None and bool(_SQUARE.search(m["rest"])) and bool(_REDUCE.search(m["rest"]))


def _ball_factor(ev: OpEvent) -> list[tuple[str, str]]:
    """Each ``1 - |x|²`` (a Poincaré ball's conformal factor) the divisor of the op's line
    is made from, written there or assigned to a name the divisor uses (``nx = 1 - (x **
    2).sum(-1)``): (the factor's name or text, the statement that makes it); [] for none."""
    got = _divisors(ev.code)
    if not got:
        return []
    divisor = got[0]
    inner = divisor.strip()
    if _squared_norm_gap(inner.removeprefix("(").removesuffix(")")):
        return [(inner, (ev.code or "").strip())]
    found: list[tuple[str, str]] = []
    for name in dict.fromkeys(re.findall(r"(?<![\w.])([A-Za-z_]\w*)(?![\w(])", divisor)):
        made = _assigned_before(ev.source, name)
        for stmt in (made or "").split(";"):  # nx = ...; ny = ... on one line
            lhs, eq, rhs = stmt.partition("=")
            if eq and lhs.strip() == name and _squared_norm_gap(rhs):
                found.append((name, stmt.strip()))
                break
    return found


def _ball_fix(ctx: RuleContext, factors: list[tuple[str, str]]) -> str:
    """Project the ball's points back inside after each update, and keep the factors off 0."""
    shapes = ctx.facts.get("param_shapes")
    names = list(shapes) if isinstance(shapes, Mapping) else list(watched_params([ctx.trace]))
    tables = [q for q in names if q.endswith("weight")]
    w = f"model.{tables[0]}" if len(tables) == 1 else "emb.weight"
    note = "" if len(tables) == 1 else "   # emb: the embedding that holds the points"
    keep = []
    for factor, made in factors:
        lhs, eq, rhs = made.partition("=")
        keep.append(
            f"{lhs.strip()} = ({rhs.strip()}).clamp_min(1e-5)   # and keep the factor off 0"
            if eq and lhs.strip() == factor
            else f"# and keep the factor off 0: ({factor}).clamp_min(1e-5)"
        )
    return "\n".join(
        [
            "# after every opt.step(): points back inside the unit ball",
            f"with torch.no_grad():{note}",
            f"    n = {w}.norm(dim=-1, keepdim=True)",
            f"    {w}.mul_(((1 - 1e-5) / n).clamp_max(1))   # rows with |w| >= 1 back inside",
            *keep,
        ]
    )


def _float_count(ev: OpEvent, den: TensorStat) -> str | None:
    """A floating denominator that is a count (``cnt = torch.bincount(b).to(h.dtype)``,
    ``mask.float().sum(1)``): its recorded values are whole numbers from 0 (min 0, max an
    integer), and the code shows a count -- a bincount, a sum, an index_add of ones on the
    line or where its name was assigned, or a count's name. What shows it, else None; None
    too when the numerator multiplies the tensors the denominator sums (an overlap ratio, not
    a number of elements: its 0/0 is two empty sets, which smoothing scores 1)."""
    if not (den.min == 0 and math.isfinite(den.max) and den.max >= 1 and den.max.is_integer()):
        return None
    got = _divisors(ev.code)
    if not got:
        return None
    one = _one_division(ev.code)
    if one is not None and _overlap_terms(ev, *one):
        return None  # a ratio of two overlapping sums (dice): 0/0 is two empty sets
    if _continuous_made(ev):
        return None  # a sum of weights or probabilities (a.sum(-1) of a softmax): no count
    divisor = got[0]
    if _COUNT_CODE.search(divisor):
        return f"the line makes it a count: {divisor}"
    for name in dict.fromkeys(re.findall(r"(?<![\w.])([A-Za-z_]\w*)(?![\w(])", divisor)):
        made = _assigned_before(ev.source, name)
        for _ in range(3):  # cnt = cnt.to(h.dtype): look further up for what made it
            if made is None or _COUNT_CODE.search(made):
                break
            rhs = made.split("=", 1)[1]
            if not re.match(rf"\s*{re.escape(name)}\b", rhs):
                break
            src = _line_of(ev.source, made)
            made = _assigned_before(src, name) if src else None
        if made is not None and _COUNT_CODE.search(made):
            return f"made as a count: {made}"
        if _COUNT_NAME.fullmatch(name):
            return f"its name, {name}, says it is a count"
    return None


#: ops whose result is whole numbers when their operands are (a count's making: a mask's
#: .float(), a sum of it, an index_add of ones), as autograd names them, lower-case
_WHOLE_OPS = _PICKS | {
    "tocopy", "copy", "sum", "add", "sub", "mul", "neg", "abs", "cumsum", "indexadd",
    "scatteradd", "scatter", "indexput", "zeros", "ones", "full", "fill", "newones",
    "newzeros", "cat", "stack", "clamp", "clampmin", "clampmax", "maximum", "minimum",
    "where", "maskedfill", "floor", "ceil", "round", "bincount", "countnonzero",
}  # fmt: skip


def _continuous_made(ev: OpEvent) -> bool:
    """The data flow shows the denominator made by an op whose values are not whole numbers
    (``other_made_from``, as the replay saw it: ``sum<mul<softmax`` of ``a / a.sum(-1)``
    with ``a`` attention weights, a parameter's ``leaf``): a sum of weights or
    probabilities, not a count, whatever its min and max happen to be. False when the flow
    was not recorded, or shows only ops that keep whole numbers whole (``sum<tocopy`` of
    ``mask.float().sum(1)``)."""
    made = ev.scalars.get("other_made_from")
    if not isinstance(made, str) or not made:
        return False
    return any(op not in _WHOLE_OPS for op in made.split("<"))


def _renormalization(ev: OpEvent) -> tuple[str, str, str] | None:
    """(``a``, ``a.sum(-1, keepdim=True)``, the fixed line) of a division of a tensor by its
    own sum, ``w = a / a.sum(-1, keepdim=True)`` (or ``s = a.sum(...)`` assigned above):
    weights renormalized to sum to 1, whose 0/0 is a row of ``a`` that is all 0. None for any
    other division, for a sum that is a count (the caller rules that out), and for a sum of
    exp() terms the data flow shows reaching the exp through no product (underflow, told
    elsewhere; a product there is a mask)."""
    picked = _picked_division(ev)
    if picked is None:
        return None
    stmt, div, _ = picked
    right: ast.expr = div.right
    if isinstance(right, ast.Name):
        value = _unconditional_assignment(ev, right.id)
        if value is None:
            return None
        right = value
    if not (isinstance(right, ast.Call) and isinstance(right.func, ast.Attribute)):
        return None
    if right.func.attr == "sum" and ast.unparse(right.func.value) not in ("torch", "th"):
        summed = right.func.value
    elif right.func.attr == "sum" and right.args:
        summed = right.args[0]
    else:
        return None
    if ast.unparse(summed) != ast.unparse(div.left):
        return None
    made = ev.scalars.get("other_made_from")
    ops = made.split("<") if isinstance(made, str) else []
    for op in ops[1:]:
        if op in ("exp", "exp2"):
            return None  # exp() terms summed as they are: an underflow (told elsewhere)
        if op not in _PICKS:
            break
    x = ast.get_source_segment(stmt, div.left) or ast.unparse(div.left)
    d = ast.get_source_segment(stmt, div.right) or ast.unparse(div.right)
    line = stmt.split("  #", 1)[0].rstrip()
    if not line.isascii() or div.right.end_col_offset is None:
        return None
    dtype = f"{x}.dtype" if isinstance(div.left, ast.Name) else f"torch.{ev.dtype or 'float32'}"
    head, tail = line[: div.right.col_offset], line[div.right.end_col_offset :]
    fixed = (
        f"{head}{paren(d)}.clamp_min(torch.finfo({dtype}).eps){tail}   # a row whose weights "
        "are all 0 stays 0, not NaN; every sum above eps unchanged (not clamp_min(1): a sum "
        "below 1 would change)"
    )
    return x, d, fixed


def _line_of(source: str | None, stmt: str, reach: int = 40) -> str | None:
    """``file.py:N`` of the nearest line above ``source`` that holds ``stmt``."""
    import linecache

    path, _, num = (source or "").rpartition(":")
    if not path or not num.isdigit():
        return None
    for n in range(int(num) - 1, max(0, int(num) - reach), -1):
        if stmt in linecache.getline(path, n):
            return f"{path}:{n}"
    return None


def _python_count(ev: OpEvent) -> bool:
    """The denominator is a Python int (``loss / n_micro``): a count, no tensor."""
    n = ev.scalars.get("other")
    return isinstance(n, int) and not isinstance(n, bool) and "other" not in dict(ev.inputs)


def _bare(expr: str) -> str:
    """``expr`` without one pair of parentheses around all of it: ``W - 1`` of ``(W - 1)``."""
    e = expr.strip()
    if e.startswith("(") and e.endswith(")"):
        try:
            if ast.dump(ast.parse(e[1:-1].strip(), mode="eval")) == ast.dump(
                ast.parse(e, mode="eval")
            ):
                return e[1:-1].strip()
        except SyntaxError:
            pass
    return e


def _size_minus_one(divisor: str) -> str | None:
    """``W`` of a divisor ``(W - 1)`` / ``len(xs) - 1``: a size minus 1, 0 at size 1."""
    try:
        node = ast.parse(divisor.strip(), mode="eval").body
    except SyntaxError:
        return None
    if (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Sub)
        and isinstance(node.right, ast.Constant)
        and node.right.value == 1
    ):
        return ast.unparse(node.left)
    return None


def _count_text(ev: OpEvent) -> str:
    """Why a Python-int divisor was 0, from how the line writes it: a size minus 1 (0 at
    size 1), a floor division (a count of micro-batches), or a count in general."""
    divisors = [d for st in statements(ev.code) for d in _divisors(st)]
    sizes = [z for d in divisors if (z := _size_minus_one(d)) is not None]
    if sizes:
        d = " or ".join(_bare(d) for d in divisors if _size_minus_one(d) is not None)
        z = " or ".join(sizes)
        return (
            f"The denominator {d} is a size minus 1, and it is 0 when {z} is 1: a "
            "one-pixel level of an image pyramid or a thin crop (align_corners "
            "normalization 2·x / (W - 1) - 1), a dimension of one element, the n - 1 of an "
            "unbiased estimate from one sample. x/0 is ±inf and 0/0 is NaN. Floor it at 1 "
            f"(max({sizes[0]} - 1, 1)): at size 1 the only coordinate is 0, and 0 / 1 = 0 is "
            "the right value."
        )
    made = [
        m
        for d in divisors
        if _NAME.fullmatch(d.strip()) and (m := _assigned_before(ev.source, d.strip()))
    ]
    if not ev.code or any("//" in d or "len(" in d for d in [*divisors, *made]):
        return (
            "The denominator is a Python int, a count, and it was 0 at this step: a "
            "number of gradient-accumulation micro-batches computed as len(batch) // "
            "micro_batch_size for a short last batch, an accumulation count of 0, the "
            "size of an empty batch. x/0 is ±inf and 0/0 is NaN. Count with ceiling "
            "division (-(-len(batch) // micro_batch_size)) or floor the count at 1."
        )
    return (
        "The denominator is a Python int, a count, and it was 0 at this step (an empty "
        "batch or selection, a counter that was never incremented, a step count that starts "
        "at 0). x/0 is ±inf and 0/0 is NaN. Floor the count at 1, or skip the division when "
        "there is nothing to divide."
    )


def _count_fix(ev: OpEvent) -> str:
    """``max(n, 1)`` around the user's Python-int divisor: a count of 0 divides by 1."""
    own = _rewrite_divisor(ev.code, lambda d: f"max({_bare(d)}, 1)")
    if own is not None:
        return f"{own}   # a count of 0 divides by 1 (an int: no tensor to clamp)"
    stmts = statements(ev.code)
    each = [_rewrite_divisor(st, lambda d: f"max({_bare(d)}, 1)") for st in stmts]
    if len(stmts) > 1 and all(r is not None for r in each):  # one division per statement
        line = "; ".join(r.strip() for r in each if r is not None)
        return f"{line}   # a size or count of 0 divides by 1 (an int: no tensor to clamp)"
    return (
        "y = x / max(d, 1)   # d: the Python int you divide by (a count): at least 1, "
        "no tensor to clamp"
    )


_POWER = re.compile(r"\s*\*\*\s*(?:-?\s*\d[\w.]*|[A-Za-z_][\w.]*|\([^()]*\))")
_MARK = "\x00divisor\x00"


def _rewrite_divisor(code: str | None, wrap: Callable[[str], str]) -> str | None:
    """``rewrite_divisor`` with a power taken whole: ``g / (c * x) ** 2`` divides by
    ``(c * x) ** 2`` (``**`` binds tighter than ``/``), so ``wrap`` gets all of it.

    >>> _rewrite_divisor("y = g / (c * x) ** 2", lambda d: f"F({d})")
    'y = g / F((c * x) ** 2)'
    """
    seen: list[str] = []

    def mark(d: str) -> str:
        seen.append(d)
        return _MARK

    marked = rewrite_divisor(code, mark)
    if marked is None:
        return None
    head, tail = marked.split(_MARK)
    d = seen[0]
    power = _POWER.match(tail)
    if power is not None:
        d, tail = d + tail[: power.end()], tail[power.end() :]
    return head + wrap(d) + tail


def _one_plus_power(code: str | None) -> str | None:
    """The user's line with ``g / (c * x.abs()) ** k`` written ``g / (1 + c * x.abs()) ** k``:
    the fast-sigmoid surrogate gradient, finite at x = 0; None for any other divisor."""
    got = _divisors(code)
    m = re.fullmatch(r"\((.*)\)(\s*\*\*\s*\S+)", got[0].strip()) if len(got) == 1 else None
    if m is None or not re.search(r"\babs\(|\.abs\(\)", m.group(1)):
        return None
    return _rewrite_divisor(code, lambda _: f"(1 + {m.group(1)}){m.group(2)}")


def _sqrt_made_divisor(ev: OpEvent) -> str | None:
    """``n = torch.sqrt(n2 + 1e-8)``: the assignment, above the user's line, of the one name
    its divisions divide by, when that name is a square root (a norm written by hand), with
    an eps inside the sqrt; None when the line or the assignment shows none."""
    names = {
        n.right.id
        for _, tree in _parsed(ev.code)
        for n in ast.walk(tree)
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div) and isinstance(n.right, ast.Name)
    }
    if len(names) != 1:
        return None
    made = _assigned_before(ev.source, names.pop())
    if made is None or not re.search(r"(?<![\w.])(?:torch\.)?sqrt\(|\.sqrt\(", made):
        return None
    if re.search(r"(?<![\w.])(?:torch\.)?sqrt\(", made):  # torch.sqrt(e): e + eps as is
        return rewrite_call(made, ["sqrt"], lambda e: f"{e} + 1e-8")
    return rewrite_call(made, ["sqrt"], lambda e: f"({e} + 1e-8)")


def _power_base(d: str) -> str:
    """``(c * x)`` for ``(c * x) ** 2``: the tensor whose dtype a power keeps; else ``d``
    made safe for an attribute."""
    base = _POWER.sub("", d, count=1) if _POWER.search(d) else d
    return paren(base)


def _divisors(code: str | None) -> list[str]:
    """The divisors of the divisions on ``code`` (the user's line), as written."""
    got: list[str] = []

    def keep(d: str) -> str:
        got.append(d)
        return d

    _rewrite_divisor(code, keep)
    return got


def _exp_args(code: str) -> list[str]:
    """The argument of each ``torch.exp(x)`` / ``x.exp()`` of the statement ``code``.

    >>> _exp_args("return torch.exp(wx) * (-h).exp() / 2")
    ['wx', '-h']
    """
    try:
        tree = ast.parse(code.strip().removeprefix("return").strip() or "0", mode="eval")
    except SyntaxError:
        return []
    got: list[str] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "exp":
            own = isinstance(n.func.value, ast.Name) and n.func.value.id == "torch"
            args = n.args if own else [n.func.value]
            if len(args) == 1 and not n.keywords:
                got.append(ast.unparse(args[0]))
    return got


def _exp_argument(code: str) -> str | None:
    """The argument of the first ``torch.exp(x)`` / ``x.exp()`` of ``code``."""
    got: list[str] = []

    def keep(x: str) -> str:
        got.append(x)
        return x

    rewrite_call(code, ["exp"], keep)
    return got[0] if got else None


def _assigned_before(source: str | None, name: str, reach: int = 40) -> str | None:
    """The last ``name = ...`` statement above line ``source`` (``file.py:42``) in the same
    function, read from the file; None when the file cannot be read or shows none."""
    import linecache

    path, _, num = (source or "").rpartition(":")
    if not path or not num.isdigit():
        return None
    line = int(num)
    here = linecache.getline(path, line)
    indent = len(here) - len(here.lstrip())
    pattern = re.compile(rf"^\s*{re.escape(name)}\s*=(?!=)")
    for n in range(line - 1, max(0, line - reach), -1):
        text = linecache.getline(path, n)
        if not text.strip():
            continue
        if re.match(r"\s*(?:async\s+)?def\s", text) and len(text) - len(text.lstrip()) < indent:
            return None  # the function's start: the name is not assigned in it
        for stmt in statements(text):
            if pattern.match(stmt):
                return stmt.strip()
    return None


def _assigned_expr(source: str | None, name: str) -> tuple[str, ast.expr] | None:
    """:func:`_assigned_before`'s statement and its right-hand side parsed; None when there
    is none or it does not parse."""
    made = _assigned_before(source, name)
    if made is None:
        return None
    try:
        return made, ast.parse(made.split("=", 1)[1].strip(), mode="eval").body
    except SyntaxError:
        return None


def _underflowed_denominator(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, u: _Underflow, *, evidence: list[str], title: str
) -> Diagnosis:
    """A denominator that is 0 because the exp() terms it sums underflowed: exp(x) is
    exactly 0 below log(smallest subnormal); clamping it divides by eps and zeroes the
    result and its gradient, the log domain (logsumexp) keeps it exact."""
    lim = limits(ev.dtype) or limits("float32")
    assert lim is not None
    dtype = ev.dtype or "float32"
    low, normal = math.log(lim.subnormal / 2), math.log(lim.tiny)
    if u.graph:
        return _graph_underflowed(ctx, a, ev, u, evidence=evidence, title=title)
    if u.via is not None:
        return _feature_map_underflowed(ctx, a, ev, u, evidence=evidence, title=title)
    evidence.append(
        f"the denominator {u.denominator} is a sum of exp() terms"
        + (f": {u.made}" if u.name else "")
        + f"; exp(x) is exactly 0 in {dtype} for x below {fmt(low)} "
        f"(below {fmt(normal)} it loses precision), so every term underflowed"
    )
    ratio = "0/0" in title
    soft = _log_softmax_fix(ev, u) if u.name else None
    if soft is not None:
        return ctx.diagnosis(
            **op_fields(ev, a),
            title=f"{title}: exp() underflowed to 0",
            evidence=evidence,
            explanation=_SOFTMAX_UNDERFLOW_TEXT.format(
                dtype=dtype, low=fmt(-low), what="0/0 is NaN" if ratio else "x/0 is inf"
            ),
            fix=soft,
        )
    if not _summed_exp(u):
        return _single_exp_denominator(ctx, a, ev, u, evidence=evidence, title=title)
    x = u.exponent or "x"
    name = u.name or "t"
    mm = re.fullmatch(rf"\(?\s*{re.escape(name)}(\.t\(\)|\.T)?\s*@\s*([\w.]+)\s*\)?", u.denominator)
    lines = [
        f"log_{name} = {x}   # was {u.made}: keep the exponent, never form the exp"
        if u.name
        else f"# {u.made}: keep the exponent {x}, never form the exp"
    ]
    lhs = _target(statements(ev.code)[0] if statements(ev.code) else None)
    num = _numerator_text(ev.code)
    if mm is not None and lhs and num:
        t = ".t()" if mm.group(1) else ""
        lines.append(
            f"log_{lhs} = torch.log({num}) - torch.logsumexp(log_{name}{t} + "
            f"torch.log({mm.group(2)}), dim=-1)   # was {lhs} = {num} / {u.denominator}: "
            "the same in the log domain"
        )
    else:
        lines.append(
            f"log_d = torch.logsumexp({x}, dim=-1)   # log of the sum of exps, finite where "
            "the sum underflows to 0; divide by subtracting: log_y = torch.log(num) - log_d"
        )
    lines.append(
        f"# or keep the exponents above {fmt(normal)} (a larger temperature, a larger "
        "entropic eps); not .clamp_min(eps): the quotient and its gradient become 0 and "
        "training stops"
    )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=f"{title}: exp() underflowed to 0",
        evidence=evidence,
        explanation=_UNDERFLOW_TEXT.format(
            dtype=dtype, low=fmt(low), what="0/0 is NaN" if ratio else "x/0 is inf"
        ),
        fix="\n".join(lines),
    )


_SUMMING = frozenset(
    ("sum", "nansum", "mean", "matmul", "mm", "bmm", "mv", "dot", "einsum", "cumsum", "norm")
)


def _summed_exp(u: _Underflow) -> bool:
    """The denominator sums its exp() terms (``exp(x).sum(-1)``, ``K @ v``, ``a + exp(b)``),
    read from the line's divisor and the assignment that made the exp; False for one exp
    scaled or raised (``sig = log_sig.exp()`` then ``(y - mu) / sig``), which no logsumexp
    rewrites. Unreadable code counts as summed (the template as before)."""
    texts = [u.denominator, u.made.split("=", 1)[1] if u.name else u.made]
    for text in texts:
        try:
            node = ast.parse(_unwrapped(text.strip()), mode="eval").body
        except SyntaxError:
            return True
        for n in ast.walk(node):
            if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Sub, ast.MatMult)):
                return True
            if isinstance(n, ast.Call):
                f = n.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if called in _SUMMING:
                    return True
    return u.via is not None


_SINGLE_EXP_TEXT = (
    "The denominator is one exp(), not a sum of them: exp(x) is exactly 0 in {dtype} for x "
    "below {low} (a log-scale or log-variance head driven far negative, a collapsed "
    "mixture component), so {what}. Dividing by multiplying, num * exp(-x), does not "
    "help: exp(-x) overflows for -x above {over}, which it is wherever exp(x) underflowed; "
    "nothing is summed, so no logsumexp applies either. A floor at finfo.tiny ** 0.25 "
    "({floor}) keeps the quotient and the 1/d² of its gradient finite; a scale this small "
    "is a collapsed component: keep x in a range in the model."
)


def _single_exp_denominator(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, u: _Underflow, *, evidence: list[str], title: str
) -> Diagnosis:
    """The zero denominator is one exp() that underflowed (``sig = log_sig.exp()``, then
    ``(y - mu) / sig``): floor the exp where it is made, in the user's names."""
    lim = limits(ev.dtype) or limits("float32")
    assert lim is not None
    dtype = ev.dtype or "float32"
    low = fmt(math.log(lim.subnormal / 2))
    x = u.exponent or "x"
    floor = f"torch.finfo({paren(x)}.dtype).tiny ** 0.25"
    if u.name and "=" in u.made:
        target, rhs = u.made.split("=", 1)
        fix = (
            f"{target.strip()} = {paren(rhs.strip())}.clamp_min({floor})   # was {u.made}: "
            f"exactly 0 for {x} below {low} in {dtype}; floored, a division by {u.name} and "
            "its gradient stay finite"
        )
    else:
        line = _rewrite_divisor(ev.code, lambda d: f"{paren(d)}.clamp_min({floor})")
        fix = (
            f"{line}   # exp({x}) is exactly 0 for {x} below {low} in {dtype}"
            if line is not None
            else f"d = torch.exp({x}).clamp_min({floor})   # the denominator, floored"
        )
    lines = [
        fix,
        f"# better, keep {x} in a range in the model ({paren(x)}.clamp(min=...), or a scale "
        "made as F.softplus(raw) + a minimum)",
    ]
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=f"{title}: exp() underflowed to 0",
        evidence=evidence,
        explanation=_SINGLE_EXP_TEXT.format(
            dtype=dtype,
            low=low,
            what="0/0 is NaN" if "0/0" in title else "x/0 is inf",
            over=fmt(lim.exp_bound),
            floor=fmt(lim.tiny**0.25),
        ),
        fix="\n".join(lines),
    )


def _feature_map_underflowed(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, u: _Underflow, *, evidence: list[str], title: str
) -> Diagnosis:
    """A denominator summed from the exp() features a method returns (a Performer's
    positive random features ``phi(x) = exp(w.x - |x|^2 / 2)``): the exp underflowed to 0
    in the dtype, so whole rows of features are 0 and so is their sum. Subtract the
    exponent's maximum (a constant per sequence, which cancels between numerator and
    denominator) and compute the features in float32."""
    lim = limits(ev.dtype) or limits("float32")
    f32 = limits("float32")
    assert lim is not None
    assert f32 is not None
    dtype = ev.dtype or "float32"
    low, normal = math.log(lim.subnormal / 2), math.log(lim.tiny)
    where = (u.via_at or "").rpartition("/")[2]
    evidence.append(
        f"the denominator {u.denominator} sums and multiplies exp() features made by "
        f"{u.via}(), which returns {u.made.removeprefix('return ')}"
        + (f" ({where})" if where else "")
    )
    evidence.append(
        f"exp(x) is exactly 0 in {dtype} for x below {fmt(low)} (log of half its smallest "
        f"subnormal; below log(finfo.tiny) = {fmt(normal)} it is already subnormal): where "
        "every feature of a row underflowed, their sum is 0"
    )
    exps = _exp_args(u.made)
    x = " + ".join(paren(e) for e in exps) if len(exps) > 1 else u.exponent or "x"
    simple = _NAME.fullmatch(x) is not None
    z = x if simple else "z"
    first = "" if simple else f"{z} = {x}; "
    fix = (
        f"{first}{z} = {z}.float(); {z} = {z} - {z}.amax(dim=(-2, -1), keepdim=True).detach()"
        f"   # in {u.via}, before: {u.made}"
        + ("" if simple else f" (and torch.exp({z}) in place of its exp)")
        + "\n# the exponent's maximum, a constant per sequence (FAVOR+'s stabilizer): every "
        "feature is scaled by the same exp(-max), which cancels between numerator and "
        "denominator, and the largest feature is exp(0) = 1\n"
    )
    call = ctx.trace.call(a.record.call)
    ref = module_ref(ev.path or a.path, root=call is not None and call.root)
    if lim.short_range and ref != "model":
        # the float32 features meet the module's float16 tensors (v, the weights): the
        # module runs in float32, its inputs cast up and its outputs back
        cast = (
            "torch.utils._pytree.tree_map(lambda a: a.to(torch.{}) if torch.is_tensor(a) "
            "and a.is_floating_point() else a, {})"
        )
        fix += (
            f"{ref}.float()   # once, after building the model: the features and the sums "
            f"over them in float32, where exp underflows only below "
            f"{fmt(math.log(f32.subnormal / 2))}, not {fmt(low)}\n"
            f"{ref}.register_forward_pre_hook(lambda m, args: {cast.format('float32', 'args')})"
            f"   # its {dtype} inputs up to float32\n"
            f"{ref}.register_forward_hook(lambda m, args, out: {cast.format(dtype, 'out')})   "
            f"# its output (normalized) back to {dtype}\n"
        )
    fix += (
        f"# not a clamp on {u.denominator}: the quotient of 0-features by a floor is 0, and so "
        "is its gradient"
    )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=f"{title}: exp() features underflowed to 0",
        evidence=evidence,
        explanation=(
            f"The denominator is a sum of exp() features, and exp(x) is exactly 0 in {dtype} "
            f"for x below {fmt(low)}. Features such as a Performer's exp(w.x - |x|^2 / 2) have "
            "exponents far below 0 when the inputs are large (no normalization before the "
            f"attention): every feature of a row underflows, their sum is 0 and the "
            "division is 0/0 = NaN. Subtracting the exponent's maximum keeps the largest "
            "feature at 1, and float32 holds exponents down to "
            f"{fmt(math.log(f32.subnormal / 2))}."
        ),
        fix=fix,
    )


def _softmax_to_log(stmt: str) -> tuple[str, str] | None:
    """``(p, F.log_softmax(z, dim=1))`` for ``p = F.softmax(z, dim=1)`` (also
    ``torch.softmax``, ``z.softmax(1)``): the name assigned and the statement's value with
    its softmax call made a log_softmax; None for anything else."""
    try:
        top = ast.parse(stmt).body[0]
    except (SyntaxError, IndexError):
        return None
    if not (
        isinstance(top, ast.Assign)
        and len(top.targets) == 1
        and isinstance(top.targets[0], ast.Name)
    ):
        return None
    value = ast.get_source_segment(stmt, top.value)
    if value is None:
        return None
    shift = top.value.col_offset
    for n in ast.walk(top.value):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        tail = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if tail != "softmax":
            continue
        end = (f.end_col_offset or 0) - shift
        if value[end - len("softmax") : end] != "softmax":
            return None
        return top.targets[0].id, value[: end - len("softmax")] + "log_softmax" + value[end:]
    return None


def _log_softmax_fix(ev: OpEvent, u: _Underflow) -> str | None:
    """The fix for a division by a softmax that underflowed to 0 (a distillation loss
    written with probabilities, ``torch.log(p_old / p_new)``): the softmax's own argument
    through log_softmax, and the log of the quotient as a difference of logs, with the
    numerator's log_softmax too when it is a softmax as well; None when ``u.made`` is not
    ``name = ...softmax(...)``."""
    got = _softmax_to_log(u.made)
    if got is None or got[0] != u.name:
        return None
    name, log_value = got
    lines = [
        f"log_{name} = {log_value}   # was {u.made}: its log, finite where the softmax "
        "underflowed to 0"
    ]
    stmt = next(iter(statements(ev.code)), "")
    try:
        tree: ast.AST | None = ast.parse(stmt) if stmt else None
    except SyntaxError:
        tree = None
    for n in ast.walk(tree) if tree is not None else ():
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        arg: ast.expr | None = None
        if isinstance(f, ast.Attribute) and f.attr == "log" and not n.keywords:
            if len(n.args) == 1 and ast.unparse(f.value) == "torch":
                arg = n.args[0]
            elif not n.args and ast.unparse(f.value) != "torch":
                arg = f.value
        if not (
            isinstance(arg, ast.BinOp)
            and isinstance(arg.op, ast.Div)
            and ast.unparse(arg.right) == name
        ):
            continue
        num = ast.get_source_segment(stmt, arg.left) or ast.unparse(arg.left)
        log_num = f"torch.log({num})"
        if isinstance(arg.left, ast.Name):
            made = _assigned_before(ev.source, arg.left.id)
            top = _softmax_to_log(made) if made is not None else None
            if top is not None and top[0] == arg.left.id:
                lines.append(f"log_{top[0]} = {top[1]}   # was {made}")
                log_num = f"log_{top[0]}"
        lines.append(
            f"{_spliced(stmt, n, f'({log_num} - log_{name})')}   # log(a / b) = log(a) - "
            "log(b): no division, no 0/0"
        )
        return "\n".join(lines)
    lines.append(
        f"# then divide in the log domain: log(a / {name}) = log(a) - log_{name}, "
        f"a / {name} = torch.exp(torch.log(a) - log_{name})"
    )
    return "\n".join(lines)


_CUMPROD_CALL = re.compile(r"(?<![\w.])torch\.(?:cum)?prod\(|\.(?:cum)?prod\(")
_ELU_CALL = re.compile(r"(?<![\w.])(?:F|torch\.nn\.functional|torch)\.elu_?\(")


@dataclass(frozen=True)
class _Shrunk:
    """A denominator made by an op whose positive result rounds to exactly 0: a (cumulative)
    product of factors below 1, or elu(x) + 1 (= exp(x) for x < 0)."""

    kind: str  #: ``cumprod`` or ``elu``
    said: str  #: how nanwatch knows: the statement that made it, or the autograd nodes
    name: str | None = None  #: the name assigned (``P``), when read from the code
    made: str | None = None  #: that statement (``P = torch.cumprod(dA, dim=1)``)


def _shrinking_maker(ev: OpEvent) -> _Shrunk | None:
    """The zero denominator of a forward division was made by a cumprod/prod or by an
    elu (``elu(x) + 1``): from the line or an earlier line of the function that assigned a
    name the divisor uses, else from the autograd nodes that made it (``other_made_by``)."""
    for den in _divisors(ev.code):
        texts = [(None, den)]
        for name in dict.fromkeys(re.findall(r"(?<![\w.])([A-Za-z_]\w*)(?![\w(])", den)):
            made = _assigned_before(ev.source, name)
            if made is not None:
                texts.append((name, made))
        for name, text in texts:
            for kind, pat in (("cumprod", _CUMPROD_CALL), ("elu", _ELU_CALL)):
                if pat.search(text):
                    said = f"{name} was made by {text}" if name else f"the divisor is {text}"
                    return _Shrunk(kind, said, name, text if name else None)
    chain = ev.scalars.get("other_made_by")
    if isinstance(chain, str):
        bases = [node_base(n) for n in chain.split("<")]
        for kind, nodes in (("cumprod", ("Cumprod", "Prod")), ("elu", ("Elu",))):
            if any(b in nodes for b in bases):
                return _Shrunk(kind, f"the divisor was made by autograd nodes {chain}")
    return None


def _shrunk_denominator(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    den: TensorStat,
    u: _Shrunk,
    *,
    evidence: list[str],
    title: str,
) -> Diagnosis:
    """A denominator that is positive in exact arithmetic and 0 in the dtype: a cumulative
    product of factors below 1 that underflowed, or elu(x) + 1 that rounded to 0. The fix
    keeps it in the log domain, or computes it in float32."""
    dtype = ev.dtype or "float32"
    lim = limits(dtype) or limits("float32")
    assert lim is not None
    narrow = dtype in _NARROW
    zeros = f"{den.zeros:,} of its {den.numel:,} values are exactly 0"
    if u.kind == "cumprod":
        evidence.append(
            f"{u.said}: a product of many factors below 1 shrinks geometrically, and "
            f"{zeros}: it fell below {fmt(lim.subnormal / 2)} (half of {dtype}'s smallest "
            f"subnormal, torch.finfo(torch.{dtype}).tiny = {fmt(lim.tiny)}) and underflowed"
        )
        explanation = (
            "The denominator is a cumulative product (a decay over a sequence, a survival "
            "or transmittance curve, a scan's state transition) of factors below 1. It is "
            f"positive in exact arithmetic, but over a long sequence it underflows to exactly "
            f"0 in {dtype}, and x/0 is ±inf, 0/0 NaN. No clamp makes the quotient right: keep "
            "the product in the log domain (a cumsum of logs) and form ratios of products "
            "as exp of a difference of log sums, which stays finite."
        )
        lhs = u.name or "P"
        factors, dim = _cumprod_args(u.made) or ("a", "1")
        was = u.made or f"P = torch.cumprod(a, dim={dim})"
        fix = (
            f"log_{lhs} = torch.cumsum(torch.log({factors}), dim={dim})   # was {was}: log of "
            f"the product, never 0 (for {factors} = torch.exp(z): torch.cumsum(z, dim={dim}))\n"
            f"# divide by subtracting: x / {lhs}_s as x * torch.exp(-log_{lhs}_s), and a ratio "
            f"{lhs}_t / {lhs}_s as torch.exp(log_{lhs}_t - log_{lhs}_s) (a segment sum, finite)\n"
            + (
                "# and compute it in float32: a 16-bit dtype underflows far sooner\n"
                if narrow
                else ""
            )
            + "# not .clamp_min(eps): the quotient is then wrong by orders of magnitude"
        )
    else:
        cut = math.log(lim.eps / 4)
        evidence.append(
            f"{u.said}: elu(x) + 1 equals exp(x) for x < 0, positive in exact arithmetic, "
            f"but elu(x) rounds to exactly -1 in {dtype} once exp(x) is below "
            f"{fmt(lim.eps / 4)} (x below {fmt(cut)}, eps = {fmt(lim.eps)}), and {zeros}"
        )
        explanation = (
            f"The denominator is a sum of elu(x) + 1 features (linear attention's normalizer). "
            f"elu(x) + 1 is positive for every x in exact arithmetic, but in {dtype} elu(x) "
            f"rounds to -1 for x below {fmt(cut)}, so the feature is exactly 0, and a query or "
            "key whose features are all that negative gives a normalizer of 0: x/0 is inf, "
            "0/0 NaN."
            + (
                f" This is a {dtype} underflow: float32 holds the same values down to x "
                f"below {fmt(math.log((limits('float32') or lim).eps / 4))}."
                if narrow
                else ""
            )
        )
        eps = "1e-4" if narrow else "1e-6"
        own = next(
            (e for st in statements(ev.code) if (e := _spliced_eps(st, eps)) is not None), None
        )
        fix = (
            f"{own}   # an eps {dtype} holds (at least {fmt(lim.tiny)}, "
            f"torch.finfo(torch.{dtype}).tiny) keeps the normalizer off 0\n"
            if own
            else f"# add an eps to the normalizer, at least {fmt(lim.tiny)} "
            f"(torch.finfo(torch.{dtype}).tiny): d + {eps} in {dtype}\n"
        ) + (
            "# or compute the features and the normalizer in float32: "
            "F.elu(h.float()) + 1, then cast the result back"
            if narrow
            else "# or a feature map that stays positive: F.elu(h) + 1 + 1e-6"
        )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=f"{title}: the denominator underflowed to 0",
        evidence=evidence,
        explanation=explanation,
        fix=fix,
    )


def _cumprod_args(made: str | None) -> tuple[str, str] | None:
    """(factors, dim) of the cumprod in ``P = torch.cumprod(a, dim=1)`` / ``a.cumprod(1)``."""
    try:
        tree = ast.parse((made or "").strip())
    except SyntaxError:
        return None
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            if n.func.attr != "cumprod":
                continue
            args = list(n.args)
            if ast.unparse(n.func.value) != "torch":
                args.insert(0, n.func.value)
            kw = {k.arg: k.value for k in n.keywords}
            dim = kw.get("dim") or (args[1] if len(args) > 1 else None)
            if args and dim is not None:
                return ast.unparse(args[0]), ast.unparse(dim)
    return None


def _spliced_eps(stmt: str, eps: str) -> str | None:
    """``stmt`` (one division) with ``+ eps`` added to its divisor."""
    one = _one_division(stmt)
    if one is None:
        return None
    st, div = one
    d = ast.get_source_segment(st, div.right)
    if d is None:
        return None
    return _spliced(st, div.right, f"({d} + {eps})", grouped=True)


_SOFTMAX_UNDERFLOW_TEXT = (
    "The denominator is a softmax, and softmax(z) is exactly 0 in {dtype} where z lies "
    "more than {low} below its row's largest entry (confident logits, a small "
    "temperature): the division by it is {what}. Clamping it keeps the quotient finite but "
    "wrong. log_softmax computes the same log-probabilities without forming the exp and "
    "is finite there; divide by subtracting logs."
)

_UNDERFLOW_TEXT = (
    "The denominator is a sum of exp() terms, and exp(x) is exactly 0 in {dtype} for x "
    "below {low}: with exponents as large in magnitude as x / eps for a small temperature "
    "or entropic eps (a Sinkhorn kernel exp(-C / eps), a softmax written by hand) every "
    "term underflowed and the sum is 0, so {what}. Clamping the denominator keeps it "
    "finite but wrong: every quotient is 0, and so is its gradient. In the log domain the "
    "sum is torch.logsumexp, which subtracts the largest exponent first and never "
    "underflows."
)


def _graph_underflowed(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, u: _Underflow, *, evidence: list[str], title: str
) -> Diagnosis:
    """:func:`_underflowed_denominator` told from the autograd graph (the line unknown):
    the nodes that made the denominator from exp(), and how many of the exp's values are
    exactly 0."""
    lim = limits(ev.dtype) or limits("float32")
    assert lim is not None
    dtype = ev.dtype or "float32"
    low, normal = math.log(lim.subnormal / 2), math.log(lim.tiny)
    bases = [node_base(n).lower() for n in u.graph]
    via = f" through {' of '.join(bases[:-1])}" if len(bases) > 1 else ""
    z, n = u.zeros or (0, 0)
    held = f"every one of its {n:,} values is 0" if z == n else f"{z:,} of its {n:,} values are 0"
    evidence.append(
        f"the denominator was made from exp(){via} (autograd nodes {' < '.join(u.graph)}), "
        f"and {held}: exp(x) is exactly 0 in {dtype} for x below {fmt(low)} (below "
        f"{fmt(normal)} it loses precision), so those terms underflowed"
    )
    evidence.append(untraced_hint(ctx))
    if len(bases) == 1:  # the denominator is the exp itself: nothing summed
        lines = [
            "d = torch.exp(x).clamp_min(torch.finfo(x.dtype).tiny ** 0.25)   # a pattern, in "
            "your names: d the denominator, x what you pass to torch.exp(x)",
            "# better, keep x in a range in the model (x.clamp(min=...), or a scale made as "
            "F.softplus(raw) + a minimum)",
            '# mode="forensic" names your line, and nanwatch rewrites it',
        ]
        return ctx.diagnosis(
            **op_fields(ev, a),
            title=f"{title}: exp() underflowed to 0",
            evidence=evidence,
            explanation=_SINGLE_EXP_TEXT.format(
                dtype=dtype,
                low=fmt(low),
                what="0/0 is NaN" if "0/0" in title else "x/0 is inf",
                over=fmt(lim.exp_bound),
                floor=fmt(lim.tiny**0.25),
            ),
            fix="\n".join(lines),
        )
    lines = ["log_K = x   # x: what you pass to torch.exp(x); keep it, never form the exp"]
    if len(bases) > 1 and bases[0] in ("mv", "dot"):
        lines.append(
            "log_d = torch.logsumexp(log_K + torch.log(v), dim=-1)   # was d = torch.exp(x) "
            "@ v: finite where the product underflows to 0"
        )
    elif len(bases) > 1 and bases[0] in ("mm", "bmm"):
        lines.append(
            "log_d = torch.logsumexp(log_K.unsqueeze(-1) + torch.log(V).unsqueeze(-3), "
            "dim=-2)   # was d = torch.exp(x) @ V: finite where the product underflows to 0"
        )
    else:
        lines.append(
            "log_d = torch.logsumexp(log_K, dim=-1)   # was d = torch.exp(x).sum(-1): finite "
            "where the sum underflows to 0"
        )
    lines += [
        "log_y = torch.log(num) - log_d   # was y = num / d: divide by subtracting logs",
        f"# or keep the exponents above {fmt(normal)} (a larger temperature, a larger "
        "entropic eps); not .clamp_min(eps): the quotient and its gradient become 0 and "
        "training stops",
    ]
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=f"{title}: exp() underflowed to 0",
        evidence=evidence,
        explanation=_UNDERFLOW_TEXT.format(
            dtype=dtype, low=fmt(low), what="0/0 is NaN" if "0/0" in title else "x/0 is inf"
        ),
        fix="\n".join(lines),
    )


def _numerator_text(code: str | None) -> str | None:
    """The left operand of the one binary ``/`` of the user's line, when it is a name."""
    for stmt in statements(code):
        m = re.search(r"=\s*([A-Za-z_][\w.]*)\s*/\s", stmt)
        if m:
            return m.group(1)
    return None


def _inf_given(ctx: RuleContext, a: Anomaly, ev: OpEvent, trigger: OpEvent) -> Diagnosis:
    """An op that passed on an infinity one of its inputs already held (finite × inf):
    nothing overflowed. Names the input that held it (a loss's class weights, a parameter,
    the module's input) and the usual origin, a division by a zero count."""
    op = short_op(ev.op)
    held = inf_inputs(ev)
    weights = None
    evidence: list[str] = []
    named: str | None = None
    for nm, s in held:
        what, is_weight = _inf_holder(ctx, ev, nm, s)
        weights = weights or (what if is_weight else None)
        expr = _operand(ev, nm)
        named = named or expr
        evidence.append(
            f"{op} did not make the inf: its input {nm}"
            + (f" ({expr}, {what})" if expr else f" ({what})")
            + f" already held {infinities(s)}: {describe_stat(s)}"
        )
    for nm, st in ev.inputs:
        if st is not None and all(nm != h for h, _ in held):
            evidence.append(f"input {nm}: {describe_stat(st)}")
    out = infinities(ev.output) or ev.born
    evidence.append(
        f"{op} passed it on ({out} in its {ev.dtype} output; finite × inf = ±inf): no "
        "value overflowed"
    )
    evidence += _chain_evidence(ev, trigger, ev.born)
    mask = None if weights else _inf_mask_maker(ctx, ev, held)
    if mask is not None:
        return _inf_mask_given(ctx, a, ev, mask, evidence)
    if named is None and len(held) == 1:
        named = _unary_operand(ev)
    state = None if weights else _module_state_inf(ev, named)
    if state is not None and named is not None:
        return _state_inf_given(ctx, a, ev, named, state, evidence=evidence)
    holder = weights or (_inf_holder(ctx, ev, *held[0])[0] if held else "an input")
    if named and not weights:
        holder = f"{named} ({holder})"
    ref = _weight_ref(ev.code) if weights else None
    check = ref or named or "t"
    return ctx.diagnosis(
        **op_fields(ev, a),
        title="Infinite value given to an op (not an overflow)",
        evidence=evidence,
        explanation=(
            f"{op} made no infinity of its own: {holder} already held one, and an "
            "arithmetic op passes an inf on (finite × inf = ±inf; 0 × inf and inf - inf "
            "are NaN). Such an inf is almost always a division by a count that was 0, "
            "computed before the step: inverse-frequency class weights 1 / counts or "
            "counts.sum() / counts where a class has no sample, a pos_weight = neg / pos "
            "with no positive, a normalizer over an empty set. Fix it where it was "
            "computed, and check the tensor is finite before training."
        ),
        fix=(
            "counts = counts.clamp_min(1)   # where the weights were computed: a class with "
            "no sample divides by 1, not 0 (1 / 0 = inf)\n"
            f"assert torch.isfinite({check}).all(), {check}   # "
            + (
                "the weights the loss was given"
                if ref
                else "where it is made"
                if named
                else "t: the tensor that held the inf, checked where it is made"
            )
        ),
    )


def _state_inf_given(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    named: str,
    state: tuple[str, str],
    *,
    evidence: list[str],
) -> Diagnosis:
    """The inf an op passed on is a module's state (a buffer) that the code starts at an
    infinity, the identity of a running min or max, and that was read before anything
    updated it: an observer never calibrated, a running extreme read in eval mode first."""
    op = short_op(ev.op)
    attr, made = state
    where = f"{ev.path}'s" if ev.path else "the module's"
    evidence.insert(
        0,
        f"{named} is {where} state {attr}, set to an infinity by `{made}`, and it still held "
        "it here: nothing updated it before this read",
    )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title="Infinite value given to an op (not an overflow): a state still at its initial inf",
        evidence=evidence,
        explanation=(
            f"{op} made no infinity of its own: {named} ({where} {attr}) already held one. The "
            "code starts it at ±inf, the identity of a running min or max (an observer's "
            "min_val = +inf, max_val = -inf), and it was read before any value updated it: "
            "the update runs only in training mode, or only after a calibration pass that "
            "has not run yet (a validation pass before the first training step). No division "
            "made this inf. Read the state only once it has seen data, or fall back to the "
            "current batch while it is still infinite."
        ),
        fix=(
            f"{attr} = torch.where(torch.isinf({named}), x.min(), {named})   # read {attr} in "
            f"place of {named}: while it has seen no data, the batch's own value (x: the "
            "tensor it observes; x.max() for a running max)\n"
            f"# or calibrate first: run a training-mode pass (or update {named}) before the "
            "first evaluation\n"
            f"assert torch.isfinite({named}).all(), {named}   # where it is read"
        ),
    )


_MASK_OPS = frozenset(
    {"masked_fill", "masked_fill_", "where", "full", "full_like", "fill", "fill_"}
)
_INF_TOKEN = re.compile(
    r"""(?:-\s*)?(?:float\(\s*["'][+-]?inf(?:inity)?["']\s*\)|(?:math|torch|np|numpy)\.inf)""",
    re.IGNORECASE,
)


def _inf_mask_maker(
    ctx: RuleContext, ev: OpEvent, held: list[tuple[str, TensorStat]]
) -> OpEvent | None:
    """The traced op that wrote the infinities an input of ``ev`` held on purpose: a
    ``masked_fill`` / ``where`` / ``full`` given a constant inf (a mask of forbidden
    entries), of the same size, earlier in the step; None when the trace shows none."""
    if not held:
        return None
    for mk in ctx.trace.ops:
        if mk is ev:
            break
        if packet(mk.op) not in _MASK_OPS or not mk.injected:
            continue
        for _, st in held:
            same = st.numel == mk.output.numel
            if same and (
                (st.has_posinf and mk.output.has_posinf) or (st.has_neginf and mk.output.has_neginf)
            ):
                return mk
    return None


def _inf_mask_given(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, mk: OpEvent, evidence: list[str]
) -> Diagnosis:
    """An inf written on purpose (a cost or score masked with ``masked_fill(~allowed, inf)``)
    that an op later passed on: a row with nothing allowed is inf everywhere, and the
    logsumexp or max-subtraction over it is inf - inf = NaN. The fix writes a large finite
    value in the mask's place, on the mask's line when it is known."""
    op = short_op(ev.op)
    made = infinities(mk.output) or mk.born
    at = f" {mk.at}" if mk.at else ""
    line = f": {mk.code.strip()}" if mk.code else ""
    outside = "a buffer or a tensor the code captured, made outside the traced ops"
    evidence[:] = [e.replace(outside, f"made by {short_op(mk.op)}{at}") for e in evidence]
    evidence.insert(
        0,
        f"{short_op(mk.op)} made the infinities on purpose{at}{line} ({made} of "
        f"{mk.output.numel:,} values): a mask of forbidden entries, not a count that was 0",
    )
    sign = "-" if "-inf" in mk.born and "+inf" not in mk.born else ""
    target = None
    for stmt in statements(mk.code):
        m = re.match(r"\s*([A-Za-z_][\w.]*)\s*=(?!=)", stmt)
        target = target or (m.group(1) if m else None)
    dtype = f"{target}.dtype" if target else f"torch.{mk.dtype or ev.dtype or 'float32'}"
    big = f"{sign}torch.finfo({dtype}).max ** 0.5"
    note = (
        "# a large finite value, not inf: a row with nothing allowed stays finite (inf - inf "
        "is NaN); sqrt(max) leaves room for / eps and sums"
    )
    own = None
    for stmt in statements(mk.code):
        if _INF_TOKEN.search(stmt):
            own = _INF_TOKEN.sub(lambda _: big, stmt, count=1).strip()
            break
    fix = f"{own}   {note}" if own else f"cost = cost.masked_fill(~allowed, {big})   {note}"
    fix += (
        "\n# and where a row may have nothing allowed, drop it or give it a default partner "
        "(its result is meaningless either way)"
    )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title="Infinite value given to an op (not an overflow): an inf mask",
        evidence=evidence,
        explanation=(
            f"{op} made no infinity of its own: {short_op(mk.op)} wrote them as a mask of "
            "forbidden entries. An inf mask works only while every row (or column) keeps one "
            "finite entry: where nothing is allowed the row is inf everywhere, and a "
            "logsumexp, a softmax or a max subtracted over it computes inf - inf = NaN. A "
            "large finite value masks the same entries (exp of it is 0) and stays finite "
            "where a row has nothing allowed."
        ),
        fix=fix,
    )


#: a literal non-finite number on the user's line (``float("-inf")``, ``math.inf``)
_INF_LITERAL = re.compile(
    r"""^-?\s*(?:float\(\s*["'][+-]?(?:inf|infinity|nan)["']\s*\)|(?:math|torch|np|numpy)\."""
    r"""(?:inf|nan))$""",
    re.IGNORECASE,
)


def _scalar_given(ctx: RuleContext, a: Anomaly, ev: OpEvent, trigger: OpEvent) -> Diagnosis:
    """An arithmetic op given a non-finite Python number (``g.neg() * ctx.lambd`` with
    ``lambd = inf``): it passed the inf on, nothing overflowed. Names the number and the
    usual origin, a schedule such as ``1 / (1 - p)`` at ``p = 1``; the fix bounds it on the
    user's line. A literal ``float("-inf")`` there (a 0/1 mask times -inf, NaN where the
    mask is 0) is replaced by the dtype's finite extreme."""
    op = short_op(ev.op)
    name, value = nonfinite_scalars(ev)[0]
    expr = _operand(ev, name)
    literal = expr is not None and _INF_LITERAL.match(expr) is not None
    name_it = f" ({expr})" if expr and not literal else ""
    evidence = [
        f"{op} made no inf of its own: it was given the number {name}={fmt(value)}{name_it}, "
        "a Python number, not a tensor"
    ]
    # a finite number past float32's range (see nonfinite_scalars): inf where the op computes
    past = math.isfinite(value)
    f32 = limits("float32")
    f32_max = f32.max if f32 is not None else math.inf
    if past:
        evidence[0] += (
            f", past {fmt(f32_max)}, float32's largest value: the op computes with it in "
            "float32, where it is inf"
        )
    evidence += [f"input {nm}: {describe_stat(st)}" for nm, st in ev.inputs if st is not None]
    out = infinities(ev.output) or ev.born
    rule_of = (
        "x × inf = ±inf, 0 × inf = NaN" if packet(ev.op) in ("mul", "mul_") else "x + inf = inf"
    )
    evidence.append(
        f"{op} passed it on ({out} in its {ev.dtype} output; {rule_of}): no value "
        "overflowed, so clipping or a lower learning rate changes nothing"
    )
    evidence += _chain_evidence(ev, trigger, ev.born)
    fix: list[str] = []
    if literal and expr is not None and not math.isnan(value):
        extreme = f"torch.finfo(torch.{ev.dtype or 'float32'}).{'max' if value > 0 else 'min'}"
        fixed = _replace_operand(ev, name, lambda _: extreme)
        if fixed is not None:
            fix.append(f"{fixed}   # finite: 0 × it is 0, not NaN")
        else:
            fix.append(f"# write {extreme} for {expr} on {ev.source or 'the line'}")
        return ctx.diagnosis(
            **op_fields(ev, a),
            title="Infinite number given to an op (not an overflow)",
            evidence=evidence,
            explanation=(
                f"{expr} is written on the line: {op} multiplies or adds it as it is, and "
                "0 × inf is NaN (a 0/1 mask times -inf is NaN wherever the mask is 0). The "
                "dtype's most negative finite value masks as well and keeps 0 × it at 0."
            ),
            fix="\n".join(fix),
        )
    ref = expr or f"the number given as {name}"
    made = _attribute_quotient(ev, expr) if expr and math.isinf(value) else None
    if made is not None:
        stmt, where, divisor = made
        evidence.insert(
            1,
            f"{expr} is made at {where}: {stmt}; {fmt(value)} there means {divisor} was 0 "
            "(numpy and torch scalars divide by 0 with a warning, not an error)",
        )
        return ctx.diagnosis(
            **op_fields(ev, a),
            title=f"Infinite number given to an op: {stmt} is inf ({divisor} is 0)",
            evidence=evidence,
            explanation=(
                f"{stmt.split('=', 1)[0].strip()} was computed as a division by {divisor}, "
                f"and {divisor} was 0 when the module was built: a rank, size or count "
                "derived from a configuration (int(round(frac * d)) is 0 for a small d), "
                f"a number divided in numpy, which gives inf instead of raising. Capping "
                f"{expr} would hide a component built empty; check {divisor} where it is "
                "given."
            ),
            fix=(
                f"assert {divisor} != 0, {divisor}   # before {stmt} ({where}): a rank or "
                f"count must be at least 1; skip the component when {divisor} is 0"
            ),
        )
    bounded = None
    if not math.isnan(value):
        bounded = _replace_operand(
            ev, name, lambda e: f"min({e}, 1e3)" if value > 0 else f"max({e}, -1e3)"
        )
    if bounded is not None:
        fix.append(f"{bounded}   # {expr} was {fmt(value)}")
    elif expr and past:
        fix.append(f"assert abs({expr}) < 1e3, {expr}   # before {ev.source or 'the op'}")
    elif expr:
        fix.append(f"assert math.isfinite({expr}), {expr}   # before {ev.source or 'the op'}")
    if past:
        fix.append(
            f"# and where {ref} is computed: a schedule that grows without bound (10 ** step, "
            "exp(t)) or a division by a value near 0; bound the result"
            + (" (min(value, 1e3))" if not expr else "")
        )
    else:
        fix.append(
            f"# and where {ref} is computed: a schedule 1 / (1 - p) is inf at p = 1; keep p "
            "below 1 (min(p, 0.999)) or bound the result"
            + (" (min(value, 1e3))" if not expr else "")
        )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=(
            "Number past float32's range given to an op (not an overflow)"
            if past
            else "Infinite number given to an op (not an overflow)"
        ),
        evidence=evidence,
        explanation=(
            f"{op} made no infinity of its own: {ref} was {fmt(value)} when it ran"
            + (f", which float32 cannot hold (its max is {fmt(f32_max)})" if past else "")
            + ". It is a number computed in Python, outside the tensors nanwatch watches: "
            + (
                "a schedule or coefficient that grew without bound (a gradient-reversal "
                "lambda, a loss weight, an annealing factor), or a ratio with a denominator "
                "near 0. Bound it where it is computed."
                if past
                else "a schedule such as a gradient-reversal or warm-up factor 1 / (1 - p), "
                "which is inf at p = 1, a ratio of counts divided by 0 in numpy, or .item() of "
                "an inf. Bound it where it is computed."
            )
        ),
        fix="\n".join(fix),
    )


def _attribute_quotient(ev: OpEvent, expr: str) -> tuple[str, str, str] | None:
    """For an operand ``self.<attr>`` of the user's line: the statement of the class that
    assigned it as a division (``self.scaling = alpha / r``), where, and its divisor, when
    the file shows exactly one such assignment above the line; else None."""
    import linecache

    m = re.fullmatch(r"self\.([A-Za-z_]\w*)", expr.strip())
    path, _, num = (ev.source or "").rpartition(":")
    if m is None or not path or not num.isdigit():
        return None
    pattern = re.compile(rf"^\s*self\.{re.escape(m.group(1))}\s*=(?!=)")
    found: list[tuple[str, str, str]] = []
    for n in range(1, int(num)):
        text = linecache.getline(path, n)
        for stmt in statements(text):
            if not pattern.match(stmt):
                continue
            try:
                value = ast.parse(stmt.strip()).body[0]
            except (SyntaxError, IndexError):
                return None
            if not isinstance(value, ast.Assign):
                return None
            rhs = value.value
            if not (isinstance(rhs, ast.BinOp) and isinstance(rhs.op, ast.Div)):
                return None
            if isinstance(rhs.right, ast.Constant):
                return None
            found.append((stmt.strip(), f"{path}:{n}", ast.unparse(rhs.right)))
    return found[0] if len(found) == 1 else None


def _replace_operand(ev: OpEvent, name: str, wrap: Callable[[str], str]) -> str | None:
    """The user's statement with input ``name`` of its one binary op replaced by
    ``wrap(operand text)`` (``g * ctx.lambd`` -> ``g * min(ctx.lambd, 1e3)``); None when
    the line holds no single such operator."""
    kind = _BINARY.get(packet(ev.op).rstrip("_"))
    if kind is None or name not in ("self", "other"):
        return None
    found: list[tuple[str, ast.BinOp]] = []
    for stmt in statements(ev.code):
        try:
            tree = ast.parse(stmt)
        except SyntaxError:
            return None
        found += [
            (stmt, n) for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, kind)
        ]
    if len(found) != 1:
        return None
    stmt, node = found[0]
    side = node.left if name == "self" else node.right
    if side.end_col_offset is None or side.lineno != 1 or side.end_lineno != 1:
        return None
    text = stmt[side.col_offset : side.end_col_offset]
    return stmt[: side.col_offset] + wrap(text) + stmt[side.end_col_offset :]


def _inf_holder(ctx: RuleContext, ev: OpEvent, name: str, s: TensorStat) -> tuple[str, bool]:
    """What the input ``name`` of ``ev`` that held an inf was, in words, and whether it is
    a loss's class weights: a parameter of the op's module, that module's input (an
    activation from upstream), else a tensor the loss holds besides its input (a loss) or a
    tensor from outside the traced code."""
    trace = ctx.trace
    calls = [c for c in trace.calls if ev.path is not None and c.path == ev.path]
    ids = {c.id for c in calls}
    for r in trace.records:
        m = exact(trace, r) if r.path == ev.path else None
        st = m.stat if m is not None else None
        if st is None or st.numel != s.numel or not (st.has_posinf or st.has_neginf):
            continue
        if r.phase is Phase.PARAMETER:
            return f"parameter {r.role} of {r.path}", False
        if r.phase is Phase.INPUT and r.call in ids:
            return f"{r.path}'s {r.role}, an activation from upstream", False
    if name in ("weight", "pos_weight") or any(c.is_loss for c in calls):
        loss = ev.path or "the loss"
        return f"the class weights {loss} was given, its weight or pos_weight", True
    return "a buffer or a tensor the code captured, made outside the traced ops", False


_BINARY = {"mul": ast.Mult, "add": ast.Add, "sub": ast.Sub, "div": ast.Div, "true_divide": ast.Div}


def _operand(ev: OpEvent, name: str) -> str | None:
    """The user's expression for input ``self`` / ``other`` of a binary op when its line
    holds exactly one such operator (``x * s.scale``: ``other`` is ``s.scale``)."""
    kind = _BINARY.get(packet(ev.op).rstrip("_"))
    if kind is None or name not in ("self", "other"):
        return None
    found: list[ast.BinOp] = []
    for stmt in statements(ev.code):
        try:
            tree = ast.parse(stmt)
        except SyntaxError:
            return None
        found += [n for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, kind)]
    if len(found) != 1:
        return None
    side = found[0].left if name == "self" else found[0].right
    return None if isinstance(side, ast.Constant) else ast.unparse(side)


def _unary_operand(ev: OpEvent) -> str | None:
    """The user's expression for the one input of a unary op when its line holds exactly
    one such call (``-s.min_val`` of aten.neg, ``x.abs()`` / ``torch.abs(x)``)."""
    op = packet(ev.op).rstrip("_")
    found: list[ast.expr] = []
    for stmt in statements(ev.code):
        try:
            tree = ast.parse(stmt.strip())
        except SyntaxError:
            return None
        for n in ast.walk(tree):
            if op == "neg" and isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
                if not isinstance(n.operand, ast.Constant):
                    found.append(n.operand)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                if n.func.attr != op:
                    continue
                if ast.unparse(n.func.value) == "torch" and len(n.args) == 1:
                    found.append(n.args[0])
                elif ast.unparse(n.func.value) != "torch" and not n.args:
                    found.append(n.func.value)
    return ast.unparse(found[0]) if len(found) == 1 else None


_STATE_REF = re.compile(r"^([A-Za-z_]\w*)\.([A-Za-z_]\w*)$")


def _module_state_inf(ev: OpEvent, expr: str | None) -> tuple[str, str] | None:
    """When ``expr`` is a module attribute (``s.min_val``) that the file registers as a
    buffer, or sets, to an infinity (``register_buffer("min_val", torch.tensor(float("inf")))``):
    (the attribute, the statement that set it). A state kept across calls (a running min
    or max, an observer) that still holds its initial inf: it was never updated."""
    import linecache

    m = _STATE_REF.match(expr or "")
    path = (ev.source or "").rpartition(":")[0]
    if m is None or not path:
        return None
    attr = m.group(2)
    reg = re.compile(
        rf"register_buffer\(\s*[\"']{re.escape(attr)}[\"']\s*,|"
        rf"(?<![\w.])[A-Za-z_]\w*\.{re.escape(attr)}\s*=(?!=)"
    )
    for line in linecache.getlines(path):
        for stmt in statements(line):
            if reg.search(stmt) and re.search(r"\binf\b|float\(\s*[\"'][+-]?inf", stmt):
                return attr, stmt.strip()
    return None


def _weight_ref(code: str | None) -> str | None:
    """The user's class weights on a loss line: the ``weight=`` / ``pos_weight=`` argument
    of a functional loss, else ``crit.weight`` for a call of a loss module ``crit(x, y)``."""
    for stmt in statements(code):
        try:
            tree = ast.parse(stmt)
        except SyntaxError:
            continue
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
        for c in calls:
            for k in c.keywords:
                if k.arg in ("weight", "pos_weight"):
                    return ast.unparse(k.value)
        for c in calls:
            f = ast.unparse(c.func)
            plain = re.fullmatch(r"[A-Za-z_][\w.]*", f) is not None
            if len(c.args) >= 2 and plain and f.split(".")[0] not in ("torch", "F", "nn"):
                return f"{f}.weight"
    return None


def _above_one(value: float, dtype: str | None) -> bool:
    """``value`` is past 1 by more than rounding: a probability computed in ``dtype`` (a
    projected distribution, a normalized histogram) can end a few ulps above 1
    (1.0000001 in float32) and is still one."""
    lim = dtype_limits(dtype or "float32") or dtype_limits("float32")
    eps = lim.eps if lim is not None else 2.0**-23
    return value > 1 + 8 * eps


def _one_division(code: str | None) -> tuple[str, ast.BinOp] | None:
    """The statement of the user's line holding its one ``/``, and that operator's node;
    None when the line is unknown, not ASCII (offsets), or has no or several ``/``."""
    found = _line_divisions(code)
    return found[0] if found is not None and len(found) == 1 else None


def _line_divisions(code: str | None) -> list[tuple[str, ast.BinOp]] | None:
    """Each ``/`` of the user's line, with the statement that holds it; None when a
    statement is not ASCII (its offsets would not match the text)."""
    found: list[tuple[str, ast.BinOp]] = []
    for stmt in statements(code):
        if not stmt.isascii():
            return None
        try:
            tree = ast.parse(stmt)
        except SyntaxError:
            continue
        found += [
            (stmt, n)
            for n in ast.walk(tree)
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)
        ]
    return found


def _resolved(node: ast.expr, ev: OpEvent, depth: int = 2) -> ast.expr:
    """``node`` with each plain name replaced by the value it was assigned above the user's
    line, whenever that line runs (``sq`` in ``1 + sq`` -> ``(s ** 2).sum(-1)``), ``depth``
    levels deep; names with no such assignment are kept."""
    if depth <= 0 or not ev.source:
        return node

    class _Sub(ast.NodeTransformer):
        def visit_Name(self, n: ast.Name) -> ast.AST:
            if n.id in _MODULES:
                return n
            value = _unconditional_assignment(ev, n.id)
            if value is None or n.id in _tensor_names(value):
                return n
            return _resolved(value, ev, depth - 1)

    import copy

    return _Sub().visit(copy.deepcopy(node))  # type: ignore[no-any-return]


def _positive(node: ast.expr) -> bool:
    """The expression is above 0 whatever the data: a positive number, ``1 + x ** 2``, a
    positive number plus something never negative, ``d.clamp_min(0.1)``."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and node.value > 0
    if isinstance(node, ast.BinOp):
        left, right = node.left, node.right
        if isinstance(node.op, ast.Add):
            return (_positive(left) and _never_negative(right)) or (
                _positive(right) and _never_negative(left)
            )
        if isinstance(node.op, (ast.Mult, ast.Div)):
            return _positive(left) and _positive(right)
        if isinstance(node.op, ast.Pow):
            return _positive(left)
        return False
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        name = node.func.attr
        if name in ("clamp_min", "clamp", "clip"):
            low = [k.value for k in node.keywords if k.arg == "min"] + node.args[:1]
            return bool(low) and _positive(low[0])
    return False


def _cannot_be_zero(node: ast.expr, ev: OpEvent) -> str | None:
    """Why a divisor of the user's line cannot be 0 (``1 + sq``: 1 plus a value that is
    never negative, sq = ``(s ** 2).sum(-1)``); None when it can."""
    if _positive(node):
        return "a positive number" if isinstance(node, ast.Constant) else "at least positive"
    full = _resolved(node, ev)
    if full is not node and _positive(full):
        return f"{ast.unparse(full)}, never 0"
    return None


def _whole_code(ev: OpEvent) -> str | None:
    """The user's line, or the whole statement that starts there when the line alone does
    not parse (a formula continued on the next lines)."""
    for stmt in statements(ev.code):
        try:
            ast.parse(stmt)
        except SyntaxError:
            return full_statement(ev.source) or ev.code
    return ev.code


def _sqrt_eps(ev: OpEvent, name: str) -> str | None:
    """``norm = torch.sqrt(sq + 1e-8)``: the assignment of the divisor ``name``, above the
    user's line, with an eps the dtype holds inside each square root that has none (a norm
    written by hand); a clamp after the sqrt keeps the forward finite but the sqrt's own
    backward still divides by 0. None when ``name`` is not made by a sqrt."""
    made = _assigned_before(ev.source, name)
    if made is None or not made.isascii():
        return None
    try:
        tree = ast.parse(made)
    except SyntaxError:
        return None
    roots: list[tuple[ast.expr, bool]] = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
            continue
        if n.func.attr != "sqrt" or n.keywords:
            continue
        mod = ast.unparse(n.func.value) in ("torch", "math", "np")
        arg = n.args[0] if mod and len(n.args) == 1 else n.func.value if not n.args else None
        if arg is None:
            continue
        guarded = (
            isinstance(arg, ast.BinOp)
            and isinstance(arg.op, ast.Add)
            and (_positive(arg.left) or _positive(arg.right))
        )
        if not guarded and not _positive(arg):
            roots.append((arg, not mod))
    if not roots:
        return None
    eps = _eps_floor(ev.dtype) or "1e-8"
    for arg, method in sorted(roots, key=lambda r: -r[0].col_offset):
        text = ast.get_source_segment(made, arg) or ast.unparse(arg)
        made = _spliced(made, arg, f"({text} + {eps})" if method else f"{text} + {eps}")
    return made


@dataclass(frozen=True)
class _ZeroDivisions:
    """The divisions of the user's line whose denominator can be 0, when it has several."""

    stmt: str
    divisions: list[ast.BinOp]
    #: the divisors passed over, each with why it cannot be 0
    ruled_out: list[tuple[str, str]]
    total: int


def _zero_divisions(ev: OpEvent) -> _ZeroDivisions | None:
    """The divisions of the user's line that can have divided by the zeros: a line with
    several ``/`` keeps those whose divisor can be 0 (``1 + sq`` of a square cannot); None
    when the line is unknown, not ASCII, has no ``/``, or they span several statements."""
    found = _line_divisions(_whole_code(ev))
    if not found:
        return None
    kept: list[tuple[str, ast.BinOp]] = []
    out: list[tuple[str, str]] = []
    for stmt, n in found:
        why = _cannot_be_zero(n.right, ev)
        if why is None:
            kept.append((stmt, n))
        else:
            out.append((ast.get_source_segment(stmt, n.right) or ast.unparse(n.right), why))
    if not kept or len({s for s, _ in kept}) != 1:
        return None
    kept.sort(key=lambda sn: sn[1].right.col_offset)
    return _ZeroDivisions(kept[0][0], [n for _, n in kept], out, len(found))


def _picked_division(ev: OpEvent) -> tuple[str, ast.BinOp, str | None] | None:
    """The statement and the ``/`` of the user's line that divided by the zeros, with the
    evidence that picked it among several (None when the line has one); None when the line
    is unknown or several divisions can be 0."""
    one = _one_division(ev.code)
    if one is not None:
        return one[0], one[1], None
    z = _zero_divisions(ev)
    if z is None or len(z.divisions) != 1:
        return None
    div = z.divisions[0]
    d = ast.get_source_segment(z.stmt, div.right) or ast.unparse(div.right)
    others = "; ".join(f"{t} is {why}" for t, why in z.ruled_out)
    said = f"the line divides {z.total} times; only {d} can be 0 ({others}): it held the zeros"
    return z.stmt, div, said


def _which_division(ev: OpEvent) -> list[str]:
    """Evidence of which ``/`` of a line with several divided by the zeros: the one whose
    divisor can be 0, or that the zeros cannot tell them apart; [] for a line with one."""
    if _one_division(ev.code) is not None:
        return []
    picked = _picked_division(ev)
    if picked is not None:
        return [picked[2]] if picked[2] else []
    z = _zero_divisions(ev)
    if z is None or len(z.divisions) < 2:
        return []
    ds = [ast.get_source_segment(z.stmt, d.right) or ast.unparse(d.right) for d in z.divisions]
    return [
        f"the line divides {z.total} times and {len(ds)} of its divisors can be 0 "
        f"({', '.join(ds)}); the op's statistics do not say which one held the zeros, so the "
        "fix guards each"
    ]


_MASK_CALLS = frozenset(
    {"eq", "ne", "gt", "ge", "lt", "le", "isfinite", "isnan", "isinf", "isin", "isclose"}
    | {"logical_and", "logical_or", "logical_not", "logical_xor", "bool"}
)


def _mask_of(node: ast.expr, source: str | None, depth: int = 3) -> bool:
    """The expression is a mask, a bool tensor or a 0/1 cast of one: a comparison, ``~m``,
    ``a & b``, ``m.float()``, ``torch.isfinite(x)``, a slice of one, or a name assigned one
    above line ``source``."""
    if isinstance(node, ast.Compare):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
        return _mask_of(node.operand, source, depth)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr, ast.BitXor)):
        return _mask_of(node.left, source, depth) or _mask_of(node.right, source, depth)
    if isinstance(node, ast.Subscript):
        return _mask_of(node.value, source, depth)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr in _MASK_CALLS:
            return True
        if node.func.attr in _CASTS and ast.unparse(node.func.value) not in _MODULES:
            return _mask_of(node.func.value, source, depth)
        return False
    if isinstance(node, ast.Name) and depth > 0 and node.id not in _MODULES:
        found = _assigned_expr(source, node.id)
        if found is None:
            return False
        made, value = found
        if node.id in _tensor_names(value):
            return False
        return _mask_of(value, _line_of(source, made) or source, depth - 1)
    return False


def _mask_count(node: ast.expr, source: str | None, depth: int = 2) -> str | None:
    """The mask a divisor counts (``alive`` for ``alive.sum()``, ``alive.float().sum()``,
    ``torch.count_nonzero(alive)``, or a name assigned such a count), as written; None when
    the divisor is not a count of a mask."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        f = node.func.attr
        mod = ast.unparse(node.func.value) in _MODULES
        x = node.args[0] if mod and node.args else None if mod else node.func.value
        if x is None:
            return None
        if f == "count_nonzero" or (f == "sum" and _mask_of(x, source)):
            return ast.unparse(x)
        if f in _CASTS and not mod:  # mask.sum().float()
            return _mask_count(x, source, depth)
        return None
    if isinstance(node, ast.Name) and depth > 0 and node.id not in _MODULES:
        found = _assigned_expr(source, node.id)
        if found is None:
            return None
        made, value = found
        return _mask_count(value, _line_of(source, made) or source, depth - 1)
    return None


@dataclass(frozen=True)
class _EmptySelection:
    """A division by the count of a mask that selected nothing: a mean over an empty
    selection written by hand."""

    stmt: str
    div: ast.BinOp
    mask: str
    #: where the statement was read when the op's own line is not known (watch mode)
    read_from: str | None


def _loss_statement(ctx: RuleContext, a: Anomaly, ev: OpEvent) -> tuple[str, str] | None:
    """For a division that made the loss itself on a line not recorded (watch mode): the
    statement that assigned the tensor ``backward()`` was called on, read above that call,
    when its value is one division; with where it was read."""
    rec = a.record
    if ev.code or not ev.backward_at or ev.path != "(loss)":
        return None
    if node_base(rec.grad_fn or "") != "Div" or (rec.stat is not None and rec.stat.numel != 1):
        return None
    import linecache

    path, _, num = ev.backward_at.rpartition(":")
    if not num.isdigit():
        return None
    m = re.search(r"([A-Za-z_]\w*)\.backward\(", linecache.getline(path, int(num)))
    if m is None:
        return None
    made = _assigned_before(ev.backward_at, m.group(1))
    if made is None:
        return None
    where = _line_of(ev.backward_at, made)
    try:
        top = ast.parse(made).body[0]
    except (SyntaxError, IndexError):
        return None
    if not (
        isinstance(top, ast.Assign)
        and isinstance(top.value, ast.BinOp)
        and isinstance(top.value.op, ast.Div)
    ):
        return None
    return made, where or ev.backward_at


def _empty_selection(ctx: RuleContext, a: Anomaly, ev: OpEvent) -> _EmptySelection | None:
    """The zero denominator is the count of a mask (``alive.sum()`` of a comparison), on the
    user's line or, in watch mode, on the line that made the loss: the mask selected nothing
    this step."""
    if ev.phase is not Phase.FORWARD:
        return None
    found = _loss_statement(ctx, a, ev)
    if found is not None:
        stmt, where = found
        top = ast.parse(stmt).body[0]
        assert isinstance(top, ast.Assign)
        assert isinstance(top.value, ast.BinOp)
        div: ast.BinOp = top.value
        source: str | None = where
        read_from: str | None = where
    else:
        picked = _picked_division(ev)
        if picked is None:
            return None
        stmt, div, _ = picked
        source, read_from = ev.source, None
    mask = _mask_count(div.right, source)
    if mask is None:
        return None
    return _EmptySelection(stmt, div, mask, read_from)


def _empty_selection_diagnosis(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    e: _EmptySelection,
    *,
    evidence: list[str],
) -> Diagnosis:
    """NW113's story for a mean written by hand, sum over a mask divided by its count: the
    mask picked nothing, the count is 0, and the mean is 0/0."""
    d = ast.get_source_segment(e.stmt, e.div.right) or ast.unparse(e.div.right)
    den = input_named(ev, "other") or other_input(ev, "other")
    # a count per row (mask.sum(-1)) with only some rows empty: those samples, not the step
    rows = den is not None and den.numel > 1 and den.min == 0 < den.max
    evidence.insert(
        0,
        f"the denominator {d} counts the mask {e.mask}: "
        + (
            f"{'some' if den.zeros is None else den.zeros} of its {den.numel} counts are 0 "
            f"(max {fmt(den.max)}): rows it selected nothing in, whose mean is 0/0"
            if den is not None and rows
            else "it selected nothing this step, so the count is 0 and the mean over the "
            "selection is 0/0"
        ),
    )
    if e.read_from is not None:
        evidence.append(f"the loss was made at {e.read_from}: {e.stmt}")
    fixed = _spliced(e.stmt, e.div.right, f"{paren(d)}.clamp_min(1)", grouped=True)
    m = paren(e.mask)
    return ctx.diagnosis(
        **op_fields(ev, a),
        code="NW113",
        title="Mean over an empty selection: the mask selected nothing"
        + (" in some rows" if rows else ""),
        priority=12,
        evidence=evidence,
        explanation=(
            "The division is a mean over a mask written by hand: the sum of the selected "
            "values over the count of the selected ones. This step the mask selected "
            "nothing, so both are 0 and the mean is 0/0 = NaN. An eps floor on the count "
            "would hide it; count at least 1 (an empty selection then gives 0, with zero "
            "gradient), or skip the step when the mask is empty, and find why it selected "
            "nothing when that should not happen."
        ),
        fix=(
            f"{fixed}   # a count of 0 divides by 1: an empty selection gives 0, not NaN\n"
            + (
                "# and find why those rows select nothing: a sample of length 0 (all "
                "padding, or shorter than the model's downsampling) is best dropped in the "
                "Dataset or the collate_fn"
                if rows
                else f"# or skip the step when the mask is empty: if not {m}.any(): continue"
            )
        ),
    )


def _guard_each(ev: OpEvent, z: _ZeroDivisions) -> str | None:
    """The user's line with every divisor that can be 0 kept off it, for a line whose
    divisions the recorded zeros cannot tell apart (B-spline recursions: both ratios have
    knot differences that repeated knots make 0); the quotient changes only where a
    divisor is 0."""
    stmt = z.stmt
    prob = _probability_divisors(ev, z)
    if prob is not None:
        return prob
    eps = ones = False
    for div in sorted(z.divisions, key=lambda n: -n.right.col_offset):
        d = ast.get_source_segment(z.stmt, div.right)
        if d is None:
            return None
        if _never_negative(div.right):
            safe = f"{paren(d)}.clamp_min(torch.finfo({_dtype_of(div.right, d)}).eps)"
            eps = True
        else:
            safe = f"torch.where({d} == 0, 1, {d})"
            ones = True
        stmt = _spliced(stmt, div.right, safe, grouped=True)
    how = " or ".join(w for w, on in (("by 1", ones), ("by eps", eps)) if on)
    return (
        f"{stmt}   # where a divisor is 0 it divides {how} instead"
        + (": the quotient there is its numerator (1/0 gives 1, 0/0 gives 0)" if ones else "")
        + "; elsewhere unchanged"
    )


def _probability_divisors(ev: OpEvent, z: _ZeroDivisions) -> str | None:
    """The divisors are one probability and its complement (``1 / e`` and ``1 / (1 - e)``:
    inverse-propensity weights, a treatment-regularization term), the probability a
    sigmoid's output or the divisor's values in [0, 1]: it saturated at 0 or 1, and it is
    clipped before the division (a where dividing by 1 there would give the smallest
    weight where the weight should be largest). None for other divisors."""
    qs: list[str] = []
    complement = False
    for div in z.divisions:
        d = ast.get_source_segment(z.stmt, div.right)
        if d is None:
            return None
        d = d.strip()
        while d.startswith("(") and d.endswith(")"):
            d = d[1:-1].strip()
        m = _ONE_MINUS.match(d)
        complement = complement or m is not None
        qs.append(m.group(1).strip() if m is not None else d)
    q = qs[0] if qs else ""
    if len(set(qs)) != 1 or len(qs) < 2 or not complement or not _NAME.fullmatch(q):
        return None
    den = input_named(ev, "other") if "div" in ev.op else first_input(ev)
    unit = den is not None and den.min >= 0 and den.max <= 1
    if not unit and _producer_of(q, ev.source)[0] != "sigmoid":
        return None
    clip = fresh_name(f"{q}_clip", set(re.findall(r"\w+", z.stmt)))
    stmt = z.stmt
    for div in sorted(z.divisions, key=lambda n: -n.right.col_offset):
        d = ast.get_source_segment(z.stmt, div.right) or ""
        own = re.sub(rf"(?<![\w.]){re.escape(q)}(?!\w)", clip, d)
        stmt = _spliced(stmt, div.right, paren(own), grouped=True)
    what = "a sigmoid's output" if not unit else "a probability (its values lie in [0, 1])"
    return (
        f"{clip} = {q}.clamp(1e-3, 1 - 1e-3)   # {q} is {what} that saturated at 0 or 1: a "
        "positivity violation (units with no chance of the other arm); clip it for the "
        "division (1e-3 to 1e-6), or trim those units\n"
        f"{stmt.strip()}   # {q} itself is unchanged elsewhere"
    )


#: f(x) / x = 1 + a·x² + O(x⁴) near 0: each f whose ratio with x is a removable 0/0
_RATIO_SERIES = {"sin": (6, -1), "tan": (3, 1), "sinh": (6, 1), "tanh": (3, -1)}


def _factors(node: ast.expr) -> tuple[ast.expr, list[str]]:
    """``node`` without constant factors (``2 * torch.sin(t)`` -> ``torch.sin(t)``, ["2"])."""
    consts: list[str] = []
    while isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        if isinstance(node.left, ast.Constant) and isinstance(node.left.value, (int, float)):
            consts.append(ast.unparse(node.left))
            node = node.right
        elif isinstance(node.right, ast.Constant) and isinstance(node.right.value, (int, float)):
            consts.append(ast.unparse(node.right))
            node = node.left
        else:
            break
    return node, consts


def _series_call(node: ast.expr) -> tuple[str, ast.expr] | None:
    """(f, x) of ``torch.sin(x)`` / ``x.sin()`` for f in :data:`_RATIO_SERIES`."""
    if not isinstance(node, ast.Call) or node.keywords or not isinstance(node.func, ast.Attribute):
        return None
    f = node.func.attr
    if f not in _RATIO_SERIES:
        return None
    if len(node.args) == 1 and ast.unparse(node.func.value) == "torch":
        return f, node.args[0]
    if not node.args:
        return f, node.func.value
    return None


def _removable_ratio(ev: OpEvent) -> tuple[str, str, str] | None:
    """A 0/0 on the user's line that is a removable limit, ``x / (c·sin(x))`` or
    ``sin(x) / x`` (tan, sinh, tanh too) at x = 0: the ratio tends to a finite value there
    (1/c), and clamping the denominator would give 0 instead. The fix evaluates a Taylor
    branch near 0 and the ratio of a safe x elsewhere (the double where keeps the unused
    branch finite for backward); an x made by acos/asin gets a margin inside its clamp,
    since their gradient at ±1 is inf. (evidence, explanation, fix), or None."""
    found = _one_division(ev.code)
    if found is None:
        return None
    stmt, div = found
    num, cn = _factors(div.left)
    den, cd = _factors(div.right)
    if (hit := _series_call(den)) is not None and ast.dump(hit[1]) == ast.dump(num):
        f, x, over = hit[0], num, True  # x / f(x)
    elif (hit := _series_call(num)) is not None and ast.dump(hit[1]) == ast.dump(den):
        f, x, over = hit[0], den, False  # f(x) / x
    else:
        return None
    if not isinstance(x, (ast.Name, ast.Attribute)):
        return None
    xs = ast.unparse(x)
    k, sign = _RATIO_SERIES[f]
    sign = -sign if over else sign
    series = f"1 {'+' if sign > 0 else '-'} {xs} ** 2 / {k}"
    scale = [*cn, *[f"/ {c}" for c in cd]]
    head = " * ".join(cn) if cn else ""
    taylor = f"({series})" if head or cd else series
    if head:
        taylor = f"{head} * {taylor}"
    for c in cd:
        taylor = f"{taylor} / {c}"
    limit = "1"
    if scale:
        limit = f"{' * '.join(cn) or '1'}" + "".join(f" / {c}" for c in cd)
    taken = set(re.findall(r"(?<![\w.])[A-Za-z_]\w*", stmt))
    small, safe = fresh_name("small", taken), fresh_name(f"{xs.split('.')[-1]}_safe", taken)

    class _Swap(ast.NodeTransformer):
        def visit_Name(self, n: ast.Name) -> ast.expr:
            return ast.Name(safe, ast.Load()) if ast.dump(n) == ast.dump(x) else n

        def visit_Attribute(self, n: ast.Attribute) -> ast.expr:
            if ast.dump(n) == ast.dump(x):
                return ast.Name(safe, ast.Load())
            return self.generic_visit(n)  # type: ignore[return-value]

    import copy

    ratio = ast.unparse(_Swap().visit(copy.deepcopy(div)))
    whole = ast.get_source_segment(stmt, div) or ast.unparse(div)
    lines: list[str] = []
    made = _assigned_before(ev.source, xs) if isinstance(x, ast.Name) else None
    inverse = None
    if made is not None:
        rhs = made.split("=", 1)[1].strip()
        arg = call_argument(rhs, ["acos", "asin", "arccos", "arcsin"])
        inverse = re.search(r"\b(a(?:rc)?(?:cos|sin))\(", rhs)
        if arg is not None and inverse is not None:
            m = re.fullmatch(r"(.+?)\.clamp\(\s*-1(?:\.0*)?\s*,\s*1(?:\.0*)?\s*\)", arg.strip())
            inner = m.group(1) if m is not None else arg.strip()
            eps = fresh_name("eps", taken)
            kept = rewrite_call(
                made, ["acos", "asin", "arccos", "arcsin"],
                lambda v: f"{paren(inner)}.clamp(-1 + {eps}, 1 - {eps})",
            )  # fmt: skip
            if kept is not None:
                lines += [
                    f"{eps} = torch.finfo({paren(inner)}.dtype).eps",
                    f"{kept}   # off ±1: {inverse.group(1)}'s gradient there is inf",
                ]
        else:
            inverse = None
    lines += [
        f"{small} = {paren(xs)}.abs() < 1e-2",
        f"{safe} = torch.where({small}, torch.ones_like({xs}), {xs})   # no 0 in the branch "
        "not taken either",
        f"{_spliced(stmt, div, f'torch.where({small}, {taylor}, {ratio})')}   # {whole} -> "
        f"{limit} at {xs} = 0: its Taylor series there",
    ]
    said = (
        f"numerator and denominator vanish together at {xs} = 0: {whole} tends to {limit} "
        "there, a removable 0/0 (a limit), not a division by zero"
    )
    if inverse is not None:
        said += (
            f"; {xs} is {inverse.group(1)} of a value clamped to [-1, 1], exactly 0 at the "
            f"endpoint, where {inverse.group(1)}'s gradient is inf"
        )
    why = (
        f"{whole} is a ratio whose numerator and denominator are both 0 at {xs} = 0 (a "
        "rotation at the identity, an angle of 0): its value there is the limit "
        f"{limit}, but evaluated as it is it is 0/0 = NaN. Clamping the denominator would "
        f"give 0 instead of {limit}, and"
        + (
            f" the next NaN would be {inverse.group(1)}'s gradient at the clamped endpoint"
            if inverse is not None
            else " its gradient would still be wrong there"
        )
        + ". Evaluate the Taylor series near 0 and the ratio elsewhere, with a safe value in "
        "the branch not taken: torch.where differentiates both branches."
    )
    return said, why, "\n".join(lines)


def _spliced(stmt: str, node: ast.expr, text: str, *, grouped: bool = False) -> str:
    """``stmt`` with the source of ``node`` replaced by ``text``; with ``grouped``, the
    parentheses around it too (the right operand of ``/``: ``(hi - lo)``)."""
    a, b = node.col_offset, node.end_col_offset or node.col_offset
    while grouped:
        i, j = a - 1, b
        while i >= 0 and stmt[i] == " ":
            i -= 1
        while j < len(stmt) and stmt[j] == " ":
            j += 1
        if i < 0 or j >= len(stmt) or stmt[i] != "(" or stmt[j] != ")":
            break
        a, b = i, j + 1
    return stmt[:a] + text + stmt[b:]


def _where_guard(code: str | None) -> tuple[str, str] | None:
    """The user's line divides inside a branch of ``torch.where(cond, a / d, b)``: the
    condition, and the line with ``d`` replaced by ``torch.where(cond, d, 1)`` (the
    double-where trick: the discarded branch divides by 1, so its zero gradient stays 0)."""
    one = _one_division(code)
    if one is None:
        return None
    stmt, div = one
    for call in ast.walk(ast.parse(stmt)):
        if not (
            isinstance(call, ast.Call)
            and ast.unparse(call.func) in ("torch.where", "where")
            and len(call.args) == 3
        ):
            continue
        for i in (1, 2):
            inside = any(
                isinstance(n, ast.BinOp)
                and isinstance(n.op, ast.Div)
                and (n.col_offset, n.end_col_offset) == (div.col_offset, div.end_col_offset)
                for n in ast.walk(call.args[i])
            )
            if not inside:
                continue
            cond = ast.get_source_segment(stmt, call.args[0]) or ast.unparse(call.args[0])
            d = ast.get_source_segment(stmt, div.right) or ast.unparse(div.right)
            safe = f"torch.where({cond}, {d}, 1)" if i == 1 else f"torch.where({cond}, 1, {d})"
            return cond, _spliced(stmt, div.right, safe, grouped=True)
    return None


_NORM_FUNCS = ("torch.norm", "torch.linalg.norm", "torch.linalg.vector_norm")
_NORMALIZE_FUNCS = (
    "F.normalize",
    "normalize",
    "functional.normalize",
    "nn.functional.normalize",
    "torch.nn.functional.normalize",
)
_NORMALIZE_EPS = 1e-12  # F.normalize's default eps


def _eps_floor(dtype: str | None) -> str | None:
    """An eps ``dtype`` holds as a normal number: the power of ten at or above
    ``finfo.tiny`` (``1e-4`` in float16), no smaller than the usual 1e-8."""
    lim = limits(dtype)
    if lim is None:
        return None
    return f"1e-{min(8, max(0, -math.ceil(math.log10(lim.tiny))))}"


def _stored_as_zero(value: float, dtype: str | None) -> bool:
    """A positive number that is 0 once stored in ``dtype`` (1e-12 in float16)."""
    import torch

    dt = getattr(torch, dtype or "", None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        return False
    return value > 0 and bool(torch.tensor(value, dtype=dt) == 0)


@dataclass(frozen=True)
class _LostNormalizeEps:
    """``F.normalize(z, dim=1)`` on the user's line, whose eps (1e-12 unless given) is 0 in
    the op's dtype: a zero row is 0 / max(0, 0) = NaN."""

    eps: str  #: the eps as written, or ``1e-12`` (the default)
    given: bool  #: the line passes eps itself
    dtype: str
    floor: str  #: an eps the dtype holds (``1e-4``)
    line: str  #: the user's statement with ``eps=floor``
    operand: str  #: the tensor normalized (``z``)


def _parsed(code: str | None) -> Iterator[tuple[str, ast.Module]]:
    """Each statement of ``code`` that is ASCII and parses, with its tree."""
    for stmt in statements(code):
        if not stmt.isascii():
            continue
        try:
            yield stmt, ast.parse(stmt)
        except SyntaxError:
            continue


def _normalize_eps_lost(code: str | None, dtype: str | None) -> _LostNormalizeEps | None:
    """The user's line calls F.normalize with an eps that is 0 in ``dtype``; None when the
    line shows no such call or the eps is not a literal."""
    floor = _eps_floor(dtype)
    if floor is None or dtype is None:
        return None
    for stmt, tree in _parsed(code):
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and ast.unparse(call.func) in _NORMALIZE_FUNCS):
                continue
            if not call.args:
                continue
            kw = next((k for k in call.keywords if k.arg == "eps"), None)
            if kw is None and len(call.args) >= 4:
                continue  # eps given by position: rare, leave it
            value: object = _NORMALIZE_EPS
            if kw is not None:
                if not isinstance(kw.value, ast.Constant):
                    continue
                value = kw.value.value
            if not isinstance(value, (int, float)) or not _stored_as_zero(float(value), dtype):
                continue
            if kw is not None:
                line = _spliced(stmt, kw.value, floor)
                eps = ast.get_source_segment(stmt, kw.value) or repr(value)
            else:
                end = (call.end_col_offset or 0) - 1
                head = stmt[:end].rstrip()
                sep = " " if head.endswith(",") else ", "
                line = f"{head}{sep}eps={floor}{stmt[end:]}"
                eps = "1e-12"
            operand = ast.get_source_segment(stmt, call.args[0]) or ast.unparse(call.args[0])
            return _LostNormalizeEps(
                eps=eps,
                given=kw is not None,
                dtype=dtype,
                floor=floor,
                line=line,
                operand=operand,
            )
    return None


def _normalize_eps_diagnosis(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    gone: _LostNormalizeEps,
    *,
    evidence: list[str],
    title: str,
) -> Diagnosis:
    """F.normalize divided a zero row by max(norm, eps) with an eps the dtype rounds to 0."""
    lim = limits(gone.dtype)
    sub = f" (anything below {fmt(lim.subnormal / 2)} rounds to 0)" if lim is not None else ""
    which = f"eps={gone.eps}" if gone.given else "default eps=1e-12"
    evidence.insert(
        1,
        f"F.normalize divides by max(norm, eps); its {which} is 0 in {gone.dtype}{sub}, so an "
        "all-zero row is divided by 0",
    )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=title,
        evidence=evidence,
        explanation=(
            f"F.normalize(x) is x / max(‖x‖, eps), and its eps is what keeps an all-zero row "
            f"at 0 instead of 0/0. {gone.dtype} cannot hold {gone.eps}: it is stored as 0, "
            "so the clamp does nothing and every all-zero row (a ReLU output that is 0 "
            "everywhere, a padded sample) becomes NaN. Pass an eps the dtype can hold, or "
            "normalize in float32."
        ),
        fix=(
            f"{gone.line}   # {gone.eps} is 0 in {gone.dtype}; {gone.floor} is not: a zero "
            "row stays 0\n"
            f"# or normalize in float32: F.normalize({gone.operand}.float(), ...).to("
            f"{paren(gone.operand)}.dtype)"
        ),
    )


_CASTS = frozenset({"float", "double", "half", "bfloat16", "to", "type", "type_as", "long", "int"})


def _normalize_fix(stmt: str, div: ast.BinOp, *, eps: str | None = None) -> str | None:
    """``x / x.norm(dim=d, keepdim=True)`` (or ``torch.linalg.norm(x, dim=d, ...)``) as
    ``F.normalize(x, dim=d)``: an L2 norm of the numerator along one dim; with ``eps``
    (a dtype that rounds the default 1e-12 to 0) passed as ``eps=``."""
    right, x = div.right, ast.unparse(div.left)
    if not isinstance(right, ast.Call):
        return None
    func = right.func
    if isinstance(func, ast.Attribute) and func.attr == "norm" and not right.args:
        if ast.unparse(func.value) != x:
            return None
    elif ast.unparse(func) in _NORM_FUNCS and len(right.args) == 1:
        if ast.unparse(right.args[0]) != x:
            return None
    else:
        return None
    kw = {k.arg: k.value for k in right.keywords}
    dim = kw.pop("dim", None)
    keep = kw.pop("keepdim", None)
    p = kw.pop("p", None) or kw.pop("ord", None)
    if dim is None or kw or not (isinstance(keep, ast.Constant) and keep.value is True):
        return None
    if p is not None and not (isinstance(p, ast.Constant) and p.value in (2, 2.0)):
        return None
    seg = ast.get_source_segment(stmt, div.left) or x
    more = f", eps={eps}" if eps is not None else ""
    return _spliced(stmt, div, f"F.normalize({seg}, dim={ast.unparse(dim)}{more})")


def _dtype_of(node: ast.expr, text: str) -> str:
    """``g.dtype`` for ``g.sum(-1)``: the tensor a method chain starts from, when no cast
    changes its dtype on the way; else ``(expr).dtype``."""
    n = node
    while True:
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            if n.func.attr in _CASTS:
                return f"{paren(text)}.dtype"
            n = n.func.value
        else:
            break  # a subscript stays: fisher[n] of a dict has a dtype, fisher has none
    if n is node and isinstance(n, ast.BinOp) and not isinstance(n.op, (ast.Div, ast.Pow)):
        # hi - lo: the operands' dtype (a number on one side keeps the tensor's)
        side = n.right if isinstance(n.left, ast.Constant) else n.left
        if isinstance(side, (ast.Name, ast.Attribute)):
            n = side
    base = ast.unparse(n)
    root = n
    while isinstance(root, ast.Subscript):
        root = root.value
    plain = re.fullmatch(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*", ast.unparse(root)) is not None
    if n is not node and plain and base.split(".")[0] not in ("torch", "F", "nn", "math", "np"):
        return f"{base}.dtype"
    return f"{paren(text)}.dtype"


def _unconditional_assignment(ev: OpEvent, name: str) -> ast.expr | None:
    """The value of the last ``name = value`` above the user's line in the same function
    that runs whenever the line does: assignments under an ``if``/``for``/``with`` (a
    one-line header, or a deeper indent than the line's) are passed over."""
    found = _unconditional_assignment_at(ev, name)
    return found[0] if found is not None else None


def _unconditional_assignment_at(ev: OpEvent, name: str) -> tuple[ast.expr, str] | None:
    """:func:`_unconditional_assignment`'s value and its line (``file.py:N``)."""
    import linecache

    source = ev.source
    path, _, num = (source or "").rpartition(":")
    if not path or not num.isdigit():
        return None
    here = linecache.getline(path, int(num))
    indent = len(here) - len(here.lstrip())
    for _ in range(4):
        made = _assigned_before(source, name)
        where = _line_of(source, made) if made is not None else None
        if made is None or where is None:
            return None
        text = linecache.getline(path, int(where.rpartition(":")[2]))
        body = text.lstrip()
        if len(text) - len(body) > indent or _HEADER_LINE.match(body):
            source = where  # conditional: it may not have run; look further up
            continue
        try:
            tree = ast.parse(made)
        except SyntaxError:
            return None
        node = tree.body[0] if len(tree.body) == 1 else None
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            return None
        target = node.targets[0]
        if not isinstance(target, ast.Name) or target.id != name:
            return None
        return node.value, where
    return None


_HEADER_LINE = re.compile(r"(?:if|elif|else|for|while|with|try|except|finally)\b")
_MODULES = ("torch", "F", "nn", "math", "np", "self")


def _coarse_eps(dtype: str, name: str) -> str:
    """A line to add to an eps floor in a 16-bit float: its eps (9.8e-4 in float16, 7.8e-3
    in bfloat16) is above many legitimate values (an int8 quantization scale max|w| / 127
    of weights below 0.12), which the floor would silently raise; ``""`` in wider dtypes."""
    lim = dtype_limits(dtype) if dtype else None
    if lim is None or not lim.low_precision:
        return ""
    return (
        f"\n# in {lim.name} eps is {fmt(lim.eps)}: a legitimate {name} below it is raised to it;"
        f" when {name} can be that small, floor it at torch.finfo(...).tiny ({fmt(lim.tiny)})"
        f" or compute {name} in float32"
    )


def _fixed_at_assignment(ev: OpEvent, right: ast.expr, den: TensorStat) -> str | None:
    """A denominator that is a plain name assigned above in the same function (``scale =
    (hi - lo) / 255``) is kept off 0 where it is made, so that every division by it is
    safe, not only the one on this line. An attribute (``self.scale``, a buffer) filled
    above by ``self.scale.copy_(v)`` / ``self.scale = v`` is clamped there the same way."""
    if isinstance(right, ast.Attribute) and den.min >= 0:
        return _attribute_fixed_where_made(ev, ast.unparse(right))
    if not isinstance(right, ast.Name):
        return None
    name = right.id
    value = _unconditional_assignment(ev, name)
    if value is None:
        return None
    text = ast.unparse(value)
    if re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", text):
        return None  # scale = scale * k: the first assignment is the one to fix
    names = sorted(_dtype_carriers(value), key=lambda n: n.col_offset)
    coarse = _coarse_eps(ev.dtype, name)
    if den.min >= 0 and names:
        carrier = ast.unparse(names[0])  # stats[k], not stats: a dict has no dtype
        return (
            f"{name} = {paren(text)}.clamp_min(torch.finfo({carrier}.dtype).eps)   # clamped "
            f"where it is made: every division by {name} is safe, 0/eps = 0 where it was 0" + coarse
        )
    if den.min >= 0:  # made by a call (f(t)): its dtype is the result's, not an argument's
        return (
            f"{name} = {text}\n"
            f"{name} = {name}.clamp_min(torch.finfo({name}.dtype).eps)   # clamped where it is "
            f"made: every division by {name} is safe, 0/eps = 0 where it was 0" + coarse
        )
    return (
        f"{name} = {text}\n"
        f"{name} = torch.where({name} == 0, torch.ones_like({name}), {name})   # every "
        f"division by {name} divides by 1 where it was 0 (any sign)"
    )


def _attribute_fixed_where_made(ev: OpEvent, attr: str) -> str | None:
    """The line above the user's, in the same function and at its indent or shallower (so
    it ran), that fills the attribute ``attr`` (``self.scale.copy_(v)``, ``.fill_(v)``,
    ``self.scale = v``), rewritten with ``v`` kept off 0; None when there is none."""
    import linecache

    path, _, num = (ev.source or "").rpartition(":")
    if not path or not num.isdigit():
        return None
    here = linecache.getline(path, int(num))
    indent = len(here) - len(here.lstrip())
    fill = re.compile(rf"^{re.escape(attr)}\.(copy_|fill_)\((.+)\)$")
    assign = re.compile(rf"^{re.escape(attr)}\s*=(?!=)(.+)$")
    for n in range(int(num) - 1, max(0, int(num) - 40), -1):
        text = linecache.getline(path, n)
        if not text.strip():
            continue
        deeper = len(text) - len(text.lstrip()) > indent
        if re.match(r"\s*(?:async\s+)?def\s", text) and not deeper:
            return None
        for stmt in statements(text):
            st = stmt.strip()
            m, a = fill.match(st), assign.match(st)
            if (m or a) and deeper:
                return None  # made under a branch the line may not share
            why = (
                f"clamped where it is made: every division by {attr} is safe (the next one "
                f"too), 0/eps = 0 where it was 0"
            )
            if m is not None:
                v = m.group(2).strip()
                return (
                    f"{attr}.{m.group(1)}({paren(v)}.clamp_min(torch.finfo({attr}.dtype).eps))"
                    f"   # {why}"
                )
            if a is not None:
                return f"{st}\n{attr} = {attr}.clamp_min(torch.finfo({attr}.dtype).eps)   # {why}"
    return None


@dataclass(frozen=True)
class _Learnable:
    """A divisor that is, or is made from, a learnable parameter of the module whose
    forward holds the division (LSQ's step size ``self.s``)."""

    divisor: str  #: the divisor as written on the line (``s_scale``, ``self.s``)
    attr: str  #: the parameter's attribute, as read (``self.s``)
    qual: str  #: its qualified name (``aq.s``)
    name: str | None  #: the local name the divisor is, when it is one (``s_scale``)


def _self_attrs(node: ast.expr) -> list[str]:
    """The ``self.<x>`` attributes an expression reads, in order of appearance."""
    found = [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
        and isinstance(n.ctx, ast.Load)
    ]
    return [n.attr for n in sorted(found, key=lambda n: (n.lineno, n.col_offset))]


def _declared_parameters(source: str | None) -> set[str]:
    """The attribute names the class whose method holds the line ``source`` makes
    ``nn.Parameter``s of (``self.s = nn.Parameter(...)``,
    ``self.register_parameter("s", ...)``), read from the user's file; empty when unknown."""
    parsed = _source_tree(source)
    if parsed is None:
        return set()
    tree, line = parsed
    owners = [
        c
        for c in ast.walk(tree)
        if isinstance(c, ast.ClassDef) and c.lineno <= line <= (c.end_lineno or c.lineno)
    ]
    if not owners:
        return set()
    cls = max(owners, key=lambda c: c.lineno)  # the innermost class holding the line
    out: set[str] = set()
    for n in ast.walk(cls):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call):
            f = n.value.func
            called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if called != "Parameter":
                continue
            for t in n.targets:
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "self"
                ):
                    out.add(t.attr)
        elif (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "register_parameter"
            and n.args
            and isinstance(n.args[0], ast.Constant)
            and isinstance(n.args[0].value, str)
        ):
            out.add(n.args[0].value)
    return out


def _recorded_parameter(ctx: RuleContext, qual: str) -> bool:
    """Whether the watcher recorded a parameter (its value or its gradient) named ``qual``."""
    for t in (ctx.trace, *ctx.history):
        for r in t.records:
            if r.phase in (Phase.PARAMETER, Phase.GRADIENT) and r.role == qual:
                return True
    return False


def _learnable_divisor(ctx: RuleContext, ev: OpEvent, path: str) -> _Learnable | None:
    """The divisor of the user's line when it is ``self.<p>``, or a name assigned above from
    an expression reading ``self.<p>``, where ``p`` is a parameter of the module ``path``
    whose forward holds the line (its records, or ``nn.Parameter`` in its class)."""
    picked = _picked_division(ev)
    if picked is None:
        return None
    stmt, div, _ = picked
    right = div.right
    name: str | None = None
    if isinstance(right, ast.Name):
        name = right.id
        value = _unconditional_assignment(ev, name)
        if value is None:
            return None
        attrs = _self_attrs(value)
    else:
        attrs = _self_attrs(right) if isinstance(right, ast.Attribute) else []
        if not (isinstance(right, ast.Attribute) and attrs == [right.attr]):
            return None
    if not attrs:
        return None
    declared: set[str] | None = None
    for attr in attrs:
        qual = f"{path}.{attr}" if path else attr
        if not _recorded_parameter(ctx, qual):
            if declared is None:
                declared = _declared_parameters(ev.source)
            if attr not in declared:
                continue
        d = ast.get_source_segment(stmt, right) or ast.unparse(right)
        return _Learnable(divisor=d, attr=f"self.{attr}", qual=qual, name=name)
    return None


def _learnable_fix(ev: OpEvent, lv: _Learnable) -> str:
    """A floor on a learnable divisor that keeps its gradient (a straight-through floor:
    the value is max(d, eps), the gradient that of d), and a floor where it is initialized."""
    eps = f"torch.finfo({lv.attr}.dtype).eps"
    init = (
        f"{lv.attr}.data.clamp_(min={eps})   # right after {lv.attr} is initialized (a "
        "data-dependent init of an all-zero batch gives 0): it starts above 0"
    )
    if lv.name is not None:
        value = _unconditional_assignment(ev, lv.name)
        made = f"{lv.name} = {ast.unparse(value)}\n" if value is not None else ""
        d = lv.name
        return (
            f"{made}{d} = {d} + ({d}.clamp_min(torch.finfo({d}.dtype).eps) - {d}).detach()"
            f"   # floored at eps in value, the gradient still reaches {lv.attr}\n{init}"
        )
    picked = _picked_division(ev)
    assert picked is not None
    stmt, div, _ = picked
    d = lv.divisor
    safe = f"({d} + ({d}.clamp_min({eps}) - {d}).detach())"
    return (
        f"{_spliced(stmt, div.right, safe, grouped=True)}   # floored at eps in value, the "
        f"gradient still reaches {lv.attr}\n{init}"
    )


def _dtype_carriers(node: ast.expr) -> list[ast.expr]:
    """The names whose dtype the value has: operands of arithmetic and the tensors a method
    chain starts from (``hi`` and ``lo`` in ``(hi.max() - lo) / 255``), not arguments of a
    call (``t`` in ``compute_snr(t)``, an integer timestep) nor indices, nor past a cast.
    An indexed name stays indexed (``stats[k]``): a dict or a list has no dtype."""
    if isinstance(node, ast.Name):
        return [] if node.id in _MODULES else [node]
    if isinstance(node, ast.BinOp):
        return _dtype_carriers(node.left) + _dtype_carriers(node.right)
    if isinstance(node, ast.UnaryOp):
        return _dtype_carriers(node.operand)
    if isinstance(node, ast.Subscript):
        root: ast.expr = node.value
        while isinstance(root, ast.Subscript):
            root = root.value
        return [node] if _dtype_carriers(root) else []
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr not in _CASTS
        and ast.unparse(node.func.value) not in _MODULES
    ):
        return _dtype_carriers(node.func.value)
    return []


_BINDS_F = re.compile(
    r"^[ \t]*(?:import[ \t]+(?:[\w.]+(?:[ \t]+as[ \t]+\w+)?[ \t]*,[ \t]*)*"
    r"torch\.nn\.functional[ \t]+as[ \t]+F"  # import torch, torch.nn.functional as F
    r"|from[ \t]+torch\.nn[ \t]+import[ \t]+(?:\([^)]*?|[^\n]*?)\bfunctional\s+as\s+F"
    r"|F[ \t]*=[ \t]*(?:torch\.)?nn\.functional[ \t]*$)\b",
    re.M,
)


def _binds_f(source: str | None) -> bool:
    """Whether the file of ``source`` (``file.py:42``) imports torch.nn.functional as
    ``F``, so a fix written with ``F.`` runs there as pasted; False when it cannot be read."""
    import linecache

    path = (source or "").rpartition(":")[0]
    return bool(path) and _BINDS_F.search("".join(linecache.getlines(path))) is not None


def _lacks_f(source: str | None) -> bool:
    """The file of ``source`` can be read and does not bind ``F`` (:func:`_binds_f`): a fix
    pasted there spells ``torch.nn.functional.`` out."""
    import linecache

    path = (source or "").rpartition(":")[0]
    return bool(path) and bool(linecache.getlines(path)) and not _binds_f(source)


def _own_float_fix(ev: OpEvent, den: TensorStat) -> str | None:
    """The user's line with its floating denominator kept off 0: ``F.normalize`` for a
    hand-written L2 normalization, ``.clamp_min(eps of its dtype)`` for a non-negative
    one, a where that divides by 1 at the zeros for a signed one."""
    picked = _picked_division(ev)
    if picked is None:
        z = _zero_divisions(ev) if _one_division(ev.code) is None else None
        return _guard_each(ev, z) if z is not None and len(z.divisions) > 1 else None
    stmt, div, _ = picked
    sinc = _sinc_fix(stmt, div)
    if sinc is not None:
        return sinc
    cosine = _cosine_fix(ev, stmt, div)
    if cosine is not None:
        return cosine
    floor = _eps_floor(ev.dtype)
    narrow = floor is not None and _stored_as_zero(_NORMALIZE_EPS, ev.dtype)
    num = input_named(ev, "self", "input")
    # x/0 = ±inf (or a numerator with no zero at all): the numerator is not 0 where the
    # denominator is, so clamp_min(eps) would give x/eps, huge, not 0
    live = "inf" in ev.born or (num is not None and num.zeros == 0 and not num.has_nan)
    norm = _normalize_fix(stmt, div, eps=floor if narrow else None)
    needs = "" if _binds_f(ev.source) else "\n# needs: import torch.nn.functional as F"
    if norm is not None and narrow:
        return (
            f"{norm}   # divides by max(norm, {floor}): a zero vector stays 0, not NaN "
            f"(the default eps 1e-12 is 0 in {ev.dtype}){needs}"
        )
    if norm is not None:
        return f"{norm}   # divides by max(norm, 1e-12): a zero vector stays 0, not NaN{needs}"
    spread = _std_eps(ev, stmt, div, den)
    if spread is not None:
        return spread
    rname = div.right.id if isinstance(div.right, ast.Name) else None
    root = _sqrt_eps(ev, rname) if rname is not None else None
    if root is not None:
        return (
            f"{root}   # eps inside the sqrt: a zero vector gets a small norm, and x / "
            f"{rname} is 0, not 0/0; a clamp after the sqrt would leave its backward 0/0"
        )
    at_source = _fixed_at_assignment(ev, div.right, den) if not live else None
    if at_source is not None:
        return at_source
    d = ast.get_source_segment(stmt, div.right)
    if d is None:
        return None
    if live and den.min >= 0:
        return _masked_division(stmt, div, d)
    counted = _counted_power(stmt, div.right)
    if den.min >= 0 and counted is not None:
        base, power = counted
        safe = f"{paren(base)}.clamp_min(1) ** {power}"
        why = (
            f"{base} is a count: floored at 1 before the power, a count of 0 divides by 1 "
            "(not 0/0, and no power's gradient at 0); elsewhere unchanged"
        )
    elif den.min >= 0:
        safe = f"{paren(d)}.clamp_min(torch.finfo({_dtype_of(div.right, d)}).eps)"
        why = "0/eps = 0 where the denominator is 0; elsewhere unchanged"
    else:
        safe = f"torch.where({d} == 0, torch.ones_like({d}), {d})"
        why = "divides by 1 where the denominator is 0 (any sign): leaves x as is"
    return f"{_spliced(stmt, div.right, safe, grouped=True)}   # {why}"


#: F.cosine_similarity's default eps, the floor of each norm
_COSINE_EPS = 1e-8


def _l2_along(node: ast.expr) -> tuple[str, str] | None:
    """(the tensor, the dim) of an L2 norm along one dim without keepdim: ``x.norm(dim=d)``,
    ``x.norm(p=2, dim=d)``, ``torch.norm(x, dim=d)``, ``torch.linalg.vector_norm(x, dim=d)``;
    None for anything else."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr == "norm" and not node.args:
        x = func.value
        if ast.unparse(x) in _MODULES:
            return None
    elif ast.unparse(func) in _NORM_FUNCS and len(node.args) == 1:
        x = node.args[0]
    else:
        return None
    kw = {k.arg: k.value for k in node.keywords}
    dim = kw.pop("dim", None)
    p = kw.pop("p", None) or kw.pop("ord", None)
    keep = kw.pop("keepdim", None)
    if keep is not None and not (isinstance(keep, ast.Constant) and keep.value is False):
        return None
    if dim is None or kw:
        return None
    if p is not None and not (isinstance(p, ast.Constant) and p.value in (2, 2.0)):
        return None
    return ast.unparse(x), ast.unparse(dim)


def _cosine_fix(ev: OpEvent, stmt: str, div: ast.BinOp) -> str | None:
    """``(a * b).sum(d) / (a.norm(dim=d) * b.norm(dim=d))``, a cosine similarity written by
    hand (``torch.sum(a * b, dim=d)`` too, any norm spelling :func:`_l2_along` reads), as
    ``F.cosine_similarity(a, b, dim=d)``: it floors each norm at eps, so a zero vector (a
    user or an item with no features, a padding row) gives 0, not 0/0; an eps the op's
    dtype holds where the default 1e-8 is 0 in it. None for any other division."""
    left = div.left
    if not isinstance(left, ast.Call) or not isinstance(left.func, ast.Attribute):
        return None
    if left.func.attr != "sum":
        return None
    owner = ast.unparse(left.func.value)
    if owner == "torch" and left.args:
        prod, given = left.args[0], [*left.args[1:]]
    elif owner not in _MODULES:
        prod, given = left.func.value, [*left.args]
    else:
        return None
    kw = {k.arg: k.value for k in left.keywords}
    if "dim" in kw:
        given.append(kw.pop("dim"))
    if kw or len(given) != 1:
        return None
    factors = _product(prod)
    norms = [_l2_along(f) for f in _product(div.right)]
    if len(factors) != 2 or len(norms) != 2 or None in norms:
        return None
    dim = ast.unparse(given[0])
    pairs = [n for n in norms if n is not None]
    if any(d != dim for _, d in pairs):
        return None
    if sorted(ast.unparse(f) for f in factors) != sorted(x for x, _ in pairs):
        return None
    a, b = (ast.get_source_segment(stmt, f) or ast.unparse(f) for f in factors)
    floor = _eps_floor(ev.dtype)
    lost = floor is not None and _stored_as_zero(_COSINE_EPS, ev.dtype)
    more = f", eps={floor}" if lost else ""
    why = f"the default eps 1e-8 is 0 in {ev.dtype}; {floor} is not" if lost else "eps 1e-8"
    needs = "" if _binds_f(ev.source) else "\n# needs: import torch.nn.functional as F"
    text = _spliced(stmt, div, f"F.cosine_similarity({a}, {b}, dim={dim}{more})")
    return (
        f"{text}   # the built-in cosine divides by each norm floored at eps ({why}): a "
        f"zero vector gives 0, not 0/0{needs}"
    )


#: how a user's line writes pi
_PI_NAMES = frozenset({"math.pi", "torch.pi", "np.pi", "numpy.pi", "pi"})


def _product(node: ast.expr) -> list[ast.expr]:
    """The factors of ``a * b * c``; ``[node]`` for anything else."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _product(node.left) + _product(node.right)
    return [node]


def _literal_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _sinc_fix(stmt: str, div: ast.BinOp) -> str | None:
    """``sin(u) / d`` where every factor of ``d`` is a factor of ``u`` (a sinc filter's
    ``torch.sin(2 * math.pi * f * t) / (math.pi * t)`` at ``t = 0``): the quotient tends to
    the rest of ``u``'s factors there, not to 0/0, and ``torch.sinc(x) = sin(pi x)/(pi x)``
    computes it, 1 at 0 with a finite gradient. A floor or a ``torch.where`` on ``d`` would
    put 0 at those points instead (the centre tap of the filter). None for any other line."""
    left = div.left
    if not isinstance(left, ast.Call) or not isinstance(left.func, ast.Attribute):
        return None
    if left.func.attr != "sin" or left.keywords:
        return None
    if ast.unparse(left.func.value) == "torch" and len(left.args) == 1:
        u = left.args[0]
    elif not left.args and ast.unparse(left.func.value) not in _MODULES:
        u = left.func.value  # u.sin()
    else:
        return None
    num = [ast.unparse(f) for f in _product(u)]
    den = [ast.unparse(f) for f in _product(div.right)]
    rest = list(num)
    for f in den:
        if f not in rest:
            return None
        rest.remove(f)
    if all(f in _PI_NAMES or _literal_number(f) for f in den):
        return None  # sin(u) / pi: no variable that is 0 on both sides
    pi = next((f for f in num if f in _PI_NAMES), None)
    if pi is not None:
        inner = list(num)
        inner.remove(pi)
        arg = " * ".join(paren(f) if len(inner) > 1 else f for f in inner)
    else:
        arg = f"{paren(ast.unparse(u))} / torch.pi"
    scale = " * ".join(paren(f) for f in rest)
    text = f"{scale} * torch.sinc({arg})" if scale else f"torch.sinc({arg})"
    return (
        f"{_spliced(stmt, div, text)}   # sin(u)/u is 1 at u = 0, not 0/0: torch.sinc(x) = "
        "sin(pi*x)/(pi*x) gives that limit and a finite gradient (a floor or a where on the "
        "denominator would put 0 there)"
    )


#: the eps InstanceNorm, LayerNorm and BatchNorm add to the variance inside the sqrt
_NORM_VAR_EPS = "1e-5"


def _std_eps(ev: OpEvent, stmt: str, div: ast.BinOp, den: TensorStat) -> str | None:
    """A denominator that is a standard deviation (``x.std(dims)``, ``torch.sqrt(x.var(dims))``,
    or a name the function assigned one, ``std = x.std(dims)``) with ``eps`` inside the
    sqrt, as the built-in norms do: a row that does not vary (a constant channel) has
    variance 0, and ``(x - mean) / sqrt(var + eps)`` is then about 0 with a gradient of at
    most 1/sqrt(eps). A clamp after the sqrt (``std.clamp_min(eps)``) divides the rounding
    left in ``x - mean`` by eps, and the gradient by eps too. The built-in norm is named
    when the dims say which (``(2, 3)``: ``F.instance_norm``, ``-1``: ``F.layer_norm``).
    None for any other denominator."""
    made = None
    text = ast.get_source_segment(stmt, div.right)
    if isinstance(div.right, ast.Name):
        made = _assigned_before(ev.source, div.right.id)
        text = made
    if not text or not text.isascii():
        return None
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None

    def variance(name: str) -> ast.Call | None:  # a name the function assigned a variance
        value = _assigned_before(ev.source, name)
        try:
            v = ast.parse(value.split("=", 1)[1].strip(), mode="eval").body if value else None
        except SyntaxError:
            return None
        return v if isinstance(v, ast.Call) else None

    found = [f for n in ast.walk(tree) if (f := _var_inside_sqrt(n, variance)) is not None]
    if len(found) != 1:
        return None
    node, replacement, x, dims = found[0]
    fixed = _spliced(text, node, replacement)
    if made is None:
        fixed = _spliced(stmt, div.right, fixed)
    eps = _NORM_VAR_EPS
    rows = f" ({den.zeros:,} of {den.numel:,} here)" if den.zeros else ""
    # over the batch dim (a tabular standardization): each statistic is a feature column's
    row = "a feature column" if dims in ("0", "(0,)", "[0]") else "a row"
    lines = [
        f"{fixed}   # eps inside the sqrt ({eps}, as the built-in norms): {row} that does not "
        f"vary{rows} has variance 0 and gives about 0, with a gradient of at most "
        "1/sqrt(eps); not .clamp_min(eps) after the sqrt: it divides by eps, and the "
        "gradient too"
    ]
    builtin = None
    if dims in ("(2, 3)", "[2, 3]", "(-2, -1)", "[-2, -1]"):
        builtin = f"F.instance_norm({x}, eps={eps})   # (N, C, H, W): each channel of each sample"
    elif dims in ("-1", "(-1,)", "[-1]"):
        builtin = f"F.layer_norm({x}, {paren(x)}.shape[-1:], eps={eps})   # over the last dim"
    if builtin is not None:
        needs = "" if _binds_f(ev.source) else "\n# needs: import torch.nn.functional as F"
        lines.append(f"# or the whole normalization built in: {builtin}{needs}")
    return "\n".join(lines)


def _var_inside_sqrt(
    n: ast.AST, variance: Callable[[str], ast.Call | None]
) -> tuple[ast.expr, str, str, str | None] | None:
    """For a standard deviation without an eps: the node, what replaces it (the square
    root of the variance plus eps), the tensor and the dims as written; None otherwise.
    ``x.std(d)`` and ``torch.std(x, d)`` keep their arguments (correction too); the sqrt
    of a name is one when ``variance`` finds the variance call assigned to it."""
    if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
        return None
    attr, owner = n.func.attr, ast.unparse(n.func.value)
    mod = owner in ("torch", "math", "np")
    eps = _NORM_VAR_EPS
    if attr == "std":
        x = n.args[0] if mod and n.args else None if mod else n.func.value
        if x is None:
            return None
        args = [ast.unparse(a) for a in n.args] + [ast.unparse(k) for k in n.keywords]
        given = ", ".join(args)
        var = f"torch.var({given})" if mod else f"{paren(ast.unparse(x))}.var({given})"
        return n, f"torch.sqrt({var} + {eps})", ast.unparse(x), _dims_of(n, 1 if mod else 0)
    if attr != "sqrt" or n.keywords:
        return None
    arg = n.args[0] if mod and len(n.args) == 1 else n.func.value if not n.args else None
    call = variance(arg.id) if isinstance(arg, ast.Name) else arg
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
        return None  # a sum with an eps: not a bare variance
    vmod = ast.unparse(call.func.value) == "torch"
    if call.func.attr != "var" or arg is None:
        return None
    x = call.args[0] if vmod and call.args else None if vmod else call.func.value
    if x is None:
        return None
    v = ast.unparse(arg)
    root = f"torch.sqrt({v} + {eps})" if mod else f"({v} + {eps}).sqrt()"
    return n, root, ast.unparse(x), _dims_of(call, 1 if vmod else 0)


def _dims_of(call: ast.Call, skip: int) -> str | None:
    """The ``dim`` argument of a reduction call as written (keyword, or the first positional
    after the tensor)."""
    for k in call.keywords:
        if k.arg == "dim":
            return ast.unparse(k.value)
    rest = call.args[skip:]
    return ast.unparse(rest[0]) if rest else None


def _counted_power(stmt: str, node: ast.expr) -> tuple[str, str] | None:
    """The base and exponent, as written, of a denominator that is a count to a positive
    power (``length ** alpha``, ``lengths.float() ** 0.6``); None for anything else."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow)):
        return None
    k = node.right
    if isinstance(k, ast.UnaryOp) and isinstance(k.op, ast.USub):
        return None  # a negative power is a division already
    if isinstance(k, ast.Constant) and not (isinstance(k.value, (int, float)) and k.value > 0):
        return None
    base = node.left
    while (
        isinstance(base, ast.Call)
        and isinstance(base.func, ast.Attribute)
        and base.func.attr in ("float", "double", "half", "to", "type")
    ):
        base = base.func.value  # lengths.float(): the count is lengths
    b = ast.get_source_segment(stmt, base)
    if b is None or not _count_base(b):
        return None
    whole = ast.get_source_segment(stmt, node.left)
    power = ast.get_source_segment(stmt, k)
    return (whole, power) if whole and power else None


_SCALAR_ARGS = ("tau", "temperature", "temp", "t", "scale", "divisor", "sigma", "std")


def _div_call_divisor(n: ast.AST) -> ast.expr | None:
    """The divisor of a division written as a call, when it is a name or attribute:
    ``x.div(keep_prob)`` / ``x.div_(d)`` / ``torch.div(x, d)`` (``true_divide``, ``divide``
    too); None for anything else."""
    if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
        return None
    if n.func.attr not in ("div", "div_", "true_divide", "true_divide_", "divide", "divide_"):
        return None
    mod = ast.unparse(n.func.value) == "torch"
    if n.keywords and any(k.arg not in ("rounding_mode",) for k in n.keywords):
        return None
    d = (
        n.args[1]
        if mod and len(n.args) == 2
        else n.args[0]
        if not mod and len(n.args) == 1
        else None
    )
    return d if isinstance(d, (ast.Name, ast.Attribute)) else None


def _underflowed_scale(ev: OpEvent, num: TensorStat | None) -> tuple[str, str, str] | None:
    """(evidence, explanation, fix) when the one-number divisor is a name made just above
    as ``expr / c`` from the values it divides (``scale = x.abs().amax() / 127``) and the
    numerator's largest magnitude over ``c`` is below half the dtype's smallest subnormal:
    the divisor underflowed to 0, it is not a 0 that means off."""
    lim = limits(ev.dtype)
    if lim is None or num is None or num.min is None or num.max is None:
        return None
    amax = max(abs(num.min), abs(num.max))
    if not (math.isfinite(amax) and amax > 0):
        return None
    divisors = _divisors(ev.code)
    if len(divisors) != 1 or not re.fullmatch(r"[A-Za-z_][\w.]*", d := divisors[0].strip()):
        return None
    made = _assigned_before(ev.source, d)
    if made is None:
        return None
    rhs_text = made.split("=", 1)[1].strip()
    try:
        rhs = ast.parse(rhs_text, mode="eval").body
    except SyntaxError:
        return None
    if not (
        isinstance(rhs, ast.BinOp)
        and isinstance(rhs.op, ast.Div)
        and isinstance(rhs.right, ast.Constant)
        and isinstance(rhs.right.value, (int, float))
        and rhs.right.value > 1
    ):
        return None
    c = float(rhs.right.value)
    here = {n.id for st in statements(ev.code) for n in _names_in(st)} - {d.split(".")[0]}
    if not here & {n.id for n in ast.walk(rhs.left) if isinstance(n, ast.Name)}:
        return None  # not made from the values this line divides
    if amax / c > lim.subnormal / 2:
        return None
    dt = lim.name
    c_text = ast.get_source_segment(rhs_text, rhs.right) or fmt(c)
    said = (
        f"the divisor {d} = {rhs_text} is 0 but the values it is made from are not: the "
        f"numerator's largest magnitude is {fmt(amax)}, and {fmt(amax)} / {c_text} = "
        f"{fmt(amax / c)} is below half of {dt}'s smallest subnormal "
        f"({fmt(lim.subnormal)}; torch.finfo({dt}).tiny = {fmt(lim.tiny)}): it rounded to 0"
    )
    why = (
        f"The divisor {d} underflowed: it is computed in {dt} as a maximum over {c_text}, "
        f"and for values as small as these that quotient is below the smallest number "
        f"{dt} can hold, so it is stored as 0. It is not a setting where 0 means off. "
        "Dividing by it makes ±inf, and 0/0 = NaN where the values are 0. Keep the divisor "
        f"at least torch.finfo({dt}).tiny, or compute it and the division in float32."
    )
    lhs = made.split("=", 1)[0].strip()
    fix = (
        f"{lhs} = {paren(rhs_text)}.clamp_min(torch.finfo(torch.{dt}).tiny)   # a "
        f"{d} that {dt} can hold: at least {fmt(lim.tiny)}\n"
        f"# or compute {d} and the division in float32 (cast the values with .float() "
        "first), then cast the result back"
    )
    return said, why, fix


def _names_in(stmt: str) -> list[ast.Name]:
    try:
        tree = ast.parse(stmt.strip())
    except SyntaxError:
        return []
    return [n for n in ast.walk(tree) if isinstance(n, ast.Name)]


def _one_zero(ev: OpEvent, den: TensorStat | None) -> bool:
    """The divisor is one number, and it is 0: a Python number (``other=0.0``) or a
    one-element tensor (torch wraps a Python number so in backward)."""
    if den is None:
        return scalar_num(ev, "other") == 0 and "other" not in dict(ev.inputs)
    return den.numel == 1 and den.min == 0 and den.max == 0


def _off_switch(code: str | None) -> tuple[str, str] | None:
    """The user's line divides by a Python name that also multiplies the result
    (``logits = torch.tanh(logits / self.softcap) * self.softcap``, ``x / c * c``): the
    name, and the line with the operation skipped where it is 0 (0 means "off"; a floor
    would leave the product 0 forever). None when the line has no such shape."""
    for stmt, tree in _parsed(code):
        found: list[tuple[ast.BinOp, str]] = []
        for mul in ast.walk(tree):
            if not (isinstance(mul, ast.BinOp) and isinstance(mul.op, ast.Mult)):
                continue
            for c, other in ((mul.left, mul.right), (mul.right, mul.left)):
                if not isinstance(c, (ast.Name, ast.Attribute)):
                    continue
                name = ast.unparse(c)
                found += [
                    (d, name)
                    for d in ast.walk(other)
                    if isinstance(d, ast.BinOp)
                    and isinstance(d.op, ast.Div)
                    and ast.unparse(d.right) == name
                ]
        if len({name for _, name in found}) != 1:
            continue
        div, name = found[0]
        if len({id(d) for d, _ in found}) != 1 or _times_scaled(tree, name) != 1:
            continue  # a KD loss's s / T, t / T ... * T * T: T is a temperature, not a switch
        num = ast.get_source_segment(stmt, div.left) or ast.unparse(div.left)
        body = tree.body[0] if len(tree.body) == 1 else None
        if (
            isinstance(body, ast.Assign)
            and len(body.targets) == 1
            and ast.unparse(body.targets[0]) == ast.unparse(div.left)
        ):  # the result replaces its input: skipping leaves the input as it was
            return name, f"if {name}: {stmt}"
        value = body.value if isinstance(body, (ast.Assign, ast.Return, ast.Expr)) else None
        if value is None:
            continue
        text = ast.get_source_segment(stmt, value) or ast.unparse(value)
        return name, _spliced(stmt, value, f"{text} if {name} else {paren(num)}")
    return None


def _times_scaled(tree: ast.AST, name: str) -> int:
    """How many times the statement multiplies by ``name`` (``T * T`` and ``T ** 2``: 2)."""
    n = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            n += sum(ast.unparse(side) == name for side in (node.left, node.right))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            n += 2 * (ast.unparse(node.left) == name)
    return n


@dataclass(frozen=True)
class _LimitCase:
    """A Python-number divisor ``c`` = 0 whose numerator is built from ``c`` too (``huber
    = torch.where(u.abs() <= kappa, ..., kappa * (...))`` above ``loss = w * huber /
    kappa``): 0/0, and c = 0 is the limit case of the formula, not a value to floor."""

    name: str  #: the divisor, ``kappa``
    made: str  #: the statement that builds the numerator's name from it
    where: str | None  #: ``file.py:N`` of that statement
    limit: str | None  #: the numerator divided by ``c`` at c -> 0 (``... * u.abs()``)
    fix: str


def _at_zero(node: ast.expr, name: str) -> ast.expr:
    """``node`` with ``name`` set to 0 and the terms that vanish folded away
    (``u.abs() - 0.5 * kappa`` -> ``u.abs()``)."""

    class _Zero(ast.NodeTransformer):
        def visit_Name(self, n: ast.Name) -> ast.AST:
            return ast.Constant(0) if n.id == name else n

        def visit_Attribute(self, n: ast.Attribute) -> ast.AST:
            return ast.Constant(0) if ast.unparse(n) == name else self.generic_visit(n)

        def visit_BinOp(self, n: ast.BinOp) -> ast.AST:
            self.generic_visit(n)
            zero_l = isinstance(n.left, ast.Constant) and n.left.value == 0
            zero_r = isinstance(n.right, ast.Constant) and n.right.value == 0
            if isinstance(n.op, ast.Mult) and (zero_l or zero_r):
                return ast.Constant(0)
            if isinstance(n.op, (ast.Add, ast.Sub)) and zero_r:
                return n.left
            if isinstance(n.op, ast.Add) and zero_l:
                return n.right
            if isinstance(n.op, ast.Sub) and zero_l:
                return ast.UnaryOp(ast.USub(), n.right)
            return n

    import copy

    out = ast.fix_missing_locations(_Zero().visit(copy.deepcopy(node)))
    return out if isinstance(out, ast.expr) else node


def _substituted(expr: str, name: str, value: str) -> str:
    """``expr`` with every plain ``name`` in it replaced by ``value`` (parenthesized)."""

    class _Sub(ast.NodeTransformer):
        def visit_Name(self, m: ast.Name) -> ast.AST:
            return ast.parse(paren(value), mode="eval").body if m.id == name else m

    return ast.unparse(_Sub().visit(ast.parse(expr, mode="eval")))


def _over_name(node: ast.expr, name: str) -> ast.expr | None:
    """``X`` for ``name * X`` / ``X * name`` (the value divided by ``name``); for a
    ``torch.where`` whose one branch is such a product (a Huber loss: ``kappa * (|u| - 0.5
    kappa)``), that branch's ``X``; None otherwise."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        for c, x in ((node.left, node.right), (node.right, node.left)):
            if ast.unparse(c) == name:
                return x
        return None
    if (
        isinstance(node, ast.Call)
        and ast.unparse(node.func) in ("torch.where", "where")
        and len(node.args) == 3
    ):
        got = [_over_name(b, name) for b in node.args[1:]]
        found = [x for x in got if x is not None]
        return found[0] if len(found) == 1 else None
    return None


def _uses(node: ast.AST, name: str) -> bool:
    """``node`` reads ``name`` (a plain name or ``self.x``)."""
    return any(
        isinstance(n, (ast.Name, ast.Attribute)) and ast.unparse(n) == name for n in ast.walk(node)
    )


def _limit_case(ev: OpEvent) -> _LimitCase | None:
    """The user's line divides by a Python name whose value is 0 and its numerator holds a
    name assigned above in the same function from that divisor (``huber = torch.where(u.abs()
    <= kappa, 0.5 * u.pow(2), kappa * (u.abs() - 0.5 * kappa))``, then ``... * huber /
    kappa``): the numerator vanishes with the divisor, so a floor divides 0 by the floor
    and the loss is 0 for good. The fix computes the limit where the divisor is 0 (``huber /
    kappa`` -> ``u.abs()``), else requires the divisor above 0. None for other lines."""
    for stmt, tree in _parsed(ev.code):
        divs = [
            d
            for d in ast.walk(tree)
            if isinstance(d, ast.BinOp)
            and isinstance(d.op, ast.Div)
            and isinstance(d.right, (ast.Name, ast.Attribute))
        ]
        if len({ast.unparse(d.right) for d in divs}) != 1:
            continue
        div, c = divs[0], ast.unparse(divs[0].right)
        if c in _MODULES:
            continue
        for n in ast.walk(div.left):
            if not isinstance(n, ast.Name) or n.id in _MODULES or n.id == c:
                continue
            text = _assigned_value(ev.source, n.id)
            try:
                value = ast.parse(text, mode="eval").body if text else None
            except SyntaxError:
                value = None
            if value is None or not _uses(value, c):
                continue
            made = f"{n.id} = {text}"
            num = ast.get_source_segment(stmt, div.left) or ast.unparse(div.left)
            over = _over_name(value, c)
            limit = None
            if over is not None:  # num / c -> num with n / c replaced by its limit
                at0 = ast.unparse(_at_zero(over, c))
                limit = _substituted(num, n.id, at0)
            whole = ast.get_source_segment(stmt, div) or ast.unparse(div)
            if limit is not None:
                guarded = _spliced(stmt, div, f"({whole} if {c} else {limit})")
                fix = (
                    f"{guarded}   # {c} = 0 is the limit case ({n.id} / {c} -> {paren(at0)}): "
                    f"computed, not divided; never floor {c} ({n.id} is 0 too: the loss "
                    "would be 0 for good)"
                )
            else:
                fix = (
                    f'assert {c} > 0, "{c} = 0 is a limit case of this formula: '
                    f'write it out, do not divide by 0"   # never floor {c}: {n.id} '
                    f"is 0 with it, the result would be 0 for good\n{stmt}"
                )
            return _LimitCase(c, made, _line_of(ev.source, made.split("=", 1)[0] + "="), limit, fix)
    return None


def _scalar_floor(code: str | None) -> str | None:
    """The user's line with ``max(d, 1e-3)`` around the Python-number divisor: a keyword
    argument that a call divides by (``F.gumbel_softmax(l, tau=self.tau)``), else the right
    operand of the line's one ``/`` (``z @ z.t() / temperature``); None when neither shows."""
    for stmt, tree in _parsed(code):
        kws = [
            k
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
            for k in n.keywords
            if k.arg in _SCALAR_ARGS and isinstance(k.value, (ast.Name, ast.Attribute))
        ]
        if len(kws) == 1:
            k = kws[0]
            text = ast.get_source_segment(stmt, k.value) or ast.unparse(k.value)
            return _spliced(stmt, k.value, f"max({text}, 1e-3)")
        divs = [d for n in ast.walk(tree) if (d := _div_call_divisor(n)) is not None]
        if len(divs) == 1 and "/" not in stmt:
            text = ast.get_source_segment(stmt, divs[0]) or ast.unparse(divs[0])
            return _spliced(stmt, divs[0], f"max({text}, 1e-3)")

    def floor(d: str) -> str:
        try:
            value = ast.literal_eval(d)
        except (ValueError, SyntaxError):
            return f"max({d}, 1e-3)"
        return d if isinstance(value, (int, float)) and value != 0 else f"max({d}, 1e-3)"

    own = _rewrite_divisor(code, floor)
    return None if own is None or own in statements(code) else own  # a literal divisor: not it


def _scaled_scalar(stmt: str | None) -> str | None:
    """The Python-number divisor (a name or attribute) that the statement also multiplies
    by: ``T`` in ``F.kl_div(F.log_softmax(s / T, 1), ..., reduction="batchmean") * T * T``;
    None when it parses to no such name."""
    for _, tree in _parsed(stmt):
        name = _scaled_scalar_in(tree)
        if name is not None:
            return name
    return None


def _scaled_scalar_in(tree: ast.AST) -> str | None:
    """:func:`_scaled_scalar` for one parsed statement."""
    divisors = {
        ast.unparse(d)
        for n in ast.walk(tree)
        if (
            d := n.right
            if isinstance(n, ast.BinOp)
            and isinstance(n.op, (ast.Div, ast.FloorDiv))
            and isinstance(n.right, (ast.Name, ast.Attribute))
            else _div_call_divisor(n)
        )
        is not None
    }
    factors = {
        ast.unparse(side)
        for n in ast.walk(tree)
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Mult, ast.Pow))
        for side in ((n.left, n.right) if isinstance(n.op, ast.Mult) else (n.left,))
        if isinstance(side, (ast.Name, ast.Attribute))
    }
    both = sorted(divisors & factors)
    return both[0] if len(both) == 1 else None


def _scaled_scalar_text(ev: OpEvent) -> str:
    """The sentence for a zero divisor that the user's statement also multiplies by."""
    name = _scaled_scalar(full_statement(ev.source) or ev.code)
    if name is None:
        return ""
    return (
        f" Here the statement also multiplies by {name} (the {name} * {name} scaling of "
        f"distillation): with {name} floored only in the divisions the product is 0, the "
        f"term silently off. {name} = 0 is a config error (a distillation temperature is "
        "1-4): set it above 0 where it is made."
    )


def _scaled_scalar_fix(ev: OpEvent) -> str | None:
    """A check at the source for a Python-number divisor of 0 that the user's statement
    also multiplies by (distillation's ``/ T`` ... ``* T * T``): a floor in the divisions
    would leave the product 0, the term silently off; None when the line shows no such
    name."""
    stmt = full_statement(ev.source) or ev.code
    name = _scaled_scalar(stmt)
    if name is None:
        return None
    made = _assigned_before(ev.source, name)
    where = _line_of(ev.source, made) if made is not None else None
    at = f" ({where.rsplit('/', 1)[-1]}: {made})" if made and where else ""
    return (
        f'assert {name} > 0, "{name} must be > 0 (a distillation temperature is 1-4)"   '
        f"# before the line: {name} is 0, a config error: set it where it is made{at}\n"
        f"# not max({name}, 1e-3) in the divisions: the line also multiplies by {name}, "
        "so the result would be 0 every step (the term silently off)"
    )


def _named_scalar_floor(stmt: str | None) -> str | None:
    """The user's whole statement (on several lines: ``full_statement``) with
    ``max(T, 1e-3)`` for each divisor that is the one name (or attribute) it divides by:
    ``F.kl_div(F.log_softmax(s / T, dim=1), F.log_softmax(t / T, dim=1), ...)``; None when
    it does not parse or divides by no name or by several."""
    if not stmt or not stmt.isascii():
        return None
    try:
        tree = ast.parse(stmt)
    except SyntaxError:
        return None
    divisors = [
        n.right
        for n in ast.walk(tree)
        if isinstance(n, ast.BinOp)
        and isinstance(n.op, ast.Div)
        and isinstance(n.right, (ast.Name, ast.Attribute))
    ]
    if len({ast.unparse(d) for d in divisors}) != 1 or any(d.lineno != 1 for d in divisors):
        return None
    name = ast.get_source_segment(stmt, divisors[0]) or ast.unparse(divisors[0])
    for d in sorted(divisors, key=lambda d: d.col_offset, reverse=True):
        stmt = _spliced(stmt, d, f"max({name}, 1e-3)")
    return stmt


_NORM_NODES = frozenset({"LinalgVectorNorm", "Norm", "LinalgNorm"})


#: the double-where norm, for a line that is not known (watch mode)
_NORM_TWICE_TEMPLATE = (
    "d2 = (v ** 2).sum(dim=-1)   # v: the vectors of the norm (was d = v.norm(dim=-1)): the "
    "squared norm, smooth at 0\n"
    "d = torch.where(d2 > 0, torch.where(d2 > 0, d2, 1).sqrt(), 0)   # the sqrt never sees 0: "
    "finite first and second derivatives; not .clamp_min(eps) on the norm: its own "
    "backward still runs at 0"
)


def _norm_divided_twice(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, den: TensorStat | None
) -> str | None:
    """The autograd node of a norm (``LinalgVectorNormBackward0``) whose backward a second
    backward differentiated at a norm of 0, told without the line (watch mode): a
    DivBackward0 of a graph built by ``torch.autograd.grad(create_graph=True)`` whose zero
    denominator has the size of the tensor the gradient went bad on, which a norm made (a
    distance a module's input). None otherwise."""
    if ev.phase is not Phase.BACKWARD or node_base(ev.node) != "Div":
        return None
    if den is None or not has_zero(den) or a.record.phase is not Phase.BACKWARD:
        return None
    if a.record.source is None:
        return None
    fwd = ctx.trace.record(a.record.source)
    if fwd is None or not fwd.grad_fn or node_base(fwd.grad_fn) not in _NORM_NODES:
        return None
    if math.prod(fwd.shape) != den.numel:
        return None
    return fwd.grad_fn if _second_backward(ctx, a) else None


def _second_backward(ctx: RuleContext, a: Anomaly) -> bool:
    """The bad gradient came after another backward pass of the step (the
    ``torch.autograd.grad(create_graph=True)`` of force matching, a gradient penalty)."""
    return a.record.phase is Phase.BACKWARD and any(
        r.phase is Phase.BACKWARD and r.by_grad != a.record.by_grad and r.index < a.record.index
        for r in ctx.trace.records
    )


def _norm_second_derivative(ev: OpEvent) -> str | None:
    """The user's line with its one L2 norm (``x.norm(dim=d)``, ``torch.linalg.vector_norm
    (x, dim=d)``, ``torch.norm(x, dim=d)``) computed as a double-where sqrt of the squared
    norm, whose first and second derivatives are finite at 0; None when the line is unknown
    or shows no such norm."""
    if not ev.source or ev.source == ev.backward_at:
        return None
    for stmt, tree in _parsed(ev.code):
        norms = []
        for n in ast.walk(tree):
            if not isinstance(n, ast.Call):
                continue
            func = ast.unparse(n.func)
            if isinstance(n.func, ast.Attribute) and n.func.attr == "norm" and not n.args:
                x = n.func.value
            elif func in _NORM_FUNCS and len(n.args) == 1:
                x = n.args[0]
            else:
                continue
            kw = {k.arg: k.value for k in n.keywords}
            p = kw.pop("p", None) or kw.pop("ord", None)
            if p is not None and not (isinstance(p, ast.Constant) and p.value in (2, 2.0)):
                continue
            if set(kw) - {"dim", "keepdim"}:
                continue
            norms.append((n, x, kw))
        if len(norms) != 1:
            continue
        call, x, kw = norms[0]
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        sq = fresh_name("d2", names)
        xs = ast.get_source_segment(stmt, x) or ast.unparse(x)
        args = ", ".join(
            f"{k}={ast.get_source_segment(stmt, v) or ast.unparse(v)}" for k, v in kw.items()
        )
        safe = f"torch.where({sq} > 0, torch.where({sq} > 0, {sq}, 1).sqrt(), 0)"
        return (
            f"{sq} = ({paren(xs)} ** 2).sum({args})   # the squared norm: smooth at 0\n"
            f"{_spliced(stmt, call, safe)}   # the sqrt never sees 0: finite first and "
            "second derivatives"
        )
    return None


_NEVER_NEGATIVE = frozenset(
    {"sqrt", "rsqrt", "abs", "exp", "exp2", "cosh", "square", "norm", "vector_norm", "std"}
    | {"var", "softplus", "sigmoid", "relu", "numel", "count_nonzero"}
)
_SAME_SIGN = frozenset(
    {"sum", "mean", "amax", "amin", "max", "min", "float", "double", "half", "to", "detach"}
    | {"unsqueeze", "squeeze", "view", "reshape", "expand", "expand_as", "flatten"}
)


def _never_negative(node: ast.expr) -> bool:
    """The expression cannot be negative whatever the data: ``a.sqrt()``, ``x.abs()``,
    ``torch.exp(s)``, ``x ** 2``, ``d.clamp_min(0)``, a sum or mean of such; a bare name or
    a difference may be either sign."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and node.value >= 0
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.Pow):
            p = node.right
            even = isinstance(p, ast.Constant) and isinstance(p.value, int) and p.value % 2 == 0
            return even or _never_negative(node.left)
        if isinstance(node.op, (ast.Add, ast.Mult, ast.Div)):
            return _never_negative(node.left) and _never_negative(node.right)
        return False
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else ast.unparse(func)
    module = isinstance(func, ast.Attribute) and ast.unparse(func.value) in (
        *_MODULES,
        "torch.linalg",
    )
    tensors = node.args if module else [func.value] if isinstance(func, ast.Attribute) else []
    if name in _NEVER_NEGATIVE:
        return True
    if name in ("clamp_min", "clamp", "clip"):
        low = [k.value for k in node.keywords if k.arg == "min"] + node.args[int(module) :][:1]
        return bool(low) and _never_negative(low[0])
    if name in ("max", "min", "maximum", "minimum") and tensors:  # every operand counts
        return all(_never_negative(t) for t in [*tensors, *node.args])
    if name in _SAME_SIGN and tensors:
        return _never_negative(tensors[0])
    return False


def _masked_division(stmt: str, div: ast.BinOp, d: str) -> str:
    """``torch.where(d > 0, n / d.clamp_min(eps), fallback)`` in the user's line: a nonzero
    numerator over a zero denominator is x/eps (huge) after a clamp, so the quotient is
    not used there; the fallback is the tensor ``copy_`` writes into (its old value) when
    the line shows one, else 0."""
    n = ast.get_source_segment(stmt, div.left) or ast.unparse(div.left)
    fallback, why = "0", "0 where the denominator is 0: pick what such a row should hold"
    tree = ast.parse(stmt)
    for call in ast.walk(tree):
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "copy_"
            and len(call.args) == 1
            and call.args[0].col_offset <= div.col_offset
            and (call.args[0].end_col_offset or 0) >= (div.end_col_offset or 0)
        ):
            fallback = ast.get_source_segment(stmt, call.func.value) or ast.unparse(call.func.value)
            why = f"{fallback} keeps its old value where the denominator is 0"
    n = paren(n)  # (a - b) / d: the numerator keeps its parentheses
    if _never_negative(div.right):
        eps = f"torch.finfo({_dtype_of(div.right, d)}).eps"
        safe = f"torch.where({paren(d)} > 0, {n} / {paren(d)}.clamp_min({eps}), {fallback})"
        tail = "x/eps would be huge, the numerator is not 0 there"
    else:  # a sign the line does not fix (a target, a difference): keep the negative rows
        kept = f"torch.where({paren(d)} != 0, {d}, 1)"
        safe = f"torch.where({paren(d)} != 0, {n} / {kept}, {fallback})"
        tail = "rows of either sign are kept; the unused branch divides by 1, so no NaN gradient"
    return f"{_spliced(stmt, div, safe, grouped=False)}   # {why}; {tail}"


def _named_count_fix(ev: OpEvent, den: TensorStat | None) -> tuple[str, str] | None:
    """Evidence and fix for a division whose line is not known but whose denominator and
    quotient the user's code holds under local names (``cls_loss = s / num_pos``, read at
    backward()): a single whole number from 0 with no autograd history (a count made from
    the data: ``mask.sum().float()``) is floored at 1 under its own name. None otherwise."""
    name = ev.scalars.get("other_local")
    if not isinstance(name, str) or den is None or den.numel != 1:
        return None
    if not (den.min == 0 and math.isfinite(den.max) and float(den.max).is_integer()):
        return None
    made = _assigned_before(ev.backward_at, name)
    for _ in range(3):  # num_pos = num_pos.float(): look further up for what made it
        if made is None or _COUNT_CODE.search(made.split("=", 1)[1]):
            break
        if not re.match(rf"\s*{re.escape(name)}\b", made.split("=", 1)[1]):
            break
        src = _line_of(ev.backward_at, made)
        made = _assigned_before(src, name) if src else None
    rhs = made.split("=", 1)[1] if made is not None else ""
    if not _COUNT_CODE.search(rhs) or re.search(r"sqrt|norm|std|var|mean|\*\*", rhs):
        return None  # not shown to be a count: a norm or a std of 0 wants eps, not 1
    out = ev.scalars.get("result_local")
    into = f"{out} = ... / {name}" if isinstance(out, str) else f"... / {name}"
    said = (
        f"the division is {into} (local names of the code that called backward()); "
        f"{name} is 0, a count made from the data: {made.strip() if made else name}"
    )
    fix = (
        f"{name} = {name}.clamp_min(1)   # before {into}: a count of 0 divides by 1, "
        "an empty selection gives 0, not inf or NaN\n"
        f"# or skip the batch when it is 0: if {name} == 0: continue"
    )
    return said, fix


def _div_fix(
    ev: OpEvent,
    *,
    scalar: bool,
    count: bool,
    floating: bool = False,
    den: TensorStat | None = None,
) -> str:
    """A Python-number denominator gets a floor; an integer count is at least 1 (finfo
    has no integer dtypes); a float one is kept off 0 by its dtype's eps, on the user's
    own line when it is known; an unknown one gets both."""
    if scalar:  # a temperature annealed to 0, a count: no tensor to clamp
        scaled = _scaled_scalar_fix(ev)
        if scaled is not None:
            return scaled
        own_scalar = _scalar_floor(ev.code) or _named_scalar_floor(full_statement(ev.source))
        if own_scalar is not None:
            return (
                f"{own_scalar}   # a Python number annealed to 0: a floor keeps it above 0 "
                "(or end the schedule above 0)"
            )
        return (
            "d = max(d, 1e-3)   # d: the Python number divided by; annealed to 0: a floor\n"
            "y = x / d\n"
            "# set to 0 in a config (a distillation temperature is 1-4): that is the error, "
            "set it > 0 where it is made; a floor is no fix when the result is also "
            "multiplied by d (distillation's * T * T): it would be 0"
        )
    own = _rewrite_divisor(ev.code, lambda d: f"{d}.clamp_min(1)") if count else None
    if own is not None:
        return f"{own}   # a count of 0 divides by 1: nothing to average gives 0, not NaN"
    if count:
        return (
            "y = x / d.clamp_min(1)   # an integer count (lengths, mask.sum()): at least 1\n"
            "y = x / torch.where(d == 0, torch.ones_like(d), d)   # or leave x as is"
        )
    own_float = _own_float_fix(ev, den) if floating and den is not None else None
    if own_float is not None:
        return own_float
    if floating:
        return (
            "eps = torch.finfo(d.dtype).eps\n"
            "y = x / d.clamp_min(eps)            # non-negative denominators (std, range, "
            "norm)\n"
            "y = x / torch.where(d == 0, torch.ones_like(d), d)   # any sign: leave x as is"
        )
    return (
        "y = x / d.clamp_min(torch.finfo(d.dtype).eps)   # a float denominator (std, range, "
        "norm)\n"
        "y = x / d.clamp_min(1)                          # an integer count (lengths, "
        "mask.sum())\n"
        "y = x / torch.where(d == 0, torch.ones_like(d), d)   # any sign: leave x as is"
    )


_DIST_CALL = re.compile(
    r"\.(?:log_prob|entropy|cdf|icdf|rsample|perplexity)\(|\bdistributions\.|\bkl_divergence\("
)


def _in_distribution(ev: OpEvent) -> bool:
    """The op ran inside torch.distributions: its source is there, or the user's line calls
    a distribution's method (``dist.log_prob(a)``)."""
    src = (ev.source or "").replace("\\", "/")
    if "torch/distributions/" in src:
        return True
    code = (ev.code or "").split("  #", 1)[0]
    return _DIST_CALL.search(code) is not None


def _scale_text(dtype: str) -> str:
    lim = limits(dtype)
    small = f" (below {fmt(math.sqrt(lim.subnormal / 2))} in {dtype})" if lim is not None else ""
    return (
        "The distribution's scale is exactly 0, or so small that its square rounds to 0"
        f"{small}: log_prob divides by scale² and takes log(scale). A scale computed as "
        "exp(log_sigma) or softplus(raw) underflows to 0 once the network's raw output "
        "drifts very negative (exp(-104) is 0 in float32). Validation (validate_args) "
        "rejects a scale of 0 with a ValueError; without it, log_prob is ±inf or NaN."
    )


_SCALE_FIX = (
    "std = F.softplus(raw) + 1e-5        # a scale that can never reach 0\n"
    "std = log_std.clamp(-20, 2).exp()   # or bound the log-scale before exp\n"
    "dist = torch.distributions.Normal(mu, std)"
)

_SPECTRAL = {
    "LinalgSvd": ("svd", "singular values", "torch.linalg.svdvals"),
    "Svd": ("svd", "singular values", "torch.linalg.svdvals"),
    "LinalgEigh": ("eigh", "eigenvalues", "torch.linalg.eigvalsh"),
    "LinalgEig": ("eig", "eigenvalues", "torch.linalg.eigvals"),
}


def _spectral_backward(
    ctx: RuleContext,
    a: Anomaly,
    ev: OpEvent,
    spectral: tuple[str, str, str],
    trigger: OpEvent,
) -> Diagnosis:
    """The backward of svd/eigh divides by the differences of the singular values or
    eigenvalues: 0 where two are equal, and the vectors' gradient has no value there."""
    fn, values, vals_only = spectral
    den = denominator(ev)
    evidence = [
        f"in backward, {ev.node} divides by the differences of the {values} of the "
        f"forward {fn}: {describe_stat(den)}",
    ]
    num = input_named(ev, "self", "input")
    if num is not None:
        evidence.append(f"numerator: {describe_stat(num)}")
    evidence.append(f"{short_op(ev.op)} made {ev.born} in {ev.dtype}")
    evidence += _chain_evidence(ev, trigger, ev.born)
    got: list[str] = []

    def keep(e: str) -> str:
        got.append(e)
        return e

    rewrite_call(ev.code, [fn], keep)
    m = paren(got[0]) if got else "A"
    outs = "evals, evecs" if fn == "eigh" else ("evals, evecs" if fn == "eig" else "U, S, Vh")
    if fn == "eigh":  # a symmetric jitter: distinct diagonal steps
        head = (
            f"jitter = torch.diag(torch.linspace(0, 1, {m}.shape[-1], dtype={m}.dtype, "
            f"device={m}.device))\n"
        )
        noise = "1e-4 * jitter"
    else:
        head = ""
        noise = f"1e-4 * torch.randn_like({m})"
    call = rewrite_call(ev.code, [fn], lambda e: f"{paren(e)} + {noise}")
    fix = (
        head
        + (call or f"{outs} = torch.linalg.{fn}({m} + {noise})")
        + f"   # distinct {values} (scale 1e-4 to the matrix)\n"
        + f"# only the {values} needed: {vals_only}({m}), whose backward is defined\n"
        + "# and initialize the weights that make the matrix randomly, not to 0 or a constant"
    )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title=f"Backward of {fn} at repeated {values}",
        evidence=evidence,
        explanation=(
            f"The forward {fn} is fine, but its backward divides by the differences between "
            f"{values} (1 / (s_j² - s_i²) for svd, 1 / (λ_j - λ_i) for eigh): where two of "
            f"them are equal, the {'singular vectors' if fn == 'svd' else 'eigenvectors'} are "
            "not unique and their gradient is 0/0 = NaN or inf. A multiple of the identity, "
            "a rank-deficient matrix, or weights zeroed or filled with a constant make "
            f"{values} repeat."
        ),
        fix=fix,
    )


# ---------------------------------------------------------------------- NW112

_ROOT_NODES = frozenset({"Sqrt", "Rsqrt", "Pow", "Cdist", "Norm", "LinalgVectorNorm"})


@rule(
    "NW112",
    title="sqrt or fractional power at zero or below",
    severity="error",
    summary=(
        "sqrt/pow(x, p<1) of a negative number is NaN; at exactly 0 the forward is finite "
        "but the gradient 1/(2·sqrt(0)) is inf (NaN after × 0): the backward-only NaN."
    ),
    priority=12,
)
def root_at_zero(ctx: RuleContext) -> Iterator[Diagnosis]:
    a = ctx.anomaly
    if a is None or a.transient:
        return
    cause = cause_of(a)
    if cause is not None:
        if cause.kind == "root" and not forward_nan_hidden(ctx, a):  # hidden: NW407's
            yield _root_from_op(ctx, a, cause.event, cause.trigger)
        return
    if a.kind is AnomalyKind.BACKWARD:
        yield from _root_backward_untraced(ctx, a)


def _pow_with_tensor_exponent(code: str | None) -> tuple[str, ast.BinOp] | None:
    """The statement of the user's line and its one ``base ** exponent`` whose exponent is
    not a number (``(t / lam) ** k``); None when the line shows none, or several."""
    for stmt in statements(code):
        try:
            tree = ast.parse(stmt.strip())
        except SyntaxError:
            continue
        pows = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.BinOp)
            and isinstance(n.op, ast.Pow)
            and not isinstance(n.right, ast.Constant)
            and not (isinstance(n.right, ast.UnaryOp) and isinstance(n.right.operand, ast.Constant))
        ]
        if len(pows) == 1:
            return stmt.strip(), pows[0]
    return None


def _log_text(ev: OpEvent, node: ast.expr, text: str) -> str:
    """``torch.log(text)`` in the user's words; the exponent itself for a name made by
    ``torch.exp(y)`` just above (``lam = torch.exp(log_lam)``: log(lam) is ``log_lam``,
    finite where ``lam`` overflowed or underflowed)."""
    if isinstance(node, ast.Name) and (made := _assigned_before(ev.source, node.id)) is not None:
        inner = _exp_operand(made.split("=", 1)[1])
        if inner is not None:
            return paren(inner)
    return f"torch.log({text})"


def _exponent_grad(ev: OpEvent) -> tuple[str, str, str] | None:
    """(evidence, explanation, fix) when the backward op is the log(base) of a power's
    exponent gradient (PowBackward1 / PowBackward2: d/dk b ** k = b ** k · log(b)) and the
    base held exact zeros: 0 · log(0) = 0 · -inf = NaN, whatever the exponent."""
    if node_base(ev.node) != "Pow" or (ev.node or "") == "PowBackward0":
        return None
    if not short_op(ev.op).rstrip("_").endswith("log"):
        return None
    x = first_input(ev)
    if x is None or not has_zero(x):
        return None
    dtype = ev.dtype or "float32"
    evidence = (
        f"in backward, {ev.node} ({short_op(ev.op)}) made {ev.born}: it computes the gradient "
        f"of a power's tensor exponent, d/dk (b ** k) = b ** k · log(b), and the base b held "
        f"{_zeros_text(x, 'log')}: 0 · log(0) = 0 · -inf = NaN"
    )
    explanation = (
        "The power's exponent requires grad, and d/dk (b ** k) = b ** k · log(b). Where the "
        "base b is exactly 0 (a ratio that underflowed: a scale that grew huge or overflowed "
        f"to inf in {dtype}) that is 0 · -inf = NaN, although the forward value 0 ** k = 0 is "
        "fine. This is not a root of a negative number: compute the power in log space, "
        "exp(k · log b), from logs that are finite (the log the model already predicts), or "
        "keep the base above 0."
    )
    fix = (
        "z = torch.exp(k * (torch.log(t) - log_lam))   # b ** k in log space, from the "
        "predicted log-scale: its exponent gradient is finite\n"
        "z = b.clamp_min(torch.finfo(b.dtype).tiny) ** k   # or keep the base above 0"
    )
    at = _pow_with_tensor_exponent(ev.code)
    if at is not None:
        stmt, pw = at
        b = ast.get_source_segment(stmt, pw.left) or ast.unparse(pw.left)
        k = ast.get_source_segment(stmt, pw.right) or ast.unparse(pw.right)
        base = pw.left
        if isinstance(base, ast.BinOp) and isinstance(base.op, ast.Div):
            num = ast.get_source_segment(stmt, base.left) or ast.unparse(base.left)
            den = ast.get_source_segment(stmt, base.right) or ast.unparse(base.right)
            logs = f"{_log_text(ev, base.left, num)} - {_log_text(ev, base.right, den)}"
        else:
            logs = _log_text(ev, base, b)
        logged = f"torch.exp({paren(k)} * ({logs}))"
        floored = f"{paren(b)}.clamp_min(torch.finfo({_dtype_of(base, b)}).tiny) ** {paren(k)}"
        fix = (
            f"{_spliced(stmt, pw, logged)}   # {paren(b)} ** {paren(k)} in log space: its "
            f"gradient in {k} is finite where {b} is 0\n"
            f"# or keep the base above 0: {_spliced(stmt, pw, floored)}"
        )
    return evidence, explanation, fix


def _root_from_op(ctx: RuleContext, a: Anomaly, ev: OpEvent, trigger: OpEvent) -> Diagnosis:
    x = first_input(ev)
    op = short_op(ev.op)
    e = ev.scalars.get("exponent")
    evidence: list[str] = []
    backward = ev.phase is Phase.BACKWARD
    own = scalar_base(ev) is None  # x is the base, not a tensor exponent
    pole = not backward and own and _pole_at_zero(ev, x, e)
    cancel = None
    power = _forward_exponent(ev, e) if backward and node_base(ev.node) == "Pow" else None
    exp_grad = _exponent_grad(ev) if backward else None
    if exp_grad is not None:
        evidence.append(exp_grad[0])
        for nm, saved in ev.other_inputs:
            if nm.startswith(_SAVED):
                evidence.append(f"forward pow {nm[len(_SAVED) :]}: {describe_stat(saved)}")
    elif backward:
        node = node_base(ev.node)
        slope = (
            f"d/dx x^({fmt(power)}) = {fmt(power)}·x^({fmt(power - 1)})"
            if power is not None
            else "d/dx sqrt(x) = 1 / (2·sqrt(x))"
        )
        if power is not None and _negative_base(x, power):
            assert x is not None
            zeros = f", {x.zeros} exact zeros" if x.zeros is not None else ""
            evidence.append(
                f"in backward, {ev.node} ({op}) made {ev.born}: the forward power's base holds "
                f"negative numbers (min {fmt(x.min)}{zeros}), and a negative number to a "
                f"fractional power is NaN, and so is the derivative there ({slope})"
                + (
                    "; at 0 that derivative is 0, finite: exact zeros are not the cause"
                    if power > 1
                    else ""
                )
            )
        elif x is None:  # named by its node alone: what it saved was freed unread
            evidence.append(
                f"in backward, {ev.node} ({op}) made {ev.born} from a finite gradient: its "
                f"derivative is infinite where the forward {node.lower()}'s base is exactly 0 "
                f"({slope}), and NaN below 0 (autograd freed its saved values before they "
                "were read)"
            )
        else:
            evidence.append(
                f"in backward, {ev.node} ({op}) made {ev.born}: the forward {node.lower()} was "
                f"given exact zeros, and its derivative there is infinite ({slope})"
            )
            if (res := dict(ev.other_inputs).get(_SAVED + "result")) is not None:
                # the zeros themselves, not only the gradient that met them
                evidence.append(f"forward {node.lower()} result: {describe_stat(res)}")
        for nm, s in ev.inputs[:2]:
            evidence.append(f"backward input {nm}: {describe_stat(s)}")
    elif (number := scalar_base(ev)) is not None:  # number ** tensor: x is the exponent
        evidence.append(
            f"{op} raised {fmt(number)} to the powers of its input: "
            + (
                "a negative number to a fractional power is NaN"
                if number < 0
                else "0 to a negative power is inf"
            )
        )
        evidence.append(f"input exponent ({ev.dtype}): {describe_stat(x)}")
    else:
        what = f"{op} with exponent {e}" if e is not None else op
        if x is not None and x.min < 0:
            cancel = None if _rounding_negative(x, ev.dtype) else _cancellation(ctx, ev, x)
            evidence.append(
                f"{what} of negative numbers is NaN: its input's minimum is {fmt(x.min)}"
                + (
                    ""
                    if _rounding_negative(x, ev.dtype)
                    else f", {cancel.words}"
                    if cancel is not None
                    else ", far below 0: not rounding"
                )
            )
        elif pole and x is not None:
            evidence.append(
                f"{what} of 0 is inf ({_pole_formula(ev, e)}): its input holds "
                f"{_zeros_text(x, 'pow')} and nothing below 0"
            )
            zf = _pole_zero_factor(ev)
            if zf is not None:
                evidence.append(zf.words)
        elif x is not None and has_zero(x):
            evidence.append(f"{what} at 0 is inf (a negative exponent or rsqrt)")
        evidence.append(f"input ({ev.dtype}): {describe_stat(x)}")
    evidence += _chain_evidence(ev, trigger, ev.born)
    # a sqrt of values negative in their own right (predictions), not by rounding
    # (a sqrt, or a negative fractional power: mu ** -0.5 of a raw rate in a Tweedie loss,
    # whose signed power would be inf at 0; a positive one keeps the signed-power fix)
    fractional = e is None or (
        isinstance(e, (int, float))
        and not isinstance(e, bool)
        and e < 0
        and not float(e).is_integer()
    )
    negative = own and fractional and x is not None and x.min < 0
    negative = negative and x is not None and not _rounding_negative(x, ev.dtype)
    if exp_grad is not None:
        _, explanation, fix = exp_grad
    elif cancel is not None:
        explanation, fix = _cancel_text(cancel, ev.dtype), _cancel_fix(ev)
    elif pole and x is not None and (lk := _table_lookup(ev, _pole_operand(ev))) is not None:
        return _table_zero(  # rsqrt(alpha_bar[t]) of a schedule that reaches 0
            ctx,
            a,
            ev,
            x,
            lk,
            evidence=evidence,
            title=ctx.rule.title if ctx.rule is not None else "Root at zero",
            operand="the input of the root",
            effect=f"{_pole_formula(ev, e)} is inf",
        )
    elif pole:
        explanation, fix = _pole_text(ev, e), _pole_fix(ev, e)
        if (zf := _pole_zero_factor(ev)) is not None:
            explanation = (
                f"x ** {e} = 1 / x ** {fmt(-float(e)) if isinstance(e, (int, float)) else '-e'}"
                " is inf at x = 0. The base is not a count but a probability times a number "
                "(an importance-sampling weight (N·P) ** -beta of prioritized replay), and the "
                "probability is 0 because the values it normalizes are 0: priorities of "
                "exactly 0 (a buffer filled with zeros instead of the max priority, or |td| "
                "without + eps). One weight of inf makes the max inf too, so the usual "
                "normalization w / w.max() is inf / inf = NaN. Keep every priority above 0 "
                "where it is made; a floor on N·P would change the weights of a healthy "
                "buffer, where N·P < 1 is common."
            )
    elif backward and power is not None and _negative_base(x, power):
        explanation, fix = _negative_power_backward(ev, power)
    elif backward and power is not None:
        explanation, fix = _power_backward_text(power), _power_backward_fix(ev, power)
    elif backward:
        explanation, fix = _ROOT_BACKWARD, _root_backward_fix(node_base(ev.node), e, ev.dtype)
        mine = _root_backward_own(ev) if node_base(ev.node) in ("Sqrt", "Rsqrt") else None
        if mine is not None:
            explanation, fix = mine
    elif negative and (data := _data_base(ctx, ev, x)) is not None:
        evidence.insert(
            1,
            f"the base is {data.path}'s {data.role}, data with no autograd history (min "
            f"{fmt(x.min if x is not None else None)}): not a network output",
        )
        explanation, fix = _ROOT_DATA, _data_root_fix(ev, e)
    elif negative and (built := _built_from_data(ctx, ev)) is not None:
        name, made, inputs = built
        evidence.insert(
            1,
            f"the base {name} is computed from {inputs} with no autograd history ({made}; "
            f"min {fmt(x.min if x is not None else None)}): data, not a network output",
        )
        explanation, fix = _ROOT_DATA_BUILT, _data_root_fix(ev, e)
    elif negative and (flow := _no_history(ev)):
        read = _constant_read(ev)
        evidence.insert(
            1,
            f"the base has no autograd history (made by {' <- '.join(flow)}; it does not "
            "require grad): a constant or data your code built, not a network output"
            + (f"; {read[0]} reads {read[1]}" if read is not None else ""),
        )
        explanation, fix = _ROOT_CONSTANT, _constant_root_fix(ev, read)
    elif negative and (squares := _root_weighted_squares(ev)) is not None:
        name, made, square, weights = squares
        said = ", ".join(weights)
        evidence.insert(
            1,
            f"{name} = {made}: a weighted sum of squares ({square}), >= 0 for any input "
            f"while its weights ({said}) are >= 0: negative only where they went negative",
        )
        explanation = (
            "sqrt(x) is not a real number for negative x: PyTorch returns NaN. The argument "
            f"is a weighted sum of squares ({made}), never negative while its weights "
            f"({said}) are not: a parameter that an update pushed below 0 makes it negative. "
            "A clamp at 0 keeps every healthy value unchanged (softplus would change them "
            "all); the cause is the weights, which need a non-negativity constraint (a "
            "reparametrization, as GDN's NonNegativeParametrizer, or a clamp after each "
            "optimizer step)."
        )
        fix = (
            _computed_root_fix(ev).split("\n", 1)[0]
            + f"\n{name} = {_floored_weights(made, weights)}   # where {name} is made: "
            "non-negative weights, every healthy value unchanged (or a non-negative "
            "reparametrization of them)"
        )
    elif negative and not _raw_output(ev):
        explanation, fix = _ROOT_COMPUTED, _computed_root_fix(ev)
    elif negative:
        explanation, fix = _ROOT_NEGATIVE, _negative_root_fix(ev)
    elif not backward and own and x is None and (par := _root_of_param(ctx, a, ev, e)):
        said, explanation, fix = par
        evidence.insert(0, said)
        evidence = [w for w in evidence if w != f"input ({ev.dtype}): not measured"]
    else:
        explanation = _root_forward_text(e)
        fix = _root_forward_fix(
            e, measured=x is not None and own, code=ev.code if own else None, dtype=ev.dtype
        )
    lost = (
        lost_eps(ev.code, ev.dtype, "root", zeros=not backward and has_zero(x))
        if own and cancel is None and not negative
        else None
    )
    if lost is not None and pole and lost.value is None:
        lost = None  # the pole's own fix says what to do with an eps attribute of 0
    if lost is not None:  # the line keeps the root's input off 0 with an eps that is 0 here
        evidence.insert(1, lost.words("the input of the root"))
        explanation = (
            f"The eps added on this line is meant to keep the root's input off 0 (where "
            f"sqrt's gradient 1/(2·sqrt(x)) is inf), but {ev.dtype} cannot hold it: a number "
            f"below half of {ev.dtype}'s smallest subnormal is stored as 0, so 0 + eps is "
            "still 0. Use an eps the dtype can hold, or compute this line in a wider dtype."
        )
        fix = lost.fix()
    if backward and a.kind is AnomalyKind.FORWARD:
        explanation = _derivative_in_forward(explanation, ev)
    return ctx.diagnosis(**op_fields(ev, a), evidence=evidence, explanation=explanation, fix=fix)


#: the clause of a root's backward-only explanation that holds only when the step's own
#: backward() ran the derivative
_NEVER_SHOWN = re.compile(r"[;.] the forward pass never shows a bad value,", re.IGNORECASE)


def _derivative_in_forward(explanation: str, ev: OpEvent) -> str:
    """``explanation`` for a root's derivative that a differentiation inside the forward
    ran (a backward op whose bad value the forward's statistics saw first:
    ``torch.autograd.grad(..., create_graph=True)``, a PINN's du/dx, a gradient penalty).
    What that backward op returns is a forward value, so the forward does show it."""
    at = f" at {ev.backward_at}" if ev.backward_at else ""
    said = (
        f"Here torch.autograd.grad(create_graph=True){at} ran this derivative inside the "
        "forward, so its inf or NaN is a forward value: the forward's output holds it"
    )
    if _NEVER_SHOWN.search(explanation):
        return _NEVER_SHOWN.sub(lambda _: f". {said},", explanation, count=1)
    return f"{explanation} {said}."


_RSQRT = frozenset({"rsqrt", "rsqrt_"})


_LAYER_PARAM = re.compile(r"(?:^|[._])(?:weight|bias)(?:_[a-z]+|_\w*\d\w*)?$")


def _positive_param_fix(
    qual: str,
    ref: str,
    stmt: str,
    numel: int,
    *,
    finite: Callable[[str], str],
    eps: str = "",
) -> str:
    """The fix for a parameter trained as it is that must stay positive (``ref`` on the
    user's line ``stmt``): map an unconstrained value through softplus (plus ``eps``), use
    it on that line, or train its log. ``finite(name)`` names what the mapped value keeps
    finite (``torch.log(sigma)``)."""
    leaf = qual.rsplit(".", maxsplit=1)[-1]
    taken = set(re.findall(r"(?<![\w.])[A-Za-z_]\w*", stmt))
    pos = fresh_name(leaf if leaf != ref else f"{leaf}_pos", taken)
    lines = [f"{pos} = torch.nn.functional.softplus({ref}){eps}   # positive whatever the update"]
    if stmt:
        lines.append(re.sub(rf"(?<![\w.]){re.escape(ref)}(?![\w(])", pos, stmt))
    else:
        lines.append(f"# use {pos} where the loss uses {ref}: {finite(pos)} is finite")
    lines.append(
        f"# or train its log: log_{leaf} = nn.Parameter(torch.zeros({numel})) and "
        f"{leaf} = log_{leaf}.exp()"
    )
    return "\n".join(lines)


def _root_of_param(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, e: object
) -> tuple[str, str, str] | None:
    """A sqrt (or fractional power) of a watched parameter trained as it is (a wave speed
    squared, a variance, a diffusivity) that made NaN while its input went unmeasured: the
    parameter named on the line, or, the line unknown, the only watched parameter of the NaN
    output's size in loss code. A root of a finite number is NaN only below 0, so an update
    moved the parameter there: the fix maps an unconstrained parameter to a positive value,
    not a clamp for rounding. (evidence, explanation, fix), or None."""
    if "NaN" not in ev.born or (
        e is not None and (not isinstance(e, (int, float)) or float(e).is_integer())
    ):
        return None
    params = watched_params((ctx.trace, *reversed(ctx.history)))
    stmt = next((st for st in statements(ev.code) if call_argument(st, ["sqrt", "pow"])), "")
    expr = call_argument(stmt, ["sqrt", "pow"]) if stmt else None
    if expr is not None and ev.op.startswith("aten.pow") and "," in expr:
        expr = expr.split(",", 1)[0].strip()
    qual: str | None = None
    n = ev.output.numel
    if expr is not None:
        qual = param_named(params, expr) if _NAME.fullmatch(expr) else None
    elif not ev.code and (ev.path or a.path) == LOSS_PATH:
        # a layer's weight or bias is used by the layer's own forward, not by loss code
        hits = [q for q, k in params.items() if k == n and not _LAYER_PARAM.search(q)]
        outputs = {r.stat.numel for r in first_root_outputs(ctx.trace) if r.stat is not None}
        if len(hits) == 1 and n not in outputs:
            qual = hits[0]
    if qual is None:
        return None
    ref = expr or module_ref(qual)
    how = (
        f"the {packet(ev.op)}'s input {ref} is the parameter {qual}"
        if expr
        else f"the {packet(ev.op)}'s NaN output has {count(n, 'value')}, as the parameter "
        f"{qual} has, the only watched parameter of {count(n, 'value')}"
    )
    said = (
        f"{how}: a {packet(ev.op)} of a finite number is NaN only below 0, so an optimizer "
        "update moved it below 0 (not rounding: rounding does not move a parameter)"
        if expr
        # matched by size alone: said as what it points to, not as a fact
        else f"{how}: if the {packet(ev.op)} is of it, an optimizer update moved it below 0 "
        f"(a {packet(ev.op)} of a finite number is NaN only below 0, and rounding does not "
        "move a parameter)"
    )
    grad = last_gradient(tuple(reversed(ctx.history)), qual)
    held = group_holding((*ctx.history, ctx.trace), qual)
    if grad is not None and held is not None:
        opt, _, lr = held
        size = grad.norm if grad.norm is not None else grad.magnitude
        said += f"; its last gradient had norm {fmt(size)}, and {opt} lr {fmt(lr)}"
    fix = _positive_param_fix(qual, ref, stmt, n, finite=lambda _: f"its {packet(ev.op)}")
    why = (
        f"The {packet(ev.op)}'s input is a parameter trained as it is, one that must stay "
        "positive (a squared speed, a variance, a diffusivity, a scale). Nothing keeps it "
        "above 0: an update larger than its value takes it below 0, where the "
        f"{packet(ev.op)} is NaN. A clamp for rounding (clamp_min(0) + eps) would hide it and "
        "zero its gradient, so it never comes back. Train an unconstrained parameter and map "
        "it to a positive value (softplus, or exp of a log-parameter)."
    )
    return said, why, fix


def _pole_at_zero(ev: OpEvent, x: TensorStat | None, e: object) -> bool:
    """rsqrt or a negative power of exact zeros and of nothing below 0: 0 ** -0.5 = inf, a
    pole, not a number outside the real domain."""
    negative_power = (isinstance(e, (int, float)) and not isinstance(e, bool) and e < 0) or packet(
        ev.op
    ) in _RSQRT
    if not negative_power or "inf" not in ev.born:
        return False
    if x is None:
        return "NaN" not in ev.born  # only inf: a negative number would have made NaN
    return x.min == 0.0 and has_zero(x)


def _pole_zero_factor(ev: OpEvent) -> _ZeroFactor | None:
    """:func:`_zero_factor` of the base of the user's power, for the evidence."""
    if packet(ev.op) in _RSQRT:
        return None
    stmt = next((st for st in statements(ev.code) if re.search(r"pow\(|\*\*", st)), None)
    base: list[str] = []
    _rewrite_base(stmt, lambda b: b, base, ev)
    return _zero_factor(ev, base[0]) if base and not _count_base(base[0]) else None


def _pole_operand(ev: OpEvent) -> str | None:
    """The input of the rsqrt, or the base of the negative power, as the line writes it."""
    stmt = next((st for st in statements(ev.code) if re.search(r"rsqrt|pow\(|\*\*", st)), None)
    got: list[str] = []
    if packet(ev.op) in _RSQRT:

        def keep(v: str) -> str:
            got.append(v)
            return v

        rewrite_call(stmt, ["rsqrt"], keep)
    else:
        _rewrite_base(stmt, lambda b: b, got, ev)
    return got[0] if got else None


def _pole_formula(ev: OpEvent, e: object) -> str:
    if packet(ev.op) in _RSQRT:
        return "rsqrt(0) = 1 / sqrt(0)"
    return f"0 ** {e} = 1 / 0 ** {fmt(-float(e))}" if isinstance(e, (int, float)) else "1 / 0"


#: calls and names whose value is a whole number: a count, a degree, a length
_COUNT_CALLS = frozenset(
    {"sum", "count_nonzero", "bincount", "len", "numel", "degree", "size", "nnz", "histc"}
)
#: the last part of a name that holds a count (``node_deg``, ``n``): see _count_base
_COUNT_SUFFIX = re.compile(r"(?:^|_)(?:deg|degree|degrees|count|counts|cnt|len|lens|lengths?|n)$")


def _count_base(base: str) -> bool:
    """The base of a power is integer-valued: a sum, a count, a length, a bincount or a
    degree (``adj.sum(1)``, ``deg``, ``lengths``); a product with a probability (``N *
    P[idx]``) or any other continuous value is not."""
    try:
        node = ast.parse(base.strip(), mode="eval").body
    except SyntaxError:
        return True  # unknown: keep the count story
    if isinstance(node, ast.Call):
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        return name in _COUNT_CALLS or "degree" in name
    if isinstance(node, (ast.Name, ast.Attribute)):
        last = node.id if isinstance(node, ast.Name) else node.attr
        return _COUNT_SUFFIX.search(last.lower()) is not None
    if isinstance(node, ast.Subscript):
        return _count_base(ast.unparse(node.value))
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        return _count_base(ast.unparse(node.left)) and _count_base(ast.unparse(node.right))
    return False


@dataclass(frozen=True)
class _ZeroFactor:
    """The factor of a negative power's base that holds the zeros (``P`` in ``(N *
    P[idx]) ** -beta``) traced to the tensor it normalizes (``prio``)."""

    words: str
    fix: str


def _zero_factor(ev: OpEvent, base: str) -> _ZeroFactor | None:
    """The base of a negative power is a product of numbers and one tensor factor that is a
    normalized distribution made above (``P = prio ** alpha / (prio ** alpha).sum()``):
    its zeros are the zeros of the tensor it normalizes (priorities of 0), which is the
    thing to fix where it is made; a floor on the product would change every weight."""
    try:
        node = ast.parse(base.strip(), mode="eval").body
    except SyntaxError:
        return None
    factors = operands(node, ast.Mult)
    tensors = []
    for f in factors:
        if isinstance(f, ast.Constant):
            continue
        if isinstance(f, ast.Name):
            made = _assigned_value(ev.source, f.id)
            if made is not None and re.fullmatch(r"\s*(?:\d[\d_.eE+-]*|len\(.*\))\s*", made):
                continue  # a Python number: N = 64, n = len(buffer)
        tensors.append(f)
    if len(tensors) != 1:
        return None
    f = tensors[0]
    head = f.value if isinstance(f, ast.Subscript) else f
    if not isinstance(head, ast.Name):
        return None
    p = head.id
    made = _assigned_value(ev.source, p)
    try:
        value = ast.parse(made, mode="eval").body if made else None
    except SyntaxError:
        return None
    if not (
        isinstance(value, ast.BinOp)
        and isinstance(value.op, ast.Div)
        and isinstance(value.right, ast.Call)
        and isinstance(value.right.func, ast.Attribute)
        and value.right.func.attr == "sum"
    ):
        return None
    src = value.left  # prio ** alpha: the tensor normalized, maybe raised to a power
    while isinstance(src, ast.BinOp) and isinstance(src.op, ast.Pow):
        src = src.left
    if not isinstance(src, ast.Name):
        return None
    q = src.id
    init = _assigned_value(ev.source, q)
    words = (
        f"the base {base} is a probability times a number, not a count: {p} = {made} "
        f"is 0 wherever {q} is 0, so {q} holds values of exactly 0 (priorities of 0), and "
        f"0 ** {ev.scalars.get('exponent', '-b')} is inf"
    )
    lines = []
    if init is not None and re.search(r"\bzeros(?:_like)?\(", init):
        words += f"; {q} is made with zeros: {q} = {init}"
        try:
            made_node = ast.parse(init, mode="eval").body
        except SyntaxError:
            made_node = None
        if isinstance(made_node, ast.IfExp):  # a ... if cond else torch.zeros(n): that branch
            zeros = [b for b in (made_node.body, made_node.orelse) if "zeros" in ast.unparse(b)]
            if len(zeros) == 1:
                init = ast.get_source_segment(init, zeros[0]) or ast.unparse(zeros[0])
        fixed = re.sub(r"\bzeros(_like)?\(", r"ones\1(", init)
        lines.append(
            f"{q} = {fixed}   # new entries at the max priority (1.0 in an empty buffer), "
            "not 0: every one is sampled and none has a weight of inf"
        )
    lines.append(
        f"# and where {q} is updated from the TD errors: |td| + eps (td.abs() + 1e-6), "
        "never exactly 0"
    )
    lines.append(
        f"# not a floor on {base}: it is below 1 for every sample of a healthy buffer, "
        "and .clamp_min(1) would give them all the same weight"
    )
    return _ZeroFactor(words, "\n".join(lines))


def _pole_text(ev: OpEvent, e: object) -> str:
    if packet(ev.op) in _RSQRT:
        return (
            "rsqrt(x) = 1 / sqrt(x) is inf at x = 0, and nothing here is negative: the "
            "input is exactly 0. A mean square or a variance of an all-zero row is 0 -- a "
            "padding token (padding_idx keeps its embedding 0), a masked or zeroed feature. "
            "RMSNorm and LayerNorm add an eps inside, rsqrt(ms + eps), so such a row stays "
            "finite; without it the row is inf, and the product that follows (0 × inf) is NaN."
        )
    return (
        f"x ** {e} = 1 / x ** {fmt(-float(e)) if isinstance(e, (int, float)) else '-e'} is "
        "inf at x = 0: a negative power of 0 has no finite value, and nothing here is "
        "negative. A count or a sum that is 0 for one row -- the degree of a node without "
        "edges in a graph, an empty bag, a length of 0 -- or the norm of an all-zero "
        "vector makes it, and what follows turns the inf into NaN (0 × inf, inf - inf)."
    )


def _pole_fix(ev: OpEvent, e: object) -> str:
    """Keep the base off 0 on the user's line: rsqrt(v + eps); a count (a degree) at least
    1, and its result set to 0 where the count was 0; or an eps for continuous values."""
    stmt = next((st for st in statements(ev.code) if re.search(r"rsqrt|pow\(|\*\*", st)), None)
    if packet(ev.op) in _RSQRT:
        method = stmt is not None and re.search(r"(?<!torch)\.rsqrt_?\(", stmt) is not None
        own = rewrite_call(stmt, ["rsqrt"], lambda v: f"({v} + 1e-6)" if method else f"{v} + 1e-6")
        addend = _addend(stmt)
        lines = [
            f"{own}   # eps inside the root, as RMSNorm (1e-6): rsqrt(0 + eps) is finite"
            if own
            else "y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)   # RMSNorm, "
            "with its eps"
        ]
        lim = limits(ev.dtype)
        if addend is not None and lim is not None and lim.subnormal / 2 > 1e-8:
            dt = ev.dtype
            lines.append(
                f"# or give {addend} a value {dt} holds, at least {fmt(lim.tiny)} "
                f"(torch.finfo(torch.{dt}).tiny): it added nothing, so it is 0 or below "
                f"{fmt(lim.subnormal / 2)}, half of {dt}'s smallest subnormal "
                f"{fmt(lim.subnormal)}, which rounds to 0 in {dt} (1e-8 and 1e-12 do)"
            )
        elif addend is not None:
            lines.append(
                f"# or give {addend} a value above 0: the input reached exactly 0, so it "
                "added nothing"
            )
        lines.append("# or keep padding rows out: normalize only where the mask is True")
        return "\n".join(lines)
    base: list[str] = []
    at_least_one = _rewrite_base(stmt, lambda b: f"{paren(b)}.clamp_min(1)", base, ev)
    with_eps = _rewrite_base(stmt, lambda b: f"({b} + 1e-6)", [], ev)
    lhs = _target(stmt)
    if base and not _count_base(base[0]):  # a continuous value: keep it off 0, never 1
        zero = _zero_factor(ev, base[0])
        if zero is not None:
            return zero.fix
        own = _negative_power_floor(stmt, e, _power_eps(ev.dtype))
        if own is not None:
            return (
                f"{own}   # a continuous value, not a count: a floor keeps the power finite "
                "(not relu: 0 ** -k = inf; not sign·|x|)\n"
                f"# better: find why {_unclipped_text(base[0])} reached 0 and keep it above 0 "
                "where it is made"
            )
        floored = _rewrite_base(stmt, lambda b: f"{paren(b)}.clamp_min(1e-6)", [], ev)
        if floored is not None and with_eps is not None:
            return (
                f"{floored}   # a continuous value, not a count: an eps floor keeps "
                f"{base[0]} ** {e} finite\n"
                f"{with_eps}   # or add the eps\n"
                f"# better: keep {base[0]} above 0 where it is made (a softplus or exp "
                "output, not a relu: relu is exactly 0 for every negative input)"
            )
    if at_least_one is None or with_eps is None or not base:
        p = f"{e}" if e is not None else "-0.5"
        return (
            f"y = x.clamp_min(1) ** {p}   # a count (a degree, a length): 0 counts as 1\n"
            "y = y.masked_fill(x == 0, 0)   # then, where a zero should give 0 (no edges)\n"
            f"y = (x + 1e-6) ** {p}   # or a continuous value (a norm, a variance): an eps"
        )
    lines = [f"{at_least_one}   # a count (a degree, a length): 0 counts as 1, not inf"]
    if lhs is not None:
        lines.append(
            f"{lhs} = {lhs}.masked_fill({base[0]} == 0, 0)   # then, where a zero should give "
            "0 (a node without edges)"
        )
    lines.append(f"{with_eps}   # or a continuous value (a norm, a variance): an eps")
    return "\n".join(lines)


def _addend(stmt: str | None) -> str | None:
    """The name added last inside the root's argument (``ms + self.eps`` -> ``self.eps``)."""
    arg = call_argument(stmt, ["rsqrt", "sqrt"])
    if arg is None:
        return None
    m = re.search(r"\+\s*([A-Za-z_][\w.]*)\s*$", arg)
    return m.group(1) if m else None


def _target(stmt: str | None) -> str | None:
    """The plain name a statement assigns (``dinv = ...`` -> ``dinv``)."""
    m = re.match(r"\s*([A-Za-z_]\w*)\s*=(?!=)", stmt or "")
    return m.group(1) if m else None


def _power_sites(tree: ast.AST) -> list[tuple[ast.expr, ast.expr, ast.expr]]:
    """Each power of ``tree`` in source order: (node, base, exponent) of ``x ** e``,
    ``x.pow(e)`` and ``torch.pow(x, e)``."""
    out: list[tuple[ast.expr, ast.expr, ast.expr]] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow):
            out.append((n, n.left, n.right))
        elif isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Attribute) and f.attr == "pow" and len(n.args) == 1:
                if ast.unparse(f.value) != "torch":
                    out.append((n, f.value, n.args[0]))
            elif ast.unparse(f) == "torch.pow" and len(n.args) == 2:
                out.append((n, n.args[0], n.args[1]))
    return sorted(out, key=lambda t: (t[0].lineno, t[0].col_offset))


def _source_tree(source: str | None) -> tuple[ast.Module, int] | None:
    """The parsed file of ``source`` (``file.py:42``) and the line number; None when it
    cannot be read or parsed."""
    import linecache

    path, _, num = (source or "").rpartition(":")
    if not path or not num.isdigit():
        return None
    text = "".join(linecache.getlines(path))
    if not text:
        return None
    try:
        return ast.parse(text), int(num)
    except (SyntaxError, ValueError):
        return None


_ARITH: dict[type, Callable[[float, float], float]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def _constant_value(expr: ast.expr, source: str | None, depth: int = 0) -> float | None:
    """The number ``expr`` evaluates to, its names read from the user's file
    (:func:`_name_constant`); None when any part is not such a constant."""
    if depth > 8:
        return None
    if isinstance(expr, ast.Constant):
        v = expr.value
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, (ast.USub, ast.UAdd)):
        v = _constant_value(expr.operand, source, depth + 1)
        return None if v is None else (-v if isinstance(expr.op, ast.USub) else v)
    if isinstance(expr, ast.BinOp) and type(expr.op) in _ARITH:
        a = _constant_value(expr.left, source, depth + 1)
        b = _constant_value(expr.right, source, depth + 1)
        if a is None or b is None or (isinstance(expr.op, ast.Div) and b == 0):
            return None
        return _ARITH[type(expr.op)](a, b)
    if isinstance(expr, ast.Name) and source is not None:
        found = _name_constant(expr.id, source)
        return None if found is None else _constant_value(found, source, depth + 1)
    return None


def _assigned_in(body: list[ast.stmt], name: str, before: int | None) -> ast.expr | bool | None:
    """What the last assignment to ``name`` among ``body``'s statements above line
    ``before`` gives it: the expression, None when it is not one (``a, b = f()``, ``+=``),
    False when none assigns it."""
    got: ast.expr | bool | None = False
    for st in body:
        if before is not None and st.lineno >= before:
            break
        if isinstance(st, ast.Assign):
            for t in st.targets:
                v = st.value
                if isinstance(t, ast.Name) and t.id == name:
                    got = v
                elif isinstance(t, ast.Tuple) and any(
                    isinstance(x, ast.Name) and x.id == name for x in t.elts
                ):
                    same = isinstance(v, ast.Tuple) and len(v.elts) == len(t.elts)
                    i = [isinstance(x, ast.Name) and x.id == name for x in t.elts].index(True)
                    got = v.elts[i] if same and isinstance(v, ast.Tuple) else None
        elif (
            isinstance(st, (ast.AugAssign, ast.AnnAssign))
            and isinstance(st.target, ast.Name)
            and st.target.id == name
        ):
            got = st.value if isinstance(st, ast.AnnAssign) else None
    return got


def _name_constant(name: str, source: str) -> ast.expr | None:
    """The expression ``name`` holds at line ``source``, read from the user's file: a
    constant assigned in the enclosing function above the line, the default of its
    parameter (``p=P``: what the line sees unless a caller passes one), or a module-level
    assignment (``N, D, P = 256, 8, 1.5``); None when none is found."""
    parsed = _source_tree(source)
    if parsed is None:
        return None
    tree, line = parsed
    fn: ast.FunctionDef | ast.AsyncFunctionDef | None = None
    for n in ast.walk(tree):
        if (
            isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.lineno <= line <= (n.end_lineno or n.lineno)
            and (fn is None or n.lineno > fn.lineno)
        ):
            fn = n
    if fn is not None:
        inner = [st for st in ast.walk(fn) if isinstance(st, ast.stmt) and st is not fn]
        got = _assigned_in(sorted(inner, key=lambda st: st.lineno), name, line)
        if got is not False:
            return got if isinstance(got, ast.expr) else None
        args = fn.args
        pos = args.posonlyargs + args.args
        named = dict(
            zip([a.arg for a in pos[len(pos) - len(args.defaults) :]], args.defaults, strict=True)
        )
        named.update(
            (a.arg, d)
            for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
            if d is not None
        )
        if name in named:
            return named[name]
        if any(a.arg == name for a in pos + args.kwonlyargs):
            return None
    got = _assigned_in(tree.body, name, None if fn is not None else line)
    return got if isinstance(got, ast.expr) else None


def _traced_power(stmt: str, ev: OpEvent) -> tuple[str, ast.expr] | None:
    """The statement and the base of the power on the user's line that the traced op ran,
    when the line holds several: the one whose exponent evaluates (:func:`_constant_value`)
    to the op's scalar exponent (``mu.pow(1 - p)`` with ``p = 1.5`` for an exponent of
    -0.5, not the ``y.pow(2 - p)`` before it). None when not exactly one base fits."""
    e = ev.scalars.get("exponent")
    if not isinstance(e, (int, float)) or isinstance(e, bool):
        return None
    for st, tree in _parsed(stmt):
        # a number's power (2 ** x) has its tensor in the exponent: not this op's base
        sites = [s for s in _power_sites(tree) if _constant_value(s[1], None) is None]
        if len(sites) < 2:
            continue
        fits = [
            s
            for s in sites
            if (v := _constant_value(s[2], ev.source)) is not None
            and math.isclose(v, e, rel_tol=1e-6, abs_tol=1e-9)
        ]
        if fits and len({ast.unparse(s[1]) for s in fits}) == 1:
            return st, fits[0][1]
    return None


def _rewrite_base(
    stmt: str | None,
    wrap: Callable[[str], str],
    got: list[str],
    ev: OpEvent | None = None,
) -> str | None:
    """The statement with the base of its power (``x.pow(e)``, ``torch.pow(x, e)``, ``x **
    e``) passed through ``wrap``; the base is appended to ``got``. With ``ev``, the power
    whose exponent is the traced one (:func:`_traced_power`) when the line holds several;
    else the first."""

    def keep(b: str) -> str:
        got.append(b)
        return wrap(b)

    if ev is not None and stmt and (hit := _traced_power(stmt, ev)) is not None:
        st, node = hit
        text = ast.get_source_segment(st, node) or ast.unparse(node)
        new = keep(text)
        return _spliced(st, node, paren(new) if new == text else new, grouped=True)
    out = rewrite_call(stmt, ["pow"], keep)
    if out is not None or not stmt:
        return out
    line = stmt.split("  #", 1)[0].rstrip()
    m = re.search(r"\*\*", line)
    if m is None:
        return None
    end = m.start() - 1
    while end >= 0 and line[end] == " ":
        end -= 1
    begin = postfix_start(line, end) if end >= 0 else None
    if begin is None:
        return None
    base = line[begin : end + 1]
    if base.startswith("(") and base.endswith(")"):
        base = base[1:-1]
    return line[:begin] + keep(base) + line[end + 1 :]


def _rounding_negative(x: TensorStat, dtype: str | None) -> bool:
    """The negative values are rounding errors: within a few eps of the values' scale
    (E[x²] - E[x]² of -1e-8), not values that are negative in their own right."""
    lim = limits(dtype) or limits("float32")
    assert lim is not None
    scale = max(abs(x.max) if math.isfinite(x.max) else 1.0, 1.0)
    return x.min >= -64 * lim.eps * scale


@dataclass(frozen=True)
class _Cancellation:
    """Negative values of a root's argument within a few rounding steps of the squares of
    the values its module worked with: what is left of a difference of two nearly equal
    large numbers (E[x²] - E[x]²), rounding noise of either sign."""

    path: str
    amax: float  #: the largest |x| among the module's inputs and its children's outputs
    ulp: float  #: eps · amax²: one rounding step of those squares
    steps: int  #: how many such steps the minimum is below 0
    dtype: str
    #: the op's input was made by a subtraction whose operands reached this magnitude (seen
    #: op by op: the large values may be the module's own intermediates); None: inferred
    #: from the squares of the values the module was given or computed
    operands: float | None = None

    @property
    def words(self) -> str:
        if self.operands is not None:
            return (
                f"{count(self.steps, f'{self.dtype} rounding step')} of the subtraction that "
                f"made it, whose operands reach {fmt(self.operands)} (eps·{fmt(self.operands)}"
                f" = {fmt(self.ulp)}): cancellation, not values negative in their own right"
            )
        return (
            f"{count(self.steps, f'{self.dtype} rounding step')} of the squares of the values "
            f"{self.path} works with (max |x| {fmt(self.amax)}, x² up to "
            f"{fmt(self.amax * self.amax)}, eps·x² = {fmt(self.ulp)}): cancellation, not "
            "values negative in their own right"
        )


def _cancellation(ctx: RuleContext, ev: OpEvent, x: TensorStat) -> _Cancellation | None:
    """The negative minimum of a root's argument is within 16 rounding steps of the
    squares of the values the op's module was given or computed (its inputs and its
    children's outputs this step): a variance E[x²] - E[x]² of values far from 0 cancels to
    noise of that size, of either sign."""
    lim = limits(ev.dtype)
    if lim is None or not x.min < 0:
        return None
    name = ev.inputs[0][0] if ev.inputs else None
    operands = ev.scalars.get(f"{DIFFERENCE_OF}:{name}")
    if isinstance(operands, float) and math.isfinite(operands) and operands > 0:
        # seen op by op: the subtraction that made the argument, and its operands' size
        ulp = lim.eps * operands
        if -x.min <= 16 * ulp:
            steps = max(1, round(-x.min / ulp))
            amax = math.sqrt(operands)
            return _Cancellation(ev.path or "", amax, ulp, steps, ev.dtype or "float32", operands)
        return None
    if ev.path is None:
        return None
    trace = ctx.trace
    calls = {c.id for c in trace.calls if c.path == ev.path}
    inner = ev.path + "."
    amax = 0.0
    for r in trace.records:
        mine = r.phase is Phase.INPUT and r.call in calls
        child = r.phase is Phase.FORWARD and r.path.startswith(inner) and r.call >= 0
        if not (mine or child):
            continue
        m = exact(trace, r)
        mag = m.stat.magnitude if m is not None and m.stat is not None else math.nan
        if math.isfinite(mag):
            amax = max(amax, mag)
    ulp = lim.eps * amax * amax
    if not (math.isfinite(ulp) and ulp > 0) or -x.min > 16 * ulp:
        return None
    return _Cancellation(ev.path, amax, ulp, max(1, round(-x.min / ulp)), ev.dtype or "float32")


def _cancel_text(c: _Cancellation, dtype: str | None) -> str:
    near = (
        f"numbers near {fmt(c.operands)}"
        if c.operands is not None
        else f"numbers near {fmt(c.amax * c.amax)} (squares of values up to {fmt(c.amax)})"
    )
    return (
        "sqrt(x) is not a real number for negative x: PyTorch returns NaN. These negative "
        "values are rounding, not data: a variance computed as E[x²] - E[x]² subtracts two "
        f"{near} that "
        f"agree to within {dtype or 'float32'}'s precision, and what is left is noise of "
        f"about {fmt(c.ulp)}, of either sign. Values far from 0 with a small spread (an "
        "un-centered feature, a constant row) do this. Subtracting the mean first, "
        "((x - mean)²).mean(), never goes below 0; then add eps."
    )


def _cancel_fix(ev: OpEvent) -> str:
    """A two-pass variance (under the user's name for it when their line shows one), the
    built-in layer norm, and the user's root with an eps inside."""
    stmt = next((st for st in statements(ev.code) if "sqrt" in st), None)
    arg = call_argument(stmt, ["sqrt", "rsqrt"])
    m = re.match(r"\s*([A-Za-z_]\w*)(?![\w.(\[])", arg) if arg is not None else None
    var = m.group(1) if m and m.group(1) not in ("torch", "self", "x") else "var"
    own = rewrite_call(stmt, ["sqrt", "rsqrt"], lambda v: f"{v} + 1e-5")
    return (
        f"{var} = x.var(-1, keepdim=True, correction=0)   # two-pass: never below 0, unlike "
        "E[x²] - E[x]² (x: the values normalized)\n"
        f"{var} = ((x - x.mean(-1, keepdim=True)) ** 2).mean(-1, keepdim=True)   # the same, "
        "by hand\n"
        "y = F.layer_norm(x, x.shape[-1:], eps=1e-5)   # or the built-in\n"
        + (
            f"{own}   # then an eps inside the root, as LayerNorm"
            if own
            else "y = torch.sqrt(v.clamp_min(0) + 1e-12)   # rounding made v slightly negative"
        )
    )


_ROOT_NEGATIVE = (
    "sqrt(x) is not a real number for negative x: PyTorch returns NaN. These values are "
    "negative in their own right, not by rounding: a raw network output (a Linear) is "
    "negative about half the time, so a quantity that must be positive (a width, a "
    "variance, a scale) needs a positive parameterization. Clamping at 0 keeps the NaN "
    "away but zeroes the gradient of every negative prediction, and sqrt's gradient at 0 "
    "is infinite."
)


_ROOT_DATA = (
    "A root or a fractional power of a negative number is not real: PyTorch returns NaN. "
    "The negative values are in the data itself, the module's input with no autograd "
    "history, not a prediction: a count with negative corrections (returns booked as "
    "negative sales), a sentinel such as -1 for missing, a feature that was centered or "
    "standardized upstream. Clamp or filter them where the data enters, or fix the data."
)


def _data_base(ctx: RuleContext, ev: OpEvent, x: TensorStat | None) -> Record | None:
    """The input record of the op's module that is the root's base: its measured values
    match the base's (min, max, size) and it has no autograd history -- data, not a
    network output."""
    if x is None or ev.path is None:
        return None
    trace = ctx.trace
    calls = {c.id for c in trace.calls if c.path == ev.path}
    for r in trace.records:
        if r.phase is not Phase.INPUT or r.call not in calls:
            continue
        m = exact(trace, r)
        st = m.stat if m is not None else None
        if m is None or st is None or m.phase is not Phase.INPUT or m.grad_fn is not None:
            continue
        if r.grad_fn is not None:
            continue
        if st.numel == x.numel and st.min == x.min and st.max == x.max:
            return r
    return None


_ROOT_DATA_BUILT = (
    "A root or a fractional power of a negative number is not real: PyTorch returns NaN. "
    "The base is computed from the module's inputs that have no autograd history -- data, "
    "not a prediction -- and takes their sign: a degree summed from signed edge weights "
    "(correlations), a total with negative corrections, a difference of features. A "
    "positive parameterization (softplus) does not apply: nothing here is learned. Clamp "
    "the base where it is made, take absolute weights if the sign carries no meaning for "
    "it, or fix the data."
)

#: calls whose arguments give a shape or a fill value, not the values of a tensor
_CONSTRUCTORS = frozenset(
    {"zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like", "empty_like"}
    | {"arange", "eye", "tensor", "as_tensor", "size", "numel", "dim", "len"}
)
#: methods whose argument at this position is an index (no values flow from it)
_INDEX_ARG = {
    "scatter_add": 1, "scatter_add_": 1, "scatter": 1, "scatter_": 1, "scatter_reduce": 1,
    "scatter_reduce_": 1, "index_add": 1, "index_add_": 1, "gather": 1, "index_select": 1,
}  # fmt: skip


def _value_names(node: ast.expr) -> list[str] | None:
    """The names whose values flow into ``node`` (``ew`` of ``torch.zeros(x.size(0))
    .scatter_add_(0, col, ew)``: not ``x``, read for its size, nor ``col``, an index); None
    when something else does (a module call ``self.lin(h)``, an attribute ``self.w``, a
    function of the user's), whose history is unknown."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Constant):
        return []
    if isinstance(node, ast.Attribute):
        return [] if node.attr in ("shape", "device", "dtype", "ndim") else None
    if isinstance(node, ast.UnaryOp):
        return _value_names(node.operand)
    if isinstance(node, (ast.BinOp, ast.Compare, ast.Subscript, ast.Tuple, ast.Slice)):
        parts = [
            _value_names(n)
            for n in ast.iter_child_nodes(node)
            if isinstance(n, ast.expr) and not isinstance(n, ast.expr_context)
        ]
        return None if any(p is None for p in parts) else [n for p in parts for n in p or []]
    if not isinstance(node, ast.Call) or any(k.arg is None for k in node.keywords):
        return None  # f(**kw): what it passes is not shown
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else ast.unparse(func)
    if name in _CONSTRUCTORS:
        return []
    module = isinstance(func, ast.Attribute) and ast.unparse(func.value) in ("torch", "F")
    if not isinstance(func, ast.Attribute) or (
        not module and isinstance(func.value, ast.Attribute)
    ):
        return None  # f(x), self.lin(x): a function or a module of the user's
    skip = _INDEX_ARG.get(name, -1) + int(module)
    args = [a for i, a in enumerate(node.args) if i != skip]
    args += [k.value for k in node.keywords if k.arg != "index"]
    parts = [_value_names(a) for a in args] + ([] if module else [_value_names(func.value)])
    return None if any(p is None for p in parts) else [n for p in parts for n in p or []]


def _forward_params(source: str | None) -> list[str] | None:
    """The positional parameters of the function holding line ``source``, without ``self``
    (a method's first); None when its ``def`` line is not found or does not parse."""
    import linecache

    path, _, num = (source or "").rpartition(":")
    if not path or not num.isdigit():
        return None
    here = linecache.getline(path, int(num))
    indent = len(here) - len(here.lstrip())
    for n in range(int(num) - 1, max(0, int(num) - 80), -1):
        text = linecache.getline(path, n)
        m = re.match(r"(\s*)(?:async\s+)?def\s", text)
        if m is None or len(m.group(1)) >= indent:
            continue
        try:
            fn = ast.parse(text.strip().removeprefix("async ") + " pass").body[0]
        except (SyntaxError, IndexError):
            return None
        if not isinstance(fn, ast.FunctionDef):
            return None
        names = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        return names[1:] if m.group(1) else names  # indented: a method
    return None


def _built_from_data(ctx: RuleContext, ev: OpEvent) -> tuple[str, str, str] | None:
    """The root's base is a name computed, in the function that holds the user's line, only
    from the module's inputs that have no autograd history (data) and from constructors
    (``deg = torch.zeros(n).scatter_add_(0, col, ew)`` with ``ew`` an input): the name, its
    assignment, and the inputs it read (``c1's input[2] (ew)``); None otherwise."""
    got: list[str] = []
    if _rewrite_base(ev.code, lambda b: b, got, ev) is None or not got:
        got = [a] if (a := call_argument(ev.code, ["sqrt", "rsqrt"])) else []
    if not got or not re.fullmatch(r"[A-Za-z_]\w*", got[0].strip()) or ev.path is None:
        return None
    params = _forward_params(ev.source)
    if params is None:
        return None
    trace = ctx.trace
    calls = {c.id for c in trace.calls if c.path == ev.path}
    inputs = {r.role: r for r in trace.records if r.phase is Phase.INPUT and r.call in calls}

    def data(role: str) -> bool:
        r = inputs.get(role)
        if r is None:
            return False
        if not r.dtype.startswith(("float", "bfloat", "complex")):
            return True  # an integer or bool tensor has no gradient
        m = exact(trace, r)
        return r.grad_fn is None and m is not None and m.grad_fn is None

    base = got[0].strip()
    seen: list[str] = []
    todo, made = [base], ""
    while todo:
        name = todo.pop()
        if name in params:
            role = f"input[{params.index(name)}]"
            if not data(role):
                return None
            seen.append(f"{role} ({name})")
            continue
        if len(seen) + len(todo) > 8:
            return None
        found = _assigned_expr(ev.source, name)
        if found is None:
            return None
        stmt, value = found
        made = made or stmt
        names = _value_names(value)
        if names is None or name in names:
            return None
        todo += [n for n in dict.fromkeys(names) if n not in todo]
    if not seen:
        return None
    return base, made, f"{ev.path}'s " + ", ".join(dict.fromkeys(seen))


def _data_root_fix(ev: OpEvent, e: object) -> str:
    """The user's line with the base (data) clamped at 0; a shift by 1 where the exponent
    may be negative (0 ** -p is inf)."""
    got: list[str] = []
    if packet(ev.op) in ("sqrt", "rsqrt"):
        own = rewrite_call(ev.code, ["sqrt", "rsqrt"], lambda v: f"{paren(v)}.clamp_min(0)")
        base = "x"
    else:
        own = _rewrite_base(ev.code, lambda b: f"{paren(b)}.clamp_min(0)", got, ev)
        base = got[0] if got else "x"
    signed = e is None or (isinstance(e, (int, float)) and not isinstance(e, bool) and e < 0)
    lines = [
        (f"{own}" if own else f"y = {paren(base)}.clamp_min(0) ** p")
        + "   # negative entries of the data count as 0"
    ]
    if signed and packet(ev.op) not in ("sqrt",):
        lines.append(
            f"# the exponent may go below 0, and 0 ** -p is inf: shift counts first, "
            f"{paren(base)}.clamp_min(0) + 1"
        )
    lines.append(
        f"# or drop them where the batch is made: rows = ({base} >= 0).all(-1); "
        f"{base} = {base}[rows]"
    )
    return "\n".join(lines)


_ROOT_COMPUTED = (
    "sqrt(x) is not a real number for negative x: PyTorch returns NaN. The argument is "
    "computed by the code, not a raw network output: a formula that is negative for some "
    "entries (a discriminant, a difference of moments, a candidate threshold that a later "
    "step discards). A NaN in an entry the forward discards still reaches the gradient. "
    "Clamp the argument at 0 where the formula leaves its domain (the reference entmax "
    "does torch.sqrt(delta.clamp_min(0))); softplus would change every value, not only the "
    "negative ones."
)


def _raw_output(ev: OpEvent) -> bool:
    """The root's argument may be a raw prediction, which a positive parameterization
    fixes: true unless the user's line shows it computed by arithmetic -- on the line
    (``torch.sqrt(1 - ss)``) or where its name was assigned in the same function
    (``delta = (1 - ss) / rho``), seen through views (``delta[:, 1:]``)."""
    got: list[str] = []
    stmt = next((st for st in statements(ev.code) if "sqrt" in st), None)
    arg = call_argument(stmt, ["sqrt", "rsqrt"]) if stmt else None
    if arg is None and _rewrite_base(ev.code, lambda b: b, got, ev) is not None and got:
        arg = got[0]
    if arg is None:
        return True
    try:
        node: ast.expr = ast.parse(arg.strip(), mode="eval").body
    except SyntaxError:
        return True
    node, _ = under_views(node, _VIEWS)  # delta[:, 1:], v.float(), v.squeeze(-1)
    if isinstance(node, ast.BinOp):
        return False
    if not isinstance(node, ast.Name):
        return True
    made = _unconditional_assignment(ev, node.id)
    if isinstance(made, ast.BinOp) or _weighted_squares(made) is not None:
        return False
    # values gathered from several computations (torch.stack([cs1, cs2, ssim])) are not
    # one head's raw output
    return not (
        isinstance(made, ast.Call)
        and isinstance(made.func, ast.Attribute)
        and made.func.attr in ("stack", "cat", "concat", "concatenate")
    )


def _is_square(node: ast.expr) -> bool:
    """``x ** 2``, ``x * x``, ``x.pow(2)``, ``torch.square(x)``: non-negative by itself."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return isinstance(node.right, ast.Constant) and node.right.value == 2
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return ast.dump(node.left) == ast.dump(node.right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr == "square" and len(node.args) == 1:
            return True
        if node.func.attr == "pow" and len(node.args) == 1:
            arg = node.args[0]
            return isinstance(arg, ast.Constant) and arg.value == 2
    return False


def _weighted_squares(made: ast.expr | None) -> tuple[str, list[str]] | None:
    """A call that weighs squares (``F.conv2d(x ** 2, gamma, beta)``, ``F.linear(h * h,
    w, b)``): non-negative for every healthy input, negative only where its weights are.
    The square's text and the weights' (the call's other arguments that are names)."""
    if not isinstance(made, ast.Call):
        return None
    args = [*made.args, *(k.value for k in made.keywords)]
    squares = [a for a in args if _is_square(a)]
    weights = [
        ast.unparse(a)
        for a in args
        if isinstance(a, (ast.Name, ast.Attribute)) and not _is_square(a)
    ]
    if len(squares) != 1 or not weights:
        return None
    return ast.unparse(squares[0]), weights


def _floored_weights(made: str, weights: list[str]) -> str:
    """``F.conv2d(x ** 2, gamma, beta)`` -> ``F.conv2d(x ** 2, gamma.clamp_min(0),
    beta.clamp_min(0))``: the call's weight arguments floored at 0."""
    call = ast.parse(made, mode="eval").body
    assert isinstance(call, ast.Call)

    def floor(a: ast.expr) -> ast.expr:
        if isinstance(a, (ast.Name, ast.Attribute)) and ast.unparse(a) in weights:
            return ast.parse(f"{ast.unparse(a)}.clamp_min(0)", mode="eval").body
        return a

    call.args = [floor(a) for a in call.args]
    for k in call.keywords:
        k.value = floor(k.value)
    return ast.unparse(call)


def _root_weighted_squares(ev: OpEvent) -> tuple[str, str, str, list[str]] | None:
    """The root's argument named on the line and assigned above it from a weighted sum of
    squares: (its name, the assignment's value, the square, the weights)."""
    stmt = next((st for st in statements(ev.code) if "sqrt" in st), None)
    arg = call_argument(stmt, ["sqrt", "rsqrt"]) if stmt else None
    if arg is None or not _NAME.fullmatch(arg.strip()) or "." in arg:
        return None
    made = _unconditional_assignment(ev, arg.strip())
    found = _weighted_squares(made)
    if made is None or found is None:
        return None
    return arg.strip(), ast.unparse(made), found[0], found[1]


_VIEWS = frozenset(
    {
        "float",
        "double",
        "half",
        "to",
        "squeeze",
        "unsqueeze",
        "view",
        "reshape",
        "flatten",
        "contiguous",
        "clone",
        "detach",
        "t",
        "transpose",
        "permute",
        "expand",
        "narrow",
    }
)


def _computed_root_fix(ev: OpEvent) -> str:
    """The user's line with the root's argument clamped at 0."""
    own = rewrite_call(ev.code, ["sqrt", "rsqrt"], lambda v: f"{paren(v)}.clamp_min(0)")
    if own is None:
        own = _rewrite_base(ev.code, lambda b: f"{paren(b)}.clamp_min(0)", [], ev)
    head = own or "y = torch.sqrt(v.clamp_min(0))"
    return (
        f"{head}   # entries outside the domain give 0, not NaN; the rest are unchanged\n"
        "# not F.softplus inside the root: softplus(v) != v for v > 0, it changes every value"
    )


def _no_history(ev: OpEvent) -> list[str]:
    """The ops that made a root's base (``["unsqueeze", "index"]`` for ``ab = table[t][:, None]``)
    when the op checker saw, with grad on, that the base does not require grad
    (``history:self``): no parameter went into it, a constant or data the code built, which
    nothing learns. Empty otherwise."""
    if ev.phase is not Phase.FORWARD or ev.scalars.get("history:self") != "none":
        return []
    return list(ev.made_from) or ["code"]


def _constant_read(ev: OpEvent) -> tuple[str, str] | None:
    """(the statement, the table) when the root's base is a name the function assigned by
    indexing another tensor (``ab = alpha_bar[t][:, None]`` reads ``alpha_bar``)."""
    arg = call_argument(ev.code, ["sqrt", "rsqrt"])
    name = arg.strip() if arg is not None else ""
    if not re.fullmatch(r"[A-Za-z_]\w*", name):
        return None
    made = _assigned_before(ev.source, name)
    if made is None:
        return None
    try:
        node: ast.expr = ast.parse(made.split("=", 1)[1].strip(), mode="eval").body
    except (SyntaxError, IndexError):
        return None
    node, seen = under_views(node, _VIEWS)  # alpha_bar[t][:, None], table[t].view(-1, 1)
    if not seen or not isinstance(node, (ast.Name, ast.Attribute)):
        return None
    return made.strip(), ast.unparse(node)


_ROOT_CONSTANT = (
    "sqrt(x) is not a real number for negative x: PyTorch returns NaN. No parameter went "
    "into the base: it is not a prediction but a constant or data your code built (a "
    "schedule, a table indexed by step), and it holds negative entries. Softplus does not "
    "apply, nothing here is learned, and a clamp at 0 only hides the wrong entries: fix "
    "the formula that builds it (a table meant to stay in [0, 1], such as a cumulative "
    "product of factors in (0, 1], left it)."
)


def _constant_root_fix(ev: OpEvent, read: tuple[str, str] | None) -> str:
    """Check the constant where it is built (the table the base was read from, when the
    code shows it); the clamp only as a stopgap."""
    arg = call_argument(ev.code, ["sqrt", "rsqrt"])
    table = read[1] if read is not None else (arg.strip() if arg else "x")
    clamp = rewrite_call(ev.code, ["sqrt", "rsqrt"], lambda v: f"{paren(v)}.clamp_min(0)")
    return "\n".join(
        [
            f"assert ({paren(table)} >= 0).all(), {paren(table)}.min()   # right where {table} "
            "is built: it holds negative entries, and the root of each is NaN",
            f"# then fix the formula that builds {table}, not this line",
            *([f"# only as a stopgap: {clamp.strip()}"] if clamp else []),
        ]
    )


def _positive_where_made(
    ev: OpEvent, arg: str | None
) -> tuple[str, str, str, str, str | None] | None:
    """(the name, its value, that value passed through softplus, its line, the unpacking
    statement or None) when
    ``arg`` (what a log or a root was given, as the line writes it) is a plain name the
    function assigned, unconditionally, from a model's or a layer's call (``rate =
    m(x)``, ``mu = self.head(h).squeeze(-1)``): made positive there, every use of it is,
    where wrapping the one use on the line leaves the others as they were (a Tweedie
    loss's ``mu.pow(1 - p)`` and ``mu.pow(2 - p)``). A name unpacked from such a call
    (``mu, sigma = m(x)``) is made positive right after the unpacking: its value is then
    the call, its softplus that of the name. None for a value computed by arithmetic or by
    a torch function: softplus would change what it means."""
    name = (arg or "").strip()
    if not re.fullmatch(r"[A-Za-z_]\w*", name):
        return None
    unpacked = _unpacked_from_call(ev, name)  # the nearest assignment, when it unpacks
    found = _unconditional_assignment_at(ev, name) if unpacked is None else None
    if unpacked is not None:
        _, value, where = unpacked
    elif found is not None:
        value, where = found
    else:
        return None
    inner, _ = under_views(value, _VIEWS)
    library = ("torch", "F", "nn", "math", "np")  # torch.sub(a, b): computed, no layer's output
    if not isinstance(inner, ast.Call) or ast.unparse(inner.func).split(".")[0] in library:
        return None
    f = "torch.nn.functional." if _lacks_f(ev.source) else "F."
    if unpacked is not None:  # mu, sigma = m(x): the element made positive right after
        return name, ast.unparse(value), f"{f}softplus({name})", where, unpacked[0]
    return name, ast.unparse(value), f"{f}softplus({ast.unparse(value)})", where, None


def _unpacked_from_call(ev: OpEvent, name: str) -> tuple[str, ast.expr, str] | None:
    """(the statement, its value, its line) when the nearest assignment of ``name`` above
    the line, in the same function and not under an ``if``/``for``, unpacks a call's
    result into names (``mu, sigma = m(x)``); None otherwise."""
    import linecache

    path, _, num = (ev.source or "").rpartition(":")
    if not path or not num.isdigit():
        return None
    here = linecache.getline(path, int(num))
    indent = len(here) - len(here.lstrip())
    target = re.compile(rf"^\s*\(?[\w\s,*()\[\]]*\b{re.escape(name)}\b[\w\s,*()\[\]]*=(?!=)")
    for n in range(int(num) - 1, max(0, int(num) - 40), -1):
        text = linecache.getline(path, n)
        body = text.lstrip()
        if not body.strip() or body.startswith("#"):
            continue
        if re.match(r"(?:async\s+)?def\s", body) and len(text) - len(body) < indent:
            return None
        for stmt in statements(text):
            if not target.match(stmt):
                continue
            if len(text) - len(body) > indent or _HEADER_LINE.match(body):
                return None  # conditional: it may not have run
            try:
                node = ast.parse(stmt.strip()).body[0]
            except (SyntaxError, IndexError):
                return None
            if not isinstance(node, ast.Assign):
                continue  # f(a, sigma, k=3): a call with a keyword, no assignment
            bound = {t.id for tg in node.targets for t in ast.walk(tg) if isinstance(t, ast.Name)}
            if name not in bound:
                continue  # x[sigma] = ...: read, not assigned
            tgt = node.targets[0]
            names = tgt.elts if isinstance(tgt, (ast.Tuple, ast.List)) else []
            if (
                len(node.targets) != 1
                or not names
                or not all(isinstance(e, ast.Name) for e in names)
            ):
                return None  # a plain assignment (the caller's case), a starred or nested one
            return stmt.strip(), node.value, f"{path}:{n}"
    return None


def _made_at(made: tuple[str, str, str, str, str | None]) -> str:
    """Where :func:`_positive_where_made`'s line goes: at the assignment, or right after
    the unpacking."""
    name, _, _, where, unpacked = made
    if unpacked is not None:
        return f"a new line right after {where} ({unpacked}), where {name} is made"
    return f"at {where}, where {name} is made"


def _negative_root_fix(ev: OpEvent) -> str:
    """A positive parameterization of the values the sqrt was given: where the name the
    line uses is made, when that is a model's output assigned above; else on the user's
    line when it is known."""
    got: list[str] = []
    stmt = next((st for st in statements(ev.code) if "sqrt" in st), None)
    arg = call_argument(stmt, ["sqrt"]) if stmt else None
    if arg is None and _rewrite_base(ev.code, lambda b: b, got, ev) is not None and got:
        arg = got[0]
    made = _positive_where_made(ev, arg)
    own = rewrite_call(ev.code, ["sqrt"], lambda v: f"F.softplus({v})")
    if own is None:
        own = _rewrite_base(ev.code, lambda b: f"F.softplus({b})", [], ev)
    head = (
        f"{made[0]} = {made[2]}   # {_made_at(made)}: softplus keeps it "
        "positive for every use of it"
        if made is not None
        else f"{own}   # softplus keeps them positive"
        if own
        else "# the root's argument, where the network predicts it: F.softplus of the raw "
        "output (> 0)"
    )
    return (
        f"{head}; use the same at inference\n"
        "# or predict the log: w = raw.exp() (a log link), and work with logs instead of "
        "roots or powers\n"
        "# not .clamp_min(0) or relu: it zeroes the gradient of every negative prediction, "
        "and a negative power of 0 is inf"
    )


_ROOT_BACKWARD = (
    "sqrt(0) = 0 is a fine forward value, but the derivative 1 / (2·sqrt(x)) is inf at "
    "x = 0, and autograd multiplies it by the gradient of what fed the sqrt: ±inf, or "
    "inf × 0 = NaN where that gradient is 0. Any argument that reaches exactly 0 does this: "
    "a product or ratio that is 0 (of a clamped or ReLU-made quantity), a norm of a zero "
    "vector, a distance between identical samples, x ** 0.5; the forward pass never shows "
    "a bad value, and the next optimizer step makes every weight NaN."
)

_ROOT_FIX_BACKWARD = (
    "norm = torch.linalg.vector_norm(x, dim=-1)   # a pattern: dim= the dim your sum of "
    "squares runs over (-1 only if it is the last); not (x ** 2).sum(dim).sqrt(): its "
    "gradient at 0 is 0\n"
    "dist = F.pairwise_distance(x1, x2)   # a distance over the last dim, not ((x1 - x2) ** "
    "2).sum(-1).sqrt(): eps=1e-6 inside\n"
    "norm = ((x ** 2).sum(-1) + 1e-12).sqrt()   # or eps inside the sqrt, summed over the same "
    "dim: off exact 0\n"
    "std = torch.sqrt(v + 1e-4)   # v a variance (z.var(dim=0)): eps inside the sqrt\n"
    "y = torch.sqrt(a.clamp_min(1e-12))   # any other argument a that reaches 0 (a product "
    "or ratio): a floor inside the sqrt"
)


def _root_backward_fix(node: str, e: object, dtype: str | None) -> str:
    """The fix for an infinite derivative at 0: a power keeps its base off 0; a sqrt of a
    squared distance becomes a norm whose gradient at 0 is defined."""
    if node == "Pow" and isinstance(e, (int, float)) and not isinstance(e, bool):
        dt = f"torch.{dtype}" if dtype else "x.dtype"
        return (
            f"eps = torch.finfo({dt}).eps\n"
            f"y = x.clamp_min(eps) ** {e}   # was x ** {e}: its gradient {e}·x^({e} - 1) is "
            "inf at 0\n"
            "# a focal-style (1 - p) ** gamma: (1 - p).clamp_min(eps) ** gamma"
        )
    return _ROOT_FIX_BACKWARD


def _forward_exponent(ev: OpEvent, e: object) -> float | None:
    """The exponent the user's forward ``x ** p`` used, for a PowBackward0 event: the event
    of a node carries it as is (``aten.pow``, read from what the node saved); the pow that
    the backward ran (``aten.pow.Tensor_Scalar`` under forensic) computes x ** (p - 1), and
    only a negative exponent there makes inf at 0. The user's line settles it when one of
    its constant exponents is e or e + 1 (``d ** 3`` beside ``x ** (1 / 3)``: 1/3 for
    e = -2/3); None for a tensor exponent."""
    if not isinstance(e, (int, float)) or isinstance(e, bool):
        return None
    ran = ev.op.startswith("aten.pow.")  # the backward's own pow: x ** (p - 1)
    if ev.source and ev.source != ev.backward_at:
        shown = {p for st in statements(ev.code) for _, _, p in _powers(st) if p is not None}
        for want in (float(e) + 1, float(e)) if ran else (float(e), float(e) + 1):
            hit = [p for p in shown if math.isclose(p, want, rel_tol=1e-6, abs_tol=1e-9)]
            if len(hit) == 1:
                return hit[0]
    return float(e) + 1 if ran and e < 0 else float(e)


def _number(n: ast.expr) -> float | None:
    """The value of a constant exponent: ``2``, ``-0.5``, ``(1 / 3)``; None otherwise."""
    if isinstance(n, ast.Constant):
        v = n.value
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
        v = _number(n.operand)
        return None if v is None else -v if isinstance(n.op, ast.USub) else v
    if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        a, b = _number(n.left), _number(n.right)
        if a is None or b is None or (isinstance(n.op, ast.Div) and b == 0):
            return None
        if isinstance(n.op, ast.Add):
            return a + b
        if isinstance(n.op, ast.Sub):
            return a - b
        return a * b if isinstance(n.op, ast.Mult) else a / b
    return None


def _symbolic(n: ast.expr) -> bool:
    """An exponent held by a name or an attribute: ``gamma``, ``self.gamma``."""
    while isinstance(n, ast.Attribute):
        n = n.value
    return isinstance(n, ast.Name)


def _powers(stmt: str) -> list[tuple[ast.expr, ast.expr, float | None]]:
    """Each power in ``stmt`` whose exponent is a constant (``2``, ``(1 / 3)``) or held by
    a name (``self.gamma``, p None): (the whole power, its base, p) for ``x ** p``,
    ``x.pow(p)`` and ``torch.pow(x, p)``. A base that is a number (``2 ** k``) is no
    tensor's power and is left out."""
    try:
        tree = ast.parse(stmt)
    except SyntaxError:
        return []
    out: list[tuple[ast.expr, ast.expr, float | None]] = []
    for n in ast.walk(tree):
        base: ast.expr | None = None
        exp: ast.expr | None = None
        if not isinstance(n, ast.expr):
            continue
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow):
            base, exp = n.left, n.right
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and not n.keywords:
            if n.func.attr == "pow" and ast.unparse(n.func.value) == "torch" and len(n.args) == 2:
                base, exp = n.args
            elif n.func.attr == "pow" and len(n.args) == 1:
                base, exp = n.func.value, n.args[0]
        if base is None or exp is None or _number(base) is not None:
            continue
        if (p := _number(exp)) is not None or _symbolic(exp):
            out.append((n, base, p))
    return out


def _power_at(ev: OpEvent, p: float) -> tuple[str, ast.expr, ast.expr] | None:
    """The power on the user's forward line whose backward failed: (statement, the whole
    power, its base). The one whose constant exponent is ``p`` (``xyz ** (1 / 3)``, not the
    ``d ** 3`` of its condition); else the one whose exponent is a name (``(1 - p_t) **
    self.gamma``); None when the line is unknown or several fit."""
    if not ev.source or ev.source == ev.backward_at:
        return None
    found = [(st, n, b, q) for st in statements(ev.code) for n, b, q in _powers(st)]
    same = [
        (st, n, b)
        for st, n, b, q in found
        if q is not None and math.isclose(q, p, rel_tol=1e-6, abs_tol=1e-9)
    ]
    named = [(st, n, b) for st, n, b, q in found if q is None]
    for pick in (same, named):
        if len(pick) == 1:
            return pick[0]
        if pick:
            return None
    return None


def _rebased(whole: str, power: ast.expr, base: ast.expr, b: str, safe: str) -> str | None:
    """The power's source ``whole`` with its base ``b`` replaced by ``safe`` (which brings
    its own parentheses: the base's grouping ones go, ``(1 - p).clamp_min(eps) ** g``, not
    ``((1 - p).clamp_min(eps)) ** g``); None when the base is not found where the AST says."""
    a = (base.col_offset or 0) - (power.col_offset or 0)
    z = (base.end_col_offset or 0) - (power.col_offset or 0)
    if not 0 <= a <= z <= len(whole) or whole[a:z] != b:
        return None
    i, j = a - 1, z
    while i >= 0 and whole[i] == " ":
        i -= 1
    while j < len(whole) and whole[j] == " ":
        j += 1
    grouped = isinstance(power, ast.BinOp) and i >= 0 and j < len(whole)
    if grouped and whole[i] == "(" and whole[j] == ")" and whole[:i].strip() == "":
        a, z = i, j + 1
    return whole[:a] + safe + whole[z:]


def _exponent_text(p: float) -> str:
    """An exponent as the user would write it: ``2``, ``0.5``, ``(1 / 3)`` for the
    0.333... a node saved, never a rounded ``0.3333`` that changes the power."""
    if float(p).is_integer():
        return str(int(p))
    r = repr(float(p))
    if len(r) <= 7:
        return r
    f = Fraction(p).limit_denominator(64)
    if math.isclose(float(f), p, rel_tol=1e-9):
        return f"({f.numerator} / {f.denominator})"
    return r


def _negative_base(x: TensorStat | None, p: float) -> bool:
    """The base of a fractional power ``x ** p`` (the first input of its backward) holds
    negative numbers: x ** p and its derivative are NaN there, whatever 0 does."""
    return x is not None and x.min < 0 and not float(p).is_integer()


def _in_where_branch(stmt: str, node: ast.expr) -> bool:
    """``node`` sits in a value branch of a ``torch.where(cond, a, b)`` of ``stmt``."""
    try:
        tree = ast.parse(stmt)
    except SyntaxError:
        return False
    for n in ast.walk(tree):
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "where"
            and len(n.args) == 3
        ):
            for branch in n.args[1:]:
                for m in ast.walk(branch):
                    if (
                        isinstance(m, ast.expr)
                        and (m.col_offset, m.end_col_offset)
                        == (node.col_offset, node.end_col_offset)
                        and ast.dump(m) == ast.dump(node)
                    ):
                        return True
    return False


def _negative_power_backward(ev: OpEvent, p: float) -> tuple[str, str]:
    """Why a fractional power of a negative base made a NaN gradient although the forward
    pass was finite (the NaN entries were discarded: a torch.where branch, a mask), and the
    user's power with its base clamped inside, so the discarded entries stay finite: x ** p
    with p > 1 has a finite derivative at 0 (clamp to 0); p < 1 needs the base off 0."""
    q = fmt(p)
    slope = f"{q}·x^({fmt(p - 1)})"
    masked = False
    fix: str | None = None
    if (at := _power_at(ev, p)) is not None:
        stmt, power, base = at
        b = ast.get_source_segment(stmt, base) or ast.unparse(base)
        whole = ast.get_source_segment(stmt, power) or ast.unparse(power)
        lo = "0" if p > 1 else f"torch.finfo({_dtype_of(base, b)}).eps"
        safe = f"{paren(b)}.clamp_min({lo})"
        masked = _in_where_branch(stmt, power)
        if (inner := _rebased(whole, power, base, b, safe)) is not None:
            new = inner if masked else f"torch.where({paren(b)} > 0, {inner}, 0)"
            fix = (
                f"{_spliced(stmt, power, new)}   # the base clamped inside the power: the "
                "discarded entries are finite, so their gradient is 0, not NaN"
            )
    if fix is None:
        dt = f"torch.{ev.dtype}" if ev.dtype else "x.dtype"
        lo = "0" if p > 1 else f"torch.finfo({dt}).eps"
        k = _exponent_text(p)
        fix = (
            f"y = x.clamp_min({lo}) ** {k}   # was x ** {k}, the base clamped inside the "
            "power (inside the torch.where branch, before the mask; the condition stays as "
            "it is): the discarded entries are finite, so their gradient is 0, not NaN"
        )
    where = (
        "torch.where still computes the masked branch for every entry and backward "
        "differentiates it"
        if masked
        else "the NaN entries were discarded after the power (a torch.where, a mask), but "
        "backward still differentiates the power at every entry"
    )
    return (
        f"x ** {q} of a negative number is NaN (a negative base to a fractional power), and "
        f"so is its derivative {slope}. The forward pass hides it: {where}. The discarded "
        "entries get gradient 0, and autograd multiplies it by that NaN derivative: "
        "0 × NaN = NaN, and the next optimizer step makes every weight NaN. Clamp the base "
        "inside the branch (x.clamp_min(0) ** p; the where's condition alone does not help), "
        "so the discarded entries are finite.",
        fix,
    )


def _power_backward_text(p: float) -> str:
    """Why ``x ** p`` at x = 0 made a NaN gradient, with the user's own exponent."""
    q = fmt(p)
    slope = f"{q}·x^({fmt(p - 1)})"
    if p < 0:
        return (
            f"x ** {q} is inf at x = 0 already in forward: a count or a degree of 0 (a node "
            "whose edge weights are all 0), an empty bag, a zero norm. Something after the "
            "power replaced that inf (a masked_fill(y == inf, 0), a torch.where, an indexed "
            "assignment), so the forward pass looks finite; backward does not see the "
            "replacement: the replaced entries get gradient 0, and autograd multiplies it "
            f"by the power's derivative {slope}, inf at 0: 0 × inf = NaN. The next "
            "optimizer step makes every weight NaN."
        )
    return (
        f"x ** {q} = 0 at x = 0 is a fine forward value, but its derivative {slope} is inf "
        "there, and autograd multiplies it by the gradient of what fed the power (0 for a "
        "row that was masked or constant): inf × 0 = NaN. The forward pass never shows a "
        "bad value, and the next optimizer step makes every weight NaN."
    )


def _power_backward_fix(ev: OpEvent, p: float) -> str:
    """The user's power computed only where its base is off 0, with the base clamped inside
    (the double where: the discarded branch has a finite gradient, so 0 × it stays 0); 0
    where the base is 0, which is what masking the inf gave."""
    q = fmt(p)
    why = (
        "0 where the base is 0, what masking the inf gave; its gradient there is 0, not NaN"
        if p < 0
        else "0 at 0 as before; its gradient there is 0, not NaN"
    )
    signed = float(p).is_integer()  # x ** -1 is defined below 0: keep those rows
    if (at := _power_at(ev, p)) is not None:
        stmt, power, base = at
        b = ast.get_source_segment(stmt, base) or ast.unparse(base)
        whole = ast.get_source_segment(stmt, power) or ast.unparse(power)
        if signed:
            cond, safe = f"{paren(b)} != 0", f"torch.where({paren(b)} != 0, {b}, 1)"
        else:
            eps = f"torch.finfo({_dtype_of(base, b)}).eps"
            cond, safe = f"{paren(b)} > 0", f"{paren(b)}.clamp_min({eps})"
        if (inner := _rebased(whole, power, base, b, safe)) is not None:
            return f"{_spliced(stmt, power, f'torch.where({cond}, {inner}, 0)')}   # {why}"
    dt = f"torch.{ev.dtype}" if ev.dtype else "x.dtype"
    k = _exponent_text(p)
    if signed:
        return f"y = torch.where(x != 0, torch.where(x != 0, x, 1) ** {k}, 0)   # {why}"
    return (
        f"eps = torch.finfo({dt}).eps\n"
        f"y = torch.where(x > 0, x.clamp_min(eps) ** {k}, 0)   # was x ** {k}: its gradient "
        f"{q}·x^({fmt(p - 1)}) is inf at 0; {why}"
    )


_VARIANCE = re.compile(r"(?:\.|\btorch\.)(?:var|std|var_mean|std_mean)\(|\bvariance\b|\bvar\b")
_DISTANCE = re.compile(r"\*\*\s*2|\.pow\(\s*2\s*\)|\.square\(|\bsquare\(")


def _root_backward_own(ev: OpEvent) -> tuple[str, str] | None:
    """The explanation and fix for an infinite sqrt gradient at 0 on the user's line (the
    forward line of the node, not the backward() call): a variance or std under the root
    gets an eps inside it (VICReg's sqrt(var + 1e-4)); a squared distance a clamp; anything
    else a clamp too. None when the line is unknown or holds no sqrt."""
    if not ev.source or ev.source == ev.backward_at:
        return None
    stmt = next((st for st in statements(ev.code) if "sqrt" in st), None)
    arg = call_argument(stmt, ["sqrt", "rsqrt"])
    if arg is None:
        return None
    addend = _addend(stmt)
    if _VARIANCE.search(arg):
        if addend is not None and not re.fullmatch(r"[\d.e+-]+", addend):
            inner = re.sub(rf"\+\s*{re.escape(addend)}\s*$", "+ 1e-4", arg)
            note = f" ({addend} was 0 here)"
        else:
            inner, note = f"{arg} + 1e-4", ""
        method = re.search(r"(?<!torch)\.r?sqrt_?\(", stmt or "") is not None
        fixed = rewrite_call(stmt, ["sqrt", "rsqrt"], lambda v: f"({inner})" if method else inner)
        return (
            "sqrt(0) = 0 is a fine forward value, but the derivative 1 / (2·sqrt(x)) is inf "
            "at x = 0, and what is under this sqrt is a variance: a feature that is "
            "constant over the batch (collapsed embeddings, dead units, a batch of one) has "
            "variance exactly 0, so its standard deviation has an infinite gradient and "
            "the next optimizer step makes every weight NaN. An eps inside the sqrt (VICReg "
            "uses 1e-4) keeps the gradient finite.",
            f"{fixed}   # eps inside the sqrt{note}: its gradient at a zero variance is finite",
        )
    if _DISTANCE.search(arg):
        return _squares_under_root(stmt, arg, ev.dtype)
    fixed, each = _rewrite_each_call(
        stmt, ["sqrt", "rsqrt"], lambda v: f"{paren(v)}.clamp_min(1e-12)"
    )
    return _ROOT_BACKWARD, f"{fixed}   # keep {each} off exact 0: its gradient there is inf"


def _rewrite_each_call(
    code: str | None, names: Sequence[str], wrap: Callable[[str], str]
) -> tuple[str | None, str]:
    """:func:`rewrite_call` of every call to one of ``names`` on the user's line, and how the
    fix's comment names them: a backward node's input statistics do not say which of a
    line's several roots (``(a * a).sum(-1).sqrt() * (b * b).sum(-1).sqrt()``, a cosine by
    hand) was given the 0, so each is rewritten ("each sqrt"); one call, or the part of the
    line that ran known, as :func:`rewrite_call` ("the sqrt").

    >>> _rewrite_each_call("c = u / (x.sqrt() * torch.sqrt(y))", ["sqrt"], lambda v: f"f({v})")
    ('c = u / (f(x).sqrt() * torch.sqrt(f(y)))', 'each sqrt')
    """
    found = list(_calls_of(code, names)) if code else []
    if len(found) < 2 or getattr(code, "span", None) is not None:
        return rewrite_call(code, names, wrap), "the sqrt"
    line = str(code)
    for i in reversed(range(len(found))):
        now = list(_calls_of(line, names))
        if len(now) != len(found):
            return rewrite_call(code, names, wrap), "the sqrt"
        _, _, head, arg, tail = now[i]
        line = head + wrap(arg) + tail
    return line, "each sqrt"


def _complex_parts(arg: str) -> str | None:
    """``z`` of ``z.real ** 2 + z.imag ** 2`` (any way of squaring): the squared magnitude
    of a complex tensor; None for anything else."""
    try:
        node = ast.parse(arg.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)):
        return None
    a, b = _squared(node.left), _squared(node.right)
    if not (isinstance(a, ast.Attribute) and isinstance(b, ast.Attribute)):
        return None
    if {a.attr, b.attr} != {"real", "imag"} or ast.dump(a.value) != ast.dump(b.value):
        return None
    return ast.get_source_segment(arg.strip(), a.value) or ast.unparse(a.value)


def _root_call(stmt: str) -> ast.Call | None:
    """The one ``torch.sqrt(...)`` / ``x.sqrt()`` call of ``stmt``; None for none or several."""
    try:
        tree = ast.parse(stmt)
    except SyntaxError:
        return None
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, (ast.Attribute, ast.Name))
        and (n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id) == "sqrt"
    ]
    return calls[0] if len(calls) == 1 else None


def _squares_under_root(stmt: str | None, arg: str, dtype: str | None) -> tuple[str, str] | None:
    """A sum of squares under the user's sqrt that is not a difference (a - b: the norm and
    pairwise_distance fixes apply): the magnitude of a complex number, ``z.abs()``, or the
    user's own expression with an eps inside the sqrt."""
    if stmt is None or not stmt.isascii():
        return None
    try:
        tree = ast.parse(arg.strip(), mode="eval")
    except SyntaxError:
        return None
    if any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub) for n in ast.walk(tree)):
        return _squared_difference_under_root(stmt, tree.body, dtype)
    parts = _complex_parts(arg)
    call = _root_call(stmt)
    if parts is not None and call is not None:
        return (
            "sqrt(0) = 0 is a fine forward value, but the derivative 1 / (2·sqrt(x)) is inf "
            "at x = 0: this is the magnitude of a complex tensor (real² + imag²), which is 0 "
            "wherever the signal is 0 (digital silence, padding, a zeroed band), and "
            "autograd multiplies that inf by the 0 gradient of the squares: inf × 0 = NaN. "
            "torch.abs of a complex tensor computes the same magnitude with a gradient of 0 "
            "there.",
            f"{_spliced(stmt, call, f'{paren(parts)}.abs()')}   # |z| of a complex tensor: "
            "same value, its gradient at 0 is 0, not NaN",
        )
    eps = "1e-12" if not _stored_as_zero(1e-12, dtype) else (_eps_floor(dtype) or "1e-8")
    method = re.search(r"(?<!torch)\.r?sqrt_?\(", stmt) is not None
    fixed, each = _rewrite_each_call(
        stmt, ["sqrt"], lambda v: f"({v} + {eps})" if method else f"{v} + {eps}"
    )
    if fixed is None:
        return None
    return (
        _ROOT_BACKWARD,
        f"{fixed}   # eps inside {each}: finite gradient where the sum of squares is 0",
    )


def _squared_difference_under_root(
    stmt: str, arg: ast.expr, dtype: str | None
) -> tuple[str, str] | None:
    """The square of one difference under the user's sqrt, elementwise (nothing summed
    under the root: ``((a - b) ** 2).sqrt()``, Charbonnier's loss without its eps): an eps
    inside the sqrt, or the difference's abs(), which is the same value; None for a
    distance, a sum of squared differences (the norm and pairwise_distance fixes apply)."""
    diff = _squared(arg)
    if not (isinstance(diff, ast.BinOp) and isinstance(diff.op, ast.Sub)):
        return None
    eps = "1e-12" if not _stored_as_zero(1e-12, dtype) else (_eps_floor(dtype) or "1e-8")
    method = re.search(r"(?<!torch)\.r?sqrt_?\(", stmt) is not None
    fixed = rewrite_call(stmt, ["sqrt"], lambda v: f"({v} + {eps})" if method else f"{v} + {eps}")
    if fixed is None:
        return None
    d = ast.unparse(diff)
    return (
        _ROOT_BACKWARD,
        f"{fixed}   # eps inside the sqrt: finite gradient where {d} is 0 (Charbonnier's "
        f"loss: sqrt(d ** 2 + eps ** 2))\n# or ({d}).abs(): the same value as the sqrt of "
        "its square, with a gradient of 0 at 0",
    )


def _root_forward_text(e: object) -> str:
    what = f"x ** {e}" if e is not None else "sqrt(x)"
    return (
        f"{what} is not a real number for negative x: PyTorch returns NaN. Values that "
        "should be non-negative come out slightly negative from rounding (a variance "
        "computed as E[x²] - E[x]²), and activations such as x ** 1.5 are simply undefined "
        "for the negative half of their input."
    )


def _unclipped(node: ast.expr) -> ast.expr:
    """The value under ``torch.relu(x)``, ``x.relu()``, ``x.abs()``, ``x.clamp_min(0)`` or
    ``x.clamp(min=0)``: what a floor for a negative power applies to (relu and a clamp at 0
    leave exact zeros, 0 ** -k = inf; abs flips the sign of the negative ones)."""
    while isinstance(node, ast.Call):
        f, args = node.func, node.args
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        method = isinstance(f, ast.Attribute) and ast.unparse(f.value) not in _MODULES
        if method and isinstance(f, ast.Attribute):
            recv = f.value
            at_zero = (name == "clamp_min" and len(args) == 1) or (
                name == "clamp"
                and not args
                and any(k.arg == "min" for k in node.keywords)
                and all(k.arg == "min" for k in node.keywords)
            )
            if name in ("relu", "abs") and not args:
                node = recv
                continue
            if at_zero:
                v = args[0] if args else node.keywords[0].value
                if isinstance(v, ast.Constant) and v.value == 0:
                    node = recv
                    continue
            return node
        if name in ("relu", "abs") and len(args) == 1:
            node = args[0]
            continue
        return node
    return node


def _unclipped_text(expr: str) -> str:
    """:func:`_unclipped` of an expression's text (``torch.relu(v)`` -> ``v``)."""
    try:
        return ast.unparse(_unclipped(ast.parse(expr.strip(), mode="eval").body))
    except SyntaxError:
        return expr


def _negative_power_floor(code: str | None, e: object, eps: str) -> str | None:
    """The user's line with the base of its negative power floored at ``eps``
    (``evals.pow(-0.5)`` -> ``evals.clamp_min(1e-6).pow(-0.5)``), any relu, abs or sign
    around that base dropped (``torch.relu(v) ** -0.5`` and ``v.sign() * v.abs() ** -0.5``
    -> ``v.clamp_min(1e-6) ** -0.5``): a floor keeps every value finite and positive."""
    for stmt, tree in _parsed(code):
        powers: list[tuple[ast.expr, ast.expr, str]] = []  # (node, base, exponent text)
        for n in ast.walk(tree):
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow):
                powers.append((n, n.left, ast.unparse(n.right)))
            elif isinstance(n, ast.Call) and len(n.args) >= 1:
                f = n.func
                if isinstance(f, ast.Attribute) and f.attr == "pow" and len(n.args) == 1:
                    powers.append((n, f.value, ast.unparse(n.args[0])))
                elif ast.unparse(f) == "torch.pow" and len(n.args) == 2:
                    powers.append((n, n.args[0], ast.unparse(n.args[1])))
        want = fmt(float(e)) if isinstance(e, (int, float)) else None
        negative = [
            pw
            for pw in powers
            if pw[2].lstrip("(").startswith("-") or (want is not None and pw[2] == want)
        ]
        if len(negative) != 1:
            continue
        node, base, k = negative[0]
        inner = _unclipped(base)
        text = ast.get_source_segment(stmt, inner) or ast.unparse(inner)
        floored = f"{paren(text)}.clamp_min({eps}) ** {k}"
        target: ast.expr = node
        for m in ast.walk(tree):  # x.sign() * x.abs() ** -k: the sign goes too
            if isinstance(m, ast.BinOp) and isinstance(m.op, ast.Mult):
                for sgn, pw in ((m.left, m.right), (m.right, m.left)):
                    if (
                        pw is node
                        and isinstance(sgn, ast.Call)
                        and isinstance(sgn.func, ast.Attribute)
                        and sgn.func.attr == "sign"
                        and ast.unparse(sgn.func.value) == ast.unparse(inner)
                    ):
                        target = m
        return _spliced(stmt, target, floored)
    return None


def _rsqrt_floor(code: str | None, eps: str) -> str | None:
    """The user's line with the input of its one rsqrt floored at ``eps``
    (``torch.diag(L.rsqrt())`` -> ``torch.diag(L.clamp_min(1e-5).rsqrt())``,
    ``torch.rsqrt(v)`` -> ``torch.rsqrt(v.clamp_min(1e-5))``); None without exactly one."""
    for stmt, tree in _parsed(code):
        calls: list[tuple[ast.Call, ast.expr]] = []
        for n in ast.walk(tree):
            if not isinstance(n, ast.Call) or not isinstance(n.func, ast.Attribute):
                continue
            if n.func.attr != "rsqrt":
                continue
            if ast.unparse(n.func.value) == "torch" and len(n.args) == 1:
                calls.append((n, n.args[0]))
            elif ast.unparse(n.func.value) != "torch" and not n.args:
                calls.append((n, n.func.value))
        if len(calls) != 1:
            continue
        _, base = calls[0]
        inner = _unclipped(base)
        text = ast.get_source_segment(stmt, inner) or ast.unparse(inner)
        return _spliced(stmt, base, f"{paren(text)}.clamp_min({eps})")
    return None


def _power_eps(dtype: str | None) -> str:
    """The floor for the base of a negative power: 1e-6, or a normal number of a 16-bit
    dtype whose tiny is above it (1e-4 in float16)."""
    lim = limits(dtype)
    if lim is not None and lim.tiny > 1e-6:
        return _eps_floor(dtype) or "1e-4"
    return "1e-6"


def _root_forward_fix(
    e: object, *, measured: bool = True, code: str | None = None, dtype: str | None = None
) -> str:
    """``measured``: the input's minimum is known, and it is a rounding error (else the
    fix of :func:`_negative_root_fix` applies). A negative power (whitening's ``evals **
    -0.5``) gets a floor on the user's own line: relu or a signed power leave 0 ** -k = inf."""
    if isinstance(e, (int, float)) and not isinstance(e, bool) and e < 0:
        eps = _power_eps(dtype)
        own = _negative_power_floor(code, e, eps)
        if own is not None:
            return (
                f"{own}   # a negative power needs a base above 0: values at 0 or slightly "
                "below it (rounding) are floored, not zeroed (relu: 0 ** -k = inf) nor "
                "flipped (sign·|x|)"
            )
        return (
            f"y = x.clamp_min({eps}) ** {e}   # a negative power needs a base above 0: a "
            "floor, not relu (0 ** -k = inf) nor sign·|x|"
        )
    own_rsqrt = _rsqrt_floor(code, "1e-5") if e is None else None
    if own_rsqrt is not None:
        return (
            f"{own_rsqrt}   # rsqrt needs its input above 0: values at 0 or slightly below "
            "it (rounding) are floored at 1e-5, an eps as in LayerNorm; every larger value is "
            "unchanged"
        )
    if e is not None:
        return (
            f"y = x.sign() * x.abs() ** {e}     # a signed power, defined everywhere\n"
            f"y = torch.relu(x) ** {e}          # or only the positive part"
        )
    if not measured:  # how far below 0 is unknown: both causes
        return (
            "y = torch.sqrt(v.clamp_min(0) + 1e-12)   # v slightly negative from rounding\n"
            "w = F.softplus(raw)   # v a prediction, negative in its own right: keep it > 0\n"
            "# not .clamp_min(0) there: it zeroes the gradient of every negative prediction"
        )
    own = (
        rewrite_call(code, ["sqrt"], lambda v: f"{paren(v)}.clamp_min(0) + 1e-5")
        if e is None and code and len(re.findall(r"\bsqrt\(", code.split("  #", 1)[0])) == 1
        else None
    )
    if own is not None:  # the user's own root: a std of E[x²] - E[x]² (a statistics pooling)
        return (
            f"{own}   # rounding made the argument slightly negative: floored at 0, and an "
            "eps as in LayerNorm keeps sqrt's gradient finite where it is 0 (a constant "
            "input)\n# or compute the variance two-pass, ((x - mean) ** 2).mean(): never "
            "below 0"
        )
    return (
        "y = torch.sqrt(v.clamp_min(0) + 1e-12)   # rounding made v slightly negative\n"
        "y = torch.rsqrt(v + 1e-5)                # eps as in LayerNorm"
    )


def _root_backward_untraced(ctx: RuleContext, a: Anomaly) -> Iterator[Diagnosis]:
    trace = ctx.trace
    calls = {c.id for c in trace.calls if c.path == a.path}
    hit: Record | None = None
    for r in trace.records:
        if r.phase is not Phase.FORWARD or r.call not in calls:
            continue
        node = node_base(r.grad_fn)
        if node in _ROOT_NODES:
            hit = r
            if r.stat is None or r.stat.min == 0.0 or r.stat.zeros:
                break
    if hit is None:
        return
    m = exact(trace, hit)
    s = m.stat if m is not None else None
    zeros = s is not None and (s.min == 0.0 or bool(s.zeros))
    g = a.record
    upstream = [
        r
        for r in trace.records
        if r.phase is Phase.BACKWARD and r.call in calls and r.stat is not None and r.stat.finite
    ]
    evidence = []
    if upstream:
        evidence.append(
            f"the gradient of {a.path}'s output was finite (max |g| "
            f"{fmt(upstream[0].stat.amax if upstream[0].stat else None)}); the gradient it "
            f"passed back to {g.path} ({g.role}) holds "
            f"{g.stat.kinds() if g.stat else 'NaN'}"
            + (f" ({g.stat.nan:,} NaN of {g.stat.numel:,})" if g.stat and g.stat.nan else "")
        )
    evidence.append(
        f"{a.path}'s {hit.role} was made by {hit.grad_fn}"
        + (f" and holds exact zeros (min {fmt(s.min)})" if zeros and s is not None else "")
        + ": d/dx sqrt(x) = 1/(2·sqrt(x)) is inf at 0, and inf × 0 = NaN"
    )
    evidence.append(untraced_hint(ctx))
    yield ctx.diagnosis(
        **anomaly_fields(a),
        evidence=evidence,
        explanation=_ROOT_BACKWARD,
        fix=_ROOT_FIX_BACKWARD,
        priority=14 if zeros else 18,
    )


# ---------------------------------------------------------------------- NW113


@rule(
    "NW113",
    title="Mean or variance over too few elements",
    severity="error",
    summary=(
        "A mean over 0 elements (an empty mask, a batch whose every target is ignore_index "
        "or whose class weights sum to 0) is 0/0 = NaN; an unbiased std/var of 1 element "
        "divides by N - 1 = 0."
    ),
    priority=12,
)
def too_few_elements(ctx: RuleContext) -> Iterator[Diagnosis]:
    a = ctx.anomaly
    if a is None or a.transient:
        return
    cause = cause_of(a)
    if cause is None or cause.kind != "reduce":
        return
    ev = cause.event
    sf = shortfall(ev)
    if sf is None:
        return
    op = short_op(ev.op)
    evidence: list[str] = []
    if sf.kind == "var":
        x = input_named(ev, "self", "input")
        n = _n(sf.per_output)
        c = _n(sf.correction)
        evidence.append(
            f"{op} with correction={c} reduced {n} element{'s' if n != '1' else ''} into each "
            f"output ({count(x.numel, 'value') if x else '?'} into "
            f"{count(sf.outputs or 0, 'output')}): it divides by N - correction = "
            f"{_n((sf.per_output or 0) - (sf.correction or 0))}"
        )
        batch = _batch_size(ctx)
        single = sf.per_output == 1 and batch is not None and batch > 1
        activation = _std_of_activation(ev, a.record.module_type) if single else None
        if activation is not None:  # one element of an activation (a 1x1 feature map)
            evidence.append(
                f"this batch has {batch} samples: the reduced dimensions of "
                f"{activation[0]} hold one element each (a feature map or sequence of size "
                "1), not a batch of one and not a weight"
            )
            explanation = (
                "std and var divide the summed squared deviations by N - correction, and "
                "here N = 1: the correction=1 default divides by 0. The reduction is over "
                "dimensions of an activation that hold a single element (a 1x1 feature map: "
                "an input too small for the network's downsampling), so no DataLoader "
                "setting changes it. The population variance plus an eps is finite at N = 1 "
                "(std eps**0.5), or keep the reduced dimensions at 2 or more (a feature map "
                "at least 2x2)."
            )
            fix = activation[1]
        elif single:  # one element reduced while the batch holds several: not the batch
            evidence.append(
                f"this batch has {batch} samples: the element reduced is not a batch of "
                "one (a weight's fan-in or a feature dimension of size 1)"
            )
            explanation = (
                "std and var divide the summed squared deviations by N - correction, and "
                "here N = 1: the correction=1 default divides by 0. The reduction is over "
                "dimensions that hold a single element whatever the batch (weight "
                "standardization of a layer whose fan-in is 1, a norm over a feature of size "
                "1), so no DataLoader setting changes it, and correction=0 is no cure: x - "
                "x.mean() over one element is 0, and every standardized value (every weight) "
                "would be 0."
            )
            fix = _single_element_fix(a.record.module_type)
        else:
            explanation = (
                "std and var divide the summed squared deviations by N - correction. The "
                "default correction=1 (Bessel's, unbiased) makes one element a division by "
                "0: NaN. A batch of one sample reduced over the batch dimension does this (the "
                "last, smaller batch of an epoch, batch_size=1 at evaluation)."
            )
            fix = _var_fix(ev)
    elif sf.kind == "nll" and _empty_batch(sf):
        evidence += _nll_evidence(ev, sf)
        explanation = (
            "With reduction='mean', cross-entropy and NLL divide the summed loss by the "
            "number (total weight) of the targets. This batch holds no sample at all (an "
            "empty draw: a replay buffer that is still empty, a selection that picked "
            "nothing), so the loss is 0/0 = NaN; backward then makes every gradient NaN. "
            "Compute the loss only when the batch holds a sample."
        )
        fix = _nll_fix(ctx, a, ev, sf)
    elif sf.kind == "nll":
        evidence += _nll_evidence(ev, sf)
        explanation = (
            "With reduction='mean', cross-entropy and NLL divide the summed loss by the "
            "total weight of the targets that count. Targets equal to ignore_index (padding, "
            "unlabeled pixels) count 0, so a batch where every target is ignored -- or whose "
            "targets' classes all have weight 0 -- divides 0 by 0 and the loss is NaN; "
            "backward then makes every gradient NaN."
        )
        shift = _labels_shift(ctx)
        if shift is not None:
            arg, shape, k = shift
            evidence.append(
                f"the model was given {arg} {shape} with {k} label"
                f"{'s' if k != 1 else ''} that count{'s' if k == 1 else ''}, all at position "
                "0 of the last dimension: the model shifts its labels by one before the loss "
                "(position t is scored on label t + 1), so no target counts"
            )
            explanation += (
                " The model shifts the labels by one (a causal LM predicts the next token), so "
                "the label at position 0 is never a target: a check on the labels as given, "
                f"(labels != {sf.ignore_index if sf.ignore_index is not None else -100}).any(), "
                "passes on this batch; check the shifted labels, labels[..., 1:]."
            )
        fix = _nll_fix(ctx, a, ev, sf)
    else:
        what = "mean" if sf.kind == "mean" else f"{op} with reduction='mean'"
        evidence.append(
            f"{what} of an empty tensor (0 values) into "
            f"{count(sf.outputs or 0, 'output')}: sum / count = 0/0 = NaN"
        )
        explanation = (
            "A mean divides a sum by a count. When the selection is empty -- a boolean mask "
            "that picked nothing in this batch (no valid token, no positive sample), an empty "
            "batch -- the count is 0 and the mean is NaN. It happens on the rare batch, so "
            "training runs fine until then."
        )
        fix = _mean_fix(ctx, a, ev, sf)
        sliced = _slice_mean(ev.code) if sf.kind == "mean" else None
        tail = _tail_slice_mean(ev.code) if sf.kind == "mean" and sliced is None else None
        if tail is not None:
            said, explanation, fix = tail
            evidence[-1] = f"{said} ({count(sf.outputs or 0, 'output')}): sum / 0 = 0/0 = NaN"
        if sliced is not None:
            lo, hi, fix = sliced
            explanation = (
                f"A mean divides a sum by a count. The line averages over the slice "
                f"{lo}:{hi}, which is empty when {hi} <= {lo} (a segment whose end rounded "
                "onto its start, a window at the end of a sequence): the count is 0 and "
                "the mean is 0/0 = NaN. Keep at least one element in the slice, or skip the "
                "empty segment."
            )
    evidence += _chain_evidence(ev, cause.trigger, ev.born)
    yield ctx.diagnosis(**op_fields(ev, a), evidence=evidence, explanation=explanation, fix=fix)


def _labels_shift(ctx: RuleContext) -> tuple[str, tuple[int, ...], int] | None:
    """The guards' finding that the model the loss ran inside shifts its labels by one and
    the labels it was given count only at position 0 (see ``guards._shifted_labels``): the
    argument's name, its shape and its number of labels that count."""
    for n in reversed(ctx.notes("loss_input")):
        got = n.data.get("labels_shifted")
        if isinstance(got, dict) and isinstance(got.get("counting"), int):
            shape = tuple(int(d) for d in got.get("shape") or ())
            return str(got.get("arg") or "labels"), shape, int(got["counting"])
    return None


def _n(x: float | None) -> str:
    if x is None:
        return "?"
    return str(int(x)) if float(x).is_integer() else fmt(x)


def _nll_evidence(ev: OpEvent, sf: Shortfall) -> list[str]:
    op = short_op(ev.op)
    t = sf.targets
    out: list[str] = []
    if sf.all_ignored and t is not None:
        out.append(f"all {t.numel:,} targets equal ignore_index={sf.ignore_index}")
    elif sf.per_output == 0:
        out.append(f"{op} got an empty batch (0 values)")
    elif sf.weight is not None:
        out.append(
            "the class weights of this batch's targets sum to 0 "
            f"(weight: {describe_stat(sf.weight)})"
        )
    elif t is not None:
        out.append(f"targets: min {fmt(t.min)}, max {fmt(t.max)} ({t.numel:,} values)")
    tw = fmt(sf.total_weight) if sf.total_weight is not None else "0"
    out.append(
        f"{op} with reduction='mean' divides the summed loss by the total target weight "
        f"{tw}: 0/0 = NaN"
    )
    return out


def _nll_fix(ctx: RuleContext, a: Anomaly, ev: OpEvent, sf: Shortfall) -> str:
    """The loss rewritten with reduction='sum' and divided by what counts (at least 1, or
    the weight of the counted targets), keeping the loss's other options (a label_smoothing,
    class weights: the guard's note has them in the user's names) and the user's own input
    and target when the line shows them."""
    kind = f"{a.record.module_type} {a.path} {ev.code or ''}".lower()
    fn = "F.nll_loss" if "nll" in kind and "crossentropy" not in kind else "F.cross_entropy"
    ii = sf.ignore_index if sf.ignore_index is not None else -100
    code = ev.code or _loss_line(ctx)
    site = _loss_site(ctx, a, ev, code, lambda n: loss_kind(n) in ("ce", "nll"))
    if site is not None and site.inside:
        return _model_loss_fix(site, ii, sf, shifted=_labels_shift(ctx) is not None)
    if site is not None and not site.functional and site.term:
        return _module_term_fix(site, ii, sf)
    summed = _summed_call(code, site.segment if site is not None else None)
    if summed is not None:
        y, wt = paren(summed.target), summed.weight
        if wt is not None and sf.weight is not None:
            den = f"{paren(wt)}[{y}[{y} != {ii}]].sum().clamp_min(1e-12)"
            why = "0, not NaN, when no target counts or the batch weighs nothing"
        elif sf.weight is None:
            den, why = f"({y} != {ii}).sum().clamp_min(1)", "0, not NaN, when no target counts"
        else:
            den = None
        if den is not None:
            # the loss term alone divided by its own count: the line's other terms (another
            # task's loss) keep their own reduction
            line = summed.with_term(f"{summed.call} / {den}") + f"   # {why}"
            if summed.alone and summed.assigned:
                line += (
                    f"\n# or skip the batch: if ({y} != {ii}).any(): {summed.assigned}.backward()"
                )
            elif wt is not None and not sf.all_ignored:
                line += "\n# or give every class a weight > 0"
            return line
    if site is not None and _empty_batch(sf):  # not a term the lines above rewrite
        return _empty_batch_fix(site)
    opts = _loss_options(ctx, ev, a)
    weight = re.match(r"weight=([^,]+)", opts) if opts else None
    found = (site.x, site.y) if site is not None else _loss_args(ev.code, opts)
    x, y = found or ("logits", "y")
    head = ""
    if not re.fullmatch(r"[\w.]+", y):
        # a name of its own: the user's function may use ``t`` already (a decoder's input
        # tokens, read again after the loss line)
        src = ev.source if ev.code else _loss_note_source(ctx)
        t = fresh_name("t", identifiers(f"{code or ''} {x}") | _names_of_function(src))
        head, y = f"{t} = {y}\n", t
    keep = f"{opts}, " if opts else ""
    w: str | None = weight.group(1) if weight is not None else None
    if w is None and sf.weight is not None:  # weights the guard did not name
        keep, w = "weight=w, ", "w"
        head = "# w: the class weights given to the loss\n" + head
    if _lacks_f(ev.source if ev.code else _loss_note_source(ctx)):
        fn = fn.replace("F.", "torch.nn.functional.", 1)  # F is no name in the user's file
    # the user's statement around a loss module's call (``crit(o, t) / K``): the rest of it
    # is kept, with the summed loss over its count in place of the call
    around = (
        (site.stmt, site.segment, site.assigned)
        if site is not None and not site.functional
        else _call_of(code, *found)
        if site is None and found is not None
        else None
    )
    rest = around is not None and _more_than(around[0], around[1])
    name = "loss"
    if rest:
        assert around is not None
        name = fresh_name("ce" if "cross" in fn else "nll", set(re.findall(r"\w+", around[0])))
    call = f"{name} = {fn}({x}, {y}, {keep}ignore_index={ii}, reduction='sum')\n"
    if w is not None:
        den = f"{w}[{y}[{y} != {ii}]].sum().clamp_min(1e-12)"
        why = "0, not NaN, when no target counts or the batch weighs nothing"
    else:
        den, why = f"({y} != {ii}).sum().clamp_min(1)", "0 when no target counts"
    if rest:
        assert around is not None
        stmt, segment, assigned = around
        last = stmt.replace(segment, f"({name} / {den})", 1) + f"   # {why}\n"
        target = assigned or "loss"
    else:
        last, target = f"loss = loss / {den}   # {why}\n", "loss"
    return (
        head
        + call
        + last
        + (
            f"# or skip the batch: if ({y} != {ii}).any(): {target}.backward()"
            if w is None or sf.all_ignored
            else "# or give every class a weight > 0"
        )
    )


def _names_of_function(source: str | None) -> set[str]:
    """The variable names the body of the user's function holding line ``source`` reads or
    assigns (strings and attributes left out); empty when it cannot be read or parsed."""
    import textwrap

    lines = _function_lines(source)
    try:
        tree = ast.parse(textwrap.dedent("".join(text for _, text in lines)))
    except (SyntaxError, ValueError):
        return set()
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def _call_of(code: str | None, x: str, y: str) -> tuple[str, str, str | None] | None:
    """The statement of ``code`` that calls a loss with input ``x`` and target ``y`` as
    written, the call's text, and the name the statement assigns; None when none does."""
    for stmt, tree in _parsed(code):
        top = tree.body[0] if len(tree.body) == 1 else None
        assigned = None
        if isinstance(top, ast.Assign) and len(top.targets) == 1:
            assigned = top.targets[0].id if isinstance(top.targets[0], ast.Name) else None
        for c in _post_order(tree):
            if _xy(stmt, c) == (x, y) and (seg := ast.get_source_segment(stmt, c)):
                return stmt, seg, assigned
    return None


def _more_than(stmt: str, segment: str) -> bool:
    """``stmt`` computes more than ``segment`` alone (``loss = crit(o, t) / K``, not
    ``loss = crit(o, t)`` nor ``return crit(o, t)``)."""
    try:
        top = ast.parse(stmt).body[0]
    except (SyntaxError, IndexError):
        return False
    value = getattr(top, "value", None)
    if not isinstance(top, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return, ast.Expr)):
        return False
    if isinstance(top, ast.AugAssign):
        return True
    return value is not None and ast.get_source_segment(stmt, value) != segment


def _loss_note_source(ctx: RuleContext) -> str | None:
    """The ``file.py:42`` of the step's class-index loss call, from its guard note."""
    for n in ctx.notes("loss_input"):
        name = n.data.get("loss")
        if loss_kind(name if isinstance(name, str) else n.path) in ("ce", "nll") and n.source:
            return n.source
    return None


def _in_loop(source: str | None) -> bool:
    """Line ``source`` (``train.py:42``) runs in the body of a ``for``/``while`` loop of
    its own function (or of the module's top level): a ``continue`` there skips the batch.
    False when it does not, or when the file cannot be read and parsed."""
    parsed = _source_tree(source)
    if parsed is None:
        return False
    tree, line = parsed

    def walk(node: ast.AST, looped: bool) -> bool | None:
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.stmt):
                continue
            end = child.end_lineno or child.lineno
            if not child.lineno <= line <= end:
                continue
            scope = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            here = (
                False if scope else looped or isinstance(child, (ast.For, ast.AsyncFor, ast.While))
            )
            inner = walk(child, here)
            return here if inner is None else inner
        return None

    return bool(walk(tree, False))


def _empty_batch(sf: Shortfall) -> bool:
    """The class loss got no sample at all (an empty draw from a replay buffer, an empty
    selection): not targets that were ignored or weigh nothing."""
    t = sf.targets
    return (sf.per_output == 0 or (t is not None and t.numel == 0)) and not sf.all_ignored


def _empty_batch_fix(site: _LossSite) -> str:
    """The user's statement run only when its batch holds a sample, in the user's names: an
    accumulation (``loss = loss + crit(out, y)``, ``loss += ...``) keeps its other terms;
    a loss call that is one term of a larger expression becomes 0 for an empty batch; a
    loss that is the whole value skips the step."""
    y = paren(site.y)
    cond = f"{y}.numel()"
    why = "an empty batch adds nothing, not NaN; the other terms are kept"
    try:
        top = ast.parse(site.stmt).body[0]
    except (SyntaxError, IndexError):
        top = None
    accum = isinstance(top, ast.AugAssign) or (
        isinstance(top, ast.Assign)
        and len(top.targets) == 1
        and isinstance(top.value, ast.BinOp)
        and ast.unparse(top.targets[0])
        in {ast.unparse(n) for n in (top.value.left, top.value.right)}
    )
    if accum:
        return f"if {cond}:   # {why}\n    {site.stmt}"
    if (
        isinstance(top, (ast.Assign, ast.AugAssign, ast.AnnAssign))
        and (ast.get_source_segment(site.stmt, top.value) if top.value is not None else None)
        != site.segment
    ):
        term = f"({site.segment} if {cond} else 0)"
        return site.stmt.replace(site.segment, term, 1) + f"   # {why}"
    if isinstance(top, ast.Return) and not _in_loop(site.source):
        x = paren(site.x)
        return (
            f"if not {cond}:   # an empty batch has no loss: 0, not NaN (backward still runs)\n"
            f"    return {x}.sum() * 0\n" + site.stmt
        )
    if not _in_loop(site.source):  # no loop to continue: 0 for an empty batch
        x = paren(site.x)
        term = f"({site.segment} if {cond} else {x}.sum() * 0)"
        return site.stmt.replace(site.segment, term, 1) + "   # 0, not NaN, for an empty batch"
    return (
        f"if not {cond}:\n    continue   # an empty batch has no loss: skip the step\n" + site.stmt
    )


def _loss_line(ctx: RuleContext) -> str | None:
    """The user's line of the step's class-index loss call, read from the file its guard
    note names (functional losses run where no op event records the line)."""
    import linecache

    for n in ctx.notes("loss_input"):
        name = n.data.get("loss")
        if loss_kind(name if isinstance(name, str) else n.path) not in ("ce", "nll"):
            continue
        path, _, num = (n.source or "").rpartition(":")
        if path and num.isdigit():
            text = linecache.getline(path, int(num)).strip()
            if text:
                return text
    return None


@dataclass(frozen=True)
class _Summed:
    """The user's class-index loss call rewritten with ``reduction='sum'``."""

    stmt: str  #: the user's statement
    segment: str  #: the call's text in it
    call: str  #: the call with every argument kept and ``reduction='sum'``
    target: str  #: the target expression
    weight: str | None  #: the ``weight=`` expression (None when not given)
    #: the call may take a ``/`` without parentheses (a term of a sum, the whole value)
    bare: bool
    alone: bool  #: the call is the statement's whole value (``loss = F.cross_entropy(...)``)
    assigned: str | None  #: the name the statement assigns, when one

    def with_term(self, term: str) -> str:
        """The statement with the call replaced by ``term``."""
        return self.stmt.replace(self.segment, term if self.bare else f"({term})", 1)


#: parents under which ``call / n`` needs no parentheses (``a + call / n``, ``w * call / n``)
_BARE_PARENTS = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return, ast.Expr, ast.Call)


def _summed_call(code: str | None, segment: str | None = None) -> _Summed | None:
    """The user's ``F.cross_entropy(...)`` / ``F.nll_loss(...)`` call with every argument
    they gave kept and ``reduction='sum'``, where it sits in its statement; ``segment``:
    the text of the call that failed, when the line makes several."""
    for stmt in statements(code):
        try:
            tree = ast.parse(stmt)
        except SyntaxError:
            continue
        parents = {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or len(node.args) < 2:
                continue
            if ast.unparse(node.func).split(".")[-1] not in _CLASS_LOSSES:
                continue
            kw = [k for k in node.keywords if k.arg != "reduction"]
            args = [ast.unparse(v) for v in node.args[:2]]
            args += [f"{k.arg}={ast.unparse(k.value)}" for k in kw if k.arg is not None]
            args.append("reduction='sum'")
            seg = ast.get_source_segment(stmt, node)
            if seg is None:
                return None
            if segment is not None and seg != segment:
                continue
            parent = parents.get(id(node))
            bare = isinstance(parent, (*_BARE_PARENTS, ast.UnaryOp, ast.keyword)) or (
                isinstance(parent, ast.BinOp)
                and (
                    isinstance(parent.op, (ast.Add, ast.Sub, ast.Mult))
                    or (isinstance(parent.op, ast.Div) and parent.left is node)
                )
            )
            top = tree.body[0] if len(tree.body) == 1 else None
            alone = isinstance(top, (ast.Assign, ast.AnnAssign)) and top.value is node
            assigned = None
            if isinstance(top, ast.Assign) and len(top.targets) == 1:
                target = top.targets[0]
                assigned = target.id if isinstance(target, ast.Name) else None
            return _Summed(
                stmt=stmt,
                segment=seg,
                call=f"{ast.unparse(node.func)}({', '.join(args)})",
                target=args[1],
                weight=next((ast.unparse(k.value) for k in kw if k.arg == "weight"), None),
                bare=bare,
                alone=alone,
                assigned=assigned,
            )
    return None


def _loss_options(ctx: RuleContext, ev: OpEvent, a: Anomaly) -> str:
    """The loss's options besides ignore_index and reduction, from this loss's note."""
    paths = {p for p in (ev.path, a.path) if p}
    notes = [n for n in ctx.notes("loss_input") if "loss_options" in n.data]
    for n in sorted(notes, key=lambda n: n.path not in paths):
        opts = n.data.get("loss_options")
        return opts if isinstance(opts, str) else ""
    return ""


def _loss_args(code: str | None, opts: str) -> tuple[str, str] | None:
    """The user's input and target expressions of the loss call on ``code``: a call of the
    criterion the options name (``crit.weight`` -> ``crit(...)``) or of cross_entropy /
    nll_loss, else the only outermost call given two arguments; None when the line shows
    none, or several."""
    if not code:
        return None
    line = code.split("  #", 1)[0].strip()
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None
    owner = re.match(r"weight=([\w.]+)\.weight\b", opts or "")
    inner = {
        id(n)
        for c in ast.walk(tree)
        if isinstance(c, ast.Call)
        for v in [*c.args, *(k.value for k in c.keywords)]
        for n in ast.walk(v)
    }
    named: list[tuple[str, str]] = []
    outer: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        args = [ast.get_source_segment(line, v) for v in node.args[:2]]
        kw = {k.arg: ast.get_source_segment(line, k.value) for k in node.keywords}
        x = args[0] if args else kw.get("input")
        y = args[1] if len(args) > 1 else kw.get("target")
        if not (x and y):
            continue
        f = ast.unparse(node.func)
        if (owner is not None and f == owner.group(1)) or f.split(".")[-1] in _CLASS_LOSSES:
            named.append((x, y))
        elif id(node) not in inner:
            outer.append((x, y))
    found = named or outer
    return found[0] if len(found) == 1 else None


_CLASS_LOSSES = ("cross_entropy", "nll_loss")


@dataclass(frozen=True)
class _LossSite:
    """Where the loss that failed was called on the user's line."""

    stmt: str  #: the statement
    segment: str  #: the loss call's text in it (the model call's, when ``inside``)
    x: str  #: its input expression (``""`` when ``inside``)
    y: str  #: its target expression (the labels given to the model, when ``inside``)
    callee: str  #: the called function or module as written (``F.cross_entropy``, ``ce``)
    functional: bool  #: ``F.cross_entropy(...)``, not a call of a loss module
    #: the line calls no loss: it ran inside a call of the line (a model that computes its
    #: own loss from the labels it is given, as Hugging Face models do)
    inside: bool
    assigned: str | None  #: the name the statement assigns (``out`` of ``out = model(...)``)
    #: the call is one term of a sum with other calls (``bce(a, b) + ce(x, y)``): it can be
    #: replaced by 0 alone
    term: bool = False
    source: str | None = None  #: where the statement is, ``train.py:42``


def _post_order(node: ast.AST) -> Iterator[ast.Call]:
    """The calls under ``node`` in the order Python makes them (arguments first)."""
    for child in ast.iter_child_nodes(node):
        yield from _post_order(child)
    if isinstance(node, ast.Call):
        yield node


def _xy(stmt: str, node: ast.Call) -> tuple[str, str] | None:
    args = [ast.get_source_segment(stmt, v) for v in node.args[:2]]
    kw = {k.arg: ast.get_source_segment(stmt, k.value) for k in node.keywords}
    x = args[0] if args else kw.get("input")
    y = args[1] if len(args) > 1 else kw.get("target")
    return (x, y) if x and y else None


def _functional(node: ast.Call) -> bool:
    """A call of a torch function (``torch.where``, ``F.pad``) or a tensor method
    (``x.view(a, b)``): not a call of a loss module."""
    import torch

    f = ast.unparse(node.func)
    head = f.split(".", 1)[0]
    return head in ("torch", "F", "nn") or (
        isinstance(node.func, ast.Attribute) and hasattr(torch.Tensor, node.func.attr)
    )


def _note_name(n: Note) -> str:
    name = n.data.get("loss")
    return name if isinstance(name, str) else n.path


def _loss_site(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, code: str | None, family: Callable[[str], bool]
) -> _LossSite | None:
    """The call on ``code`` of the loss that failed, matched with the guards' notes: a call
    of the loss function the note names, or of the watched loss module (by its name, else
    by the order the line calls its losses in); ``inside`` when the line calls no such loss
    and the note was written from this line (the loss ran in a library's code). None when
    the line does not tell."""
    notes = ctx.notes("loss_input")
    paths = {p for p in (ev.path, a.path) if p}
    mine = [n for n in notes if n.path in paths] or [n for n in notes if family(_note_name(n))]
    note = next((n for n in reversed(mine) if _empty_input(n)), mine[-1] if mine else None)
    where = ev.source if code and code == ev.code else note.source if note is not None else None
    for stmt in statements(code):
        try:
            tree = ast.parse(stmt)
        except SyntaxError:
            continue
        top = tree.body[0] if len(tree.body) == 1 else None
        assigned = None
        if isinstance(top, ast.Assign) and len(top.targets) == 1:
            t = top.targets[0]
            assigned = t.id if isinstance(t, ast.Name) else None
        calls = [(c, xy) for c in _post_order(tree) if (xy := _xy(stmt, c)) is not None]
        site: tuple[ast.Call, tuple[str, str]] | None = None
        functional = True
        if note is not None:
            name = _note_name(note)
            same = [n for n in notes if n.source == note.source and _note_name(n) == name]
            k = next((i for i, n in enumerate(same) if n is note), 0)
            if "." in name or name[:1].islower():  # a loss function: F.cross_entropy
                fn = name.rsplit(".", 1)[-1]
                named = [c for c in calls if _callee(c[0]) == fn]
                site = named[min(k, len(named) - 1)] if named else None
            else:  # a loss module, called by the name the user gave it
                functional = False
                cands = [c for c in calls if not _functional(c[0])]
                last = note.path.rsplit(".", 1)[-1]
                by_name = [c for c in cands if _callee(c[0]) == last]
                on_line = [n for n in notes if n.source == note.source and not _functional_name(n)]
                if by_name:
                    site = by_name[min(k, len(by_name) - 1)]
                elif len(on_line) == len(cands) and note in on_line:
                    site = cands[on_line.index(note)]
        else:
            named = [c for c in calls if family(_callee(c[0]))]
            site = named[0] if len(named) == 1 else None
        if site is not None:
            seg = ast.get_source_segment(stmt, site[0]) or ""
            callee = ast.unparse(site[0].func)
            term = _a_term(tree, site[0])
            return _LossSite(stmt, seg, *site[1], callee, functional, False, assigned, term, where)
        if (
            note is not None
            and _functional_name(note)
            and not any(family(_callee(c)) for c in _post_order(tree))
            and note.source is not None
            and ev.code is not None
            and _linecache_line(note.source) == ev.code.strip()
        ):
            model = next(
                (c for c in _post_order(tree) if not _functional(c) and (c.args or c.keywords)),
                None,
            )
            if model is None:
                return None
            seg = ast.get_source_segment(stmt, model) or ""
            made = _made_by(where, ast.unparse(model.func))
            xy = _xy(stmt, model)
            if made is not None and family(made) and xy is not None:  # a loss module's call
                callee, term = ast.unparse(model.func), _a_term(tree, model)
                return _LossSite(stmt, seg, *xy, callee, False, False, assigned, term, where)
            y = _labels_arg(stmt, model)
            callee = ast.unparse(model.func)
            return _LossSite(stmt, seg, "", y, callee, True, True, assigned, source=where)
    return None


def _made_by(source: str | None, name: str) -> str | None:
    """The class or function whose call the user's file assigns to ``name`` (``ce =
    nn.CrossEntropyLoss()`` -> ``nn.CrossEntropyLoss``; ``self.crit = ...`` for
    ``self.crit``), when every such assignment calls the same one; None otherwise, or when
    the file of ``source`` (``train.py:42``) cannot be read and parsed."""
    import linecache

    path, _, num = (source or "").rpartition(":")
    if not path or not num.isdigit():
        return None
    try:
        tree = ast.parse("".join(linecache.getlines(path)))
    except (SyntaxError, ValueError):
        return None
    made = {
        ast.unparse(n.value.func)
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign)
        and isinstance(n.value, ast.Call)
        and any(ast.unparse(t) == name for t in n.targets)
    }
    return made.pop() if len(made) == 1 else None


def _a_term(tree: ast.AST, node: ast.Call) -> bool:
    """``node`` is added to (multiplied by) another call's value: a sum of losses."""
    parents = {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    parent = parents.get(id(node))
    if not isinstance(parent, ast.BinOp):
        return False
    top: ast.AST = parent
    while isinstance(parents.get(id(top)), ast.BinOp):
        top = parents[id(top)]
    inner = {id(n) for n in ast.walk(node)}
    return any(isinstance(n, ast.Call) and id(n) not in inner for n in ast.walk(top))


def _functional_name(n: Note) -> bool:
    name = _note_name(n)
    return "." in name or name[:1].islower()


def _linecache_line(source: str) -> str:
    import linecache

    path, _, num = source.rpartition(":")
    return linecache.getline(path, int(num)).strip() if path and num.isdigit() else ""


def _empty_input(n: Note) -> bool:
    """The note's loss got no input value or no target that counts."""
    shapes = [n.data.get("input_shape"), n.data.get("target_shape")]
    if any(isinstance(s, list) and 0 in s for s in shapes):
        return True
    t = n.data.get("target_shape")
    ignored = n.data.get("ignored")
    return isinstance(t, list) and isinstance(ignored, int) and ignored == math.prod(t)


def _labels_arg(stmt: str, node: ast.Call) -> str:
    """The labels a model call is given: its ``labels=`` (``target=``) keyword, a
    ``**batch`` mapping's ``"labels"``, an argument named so; ``""`` when none shows."""
    for k in node.keywords:
        if k.arg is not None and re.search(r"label|target", k.arg):
            return ast.get_source_segment(stmt, k.value) or ""
    for v in node.args:
        text = ast.get_source_segment(stmt, v) or ""
        if re.fullmatch(r"[\w.]*(label|target)s?\w*|y|y_\w+|\w+\[['\"]labels['\"]\]", text):
            return text
    for k in node.keywords:
        if k.arg is None and isinstance(k.value, ast.Name):
            return f'{k.value.id}["labels"]'
    return ""


def _module_term_fix(site: _LossSite, ii: int, sf: Shortfall) -> str:
    """The user's call of a class-index loss module, one term of a sum of losses, replaced by
    0 when no target counts: the module keeps its own options (weights, label smoothing)."""
    y = paren(site.y)
    if sf.weight is None:
        cond, why = f"({y} != {ii}).any()", "when no target counts"
    else:
        cond = f"{site.callee}.weight[{y}[{y} != {ii}]].sum() > 0"
        why = "when no target counts or the batch weighs nothing"
    term = f"({site.segment} if {cond} else 0)"
    return site.stmt.replace(site.segment, term, 1) + f"   # 0, not NaN, {why}"


#: the functional losses whose reduction='mean' is their reduction='sum' divided by the
#: input's number of elements (cross-entropy and NLL divide by the targets' total weight)
_ELEMENTWISE_MEAN = frozenset(
    {
        "binary_cross_entropy",
        "binary_cross_entropy_with_logits",
        "mse_loss",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "soft_margin_loss",
    }
)


def _elementwise_mean(callee: str) -> bool:
    """``callee`` (``F.mse_loss``, ``torch.nn.functional.l1_loss``) is such a loss."""
    return callee.rsplit(".", 1)[-1] in _ELEMENTWISE_MEAN


def _empty_loss_fix(site: _LossSite) -> str:
    """The user's statement with its loss call on an empty input made 0, not NaN, and the
    loss unchanged otherwise: an elementwise loss function summed and divided by at least
    1; any other loss guarded by its input's size, the empty case ``x.sum() * 0`` so that
    backward still runs (a ``return`` of the call is preceded by an early return)."""
    x = paren(site.x)
    why = f"0, not NaN, when {site.x} is empty"
    try:
        top: ast.stmt | None = ast.parse(site.stmt).body[0]
    except (SyntaxError, IndexError):
        top = None
    value = getattr(top, "value", None)
    whole = value is not None and ast.get_source_segment(site.stmt, value) == site.segment
    if site.functional and _elementwise_mean(site.callee):
        tree = ast.parse(site.segment, mode="eval").body
        assert isinstance(tree, ast.Call)
        tree.keywords = [k for k in tree.keywords if k.arg != "reduction"]
        tree.keywords.append(ast.keyword("reduction", ast.Constant("sum")))
        term = f"{ast.unparse(tree)} / max({x}.numel(), 1)"
        why += "; the mean otherwise"
    else:
        if isinstance(top, ast.Return) and whole:
            return (
                f"if {x}.numel() == 0:\n"
                f"    return {x}.sum() * 0   # {why} (0 keeps the graph: backward runs)\n"
                + site.stmt
            )
        term = f"{site.segment} if {x}.numel() else {x}.sum() * 0"
    if not whole:
        term = f"({term})"
    return site.stmt.replace(site.segment, term, 1) + f"   # {why}"


def _empty_term_fix(site: _LossSite) -> str:
    """The user's loss call on an empty selection, one term of a sum of losses, made 0, not
    NaN: a loss module's call guarded by the input's size; a loss function summed and
    divided by at least 1."""
    x = paren(site.x)
    if site.functional:
        tree = ast.parse(site.segment, mode="eval").body
        assert isinstance(tree, ast.Call)
        tree.keywords = [k for k in tree.keywords if k.arg != "reduction"]
        tree.keywords.append(ast.keyword("reduction", ast.Constant("sum")))
        term = f"{ast.unparse(tree)} / max({x}.numel(), 1)"
    else:
        term = f"{site.segment} if {x}.numel() else 0"
    return (
        site.stmt.replace(site.segment, f"({term})", 1)
        + "   # 0, not NaN, when the selection is empty"
    )


def _model_loss_fix(site: _LossSite, ii: int, sf: Shortfall, *, shifted: bool = False) -> str:
    """The model computes its loss from the labels it is given: skip a batch with no label
    that counts before the model call, or compute the loss outside the model. ``shifted``:
    the model shifts the labels by one first (a causal LM), the check is on ``[..., 1:]``."""
    y = site.y
    head = ""
    if not y:
        y = "labels"
        head = "# labels: the labels given to the model on this line\n"
    why = "no label counts" if sf.weight is None else "no label weighs anything"
    cond = f"({y} != {ii}).any()"
    if shifted:
        why += " after its shift by one (position 0's label is never a target)"
        cond = f"({paren(y)}[..., 1:] != {ii}).any()"
    skip = (
        f"if not {cond}:\n    continue   # skip this batch before the forward\n"
        if _in_loop(site.source)  # no loop around the line: skip where the batch is drawn
        else f"# skip such a batch in the training loop, before this line runs: if not {cond}\n"
    )
    out = (
        "# the model computes a mean loss over the labels it is given: 0/0 when "
        f"{why}\n" + head + skip + site.stmt
    )
    m = re.fullmatch(r'(\w+)\["labels"\]', y)
    if m is not None and site.assigned and sf.weight is None and site.segment in site.stmt:
        batch, o = m.group(1), site.assigned
        call = site.segment.replace(f"**{batch}", "**inputs")
        if call != site.segment:
            out += (
                "\n# or compute the loss outside the model (a classifier's logits; a causal "
                "LM shifts them):\n"
                f'# inputs = {{k: v for k, v in {batch}.items() if k != "labels"}}\n'
                f"# {o} = {call}\n"
                f"# loss = F.cross_entropy({o}.logits.flatten(0, -2), {y}.flatten(), "
                f"ignore_index={ii}, reduction='sum') / ({y} != {ii}).sum().clamp_min(1)"
            )
    return out


def _batch_size(ctx: RuleContext) -> int | None:
    """The batch's number of samples: the first dimension of the model's first input, when
    it has a dimension besides it (a 1-D input may be one sample's features)."""
    for r in ctx.trace.records:
        if r.phase is not Phase.INPUT or len(r.shape) < 2:
            continue
        call = ctx.trace.call(r.call)
        if call is not None and call.root and not call.is_loss:
            return r.shape[0]
    return None


def _std_of_activation(ev: OpEvent, module_type: str) -> tuple[str, str] | None:
    """The std/var call on the user's line when what it reduces is not a weight: its
    receiver is not module state (``self.weight``, or a name assigned from ``self.``) and
    the module is no torch layer subclass. The call's text and a fix in the user's names:
    ``x.var(dims, unbiased=False).add(1e-5).sqrt()`` for ``x.std(dims)``."""
    if _torch_layer(module_type) is not None:
        return None
    line = (ev.code or "").split("  #", 1)[0].strip()
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None
    for n in ast.walk(tree):
        if not (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("std", "var")
        ):
            continue
        on = n.func.value
        if ast.unparse(on) == "torch":
            if not n.args:
                continue
            on, args = n.args[0], n.args[1:]
        else:
            args = n.args
        root = on
        while isinstance(root, (ast.Attribute, ast.Call, ast.Subscript)):
            root = root.func if isinstance(root, ast.Call) else root.value
        if not isinstance(root, ast.Name) or root.id == "self":
            return None
        made = _assigned_expr(ev.source, root.id)
        if made is not None and "self." in made[0].split("=", 1)[1]:
            return None  # module state (w = self.weight): the weight case
        keep = [k for k in n.keywords if k.arg not in ("unbiased", "correction")]
        call = ast.Call(
            func=ast.Attribute(value=on, attr="var", ctx=ast.Load()),
            args=list(args),
            keywords=[*keep, ast.keyword(arg="unbiased", value=ast.Constant(False))],
        )
        var = ast.unparse(call)
        what = ast.unparse(n)
        new = f"{var}.add(1e-5)" if n.func.attr == "var" else f"{var}.add(1e-5).sqrt()"
        fixed = line.replace(what, new, 1) if what in line else None
        lines = []
        if fixed is not None and fixed != line:
            lines.append(
                f"{fixed}   # was {line}: population variance + eps, finite where the reduced "
                "dimensions hold 1 element"
            )
        else:
            lines.append(f"{new}   # was {what}: population variance + eps")
        lines.append(
            "# or keep the reduced dimensions at 2 or more elements (a feature map at least "
            "2x2: a larger input)"
        )
        return ast.unparse(on), "\n".join(lines)
    return None


def _single_element_fix(module_type: str) -> str:
    """Do not standardize over one element: a plain layer of the kind the module extends
    (``WSConv2d`` -> ``nn.Conv2d``) where the reduced size is 1."""
    plain = _torch_layer(module_type)
    layer = f"a plain {plain}" if plain else "a plain layer"
    return (
        "# a mean/std over a single element has nothing to standardize: x - x.mean() is 0\n"
        "# there, so correction=0 would swap the NaN for all-zero values (every weight 0)\n"
        f"# use {layer} where the reduced dimensions hold 1 element (a fan-in of 1),\n"
        "# and standardize only layers whose reduced dimensions hold more than one"
    )


def _torch_layer(module_type: str) -> str | None:
    """``nn.Conv2d`` for a module type named ``WSConv2d`` (the longest torch.nn layer name
    it ends with), else None."""
    import torch.nn

    for i in range(1, len(module_type)):
        tail = module_type[i:]
        cls = getattr(torch.nn, tail, None)
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module) and tail[0].isupper():
            return f"nn.{tail}"
    return None


_VAR_CALL = re.compile(r"(\.|\btorch\.)(std|var|std_mean|var_mean)\(")


def _guarded_var(code: str | None) -> str | None:
    """The user's line with its one ``x.std(...)`` / ``torch.var(x, ...)`` call taken only
    where the reduced size exceeds 1 (``(x.std() if x.numel() > 1 else 1.0)``): a batch of
    one gets 1.0 (its deviation from the mean is 0 anyway), every other batch is unchanged.
    None when the line shows no such call or its reduced size cannot be written."""
    stmt = (statements(code) or [""])[0].split("  #", 1)[0].rstrip()
    try:
        tree = ast.parse(stmt)
    except SyntaxError:
        return None
    calls = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            if n.func.attr not in ("std", "var"):
                continue
            on_torch = isinstance(n.func.value, ast.Name) and n.func.value.id == "torch"
            args = list(n.args[1:] if on_torch else n.args)
            recv = (n.args[0] if n.args else None) if on_torch else n.func.value
            if recv is not None:
                calls.append((n, recv, args))
    if len(calls) != 1 or not stmt.isascii():
        return None
    call, recv, args = calls[0]
    kw = {k.arg: k.value for k in call.keywords}
    dim = kw.get("dim", args[0] if args else None)
    x = ast.get_source_segment(stmt, recv)
    whole = ast.get_source_segment(stmt, call)
    if x is None or whole is None:
        return None
    if dim is None:
        size = f"{paren(x)}.numel()"
    elif isinstance(dim, ast.Constant) and isinstance(dim.value, int):
        size = f"{paren(x)}.shape[{dim.value}]"
    elif isinstance(dim, ast.UnaryOp) and isinstance(dim.operand, ast.Constant):
        size = f"{paren(x)}.shape[{ast.unparse(dim)}]"
    else:
        return None
    assert call.end_col_offset is not None
    return f"{stmt[: call.col_offset]}({whole} if {size} > 1 else 1.0){stmt[call.end_col_offset :]}"


def _var_fix(ev: OpEvent) -> str:
    fixed = _with_correction0(ev.code)
    added = re.search(r"correction=0[^()]*\)\s*\+\s*(\d[\w.+-]*)", fixed or "")
    eps = (
        f"+ {added.group(1)} keeps a division by it finite"
        if added is not None
        else "where you divide by it, add an eps (+ 1e-5)"
    )
    guarded = _guarded_var(ev.code) if fixed is not None else None
    if guarded is not None and fixed is not None:
        return (
            f"{guarded}   # a reduction over 1 element: its deviation from the mean is 0, "
            "so 1.0 stands in; every larger batch is unchanged\n"
            "# or never reduce over one sample: DataLoader(..., drop_last=True), or skip "
            "the step when the batch holds 1\n"
            "# or the population std, which changes the scale of every batch by sqrt(N / "
            f"(N - 1)) (1.15x at N = 4): {fixed}\n"
            f"#   correction=0 (unbiased=False): N = 1 gives 0, not NaN; {eps}"
        )
    if fixed is None:
        return (
            "s = x.std(dim=0, correction=0)   # N = 1 gives std 0, not NaN (unbiased=False)\n"
            "y = (x - x.mean(0)) / (s + 1e-5)  # dividing by it: keep it off 0, as BatchNorm\n"
            "# or never reduce over one sample: DataLoader(..., drop_last=True)"
        )
    return (
        f"{fixed}\n"
        f"# correction=0 (unbiased=False): N = 1 gives 0, not NaN; {eps}\n"
        "# or never reduce over one sample: DataLoader(..., drop_last=True)"
    )


def _with_correction0(code: str | None) -> str | None:
    """The user's std/var call with ``correction=0`` (replacing ``unbiased=`` or a given
    ``correction=``)."""
    if not code:
        return None
    line = code.split("  #", 1)[0].rstrip()
    m = _VAR_CALL.search(line)
    if m is None:
        return None
    depth, end = 1, None
    for i in range(m.end(), len(line)):
        if line[i] in "([{":
            depth += 1
        elif line[i] in ")]}":
            depth -= 1
            if depth == 0:
                end = i
                break
    if end is None:
        return None
    args = line[m.end() : end]
    if re.search(r"\b(unbiased|correction)\s*=", args):
        args = re.sub(r"\b(unbiased|correction)\s*=\s*[^,)]+", "correction=0", args)
    elif not args.strip():
        args = "correction=0"
    else:
        args = f"{args}, correction=0"
    start = m.start() if m.group(1) != "." else postfix_start(line, m.start() - 1)
    if start is None:
        start = m.start()
    call = line[start : m.end()] + args + ")"
    if line[:start].rstrip().endswith("/"):  # a standardization: keep the division finite
        call = f"({call} + 1e-5)"
    return line[:start] + call + line[end + 1 :]


def _mean_fix(ctx: RuleContext, a: Anomaly, ev: OpEvent, sf: Shortfall) -> str:
    if sf.kind == "loss":
        fn = f"F.{packet(ev.op).rstrip('_')}"  # aten's losses and F's share their names

        def norm(n: str) -> str:
            return n.rsplit(".", 1)[-1].lower().replace("_", "").removesuffix("loss")

        def family(n: str) -> bool:
            k = loss_kind(n)
            return (k is not None and k == loss_kind(fn)) or norm(n) == norm(fn)

        site = _loss_site(ctx, a, ev, ev.code, family)
        if site is not None and site.term:
            return _empty_term_fix(site)
        if site is not None and not site.inside:
            return _empty_loss_fix(site)
        returns = any(st.lstrip().startswith("return ") for st in statements(ev.code))
        head = "return" if returns else "loss ="
        if _elementwise_mean(fn):
            call = f"{fn}(pred, y, reduction='sum') / max(pred.numel(), 1)"
        else:
            call = f"{fn}(pred, y) if pred.numel() else pred.sum() * 0"
        return (
            f"# e.g. {head} {call}   # pred, y the loss's input and target: 0, not NaN, "
            "when pred is empty\n"
            "# or skip the batch: if pred.numel(): loss.backward()"
        )
    own = _mean_own_line(ev.code)
    if own is not None and own[1]:
        was = ev.code.split("  #", 1)[0].strip() if ev.code else ""
        return (
            f"{own[0]}   # was: {was}\n"
            "# x[mask].mean() is the same as x[mask].sum() / max(x[mask].numel(), 1) when "
            "not empty\n"
            "# or skip the batch: if mask.any(): loss.backward()"
        )
    if own is not None:
        return (
            f"{own[0]}   # 0, not NaN, when nothing is selected; the mean otherwise\n"
            "# or skip a batch that selects nothing, before loss.backward()"
        )
    several = _several_means_fix(ev.code)
    if several is not None:
        return several
    returns = any(st.lstrip().startswith("return ") for st in statements(ev.code))
    head = "return" if returns else "loss ="
    return (
        f"# e.g. {head} (x * mask).sum() / mask.sum().clamp_min(1)   # x the values, mask "
        "the selection: 0, not NaN, when the mask is empty\n"
        "# x[mask].mean() is the same as x[mask].sum() / max(x[mask].numel(), 1) when not empty\n"
        "# or skip the batch: if mask.any(): loss.backward()"
    )


def _method_means(tree: ast.AST) -> list[tuple[ast.Call, ast.expr]]:
    """Each ``v.mean(...)`` / ``torch.mean(v, ...)`` of ``tree`` with its ``v``."""
    out: list[tuple[ast.Call, ast.expr]] = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call) or not isinstance(n.func, ast.Attribute):
            continue
        if n.func.attr != "mean":
            continue
        owner = ast.unparse(n.func.value)
        if owner == "torch" and n.args:
            out.append((n, n.args[0]))
        elif owner not in ("torch", "np", "math", "statistics"):
            out.append((n, n.func.value))
    return out


def _several_means_fix(code: str | None) -> str | None:
    """The user's statement that takes several means, one of them over nothing this batch
    (the op's input is empty, and its stats cannot say which): a difference of two groups'
    means (an IPM, a distance between treated and control) is skipped when either group is
    empty, since a 0 for the empty group's mean would be a wrong penalty; the means of a sum
    of terms (a loss per group) each fall back to a sum, 0 over nothing. None when the
    line takes fewer than two means, or is no assignment or return."""
    for stmt in statements(code):
        text = stmt.strip()
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        top = tree.body[0] if len(tree.body) == 1 else None
        value = getattr(top, "value", None)
        if not isinstance(top, (ast.Assign, ast.AnnAssign, ast.Return)) or value is None:
            continue
        means = _method_means(value)
        if len(means) < 2:
            continue
        names = [ast.get_source_segment(text, c) or ast.unparse(c) for c, _ in means]

        def holds(n: ast.AST, call: ast.Call) -> bool:
            return any(m is call for m in ast.walk(n))

        diff = next(
            (
                n
                for n in ast.walk(value)
                if isinstance(n, ast.BinOp)
                and isinstance(n.op, ast.Sub)
                and any(holds(n.left, c) for c, _ in means)
                and any(holds(n.right, c) for c, _ in means)
            ),
            None,
        )
        if diff is not None:
            conds, base = [], None
            for _, v in means:
                if isinstance(v, ast.Subscript) and not isinstance(v.slice, (ast.Slice, ast.Tuple)):
                    sel = ast.get_source_segment(text, v.slice) or ast.unparse(v.slice)
                    conds.append(f"{paren(sel)}.any()")
                    base = base or ast.get_source_segment(text, v.value)
                else:
                    seg = ast.get_source_segment(text, v) or ast.unparse(v)
                    conds.append(f"{paren(seg)}.numel()")
                    base = base or seg
            cond = " and ".join(dict.fromkeys(conds))
            rhs = ast.get_source_segment(text, value) or ast.unparse(value)
            lead = text[: text.index(rhs)] if rhs in text else ""
            return (
                f"{lead}{rhs} if {cond} else {paren(base or 'x')}.new_zeros(())   # a "
                "difference of two groups' means: skip it when a group is empty\n"
                f"# one of {', '.join(names)} is over 0 values this batch; a mean of 0 for the "
                "empty group (a clamped count) would make the difference a wrong penalty\n"
                f"# or skip the term only: compute it under `if {cond}:`"
            )
        fixed = text
        for call, v in sorted(means, key=lambda m: -(m[0].col_offset or 0)):
            whole = ast.get_source_segment(text, call)
            vs = ast.get_source_segment(text, v)
            if whole is None or vs is None or whole not in fixed:
                return None
            rest = (
                [*call.args[1:], *call.keywords] if v in call.args else [*call.args, *call.keywords]
            )
            dims = ", ".join(ast.get_source_segment(text, d) or ast.unparse(d) for d in rest)
            summed = f"{paren(vs)}.sum({dims})"
            fixed = fixed.replace(whole, f"({whole} if {paren(vs)}.numel() else {summed})", 1)
        return (
            f"{fixed}   # a mean over 0 values is NaN: the sum over them is 0\n"
            f"# one of {', '.join(names)} is over 0 values this batch (the op's input is "
            "empty; its stats do not say which)"
        )
    return None


def _mean_of_a_slice(code: str | None) -> Iterator[tuple[str, ast.Call]]:
    """Each statement of ``code`` (ASCII, parsed) that takes exactly one ``.mean`` of a
    subscript (``f[b, :, t0:t1].mean(1)``), with that call."""
    for stmt, tree in _parsed(code):
        means = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "mean"
            and isinstance(n.func.value, ast.Subscript)
        ]
        if len(means) == 1:
            yield stmt.strip(), means[0]


def _slice_mean(code: str | None) -> tuple[str, str, str] | None:
    """``(lo, hi, fix)`` when the user's line takes one mean of a slice ``x[..., lo:hi]``
    (both bounds given, no step): the line with ``lo:max(hi, lo + 1)``, so the slice holds
    one element at least; None for any other line."""
    for text, call in _mean_of_a_slice(code):
        func = call.func
        assert isinstance(func, ast.Attribute)
        sub = func.value
        assert isinstance(sub, ast.Subscript)
        parts = sub.slice.elts if isinstance(sub.slice, ast.Tuple) else [sub.slice]
        slices = [
            p
            for p in parts
            if isinstance(p, ast.Slice)
            and p.lower is not None
            and p.upper is not None
            and p.step is None
            and not isinstance(p.upper, ast.Constant)
        ]
        if len(slices) != 1:
            continue
        sl = slices[0]
        assert isinstance(sl, ast.Slice)
        assert sl.lower is not None
        assert sl.upper is not None
        lo = ast.get_source_segment(text, sl.lower) or ast.unparse(sl.lower)
        hi = ast.get_source_segment(text, sl.upper) or ast.unparse(sl.upper)
        fixed = _spliced(text, sl.upper, f"max({hi}, {paren(lo)} + 1)")
        return (
            lo,
            hi,
            f"{fixed}   # at least one element: {lo}:{hi} is empty when {hi} <= {lo}\n"
            f"# or skip the empty segment: compute this only when {hi} > {lo}",
        )
    return None


def _tail_slice_mean(code: str | None) -> tuple[str, str, str] | None:
    """``(evidence, explanation, fix)`` when the user's line takes one mean along a dim of
    a slice that runs to the end on that dim (``x[:, self.num_prefix:].mean(dim=1)``): the
    dim is empty when the tensor holds no entry past the start; the fix divides the sum by
    the count floored at 1, so an empty dim gives 0, and names the dim. None otherwise."""
    for text, call in _mean_of_a_slice(code):
        func = call.func
        assert isinstance(func, ast.Attribute)
        sub = func.value
        assert isinstance(sub, ast.Subscript)
        parts = sub.slice.elts if isinstance(sub.slice, ast.Tuple) else [sub.slice]
        if any(isinstance(p, ast.Constant) and p.value is Ellipsis for p in parts):
            continue
        at = [
            i
            for i, p in enumerate(parts)
            if isinstance(p, ast.Slice) and p.lower is not None and p.upper is None
        ]
        dims = [k.value for k in call.keywords if k.arg == "dim"] + call.args[:1]
        if len(at) != 1 or len(dims) != 1 or len(call.args) + len(call.keywords) != 1:
            continue
        dim = dims[0]
        if not (isinstance(dim, ast.Constant) and dim.value == at[0]):
            continue
        if any(isinstance(p, ast.Constant) for p in parts):
            continue  # an integer index drops a dim: the positions would not match
        sl = parts[at[0]]
        assert isinstance(sl, ast.Slice)
        assert sl.lower is not None
        lo = ast.get_source_segment(text, sl.lower) or ast.unparse(sl.lower)
        x = ast.get_source_segment(text, sub.value) or ast.unparse(sub.value)
        part = ast.get_source_segment(text, sub) or ast.unparse(sub)
        d = dim.value
        fixed = _spliced(text, call, f"{part}.sum(dim={d}) / max({x}.shape[{d}] - {paren(lo)}, 1)")
        return (
            f"mean along dim {d} of {part}, and that dim has size 0: {x} holds no entry "
            f"past {lo} on dim {d}",
            f"A mean divides a sum by a count. {part} keeps the entries of {x} from {lo} to "
            f"the end of dim {d}, and this batch {x} had none there (size {lo} or less on "
            f"dim {d}: whatever made {x} dropped or cropped all of them, such as a token "
            "dropout that kept 0 tokens), so the mean over dim "
            f"{d} is 0/0 = NaN. Keep at least one entry there where {x} is made; the fix "
            "makes the empty case 0 meanwhile.",
            f"{fixed}   # sum over count, the count at least 1: an empty dim {d} gives 0, "
            "not NaN; unchanged otherwise\n"
            f"# and where {x} is made: keep at least one entry past {lo} on dim {d}",
        )
    return None


def _mean_own_line(code: str | None) -> tuple[str, bool] | None:
    """The user's line with its one full mean (``v.mean()``, ``torch.mean(v)``) written as
    ``v.sum() / max(v.numel(), 1)``, or, for ``x[mask].mean()``, as ``(x * mask).sum() /
    mask.sum().clamp_min(1)`` (True): 0 over an empty selection; None when the line holds
    no such mean, or several."""
    for stmt in statements(code):
        try:
            tree = ast.parse(stmt.strip())
        except SyntaxError:
            continue
        text = stmt.strip()
        means: list[tuple[ast.Call, ast.expr]] = []
        for n in ast.walk(tree):
            if not isinstance(n, ast.Call) or n.keywords or not isinstance(n.func, ast.Attribute):
                continue
            if n.func.attr != "mean":
                continue
            if not n.args and ast.unparse(n.func.value) not in ("torch", "np"):
                means.append((n, n.func.value))
            elif len(n.args) == 1 and ast.unparse(n.func.value) == "torch":
                means.append((n, n.args[0]))
        if len(means) != 1:
            continue
        call, v = means[0]
        seg = ast.get_source_segment(text, v)
        if seg is None:
            continue
        if isinstance(v, ast.Subscript) and isinstance(v.slice, ast.Name):
            x, m = ast.get_source_segment(text, v.value), v.slice.id
            if x is not None:
                masked = f"({paren(x)} * {m}).sum() / {m}.sum().clamp_min(1)"
                return _spliced(text, call, masked), True
        x = paren(seg)
        return _spliced(text, call, f"{x}.sum() / max({x}.numel(), 1)"), False
    return None


# ---------------------------------------------------------------------- NW114


@rule(
    "NW114",
    title="Function outside its domain",
    severity="error",
    summary=(
        "acos/asin of |x| > 1, atanh/erfinv at ±1, acosh below 1, logit/ndtri outside "
        "[0, 1], lgamma/digamma/polygamma at 0, -1, -2, ...: NaN or ±inf from finite "
        "inputs (a cosine that rounded to 1.0000001); and acos/asin/acosh exactly at an "
        "endpoint, where only the gradient is infinite."
    ),
    priority=12,
)
def outside_its_domain(ctx: RuleContext) -> Iterator[Diagnosis]:
    a = ctx.anomaly
    if a is None or a.transient:
        return
    cause = cause_of(a)
    if cause is None:
        if a.kind is AnomalyKind.BACKWARD:
            yield from _domain_backward_untraced(ctx, a)
        return
    if cause.kind != "domain":
        return
    ev = cause.event
    steep = node_domain(ev.node) if ev.phase is Phase.BACKWARD else None
    if steep is not None:
        yield _domain_backward(ctx, a, ev, steep, cause.trigger)
        return
    hit = outside_domain(ev)
    if hit is None:
        return
    dom = hit.domain
    op = short_op(ev.op)
    x = hit.stat
    evidence = [_domain_line(op, hit)]
    near = _rounding(x, dom, ev.dtype)
    if near:
        evidence.append(near)
    evidence.append(f"input {dom.arg} ({ev.dtype}): {_precise_stat(x, dom)}")
    evidence.append(f"{op} made {ev.born}")
    evidence += _chain_evidence(ev, cause.trigger, ev.born)
    far = None if near else _far_outside(x, dom, ev.dtype)
    if far is not None:
        evidence.insert(1, far)
        yield ctx.diagnosis(
            **op_fields(ev, a),
            evidence=evidence,
            explanation=_invalid_text(dom),
            fix=_invalid_fix(ctx, dom),
        )
        return
    yield ctx.diagnosis(
        **op_fields(ev, a),
        evidence=evidence,
        explanation=_domain_text(dom, rounding=bool(near)),
        fix=_domain_fix(ev, dom),
    )


_FAR_STEPS = 1000  # past an endpoint by more than this many float steps: not rounding


def _far_outside(s: TensorStat | None, dom: Domain, dtype: str | None) -> str | None:
    """Evidence when the input lies far past a finite endpoint (acosh of -94): more than
    ``_FAR_STEPS`` of the dtype's float steps, so no rounding error made it; None else."""
    lim = limits(dtype)
    if s is None or lim is None or dom.poles:
        return None
    for value, edge, side in ((s.max, dom.hi, "above"), (s.min, dom.lo, "below")):
        if not (math.isfinite(value) and math.isfinite(edge)) or not dom.outside_of(value):
            continue
        excess = value - edge if side == "above" else edge - value
        step = lim.eps * max(1.0, abs(edge))
        if excess > _FAR_STEPS * step:
            return (
                f"{_precise(value)} is {fmt(excess)} {side} {_fmt_edge(edge)}, "
                f"{fmt(excess / step)} {dtype} rounding steps (eps {fmt(lim.eps)}): not "
                f"rounding, the argument of {dom.name} is wrong"
            )
    return None


_INVALID_WHY = {
    "acosh": (
        "In hyperbolic models it is the Poincaré distance, acosh(1 + 2|u - v|² / ((1 - "
        "|u|²)(1 - |v|²))): once an optimizer step pushes a point to |u| ≥ 1, out of the "
        "unit ball, the denominator turns 0 or negative and the argument falls below 1."
    ),
    "atanh": (
        "In hyperbolic models it takes a norm that must stay below 1 (a point of the "
        "Poincaré ball, tanh⁻¹ of |x|): points that an optimizer step pushed out of the "
        "ball give norms of 1 and more."
    ),
    "acos": (
        "A cosine computed from vectors that were not normalized (a plain dot product) "
        "goes far beyond ±1."
    ),
    "asin": ("A sine or cosine computed from vectors that were not normalized goes far beyond ±1."),
}


def _invalid_text(dom: Domain) -> str:
    return (
        f"{dom.name} is a real number only on {dom.interval}, and its input is far outside, "
        "not a float step or two: the values that feed it are invalid. "
        + _INVALID_WHY.get(dom.name, "Check what produces them.")
        + " A clamp to the domain would hide this: every clamped element gives the same "
        "value and a zero gradient, and training goes on from wrong values."
    )


def _invalid_fix(ctx: RuleContext, dom: Domain) -> str:
    head = f"# the input of {dom.name} is invalid, not rounded: fix what computes it"
    if dom.name in ("acosh", "atanh"):
        params = [q for q in watched_params([ctx.trace]) if q.endswith("weight")]
        w = f"model.{params[0]}" if len(params) == 1 else "emb.weight"
        note = "" if len(params) == 1 else "   # emb: the embedding that holds the points"
        return (
            f"{head}\n"
            "# points must stay inside the unit ball: project them after every opt.step()\n"
            f"with torch.no_grad():{note}\n"
            f"    n = {w}.norm(dim=-1, keepdim=True)\n"
            f"    {w}.mul_(((1 - 1e-5) / n).clamp_max(1))   # rows with |w| >= 1 back inside"
        )
    if dom.name in ("acos", "asin"):
        return (
            f"{head}\n"
            "cos = F.cosine_similarity(a, b, dim=-1)   # normalized: within [-1, 1] up to "
            "rounding"
        )
    return head


def _domain_line(op: str, hit: DomainHit) -> str:
    dom = hit.domain
    where = f"{dom.name} is defined on {dom.interval}"
    if dom.at_edges:
        where += f" ({dom.at_edges})"
    n = hit.total
    x = hit.stat
    if n is not None and x is not None:
        parts = []
        if hit.outside:
            parts.append(f"{hit.outside:,} of its {x.numel:,} inputs lie outside")
        if hit.edge:
            parts.append(f"{hit.edge:,} of its {x.numel:,} inputs sit exactly on an endpoint")
        if hit.pole:
            parts.append(f"{hit.pole:,} of its {x.numel:,} inputs sit on a pole")
        return f"{where}: {'; '.join(parts)}"
    if x is not None:
        return f"{where}: its input ranges over [{_precise(x.min)}, {_precise(x.max)}]"
    return f"{where}: {op} made NaN or inf from finite inputs"


def _fmt_edge(x: float) -> str:
    return fmt(x) if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def _precise(x: float) -> str:
    """Enough digits to tell 1.0000001 from 1."""
    if not math.isfinite(x):
        return fmt(x)
    text = fmt(x)
    if float(text) != x and abs(x) < 1e6:
        return f"{x:.9g}"
    return text


def _edge_spread(s: TensorStat | None, dom: Domain) -> str:
    """``" (the min is the edge 1 exactly, the max 1.0000129 is inside ...)"`` when the
    values run from a finite edge into the domain: only some of them sit on the edge, and
    the range printed at a few digits would read as all of them."""
    if s is None or s.numel < 2 or s.max == s.min:
        return ""
    for edge, inner, other in ((dom.lo, s.min, s.max), (dom.hi, s.max, s.min)):
        if math.isfinite(edge) and inner == edge and not dom.outside_of(other):
            return (
                f"; the {'min' if edge == dom.lo else 'max'} is exactly the edge "
                f"{_fmt_edge(edge)}, the {'max' if edge == dom.lo else 'min'} "
                f"{_precise(other)} is inside: not every value is on the edge"
            )
    return ""


def _precise_stat(s: TensorStat | None, dom: Domain) -> str:
    if s is None:
        return "not measured"
    base = describe_stat(s)
    lo, hi = _precise(s.min), _precise(s.max)
    if (lo, hi) != (fmt(s.min), fmt(s.max)):
        base = base.replace(f"min {fmt(s.min)}, max {fmt(s.max)}", f"min {lo}, max {hi}", 1)
    return base


def _rounding(s: TensorStat | None, dom: Domain, dtype: str) -> str | None:
    """When the values beyond a finite endpoint are within a few float steps of it: a
    rounding error, not bad data."""
    lim = limits(dtype)
    if s is None or lim is None:
        return None
    for value, edge, side in ((s.max, dom.hi, "above"), (s.min, dom.lo, "below")):
        if not (math.isfinite(value) and math.isfinite(edge)):
            continue
        excess = value - edge if side == "above" else edge - value
        step = lim.eps * max(1.0, abs(edge))
        if 0 < excess <= 16 * step and dom.outside_of(value):
            steps = max(1, round(excess / step))
            return (
                f"{_precise(value)} is {fmt(excess)} {side} {_fmt_edge(edge)}: "
                f"{count(steps, f'{dtype} rounding step')} (eps {fmt(lim.eps)}), "
                "a rounding error, not bad data"
            )
    return None


def _domain_text(dom: Domain, *, rounding: bool) -> str:
    if dom.poles:
        return (
            f"{dom.name} has poles at 0, -1, -2, ... (the gamma function is infinite there): "
            f"{dom.at_edges}. A parameter that should be positive (a concentration, a shape, "
            "a rate) reached exactly 0 -- a ReLU output, a clamp at 0, an underflow -- and "
            "sits on the first pole."
        )
    head = f"{dom.name} is a real number only on {dom.interval}"
    if dom.edges:
        head += f"; {dom.at_edges}, and NaN beyond"
    else:
        head += "; outside it PyTorch returns NaN"
    why = (
        " Values that are mathematically inside come out a rounding step outside: a cosine "
        "computed as a normalized dot product (F.cosine_similarity, x·y / (|x||y|)) gives "
        "1.0000001 for parallel vectors, a tanh or sigmoid saturates to exactly ±1 or 0/1."
        if rounding or dom.name in ("acos", "asin", "atanh", "erfinv", "logit")
        else " Its input left that range: check what produces it."
    )
    grad = (
        f" The derivative of {dom.name} is also infinite at the endpoints, so clamp with a "
        "margin (eps), not exactly to them."
        if dom.steep_edges or dom.edges
        else ""
    )
    return head + "." + why + grad


_TORCH_NAME = {"ndtri": "torch.special.ndtri", "polygamma": "torch.polygamma"}


def _domain_fix(ev: OpEvent, dom: Domain) -> str:
    dtype = ev.dtype or "float32"
    lim = limits(dtype)
    head = f"eps = torch.finfo(torch.{dtype}).eps" + (f"   # {fmt(lim.eps)}" if lim else "")
    names = [dom.name, f"arc{dom.name[1:]}"] if dom.name.startswith("a") else [dom.name]
    call = _TORCH_NAME.get(dom.name, f"torch.{dom.name}")
    if dom.poles:
        fixed = rewrite_call(ev.code, names, lambda e: f"{paren(e)}.clamp_min(eps)")
        return (
            "x = F.softplus(raw) + 1e-4   # a parameter that must stay positive\n"
            + f"{head}\n"
            + (fixed or f"y = {call}(x.clamp_min(eps))")
            + "   # or keep the argument off 0"
        )
    lo = None if math.isinf(dom.lo) else dom.lo
    hi = None if math.isinf(dom.hi) else dom.hi

    def clamp(e: str) -> str:
        lo_t = None if lo is None else ("eps" if lo == 0 else f"{_fmt_edge(lo)} + eps")
        hi_t = None if hi is None else f"{_fmt_edge(hi)} - eps"
        if lo_t is not None and hi_t is not None:
            return f"{paren(e)}.clamp({lo_t}, {hi_t})"
        if lo_t is not None:
            return f"{paren(e)}.clamp_min({lo_t})"
        return f"{paren(e)}.clamp_max({hi_t})"

    def reclamp(e: str) -> str:
        return clamp(_drop_edge_clamp(e, dom))

    fixed = rewrite_call(ev.code, names, reclamp)
    body = fixed if fixed is not None else f"y = {call}({clamp('x')})"
    out = f"{head}\n{body}"
    if dom.name == "logit":
        out += "\n# or torch.logit(p, eps=eps), which clamps the same way"
    elif dom.name in ("acos", "asin"):
        out += "\n# or avoid the inverse: compare cosines, or use atan2(|x × y|, x·y) for angles"
    return out


def _drop_edge_clamp(expr: str, dom: Domain) -> str:
    """``cos.clamp(-1, 1)`` -> ``cos``: a clamp exactly to the domain's endpoints keeps the
    forward finite but not the gradient; the fix replaces it with one a margin inside."""

    def num(x: float) -> str:
        return rf"{'-' if x < 0 else ''}{int(abs(x))}(?:\.0*)?"

    parts = []
    if math.isfinite(dom.lo):
        parts.append(rf"(?:min\s*=\s*)?{num(dom.lo)}")
    if math.isfinite(dom.hi):
        parts.append(rf"(?:max\s*=\s*)?{num(dom.hi)}")
    if not parts:
        return expr
    method = "clamp" if len(parts) == 2 else ("clamp_min" if math.isfinite(dom.lo) else "clamp_max")
    args = r"\s*,\s*".join(parts)
    m = re.search(rf"\.(?:{method}|clamp|clip)\(\s*{args}\s*\)$", expr.strip())
    return expr.strip()[: m.start()] if m else expr


def _domain_backward(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, dom: Domain, trigger: OpEvent
) -> Diagnosis:
    op = short_op(ev.op)
    evidence = [
        f"in backward, {ev.node} ({op}) made {ev.born}: the forward {dom.name} was given "
        f"values on the edge of {dom.interval}, where its derivative {dom.slope} is infinite"
    ]
    # the forward op's own input (the cosines given exactly 1) before what the backward
    # read (1 - x², of which the zeros are only a consequence)
    own = dict(ev.other_inputs).get(_SAVED + dom.arg)
    if own is not None:
        at = ev.scalars.get("saved_at_edge")
        evidence.append(
            f"forward {dom.name} input: {_precise_stat(own, dom)}"
            + (f"; {at:,} exactly at an edge" if isinstance(at, int) and at else "")
        )
    for i, (nm, s) in enumerate(ev.inputs[:2]):
        hits = ev.scalars.get("n_edge") if i == 0 and nm == dom.arg else None
        evidence.append(
            f"backward input {nm}: {_precise_stat(s, dom)}"
            + (f"; {hits:,} exactly at an edge" if isinstance(hits, int) and hits else "")
            + _edge_spread(s, dom)
        )
    evidence += _chain_evidence(ev, trigger, ev.born)
    return ctx.diagnosis(
        **op_fields(ev, a),
        evidence=evidence,
        explanation=_steep_text(dom),
        fix=_domain_fix(ev, dom),
    )


def _steep_text(dom: Domain) -> str:
    lo = None if math.isinf(dom.lo) else _fmt_edge(dom.lo)
    hi = None if math.isinf(dom.hi) else _fmt_edge(dom.hi)
    guard = (
        f"x.clamp({lo}, {hi})"
        if lo is not None and hi is not None
        else f"x.clamp_min({lo})"
        if lo is not None
        else f"x.clamp_max({hi})"
    )
    return (
        f"{dom.name} is finite at the endpoints of {dom.interval}, so the forward pass shows "
        f"nothing, but its derivative {dom.slope} is infinite there; autograd multiplies it "
        "by the incoming gradient and inf × 0 is NaN. Clamping exactly to the endpoints "
        f"({guard} before {dom.name}, the usual guard) keeps the forward finite and leaves "
        "the gradient infinite: the clamp needs a margin of a few eps inside."
    )


def _domain_backward_untraced(ctx: RuleContext, a: Anomaly) -> Iterator[Diagnosis]:
    """A NaN gradient born in a module whose output an acos/asin/acosh made, and that
    output holds the op's value at an endpoint (acos: 0 at 1, π at -1)."""
    trace = ctx.trace
    calls = {c.id for c in trace.calls if c.path == a.path}
    for r in trace.records:
        if r.phase is not Phase.FORWARD or r.call not in calls:
            continue
        dom = node_domain(r.grad_fn)
        if dom is None or not dom.edge_outputs:
            continue
        m = exact(trace, r)
        s = m.stat if m is not None else None
        if s is None:
            continue
        hits = [
            v
            for v in dom.edge_outputs
            if any(math.isclose(x, v, rel_tol=1e-6, abs_tol=0.0) for x in (s.min, s.max))
        ]
        if not hits:
            continue
        g = a.record
        evidence = [
            f"{a.path}'s {r.role} was made by {r.grad_fn} ({dom.name}) and holds "
            f"{' and '.join(fmt(v) for v in hits)}, {dom.name}'s value at an endpoint of "
            f"{dom.interval}: {describe_stat(s)}",
            f"the gradient it sent back to {g.path} ({g.role}) holds "
            f"{g.stat.kinds() if g.stat else 'NaN'}: d/dx {dom.name} = {dom.slope} is "
            "infinite there",
            untraced_hint(ctx),
        ]
        yield ctx.diagnosis(
            **anomaly_fields(a),
            evidence=evidence,
            explanation=_steep_text(dom),
            fix=_domain_fix_text(dom, "float32" if not r.dtype else r.dtype),
            priority=14,
        )
        return


def _domain_fix_text(dom: Domain, dtype: str) -> str:
    probe = OpEvent(
        f"aten.{dom.name}", Phase.FORWARD, None, "", TensorStat(0.0, 0.0, 0), dtype=dtype
    )
    return _domain_fix(probe, dom)
