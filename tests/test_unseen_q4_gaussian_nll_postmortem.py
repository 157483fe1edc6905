"""A probabilistic forecaster (mean and variance heads) trained with GaussianNLLLoss whose
variance is a raw Linear output: torch raises ``ValueError: var has negative
entry/entries``. The user's exception comes out unchanged; the post-mortem names it a
negative variance and leads with the positive parameterization, not a generic line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

torch.set_num_threads(1)


class _MeanVar(nn.Module):
    def __init__(self, positive: bool = False) -> None:
        super().__init__()
        self.rnn = nn.GRU(1, 16, batch_first=True)
        self.mu = nn.Linear(16, 1)
        self.var = nn.Linear(16, 1)
        self.positive = positive

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, _ = self.rnn(x)
        var = self.var(h)
        return self.mu(h), F.softplus(var) + 1e-6 if self.positive else var


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 20, 1, generator=g), torch.randn(8, 20, 1, generator=g)


def _error(directory: Path) -> dict:
    (path,) = sorted(directory.glob("*.json"))
    return json.loads(path.read_text())["error"]


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
@pytest.mark.parametrize("functional", [False, True])
def test_a_negative_variance_is_named_with_its_positive_parameterization(
    tmp_path: Path, mode: str, functional: bool
) -> None:
    torch.manual_seed(0)
    model, crit = _MeanVar(), nn.GaussianNLLLoss()
    with torch.no_grad():
        model.var.bias.fill_(-1.0)  # negative variances from the first step
    x, y = _batch()
    with (
        pytest.raises(ValueError, match="var has negative entry/entries"),
        nanwatch.watch(model, crit, mode=mode, report_dir=str(tmp_path)),  # type: ignore[arg-type]
    ):
        mu, var = model(x)
        loss = F.gaussian_nll_loss(mu, y, var) if functional else crit(mu, y, var)
        loss.backward()
    err = _error(tmp_path)
    assert err["class"] == "negative-variance"
    assert err["advice"].startswith("GaussianNLLLoss (F.gaussian_nll_loss) got a var with")
    assert "var = F.softplus(raw) + 1e-6" in err["advice"].split(". ")[0]


def test_a_positive_variance_trains_clean(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, crit = _MeanVar(positive=True), nn.GaussianNLLLoss()
    with torch.no_grad():
        model.var.bias.fill_(-1.0)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with nanwatch.watch(model, crit, report_dir=str(tmp_path)) as nw:
        for _ in range(3):
            x, y = _batch()
            mu, var = model(x)
            loss = crit(mu, y, var)
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    assert nw.report.diagnoses == []
    assert not list(tmp_path.glob("*.json"))
