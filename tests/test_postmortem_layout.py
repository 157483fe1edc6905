"""Post-mortem for two image-layout mistakes that surface as shape errors far from their
cause: a batch with its channels last (``[N, H, W, C]``, as PIL, NumPy and OpenCV give),
and one sample passed with no batch dim, which a convolution takes as unbatched so that the
Linear after the flatten fails. The advice names the layout and the permute or unsqueeze
that fixes it, not a layer rebuilt for the wrong size; the error reaches the user
unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.report import Report

MODES = ["sentinel", "watch"]


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 10))


def _error(tmp_path: Path, mode: str, x: torch.Tensor, match: str) -> dict[str, object]:
    model = _cnn()
    with (
        pytest.raises(RuntimeError, match=match) as info,
        nanwatch.watch(model, mode=mode, report_dir=str(tmp_path)) as nw,
    ):
        out = model(x)
        F.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long)).backward()
        nw.step()
    assert type(info.value) is RuntimeError
    (path,) = sorted(tmp_path.glob("*.json"))
    error = Report.load(path).error
    assert error is not None and error["class"] == "shape-mismatch"
    return error


@pytest.mark.parametrize("mode", MODES)
def test_a_channels_last_batch_gets_the_permute(tmp_path: Path, mode: str) -> None:
    advice = str(_error(tmp_path, mode, torch.randn(4, 16, 16, 3), "channels")["advice"])
    assert "has 16 at dim 1 and 3 in its last dim" in advice
    assert "x = x.permute(0, 3, 1, 2)" in advice
    assert "build it as" not in advice  # not a Conv2d rebuilt for 16 channels


@pytest.mark.parametrize("mode", MODES)
def test_one_sample_without_its_batch_dim_gets_the_unsqueeze(tmp_path: Path, mode: str) -> None:
    advice = str(_error(tmp_path, mode, torch.randn(3, 16, 16), "cannot be multiplied")["advice"])
    assert "the model's input has shape [3, 16, 16], one sample with no batch dim" in advice
    assert "0 (Conv2d) took it as an unbatched input" in advice
    assert "x = x.unsqueeze(0)" in advice
    assert "build it as" not in advice  # not a Linear rebuilt for 196 features


def test_a_batch_with_too_few_channels_still_gets_the_layer_it_fits(tmp_path: Path) -> None:
    advice = str(_error(tmp_path, "sentinel", torch.randn(4, 1, 16, 16), "channels")["advice"])
    assert "permute" not in advice and "unsqueeze" not in advice
    assert "build it as nn.Conv2d(1, 8, kernel_size=(3, 3))" in advice


def test_the_fixed_layouts_train_with_nothing_to_report() -> None:
    model = _cnn()
    with nanwatch.watch(model, mode="sentinel") as nw:
        for x in (torch.randn(4, 16, 16, 3).permute(0, 3, 1, 2), torch.randn(3, 16, 16)[None]):
            out = model(x)
            F.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long)).backward()
            nw.step()
    assert nw.report.diagnoses == [] and nw.report.error is None
