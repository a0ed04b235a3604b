"""The headline benchmarks in one command, and this machine's row of RESULTS.md's headline table.

    python -m benchmarks            # run them (about 6 minutes on a 2-core Xeon) and print the row
    python -m benchmarks --write    # and put the row into benchmarks/RESULTS.md (a row per hardware)
    python -m benchmarks --quick    # small sizes, a minute: checks the command, figures not for RESULTS.md

Each part runs as a subprocess of its own with a timeout, so one that fails or hangs says so in its
cell and the others still run:

1. speed-up over fp32, and step time against the hand-written loop at the same precision:
   `benchmarks/peers.py` (the MLP and the transformer, 1 thread, eager; rounds interleaved, paired ratios);
2. peak memory of a training step per preset against fp32: `benchmarks/step_memory.py`, one fresh
   process per preset (`--quick`: its 3M-parameter stack, whose bf16 steps stay seconds on a CPU without bf16);
3. `ampkit compare`'s verdict (its first line) on the default task, and how long the command took.

The row is keyed by the CPU (or GPU) and its bf16 flags, so a rerun on the same hardware replaces
its row and other hardware's rows stay; each row names the date and the commit it measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
START, END = "<!-- headline:start -->", "<!-- headline:end -->"
HEADER = [
    "| hardware | speed-up vs fp32 | step time vs the hand-written loop, same precision | peak step memory vs fp32 "
    "| `ampkit compare` verdict (its first line) |",
    "|---|---|---|---|---|",
]
PRESETS = ("bf16-mixed", "bf16-master", "bf16-true")


def run(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[str | None, str]:
    """(stdout, "") of a finished command, or (None, why it did not finish: timeout or exit status)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=HERE.parent)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"failed (exit {done.returncode}: {last[:160]})"
    return done.stdout, ""


def environment() -> dict[str, str]:
    """This checkout's ampkit first on the path, one thread for the side-by-side loops."""
    src = str(HERE.parent / "src")
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def speed(quick: bool) -> tuple[str, str]:
    """(speed-up cell, vs hand-written cell) from one peers.py run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peers.json"
        scale = ["--scale", "small", "--rounds", "3"] if quick else ["--scale", "full"]
        argv = [sys.executable, str(HERE / "peers.py"), *scale, "--models", "mlp,transformer", "--no-compile"]
        argv += ["--precisions", "fp32,bf16", "--threads", "1", "--json", str(out)]
        _, why = run(argv, 300 if quick else 1500, environment())
        if why:
            return f"peers.py {why}", ""
        models = json.loads(out.read_text())["models"]
    speedups, matching = [], []
    for model, result in models.items():
        rows = {r["variant"]: r for r in result["rows"] if r.get("status") == "ok"}
        ups = [f"{p} {1 / rows[f'ampkit {p}']['vs_fp32']:.2f}×" for p in PRESETS if f"ampkit {p}" in rows]
        same = [f"{p} {rows[f'ampkit {p}']['vs_matching']:.3f}×" for p in ("fp32", *PRESETS) if f"ampkit {p}" in rows]
        speedups.append(f"{model}: {', '.join(ups) or 'no bf16 row ran'}")
        matching.append(f"{model}: {', '.join(same)}")
    return "; ".join(speedups), "; ".join(matching)


def memory(quick: bool) -> str:
    """Peak step memory of each preset against fp32 (one fresh process each, step_memory.py's warm figure)."""
    peaks: dict[str, float] = {}
    for preset in ("fp32", *PRESETS):
        small = ["--small"] if quick else []  # 3M parameters: bf16 steps stay seconds on a CPU without bf16
        stdout, why = run([sys.executable, str(HERE / "step_memory.py"), "--child", f"{preset}:warm", *small], 600)
        if stdout is None:
            return f"step_memory.py {preset}: {why}"
        peaks[preset] = json.loads(stdout.strip().splitlines()[-1])["peak_mib"]
    fp32 = peaks.pop("fp32")
    return ", ".join(f"{p} {mib / fp32:.2f}×" for p, mib in peaks.items()) + f" ({fp32:.0f} MiB fp32)"


def verdict(quick: bool) -> str:
    """`ampkit compare`'s first line, with the task, the whole command's time and the load beside it."""
    with tempfile.TemporaryDirectory() as tmp:
        task = ["--task", "iris-mlp"] if quick else []
        argv = [sys.executable, "-m", "ampkit.cli.main", "compare", *task, "--out", tmp]
        start = time.perf_counter()
        # every core (no OMP_NUM_THREADS), and wide enough that the verdict stays on one line
        wide = {k: v for k, v in environment().items() if k != "OMP_NUM_THREADS"} | {"COLUMNS": "1000"}
        stdout, why = run(argv, 300 if quick else 1200, wide)
        took = time.perf_counter() - start
    if stdout is None:
        return f"ampkit compare {why}"
    lines = stdout.splitlines()
    echo = next((i for i, line in enumerate(lines) if line.startswith("$ ampkit compare")), None)
    first = lines[echo + 1].strip() if echo is not None and echo + 1 < len(lines) else "no verdict printed"
    minutes, seconds = divmod(round(took), 60)
    return f"`` {first} `` ({'iris-mlp' if quick else 'the default task'}, whole command {minutes} min {seconds:02d} s)"


def hardware() -> str:
    """The machine's name as `ampkit info` would put it: the CPU (or GPU) and its bf16/fp16 flags."""
    sys.path.insert(0, str(HERE))
    from _timing import machine  # benchmarks/_timing.py: CPU model, threads, flags, torch, Python

    cpu, _, flags = machine().split(";")[0].partition(", flags: ")
    return f"{cpu.rsplit(', ', 1)[0]} ({flags or 'no bf16/fp16 flags'})"


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    return done.stdout.strip() or "no git"


def write_row(label: str, row: str) -> None:
    """Replace `label`'s row in the headline table (or add it above the pending rows)."""
    text = RESULTS.read_text()
    if START not in text:
        raise SystemExit(f"{RESULTS}: no {START} ... {END} block to write the headline row into")
    head, rest = text.split(START, 1)
    table, tail = rest.split(END, 1)
    rows = [r for r in table.strip().splitlines()[len(HEADER) :] if not r.startswith(f"| {label} (")]
    pending = [r for r in rows if "pending" in r.split("|")[2]]
    rows = [r for r in rows if r not in pending] + [row] + pending
    RESULTS.write_text(head + START + "\n" + "\n".join([*HEADER, *rows]) + "\n" + END + tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: checks the command (about a minute)")
    parser.add_argument("--write", action="store_true", help=f"put this machine's row into {RESULTS.name}")
    args = parser.parse_args(argv)
    if args.write and args.quick:
        parser.error("--quick figures are not for RESULTS.md: drop --quick or --write")
    load = os.getloadavg()[0]  # the machine as the run found it: the row says it
    speedups, matching = speed(args.quick)
    label = hardware()
    measured = f"{datetime.date.today().isoformat()}, ampkit {commit()}, load {load:.2f} at the start"
    row = f"| {label} ({measured}) | {speedups} | {matching} | {memory(args.quick)} | {verdict(args.quick)} |"
    print(row)
    if args.write:
        write_row(label, row)
        print(f"wrote {label}'s row into {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
