"""Domain fixes: a zero norm of a Gram-Schmidt difference is floored on the norm, never on
the signed vector; a std over a 1x1 feature map is no weight standardization; a float16 eps
is limited by the smallest subnormal, and a named eps of 1e-12 is said to round to 0; an
rsqrt line gets its own input floored."""

from __future__ import annotations

import ast

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests._diagnoses import code_lines, top


def _first_fix_line(fix: str) -> str:
    return fix.splitlines()[0].split("   #", 1)[0].strip()


# ------------------------------------------------------------- 6D rotation: zero norm


class SixD(nn.Module):
    def __init__(self, layout: str = "bad") -> None:
        super().__init__()
        self.head = nn.Linear(4, 6)
        self.layout = layout
        nn.init.zeros_(self.head.weight)
        self.head.bias.data = torch.tensor([1.0, 0, 0, 0, 1, 0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.head(x)
        d6 = h.view(-1, 3, 2) if self.layout == "bad" else h.view(-1, 2, 3).transpose(1, 2)
        a1, a2 = d6[..., 0], d6[..., 1]
        b1 = a1 / a1.norm(dim=-1, keepdim=True)
        b2 = a2 - (b1 * a2).sum(-1, keepdim=True) * b1
        b2 = b2 / b2.norm(dim=-1, keepdim=True)
        b3 = torch.cross(b1, b2, dim=-1)
        return torch.stack([b1, b2, b3], dim=-1)


def test_zero_norm_of_a_gram_schmidt_difference_floors_the_norm_not_the_vector() -> None:
    model = SixD()
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(torch.randn(5, 4)).sum().backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW111"
    assert "cancelled" not in d.title and "the norm of b2 is 0" in d.title
    assert "a2 is 0 or parallel to b1" in " ".join(d.evidence)
    line = _first_fix_line(d.fix)
    assert line == "b2 = b2 / b2.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(b2.dtype).eps)"
    ast.parse(code_lines(d.fix))
    assert ".clamp_min" not in d.fix.split("b2 / ", 1)[0]  # the vector itself is not clamped
    # the floor keeps the degenerate rows finite, and a healthy model still gives rotations
    a2 = torch.zeros(3, 3)
    b1 = F.normalize(torch.randn(3, 3), dim=-1)
    b2 = a2 - (b1 * a2).sum(-1, keepdim=True) * b1
    ns = {"torch": torch, "b2": b2}
    exec(line, ns)
    assert torch.isfinite(ns["b2"]).all()
    a2 = torch.randn(3, 3)
    b2 = a2 - (b1 * a2).sum(-1, keepdim=True) * b1
    ns = {"torch": torch, "b2": b2}
    exec(line, ns)
    assert torch.allclose(ns["b2"], F.normalize(b2, dim=-1))


# ------------------------------------------------------------- AdaIN std over a 1x1 map


def calc_std(feat: torch.Tensor) -> torch.Tensor:
    n, c = feat.shape[:2]
    std = feat.view(n, c, -1).std(2).view(n, c, 1, 1)
    return std


class AdaIN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(3, 4, 3, 2, 1)

    def forward(self, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        fc, fs = self.enc(c), self.enc(s)
        return (fc - fc.mean((2, 3), keepdim=True)) * calc_std(fs)


def test_std_over_a_1x1_feature_map_is_not_called_a_weight() -> None:
    model = AdaIN()
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(torch.rand(2, 3, 8, 8), torch.rand(2, 3, 2, 2)).sum().backward()
        nw.step()
    d = top(nw)
    assert (d.code, d.op) == ("NW113", "aten.std.correction")
    said = " ".join(d.evidence)
    assert "a weight's" not in said and "fan-in" not in said and "not a weight" in said
    assert "hold one element each" in said
    assert "weight" not in d.fix and "fan-in" not in d.fix
    line = _first_fix_line(d.fix)
    assert line == (
        "std = feat.view(n, c, -1).var(2, unbiased=False).add(1e-5).sqrt().view(n, c, 1, 1)"
    )
    ast.parse(code_lines(d.fix))
    feat, n, c = torch.rand(2, 4, 1, 1), 2, 4
    ns = {"feat": feat, "n": n, "c": c}
    exec(line, ns)
    assert torch.isfinite(ns["std"]).all()


# ------------------------------------------------------------- float16 eps of 1e-12


class BertLN(nn.Module):
    def __init__(self, d: int, eps: float = 1e-12) -> None:
        super().__init__()
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        return (x - u) / torch.sqrt(s + self.variance_epsilon)


def test_float16_eps_limit_is_the_smallest_subnormal_and_1e_12_is_named() -> None:
    model = BertLN(8)
    x = torch.randn(2, 8, dtype=torch.float16)
    x[0] = 0
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(x)
        nw.step()
    d = top(nw)
    assert d.code == "NW111"
    assert "eps=1e-12 rounds to 0 in float16" in d.title
    assert "6.1e-05 (torch.finfo(torch.float16).tiny) to count" not in d.fix
    assert "5.96e-08" in d.fix and "smallest_normal" in d.fix
    ast.parse(code_lines(d.fix))
    # the stated limit is true: 1e-5 counts in float16, 1e-12 does not
    assert torch.tensor(0.0, dtype=torch.float16) + 1e-5 > 0
    assert torch.tensor(1e-12, dtype=torch.float16) == 0


# ------------------------------------------------------------- ZCA whitening's rsqrt


class ZCA(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xc = x - x.mean(0, keepdim=True)
        cov = xc.T @ xc / (x.shape[0] - 1)
        L, V = torch.linalg.eigh(cov)
        W = V @ torch.diag(L.rsqrt()) @ V.T
        return xc @ W


def test_rsqrt_fix_floors_the_users_own_rsqrt_input() -> None:
    torch.manual_seed(0)
    model = ZCA()
    x = torch.randn(4, 8)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(x)
        nw.step()
    d = top(nw)
    assert d.code == "NW112"
    line = _first_fix_line(d.fix)
    assert line == "W = V @ torch.diag(L.clamp_min(1e-5).rsqrt()) @ V.T"
    assert "sqrt(v" not in d.fix and "rsqrt(v" not in d.fix
    xc = x - x.mean(0, keepdim=True)
    L, V = torch.linalg.eigh(xc.T @ xc / 3)
    ns = {"torch": torch, "L": L, "V": V}
    exec(line, ns)
    assert torch.isfinite(ns["W"]).all()
