"""Hugging Face fine-tuning loops as users write them (``model(**batch)`` with labels,
AdamW, a warmup schedule), with the batch's mistakes planted: a guard's fix names the
entry of the user's batch that holds the bad values (``batch["labels"]``,
``batch["token_type_ids"]``), its positions are said to be in that tensor, and labels past
a classification head's outputs name the config setting that sized it (``num_labels``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import nanwatch

torch.set_num_threads(1)


def _transformers() -> Any:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def _config(kind: str, **kw: Any) -> Any:
    tf = _transformers()
    if kind == "gpt2":
        return tf.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64)
    return tf.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=64,
        **kw,
    )


def _fine_tune(model: Any, batches: list[dict[str, torch.Tensor]], mode: str) -> Any:
    """The user's loop: the batch goes in as ``model(**batch)``; a guard's failure is
    recorded, and the GuardError (an IndexError too) propagates unchanged."""
    tf = _transformers()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = tf.get_linear_schedule_with_warmup(opt, 0, 10)
    nw = nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False)
    with pytest.raises(nanwatch.GuardError) as info, nw:
        for batch in batches:
            out = model(**batch)
            out.loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            nw.step()
    assert isinstance(info.value, IndexError)
    (d,) = [d for d in nw.report.diagnoses if d.code.startswith("NW5")]
    return d


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_labels_padded_with_minus_one_are_fixed_in_the_users_batch(mode: str) -> None:
    tf = _transformers()
    torch.manual_seed(0)
    model = tf.BertForMaskedLM(_config("bert"))
    ids = torch.randint(1, 100, (2, 8))
    good = {"input_ids": ids, "labels": ids.clone()}
    batch = {"input_ids": ids, "labels": ids.clone()}
    batch["labels"][:, 5:] = -1  # padded with -1, not transformers' -100
    d = _fine_tune(model, [good, batch], mode)
    assert d.code == "NW501"
    fix = "batch['labels'] = batch['labels'].masked_fill(batch['labels'] == -1, -100)"
    assert d.fix.startswith(fix + "   # before the model call"), d.fix
    ns: dict[str, Any] = {"batch": batch}
    exec(fix, ns)
    assert int(batch["labels"].min()) == -100
    assert torch.isfinite(model(**batch).loss)


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_token_type_ids_past_type_vocab_size_name_the_batch_entry(mode: str) -> None:
    tf = _transformers()
    torch.manual_seed(0)
    model = tf.BertForSequenceClassification(_config("bert", num_labels=3))
    ids = torch.randint(1, 100, (2, 8))
    good = {
        "input_ids": ids,
        "token_type_ids": torch.zeros_like(ids),
        "labels": torch.tensor([0, 2]),
    }
    batch = dict(good, token_type_ids=torch.zeros_like(ids))
    batch["token_type_ids"][:, 4:] = 2  # a third segment; BERT has type_vocab_size=2
    d = _fine_tune(model, [good, batch], mode)
    assert d.code == "NW513"
    text = "\n".join(d.evidence)
    assert "type_vocab_size=2, and the ids reach 2 (in batch['token_type_ids'])" in text
    # the positions index the user's own (2, 8) tensor: no "not in your tensor"
    assert "first positions: (0, 4), (0, 5), (0, 6) (of 8)" in text
    assert "not in your tensor" not in text
    assert d.fix.startswith("batch['token_type_ids'] = batch['token_type_ids'].clamp_max(1)")
    assert "# give it" not in d.fix


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_input_ids_past_the_vocab_are_the_users_own_tensor(mode: str) -> None:
    tf = _transformers()
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(_config("gpt2"))
    ids = torch.randint(1, 100, (2, 8))
    bad = ids.clone()
    bad[1, 5:] = 100  # a token added to the tokenizer, no resize_token_embeddings
    batches = [{"input_ids": ids, "labels": ids}, {"input_ids": bad, "labels": bad}]
    d = _fine_tune(model, batches, mode)
    assert d.code == "NW513"
    text = "\n".join(d.evidence)
    assert "first positions: (1, 5), (1, 6), (1, 7)" in text
    assert "not in your tensor" not in text
    assert d.fix.startswith("model.resize_token_embeddings(len(tokenizer))")


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_labels_past_a_head_built_from_a_config_name_num_labels(mode: str) -> None:
    tf = _transformers()
    torch.manual_seed(0)
    model = tf.BertForSequenceClassification(_config("bert", num_labels=2))
    batch = {"input_ids": torch.randint(1, 100, (2, 8)), "labels": torch.tensor([0, 2])}
    d = _fine_tune(model, [batch], mode)
    assert d.code == "NW501"
    assert d.fix == (
        "# build model from a config with num_labels=3 (it has num_labels=2), "
        "or remap the labels to 0..1"
    )


def test_labels_past_a_pretrained_head_reload_it_with_num_labels(tmp_path: Path) -> None:
    tf = _transformers()
    torch.manual_seed(0)
    tf.BertForSequenceClassification(_config("bert", num_labels=2)).save_pretrained(tmp_path)
    model = tf.BertForSequenceClassification.from_pretrained(str(tmp_path))
    batch = {"input_ids": torch.randint(1, 100, (2, 8)), "labels": torch.tensor([0, 2])}
    d = _fine_tune(model, [batch], "watch")
    assert d.code == "NW501"
    line = (
        f"model = BertForSequenceClassification.from_pretrained({str(tmp_path)!r}, "
        "num_labels=3, ignore_mismatched_sizes=True)"
    )
    assert (
        d.fix == line + "   # was num_labels=2: a head with 2 outputs; or remap the labels to 0..1"
    )
    ns: dict[str, Any] = {"BertForSequenceClassification": tf.BertForSequenceClassification}
    exec(line, ns)
    assert ns["model"].config.num_labels == 3
    assert torch.isfinite(ns["model"](**batch).loss)


def test_labels_past_a_head_name_the_users_config_and_the_fix_runs() -> None:
    tf = _transformers()
    torch.manual_seed(0)
    cfg = _config("bert")  # num_labels=2, the default
    model = tf.BertForSequenceClassification(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {"input_ids": torch.randint(1, 100, (4, 8)), "labels": torch.tensor([0, 1, 2, 1])}
    nw = nanwatch.watch(model, on_anomaly="record", postmortem=False)
    with pytest.raises(nanwatch.GuardError), nw:
        out = model(**batch)
        out.loss.backward()
        opt.step()
    (d,) = nw.report.diagnoses
    assert d.code == "NW501"
    assert d.fix == (
        "cfg.num_labels = 3   # was 2: then build model again from cfg; or remap the labels to 0..1"
    )
    exec(d.fix.split("   #")[0], {"cfg": cfg})
    model = tf.BertForSequenceClassification(cfg)
    assert torch.isfinite(model(**batch).loss)


def test_a_layernorm_in_an_attention_block_that_overflows_is_no_masked_row() -> None:
    """An absurd lr with no warmup grows BERT's activations past sqrt(float32 max): the
    LayerNorm of ``attention.output`` makes NaN from finite inputs. The module's path says
    attention, but native_layer_norm runs no softmax: no fully masked row (NW402)."""
    tf = _transformers()
    torch.manual_seed(0)
    model = tf.BertForSequenceClassification(_config("bert", num_labels=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e4)
    sch = tf.get_linear_schedule_with_warmup(opt, 0, 10)
    torch.manual_seed(0)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for _ in range(6):
            batch = {"input_ids": torch.randint(1, 100, (2, 8)), "labels": torch.tensor([0, 1])}
            out = model(**batch)
            out.loss.backward()
            opt.step()
            sch.step()
            opt.zero_grad()
            nw.step()
    a = nw.first_anomaly
    assert a is not None and a.path == "bert.encoder.layer.0.attention.output.LayerNorm"
    codes = [d.code for d in nw.report.diagnoses]
    assert "NW402" not in codes, codes
    assert "NW101" in codes, codes


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_seq2seq_labels_padded_with_minus_one_blame_the_labels_not_the_table(mode: str) -> None:
    """T5 shifts the labels right into its decoder's ids (turning -100 into padding): -1
    padding reaches the decoder's embedding, whose guard must send the user to the labels,
    not to a padding row of the embedding."""
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.T5Config(
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        vocab_size=100,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = tf.T5ForConditionalGeneration(cfg)
    ids = torch.randint(1, 100, (2, 8))
    good = {"input_ids": ids, "labels": torch.randint(1, 100, (2, 6))}
    batch = {"input_ids": ids, "labels": torch.randint(1, 100, (2, 6))}
    batch["labels"][1, 3:] = -1
    d = _fine_tune(model, [good, batch], mode)
    assert d.code == "NW513"
    assert d.evidence[0].endswith(
        "the model shifted batch['labels'] right by one into this input, -1 and all: mark "
        "the labels to skip with -100 (the ignore_index of torch's losses), not -1"
    ), d.evidence[0]
    fix = "batch['labels'] = batch['labels'].masked_fill(batch['labels'] == -1, -100)"
    assert d.fix == fix + "   # before the model call"
    exec(fix, {"batch": batch})
    assert torch.isfinite(model(**batch).loss)
