"""NanWatchCallback and validation: a value validation_step returns or logs that turns
NaN/inf (``val_loss`` nan while the training loss is fine) is said once per cause, with
where it came from: a norm's running statistic that holds NaN (named, with its fix), the
first module whose eval forward went bad (a replay of the validation batch in eval mode),
or the op of validation_step's own code (a metric divided by zero). A healthy validation
says nothing and adds no hook."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("lightning.pytorch")
from nanwatch.callbacks import NanWatchCallback  # noqa: E402

from nanwatch import AnomalyError  # noqa: E402


class Classifier(L.LightningModule):  # type: ignore[misc,name-defined]
    def __init__(self, eval_norm: bool = False, recall: bool = False) -> None:
        super().__init__()
        self.eval_norm = eval_norm
        self.recall = recall
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = F.relu(self.bn(self.fc1(x)))
        if not self.training and self.eval_norm:
            z = z / z.norm(dim=1, keepdim=True)  # unit embeddings for eval: 0/0 on a zero row
        return self.head(z)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        if self.recall:
            pred = logits.argmax(1)
            tp = ((pred == 0) & (y == 0)).sum()
            fn = ((pred != 0) & (y == 0)).sum()
            self.log("val_recall0", tp / (tp + fn))  # 0/0 when class 0 is absent

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader(seed: int, *, nan_at: int | None = None, no_class0: bool = False) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)
    if nan_at is not None:
        x[nan_at, 2] = float("nan")
    if no_class0:
        y[y == 0] = 1
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _fit(
    tmp_path: Path,
    model: Any,
    cb: Any,
    train: DataLoader[Any],
    val: DataLoader[Any],
    *,
    epochs: int = 1,
) -> tuple[list[str], Any]:
    trainer = L.Trainer(
        callbacks=[cb],
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        limit_train_batches=2,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train, val)
    return [str(w.message) for w in caught if str(w.message).startswith("nanwatch:")], trainer


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_running_statistic_a_skipped_nan_batch_left_is_named(tmp_path: Path, mode: str) -> None:
    # "skip" drops the update of the NaN training batch, but its train-mode forward had
    # folded the NaN into bn.running_mean/var already: every validation batch is NaN
    cb = NanWatchCallback(mode=mode, on_anomaly="skip")
    said, trainer = _fit(tmp_path, Classifier(), cb, _loader(0, nan_at=3), _loader(1), epochs=2)
    assert torch.isnan(trainer.callback_metrics["val_loss"])
    val = [s for s in said if "validation batch" in s]
    assert len(val) == 1, said  # once per cause, not at each batch or epoch
    msg = val[0]
    # before: nothing was said about the validation at all
    assert msg.startswith("nanwatch: validation batch 0: val_loss is NaN."), msg
    assert "bn.running_mean, bn.running_var (BatchNorm1d) hold NaN (32 of 32 values)" in msg, msg
    assert "training step 0 had NaN in the input data" in msg, msg
    assert "self.bn.reset_running_stats()" in msg, msg
    assert "training goes on" in msg


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_eval_only_branch_names_its_division(tmp_path: Path, mode: str) -> None:
    cb = NanWatchCallback(mode=mode)
    torch.manual_seed(0)
    model = Classifier(eval_norm=True)
    with torch.no_grad():
        model.bn.bias.fill_(-50.0)  # every ReLU output 0: training is finite (and learns nothing)
    said, trainer = _fit(tmp_path, model, cb, _loader(0), _loader(1))
    assert not torch.isfinite(trainer.callback_metrics["val_loss"])
    val = [s for s in said if "validation batch" in s]
    assert len(val) == 1, said
    assert "first bad in the eval forward:" in val[0], val[0]
    assert "born in the forward code of Classifier itself" in val[0], val[0]
    assert "aten.div.Tensor" in val[0] and "test_unseen_s7_lightning_validation.py:" in val[0]
    assert "NW111" in val[0], val[0]  # division by zero


def test_nan_feature_in_the_validation_set_is_bad_data(tmp_path: Path) -> None:
    cb = NanWatchCallback()
    said, _ = _fit(tmp_path, Classifier(), cb, _loader(0), _loader(1, nan_at=13))
    val = [s for s in said if "validation batch" in s]
    assert len(val) == 1, said
    assert val[0].startswith("nanwatch: validation batch 1: val_loss is NaN."), val[0]
    assert "NaN in the input data" in val[0] and "sample 5" in val[0], val[0]
    # an eval-mode forward reads the running statistics, it does not fold the batch in
    assert "the bad batch reached" not in val[0], val[0]


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_metric_divided_by_zero_names_the_line(tmp_path: Path, mode: str) -> None:
    cb = NanWatchCallback(mode=mode)
    model = Classifier(recall=True)
    said, trainer = _fit(tmp_path, model, cb, _loader(0), _loader(1, no_class0=True))
    assert torch.isfinite(trainer.callback_metrics["val_loss"])
    val = [s for s in said if "validation batch" in s]
    assert len(val) == 1, said
    assert val[0].startswith("nanwatch: validation batch 0: val_recall0 is NaN."), val[0]
    assert "every module's eval forward was finite" in val[0], val[0]
    assert 'self.log("val_recall0", tp / (tp + fn))' in val[0], val[0]
    assert "clamp_min(1)" in val[0]


def test_raise_mode_raises_after_the_validation_batch(tmp_path: Path) -> None:
    cb = NanWatchCallback(on_anomaly="raise")
    model = Classifier(recall=True)
    with pytest.raises(AnomalyError, match="val_recall0 is NaN"):
        _fit(tmp_path, model, cb, _loader(0), _loader(1, no_class0=True))
    assert model.fc1._forward_hooks == {} and model.bn._forward_hooks == {}


def test_healthy_validation_says_nothing_and_hooks_nothing(tmp_path: Path) -> None:
    seen: list[int] = []

    class Probe(L.Callback):  # type: ignore[misc,name-defined]
        def on_validation_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            seen.append(sum(len(m._forward_hooks) for m in pl_module.modules()))

    cb = NanWatchCallback()
    model = Classifier(recall=True)
    trainer = L.Trainer(
        callbacks=[cb, Probe()],
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _loader(0), _loader(1))
    assert torch.isfinite(trainer.callback_metrics["val_recall0"])
    assert not [w for w in caught if str(w.message).startswith("nanwatch:")]
    assert seen and not any(seen)  # the sanity check's and fit's validation batches
    assert cb._val_replays == 0


def test_an_internal_error_of_the_validation_check_leaves_training_watched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nanwatch.callbacks.lightning as lt

    def broken(*args: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(lt, "_val_values", broken)
    cb = NanWatchCallback(on_anomaly="skip")
    said, _ = _fit(tmp_path, Classifier(), cb, _loader(0, nan_at=11), _loader(1), epochs=2)
    assert sum("validation check (RuntimeError: boom)" in s for s in said) == 1, said
    assert [e["batch_idx"] for e in cb.skipped] == [1, 1]  # training still watched
    assert cb.watcher is not None and not cb.watcher.faults[:-1]
