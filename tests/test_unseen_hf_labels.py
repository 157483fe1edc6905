"""Class indices given to a multi-label loss (NW507): a target of one whole number per row
in [0, C) against C columns. A Hugging Face classifier does it itself when its labels are
float (it picks problem_type="multi_label_classification" from their dtype): the fix names
the labels and the config setting it kept, not 'make them the same shape'."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.errors import GuardError
from tests._hf import tiny_classifier

transformers = pytest.importorskip("transformers")


def _classifier(num_labels: int) -> nn.Module:
    return tiny_classifier("Bert", 64, num_labels=num_labels)


def test_float_labels_for_a_classifier_are_told_to_be_int64() -> None:
    model = _classifier(3)
    batch = {"input_ids": torch.randint(1, 100, (4, 16)), "labels": torch.tensor([0.0, 2, 1, 0])}
    with pytest.raises(GuardError) as info, nanwatch.watch(model, postmortem=False):
        model(**batch)
    err = info.value
    assert err.code == "NW507"
    assert (
        "the target holds one class index per row (whole numbers in 0..2) for the 3 columns: "
        "one class per row needs int64 class indices and cross-entropy, not a multi-label "
        "loss (batch['labels'] is float32)"
    ) in str(err)
    assert err.fix.splitlines() == [
        "batch['labels'] = batch['labels'].long()   # int64 class indices: the model then uses "
        "CrossEntropyLoss",
        "model.config.problem_type = None   # transformers set it to "
        "'multi_label_classification' from the float labels of the first batch",
    ]


def test_class_indices_to_a_functional_multi_label_loss() -> None:
    logits, y = torch.randn(5, 4), torch.tensor([0.0, 3, 1, 2, 2])
    with pytest.raises(GuardError) as info, nanwatch.watch(nn.Identity(), postmortem=False):
        F.binary_cross_entropy_with_logits(logits, y)
    assert "one class index per row (whole numbers in 0..3) for the 4 columns" in str(info.value)
    assert info.value.fix.splitlines()[0] == (
        "F.cross_entropy(logits, y.long())   # one class per row"
    )


def test_targets_that_are_not_class_indices_keep_the_shape_fix() -> None:
    logits, y = torch.randn(5, 4), torch.tensor([0.5, 3, 1, 2, 2])
    with pytest.raises(GuardError) as info, nanwatch.watch(nn.Identity(), postmortem=False):
        F.binary_cross_entropy_with_logits(logits, y)
    assert "class index" not in str(info.value)
    assert info.value.fix == "make logits and y the same shape"
