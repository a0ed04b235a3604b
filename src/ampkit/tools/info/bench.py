"""`ampkit info --bench`: a matmul micro-benchmark per dtype that checks the capability table against
measured speed on this device (the `bench` of `INFO_SCHEMA`), and whether the measurement can tell.

The machine is looked at before and after the timing (`ampkit.tools.timing`, the check every timing shares); a
ratio measured on a busy machine, or too close to the line to tell, neither confirms nor contradicts the
table (`agreement`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, Literal

import torch

from ampkit.hardware import capability as hardware
from ampkit.precision.policy import short_dtype_name
from ampkit.tools.timing import check_load, matmul_rate, own_load, worst

BENCH_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
"""What `--bench` measures, fp32 first: the others are reported as a ratio to it."""

FAST_RATIO = 1.1
"""A dtype is "fast here" when its matmul throughput is at least this many times fp32's: a margin
above 1, so timing noise between two equally fast dtypes does not read as a speed-up."""

NOISE = 1.1
"""How far one timing's ratio to fp32 may stray on a quiet machine: a ratio within this factor of
`FAST_RATIO` either way (1.0× up to 1.21×) is too close to the line to say "fast" or "not fast"."""

#: What a measured ratio says of the table's fact (`agreement`; the `agreement` of each bench result).
Agreement = Literal["agrees", "disagrees", "busy", "noise"]


def bench_matmul(
    device: str | torch.device, dtypes: Sequence[torch.dtype] = BENCH_DTYPES, seconds: float = 2.0
) -> dict[str, Any]:
    """Time n×n matmuls per dtype on `device` within `seconds` for all (the `bench` of `INFO_SCHEMA`).

    Each dtype gets an equal share of `ampkit.tools.timing.matmul_rate`, the probe every timing of ampkit uses:
    the matrix size doubles while a matmul of the next would take under a quarter of it, then as many as fit
    run (a 100x slower dtype gets a smaller matrix, the same time). Throughput is 2n³ over the fastest call's
    time; a dtype that fails records its error instead.
    """
    dev = hardware.resolve_device(device)
    if not (isinstance(seconds, (int, float)) and seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"seconds={seconds!r} must be a positive number of seconds")
    if any(d not in BENCH_DTYPES for d in dtypes):
        raise ValueError(f"dtypes={list(dtypes)!r}: ampkit benchmarks only {', '.join(map(str, BENCH_DTYPES))}")
    share = seconds / len(dtypes) if dtypes else 0.0
    start = time.perf_counter()
    before = check_load(dev)  # the machine as the bench found it and as it left it: the busier look is kept
    results = [_bench_one(dev, dtype, share) for dtype in dtypes]
    load = worst(before, check_load(dev, own=own_load(torch.get_num_threads(), time.perf_counter() - start)))
    _compare_with_table(results, hardware.device_capabilities(dev), busy=load.busy)
    return {
        "device": str(dev),
        "seconds": float(seconds),
        "threads": torch.get_num_threads(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "load": load.as_dict(),
        "results": results,
    }


def _compare_with_table(results: list[dict[str, Any]], facts: dict[str, hardware.Fact], *, busy: bool) -> None:
    """Fill each result's ratio to fp32 and what it says of the table, once fp32 (the baseline) is known."""
    fp32 = next((r["flops_per_s"] for r in results if r["dtype"] == "fp32"), None)
    for r in results:
        if r["dtype"] != "fp32":
            r["table"] = facts[r["dtype"]].supported
        if fp32 and r["flops_per_s"]:
            r["ratio_to_fp32"] = r["flops_per_s"] / fp32
            r["fast_here"] = None if r["dtype"] == "fp32" else r["ratio_to_fp32"] >= FAST_RATIO
        if r["dtype"] != "fp32":
            r["agreement"] = agreement(r["table"], r["ratio_to_fp32"], busy=busy)


def agreement(table: bool | None, ratio: float | None, *, busy: bool) -> Agreement | None:
    """What a dtype's measured matmul ratio to fp32 says of the table's fact (True: fast, False: not), by one rule.

    - None: nothing to compare (the table does not know, or the dtype was not measured).
    - "busy": the machine was busy (`ampkit.tools.timing`). The dtypes are timed one after another, so a stall in
      one of them moves the ratio by as much as the machine slows ops: not read either way (compare's rule for
      unpaired timings on a busy machine).
    - "noise": the ratio is within `NOISE` of `FAST_RATIO` (1.0× up to 1.21×): a few percent of timing noise
      would move it across the line, so it neither confirms nor contradicts.
    - "agrees" / "disagrees": measured fast (ratio ≥ `FAST_RATIO`) is, or is not, what the table says.
    """
    if table is None or ratio is None:
        return None
    if busy:
        return "busy"
    if FAST_RATIO / NOISE <= ratio < FAST_RATIO * NOISE:
        return "noise"
    return "agrees" if (ratio >= FAST_RATIO) == table else "disagrees"


def _bench_one(device: torch.device, dtype: torch.dtype, budget: float) -> dict[str, Any]:
    result: dict[str, Any] = {
        "dtype": short_dtype_name(dtype),
        "size": None,
        "iterations": 0,
        "seconds": 0.0,
        "flops_per_s": None,
        "ratio_to_fp32": None,
        "table": None,
        "fast_here": None,
        "agreement": None,
        "error": None,
    }
    try:
        rate = matmul_rate(device, dtype, budget)  # sized to the budget: `ampkit.tools.timing.MATMUL_N`
    except Exception as exc:  # a dtype this device cannot run is a result ("error"), not a crash
        result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return result
    result.update(size=rate.size, iterations=rate.calls, seconds=rate.seconds, flops_per_s=rate.per_s)
    return result
