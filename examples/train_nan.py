"""A plain training loop that goes NaN: a log-loss written by hand meets a probability of 0.

Run it under nanwatch without changing a line:

    nanwatch run examples/train_nan.py
"""

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1), nn.Sigmoid())
opt = torch.optim.SGD(model.parameters(), lr=0.5)


def log_loss(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


for step in range(200):
    x = torch.randn(64, 10) * (1 + step / 10)  # inputs drift: the sigmoid saturates
    y = (x[:, :1] > 0).float()
    loss = log_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step % 50 == 0:
        print(f"step {step}: loss {loss.item():.4f}")
print("done")
