"""A sequence longer than the model's position table. The guard of a module that holds a
config-sized position table stops the call before any kernel (on a GPU, RoBERTa's positions
first index a buffer with torch.gather: a device-side assert); without guards, the
post-mortem advice names the input's length, the table (read from the model's own modules
and config) and the fix (truncate when tokenizing, or slice the batch). Covered: BERT's
sliced position buffer (a shape error), RoBERTa's padding offset (positions start at
padding_idx + 1), GPT-2's wpe and a hand-written nn.Embedding(max_len, d) indexed by
torch.arange(T)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.errors import GuardError
from nanwatch.postmortem import classify
from tests._hf import tiny_classifier

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _quiet_transformers() -> None:
    transformers.logging.set_verbosity_error()


def _bert(positions: int) -> nn.Module:
    return tiny_classifier("Bert", positions)


def _roberta(positions: int) -> nn.Module:
    return tiny_classifier("Roberta", positions)


def _gpt2(positions: int) -> nn.Module:
    cfg = transformers.GPT2Config(
        n_embd=32, n_layer=1, n_head=2, vocab_size=100, n_positions=positions
    )
    return transformers.GPT2LMHeadModel(cfg)


class HandWritten(nn.Module):
    """Token and learned position tables, the positions made inside forward."""

    def __init__(self, vocab: int = 100, max_len: int = 64, d: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        return self.head(h.mean(1))


def _advice(model: nn.Module, run: Callable[[], Any], tmp_path: Path, **kw: Any) -> str:
    """The post-mortem report's advice for the error ``run`` raises under watch(model)."""
    with pytest.raises(Exception) as info, nanwatch.watch(model, report_dir=tmp_path, **kw) as nw:
        run()
    assert not isinstance(info.value, GuardError), info.value
    error = nw.report.to_dict()["error"]
    assert error is not None and error["message"] == str(info.value)
    return str(error["advice"])


def _stopped(model: nn.Module, ids: torch.Tensor) -> GuardError:
    with pytest.raises(GuardError) as info, nanwatch.watch(model, postmortem=False):
        model(input_ids=ids)
    return info.value


def test_bert_guard_stops_a_sequence_longer_than_its_positions() -> None:
    err = _stopped(_bert(64), torch.randint(1, 100, (2, 80)))
    assert isinstance(err, RuntimeError)  # what torch raises there: a shape error
    assert err.code == "NW513" and err.module == "bert.embeddings"
    assert (
        "input_ids (2, 80) has 80 tokens, but bert.embeddings.position_embeddings (Embedding) "
        "has 64 positions (config.max_position_embeddings=64): the sequence is longer than "
        "the model's position table"
    ) in str(err)
    assert err.fix.startswith(
        "truncate the inputs to 64 tokens (tokenizer(..., truncation=True, max_length=64)), "
        "or slice the batch: input_ids[:, :64]"
    )
    assert "max_position_embeddings >= 80" in err.fix


def test_roberta_guard_counts_the_padding_offset_and_the_padding() -> None:
    model = _roberta(66)
    ids = torch.randint(3, 100, (2, 70))
    err = _stopped(model, ids)
    assert "a row of 70 tokens besides padding (id 1)" in str(err)
    assert "has 66 rows but 64 positions (padding_idx=1: positions start at 2)" in str(err)
    assert "max_length=64" in err.fix
    # padding gets no position: 70 ids of which 10 are padding in every row fit
    ids[:, 60:] = 1
    with nanwatch.watch(model, postmortem=False):
        model(input_ids=ids, attention_mask=(ids != 1).long())


def test_bert_longer_than_max_position_embeddings(tmp_path: Path) -> None:
    model = _bert(64)
    ids = torch.randint(1, 100, (2, 80))
    advice = _advice(
        model,
        lambda: model(input_ids=ids, labels=torch.tensor([0, 1])),
        tmp_path,
        guards=False,
    )
    assert advice.startswith(
        "The input has 80 tokens, but bert.embeddings.position_embeddings (Embedding) has 64 "
        "positions (config.max_position_embeddings=64)."
    ), advice
    assert "tokenizer(..., truncation=True, max_length=64)" in advice
    assert "input_ids[:, :64]" in advice
    assert "max_position_embeddings >= 80" in advice


def test_roberta_counts_the_padding_offset(tmp_path: Path) -> None:
    # 66 rows, positions from padding_idx + 1 = 2: 64 tokens fit, 70 do not
    model = _roberta(66)
    ids = torch.randint(3, 100, (2, 70))
    advice = _advice(model, lambda: model(input_ids=ids), tmp_path, guards=False)
    assert advice.startswith(
        "The input has 70 tokens, but roberta.embeddings.position_embeddings (Embedding) has "
        "66 rows but 64 positions (padding_idx=1: positions start at 2) "
        "(config.max_position_embeddings=66)."
    ), advice
    assert "max_length=64" in advice and "input_ids[:, :64]" in advice


def test_roberta_at_its_usable_length_runs_clean(tmp_path: Path) -> None:
    model = _roberta(66)
    with nanwatch.watch(model, report_dir=tmp_path):
        model(input_ids=torch.randint(3, 100, (2, 64)))


def test_gpt2_without_guards_is_told_its_n_positions(tmp_path: Path) -> None:
    model = _gpt2(64)
    ids = torch.randint(1, 100, (2, 80))
    advice = _advice(model, lambda: model(input_ids=ids), tmp_path, guards=False)
    assert advice.startswith(
        "The input has 80 tokens, but transformer.wpe (Embedding) has 64 positions "
        "(config.n_positions=64)."
    ), advice
    assert "max_length=64" in advice and "n_positions >= 80" in advice


def test_gpt2_guard_names_the_config_setting() -> None:
    err = _stopped(_gpt2(64), torch.randint(1, 100, (2, 80)))
    assert isinstance(err, IndexError)  # torch's own: 'index out of range in self'
    assert err.code == "NW513" and err.module == "transformer"
    assert "transformer.wpe (Embedding) has 64 positions (config.n_positions=64)" in str(err)
    assert "n_positions >= 80" in err.fix


def test_positions_the_caller_gives_are_left_to_the_embedding_guard() -> None:
    # packed sequences restart their positions: the length alone says nothing then
    model = _gpt2(64)
    ids = torch.randint(1, 100, (1, 80))
    positions = torch.arange(80).remainder(40).unsqueeze(0)
    with nanwatch.watch(model, postmortem=False):
        model(input_ids=ids, position_ids=positions)
    with pytest.raises(GuardError) as info, nanwatch.watch(model, postmortem=False):
        model(input_ids=ids, position_ids=torch.arange(80).unsqueeze(0))
    assert info.value.module == "transformer.wpe"
    assert "(config.n_positions=64)" in str(info.value)
    assert info.value.fix == (
        "truncate the inputs to 64 tokens (tokenizer(..., truncation=True, max_length=64)), "
        "or build the model with n_positions >= 80 (a pretrained model's is fixed)"
    )


def test_a_position_table_with_a_padding_row_counts_from_after_it() -> None:
    # positions made as RoBERTa makes them, past a table whose row 0 is padding
    class Padded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.positions = nn.Embedding(16, 4, padding_idx=0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.positions(torch.arange(1, x.shape[1] + 1).expand_as(x))

    model = Padded()
    with pytest.raises(GuardError) as info, nanwatch.watch(model, postmortem=False):
        model(torch.zeros(2, 20, dtype=torch.long))
    assert "longer than the 15 positions the embedding's 16 rows hold from 1" in str(info.value)
    assert "max_length=15" in info.value.fix


def test_hand_written_positions_without_guards(tmp_path: Path) -> None:
    model = HandWritten(max_len=64)
    x = torch.randint(0, 100, (2, 80))
    advice = _advice(model, lambda: model(x), tmp_path, guards=False)
    assert advice.startswith("The input has 80 tokens, but pos (Embedding) has 64 positions."), (
        advice
    )
    assert "max_length=64" in advice and "x[:, :64]" in advice
    assert "a table of 80 rows" in advice


def test_a_short_enough_input_keeps_the_generic_advice() -> None:
    # the error is elsewhere: the table is as long as the input, so it is not named
    class Fine(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Embedding(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.pos(torch.arange(x.shape[1])) @ torch.ones(3, 3)

    try:
        Fine()(torch.zeros(1, 8, dtype=torch.long))
    except RuntimeError as exc:
        info = classify(exc)
    assert info["class"] == "shape-mismatch" and "positions" not in info["advice"]


def test_a_table_named_for_positions_that_the_error_does_not_concern() -> None:
    # a part-of-speech table shorter than the sentence: an unrelated error there names
    # neither its size nor the input's length, and the table did not raise it
    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Embedding(17, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    try:
        Tagger()(torch.zeros(1, 30, dtype=torch.long))
    except RuntimeError as exc:
        info = classify(exc)
    assert info["advice"] == "The last modules that ran before the exception are listed."


def test_bart_counts_the_rows_below_its_first_position() -> None:
    # BART's table has max_position_embeddings + 2 rows and its positions start at 2
    cfg = transformers.BartConfig(
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        vocab_size=100,
        max_position_embeddings=64,
    )
    model = transformers.BartForConditionalGeneration(cfg)
    err = _stopped(model, torch.randint(3, 100, (2, 80)))
    assert err.code == "NW513"
    assert (
        "the sequence (80 tokens) is longer than the 64 positions the embedding's 66 rows hold "
        "from 2 (config.max_position_embeddings=64)"
    ) in str(err)
    assert err.fix == (
        "truncate the inputs to 64 tokens (tokenizer(..., truncation=True, max_length=64)), "
        "or build the model with max_position_embeddings >= 80 (a pretrained model's is fixed)"
    )
