"""Attention and NLP training loops as users write them, diagnosed in watch and sentinel
mode: a seq2seq batch whose labels are all padding gets a mean-loss fix that keeps the
decoder's input ``t`` (its target gets a name of its own); a learning rate lowered by a fix
stays lowered when a scheduler drives it (LambdaLR, transformers' warmup schedules, set the
lr from their ``base_lrs`` at every step); a weight decay of a usual size past its limit
with an absurd lr blames the lr, not the decay; and a fully padded sample in a bf16 Llama
stays quiet."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import Note
from nanwatch.rules._evidence import with_scheduler
from tests._diagnoses import code_lines, top

torch.set_num_threads(1)


def _transformers() -> Any:
    return pytest.importorskip("transformers")


# ------------------------------- NW113: every label is padding, the loss line reads ``t``


class Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.tr = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)
        self.out = nn.Linear(16, 20)

    def forward(self, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(t.shape[1])
        return self.out(self.tr(self.emb(s), self.emb(t), tgt_mask=causal))


def _train_seq2seq(mode: str) -> tuple[nanwatch.Watcher, dict[str, Any]]:
    torch.manual_seed(0)
    model = Seq2Seq()
    crit = nn.CrossEntropyLoss(label_smoothing=0.1, ignore_index=0)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    bad: dict[str, Any] = {"F": F, "torch": torch, "model": model}
    with nanwatch.watch(model, crit, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for step in range(3):
            s, t = torch.randint(1, 20, (2, 5)), torch.randint(1, 20, (2, 4))
            y = torch.randint(1, 20, (2, 4))
            if step == 1:
                y[:] = 0  # every label of the batch is padding
                bad.update(s=s, t=t, y=y)
            loss = crit(model(s, t).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw, bad


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_an_all_padding_batch_fix_keeps_the_decoder_input_the_line_reads(mode: str) -> None:
    nw, ns = _train_seq2seq(mode)
    t = ns["t"]
    a = nw.first_anomaly
    assert a is not None and a.step == 1 and a.op is not None
    assert a.op.op == "aten.nll_loss_forward.default"
    d = top(nw)
    assert d.code == "NW113"
    assert "all 8 targets equal ignore_index=0" in d.evidence
    # the flattened target gets a name the user's loop does not use: ``t`` is the decoder's
    # input on the very line the fix rewrites
    assert d.fix.startswith("t_ = y.flatten()\n"), d.fix
    assert "label_smoothing=0.1, ignore_index=0, reduction='sum'" in d.fix
    exec(code_lines(d.fix), ns)
    assert ns["t"] is t  # the decoder still reads its own input
    assert ns["loss"].item() == 0.0  # 0, not NaN, when no label counts


# ------------------------------- a lower lr under a scheduler that sets it from its base


def _gpt2_under_a_warmup_of_0_steps(mode: str) -> tuple[nanwatch.Watcher, Any, Any]:
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = tf.GPT2LMHeadModel(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=1e4)
    sched = tf.get_linear_schedule_with_warmup(opt, num_warmup_steps=0, num_training_steps=1000)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(4):
            ids = torch.randint(0, 50, (2, 8))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            nw.step()
    return nw, opt, sched


def _lr_lines(fix: str) -> str:
    return "\n".join(ln for ln in code_lines(fix).splitlines() if "lr" in ln)


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_lower_lr_under_a_warmup_schedule_is_not_undone_by_its_next_step(mode: str) -> None:
    nw, opt, sched = _gpt2_under_a_warmup_of_0_steps(mode)
    a = nw.first_anomaly
    assert a is not None and a.step == 3
    assert a.op is not None and a.op.op == "aten.native_layer_norm.default"
    d = top(nw)
    assert d.code == "NW101"
    assert 'for g in opt.param_groups: g["lr"] = 1e-3   # was 9980 (SGD)' in d.fix
    assert (
        'sched.base_lrs = [g["lr"] for g in opt.param_groups]   # LambdaLR sets the lr from '
        "base_lrs at every sched.step(): without this line it undoes the new lr"
    ) in d.fix
    # the fix, run, keeps the lower lr through the scheduler's next steps
    exec(_lr_lines(d.fix), {"opt": opt, "sched": sched})
    for _ in range(3):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] <= 1e-3


def _sgd_fix(scheduler: type[Any], **kw: Any) -> str:
    """The NW303/NW101 fix of an SGD run whose lr is far too large, driven by ``scheduler``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e4)
    sched = scheduler(opt, **kw)
    with nanwatch.watch(model, mode="watch", on_anomaly="record", postmortem=False) as nw:
        for _ in range(6):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            nw.step()
    lr = [d.fix for t in nw.history for d in t.diagnoses if 'g["lr"] = ' in d.fix]
    assert lr, [d.code for t in nw.history for d in t.diagnoses]
    return lr[0]


def test_a_scheduler_that_scales_the_lr_it_finds_needs_no_base_lrs_line() -> None:
    # StepLR multiplies the lr it finds in the group: a lower g["lr"] stays lower
    fix = _sgd_fix(torch.optim.lr_scheduler.StepLR, step_size=100)
    assert "base_lrs" not in fix and "sched" not in fix
    fix = _sgd_fix(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda step: 1.0)
    assert 'sched.base_lrs = [g["lr"] for g in opt.param_groups]' in fix


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        ("OneCycleLR", "# OneCycleLR sets the lr from the max_lr it was made with at every "
         "s.step(), undoing this: make s again with max_lr=0.001"),
        ("SequentialLR", "# SequentialLR's schedulers set the lr from the one the optimizer "
         "had when they were made, undoing this: make optimizer with lr=0.001, then the "
         "schedulers again"),
        ("CosineAnnealingLR", None),
    ],
)  # fmt: skip
def test_the_schedulers_line_follows_how_it_sets_the_lr(kind: str, said: str | None) -> None:
    n = Note("optimizer", "SGD", data={"scheduler": kind, "scheduler_variable": "s"})
    line = 'for g in optimizer.param_groups: g["lr"] = 0.001   # was 1e4 (SGD)'
    fix = with_scheduler(line, [n])
    assert fix == (line if said is None else f"{line}\n{said}")


# ------------------------------- NW306: a usual weight decay, an absurd learning rate


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_usual_weight_decay_past_its_limit_blames_the_absurd_lr(mode: str) -> None:
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    model = tf.LlamaForCausalLM(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e3)  # weight_decay 0.01
    scheduler = tf.get_cosine_schedule_with_warmup(optimizer, 0, num_training_steps=100)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            ids = torch.randint(0, 64, (2, 8))
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            nw.step()
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW306"
    assert "lr 1000 × weight_decay 0.01 = 10, past 2" in d.evidence[0]
    assert "weight_decay 0.01 is a usual value; the learning rate 1000 is not" in d.explanation
    assert "it was probably given where a learning rate" not in d.explanation
    assert "weight_decay=" not in d.fix  # the decay is not what to change
    assert d.fix.startswith('optimizer.param_groups[0]["lr"] = 1e-3   # was 1000 (AdamW')
    exec(_lr_lines(d.fix), {"optimizer": optimizer, "scheduler": scheduler})
    scheduler.step()
    g = optimizer.param_groups[0]
    assert g["lr"] * g["weight_decay"] < 0.2  # well inside the limit of 2


def test_an_sgd_lr_past_the_decays_limit_is_lowered_to_a_usual_one() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=300.0, weight_decay=0.01)
    with nanwatch.watch(model, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        nw.step()
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW306"
    assert "weight_decay 0.01 is a usual value; the learning rate 300 is not:" in d.explanation
    assert d.fix.startswith('opt.param_groups[0]["lr"] = 0.1   # was 300 (SGD, weight_decay 0.01)')


def test_a_weight_decay_given_for_a_learning_rate_is_still_the_decay_to_change() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=30.0)
    with nanwatch.watch(model, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        nw.step()
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW306"
    assert "it was probably given where a learning rate" in d.explanation
    assert d.fix.startswith("opt.param_groups[0].update(weight_decay=")


# ------------------------------- healthy: a fully padded sample in a bf16 Llama


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_fully_padded_sample_in_a_bf16_llama_stays_quiet(mode: str) -> None:
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    model = tf.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    losses = []
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            ids = torch.randint(0, 64, (2, 8))
            mask = torch.ones(2, 8, dtype=torch.long)
            mask[1] = 0  # an empty sample: HF fills its rows with finfo.min, not -inf
            labels = ids.masked_fill(mask == 0, -100)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
            nw.step()
    assert all(torch.isfinite(torch.tensor(losses)))
    assert nw.first_anomaly is None
    assert [d.code for t in nw.history for d in t.diagnoses] == []


# ------------------------------- NW513: ids past a table the model's config sized


def _bert(tf: Any) -> Any:
    cfg = tf.BertConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=32,
        num_labels=3,
    )
    return tf.BertForSequenceClassification(cfg)


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_segment_ids_past_type_vocab_size_are_fixed_in_the_users_tensor(mode: str) -> None:
    # three segments given to a BERT built with type_vocab_size=2: the table is called in
    # the library's code, so no call on the user's line (``torch.tensor([0, 1])`` has one
    # argument too) is the embedding's
    tf = _transformers()
    torch.manual_seed(0)
    model = _bert(tf)
    ids = torch.randint(0, 64, (2, 8))
    tt = torch.zeros(2, 8, dtype=torch.long)
    tt[:, 4:] = 2
    with (
        pytest.raises(nanwatch.GuardError) as err,
        nanwatch.watch(model, mode=mode, postmortem=False),
    ):
        model(input_ids=ids, token_type_ids=tt, labels=torch.tensor([0, 1])).loss.backward()
    msg = str(err.value)
    assert "bert.embeddings.token_type_embeddings (Embedding)" in msg
    said = "the model's config sized this table: type_vocab_size=2, and the ids reach 2 (in tt)"
    assert said in msg
    assert "fix: tt = tt.clamp_max(1)   # ids in 0..1 only" in msg
    assert "config with type_vocab_size=3" in msg
    assert "torch.tensor =" not in msg and "'unknown'" not in msg
    ns = {"tt": tt}
    exec("tt = tt.clamp_max(1)", ns)
    assert model(input_ids=ids, token_type_ids=ns["tt"]).logits.isfinite().all()


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_kv_cache_grown_past_the_context_is_named_as_positions(mode: str) -> None:
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = tf.GPT2LMHeadModel(cfg).eval()
    ids, past = torch.randint(0, 50, (1, 4)), None
    with (
        pytest.raises(nanwatch.GuardError) as err,
        nanwatch.watch(model, mode=mode, postmortem=False),
        torch.no_grad(),
    ):
        for _ in range(20):  # a decoding loop with no stop at the model's context
            step_ids = ids[:, -1:] if past is not None else ids
            out = model(input_ids=step_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            ids = torch.cat([ids, out.logits[:, -1:].argmax(-1)], 1)
    assert ids.shape[1] == 17  # the 17th token's position is 16
    msg = str(err.value)
    assert "transformer.wpe (Embedding)" in msg
    assert (
        "these are positions: the model was built with n_positions=16, and position 16 is past it"
    ) in msg
    assert "fix: stop at 16 tokens in all" in msg
    assert "'unknown'" not in msg and "a category" not in msg


def test_a_table_a_library_calls_is_not_matched_to_a_call_on_the_users_line() -> None:
    # only the embeddings watched (no config at hand): the generic fix, but no call of the
    # user's line with one argument (``torch.tensor([0, 1])``) is taken for the table's
    tf = _transformers()
    torch.manual_seed(0)
    model = _bert(tf)
    ids = torch.randint(0, 64, (2, 8))
    tt = torch.zeros(2, 8, dtype=torch.long)
    tt[:, 4:] = 2
    with (
        pytest.raises(nanwatch.GuardError) as err,
        nanwatch.watch(model.bert.embeddings, postmortem=False),
    ):
        model(input_ids=ids, token_type_ids=tt, labels=torch.tensor([0, 1])).loss.backward()
    fix = err.value.diagnosis.fix if err.value.diagnosis is not None else str(err.value)
    assert "torch.tensor" not in fix
    assert fix.startswith("nn.Embedding(3, 32)"), fix
