"""NW111 fix at the divisor's assignment, NW110 log of a ReLU output, NW112 roots of data
and of computed values (not network outputs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

torch.set_num_threads(1)


def _first(err: nanwatch.AnomalyError, code: str) -> nanwatch.Diagnosis:
    return next(d for d in err.diagnoses if d.code == code)


# ---------------------------------------------------------------- NW111 at the assignment


class _RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g


class _FakeQuant(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lo, hi = x.min().detach(), x.max().detach()
        scale = (hi - lo) / 255
        zp = torch.round(-lo / scale)
        q = torch.clamp(_RoundSTE.apply(x / scale) + zp, 0, 255)
        return (q - zp) * scale


class _QNet(nn.Module):
    def __init__(self, dead: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.act = nn.ReLU()
        self.fq = _FakeQuant()
        self.fc2 = nn.Linear(32, 4)
        if dead:
            with torch.no_grad():
                self.fc1.bias.fill_(-50.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fq(self.act(self.fc1(x))))


def _qat(model: nn.Module) -> None:
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
    with nanwatch.watch(model) as nw:
        for _ in range(2):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()


def test_nw111_divisor_clamped_where_assigned() -> None:
    torch.manual_seed(0)
    with pytest.raises(nanwatch.AnomalyError) as e:
        _qat(_QNet(dead=True))
    d = _first(e.value, "NW111")
    assert d.path == "fq"
    assert "zp = torch.round(-lo / scale)" in (d.evidence[-1] + " ".join(d.evidence))
    assert d.fix.startswith("scale = ((hi - lo) / 255).clamp_min(torch.finfo(hi.dtype).eps)")
    assert "every division by scale" in d.fix
    assert "-lo / scale.clamp_min" not in d.fix


def test_nw111_divisor_fix_runs_when_pasted() -> None:
    class Fixed(_FakeQuant):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            lo, hi = x.min().detach(), x.max().detach()
            scale = ((hi - lo) / 255).clamp_min(torch.finfo(hi.dtype).eps)
            zp = torch.round(-lo / scale)
            q = torch.clamp(_RoundSTE.apply(x / scale) + zp, 0, 255)
            return (q - zp) * scale

    torch.manual_seed(0)
    model = _QNet(dead=True)
    model.fq = Fixed()
    _qat(model)  # no anomaly


def test_nw111_healthy_quantizer_silent() -> None:
    torch.manual_seed(0)
    _qat(_QNet(dead=False))


# ---------------------------------------------------------------- NW110 log of a ReLU output


class _NBHead(nn.Module):
    def __init__(self, relu: bool) -> None:
        super().__init__()
        self.relu = relu
        self.mu = nn.Linear(16, 1)
        self.alpha = nn.Linear(16, 1)
        if relu:
            with torch.no_grad():
                self.mu.bias.fill_(-0.3)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu = F.relu(self.mu(h)) if self.relu else F.softplus(self.mu(h))
        r = F.softplus(self.alpha(h)) + 1e-3
        return mu.squeeze(-1), r.squeeze(-1)


class _DeepAR(nn.Module):
    def __init__(self, relu: bool) -> None:
        super().__init__()
        self.rnn = nn.LSTM(1, 16, batch_first=True)
        self.head = _NBHead(relu)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, _ = self.rnn(torch.log1p(x).unsqueeze(-1))
        return self.head(h)


def _nb_nll(y: torch.Tensor, mu: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    ll = (
        torch.lgamma(y + r)
        - torch.lgamma(r)
        - torch.lgamma(y + 1)
        + r * torch.log(r / (r + mu))
        + y * torch.log(mu / (r + mu))
    )
    return -ll.mean()


def _forecast(relu: bool) -> None:
    torch.manual_seed(0)
    m = _DeepAR(relu)
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    with nanwatch.watch(m) as nw:
        for _ in range(3):
            x = torch.poisson(torch.full((8, 25), 0.3))
            mu, r = m(x[:, :-1])
            loss = _nb_nll(x[:, 1:], mu, r)
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()


def test_nw110_log_of_relu_output_suggests_softplus() -> None:
    with pytest.raises(nanwatch.AnomalyError) as e:
        _forecast(relu=True)
    d = _first(e.value, "NW110")
    text = " ".join(d.evidence)
    assert "head's output[0]" in text and "head.mu" in text
    assert "exactly 0 in all 192 values" in text
    assert "ReLU" in d.explanation
    assert "F.softplus(self.mu(...)) + 1e-6" in d.fix
    assert "_NBHead.forward" in d.fix
    assert "softmax/sigmoid probability" not in d.fix


def test_nw110_softplus_head_silent() -> None:
    _forecast(relu=False)


# ---------------------------------------------------------------- NW112 power of data


class _BoxCox(nn.Module):
    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.safe = safe
        self.lam = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.safe:
            x = x.clamp_min(0) + 1
        return (x.pow(self.lam) - 1) / self.lam


class _CountNet(nn.Module):
    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.tf = _BoxCox(safe)
        self.mlp = nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.tf(x))


def _counts(safe: bool) -> None:
    torch.manual_seed(0)
    m = _CountNet(safe)
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    with nanwatch.watch(m) as nw:
        for step in range(3):
            x = torch.poisson(torch.full((8, 30), 4.0))
            if step == 1:
                x[2, 10] = -1.0  # a return booked as a negative sale
            y = torch.log1p(x[:, 24:].clamp_min(0))
            loss = F.huber_loss(m(x[:, :24]), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()


def test_nw112_power_of_negative_data_clamps_the_data() -> None:
    with pytest.raises(nanwatch.AnomalyError) as e:
        _counts(safe=False)
    d = _first(e.value, "NW112")
    assert d.path == "tf"
    assert any("data with no autograd history" in ev for ev in d.evidence)
    assert "raw network output" not in d.explanation
    assert "in the data itself" in d.explanation
    assert d.fix.startswith("return (x.clamp_min(0).pow(self.lam) - 1) / self.lam")
    assert "softplus" not in d.fix
    assert "not .clamp_min(0)" not in d.fix


def test_nw112_data_healthy_silent() -> None:
    _counts(safe=True)


# ---------------------------------------------------------------- NW112 computed root


def _entmax15(z: torch.Tensor, safe: bool) -> torch.Tensor:
    z = z / 2
    zs, _ = torch.sort(z, dim=-1, descending=True)
    rho = torch.arange(1, z.size(-1) + 1, dtype=z.dtype)
    mean = zs.cumsum(-1) / rho
    ss = rho * ((zs**2).cumsum(-1) / rho - mean**2)
    delta = (1 - ss) / rho
    if safe:
        delta = delta.clamp_min(0)
    tau = mean - torch.sqrt(delta)
    support = (tau <= zs).sum(-1, keepdim=True)
    tau_star = tau.gather(-1, support - 1)
    return torch.clamp(z - tau_star, min=0) ** 2


class _Att(nn.Module):
    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.safe = safe
        self.fc = nn.Linear(8, 6)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return _entmax15(self.fc(a), self.safe)


class _AttNet(nn.Module):
    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.att = _Att(safe)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.att(x) * x[:, :6])


def _attend(safe: bool) -> None:
    torch.manual_seed(0)
    m = _AttNet(safe)
    opt = torch.optim.SGD(m.parameters(), 1e-2)
    with nanwatch.watch(m, mode="forensic") as nw:
        x = 3 * torch.randn(32, 8)
        y = (x[:, 0] > 0).long()
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        nw.step()


def test_nw112_computed_root_clamps_not_softplus() -> None:
    with pytest.raises(nanwatch.AnomalyError) as e:
        _attend(safe=False)
    d = _first(e.value, "NW112")
    assert d.source is not None
    assert d.source.endswith(f":{_line('tau = mean - torch.sqrt(delta)')}")
    assert d.fix.startswith("tau = mean - torch.sqrt(delta.clamp_min(0))")
    assert "F.softplus(delta)" not in d.fix
    assert "raw network output (a Linear) is negative" not in d.explanation


def test_nw112_computed_root_healthy_silent() -> None:
    _attend(safe=True)


def _line(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line and "_line(" not in line)


def test_a_bfloat16_sigmoid_saturating_at_a_logit_of_7_quotes_bfloat16s_bound() -> None:
    """Under bfloat16 autocast, sigmoid(7) rounds to 1.0 and log(1 - p) is -inf: the
    explanation quoted only float32's (17) and float16's (8) bounds, neither of which a
    logit of 7 reaches. The bounds come from each dtype's eps: log(2 / eps)."""
    m = nn.Linear(4, 2)
    with torch.no_grad():
        m.weight.zero_()
        m.bias.fill_(7.0)
    t = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    # raised as backward begins, or (read late: a GPU-bound step) as the watch ends
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(m, mode="forensic", postmortem=False) as nw,
    ):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            p = torch.sigmoid(m(torch.randn(2, 4)))
            loss = (-(t * torch.log(p) + (1 - t) * torch.log(1 - p))).sum()
        loss.backward()
    assert nw is not None
    d = info.value.diagnosis
    assert d is not None and d.code == "NW110"
    assert "5.5 in bfloat16" in d.explanation
