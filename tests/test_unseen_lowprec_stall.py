"""Low-precision training that silently stops learning: weights held in bfloat16 or
float16 (no float32 master copy) whose updates are below half the spacing of the dtype's
numbers around them round back to the same weights at every step. Every value stays
finite; NW107 tells it from torch.finfo, the optimizer's lr and the weights' sizes, and
stays silent where the update survives the rounding."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

import nanwatch

MODES = ("watch", "sentinel")


def _train(
    dtype: torch.dtype,
    make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    *,
    mode: str,
    autocast: bool = False,
    steps: int = 4,
    scheduler: Callable[[torch.optim.Optimizer], LRScheduler] | None = None,
) -> tuple[list[tuple[int, nanwatch.Diagnosis]], float]:
    """Train a small MLP in ``dtype``; the diagnoses of every step, and the share of the
    weights' values that changed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).to(dtype)
    opt = make_opt(list(model.parameters()))
    sched = scheduler(opt) if scheduler is not None else None
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(16, 32)
    y = torch.randint(0, 4, (16,))
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(steps):
            if autocast:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x)
            else:
                out = model(x.to(dtype))
            F.cross_entropy(out.float(), y).backward()
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
            nw.step()
    changed = sum(
        int((p.detach() != w).sum()) for p, w in zip(model.parameters(), before, strict=True)
    )
    total = sum(w.numel() for w in before)
    return [(t.step, d) for t in nw.history for d in t.diagnoses], changed / total


def _adamw(lr: float) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    return lambda ps: torch.optim.AdamW(ps, lr=lr)


@pytest.mark.parametrize("mode", MODES)
def test_pure_bfloat16_adamw_at_a_small_lr_is_told_once_with_the_rounding_numbers(
    mode: str,
) -> None:
    found, changed = _train(torch.bfloat16, _adamw(1e-5), mode=mode)
    assert changed < 0.1  # the reproducer: the weights barely change, and nothing is NaN
    hits = [(s, d) for s, d in found if d.code == "NW107"]
    assert [s for s, _ in hits] == [0], [(s, d.headline) for s, d in found]
    d = hits[0][1]
    text = " | ".join(d.evidence)
    assert "finfo(bfloat16).eps = 0.007812" in text
    assert "typical |w| (RMS) = 0.1028" in text and "rounds back to w" in text
    assert "about lr = 1e-5 per value" in text
    assert "AdamW updates 2,372 values held in bfloat16, with no float32 copy" in text
    assert "every value with |w| >= 0.003906 loses its whole update: about 97%" in text
    assert d.parameter == "0.weight"
    # the test's own line that built the model, without its .to(dtype)
    assert d.fix.startswith(
        "model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))   # float32 weights"
    )
    assert "torch.autocast(device_type='cpu', dtype=torch.bfloat16)" in d.fix
    assert "Kahan-summation" in d.fix and "stochastically" in d.fix


@pytest.mark.parametrize("mode", MODES)
def test_pure_bfloat16_sgd_scales_the_update_by_the_gradient(mode: str) -> None:
    found, _ = _train(torch.bfloat16, lambda ps: torch.optim.SGD(ps, lr=1e-3), mode=mode)
    d = next(d for _, d in found if d.code == "NW107")
    assert "SGD's update: lr × |grad| = 1e-3 ×" in " | ".join(d.evidence)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("dtype", "make_opt", "autocast"),
    [
        (torch.float32, _adamw(1e-5), False),  # float32 weights hold a 1e-5 step
        (torch.float32, _adamw(1e-5), True),  # mixed precision: float32 master weights
        (torch.bfloat16, _adamw(1e-2), False),  # bfloat16 with an lr above the spacing
        (torch.bfloat16, lambda ps: torch.optim.SGD(ps, lr=0.1), False),
    ],
    ids=["fp32", "autocast", "bf16-big-lr", "bf16-sgd-big-lr"],
)
def test_updates_that_survive_the_rounding_are_silent(
    mode: str,
    dtype: torch.dtype,
    make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    autocast: bool,
) -> None:
    found, changed = _train(dtype, make_opt, mode=mode, autocast=autocast)
    assert changed > 0.5
    assert [d.code for _, d in found] == []


@pytest.mark.parametrize("mode", MODES)
def test_a_warmup_from_a_tiny_lr_to_a_large_one_is_silent(mode: str) -> None:
    # the first steps' lr (1e-2 / 1000) is below the spacing; the scheduler's base lr is not
    def warmup(opt: torch.optim.Optimizer) -> LRScheduler:
        return LambdaLR(opt, lambda s: min(1.0, (s + 1) / 1000))

    found, _ = _train(torch.bfloat16, _adamw(1e-2), mode=mode, scheduler=warmup)
    assert "NW107" not in [d.code for _, d in found]


def test_an_lr_lowered_below_the_spacing_mid_run_is_told_at_that_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    y = torch.randint(0, 4, (16,))
    with nanwatch.watch(model, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
        for i in range(5):
            if i == 3:
                opt.param_groups[0]["lr"] = 1e-5  # a plateau scheduler's cut, by hand
            F.cross_entropy(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    assert [(t.step, d.code) for t in nw.history for d in t.diagnoses] == [(3, "NW107")]
