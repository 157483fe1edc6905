"""Optimizers and hand-written updates as users write them: the diagnosis of non-finite
weights names the user's own optimizer, learning rate and param group (never a new
optimizer), tells a hand-written ``p -= lr * p.grad`` from code that is no update, and a
fix pasted into the loop runs and fixes it (NW301, NW304, NW306)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.records import Note, StepTrace
from nanwatch.rules.base import Diagnosis
from nanwatch.rules.testing import TraceBuilder, diagnose, stat
from tests._diagnoses import code_lines, counted, first_bad
from tests.zoo import TanhMLP

NAN, INF = math.nan, math.inf


def _nw301(nw: Any) -> tuple[StepTrace, Diagnosis]:
    t = first_bad(nw)
    (d,) = [d for d in t.diagnoses if d.code == "NW301"]
    return t, d


def _resumed_adam() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model and an Adam resumed from a checkpoint whose exp_avg_sq of fc1.weight holds a
    NaN (saved from a run that had gone bad); the weights themselves are fine."""
    torch.manual_seed(0)
    model, crit = TanhMLP(), nn.MSELoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(32, 8)
    crit(model(x), x.sum(1, keepdim=True)).backward()
    opt.step()
    opt.zero_grad()
    ck = {"model": model.state_dict(), "opt": opt.state_dict()}
    ck["opt"]["state"][0]["exp_avg_sq"][3, 5] = NAN
    resumed = TanhMLP()
    resumed.load_state_dict(ck["model"])
    opt2 = torch.optim.Adam(resumed.parameters(), lr=1e-3)
    opt2.load_state_dict(ck["opt"])
    return resumed, opt2


def _train_resumed_adam() -> Any:
    model, opt = _resumed_adam()
    crit = nn.MSELoss()
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            x = torch.randn(32, 8)
            crit(model(x), x.sum(1, keepdim=True)).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


# ---------------------------------------------------------------- NW301: the optimizer


def test_a_nan_in_a_resumed_adam_state_is_not_blamed_on_the_learning_rate() -> None:
    """It said 'a learning rate far too high' and pasted SGD(lr=1e-3) + clipping for an Adam
    at lr 1e-3 whose gradient norm was 2.7: the NaN came from the loaded state."""
    _, d = _nw301(_train_resumed_adam())
    assert d.parameter == "fc1.weight"
    # the watcher read Adam's state of the bad weight: the key is named
    assert d.title == "Non-finite optimizer state"
    assert "Adam's state for fc1.weight holds NaN/inf: exp_avg_sq (lr 1e-3 is finite)" in (
        d.evidence
    )
    assert "Lowering the learning rate or clipping the gradients does not remove it" in (
        d.explanation
    )
    assert "far too high" not in d.explanation
    assert "torch.optim.SGD" not in d.fix and "clip_grad_norm_" not in d.fix
    assert "opt.state.items()" in d.fix


def test_the_optimizer_state_fix_finds_and_resets_the_nan_state() -> None:
    """The fix, pasted right after the load, names the bad state and resets it: training
    then stays finite."""
    _, d = _nw301(_train_resumed_adam())
    model, optimizer = _resumed_adam()
    out: list[tuple[Any, ...]] = []
    scope = {"torch": torch, "model": model, "optimizer": optimizer, "opt": optimizer}
    exec(d.fix, {**scope, "print": lambda *args: out.append(args)})
    assert out == [("fc1.weight", ["exp_avg_sq"])]
    crit = nn.MSELoss()
    for _ in range(3):
        x = torch.randn(32, 8)
        crit(model(x), x.sum(1, keepdim=True)).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_an_optimizer_state_fact_names_the_bad_state_key() -> None:
    """With the watcher's "optimizer_state" note (the state keys that hold NaN/inf, read
    when the weight was found bad), the diagnosis names the key."""
    nw = _train_resumed_adam()
    t = first_bad(nw)
    history = [h for h in nw.history if h.step < t.step]
    t.notes[:] = [n for n in t.notes if n.kind != "optimizer_state"]  # the watcher's own
    d = next(d for d in diagnose(t, history) if d.code == "NW301")
    assert d.title == "Non-finite weights after an optimizer step"
    assert "updated at step 0 by Adam (lr 1e-3, param group 0)" in d.evidence
    assert "the learning rate is not too high and clipping will not help" in d.explanation
    t.notes.append(
        Note("optimizer_state", "Adam", {"optimizer_state_bad": [["fc1.weight", "exp_avg_sq"]]})
    )
    d = next(d for d in diagnose(t, history) if d.code == "NW301")
    assert d.title == "Non-finite optimizer state"
    assert "Adam's state for fc1.weight holds NaN/inf: exp_avg_sq (lr 1e-3 is finite)" in (
        d.evidence
    )
    assert "Lowering the learning rate or clipping the gradients does not remove it" in (
        d.explanation
    )
    # another weight's bad state does not name this one
    t.notes[-1] = Note("optimizer_state", "Adam", {"optimizer_state_bad": [["fc2.bias", "x"]]})
    d = next(d for d in diagnose(t, history) if d.code == "NW301")
    assert d.title == "Non-finite weights after an optimizer step"


def test_float16_adam_with_a_huge_lr_is_told_clipping_does_not_bound_its_step() -> None:
    """Adam at lr=3e4 (for 3e-4) on float16 weights: the fix sets that optimizer's lr, does
    not clip (Adam's step is about lr whatever the gradient) and keeps Adam."""
    torch.manual_seed(0)
    model, crit = TanhMLP().half(), nn.MSELoss()
    opt = torch.optim.Adam(model.parameters(), lr=3e4, eps=1e-4)
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for _ in range(5):
            x = torch.randn(64, 8).half()
            crit(model(x).float(), torch.randn(64, 1)).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    _, d = _nw301(nw)
    assert "updated at step 0 by Adam (lr 30000, param group 0)" in d.evidence
    assert "clipping the gradients does not bound the step, only the lr does" in d.explanation
    assert "At lr 30000 a weight reaches float16's largest value 65504 in about 2.183 steps" in (
        d.explanation
    )
    assert d.fix.splitlines()[0] == ('opt.param_groups[0]["lr"] = 1e-3   # was 30000 (Adam)')
    assert "clip_grad_norm_" not in d.fix and "torch.optim." not in d.fix


def test_centered_rmsprop_nan_names_the_square_root_not_the_lr() -> None:
    """RMSprop(centered=True): sqrt(square_avg - grad_avg²) of a constant gradient goes below
    0 by rounding. It was told 'a learning rate far too high' with an SGD fix."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1))
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3, alpha=0.5, centered=True)
    x = torch.ones(16, 4) * 0.3
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for _ in range(60):
            model(x).mean().backward()  # a linear loss: the same gradient every step
            opt.step()
            opt.zero_grad()
            nw.step()
            if nw.history[-1].anomaly is not None:
                break
    _, d = _nw301(nw)
    assert any(e.endswith("by RMSprop (lr 1e-3, param group 0)") for e in d.evidence)
    assert "RMSprop(centered=True) takes sqrt(square_avg - grad_avg²)" in d.explanation
    assert "far too high" not in d.explanation
    first = d.fix.splitlines()[0]
    assert first.startswith('opt.param_groups[0]["centered"] = False')  # the loop's name
    # pasted, it turns centering off: the same loop then stays finite
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1))
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, alpha=0.5, centered=True)
    exec(first, {"opt": optimizer})
    for _ in range(60):
        model(x).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_lbfgs_that_overflows_float16_weights_gets_a_line_search() -> None:
    torch.manual_seed(0)
    model, crit = nn.Linear(8, 1).half(), nn.MSELoss()
    opt = torch.optim.LBFGS(model.parameters(), lr=1e30, max_iter=4)
    x = torch.randn(64, 8).half()
    y = x.float().sum(1, keepdim=True)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = crit(model(x).float(), y)
        loss.backward()
        return loss

    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(model, crit) as nw:
        for _ in range(2):
            opt.step(closure)  # its inner iterations write inf into the weights
            nw.step()
    (d,) = [d for d in info.value.diagnoses if d.code == "NW301"]
    assert "LBFGS moves the weights by lr × its quasi-Newton direction" in d.explanation
    assert d.fix.splitlines()[:2] == [
        'opt.param_groups[0]["line_search_fn"] = "strong_wolfe"   # a line search picks '
        "each step's length",
        'opt.param_groups[0]["lr"] = 1   # was 1e30 (LBFGS)',
    ]
    assert "SGD" not in d.fix and "clip_grad_norm_" not in d.fix


def test_sgd_whose_lr_is_too_high_keeps_its_own_optimizer_in_the_fix() -> None:
    """SGD at lr=1e3 on float16 weights fed small inputs: the weights overflow before any
    output does. lr × gradient is large, so the lr is to blame, and the fix lowers that
    optimizer's lr instead of building a new SGD(lr=1e-3)."""
    torch.manual_seed(0)
    model, crit = nn.Sequential(nn.Linear(8, 1, bias=False)).half(), nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e3)
    x = (0.05 * torch.randn(64, 8)).half()
    y = torch.randn(64, 1)
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for _ in range(12):
            crit(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
            if nw.first_anomaly is not None:
                break
    _, d = _nw301(nw)
    assert "updated at step 5 by SGD (lr 1000, param group 0)" in d.evidence
    assert "Each update is lr × gradient: 1000 × 110.4 = 1.104e+05 here." in d.explanation
    assert d.fix.splitlines()[:2] == [
        "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # before "
        "optimizer.step()",
        # the NW308 warning of step 2 sized the lr from its update: the error keeps it
        'opt.param_groups[0]["lr"] = 0.05   # was 1000 (SGD); not 100: the NW308 warning of '
        "step 2 asked for 0.05 already, the lower of the two",
    ]
    assert "torch.optim.SGD(" not in d.fix


def test_an_inf_that_an_ordinary_update_cannot_write_points_at_the_optimizer_state() -> None:
    """SGD(momentum=0.9) resumed with an inf in its momentum buffer: lr 0.1 and a gradient of
    norm about 3 cannot overflow float32, so the lr is not blamed."""
    torch.manual_seed(0)
    model, crit = TanhMLP(), nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(32, 8)
    crit(model(x), x.sum(1, keepdim=True)).backward()
    opt.step()
    opt.zero_grad()
    sd = opt.state_dict()
    sd["state"][2]["momentum_buffer"][0, 1] = INF  # fc2.weight
    opt.load_state_dict(sd)
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            x = torch.randn(32, 8)
            crit(model(x), x.sum(1, keepdim=True)).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    t, d = _nw301(nw)
    assert d.parameter == "fc2.weight"
    assert d.title == "Non-finite optimizer state"
    assert "SGD's state for fc2.weight holds NaN/inf: momentum_buffer (lr 0.1 is finite)" in (
        d.evidence
    )
    assert "opt.state.items()" in d.fix and "clip_grad_norm_" not in d.fix
    # without the state the watcher read, the size of one update still clears the lr
    t.notes[:] = [n for n in t.notes if n.kind != "optimizer_state"]
    history = [h for h in nw.history if h.step < t.step]
    d = next(d for d in diagnose(t, history) if d.code == "NW301")
    assert any(
        e.startswith("one update of SGD at this lr moves a weight by at most about ")
        and e.endswith("far below float32's largest value 3.4e+38")
        for e in d.evidence
    )
    assert "the learning rate is not the cause and clipping will not help" in d.explanation
    assert "optimizer.state.items()" in d.fix and "clip_grad_norm_" not in d.fix


# ---------------------------------------------------------------- NW301: hand-written updates


def _manual_sgd(data: bool) -> Any:
    torch.manual_seed(0)
    model, crit, lr = nn.Sequential(nn.Linear(8, 1, bias=False)).half(), nn.MSELoss(), 1e3
    x = (0.05 * torch.randn(64, 8)).half()
    y = torch.randn(64, 1)
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for _ in range(12):
            crit(model(x).float(), y).backward()
            for p in model.parameters():
                if data:  # the old style: no version bump, no step nanwatch can see
                    p.data.add_(p.grad.data, alpha=-lr)
                    p.grad.data.zero_()
                else:
                    with torch.no_grad():
                        p -= lr * p.grad  # noqa: PLW2901 (in place: the users' own style)
                    p.grad = None
            if nw.first_anomaly is not None:
                break
    return nw


def test_a_hand_written_sgd_update_that_overflows_is_an_update_not_other_code() -> None:
    """p -= lr * p.grad under no_grad was 'written outside an optimizer step ... The learning
    rate is not the cause'."""
    _, d = _nw301(_manual_sgd(data=False))
    assert d.title == "Non-finite weights after a hand-written update"
    assert (
        "no torch.optim step updated 0.weight; it was written after the backward of step 5, "
        "which gave it a finite gradient (norm 110.4): a hand-written update (p -= lr * p.grad)"
    ) in d.evidence
    assert "The learning rate is not the cause" not in d.explanation
    assert "Its learning rate is too high for these gradients" in d.explanation
    assert d.fix.splitlines()[:2] == [
        "# your update p -= lr * p.grad: make lr 10 times lower, and clip before it:",
        "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)",
    ]


def test_a_data_update_is_not_called_loaded_when_the_weights_were_finite_at_attach() -> None:
    """p.data.add_(p.grad.data, alpha=-lr) bumps no version: it was 'before the first
    update ... loaded that way' with a torch.load fix."""
    _, d = _nw301(_manual_sgd(data=True))
    assert d.title == "Non-finite weights after a hand-written update"
    assert "torch.load" not in d.fix and "loaded" not in d.explanation
    assert any(
        "gradient norm grew from 0.0385 to 110.4 over 6 backward passes" in e for e in d.evidence
    )


def _front_weight_trace(writer: dict[str, Any], *, grad: bool) -> StepTrace:
    """Step 0, a weight found non-finite ahead of the step's records; the model's forward
    (and, with ``grad``, its backward) ran finite."""
    b = TraceBuilder(0)
    w = b.parameter("fc1", "fc1.weight", counted(-INF, 1.0, neginf=1, finite_amax=1.0))
    w.index = -1  # recorded ahead of the step's records
    net = b.call("Net", root=True)
    b.input(net, stat(-1.0, 1.0))
    fc1 = b.call("fc1", "Linear", parent=net)
    h = b.forward(fc1, stat(-1.0, 1.0))
    if grad:
        b.backward(h, stat(-0.1, 0.1))
        b.gradient("fc1", "fc1.weight", 0.5)
    b.note("weight_writer", "fc1", parameter="fc1.weight", optimizer=None, group=None,
           after_optimizer=None, since_attach=False, **writer)  # fmt: skip
    t = b.build()
    assert t.anomaly is not None and t.anomaly.parameter == "fc1.weight"
    return t


def test_a_weight_finite_at_attach_and_written_unseen_was_not_loaded_so() -> None:
    """The watcher's finite_at_attach: a write that left the version alone (.data) after
    the attach check found the weight finite is not 'loaded that way'."""
    d = next(d for d in diagnose(_front_weight_trace({"finite_at_attach": True}, grad=False))
             if d.code == "NW301")  # fmt: skip
    assert d.title == "Non-finite weights written outside an optimizer step"
    assert any("nanwatch's check at attach found it finite" in e for e in d.evidence)
    # found bad at attach: loaded, whatever the gradients say
    d = next(d for d in diagnose(_front_weight_trace({"finite_at_attach": False}, grad=True))
             if d.code == "NW301")  # fmt: skip
    assert d.title == "Non-finite weights before the first update"


# ---------------------------------------------------------------- NW301: a NaN learning rate


def test_a_nan_lr_set_by_hand_gets_no_scheduler_in_its_fix() -> None:
    """A poly decay computed past its last step (numpy: NaN) and written into param_groups
    by hand: the fix pasted scheduler.step(), and there is no scheduler."""
    torch.manual_seed(0)
    model, crit = TanhMLP(), nn.MSELoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    total = 4
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for step in range(6):
            base = 1 - step / total
            lr = 1e-3 * base**0.9 if base >= 0 else NAN  # numpy's power of a negative
            opt.param_groups[0]["lr"] = lr
            x = torch.randn(32, 8)
            crit(model(x), x.sum(1, keepdim=True)).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    _, d = _nw301(nw)
    assert d.title == "Non-finite learning rate"
    assert "scheduler" not in d.fix
    assert code_lines(d.fix).splitlines() == [
        "import math",
        "lr = opt.param_groups[0]['lr']",
        "assert math.isfinite(lr), lr   # right after each change of the lr",
    ]


def test_a_nan_lr_of_a_scheduled_group_names_the_scheduler() -> None:
    """A group a torch scheduler manages holds "initial_lr": the check goes after its
    step()."""
    nw = _train_resumed_adam()
    t = first_bad(nw)
    note = next(n for n in t.notes if n.kind == "optimizer")
    note.data["groups"][0].update(lr=NAN, initial_lr=1e-3)
    d = next(d for d in diagnose(t, [h for h in nw.history if h.step < t.step])
             if d.code == "NW301")  # fmt: skip
    assert d.title == "Non-finite learning rate"
    assert "assert math.isfinite(lr), lr   # right after each change of the lr " in d.fix
    assert "(scheduler.step())" in d.fix


# ---------------------------------------------------------------- NW304: float16 underflow


def _fp16_underflow(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                    y: torch.Tensor) -> torch.Tensor:  # fmt: skip
    return 1e-6 * ((model(x) - y) ** 2).mean()


def test_pure_float16_weights_get_float32_weights_and_a_cpu_scaler() -> None:
    """model.half() and no autocast: GradScaler() is a no-op on the CPU and raises on
    float16 gradients; the fix keeps float32 weights under autocast."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for _ in range(6):
            x = torch.randn(64, 16).half()
            loss = _fp16_underflow(model, opt, x, x[:, :1] * 0.01)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step(loss=loss)
    d = next(d for t in nw.history for d in t.diagnoses if d.code == "NW304")
    assert (
        "gradients are float16: it holds values down to 5.96e-08 (its smallest subnormal; "
        "below 6.1e-05, its smallest normal, precision is lost): values under 2.98e-08 "
        "round to exactly 0; no GradScaler was given"
    ) in d.evidence
    assert "a GradScaler refuses to unscale float16 gradients" in d.explanation
    assert d.fix.splitlines() == [
        "model = model.float()   # float32 weights; float16 in the forward only",
        "with torch.autocast(device_type='cpu', dtype=torch.float16):",
        "    loss = criterion(model(x), y)",
        "scaler = torch.amp.GradScaler('cpu')",
        "scaler.scale(loss).backward()",
        "scaler.step(opt)",
        "scaler.update()   # nanwatch finds the scaler at scaler.scale(loss)",
    ]
    # pasted into the loop, the first layer gets its gradient back
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(64, 16).half()
    y = x[:, :1] * 0.01
    scope: dict[str, Any] = {
        "torch": torch, "model": model, "optimizer": optimizer, "opt": optimizer, "x": x, "y": y,
        "criterion": lambda out, target: 1e-6 * ((out - target) ** 2).mean(),
    }  # fmt: skip
    exec(d.fix, scope)
    grad = scope["model"][0].weight.grad
    assert grad.dtype == torch.float32 and int((grad != 0).sum()) == grad.numel()


# ---------------------------------------------------------------- NW306: one param group


def _wd_groups() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 16), nn.Flatten(), nn.Linear(16 * 5, 2))
    opt = torch.optim.SGD(
        [
            {"params": model[2].parameters(), "weight_decay": 0.0},
            {"params": model[0].parameters(), "weight_decay": 5.0},  # 5e-4 intended
        ],
        lr=0.5,
    )
    return model, opt


def test_a_diverging_weight_decay_names_its_param_group_and_keeps_the_groups() -> None:
    """It pasted torch.optim.SGD(params, lr=0.5, weight_decay=0.01): params undefined, and
    the other group (no decay) lost."""
    model, opt = _wd_groups()
    crit = nn.CrossEntropyLoss()
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            t = torch.randint(0, 100, (32, 5))
            crit(model(t), (t[:, 0] < 50).long()).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW306"
    assert d.evidence[0] == (
        "SGD param group 1 (0.weight): lr 0.5 × weight_decay 5 = 2.5, past 2, the largest "
        "value for which its update stays bounded"
    )
    assert d.fix.splitlines()[0] == (
        "opt.param_groups[1].update(weight_decay=0.01)   # was 5 (SGD, lr 0.5)"
    )
    model, optimizer = _wd_groups()
    exec(code_lines(d.fix), {"optimizer": optimizer, "opt": optimizer})
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.0, 0.01]


def test_a_diverging_weight_decay_names_the_weights_when_the_note_lists_them() -> None:
    b = TraceBuilder(0)
    b.note("optimizer", "AdamW", groups=[
        {"group": 0, "params": 2, "dtypes": ["float32"], "lr": 1e-3, "weight_decay": 0.01},
        {"group": 2, "params": 1, "dtypes": ["float32"], "lr": 1.0, "weight_decay": 3.0,
         "names": ["emb.weight"]},
    ])  # fmt: skip
    d = next(d for d in diagnose(b.build()) if d.code == "NW306")
    assert d.evidence[0].startswith("AdamW param group 2 (emb.weight): lr 1 × weight_decay 3")
    assert d.fix.startswith("optimizer.param_groups[2].update(weight_decay=")
