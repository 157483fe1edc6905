"""A variance computed as E[x²] - E[x]² inside a module's own code, of values that the
module itself moved far from 0 (an offset, a large constant): the negative "variance" is
rounding noise of the subtraction's operands, seen op by op, though no recorded module
input or output is large. It was called 'far below 0: not rounding', with a clamp fix that
turns the NaN into inf."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests._diagnoses import top


class OffsetVar(nn.Module):
    """Features moved to 1000 + small, normalized by sqrt(E[h²] - E[h]²)."""

    def __init__(self, eps: float | None) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) + 1000.0
        var = (h * h).mean(-1) - h.mean(-1) ** 2
        if self.eps is None:
            return h / torch.sqrt(var).unsqueeze(-1)
        return h / torch.sqrt(var + self.eps).unsqueeze(-1)


class TrulyNegative(nn.Module):
    """sqrt(a - b) of predictions whose difference is negative in its own right."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ab = self.lin(x)
        return torch.sqrt(ab[:, 0] - ab[:, 1] * 0 + 0 * ab[:, 0] - 3.0)


def _run(model: nn.Module, mode: str) -> Any:
    torch.manual_seed(0)
    x = torch.randn(64, 8) * 1e-3
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        model(x).float().mean().backward()
        nw.step()
    return nw


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
@pytest.mark.parametrize("eps", [None, 1e-5])
def test_a_variance_cancelled_in_the_modules_own_code_is_rounding(
    mode: str, eps: float | None
) -> None:
    torch.manual_seed(0)
    model = OffsetVar(eps)
    nw = _run(model, mode)
    d = top(nw)
    assert (d.code, d.op, d.path) == ("NW112", "aten.sqrt", "OffsetVar")
    ev = d.evidence[0]
    assert "not rounding" not in ev
    assert "float32 rounding step" in ev
    assert "of the subtraction that made it, whose operands reach 1e+06" in ev
    assert "cancellation" in ev
    assert "two numbers near 1e+06" in d.explanation
    assert "raw network output" not in d.explanation
    lines = [ln.split("  #", 1)[0].strip() for ln in d.fix.splitlines()]
    assert lines[0] == "var = x.var(-1, keepdim=True, correction=0)"
    # the two-pass variance of the module's own values is never below 0
    h = model.lin(torch.randn(64, 8) * 1e-3).detach() + 1000.0
    ns: dict[str, Any] = {"torch": torch, "F": F, "x": h}
    for ln in lines[:2]:
        exec(ln, ns)
        assert (ns["var"] >= 0).all(), ln


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_difference_negative_in_its_own_right_is_not_called_rounding(mode: str) -> None:
    nw = _run(TrulyNegative(), mode)
    d = top(nw)
    assert (d.code, d.op) == ("NW112", "aten.sqrt")
    assert "cancellation" not in d.evidence[0]
    assert "not rounding" in d.evidence[0]
