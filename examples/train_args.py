"""A script with its own command-line arguments: nanwatch passes them through untouched.

    nanwatch run examples/train_args.py --steps 5 --lr 0.01 --exit-code 3
"""

import argparse
import sys

import torch
from torch import nn

parser = argparse.ArgumentParser(description="a tiny regression")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--exit-code", type=int, default=0)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=args.lr)
for _ in range(args.steps):
    x = torch.randn(16, 4)
    loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print(f"argv={sys.argv[1:]} steps={args.steps} lr={args.lr} name={__name__}")
sys.exit(args.exit_code)
