"""A finite loss spike right after an oversized update is warned about at the step it
happens (NW308), in watch and in sentinel mode: before the NaN, the dead units (NW304) or
the exploding gradients (NW303) that follow it. Healthy runs whose loss jumps (a noisy
loss, a warm-up, a loss near 0 that one batch multiplies) stay silent."""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch import scenarios
from nanwatch.records import StepTrace
from nanwatch.rules.testing import TraceBuilder, diagnose

MODES = ["watch", "sentinel"]


def _codes(nw: Any) -> dict[int, list[str]]:
    return {t.step: [d.code for d in t.diagnoses] for t in nw.history}


def _ours(caught: list[warnings.WarningMessage], code: str) -> list[str]:
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, nanwatch.NanwatchWarning) and code in str(w.message)
    ]


def _tiny_bert() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=20,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
    )
    return transformers.BertForMaskedLM(cfg)


@pytest.mark.parametrize("mode", MODES)
def test_bert_at_lr_50_is_warned_at_the_step_its_loss_spikes(mode: str) -> None:
    model = _tiny_bert()
    opt = torch.optim.AdamW(model.parameters(), lr=50.0)
    ids = torch.randint(0, 20, (8, 12))
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(model, mode=mode) as nw:
            for _ in range(3):
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                nw.step()
                losses.append(loss.item())
    assert losses[1] > 100 * losses[0]  # the spike: finite, one step after the first update
    codes = _codes(nw)
    assert "NW308" not in codes[0] and "NW308" in codes[1]
    said = _ours(caught, "NW308")
    assert len(said) == 1, said  # once, at the step it happened
    d = next(d for d in nw.history[1].diagnoses if d.code == "NW308")
    assert d.severity == "warning"
    assert d.parameter in dict(model.named_parameters())
    text = "\n".join(d.evidence)
    assert "the loss of the step before" in text
    assert f"(AdamW, param group 0, lr 50) moved {d.parameter} by 50 per value" in text
    assert "its largest |value|" in text and "when watching began" in text
    # Adam's step is about lr whatever the gradient: the lr is the fix, not clipping
    assert d.fix.startswith('opt.param_groups[0]["lr"] = 5e-4   # was 50 (AdamW)')
    assert "Clipping the gradients does not bound this step" in d.explanation


@pytest.mark.parametrize("mode", MODES)
def test_an_sgd_lr_typo_is_warned_before_the_gradients_explode_and_the_weights_overflow(
    mode: str,
) -> None:
    """The lr-explode scenario (SGD at lr=1e3): the loss first multiplies at step 2, two
    steps or more before NW303 and the inf the update writes (NW301); the loss that keeps
    multiplying after it is the same spike, not one warning a step."""
    out = scenarios.run(scenarios.get("lr-explode"), mode=mode)
    assert out.watcher is not None
    codes = _codes(out.watcher)
    assert [s for s, c in codes.items() if "NW308" in c] == [2]
    assert min(s for s, c in codes.items() if "NW303" in c) >= 4
    assert min(s for s, c in codes.items() if "NW301" in c) >= 5
    d = next(d for d in out.watcher.history[2].diagnoses if d.code == "NW308")
    assert d.parameter == "proj.weight"
    assert "(SGD, param group 0, lr 1000) moved proj.weight by 54.37 per value (lr × its " in (
        "\n".join(d.evidence)
    )
    assert d.fix.startswith('opt.param_groups[0]["lr"] = 0.05   # was 1000 (SGD): its update')
    assert "Clipping" not in d.explanation  # SGD's step is lr × gradient: clipping bounds it


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)))


@pytest.mark.parametrize("mode", MODES)
def test_an_lr_raised_at_once_is_named_at_the_step_the_loss_spikes(mode: str) -> None:
    model = _Encoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 16, (8, 10))
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(model, mode=mode) as nw:
            for step in range(8):
                if step == 5:
                    for g in opt.param_groups:
                        g["lr"] = 50.0
                loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
                nw.step()
                losses.append(loss.item())
    assert losses[6] > 10 * max(losses[:6])
    codes = _codes(nw)
    assert [s for s, c in codes.items() if "NW308" in c] == [6]  # the first loss after it
    said = _ours(caught, "NW308")
    assert len(said) == 1, said
    d = next(d for d in nw.history[6].diagnoses if d.code == "NW308")
    assert "the update at step 5 (AdamW, param group 0) used lr 50, 50000× the 0.001" in (
        "\n".join(d.evidence)
    )
    assert d.fix.startswith('opt.param_groups[0]["lr"] = 1e-3   # was 50 (AdamW); raise it')
    assert "raised 50000× at once, to 50" in d.explanation


@pytest.mark.parametrize("mode", MODES)
def test_a_loss_near_0_that_one_batch_multiplies_is_silent(mode: str) -> None:
    """A regression that converged to 1e-13 meets one noisy label: its loss multiplies by
    many thousands over every loss the ring holds, from an update that was tiny."""
    w = torch.randn(8, 1)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with nanwatch.watch(model, mode=mode, on_anomaly="record") as nw:
        for step in range(100):
            x = torch.randn(16, 8)
            y = x @ w
            if step == 95:
                y[0] += 0.05
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
            losses.append(loss.item())
    assert losses[95] > 1000 * max(losses[95 - nw.config.ring_size : 95])
    assert not [s for s, c in _codes(nw).items() if "NW308" in c]


@pytest.mark.parametrize("mode", MODES)
def test_a_warm_up_that_raises_the_lr_many_times_is_silent(mode: str) -> None:
    """LinearLR raises the lr 100× at its first step and the loss rises for a few steps
    while the lr climbs: a warm-up, not a spike."""
    model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1e-3, total_iters=8)
    x, y = torch.randn(256, 10), torch.randint(0, 5, (256,))
    losses, lrs = [], []
    with nanwatch.watch(model, mode=mode, on_anomaly="record") as nw:
        for step in range(20):
            i = step * 32 % 256
            lrs.append(opt.param_groups[0]["lr"])
            loss = F.cross_entropy(model(x[i : i + 32]), y[i : i + 32])
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            nw.step()
            losses.append(loss.item())
    assert lrs[1] > 100 * lrs[0]
    assert any(b > a for a, b in itertools.pairwise(losses[:8]))  # while the lr climbs
    assert not [s for s, c in _codes(nw).items() if "NW308" in c]


@pytest.mark.parametrize("mode", MODES)
def test_a_noisy_loss_is_silent(mode: str) -> None:
    """One sample a step: the loss varies by orders of magnitude from step to step."""
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    with nanwatch.watch(model, mode=mode, on_anomaly="record") as nw:
        for _ in range(60):
            x = torch.randn(1, 4)
            y = x.sum(1, keepdim=True) + torch.randn(1, 1)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
            losses.append(loss.item())
    assert max(losses) > 1000 * min(losses)
    assert not [s for s, c in _codes(nw).items() if "NW308" in c]


def _adam_step(step: int, loss: float) -> StepTrace:
    b = TraceBuilder(step=step)
    b.gradient("block", "block.gain", 1e-3, numel=8)
    b.gradient("block.proj", "block.proj.weight", 0.1, numel=4096)
    b.note(
        "optimizer",
        "Adam",
        groups=[
            {
                "group": 0,
                "params": 2,
                "names": ["block.gain", "block.proj.weight"],
                "dtypes": ["float32"],
                "lr": 1e-3,
            }
        ],
        ident=1,
    )
    return b.build(loss=loss, grad_norm=0.1)


@pytest.mark.parametrize(
    ("proj_size", "warned"),
    [(0.05, False), (1e-4, True)],
    ids=["a-gain-initialized-near-0", "the-bulk-of-the-weights"],
)
def test_the_update_is_oversized_only_when_it_outgrows_most_of_the_weights(
    proj_size: float, warned: bool
) -> None:
    """A LayerScale gain initialized at 1e-6 moves by 1000× its size at every healthy Adam
    step; a loss spike after such a step is no oversized update while the weights holding
    most of the values moved by a sliver of theirs."""
    scales = {"block.gain": (1e-6, "max", 8), "block.proj.weight": (proj_size, "max", 4096)}
    found = diagnose(_adam_step(1, 30.0), [_adam_step(0, 1.0)], facts={"weight_scales": scales})
    spikes = [d for d in found if d.code == "NW308"]
    assert bool(spikes) is warned
    if warned:
        assert spikes[0].parameter == "block.proj.weight"
        assert "10× its largest |value| 0.0001 when watching began" in "\n".join(spikes[0].evidence)
