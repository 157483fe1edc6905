"""A zoo of awkward models (torchinfo's habit): each exercises something the watcher must
survive without special-casing it."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

Pair = collections.namedtuple("Pair", ["logits", "aux"])


@dataclasses.dataclass
class DataOut:
    logits: torch.Tensor
    hidden: torch.Tensor
    extra: Any = None


class ModelOutput(collections.OrderedDict):  # transformers-style: a dict subclass
    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as exc:
            raise AttributeError(name) from exc


class SharedTwice(nn.Module):
    """The same Linear called twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.sin(self.fc(x)))  # functional code between the two calls


class Recursive(nn.Module):
    """A module that calls itself."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, depth: int = 2) -> torch.Tensor:
        x = self.fc(x)
        return self(x, depth - 1) if depth > 0 else x


class Structured(nn.Module):
    """Outputs of every structure: tuple, dict, dataclass, namedtuple, ModelOutput, None,
    ints."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 2), "b": nn.Linear(4, 3)})

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = self.fc(x)
        return {
            "tuple": (self.heads["a"](h), None),
            "data": DataOut(logits=self.heads["b"](h), hidden=h, extra="text"),
            "pair": Pair(h * 2, torch.arange(3)),
            "model_output": ModelOutput(loss=h.sum(), logits=h),
            "count": 3,
        }


class InplaceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Checkpointed(nn.Module):
    """Activation checkpointing: the block's forward runs again inside backward (reentrant:
    its first pass runs under no_grad)."""

    def __init__(self, *, reentrant: bool = False, block: nn.Module | None = None) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.stem = nn.Linear(4, 4)  # so the block's input requires grad (reentrant needs it)
        self.block = block or nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(
            self.block, self.stem(x), use_reentrant=self.reentrant
        )
        return self.head(h)


class Deep(nn.Module):
    """encoder.layers.N.attn-style paths."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(  # type: ignore[assignment]
            nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.encoder.layers:  # type: ignore[union-attr]
            x = layer(x)
        return x


class LSTMTagger(nn.Module):
    """PackedSequence and tuple-of-tuples outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(
            x, lengths, batch_first=True, enforce_sorted=False
        )
        out, _ = self.lstm(packed)
        padded, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        return self.head(padded)


class GatedDropout(nn.Module):
    """Dropout, then a division by the ``gate`` buffer: a loop that zeroes the gate makes
    this module's own forward blow up, so its replay (which draws dropout masks again)
    runs."""

    def __init__(self, p: float = 0.3) -> None:
        super().__init__()
        self.drop = nn.Dropout(p)
        self.register_buffer("gate", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x) / self.gate


class Regularized(nn.Module):
    """Training-time state and randomness: BatchNorm's running statistics (buffers every
    forward updates) and Dropout's draws from the global RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Dropout2d(0.2),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.hidden = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.GELU())
        self.gated = GatedDropout()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gated(self.hidden(self.features(x))))


class Rope(nn.Module):
    """Rotary angles computed in the model's dtype: theta = base ** (i / d)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i = torch.arange(0, 16, 2, dtype=x.dtype)
        theta = 1e6 ** (i / 16)
        ang = torch.arange(x.shape[1], dtype=x.dtype)[:, None] * theta
        return self.lin(x) * ang.cos().repeat_interleave(2, -1)


class TanhMLP(nn.Module):
    """8 -> 16 (tanh) -> 1, its layers named fc1/fc2: the optimizer tests' regression net."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class TwoTasks(nn.Module):
    """A shared trunk and two task heads (4 classes and 1 regression output): the
    multi-task tests' model."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.a = nn.Linear(16, 4)
        self.b = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.a(h), self.b(h)
