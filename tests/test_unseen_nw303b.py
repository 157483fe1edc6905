"""NW303 (exploding gradients) against a fit that converged, against an lr raised at once,
and on a healthy step. A fit at its floor (the loss at finfo.eps of where the run began,
its gradients the rounding noise of that fit) that meets one hard batch goes back to a
gradient level the run trained through: no explosion, while a jump past where the run
began still is one. Gradients that jump right after an oversized update are the lr's:
NW308 says so where the loss spiked, and NW303 names the lr, never a module's backward.
A healthy step stops at the window minimum each norm is carried with: no pass over the
history."""

from __future__ import annotations

from collections import deque

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import StepTrace
from nanwatch.rules import gradients
from nanwatch.rules.testing import TraceBuilder, diagnose

MODES = ["sentinel", "watch"]


def _nw303(nw: nanwatch.Watcher) -> list[tuple[int, nanwatch.Diagnosis]]:
    return [(t.step, d) for t in nw.history for d in t.diagnoses if d.code == "NW303"]


def _regression(mode: str, hard: float, *, steps: int = 100) -> nanwatch.Watcher:
    """SGD fits y = x @ w exactly (the loss falls from about 8 to 1e-14, float32's floor),
    then the batch at ``steps - 5`` has one label off by ``hard``."""
    torch.manual_seed(0)
    w = torch.randn(8, 1)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for step in range(steps):
            x = torch.randn(16, 8)
            y = x @ w
            if step == steps - 5:
                y[0] += hard
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", MODES)
def test_a_fit_at_its_floor_that_meets_one_noisy_label_is_no_explosion(mode: str) -> None:
    nw = _regression(mode, 0.05)
    history = list(nw.history)
    hard = history[-5]
    before = [t.loss for t in history[:-5] if t.loss is not None]
    assert hard.loss is not None and hard.loss > 1e6 * max(before)  # the jump is real
    assert _nw303(nw) == [], [(s, d.evidence) for s, d in _nw303(nw)]
    # a label off by far more sends the gradient past where the run began: an explosion
    found = _nw303(_regression(mode, 1e4))
    assert [s for s, _ in found][:1] == [95], found
    d = found[0][1]
    assert d.evidence[0].startswith("total gradient norm "), d.evidence


def _step(i: int, loss: float, grad: float) -> StepTrace:
    b = TraceBuilder(i)
    b.gradient("fc", "fc.weight", grad)
    return b.build(loss=loss, grad_norm=grad)


def _walk(losses: list[float], grads: list[float]) -> list[int]:
    """Each step diagnosed with the steps before it in a ring of 32, as the watcher does:
    the steps NW303 fires at."""
    ring: deque[StepTrace] = deque(maxlen=32)
    fired = []
    for i, (loss, grad) in enumerate(zip(losses, grads, strict=True)):
        t = _step(i, loss, grad)
        if any(d.code == "NW303" for d in diagnose(t, list(ring))):
            fired.append(i)
        ring.append(t)
    return fired


def _converging(floor: float, hard: float) -> tuple[list[float], list[float]]:
    """100 steps: a loss of 8 (gradient norm 5) that falls geometrically to ``floor`` by
    step 60 and stays there (its gradient norm as the square root), then one hard batch at
    step 95 with gradient norm ``hard``."""
    losses, grads = [], []
    for i in range(100):
        loss = 8.0 * (floor / 8.0) ** (min(i, 60) / 60) * (1.0 + 0.3 * (i % 3))
        losses.append(loss)
        grads.append(5.0 * (loss / 8.0) ** 0.5)
    losses[95], grads[95] = 1.6e-4, hard
    return losses, grads


def test_the_floor_is_the_runs_own_start_carried_past_the_ring() -> None:
    """The ring holds the last 32 steps only: where the run began (loss 8, gradient norm
    5) is carried from step to step, the level a fitted model's gradient goes back to."""
    assert _walk(*_converging(1e-14, 1.0)) == []
    # past the norm the run began with: an explosion whatever the floor
    assert _walk(*_converging(1e-14, 50.0))[:1] == [95]
    # a loss that fell by 1e4 only (not to finfo(float32).eps of where it began): its
    # gradient level (0.05) is no rounding noise, and a jump from it is one
    assert _walk(*_converging(8e-4, 1.0))[:1] == [95]


def _bert_at(lr: float, mode: str) -> nanwatch.Watcher:
    """A tiny BERT under AdamW at 1e-3 for 6 steps, then the lr raised to ``lr`` at once."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=20,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
    )
    model = transformers.BertForMaskedLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 20, (8, 12))
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for step in range(12):
            if step == 6:
                for g in opt.param_groups:
                    g["lr"] = lr
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_gradients_after_an_lr_raised_at_once_blame_the_lr_not_a_module(mode: str) -> None:
    # the loss spikes 10000×: NW308 names the lr, and NW303 adds no module to blame
    nw = _bert_at(50.0, mode)
    codes = {t.step: [d.code for d in t.diagnoses] for t in nw.history}
    assert "NW308" in codes[7], codes
    assert _nw303(nw) == [], [(s, d.headline) for s, d in _nw303(nw)]
    # the loss rises 3× only, the gradients 11×: NW303 says it, and names the lr
    found = _nw303(_bert_at(0.5, mode))
    assert [s for s, _ in found] == [7], [(s, d.headline) for s, d in found]
    d = found[0][1]
    assert d.path is None, d.headline
    said = "\n".join(d.evidence)
    assert "the update at step 6 (AdamW, param group 0) used lr 0.5, 500× the 0.001" in said
    assert "the learning rate made this jump, not a module's backward" in d.explanation
    assert d.fix.startswith('opt.param_groups[0]["lr"] = 1e-3   # was 0.5 (AdamW)'), d.fix
    assert "find what it divides by" not in d.fix, d.fix


def test_a_healthy_step_reads_no_history(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each norm's minimum over the history is carried from step to step; a step whose
    norms are all below explode_factor times theirs stops there, before the regime, the
    medians and the per-step summaries of the history are read."""
    passes = {"regime": 0}
    regime = gradients._regime

    def counted(ctx: object) -> object:
        passes["regime"] += 1
        return regime(ctx)  # type: ignore[arg-type]

    monkeypatch.setattr(gradients, "_regime", counted)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    w = torch.randn(8, 1)
    with nanwatch.watch(model, mode="watch", postmortem=False) as nw:
        for _ in range(40):
            x = torch.randn(64, 8)
            F.mse_loss(model(x), torch.tanh(x @ w)).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    assert not _nw303(nw)
    assert passes["regime"] == 0
