"""Faults and memory (issue 9): nanwatch must never be what breaks a training job."""

from __future__ import annotations

import contextlib
import gc
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import nanwatch
from nanwatch import Phase
from nanwatch.rules import REGISTRY, rule
from tests import _tensors as _t
from tests import zoo


def _step(model: nn.Module, opt: torch.optim.Optimizer, nw: nanwatch.Watcher) -> None:
    loss = model(torch.randn(8, 16)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    nw.step()


def test_keyboard_interrupt_in_the_middle_of_a_flush(tmp_path: Path) -> None:
    calls = {"n": 0}

    @rule("NW990", title="interrupts the flush", severity="info", summary="test only")
    def interrupt(ctx: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # the user pressed Ctrl-C while rules ran

    try:
        model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with (
            pytest.raises(KeyboardInterrupt),
            nanwatch.watch(model, report_dir=str(tmp_path)) as nw,
        ):
            for _ in range(5):
                _step(model, opt, nw)
    finally:
        REGISTRY.pop("NW990", None)
    assert not nw.attached
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks
    assert torch.autograd.backward.__module__ == "torch.autograd"
    reports = list(tmp_path.glob("*.json"))
    assert reports, "the interrupted run left no report"
    report = nanwatch.Report.load(reports[0])
    assert report.error is not None and report.error["class"] == "keyboard-interrupt"
    # the watcher is usable again afterwards
    with nanwatch.watch(model, postmortem=False) as again:
        _step(model, opt, again)
    assert len(again.history) == 1


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor)


def test_memory_stays_flat_over_many_steps() -> None:
    """Once the ring is full and the caches are warm, more steps add no live tensors and no
    memory in nanwatch's own code (allocations fluctuate around zero).
    benchmarks/memory_soak.py runs 10,000 steps and reports RSS and the slope."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanwatch.watch(model, ring_size=16) as nw:
        for _ in range(100):  # warm every cache
            _step(model, opt, nw)
        tensors_before = _live_tensors()
        tracemalloc.start()
        for _ in range(40):  # the ring now holds only traced steps
            _step(model, opt, nw)
        gc.collect()
        snap_before = tracemalloc.take_snapshot()
        for _ in range(200):
            _step(model, opt, nw)
        gc.collect()
        snap_after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        tensors_after = _live_tensors()
    assert len(nw.history) == 16
    assert tensors_after <= tensors_before
    ours = [
        s
        for s in snap_after.compare_to(snap_before, "filename")
        if "nanwatch" in s.traceback[0].filename
    ]
    growth = sum(s.size_diff for s in ours)
    # autograd frees nodes (and the hooks nanwatch put on them) when it likes: a few KB
    # come and go; one leaked record a step would be ~90 KB here
    assert growth < 48 * 1024, f"nanwatch grew by {growth} bytes over 200 steps: {ours[:5]}"


def test_a_report_directory_that_cannot_be_written_never_hides_the_users_error(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the report directory should be")
    model = nn.Linear(2, 2)
    err = ValueError("the user's own error")
    with (
        pytest.warns(RuntimeWarning, match="could not write"),
        pytest.raises(ValueError) as info,
        nanwatch.watch(model, report_dir=str(blocker / "reports")),
    ):
        model(torch.randn(1, 2))
        raise err
    assert info.value is err


def test_under_fake_tensors_the_hooks_stay_out_of_the_way() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
        with nanwatch.watch(model, postmortem=False) as nw:
            model(torch.randn(2, 3)).sum().backward()
            nw.step()
    assert nw.faults == []
    assert nw.history[-1].records == []


def test_an_internal_fault_under_warnings_as_errors_does_not_stop_training(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import warnings

    def broken(*args: Any, **kwargs: Any) -> None:
        raise KeyError("boom")

    monkeypatch.setattr(nanwatch.Watcher, "_record_outputs", broken)
    model = nn.Sequential(nn.Linear(3, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with nanwatch.watch(model, postmortem=False) as nw:
            model(torch.randn(2, 3)).sum().backward()
            nw.step()
    err = capsys.readouterr().err
    assert nw.faults and "internal error" in err
    # the message asks for the traceback that -W error gives: it is there, nanwatch's own
    assert "Traceback (most recent call last)" in err and "in broken" in err
    assert "KeyError: 'boom'" in err


def test_a_compiled_submodule_is_refused_with_the_way_out() -> None:
    model = nn.Sequential(nn.Linear(3, 3))
    model.add_module("block", torch.compile(nn.Linear(3, 3)))
    with pytest.raises(nanwatch.ConfigError, match=r"torch\.compile") as info:
        nanwatch.watch(model).attach()
    assert not model[0]._forward_hooks
    # the way out names the submodule, and runs when pasted
    assert "model.block = model.block._orig_mod" in str(info.value)
    model.block = model.block._orig_mod
    with nanwatch.watch(model, postmortem=False):
        model(torch.randn(2, 3))


def test_a_users_torch_function_mode_does_not_see_nanwatchs_own_ops() -> None:
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    model = nn.Sequential(nn.Linear(3, 3), nn.GELU())
    with nanwatch.watch(model, postmortem=False) as nw, Count() as mode:
        model(torch.randn(2, 3))
        nw.step()
    assert "aminmax" not in mode.names
    assert any(r.stat is not None for r in nw.history[-1].records)


def test_a_full_disk_is_a_warning_and_leaves_no_half_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    real_fsync = os.fsync

    def full(fd: int) -> None:  # the write "succeeds" into the page cache; the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    model = nn.Linear(2, 2)
    err = RuntimeError("the user's crash")
    monkeypatch.setattr(os, "fsync", full)
    with (
        pytest.warns(RuntimeWarning, match="No space left on device"),
        pytest.raises(RuntimeError) as info,
        nanwatch.watch(model, report_dir=str(tmp_path)),
    ):
        model(torch.randn(1, 2))
        raise err
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert info.value is err
    assert list(tmp_path.iterdir()) == []  # no half-written report, no temporary file


def test_the_report_notes_a_fault_of_nanwatchs_own(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise KeyError("boom")

    model = nn.Sequential(nn.Linear(3, 3))
    monkeypatch.setattr(nanwatch.Watcher, "_check_grads", broken)
    with (
        pytest.warns(RuntimeWarning, match="internal error"),
        nanwatch.watch(model, postmortem=False) as nw,
    ):
        model(torch.randn(2, 3)).sum().backward()
        nw.step()
    report = nw.report
    assert ("end-of-backward check", "KeyError: 'boom'") in report.faults
    assert "nanwatch faults" in str(report) and "end-of-backward check" in str(report)


def test_overlapping_watchers_on_one_model() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    before = {n: dict(getattr(model[0], n)) for n in ("_forward_hooks", "_forward_pre_hooks")}
    original_backward = torch.autograd.backward
    a = nanwatch.watch(model, postmortem=False).attach()
    b = nanwatch.watch(model, postmortem=False).attach()
    model(torch.randn(2, 3)).sum().backward()
    model.zero_grad()  # the update: B, which has not called step() yet, begins a new step
    a.step()
    a.detach()  # A goes first although it came first: B keeps watching
    model(torch.randn(2, 3)).sum().backward()
    b.step()
    b.step()
    b.detach()
    assert len(a.history) == 1
    # B's first step() makes everything since its attach its first step (README, Steps):
    # both forwards are in it, and its second step() closed an empty one
    assert [len(t.records) > 0 for t in b.history][:2] == [True, False]
    assert {n: dict(getattr(model[0], n)) for n in before} == before
    assert torch.autograd.backward is original_backward


@pytest.mark.slow
def test_a_model_compiled_after_watch_is_said_to_be_unwatched() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    with (
        # a NanwatchWarning: the documented filter on that category silences it
        pytest.warns(nanwatch.NanwatchWarning, match="torch.compile"),
        nanwatch.watch(model, postmortem=False) as nw,
    ):
        compiled = torch.compile(model, backend="eager")
        for _ in range(2):
            compiled(torch.randn(4, 3)).pow(2).mean().backward()
            nw.step()
    # its module calls were not watched; its parameters' gradients are still read
    assert not any(
        r.path == "0" and r.phase.value != "gradient" for t in nw.history for r in t.records
    )
    assert any(r.phase.value == "gradient" for r in nw.history[-1].records)


@pytest.mark.slow
def test_a_compiled_model_trained_with_a_watched_criterion_is_said_to_be_unwatched() -> None:
    """The criterion runs in eager mode and makes the loss: that must not hide that the
    model itself ran compiled and nothing of it was watched."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    criterion = nn.CrossEntropyLoss()
    with (
        pytest.warns(RuntimeWarning, match="torch.compile"),
        nanwatch.watch(model, criterion, postmortem=False) as nw,
    ):
        compiled = torch.compile(model, backend="eager")
        for _ in range(2):
            criterion(compiled(torch.randn(4, 3)), torch.tensor([0, 1, 0, 1])).backward()
            nw.step()
    assert not any(
        r.path == "0" and r.phase.value == "forward" for t in nw.history for r in t.records
    )


class Emit(nn.Module):
    """Returns the tensor it was built with, whatever it is given."""

    def __init__(self, out: torch.Tensor) -> None:
        super().__init__()
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out


@pytest.mark.parametrize("dtype", _t.ALL_DTYPES, ids=_t.dtype_id)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_the_watcher_records_what_a_float64_reference_says(
    dtype: torch.dtype, data: st.DataObject
) -> None:
    """A one-module model fed an awkward tensor and returning another like it, under each
    mode, read at once (CPU) or at the flush (the accelerator path): the input (the batch:
    with its bad samples) and the output are recorded with the reference's min/max and
    finiteness, and their counts wherever counted; a NaN or +inf is the first anomaly, found
    in the batch; nanwatch says nothing and has no fault of its own."""
    case = data.draw(_t.cases((dtype,)), label="case")
    mode = data.draw(st.sampled_from(["sentinel", "watch", "forensic"]), label="mode")
    deferred = data.draw(st.booleans(), label="deferred")
    ref = _t.reference(case)
    model = Emit(case.make())
    nw = nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False)
    nw._defer_cpu = deferred  # statistics kept "on the device" until the step's flush
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nw:
            out = model(case.make())
            nw.step()
    assert not [str(w.message) for w in caught if "nanwatch" in str(w.message)]
    assert not nw.faults
    recs = {(r.phase, r.role): r for r in nw.history[-1].records if r.path == "Emit"}
    batch, output = recs[(Phase.INPUT, "input[0]")], recs[(Phase.FORWARD, "output")]
    assert output.dtype == _t.dtype_id(dtype) and output.shape == tuple(out.shape)
    for rec in (batch, output):
        s = rec.stat
        if ref.numel == 0:
            assert s is None, rec
            continue
        assert s is not None and s.numel == ref.numel, rec
        assert s.finite is ref.finite, (rec, ref)
        assert _t.close(case, s.min, ref.min) and _t.close(case, s.max, ref.max), (rec, ref)
        if s.counted:
            assert (s.nan, s.posinf, s.neginf, s.zeros) == (
                ref.nan, ref.posinf, ref.neginf, ref.zeros,
            ), (rec, ref)  # fmt: skip
            assert _t.close(case, s.finite_amax, ref.finite_amax), (rec, ref)
        else:  # counts only for bad tensors, and on the accelerator path not at all
            assert ref.finite or deferred, rec
    if not ref.finite and ref.bad_rows is not None:  # the samples of the batch to look at
        assert batch.stat is not None and batch.stat.bad_row_count == len(ref.bad_rows)
        assert list(batch.stat.bad_rows or ()) == ref.bad_rows[:8]
    a = nw.first_anomaly
    if ref.finite or ref.numel == 0:
        assert a is None, a
    elif ref.nan or ref.posinf:  # -inf alone is a mask's, not an anomaly in itself
        assert a is not None and a.record.index == batch.index, a


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so NaNs compare too (and -0.0 differs from 0.0)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _train(
    watch: dict[str, Any] | None, spike_at: int | None
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], torch.Tensor, nanwatch.Watcher | None]:
    """Six SGD steps of a model with BatchNorm and Dropout, data drawn from the same global
    RNG; with ``spike_at``, that step divides by zero inside the gated dropout."""
    torch.manual_seed(11)
    model = zoo.Regularized()
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    outs: list[torch.Tensor] = []
    nw = None
    if watch is not None:
        nw = nanwatch.watch(model, criterion, on_anomaly="record", postmortem=False, **watch)
    with nw if nw is not None else contextlib.nullcontext():
        for step in range(6):
            model.gated.gate.fill_(0.0 if step == spike_at else 1.0)
            x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 4, (6,))
            out = model(x)
            criterion(out, y).backward()
            opt.step()
            opt.zero_grad()
            outs.append(out.detach().clone())
            if nw is not None:
                nw.step()
    return outs, model.state_dict(), torch.get_rng_state(), nw


@pytest.mark.parametrize("spike", [False, True], ids=["clean", "replayed-anomaly"])
@pytest.mark.parametrize(
    "watch",
    [
        {"mode": "sentinel"},
        {"mode": "watch"},
        {"mode": "forensic"},
        {"mode": "watch", "sample_every": 3},
    ],
    ids=["sentinel", "watch", "forensic", "sample_every=3"],
)
def test_training_is_bit_identical_to_an_unwatched_run(watch: dict[str, Any], spike: bool) -> None:
    """Outputs of every step, weights, BatchNorm's running statistics and the RNG state
    after six SGD steps are the same bytes with or without the watcher, whatever its mode;
    also when an anomaly makes it replay a module whose forward draws dropout masks."""
    spike_at = 4 if spike else None
    ref_outs, ref_state, ref_rng, _ = _train(None, spike_at)
    outs, state, rng, nw = _train(watch, spike_at)
    assert nw is not None and len(nw.history) == 6  # it watched every step
    for step, (got, want) in enumerate(zip(outs, ref_outs, strict=True)):
        assert torch.equal(_bits(got), _bits(want)), f"the output of step {step} differs"
    assert state.keys() == ref_state.keys()
    for name, want in ref_state.items():
        assert torch.equal(_bits(state[name]), _bits(want)), name
    assert torch.equal(rng, ref_rng), "nanwatch drew from the global RNG"
    if spike:
        a = nw.first_anomaly
        assert a is not None and a.step == 4, a
        if watch != {"mode": "sentinel"} and 4 % watch.get("sample_every", 1) == 0:
            assert a.path == "gated" and a.op is not None, a  # replayed to name the op
    else:
        assert nw.first_anomaly is None


class _Running(nn.Module):
    """Updates a buffer in place, then multiplies by it (autograd saves it for backward),
    and divides by zero: its replay writes the buffer again."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("ema", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ema.mul_(0.5).add_(1.0)
        return self.fc(x) * self.ema / 0.0


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_a_replay_leaves_the_buffers_backward_needs_as_they_were(mode: str) -> None:
    """The anomaly is replayed to name its op; the buffer the replay wrote again is put
    back with its value and its autograd version, so the user's backward still runs."""
    model = nn.Sequential(_Running(), nn.Linear(3, 1))
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        model(torch.randn(4, 3)).sum().backward()  # raised "modified by an inplace operation"
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.path == "0" and a.op is not None and "div" in a.op.op
    assert torch.equal(model[0].ema, torch.ones(3))  # one real forward, not two
    assert model[0].fc.weight.grad is not None


def _users_hook(module: nn.Module, args: Any, output: Any) -> None:
    """A user's own forward hook: a module-level function, so a pickle can keep it."""


def _hook_ids(model: nn.Module) -> set[int]:
    names = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
    return {k for m in model.modules() for n in names for k in getattr(m, n)}


def test_a_copy_or_pickle_of_a_watched_model_carries_none_of_nanwatchs_hooks() -> None:
    """An EMA/teacher made with deepcopy, and torch.save(model), inside the block: pickling
    failed on the hooks (closures), and a deep copy kept them, so its calls were recorded as
    the watched model's (and a NaN only the copy had was blamed on the model) long after the
    block. The user's own hook goes with the copy; the live model keeps nanwatch's."""
    import copy
    import io
    import pickle

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    criterion = nn.CrossEntropyLoss()  # guarded: a guard's hooks too
    user = model[0].register_forward_hook(_users_hook)
    try:
        with nanwatch.watch(model, criterion, postmortem=False) as nw:
            ours = _hook_ids(model) - {user.id}
            assert ours
            ema = copy.deepcopy(model)
            assert _hook_ids(ema) == {user.id}
            assert not _hook_ids(copy.deepcopy(criterion))
            data = pickle.dumps(model)
            assert b"nanwatch" not in data  # loading needs no nanwatch
            assert _hook_ids(pickle.loads(data)) == {user.id}
            torch.save(model, io.BytesIO())
            assert _hook_ids(model) - {user.id} == ours  # the live model is still watched
            before = len(nw.trace.calls)
            with torch.no_grad():
                ema[0].weight[0, 0] = float("nan")
                teacher = ema(torch.randn(3, 4)).nan_to_num()
            assert len(nw.trace.calls) == before  # the copy's calls are not the model's
            loss = criterion(model(torch.randn(3, 4)) + teacher, torch.tensor([0, 1, 0]))
            loss.backward()
            assert len(nw.trace.calls) > before
            nw.step()
        assert nw.first_anomaly is None
    finally:
        user.remove()


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_children_called_one_by_one_are_not_taken_for_a_compiled_model(mode: str) -> None:
    """checkpoint_sequential (or a loop over a Sequential) calls the root's children, never
    the root: in sentinel mode, where only roots are hooked, that is no compiled model."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    criterion = nn.MSELoss()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(model, criterion, mode=mode, postmortem=False) as nw:
            for _ in range(2):
                out = torch.utils.checkpoint.checkpoint_sequential(
                    model, 2, torch.randn(8, 4), use_reentrant=False
                )
                criterion(out, torch.randn(8, 1)).backward()
                nw.step()
    assert nw.first_anomaly is None
    assert not [w for w in caught if "torch.compile" in str(w.message)]
