"""NanWatchCallback where Lightning holds what a plain loop holds itself: the lr scheduler
``configure_optimizers`` returns (an lr fix keeps its lower lr through the trainer's own
scheduler steps), and the sanity check's validation, which runs before the watching begins
(a crash there still leaves its post-mortem)."""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nanwatch
from nanwatch.report import Report
from tests._diagnoses import code_lines

BOTH = pytest.mark.parametrize("ns", ["lightning.pytorch", "pytorch_lightning"])


def _trainer(tmp_path: Path, callback: Any, ns: str, **options: Any) -> Any:
    mod = pytest.importorskip(ns)
    settings: dict[str, Any] = {
        "callbacks": [callback],
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        "num_sanity_val_steps": 0,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "log_every_n_steps": 1,
        "logger": importlib.import_module(f"{ns}.loggers").CSVLogger(tmp_path),
    }
    settings.update(options)
    return mod.Trainer(**settings)


def _fit(trainer: Any, model: Any) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec).*")
        trainer.fit(model)


def _labelled(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


# ------------------------------- the lr scheduler configure_optimizers returns


def _warmup_model(ns: str) -> Any:
    L = pytest.importorskip(ns)

    class Regressor(L.LightningModule):  # type: ignore[misc,name-defined]
        """SGD at an lr far too large, under a LambdaLR (a warmup schedule's class) that
        Lightning steps after every batch: only the trainer holds the scheduler."""

        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            return self.net(x).pow(2).mean()

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=1e4)
            warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

        def train_dataloader(self) -> DataLoader[Any]:
            g = torch.Generator().manual_seed(0)
            return DataLoader(TensorDataset(torch.randn(48, 4, generator=g)), batch_size=8)

    return Regressor()


@BOTH
def test_an_lr_fix_keeps_its_lr_under_the_scheduler_the_trainer_holds(
    tmp_path: Path, ns: str
) -> None:
    callback = nanwatch.callbacks.NanWatchCallback.for_namespace(ns)(
        on_anomaly="warn", postmortem=False, log_metrics=False
    )
    trainer = _trainer(tmp_path, callback, ns)
    with pytest.warns(RuntimeWarning, match="nanwatch: step"):
        _fit(trainer, _warmup_model(ns))
    assert callback.watcher is not None
    fixes = [d.fix for t in callback.watcher.history for d in t.diagnoses if '["lr"] = ' in d.fix]
    assert fixes, [d.code for t in callback.watcher.history for d in t.diagnoses]
    fix = fixes[0]
    # the scheduler is named by where the trainer keeps it: no frame of the loop holds it
    assert (
        'trainer.lr_scheduler_configs[0].scheduler.base_lrs = [g["lr"] for g in '
        "optimizer.param_groups]   # LambdaLR sets the lr from base_lrs"
    ) in fix, fix
    # the fix, run, keeps its lower lr through the scheduler's next steps
    optimizer = trainer.optimizers[0]
    lines = "\n".join(ln for ln in code_lines(fix).splitlines() if "lr" in ln)
    exec(lines, {"trainer": trainer, "optimizer": optimizer})
    lowered = optimizer.param_groups[0]["lr"]
    assert lowered < 1e4
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == lowered


# ------------------------------- a crash in the sanity check, before the watching begins


@BOTH
def test_a_crash_in_the_sanity_check_leaves_its_post_mortem(tmp_path: Path, ns: str) -> None:
    """The sanity check validates before ``on_train_start`` attaches the watcher: what it
    raises comes out of fit unchanged, and the post-mortem says it came from the sanity
    check, before any training step."""
    L = pytest.importorskip(ns)

    class Classifier(L.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 3)
            self.raised: list[BaseException] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            try:
                F.cross_entropy(self.net(x), y + 3)  # labels past the 3 classes
            except IndexError as exc:
                self.raised.append(exc)
                raise

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(_labelled(16), batch_size=4)

        def val_dataloader(self) -> DataLoader[Any]:
            return DataLoader(_labelled(8), batch_size=4)

    callback = nanwatch.callbacks.NanWatchCallback.for_namespace(ns)(report_dir=tmp_path / "nw")
    model = Classifier()
    trainer = _trainer(tmp_path, callback, ns, num_sanity_val_steps=2)
    with pytest.raises(IndexError, match="out of bounds") as info:
        _fit(trainer, model)
    assert model.raised == [info.value]  # the user's exception, unchanged
    (path,) = callback.report_paths
    assert path.parent == tmp_path / "nw"
    report = Report.load(path)
    assert report.error is not None and report.error["during"] == "the sanity check"
    assert report.headline.startswith(
        "IndexError (index out of range) during the sanity check, before step 0:"
    ), report.headline
    assert callback.watcher is not None and not callback.watcher.attached


# ------------------------------- an evaluation read late, under inference_mode


class _GatedLog(nn.Module):
    def forward(self, h: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return torch.log(h.abs() * gate) * 0  # a closed gate: log(0) = -inf, then NaN


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.head = _GatedLog()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x), x[:, :1].gt(100))


def test_an_inference_loop_read_late_names_the_op(tmp_path: Path, deferred: None) -> None:
    """What trainer.test and trainer.predict run under: inference tensors have no version
    counter, so a replay after the call ended cannot know its inputs unchanged. Read late
    (the accelerator path), an evaluation-only run reads each call as it returns, with its
    inputs at hand: the op is named, as on the CPU path."""
    model = _Net().eval()
    with (
        pytest.raises(
            nanwatch.AnomalyError, match=r"-inf born in the forward of head \(_GatedLog\)"
        ) as err,
        torch.inference_mode(),
        nanwatch.watch(model, report_dir=tmp_path),
    ):
        for i in range(3):
            # made inside inference_mode, as a loader's batch there is: an inference tensor
            x = torch.randn(4, 8) if i == 1 else torch.full((4, 8), 200.0)
            model(x)
    a = err.value.anomaly
    assert a is not None and a.step == 1 and a.path == "head"
    # the NaN of -inf * 0, and the log that made the -inf
    assert a.op is not None and a.op.op == "aten.mul.Tensor"
    assert a.op.cause is not None and a.op.cause.op == "aten.log.default"
