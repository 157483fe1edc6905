"""The replay of a module's own backward (:func:`nanwatch.ops.own_backward_event`) runs
its nodes from a gradient it chooses, ones where the step's own is not known: a node
whose result depends on that gradient (a sqrt's backward at 0 makes +inf from a positive
gradient, -inf from a negative one, NaN from zero) is not said to have made the kind the
replay's gradient gave it. Given the step's own gradients (or statistics that say their
signs), or a parameter gradient the step wrote that one of ones, zeros or minus ones
reproduces, or the kinds the step's bad gradient held (no NaN: the node made inf), the
kind is what the step made; a kind that does not depend on the gradient (0 × -inf where
a ``torch.where`` hid ``log(0)``) is told as before."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch import ops
from nanwatch.records import TensorStat
from nanwatch.report import anomaly_headline

torch.set_num_threads(1)


class _Scale(nn.Module):
    """A learned scale at exactly 0 behind a sqrt: d sqrt(w)/dw is infinite there."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * torch.sqrt(self.w)


class _HiddenLog(nn.Module):
    """log(x) hidden where x <= 0 by a where: its backward makes 0 × -inf = NaN at 0
    whatever gradient arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.tensor([0.0, 1.0, 2.0]))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * torch.where(self.x > 0, torch.log(self.x), torch.zeros_like(self.x))


def test_a_kind_that_depends_on_the_gradient_is_not_claimed_by_a_replay_from_ones() -> None:
    """Before, the sqrt's backward replayed from ones was said to make +inf; the step's
    own gradient there was 0 (``u ** 2`` at ``u == 0``) and it made NaN."""
    h = torch.rand(4, 1) + 0.5  # positive: from ones, the sqrt's gradient is +inf
    ev = ops.own_backward_event(_Scale(), (h,), {}, path="scale")
    assert ev is not None and ev.node == "SqrtBackward0"
    assert ev.born == "non-finite"  # was "+inf"
    assert ev.born == ops.UNKNOWN_KIND
    assert ev.output.placeholder  # the replay's values are not the step's: not counted

    # made the same whatever the gradient: told as the replay made it
    ev = ops.own_backward_event(_HiddenLog(), (torch.rand(3) + 0.5,), {}, path="hidden")
    assert ev is not None and ev.node == "LogBackward0"
    assert ev.born == "NaN"
    assert ev.output.nan == 1


@pytest.mark.parametrize(
    ("real", "born"),
    [
        (torch.zeros(4, 1), "NaN"),  # 0 / (2·sqrt(0))
        (TensorStat(0.0, 0.0, 4), "NaN"),  # its statistics: every value 0
        (TensorStat(-0.25, -0.25, 4), "-inf"),  # a mean's constant gradient, negated
        (TensorStat(-2.0, -0.5, 4), "-inf"),  # values that vary, all below 0
    ],
)
def test_the_steps_own_gradient_at_the_outputs_gives_the_kind_the_step_made(
    real: torch.Tensor | TensorStat, born: str
) -> None:
    h = torch.rand(4, 1) + 0.5
    ev = ops.own_backward_event(_Scale(), (h,), {}, path="scale", grads={"output": real})
    assert ev is not None and ev.node == "SqrtBackward0"
    assert ev.born == born
    assert not ev.output.placeholder


def test_gradient_statistics_of_both_signs_leave_the_kind_unclaimed() -> None:
    h = torch.rand(4, 1) + 0.5
    real = TensorStat(-1.0, 1.0, 4)  # the sign of each value, and any zero, are not known
    ev = ops.own_backward_event(_Scale(), (h,), {}, path="scale", grads={"output": real})
    assert ev is not None and ev.born == ops.UNKNOWN_KIND


def test_the_kinds_the_steps_bad_gradient_held_say_inf_when_they_hold_no_nan() -> None:
    h = torch.rand(4, 1) + 0.5
    scale = _Scale()
    ev = ops.own_backward_event(scale, (h,), {}, path="scale", held=frozenset({"+inf"}))
    assert ev is not None and ev.born == "+inf"
    ev = ops.own_backward_event(scale, (h,), {}, path="scale", held=frozenset({"NaN"}))
    assert ev is not None and ev.born == ops.UNKNOWN_KIND  # NaN: made here, or of an inf


def test_a_parameter_gradient_the_step_wrote_says_which_gradient_reached_the_node() -> None:
    """The step's ``.grad`` of the parameter is NaN: a gradient of zeros at the output
    makes it, ones make +inf. The run that gives what the step wrote is the one told."""
    h = torch.rand(4, 1) + 0.5
    scale = _Scale()
    scale.w.grad = torch.full((1,), float("nan"))
    ev = ops.own_backward_event(scale, (h,), {}, path="scale", ends=[scale.w])
    assert ev is not None and ev.node == "SqrtBackward0"
    assert ev.born == "NaN" and ev.output.nan == 1
    scale.w.grad = torch.full((1,), -float("inf"))  # minus ones at the output
    ev = ops.own_backward_event(scale, (h,), {}, path="scale", ends=[scale.w])
    assert ev is not None and ev.born == "-inf"
    assert torch.isneginf(scale.w.grad).all()  # no .grad written by the replay


class _PINN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
        self.scale = _Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_(True)
        u = self.scale(self.net(x))
        (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        return (du**2).mean() + u.pow(2).mean() + 1.0


def test_sentinel_does_not_say_the_sqrt_made_inf_where_the_step_made_nan() -> None:
    """The gradient of ``scale.w`` was NaN (0 × inf: the gradient at the sqrt was 0), and
    the report said the sqrt's backward made +inf (then NaN). The parameter's gradient,
    read before the update, says a gradient of zeros reached the sqrt."""
    torch.manual_seed(0)
    model = _PINN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.rand(8, 1)
    with nanwatch.watch(model, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
        loss = model(x.clone()) + model(x.clone() + 1.0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        nw.step()
    first = nw.report.diagnoses[0]
    assert first.code == "NW112"
    assert first.evidence[0].startswith(
        "in backward, SqrtBackward0 (aten.sqrt) made NaN: the forward sqrt was given exact zeros"
    )
    a = nw.first_anomaly
    assert a is not None
    assert anomaly_headline(a).startswith("NaN gradient born in the backward of scale by ")
    assert "inf" not in anomaly_headline(a)
