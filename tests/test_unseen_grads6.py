"""NW301 for gradients the user's code writes into ``.grad`` (DP-SGD, PCGrad), including a
step with no forward at all; NW302/NW303 fixes in the user's own names."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import nanwatch

torch.set_num_threads(1)


# ---------------------------------------------------------------- NW301: no forward in the step


def _dp_sgd_poisson(*, momentum: float, empty_at: int | None):  # type: ignore[no-untyped-def]
    """DP-SGD with Poisson sampling: the noised sum of per-example gradients is divided
    by the batch's size, and a batch can be empty (no forward, no backward that step)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    crit = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    with nanwatch.watch(model, crit, postmortem=False) as nw:
        for it in range(4):
            batch = [] if it == empty_at else [0, 1, 2]
            acc = [torch.zeros_like(p) for p in model.parameters()]
            for i in batch:
                crit(model(torch.randn(1, 4)), torch.tensor([i % 2])).backward()
                for a, p in zip(acc, model.parameters(), strict=True):
                    a.add_(p.grad)
                opt.zero_grad()
            for a, p in zip(acc, model.parameters(), strict=True):
                p.grad = (a + torch.randn_like(a)) / len(batch)
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw, opt


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_a_hand_set_grad_in_a_step_without_forward_is_named_not_the_optimizer_state(
    momentum: float,
) -> None:
    with pytest.raises(nanwatch.AnomalyError) as info:
        _dp_sgd_poisson(momentum=momentum, empty_at=2)
    (d,) = [d for d in info.value.diagnoses if d.code == "NW301"]
    assert d.title == "Non-finite weights from a gradient your code wrote after backward"
    assert d.step == 2
    fix = d.fix or ""
    assert "optimizer.state" not in fix and "load_state_dict" not in fix
    assert "clip_grad_norm_" not in fix and '["lr"]' not in fix
    assert "p.grad = (a + torch.randn_like(a)) / len(batch)" in fix
    assert "divides by len(batch)" in fix
    assert "projection" not in fix and "gj" not in fix
    assert 'for g in opt.param_groups for p in g["params"]' in fix and "opt.step()" in fix
    assert any("your code writes the gradient at" in e for e in d.evidence)


def test_dp_sgd_with_no_empty_batch_stays_silent() -> None:
    nw, _ = _dp_sgd_poisson(momentum=0.9, empty_at=None)
    assert not nw.anomalies
    assert not [d for d in nw.report.diagnoses if d.code == "NW301"]


# ---------------------------------------------------------------- NW301: projection or not


def test_a_nan_clip_factor_gives_a_generic_fix_not_the_pcgrad_one() -> None:
    """Per-sample clipping written min(norm, C) / norm: 0/0 for an all-zero row. The
    .grad line divides by a constant: the fix points at the line and what it reads."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(model, postmortem=False):
        for _ in range(3):
            x = torch.randn(8, 4)
            x[-1] = 0.0
            per = [torch.autograd.grad(model(r[None]).sum(), list(model.parameters())) for r in x]
            per = [[g * 0 if i == 7 else g for g in gs] for i, gs in enumerate(per)]
            for k, p in enumerate(model.parameters()):
                gk = torch.stack([gs[k] for gs in per])
                norms = gk.flatten(1).norm(dim=1)
                factor = norms.clamp(max=1.0) / norms  # 0/0 for the zero row
                p.grad = (gk * factor.view(-1, *[1] * (gk.dim() - 1))).sum(0) / 8
            sgd.step()
    (d,) = [d for d in info.value.diagnoses if d.code == "NW301"]
    fix = d.fix or ""
    assert "projection" not in fix and "gj" not in fix and "clamp_min(1e-12)" not in fix
    assert "p.grad = (gk * factor.view(-1, *[1] * (gk.dim() - 1))).sum(0) / 8" in fix
    assert "divides by" not in fix  # NaN, not inf: the constant 8 is not the cause
    assert 'assert torch.isfinite(p.grad).all(), "p.grad is not finite"' in fix
    assert "sgd.step()" in fix


def _project(flat: list[torch.Tensor]) -> torch.Tensor:
    out = []
    for i, g0 in enumerate(flat):
        ga = g0
        for j, gb in enumerate(flat):
            if i != j:
                ga = ga - (ga @ gb) / (gb @ gb) * gb  # 0/0 when task j's gradient is 0
        out.append(ga)
    return torch.stack(out).sum(0)


def _surgery(losses: list[torch.Tensor], params: list[nn.Parameter]) -> None:
    flat = [
        torch.cat([g.flatten() for g in torch.autograd.grad(lo, params, retain_graph=True)])
        for lo in losses
    ]
    g = _project(flat)
    k = 0
    for p in params:
        p.grad = g[k : k + p.numel()].view_as(p).clone()
        k += p.numel()


def test_a_projection_keeps_the_guard_in_the_users_own_names() -> None:
    torch.manual_seed(0)
    net = nn.Linear(8, 2)
    params = list(net.parameters())
    adam = torch.optim.SGD(params, lr=0.05)
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(net, postmortem=False):
        for step in range(4):
            out = net(torch.randn(16, 8))
            l1 = (out[:, 0] ** 2).mean()
            l2 = (out[:, 1] ** 2).mean() * (0.0 if step == 2 else 1.0)
            adam.zero_grad()
            _surgery([l1, l2], params)
            adam.step()
    (d,) = [d for d in info.value.diagnoses if d.code == "NW301"]
    fix = d.fix or ""
    assert "(gb @ gb).clamp_min(1e-12)" in fix and "gj" not in fix
    assert "adam.step()" in fix
    assert "projection" in d.explanation and "(ga @ gb) / (gb @ gb)" in d.explanation


# ---------------------------------------------------------------- NW302 / NW303: user names


def _spiky(*, spike: bool):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    crit = nn.MSELoss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(m, crit, postmortem=False) as nw:
            for it in range(12):
                x = torch.randn(32, 8) * (200.0 if spike and it == 10 else 1.0)
                loss = crit(m(x), torch.randn(32, 1))
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()
    return nw


def test_nw303_clip_fix_names_the_users_model_and_optimizer() -> None:
    nw = _spiky(spike=True)
    (d,) = [d for d in nw.report.diagnoses if d.code == "NW303"]
    fix = d.fix or ""
    assert "torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=1.0)" in fix
    assert "# before opt.step()" in fix
    assert "model." not in fix and "optimizer." not in fix


def test_nw303_healthy_twin_is_silent() -> None:
    nw = _spiky(spike=False)
    assert not [d for d in nw.report.diagnoses if d.code == "NW303"]


class _Gain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)
        self.g = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * torch.sqrt((self.g**2).sum())  # d sqrt at 0: 0 * inf = NaN


def test_nw302_skip_fix_names_the_users_model_and_optimizer() -> None:
    torch.manual_seed(0)
    net = _Gain()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    crit = nn.MSELoss()
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(net, crit, postmortem=False, pinpoint=False) as nw,
    ):
        for it in range(4):
            if it == 2:
                with torch.no_grad():
                    net.g.zero_()
            loss = crit(net(torch.randn(8, 4)), torch.randn(8, 1))
            sgd.zero_grad()
            loss.backward()
            sgd.step()
            nw.step()
    (d,) = [d for d in info.value.diagnoses if d.code == "NW302"]
    fix = d.fix or ""
    skip = fix[fix.index("# skip the update") :]
    assert "for p in net.parameters() if p.grad is not None" in skip
    assert skip.rstrip().endswith("sgd.step()")
    assert "model." not in skip and "optimizer." not in skip
    body = skip.replace("sgd.step()", "stepped.append(1)")
    stepped: list[int] = []
    exec(body, {"torch": torch, "net": net, "stepped": stepped})
    assert not stepped  # the NaN gradient skips the update
