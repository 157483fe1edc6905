"""A gradient spike the loop already clips before optimizer.step() is not reported as
exploding gradients with a clipping fix (NW303); q/k gradients that are exactly 0 because
the attention softmax saturated are not blamed on float16 underflow (NW304)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.rules.base import Diagnosis

torch.set_num_threads(1)


def _diags(nw: Any, code: str) -> list[Diagnosis]:
    return [d for t in nw.history for d in t.diagnoses if d.code == code]


# ---------------------------------------------------------------- NW303: clipped spikes


class _IRNN(nn.Module):
    def __init__(self, vocab: int = 30) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 32)
        self.rnn = nn.RNN(32, 64, nonlinearity="relu", batch_first=True)
        self.out = nn.Linear(64, vocab)
        with torch.no_grad():
            self.rnn.weight_hh_l0.copy_(torch.eye(64))
            self.rnn.bias_hh_l0.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(x))
        out: torch.Tensor = self.out(h)
        return out


def test_an_rnn_that_clips_before_step_is_not_told_to_clip() -> None:
    """IRNN language model, clip_grad_norm_(..., 1.0) between backward() and step(): the
    gradient norm measured at the end of backward spikes 15x at step 8, but the optimizer
    applied it clipped to 1.0. Recommending that very clip is noise."""
    torch.manual_seed(0)
    m = _IRNN()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(m, postmortem=False) as nw:
            for _ in range(12):
                x = torch.randint(0, 30, (8, 64))
                logits = m(x[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, 30), x[:, 1:].reshape(-1))
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                opt.step()
                nw.step()
    assert not _diags(nw, "NW303")


def _spiky_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    return m, torch.optim.SGD(m.parameters(), lr=1e-3)


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Regression batches; the one of step 10 has targets 100 times larger: a spike."""
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    return x, (y * 100 if i == 10 else y)


def test_a_spike_clipped_before_step_is_silent() -> None:
    m, opt = _spiky_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(m, postmortem=False) as nw:
            for i in range(14):
                x, y = _batch(i)
                loss = F.mse_loss(m(x), y)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=1.0)
                opt.step()
                nw.step()
    assert not _diags(nw, "NW303")


def test_an_unclipped_spike_is_still_reported() -> None:
    m, opt = _spiky_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(m, postmortem=False) as nw:
            for i in range(14):
                x, y = _batch(i)
                loss = F.mse_loss(m(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()
    found = _diags(nw, "NW303")
    assert found and "clip_grad_norm_" in found[0].fix


def test_a_clip_after_step_does_not_count() -> None:
    """clip_grad_norm_ after optimizer.step() clips nothing the update applied."""
    m, opt = _spiky_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(m, postmortem=False) as nw:
            for i in range(14):
                x, y = _batch(i)
                loss = F.mse_loss(m(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=1.0)
                nw.step()
    assert _diags(nw, "NW303")


# ---------------------------------------------------------------- NW304: saturated softmax


class _Attn(nn.Module):
    def __init__(self, d: int = 32, nh: int = 2) -> None:
        super().__init__()
        self.nh, self.hd = nh, d // nh
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q = self.q(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd)
        out: torch.Tensor = self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c))
        return out


class _Net(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.attn = _Attn(d)
        self.ln2 = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        x = x + self.attn(self.ln(x))
        out: torch.Tensor = self.out(self.ln2(x))[:, -1]
        return out


def _attention(gain: float) -> Any:
    """A float16 attention fine-tune whose q/k weights were scaled by ``gain``."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = _Net()
    with torch.no_grad():
        model.attn.q.weight.mul_(gain)
        model.attn.k.weight.mul_(gain)
    model = model.half()
    crit = nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=2e-2, eps=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, crit, postmortem=False) as nw:
            for _ in range(8):
                ids = torch.randint(0, 32, (8, 8), generator=g)
                loss = crit(model(ids).float(), ids[:, 0])
                loss.backward()
                opt.step()
                opt.zero_grad()
                nw.step()
    return nw


def test_q_k_gradients_zeroed_by_a_saturated_softmax_are_not_float16_underflow() -> None:
    """q @ k^T reaches thousands: the softmax rows are one-hot and q/k's gradients are
    exactly 0 in float32 too. attn.v, fed the same input, gets gradients ~0.1."""
    found = _diags(_attention(60.0), "NW304")
    assert found
    d = found[0]
    assert d.path in ("attn.q", "attn.k")
    text = " ".join([d.headline, *d.evidence, d.explanation, d.fix])
    assert "GradScaler(" not in d.fix and "autocast" not in d.fix
    assert "underflow" not in d.evidence[0]
    assert "softmax" in text and "attn.v" in text
    assert "F.normalize(q, dim=-1)" in d.fix


def test_healthy_attention_in_float16_has_no_zero_gradients() -> None:
    assert not _diags(_attention(1.0), "NW304")
