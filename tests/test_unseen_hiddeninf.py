"""0 × inf in backward where the infinity was hidden in forward: nanwatch tells the
torch.where story only when a where or a mask is in the evidence; a constant holding +inf
(a per-class weight 1 / count with a count of 0) and an exp that overflowed are named as
such. And the forensic fix of an exp overflow on a box-decode line clamps every exp.

Each runs a tiny real model under ``nanwatch.watch`` on CPU."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests._diagnoses import code_lines, text, top

torch.set_num_threads(1)


def _train(step_fn, *modules: nn.Module, mode: str = "watch", steps: int = 1) -> nanwatch.Watcher:
    with nanwatch.watch(*modules, mode=mode, on_anomaly="record") as nw:
        for step in range(steps):
            step_fn(step)
            nw.step()
    return nw


# ------------------------------------ 1: a per-class weight 1 / count with a count of 0


def _focal(counts: torch.Tensor, *, chained: bool, mode: str = "watch") -> nanwatch.Watcher:
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    alpha = counts.sum() / (len(counts) * counts)

    def step(_: int) -> None:
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        logp = F.log_softmax(m(x), 1)
        per = alpha * (1 - logp.exp()) ** 2 * logp if chained else alpha * logp
        (-per.gather(1, y[:, None]).mean()).backward()

    return _train(step, m, mode=mode)


@pytest.mark.parametrize("chained", [False, True])
def test_a_constant_weight_holding_inf_is_not_blamed_on_torch_where(chained: bool) -> None:
    d = top(_focal(torch.tensor([500.0, 30.0, 0.0]), chained=chained))
    assert d.code == "NW100" and d.op == "aten.mul"
    assert d.title.startswith("0 × +inf in backward")
    t = text(d)
    assert "torch.where" not in d.title and "torch.where" not in d.fix
    assert "mask hid" not in t
    assert "1 / count with a count of 0" in t
    if not chained:
        assert d.title.endswith("a constant operand held +inf")
    count = torch.tensor([500.0, 30.0, 0.0])
    scope = {"torch": torch, "math": math, "count": count, "x": torch.tensor([100.0])}
    exec(code_lines(d.fix), scope)  # the pasted fix: a finite weight
    assert torch.isfinite(scope["w"]).all()


def test_a_constant_weight_holding_inf_in_forensic_mode_is_a_constant() -> None:
    d = top(_focal(torch.tensor([500.0, 30.0, 0.0]), chained=True, mode="forensic"))
    assert d.code == "NW100"
    assert "torch.where" not in d.title and "torch.where" not in d.fix
    assert "clamp_min(1)" in d.fix


def test_weights_from_nonzero_counts_are_silent() -> None:
    for chained in (False, True):
        nw = _focal(torch.tensor([500.0, 30.0, 7.0]), chained=chained)
        assert all(t.anomaly is None for t in nw.history)


# ------------------------------------- 2: a box decode whose exps overflowed, hidden


def _decode(scale: float, mode: str = "watch") -> nanwatch.Watcher:
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    with torch.no_grad():
        m.weight.fill_(scale)
    anc = torch.tensor([[0.0, 0.0, 16.0, 16.0]]).repeat(3, 1)
    gt = torch.tensor([[2.0, 2.0, 12.0, 12.0]]).repeat(3, 1)

    def step(_: int) -> None:
        d = m(torch.ones(3, 4))
        aw = anc[:, 2] - anc[:, 0]
        ah = anc[:, 3] - anc[:, 1]
        w = aw * torch.exp(d[:, 2])
        h = ah * torch.exp(d[:, 3])
        p = torch.stack([8 - w / 2, 8 - h / 2, 8 + w / 2, 8 + h / 2], 1)
        lt = torch.max(p[:, :2], gt[:, :2])
        rb = torch.min(p[:, 2:], gt[:, 2:])
        wh = (rb - lt).clamp(min=0)
        inter = wh[:, 0] * wh[:, 1]
        union = w * h + 100 - inter
        (1 - inter / union).mean().backward()

    return _train(step, m, mode=mode)


def test_an_overflowed_box_decode_is_not_blamed_on_torch_where() -> None:
    d = top(_decode(30.0))
    assert d.code == "NW100"
    t = text(d)
    assert "torch.where" not in t and "mask hid" not in t
    assert "every value" not in t or "+inf" in t
    assert "math.log(torch.finfo(x.dtype).max)" in d.fix


def test_a_small_box_decode_is_silent() -> None:
    assert all(t.anomaly is None for t in _decode(0.05).history)


# ------------------------- 4: the forensic fix of a box decode bounds every exp, honestly


def _decode_line(scale: float) -> nanwatch.Watcher:
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    with torch.no_grad():
        m.weight.fill_(scale)
    anc = torch.tensor([[0.0, 0.0, 16.0, 16.0]]).repeat(3, 1)

    def step(_: int) -> None:
        d = m(torch.ones(3, 4))
        aw, ah = anc[:, 2] - anc[:, 0], anc[:, 3] - anc[:, 1]
        w, h = aw * torch.exp(d[:, 2]), ah * torch.exp(d[:, 3])
        (1 - 100.0 / (w * h + 100.0)).mean().backward()

    return _train(step, m, mode="forensic")


def test_a_box_decode_fix_clamps_every_exp_and_the_area_fits() -> None:
    d = top(_decode_line(30.0))
    assert d.code == "NW101"
    first = d.fix.splitlines()[0]
    assert first.count(".clamp(max=") == 2, first
    assert "a product of two still fits" not in d.fix
    aw = ah = torch.full((3,), 16.0)
    big = torch.full((3, 4), 1e4)
    scope = {"torch": torch, "aw": aw, "ah": ah, "d": big}
    exec(code_lines(d.fix), scope)  # the pasted fix: the area w * h is finite
    assert torch.isfinite(scope["w"] * scope["h"]).all()


def test_a_single_scaled_exp_makes_no_claim_about_the_product() -> None:
    from nanwatch.rules.overflow import _exp_calls, _rewrite_calls

    assert _exp_calls("w = aw * torch.exp(dw)", "exp") == (1, 1)
    assert _exp_calls("p = torch.exp(a) * torch.exp(b)", "exp") == (2, 0)
    assert _exp_calls("s = 2.0 * torch.exp(x)", "exp") == (1, 0)
    got = _rewrite_calls("z = (0.5 * lv).exp() + torch.exp(b)", "exp", lambda e: f"f({e})")
    assert got == "z = f(0.5 * lv).exp() + torch.exp(f(b))"
