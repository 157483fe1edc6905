"""Hand-written numerical failures in a training step, diagnosed in watch and sentinel mode:
the place, the op and the cause, and a fix that works."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch

torch.set_num_threads(1)


def _rate_model() -> nn.Sequential:
    """A count regressor whose rate head is a ReLU, its pre-activation negative for every
    sample (a dead head: a bias driven down by an earlier update)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1), nn.ReLU())
    with torch.no_grad():
        net[2].weight.mul_(0.1)
        net[2].bias.fill_(-3.0)
    return net


class PoissonNLL(nn.Module):
    def forward(self, rate: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (rate - k * torch.log(rate)).mean()


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_poisson_nll_of_a_dead_relu_rate_names_the_relu(mode: str) -> None:
    net, criterion = _rate_model(), PoissonNLL()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, k = torch.randn(6, 4), torch.tensor([[0.0], [1.0], [3.0], [0.0], [2.0], [5.0]])
    with nanwatch.watch(net, criterion, mode=mode, on_anomaly="record") as nw:
        loss = criterion(net(x), k)
        loss.backward()
        opt.step()
        opt.zero_grad()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.path == "PoissonNLL"
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW110" and d.op == "aten.log", d.headline
    # the zeros are a ReLU's: the fix replaces it, not a floor on the log
    assert "ReLU" in " ".join(d.evidence), d.evidence
    assert "softplus" in d.fix.lower(), d.fix
    if mode == "watch":  # the ReLU module itself is seen
        assert "# 3 is an nn.ReLU: for a predicted positive quantity put nn.Softplus()" in d.fix
    assert "clamp_min" not in d.fix, d.fix
    net[3] = nn.Softplus()  # the fix: positive, never exactly 0
    with nanwatch.watch(net, criterion, mode=mode, on_anomaly="record") as nw:
        criterion(net(x), k).backward()
        nw.step()
    assert nw.first_anomaly is None


class TripletLoss(nn.Module):
    """A triplet margin loss written by hand: Euclidean distances as sqrt of a sum of
    squares, whose derivative is inf at 0 (an anchor identical to its positive)."""

    def forward(self, emb: torch.Tensor) -> torch.Tensor:
        a, p, n = emb[0::3], emb[1::3], emb[2::3]
        d_ap = (a - p).pow(2).sum(-1).sqrt()
        d_an = (a - n).pow(2).sum(-1).sqrt()
        return torch.relu(d_ap - d_an + 1.0).mean()


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_sqrt_of_a_zero_distance_in_a_loss_modules_backward_names_its_line(mode: str) -> None:
    torch.manual_seed(0)
    net, criterion = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), TripletLoss()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(6, 4)
    x[1] = x[0]  # the same sample drawn as anchor and positive
    with nanwatch.watch(net, criterion, mode=mode, on_anomaly="record") as nw:
        loss = criterion(net(x))
        loss.backward()
        opt.step()
        opt.zero_grad()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.path == "TripletLoss" and a.kind.value == "backward"
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW112" and d.op == "aten.sqrt", d.headline
    # the forward line that made the node, not the loss.backward() call
    assert d.source is not None and d.source.endswith(f":{_line_of('d_ap = (a - p)')}"), d.source
    assert a.op is not None and a.op.code == "d_ap = (a - p).pow(2).sum(-1).sqrt()", a.op.code
    assert "vector_norm" in d.fix or "pairwise_distance" in d.fix, d.fix


def _line_of(text: str) -> int:
    with open(__file__, encoding="utf-8") as f:
        return next(i for i, line in enumerate(f, 1) if text in line and "sqrt()" in line)


class Bf16Norm(nn.Module):
    """A normalization written by hand in bfloat16, its variance as E[x²] - E[x]²."""

    def __init__(self, d: int, *, two_pass: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.two_pass = two_pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        mean = x.mean(-1, keepdim=True)
        if self.two_pass:  # the fix nanwatch gives
            var = ((x - mean) ** 2).mean(-1, keepdim=True)
            y = (x - mean) / torch.sqrt(var + 1e-5)
        else:
            var = (x * x).mean(-1, keepdim=True) - mean * mean
            y = (x - mean) / torch.sqrt(var)
        return (y * self.weight).float()


def _norm_step(mode: str, *, two_pass: bool = False) -> nanwatch.Watcher:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), Bf16Norm(16, two_pass=two_pass), nn.Linear(16, 1))
    with torch.no_grad():  # activations far from 0 that vary little: an un-normalized input
        net[0].weight.mul_(0.01)
        net[0].bias.fill_(300.0)
        net[0].bias[::2] += 1.0
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    with nanwatch.watch(net, nn.MSELoss(), mode=mode, on_anomaly="record") as nw:
        loss = nn.functional.mse_loss(net(torch.randn(4, 8)), torch.randn(4, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        nw.step()
    return nw


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_bf16_variance_as_mean_square_minus_square_mean_is_a_cancellation(mode: str) -> None:
    nw = _norm_step(mode)
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.op == "aten.div.Tensor"
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW111", d.headline
    assert "E[x²] - E[x]²" in d.title, d.title
    # not "a feature that did not vary": the two-pass variance, and an eps inside the sqrt
    assert "var = ((x - mean) ** 2).mean(-1, keepdim=True)" in d.fix, d.fix
    assert "y = (x - mean) / torch.sqrt(var + 1e-5)" in d.fix, d.fix
    assert _norm_step(mode, two_pass=True).first_anomaly is None


class Fp16RMSNorm(nn.Module):
    """An RMSNorm written by hand in float16: the square of an input above
    sqrt(65504) = 255.9 is inf, the mean inf, and rsqrt(inf) = 0."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.half()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).float() * self.weight


def test_a_norm_whose_fp16_squares_overflow_is_named_as_the_zero_not_a_dead_unit() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), Fp16RMSNorm(16), nn.Linear(16, 1))
    with torch.no_grad():  # un-normalized features: activations in the hundreds
        net[0].bias.fill_(400.0)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with nanwatch.watch(net, on_anomaly="record") as nw:
        for _ in range(6):
            loss = nn.functional.mse_loss(net(torch.randn(4, 8)), torch.randn(4, 1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    assert nw.first_anomaly is None  # no NaN, ever: the norm's output is silently 0
    found = [d for t in nw.history for d in t.diagnoses if d.code == "NW304"]
    assert found, [d.headline for t in nw.history for d in t.diagnoses]
    d = found[0]
    # the module that makes the zero, not "find what stops the gradient"
    assert d.path == "1" and "exactly 0 whatever its input" in d.title, d.headline
    assert "in 1 (Fp16RMSNorm)'s forward" in d.fix, d.fix
    assert "x.float().pow(2).mean(-1, keepdim=True)" in d.fix, d.fix


class DiscreteSurvival(nn.Module):
    """A discrete-time survival model: hazards per time bin, the survival curve as the
    running product of 1 - hazard (or, as nanwatch advises, its log as a running sum)."""

    def __init__(self, bins: int, *, in_log_space: bool = False) -> None:
        super().__init__()
        self.hazard = nn.Linear(4, bins)
        self.in_log_space = in_log_space

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.hazard(x)
        if self.in_log_space:  # the fix: log S(t), finite for every t
            return torch.cumsum(nn.functional.logsigmoid(-z), dim=-1)
        return torch.cumprod(1 - torch.sigmoid(z), dim=-1)


class SurvivalNLL(nn.Module):
    def __init__(self, *, in_log_space: bool = False) -> None:
        super().__init__()
        self.in_log_space = in_log_space

    def forward(self, surv: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if self.in_log_space:
            return -surv.gather(1, t).mean()
        return -torch.log(surv.gather(1, t)).mean()


def _survival_step(mode: str, *, in_log_space: bool = False) -> nanwatch.Watcher:
    torch.manual_seed(0)
    net = DiscreteSurvival(300, in_log_space=in_log_space)
    criterion = SurvivalNLL(in_log_space=in_log_space)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, t = torch.randn(3, 4), torch.tensor([[10], [250], [299]])  # events late in follow-up
    with nanwatch.watch(net, criterion, mode=mode, on_anomaly="record") as nw:
        loss = criterion(net(x), t)
        loss.backward()
        opt.step()
        opt.zero_grad()
        nw.step()
    return nw


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_the_log_of_a_survival_curve_that_underflowed_is_taken_as_a_sum(mode: str) -> None:
    nw = _survival_step(mode)
    a = nw.first_anomaly
    assert a is not None and a.path == "SurvivalNLL"
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW110" and d.op == "aten.log", d.headline
    assert d.title == "Log of a product that underflowed to 0", d.title
    assert any("DiscreteSurvival's output is a cumprod" in e for e in d.evidence), d.evidence
    # the sum of logs, not a floor at tiny
    assert "log_s = torch.cumsum(F.logsigmoid(-z), dim=-1)" in d.fix, d.fix
    assert "clamp_min" not in d.fix, d.fix
    assert _survival_step(mode, in_log_space=True).first_anomaly is None


class SequenceLikelihood(nn.Module):
    """The likelihood of a label sequence as the product of its per-step probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(self.head(x), -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        return p.prod(-1)


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_the_log_of_a_sequence_likelihood_that_underflowed_is_taken_as_a_sum(mode: str) -> None:
    torch.manual_seed(0)
    net = SequenceLikelihood()
    x, y = torch.randn(2, 120, 4), torch.randint(0, 5, (2, 120))  # 120 steps of p ~ 0.2
    with nanwatch.watch(net, mode=mode, on_anomaly="record") as nw:
        loss = -torch.log(net(x, y)).mean()
        loss.backward()
        nw.step()
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW110" and d.title == "Log of a product that underflowed to 0", d.headline
    assert "log_s = torch.log(p).sum(-1)" in d.fix, d.fix
    assert "cumsum" not in d.fix, d.fix
