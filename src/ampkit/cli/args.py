"""The `ampkit` command line's checks: every flag is checked before anything runs, and a bad one
gets one line on stderr naming it (exit status 2), never a traceback or a hang in torchrun."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ampkit.precision.names import PRESET_NAMES
from ampkit.util.validate import suggest

# The smallest value of each integer flag (by argparse dest), where a command has it.
MINIMUM = {
    "steps": 1,
    "batch_size": 1,
    "nproc": 1,
    "grad_accum_steps": 1,
    "max_steps": 1,
    "rounds": 1,
    "threads": 1,
    "warmup": 0,
    "node_rank": 0,
}
MINIMUM_OF = {("export", "steps"): 0}  # export --steps 0: export the untrained model
WHAT = {"nproc": "processes", "warmup": "steps before measuring", "node_rank": "this node's rank, 0 .. nnodes-1"}
RDZV_BACKENDS = ("c10d", "etcd", "etcd-v2", "static")


class Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line naming the (sub)command, and which knows its flags
    for a "did you mean"."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.flags: list[str] = []  # before argparse's own add_argument("-h", "--help")
        super().__init__(*args, **kwargs)

    def add_argument(self, *names: Any, **kwargs: Any) -> argparse.Action:
        self.flags.extend(n for n in names if isinstance(n, str) and n.startswith("-"))
        return super().add_argument(*names, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def unknown(self, extras: list[str]) -> None:
        """Exit on the arguments argparse did not recognise, suggesting the flag that was meant."""
        flags = [e.split("=")[0] for e in extras if e.startswith("-")]
        hint = suggest(flags[0], self.flags) if flags else ""
        self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")


def usage(command: str, problem: object) -> int:
    """Say what is wrong with the command line (or what it asked for) on stderr; exit status 2."""
    print(f"ampkit {command}: {problem}", file=sys.stderr)
    return 2


def starting(command: str, what: str) -> None:
    """The first second's answer on stderr, before torch loads: what the command is about to do."""
    print(f"ampkit {command}: {what}...", file=sys.stderr, flush=True)


def clock(command: str) -> Callable[[str], None]:
    """A phase's line on stderr with the seconds since now: "ampkit export [  12 s] timing ..."."""
    start = time.monotonic()

    def say(message: str) -> None:
        print(f"ampkit {command} [{time.monotonic() - start:4.0f} s] {message}", file=sys.stderr, flush=True)

    return say


def subcommand(
    sub: Any, name: str, func: Callable[[argparse.Namespace], int], help: str, description: str
) -> argparse.ArgumentParser:
    """The subcommand `name`, run by `func(args)`; its parser is `args.parser`, for errors found after parsing."""
    parser = sub.add_parser(name, help=help, description=description)
    parser.set_defaults(func=func, parser=parser)
    return parser


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_numbers(command: str, args: argparse.Namespace) -> str | None:
    """The first integer flag below its minimum, as a one-line problem; None if all are fine."""
    for dest, minimum in MINIMUM.items():
        value = getattr(args, dest, None)
        minimum = MINIMUM_OF.get((command, dest), minimum)
        if isinstance(value, int) and value < minimum:
            what = f" ({WHAT[dest]})" if dest in WHAT else ""
            return f"{flag_name(dest)} {value}: expected an integer >= {minimum}{what}"
    return None


def nproc(count: int | None, device: str = "auto", oversubscribe: bool = False) -> str | None:
    """The one-line problem with `--nproc` beyond this machine's devices (its GPUs, or the cores this process
    may run on with none), or None. Checked before anything starts: 100,000 workers on 2 cores once woke the
    kernel's out-of-memory killer. `--oversubscribe` starts more on purpose."""
    if count is None or count <= 1 or oversubscribe:
        return None
    import torch  # only for --nproc > 1: the GPUs are counted through torch

    gpus = torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limit, what = (gpus, f"{gpus} GPU{'s' * (gpus > 1)}") if gpus else (cores, f"{cores} CPU core{'s' * (cores > 1)}")
    if count <= limit:
        return None
    return (
        f"--nproc {count}: this machine has {what}, so at most --nproc {limit} (one process per "
        f"{'GPU' if gpus else 'core'}); add --oversubscribe to start {count} processes anyway"
    )


def names(flag: str, text: str | None, presets: bool = False) -> list[str] | None:
    """A comma-separated list of names from the command line (None when the flag was not given).
    ValueError for an empty list, a name given twice, or (`presets`) a name that is no preset."""
    if text is None:
        return None
    found = [p.strip() for p in text.split(",") if p.strip()]
    if not found:
        raise ValueError(f"{flag} {text!r}: expected a comma-separated list, e.g. {flag} fp32,bf16-mixed")
    if twice := sorted({n for n in found if found.count(n) > 1}):
        raise ValueError(f"{flag} {text!r}: {twice[0]!r} is given twice; name each once")
    if presets and (unknown := [n for n in found if n not in PRESET_NAMES]):
        raise ValueError(
            f"{flag} {text!r}: unknown precision {unknown[0]!r}; choose from: "
            f"{', '.join(PRESET_NAMES)}{suggest(unknown[0], PRESET_NAMES)}"
        )
    return found


def precision(flag: str, name: str | None) -> str | None:
    """The one-line problem with a preset name from the command line, or None."""
    if name is None or name in PRESET_NAMES:
        return None
    return f"{flag} {name!r}: unknown precision; choose one of: {', '.join(PRESET_NAMES)}{suggest(name, PRESET_NAMES)}"


#: The built-in tasks' names, known without importing torch (tests/test_cli_fast.py checks them against the tasks).
TASK_NAMES = ("digits-cnn", "iris-mlp", "tiny-lm")

#: The folder in a comparison's --out that `--resume` continues from, known without importing torch (as above).
COMPARE_STATE_DIR = ".compare"


def task(flag: str, name: str) -> str | None:
    """The one-line problem with a built-in task's name, or None: said before torch is imported."""
    if name in TASK_NAMES:
        return None
    return f"{flag} {name!r}: unknown task; choose one of: {', '.join(TASK_NAMES)}{suggest(name, TASK_NAMES)}"


def out_folder(flag: str, out: str | None) -> str | None:
    """The problem with a folder to write into (it, or a folder above it, is a file), or None."""
    if out is None:
        return None
    if not out.strip():
        return f"{flag} {out!r}: expected a folder name (it is created if missing)"
    path = Path(out)
    for at in (path, *path.parents):
        if at.exists():
            if not at.is_dir():
                where = "is a file" if at == path else f"is under {str(at)!r}, a file"
                return f"{flag} {out!r}: {where}, not a folder: name a folder (it is created if missing)"
            return None
    return None


def _port(text: str) -> int | None:
    try:
        port = int(text)
    except ValueError:
        return None
    return port if 1 <= port <= 65535 else None


#: How long `resolvable` waits for the resolver, in seconds (a dead DNS server would otherwise stall the launch).
RESOLVE_TIMEOUT = 5.0


def resolvable(args: argparse.Namespace) -> str | None:
    """`ampkit run`'s --rdzv-endpoint and --master-addr hosts, looked up before torchrun starts (where an
    unknown host makes every node wait in the rendezvous). The one-line problem, or None."""
    for flag, given in (("--rdzv-endpoint", args.rdzv_endpoint), ("--master-addr", args.master_addr)):
        if given is None:
            continue
        host, _, port = given.rpartition(":") if flag == "--rdzv-endpoint" else (given, "", "")
        host = (host or port).strip("[]")  # "HOST" alone, or "[::1]:29400"
        found: list[Any] = []
        lookup = threading.Thread(target=lambda h=host, out=found: out.append(_lookup(h)), daemon=True)
        lookup.start()
        lookup.join(RESOLVE_TIMEOUT)  # the resolver has no timeout of its own: leave it behind if it stalls
        problem = found[0] if found else f"no answer from the resolver within {RESOLVE_TIMEOUT:.0f} s"
        if problem:
            return (
                f"{flag} {given!r}: cannot resolve the host {host!r} ({problem}); give the rendezvous node's "
                f"name or IP address as every node can reach it"
            )
    return None


def _lookup(host: str) -> str:
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError) as exc:
        return str(exc)
    return ""


def torchrun(args: argparse.Namespace) -> str | None:
    """`ampkit run`'s torchrun flags, checked as torchrun would only after starting (or never: a node
    rank beyond --nnodes waits in the rendezvous forever). The one-line problem, or None."""
    low = high = 1
    if args.nnodes is not None:
        parts = args.nnodes.split(":")
        try:
            low, high = int(parts[0]), int(parts[-1])
        except ValueError:
            low = high = 0
        if len(parts) > 2 or not 1 <= low <= high:
            return (
                f"--nnodes {args.nnodes!r}: expected an integer >= 1 (nodes), or MIN:MAX with "
                f"1 <= MIN <= MAX for an elastic job"
            )
    if args.node_rank is not None and args.node_rank >= high:
        return (
            f"--node-rank {args.node_rank}: expected 0 .. {high - 1}, below --nnodes ({high}); each node "
            f"gets its own rank"
        )
    if args.master_port is not None and _port(args.master_port) is None:
        return f"--master-port {args.master_port!r}: expected a port number from 1 to 65535"
    if args.rdzv_endpoint is not None:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        if not args.rdzv_endpoint.strip() or (host and _port(port) is None):
            return f"--rdzv-endpoint {args.rdzv_endpoint!r}: expected HOST or HOST:PORT with a port from 1 to 65535"
    if args.rdzv_backend is not None and args.rdzv_backend not in RDZV_BACKENDS:
        return (
            f"--rdzv-backend {args.rdzv_backend!r}: expected one of {', '.join(RDZV_BACKENDS)}"
            f"{suggest(args.rdzv_backend, RDZV_BACKENDS)}"
        )
    if high > 1 and args.rdzv_endpoint is None and args.master_addr is None:
        return (
            f"--nnodes {args.nnodes}: nodes meet at a rendezvous: give --rdzv-endpoint HOST:PORT (or "
            f"--master-addr and --master-port), the same on every node"
        )
    return None
