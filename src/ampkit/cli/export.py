"""`ampkit export`: its flags, and the call of `ampkit.tools.export.measure` they make."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ampkit.cli import args as flags


def add_parser(sub: Any) -> None:
    """`ampkit export` and its flags, onto the subcommands `sub`."""
    exp = flags.subcommand(
        sub,
        "export",
        handle,
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
    exp.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show other libraries' warnings and log lines (torchao, onnx, onnxruntime); by default one line "
        "counts them",
    )


def handle(args: argparse.Namespace) -> int:
    """`ampkit export [options]`: the task trained in fp32, exported in each precision and measured."""
    if problem := flags.out_folder("--out", args.out) or flags.task("--task", args.task):
        return flags.usage("export", problem)
    try:
        precisions = flags.names("--precisions", args.precisions)
        backends = flags.names("--backends", args.backends) or ["torch", "onnx"]
    except ValueError as exc:
        return flags.usage("export", exc)
    flags.starting(
        "export",
        f"training {args.task} in fp32, then exporting "
        f"{', '.join(precisions) if precisions else 'each precision'} with {', '.join(backends)} and timing each",
    )
    from ampkit.tools.export import (  # torch: only once the command line is known to be good
        PRECISIONS,
        format_text,
        measure,
    )
    from ampkit.util.held_back import held_back

    try:
        with held_back(show=args.verbose) as held:
            report = measure(
                args.task,
                precisions or list(PRECISIONS),
                backends,
                args.out,
                steps=args.steps,
                seed=args.seed,
                rounds=args.rounds,
                threads=args.threads,
                progress=flags.clock("export"),
            )
    except ValueError as exc:
        return flags.usage("export", exc)
    if summary := held.summary():
        print(f"ampkit export: {summary}", file=sys.stderr)
    print(format_text(report), end="")
    print(f"inference report: {args.out}/inference.json (and inference.txt; the exported files in {args.out}/exports/)")
    return 0
