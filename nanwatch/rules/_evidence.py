"""Shared reading of records for the built-in rules: number formatting, what an aten op
event means (overflow, log of zero, division by zero, ...), and the data flow into losses.

Private: rule families import it; users write rules against :mod:`nanwatch.records`.
"""

from __future__ import annotations

import ast
import functools
import itertools
import math
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from nanwatch._domains import Domain, domain_of
from nanwatch.records import (
    LOSS_PATH,
    Anomaly,
    AnomalyKind,
    Call,
    Note,
    OpEvent,
    Phase,
    Record,
    StepTrace,
    TensorStat,
)
from nanwatch.stats import DtypeLimits, dtype_limits

# ---------------------------------------------------------------------- numbers


def forward_params(module: Any) -> tuple[str, ...]:
    """The names of ``module``'s forward's positional parameters, in order, without
    ``self`` and stopping at ``*args``: ``forward(self, c, x)`` -> ``("c", "x")``; ``()``
    when its signature cannot be read. The watcher passes them to the rules as the fact
    ``forward_params`` (``{call path: names}``), so a fix can call ``input[1]`` by the
    name the model's code gives it."""
    import inspect

    fwd = getattr(module, "forward", None)
    try:
        params = inspect.signature(fwd).parameters.values() if fwd is not None else ()
    except (TypeError, ValueError):
        return ()
    names: list[str] = []
    for param in params:
        if param.kind not in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            break
        names.append(param.name)
    return tuple(names)


def fmt(x: float | int | None) -> str:
    """A number for a sentence: 4 significant digits, exponent when large or tiny.

    >>> fmt(11.0903), fmt(65504.0), fmt(1.5625e10), fmt(0.0), fmt(float("nan"))
    ('11.09', '65504', '1.56e+10', '0', 'NaN')
    """
    if x is None:
        return "?"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    a = abs(x)
    if a >= 1e6 or a < 1e-3:
        return f"{x:.3g}"
    if a >= 1e4 and float(x).is_integer():
        return f"{int(x)}"
    return f"{x:.4g}"


def count(n: int, noun: str) -> str:
    """``count(3, "value")`` -> ``'3 values'``; thousands separated."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def short_op(op: str) -> str:
    """``aten.exp.default`` -> ``aten.exp``; other overloads are kept (``aten.div.Tensor``)."""
    return op[: -len(".default")] if op.endswith(".default") else op


def operands(node: ast.expr, op: type[ast.operator]) -> list[ast.expr]:
    """The operands of a chain of one binary operator, left to right: ``a + b + c`` with
    ``ast.Add`` gives ``[a, b, c]``; any other node is its own one operand.

    >>> [ast.unparse(n) for n in operands(ast.parse("a * b * (c + d)", mode="eval").body,
    ...                                   ast.Mult)]
    ['a', 'b', 'c + d']
    """
    if isinstance(node, ast.BinOp) and isinstance(node.op, op):
        return [*operands(node.left, op), *operands(node.right, op)]
    return [node]


def packet(op: str) -> str:
    """``aten.div.Tensor`` -> ``div``."""
    parts = op.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


@functools.lru_cache(maxsize=64)
def limits(dtype: str | None) -> DtypeLimits | None:
    """``nanwatch.stats.dtype_limits`` by the dtype's name as records store it."""
    return dtype_limits(dtype) if dtype else None


@functools.lru_cache(maxsize=64)
def low_precision(dtype: str | None) -> DtypeLimits | None:
    """Limits of a floating dtype of 16 bits or fewer (float16, bfloat16, float8), else None."""
    lim = limits(dtype)
    return lim if lim is not None and lim.low_precision else None


def describe_stat(s: TensorStat | None) -> str:
    """``min -17.16, max 11.52 (4,096 values)`` with the non-finite and zero counts known."""
    if s is None:
        return "not measured"
    if s.numel == 0:
        return "empty (0 values)"
    parts = [f"min {fmt(s.min)}, max {fmt(s.max)}"]
    extra = []
    if s.nan:
        extra.append(f"{s.nan:,} NaN")
    if s.posinf:
        extra.append(f"{s.posinf:,} +inf")
    if s.neginf:
        extra.append(f"{s.neginf:,} -inf")
    if s.zeros:
        extra.append(f"{s.zeros:,} exact zero{'s' if s.zeros != 1 else ''}")
    if s.finite_amax is not None and not s.finite:
        extra.append(f"max |finite| {fmt(s.finite_amax)}")
    tail = f" ({', '.join(extra)}; {s.numel:,} values)" if extra else f" ({s.numel:,} values)"
    return parts[0] + tail


def has_zero(s: TensorStat | None) -> bool:
    if s is None:
        return False
    if s.zeros is not None:
        return s.zeros > 0
    return s.min == 0.0 or s.max == 0.0


def signed_max(s: TensorStat | None) -> float:
    """The largest finite value (exp overflows on the positive side)."""
    if s is None or math.isnan(s.max):
        return math.nan
    if math.isinf(s.max):
        return s.finite_amax if s.finite_amax is not None else math.nan
    return s.max


# ---------------------------------------------------------------------- op events

_LOG = frozenset(
    {
        "log",
        "log2",
        "log10",
        "log1p",
        "log_",
        "xlogy",
        "special_xlogy",
        "special_xlog1py",
        "special_entr",
    }
)
_DIV = frozenset({"div", "div_", "true_divide", "floor_divide", "reciprocal", "remainder", "fmod"})
_ROOT = frozenset({"sqrt", "sqrt_", "rsqrt", "pow", "pow_", "float_power"})
_SOFTMAX = frozenset(
    {"_softmax", "softmax", "_safe_softmax", "_log_softmax", "log_softmax", "special_softmax"}
)
EXP_LIKE = frozenset(
    {"exp", "exp_", "exp2", "expm1", "sinh", "cosh", "logsumexp", "softplus"} | _SOFTMAX
)
MATMUL = frozenset(
    {
        "mm",
        "bmm",
        "addmm",
        "baddbmm",
        "addbmm",
        "matmul",
        "linear",
        "mv",
        "addmv",
        "dot",
        "einsum",
        "convolution",
        "_convolution",
        "conv1d",
        "conv2d",
        "conv3d",
        "_scaled_mm",
        "_scaled_dot_product_attention_math",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
    }
)
CAST = frozenset({"_to_copy", "to", "copy_", "_to_dtype"})

_NODE_CLASS = {
    "Sqrt": "root",
    "Rsqrt": "root",
    "Pow": "root",
    "Cdist": "root",
    "Norm": "root",
    "Div": "div",
    "Reciprocal": "div",
    "Log": "log",
    "Log2": "log",
    "Log10": "log",
    "Log1P": "log",
    "Xlogy": "log",
}


def node_base(node: str | None) -> str:
    """``SqrtBackward0`` -> ``Sqrt``."""
    return re.sub(r"Backward\d*$", "", node or "")


def inputs_of(ev: OpEvent) -> list[TensorStat]:
    return [s for _, s in ev.inputs if s is not None]


def input_named(ev: OpEvent, *names: str) -> TensorStat | None:
    for name, s in ev.inputs:
        if name in names:
            return s
    return None


def first_input(ev: OpEvent) -> TensorStat | None:
    return ev.inputs[0][1] if ev.inputs else None


def other_input(ev: OpEvent, name: str) -> TensorStat | None:
    """A tensor argument the checker recorded outside ``inputs`` (integer, bool or empty),
    by schema name."""
    for n, s in ev.other_inputs:
        if n == name:
            return s
    return None


def output_named(ev: OpEvent, name: str) -> TensorStat | None:
    """An output of a multi-output op by schema name (``total_weight``)."""
    for n, s in ev.outputs:
        if n == name:
            return s
    return None


def argument(ev: OpEvent, *names: str) -> TensorStat | None:
    """A tensor argument by schema name, whether floating with values or not."""
    found = input_named(ev, *names)
    if found is not None:
        return found
    for n in names:
        s = other_input(ev, n)
        if s is not None:
            return s
    return None


def scalar_num(ev: OpEvent, key: str) -> float | None:
    v = ev.scalars.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return None


def device_type(ev: OpEvent | None, *fallbacks: str | None) -> str:
    """``"cpu"``/``"cuda"`` for code a fix emits, from the op's device or the record's; the
    expression ``x.device.type`` when neither is known (never a guessed ``'cuda'``)."""
    for d in (ev.device if ev is not None else None, *fallbacks):
        if d:
            return repr(d.split(":", 1)[0])
    return "x.device.type"


def denominator(ev: OpEvent) -> TensorStat | None:
    """The denominator of a division op (``other``; ``reciprocal``'s ``self``)."""
    if packet(ev.op).rstrip("_") == "reciprocal":
        return first_input(ev)
    den = input_named(ev, "other")
    if den is not None:
        return den
    ins = inputs_of(ev)
    if len(ins) > 1:
        return ins[1]
    return integer_denominator(ev)


def integer_denominator(ev: OpEvent) -> TensorStat | None:
    """The denominator of a division when it is an integer or bool tensor (a count:
    ``lengths``, ``mask.sum()``): the checker records its min, max and numel apart from
    the floating inputs."""
    if packet(ev.op).rstrip("_") == "reciprocal":
        return None
    s = other_input(ev, "other")
    return s if s is not None and s.numel > 0 else None


def scalar_base(ev: OpEvent) -> float | None:
    """The Python number raised to a tensor power (``aten.pow.Scalar``: ``1e6 ** t``):
    its tensor input is the exponent, not the base. None for other events."""
    if input_named(ev, "self") is not None or not any(n == "exponent" for n, _ in ev.inputs):
        return None
    return scalar_num(ev, "self")


def _exponent(ev: OpEvent) -> float | None:
    e = ev.scalars.get("exponent")
    if isinstance(e, (int, float)) and not isinstance(e, bool):
        return float(e)
    return None


def smallest_magnitude(den: TensorStat | None) -> float | None:
    """The smallest |d| of a denominator known to hold no zero (all of one sign), else
    None (zeros, or a sign change that may hide one)."""
    if den is None or has_zero(den) or den.nan or not (den.min > 0 or den.max < 0):
        return None
    return den.min if den.min > 0 else -den.max


def near_zero_denominator(ev: OpEvent) -> bool:
    """A division that overflowed because its denominator was tiny (below 1, one sign, no
    zero) while its numerator had not exploded (below sqrt(finfo.max)), in a dtype of
    float32's range: in float16 x / 1e-4 overflows for x above 6.6, and float32 is the fix."""
    closest = smallest_magnitude(denominator(ev))
    lim = limits(ev.dtype)
    if closest is None or lim is None or lim.short_range or not closest < 1.0:
        return False
    num = input_named(ev, "self", "input")
    return num is None or num.magnitude < math.sqrt(lim.max)


def classify(ev: OpEvent) -> str:
    """What an op event is: ``overflow``, ``log``, ``div``, ``root`` (sqrt / fractional
    power outside its domain), ``domain`` (another op outside its real domain: acos of
    1.0000001, atanh of 1), ``reduce`` (a mean or variance over too few elements),
    ``masked-softmax``, ``hidden-nan`` (a backward node whose saved forward values already
    held NaN: torch.where or a mask hid it from the loss), ``inf-arith`` (a forward op that
    made NaN of the infinities it was given: -inf - (-inf), 0 × inf, inf / inf; see
    :func:`inf_arithmetic`), ``neginf-input``
    (a forward op given a -inf, which it turned into inf or NaN), ``inf-input`` (a forward
    op given a +inf, which it passed on as ±inf: finite × inf, not an overflow; see
    :func:`inf_came_in`; or any arithmetic op given a non-finite Python number, see
    :func:`nonfinite_scalars`), ``injected`` (a constant -inf put in on purpose),
    ``log-zero`` (a log-probability output holding log 0 by definition, or a CTC loss of
    +inf its ``zero_infinity=True`` zeroes; see :func:`log_zero`), ``impossible`` (a CTC loss
    of +inf without ``zero_infinity``: a target its input cannot align) or ``other``.

    >>> from nanwatch.records import OpEvent, Phase, TensorStat
    >>> ev = OpEvent("aten.exp.default", Phase.FORWARD, "head", "+inf",
    ...              TensorStat(0, math.inf, 4), [("self", TensorStat(0, 12.0, 4))],
    ...              dtype="float16")
    >>> classify(ev)
    'overflow'
    """
    if nonfinite_scalars(ev) and not (ev.injected and ev.born == "-inf"):
        return "inf-input"  # x * inf of a Python number (a schedule at 1 / 0): not made here
    if ev.injected:
        return "injected"
    born_inf = "+inf" in ev.born or "-inf" in ev.born
    if ev.phase is Phase.BACKWARD and ev.node and any(s.has_nan for s in inputs_of(ev)):
        # what the node saved in forward already held NaN: the forward value was NaN and
        # hidden (torch.where, a mask by 0) before the loss; backward multiplies 0 by it
        return "hidden-nan"
    if ev.phase is Phase.BACKWARD and ev.node:
        cls = _NODE_CLASS.get(node_base(ev.node))
        if cls is not None:
            return cls
        if packet(ev.op) in EXP_LIKE and any(s.has_posinf for s in inputs_of(ev)):
            return "overflow"  # the forward's exp was inf (hidden by a min or a where)
        if node_domain(ev.node) is not None:
            return "domain"  # acos's backward at ±1: whatever aten op it runs (rsqrt, div)
    name = packet(ev.op)
    zero = log_zero(ev)
    if zero is not None:
        return zero  # log 0 of a log-probability table, not a value past the dtype's max
    if name in _SOFTMAX:
        x = first_input(ev)
        if x is not None and x.has_neginf and not x.has_posinf and not x.has_nan:
            return "masked-softmax"
        return "overflow" if born_inf or (x is not None and x.has_posinf) else "other"
    if inf_arithmetic(ev) is not None:
        return "inf-arith"  # -inf - (-inf), 0 × inf: the infinities came from upstream
    short = shortfall(ev)
    if short is not None and short.kind != "var":
        return "reduce"  # 0/0 of a mean over nothing, whatever -inf the input also held
    if ev.phase is Phase.FORWARD and any(s.has_neginf for s in inputs_of(ev)):
        return "neginf-input"  # it was given a -inf (a log of 0 upstream): not its doing
    if born_inf and inf_came_in(ev):
        return "inf-input"  # finite × inf, -1 × inf: the inf was in an input already
    if name in _LOG:
        return "log"
    if name in _DIV:
        den = denominator(ev)
        zero_scalar = scalar_num(ev, "other") == 0.0
        spans_zero = den is not None and den.zeros is None and den.min <= 0 <= den.max
        if has_zero(den) or zero_scalar or (spans_zero and den is integer_denominator(ev)):
            return "div"  # an integer count spanning 0 holds it: integers have no tiny values
        if den is not None and born_inf and not near_zero_denominator(ev):
            return "overflow"  # exploded numerators: x / d went past the max
        number = scalar_num(ev, "other")
        if den is None and number is not None and born_inf and "other" not in dict(ev.inputs):
            return "overflow"  # x / 1e-4 past the max: a Python divisor that is not 0
        return "div"
    if name in _ROOT:
        e = _exponent(ev)
        base = first_input(ev)
        number = scalar_base(ev)
        if number is not None:  # number ** tensor (rotary theta = base ** (i / d))
            if number > 0:
                return "overflow" if born_inf else "other"
            return "root"
        if name in ("sqrt", "sqrt_", "rsqrt"):
            return "root"
        if e is not None and (e >= 1 and float(e).is_integer()) and born_inf:
            return "overflow"
        if e is not None and e > 0 and float(e).is_integer():
            return "overflow" if born_inf else "other"
        if base is not None and (base.min < 0 or has_zero(base)):
            return "root"
        return "overflow" if born_inf else "root"
    if outside_domain(ev) is not None:
        return "domain"
    if short is not None:
        return "reduce"
    if born_inf:
        return "overflow"
    return "other"


# ---------------------------------------------------------------------- log of zero

#: ops returning a CTC loss first: +inf for a target its input cannot align (probability 0)
_CTC = frozenset({"_ctc_loss", "ctc_loss", "_cudnn_ctc_loss"})
#: outputs that are log-probability tables by definition, by op and output name: the
#: forward variables log_alpha of ``_ctc_loss`` (log 0 = -inf for every unreachable state)
_LOG_TABLES: dict[str, frozenset[str]] = {"_ctc_loss": frozenset({"output[1]"})}
#: schema names of outputs that are log-sum-exps (an attention kernel's ``logsumexp``:
#: -inf for a query row whose every key is masked)
_LOG_OUTPUTS = frozenset({"logsumexp", "log_sumexp", "softmax_lse", "lse"})
_LOG_SOFTMAX = frozenset({"_log_softmax", "log_softmax", "special_log_softmax"})


def log_zero(ev: OpEvent) -> str | None:
    """``log-zero`` when every infinity a forward op made from finite inputs is a log of
    probability 0 its output holds by definition, not a value past the dtype's max: -inf
    in a log-probability output (``_ctc_loss``'s log_alpha table, an attention kernel's
    ``logsumexp``, a log_softmax whose probability underflowed to 0), and the +inf CTC loss
    of a target the input cannot align when ``zero_infinity=True`` zeroes it on purpose;
    ``impossible`` for that +inf loss without ``zero_infinity`` (the data's fault, not a
    range); None otherwise.

    >>> from nanwatch.records import OpEvent, Phase, TensorStat
    >>> lp = TensorStat(-2.2, -1.4, 240)
    >>> ev = OpEvent("aten._ctc_loss.Tensor", Phase.FORWARD, "CTCLoss", "+inf, -inf",
    ...              TensorStat(7.6, math.inf, 4, posinf=1), [("log_probs", lp)],
    ...              scalars={"blank": 0, "zero_infinity": 1},
    ...              outputs=[("output[0]", TensorStat(7.6, math.inf, 4, posinf=1)),
    ...                       ("output[1]", TensorStat(-math.inf, 3.6, 520, neginf=109))])
    >>> log_zero(ev), classify(ev)
    ('log-zero', 'log-zero')
    """
    if ev.phase is not Phase.FORWARD or "NaN" in ev.born or ev.injected:
        return None
    born = {k.strip() for k in ev.born.split(",")}
    if not born <= {"+inf", "-inf"} or any(s.has_posinf or s.has_nan for s in inputs_of(ev)):
        return None
    name = packet(ev.op)
    if name in _LOG_SOFTMAX:
        return "log-zero" if born == {"-inf"} else None  # log(p) of a p that became 0
    outs = ev.outputs or [("output[0]", ev.output)]
    tables = _LOG_TABLES.get(name, frozenset()) | _LOG_OUTPUTS
    rest = [s for n, s in outs if n not in tables]
    if any(s.has_neginf or s.has_nan for s in rest):
        return None  # a -inf outside the log tables
    if any(s.has_posinf for n, s in outs if n in tables):
        return None  # log tables hold probabilities of at most 1: a +inf is not a log 0
    if "+inf" not in born:
        return "log-zero" if len(rest) < len(outs) else None
    if name not in _CTC or any(s.has_posinf for s in rest[1:]):
        return None
    return "log-zero" if scalar_num(ev, "zero_infinity") == 1 else "impossible"


# ---------------------------------------------------------------------- infinities


def inf_came_in(ev: OpEvent) -> bool:
    """A forward op that made ±inf (no NaN) from inputs of which one already held an
    infinity: it multiplied, added or negated the inf it was given (finite × inf, -1 × inf)
    and made none from finite values. Not a division by a denominator holding zeros (x/0
    is the division's own inf), and not an op given NaN.

    >>> from nanwatch.records import OpEvent, Phase, TensorStat
    >>> w = TensorStat(0.77, math.inf, 5, nan=0, posinf=1, neginf=0)
    >>> ev = OpEvent("aten.mul.Tensor", Phase.FORWARD, "ce", "-inf",
    ...              TensorStat(-math.inf, -0.9, 80, neginf=16),
    ...              [("self", TensorStat(-2.2, -1.1, 80)), ("other", w)])
    >>> inf_came_in(ev), classify(ev)
    (True, 'inf-input')
    """
    if ev.phase is not Phase.FORWARD or ev.injected or "NaN" in ev.born:
        return False
    ins = inputs_of(ev)
    if not any(s.has_posinf or s.has_neginf for s in ins) or any(s.has_nan for s in ins):
        return False
    return not (packet(ev.op) in _DIV and has_zero(denominator(ev)))


#: arithmetic ops whose number argument, when non-finite, is passed on (g * inf = ±inf)
_SCALAR_ARITH = frozenset(
    {"mul", "multiply", "div", "divide", "true_divide", "add", "sub", "subtract", "rsub", "pow"}
)


def nonfinite_scalars(ev: OpEvent) -> list[tuple[str, float]]:
    """The non-finite Python numbers an arithmetic op was given (``g * ctx.lambd`` with
    ``lambd = inf``), by schema name, when the op's non-finite output came from them: the
    op made nothing from its tensors. Empty for other ops (a ``masked_fill`` value of
    ``-inf`` is a mask) and for an op whose tensors already held NaN.

    >>> from nanwatch.records import OpEvent, Phase, TensorStat
    >>> ev = OpEvent("aten.mul.Tensor", Phase.BACKWARD, None, "-inf",
    ...              TensorStat(-math.inf, math.inf, 8, nan=0, posinf=4, neginf=4),
    ...              [("self", TensorStat(-0.004, 0.003, 8))], {"other": math.inf},
    ...              node="GradReverseBackward")
    >>> nonfinite_scalars(ev), classify(ev)
    ([('other', inf)], 'inf-input')
    """
    name = packet(ev.op).rstrip("_")
    if name not in _SCALAR_ARITH or any(s.has_nan for s in inputs_of(ev)):
        return []
    return [
        (k, v)
        for k, v in ev.scalars.items()
        if isinstance(v, float)
        and (not math.isfinite(v) or _past_range(name, k, v, ev.dtype))
        and not k.endswith("_made_by")
    ]


#: ops that make ±inf of a number past float32's range as they do of inf (``g * 1e40``),
#: and, of a division, the number divided (``1e40 / x``)
_PAST_RANGE_ARITH = frozenset({"mul", "multiply", "add", "sub", "subtract", "rsub"})
_PAST_RANGE_DIV = frozenset({"div", "divide", "true_divide"})


def _past_range(name: str, key: str, v: float, dtype: str | None) -> bool:
    """A finite Python number that is inf where ``name`` computes: past float32's largest
    value, given to an op of a float32, float16 or bfloat16 tensor (the two short types
    compute with float32 numbers), where it makes ±inf as inf would."""
    if dtype not in ("float32", "float16", "bfloat16") or not math.isfinite(v):
        return False
    if name not in _PAST_RANGE_ARITH and not (name in _PAST_RANGE_DIV and key == "self"):
        return False
    f32 = limits("float32")
    return f32 is not None and abs(v) > f32.max


def inf_inputs(ev: OpEvent) -> list[tuple[str, TensorStat]]:
    """The inputs of ``ev`` that hold an infinity, by schema name."""
    return [(n, s) for n, s in ev.inputs if s is not None and (s.has_posinf or s.has_neginf)]


_SUBTRACT = frozenset({"sub", "rsub"})
_ADD = frozenset({"add"})
_MULTIPLY = frozenset({"mul", "multiply"})
_QUOTIENT = frozenset({"div", "true_divide", "divide"})
#: ops that sum products or values: a -inf and a +inf term, or 0 × inf, make NaN inside
_SUMS = MATMUL | frozenset({"sum", "mean", "cumsum", "index_add", "scatter_add", "addcmul"})


def inf_arithmetic(ev: OpEvent) -> str | None:
    """The undefined IEEE operation a forward op computed when it made NaN from inputs that
    hold infinities and no NaN: ``-inf - (-inf)``, ``-inf + inf``, ``0 × -inf``,
    ``inf / inf``, or a sum of products holding them. None for other events and for other
    ops (sin(inf) is outside sin's domain, not arithmetic on two infinities).

    >>> from nanwatch.records import OpEvent, Phase, TensorStat
    >>> e = TensorStat(-math.inf, 0.7, 6, nan=0, posinf=0, neginf=2)
    >>> ev = OpEvent("aten.sub.Tensor", Phase.FORWARD, "soft", "NaN",
    ...              TensorStat(math.nan, math.nan, 6, nan=2), [("self", e), ("other", e)])
    >>> inf_arithmetic(ev)
    '-inf - (-inf)'
    """
    if ev.phase is not Phase.FORWARD or "NaN" not in ev.born or ev.injected:
        return None
    ins = inputs_of(ev)
    if any(s.has_nan for s in ins):
        return None
    neg = any(s.has_neginf for s in ins)
    pos = any(s.has_posinf for s in ins)
    if not (neg or pos):
        return None
    inf = "-inf" if neg and not pos else "inf"
    name = packet(ev.op).rstrip("_")
    if name in _SUBTRACT:
        return "-inf - (-inf)" if inf == "-inf" else "inf - inf"
    if name in _ADD:
        return "-inf + inf"
    if name in _MULTIPLY:
        return f"0 × {inf}"
    if name in _QUOTIENT:
        num = input_named(ev, "self", "input")
        den = denominator(ev)
        both = all(s is not None and (s.has_neginf or s.has_posinf) for s in (num, den))
        return "inf / inf" if both else None  # else 0/0 beside the inf: NW111's
    if name in _SUMS:
        return "a sum holding -inf and +inf terms, or 0 × inf"
    return None


#: autograd nodes (``Log`` of ``LogBackward0``) whose output holds -inf where their input
#: was 0: a -inf they made is a log of 0
_LOG_NODES = frozenset(
    {"Log", "Log2", "Log10", "Log1P", "LogSoftmax", "Xlogy", "SpecialXlog1Py", "LogSigmoid"}
)
#: autograd nodes that write a constant into chosen positions: a -inf they made is a mask
_MASK_NODES = frozenset(
    {"MaskedFill", "Where", "IndexFill", "IndexPut", "MaskedScatter", "Fill", "Scatter"}
)
#: ops that create a tensor full of a constant: a -inf there is an initial value (the start
#: of a running max), not the mask itself
_INIT_OPS = frozenset({"full", "full_like", "new_full", "scalar_tensor", "empty", "fill"})


@dataclass(frozen=True)
class InfSource:
    """Where the infinities an op was given came from."""

    #: ``mask`` (a constant ±inf put in: masked_fill, full), ``log``, ``state`` (read from
    #: a buffer or parameter of the module: ``self.dist``), ``unknown``
    kind: str
    events: tuple[OpEvent, ...]  #: the traced ops that put it in, in execution order
    record: Record | None  #: where a -inf was first seen (an input made by untraced code)
    node: str | None = None  #: the autograd node that made it, when read from a record
    #: a loss module was watched (a root call of one): a forensic re-run may name it
    criterion: bool = True
    #: the op's operand that held the infinity is the module's own tensor (kind ``state``)
    state: StateOperand | None = None

    @property
    def masks(self) -> tuple[OpEvent, ...]:
        """The events that masked (masked_fill, where), not those that made a constant
        tensor (torch.full(-inf), the start of a running max)."""
        return tuple(e for e in self.events if packet(e.op).rstrip("_") not in _INIT_OPS)


@dataclass(frozen=True)
class StateOperand:
    """An operand of a binary op, written on the user's line as the module's own tensor
    (``-self.slopes * self.dist``: ``other`` is ``self.dist``), with what it held."""

    name: str  #: the op's input: ``self``, ``other``
    expr: str  #: as written: ``self.dist``
    attr: str  #: the attribute: ``dist``
    kind: str  #: ``buffer``, ``parameter`` or ``tensor attribute``, from the class's source
    stat: TensorStat
    #: the other operand, as written (``-self.slopes``), its short name and what it held
    partner: tuple[str, str, TensorStat] | None = None


_BINOP_OF = {
    "mul": ast.Mult,
    "multiply": ast.Mult,
    "add": ast.Add,
    "sub": ast.Sub,
    "rsub": ast.Sub,
    "div": ast.Div,
    "true_divide": ast.Div,
}


def _one_binop(ev: OpEvent) -> tuple[str, int, ast.BinOp] | None:
    """The statement of the user's line holding the one operator of a binary op (``*`` of
    ``aten.mul``), the offset of the parsed text in it, and the operator's node."""
    kind = _BINOP_OF.get(packet(ev.op).rstrip("_"))
    if kind is None:
        return None
    found: list[tuple[str, int, ast.BinOp]] = []
    for stmt in statements(ev.code):
        parsed = _parsed(stmt)
        if parsed is None:
            continue
        tree, shift = parsed
        found += [
            (stmt, shift, n)
            for n in ast.walk(tree)
            if isinstance(n, ast.BinOp) and isinstance(n.op, kind)
        ]
    return found[0] if len(found) == 1 else None


def _segment(stmt: str, shift: int, node: ast.expr) -> tuple[int, int]:
    return shift + node.col_offset, shift + (node.end_col_offset or node.col_offset)


def binary_operands(ev: OpEvent) -> dict[str, str] | None:
    """The user's expressions for inputs ``self`` and ``other`` of a binary op whose line
    holds exactly one such operator (``bias = -self.slopes * self.dist``)."""
    one = _one_binop(ev)
    if one is None:
        return None
    stmt, shift, node = one
    left, right = (stmt[slice(*_segment(stmt, shift, e))] for e in (node.left, node.right))
    if packet(ev.op).rstrip("_") == "rsub":
        left, right = right, left
    return {"self": left, "other": right}


def wrapped_binop(ev: OpEvent) -> tuple[str, str, str] | None:
    """(the binary op's expression, its left, its right operand) as written, when the
    user's line holds exactly one such operator and does more with its result than assign
    or return it (``(logZ - score).mean()``): the op's output is that expression, not what
    the line makes of it. None otherwise.

    >>> from nanwatch.records import OpEvent, Phase, TensorStat
    >>> s = TensorStat(0.0, 1.0, 4)
    >>> ev = OpEvent("aten.sub.Tensor", Phase.FORWARD, "crf", "NaN", s, [("self", s)],
    ...              code="return (logZ - score).mean()")
    >>> wrapped_binop(ev)
    ('logZ - score', 'logZ', 'score')
    """
    one = _one_binop(ev)
    if one is None:
        return None
    stmt, shift, node = one
    parsed = _parsed(stmt)
    body = parsed[0].body if parsed is not None and isinstance(parsed[0], ast.Module) else []
    value = getattr(body[0], "value", None) if len(body) == 1 else None
    if not isinstance(value, ast.expr):
        return None
    where = (value.col_offset, value.end_col_offset)
    if where == (node.col_offset, node.end_col_offset):
        return None  # the line assigns or returns the op's result itself
    whole = stmt[slice(*_segment(stmt, shift, node))]
    left, right = (stmt[slice(*_segment(stmt, shift, e))] for e in (node.left, node.right))
    if packet(ev.op).rstrip("_") == "rsub":
        left, right = right, left
    return whole, left, right


def _attr_of(expr: str) -> str | None:
    """``dist`` of ``self.dist``, ``-self.dist``, ``self.dist[:T, :T]``; None for anything
    else (a computation on it, a local name)."""
    try:
        node: ast.expr = ast.parse(expr.strip(), mode="eval").body
    except SyntaxError:
        return None
    while isinstance(node, (ast.UnaryOp, ast.Subscript)):
        node = node.operand if isinstance(node, ast.UnaryOp) else node.value
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    ):
        return node.attr
    return None


def _state_kind(source: str | None, attr: str) -> str:
    """How the class made ``self.<attr>``, read from its file: a buffer, a parameter."""
    import linecache

    path = (source or "").rpartition(":")[0]
    text = "".join(linecache.getlines(path)) if path else ""
    quoted = rf"""\(\s*(['"]){re.escape(attr)}\1"""
    if re.search(r"register_buffer" + quoted, text):
        return "buffer"
    if re.search(r"register_parameter" + quoted, text) or re.search(
        rf"self\.{re.escape(attr)}\s*=\s*(?:nn\.|torch\.nn\.)?Parameter\(", text
    ):
        return "parameter"
    return "tensor attribute"


def state_operand(trace: StepTrace, ev: OpEvent) -> StateOperand | None:
    """The operand of ``ev`` that held the infinity, when the user's line reads it from the
    module itself (``self.dist``: a buffer, a parameter) and no record of the traced calls
    held such a tensor: the inf was made when the tensor was (``__init__``), not in a step."""
    ops = binary_operands(ev)
    if ops is None:
        return None
    for name, s in inf_inputs(ev):
        attr = _attr_of(ops.get(name, ""))
        if attr is None:
            continue
        came = any(
            m.stat is not None
            and m.stat.numel == s.numel
            and (m.stat.has_posinf or m.stat.has_neginf)
            for r in trace.records
            if r.phase is Phase.INPUT and r.path == ev.path and (m := exact(trace, r)) is not None
        )
        if came:
            continue  # the module's input held it: an activation from upstream
        partner = None
        other = "other" if name == "self" else "self"
        st = input_named(ev, other)
        if other in ops and st is not None:
            partner = (ops[other], _attr_of(ops[other]) or ops[other], st)
        return StateOperand(name, ops[name].strip(), attr, _state_kind(ev.source, attr), s, partner)
    return None


def inf_source(trace: StepTrace, anomaly: Anomaly, event: OpEvent | None) -> InfSource:
    """The origin of the infinities ``event`` (the op that was given them; None when no op
    was traced) was given: constant ±inf written by traced ops (the chain's, and those of
    the same module before it: a masked_fill and the -inf start of a segment max), a log
    read from the autograd node of the record where a -inf was first seen, else unknown."""
    chain = anomaly.op.chain() if anomaly.op is not None else []
    found: list[OpEvent] = [e for e in chain if e.injected and "inf" in e.born]
    if event is not None and any(e is event for e in trace.ops):
        for e in trace.ops:
            if e is event:
                break
            same = event.path is not None and e.path == event.path
            if same and e.injected and "inf" in e.born and all(e is not f for f in found):
                found.append(e)
    order = {id(e): i for i, e in enumerate(trace.ops)}
    found.sort(key=lambda e: order.get(id(e), -1))
    rec = anomaly.neginf_source
    crit = watched_criterion(trace)
    if found:
        return InfSource("mask", tuple(found), rec, criterion=crit)
    if any(classify(e) == "log" for e in chain):
        return InfSource("log", (), rec, criterion=crit)
    node = _producer_node(trace, rec) if rec is not None else None
    base = node_base(node)
    if base in _LOG_NODES:
        return InfSource("log", (), rec, node, criterion=crit)
    if base in _MASK_NODES:
        return InfSource("mask", (), rec, node, criterion=crit)
    state = state_operand(trace, event) if event is not None else None
    if state is not None:
        return InfSource("state", (), rec, node, criterion=crit, state=state)
    return InfSource("unknown", (), rec, node, criterion=crit)


def watched_criterion(trace: StepTrace) -> bool:
    """A loss module was passed to watch (a root call of one), not only loss code."""
    return any(c.root and c.is_loss and c.path != LOSS_PATH for c in trace.calls)


def _producer_node(trace: StepTrace, rec: Record) -> str | None:
    """The autograd node of the tensor ``rec`` measured, following ``source`` links back to
    the record of the module output that produced it."""
    cur: Record | None = rec
    hops = 0
    while cur is not None and hops < 64:
        hops += 1
        if cur.grad_fn:
            return cur.grad_fn
        if cur.source is None:
            return None
        cur = trace.record(cur.source)
    return None


_NEG_INF_LITERAL = re.compile(
    r"""-\s*float\(\s*(['"])inf(?:inity)?\1\s*\)"""
    r"""|float\(\s*(['"])-inf(?:inity)?\2\s*\)"""
    r"|-\s*(?:math|torch|np|numpy)\.inf\b",
    re.IGNORECASE,
)


def replace_neg_inf(code: str | None, replacement: str) -> str | None:
    """The user's line with its -inf literal (``float("-inf")``, ``-math.inf``, ...)
    replaced; None when the line holds none (or is unknown).

    >>> replace_neg_inf('e = e.masked_fill(~m, float("-inf"))  # mask', "MIN")
    'e = e.masked_fill(~m, MIN)'
    """
    if not code:
        return None
    line = code.split("  #", 1)[0].rstrip()
    new, n = _NEG_INF_LITERAL.subn(replacement, line)
    return new if n else None


def _operand_end(line: str, start: int) -> int | None:
    """End (exclusive) of the postfix expression starting at ``start`` (``m[dst]``,
    ``x.max(1).values``, ``(a + b)``)."""
    i = start
    while i < len(line) and line[i] == " ":
        i += 1
    begin = i
    while i < len(line):
        c = line[i]
        if c in "([":
            j = _close(line, i + 1)
            if j is None:
                return None
            i = j + 1
        elif c.isalnum() or c in "_.":
            i += 1
        else:
            break
    return i if i > begin else None


def rewrite_subtrahend(code: str | None, wrap: Callable[[str], str]) -> str | None:
    """The user's line with the right operand of its one binary ``-`` passed through
    ``wrap``; None when the line has no such subtraction or more than one.

    >>> rewrite_subtrahend("p = torch.exp(e - m[dst])", lambda r: f"{r}.clamp_min(L)")
    'p = torch.exp(e - m[dst].clamp_min(L))'
    """
    if not code:
        return None
    return _rewrite_right_operand(code.split("  #", 1)[0].rstrip(), "-", wrap)


def _rewrite_right_operand(line: str, op: str, wrap: Callable[[str], str]) -> str | None:
    """``line`` with the right operand of its one binary ``op`` (spaced: ``a - b``,
    ``a / b``) passed through ``wrap``; None when it has none, or more than one."""
    hits = [m.start() for m in re.finditer(rf"(?<=[\w\)\]]) {re.escape(op)} (?=[\w(])", line)]
    if len(hits) != 1:
        return None
    start = hits[0] + len(op) + 2
    end = _operand_end(line, start)
    if end is None:
        return None
    return line[:start] + wrap(line[start:end]) + line[end:]


#: the header of a one-line compound statement; a one-line ``def``'s body (``def
#: forward(self, x): return self.head(x)``) is the statement that ran
_HEADER = re.compile(
    r"^(?:(?:async\s+)?(?:with|for|def)|if|elif|else|while|try|except|finally|class)\b"
)


def top_level(text: str, sep: str) -> list[int]:
    """Indices of ``sep`` outside brackets and string literals."""
    out: list[int] = []
    depth, quote = 0, ""
    for i, c in enumerate(text):
        if quote:
            if c == quote and text[i - 1] != "\\":
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == sep and depth == 0:
            out.append(i)
    return out


def statements(code: str | None) -> list[str]:
    """The simple statements of a line of source: split at top-level ``;``, each without
    the header of a one-line compound statement (``with torch.no_grad(): out = f(x)`` ->
    ``out = f(x)``; ``else: y = a / b`` -> ``y = a / b``), comments dropped.

    >>> statements("with torch.no_grad(): out = enc(x); n += 1  # eval")
    ['out = enc(x)', 'n += 1']
    """
    if not code:
        return []
    line = code.split("  #", 1)[0].strip()
    cuts = [-1, *top_level(line, ";"), len(line)]
    out = []
    for a, b in itertools.pairwise(cuts):
        stmt = line[a + 1 : b].strip()
        while _HEADER.match(stmt):
            colons = [i for i in top_level(stmt, ":") if not _in_lambda(stmt, i)]
            if not colons:
                break
            stmt = stmt[colons[0] + 1 :].strip()
        if stmt:
            out.append(stmt)
    return out


def _in_lambda(text: str, colon: int) -> bool:
    """The colon ends a lambda's parameters (``key=lambda t: t[0]``)."""
    return re.search(r"\blambda\b[^:]*$", text[:colon]) is not None


def _statement_key(stmt: str) -> tuple[str, str] | None:
    """What a simple statement writes: the target of an assignment, ``return``, or the
    method an expression statement calls (``x.div_``); None for anything else, or for text
    that is not exactly one statement."""
    try:
        body = ast.parse(stmt).body
    except SyntaxError:
        return None
    if len(body) != 1:
        return None
    node = body[0]
    if isinstance(node, ast.Assign):
        return "=", " = ".join(ast.unparse(t) for t in node.targets)
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return "=", ast.unparse(node.target)
    if isinstance(node, ast.Return):
        return "return", ""
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        return "call", ast.unparse(node.value.func)
    return None


#: lr schedulers that compute each lr from the one they find in the group (``lr *= gamma``):
#: a lower ``g["lr"]`` stays lowered
_CHAINED_SCHEDULERS = frozenset(
    {
        "StepLR",
        "MultiStepLR",
        "ConstantLR",
        "LinearLR",
        "ExponentialLR",
        "PolynomialLR",
        "CosineAnnealingLR",
        "MultiplicativeLR",
        "ReduceLROnPlateau",
    }
)
#: lr schedulers that set each lr from a peak they were given, not from the optimizer's
_PEAK_SCHEDULERS = frozenset({"OneCycleLR", "CyclicLR"})
#: lr schedulers made of others, each holding its own base
_COMPOSITE_SCHEDULERS = frozenset({"SequentialLR", "ChainedScheduler"})
#: a fix's line that sets a param group's learning rate
_LR_WRITE = re.compile(r"([\w.]+)\.param_groups\b.*\[\s*[\"']lr[\"']\s*\]\s*[*/]?=(?!=)")


def with_scheduler(fix: str, notes: Sequence[Note]) -> str:
    """``fix`` with what keeps its new learning rate when an lr scheduler drives the
    optimizer (its ``"optimizer"`` note names one): LambdaLR (transformers' warmup
    schedules) and CosineAnnealingWarmRestarts set ``lr`` from their ``base_lrs`` at every
    ``step()``, so a lower ``g["lr"]`` alone is undone by the next one; OneCycleLR and
    CyclicLR set it from the peak they were made with. A scheduler that scales the lr it
    finds (StepLR, CosineAnnealingLR) keeps it: nothing is added.

    >>> n = Note("optimizer", "SGD", data={"scheduler": "LambdaLR", "scheduler_variable": "s"})
    >>> fix = with_scheduler('for g in optimizer.param_groups: g["lr"] = 0.001', [n])
    >>> print(fix.splitlines()[1].split("   #")[0])
    s.base_lrs = [g["lr"] for g in optimizer.param_groups]
    """
    lines = fix.splitlines()
    at = next((i for i, ln in enumerate(lines) if _LR_WRITE.search(ln.split("#", 1)[0])), None)
    if at is None:
        return fix
    found = None
    for n in reversed(notes):
        kind = n.data.get("scheduler")
        if n.kind == "optimizer" and isinstance(kind, str):
            found = n
            if f"({n.path}" in lines[at]:  # the optimizer the line names
                break
    if found is None:
        return fix
    kind = str(found.data["scheduler"])
    if kind in _CHAINED_SCHEDULERS or f"{kind}.base_lrs" in fix:
        return fix
    var = found.data.get("scheduler_variable")
    sched = var if isinstance(var, str) and var else "scheduler"
    m = _LR_WRITE.search(lines[at])
    assert m is not None
    optimizer = m.group(1)
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    new = re.search(r"\[\s*[\"']lr[\"']\s*\]\s*=\s*([\d.eE+-]+)", lines[at])
    peak = new.group(1) if new else "a lower one"
    if kind in _PEAK_SCHEDULERS:
        line = (
            f"# {kind} sets the lr from the max_lr it was made with at every {sched}.step(), "
            f"undoing this: make {sched} again with max_lr={peak}"
        )
    elif kind in _COMPOSITE_SCHEDULERS:
        line = (
            f"# {kind}'s schedulers set the lr from the one the optimizer had when they were "
            f"made, undoing this: make {optimizer} with lr={peak}, then the schedulers again"
        )
    else:
        line = (
            f'{sched}.base_lrs = [g["lr"] for g in {optimizer}.param_groups]   # {kind} sets '
            f"the lr from base_lrs at every {sched}.step(): without this line it undoes the "
            "new lr"
        )
    lines.insert(at + 1, indent + line)
    return "\n".join(lines)


def on_its_line(source: str | None, fix: str) -> str:
    """``fix`` with each of its lines that rewrites one statement of the user's line put
    back into that line, so the pasted line keeps what else it held: a one-line compound
    statement's header (``else: score = a / b`` stays under its ``else:``) and the other
    ``;``-separated statements. A line rewritten as one statement that writes what exactly
    one statement of the user's line writes is that statement's rewrite."""
    line = full_statement(source)
    if not line:
        return fix
    code = line.split("  #", 1)[0].strip()
    stmts = statements(code)
    if not stmts or stmts == [code]:
        return fix
    keys = [_statement_key(st) for st in stmts]
    out = []
    for text in fix.split("\n"):
        body, sep, note = text.partition("   #")
        body = body.rstrip()
        key = _statement_key(body) if body and not body.startswith("#") else None
        at = code.find(stmts[keys.index(key)]) if key is not None and keys.count(key) == 1 else -1
        if at >= 0:
            old = stmts[keys.index(key)]
            out.append(code[:at] + body + code[at + len(old) :] + (sep + note if sep else ""))
        else:
            out.append(text)
    return "\n".join(out)


def rewrite_divisor(code: str | None, wrap: Callable[[str], str]) -> str | None:
    """The user's line with the right operand of its one binary ``/`` passed through
    ``wrap``; None when the line has no such division or more than one.

    >>> rewrite_divisor("loss = (tok.sum(1) / lengths).mean()", lambda d: f"{d}.clamp_min(1)")
    'loss = (tok.sum(1) / lengths.clamp_min(1)).mean()'
    """
    found = [st for st in statements(code) if re.search(r"(?<=[\w\)\]]) / (?=[\w(])", st)]
    if len(found) != 1:
        return None
    return _rewrite_right_operand(found[0], "/", wrap)


def infinities(s: TensorStat) -> str:
    """``2 -inf``, ``-inf and 3 +inf``: the infinities a tensor holds, counted when known."""
    parts = []
    if s.has_neginf:
        parts.append(f"{s.neginf:,} -inf" if s.neginf else "-inf")
    if s.has_posinf:
        parts.append(f"{s.posinf:,} +inf" if s.posinf else "+inf")
    return " and ".join(parts)


def put_in(e: OpEvent) -> str:
    """``the -inf came from aten.masked_fill.Scalar(value=-inf) at train.py:14: <code>``."""
    args = ", ".join(
        f"{k}={fmt(v) if isinstance(v, float) else v}"
        for k, v in e.scalars.items()
        if k not in ("evidence", "backward_at")
    )
    line = code_line(e)
    return f"the {e.born} came from {short_op(e.op)}({args})" + (f" {line}" if line else "")


def state_words(ev: OpEvent, st: StateOperand) -> str:
    """``buffer dist holds 6 +inf and slopes holds 1 exact zero``: the module's tensor that
    held the inf, and what the other operand gave it."""
    words = f"{st.kind} {st.attr} holds {infinities(st.stat)}"
    if st.partner is None:
        return words
    _, pname, ps = st.partner
    if packet(ev.op).rstrip("_") in _MULTIPLY and has_zero(ps):
        zeros = count(ps.zeros, "exact zero") if ps.zeros else "exact zeros"
        return f"{words} and {pname} holds {zeros}"
    if ps.has_posinf or ps.has_neginf:
        return f"{words} and {pname} holds {infinities(ps)}"
    return words


def _state_fix(ev: OpEvent, st: StateOperand) -> str | None:
    """The user's line with a product that met a module tensor's inf computed on the
    finite values and masked after: ``(-self.slopes * self.dist.nan_to_num(posinf=0.0))
    .masked_fill(self.dist.isposinf(), torch.finfo(torch.float32).min)``. For a sum, the
    tensor clamped to the dtype's finite range. None when the line or a sign is unclear."""
    one = _one_binop(ev)
    if one is None or st.partner is None:
        return None
    stmt, shift, node = one
    dtype = ev.dtype or "float32"
    side = node.right if st.name == "other" else node.left
    if packet(ev.op).rstrip("_") == "rsub":
        side = node.left if st.name == "other" else node.right
    s0, s1 = _segment(stmt, shift, side)
    t = paren(stmt[s0:s1])
    pos, neg = st.stat.has_posinf, st.stat.has_neginf
    if packet(ev.op).rstrip("_") not in _MULTIPLY:
        clamped = f"{t}.clamp(torch.finfo(torch.{dtype}).min, torch.finfo(torch.{dtype}).max)"
        return (
            f"{stmt[:s0]}{clamped}{stmt[s1:]}   # a finite extreme for {st.attr}'s inf: "
            "inf - inf = NaN, max - max = 0"
        )
    ps = st.partner[2]
    if ps.nan or (pos and neg) or not (ps.max <= 0 or ps.min >= 0):
        return None  # mixed signs: no one fill value is the product's
    negative = (ps.max <= 0) == pos
    fill = f"torch.finfo(torch.{dtype}).{'min' if negative else 'max'}"
    which = "posinf" if pos else "neginf"
    b0, b1 = _segment(stmt, shift, node)
    product = stmt[b0:s0] + f"{t}.nan_to_num({which}=0.0)" + stmt[s1:b1]
    return (
        f"{stmt[:b0]}({product}).masked_fill({t}.is{which}(), {fill}){stmt[b1:]}"
        f"   # mask after multiplying: 0 × inf = NaN"
    )


def _function_names(source: str | None, code: str | None, reach: int = 60) -> set[str] | None:
    """Every name the user's function uses up to line ``source`` (its parameters, what it
    assigns), for checking that a fix's names exist; None when the line is not known."""
    import linecache

    if not code:
        return None
    names = identifiers(code)
    path, _, num = (source or "").rpartition(":")
    if not path or not num.isdigit():
        return names
    here = linecache.getline(path, int(num))
    indent = len(here) - len(here.lstrip())
    for n in range(int(num) - 1, max(0, int(num) - reach), -1):
        text = linecache.getline(path, n)
        if not text.strip():
            continue
        names |= identifiers(text)
        if re.match(r"\s*(?:async\s+)?def\s", text) and len(text) - len(text.lstrip()) < indent:
            break
    return names


_LIBRARY_NAMES = frozenset({"torch", "F", "nn", "math", "float", "int", "nanwatch", "model"})


def _names_known(line: str, known: set[str] | None) -> bool:
    """Every name ``line`` reads is one the user's code has (or a library's): a template
    line naming ``scores`` or ``keep`` the user never wrote is left out."""
    if known is None:
        return True
    parsed = _parsed(line.split("  #", 1)[0].strip())
    if parsed is None:
        return True
    read = {
        n.id for n in ast.walk(parsed[0]) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    }
    return read <= known | _LIBRARY_NAMES


def inf_evidence(ev: OpEvent, src: InfSource, trigger: OpEvent, mode: object) -> list[str]:
    """Evidence for an op that made NaN of the infinities it was given (``inf-arith``): the
    undefined operation, the inputs that held them, where they came from, the line."""
    expr = inf_arithmetic(ev) or "arithmetic on infinities"
    held = [
        f"{nm} holds {infinities(s)}"
        for nm, s in ev.inputs
        if s is not None and (s.has_neginf or s.has_posinf)
    ]
    out = [f"{short_op(ev.op)} computed {expr} = NaN in {ev.dtype}: input " + "; input ".join(held)]
    out += [f"input {nm}: {describe_stat(s)}" for nm, s in ev.inputs[:2]]
    if ev.output.nan:
        out.append(f"output: {ev.output.nan:,} NaN of {ev.output.numel:,} values")
    out += [put_in(e) for e in src.events[:3]]
    rec = src.record
    forensic = mode == "forensic"
    if src.state is not None:
        st = src.state
        out.append(
            f"input {st.name} is {st.expr}, the module's {st.kind} {st.attr}: it holds "
            f"{infinities(st.stat)}, made with the module (not by an op of this step)"
        )
    elif rec is not None and not src.masks:
        made = (
            f"autograd node {src.node}"
            if src.node
            else "code nanwatch did not trace"
            + ("" if forensic else f" ({_forensic_words()} names it)")
        )
        out.append(f"a -inf first appeared in {rec.where}, made by {made}")
    elif rec is None and not src.events and not forensic:
        out.append(f"{_forensic_words()} traces every op and names the one that made the inf")
    line = code_line(ev)
    if line:
        out.append(line)
    if trigger is not ev:
        out.append(f"then {short_op(trigger.op)} carried it to {trigger.born}")
    return out


def _forensic_words() -> str:
    """``mode="forensic"``, or under ``nanwatch run`` the command that runs it."""
    rerun = cli_rerun()
    return rerun if rerun is not None else 'mode="forensic"'


def inf_explanation(ev: OpEvent, src: InfSource) -> str:
    """Why an op made NaN of infinities, by where they came from."""
    expr = inf_arithmetic(ev) or "arithmetic on infinities"
    undefined = f"{expr} has no value, so IEEE arithmetic returns NaN."
    name = packet(ev.op).rstrip("_")
    const = _inf_constants(src)
    if const is not None and name in _MULTIPLY:
        op, sign = const
        if sign == "+inf":
            return (
                f"{undefined} The +inf is a constant {op} wrote (fill value inf: an infinite "
                "interval, distance or bound, not a mask), and the value it was multiplied by "
                "is exactly 0 there (a density or weight a ReLU or a mask set to 0). Use a "
                "large finite value instead of inf (1e10, as reference NeRF does for the last "
                "interval): 0 × 1e10 = 0, and it still acts as infinite elsewhere "
                "(exp(-1e10) = 0). Not torch.finfo(dtype).max: scaled by more than 1 it "
                "overflows to inf again."
            )
        return (
            f"{undefined} The -inf is a constant {op} wrote (fill value -inf: the start of a "
            "running max, a bound), and the value it was multiplied by is exactly 0 there. "
            "Start from torch.finfo(dtype).min instead (0 × finfo.min = 0), or zero those "
            "positions with masked_fill instead of multiplying."
        )
    if src.kind == "mask" and name in _MULTIPLY and _inf_sign(src) == "+inf":
        return (
            f"{undefined} A value masked to +inf was multiplied by 0 (a 0/1 mask or a zero "
            "weight applied after the +inf one). Mask with a large finite value (1e10, or "
            "torch.finfo(dtype).max when nothing scales it up), or zero the masked values "
            "with masked_fill instead of multiplying."
        )
    if src.kind == "mask" and name in _MULTIPLY:
        return (
            f"{undefined} A value masked to -inf was multiplied by 0 (a 0/1 mask or a zero "
            "weight applied after the -inf one). Mask with torch.finfo(dtype).min "
            "(0 × finfo.min = 0), or zero the masked values with masked_fill instead of "
            "multiplying."
        )
    if src.kind == "mask":
        fill = _inf_sign(src)
        if fill == "+inf":
            masked, limit = "+inf", "torch.finfo(dtype).max, the largest finite value"
        elif fill == "-inf":
            masked, limit = "-inf", "torch.finfo(dtype).min, the most negative finite value"
        else:
            masked = "an infinity"
            limit = "torch.finfo(dtype).min for -inf, torch.finfo(dtype).max for +inf"
        return (
            f"{undefined} Values masked to {masked} met another infinity. Mask with "
            f"{limit}, or leave the masked values out of this op (masked_fill(mask, 0.0) "
            "before a sum)."
        )
    if src.kind == "log":
        return f"{undefined} The -inf is a log of 0 (see NW110)."
    if src.state is not None:
        st = src.state
        said = f"{undefined} {state_words(ev, st)}: {expr} = NaN."
        if name in _MULTIPLY:
            part = st.partner[1] if st.partner is not None else "the other operand"
            return (
                f"{said} Mask after multiplying: multiply the finite values, then fill "
                f"where {st.attr} is inf. A large finite value in {st.attr} instead of inf "
                f"gives 0 × max = 0, which leaves those positions unmasked where {part} "
                "is 0."
            )
        return f"{said} Use a large finite value (torch.finfo(dtype).max) instead of inf."
    return undefined + (
        " The infinities came from code nanwatch did not trace: a -inf mask "
        "(masked_fill with float('-inf'), the max of an empty row or segment), an overflow, "
        "or a log of 0 (NW110)."
    )


def _inf_sign(src: InfSource) -> str | None:
    """``+inf`` or ``-inf`` when every traced op that put the infinities in made that one
    sign; None when unknown or mixed."""
    signs = {k for e in src.events for k in e.born.split(", ") if k in ("+inf", "-inf")}
    return next(iter(signs)) if len(signs) == 1 else None


def _inf_constants(src: InfSource) -> tuple[str, str] | None:
    """(the op, ``+inf``/``-inf``) when the infinities came only from ops that create a
    tensor full of a constant (torch.full_like(x, inf): an infinite interval), not from a
    mask written into chosen positions; None otherwise."""
    if src.kind != "mask" or not src.events or src.masks:
        return None
    sign = _inf_sign(src)
    if sign is None:
        return None
    return short_op(src.events[0].op), sign


_POS_INF_LITERAL = re.compile(
    r"""(?<![\w.])float\(\s*(['"])\+?inf(?:inity)?\1\s*\)"""
    r"|(?<![\w.])(?:math|torch|np|numpy)\.inf\b",
    re.IGNORECASE,
)


def replace_pos_inf(code: str | None, replacement: str) -> str | None:
    """The user's line with its +inf literal (``float("inf")``, ``math.inf``) replaced;
    None when the line holds none (or is unknown).

    >>> replace_pos_inf('d = torch.full_like(d[:, :1], float("inf"))  # last', "1e10")
    'd = torch.full_like(d[:, :1], 1e10)'
    >>> replace_pos_inf('m = x.masked_fill(k, float("-inf"))', "1e10") is None
    True
    """
    if not code:
        return None
    line = code.split("  #", 1)[0].rstrip()
    n = 0

    def swap(m: re.Match[str]) -> str:
        nonlocal n
        if line[: m.start()].rstrip().endswith("-"):
            return m.group(0)  # -float("inf"), -math.inf: a -inf
        n += 1
        return replacement

    new = _POS_INF_LITERAL.sub(swap, line)
    return new if n else None


def inf_fix(ev: OpEvent, src: InfSource, *, forensic: bool) -> str:
    """Code for an op that made NaN of infinities: the user's mask line with
    ``torch.finfo(dtype).min`` for its -inf (a template when the line is not known), for a
    subtraction of a max the same line skipping empty rows, and for an unknown origin the
    run that names it."""
    dtype = ev.dtype or "float32"
    finite_min = f"torch.finfo(torch.{dtype}).min"
    masked = src.kind == "mask"
    lines: list[str] = []
    const = _inf_constants(src)
    if const is not None and const[1] == "+inf" and packet(ev.op).rstrip("_") in _MULTIPLY:
        for e in src.events:
            fixed = replace_pos_inf(e.code, "1e10")
            if fixed is not None:
                return f"{fixed}   # not inf: 0 × 1e10 = 0, exp(-1e10) = 0"
        return (
            "# where the tensor is filled with inf: a large finite value instead\n"
            "last = torch.full_like(x[..., :1], 1e10)   # not float('inf'): 0 × 1e10 = 0"
        )
    for m in src.masks:
        fixed = replace_neg_inf(m.code, f"torch.finfo(torch.{m.dtype or dtype}).min")
        line = f"{fixed}   # not -inf: an empty row or segment stays finite"
        if fixed is not None and line not in lines:
            lines.append(line)
    name = packet(ev.op).rstrip("_")
    if src.state is not None:
        fixed = _state_fix(ev, src.state)
        if fixed is not None:
            return fixed
    lse = logsumexp_rewrite(ev.code) if name in _SUBTRACT else None
    if lse is not None:  # a hand-written logsumexp: its empty rows are log(0) = -inf anyway
        line, x, dim, out = lse
        keep = _kept_rows(src.masks, x, dim)
        return "\n".join(
            [
                f"{line}   # was m + log(sum(exp({x} - m))): -inf - (-inf) on an empty row",
                f"keep = {keep}   # rows with a value left: an empty row's logsumexp is "
                "log(0) = -inf",
                f"{out} = {out}[keep]   # leave the empty rows out of the loss",
            ]
        )
    known = _function_names(ev.source, ev.code)

    def ours(line: str) -> list[str]:
        """``line`` when the names it reads are the user's, else nothing."""
        return [line] if _names_known(line, known) else []

    if not lines:
        rerun = cli_rerun()
        if not masked and not forensic and src.state is None and rerun is not None:
            lines.append(f"{rerun}   # names the op that made the inf")
        elif not masked and not forensic and src.state is None:
            crit = src.criterion
            lines += [
                f'with nanwatch.watch(model{", criterion" if crit else ""}, mode="forensic") '
                "as nw:   # names the op that made the inf",
                "    loss = criterion(model(x), y); loss.backward()"
                if crit
                else "    ...   # the same step: forward, loss, backward()",
            ]
        lines += ours(
            "scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)   # not "
            'float("-inf")'
        )
    if name in _SUBTRACT:
        skipped = clamp_where_made(ev, f".clamp_min({finite_min})") or rewrite_subtrahend(
            ev.code, lambda r: f"{r}.clamp_min({finite_min})"
        )
        shown = ours(skipped or f"y = x - m.clamp_min({finite_min})")
        if shown:
            lines += [
                "# or keep -inf and skip empty rows/segments: subtract a finite max (exp gives 0)",
                *shown,
                "# and divide by their sum with .clamp_min(1e-12): an empty one sums to 0",
            ]
    elif name in _MULTIPLY:
        lines += ours("x = x.masked_fill(~keep, 0.0)   # zero masked values before multiplying")
    if not masked and src.state is None:
        lines += ours("logp = F.log_softmax(logits, dim=-1)   # a log of 0: from logits (NW110)")
    if not lines:
        lines = _finite_asserts(ev)
    return "\n".join(lines)


def _finite_asserts(ev: OpEvent) -> list[str]:
    """``assert torch.isfinite(<operand>).all()`` for each of the op's operands on the
    user's line that held an infinity (each operand when the stats do not tell), to put
    above the line: it stops the step where the infinity comes in. A comment when the line
    or its operands are not known."""
    exprs: list[str] = []
    ops = binary_operands(ev)
    if ops is not None:
        held = {n for n, _ in inf_inputs(ev)}
        exprs = [e for n, e in ops.items() if n in held] or list(ops.values())
    else:
        arg = call_argument(ev.code, [packet(ev.op).rstrip("_")])
        exprs = [arg] if arg else []
    out = []
    for e in dict.fromkeys(exprs):
        line = f"assert torch.isfinite({e}).all()"
        if _parsed(line) is not None:
            out.append(line)
    if not out:
        return [
            "# above this line: assert torch.isfinite(t).all() for each tensor the op reads; "
            "the one that fails holds the inf"
        ]
    out[0] += "   # above this line: stops the step where the inf comes in"
    return out


def clamp_where_made(ev: OpEvent, clamp: str) -> str | None:
    """The statement above the op's line, in the same function, that assigns the name
    subtracted there (``m_new = torch.maximum(m, s.amax(-1, keepdim=True))`` for ``s -
    m_new``), with ``clamp`` appended: every later line that subtracts it (an online
    softmax's ``exp(m - m_new)`` too) stays finite. None when the subtrahend is not a plain
    name assigned above."""
    import linecache

    ops = binary_operands(ev)
    name = ops.get("other", "").strip() if ops is not None else ""
    path, _, num = (ev.source or "").rpartition(":")
    if not name.isidentifier() or not path or not num.isdigit():
        return None
    here = linecache.getline(path, int(num))
    indent = len(here) - len(here.lstrip())
    for n in range(int(num) - 1, max(0, int(num) - 60), -1):
        text = linecache.getline(path, n)
        if not text.strip():
            continue
        if re.match(r"\s*(?:async\s+)?def\s", text) and len(text) - len(text.lstrip()) < indent:
            return None
        stmt = full_statement(f"{path}:{n}")
        try:
            tree = ast.parse(stmt or "")
        except SyntaxError:
            continue
        node = tree.body[0] if len(tree.body) == 1 else None
        if not isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if not any(isinstance(t, ast.Name) and t.id == name for t in targets):
            continue
        if not isinstance(node, ast.Assign) or len(targets) != 1 or stmt is None:
            return None  # unpacked, annotated or augmented: not rewritten
        value = ast.get_source_segment(stmt, node.value)
        if value is None:
            return None
        return (
            f"{name} = {paren(value)}{clamp}   # where {name} is made: every line that "
            "subtracts it stays finite"
        )
    return None


def logsumexp_rewrite(code: str | None) -> tuple[str, str, str, str] | None:
    """A logsumexp written by hand on the user's line, ``m + log(exp(x - m).sum(d))``
    (``torch.log``/``.log()``, ``torch.exp``/``.exp()``, ``.sum``/``torch.sum``): the line
    with it replaced by ``torch.logsumexp(x, dim=d)``, ``x``, ``d`` and the name the line
    assigns; None when the line holds none or assigns no plain name.

    >>> logsumexp_rewrite("ll = m + torch.log(torch.exp(lp - m).sum(-1))")[0]
    'll = torch.logsumexp(lp, dim=-1)'
    """
    if not code:
        return None
    line = code.split("  #", 1)[0].strip()
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None
    stmt = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(stmt, ast.Assign) or not isinstance(stmt.targets[0], ast.Name):
        return None
    for node in ast.walk(stmt.value):
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)):
            continue
        for m, log in ((node.left, node.right), (node.right, node.left)):
            found = _log_sum_exp(log, ast.unparse(m))
            if found is None:
                continue
            x, dim, keepdim = found
            args = f"{ast.unparse(x)}, dim={ast.unparse(dim)}"
            if keepdim is not None:
                args += f", keepdim={ast.unparse(keepdim)}"
            seg = ast.get_source_segment(line, node)
            if seg is None:
                return None
            if f"({seg})" in line:  # its parentheses are the call's now
                seg = f"({seg})"
            new = line.replace(seg, f"torch.logsumexp({args})", 1)
            return new, ast.unparse(x), ast.unparse(dim), stmt.targets[0].id
    return None


def _call_of(node: ast.expr, name: str) -> ast.expr | None:
    """The operand of ``torch.<name>(a)`` or ``a.<name>()``."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return None
    if node.func.attr != name:
        return None
    if not node.args and not node.keywords:
        return node.func.value
    if ast.unparse(node.func.value) == "torch" and len(node.args) >= 1:
        return node.args[0]
    return None


def _log_sum_exp(node: ast.expr, m: str) -> tuple[ast.expr, ast.expr, ast.expr | None] | None:
    """``log(exp(x - m).sum(dim[, keepdim]))`` with this ``m``: x, dim and keepdim."""
    inner = _call_of(node, "log")
    if not isinstance(inner, ast.Call) or not isinstance(inner.func, ast.Attribute):
        return None
    if inner.func.attr != "sum":
        return None
    torch_sum = ast.unparse(inner.func.value) == "torch"
    operand = inner.args[0] if torch_sum and inner.args else inner.func.value
    rest = inner.args[1:] if torch_sum else inner.args
    kw = {k.arg: k.value for k in inner.keywords}
    dim = rest[0] if rest else kw.get("dim")
    keepdim = rest[1] if len(rest) > 1 else kw.get("keepdim")
    diff = _call_of(operand, "exp")
    if dim is None or not (isinstance(diff, ast.BinOp) and isinstance(diff.op, ast.Sub)):
        return None
    if ast.unparse(diff.right) != m:
        return None
    return diff.left, dim, keepdim


def _kept_rows(masks: Sequence[OpEvent], x: str, dim: str) -> str:
    """The rows with an unmasked value: from the user's masked_fill (``x.masked_fill(~keep,
    -inf)`` -> ``keep.any(dim=d)``), else the finite values of ``x``."""
    for e in masks:
        line = (e.code or "").split("  #", 1)[0].strip()
        try:
            tree = ast.parse(line)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr in ("masked_fill", "masked_fill_") and node.args:
                mask = node.args[0]
                if isinstance(mask, ast.UnaryOp) and isinstance(mask.op, ast.Invert):
                    return f"{paren(ast.unparse(mask.operand))}.any(dim={dim})"
                return f"(~{paren(ast.unparse(mask))}).any(dim={dim})"
    return f"torch.isfinite({x}).any(dim={dim})"


# ---------------------------------------------------------------------- domains


def node_domain(node: str | None) -> Domain | None:
    """The restricted domain of the forward op of an autograd node (``AcosBackward0`` ->
    acos, ``SpecialNdtriBackward0`` -> ndtri); the logs excepted (NW110's).

    >>> node_domain("AcosBackward0").name, node_domain("LogBackward0")
    ('acos', None)
    """
    base = node_base(node)
    if not base:
        return None
    dom = domain_of(re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", base).lower())
    return dom if dom is not None and dom.family != "log" else None


@dataclass(frozen=True)
class DomainHit:
    """An op given values outside its real domain, with the checker's counts."""

    domain: Domain
    stat: TensorStat | None  #: the restricted argument
    outside: int | None  #: values outside the closed interval (NaN there)
    edge: int | None  #: values on a pole endpoint (±inf there)
    pole: int | None  #: values at a pole at 0, -1, -2, ...

    @property
    def total(self) -> int | None:
        if self.outside is None and self.edge is None and self.pole is None:
            return None
        return (self.outside or 0) + (self.edge or 0) + (self.pole or 0)


def outside_domain(ev: OpEvent) -> DomainHit | None:
    """When ``ev``'s op has a restricted real domain (:mod:`nanwatch._domains`, the logs
    excepted: NW110 speaks for them) and the evidence puts its input outside it: the
    checker's counts, else the input's min and max; an op with no recorded input is taken
    at its word (it made a NaN or inf from finite inputs)."""
    dom = domain_of(ev.op)
    if dom is None or dom.family == "log" or ev.injected:
        return None
    x = input_named(ev, dom.arg)
    counts = {k: int(v) for k in ("n_outside", "n_edge", "n_pole") if (v := scalar_num(ev, k))}
    hit = DomainHit(
        dom,
        x,
        counts.get("n_outside"),
        counts.get("n_edge"),
        counts.get("n_pole"),
    )
    if counts:
        return hit
    if x is None:
        return hit if ev.born else None
    if dom.outside_of(x.min) or dom.outside_of(x.max):
        return hit
    if dom.poles and not (x.min > 0):
        return hit  # a pole may sit between min and max
    return None


# ---------------------------------------------------------------------- reductions

_MEAN = frozenset({"mean"})
_VAR = frozenset({"std", "var", "std_mean", "var_mean"})
_NLL = frozenset(
    {"nll_loss_forward", "nll_loss2d_forward", "nll_loss", "nll_loss2d", "nll_loss_nd"}
)
_MEAN_LOSSES = frozenset({"binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div"})


@dataclass(frozen=True)
class Shortfall:
    """A reduction that divided by a count of 0: a mean over nothing, a variance whose
    N - correction is not positive, a class loss whose targets weigh 0 in total."""

    kind: str  #: ``mean``, ``var``, ``nll``, ``loss`` (another loss with reduction='mean')
    per_output: float | None  #: N: elements reduced into each output
    outputs: int | None  #: number of outputs
    correction: float | None = None  #: var/std
    targets: TensorStat | None = None  #: nll: the target (min, max, numel)
    ignore_index: int | None = None
    weight: TensorStat | None = None  #: nll: the class weights, when given
    total_weight: float | None = None  #: nll: the sum of the targets' weights

    @property
    def all_ignored(self) -> bool:
        t = self.targets
        return (
            t is not None
            and self.ignore_index is not None
            and t.numel > 0
            and t.min == t.max == self.ignore_index
        )


def _mean_reduction(ev: OpEvent) -> bool:
    """reduction='mean': at aten level 0 none, 1 mean, 2 sum; an aten loss called without
    the argument gets its schema default, which is mean for every one of them."""
    r = scalar_num(ev, "reduction")
    return r == 1.0 or r is None


def shortfall(ev: OpEvent) -> Shortfall | None:
    """A reduction over too few elements, read from what the op checker recorded: the
    reduced input's numel against the output's, the correction, the target and the total
    weight of an nll_loss. None when the evidence does not show one.

    >>> from nanwatch.records import OpEvent, Phase, TensorStat
    >>> ev = OpEvent("aten.std.correction", Phase.FORWARD, "m", "NaN",
    ...              TensorStat(math.nan, math.nan, 5), [("self", TensorStat(-1, 1, 5))],
    ...              scalars={"correction": 1})
    >>> s = shortfall(ev)
    >>> s.kind, s.per_output, s.correction
    ('var', 1.0, 1.0)
    """
    if "NaN" not in ev.born and "inf" not in ev.born:
        return None
    name = packet(ev.op).rstrip("_")
    x = argument(ev, "self", "input")
    outs = ev.output.numel
    if name in _MEAN:
        if x is not None and x.numel == 0:
            return Shortfall("mean", 0.0, outs)
        if x is None and not ev.inputs and "NaN" in ev.born:
            return Shortfall("mean", 0.0, outs)  # the checker skips only empty tensors
        return None
    if name in _VAR:
        if x is None or outs <= 0:
            return None
        per = x.numel / outs
        c = scalar_num(ev, "correction")
        corr = 1.0 if c is None else c
        if per - corr <= 0:
            return Shortfall("var", per, outs, correction=corr)
        return None
    if name in _NLL:
        if not _mean_reduction(ev):
            return None
        ii = scalar_num(ev, "ignore_index")
        tw = output_named(ev, "total_weight")
        short = Shortfall(
            "nll",
            0.0 if x is not None and x.numel == 0 else None,
            1,
            targets=other_input(ev, "target"),
            ignore_index=int(ii) if ii is not None else None,
            weight=input_named(ev, "weight"),
            total_weight=tw.max if tw is not None else None,
        )
        if (tw is not None and tw.max == 0.0) or short.all_ignored or short.per_output == 0:
            return short
        return None
    lossy = name.endswith("_loss") or name in _MEAN_LOSSES
    if lossy and _mean_reduction(ev) and x is not None and x.numel == 0:
        return Shortfall("loss", 0.0, outs)
    return None


@dataclass(frozen=True)
class Cause:
    """The op that started the trouble, read from the anomaly's op chain."""

    kind: str  #: see :func:`classify`
    event: OpEvent  #: the op that created the first bad value of this kind
    chain: tuple[OpEvent, ...]  #: the whole chain, oldest first
    trigger: OpEvent  #: the op the anomaly was pinned to (the last of the chain)


def cause_of(anomaly: Anomaly | None) -> Cause | None:
    """The first meaningful op of the anomaly's chain (None without a pinpointed op)."""
    if anomaly is None or anomaly.op is None:
        return None
    chain = anomaly.op.chain()
    kinds = [classify(ev) for ev in chain]
    for ev, k in zip(chain, kinds, strict=True):
        if k == "masked-softmax":
            return Cause(k, ev, tuple(chain), anomaly.op)
    for ev, k in zip(chain, kinds, strict=True):
        if k not in ("injected", "other"):
            return Cause(k, ev, tuple(chain), anomaly.op)
    for ev, k in zip(chain, kinds, strict=True):
        if k != "injected":
            return Cause(k, ev, tuple(chain), anomaly.op)
    return Cause(kinds[-1], chain[-1], tuple(chain), anomaly.op)


def op_fields(ev: OpEvent, anomaly: Anomaly | None = None) -> dict[str, Any]:
    """Diagnosis fields for an op event: module path, op, phase, source line."""
    path = ev.path or (anomaly.path if anomaly is not None else None)
    return {
        "path": path,
        "op": short_op(ev.op),
        "phase": ev.phase.value,
        "source": ev.source,
    }


def code_line(ev: OpEvent) -> str | None:
    """``at train.py:42: e = logits.exp()`` when the op's source line is known."""
    if not ev.source:
        return None
    code = f": {ev.code.strip()}" if ev.code else ""
    return f"at {ev.source}{code}"


_SIMPLE_EXPR = re.compile(r"^[A-Za-z_][\w.]*(?:\[[^\]]*\])?$")


def paren(expr: str) -> str:
    """``x`` -> ``x``; ``a * b`` -> ``(a * b)``: an expression safe to call a method on.

    >>> paren("x[0]"), paren("f(a).sum(-1)"), paren("0.5 * lv"), paren("-x")
    ('x[0]', 'f(a).sum(-1)', '(0.5 * lv)', '(-x)')
    """
    e = expr.strip()
    if _SIMPLE_EXPR.match(e) or (e and postfix_start(e, len(e) - 1) == 0):
        return e
    return f"({e})"


def _close(text: str, start: int) -> int | None:
    """Index of the parenthesis closing the one opened just before ``start``."""
    depth = 1
    for i in range(start, len(text)):
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return None


def _open(text: str, end: int) -> int | None:
    """Index of the parenthesis opening the one that closes at ``end``."""
    depth = 0
    for i in range(end, -1, -1):
        c = text[i]
        if c in ")]}":
            depth += 1
        elif c in "([{":
            depth -= 1
            if depth == 0:
                return i
    return None


def postfix_start(line: str, end: int) -> int | None:
    """Start of the postfix expression ending at ``end`` (``a.b[0].c(x)``, ``(u * v)``).

    >>> line = "y = 2 * f(a).b[0]"
    >>> line[postfix_start(line, len(line) - 1):]
    'f(a).b[0]'
    """
    i = end
    while i >= 0:
        c = line[i]
        if c in ")]":
            j = _open(line, i)
            if j is None:
                return None
            i = j - 1
        elif c.isalnum() or c in "_.":
            i -= 1
        else:
            break
    begin = i + 1
    return begin if begin <= end else None


def call_argument(code: str | None, names: Sequence[str]) -> str | None:
    """The argument of the line's first call to one of ``names`` (what :func:`rewrite_call`
    would wrap): ``torch.sqrt(v + eps)`` and ``(v + eps).sqrt()`` both give ``v + eps``.

    >>> call_argument("s = torch.sqrt(z.var(0) + 1e-4)", ["sqrt"])
    'z.var(0) + 1e-4'
    """
    got: list[str] = []

    def keep(v: str) -> str:
        got.append(v)
        return v

    rewrite_call(code, names, keep)
    return got[0] if got else None


def rewrite_call(code: str | None, names: Sequence[str], wrap: Callable[[str], str]) -> str | None:
    """The user's line with the argument of its first call to one of ``names`` passed
    through ``wrap``: ``torch.acos(c)`` and ``c.acos()`` both get ``wrap("c")`` in place of
    ``c``. None when the line holds no such call (or is unknown). When ``code`` knows the
    part of the line that ran (a :class:`nanwatch._frames.CodeLine`: of ``torch.sqrt(a) if
    ok else torch.sqrt(b)``, the second call), the call inside that part is rewritten.

    >>> rewrite_call("y = torch.acos(a * b)  # angle", ["acos"], lambda e: f"clip({e})")
    'y = torch.acos(clip(a * b))'
    >>> rewrite_call("z = (0.5 * lv).exp() + 1", ["exp"], lambda e: f"{paren(e)}.clamp(max=9)")
    'z = (0.5 * lv).clamp(max=9).exp() + 1'
    """
    if not code:
        return None
    span = getattr(code, "span", None)
    found = list(_calls_of(code, names))
    if span is not None:
        found = [c for c in found if span[0] <= c[0] and c[1] <= span[1]] or found
    if not found:
        return None
    _, _, head, arg, tail = found[0]
    return head + wrap(arg) + tail  # wrap called once: some callers collect its argument


def _calls_of(code: str, names: Sequence[str]) -> Iterator[tuple[int, int, str, str, str]]:
    """For each call to one of ``names`` on the line (see :func:`rewrite_call`): where the
    call begins and ends (its receiver included), and the line cut around the argument
    that :func:`rewrite_call` wraps (before it, the argument, after it)."""
    line = code.split("  #", 1)[0].rstrip()
    alt = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    mod = r"(?:torch\.special|torch\.linalg|torch|special|linalg|F)\."
    for m in re.finditer(rf"(?<![\w])({mod})?({alt})\(", line):
        open_at = m.end()
        close_at = _close(line, open_at)
        if close_at is None:
            continue
        dot = m.start(2) - 1
        if m.group(1) is None and dot >= 0 and line[dot] == ".":  # a method: recv.acos()
            begin = postfix_start(line, dot - 1)
            if begin is None:
                continue
            recv = line[begin:dot]
            if recv.startswith("(") and _close(line, begin + 1) == dot - 1:
                recv = recv[1:-1]  # a parenthesized group: wrap what is inside
            yield begin, close_at + 1, line[:begin], recv, line[dot:]
            continue
        if m.group(1) is None:
            continue  # a bare name: a user function of the same name, not the op
        args = line[open_at:close_at]
        depth, cut = 0, len(args)
        for i, c in enumerate(args):
            if c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
            elif c == "," and depth == 0:
                cut = i
                break
        first = args[:cut]
        lead = first[: len(first) - len(first.lstrip())]
        yield (
            m.start(),
            close_at + 1,
            line[:open_at] + lead,
            first.strip(),
            args[cut:] + line[close_at:],
        )


def module_ref(path: str, *, root: bool = False) -> str:
    """The expression that reaches module ``path`` from the user's model: ``model.enc[0].fc``
    for ``enc.0.fc``; ``model`` for a root (named by its class) or an empty path.

    >>> module_ref("enc.0.fc"), module_ref("Net", root=True)
    ('model.enc[0].fc', 'model')
    """
    if root or not path or not re.fullmatch(r"[\w.]+", path):
        return "model"
    return "model" + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path.split("."))


def anomaly_fields(anomaly: Anomaly) -> dict[str, Any]:
    return {
        "step": anomaly.step,
        "path": anomaly.path,
        "phase": anomaly.record.phase.value,
        "parameter": anomaly.parameter,
    }


def untraced_hint(ctx: Any) -> str:
    """What to run to name the op and line when they are unknown (``ctx``: the rule's
    context, whose facts give the mode and whose notes say whether a replay was skipped)."""
    if ctx.facts.get("mode") == "forensic":
        return "the op was not traced (it ran outside the op checker)"
    if any(
        n.kind == "replay" and n.data.get("skipped") == "distributed" for n in ctx.trace.notes
    ):  # a replay on one rank would block in a collective: no nw.replay
        return (
            "the op and line were not traced in this mode, and a replay on one rank of a "
            "distributed run could block in a collective: run this rank's step with "
            'mode="forensic" or reproduce it in one process'
        )
    rerun = cli_rerun()
    if rerun is not None:  # nanwatch run: the script has no nw and no watch to change
        return f"the op and line were not traced in this mode: run {rerun} to name them"
    return (
        "the op and line were not traced in this mode: run the step again with "
        'nanwatch.watch(..., mode="forensic") or nw.replay(step_fn) to name them'
    )


def cli_rerun(mode: str = "forensic") -> str | None:
    """``nanwatch run --mode forensic train.py --lr 1e-3`` when this process runs the
    script under ``nanwatch run`` (its frames are below nanwatch's launcher): the user
    changes no code, so the advice is the command, with the script and its arguments as
    they were given; None in the user's own process (``nanwatch.watch`` in their code)."""
    import shlex
    import sys

    from nanwatch import _frames

    if not _frames._launchers:
        return None
    argv = [a for a in sys.argv if a] or ["train.py"]
    return f"nanwatch run --mode {mode} " + " ".join(shlex.quote(a) for a in argv)


# ---------------------------------------------------------------------- data flow

_ACT_BY_GRAD_FN = {
    "SigmoidBackward0": "sigmoid",
    "SigmoidBackward1": "sigmoid",
    "SoftmaxBackward0": "softmax",
    "LogSoftmaxBackward0": "log_softmax",
}
_ACT_BY_MODULE = {
    "Sigmoid": "sigmoid",
    "Softmax": "softmax",
    "Softmax2d": "softmax",
    "LogSoftmax": "log_softmax",
}


@dataclass(frozen=True)
class Activation:
    kind: str  #: ``sigmoid``, ``softmax``, ``log_softmax``
    path: str | None  #: the module that applied it, when a module did
    module_type: str | None
    grad_fn: str | None
    via: str  #: ``module`` or ``grad_fn`` (functional call) or ``note``


#: pass-through modules that return the same values (so an activation before them still
#: reaches the loss)
_SAME_VALUES = frozenset(
    {"Identity", "Flatten", "Unflatten", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d"}
)


def activation_of(trace: StepTrace, rec: Record) -> Activation | None:
    """Which activation produced the tensor of ``rec``, following the data flow (``source``
    links) through aliases and pass-through modules back to the producing record: a
    Sigmoid/Softmax module, or (functional ``torch.sigmoid``) the autograd node."""
    cur: Record | None = rec
    by_grad_fn: Activation | None = None
    hops = 0
    while cur is not None and hops < 64:
        hops += 1
        if cur.phase is Phase.FORWARD:
            kind = _ACT_BY_MODULE.get(cur.module_type)
            if kind is not None:
                return Activation(kind, cur.path, cur.module_type, cur.grad_fn, "module")
            call = trace.call(cur.call)
            alias = cur.source is not None and cur.stat is None
            passthrough = call is not None and call.passthrough
            kind = _ACT_BY_GRAD_FN.get(cur.grad_fn or "")
            if kind is not None and by_grad_fn is None:
                own = not alias and not passthrough and call is not None and not call.root
                by_grad_fn = Activation(
                    kind,
                    cur.path if own else None,
                    cur.module_type if own else None,
                    cur.grad_fn,
                    "grad_fn",
                )
            if not alias and not passthrough:
                return by_grad_fn  # a module's own output: the producer
            if passthrough and by_grad_fn is None and cur.module_type not in _SAME_VALUES:
                return None  # ReLU & co. changed the values: not the activation's output
        if cur.source is None:
            return by_grad_fn
        cur = trace.record(cur.source)
    return by_grad_fn


_LOSS_NAMES = {
    "bce": "bce",
    "binarycrossentropy": "bce",
    "crossentropy": "ce",
    "nll": "nll",
    "nllloss2d": "nll",
    "bcewithlogits": "bce_logits",
    "binarycrossentropywithlogits": "bce_logits",
    "kldiv": "kldiv",
    "ctc": "ctc",
}


def loss_kind(name: str | None) -> str | None:
    """``BCELoss``/``F.binary_cross_entropy`` -> ``bce``; ``CrossEntropyLoss`` -> ``ce``;
    ``NLLLoss``/``nll_loss`` -> ``nll``; ``BCEWithLogitsLoss`` -> ``bce_logits``;
    ``KLDivLoss``/``F.kl_div`` -> ``kldiv``; ``CTCLoss``/``F.ctc_loss`` -> ``ctc``.

    >>> loss_kind("F.cross_entropy"), loss_kind("NLLLoss"), loss_kind("MSELoss")
    ('ce', 'nll', None)
    >>> loss_kind("F.kl_div"), loss_kind("KLDivLoss")
    ('kldiv', 'kldiv')
    """
    if not name:
        return None
    n = name.rsplit(".", 1)[-1].lower().replace("_", "")
    return _LOSS_NAMES.get(n, _LOSS_NAMES.get(n.removesuffix("loss")))


@dataclass
class LossUse:
    """One loss call of the step: the module call (when a watched loss module ran it), its
    input record, the record that measured the input, the loss value, and the guard's note."""

    path: str
    kind: str | None  #: see :func:`loss_kind`
    call: Call | None
    input: Record | None  #: the call's ``input[0]`` record
    measured: Record | None  #: ``input`` followed to the record holding its statistics
    output: Record | None
    note: Note | None

    @property
    def value(self) -> float | None:
        """The loss value this call returned, when its output was measured."""
        out = self.output
        if out is not None and out.stat is not None and out.stat.numel == 1:
            return out.stat.max
        return None

    def data(self, key: str, default: Any = None) -> Any:
        if self.note is None:
            return default
        v = self.note.data.get(key, default)
        return default if v is None else v

    @property
    def input_stat(self) -> TensorStat | None:
        return self.measured.stat if self.measured is not None else None

    @property
    def input_dtype(self) -> str | None:
        d = self.data("input_dtype")
        if isinstance(d, str):
            return d
        return self.input.dtype if self.input is not None else None


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def note_num(note: Note | None, key: str) -> float | None:
    return _num(note.data.get(key)) if note is not None else None


def module_loss_target(trace: StepTrace, a: Anomaly) -> Note | None:
    """The ``loss_input`` note of a loss module whose output the anomaly is, when the -inf
    it grew from was in the target the user's code passed it (not a watched module's
    output) and the prediction was finite: ``crit(pred, torch.log(w))`` with a 0 in ``w``.
    The localization names the loss's forward (a -inf is what a mask holds), but the
    target was bad before the loss saw it, as a functional loss's is. None otherwise."""
    src = a.neginf_source
    if a.kind is not AnomalyKind.FORWARD or src is None or src.phase is not Phase.INPUT:
        return None
    call = trace.call(a.record.call)
    if call is None or not call.is_loss or src.call != a.record.call:
        return None
    if src.role == "input[0]" or src.source is not None:
        return None  # the prediction, or a watched module's output: not the user's target
    for n in trace.notes:
        if n.kind != "loss_input" or n.path != call.path:
            continue
        lo, hi = note_num(n, "target_min"), note_num(n, "target_max")
        ins = [note_num(n, "input_min"), note_num(n, "input_max")]
        if lo is None or hi is None or (math.isfinite(lo) and math.isfinite(hi)):
            continue
        if all(v is not None and math.isfinite(v) for v in ins):
            return n
    return None


def log_into_target(trace: StepTrace, a: Anomaly) -> OpEvent | None:
    """The log op (forensic mode's) that made the -inf a loss read in its target, when the
    loss op itself is the op pinned: its ``target`` input is non-finite, every other input
    finite, and the chain's first op is a forward log of a quotient that made -inf (a box
    encoding's ``log(gw / aw)`` of a box of zero width). The target was bad before the loss
    saw it, as the watch mode's NW401 says (the entries to drop); a functional loss whose
    own line takes the log of its target is left to NW110 (:func:`target_log`), and so is
    a log of anything else (a count: NW110 reads its values). None otherwise."""
    op = a.op
    if op is None or op.injected or a.kind is not AnomalyKind.FORWARD:
        return None
    ev = op.cause
    if ev is None or ev.phase is not Phase.FORWARD or ev.born != "-inf":
        return None
    if packet(ev.op) not in ("log", "log2", "log10"):
        return None
    if not ev.made_from or ev.made_from[0] not in ("div", "true_divide"):
        return None  # a log of a count or a magnitude: NW110 reads its values and says which
    target = [st for name, st in op.inputs if name == "target"]
    others = [st for name, st in op.inputs if name != "target"]
    if len(target) != 1 or target[0] is None or target[0].finite:
        return None
    if not others or any(st is None or not st.finite for st in others):
        return None
    if a.path != LOSS_PATH:
        return ev if module_loss_target(trace, a) is not None else None
    for n in trace.notes:
        if n.kind != "loss_input" or target_log(n) is not None:
            continue
        lo = note_num(n, "target_min")
        ins = [note_num(n, "input_min"), note_num(n, "input_max")]
        if lo == -math.inf and all(v is not None and math.isfinite(v) for v in ins):
            return ev
    return None


def exact(trace: StepTrace, rec: Record) -> Record | None:
    """The record that measured this very tensor: ``rec`` itself, or the record its
    ``source`` links lead to through aliases. None when the links cross the output of a
    pass-through module (ReLU, Sigmoid, ...): its statistics are those of a different tensor
    (the module's input), which :meth:`StepTrace.resolve` would return."""
    cur: Record | None = rec
    hops = 0
    while cur is not None and cur.stat is None and cur.source is not None and hops < 64:
        hops += 1
        if cur.phase is Phase.FORWARD:
            call = trace.call(cur.call)
            if call is not None and call.passthrough:
                return None
        cur = trace.record(cur.source)
    return cur if cur is not None and cur.stat is not None else None


#: the step being evaluated and its loss calls, once found (see :func:`evaluating`): a
#: dozen rules ask for them on every step, healthy ones included
_USES_NOW: list[Any] = [None, None]


@contextmanager
def evaluating(trace: StepTrace) -> Iterator[None]:
    """While the rules evaluate ``trace`` (which nothing writes meanwhile), its loss calls
    are found once: :func:`loss_uses` returns the same list to every rule. Outside, each
    call looks afresh (a trace read late changes as its statistics land)."""
    outer = _USES_NOW[:]
    _USES_NOW[0], _USES_NOW[1] = trace, None
    try:
        yield
    finally:
        _USES_NOW[:] = outer


def loss_uses(trace: StepTrace) -> list[LossUse]:
    """Every loss call of the step: from loss-module calls, and from the guards' notes
    (functional losses have only a note). Read-only for the caller: within one evaluation
    (:func:`evaluating`) every rule gets the same list."""
    now = _USES_NOW
    if now[0] is trace:
        if now[1] is None:
            now[1] = _find_loss_uses(trace)
        found: list[LossUse] = now[1]
        return found
    return _find_loss_uses(trace)


def _find_loss_uses(trace: StepTrace) -> list[LossUse]:
    notes = [n for n in trace.notes if n.kind == "loss_input"]
    out: list[LossUse] = []
    used: set[int] = set()
    for call in trace.calls:
        if not call.is_loss:
            continue
        inp: Record | None = None
        outp: Record | None = None
        for r in _records_of_call(trace, call):
            if r.phase is Phase.INPUT and r.role == "input[0]" and inp is None:
                inp = r
            elif r.phase is Phase.FORWARD and outp is None:
                outp = r
        note = None
        for i, n in enumerate(notes):
            if i not in used and n.path == call.path:
                note = n
                used.add(i)
                break
        measured = exact(trace, inp) if inp is not None else None
        out.append(LossUse(call.path, loss_kind(call.module_type), call, inp, measured, outp, note))
    for i, n in enumerate(notes):
        if i in used:
            continue
        src = _num(n.data.get("input_source"))
        rec = trace.record(int(src)) if src is not None else None
        measured = exact(trace, rec) if rec is not None else None
        name = n.data.get("loss")
        out.append(
            LossUse(
                n.path,
                loss_kind(name if isinstance(name, str) else n.path),
                None,
                rec,
                measured,
                None,
                n,
            )
        )
    return out


def _records_of_call(trace: StepTrace, call: Call) -> Iterator[Record]:
    end = call.end if call.end >= 0 else None
    for r in trace.records:
        if r.index < call.start:
            continue
        if end is not None and r.index >= end and r.phase is not Phase.BACKWARD:
            break
        if r.call == call.id:
            yield r


def loss_activation(trace: StepTrace, use: LossUse) -> Activation | None:
    """The activation applied right before the loss: from the data flow, else from the
    guard's note (``input_grad_fn``)."""
    if use.input is not None:
        act = activation_of(trace, use.input)
        if act is not None:
            return act
    for key in ("input_activation", "input_grad_fn"):  # the former sees through views
        fn = use.data(key)
        if isinstance(fn, str) and fn in _ACT_BY_GRAD_FN:
            return Activation(_ACT_BY_GRAD_FN[fn], None, None, fn, "note")
    return None


def describe_activation(act: Activation) -> str:
    if act.path:
        return f"the output of {act.path} ({act.module_type or act.kind})"
    if act.grad_fn:
        return (
            f"a {act.kind} output (autograd node {act.grad_fn}: torch.{act.kind} or F.{act.kind})"
        )
    return f"a {act.kind} output"


def _root_of(trace: StepTrace, call_id: int, memo: dict[int, int]) -> int:
    """The id of the outermost call enclosing call ``call_id`` (itself for a root)."""
    if call_id in memo:
        return memo[call_id]
    cur, hops = trace.call(call_id), 0
    while cur is not None and cur.parent is not None and hops < 256:
        hops += 1
        parent = trace.call(cur.parent)
        if parent is None:
            break
        cur = parent
    memo[call_id] = cur.id if cur is not None else call_id
    return memo[call_id]


def _whole_model(call: Call) -> bool:
    """A call of a watched root itself (named by its class: ``Net``, ``Net#2``), not of one
    of its submodules called directly (``emb``, ``Net#2.emb``)."""
    path, kind = call.path, call.module_type
    return "." not in path and bool(kind) and (path == kind or path.startswith(kind + "#"))


def model_call(trace: StepTrace) -> Call | None:
    """The step's forward of the model: of the root calls (not a loss), the first whose
    values reached the backward or a loss, else one made with grad enabled, else one of a
    watched root itself. A submodule called directly under ``no_grad`` whose values went
    nowhere (a logging line after ``nw.step()``: ``model.emb(ids).norm()``) is never the
    model: None when that is all the step holds."""
    roots = [c for c in trace.calls if c.root and not c.is_loss]
    if not roots:
        return None
    memo: dict[int, int] = {}
    reached: set[int] = set()
    for r in trace.records:
        if r.phase is Phase.BACKWARD and r.call >= 0:
            reached.add(_root_of(trace, r.call, memo))
    for use in loss_uses(trace):
        rec, hops = use.input, 0
        while rec is not None and hops < 64:
            hops += 1
            if rec.call >= 0 and rec.phase is not Phase.INPUT:
                reached.add(_root_of(trace, rec.call, memo))
                break
            rec = trace.record(rec.source) if rec.source is not None else None
    grad = {r.call for r in trace.records if r.phase is Phase.FORWARD and r.grad_fn is not None}
    nested = {c.path for c in trace.calls if c.parent is not None}

    def rank(c: Call) -> tuple[bool, bool, bool, bool]:
        return (c.id in reached, c.id in grad, _whole_model(c), c.path not in nested)

    best = max(roots, key=rank)  # max keeps the earliest of equals
    return best if any(rank(best)[:3]) else None


def first_root_outputs(trace: StepTrace) -> list[Record]:
    """Measured output records of the model's forward of the step (:func:`model_call`):
    its logits."""
    root = model_call(trace)
    if root is None:
        return []
    out = []
    for r in trace.records:
        if r.call == root.id and r.phase is Phase.FORWARD:
            m = exact(trace, r)
            if m is not None:
                out.append(m)
    return out


def watched_params(traces: Sequence[StepTrace]) -> dict[str, int]:
    """The watched parameters' qualified names and sizes, from the gradient (or value)
    records of the first of ``traces`` that holds any."""
    out: dict[str, int] = {}
    for t in traces:
        for r in t.records:
            if r.phase in (Phase.GRADIENT, Phase.PARAMETER) and r.stat is not None:
                out.setdefault(r.role, r.stat.numel)
        if out:
            break
    return out


def last_gradient(traces: Sequence[StepTrace], qualname: str) -> TensorStat | None:
    """The latest recorded gradient of the watched parameter ``qualname``."""
    for t in traces:
        for r in t.records:
            if r.phase is Phase.GRADIENT and r.role == qualname and r.stat is not None:
                return r.stat
    return None


def group_holding(traces: Sequence[StepTrace], qualname: str) -> tuple[str, int, float] | None:
    """The optimizer (class name), param group and lr of the latest ``"optimizer"`` note of
    ``traces`` (oldest first) whose group lists the watched parameter ``qualname``."""
    found: tuple[str, int, float] | None = None
    for t in traces:
        for n in t.notes:
            if n.kind != "optimizer":
                continue
            for g in n.data.get("groups", ()):
                if not isinstance(g, dict):
                    continue
                names, lr, gi = g.get("names"), g.get("lr"), g.get("group")
                if (
                    isinstance(names, list)
                    and qualname in names
                    and isinstance(gi, int)
                    and isinstance(lr, (int, float))
                    and not isinstance(lr, bool)
                ):
                    found = (n.path, gi, float(lr))
    return found


def param_named(params: dict[str, int], expr: str) -> str | None:
    """The one watched parameter the user's expression ``expr`` names (``model.sigma``,
    ``self.log_vars`` -> ``sigma``, ``log_vars``), matched by its last component."""
    leaf = expr.rsplit(".", 1)[-1]
    hits = [q for q in params if q == leaf or q.endswith(f".{leaf}")]
    return hits[0] if len(hits) == 1 else None


# ---------------------------------------------------------------------- an eps that is 0


@dataclass(frozen=True)
class LostEps:
    """An eps on the user's line (``x / (std + 1e-8)``, ``torch.log(mel + self.eps)``,
    ``p.clamp_min(1e-8)``) in the operand of the op that failed, which is 0 in the op's
    dtype: 1e-8 is below half of float16's smallest subnormal (5.96e-08) and rounds to 0."""

    text: str  #: the eps as written: ``1e-8``, ``self.eps``
    value: float | None  #: a literal's value; None for a name (its value is not known)
    dtype: str  #: the dtype it was added in (``float16``)
    lim: DtypeLimits  #: that dtype's limits (of each part, for a complex dtype)
    floor: str  #: an eps that counts in ``dtype``: a power of ten at or above finfo.tiny
    line: str  #: the user's statement with the eps raised to ``floor``

    def words(self, what: str) -> str:
        """Evidence: why the eps did not keep ``what`` (``the log's input``) off 0."""
        sub = self.lim.subnormal
        if self.value is not None:
            return (
                f"the {self.text} on this line is 0 in {self.dtype} (its smallest subnormal is "
                f"{fmt(sub)}; anything below {fmt(sub / 2)} rounds to 0): it did not keep "
                f"{what} off 0"
            )
        example = " (1e-8 does)" if _rounds_to_zero(1e-8, self.dtype) else ""
        return (
            f"the line adds {self.text}, yet {what} holds exact zeros: there {self.text} "
            f"added nothing, so it is 0, or below {fmt(sub / 2)} (half of {self.dtype}'s "
            f"smallest subnormal {fmt(sub)}), which rounds to 0 in {self.dtype}{example}"
        )

    def fix(self) -> str:
        """The user's line with the eps raised, and what to do instead."""
        tiny = fmt(self.lim.tiny)
        wider = (
            ", or compute this line in float32"
            if self.lim.short_range
            else f" ({self.text} must not be 0)"
            if self.value is None
            else ""
        )
        sub = fmt(self.lim.subnormal)
        fin = f"torch.finfo(torch.{self.dtype})"
        return (
            f"{self.line}\n"
            f"# an eps below {fmt(self.lim.subnormal / 2)} rounds to 0 in {self.dtype}: its "
            f"smallest positive value is {sub} ({fin}.smallest_normal * {fin}.eps, a subnormal); "
            f"{self.floor} is above {tiny} ({fin}.tiny), where it keeps full precision{wider}"
        )


#: the ops whose operand an eps keeps off 0, by the kind of op that failed
_EPS_OPS = {
    "log": frozenset({"log", "log2", "log10"}),
    "root": frozenset({"sqrt", "rsqrt"}),
}
_EPS_NAME = re.compile(r"eps", re.IGNORECASE)
_STMT_KEYWORD = re.compile(r"^(return|yield|await|assert)\s+")


@functools.lru_cache(maxsize=256)
def _rounds_to_zero(value: float, dtype: str) -> bool:
    """A positive number that is 0 once stored in ``dtype`` (a complex one: in its parts)."""
    import torch

    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype) or not (dt.is_floating_point or dt.is_complex):
        return False
    try:
        return value > 0 and bool(torch.tensor(value, dtype=dt) == 0)
    except (RuntimeError, TypeError):
        return False


def _parsed(stmt: str) -> tuple[ast.AST, int] | None:
    """``stmt`` parsed, and the offset of the parsed text in it (``return x`` parses ``x``)."""
    try:
        return ast.parse(stmt), 0
    except SyntaxError:
        pass
    m = _STMT_KEYWORD.match(stmt)
    if m is None:
        return None
    try:
        return ast.parse(stmt[m.end() :]), m.end()
    except SyntaxError:
        return None


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _eps_operands(tree: ast.AST, kind: str) -> list[ast.expr]:
    """The operands of ``kind``'s ops in ``tree``: the argument of each log (or sqrt), the
    base of each fractional power, each denominator."""
    out: list[ast.expr] = []
    names = _EPS_OPS.get(kind, frozenset())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _call_name(node)
            method = isinstance(node.func, ast.Attribute) and not (
                isinstance(node.func.value, ast.Name) and node.func.value.id in ("torch", "F")
            )
            if name in names:
                out += [node.func.value] if method and not node.args else node.args[:1]  # type: ignore[attr-defined]
            elif kind == "div" and name in ("div", "true_divide", "divide"):
                out += node.args[:1] if method else node.args[1:2]
            elif kind == "div" and name == "reciprocal":
                out += [node.func.value] if method and not node.args else node.args[:1]  # type: ignore[attr-defined]
            elif kind == "root" and name == "pow":
                out += [node.func.value] if method else node.args[:1]  # type: ignore[attr-defined]
        elif isinstance(node, ast.BinOp):
            if kind == "div" and isinstance(node.op, ast.Div):
                out.append(node.right)
            elif kind == "root" and isinstance(node.op, ast.Pow):
                out.append(node.left)
    return out


def _eps_in(operand: ast.expr) -> Iterator[tuple[ast.expr, float | None]]:
    """The eps terms inside an operand: a positive number added to it or clamped at, and a
    name holding ``eps`` added to it; each with a literal's value (None for a name)."""
    for node in ast.walk(operand):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            for side in (node.right, node.left):
                if isinstance(side, ast.Constant) and isinstance(side.value, (int, float)):
                    if not isinstance(side.value, bool):
                        yield side, float(side.value)
                elif isinstance(side, (ast.Name, ast.Attribute)):
                    ident = side.attr if isinstance(side, ast.Attribute) else side.id
                    if _EPS_NAME.search(ident):
                        yield side, None
        elif isinstance(node, ast.Call) and _call_name(node) in ("clamp_min", "clamp", "add"):
            cands = [k.value for k in node.keywords if k.arg in ("min", "other")]
            if _call_name(node) != "clamp" or not cands:
                cands += node.args[-1:] if isinstance(node.func, ast.Attribute) else []
            for c in cands[:1]:
                if (
                    isinstance(c, ast.Constant)
                    and isinstance(c.value, (int, float))
                    and not isinstance(c.value, bool)
                ):
                    yield c, float(c.value)


def lost_eps(code: str | None, dtype: str | None, kind: str, *, zeros: bool) -> LostEps | None:
    """An eps in the operand of the ``kind`` op (``"log"``, ``"div"``, ``"root"``) on the
    user's line that is 0 in ``dtype``: a literal that rounds to 0 there, or (``zeros``: the
    operand holds exact zeros although the eps was added) a name holding ``eps``, whose
    value nanwatch does not know. None when the line shows neither."""
    lim = limits(dtype)
    if lim is None or not dtype or not code:
        return None
    # the power of ten at or above finfo.tiny, and no smaller than the usual 1e-8
    floor = f"1e-{min(8, max(0, -math.ceil(math.log10(lim.tiny))))}"
    for stmt in statements(code):
        parsed = _parsed(stmt)
        if parsed is None:
            continue
        tree, shift = parsed
        for operand in _eps_operands(tree, kind):
            for node, value in _eps_in(operand):
                if value is not None and not _rounds_to_zero(value, dtype):
                    continue
                if value is None and not zeros:
                    continue
                begin = shift + node.col_offset
                end = shift + (node.end_col_offset or node.col_offset)
                text = stmt[begin:end]
                new = floor if value is not None else f"max({text}, {floor})"
                return LostEps(
                    text=text,
                    value=value,
                    dtype=dtype,
                    lim=lim,
                    floor=floor,
                    line=stmt[:begin] + new + stmt[end:],
                )
    return None


# ---------------------------------------------------------------------- log of a target


@dataclass(frozen=True)
class LoggedTarget:
    """A functional loss whose target holds -inf (and no NaN) because the loss line itself
    takes its log (``F.l1_loss(S.log(), T.log())`` with zeros in ``T``): log(0) = -inf,
    made on the loss line, not a bad target in the data."""

    note: Note  #: the loss call's ``"loss_input"`` note
    loss: str  #: ``F.l1_loss``
    target: str  #: the target expression as written: ``T.log()``
    base: str  #: what the log was taken of: ``T``
    how: str  #: how nanwatch knows: the line's text or the target's autograd node
    line: str | None  #: the loss statement with a floor under its logs (None: line unknown)
    floor: str  #: that floor (``1e-5``)
    both: bool  #: the prediction is a log on the line too, and got the floor as well


_LOG_NODES_BY_NAME = frozenset({"LogBackward0", "Log2Backward0", "Log10Backward0"})


def _log_base(node: ast.expr) -> ast.expr | None:
    """``x`` of ``x.log()`` / ``torch.log(x)`` (log2, log10 too); None for anything else."""
    if not isinstance(node, ast.Call) or _call_name(node) not in ("log", "log2", "log10"):
        return None
    f = node.func
    if isinstance(f, ast.Attribute) and not node.args and not node.keywords:
        return f.value
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and node.args:
        return node.args[0] if f.value.id == "torch" else None
    return None


def _loss_line_of(note: Note) -> str | None:
    import linecache

    line = note.data.get("source_line")
    if isinstance(line, str) and line.strip():
        return line.strip()
    path, _, num = (note.source or "").rpartition(":")
    if path and num.isdigit():
        return linecache.getline(path, int(num)).strip() or None
    return None


def loss_call_in(tree: ast.AST, note: Note | None) -> ast.Call | None:
    """The loss call of a guard's ``"loss_input"`` note in a parsed statement: the call the
    user's frame was making (the note's ``call``, compared as code: spacing aside), else
    the one call named as the loss (``cross_entropy`` for ``F.cross_entropy``); None when
    neither is found (``0.5 * mse(a, b) + nll(c, d)`` from a note without its call).

    >>> from nanwatch.records import Note
    >>> n = Note("loss_input", "NLLLoss", data={"loss": "NLLLoss", "call": "nll(c,  d)"})
    >>> ast.unparse(loss_call_in(ast.parse("loss = 0.5 * mse(a, b) + 0.5 * nll(c, d)"), n))
    'nll(c, d)'
    """
    if note is None:
        return None
    calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call)]
    text = note.data.get("call")
    if isinstance(text, str):
        try:
            want = ast.unparse(ast.parse(text, mode="eval").body)
        except SyntaxError:
            want = None
        found = [c for c in calls if ast.unparse(c) == want]
        if found:
            return found[0]
    fname = str(note.data.get("loss", note.path)).rsplit(".", 1)[-1]
    named = [c for c in calls if _call_name(c) == fname]
    return named[0] if len(named) == 1 else None


def loss_input_rewrite(note: Note, wrap: Callable[[str], str], *, min_args: int = 2) -> str | None:
    """The loss call's statement with its input (the first argument, or ``input=`` /
    ``log_probs=``) passed through ``wrap``. The call is the one named as the loss
    (``F.ctc_loss``, ``CTCLoss``) or, for a loss module called by the user's own name
    (``ctc(out, y, il, tl)``), the outermost call with at least ``min_args`` arguments.
    None when the line is unknown or holds no such call.

    >>> from nanwatch.records import Note
    >>> n = Note("loss_input", "CTCLoss", data={"loss": "CTCLoss",
    ...          "source_line": "loss = ctc(m(x).transpose(0, 1), y, il, tl)"})
    >>> loss_input_rewrite(n, lambda e: f"{paren(e)}.log_softmax(-1)", min_args=4)
    'loss = ctc(m(x).transpose(0, 1).log_softmax(-1), y, il, tl)'
    """
    fname = str(note.data.get("loss", note.path)).rsplit(".", 1)[-1]
    for stmt in statements(_loss_line_of(note)):
        parsed = _parsed(stmt)
        if parsed is None:
            continue
        tree, shift = parsed
        calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call)]  # outermost first
        named = [c for c in calls if _call_name(c) == fname]
        counted = [c for c in calls if len(c.args) + len(c.keywords) >= min_args]
        exact = loss_call_in(tree, note)
        for call in [exact] if exact is not None else named or counted[:1]:
            kw = {k.arg: k.value for k in call.keywords if k.arg}
            arg = kw.get("input", kw.get("log_probs", call.args[0] if call.args else None))
            if arg is None:
                continue
            s0, s1 = shift + arg.col_offset, shift + (arg.end_col_offset or arg.col_offset)
            return stmt[:s0] + wrap(stmt[s0:s1]) + stmt[s1:]
    return None


def target_log(note: Note) -> LoggedTarget | None:
    """The target of this loss call is -inf (no NaN) and was made by a log: its autograd
    node is a log, or the loss line passes ``<x>.log()`` / ``torch.log(<x>)`` as the
    target. None otherwise."""
    d = note.data
    lo, hi = _num(d.get("target_min")), _num(d.get("target_max"))
    if lo is None or hi is None or lo != -math.inf or math.isnan(hi):
        return None
    ins = [_num(d.get(k)) for k in ("input_min", "input_max")]
    if not all(v is not None and math.isfinite(v) for v in ins):
        return None  # the prediction was bad too: its own op says why
    loss = str(d.get("loss", note.path))
    node = d.get("target_grad_fn")
    by_node = isinstance(node, str) and node in _LOG_NODES_BY_NAME
    dtype = d.get("target_dtype")
    floor = "1e-5"
    if isinstance(dtype, str) and _rounds_to_zero(1e-5, dtype):
        lim = limits(dtype)
        floor = f"1e-{-math.ceil(math.log10(lim.tiny))}" if lim is not None else floor
    code = _loss_line_of(note)
    fname = loss.rsplit(".", 1)[-1]
    for stmt in statements(code):
        parsed = _parsed(stmt)
        if parsed is None:
            continue
        tree, shift = parsed
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call) or _call_name(call) != fname:
                continue
            kw = {k.arg: k.value for k in call.keywords if k.arg}
            tgt = kw.get("target", call.args[1] if len(call.args) > 1 else None)
            pred = kw.get("input", call.args[0] if call.args else None)
            base = _log_base(tgt) if tgt is not None else None
            if tgt is None or base is None:
                continue
            edits = [base]
            pbase = _log_base(pred) if pred is not None else None
            if pbase is not None:
                edits.append(pbase)
            new = stmt
            for b in sorted(edits, key=lambda n: n.col_offset, reverse=True):
                s0, s1 = shift + b.col_offset, shift + (b.end_col_offset or b.col_offset)
                new = new[:s0] + f"{paren(stmt[s0:s1])}.clamp_min({floor})" + new[s1:]
            seg = (shift + tgt.col_offset, shift + (tgt.end_col_offset or tgt.col_offset))
            bseg = (shift + base.col_offset, shift + (base.end_col_offset or base.col_offset))
            return LoggedTarget(
                note=note,
                loss=loss,
                target=stmt[seg[0] : seg[1]],
                base=stmt[bseg[0] : bseg[1]],
                how="the loss line takes the target's log",
                line=new,
                floor=floor,
                both=pbase is not None,
            )
    if by_node:
        return LoggedTarget(
            note=note,
            loss=loss,
            target="the target",
            base="the target's input",
            how=f"the target's autograd node is {node}",
            line=None,
            floor=floor,
            both=False,
        )
    return None


# ---------------------------------------------------------------------- whole statements


def full_statement(source: str | None, reach: int = 12) -> str | None:
    """The statement that starts on line ``source`` (``train.py:42``), read from the file
    and joined into one line when it continues on the next ones (an open parenthesis, a
    backslash): ``loss = kl(a,\\n      b)`` -> ``loss = kl(a, b)``. The line alone when no
    run of up to ``reach`` lines parses; None when the file cannot be read."""
    import linecache

    path, _, num = (source or "").rpartition(":")
    if not path or not num.isdigit():
        return None
    start = int(num)
    first = linecache.getline(path, start).strip()
    if not first:
        return None
    parts: list[str] = []
    for n in range(start, start + reach):
        text = linecache.getline(path, n)
        if not text.strip():
            break
        parts.append(text.split("  #", 1)[0].strip().removesuffix("\\").rstrip())
        joined = " ".join(parts)
        if "'" not in joined and '"' not in joined:  # no string to change: tidy the joins
            joined = re.sub(r"\s+([)\]}])", r"\1", re.sub(r"([(\[{]) +", r"\1", joined))
        if _parsed(joined) is not None:
            return joined
    return first


def identifiers(code: str | None) -> set[str]:
    """Every name a line of code uses or assigns (``l = crit(model(x), y)`` -> ``l``,
    ``crit``, ``model``, ``x``, ``y``): a fix that introduces a name must not take one of
    these, or pasting it overwrites the user's variable."""
    if not code:
        return set()
    text = re.sub(r"(['\"]).*?\1", "", code.split("  #", 1)[0])
    return set(re.findall(r"(?<![\w.])[A-Za-z_]\w*", text))


def fresh_name(want: str, taken: set[str]) -> str:
    """``want``, or ``want`` with a suffix, whichever is not in ``taken``.

    >>> fresh_name("fin", {"fin", "x"}), fresh_name("fin", set())
    ('fin_', 'fin')
    """
    name = want
    while name in taken:
        name += "_"
    return name


@dataclass(frozen=True)
class OverflowedConstant:
    """A finite Python constant too large for the op's dtype (``* -1e9`` in float16):
    the op wrote it as ±inf."""

    event: OpEvent
    value: float  #: the constant, as the op got it
    literal: str  #: as written on the user's line (``-1e9``), else formatted
    dtype: str
    max: float  #: the dtype's largest finite value


#: a number literal: ``1e9``, ``1e+09``, ``1000000000.0``, ``.5``
_NUMBER = re.compile(r"(?<![\w.])(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?(?![\w.])")


def _unary_minus(line: str, start: int) -> int | None:
    """Index of the unary minus just before ``start`` (``* -1e9``, ``(-1e9)``), else None
    (``x - 1e9`` is a subtraction)."""
    i = start - 1
    while i >= 0 and line[i] == " ":
        i -= 1
    if i < 0 or line[i] != "-":
        return None
    j = i - 1
    while j >= 0 and line[j] == " ":
        j -= 1
    if j >= 0 and (line[j].isalnum() or line[j] in "_)]."):
        return None
    return i


def _constant_literal(code: str | None, value: float) -> tuple[int, int, bool] | None:
    """Where ``value`` is written on the user's line: (start, end, negative) of the one
    literal whose magnitude is ``|value|`` (with its unary minus), else None."""
    if not code:
        return None
    line = code.split("  #", 1)[0]
    hits = []
    for m in _NUMBER.finditer(line):
        try:
            v = float(m.group())
        except ValueError:
            continue
        if v == abs(value):
            sign = _unary_minus(line, m.start())
            hits.append((sign if sign is not None else m.start(), m.end(), sign is not None))
    return hits[0] if len(hits) == 1 else None


def overflowed_constant(ev: OpEvent) -> OverflowedConstant | None:
    """A forward op that made ±inf of finite tensors with a finite constant beyond its
    dtype's range: ``(1 - m) * -1e9`` or ``masked_fill(m, -1e9)`` in float16 (max 65504)."""
    if ev.phase is not Phase.FORWARD or ev.injected or "inf" not in ev.born:
        return None
    lim = limits(ev.dtype)
    if lim is None or ev.dtype is None or any(not x.finite for x in inputs_of(ev)):
        return None
    for v in ev.scalars.values():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(v) and abs(v) > lim.max:
            where = _constant_literal(ev.code, float(v))
            line = (ev.code or "").split("  #", 1)[0]
            literal = line[where[0] : where[1]].replace(" ", "") if where else fmt(float(v))
            return OverflowedConstant(ev, float(v), literal, ev.dtype, lim.max)
    return None


def dtype_expr(code: str | None, dtype: str) -> str:
    """How the user's line names the dtype: ``scores.dtype`` when it converts to one
    (``.to(scores.dtype)``, ``dtype=x.dtype``), else ``torch.float16``."""
    m = re.search(r"([A-Za-z_][\w.]*)\.dtype\b", (code or "").split("  #", 1)[0])
    return f"{m.group(1)}.dtype" if m else f"torch.{dtype}"


def replace_constant(c: OverflowedConstant) -> str | None:
    """The user's line with the overflowing constant replaced by the dtype's extreme finite
    value: ``* -1e9`` -> ``* torch.finfo(scores.dtype).min``; None when it is not found."""
    where = _constant_literal(c.event.code, c.value)
    if where is None or not c.event.code:
        return None
    line = c.event.code.split("  #", 1)[0].rstrip()
    start, end, negative = where
    d = dtype_expr(line, c.dtype)
    new = f"torch.finfo({d}).{'min' if negative else 'max'}"
    return (line[:start] + new + line[end:]).strip()


# ---------------------------------------------------------------------- data flow vs text

#: ops that hand on their input's values unchanged (a cast, a copy): looked through when a
#: line's text is compared with the data flow
_FLOW_SAME = frozenset({"tocopy", "clone", "contiguous", "alias", "detach"})

#: the ops a call on the user's line runs, as the data flow names them (lower-case autograd
#: node names), for the calls whose op is known from their name alone
_WRITTEN_CALLS: dict[str, frozenset[str]] = {
    **{f: frozenset({f}) for f in ("sigmoid", "exp", "log", "sqrt", "tanh", "relu", "abs")},
    **{f: frozenset({f}) for f in ("expm1", "log1p", "exp2", "log2", "log10", "rsqrt")},
    "softmax": frozenset({"softmax"}),
    "log_softmax": frozenset({"logsoftmax"}),
    "logsigmoid": frozenset({"logsigmoid"}),
    "clamp": frozenset({"clamp", "clampmin", "clampmax"}),
    "clamp_min": frozenset({"clamp", "clampmin"}),
    "clamp_max": frozenset({"clamp", "clampmax"}),
}


def operand_flow(ev: OpEvent, name: str = "self") -> list[str] | None:
    """The ops that made operand ``name`` of ``ev`` (``self``: its first), nearest first,
    lower-case, as the data flow shows them (:attr:`OpEvent.made_from`; a division's
    ``other_made_from``): ``["sum", "sub", "exp"]``; None when it was not read."""
    if name == "self":
        return list(ev.made_from) or None
    v = ev.scalars.get(f"{name}_made_from")
    return v.split("<") if isinstance(v, str) and v else None


def written_op(arg: str) -> frozenset[str] | None:
    """The ops the data flow may name for the last op of ``arg``, the user's text of an
    operand: ``1 - p`` -> rsub (or sub); ``torch.sigmoid(z)``, ``z.sigmoid()`` -> sigmoid;
    None for a name, an attribute, a subscript, a call of anything else (any op may have
    made it) or text that does not parse.

    >>> sorted(written_op("1 - p")), sorted(written_op("F.softmax(z, -1)")), written_op("p")
    (['rsub', 'sub'], ['softmax'], None)
    """
    try:
        node = ast.parse(arg.strip(), mode="eval").body
    except SyntaxError:
        return None
    if isinstance(node, ast.BinOp):
        ops = {ast.Sub: {"sub", "rsub"}, ast.Add: {"add"}, ast.Mult: {"mul"}, ast.Div: {"div"}}
        got = ops.get(type(node.op))
        return frozenset(got) if got is not None else None
    if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
        f = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
        return _WRITTEN_CALLS.get(f.rstrip("_"))
    return None


def flow_disagrees(ev: OpEvent, arg: str, name: str = "self") -> str | None:
    """The op the data flow shows made operand ``name`` of ``ev``, when the user's text of
    it, ``arg``, says another made it (``1 - p`` on the line, the log's input made by a
    sigmoid: the op ran on another call of the line, ``log(p)``); None when they agree or
    either is unknown. Read before a rule trusts which part of a line an op ran."""
    flow = operand_flow(ev, name)
    said = written_op(arg)
    if flow is None or said is None:
        return None
    made = next((o.removeprefix("watched:") for o in flow if o not in _FLOW_SAME), None)
    if made is None or made == "leaf" or made in said:
        return None
    return made


def under_views(node: ast.expr, methods: frozenset[str] | set[str]) -> tuple[ast.expr, bool]:
    """The expression ``node`` indexes or views (through every subscript and every call of
    one of ``methods``, view or cast methods), and whether a subscript was among them.

    >>> n, indexed = under_views(ast.parse("table[t].view(-1, 1)", mode="eval").body, {"view"})
    >>> ast.unparse(n), indexed
    ('table', True)
    """
    seen = False
    while True:
        if isinstance(node, ast.Subscript):
            seen, node = True, node.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in methods
        ):
            node = node.func.value
        else:
            return node, seen
