"""NW303 on a run that converged: a gradient norm that returns toward the level the run
began at is no explosion (a fit that converged with LBFGS, then moves off the optimum with
Adam); a spike that recurs still fires each time; and the clip the fix suggests binds on
the spike it names (not a fixed max_norm=1.0 above a norm of 0.2)."""

from __future__ import annotations

import ast
import math
import re
import warnings

import torch
from torch import nn

import nanwatch
from nanwatch.records import StepTrace
from nanwatch.rules.testing import TraceBuilder, diagnose, stat

torch.set_num_threads(1)


def _trace(i: int, weight: float, bias: float) -> StepTrace:
    b = TraceBuilder(i)
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0))
    b.forward(net, stat(-1.0, 1.0))
    b.gradient("lin", "lin.weight", weight)
    b.gradient("lin", "lin.bias", bias)
    return b.build(grad_norm=math.hypot(weight, bias))


#: per-step (weight, bias) gradient norms of a Poisson GLM fitted with LBFGS (converged
#: from step 2 on), then the first Adam step off the optimum
_CONVERGED = [(0.389, 0.0128), (0.0114, 0.0039)] + [(0.00129, 0.000665)] * 5


def _codes(trace: StepTrace, hist: list[StepTrace]) -> list[str]:
    return [d.code for d in diagnose(trace, hist)]


def test_nw303_a_norm_back_below_the_runs_first_steps_is_no_explosion() -> None:
    hist = [_trace(i, w, b) for i, (w, b) in enumerate(_CONVERGED)]
    # total 0.19: 130x the converged median, but half of step 0's; the bias 0.026 is 39x
    # its median and twice its own first step
    assert "NW303" not in _codes(_trace(7, 0.190, 0.0258), hist)
    # the bias alone at twice its first step, the total flat: no jump past its own level
    assert "NW303" not in _codes(_trace(7, 0.00129, 0.0258), hist)
    # past anything the run had: an explosion
    d = [d for d in diagnose(_trace(7, 4.0, 0.0258), hist) if d.code == "NW303"]
    assert d and "total gradient norm 4" in "\n".join(d[0].evidence)


def test_nw303_a_recurring_spike_fires_again() -> None:
    """A spike already in the history is not the level a later spike is measured from."""
    norms = [1.0] * 8 + [40.0] + [1.0] * 6
    hist = [_trace(i, w, 0.1) for i, w in enumerate(norms)]
    assert "NW303" in _codes(_trace(len(norms), 35.0, 0.1), hist)


def _data(it: int, spike: bool) -> torch.Tensor:
    """Gradients of about 1e-3 that jump 20x at step 9 (its input scaled by 100)."""
    return torch.randn(64, 4) * (100.0 if spike and it == 9 else 1.0)


def _run(*, spike: bool) -> nanwatch.Watcher:  # type: ignore[name-defined]
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(m, postmortem=False) as nw:
            for it in range(11):
                loss = 1e-3 * m(_data(it, spike)).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()
    return nw


def _run_clipped(max_norm: float) -> nanwatch.Watcher:  # type: ignore[name-defined]
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(m, postmortem=False) as nw:
            for it in range(11):
                loss = 1e-3 * m(_data(it, True)).mean()
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=max_norm)
                opt.step()
                nw.step()
    return nw


def test_nw303_fix_clips_at_a_max_norm_that_binds() -> None:
    nw = _run(spike=True)
    (d,) = [d for d in nw.report.diagnoses if d.code == "NW303"]
    fix = d.fix or ""
    ast.parse(fix)
    assert "torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=" in fix
    max_norm = float(re.search(r"max_norm=([^)]+)\)", fix).group(1))  # type: ignore[union-attr]
    total = float(re.search(r"total gradient norm (\S+)", d.evidence[0]).group(1))  # type: ignore[union-attr]
    level = float(re.search(r"median of the previous \d+ steps (\S+)", d.evidence[0]).group(1))  # type: ignore[union-attr]
    assert level <= max_norm < total < 1.0  # a clip at 1.0 would leave this spike alone
    assert max_norm == 0.002
    # the fix, as written in the loop, ends the warning; the run without a spike is silent
    assert not [d for d in _run_clipped(max_norm).report.diagnoses if d.code == "NW303"]
    assert not [d for d in _run(spike=False).report.diagnoses if d.code == "NW303"]
