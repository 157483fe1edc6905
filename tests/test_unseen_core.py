"""Replays that see what the module's call really ran, found by user testing: the user's own
forward hooks and pre-hooks (a row normalization, a per-sample standardization), non-finite
weights and buffers of submodules nanwatch does not watch (a head replaced after attach, a
``torch.jit.trace``'d part), a BatchNorm reading a NaN running variance in eval, and the
module that made the -inf an anomaly grew out of (erfinv of -1, log of a silent frame).

Each runs a tiny real training loop under ``nanwatch.watch`` on CPU."""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch import ops
from nanwatch.records import AnomalyKind, Phase


def _run(
    model: nn.Module,
    crit: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    before: Any = None,
) -> Any:
    """A plain SGD loop, anomalies recorded; ``before(step)`` runs ahead of each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for step, (x, y) in enumerate(batches):
            if before is not None:
                opt = before(step) or opt
            loss = crit(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


def _batches(
    n: int, shape: tuple[int, ...], classes: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return [(torch.randn(*shape), torch.randint(0, classes, (shape[0],))) for _ in range(n)]


def _line_of(fn: Any, text: str) -> str:
    lines, start = inspect.getsourcelines(fn)
    i = next(i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(fn)}:{start + i}"


def _top(nw: Any) -> Any:
    trace = nw.first_bad_step
    assert trace is not None and trace.diagnoses
    return trace.diagnoses[0]


# ---------------------------------------------------------------- the user's own hooks


def l2_rows(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out / out.norm(dim=1, keepdim=True)


def test_a_users_forward_hook_that_divides_by_a_zero_norm_is_replayed_with_it() -> None:
    """The hook normalizes a Linear's output rows; a dead layer gives 0/0. The replay ran
    ``forward`` alone, came out clean, and the NaN was called a transient hardware fault
    (NW404) with nvidia-smi advice."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 3))
    model[2].register_forward_hook(l2_rows)

    def kill(step: int) -> None:
        if step == 2:
            with torch.no_grad():
                model[2].weight.zero_()
                model[2].bias.zero_()

    nw = _run(model, nn.CrossEntropyLoss(), _batches(4, (4, 6), 3), before=kill)
    a = nw.first_anomaly
    assert (a.step, a.path, a.kind, a.transient) == (2, "2", AnomalyKind.FORWARD, None)
    assert a.op is not None and a.op.op == "aten.div.Tensor" and a.op.born == "NaN"
    assert a.op.source == _line_of(l2_rows, "out.norm")
    d = _top(nw)
    assert (d.code, d.path, d.source) == ("NW111", "2", a.op.source)


def standardize(mod: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
    x = args[0]
    return ((x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True),)


def test_a_users_pre_hook_on_the_model_is_code_of_the_call_not_the_data() -> None:
    """The user standardizes each sample in a pre-hook on the model; a constant sample has
    std 0. nanwatch's pre-hook ran after the user's and took the hook's NaN output for the
    batch: bad data (NW401), with a fix that found nothing in the user's finite x."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    model.register_forward_pre_hook(standardize)
    batches = _batches(4, (4, 6), 3)
    batches[2][0][1] = 0.7  # a dead sensor: every feature the same
    nw = _run(model, nn.CrossEntropyLoss(), batches)
    trace = nw.first_bad_step
    data = next(r for r in trace.records if r.phase is Phase.INPUT and r.path == "Sequential")
    assert data.stat is not None and data.stat.finite  # the batch as the user passed it
    a = nw.first_anomaly
    assert (a.step, a.kind, a.path) == (2, AnomalyKind.FORWARD, "Sequential")
    assert a.op is not None and a.op.op == "aten.div.Tensor"
    assert a.op.source == _line_of(standardize, "x.std(1")
    assert _top(nw).code == "NW111"


def test_a_replay_runs_the_users_hooks_that_followed_the_recorded_inputs() -> None:
    """``ops.call_forward`` runs the pre-hooks after the one that saw the inputs (the
    inputs went through those before it), every user forward hook, no hook of nanwatch's."""
    lin = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(2))
    first = lin.register_forward_pre_hook(lambda m, a: (a[0] + 1,))
    lin.register_forward_pre_hook(lambda m, a: (a[0] * 10,))
    lin.register_forward_hook(lambda m, a, out: out - 1)
    x = torch.ones(1, 2)
    try:
        with nanwatch.watch(lin, postmortem=False):  # nanwatch's hooks: left out of replays
            got = {
                "caller": ops.call_forward(lin, (x,), {}, pre_hooks=True),
                "after the first": ops.call_forward(lin, (x,), {}, pre_hooks=first.id),
                "forward's own": ops.call_forward(lin, (x,), {}, pre_hooks=False),
            }
            assert torch.equal(lin(x), got["caller"])
    finally:
        lin._forward_pre_hooks.clear()
        lin._forward_hooks.clear()
    assert {k: v.tolist() for k, v in got.items()} == {
        "caller": [[19.0, 19.0]],
        "after the first": [[9.0, 9.0]],
        "forward's own": [[0.0, 0.0]],
    }


# ---------------------------------------------------------------- state nanwatch does not watch


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.body(x)))


def test_a_head_replaced_after_attach_with_a_nan_weight_is_named() -> None:
    """Fine-tuning swaps the head (``model.fc = nn.Linear(8, 5)``) inside the watch block;
    its weight holds a NaN. The replay made the NaN again from the weight, but no op created
    it, and that was reported as a replay that 'produced no NaN or inf' (NW404)."""
    torch.manual_seed(0)
    model = Net()

    def swap(step: int) -> Any:
        if step != 2:
            return None
        model.fc = nn.Linear(8, 5)
        with torch.no_grad():
            model.fc.weight[2, 4] = math.nan
        return torch.optim.SGD(model.parameters(), lr=0.05)

    nw = _run(model, nn.CrossEntropyLoss(), _batches(4, (4, 6), 3), before=swap)
    a = nw.first_anomaly
    assert (a.step, a.kind, a.parameter, a.transient) == (
        2,
        AnomalyKind.PARAMETER,
        "fc.weight",
        None,
    )
    writer = next(n.data for n in nw.first_bad_step.notes if n.kind == "weight_writer")
    assert (writer["optimizer"], writer["after_optimizer"]) == (None, None)  # never stepped
    d = _top(nw)
    assert (d.code, d.parameter) == ("NW301", "fc.weight")


def test_a_nan_weight_in_a_traced_submodule_is_named_with_its_last_update() -> None:
    """A ``torch.jit.trace``'d feature extractor cannot be hooked; a NaN written into its
    weight after an SGD step surfaced in the next module's input as a transient (NW404)."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.trace is deprecated
        feat = torch.jit.trace(nn.Sequential(nn.Linear(6, 8), nn.Tanh()), torch.randn(2, 6))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.feat = feat
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.feat(x)
            return self.head((h - h.mean(1, keepdim=True)) / h.std(1, keepdim=True))

    model = Model()

    def corrupt(step: int) -> None:
        if step == 2:
            with torch.no_grad():
                next(model.feat.parameters())[2, 3] = math.nan

    with pytest.warns(RuntimeWarning, match="feat is a torch.jit.ScriptModule"):
        nw = _run(model, nn.CrossEntropyLoss(), _batches(4, (4, 6), 3), before=corrupt)
    a = nw.first_anomaly
    assert (a.step, a.kind, a.parameter) == (2, AnomalyKind.PARAMETER, "feat.0.weight")
    writer = next(n.data for n in nw.first_bad_step.notes if n.kind == "weight_writer")
    assert writer["after_optimizer"] == "SGD"  # SGD left it finite; the write came after
    assert _top(nw).code == "NW301"


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("gain", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def test_a_nan_buffer_of_a_submodule_assigned_after_attach_is_module_state() -> None:
    """A submodule set after attach holds a NaN buffer. Only the model's own parameters and
    buffers were looked at, so it was a transient (NW404); the new submodule is now hooked
    at the next step's first call, under its name, and its own forward reads the buffer."""
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(6, 8)
            self.scale: nn.Module = nn.Identity()
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.scale(self.body(x)))

    model = Model()

    def add(step: int) -> None:
        if step == 2:
            model.scale = Scale()
            model.scale.gain[5] = math.nan

    nw = _run(model, nn.CrossEntropyLoss(), _batches(4, (4, 6), 3), before=add)
    a = nw.first_anomaly
    assert (a.step, a.path, a.transient) == (2, "scale", None)
    d = _top(nw)
    assert d.code == "NW405"
    assert d.evidence[0] == "scale.gain (buffer, float32) holds NaN"


class Shift(nn.Module):
    """Adds a tensor it holds in a list: no parameter, buffer or attribute shows it."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.tables = [table]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.tables[0]


def test_a_replay_that_makes_the_nan_again_is_no_transient_even_with_no_tensor_found() -> None:
    """The replay's output held the NaN again: whatever it read, the fault repeats, so it
    is not a transient hardware fault (NW404), even when no tensor of the module shows it."""
    torch.manual_seed(0)
    table = torch.zeros(8)
    model = nn.Sequential(nn.Linear(6, 8), Shift(table), nn.Linear(8, 3))

    def corrupt(step: int) -> None:
        if step == 2:
            table[3] = math.nan

    nw = _run(model, nn.CrossEntropyLoss(), _batches(4, (4, 6), 3), before=corrupt)
    a = nw.first_anomaly
    assert (a.step, a.path, a.transient, a.op) == (2, "1", None, None)
    assert "NW404" not in [d.code for d in nw.first_bad_step.diagnoses]


# ---------------------------------------------------------------- BatchNorm in eval


def bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


def test_batchnorm_reading_a_nan_running_var_in_eval_is_named() -> None:
    """In eval BatchNorm normalizes with its running statistics; one holding NaN made NaN
    of finite inputs, but BatchNorm was taken as unable to, and the NaN was blamed on the
    AdaptiveAvgPool2d after it (NW100)."""
    model, crit = bn_model(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for x, y in _batches(3, (4, 3, 8, 8), 3):
            crit(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
        with torch.no_grad():
            model[1].running_var[2] = math.nan
        model.eval()
        model(torch.randn(8, 3, 8, 8))
        nw.step()
    a = nw.first_anomaly
    assert (a.step, a.path, a.record.module_type) == (3, "1", "BatchNorm2d")
    d = _top(nw)
    assert (d.code, d.evidence[0]) == ("NW405", "1.running_var (buffer, float32) holds NaN")
    # the fix reaches the module from the model (get_submodule of a root's class name
    # raised), resets the running statistics and checks the buffer where it is written
    assert not d.fix.startswith("m = ")  # binds no name: the user's model may be m
    assert "torch.isfinite(model[1].running_var).all()" in d.fix
    exec(d.fix, {"model": model, "torch": torch})
    assert bool(torch.isfinite(model[1].running_var).all())


def test_batchnorm_in_training_is_still_bounded_by_its_input() -> None:
    """Training mode normalizes with the batch's statistics: not measured, as before; eval
    reads the running ones: measured."""
    model = bn_model()
    with nanwatch.watch(model, postmortem=False) as nw:
        model(torch.randn(4, 3, 8, 8))
        nw.step()
        model.eval()
        with torch.no_grad():
            model(torch.randn(4, 3, 8, 8))
        nw.step()
    skipped = [next(c.passthrough for c in t.calls if c.path == "1") for t in nw.history]
    assert skipped == [True, False]


# ---------------------------------------------------------------- the module that made the -inf


class Probit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = torch.sigmoid(self.lin(x))
        return math.sqrt(2) * torch.erfinv(2 * u - 1)


def test_the_module_that_made_the_neginf_is_replayed_too() -> None:
    """erfinv(2u - 1) at u == 0 is -inf; the MSE loss then made +inf. Only the loss was
    replayed, and the -inf was taken for a log of 0 (NW110)."""
    torch.manual_seed(0)
    model, crit = Probit(), nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for step in range(3):
            x = torch.randn(16, 4)
            if step == 2:
                x[5] = -40.0 * torch.sign(model.lin.weight[0]).detach()  # sigmoid -> 0
            crit(model(x), torch.randn(16, 1)).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    a = nw.first_anomaly
    # the anomaly is where the -inf was born (Probit), not where MSELoss made +inf of it
    assert (a.step, a.path) == (2, "Probit")
    assert a.op is not None
    made = a.op.chain()[0]
    assert (made.op, made.path, made.born) == ("aten.erfinv.default", "Probit", "-inf")
    assert made.source == _line_of(Probit.forward, "torch.erfinv")
    d = _top(nw)
    assert (d.code, d.path, d.op) == ("NW114", "Probit", "aten.erfinv")


class LogMag(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x.abs())


def test_a_log_of_zero_in_an_earlier_module_is_named_by_its_op() -> None:
    """A silent sample: log(|x|) is -inf, the next Linear sums -inf and +inf terms into
    NaN. The -inf's maker was never replayed: 'made by code nanwatch did not trace'."""
    torch.manual_seed(0)
    model = nn.Sequential(LogMag(), nn.Linear(8, 4))
    batches = _batches(3, (4, 8), 4)
    batches[2][0][1] = 0.0
    nw = _run(model, nn.CrossEntropyLoss(), batches)
    a = nw.first_anomaly
    assert (a.step, a.path) == (2, "0")  # where the -inf was born, not the Linear's NaN
    made = a.op.chain()[0]
    assert (made.op, made.path, made.born) == ("aten.log.default", "0", "-inf")
    assert made.source == _line_of(LogMag.forward, "torch.log")
    assert (_top(nw).code, _top(nw).path) == ("NW110", "0")
