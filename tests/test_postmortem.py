"""The post-mortem: a report on every kind of exception, the original exception unchanged,
the CUDA-error path without touching a tensor, KeyboardInterrupt and SIGTERM in a real
process, atomic writes, and a write failure that stays a warning."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import nanwatch
from nanwatch import postmortem, scenarios
from nanwatch.errors import AnomalyError
from nanwatch.postmortem import atomic_write, classify, install_signal_handlers
from nanwatch.render import render_text
from nanwatch.report import Report

#: torch.OutOfMemoryError came in 2.2; before it, only the CUDA one
_OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError

ROOT = Path(__file__).resolve().parent.parent
_NAME = re.compile(r"^nanwatch-\d{8}-\d{6}-rank(\d+)-step(\d+)(-\d+)?\.(json|html)$")


class NoTensorOps:
    """While ``armed``, any aten op (TorchDispatchMode: every read, copy or kernel of a
    tensor's data) raises, and so does, with ``strict``, any torch function on a tensor
    (TorchFunctionMode: metadata reads included). What was attempted is in ``violations``.
    This is what a dead CUDA context would do to the post-mortem, on CPU."""

    def __init__(self, *, strict: bool = False) -> None:
        self.strict = strict
        self.armed = False
        self.violations: list[str] = []
        outer = self

        class _Dispatch(TorchDispatchMode):
            def __torch_dispatch__(
                self, func: Any, types: Any, args: Any = (), kwargs: Any = None
            ) -> Any:
                if outer.armed:
                    outer.violations.append(f"aten op {func}")
                    raise RuntimeError(f"tensor op {func} after the device was lost")
                return func(*args, **(kwargs or {}))

        class _Function(TorchFunctionMode):
            def __torch_function__(
                self, func: Any, types: Any, args: Any = (), kwargs: Any = None
            ) -> Any:
                if outer.armed:
                    outer.violations.append(f"torch function {getattr(func, '__name__', func)}")
                    raise RuntimeError(f"torch function {func} after the device was lost")
                return func(*args, **(kwargs or {}))

        self._modes: list[Any] = [_Dispatch()] + ([_Function()] if strict else [])

    def __enter__(self) -> NoTensorOps:
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.armed = False
        for m in reversed(self._modes):
            m.__exit__(et, ev, tb)


def test_no_tensor_ops_does_catch_a_tensor_op() -> None:
    """The guard the CUDA-path tests rely on must itself be able to fail."""
    x = torch.ones(3)
    with NoTensorOps(strict=True) as forbid:
        forbid.armed = True
        with pytest.raises(RuntimeError, match="after the device was lost"):
            _ = x + 1
        with pytest.raises(RuntimeError, match="after the device was lost"):
            x.sum().item()
        forbid.armed = False
    assert forbid.violations


# ---------------------------------------------------------------------- classify
@pytest.mark.parametrize(
    ("exc", "cls"),
    [
        (RuntimeError("CUDA error: device-side assert triggered"), "cuda-device-assert"),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), "cuda-error"),
        (_OOM("CUDA out of memory. Tried to allocate 2.00 GiB"), "out-of-memory"),
        (
            RuntimeError(
                "one of the variables needed for gradient computation has been modified "
                "by an inplace operation"
            ),
            "autograd-inplace",
        ),
        (IndexError("Target 255 is out of bounds."), "index-out-of-range"),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (5x5 and 4x8)"), "shape-mismatch"),
        (
            RuntimeError(
                "Expected all tensors to be on the same device, but found at least two "
                "devices, cuda:0 and cpu!"
            ),
            "device-mismatch",
        ),
        (
            RuntimeError("mat1 and mat2 must have the same dtype, but got Double and Float"),
            "dtype-error",
        ),
        (KeyboardInterrupt(), "keyboard-interrupt"),
        (SystemExit(3), "exit"),
        (ValueError("something else"), "other"),
    ],
)
def test_classify(exc: BaseException, cls: str) -> None:
    info = classify(exc)
    assert info["class"] == cls
    assert info["device_lost"] == (cls in ("cuda-device-assert", "cuda-error"))
    assert info["advice"] and info["message"] == str(exc)
    assert info["type"].endswith(type(exc).__qualname__)


# ---------------------------------------------------------------------- post-mortem per class
def _reports(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*.json") if not p.name.startswith("."))


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _shape(model: nn.Module) -> None:
    model(torch.randn(5, 5))


def _dtype(model: nn.Module) -> None:
    model(torch.randn(5, 4, dtype=torch.float64))


def _device(model: nn.Module) -> None:
    model(torch.randn(5, 4)) + torch.randn(5, 2, device="meta")


def _index(model: nn.Module) -> None:
    F.cross_entropy(model(torch.randn(5, 4)), torch.tensor([0, 1, 255, 1, 0]))


def _oom(model: nn.Module) -> None:
    model(torch.randn(5, 4))
    raise _OOM("CUDA out of memory. Tried to allocate 20.00 GiB")


def _interrupt(model: nn.Module) -> None:
    model(torch.randn(5, 4))
    raise KeyboardInterrupt


def _other(model: nn.Module) -> None:
    raise ValueError("the data loader ran dry")


def _nan(model: nn.Module) -> None:
    model(torch.full((5, 4), math_nan()))


def math_nan() -> float:
    return float("nan")


@pytest.mark.parametrize(
    "case",
    [
        (_shape, RuntimeError, "shape-mismatch", "shapes cannot be multiplied"),
        (_dtype, RuntimeError, "dtype-error", "same dtype"),
        (_device, RuntimeError, "device-mismatch", "not on the expected device"),
        (_index, IndexError, "index-out-of-range", "Target 255 is out of bounds"),
        (_oom, _OOM, "out-of-memory", "out of memory"),
        (_interrupt, KeyboardInterrupt, "keyboard-interrupt", ""),
        (_other, ValueError, "other", "ran dry"),
        (_nan, AnomalyError, "anomaly", "NaN"),
    ],
    ids=lambda case: case[2],
)
def test_postmortem_for_each_exception_class(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    case: tuple[Callable[[nn.Module], None], type[BaseException], str, str],
) -> None:
    fail, exc_type, cls, words = case
    model = _model()
    with (
        pytest.raises(exc_type) as info,
        nanwatch.watch(model, report_dir=str(tmp_path), guards=False) as nw,
    ):
        for _ in range(2):
            model(torch.randn(5, 4)).sum().backward()
            nw.step()
        fail(model)
    assert words in str(info.value)
    (path,) = _reports(tmp_path)
    m = _NAME.match(path.name)
    assert m is not None and m.group(1) == "0" and m.group(2) == "2", path.name
    assert path.with_suffix(".html").exists()
    report = Report.load(path)
    assert report.error is not None and report.error["class"] == cls
    assert report.error["step"] == 2 and report.error["traceback"]
    err = capsys.readouterr().err
    assert "post-mortem report written" in err and path.name in err
    assert path.with_suffix(".html").name in err
    if cls in ("shape-mismatch", "dtype-error"):
        running = [e for e in report.recent_events() if e.running]
        assert running and running[-1].path == "0", "the module that raised is named"
        assert "in 0 (Linear)" in report.headline
    if cls == "out-of-memory":
        assert "Largest tensors of the last step" in str(report)
    if cls == "anomaly":
        assert report.first_anomaly is not None and "NaN in the input data" in report.headline


def test_autograd_inplace_error_from_the_gallery(tmp_path: Path) -> None:
    outcome = scenarios.run(
        scenarios.get("inplace-saved"), report_dir=str(tmp_path), postmortem=True
    )
    assert isinstance(outcome.error, RuntimeError)
    (path,) = _reports(tmp_path)
    report = Report.load(path)
    assert report.error is not None and report.error["class"] == "autograd-inplace"
    assert report.headline.startswith("RuntimeError (autograd in-place error)")
    assert "modified by an inplace operation" in report.error["message"]
    assert re.search(r"inplace_saved\.py:\d+$", report.error["source"])
    assert "backward()" in report.error["code"], "the user's line that raised"


def test_the_original_exception_comes_out_unchanged(tmp_path: Path) -> None:
    model = _model()
    cause = KeyError("batch 17")
    original = ValueError("bad batch", 17)
    line = 0
    with (
        pytest.raises(ValueError) as info,
        nanwatch.watch(model, report_dir=str(tmp_path)),
    ):
        model(torch.randn(2, 4))
        try:
            raise cause
        except KeyError as inner:
            line = sys._getframe().f_lineno + 1
            raise original from inner
    exc = info.value
    assert exc is original
    assert type(exc) is ValueError and exc.args == ("bad batch", 17)
    assert exc.__cause__ is cause and exc.__suppress_context__
    assert exc.__context__ is cause, "no exception of nanwatch's got chained in"
    frames = traceback.extract_tb(exc.__traceback__)
    assert frames[-1].lineno == line and frames[-1].filename == __file__
    assert not any("nanwatch" in f.filename for f in frames), "no frame of nanwatch added"
    assert len(_reports(tmp_path)) == 1


# ---------------------------------------------------------------------- the CUDA-error path
def test_cuda_error_postmortem_touches_no_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A device-side assert kills the CUDA context: from then on the watcher's flush may not
    run a kernel (no aten op at all) and the capture may not even look at a tensor."""
    from tests._report_fixtures import simulated_cuda_crash

    strict = NoTensorOps(strict=True)
    real_capture = postmortem.capture

    def guarded_capture(watcher: nanwatch.Watcher, exc: BaseException) -> Path | None:
        with strict:
            strict.armed = True
            try:
                return real_capture(watcher, exc)
            finally:
                strict.armed = False

    monkeypatch.setattr(postmortem, "capture", guarded_capture)
    dispatch = NoTensorOps()
    original_exit = nanwatch.Watcher.__exit__

    def exit_without_device(self: nanwatch.Watcher, et: Any, ev: Any, tb: Any) -> None:
        dispatch.armed = et is not None
        try:
            original_exit(self, et, ev, tb)
        finally:
            dispatch.armed = False

    monkeypatch.setattr(nanwatch.Watcher, "__exit__", exit_without_device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed write would be a warning: make it fail
        with dispatch:
            _, exc = simulated_cuda_crash(report_dir=tmp_path)
    assert str(exc).startswith("CUDA error: device-side assert triggered")
    assert dispatch.violations == [] and strict.violations == []
    (path,) = _reports(tmp_path)
    report = Report.load(path)
    assert report.error is not None
    assert report.error["class"] == "cuda-device-assert" and report.error["device_lost"]
    assert "CUDA_LAUNCH_BLOCKING=1" in report.error["advice"]
    events = report.recent_events()
    assert [e.path for e in events][-3:] == ["head", "Classifier", "CrossEntropyLoss"]
    text = render_text(report, width=120)  # not the terminal's: an 80-column one wraps it
    assert "the failing one is among these" in text
    assert "CUDA device-side assert" in capsys.readouterr().err


def test_device_loss_does_not_invent_a_nan(tmp_path: Path) -> None:
    model = _model()
    with pytest.raises(RuntimeError), nanwatch.watch(model, report_dir=str(tmp_path)) as nw:
        nw._defer_cpu = True  # statistics wait on the "device" until the flush, as on CUDA
        model(torch.randn(5, 4)).sum().backward()
        nw.step()
        model(torch.randn(5, 4))
        raise RuntimeError("CUDA error: device-side assert triggered")
    report = Report.load(_reports(tmp_path)[0])
    assert report.first_anomaly is None, report.first_anomaly.summary


# ---------------------------------------------------------------------- write failures
def test_a_failed_write_is_a_warning_and_the_exception_is_unchanged(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the report directory should be")
    model = _model()
    original = ValueError("mine")
    with (
        pytest.warns(RuntimeWarning, match="could not write the post-mortem report") as rec,
        pytest.raises(ValueError) as info,
        nanwatch.watch(model, report_dir=str(blocker)),
    ):
        model(torch.randn(2, 4))
        raise original
    assert info.value is original and info.value.__context__ is None
    assert rec[0].filename == __file__, "the warning points at the user's code"


def test_a_failed_write_under_warnings_as_errors_goes_to_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    model = _model()
    with (
        warnings.catch_warnings(),
        pytest.raises(ValueError, match="mine") as info,
        nanwatch.watch(model, report_dir=str(blocker)),
    ):
        warnings.simplefilter("error")
        raise ValueError("mine")
    assert info.value.__context__ is None
    assert "could not write the post-mortem report" in capsys.readouterr().err


def test_two_reports_in_one_second_get_distinct_names(tmp_path: Path) -> None:
    inner_model, outer_model = _model(), _model()
    with (
        pytest.raises(RuntimeError),
        nanwatch.watch(outer_model, report_dir=str(tmp_path)),
        nanwatch.watch(inner_model, report_dir=str(tmp_path)),
    ):
        raise RuntimeError("boom")
    names = [p.name for p in _reports(tmp_path)]
    assert len(names) == 2 and all(_NAME.match(n) for n in names), names


# ---------------------------------------------------------------------- atomic writes
def test_atomic_write_replaces_and_cleans_up_on_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "r.json"
    atomic_write(target, '{"old": true}')
    assert oct(target.stat().st_mode & 0o777) == "0o644"

    def broken_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="No space left"):
        atomic_write(target, '{"new": true}')
    assert target.read_text() == '{"old": true}'
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"], "the temporary file is gone"


_KILLED_WRITER = """
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("pm", {module!r})
pm = importlib.util.module_from_spec(spec); spec.loader.exec_module(pm)
real_fsync = os.fsync
def stall(fd):
    real_fsync(fd)
    print("WRITTEN", flush=True)   # the data is in the temporary file, not yet renamed
    time.sleep(120)
os.fsync = stall
pm.atomic_write({target!r}, "x" * 5_000_000)
"""


def test_a_writer_killed_mid_write_leaves_no_half_file(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    target.write_text('{"schema_version": "1.0", "steps": []}')
    code = _KILLED_WRITER.format(module=postmortem.__file__, target=str(target))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "WRITTEN"
        proc.kill()
    finally:
        proc.wait(timeout=30)
    assert target.read_text() == '{"schema_version": "1.0", "steps": []}', "old file intact"
    assert Report.load(target).steps == []
    stray = [p.name for p in tmp_path.iterdir() if p != target]
    assert all(n.startswith(".report.json.") and n.endswith(".tmp") for n in stray), stray


# ---------------------------------------------------------------------- signals
def test_sigterm_handler_is_installed_while_attached_and_restored_after() -> None:
    before = signal.getsignal(signal.SIGTERM)
    model = _model()
    with nanwatch.watch(model):
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
    with nanwatch.watch(model, postmortem=False):
        assert signal.getsignal(signal.SIGTERM) is before


def test_nested_handlers_restore_in_any_order() -> None:
    before = signal.getsignal(signal.SIGTERM)
    outer, inner = nanwatch.watch(_model()), nanwatch.watch(_model())
    outer.attach()
    inner.attach()
    try:
        outer.detach()  # out of order: the inner handler sits on top
        assert signal.getsignal(signal.SIGTERM) is not before
    finally:
        inner.detach()
        outer.detach()
    assert signal.getsignal(signal.SIGTERM) is before


def test_no_handler_outside_the_main_thread() -> None:
    before = signal.getsignal(signal.SIGTERM)
    result: list[Any] = []
    model = _model()
    nw = nanwatch.watch(model)

    def worker() -> None:
        undo = install_signal_handlers(nw)
        result.append(signal.getsignal(signal.SIGTERM))
        undo()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert result == [before]


_CHILD = """
import os, signal, sys, time
import torch
from torch import nn
import nanwatch

mode = sys.argv[1]
if mode == "user-handler":
    def handler(signum, frame):
        print("USER HANDLER", flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, handler)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
criterion = nn.MSELoss()
with nanwatch.watch(model, report_dir=sys.argv[2]) as outer:
    with nanwatch.watch(criterion, report_dir=sys.argv[2]) as inner:
        for step in range(100000):
            loss = criterion(model(torch.randn(8, 4)), torch.randn(8, 2))
            loss.backward()
            outer.step(); inner.step()
            if step == 2:
                print("READY", flush=True)
            time.sleep(0.01)
"""


def _run_child(
    tmp_path: Path, mode: str, sig: int
) -> tuple[subprocess.CompletedProcess[str], Path]:
    reports = tmp_path / "reports"
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_CHILD))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), mode, str(reports)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "READY", (line, proc.stderr.read() if proc.stderr else "")
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, line + out, err)
    return done, reports


@pytest.mark.slow
def test_sigterm_writes_every_watchers_report_then_terminates(tmp_path: Path) -> None:
    done, reports = _run_child(tmp_path, "default", signal.SIGTERM)
    assert done.returncode == -signal.SIGTERM, done.stderr
    paths = _reports(reports)
    assert len(paths) == 2, "one report per watcher, nested handlers chained"
    for p in paths:
        report = Report.load(p)
        assert report.error is not None
        assert (report.error["class"], report.error["type"]) == ("signal", "SIGTERM")
        assert report.steps and report.steps[-1].step >= 2
        assert p.with_suffix(".html").exists()
    assert done.stderr.count("post-mortem report written") == 2


@pytest.mark.slow
def test_sigterm_hands_over_to_the_programs_own_handler(tmp_path: Path) -> None:
    done, reports = _run_child(tmp_path, "user-handler", signal.SIGTERM)
    assert "USER HANDLER" in done.stdout
    assert done.returncode == 3, done.stderr  # the program's handler decided how to end
    paths = _reports(reports)
    classes = sorted(json.loads(p.read_text())["error"]["class"] for p in paths)
    # the signal's reports, then (sys.exit(3) raised inside the watchers) the exit's
    assert classes.count("signal") == 2 and set(classes) <= {"signal", "exit"}


@pytest.mark.slow
def test_keyboard_interrupt_writes_the_report_and_propagates(tmp_path: Path) -> None:
    done, reports = _run_child(tmp_path, "default", signal.SIGINT)
    assert done.returncode == -signal.SIGINT, done.stderr  # Python's exit for Ctrl-C
    assert "KeyboardInterrupt" in done.stderr.splitlines()[-1]
    paths = _reports(reports)
    assert paths and all(
        json.loads(p.read_text())["error"]["class"] == "keyboard-interrupt" for p in paths
    )
    assert "interrupted (Ctrl-C)" in done.stderr


@pytest.fixture(autouse=True)
def _sigterm_untouched() -> Iterator[None]:
    before = signal.getsignal(signal.SIGTERM)
    yield
    assert signal.getsignal(signal.SIGTERM) is before, "a test left a SIGTERM handler behind"


def test_a_failing_postmortem_never_replaces_the_users_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # nanwatch's own bug while reading the exception or writing the report: one warning,
    # the fault noted, the user's exception out unchanged (no __context__ from ours)
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a nanwatch bug")

    model = nn.Linear(2, 1)
    for target in ("_note_mutations", "capture"):
        owner = nanwatch.Watcher if target == "_note_mutations" else postmortem
        with monkeypatch.context() as m:
            m.setattr(owner, target, broken)
            with (
                pytest.warns(RuntimeWarning, match="post-mortem.*a nanwatch bug"),
                pytest.raises(KeyError, match="users_own") as info,
                nanwatch.watch(model, report_dir=str(tmp_path)) as nw,
            ):
                model(torch.ones(1, 2))
                raise KeyError("users_own")
        assert info.value.__context__ is None and info.value.__cause__ is None
        assert nw.faults == [("post-mortem", "RuntimeError: a nanwatch bug")]
        assert not nw.attached and not model._forward_hooks


@pytest.mark.filterwarnings("ignore::nanwatch.NanwatchWarning")  # NW202: sigmoid into BCE
def test_an_anomaly_error_of_nw_step_is_the_ended_steps_not_the_next(report_dir: Path) -> None:
    """A diagnosis with no NaN in it (BCELoss fed saturated probabilities) is raised by
    nw.step() when it ends step 1: the post-mortem said "at step 2" (and kept an empty
    step 2 holding the error) for a diagnosis of step 1."""
    model = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
    criterion = nn.BCELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with (
        pytest.raises(nanwatch.AnomalyError) as caught,
        nanwatch.watch(model, criterion, report_dir=str(report_dir)) as nw,
    ):
        for step in range(3):
            if step == 1:
                with torch.no_grad():
                    model[0].weight.mul_(1e4)
            x, y = torch.randn(8, 4), torch.randint(0, 2, (8, 1)).float()
            criterion(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    d = caught.value.diagnosis
    assert caught.value.anomaly is None and d is not None and d.step == 1
    (path,) = report_dir.glob("*.json")
    assert path.name.endswith("-step1.json")
    report = Report.load(path)
    assert report.error is not None and report.error["step"] == 1
    assert [t.step for t in report.steps] == [0, 1]


@pytest.mark.parametrize(("update", "where"), [(True, "after the optimizer step"),
                                               (False, "after the backward pass")])  # fmt: skip
def test_an_exception_after_backward_is_not_said_to_be_during_backward(
    report_dir: Path, update: bool, where: str
) -> None:
    """The user's own check raising after the update was headed 'ValueError during
    backward': the last records were the gradients, and backward had ended."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        pytest.raises(ValueError, match="my own check"),
        nanwatch.watch(model, report_dir=str(report_dir)),
    ):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        if update:
            opt.step()
        raise ValueError("my own check failed")
    (path,) = report_dir.glob("*.json")
    headline = Report.load(path).headline
    assert f"ValueError (exception) {where}, step 0" in headline


class _AddBias(torch.autograd.Function):
    """A custom Function whose backward returns the bias gradient in the wrong shape."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return x + b

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return g, g.sum(1)  # should be g.sum(0): got (batch,), expected (features,)


def test_an_exception_autograd_raised_is_said_to_be_during_backward(report_dir: Path) -> None:
    """A gradient of the wrong shape from a custom backward was headed 'after the backward
    pass': a parameter's gradient recorded earlier in that backward looked like its end."""
    first, b = nn.Linear(4, 16), nn.Parameter(torch.zeros(16))
    with (
        pytest.raises(RuntimeError, match="invalid gradient"),
        nanwatch.watch(first, report_dir=str(report_dir)),
    ):
        _AddBias.apply(first(torch.randn(32, 4)), b).pow(2).mean().backward()
    (path,) = report_dir.glob("*.json")
    assert "RuntimeError (exception) during backward, step 0" in Report.load(path).headline
