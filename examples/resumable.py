"""A training loop that survives a crash: kill it at any moment, rerun with --resume, and it
continues the same run (same batches, same dropout masks, same loss scale) from its last checkpoint.

    python examples/resumable.py --precision fp16-mixed            # Ctrl-C or kill it mid-way, then:
    python examples/resumable.py --precision fp16-mixed --resume   # continues from checkpoints/
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ampkit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="auto", help="a preset name or auto (default)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--checkpoints", default="checkpoints", help="checkpoint folder (default: checkpoints)")
    parser.add_argument("--every", type=int, default=50, help="checkpoint every N optimizer steps (default: 50)")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the newest valid checkpoint in --checkpoints"
    )
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8192, 32, generator=g)
    y = (x @ torch.randn(32, 10, generator=g)).argmax(dim=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.Dropout(0.1), nn.GELU(), nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * 128)
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(1))

    acc = ampkit.Accelerator(precision=args.precision)
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    if args.resume and (path := acc.resume(args.checkpoints)) is not None:
        print(f"resumed from {path} at step {acc.state.applied_steps}")

    for epoch in acc.epochs(args.epochs):  # the epochs still to run
        for xb, yb in loader:  # resumes mid-epoch at the exact next batch
            loss = F.cross_entropy(model(xb), yb)
            acc.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            acc.track("loss", loss)
            if acc.state.applied_steps % args.every == 0:
                acc.save_checkpoint(args.checkpoints)
        print(f"epoch {epoch}: mean loss {acc.metrics()['loss']:.4f}, steps {acc.state.applied_steps}")


if __name__ == "__main__":
    main()
