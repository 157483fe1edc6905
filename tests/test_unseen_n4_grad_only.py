"""A loop that trains with ``torch.autograd.grad`` alone, no ``backward()``: ``grads =
torch.autograd.grad(loss, params)``, then its own update (``p.data -= lr * g``, or ``p -=
lr * g`` under no_grad). In sentinel mode the NaN gradient it takes was never read (no
``.grad``): a step later the NaN weights were blamed on "a .data write" (NW301), and with
``p.data`` every step was step 0, since no version counter shows a ``.data`` write. The
gradients autograd.grad returns for watched weights are checked as ``.grad`` is, and the
next forward begins a step; a MAML inner loop (``functional_call`` with fast weights)
stays in its step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import nanwatch


class _LogFeatures(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_LogFeatures(), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _train(nw: Any, model: nn.Module, update: str, bad_step: int | None, steps: int = 6) -> None:
    params = list(model.parameters())
    for step in range(steps):
        x = torch.rand(32, 8) + 0.1
        if step == bad_step:
            x[5, 2] = 0.0  # log(0) = -inf; tanh saturates: finite loss, NaN weight gradient
        y = torch.randn(32, 1)
        loss = ((model(x) - y) ** 2).mean()
        if update == "data":  # the weights as a generator, read once by autograd.grad
            grads = torch.autograd.grad(loss, model.parameters())
        else:
            grads = torch.autograd.grad(loss, params)
        if update == "data":
            for p, g in zip(params, grads, strict=True):
                p.data -= 0.01 * g
        else:
            with torch.no_grad():
                for w, g in zip(params, grads, strict=True):
                    w.sub_(0.01 * g)


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
@pytest.mark.parametrize("update", ["data", "no_grad"])
def test_the_anomaly_is_named_at_the_step_that_made_it(mode: str, update: str) -> None:
    """Step 3, not step 0 (every step of a .data update loop was step 0) nor step 4 (the
    NaN weights the update wrote, read at the next forward)."""
    model = _model()
    with (
        pytest.raises(nanwatch.AnomalyError) as ei,
        nanwatch.watch(model, mode=mode, postmortem=False) as nw,
    ):
        _train(nw, model, update, bad_step=3)
    assert ei.value.anomaly is not None and ei.value.anomaly.step == 3
    assert ei.value.diagnoses[0].step == 3


@pytest.mark.accelerator_weaker(
    reason="the gradients' norms are read at the step end, after the hand-written update "
    "wrote NaN weights (no hook runs before it): NW301, as with backward() and p.data"
)
@pytest.mark.parametrize("update", ["data", "no_grad"])
def test_sentinel_names_the_nan_gradient_autograd_grad_returned(update: str) -> None:
    model = _model()
    with (
        pytest.raises(nanwatch.AnomalyError) as ei,
        nanwatch.watch(model, mode="sentinel", postmortem=False) as nw,
    ):
        _train(nw, model, update, bad_step=3)
    msg = str(ei.value)
    assert "gradient born in the backward of 1" in msg and "1.weight" in msg
    assert "NW301" not in {d.code for d in ei.value.diagnoses}  # not "a .data write"


@pytest.mark.gpu_bound_weaker(
    reason="nothing has landed when autograd.grad begins: the forward's statistics are read "
    "at the step end, after the update wrote NaN weights (NW301, as with backward())"
)
def test_watch_names_the_log_of_a_data_update_loop() -> None:
    model = _model()
    with pytest.raises(nanwatch.AnomalyError) as ei, nanwatch.watch(model, postmortem=False) as nw:
        _train(nw, model, "data", bad_step=3)
    d = ei.value.diagnoses[0]
    assert d.code == "NW110" and d.path == "0"


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
@pytest.mark.parametrize("update", ["data", "no_grad"])
def test_healthy_grad_only_loop_is_silent_one_step_an_update(mode: str, update: str) -> None:
    model = _model()
    with nanwatch.watch(model, mode=mode, postmortem=False) as nw:
        _train(nw, model, update, bad_step=None)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not [d for t in nw.history for d in t.diagnoses]
    assert [t.step for t in nw.history] == list(range(6))


@pytest.mark.parametrize("create_graph", [False, True])
def test_maml_inner_loop_stays_in_its_meta_step(create_graph: bool) -> None:
    """First- and second-order MAML: the inner steps take the weights' gradients with
    autograd.grad, then run the model on fast weights (functional_call): one step per
    meta-update, and a NaN made in the query batch of meta-step 3 is named at step 3."""
    model = _model()
    meta_opt = torch.optim.Adam(model.parameters(), 1e-3)
    with pytest.raises(nanwatch.AnomalyError) as ei, nanwatch.watch(model, postmortem=False) as nw:
        for it in range(5):
            assert [t.step for t in nw.history] == list(range(it - 1))  # ended ones
            meta_opt.zero_grad()
            for task in range(2):
                xs, ys = torch.rand(10, 8) + 0.1, torch.randn(10, 1)
                xq, yq = torch.rand(10, 8) + 0.1, torch.randn(10, 1)
                if it == 3 and task == 1:
                    xq[2, 1] = 0.0
                fast = dict(model.named_parameters())
                for _ in range(2):
                    inner = ((functional_call(model, fast, (xs,)) - ys) ** 2).mean()
                    g = torch.autograd.grad(inner, list(fast.values()), create_graph=create_graph)
                    fast = {n: w - 0.1 * gi for (n, w), gi in zip(fast.items(), g, strict=True)}
                ((functional_call(model, fast, (xq,)) - yq) ** 2).mean().backward()
            meta_opt.step()
    assert ei.value.anomaly is not None and ei.value.anomaly.step == 3
    assert ei.value.diagnoses[0].code == "NW110"
