"""A Gaussian forecaster whose model returns two outputs, unpacked on one line (``mu,
sigma = model(x)``), then a hand-written NLL with ``torch.log(sigma)``: the fix makes the
element positive on a new line right after the unpacking (``sigma = F.softplus(sigma) +
1e-6``), which covers every use of it. And a file that binds ``F`` on a shared import line
(``import torch, torch.nn.functional as F``) gets fixes spelled ``F.``."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.rules.domain import _binds_f
from tests._diagnoses import code_lines
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.mu = nn.Linear(16, 1)
        self.sigma = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.mu(h), self.sigma(h)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 6, generator=g), torch.randn(32, 1, generator=g)


def _unpacking_line() -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i + 1 for i, ln in enumerate(lines) if ln.strip() == "mu, sigma = model(x)")


def _gaussian_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    mu, sigma = model(x)
    loss = (torch.log(sigma) + (y - mu) ** 2 / (2 * sigma**2)).mean()
    loss.backward()


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_unpacked_scale_is_made_positive_right_after_the_unpacking(mode: str) -> None:
    model = _TwoHeads()
    x, y = _batch()
    with torch.no_grad():
        model.sigma.bias.fill_(-2.0)  # every sigma negative: the first forward is NaN
    err = _raises(model, lambda: _gaussian_step(model, x, y), mode)
    d = _first(err, "NW110")
    first = d.fix.splitlines()[0]
    assert first.startswith("sigma = F.softplus(sigma) + 1e-6   # a new line right after ")
    assert f"unpacked_positive.py:{_unpacking_line()} (mu, sigma = model(x))" in first
    assert "F.softplus(model(x))" not in d.fix
    assert any(
        e.startswith("sigma is made at ") and "mu, sigma = model(x)" in e for e in d.evidence
    )
    # the fix, pasted right after the unpacking, gives a finite loss
    env = {"F": F, "model": model, "x": x}
    exec("mu, sigma = model(x)\n" + code_lines(d.fix).splitlines()[0], env)
    with torch.no_grad():
        mu, sigma = env["mu"], env["sigma"]
        assert torch.isfinite((torch.log(sigma) + (y - mu) ** 2 / (2 * sigma**2)).mean())


def test_an_unpacked_name_reassigned_below_is_not_the_unpacking() -> None:
    """``sigma = sigma - 1`` after the unpacking: arithmetic, softplus would change it."""
    model = _TwoHeads()
    x, y = _batch()
    with torch.no_grad():
        model.sigma.bias.fill_(3.0)

    def step() -> None:
        mu, sigma = model(x)
        sigma = sigma - 10.0
        loss = (torch.log(sigma) + (y - mu) ** 2).mean()
        loss.backward()

    d = _first(_raises(model, step, "forensic"), "NW110")
    assert "F.softplus(sigma)" not in d.fix
    assert not any(e.startswith("sigma is made at ") for e in d.evidence)


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_healthy_unpacked_positive_scale_trains_clean(mode: str) -> None:
    model = _TwoHeads()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    with nanwatch.watch(model, mode=mode) as nw:  # type: ignore[arg-type]
        for _ in range(3):
            x, y = _batch()
            mu, sigma = model(x)
            sigma = F.softplus(sigma) + 1e-6
            loss = (torch.log(sigma) + (y - mu) ** 2 / (2 * sigma**2)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    assert all(t.anomaly is None for t in nw.history)
    assert not [d for t in nw.history for d in t.diagnoses if d.severity == "error"]


@pytest.mark.parametrize(
    "imports",
    [
        "import torch, torch.nn.functional as F",
        "import math, torch.nn.functional as F",
        "from torch.nn import init, functional as F",
        "from torch.nn import (\n    init,\n    functional as F,\n)",
        "from torch import nn\nF = nn.functional",
    ],
)
def test_every_import_form_that_binds_f_is_seen(tmp_path: Path, imports: str) -> None:
    path = tmp_path / "train_bind.py"
    path.write_text(f"{imports}\n\nx = 1\n")
    assert _binds_f(f"{path}:4")


@pytest.mark.parametrize(
    "imports",
    ["import torch", "import torch.nn.functional as Fn", "# import torch.nn.functional as F"],
)
def test_a_file_without_f_is_not_taken_to_bind_it(tmp_path: Path, imports: str) -> None:
    path = tmp_path / "train_nobind.py"
    path.write_text(f"{imports}\n\nx = 1\n")
    assert not _binds_f(f"{path}:3")


def test_shared_import_line_gets_fixes_spelled_with_f(tmp_path: Path) -> None:
    path = tmp_path / "r1_forecast.py"
    path.write_text(
        textwrap.dedent(
            """\
            import torch, torch.nn.functional as F


            def step(model, x, y):
                rate = model(x)
                loss = (rate - y * torch.log(rate)).mean()
                loss.backward()
            """
        )
    )
    spec = importlib.util.spec_from_file_location("r1_forecast", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["r1_forecast"] = mod
    try:
        spec.loader.exec_module(mod)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
        with torch.no_grad():
            model[2].bias.fill_(-1.0)
        x, _ = _batch()
        y = torch.poisson(torch.full((32, 1), 3.0))
        d = _first(_raises(model, lambda: mod.step(model, x, y), "forensic"), "NW110")
    finally:
        del sys.modules["r1_forecast"]
    assert d.fix.splitlines()[0].startswith("rate = F.softplus(model(x)) + 1e-6")
    assert "torch.nn.functional." not in d.fix
