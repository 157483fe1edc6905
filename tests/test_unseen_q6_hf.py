"""Hugging Face models trained by hand. An additive attention mask built as ``(1.0 -
mask) * float("-inf")`` is NaN at every position it keeps (0 x inf): watch and sentinel,
which trace no op outside the modules, read the user's line that assigned the input and
say so, with the finite extreme on that line as the fix (not ``nan_to_num``, which would
unmask the padding too)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from torch import nn

import nanwatch
from tests._hf import tiny_classifier

transformers = pytest.importorskip("transformers")

MODES = ["watch", "sentinel"]


def _bert() -> nn.Module:
    torch.manual_seed(0)
    return tiny_classifier("Bert", 64, num_labels=3)


@pytest.mark.parametrize("mode", MODES)
def test_a_mask_times_minus_inf_names_the_users_line(mode: str) -> None:
    model = _bert()
    ids = torch.randint(1, 100, (4, 16))
    mask = torch.ones(4, 16)
    mask[:, 12:] = 0  # padding
    with (
        pytest.raises(nanwatch.AnomalyError),
        nanwatch.watch(model, mode=mode, postmortem=False) as nw,
    ):
        ext = (1.0 - mask[:, None, None, :]) * float("-inf")
        model(input_ids=ids, attention_mask=ext, labels=torch.tensor([0, 1, 2, 0]))
    d = nw.history[-1].diagnoses[0]
    assert d.code == "NW401"
    assert d.title == "NaN in an input your code multiplied by float('-inf')"
    assert any(
        e.startswith("ext is not the batch as loaded: your code computed it at ")
        and e.endswith(
            ': ext = (1.0 - mask[:, None, None, :]) * float("-inf") -- a product with '
            "float('-inf'), and 0 x inf is NaN: NaN wherever the other factor is 0"
        )
        for e in d.evidence
    ), d.evidence
    assert d.fix.splitlines()[0] == (
        "ext = (1.0 - mask[:, None, None, :]) * torch.finfo(torch.float32).min   # finite: "
        "0 x it is 0, not NaN; a masked entry still gets exp(it) = 0"
    )
    assert "nan_to_num" not in d.fix


@pytest.mark.parametrize("mode", MODES)
def test_the_finite_mask_trains_clean(mode: str) -> None:
    model = _bert()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(1, 100, (4, 16))
    mask = torch.ones(4, 16)
    mask[:, 12:] = 0
    with nanwatch.watch(model, mode=mode, postmortem=False) as nw:
        for _ in range(2):
            ext = (1.0 - mask[:, None, None, :]) * torch.finfo(torch.float32).min
            out = model(input_ids=ids, attention_mask=ext, labels=torch.tensor([0, 1, 2, 0]))
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    assert [d.code for t in nw.history for d in t.diagnoses] == []


# ------------------------------------------- a float16 model overflowing in a library layer
#
# The product that overflows runs in nn.Linear's forward, which is not the user's code: the
# fix is the model's dtype (bfloat16), or, for a model that declares float32 modules
# (T5's ``_keep_in_fp32_modules = ["wo"]``), those modules back in float32.


def _llama(scale: float) -> nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=100,
        max_position_embeddings=32,
    )
    model: nn.Module = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # weights of a checkpoint whose activations are large
        for layer in model.model.layers:
            layer.mlp.up_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    return model


def _t5(scale: float) -> nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        vocab_size=100,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model: nn.Module = transformers.T5ForConditionalGeneration(cfg)
    with torch.no_grad():  # T5's feed-forward output grows past float16's range
        for block in model.encoder.block:
            block.layer[-1].DenseReluDense.wo.weight.mul_(scale)
    return model


def _train(model: nn.Module, nw: nanwatch.Watcher, steps: int) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-4)
    ids = torch.randint(1, 100, (2, 8))
    with nw:
        for _ in range(steps):
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()


def _diagnoses(model: nn.Module, mode: str, steps: int = 1) -> list[nanwatch.Diagnosis]:
    nw = nanwatch.watch(model, mode=mode, postmortem=False)
    with contextlib.suppress(nanwatch.AnomalyError):
        _train(model, nw, steps)
    return [d for t in nw.history for d in t.diagnoses]


@pytest.mark.parametrize("mode", MODES)
def test_a_half_model_overflowing_in_a_linear_is_told_its_dtype(mode: str) -> None:
    model = _llama(1e4).half()
    d = _diagnoses(model, mode)[0]
    assert (d.code, d.path, d.op) == ("NW101", "model.layers.0.mlp.down_proj", "aten.mm")
    assert (
        "Here the product runs in model.model.layers[0].mlp.down_proj's forward (Linear: "
        "library code, no line of yours) with its own float16 weights and no autocast: the "
        "model's weights were cast to float16 (model.half(), .to(torch.float16))."
    ) in d.explanation
    assert d.fix.splitlines() == [
        "model.to(torch.bfloat16)   # instead of casting to float16: float32's range (3.4e38) "
        "in 16 bits",
        "# model.model.layers[0].mlp.down_proj is Linear: its float16 product has no room past "
        "65504, and its forward is not yours to upcast",
        "# or keep the weights in float32 and run the forward under "
        "torch.autocast(device_type='cpu', dtype=torch.bfloat16)",
    ]


def test_a_half_t5_is_told_the_modules_it_keeps_in_float32() -> None:
    model = _t5(3e4).half()
    # watch: T5 clamps the inf its block makes in float16, so the loss sentinel reads stays
    # finite here; the feed-forward's own output holds it
    d = _diagnoses(model, "watch")[0]
    assert (d.code, d.path) == ("NW101", "encoder.block.0.layer.1.DenseReluDense.wo")
    assert (
        "T5ForConditionalGeneration declares 'wo' must stay float32 (its "
        "_keep_in_fp32_modules): from_pretrained(..., dtype=torch.float16) keeps it there, "
        "model.half() does not."
    ) in d.explanation
    assert d.fix.splitlines() == [
        "for name, module in model.named_modules():   # after the cast: "
        "T5ForConditionalGeneration keeps 'wo' in float32, as from_pretrained(..., "
        "dtype=torch.float16) leaves it",
        '    if ".wo." in f".{name}.":',
        "        module.float()",
        "# or load it so: T5ForConditionalGeneration.from_pretrained(..., dtype=torch.float16)",
        "# or model.to(torch.bfloat16)   # instead of casting to float16: float32's range "
        "(3.4e38) in 16 bits",
    ]


@pytest.mark.parametrize("mode", MODES)
def test_the_fixes_train_clean(mode: str) -> None:
    t5 = _t5(3e4).half()
    for name, module in t5.named_modules():  # the fix, as said
        if ".wo." in f".{name}.":
            module.float()
    assert _diagnoses(t5, mode, steps=2) == []
    assert _diagnoses(_llama(1e4).to(torch.bfloat16), mode, steps=2) == []


# ------------------------------------ a token added to the tokenizer, the model not resized


def _gpt2() -> nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    model: nn.Module = transformers.GPT2LMHeadModel(cfg)
    return model


def test_without_guards_the_post_mortem_names_the_table_and_resize(tmp_path: Path) -> None:
    model = _gpt2()
    ids = torch.randint(0, 100, (2, 8))
    ids[:, -2:] = 100  # the pad token the tokenizer was given: len(tokenizer) == 101
    with (
        pytest.raises(IndexError),
        nanwatch.watch(model, report_dir=tmp_path, guards=False) as nw,
    ):
        model(input_ids=ids, labels=ids)
    advice = nw.report.to_dict()["error"]["advice"]
    assert advice == (
        "transformer.wte (Embedding, GPT2LMHeadModel's input embeddings) has 100 rows, so "
        "token ids must be in 0..99, but ids holds 1..100 (4 of 16 past the last row): tokens "
        "added to the tokenizer after the model was built (a pad or special token) have no "
        "row. Fix: model.resize_token_embeddings(len(tokenizer)) (a row for every token), "
        "after adding the tokens and before building the optimizer, which holds the old table."
    )


def test_the_resized_model_trains_clean(tmp_path: Path) -> None:
    model = _gpt2()
    model.resize_token_embeddings(101)  # the fix, as said
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 100, (2, 8))
    ids[:, -2:] = 100
    with nanwatch.watch(model, report_dir=tmp_path, guards=False) as nw:
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    assert not nw.report.to_dict().get("error")
    assert [d.code for t in nw.history for d in t.diagnoses] == []
