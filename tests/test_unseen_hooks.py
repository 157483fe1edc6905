"""Unseen models, gradient hooks the user registered: a tensor or parameter hook that
returns NaN (``g / g.norm()`` of an all-zero gradient) is named in watch mode with its line,
and NW302's fix guards it (detect_anomaly does not check hooks) or, without a hook, replays
the step; a custom autograd.Function applied between two modules is named in watch mode; a
leaf an earlier update wrote is the headline too, as in the summary."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import nanwatch
from tests._diagnoses import first_bad


def _batch(step: int, bad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    lab = torch.rand(16, generator=g) < (0.0 if step == bad else 0.5)
    return x, y, lab


def _masked(pred: torch.Tensor, y: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
    return (((pred - y) ** 2).squeeze(1) * lab).sum() / lab.sum().clamp(min=1)


def test_tensor_hook_between_modules_is_named() -> None:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
    head = nn.Linear(16, 1)
    with nanwatch.watch(trunk, head, on_anomaly="record", postmortem=False) as nw:
        for step in range(3):
            x, y, lab = _batch(step, 2)
            feats = trunk(x)
            feats.register_hook(lambda g: g / g.norm())
            _masked(head(feats), y, lab).backward()
            nw.step()
    a = nw.first_anomaly
    assert a is not None and a.step == 2
    assert "born in a hook you registered on" in a.summary
    assert "(register_hook, <lambda> at " in a.summary and "test_unseen_hooks.py:" in a.summary
    assert "the gradient reaching it was finite" in a.summary
    assert "detect_anomaly does not check hooks" in a.summary


class _Mtl(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.h1, self.h2 = nn.Linear(16, 1), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.h1(h), self.h2(h)


def test_parameter_hook_nan_guarded_by_nw302_fix() -> None:
    torch.manual_seed(0)
    model = _Mtl()
    handle = model.h2.weight.register_hook(lambda grad: grad / grad.norm())
    try:
        with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
            for step in range(3):
                x, y, lab = _batch(step, 2)
                p1, p2 = model(x)
                (((p1 - y) ** 2).mean() + _masked(p2, y, lab)).backward()
                model.zero_grad()
                nw.step()
    finally:
        handle.remove()
    a = nw.first_anomaly
    assert a is not None and a.parameter == "h2.weight"
    assert "returned by a hook you registered on it (register_hook, <lambda> at " in a.summary
    d = next(d for d in first_bad(nw).diagnoses if d.code == "NW302")
    assert "detect_anomaly():" not in d.fix
    assert "detect_anomaly does not check hooks: guard the hook" in d.fix
    line = next(ln for ln in d.fix.splitlines() if ".register_hook(" in ln)
    assert "grad.norm().clamp_min(torch.finfo(grad.dtype).eps)" in line
    exec(line, {"model": model, "torch": torch})  # the pasted fix runs: 0 gradient -> 0
    x, y, lab = _batch(2, 2)
    p1, p2 = model(x)
    _masked(p2, y, lab).backward()
    assert model.h2.weight.grad is not None and torch.isfinite(model.h2.weight.grad).all()
    model.h2.weight._backward_hooks.clear()


class _NanBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * float("nan")


def test_nw302_without_hook_replays_instead_of_detect_anomaly() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        loss = model(torch.randn(2, 4)).sum() + _NanBackward.apply(model.weight).sum()
        loss.backward()
        nw.step()
    d = next((d for d in first_bad(nw).diagnoses if d.code == "NW302"), None)
    assert d is not None, [x.code for x in first_bad(nw).diagnoses]
    assert "detect_anomaly" not in d.fix and "hook" not in d.fix
    assert "nw.replay(step_fn)" in d.fix


class _Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, lambd: float) -> torch.Tensor:
        ctx.lambd = lambd
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g.neg() * ctx.lambd, None


class _Dann(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lambd = 1.0
        self.features = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.label_head = nn.Linear(16, 3)
        self.domain_head = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.features(x)
        return self.label_head(f), self.domain_head(_Reverse.apply(f, self.lambd))


def test_functional_custom_function_between_modules_named_in_watch_mode() -> None:
    torch.manual_seed(0)
    model = _Dann()
    model.lambd = float("inf")
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        y, d = model(torch.randn(8, 8))
        (y.sum() + d.sum()).backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None
    # its own backward, replayed, names the Function whose backward made it
    assert "born in the backward of custom autograd.Function _Reverse" in a.summary


def test_leaf_written_by_earlier_update_is_the_headline() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    weights = nn.Parameter(torch.ones(2))
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for step in range(2):
            x, y = torch.randn(4, 8), torch.randn(4, 1)
            p = model(x)
            losses = torch.stack([((p - y) ** 2).mean(), (p - y).abs().mean()])
            (weights * losses).sum().backward()
            with torch.no_grad():
                if step == 0:
                    weights.fill_(float("nan"))  # an earlier update wrote NaN
            model.zero_grad()
            nw.step()
    a = nw.first_anomaly
    assert a is not None and "a leaf" in a.summary
    head = nw.report.headline
    assert "already held NaN" in head and "earlier step wrote it" in head, head
    assert "born in the forward of (loss)" not in head
