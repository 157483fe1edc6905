"""A training loop that crashes: a segmentation target holds 255 (the "ignore" label) but
the loss was built with the default ignore_index. On a GPU this is the unreadable
"CUDA error: device-side assert triggered"; under nanwatch the guard names the value.

    nanwatch run examples/train_crash.py
"""

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Conv2d(3, 5, kernel_size=1)
criterion = nn.CrossEntropyLoss()  # meant: nn.CrossEntropyLoss(ignore_index=255)
opt = torch.optim.SGD(model.parameters(), lr=0.1)

for step in range(3):
    images = torch.randn(2, 3, 8, 8)
    masks = torch.randint(0, 5, (2, 8, 8))
    masks[:, :2, :] = 255  # unlabeled border
    loss = criterion(model(images), masks)
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step}: loss {loss.item():.4f}")
