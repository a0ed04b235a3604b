"""`ampkit doctor`: its flags, and the diagnosis they ask for (of time, or with --numerics of numerics)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

from ampkit.cli import args as flags
from ampkit.util.validate import missing_script


def add_parser(sub: Any) -> None:
    """`ampkit doctor` and its flags, onto the subcommands `sub`."""
    doc = flags.subcommand(
        sub,
        "doctor",
        handle,
        "run a training script (or a built-in task) for a few steps and say where the time goes",
        "Run a script that trains with ampkit (or a built-in task) for a few steps under "
        "instrumentation: per-step time by phase (data, host->device copy, forward, backward, "
        "optimizer, other), kernel ops per step and their duration, host<->device syncs with the "
        "file:line that caused them, an estimate of the step on known GPUs, and findings ranked "
        "by the time they should save. Doctor options go before the script; everything after "
        "the script is passed to it.",
    )
    doc.add_argument("script", nargs="?", default=None, help="the training script (it must use ampkit.Accelerator)")
    doc.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    doc.add_argument("--task", default=None, help="diagnose a built-in task instead: iris-mlp, digits-cnn, tiny-lm")
    doc.add_argument(
        "--numerics",
        action="store_true",
        help="diagnose numerics instead of time: per-layer value ranges against fp16/bf16 limits and a "
        "suggested keep_fp32, the first layer to overflow (an exact replay of the first skipped "
        "step's batch), updates lost to rounding, and the loss-scale history",
    )
    doc.add_argument(
        "--steps",
        type=int,
        default=20,
        help="optimizer steps to measure after the warm-up (default: 20; a few are profiled); with "
        "--numerics, the steps watched",
    )
    doc.add_argument(
        "--warmup", type=int, default=None, help="steps to skip before measuring (default: 5; 0 with --numerics)"
    )
    doc.add_argument(
        "--gpu",
        default=None,
        help="the GPU the advisor and the findings quote costs for: T4, L4, A100, RTX 4090, H100 (default: A100)",
    )
    doc.add_argument(
        "--json",
        action="store_true",
        help="print the result as JSON (schema: ampkit.tools.doctor.DOCTOR_SCHEMA; with --numerics "
        "ampkit.tools.doctor.NUMERICS_SCHEMA); the script's output goes to stderr",
    )
    doc.add_argument("--precision", default=None, help="--task only: precision preset (default: auto)")
    doc.add_argument("--device", default=None, help="--task only: auto (default), cpu, cuda, cuda:N, mps")
    doc.add_argument("--batch-size", type=int, default=None, help="--task only: batch size (default: the task's)")
    doc.add_argument("--seed", type=int, default=0, help="--task only: seed (default: 0)")


def handle(args: argparse.Namespace) -> int:
    """`ampkit doctor [options] (train.py [args...] | --task NAME)`: the diagnosis, as a report or JSON."""
    if (args.script is None) == (args.task is None):
        return flags.usage(
            "doctor",
            "give a script (ampkit doctor train.py [args...]) or --task NAME, not both"
            if args.script
            else "give a script to run (ampkit doctor train.py [args...]) or --task NAME",
        )
    if args.script is not None and (args.precision or args.device or args.batch_size):
        return flags.usage("doctor", "--precision, --device and --batch-size are for --task; a script chooses its own")
    if problem := (
        flags.precision("--precision", args.precision)
        or (missing_script(args.script) if args.script is not None else flags.task("--task", args.task))
    ):
        return flags.usage("doctor", problem)
    if args.numerics and args.gpu is not None:
        return flags.usage("doctor", "--gpu is for the performance doctor; --numerics quotes no GPU costs")
    kind = "numerics" if args.numerics else "speed"
    flags.starting("doctor", f"running {args.script or args.task} to measure its {kind}, step by step")
    from ampkit.tools.doctor import (  # torch: only once the command line is known to be good
        DoctorError,
        diagnose_script,
        diagnose_task,
        numerics_script,
        numerics_task,
        render_report,
        script_traceback,
    )
    from ampkit.tools.doctor.numerics.report import format_text as format_numerics

    warmup = args.warmup if args.warmup is not None else (0 if args.numerics else 5)
    options = {"steps": args.steps, "warmup": warmup} | ({} if args.numerics else {"gpu": args.gpu or "A100"})
    diagnose: Callable[..., dict[str, Any]]
    target: tuple[Any, ...]
    if args.task is not None:
        diagnose, target = (numerics_task if args.numerics else diagnose_task), (args.task,)
        options |= {
            "precision": args.precision or "auto",
            "device": args.device or "auto",
            "batch_size": args.batch_size,
            "seed": args.seed,
        }
    else:
        diagnose = numerics_script if args.numerics else diagnose_script
        target = (args.script, args.script_args)
    # With --json, stdout carries only the JSON: the script's own prints go to stderr.
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    try:
        with quiet:
            result = diagnose(*target, **options)
    except KeyboardInterrupt:
        print("\nampkit doctor: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        shown = script_traceback(exc, args.script) if args.script and not isinstance(exc, DoctorError) else None
        if shown is not None:  # the script failed, not ampkit: say so first, then its own frames
            print(f"ampkit doctor: {args.script} failed: {type(exc).__name__}: {exc}\n{shown}", end="", file=sys.stderr)
            return 1
        if isinstance(exc, (FileNotFoundError, ValueError, DoctorError)):
            return flags.usage("doctor", exc)
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
