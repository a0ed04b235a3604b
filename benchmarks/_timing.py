"""What the side-by-side benchmarks share (`peers.py`, `param_scaling.py`, ...), on top of `ampkit.tools.timing`.

They compare training loops that run in one process on a machine other work shares, so one loop's
figures are never measured in a quiet moment another loop missed: rounds are interleaved
(A B C A B C ...; `ampkit.tools.timing.interleaved`), the first rounds are dropped as warm-up, and ratios are
paired round by round with an interval (`time_ratio`). Also here: the machine's one-line description and the
RESULTS.md writer.
"""

from __future__ import annotations

import platform
import re
import statistics
from pathlib import Path

import torch

from ampkit.hardware.capability import cpu_flags
from ampkit.tools.timing import interleaved, paired_speedup

__all__ = ["interleaved", "machine", "medians", "paired_ratio", "spread", "time_ratio", "write_section"]


def time_ratio(a: list[float], b: list[float]) -> tuple[float, float, float] | None:
    """Loop a's time per step over loop b's, rounds side by side, with its 95% interval: the reciprocal of
    `ampkit.tools.timing.paired_speedup(b, a)` (the geometric mean of the per-round ratios, a seeded bootstrap
    interval), the estimator `ampkit compare` uses. A slow moment of the machine slows both loops of that round
    and cancels out of the ratio, which a ratio of medians keeps. None with fewer than two rounds."""
    paired = paired_speedup(b, a)
    if paired is None:
        return None
    point, low, high = paired
    return 1 / point, 1 / high, 1 / low


def paired_ratio(a: list[float], b: list[float]) -> float:
    """`time_ratio`'s point (NaN with fewer than two rounds)."""
    ratio = time_ratio(a, b)
    return float("nan") if ratio is None else ratio[0]


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(ts) for name, ts in times.items() if ts}


def spread(ts: list[float]) -> float:
    """Interquartile range over the median: how much one round's figure moves (0.05 = ±2.5%)."""
    if len(ts) < 4:
        return float("nan")
    q1, _, q3 = statistics.quantiles(ts, n=4)
    return (q3 - q1) / statistics.median(ts)


def cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine() -> str:
    """One line: the CPU, its low-precision flags, the threads torch uses, torch and Python versions."""
    flags = cpu_flags()
    have = [f for f, on in (flags or {}).items() if on] or ["no avx512_bf16/amx"]
    return (
        f"{cpu_model()}, {torch.get_num_threads()} threads, flags: {', '.join(have)}; "
        f"torch {torch.__version__}; Python {platform.python_version()}"
    )


def write_section(path: Path, start: str, end: str, lines: list[str]) -> None:
    """Replace the text between the `start` and `end` markers of `path` (or append the block)."""
    text = path.read_text() if path.exists() else "# Benchmark results\n\n"
    block = "\n".join([start, *lines, end])
    if start in text:
        text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
