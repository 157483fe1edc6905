"""NanWatchCallback: early warnings said as nanwatch.watch says them (once per code, a
NanwatchWarning, never stopping training, in the report and the logged figures), and the
micro-batches of an accumulation window that only add to gradients an earlier micro-batch
made NaN are not blamed."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nanwatch
from nanwatch.report import Report

L = pytest.importorskip("lightning.pytorch")

from nanwatch.callbacks import NanWatchCallback  # noqa: E402  (after the importorskip)


def fit(tmp_path: Path, model: Any, cb: Any, *, max_steps: int, **options: Any) -> Any:
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "max_steps": max_steps,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "logger": False,
        "default_root_dir": tmp_path,
    }
    settings.update(options)
    trainer = L.Trainer(callbacks=[cb], **settings)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec).*")
        trainer.fit(model)
    return trainer


class NoZeroGrad(L.LightningModule):  # type: ignore[misc,name-defined]
    """Manual optimization; ``reset=False`` forgets ``opt.zero_grad()``: every backward adds
    to the gradients of all the steps before (NW307)."""

    def __init__(self, reset: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.reset = reset

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        if self.reset:
            opt.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self.net(x), y))
        opt.step()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))
        return DataLoader(data, batch_size=4)


def test_an_early_warning_is_said_once_logged_and_reported_and_training_goes_on(
    tmp_path: Path,
) -> None:
    """A forgotten zero_grad() fired NW307 at every step, and the callback said nothing: no
    warning, no report, nothing logged (the watcher is set to "record")."""
    logger = L.loggers.CSVLogger(tmp_path, name="csv")
    cb = NanWatchCallback(report_dir=tmp_path / "reports")  # on_anomaly="stop"
    with pytest.warns(nanwatch.NanwatchWarning) as seen:
        trainer = fit(tmp_path, NoZeroGrad(reset=False), cb, max_steps=6, logger=logger,
                      log_every_n_steps=1)  # fmt: skip
    said = [str(w.message) for w in seen if isinstance(w.message, nanwatch.NanwatchWarning)]
    assert len(said) == 1, said  # once per code, although it fires at every step
    assert said[0].startswith("nanwatch: step 1: NW307 warning: Gradients never reset")
    assert "zero_grad()" in said[0]
    # a warning never stops or skips training
    assert trainer.global_step == 6 and cb.stopped_at is None and not cb.skipped
    assert cb.watcher is not None and not cb.watcher.anomalies
    (path,) = cb.report_paths
    report = Report.load(path)
    assert any(d.code == "NW307" for s in report.steps for d in s.diagnoses)
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        logged = [float(r["nanwatch/warnings"]) for r in csv.DictReader(f)]
    # the warnings said (one), not the steps NW307 fired at again (five)
    assert logged and logged[-1] == 1 == cb.warning_count and logged[0] <= logged[-1]


def test_a_healthy_loop_says_no_early_warning_and_writes_no_report(tmp_path: Path) -> None:
    cb = NanWatchCallback(report_dir=tmp_path / "reports")
    with warnings.catch_warnings():
        warnings.simplefilter("error", nanwatch.NanwatchWarning)
        fit(tmp_path, NoZeroGrad(reset=True), cb, max_steps=6)
    assert not cb.report_paths and cb.warning_count == 0
    assert not (tmp_path / "reports").exists()


class BadData(L.LightningModule):  # type: ignore[misc,name-defined]
    """An MLP on data whose batches ``bad`` hold one NaN feature."""

    def __init__(self, bad: tuple[int, ...]) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.bad = bad
        self.after: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.after.append(next(self.net.parameters()).detach().clone())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g)
        for b in self.bad:
            x[4 * b + 1, 3] = float("nan")
        return DataLoader(TensorDataset(x, y), batch_size=4)


@pytest.mark.parametrize(("bad", "listed"), [((5,), [5]), ((5, 7), [5, 7])])
def test_micro_batches_adding_to_a_nan_gradient_are_not_blamed(
    tmp_path: Path, bad: tuple[int, ...], listed: list[int]
) -> None:
    """accumulate_grad_batches=4, batch 5's data holds a NaN: batches 6 and 7 were said to
    have made NaN gradients (NW302) and listed as bad batches, though their backward was
    finite (they added to a .grad that held batch 5's NaN). A later batch with a NaN of
    its own is still listed."""
    cb = NanWatchCallback(on_anomaly="skip", report_dir=tmp_path)
    model = BadData(bad)
    with pytest.warns(RuntimeWarning, match="skipped") as seen:
        fit(tmp_path, model, cb, max_steps=3, accumulate_grad_batches=4)
    (entry,) = cb.skipped
    assert entry["bad_batches"] == listed and entry["batch_idx"] == 7
    assert "NaN in the input data" in entry["what"]
    said = "\n".join(str(w.message) for w in seen)
    assert "nanwatch: step 5 (batch 5, optimizer step 1)" in said
    assert "this update of batches 4-7 is dropped" in said
    nw = cb.watcher
    assert nw is not None
    codes = {t.step: [d.code for d in t.diagnoses] for t in nw.history}
    assert codes[5] == ["NW401"]
    assert codes[6] == [] and ("NW401" in codes[7]) == (7 in bad)
    assert [a.step for a in nw.anomalies] == listed
    # the window's update was dropped, the next one applied
    assert torch.equal(model.after[7], model.after[3])
    assert not torch.equal(model.after[11], model.after[7])
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_raise_under_accumulation_carries_the_bad_batchs_diagnosis(tmp_path: Path) -> None:
    cb = NanWatchCallback(on_anomaly="raise", report_dir=tmp_path)
    with pytest.raises(nanwatch.AnomalyError, match=r"step 5 \(batch 5") as err:
        fit(tmp_path, BadData((5,)), cb, max_steps=3, accumulate_grad_batches=4)
    assert [d.code for d in err.value.diagnoses] == ["NW401"]
    assert cb.watcher is not None and [a.step for a in cb.watcher.anomalies] == [5]
