"""NanWatchCallback(on_anomaly="skip"): the updates are dropped and the weights stay clean,
so a later anomaly of another cause (bad data after a division by zero) is news of its own
and is said; the same cause in a later batch is only listed in the skip list."""

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

L = pytest.importorskip("lightning.pytorch")
from nanwatch.callbacks import NanWatchCallback  # noqa: E402


class Standardize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(dim=1, keepdim=True)) / x.std(dim=1, keepdim=True)


class Net(L.LightningModule):  # type: ignore[misc,name-defined]
    def __init__(self) -> None:
        super().__init__()
        self.norm = Standardize()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.norm(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _data(bad: bool) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
    if bad:
        x[9] = 0.0  # batch 2: a row that does not vary -> 0/0 in Standardize
        x[17, 3] = float("nan")  # batch 4: a missing value in the data
        x[25] = 0.0  # batch 6: the division by zero again
    return DataLoader(TensorDataset(x, y), batch_size=4)


def _fit(tmp_path: Path, cb: Any, bad: bool) -> list[str]:
    trainer = L.Trainer(
        callbacks=[cb],
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=importlib.import_module("lightning.pytorch.loggers").CSVLogger(tmp_path),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec).*")
        trainer.fit(Net(), _data(bad))
    return [str(w.message) for w in caught if str(w.message).startswith("nanwatch:")]


def test_skip_says_each_new_cause_once_and_lists_every_skipped_batch(tmp_path: Path) -> None:
    cb = NanWatchCallback(on_anomaly="skip")
    said = _fit(tmp_path, cb, bad=True)
    assert [e["batch_idx"] for e in cb.skipped] == [2, 4, 6]
    # before: only the first (step 2's division by zero); the NaN in the data at step 4, a
    # cause of its own with its own fix, was dropped in silence
    assert len(said) == 2, said
    assert said[0].startswith("nanwatch: step 2: NaN born in the forward of norm (Standardize)")
    assert "NW111" in said[0]
    assert said[1].startswith("nanwatch: step 4: NaN in the input data")
    assert "NW401" in said[1] and "updates with anomalies are skipped" in said[1]


def test_skip_on_clean_data_says_nothing(tmp_path: Path) -> None:
    cb = NanWatchCallback(on_anomaly="skip")
    assert _fit(tmp_path, cb, bad=False) == []
    assert cb.skipped == [] and cb.report_paths == []
