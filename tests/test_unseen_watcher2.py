"""The watcher in forked children (DataLoader workers), LBFGS closures, and the optimizer
facts the rules read (group names, initial_lr, centered, the attach-time weight check,
non-finite optimizer state). Each on a tiny real training loop on CPU."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import nanwatch
from nanwatch.errors import GuardError
from nanwatch.records import LOSS_PATH, Note, StepTrace

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")


def _notes(traces: Any, kind: str) -> list[Note]:
    return [n for t in traces for n in t.notes if n.kind == kind]


# ---------------------------------------------------------------- forked children
class _OneHotData(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample 5 has label 3 of 3 classes: F.one_hot raises in the worker."""

    def __init__(self) -> None:
        self.x = torch.randn(8, 4)
        self.y = torch.tensor([0, 1, 2, 0, 1, 3, 2, 0])

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], F.one_hot(self.y[i], num_classes=3).float()


@needs_fork
def test_forked_worker_raises_torch_error_not_a_guard() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    crit = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = DataLoader(_OneHotData(), batch_size=2, num_workers=2, multiprocessing_context="fork")
    with (
        pytest.raises(RuntimeError) as info,
        nanwatch.watch(model, crit, on_anomaly="record", postmortem=False),
    ):
        for x, y in dl:
            crit(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert not isinstance(info.value, GuardError)
    assert "Class values must be smaller than num_classes." in str(info.value)


class _HookCount(Dataset[torch.Tensor]):
    """Each sample: what of nanwatch the worker process holds (hooks on the watched module,
    global module hooks, the backward tap), and a forward of the watched module there."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        import torch.nn.modules.module as mm

        with torch.no_grad():
            self.model(torch.ones(1, 2))
        return torch.tensor(
            [
                len(self.model._forward_hooks) + len(self.model._forward_pre_hooks),
                len(mm._global_forward_hooks) + len(mm._global_forward_pre_hooks),
                int(torch.autograd.backward is not _BACKWARD),
            ]
        )


_BACKWARD = torch.autograd.backward


@needs_fork
@pytest.mark.parametrize("everything", [False, True])
def test_forked_worker_holds_no_hooks(everything: bool) -> None:
    model = nn.Linear(2, 2)
    dl = DataLoader(_HookCount(model), batch_size=2, num_workers=2, multiprocessing_context="fork")
    nw = (
        nanwatch.watch_all(on_anomaly="record", postmortem=False)
        if everything
        else nanwatch.watch(model, on_anomaly="record", postmortem=False)
    )
    with nw:
        got = [b.tolist() for b in dl]
        model(torch.ones(1, 2)).sum().backward()
    assert got == [[[0, 0, 0], [0, 0, 0]], [[0, 0, 0], [0, 0, 0]]]
    # the main process's forward alone (a worker's would be a second call of the module)
    assert [c.path for t in nw.history for c in t.calls if c.path != LOSS_PATH] == ["Linear"]


# ---------------------------------------------------------------- LBFGS closures
@pytest.mark.parametrize("explicit", [True, False])
def test_lbfgs_closure_evaluations_are_one_step(explicit: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    crit = nn.MSELoss()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for step in range(5):
            x = torch.randn(16, 4)
            y = x.sum(1, keepdim=True)
            if step == 3:
                x[2, 1] = float("nan")

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                opt.zero_grad()
                loss = crit(model(x), y)
                loss.backward()
                return loss

            opt.step(closure)  # type: ignore[no-untyped-call]
            if explicit:
                nw.step()
            if nw.first_anomaly is not None:
                break
    assert step == 3
    assert nw.first_anomaly is not None
    assert nw.first_anomaly.step == 3


# ---------------------------------------------------------------- optimizer facts
def test_optimizer_note_names_groups_initial_lr_and_centered() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    crit = nn.MSELoss()
    opt = torch.optim.RMSprop(
        [
            {"params": model[0].parameters(), "lr": 1e-3},
            {"params": model[2].parameters(), "lr": 1e-2, "centered": True},
        ]
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        x = torch.randn(8, 4)
        crit(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
        sched.step()
        trace: StepTrace = nw.step()
    (note,) = _notes([trace], "optimizer")
    groups = note.data["groups"]
    assert [g["names"] for g in groups] == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
    assert [g["initial_lr"] for g in groups] == [1e-3, 1e-2]
    assert [g["centered"] for g in groups] == [False, True]


def test_weight_writer_says_finite_at_attach_for_a_data_write() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    crit = nn.MSELoss()
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for step in range(3):
            x = torch.randn(8, 4)
            crit(model(x), x.sum(1, keepdim=True)).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-1e38 if step == 1 else -0.1)  # .data: no version
                    p.grad = None
            nw.step()
    writers = _notes([*nw.history], "weight_writer")
    assert writers
    assert {n.data["finite_at_attach"] for n in writers} == {True}


def test_weight_writer_says_not_finite_at_attach_for_a_loaded_nan() -> None:
    model = nn.Linear(4, 1)
    with torch.no_grad():
        model.weight[0, 2] = float("nan")
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(torch.ones(2, 4))
        trace = nw.step()
    writers = _notes([trace], "weight_writer")
    assert [(n.data["parameter"], n.data["finite_at_attach"]) for n in writers] == [
        ("weight", False)
    ]


def test_nan_in_adam_state_is_named() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    crit = nn.MSELoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(8, 4)
    crit(model(x), x.sum(1, keepdim=True)).backward()
    opt.step()
    opt.zero_grad()
    opt.state[model[0].weight]["exp_avg_sq"][1, 2] = float("nan")  # a resumed bad checkpoint
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for _ in range(1):  # one update: the NaN reaches the other weights' state at the next
            x = torch.randn(8, 4)
            crit(model(x), x.sum(1, keepdim=True)).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    notes = _notes([*nw.history], "optimizer_state")
    assert [(n.path, n.data["optimizer_state_bad"]) for n in notes] == [
        ("Adam", [["0.weight", "exp_avg_sq"]])
    ]
    assert nw.first_bad_step is not None
    titles = [d.title for d in nw.first_bad_step.diagnoses]
    assert "Non-finite optimizer state" in titles


# ---------------------------------------------------------------- a watched loss module
class _EntropyLoss(nn.Module):
    def forward(self, p: torch.Tensor) -> torch.Tensor:
        return -torch.special.xlogy(p, p).sum(-1).mean()


def test_a_backward_nan_born_in_a_watched_loss_module_names_its_op() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    crit = _EntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        p = torch.relu(model(torch.randn(8, 4)))  # exact zeros: d/dp xlogy(p, p) = inf
        crit(p).backward()
        opt.step()
        trace = nw.step()
    assert [(e.path, e.op) for e in trace.ops] == [("_EntropyLoss", "aten.xlogy")]
    assert trace.anomaly is not None
    assert trace.anomaly.op is not None
    assert trace.anomaly.op.op == "aten.xlogy"
    assert [d.code for d in trace.diagnoses][:1] == ["NW110"]
    assert trace.diagnoses[0].title == "Gradient of xlogy at 0"
