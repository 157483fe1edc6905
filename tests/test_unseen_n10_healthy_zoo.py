"""Healthy training that must stay quiet in every mode: a tiny GPT-2 language model (tied
embeddings, AdamW, a warmup + cosine schedule), BERT classification with padded batches,
a residual CNN with BatchNorm in channels_last, a packed-sequence LSTM language model with
gradient clipping, bfloat16 autocast, float16 autocast with a GradScaler whose first
scale overflows (skipped steps are its normal work), and a model with frozen layers,
tied weights and label smoothing. Each runs a few steps in sentinel and watch mode (and
two in forensic): no diagnosis of severity warning or error, no anomaly, no nanwatch
warning, no internal fault."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

#: (the modules to watch, the step: takes the step number, returns the loss, updates)
Case = tuple[list[nn.Module], Callable[[int], torch.Tensor], dict[str, Any]]


def _gpt2() -> Case:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg)  # lm_head tied to the token embedding
    opt = torch.optim.AdamW(model.parameters(), 1e-3, weight_decay=0.01)
    warm, total = 3, 20
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)),
    )

    def step(i: int) -> torch.Tensor:
        ids = torch.randint(0, 100, (4, 16))
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        return loss

    return [model], step, {}


def _bert() -> Case:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=32,
    )
    model = transformers.BertForSequenceClassification(cfg)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)

    def step(i: int) -> torch.Tensor:
        ids = torch.randint(1, 100, (4, 16))
        mask = torch.ones(4, 16, dtype=torch.long)
        mask[:2, 10:] = 0  # padded rows
        ids[mask == 0] = 0
        loss = model(input_ids=ids, attention_mask=mask, labels=torch.randint(0, 2, (4,))).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return [model], step, {}


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(c)
        self.c2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


def _resnet() -> Case:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        _Block(8),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    ).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=5e-4)

    def step(i: int) -> torch.Tensor:
        x = torch.randn(8, 3, 8, 8).to(memory_format=torch.channels_last)
        loss = F.cross_entropy(model(x), torch.randint(0, 10, (8,)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return [model], step, {}


class _LSTMLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.rnn = nn.LSTM(16, 32, batch_first=True)
        self.out = nn.Linear(32, 50)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(
            self.emb(x), lengths, batch_first=True, enforce_sorted=False
        )
        h, _ = self.rnn(packed)
        h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True, total_length=x.shape[1])
        return self.out(h)


def _lstm() -> Case:
    model = _LSTMLM()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    lengths = torch.tensor([12, 9, 5, 3])

    def step(i: int) -> torch.Tensor:
        x = torch.randint(1, 50, (4, 12))
        for row, n in enumerate(lengths.tolist()):
            x[row, n:] = 0
        y = torch.roll(x, -1, 1)
        y[x == 0] = 0
        loss = F.cross_entropy(model(x, lengths).reshape(-1, 50), y.reshape(-1), ignore_index=0)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    return [model], step, {}


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))


def _bf16() -> Case:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)

    def step(i: int) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return [model], step, {}


def _fp16_scaler() -> Case:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), 0.01)
    # a first scale too large: the scaler skips the steps whose gradients overflow and
    # halves the scale, as it is meant to
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)

    def step(i: int) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,)))
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        return loss

    return [model], step, {"scaler": scaler}


class _Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.frozen = nn.Linear(16, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(F.relu(self.frozen(self.emb(x))))))


def _frozen_tied() -> Case:
    model = _Frozen()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], 1e-3)

    def step(i: int) -> torch.Tensor:
        x = torch.randint(0, 40, (8, 6))
        logits = model(x).reshape(-1, 40)
        loss = F.cross_entropy(logits, torch.roll(x, -1, 1).reshape(-1), label_smoothing=0.1)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        return loss

    return [model], step, {}


CASES: dict[str, Callable[[], Case]] = {
    "gpt2": _gpt2,
    "bert": _bert,
    "resnet_channels_last": _resnet,
    "packed_lstm": _lstm,
    "bf16_autocast": _bf16,
    "fp16_grad_scaler": _fp16_scaler,
    "frozen_tied": _frozen_tied,
}


def _run(name: str, mode: str, steps: int) -> tuple[Any, list[str]]:
    torch.manual_seed(0)
    modules, step, options = CASES[name]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(*modules, mode=mode, **options) as nw:
            for i in range(steps):
                nw.step(step(i))
    said = [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if issubclass(w.category, nanwatch.NanwatchWarning) or "nanwatch" in str(w.message)
    ]
    return nw, said


def _assert_quiet(nw: Any, said: list[str]) -> None:
    report = nw.report
    loud = [(d.code, d.severity, d.title) for d in report.diagnoses if d.severity != "info"]
    assert not loud, loud
    assert not report.anomalies, report.headline
    assert not said, said
    assert not report.faults, report.faults
    assert report.status == "ok"


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_healthy_run_is_quiet(name: str, mode: str) -> None:
    _assert_quiet(*_run(name, mode, 8))


@pytest.mark.parametrize("name", ["gpt2", "packed_lstm", "fp16_grad_scaler", "frozen_tied"])
def test_a_healthy_run_is_quiet_in_forensic_mode(name: str) -> None:
    _assert_quiet(*_run(name, "forensic", 2))


def test_the_scaler_skipped_steps_while_the_run_stayed_quiet() -> None:
    """The float16 case is healthy with skipped steps: the scaler did skip (the scale
    fell), and nanwatch said nothing of it."""
    nw, said = _run("fp16_grad_scaler", "watch", 8)
    assert nw.scaler.get_scale() < 2.0**24
    _assert_quiet(nw, said)
