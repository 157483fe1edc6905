"""Count and rate forecasting losses written by hand on a raw model output (``rate =
model(x)`` above the loss line): a Poisson NLL's ``torch.log(rate)`` and a Tweedie loss's
``mu.pow(1 - p)`` / ``mu.pow(2 - p)``. The fix makes the name positive where it is made,
on the user's own line, so every use of it is valid (wrapping the one use on the loss line
left the Tweedie's second power NaN)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests._diagnoses import code_lines
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)

_MODES = ["sentinel", "watch", "forensic"]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 6, generator=g), torch.poisson(torch.full((32, 1), 3.0), generator=g)


def _made_line(name: str) -> int:
    from pathlib import Path

    lines = Path(__file__).read_text().splitlines()
    return next(i + 1 for i, ln in enumerate(lines) if ln.strip() == f"{name} = model(x)")


def _poisson_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    rate = model(x)
    loss = (rate - y * torch.log(rate)).mean()
    loss.backward()


def _tweedie_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    p = 1.5
    mu = model(x)
    loss = (-y * mu.pow(1 - p) / (1 - p) + mu.pow(2 - p) / (2 - p)).mean()
    loss.backward()


@pytest.mark.parametrize("mode", _MODES)
def test_poisson_nll_on_a_raw_output_makes_the_rate_positive_where_it_is_made(mode: str) -> None:
    model = _net()
    x, y = _batch()
    with torch.no_grad():
        model[2].bias.fill_(-1.0)  # every rate negative: the first forward is NaN
    err = _raises(model, lambda: _poisson_step(model, x, y), mode)
    d = _first(err, "NW110")
    first = d.fix.splitlines()[0]
    assert first.startswith("rate = F.softplus(model(x)) + 1e-6   # at ")
    assert (
        f"test_unseen_q4_positive_where_made.py:{_made_line('rate')}, where rate is made" in first
    )
    assert any(e.startswith("rate is made at ") and "rate = model(x)" in e for e in d.evidence)
    assert "find what makes it negative" not in d.fix
    # the fix, pasted in place of the assignment, gives a finite loss
    env = {"F": F, "model": model, "x": x}
    exec(code_lines(d.fix).splitlines()[0], env)
    with torch.no_grad():
        rate = env["rate"]
        assert torch.isfinite((rate - y * torch.log(rate)).mean())


def test_tweedie_power_fix_covers_every_use_of_the_raw_output() -> None:
    model = _net()
    x, y = _batch()
    with torch.no_grad():
        model[2].bias.fill_(-1.0)
    err = _raises(model, lambda: _tweedie_step(model, x, y), "forensic")
    d = _first(err, "NW112")
    first = d.fix.splitlines()[0]
    assert first.startswith("mu = F.softplus(model(x))   # at ")
    assert f"positive_where_made.py:{_made_line('mu')}, where mu is made" in first
    env = {"F": F, "model": model, "x": x}
    exec(code_lines(d.fix).splitlines()[0], env)
    with torch.no_grad():
        mu, p = env["mu"], 1.5
        assert torch.isfinite((-y * mu.pow(1 - p) / (1 - p) + mu.pow(2 - p) / (2 - p)).mean())


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_tweedie_is_still_a_negative_power_without_the_line(mode: str) -> None:
    model = _net()
    x, y = _batch()
    with torch.no_grad():
        model[2].bias.fill_(-1.0)
    err = _raises(model, lambda: _tweedie_step(model, x, y), mode)
    assert "NW112" in [d.code for d in err.diagnoses]


def test_a_computed_rate_is_not_passed_through_softplus() -> None:
    """``rate = model(x) - 1`` is arithmetic on an output: softplus would change it."""
    model = _net()
    x, y = _batch()

    def step() -> None:
        rate = model(x) - 1.0
        loss = (rate - y * torch.log(rate)).mean()
        loss.backward()

    d = _first(_raises(model, step, "forensic"), "NW110")
    assert "F.softplus(model(x) - 1.0)" not in d.fix
    assert not any(e.startswith("rate is made at ") for e in d.evidence)


@pytest.mark.parametrize("mode", _MODES)
def test_healthy_positive_rate_trains_clean(mode: str) -> None:
    model = _net()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    with nanwatch.watch(model, mode=mode) as nw:  # type: ignore[arg-type]
        for _ in range(3):
            x, y = _batch()
            rate = F.softplus(model(x)) + 1e-6
            mu = F.softplus(model(x))
            loss = (rate - y * torch.log(rate)).mean() + (
                -y * mu.pow(-0.5) / -0.5 + mu.pow(0.5) / 0.5
            ).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    assert all(t.anomaly is None for t in nw.history)
    assert not [d for t in nw.history for d in t.diagnoses if d.severity == "error"]
