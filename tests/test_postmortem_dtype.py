"""A dtype error in a watched layer: the post-mortem says the dtype of the layer's weights
against its input's, whether the model's input had it too, and where to cast (a float64
batch from numpy, integer pixels, a model made float64), not only "an op got a dtype it
does not take"."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.report import Report


def _advice(run: Callable[[], None], tmp_path: Path) -> str:
    with pytest.raises(RuntimeError):
        run()
    files = sorted(tmp_path.glob("*.json"))
    assert files, "no post-mortem report written"
    report = Report.load(str(files[-1]))
    assert report.error is not None and report.error["class"] == "dtype-error", report.error
    return str(report.error["advice"])


def _fit(model: nn.Module, x: torch.Tensor, mode: str, tmp_path: Path) -> Callable[[], None]:
    def run() -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with nanwatch.watch(model, mode=mode, report_dir=str(tmp_path)) as nw:
            loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()

    return run


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_float64_batch_from_numpy_is_cast_where_it_is_made(tmp_path: Path, mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((8, 4)))
    said = _advice(_fit(model, x, mode, tmp_path), tmp_path)
    assert said.startswith(
        "0 (Linear) has float32 weights, but its input is float64, the model's input "
        "(numpy's default dtype"
    ), said
    assert "x = x.float()" in said and "X.astype(np.float32)" in said


def test_integer_pixels_are_cast_and_scaled(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    x = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    said = _advice(_fit(model, x, "watch", tmp_path), tmp_path)
    assert said.startswith(
        "0 (Conv2d) has float32 weights, but its input is uint8 (raw pixel values, or token "
        "ids), the model's input: cast the batch where it is made, x = x.float() / 255"
    ), said


def test_a_model_made_float64_is_made_float32_again(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    said = _advice(_fit(model, torch.randn(3, 4), "watch", tmp_path), tmp_path)
    assert said.startswith(
        "0 (Linear) has float64 weights, but its input is float32, the model's input: the "
        "model is float64"
    ), said
    assert "model.float()" in said


def test_a_half_layer_inside_a_float32_model_names_the_layer(tmp_path: Path) -> None:
    """Only the model's second layer is float16: its input is the first layer's float32
    output, not the batch, so the model is made one dtype, not the batch cast."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    model[2].half()
    said = _advice(_fit(model, torch.randn(3, 4), "watch", tmp_path), tmp_path)
    assert said.startswith(
        "2 (Linear) has float16 weights, but its input is float32, made by the layers before "
        "it: the model mixes float16 and float32 weights"
    ), said
    assert "model.to(torch.float32)" in said and "torch.autocast" in said
    assert "batch" not in said


def test_a_dtype_error_outside_the_layers_keeps_the_general_advice(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)

    def run() -> None:
        with nanwatch.watch(model, report_dir=str(tmp_path)) as nw:
            out = model(torch.randn(2, 4))
            loss = (out @ torch.randn(4, 1, dtype=torch.float64)).sum()
            loss.backward()
            nw.step()

    said = _advice(run, tmp_path)
    assert said.startswith("An op got a dtype it does not take"), said
