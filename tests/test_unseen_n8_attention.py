"""Attention and transformer models, unseen cases (n8): a mask value of -1e9 written into
float16 scores (torch refuses it: "value cannot be converted to type c10::Half without
overflow") gets the user's line back with the dtype's own limit, not "the last modules are
listed"; negative position ids (left padding given positions by ``cumsum(-1) - 1``) into a
position table are positions, not a pandas category code; positions that carry an offset
into a table the input is short enough for are not "a sequence longer than the table"."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.errors import GuardError
from nanwatch.postmortem import classify, scalar_overflow_advice
from tests._diagnoses import code_lines

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _quiet_transformers() -> None:
    transformers.logging.set_verbosity_error()


# ------------------------------------------------- a mask constant float16 cannot hold


class SelfAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-2, -1) / math.sqrt(x.size(-1))
        scores = scores.masked_fill(mask[:, None, :] == 0, -1e9)
        return scores.softmax(-1) @ self.v(x)


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.attn = SelfAttention(32)
        self.head = nn.Linear(32, 2)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.emb(ids), mask).mean(1))


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    ids = torch.randint(1, 100, (3, 6))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    return ids, mask, torch.tensor([0, 1, 1])


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_minus_1e9_into_float16_scores_is_fixed_with_finfo_min_on_the_users_line(
    mode: str, tmp_path: Path
) -> None:
    model = Classifier().half()
    ids, mask, y = _batch()
    with (
        pytest.raises(RuntimeError, match="without overflow") as info,
        nanwatch.watch(model, mode=mode, report_dir=tmp_path) as nw,  # type: ignore[arg-type]
    ):
        F.cross_entropy(model(ids, mask).float(), y).backward()
    assert not isinstance(info.value, nanwatch.AnomalyError)  # the user's own exception
    error = nw.report.to_dict()["error"]
    assert error["class"] == "scalar-overflow"
    advice = str(error["advice"])
    line = "scores = scores.masked_fill(mask[:, None, :] == 0, torch.finfo(scores.dtype).min)"
    assert advice.startswith(
        f"-1e9 does not fit in float16 (its finite values end at ±65504): write the dtype's "
        f"own limit, {line}. "
    )
    assert "-65504 in float16 and -3.40282e+38 in float32" in advice
    # the rewritten line, put in the user's forward, trains clean in float16 and float32
    SelfAttention.forward.__code__ = compile_forward(line)
    try:
        for dtype in (torch.float16, torch.float32):
            fixed = Classifier().to(dtype)
            with nanwatch.watch(fixed, mode=mode) as ok:  # type: ignore[arg-type]
                F.cross_entropy(fixed(ids, mask).float(), y).backward()
                ok.step()
            assert [t.anomaly for t in ok.history] == [None]
    finally:
        SelfAttention.forward.__code__ = _ORIGINAL


_ORIGINAL = SelfAttention.forward.__code__


def compile_forward(line: str) -> Any:
    """SelfAttention.forward's code with its masking line replaced by ``line``."""
    src = (
        "def forward(self, x, mask):\n"
        "    scores = self.q(x) @ self.k(x).transpose(-2, -1) / math.sqrt(x.size(-1))\n"
        f"    {line}\n"
        "    return scores.softmax(-1) @ self.v(x)\n"
    )
    scope: dict[str, Any] = {"math": math, "torch": torch}
    exec(src, scope)
    return scope["forward"].__code__


def test_a_constant_without_a_tensor_names_the_dtype_and_an_int_table_its_range() -> None:
    half = "value cannot be converted to type c10::Half without overflow"
    said = scalar_overflow_advice(half, "bias = torch.full((T, T), -1e9, dtype=torch.half)")
    assert "bias = torch.full((T, T), torch.finfo(torch.float16).min, dtype=torch.half)" in said
    byte = "value cannot be converted to type int8_t without overflow"
    said = scalar_overflow_advice(byte, "q = q.fill_(300)")
    assert said.startswith("300 does not fit in int8 (it holds -128..127)")
    assert "q = q.fill_(torch.iinfo(q.dtype).max)" in said
    # no number on the line that float16 cannot hold: the rule, not a made-up rewrite
    said = scalar_overflow_advice(half, "out = model(x)")
    assert said.startswith("A Python number on this line does not fit in float16")
    assert classify(RuntimeError(half))["class"] == "scalar-overflow"


def test_finfo_min_in_float16_stays_silent() -> None:
    class Fixed(SelfAttention):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            scores = self.q(x) @ self.k(x).transpose(-2, -1) / math.sqrt(x.size(-1))
            scores = scores.masked_fill(mask[:, None, :] == 0, torch.finfo(scores.dtype).min)
            return scores.softmax(-1) @ self.v(x)

    model = Classifier().half()
    model.attn = Fixed(32).half()
    ids, mask, y = _batch()
    with nanwatch.watch(model) as nw:
        for _ in range(2):
            F.cross_entropy(model(ids, mask).float(), y).backward()
            nw.step()
    assert [t.anomaly for t in nw.history] == [None, None]
    assert [d.code for t in nw.history for d in t.diagnoses] == []


# ------------------------------------------------- position ids the caller made


def _gpt2(positions: int = 16) -> nn.Module:
    cfg = transformers.GPT2Config(
        n_embd=32, n_layer=1, n_head=2, vocab_size=100, n_positions=positions
    )
    return transformers.GPT2LMHeadModel(cfg)


def _left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    ids = torch.randint(1, 100, (2, 6))
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    return ids, attention_mask


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_left_padding_positions_from_cumsum_are_positions_not_a_category(mode: str) -> None:
    model = _gpt2()
    ids, attention_mask = _left_padded()
    position_ids = attention_mask.long().cumsum(-1) - 1  # -1 at the two pads
    with (
        pytest.raises(GuardError) as info,
        nanwatch.watch(model, mode=mode, postmortem=False),  # type: ignore[arg-type]
    ):
        model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids)
    err = info.value
    assert err.code == "NW513" and err.module == "transformer.wpe"
    assert "pandas" not in str(err) and "unknown" not in err.fix
    assert (
        "these are positions (config.n_positions=16), and no position is negative: the "
        "negative ones open their rows, before the first real token (left padding: "
        "attention_mask.cumsum(-1) - 1 is -1 at every pad)"
    ) in str(err)
    assert err.fix.splitlines()[0] == (
        "position_ids = position_ids.clamp(min=0)   # a pad's position: any row, its output "
        "is masked"
    )
    scope: dict[str, Any] = {"position_ids": position_ids, "attention_mask": attention_mask}
    exec(code_lines(err.fix), scope)
    other = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    for fixed in (scope["position_ids"], other):  # both ways the fix names train clean
        with nanwatch.watch(model, mode=mode) as nw:  # type: ignore[arg-type]
            out = model(input_ids=ids, attention_mask=attention_mask, position_ids=fixed)
            out.logits.float().mean().backward()
            nw.step()
        assert [t.anomaly for t in nw.history] == [None]


def test_a_hand_written_position_table_is_known_by_its_name() -> None:
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(100, 16)
            self.pos_emb = nn.Embedding(32, 16)

        def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return self.tok(ids) + self.pos_emb(positions)

    model = Encoder()
    ids, attention_mask = _left_padded()
    positions = attention_mask.cumsum(-1) - 1
    with pytest.raises(GuardError) as info, nanwatch.watch(model, postmortem=False):
        model(ids, positions)
    assert "these are positions (pos_emb), and no position is negative" in str(info.value)
    assert info.value.fix.startswith("positions = positions.clamp(min=0)")


def test_a_negative_id_into_a_table_that_is_not_positions_keeps_the_category_story() -> None:
    class Users(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.user = nn.Embedding(10, 4)

        def forward(self, u: torch.Tensor) -> torch.Tensor:
            return self.user(u)

    model = Users()
    with pytest.raises(GuardError) as info, nanwatch.watch(model, postmortem=False):
        model(torch.tensor([[3, -1, 2]]))
    assert "these are positions" not in str(info.value)
    assert "pandas' Categorical" in str(info.value)


def test_positions_with_an_offset_are_not_a_sequence_longer_than_the_table() -> None:
    model = _gpt2()
    torch.manual_seed(0)
    ids = torch.randint(1, 100, (2, 12))
    # the second row's positions keep counting from 10 (packed after a 10-token document)
    position_ids = torch.arange(12)[None] + torch.tensor([[0], [10]])
    with pytest.raises(GuardError) as info, nanwatch.watch(model, postmortem=False):
        model(input_ids=ids, position_ids=position_ids)
    err = info.value
    assert "longer than" not in str(err) and "truncate" not in err.fix
    assert (
        "these are positions (config.n_positions=16): this input has only 12 tokens, but its "
        "positions start at 10 in a row: they carry an offset"
    ) in str(err)
    assert err.fix.splitlines()[0] == (
        "position_ids = position_ids - position_ids[..., :1]   # each sequence's positions from 0"
    )
    scope: dict[str, Any] = {"position_ids": position_ids}
    exec(code_lines(err.fix), scope)
    with nanwatch.watch(model) as nw:
        model(input_ids=ids, position_ids=scope["position_ids"]).logits.mean().backward()
        nw.step()
    assert [t.anomaly for t in nw.history] == [None]


def test_a_sequence_longer_than_the_table_keeps_the_truncation_fix() -> None:
    model = _gpt2()
    ids = torch.randint(1, 100, (1, 20))
    with pytest.raises(GuardError) as info, nanwatch.watch(model, postmortem=False):
        model(input_ids=ids, position_ids=torch.arange(20)[None])
    assert "the sequence (20 tokens) is longer than the 16 positions" in str(info.value)
    assert info.value.fix.startswith("truncate the inputs to 16 tokens")


# ------------------------------------------------- no warmup: logits grow until float16 overflows


class Scorer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.q(x) @ self.k(x).transpose(-2, -1) / math.sqrt(x.size(-1))
        return s.softmax(-1) @ self.v(x)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        self.attn = Scorer(64)
        self.head = nn.Linear(64, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return self.head(h + self.attn(h))


def _train(lr: float, mode: str, steps: int = 14) -> Any:
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.Adam(model.parameters(), lr=lr)  # no warmup: full lr from step 0
    ids = torch.randint(0, 100, (8, 16))
    with nanwatch.watch(model, mode=mode, on_anomaly="record") as nw:  # type: ignore[arg-type]
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(ids)
            loss = F.cross_entropy(logits.float().reshape(-1, 100), ids.roll(1, 1).reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_logits_grown_update_after_update_blame_the_learning_rate_not_float16(mode: str) -> None:
    nw = _train(0.3, mode)
    bad = [t for t in nw.history if t.anomaly is not None]
    assert bad and bad[0].step > 3  # the weights needed many updates to get there
    d = bad[0].diagnoses[0]
    assert d.code == "NW101" and d.op == "aten.bmm"
    grew = next(e for e in d.evidence if e.startswith("the values grew update after update"))
    assert f"from step 0: {'attn' if mode == 'watch' else 'TinyLM'}'s outputs reached" in grew
    assert f"the {bad[0].step} optimizer updates in between (Adam lr 0.3) moved its weights" in grew
    assert "no warmup" in d.explanation and "a typo" not in d.explanation
    assert d.fix.splitlines()[0] == (
        'for g in opt.param_groups: g["lr"] = 1e-3   # was 0.3 (Adam: 1e-5 to 1e-2 is usual)'
    )
    assert "# or warm the learning rate up over the first steps" in d.fix


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_the_same_model_at_the_lr_the_fix_gives_trains_clean(mode: str) -> None:
    nw = _train(1e-3, mode)
    assert [t.anomaly for t in nw.history] == [None] * 14
    assert [d.code for t in nw.history for d in t.diagnoses] == []
