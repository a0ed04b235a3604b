"""A training script with a planted fp16 overflow: `boom` multiplies its input by 1e5.

Run as `ampkit doctor --numerics tests/numerics_scripts/planted_overflow.py`; the doctor should
name `boom` and suggest keep_fp32=['boom', 'norm'].
"""

import argparse
import warnings

import torch
from torch import nn
from torch.nn import functional as F

import ampkit

warnings.filterwarnings("ignore", message=r".*runs far slower than fp32.*")


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e5


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential()
model.add_module("fc1", nn.Linear(8, 16))
model.add_module("boom", Boom())
model.add_module("norm", nn.LayerNorm(16))
model.add_module("fc2", nn.Linear(16, 4))
acc = ampkit.Accelerator("fp16-mixed", device="cpu")
model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
g = torch.Generator().manual_seed(0)
for _ in range(args.steps):
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    acc.backward(F.cross_entropy(model(x), y))
    optimizer.step()
    optimizer.zero_grad()
