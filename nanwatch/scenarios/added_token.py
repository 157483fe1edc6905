"""A token added to the tokenizer after the model was built: its id equals the vocabulary
size, one past the last row of the embedding.

In practice: a language model is built with ``nn.Embedding(len(tokenizer), d)``, then the
training script adds a special token: an end-of-text marker appended to every document, a
pad token for a tokenizer that had none, chat role markers for fine-tuning
(``tokenizer.add_special_tokens(...)``). The new token gets the next free id, which is the
old vocabulary size, and nobody calls ``model.resize_token_embeddings(len(tokenizer))``. On
the CPU PyTorch stops with "IndexError: index out of range in self", naming neither the
embedding nor the id; on a GPU the embedding kernel's assert fires and the run dies with
"RuntimeError: CUDA error: device-side assert triggered", reported at a later line, with
the CUDA context gone. nanwatch's guard checks the ids before the embedding runs and names
the id, where it is, the number of rows and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from nanwatch.errors import GuardError
from nanwatch.scenarios import Expected

TITLE = "Token id equal to the vocabulary size (a token added later)"
EXPECTED = Expected(raises=GuardError, diagnosis="NW513")

WORDS = [
    *("the", "cat", "dog", "sat", "ran", "on", "a", "mat", "log", "and", "then"),
    *("slept", "barked", "under", "tree", "quickly", "slowly", "big", "small", "red", "blue"),
]
EOS = "<|endoftext|>"
SEQ = 12
BATCH = 8


class WordTokenizer:
    """A word-level tokenizer with the parts of Hugging Face's interface the script uses:
    ``len(tokenizer)``, ``add_special_tokens``, ``encode``."""

    def __init__(self, words: list[str]) -> None:
        self.vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", *words])}
        self.pad_token_id = 0

    def __len__(self) -> int:
        return len(self.vocab)

    def add_special_tokens(self, tokens: list[str]) -> int:
        added = [t for t in tokens if t not in self.vocab]
        for t in added:
            self.vocab[t] = len(self.vocab)  # the next free id: the old vocabulary size
        return len(added)

    def encode(self, text: str) -> list[int]:
        return [self.vocab.get(w, 1) for w in text.split()]


class TinyLM(nn.Module):
    """Token and position embeddings, one transformer layer, a head over the vocabulary."""

    def __init__(self, vocab_size: int, d_model: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(SEQ, d_model)
        self.block = nn.TransformerEncoderLayer(d_model, 4, 64, batch_first=True)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        h = self.embed(ids) + self.pos(positions)
        return self.head(self.block(h))


def documents(n: int) -> Iterator[str]:
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        n_words = int(torch.randint(4, SEQ - 1, (), generator=g, device=g.device))
        idx = torch.randint(0, len(WORDS), (n_words,))
        yield " ".join(WORDS[i] for i in idx.tolist())


def batches(tokenizer: WordTokenizer, n: int) -> Iterator[torch.Tensor]:
    """Documents packed one per row, each ending with the end-of-text token, right-padded."""
    docs = list(documents(n * BATCH))
    for b in range(n):
        ids = torch.full((BATCH, SEQ), tokenizer.pad_token_id)
        for row, doc in enumerate(docs[b * BATCH : (b + 1) * BATCH]):
            tokens = tokenizer.encode(doc) + tokenizer.encode(EOS)
            ids[row, : len(tokens)] = torch.tensor(tokens)
        yield ids


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    tokenizer = WordTokenizer(WORDS)
    model = TinyLM(len(tokenizer))
    tokenizer.add_special_tokens([EOS])  # after the model: the embedding is one row short
    criterion = nn.CrossEntropyLoss(ignore_index=tokenizer.pad_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with watch(model, criterion) as nw:
        for ids in batches(tokenizer, 3):
            logits = model(ids[:, :-1])
            loss = criterion(logits.flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
