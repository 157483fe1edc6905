"""A log of a product with a sqrt of 0 in it (a bivariate Gaussian's normalizer with
rho = +-1): the forward op that made the -inf is the log, not the sqrt (whose result, 0,
is finite; only its gradient is inf); a log of a product of numbers and names is not
taken apart into torch.log(2) (torch.log takes no Python number)."""

from __future__ import annotations

import ast
import math

import pytest
import torch
from torch import nn

from nanwatch.rules.domain import _log_expanded
from tests._diagnoses import code_lines
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _run(m: Head, x: torch.Tensor) -> None:
    o = m(x)
    sx, sy = o[:, 0].exp(), o[:, 1].exp()
    one_m = 1 - torch.tanh(o[:, 2] * 0 + 12.0) ** 2  # rho saturated: exactly 0 in float32
    nll = torch.log(2 * math.pi * sx * sy * torch.sqrt(one_m))
    nll.mean().backward()


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_the_log_of_a_sqrt_of_zero_is_the_log(mode: str) -> None:
    torch.manual_seed(0)
    m, x = Head(), torch.randn(8, 4)
    err = _raises(m, lambda: _run(m, x), mode)
    a = err.anomaly
    assert a is not None and a.op is not None
    assert a.op.op.startswith("aten.log"), a.summary
    assert err.diagnosis is not None and err.diagnosis.code == "NW110"
    assert "torch.log(2)" not in err.diagnosis.fix
    ast.parse(code_lines(err.diagnosis.fix))


def test_numbers_in_a_log_of_a_product_stay_numbers() -> None:
    node = ast.parse("2 * math.pi * s ** 2", mode="eval").body
    out = _log_expanded(node, "log")
    assert out == "math.log(2 * math.pi) + 2 * torch.log(s)"
    s = torch.tensor([1e-30, 3.0])
    got = eval(out, {"math": math, "torch": torch, "s": s})  # the fix, pasted
    assert torch.allclose(got, torch.log(2 * math.pi * s.double() ** 2).float())
    plain = ast.parse("3.0 * s ** 2", mode="eval").body
    assert _log_expanded(plain, "log") == f"{math.log(3.0)!r} + 2 * torch.log(s)"
    assert _log_expanded(ast.parse("2 * s * t", mode="eval").body, "log") is None
