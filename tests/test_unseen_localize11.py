"""Localization headlines found by user testing: a loss target a float16 teacher computed
in the step is not called bad data, and a value passed to a module the step called many
times (a hand-written ODE solver's function) says at which call it went bad."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.localize import computed_target, localize
from nanwatch.records import Anomaly, StepTrace
from tests._diagnoses import first_bad

torch.set_num_threads(1)


# ------------------------------ 1: a float16 teacher's soft targets went NaN


def _distill(half: bool) -> tuple[nanwatch.AnomalyError, Anomaly, StepTrace]:
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 5))
    with torch.no_grad():
        for layer in teacher:
            if isinstance(layer, nn.Linear):
                layer.weight.mul_(300)  # float16 hidden values past 65504: inf logits
    if half:
        teacher.half()
    student, kd = nn.Linear(8, 5), nn.KLDivLoss(reduction="batchmean")
    x = torch.randn(4, 8) * 3
    nw = nanwatch.watch(student, kd)
    try:
        with nw:
            with torch.no_grad():
                if half:  # a softmax of a row holding inf is NaN in the whole row
                    t = F.softmax(teacher(x.half()).float(), 1)
                else:  # a loaded target with one missing value
                    t = torch.rand(4, 5).softmax(1)
                    t[1, 2] = float("nan")
            kd(F.log_softmax(student(x), 1), t).backward()
    except nanwatch.AnomalyError as e:
        trace = first_bad(nw)
        assert trace.anomaly is not None
        return e, trace.anomaly, trace
    raise AssertionError("no anomaly")


def test_a_target_a_float16_teacher_computed_is_not_called_bad_data() -> None:
    err, a, trace = _distill(half=True)
    head = str(err).splitlines()[0]
    assert "in the target of KLDivLoss (input[1])" in head, head
    assert "computed by your code this step (a teacher or target network), not the data" in head
    assert "bad data" not in head and "in the input data" not in head
    assert a.origin == "computed-target"
    assert err.diagnoses[0].code == "NW401"
    found = computed_target(trace, a.record, trace.call(a.record.call))
    assert found is not None and found.soft and found.model_input.dtype == "float32"


def test_a_loaded_target_with_one_missing_value_is_still_bad_data() -> None:
    err, a, _ = _distill(half=False)
    head = str(err).splitlines()[0]
    assert "in the input data: input[1] of KLDivLoss" in head, head
    assert "(bad data, not a layer)" in head
    assert a.origin == "data"


# ------------------------------ 2: which call of a solver's function got the overflow


class _ODEFunc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.log_k = nn.Parameter(torch.zeros(4))
        with torch.no_grad():
            self.lin.weight.mul_(0.01)

    def forward(self, t: float, z: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(z)) - self.log_k.exp() * z


class _NODE(nn.Module):
    """A hand-written midpoint solver with dt far too large: the state grows ×41 a step,
    and the solver's own update (z + dt * k2) is the first to overflow."""

    def __init__(self) -> None:
        super().__init__()
        self.odefunc = _ODEFunc()

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        dt = 10.0
        for _ in range(40):
            k1 = self.odefunc(0.0, z)
            k2 = self.odefunc(0.0, z + dt / 2 * k1)
            z = z + dt * k2
        return z


def _ordinal(n: int) -> str:
    return f"{n}" + ("th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th"))


@pytest.mark.cpu_path(
    reason="a raise inside the forward; the accelerator path finishes the forward first"
)
def test_a_value_passed_to_a_module_called_many_times_names_the_call() -> None:
    torch.manual_seed(0)
    m = _NODE()
    nw = nanwatch.watch(m)
    try:
        with nw:
            m(torch.randn(2, 4)).sum().backward()
    except nanwatch.AnomalyError as e:
        head = str(e).splitlines()[0]
    else:
        raise AssertionError("no anomaly")
    trace = first_bad(nw)
    a = trace.anomaly
    assert a is not None and a.origin == "between-children" and a.record.path == "odefunc"
    calls = [c.id for c in trace.calls if c.path == "odefunc"]
    nth = calls.index(a.record.call) + 1
    assert nth > 2 and nth == len(calls)  # the step stopped there: no total is known
    assert "born in the forward code of _NODE itself" in head, head
    assert (
        f"in the value it passed to odefunc (input[1]), at the {_ordinal(nth)} call of odefunc "
        "in this step"
    ) in head, head


def test_a_step_recorded_to_its_end_gives_the_number_of_calls() -> None:
    torch.manual_seed(0)
    m = _NODE()
    with nanwatch.watch(m, on_anomaly="record") as nw:
        m(torch.randn(2, 4)).sum().backward()
    trace = first_bad(nw)
    a = localize(trace)  # the whole step's records, as a saved report holds them
    assert a is not None and a.origin == "between-children"
    head = a.summary
    calls = [c.id for c in trace.calls if c.path == "odefunc"]
    nth = calls.index(a.record.call) + 1
    assert len(calls) == 80 and nth < 80
    assert f", at the {_ordinal(nth)} of 80 calls of odefunc in this step" in head, head


class _Once(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * 1e30 * 1e30)


def test_a_module_called_once_gets_no_call_number() -> None:
    m = _Once()
    try:
        with nanwatch.watch(m):
            m(torch.ones(2, 4)).sum().backward()
    except nanwatch.AnomalyError as e:
        head = str(e).splitlines()[0]
    else:
        raise AssertionError("no anomaly")
    assert "in the value it passed to lin (input[0])" in head, head
    assert " call" not in head, head
