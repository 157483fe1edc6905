"""NW111 on a learnable divisor (LSQ's step size initialized to 0 from an all-zero first
batch): clamp_min would pass no gradient below eps and freeze it at 0, so the fix is a
straight-through floor that still trains it, plus a floor where it is initialized."""

from __future__ import annotations

import ast

import torch
from torch import nn

from tests._diagnoses import code_lines, text
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


def _grad_scale(x: torch.Tensor, g: float) -> torch.Tensor:
    return (x - x * g).detach() + x * g


class _Lsq(nn.Module):
    """LSQ activation quantizer: s initialized as 2*mean|x|/sqrt(Qp) on the first batch."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.fixed = fixed
        self.s = nn.Parameter(torch.ones(1))
        self.register_buffer("initialized", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.initialized == 0:
            with torch.no_grad():
                self.s.copy_(2 * x.abs().mean() / 15**0.5)
                self.initialized.fill_(1)
        s_scale = _grad_scale(self.s, 1.0 / (15 * x.numel()) ** 0.5)
        if self.fixed:  # the diagnosis's fix, as pasted
            eps = torch.finfo(s_scale.dtype).eps
            s_scale = s_scale + (s_scale.clamp_min(eps) - s_scale).detach()
        x = x / s_scale
        x = x.clamp(0, 15)
        return ((x.round() - x).detach() + x) * s_scale


class _Direct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.s


class _Buffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s_scale = self.s * 2
        return x / s_scale


def test_a_divisor_made_from_a_parameter_gets_a_floor_that_keeps_its_gradient() -> None:
    q = _Lsq()
    d = _first(_raises(q, lambda: q(torch.zeros(4, 3))), "NW111")
    said = text(d)
    assert "learnable" in said and "self.s" in said and "clamp_min" in d.explanation
    floor = "s_scale + (s_scale.clamp_min(torch.finfo(s_scale.dtype).eps) - s_scale).detach()"
    assert f"s_scale = {floor}" in d.fix
    assert "self.s.data.clamp_(min=torch.finfo(self.s.dtype).eps)" in d.fix
    assert "s_scale = s_scale.clamp_min(" not in d.fix
    ast.parse(code_lines(d.fix))
    # applied: s leaves 0 and the quantizer learns (a clamp_min floor would keep s = 0)
    q = _Lsq(fixed=True)
    with torch.no_grad():
        q(torch.zeros(4, 3))
    opt = torch.optim.SGD(q.parameters(), lr=0.1)
    x = torch.rand(64, 3) * 4
    for _ in range(30):
        loss = ((q(x) - x) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert torch.isfinite(loss) and q.s.item() > 0.01


def test_a_parameter_divided_by_directly_is_named_learnable() -> None:
    m = _Direct()
    d = _first(_raises(m, lambda: m(torch.zeros(2, 3))), "NW111")
    assert "learnable" in d.title and "(self.s + (self.s.clamp_min(" in d.fix
    assert d.evidence[0].startswith("the divisor self.s is a learnable parameter (")
    ast.parse(code_lines(d.fix))


def test_a_buffer_divisor_keeps_the_clamp_min_fix() -> None:
    m = _Buffer()
    d = _first(_raises(m, lambda: m(torch.zeros(2, 3))), "NW111")
    assert "learnable" not in text(d)
    assert "s_scale = s_scale.clamp_min(torch.finfo(s_scale.dtype).eps)" in d.fix
