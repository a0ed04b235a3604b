"""A plain PyTorch training loop and its four-line ampkit twin, run side by side.

    python examples/four_lines.py                  # every preset, 300 steps each
    python examples/four_lines.py --precisions fp32,bf16-mixed --steps 100

Prints, per run, the median time per step and the final training loss. The two functions below
differ in exactly the four marked lines (with the import): that is the whole conversion.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ampkit  # +4


def make_problem(seed: int = 0, n: int = 4096, dim: int = 64, classes: int = 10):
    """A model, an optimizer, a scheduler and a loader; the same for every run under one seed."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(dim, classes, generator=g)
    x = torch.randn(n, dim, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(n, classes, generator=g)).argmax(dim=1)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(dim, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, classes))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(seed))
    return model, optimizer, scheduler, loader


def plain_loop(steps: int) -> tuple[list[float], float]:
    model, optimizer, scheduler, loader = make_problem()
    times, step = [], 0
    while step < steps:
        for x, y in loader:
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - t0)
            step += 1
            if step == steps:
                break
    return times, loss.item()


def ampkit_loop(steps: int, precision: str) -> tuple[list[float], float]:
    model, optimizer, scheduler, loader = make_problem()
    acc = ampkit.Accelerator(precision=precision)  # +1
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)  # +2
    times, step = [], 0
    while step < steps:
        for x, y in loader:
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            acc.backward(loss)  # +3 (was loss.backward())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - t0)
            step += 1
            if step == steps:
                break
    return times, loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--precisions", default=",".join(ampkit.PRESETS), help="comma-separated presets to run (default: all)"
    )
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default: 300)")
    args = parser.parse_args()
    warmup = min(10, args.steps // 5)

    def report(label: str, times: list[float], loss: float) -> None:
        print(f"{label:<22} {statistics.median(times[warmup:]) * 1e3:8.3f} ms/step   final loss {loss:.4f}", flush=True)

    print(
        f"device: {ampkit.Accelerator(precision='fp32').device}; auto would pick {ampkit.Accelerator().policy.name!r} "
        f"({ampkit.Accelerator().policy.reason})"
    )
    report("plain fp32 loop", *plain_loop(args.steps))
    for precision in args.precisions.split(","):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            times, loss = ampkit_loop(args.steps, precision)
        report(f"ampkit {precision}", times, loss)
        for w in caught:
            print(f"  note: {w.message}")


if __name__ == "__main__":
    main()
