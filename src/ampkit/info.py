"""`ampkit info`: what this machine can do in low precision, what `auto` picks here, and (optionally)
a matmul micro-benchmark that checks the capability table against measured speed.

`collect_info` gathers one dict (`INFO_SCHEMA`, what `--json` prints) from `ampkit.hardware`'s facts;
`render_info` and `format_info_text` only present it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import platform
import time
from collections.abc import Sequence
from typing import Any

import torch
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text
from torch.utils import benchmark

from ampkit import hardware, present
from ampkit.hardware import CAPABILITIES, CPU_FLAGS
from ampkit.precision import PRESETS, short_dtype_name
from ampkit.version import versions

Info = dict[str, Any]

# --- The schema ---


def _object(properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A JSON object with exactly `properties`, each one required."""
    return {
        "type": "object",
        **extra,
        "additionalProperties": False,
        "required": list(properties),
        "properties": properties,
    }


_FACT = _object(
    {
        "supported": {"type": ["boolean", "null"], "description": "null: unknown (never a guess)."},
        "source": {"type": "string", "minLength": 1, "description": "Where the fact comes from."},
    }
)
_CAPABILITIES = _object(
    {c: {"$ref": "#/$defs/fact"} for c in CAPABILITIES},
    description="Per dtype: does the device have hardware that runs matmuls in it faster than fp32?",
)
_BENCH_RESULT = _object(
    {
        "dtype": {"enum": ["fp32", "bf16", "fp16"]},
        "size": {"type": ["integer", "null"], "minimum": 1, "description": "n of the n×n @ n×n matmul."},
        "iterations": {"type": "integer", "minimum": 0},
        "seconds": {"type": "number", "minimum": 0, "description": "Time the timed iterations took."},
        "flops_per_s": {"type": ["number", "null"], "exclusiveMinimum": 0, "description": "2n³ per matmul."},
        "ratio_to_fp32": {"type": ["number", "null"], "exclusiveMinimum": 0},
        "table": {"type": ["boolean", "null"], "description": "The capability table's fact for this dtype."},
        "fast_here": {
            "type": ["boolean", "null"],
            "description": "Measured: ratio_to_fp32 >= FAST_RATIO (null for fp32 or on error).",
        },
        "error": {"type": ["string", "null"], "description": "Why the dtype could not be measured."},
    }
)

INFO_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://ampkit.invalid/schemas/info-v1.json",
    "title": "ampkit info",
    "description": "`ampkit info --json`: versions, devices, what each runs fast (with sources), the "
    "preset precision='auto' picks on `device`, and an optional matmul benchmark.",
    "$defs": {"fact": _FACT, "capabilities": _CAPABILITIES},
    **_object(
        {
            "schema_version": {"const": 1},
            "ampkit_version": {"type": "string"},
            "torch": {"type": "string"},
            "cuda": {"type": ["string", "null"], "description": "CUDA torch was built with; null: none."},
            "cudnn": {"type": ["string", "null"], "description": "cuDNN version, e.g. '9.1.0'; null: none."},
            "hip": {"type": ["string", "null"], "description": "ROCm/HIP torch was built with; null: none."},
            "python": {"type": "string"},
            "platform": {"type": "string"},
            "device": {"type": "string", "description": "The device the recommendation and benchmark are for."},
            "cpu": _object(
                {
                    "name": {"type": "string"},
                    "threads": {"type": "integer", "minimum": 1, "description": "torch.get_num_threads()."},
                    "flags": _object(
                        {f: {"type": "boolean"} for f in CPU_FLAGS},
                        type=["object", "null"],
                        description="Each flag a boolean under exactly its Linux name; null: the OS did not say.",
                    ),
                    "flags_source": {"type": "string"},
                    "capabilities": {"$ref": "#/$defs/capabilities"},
                }
            ),
            "gpus": {
                "type": "array",
                "items": _object(
                    {
                        "device": {"type": "string", "pattern": r"^cuda:\d+$"},
                        "name": {"type": "string"},
                        "compute_capability": {
                            "type": "string",
                            "pattern": r"^(\d+\.\d+|gfx[0-9a-f]+)$",
                            "description": "NVIDIA's major.minor; on ROCm the gfx architecture.",
                        },
                        "memory_bytes": {"type": "integer", "minimum": 0},
                        "sm_count": {"type": "integer", "minimum": 0},
                        "capabilities": {"$ref": "#/$defs/capabilities"},
                    }
                ),
            },
            "mps": _object(
                {"capabilities": {"$ref": "#/$defs/capabilities"}},
                type=["object", "null"],
                description="Apple's GPU, or null where MPS is not available.",
            ),
            "recommended": _object(
                {"preset": {"enum": list(PRESETS)}, "reason": {"type": "string", "minLength": 1}},
                description="What precision='auto' picks on `device` (ampkit.hardware.auto_precision).",
            ),
            "bench": _object(
                {
                    "device": {"type": "string"},
                    "seconds": {"type": "number", "exclusiveMinimum": 0, "description": "Budget, all dtypes."},
                    "threads": {"type": "integer", "minimum": 1},
                    "float32_matmul_precision": {
                        "enum": ["highest", "high", "medium"],
                        "description": "Not 'highest': fp32 matmuls may use tf32/bf16.",
                    },
                    "results": {"type": "array", "items": _BENCH_RESULT},
                },
                type=["object", "null"],
                description="Matmul throughput per dtype on `device` (--bench); null when not run.",
            ),
        }
    ),
}


# --- Collecting ---


def collect_info(device: str | torch.device = "auto", bench: bool = False, bench_seconds: float = 2.0) -> Info:
    """Everything `ampkit info` shows (`INFO_SCHEMA`): every device present, and the recommendation and
    benchmark for `device` ("auto", "cpu", "cuda:1", ...; ValueError for one that is not here)."""
    dev = hardware.resolve_device(device)
    if bench and not bench_seconds > 0:
        raise ValueError(f"bench_seconds={bench_seconds!r} must be a positive number of seconds")
    flags = hardware.cpu_flags()
    gpus = []
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props, gpu = torch.cuda.get_device_properties(i), torch.device("cuda", i)
        gpus.append(
            {
                "device": str(gpu),
                "name": props.name,
                "compute_capability": hardware.rocm_arch(gpu) or f"{props.major}.{props.minor}",
                "memory_bytes": int(props.total_memory),
                "sm_count": int(props.multi_processor_count),
                "capabilities": _facts(hardware.device_capabilities(gpu)),
            }
        )
    mps = torch.backends.mps.is_available()
    preset, reason = hardware.auto_precision(dev)
    v = versions()
    return {
        "schema_version": 1,
        "ampkit_version": v["ampkit"],
        **{key: v[key] for key in ("torch", "cuda", "cudnn", "hip", "python")},
        "platform": platform.platform(),
        "device": str(dev),
        "cpu": {
            "name": hardware.cpu_name(),
            "threads": torch.get_num_threads(),
            "flags": flags,
            "flags_source": "/proc/cpuinfo" if flags is not None else "unknown: no x86 flags line in /proc/cpuinfo",
            "capabilities": _facts(hardware.cpu_capabilities(flags)),
        },
        "gpus": gpus,
        "mps": {"capabilities": _facts(hardware.device_capabilities(torch.device("mps")))} if mps else None,
        "recommended": {"preset": preset, "reason": reason},
        "bench": bench_matmul(dev, seconds=bench_seconds) if bench else None,
    }


def _facts(facts: dict[str, hardware.Fact]) -> dict[str, dict[str, Any]]:
    return {name: dataclasses.asdict(fact) for name, fact in facts.items()}


# --- The benchmark ---

BENCH_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
"""What `--bench` measures, fp32 first: the others are reported as a ratio to it."""

FAST_RATIO = 1.1
"""A dtype is "fast here" when its matmul throughput is at least this many times fp32's: a margin
above 1, so timing noise between two equally fast dtypes does not read as a speed-up."""

# Matrix sizes tried: start small (a slow dtype may take a second for n=512 on a CPU without its
# instructions) and double while the next size still fits the time box, up to a size that keeps the
# fast units busy (a GPU needs thousands; a CPU is near peak by 1024).
_START_N = {"cpu": 128, "cuda": 256, "mps": 256}
_MAX_N = {"cpu": 1024, "cuda": 8192, "mps": 4096}


def bench_matmul(
    device: str | torch.device, dtypes: Sequence[torch.dtype] = BENCH_DTYPES, seconds: float = 2.0
) -> dict[str, Any]:
    """Time n×n matmuls per dtype on `device` within `seconds` for all (the `bench` of `INFO_SCHEMA`).

    Each dtype gets an equal share: the matrix size doubles while a matmul of the next would take under
    a quarter of it, then as many as fit run (a 100x slower dtype gets a smaller matrix, the same time).
    Throughput is 2n³ per matmul over their time; a dtype that fails records its error instead.
    """
    dev = hardware.resolve_device(device)
    if not (isinstance(seconds, (int, float)) and seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"seconds={seconds!r} must be a positive number of seconds")
    if any(d not in BENCH_DTYPES for d in dtypes):
        raise ValueError(f"dtypes={list(dtypes)!r}: ampkit benchmarks only {', '.join(map(str, BENCH_DTYPES))}")
    facts = hardware.device_capabilities(dev)
    share = seconds / len(dtypes) if dtypes else 0.0
    # The Timer synchronises the current device around what it times: make that `dev` (cuda:1 is not the default).
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        results = [_bench_one(dev, dtype, share) for dtype in dtypes]
    fp32 = next((r["flops_per_s"] for r in results if r["dtype"] == "fp32"), None)
    for r in results:
        if r["dtype"] != "fp32":
            r["table"] = facts[r["dtype"]].supported
        if fp32 and r["flops_per_s"]:
            r["ratio_to_fp32"] = r["flops_per_s"] / fp32
            r["fast_here"] = None if r["dtype"] == "fp32" else r["ratio_to_fp32"] >= FAST_RATIO
    return {
        "device": str(dev),
        "seconds": float(seconds),
        "threads": torch.get_num_threads(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "results": results,
    }


def _matmul_timer(n: int, dtype: torch.dtype, device: torch.device) -> benchmark.Timer:
    # Operands made on the device: filling 8192² on the host and copying would eat the time box. The
    # Timer runs on torch's threads, not its default of 1.
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return benchmark.Timer("a @ b", globals={"a": a, "b": b}, num_threads=torch.get_num_threads())


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
        "error": None,
    }
    try:
        start = time.perf_counter()  # the budget's clock; the matmuls are timed by the Timer
        n = _START_N.get(device.type, 256)
        timer = _matmul_timer(n, dtype, device)
        # `timeit(1)` runs two warm-up matmuls first: library init and kernel choice stay out of it.
        per_call = timer.timeit(1).mean
        # Double n while the next size (8x the work) would take under a quarter of the budget per call.
        while n < _MAX_N.get(device.type, 1024) and 8 * per_call <= budget / 4:
            n *= 2
            timer = _matmul_timer(n, dtype, device)
            per_call = timer.timeit(1).mean
        left = budget - (time.perf_counter() - start)
        measured = timer.timeit(max(1, int(left / max(per_call, 1e-9))))
    except Exception as exc:  # a dtype this device cannot run is a result ("error"), not a crash
        result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return result
    elapsed = measured.raw_times[0]  # one run of `number_per_run` matmuls
    result.update(size=n, iterations=measured.number_per_run, seconds=elapsed)
    if elapsed > 0:
        result["flops_per_s"] = 2 * n**3 * measured.number_per_run / elapsed
    return result


# --- Presenting: one list of blocks, rendered by rich (to the terminal, or as plain text) ---


def _cpu_line(info: Info) -> str:
    cpu = info["cpu"]
    head = f"CPU: {cpu['name']}, {cpu['threads']} torch threads; flags"
    if cpu["flags"] is None:
        return f"{head}: unknown ({cpu['flags_source']})"
    return f"{head} ({cpu['flags_source']}): " + ", ".join(
        f"{f} {present.yes_no(on)}" for f, on in cpu["flags"].items()
    )


def _selected_capabilities(info: Info) -> dict[str, dict[str, Any]]:
    device = info["device"]
    if device.startswith("cuda"):
        return next(g["capabilities"] for g in info["gpus"] if g["device"] == device)
    if device == "mps":
        return info["mps"]["capabilities"]
    return info["cpu"]["capabilities"]


_SPEED = {True: "fast", False: "slow", None: "unknown"}


def _bench_rows(info: Info) -> list[list[str]]:
    rows = []
    for r in info["bench"]["results"]:
        if r["error"]:
            rows.append(
                [r["dtype"], "failed", "", "", present.yes_no(r["table"]) if r["dtype"] != "fp32" else "", r["error"]]
            )
            continue
        ratio = present.times(r["ratio_to_fp32"]) if r["ratio_to_fp32"] else ""
        if r["dtype"] == "fp32":
            table, measured = "", "baseline"
        else:
            table, measured = (_SPEED[r[k]] for k in ("table", "fast_here"))
            if r["table"] is not None and r["fast_here"] is not None:
                measured += " (agrees)" if r["table"] == r["fast_here"] else " (DISAGREES)"
        rows.append([r["dtype"], present.flops(r["flops_per_s"]), ratio, str(r["size"]), table, measured])
    return rows


def _table(title: str, header: list[str], rows: list[list[str]]) -> Table:
    return present.table(header, rows, title=title, numeric_from=len(header), heading=True, wrap=True)


def _renderables(info: Info) -> list[Any]:
    """The report, top to bottom: what the terminal shows and what `format_info_text` writes."""
    rocm = [f"ROCm {info['hip']}"] if info["hip"] else []
    parts = [
        f"ampkit {info['ampkit_version']}",
        f"torch {info['torch']}",
        f"CUDA {info['cuda'] or 'none'}",
        f"cuDNN {info['cudnn'] or 'none'}",
        *rocm,
    ]
    out: list[Any] = [
        Text(" · ".join(parts)),
        Text(f"Python {info['python']} · {info['platform']}"),
        Text(_cpu_line(info)),
    ]
    if info["gpus"]:
        out.append(
            _table(
                "GPUs",
                ["device", "name", "compute capability", "memory", "SMs"],
                [
                    [
                        g["device"],
                        g["name"],
                        g["compute_capability"],
                        present.size(g["memory_bytes"]),
                        str(g["sm_count"]),
                    ]
                    for g in info["gpus"]
                ],
            )
        )
    else:
        out.append(Text("GPUs: none" + ("" if info["cuda"] or info["hip"] else " (this torch has no CUDA)")))
    out.append(
        _table(
            f"What {info['device']} runs fast",
            ["dtype", "fast", "source"],
            [[c, present.yes_no(f["supported"]), f["source"]] for c, f in _selected_capabilities(info).items()],
        )
    )
    rec = info["recommended"]
    out.append(Text(f"Recommended on {info['device']}: {rec['preset']} — {rec['reason']}", style="bold"))
    if (b := info["bench"]) is not None:
        out.append(
            _table(
                f"Matmul benchmark on {b['device']}",
                ["dtype", "matmul", "× fp32", "n", "table says", "measured"],
                _bench_rows(info),
            )
        )
        # A line of its own: as a rich caption it would wrap to the table's width.
        out.append(
            Text(
                f"  n×n @ n×n, {present.seconds(b['seconds'])} in all, {b['threads']} threads, "
                f"float32_matmul_precision={b['float32_matmul_precision']}; "
                f"fast: ≥ {present.times(FAST_RATIO)} fp32",
                style="dim",
            )
        )
    return out


def format_info_text(info: Info) -> str:
    """The report as plain text (what the terminal shows, without colour): for logs and tests."""
    return present.as_text(*_renderables(info))


def render_info(info: Info, console: Console | None = None) -> None:
    """Print the report with rich on `console` (default: stdout)."""
    (console or present.console()).print(Group(*_renderables(info)))
