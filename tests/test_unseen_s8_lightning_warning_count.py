"""NanWatchCallback's ``warning_count`` (the logged ``nanwatch/warnings``) is the number of
early warnings said, one per code: a code that fires again at every later step is not
counted again, and two codes are two; a checkpoint keeps the count."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nanwatch

L = pytest.importorskip("lightning.pytorch")

from nanwatch.callbacks import NanWatchCallback  # noqa: E402  (after the importorskip)


class Forgetful(L.LightningModule):  # type: ignore[misc,name-defined]
    """Manual optimization that never calls ``opt.zero_grad()`` (NW307 at every step)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self.net(x), y))
        opt.step()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))
        return DataLoader(data, batch_size=4)


def test_a_warning_said_once_is_counted_once(tmp_path: Path) -> None:
    cb = NanWatchCallback(report_dir=tmp_path / "reports")
    trainer = L.Trainer(
        callbacks=[cb],
        accelerator="cpu",
        max_steps=6,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec).*")
        trainer.fit(Forgetful())
    said = [w for w in seen if issubclass(w.category, nanwatch.NanwatchWarning)]
    assert len(said) == 1, [str(w.message) for w in said]
    assert cb.watcher is not None
    fired = sum(
        1 for s in cb.watcher.history for d in s.diagnoses if d.code == "NW307"
    )  # at every step after the first
    assert fired >= 4
    # before: warning_count was 5 (the steps NW307 fired at), with one warning said
    assert cb.warning_count == len(said) == 1
    assert cb.state_dict()["warnings"] == 1
