"""Recommender and tabular training failures: a standardization of the whole table with a
constant feature column (its std is 0: that column is 0/0 = NaN in every row) was told,
outside forensic mode, as "whole samples are non-finite ... a per-sample norm" with a fix
for a per-sample divisor; a two-tower cosine similarity written by hand,
``(u * v).sum(-1) / (u.norm(dim=-1) * v.norm(dim=-1))``, at a zero item vector got a
``clamp_min(torch.finfo((u.norm(dim=-1) * v.norm(dim=-1)).dtype).eps)`` fix instead of
``F.cosine_similarity``; and a standardization inside the model over the batch dim spoke
of "a row that does not vary" for a constant feature column."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

torch.set_num_threads(1)


def _line_of(snippet: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if snippet in line)


# ------------------------------------ a constant column standardized by the whole table


def _tabular(mode: str, *, fixed: bool = False) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    X, Y = torch.randn(256, 6), torch.randn(256)
    X[:, 2] = 3.0  # a feature that never varies in this table
    with nanwatch.watch(m, mode=mode, postmortem=False) as nw:
        mean, std = X.mean(0), X.std(0)
        if fixed:
            std = torch.where(std > 0, std, torch.ones_like(std))
        Xn = (X - mean) / std
        for step in range(3):
            xb, yb = Xn[step * 64 : (step + 1) * 64], Y[step * 64 : (step + 1) * 64]
            loss = F.mse_loss(m(xb).squeeze(-1), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_a_constant_column_standardized_is_told_as_a_column_not_whole_samples(mode: str) -> None:
    with pytest.raises(nanwatch.AnomalyError) as info:
        _tabular(mode)
    d = info.value.diagnoses[0]
    assert d.code == "NW401"
    body = "\n".join(d.evidence)
    assert "feature column 2 is non-finite in every sample" in body
    assert "whole samples" not in body and "per-sample" not in body
    assert "constant column" in d.explanation
    assert "std = torch.where(std > 0, std, torch.ones_like(std))" in d.fix
    assert "print((~torch.isfinite(xb)).all(dim=0).nonzero().flatten().tolist())" in d.fix
    assert "x / s.clamp_min" not in d.fix


def test_forensic_names_the_standardization_line() -> None:
    with pytest.raises(nanwatch.AnomalyError) as info:
        _tabular("forensic")
    d = info.value.diagnoses[0]
    assert d.code == "NW111"
    body = "\n".join(d.evidence)
    assert f"test_unseen_s6_tabular.py:{_line_of('Xn = (X - mean) / std')}" in body


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_the_standardization_the_fix_gives_trains_clean(mode: str) -> None:
    _tabular(mode, fixed=True)


def test_a_per_sample_division_is_still_told_as_whole_samples() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8))
    x = torch.randn(16, 6)
    x[3] = 0.0  # an all-zero sample
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(m, mode="watch", postmortem=False) as nw,
    ):
        xn = x / x.norm(dim=1, keepdim=True)
        m(xn).sum().backward()
        nw.step()
    d = info.value.diagnoses[0]
    assert d.code == "NW401"
    body = "\n".join(d.evidence)
    assert "whole samples are non-finite" in body
    assert "the other columns are finite" not in body


# ------------------------------------ a two-tower cosine similarity written by hand


class _TwoTower(nn.Module):
    def __init__(self, *, builtin: bool = False) -> None:
        super().__init__()
        self.user = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.item = nn.Embedding(100, 16)
        self.builtin = builtin

    def forward(self, uf: torch.Tensor, it: torch.Tensor) -> torch.Tensor:
        u, v = self.user(uf), self.item(it)
        if self.builtin:
            return F.cosine_similarity(u, v, dim=-1)
        return (u * v).sum(-1) / (u.norm(dim=-1) * v.norm(dim=-1))


def _two_tower(mode: str, *, builtin: bool = False) -> None:
    torch.manual_seed(0)
    m = _TwoTower(builtin=builtin)
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    with nanwatch.watch(m, mode=mode, postmortem=False) as nw:
        for step in range(3):
            uf, it, y = torch.randn(32, 8), torch.randint(0, 100, (32,)), torch.rand(32)
            if step == 2:
                with torch.no_grad():
                    m.item.weight[it[3]] = 0.0  # an item row zeroed (a padding row)
            loss = F.mse_loss(m(uf, it), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_a_cosine_by_hand_at_a_zero_vector_gets_the_builtin(mode: str) -> None:
    with pytest.raises(nanwatch.AnomalyError) as info:
        _two_tower(mode)
    d = info.value.diagnoses[0]
    assert d.code == "NW111"
    line = d.fix.splitlines()[0]
    assert line.startswith("return F.cosine_similarity(u, v, dim=-1)   #")
    assert "a zero vector gives 0, not 0/0" in line
    assert "finfo((" not in d.fix
    # the fix, as pasted, is finite at the zero vector, forward and backward
    u = torch.randn(4, 16, requires_grad=True)
    v = torch.randn(4, 16)
    v[1] = 0.0
    v.requires_grad_(True)
    out = F.cosine_similarity(u, v, dim=-1)
    out.sum().backward()
    assert out[1] == 0 and torch.isfinite(out).all()
    assert u.grad is not None and v.grad is not None
    assert torch.isfinite(u.grad).all() and torch.isfinite(v.grad).all()


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_the_builtin_cosine_trains_clean(mode: str) -> None:
    _two_tower(mode, builtin=True)


def test_a_cosine_in_float16_gets_an_eps_the_dtype_holds() -> None:
    class _Half(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return (a * b).sum(dim=1) / (torch.linalg.vector_norm(a, dim=1) * b.norm(dim=1))

    m = _Half()
    a = torch.randn(4, 8, dtype=torch.float16)
    b = torch.randn(4, 8, dtype=torch.float16)
    a[2] = 0.0
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(m, mode="forensic", postmortem=False) as nw,
    ):
        m(a, b).float().sum()
        nw.step()
    d = info.value.diagnoses[0]
    assert d.code == "NW111"
    line = d.fix.splitlines()[0]
    assert line.startswith("return F.cosine_similarity(a, b, dim=1, eps=1e-4)   #")
    assert "the default eps 1e-8 is 0 in float16" in line
    assert F.cosine_similarity(a, b, dim=1, eps=1e-4)[2] == 0


# ------------------------------------ a standardization in the model over the batch dim


class _Standardize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        std = x.std(0, keepdim=True)
        x = (x - x.mean(0, keepdim=True)) / std
        return self.net(x).squeeze(-1)


def test_a_constant_feature_in_a_batch_standardization_is_called_a_column() -> None:
    torch.manual_seed(0)
    m = _Standardize()
    x = torch.randn(64, 6)
    x[:, 4] = 1.0
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(m, mode="watch", postmortem=False) as nw,
    ):
        F.mse_loss(m(x), torch.randn(64)).backward()
        nw.step()
    d = info.value.diagnoses[0]
    assert d.code == "NW111"
    assert d.fix.startswith("std = torch.sqrt(x.var(0, keepdim=True) + 1e-5)")
    assert "a feature column that does not vary (1 of 6 here)" in d.fix
    assert "a row" not in d.fix
