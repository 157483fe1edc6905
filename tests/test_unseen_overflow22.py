"""Overflow fixes for a value the root's own forward code made and handed to a child: the
root is reached as ``model``, never as ``model.<ClassName>`` (no such attribute)."""

from __future__ import annotations

import ast
import re

import torch
import torch.nn.functional as F
from torch import nn

from tests._diagnoses import code_lines
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


class Sharpen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, tau: float) -> torch.Tensor:
        return self.out(self.fc(x) / tau)  # float16: past 65504 at a tiny tau


def test_a_root_made_overflow_fix_does_not_name_the_root_by_its_class() -> None:
    torch.manual_seed(0)
    m = Sharpen().half()
    x = (torch.randn(4, 8) * 4).half()

    def run() -> None:
        m(x, 1e-5).float().sum().backward()

    err = _raises(m, run, "watch")
    (d,) = [d for d in err.diagnoses if d.code == "NW101"][:1]
    assert d.path == "Sharpen"
    assert "model.Sharpen" not in d.fix
    ast.parse(code_lines(d.fix))
    assert "tau.float()" not in d.fix, "tau is a Python float: no .float() method"
    assert "self.fc(x) / max(tau, 0.001)" in d.fix, d.fix
    assert "float16's largest value" in d.fix


def test_the_floored_temperature_keeps_the_quotient_finite() -> None:
    torch.manual_seed(0)
    m = Sharpen().half()
    x = (torch.randn(4, 8) * 4).half()
    tau = 1e-5
    out = m.out(m.fc(x) / max(tau, 0.001))  # the fix, pasted
    assert torch.isfinite(out).all()


class GumbelHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, tau: float) -> torch.Tensor:
        return self.out(F.gumbel_softmax(self.fc(x), tau=tau, hard=True))


def test_a_python_number_divisor_inside_a_library_call_is_named_by_its_value() -> None:
    torch.manual_seed(0)
    m = GumbelHead().half()
    x = (torch.randn(4, 8) * 4).half()

    def run() -> None:
        m(x, 1e-5).float().sum().backward()

    err = _raises(m, run, "forensic")
    (d,) = [d for d in err.diagnoses if d.code == "NW101"][:1]
    assert "by the Python number 1e-05" in d.fix, d.fix
    assert "float16's largest value" in d.fix
    floor = float(re.search(r"floor it at ([\d.e-]+)", d.fix).group(1))  # type: ignore[union-attr]
    assert floor * torch.finfo(torch.float16).max > 4 * 4  # a real floor, with room
    assert "model.GumbelHead" not in d.fix
