"""Zero gradients that start at the loss (a saturated loss, a loss divided by a float16 inf)
or at a module whose output is 0 whatever its input, frozen layers that are not dead units
(NW304); an optimizer eps of 0 (NW301); a momentum of 1 or more (NW306)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.rules.base import Diagnosis


def _diag(nw: Any, code: str) -> Diagnosis:
    return next(d for t in nw.history for d in t.diagnoses if d.code == code)


def _codes(nw: Any) -> set[str]:
    return {d.code for t in nw.history for d in t.diagnoses}


class _MaskedNLL(nn.Module):
    def forward(self, logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> Any:
        nll = F.cross_entropy(logits.float(), target, reduction="none")
        n = mask.sum().to(logits.dtype)  # a count in float16: inf past 65504
        return (nll * mask).sum() / n


def test_a_loss_divided_by_a_float16_count_is_not_underflow() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(8, 8), nn.Tanh()).half()
    crit = _MaskedNLL()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n = 70000
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, crit, postmortem=False) as nw:
            for _ in range(5):
                t = torch.randint(0, 8, (n,))
                mask = torch.ones(n, dtype=torch.bool)
                loss = crit(model(t), t, mask)
                loss.backward()
                opt.step()
                opt.zero_grad()
                nw.step()
    d = _diag(nw, "NW304")
    assert d.title == "Zero gradients: the loss does not depend on the outputs"
    assert "GradScaler" not in d.fix and "LeakyReLU" not in d.fix
    assert any("the zero starts at the loss" in e for e in d.evidence)
    assert any("the loss is exactly 0" in e for e in d.evidence)
    assert any("float16" in e and "65504" in e for e in d.evidence)
    assert d.fix.startswith("# a count or a sum in float16")
    # the fix's count, pasted, gives the loss back
    ns: dict[str, Any] = {"mask": mask, "x": model(t)}
    exec(d.fix, ns)
    assert math.isfinite(float(ns["n"])) and float(ns["n"]) == n


class _CLIP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.img = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        a = F.normalize(self.img(x), dim=-1)
        b = F.normalize(self.img(t), dim=-1)
        return self.logit_scale.exp() * a @ b.t()


def test_a_saturated_contrastive_loss_names_the_learned_scale() -> None:
    torch.manual_seed(0)
    model = _CLIP()
    opt = torch.optim.Adam(
        [
            {"params": list(model.img.parameters()), "lr": 1e-3},
            {"params": [model.logit_scale], "lr": 4.0},
        ]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, postmortem=False) as nw:
            for _ in range(12):
                x = torch.randn(32, 16)
                logits = model(x, x + 0.05 * torch.randn(32, 16))
                y = torch.arange(32)
                loss = (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y)) / 2
                loss.backward()
                opt.step()
                opt.zero_grad()
                nw.step()
    d = _diag(nw, "NW304")
    assert d.title == "Zero gradients: the loss does not depend on the outputs"
    assert "LeakyReLU" not in d.fix and "BCEWithLogitsLoss" not in d.fix
    assert any("log(1/eps) of float32" in e for e in d.evidence)
    assert "saturated" in d.explanation and "dead units" in d.explanation
    exec(d.fix, {"model": model, "torch": torch})  # the clamp, pasted after a step
    assert model.logit_scale.item() <= math.log(100) + 1e-6


class _GlobalNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).sum() / x.numel() + 1e-3)  # float16 sum: inf


def test_a_module_whose_float16_sum_overflows_zeroes_its_output() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), _GlobalNorm(), nn.Flatten(2))
    model = model.half()
    head = nn.Linear(16, 4).half()
    opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=1e-2)
    crit = nn.CrossEntropyLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, crit, postmortem=False) as nw:
            for _ in range(5):
                x = torch.randn(8, 3, 64, 64).half()
                loss = crit(head(model(x).mean(2)).float(), torch.randint(0, 4, (8,)))
                loss.backward()
                opt.step()
                opt.zero_grad()
                nw.step()
    d = _diag(nw, "NW304")
    assert d.title == "Zero gradients: a module's output is exactly 0 whatever its input"
    assert d.path == "1" and "GradScaler" not in d.fix
    assert any("output is exactly 0 everywhere" in e for e in d.evidence)
    assert "x.float().sum()" in d.fix


def test_layers_frozen_with_requires_grad_false_are_not_dead() -> None:
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(8, 16), nn.GELU())
    model = nn.Sequential(backbone, nn.Linear(16, 1))
    crit = nn.MSELoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, crit, postmortem=False) as nw:
            for i in range(9):
                if i == 2:
                    backbone.requires_grad_(False)
                x = torch.randn(16, 8)
                crit(model(x), x.sum(1, keepdim=True)).backward()
                opt.step()
                opt.zero_grad(set_to_none=False)  # the frozen .grad stays a zero tensor
                nw.step()
    assert "NW304" not in _codes(nw)


def _zero_column_run(make: Any) -> tuple[Any, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = make(model.parameters())
    x = torch.randn(32, 4)
    x[:, 2] = 0.0  # a feature that is always 0: its weights' gradient is exactly 0
    err = None
    try:
        with nanwatch.watch(model, nn.MSELoss(), postmortem=False) as nw:
            for _ in range(3):
                F.mse_loss(model(x), x[:, :1]).backward()
                opt.step()
                opt.zero_grad()
                nw.step()
    except nanwatch.AnomalyError as e:
        err = e
    return err, opt, model


def test_an_optimizer_eps_of_zero_is_named_and_the_fix_works() -> None:
    for make in (
        lambda p: torch.optim.Adagrad(p, lr=0.05, eps=0.0),
        lambda p: torch.optim.RMSprop(p, lr=1e-2, eps=0.0),
        lambda p: torch.optim.Adadelta(p, eps=0.0),
    ):
        err, opt, _ = _zero_column_run(make)
        assert err is not None
        d = err.diagnosis
        name = type(opt).__name__
        assert d.code == "NW301"
        assert d.title == "Optimizer eps is 0: 0 / 0 where a gradient is exactly 0"
        assert f"{name} param group 0 has eps=0" in " ".join(d.evidence)
        assert "centered" not in d.fix and "load_state_dict" not in d.title
        # in the training function's name for the optimizer (opt)
        assert d.fix.startswith('for g in opt.param_groups:\n    g["eps"] = ')

        def fixed(p: Any, make: Any = make, fix: str = d.fix) -> torch.optim.Optimizer:
            optimizer = make(p)
            exec(fix, {"opt": optimizer})
            return optimizer

        err2, opt2, model = _zero_column_run(fixed)
        assert err2 is None and opt2.param_groups[0]["eps"] > 0
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_momentum_of_one_or_more_is_an_error_before_the_overflow() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.01, momentum=1.5, nesterov=True, weight_decay=1e-4
    )
    x = torch.randn(32, 8)
    err = None
    try:
        with nanwatch.watch(model, nn.MSELoss(), postmortem=False) as nw:
            for _ in range(3):
                F.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
                optimizer.step()
                optimizer.zero_grad()
                nw.step()
    except nanwatch.AnomalyError as e:
        err = e
    assert err is not None
    d = err.diagnosis
    assert d.code == "NW306" and d.step == 0
    assert "momentum=1.5" in d.evidence[0]
    assert d.fix.startswith('optimizer.param_groups[0]["momentum"] = 0.9')
    exec(d.fix, {"optimizer": optimizer})
    assert optimizer.param_groups[0]["momentum"] == 0.9
