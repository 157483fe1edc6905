"""NanWatchCallback in sentinel mode when training_step calls a submodule (``self.net(x)``),
never the LightningModule itself: sentinel watches only the LightningModule's own call, so no
watched output got a gradient, and the gradients were never read after backward (the logged
``nanwatch/grad_norm`` was NaN on every step, and a NaN born in backward was found only in
the weights, after the update)."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests._lightning_models import submodule_model_class

pytest.importorskip("lightning.pytorch")

from nanwatch.callbacks import NanWatchCallback

from tests.test_lightning import LP, fit

Submodule = submodule_model_class(LP)


class _NanInBackward(torch.autograd.Function):
    """Identity in forward; a NaN gradient in backward (a backward-only blow-up)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * float("nan")


class BackwardNaN(Submodule):  # type: ignore[misc,valid-type]
    """Batch 1's backward is NaN; its forward and loss are finite."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        if batch_idx == 1:
            out = _NanInBackward.apply(out)
        return F.mse_loss(out, y)


def _rows(trainer: Any) -> list[dict[str, str]]:
    with (Path(trainer.logger.log_dir) / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("accumulate", [1, 3])
def test_sentinel_logs_the_gradient_norm_of_a_submodule_step(
    tmp_path: Path, accumulate: int
) -> None:
    torch.manual_seed(0)
    cb = NanWatchCallback(mode="sentinel")
    trainer = fit(
        tmp_path,
        Submodule(bad=False),
        cb,
        batches=5,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=0.5,
    )
    nw = cb.watcher
    assert nw is not None and not nw.anomalies
    assert all(t.grad_norm is not None and t.grad_norm > 0 for t in nw.history)
    rows = _rows(trainer)
    logged = [float(r["nanwatch/grad_norm"]) for r in rows if r.get("nanwatch/grad_norm")]
    assert len(logged) == -(-5 // accumulate)  # one a window; the last one is partial
    assert all(math.isfinite(g) and g > 0 for g in logged)
    # the figure of the step that held the update's backward (each window's last batch)
    ends = [t.grad_norm for t in nw.history if (t.step + 1) % accumulate == 0 or t.step == 4]
    assert logged == pytest.approx(ends, rel=1e-6)
    # max_logit: unknown at step 0 (the LightningModule's own call never runs); from the
    # first backward on, sentinel watches net, the part training_step calls, and its output
    first, *rest = nw.history
    assert first.max_logit is None and all(t.max_logit for t in rest)
    maxima = [float(r["nanwatch/max_logit"]) for r in rows if r.get("nanwatch/max_logit")]
    assert maxima == pytest.approx([t.max_logit for t in rest if t.grad_norm in ends], rel=1e-6)


def test_sentinel_finds_a_nan_gradient_before_the_update(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cb = NanWatchCallback(mode="sentinel", on_anomaly="skip")
    model = BackwardNaN(bad=False)
    # net, the part training_step calls, is watched from the first backward on: the NaN is
    # seen where it arrives, at net's output, before the weights' gradients
    arrived = r"nanwatch: step 1: NaN gradient arrived at the output of net from code outside"
    with pytest.warns(RuntimeWarning, match=arrived):
        fit(tmp_path, model, cb, batches=3)
    nw = cb.watcher
    assert nw is not None and nw.first_anomaly is not None
    assert nw.first_anomaly.step == 1
    assert [e["batch_idx"] for e in cb.skipped] == [1]
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the update dropped
