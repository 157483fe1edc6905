"""A guard inside a ``torch.compile``'d child (sentinel mode runs it compiled) cannot run in
the graph: when the compiled call raises, the error goes on unchanged and the guard's
diagnosis is found from the same inputs on the eager module. Nothing of nanwatch breaks
the child's graph. A loss module built in the loop under ``watch_all`` (``nanwatch run``)
keeps one name and is let go with its step. A hand-written instance norm divided by a zero
std gets the eps inside the sqrt, not a clamp after it; the float32 fix of a bfloat16
one-pass variance casts back, so that it runs in a model cast to bfloat16 whole."""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

torch.set_num_threads(1)


# ------------------------------------------------ 1: guards and a compiled child (sentinel)
class _WithLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.crit = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.crit(self.lin(x), y)


class _Tagger(nn.Module):
    def __init__(self, backend: str) -> None:
        super().__init__()
        self.emb = torch.compile(nn.Embedding(10, 4), backend=backend)
        self.head = nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def _compiled_loss_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.body = torch.compile(_WithLoss(), backend="eager")
    return model


def test_a_class_target_out_of_range_in_a_compiled_child_keeps_the_error_and_explains_it() -> None:
    model = _compiled_loss_model()
    x = torch.randn(3, 4)
    with (
        pytest.raises(IndexError, match="Target 3 is out of bounds") as info,
        nanwatch.watch(model, mode="sentinel", postmortem=False, functional_guards=False) as nw,
    ):
        model.body(x, torch.tensor([0, 1, 2]))  # compiled, and fine
        nw.step()
        model.body(x, torch.tensor([0, 1, 3]))
    assert type(info.value) is IndexError  # torch's own, not replaced
    d = nw.report.diagnoses[0]
    assert (d.code, d.path, d.severity) == ("NW501", "body.crit", "error"), d.headline
    assert "target contains 3" in d.evidence[0], d.evidence
    said = " ".join(d.evidence)
    assert "torch.compile'd call of body raised IndexError (Target 3 is out of bounds)" in said
    assert "give the model 4 outputs, or remap the labels to 0..2" in d.fix, d.fix


# the eager backend's graph calls F.embedding by name: the functional guard would stop it
# there (a GuardError, as in an eager run); aot_eager's graph holds aten ops, as inductor's
@pytest.mark.parametrize(("backend", "functional"), [("eager", False), ("aot_eager", True)])
def test_an_embedding_id_out_of_range_in_a_compiled_child_is_named(
    backend: str, functional: bool
) -> None:
    torch.manual_seed(0)
    net = _Tagger(backend)
    with (
        pytest.raises(IndexError, match="index out of range in self") as info,
        nanwatch.watch(net, mode="sentinel", postmortem=False, functional_guards=functional) as nw,
    ):
        net(torch.tensor([[1, 2, 10]]))
    assert type(info.value) is IndexError
    d = nw.report.diagnoses[0]
    assert d.code == "NW513", d.headline
    assert "input contains 10" in d.evidence[0] and "ids must be in 0..9" in d.evidence[0]
    assert "torch.compile'd call of emb raised IndexError" in " ".join(d.evidence)


class _Lookup(nn.Module):
    """Raises as a GPU does after a kernel's assert (the CPU raises IndexError first)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.emb(ids)
        if ids.shape[1] == 3:
            raise RuntimeError("CUDA error: device-side assert triggered")
        return out


def test_a_dead_device_s_error_from_a_compiled_child_names_it_from_host_data_alone() -> None:
    net = nn.Module()
    net.look = torch.compile(_Lookup(), backend="eager")
    with (
        pytest.raises(RuntimeError, match="device-side assert triggered") as info,
        nanwatch.watch(net, mode="sentinel", postmortem=False, functional_guards=False) as nw,
    ):
        net.look(torch.tensor([[1, 2, 3]]))
    assert type(info.value) is RuntimeError
    advice = nw.report.error["advice"]
    assert advice.startswith(
        "The error came out of the torch.compile'd call of look, which holds look.emb: a guard "
        "cannot check inputs inside a compiled graph (Embedding look.emb: 10 rows; input "
        "int64 (1, 3)). Run this batch through look uncompiled (its ._orig_mod), or on the "
        "CPU, and the guard names the values and their positions. A CUDA kernel's assertion"
    ), advice


def test_a_compiled_child_s_error_caught_by_the_loop_is_a_warning_and_the_step_goes_on() -> None:
    model = _compiled_loss_model()
    x = torch.randn(3, 4)
    with (
        pytest.warns(nanwatch.NanwatchWarning, match="NW501 warning"),
        nanwatch.watch(model, mode="sentinel", postmortem=False, functional_guards=False) as nw,
    ):
        with contextlib.suppress(IndexError):  # a bad batch skipped
            model.body(x, torch.tensor([0, 5, 1]))
        model.body(x, torch.tensor([0, 1, 2])).backward()
    d = nw.history[0].diagnoses[0]
    assert (d.code, d.severity) == ("NW501", "warning"), d.headline
    assert "the error was caught and the step went on" in d.evidence


def test_no_graph_break_of_nanwatch_s_in_a_compiled_child_that_holds_a_loss() -> None:
    from torch._dynamo.utils import counters

    model = _compiled_loss_model()
    torch._dynamo.reset()
    counters.clear()
    with nanwatch.watch(model, mode="sentinel", postmortem=False):
        model.body(torch.randn(3, 4), torch.tensor([0, 1, 2])).backward()
    assert not counters["graph_break"], dict(counters["graph_break"])


# ------------------------------------------------ 2: a loss module made in the loop (watch_all)
def _loop(steps: int, *, two_sites: bool = False) -> tuple[Any, list[Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    made: list[Any] = []
    sizes: list[tuple[int, int, int]] = []
    with nanwatch.watch_all(postmortem=False) as nw:
        for _ in range(steps):
            x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
            crit = nn.CrossEntropyLoss()
            made.append(weakref.ref(crit))
            loss = crit(model(x), y)
            if two_sites:
                loss = loss + nn.CrossEntropyLoss(label_smoothing=0.1)(model(x), y)
            del crit
            loss.backward()
            opt.step()
            opt.zero_grad()
            sizes.append((len(nw.roots), len(nw.module_paths), len(nw._handles)))
    return nw, [made, sizes]


def test_a_loss_module_made_in_the_loop_keeps_one_name_and_is_let_go() -> None:
    nw, (made, sizes) = _loop(12)
    paths = {r.path for t in nw.history for r in t.records}
    assert "CrossEntropyLoss" in paths
    assert not any("#" in p for p in paths), sorted(paths)
    assert sizes[2] == sizes[-1], sizes  # roots, names and hooks do not grow with the steps
    gc.collect()
    assert made[0]() is None  # the first step's loss module is not held


def test_one_name_per_line_for_modules_without_weights_and_one_per_module_with() -> None:
    nw, (_, sizes) = _loop(6, two_sites=True)
    names = [p for p in nw.module_paths if p.startswith("CrossEntropyLoss")]
    assert names == ["CrossEntropyLoss", "CrossEntropyLoss#2"], nw.module_paths
    assert sizes[1] == sizes[-1], sizes
    # heads with weights of their own, called by one line of a loop: each trains apart
    torch.manual_seed(0)
    heads = [nn.Linear(4, 2) for _ in range(3)]
    with nanwatch.watch_all(postmortem=False) as nw:
        for _ in range(2):
            for head in heads:
                head(torch.randn(2, 4)).sum().backward()
    assert [p for p in nw.module_paths if p.startswith("Linear")] == [
        "Linear",
        "Linear#2",
        "Linear#3",
    ]


# ------------------------------------------------ 3: an instance norm by hand, a constant channel
class _InstanceNorm(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=(2, 3), keepdim=True)
        if self.how == "std":
            std = x.std(dim=(2, 3), keepdim=True)
            return (x - mean) / std
        if self.how == "var":
            var = x.var(dim=(2, 3), keepdim=True)
            return (x - mean) / var.sqrt()
        if self.how == "clamp":  # the advice nanwatch gave before
            return (x - mean) / x.std(dim=(2, 3), keepdim=True).clamp_min(1e-8)
        return (x - mean) / torch.sqrt(x.var(dim=(2, 3), keepdim=True) + 1e-5)  # its fix now


class _ConvNet(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = _InstanceNorm(how)
        self.head = nn.Linear(4 * 8 * 8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.conv(x)).flatten(1))


def _norm_run(how: str) -> tuple[Any, float]:
    torch.manual_seed(0)
    net = _ConvNet(how)
    with torch.no_grad():
        net.conv.weight[1].zero_()  # channel 1 holds its bias alone: it does not vary
    with nanwatch.watch(net, postmortem=False, on_anomaly="record") as nw:
        F.cross_entropy(net(torch.randn(2, 3, 8, 8)), torch.tensor([0, 1])).backward()
    grad = net.conv.weight.grad
    assert grad is not None
    return nw, float(grad.abs().max())


@pytest.mark.parametrize("how", ["std", "var"])
def test_a_zero_std_of_a_constant_channel_gets_eps_inside_the_sqrt(how: str) -> None:
    nw, _ = _norm_run(how)
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW111", d.headline
    first = d.fix.splitlines()[0]
    assert "+ 1e-5" in first and "sqrt" in first, d.fix
    assert "clamp_min" not in first.split("#")[0], d.fix
    assert "(2 of 8 here)" in first, d.fix
    assert "F.instance_norm(x, eps=1e-5)" in d.fix, d.fix
    # that fix trains on the same data; the clamp given before divided by eps
    fixed, g_fixed = _norm_run("fixed")
    assert fixed.first_anomaly is None
    assert not fixed.history[0].diagnoses, [d.headline for d in fixed.history[0].diagnoses]
    _, g_clamp = _norm_run("clamp")
    assert g_clamp > 1e3 * g_fixed  # x - mean's rounding divided by eps, and its gradient


# ------------------------------------------------ 4: a bfloat16 one-pass variance, model all bf16
class _OnePass(nn.Module):
    def __init__(self, d: int, *, fixed: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.fixed = fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed:  # the float32 fix nanwatch gives
            y = F.layer_norm(x.float(), x.shape[-1:]).to(x.dtype)
        else:
            mean = x.mean(-1, keepdim=True)
            var = (x * x).mean(-1, keepdim=True) - mean * mean
            y = (x - mean) / torch.sqrt(var)
        return y * self.weight


def _bf16_run(*, fixed: bool) -> Any:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), _OnePass(16, fixed=fixed), nn.Linear(16, 1))
    with torch.no_grad():  # activations far from 0 that vary little
        net[0].weight.mul_(0.01)
        net[0].bias.fill_(300.0)
        net[0].bias[::2] += 1.0
    net = net.to(torch.bfloat16)  # the whole model, weights too
    with nanwatch.watch(net, postmortem=False, on_anomaly="record") as nw:
        x = torch.randn(4, 8, dtype=torch.bfloat16)
        F.mse_loss(net(x), torch.randn(4, 1, dtype=torch.bfloat16)).backward()
    return nw


def test_the_float32_fix_of_a_bf16_variance_casts_back_for_a_bf16_model() -> None:
    d = _bf16_run(fixed=False).history[0].diagnoses[0]
    assert "E[x²] - E[x]²" in d.title, d.title
    assert "F.layer_norm(x.float(), x.shape[-1:]).to(x.dtype)" in d.fix, d.fix
    fixed = _bf16_run(fixed=True)  # runs: no float32 output into a bfloat16 Linear
    assert fixed.first_anomaly is None
