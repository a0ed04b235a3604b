"""Updates lost to bf16 rounding: torch's AdamW on a bf16 model vs the drop-in `ampkit.optim.AdamW`, against fp32.

    OMP_NUM_THREADS=2 python benchmarks/dropin_lost_updates.py [--steps 400] [--size small] [--seed 0]

tiny-lm (`ampkit.tools.tasks.tiny_lm`: a byte-level transformer on Python's stdlib source) trained three times from
the same initial weights and the same batches, with the task's AdamW settings (betas 0.9/0.95, weight decay 0.01)
and its learning rate decayed by a cosine to a tenth, as LM recipes do:

- fp32: the fp32 model, torch's AdamW (the reference);
- bf16 plain: `model.to(torch.bfloat16)`, torch's AdamW (bf16 weights and moments, no compensation);
- bf16 drop-in: `model.to(torch.bfloat16)`, `ampkit.optim.AdamW` (bf16-true's compensated update).

Printed per run: the lost-update share, measured by ampkit's lost-update detector (the doctor's: of the elements
with a nonzero gradient, those whose effective weight did not move at a step; the effective weight is the bf16
weight, or for the drop-in the weight plus its compensation), the share of updates below half a bf16 ulp, the
mean training loss of the last 50 steps and the held-out loss, each with its gap to fp32.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

import ampkit.optim
from ampkit.tools.doctor.numerics.lost_updates import LostUpdateDetector
from ampkit.tools.tasks import tiny_lm


class Watched:
    """What the lost-update detector reads of an optimizer (`param_groups`, and `weights` where the effective
    weight is not the parameter itself): for the drop-in, each bf16 weight plus its compensation."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.param_groups = opt.param_groups
        self.weights = _Compensated(opt) if isinstance(opt, ampkit.optim.CompensatedStep) else None


class _Compensated:
    kind = "compensated"

    def __init__(self, opt: ampkit.optim.CompensatedStep) -> None:
        self.opt = opt
        self.pairs = [(p, p) for g in opt.param_groups for p in g["params"]]

    def fp32_value(self, i: int) -> torch.Tensor:
        return self.opt.fp32_value(self.pairs[i][0])


def run(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    s = tiny_lm.SIZES[args.size]
    model = tiny_lm.make_model(args.seed, args.size)
    data = tiny_lm.make_data(args.seed, s.batch_size)  # a fresh TaskData per run: the same batches in each
    make = ampkit.optim.AdamW if kind == "bf16 drop-in" else torch.optim.AdamW
    if kind != "fp32":
        model = model.to(torch.bfloat16)
    opt = make(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.01)
    decay = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: 0.1 + 0.45 * (1 + math.cos(math.pi * min(step, args.steps) / args.steps))
    )
    detector = LostUpdateDetector(Watched(opt))  # type: ignore[arg-type]  # duck-typed: param_groups, weights
    losses: list[torch.Tensor] = []
    batches = iter(())
    for _ in range(args.steps):
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(data.train_loader)
            x, y = next(batches)
        loss = tiny_lm.loss_fn(model(x), y)
        loss.backward()
        detector.snapshot()
        opt.step()
        detector.measure(applied=True)
        decay.step()
        opt.zero_grad()
        losses.append(loss.detach())
    result = detector.result()
    wanted = sum(g["wanted"] for g in result["groups"])
    lost = sum((g["lost_share"] or 0) * g["wanted"] for g in result["groups"])
    small = sum((g["below_half_ulp_share"] or 0) * g["wanted"] for g in result["groups"])
    tail = float(torch.stack(losses[-50:]).mean())  # sync: once, after training
    return {
        "lost": lost / wanted,
        "small": small / wanted,
        "train": tail,
        "eval": tiny_lm.evaluate(model, data, "cpu")["eval_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per run (default 400)")
    parser.add_argument("--size", default="small", choices=sorted(tiny_lm.SIZES), help="tiny-lm size (small)")
    parser.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    args = parser.parse_args()
    results = {kind: run(kind, args) for kind in ("fp32", "bf16 plain", "bf16 drop-in")}
    ref = results["fp32"]
    print(f"tiny-lm {args.size}, {args.steps} steps, seed {args.seed}, torch {torch.__version__}")
    print("| run | lost updates | below half an ulp | train loss (last 50) | vs fp32 | held-out loss | vs fp32 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind, r in results.items():
        print(
            f"| {kind} | {r['lost']:.1%} | {r['small']:.1%} | {r['train']:.4f} | {r['train'] - ref['train']:+.4f} "
            f"| {r['eval']:.4f} | {r['eval'] - ref['eval']:+.4f} |"
        )


if __name__ == "__main__":
    main()
