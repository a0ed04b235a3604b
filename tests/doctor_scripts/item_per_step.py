"""A converted loop that logs with `loss.item()` every step: one host<->device sync per step on a GPU.

`ampkit doctor` must name the planted line (the one marked below) with its file and line number.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ampkit

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=100)
args = parser.parse_args()

torch.manual_seed(0)
x = torch.randn(256, 8)
y = (x.sum(dim=1) > 0).long()
loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

acc = ampkit.Accelerator(precision="fp32")
model, optimizer, loader = acc.prepare(model, optimizer, loader)
losses = []
for _ in range(args.epochs):
    for xb, yb in loader:
        loss = nn.functional.cross_entropy(model(xb), yb)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())  # doctor: planted sync
print(f"trained {len(losses)} steps, last loss {losses[-1]:.3f}")
