"""Gradient norms of large CPU weights are read in a post-accumulate-grad hook, while the
gradient is still in the cache, and taken by the end-of-backward check only while they
still describe ``.grad``: the same tensor, at the same version. Everything else is read
after backward, as before."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.records import Phase
from nanwatch.stats import foreach_finite_probe, hot_l2_pays, l2

WIDE = 512  # 512 x 512 weights: 262,144 values, past the size where the hook pays


def _grad_norms(w: nanwatch.Watcher) -> dict[str, float]:
    return {
        r.role: r.stat.norm  # type: ignore[union-attr]
        for r in w.trace.records
        if r.phase is Phase.GRADIENT and r.stat is not None
    }


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDE, WIDE), nn.Tanh(), nn.Linear(WIDE, 4))


def test_only_large_dense_float_cpu_tensors_take_the_hook() -> None:
    assert hot_l2_pays(torch.zeros(WIDE, WIDE))
    assert hot_l2_pays(torch.zeros(WIDE, WIDE, dtype=torch.float64))
    assert not hot_l2_pays(torch.zeros(16, 16))  # small: one multi-tensor call after backward
    assert not hot_l2_pays(torch.zeros(WIDE, WIDE, dtype=torch.float16))
    assert not hot_l2_pays(nn.Parameter(torch.zeros(WIDE, WIDE)))  # a subclass
    assert float(l2(torch.tensor([[3.0], [4.0]]))) == 5.0


def test_a_large_weight_gets_a_hook_that_detach_removes() -> None:
    model = _model()
    w = nanwatch.watch(model, mode="sentinel")
    with w:
        assert set(w._param_hooks) == {id(model[0].weight)}  # 2,048 bias/head values: no hook
        model(torch.randn(8, WIDE)).sum().backward()
    assert not w._param_hooks and not model[0].weight._post_accumulate_grad_hooks


@pytest.mark.cpu_path(reason="CPU hooks read large gradients' norms as backward writes them")
def test_the_recorded_norm_is_the_gradients_norm() -> None:
    model = _model()
    with nanwatch.watch(model, mode="sentinel") as w:
        model(torch.randn(8, WIDE)).pow(2).sum().backward()
        norms = _grad_norms(w)
        for name, p in model.named_parameters():
            assert p.grad is not None
            assert norms[name] == pytest.approx(p.grad.norm().item(), rel=1e-5)


@pytest.mark.cpu_path(reason="CPU hooks read large gradients' norms as backward writes them")
def test_a_gradient_changed_after_the_hook_read_it_is_read_again() -> None:
    """A hook of the user's that runs after nanwatch's (clipping, a gradient noise) writes
    the gradient in place: the version moved, so the norm of what the optimizer will apply
    is recorded, not the one the hook saw."""
    model = _model()
    with nanwatch.watch(model, mode="sentinel", on_anomaly="record") as w:
        weight = model[0].weight

        def clip(p: torch.Tensor) -> None:
            assert p.grad is not None
            p.grad.mul_(3.0)

        user = weight.register_post_accumulate_grad_hook(clip)
        try:
            model(torch.randn(8, WIDE)).pow(2).sum().backward()
        finally:
            user.remove()
        assert weight.grad is not None
        assert _grad_norms(w)["0.weight"] == pytest.approx(weight.grad.norm().item(), rel=1e-5)


@pytest.mark.cpu_path(reason="CPU hooks read large gradients' norms as backward writes them")
def test_a_nan_written_into_the_gradient_after_the_hook_is_found() -> None:
    model = _model()
    with nanwatch.watch(model, mode="sentinel", on_anomaly="record") as w:
        weight = model[0].weight

        def poison(p: torch.Tensor) -> None:
            assert p.grad is not None
            p.grad[0, 0] = math.nan

        user = weight.register_post_accumulate_grad_hook(poison)
        try:
            model(torch.randn(8, WIDE)).pow(2).sum().backward()
        finally:
            user.remove()
        bad = [
            r
            for r in w.trace.records
            if r.phase is Phase.GRADIENT and r.stat is not None and not r.stat.finite
        ]
        assert [r.role for r in bad] == ["0.weight"]
        assert bad[0].stat is not None and bad[0].stat.nan == 1


@pytest.mark.cpu_path(reason="CPU hooks read large gradients' norms as backward writes them")
def test_accumulated_gradients_are_measured_after_each_backward() -> None:
    model = _model()
    x = torch.randn(8, WIDE)
    with nanwatch.watch(model, mode="sentinel") as w:
        model(x).sum().backward()
        first = _grad_norms(w)["0.weight"]
        model(x).sum().backward()  # accumulates: twice the first gradient
        weight = model[0].weight
        assert weight.grad is not None
        assert [r.stat.norm for r in w.trace.records if r.role == "0.weight"][-1] == (
            pytest.approx(2 * first, rel=1e-5)
        )


def test_the_hook_keeps_no_gradient_alive() -> None:
    """zero_grad(set_to_none=True) frees the gradients: the hook's note of what it read
    holds a weak reference, so the memory comes back before the next forward."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, mode="sentinel") as w:
        model(torch.randn(8, WIDE)).sum().backward()
        ref = weakref.ref(model[0].weight.grad)  # type: ignore[arg-type]
        opt.step()
        opt.zero_grad(set_to_none=True)
        w.step()
        assert ref() is None


@pytest.mark.cpu_path(reason="CPU hooks read large gradients' norms as backward writes them")
def test_forensic_mode_reads_after_backward() -> None:
    model = _model()
    with nanwatch.watch(model, mode="forensic") as w:
        assert not w._param_hooks
        model(torch.randn(8, WIDE)).sum().backward()
        grad = model[0].weight.grad
        assert grad is not None
        assert _grad_norms(w)["0.weight"] == pytest.approx(grad.norm().item(), rel=1e-5)


def test_the_weight_probe_is_finite_exactly_when_it_need_not_look_closer() -> None:
    """After an update, watch asks only whether each weight is finite: a large CPU weight
    gets its L2 norm (one pass), which NaN and inf make non-finite, and whose squares finite
    values past sqrt(float32 max) overflow too: "look closer", not "bad"."""
    big = torch.randn(WIDE, WIDE)
    small = torch.tensor([-3.0, 2.0])
    probe, exact = foreach_finite_probe([big, small])
    assert probe.item() == pytest.approx(big.norm().item(), rel=1e-4)
    assert exact.item() == 3.0  # below the size where the dot pays: its max |x|
    big[1, 2] = math.nan
    assert math.isnan(foreach_finite_probe([big])[0].item())
    big[1, 2] = 1e20  # finite, but its square is not
    assert math.isinf(foreach_finite_probe([big])[0].item())


def _weights_step(value: float) -> nanwatch.Watcher:
    """One watched step whose update writes ``value`` into the large weight."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanwatch.watch(model, mode="watch", on_anomaly="record") as w:
        model(torch.randn(8, WIDE)).pow(2).sum().backward()
        opt.step()
        with torch.no_grad():
            model[0].weight[3, 4] = value  # as an update would
        w.step()
    return w


def test_a_finite_weight_past_the_probes_range_is_no_anomaly() -> None:
    w = _weights_step(1e20)
    assert w.first_anomaly is None
    assert not [r for r in w.history[-1].records if r.phase is Phase.PARAMETER]


def test_a_nan_weight_after_the_update_is_found_through_the_probe() -> None:
    w = _weights_step(math.nan)
    bad = [r for r in w.history[-1].records if r.phase is Phase.PARAMETER]
    assert [r.role for r in bad] == ["0.weight"]
    assert bad[0].stat is not None and bad[0].stat.nan == 1
    assert w.first_anomaly is not None and w.first_anomaly.record is bad[0]
