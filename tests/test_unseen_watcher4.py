"""Loops whose model runs under torch.func transforms (vmap, grad): MAML batched over tasks,
DP-SGD's per-sample gradients. The module hooks step aside there; the optimizer hooks and
the eager calls still tell what happened."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import nanwatch

torch.set_num_threads(1)


def test_maml_batched_with_vmap_is_not_called_a_compiled_model() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.Adam(net.parameters(), 1e-3)

    def loss_fn(params, x, y):  # type: ignore[no-untyped-def]
        return F.cross_entropy(functional_call(net, params, (x,)), y)

    def task(params, xs, ys, xq, yq):  # type: ignore[no-untyped-def]
        g = grad(loss_fn)(params, xs, ys)
        return loss_fn({k: params[k] - 0.1 * g[k] for k in params}, xq, yq)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(net, postmortem=False) as nw:
            for _ in range(3):
                xs, xq = torch.randn(2, 4, 10, 4)
                ys, yq = torch.randint(0, 3, (2, 4, 10))
                params = dict(net.named_parameters())
                loss = vmap(task, in_dims=(None, 0, 0, 0, 0))(params, xs, ys, xq, yq).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()
    assert not [w for w in caught if "torch.compile" in str(w.message)]
    assert not nw.anomalies


def _dp_sgd(  # type: ignore[no-untyped-def]
    opt_of,
    *,
    bad: bool,
    steps: int = 4,
    evaluate: bool = False,
    zero_col: bool = False,
    done: list[str] | None = None,
):
    """Per-sample gradients clipped to norm 1 and summed; the last row is padding (mask 0).
    ``bad``: the clip factor is written min(norm, 1) / norm, 0/0 for the padded row."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = opt_of(model.parameters())

    def loss_one(params, x, y, m):  # type: ignore[no-untyped-def]
        return F.cross_entropy(functional_call(model, params, (x[None],)), y[None]) * m

    ps_grad = vmap(grad(loss_one), in_dims=(None, 0, 0, 0))
    done = [] if done is None else done
    with nanwatch.watch(model, postmortem=False) as nw:
        for it in range(steps):
            x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
            if zero_col:
                x[:, 3] = 0.0  # a feature that is always 0: its weights get a 0 gradient
            m = torch.ones(8)
            m[-1] = 0  # padded row
            gs = ps_grad({k: v.detach() for k, v in model.named_parameters()}, x, y, m)
            norms = torch.sqrt(sum((g.flatten(1) ** 2).sum(1) for g in gs.values()))
            clipped = norms.clamp(max=1.0) / norms  # the bug: 0/0 for the padded row
            factor = clipped if bad else (1.0 / (norms + 1e-6)).clamp(max=1.0)
            for k, p in model.named_parameters():
                p.grad = (gs[k] * factor.view(-1, *[1] * (gs[k].dim() - 1))).sum(0) / 8
            opt.step()
            done.append(f"step {it}")
            opt.zero_grad()
            if evaluate:
                with torch.no_grad():
                    (model(x).argmax(1) == y).float().mean()
                nw.step()
    return nw, done


def _sgd(ps):  # type: ignore[no-untyped-def]
    return torch.optim.SGD(ps, lr=0.1)


@pytest.mark.cpu_path(
    reason="raises at the first opt.step(); the accelerator path reads a late .grad later"
)
def test_dp_sgd_under_vmap_without_step_stops_at_the_update_of_a_nan_gradient() -> None:
    done: list[str] = []
    with pytest.raises(nanwatch.AnomalyError) as info:
        _dp_sgd(_sgd, bad=True, done=done)
    assert not done  # raised by the first optimizer.step(), before anything after it ran
    tb = info.traceback
    assert any("opt.step()" in str(e.statement) for e in tb)
    (d,) = [d for d in info.value.diagnoses if d.code == "NW301"]
    assert d.title == "Non-finite weights from a gradient your code wrote after backward"
    assert "torch.isfinite(p.grad)" in (d.fix or "")
    a = info.value.anomaly
    assert a is not None and a.step == 0 and a.parameter == "0.weight"
    assert "made non-finite by the last update (optimizer step)" in a.summary


def test_dp_sgd_under_vmap_with_an_evaluation_names_the_optimizer_that_wrote_the_nan() -> None:
    with pytest.raises(nanwatch.AnomalyError) as info:
        _dp_sgd(_sgd, bad=True, evaluate=True)
    (d,) = [d for d in info.value.diagnoses if d.code == "NW301"]
    assert d.title == "Non-finite weights from a gradient your code wrote after backward"
    a = info.value.anomaly
    assert a is not None and a.step == 0
    assert "no optimizer updated it" not in a.summary


def test_an_update_earlier_in_the_step_is_named_when_an_evaluation_finds_its_nan() -> None:
    # finite per-sample gradients; Adam with eps=0 divides 0 by 0 where a weight's gradient
    # is exactly 0 (a feature that is always 0): the evaluation after opt.step() finds it
    def adam(ps):  # type: ignore[no-untyped-def]
        return torch.optim.Adam(ps, lr=1e-3, eps=0.0)

    with pytest.raises(nanwatch.AnomalyError) as info:
        _dp_sgd(adam, bad=False, evaluate=True, zero_col=True)
    a = info.value.anomaly
    assert a is not None and a.step == 0 and a.parameter == "0.weight"
    (d,) = [d for d in info.value.diagnoses if d.code == "NW301"]
    assert "eps is 0" in d.title
    assert 'g["eps"] = 1e-8' in (d.fix or "")


@pytest.mark.parametrize("evaluate", [False, True])
def test_healthy_dp_sgd_under_vmap_stays_silent(evaluate: bool) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nw, done = _dp_sgd(_sgd, bad=False, evaluate=evaluate)
    assert done == ["step 0", "step 1", "step 2", "step 3"]
    assert not nw.anomalies
    assert not [w for w in caught if "nanwatch" in str(w.message)]
