"""Optimizer settings and training-loop bugs seen before any NaN: a running-average
coefficient >= 1 without weight decay (NW306), a forgotten ``optimizer.zero_grad()`` (NW307,
and the overflow it leads to), stale ``.grad`` of frozen weights, a hand-written update's
headline, and an optimizer error named by the weights' names."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.records import Phase

Loop = Callable[[nn.Sequential, int, dict[str, Any]], None]


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(16, 8)
    return x, x.sum(1, keepdim=True)


# ---------------------------------------------------------------------- NW306


def _set(opt: torch.optim.Optimizer, **values: Any) -> torch.optim.Optimizer:
    """A value the constructor refuses, set as a scheduler (OneCycleLR's cycle_momentum)
    or a hand-edited param group sets it."""
    for g in opt.param_groups:
        g.update(values)
    return opt


@pytest.mark.parametrize(
    ("make", "key", "label"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=1.5, nesterov=True), "momentum",
         "momentum"),
        (lambda ps: _set(torch.optim.Adam(ps, lr=1e-3), betas=(0.9, 1.0)), "betas", "beta2"),
        (lambda ps: _set(torch.optim.AdamW(ps, lr=1e-3), betas=(1.1, 0.999)), "betas", "beta1"),
        (lambda ps: torch.optim.RMSprop(ps, lr=1e-3, alpha=1.0), "alpha", "alpha"),
        (lambda ps: _set(torch.optim.Adadelta(ps), rho=1.5), "rho", "rho"),
    ],
)  # fmt: skip
def test_an_average_coefficient_of_one_or_more_is_an_error_at_step_0_without_decay(
    make: Callable[[Any], torch.optim.Optimizer], key: str, label: str
) -> None:
    model, crit = _mlp(), nn.MSELoss()
    optimizer = make(model.parameters())
    assert not optimizer.param_groups[0]["weight_decay"] or label == "beta1"
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            crit(model(_batch()[0]), _batch()[1]).backward()
            optimizer.step()
            optimizer.zero_grad()
            nw.step()
    first = nw.history[0]
    (d,) = [d for d in first.diagnoses if d.code == "NW306"]
    assert d.step == 0 and d.severity == "error"
    assert d.title == f"Optimizer {label} >= 1: the update grows instead of averaging"
    assert first.diagnoses[0] is d  # before anything else, before any overflow
    exec(d.fix, {"optimizer": optimizer})
    assert optimizer.param_groups[0][key] in (0.9, (0.9, 0.999), 0.99)


def test_the_optimizer_note_stays_small() -> None:
    model, crit = _mlp(), nn.MSELoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        crit(model(_batch()[0]), _batch()[1]).backward()
        optimizer.step()
        nw.step()
    (note,) = [n for n in nw.history[0].notes if n.kind == "optimizer"]
    (g,) = note.data["groups"]
    assert g["betas"] == [0.9, 0.999]
    assert "momentum" not in g and "weight_decay" not in g and len(g) <= 8


# ---------------------------------------------------------------------- NW307


def _forgotten(model: nn.Sequential, i: int, s: dict[str, Any]) -> None:
    opt = s.setdefault("opt", torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    loss = nn.functional.mse_loss(model(_batch()[0]), _batch()[1])
    loss.backward()
    opt.step()  # <- opt.zero_grad() forgotten


def _forgotten_with_clip(model: nn.Sequential, i: int, s: dict[str, Any]) -> None:
    opt = s.setdefault("opt", torch.optim.AdamW(model.parameters(), lr=1e-3))
    nn.functional.mse_loss(model(_batch()[0]), _batch()[1]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # changes .grad in place
    opt.step()


def _train(loop: Loop, steps: int = 4, **kw: Any) -> tuple[Any, list[str], dict[str, Any]]:
    model, state = _mlp(), {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(model, nn.MSELoss(), postmortem=False, **kw) as nw:
            for i in range(steps):
                loop(model, i, state)
                nw.step()
    said = [str(w.message) for w in caught if "nanwatch" in str(w.message)]
    return nw, said, state


@pytest.mark.parametrize("loop", [_forgotten, _forgotten_with_clip])
def test_a_forgotten_zero_grad_is_an_early_warning_with_the_users_optimizer(loop: Loop) -> None:
    nw, said, state = _train(loop)
    (msg,) = [m for m in said if "NW307" in m]
    assert "step 1: NW307 warning: Gradients never reset" in msg
    d = next(d for d in nw.history[1].diagnoses if d.code == "NW307")
    name = type(state["opt"]).__name__
    assert d.evidence[0].startswith(f"{name} (opt) stepped with the .grad of 0.weight, 0.bias")
    assert "(all 4 weights it updates)" in d.evidence[0]
    assert d.fix.startswith("opt.zero_grad()")
    assert d.source is not None and d.source.endswith(f":{loop.__code__.co_firstlineno + 4}")
    assert "clip" not in d.fix and "lr" not in d.fix

    def fixed(model: nn.Sequential, i: int, s: dict[str, Any], fix: str = d.fix) -> None:
        loop(model, i, s)
        exec(fix, {"opt": s["opt"]})  # pasted right after opt.step()

    nw2, said2, _ = _train(fixed)
    assert not said2
    assert all(not t.diagnoses for t in nw2.history)


def _fast_blowup(model: nn.Sequential, i: int, s: dict[str, Any]) -> None:
    opt = s.setdefault("opt", torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    nn.functional.mse_loss(model(_batch()[0]), _batch()[1] * 100).backward()
    opt.step()


def test_the_overflow_a_forgotten_zero_grad_leads_to_is_blamed_on_it() -> None:
    with pytest.raises(nanwatch.AnomalyError) as info:
        _train(_fast_blowup, steps=200)
    err = info.value
    codes = [d.code for d in err.diagnoses]
    d = err.diagnosis
    assert d.code == "NW307" and d.severity == "error", codes
    assert "then, at step" in d.evidence[-1] and "inf" in d.evidence[-1]
    assert d.fix.startswith("opt.zero_grad()")
    assert str(err).splitlines()[1].startswith("  NW307 error: Gradients never reset")


def _zero_after(model: nn.Sequential, i: int, s: dict[str, Any]) -> None:
    opt = s.setdefault("opt", torch.optim.SGD(model.parameters(), lr=0.01))
    nn.functional.mse_loss(model(_batch()[0]), _batch()[1]).backward()
    opt.step()
    opt.zero_grad()


def _zero_before_keep_tensors(model: nn.Sequential, i: int, s: dict[str, Any]) -> None:
    opt = s.setdefault("opt", torch.optim.Adam(model.parameters(), lr=0.01))
    opt.zero_grad(set_to_none=False)
    nn.functional.mse_loss(model(_batch()[0]), _batch()[1]).backward()
    opt.step()


def _model_zero_grad(model: nn.Sequential, i: int, s: dict[str, Any]) -> None:
    opt = s.setdefault("opt", torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    nn.functional.mse_loss(model(_batch()[0]), _batch()[1]).backward()
    opt.step()
    model.zero_grad(set_to_none=False)


def _none_by_hand(model: nn.Sequential, i: int, s: dict[str, Any]) -> None:
    opt = s.setdefault("opt", torch.optim.SGD(model.parameters(), lr=0.01))
    nn.functional.mse_loss(model(_batch()[0]), _batch()[1]).backward()
    opt.step()
    for p in model.parameters():
        p.grad = None


def _zero_by_hand(model: nn.Sequential, i: int, s: dict[str, Any]) -> None:
    opt = s.setdefault("opt", torch.optim.SGD(model.parameters(), lr=0.01))
    nn.functional.mse_loss(model(_batch()[0]), _batch()[1]).backward()
    opt.step()
    for p in model.parameters():
        p.grad.zero_()  # type: ignore[union-attr]


def _accumulate(model: nn.Sequential, i: int, s: dict[str, Any]) -> None:
    opt = s.setdefault("opt", torch.optim.SGD(model.parameters(), lr=0.01))
    for _ in range(3):  # micro-batches: backward adds up, on purpose
        (nn.functional.mse_loss(model(_batch()[0]), _batch()[1]) / 3).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()
    opt.zero_grad(set_to_none=False)


def _subset(model: nn.Sequential, i: int, s: dict[str, Any]) -> None:
    # the first layer is not trained: its .grad adds up, but no optimizer applies it
    opt = s.setdefault("opt", torch.optim.SGD(model[2].parameters(), lr=0.01))
    nn.functional.mse_loss(model(_batch()[0]), _batch()[1]).backward()
    opt.step()
    opt.zero_grad()


def _two_optimizers(model: nn.Sequential, i: int, s: dict[str, Any]) -> None:
    # a GAN's pattern: the second loss's backward reaches the first optimizer's weights
    # after its step; they are reset before that optimizer's next step
    first = s.setdefault("d", torch.optim.SGD(model[2].parameters(), lr=0.01))
    second = s.setdefault("g", torch.optim.SGD(model[0].parameters(), lr=0.01))
    x, y = _batch()
    first.zero_grad(set_to_none=False)
    h = model[1](model[0](x))
    nn.functional.mse_loss(model[2](h.detach()), y).backward()
    first.step()
    second.zero_grad(set_to_none=False)
    nn.functional.mse_loss(model[2](h), -y).backward()
    second.step()


def _lbfgs(model: nn.Sequential, i: int, s: dict[str, Any]) -> None:
    opt = s.setdefault("opt", torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3))
    x, y = _batch()

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    opt.step(closure)


def _freeze_half_way(model: nn.Sequential, i: int, s: dict[str, Any]) -> None:
    opt = s.setdefault("opt", torch.optim.AdamW(model.parameters(), lr=1e-3))
    if i == 2:
        model[0].requires_grad_(False)
    nn.functional.mse_loss(model(_batch()[0]), _batch()[1]).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


@pytest.mark.parametrize(
    "loop",
    [
        _zero_after,
        _zero_before_keep_tensors,
        _model_zero_grad,
        _none_by_hand,
        _zero_by_hand,
        _accumulate,
        _subset,
        _two_optimizers,
        _lbfgs,
        _freeze_half_way,
    ],
)
def test_loops_that_reset_their_gradients_stay_silent(loop: Loop) -> None:
    nw, said, _ = _train(loop, steps=5)
    assert not said
    assert not [d.headline for t in nw.history for d in t.diagnoses]


# ---------------------------------------------------------------------- frozen weights


def test_a_frozen_layers_leftover_grad_is_no_gradient() -> None:
    """A middle layer frozen with requires_grad_(False) under zero_grad(set_to_none=False)
    keeps a .grad of zeros that no backward writes: not a vanishing gradient (NW304), and
    not part of the gradient norm."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(model, nn.MSELoss(), postmortem=False) as nw:
            for i in range(12):
                if i == 2:
                    model[2].requires_grad_(False)
                nn.functional.mse_loss(model(_batch()[0]), _batch()[1]).backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
                nw.step()
    assert not [str(w.message) for w in caught if "nanwatch" in str(w.message)]
    last = nw.history[-1]
    grads = {r.role for r in last.records if r.phase is Phase.GRADIENT}
    assert grads == {"0.weight", "0.bias", "4.weight", "4.bias"}
    assert model[2].weight.grad is not None  # the stale zeros are still there


# ---------------------------------------------------------------------- NW301 headline


def test_a_nan_from_a_hand_written_update_is_called_one_in_the_headline() -> None:
    model, crit = _mlp(), nn.MSELoss()
    warmup = torch.tensor(0.0)
    with pytest.raises(nanwatch.AnomalyError) as info:  # noqa: SIM117
        with nanwatch.watch(model, crit, postmortem=False):
            for step in range(3):
                crit(model(_batch()[0]), _batch()[1]).backward()
                lr = 0.05 * torch.clamp(step / warmup, max=1.0)  # 0 / 0 at step 0
                with torch.no_grad():
                    for p in model.parameters():
                        p -= lr * p.grad  # noqa: PLW2901
                        p.grad = None
    err = info.value
    head = str(err).splitlines()[0]
    assert "written after this step's backward" in head
    assert "a hand-written update, p -= lr * p.grad" in head
    assert "data-dependent init" not in head
    assert err.diagnosis.title == "Non-finite weights after a hand-written update"


# ---------------------------------------------------------------------- post-mortem names


def test_an_optimizer_state_mismatch_names_the_weights_in_the_steps_error() -> None:
    def mk(h: int) -> nn.Sequential:
        return nn.Sequential(nn.Linear(8, h), nn.ReLU(), nn.Linear(h, 1))

    torch.manual_seed(0)
    crit = nn.MSELoss()
    x, y = _batch()
    old = mk(4)
    o = torch.optim.Adam(old.parameters())
    crit(old(x), y).backward()
    o.step()
    model = mk(8)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    optimizer.load_state_dict(o.state_dict())  # a checkpoint of another model
    with pytest.raises(RuntimeError, match="must match"):  # noqa: SIM117
        with nanwatch.watch(model, crit, postmortem=False) as nw:
            crit(model(x), y).backward()
            optimizer.step()
    (error,) = [t.error for t in nw.history if t.error is not None]
    assert error["optimizer"]["mismatch"][0]["param"] == "0.weight"
