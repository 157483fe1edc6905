"""Gradient and weight fixes found by user testing: a LoRA adapter whose factors are both
zero gets a fix that compiles and names every dead adapter, a rank-0 adapter is called
empty, a one-line ``def`` gives its body to the inspect fix, an EMA copy written outside
an optimizer step is named instead of gradient clipping."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import nanwatch
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises
from tests._diagnoses import text

torch.set_num_threads(1)


def _compiles(fix: str) -> None:
    compile(fix, "<fix>", "exec")


# ------------------------------ 1: LoRA factors both zero, and a rank-0 adapter


class _LoRA(nn.Module):
    def __init__(self, base: nn.Linear, r: int, *, zero_a: bool) -> None:
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.A = nn.Parameter(torch.zeros(r, base.in_features))
        if not zero_a and r:
            nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        self.B = nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.A.t() @ self.B.t()


def _vanish(model: nn.Module) -> nanwatch.Diagnosis:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    with nanwatch.watch(model) as nw:
        for _ in range(6):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    found = [d for t in nw.history for d in t.diagnoses if d.code == "NW304"]
    assert found, "no NW304"
    return found[0]


def test_zero_lora_factors_get_a_fix_that_compiles_and_names_every_dead_adapter() -> None:
    m = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    for i in (0, 2, 4):
        m[i] = _LoRA(m[i], 2, zero_a=True)  # type: ignore[arg-type]
    d = _vanish(m)
    assert d.path == "4"
    _compiles(d.fix)
    assert "'4').4.A" not in d.fix
    assert "2, 0 are dead the same way" in text(d)
    ns = {"torch": torch, "model": m}
    exec(d.fix, ns)  # initializes A of each adapter
    assert all(m[i].A.abs().max() > 0 for i in (0, 2, 4))
    assert all(m[i].B.abs().max() == 0 for i in (0, 2, 4))  # the other factor stays at zero


def test_a_rank_0_adapter_is_called_empty_not_initialized() -> None:
    m = nn.Sequential(nn.Linear(8, 8), nn.GELU(), _LoRA(nn.Linear(8, 4), 0, zero_a=False))
    d = _vanish(m)
    _compiles(d.fix)
    assert "rank-0 adapter" in d.fix and "kaiming" not in d.fix
    assert "2.A (0, 8)" in text(d) and "empty" in text(d)


# ------------------------------ 2: a one-line def: the inspect fix reads its body


class _Zeta(nn.Module):
    """A value no rule explains (Hurwitz zeta at a negative q), made in a one-line forward
    (a weight_norm of a zero weight was this test's model: it has a diagnosis of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, x): return self.head(self.body(x)) + torch.special.zeta(x[:, :4], -1.5)  # type: ignore[no-untyped-def]  # fmt: skip


def test_a_one_line_def_gives_its_body_to_the_inspect_fix() -> None:
    torch.manual_seed(0)
    m = _Zeta()

    def run() -> None:
        m(torch.randn(4, 8)).sum().backward()

    d = _first(_raises(m, run, "sentinel"), "NW100")
    _compiles(d.fix)
    assert "def forward" not in d.fix.split("\n", 1)[1]
    assert "out = self.head(self.body(x)) + torch.special.zeta(x[:, :4], -1.5)" in d.fix
    assert "in forward's body" in d.fix


# ------------------------------ 3: an EMA copy written outside an optimizer step


def _ema_run(decay_of: object) -> nanwatch.AnomalyError:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ema = copy.deepcopy(model)
    for p in ema.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(model, ema) as nw:
        for step in range(4):
            with torch.no_grad():
                t = ema(x).softmax(-1)
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y) - (t * logits.log_softmax(-1)).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            decay = decay_of(step)  # type: ignore[operator]
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), model.parameters(), strict=True):
                    pe.mul_(decay).add_(p, alpha=1 - decay)
            nw.step()
    return info.value


def test_ema_weights_grown_outside_an_optimizer_are_named_not_clipped() -> None:
    err = _ema_run(lambda step: 1.0 - 1.0 / max(step, 1e-30))
    d = err.diagnoses[0]
    assert d.code == "NW301", [x.code for x in err.diagnoses]
    assert "outside an optimizer step" in d.title
    assert "Sequential#2" in text(d) and "clip_grad_norm_" not in d.fix
    _compiles(d.fix)
    assert "model.named_parameters()" not in d.fix  # the EMA copy is not `model`


def test_non_finite_ema_weights_fix_does_not_check_the_student() -> None:
    err = _ema_run(lambda step: 1.0 - 1.0 / torch.tensor(float(step)))
    d = _first(err, "NW301")
    assert "outside an optimizer step" in d.title
    _compiles(d.fix)
    assert "model.named_parameters()" not in d.fix and "Sequential#2" in d.fix


# ------------------------------ 4: a gradient norm huge from the first step


def test_a_gradient_norm_near_the_dtype_limit_is_told_at_the_first_step() -> None:
    m = nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    x = torch.randn(8, 4)
    with nanwatch.watch(m) as nw:
        for _ in range(2):
            (m(x).pow(2).sum() * 1e22).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    d = next(d for d in nw.history[0].diagnoses if d.code == "NW303")
    assert d.step == 0 and "sqrt(finfo(float32).max)" in text(d)
    _compiles(d.fix)
    assert not [d for d in nw.history[1].diagnoses if d.code == "NW303"]  # told once


# ------------------------------ 5: a divisor whose value the source fixes is not called 0


def test_a_constant_divisor_is_not_blamed_for_an_inf_gradient() -> None:
    m = nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    B = 32
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(m) as nw:
        for it in range(4):
            sigma = 1.0 if it < 2 else math.inf
            m(x).sum().backward()
            for p in m.parameters():
                g = p.grad.detach()
                p.grad = (g + torch.randn_like(g) * sigma) / B
            opt.step()
            opt.zero_grad()
            nw.step()
    d = _first(info.value, "NW301")
    assert "divides by B = 32, not 0" in d.fix and "sigma" in d.fix
    assert "empty batch" not in d.fix
    _compiles(d.fix)
