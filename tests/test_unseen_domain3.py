"""Unseen-model follow-ups for the domain rules: an inf that came in is not an overflow
(NW111), a denominator or a log argument that is a sum of exp() terms that underflowed
(NW111, NW110), NW113's fix keeps the user's loss call, NW112's fix follows what was under
the sqrt."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import OpEvent, Phase, TensorStat
from nanwatch.rules._evidence import classify


def _diag(run) -> nanwatch.AnomalyError:
    with pytest.raises(nanwatch.AnomalyError) as info:
        run()
    return info.value


class _Reweight(nn.Module):
    def __init__(self, counts: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("scale", counts.sum() / counts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def test_an_inf_given_to_an_op_is_classified_as_come_in_not_overflow() -> None:
    w = TensorStat(0.77, math.inf, 5, nan=0, posinf=1, neginf=0)
    ev = OpEvent(
        "aten.mul.Tensor",
        Phase.FORWARD,
        "CrossEntropyLoss",
        "-inf",
        TensorStat(-math.inf, -0.9, 80, neginf=16),
        [("self", TensorStat(-2.2, -1.1, 80)), ("other", w)],
        dtype="float32",
    )
    assert classify(ev) == "inf-input"


def test_a_buffer_holding_inf_is_named_and_the_fix_is_on_the_zero_count() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), _Reweight(torch.tensor([3.0, 5.0, 0.0, 2.0])))

    def run() -> None:
        with nanwatch.watch(model) as nw:
            for _ in range(2):
                loss = model(torch.randn(8, 6)).pow(2).mean()
                loss.backward()
                nw.step()

    d = _diag(run).diagnoses[0]
    assert d.code == "NW111" and d.code != "NW101"
    assert "not an overflow" in d.title
    text = "\n".join(d.evidence)
    assert "did not make the inf" in text and "self.scale" in text and "1 +inf" in text
    assert "no value overflowed" in text
    assert "1 / counts" in d.explanation
    assert "counts.clamp_min(1)" in d.fix
    assert "assert torch.isfinite(self.scale).all()" in d.fix


def test_a_loss_weight_holding_inf_is_named_as_the_class_weights() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(10, 5))
    counts = torch.tensor([4.0, 3.0, 5.0, 2.0, 0.0])
    crit = nn.CrossEntropyLoss(weight=counts.sum() / (5 * counts), label_smoothing=0.1)

    def run() -> None:
        with nanwatch.watch(net, crit, guards=False) as nw:
            loss = crit(net(torch.randn(16, 10)), torch.randint(0, 4, (16,)))
            loss.backward()
            nw.step()

    d = _diag(run).diagnoses[0]
    assert d.code == "NW111" and "not an overflow" in d.title
    assert any("class weights" in e and "+inf" in e for e in d.evidence)
    assert "assert torch.isfinite(crit.weight).all()" in d.fix


def _sinkhorn(x: torch.Tensor, y: torch.Tensor, eps: float = 0.01) -> torch.Tensor:
    C = torch.cdist(x, y) ** 2
    a = torch.full((x.shape[0],), 1.0 / x.shape[0])
    b = torch.full((y.shape[0],), 1.0 / y.shape[0])
    K = torch.exp(-C / eps)
    u = torch.ones_like(a)
    v = torch.ones_like(b)
    for _ in range(3):
        u = a / (K @ v)
        v = b / (K.t() @ u)
    return (u[:, None] * K * v[None, :] * C).sum()


@pytest.mark.parametrize("mode", ["forensic", "watch"])
def test_a_sum_of_underflowed_exps_as_denominator_points_to_the_log_domain(mode: str) -> None:
    torch.manual_seed(0)
    gen = nn.Linear(4, 2)

    def run() -> None:
        with nanwatch.watch(gen, mode=mode) as nw:
            loss = _sinkhorn(gen(torch.randn(8, 4)), torch.randn(8, 2) * 2 + 3)
            loss.backward()
            nw.step()

    d = _diag(run).diagnoses[0]
    assert d.code == "NW111"
    assert "logsumexp" in d.fix and "logsumexp" in d.explanation
    if mode == "forensic":  # the line and the exp above it are known
        assert "exp() underflowed" in d.title
        assert any("K = torch.exp(-C / eps)" in e for e in d.evidence)
        assert "log_K = -C / eps" in d.fix
        assert "log_u = torch.log(a) - torch.logsumexp(log_K + torch.log(v), dim=-1)" in d.fix


def _softmin(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, g: float = 0.01) -> torch.Tensor:
    return -g * torch.log(torch.exp(-a / g) + torch.exp(-b / g) + torch.exp(-c / g))


def test_a_log_of_a_sum_of_exps_is_fixed_with_logsumexp_on_the_users_line() -> None:
    torch.manual_seed(0)
    net = nn.Linear(3, 3)

    def run() -> None:
        with nanwatch.watch(net, mode="forensic") as nw:
            z = net(torch.randn(4, 3)) + 5.0
            loss = _softmin(z[:, 0], z[:, 1], z[:, 2]).mean()
            loss.backward()
            nw.step()

    d = _diag(run).diagnoses[0]
    assert d.code == "NW110"
    want = "return -g * torch.logsumexp(torch.stack([-a / g, -b / g, -c / g]), dim=0)"
    assert want in d.fix
    assert "log_softmax" not in d.fix
    a, b, c = torch.tensor([5.0, 6.0]), torch.tensor([5.5, 7.0]), torch.tensor([6.0, 5.2])
    g = 0.01
    fixed = -g * torch.logsumexp(torch.stack([-a / g, -b / g, -c / g]), dim=0)  # the fix
    assert torch.allclose(fixed, torch.minimum(torch.minimum(a, b), c), atol=0.05)


def test_the_nll_fix_keeps_every_argument_of_the_users_functional_call() -> None:
    torch.manual_seed(0)
    net = nn.Linear(10, 4)
    w = torch.tensor([0.0, 1.0, 2.0, 1.5])

    def run() -> None:
        with nanwatch.watch(net) as nw:
            out = net(torch.randn(8, 10))
            y = torch.zeros(8, dtype=torch.long)
            loss = F.cross_entropy(out, y, weight=w, label_smoothing=0.1)
            loss.backward()
            nw.step()

    d = _diag(run).diagnoses[0]
    assert d.code == "NW113"
    first = d.fix.splitlines()[0]
    assert first.startswith(
        "loss = F.cross_entropy(out, y, weight=w, label_smoothing=0.1, reduction='sum')"
    )
    assert "logits" not in d.fix
    out = net(torch.randn(8, 10))
    y = torch.zeros(8, dtype=torch.long)
    loss = F.cross_entropy(out, y, weight=w, label_smoothing=0.1, reduction="sum")
    loss = loss / w[y[y != -100]].sum().clamp_min(1e-12)  # the fix's second line
    assert torch.isfinite(loss)


def _vicreg_std(z: torch.Tensor, eps: float) -> torch.Tensor:
    std = torch.sqrt(z.var(dim=0) + eps)
    return F.relu(1 - std).mean()


def test_a_sqrt_of_a_variance_gets_an_eps_inside_on_the_users_line() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    with torch.no_grad():
        net[0].bias.fill_(-100.0)  # every unit dead: each feature is constant, var = 0

    def run() -> None:
        with nanwatch.watch(net, mode="forensic") as nw:
            loss = _vicreg_std(net(torch.randn(16, 8)), 0.0)
            loss.backward()
            nw.step()

    d = _diag(run).diagnoses[0]
    assert d.code == "NW112"
    assert "std = torch.sqrt(z.var(dim=0) + 1e-4)" in d.fix
    assert "vector_norm(a - b" not in d.fix and "variance" in d.explanation
    z = net(torch.randn(16, 8)).detach().requires_grad_()
    std = torch.sqrt(z.var(dim=0) + 1e-4)  # the fix
    F.relu(1 - std).mean().backward()
    assert z.grad is not None and torch.isfinite(z.grad).all()
