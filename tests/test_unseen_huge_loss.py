"""A huge finite loss is said before it turns into inf (NW106); an overflow whose large
operand is data the model never made names the data; a converged fit that meets one
flipped label is no explosion; and NW303 speaks for a silenced NW308."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch import Diagnosis, scenarios
from nanwatch.rules._evidence import fmt

MODES = ["watch", "sentinel"]


@pytest.mark.parametrize("mode", MODES)
def test_exploding_gradients_name_the_lr_when_nw308_is_ignored(mode: str) -> None:
    """lr-explode (SGD at lr=1e3): NW303 leaves an oversized update to NW308's loss spike;
    with NW308 silenced by the user, NW303 names the lr itself."""
    out = scenarios.run(scenarios.get("lr-explode"), mode=mode, ignore=["NW308"])
    assert out.watcher is not None
    found = [d for t in out.watcher.history for d in t.diagnoses if d.code == "NW303"]
    assert found, "NW303 stayed silent on the steps NW308 would have explained"
    d = found[0]
    assert d.step is not None and d.step <= 5
    assert any("(SGD, param group 0, lr 1000) moved proj.weight" in e for e in d.evidence)
    assert d.fix.startswith('opt.param_groups[0]["lr"] = 2e-4   # was 1000 (SGD)')


# ---------------------------------------------------------------- NW106: a huge finite loss


class _DirichletVAE(nn.Module):
    """A topic model whose encoder's bias makes the Dirichlet concentration ~1e-13."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(50, 10)
        self.dec = nn.Linear(10, 50)
        with torch.no_grad():
            self.enc.bias.fill_(-30.0)

    def forward(self, bow: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        alpha = F.softplus(self.enc(bow))
        theta = torch.distributions.Dirichlet(alpha).rsample()
        return F.log_softmax(self.dec(theta), -1), alpha


def _dirichlet_run(mode: str, steps: int = 2) -> tuple[Any, list[float]]:
    torch.manual_seed(0)
    model = _DirichletVAE()
    bow = torch.randint(0, 3, (32, 50)).float()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(steps):
            logp, alpha = model(bow)
            prior = torch.distributions.Dirichlet(torch.ones_like(alpha))
            kl = torch.distributions.kl_divergence(torch.distributions.Dirichlet(alpha), prior)
            loss = -(bow * logp).sum(-1).mean() + kl.mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
            losses.append(loss.item())
    return nw, losses


def _found(nw: Any, code: str) -> list[Diagnosis]:
    return [d for t in nw.history for d in t.diagnoses if d.code == code]


@pytest.mark.parametrize("mode", MODES)
def test_a_dirichlet_concentration_near_0_is_warned_at_its_huge_finite_loss(mode: str) -> None:
    nw, losses = _dirichlet_run(mode)
    assert all(math.isfinite(x) and x > 1e13 for x in losses)  # finite, no NaN yet
    found = _found(nw, "NW106")
    assert [d.step for d in found] == [0], "said once, at the first step of it"
    d = found[0]
    assert d.severity == "warning" and d.path == "_DirichletVAE"
    text = "\n".join(d.evidence)
    assert f"loss {fmt(losses[0])} at step 0: " in text and "× a sum of squares of all" in text
    assert "_DirichletVAE (output[1]) holds only tiny positive values, |x| from" in text
    assert "the loss blows up as they go to 0" in text
    assert "lgamma(x) and digamma(x)" in d.explanation and "Dirichlet" in d.explanation
    assert d.fix.startswith(
        "# a floor under the positive quantity _DirichletVAE (output[1]) returns keeps the "
        "term finite\nx = F.softplus(raw) + 1e-3"
    )
    if mode == "watch":  # the encoder's output is measured: softplus of it made alpha
        assert "enc's output, from -3" in text
        assert d.fix.endswith(
            "# and bring enc's output near 0 (its initialization: a bias far below 0)"
        )


def _healthy(loss_fn: Any, model: nn.Module, x: torch.Tensor, mode: str, steps: int = 3) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(steps):
            loss = loss_fn(model(x))
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", MODES)
def test_large_legitimate_losses_are_silent(mode: str) -> None:
    """Sum-reduced losses over a big batch, and a regression on targets in raw units read
    by the loss, are large and healthy: no NW106."""
    torch.manual_seed(0)
    x = torch.randn(4096, 16)
    y = torch.randn(4096, 8)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
    nw = _healthy(lambda p: F.mse_loss(p, y * 3, reduction="sum"), model, x, mode)
    assert nw.history[0].loss is not None and nw.history[0].loss > 1e5
    assert not _found(nw, "NW106")
    # a hand-written sum of squares, the targets never seen by nanwatch
    nw = _healthy(lambda p: ((p - y * 3) ** 2).sum(), model, x, mode)
    assert not _found(nw, "NW106")
    # sum-reduced cross-entropy over many tokens
    labels = torch.randint(0, 8, (4096,))
    nw = _healthy(lambda p: F.cross_entropy(p * 10, labels, reduction="sum"), model, x, mode)
    assert nw.history[0].loss is not None and nw.history[0].loss > 1e4
    assert not _found(nw, "NW106")
    # house prices in dollars: large, but the loss read its targets
    prices = torch.rand(4096, 8) * 5e5
    nw = _healthy(lambda p: F.mse_loss(p, prices), model, x, mode)
    assert nw.history[0].loss is not None and nw.history[0].loss > 1e10
    assert not _found(nw, "NW106")


# ------------------------------------------- NW101: log-cosh of a target never standardized


def _log_cosh_run(mode: str, *, target_scale: float, weight_scale: float) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
    with torch.no_grad():
        model[2].weight.mul_(weight_scale)
    x = torch.randn(64, 4)
    y = torch.randn(64, 1) * target_scale
    y[0] = 5 * target_scale
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        pred = model(x)
        loss = torch.log(torch.cosh(pred - y)).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        nw.step()
    return nw


@pytest.mark.parametrize("mode", MODES)
def test_log_cosh_of_targets_in_raw_units_names_the_targets(mode: str) -> None:
    nw = _log_cosh_run(mode, target_scale=100.0, weight_scale=1.0)
    d = _found(nw, "NW101")[0]
    text = "\n".join(d.evidence)
    assert "aten.cosh's argument is a sub of the model's output (at most |x| = " in text
    assert "and a tensor no watched module made, at least |y| = 4" in text
    assert "data passed to the loss (the target) puts it at 500" in text
    assert "the initial weights or the inputs put it there" not in text
    assert "the targets were never standardized" in d.explanation
    assert "log-variance" not in d.explanation
    assert d.fix.startswith("y = (y - y_mean) / y_std   # standardize the target")
    assert "log_cosh = d.abs() + F.softplus(-2 * d.abs()) - math.log(2)" in d.fix


@pytest.mark.parametrize("mode", MODES)
def test_log_cosh_of_a_prediction_that_exploded_does_not_blame_the_targets(mode: str) -> None:
    """Standardized targets, a prediction grown past cosh's bound: the model made it."""
    nw = _log_cosh_run(mode, target_scale=1.0, weight_scale=1e3)
    d = _found(nw, "NW101")[0]
    assert "the targets were never standardized" not in d.explanation
    assert not any("no watched module made" in e for e in d.evidence)
    # cosh overflows on both sides: its bound and its argument are in |x|
    assert "cosh overflows float32 for |x| above 89.42; its argument reached |x| = " in (
        d.explanation
    )


# ------------------------------------- NW303: one flipped label in a memorized batch


@pytest.mark.parametrize("mode", MODES)
def test_one_flipped_label_in_a_memorized_batch_is_no_explosion(mode: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(32, 10)
    labels = torch.randint(0, 3, (32,))
    model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    flip = 155
    losses = []
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for step in range(flip + 3):
            y = labels.clone()
            if step == flip:
                y[0] = (y[0] + 1) % 3
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
            losses.append(loss.item())
    assert losses[flip] > 5 * losses[flip - 1]  # the one sample's -log p
    grads = [t.grad_norm or 0.0 for t in nw.history]
    assert grads[-3] > 10 * grads[-4]  # the gradients jumped with it
    assert not _found(nw, "NW303")
