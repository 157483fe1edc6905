"""Without guards, the post-mortem of an index error raised by a position table on an
input short enough for it says what NW513's guard says: negative positions (left padding
given positions by attention_mask.cumsum(-1) - 1) or positions carrying an offset
(counting on across packed sequences), with the user's variable in the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.errors import GuardError


class Packed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(100, 16)
        self.pos_emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids) + self.pos_emb(position_ids)
        return self.head(h.mean(1))


def _advice(model: nn.Module, ids: torch.Tensor, pos: torch.Tensor, tmp_path: Path) -> str:
    with (
        pytest.raises(IndexError) as info,
        nanwatch.watch(model, report_dir=tmp_path, guards=False) as nw,
    ):
        model(ids, pos)
    assert not isinstance(info.value, GuardError)
    error = nw.report.to_dict()["error"]
    assert error is not None and error["message"] == str(info.value)
    return str(error["advice"])


def _mask() -> torch.Tensor:
    am = torch.ones(2, 8, dtype=torch.long)
    am[0, :3] = 0  # left padding
    return am


def test_negative_positions_from_left_padding(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Packed()
    advice = _advice(model, torch.randint(1, 100, (2, 8)), _mask().cumsum(-1) - 1, tmp_path)
    assert "pos_emb (Embedding) has 32 rows" in advice
    assert "position_ids holds -1..7" in advice
    assert "no position is negative" in advice
    assert "left padding: attention_mask.cumsum(-1) - 1" in advice
    assert "position_ids = position_ids.clamp(min=0)" in advice
    assert "outside its valid range" not in advice


def test_positions_with_an_offset(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Packed()
    pos = torch.arange(30, 38).expand(2, 8)  # counting on from the previous packed sequence
    advice = _advice(model, torch.randint(1, 100, (2, 8)), pos, tmp_path)
    assert "position_ids holds 30..37" in advice
    assert "only 8 tokens, but its positions start at 30" in advice
    assert "position_ids = position_ids - position_ids[..., :1]" in advice


def test_token_ids_past_a_vocabulary_keep_the_generic_advice(tmp_path: Path) -> None:
    """Control: a table that holds no positions (the token table) gets no position words."""
    torch.manual_seed(0)
    model = Packed()
    ids = torch.randint(1, 100, (2, 8))
    ids[0, 0] = 100
    advice = _advice(model, ids, torch.arange(8).expand(2, 8), tmp_path)
    assert "positions" not in advice


def test_healthy_positions_train_clean(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Packed()
    pos = (_mask().cumsum(-1) - 1).clamp(min=0)
    with nanwatch.watch(model, report_dir=tmp_path, guards=False) as nw:
        model(torch.randint(1, 100, (2, 8)), pos).sum().backward()
        nw.step()
    assert not nw.report.to_dict().get("error")
    assert not nw.report.diagnoses


def test_bert_left_padding_positions_without_guards(tmp_path: Path) -> None:
    """BERT reads a config-sized buffer at the position ids (a gather): the same words."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    from tests._hf import tiny_classifier

    torch.manual_seed(0)
    model = tiny_classifier("Bert", 64)
    ids, am = torch.randint(1, 100, (2, 8)), _mask()
    position_ids = am.cumsum(-1) - 1
    with (
        pytest.raises(Exception) as info,
        nanwatch.watch(model, report_dir=tmp_path, guards=False) as nw,
    ):
        model(input_ids=ids, attention_mask=am, position_ids=position_ids)
    assert not isinstance(info.value, GuardError)
    advice = str(nw.report.to_dict()["error"]["advice"])
    assert "position_ids holds -1..7" in advice
    assert "config.max_position_embeddings=64" in advice
    assert "position_ids = position_ids.clamp(min=0)" in advice
