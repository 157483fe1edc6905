"""Op-level tracing: births of non-finite values, op-level data flow, faithful replays."""

from __future__ import annotations

import math

import torch
from torch import nn

import nanwatch
from nanwatch.ops import OpChecker, preserved_state, replay
from nanwatch.records import Phase


def test_log_of_zero_then_zero_times_minus_inf_is_traced_as_a_chain() -> None:
    p = torch.tensor([0.0, 0.5, 1.0])
    y = torch.tensor([0.0, 1.0, 1.0])
    with OpChecker() as chk:
        loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
    assert math.isnan(float(loss))
    first = chk.first()
    assert first is not None
    assert first.op == "aten.mul.Tensor" and first.born == "NaN"
    assert first.cause is not None and first.cause.op == "aten.log.default"
    assert first.cause.born == "-inf"
    assert [e.op for e in first.chain()] == ["aten.log.default", "aten.mul.Tensor"]
    log_input = first.cause.inputs[0][1]
    assert log_input is not None and log_input.zeros == 1
    assert first.source is not None and "test_ops.py:" in first.source
    assert first.code is not None and "torch.log" in first.code


def test_masked_fill_with_minus_inf_is_injected_not_born() -> None:
    scores = torch.randn(2, 3)
    mask = torch.tensor([[True, True, True], [False, True, False]])
    with OpChecker() as chk:
        torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    fill, soft = chk.events
    assert fill.op == "aten.masked_fill.Scalar" and fill.injected
    assert fill.scalars["value"] == -math.inf
    assert soft.op == "aten._softmax.default" and soft.born == "NaN" and not soft.injected
    assert soft.cause is fill
    assert chk.first() is soft


def test_a_narrowing_cast_that_overflows_is_a_birth() -> None:
    with OpChecker() as chk:
        torch.tensor([70000.0, 1.0]).half()
    ev = chk.first()
    assert ev is not None and ev.op.startswith("aten._to_copy") and ev.born == "+inf"
    assert ev.dtype == "float16"


def test_propagation_alone_is_not_an_event() -> None:
    x = torch.tensor([math.nan, 1.0])
    with OpChecker() as chk:
        (x * 2 + 1).relu()
    assert chk.events == []
    assert chk.checked >= 3


def test_backward_ops_are_seen_with_their_autograd_node() -> None:
    x = torch.zeros(3, requires_grad=True)
    y = torch.sqrt(x * 1).sum()
    with OpChecker() as chk:
        y.backward()
    ev = chk.first()
    assert ev is not None and ev.phase is Phase.BACKWARD and ev.node == "SqrtBackward0"
    assert ev.op == "aten.div.Tensor"


def test_replay_changes_nothing_batchnorm_statistics_and_rng_included() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(4)
            self.drop = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(self.drop(self.bn(x)))  # log of the zeros dropout makes

    net = Net().train()
    x = torch.randn(8, 4)
    mean_before = net.bn.running_mean.clone()
    batches_before = int(net.bn.num_batches_tracked)
    rng_before = torch.get_rng_state()
    result = replay(net, (x,), {}, path="Net")
    assert torch.equal(net.bn.running_mean, mean_before)
    assert int(net.bn.num_batches_tracked) == batches_before
    assert torch.equal(torch.get_rng_state(), rng_before)
    ev = result.first()
    assert ev is not None and ev.op == "aten.log.default" and ev.path == "Net"
    assert not result.clean


def test_replay_of_a_clean_module_is_clean_and_errors_are_reported() -> None:
    assert replay(nn.Linear(3, 3), (torch.randn(2, 3),), {}, path="fc").clean

    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("nope")

    result = replay(Boom(), (torch.randn(1),), {}, path="boom")
    assert result.error == "ValueError: nope" and not result.clean


def test_preserved_state_restores_even_when_the_body_raises() -> None:
    bn = nn.BatchNorm1d(2)
    before = bn.running_var.clone()
    try:
        with preserved_state(bn, set()):
            bn(torch.randn(4, 2) * 10)
            raise RuntimeError("inside")
    except RuntimeError:
        pass
    assert torch.equal(bn.running_var, before)


class _RandomDenominator(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.randint(0, 2, (1,)).float()  # 0 about every other call


def test_a_random_forward_is_replayed_with_new_draws_until_it_fails_again() -> None:
    x = torch.ones(3)
    rng = torch.get_rng_state()
    found = replay(_RandomDenominator(), (x,), {}, path="noisy", attempts=32)
    assert torch.equal(torch.get_rng_state(), rng)
    assert found.random and found.conclusive
    first = found.first()
    assert first is not None and first.op == "aten.div.Tensor" and first.born == "+inf"


def test_a_clean_replay_of_a_random_forward_is_not_evidence_of_a_transient_fault() -> None:
    clean = replay(nn.Dropout(0.5), (torch.ones(8),), {}, path="drop", attempts=3)
    assert clean.clean and clean.random and not clean.conclusive and clean.attempts == 3
    fixed = replay(nn.Linear(2, 2), (torch.ones(2),), {}, path="lin", attempts=3)
    assert fixed.clean and not fixed.random and fixed.conclusive and fixed.attempts == 1


def test_the_replay_does_not_repeat_the_users_warnings() -> None:
    """The module re-run that names the op ran the user's std() a second time, and torch
    said "degrees of freedom is <= 0" twice."""
    import warnings

    class MinibatchStd(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x.std(0, keepdim=True).mean().expand(x.shape[0], 1)], 1)

    model = nn.Sequential(nn.Linear(4, 4), MinibatchStd(), nn.Linear(5, 1))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
            model(torch.randn(1, 4))  # a batch of 1: std over one sample
            nw.step()
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.op.startswith("aten.std")
    assert sum("degrees of freedom" in str(w.message) for w in seen) == 1
