"""Nothing trains while every value stays finite: a loss that is exactly 0 from the first
step (a softmax over a dim of size 1) is constant, not at a minimum it reached (NW304); an
lr that a warmup written with integer division keeps at exactly 0 (NW312)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.rules.base import Diagnosis

MODES = ("watch", "sentinel")


def _diags(nw: Any, code: str) -> list[Diagnosis]:
    return [d for t in nw.history for d in t.diagnoses if d.code == code]


def _train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    loss_fn: Callable[[int], torch.Tensor],
    *,
    mode: str,
    steps: int = 8,
    sched: Any = None,
    crits: tuple[nn.Module, ...] = (),
) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, *crits, mode=mode, on_anomaly="record", postmortem=False) as nw:
            for i in range(steps):
                loss = loss_fn(i)
                loss.backward()
                opt.step()
                if sched is not None:
                    sched.step()
                opt.zero_grad()
                nw.step()
    return nw


# ------------------------------------------- NW304: a loss that is 0 from the first step


@pytest.mark.parametrize("mode", MODES)
def test_a_softmax_over_a_dim_of_size_one_is_a_constant_loss_not_a_minimum(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(i: int) -> torch.Tensor:
        logits = model(torch.randn(32, 8)).unsqueeze(-1)  # (B, C, 1)
        p = torch.softmax(logits, dim=-1).squeeze(-1)  # over the dim of size 1: always 1
        return F.nll_loss(torch.log(p), torch.randint(0, 5, (32,)))

    found = _diags(_train(model, opt, step, mode=mode), "NW304")
    assert found, "no NW304"
    d = found[0]
    assert d.severity == "warning"
    assert d.title == "Zero gradients: the loss is 0 from the first step, it never came down"
    assert "reached its minimum" not in d.title
    assert any("exactly 0 at every step since the watch began" in e for e in d.evidence)
    soft = [e for e in d.evidence if "SoftmaxBackward0" in e]
    assert soft and "dim 2 of size 1" in soft[0] and "[32, 5, 1]" in soft[0]
    assert "does not depend on the outputs" in d.explanation
    assert "dim=1" in d.fix and "the dim of size 5" in d.fix


@pytest.mark.parametrize("mode", MODES)
def test_a_loss_of_the_prediction_against_itself_is_zero_from_the_first_step(mode: str) -> None:
    # no softmax to blame: the target is the prediction itself, so the loss is 0 and its
    # gradient 0 at every step, whatever the weights
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(i: int) -> torch.Tensor:
        pred = model(torch.randn(16, 8))
        return F.mse_loss(pred, pred)

    d = _diags(_train(model, opt, step, mode=mode), "NW304")[0]
    assert d.severity == "warning"
    assert d.title == "Zero gradients: the loss is 0 from the first step, it never came down"
    assert "does not depend on the outputs" in d.explanation
    assert any("F.mse_loss compares pred with itself" in e for e in d.evidence)
    assert d.fix.splitlines()[-1].startswith("loss = F.mse_loss(pred, target)")


@pytest.mark.parametrize("mode", MODES)
def test_a_margin_loss_that_came_down_to_zero_still_reached_its_minimum(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    crit = nn.MultiMarginLoss(margin=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = torch.randn(30, 4), torch.randint(0, 3, (30,))
    x[torch.arange(30), y] += 6.0
    nw = _train(model, opt, lambda i: crit(model(x), y), mode=mode, steps=15, crits=(crit,))
    assert nw.history[0].loss > 0  # it came down
    d = _diags(nw, "NW304")[0]
    assert d.severity == "info"
    assert d.title == "Zero gradients: the loss reached its minimum (0), nothing is left to learn"


# ------------------------------------------------ NW312: an lr stuck at exactly 0


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _regression(model: nn.Module) -> Callable[[int], torch.Tensor]:
    return lambda i: (model(torch.randn(32, 8)) - 1).pow(2).mean()


@pytest.mark.parametrize("mode", MODES)
def test_an_integer_division_warmup_that_keeps_the_lr_at_zero_is_named(mode: str) -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    warm = 100
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: s // warm if s < warm else 1)
    nw = _train(model, opt, _regression(model), mode=mode, sched=sched)
    found = _diags(nw, "NW312")
    assert found, "no NW312"
    d = found[0]
    assert d.severity == "warning"
    assert d.step == 4  # the fifth step at lr 0: early
    assert any("lr is exactly 0 for the last 5 optimizer steps" in e for e in d.evidence)
    assert any("LambdaLR" in e for e in d.evidence)
    assert any(
        "s // warm, an integer division: 0 for every step below warm" in e for e in d.evidence
    )
    line = d.fix.splitlines()[0]
    assert line.startswith("sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: s / warm")
    # the fix, pasted, gives an lr above 0 after the first step
    ns: dict[str, Any] = {"torch": torch, "opt": torch.optim.SGD(_mlp().parameters(), 1.0)}
    ns["warm"] = warm
    exec(line, ns)
    ns["opt"].step()
    ns["sched"].step()
    assert ns["sched"].get_last_lr()[0] > 0


@pytest.mark.parametrize("mode", MODES)
def test_an_optimizer_made_with_lr_zero_is_named(mode: str) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    d = _diags(_train(model, opt, _regression(model), mode=mode), "NW312")[0]
    assert any("lr is exactly 0 for the last 5 optimizer steps" in e for e in d.evidence)
    assert not any("//" in e for e in d.evidence)
    assert d.fix.splitlines()[-1].endswith(" = torch.optim.SGD(model.parameters(), lr=1e-3)")


def _warmup(opt: torch.optim.Optimizer, kind: str) -> Any:
    if kind == "hf_linear":
        from transformers import get_linear_schedule_with_warmup

        return get_linear_schedule_with_warmup(opt, 3, 100)  # lr 0 at step 0, then rises
    if kind == "true_division":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 3))
    return torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=3)


@pytest.mark.parametrize("kind", ["hf_linear", "true_division", "linear_lr"])
@pytest.mark.parametrize("mode", MODES)
def test_a_warmup_that_starts_at_zero_and_rises_is_silent(kind: str, mode: str) -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    sched = _warmup(opt, kind)
    nw = _train(model, opt, _regression(model), mode=mode, sched=sched, steps=10)
    assert not _diags(nw, "NW312")


def test_a_scheduler_kept_on_an_attribute_of_the_loop_is_found() -> None:
    # the scheduler is no local of the loop: it hangs on the model, one level down
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    model._sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: s // 50)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
            for _ in range(6):
                (model(torch.randn(32, 8)) - 1).pow(2).mean().backward()
                opt.step()
                model._sched.step()
                opt.zero_grad()
                nw.step()
    d = _diags(nw, "NW312")[0]
    assert any(e.startswith("LambdaLR (model._sched) sets it") for e in d.evidence)
    assert "lambda s: s / 50" in d.fix
