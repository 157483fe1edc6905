"""An additive attention mask built as ``(1.0 - mask) * float("-inf")`` is NaN where the
mask keeps a position (0 x inf). NW401 names the user's line that made it; the anomaly's
headline (the localization) names the same line instead of blaming "the batch, or your
code" and sending the user to forensic mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from tests._hf import tiny_classifier

pytest.importorskip("transformers")

MODES = ["watch", "sentinel"]


def _bert() -> nn.Module:
    torch.manual_seed(0)
    return tiny_classifier("Bert", 64, num_labels=3)


@pytest.mark.parametrize("mode", MODES)
def test_the_headline_names_the_line_that_made_the_mask(mode: str) -> None:
    model = _bert()
    ids = torch.randint(1, 100, (4, 16))
    mask = torch.ones(4, 16)
    mask[:, 12:] = 0  # padding
    with nanwatch.watch(model, mode=mode, postmortem=False, on_anomaly="record") as nw:
        ext = (1.0 - mask[:, None, None, :]) * float("-inf")
        out = model(input_ids=ids, attention_mask=ext, labels=torch.tensor([0, 1, 2, 0]))
        out.loss.backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None
    assert "the batch, or your code" not in a.summary
    assert "mode='forensic'" not in a.summary
    assert "input.attention_mask of BertForSequenceClassification" in a.summary
    assert (
        ": computed by your code at " in a.summary
        and '(ext = (1.0 - mask[:, None, None, :]) * float("-inf")), not the batch' in a.summary
    ), a.summary
    d = nw.history[-1].diagnoses[0]
    assert d.code == "NW401"
    at = a.summary.split("computed by your code at ", 1)[1].split(" ", 1)[0]
    assert any(f"your code computed it at {at}:" in e for e in d.evidence), (at, d.evidence)


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_mask_from_the_batch_keeps_the_general_headline(mode: str) -> None:
    model = _bert()
    ids = torch.randint(1, 100, (4, 16))
    ext = torch.zeros(4, 1, 1, 16)
    ext[:, :, :, 3] = float("nan")  # a broken batch: no line of the user's made it
    with nanwatch.watch(model, mode=mode, postmortem=False, on_anomaly="record") as nw:
        out = model(input_ids=ids, attention_mask=ext, labels=torch.tensor([0, 1, 2, 0]))
        out.loss.backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None
    assert "computed by your code at" not in a.summary
