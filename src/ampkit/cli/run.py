"""`ampkit run`: its flags (the launcher's settings and torchrun's rendezvous), and the launch they make."""

from __future__ import annotations

import argparse
from typing import Any

from ampkit.cli import args as flags
from ampkit.precision.names import PRESET_NAMES

# torchrun's rendezvous flags, passed on as given (checked by ampkit.cli.args.torchrun before torchrun starts).
RENDEZVOUS = (
    "--nnodes",
    "--node-rank",
    "--rdzv-backend",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--master-addr",
    "--master-port",
)


def add_parser(sub: Any) -> None:
    """`ampkit run` and its flags, onto the subcommands `sub`."""
    run = flags.subcommand(
        sub,
        "run",
        handle,
        "run a training script with the precision and processes chosen at launch",
        "Run a script that trains with ampkit.Accelerator, with every Accelerator it creates taking "
        "what it does not pass itself from the launcher (AMPKIT_PRECISION, AMPKIT_GRAD_ACCUM_STEPS, "
        "AMPKIT_COMPILE, AMPKIT_MAX_STEPS). --nproc > 1 runs it under torchrun, with the rendezvous "
        "flags passed on. Options go before the script; everything after it is the script's.",
    )
    run.add_argument("--precision", default=None, help=f"precision preset: {', '.join(PRESET_NAMES)}")
    run.add_argument("--nproc", type=int, default=None, help="processes on this node (>1: torchrun, data parallel)")
    run.add_argument(
        "--oversubscribe",
        action="store_true",
        help="allow --nproc beyond this machine's GPUs (or CPU cores without one)",
    )
    run.add_argument("--grad-accum-steps", type=int, default=None, help="micro-batches per optimizer step")
    run.add_argument("--compile", action="store_true", default=None, help="torch.compile the prepared models")
    run.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="end training after this many optimizer steps (prepared loaders' training passes end; "
        "evaluation still runs)",
    )
    for flag in RENDEZVOUS:
        run.add_argument(
            flag, default=None, type=int if flag == "--node-rank" else str, help=f"passed to torchrun as {flag}"
        )
    run.add_argument("script", nargs="?", default=None, help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def handle(args: argparse.Namespace) -> int:
    """`ampkit run [options] train.py [args...]`: the script, with AMPKIT_* set, as python or torchrun runs it."""
    if args.script is None:
        return flags.usage("run", "give a script to run: ampkit run [--precision P] [--nproc N] train.py [args...]")
    if problem := flags.precision("--precision", args.precision) or flags.torchrun(args) or flags.resolvable(args):
        return flags.usage("run", problem)  # before torchrun starts: it would fail in a traceback, or wait forever
    rendezvous = [
        f"--{name.replace('_', '-')}={value}"
        for name, value in vars(args).items()
        if flags.flag_name(name) in RENDEZVOUS and value is not None
    ]
    if problem := flags.nproc(args.nproc, oversubscribe=args.oversubscribe):
        return flags.usage("run", problem)
    from ampkit.engine.launch import launch  # torch: only once the command line is known to be good

    settings = {
        "precision": args.precision,
        "grad_accum_steps": args.grad_accum_steps,
        "compile": args.compile,
        "max_steps": args.max_steps,
    }
    try:
        return launch(args.script, args.script_args, nproc=args.nproc or 1, settings=settings, torchrun_args=rendezvous)
    except (FileNotFoundError, ValueError) as exc:
        return flags.usage("run", exc)
