"""NW110 without a parameter matched by size alone; soft-min logs of sums of exps; NW111 for
a deliberate inf mask, a computed zero sum and a DropPath of keep 0; NW112 fixes of a
hand-written norm."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.stats import HostRead
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


# ------------------------------------- 1: a saturated sigmoid is no parameter of its size


class _GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())


_GAN_LOSS = compile(
    "fake = m.G(torch.randn(8, 4))\n"
    "loss = -(torch.log(m.D(real)) + torch.log(1 - m.D(fake))).mean()\n"
    "loss.backward()\n",
    "<gan>",
    "exec",
)


def test_log_of_saturated_sigmoid_is_not_a_parameter_of_its_size() -> None:
    torch.manual_seed(0)
    m = _GAN()

    def run() -> None:
        opt = torch.optim.Adam(m.parameters(), 2e-4)
        for step in range(3):
            real = torch.randn(8, 8) * (1e3 if step == 2 else 1.0)  # D(real) saturates to 0
            opt.zero_grad()
            exec(_GAN_LOSS, {"torch": torch, "m": m, "real": real})
            opt.step()

    d = _first(_raises(m, run), "NW110")
    assert "G.2.bias" not in d.fix and not any("G.2.bias" in e for e in d.evidence)
    assert "not a probability" not in d.explanation


# --------------------------------------- 2: a soft-min's log of a sum of exps is no softplus


def _softmin(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, gamma: float) -> torch.Tensor:
    s = torch.exp(-a / gamma) + torch.exp(-b / gamma) + torch.exp(-c / gamma)
    return -gamma * torch.log(s)


def _soft_dtw(x: torch.Tensor, y: torch.Tensor, gamma: float = 0.01) -> torch.Tensor:
    D = torch.cdist(x, y) ** 2
    n, m = D.shape
    R = [[torch.tensor(float("inf"))] * (m + 1) for _ in range(n + 1)]
    R[0][0] = torch.tensor(0.0)
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            R[i][j] = D[i - 1, j - 1] + _softmin(R[i - 1][j - 1], R[i - 1][j], R[i][j - 1], gamma)
    return R[n][m]


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_soft_dtw_softmin_is_a_logsumexp_not_a_softplus(mode: str) -> None:
    torch.manual_seed(0)
    m = nn.Linear(2, 2)
    x, y = torch.randn(8, 2), torch.randn(8, 2) * 3

    def run() -> None:
        _soft_dtw(m(x), y).backward()

    d = _first(_raises(m, run, mode), "NW110")
    assert "softplus" not in d.fix and "softplus" not in d.explanation
    assert "torch.logsumexp(torch.stack([" in d.fix
    if mode == "forensic":
        assert d.fix.startswith(
            "return -gamma * torch.logsumexp(torch.stack([-a / gamma, -b / gamma, -c / gamma]), "
            "dim=0)"
        )


# --------------------------------------------- 3: an inf mask is no count that was 0


class _Sinkhorn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        C = 1 - self.proj(a) @ self.proj(b).t()
        C = C.masked_fill(~allowed, float("inf"))
        f = torch.zeros(C.shape[0])
        g = torch.zeros(C.shape[1])
        for _ in range(3):
            f = -0.1 * torch.logsumexp((g[None] - C) / 0.1, dim=1)
            g = -0.1 * torch.logsumexp((f[:, None] - C) / 0.1, dim=0)
        return torch.exp((f[:, None] + g[None] - C) / 0.1)


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_inf_cost_mask_with_an_empty_row_is_named_as_a_mask(mode: str) -> None:
    torch.manual_seed(0)
    m = _Sinkhorn()
    allowed = torch.rand(5, 5) > 0.3
    allowed[2] = False  # a row with nothing allowed

    def run() -> None:
        m(torch.randn(5, 4), torch.randn(5, 4), allowed).sum().backward()

    d = _first(_raises(m, run, mode), "NW111")
    assert "counts" not in d.fix and "count that was 0" not in d.explanation
    assert d.fix.startswith("C = C.masked_fill(~allowed, torch.finfo(C.dtype).max ** 0.5)")
    assert "masked_fill" in d.evidence[0] and "inf - inf" in d.explanation


# ----------------------------- 4: a module's -inf constraint times a 0 mask is not a log


class _Transitions(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, n) * 0.1)
        c = torch.zeros(n, n)
        c[0, 2] = float("-inf")  # a forbidden transition
        self.register_buffer("c", c)

    def forward(self) -> torch.Tensor:
        return self.w + self.c


class _CRF(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trans = _Transitions(3)


def test_constraint_neginf_times_pad_mask_is_no_log_of_zero() -> None:
    m = _CRF()

    def run() -> None:
        T = m.trans()
        mask = torch.tensor([1.0, 1.0, 0.0])
        prev, cur = torch.tensor([1, 0, 0]), torch.tensor([0, 2, 2])  # padding: O -> I
        (T[prev, cur] * mask).sum().backward()

    err = _raises(m, run)
    assert all(d.code != "NW110" for d in err.diagnoses)
    d = err.diagnoses[0]
    assert d.code == "NW100" and "constant -inf" in d.title
    assert "torch.where(mask, x, 0.0)" in d.fix and "torch.finfo(c.dtype).min" in d.fix
    assert "log" not in d.fix


def test_read_late_the_dropped_neginf_output_the_loss_read_is_described_in_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Statistics read after backward (nothing landed as it began): the module's output,
    a local of the step function, was dropped before the read, and only its min and max
    were known -- not its largest finite value, which rules out an overflow -- so the
    diagnosis was 'Non-finite value'. The value the loss code read is held until read,
    then released."""
    monkeypatch.setattr(HostRead, "ready", lambda self: False)
    m = _CRF()
    out: list[weakref.ReferenceType[torch.Tensor]] = []

    def run() -> None:
        T = m.trans()
        out.append(weakref.ref(T))
        mask = torch.tensor([1.0, 1.0, 0.0])
        prev, cur = torch.tensor([1, 0, 0]), torch.tensor([0, 2, 2])
        (T[prev, cur] * mask).sum().backward()

    nw = nanwatch.watch(m, on_anomaly="record", postmortem=False)
    nw._defer_cpu = True
    with nw:
        run()
        nw.step()
        assert out[0]() is None  # held until read, not past the step
    src = nw.history[0].anomaly.neginf_source if nw.history[0].anomaly else None
    assert src is not None and src.path == "trans" and src.stat is not None
    assert src.stat.neginf == 1 and src.stat.finite_amax is not None
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW100" and "constant -inf" in d.title


# ------------------------------- 5: an all-zero sum computed this step is no unfilled buffer


class _Density(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 1)
        with torch.no_grad():
            self.fc.bias.fill_(-50.0)  # a dead ReLU head: 0 everywhere

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))[..., 0]


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_all_zero_sum_of_a_dead_relu_is_computed_not_a_buffer(mode: str) -> None:
    torch.manual_seed(0)
    m = _Density()

    def run() -> None:
        w = m(torch.randn(4, 8, 3))
        w = w / w.sum(-1, keepdim=True)
        w.sum().backward()

    d = _first(_raises(m, run, mode), "NW111")
    assert "never filled (a buffer" not in d.explanation
    assert "created with torch.zeros" not in d.fix
    assert any("computed this step" in e and "0 everywhere" in e for e in d.evidence)
    assert "ReLU output that is 0 everywhere" in d.explanation


# ------------------------------------ 6: a scalar divisor written x.div(d) on the user's line


class _DropPath(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep_prob = 1 - self.p
        mask = (torch.rand(x.shape[0], 1) < keep_prob).to(x.dtype)
        return self.fc(x).div(keep_prob) * mask


def test_droppath_keep_prob_0_floor_on_the_users_div_call() -> None:
    m = _DropPath(1.0)
    d = _first(_raises(m, lambda: m(torch.randn(3, 4)).sum().backward()), "NW111")
    assert d.fix.startswith("return self.fc(x).div(max(keep_prob, 1e-3)) * mask")
    assert "d = max(d, 1e-3)" not in d.fix


# --------------------------- 7: a hand-written norm's sqrt: no made-up distance, no `d =`


def test_sqrt_of_sum_of_squares_watch_fix_names_a_norm() -> None:
    m = nn.Linear(3, 3)

    def run() -> None:
        g = m(torch.randn(4, 3)) * torch.tensor([[1.0], [0.0], [1.0], [1.0]])  # a zero row
        (g**2).sum(-1).sqrt().sum().backward()

    d = _first(_raises(m, run), "NW112")
    assert "a - b" not in d.fix and not d.fix.startswith("d =")
    assert d.fix.startswith("norm = torch.linalg.vector_norm(x, dim=-1)")
