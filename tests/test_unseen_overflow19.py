"""A float16 exp whose result Sinkhorn-Knopp normalizes over other dims (SwAV's
Q = exp(out / eps).t()): NW101's fix is the exp in float32, not a row max subtracted in
float16 (a row of underflowed zeros divides 0 / 0); and NW100 on the NaN tensor made without
gradients says how to find the op, not to clamp a denominator nothing showed."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import torch
from torch import nn

from tests._diagnoses import code_lines
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)

DT = torch.float16


@torch.no_grad()
def sinkhorn(out: torch.Tensor, eps: float = 0.05, iters: int = 3) -> torch.Tensor:
    Q = torch.exp(out.to(DT) / eps).t()
    Q /= Q.sum()
    K, B = Q.shape
    for _ in range(iters):
        Q /= Q.sum(dim=1, keepdim=True)
        Q /= K
        Q /= Q.sum(dim=0, keepdim=True)
        Q /= B
    return (Q * B).t()


def _scores() -> torch.Tensor:
    """Unit vectors against unit prototypes: cosines up to ~0.9, / eps = 18 > 11.09; the
    last prototype is far from every sample (cosine -0.9: never a row's max)."""
    g = torch.Generator().manual_seed(0)
    z = nn.functional.normalize(torch.randn(32, 8, generator=g), dim=1)
    w = nn.functional.normalize(torch.randn(10, 8, generator=g), dim=1)
    s = z @ w.t()
    s[:, -1] = -0.9
    return s


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _run(m: _Model) -> None:
    s = m(torch.randn(32, 4)) * 0.0 + _scores()
    q = sinkhorn(s.detach())
    loss = -(q.float() * torch.log_softmax(s / 0.1, 1)).sum(1).mean()
    loss.backward()


def _pasted(fix: str) -> Any:
    """sinkhorn with its exp line replaced by the fix's first code line."""
    src = textwrap.dedent(inspect.getsource(sinkhorn))
    old = next(ln for ln in src.splitlines() if "torch.exp(" in ln)
    new = code_lines(fix).splitlines()[0].split("  #", 1)[0]
    ast.parse(new)
    body = src.replace(old.strip(), new)
    ns: dict[str, Any] = {"torch": torch, "DT": DT}
    exec(body, ns)
    return ns["sinkhorn"]


def test_a_float16_exp_normalized_by_sinkhorn_is_computed_in_float32_not_max_shifted() -> None:
    torch.manual_seed(0)
    m = _Model()
    d = _first(_raises(m, lambda: _run(m), "forensic"), "NW101")
    assert d.op == "aten.exp"
    first = code_lines(d.fix).splitlines()[0]
    assert first.startswith("Q = torch.exp(out.to(DT).float() / eps).t()"), d.fix
    assert "amax" not in d.fix and "the result is the same" not in d.fix, d.fix
    assert "torch.softmax" not in d.fix, d.fix
    assert "sums over every value, dim=1, dim=0" in d.fix and "0 / 0" in d.fix, d.fix
    # pasted: finite, and Sinkhorn's float32 result
    out = _scores()
    q = _pasted(d.fix)(out)
    assert torch.isfinite(q).all()
    ref = _pasted("Q = torch.exp(out.float() / eps).t()")(out)
    assert (q.float() - ref).abs().max() < 1e-2
    # the max-subtracted float16 line, for contrast: 0 / 0 where a row underflows
    shifted = "Q = torch.exp((out.to(DT) / eps) - (out.to(DT) / eps).amax(-1, keepdim=True)).t()"
    assert not torch.isfinite(_pasted(shifted)(out)).all()


def test_the_nan_of_a_tensor_made_without_gradients_gets_no_denominator_clamp() -> None:
    torch.manual_seed(0)
    m = _Model()
    for mode in ("watch", "sentinel"):
        d = _first(_raises(m, lambda: _run(m), mode), "NW100")
        assert "computed without gradients" in d.title
        assert "clamp_min" not in d.fix and "denominator that reaches 0" not in d.fix, d.fix
        assert "mode='forensic'" in d.fix and "nw.replay" in d.fix, d.fix
        assert "inf / inf" in d.fix and "overflowed" in d.fix, d.fix
        assert "inf / inf" in d.explanation


def test_an_exp_softmax_by_hand_over_its_own_sum_keeps_the_row_max() -> None:
    from nanwatch.rules.overflow import _other_dims

    assert _other_dims("p = torch.exp(x) / torch.exp(x).sum(-1, keepdim=True)", "exp", None) is None
    assert _other_dims("e = torch.exp(x)", "exp", None) is None
    assert _other_dims("e = torch.exp(x).t()", "exp", None) == "a transpose"
