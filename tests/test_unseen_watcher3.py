"""Steps of self-distillation loops (an EMA teacher run first under no_grad), an overflow
hidden inside a module (NW105), and a NaN gradient a final ReLU zeroed. Tiny real loops on
CPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import AnomalyKind


# ---------------------------------------------------------------- teacher first, no_grad
def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _byol(
    order: str, *, explicit: bool, nan_at: int | None = None, accum: int = 1, n: int = 5
) -> nanwatch.Watcher:
    """BYOL-style: the target network runs first under no_grad on both views, then the
    online network with gradients; the target is an EMA of the online one."""
    online = _mlp()
    target = copy.deepcopy(online).requires_grad_(False)
    opt = torch.optim.SGD(online.parameters(), lr=0.05)
    roots = (online, target) if order == "online" else (target, online)
    with nanwatch.watch(*roots, on_anomaly="record") as nw:
        for it in range(n):
            for m in range(accum):
                x = torch.randn(4, 8)
                if it == nan_at and m == 0:
                    x[1, 0] = float("nan")
                with torch.no_grad():
                    z1, z2 = target(x), target(x + 1)
                p1, p2 = online(x), online(x + 1)
                ((p1 - z2).pow(2).mean() + (p2 - z1).pow(2).mean()).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for po, pt in zip(online.parameters(), target.parameters(), strict=True):
                    pt.mul_(0.9).add_(po, alpha=0.1)
            if explicit:
                nw.step()
    return nw


@pytest.mark.parametrize("order", ["online", "target"])
@pytest.mark.parametrize("explicit", [True, False])
@pytest.mark.parametrize("accum", [1, 2])
def test_a_teacher_run_first_under_no_grad_is_part_of_the_training_step(
    order: str, explicit: bool, accum: int
) -> None:
    nw = _byol(order, explicit=explicit, accum=accum)
    assert [t.step for t in nw.history] == [0, 1, 2, 3, 4]
    # every step holds the two teacher calls and the two online calls of each micro-batch
    assert [sum(c.root for c in t.calls) for t in nw.history] == [5 * accum] * 5
    nw = _byol(order, explicit=explicit, accum=accum, nan_at=3)
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.INPUT and a.step == 3


def test_an_evaluation_loop_under_no_grad_is_still_a_step_per_call() -> None:
    model, other = _mlp(), _mlp()
    with torch.no_grad(), nanwatch.watch(model, other) as nw:
        for _ in range(3):
            other(torch.randn(2, 8))
        for _ in range(3):
            model(torch.randn(2, 8))
    assert [t.step for t in nw.history] == [0, 1, 2, 3, 4, 5]


def test_an_evaluation_of_the_model_before_training_keeps_its_steps() -> None:
    """The model evaluated under no_grad, then trained: the evaluation calls are not
    folded into the first training step (only another module's no_grad calls are)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model) as nw:
        with torch.no_grad():
            for _ in range(3):
                model(torch.randn(2, 8))
        for _ in range(2):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert len(nw.history) == 4  # as before: the last evaluation call joins the first step


# ---------------------------------------------------------------- NW105: a hidden overflow
class _GlobalNorm(nn.Module):
    def __init__(self, use_mean: bool) -> None:
        super().__init__()
        self.use_mean = use_mean

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        energy = (x * x).mean() if self.use_mean else (x * x).sum() / x.numel()
        return x / torch.sqrt(energy + 1e-3)


def _norm_net(use_mean: bool) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 64), _GlobalNorm(use_mean), nn.Linear(64, 2))
    with torch.no_grad():
        net[0].weight.fill_(1.0)
    return net.half()


def _forensic_step(model: nn.Module) -> tuple[nanwatch.Watcher, torch.Tensor]:
    x = (10 * torch.randn(64, 4)).half()
    with nanwatch.watch(model, mode="forensic") as nw:
        out = model(x)
        out.float().pow(2).mean().backward()
        nw.step()
    return nw, out


def test_an_overflow_absorbed_inside_a_module_is_reported_in_forensic_mode() -> None:
    model = _norm_net(use_mean=False)
    with pytest.warns(nanwatch.NanwatchWarning, match="NW105"):
        nw, out = _forensic_step(model)
    assert torch.isfinite(out).all() and nw.first_anomaly is None
    assert any(o.op == "aten.sum.default" and o.born == "+inf" for o in nw.history[0].ops)
    d = next(d for d in nw.report.diagnoses if d.code == "NW105")
    assert d.severity == "warning" and d.path == "1" and d.op == "aten.sum"
    text = "\n".join(d.evidence)
    assert "65504" in text and "torch.finfo(torch.float16).max" in text
    assert "(x * x).sum() / x.numel()" in text and "silently wrong" in text
    assert "float32" in d.explanation
    assert "model[1].float()" in d.fix
    assert nw.report.headline.startswith("NW105 warning")
    # the fix, pasted: the module computes in float32, the overflow is gone
    setup = "\n".join(line for line in d.fix.splitlines()[:3])
    exec(setup, {"model": model, "torch": torch})
    nw2, out2 = _forensic_step(model)
    assert not any(d.code == "NW105" for d in nw2.report.diagnoses)
    assert out2.abs().max() > 0


def test_the_healthy_twin_of_the_hidden_overflow_is_silent() -> None:
    nw, out = _forensic_step(_norm_net(use_mean=True))
    assert nw.report.diagnoses == [] and nw.first_anomaly is None
    assert out.abs().max() > 0


# ---------------------------------------------------------------- a NaN gradient a ReLU hid
class _SSL(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.projector = nn.Sequential(nn.Linear(32, 16), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projector(self.backbone(x))


def _vicreg_std(eps: float) -> nanwatch.Watcher:
    model = _SSL()
    with torch.no_grad():
        model.projector[0].bias[3] = -100.0  # unit 3 is dead: a constant 0 feature
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanwatch.watch(model, on_anomaly="record") as nw:
        for _ in range(2):
            z = model(torch.randn(32, 16))
            std = torch.sqrt(z.var(dim=0) + eps)
            F.relu(1 - std).mean().backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


def test_a_nan_gradient_at_the_output_is_caught_though_a_final_relu_zeroes_it() -> None:
    nw = _vicreg_std(0.0)
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.BACKWARD and a.step == 0
    assert any(d.code == "NW112" for d in nw.report.diagnoses)


def test_the_eps_twin_is_silent_and_says_what_was_measured() -> None:
    nw = _vicreg_std(1e-4)
    assert nw.first_anomaly is None and nw.report.diagnoses == []
    assert nw.report.headline.endswith("every value nanwatch measured was finite")
