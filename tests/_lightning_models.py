"""Tiny LightningModules for the callback's tests (Lightning's BoringModel pattern), built
per namespace: a LightningModule of one namespace is rejected by the other's Trainer."""

from __future__ import annotations

import functools
import importlib
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Blowup(nn.Module):
    """Passes its input through; when switched on, log(x * 0) * 0 = -inf * 0 = NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.on:
            return x
        return torch.log(x * 0) * 0


def dataset(n: int = 64, features: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, features, generator=g))


@functools.cache
def model_class(namespace: str) -> type[Any]:
    L = importlib.import_module(namespace)

    class TinyModel(L.LightningModule):  # type: ignore[misc,name-defined]
        """A Linear (and a Blowup) on random data; ``bad``: batch indices whose forward
        makes NaN (on ``bad_rank`` only, when given); ``transient``: only the first time a
        batch runs (its replay is then clean); ``detached``: the NaN is in a side branch
        that reaches neither the loss nor the gradients (what one rank alone sees);
        ``bad_test``: batch indices of ``trainer.test`` whose forward makes NaN."""

        def __init__(
            self,
            bad: Iterable[int] = (),
            *,
            transient: bool = False,
            bad_rank: int | None = None,
            detached: bool = False,
            fail_at: int | None = None,
            bad_test: Iterable[int] = (),
            batch_size: int = 4,
        ) -> None:
            super().__init__()
            self.layer = nn.Linear(32, 2)
            self.blowup = Blowup()
            self.bad = set(bad)
            self.transient = transient
            self.bad_rank = bad_rank
            self.detached = detached
            self.fail_at = fail_at
            self.bad_test = set(bad_test)
            self.batch_size = batch_size
            self.calls: Counter[int] = Counter()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.layer(x)
            if self.detached:
                self.blowup(h.detach())
                return h
            return self.blowup(h)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            self.calls[batch_idx] += 1
            if batch_idx == self.fail_at:
                raise RuntimeError("boom: the data loader handed over a broken batch")
            on = batch_idx in self.bad
            if self.transient:
                on = on and self.calls[batch_idx] == 1
            if self.bad_rank is not None:
                on = on and self.global_rank == self.bad_rank
            self.blowup.on = on
            out = self(x)
            loss = F.mse_loss(out.float(), torch.ones_like(out, dtype=torch.float32))
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            (x,) = batch
            self.blowup.on = False
            self.log("val_loss", self(x).float().pow(2).mean())

        def test_step(self, batch: Any, batch_idx: int) -> None:
            (x,) = batch
            self.blowup.on = batch_idx in self.bad_test
            self.log("test_loss", self(x).float().pow(2).mean())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(dataset(), batch_size=self.batch_size)

        def val_dataloader(self) -> DataLoader[Any]:
            return DataLoader(dataset(16), batch_size=self.batch_size)

        def test_dataloader(self) -> DataLoader[Any]:
            return DataLoader(dataset(16), batch_size=self.batch_size)

    return TinyModel


def labelled(n: int = 64, features: int = 32, classes: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)
    )


@functools.cache
def classifier_class(namespace: str) -> type[Any]:
    L = importlib.import_module(namespace)

    class TinyClassifier(L.LightningModule):  # type: ignore[misc,name-defined]
        """A Linear over 3 classes whose loss gets a bad target in batch ``bad_at``:
        ``loss="module"``: ``nn.CrossEntropyLoss`` (a submodule) and a class index of 255;
        ``"functional"``: ``F.cross_entropy`` and 255; ``"broadcast"``: ``F.mse_loss`` of an
        (N, 1) prediction against an (N,) target (an (N, 1) one in the other batches)."""

        def __init__(self, loss: str = "module", bad_at: int | None = None) -> None:
            super().__init__()
            self.layer = nn.Linear(32, 3)
            self.criterion = nn.CrossEntropyLoss()
            self.loss = loss
            self.bad_at = bad_at
            self.raised: list[BaseException] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            try:
                return self._loss(batch, batch_idx)
            except Exception as exc:
                self.raised.append(exc)  # the very object, to compare with what fit raises
                raise

        def _loss(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            bad = batch_idx == self.bad_at
            logits = self(x)
            if self.loss == "broadcast":
                target = y.float() if bad else y.float().unsqueeze(1)
                return F.mse_loss(logits[:, :1], target)
            if bad:
                y = y.clone()
                y[1] = 255  # a "void" label of a segmentation dataset
            if self.loss == "functional":
                return F.cross_entropy(logits, y)
            return self.criterion(logits, y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(labelled(), batch_size=4)

    return TinyClassifier


@functools.cache
def submodule_model_class(namespace: str) -> type[Any]:
    """A LightningModule whose training_step calls ``self.net(x)``, never ``self(x)``; batch
    2 holds a NaN in sample 1 when built with ``bad=True``."""
    L = importlib.import_module(namespace)

    class SubmoduleModel(L.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self, bad: bool = True) -> None:
            super().__init__()
            self.bad = bad
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            if self.bad and batch_idx == 2:
                x = x.clone()
                x[1, 3] = float("nan")
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> Any:
            g = torch.Generator().manual_seed(0)
            data = TensorDataset(torch.randn(40, 8, generator=g), torch.randn(40, 1, generator=g))
            return DataLoader(data, batch_size=8)

    return SubmoduleModel
