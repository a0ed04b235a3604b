"""The `ampkit` command: parses flags into a call of the library, nothing else."""

from __future__ import annotations

import argparse
import shlex
import sys

from ampkit.precision import PRESET_NAMES


def _usage(command: str, problem: object) -> int:
    """Say what is wrong with the command line (or what it asked for) on stderr; exit status 2."""
    print(f"ampkit {command}: {problem}", file=sys.stderr)
    return 2


def _compare(args: argparse.Namespace) -> int:
    from ampkit.compare import compare
    from ampkit.errors import PrecisionError

    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()] if args.precisions else None
    command = "ampkit " + " ".join(shlex.quote(a) for a in args.argv)
    try:
        compare(task=args.task, precisions=precisions, steps=args.steps, batch_size=args.batch_size,
                seed=args.seed, device=args.device, out=args.out, command=command, resume=args.resume,
                nproc=args.nproc, numerics=not args.no_numerics,
                size=args.size)
    except (PrecisionError, ValueError) as exc:
        return _usage("compare", exc)
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
        return _usage("info", f"--bench-seconds {args.bench_seconds:g} must be a positive number of seconds")
    if args.bench and not args.json:
        print(f"measuring matmul throughput on {args.device} (~{args.bench_seconds:g} s)...", file=sys.stderr)
    try:
        info = collect_info(device=args.device, bench=args.bench, bench_seconds=args.bench_seconds)
    except ValueError as exc:
        return _usage("info", exc)
    if args.json:
        print(json.dumps(info, indent=2, allow_nan=False))
    else:
        render_info(info)
    return 0


def _doctor(args: argparse.Namespace) -> int:
    import contextlib
    import json
    import traceback

    from ampkit.doctor import (DoctorError, diagnose_script, diagnose_task, numerics_script, numerics_task,
                               render_report, script_traceback)
    from ampkit.doctor.numerics_report import format_text as format_numerics

    if (args.script is None) == (args.task is None):
        return _usage("doctor", "give a script (ampkit doctor train.py [args...]) or --task NAME, not both"
                      if args.script else "give a script to run (ampkit doctor train.py [args...]) or --task NAME")
    if args.script is not None and (args.precision or args.device or args.batch_size):
        return _usage("doctor", "--precision, --device and --batch-size are for --task; a script chooses its own")
    if args.numerics and args.gpu is not None:
        return _usage("doctor", "--gpu is for the performance doctor; --numerics quotes no GPU costs")
    warmup = args.warmup if args.warmup is not None else (0 if args.numerics else 5)
    gpu = args.gpu or "A100"
    # With --json, stdout carries only the JSON: the script's own prints go to stderr.
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    try:
        with quiet:
            if args.numerics and args.task is not None:
                result = numerics_task(args.task, steps=args.steps, warmup=warmup, precision=args.precision or "auto",
                                       device=args.device or "auto", batch_size=args.batch_size, seed=args.seed)
            elif args.numerics:
                result = numerics_script(args.script, args.script_args, steps=args.steps, warmup=warmup)
            elif args.task is not None:
                result = diagnose_task(args.task, steps=args.steps, warmup=warmup, gpu=gpu,
                                       precision=args.precision or "auto", device=args.device or "auto",
                                       batch_size=args.batch_size, seed=args.seed)
            else:
                result = diagnose_script(args.script, args.script_args, steps=args.steps, warmup=warmup, gpu=gpu)
    except KeyboardInterrupt:
        print("\nampkit doctor: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        shown = script_traceback(exc, args.script) if args.script and not isinstance(exc, DoctorError) else None
        if shown is not None:  # the script failed, not ampkit: say so first, then its own frames
            print(f"ampkit doctor: {args.script} failed: {type(exc).__name__}: {exc}\n{shown}", end="", file=sys.stderr)
            return 1
        if isinstance(exc, (FileNotFoundError, ValueError, DoctorError)):
            return _usage("doctor", exc)
        traceback.print_exc()
        print(f"ampkit doctor: {args.script or args.task} raised {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2, allow_nan=False))
    elif args.numerics:
        print(format_numerics(result))
    else:
        render_report(result)
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
    cmp.add_argument("--size", choices=("small", "medium", "large"), default=None,
                     help="tiny-lm's model size (default: sized for the device: large on a GPU, medium on a CPU "
                          "with fast bf16, else small)")
    cmp.add_argument("--seed", type=int, default=0, help="seed for model init and data order (default: 0)")
    cmp.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N, mps")
    cmp.add_argument("--out", default="report", help="folder for report.json, plots and report.html (default: report)")
    cmp.add_argument("--nproc", type=int, default=1,
                     help="processes per precision: >1 trains data-parallel under torchrun (batch size is per process)")
    cmp.add_argument("--resume", action="store_true",
                     help="continue an interrupted comparison in --out: finished runs are kept, the unfinished one "
                          "resumes from its last checkpoint")
    cmp.add_argument("--no-numerics", action="store_true",
                     help="skip the numerics pass: by default, after each run, a few more steps of the same training "
                          "run under `ampkit doctor --numerics` (not timed) for the report's numerics section")
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
    doc = sub.add_parser(
        "doctor", help="run a training script (or a built-in task) for a few steps and say where the time goes",
        description="Run a script that trains with ampkit (or a built-in task) for a few steps under "
                    "instrumentation: per-step time by phase (data, host->device copy, forward, backward, "
                    "optimizer, other), kernel ops per step and their duration, host<->device syncs with the "
                    "file:line that caused them, an estimate of the step on known GPUs, and findings ranked "
                    "by the time they should save. Doctor options go before the script; everything after "
                    "the script is passed to it.",
    )
    doc.add_argument("script", nargs="?", default=None, help="the training script (it must use ampkit.Accelerator)")
    doc.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    doc.add_argument("--task", default=None, help="diagnose a built-in task instead: iris-mlp, digits-cnn, tiny-lm")
    doc.add_argument("--numerics", action="store_true",
                     help="diagnose numerics instead of time: per-layer value ranges against fp16/bf16 limits and a "
                          "suggested keep_fp32, the first layer to overflow (an exact replay of the first skipped "
                          "step's batch), updates lost to rounding, and the loss-scale history")
    doc.add_argument("--steps", type=int, default=20,
                     help="optimizer steps to measure after the warm-up (default: 20; a few are profiled); with "
                          "--numerics, the steps watched")
    doc.add_argument("--warmup", type=int, default=None,
                     help="steps to skip before measuring (default: 5; 0 with --numerics)")
    doc.add_argument("--gpu", default=None,
                     help="the GPU the advisor and the findings quote costs for: T4, L4, A100, RTX 4090, H100 "
                          "(default: A100)")
    doc.add_argument("--json", action="store_true",
                     help="print the result as JSON (schema: ampkit.doctor.DOCTOR_SCHEMA; with --numerics "
                          "ampkit.doctor.NUMERICS_SCHEMA); the script's output goes to stderr")
    doc.add_argument("--precision", default=None, help="--task only: precision preset (default: auto)")
    doc.add_argument("--device", default=None, help="--task only: auto (default), cpu, cuda, cuda:N, mps")
    doc.add_argument("--batch-size", type=int, default=None, help="--task only: batch size (default: the task's)")
    doc.add_argument("--seed", type=int, default=0, help="--task only: seed (default: 0)")
    doc.set_defaults(func=_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
