"""NW101/NW102/NW104 on failures found by user testing (second round): a float16 overflow
that a learning-rate jump caused (blamed on the lr and its param group, not on float16),
the lr fix of one param group, clipping inside an LBFGS closure, torch.special.i0's
overflow (like exp; its log through i0e), no lr or clipping fix before any update,
amax-scaled float8 casts (silent), a float8 cast fix that keeps the user's line, float16
fixes that lead with the dtype-independent one (scale first, subtract the max), the batch
that jumped in float16, and a weight written outside the optimizer.

Each runs a tiny real model under ``nanwatch.watch`` on CPU, or hand-built records, and
the fixes that claim to be code are executed."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

import nanwatch
from nanwatch.rules.testing import TraceBuilder, diagnose, stat
from tests._diagnoses import first_bad, text, top
from tests.zoo import TanhMLP


def train(
    model: nn.Module, opt: torch.optim.Optimizer, *, steps: int, dtype: torch.dtype
) -> nanwatch.Watcher:
    crit = nn.MSELoss()
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for _ in range(steps):
            x, y = torch.randn(64, 8).to(dtype), torch.randn(64, 1)
            crit(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
            if nw.history[-1].anomaly is not None:
                break
    return nw


# ---------------------------------------------------------------- 1: an lr jump in float16


def test_a_float16_overflow_after_an_lr_jump_names_the_lr_not_float16() -> None:
    """Adam lr 3e4 (for 3e-4): weights 0.35 -> 30000 in one update; it said 'float32 for
    this product / bfloat16'."""
    torch.manual_seed(0)
    model = TanhMLP().half()
    opt = torch.optim.Adam(model.parameters(), lr=3e4, fused=True)
    nw = train(model, opt, steps=4, dtype=torch.float16)
    d = top(nw)
    assert (first_bad(nw).step, d.code, d.path) == (1, "NW101", "fc1")
    line = next(e for e in d.evidence if e.startswith("the values jumped in one step"))
    assert line.startswith("the values jumped in one step: fc1's outputs reached max |x| = ")
    assert (
        "while its inputs did not grow: its weights changed, by the optimizer update in "
        "between (Adam lr 30000)" in line
    )
    assert d.fix.splitlines()[0] == (
        'for g in opt.param_groups: g["lr"] = 1e-3   # was 30000 (Adam): far above any '
        "usable learning rate"
    )
    assert "autocast" not in d.fix and "bfloat16" not in d.fix and "float32" not in d.fix


def test_a_float16_param_group_whose_lr_jumped_its_weights_is_named() -> None:
    """head lr 1e3: the update writes inf into the gradients next step; it said 'GradScaler
    + autocast', which does not fix it. The module whose outputs outgrew its inputs (fc2)
    is named, and its group (the watcher noted it when fc2's weights went inf)."""
    torch.manual_seed(0)
    model = TanhMLP().half()
    opt = torch.optim.SGD(
        [
            {"params": model.fc1.parameters(), "lr": 1e-2},
            {"params": model.fc2.parameters(), "lr": 1e3},
        ]
    )
    nw = train(model, opt, steps=4, dtype=torch.float16)
    d = top(nw)
    assert (first_bad(nw).step, d.code) == (1, "NW101")
    assert any(e.startswith("the values jumped in one step: fc2's outputs") for e in d.evidence)
    assert "GradScaler" not in d.fix and "autocast" not in d.fix
    first = d.fix.splitlines()[0]
    assert first == (
        'opt.param_groups[1]["lr"] = 1e-3   # was 1000 (SGD): the group holding fc2\'s '
        "weights; leave the others (0: 0.01)"
    )
    exec(first, {"optimizer": opt, "opt": opt})
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 1e-3]


def group_trace(step: int, head: float, *, names: bool, lrs: tuple[float, float]) -> Any:
    """A float16 MLP's records: fc2's outputs at ``head`` while its inputs stay at 1; the
    optimizer note of two groups (with their parameter names when ``names``)."""
    b = TraceBuilder(step)
    net = b.call("MLP", root=True)
    x = b.input(net, stat(-2.0, 2.0, numel=64), shape=(8, 8), dtype="float16")
    fc1 = b.call("fc1", "Linear", parent=net)
    b.input(fc1, source=x, dtype="float16", shape=(8, 8))
    h = b.forward(fc1, stat(-1.0, 1.0, numel=64), dtype="float16", shape=(8, 8))
    fc2 = b.call("fc2", "Linear", parent=net)
    b.input(fc2, source=h, dtype="float16", shape=(8, 8))
    bad = math.inf if step else head
    o = b.forward(fc2, stat(-head, bad, numel=8, finite_amax=head), dtype="float16", shape=(8, 1))
    b.forward(net, source=o, dtype="float16", shape=(8, 1))
    groups = [
        {"group": i, "params": 2, "dtypes": ["float16"], "lr": lr}
        | ({"names": [f"{m}.weight", f"{m}.bias"]} if names else {})
        for i, (m, lr) in enumerate((("fc1", lrs[0]), ("fc2", lrs[1])))
    ]
    b.note("optimizer", "SGD", groups=groups)
    return b.build()


def test_the_lr_fix_of_several_groups_names_the_group_holding_the_weights_that_grew() -> None:
    """It divided every group: the diverging one still diverged, the healthy one slowed."""
    history = [group_trace(0, 0.5, names=True, lrs=(1e-3, 10.0))]
    d = next(
        d
        for d in diagnose(group_trace(1, 2000.0, names=True, lrs=(1e-3, 10.0)), history=history)
        if d.code == "NW101"
    )
    assert "SGD lr 10 in param group 1, which holds fc2's weights" in text(d)
    assert d.fix.splitlines()[0] == (
        'optimizer.param_groups[1]["lr"] = 1   # was 10 (SGD): the group holding fc2\'s '
        "weights; leave the others (0: 1e-3)"
    )
    opt = torch.optim.SGD(
        [{"params": [nn.Parameter(torch.ones(1))], "lr": lr} for lr in (1e-3, 10.0)]
    )
    exec(d.fix.splitlines()[0], {"optimizer": opt})
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 1]


# ---------------------------------------------------------------- 3: a closure optimizer


def test_lbfgs_clipping_goes_inside_the_closure() -> None:
    """clip_grad_norm_ 'before step()' does nothing for LBFGS, whose step re-runs the
    closure."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 1))
    crit = nn.MSELoss()
    opt = torch.optim.LBFGS(model.parameters(), lr=1e12, max_iter=1)
    x, y = torch.randn(32, 4), torch.randn(32, 1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = crit(model(x), y)
        loss.backward()
        return loss

    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for _ in range(6):
            opt.step(closure)
            nw.step()
            if nw.history[-1].anomaly is not None:
                break
    d = top(nw)
    assert d.code == "NW101"
    clip = next(line for line in d.fix.splitlines() if "clip_grad_norm_" in line)
    assert clip.endswith(
        "# inside the closure, right after loss.backward(): step() re-evaluates the closure"
    )
    assert "before step()" not in d.fix


# ---------------------------------------------------------------- 4: i0 and step 0


class VonMises(nn.Module):
    def forward(self, kappa: torch.Tensor) -> torch.Tensor:
        log_i0 = torch.log(torch.special.i0(kappa))
        return log_i0.mean()


def test_i0_overflows_like_exp_and_its_log_goes_through_i0e() -> None:
    """It said 'values exploded' with clip_grad_norm_ and an lr fix before any update."""
    head = nn.Linear(4, 1)
    with torch.no_grad():
        head.bias.fill_(89.0)
        head.weight.fill_(0.5)
    loss_fn = VonMises()
    with nanwatch.watch(head, loss_fn, on_anomaly="record", postmortem=False) as nw:
        kappa = head(torch.ones(8, 4)).squeeze(1)
        loss_fn(kappa).backward()
        nw.step()
    d = top(nw)
    assert (d.code, d.op) == ("NW101", "aten.i0")
    assert d.evidence[0].endswith("float32's largest value, above 88.72: it overflows like exp")
    first = d.fix.splitlines()[0]
    assert first == (
        "log_i0 = (torch.log(torch.special.i0e(kappa)) + kappa.abs())  # was: log_i0 = "
        "torch.log(torch.special.i0(kappa))"
    )
    assert "clip_grad_norm_" not in d.fix and "lr" not in d.fix
    k = torch.tensor([0.5, 50.0, 91.0, 500.0])
    ns: dict[str, Any] = {"torch": torch, "kappa": k}
    exec(first, ns)
    assert bool(torch.isfinite(ns["log_i0"]).all())
    assert torch.allclose(ns["log_i0"][:2], torch.log(torch.special.i0(k[:2].double())).float())


def test_an_overflow_before_any_update_gets_no_lr_or_clipping_fix() -> None:
    """Step 0: the initial weights or the inputs did it, not the learning rate."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(1e19)
    crit = nn.MSELoss()
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        crit(model(torch.ones(2, 4)), torch.zeros(2, 1)).backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW101" and first_bad(nw).step == 0
    assert "clip_grad_norm_" not in d.fix and "param_groups" not in d.fix


# ---------------------------------------------------------------- 5, 6: float8


class Quant(nn.Module):
    def __init__(self, dtype: torch.dtype, *, scaled: bool) -> None:
        super().__init__()
        self.dtype, self.scaled = dtype, scaled

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = x.detach().abs().amax() / torch.finfo(self.dtype).max if self.scaled else torch.ones(())
        return (x / s).to(self.dtype), s


class QNet(nn.Module):
    def __init__(self, dtype: torch.dtype, *, scaled: bool) -> None:
        super().__init__()
        self.l1, self.q, self.l2 = nn.Linear(16, 32), Quant(dtype, scaled=scaled), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, s = self.q(self.l1(x))
        return self.l2(q.float() * s)


def fp8_run(dtype: torch.dtype, *, scaled: bool, xscale: float) -> nanwatch.Watcher:
    torch.manual_seed(0)
    model, crit = QNet(dtype, scaled=scaled), nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), 1e-4)
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            crit(model(torch.randn(8, 16) * xscale), torch.randn(8, 4)).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


def test_amax_scaled_float8_quantization_is_silent() -> None:
    """NW102 fired on every healthy step: amax scaling puts the max at finfo.max by design."""
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        nw = fp8_run(dtype, scaled=True, xscale=1.0)
        assert not [d.code for t in nw.history for d in t.diagnoses], dtype


def test_what_a_cast_past_the_max_makes_is_asked_of_torch() -> None:
    """'overflows to inf' is false for e4m3fn: the cast saturates to 448 (torch >= 2.13) or
    makes NaN (torch 2.11): what this torch does is the answer."""
    from nanwatch.rules.overflow import _past_max

    made = float(torch.tensor([448.0 * 4]).to(torch.float8_e4m3fn).float())
    assert math.isnan(made) or made == 448.0
    said = _past_max("float8_e4m3fn")
    assert said == "NaN" if math.isnan(made) else said.startswith("±448 (it saturates")
    assert _past_max("float8_e5m2") == "±inf"
    assert _past_max("float16") == "±inf"


def test_a_float8_cast_overflow_fix_keeps_the_users_line_and_scales_it() -> None:
    """It replaced a return with an assignment (y = x.clamp(...)) that cannot be pasted."""
    from nanwatch.rules.overflow import _fix_cast

    nw = fp8_run(torch.float8_e5m2, scaled=False, xscale=3e5)
    d = top(nw)
    assert (d.code, d.op) == ("NW101", "aten._to_copy")
    lines = d.fix.splitlines()
    assert lines[1] == (
        "return ((x / s) / scale).to(self.dtype), s  # was: return (x / s).to(self.dtype), s"
    )
    # pasted into the module's forward, the cast is finite
    x = torch.randn(8, 32) * 3e5
    src = "def f(self, x, s):\n" + "\n".join(f"    {line}" for line in lines[:2])
    ns: dict[str, Any] = {"torch": torch}
    exec(src, ns)
    q, _ = ns["f"](Quant(torch.float8_e5m2, scaled=False), x, torch.ones(()))
    assert q.dtype == torch.float8_e5m2 and bool(torch.isfinite(q.float()).all())
    assert _fix_cast("y = h.half()", "float16").splitlines()[1] == (
        "y = h.clamp(fin.min, fin.max).half()  # was: y = h.half()"
    )


# ---------------------------------------------------------------- 7: float16 fixes


class Attn(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        s = q @ k.transpose(-1, -2)
        return torch.softmax(s, -1) @ v


def test_an_unscaled_float16_attention_product_is_computed_in_float32() -> None:
    """It said 'with torch.autocast(..., enabled=False): s = q.float() @ ...' (a dtype
    mismatch on the next line) and 'cast back with .to(torch.float16)' (inf again). Scaling
    q first would change what this model computes (its softmax has no 1/sqrt(d) to move):
    the product is taken in float32."""
    from nanwatch.rules.overflow import _scaled_scores

    torch.manual_seed(0)
    model = Attn(64).half()
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(torch.randn(2, 8, 64).half() * 100).float().sum().backward()
        nw.step()
    d = top(nw)
    assert (d.code, d.op) == ("NW101", "aten.bmm")
    first = d.fix.splitlines()[0]
    assert first == (
        "s = q.float() @ k.transpose(-1, -2).float()  # was: s = q @ k.transpose(-1, -2)"
    )
    assert "autocast(device_type='cpu', enabled=False)" not in d.fix
    assert "if needed" not in d.fix
    with torch.no_grad():
        x = torch.randn(2, 8, 64).half() * 100
        q, k = model.q(x), model.k(x)
        ns: dict[str, Any] = {"q": q, "k": k}
        exec(first, ns)
    assert ns["s"].dtype == torch.float32 and bool(torch.isfinite(ns["s"]).all())
    assert _scaled_scores("g = f @ f.t()") == "g = (f * f.shape[-1] ** -0.5) @ f.t()"
    assert _scaled_scores("y = a @ b") is None


class HandSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.body(x)
        e = torch.exp(z)
        return e / e.sum(-1, keepdim=True)


def test_a_float16_softmax_by_hand_subtracts_the_max_first() -> None:
    """It said 'e = torch.exp(z.float())' with 'cast back if needed'; in float32 the rule
    said 'subtract the row max'."""
    torch.manual_seed(0)
    model = HandSoftmax().half()
    with torch.no_grad():
        model.body.weight.fill_(1.0)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(torch.full((2, 4), 8.0).half()).float().sum().backward()
        nw.step()
    d = top(nw)
    assert (d.code, d.op) == ("NW101", "aten.exp")
    lines = d.fix.splitlines()
    assert lines[0] == "e = torch.exp(z - z.amax(dim=-1, keepdim=True))  # was: e = torch.exp(z)"
    assert "if needed" not in d.fix and "autocast" not in d.fix
    z = torch.full((2, 4), 20.0).half()
    ns: dict[str, Any] = {"torch": torch, "z": z}
    exec(lines[0], ns)
    assert bool(torch.isfinite(ns["e"]).all())


def test_a_float16_batch_that_jumped_earlier_is_blamed_and_the_trend_says_it_jumped() -> None:
    """The batch jumped ×1500 at step 8 and overflowed at step 9: nothing said 'the batch
    did it' in float16; NW104 said 'grew over 4 steps' though they jumped in one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))
    crit = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for step in range(12):
            dt = torch.float16 if step >= 5 else torch.float32
            if step == 5:
                model.half()
            x = (torch.randn(16, 6) * (3000 if step >= 8 else 2)).to(dt)
            crit(model(x).float(), torch.randint(0, 3, (16,))).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
            if nw.history[-1].anomaly is not None:
                break
    t = first_bad(nw)
    d = top(nw)
    assert (t.step, d.code) == (9, "NW101")
    line = next(e for e in d.evidence if e.startswith("the batch did it"))
    assert "(the batches have been this large since step 8)" in line
    assert d.fix.startswith("bad = x.abs().flatten(1).amax(dim=1) > ")
    warn = next(d for t in nw.history for d in t.diagnoses if d.code == "NW104")
    assert " jumped from " in warn.evidence[0] and " at step 7 to " in warn.evidence[0]


# ---------------------------------------------------------------- 8: a weight set by hand


def test_a_weight_written_outside_the_optimizer_is_not_called_growth_in_training() -> None:
    """bias.fill_(300) under no_grad at step 3: it said 'the values grew during training'."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for step in range(6):
            if step == 3:
                with torch.no_grad():
                    model[1].bias.fill_(300.0)
            torch.exp(model(torch.randn(4, 6))).sum().backward()
            opt.step()
            opt.zero_grad()
            nw.step()
            if nw.history[-1].anomaly is not None:
                break
    d = top(nw)
    assert (first_bad(nw).step, d.code) == (3, "NW101")
    assert "grew during training" not in text(d)
    assert (
        "the values jumped in one step: 1's outputs reached max |x| = " in text(d)
        and "or by code that wrote them outside it (a fill_ under no_grad, a loaded checkpoint)"
        in text(d)
    )


def test_without_the_groups_parameter_names_the_fix_prints_them_instead_of_dividing_all() -> None:
    history = [group_trace(0, 0.5, names=False, lrs=(1e-3, 10.0))]
    d = next(
        d
        for d in diagnose(group_trace(1, 2000.0, names=False, lrs=(1e-3, 10.0)), history=history)
        if d.code == "NW101"
    )
    lines = d.fix.splitlines()
    assert lines[0] == (
        "# SGD's param groups have lr 1e-3, 10: lower the lr of the group holding fc2's "
        "weights, not all of them; which group holds which weights:"
    )
    assert "/= 10" not in d.fix
    model = TanhMLP()
    opt = torch.optim.SGD(
        [
            {"params": model.fc1.parameters(), "lr": 1e-3},
            {"params": model.fc2.parameters(), "lr": 10.0},
        ]
    )
    out: list[tuple[Any, ...]] = []
    exec(lines[1], {"optimizer": opt, "model": model, "print": lambda *a: out.append(a)})
    assert out == [(0, 1e-3, ["fc1.weight", "fc1.bias"]), (1, 10.0, ["fc2.weight", "fc2.bias"])]
