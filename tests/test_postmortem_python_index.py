"""An IndexError of a Python sequence (``sys.argv[1]``, ``batches[i]`` past the list's end)
is the user's code's, not a tensor index out of range: the post-mortem does not tell it of
class targets, embedding ids or device-side asserts. A tensor's own stays that class."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.report import Report


def _error(tmp_path: Path, fail: object) -> dict[str, object]:
    model = nn.Linear(3, 1)
    batches = [torch.randn(4, 3) for _ in range(2)]
    with pytest.raises(IndexError), nanwatch.watch(model, report_dir=str(tmp_path)) as nw:
        for i in range(3):
            x = batches[i] if fail == "list" else batches[i % 2]
            if fail == "tensor" and i == 2:
                x = x[:, torch.tensor([0, 1, 7])]
            model(x).pow(2).mean().backward()
            nw.step()
    files = sorted(tmp_path.glob("*.json"))
    assert files, "no post-mortem report written"
    report = Report.load(str(files[-1]))
    assert report.error is not None
    return report.error


def test_a_python_list_index_is_not_told_as_a_tensor_index(tmp_path: Path) -> None:
    error = _error(tmp_path, "list")
    assert error["class"] == "other", error
    assert "device-side assert" not in str(error["advice"])


def test_a_tensor_index_out_of_bounds_keeps_its_class(tmp_path: Path) -> None:
    error = _error(tmp_path, "tensor")
    assert error["class"] == "index-out-of-range", error
