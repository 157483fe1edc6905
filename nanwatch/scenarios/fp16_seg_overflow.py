"""A float16 segmentation head: logits at ignored pixels grow until exp overflows.

In practice: semantic segmentation under float16 (``model.half()`` or autocast), labels
with an "ignore" value (255: void, borders, unlabeled regions) and a hand-written soft
Dice/softmax term that calls ``exp`` on the logits. Cross-entropy ignores those pixels, so
nothing pulls their logits down; as the weights grow to fit the labeled pixels, the
logits where the input is unusual (here: bright padding) grow with them. float16's exp
overflows above log(65504) = 11.09: exp gives inf, inf / inf gives NaN, and the loss is NaN
after hundreds of healthy steps. The logit magnitude climbed for many steps before that --
nanwatch shows the climb and warns while there is still headroom.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanwatch.records import AnomalyKind, Phase
from nanwatch.scenarios import Expected

TITLE = "float16 segmentation head: exp overflows at ignored pixels"
EXPECTED = Expected(
    kind=AnomalyKind.FORWARD,
    path="SegLoss",
    phase=Phase.FORWARD,
    op="aten.exp",
    dtype="float16",
    diagnosis="NW206",
)

IGNORE = 255
CLASSES = 4


class SegNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.act = nn.ReLU()
        self.head = nn.Conv2d(16, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.stem(x)))


class SegLoss(nn.Module):
    """Cross-entropy (ignoring label 255) plus a soft Dice term on hand-written softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.ce = nn.CrossEntropyLoss(ignore_index=IGNORE)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        ce = self.ce(logits.float(), target)
        e = logits.exp()  # softmax by hand, in the logits' dtype
        probs = e / e.sum(dim=1, keepdim=True)
        valid = (target != IGNORE).unsqueeze(1)
        onehot = torch.zeros_like(probs).scatter_(1, target.clamp(max=CLASSES - 1).unsqueeze(1), 1)
        inter = (probs * onehot * valid).sum()
        dice = 1 - 2 * inter / ((probs * valid).sum() + (onehot * valid).sum())
        return ce + dice.float()


def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    # drawn on the generator's device (the CPU), whatever the default device is
    target = torch.randint(0, CLASSES, (4, 16, 16), generator=gen, device=gen.device)
    x = 0.5 * torch.randn(4, 3, 16, 16, generator=gen, device=gen.device)
    for c in range(CLASSES):  # each class has its own mean color
        x += (target == c).unsqueeze(1) * (0.4 * c)
    x[:, :, :, 12:] = 4.0  # bright padding on the right: unlabeled
    target[:, :, 12:] = IGNORE
    return x.half(), target


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = SegNet().half()
    criterion = SegLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with watch(model, criterion) as nw:
        for _ in range(36):
            x, target = (t.to(opt.param_groups[0]["params"][0].device) for t in batch(gen))
            loss = criterion(model(x), target)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
