"""Domain fixes found by user testing: a log of a running sum of exps becomes logcumsumexp in
the user's names, a power whose exponent requires grad is NaN in backward at base 0, log1p of
a signed amount, a size minus 1 as a divisor, the mean of an empty slice."""

from __future__ import annotations

import torch
from torch import nn

from tests._diagnoses import code_lines, text
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


# ------------------------------------- 1: log(cumsum(exp(risk))) -> logcumsumexp(risk, 0)


def _cox(risk: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    log_cum = torch.log(torch.cumsum(torch.exp(risk), 0))
    return -((risk - log_cum) * e).sum() / e.sum().clamp_min(1)


def test_log_of_a_cumsum_of_exp_is_logcumsumexp_in_the_users_names() -> None:
    lin = nn.Linear(3, 1)
    with torch.no_grad():
        lin.weight.zero_()
        lin.bias.fill_(-200.0)  # every exp underflows to 0 in float32

    def run() -> None:
        _cox(lin(torch.rand(6, 3)).squeeze(-1), torch.tensor([1.0, 0, 1, 0, 1, 1])).backward()

    d = _first(_raises(lin, run, "watch"), "NW110")  # the line unknown: the loss graph's
    assert "torch.logcumsumexp(a, dim)" in d.fix and not code_lines(d.fix).strip()
    assert "Normal" not in d.fix and "cumsum of exp(a)" in d.explanation
    d = _first(_raises(lin, run, "forensic"), "NW110")
    assert "log_cum = torch.logcumsumexp(risk, 0)" in d.fix
    assert "pi" not in code_lines(d.fix) and "Normal" not in d.fix
    assert "running sum" in d.explanation
    scope = {"torch": torch, "risk": torch.full((6,), -200.0)}
    exec(code_lines(d.fix), scope)
    assert torch.isfinite(scope["log_cum"]).all()


# ---------------------- 2: (t / lam) ** k with k requiring grad: 0 ** k's k-gradient is NaN


def _weibull(log_lam: torch.Tensor, log_k: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    k = torch.exp(log_k)
    lam = torch.exp(log_lam)
    z = (t / lam) ** k
    return z.sum()


def test_power_with_a_tensor_exponent_at_base_zero_is_named_and_fixed_in_log_space() -> None:
    lin = nn.Linear(3, 2)
    with torch.no_grad():
        lin.weight.zero_()
        lin.bias.copy_(torch.tensor([100.0, 0.0]))  # lam = exp(100) = inf: t / lam = 0
    t = torch.rand(4) * 10 + 1

    def run() -> None:
        o = lin(torch.rand(4, 3))
        _weibull(o[:, 0], o[:, 1], t).backward()

    d = _first(_raises(lin, run, "forensic"), "NW112")
    assert "0 · -inf = NaN" in d.explanation
    assert "sqrt" not in d.fix and "x1" not in d.fix
    assert "z = torch.exp(k * (torch.log(t) - log_lam))" in d.fix
    log_lam = torch.full((4,), 100.0)
    log_k = torch.zeros(4, requires_grad=True)
    scope = {"torch": torch, "t": t, "log_lam": log_lam, "k": torch.exp(log_k)}
    exec(code_lines(d.fix).splitlines()[0], scope)
    scope["z"].sum().backward()
    assert log_k.grad is not None and torch.isfinite(log_k.grad).all()


# ---------------------------------------------- 3: log1p of a signed amount (a refund)


class _LogFeatures(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log1p(x)


def test_log1p_of_a_negative_amount_offers_the_signed_transform() -> None:
    m = nn.Sequential(_LogFeatures(), nn.Linear(3, 1))
    amount = torch.rand(4, 3) * 100
    amount[1, 2] = -350.0

    d = _first(_raises(m, lambda: m(amount).sum().backward()), "NW110")
    assert "return torch.sign(x) * torch.log1p(x.abs())" in d.fix
    assert "p.clamp_max" not in code_lines(d.fix)  # no line with a name the user lacks
    assert "signed" in d.explanation
    for line in code_lines(d.fix).splitlines():
        compile(line.replace("return ", "y = "), "<fix>", "exec")


# ------------------------------------------------ 5: a size minus 1 that is 0 at size 1


class _Warp(nn.Module):
    def forward(self, gx: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
        H, W = gx.shape[-2:]
        gx = 2.0 * gx / (W - 1) - 1.0; gy = 2.0 * gy / (H - 1) - 1.0  # fmt: skip  # noqa: E702
        return gx + gy


def test_a_size_minus_one_divisor_is_not_called_a_micro_batch_count() -> None:
    m = _Warp()
    g = torch.zeros(1, 3, 1)  # W = 1: W - 1 = 0, and 0 / 0 = NaN

    d = _first(_raises(m, lambda: m(g, g.clone())), "NW111")
    assert "micro" not in d.explanation
    assert "size minus 1" in d.explanation and "W - 1" in d.explanation
    assert "max(W - 1, 1)" in d.fix and "max(H - 1, 1)" in d.fix
    scope = {"gx": g.clone(), "gy": g.clone(), "W": 1, "H": 3}
    exec(code_lines(d.fix), scope)
    assert torch.isfinite(scope["gx"]).all()


# ------------------------------------------------------ 6: the mean of an empty slice


class _SegmentPool(nn.Module):
    def forward(self, f: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        pooled = []
        for b in range(f.shape[0]):
            pooled.append(f[b, :, t0:t1].mean(1))
        return torch.stack(pooled)


def test_mean_of_an_empty_slice_keeps_one_element_in_the_users_slice() -> None:
    m = _SegmentPool()
    f = torch.rand(2, 4, 5)

    d = _first(_raises(m, lambda: m(f, 3, 3)), "NW113")
    assert "f[b, :, t0:max(t1, t0 + 1)].mean(1)" in d.fix
    assert "mask" not in text(d).split("\n", 1)[1] or "mask" not in d.fix
    assert "mask" not in d.fix
    assert "t1 <= t0" in d.explanation
    pooled: list[torch.Tensor] = []
    scope = {"pooled": pooled, "f": f, "b": 0, "t0": 3, "t1": 3}
    exec(code_lines(d.fix), scope)
    assert torch.isfinite(pooled[0]).all()


# ------------------------------- 7: a float16 scale that underflowed is not "0 means off"


class _FakeQuant(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.detach().abs().amax() / 127
        q = torch.clamp(torch.round(x / scale), -128, 127) * scale
        return x + (q - x).detach()


def test_a_float16_scale_that_underflowed_is_named_and_floored_where_it_is_made() -> None:
    m = _FakeQuant()
    x = torch.tensor([0.0, 5e-7, -9e-7, 2e-7], dtype=torch.float16)  # amax / 127 < 3e-8

    d = _first(_raises(m, lambda: m(x)), "NW111")
    assert "means off: the operation is skipped" not in d.fix
    assert "underflowed" in d.explanation
    assert any("smallest subnormal" in e for e in d.evidence)
    first = code_lines(d.fix).splitlines()[0]
    assert first.startswith("scale = (x.detach().abs().amax() / 127).clamp_min(")
    scope = {"torch": torch, "x": x}
    exec(first, scope)
    assert torch.isfinite(x / scope["scale"]).all()


# ------------------- 8: acosh at its endpoint: the range printed with enough digits


class _Acosh(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.acosh(x)


def test_acosh_endpoint_evidence_shows_the_max_above_one() -> None:
    m = _Acosh()
    x = torch.tensor([1.0, 1.0000129, 1.5], requires_grad=True)

    d = _first(_raises(m, lambda: m(x * 1).sum().backward()), "NW114")
    line = next(e for e in d.evidence if e.startswith("backward input self"))
    assert "max 1.5" in line and "min 1," in line
    assert "not every value is on the edge" in line


def test_acosh_endpoint_evidence_has_the_digits_of_a_max_near_one() -> None:
    m = _Acosh()
    x = torch.tensor([1.0, 1.0000129, 1.0000002], requires_grad=True)

    d = _first(_raises(m, lambda: m(x * 1).sum().backward()), "NW114")
    line = next(e for e in d.evidence if e.startswith("backward input self"))
    assert "max 1.00001287" in line, line


# --------------- 4: a buffer divisor (self.scale) is clamped where it is filled, not per use


class _Observer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("min_val", torch.tensor(0.0))
        self.register_buffer("max_val", torch.tensor(0.0))
        self.register_buffer("scale", torch.tensor(1.0))
        self.register_buffer("zero_point", torch.tensor(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.min_val.copy_(x.min())
            self.max_val.copy_(x.max())
            scale = (self.max_val - self.min_val) / 255
            self.scale.copy_(scale)
            self.zero_point.copy_(-torch.round(self.min_val / self.scale))
        q = torch.clamp(torch.round(x / self.scale) + self.zero_point, 0, 255)
        return x + ((q - self.zero_point) * self.scale - x).detach()


def test_a_buffer_divisor_is_clamped_where_it_is_filled() -> None:
    m = _Observer()

    d = _first(_raises(m, lambda: m(torch.zeros(4, 3))), "NW111")
    first = code_lines(d.fix).splitlines()[0]
    assert first.startswith("self.scale.copy_(scale.clamp_min(torch.finfo(self.scale.dtype).eps))")
    assert "self.min_val / self.scale.clamp_min" not in d.fix
    compile(first, "<fix>", "exec")
