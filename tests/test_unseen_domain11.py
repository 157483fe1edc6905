"""NW111 fixes that keep the numerator's parentheses, keep rows of either sign, and take an
eps from a float tensor's dtype; NW112 for a negative power whose inf was masked in forward
(the user's exponent, not backward's), and for a base computed from data."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._diagnoses import code_lines
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


def _pasted(fix: str, scope: dict[str, object]) -> dict[str, object]:
    """Run the fix's code lines in ``scope`` (a user's paste), and return the scope."""
    exec(code_lines(fix), {"torch": torch, "F": F}, scope)
    return scope


# ------------------------------------------------------------ the numerator's parentheses


class _X0(nn.Module):
    """x0 from a predicted eps: (xt - sqrt(1 - a) * eps) / sqrt(a), with a = 0 at t = T."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, xt: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        eps = self.fc(xt)
        pred_x0 = (xt - (1 - a).sqrt() * eps) / a.sqrt()
        return pred_x0.square().mean()


def test_nw111_masked_fix_keeps_the_numerators_parentheses() -> None:
    torch.manual_seed(0)
    net = _X0()
    xt, a = torch.randn(3, 4), torch.tensor([[0.5], [0.0], [0.9]])
    err = _raises(net, lambda: net(xt, a).backward(), mode="forensic")
    d = _first(err, "NW111")
    assert "(xt - (1 - a).sqrt() * eps) / a.sqrt()" in d.fix
    assert "a.sqrt() > 0" in d.fix  # a sqrt is never negative: > 0 loses no row
    # pasted, it equals the user's formula wherever the denominator is not 0
    eps = net.fc(xt).detach()
    out = _pasted(d.fix, {"xt": xt, "a": a, "eps": eps})["pred_x0"]
    assert isinstance(out, torch.Tensor)
    want = (xt - (1 - a).sqrt() * eps) / a.sqrt()
    assert torch.allclose(out[[0, 2]], want[[0, 2]]) and torch.equal(out[1], torch.zeros(4))


class _Mape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pred = self.fc(x)
        loss = torch.mean(torch.abs((y - pred) / y)) * 100
        return loss


def test_nw111_masked_fix_of_a_signed_denominator_keeps_negative_rows() -> None:
    torch.manual_seed(0)
    net = _Mape()
    x, y = torch.randn(4, 3), torch.tensor([[2.0], [0.0], [1.0], [3.0]])
    err = _raises(net, lambda: net(x, y).backward(), mode="forensic")
    d = _first(err, "NW111")
    assert "(y - pred) / " in d.fix and "y - pred / " not in d.fix
    assert "y > 0" not in d.fix and "y != 0" in d.fix  # a target may be below 0
    # pasted, on targets of both signs: the user's MAPE on every nonzero row, 0 at y = 0,
    # and a finite gradient
    pred = torch.tensor([[1.0], [5.0], [-1.0], [2.0]], requires_grad=True)
    yy = torch.tensor([[2.0], [0.0], [-4.0], [-3.0]])
    loss = _pasted(d.fix, {"y": yy, "pred": pred})["loss"]
    assert isinstance(loss, torch.Tensor)
    keep = yy != 0
    want = torch.abs(torch.where(keep, (yy - pred) / torch.where(keep, yy, 1), 0)).mean() * 100
    assert torch.allclose(loss, want) and loss.item() > 0
    loss.backward()
    assert pred.grad is not None and torch.isfinite(pred.grad).all()
    assert pred.grad[2].abs().item() > 0  # the negative target's row counts


# ------------------------------------------------------------ an eps from an integer tensor


def _snr_of(t: torch.Tensor) -> torch.Tensor:
    abar = torch.linspace(1.0, 0.0, 10)[t]  # zero-terminal SNR: abar = 0 at the last step
    return abar / (1 - abar).clamp_min(1e-3)


class _MinSnr(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        snr = _snr_of(t)
        w = torch.minimum(snr, 5.0 * torch.ones_like(snr)) / snr
        return (self.fc(x).squeeze(-1) ** 2 * w).mean()


def test_nw111_fix_at_assignment_takes_no_eps_from_an_integer_argument() -> None:
    torch.manual_seed(0)
    net = _MinSnr()
    t = torch.tensor([1, 9, 4])  # int64 timesteps; 9 gives snr = 0
    err = _raises(net, lambda: net(torch.randn(3, 2), t).backward(), mode="forensic")
    d = _first(err, "NW111")
    assert d.fix.startswith("snr = _snr_of(t)\nsnr = snr.clamp_min(torch.finfo(snr.dtype).eps)")
    assert "t.dtype" not in d.fix
    snr = _pasted(d.fix, {"t": t, "_snr_of": _snr_of})["snr"]  # no TypeError from finfo
    assert isinstance(snr, torch.Tensor) and bool((snr > 0).all())


# ------------------------------------------------------------ a masked negative power


class _EdgeMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(2, 1)

    def forward(self, ef: torch.Tensor) -> torch.Tensor:
        return F.relu(self.l(ef)).squeeze(-1)


class _LearnedGcn(nn.Module):
    """Learned edge weights, relu'd: a node whose weights are all 0 has degree 0; the
    forward masks deg ** -0.5 = inf, the backward does not."""

    def __init__(self) -> None:
        super().__init__()
        self.edge = _EdgeMlp()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, ef: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        ew = self.edge(ef)
        deg = torch.zeros(x.size(0)).scatter_add(0, col, ew)
        dinv = deg.pow(-0.5)
        dinv = dinv.masked_fill(dinv == float("inf"), 0)
        return self.lin(x) * dinv[:, None]


def _gcn_case() -> tuple[_LearnedGcn, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = _LearnedGcn()
    with torch.no_grad():
        net.edge.l.weight.fill_(1.0)
        net.edge.l.bias.zero_()
    ef = torch.tensor([[1.0, 1.0], [2.0, 0.5], [-3.0, -3.0], [1.0, 0.0]])  # edge 2: weight 0
    col = torch.tensor([0, 1, 2, 0])
    return net, torch.randn(3, 3), ef, col


def test_nw112_masked_negative_power_quotes_the_users_exponent() -> None:
    net, x, ef, col = _gcn_case()
    err = _raises(net, lambda: net(x, ef, col).sum().backward(), mode="forensic")
    d = _first(err, "NW112")
    assert d.phase == "backward"
    assert "-1.5" not in d.fix and "sqrt" not in d.explanation
    assert "x ** -0.5 is inf at x = 0" in d.explanation and "0 × inf = NaN" in d.explanation
    assert d.fix.startswith("dinv = torch.where(deg > 0, deg.clamp_min(")
    assert ".pow(-0.5), 0)" in d.fix
    # pasted, the forward is the masked one and the gradient is finite
    ew = F.relu(net.edge(ef)).squeeze(-1)
    deg = torch.zeros(3).scatter_add(0, col, ew)
    dinv = _pasted(d.fix, {"deg": deg})["dinv"]
    assert isinstance(dinv, torch.Tensor)
    masked = deg.pow(-0.5).masked_fill(deg == 0, 0)
    assert torch.allclose(dinv, masked)
    dinv.sum().backward()
    grad = net.edge.l.weight.grad
    assert grad is not None and torch.isfinite(grad).all()


# ------------------------------------------------------------ a base computed from data


class _SignedGcn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, col: torch.Tensor, ew: torch.Tensor) -> torch.Tensor:
        deg = torch.zeros(x.size(0)).scatter_add_(0, col, ew)
        dinv = deg.pow(-0.5)
        return self.lin(x) * dinv[:, None]


def test_nw112_base_summed_from_data_is_data_not_a_network_output() -> None:
    torch.manual_seed(0)
    net = _SignedGcn()
    col = torch.tensor([0, 1, 2, 2])
    ew = torch.tensor([0.5, 0.3, -0.9, 0.2])  # signed (correlations): node 2's degree < 0
    err = _raises(net, lambda: net(torch.randn(3, 3), col, ew).sum().backward())
    d = _first(err, "NW112")
    assert "softplus(raw)" not in d.fix and "network output (a Linear)" not in d.explanation
    assert "no autograd history" in d.explanation
    assert any("the base deg is computed from" in e and "(ew)" in e for e in d.evidence)
    assert d.fix.startswith("dinv = deg.clamp_min(0).pow(-0.5)")


class _LearnedDeg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.edge = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor, col: torch.Tensor, ef: torch.Tensor) -> torch.Tensor:
        ew = self.edge(ef).squeeze(-1)
        deg = torch.zeros(x.size(0)).scatter_add_(0, col, ew)
        dinv = deg.pow(-0.5)
        return x * dinv[:, None]


def test_nw112_base_summed_from_a_prediction_is_not_called_data() -> None:
    torch.manual_seed(0)
    net = _LearnedDeg()
    with torch.no_grad():
        net.edge.weight.fill_(1.0)
        net.edge.bias.zero_()
    col, ef = torch.tensor([0, 1, 2]), torch.tensor([[1.0], [2.0], [-1.0]])
    err = _raises(net, lambda: net(torch.randn(3, 2), col, ef).sum().backward())
    d = _first(err, "NW112")
    assert not any("the base deg is computed from" in e for e in d.evidence)
