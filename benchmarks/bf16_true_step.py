"""bf16-true's fused step against a plain bf16-weight AdamW step (Lightning Fabric's "bf16-true"), side by side.

    OMP_NUM_THREADS=1 python benchmarks/bf16_true_step.py [--rounds 15] [--threads 1]

The model is peers.py's GEMM-bound MLP (1024 -> 4096 -> 1024, 8.4M parameters, batch 64), trained with AdamW
(lr 1e-3). Three loops take turns step by step, warm-up dropped: ampkit bf16-true (bf16 weights, Kahan buffers,
bf16 moments, one fused kernel per group), the plain loop that casts the model to bf16 and steps torch's AdamW on
it (what Fabric's bf16-true does: no compensation, the moments in bf16), and ampkit bf16-mixed (fp32 weights).
Printed: the median whole-step and update-only time of each, and their ratios to the plain bf16 loop.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import ampkit


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))


def loops(batch: int):
    x, y = torch.randn(batch, 1024), torch.randn(batch, 1024)
    made = {}
    for name in ("bf16-true", "bf16-mixed"):
        acc = ampkit.Accelerator(name, device="cpu")
        model = mlp()
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        made[name] = (lambda acc=acc, model=model: acc.backward(F.mse_loss(model(x).float(), y)), opt)
    plain = mlp().bfloat16()
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    made["plain bf16 (Fabric bf16-true)"] = (lambda: F.mse_loss(plain(x.bfloat16()).float(), y).backward(), popt)
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    made = loops(args.batch)
    step = {n: [] for n in made}
    update = {n: [] for n in made}
    for r in range(args.rounds + 3):
        for name, (fwd_bwd, opt) in made.items():
            t0 = time.perf_counter()
            fwd_bwd()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            opt.zero_grad()
            if r >= 3:  # warm-up (the fused kernel compiles at the first step)
                step[name].append(t2 - t0)
                update[name].append(t2 - t1)
    base = "plain bf16 (Fabric bf16-true)"
    print(f"threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}, rounds {args.rounds}")
    print(f"{'loop':32} {'step ms':>8} {'/plain':>7} {'update ms':>10} {'/plain':>7}")
    for name in made:
        s, u = statistics.median(step[name]), statistics.median(update[name])
        bs, bu = statistics.median(step[base]), statistics.median(update[base])
        print(f"{name:32} {1e3 * s:8.1f} {s / bs:6.2f}x {1e3 * u:10.2f} {u / bu:6.2f}x")


if __name__ == "__main__":
    main()
