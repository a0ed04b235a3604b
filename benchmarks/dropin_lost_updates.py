"""Updates lost to bf16 rounding: torch's AdamW on a bf16 model vs the drop-in `ampkit.optim.AdamW`, against fp32.

    OMP_NUM_THREADS=2 python benchmarks/dropin_lost_updates.py [--steps 400] [--size small] [--seeds 0 1 2]

tiny-lm (`ampkit.tools.tasks.tiny_lm`: a byte-level transformer on Python's stdlib source) trained three times from
the same initial weights and the same batches, with the task's AdamW settings (betas 0.9/0.95, weight decay 0.01)
and its learning rate decayed by a cosine to a tenth, as LM recipes do:

- fp32: the fp32 model, torch's AdamW (the reference);
- bf16 fp32-master: the bf16 model, torch's AdamW on fp32 masters rounded into it after each step (what the
  compensated update approximates: the same bf16 forward, the update in fp32);
- bf16 plain: `model.to(torch.bfloat16)`, torch's AdamW (bf16 weights and moments, no compensation);
- bf16 drop-in: `model.to(torch.bfloat16)`, `ampkit.optim.AdamW` (bf16-true's compensated update).

Printed per run: the lost-update share, measured by ampkit's lost-update detector (the doctor's: of the elements
with a nonzero gradient, those whose effective weight did not move at a step; the effective weight is the bf16
weight, or for the drop-in the weight plus its compensation), the share of updates below half a bf16 ulp, the
mean training loss of the last 50 steps and the held-out loss, each with its gap to the same seed's fp32 run.
Runs that are equally exact drift apart (a last-bit difference flips the sign of an Adam step near a zero
gradient), so the losses are compared over several seeds; the spread between seeds is the noise floor.
"""

from __future__ import annotations

import argparse
import math
import statistics
from types import SimpleNamespace
from typing import Any

import torch

import ampkit.optim
from ampkit.tools.doctor.numerics.lost_updates import LostUpdateDetector
from ampkit.tools.tasks import tiny_lm


class Watched:
    """What the lost-update detector reads of an optimizer: `param_groups`, and `weights` where the effective
    weight is not the parameter itself (`pairs`: (model parameter, optimizer parameter); `value(i)`: the i-th
    effective weight: the bf16 weight plus its compensation, or the fp32 master)."""

    def __init__(self, opt: torch.optim.Optimizer, kind: str | None, pairs: list, value: Any) -> None:
        self.param_groups = opt.param_groups
        self.weights = None if kind is None else SimpleNamespace(kind=kind, pairs=pairs, fp32_value=value)


KINDS = ("fp32", "bf16 fp32-master", "bf16 plain", "bf16 drop-in")


def run(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    s = tiny_lm.SIZES[args.size]
    model = tiny_lm.make_model(args.seed, args.size)
    data = tiny_lm.make_data(args.seed, s.batch_size)  # a fresh TaskData per run: the same batches in each
    if kind != "fp32":
        model = model.to(torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float().requires_grad_() for p in params] if kind == "bf16 fp32-master" else None
    make = ampkit.optim.AdamW if kind == "bf16 drop-in" else torch.optim.AdamW
    opt = make(masters or params, lr=s.lr, betas=(0.9, 0.95), weight_decay=0.01)
    decay = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: 0.1 + 0.45 * (1 + math.cos(math.pi * min(step, args.steps) / args.steps))
    )
    if masters is not None:
        watched = Watched(opt, "master", list(zip(params, masters)), lambda i: masters[i].detach())
    elif isinstance(opt, ampkit.optim.CompensatedStep):
        watched = Watched(opt, "compensated", [(p, p) for p in params], lambda i: opt.fp32_value(params[i]))
    else:
        watched = Watched(opt, None, [], None)
    detector = LostUpdateDetector(watched)  # type: ignore[arg-type]  # duck-typed: param_groups, weights
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
        if masters is not None:  # the update in fp32 on the masters, rounded into the bf16 model
            for p, m in zip(params, masters):
                m.grad = None if p.grad is None else p.grad.float()
            opt.step()
            with torch.no_grad():
                torch._foreach_copy_(params, masters)
        else:
            opt.step()
        detector.measure(applied=True)
        decay.step()
        opt.zero_grad()
        model.zero_grad()  # the master run steps other tensors than the model's
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
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="model and data seeds (0 1 2)")
    args = parser.parse_args()
    rows = {kind: [] for kind in KINDS}  # kind -> one result per seed
    for seed in args.seeds:
        for kind in KINDS:
            rows[kind].append(run(kind, argparse.Namespace(**{**vars(args), "seed": seed})))
    ref = rows["fp32"]
    print(f"tiny-lm {args.size}, {args.steps} steps, seeds {args.seeds}, torch {torch.__version__}")
    print("means over the seeds; in brackets the smallest and largest gap to the same seed's fp32 run")
    print("| run | lost updates | below half an ulp | train loss (last 50) vs fp32 | held-out loss vs fp32 |")
    print("|---|---:|---:|---:|---:|")
    for kind, results in rows.items():
        cells = [f"{statistics.mean(r[key] for r in results):.1%}" for key in ("lost", "small")]
        for key in ("train", "eval"):
            gaps = [r[key] - f[key] for r, f in zip(results, ref)]
            mean = statistics.mean(r[key] for r in results)
            cells.append(f"{mean:.4f} {statistics.mean(gaps):+.4f} [{min(gaps):+.4f}, {max(gaps):+.4f}]")
        print(f"| {kind} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
