"""NW101 found by user testing: a triangular solve that divides by a zero diagonal entry is
a division by zero (NW111), not an overflow; a GroupNorm with eps=0 quotes its data input,
not its weight; a float16 module's return line computed in float32 is cast back."""

from __future__ import annotations

import ast
import types
import warnings

import torch
from torch import nn

import nanwatch
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises
from tests._diagnoses import text

torch.set_num_threads(1)


# ------------------------------ 1: a zero pivot of solve_triangular is not an overflow


class _Gauss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.raw = nn.Parameter(torch.full((3, 3), 0.1))
        self.d = nn.Parameter(torch.tensor([1.0, -0.5, 1.0]))  # relu(-0.5) = 0 on the diagonal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        L = torch.tril(self.raw, -1) + torch.diag(torch.relu(self.d))
        z = torch.linalg.solve_triangular(L, x.T, upper=False)
        return z.pow(2).sum()


class _Fixed(_Gauss):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        L = torch.tril(self.raw, -1) + torch.diag(torch.nn.functional.softplus(self.d) + 1e-5)
        z = torch.linalg.solve_triangular(L, x.T, upper=False)
        return z.pow(2).sum()


def _solve(model: nn.Module) -> None:
    model(torch.randn(8, 3, generator=torch.Generator().manual_seed(0))).backward()


def test_zero_pivot_of_a_triangular_solve_is_a_division_by_zero() -> None:
    err = _raises(model := _Gauss(), lambda: _solve(model))
    d = err.diagnoses[0]
    assert d.code == "NW111" and d.title == "Division by zero"
    assert not any(x.code == "NW101" for x in err.diagnoses)
    t = text(d)
    assert "zero pivot" in t and "diagonal entry of L" in t and "not an overflow" in t
    assert "exploded" not in t and "lr" not in d.fix
    assert "torch.diag(torch.relu(self.d)) can put a 0 on the diagonal" in t
    first, ridge = d.fix.splitlines()[:2]
    want = "L = torch.tril(self.raw, -1) + torch.diag(torch.nn.functional.softplus(self.d) + 1e-5)"
    assert first.split("#", 1)[0].strip() == want
    assert ridge.startswith("# or add a ridge where it is solved: z = torch.linalg.")
    ast.parse(ridge.split(": ", 1)[1])
    with nanwatch.watch(fixed := _Fixed()):  # the fixed line: the solve stays finite
        _solve(fixed)


class _SolveAttr(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.L = nn.Parameter(torch.diag(torch.tensor([1.0, 0.0, 2.0])))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.solve_triangular(self.L, x.T, upper=False).sum()


def test_zero_pivot_without_its_construction_gets_a_ridge_on_the_line() -> None:
    err = _raises(model := _SolveAttr(), lambda: _solve(model))
    d = _first(err, "NW111")
    assert err.diagnoses[0].code == "NW111" and "zero pivot" in text(d)
    line = d.fix.splitlines()[0].split("  #", 1)[0].strip()
    assert "self.L + 1e-5 * torch.eye(self.L.shape[-1]" in line and "softplus" in d.fix
    ast.parse(line)


# ------------------------------ 2: GroupNorm eps=0 on an all-zero input quotes that input


def test_group_norm_eps0_quotes_the_all_zero_input_not_its_weight() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.GroupNorm(2, 4, eps=0.0))
    with torch.no_grad():
        model[0].weight.fill_(1.5)
    err = _raises(model, lambda: model(torch.zeros(2, 4, 3, 3)))
    d = _first(err, "NW111")
    assert "from an input of all zeros (72 values)" in d.evidence[0]
    assert "1.5" not in d.evidence[0]
    assert not any(e.startswith("input input:") for e in d.evidence)
    assert sum(e.startswith("input: min 0, max 0") for e in d.evidence) == 1
    assert any(e.startswith("input weight: min 1.5") for e in d.evidence)


# ------------------------------ 3: a float16 RMSNorm's return line upcast is cast back


class _RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def test_fp16_return_line_upcast_is_cast_back_to_the_input_dtype() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 16), _RMSNorm(16))
    with torch.no_grad():
        model[0].weight[5].fill_(400.0)  # 400 ** 2 is past float16's 65504
    model = model.half()
    idx = torch.tensor([[1, 5, 2]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nanwatch.NanwatchWarning)
        with nanwatch.watch(model, mode="forensic") as nw:
            model(idx)
            nw.step()
    ds = [d for t in nw.history for d in t.diagnoses if d.code == "NW105"]
    assert ds, "no NW105"
    alt = next(ln for ln in ds[0].fix.splitlines() if "'s forward: return" in ln)
    line = alt.split("'s forward: ", 1)[1].split(", and the tensors", 1)[0]
    assert line.endswith(".to(x.dtype)") and "x.float().pow(2)" in line
    ns: dict[str, object] = {"torch": torch}
    exec(f"def forward(self, x):\n    {line}", ns)  # the user's forward with the fix pasted
    norm = model[1]
    norm.forward = types.MethodType(ns["forward"], norm)
    out = model(idx)
    assert out.dtype == torch.float16 and bool(out.isfinite().all())
    assert float(out[0, 1].detach().abs().max()) > 0.5  # normalized, not silently 0
