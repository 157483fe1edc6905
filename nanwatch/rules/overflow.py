"""Overflow: an op exceeded the dtype's range (NW101), and the early warnings before it
does: headroom nearly gone (NW102), logits approaching the exp bound (NW103), and a
magnitude trend that reaches the dtype's limit within a few steps (NW104).

Every limit is read from ``torch.finfo`` of the tensor at hand (``nanwatch.stats.
dtype_limits``): float16's largest value is 65504 and exp overflows above log(65504) =
11.09; bfloat16 and float32 overflow exp above 88.7.
"""

from __future__ import annotations

import ast
import itertools
import math
import re
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from nanwatch.records import (
    LOSS_PATH,
    Anomaly,
    AnomalyKind,
    OpEvent,
    Phase,
    Record,
    StepTrace,
    TensorStat,
)
from nanwatch.rules._evidence import (
    CAST,
    EXP_LIKE,
    MATMUL,
    anomaly_fields,
    cause_of,
    code_line,
    count,
    describe_stat,
    device_type,
    first_input,
    first_root_outputs,
    fmt,
    inputs_of,
    limits,
    loss_kind,
    low_precision,
    op_fields,
    packet,
    paren,
    postfix_start,
    rewrite_call,
    scalar_base,
    short_op,
    signed_max,
    untraced_hint,
)
from nanwatch.rules.base import Diagnosis, RuleContext, rule
from nanwatch.stats import DtypeLimits

# ---------------------------------------------------------------------- NW101


@rule(
    "NW101",
    title="Floating-point overflow",
    severity="error",
    summary=(
        "An op made inf from finite inputs: exp, softmax, a matmul or a cast went past the "
        "dtype's largest value (float16: exp overflows above log(65504) = 11.09; in "
        "float32, values that exploded)."
    ),
    priority=15,
)
def overflow(ctx: RuleContext) -> Iterator[Diagnosis]:
    a = ctx.anomaly
    if a is None or a.transient:
        return
    cause = cause_of(a)
    if cause is not None:
        if cause.kind == "overflow":
            yield _from_op(ctx, a, cause.event, cause.trigger, cause.chain)
        elif cause.kind == "other":
            # an op with no rule of its own (a norm's variance) made NaN from finite values
            # so large that their square passes the dtype: the values exploded
            yield from _wide_from_record(ctx, a)
        return
    yield from _from_record(ctx, a)


#: exp-like ops that overflow on both sides (cosh(-100) = inf, sinh(-100) = -inf)
_BOTH_SIDES = frozenset({"sinh", "cosh"})
#: exp-like ops that are not a softmax themselves: their own argument overflows
_BARE_EXP = frozenset({"exp", "exp_", "exp2", "expm1", "sinh", "cosh"})
#: ops that, after an exp, make it a softmax / logsumexp by hand (normalize, or log a sum)
_NORMALIZERS = frozenset({"div", "div_", "sum", "log", "log_", "true_divide", "reciprocal"})
_RECURRENT = frozenset({"RNN", "RNNCell", "LSTM", "LSTMCell", "GRU", "GRUCell"})


def _same_event(a: OpEvent, b: OpEvent) -> bool:
    """The same op event (identical, or equal in what identifies it: a loaded report)."""
    return a is b or (
        a.op == b.op and a.phase is b.phase and a.source == b.source and a.born == b.born
    )


def _followers(ev: OpEvent, ops: Sequence[OpEvent]) -> list[OpEvent]:
    """The step's later op events that consumed what ``ev`` made (``ev`` is in their
    cause chain): where an exp's inf went (the division by its own sum, two lines on)."""
    return [o for o in ops if not _same_event(o, ev) and any(_same_event(c, ev) for c in o.chain())]


_SOFTMAX_CODE = re.compile(r"\b(softmax|logsumexp)\b|\.sum\(|torch\.sum\(")


def _softmax_like(ev: OpEvent, chain: Sequence[OpEvent], ops: Sequence[OpEvent] = ()) -> bool:
    """Whether the overflowing exp is part of a softmax / logsumexp: a softmax op, or an
    exp whose inf a later op (of the chain, or of the step, on any line) normalized
    (divided by a sum, took a log), or whose line sums or normalizes it."""
    name = packet(ev.op)
    if name not in _BARE_EXP:
        return name in EXP_LIKE and name not in ("softplus",)
    later = list(chain[chain.index(ev) + 1 :]) if ev in chain else []
    later += _followers(ev, ops)
    if any(packet(e.op) in _NORMALIZERS for e in later):
        return True
    code = (ev.code or "").split("  #", 1)[0]
    return bool(_SOFTMAX_CODE.search(code))


def _from_op(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, trigger: OpEvent, chain: Sequence[OpEvent] = ()
) -> Diagnosis:
    lim = limits(ev.dtype)
    dtype = ev.dtype or a.record.dtype
    name = packet(ev.op)
    op = short_op(ev.op)
    x = first_input(ev)
    evidence: list[str] = []
    big = max((s.magnitude for s in inputs_of(ev) if not math.isnan(s.magnitude)), default=math.nan)
    # a backward of exp: what the node holds is exp's result, not its argument
    result_only = ev.phase is Phase.BACKWARD and name in EXP_LIKE
    power: tuple[float, float, float] | None = None
    if lim is None:
        evidence.append(f"{op} made {ev.born} in {dtype}")
    elif result_only:
        evidence.append(
            f"in forward, {op} overflowed: the result autograd saved holds +inf "
            f"({describe_stat(x)}), which the loss then left out (a min, a clamp or a where "
            "chose the other branch)"
        )
        evidence.append(
            f"in backward ({ev.node}) the gradient is multiplied by that result: 0 × inf = "
            f"{ev.born}"
        )
    elif name.rstrip("_") in _BOTH_SIDES and x is not None and not math.isnan(x.magnitude):
        evidence.append(
            f"{op} made {ev.born} in {dtype} from an input up to |x| = {fmt(x.magnitude)} "
            f"(min {fmt(x.min)}, max {fmt(x.max)}); it overflows for |x| above "
            f"{fmt(lim.exp_bound + math.log(2))} = log(2 × {fmt(lim.max)})"
        )
    elif name in EXP_LIKE:
        top = signed_max(x)
        given = (
            f"from an input whose largest value is {fmt(top)}"
            if not math.isnan(top)
            else "(its input was not kept by autograd)"
        )
        evidence.append(
            f"{op} made {ev.born} in {dtype} {given}; exp overflows above "
            f"{fmt(lim.exp_bound)} = log({fmt(lim.max)}), the largest finite {dtype} value"
        )
    elif name in MATMUL:
        mags = ", ".join(fmt(s.magnitude) for s in inputs_of(ev)[:3])
        evidence.append(
            f"{op} made {ev.born} in {dtype}: inputs up to |x| = {mags}; their products, "
            f"summed over the inner dimension, passed {fmt(lim.max)} (the largest finite "
            f"{dtype} value)"
        )
    elif name in CAST:
        evidence.append(
            f"{op} cast a value of |x| = {fmt(big)} to {dtype}, whose largest finite value "
            f"is {fmt(lim.max)}: it became {ev.born}"
        )
    elif (power := _scalar_power(ev)) is not None:
        base, e, value = power
        evidence.append(
            f"{op} raised {fmt(base)} to the powers of its input: {fmt(base)} ** {fmt(e)} = "
            f"{fmt(value)} > {fmt(lim.max)} ({dtype}'s max)"
        )
    else:
        evidence.append(
            f"{op} made {ev.born} in {dtype} from inputs up to |x| = {fmt(big)}; the largest "
            f"finite {dtype} value is {fmt(lim.max)}"
        )
    for nm, s in ev.inputs[:3]:
        evidence.append(f"input {nm}: {describe_stat(s)}")
    # float32 and up, and bfloat16 (float32's range: an upcast would not help it)
    wide = lim is not None and not lim.short_range
    loop = None if result_only else _recurrence(ctx.trace, ev.path or a.path, a.record.call)
    batch = _batch_jump(ctx, a) if wide and not result_only and loop is None else None
    if loop is not None:
        evidence.append(loop.line())
    elif batch is not None:
        evidence.append(batch.line(ctx.step))
    elif wide and lim is not None and name not in CAST and not result_only:
        evidence.append(_growth_line(ctx, a, name, _overflowing(name, x, big), lim))
    arg = _overflowing(name, x, big)
    f32 = _exp_bound("float32")
    if lim is not None and lim.short_range and name in _BARE_EXP and arg > f32 and not result_only:
        evidence.append(
            f"the argument {fmt(arg)} is past float32's exp bound {fmt(f32)} too: computing "
            "this exp in float32 or bfloat16 would overflow as well"
        )
    line = code_line(ev)
    if line:
        evidence.append(line)
    if trigger is not ev:
        why = " (inf - inf, inf / inf and 0 × inf are NaN)" if "NaN" in trigger.born else ""
        evidence.append(f"then {short_op(trigger.op)} turned the inf into {trigger.born}{why}")
    if a.record.stat is not None and a.record.dtype != dtype:
        evidence.append(
            f"the anomaly was first seen in {a.record.where}: {a.record.stat.kinds()} in "
            f"{a.record.dtype}"
        )
    fields = op_fields(ev, a)
    kind = _kind(name, ev, chain, ctx.trace.ops)
    device = device_type(ev, a.record.device)
    recurrent = a.record.module_type in _RECURRENT
    first = _first_step(ctx)
    if loop is not None:
        explanation = _explain_loop(loop, dtype)
        fix = _fix_loop(loop)
    elif batch is not None:
        explanation = _explain_batch(batch, dtype)
        fix = _fix_batch(batch)
    elif wide and lim is not None:
        explanation = _explain_wide(
            kind, dtype, lim, None if result_only else x, big, recurrent=recurrent
        )
        fix = _fix_wide(
            kind,
            name,
            dtype,
            lim,
            ev.code,
            recurrent=recurrent,
            first=first,
            ref=_module_ref(ctx, a),
            lr=_lr_fix(ctx),
        )
    elif power is not None and lim is not None:
        explanation = (
            f"{fmt(power[0])} ** t grows with the exponent t, and {dtype} holds values up to "
            f"{fmt(lim.max)}: its largest exponent's power is {fmt(power[2])}, which became "
            "inf. Frequencies and scales built as base ** (i / d) (rotary embeddings, "
            "sinusoidal positions) are computed in float32 and only their bounded results "
            "(cos, sin) cast to the model's dtype."
        )
        fix = _power_fix(ev.code, power, dtype, ref=_module_ref(ctx, a))
    else:
        explanation = _explain(kind, dtype, lim)
        fix = _fix(
            kind,
            name,
            dtype,
            lim,
            ev.code,
            device=device,
            ref=_module_ref(ctx, a),
            arg=math.nan if result_only else arg,
            scalar=x is not None and x.numel == 1,
            loss=(ev.path or a.path) == LOSS_PATH,
        )
    return ctx.diagnosis(**fields, evidence=evidence, explanation=explanation, fix=fix)


def _scalar_power(ev: OpEvent) -> tuple[float, float, float] | None:
    """``number ** tensor`` (aten.pow.Scalar) that overflowed: the base, the exponent of
    the largest power among the input's extremes and that power (|base| ** e)."""
    base = scalar_base(ev)
    x = first_input(ev)
    if base is None or base == 0 or x is None:
        return None
    ends = [e for e in (x.min, x.max) if math.isfinite(e)]
    if not ends:
        return None

    def power(e: float) -> float:
        try:
            return math.pow(abs(base), e)
        except OverflowError:
            return math.inf

    e = max(ends, key=power)
    return base, e, power(e)


def _power_fix(code: str | None, power: tuple[float, float, float], dtype: str, *, ref: str) -> str:
    """The user's ``number ** t`` with the exponent in float32, and what uses the result
    kept there until it is back in the dtype's range."""
    base, e, value = power
    why = f"float32: {fmt(base)} ** {fmt(e)} = {fmt(value)} does not fit {dtype}"
    line, name = _float_exponent(code)
    if line is not None:
        what = name or "the result"
        keep = (
            f"# and keep what uses {what} in float32: cast only bounded results (its cos, "
            f"sin) to torch.{dtype}"
        )
        return f"{line}   # {why}\n{keep}"
    return (
        f"# in {ref}'s forward: compute base ** t from t.float() ({why})\n"
        f"# and cast only its bounded results (cos, sin) to torch.{dtype}"
    )


def _float_exponent(code: str | None) -> tuple[str | None, str | None]:
    """The user's line with the tensor exponent of its one ``number ** t`` cast to float32,
    and the name the line assigns (None when it assigns no plain name)."""
    if not code:
        return None, None
    line = code.split("  #", 1)[0].strip()
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None, None
    hits = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.BinOp)
        and isinstance(n.op, ast.Pow)
        and isinstance(n.left, ast.Constant)
        and isinstance(n.left.value, (int, float))
    ]
    if len(hits) != 1:
        return None, None
    seg = ast.get_source_segment(line, hits[0].right)
    if seg is None:
        return None, None
    if f"({seg})" in line:  # already parenthesized
        seg = f"({seg})"
    at = line.rfind(seg)
    new = line[:at] + f"{paren(seg)}.float()" + line[at + len(seg) :]
    stmt = tree.body[0] if len(tree.body) == 1 else None
    name = (
        stmt.targets[0].id
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name)
        else None
    )
    return new, name


def _kind(name: str, ev: OpEvent, chain: Sequence[OpEvent], ops: Sequence[OpEvent] = ()) -> str:
    """``softmax``, ``exp`` (a bare exp), ``matmul``, ``cast``, ``backward`` or ``other``."""
    if name in EXP_LIKE:
        return "softmax" if _softmax_like(ev, chain, ops) else "exp"
    if name in MATMUL:
        return "matmul"
    if name in CAST:
        return "cast"
    return "other"


def _module_ref(ctx: RuleContext, a: Anomaly) -> str:
    """``model.rnn`` for the anomaly's module (``model`` when it is the root)."""
    call = ctx.trace.call(a.record.call)
    if call is None or call.root or not re.fullmatch(r"[\w.]+", a.path):
        return "model"
    return "model." + ".".join(
        p if p.isidentifier() else f"[{p}]" for p in a.path.split(".")
    ).replace(".[", "[")


def _first_step(ctx: RuleContext) -> bool:
    """No optimizer update came before this step (the first step nanwatch saw)."""
    return not ctx.history and ctx.step == 0


def _overflowing(name: str, x: TensorStat | None, big: float) -> float:
    """The input value that overflowed: for exp and its kin the largest (signed) argument,
    since exp of a large negative number underflows to 0 and never overflows (sinh and cosh
    overflow on both sides: their largest |x|); for other ops the largest |x|."""
    if name in EXP_LIKE and name.rstrip("_") not in _BOTH_SIDES:
        top = signed_max(x)
        return top if not math.isnan(top) else big
    return big


#: a batch whose max |x| is this many times the largest of the earlier batches' is out of
#: the range the model was trained on (a forgotten /255 is 255 times)
_JUMP = 10.0


@dataclass(frozen=True)
class _Batch:
    """A root input (the batch) that put the values out of range."""

    rec: Record  #: its input record
    now: float  #: its max |x|
    before: float | None  #: the largest max |x| of the same input earlier (None: unknown)
    since: int | None  #: the first step of that comparison (None: this step's calls only)
    until: int | None  #: its last step
    lim: DtypeLimits

    @property
    def huge(self) -> bool:
        """Its own square overflows: a missing-value marker or a corrupt value, not data."""
        return self.now >= math.sqrt(self.lim.max)

    @property
    def name(self) -> str:
        return f"{self.rec.role} of {self.rec.path}"

    def line(self, step: int) -> str:
        lim = self.lim
        if self.huge:
            frac = self.now / lim.max
            share = f", {frac:.0%} of the {lim.name} limit" if frac >= 0.01 else ""
            earlier = (
                f" (at most {fmt(self.before)} in the batches before)"
                if self.before is not None
                else ""
            )
            return (
                f"the batch did it: {self.name} holds max |x| = {fmt(self.now)}{share}"
                f"{earlier}; past sqrt({fmt(lim.max)}) = {fmt(math.sqrt(lim.max))}, its "
                "square and its products overflow: a missing-value marker or a corrupt sample, "
                "not a measurement"
            )
        if self.since is None or self.until is None or self.since == step:
            when = "this step's earlier calls"
        elif self.since == self.until:
            when = f"step {self.since}"
        else:
            when = f"steps {self.since}-{self.until}"
        ratio = self.now / self.before if self.before else math.inf
        return (
            f"the batch did it: {self.name} holds max |x| = {fmt(self.now)} at step {step}, "
            f"against at most {fmt(self.before)} over {when} ({fmt(ratio)} times larger); the "
            "values grew with the input, not with training"
        )


def _root_inputs(trace: StepTrace, upto: float) -> list[Record]:
    """The finite, measured inputs of the step's root calls (the batches), before ``upto``."""
    roots = {c.id for c in trace.calls if c.root and not c.is_loss}
    return [
        r
        for r in trace.records
        if r.phase is Phase.INPUT
        and r.call in roots
        and r.source is None
        and r.index < upto
        and r.stat is not None
        and r.stat.finite
        and not math.isnan(r.stat.magnitude)
    ]


def _activation_max(trace: StepTrace, upto: float) -> float:
    """The largest finite max |x| of the step's module outputs (losses left out)."""
    losses = {c.id for c in trace.calls if c.is_loss}
    mags = [
        r.stat.magnitude
        for r in trace.records
        if r.phase is Phase.FORWARD
        and r.index < upto
        and r.call not in losses
        and r.stat is not None
        and r.stat.finite
        and not math.isnan(r.stat.magnitude)
    ]
    return max(mags, default=math.nan)


def _batch_jump(ctx: RuleContext, a: Anomaly) -> _Batch | None:
    """The batch, when it (not training) put the values out of range: one of its values is
    so large that its square overflows, or its max |x| is ``_JUMP`` times the largest of
    the same input's earlier batches while the activations grew no faster than such an
    input makes them (a polynomial of it: up to its cube; weights that exploded grow them
    far faster)."""
    upto = a.record.index
    current = _root_inputs(ctx.trace, upto)
    if not current:
        return None
    past = [(t.step, r) for t in ctx.history for r in _root_inputs(t, math.inf)]
    act_before = max(
        (m for t in ctx.history if not math.isnan(m := _activation_max(t, math.inf))),
        default=math.nan,
    )
    act_now = _activation_max(ctx.trace, upto)
    found: list[tuple[float, _Batch]] = []
    for i, r in enumerate(current):
        lim = limits(r.dtype)
        if lim is None or r.stat is None:
            continue
        now = r.stat.magnitude
        key = (r.path, r.role)
        earlier = [(s, m.stat.magnitude) for s, m in past if (m.path, m.role) == key and m.stat]
        earlier += [
            (ctx.step, m.stat.magnitude) for m in current[:i] if (m.path, m.role) == key and m.stat
        ]
        before = max((v for _, v in earlier), default=None)
        since = min((s for s, _ in earlier), default=None)
        until = max((s for s, _ in earlier), default=None)
        batch = _Batch(r, now, before, since, until, lim)
        if batch.huge:
            found.append((math.inf, batch))
            continue
        if before is None or not before > 0 or now < _JUMP * before:
            continue
        gain = now / before
        if (
            math.isfinite(act_before)
            and act_before > 0
            and math.isfinite(act_now)
            and act_now / act_before > _JUMP * gain**3
        ):
            continue  # the activations outgrew the input: the weights grew too
        found.append((gain, batch))
    if not found:
        return None
    return max(found, key=lambda f: f[0])[1]


def _explain_batch(b: _Batch, dtype: str) -> str:
    usual = (
        f" ({fmt(b.now / b.before)} times the earlier batches')" if b.before and not b.huge else ""
    )
    return (
        f"{dtype} holds values up to {fmt(b.lim.max)}. This step's batch reached max |x| = "
        f"{fmt(b.now)}{usual}, and the layers carried it past that limit: the weights and "
        "the learning rate are not the cause, and clipping gradients cannot help a forward "
        "that overflows. A batch that skipped its normalization (a forgotten / 255 or "
        "standardization), a missing-value marker stored as a huge number (FLT_MAX, 1e38), "
        "or a corrupt sample."
    )


def _fix_batch(b: _Batch) -> str:
    cap = _JUMP * b.before if b.before else math.sqrt(b.lim.max)
    rows = "x.abs().flatten(1).amax(dim=1)" if len(b.rec.shape) >= 2 else "x.abs()"
    return (
        f"bad = {rows} > {fmt(cap)}   # x: the batch given to the model ({b.name})\n"
        "print(bad.nonzero().flatten().tolist())   # the samples out of range: trace them to "
        "the dataset\n"
        "# fix them where the data is made: normalize (x / 255, (x - mean) / std), replace "
        "missing-value markers"
    )


# ---------------------------------------------------------------- a loop in one forward

#: calls of one module in one forward from which a trend of its outputs is read
_MANY_CALLS = 8
#: the share of successive calls whose output must be larger than the call before
_GROWING = 0.75
#: and the growth over the calls, first to last: orders of magnitude, not noise
_GREW = 1e3


@dataclass(frozen=True)
class _Loop:
    """One module called many times in one forward, its output growing call after call:
    a recurrence or an integrator (x = x + dt · f(x)) that is unstable."""

    path: str
    calls: int  #: calls of the module in this forward, the overflowing one included
    first: float  #: max |x| of the first measured output
    last: float  #: max |x| of the last finite output before the overflow
    factor: float  #: the growth per call (geometric mean)

    def line(self) -> str:
        return (
            f"{self.path} was called {self.calls} times in this forward and its output grew "
            f"call after call, from max |x| {fmt(self.first)} to {fmt(self.last)} (×"
            f"{fmt(self.factor)} per call): a recurrence or an integrator that diverges, "
            "not a deep stack of layers"
        )


def _recurrence(trace: StepTrace, path: str | None, upto: int) -> _Loop | None:
    """The module at ``path`` called at least ``_MANY_CALLS`` times in this forward up to
    the call ``upto`` (the overflowing one), its outputs (in call order) growing in most
    successive calls and by orders of magnitude overall; None otherwise."""
    if not path:
        return None
    calls = [c for c in trace.calls if c.path == path and c.id <= upto]
    if len(calls) < _MANY_CALLS:
        return None
    ids = {c.id for c in calls}
    first_out: dict[int, float] = {}
    for r in trace.records:
        if r.phase is Phase.FORWARD and r.call in ids and r.call not in first_out and r.stat:
            first_out[r.call] = r.stat.amax if r.stat.finite else math.nan
    mags = [first_out[c.id] for c in calls if c.id in first_out]
    mags = [m for m in mags if math.isfinite(m) and m > 0]  # the overflowing call left out
    if len(mags) < _MANY_CALLS:
        return None
    pairs = list(itertools.pairwise(mags))
    up = sum(1 for x, y in pairs if y > x)
    if up < _GROWING * len(pairs) or mags[-1] < _GREW * mags[0]:
        return None
    factor = (mags[-1] / mags[0]) ** (1 / (len(mags) - 1))
    return _Loop(path, len(calls), mags[0], mags[-1], factor)


def _explain_loop(loop: _Loop, dtype: str) -> str:
    return (
        f"The same module ran {loop.calls} times in one forward pass, each call fed what "
        f"the previous one made, and the values grew by about ×{fmt(loop.factor)} per "
        f"call until they passed {dtype}'s largest value. That is a loop that amplifies: an "
        "explicit Euler step x + dt·f(x) with dt too large for the field (stable only "
        "while |1 + dt·λ| < 1 for its eigenvalues λ), or a recurrent cell whose weight has "
        "a gain above 1. The step 0 weights are not to blame, and normalization layers, "
        "initialization or gradient clipping do not change the loop's growth."
    )


def _fix_loop(loop: _Loop) -> str:
    return (
        f"# the loop that calls {loop.path} ({loop.calls} times) grows ×{fmt(loop.factor)} "
        "per call: make each step contract\n"
        "# an integrator x = x + dt * f(x): a smaller dt (explicit Euler needs dt·|λ| < 2),\n"
        "#   or an implicit or adaptive solver: torchdiffeq.odeint(f, x0, t, "
        "method='dopri5') picks its own step\n"
        "# a recurrence h = cell(h): bound the state each call, h = torch.tanh(h) or "
        "h.clamp(-c, c),\n"
        "#   or keep the recurrent weight's gain below 1 "
        "(torch.nn.utils.parametrizations.spectral_norm)"
    )


# ---------------------------------------------------------------- learning rate


@dataclass(frozen=True)
class _LrStep:
    step: int
    optimizer: str  #: the class (``SGD``)
    lrs: tuple[float, ...]  #: per param group


def _lr_steps(ctx: RuleContext) -> list[_LrStep]:
    """The learning rates of the optimizer steps before this one (their ``"optimizer"``
    notes): this step's own update, if any, came after the values went bad."""
    out = []
    for t in ctx.history:
        for n in t.notes:
            if n.kind != "optimizer":
                continue
            lrs = tuple(
                float(g["lr"])
                for g in n.data.get("groups", ())
                if isinstance(g, dict)
                and isinstance(g.get("lr"), (int, float))
                and not isinstance(g.get("lr"), bool)
                and math.isfinite(g["lr"])
            )
            if lrs:
                out.append(_LrStep(t.step, n.path, lrs))
    return out


#: no optimizer trains with a learning rate this large: a typo (1e36 for 1e-3, 1000 for 1e-3)
_ABSURD_LR = 1e3
#: the learning rate rose across the recorded steps by more than this factor: a schedule
_ROSE = 1.5


def _lr_rise(steps: Sequence[_LrStep]) -> tuple[_LrStep, _LrStep] | None:
    """The first and the last step of the latest optimizer, when its lr rose (a warmup, a
    OneCycleLR) across the recorded steps."""
    if not steps:
        return None
    last = steps[-1]
    mine = [s for s in steps if s.optimizer == last.optimizer]
    first = min(mine, key=lambda s: max(s.lrs))
    if max(last.lrs) > _ROSE * max(first.lrs) and first.step < last.step:
        return first, last
    return None


def _lr_fix(ctx: RuleContext) -> list[str]:
    """Lower the learning rate of the user's own optimizer, by the numbers nanwatch saw."""
    steps = _lr_steps(ctx)
    if not steps:
        return ['for g in optimizer.param_groups: g["lr"] /= 10   # a learning rate 10 times lower']
    last = steps[-1]
    lr = max(last.lrs)
    rise = _lr_rise(steps)
    if rise is not None:
        first, _ = rise
        return [
            f"# {last.optimizer}'s lr rose from {fmt(max(first.lrs))} at step {first.step} to "
            f"{fmt(lr)} at step {last.step}: a scheduler raised it (a warmup, OneCycleLR),",
            f"# and the values exploded on the way up: lower the schedule's peak (OneCycleLR's "
            f"max_lr, the warmup's target) to {fmt(lr / 10)} or less",
        ]
    if len(set(last.lrs)) > 1:
        was = ", ".join(fmt(x) for x in last.lrs)
        return [f'for g in optimizer.param_groups: g["lr"] /= 10   # were {was} ({last.optimizer})']
    if lr >= _ABSURD_LR:
        return [
            f'for g in optimizer.param_groups: g["lr"] = 1e-3   # was {fmt(lr)} '
            f"({last.optimizer}): far above any usable learning rate"
        ]
    return [
        f'for g in optimizer.param_groups: g["lr"] = {fmt(lr / 10)}   # was {fmt(lr)} '
        f"({last.optimizer})"
    ]


def _lr_note(ctx: RuleContext) -> str:
    """``(SGD lr 0.336, up from 0.12 at step 0)`` for the growth line; "" when unknown."""
    steps = _lr_steps(ctx)
    if not steps:
        return ""
    last = steps[-1]
    lr = ", ".join(fmt(x) for x in dict.fromkeys(last.lrs))
    rise = _lr_rise(steps)
    up = f", up from {fmt(max(rise[0].lrs))} at step {rise[0].step}" if rise else ""
    return f" ({last.optimizer} lr {lr}{up})"


def _growth_line(
    ctx: RuleContext, a: Anomaly, name: str, big: float, lim: DtypeLimits, *, noun: str = "inputs"
) -> str:
    """For float32/float64: the values themselves exploded; say when. For an exp-like op,
    ``big`` is its largest argument (see :func:`_overflowing`)."""
    if name in EXP_LIKE and math.isfinite(big):
        base = 2.0 if name.rstrip("_") == "exp2" else math.e
        power = f"2^{fmt(big)}" if base == 2.0 else f"e^{fmt(big)}"
        what = f"exp's argument reached {fmt(big)} ({power} ≈ 1e{int(big * math.log10(base))})"
    elif name in EXP_LIKE:
        what = f"exp's argument passed {fmt(lim.exp_bound)}"  # (its input was not kept)
    else:
        frac = big / lim.max if math.isfinite(big) else math.nan
        what = (
            f"{noun} already at {fmt(big)} ({frac:.0%} of the {lim.name} limit)"
            if math.isfinite(frac) and frac >= 0.01
            else f"{noun} up to {fmt(big)}"
        )
    when = (
        "at step 0, before any optimizer update: the initial weights or the inputs put it "
        "there, not the learning rate"
        if _first_step(ctx)
        else f"at step {ctx.step}: the values grew during training{_lr_note(ctx)}"
    )
    return f"{what}: the values themselves exploded, {when}"


def _inputs_of_record(trace: StepTrace, rec: Record) -> list[Record]:
    """The measured records of what the call that made ``rec`` was given: a module's
    inputs, or for a loss computed outside any module, the model's outputs. An input that
    came through a pass-through module resolves to that module's input, an upper bound."""
    if rec.path == LOSS_PATH:
        return first_root_outputs(trace)
    resolved = (trace.resolve(r) for r in trace.inputs_of(rec.call))
    return [m for m in resolved if m.stat is not None]


def _forward_values_of(trace: StepTrace, path: str) -> list[Record]:
    """The measured inputs and outputs of every forward call of the module at ``path``:
    what its backward multiplies the incoming gradient by."""
    calls = {c.id for c in trace.calls if c.path == path}
    out = []
    for r in trace.records:
        if r.call in calls and r.phase in (Phase.INPUT, Phase.FORWARD):
            m = trace.resolve(r)
            if m.stat is not None:
                out.append(m)
    return out


def _wide_from_record(ctx: RuleContext, a: Anomaly) -> Iterator[Diagnosis]:
    """float32/float64, no op recorded: a NaN or inf made from finite values so large that
    a product of two of them passes the dtype's range (|x| >= sqrt(finfo.max)) -- values
    that exploded; smaller values leave the cause to the op (forensic mode). In forward the
    values are the call's inputs; in backward, what the module's forward took and gave,
    which its backward multiplies by (a norm's forward can hide x² = inf as rsqrt(inf) = 0;
    its backward makes inf × 0 = NaN)."""
    rec = a.record
    s = rec.stat
    if s is None or s.finite:
        return
    if a.kind is AnomalyKind.FORWARD:
        values = _inputs_of_record(ctx.trace, rec)
    elif a.kind is AnomalyKind.BACKWARD:
        values = _forward_values_of(ctx.trace, a.path)
    else:
        return
    if not values and a.op is not None and a.op.phase is Phase.FORWARD:
        # inputs bounded by earlier records, not read (a residual sum): the op read them
        values = [
            Record(
                -1,
                rec.step,
                Phase.INPUT,
                a.path,
                name,
                a.op.dtype or rec.dtype,
                rec.device,
                (),
                st,
                rec.call,
                None,
                rec.module_type,
            )
            for name, st in a.op.inputs
            if st is not None
        ]
    if not values or any(r.stat is None or not r.stat.finite for r in values):
        return
    top = max(values, key=lambda r: r.stat.magnitude if r.stat is not None else -1.0)
    big = top.stat.magnitude if top.stat is not None else math.nan
    lim = limits(top.dtype) or limits(rec.dtype)
    if lim is None or lim.short_range or not big >= math.sqrt(lim.max):
        return
    square = f"past sqrt({fmt(lim.max)}) = {fmt(math.sqrt(lim.max))}, the product or square "
    if a.kind is AnomalyKind.FORWARD:
        first = (
            f"{rec.where} holds {s.kinds()} in {rec.dtype}, made from finite inputs up to "
            f"|x| = {fmt(big)} (the {top.role} of {top.path}): {square}of two such values "
            "is inf"
        )
    else:
        first = (
            f"{rec.where} holds {s.kinds()}, born in the backward of {a.path}, whose "
            f"forward took and gave finite values up to |x| = {fmt(big)} (its {top.role}, "
            f"{top.dtype}): {square}of two such values is inf, which a forward can hide "
            "(rsqrt(inf) = 0) and its backward cannot (inf × 0 = NaN)"
        )
    noun = "inputs" if a.kind is AnomalyKind.FORWARD else "values"
    batch = _batch_jump(ctx, a)
    grew = batch.line(ctx.step) if batch else _growth_line(ctx, a, "", big, lim, noun=noun)
    evidence = [first, grew]
    exploded = next(
        (t.step for t in ctx.history for d in t.diagnoses if getattr(d, "code", "") == "NW303"),
        None,
    )
    if exploded is not None:
        evidence.append(f"the gradient norms exploded first, at step {exploded} (NW303)")
    if batch is not None:
        explanation = _explain_batch(batch, top.dtype)
        fix = _fix_batch(batch)
    else:
        explanation = _explain_wide("other", top.dtype, lim, top.stat, big, recurrent=False)
        fix = _fix_wide(
            "other",
            "",
            top.dtype,
            lim,
            None,
            recurrent=False,
            first=_first_step(ctx),
            ref=_module_ref(ctx, a),
            lr=_lr_fix(ctx),
        )
    yield ctx.diagnosis(
        **anomaly_fields(a), evidence=evidence, explanation=explanation, fix=fix, priority=20
    )


def _from_record(ctx: RuleContext, a: Anomaly) -> Iterator[Diagnosis]:
    rec = a.record
    lim = low_precision(rec.dtype)
    s = rec.stat
    if lim is None and limits(rec.dtype) is not None:
        yield from _wide_from_record(ctx, a)
        return
    if lim is not None and not lim.short_range:  # bfloat16: float32's range
        found = list(_wide_from_record(ctx, a))
        if found:
            yield from found
            return
    if lim is None or s is None or not (s.has_posinf or s.has_neginf):
        return
    if a.kind not in (AnomalyKind.FORWARD, AnomalyKind.BACKWARD, AnomalyKind.GRADIENT):
        return
    evidence = [
        f"{rec.where} holds {s.kinds()} in {rec.dtype}; its inputs were finite",
        f"statistics: {describe_stat(s)}; the largest finite {rec.dtype} value is "
        f"{fmt(lim.max)} (exp overflows above {fmt(lim.exp_bound)})",
        untraced_hint(ctx.facts.get("mode")),
    ]
    backward = a.kind is not AnomalyKind.FORWARD
    kind = "backward" if backward else "other"
    device = device_type(None, rec.device)
    yield ctx.diagnosis(
        **anomaly_fields(a),
        evidence=evidence,
        explanation=_explain(kind, rec.dtype, lim),
        fix=_fix(kind, "", rec.dtype, lim, None, device=device, ref=_module_ref(ctx, a)),
        priority=20,
    )


def _explain(kind: str, dtype: str, lim: DtypeLimits | None) -> str:
    """Low precision (float16, bfloat16, float8): the dtype's range is the problem."""
    top = fmt(lim.max) if lim is not None else "its largest value"
    if kind == "backward":
        return (
            f"A gradient exceeded {dtype}'s largest finite value {top} and became inf. "
            f"{dtype} has 5 exponent bits: values above {top} do not exist, so a large loss "
            "or a large upstream gradient overflows in backward. A GradScaler detects such "
            "steps and skips them while lowering the scale; float32 master weights with "
            "autocast keep the update itself in range."
        )
    if kind in ("softmax", "exp") and lim is not None:
        return (
            f"exp(x) is larger than {top}, {dtype}'s largest finite value, for every x above "
            f"log({top}) = {fmt(lim.exp_bound)}: a hand-written softmax, an exp or a "
            f"logsumexp computed in {dtype} turns moderately large inputs into inf, and the "
            "next division or subtraction turns inf into NaN. Stable softmax subtracts the "
            "row maximum first; autocast runs softmax in float32 for this reason."
        )
    if kind == "matmul":
        return (
            f"A matmul sums many products: inputs of a few hundred in {dtype} give sums "
            f"beyond {top} (attention scores q·k before the 1/sqrt(d) scaling, T5-style "
            "un-normalized activations). bfloat16 has float32's range; float32 for this one "
            "op costs little."
        )
    if kind == "cast":
        return (
            f"Casting to {dtype} turns every value beyond ±{top} into ±inf: a tensor computed "
            f"in float32 (a loss, an autocast output, a buffer) does not fit in {dtype}."
        )
    return (
        f"A value exceeded {top}, the largest finite {dtype} value, and became inf; the "
        "NaN that followed (inf - inf, 0 × inf) is a consequence."
    )


def _explain_wide(
    kind: str,
    dtype: str,
    lim: DtypeLimits,
    x: TensorStat | None,
    big: float,
    *,
    recurrent: bool,
) -> str:
    """float32 / float64: the range is vast, so the values themselves exploded."""
    top = fmt(lim.max)
    head = (
        f"{dtype} holds values up to {top}: reaching that is not a precision problem, and "
        "computing in a wider dtype only delays it. "
    )
    if kind == "softmax":
        return head + (
            f"This exp is part of a softmax or logsumexp written by hand: exp of inputs "
            f"above {fmt(lim.exp_bound)} is inf, and the normalization then makes inf / inf "
            "= NaN. Subtracting the row maximum first keeps every exp at most 1 and gives the "
            "same result; torch.softmax and torch.logsumexp do it for you."
        )
    if kind == "exp":
        arg = signed_max(x)
        reached = f"reached {fmt(arg)}" if not math.isnan(arg) else "passed it"
        return head + (
            f"exp overflows {dtype} above {fmt(lim.exp_bound)}; its argument {reached}. "
            "An exponentiated quantity with no upper bound -- a "
            "predicted log-variance or log-scale, a temperature, a learned log-rate -- "
            "drifted up. Bound the argument (clamp), or parameterize the positive quantity "
            "with softplus, which grows linearly instead of exponentially."
        )
    if kind == "matmul":
        more = (
            " In a recurrence the hidden state is multiplied by the same weight_hh at every "
            "time step: a largest singular value above 1 grows it geometrically with the "
            "sequence length, and a ReLU recurrence has nothing that saturates it."
            if recurrent
            else " Activations multiplied by weights of gain above 1 in layer after layer "
            "grow geometrically when nothing normalizes them."
        )
        return head + f"The inputs of this product were already up to {fmt(big)}." + more
    return head + (
        f"The inputs reached {fmt(big)}: find what lets them grow (a learning rate too "
        "high, no gradient clipping, an un-normalized residual stream)."
    )


def _fix_wide(
    kind: str,
    name: str,
    dtype: str,
    lim: DtypeLimits,
    code: str | None,
    *,
    recurrent: bool,
    first: bool,
    ref: str,
    lr: Sequence[str] = (),
) -> str:
    plain = code.split("  #", 1)[0].strip() if code else ""
    was = f"  # was: {plain}" if plain else ""
    if kind == "softmax":
        op = name.rstrip("_")
        if op in _BARE_EXP:
            return (
                f"{_max_subtracted(code, op)}{was}\n"
                "# subtract the row max first (the dim you normalize over): every exp is then "
                "at most 1, and the result is the same\n"
                "# or the whole softmax in one call, stable: torch.softmax(x, dim=-1) "
                "(torch.logsumexp, F.log_softmax)"
            )
        return (
            f"x = x - x.amax(dim=-1, keepdim=True)   # subtract the row max before exp{was}\n"
            "probs = torch.softmax(x, dim=-1)       # or torch.logsumexp / log_softmax"
        )
    if kind == "exp":
        bound = lim.exp_bound / (math.log(2) if name.rstrip("_") == "exp2" else 1.0)
        cap = math.floor(bound / 2 * 10) / 10
        bounds = f"-{cap}, {cap}" if name.rstrip("_") in _BOTH_SIDES else f"max={cap}"
        fixed = rewrite_call(code, [name.rstrip("_")], lambda e: f"{paren(e)}.clamp({bounds})")
        first_line = (
            fixed if fixed is not None else f"y = torch.{name.rstrip('_')}(x.clamp({bounds}))"
        )
        last = (
            "# log(cosh(d)), a log-cosh loss, without cosh: "
            "d.abs() + F.softplus(-2 * d.abs()) - math.log(2)"
            if name.rstrip("_") == "cosh"
            else "std = F.softplus(raw) + 1e-4   # or: a scale parameterized by softplus, not exp"
        )
        return (
            f"{first_line}\n"
            f"# {cap} = half of {fmt(lim.exp_bound)}: exp stays below sqrt({fmt(lim.max)}) = "
            f"{fmt(math.sqrt(lim.max))}, so a product of two still fits\n"
            f"{last}"
        )
    if kind == "cast":
        return (
            f"fin = torch.finfo(torch.{dtype})\n"
            f"y = x.clamp(fin.min, fin.max).to(torch.{dtype}){was}"
        )
    clip = "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # before step()"
    if kind == "matmul" and recurrent:
        lines = [
            f"for name, w in {ref}.named_parameters():   # recurrent weights, gain <= 1",
            "    if 'weight_hh' in name: nn.init.orthogonal_(w)",
            "# or nonlinearity='tanh' (saturates), or nn.LSTM / nn.GRU (gated)",
            clip,
        ]
    elif kind == "matmul":
        lines = [
            "self.norm = nn.LayerNorm(d)   # in __init__; h = self.norm(h) before this product",
            "nn.init.xavier_uniform_(w)    # initial weights of gain ~1, not larger",
            clip,
        ]
    else:
        lines = [clip, *(lr or ['for g in optimizer.param_groups: g["lr"] /= 10'])]
    if first and kind != "other":
        return "\n".join(lines)
    if kind != "other":
        return "\n".join([*lines[-1:], *lines[:-1]])  # grew in training: clipping first
    return "\n".join([*lines, "# and normalize what grows (nn.LayerNorm) before this op"])


_OPERAND = r"[A-Za-z_][\w.]*(?:\[[^\]]*\])?"
_UPCASTS = (
    (
        re.compile(
            rf"\b((?:torch|F)\.(?:exp|exp2|expm1|softmax|log_softmax|logsumexp))\(({_OPERAND})"
        ),
        r"\1(\2.float()",
    ),
    (
        re.compile(
            rf"\b(?!torch\.|F\.)({_OPERAND})\.(exp|exp2|expm1|softmax|log_softmax|logsumexp)\("
        ),
        r"\1.float().\2(",
    ),
)


def upcast_line(code: str | None) -> str | None:
    """The user's line with the overflowing operand cast to float32, when it is one of the
    usual shapes (``x.exp()``, ``torch.softmax(x, ...)``, ``a @ b``); else None.

    >>> upcast_line("e = logits.exp()  # by hand")
    'e = logits.float().exp()'
    """
    if not code:
        return None
    line = code.split("#", 1)[0].strip()
    for pattern, repl in _UPCASTS:
        new, n = pattern.subn(repl, line, count=1)
        if n:
            return new
    return _upcast_matmul(line)


def _fix(
    kind: str,
    name: str,
    dtype: str,
    lim: DtypeLimits | None,
    code: str | None,
    *,
    device: str,
    ref: str = "model",
    arg: float = math.nan,
    scalar: bool = False,
    loss: bool = False,
) -> str:
    """Low precision: compute the op in float32, or train in bfloat16 (float32's range).
    ``arg``: an exp's largest argument; ``scalar``: the exp's input is one value (a learned
    0-dim scale); ``loss``: the op ran in loss code, outside the modules."""
    plain = code.split("#", 1)[0].strip() if code else ""
    was = f"  # was: {plain}" if plain else ""
    bf16 = f"# or train in bfloat16: torch.autocast({device}, dtype=torch.bfloat16)"
    if kind in ("softmax", "exp") and lim is not None:
        bounded = _bounded_exp(kind, name, lim, code, arg=arg, scalar=scalar)
        if bounded is not None:
            return bounded
    if kind == "matmul":
        mine = _upcast_matmul(code)
        body = (
            f"    {mine}{was}"
            if mine is not None
            else f"    ...   # the product at this line, with .float() on both operands{was}"
        )
        hint = (
            "" if loss else "# attention: scale q before the product: q = q * q.shape[-1] ** -0.5\n"
        )
        return (
            f"with torch.autocast(device_type={device}, enabled=False):\n"
            f"{body}\n"
            f"# (float32 for this product; cast back with .to(torch.{dtype}) if needed)\n"
            f"{hint}{bf16}"
        )
    fixed = upcast_line(code)
    if fixed is not None and kind != "cast":
        return (
            f"{fixed}{was}\n"
            "# (compute this op in float32; cast back with .to(torch."
            f"{dtype}) if needed)\n"
            "# or train in bfloat16, where exp overflows only above "
            f"{fmt(_exp_bound('bfloat16'))}"
        )
    if kind == "backward":
        return (
            "scaler = torch.amp.GradScaler()\n"
            f"with torch.autocast(device_type={device}, dtype=torch.float16):\n"
            "    loss = criterion(model(x), y)      # model weights stay float32\n"
            "scaler.scale(loss).backward()\n"
            "scaler.step(optimizer); scaler.update()\n"
            "nanwatch.watch(model, criterion, scaler=scaler)\n"
            "# the scaler skips a step whose gradients overflow and halves its scale until "
            "they fit\n"
            f"{bf16}"
        )
    if kind in ("softmax", "exp"):
        return (
            f"e = x.float().exp(){was}\n"
            "probs = torch.softmax(x.float(), dim=-1)   # softmax/log_softmax: upcast "
            "the input\n"
            "# or train in bfloat16, where exp overflows only above "
            f"{fmt(_exp_bound('bfloat16'))}"
        )
    if kind == "cast":
        return (
            f"fin = torch.finfo(torch.{dtype})\n"
            f"y = x.clamp(fin.min, fin.max).to(torch.{dtype}){was}\n"
            "# or keep this tensor in float32"
        )
    op = name.rstrip("_")
    mine = rewrite_call(code, [op], lambda e: f"{paren(e)}.float()") if op else None
    if mine is not None:
        return f"{mine}{was}\n# (compute it in float32; cast back with .to(torch.{dtype}))\n{bf16}"
    if op:
        where = "in the loss code" if loss else f"in {ref}'s forward"
        return (
            f"# {where}, call {op} on .float() inputs and cast the result back\n"
            f"# with .to(torch.{dtype}) (under autocast: inside torch.autocast("
            f"device_type={device}, enabled=False))\n"
            f"{bf16}"
        )
    return (
        f"{ref}.float()   # once, after building the model: this module computes in float32\n"
        f"# and give it x.float(); cast its output back with .to(torch.{dtype}) where needed\n"
        f"{bf16}"
    )


def _bounded_exp(
    kind: str,
    name: str,
    lim: DtypeLimits,
    code: str | None,
    *,
    arg: float,
    scalar: bool,
) -> str | None:
    """The fix of a low-precision exp that a float32 upcast cannot mend: an argument past
    float32's exp bound too (bound the argument; a softmax subtracts its max), or a
    one-value argument (a learned scale), whose float32 result times a tensor of ``lim``'s
    dtype is computed in that dtype again (type promotion)."""
    f32 = _exp_bound("float32")
    plain = code.split("#", 1)[0].strip() if code else ""
    was = f"  # was: {plain}" if plain else ""
    op = name.rstrip("_")
    past = math.isfinite(arg) and arg > f32
    if kind == "softmax" and past:
        return (
            f"{_max_subtracted(code, op)}{was}\n"
            f"# subtract the row max first (the dim you normalize over): every exp is then at "
            f"most 1; the argument reached {fmt(arg)}, past float32's exp bound {fmt(f32)} too, "
            "so float32 or bfloat16 would still overflow\n"
            "# or the whole softmax in one call, stable: torch.softmax(x, dim=-1)"
        )
    if kind != "exp" or not (past or scalar) or op not in _BARE_EXP:
        return None
    bound = lim.exp_bound / (math.log(2) if op == "exp2" else 1.0)
    cap = math.floor(bound / 2 * 10) / 10
    bounds = f"-{cap}, {cap}" if op in _BOTH_SIDES else f"max={cap}"
    fixed = rewrite_call(code, [op], lambda e: f"{paren(e)}.clamp({bounds})")
    first = fixed if fixed is not None else f"y = torch.{op}(x.clamp({bounds}))"
    why = (
        f"# {cap} = half of {fmt(lim.exp_bound)}: exp stays below sqrt({fmt(lim.max)}) = "
        f"{fmt(math.sqrt(lim.max))}, so a product of two still fits in {lim.name}"
    )
    if past:
        return (
            f"{first}{was}\n{why}\n"
            f"# the argument reached {fmt(arg)}, past float32's exp bound {fmt(f32)} too: "
            "float32 or bfloat16 would overflow as well; bound it"
        )
    return (
        f"{first}{was}\n{why}\n"
        f"# .float() alone does not help: a one-value (0-dim) float32 tensor times a "
        f"{lim.name} tensor is computed in {lim.name}; or compute the whole product in "
        "float32 (.float() on every tensor operand)"
    )


def _max_subtracted(code: str | None, op: str) -> str:
    """The user's exp line with the row max subtracted from the argument (a stable
    softmax by hand), or the same on a named placeholder when the line is unknown.

    >>> _max_subtracted("e = torch.exp(scores)", "exp")
    'e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))'
    >>> _max_subtracted("e = (q @ k).exp()  # scores", "exp")
    'e = ((q @ k) - (q @ k).amax(dim=-1, keepdim=True)).exp()'
    """
    line = code.split("  #", 1)[0] if code else ""
    function = re.search(rf"\b(?:torch\.special|torch|special)\.{re.escape(op)}\(", line)

    def wrap(e: str) -> str:
        shifted = f"{paren(e)} - {paren(e)}.amax(dim=-1, keepdim=True)"
        return shifted if function else f"({shifted})"

    fixed = rewrite_call(code, [op], wrap)
    if fixed is not None:
        return fixed
    return f"e = torch.{op}(x - x.amax(dim=-1, keepdim=True))   # x: this exp's argument"


def _upcast_matmul(code: str | None) -> str | None:
    """The user's line with both operands of its first ``@`` cast to float32 (operands
    may be method calls: ``f @ f.transpose(1, 2)``); None when there is none.

    >>> _upcast_matmul("g = f @ f.transpose(1, 2)  # gram")
    'g = f.float() @ f.transpose(1, 2).float()'
    """
    if not code:
        return None
    line = code.split("  #", 1)[0].rstrip()
    for m in re.finditer(r"(?<![@=])@(?![@=])", line):
        end = m.start() - 1
        while end >= 0 and line[end] == " ":
            end -= 1
        begin = postfix_start(line, end) if end >= 0 else None
        start = m.end()
        while start < len(line) and line[start] == " ":
            start += 1
        stop = _postfix_end(line, start)
        if begin is None or stop is None:
            continue
        left, right = line[begin : end + 1], line[start:stop]
        return (
            f"{line[:begin]}{paren(left)}.float() {line[end + 1 : start].strip()} "
            f"{paren(right)}.float(){line[stop:]}"
        )
    return None


def _postfix_end(line: str, start: int) -> int | None:
    """End (exclusive) of the postfix expression starting at ``start`` (``a.b(x)[0]``,
    ``(u * v).t()``); None when none starts there."""
    i = start
    while i < len(line):
        c = line[i]
        if c in "([":
            close = _closing(line, i)
            if close is None:
                return None
            i = close + 1
        elif c.isalnum() or c in "_.":
            i += 1
        else:
            break
    return i if i > start else None


def _closing(line: str, at: int) -> int | None:
    depth = 0
    for i in range(at, len(line)):
        if line[i] in "([{":
            depth += 1
        elif line[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return None


def _exp_bound(dtype: str) -> float:
    lim = limits(dtype)
    return lim.exp_bound if lim is not None else math.nan


# ---------------------------------------------------------------------- NW102


def _measured(rec: Record, scaled: bool) -> bool:
    if rec.stat is None or rec.phase in (Phase.GRADIENT, Phase.INPUT):
        return rec.phase is Phase.INPUT and rec.stat is not None and rec.source is None
    return not (rec.phase is Phase.BACKWARD and scaled)


@rule(
    "NW102",
    title="Overflow headroom nearly gone",
    severity="warning",
    summary=(
        "A float16/bfloat16/float8 tensor's max |x| is within a factor of the dtype's "
        "largest value (thresholds.headroom): the next spike overflows to inf."
    ),
    early=True,
    priority=40,
)
def headroom(ctx: RuleContext) -> Iterator[Diagnosis]:
    frac = ctx.thresholds.headroom
    scaled = bool(ctx.facts.get("scaler"))
    worst: dict[str, tuple[float, Record, DtypeLimits]] = {}
    for r in ctx.trace.records:
        lim = low_precision(r.dtype)
        if lim is None or not _measured(r, scaled) or r.stat is None:
            continue
        m = r.stat.magnitude
        if not math.isfinite(m) or m < frac * lim.max:
            continue
        ratio = m / lim.max
        key = r.role if r.phase is Phase.PARAMETER else r.path
        if key not in worst or ratio > worst[key][0]:
            worst[key] = (ratio, r, lim)
    if not worst:
        return
    ranked = sorted(worst.values(), key=lambda t: -t[0])
    ratio, top, lim = ranked[0]
    evidence = []
    for ratio_i, r, lim_i in ranked[:5]:
        near = (
            f"; {count(r.stat.near_max, 'value')} within a factor of 2 of it"
            if r.stat is not None and r.stat.near_max
            else ""
        )
        evidence.append(
            f"max |x| = {fmt(r.stat.magnitude if r.stat else math.nan)} in {r.dtype} at "
            f"{r.where}: {ratio_i:.0%} of the largest finite {r.dtype} value "
            f"{fmt(lim_i.max)}{near}"
        )
    if len(ranked) > 5:
        evidence.append(f"and {len(ranked) - 5} more")
    param = top.role if top.phase is Phase.PARAMETER else None
    yield ctx.diagnosis(
        path=top.path,
        phase=top.phase.value,
        parameter=param,
        evidence=evidence,
        explanation=(
            f"{top.dtype} cannot hold values beyond {fmt(lim.max)}. A tensor already at "
            f"{ratio:.0%} of that overflows to inf on the next spike (a larger batch, a "
            "sharper input, one more optimizer step), and the inf becomes NaN downstream. "
            "No value is bad yet: this is the warning before it happens."
        ),
        fix=(
            "# give these values range: bfloat16 has float32's range\n"
            f"with torch.autocast(device_type={device_type(None, top.device)}, "
            "dtype=torch.bfloat16):\n"
            "    out = model(x)\n"
            f"# or keep {top.path} in float32: model.get_submodule({top.path!r}).float() "
            "and cast its input"
            if top.phase is not Phase.PARAMETER
            else "# weights growing toward the limit: lower the learning rate, add weight "
            "decay,\n# or keep float32 master weights: model.float() + torch.autocast(...)"
        ),
    )


# ---------------------------------------------------------------------- trends


@dataclass(frozen=True)
class Trend:
    slope: float  #: growth per step
    steps: float  #: steps until ``limit`` at this rate
    first: float
    last: float
    span: int  #: steps the fit covers


def predict(points: Sequence[tuple[int, float]], limit: float, *, min_points: int) -> Trend | None:
    """Linear growth of the last points (step, value) toward ``limit``: None unless the
    values grow steadily (at least 2/3 of the step-to-step changes are increases).

    >>> predict([(0, 1.0), (1, 2.0), (2, 3.0), (3, 4.0)], 10.0, min_points=4).steps
    6.0
    """
    pts = [(s, v) for s, v in points if math.isfinite(v)][-16:]
    if len(pts) < max(min_points, 3):
        return None
    ups = sum(b[1] > a[1] for a, b in itertools.pairwise(pts))
    if ups < (2 * (len(pts) - 1)) / 3:
        return None
    xs = [float(s) for s, _ in pts]
    ys = [v for _, v in pts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    if den == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den
    if slope <= 0:
        return None
    last = ys[-1]
    steps = max(0.0, (limit - last) / slope)
    return Trend(slope, steps, ys[0], last, int(xs[-1] - xs[0]))


def _class_scores(rec: Record) -> bool:
    """Shaped like class scores: (N, C, ...) with C >= 2 (a regression head's (N, 1) is not)."""
    return len(rec.shape) >= 2 and rec.shape[1] >= 2


def _logit_max(trace: StepTrace) -> tuple[float, str] | None:
    """Largest value of the model's low-precision class-score outputs, and their dtype."""
    best: tuple[float, str] | None = None
    for r in first_root_outputs(trace):
        if low_precision(r.dtype) is None or not _class_scores(r):
            continue
        v = signed_max(r.stat)
        if math.isfinite(v) and (best is None or v > best[0]):
            best = (v, r.dtype)
    return best


_STABLE_LOSSES = frozenset({"ce", "nll", "bce_logits"})


def _only_stable_losses(trace: StepTrace, rec: Record) -> bool:
    """Whether every recorded consumer of ``rec``'s tensor is a loss that never computes a
    plain exp of it (cross-entropy and friends subtract the max, or upcast)."""
    ids = {rec.index}
    ids.update(r.index for r in trace.records if r.phase is Phase.FORWARD and r.source in ids)
    # the modules that took it (a loss module, or any other), and the functional losses
    # (F.cross_entropy: their guard's note names the record of their input)
    kinds: list[str | None] = []
    for r in trace.records:
        if r.phase is Phase.INPUT and r.source in ids:
            call = trace.call(r.call)
            kinds.append(loss_kind(call.module_type) if call is not None and call.is_loss else None)
    kinds.extend(
        loss_kind(str(n.data.get("loss") or n.path))
        for n in trace.notes
        if n.kind == "loss_input" and n.data.get("input_source") in ids
    )
    return bool(kinds) and all(k in _STABLE_LOSSES for k in kinds)


@rule(
    "NW103",
    title="Logits approaching the exp overflow bound",
    severity="warning",
    summary=(
        "The model's float16/bfloat16 outputs grow toward log(finfo.max) (11.09 in "
        "float16): any exp or softmax computed on them in that dtype is about to overflow."
    ),
    early=True,
    priority=35,
)
def logits_exp_bound(ctx: RuleContext) -> Iterator[Diagnosis]:
    cur = ctx.memo(ctx.trace, "logit_max", _logit_max)
    if cur is None:
        return
    value, dtype = cur
    lim = low_precision(dtype)
    if lim is None:
        return
    bound = lim.exp_bound
    points = [(t.step, v[0]) for t in ctx.history if (v := ctx.memo(t, "logit_max", _logit_max))]
    points.append((ctx.step, value))
    min_hist = ctx.thresholds.min_history
    trend = predict(points, bound, min_points=min_hist + 1)
    near = value >= ctx.thresholds.exp_headroom * bound
    horizon = ctx.thresholds.trend_horizon
    floor = ctx.thresholds.trend_floor
    soon = trend is not None and value < bound and trend.steps <= horizon and value >= floor * bound
    if not ((near and trend is not None) or soon):
        return
    root = next(
        (r for r in first_root_outputs(ctx.trace) if r.dtype == dtype and _class_scores(r)),
        None,
    )
    if root is not None and _only_stable_losses(ctx.trace, root):
        return
    evidence = [
        f"largest {dtype} output value {fmt(value)}; exp overflows above {fmt(bound)} = "
        f"log({fmt(lim.max)}) in {dtype}"
    ]
    if trend is not None:
        evidence.append(
            f"it grew from {fmt(trend.first)} to {fmt(trend.last)} over {trend.span} steps "
            f"(+{fmt(trend.slope)} per step)"
            + (
                f": at this rate it passes {fmt(bound)} in about {math.ceil(trend.steps)} steps"
                if value < bound
                else ""
            )
        )
    yield ctx.diagnosis(
        path=root.path if root is not None else None,
        phase=Phase.FORWARD.value,
        evidence=evidence,
        explanation=(
            f"In {dtype}, exp(x) overflows for x above {fmt(bound)}. Logits that keep "
            "growing (nothing pulls them down: ignored pixels, padding, a rare class) reach "
            "that bound; a stable softmax or F.cross_entropy survives it, but any exp, "
            f"hand-written softmax or logsumexp computed in {dtype} returns inf, then NaN. "
            "Harmless if every exp on these logits runs in float32."
        ),
        fix=(
            "logits = model(x)\n"
            "probs = torch.softmax(logits.float(), dim=1)    # exp/softmax in float32\n"
            "loss = F.cross_entropy(logits.float(), target)  # the loss too"
        ),
    )


_Mags = dict[tuple[str, str, str], tuple[float, str]]


def _low_magnitudes(trace: StepTrace, scaled: bool) -> _Mags:
    out: _Mags = {}
    for r in trace.records:
        if low_precision(r.dtype) is None or not _measured(r, scaled) or r.stat is None:
            continue
        m = r.stat.magnitude
        if not math.isfinite(m):
            continue
        key = (r.phase.value, r.path, r.role)
        if key not in out or m > out[key][0]:
            out[key] = (m, r.dtype)
    return out


@rule(
    "NW104",
    title="Magnitude growing toward overflow",
    severity="warning",
    summary=(
        "A low-precision tensor's max |x| grows steadily over the recorded steps and, at "
        "this rate, passes the dtype's largest value within thresholds.trend_horizon steps."
    ),
    early=True,
    priority=36,
)
def growth_to_overflow(ctx: RuleContext) -> Iterator[Diagnosis]:
    scaled = bool(ctx.facts.get("scaler"))
    key = "low_mags_scaled" if scaled else "low_mags"
    current = ctx.memo(ctx.trace, key, lambda tr: _low_magnitudes(tr, scaled))
    if not current or len(ctx.history) < ctx.thresholds.min_history:
        return
    past = [(t.step, ctx.memo(t, key, lambda tr: _low_magnitudes(tr, scaled))) for t in ctx.history]
    horizon = ctx.thresholds.trend_horizon
    floor = ctx.thresholds.trend_floor
    min_hist = ctx.thresholds.min_history
    found: list[tuple[Trend, tuple[str, str, str], str, DtypeLimits]] = []
    for k, (value, dtype) in current.items():
        lim = low_precision(dtype)
        if lim is None or value < floor * lim.max:
            continue
        pts = [(s, m[k][0]) for s, m in past if k in m]
        pts.append((ctx.step, value))
        trend = predict(pts, lim.max, min_points=min_hist + 1)
        if trend is not None and trend.steps <= horizon:
            found.append((trend, k, dtype, lim))
    if not found:
        return
    found.sort(key=lambda f: f[0].steps)
    trend, (phase, path, role), dtype, lim = found[0]
    evidence = [
        f"max |x| of {p} ({ph}, {ro}) in {d} grew from {fmt(t.first)} to {fmt(t.last)} over "
        f"{t.span} steps (+{fmt(t.slope)} per step): it passes {fmt(li.max)} in about "
        f"{math.ceil(t.steps)} steps"
        for t, (ph, p, ro), d, li in found[:5]
    ]
    yield ctx.diagnosis(
        path=path,
        phase=phase,
        parameter=role if phase == Phase.PARAMETER.value else None,
        evidence=evidence,
        explanation=(
            f"Nothing is inf yet, but {path}'s values grow every step and {dtype} stops at "
            f"{fmt(lim.max)}. Weights that grow without bound (a learning rate too high, no "
            "weight decay) or activations that nothing normalizes overflow on a predictable "
            "step; the trend says which."
        ),
        fix=(
            "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
            "optimizer = torch.optim.AdamW(model.parameters(), lr=lr / 10, weight_decay=0.01)\n"
            "# or give the values range: torch.autocast("
            f"{device_type(None, *(r.device for r in ctx.trace.records if r.path == path))}, "
            "dtype=torch.bfloat16)"
        ),
    )
