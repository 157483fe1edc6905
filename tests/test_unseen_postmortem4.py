"""Post-mortem of an exception that a NaN made earlier in the same step caused (a cholesky of
a 0/0 kernel matrix, an index computed from NaN), and of torch.linalg's own errors."""

from __future__ import annotations

import ast
import io
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

import nanwatch
from nanwatch.render import report_summary


def _report(directory: Path) -> dict:
    (path,) = sorted(directory.glob("*.json"))
    return json.loads(path.read_text())


def _summary(directory: Path) -> str:
    from nanwatch.report import Report

    (path,) = sorted(directory.glob("*.json"))
    out = io.StringIO()
    Console(file=out, width=400, no_color=True).print(
        report_summary(Report.load(path), [path]), soft_wrap=True
    )
    return out.getvalue()


class _GP(nn.Module):
    """An exact GP's marginal likelihood; ``raw_ls`` = -120 makes softplus 0: d2 / 0."""

    def __init__(self, raw_ls: float, raw_noise: float = -2.0) -> None:
        super().__init__()
        self.raw_ls = nn.Parameter(torch.tensor(raw_ls))
        self.raw_noise = nn.Parameter(torch.tensor(raw_noise))

    def forward(self, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ls = F.softplus(self.raw_ls)
        d2 = (X[:, None] - X[None]).pow(2).sum(-1)
        K = torch.exp(-0.5 * d2 / ls**2) + F.softplus(self.raw_noise) * torch.eye(len(X))
        L = torch.linalg.cholesky(K)
        return torch.log(torch.diagonal(L)).sum()


def test_nan_born_before_a_linalg_error_leads_the_post_mortem(tmp_path: Path) -> None:
    X, y = torch.rand(8, 2), torch.rand(8)
    model = _GP(-120.0)
    with (
        pytest.raises(torch.linalg.LinAlgError),
        nanwatch.watch(model, mode="forensic", report_dir=str(tmp_path)),
    ):
        model(X, y).backward()
    r = _report(tmp_path)
    err = r["error"]
    assert err["class"] == "linalg"
    assert err["type"] == "torch.linalg.LinAlgError"
    before = err["before"]
    assert before["op"] == "aten.div" and before["detail"] == "aten.div, 0/0"
    lines = Path(__file__).read_text().splitlines()
    line = next(i for i, ln in enumerate(lines) if ln.strip().startswith("K = torch.exp("))
    assert before["source"].endswith(f":{line + 1}")  # the K = ... line
    assert before["text"].startswith("before it raised, NaN")
    assert err["advice"].startswith("Before it raised, NaN")
    assert "(NW111)" in err["advice"]
    assert "NW111" in [d["code"] for d in r["diagnoses"]]
    assert r["anomalies"] and r["anomalies"][0]["op"]["op"] == "aten.div.Tensor"
    text = _summary(tmp_path)
    assert "! before it raised, NaN" in text and "(aten.div, 0/0)" in text
    assert "NW111" in text


def test_nan_index_before_an_index_error_is_linked(tmp_path: Path) -> None:
    """A scalar 0 divisor (v_max == v_min): b = (t - lo) / 0 is NaN, b.long() is garbage."""

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    model = Head()
    lo, hi = 2.0, 2.0
    delta = (hi - lo) / 4
    with (
        pytest.raises(IndexError),
        nanwatch.watch(model, mode="forensic", report_dir=str(tmp_path)),
    ):
        out = model(torch.rand(4, 3))
        t = torch.full((4,), lo)
        b = (t - lo) / delta
        idx = b.floor().long()
        torch.zeros(5).index_add_(0, idx, out[:, 0].detach())
    err = _report(tmp_path)["error"]
    assert err["class"] == "index-out-of-range"
    assert err["before"]["detail"] == "aten.div, 0/0"
    assert err["advice"].startswith("Before it raised, NaN was born at")
    assert "NW111" in [d["code"] for d in _report(tmp_path)["diagnoses"]]


def test_no_nan_no_before(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    with (
        pytest.raises(ValueError),
        nanwatch.watch(model, mode="forensic", report_dir=str(tmp_path)),
    ):
        model(torch.rand(2, 3)).sum().backward()
        raise ValueError("boom")
    err = _report(tmp_path)["error"]
    assert "before" not in err and err["class"] == "other"
    text = _summary(tmp_path)
    assert "are listed in the report file." in text


def test_cholesky_of_duplicate_inputs_gets_linalg_advice_and_the_jitter_fixes_it(
    tmp_path: Path,
) -> None:
    X = torch.rand(6, 2)
    X = torch.cat([X, X[:2]])  # duplicate rows: a noise of 0 makes K singular
    model = _GP(0.0, raw_noise=-200.0)
    with (
        pytest.raises(torch.linalg.LinAlgError),
        nanwatch.watch(model, report_dir=str(tmp_path)),
    ):
        model(X, torch.rand(len(X)))
    err = _report(tmp_path)["error"]
    assert err["class"] == "linalg" and err["type"] == "torch.linalg.LinAlgError"
    assert "before" not in err
    advice = err["advice"]
    assert advice.startswith("K is not positive-definite")
    assert "listed" not in advice
    assert "float64" in advice and "duplicates" in advice and "+ 1e-4" in advice
    fix = advice[advice.index("K = K +") : advice.index(", or keep")]
    ast.parse(fix)
    with torch.no_grad():  # the jitter on the line's own K makes the factorization work
        d2 = (X[:, None] - X[None]).pow(2).sum(-1)
        K = torch.exp(-0.5 * d2 / F.softplus(model.raw_ls) ** 2)
        scope = {"K": K, "torch": torch}
        exec(fix, scope)
        torch.linalg.cholesky(scope["K"].double())
    text = _summary(tmp_path)
    assert "LinAlgError (linear algebra error)" in text and "_LinAlgError" not in text


def test_singular_solve_gets_lstsq_and_ridge_with_the_lines_names(tmp_path: Path) -> None:
    model = nn.Linear(3, 3)
    A = torch.ones(3, 3)
    with pytest.raises(torch.linalg.LinAlgError), nanwatch.watch(model, report_dir=str(tmp_path)):
        b = model(torch.rand(3, 3)).detach()
        torch.linalg.solve(A, b)
    advice = _report(tmp_path)["error"]["advice"]
    assert advice.startswith("A is singular")
    assert "torch.linalg.lstsq(A, b).solution" in advice
    ridge = advice[advice.index("A + 1e-6") : advice.index(". Duplicate")]
    x = torch.linalg.solve(eval(ridge, {"A": A.double(), "torch": torch}), torch.rand(3).double())
    assert torch.isfinite(x).all()


def test_classify_linalg_messages_without_the_type() -> None:
    from nanwatch.postmortem import classify

    info = classify(RuntimeError("linalg.eigh: The algorithm failed to converge"))
    assert info["class"] == "linalg" and "float64" in info["advice"]
    assert classify(RuntimeError("boom"))["class"] == "other"
