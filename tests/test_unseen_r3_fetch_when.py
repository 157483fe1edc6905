"""An exception raised while the DataLoader fetches a batch (a Dataset's ``__getitem__``)
under ``nanwatch run``: the post-mortem's "when" says it was the fetch of the next batch,
after the last step's update and before the next step's forward (or the first batch,
before step 0), not "after the optimizer step, step N"; in every mode."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from nanwatch import cli
from nanwatch.report import Report, error_when

_SCRIPT = """\
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Tokens(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.seqs = [torch.randint(0, 100, (12,), generator=g) for _ in range(16)]

    def __len__(self):
        return len(self.seqs) + {extra}

    def __getitem__(self, i):
        return self.seqs[i - {shift}], i % 3


model = nn.Sequential(nn.Embedding(100, 8), nn.Flatten(), nn.Linear(96, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(Tokens(), batch_size=4)
for x, y in loader:
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _report(tmp_path: Path, mode: str, *, extra: int = 1, shift: int = 0) -> Report | None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT.format(extra=extra, shift=shift))
    out = tmp_path / "r"
    argv = ["run", "--mode", mode, "--report-dir", str(out), str(script)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if extra or shift:
            with pytest.raises(IndexError):  # the script's own exception, unchanged
                cli.main(argv)
        else:
            assert cli.main(argv) == 0
    reports = sorted(out.glob("*.json")) if out.exists() else []
    return Report.load(reports[-1]) if reports else None


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_a_crash_in_getitem_is_the_fetch_of_the_next_batch(tmp_path: Path, mode: str) -> None:
    report = _report(tmp_path, mode)
    assert report is not None and report.error is not None
    # before: "IndexError (exception) after the optimizer step, step 3: list index out of range"
    assert report.headline == (
        "IndexError (exception) while the DataLoader fetched the next batch, after step 3's "
        "update, before step 4's forward: list index out of range"
    ), report.headline


def test_a_crash_fetching_the_first_batch_is_before_step_0(tmp_path: Path) -> None:
    report = _report(tmp_path, "watch", extra=0, shift=100)
    assert report is not None and report.error is not None
    # before: "IndexError (exception), step 0: list index out of range"
    assert report.headline == (
        "IndexError (exception) while the DataLoader fetched the first batch, before step "
        "0's forward: list index out of range"
    ), report.headline


def test_a_healthy_loader_writes_no_report(tmp_path: Path) -> None:
    assert _report(tmp_path, "watch", extra=0) is None


def test_when_words() -> None:
    assert error_when({"step": 3, "fetching": "after-step"}) == (
        " while the DataLoader fetched the next batch, after step 3, before step 4"
    )
    assert error_when({"step": 3}) == ", step 3"
    # paused watching says what ran then
    assert error_when({"step": 3, "during": "validation", "fetching": "after-update"}) == (
        " during validation, after step 2"
    )
