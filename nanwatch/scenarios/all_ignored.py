"""A token-classification batch whose labels are all padding: the mean loss over zero
tokens is 0/0 = NaN.

In practice: named-entity tagging, part-of-speech tagging or LM fine-tuning with
``ignore_index=-100`` on padding and special tokens. A batch made only of very short (or
fully truncated) sequences, or a collator that masks everything, leaves no position that
counts; ``CrossEntropyLoss(reduction="mean")`` divides a sum of nothing by a count of zero,
and one NaN loss poisons every weight at the next step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanwatch.records import AnomalyKind, Phase
from nanwatch.scenarios import Expected

TITLE = "Cross-entropy over a batch whose labels are all ignore_index"
EXPECTED = Expected(
    kind=AnomalyKind.FORWARD,
    path="CrossEntropyLoss",
    phase=Phase.FORWARD,
    op="aten.nll_loss",
    dtype="float32",
    diagnosis="NW113",
)

PAD = -100


class Tagger(nn.Module):
    def __init__(self, vocab: int = 50, tags: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.encoder = nn.GRU(16, 16, batch_first=True)
        self.head = nn.Linear(16, tags)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.encoder(self.embed(ids))
        return self.head(h)


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    model = Tagger()
    criterion = nn.CrossEntropyLoss(ignore_index=PAD)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with watch(model, criterion) as nw:
        for step in range(3):
            ids = torch.randint(0, 50, (4, 10))
            tags = torch.randint(0, 5, (4, 10))
            if step == 2:
                tags[:] = PAD  # every position is padding in this batch
            logits = model(ids)
            loss = criterion(logits.reshape(-1, 5), tags.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
