"""The `ampkit` command: parses flags into a call of the library, nothing else."""

from __future__ import annotations

import argparse
import shlex
import sys

from ampkit.precision import PRESET_NAMES


def _compare(args: argparse.Namespace) -> int:
    from ampkit.compare import compare
    from ampkit.errors import PrecisionError

    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()] if args.precisions else None
    command = "ampkit " + " ".join(shlex.quote(a) for a in args.argv)
    try:
        compare(task=args.task, precisions=precisions, steps=args.steps, batch_size=args.batch_size,
                seed=args.seed, device=args.device, out=args.out, command=command, resume=args.resume,
                nproc=args.nproc)
    except (PrecisionError, ValueError) as exc:
        print(f"ampkit compare: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted: the runs that finished are in {args.out}/; continue with the same command and --resume",
              file=sys.stderr)
        return 130
    print(f"\nreport: {args.out}/report.html (and report.json, PNG plots)")
    return 0


def _info(args: argparse.Namespace) -> int:
    import json

    from ampkit.info import collect_info, render_info

    if args.bench and not args.bench_seconds > 0:
        print(f"ampkit info: --bench-seconds {args.bench_seconds:g} must be a positive number of seconds",
              file=sys.stderr)
        return 2
    if args.bench and not args.json:
        print(f"measuring matmul throughput on {args.device} (~{args.bench_seconds:g} s)...", file=sys.stderr)
    try:
        info = collect_info(device=args.device, bench=args.bench, bench_seconds=args.bench_seconds)
    except ValueError as exc:
        print(f"ampkit info: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=2, allow_nan=False))
    else:
        render_info(info)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampkit", description="Mixed-precision training for PyTorch: measured and explained.")
    sub = parser.add_subparsers(dest="command", required=True)
    cmp = sub.add_parser(
        "compare", help="train a task once per precision and compare time, memory, loss and accuracy",
        description="Train the same task once per precision preset, each in its own process with the same seed "
                    "and data order, and report time per step, peak memory, the loss curve and the eval metric "
                    "against fp32.",
    )
    cmp.add_argument("--task", default="tiny-lm", help="built-in task: tiny-lm (default), digits-cnn, iris-mlp")
    cmp.add_argument("--precisions", default=None,
                     help=f"comma-separated presets, the first is the baseline (choices: {', '.join(PRESET_NAMES)}); "
                          "default: fp32, the auto choice and every preset fast on this hardware")
    cmp.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the task's)")
    cmp.add_argument("--batch-size", type=int, default=None, help="batch size (default: the task's)")
    cmp.add_argument("--seed", type=int, default=0, help="seed for model init and data order (default: 0)")
    cmp.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N, mps")
    cmp.add_argument("--out", default="report", help="folder for report.json, plots and report.html (default: report)")
    cmp.add_argument("--nproc", type=int, default=1,
                     help="processes per precision: >1 trains data-parallel under torchrun (batch size is per process)")
    cmp.add_argument("--resume", action="store_true",
                     help="continue an interrupted comparison in --out: finished runs are kept, the unfinished one "
                          "resumes from its last checkpoint")
    cmp.set_defaults(func=_compare)
    info = sub.add_parser(
        "info", help="what this machine runs fast in low precision, and what precision='auto' picks here",
        description="Show torch/CUDA/cuDNN versions, every device (name, compute capability, memory, SMs), "
                    "which low-precision dtypes each runs fast (with the source of each fact; 'unknown' where "
                    "ampkit does not know), the CPU's flags, and the preset precision='auto' picks with its reason.",
    )
    info.add_argument("--device", default="auto",
                      help="device the recommendation and benchmark are for: auto (default), cpu, cuda, cuda:N, mps")
    info.add_argument("--json", action="store_true", help="print the report as JSON (schema: ampkit.info.INFO_SCHEMA)")
    info.add_argument("--bench", action="store_true",
                      help="also time matmuls in fp32, bf16 and fp16 on the device, to confirm the table by speed")
    info.add_argument("--bench-seconds", type=float, default=2.0,
                      help="time budget of --bench for all dtypes together (default: 2)")
    info.set_defaults(func=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
