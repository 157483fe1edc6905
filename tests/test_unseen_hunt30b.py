"""Real architectures and training setups as users write them, diagnosed in watch and
sentinel mode: a tiny GPT-2 trained with a far too large learning rate (its NaN is born in a
LayerNorm, after an inf that GELU's tanh absorbed), a Llama whose RMSNorm hides x² = inf in
the forward (the NaN gradient is its backward's, not a view's), a BERT classifier given -1
for unlabelled rows (the loss call is the library's), gradient accumulation with one bad
micro-batch, and a healthy checkpointed bf16 GPT-2 that must stay quiet."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import nanwatch
from tests._diagnoses import first_bad, text


def _transformers() -> Any:
    return pytest.importorskip("transformers")


def _gpt2() -> torch.nn.Module:
    tf = _transformers()
    cfg = tf.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return tf.GPT2LMHeadModel(cfg)


def _train_gpt2_with_a_huge_lr(mode: str) -> nanwatch.Watcher:
    torch.manual_seed(0)
    model = _gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=1e4)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(4):
            ids = torch.randint(0, 50, (2, 8))
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_gpt2_huge_lr_blames_the_layernorm_not_an_inf_that_gelu_absorbed(mode: str) -> None:
    nw = _train_gpt2_with_a_huge_lr(mode)
    a = nw.first_anomaly
    assert a is not None and a.step == 3
    # GELU's tanh form computes x**3 and makes +inf of it an op earlier, in layer 0; tanh
    # turns that inf into 1 and nothing of it reaches the loss: the NaN is born later, in
    # the LayerNorm of layer 1, whose float32 variance of values near 7.6e19 overflows
    assert a.op is not None and a.op.op == "aten.native_layer_norm.default"
    # the GPU-bound path too, where that LayerNorm's input was freed; sentinel's replay of
    # the root names it too, though its output was not measured
    assert a.path == "transformer.h.1.ln_2"
    d = first_bad(nw).diagnoses[0]
    assert d.code == "NW101"
    said = text(d)
    assert "pow" not in said
    # the values are the op's operands, not the model's input (its token ids)
    if mode == "watch":
        assert "(the input of aten.native_layer_norm in transformer.h.1.ln_2)" in said
    else:  # seen in the root's output: the op's module is named as where it ran
        assert "aten.native_layer_norm in transformer.h.1.ln_2 made NaN in float32" in said
        assert "(the input of transformer.h.1.ln_2)" in said
    assert "(the input of GPT2LMHeadModel)" not in said
    assert "SGD lr 10000" in said and 'g["lr"] = 1e-3' in d.fix


class NewGELU(nn.Module):
    """GPT-2's tanh GELU, as transformers writes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = math.sqrt(2.0 / math.pi)
        return 0.5 * x * (1.0 + torch.tanh(c * (x + 0.044715 * torch.pow(x, 3.0))))


class Block(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = NewGELU()
        self.ln = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(x))
        return self.ln(x + h)


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_an_inf_that_tanh_absorbed_is_not_the_op_named(mode: str) -> None:
    # the first block's x**3 overflows to +inf and tanh turns it into 1: its output is
    # finite. The NaN the model returns is born in the second block's LayerNorm, whose
    # variance of values near 1e20 overflows float32
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    with torch.no_grad():
        model[0].fc.weight.mul_(1e12)
        model[0].ln.weight.fill_(1e20)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        model(torch.randn(4, 32)).sum().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.op is not None
    assert (a.op.op, a.op.born) == ("aten.native_layer_norm.default", "NaN"), a.summary
    if mode == "watch":  # the replay knows the submodule each op ran in
        assert a.op.path == "1.ln"
    assert "pow" not in a.summary and "+inf" not in a.summary


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_label_to_skip_in_a_library_loss_is_remapped_not_its_ignore_index(mode: str) -> None:
    # a Hugging Face classifier computes its own loss with ignore_index=-100; the dataset
    # marks unlabelled rows with -1. The loss call is the library's, not the user's to
    # edit: the fix maps the user's labels, in their own tensor.
    torch.manual_seed(0)
    transformers = _transformers()
    cfg = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=32,
        num_labels=3,
    )
    model = transformers.BertForSequenceClassification(cfg)
    ids = torch.randint(0, 64, (3, 8))
    batch_labels = torch.tensor([0, 2, -1])
    with (
        pytest.raises(nanwatch.GuardError, match="target contains -1 at 1 position") as err,
        nanwatch.watch(model, mode=mode, postmortem=False),
    ):
        model(input_ids=ids, labels=batch_labels).loss.backward()
    msg = str(err.value)
    assert "transformers/models/bert/modeling_bert.py:" in msg
    assert "makes this call: mark the labels to skip with -100, not -1" in msg
    assert "did you mean ignore_index" not in msg
    fix = "batch_labels = batch_labels.masked_fill(batch_labels == -1, -100)"
    assert f"fix: {fix}   # before the model call" in msg
    # the fix, run, gives a loss that skips the row
    ns = {"batch_labels": batch_labels}
    exec(fix, ns)
    loss = model(input_ids=ids, labels=ns["batch_labels"]).loss
    assert torch.isfinite(loss)


def test_llama_huge_lr_nan_gradient_is_born_in_the_rmsnorm_not_in_a_view() -> None:
    # after two SGD steps at lr 3000 the final RMSNorm's input squares past float32's
    # range: rsqrt(inf) = 0 hides it in the forward, the backward makes inf * 0 = NaN. The
    # gradient of the norm's output was finite; the view transformers takes of it for the
    # head (hidden_states[:, -k:], an AliasBackward0) only moves gradient values
    torch.manual_seed(0)
    transformers = _transformers()
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=3e3)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            ids = torch.randint(0, 64, (2, 8))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    a = nw.first_anomaly
    assert a is not None and a.step == 2
    assert (a.kind, a.path, a.origin) == (nanwatch.AnomalyKind.BACKWARD, "model.norm", "module")
    assert "AliasBackward0" not in a.summary and "or in the backward of" not in a.summary
    d = first_bad(nw).diagnoses[0]
    assert (d.code, d.path) == ("NW101", "model.norm")
    assert "inf × 0 = NaN" in text(d) and "SGD lr 3000" in text(d)
    assert 'g["lr"] = 1e-3' in d.fix


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_gradient_accumulation_names_the_micro_batch_that_held_the_nan(mode: str) -> None:
    # four micro-batches a step; one sample of the third of step 1 holds a NaN feature:
    # "sample 1" alone points at four samples, one in each micro-batch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for step in range(2):
            for micro in range(4):
                x, y = torch.randn(4, 8), torch.randn(4, 1)
                if (step, micro) == (1, 2):
                    x[1, 3] = float("nan")
                (torch.nn.functional.mse_loss(model(x), y) / 4).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    a = nw.first_anomaly
    assert a is not None and (a.step, a.kind) == (1, nanwatch.AnomalyKind.INPUT)
    assert "in sample 1 (1 of 4), in its 3rd call this step (bad data" in a.summary
    d = first_bad(nw).diagnoses[0]
    assert d.code == "NW401"
    assert (
        "Sequential ran 4 times in this step (micro-batches of gradient accumulation, or "
        "several batches): the bad one is its call 3 of 4, and the sample numbers count "
        "within that call's batch"
    ) in d.evidence


def test_a_root_called_once_a_step_says_nothing_of_calls() -> None:
    model = torch.nn.Linear(8, 1)
    x = torch.randn(4, 8)
    x[2, 0] = float("nan")
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(x).sum().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and "in sample 2 (1 of 4) (bad data, not a layer)" in a.summary
    assert not any("times in this step" in e for e in first_bad(nw).diagnoses[0].evidence)


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_healthy_gpt2_checkpointed_in_bf16_with_padding_stays_quiet(mode: str) -> None:
    # activation checkpointing (transformers' own, use_reentrant=False), bfloat16 autocast,
    # a padded row whose labels are -100 and whose mask hides keys: finfo.min mask fills,
    # ignored positions and a recomputed forward are no anomaly
    torch.manual_seed(0)
    model = _gpt2()
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            ids = torch.randint(0, 50, (2, 8))
            mask = torch.ones(2, 8, dtype=torch.long)
            mask[1, 5:] = 0
            labels = ids.masked_fill(mask == 0, -100)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    assert nw.first_anomaly is None
    assert [d.code for t in nw.history for d in t.diagnoses] == []
    assert len(nw.history) == 3 and torch.isfinite(loss)
