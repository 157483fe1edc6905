"""NW110 for a log argument in [0, 1] that no softmax made (a Gaussian survival, a ReLU
output) and one rounding below 0; NW111 for F.normalize in a file without F, a denominator
that underflowed (cumprod, elu + 1 in float16) and an observer buffer still at +inf; NW112
for an eps float16 rounds to 0; NW113 written on the user's own line.

This file binds no ``F``: the F.normalize fix must say what to import."""

from __future__ import annotations

import ast

import torch
from torch import nn
from torch.distributions import Normal

from tests._diagnoses import code_lines
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


# ------------------------------------- 1: a log of [0, 1] values is not always a softmax's


def test_log_of_a_gaussian_survival_suggests_log_ndtr_not_logits() -> None:
    torch.manual_seed(0)
    head = nn.Linear(3, 1)
    std = Normal(0.0, 1.0)

    def run() -> None:
        z = head(torch.randn(16, 3)).squeeze(-1) * 0.0 + torch.linspace(0.0, 12.0, 16)
        surv = torch.log(1 - std.cdf(z))
        (-surv.mean()).backward()

    d = _first(_raises(head, run), "NW110")
    assert "log_ndtr(-z)" in d.fix
    assert "log_softmax" not in d.fix and "logits" not in d.fix
    assert "cdf" in d.explanation


class _Concentration(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_log_of_a_relu_output_with_some_zeros_is_a_relu_not_a_probability() -> None:
    torch.manual_seed(0)
    m = _Concentration()

    def run() -> None:
        alpha = m(torch.randn(12, 4))
        (-torch.log(alpha).sum(1).mean()).backward()

    d = _first(_raises(m, run), "NW110")
    assert "ReLU output" in d.fix and "F.softplus(raw) + 1e-6" in d.fix
    assert "log_softmax" not in d.fix


def test_log_of_a_sigmoid_output_still_gets_the_logits_recipe() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())

    def run() -> None:
        p = m(torch.randn(8, 4) * 1e4)
        (-torch.log(p).mean()).backward()

    d = _first(_raises(m, run), "NW110")
    assert "logsigmoid" in d.fix.lower()


# ------------------------------------------- 5: one rounding below 0 is not a negative value


def test_log_of_one_minus_a_cumsum_one_rounding_below_zero_is_called_rounding() -> None:
    torch.manual_seed(0)
    head = nn.Linear(5, 10)

    def run() -> None:
        p = torch.softmax(head(torch.randn(64, 5)) * 10, dim=-1)
        surv = 1 - p.cumsum(-1)
        (-torch.log(surv[:, -1]).mean()).backward()

    d = _first(_raises(head, run), "NW110")
    assert "reached -" in " ".join(d.evidence)  # the cumsum rounded above 1 here
    assert "rounding" in d.explanation and "clamp_min" in d.fix
    assert "find what makes it negative" not in d.fix


# ------------------------------------------------- 2: F.normalize in a file that has no F


class _QuatHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.fc(x) * x[:, :1]
        return q / q.norm(dim=-1, keepdim=True)


def test_normalize_fix_notes_the_import_when_the_file_binds_no_f() -> None:
    m = _QuatHead()

    def run() -> None:
        x = torch.randn(4, 3)
        x[2] = 0  # a zero row: its quaternion is 0
        m(x).sum().backward()

    d = _first(_raises(m, run), "NW111")
    assert "F.normalize(q, dim=-1)" in d.fix
    assert "# needs: import torch.nn.functional as F" in d.fix


# ------------------------------------------------ 3: NW113's fix on the user's own line


class _RoiChamfer(nn.Module):
    def forward(self, pred: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        keep = pred.norm(dim=-1) < 0.5
        d = torch.cdist(pred[keep], tgt)
        return d.min(1).values.mean()


def test_nw113_fix_keeps_the_return_and_the_users_names() -> None:
    crit = _RoiChamfer()

    def run() -> None:
        pred = (torch.randn(8, 3) + 20.0).requires_grad_()
        crit(pred, torch.randn(8, 3)).backward()

    d = _first(_raises(crit, run), "NW113")
    line = d.fix.splitlines()[0]
    assert line.startswith("return d.min(1).values.sum() / max(d.min(1).values.numel(), 1)")
    assert "# was:" not in d.fix and "loss = (x * mask)" not in d.fix
    ast.parse(code_lines(d.fix).replace("return ", "y = "))


# --------------------------------------------- 4: an eps that float16 rounds to 0 is named


class _HalfRms(nn.Module):
    def __init__(self, eps: float = 1e-12) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def test_rsqrt_eps_rounded_to_zero_in_float16_names_the_dtype_limit() -> None:
    m = _HalfRms().half()

    def run() -> None:
        x = torch.randn(3, 4).half()
        x[1] = 0
        m(x).float().sum().backward()

    d = _first(_raises(m, run), "NW112")
    assert "self.eps" in d.fix and "torch.finfo(torch.float16).tiny" in d.fix
    assert "rounds to 0 in float16" in d.fix
    assert "a value above 0" not in d.fix


# ------------------------------------------- 6: a denominator that underflowed to 0


class _CumprodScan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        decay = torch.exp(-5.0 - self.fc(x).abs())
        acc = torch.cumprod(decay, dim=1)
        return acc * torch.cumsum(x / acc, dim=1)


def test_cumprod_denominator_is_called_an_underflow_with_a_log_space_fix() -> None:
    m = _CumprodScan()

    def run() -> None:
        m(torch.randn(1, 40, 2)).sum().backward()

    d = _first(_raises(m, run), "NW111")
    assert "underflow" in d.title and "cumprod" in " ".join(d.evidence)
    assert "log_acc = torch.cumsum(torch.log(decay), dim=1)" in d.fix
    assert "standard deviation" not in d.explanation


class _EluAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        phi = torch.nn.functional.elu(self.q(x)) + 1
        z = 1.0 / phi.sum(-1)
        return phi * z.unsqueeze(-1)


def test_elu_plus_one_that_rounds_to_zero_in_float16_names_the_dtype() -> None:
    m = _EluAttention().half()
    with torch.no_grad():
        m.q.bias.fill_(-12.0)
        m.q.weight.zero_()

    def run() -> None:
        m(torch.randn(2, 3, 4).half()).float().sum().backward()

    d = _first(_raises(m, run), "NW111")
    assert "underflow" in d.title and "float16" in d.explanation
    assert "elu" in " ".join(d.evidence)
    assert "+ 1e-4)" in d.fix and "float32" in d.fix
    assert "ReLU" not in d.fix


# ------------------------------------- 7: an observer buffer read while still at +inf


class _Observer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("lo", torch.tensor(float("inf")))
        self.register_buffer("hi", torch.tensor(float("-inf")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.lo.copy_(torch.minimum(self.lo, x.detach().min()))
            self.hi.copy_(torch.maximum(self.hi, x.detach().max()))
        scale = (self.hi - self.lo) / 255.0
        zp = torch.round(-self.lo / scale)
        return x / scale + zp


def test_an_uncalibrated_observer_buffer_is_named_not_a_count_division() -> None:
    m = nn.Sequential(nn.Linear(3, 3), _Observer())
    m.eval()

    def run() -> None:
        with torch.no_grad():
            m(torch.randn(2, 3))

    d = _first(_raises(m, run), "NW111")
    assert "self.lo" in d.fix and "torch.isinf(self.lo)" in d.fix
    assert "counts" not in d.fix and "class weights" not in d.explanation
    assert "register_buffer" in " ".join(d.evidence)
