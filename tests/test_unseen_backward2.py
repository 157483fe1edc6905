"""Backward births in a root's own code, named in watch and sentinel mode: a sqrt of a
squared distance of 0 or an acos at exactly 1 in the root's forward that feeds a child (the
replay seeds the values the root gave its children too, and uses the root call's own
arguments, an int among them), a soft-cap of 0 after the last layer. And a NaN made by
``w / w.norm()`` of zero rows between two roots is named by the division that made it, not
by the matmul that carried it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


class _Rbf(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.register_buffer("mu", torch.linspace(0, 3, n))

    def forward(self, d: torch.Tensor) -> torch.Tensor:
        return torch.exp(-((d[:, None] - self.mu) ** 2))


class _SelfPairs(nn.Module):
    """Distances of every pair, the self-pairs included: sqrt(0) there."""

    def __init__(self) -> None:
        super().__init__()
        self.rbf = _Rbf()
        self.head = nn.Linear(4, 1)

    def forward(self, pos: torch.Tensor, i: torch.Tensor, j: torch.Tensor, n: int) -> torch.Tensor:
        vec = pos[i] - pos[j]
        d = torch.sqrt((vec**2).sum(-1))
        return self.head(self.rbf(d)).sum() / n


def _pairs(n: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    i, j = torch.ones(n, n, dtype=torch.bool).nonzero(as_tuple=True)
    return i, j


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_sqrt_at_zero_in_the_roots_own_code_feeding_a_child_is_named(mode: str) -> None:
    torch.manual_seed(0)
    m = _SelfPairs()
    pos = torch.randn(3, 3, requires_grad=True)
    i, j = _pairs()

    def run() -> None:
        (m(pos, i, j, 3) - 1.0).pow(2).backward()

    err = _raises(m, run, mode)
    d = _first(err, "NW112")
    assert "sqrt" in str(err)
    assert "_SelfPairs" in str(err)
    assert "1e-12" in d.fix
    body = "\n".join("    " + ln for ln in d.fix.strip().splitlines())
    compile(f"def f(vec):\n{body}\n", "<fix>", "exec")


class _Angles(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.n = n

    def forward(self, theta: torch.Tensor) -> torch.Tensor:
        k = torch.arange(1, self.n + 1, dtype=theta.dtype)
        return torch.cos(k * theta[:, None])


class _Triplets(nn.Module):
    """The angle between two bond vectors that are the same one: cos = 1, acos'(1) = -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.sbf = _Angles()
        self.out = nn.Linear(3, 1)

    def forward(self, pos: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        v1, v2 = pos[a] - pos[0], pos[b] - pos[0]
        cos = (v1 * v2).sum(-1) / (v1.norm(dim=-1) * v2.norm(dim=-1))
        theta = torch.acos(cos.clamp(-1, 1))
        return self.out(self.sbf(theta)).sum()


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_an_acos_at_one_in_the_roots_own_code_feeding_a_child_is_named(mode: str) -> None:
    torch.manual_seed(0)
    m = _Triplets()
    pos = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 2.0, 0.0]], requires_grad=True)
    a, b = torch.tensor([1, 1]), torch.tensor([2, 1])  # the second triplet: k == i

    def run() -> None:
        m(pos, a, b).backward()

    err = _raises(m, run, mode)
    _first(err, "NW114")
    assert "acos" in str(err)


class _Capped(nn.Module):
    """Logit soft-capping with a cap of 0 (meant as off): tanh(x / 0) * 0 is 0 forward and
    0/0 backward."""

    def __init__(self, softcap: float = 0.0) -> None:
        super().__init__()
        self.wte = nn.Embedding(8, 6)
        self.body = nn.Linear(6, 6)
        self.lm_head = nn.Linear(6, 8)
        self.softcap = softcap

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(torch.relu(self.body(self.wte(idx))))
        return torch.tanh(logits / self.softcap) * self.softcap


def test_a_soft_cap_of_zero_after_the_last_layer_is_named_in_watch_mode() -> None:
    torch.manual_seed(0)
    m = _Capped()
    idx = torch.randint(0, 8, (2, 5))

    def run() -> None:
        logits = m(idx)
        nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()

    err = _raises(m, run, "watch")
    d = _first(err, "NW111")
    assert "aten.div" in str(err)
    assert "self.softcap" in d.fix
    body = "\n".join("    " + ln for ln in d.fix.strip().splitlines())
    compile(f"def forward(self, logits):\n{body}\n", "<fix>", "exec")  # a line of forward


class _Hyper(nn.Module):
    """Generates the weights of a target net; a ReLU on the last layer makes rows of 0."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 4)
        self.head = nn.Linear(4, 12)

    def forward(self, task: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.head(self.emb(task))).view(4, 3)


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_zero_row_normalized_between_roots_is_named_by_its_division(mode: str) -> None:
    torch.manual_seed(0)
    m, crit = _Hyper(), nn.MSELoss()
    with torch.no_grad():
        m.head.bias.fill_(-10.0)  # every generated weight is 0
    x, y = torch.randn(5, 3), torch.randn(5, 4)
    try:
        with nanwatch.watch(m, crit, mode=mode):
            w = m(torch.tensor(1))
            w = w / w.norm(dim=1, keepdim=True)
            crit(x @ w.t(), y).backward()
    except nanwatch.AnomalyError as e:
        err = e
    else:
        raise AssertionError("no anomaly")
    _first(err, "NW111")
    assert "[op aten.div" in str(err)
