"""A shape error in a layer that ran on the batches before: the batch changed, not the
model, and the post-mortem says so -- images of another size (resize them, or pool to a
fixed size), or a short last batch through a reshape that wrote the batch size in (named
with its line) -- instead of telling the user to rebuild a layer that was right."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.report import Report

HERE = os.path.basename(__file__)


def _report(tmp_path: Path) -> Report:
    files = sorted(tmp_path.glob("*.json"))
    assert files, "no post-mortem report written"
    return Report.load(str(files[-1]))


def _advice(tmp_path: Path) -> str:
    report = _report(tmp_path)
    assert report.error is not None and report.error["class"] == "shape-mismatch"
    return str(report.error["advice"])


def _train(model: nn.Module, batches: list[torch.Tensor], mode: str, tmp_path: Path) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        pytest.raises(RuntimeError),
        nanwatch.watch(model, mode=mode, report_dir=str(tmp_path)) as nw,
    ):
        for x in batches:
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()


def _convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 10 * 10, 2))


class _FixedView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.fc = nn.Linear(2 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        return self.fc(h.view(6, -1))  # the batch size written in


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_images_of_another_size_are_the_batchs_change_not_the_layers(
    tmp_path: Path, mode: str
) -> None:
    batches = [torch.randn(2, 3, 12, 12), torch.randn(2, 3, 12, 12), torch.randn(2, 3, 10, 10)]
    _train(_convnet(), batches, mode, tmp_path)
    said = _advice(tmp_path)
    assert "was built for in_features 400 and got it at step 1" in said, said
    assert "model's input had shape [2, 3, 12, 12]; this step's has shape [2, 3, 10, 10]" in said
    assert "the batch's shape changed, not the model" in said
    assert "AdaptiveAvgPool2d" in said
    assert "build it as" not in said  # the layer was right for every batch before


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_short_last_batch_names_the_reshape_that_wrote_the_batch_size_in(
    tmp_path: Path, mode: str
) -> None:
    torch.manual_seed(0)
    batches = [torch.randn(6, 1, 4, 4), torch.randn(6, 1, 4, 4), torch.randn(3, 1, 4, 4)]
    _train(_FixedView(), batches, mode, tmp_path)
    said = _advice(tmp_path)
    lines, start = inspect.getsourcelines(_FixedView.forward)
    line = start + next(i for i, text in enumerate(lines) if "h.view(6, -1)" in text)
    assert "only the batch size changed (6 to 3)" in said, said
    assert f"({HERE}:{line}: return self.fc(h.view(6, -1)))" in said, said
    assert "x.flatten(1)" in said and "drop_last=True" in said
    assert "build it as" not in said


def test_a_layer_wrong_from_the_first_step_is_still_rebuilt(tmp_path: Path) -> None:
    """No earlier step ran it: the layer itself is built for another size."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(7, 2))
    _train(model, [torch.randn(2, 3, 12, 12)], "watch", tmp_path)
    said = _advice(tmp_path)
    assert "build it as nn.Linear(400, 2)" in said, said
    assert "got it at step" not in said


def test_a_model_input_of_the_same_shape_keeps_the_rebuild_advice(tmp_path: Path) -> None:
    """Every batch had the same shape: what changed is not the batch."""

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 2)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            h = x if self.calls < 3 else torch.cat([x, x], 1)
            return self.fc(h)

    _train(Branchy(), [torch.randn(2, 8)] * 3, "watch", tmp_path)
    said = _advice(tmp_path)
    assert "got it at step" not in said and "build it as nn.Linear(16, 2)" in said, said
