"""An attention mask (or token types) of another shape than the ids: the post-mortem advice
names the two tensors and their shapes, and how to make them together, where the error
itself says only that two sizes differ somewhere inside the model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.postmortem import classify
from tests._hf import tiny_classifier

transformers = pytest.importorskip("transformers")


def _bert() -> nn.Module:
    return tiny_classifier("Bert", 64)


@pytest.mark.parametrize(
    ("mask_shape", "said"),
    [((4, 12), "attention_mask is (4, 12)"), ((3, 16), "attention_mask is (3, 16)")],
)
def test_a_mask_of_another_shape_than_the_ids(
    tmp_path: Path, mask_shape: tuple[int, int], said: str
) -> None:
    model = _bert()
    ids = torch.randint(1, 100, (4, 16))
    mask = torch.ones(mask_shape, dtype=torch.long)
    mask[:, 8:] = 0  # padding: an all-ones mask is dropped by transformers, unread
    with (
        pytest.raises((RuntimeError, IndexError)) as info,
        nanwatch.watch(model, report_dir=tmp_path) as nw,
    ):
        model(input_ids=ids, attention_mask=mask)
    error = nw.report.to_dict()["error"]
    assert error["message"] == str(info.value)
    assert error["advice"].startswith(f"input_ids is (4, 16) but {said}: "), error["advice"]
    assert "tokenizer(texts, padding=True, truncation=True)" in error["advice"]


def test_inputs_of_one_shape_keep_the_generic_advice() -> None:
    class Fine(nn.Module):
        def forward(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return (input_ids * mask) @ torch.ones(3, 3, dtype=torch.long)

    try:
        Fine()(torch.ones(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long))
    except RuntimeError as exc:
        info = classify(exc)
    assert "token by token" not in info["advice"]
