"""Ops that write their own arguments (``x /= n``, ``x.sqrt_()``, ``torch.div(a, b, out=o)``):
the values such an op read are the ones it overwrote, so they are measured before it runs.
Without that, every NaN an in-place op made looked inherited, the module's replay "ran
clean" and a division by zero was called a hardware fault."""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import nanwatch
from nanwatch.ops import OpChecker
from nanwatch.records import AnomalyKind, Phase

HERE = os.path.basename(__file__)
INF = math.inf


def _line(fn: Callable[..., Any], marker: str) -> str:
    """``test_unseen_inplace.py:N`` of the line of ``fn`` that holds ``marker``."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, text in enumerate(lines) if marker in text)
    return f"{HERE}:{start + offset}"


def _stats(ev: Any) -> dict[str, tuple[float, float, int | None]]:
    return {n: (s.min, s.max, s.zeros) for n, s in ev.inputs}


# ------------------------------------------------------------------ unit: what was read


def test_an_in_place_division_by_zero_is_born_there_with_the_values_it_read() -> None:
    x = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    n = x.norm(dim=-1, keepdim=True)
    with OpChecker() as chk:
        x /= n  # the in-place division
    (ev,) = chk.events
    assert ev.op == "aten.div_.Tensor" and ev.born == "NaN" and not ev.injected
    assert _stats(ev) == {"self": (0.0, 4.0, 2), "other": (0.0, 5.0, 1)}
    assert ev.output.nan == 2
    here = _line(test_an_in_place_division_by_zero_is_born_there_with_the_values_it_read, "# the")
    assert ev.source is not None and ev.source.endswith(here)


def test_in_place_domain_errors_are_births() -> None:
    with OpChecker() as chk:
        torch.tensor([-1.0, 4.0]).sqrt_()
        torch.tensor([0.0, 4.0]).log_()
    sqrt, log = chk.events
    assert (sqrt.op, sqrt.born, _stats(sqrt)) == ("aten.sqrt_.default", "NaN", {"self": (-1, 4, 0)})
    assert (log.op, log.born, _stats(log)) == ("aten.log_.default", "-inf", {"self": (0, 4, 1)})
    assert log.scalars == {"n_edge": 1}
    assert not sqrt.injected and not log.injected


def test_a_tensor_divided_by_itself_in_place_reads_its_old_values_on_both_sides() -> None:
    t = torch.tensor([0.0, 0.0, 3.0])
    u = t.clone()
    with OpChecker() as chk:
        t.div_(t)
        u.div_(u.detach())  # another tensor over the same memory
    for ev in chk.events:
        assert ev.born == "NaN" and _stats(ev) == {"self": (0, 3, 2), "other": (0, 3, 2)}
    assert len(chk.events) == 2


def test_an_out_argument_is_an_output_not_an_input() -> None:
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    with OpChecker() as chk:
        o = torch.empty(2)
        o.fill_(math.nan)  # whatever the buffer held is overwritten
        torch.div(a, b, out=o)
        torch.div(b, a + 1, out=o)  # a clean division into the NaN buffer
    fill, div = chk.events
    assert fill.op == "aten.fill_.Scalar" and fill.injected
    assert div.op == "aten.div.out" and div.born == "+inf" and not div.injected
    assert [n for n, _ in div.inputs] == ["self", "other"]


def test_a_multi_tensor_in_place_op_that_returns_nothing_is_checked_on_what_it_wrote() -> None:
    ps = [torch.tensor([0.0, 1.0]), torch.tensor([2.0])]
    with OpChecker() as chk:
        torch._foreach_div_(ps, [torch.tensor([0.0, 1.0]), torch.tensor([1.0])])
    (ev,) = chk.events
    assert ev.op == "aten._foreach_div_.List" and ev.born == "NaN"
    assert _stats(ev) == {
        "self[0]": (0, 1, 1),
        "self[1]": (2, 2, 0),
        "other[0]": (0, 1, 1),
        "other[1]": (1, 1, 0),
    }


# --------------------------------------------------- unit: non-finite values put in on purpose


def test_constants_written_in_place_are_injected_like_their_out_of_place_twins() -> None:
    x = torch.randn(2, 3)
    mask = torch.tensor([[True, False, True], [False, False, True]])
    with OpChecker() as chk:
        x.clone().masked_fill_(mask, -INF)
        x.clone().masked_fill(mask, -INF)
        x.clone().fill_(-INF)
        x.clone().index_fill_(1, torch.tensor([0]), -INF)
    assert [(e.op, e.born, e.injected) for e in chk.events] == [
        ("aten.masked_fill_.Scalar", "-inf", True),
        ("aten.masked_fill.Scalar", "-inf", True),
        ("aten.fill_.Scalar", "-inf", True),
        ("aten.index_fill_.int_Scalar", "-inf", True),
    ]
    assert chk.first() is chk.events[0]  # only injections: the first is all there is


def test_copies_carry_bad_values_and_only_a_narrowing_copy_makes_one() -> None:
    bad = torch.tensor([1.0, math.nan, 2.0])
    with OpChecker() as chk:
        torch.zeros(3).copy_(bad)  # the NaN came from the source
        bad.clone().copy_(torch.ones(3))  # the old NaN is overwritten, not read
        torch.zeros(3, dtype=torch.float16).copy_(torch.tensor([7e4, 1.0, 2.0]))
    (ev,) = chk.events
    assert ev.op == "aten.copy_.default" and ev.born == "+inf" and not ev.injected
    assert _stats(ev) == {"src": (1.0, 7e4, 0)}


# ------------------------------------------------------------------------------ unit: views


def test_a_masked_in_place_division_is_born_in_the_division() -> None:
    x = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    keep = torch.tensor([True, False])
    with OpChecker() as chk:
        x[keep] /= torch.tensor(0.0)
    (ev,) = chk.events  # the index_put_ that writes the NaN back only carries it
    assert ev.op == "aten.div_.Tensor" and ev.born == "NaN"
    assert _stats(ev) == {"self": (0, 0, 2), "other": (0, 0, 1)}
    assert torch.isnan(x[0]).all() and not torch.isnan(x[1]).any()


def test_a_view_written_in_place_makes_its_base_the_cause_of_what_follows() -> None:
    y = torch.tensor([[1.0, -1.0], [1.0, 2.0]])
    with OpChecker() as chk:
        y.select(0, 0).div_(torch.zeros(2))  # row 0: +inf, -inf
        z = y.sum(0) - y.sum(0)  # inf - inf: NaN
    div, sub = chk.events
    assert (div.op, div.born) == ("aten.div_.Tensor", "+inf, -inf")
    assert _stats(div) == {"self": (-1, 1, 0), "other": (0, 0, 2)}
    assert (sub.op, sub.born) == ("aten.sub.Tensor", "NaN")
    assert sub.cause is div
    assert torch.isnan(z).all()


# ------------------------------------------------------------------ watched training loops


class RowNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.norm(dim=-1, keepdim=True)
        x = x.clone()
        x /= n  # normalize in place
        return x


def test_watch_names_the_in_place_division_not_a_hardware_fault() -> None:
    torch.manual_seed(0)
    first = nn.Linear(4, 4)
    model = nn.Sequential(first, nn.ReLU(), RowNorm(), nn.Linear(4, 2))
    with torch.no_grad():
        first.bias.fill_(-100.0)  # every ReLU unit dead for this batch: zero rows
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(3, 4)).pow(2).mean().backward()
            opt.step()
            nw.step()
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.FORWARD and a.path == "2"
    assert not a.transient
    assert a.op is not None and a.op.op == "aten.div_.Tensor" and a.op.born == "NaN"
    assert a.op.source is not None
    assert a.op.source.endswith(_line(RowNorm.forward, "# normalize in place"))
    d = nw.history[0].diagnoses[0]
    assert (d.code, d.op) == ("NW111", "aten.div_.Tensor")
    assert "numerator: min 0, max 0 (12 exact zeros; 12 values)" in d.evidence


class Whiten(nn.Module):
    """Whitening by M^{-1/2} from eigh: at identity init every eigenvalue is 1, and eigh's
    backward divides by their differences (in place, inside torch)."""

    def __init__(self, d: int = 3) -> None:
        super().__init__()
        self.L = nn.Parameter(torch.eye(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        evals, evecs = torch.linalg.eigh(self.L @ self.L.T)  # the eigh
        w: torch.Tensor = evecs @ torch.diag(evals.rsqrt()) @ evecs.T
        return x @ w


def test_forensic_names_the_in_place_division_in_eighs_backward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), Whiten())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanwatch.watch(model, mode="forensic", on_anomaly="record", postmortem=False) as nw:
        opt.zero_grad()
        model(torch.randn(8, 5)).pow(2).sum().backward()
        opt.step()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.op is not None
    op = a.op
    assert (op.op, op.phase, op.node, op.born) == (
        "aten.div_.Tensor",
        Phase.BACKWARD,
        "LinalgEighBackward0",
        "NaN",
    )
    assert op.path == "1" and not op.injected
    assert op.source is not None and op.source.endswith(_line(Whiten.forward, "# the eigh"))
    d = nw.history[0].diagnoses[0]
    assert d.op == "aten.div_.Tensor" and d.code != "NW302"
