"""`ampkit compare`: its flags, and the call of `ampkit.compare` (or of a script, once per precision) they make."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from ampkit.cli import args as flags
from ampkit.cli.args import Parser
from ampkit.precision.names import PRESET_NAMES
from ampkit.util.validate import missing_script


def add_parser(sub: Any) -> None:
    """`ampkit compare` and its flags, onto the subcommands `sub`."""
    cmp = flags.subcommand(
        sub,
        "compare",
        handle,
        "train a task once per precision and compare time, memory, loss and accuracy",
        "Train the same task once per precision preset, each in its own process with the same seed "
        "and data order, and report time per step, peak memory, the loss curve and the eval metric "
        "against fp32.",
    )
    cmp.add_argument("--task", default="tiny-lm", help="built-in task: tiny-lm (default), digits-cnn, iris-mlp")
    cmp.add_argument(
        "--precisions",
        default=None,
        help=f"comma-separated presets, the first is the baseline (choices: {', '.join(PRESET_NAMES)}); "
        "default: fp32, the auto choice and every preset fast on this hardware",
    )
    cmp.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the task's)")
    cmp.add_argument("--batch-size", type=int, default=None, help="batch size (default: the task's)")
    cmp.add_argument(
        "--size",
        choices=("small", "medium", "large"),
        default=None,
        help="tiny-lm's model size (default: sized for the device: large on a GPU, medium on a CPU "
        "with fast bf16, else small)",
    )
    cmp.add_argument("--seed", type=int, default=0, help="seed for model init and data order (default: 0)")
    cmp.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N, mps")
    cmp.add_argument("--out", default="report", help="folder for report.json, plots and report.html (default: report)")
    cmp.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="processes per precision: >1 trains data-parallel under torchrun (batch size is per process)",
    )
    cmp.add_argument(
        "--oversubscribe",
        action="store_true",
        help="allow --nproc beyond this machine's GPUs (or CPU cores without one)",
    )
    cmp.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted comparison in --out: finished runs are kept, the unfinished one "
        "resumes from its last checkpoint",
    )
    cmp.add_argument(
        "--no-numerics",
        action="store_true",
        help="skip the numerics pass: by default, after each run, a few more steps of the same training "
        "run under `ampkit doctor --numerics` (not timed) for the report's numerics section",
    )
    cmp.add_argument(
        "--inference",
        action="store_true",
        help="afterwards, export the task's fp32-trained model in fp32/bf16/fp16/int8 (torch.export and "
        "onnxruntime) and measure latency, size, memory and accuracy (see `ampkit export`)",
    )
    cmp.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="with --inference: show other libraries' warnings and log lines (torchao, onnx, onnxruntime); "
        "by default one line counts them",
    )
    cmp.add_argument(
        "script",
        nargs="?",
        default=None,
        help="instead of --task: your training script (converted with ampkit.Accelerator, no precision= "
        "passed), run once per precision; --precisions/--steps/--seed/--out may follow it, and "
        "everything after `--` is the script's",
    )
    cmp.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def handle(args: argparse.Namespace) -> int:
    """`ampkit compare [options]`: the built-in task trained once per precision, and the report."""
    if args.script is not None:  # ampkit compare train.py [args...]
        return _compare_script(args)
    if problem := flags.task("--task", args.task):
        return flags.usage("compare", problem)
    try:
        precisions = flags.names("--precisions", args.precisions, presets=True)
    except ValueError as exc:
        return flags.usage("compare", exc)
    if problem := flags.nproc(args.nproc, args.device, args.oversubscribe):
        return flags.usage("compare", problem)
    state = Path(args.out) / flags.COMPARE_STATE_DIR
    if args.resume and not (state.is_dir() and any(state.iterdir())):
        return flags.usage(
            "compare",
            f"--resume: nothing to resume in {args.out}/ (no {flags.COMPARE_STATE_DIR}/ of an interrupted "
            f"comparison): drop --resume to start a new one, or give its --out",
        )
    from ampkit.errors import PrecisionError
    from ampkit.tools.compare import compare  # torch: only once the command line is known to be good

    command = "ampkit " + shlex.join(args.argv)
    try:
        compare(
            task=args.task,
            precisions=precisions,
            steps=args.steps,
            seed=args.seed,
            batch_size=args.batch_size,
            device=args.device,
            out=args.out,
            command=command,
            resume=args.resume,
            nproc=args.nproc,
            numerics=not args.no_numerics,
            size=args.size,
            inference=args.inference,
            verbose=args.verbose,
        )
    except (PrecisionError, ValueError) as exc:
        return flags.usage("compare", exc)
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: the runs that finished are in {args.out}/; continue with the same command and --resume",
            file=sys.stderr,
        )
        return 130
    print(f"\nreport: {args.out}/report.html (and report.json, PNG plots{', inference.json' * args.inference})")
    return 0


def _compare_script(args: argparse.Namespace) -> int:
    """`ampkit compare train.py ...`: compare's own options may follow the script; `--` ends them."""
    given = args.script_args
    split = given.index("--") if "--" in given else len(given)
    tail = Parser(prog="ampkit compare", add_help=False, allow_abbrev=False)
    for flag in ("--precisions", "--out"):
        tail.add_argument(flag)
    for flag in ("--steps", "--seed"):
        tail.add_argument(flag, type=int)
    tail.add_argument("--no-numerics", action="store_true")
    try:
        _, script_args = tail.parse_known_args(given[:split], namespace=args)
    except SystemExit:
        return 2
    script_args += given[split + 1 :]
    if args.steps is not None and args.steps < 1:
        return flags.usage("compare", f"--steps {args.steps}: expected an integer >= 1 (optimizer steps per run)")
    for flag, value, default in (
        ("--device", args.device, "auto"),
        ("--nproc", args.nproc, 1),
        ("--resume", args.resume, False),
        ("--batch-size", args.batch_size, None),
        ("--task", args.task, "tiny-lm"),
        ("--size", args.size, None),
        ("--inference", args.inference, False),
        ("--verbose", args.verbose, False),
        ("--no-numerics", args.no_numerics, False),
    ):
        if value != default:
            return flags.usage(
                "compare",
                f"{flag} is for the built-in tasks; a script chooses its own device, batch size "
                f"and processes, and its comparison has no numerics pass or export",
            )
    try:
        precisions = flags.names("--precisions", args.precisions, presets=True)
    except ValueError as exc:
        return flags.usage("compare", exc)
    if problem := missing_script(args.script):
        return flags.usage("compare", problem)
    flags.starting("compare", f"running {args.script} once per precision; its output goes to {args.out}/logs/")
    from ampkit.errors import PrecisionError
    from ampkit.tools.compare.script import compare_script  # torch: only once the command line is known to be good

    command = "ampkit " + shlex.join(args.argv)
    try:
        report = compare_script(
            args.script,
            script_args,
            precisions,
            steps=args.steps,
            seed=args.seed,
            out=args.out,
            command=command,
        )
    except (FileNotFoundError, PrecisionError, ValueError) as exc:
        return flags.usage("compare", exc)
    except KeyboardInterrupt:
        print("\nampkit compare: interrupted", file=sys.stderr)
        return 130
    print(f"\nreport: {args.out}/report.html (and report.json, PNG plots; the script's output: {args.out}/logs/)")
    return 0 if any(run["status"] == "ok" for run in report["runs"]) else 1
