"""Gradients that grow from exactly 0 are not exploding (NW303); a loss term weighted 0 or
masked out is not dead units (NW304); a gradient the user's code wrote after backward
(PCGrad, GradNorm) is named as the source of NaN weights (NW301)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.rules.base import Diagnosis


def _diags(nw: Any, code: str) -> list[Diagnosis]:
    return [d for t in nw.history for d in t.diagnoses if d.code == code]


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.main = nn.Linear(16, 3)
        self.aux = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.main(h), self.aux(h)


def _aux_warmup(steps: int, off: int) -> Any:
    """An auxiliary loss weighted 0 for ``off`` steps, then 0.5: a curriculum."""
    torch.manual_seed(0)
    m = _TwoHeads()
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(m, postmortem=False) as nw:
            for i in range(steps):
                x, y, z = torch.randn(8, 8), torch.randint(0, 3, (8,)), torch.randn(8, 1)
                a, b = m(x)
                loss = F.cross_entropy(a, y) + (0.0 if i < off else 0.5) * F.mse_loss(b, z)
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()
    return nw


def test_a_gradient_growing_from_exactly_0_is_not_exploding() -> None:
    """The median of the aux head's gradient was over 10 exact zeros (the warm-up) and 10
    real values: its ordinary gradient read as 35x its median. The zeros are not its
    level, and while the loss term is off it is not dead units either."""
    nw = _aux_warmup(30, 10)
    assert not _diags(nw, "NW303")
    assert not [d for d in _diags(nw, "NW304") if d.severity != "info"]
    notes = _diags(nw, "NW304")
    assert notes and notes[0].path == "aux"
    assert "contributed nothing (weighted 0 or masked out)" in notes[0].explanation
    assert "LeakyReLU" not in notes[0].fix


class _AdaLNZero(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d, elementwise_affine=False)
        self.mod = nn.Linear(d, 3 * d)
        nn.init.zeros_(self.mod.weight)
        nn.init.zeros_(self.mod.bias)
        self.mlp = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        sh, sc, g = self.mod(c).chunk(3, -1)
        return x + g * self.mlp(self.ln(x) * (1 + sc) + sh)


class _DiT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.c = nn.Linear(4, 16)
        self.blocks = nn.ModuleList([_AdaLNZero(), _AdaLNZero()])
        self.out = nn.Linear(16, 8)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        h, cc = self.inp(x), self.c(c)
        for b in self.blocks:
            h = b(h, cc)
        return self.out(h)


def test_adaln_zero_gates_opening_are_not_exploding_gradients() -> None:
    """DiT's adaLN-Zero: the gated MLPs' gradients grow from 0 as the gates open, while the
    total norm is flat about 1. A module whose output gradient is 1e-5 of what backward
    carries from the loss cannot explode the update."""
    torch.manual_seed(0)
    m = _DiT()
    opt = torch.optim.AdamW(m.parameters(), 1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(m, postmortem=False) as nw:
            for _ in range(24):
                x, c = torch.randn(8, 8), torch.randn(8, 4)
                n = torch.randn_like(x)
                loss = F.mse_loss(m(x + n, c), n)
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()
    assert not _diags(nw, "NW303")


@pytest.mark.parametrize("masked", [False, True])
def test_a_task_absent_from_most_batches_is_not_dead_units(masked: bool) -> None:
    """Multi-dataset MTL: task 2 comes every 6th batch; the other batches touch its head
    with 0.0 * p2.sum() (DDP's unused-parameter idiom) or mask its loss out. Its gradient
    is exactly 0 on those steps, and it was not on the task's steps: silent."""
    torch.manual_seed(0)
    m = _TwoHeads()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(m, postmortem=False) as nw:
            for step in range(14):
                task2 = step % 6 == 0
                p1, p2 = m(torch.randn(16, 8))
                ce = F.cross_entropy(p1, torch.randint(0, 3, (16,)))
                if masked:
                    has2 = torch.full((16,), task2)
                    err = ((p2 - torch.randn(16, 1)) ** 2).squeeze(1) * has2
                    loss = ce + err.sum() / has2.sum().clamp(min=1)
                else:
                    loss = F.mse_loss(p2, torch.randn(16, 1)) if task2 else ce + 0.0 * p2.sum()
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()
    assert not _diags(nw, "NW304")


def test_dead_relu_units_are_still_dead_units() -> None:
    """The loss reads the model's output, which the last ReLU made: a zero behind it is the
    ReLU's (dead units), not a loss term's."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1), nn.ReLU())
    with torch.no_grad():
        m[2].bias.fill_(-100.0)  # the last ReLU never fires
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(m, postmortem=False) as nw:
            for _ in range(6):
                loss = F.mse_loss(m(torch.randn(8, 4)), torch.randn(8, 1))
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()
    d = _diags(nw, "NW304")
    assert d and d[0].severity == "warning" and "dead" in d[0].explanation


# ---------------------------------------------------------------- NW301: grads written by hand


class _MTL(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.h1 = nn.Linear(16, 1)
        self.h2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.shared(x)
        return self.h1(h), self.h2(h)


def _pcgrad(losses: list[torch.Tensor], params: list[nn.Parameter]) -> None:
    flat = []
    for loss in losses:
        g = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        flat.append(
            torch.cat(
                [
                    (x if x is not None else torch.zeros_like(p)).flatten()
                    for x, p in zip(g, params, strict=True)
                ]
            )
        )
    out = []
    for i, g0 in enumerate(flat):
        gi = g0
        for j, gj in enumerate(flat):
            if i != j:
                gi = gi - (gi @ gj) / (gj @ gj) * gj  # 0/0 when task j's gradient is 0
        out.append(gi)
    g = torch.stack(out).sum(0)
    k = 0
    for p in params:
        p.grad = g[k : k + p.numel()].view_as(p).clone()
        k += p.numel()


def test_pcgrad_nan_written_into_grad_is_named_not_the_optimizer() -> None:
    """PCGrad writes p.grad by hand after torch.autograd.grad (no backward()): a task
    with no labels in the batch has a gradient of 0 and the projection is 0/0. NW301 said
    SGD "wrote NaN from a finite gradient" and told to clear optimizer.state."""
    torch.manual_seed(0)
    model = _MTL()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.05)
    with pytest.raises(nanwatch.AnomalyError) as ei, nanwatch.watch(model, postmortem=False):
        for step in range(4):
            x, y1, y2 = torch.randn(16, 8), torch.randn(16, 1), torch.randn(16, 1)
            lab2 = torch.rand(16) < (0.5 if step != 2 else 0.0)
            p1, p2 = model(x)
            l1 = ((p1 - y1) ** 2).mean()
            l2 = (((p2 - y2) ** 2).squeeze(1) * lab2).sum() / lab2.sum().clamp(min=1)
            optimizer.zero_grad()
            _pcgrad([l1, l2], params)
            optimizer.step()
    d = next(d for d in ei.value.diagnoses if d.code == "NW301")
    assert d.title == "Non-finite weights from a gradient your code wrote after backward"
    assert any("set by your code" in e and "held NaN" in e for e in d.evidence)
    assert "from a finite gradient" not in d.explanation
    assert "clamp_min" in d.fix and "optimizer.state" not in d.fix
    exec(d.fix, {"torch": torch, "model": model, "optimizer": optimizer})  # skips the step


def test_a_grad_replaced_after_backward_is_named() -> None:
    """GradNorm: backward gives the task weights a finite gradient, then the user's code
    replaces it (weights.grad = autograd.grad(...)), NaN from L/L0 = 0/0. The norm read
    at the end of backward is not what the optimizer applied."""
    torch.manual_seed(0)
    model = _MTL()
    weights = nn.Parameter(torch.ones(2))
    model.register_parameter("task_weights", weights)
    opt_w = torch.optim.SGD([weights], lr=0.01)
    with pytest.raises(nanwatch.AnomalyError) as ei, nanwatch.watch(model, postmortem=False):
        p1, p2 = model(torch.randn(16, 8))
        losses = torch.stack([(p1**2).mean(), (p2**2).mean() * 0])
        ratio = losses.detach() / losses.detach()  # 0/0 for the empty task
        opt_w.zero_grad()
        (weights * losses).sum().backward()
        weights.grad = weights.grad * ratio
        opt_w.step()
    d = next(d for d in ei.value.diagnoses if d.code == "NW301")
    assert any("replaced after backward" in e and "opt_w" in e for e in d.evidence)
    assert not any("its gradient norm at step" in e for e in d.evidence)
