"""A converted loop whose Dataset sleeps in __getitem__: the step waits for data.

`ampkit doctor` must rank "waiting for data" first.
"""

import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import ampkit


class SlowDataset(Dataset):
    """Stands in for decoding images or reading files: 3 ms per sample, all on the main process."""

    def __init__(self, n: int = 512) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x.sum(dim=1) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.003)
        return self.x[i], self.y[i]


torch.manual_seed(0)
loader = DataLoader(SlowDataset(), batch_size=8, shuffle=True)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
acc = ampkit.Accelerator(precision="fp32")
model, optimizer, loader = acc.prepare(model, optimizer, loader)
for _ in range(100):
    for xb, yb in loader:
        acc.backward(nn.functional.cross_entropy(model(xb), yb))
        optimizer.step()
        optimizer.zero_grad()
