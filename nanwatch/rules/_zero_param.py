"""NW110's story for a log of 0 whose zeros come from a watched parameter held at exactly 0
(``rate = gain * softplus(z)`` with ``gain`` projected to 0 by ``clamp_(min=0)`` between
two steps), read from the watcher's ``"zero_param"`` notes (see
:mod:`nanwatch._zero_params`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from nanwatch.records import Note, OpEvent, TensorStat
from nanwatch.rules._evidence import count, has_zero
from nanwatch.rules.base import RuleContext


@dataclass(frozen=True, slots=True)
class ZeroParamStory:
    title: str
    evidence: str
    why: str
    fix: str


#: a lower bound of 0 in an in-place clamp (``clamp_(min=0.0)``, ``clamp_(0)``,
#: ``clamp_min_(0.)``, ``clip_(min=0)``): the projection's floor, which the fix raises
_ZERO_BOUND = re.compile(
    r"(?P<head>\.(?:clamp|clip)_\((?:[^()]*,\s*)?min\s*=\s*|\.(?:clamp|clip|clamp_min)_\(\s*)"
    r"0(?:\.0*)?(?![\w.])"
)


def _floor_fix(code: str) -> str | None:
    """``code`` (a projection's statement) with its lower bound of 0 raised above 0; None
    when it has no such bound."""
    raised, n = _ZERO_BOUND.subn(lambda m: f"{m.group('head')}1e-6", code, count=1)
    return raised if n else None


def _note_for(ctx: RuleContext, ev: OpEvent) -> Note | None:
    notes = [n for n in ctx.notes("zero_param") if not ev.node or n.data.get("node") == ev.node]
    # the parameter whose zeros are all of it first: one that is 0 zeroes all it multiplies
    notes.sort(key=lambda n: n.data.get("zeros") != n.data.get("numel"))
    return notes[0] if notes else None


def zero_param_story(ctx: RuleContext, ev: OpEvent, x: TensorStat | None) -> ZeroParamStory | None:
    """The story of a log (``ev``, forward) whose input ``x`` holds exact zeros that a
    watched parameter at exactly 0 put there (a ``"zero_param"`` note of the step): it names
    the parameter, how many of its values are 0, what wrote it there (a statement that
    writes it in place, a user-defined optimizer ``step``, a write after the update), and
    a fix that keeps it off 0. None when no note says so."""
    if x is None or not has_zero(x):
        return None
    n = _note_for(ctx, ev)
    if n is None:
        return None
    d = n.data
    q, zeros, numel = str(d.get("parameter")), int(d.get("zeros", 0)), int(d.get("numel", 0))
    if not zeros:
        return None
    held = (
        f"exactly 0 ({'its one value' if numel == 1 else f'all {numel:,} values'})"
        if zeros == numel
        else f"exactly 0 at {zeros:,} of {count(numel, 'value')}"
    )
    via = " -> ".join(str(v) for v in d.get("via", ())) or "a view"
    evidence = (
        f"the log's input is 0 where the parameter {q} is: {q} was {held} when the forward "
        f"read it, and reaches the log through {via} (a product is 0 where a factor is)"
    )
    code, source, own = d.get("write_code"), d.get("write_source"), d.get("own_step")
    opt = d.get("optimizer")
    after = f" after {opt}'s update" if opt else ""
    if own and code:
        evidence += (
            f"; {own}, your optimizer's own step(), writes the weights in place after the "
            f"update: {code} ({source})"
        )
    elif code and d.get("write_in_file"):
        evidence += (
            f"; written in place between steps{after}, by the statement of the training "
            f"script that writes it: {code} ({source})"
        )
    elif code:
        evidence += f"; written in place between steps{after} by {code} ({source})"
    elif own:
        evidence += f"; {own} is your optimizer's own step(): it wrote {q} after the update"
    elif d.get("written_after"):
        evidence += (
            f"; written in place{after} (its version moved on since): a projection or a "
            "clamp_ under torch.no_grad()"
        )
    else:
        evidence += (
            "; an update w - lr × grad lands on exactly 0 only by chance: a write between "
            f"steps ({q}.data.clamp_(min=0), a projection) set it"
        )
    leaf = q.rsplit(".", 1)[-1]
    raised = _floor_fix(str(code)) if code else None
    floor = raised if raised is not None else f"{leaf}.data.clamp_(min=1e-6)"
    fix = (
        f"# train {leaf} unconstrained and use F.softplus(self.{leaf}) where the forward uses "
        f"self.{leaf}, with no projection: positive whatever the update, never 0 (start it at "
        f"torch.log(torch.expm1(g0)) for a start value g0)\n"
        f"{floor}   # only if the projection must stay"
        + (f" ({source})" if code else "")
        + f": a floor above 0 keeps the log finite, but its gradient 1/{leaf} is 1e6 there, "
        "and one step can throw it far"
    )
    why = (
        f"Its input is 0 because the parameter {q} is. A write that sets a parameter to "
        f"exactly 0 (a projection onto {leaf} >= 0, clamp_(min=0), whenever an update would "
        "take it below; a pruning mask) makes everything it multiplies exactly 0, and the "
        "log of that is -inf. This is not a probability that underflowed, and a floor under "
        f"the log's input would only hide it: {leaf} would stay at 0. Keep it off 0: train an "
        "unconstrained parameter mapped through softplus."
    )
    return ZeroParamStory(
        title=f"Log of 0: the parameter {q} is exactly 0",
        evidence=evidence,
        why=why,
        fix=fix,
    )
