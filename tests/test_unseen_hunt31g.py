"""Hunt 31g: real runs through the CLI, the post-mortem and the Lightning callback."""

from __future__ import annotations

import importlib
import io
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nanwatch
from nanwatch import cli
from nanwatch.render import report_summary
from nanwatch.report import Report


def _error(directory: Path) -> dict:
    (path,) = sorted(directory.glob("*.json"))
    return json.loads(path.read_text())["error"]


def _line_of(text: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i + 1 for i, ln in enumerate(lines) if ln.strip().startswith(text))


def _sqrt_of_zero_under_detect_anomaly(tmp_path: Path) -> nanwatch.Watcher:
    net = nn.Linear(8, 3)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    with (
        pytest.raises(RuntimeError, match="returned nan values"),
        torch.autograd.detect_anomaly(),
        nanwatch.watch(net, report_dir=str(tmp_path)) as nw,
    ):
        h = torch.sqrt(net(x).abs() * 0)  # its gradient at 0 is inf; inf * 0 is NaN
        F.cross_entropy(h, y).backward()
    return nw


def test_under_detect_anomaly_a_loss_codes_backward_birth_names_its_forward_line(
    tmp_path: Path,
) -> None:
    """torch.autograd.detect_anomaly() (Lightning's Trainer(detect_anomaly=True)) raises at
    the node after the one that made the inf; the node that made it keeps its forward line
    in anomaly mode, and the post-mortem names that line, not the backward() call."""
    _sqrt_of_zero_under_detect_anomaly(tmp_path)
    before = _error(tmp_path)["before"]
    assert before["op"] == "aten.sqrt"
    assert before["source"].endswith(f":{_line_of('h = torch.sqrt(net(x)')}")
    assert "in the backward of" in before["text"]


def test_the_report_read_after_a_crash_leads_with_what_was_born_before_it(
    tmp_path: Path,
) -> None:
    """``print(nw.report)`` after the ``with`` block says what the post-mortem file says: the
    inf born before the exception, and its diagnosis."""
    nw = _sqrt_of_zero_under_detect_anomaly(tmp_path)
    report = nw.report
    assert report.error is not None
    assert report.error["before"] == _error(tmp_path)["before"]
    assert report.error["advice"] == _error(tmp_path)["advice"]
    assert "NW112" in [d.code for d in report.diagnoses]


# ---------------------------------------------------------------------- Ctrl-C made an exit
def _shut_down(linked: bool) -> None:
    """What Lightning's Trainer does with a Ctrl-C: a graceful shutdown, then sys.exit(1)
    (``linked=False``: ``raise SystemExit(1) from None``, the link cut on purpose)."""
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        if linked:
            sys.exit(1)
        raise SystemExit(1) from None


@pytest.mark.parametrize("linked", [True, False])
def test_an_exit_made_of_a_ctrl_c_writes_the_interrupts_post_mortem(
    tmp_path: Path, linked: bool
) -> None:
    model = nn.Linear(4, 2)
    with pytest.raises(SystemExit) as info, nanwatch.watch(model, report_dir=str(tmp_path)):
        model(torch.randn(3, 4)).sum().backward()
        _shut_down(linked)
    assert info.value.code == 1  # the exit goes on as it was raised
    if not linked:
        assert not list(tmp_path.glob("*.json"))  # an exit on purpose: no post-mortem
        return
    err = _error(tmp_path)
    assert err["class"] == "keyboard-interrupt" and err["type"] == "builtins.KeyboardInterrupt"


def test_run_of_a_script_that_exits_on_ctrl_c_keeps_its_code_and_writes_one_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train_interrupted.py"
    script.write_text(
        "import sys\n"
        "import torch\n"
        "model = torch.nn.Linear(4, 2)\n"
        "for step in range(3):\n"
        "    x = torch.full((3, 4), float('nan')) if step == 0 else torch.randn(3, 4)\n"
        "    model(x).sum().backward()  # a NaN batch first, recorded\n"
        "    try:\n"
        "        if step == 1:\n"
        "            raise KeyboardInterrupt\n"
        "    except KeyboardInterrupt:\n"
        "        print('shutting down')\n"
        "        sys.exit(1)\n",
        encoding="utf-8",
    )
    reports = tmp_path / "reports"
    code = cli.main(["run", "--on-anomaly", "record", "--report-dir", str(reports), str(script)])
    assert code == 1
    (path,) = reports.glob("*.json")  # the post-mortem, and no end-of-run report beside it
    report = Report.load(path)
    assert report.error is not None and report.error["class"] == "keyboard-interrupt"
    assert report.anomaly_count == 1  # the NaN batch recorded before it
    captured = capsys.readouterr()
    assert "shutting down" in captured.out
    assert captured.err.count("report written") == 1


# ---------------------------------------------------------------------- Lightning
def _labelled(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


def _fit(tmp_path: Path, model: Any, callback: Any, ns: str, **options: Any) -> Any:
    mod = importlib.import_module(ns)
    trainer = mod.Trainer(
        callbacks=[callback],
        accelerator="cpu",
        devices=1,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
        logger=importlib.import_module(f"{ns}.loggers").CSVLogger(tmp_path),
        **options,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec).*")
        trainer.fit(model)
    return trainer


@pytest.mark.parametrize("ns", ["lightning.pytorch", "pytorch_lightning"])
def test_a_crash_in_validation_is_said_to_be_the_validations_not_a_training_steps(
    tmp_path: Path, ns: str
) -> None:
    """Validation runs unwatched between two training steps; a crash there is not the next
    training step's: the post-mortem says it was raised during validation, after the last
    training step, and the user's exception comes out of fit unchanged."""
    L = pytest.importorskip(ns)
    callback = nanwatch.callbacks.NanWatchCallback.for_namespace(ns)()

    class Classifier(L.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 3)
            self.raised: list[BaseException] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            if self.current_epoch == 1:
                y = y + 3  # the second epoch's validation labels run past the 3 classes
            try:
                F.cross_entropy(self.net(x), y)
            except IndexError as exc:
                self.raised.append(exc)
                raise

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(_labelled(16), batch_size=4)

        def val_dataloader(self) -> DataLoader[Any]:
            return DataLoader(_labelled(8), batch_size=4)

    model = Classifier()
    with pytest.raises(IndexError, match="out of bounds") as info:
        _fit(tmp_path, model, callback, ns, max_epochs=3)
    assert model.raised == [info.value]
    (path,) = callback.report_paths
    report = Report.load(path)
    assert report.error is not None and report.error["during"] == "validation"
    # 4 training steps an epoch: the second epoch's validation ran after step 7
    assert report.headline.startswith(
        "IndexError (index out of range) during validation, after step 7:"
    )
    out = io.StringIO()
    Console(file=out, width=300, no_color=True).print(report_summary(report, [path]))
    assert (
        "IndexError (index out of range) during validation, after step 7; post-mortem"
        in out.getvalue()
    )
    assert callback.watcher is not None and not callback.watcher.attached


@pytest.mark.parametrize("ns", ["lightning.pytorch", "pytorch_lightning"])
def test_a_nan_in_a_later_epoch_is_named_by_its_epoch_and_batch(tmp_path: Path, ns: str) -> None:
    """Batch indices start from 0 in every epoch: "batch 1" alone would point at the first
    epoch's; the message says which epoch's batch it was."""
    L = pytest.importorskip(ns)
    callback = nanwatch.callbacks.NanWatchCallback.for_namespace(ns)()

    class Regressor(L.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 3)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            if self.current_epoch == 2 and batch_idx == 1:
                x = x.clone()
                x[1, 2] = float("nan")  # a broken sample in the third epoch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(_labelled(16), batch_size=4)

    with pytest.warns(RuntimeWarning) as said:
        _fit(tmp_path, Regressor(), callback, ns, max_epochs=4)
    text = "\n".join(str(w.message) for w in said if "nanwatch: step" in str(w.message))
    # 4 batches an epoch: the third epoch's batch 1 is step 9, decided before update 9
    assert "nanwatch: step 9 (epoch 2, batch 1, optimizer step 9): NaN in the input data" in text
    assert callback.stopped_at == 9
