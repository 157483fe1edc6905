"""Probabilistic, reinforcement-learning and custom-autograd training steps written as
users write them, diagnosed in watch and sentinel mode: a policy's log of the taken action's
probability picked from a softmax; an embedding divided by its own norm where a ReLU made it
all zeros; a normalizing flow's log|det J| at a non-invertible point; SAC's log(1 - tanh²)
in loss code; a softplus scale that rounded to 0 under validate_args; a scale made by a
functional relu of a watched head; a custom Function whose backward returns the wrong
shape."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

torch.set_num_threads(1)


# ----------------------- 1: REINFORCE with log(p.gather(...)) of a saturated softmax policy


def _policy() -> nn.Sequential:
    """A discrete policy that ends in nn.Softmax, its logits saturated (one action's bias far
    above the others: a policy that collapsed onto it), so the other actions' probabilities
    underflow to exactly 0."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 5), nn.Softmax(-1))
    with torch.no_grad():
        net[2].weight.mul_(50.0)
        net[2].bias.copy_(torch.tensor([0.0, 200.0, 0.0, 0.0, 0.0]))
    return net


def _reinforce(net: nn.Module, mode: str, *, from_logits: bool = False) -> nanwatch.Watcher:
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    obs, adv = torch.randn(8, 4), torch.randn(8)
    act = torch.tensor([0, 1, 2, 3, 4, 0, 2, 3])  # actions a replay buffer holds
    with nanwatch.watch(net, mode=mode, on_anomaly="record") as nw:
        if from_logits:  # the fix: the log from the logits, then the same pick
            logp = F.log_softmax(net[:3](obs), dim=-1).gather(1, act[:, None]).squeeze(1)
        else:
            p = net(obs)
            logp = torch.log(p.gather(1, act[:, None]).squeeze(1))
        loss = -(logp * adv).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        nw.step()
    return nw


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_log_of_the_taken_actions_probability_is_picked_from_the_softmax(mode: str) -> None:
    nw = _reinforce(_policy(), mode)
    a = nw.first_anomaly
    assert a is not None and a.path == "(loss)" and a.op is not None and a.op.op == "aten.log"
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW110" and d.op == "aten.log", d.headline
    # the gather and squeeze hand on the softmax's values: not "what made it is not seen"
    assert (
        "the log's argument is picked from a softmax output (log <- squeeze <- gather <- "
        "softmax): a probability that underflowed to 0"
    ) in d.evidence, d.evidence
    assert "not seen" not in d.explanation, d.explanation
    assert d.fix.startswith("logp = F.log_softmax(logits, dim=-1)"), d.fix
    assert "logp.gather(-1, idx) in place of torch.log(p.gather(-1, idx))" in d.fix, d.fix
    assert "mixture" not in d.fix, d.fix
    assert _reinforce(_policy(), mode, from_logits=True).first_anomaly is None


# ----------------------- 2: a contrastive loss that normalizes a ReLU embedding by its norm


class CosineHead(nn.Module):
    """A projection head that ends in a ReLU, its bias driven far below 0 (by a large
    update), so most samples' embeddings are all zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.proj(x))


def _cosine_step(mode: str, *, fixed: bool = False) -> nanwatch.Watcher:
    torch.manual_seed(0)
    head = CosineHead()
    with torch.no_grad():
        head.proj.bias.fill_(-0.8)
    opt = torch.optim.SGD(head.parameters(), lr=0.01)
    x, target = torch.randn(6, 8), torch.randn(6, 16)
    with nanwatch.watch(head, mode=mode, on_anomaly="record") as nw:
        z = head(x)
        zn = F.normalize(z, dim=-1) if fixed else z / z.norm(dim=-1, keepdim=True)
        tn = target / target.norm(dim=-1, keepdim=True)
        loss = (1 - (zn * tn).sum(-1)).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        nw.step()
    return nw


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_relu_embedding_divided_by_its_own_norm_is_a_zero_vector_not_a_distance(
    mode: str,
) -> None:
    nw = _cosine_step(mode)
    a = nw.first_anomaly
    assert a is not None and a.path == "(loss)" and a.op is not None and a.op.op == "aten.div"
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW111", d.headline
    # the graph shows the divisor is the norm of the numerator: no pairs, no self-pair i == j
    assert d.title == "Division by zero (0/0) normalizing a zero vector", d.title
    assert "self-pair" not in d.explanation and "i != j" not in d.fix, d.fix
    maker = "act (ReLU)" if mode == "watch" else "the model (CosineHead)"
    assert (
        "the autograd graph shows the divisor is the norm of the numerator itself, the output "
        f"of {maker}: a normalization x / x.norm(dim=-1, keepdim=True), and 3 of 6 norms "
        "are 0 (an all-zero vector)"
    ) in d.evidence, d.evidence
    assert d.fix.startswith("x = F.normalize(x, dim=-1)"), d.fix
    assert "all zeros for a sample whose every unit is off" in d.explanation, d.explanation
    assert _cosine_step(mode, fixed=True).first_anomaly is None


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_a_whole_batch_of_zero_vectors_normalized_is_not_a_tensor_never_filled(
    mode: str,
) -> None:
    """Every sample's embedding 0: the division's denominator is 0 everywhere, which alone
    reads like a buffer never filled; the graph (watch) or the line (forensic) says it is a
    norm of the numerator."""
    torch.manual_seed(0)
    head = CosineHead()
    with torch.no_grad():
        head.proj.bias.fill_(-10.0)
    x, target = torch.randn(6, 8), torch.randn(6, 16)
    with nanwatch.watch(head, mode=mode, on_anomaly="record") as nw:
        z = head(x)
        zn = z / z.norm(dim=1)[:, None]
        loss = (1 - (zn * F.normalize(target, dim=-1)).sum(-1)).mean()
        loss.backward()
        nw.step()
    d = nw.history[0].diagnoses[0]
    assert d.title == "Division by zero (0/0) normalizing a zero vector", d.title
    assert "never filled" not in d.explanation and "torch.zeros" not in d.fix, d.fix
    fixed = (
        "zn = z / z.norm(dim=1)[:, None].clamp_min("  # the line, floored: finite, 0 at a zero
        if mode == "forensic"
        else "x = F.normalize(x, dim=1)"
    )
    assert d.fix.startswith(fixed), d.fix


# ----------------------- 3: a planar flow's log|det J| where the map is not invertible


class PlanarFlow(nn.Module):
    """f(z) = z + u tanh(w·z + b), log|det J| = log|1 + u·ψ(z)| (Rezende & Mohamed), with u
    unconstrained: w·u = -1 makes the Jacobian singular at w·z + b = 0."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.u = nn.Parameter(torch.randn(d) * 0.1)
        self.w = nn.Parameter(torch.randn(d))
        self.b = nn.Parameter(torch.zeros(1))
        self.eps = 0.0

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lin = z @ self.w + self.b
        f = z + self.u * torch.tanh(lin)[:, None]
        psi = (1 - torch.tanh(lin) ** 2)[:, None] * self.w
        if self.eps:  # the fix nanwatch gives
            logdet = torch.log((1 + psi @ self.u).abs() + self.eps)
        else:
            logdet = torch.log(torch.abs(1 + psi @ self.u))
        return f, logdet


def _flow_step(mode: str, eps: float = 0.0) -> nanwatch.Watcher:
    torch.manual_seed(0)
    flow = PlanarFlow(2)
    flow.eps = eps
    with torch.no_grad():
        flow.w.copy_(torch.tensor([1.0, 0.0]))
        flow.u.copy_(torch.tensor([-1.0, 0.5]))  # w·u = -1
    opt = torch.optim.SGD(flow.parameters(), lr=0.01)
    z = torch.randn(8, 2)
    z[0, 0] = 0.0  # a sample at w·z + b = 0
    with nanwatch.watch(flow, mode=mode, on_anomaly="record") as nw:
        f, logdet = flow(z)
        loss = -(-0.5 * (f**2).sum(-1) + logdet).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        nw.step()
    return nw


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_flows_log_abs_det_at_zero_is_a_magnitude_not_a_probability(mode: str) -> None:
    nw = _flow_step(mode)
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.op == "aten.log.default"
    assert a.op.code == "logdet = torch.log(torch.abs(1 + psi @ self.u))", a.op.code
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW110" and d.path == "PlanarFlow", d.headline
    assert d.title == "Log of an absolute value that reached 0", d.title
    # not the probability recipes: no softmax, mixture or entropy advice for a determinant
    assert "mixture" not in d.fix and "log_softmax" not in d.fix, d.fix
    assert "Jacobian determinant" in d.explanation, d.explanation
    assert "w·u > -1" in d.fix, d.fix
    assert (
        "logdet = torch.log((1 + psi @ self.u).abs() + 1.19e-07)   # finite: log(1.19e-07) at a 0"
    ) in d.fix, d.fix
    assert _flow_step(mode, eps=1.19e-07).first_anomaly is None


# ----------------------- 4: SAC's tanh-squash correction log(1 - tanh(u)²) in loss code


class Actor(nn.Module):
    """A squashed-Gaussian actor whose mean head grew large (an unnormalized observation):
    the pre-squash actions u sit far out, where tanh(u) rounds to ±1."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 32), nn.ReLU())
        self.mu = nn.Linear(32, 2)
        self.log_std = nn.Linear(32, 2)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(obs)
        return self.mu(h), self.log_std(h).clamp(-20, 2)


def _sac_step(mode: str, *, stable: bool = False) -> nanwatch.Watcher:
    torch.manual_seed(0)
    actor = Actor()
    with torch.no_grad():
        actor.mu.bias.fill_(12.0)
    opt = torch.optim.SGD(actor.parameters(), lr=0.01)
    obs, q = torch.randn(8, 4), torch.randn(8)
    with nanwatch.watch(actor, mode=mode, on_anomaly="record") as nw:
        mu, log_std = actor(obs)
        dist = torch.distributions.Normal(mu, log_std.exp())
        u = dist.rsample()
        if stable:  # the fix nanwatch gives
            log_det = 2 * (math.log(2) - u - F.softplus(-2 * u))
        else:
            log_det = torch.log(1 - torch.tanh(u).pow(2))
        logp = dist.log_prob(u).sum(-1) - log_det.sum(-1)
        loss = (0.2 * logp - q).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        nw.step()
    return nw


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_sacs_tanh_correction_in_loss_code_is_computed_from_the_pre_squash_action(
    mode: str,
) -> None:
    nw = _sac_step(mode)
    a = nw.first_anomaly
    assert a is not None and a.path == "(loss)" and a.op is not None and a.op.op == "aten.log"
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW110" and d.title == "Log of 1 - tanh(u)² that rounded to 0", d.headline
    # the loss graph shows the tanh: not "p = sigmoid(logits)" advice for a policy's squash
    assert (
        "the loss graph takes the log of 1 - tanh(u)² (log <- rsub <- square <- tanh): "
        "tanh(u)² rounds to 1 for |u| > 9.011 in float32"
    ) in d.evidence, d.evidence
    assert "sigmoid" not in d.fix, d.fix
    assert d.fix.startswith("log_det = 2 * (math.log(2) - u - F.softplus(-2 * u))"), d.fix
    assert _sac_step(mode, stable=True).first_anomaly is None


# ----------------------- 5: a VAE encoder's softplus scale that rounded to 0, validate_args on


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 16)
        self.mu = nn.Linear(16, 2)
        self.sd = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.relu(self.body(x))
        return self.mu(h), F.softplus(self.sd(h))


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_softplus_scale_that_rounded_to_zero_is_not_called_a_raw_linear_output(
    mode: str, tmp_path: Any
) -> None:
    torch.manual_seed(0)
    enc = Encoder()
    with torch.no_grad():
        enc.sd.bias.fill_(-200.0)  # an update that drove the scale head far below 0
    x = torch.randn(8, 6)
    with (
        pytest.raises(ValueError, match="to satisfy the constraint") as info,
        nanwatch.watch(enc, mode=mode, report_dir=tmp_path) as nw,
    ):
        mu, sd = enc(x)
        q = torch.distributions.Normal(mu, sd, validate_args=True)
        prior = torch.distributions.Normal(torch.zeros_like(mu), torch.ones_like(sd))
        torch.distributions.kl_divergence(q, prior).sum(-1).mean().backward()
    assert type(info.value) is ValueError  # the user's exception, unchanged
    err = nw.report.error
    assert err is not None and err["class"] == "distribution-constraint"
    # torch's message prints the values' autograd node: a softplus made them, not a Linear
    advice = err["advice"]
    assert "it was made by a softplus" in advice, advice
    assert "below about -103.3 in float32" in advice, advice
    assert "scale = F.softplus(raw) + 1e-5" in advice, advice
    assert "raw Linear output" not in advice, advice


# ----------------------- 6: a Gaussian regressor whose scale is F.relu of a head, in forward


class GaussianHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 16)
        self.mu = nn.Linear(16, 1)
        self.s = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return self.mu(h).squeeze(-1), F.relu(self.s(h)).squeeze(-1)


def test_a_scale_made_by_a_functional_relu_of_a_watched_head_names_the_relu() -> None:
    """No ReLU module: the scale is F.relu of the head ``s`` inside forward. The log's input
    is s's measured output with its negatives made 0 (the same size and maximum)."""
    torch.manual_seed(0)
    net = GaussianHead()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = torch.randn(8, 4), torch.randn(8)
    with nanwatch.watch(net, on_anomaly="record") as nw:
        mu, scale = net(x)
        loss = -torch.distributions.Normal(mu, scale, validate_args=False).log_prob(y).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        nw.step()
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW110" and d.op == "aten.log", d.headline
    assert (
        "the log's argument holds the values of s's output (Linear: min -0.1232, max 0.7149, "
        "8 values) with its negatives set to 0: a relu (or a clamp at 0) of it"
    ) in d.evidence, d.evidence
    assert "F.softplus(raw) + 1e-6 in place of F.relu(raw)" in d.fix, d.fix
    assert "mixture" not in d.fix and "log_softmax" not in d.fix, d.fix


# ----------------------- 7: a custom autograd.Function whose backward reduces the batch away


class ScaledClip(torch.autograd.Function):
    """A clipped identity whose backward sums the incoming gradient over the batch (copied
    from a per-parameter rule): a gradient of the wrong shape for its input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-1, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.sum(0)


class ClipNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(ScaledClip.apply(self.fc1(x)))


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_custom_functions_backward_of_the_wrong_shape_names_the_function_and_shapes(
    mode: str, tmp_path: Any
) -> None:
    torch.manual_seed(0)
    net = ClipNet()
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    with (
        pytest.raises(RuntimeError, match="returned an invalid gradient") as info,
        nanwatch.watch(net, mode=mode, report_dir=tmp_path) as nw,
    ):
        F.mse_loss(net(x), y).backward()
    assert type(info.value) is RuntimeError  # the user's exception, unchanged
    err = nw.report.error
    assert err is not None and err["class"] == "other", err
    assert err["advice"].startswith(
        "ScaledClip.backward returned a gradient of shape [8] for forward input 0 (counted "
        "from 0, ctx not counted), whose shape is [6, 8]"
    ), err["advice"]
    assert "grad.sum(dim, keepdim=True)" in err["advice"], err["advice"]
