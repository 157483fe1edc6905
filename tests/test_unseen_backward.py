"""Backward code the module hooks do not see: a custom ``autograd.Function``'s own
``backward()``, a parent module's code before its children, and a gradient of a gradient
(``autograd.grad(..., create_graph=True)``) that reaches a weight past every hooked output.
Each is named by what was traced, never by an op made up from a node's name."""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import nanwatch
from nanwatch import localize as loc
from nanwatch import ops
from nanwatch.records import (
    LOSS_PATH,
    AnomalyKind,
    OpEvent,
    Phase,
    Record,
    StepTrace,
    TensorStat,
)
from nanwatch.report import anomaly_headline

HERE = os.path.basename(__file__)


def _line(fn: Callable[..., Any], marker: str) -> str:
    """``test_unseen_backward.py:N`` of the line of ``fn`` that holds ``marker``."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, text in enumerate(lines) if marker in text)
    return f"{HERE}:{start + offset}"


class HalfSqrt(torch.autograd.Function):
    """sqrt with a hand-written backward that divides by 2·sqrt(x): inf at x == 0."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = x.clamp_min(0).sqrt()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return g / (2 * y)  # the division


def _pairwise_step(model: nn.Module, x: torch.Tensor) -> None:
    e = model(x)
    d = HalfSqrt.apply(((e[:, None] - e[None]) ** 2).sum(-1))  # the apply
    loss = torch.relu(1 - d).mean()
    loss.backward()  # the backward call


def _embedder() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), torch.randn(6, 4)


# ---------------------------------------------------------------- A: custom Function, watch


def test_a_custom_function_node_is_never_given_a_made_up_aten_op() -> None:
    assert ops.node_op("PowBackward0") == "aten.pow"
    assert ops.node_op("MySqrtBackward") == "MySqrt.backward"
    x = torch.ones(3, requires_grad=True)
    out = HalfSqrt.apply(x)  # held: torch 2.11 frees a custom node whose output is gone
    node = out.grad_fn
    assert ops.custom_function(node) == "HalfSqrt"
    assert ops.custom_function(torch.sqrt(x).grad_fn) is None
    ev = ops.node_event(node, torch.tensor([1.0, -float("inf")]), name=ops.name_of(node))
    assert ev.op == "HalfSqrt.backward" and ev.born == "-inf" and ev.inputs == []
    assert loc.custom_function("HalfSqrtBackward") == "HalfSqrt"
    assert loc.custom_function("SqrtBackward0") is None


def test_watch_mode_says_whose_backward_made_it_and_claims_no_overflow() -> None:
    model, x = _embedder()
    with nanwatch.watch(model, on_anomaly="record") as nw:
        _pairwise_step(model, x)
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.BACKWARD
    assert a.op is None  # nothing was traced inside the user's backward
    assert "the backward of custom autograd.Function HalfSqrt made -inf" in a.summary
    call = _line(_pairwise_step, "# the backward call")
    assert re.search(rf"\(backward\(\) at \S*{re.escape(call)}\)", a.summary)
    assert "mode='forensic' or nw.replay(step_fn)" in a.summary
    assert "aten.half_sqrt" not in a.summary
    codes = [d.code for d in nw.history[-1].diagnoses]
    assert "NW101" not in codes and codes[0] == "NW100"
    text = "\n".join(str(e) for d in nw.history[-1].diagnoses for e in d.evidence)
    assert "aten.half_sqrt" not in text and "|x| = NaN" not in text


# ---------------------------------------------------------------- B: lines in backward


def test_forensic_names_the_line_inside_a_custom_backward_and_the_real_backward_call() -> None:
    model, x = _embedder()
    with nanwatch.watch(model, mode="forensic", on_anomaly="record") as nw:
        _pairwise_step(model, x)
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.op is not None
    op = a.op
    assert op.op == "aten.div.Tensor" and op.node == "HalfSqrtBackward"
    assert op.source is not None and op.source.endswith(_line(HalfSqrt.backward, "# the division"))
    assert op.code is not None and "g / (2 * y)" in op.code
    assert op.backward_at is not None
    assert op.backward_at.endswith(_line(_pairwise_step, "# the backward call"))
    where = (
        f"at {op.source} in the backward of custom autograd.Function HalfSqrt, "
        f"backward() at {op.backward_at}"
    )
    assert where in a.summary and where in anomaly_headline(a)
    assert nw.history[-1].diagnoses[0].code == "NW111"


class Radial(nn.Module):
    """A parent whose own code (the sqrt) runs before its child."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, xy: torch.Tensor) -> torch.Tensor:
        r = torch.sqrt((xy**2).sum(-1, keepdim=True))  # the parent's sqrt
        return self.net(torch.cat([xy, r], -1))


def test_nodes_made_by_the_parents_own_code_belong_to_the_parent() -> None:
    torch.manual_seed(0)
    model = Radial()
    xy = torch.rand(8, 2)
    xy[3] = 0.0
    with nanwatch.watch(model, mode="forensic", on_anomaly="record") as nw:
        model(xy.requires_grad_(True)).sum().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.node == "SqrtBackward0"
    assert a.op.path == "Radial"  # not net.0, the child that first walked the graph
    assert a.op.source is not None
    assert a.op.source.endswith(_line(Radial.forward, "# the parent's sqrt"))
    d = nw.history[-1].diagnoses[0]
    assert d.code == "NW112" and d.path == "Radial"


def test_stamp_graph_gives_each_node_the_module_that_made_it() -> None:
    parent_first = torch.ones(2, requires_grad=True)
    paths = ["outer"]
    with ops.OpChecker(current_path=lambda: paths[-1]):
        a = parent_first * 2  # made by "outer"
        paths.append("outer.child")
        b = a.exp()  # made by "outer.child"
        ops.stamp_graph([b], "outer.child")
        paths.pop()
        c = b + 1
        ops.stamp_graph([c], "outer")
    assert b.grad_fn is not None and a.grad_fn is not None and c.grad_fn is not None
    assert b.grad_fn.metadata["nanwatch.path"] == "outer.child"
    assert a.grad_fn.metadata["nanwatch.path"] == "outer"
    assert c.grad_fn.metadata["nanwatch.path"] == "outer"


# ---------------------------------------------------------------- C: gradient of a gradient


def _critic() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
    with torch.no_grad():
        critic[0].weight.abs_()
        critic[0].bias.fill_(0.1)
    real = torch.randn(8, 2) * 0.5 + 1
    real[3] = -100.0  # every ReLU dead: the critic's input gradient is exactly 0
    fake = torch.randn(8, 2)
    return critic, real, fake


def _gp_step(critic: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> None:
    xh = (0.5 * real + 0.5 * fake).requires_grad_(True)
    (g,) = torch.autograd.grad(critic(xh).sum(), xh, create_graph=True)
    gp = ((torch.sqrt((g**2).sum(1)) - 1) ** 2).mean()  # the norm
    (critic(fake).mean() - critic(real).mean() + 10 * gp).backward()


def test_forensic_uses_the_traced_backward_op_of_a_gradient_penalty() -> None:
    critic, real, fake = _critic()
    with nanwatch.watch(critic, mode="forensic", on_anomaly="record") as nw:
        _gp_step(critic, real, fake)
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.BACKWARD  # not a bare NaN gradient
    assert a.parameter == "0.weight"
    assert a.op is not None and a.op.node == "SqrtBackward0" and a.op.op == "aten.div.Tensor"
    assert a.op.source is not None and a.op.source.endswith(_line(_gp_step, "# the norm"))
    codes = [d.code for d in nw.history[-1].diagnoses]
    assert codes[0] == "NW112" and "NW302" not in codes
    assert "reached the gradient of parameter 0.weight" in a.summary


def _grad_record() -> Record:
    stat = TensorStat(float("nan"), float("nan"), 32, nan=32, posinf=0, neginf=0)
    return Record(
        index=5,
        step=0,
        phase=Phase.GRADIENT,
        path="0",
        role="0.weight",
        dtype="float32",
        device="cpu",
        shape=(16, 2),
        stat=stat,
    )


def test_a_replays_backward_op_completes_a_gradient_anomaly() -> None:
    trace = StepTrace(step=0)
    trace.records.append(_grad_record())
    a = loc.localize(trace)
    assert a is not None and a.kind is AnomalyKind.GRADIENT and a.op is None
    div = OpEvent(
        "aten.div.Tensor",
        Phase.BACKWARD,
        None,
        "-inf",
        TensorStat(-float("inf"), 0.0, 8),
        node="SqrtBackward0",
        source="train.py:20",
        backward_at="train.py:31",
    )
    assert loc.adopt_backward_op(a, [div])
    assert "reached the gradient of parameter 0.weight" in a.summary
    assert a.kind is AnomalyKind.BACKWARD and a.op is div and a.path == LOSS_PATH
    assert "[op aten.div.Tensor in the backward of train.py:20, which made -inf]" in a.summary
    assert not loc.adopt_backward_op(a, [div])  # only a gradient anomaly is completed


def test_a_backward_view_passes_the_cause_of_a_non_finite_gradient_on() -> None:
    x = torch.tensor([[1.0, 2.0], [0.0, 0.0]], requires_grad=True)
    with ops.OpChecker() as chk:
        n = torch.sqrt((x**2).sum(1))  # sqrt'(0) = inf; sum's backward expands it (a view)
        ((n - 1) ** 2).mean().backward()
    births = [(e.node, e.born) for e in chk.events]
    assert births == [("SqrtBackward0", "-inf"), ("PowBackward0", "NaN")]
    assert chk.events[1].cause is chk.events[0]  # 0 × -inf, the -inf from the sqrt
