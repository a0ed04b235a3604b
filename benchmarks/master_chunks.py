"""bf16-master's update at several chunk and run sizes, interleaved in one process.

    OMP_NUM_THREADS=1 python benchmarks/master_chunks.py                       # the peers MLP, 8.4M parameters
    OMP_NUM_THREADS=1 python benchmarks/master_chunks.py --model transformer --settings 262144:0,1048576:131072

One model prepared with `bf16-master` and AdamW (lr 1e-3); before each timed round it is set to one
`chunk:run` setting (`opt.weights.chunk`, `opt.weights.run`; run 0: no cap on a flat run's length) and
takes one untimed step (the plan is rebuilt), then `--steps` timed steps of `opt.step()` +
`opt.zero_grad()` alone (the backward before each is not timed). Settings are interleaved round by
round, the first round dropped; the figure is the median of the rounds' per-step means. With
`--fp32-between`, an fp32 copy of the model trains one step between rounds, as in benchmarks/peers.py,
where other variants' data pushes this model's out of the cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _timing import machine  # noqa: E402
from peers import models  # noqa: E402

import ampkit  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp", choices=("mlp", "transformer"))
    parser.add_argument("--settings", default="262144:0,1048576:131072", help="chunk:run pairs, comma-separated")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fp32-between", action="store_true", help="an fp32 copy trains a step between rounds")
    args = parser.parse_args()
    spec = models("full")[args.model]
    batch = spec.batch(torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    acc = ampkit.Accelerator("bf16-master", device="cpu")
    module = spec.build()
    model, opt = acc.prepare(module, torch.optim.AdamW(module.parameters(), lr=1e-3))
    other = spec.build()
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    settings = [tuple(int(v) for v in s.split(":")) for s in args.settings.split(",")]
    times: dict[tuple[int, ...], list[float]] = {s: [] for s in settings}

    def backward() -> None:
        acc.backward(F.cross_entropy(model(batch[0]), batch[1]))

    for r in range(args.rounds):
        for setting in settings:
            if args.fp32_between:
                F.cross_entropy(other(batch[0]), batch[1]).backward()
                other_opt.step()
                other_opt.zero_grad()
            opt.weights.chunk, opt.weights.run = setting
            backward()
            opt.step()
            opt.zero_grad()
            spent = 0.0
            for _ in range(args.steps):
                backward()
                start = time.perf_counter()
                opt.step()
                opt.zero_grad()
                spent += time.perf_counter() - start
            if r:
                times[setting].append(spent / args.steps * 1e3)
    n = sum(p.numel() for p in model.parameters())
    print(f"bf16-master update (opt.step + zero_grad) of the peers {args.model}, {n / 1e6:.1f}M parameters ({machine()}); "
          f"ms, median of {args.rounds - 1} rounds{', an fp32 step between rounds' if args.fp32_between else ''}")
    for (chunk, run), t in times.items():
        print(f"  chunk {chunk}, run {run or 'no cap'}: {statistics.median(t):.1f} ms (rounds {min(t):.1f}–{max(t):.1f})")


if __name__ == "__main__":
    main()
