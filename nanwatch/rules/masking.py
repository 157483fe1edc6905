"""Masking: a fully masked attention row (NW402), a NaN hidden by a mask in forward that
comes back as a NaN gradient (NW407). ``masked_fill(mask, -inf)`` before a
softmax is normal and never reported; a row that is -inf everywhere has no maximum, and
softmax returns NaN for the whole row. A softmax written by hand over rows or segments
(graph attention: a node whose every edge is masked) fails the same way one op earlier, at
x - max = -inf - (-inf)."""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Iterator, Sequence

from nanwatch.records import LOSS_PATH, Anomaly, AnomalyKind, OpEvent, Phase, TensorStat
from nanwatch.rules._evidence import (
    Cause,
    OverflowedConstant,
    _function_names,
    _names_known,
    anomaly_fields,
    binary_operands,
    cause_of,
    code_line,
    describe_stat,
    dtype_expr,
    first_input,
    fmt,
    inf_arithmetic,
    inf_evidence,
    inf_fix,
    inf_inputs,
    inf_source,
    input_named,
    inputs_of,
    limits,
    node_base,
    op_fields,
    overflowed_constant,
    packet,
    paren,
    put_in,
    replace_constant,
    rewrite_call,
    short_op,
    statements,
    untraced_hint,
    wrapped_binop,
)
from nanwatch.rules.base import Diagnosis, RuleContext, rule

_FIX = (
    "scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)  # not -inf\n"
    "attn = torch.softmax(scores, dim=-1)\n"
    "attn = attn.masked_fill(mask.all(dim=-1, keepdim=True), 0.0)  # rows with no key\n"
    "# and find why a row has nothing to attend to (an empty sequence, length 0)"
)

#: torch.nn modules that mask with -inf inside, from a key_padding_mask the user passes
_TORCH_ATTENTION = frozenset(
    {
        "MultiheadAttention",
        "TransformerEncoderLayer",
        "TransformerDecoderLayer",
        "TransformerEncoder",
        "TransformerDecoder",
        "Transformer",
    }
)

_FIX_TORCH = (
    "# key_padding_mask: the mask your code passes to the attention module\n"
    "empty = key_padding_mask.all(dim=-1)   # samples with no key to attend to (length 0)\n"
    "key_padding_mask[empty, 0] = False     # un-mask one key each: a finite, meaningless row\n"
    "# and leave those samples out of the loss, or drop them from the batch"
)

#: the keyword arguments of torch.nn attention modules that carry a padding mask
_PADDING_KWARG = re.compile(r"(?<![\w.])((?:src_|tgt_|memory_)?key_padding_mask)\s*=(?!=)\s*")


def _kwarg_value(line: str, start: int) -> str | None:
    """The expression of a keyword argument that starts at ``start`` (up to the comma or
    closing parenthesis at its own depth)."""
    depth = 0
    for i in range(start, len(line)):
        c = line[i]
        if c in "([{":
            depth += 1
        elif c in ")]}" or (c == "," and depth == 0):
            if depth == 0:
                expr = line[start:i].strip()
                return expr or None
            depth -= 1
    return None


def _torch_fix(code: str | None, inverted: bool = False) -> str:
    """The key_padding_mask fix, on the user's own line when it passes the mask by keyword:
    a copy of the mask with one key un-masked in each sample that has none; or, for a mask
    that looks inverted (True at the real tokens), the mask inverted."""
    line = code.split("  #", 1)[0].rstrip() if code else ""
    m = _PADDING_KWARG.search(line)
    expr = _kwarg_value(line, m.end()) if m is not None else None
    if m is None or expr is None:
        return _FIX_TORCH_INVERTED if inverted else _FIX_TORCH
    name = m.group(1)
    indent = line[: len(line) - len(line.lstrip())]
    if inverted:
        call = line[: m.end()] + _inverse(expr) + line[m.end() + len(expr) :]
        return (
            f"{call.strip()}   # True = ignore: mask the padding, not the real tokens\n"
            f"# {name} is True at the keys to IGNORE; a tokenizer's attention_mask is 1 at "
            "the real tokens: pass (attention_mask == 0)"
        )
    call = line[: m.end()] + name + line[m.end() + len(expr) :]
    return (
        f"{indent}{name} = {expr}.clone()\n"
        f"{indent}empty = {name}.all(dim=-1)   # samples with no key to attend to (length 0)\n"
        f"{indent}{name}[empty, 0] = False     # un-mask one key each: a finite, meaningless row\n"
        f"{call}\n"
        f"{indent}# and leave those samples out of the loss, or drop them from the batch"
    ).strip("\n")


_FIX_TORCH_INVERTED = (
    "key_padding_mask = attention_mask == 0   # True = ignore: the padding, not the real tokens\n"
    "# key_padding_mask is True at the keys to IGNORE; a tokenizer's attention_mask is 1 at "
    "the real tokens, so passing attention_mask.bool() masks every real token"
)

#: a boolean made from a 1-at-real-tokens mask: ``attention_mask.bool()``, ``am > 0``
_KEEP_AS_BOOL = re.compile(
    r"^(?P<x>.+?)(?:\.bool\(\)|\.to\(\s*(?:dtype\s*=\s*)?(?:torch\.)?bool\s*\)"
    r"|\s*(?:>|!=)\s*0|\s*==\s*1)$"
)


def _inverse(expr: str) -> str:
    """The user's mask expression inverted: ``attention_mask.bool()`` ->
    ``(attention_mask == 0)``; ``~pad`` -> ``pad``; ``kpm`` -> ``~kpm``."""
    m = _KEEP_AS_BOOL.match(expr.strip())
    if m is not None:
        return f"({paren(m.group('x'))} == 0)"
    return _negate(expr)


def _negate(expr: str) -> str:
    """``~pad`` -> ``pad``; ``pad[:, None]`` -> ``~pad[:, None]``; ``a & b`` -> ``~(a & b)``."""
    e = expr.strip()
    if e.startswith("~") and paren(e[1:]) == e[1:].strip():
        return e[1:].strip()
    return f"~{paren(e)}"


#: a tokenizer's attention_mask (1 = real token) used as is, not negated
_KEEP_MASK_NAME = re.compile(r"attention_mask")
_NEGATED = re.compile(r"~|logical_not|==\s*0|\beq\(\s*0|1\s*-|<\s*1|\bnot\b")


def _inverted_mask(mask: OpEvent | None, soft: TensorStat | None, code: str | None) -> str | None:
    """Evidence that a torch attention module's key_padding_mask is inverted (True at the
    real tokens, False at the padding). The module turns the bool mask into -inf with one
    masked_fill over (batch, keys), so that op's -inf count is the number of masked keys;
    the share of NaN softmax rows is the share of samples with every key masked. An
    inverted mask leaves the full-length samples with no key, and masks most keys of the
    others (their real tokens): most samples fully masked, or the samples that are not
    masking at least half their keys, or the user's line passing a tokenizer's
    attention_mask as is."""
    line = code.split("  #", 1)[0] if code else ""
    m = _PADDING_KWARG.search(line)
    expr = (_kwarg_value(line, m.end()) if m is not None else None) or ""
    named = bool(_KEEP_MASK_NAME.search(expr)) and not _NEGATED.search(expr)
    keys = mask.output if mask is not None else None
    hidden = keys.neginf if keys is not None and isinstance(keys.neginf, int) else None
    full = soft.nan / soft.numel if soft is not None and soft.nan and soft.numel else None
    rest = (
        (hidden / keys.numel - full) / (1 - full)
        if hidden is not None and keys is not None and keys.numel and full is not None and full < 1
        else None
    )
    if not (named or (full is not None and full > 0.5) or (rest is not None and rest >= 0.5)):
        return None
    parts = []
    if hidden is not None and keys is not None:
        parts.append(f"key_padding_mask masks {hidden:,} of {keys.numel:,} keys")
    if full is not None:
        parts.append(f"{full:.0%} of the samples have every key masked")
    why = (
        f"{expr} is a tokenizer's attention_mask (1 = real token), passed as is"
        if named
        else "the samples that keep a key have most of theirs masked"
        if full is None or full <= 0.5
        else "most samples have no key left"
    )
    return (
        " and ".join(parts)
        + f": {why}, so the mask looks inverted. key_padding_mask is True at the keys to "
        "IGNORE: True at the real tokens masks every one of them, and the fully masked "
        "samples are the full-length ones (no padding), not empty ones"
    ).lstrip(": ")


_NEG_INF = re.compile(
    r"""float\(\s*["']-inf(?:inity)?["']\s*\)|-\s*float\(\s*["']inf(?:inity)?["']\s*\)"""
    r"|-\s*(?:math|torch|np|numpy)\.inf\b",
    re.IGNORECASE,
)
_FILL_CALL = re.compile(r"([A-Za-z_][\w.]*(?:\[[^\]]*\])?)\.masked_fill_?\(")


def _own_mask_fix(mask: OpEvent | None, *, attention: bool = True) -> str | None:
    """The user's own masked_fill line with its -inf replaced by the dtype's most negative
    finite value: the mask expression stays theirs (``~mask[:, None, :]``), so it runs."""
    if mask is None or not mask.code:
        return None
    line = mask.code.split("  #", 1)[0].rstrip()
    call = _FILL_CALL.search(line)
    if len(_NEG_INF.findall(line)) != 1:
        return None
    # the filled tensor's dtype by its name, else (a call's result: f(x).masked_fill) as seen
    dtype = f"{call.group(1)}.dtype" if call is not None else f"torch.{mask.dtype or 'float32'}"
    fixed = _NEG_INF.sub(lambda _: f"torch.finfo({dtype}).min", line)
    if not attention:
        return (
            f"{fixed.strip()}   # not -inf: a row with every entry masked stays finite\n"
            "# such a row has no valid choice: keep it out of the loss (as your code does), "
            "or make sure each row keeps at least one allowed entry"
        )
    return (
        f"{fixed.strip()}   # not -inf: a row with every key masked stays finite\n"
        "# and find why a row has nothing to attend to (an empty sequence, length 0); give "
        "its output a defined value, or leave it out of the loss"
    )


def _torch_module(ctx: RuleContext, call_id: int, ev: OpEvent | None = None) -> bool:
    """A torch.nn attention module builds the -inf mask itself from key_padding_mask. The
    module is known from the recorded calls, or (sentinel mode records only the root's
    call) from the user's line, which passes a key_padding_mask to it."""
    call = ctx.trace.call(call_id)
    while call is not None:
        if call.module_type in _TORCH_ATTENTION:
            return True
        call = ctx.trace.call(call.parent) if call.parent is not None else None
    code = ev.code if ev is not None else None
    return bool(code and _PADDING_KWARG.search(code.split("  #", 1)[0]))


def _fix_for(
    ctx: RuleContext, call_id: int, ev: OpEvent | None = None, *, inverted: bool = False
) -> str:
    """A torch.nn attention module: the fix is in the key_padding_mask it is given;
    hand-written attention gets the masking fix."""
    if _torch_module(ctx, call_id, ev):
        return _torch_fix(ev.code if ev is not None else None, inverted)
    return _FIX


#: words that say a softmax is attention: its module, or the user's lines around it
_ATTENTION_WORDS = re.compile(r"attn|attention|key_padding|scores?\b|\bkeys?\b|quer", re.IGNORECASE)


def _enclosing_headers(source: str | None, reach: int = 400) -> list[str]:
    """The ``def`` and ``class`` lines around the user's line ``file.py:42``, innermost
    first, read from its file: ``def forward(self, query, memory, mask):`` and ``class
    Attention(nn.Module):``. Sentinel mode records only the root module's call; the code
    that ran the op still says which module's forward it is."""
    import linecache

    path, _, num = (source or "").rpartition(":")
    if not path or not num.isdigit():
        return []
    here = linecache.getline(path, int(num))
    if not here.strip():
        return []
    indent = len(here) - len(here.lstrip())
    out: list[str] = []
    for n in range(int(num) - 1, max(0, int(num) - reach), -1):
        text = linecache.getline(path, n)
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        ind = len(text) - len(text.lstrip())
        if ind >= indent:
            continue
        if re.match(r"\s*(?:async\s+def|def|class)\s", text):
            out.append(text.strip())
        indent = ind
        if indent == 0:
            break
    return out


def _class_name(header: str) -> str | None:
    m = re.match(r"class\s+(\w+)", header)
    return m.group(1) if m else None


def _is_attention(ctx: RuleContext, call_id: int, events: list[OpEvent | None]) -> bool | None:
    """The masked softmax is attention (over keys) when its module is an attention module
    or the user's lines (the op's, and the ``def``/``class`` lines that hold it) name
    attention scores, queries or keys; else it is a softmax over choices (experts,
    classes, actions) and a fully masked row has no valid choice. None: not known, when
    only the root's call was recorded (sentinel) and the op ran in the forward of another
    class, whose path (``attn``) was not recorded."""
    if _torch_module(ctx, call_id, events[0] if events else None):
        return True
    call = ctx.trace.call(call_id)
    types: set[str] = set()
    while call is not None:
        if _ATTENTION_WORDS.search(f"{call.path} {call.module_type}"):
            return True
        types.add(call.module_type)
        call = ctx.trace.call(call.parent) if call.parent is not None else None
    a = ctx.anomaly
    if a is not None and a.module_type and any(e is not None and e.path == a.path for e in events):
        # sentinel: a replay found the op in a submodule no hook records (see born_below)
        if _ATTENTION_WORDS.search(f"{a.path} {a.module_type}"):
            return True
        types.add(a.module_type)
    if any(
        e is not None
        and (_ATTENTION_WORDS.search(e.path or "") or _ATTENTION_WORDS.search(e.code or ""))
        for e in events
    ):
        return True
    headers = [h for e in events if e is not None for h in _enclosing_headers(e.source)]
    if any(_ATTENTION_WORDS.search(h) for h in headers):
        return True
    if ctx.trace.full:
        return False
    classes = {c for c in map(_class_name, headers) if c is not None}
    # sentinel: the op's own module is known only when its class is a recorded call's
    return None if not classes or not classes <= types else False


#: a masked_fill call: the mask is its first argument
_FILL_MASK = re.compile(r"\.masked_fill_?\(")


def _function_lines(source: str | None, *, after: bool = False, reach: int = 60) -> list[str]:
    """The lines of the user's function around line ``source``: those above it, nearest
    first (up to its ``def``), or with ``after`` those below it while they stay inside."""
    import linecache

    path, _, num = (source or "").rpartition(":")
    if not path or not num.isdigit():
        return []
    here = linecache.getline(path, int(num))
    indent = len(here) - len(here.lstrip())
    out: list[str] = []
    span = range(int(num) + 1, int(num) + reach) if after else range(int(num) - 1, 0, -1)
    for n in span:
        text = linecache.getline(path, n)
        if not text.strip() or text.lstrip().startswith("#"):
            if after and not text:
                break
            continue
        if len(out) >= reach:
            break
        ind = len(text) - len(text.lstrip())
        if not after and re.match(r"\s*(?:async\s+)?def\s", text) and ind < indent:
            break
        if after and ind < indent and not text.lstrip().startswith((")", "]", "}")):
            break
        out.append(text.split("  #", 1)[0].strip())
    return out


def _assignments(lines: list[str]) -> list[tuple[str, list[str], ast.expr]]:
    """(the statement, the names it assigns, its value) of each one-line assignment."""
    out = []
    for line in lines:
        for stmt in statements(line):
            try:
                body = ast.parse(stmt).body
            except SyntaxError:
                continue
            node = body[0] if len(body) == 1 else None
            if not isinstance(node, ast.Assign) or len(node.targets) != 1:
                continue
            t = node.targets[0]
            elts = t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]
            names = [e.id for e in elts if isinstance(e, ast.Name)]
            if names:
                out.append((stmt, names, node.value))
    return out


def _calls(node: ast.AST, names: frozenset[str]) -> list[ast.Call]:
    return [
        c
        for c in ast.walk(node)
        if isinstance(c, ast.Call)
        and (c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", ""))
        in names
    ]


def _reaches(
    node: ast.AST, names: frozenset[str], defs: dict[str, ast.expr], depth: int = 4
) -> bool:
    """``node`` calls one of ``names``, or reads a name whose value (``defs``) does."""
    if _calls(node, names):
        return True
    if depth == 0:
        return False
    read = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    return any(n in defs and _reaches(defs[n], names, defs, depth - 1) for n in read)


_CUMSUM = frozenset({"cumsum"})
_SORT = frozenset({"sort", "argsort", "sorted"})


def _cumsum_dim(node: ast.AST, defs: dict[str, ast.expr]) -> str | None:
    """The ``dim`` of the cumsum that ``node`` reads, as written (``-1``)."""
    for c in _calls(node, _CUMSUM):
        kw = next((k.value for k in c.keywords if k.arg == "dim"), None)
        method = isinstance(c.func, ast.Attribute) and ast.unparse(c.func.value) != "torch"
        pos = c.args[0 if method else 1] if len(c.args) > (0 if method else 1) else None
        dim = kw if kw is not None else pos
        return ast.unparse(dim) if dim is not None else None
    read = [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
    return next(
        (d for n in read if n in defs and (d := _cumsum_dim(defs[n], {})) is not None), None
    )


def _nucleus_fix(mask: OpEvent, expr: str) -> str | None:
    """A top-p (nucleus) filter that removes every token: the mask is a cut of the
    cumulative sum of sorted probabilities (``remove = cum > top_p``), which also removes
    the top token when it alone holds more than top_p. The standard filter shifts the cut
    right by one, so the token that crosses top_p (and so the top one) stays: the shift,
    in the user's names, right after the cut."""
    if not expr.isidentifier():
        return None
    above = _assignments(_function_lines(mask.source))  # nearest first
    defs: dict[str, ast.expr] = {}
    for _, names, value in reversed(above):
        for n in names:
            defs[n] = value
    flow = {expr}
    for stmt, names, value in above:
        hit = [n for n in names if n in flow]
        if not hit:
            continue
        if (
            isinstance(value, ast.Compare)
            and (cut := value.left) is not None
            and len(value.ops) == 1
            and isinstance(value.ops[0], (ast.Gt, ast.GtE))
            and _reaches(cut, _CUMSUM, defs)
            and _reaches(cut, _SORT, defs)
        ):
            t = hit[0]
            dim = _cumsum_dim(cut, defs)
            p = ast.unparse(value.comparators[0])
            if dim == "-1":
                shift = (
                    f"{t}[..., 1:] = {t}[..., :-1].clone()   # shift the cut right by one: the "
                    f"token that crosses {p} stays\n"
                    f"{t}[..., 0] = False   # and the most likely token always stays"
                )
            elif dim is not None:
                shift = (
                    f"{t} = {t}.roll(1, dims={dim})   # shift the cut right by one: the token "
                    f"that crosses {p} stays\n"
                    f"{t}.narrow({dim}, 0, 1).fill_(False)   # and the most likely token "
                    "always stays"
                )
            else:
                return None
            return (
                f"{stmt}\n{shift}\n"
                f"# {stmt} is a top-p (nucleus) cut of the sorted cumulative probabilities: "
                f"it removes every token when the top one alone holds more than {p}; put the "
                "shift right after it (before the mask is scattered back), as the standard "
                "top-p filter does"
            )
        flow |= {
            n.id for n in ast.walk(value) if isinstance(n, ast.Name) and n.id not in names
        } | set(names)
    return None


#: calls that draw from a softmax's probabilities: the softmax picks the next token
_SAMPLERS = frozenset({"multinomial", "Categorical", "sample", "argmax"})


def _sampled(soft: OpEvent) -> bool:
    """The softmax's result is drawn from on the lines after it (``torch.multinomial(probs,
    1)``): decoding, where a row with every token banned needs a token to fall back on."""
    stmts = statements(soft.code)
    target = None
    for st in stmts:
        try:
            node = ast.parse(st).body[0]
        except (SyntaxError, IndexError):
            continue
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            target = node.targets[0].id
    if target is None:
        return False
    for line in _function_lines(soft.source, after=True, reach=20):
        try:
            tree = ast.parse(line)
        except SyntaxError:
            continue
        if any(
            isinstance(a, ast.Name) and a.id == target
            for c in _calls(tree, _SAMPLERS)
            for a in ast.walk(c)
        ):
            return True
    return False


def _unban_fix(line: str, start: int, expr: str, dim: int) -> str:
    """Decoding with every token of a row banned: the user's mask with such rows unbanned
    (a finite, uniform row instead of NaN), on their own line."""
    guard = f"{paren(expr)} & ~{paren(expr)}.all(dim={dim}, keepdim=True)"
    if expr.isidentifier():
        head = (
            f"{expr} = {guard}   # a row with every token banned: unban it, so the softmax "
            f"stays finite\n{line.strip()}"
        )
    else:
        fixed = line[:start] + line[start:].replace(expr, guard, 1)
        head = f"{fixed.strip()}   # unban a row with every token banned: the softmax stays finite"
    return (
        f"{head}\n# better: leave at least one token allowed in each row (fall back to an "
        "end-of-sequence token when everything else is banned), or stop that sequence"
    )


def _choice_fix(mask: OpEvent | None, soft: OpEvent) -> str:
    """A softmax over choices with a row where every choice is masked: no fill value makes
    that row right (finfo.min spreads it over the forbidden choices), so the fix checks
    that each row keeps an allowed entry, in the user's own mask expression. A top-p cut
    gets the shift that keeps the top token; a mask of banned tokens before sampling gets a
    guard that unbans a fully banned row."""
    advice = (
        "# a row with every entry masked has no valid choice: make sure each row keeps at "
        "least one allowed entry (fix the mask, or drop those rows before the softmax)"
    )
    dim = soft.scalars.get("dim")
    line = mask.code.split("  #", 1)[0].rstrip() if mask is not None and mask.code else ""
    m = _FILL_MASK.search(line)
    expr = _kwarg_value(line, m.end()) if m is not None else None
    nucleus = _nucleus_fix(mask, expr) if mask is not None and expr is not None else None
    if nucleus is not None:
        return nucleus
    if expr is None or not isinstance(dim, int) or dim >= 0:
        return advice
    if m is not None and _sampled(soft):
        return _unban_fix(line, m.end(), expr, dim)
    return (
        f"assert {paren(_negate(expr))}.any(dim={dim}).all(), "
        '"a row with every entry masked: no valid choice"\n'
        f"{line.strip()}\n{advice}"
    )


#: ops that convert a tensor to another dtype: a value beyond the new dtype's range
#: becomes an infinity
_CASTS = frozenset({"_to_copy", "to", "copy_", "copy", "_to_copy_"})


def _cast_to_inf(ev: OpEvent) -> str | None:
    """Evidence that a cast turned a finite, very negative mask value into -inf: a float32
    -1e9 or finfo(float32).min does not fit in float16."""
    if packet(ev.op) not in _CASTS or "-inf" not in ev.born:
        return None
    x = first_input(ev)
    lim = limits(ev.dtype)
    if x is None or lim is None or x.has_neginf or x.has_nan or x.min > -lim.max:
        return None
    line = code_line(ev)
    return (
        f"the -inf came from the cast to {ev.dtype} ({short_op(ev.op)}"
        + (f" {line}" if line else "")
        + f"): the mask value {fmt(x.min)} is finite, but beyond {ev.dtype}'s range "
        f"(most negative {fmt(-lim.max)}), so the cast made it -inf"
    )


def _cast_fix(ev: OpEvent) -> str:
    """The user's cast line with the mask clamped into the target dtype first."""
    low = f"torch.finfo(torch.{ev.dtype}).min"
    line = rewrite_call(
        ev.code, ["to", "half", "bfloat16", "type"], lambda e: f"{paren(e)}.clamp_min({low})"
    )
    head = f"# the mask value does not fit in {ev.dtype}: clamp it to {low} before the cast\n" + (
        f"{line}\n" if line else ""
    )
    return (
        head + f"# or build the mask in the scores' dtype: fill with {low}, not -1e9 or "
        "torch.finfo(torch.float32).min"
    )


_EXPLAIN = (
    "softmax(x) = exp(x - max(x)) / sum(...): on a row where every score is -inf the max "
    "is -inf, x - max is -inf - (-inf) = NaN, and the whole row is NaN. Masking with -inf "
    "is fine as long as every query keeps at least one key; a padding mask for an empty "
    "sequence (length 0), or a causal mask combined with a padding mask, leaves a row with "
    "none. Using the dtype's most negative finite value instead of -inf keeps such rows "
    "finite."
)


@rule(
    "NW402",
    title="Fully masked attention row",
    severity="error",
    summary=(
        "A softmax got a row that is -inf everywhere (every key masked): softmax of all "
        "-inf is NaN, as is x - max(x) in one written by hand over rows or graph segments "
        "(-inf - (-inf)); mask with finfo.min or drop empty rows."
    ),
    priority=10,
)
def fully_masked_row(ctx: RuleContext) -> Iterator[Diagnosis]:
    a = ctx.anomaly
    if a is None or a.transient:
        return
    cause = cause_of(a)
    if cause is not None:
        if cause.kind == "hidden-nan":
            return  # NW407's
        if cause.kind == "inf-arith":
            yield from _masked_by_hand(ctx, a, cause.event, cause.trigger)
            return
        if cause.kind == "other" and _softmax_backward(cause.event):
            yield _hidden_masked_row(ctx, a, cause.event)
            return
        if cause.kind == "other" and _logsumexp_backward(cause.event):
            yield _empty_logsumexp(ctx, a, cause.event)
            return
        if cause.kind == "other":
            yield from _fused_attention(ctx, a, cause.event)
            return
        if cause.kind == "neginf-input":
            yield from _emptied_reduction(ctx, a, cause)
            return
        if cause.kind != "masked-softmax":
            return
        yield _masked_softmax(ctx, a, cause.event, cause.chain)
        return
    if a.kind is not AnomalyKind.FORWARD:
        return
    if a.path == LOSS_PATH:  # loss code read from its graph (no op traced): a -inf row
        yield from _emptied_in_graph(ctx, a)
        return
    s = a.record.stat
    text = f"{a.path} {a.record.module_type}".lower()
    if s is None or s.has_posinf or s.has_neginf or "atten" not in text:
        return
    call = ctx.trace.call(a.record.call)
    typ = call.module_type if call is not None else a.record.module_type
    yield ctx.diagnosis(
        **anomaly_fields(a),
        evidence=[
            f"NaN (and no inf) born in the attention module {a.path} ({typ}) from finite "
            "inputs: the signature of a softmax over a fully masked row",
            untraced_hint(ctx),
        ],
        explanation=_EXPLAIN,
        fix=_fix_for(ctx, a.record.call),
        priority=20,
    )


def _masked_softmax(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, chain: tuple[OpEvent, ...]
) -> Diagnosis:
    """A softmax over a row that a -inf mask (or a cast to -inf) filled everywhere: in
    attention, a query with no key; over choices (experts, classes), no valid choice."""
    x = first_input(ev)
    mask = next((e for e in chain if e.injected), None)
    cast = next((e for e in chain if _cast_to_inf(e) is not None), None)
    const = next((c for c in map(overflowed_constant, chain) if c is not None), None)
    attention = _is_attention(ctx, a.record.call, [ev, mask])
    what = "scores" if attention is True else "values"
    evidence = []
    if x is not None:
        evidence.append(
            f"{short_op(ev.op)} input: {x.neginf or 'some':,} of {x.numel:,} {what} are "
            "-inf and none is NaN or +inf: at least one row is -inf everywhere"
            if isinstance(x.neginf, int)
            else f"{short_op(ev.op)} input holds -inf and no NaN or +inf"
        )
        evidence.append(f"input: {describe_stat(x)}")
    if ev.output.nan:
        evidence.append(f"output: {ev.output.nan:,} NaN of {ev.output.numel:,} values")
    if cast is not None:
        evidence.append(_cast_to_inf(cast) or "")
    elif const is not None:
        evidence.append(_constant_words(const))
    elif mask is not None:
        val = mask.scalars.get("value")
        line = code_line(mask)
        evidence.append(
            f"the -inf came from {short_op(mask.op)}"
            + (f"(value={fmt(val) if isinstance(val, float) else val})" if val else "")
            + (f" {line}" if line else "")
        )
    line = code_line(ev)
    if line:
        evidence.append(line)
    title = None
    if cast is not None:
        fix = _cast_fix(cast)
        explanation = _EXPLAIN + _EXPLAIN_CAST.format(dtype=cast.dtype)
    elif const is not None:
        fix = _constant_fix(const)
        explanation = _constant_explanation(const, attention is True)
    elif not attention and _left_out(ctx, a):
        title = "Fully masked softmax row: no valid choice left"
        fix = _own_mask_fix(mask, attention=False) or _choice_fix(mask, ev)
        explanation = _EXPLAIN_CHOICE_LEFT_OUT
    elif attention is None:
        title = "Fully masked softmax row"
        fix = _either_fix(mask, ev)
        explanation = _EXPLAIN_EITHER
    elif not attention:
        title = "Fully masked softmax row: no valid choice left"
        fix = _choice_fix(mask, ev)
        explanation = _EXPLAIN_CHOICE
    else:
        module = _torch_module(ctx, a.record.call, ev)
        inverted = _inverted_mask(mask, ev.output, ev.code) if module else None
        if inverted is not None:
            evidence.insert(0, inverted)
        fix = _fix_for(ctx, a.record.call, ev, inverted=inverted is not None)
        if fix == _FIX:  # hand-written attention: rewrite the user's own mask line
            own = _own_mask_fix(mask)
            partly = _partly_empty(a, ev)
            if partly is not None:  # no sequence is empty: pad queries with no key
                evidence.insert(0, partly)
                head = own.split("\n", 1)[0] if own else _FIX.split("\n# ", 1)[0]
                own = head + _PAD_QUERIES
            fix = own or fix
        explanation = _EXPLAIN
    fields = {"title": title} if title else {}
    return ctx.diagnosis(
        **op_fields(ev, a), evidence=evidence, explanation=explanation, fix=fix, **fields
    )


_PAD_QUERIES = (
    "\n# no sequence is empty: the rows with no key are pad positions' queries (left "
    "padding under a causal mask sees only pad keys); the finite fill keeps them finite, "
    "and leave pad positions out of the loss (labels -100 where attention_mask is 0)"
)


def _partly_empty(a: Anomaly, soft: OpEvent) -> str | None:
    """Evidence that the NaN rows are only some of the positions of the samples that hold
    them: the first NaN tensor, (batch, length, features), holds a NaN count that is not a
    whole number of samples (a query's row is NaN whole, a sample with no key at all is NaN
    at every position); where its values were not counted (read late, on the accelerator
    path), the softmax's output, split into as many samples. Then no sequence is empty:
    some queries of a sample had keys, and others had none (a causal mask over left
    padding). None when that cannot be told."""
    r = a.record
    if len(r.shape) < 3 or r.shape[0] <= 0 or r.shape[1] <= 0:
        return None
    batch, length = r.shape[0], r.shape[1]
    s = r.stat
    if s is not None and isinstance(s.nan, int) and not s.posinf and not s.neginf:
        per_sample = s.numel // batch
        per_position = per_sample // length
        if s.nan > 0 and per_position > 0 and s.nan % per_sample != 0 and s.nan % per_position == 0:
            return (
                f"{r.path} {r.role} {tuple(r.shape)} is NaN at {s.nan // per_position:,} of "
                f"its {batch * length:,} positions, not a whole number of samples: " + _PARTLY
            )
        return None
    out = soft.output
    if not isinstance(out.nan, int) or out.nan <= 0 or out.numel % batch != 0:
        return None
    per_sample = out.numel // batch
    if out.nan % per_sample == 0:
        return None
    return (
        f"{short_op(soft.op)} output is NaN at {out.nan:,} of {out.numel:,} values, not a "
        f"whole number of its {batch} samples ({per_sample:,} values each): " + _PARTLY
    )


_PARTLY = (
    "those samples' other queries had keys, so no sequence is empty; a query with no key "
    "at all in a non-empty sequence is a pad position under a causal mask (left padding: "
    "its only earlier keys are pads)"
)


def _left_out(ctx: RuleContext, a: Anomaly) -> bool:
    """The NaN rows never reached the loss (a torch.where or a 0 mask drops the rows with
    no valid choice): the NaN showed up in backward, or the step's loss was finite."""
    loss = ctx.trace.loss
    return a.kind is AnomalyKind.BACKWARD or (loss is not None and loss - loss == 0)


_EXPLAIN_CHOICE_LEFT_OUT = (
    "softmax(x) = exp(x - max(x)) / sum(...): on a row where every value is -inf the max "
    "is -inf, x - max is -inf - (-inf) = NaN, and the whole row is NaN. A row with every "
    "choice masked has no valid choice; your code leaves such rows out of the loss, but "
    "backward still runs through them and its gradient there is NaN. The dtype's most "
    "negative finite value instead of -inf keeps them finite."
)

_EXPLAIN_CHOICE = (
    "softmax(x) = exp(x - max(x)) / sum(...): on a row where every value is -inf the max "
    "is -inf, x - max is -inf - (-inf) = NaN, and the whole row is NaN. A row with every "
    "choice masked has no valid choice: no fill value makes it right (the dtype's most "
    "negative finite value instead of -inf spreads it evenly over the choices the mask "
    "forbids). Make sure each row keeps at least one allowed entry."
)


_EXPLAIN_EITHER = (
    "softmax(x) = exp(x - max(x)) / sum(...): on a row where every value is -inf the max "
    "is -inf, x - max is -inf - (-inf) = NaN, and the whole row is NaN. In attention (a "
    "query whose every key is masked: an empty sequence, length 0) the dtype's most "
    "negative finite value instead of -inf keeps such a row finite; in a softmax over "
    "choices (actions, experts) such a row has no valid choice, and each row must keep at "
    "least one allowed entry. Only the root module's call was recorded (sentinel mode), so "
    "the module that ran the softmax is not known; watch mode names it."
)


def _either_fix(mask: OpEvent | None, soft: OpEvent) -> str:
    """Attention or a choice, not known: the check that no row is fully masked (right for
    both), and the finite fill for attention in a comment."""
    own = _own_mask_fix(mask)
    line = own.split("\n", 1)[0].split("   #", 1)[0] if own else None
    head = _choice_fix(mask, soft).split("\n# ", 1)[0]
    tail = (
        "# if this softmax is attention (a query with no key), a finite fill keeps the row "
        f"finite instead: {line}"
        if line
        else "# if this softmax is attention (a query "
        "with no key), fill with torch.finfo(dtype).min instead of -inf"
    )
    return (
        f"{head}\n{tail}\n# if it picks a choice (an action, an expert), make sure each "
        "row keeps at least one allowed entry"
    )


@rule(
    "NW407",
    title="NaN hidden by a mask in forward, NaN gradient in backward",
    severity="error",
    summary=(
        "A value that held NaN (a NaN target, a log of a negative number) was selected away "
        "by torch.where or zeroed by a mask, so the loss stayed finite; backward still "
        "multiplies its 0 gradient by the NaN (0 × NaN = NaN). Clean the value before the "
        "torch.where or the mask."
    ),
    priority=10,
)
def hidden_nan_gradient(ctx: RuleContext) -> Iterator[Diagnosis]:
    a = ctx.anomaly
    if a is None or a.transient:
        return
    cause = cause_of(a)
    if cause is not None and cause.kind == "hidden-nan" and not _loss_not_finite(ctx):
        yield _hidden_nan(ctx, a, cause.event)
    elif a.op is not None and forward_nan_hidden(ctx, a):
        yield _hidden_forward_nan(ctx, a, a.op)


def forward_nan_hidden(ctx: RuleContext, a: Anomaly) -> bool:
    """Forensic mode: no backward op made the anomaly's NaN gradient (each was given the
    NaN), so its op is the forward op that made a NaN the loss never saw (a torch.where or
    a 0 mask hid it, and the loss is finite): NW407's, whatever op made it."""
    ev = a.op
    if not (
        a.kind is AnomalyKind.BACKWARD
        and ev is not None
        and ev.phase is Phase.FORWARD
        and not ev.injected
        and "NaN" in ev.born
        and not _loss_not_finite(ctx)
    ):
        return False
    if any(st is not None and st.has_nan for _, st in ev.inputs):
        return True  # a NaN given to the op and hidden after it: clean it before the op
    # made from finite inputs outside the op's domain (a root of a negative number): the
    # hidden NaN's story only when the op's line selects with torch.where (the double
    # where); hidden by a later gather or index, the op's domain is what to fix
    return bool(ev.code) and _double_where(ev, {n for n, _ in ev.inputs} or {"self"}) is not None


def _loss_not_finite(ctx: RuleContext) -> bool:
    """Whether the step's loss is known to be NaN or inf: its value (``trace.loss``), else
    the last one-value forward output of a root or a loss module. Then the NaN a backward
    node saved reached the loss, and no mask or torch.where hid it: not NW407's."""
    loss = ctx.trace.loss
    if loss is not None:
        return not math.isfinite(loss)
    last: TensorStat | None = None
    for r in ctx.trace.records:
        if r.phase is not Phase.FORWARD:
            continue
        st = ctx.trace.resolve(r).stat
        call = ctx.trace.call(r.call)
        if st is not None and st.numel == 1 and call is not None and (call.root or call.is_loss):
            last = st
    return last is not None and not last.finite


def _hidden_nan(ctx: RuleContext, a: Anomaly, ev: OpEvent) -> Diagnosis:
    """A backward node whose saved forward values held NaN: the forward's NaN never reached
    the loss (``torch.where(mask, (p - y) ** 2, 0)`` with NaN targets, ``x * 0``), and the
    gradient through the hidden branch is 0 × NaN = NaN."""
    bad = [(n, st) for n, st in ev.inputs if st is not None and st.has_nan]
    evidence = [
        f"{ev.node} saved its forward {n}: {describe_stat(st)}: it already held NaN in "
        "forward, so this gradient was not born here"
        for n, st in bad[:2]
    ]
    evidence.append(
        "the loss was finite: a torch.where or a multiplication by a 0 mask hid those NaN "
        "from it, but backward still multiplies their gradient (0) by them: 0 × NaN = NaN"
    )
    line = code_line(ev)
    if line:
        evidence.append(line)
    return ctx.diagnosis(
        **op_fields(ev, a),
        title="NaN hidden by a mask in forward, NaN gradient in backward",
        evidence=evidence,
        explanation=(
            "A value that held NaN (a NaN target in a masked window, a log of a negative "
            "number in the unselected branch) was selected away by torch.where or zeroed by "
            "a mask, so the loss stayed finite. Autograd still computes the gradient of the "
            "discarded branch, and 0 times NaN is NaN: every weight gets NaN. Clean the "
            "value before it enters the expression, not after."
        ),
        fix=_hidden_nan_fix(ev, {n for n, _ in bad}),
    )


def _hidden_forward_nan(ctx: RuleContext, a: Anomaly, ev: OpEvent) -> Diagnosis:
    """Forensic mode's view of :func:`_hidden_nan`: the forward op that made the NaN a
    torch.where or a 0 mask kept from the loss (``torch.where(h > 0, torch.sqrt(h), 0)``),
    named as the anomaly's op because no backward op made the NaN gradient, each was given
    it. The fix is the hidden NaN's, not one for the op's domain: the where already keeps
    the op's out-of-domain results out of the forward."""
    op = short_op(ev.op)
    evidence = [f"{op} made NaN in forward: {describe_stat(ev.output)}"]
    evidence += [f"input {n}: {describe_stat(st)}" for n, st in ev.inputs[:2] if st is not None]
    evidence.append(
        "the loss was finite: a torch.where or a multiplication by a 0 mask hid those NaN "
        "from it, but backward still multiplies their gradient (0) by them: 0 × NaN = NaN"
    )
    line = code_line(ev)
    if line:
        evidence.append(line)
    return ctx.diagnosis(
        **op_fields(ev, a),
        title="NaN hidden by a mask in forward, NaN gradient in backward",
        evidence=evidence,
        explanation=(
            "A value that held NaN (a root or a log of a negative number in the unselected "
            "branch, a NaN target in a masked window) was selected away by torch.where or "
            "zeroed by a mask, so the loss stayed finite. Autograd still computes the "
            "gradient of the discarded branch, and 0 times NaN is NaN: every weight gets "
            "NaN. Give the op a safe value where its result is discarded, not after."
        ),
        fix=_hidden_nan_fix(ev, {n for n, _ in ev.inputs} or {"self"}),
    )


#: the hidden-NaN fix: each line with the code whose names it needs (None: prose only)
_HIDDEN_NAN_FIX = (
    ("y = torch.nan_to_num(y)                        # clean the NaN before the op", None),
    (
        "loss = torch.where(mask, (p - y) ** 2, 0.0)    # now its gradient is finite",
        "loss = torch.where(mask, (p - y) ** 2, 0.0)",
    ),
    (
        "# or select first: loss = ((p[mask] - y[mask]) ** 2).mean()",
        "loss = ((p[mask] - y[mask]) ** 2).mean()",
    ),
)


def _op_names(op: str) -> list[str]:
    """The names the user's code may call an aten op by: ``aten.linalg_vector_norm`` ->
    ``linalg_vector_norm``, ``vector_norm``, ``norm``; ``aten._softmax`` -> ``softmax``."""
    parts = packet(op).strip("_").split("_")
    return ["_".join(parts[i:]) for i in range(len(parts)) if parts[i]]


def _cleaned_on_line(ev: OpEvent, bad: set[str]) -> str | None:
    """The user's line of the op whose saved forward input held NaN, with that input
    passed through torch.nan_to_num (``err = torch.nan_to_num(pred - gt).norm(dim=-1)``):
    its gradient at the NaN is then 0, not NaN. None when the line does not show the op."""
    ops = binary_operands(ev)
    if ops is not None:
        name = next((n for n in ("self", "other") if n in bad), None)
        if name is None:
            return None
        expr = ops[name].strip()
        stmt = next((st for st in statements(ev.code) if expr in st), None)
        if stmt is None:
            return None
        at = stmt.index(expr)
        return f"{stmt[:at]}torch.nan_to_num({expr}){stmt[at + len(expr) :]}"
    if not bad & {"self", "input", "result"}:
        return None
    return rewrite_call(ev.code, _op_names(ev.op), lambda e: f"torch.nan_to_num({e})")


#: ops defined on part of the line (or with an infinite derivative at its edge), which make
#: NaN or inf in the branch a torch.where discards; the value each is given there instead
#: (its function and derivative are finite at it)
_DOMAIN_SAFE = {
    "sqrt": "1.0",
    "rsqrt": "1.0",
    "log": "1.0",
    "log2": "1.0",
    "log10": "1.0",
    "log1p": "0.0",
    "reciprocal": "1.0",
    "acos": "0.0",
    "asin": "0.0",
    "atanh": "0.0",
    "arccos": "0.0",
    "arcsin": "0.0",
    "arctanh": "0.0",
    "erfinv": "0.0",
    "lgamma": "1.0",
    "digamma": "1.0",
    "pow": "1.0",
}

#: modules whose functions take the tensor first (``torch.sqrt(x)``), as opposed to a
#: tensor's method (``x.sqrt()``)
_NAMESPACES = frozenset(("torch", "F", "math", "special", "np"))


def _domain_arg(node: ast.AST, names: Sequence[str], *, any_power: bool = False) -> ast.expr | None:
    """The argument of the call of one of ``names`` that ``node`` is: ``x`` of
    ``torch.sqrt(x)``, ``x.sqrt()``, ``x ** 0.5`` (a fractional power, or ``any_power``);
    None otherwise."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and "pow" in names:
        exp = node.right
        if any_power:
            return node.left
        if isinstance(exp, ast.Constant) and isinstance(exp.value, float):
            return None if exp.value.is_integer() else node.left
        return None
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in names:
        return None
    if isinstance(func, ast.Attribute):
        owner = func.value
        while isinstance(owner, ast.Attribute):
            owner = owner.value
        if not (isinstance(owner, ast.Name) and owner.id in _NAMESPACES):
            return func.value  # x.sqrt()
    return node.args[0] if node.args else None


def _outer_domain_arg(node: ast.AST) -> tuple[ast.expr, str] | None:
    """The outermost call in ``node`` of an op with a restricted domain (see
    :data:`_DOMAIN_SAFE`): its argument and the value it is safe at; None when it has
    none (the NaN came in with the data: a NaN target)."""
    queue = [node]
    while queue:
        cur = queue.pop(0)
        for name, safe in _DOMAIN_SAFE.items():
            arg = _domain_arg(cur, (name,))
            if arg is not None:
                return arg, safe
        queue.extend(ast.iter_child_nodes(cur))
    return None


def _double_where(ev: OpEvent, bad: set[str]) -> str | None:
    """The user's line with the "double where": the op that made (or was given) the NaN
    inside a ``torch.where`` branch gets its argument through the same condition, with a
    value it is finite at where the branch is discarded
    (``torch.where(z > 0, torch.sqrt(z), 0)`` ->
    ``torch.where(z > 0, torch.sqrt(torch.where(z > 0, z, 1.0)), 0)``). torch.where's
    backward gives the discarded entries a 0 gradient, and the op's derivative there is
    finite, so no 0 × NaN is left; cleaning the result (or nan_to_num of a finite input
    that is out of the op's domain) leaves it. None when the line has no torch.where
    around the op."""
    names = _op_names(ev.op)
    operands = binary_operands(ev) if bad & {"self", "other"} else None
    for stmt in statements(ev.code):
        try:
            tree = ast.parse(stmt)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "where"
                and len(node.args) == 3
                and node.lineno == node.end_lineno
            ):
                continue
            cond = ast.get_source_segment(stmt, node.args[0])
            if cond is None:
                continue
            for branch, keep in ((node.args[1], cond), (node.args[2], f"~({cond})")):
                found = _nan_maker(stmt, branch, names, operands, bad)
                if found is None:
                    continue
                arg, safe = found
                text = ast.get_source_segment(stmt, arg)
                if text is None or arg.col_offset is None or arg.end_col_offset is None:
                    continue
                return (
                    f"{stmt[: arg.col_offset]}torch.where({keep}, {text}, {safe})"
                    f"{stmt[arg.end_col_offset :]}"
                )
    return None


def _nan_maker(
    stmt: str,
    branch: ast.expr,
    names: list[str],
    operands: dict[str, str] | None,
    bad: set[str],
) -> tuple[ast.expr, str] | None:
    """In one branch of a torch.where: the expression to pass through the condition, and
    the value to give it where the branch is discarded. The op's own argument when the op
    saved its NaN result or input (``torch.sqrt(z)``: ``z``); for a binary op's NaN
    operand (``a / (b - 1).sqrt()``), the argument of the op inside it that made the NaN
    (``b - 1``), or the operand itself when nothing in it could (a NaN target)."""
    if operands is not None:
        for side in ("self", "other"):
            if side not in bad:
                continue
            want = operands[side].strip()
            for node in ast.walk(branch):
                if ast.get_source_segment(stmt, node) == want:
                    inner = _outer_domain_arg(node)
                    if inner is not None:
                        return inner
                    return (node, "1.0") if isinstance(node, ast.expr) else None
        return None
    safe = next((_DOMAIN_SAFE[n] for n in names if n in _DOMAIN_SAFE), "1.0")
    given = bool(bad & {"self", "input"})  # the NaN came into the op: any power of it
    for node in ast.walk(branch):
        arg = _domain_arg(node, names, any_power=given)
        if arg is not None:
            return arg, safe
    return None


def _hidden_nan_fix(ev: OpEvent, bad: set[str] | None = None) -> str:
    """The user's op line with the NaN input cleaned, where the line shows the op; else the
    template fix, keeping only the lines whose names the user's function has (a ``p`` it
    never defined is left out); prose says the rest."""
    guarded = _double_where(ev, bad or set()) if ev.code else None
    if guarded is not None:
        return (
            f"{guarded}   # the entries torch.where discards get a safe value before the "
            "op: their gradient is then 0, not 0 × NaN\n"
            "# (nan_to_num after the op, or on an input that is finite but outside the "
            "op's domain, leaves the NaN in backward)"
        )
    cleaned = _cleaned_on_line(ev, bad or set()) if ev.code else None
    if cleaned is not None:
        return (
            f"{cleaned.strip()}   # clean the NaN before the op, not after: its gradient "
            "there is 0, not 0 × NaN\n"
            "# or select the rows the mask keeps before this op, so the NaN never enters it"
        )
    known = _function_names(ev.source, ev.code)
    kept = [line for line, code in _HIDDEN_NAN_FIX if _names_known(code or line, known)]
    if not kept or not kept[0].startswith("y ="):
        kept.insert(
            0,
            "# clean the NaN with torch.nan_to_num where the value is made (the target, the "
            "log's input), before the torch.where or the 0 mask, not after",
        )
    if len(kept) == 1:
        kept.append(
            "# then the torch.where (or the 0 mask) after it has a finite gradient; or select "
            "the kept rows with the mask before the op"
        )
    return "\n".join(kept)


def _constant_words(c: OverflowedConstant) -> str:
    """``the -inf came from aten.mul.Tensor at a.py:12: <code>: -1e9 is -inf in float16
    (max 65504)``."""
    line = code_line(c.event)
    sign = "-inf" if c.value < 0 else "+inf"
    return (
        f"the -inf came from {short_op(c.event.op)}" + (f" {line}" if line else "") + ": "
        f"{c.literal} is {sign} in {c.dtype} (max {fmt(c.max)})"
    )


def _constant_explanation(c: OverflowedConstant, attention: bool) -> str:
    """Why a finite mask constant made a NaN row: it overflowed the dtype."""
    sign = "-inf" if c.value < 0 else "+inf"
    what = "key" if attention else "entry"
    return (
        f"{c.literal} is {sign} in {c.dtype} (max {fmt(c.max)}): the mask constant does not "
        f"fit in the dtype, so {short_op(c.event.op)} wrote {sign} at the masked positions. "
        f"A row with every {what} masked is then -inf everywhere, and softmax(x) = "
        "exp(x - max(x)) / sum(...) computes -inf - (-inf) = NaN for the whole row (in "
        "float32 the same row stays finite). torch.finfo(dtype).min is the most negative "
        f"value {c.dtype} holds: with it a fully masked row stays finite."
    )


def _constant_fix(c: OverflowedConstant) -> str:
    """The user's line with the constant replaced by the dtype's most negative finite value,
    and the clamp that keeps a masked score from rounding past it when added."""
    d = dtype_expr(c.event.code, c.dtype)
    fixed = replace_constant(c)
    low = f"torch.finfo({d}).min"
    head = (
        f"{fixed}   # not {c.literal}: it is -inf in {c.dtype} (max {fmt(c.max)})"
        if fixed
        else f"# replace {c.literal} with {low}: {c.literal} is -inf in {c.dtype} "
        f"(max {fmt(c.max)})"
    )
    line = (c.event.code or "").split("  #", 1)[0]
    if fixed and "+" not in line and re.search(r"\b(?:where|masked_fill_?)\(", line):
        return head  # the constant replaces the masked scores: nothing is added to it
    return (
        f"{head}\n"
        f"# a negative score plus {low} can still round to -inf: after adding the mask, "
        f"clamp the sum with .clamp_min({low})"
    )


_EXPLAIN_CAST = (
    " Here the mask held a large finite negative value, which does not fit in {dtype}: "
    "the cast to {dtype} rounded it to -inf, and a fully masked row became -inf everywhere."
)


def _fused_attention(ctx: RuleContext, a: Anomaly, ev: OpEvent) -> Iterator[Diagnosis]:
    """A fused attention kernel (nn.MultiheadAttention's eval fast path,
    aten._native_multi_head_attention; scaled_dot_product_attention) that made NaN, and no
    inf, from finite inputs: its softmax ran inside the kernel over a row with every key
    masked (the boolean mask is not among the recorded inputs)."""
    if a.kind is not AnomalyKind.FORWARD or ev.phase is not Phase.FORWARD:
        return
    out = ev.output
    if out.has_posinf or out.has_neginf or not out.has_nan:
        return
    ins = inputs_of(ev)
    if not ins or not all(x.finite for x in ins):
        return
    call = ctx.trace.call(a.record.call)
    typ = call.module_type if call is not None else a.record.module_type
    text = f"{packet(ev.op)} {a.path} {typ}".lower()
    if "atten" not in text or not _may_softmax(ev.op):
        return
    evidence = [
        f"{short_op(ev.op)} made {out.nan or 'some':,} NaN (and no inf) of {out.numel:,} "
        f"values from finite inputs, in the attention module {a.path} ({typ}): the "
        "signature of a softmax over a fully masked row inside the fused kernel"
        if isinstance(out.nan, int)
        else f"{short_op(ev.op)} made NaN (and no inf) from finite inputs in the attention "
        f"module {a.path} ({typ}): the signature of a softmax over a fully masked row",
    ]
    line = code_line(ev)
    if line:
        evidence.append(line)
    inverted = _inverted_mask(None, out, ev.code) if _torch_module(ctx, a.record.call, ev) else None
    if inverted is not None:
        evidence.insert(0, inverted)
    yield ctx.diagnosis(
        **op_fields(ev, a),
        evidence=evidence,
        explanation=_EXPLAIN,
        fix=_fix_for(ctx, a.record.call, ev, inverted=inverted is not None),
    )


def _may_softmax(op: str) -> bool:
    """Whether ``op`` may run a softmax inside it: a fused attention kernel
    (``aten._native_multi_head_attention``, ``aten._scaled_dot_product_*_attention``), a
    softmax, or an op outside aten (a custom kernel nothing here can read). An aten op
    without one (``native_layer_norm`` of an attention block's output, whose variance
    overflowed) that made NaN from finite inputs is no masked row."""
    if not op.startswith("aten."):
        return True
    name = packet(op).lower()
    return "atten" in name or "softmax" in name


_EXPLAIN_BY_HAND = (
    "A row or segment whose every value is masked to -inf (a node with no unmasked edge, an "
    "empty sequence, a causal mask combined with a padding mask) has max = -inf, and "
    "subtracting that max, as a softmax written by hand does, computes -inf - (-inf) = NaN. "
    "Masking with -inf is fine as long as every row or segment keeps one unmasked value; "
    "the dtype's most negative finite value, torch.finfo(dtype).min, keeps empty ones "
    "finite, or skip them."
)


def _masked_by_hand(
    ctx: RuleContext, a: Anomaly, ev: OpEvent, trigger: OpEvent
) -> Iterator[Diagnosis]:
    """x - max(x) over a row or segment that a constant -inf masked everywhere: the
    subtraction of a softmax written by hand (scatter_reduce amax, a segment max)."""
    if inf_arithmetic(ev) != "-inf - (-inf)":
        return
    src = inf_source(ctx.trace, a, ev)
    if src.kind != "mask":
        return
    mode = ctx.facts.get("mode")
    yield ctx.diagnosis(
        **op_fields(ev, a),
        title="Fully masked row or segment: -inf - (-inf) = NaN",
        evidence=inf_evidence(ev, src, trigger, mode),
        explanation=_EXPLAIN_BY_HAND,
        fix=inf_fix(ev, src, forensic=mode == "forensic"),
    )


#: autograd nodes of a softmax: their backward turns a finite gradient into NaN only when
#: the forward result they saved was NaN (a row that was -inf everywhere)
_SOFTMAX_NODES = frozenset({"Softmax", "LogSoftmax"})


def _softmax_backward(ev: OpEvent) -> bool:
    """A softmax's backward node made NaN, known by name only (what it saved was freed)."""
    return (
        ev.phase is Phase.BACKWARD
        and node_base(ev.node) in _SOFTMAX_NODES
        and "NaN" in ev.born
        and not ev.inputs
    )


def _hidden_masked_row(ctx: RuleContext, a: Anomaly, ev: OpEvent) -> Diagnosis:
    """A softmax's backward made NaN from a finite gradient while the loss was finite: its
    forward result held NaN, a row with every value masked to -inf, which torch.where or a
    0 mask then hid from the loss."""
    op = short_op(ev.op)
    evidence = [
        a.summary,
        f"{ev.node} made NaN from a finite gradient: {op}'s backward does that only when "
        "its forward result held NaN, and the loss was finite, so the NaN was hidden",
    ]
    fwd = ctx.trace.record(a.record.source) if a.record.source is not None else None
    if fwd is not None and fwd.stat is not None and fwd.stat.has_neginf:
        evidence.append(
            f"{fwd.path}'s {fwd.role} (forward), the input of {op}: "
            f"{describe_stat(fwd.stat)}: a row of it that is -inf everywhere gives NaN"
        )
    evidence.append(untraced_hint(ctx))
    return ctx.diagnosis(
        **op_fields(ev, a),
        title="Fully masked row: NaN hidden in forward, NaN gradient in backward",
        evidence=evidence,
        explanation=(
            f"{op} of a row whose every value is -inf (a query or list with no item left, an "
            "empty sequence) is NaN. torch.where(has_items, per_row, 0) or a multiplication "
            "by a 0 mask keeps it out of the loss, but backward still runs through that row: "
            f"{op}'s gradient there is NaN, and it reaches every weight. Mask with the "
            "dtype's most negative finite value, or leave the empty rows out before the "
            "softmax."
        ),
        fix=(
            "scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)   # not -inf: "
            "an empty row stays finite\n"
            "# or drop the rows with no item left before the softmax:\n"
            "keep = mask.any(dim=-1)\n"
            "scores, mask = scores[keep], mask[keep]"
        ),
    )


def _logsumexp_backward(ev: OpEvent) -> bool:
    """logsumexp's backward made NaN from the -inf its forward input held: its gradient is
    exp(x - logsumexp(x)), and on a row that is -inf everywhere that is -inf - (-inf)."""
    if ev.phase is not Phase.BACKWARD or node_base(ev.node) != "Logsumexp":
        return False
    ins = inputs_of(ev)
    return "NaN" in ev.born and any(s.has_neginf for s in ins) and not any(s.has_nan for s in ins)


def _neg_inf_line(ctx: RuleContext, a: Anomaly, ev: OpEvent) -> OpEvent | str | None:
    """Where the user's code writes the -inf: the op that put it in, when its line holds
    the literal, else the one line of the function above it that does (``NEG =
    float("-inf")``, used by the op by name), as ``path:line``."""
    import linecache

    src = inf_source(ctx.trace, a, ev)
    for m in src.events:
        if _NEG_INF.search((m.code or "").split("  #", 1)[0]):
            return m
    for m in src.events:
        path, _, num = (m.source or "").rpartition(":")
        if not path or not num.isdigit():
            continue
        found = []
        for n in range(int(num), max(0, int(num) - 60), -1):
            text = linecache.getline(path, n)
            if _NEG_INF.search(text.split("  #", 1)[0]):
                found.append((n, text.strip()))
            if re.match(r"\s*(?:async\s+)?def\s", text):
                break
        if len(found) == 1:
            return f"{path}:{found[0][0]}: {found[0][1]}"
    return None


def _empty_logsumexp(ctx: RuleContext, a: Anomaly, ev: OpEvent) -> Diagnosis:
    """torch.logsumexp over a row that is -inf everywhere (an unreachable state of a
    hand-written CTC / RNN-T / HMM lattice, a fully masked row): the forward is -inf, a
    correct log 0, but the gradient exp(x - lse) is exp(-inf - (-inf)) = NaN, and autograd
    multiplies it by the row's gradient even when that is 0."""
    x = input_named(ev, "self", "input")
    lse = input_named(ev, "other", "result")
    dtype = ev.dtype or "float32"
    lim = limits(dtype)
    evidence = [
        f"{ev.node} made NaN: {short_op(ev.op)} computed exp(x - logsumexp(x)) = "
        "exp(-inf - (-inf)) in the backward of torch.logsumexp"
        + (f" at {ev.source}: {ev.code.strip()}" if ev.source and ev.code else "")
    ]
    if x is not None:
        evidence.append(f"logsumexp's input: {describe_stat(x)}")
    if lse is not None and lse.has_neginf:
        rows = f"{lse.neginf:,} of {lse.numel:,}" if isinstance(lse.neginf, int) else "some"
        evidence.append(
            f"logsumexp's result: {rows} values are -inf: those rows of its input are -inf "
            "everywhere (nothing reaches them)"
        )
    where = _neg_inf_line(ctx, a, ev)
    if isinstance(where, OpEvent):
        evidence.append(put_in(where))
    elif where is not None:
        evidence.append(f"the -inf is written at {where}")
    big = "-1e30" if lim is not None and lim.max > 1e30 else f"torch.finfo(torch.{dtype}).min"
    fixed: str | None = None
    if isinstance(where, OpEvent):
        fixed = _NEG_INF.sub(big, (where.code or "").split("  #", 1)[0].rstrip()).strip()
    elif where is not None:
        fixed = _NEG_INF.sub(big, where.split(": ", 1)[1].split("  #", 1)[0].rstrip()).strip()
    head = (
        f"{fixed}   # not -inf: unreachable states stay finite, their gradient is 0"
        if fixed
        else f"NEG = {big}   # for unreachable states, not float('-inf'): their gradient is 0"
    )
    return ctx.diagnosis(
        **op_fields(ev, a),
        title="logsumexp over a row that is all -inf: NaN gradient",
        evidence=evidence,
        explanation=(
            "torch.logsumexp of a row whose every value is -inf is -inf, a correct forward "
            "value (log 0: no path reaches that state of the lattice). Its gradient is "
            "softmax(x) = exp(x - logsumexp(x)), and on that row it is exp(-inf - (-inf)) = "
            "NaN; autograd multiplies it by the row's gradient, and 0 × NaN is NaN, so it "
            "reaches every weight even when the row does not reach the loss. A large finite "
            f"negative value ({big} in {dtype}) instead of -inf gives the same forward "
            "result, since exp of it is 0, and a finite gradient."
        ),
        fix=(
            f"{head}\n"
            "# a sequence with no valid path then gets a huge finite loss: drop it, or for "
            "CTC use F.ctc_loss(..., zero_infinity=True), which handles unreachable states"
        ),
    )


#: reductions over a dim whose value on a row that is -inf everywhere is -inf: the log of an
#: empty sum, the max of nothing left
_ROW_REDUCTIONS = frozenset({"logsumexp", "amax", "max"})
#: binary ops that turn a -inf operand into +inf or NaN (x - (-inf), -inf + inf)
_INF_ARITH = frozenset({"sub", "rsub", "add"})


def _reduction_call(expr: str) -> tuple[str, str, str] | None:
    """(the reduction, the tensor it reduces, its dim) of an operand written as a row
    reduction: ``torch.logsumexp(x, 1)``, ``x.logsumexp(dim=-1)``, ``x.amax(1)``,
    ``x.max(dim=1).values``, ``torch.max(x, 1)[0]``. None for anything else (a reduction
    of the whole tensor has no rows).

    >>> _reduction_call("torch.logsumexp(pos_sim, 1)")
    ('logsumexp', 'pos_sim', '1')
    >>> _reduction_call("d.max(dim=1).values")
    ('max', 'd', '1')
    >>> _reduction_call("x.logsumexp()") is None
    True
    """
    try:
        node: ast.expr = ast.parse(expr.strip(), mode="eval").body
    except SyntaxError:
        return None
    picked = isinstance(node, ast.Subscript) and ast.unparse(node.slice) == "0"
    if picked or (isinstance(node, ast.Attribute) and node.attr == "values"):
        node = node.value  # type: ignore[attr-defined]
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return None
    name = node.func.attr
    if name not in _ROW_REDUCTIONS:
        return None
    args = list(node.args)
    owner = node.func.value
    if isinstance(owner, ast.Name) and owner.id == "torch":
        if not args:
            return None
        tensor, rest = args[0], args[1:]
    else:
        tensor, rest = owner, args
    dim = rest[0] if rest else next((k.value for k in node.keywords if k.arg == "dim"), None)
    if dim is None:
        return None
    return name, ast.unparse(tensor), ast.unparse(dim)


def _filled_with(mask: OpEvent, tensor: str) -> str | None:
    """The mask expression of ``tensor = src.masked_fill(MASK, -inf)`` on the mask op's
    line, when that line assigns ``tensor``: ``~pos`` of
    ``pos_sim = sim.masked_fill(~pos, float("-inf"))``."""
    if packet(mask.op).rstrip("_") != "masked_fill":
        return None
    for stmt in statements(mask.code):
        try:
            tree = ast.parse(stmt)
        except SyntaxError:
            continue
        body = tree.body[0] if len(tree.body) == 1 else None
        if not isinstance(body, ast.Assign) or len(body.targets) != 1:
            continue
        if ast.unparse(body.targets[0]) != tensor:
            continue
        call = body.value
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr in ("masked_fill", "masked_fill_")
            and call.args
        ):
            return ast.unparse(call.args[0])
    return None


_EXPLAIN_EMPTIED = (
    "{red} over a row whose every entry is masked to -inf is -inf: the row has nothing "
    "left to reduce (logsumexp of no term is log 0). That -inf is a correct value, but "
    "the next op turns it into {made}: x - (-inf) = +inf, -inf + inf = NaN, and the loss "
    "is {made}, its gradient NaN. In a contrastive or metric-learning loss it is an anchor "
    "with no positive in the batch (its class appears once) or no negative (the batch is "
    "one class). Leave the rows with nothing left out of the loss, or sample batches so "
    "that every row keeps an entry."
)


def _emptied_reduction(ctx: RuleContext, a: Anomaly, cause: Cause) -> Iterator[Diagnosis]:
    """An op that made +inf or NaN of a -inf operand that is a row reduction (logsumexp,
    amax, max over a dim) of a tensor a mask filled with -inf: the mask left some rows
    with no entry (an anchor with no positive), and the reduction of nothing is -inf."""
    ev, chain = cause.event, cause.chain
    if ev.phase is not Phase.FORWARD or packet(ev.op).rstrip("_") not in _INF_ARITH:
        return
    if any(s.has_nan for s in inputs_of(ev)):
        return
    mask = next((e for e in chain if e.injected and e.born == "-inf"), None)
    if mask is None or packet(mask.op).rstrip("_") not in ("masked_fill", "where", "index_put"):
        return  # a -inf of a log of 0, or the start of a running max: not a mask
    operands = binary_operands(ev)
    if operands is None:
        return
    found = None
    for name, s in inf_inputs(ev):
        call = _reduction_call(operands.get(name, "")) if s.has_neginf else None
        if call is not None and not s.has_posinf:
            found = (operands[name].strip(), call, s)
            break
    if found is None:
        return
    expr, (red, tensor, dim), s = found
    made = "NaN" if "NaN" in ev.born else "+inf"
    rows = (
        f"{s.neginf:,} of its {s.numel:,} values are"
        if isinstance(s.neginf, int)
        else "some of its values are"
    )
    evidence = [
        f"{expr} is -inf where a row of {tensor} is -inf everywhere along dim {dim}: "
        f"{rows} -inf (rows the mask left empty)",
        put_in(mask),
        f"{short_op(ev.op)} made {made} of it" + (f" ({line})" if (line := code_line(ev)) else ""),
    ]
    filled = _filled_with(mask, tensor)
    keep = f"{_negate(filled)}.any({dim})" if filled is not None else None
    if keep is not None:
        head = (
            f"keep = {keep}   # the rows of {tensor} where {filled} leaves at least one "
            "entry: the others have no " + red
        )
    else:
        head = (
            f"keep = torch.isfinite({expr})   # the rows of {tensor} with at least one "
            "entry left: the others have no " + red
        )
    whole = wrapped_binop(ev)
    stmt = statements(ev.code)
    rewritten = None
    if whole is not None and len(stmt) == 1 and stmt[0].count(whole[0]) == 1:
        rewritten = stmt[0].replace(whole[0], f"({whole[0]})[keep]") + (
            "   # the loss over those rows only"
        )
    fix = head + "\n"
    fix += rewritten or "# then compute the loss over those rows only: per_row[keep].mean()"
    fix += (
        "\n# and find why rows are empty: a class seen once in the batch has no positive; "
        "a sampler that draws k > 1 samples per class keeps every row"
    )
    yield ctx.diagnosis(
        **op_fields(ev, a),
        title=f"{red} over a row the mask left empty: -inf, then {made}",
        evidence=evidence,
        explanation=_EXPLAIN_EMPTIED.format(red=red, made=made),
        fix=fix,
    )


def _emptied_in_graph(ctx: RuleContext, a: Anomaly) -> Iterator[Diagnosis]:
    """The loss is +inf or NaN, no op was traced (watch, sentinel), and its graph holds a
    row reduction of a masked tensor whose result is -inf (the ``"emptied"`` of its
    ``"loss_graph"`` note): a row the mask left no entry in, which the loss subtracted."""
    s = a.record.stat
    if s is None or not (s.has_posinf or s.has_nan):
        return
    found = [
        e
        for n in ctx.notes("loss_graph")
        for e in n.data.get("emptied", ())
        if isinstance(e, dict) and "maskedfill" in e.get("made_from", ())[:1]
    ]
    if not found:
        return
    e = found[0]
    red, rows, of, dim = e.get("op", "logsumexp"), e.get("rows"), e.get("of"), e.get("dim")
    made = "NaN" if s.has_nan else "+inf"
    dims = dim[0] if isinstance(dim, list) and len(dim) == 1 else dim
    yield ctx.diagnosis(
        **anomaly_fields(a),
        title=f"{red} over a row the mask left empty: -inf, then {made}",
        evidence=[
            a.summary,
            f"the loss's graph holds torch.{red}(x, {dims}) of a masked_fill: {rows} of its "
            f"{of} values are -inf, each a row of x that the mask made -inf everywhere",
            "the loss is +inf: that -inf, subtracted, is +inf (x - (-inf))"
            if made == "+inf"
            else "the loss is NaN: that -inf, added to a +inf or subtracted from a -inf, is NaN",
            untraced_hint(ctx),
        ],
        explanation=_EXPLAIN_EMPTIED.format(red=red, made=made),
        fix=(
            f"keep = keep_mask.any({dims})   # keep_mask: True at the entries your "
            f"masked_fill keeps (its mask negated); the other rows have no {red}\n"
            "loss = per_row[keep].mean()   # per_row: the loss of each row, before its mean\n"
            "# and find why rows are empty: a class seen once in the batch has no positive; "
            "a sampler that draws k > 1 samples per class keeps every row"
        ),
    )
