"""NW402 on a causal mask over left padding: no sequence is empty, the rows with no key
are the pad positions' queries (they see only pad keys). The NaN tensor's count, not a
whole number of samples, tells it; the fix says so instead of 'an empty sequence'."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.errors import AnomalyError


class Attn(nn.Module):
    def __init__(self, d: int = 16, fill: float | None = None) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.fill = fill

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / 4.0
        n = x.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)
        mask = causal[None] | (attention_mask[:, None, :] == 0)
        if self.fill is None:
            scores = scores.masked_fill(mask, float("-inf"))
        else:
            scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        attn = torch.softmax(scores, dim=-1)
        return self.out(attn @ v)


class LM(nn.Module):
    def __init__(self, fill: float | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.attn = Attn(fill=fill)
        self.head = nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.emb(ids), attention_mask))


def _batch(empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    ids = torch.randint(1, 50, (2, 8))
    am = torch.ones(2, 8, dtype=torch.long)
    if empty:
        am[0] = 0  # a sequence of length 0
    else:
        am[0, :3] = 0  # left padding
    return ids, am


def _nw402(mode: str, empty: bool = False) -> nanwatch.Diagnosis:
    model = LM()
    ids, am = _batch(empty)
    with pytest.raises(AnomalyError), nanwatch.watch(model, mode=mode, postmortem=False) as nw:
        model(ids, am)
    d = nw.report.diagnoses[0]
    assert d.code == "NW402"
    return d


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_causal_left_padding_names_pad_queries(mode: str) -> None:
    d = _nw402(mode)
    assert "not a whole number of" in d.evidence[0]
    assert "no sequence is empty" in d.evidence[0]
    assert "empty sequence, length 0" not in d.fix
    assert "torch.finfo(scores.dtype).min" in d.fix
    assert "pad positions' queries" in d.fix
    assert "leave pad positions out of the loss" in d.fix


def test_an_empty_sequence_keeps_the_empty_sequence_words() -> None:
    d = _nw402("watch", empty=True)
    assert "an empty sequence, length 0" in d.fix
    assert not any("no sequence is empty" in e for e in d.evidence)


def test_finite_fill_trains_clean() -> None:
    model = LM(fill=1.0)
    ids, am = _batch()
    with nanwatch.watch(model, postmortem=False) as nw:
        out = model(ids, am)
        labels = ids.masked_fill(am == 0, -100)
        loss = nn.functional.cross_entropy(out.reshape(-1, 50), labels.reshape(-1))
        loss.backward()
        nw.step()
    assert torch.isfinite(loss)
    assert not nw.report.diagnoses
