"""nanwatch run on a Lightning script says the epoch and batch of the step, as the Lightning
callback does (batch indices start from 0 in every epoch: "step 9" alone does not say which
batch broke), read from the Trainer the script runs, and an lr fix names the scheduler that
Trainer steps; a script without Lightning gets none, and Lightning is not imported for it."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from nanwatch import cli

_LIGHTNING_SCRIPT = """\
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import {ns} as L


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.current_epoch == 2 and batch_idx == 1:
            x = x.clone()
            x[1, 2] = float("nan")  # a broken sample in the third epoch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=4)


torch.manual_seed(0)
trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=4, logger=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    enable_checkpointing=False, num_sanity_val_steps=0)
trainer.fit(Regressor())
"""

_SCHEDULED_SCRIPT = """\
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import lightning.pytorch as L


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1e4)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(48, 4, generator=g)), batch_size=8)


torch.manual_seed(0)
trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    enable_checkpointing=False, num_sanity_val_steps=0)
trainer.fit(Regressor())
"""

_PLAIN_SCRIPT = """\
import torch
m = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for it in range(3):
    x = torch.ones(4, 3)
    if it == 2:
        x[1, 0] = float("nan")
    m(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize("ns", ["lightning.pytorch", "pytorch_lightning"])
def test_run_on_a_lightning_script_names_the_epoch_and_batch(tmp_path: Path, ns: str) -> None:
    pytest.importorskip(ns)
    script = tmp_path / "train.py"
    script.write_text(_LIGHTNING_SCRIPT.format(ns=ns))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec).*")
        code = cli.main(
            ["run", "--on-anomaly", "warn", "--report-dir", str(tmp_path / "r"), str(script)]
        )
    assert code == 0
    said = [str(w.message) for w in caught if str(w.message).startswith("nanwatch: step")]
    assert said, [str(w.message) for w in caught]
    # 4 batches an epoch: the third epoch's batch 1 is step 9, as the callback says it
    assert said[0].startswith("nanwatch: step 9 (epoch 2, batch 1): NaN in the input data"), said[0]


def test_run_on_a_lightning_script_names_the_scheduler_its_trainer_steps(tmp_path: Path) -> None:
    pytest.importorskip("lightning.pytorch")
    script = tmp_path / "train.py"
    script.write_text(_SCHEDULED_SCRIPT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec).*")
        code = cli.main(
            ["run", "--on-anomaly", "warn", "--report-dir", str(tmp_path / "r"), str(script)]
        )
    assert code == 0
    fixes = [str(w.message) for w in caught if '["lr"] = ' in str(w.message)]
    assert fixes, [str(w.message) for w in caught]
    # configure_optimizers returned it: only the trainer holds it, and the fix reaches it there
    assert (
        'trainer.lr_scheduler_configs[0].scheduler.base_lrs = [g["lr"] for g in '
        "optimizer.param_groups]   # LambdaLR sets the lr from base_lrs"
    ) in fixes[0], fixes[0]


def test_run_on_a_plain_loop_names_no_batch_and_imports_no_lightning(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(_PLAIN_SCRIPT)
    probe = (
        "import sys, warnings\n"
        "from nanwatch import cli\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    code = cli.main(['run', '--on-anomaly', 'warn', '--report-dir', "
        f"{str(tmp_path / 'r')!r}, {str(script)!r}])\n"
        "print(code)\n"
        "print([str(w.message).splitlines()[0] for w in caught if 'nanwatch: step' in "
        "str(w.message)])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('lightning', 'pytorch_lightning')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        check=False,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    code, said, lightning = out.stdout.strip().splitlines()[-3:]
    assert code == "0"
    assert said.startswith("['nanwatch: step 2: NaN in the input data"), said
    assert lightning == "[]"  # looked for in sys.modules only: never imported for a script
