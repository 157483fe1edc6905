"""Domain diagnoses found by user testing: a backward NaN quotes what the autograd node
saved in forward (acos's input exactly at 1, sqrt's zero results), not only what its
backward read; a divisor that also multiplies the result (a soft cap of 0, meaning off) is
guarded by an ``if``, not floored; a normalization's eps of 0 quotes its input, not its
weight; a division by a distance says the distance is 0 (duplicate points)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests._diagnoses import code_lines, text
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


# ------------------------------ 1: the forward input / result the autograd node saved


class _Angle(nn.Module):
    def forward(self, c: torch.Tensor) -> torch.Tensor:
        theta = torch.acos(c.clamp(-1, 1))
        return theta


def test_acos_backward_quotes_the_forward_input_at_the_edge() -> None:
    m = _Angle()
    c = torch.tensor([0.5, 1.0, 1.5, -0.25], requires_grad=True)
    d = _first(_raises(m, lambda: m(c).sum().backward(), "forensic"), "NW114")
    said = "\n".join(d.evidence)
    assert "forward acos input: min -0.25, max 1 (4 values); 2 exactly at an edge" in said
    assert said.index("forward acos input") < said.index("backward input")


class _Tv(nn.Module):
    def forward(self, dx: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(dx**2 + dy**2).mean()


def test_sqrt_backward_quotes_the_zero_results() -> None:
    m = _Tv()
    dx = torch.tensor([0.0, 3.0, 0.0], requires_grad=True)
    dy = torch.tensor([0.0, 4.0, 0.0], requires_grad=True)
    d = _first(_raises(m, lambda: m(dx, dy).backward(), "forensic"), "NW112")
    said = "\n".join(d.evidence)
    assert "forward sqrt result: min 0, max 5 (2 exact zeros; 3 values)" in said
    assert said.index("forward sqrt result") < said.index("backward input")


# ------------------------------ 2: a divisor that also multiplies the result: 0 means off


class _SoftCap(nn.Module):
    def __init__(self, softcap: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.softcap = softcap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lin(x)
        logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_soft_cap_of_zero_is_guarded_not_floored(mode: str) -> None:
    torch.manual_seed(0)
    m = _SoftCap(0.0)
    x, y = torch.randn(8, 4), torch.randint(0, 6, (8,))

    def run() -> None:
        nn.functional.cross_entropy(m(x), y).backward()

    d = _first(_raises(m, run, mode), "NW111")
    assert "annealed" not in text(d) and "max(" not in d.fix and "clamp" not in d.fix
    assert "means the operation is off" in d.explanation
    fixed = code_lines(d.fix).split("   #")[0]
    assert fixed == ("if self.softcap: logits = torch.tanh(logits / self.softcap) * self.softcap")
    m.zero_grad()
    ns = {"torch": torch, "self": m, "logits": m.lin(x)}
    exec(compile(fixed, "<fix>", "exec"), ns)
    nn.functional.cross_entropy(ns["logits"], y).backward()
    g = m.lin.weight.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0  # it learns


class _CapOther(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cap = 0.0

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(z / self.cap) * self.cap
        return y


def test_soft_cap_into_a_new_name_keeps_the_input_when_off() -> None:
    m = _CapOther()
    z = torch.randn(5, requires_grad=True)
    d = _first(_raises(m, lambda: m(z).sum().backward(), "forensic"), "NW111")
    fixed = code_lines(d.fix).split("   #")[0]
    assert fixed == "y = torch.tanh(z / self.cap) * self.cap if self.cap else z"
    ns = {"torch": torch, "self": m, "z": z}
    exec(compile(fixed, "<fix>", "exec"), ns)
    assert torch.equal(ns["y"], z)


# ------------------------------ 4: a division by a distance: two points at the same place


class _Inverse(nn.Module):
    def forward(self, p: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        d = (p[i] - p[j]).norm(dim=-1)
        e = 1.0 / d
        return e


class _Pairs(nn.Module):
    def forward(self, p: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return (p[i] - p[j]).norm(dim=-1)


class _Envelope(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pairs = _Pairs()

    def forward(self, p: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return self.env(self.pairs(p, i, j))

    def env(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(x) / x + x


def _duplicated() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = torch.tensor([[0.0, 0.0, 0.0], [1.0, 2.0, 2.0], [0.0, 3.0, 4.0]])
    p = torch.cat([p, p[:1]])  # the first point written twice
    return p, torch.tensor([0, 1, 2]), torch.tensor([3, 2, 0])


@pytest.mark.parametrize(
    ("model", "said"),
    [
        (_Inverse, "d is a norm or distance: d = (p[i] - p[j]).norm(dim=-1)"),
        (
            _Envelope,
            "the denominator has the values of pairs's output, which "
            "LinalgVectorNormBackward0 made",
        ),
    ],
)
def test_a_zero_distance_is_called_duplicate_points(model: type[nn.Module], said: str) -> None:
    m = model()
    p, i, j = _duplicated()
    p.requires_grad_(True)
    d = _first(_raises(m, lambda: m(p, i, j).sum().backward(), "forensic"), "NW111")
    assert d.title.endswith("at a distance of 0")
    assert said in "\n".join(d.evidence)
    assert "duplicate" in d.explanation and "i == j" in d.explanation
    assert "standard deviation" not in d.explanation
    assert "keep = i != j" in d.fix and "torch.where(" in d.fix
    fixed = code_lines(d.fix)
    dist = (p[i] - p[j]).norm(dim=-1)
    ns = {"torch": torch, "d": dist, "x": dist}
    if fixed.startswith("return "):  # the envelope's line
        out = eval(fixed.removeprefix("return ").split("  #")[0], ns)
    else:
        exec(compile(fixed, "<fix>", "exec"), ns)
        out = ns["e"]
    assert torch.isfinite(out).all()
