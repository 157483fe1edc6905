"""The training steps the benchmarks measure (issue 8).

Each workload is a model, a loss module (so the guards have a loss call to guard), an
optimizer and one fixed batch. A *step* is forward + loss + backward + optimizer step +
zero_grad, all in fp32. ``functional=True`` builds the same step with the loss called as
a function (``F.mse_loss`` / ``F.cross_entropy``) instead of a module, for the
functional-guards variant.

- W1: an MLP of 8 ``Linear(1024)`` + ``ReLU``, batch 256, ``MSELoss``.
- W2: a ResNet-8-style CNN (conv-bn-relu, three residual stages) on 32x32x3, batch 64,
  ``CrossEntropyLoss`` over 10 classes.
- W3: ``nn.TransformerEncoder``, 4 layers, d_model 256, 4 heads, feed-forward 1024, over
  token embeddings, sequence 128, batch 16, ``CrossEntropyLoss`` over a 1000-token head.

``quick=True`` shrinks every shape so that a step takes milliseconds (the CI smoke test).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["WORKLOADS", "Workload", "build"]


class MLP(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class BasicBlock(nn.Module):
    """conv-bn-relu-conv-bn, plus the shortcut, then relu (ResNet's basic block)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu2 = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class ResNet8(nn.Module):
    """A stem conv and three basic blocks (7 convs + the classifier: 8 layers)."""

    def __init__(self, widths: tuple[int, int, int] = (16, 32, 64), classes: int = 10) -> None:
        super().__init__()
        w1, w2, w3 = widths
        self.stem = nn.Sequential(
            nn.Conv2d(3, w1, 3, padding=1, bias=False), nn.BatchNorm2d(w1), nn.ReLU(inplace=True)
        )
        self.layer1 = BasicBlock(w1, w1, 1)
        self.layer2 = BasicBlock(w1, w2, 2)
        self.layer3 = BasicBlock(w2, w3, 2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(w3, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.fc(self.flatten(self.pool(x)))


class TokenTransformer(nn.Module):
    """Embedding -> nn.TransformerEncoder -> linear head over the vocabulary."""

    def __init__(
        self, *, vocab: int, d_model: int, heads: int, ff: int, layers: int, seq: int
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(tokens) + self.pos[: tokens.shape[1]])
        return self.head(h).flatten(0, 1)  # (batch * seq, vocab) for the loss


@dataclass
class Workload:
    """One benchmark workload: call :meth:`step` to run one training step."""

    name: str
    description: str
    model: nn.Module
    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor
    functional: bool = False
    #: the functional form of ``criterion`` (used when ``functional``)
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = field(default=F.mse_loss)

    def loss(self) -> torch.Tensor:
        out = self.model(self.x)
        if self.functional:
            return self.loss_fn(out, self.y)
        return self.criterion(out, self.y)  # type: ignore[no-any-return]

    def step(self) -> torch.Tensor:
        """forward + loss + backward + optimizer step + zero_grad; returns the loss."""
        loss = self.loss()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def modules(self) -> tuple[nn.Module, ...]:
        """What a user passes to ``nanwatch.watch``: the model, and the loss module if any."""
        return (self.model,) if self.functional else (self.model, self.criterion)

    @property
    def n_modules(self) -> int:
        return sum(1 for _ in self.model.modules())


def _w1(quick: bool, functional: bool) -> Workload:
    width, batch = (64, 8) if quick else (1024, 256)
    model = MLP(width, 8)
    x = torch.randn(batch, width)
    y = torch.randn(batch, width)
    return Workload(
        "W1",
        f"MLP 8x(Linear({width})+ReLU), batch {batch}, MSELoss",
        model,
        nn.MSELoss(),
        torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
        x,
        y,
        functional,
        F.mse_loss,
    )


def _w2(quick: bool, functional: bool) -> Workload:
    widths, batch, side = ((4, 8, 8), 4, 8) if quick else ((16, 32, 64), 64, 32)
    model = ResNet8(widths)
    x = torch.randn(batch, 3, side, side)
    y = torch.randint(0, 10, (batch,))
    return Workload(
        "W2",
        f"ResNet-8 CNN {widths}, {side}x{side}x3, batch {batch}, CrossEntropyLoss",
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9),
        x,
        y,
        functional,
        F.cross_entropy,
    )


def _w3(quick: bool, functional: bool) -> Workload:
    if quick:
        vocab, d, heads, ff, layers, seq, batch = 50, 16, 2, 32, 2, 8, 2
    else:
        vocab, d, heads, ff, layers, seq, batch = 1000, 256, 4, 1024, 4, 128, 16
    model = TokenTransformer(vocab=vocab, d_model=d, heads=heads, ff=ff, layers=layers, seq=seq)
    x = torch.randint(0, vocab, (batch, seq))
    y = torch.randint(0, vocab, (batch * seq,))
    return Workload(
        "W3",
        f"TransformerEncoder {layers} layers, d_model {d}, {heads} heads, ff {ff}, "
        f"seq {seq}, batch {batch}, CrossEntropyLoss",
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
        x,
        y,
        functional,
        F.cross_entropy,
    )


WORKLOADS: dict[str, Callable[[bool, bool], Workload]] = {"W1": _w1, "W2": _w2, "W3": _w3}


def build(name: str, *, quick: bool = False, functional: bool = False, seed: int = 0) -> Workload:
    """A fresh workload ``name`` (``"W1"``, ``"W2"``, ``"W3"``), seeded, in training mode."""
    try:
        factory = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None
    torch.manual_seed(seed)
    w = factory(quick, functional)
    w.model.train()
    return w
