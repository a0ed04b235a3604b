"""The `ampkit` command: parses flags into a call of the library, nothing else."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ampkit import cli_args as flags
from ampkit.cli_args import Parser
from ampkit.precision import PRESET_NAMES


def _usage(command: str, problem: object) -> int:
    """Say what is wrong with the command line (or what it asked for) on stderr; exit status 2."""
    print(f"ampkit {command}: {problem}", file=sys.stderr)
    return 2


def _compare(args: argparse.Namespace) -> int:
    from ampkit.compare import compare
    from ampkit.errors import PrecisionError

    if args.script is not None:  # ampkit compare train.py [args...]
        return _compare_script(args)

    from ampkit.compare.runner import STATE_DIR

    state = Path(args.out) / STATE_DIR
    if args.resume and not (state.is_dir() and any(state.iterdir())):
        return _usage(
            "compare",
            f"--resume: nothing to resume in {args.out}/ (no {STATE_DIR}/ of an interrupted "
            f"comparison): drop --resume to start a new one, or give its --out",
        )
    command = "ampkit " + shlex.join(args.argv)
    try:
        compare(
            task=args.task,
            precisions=flags.names("--precisions", args.precisions),
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
        )
    except (PrecisionError, ValueError) as exc:
        return _usage("compare", exc)
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: the runs that finished are in {args.out}/; continue with the same command and --resume",
            file=sys.stderr,
        )
        return 130
    print(f"\nreport: {args.out}/report.html (and report.json, PNG plots{', inference.json' * args.inference})")
    return 0


def _export(args: argparse.Namespace) -> int:
    from ampkit.export import PRECISIONS, format_text, measure

    if problem := flags.out_folder("--out", args.out):
        return _usage("export", problem)
    try:
        precisions = flags.names("--precisions", args.precisions) or list(PRECISIONS)
        backends = flags.names("--backends", args.backends) or ["torch", "onnx"]
        report = measure(
            args.task,
            precisions,
            backends,
            args.out,
            steps=args.steps,
            seed=args.seed,
            rounds=args.rounds,
            threads=args.threads,
        )
    except ValueError as exc:
        return _usage("export", exc)
    print(format_text(report), end="")
    print(f"inference report: {args.out}/inference.json (and inference.txt; the exported files in {args.out}/exports/)")
    return 0


def _compare_script(args: argparse.Namespace) -> int:
    """`ampkit compare train.py ...`: compare's own options may follow the script; `--` ends them."""
    from ampkit.compare.script import compare_script
    from ampkit.errors import PrecisionError

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
        return _usage("compare", f"--steps {args.steps}: expected an integer >= 1 (optimizer steps per run)")
    for flag, value, default in (
        ("--device", args.device, "auto"),
        ("--nproc", args.nproc, 1),
        ("--resume", args.resume, False),
        ("--batch-size", args.batch_size, None),
        ("--task", args.task, "tiny-lm"),
        ("--size", args.size, None),
        ("--inference", args.inference, False),
        ("--no-numerics", args.no_numerics, False),
    ):
        if value != default:
            return _usage(
                "compare",
                f"{flag} is for the built-in tasks; a script chooses its own device, batch size "
                f"and processes, and its comparison has no numerics pass or export",
            )
    command = "ampkit " + shlex.join(args.argv)
    try:
        report = compare_script(
            args.script,
            script_args,
            flags.names("--precisions", args.precisions),
            steps=args.steps,
            seed=args.seed,
            out=args.out,
            command=command,
        )
    except (FileNotFoundError, PrecisionError, ValueError) as exc:
        return _usage("compare", exc)
    except KeyboardInterrupt:
        print("\nampkit compare: interrupted", file=sys.stderr)
        return 130
    print(f"\nreport: {args.out}/report.html (and report.json, PNG plots; the script's output: {args.out}/logs/)")
    return 0 if any(run["status"] == "ok" for run in report["runs"]) else 1


def _run(args: argparse.Namespace) -> int:
    """`ampkit run [options] train.py [args...]`: the script, with AMPKIT_* set, as python or torchrun runs it."""
    from ampkit.launch import launch

    if args.script is None:
        return _usage("run", "give a script to run: ampkit run [--precision P] [--nproc N] train.py [args...]")
    if problem := flags.precision("--precision", args.precision) or flags.torchrun(args):
        return _usage("run", problem)  # before torchrun starts: it would fail in a traceback, or wait forever
    rendezvous = [
        f"--{name.replace('_', '-')}={value}"
        for name, value in vars(args).items()
        if name in ("nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "master_addr", "master_port")
        and value is not None
    ]
    settings = {
        "precision": args.precision,
        "grad_accum_steps": args.grad_accum_steps,
        "compile": args.compile,
        "max_steps": args.max_steps,
    }
    try:
        return launch(args.script, args.script_args, nproc=args.nproc or 1, settings=settings, torchrun_args=rendezvous)
    except (FileNotFoundError, ValueError) as exc:
        return _usage("run", exc)


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

    from ampkit.doctor import (
        DoctorError,
        diagnose_script,
        diagnose_task,
        numerics_script,
        numerics_task,
        render_report,
        script_traceback,
    )
    from ampkit.doctor.numerics_report import format_text as format_numerics

    if (args.script is None) == (args.task is None):
        return _usage(
            "doctor",
            "give a script (ampkit doctor train.py [args...]) or --task NAME, not both"
            if args.script
            else "give a script to run (ampkit doctor train.py [args...]) or --task NAME",
        )
    if args.script is not None and (args.precision or args.device or args.batch_size):
        return _usage("doctor", "--precision, --device and --batch-size are for --task; a script chooses its own")
    if problem := flags.precision("--precision", args.precision):
        return _usage("doctor", problem)
    if args.numerics and args.gpu is not None:
        return _usage("doctor", "--gpu is for the performance doctor; --numerics quotes no GPU costs")
    warmup = args.warmup if args.warmup is not None else (0 if args.numerics else 5)
    options = {"steps": args.steps, "warmup": warmup} | ({} if args.numerics else {"gpu": args.gpu or "A100"})
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


def _plan(args: argparse.Namespace) -> int:
    import json

    from ampkit.errors import PrecisionError
    from ampkit.plan import check_out, parse_memory, plan, plan_task, render_plan, write_plan

    if problem := flags.out_folder("--out", args.out):
        return _usage("plan", problem)
    sharding = {"strategy": "none" if args.nproc is None else "fsdp", "nproc": 1 if args.nproc is None else args.nproc}
    try:
        memory = parse_memory(args.memory) if args.memory is not None else None
        precisions = flags.names("--precisions", args.precisions, presets=True)
        check_out(args.out)
        if args.script is not None:  # the script's first prepared model, optimizer and batch
            from ampkit.plan.script import capture

            if args.batch_size is not None:
                return _usage("plan", "--batch-size is for --task; a script's batch is its own")
            model_fn, batch, optimizer_fn, loss_fn, note = capture(args.script, args.script_args)
            print(f"ampkit plan: {args.script}: {note}", file=sys.stderr)
            result = plan(
                model_fn,
                lambda: batch,
                optimizer_fn,
                precisions=precisions,
                device=args.device,
                memory=memory,
                loss_fn=loss_fn,
                search=not args.no_search,
                **sharding,
            )
        else:
            result = plan_task(
                args.task,
                precisions,
                seed=args.seed,
                batch_size=args.batch_size,
                device=args.device,
                memory=memory,
                search=not args.no_search,
                **sharding,
            )
    except (PrecisionError, ValueError) as exc:
        return _usage("plan", exc)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2, allow_nan=False))
    else:
        render_plan(result)
    if args.out is not None and not write_plan(result, args.out):
        print("ampkit plan: no plan.png: matplotlib is not installed (pip install ampkit[plots])", file=sys.stderr)
    return 0


def _command(
    sub: Any, name: str, func: Callable[[argparse.Namespace], int], help: str, description: str
) -> argparse.ArgumentParser:
    """The subcommand `name`, run by `func(args)`."""
    parser = sub.add_parser(name, help=help, description=description)
    parser.set_defaults(func=func, parser=parser)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="ampkit", description="Mixed-precision training for PyTorch: measured and explained.")
    sub = parser.add_subparsers(dest="command", required=True)
    cmp = _command(
        sub,
        "compare",
        _compare,
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
        "script",
        nargs="?",
        default=None,
        help="instead of --task: your training script (converted with ampkit.Accelerator, no precision= "
        "passed), run once per precision; --precisions/--steps/--seed/--out may follow it, and "
        "everything after `--` is the script's",
    )
    cmp.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    run = _command(
        sub,
        "run",
        _run,
        "run a training script with the precision and processes chosen at launch",
        "Run a script that trains with ampkit.Accelerator, with every Accelerator it creates taking "
        "what it does not pass itself from the launcher (AMPKIT_PRECISION, AMPKIT_GRAD_ACCUM_STEPS, "
        "AMPKIT_COMPILE, AMPKIT_MAX_STEPS). --nproc > 1 runs it under torchrun, with the rendezvous "
        "flags passed on. Options go before the script; everything after it is the script's.",
    )
    run.add_argument("--precision", default=None, help=f"precision preset: {', '.join(PRESET_NAMES)}")
    run.add_argument("--nproc", type=int, default=None, help="processes on this node (>1: torchrun, data parallel)")
    run.add_argument("--grad-accum-steps", type=int, default=None, help="micro-batches per optimizer step")
    run.add_argument("--compile", action="store_true", default=None, help="torch.compile the prepared models")
    run.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="end training after this many optimizer steps (prepared loaders' training passes end; "
        "evaluation still runs)",
    )
    for flag in (
        "--nnodes",
        "--node-rank",
        "--rdzv-backend",
        "--rdzv-endpoint",
        "--rdzv-id",
        "--master-addr",
        "--master-port",
    ):  # checked (ampkit.cli_args.torchrun) before torchrun starts
        run.add_argument(
            flag, default=None, type=int if flag == "--node-rank" else str, help=f"passed to torchrun as {flag}"
        )
    run.add_argument("script", nargs="?", default=None, help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    exp = _command(
        sub,
        "export",
        _export,
        "train a task in fp32, export it in reduced precision, measure what each precision buys",
        "Train a built-in task briefly in fp32, export it in each precision (fp32, bf16, fp16, int8) with "
        "each backend (torch: torch.export .pt2; onnx: onnxruntime), and report latency at batch 1 and "
        "at a throughput batch (median of interleaved rounds), file size, peak memory and the held-out "
        "metric against fp32, with a verdict per export and the auto choice for this device.",
    )
    exp.add_argument("--task", default="digits-cnn", help="built-in task: digits-cnn (default), tiny-lm, iris-mlp")
    exp.add_argument("--precisions", default=None, help="comma-separated, from fp32,bf16,fp16,int8 (default: all)")
    exp.add_argument("--backends", default=None, help="comma-separated, from torch,onnx (default: both)")
    exp.add_argument(
        "--out", default="inference", help="folder for inference.json/.txt and exports/ (default: inference)"
    )
    exp.add_argument("--steps", type=int, default=None, help="fp32 training steps (default: the task's)")
    exp.add_argument("--seed", type=int, default=0, help="seed for model init and data order (default: 0)")
    exp.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (default: 7)")
    exp.add_argument("--threads", type=int, default=None, help="intra-op threads of both runtimes (default: torch's)")
    info = _command(
        sub,
        "info",
        _info,
        "what this machine runs fast in low precision, and what precision='auto' picks here",
        "Show torch/CUDA/cuDNN versions, every device (name, compute capability, memory, SMs), "
        "which low-precision dtypes each runs fast (with the source of each fact; 'unknown' where "
        "ampkit does not know), the CPU's flags, and the preset precision='auto' picks with its reason.",
    )
    info.add_argument(
        "--device",
        default="auto",
        help="device the recommendation and benchmark are for: auto (default), cpu, cuda, cuda:N, mps",
    )
    info.add_argument("--json", action="store_true", help="print the report as JSON (schema: ampkit.info.INFO_SCHEMA)")
    info.add_argument(
        "--bench",
        action="store_true",
        help="also time matmuls in fp32, bf16 and fp16 on the device, to confirm the table by speed",
    )
    info.add_argument(
        "--bench-seconds", type=float, default=2.0, help="time budget of --bench for all dtypes together (default: 2)"
    )
    doc = _command(
        sub,
        "doctor",
        _doctor,
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
        help="print the result as JSON (schema: ampkit.doctor.DOCTOR_SCHEMA; with --numerics "
        "ampkit.doctor.NUMERICS_SCHEMA); the script's output goes to stderr",
    )
    doc.add_argument("--precision", default=None, help="--task only: precision preset (default: auto)")
    doc.add_argument("--device", default=None, help="--task only: auto (default), cpu, cuda, cuda:N, mps")
    doc.add_argument("--batch-size", type=int, default=None, help="--task only: batch size (default: the task's)")
    doc.add_argument("--seed", type=int, default=0, help="--task only: seed (default: 0)")
    pln = _command(
        sub,
        "plan",
        _plan,
        "predict each precision's peak training memory and the largest batch that fits, without running it",
        "Run two training steps of a task through each precision preset on fake tensors (no memory is "
        "allocated), and show the peak with its parts: parameters, gradients, optimizer state, ampkit's "
        "master weights and buffers, activations, autocast's weight casts, temporaries; whether it fits "
        "in --memory and the largest batch size that does; and the fastest preset that fits.",
    )
    pln.add_argument(
        "script",
        nargs="?",
        default=None,
        help="a training script (its first prepared model, optimizer and batch; it runs to its first acc.backward)",
    )
    pln.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    pln.add_argument("--task", default="tiny-lm", help="built-in task: tiny-lm (default), digits-cnn, iris-mlp")
    pln.add_argument(
        "--memory",
        default=None,
        help='memory to fit in, e.g. "24GiB", "80GB", "512MiB" (default: the device\'s total memory)',
    )
    pln.add_argument(
        "--precisions",
        default=None,
        help=f"comma-separated presets (choices: {', '.join(p for p in PRESET_NAMES if p != 'auto')}); "
        "default: every preset the device runs",
    )
    pln.add_argument("--batch-size", type=int, default=None, help="batch size (default: the task's)")
    pln.add_argument("--device", default="auto", help="the device planned for: auto (default), cpu, cuda, cuda:N")
    pln.add_argument("--seed", type=int, default=0, help="seed for the model and batch (default: 0)")
    pln.add_argument("--no-search", action="store_true", help="skip the search for the largest batch that fits")
    pln.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="plan one rank's share with the model sharded by FSDP2 across this many processes",
    )
    pln.add_argument("--json", action="store_true", help="print the plan as JSON (schema: ampkit.plan.PLAN_SCHEMA)")
    pln.add_argument("--out", default=None, help="also write plan.json and plan.png (stacked bars) into this folder")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, extras = build_parser().parse_known_args(argv)
    if extras:  # a typo'd flag: the subcommand's own error, with the flag it probably meant
        args.parser.unknown(extras)
    if problem := flags.check_numbers(args.command, args):
        return _usage(args.command, problem)
    args.argv = argv
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
