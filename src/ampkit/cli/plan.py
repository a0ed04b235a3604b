"""`ampkit plan`: its flags, and the memory plan of a task or script they ask for."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ampkit.cli import args as flags
from ampkit.precision.names import PRESET_NAMES
from ampkit.util.validate import missing_script, parse_memory


def add_parser(sub: Any) -> None:
    """`ampkit plan` and its flags, onto the subcommands `sub`."""
    pln = flags.subcommand(
        sub,
        "plan",
        handle,
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
        help='memory to fit in, e.g. "24GiB", "80GB", "512MiB", "24G" (default: the device\'s total memory)',
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
    pln.add_argument(
        "--json", action="store_true", help="print the plan as JSON (schema: ampkit.tools.plan.PLAN_SCHEMA)"
    )
    pln.add_argument("--out", default=None, help="also write plan.json and plan.png (stacked bars) into this folder")


def handle(args: argparse.Namespace) -> int:
    """`ampkit plan [options] [train.py [args...]]`: the plan, as a table or JSON (and files with --out)."""
    if problem := flags.out_folder("--out", args.out) or (
        missing_script(args.script) if args.script is not None else flags.task("--task", args.task)
    ):
        return flags.usage("plan", problem)
    if args.script is not None and args.batch_size is not None:
        return flags.usage("plan", "--batch-size is for --task; a script's batch is its own")
    try:
        precisions = flags.names("--precisions", args.precisions, presets=True)
        memory = parse_memory(args.memory) if args.memory is not None else None
    except ValueError as exc:
        return flags.usage("plan", exc)
    flags.starting("plan", f"measuring a step of {args.script or args.task} in each precision")
    say = flags.clock("plan")
    from ampkit.errors import PrecisionError  # and torch, below: only once the command line is known to be good
    from ampkit.tools.plan import check_out, plan, plan_task, render_plan, write_plan

    sharding: dict[str, Any] = {
        "strategy": "none" if args.nproc is None else "fsdp",
        "nproc": 1 if args.nproc is None else args.nproc,
    }
    try:
        check_out(args.out)
        if args.script is not None:  # the script's first prepared model, optimizer and batch
            from ampkit.tools.plan.script import capture

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
                progress=say,
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
                progress=say,
            )
    except (PrecisionError, ValueError) as exc:
        return flags.usage("plan", exc)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2, allow_nan=False))
    else:
        render_plan(result)
    if args.out is not None and not write_plan(result, args.out):
        print("ampkit plan: no plan.png: matplotlib is not installed (pip install ampkit[plots])", file=sys.stderr)
    return 0
