"""Faulty data-parallel runs for test_distributed_faults.py: `torchrun --nproc-per-node=2 dist_fault_run.py MODE`.

raise: rank 1 raises at its third step (rank 0 is then waiting in DDP's gradient all-reduce);
stall: rank 1 sleeps at its third step, with Accelerator(timeout=5) (seconds);
uneven: rank 1's loader has more batches than rank 0's (a DistributedSampler the script made itself).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ampkit


def main(mode: str) -> None:
    acc = ampkit.Accelerator(precision="fp32", **({"timeout": 5} if mode == "stall" else {}))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    n = 64 + (32 * acc.rank if mode == "uneven" else 0)  # uneven: rank 1 sees 96 rows, rank 0 64
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(acc.rank))
    dataset = TensorDataset(x, x[:, :4].argmax(dim=1))
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=False) if mode == "uneven" else None
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    for step, (xb, yb) in enumerate(loader):
        if step == 3 and acc.rank == 1 and mode == "raise":
            raise RuntimeError("rank 1 fails at step 3 (planted)")
        if step == 3 and acc.rank == 1 and mode == "stall":
            time.sleep(600)
        loss = F.cross_entropy(model(xb), yb)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    print(f"rank {acc.rank} done after {step + 1} steps", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
