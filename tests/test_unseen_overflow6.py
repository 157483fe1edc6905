"""NW101/NW102 on failures found by user testing: an HF-style additive mask at exactly
finfo.min (NW102 false alarm), a hand-written logsumexp (the fix changed its value), and
float16 attention scores that still overflow once scaled (the fix double-scaled)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn

import nanwatch

torch.set_num_threads(1)


def top(nw: Any) -> Any:
    return nw.report.diagnoses[0]


# ---------------------------------------------------------- 1: NW102 on a mask


class MaskedAttn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor, ext_mask: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, -1)
        return ((q @ k.transpose(-1, -2)) / 8**0.5 + ext_mask).softmax(-1) @ x


def _headroom_codes(dtype: torch.dtype, fill: float) -> list[str]:
    torch.manual_seed(0)
    m = MaskedAttn().to(dtype)
    am = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    ext = (1.0 - am[:, None, :].to(dtype)) * fill
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with nanwatch.watch(m, postmortem=False) as nw:
            out = m(torch.randn(2, 4, 8, dtype=dtype), ext)
            out.float().pow(2).mean().backward()
            nw.step()
    assert bool(out.isfinite().all())
    return [d.code for d in nw.report.diagnoses] + [str(x.message) for x in w]


def test_an_additive_mask_at_finfo_min_is_no_headroom_warning() -> None:
    for dtype in (torch.bfloat16, torch.float16):
        found = _headroom_codes(dtype, torch.finfo(dtype).min)
        assert not any("NW102" in c for c in found), (dtype, found)


def test_a_value_near_but_below_finfo_max_still_warns() -> None:
    found = _headroom_codes(torch.float16, 0.9 * torch.finfo(torch.float16).min)
    assert "NW102" in found


# ---------------------------------------------------------- 2: a hand-written logsumexp


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lin(x)
        z = torch.log(torch.exp(logits).sum(-1)) ** 2
        return z.mean()


def test_a_hand_written_logsumexp_is_fixed_with_torch_logsumexp() -> None:
    torch.manual_seed(0)
    m = Router()
    with torch.no_grad():
        m.lin.weight.mul_(100)
    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        m(torch.randn(8, 4)).backward()
        nw.step()
    d = top(nw)
    assert (d.code, d.op) == ("NW101", "aten.exp")
    first = d.fix.splitlines()[0]
    assert first.startswith("z = torch.logsumexp(logits, -1) ** 2  # was: ")
    assert "amax" not in d.fix
    # pasted, it gives the value of the original formula, and stays finite where that overflows
    x = torch.tensor([[3.0, 1.0, 0.5, -2.0]])
    ns: dict[str, Any] = {"torch": torch, "logits": x}
    exec(first, ns)
    assert math.isclose(ns["z"].item(), (torch.log(torch.exp(x).sum(-1)) ** 2).item(), rel_tol=1e-5)
    ns["logits"] = x * 100
    exec(first, ns)
    assert bool(torch.isfinite(ns["z"]).all())


def test_logsumexp_line_forms() -> None:
    from nanwatch.rules.overflow import _logsumexp_line

    assert _logsumexp_line("lse = torch.log(torch.sum(torch.exp(s), dim=1))") == (
        "lse = torch.logsumexp(s, dim=1)"
    )
    assert _logsumexp_line("t = (a - b).exp().sum().log()") == (
        "t = torch.logsumexp((a - b).flatten(), 0)"
    )
    assert _logsumexp_line("p = torch.exp(s) / torch.exp(s).sum(-1, keepdim=True)") is None


# ---------------------------------------------------------- 3: float16 attention scores


class Attn(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.d = d
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.q(x), self.k(x)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(self.d)
        return s.softmax(-1) @ x


def _attn_fix(gain: float, scale: float, d: int = 16) -> tuple[Any, Attn, torch.Tensor]:
    torch.manual_seed(0)
    m = Attn(d)
    with torch.no_grad():
        m.q.weight.mul_(gain)
        m.k.weight.mul_(gain)
        if d > 16:  # q and k alike: self-similar rows, each score a sum of d like-signed terms
            m.k.load_state_dict(m.q.state_dict())
    m = m.half()
    x = (torch.randn(2, 8, d) * scale).half()
    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        m(x).float().mean().backward()
        nw.step()
    return top(nw), m, x


def test_scores_still_past_float16_once_scaled_are_computed_in_float32() -> None:
    d, m, x = _attn_fix(400, 1)
    assert (d.code, d.op) == ("NW101", "aten.bmm")
    first = d.fix.splitlines()[0]
    assert first.startswith(
        "s = (q.float() @ k.transpose(-1, -2).float()) / math.sqrt(self.d)  # was: "
    )
    assert "shape[-1] ** -0.5" not in d.fix and "scale before the product" not in d.fix
    assert "scaling by 1/sqrt(d) is not enough" in d.fix and "QK-norm" in d.fix
    with torch.no_grad():
        ns: dict[str, Any] = {"q": m.q(x), "k": m.k(x), "math": math, "self": m}
        exec(first, ns)
    assert bool(torch.isfinite(ns["s"]).all())


def test_prescaling_moves_the_lines_own_division_before_the_product() -> None:
    d, m, x = _attn_fix(1, 70, d=64)
    assert (d.code, d.op) == ("NW101", "aten.bmm")
    first = d.fix.splitlines()[0]
    assert first.startswith("s = (q / math.sqrt(self.d)) @ k.transpose(-1, -2)  # was: ")
    assert "a later division" not in d.fix
    with torch.no_grad():
        q, k = m.q(x), m.k(x)
        ns: dict[str, Any] = {"q": q, "k": k, "math": math, "self": m}
        exec(first, ns)
        want = (q.float() @ k.float().transpose(-1, -2)) / 8
    assert bool(torch.isfinite(ns["s"]).all())
    torch.testing.assert_close(ns["s"].float(), want, rtol=2e-2, atol=1.0)
