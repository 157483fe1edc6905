"""Tiny Hugging Face encoders for tests (one layer, width 32, a vocabulary of 100): built
the way the user's model is, small enough to run in milliseconds on the CPU."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

transformers = pytest.importorskip("transformers")

#: one layer of width 32: what a BERT-style config needs besides the sizes a test sets
_TINY = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 100,
}


def tiny_classifier(kind: str = "Bert", positions: int = 64, **config: Any) -> nn.Module:
    """``{kind}ForSequenceClassification`` (``Bert``, ``Roberta``) with ``positions``
    position embeddings and the tiny sizes above; ``config``: further settings."""
    transformers.logging.set_verbosity_error()
    cfg = getattr(transformers, f"{kind}Config")(
        **_TINY, max_position_embeddings=positions, **config
    )
    model: nn.Module = getattr(transformers, f"{kind}ForSequenceClassification")(cfg)
    return model
