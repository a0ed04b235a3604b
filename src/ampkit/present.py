"""Numbers, tables and pages for people: one way to format every figure ampkit prints (compare, info, doctor)."""

from __future__ import annotations

import os


def seconds(x: float) -> str:
    """A duration to three significant figures: "4.2 µs", "0.84 ms", "1.2 s"."""
    if x >= 1:
        return f"{x:.3g} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3g} ms"
    return f"{x * 1e6:.3g} µs"


def flop(x: float) -> str:
    """An amount of floating-point operations: "116 kFLOP", "7.65 GFLOP"."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}FLOP"
    return f"{x:.3g} FLOP"


def flops(x: float) -> str:
    """A rate of floating-point operations: "12.3 GFLOP/s"."""
    return flop(x) + "/s"


def count(x: float) -> str:
    """A per-step count: whole numbers plainly, fractions to two significant figures."""
    return f"{x:.0f}" if x >= 10 or x == int(x) else f"{x:.2g}"


def where(file: str, line: int) -> str:
    """file:line, relative to the working directory when the file is under it."""
    try:
        rel = os.path.relpath(file)
    except ValueError:  # another drive (Windows)
        rel = file
    return f"{file if rel.startswith('..') else rel}:{line}"


def times(x: float) -> str:
    """A ratio: "0.82×", "4.8×", "215×"."""
    return f"{x:.0f}×" if x >= 100 else f"{x:.2g}×"


def article(name: str) -> str:
    """"a" or "an" before a device name as it is read aloud: "an A100", "an RTX 4090", "a T4"."""
    return "an" if name[:1].upper() in "AEFHILMNORSX8" else "a"


def percent(x: float) -> str:
    """A share: "38%", and two significant figures below 1% ("0.013%") so that small is not "0%"."""
    return f"{x:.0%}" if x >= 0.01 or x == 0 else f"{x * 100:.2g}%"


# --- what `ampkit info` shows: sizes and tri-state facts ---


def size(n: float) -> str:
    """Bytes in binary units, as memory is allocated: "1.3 GiB", "780 MiB", "512 B"."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(n)} B"
    return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:.1f} {unit}"


def yes_no(value: bool | None) -> str:
    """A fact that may be unknown: "yes", "no", or "unknown" for None (never a guess)."""
    return {True: "yes", False: "no", None: "unknown"}[value]
