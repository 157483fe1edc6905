"""Gradient and overflow diagnoses found by user testing: a head left out of the loss is no
vanishing gradient, a loss term switched on is no exploding gradient, a float16 symexp is
cast without dropping its abs, and an EMA copy that grows is blamed on its decay, not on
the learning rate."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel

import nanwatch
from tests._diagnoses import text

torch.set_num_threads(1)


def _codes(nw: nanwatch.Watcher) -> list[str]:
    return [d.code for t in nw.history for d in t.diagnoses]


# ------------------------------ 1: an auxiliary head out of this step's loss is not dead


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
        self.main = nn.Linear(32, 3)
        self.aux = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.main(h), self.aux(h)


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_a_head_left_out_of_the_loss_with_stale_zero_grads_is_not_vanishing(mode: str) -> None:
    m = _TwoHeads()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    x, y, a = torch.randn(16, 10), torch.randint(0, 3, (16,)), torch.randn(16, 1)
    with nanwatch.watch(m, mode=mode) as nw:
        for i in range(9):
            out, aux = m(x)
            loss = F.cross_entropy(out, y)
            if i % 8 == 0:  # the aux term only every 8th step
                loss = loss + F.mse_loss(aux, a)
            opt.zero_grad(set_to_none=False)  # aux's .grad stays an (old) zero
            loss.backward()
            opt.step()
            nw.step()
    assert "NW304" not in _codes(nw)


# ------------------------------ 2: a loss term switched on starts a new gradient level


def test_a_new_loss_term_switched_on_is_not_an_exploding_gradient() -> None:
    torch.manual_seed(0)
    body, head, penalty = nn.Linear(8, 8), nn.Linear(8, 1), nn.Linear(8, 1)
    opt = torch.optim.Adam([*body.parameters(), *head.parameters(), *penalty.parameters()])
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    norms = []
    with nanwatch.watch(body, head, penalty) as nw:
        for step in range(12):
            h = body(x)
            loss = F.mse_loss(head(h), y)
            if step >= 6:  # task 2: a penalty term joins the loss and stays
                loss = loss + 50 * penalty(h).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
            norms.append(nw.history[-1].grad_norm)
    assert norms[6] > 10 * max(norms[:6])  # the jump is real, and it is a new level
    assert "NW303" not in _codes(nw)


def test_a_jump_of_the_same_loss_is_still_an_exploding_gradient() -> None:
    torch.manual_seed(0)
    body, head = nn.Linear(8, 8), nn.Linear(8, 1)
    opt = torch.optim.SGD([*body.parameters(), *head.parameters()], lr=0.0)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    with nanwatch.watch(body, head) as nw:
        for step in range(8):
            loss = F.mse_loss(head(body(x)), y) * (1000.0 if step == 7 else 1.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    d = next(d for d in nw.history[-1].diagnoses if d.code == "NW303")
    assert "clip_grad_norm_" in d.fix


# ------------------------------ 3: a float16 symexp keeps its abs when cast to float32


def _symexp(x): return torch.sign(x) * (torch.exp(torch.abs(x)) - 1)  # fmt: skip


def test_the_float32_fix_of_a_one_line_symexp_keeps_its_own_argument() -> None:
    torch.manual_seed(0)
    critic = nn.Linear(4, 1)
    with torch.no_grad():
        critic.bias.fill_(11.5)  # symlog of a return of ~1e5: exp(11.5) > 65504
    critic.half()
    x = torch.randn(8, 4).half()
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(critic, mode="forensic"):
        val = _symexp(critic(x).squeeze(-1))
        (val.float() - 1.0).pow(2).mean().backward()
    d = next(d for d in info.value.diagnoses if d.code == "NW101")
    line = d.fix.splitlines()[0]
    assert line.startswith("def _symexp(x): return "), d.fix
    assert "torch.abs(x).float()" in line and "x.float().exp()" not in d.fix
    ns: dict[str, object] = {"torch": torch}
    exec(compile(line, "<fix>", "exec"), ns)  # the pasted one-line def
    fixed = ns["_symexp"]
    assert callable(fixed)
    back = fixed(torch.tensor([-3.0, 12.0]).half())
    assert back[0].item() == pytest.approx(-19.0855, rel=1e-3)  # exp(|x|), not exp(x)
    assert torch.isfinite(back).all()  # exp(12) fits float32


# ------------------------------ 4: an EMA copy with a decay past 1 grows by itself


def _ema_loop(nw: nanwatch.Watcher, model: nn.Module, ema_update, ema_eval) -> None:  # type: ignore[no-untyped-def]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, 8)
    y = x.sum(1, keepdim=True)
    for step in range(120):
        loss = F.mse_loss(model(x)[:, :1], y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema_update()
        if step % 10 == 9:  # the copy is evaluated every 10 steps
            with torch.no_grad():
                ema_eval(x, y)
        nw.step()


def _check_ema(err: nanwatch.AnomalyError, root: str) -> None:
    d = err.diagnoses[0]
    assert d.code == "NW301", [x.code for x in err.diagnoses]
    assert "outside an optimizer step" in d.title
    body = text(d)
    assert "x1.5 per step" in body and root in body
    assert "decay must be in [0, 1]" in d.fix
    assert "lr" not in d.fix and "clip_grad_norm_" not in d.fix
    assert "model.named_parameters()" not in d.fix  # the copy is not the trained model
    compile(d.fix, "<fix>", "exec")
    assert all("lr" not in x.fix for x in err.diagnoses if x.code == "NW101")


def test_a_hand_written_ema_with_a_decay_past_1_is_named_not_the_lr() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    ema = copy.deepcopy(model).requires_grad_(False)

    def update() -> None:
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), model.parameters(), strict=True):
                pe.mul_(1.5).add_(p, alpha=-0.5)

    crit = nn.MSELoss()
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(model, ema, crit) as nw:
        _ema_loop(nw, model, update, lambda x, y: crit(ema(x)[:, :1], y))
    _check_ema(info.value, "Sequential#2")


def test_an_averaged_model_with_a_decay_past_1_is_named_not_clipping() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    ema = AveragedModel(model, avg_fn=lambda avg, p, n: 1.5 * avg - 0.5 * p)
    crit = nn.MSELoss()
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(model, ema, crit) as nw:
        _ema_loop(
            nw, model, lambda: ema.update_parameters(model), lambda x, y: crit(ema(x)[:, :1], y)
        )
    _check_ema(info.value, "AveragedModel")
