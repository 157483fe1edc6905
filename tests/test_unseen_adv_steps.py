"""Adversarial and consistency training: the steps of a loop whose attack or penalty does
extra forward/backward work inside one training step, a NaN an attack's per-sample
normalization makes (0/0 where an input gradient is exactly 0), and gradients that
torch.autograd.grad computed (a saliency, an R1 penalty) kept out of the spike rules.
Tiny real loops on CPU."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import AnomalyKind, Phase, StepTrace
from nanwatch.report import Report

from ._diagnoses import text


def _convnet(bias: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=bias),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 5),
    )


# ---------------------------------------------------------------- steps
def _pgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """PGD-3 with the usual ``loss.backward(); g = delta.grad; model.zero_grad()``."""
    delta = torch.zeros_like(x).requires_grad_(True)
    for _ in range(3):
        F.cross_entropy(model(x + delta), y).backward()
        g = delta.grad
        assert g is not None
        delta.data = (delta.data + 0.01 * g.sign()).clamp(-0.03, 0.03)
        g.zero_()
        model.zero_grad()
    return (x + delta).detach()


@pytest.mark.parametrize("explicit", [True, False])
def test_a_pgd_attack_by_backward_is_part_of_the_training_step(explicit: bool) -> None:
    """Each attack backward() whose gradients are reset used to end a step: with nw.step()
    the first iteration was 4 steps (a NaN of step 2 was said at step 5), without it every
    iteration was (step 8)."""
    model = _convnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for it in range(4):
            x, y = torch.rand(6, 3, 5, 5), torch.randint(0, 5, (6,))
            if it == 2:
                x[1, 0, 2, 2] = float("nan")  # a bad pixel in the user's step 2
            loss = F.cross_entropy(model(_pgd(model, x, y)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if explicit:
                nw.step()
    assert [t.step for t in nw.history] == [0, 1, 2, 3]
    # every step holds the three attack calls and the training call
    assert [sum(c.root for c in t.calls if c.path == "Sequential") for t in nw.history] == [4] * 4
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.INPUT and a.step == 2
    d = nw.history[2].diagnoses[0]
    assert d.code == "NW401" and d.title == "NaN or inf in the input data"  # the batch's


def _vat_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        pred = F.softmax(model(x), dim=1)
    d = torch.rand_like(x) - 0.5
    d = (d / (d.flatten(1).norm(dim=1).view(-1, 1, 1, 1) + 1e-8)).requires_grad_()
    adv = F.kl_div(F.log_softmax(model(x + 1e-6 * d), dim=1), pred, reduction="batchmean")
    (g,) = torch.autograd.grad(adv, d)
    r = 2.0 * g / (g.flatten(1).norm(dim=1).view(-1, 1, 1, 1) + 1e-8)
    return F.kl_div(F.log_softmax(model(x + r), dim=1), pred, reduction="batchmean")


@pytest.mark.parametrize("explicit", [True, False])
def test_a_no_grad_forward_inside_a_training_step_does_not_end_it(explicit: bool) -> None:
    """VAT's targets under no_grad, after the step's first grad-enabled forward: 4
    iterations were 8 steps without nw.step() (5 with it)."""
    model = _convnet()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with nanwatch.watch(model, postmortem=False) as nw:
        for _ in range(4):
            xl, yl, xu = torch.rand(6, 3, 5, 5), torch.randint(0, 5, (6,)), torch.rand(6, 3, 5, 5)
            loss = F.cross_entropy(model(xl), yl) + _vat_loss(model, xu)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if explicit:
                nw.step()
    assert [t.step for t in nw.history] == [0, 1, 2, 3]
    assert nw.report.diagnoses == []


@pytest.mark.parametrize("explicit", [True, False])
def test_a_gan_iteration_is_one_step_from_the_first_with_nw_step(explicit: bool) -> None:
    """The discriminator watched first: its update ended a step before the generator's in
    the first iteration (5 steps for 4 iterations). Without nw.step() each update is a step,
    as the README says of several models."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6))
    D = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
    og, od = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
    with nanwatch.watch(D, G, postmortem=False) as nw:
        for _ in range(4):
            fake = G(torch.randn(8, 4))
            loss_d = D(fake.detach()).mean() - D(torch.randn(8, 6)).mean()
            od.zero_grad()
            loss_d.backward()
            od.step()
            loss_g = -D(fake).mean()
            og.zero_grad()
            loss_g.backward()
            og.step()
            if explicit:
                nw.step()
    assert [t.step for t in nw.history] == list(range(4 if explicit else 8))


# ---------------------------------------------------------------- NW401: 0/0 of an attack
def _l2_pgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    delta = torch.zeros_like(x)
    for _ in range(2):
        delta.requires_grad_(True)
        (grad,) = torch.autograd.grad(F.cross_entropy(model(x + delta), y), delta)
        g = grad / grad.flatten(1).norm(dim=1).view(-1, 1, 1, 1)  # 0/0: a blank sample
        delta = delta.detach() + 0.1 * g
    return (x + delta).detach()


def _l2_pgd_run(blank_at: int, *, bad_batch: bool = False) -> nanwatch.Watcher:
    model = _convnet(bias=False)  # no bias, then ReLU: a blank image's input gradient is 0
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for it in range(3):
            x, y = torch.rand(6, 3, 5, 5), torch.randint(0, 5, (6,))
            if it == blank_at:
                x[3] = float("nan") if bad_batch else 0.0
            loss = F.cross_entropy(model(_l2_pgd(model, x, y)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
            if nw.first_anomaly is not None:
                break
    return nw


def test_a_nan_an_attack_computed_between_two_calls_is_not_bad_data() -> None:
    nw = _l2_pgd_run(blank_at=1)
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.INPUT and a.step == 1
    d = nw.history[1].diagnoses[0]
    assert d.code == "NW401"
    assert d.title == "NaN in an input your code computed between two calls of Sequential"
    t = text(d)
    assert "called earlier in this step with a finite input[0] of the same shape" in t
    assert "every value of the bad sample is NaN" in t
    assert "clamp_min(eps)" in d.fix and "nan_to_num" not in d.fix
    assert "every layer downstream is innocent" not in t and "dataset" not in t
    # the fix, pasted, keeps a sample whose gradient is exactly 0 at 0
    space: dict[str, object] = {"torch": torch}
    exec(d.fix, space)
    grad = torch.rand(4, 3, 2, 2)
    grad[2] = 0.0
    g = space["l2_normalize"](grad)  # type: ignore[operator]
    assert torch.isfinite(g).all() and g[2].eq(0).all()
    assert torch.allclose(g[0].norm(), torch.tensor(1.0))


def test_a_whole_nan_sample_in_the_batch_itself_is_still_bad_data() -> None:
    """The twin: the batch's own sample is NaN throughout; the step's first call gets it."""
    nw = _l2_pgd_run(blank_at=1, bad_batch=True)
    d = nw.history[1].diagnoses[0]
    assert d.code == "NW401" and d.title == "NaN or inf in the input data"
    assert "nan_to_num" in d.fix


def test_vat_without_eps_in_its_first_step_is_named_as_the_users_computation() -> None:
    """VAT by backward(): before the first update the attack backward still ends a step,
    so the NaN input is the next step's first; the step before, with the clean batch and
    no update, shows it was computed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 5))
    opt = torch.optim.Adam(model.parameters(), 1e-3)

    def l2n(d: torch.Tensor) -> torch.Tensor:
        return d / d.flatten(1).norm(dim=1).view(-1, 1, 1, 1)  # no eps

    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        xu = torch.rand(6, 3, 2, 2) * 255
        with torch.no_grad():
            pred = F.softmax(model(xu), dim=1)
        d = l2n(torch.rand_like(xu) - 0.5).requires_grad_()
        # x + 1e-6 * d rounds to x at 255: d.grad is exactly 0
        F.kl_div(F.log_softmax(model(xu + 1e-6 * d), 1), pred, reduction="batchmean").backward()
        assert d.grad is not None
        r = l2n(d.grad) * 2.0
        model.zero_grad()
        loss = F.kl_div(F.log_softmax(model(xu + r), 1), pred, reduction="batchmean")
        opt.zero_grad()
        loss.backward()
        opt.step()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.INPUT
    dg = next(t for t in nw.history if t.anomaly is a).diagnoses[0]
    assert dg.code == "NW401" and "computed between two calls" in dg.title
    assert "before any update" in text(dg)


# ---------------------------------------------------------------- NW303/NW304: autograd.grad
def test_a_saliency_by_autograd_grad_is_no_gradient_spike() -> None:
    """The seed of autograd.grad(logits.gather(1, y).sum(), x) is all ones: it was read as
    the last layer's training gradient, 34 times its median (NW303)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 5))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with nanwatch.watch(model, nn.CrossEntropyLoss(), postmortem=False) as nw:
        for it in range(8):
            x, y = torch.rand(16, 3, 2, 2), torch.randint(0, 5, (16,))
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if it % 3 == 2:  # a saliency map for the logs
                xs = x[:4].clone().requires_grad_(True)
                torch.autograd.grad(model(xs).gather(1, y[:4, None]).sum(), xs)
            nw.step()
    assert [d.code for d in nw.report.diagnoses] == []
    saliency = [r for r in nw.history[2].records if r.phase is Phase.BACKWARD and r.by_grad]
    trained = [r for r in nw.history[2].records if r.phase is Phase.BACKWARD and not r.by_grad]
    assert saliency and trained
    # the report keeps which gradients autograd.grad made
    again = Report.from_dict(json.loads(nw.report.to_json()))
    step: StepTrace | None = again.step(2)
    assert step is not None
    assert sum(r.by_grad for r in step.records) == len(saliency)


@pytest.mark.parametrize("penalty", ["lazy R1", "WGAN-GP"])
def test_a_gradient_penalty_is_no_spike_nor_vanishing_gradient(penalty: str) -> None:
    """Lazy R1 every 4 steps (its seed of ones made NW303), and WGAN-GP, whose training
    backward reaches D(x_hat) only through the penalty's second derivative, exactly 0
    through LeakyReLU and Linear (it must not read as dead units, NW304)."""
    torch.manual_seed(0)
    D = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 16))
    D.append(nn.LeakyReLU(0.2)).append(nn.Linear(16, 1))
    od = torch.optim.Adam(D.parameters(), 2e-4, betas=(0.0, 0.99))
    with nanwatch.watch(D, postmortem=False) as nw:
        for it in range(8):
            real, fake = torch.randn(16, 6) * 0.5 + 1, torch.randn(16, 6)
            loss = F.softplus(D(fake)).mean() + F.softplus(-D(real)).mean()
            if penalty == "WGAN-GP":
                a = torch.rand(16, 1)
                xi = (a * real + (1 - a) * fake).requires_grad_(True)
                (g,) = torch.autograd.grad(D(xi).sum(), xi, create_graph=True)
                loss = loss + 10 * ((g.norm(2, dim=1) - 1) ** 2).mean()
            elif it % 4 == 0:
                real.requires_grad_(True)
                (g,) = torch.autograd.grad(D(real).sum(), real, create_graph=True)
                loss = loss + 0.0 * g.pow(2).sum(1).mean()  # gamma 0: nothing changes
            od.zero_grad()
            loss.backward()
            od.step()
            nw.step()
    assert [d.code for d in nw.report.diagnoses] == []
