"""A causal LM computes its own loss on labels shifted by one (position t is scored on label
t + 1): a batch whose only labels that count sit at position 0 has no target at all, and the
mean loss is 0/0. NW113's fix must check the shifted labels, ``labels[..., 1:]``: a check
on the labels as given passes on that very batch. Found from the model's arguments (an
integer tensor with labels that count only at position 0), not from a class name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import nanwatch
from tests._diagnoses import top

torch.set_num_threads(1)


def _model() -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        vocab_size=50,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _train(mode: str, *, first_only: bool, skip: bool = False) -> nanwatch.Watcher:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for step in range(3):
            ids = torch.randint(0, 50, (2, 8))
            labels = ids.clone()
            if step == 1:
                labels[:] = -100
                if first_only:
                    labels[:, 0] = ids[:, 0]  # the prompt masked: one label, at position 0
            if skip and not (labels[..., 1:] != -100).any():
                continue  # the fix: no target after the model's shift
            out = model(input_ids=ids, labels=labels)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_a_label_only_at_position_0_gets_a_check_on_the_shifted_labels(mode: str) -> None:
    nw = _train(mode, first_only=True)
    a = nw.first_anomaly
    assert a is not None and a.step == 1
    d = top(nw)
    assert d.code == "NW113"
    assert "if not (labels[..., 1:] != -100).any():" in d.fix
    assert "(labels != -100).any()" not in d.fix
    said = " ".join(d.evidence)
    assert "the model was given labels (2, 8) with 2 labels that count, all at position 0" in said
    assert "shifts its labels by one" in said
    assert "labels[..., 1:]" in d.explanation


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_every_label_ignored_keeps_the_plain_check(mode: str) -> None:
    nw = _train(mode, first_only=False)
    d = top(nw)
    assert d.code == "NW113"
    assert "if not (labels != -100).any():" in d.fix
    assert "[..., 1:]" not in d.fix
    assert not any("shifts its labels" in e for e in d.evidence)


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_the_fixed_loop_trains_clean(mode: str) -> None:
    nw = _train(mode, first_only=True, skip=True)
    assert nw.first_anomaly is None
    assert not nw.report.diagnoses
