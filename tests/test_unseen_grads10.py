"""Gradient rules on unseen loops, round 10: a PINN whose boundary term is exactly 0 while
its residual, differentiated through torch.autograd.grad(create_graph=True), trains every
weight is not "vanishing" (NW304); a logging clip_grad_norm_(..., float("inf")) that turns
gradients past sqrt(float32 max) into NaN is named (NW301), not an optimizer's state; a
log(1 - y) of a target of exactly 1 is a log of 0, not a ratio (NW100); an overflow in a
Linear's backward gets no clue about a hand-written exp."""

from __future__ import annotations

import ast
import math

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.rules.gradients import _max_norm
from tests._diagnoses import first_bad, text, top

torch.set_num_threads(1)


# ------------------------------------------------- NW304: a PINN's boundary term of 0


class _HardBC(nn.Module):
    """u = x (1 - x) N(x): the boundary values are 0 by construction."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x * (1 - x) * self.net(x)
        return out


def test_a_pinn_boundary_term_of_exact_zero_is_not_vanishing_gradients() -> None:
    """The hooks saw only the boundary call's output gradients (0: the term is 0), while
    the residual's gradient reached every weight through the create_graph derivative: it
    was NW304 'every gradient exactly 0' with parameter gradients near 1."""
    torch.manual_seed(0)
    model = _HardBC()
    opt = torch.optim.SGD(model.parameters(), 1e-3)
    xb = torch.tensor([[0.0], [1.0]])
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for _ in range(7):
            x = torch.rand(16, 1, requires_grad=True)
            ux = torch.autograd.grad(model(x).sum(), x, create_graph=True)[0]
            loss = ((ux - 1.0) ** 2).mean() + 10.0 * (model(xb) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            assert model.net[0].weight.grad.abs().max() > 0
            opt.step()
            nw.step()
    assert not [d for t in nw.history for d in t.diagnoses if d.code == "NW304"]


def test_a_module_cut_off_from_the_loss_is_still_vanishing() -> None:
    """The counterpart: no derivative graph, the layer's output is multiplied by 0, its
    weights get exact zeros: still NW304."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), 1e-3)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for _ in range(7):
            loss = (model(torch.randn(8, 4)) * 0.0).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    assert [d for t in nw.history for d in t.diagnoses if d.code == "NW304"]


# ------------------------------------------------- NW301: a logging clip at inf overflows


@pytest.mark.accelerator_weaker(
    reason="the norms are read after the clip wrote NaN into the gradients"
)
def test_a_logging_clip_at_inf_names_the_overflowed_norm_not_the_optimizer_state() -> None:
    """Gradients of 1e19 each: their norm's square overflows float32, clip_grad_norm_
    returns inf and scales every gradient by inf / inf = NaN before step(). It was 'SGD
    wrote NaN ... from a finite gradient ... optimizer running state'."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), 1e-3)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            loss = (model(torch.ones(2, 4)) * 1e19).sum()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))  # logs the norm
            opt.step()
            nw.step()
    d = top(nw)
    assert d.code == "NW301", text(d)
    assert "clip" in d.title and "overflowed" in d.title, d.title
    t = text(d)
    assert "clip_grad_norm_ at " in t and "inf / inf = NaN" in t, t
    assert "foreach=True or False alike" in t and "optimizer's running state" not in t, t
    assert "dtype=torch.float64" in d.fix and "model.parameters()" in d.fix, d.fix
    # the fix, pasted after a backward of the same size: finite gradients, norm 1
    model.zero_grad()
    (model(torch.ones(2, 4)) * 1e19).sum().backward()
    env = {"torch": torch, "model": model}
    exec(d.fix, env)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.isfinite(g).all() for g in grads)
    total = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    assert abs(total.item() - 1.0) < 1e-3


def test_a_clip_at_inf_written_as_a_call_is_read_as_inf() -> None:
    for src in ('f(p, float("inf"))', "f(p, max_norm=math.inf)", "f(p, torch.inf)"):
        call = ast.parse(src.replace("f(", "clip_grad_norm_(")).body[0]
        assert isinstance(call, ast.Expr) and isinstance(call.value, ast.Call)
        assert _max_norm(call.value) == math.inf, src


# ------------------------------------------------- NW100: log(1 - y) of a target of 1


def test_a_log_of_a_target_of_exactly_one_is_a_log_of_zero_not_a_ratio() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    y = torch.rand(16)
    y[[2, 5]] = 1.0  # proportions of exactly 1
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        b = nn.functional.softplus(model(torch.randn(16, 3))).squeeze(1) + 1.0
        loss = -((b - 1) * torch.log(1 - y)).mean()
        loss.backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW100" and "computed without gradients" in d.title, text(d)
    t = text(d)
    assert "log of values in (0, 1]" in t and "a log of 0" in t, t
    assert "denominator" not in d.fix, d.fix
    assert "y = y.clamp(eps, 1 - eps)" in d.fix, d.fix
    fixed: dict[str, object] = {"y": y}
    exec(d.fix, fixed)
    assert torch.isfinite(torch.log(1 - fixed["y"])).all()  # type: ignore[arg-type]


def test_an_inf_weight_one_over_zero_keeps_the_denominator_fix() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        x = torch.randn(4, 4)
        weight = 1.0 / torch.tensor([1.0, 0.5, 0.0, 2.0]).unsqueeze(1) ** 2
        loss = (weight * (model(x) - x) ** 2).mean()
        loss.backward()
        nw.step()
    d = top(nw)
    assert "computed without gradients" in d.title, text(d)
    assert "den.clamp_min" in d.fix and "log" not in d.fix, d.fix


# ------------------------------------------------- NW100: no exp clue for a Linear


class _Step(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.mul_(60.0)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return 5.0 * torch.tanh(self.lin(y))


class _Euler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = _Step()

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        for _ in range(300):
            y = y + 0.1 * self.f(y)
        return y


def test_a_backward_overflow_in_a_linear_gets_no_hand_written_exp_clue() -> None:
    """Backprop through an Euler solver overflows in f.lin's backward; its input reached
    -89 (past exp's bound 88.72), but a Linear takes no exp: the clue 'a hand-written exp
    (Swish, Mish, softplus) hides it' was given all the same."""
    torch.manual_seed(0)
    model = _Euler()
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        (model(torch.randn(16, 4) * 1e-3) ** 2).mean().backward()
        nw.step()
    a = first_bad(nw).anomaly
    assert a is not None and a.path == "f.lin" and a.kind.value == "backward", a.summary
    t = text(top(nw))
    assert "exp of a value past" not in t and "Swish" not in t, t
