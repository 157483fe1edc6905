"""The watcher: hooks, records, steps, modes, safety. Each test asserts something a user
would notice if it broke."""

from __future__ import annotations

import gc
import math
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nanwatch
from nanwatch import AnomalyKind, Phase, WatchConfig, ops
from nanwatch.errors import AnomalyError, ConfigError, NanwatchError
from tests import zoo


def _paths(nw: nanwatch.Watcher, phase: Phase, step: int = -1) -> list[str]:
    trace = nw.history[step]
    return [r.path for r in trace.records if r.phase is phase]


def _hook_state(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    names = (
        "_forward_hooks",
        "_forward_pre_hooks",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_pre_hooks_with_kwargs",
        "_forward_hooks_always_called",
    )
    return [
        (f"{q}.{n}", tuple(getattr(m, n).keys())) for q, m in model.named_modules() for n in names
    ]


# ---------------------------------------------------------------- arguments and lifecycle
def test_watch_needs_modules() -> None:
    with pytest.raises(ConfigError, match=r"at least one nn\.Module"):
        nanwatch.watch()


def test_watch_rejects_non_modules_naming_the_value() -> None:
    with pytest.raises(ConfigError, match=r"got Tensor") as info:
        nanwatch.watch(torch.zeros(2))  # type: ignore[arg-type]
    assert info.value.name == "modules"


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("mode", "fast", "`mode` can be 'sentinel', 'watch', 'forensic'; got 'fast'"),
        ("on_anomaly", "stop", "`on_anomaly` can be 'raise', 'warn', 'record'; got 'stop'"),
        ("sample_every", 0, "`sample_every` must be an integer >= 1; got 0"),
        ("ring_size", -3, "`ring_size` must be an integer >= 1; got -3"),
    ],
)
def test_bad_options_name_the_value_and_the_choices(option: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        nanwatch.watch(nn.Linear(2, 2), **{option: value})
    assert message in str(info.value)
    assert info.value.name == option and info.value.value == value


def test_config_replace_validates_and_rejects_unknown_options() -> None:
    cfg = WatchConfig()
    assert cfg.replace(mode="sentinel").mode == "sentinel"
    with pytest.raises(ConfigError, match="unknown option `speed`"):
        cfg.replace(speed=2)


def test_context_manager_restores_every_hook_dict_exactly() -> None:
    model = zoo.Deep()
    model.encoder.layers[0].register_forward_hook(lambda m, i, o: None)  # a user's own hook
    before = _hook_state(model)
    with nanwatch.watch(model) as nw:
        assert nw.attached
        assert _hook_state(model) != before
        model(torch.randn(2, 4))
    assert not nw.attached
    assert _hook_state(model) == before


def test_attach_twice_is_an_error_and_detach_twice_is_safe() -> None:
    model = nn.Linear(2, 2)
    nw = nanwatch.watch(model).attach()
    with pytest.raises(NanwatchError, match="already attached"):
        nw.attach()
    nw.detach()
    nw.detach()
    assert not model._forward_hooks


def test_attach_detach_many_times_leaves_nothing() -> None:
    model = zoo.InplaceNet()
    before = _hook_state(model)
    nw = nanwatch.watch(model)
    for _ in range(20):
        nw.attach()
        model(torch.randn(3, 4)).sum().backward()
        nw.step()
        nw.detach()
    assert _hook_state(model) == before
    assert len(nw.history) == 20


# ---------------------------------------------------------------- names and records
def test_every_submodule_is_named_by_its_qualified_name() -> None:
    model = zoo.Deep()
    with nanwatch.watch(model) as nw:
        model(torch.randn(2, 4))
        nw.step()
    paths = _paths(nw, Phase.FORWARD)
    assert "encoder.layers.2.0" in paths
    assert paths[-1] == "Deep"  # the root is named by its class
    assert nw.module_paths[0] == "Deep"


def test_a_module_called_twice_gets_one_record_per_call_in_order() -> None:
    model = zoo.SharedTwice()
    with nanwatch.watch(model) as nw:
        model(torch.randn(2, 4))
        nw.step()
    trace = nw.history[-1]
    fc = [r for r in trace.records if r.path == "fc" and r.phase is Phase.FORWARD]
    assert len(fc) == 2
    assert fc[0].index < fc[1].index
    assert fc[0].call != fc[1].call
    # the second call's input is functional code (sin) between the calls, measured
    second_input = [r for r in trace.records if r.call == fc[1].call and r.phase is Phase.INPUT]
    assert second_input[0].stat is not None


def test_a_module_that_calls_itself_is_one_step() -> None:
    model = zoo.Recursive()
    with torch.no_grad(), nanwatch.watch(model) as nw:
        model(torch.randn(2, 4))
        model(torch.randn(2, 4))
    # under no_grad each outer call is a step; the recursive calls are not
    assert len(nw.history) == 2
    roots = [c for c in nw.history[0].calls if c.path == "Recursive"]
    assert len(roots) == 3


def test_outputs_of_every_structure_are_traversed() -> None:
    model = zoo.Structured()
    with nanwatch.watch(model) as nw:
        model(torch.randn(2, 4))
        nw.step()
    roles = {r.role: r for r in nw.history[-1].records if r.path == "Structured"}
    assert "output['tuple'][0]" in roles
    assert "output['data'].logits" in roles
    assert "output['data'].hidden" in roles
    assert "output['pair'].logits" in roles
    assert "output['model_output'].loss" in roles
    aux = roles["output['pair'].aux"]  # integers: metadata only
    assert aux.dtype == "int64" and aux.shape == (3,) and aux.stat is None
    assert roles["output['pair'].logits"].stat is not None


def test_packed_sequences_and_lstm_tuples() -> None:
    model = zoo.LSTMTagger()
    with nanwatch.watch(model) as nw:
        out = model(torch.randn(3, 5, 4), torch.tensor([5, 2, 4]))
        out.sum().backward()
        nw.step()
    roles = [r.role for r in nw.history[-1].records if r.path == "lstm"]
    assert "output[0].data" in roles and "output[0].batch_sizes" in roles
    assert nw.first_anomaly is None


def test_records_hold_dtype_device_shape_and_minmax() -> None:
    model = nn.Sequential(nn.Linear(3, 5))
    x = torch.randn(4, 3)
    with nanwatch.watch(model) as nw:
        y = model(x)
        nw.step()
    rec = next(r for r in nw.history[-1].records if r.path == "0" and r.phase is Phase.FORWARD)
    assert (rec.dtype, rec.device, rec.shape) == ("float32", "cpu", (4, 5))
    assert rec.stat is not None
    assert rec.stat.min == pytest.approx(float(y.detach().min()))
    assert rec.stat.max == pytest.approx(float(y.detach().max()))
    assert rec.grad_fn == "AddmmBackward0"


def test_gradients_of_outputs_and_parameters_are_recorded() -> None:
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))
    with nanwatch.watch(model) as nw:
        model(torch.randn(4, 3)).sum().backward()
        nw.step()
    trace = nw.history[-1]
    assert "0" in _paths(nw, Phase.BACKWARD)
    grads = {r.role: r for r in trace.records if r.phase is Phase.GRADIENT}
    assert set(grads) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    expected = math.sqrt(sum(float(p.grad.norm()) ** 2 for p in model.parameters()))
    assert trace.grad_norm == pytest.approx(expected, rel=1e-5)
    assert grads["2.weight"].stat is not None
    assert grads["2.weight"].stat.norm == pytest.approx(float(model[2].weight.grad.norm()))


def test_passthrough_modules_are_not_measured_but_linked() -> None:
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 1))
    with nanwatch.watch(model) as nw:
        model(torch.randn(4, 3)).sum().backward()
        nw.step()
    trace = nw.history[-1]
    relu = next(r for r in trace.records if r.path == "1" and r.phase is Phase.FORWARD)
    assert relu.stat is None
    assert trace.resolve(relu).path == "0"  # bounded by the record of its input
    assert "1" not in _paths(nw, Phase.BACKWARD)  # no gradient hook on a passthrough


def test_loss_and_max_logit_feed_the_timeline() -> None:
    model, criterion = nn.Linear(3, 2), nn.MSELoss()
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    with nanwatch.watch(model, criterion) as nw:
        out = model(x)
        loss = criterion(out, y)
        loss.backward()
        nw.step()
    trace = nw.history[-1]
    assert trace.loss == pytest.approx(float(loss))
    assert trace.max_logit == pytest.approx(float(out.abs().max()))


def test_functional_loss_can_be_given_to_step() -> None:
    model = nn.Linear(3, 1)
    with nanwatch.watch(model) as nw:
        loss = model(torch.randn(4, 3)).pow(2).mean()
        loss.backward()
        nw.step(loss=loss)
    assert nw.history[-1].loss == pytest.approx(float(loss))


# ---------------------------------------------------------------- steps
def test_without_step_a_call_after_backward_begins_a_step() -> None:
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model) as nw:
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert [t.step for t in nw.history] == [0, 1, 2]


@pytest.mark.parametrize("explicit", [False, True])
def test_the_micro_batches_of_gradient_accumulation_are_one_step(explicit: bool) -> None:
    """Four micro-batches a step, each forward after a backward: with no update or
    gradient reset between them they are one step, from the first step on (before, each
    micro-batch of the first step, or of every step without nw.step(), was a step, and a
    NaN in step 2 was reported in step 5)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for step in range(4):
            for micro in range(4):
                x = torch.randn(8, 8)
                if (step, micro) == (2, 2):
                    x[5, 3] = math.nan
                model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if explicit:
                nw.step()
    assert [t.step for t in nw.history] == [0, 1, 2, 3]
    assert sum(1 for c in nw.history[0].calls if c.path == "Sequential") == 4
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.INPUT and a.step == 2


def test_a_frozen_model_steps_at_each_backward_when_its_input_is_optimized() -> None:
    """An adversarial input or a style-transfer image updated by hand through a frozen
    model: no weight gets a gradient, nothing accumulates, each forward after a backward is
    a step."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).requires_grad_(False)
    x = torch.randn(2, 3, requires_grad=True)
    with nanwatch.watch(model) as nw:
        for _ in range(3):
            model(x).sum().backward()
            with torch.no_grad():
                x += 0.1 * x.grad.sign()  # type: ignore[union-attr]
    assert [t.step for t in nw.history] == [0, 1, 2]


def test_an_update_only_the_optimizer_hook_sees_begins_a_step() -> None:
    """A fused optimizer bumps no weight version; without zero_grad, its step still ends
    the step (the global optimizer hook), so the gradients it left are not accumulation."""
    model = nn.Linear(3, 1)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
    except (RuntimeError, TypeError):
        pytest.skip("this torch has no fused AdamW on the CPU")
    w = model.weight._version
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    assert model.weight._version == w  # the update is invisible to version counters
    with nanwatch.watch(model) as nw:
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
            opt.step()  # the gradients stay: only the optimizer hook tells
    assert [t.step for t in nw.history] == [0, 1, 2]


def test_a_gradient_penalty_by_autograd_grad_does_not_end_the_step() -> None:
    """WGAN-GP: torch.autograd.grad(D(x_hat), x_hat, create_graph=True) puts nothing into
    .grad; the forwards after it belong to the same step (the first one was split)."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt = torch.optim.Adam(critic.parameters(), 1e-3)
    with nanwatch.watch(critic) as nw:
        for _ in range(3):
            x_hat = torch.randn(16, 2).requires_grad_(True)
            (g,) = torch.autograd.grad(critic(x_hat).sum(), x_hat, create_graph=True)
            penalty = ((g.norm(2, dim=1) - 1) ** 2).mean()
            loss = critic(torch.randn(16, 2)).mean() + 10 * penalty
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [t.step for t in nw.history] == [0, 1, 2]
    assert all(sum(c.root for c in t.calls) >= 2 for t in nw.history)


@pytest.mark.parametrize("update", ["optimizer", "by hand"])
def test_training_by_autograd_grad_alone_still_steps(update: str) -> None:
    """No backward(): gradients from torch.autograd.grad, then an update; each forward
    after the update begins a step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), 0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with nanwatch.watch(model) as nw:
        for _ in range(3):
            grads = torch.autograd.grad(((model(x) - y) ** 2).mean(), list(model.parameters()))
            if update == "optimizer":
                for p, g in zip(model.parameters(), grads, strict=True):
                    p.grad = g
                opt.step()
            else:
                with torch.no_grad():
                    for p, g in zip(model.parameters(), grads, strict=True):
                        p.sub_(0.1 * g)
    assert [t.step for t in nw.history] == [0, 1, 2]


def test_two_forwards_before_one_backward_are_one_step() -> None:
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model) as nw:
        for _ in range(2):
            a = model(torch.randn(2, 3))
            b = model(torch.randn(2, 3))
            (a - b).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    assert len(nw.history) == 2
    assert sum(1 for c in nw.history[0].calls if c.path == "Linear") == 2
    assert [c.path for c in nw.history[0].calls if c.root][-1] == "(loss)"  # the functional loss


def test_under_no_grad_each_call_is_a_step() -> None:
    model = nn.Linear(3, 1)
    with torch.no_grad(), nanwatch.watch(model) as nw:
        for _ in range(4):
            model(torch.randn(2, 3))
    assert len(nw.history) == 4


def test_explicit_steps_turn_off_the_automatic_rule() -> None:
    model = nn.Linear(3, 1)
    with nanwatch.watch(model) as nw:
        nw.step()  # from the first call of step() on, steps are the user's
        for _ in range(2):
            for _ in range(3):  # gradient accumulation: three backwards per step
                model(torch.randn(2, 3)).sum().backward()
            nw.step()
    assert [t.step for t in nw.history] == [0, 1, 2]
    assert [sum(1 for c in t.calls if c.path == "Linear") for t in nw.history] == [0, 3, 3]


def test_ring_buffer_is_bounded() -> None:
    model = nn.Linear(3, 1)
    with nanwatch.watch(model, ring_size=5) as nw:
        for _ in range(12):
            model(torch.randn(2, 3)).sum().backward()
            nw.step()
    assert [t.step for t in nw.history] == [7, 8, 9, 10, 11]


# ---------------------------------------------------------------- modes
def test_sentinel_watches_roots_gradients_and_weights_only() -> None:
    model = zoo.Deep()
    with nanwatch.watch(model, mode="sentinel") as nw:
        model(torch.randn(2, 4)).sum().backward()
        nw.step()
    trace = nw.history[-1]
    watched = {r.path for r in trace.records if r.phase in (Phase.FORWARD, Phase.INPUT)}
    assert watched == {"Deep", "(loss)"}  # the model's batch and output, and the loss
    assert any(r.phase is Phase.GRADIENT for r in trace.records)
    assert not model.encoder.layers[0][0]._forward_hooks  # no hooks on submodules at all


def test_sentinel_still_finds_a_nan_loss_and_blames_the_weights() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    with torch.no_grad():
        model[1].weight[0, 2] = float("inf")
    with nanwatch.watch(model, mode="sentinel", on_anomaly="record") as nw:
        model(torch.randn(2, 3)).sum().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.PARAMETER
    assert a.parameter == "1.weight"


def test_sample_every_watches_every_nth_step_and_sentinel_between() -> None:
    model = zoo.Deep()
    with nanwatch.watch(model, sample_every=3) as nw:
        for _ in range(7):
            model(torch.randn(2, 4)).sum().backward()
            nw.step()
    full = [t.full for t in nw.history]
    assert full == [True, False, False, True, False, False, True]
    assert "encoder.layers.0.0" in _paths(nw, Phase.FORWARD, 3)
    assert "encoder.layers.0.0" not in _paths(nw, Phase.FORWARD, 4)
    assert all(any(r.phase is Phase.GRADIENT for r in t.records) for t in nw.history)


def test_forensic_mode_names_the_backward_op_and_its_module() -> None:
    from nanwatch import scenarios

    outcome = scenarios.run(scenarios.get("sqrt-backward"), mode="forensic")
    a = outcome.anomaly
    assert a is not None and a.kind is AnomalyKind.BACKWARD and a.path == "distance"
    assert a.op is not None
    assert a.op.node == "SqrtBackward0"
    assert a.op.path == "distance"
    src = scenarios.get("sqrt-backward").module.replace(".", "/") + ".py"
    path = nanwatch.__file__.replace("nanwatch/__init__.py", src)
    with open(path) as f:
        lines = f.read().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if "torch.sqrt(" in text)
    assert a.op.source is not None and a.op.source.endswith(f"sqrt_backward.py:{line}")
    assert not torch.is_anomaly_enabled()  # forensic's anomaly mode was put back


# ---------------------------------------------------------------- on_anomaly
class _Div(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (x - x)


def _nan_model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 3), _Div(), nn.Linear(3, 1))


@pytest.mark.cpu_path(
    reason="a raise inside the forward; the accelerator path raises once the value is read"
)
def test_raise_happens_where_the_anomaly_is_known() -> None:
    model = _nan_model()
    with pytest.raises(AnomalyError) as info, nanwatch.watch(model, postmortem=False):
        model(torch.randn(2, 3))  # raises here, in forward, on CPU
        pytest.fail("the forward should have raised")
    err = info.value
    assert err.module == "1"
    assert err.anomaly is not None and err.anomaly.op is not None
    assert err.anomaly.op.op.startswith("aten.div")
    assert "+inf, -inf born in the forward of 1 (_Div)" in str(err)
    assert not model[1]._forward_hooks


def test_warn_warns_once_at_the_users_line() -> None:
    model = _nan_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(model, on_anomaly="warn") as nw:
            for _ in range(3):
                model(torch.randn(2, 3)).sum().backward()
                nw.step()
    ours = [w for w in caught if "nanwatch: step" in str(w.message)]
    assert len(ours) == 1
    assert ours[0].filename == __file__


def test_record_is_silent_and_keeps_the_first_anomaly() -> None:
    model = _nan_model()
    with nanwatch.watch(model, on_anomaly="record") as nw:
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
            nw.step()
    assert nw.first_anomaly is not None and nw.first_anomaly.step == 0
    assert len(nw.anomalies) == 3


def test_allow_patterns_make_intended_non_finite_values_quiet() -> None:
    class Sentinel(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, torch.full_like(x[:, :1], float("inf"))], dim=1)

    model = nn.Sequential(nn.Linear(2, 2), Sentinel())
    with torch.no_grad(), nanwatch.watch(model, allow=["1"], on_anomaly="record") as nw:
        model(torch.randn(2, 2))
    assert nw.first_anomaly is None
    with torch.no_grad(), nanwatch.watch(model, on_anomaly="record") as nw2:
        model(torch.randn(2, 2))
    assert nw2.first_anomaly is not None and nw2.first_anomaly.path == "1"


def test_nan_in_the_batch_is_bad_data_with_the_sample_index() -> None:
    model = nn.Sequential(nn.Linear(3, 3))
    x = torch.randn(6, 3)
    x[4, 1] = float("nan")
    with nanwatch.watch(model, on_anomaly="record") as nw:
        model(x)
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.INPUT and a.origin == "data"
    assert a.record.stat is not None and a.record.stat.bad_rows == (4,)
    assert "sample 4" in a.summary


# ---------------------------------------------------------------- safety
def test_inplace_relu_works_forward_and_backward_with_identical_results() -> None:
    torch.manual_seed(1)
    model = zoo.InplaceNet()
    x = torch.randn(5, 4)
    model(x).sum().backward()
    ref_out = model(x).detach().clone()
    ref_grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    with nanwatch.watch(model) as nw:
        out = model(x)
        out.sum().backward()
        nw.step()
    assert torch.equal(out.detach(), ref_out)
    for p, g in zip(model.parameters(), ref_grads, strict=True):
        assert torch.equal(p.grad, g * 2) or torch.equal(p.grad, g)  # type: ignore[arg-type]
    assert nw.first_anomaly is None


def test_outputs_are_bit_identical_to_an_unwatched_run() -> None:
    torch.manual_seed(3)
    model = zoo.Deep()
    x = torch.randn(4, 4)
    expected = model(x)
    for mode in ("sentinel", "watch", "forensic"):
        with nanwatch.watch(model, mode=mode) as nw:
            got = model(x)
            nw.step()
        assert torch.equal(got, expected), mode


def test_no_activation_outlives_its_hook() -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8))
    refs: list[weakref.ReferenceType[torch.Tensor]] = []
    model[1].register_forward_hook(lambda m, i, o: refs.append(weakref.ref(o)))
    with nanwatch.watch(model) as nw:
        for _ in range(3):
            model(torch.randn(32, 64)).sum().backward()
            nw.step()
        gc.collect()
        assert refs and all(r() is None for r in refs)


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "eval"])
def test_works_without_autograd(context: str) -> None:
    model = zoo.InplaceNet()
    if context == "eval":
        model.eval()
    ctx = {
        "no_grad": torch.no_grad,
        "inference_mode": torch.inference_mode,
        "eval": torch.enable_grad,
    }[context]()
    with ctx, nanwatch.watch(model) as nw:
        model(torch.randn(3, 4))
        model(torch.randn(3, 4))
        nw.step()
    assert nw.first_anomaly is None
    assert any(r.path == "fc1" and r.stat is not None for r in nw.history[-1].records)


def test_script_modules_are_skipped_with_one_warning() -> None:
    scripted = torch.jit.script(nn.Linear(3, 3))
    model = nn.Sequential(nn.Linear(3, 3), scripted)
    with pytest.warns(RuntimeWarning, match="ScriptModule") as record:
        nw = nanwatch.watch(model).attach()
    try:
        model(torch.randn(2, 3))
        assert "1" not in nw.module_paths and "0" in nw.module_paths
    finally:
        nw.detach()
    assert len([w for w in record if "ScriptModule" in str(w.message)]) == 1


def test_compiled_models_are_refused_with_the_way_out() -> None:
    model = nn.Linear(3, 3)
    compiled = torch.compile(model)
    # the way out in the user's own name for the compiled model
    with pytest.raises(ConfigError, match=r"(?s)torch.compile.*compiled = compiled._orig_mod"):
        nanwatch.watch(compiled)


def test_an_internal_error_in_a_hook_warns_once_and_training_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))

    def broken(*args: Any, **kwargs: Any) -> None:
        raise KeyError("boom")

    monkeypatch.setattr(nanwatch.Watcher, "_record_outputs", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(model) as nw:
            for _ in range(3):
                model(torch.randn(2, 3)).sum().backward()
                nw.step()
    ours = [w for w in caught if "internal error" in str(w.message)]
    assert len(ours) == 1
    assert "forward hook" in str(ours[0].message)
    assert nw.faults == [("forward hook", "KeyError: 'boom'")]
    assert all(p.grad is not None for p in model.parameters())


def test_the_users_exception_comes_out_unchanged_and_hooks_are_removed() -> None:
    model = zoo.Deep()
    err = ValueError("user code broke")
    with pytest.raises(ValueError) as info, nanwatch.watch(model, postmortem=False):
        model(torch.randn(2, 4))
        raise err
    assert info.value is err
    assert not model.encoder.layers[0][0]._forward_hooks


def test_keyboard_interrupt_inside_forward_leaves_nothing_behind() -> None:
    class Interrupt(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise KeyboardInterrupt

    model = nn.Sequential(nn.Linear(2, 2), Interrupt())
    with pytest.raises(KeyboardInterrupt), nanwatch.watch(model, postmortem=False):
        model(torch.randn(1, 2))
    assert not model[0]._forward_hooks


def test_nested_watchers_on_the_same_model_both_record() -> None:
    model = zoo.Deep()
    with nanwatch.watch(model) as outer:
        with nanwatch.watch(model) as inner:
            model(torch.randn(2, 4)).sum().backward()
            inner.step()
            outer.step()
        model(torch.randn(2, 4)).sum().backward()
        outer.step()
    assert len(inner.history) == 1 and len(outer.history) == 2
    assert _paths(inner, Phase.FORWARD, 0) == _paths(outer, Phase.FORWARD, 0)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_forward_is_not_double_counted(reentrant: bool) -> None:
    model = zoo.Checkpointed(reentrant=reentrant)
    with nanwatch.watch(model) as nw:
        model(torch.randn(3, 4)).sum().backward()
        nw.step()
    trace = nw.history[-1]
    block0 = [r for r in trace.records if r.path == "block.0" and r.phase is Phase.FORWARD]
    assert len(block0) == 1
    assert trace.recomputed >= 1
    # the gradients inside the block are seen once each, in either flavour
    grads = [r.path for r in trace.records if r.phase is Phase.BACKWARD]
    assert grads.count("block.0") == 1 and grads.count("block.2") == 1


class _SqrtOfZero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x * 0)  # finite forward, inf gradient


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_backward_nan_inside_a_checkpointed_block_is_found_there(reentrant: bool) -> None:
    block = nn.Sequential(nn.Linear(4, 4), _SqrtOfZero())
    model = zoo.Checkpointed(reentrant=reentrant, block=block)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(torch.randn(3, 4)).sum().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and (a.kind, a.path) == (AnomalyKind.BACKWARD, "block.1")
    assert nw.history[-1].diagnoses[0].code == "NW112"


class _PairDistance(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(((h - h.flip(0)) ** 2).sum(-1, keepdim=True))  # 0 at the middle row


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("explicit", [False, True], ids=["auto-steps", "nw.step"])
def test_a_model_checkpointed_whole_keeps_its_step_numbers(reentrant: bool, explicit: bool) -> None:
    """``checkpoint(model, x)``: the recompute in backward calls the first root again; it is
    not the next step's first call, so the sqrt(0) of step 2 is NW112 at step 2 (it was
    step 3, or no anomaly until NW301 blamed the update for the NaN weights)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), _PairDistance())
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for i in range(4):
            x = torch.randn(15 if i == 2 else 16, 8, requires_grad=True)  # odd: a row meets itself
            out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=reentrant)
            out.mean().backward()
            opt.step()
            opt.zero_grad()
            if explicit:
                nw.step()
    a = nw.first_anomaly
    assert a is not None and a.step == 2 and (a.kind, a.path) == (AnomalyKind.BACKWARD, "3")
    assert nw.history[2].diagnoses[0].code == "NW112"
    assert [t.step for t in nw.history] == [0, 1, 2, 3]


class _StdNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)


def test_checkpoint_sequential_reentrant_segments_are_one_step() -> None:
    """A reentrant ``checkpoint_sequential`` calls each module of a segment from outside
    under ``no_grad``: these calls are the training step's, not evaluation calls that are
    a step each."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), _StdNorm(), nn.Linear(16, 1)
    )
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for i in range(3):
            if i == 2:
                with torch.no_grad():
                    model[2].weight.zero_()  # constant rows: std 0
                    model[2].bias.fill_(0.5)
            x = torch.randn(16, 8, requires_grad=True)
            out = torch.utils.checkpoint.checkpoint_sequential(model, 2, x, use_reentrant=True)
            out.pow(2).mean().backward()
            model.zero_grad()
    a = nw.first_anomaly
    assert a is not None and a.step == 2 and a.path == "3"
    assert nw.history[2].diagnoses[0].code == "NW111"


class _Meet(nn.Module):
    """Waits for the other thread's model to be in its forward too."""

    def __init__(self, barrier: Any) -> None:
        super().__init__()
        self.barrier = barrier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # not in nanwatch's replay of the root (read late, the bad module's inputs are gone):
        # the other thread is not there to meet it, and the barrier would break by timeout
        if self.barrier is not None and not ops.replaying():
            self.barrier.wait()
        return x * 1.0


class _ModelA(nn.Sequential):
    pass


class _ModelB(nn.Sequential):
    pass


def _thread_models(barrier: Any) -> list[nn.Sequential]:
    from collections import OrderedDict

    torch.manual_seed(5)
    a = _ModelA(
        OrderedDict(
            a_fc=nn.Linear(3, 3), a_div=_Div(), a_meet=_Meet(barrier), a_head=nn.Linear(3, 1)
        )
    )
    b = _ModelB(
        OrderedDict(
            b_fc=nn.Linear(4, 4), b_act=nn.GELU(), b_meet=_Meet(barrier), b_head=nn.Linear(4, 2)
        )
    )
    return [a, b]


@pytest.mark.landed_only(
    reason=(
        "read after the call, the bad module's inputs are gone and its root is replayed: the "
        "replay meets the test's thread barrier inside the forward again"
    )
)
def test_two_threads_with_their_own_watchers() -> None:
    """Two threads train their own model under their own watcher, in lock step: both are
    inside a forward at once (a barrier in the middle of each), then both in backward, then
    both at the step boundary. Each watcher records exactly what it records when its model
    runs alone -- no record of the other model, its own anomaly only."""
    import threading

    steps = 20
    xs = [[torch.randn(2, 3) for _ in range(steps)], [torch.randn(5, 4) for _ in range(steps)]]

    def signature(nw: nanwatch.Watcher) -> list[list[tuple[Any, ...]]]:
        return [
            [(r.phase, r.path, r.role, r.shape, r.stat is None or r.stat.finite) for r in t.records]
            for t in nw.history
        ]

    def train(i: int, model: nn.Module, barrier: threading.Barrier | None) -> nanwatch.Watcher:
        def meet() -> None:
            if barrier is not None:
                barrier.wait()

        with nanwatch.watch(model, on_anomaly="record", ring_size=steps) as nw:
            for x in xs[i]:
                meet()
                out = model(x)  # meets the other thread once more inside
                meet()
                out.sum().backward()
                meet()
                nw.step()
        return nw

    solo = [train(i, m, None) for i, m in enumerate(_thread_models(None))]
    barrier = threading.Barrier(2, timeout=30)
    results: dict[int, nanwatch.Watcher] = {}
    errors: list[BaseException] = []

    def run(i: int, model: nn.Module) -> None:
        try:
            results[i] = train(i, model, barrier)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [
        threading.Thread(target=run, args=(i, m)) for i, m in enumerate(_thread_models(barrier))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    own = {0: ("_ModelA", "a_"), 1: ("_ModelB", "b_")}
    for i, nw in results.items():
        paths = {r.path for t in nw.history for r in t.records}
        assert all(p.startswith(own[i]) or p == "(loss)" for p in paths), (i, paths)
        assert len(nw.history) == steps and not nw.faults
        assert signature(nw) == signature(solo[i]), i  # the same records as alone
    a, b = results[0].first_anomaly, results[1].first_anomaly
    assert a is not None and a.path == "a_div" and a.step == 0
    assert b is None
    said = [d.path for t in results[0].history for d in t.diagnoses]
    assert "a_div" in said and all(p is None or not p.startswith("b_") for p in said), said
    assert not [d.code for t in results[1].history for d in t.diagnoses]


def test_accelerator_path_gives_the_same_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Statistics kept on the device until the flush (the CUDA path), driven on CPU."""
    model = _nan_model()
    nw = nanwatch.watch(model, on_anomaly="record")
    nw._defer_cpu = True
    with nw:
        model(torch.randn(2, 3)).sum().backward()
        # what backward made is on its way to the host, not read
        assert nw._prefetched and all(
            r.stat is None for r in nw.trace.records if r.phase is Phase.BACKWARD
        )
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.path == "1" and a.kind is AnomalyKind.FORWARD
    # no update ran: the weights are the step's, and a replay of the root names the op
    assert a.op is not None and a.op.op.startswith("aten.")
    fwd = [r for r in nw.history[-1].records if r.path == "0" and r.phase is Phase.FORWARD]
    assert fwd[0].stat is not None and math.isfinite(fwd[0].stat.max)


@pytest.mark.parametrize("deferred", [False, True], ids=["cpu", "accelerator-path"])
def test_bad_samples_of_the_batch_are_named_on_every_path(deferred: bool) -> None:
    model, criterion = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)), nn.MSELoss()
    nw = nanwatch.watch(model, criterion, on_anomaly="record", postmortem=False)
    nw._defer_cpu = deferred
    x = torch.randn(8, 4)
    x[5, 2] = math.nan
    x[6, 0] = math.inf
    with nw:
        criterion(model(x), torch.randn(8, 1)).backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.INPUT
    assert a.record.stat is not None and a.record.stat.bad_rows == (5, 6)
    assert a.record.stat.bad_row_count == 2
    top = nw.history[-1].diagnoses[0]
    assert top.code == "NW401" and "samples 5, 6 (2 of 8)" in top.evidence[0]


def test_replay_names_the_op_of_a_flush_time_anomaly() -> None:
    model = _nan_model()
    x = torch.randn(2, 3)
    nw = nanwatch.watch(model, on_anomaly="record")
    nw._defer_cpu = True
    with nw:
        model(x).sum().backward()
        nw.step()
        before = [p.detach().clone() for p in model.parameters()]
        grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        result = nw.replay(lambda: model(x).sum().backward())
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.op.startswith("aten.div")
    assert result.first() is not None
    for p, b, g in zip(model.parameters(), before, grads, strict=True):
        assert torch.equal(p.detach(), b)
        torch.testing.assert_close(p.grad, g, equal_nan=True, rtol=0, atol=0)


def test_record_of_finds_the_record_of_a_tensor() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Sigmoid())
    with nanwatch.watch(model) as nw:
        out = model(torch.randn(2, 3))
        rec = nw.record_of(out)
        assert rec is not None and rec.grad_fn == "SigmoidBackward0"
        assert nw.record_of(torch.zeros(1)) is None


# ---------------------------------------------------------------- global hooks and check()
def test_watch_all_discovers_modules_as_they_are_called() -> None:
    with nanwatch.watch_all(on_anomaly="record") as nw:
        model, criterion = zoo.Deep(), nn.MSELoss()  # created after attach
        for _ in range(2):
            criterion(model(torch.randn(2, 4)), torch.randn(2, 4)).backward()
            model.zero_grad()
        late = nn.Sequential(nn.Identity(), _Div())
        late(torch.tensor([[1.0, 2.0]]))  # 1 / 0: +inf
    assert nw.module_paths[:3] == ["Deep", "encoder", "encoder.layers"]
    assert "MSELoss" in nw.module_paths
    assert len(nw.history) == 2 and nw.history[0].loss is not None
    a = nw.first_anomaly
    assert a is not None and a.path == "1" and a.op is not None
    assert a is not None and a.path == "1" and a.op is not None
    assert any(
        p.data_ptr() == model.encoder.layers[0][0].weight.data_ptr() for _, _, p in nw._params
    )


class _KeywordRoot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, *, inputs_embeds: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(inputs_embeds)))


def test_watch_all_reads_a_roots_keyword_inputs_as_data() -> None:
    """Global pre-hooks get no keyword arguments; a model called ``model(inputs_embeds=x)``
    under ``nanwatch run`` still has its batch recorded, so a NaN in it is bad data
    (NW401), not a NaN born in the model's own code."""
    with nanwatch.watch_all(on_anomaly="record", postmortem=False) as nw:
        model = _KeywordRoot()
        x = torch.randn(3, 4)
        x[1, 2] = float("nan")
        model(inputs_embeds=x).sum().backward()
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.INPUT and a.path == "_KeywordRoot"
    assert "input.inputs_embeds" in a.summary
    assert [d.code for d in nw.history[-1].diagnoses][:1] == ["NW401"]


def test_watch_all_raises_the_guard_error_of_a_loss_found_at_its_first_call() -> None:
    """A loss first called under global hooks is guarded during its discovery: its
    GuardError is the user's answer, not an internal error that turns discovery off."""
    raised = pytest.raises(nanwatch.GuardError, match="did you mean ignore_index=255")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "internal error" warning
        with raised, nanwatch.watch_all(on_anomaly="record", postmortem=False) as nw:
            nn.CrossEntropyLoss()(torch.randn(2, 3), torch.tensor([0, 255]))
    assert nw.faults == []
    assert nw.history[-1].diagnoses[0].code == "NW501"


def test_watch_all_removes_its_global_hooks() -> None:
    import torch.nn.modules.module as mm

    before = (dict(mm._global_forward_hooks), dict(mm._global_forward_pre_hooks))
    with nanwatch.watch_all():
        assert mm._global_forward_hooks and mm._global_forward_pre_hooks
        nn.Linear(2, 2)(torch.ones(1, 2))
    assert (dict(mm._global_forward_hooks), dict(mm._global_forward_pre_hooks)) == before


def test_watch_all_rejects_mixing_config_and_options() -> None:
    with pytest.raises(ConfigError, match="either config= or keyword options"):
        nanwatch.watch_all(config=WatchConfig(), mode="watch")
    with pytest.raises(ConfigError, match="known options"):
        nanwatch.watch_all(speed=3)


def test_check_localizes_mid_step_without_ending_it_or_acting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from nanwatch.stats import HostRead

    model = _nan_model()
    nw = nanwatch.watch(model, on_anomaly="raise", postmortem=False)
    nw._defer_cpu = True  # the accelerator path: nothing known until a transfer
    # a GPU behind the host: the forward's statistics have not landed when backward begins
    monkeypatch.setattr(HostRead, "ready", lambda self: False)
    with nw:
        model(torch.randn(2, 3)).sum().backward()
        a = nw.check()
        assert a is not None and a.path == "1"
        assert nw.step_index == 0 and not nw.history  # the step goes on
        for p in model.parameters():
            p.grad = None  # what the Lightning callback's "skip" does
        with pytest.raises(AnomalyError):
            nw.step()  # the step's end still applies on_anomaly


# ---------------------------------------------------------------- losses outside modules
def test_a_functional_loss_is_recorded_when_backward_is_called() -> None:
    model = nn.Linear(3, 1)
    with nanwatch.watch(model) as nw:
        loss = torch.nn.functional.mse_loss(model(torch.randn(4, 3)), torch.randn(4, 1))
        loss.backward()
        nw.step()
    trace = nw.history[-1]
    rec = next(r for r in trace.records if r.path == "(loss)")
    assert rec.grad_fn == "MseLossBackward0"
    assert trace.loss == pytest.approx(float(loss.detach()))


def test_a_nan_born_in_a_hand_written_loss_is_found_in_forward_with_its_op() -> None:
    model = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
    with torch.no_grad():
        model[0].weight.fill_(100.0)  # saturated: probabilities of exactly 0 and 1
    x = torch.cat([torch.ones(2, 4), -torch.ones(2, 4)])
    y = torch.tensor([[0.0], [1.0], [0.0], [1.0]])
    with nanwatch.watch(model, on_anomaly="record") as nw:
        p = model(x)
        loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
        loss.backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None
    assert (a.kind, a.path, a.origin) == (AnomalyKind.FORWARD, "(loss)", "loss-code")
    assert a.op is not None and a.op.op == "aten.log" and a.op.node == "LogBackward0"
    assert "input holds 2 zeros" in str(a.op.scalars["evidence"])
    assert "loss.backward() at " in a.summary and "test_watcher.py:" in a.summary
    notes = [n for n in nw.history[-1].notes if n.kind == "loss_graph"]
    assert notes and "log" in notes[0].data["ops"]


def test_the_backward_tap_is_removed_with_the_last_watcher() -> None:
    original = torch.autograd.backward
    a = nanwatch.watch(nn.Linear(1, 1)).attach()
    b = nanwatch.watch(nn.Linear(1, 1)).attach()
    assert torch.autograd.backward is not original
    a.detach()
    assert torch.autograd.backward is not original
    b.detach()
    assert torch.autograd.backward is original


def test_a_gradient_arriving_from_outside_the_modules_blames_the_loss_code() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    nw = nanwatch.watch(model, on_anomaly="record")
    with nw:
        out = model(torch.randn(2, 3))
        # a gradient injected from code nanwatch cannot see (not a scalar loss: no tap)
        out.backward(torch.full_like(out, float("nan")))
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.BACKWARD
    assert (a.origin, a.path) == ("after-output", "Sequential")
    assert "from code outside the watched modules" in a.summary


# ---------------------------------------------------------------- state and exits
def test_state_dict_round_trip_continues_the_step_numbering() -> None:
    model = _nan_model()
    with nanwatch.watch(model, on_anomaly="record") as nw:
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
            nw.step()
    state = nw.state_dict()
    assert state["step"] == 3 and state["anomaly_count"] == 3
    assert all(s["records"] == [] for s in state["steps"])  # summaries, not tensors' records
    fresh = nanwatch.watch(model, on_anomaly="record", postmortem=False)
    fresh.load_state_dict(state)
    assert fresh.first_anomaly is not None and fresh.first_anomaly.path == "1"
    with fresh:
        model(torch.randn(2, 3)).sum().backward()
        fresh.step()
    assert [t.step for t in fresh.history] == [0, 1, 2, 3]
    with pytest.raises(NanwatchError, match="before attach"), fresh:
        fresh.load_state_dict(state)
    with pytest.raises(NanwatchError, match="version 7"):
        fresh.load_state_dict({**state, "version": 7})


def test_close_with_an_exception_writes_the_post_mortem_and_detaches(tmp_path: Any) -> None:
    model = _nan_model()
    nw = nanwatch.watch(model, on_anomaly="record", report_dir=str(tmp_path)).attach()
    model(torch.randn(2, 3))
    path = nw.close(RuntimeError("the trainer crashed"))
    assert not nw.attached and not model[1]._forward_hooks
    assert path is not None and str(path).endswith(".json")
    assert nw.history[-1].error is not None and nw.history[-1].error["class"] == "other"


def test_gradient_norm_is_unscaled_under_a_grad_scaler() -> None:
    model = nn.Linear(3, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    with nanwatch.watch(model, scaler=scaler) as nw:
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        scaled = math.sqrt(sum(float(p.grad.norm()) ** 2 for p in model.parameters()))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        nw.step()
    trace = nw.history[-1]
    assert trace.scale == 1024.0
    assert trace.grad_norm == pytest.approx(scaled / 1024.0, rel=1e-5)


def _amp_step(model: nn.Module, opt: torch.optim.Optimizer, scaler: Any, x: torch.Tensor) -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def test_a_grad_scaler_nobody_passed_is_found_and_its_skipped_steps_are_not_anomalies() -> None:
    # float16 autocast with a GradScaler whose first scales overflow the float16 gradients:
    # the scaler skips those steps by design. A watcher that was not given the scaler finds
    # it at scaler.scale(loss) and reads the steps as the scaler does.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    with nanwatch.watch(model, postmortem=False) as nw:  # on_anomaly="raise"
        for _ in range(6):
            _amp_step(model, opt, scaler, torch.randn(8, 16) * 4)
            nw.step()
    assert nw.scaler is scaler and nw.first_anomaly is None
    skipped = [t for t in nw.history if any(r.stat and not r.stat.finite for r in t.records)]
    assert skipped, "the test needs a step whose scaled gradients overflowed"
    assert nw.history[0].scale == 2.0**24
    assert all(p.isfinite().all() for p in model.parameters())


def test_a_step_the_grad_scaler_skipped_is_a_step_without_nw_step() -> None:
    """zero_grad before backward, and a scale whose float16 gradients overflow: the scaler
    skips every optimizer step, so no weight, optimizer hook or gradient shows an update;
    scaler.update() lowering the scale does (before, the five steps were one)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    before = [p.detach().clone() for p in model.parameters()]
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for _ in range(5):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 8)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    skipped = zip(before, model.parameters(), strict=True)
    assert all(torch.equal(a, p) for a, p in skipped)  # the scaler skipped every step
    assert [t.step for t in nw.history] == [0, 1, 2, 3, 4]
    assert nw.first_anomaly is None


def test_an_explicit_scaler_wins_and_the_scale_tap_is_removed_with_the_last_watcher() -> None:
    from nanwatch.watcher import _grad_scaler_classes

    cls = _grad_scaler_classes()[0]
    original = vars(cls)["scale"]
    mine, other = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    model = nn.Linear(2, 1)
    a = nanwatch.watch(model, scaler=mine).attach()
    b = nanwatch.watch(nn.Linear(1, 1)).attach()
    assert vars(cls)["scale"] is not original
    other.scale(model(torch.ones(1, 2)).sum())
    assert a.scaler is mine and b.scaler is other
    a.detach()
    assert vars(cls)["scale"] is not original
    b.detach()
    assert vars(cls)["scale"] is original


def test_a_float16_linear_that_overflows_to_minus_inf_is_found_although_relu_hides_it() -> None:
    # every output of the first Linear is -inf in float16; the ReLU after it turns -inf into
    # 0, so no NaN ever appears downstream: without the Linear's own record nothing is seen
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)).half()
    with torch.no_grad():
        model[0].weight.fill_(-30000.0)
        model[0].bias.zero_()
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        out = model(torch.ones(2, 4).half())
        out.float().sum().backward()
        nw.step()
    assert out.isfinite().all()
    a = nw.first_anomaly
    assert a is not None and (a.kind, a.path) == (AnomalyKind.FORWARD, "0")
    assert a.record.dtype == "float16"
    assert a.op is not None and a.op.op.startswith("aten.addmm")
    top = nw.history[0].diagnoses[0]
    assert top.code == "NW101" and "65504" in " ".join(top.evidence)


# ---------------------------------------------------------------- what is measured
def test_an_inplace_relu_is_linked_not_measured_again() -> None:
    model = zoo.InplaceNet()
    with nanwatch.watch(model) as nw:
        model(torch.randn(3, 4)).sum().backward()
        nw.step()
    trace = nw.history[-1]
    act = [r for r in trace.records if r.path == "act" and r.phase in (Phase.INPUT, Phase.FORWARD)]
    assert all(r.stat is None for r in act)  # bounded by fc1's record, no second pass
    assert act[0].source is not None and trace.record(act[0].source).path == "fc1"
    assert "act" not in _paths(nw, Phase.BACKWARD)


@pytest.mark.parametrize(("dtype", "measured"), [(torch.float32, False), (torch.float16, True)])
def test_finite_preserving_modules_are_measured_only_where_they_can_overflow(
    dtype: torch.dtype, measured: bool
) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 2)).to(dtype)
    with nanwatch.watch(model) as nw:
        model(torch.randn(3, 4, dtype=dtype)).float().sum().backward()
        nw.step()
    trace = nw.history[-1]
    for path in ("1", "2"):  # LayerNorm and GELU
        rec = next(r for r in trace.records if r.path == path and r.phase is Phase.FORWARD)
        assert (rec.stat is not None) == measured, (path, dtype)
        assert (path in _paths(nw, Phase.BACKWARD)) == measured
    assert next(r for r in trace.records if r.path == "3" and r.phase is Phase.FORWARD).stat


def test_a_nan_passed_through_an_unmeasured_module_is_blamed_on_its_maker() -> None:
    class Div(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x / (x - x)

    model = nn.Sequential(nn.Linear(4, 4), Div(), nn.LayerNorm(4), nn.GELU(), nn.Linear(4, 2))
    with nanwatch.watch(model, on_anomaly="record") as nw:
        model(torch.randn(3, 4))
    a = nw.first_anomaly
    assert a is not None and a.path == "1"
    assert "4" in a.propagators  # the next measured module merely passed it on


def test_weights_broken_by_an_update_are_found_at_the_step_boundary() -> None:
    """A -inf weight behind a ReLU never makes a NaN downstream: only the boundary check,
    right after the update that broke it, can see it."""
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(2, 3)
    with nanwatch.watch(model, on_anomaly="record") as nw:
        model(x).sum().backward()
        opt.step()
        with torch.no_grad():
            model[0].weight[1].fill_(-float("inf"))  # the update broke one unit
            model[0].bias[1] = 0.0
        nw.step()
        model(x).sum().backward()  # relu(-inf) = 0: the rest of the model stays finite
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.step == 0
    assert (a.kind, a.parameter) == (AnomalyKind.PARAMETER, "0.weight")
    assert a.record.stat is not None and a.record.stat.neginf == 3


def test_the_keyword_defaults_of_watch_are_those_of_watchconfig() -> None:
    """watch() spells its options out for users (and their editors); WatchConfig is where
    the defaults live: they must not drift apart."""
    import dataclasses
    import inspect

    from nanwatch.callbacks.lightning import _NanWatch

    fields = {f.name: f for f in dataclasses.fields(WatchConfig)}
    # the callback's actions are its own (stop, skip, ...) and its reports go to log_dir
    own = {nanwatch.watch: {"report_dir"}, _NanWatch.__init__: {"report_dir", "on_anomaly"}}
    for fn, skip in own.items():
        for name, param in inspect.signature(fn).parameters.items():
            if name in fields and name not in skip and param.default is not param.empty:
                default = fields[name].default
                expected = tuple(default) if isinstance(default, (list, tuple)) else default
                got = (
                    tuple(param.default)
                    if isinstance(param.default, (list, tuple))
                    else (param.default)
                )
                assert got == expected, (fn.__qualname__, name)
    assert inspect.signature(nanwatch.watch).parameters["report_dir"].default == (
        fields["report_dir"].default
    )


def test_functional_code_is_measured_unless_it_is_bounded_by_recorded_tensors() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.out = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            residual = x + self.fc(x)  # a sum of recorded tensors: bounded by their records
            logged = torch.log(residual.abs() + 1).view(-1, 4)  # a view over unwatched code
            return self.out(residual) + self.out(logged)

    model = nn.Sequential(nn.Linear(4, 4), Block())
    for dtype, measured in ((torch.float32, False), (torch.float16, True)):
        m = model.to(dtype)
        with nanwatch.watch(m) as nw:
            m(torch.randn(3, 4, dtype=dtype)).float().sum().backward()
            nw.step()
        inputs = [r for r in nw.history[-1].records if r.path == "1.out" and r.phase is Phase.INPUT]
        assert (inputs[0].stat is not None) == measured, dtype  # the residual sum
        assert inputs[1].stat is not None, dtype  # the view over log: always measured


def test_a_nan_that_depends_on_a_random_draw_is_not_called_transient() -> None:
    # the replay cannot repeat the forward's draws: it draws again until the failure comes
    # back, and never blames hardware because one replay drew differently
    class Noisy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x / torch.randint(0, 2, (1,)).float()

    verdicts = []
    for seed in range(6):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 4), Noisy(), nn.Linear(4, 1))
        with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
            for _ in range(4):
                model(torch.randn(2, 4)).sum().backward()
                nw.step()
        a = nw.first_anomaly
        if a is not None:
            trace = next(t for t in nw.history if t.anomaly is a)
            top = trace.diagnoses[0]
            verdicts.append((a.path, a.transient, top.code, a.op.op if a.op else None))
            assert any(n.kind == "replay" and n.data["random"] for n in trace.notes)
    assert verdicts, "the test needs a seed whose draws made a zero denominator"
    assert all(v == ("1", None, "NW111", "aten.div.Tensor") for v in verdicts), verdicts


def _wrapper_and_bad_batch() -> tuple[nn.Module, torch.Tensor]:
    """A root whose forward is never called (like a LightningModule's) around ``net``, and a
    batch of 6 whose sample 2 holds a NaN."""

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    torch.manual_seed(0)
    x = torch.randn(6, 4)
    x[2, 1] = math.nan
    return Wrapper(), x


def test_a_part_called_from_user_code_takes_its_inputs_as_data() -> None:
    """The LightningModule pattern: the watched root's forward never runs, user code calls
    ``model.net(x)``. That call's inputs come from outside every watched call, so a NaN in
    them is bad data (NW401, with the sample), steps still begin after each backward, and
    nothing is said about a compiled model."""

    m, x = _wrapper_and_bad_batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(m, on_anomaly="record") as nw:
            for i in range(3):
                m.net(x if i == 2 else torch.randn(6, 4)).mean().backward()
                m.zero_grad()
    assert [str(w.message) for w in caught] == []
    assert [t.step for t in nw.history] == [0, 1, 2]
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.INPUT and a.step == 2
    assert a.path == "net" and a.record.stat is not None and a.record.stat.bad_rows == (2,)
    assert nw.history[-1].diagnoses[0].code == "NW401"


def test_a_sampled_out_step_watches_the_parts_called_from_user_code_as_roots() -> None:
    """With sample_every, a step between full steps watches only the roots' calls; when
    the root itself is never called, the parts called from user code stand for it."""

    m, x = _wrapper_and_bad_batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(m, on_anomaly="record", sample_every=10) as nw:
            for i in range(4):
                m.net(x if i == 3 else torch.randn(6, 4)).mean().backward()
                nw.step()
    assert [str(w.message) for w in caught] == []
    trace = nw.history[3]
    assert not trace.full
    paths = {r.path for r in trace.records if r.phase is Phase.FORWARD}
    assert "net" in paths and not {"net.0", "net.1", "net.2"} & paths  # not its parts
    a = trace.anomaly
    assert a is not None and a.kind is AnomalyKind.INPUT and a.path == "net"
    assert a.record.stat is not None and a.record.stat.bad_rows == (2,)
    assert trace.diagnoses[0].code == "NW401"


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_a_weight_loaded_non_finite_is_not_blamed_on_an_update(mode: str) -> None:
    """A NaN row of a loaded embedding table that the first batch does not look up: found
    when watching begins, reported once as loaded (NW301 before the first update), not as
    the first update's doing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(20, 4), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight[7] = float("nan")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(model, mode=mode) as nw:
        for _ in range(2):
            ids = torch.randint(0, 7, (4, 3))  # row 7 is never looked up
            model(ids).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    (d,) = [d for d in info.value.diagnoses if d.code == "NW301"]
    assert d.title == "Non-finite weights before the first update"
    assert nw.first_anomaly is not None and nw.first_anomaly.step == 0
    bad = [r for r in nw.history[0].records if r.phase is Phase.PARAMETER]
    assert [r.role for r in bad] == ["0.weight"]  # once, though the step's end saw it too


@pytest.mark.parametrize("norm", ["weight_norm", "spectral_norm"])
def test_a_weight_a_pre_hook_computes_is_module_state_not_a_transient_fault(norm: str) -> None:
    """The hook-based weight_norm/spectral_norm compute `weight` before each forward: of
    an all-zero weight, 0/0. A replay of the forward reads the same NaN weight and no op
    in it makes the NaN: that is NW405 (module state), not a clean replay (NW404)."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 8)
    with torch.no_grad():
        lin.weight.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        normed = getattr(nn.utils, norm)(lin)
    model = nn.Sequential(normed, nn.ReLU(), nn.Linear(8, 3))
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(torch.randn(16, 4)).sum().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.path == "0" and not a.transient
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW405"
    assert "0.weight (set by a forward pre-hook, float32) holds NaN" in d.evidence


def test_a_nan_buffer_read_by_the_forward_is_module_state() -> None:
    class Shift(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("offset", torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x - self.offset

    model = nn.Sequential(Shift(), nn.Linear(4, 2))
    model[0].offset[1] = float("nan")  # written by code outside the forward
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(torch.randn(3, 4)).sum().backward()
        nw.step()
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW405" and "0.offset (buffer, float32) holds NaN" in d.evidence


def test_replay_names_the_backward_op_of_a_gradient_penalty() -> None:
    """WGAN-GP with a sample whose critic input-gradient is exactly 0: sqrt's backward at
    0 makes -inf, then NaN, in the double backward, where no module hook sees it; the
    replay traces it and the anomaly gets that op (its docstring: it completes the op)."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        critic[0].bias.fill_(-10.0)  # every ReLU off for the first sample: gradient 0
        critic[0].weight[:, 0] = 0.0

    def step_fn() -> None:
        x_hat = torch.tensor([[5.0, -5.0], [0.3, 9.0]]).requires_grad_(True)
        (g,) = torch.autograd.grad(critic(x_hat).sum(), x_hat, create_graph=True)
        penalty = ((torch.sqrt((g**2).sum(1)) - 1) ** 2).mean()
        (critic(x_hat).mean() + penalty).backward()

    with nanwatch.watch(critic, on_anomaly="record", postmortem=False) as nw:
        step_fn()
        nw.step()
        assert nw.first_anomaly is not None
        nw.replay(step_fn)
    a = nw.anomalies[-1]
    assert a.op is not None and (a.op.op, a.op.node) == ("aten.div.Tensor", "SqrtBackward0")


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_a_nan_a_module_keeps_aside_for_the_loss_is_not_blamed_on_the_loss_code(mode: str) -> None:
    """A mixture of experts keeps its load-balancing loss aside (self.aux), the mean over
    an expert with no tokens: NaN. It reaches the loss without being any module's output;
    forensic mode knows the op ran in the module's forward and says so, and the other
    modes find it by a replay of the module's call."""

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(4, 3)
            self.aux = torch.zeros(())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            probs = self.gate(x).softmax(-1)
            top = probs.argmax(-1)
            self.aux = torch.stack([probs[top == e, e].mean() for e in range(3)]).sum()
            return x * probs.max(-1, keepdim=True).values

    torch.manual_seed(0)
    model = Experts()
    with torch.no_grad():
        model.gate.bias[2] = -1e3  # expert 2 gets no token: mean of nothing
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        (model(torch.randn(8, 4)).sum() + model.aux).backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and "computed outside any watched module" not in a.summary
    assert a.summary.startswith(
        "NaN born in the forward of Experts, in a value it did not return that the loss used"
    )


@pytest.mark.landed_only(
    reason="stops the step before backward runs (no .grad), by the read as backward begins; "
    "GPU-bound the first read is before the update, after backward"
)
@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_bad_data_that_reaches_an_output_still_stops_the_step_in_forward(mode: str) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    x = torch.randn(5, 3)
    x[2, 1] = float("nan")
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(model, mode=mode):
        out = model(x)
        out.sum().backward()  # never runs: the forward raised
    assert all(p.grad is None for p in model.parameters())  # no update could spread it
    assert info.value.anomaly is not None and info.value.anomaly.kind.value == "input"
    assert info.value.diagnoses[0].code == "NW401"


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_nan_padding_that_nothing_reads_is_not_an_anomaly(mode: str) -> None:
    """Sequences padded with NaN past their lengths: pack_padded_sequence never reads the
    padding, the output, loss and gradients are finite. Data is an error once it reaches
    something the step computes."""
    from torch.nn.utils.rnn import pack_padded_sequence

    class Rnn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.GRU(3, 8, batch_first=True)
            self.head = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            return self.head(self.rnn(packed)[1][-1])

    torch.manual_seed(0)
    model, crit = Rnn(), nn.MSELoss()
    with pytest.warns(nanwatch.NanwatchWarning, match="NW406") as said:
        nw = _padded_run(model, crit, mode)
    assert len(said) == 1  # once per code
    assert nw.anomalies == [] and nw.first_anomaly is None
    assert all(torch.isfinite(p).all() for p in model.parameters())
    notes = [n for n in nw.history[0].notes if n.kind == "absorbed_data"]
    assert [n.path for n in notes] == ["Rnn"] and notes[0].data["rows"] == [1, 2, 3]
    (d,) = nw.history[0].diagnoses
    assert d.code == "NW406" and d.evidence[0] == (
        "input[0] of Rnn holds NaN in samples 1, 2, 3 (3 of 4)"
    )
    # a model that imputes missing values itself is told to keep the warning out, not to
    # nan_to_num its inputs (which would leave its imputation dead code)
    assert "ignore=['NW406']" in d.fix


def _padded_run(model: nn.Module, crit: nn.Module, mode: str) -> nanwatch.Watcher:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanwatch.watch(model, crit, mode=mode) as nw:
        for _ in range(2):
            lengths = torch.tensor([6, 2, 4, 5])
            x = torch.randn(4, 6, 3)
            for i, n in enumerate(lengths):
                x[i, n:] = float("nan")
            crit(model(x, lengths), torch.randn(4, 1)).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


_nw301_summaries: list[str] = []


def _nw301(run: Callable[[nn.Module, torch.optim.Optimizer, int], None]) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(
        [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 1e-3}],
        lr=1e-3,
    )
    x = torch.randn(8, 4)
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(model) as nw:
        for i in range(4):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            run(model, opt, i)
            nw.step()
    (d,) = [d for d in info.value.diagnoses if d.code == "NW301"]
    _nw301_summaries.append(info.value.anomaly.summary if info.value.anomaly else "")
    return d


def test_nw301_tells_a_weight_written_after_the_update_from_the_update() -> None:
    # a checkpoint holding a NaN loaded mid-run: Adam updated the weight and left it finite
    def load(model: nn.Module, opt: Any, i: int) -> None:
        if i == 1:
            sd = {k: v.clone() for k, v in model.state_dict().items()}
            sd["0.weight"][0, 0] = float("nan")
            model.load_state_dict(sd)

    d = _nw301(load)
    assert d.title == "Non-finite weights written outside an optimizer step"
    assert any("Adam updated 0.weight and left it finite" in e for e in d.evidence)
    assert "lr" not in d.fix
    # the summary says the same, not 'made non-finite by the last update (optimizer step)'
    assert "by a write after the last optimizer step (not the update)" in _nw301_summaries[-1]


def test_nw301_names_the_param_group_whose_learning_rate_is_nan() -> None:
    def nan_lr(model: nn.Module, opt: Any, i: int) -> None:
        if i == 1:
            opt.param_groups[1]["lr"] = float("nan")  # group 1: the head

    d = _nw301(nan_lr)
    assert d.title == "Non-finite learning rate"
    assert any("(param group 1)" in e for e in d.evidence)
    assert "opt.param_groups[1]['lr']" in d.fix  # in the user's name for the optimizer
    # the update that broke it is this step's (the NaN is found at its end), not the last's
    assert not any("gradient norm at step 1" in e for e in d.evidence)


def test_nw301_a_weight_no_optimizer_updates_is_not_the_learning_rates_fault() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ema = torch.optim.swa_utils.AveragedModel(
        model,
        avg_fn=lambda avg, new, n: avg + (new - avg) / (n - 1),  # n = 1: 0/0
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 4)
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(model, ema) as nw:
        for _ in range(3):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ema.update_parameters(model)
            ema.update_parameters(model)
            nw.step()
    (d,) = [d for d in info.value.diagnoses if d.code == "NW301"]
    assert d.title == "Non-finite weights written outside an optimizer step"
    assert "The learning rate is not the cause" in d.explanation
    a = info.value.anomaly
    assert a is not None and "outside an optimizer step (no optimizer updated it" in a.summary


def test_when_every_weight_went_nan_the_first_one_the_model_runs_is_named() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for step in range(4):
            x = torch.randn(8, 8)
            if step == 2:
                x[0, 0] = float("nan")  # NaN gradients: the update writes NaN everywhere
            F.cross_entropy(model(x), torch.randint(0, 3, (8,))).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    later = [a for a in nw.anomalies if a.step == 3]
    assert later and later[0].parameter == "0.weight"


def test_the_report_keeps_the_first_anomalys_step_after_the_ring_moved_past_it() -> None:
    model = nn.Linear(4, 1)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False, ring_size=4) as nw:
        for step in range(10):
            x = torch.randn(8, 4)
            if step == 1:
                x[0, 0] = float("nan")
            model(x).pow(2).mean().backward()
            model.zero_grad()
            nw.step()
    report = nw.report
    assert [t.step for t in report.steps] == [1, 6, 7, 8, 9]
    assert report.diagnoses[0].code == "NW401" and report.diagnoses[0].step == 1


def test_a_layernorm_whose_variance_overflows_is_blamed_not_the_next_layer() -> None:
    """Activations near 1e20 (a diverging run): LayerNorm's x² passes float32's range and
    it outputs NaN. Its output is bounded by its input, not read, so the NaN was first seen
    at the next Linear, whose replay (given the NaN) made nothing: that was called a
    transient hardware fault (NW404). The replay's NaN input now moves the anomaly to the
    LayerNorm, which is replayed in turn."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj, self.ln, self.fc = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.ln(x + self.proj(x)))

    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].proj.weight.mul_(1e20)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(torch.randn(4, 8)).sum().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.path == "0.ln" and not a.transient
    assert a.op is not None and a.op.op == "aten.native_layer_norm.default"
    assert [d.code for d in nw.history[0].diagnoses][:1] == ["NW101"]


def test_the_headline_of_a_loaded_nan_weight_says_before_any_update() -> None:
    from nanwatch.report import anomaly_headline

    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(torch.randn(2, 3)).sum().backward()
        nw.step()
    assert nw.first_anomaly is not None
    assert (
        anomaly_headline(nw.first_anomaly) == "NaN in the weights weight before any update, step 0"
    )


def test_the_headline_names_what_the_op_made_when_the_value_changed_sign_after_it() -> None:
    """``-log(p)`` of a saturated sigmoid: aten.log made -inf, the loss is +inf. The
    headline and the summary say both, not '+inf born ... by aten.log'."""
    from nanwatch.report import anomaly_headline

    model = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
    with torch.no_grad():
        model[0].bias.fill_(-200.0)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        (-torch.log(model(torch.randn(8, 4)))).mean().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.born == "-inf"
    assert anomaly_headline(a).startswith("-inf born in the forward of (loss) by aten.log")
    assert "(then +inf), step 0" in anomaly_headline(a)
    assert a.summary.startswith("-inf born ") and " (then +inf) [op aten.log" in a.summary
    assert ", which made -inf]" in a.summary


def test_max_logit_reads_the_logits_of_an_output_that_also_holds_the_loss() -> None:
    """A Hugging Face-style output: loss, logits and hidden states. max |logit| is the
    logits' (it was the loss, or a hidden state's)."""

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
            h = self.body(x) * 100.0  # hidden states far larger than the logits
            logits = self.head(h) / 1000.0
            loss = nn.functional.cross_entropy(logits, y) + 50.0
            return {"loss": loss, "logits": logits, "hidden_states": (h,)}

    torch.manual_seed(0)
    model = WithLoss()
    with nanwatch.watch(model, postmortem=False) as nw:
        out = model(torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))
        out["loss"].backward()
        nw.step()
    assert nw.history[0].max_logit == pytest.approx(out["logits"].abs().max().item())


def test_nested_watchers_only_the_one_that_found_the_anomaly_writes_a_post_mortem(
    tmp_path: Any,
) -> None:
    """A GAN watched as two watchers: the generator's NaN raises in the generator's
    watcher; the discriminator's watcher, stopped by it, writes no report of its own (it
    said 'stopped at the first anomaly' with none), and the generator's optimizer steps
    are not updates of the discriminator's steps."""
    torch.manual_seed(0)
    gen, disc = nn.Linear(2, 2), nn.Linear(2, 1)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    with (
        pytest.raises(AnomalyError),
        nanwatch.watch(gen, report_dir=str(tmp_path)) as nw_g,
        nanwatch.watch(disc, report_dir=str(tmp_path)) as nw_d,
    ):
        for it in range(4):
            fake = gen(torch.randn(3, 2))
            disc(fake.detach()).mean().backward()
            opt_d.step()
            opt_d.zero_grad()
            scale = 0.0 if it == 2 else 1.0
            (disc(fake).mean() + ((fake * scale) ** 2).sum().sqrt()).backward()  # sqrt(0)
            opt_g.step()
            opt_g.zero_grad()
            opt_d.zero_grad()
    assert nw_g.first_anomaly is not None and nw_d.first_anomaly is None
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_another_models_optimizer_step_is_not_an_update_of_the_watched_one() -> None:
    # the watched model accumulates over two micro-batches while an unwatched model's
    # optimizer steps in between: still one step
    torch.manual_seed(0)
    model, other = nn.Linear(2, 1), nn.Linear(2, 1)
    opt, opt_other = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, other))
    with nanwatch.watch(model) as nw:
        for _ in range(2):
            for _ in range(2):  # micro-batches
                model(torch.randn(3, 2)).sum().backward()
                other(torch.randn(3, 2)).sum().backward()
                opt_other.step()
                opt_other.zero_grad()
            opt.step()
            opt.zero_grad()
    assert [t.step for t in nw.history] == [0, 1]


def test_a_nan_made_between_two_watched_roots_is_not_bad_data() -> None:
    """``h / h.norm(dim=0)`` between an encoder and a head, with a dead unit (0/0): the
    head's input was computed from the encoder's output, so it is not the batch (NW401);
    forensic mode names the division and its line."""
    for mode, code in (("watch", "NW100"), ("forensic", "NW111")):
        torch.manual_seed(0)
        enc, head = nn.Sequential(nn.Linear(6, 4), nn.ReLU()), nn.Linear(4, 1)
        with torch.no_grad():
            enc[0].bias[1] = -100.0  # unit 1 never fires: its column norm is 0
        with nanwatch.watch(enc, head, mode=mode, on_anomaly="record", postmortem=False) as nw:
            h = enc(torch.randn(64, 6))
            head(h / h.norm(dim=0, keepdim=True)).pow(2).mean().backward()
        a = nw.first_anomaly
        assert a is not None and a.kind is AnomalyKind.FORWARD and a.origin == "between-roots"
        assert "computed from the output of Sequential by DivBackward0" in a.summary
        assert nw.history[-1].diagnoses[0].code == code
        if mode == "forensic":
            assert a.op is not None and a.op.op == "aten.div.Tensor"


class _Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(((self.enc(a) - self.enc(b)) ** 2).sum(-1))  # 0 for a same pair


def test_a_backward_nan_in_the_parents_code_is_not_blamed_on_the_container_it_called() -> None:
    """The Sequential returned its last child's output as it was: the sqrt that used it is
    the root's code, not the Sequential's (NW100 'code in enc'), and it is NW112."""
    torch.manual_seed(0)
    model = _Siamese()
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        a = torch.randn(16, 16)
        b = a + 0.1 * torch.randn(16, 16)
        b[3] = a[3]
        model(a, b).mean().backward()
        nw.step()
    a_ = nw.first_anomaly
    assert a_ is not None and a_.path == "_Siamese" and a_.origin == "between-children"
    assert "code in _Siamese that used the output of enc" in a_.summary
    assert nw.history[0].diagnoses[0].code == "NW112"


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"config": {}}, r"`config` must be a nanwatch.WatchConfig; got dict"),
        ({"config": WatchConfig(), "mode": "sentinel"}, r"either config= or keyword options"),
        ({"allow": 3}, r"`allow` must be module-path patterns"),
        ({"ignore": 3}, r"`ignore` must be diagnosis codes"),
        ({"ignore": ["NW9999"]}, r"got 'NW9999'"),
        ({"guards": "no"}, r"`guards` must be True or False; got 'no'"),
        ({"postmortem": "False"}, r"`postmortem` must be True or False"),
        ({"scaler": "x"}, r"`scaler` must be a torch.amp.GradScaler; got str"),
    ],
)
def test_bad_arguments_are_refused_by_name_before_any_hook(
    options: dict[str, Any], match: str
) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=match):
        nanwatch.watch(model, **options)
    assert not model[0]._forward_hooks and not model._forward_pre_hooks


def test_diagnosis_codes_to_ignore_are_read_in_any_case() -> None:
    assert nanwatch.watch(nn.Linear(2, 2), ignore=["nw111", " NW110"]).config.ignore == (
        "NW111",
        "NW110",
    )


def test_loss_code_dividing_a_watched_output_by_zero_made_inf_not_nan() -> None:
    """``out / temperature`` with a temperature of 0: autograd did not save the numerator
    (the model's output), which the watcher holds; the division made ±inf, and the NaN came
    after it (log_softmax of inf), not '0/0 = NaN' by aten.div."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        out = model(torch.randn(8, 4))
        F.cross_entropy(out / torch.tensor(0.0), torch.randint(0, 3, (8,))).backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.op == "aten.div"
    assert a.op.born == "+inf, -inf" and dict(a.op.inputs)["self"] is not None


class _ActNorm(nn.Module):
    """Glow's ActNorm: its scale is set from the first batch it sees."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.zeros(d))
        self.register_buffer("inited", torch.tensor(False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.inited:
            with torch.no_grad():
                self.log_scale.copy_(-torch.log(x.std(0)))  # a constant feature: +inf
                self.inited.fill_(True)
        return x * self.log_scale.exp()


def test_a_weight_written_in_the_first_forward_was_not_loaded_so() -> None:
    model = nn.Sequential(_ActNorm(4), nn.Linear(4, 1))
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        x = torch.randn(32, 4)
        x[:, 3] = 1.0
        model(x).pow(2).mean().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.PARAMETER and a.parameter == "0.log_scale"
    assert "written in this step outside an optimizer step" in a.summary
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW301" and d.title == "Non-finite weights written outside an optimizer step"


class _Coupling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = torch.relu(self.net(x))  # a scale that hits 0
        return x * s, torch.log(s).sum(-1)  # log-det: -inf


class _Flow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = _Coupling()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z, ld = self.c1(x)
        return z, ld + 0.0  # the parent's output is a new tensor made from the child's


def test_a_minus_inf_is_traced_to_the_child_that_made_it_not_its_parent() -> None:
    torch.manual_seed(0)
    flow = _Flow()
    with nanwatch.watch(flow, on_anomaly="record", postmortem=False) as nw:
        z, ld = flow(torch.randn(16, 2))
        (0.5 * z.pow(2).sum(-1) - ld).mean().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.neginf_source is not None
    assert (a.neginf_source.path, a.neginf_source.role) == ("c1", "output[1]")
    assert "from -inf first seen in c1 (forward, output[1])" in a.summary


def test_a_repeated_anomaly_in_record_mode_keeps_its_op_on_every_step() -> None:
    """A run that records and goes on: the overflow of step 2 is there again at steps 3
    and 4, and each is still named by its op (it was NW100 with no op after the first)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for step in range(5):
            shift = 100.0 if step >= 2 else 0.0
            torch.exp(model(torch.randn(8, 4)) + shift).mean().backward()
            model.zero_grad()
            nw.step()
    bad = [t for t in nw.history if t.anomaly is not None]
    assert [t.step for t in bad] == [2, 3, 4]
    assert all(t.anomaly is not None and t.anomaly.op is not None for t in bad)
    assert all(t.diagnoses[0].code == "NW101" for t in bad)


def test_an_integer_count_of_zero_in_loss_code_is_measured_as_the_denominator() -> None:
    model = nn.Linear(4, 1)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        tok = model(torch.randn(3, 5, 4)).squeeze(-1)
        lengths = torch.tensor([5, 0, 3])
        (tok.sum(1) / lengths).mean().backward()
        nw.step()
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW111"
    assert any("denominator is an integer tensor (a count) holding 0" in e for e in d.evidence)


def test_a_nan_target_hidden_by_torch_where_is_named_not_a_root_at_zero() -> None:
    """NaN targets in a masked forecast window: torch.where keeps the loss finite, and the
    gradient of (p - y) ** 2 is 0 × NaN. It was NW112 'fractional power at zero' with a
    clamp fix that wrecks the MSE."""
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        p = model(torch.randn(8, 4))
        y = torch.randn(8, 6)
        y[:, 4:] = float("nan")  # the future window: no data yet
        mask = ~torch.isnan(y)
        torch.where(mask, (p - y) ** 2, 0.0).sum().backward()
        nw.step()
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW407" and d.title.startswith("NaN hidden by a mask in forward")
    assert "nan_to_num" in d.fix


def test_a_nan_numerator_of_a_finite_division_is_not_blamed_on_the_division() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        p = model(torch.randn(8, 4))
        y = torch.randn(8, 6)
        y[:, 4:] = float("nan")
        m = (~torch.isnan(y)).float()
        ((((p - y) ** 2) * m).sum() / m.sum()).backward()
        nw.step()
    assert all(d.code != "NW111" for d in nw.history[0].diagnoses)


def test_gradients_zeroed_by_a_nan_are_not_called_vanishing() -> None:
    """L1Loss of a NaN prediction sends back sign(NaN) = 0: after the weights went NaN
    every output gradient is 0, which is the NaN's doing, not dead units (NW304)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    crit = nn.L1Loss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for step in range(10):
            x = torch.rand(8, 6)
            if step == 2:
                x[3] = float("inf")
            crit(model(x), torch.rand(8, 2)).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    assert not any(d.code == "NW304" for t in nw.history for d in t.diagnoses)


def test_a_finite_gradient_whose_squares_overflow_has_a_finite_norm() -> None:
    model = nn.Linear(4, 2)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        (model(torch.randn(8, 4)).sum() * 1e21).backward()
        nw.step()
    t = nw.history[0]
    assert t.anomaly is None and t.grad_norm is not None and math.isfinite(t.grad_norm)
    assert t.grad_norm > 1e21


def test_a_fractional_power_of_negative_predictions_gets_a_positive_parameterization() -> None:
    """mu ** -0.5 of a raw Linear output (a Tweedie loss): NaN below 0. A relu or a
    sign-keeping power would make inf or flip the rate; the fix is a positive link."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    with nanwatch.watch(model, mode="forensic", on_anomaly="record", postmortem=False) as nw:
        mu = model(torch.randn(64, 4)).squeeze(-1)
        y = torch.rand(64)
        (-y * mu.pow(-0.5) / 0.5 + mu.pow(0.5) / 0.5).mean().backward()
        nw.step()
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW112"
    assert "softplus" in d.fix and "relu(" not in d.fix.split("#")[0]
    assert "** -0.5" not in d.fix


def test_bad_tabular_data_names_its_feature_columns() -> None:
    model = nn.Linear(8, 1)
    x = torch.randn(32, 8)
    x[:, 3] = float("nan")  # a missing-value column
    x[9, 6] = float("inf")
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(x).sum().backward()
        nw.step()
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW401"
    assert any("; feature columns 3, 6 (2 of 8)" in e for e in d.evidence)
    assert nw.report.to_dict()["steps"][0]["records"][0]["stat"]["bad_cols"] == [3, 6]


def test_the_headline_of_a_nan_born_between_roots_does_not_blame_the_next_root() -> None:
    from nanwatch.report import anomaly_headline

    torch.manual_seed(0)
    enc, head = nn.Sequential(nn.Linear(6, 4), nn.ReLU()), nn.Linear(4, 1)
    with torch.no_grad():
        enc[0].bias[1] = -100.0
    with nanwatch.watch(enc, head, on_anomaly="record", postmortem=False) as nw:
        h = enc(torch.randn(64, 6))
        head(h / h.norm(dim=0, keepdim=True)).pow(2).mean().backward()
    a = nw.first_anomaly
    assert a is not None
    assert anomaly_headline(a) == (
        "NaN born in code outside the watched modules, in the input of Linear, step 0"
    )
