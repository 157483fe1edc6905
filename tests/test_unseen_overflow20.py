"""Fixes found by user testing: an exp whose argument holds a mask fill value (a rollout
buffer padded with -1e9) is named as such and masked before the exp, not clamped; the
NW202 fix removes the sigmoid where the model applies it before it switches the loss to
BCEWithLogits (pasted alone, that line would apply the sigmoid twice)."""

from __future__ import annotations

import ast
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests._diagnoses import code_lines, text
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


# ------------------------------ 1: exp(lp - old), old padded with -1e9 under no_grad


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 20)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def _logps(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.gather(F.log_softmax(logits[:, :-1], -1), 2, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def _rollout() -> tuple[_LM, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return _LM(), torch.randint(0, 20, (3, 6)), torch.ones(3, 5)


def test_an_exp_of_a_mask_fill_value_is_masked_before_the_exp_not_clamped() -> None:
    pol, ids, mask = _rollout()
    mask[:, :2] = 0
    with torch.no_grad():
        old = _logps(pol(ids), ids).masked_fill(mask == 0, -1e9)  # the buffer pads with -1e9
    adv = torch.randn(3, 1)

    def run() -> None:
        lp = _logps(pol(ids), ids)
        ratio = torch.exp(lp - old)
        ((ratio * adv) * mask).sum().backward()

    d = _first(_raises(pol, run, "forensic"), "NW101")
    t = text(d)
    assert "old holds the fill value -1e9" in t and "6 of 15 positions" in t
    assert "torch.no_grad()" in t and "a mask fill" in t
    assert "drifted up" not in t and "initial weights or the inputs" not in t
    first = d.fix.splitlines()[0]
    assert first.startswith("ratio = torch.exp((lp - old).masked_fill(mask == 0, 0))")
    assert "clamp" not in d.fix
    assert "old = _logps(pol(ids), ids).masked_fill(mask == 0, 0.0)" in d.fix
    # the fix, applied, keeps the ratio finite
    ns: dict[str, Any] = {"torch": torch, "lp": _logps(pol(ids), ids).detach(), "old": old}
    ns["mask"] = mask
    exec(code_lines(d.fix), ns)
    assert torch.isfinite(ns["ratio"]).all()


def _buffer(logps: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(logps, -1e9)
    out[keep] = logps[keep]
    return out


def test_an_exp_argument_of_exactly_a_round_huge_value_is_read_as_a_fill_value() -> None:
    pol, ids, mask = _rollout()
    mask[:, :2] = 0
    with torch.no_grad():
        old = _buffer(_logps(pol(ids), ids), mask.bool())  # filled in a helper
    adv = torch.randn(3, 1)

    def run() -> None:
        lp = _logps(pol(ids), ids)
        ratio = torch.exp(lp - old)
        ((ratio * adv) * mask).sum().backward()

    d = _first(_raises(pol, run, "forensic"), "NW101")
    t = text(d)
    assert "exactly 1e+09" in t and "fill value" in t and "drifted up" not in t
    assert "clamp" not in d.fix and ".masked_fill(<masked positions>, 0)" in d.fix


# ------------------------------ 2: NW202: the sigmoid is removed first, then BCEWithLogits


class _Dragon(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rep = nn.Linear(4, 8)
        self.t_head = nn.Linear(8, 1)
        self.y = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.rep(x)
        g = torch.sigmoid(self.t_head(z)).squeeze(-1)
        return self.y(z).squeeze(-1), g


def _nw202(model: nn.Module, run: Any) -> nanwatch.Diagnosis:
    with nanwatch.watch(model, on_anomaly="record") as nw:
        run()
        nw.step()
    return next(d for d in nw.history[0].diagnoses if d.code == "NW202")


def test_sigmoid_bce_fix_first_returns_the_logit_from_the_modules_forward() -> None:
    torch.manual_seed(0)
    net = _Dragon()
    x, t_ = torch.randn(16, 4), (torch.rand(16) < 0.5).float()

    def run() -> None:
        y, g = net(x)
        loss_t = nn.functional.binary_cross_entropy(g, t_)
        h = t_ / g - (1 - t_) / (1 - g)
        (loss_t + (y * h).mean()).backward()

    fix = _nw202(net, run).fix
    lines = fix.splitlines()
    assert lines[0].startswith("g = self.t_head(z).squeeze(-1)   # first, in _Dragon.forward")
    assert lines[1].startswith("loss_t = nn.functional.binary_cross_entropy_with_logits(g, t_)")
    assert "torch.sigmoid(g)" in lines[2] and "h = t_ / g - (1 - t_) / (1 - g)" in lines[2]
    ast.parse(code_lines(fix))  # valid Python
    # applied: the forward returns the logit, and BCEWithLogits on it is the old loss
    with torch.no_grad():
        z = net.rep(x)
        ns: dict[str, Any] = {"self": net, "z": z, "nn": nn, "t_": t_}
        exec(code_lines(fix), ns)
        want = F.binary_cross_entropy(torch.sigmoid(net.t_head(z)).squeeze(-1), t_)
        assert torch.allclose(ns["loss_t"], want, atol=1e-6)


def test_sigmoid_bce_fix_first_drops_the_sigmoid_module() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Sigmoid())
    x, t_ = torch.randn(5, 4), (torch.rand(5, 3) > 0.5).float()

    def run() -> None:
        nn.BCELoss()(model(x), t_).backward()

    fix = _nw202(model, run).fix
    first = fix.splitlines()[0]
    assert first.startswith("model[1] = nn.Identity()")
    assert "BCEWithLogitsLoss" in fix.splitlines()[1]
    want = nn.BCELoss()(model(x), t_)
    exec(first.split("   #", 1)[0], {"model": model, "nn": nn})
    assert torch.allclose(nn.BCEWithLogitsLoss()(model(x), t_), want, atol=1e-6)
