"""A loop that runs each batch of 64 rows as micro-batches with `acc.split` (micro_batch=32), with an
out-of-memory error planted in the second micro-batch of the first batch's backward (tests/oom.py): the size
halves to 16.

`ampkit doctor` must say the micro-batch was halved and that the device sees 16 rows at a time.
"""

import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ampkit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for oom.py
from oom import plant_oom  # noqa: E402

torch.manual_seed(0)
x = torch.randn(1024, 8)
loader = DataLoader(TensorDataset(x, (x.sum(dim=1) > 0).long()), batch_size=64, shuffle=True)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
acc = ampkit.Accelerator(precision="fp32", micro_batch=32)
model, optimizer, loader = acc.prepare(model, optimizer, loader)
plant_oom(acc, model, batch=0, micro=1, phase="backward")  # as if that backward ran out of memory
for _ in range(100):
    for batch in loader:
        for xb, yb in acc.split(batch):
            acc.backward(nn.functional.cross_entropy(model(xb), yb))
        optimizer.step()
        optimizer.zero_grad()
