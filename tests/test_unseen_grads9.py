"""Exploding gradients (NW303) stays quiet on healthy runs: a small parameter whose
gradient grows steadily as it learns (GAT attention vectors), or noisily as an MDN's sigmas
shrink, while the total norm does not spike; a loop that clips before ``step()`` with no
loss module called (``loss = -flow(x).mean()``). Real jumps are still reported."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn

import nanwatch
from nanwatch.records import StepTrace
from nanwatch.rules.base import Diagnosis
from nanwatch.rules.testing import TraceBuilder, diagnose, stat

torch.set_num_threads(1)


def _diags(nw: Any, code: str) -> list[Diagnosis]:
    return [d for t in nw.history for d in t.diagnoses if d.code == code]


# ---------------------------------------------------------------- NW303: parameter rises


def _step(i: int, att: float, weight: float = 0.1) -> StepTrace:
    """A GAT-like layer: a large weight and a small attention vector, and the total norm."""
    b = TraceBuilder(i)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-1.0, 1.0, numel=32), shape=(4, 8))
    fc = b.call("conv", "GATConv", parent=net)
    b.input(fc, source=x, shape=(4, 8))
    o = b.forward(fc, stat(-1.0, 1.0, numel=16), shape=(4, 4), grad_fn="AddmmBackward0")
    b.forward(net, source=o, shape=(4, 4), grad_fn="AddmmBackward0")
    b.backward(o, stat(-0.01, 0.01, numel=16))
    b.gradient("conv", "conv.lin.weight", weight)
    b.gradient("conv", "conv.att_src", att)
    return b.build(loss=1.0, grad_norm=math.hypot(weight, att))


def _codes(cur: StepTrace, hist: list[StepTrace]) -> list[str]:
    return [d.code for d in diagnose(cur, hist)]


def test_a_parameter_whose_gradient_grows_steadily_is_not_exploding() -> None:
    """GAT: att_src starts near 0 (near-uniform attention) and grows 0.0009 -> 0.06 over
    18 steps, never 3x in one step; the total norm stays small. It was NW303 (14x its
    whole-run median) with a clip at max_norm=1.0 that clips nothing."""
    atts = [0.0009 * 1.28**i for i in range(18)]
    hist = [_step(i, a, weight=0.1 + 0.005 * i) for i, a in enumerate(atts)]
    cur = _step(18, atts[-1] * 2.5, weight=0.2)
    assert "NW303" not in _codes(cur, hist)


def test_a_noisy_rise_of_one_bias_without_a_total_spike_is_not_exploding() -> None:
    """MDN early in training: mu.bias's gradient rises like 1/sigma^2 with noise (0.07 ..
    0.66), then one step is 1.56: 13x its whole median, 2.4x its largest of the last
    steps, while the total is 6x its median. It was NW303."""
    bias = [0.066, 0.11, 0.068, 0.087, 0.109, 0.161, 0.126, 0.104, 0.168, 0.179, 0.0965]
    bias += [0.413, 0.662, 0.247]
    hist = [_step(i, v, weight=0.8) for i, v in enumerate(bias)]
    cur = _step(14, 1.564, weight=4.7)
    assert "NW303" not in _codes(cur, hist)


def test_a_one_step_jump_of_a_parameter_is_still_exploding() -> None:
    """From a steady level, the same parameter jumps 20x in one step: reported, by name."""
    hist = [_step(i, 0.01 * (1 + 0.02 * i)) for i in range(10)]
    found = [d for d in diagnose(_step(10, 0.2), hist) if d.code == "NW303"]
    assert found and found[0].parameter == "conv.att_src"


# ---------------------------------------------------------------- NW303: clip, no loss module


def _flow_like() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def _batch(i: int) -> torch.Tensor:
    """Step 10's batch is 300 times larger: a spike of every gradient."""
    return torch.randn(32, 4) * (300.0 if i == 10 else 1.0)


def _clipped() -> Any:
    """A model that returns its own loss terms (``loss = -model(x).mean()``: no loss
    module or functional loss called), clipped between backward() and step()."""
    model, opt = _flow_like()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, postmortem=False) as nw:
            for i in range(14):
                loss = -model(_batch(i)).mean()
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                nw.step()
    return nw


def _unclipped() -> Any:
    model, opt = _flow_like()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, postmortem=False) as nw:
            for i in range(14):
                loss = -model(_batch(i)).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()
    return nw


def test_a_clip_before_step_is_found_without_a_loss_module() -> None:
    """The optimizer's note has no source line; the clip in the loop that runs the rules
    is found all the same. It was NW303 with the very clip as the fix."""
    assert not _diags(_clipped(), "NW303")


def test_the_same_spike_unclipped_is_still_reported() -> None:
    found = _diags(_unclipped(), "NW303")
    assert found and "clip_grad_norm_" in (found[0].fix or "")


# ---------------------------------------------------------------- NW304: padding lookups


class _TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.uid = nn.Embedding(50, 8)
        self.creators = nn.EmbeddingBag(21, 8, mode="sum", padding_idx=0)
        self.mlp = nn.Linear(16, 8)

    def forward(self, u: torch.Tensor, cr: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(torch.cat([self.uid(u), self.creators(cr)], -1))
        return out


def _cold_start() -> Any:
    """A multi-hot feature every id of which is padding_idx from step 2 on (a cold-start
    cohort)."""
    torch.manual_seed(0)
    model = _TwoTower()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, postmortem=False) as nw:
            for step in range(10):
                u = torch.randint(0, 50, (16,))
                cr = torch.zeros(16, 4, dtype=torch.long)
                if step < 2:
                    cr[:4] = torch.randint(1, 21, (4, 4))
                loss = model(u, cr).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()
    return nw


def test_an_embedding_bag_given_only_its_padding_idx_is_not_vanishing() -> None:
    """Every id is padding_idx for a run of batches: the output is 0 and the weight gets
    no gradient by definition. It was NW304 'find what stops the gradient'."""
    assert not _diags(_cold_start(), "NW304")


# ---------------------------------------------------------------- NW304: a ReLU'd variance


class _Hetero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 32), nn.ReLU())
        self.mean, self.var = nn.Linear(32, 1), nn.Linear(32, 1)
        nn.init.constant_(self.var.bias, -3.0)
        nn.init.zeros_(self.var.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.mean(h), torch.relu(self.var(h))


def test_a_relu_variance_for_gaussian_nll_is_told_softplus_not_leaky_relu() -> None:
    """var = relu(linear) fed to nn.GaussianNLLLoss: every var is 0, no gradient reaches
    the var head. nn.LeakyReLU(0.01) makes var negative and GaussianNLLLoss raises; the
    fix is a softplus."""
    torch.manual_seed(0)
    model, crit = _Hetero(), nn.GaussianNLLLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, crit, postmortem=False) as nw:
            for _ in range(8):
                x = torch.randn(32, 3)
                mu, var = model(x)
                loss = crit(mu, x.sum(1, keepdim=True), var)
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()
    found = _diags(nw, "NW304")
    assert found and found[0].path == "var"
    fix = found[0].fix or ""
    assert "F.softplus(v) + 1e-6" in fix and "LeakyReLU" not in fix
