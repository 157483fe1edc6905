"""Op evidence found by user testing: a NaN a node only carried is traced back through the
graph to the op that made it from finite operands (a 0/0 of a zero row's norm before a
matmul), and a backward op's event quotes what the node saved in forward (the acos's
cosines that hit 1.0, the sqrt's result of exact zeros), not only its own operands."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch import ops

torch.set_num_threads(1)


# ------------------------------ 1: the carrier (mm) is walked back to the birth op (0/0)


def _normalized_net(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A hypernetwork's generated weight, normalized per row (one row is all zeros: 0/0),
    then used in two F.linear calls: the result's node, a matmul, only carried the NaN."""
    w = torch.randn(4, 3, requires_grad=True)
    shift = torch.tensor([[0.0], [0.0], [100.0], [0.0]])
    rows = torch.relu(w - shift)  # row 2 is all zeros
    w1 = rows / rows.norm(dim=1, keepdim=True)
    w2 = torch.randn(2, 4, requires_grad=True)
    return F.linear(torch.tanh(F.linear(x, w1)), w2), w


def test_a_nan_a_matmul_only_carried_is_named_by_the_division_that_made_it() -> None:
    torch.manual_seed(0)
    y, _ = _normalized_net(torch.randn(5, 3))
    assert type(y.grad_fn).__name__ == "MmBackward0" and y.isnan().any()
    birth = ops.birth_event(y.grad_fn)
    assert birth.carried  # mm's saved operands held the NaN already
    assert birth.event is not None
    assert birth.event.op == "aten.div" and birth.event.node == "DivBackward0"
    assert birth.event.born == "NaN"
    assert "denominator holds 1 zeros" in str(birth.event.scalars["evidence"])
    assert birth.event.scalars.get("other_made_by") == "LinalgVectorNormBackward0"


def test_a_nan_given_as_data_is_not_pinned_on_an_op() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 3)
    x[0, 0] = float("nan")
    w1, w2 = torch.randn(4, 3, requires_grad=True), torch.randn(2, 4, requires_grad=True)
    y = F.linear(torch.tanh(F.linear(x, w1)), w2)
    birth = ops.birth_event(y.grad_fn)
    assert birth.carried and birth.event is None  # the birth op is unknown: none made it


def test_a_node_with_finite_operands_is_left_as_named() -> None:
    a = torch.full((2, 2), 3e38, requires_grad=True)
    b = torch.full((2, 2), 3e38, requires_grad=True)
    y = a @ b  # the matmul itself overflowed
    assert not ops.birth_event(y.grad_fn).carried


def test_the_walk_ends_at_a_watched_output() -> None:
    torch.manual_seed(0)
    y, _ = _normalized_net(torch.randn(5, 3))
    # a stop at every division node: the 0/0 lies in a watched module, not found here
    birth = ops.birth_event(y.grad_fn, stop=lambda n: type(n).__name__ == "DivBackward0")
    assert birth.carried and birth.event is None


# ------------------------------ 2: a backward op's event quotes the node's saved forward values


def test_acos_backward_event_quotes_the_cosines_it_was_given() -> None:
    x = torch.tensor([0.5, 1.0, -0.2, 1.0], requires_grad=True)
    with ops.OpChecker() as c:
        torch.acos(x.clamp(-1, 1)).sum().backward()
    ev = next(e for e in c.events if e.node == "AcosBackward0" and e.op == "aten.rsqrt.default")
    # the op's own operand is 1 - x² (kept first: rules read inputs by position)
    assert ev.inputs[0][0] == "self" and ev.inputs[0][1].zeros == 2
    saved = dict(ev.other_inputs)
    assert saved["saved self"].max == 1.0 and abs(saved["saved self"].min + 0.2) < 1e-6
    assert ev.scalars["saved_at_edge"] == 2  # two cosines exactly on the edge of [-1, 1]


def test_sqrt_backward_event_quotes_the_result_of_exact_zeros() -> None:
    y = torch.tensor([0.0, 4.0, 0.0], requires_grad=True)
    with ops.OpChecker() as c:
        torch.sqrt(y).sum().backward()
    ev = next(e for e in c.events if e.node == "SqrtBackward0")
    assert [n for n, _ in ev.inputs] == ["self", "other"]
    res = dict(ev.other_inputs)["saved result"]
    assert res.zeros == 2 and res.max == 2.0


def test_forensic_anomaly_of_a_module_carries_the_saved_cosines() -> None:
    class Angle(nn.Module):
        def forward(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cos = (u * v).sum(-1) / (u.norm(dim=-1) * v.norm(dim=-1))
            return torch.acos(cos.clamp(-1, 1))

    m = Angle()
    u = torch.tensor([[1.0, 0.0], [0.6, 0.8]], requires_grad=True)

    try:
        with nanwatch.watch(m, mode="forensic"):
            m(u, u.detach().clone()).sum().backward()
    except nanwatch.AnomalyError as e:
        err = e
    else:
        raise AssertionError("no anomaly")
    op = err.anomaly.op
    assert op is not None
    chain = op.chain()
    acos = next(e for e in chain if e.node == "AcosBackward0")
    saved = dict(acos.other_inputs)["saved self"]
    assert saved.max == 1.0  # the cosines, not 1 - x² (whose max is below 1 here)
    assert acos.scalars["saved_at_edge"] >= 1
