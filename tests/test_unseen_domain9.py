"""NW111 for F.normalize in float16 (its eps 1e-12 is 0 there), scalar divisors annealed
to 0, and masking a nonzero numerator over a zero denominator; NW112 for the magnitude of
a complex number; NW114 for arguments far outside the domain."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


# ------------------------------------------------------------ F.normalize in float16


class _Proj(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.relu(self.fc(x))
        return F.normalize(z, dim=1)


class _ByHand(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.relu(self.fc(x))
        return p / p.norm(dim=1, keepdim=True)


def _half_dead(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    net = cls().half()
    with torch.no_grad():
        net.fc.bias.fill_(-30.0)  # type: ignore[operator]
    return net


def test_nw111_normalize_in_float16_names_its_lost_eps() -> None:
    net = _half_dead(_Proj)
    err = _raises(net, lambda: net(torch.randn(8, 16).half()).float().sum().backward())
    d = _first(err, "NW111")
    assert "F.normalize(z, dim=1, eps=1e-4)" in d.fix
    assert "1e-12 is 0 in float16" in d.fix
    assert "running statistics" not in d.explanation
    assert "d.clamp_min" not in d.fix
    assert any("default eps=1e-12 is 0 in float16" in e for e in d.evidence)
    # the offered eps keeps a zero row at 0 in float16
    z = torch.zeros(2, 8, dtype=torch.float16)
    assert torch.equal(F.normalize(z, dim=1, eps=1e-4), z)


def _some_rows_dead(net: nn.Module, dtype: torch.dtype) -> nanwatch.AnomalyError:
    torch.manual_seed(0)
    net = net.to(dtype)
    with torch.no_grad():
        net.fc.weight.abs_()  # type: ignore[operator]
        net.fc.bias.zero_()  # type: ignore[operator]
    x = torch.randn(8, 16).abs().to(dtype)
    x[:3] = -x[:3]  # these samples push every unit below 0: all-zero rows
    return _raises(net, lambda: net(x).float().sum().backward())


def test_nw111_hand_normalized_float16_offers_an_eps_it_holds() -> None:
    err = _some_rows_dead(_ByHand(), torch.float16)
    d = _first(err, "NW111")
    assert "F.normalize(p, dim=1, eps=1e-4)" in d.fix


def test_nw111_hand_normalized_float32_keeps_the_default_eps() -> None:
    err = _some_rows_dead(_ByHand(), torch.float32)
    d = _first(err, "NW111")
    assert "F.normalize(p, dim=1)" in d.fix
    assert "eps=" not in d.fix.splitlines()[0]


# ------------------------------------------------------------ a Python number annealed to 0


class _Gumbel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 6)
        self.tau = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gumbel_softmax(self.enc(x), tau=self.tau, hard=False)


def test_nw111_annealed_tau_floors_the_callers_argument() -> None:
    torch.manual_seed(0)
    net = _Gumbel()
    net.tau = max(1.0 - 0.1 * 10, 0.0)
    err = _raises(net, lambda: net(torch.randn(4, 8)).sum().backward())
    d = _first(err, "NW111")
    assert "F.gumbel_softmax(self.enc(x), tau=max(self.tau, 1e-3), hard=False)" in d.fix
    assert "Python number" in d.explanation
    assert "standard deviation" not in d.explanation
    assert "d = max(d" not in d.fix


def test_nw111_temperature_reaching_0_floors_the_users_divisor() -> None:
    torch.manual_seed(0)
    enc = nn.Linear(8, 4)

    def run() -> None:
        z = F.normalize(enc(torch.randn(4, 8)), dim=1)
        temperature = 0.07 * max(0, 1 - 10 / 10)
        logits = z @ z.t() / temperature
        F.cross_entropy(logits, torch.arange(4)).backward()

    d = _first(_raises(enc, run, mode="forensic"), "NW111")
    assert "logits = z @ z.t() / max(temperature, 1e-3)" in d.fix
    assert "annealed" in d.explanation
    assert "range (max - min)" not in d.explanation


# ------------------------------------------------------------ a nonzero numerator over 0


class _EMACodebook(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("embedding", torch.randn(6, 4))
        self.register_buffer("cluster_size", torch.tensor([2.0, 0.0, 1.0, 0.0, 3.0, 1.0]))
        self.register_buffer("embed_avg", torch.randn(6, 4))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.embedding.copy_(self.embed_avg / self.cluster_size.unsqueeze(1))
        return self.fc(z) + self.embedding.sum()


def test_nw111_nonzero_numerator_masks_the_update_not_eps() -> None:
    torch.manual_seed(0)
    net = _EMACodebook()
    err = _raises(net, lambda: net(torch.randn(2, 4)).sum().backward(), mode="forensic")
    d = _first(err, "NW111")
    # a buffer's sign is not in the code: rows of either sign are kept (!= 0), and the
    # unused branch divides by 1
    cs_ = "self.cluster_size.unsqueeze(1)"
    assert f"torch.where({cs_} != 0, self.embed_avg / torch.where({cs_} != 0, {cs_}, 1)" in d.fix
    assert "self.embedding))" in d.fix
    assert "0/eps = 0" not in d.fix
    # the offered update leaves the zero-count rows as they were and the rest exact
    emb, avg, cs = torch.randn(6, 4), net.embed_avg, net.cluster_size.unsqueeze(1)
    new = torch.where(cs != 0, avg / torch.where(cs != 0, cs, 1), emb)
    assert torch.isfinite(new).all() and torch.equal(new[1], emb[1])


# ------------------------------------------------------------ the magnitude of a complex number


class _Enhancer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv1d(1, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(x.unsqueeze(1)).squeeze(1) * (x != 0)


def _mag(x: torch.Tensor) -> torch.Tensor:
    spec = torch.stft(x, 32, 8, window=torch.hann_window(32), return_complex=True)
    return torch.sqrt(spec.real**2 + spec.imag**2)


def _mag_eps(x: torch.Tensor) -> torch.Tensor:
    spec = torch.stft(x, 32, 8, window=torch.hann_window(32), return_complex=True)
    return torch.sqrt(spec.real**2 + spec.real.abs() * 0 + spec.imag.pow(2))


def _stft_error(mag) -> nanwatch.Diagnosis:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    net = _Enhancer()
    x = torch.randn(1, 256)
    x[:, 64:192] = 0.0

    def run() -> None:
        F.l1_loss(mag(net(x)), mag(x)).backward()

    return _first(_raises(net, run, mode="forensic"), "NW112")


def test_nw112_complex_magnitude_by_hand_becomes_abs() -> None:
    d = _stft_error(_mag)
    assert "return spec.abs()" in d.fix
    assert "vector_norm(a - b" not in d.fix and "pairwise_distance" not in d.fix
    assert "complex" in d.explanation


def test_nw112_other_sum_of_squares_gets_eps_inside_the_users_sqrt() -> None:
    d = _stft_error(_mag_eps)
    assert "torch.sqrt(spec.real**2 + spec.real.abs() * 0 + spec.imag.pow(2) + 1e-12)" in d.fix
    assert "vector_norm(a - b" not in d.fix


# ------------------------------------------------------------ acosh far outside its domain


class _Poincare(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 3)
        with torch.no_grad():
            self.emb.weight.uniform_(-scale, scale)

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        e = self.emb(pairs)
        u, v = e[..., 0, :], e[..., 1, :]
        sq_u, sq_v = (u * u).sum(-1), (v * v).sum(-1)
        x = 1 + 2 * ((u - v) ** 2).sum(-1) / ((1 - sq_u) * (1 - sq_v))
        return torch.acosh(x)


def test_nw114_far_outside_says_invalid_not_clamp() -> None:
    torch.manual_seed(0)
    net = _Poincare(0.3)
    with torch.no_grad():
        net.emb.weight[1] = torch.tensor([1.5, 0.5, 0.0])  # a point that left the unit ball
    pairs = torch.tensor([[0, 1], [2, 3], [4, 5], [1, 4]])
    err = _raises(net, lambda: net(pairs).sum().backward())
    d = _first(err, "NW114")
    assert "invalid" in d.fix and "clamp_min(1 + eps)" not in d.fix
    assert "unit ball" in d.fix and ".mul_(" in d.fix
    assert any("not rounding" in e for e in d.evidence)
    assert "acosh" in d.explanation and "clamp" in d.explanation


def test_nw114_acosh_steep_edge_names_its_own_guard() -> None:
    torch.manual_seed(0)
    net = _Poincare(0.3)
    pairs = torch.tensor([[0, 0], [1, 2]])  # a point with itself: acosh(1), slope inf
    err = _raises(net, lambda: net(pairs).sum().backward(), mode="forensic")
    d = _first(err, "NW114")
    assert "x.clamp(-1, 1) before acos" not in d.explanation
    assert "x.clamp_min(1) before acosh" in d.explanation
    assert "clamp_min(1 + eps)" in d.fix


# ------------------------------------------------------------ a norm's second derivative at 0


class _Coulomb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(3, 1)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        q = self.q(pos).squeeze(-1)
        r = (pos[:, None, :] - pos[None, :, :]).norm(dim=-1).clamp_min(1e-6)
        pair = (q[:, None] * q[None, :] / r).masked_fill(torch.eye(len(pos), dtype=torch.bool), 0)
        return 0.5 * pair.sum()


def test_nw111_norm_in_double_backward_keeps_the_squared_norm_off_0() -> None:
    torch.manual_seed(0)
    net = _Coulomb().double()
    pos = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)

    def run() -> None:
        (force,) = torch.autograd.grad(net(pos), pos, create_graph=True)
        (force**2).mean().backward()

    d = _first(_raises(net, run, mode="forensic"), "NW111")
    assert "second derivative" in d.title
    assert "d2 = ((pos[:, None, :] - pos[None, :, :]) ** 2).sum(dim=-1)" in d.fix
    assert "torch.where(d2 > 0, torch.where(d2 > 0, d2, 1).sqrt(), 0)" in d.fix
    assert "y = x / d.clamp_min" not in d.fix
