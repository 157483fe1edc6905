"""Scientific and generative models, trained as a user trains them. A physics-informed
network whose forward differentiates its own output (``torch.autograd.grad(...,
create_graph=True)``) of ``sqrt(x² + y²)`` at the origin makes its NaN in a backward op
that runs inside the forward: forensic mode names that op (SqrtBackward0's division), the
line of the sqrt and the line that called autograd.grad, and the fix (an eps inside the
sqrt) removes the NaN; watch and sentinel name the same op, as their replay runs the
forward once more with gradients on when it raised under no_grad, and leaves the user's
``.grad`` as it was. The healthy network (no point at the origin) stays silent in every
mode."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch import ops

torch.set_num_threads(1)

MODES = ["watch", "sentinel"]


def _train(
    model: nn.Module, step: Callable[[], torch.Tensor], mode: str, steps: int = 1
) -> nanwatch.Watcher:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(steps):
            step().backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


def _loud(nw: nanwatch.Watcher) -> list[str]:
    return [d.code for d in nw.report.diagnoses if d.severity in ("warning", "error")]


# --------------------------------------------------- 1: a PINN's autograd.grad of r = |xy|
class _PINN(nn.Module):
    def __init__(self, eps: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
        self.eps = eps

    def forward(self, xy: torch.Tensor) -> torch.Tensor:
        xy = xy.requires_grad_(True)
        r = torch.sqrt((xy**2).sum(1, keepdim=True) + self.eps)
        u = self.net(r)
        du = torch.autograd.grad(u.sum(), xy, create_graph=True)[0]
        return (du**2).sum(1).mean() + u.pow(2).mean()


def _collocation(origin: bool) -> torch.Tensor:
    torch.manual_seed(0)
    xy = torch.rand(16, 2) + 0.1
    if origin:
        xy[0] = 0.0  # a collocation point at the origin: r = 0, dr/dxy = xy / r = 0/0
    return xy


def _pinn_loss(eps: float, origin: bool, mode: str) -> tuple[nanwatch.Watcher, float]:
    torch.manual_seed(0)
    model = _PINN(eps)
    xy = _collocation(origin)
    losses: list[float] = []

    def step() -> torch.Tensor:
        loss = model(xy.clone())
        losses.append(float(loss.detach()))
        return loss

    return _train(model, step, mode), losses[0]


def test_a_pinns_nan_from_autograd_grad_in_forward_is_named_in_forensic_mode() -> None:
    nw, loss = _pinn_loss(0.0, True, "forensic")
    assert math.isnan(loss)
    d = nw.report.diagnoses[0]
    assert d.code == "NW112", str(nw.report)
    assert d.op == "aten.div.Tensor"
    text = " ".join(str(nw.report).split())
    assert "SqrtBackward0" in text
    assert "r = torch.sqrt((xy**2).sum(1, keepdim=True) + self.eps)" in " ".join(d.evidence)
    assert "torch.autograd.grad(create_graph=True) ran inside the forward" in text
    assert "a tensor the step read already held it" not in text
    assert "+ 1e-12)" in d.fix


def test_the_pinns_fix_removes_the_nan_and_keeps_healthy_values() -> None:
    # the fix NW112 gives: an eps inside the sqrt; the NaN is gone and a batch with no point
    # at the origin gets (almost) the same loss as without it
    nw, loss = _pinn_loss(1e-12, True, "watch")
    assert math.isfinite(loss) and not _loud(nw), str(nw.report)
    _, healthy = _pinn_loss(0.0, False, "watch")
    _, fixed = _pinn_loss(1e-12, False, "watch")
    assert fixed == pytest.approx(healthy, rel=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_a_pinns_nan_in_watch_and_sentinel_is_named_by_the_replay(mode: str) -> None:
    # the op replay runs the forward under no_grad first, where its autograd.grad raises;
    # it runs it again with gradients on and names the backward op, as forensic mode does
    nw, _ = _pinn_loss(0.0, True, mode)
    d = nw.report.diagnoses[0]
    assert d.code == "NW112", str(nw.report)
    assert d.path == "_PINN"
    assert d.op == "aten.div.Tensor"
    assert "SqrtBackward0" in " ".join(str(nw.report).split())
    assert "r = torch.sqrt((xy**2).sum(1, keepdim=True) + self.eps)" in " ".join(d.evidence)
    assert "+ 1e-12)" in d.fix


@pytest.mark.parametrize("mode", [*MODES, "forensic"])
def test_nw112_says_the_derivative_ran_inside_the_forward(mode: str) -> None:
    nw, _ = _pinn_loss(0.0, True, mode)
    d = nw.report.diagnoses[0]
    assert d.code == "NW112", str(nw.report)
    why = " ".join(d.explanation.split())
    assert "never shows a bad value" not in why
    assert "ran this derivative inside the forward, so its inf or NaN is a forward value" in why
    assert "torch.autograd.grad(create_graph=True) at " in why


class _SelfBackward(nn.Module):
    """A forward that calls backward() on its own output: it writes the parameters'
    ``.grad`` (a replay with gradients on must not)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, xy: torch.Tensor) -> torch.Tensor:
        xy = xy.requires_grad_(True)
        r = torch.sqrt((xy**2).sum(1, keepdim=True))
        u = self.net(r)
        u.sum().backward(create_graph=True)
        out: torch.Tensor = u + sum(p.grad.sum() for p in self.parameters() if p.grad is not None)
        return out


@pytest.mark.parametrize("model", [_PINN, _SelfBackward])
def test_the_replay_with_gradients_names_the_op_and_leaves_the_users_grads(
    model: type[nn.Module],
) -> None:
    torch.manual_seed(0)
    m = model()
    for p in m.parameters():
        p.grad = torch.full_like(p, 0.5)
    held = {n: p.grad for n, p in m.named_parameters()}
    xy = _collocation(True).requires_grad_(True)
    result = ops.replay(m, (xy,), {}, path="m")
    assert result.error is None
    ev = result.first()
    assert ev is not None and ev.op == "aten.div.Tensor" and ev.node == "SqrtBackward0"
    for n, p in m.named_parameters():
        assert p.grad is held[n], n
        assert torch.equal(p.grad, torch.full_like(p, 0.5)), n
    assert xy.grad is None
    assert torch.is_grad_enabled() and not torch.is_anomaly_enabled()  # both given back


@pytest.mark.parametrize("mode", [*MODES, "forensic"])
def test_a_healthy_pinn_stays_silent(mode: str) -> None:
    nw, loss = _pinn_loss(0.0, False, mode)
    assert math.isfinite(loss)
    assert not _loud(nw), str(nw.report)
