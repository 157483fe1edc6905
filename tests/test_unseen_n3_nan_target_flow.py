"""A NaN target read by a hand-written loss, ``((model(x) - y) ** 2).mean()``, when more
than one local of the user's frame holds the NaN: the table the batch was sliced from, the
batch itself, and the target column ``y``. The subtraction's node saves no operand, so the
one it read is told by the graph's data flow -- its shape broadcasts with the prediction's
to the shape the subtraction made -- and only ``y`` is named, not a guess among the three."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch

torch.set_num_threads(1)

MODES = ["watch", "sentinel"]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _table(missing: bool) -> torch.Tensor:
    torch.manual_seed(1)
    data = torch.randn(16, 5)  # four features and a target column
    if missing:
        data[3, 4] = float("nan")  # a label missing in the table
    return data


@pytest.mark.parametrize("mode", MODES)
def test_the_target_column_is_named_not_the_table_it_was_sliced_from(mode: str) -> None:
    model = _net()
    data = _table(missing=True)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        batch = data[:8]
        x, y = batch[:, :4], batch[:, 4:]
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        nw.step()
    assert batch.isnan().any() and data.isnan().any()  # three locals hold the NaN
    d = nw.report.diagnoses[0]
    assert d.title == "Non-finite tensor computed without gradients, read by the loss"
    text = " | ".join(d.evidence)
    assert "other operand of sub (y)" in text and "shape (8, 1)" in text
    assert "1 of y's 8 values" in text
    assert "keep = torch.isfinite(y)" in d.fix


def test_a_feature_local_with_a_nan_the_model_never_reads_is_not_named() -> None:
    # x_raw holds a NaN the model does not see (it is filled first); y holds one too:
    # the subtraction read y, whose shape fits; x_raw's does not
    model = _net()
    with nanwatch.watch(model, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
        x_raw, y = torch.randn(16, 4), torch.randn(16)
        x_raw[0, 1] = float("nan")
        y[5] = float("nan")
        x = torch.nan_to_num(x_raw)
        loss = ((model(x).squeeze(1) - y) ** 2).mean()
        loss.backward()
        nw.step()
    d = nw.report.diagnoses[0]
    text = " | ".join(d.evidence)
    assert "other operand of sub (y)" in text, text
    assert "x_raw" not in text


def test_the_table_with_its_missing_labels_masked_trains_clean() -> None:
    model = _net()
    data = _table(missing=True)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with nanwatch.watch(model, mode="watch", postmortem=False) as nw:
        for i in range(2):
            batch = data[8 * i : 8 * i + 8]
            x, y = batch[:, :4], batch[:, 4:]
            keep = torch.isfinite(y)
            loss = ((model(x) - y)[keep] ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    assert nw.report.diagnoses == []
