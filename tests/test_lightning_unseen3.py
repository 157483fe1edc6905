"""NanWatchCallback drops an update ("skip"/"stop") also when Lightning clips gradients by
value, whose ``clip_grad_value_`` raises on an optimizer whose gradients are all None."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tests._lightning_models import model_class

L = pytest.importorskip("lightning.pytorch")

from nanwatch.callbacks import NanWatchCallback  # noqa: E402  (after the importorskip)


@pytest.mark.parametrize("algorithm", ["value", "norm"])
@pytest.mark.parametrize("action", ["skip", "stop"])
def test_dropped_update_survives_gradient_clipping(
    tmp_path: Path, algorithm: str, action: str
) -> None:
    torch.manual_seed(0)
    model = model_class("lightning.pytorch")(bad=[2])
    cb = NanWatchCallback(on_anomaly=action, report_dir=str(tmp_path))
    trainer = L.Trainer(
        callbacks=[cb],
        accelerator="cpu",
        max_steps=5,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=tmp_path,
        gradient_clip_val=0.5,
        gradient_clip_algorithm=algorithm,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert "configure_gradient_clipping" not in vars(model)  # the one-step no-op is gone
    if action == "skip":
        assert [e["batch_idx"] for e in cb.skipped] == [2]
        assert trainer.global_step == 5
    else:
        assert cb.stopped_at is not None
