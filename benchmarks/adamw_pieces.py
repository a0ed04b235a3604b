"""torch's AdamW alone on fp32 tensors, as one tensor or cut in pieces: what the chunked updates build on.

    OMP_NUM_THREADS=1 python benchmarks/adamw_pieces.py                       # 8.4M elements (the peers MLP)
    OMP_NUM_THREADS=1 python benchmarks/adamw_pieces.py --elements 1000000 --pieces 65536,262144

One `AdamW.step()` (lr 1e-3, torch's default implementation for the CPU: the for-loop one) over random
fp32 gradients, in three layouts of the same elements: one tensor; pieces of k elements handed to one
optimizer (one call steps them one after the other, each piece's ten or so kernels while it is in
cache); and one optimizer per piece (one call per piece, as a chunked update that calls the optimizer
once per chunk). Rounds are interleaved over the layouts, the first dropped; the figure is the median
step time. It is the arithmetic the user's optimizer does, which ampkit's `-master` and `bf16-true`
updates call unchanged (they add the conversions between bf16 storage and fp32 around it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import machine  # noqa: E402


def layouts(elements: int, piece: int) -> dict[str, list[torch.optim.Optimizer]]:
    n = elements // piece * piece
    g = torch.Generator().manual_seed(0)
    whole = torch.nn.Parameter(torch.randn(n, generator=g))
    whole.grad = torch.randn(n, generator=g)
    pieces = [torch.nn.Parameter(p.clone()) for p in whole.detach().split(piece)]
    for p, grad in zip(pieces, whole.grad.split(piece)):
        p.grad = grad.clone()
    return {
        "one tensor": [torch.optim.AdamW([whole], lr=1e-3)],
        f"pieces of {piece}, one call": [torch.optim.AdamW(pieces, lr=1e-3)],
        f"pieces of {piece}, a call each": [torch.optim.AdamW([p], lr=1e-3) for p in pieces],
    }


def step_ms(optimizers: list[torch.optim.Optimizer]) -> float:
    start = time.perf_counter()
    for opt in optimizers:
        opt.step()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=8_400_000)
    parser.add_argument("--pieces", default="131072,262144,1048576", help="piece sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    print(
        f"AdamW.step() over {args.elements / 1e6:.1f}M fp32 elements ({machine()}); "
        f"ms, median of {args.rounds - 1} rounds"
    )
    for piece in (int(p) for p in args.pieces.split(",")):
        runs = layouts(args.elements, piece)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(args.rounds):
            for name, optimizers in runs.items():
                t = step_ms(optimizers)
                if r:
                    times[name].append(t)
        print("  " + "; ".join(f"{name} {statistics.median(t):.1f}" for name, t in times.items()))


if __name__ == "__main__":
    main()
