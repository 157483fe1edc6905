"""Under the Lightning callback the hints name the callback's arguments: there is no
``nanwatch.watch(...)`` call to add ``ignore=`` or ``mode='forensic'`` to, and no ``nw`` to
replay with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._lightning_models import submodule_model_class

pytest.importorskip("lightning.pytorch")

from nanwatch.callbacks import NanWatchCallback

from nanwatch.rules.base import Diagnosis, lightning_words
from tests.test_lightning import LP, fit

Submodule = submodule_model_class(LP)


class LogOfZero(Submodule):  # type: ignore[misc,valid-type]
    """Batch 1's loss takes the log of a softmax that is exactly 0 somewhere."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        if batch_idx == 1:
            p = torch.cat([out, out * 0 - 1e4], 1).softmax(-1)
            return -torch.log(p).mean()
        return torch.nn.functional.mse_loss(out, y)


def test_hints_under_the_callback_name_the_callback(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cb = NanWatchCallback(on_anomaly="skip")
    fit(tmp_path, LogOfZero(bad=False), cb, batches=3)
    nw = cb.watcher
    assert nw is not None and nw.anomalies
    ds = [d for t in nw.history for d in t.diagnoses]
    assert ds, "a diagnosis"
    for d in ds:
        assert d.front == "lightning"
        assert d.silence == f'NanWatchCallback(..., ignore=["{d.code}"])'
        assert "nw.replay(step_fn)" not in d.fix and "nanwatch.watch(" not in d.fix
        assert Diagnosis.from_dict(d.to_dict()).front == "lightning"
    summary = nw.anomalies[0].summary
    assert "nw.replay(step_fn)" not in summary


def test_lightning_words() -> None:
    assert lightning_words("mode='forensic' or nw.replay(step_fn) names it") == (
        "NanWatchCallback(mode='forensic') names it"
    )
    text = (
        "with nanwatch.watch(model, mode='forensic') as nw:   # every aten op checked\n"
        "    loss = criterion(model(x), y)   # names the op and line\n"
        "# or lower the lr"
    )
    out = lightning_words(text)
    assert "Trainer(callbacks=[NanWatchCallback(mode='forensic')])" in out
    assert "    loss = " not in out, "no body left under a with that is gone"
    assert out.endswith("# or lower the lr")
