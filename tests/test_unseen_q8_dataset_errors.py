"""An exception a Dataset's ``__getitem__`` raises while the DataLoader fetches a batch, under
``nanwatch run``: the post-mortem says it came from the dataset, not the model, with the
class, the index asked for and the dataset's length (in this process), or the worker and the
original error (a worker's re-raise, "Caught IndexError in DataLoader worker process 0."),
which is no tensor index and gets no advice about class targets or device-side asserts."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from nanwatch import cli
from nanwatch.postmortem import ADVICE, classify

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
        return len(self.seqs) + {extra}  # counts the header row of the file

    def __getitem__(self, i):
        return self.seqs[i], i % 3


model = nn.Sequential(nn.Embedding(100, 8), nn.Flatten(), nn.Linear(96, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(Tokens(), batch_size=4, num_workers={workers})
for x, y in loader:
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _run(tmp_path: Path, *, extra: int, workers: int) -> dict[str, object] | None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT.format(extra=extra, workers=workers))
    out = tmp_path / "r"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if extra:
            with pytest.raises(IndexError):  # the script's own exception, unchanged
                cli.main(["run", "--report-dir", str(out), str(script)])
        else:
            assert cli.main(["run", "--report-dir", str(out), str(script)]) == 0
    reports = sorted(out.glob("*.json")) if out.exists() else []
    if not reports:
        return None
    error = json.loads(reports[-1].read_text())["error"]
    assert isinstance(error, dict)
    return error


def test_an_index_error_in_getitem_names_the_dataset_the_index_and_its_length(
    tmp_path: Path,
) -> None:
    error = _run(tmp_path, extra=1, workers=0)
    assert error is not None
    # before: "The last modules that ran before the exception are listed."
    assert error["advice"] == (
        "Raised by the dataset, not the model: Tokens.__getitem__(16) at train.py:16, while "
        "the DataLoader fetched a batch; len(dataset) is 17 (Tokens.__len__), so its sampler "
        "asks for indices 0 to 16. Make __len__ count only the samples __getitem__ can read, "
        "or fix what index 16 reads at that line."
    ), error["advice"]


def test_a_workers_index_error_is_the_datasets_not_a_tensor_index(tmp_path: Path) -> None:
    error = _run(tmp_path, extra=1, workers=1)
    assert error is not None
    # before: classed 'index-out-of-range' (its traceback's text), advice about class targets,
    # token ids and 'device-side assert triggered'
    assert error["class"] == "other"
    assert str(error["advice"]).startswith(
        "Raised by the dataset, not the model: IndexError: list index out of range in its "
        "__getitem__ at train.py:16, in DataLoader worker process 0, while it fetched a batch. "
    ), error["advice"]
    assert "num_workers=0" in str(error["advice"])


def test_a_right_length_trains_clean_and_writes_no_report(tmp_path: Path) -> None:
    assert _run(tmp_path, extra=0, workers=0) is None


def test_a_workers_tensor_index_error_keeps_its_class() -> None:
    wrapped = IndexError(
        "Caught IndexError in DataLoader worker process 2.\nOriginal Traceback (most recent "
        'call last):\n  File "/x/data.py", line 3, in f\n    t[9]\nIndexError: index 9 is out '
        "of bounds for dimension 0 with size 4\n"
    )
    info = classify(wrapped)
    assert info["class"] == "index-out-of-range"  # a tensor's index, raised outside __getitem__
    assert info["advice"] == ADVICE["index-out-of-range"]
