"""`ampkit info`: its flags, and the report on this machine's low-precision speed they ask for."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ampkit.cli import args as flags


def add_parser(sub: Any) -> None:
    """`ampkit info` and its flags, onto the subcommands `sub`."""
    info = flags.subcommand(
        sub,
        "info",
        handle,
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
    info.add_argument(
        "--json", action="store_true", help="print the report as JSON (schema: ampkit.tools.info.collect.INFO_SCHEMA)"
    )
    info.add_argument(
        "--bench",
        action="store_true",
        help="also time matmuls in fp32, bf16 and fp16 on the device, to confirm the table by speed",
    )
    info.add_argument(
        "--bench-seconds", type=float, default=2.0, help="time budget of --bench for all dtypes together (default: 2)"
    )


def handle(args: argparse.Namespace) -> int:
    """`ampkit info [options]`: the report, as a table or JSON."""
    if args.bench and not args.bench_seconds > 0:
        return flags.usage("info", f"--bench-seconds {args.bench_seconds:g} must be a positive number of seconds")
    if args.bench and not args.json:
        print(f"measuring matmul throughput on {args.device} (~{args.bench_seconds:g} s)...", file=sys.stderr)
    from ampkit.tools.info.collect import (  # torch: only once the command line is known to be good
        collect_info,
        render_info,
    )

    try:
        info = collect_info(device=args.device, bench=args.bench, bench_seconds=args.bench_seconds)
    except ValueError as exc:
        return flags.usage("info", exc)
    if args.json:
        print(json.dumps(info, indent=2, allow_nan=False))
    else:
        render_info(info)
    return 0
