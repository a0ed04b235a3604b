"""The loop harness shared by the side-by-side benchmarks (`peers.py`, `param_scaling.py`).

They compare training loops that run in one process on a machine other work shares, so one loop's
figures are never measured in a quiet moment another loop missed: rounds are interleaved
(A B C A B C ...), the first rounds are dropped as warm-up, and medians are taken. Also here: the
machine's one-line description, the process's peak-memory readings and the RESULTS.md writer.
"""

from __future__ import annotations

import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ampkit.hardware.capability import cpu_flags


def interleaved(
    steps_of: dict[str, Callable[[], None]],
    rounds: int,
    steps: int,
    warmup: int,
    sync: Callable[[], None] = lambda: None,
    on_error: Callable[[str, BaseException], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds per step of each loop in every measured round (warm-up rounds dropped).

    Each round runs `steps` calls of every loop in turn, timed between `sync()` calls (a CUDA
    device runs ahead of the host: without the sync the host would time only the kernel launches).
    With `on_error`, a loop that raises is reported there and left out of the later rounds;
    without it, the error propagates.
    """
    times: dict[str, list[float]] = {name: [] for name in steps_of}
    live = dict(steps_of)
    for r in range(rounds + warmup):
        for name, step in list(live.items()):
            sync()
            t0 = time.perf_counter()
            try:
                for _ in range(steps):
                    step()
                sync()
            except Exception as exc:  # noqa: BLE001 - one broken loop must not end the others' run
                if on_error is None:
                    raise
                on_error(name, exc)
                del live[name]
                continue
            if r >= warmup:
                times[name].append((time.perf_counter() - t0) / steps)
    return times


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(ts) for name, ts in times.items() if ts}


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of a[r] / b[r]: rounds ran side by side, so a slow moment of the machine
    slows both loops of that round and cancels out of the ratio, which a ratio of medians keeps."""
    return statistics.median(x / y for x, y in zip(a, b))


def median_ci(values: list[float], z: float = 1.96) -> tuple[float, float] | None:
    """A distribution-free ~95% confidence interval of the median: the order statistics k and n+1-k
    with k = (n - z*sqrt(n)) / 2 (the binomial sign-test interval). None for fewer than 6 values."""
    n = len(values)
    k = int((n - z * n**0.5) / 2)
    if n < 6 or k < 1:
        return None
    s = sorted(values)
    return s[k - 1], s[n - k]


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
