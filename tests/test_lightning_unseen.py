"""NanWatchCallback in Lightning runs the first tests did not cover: two optimizers stepped
by hand (a GAN) under "skip", and the loss recorded under gradient accumulation."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests._lightning_models import model_class

L = pytest.importorskip("lightning.pytorch")

from nanwatch.callbacks import NanWatchCallback  # noqa: E402  (after the importorskip)


def fit(tmp_path: Path, model: Any, *cbs: Any, batches: int, **options: Any) -> Any:
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
        "logger": False,
        "default_root_dir": tmp_path,
    }
    settings.update(options)
    trainer = L.Trainer(callbacks=list(cbs), **settings)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec).*")
        trainer.fit(model)
    return trainer


class GAN(L.LightningModule):  # type: ignore[misc,name-defined]
    """A generator and a discriminator, each with its own optimizer, stepped by hand (the
    discriminator first). In the batches of ``bad_d`` the discriminator saturates on the
    fakes: log(1 - 1) = -inf, and its gradients are NaN; in those of ``bad_g`` the
    generator's loss takes log(0) of a saturated D: its own gradients are NaN."""

    def __init__(self, bad_d: tuple[int, ...] = (), bad_g: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        self.bad_d, self.bad_g = bad_d, bad_g
        self.after: list[tuple[torch.Tensor, torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        fake = self.G(torch.randn(real.size(0), 4))
        d_fake = torch.sigmoid(self.D(fake.detach()) * (1e4 if batch_idx in self.bad_d else 1))
        loss_d = -(torch.log(torch.sigmoid(self.D(real))) + torch.log(1 - d_fake)).mean()
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        d_gen = torch.sigmoid(self.D(fake) * (-1e4 if batch_idx in self.bad_g else 1))
        loss_g = -torch.log(d_gen).mean()
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        self.after.append((self.G[0].weight.detach().clone(), self.D[0].weight.detach().clone()))

    def configure_optimizers(self) -> Any:
        adam = torch.optim.Adam
        return [adam(self.G.parameters(), lr=1e-3), adam(self.D.parameters(), lr=1e-3)]

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(40, 8, generator=g)), batch_size=8)


def test_skip_drops_only_the_discriminators_bad_update_of_a_gan_batch(tmp_path: Path) -> None:
    """The discriminator's gradients are NaN in batch 2, the generator's are finite: the
    generator's update used to be dropped too, and the batch was listed twice (once per
    optimizer step)."""
    torch.manual_seed(0)
    cb = NanWatchCallback(on_anomaly="skip")
    gan = GAN(bad_d=(2,))
    with pytest.warns(RuntimeWarning, match="skipped"):
        trainer = fit(tmp_path, gan, cb, batches=4)
    (g1, d1), (g2, d2), (g3, d3) = gan.after[1:4]
    assert torch.equal(d2, d1)  # the discriminator's NaN update was dropped
    assert not torch.equal(g2, g1)  # the generator's clean one went through
    assert not torch.equal(d3, d2) and not torch.equal(g3, g2)  # and training goes on
    assert all(torch.isfinite(p).all() for p in gan.parameters())
    assert [(e["batch_idx"], e["global_step"]) for e in cb.skipped] == [(2, 4)]
    lines = (Path(trainer.log_dir) / "nanwatch-skipped-rank0.jsonl").read_text().splitlines()
    assert len(lines) == 1


def test_skip_drops_both_updates_when_both_optimizers_gradients_are_bad(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    cb = NanWatchCallback(on_anomaly="skip")
    gan = GAN(bad_d=(2,), bad_g=(2,))
    with pytest.warns(RuntimeWarning, match="skipped"):
        fit(tmp_path, gan, cb, batches=4)
    (g1, d1), (g2, d2) = gan.after[1:3]
    assert torch.equal(d2, d1) and torch.equal(g2, g1)
    assert all(torch.isfinite(p).all() for p in gan.parameters())
    assert [(e["batch_idx"], e["global_step"]) for e in cb.skipped] == [(2, 4)]


def test_the_recorded_loss_is_the_users_under_gradient_accumulation(tmp_path: Path) -> None:
    """Lightning divides the loss it hands to on_train_batch_end by accumulate_grad_batches:
    the history, the report and the logged figures held loss / 4."""

    class Recording(model_class("lightning.pytorch")):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.losses.append(float(loss.detach()))
            return loss

    model = Recording()
    cb = NanWatchCallback()
    fit(tmp_path, model, cb, batches=8, accumulate_grad_batches=4)
    nw = cb.watcher
    assert nw is not None and len(model.losses) == 8
    assert [t.loss for t in nw.history] == model.losses


class ManualAccumulation(L.LightningModule):  # type: ignore[misc,name-defined]
    """Manual optimization that steps every second batch; batch ``bad``'s input is NaN."""

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.lin = nn.Linear(8, 1)
        self.bad = bad
        self.after: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (x,) = batch
        opt = self.optimizers()
        if batch_idx == self.bad:
            x = x * float("nan")
        self.manual_backward(self.lin(x).pow(2).mean())
        if batch_idx % 2 == 1:
            opt.step()
            opt.zero_grad()
        self.after.append(self.lin.weight.detach().clone())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(48, 8, generator=g)), batch_size=8)


def test_a_batch_decided_at_its_end_leaves_the_next_batchs_update_to_its_own_check(
    tmp_path: Path,
) -> None:
    """Batch 2 (no optimizer step) is decided at its end; its NaN gradients reach batch 3's
    step, which must still be checked, dropped and listed on its own."""
    cb = NanWatchCallback(on_anomaly="skip")
    model = ManualAccumulation(bad=2)
    with pytest.warns(RuntimeWarning, match="skipped"):
        fit(tmp_path, model, cb, batches=6)
    assert all(torch.isfinite(w).all() for w in model.after)
    assert torch.equal(model.after[3], model.after[1])  # the window's update was dropped
    assert not torch.equal(model.after[5], model.after[3])
    assert [(e["batch_idx"], e["global_step"]) for e in cb.skipped] == [(3, 1)]


class LogZero(L.LightningModule):  # type: ignore[misc,name-defined]
    """A hand-written log-loss in training_step; batch 1's logits saturate the softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        logits = self.net(x) * (1e4 if batch_idx == 1 else 1.0)
        p = torch.softmax(logits, dim=-1)
        return -torch.log(p)[:, 0].mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=4)


def test_a_loss_lightning_backpropagates_is_not_said_to_be_the_users_backward_call(
    tmp_path: Path,
) -> None:
    cb = NanWatchCallback(on_anomaly="warn", report_dir=str(tmp_path))
    with pytest.warns(RuntimeWarning):
        fit(tmp_path, LogZero(), cb, batches=3)
    a = cb.watcher.first_anomaly
    assert a is not None and "(backward by Lightning, called from " in a.summary
    assert "loss.backward() at" not in a.summary
