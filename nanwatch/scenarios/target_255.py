"""Segmentation masks with 255 on object boundaries, under CrossEntropyLoss's default
ignore_index of -100.

In practice: Pascal VOC, Cityscapes, ADE20K and most segmentation datasets mark "void"
pixels (object boundaries, unlabeled regions) with 255 in their PNG masks. The dataset code
loads a mask as an integer tensor and the training script uses ``nn.CrossEntropyLoss()``,
whose ``ignore_index`` is -100, not 255. On the CPU PyTorch stops with "IndexError: Target
255 is out of bounds."; on a GPU the loss kernel's assert fires and the run dies with
"RuntimeError: CUDA error: device-side assert triggered", reported at some later line, with
the CUDA context gone so nothing can be inspected. The fix is one argument:
``nn.CrossEntropyLoss(ignore_index=255)``. nanwatch's guard checks the target before the
kernel runs and says exactly that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanwatch.errors import GuardError
from nanwatch.scenarios import Expected

TITLE = "Segmentation target 255 with the default ignore_index"
EXPECTED = Expected(raises=GuardError, diagnosis="NW501")

CLASSES = 21  #: Pascal VOC: background and 20 object classes
VOID = 255
SIZE = 64


class SegNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.act = nn.ReLU()
        self.head = nn.Conv2d(16, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.stem(x)))


def load_batch(n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and VOC-style masks: a few labeled rectangles on background, their outlines
    marked 255 (void) the way the dataset's PNGs mark object boundaries."""
    images = torch.rand(n, 3, SIZE, SIZE)
    masks = torch.zeros(n, SIZE, SIZE, dtype=torch.long)
    for i in range(n):
        for _ in range(3):
            y0, x0 = torch.randint(0, SIZE - 16, (2,)).tolist()
            h, w = torch.randint(8, 16, (2,)).tolist()
            masks[i, y0 : y0 + h, x0 : x0 + w] = int(torch.randint(1, CLASSES, ()))
    edge = torch.zeros_like(masks, dtype=torch.bool)
    edge[:, 1:, :] |= masks[:, 1:, :] != masks[:, :-1, :]
    edge[:, :, 1:] |= masks[:, :, 1:] != masks[:, :, :-1]
    masks[edge] = VOID
    return images, masks


def train(watch: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    model = SegNet()
    criterion = nn.CrossEntropyLoss()  # ignore_index=-100; the masks use 255
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, criterion) as nw:
        for _ in range(3):
            images, masks = load_batch()
            loss = criterion(model(images), masks)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
