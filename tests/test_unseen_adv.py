"""Adversarial-training models found by user testing: TRADES' KL divergence whose target
(a softmax of the model, not detached) holds exact zeros, watch, forensic and functional
(the target gradient of xlogy(t, t) is 0/0); a hand-written BatchNorm whose running
variance is 0 everywhere (no exp: no logsumexp advice); a float16 autocast cast of a huge
input whose fix must keep the user's names (``y`` is the label, not the cast tensor).

Each runs a tiny real model under ``nanwatch.watch`` on CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.rules.overflow import _fix_cast
from tests._diagnoses import code_lines, text, top


def _confident() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 10))
    with torch.no_grad():
        model[3].weight.mul_(300.0)  # large logits: the clean softmax underflows to 0
    return model


# ------------------------------------- 1: KL divergence's target requires grad and is 0


def _trades(
    mode: str, functional: bool = False, ignore: tuple[str, ...] = ()
) -> tuple[nanwatch.Watcher, dict]:
    model = _confident()
    crit_kl = nn.KLDivLoss(reduction="sum")
    env: dict = {"model": model, "crit_kl": crit_kl, "F": F, "nn": nn, "torch": torch}

    def step(_: int) -> None:
        x = torch.rand(8, 3, 2, 2)
        y = torch.randint(0, 10, (8,))
        x_adv = (x + 0.03 * torch.randn_like(x).sign()).clamp(0, 1)
        env.update(x=x, x_adv=x_adv)
        loss_natural = F.cross_entropy(model(x), y)
        if functional:
            loss_robust = F.kl_div(F.log_softmax(model(x_adv), dim=1),
                                   F.softmax(model(x), dim=1), reduction="sum")  # fmt: skip
        else:
            loss_robust = crit_kl(F.log_softmax(model(x_adv), dim=1),
                                  F.softmax(model(x), dim=1))  # fmt: skip
        (loss_natural + 6.0 * loss_robust).backward()

    with nanwatch.watch(model, crit_kl, mode=mode, on_anomaly="record", ignore=ignore) as nw:
        step(0)
        nw.step()
    return nw, env


def _check_kl_fix(d, env: dict) -> None:
    """Both pasted fixes give a finite loss and finite gradients on the same batch."""
    lines = code_lines(d.fix).splitlines()
    assert any(".detach()" in ln for ln in lines)
    for ln in lines:
        ns = dict(env)
        exec(ln.split("   #", 1)[0], ns)  # each line on its own: the detach, the log_target
        if "loss_robust" not in ns:
            env["crit_kl"] = ns.get("crit_kl", env["crit_kl"])
            continue
        env["model"].zero_grad()
        ns["loss_robust"].backward()
        assert all(torch.isfinite(p.grad).all() for p in env["model"].parameters())


def test_kl_target_with_zeros_that_requires_grad_in_watch_mode() -> None:
    nw, env = _trades("watch")
    d = top(nw)
    # (the replay of KLDivLoss's own backward now names its xlogy)
    assert d.code == "NW110" and "target" in d.title and d.op in (None, "aten.xlogy")
    t = text(d)
    assert "requires grad" in t and "0/0" in t
    assert "exp of a value past" not in t and "Swish" not in t
    assert "F.softmax(model(x), dim=1).detach()" in d.fix
    assert "nn.KLDivLoss(reduction='sum', log_target=True)" in d.fix
    assert "F.log_softmax(model(x), dim=1))" in d.fix
    _check_kl_fix(d, env)


def test_the_catch_all_reads_no_exp_into_log_probabilities() -> None:
    """NW100's clues for an untraced backward NaN said 'input[0] reached -138.2: exp of a
    value past 88.72 is inf; a hand-written exp (Swish...)' of KLDivLoss's log_softmax input,
    which no exp is taken of."""
    nw, _ = _trades("watch", ignore=("NW110",))
    d = top(nw)
    assert d.code == "NW100"
    assert "exact zeros" in text(d)  # the target's clue stays
    assert "exp of a value past" not in text(d) and "Swish" not in text(d)


def test_kl_target_with_zeros_in_forensic_mode_is_not_an_entropy() -> None:
    nw, env = _trades("forensic")
    d = top(nw)
    assert d.code == "NW110" and "KLDivLoss" in d.title
    assert "ent = " not in d.fix and "Categorical" not in d.fix
    assert (
        "crit_kl(F.log_softmax(model(x_adv), dim=1), F.softmax(model(x), dim=1).detach())" in d.fix
    )
    _check_kl_fix(d, env)


def test_functional_kl_div_target_gets_log_target() -> None:
    nw, env = _trades("forensic", functional=True)
    d = top(nw)
    assert d.code == "NW110" and "F.kl_div" in d.title
    assert "log_target=True)" in d.fix and "F.log_softmax(model(x), dim=1)" in d.fix
    _check_kl_fix(d, env)


def test_an_entropy_of_xlogy_keeps_its_own_fix() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    with torch.no_grad():
        model.weight.mul_(400.0)

    def step(_: int) -> None:
        p = torch.softmax(model(torch.randn(5, 4)), -1)
        ent = -torch.special.xlogy(p, p).sum(-1).mean()
        ent.backward()

    with nanwatch.watch(model, mode="forensic", on_anomaly="record") as nw:
        step(0)
        nw.step()
    d = top(nw)
    assert d.code == "NW110" and d.title == "Gradient of xlogy at 0"


# ------------------------------------- 2: a denominator 0 everywhere, no exp in sight


class _MyBN(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(c))
        self.register_buffer("running_var", torch.zeros(c))  # should be ones

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m, v = self.running_mean, self.running_var
        return (x - m[None, :, None, None]) / v[None, :, None, None].sqrt()


def test_all_zero_denominator_without_exp_names_the_buffer_not_logsumexp() -> None:
    torch.manual_seed(0)
    bn = _MyBN(4)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), bn, nn.Flatten(), nn.Linear(64, 3))
    crit = nn.CrossEntropyLoss()

    def step(_: int) -> None:
        crit(model(torch.rand(2, 3, 4, 4)), torch.tensor([0, 1])).backward()

    with nanwatch.watch(model, crit, on_anomaly="record") as nw:
        step(0)
        nw.step()
    d = top(nw)
    assert d.code == "NW111" and d.path == "1"
    t = text(d)
    assert "exp" not in t.replace("explain", "") and "logsumexp" not in t
    assert "self.running_var" in t and "torch.ones" in d.fix
    line = code_lines(d.fix).split("   #", 1)[0]
    assert line == "return (x - m[None, :, None, None]) / (v[None, :, None, None] + 1e-5).sqrt()"
    ns: dict = {"x": torch.rand(2, 4, 4, 4), "m": bn.running_mean, "v": bn.running_var}
    exec("def f():\n    " + line, ns)
    assert torch.isfinite(ns["f"]()).all()


# ------------------------------------- 3: an autocast cast's fix keeps the user's names


def test_autocast_cast_fix_does_not_overwrite_the_label() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    crit = nn.CrossEntropyLoss()
    x = torch.rand(2, 3, 4, 4) * 1e5
    y = torch.tensor([0, 1])
    delta = torch.zeros_like(x)

    def step(_: int) -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            l = crit(model(x + delta), y)  # noqa: E741
        l.backward()

    with nanwatch.watch(model, crit, on_anomaly="record") as nw:
        step(0)
        nw.step()
    d = top(nw)
    assert d.code == "NW101"
    assert "y = " not in d.fix and "x = " not in d.fix
    # the input holds raw values up to 1e5: scaled, not clamped (a clamp moves the overflow
    # to the next op); the clamp form of a cast is tested below (_fix_cast)
    assert "scale the input features" in d.fix and "9.998e+04" in d.fix
    ns = {"torch": torch, "crit": crit, "model": model, "x": x, "delta": delta, "y": y}
    exec(code_lines(d.fix), ns)
    assert ns["y"] is y


def test_cast_fix_takes_a_name_the_line_does_not_use() -> None:
    fix = _fix_cast("h = fin.to(torch.float16)", "float16")
    assert "fin_ = torch.finfo(torch.float16)" in fix
    assert "h = fin.clamp(fin_.min, fin_.max).to(torch.float16)" in fix
    bare = _fix_cast("y = crit(model(x), y)", "float16")
    assert "y = " not in code_lines(bare).replace("# was: y = ", "")
