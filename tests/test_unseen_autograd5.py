"""Unseen models, autograd: tied input/output embeddings with nn.Embedding(max_norm=...).
The embedding renormalises its (shared) weight in place inside its own forward, after the
tied output layer saved it; NW403 names that write and its fix, not an optimizer step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch

torch.set_num_threads(1)

V, D = 30, 8


class Dec(nn.Module):
    """A tiny decoder LM, tied embeddings, decoded step by step (teacher forcing)."""

    def __init__(self, max_norm: float | None) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D, max_norm=max_norm)
        self.cell = nn.GRUCell(D, D)
        self.out = nn.Linear(D, V, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(ids.size(0), D)
        outs = []
        for t in range(ids.size(1)):
            h = self.cell(self.emb(ids[:, t]), h)
            outs.append(self.out(h))
        return torch.stack(outs, 1)


def _train(model: Dec) -> nanwatch.Watcher:
    torch.manual_seed(0)
    crit = nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    nw = nanwatch.watch(model, crit, postmortem=False)
    with nw:
        for _ in range(2):
            ids = torch.randint(0, V, (4, 5))
            logits = model(ids[:, :-1])
            loss = crit(logits.reshape(-1, V), ids[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


def test_the_diagnosis_blames_max_norm_and_names_the_tied_layer() -> None:
    torch.manual_seed(0)
    model = Dec(max_norm=1.0)
    crit = nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    nw = nanwatch.watch(model, crit, postmortem=False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"), nw:
        ids = torch.randint(0, V, (4, 5))
        loss = crit(model(ids[:, :-1]).reshape(-1, V), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
    d = next(d for d in nw.report.diagnoses if d.code == "NW403")
    assert d.path == "emb"
    assert "max_norm" in d.explanation and "out (tied to emb.weight)" in d.explanation
    assert "optimizer.step()" not in d.fix and "max_norm" in d.fix
    assert "F.linear(x, emb.weight.clone())   # instead of out(x)" in d.fix
    assert any("emb (Embedding) ran again" in e and "out (Linear" in e for e in d.evidence)


def test_a_tied_pair_called_directly_names_the_embedding() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, max_norm=1.0)
    out = nn.Linear(4, 10, bias=False)
    out.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "out": out})
    nw = nanwatch.watch(model, postmortem=False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"), nw:
        ids = torch.tensor([[1, 2], [3, 4]])
        logits0 = model["out"](model["emb"](ids[:, 0]))  # out saves emb.weight
        logits1 = model["out"](model["emb"](ids[:, 1]))  # the renorm writes it
        (logits0.logsumexp(-1) + logits1.logsumexp(-1)).mean().backward()
    d = next(d for d in nw.report.diagnoses if d.code == "NW403")
    assert d.path == "emb" and "renormalises" in d.explanation
    assert "emb.weight.clone()" in d.fix


def test_the_tied_model_without_max_norm_stays_silent() -> None:
    nw = _train(Dec(max_norm=None))
    assert not [d for d in nw.report.diagnoses if d.code == "NW403"]


def test_an_embedding_updated_by_the_optimizer_between_backwards_is_still_blamed_on_it() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    ids = torch.tensor([1, 2, 3])
    nw = nanwatch.watch(emb, postmortem=False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"), nw:
        h = emb(ids)
        y = h @ emb.weight.t()  # saves emb.weight
        y.sum().backward(retain_graph=True)
        opt.step()
        y.pow(2).sum().backward()
    d = next(d for d in nw.report.diagnoses if d.code == "NW403")
    assert "optimizer.step()" in d.fix and "max_norm" not in d.explanation
