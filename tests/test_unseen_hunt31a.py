"""Sentinel hooks the roots alone: a NaN born in a child is pinpointed by replaying the root,
and the replay names the child whose op made it, as watch mode does. A warn run that goes on
past its first anomaly: a later one is replayed when the earlier replay does not already
say which code made it (another child of a sentinel root, the backward of a module whose
forward was replayed), so each step's diagnosis names its own op."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch import ops

torch.set_num_threads(1)


class Shifted(nn.Module):
    """``how`` picks the code that goes bad: the log of a value shifted below zero, the
    sqrt of a value shifted below zero, or the sqrt of exact zeros (finite forward, its
    gradient inf times 0: NaN)."""

    def __init__(self) -> None:
        super().__init__()
        self.how = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "log":
            return torch.log(x - 1000.0)
        if self.how == "sqrt":
            return torch.sqrt(x - 1000.0)
        if self.how == "sqrt0":
            return x + torch.sqrt((x - x.detach()) ** 2)
        return x


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), Shifted(), nn.Linear(8, 8), Shifted(), nn.Linear(8, 2))


def _run(model: nn.Module, mode: str, steps: list[tuple[str, str]]) -> nanwatch.Watcher:
    """One step for each (code of model[1], code of model[3]); no update: the weights stay
    finite, so each anomaly is that step's own."""
    with (
        pytest.warns(RuntimeWarning, match="^nanwatch: step "),  # once, at the first
        nanwatch.watch(model, mode=mode, on_anomaly="warn", postmortem=False) as nw,
    ):
        for first, second in steps:
            model[1].how, model[3].how = first, second
            model(torch.randn(4, 8)).sum().backward()
            model.zero_grad()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_nan_born_in_a_child_names_that_child_in_both_modes(mode: str) -> None:
    model = _model()
    nw = _run(model, mode, [("", ""), ("log", "")])
    a = nw.first_anomaly
    assert a is not None and a.path == "1", a.summary
    assert a.op is not None and a.op.op == "aten.log.default" and a.op.path == "1"
    d = nw.history[-1].diagnoses[0]
    assert (d.code, d.path, d.op) == ("NW110", "1", "aten.log"), d.headline
    if mode == "sentinel":  # seen in the root's output, born in the child
        assert a.summary.startswith(
            "NaN born in the forward of 1 (Shifted), inside Sequential; "
            "first seen in Sequential (forward, output)"
        ), a.summary


def test_a_sentinel_replay_names_the_innermost_module_of_a_nested_child() -> None:
    torch.manual_seed(0)
    inner = Shifted()
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), inner), nn.Linear(8, 2))
    inner.how = "log"
    with nanwatch.watch(model, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
        model(torch.randn(4, 8)).sum().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.path == "1.1", a.summary
    assert nw.history[-1].diagnoses[0].path == "1.1"


def test_a_sentinel_warn_run_names_the_sibling_child_of_a_later_anomaly() -> None:
    """Both NaNs are first seen in the root's output: the second is another child's, and
    only a replay of the root tells which (it was NW100 in the root, not replayed again)."""
    nw = _run(_model(), "sentinel", [("log", ""), ("", ""), ("", "sqrt")])
    first, second = (t for t in nw.history if t.anomaly is not None)
    assert first.anomaly is not None and second.anomaly is not None
    assert (first.step, first.anomaly.path, first.diagnoses[0].code) == (0, "1", "NW110")
    assert (second.step, second.anomaly.path) == (2, "3"), second.anomaly.summary
    d = second.diagnoses[0]
    assert (d.code, d.path, d.op) == ("NW112", "3", "aten.sqrt"), d.headline


def test_a_sentinel_warn_run_names_the_same_child_again() -> None:
    nw = _run(_model(), "sentinel", [("log", ""), ("", ""), ("log", "")])
    bad = [t for t in nw.history if t.anomaly is not None]
    assert [t.step for t in bad] == [0, 2]
    for t in bad:
        assert t.anomaly is not None and t.anomaly.path == "1", t.anomaly.summary
        assert (t.diagnoses[0].code, t.diagnoses[0].op) == ("NW110", "aten.log")


class _Root(nn.Module):
    """A root with code of its own between its children."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), Shifted(), nn.Linear(8, 2)
        self.own = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.own:
            h = torch.log(h - 1000.0)
        return self.c(self.b(h))


def test_a_sentinel_root_blamed_for_its_own_code_is_replayed_for_a_childs_later() -> None:
    """The first replay blamed the root's own code: its path does not tell that the next
    anomaly is its code's again, since its children are not hooked."""
    torch.manual_seed(0)
    root = _Root()
    with (
        pytest.warns(RuntimeWarning, match="^nanwatch: step "),
        nanwatch.watch(root, mode="sentinel", on_anomaly="warn", postmortem=False) as nw,
    ):
        for own, how in [(True, ""), (False, "sqrt")]:
            root.own, root.b.how = own, how
            root(torch.randn(4, 8)).sum().backward()
            root.zero_grad()
            nw.step()
    first, second = nw.history
    assert first.anomaly is not None and first.anomaly.path == "_Root"
    assert first.diagnoses[0].op == "aten.log"
    assert second.anomaly is not None and second.anomaly.path == "b", second.anomaly.summary
    assert (second.diagnoses[0].code, second.diagnoses[0].op) == ("NW112", "aten.sqrt")


def test_a_backward_nan_in_a_module_whose_forward_was_replayed_is_pinpointed() -> None:
    """Watch mode: the forward replay of step 0 does not stand for the module's backward
    (it was NW100 with no op: one set of replayed paths for both)."""
    nw = _run(_model(), "watch", [("log", ""), ("", ""), ("sqrt0", "")])
    first, second = (t for t in nw.history if t.anomaly is not None)
    assert first.diagnoses[0].op == "aten.log"
    a = second.anomaly
    assert a is not None and a.kind is nanwatch.AnomalyKind.BACKWARD and a.path == "1"
    assert a.op is not None and a.op.op == "aten.sqrt", a.summary
    assert second.diagnoses[0].code == "NW112"


def test_a_replay_that_raises_in_a_child_leaves_no_path_pushed() -> None:
    """A child whose forward raises: its forward hook never runs, and the path its
    pre-hook pushed for the replay is popped all the same."""

    class Raises(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("bad input")

    model = nn.Sequential(nn.Linear(2, 2), Raises())
    names = {model[0]: "0", model[1]: "1"}
    result = ops.replay(model, (torch.ones(1, 2),), {}, path="root", names=names.get)
    assert result.error == "ValueError: bad input"
    assert ops.replay_path() is None


def test_nw_replay_in_sentinel_names_the_child_whose_op_made_the_nan() -> None:
    """No replay when it was found (pinpoint=False): ``nw.replay(step_fn)`` runs the step
    again, and names the child as the replay in the root's hook does."""
    model = _model()
    model[1].how = "log"
    x = torch.randn(4, 8)
    with nanwatch.watch(
        model, mode="sentinel", on_anomaly="record", postmortem=False, pinpoint=False
    ) as nw:
        model(x).sum().backward()
        model.zero_grad()
        nw.step()
        a = nw.first_anomaly
        assert a is not None and a.path == "Sequential" and a.op is None
        result = nw.replay(lambda: model(x).sum().backward())
    first = result.first()
    assert first is not None and (first.op, first.path) == ("aten.log.default", "1")
    assert a.path == "1", a.summary
    assert a.summary.startswith("NaN born in the forward of 1 (Shifted), inside Sequential; ")
    d = nw.history[-1].diagnoses[0]
    assert (d.code, d.path, d.op) == ("NW110", "1", "aten.log"), d.headline
