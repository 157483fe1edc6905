"""NanWatchCallback in real Lightning runs: tiny models (the BoringModel pattern) for each
action, both namespaces, mixed precision, checkpoints, and a 2-rank DDP run on CPU."""

from __future__ import annotations

import csv
import importlib
import json
import math
import os
import pickle
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import nanwatch
from nanwatch.report import Report
from tests._lightning_models import classifier_class, model_class, submodule_model_class

L = pytest.importorskip("lightning.pytorch")
PL = pytest.importorskip("pytorch_lightning")

from nanwatch.callbacks import NanWatchCallback  # noqa: E402

from nanwatch import callbacks  # noqa: E402  (after the importorskips)

LP = "lightning.pytorch"
BOTH = pytest.mark.parametrize("ns", [LP, "pytorch_lightning"])


# ---------------------------------------------------------------------- helpers
def fit(
    tmp_path: Path,
    model: Any,
    *cbs: Any,
    ns: str = LP,
    batches: int = 6,
    ckpt_path: str | None = None,
    **options: Any,
) -> Any:
    """A Trainer.fit on CPU with a CSVLogger in tmp_path; returns the trainer."""
    mod = importlib.import_module(ns)
    loggers = importlib.import_module(f"{ns}.loggers")
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        "limit_train_batches": batches,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "log_every_n_steps": 1,
        "logger": loggers.CSVLogger(tmp_path),
    }
    settings.update(options)
    trainer = mod.Trainer(callbacks=list(cbs), **settings)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec).*")
        trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def rows(trainer: Any) -> list[dict[str, str]]:
    with (Path(trainer.logger.log_dir) / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def column(trainer: Any, name: str) -> list[float]:
    return [float(r[name]) for r in rows(trainer) if r.get(name)]


def reports(directory: str | Path, rank: int = 0) -> list[Path]:
    return sorted(Path(directory).glob(f"nanwatch-*-rank{rank}-*.json"))


def weights_recorder(ns: str = LP) -> Any:
    """A callback that keeps the Linear's weight at the end of every training batch."""
    base = importlib.import_module(ns).Callback

    class Weights(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            self.after: list[torch.Tensor] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            self.after.append(pl_module.layer.weight.detach().float().clone())

    return Weights()


Model = model_class(LP)


# ---------------------------------------------------------------------- import and namespaces
def test_default_class_is_a_lightning_pytorch_callback_and_pickles() -> None:
    assert issubclass(NanWatchCallback, L.Callback)
    assert not issubclass(NanWatchCallback, PL.Callback)
    cb = NanWatchCallback(on_anomaly="skip")
    again = pickle.loads(pickle.dumps(cb))  # ddp_spawn pickles the trainer's callbacks
    assert type(again) is NanWatchCallback and again.on_anomaly == "skip"
    from nanwatch.callbacks.lightning import NanWatchCallback as explicit

    assert explicit is NanWatchCallback


def test_pytorch_lightning_class_is_reachable_three_ways_and_pickles() -> None:
    from nanwatch.callbacks.pytorch_lightning import NanWatchCallback as PLCallback

    assert NanWatchCallback.for_namespace("pytorch_lightning") is PLCallback
    assert callbacks.callback_class("pytorch_lightning") is PLCallback
    assert issubclass(PLCallback, PL.Callback) and not issubclass(PLCallback, L.Callback)
    cb = pickle.loads(pickle.dumps(PLCallback()))
    assert type(cb) is PLCallback
    assert PLCallback().state_key == NanWatchCallback().state_key  # checkpoints move across


def test_the_imported_namespace_is_preferred(monkeypatch: pytest.MonkeyPatch) -> None:
    assert callbacks.default_namespace() == LP  # both imported: lightning.pytorch
    monkeypatch.delitem(sys.modules, LP)
    assert callbacks.default_namespace() == "pytorch_lightning"
    assert issubclass(callbacks.NanWatchCallback, PL.Callback)


def test_missing_lightning_names_the_pip_line(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("lightning", LP, "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ModuleNotFoundError, match=r'pip install "nanwatch\[lightning\]"') as err:
        _ = callbacks.NanWatchCallback
    assert err.value.name == "pytorch_lightning"
    with pytest.raises(ModuleNotFoundError, match=r'pip install "nanwatch\[lightning\]"'):
        callbacks.callback_class("pytorch_lightning")
    with pytest.raises(ModuleNotFoundError, match="pip install lightning"):
        callbacks.callback_class("lightning.pytorch")


def test_bad_arguments_name_the_value_and_the_choices() -> None:
    with pytest.raises(nanwatch.ConfigError, match="`on_anomaly` can be 'stop', 'skip'") as err:
        NanWatchCallback(on_anomaly="ignore")  # type: ignore[arg-type]
    assert err.value.name == "on_anomaly" and err.value.value == "ignore"
    with pytest.raises(nanwatch.ConfigError, match="`namespace` can be"):
        NanWatchCallback.for_namespace("keras")
    with pytest.raises(nanwatch.ConfigError, match="max_replays"):
        NanWatchCallback(max_replays=-1)
    cb = NanWatchCallback(config=nanwatch.WatchConfig(mode="sentinel", on_anomaly="raise"))
    assert cb.config.mode == "sentinel" and cb.config.on_anomaly == "record"


# ---------------------------------------------------------------------- clean runs
def test_clean_run_logs_figures_to_csv_and_writes_no_report(tmp_path: Path) -> None:
    cb = NanWatchCallback()
    trainer = fit(tmp_path, Model(), cb, batches=6)
    nw = cb.watcher
    assert nw is not None and not nw.attached
    assert [t.step for t in nw.history] == list(range(6))
    assert nw.first_anomaly is None and cb.report_paths == [] and not reports(tmp_path)
    grad_norms = column(trainer, "nanwatch/grad_norm")
    assert len(grad_norms) == 6 and all(math.isfinite(g) and g > 0 for g in grad_norms)
    assert grad_norms == pytest.approx([t.grad_norm for t in nw.history], rel=1e-6)
    assert column(trainer, "nanwatch/max_logit") == pytest.approx(
        [t.max_logit for t in nw.history], rel=1e-6
    )
    for name in ("nonfinite_forward", "nonfinite_backward", "nonfinite_params", "anomalies"):
        assert column(trainer, f"nanwatch/{name}") == [0.0] * 6
    assert "nanwatch/headroom" not in rows(trainer)[0]  # float32 only: no low precision


def test_log_every_n_steps_is_honored(tmp_path: Path) -> None:
    trainer = fit(tmp_path, Model(), NanWatchCallback(), batches=6, log_every_n_steps=3)
    logged = [int(r["step"]) for r in rows(trainer) if r.get("nanwatch/grad_norm")]
    assert logged == [2, 5]


def test_validation_is_not_recorded_as_training_steps(tmp_path: Path) -> None:
    cb = NanWatchCallback()
    fit(
        tmp_path,
        Model(),
        cb,
        batches=6,
        limit_val_batches=2,
        val_check_interval=2,
        num_sanity_val_steps=1,
    )
    nw = cb.watcher
    assert nw is not None and not nw.attached
    assert [t.step for t in nw.history] == list(range(6))
    assert {len(t.calls) for t in nw.history} == {len(nw.history[0].calls)}  # no val calls
    assert all(t.grad_norm is not None for t in nw.history)  # attached again after each val


def test_validate_and_test_after_fit_run_unwatched_and_write_nothing(tmp_path: Path) -> None:
    functional = dict(vars(torch.nn.functional))
    seen: dict[str, list[tuple[bool, bool, list[str]]]] = {"validate": [], "test": []}

    def look(loop: str, model: Any) -> None:
        hooked = any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
        wrapped = [k for k, v in vars(torch.nn.functional).items() if functional.get(k) is not v]
        seen[loop].append((bool(cb.watcher and cb.watcher.attached), hooked, wrapped))

    class Probe(L.Callback):  # type: ignore[misc]
        def on_validation_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            if trainer.state.fn == "validate":  # trainer.validate, not fit's validation
                look("validate", pl_module)

        def on_test_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            look("test", pl_module)

    cb = NanWatchCallback()
    model = Model()
    trainer = fit(tmp_path, model, cb, Probe(), batches=3, limit_val_batches=2)
    nw = cb.watcher
    assert nw is not None and len(nw.history) == 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validated = trainer.validate(model, verbose=False)
        tested = trainer.test(model, verbose=False)
    assert math.isfinite(validated[0]["val_loss"]) and math.isfinite(tested[0]["test_loss"])
    # no watcher, no module hook, no F.* guard while the evaluation loops ran
    assert seen["validate"] and seen["test"]
    assert all(s == (False, False, []) for s in seen["validate"] + seen["test"])
    assert cb.watcher is nw and len(nw.history) == 3  # not replaced, no step added
    assert cb.report_paths == [] and not list(tmp_path.rglob("nanwatch-*.json"))
    assert not [w for w in caught if str(w.message).startswith("nanwatch")]
    # (the autouse fixture fails the test if a nanwatch hook is still registered)


def test_a_nan_only_in_test_step_is_left_to_a_watch_around_trainer_test(tmp_path: Path) -> None:
    # the callback watches training: a NaN born in test_step shows in the test metrics only
    # (documented in the callback's docstring, with the recipe checked below)
    cb = NanWatchCallback()
    model = Model(bad_test=[1])
    trainer = fit(tmp_path, model, cb, batches=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tested = trainer.test(model, verbose=False)
    assert math.isnan(tested[0]["test_loss"])
    assert not [w for w in caught if str(w.message).startswith("nanwatch")]
    nw = cb.watcher
    assert nw is not None and not nw.attached
    assert nw.anomalies == [] and len(nw.history) == 3 and cb.stopped_at is None
    assert cb.report_paths == [] and not list(tmp_path.rglob("nanwatch-*.json"))
    # the docstring's recipe: the NaN is found where it is born, and reported
    with (
        pytest.raises(
            nanwatch.AnomalyError,
            # the op that made the -inf, on every path: read late, the call is read as it
            # returns, while its inputs (inference tensors, with no version) are at hand
            match=r"-inf born in the forward of blowup \(Blowup\) \(then NaN\)",
        ) as err,
        nanwatch.watch(model, report_dir=tmp_path / "eval"),
    ):
        trainer.test(model, verbose=False)
    assert err.value.module == "blowup" and err.value.anomaly is not None
    assert err.value.anomaly.step == 1  # test batch 1
    assert len(list((tmp_path / "eval").glob("nanwatch-*-rank0-*.json"))) == 1
    assert cb.report_paths == [] and not nw.attached  # the callback stayed out of it


# ---------------------------------------------------------------------- actions
def test_stop_drops_the_bad_update_stops_and_writes_the_report(tmp_path: Path) -> None:
    cb = NanWatchCallback()  # on_anomaly="stop"
    weights = weights_recorder()
    with pytest.warns(
        RuntimeWarning, match=r"step 2: -inf born in the forward of blowup \(Blowup\) \(then NaN\)"
    ) as caught:
        trainer = fit(tmp_path, Model(bad=[2]), cb, weights, batches=6)
    nw = cb.watcher
    assert nw is not None and not nw.attached
    assert cb.stopped_at == 2 and trainer.should_stop
    # the warning says the diagnosis and its fix, as nanwatch.watch does, not only where
    said = next(str(w.message) for w in caught if "step 2: -inf born" in str(w.message))
    top = next(t for t in nw.history if t.step == 2).diagnoses[0]
    assert f"\n  {top.headline}\n" in said and top.fix
    assert f"\n  fix: {top.fix.splitlines()[0]}\n" in said
    assert said.index(top.headline) < said.index("training stops") < said.index("report:")
    assert [t.step for t in nw.history] == [0, 1, 2]  # batches 3-5 never ran
    assert torch.equal(weights.after[2], weights.after[1])  # the NaN update was dropped
    assert all(torch.isfinite(w).all() for w in weights.after)
    a = nw.first_anomaly
    assert a is not None and a.step == 2 and a.path == "blowup"
    assert a.op is not None and a.op.op == "aten.mul.Tensor"  # pinpointed by the replay
    assert a.transient is not True and cb.replays == 1
    (path,) = reports(trainer.log_dir)
    assert cb.report_paths == [path] and path.with_suffix(".html").exists()
    report = Report.load(path)
    assert report.first_anomaly is not None and report.first_anomaly.path == "blowup"
    assert column(trainer, "nanwatch/anomalies")[-1] == 1.0
    assert column(trainer, "nanwatch/nonfinite_forward")[-1] >= 1.0


def test_a_clean_replay_marks_the_anomaly_transient(tmp_path: Path) -> None:
    cb = NanWatchCallback()
    model = Model(bad=[1], transient=True)  # only the first run of batch 1 makes NaN
    with pytest.warns(RuntimeWarning, match="nanwatch: step 1"):
        fit(tmp_path, model, cb, batches=4)
    a = cb.watcher.first_anomaly if cb.watcher else None
    assert a is not None and a.transient is True
    assert model.calls[1] == 2  # the replay ran training_step again
    trace = next(t for t in cb.watcher.history if t.anomaly is a)  # type: ignore[union-attr]
    top = trace.diagnoses[0]
    assert top.code == "NW404" and top.severity == "error"  # no layer is blamed


def test_skip_drops_only_the_bad_updates_and_training_goes_on(tmp_path: Path) -> None:
    cb = NanWatchCallback(on_anomaly="skip")
    weights = weights_recorder()
    with pytest.warns(RuntimeWarning, match="skipped"):
        trainer = fit(tmp_path, Model(bad=[2, 4]), cb, weights, batches=8)
    nw = cb.watcher
    assert nw is not None
    assert [t.step for t in nw.history] == list(range(8))  # all batches ran
    assert [e["batch_idx"] for e in cb.skipped] == [2, 4]
    assert torch.equal(weights.after[2], weights.after[1])  # skipped
    assert torch.equal(weights.after[4], weights.after[3])  # skipped
    for i in (3, 5, 6, 7):  # the next clean steps proceed normally
        assert not torch.equal(weights.after[i], weights.after[i - 1])
    assert all(torch.isfinite(w).all() for w in weights.after)
    assert all(math.isfinite(nw.history[i].loss or math.nan) for i in (3, 5, 6, 7))
    lines = (Path(trainer.log_dir) / "nanwatch-skipped-rank0.jsonl").read_text().splitlines()
    entries = [json.loads(line) for line in lines]
    assert [e["batch_idx"] for e in entries] == [2, 4] and entries[0]["epoch"] == 0
    assert "blowup" in entries[0]["what"]
    assert column(trainer, "nanwatch/skipped")[-1] == 2.0
    (path,) = reports(trainer.log_dir)  # one report at the end of the run
    assert Report.load(path).anomaly_count == 2


def test_skip_covers_the_whole_accumulation_window(tmp_path: Path) -> None:
    cb = NanWatchCallback(on_anomaly="skip")
    weights = weights_recorder()
    with pytest.warns(RuntimeWarning, match="skipped"):
        fit(tmp_path, Model(bad=[2]), cb, weights, batches=6, accumulate_grad_batches=2)
    (entry,) = cb.skipped
    assert entry["batch_idx"] == 3 and entry["bad_batches"][0] == 2
    assert "blowup" in entry["what"]
    assert torch.equal(weights.after[3], weights.after[1])  # the window's update was dropped
    assert not torch.equal(weights.after[5], weights.after[3])
    a = cb.watcher.first_anomaly if cb.watcher else None
    assert a is not None and a.step == 2 and a.op is not None and cb.replays == 1


def test_raise_raises_anomaly_error_and_writes_the_postmortem(tmp_path: Path) -> None:
    cb = NanWatchCallback(on_anomaly="raise")
    with pytest.raises(nanwatch.AnomalyError, match="step 2: -inf born") as err:
        fit(tmp_path, Model(bad=[2]), cb, batches=6)
    assert err.value.module == "blowup" and err.value.anomaly is not None
    assert err.value.diagnoses, "the step was finished before raising: rules ran"
    nw = cb.watcher
    assert nw is not None and not nw.attached
    (path,) = reports(tmp_path / "lightning_logs" / "version_0")
    report = Report.load(path)
    assert report.error is not None and report.error["class"] == "anomaly"
    assert report.first_anomaly is not None and report.first_anomaly.step == 2


def test_warn_warns_once_and_training_goes_on(tmp_path: Path) -> None:
    cb = NanWatchCallback(on_anomaly="warn")
    with pytest.warns(RuntimeWarning, match="nanwatch: step 2") as caught:
        trainer = fit(tmp_path, Model(bad=[2]), cb, batches=5)
    ours = [w for w in caught if "nanwatch: step" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__  # points at the fit call
    nw = cb.watcher
    assert nw is not None and [t.step for t in nw.history] == list(range(5))
    assert cb.skipped == [] and cb.stopped_at is None
    assert len(reports(trainer.log_dir)) == 1


def test_a_crash_writes_the_postmortem_and_leaves_no_hook(tmp_path: Path) -> None:
    cb = NanWatchCallback()
    with pytest.raises(RuntimeError, match="boom"):
        fit(tmp_path, Model(fail_at=2), cb, batches=6)
    nw = cb.watcher
    assert nw is not None and not nw.attached
    (path,) = reports(tmp_path / "lightning_logs" / "version_0")
    assert cb.report_paths == [path]
    report = Report.load(path)
    assert report.error is not None and report.error["type"].endswith("RuntimeError")
    assert "boom" in report.error["message"]


# ---------------------------------------------------------------------- guards
GUARDED = {
    # loss: (GuardError.loss, .module, .code, .values, the message's first line)
    "module": (
        "CrossEntropyLoss",
        "criterion",
        "NW501",
        (255,),
        r"^criterion \(CrossEntropyLoss\) at \S*_lightning_models\.py:\d+: target contains 255 "
        r"at 1 position .* accepts 0\.\.2",
    ),
    "functional": (
        "F.cross_entropy",
        None,
        "NW501",
        (255,),
        r"^F\.cross_entropy at \S*_lightning_models\.py:\d+: target contains 255 at 1 position",
    ),
    "broadcast": (
        "F.mse_loss",
        None,
        "NW506",
        (),
        r"^F\.mse_loss at \S*_lightning_models\.py:\d+: input \(4, 1\) and target \(4\) "
        r"broadcast to \(4, 4\)",
    ),
}


@BOTH
@pytest.mark.parametrize("loss", list(GUARDED))
def test_a_bad_loss_target_raises_guard_error_out_of_fit_with_the_postmortem(
    tmp_path: Path, ns: str, loss: str
) -> None:
    name, module, code, values, first_line = GUARDED[loss]
    cb = NanWatchCallback.for_namespace(ns)()
    weights = weights_recorder(ns)
    model = classifier_class(ns)(loss=loss, bad_at=2)
    with pytest.raises(nanwatch.GuardError, match=first_line) as err:
        fit(tmp_path, model, cb, weights, ns=ns, batches=5)
    # the guard's own exception object, neither wrapped nor replaced on its way out
    assert isinstance(err.value, nanwatch.GuardError) and model.raised == [err.value]
    assert err.value.__cause__ is None and err.value.__context__ is None
    e = err.value
    assert (e.loss, e.module, e.code, e.values) == (name, module, code, values)
    assert e.source is not None and "_lightning_models.py:" in e.source  # the user's line
    assert f"({code}: checked before the kernel ran" in str(e)
    # the failing step changed nothing: batches 0 and 1 trained, batch 2 never updated
    assert len(weights.after) == 2 and not torch.equal(weights.after[1], weights.after[0])
    assert torch.equal(model.layer.weight.detach(), weights.after[1])
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    nw = cb.watcher
    assert nw is not None and not nw.attached
    log_dir = tmp_path / "lightning_logs" / "version_0"
    (path,) = reports(log_dir)  # rank 0's post-mortem, in trainer.log_dir
    assert re.fullmatch(r"nanwatch-\d{8}-\d{6}-rank0-step2\.json", path.name)
    assert cb.report_paths == [path] and path.with_suffix(".html").stat().st_size > 0
    data = json.loads(path.read_text())
    assert data["error"]["class"] == "guard" and data["error"]["type"] == "nanwatch.GuardError"
    assert data["error"]["message"] == str(e) and data["error"]["step"] == 2
    assert [d["code"] for d in data["diagnoses"]] == [code]
    assert Report.load(path).steps[-1].step == 2
    # (the autouse fixture: no module hook, no F.* wrapper, no GradScaler.scale tap left)


def test_a_guard_error_ends_the_run_whatever_on_anomaly_says(tmp_path: Path) -> None:
    # a GuardError is raised inside training_step, before the loss exists: there is no
    # update to skip, so "skip" cannot go on (documented in the callback's docstring)
    cb = NanWatchCallback(on_anomaly="skip")
    model = classifier_class(LP)(loss="module", bad_at=1)
    with pytest.raises(nanwatch.GuardError, match="target contains 255"):
        fit(tmp_path, model, cb, batches=4)
    assert cb.skipped == [] and len(model.raised) == 1
    assert cb.watcher is not None and not cb.watcher.attached
    assert len(reports(tmp_path / "lightning_logs" / "version_0")) == 1


def test_a_failing_postmortem_does_not_replace_the_users_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lightning calls on_exception inside its `except`: whatever the callback raises there
    # would come out of trainer.fit in place of the user's error
    def broken(self: nanwatch.Watcher) -> None:
        raise RuntimeError("a nanwatch bug")

    monkeypatch.setattr(nanwatch.Watcher, "_note_mutations", broken)
    cb = NanWatchCallback()
    model = classifier_class(LP)(loss="functional", bad_at=1)
    with (
        pytest.warns(RuntimeWarning, match=r"post-mortem.*RuntimeError: a nanwatch bug"),
        pytest.raises(nanwatch.GuardError, match=r"^F\.cross_entropy at") as err,
    ):
        fit(tmp_path, model, cb, batches=4)
    assert model.raised == [err.value] and err.value.__context__ is None
    nw = cb.watcher
    assert nw is not None and not nw.attached  # and the autouse fixture: nothing left
    assert nw.faults == [("post-mortem", "RuntimeError: a nanwatch bug")]
    # the part that failed is skipped; the report is still written from what was read
    assert len(cb.report_paths) == 1 and cb.report_paths[0].suffix == ".json"


def test_a_failing_postmortem_under_warnings_as_errors_still_lets_the_users_exception_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # python -W error: the callback's own warning about its fault would be raised inside
    # Lightning's `except` and come out of trainer.fit; it goes to stderr instead
    def broken(self: nanwatch.Watcher, exc: BaseException | None = None) -> None:
        raise RuntimeError("a nanwatch bug")

    monkeypatch.setattr(nanwatch.Watcher, "close", broken)
    cb = NanWatchCallback()
    model = classifier_class(LP)(loss="functional", bad_at=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # Lightning's own notice on a machine with a GPU, not the callback's
        warnings.filterwarnings("ignore", message="GPU available but not used")
        with pytest.raises(nanwatch.GuardError, match=r"^F\.cross_entropy at") as err:
            fit(tmp_path, model, cb, batches=4)
    assert model.raised == [err.value]
    assert "the post-mortem report could not be written (RuntimeError: a nanwatch bug)" in (
        capsys.readouterr().err
    )
    nw = cb.watcher
    assert nw is not None and not nw.attached
    assert nw.faults == [("post-mortem", "RuntimeError: a nanwatch bug")]


def test_report_dir_defaults_to_the_root_dir_without_a_logger(tmp_path: Path) -> None:
    cb = NanWatchCallback()
    with pytest.warns(RuntimeWarning, match="nanwatch: step 1"):
        fit(tmp_path, Model(bad=[1]), cb, batches=3, logger=False, default_root_dir=tmp_path)
    assert len(reports(tmp_path)) == 1


def test_an_internal_error_stops_the_watching_not_the_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: nanwatch.Watcher) -> None:
        raise RuntimeError("a nanwatch bug")

    monkeypatch.setattr(nanwatch.Watcher, "check", broken)
    cb = NanWatchCallback()
    weights = weights_recorder()
    with pytest.warns(RuntimeWarning, match="internal error in NanWatchCallback.*a nanwatch bug"):
        trainer = fit(tmp_path, Model(bad=[2]), cb, weights, batches=4)
    assert trainer.global_step == 4 and len(weights.after) == 4  # training went on
    nw = cb.watcher
    assert nw is not None and not nw.attached
    assert nw.faults == [("lightning callback", "RuntimeError: a nanwatch bug")]


# ---------------------------------------------------------------------- the other namespace
def test_pytorch_lightning_trainer_stops_at_the_anomaly(tmp_path: Path) -> None:
    PLCallback = NanWatchCallback.for_namespace("pytorch_lightning")
    cb = PLCallback()
    with pytest.warns(
        RuntimeWarning, match=r"step 1: -inf born in the forward of blowup \(Blowup\) \(then NaN\)"
    ):
        trainer = fit(
            tmp_path, model_class("pytorch_lightning")(bad=[1]), cb, ns="pytorch_lightning"
        )
    assert isinstance(trainer, PL.Trainer) and cb.stopped_at == 1
    assert cb.watcher is not None and not cb.watcher.attached
    assert len(reports(trainer.log_dir)) == 1
    assert column(trainer, "nanwatch/grad_norm")[0] > 0


# ---------------------------------------------------------------------- mixed precision
def test_bf16_mixed_logs_headroom_and_replays_under_autocast(tmp_path: Path) -> None:
    cb = NanWatchCallback()
    with pytest.warns(RuntimeWarning, match="nanwatch: step 3"):
        trainer = fit(tmp_path, Model(bad=[3]), cb, batches=6, precision="bf16-mixed")
    headroom = column(trainer, "nanwatch/headroom")
    assert len(headroom) == 4 and all(0 < h < 1e-30 for h in headroom[:3])  # bf16: 3.4e38
    a = cb.watcher.first_anomaly if cb.watcher else None
    assert a is not None and a.record.dtype == "bfloat16"
    assert a.op is not None and a.op.dtype == "bfloat16"  # the replay ran under autocast
    assert cb.watcher is not None and cb.watcher.scaler is None  # bf16 uses no scaler


def test_float16_with_grad_scaler_skips_and_reads_the_scale(tmp_path: Path) -> None:
    # Trainer(accelerator="cpu", precision="16-mixed") is turned into bf16-mixed by Lightning
    # ("AMP with fp16 is not supported on CPU"); the plugin itself runs float16 autocast and
    # a GradScaler on CPU.
    from lightning.pytorch.plugins.precision import MixedPrecision

    with pytest.warns(UserWarning, match="AMP with fp16 is not supported on CPU"):
        fallback = L.Trainer(accelerator="cpu", precision="16-mixed", logger=False)
    assert fallback.precision_plugin.precision == "bf16-mixed"

    # init_scale=1: no overflow of the scaled gradients, so GradScaler.step would step
    # (found_inf = 0) and only the dropped gradients keep the weights where they were
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1.0))
    cb = NanWatchCallback(on_anomaly="skip")
    weights = weights_recorder()
    model = Model(bad=[2], detached=True)  # the gradients stay finite: the scaler would step
    with pytest.warns(RuntimeWarning, match="skipped"):
        trainer = fit(tmp_path, model, cb, weights, batches=5, plugins=[plugin])
    nw = cb.watcher
    assert nw is not None and nw.scaler is plugin.scaler
    assert [e["batch_idx"] for e in cb.skipped] == [2]
    assert torch.equal(weights.after[2], weights.after[1])  # GradScaler.step stepped nothing
    assert not torch.equal(weights.after[3], weights.after[2])
    assert all(torch.isfinite(w).all() for w in weights.after)
    assert column(trainer, "nanwatch/loss_scale") == [1.0] * 5  # no inf was ever found
    assert [t.scale for t in nw.history] == [1.0] * 5
    norms = column(trainer, "nanwatch/grad_norm")
    assert all(0 < g < 100 for i, g in enumerate(norms) if i != 2)
    assert nw.first_anomaly is not None and nw.first_anomaly.record.dtype == "float16"
    assert all(h < 1 for h in column(trainer, "nanwatch/headroom")[:2])


@pytest.mark.parametrize("found", ["plugin", "scale"])
def test_float16_scaler_skipping_its_first_steps_is_a_healthy_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, found: str
) -> None:
    # a scale of 2**20 overflows the float16 gradients: the GradScaler skips the first steps
    # and halves its scale until they fit, as it does at the start of every fp16 run
    from lightning.pytorch.plugins.precision import MixedPrecision

    plugin = MixedPrecision(
        "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**20)
    )

    class Probe(L.Callback):  # type: ignore[misc]
        """What the optimizer is given: unscaled gradients (MixedPrecision unscales before
        this hook), the scale they carried, and the weights after each batch."""

        def __init__(self) -> None:
            self.norms: list[float] = []
            self.scales: list[float] = []
            self.after: list[torch.Tensor] = []

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            grads = [p.grad.detach() for p in pl_module.parameters() if p.grad is not None]
            if not grads:
                grads = [torch.tensor(math.nan)]
            self.norms.append(
                float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
            )
            self.scales.append(float(plugin.scaler.get_scale()))

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.after.append(pl_module.layer.weight.detach().clone())

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            self.after.append(pl_module.layer.weight.detach().clone())

    cb, probe = NanWatchCallback(), Probe()
    if found == "scale":  # not told by the callback: the watcher finds it at scaler.scale(loss)
        told = cb.on_train_start

        def on_train_start(trainer: Any, pl_module: Any) -> None:
            told(trainer, pl_module)
            assert cb.watcher is not None
            cb.watcher.scaler = None

        monkeypatch.setattr(cb, "on_train_start", on_train_start)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(tmp_path, Model(), probe, cb, batches=8, plugins=[plugin])
    ours = [str(w.message) for w in caught if str(w.message).startswith("nanwatch")]
    assert not ours, ours
    nw = cb.watcher
    assert nw is not None and nw.scaler is plugin.scaler
    # not an anomaly: no stop, no skip list, no report, every batch trained
    assert nw.anomalies == [] and cb.stopped_at is None and cb.skipped == []
    assert len(nw.history) == 8 and trainer.global_step == 8
    assert cb.report_paths == [] and not list(tmp_path.rglob("nanwatch-*"))
    assert column(trainer, "nanwatch/anomalies") == [0.0] * 8
    # the scaler did skip: its first steps left the weights alone, with a halving scale
    moved = [not torch.equal(w, probe.after[i]) for i, w in enumerate(probe.after[1:])]
    skipped = moved.index(True)
    assert skipped >= 3, moved
    assert probe.scales[:skipped] == [2.0 ** (20 - i) for i in range(skipped)]
    # the logged figures: the scale the gradients carried, the gradient norm unscaled once
    assert column(trainer, "nanwatch/loss_scale") == probe.scales
    norms = column(trainer, "nanwatch/grad_norm")
    assert not all(math.isfinite(n) for n in norms[:skipped])  # what the scaler skipped for
    assert norms == pytest.approx(probe.norms, rel=1e-5, nan_ok=True)
    assert column(trainer, "train_loss") == pytest.approx([t.loss for t in nw.history])
    assert all(0 < h < 1 for h in column(trainer, "nanwatch/headroom"))


# ---------------------------------------------------------------------- checkpoints
def test_checkpoint_resume_keeps_the_summary_and_the_counters(tmp_path: Path) -> None:
    first = NanWatchCallback(on_anomaly="skip")
    with pytest.warns(RuntimeWarning, match="skipped"):
        trainer = fit(tmp_path / "a", Model(bad=[1]), first, batches=4)
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)
    before = first.watcher
    assert before is not None

    second = NanWatchCallback(on_anomaly="skip")
    with pytest.warns(RuntimeWarning, match="skipped"):
        resumed = fit(
            tmp_path / "b", Model(bad=[2]), second, batches=4, max_epochs=2, ckpt_path=str(ckpt)
        )
    nw = second.watcher
    assert nw is not None
    assert [t.step for t in nw.history] == list(range(8))  # numbering goes on
    old = [t.loss for t in before.history]
    kept = [t.loss for t in list(nw.history)[:4]]
    assert kept[0] == old[0] and kept[2:] == old[2:] and math.isnan(kept[1] or 0.0)
    assert nw.history[1].anomaly is not None and nw.history[1].records == []  # summary only
    assert nw.first_anomaly is not None and nw.first_anomaly.step == 1
    assert nw.first_anomaly.summary == before.first_anomaly.summary  # type: ignore[union-attr]
    assert [a.step for a in nw.anomalies] == [1, 6]  # batch 2 of the resumed epoch: step 6
    assert second.skipped[0] == first.skipped[0] and len(second.skipped) == 2
    assert second.replays == 2
    assert column(resumed, "nanwatch/anomalies") == [1.0, 1.0, 2.0, 2.0]
    assert column(resumed, "nanwatch/skipped") == [1.0, 1.0, 2.0, 2.0]
    (path,) = reports(resumed.log_dir)  # the report covers the restored steps too
    report = Report.load(path)
    assert report.anomaly_count == 2 and [t.step for t in report.steps] == list(range(8))
    assert path.with_suffix(".html").stat().st_size > 0
    state = second.state_dict()
    assert state["step"] == 8 and state["anomaly_count"] == 2 and len(state["steps"]) == 8


# ---------------------------------------------------------------------- distributed
@pytest.mark.slow
def test_ddp_a_nan_on_one_rank_skips_on_both_at_the_same_step(tmp_path: Path) -> None:
    script = Path(__file__).with_name("_lightning_ddp.py")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")
        and not k.startswith("SLURM_")
    }
    env["PYTHONWARNINGS"] = "ignore"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), "skip", "ddp"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # rank 1 is its child: a hang is ended as a group
    )
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the DDP run hung (killed after 240 s):\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    r0, r1 = (json.loads((tmp_path / f"result-rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world"] == r1["world"] == 2
    assert r0["anomalies"] == [] and r1["anomalies"] == [2]  # only rank 1 saw it
    for r in (r0, r1):
        assert [e["step"] for e in r["skipped"]] == [2]  # both ranks skipped step 2
        assert r["notes"] == [
            {"rank": r["rank"], "world_size": 2, "ranks": [1], "first_ranks": [1], "action": "skip"}
        ]
        assert r["steps"] == [0, 1, 2, 3, 4] and r["finite"]
    assert r0["global_step"] == r1["global_step"] == 5
    assert r0["params"] == r1["params"]  # the replicas stayed identical
    logs = tmp_path / "lightning_logs" / "version_0"
    for rank in (0, 1):
        teardown = json.loads((tmp_path / f"teardown-rank{rank}.json").read_text())
        assert teardown["attached"] is False
        (path,) = reports(logs, rank)  # each rank wrote its own report
        assert teardown["reports"] == [str(path)]
        report = Report.load(path)
        assert report.rank == rank
        notes = [n.data for t in report.steps for n in t.notes if n.kind == "distributed"]
        assert notes and notes[0]["ranks"] == [1]
        skips = (logs / f"nanwatch-skipped-rank{rank}.jsonl").read_text().splitlines()
        assert [json.loads(s)["batch_idx"] for s in skips] == [2]


def test_a_training_step_that_calls_a_submodule_finds_a_bad_sample(tmp_path: Path) -> None:
    """The common pattern where training_step calls ``self.net(x)``, never ``self(x)``:
    the LightningModule's own forward never runs, and the batch reaches ``net`` from user
    code. A NaN in it is the data (NW401, sample 1), and no 'compiled model' notice."""
    torch.manual_seed(0)
    cb = NanWatchCallback(on_anomaly="warn")
    with pytest.warns(RuntimeWarning) as caught:
        fit(tmp_path, submodule_model_class(LP)(), cb, batches=4)
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "none of its modules ran" in m]
    assert any(m.startswith("nanwatch: step 2: NaN in the input data") for m in messages)
    nw = cb.watcher
    assert nw is not None
    a = nw.first_anomaly
    assert a is not None and a.step == 2 and a.path == "net"
    assert a.record.stat is not None and a.record.stat.bad_rows == (1,)
    assert next(t for t in nw.history if t.step == 2).diagnoses[0].code == "NW401"
    # the figure logged as max_logit is net's output (it was NaN at every step: "unknown")
    healthy = [t.max_logit for t in nw.history if t.step < 2]  # (warn applied the NaN)
    assert healthy and all(m is not None and math.isfinite(m) and m > 0 for m in healthy)


def test_with_accumulation_the_message_names_the_batch_and_the_optimizer_step(
    tmp_path: Path,
) -> None:
    """A NaN in batch 6, micro-batch 3 of optimizer step 1, decided at batch 7's optimizer
    step: the warning said "step 7" (the batch of the decision) while the report said 6."""
    cb = NanWatchCallback(on_anomaly="warn")
    with pytest.warns(RuntimeWarning, match=r"nanwatch: step 6 \(batch 6, optimizer step 1\)"):
        fit(tmp_path, Model(bad=[6]), cb, batches=8, accumulate_grad_batches=4)
    a = cb.watcher.first_anomaly if cb.watcher else None
    assert a is not None and a.step == 6


def test_manual_optimization_steps_are_the_batches(tmp_path: Path) -> None:
    """Two optimizers stepped by hand, a forward after the first one's step: before the
    callback's first nw.step() the automatic rule split batch 0 in two, and every step
    number after it was its batch + 1."""
    from torch.utils.data import DataLoader, TensorDataset

    class TwoOptimizers(L.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt_a, opt_b = self.optimizers()
            (x,) = batch
            opt_a.zero_grad()
            self.manual_backward(self.a(x).pow(2).mean())
            opt_a.step()
            opt_b.zero_grad()
            self.manual_backward(self.b(self.a(x).detach()).pow(2).mean())
            opt_b.step()

        def configure_optimizers(self) -> Any:
            sgd = torch.optim.SGD
            return [sgd(self.a.parameters(), lr=0.01), sgd(self.b.parameters(), lr=0.01)]

        def train_dataloader(self) -> Any:
            return DataLoader(TensorDataset(torch.randn(12, 4)), batch_size=4)

    cb = NanWatchCallback()
    fit(tmp_path, TwoOptimizers(), cb, batches=3)
    assert cb.watcher is not None and [t.step for t in cb.watcher.history] == [0, 1, 2]
