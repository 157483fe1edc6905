"""Sentinel hooks the roots alone, so a NaN gradient born in a child's backward reaches a
parameter's gradient with no watched output gradient between them. The replay of a
parameter's module and of the modules that hold it checks the backward of the children
that ran between them too, and names the op and the innermost child, as watch does; a
gradient penalty's ``sqrt`` at 0 in the loss code is named when it is the one node on the
way to the parameter whose backward can make it. And an op born in a recurrent module
sentinel does not hook gets the recurrent module's advice, as watch gives it."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.records import Anomaly

torch.set_num_threads(1)


class _Abs(nn.Module):
    """``|x|`` written as ``sqrt(x * x)``: finite forward, NaN gradient where x is 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x * x)


class _SafeLog(nn.Module):
    """``where(x > 0, log(x), 0)``: the branch it drops still runs backward, 0 / 0 at 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, torch.log(x), 0.0)


class _Net(nn.Module):
    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.block = nn.Sequential(nn.Identity(), child)
        self.fc2 = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.block(self.fc1(x)))


def _run(child: nn.Module, mode: str) -> nanwatch.Watcher:
    """One step whose first layer gives exact zeros in one unit (weights and bias 0)."""
    torch.manual_seed(0)
    m = _Net(child)
    with torch.no_grad():
        m.fc1.weight[0].zero_()
        m.fc1.bias[0] = 0.0
    x = torch.randn(8, 4)
    with nanwatch.watch(m, mode=mode, on_anomaly="record", postmortem=False) as nw:
        m(x).pow(2).mean().backward()
        nw.step()
    return nw


@pytest.mark.parametrize(
    ("child", "op", "code"),
    [(_Abs, "aten.sqrt", "NW112"), (_SafeLog, "aten.log", "NW110")],
)
def test_sentinel_names_the_op_and_the_child_whose_backward_made_the_nan(
    child: type[nn.Module], op: str, code: str
) -> None:
    watched = _run(child(), "watch")
    nw = _run(child(), "sentinel")
    for w in (watched, nw):
        a = w.first_anomaly
        assert a is not None and a.op is not None
        assert (a.path, a.op.op, a.op.phase.value) == ("block.1", op, "backward")
        assert a.op.source is not None and a.op.source.endswith(
            f"test_unseen_hunt32c.py:{child.forward.__code__.co_firstlineno + 1}"
        )
    assert [d.code for d in nw.history[0].diagnoses][:1] == [code]
    assert nw.history[0].diagnoses[0].where.startswith("block.1, ")
    # "it reached the gradient of parameter fc1.weight": the parameter it was seen in
    assert "fc1.weight" in nw.first_anomaly.summary


class _Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        with torch.no_grad():
            self.net[0].bias.fill_(-1.0)  # a zero input: every unit dead, zero gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _wgan_gp(mode: str) -> nanwatch.Watcher:
    torch.manual_seed(0)
    d = _Critic()
    opt = torch.optim.SGD(d.parameters(), lr=1e-3)
    real, fake = 3 * torch.randn(8, 4), 3 * torch.randn(8, 4)
    real[0] = fake[0] = 0.0
    with nanwatch.watch(d, mode=mode, on_anomaly="record", postmortem=False) as nw:
        eps = torch.rand(8, 1)
        interp = (eps * real + (1 - eps) * fake).requires_grad_(True)
        (g,) = torch.autograd.grad(d(interp).sum(), interp, create_graph=True)
        gp = ((g.pow(2).sum(1).sqrt() - 1) ** 2).mean()
        loss = d(fake).mean() - d(real).mean() + 10 * gp
        loss.backward()
        opt.step()
        opt.zero_grad()
        nw.step()
    return nw


def _two_candidates() -> nanwatch.Watcher:
    """Two nodes on the way to the parameter can each make a NaN from a finite gradient
    (a sqrt and a division): their values, kept as backward began, tell the sqrt at 0
    (the divisor is at least 1)."""
    torch.manual_seed(0)
    d = _Critic()
    real = 3 * torch.randn(8, 4)
    real[0] = 0.0
    with nanwatch.watch(d, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
        x = real.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(d(x).sum(), x, create_graph=True)
        n = g.pow(2).sum(1).sqrt()
        (n / (n.detach() + 1.0)).mean().backward()
        nw.step()
    return nw


class _HiddenExp(nn.Module):
    """``where(x < 50, exp(x), x)``: exp(100) = inf is dropped in forward, and its
    backward gives 0 x inf = NaN, in the model, not in the loss code."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x < 50, torch.exp(x), x)


def _made_in_the_model() -> nanwatch.Watcher:
    """The model, called twice (its replay cannot tell which call), makes the NaN; the
    loss code's one sqrt, away from 0, sends its gradient through the model's output,
    whose gradient was measured finite."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), _HiddenExp(), nn.Linear(4, 1))
    with torch.no_grad():
        m[0].bias[0] = 100.0
    with nanwatch.watch(m, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
        x = torch.randn(8, 4)
        (m(x) + m(x)).pow(2).sqrt().mean().backward()
        nw.step()
    return nw


def test_sentinel_names_a_gradient_penaltys_sqrt_at_zero() -> None:
    for mode in ("watch", "sentinel"):
        nw = _wgan_gp(mode)
        a = nw.first_anomaly
        assert a is not None and a.op is not None, mode
        assert (a.path, a.op.op, a.op.node) == ("(loss)", "aten.sqrt", "SqrtBackward0"), mode
        assert a.op.code is not None and "sqrt()" in a.op.code, mode
        assert [d.code for d in nw.history[0].diagnoses][:1] == ["NW112"], mode
        fix = nw.history[0].diagnoses[0].fix
        assert "+ 1e-12).sqrt()" in fix, mode
    # of two nodes on the way, the one whose saved values sit where its derivative is
    # infinite, as watch names it
    a = _two_candidates().first_anomaly
    assert a is not None and a.op is not None and a.op.node == "SqrtBackward0"
    # not when the way from the loss code's node to the parameter passes a watched output
    # whose gradient was finite
    nw = _made_in_the_model()
    a = nw.first_anomaly
    assert a is not None and a.op is None
    assert [d.code for d in nw.history[0].diagnoses][:1] == ["NW302"]


class _RNNModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.RNN(8, 32, nonlinearity="relu", batch_first=True)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def _rnn(mode: str) -> nanwatch.Watcher:
    """A relu RNN whose recurrent weight has gain 3: the hidden state triples each step
    of the sequence and overflows float32 before its end."""
    torch.manual_seed(0)
    m = _RNNModel()
    with torch.no_grad():
        nn.init.orthogonal_(m.rnn.weight_hh_l0, gain=3.0)
        m.rnn.bias_hh_l0.fill_(1.0)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x, y = torch.rand(4, 200, 8), torch.zeros(4, 1)
    with nanwatch.watch(m, mode=mode, on_anomaly="record", postmortem=False) as nw:
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
        nw.step()
    return nw


def test_sentinel_gives_an_exploding_rnn_the_recurrent_advice() -> None:
    fixes = {}
    for mode in ("watch", "sentinel"):
        nw = _rnn(mode)
        first = nw.history[0].diagnoses[0]
        assert (first.code, nw.first_anomaly.path) == ("NW101", "rnn"), mode
        fixes[mode] = first.fix
        assert "nn.init.orthogonal_(w)" in first.fix, mode
        assert "nn.LSTM / nn.GRU" in first.fix, mode
        assert "nonlinearity='tanh'" in first.fix, mode
        assert "nn.LayerNorm" not in first.fix, mode
    assert fixes["sentinel"] == fixes["watch"]
    # the module found inside the root is kept in the report, for a re-render
    a = nw.first_anomaly
    assert a.module_type == "RNN"
    back = Anomaly.from_dict(json.loads(json.dumps(a.to_dict())))
    assert back.module_type == "RNN"
