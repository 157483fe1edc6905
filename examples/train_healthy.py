"""A healthy training loop: nanwatch stays silent and writes no report.

    nanwatch run examples/train_healthy.py
"""

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
criterion = nn.CrossEntropyLoss()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for _ in range(20):
    x = torch.randn(32, 8)
    y = x[:, :3].argmax(dim=1)
    loss = criterion(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
print(f"final loss {loss.item():.4f}")
