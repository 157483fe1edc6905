"""Post-mortem for a recurrent layer given inputs with another number of features than its
``input_size`` ("input.size(-1) must be equal to input_size. Expected 8, got 12"): the
layer, what it was built for, what it got and from which module, and either the layer
rebuilt with its own options or, for the (batch, features, steps) layout a 1-d convolution
gives, the transpose. The error reaches the user unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.report import Report

MODES = ["sentinel", "watch"]


class Tagger(nn.Module):
    def __init__(self, rnn: nn.RNNBase, features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(6, features)
        self.rnn = rnn
        self.head = nn.Linear(rnn.hidden_size * (2 if rnn.bidirectional else 1), 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.proj(x))
        return self.head(h[:, -1])


class ConvTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(6, 8, 3, padding=1)
        self.rnn = nn.GRU(8, 16, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, channels, steps)
        h, _ = self.rnn(self.conv(x))
        return self.head(h[:, -1])


def _advice(tmp_path: Path, mode: str, model: nn.Module, x: torch.Tensor) -> str:
    with (
        pytest.raises(RuntimeError, match="must be equal to input_size") as info,
        nanwatch.watch(model, mode=mode, report_dir=str(tmp_path)) as nw,
    ):
        model(x).sum().backward()
        nw.step()
    assert type(info.value) is RuntimeError
    (path,) = sorted(tmp_path.glob("*.json"))
    error = Report.load(path).error
    assert error is not None and error["class"] == "shape-mismatch"
    return str(error["advice"])


@pytest.mark.parametrize("mode", MODES)
def test_an_lstm_built_for_other_features_is_rebuilt_with_its_options(
    tmp_path: Path, mode: str
) -> None:
    torch.manual_seed(0)
    model = Tagger(nn.LSTM(8, 16, num_layers=2, batch_first=True, bidirectional=True), 12)
    advice = _advice(tmp_path, mode, model, torch.randn(4, 10, 6))
    assert advice.startswith("rnn (LSTM) was built for input_size 8, but its input (shape")
    assert "has 12: build it as nn.LSTM(12, 16, num_layers=2, batch_first=True, " in advice
    assert "bidirectional=True) where the model creates rnn, or make what comes before" in advice


@pytest.mark.parametrize("mode", MODES)
def test_conv_features_in_dim_1_get_the_transpose(tmp_path: Path, mode: str) -> None:
    torch.manual_seed(0)
    advice = _advice(tmp_path, mode, ConvTagger(), torch.randn(4, 6, 50))
    assert "rnn (GRU) was built for input_size 8, but its input (shape [4, 8, 50]" in advice
    assert "has 50 in its last dim and 8 in dim 1: its features are in dim 1" in advice
    assert "x = x.transpose(1, 2) before it" in advice
    assert "build it as" not in advice  # not a GRU rebuilt for 50 features


def test_the_fixed_models_train_with_nothing_to_report(tmp_path: Path) -> None:
    torch.manual_seed(0)

    class Fixed(ConvTagger):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, _ = self.rnn(self.conv(x).transpose(1, 2))
            return self.head(h[:, -1])

    for model, x in (
        (Tagger(nn.LSTM(12, 16, num_layers=2, batch_first=True), 12), torch.randn(4, 10, 6)),
        (Fixed(), torch.randn(4, 6, 50)),
    ):
        with nanwatch.watch(model, report_dir=str(tmp_path)) as nw:
            model(x).sum().backward()
            nw.step()
        assert nw.report.diagnoses == []
    assert not list(tmp_path.glob("*.json"))
