"""NW111 fixes written on the user's own division line: a renormalization over kept
experts clamped at its dtype's eps, a hand-written QK-norm replaced by F.normalize, a
masked mean's float count floored at 1, and a division guarded by torch.where whose
gradient is NaN (the double-where trick). Every fix is pasted back and run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.rules.base import Diagnosis

torch.set_num_threads(1)


def _fix_code(fix: str) -> str:
    return fix.split("   #", 1)[0].strip()


def _caught(model: nn.Module, run, mode: str = "watch") -> Diagnosis | None:
    try:
        with nanwatch.watch(model, mode=mode):
            run()
    except nanwatch.AnomalyError as e:
        return e.diagnosis
    return None


class Renorm(nn.Module):
    """Top-2 gate whose combine weights are renormalized over the kept experts."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        topv, _ = self.gate(x).softmax(-1).topk(2, -1)
        g = topv * kept
        w = g / g.sum(-1, keepdim=True)
        return w


def test_renormalization_over_kept_experts_is_clamped_on_the_users_line() -> None:
    torch.manual_seed(0)
    m = Renorm()
    x = torch.randn(6, 8)
    kept = torch.ones(6, 2)
    kept[2] = 0  # both experts of token 2 were full
    d = _caught(m, lambda: m(x, kept).sum().backward())
    assert d is not None and d.code == "NW111"
    assert d.source is not None and d.source.endswith(
        f":{Renorm.forward.__code__.co_firstlineno + 3}"
    )
    assert d.fix.startswith("w = g / g.sum(-1, keepdim=True).clamp_min(torch.finfo(g.dtype).eps)")
    assert "y = " not in d.fix and "d.dtype" not in d.fix
    g = torch.rand(6, 2) * kept
    w = eval(_fix_code(d.fix).split("=", 1)[1], {"torch": torch, "g": g})
    assert torch.isfinite(w).all() and (w[2] == 0).all()
    # healthy twin: every token keeps an expert (the gradients of the step that raised
    # dropped: read late, a GPU-bound step, the raise came after its backward wrote them)
    m.zero_grad(set_to_none=True)
    assert _caught(m, lambda: m(x, torch.ones(6, 2)).sum().backward()) is None


class QKNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.wq(x)
        q = q / q.norm(dim=-1, keepdim=True)
        return q


def test_hand_written_qk_norm_suggests_f_normalize() -> None:
    torch.manual_seed(0)
    m = QKNorm()
    x = torch.randn(2, 5, 8)
    x[1, 3] = 0  # a zero (padding) embedding: q = 0 there
    d = _caught(m, lambda: m(x).sum().backward())
    assert d is not None and d.code == "NW111"
    assert _fix_code(d.fix) == "q = F.normalize(q, dim=-1)"
    # the gradients of the step that raised dropped: read late (a GPU-bound step), the raise
    # came after its backward wrote them
    m.zero_grad(set_to_none=True)
    q = m.wq(x)
    out = eval("F.normalize(q, dim=-1)", {"F": F, "q": q})
    out.sum().backward()
    assert torch.isfinite(out).all()
    assert _caught(m, lambda: m(torch.randn(2, 5, 8)).sum().backward()) is None


class Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def forward(self, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        m = keep.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1)
        return self.proj(pooled)


def test_masked_mean_over_an_empty_row_floors_the_float_count_at_one() -> None:
    torch.manual_seed(0)
    m = Pool()
    h = torch.randn(3, 5, 4)
    keep = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    d = _caught(m, lambda: m(h, keep).sum().backward())
    assert d is not None and d.code == "NW111"
    assert _fix_code(d.fix) == "pooled = (h * m).sum(1) / m.sum(1).clamp_min(1)"


class Score(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, padding_idx=0)

    def forward(self, q_ids: torch.Tensor, c_ids: torch.Tensor) -> torch.Tensor:
        q, c = self.emb(q_ids), self.emb(c_ids)
        dot = (q * c).sum(-1)
        den = q.norm(dim=-1) * c.norm(dim=-1)
        return torch.where(den > 0, dot / den, torch.zeros_like(dot))


@pytest.mark.cpu_path(reason="reuses a .grad that the CPU path's raise inside backward kept finite")
def test_where_guarded_division_names_the_discarded_branch_gradient() -> None:
    torch.manual_seed(0)
    m = Score()
    d = _caught(
        m,
        lambda: m(torch.tensor([0, 2, 3]), torch.tensor([1, 4, 5])).sum().backward(),
        mode="forensic",
    )
    assert d is not None and d.code == "NW111"
    assert "torch.where does not stop the gradient" in d.explanation
    assert _fix_code(d.fix) == (
        "return torch.where(den > 0, dot / torch.where(den > 0, den, 1), torch.zeros_like(dot))"
    )
    # the fix, pasted, gives finite gradients
    q = m.emb(torch.tensor([0, 2, 3]))
    c = m.emb(torch.tensor([1, 4, 5]))
    dot = (q * c).sum(-1)
    den = q.norm(dim=-1) * c.norm(dim=-1)
    out = torch.where(den > 0, dot / torch.where(den > 0, den, 1), torch.zeros_like(dot))
    out.sum().backward()
    assert torch.isfinite(m.emb.weight.grad).all()
    m.zero_grad()
    healthy = lambda: m(torch.tensor([1, 2, 3]), torch.tensor([1, 4, 5])).sum().backward()  # noqa: E731
    assert _caught(m, healthy, mode="forensic") is None


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("y = x / x.norm(dim=1, keepdim=True)", "y = F.normalize(x, dim=1)"),
        ("y = x / x.norm(dim=1)", None),  # no keepdim: F.normalize would not broadcast the same
        ("y = x / x.norm(p=1, dim=1, keepdim=True)", None),
    ],
)
def test_normalize_rewrite_only_for_an_l2_norm_with_keepdim(
    code: str, expected: str | None
) -> None:
    from nanwatch.rules.domain import _normalize_fix, _one_division

    one = _one_division(code)
    assert one is not None
    assert _normalize_fix(*one) == expected
