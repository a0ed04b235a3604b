"""`ampkit info`: what this machine can do in low precision, what `auto` picks here, and (optionally)
a matmul micro-benchmark that checks the capability table against measured speed.

`collect_info` gathers one dict (the contract: `INFO_SCHEMA`, also what `--json` prints);
`render_info` and `format_info_text` only present it. The facts themselves come from
`ampkit.hardware` (called through the module, so a test that patches `ampkit.hardware.cpu_flags`
patches the report too); nothing here decides what a device supports.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import time
from collections.abc import Sequence
from typing import Any

import torch

from ampkit import __version__, hardware
from ampkit.hardware import CAPABILITIES, CPU_FLAGS
from ampkit.precision import PRESETS

Info = dict[str, Any]

# --------------------------------------------------------------------------------------------------
# The schema
# --------------------------------------------------------------------------------------------------

_FACT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["supported", "source"],
    "properties": {
        "supported": {"type": ["boolean", "null"], "description": "null: unknown (never a guess)."},
        "source": {"type": "string", "minLength": 1, "description": "Where the fact comes from."},
    },
}

_CAPABILITIES = {
    "type": "object",
    "description": "Per dtype: does the device have hardware that runs matmuls in it faster than fp32?",
    "additionalProperties": False,
    "required": list(CAPABILITIES),
    "properties": {c: {"$ref": "#/$defs/fact"} for c in CAPABILITIES},
}

_BENCH_RESULT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["dtype", "size", "iterations", "seconds", "flops_per_s", "ratio_to_fp32", "table", "fast_here",
                 "error"],
    "properties": {
        "dtype": {"enum": ["fp32", "bf16", "fp16"]},
        "size": {"type": ["integer", "null"], "minimum": 1, "description": "n of the n×n @ n×n matmul."},
        "iterations": {"type": "integer", "minimum": 0},
        "seconds": {"type": "number", "minimum": 0, "description": "Time the timed iterations took."},
        "flops_per_s": {"type": ["number", "null"], "exclusiveMinimum": 0, "description": "2n³ per matmul."},
        "ratio_to_fp32": {"type": ["number", "null"], "exclusiveMinimum": 0},
        "table": {"type": ["boolean", "null"], "description": "The capability table's fact for this dtype."},
        "fast_here": {"type": ["boolean", "null"],
                      "description": "Measured: ratio_to_fp32 >= FAST_RATIO (null for fp32 or on error)."},
        "error": {"type": ["string", "null"], "description": "Why the dtype could not be measured."},
    },
}

INFO_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://ampkit.invalid/schemas/info-v1.json",
    "title": "ampkit info",
    "description": "`ampkit info --json`: versions, devices, what each runs fast (with sources), the "
    "preset precision='auto' picks on `device`, and an optional matmul benchmark.",
    "type": "object",
    "additionalProperties": False,
    "$defs": {"fact": _FACT, "capabilities": _CAPABILITIES},
    "properties": {
        "schema_version": {"const": 1},
        "ampkit_version": {"type": "string"},
        "torch": {"type": "string"},
        "cuda": {"type": ["string", "null"], "description": "CUDA torch was built with; null: none."},
        "cudnn": {"type": ["string", "null"], "description": "cuDNN version, e.g. '9.1.0'; null: none."},
        "hip": {"type": ["string", "null"], "description": "ROCm/HIP torch was built with; null: none."},
        "python": {"type": "string"},
        "platform": {"type": "string"},
        "device": {"type": "string", "description": "The device the recommendation and benchmark are for."},
        "cpu": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "threads", "flags", "flags_source", "capabilities"],
            "properties": {
                "name": {"type": "string"},
                "threads": {"type": "integer", "minimum": 1, "description": "torch.get_num_threads()."},
                "flags": {
                    "type": ["object", "null"],
                    "description": "Each flag a boolean under exactly its Linux name; null: the OS did not say.",
                    "additionalProperties": False,
                    "required": list(CPU_FLAGS),
                    "properties": {f: {"type": "boolean"} for f in CPU_FLAGS},
                },
                "flags_source": {"type": "string"},
                "capabilities": {"$ref": "#/$defs/capabilities"},
            },
        },
        "gpus": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["device", "name", "compute_capability", "memory_bytes", "sm_count", "capabilities"],
                "properties": {
                    "device": {"type": "string", "pattern": r"^cuda:\d+$"},
                    "name": {"type": "string"},
                    "compute_capability": {"type": "string", "pattern": r"^\d+\.\d+$"},
                    "memory_bytes": {"type": "integer", "minimum": 0},
                    "sm_count": {"type": "integer", "minimum": 0},
                    "capabilities": {"$ref": "#/$defs/capabilities"},
                },
            },
        },
        "mps": {
            "type": ["object", "null"],
            "description": "Apple's GPU, or null where MPS is not available.",
            "additionalProperties": False,
            "required": ["capabilities"],
            "properties": {"capabilities": {"$ref": "#/$defs/capabilities"}},
        },
        "recommended": {
            "type": "object",
            "description": "What precision='auto' picks on `device` (ampkit.hardware.auto_precision).",
            "additionalProperties": False,
            "required": ["preset", "reason"],
            "properties": {"preset": {"enum": list(PRESETS)}, "reason": {"type": "string", "minLength": 1}},
        },
        "bench": {
            "type": ["object", "null"],
            "description": "Matmul throughput per dtype on `device` (--bench); null when not run.",
            "additionalProperties": False,
            "required": ["device", "seconds", "threads", "float32_matmul_precision", "results"],
            "properties": {
                "device": {"type": "string"},
                "seconds": {"type": "number", "exclusiveMinimum": 0, "description": "Budget, all dtypes."},
                "threads": {"type": "integer", "minimum": 1},
                "float32_matmul_precision": {"enum": ["highest", "high", "medium"],
                                             "description": "Not 'highest': fp32 matmuls may use tf32/bf16."},
                "results": {"type": "array", "items": _BENCH_RESULT},
            },
        },
    },
}
INFO_SCHEMA["required"] = list(INFO_SCHEMA["properties"])


# --------------------------------------------------------------------------------------------------
# Collecting
# --------------------------------------------------------------------------------------------------


def collect_info(device: str | torch.device = "auto", bench: bool = False, bench_seconds: float = 2.0) -> Info:
    """Everything `ampkit info` shows, as a dict matching `INFO_SCHEMA`.

    `device` ("auto", "cpu", "cuda:1", ...) is the one the recommendation and the benchmark are for;
    every device present is described. Raises ValueError for a device that is not here.
    """
    dev = hardware.resolve_device(device)
    if bench and not bench_seconds > 0:
        raise ValueError(f"bench_seconds={bench_seconds!r} must be a positive number of seconds")
    flags = hardware.cpu_flags()
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append({
                "device": f"cuda:{i}",
                "name": props.name,
                "compute_capability": f"{props.major}.{props.minor}",
                "memory_bytes": int(props.total_memory),
                "sm_count": int(props.multi_processor_count),
                "capabilities": _facts(hardware.device_capabilities(torch.device("cuda", i))),
            })
    mps = torch.backends.mps.is_available()
    preset, reason = hardware.auto_precision(dev)
    return {
        "schema_version": 1,
        "ampkit_version": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": _cudnn_version(),
        "hip": torch.version.hip,
        "python": platform.python_version(),
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


def _facts(facts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: dataclasses.asdict(fact) for name, fact in facts.items()}


def _cudnn_version() -> str | None:
    if not torch.backends.cudnn.is_available():
        return None
    v = torch.backends.cudnn.version()
    if v is None:
        return None
    # cuDNN 9 encodes MAJOR*10000 + MINOR*100 + PATCH; cuDNN 8 and older MAJOR*1000 + MINOR*100 + PATCH.
    major, rest = divmod(v, 10000) if v >= 90000 else divmod(v, 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


# --------------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------------

BENCH_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
"""What `--bench` measures, fp32 first: the others are reported as a ratio to it."""

FAST_RATIO = 1.1
"""A dtype is "fast here" when its matmul throughput is at least this many times fp32's: a margin
above 1, so timing noise between two equally fast dtypes does not read as a speed-up."""

_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Matrix sizes tried: start small (a slow dtype may take a second for n=512 on a CPU without its
# instructions) and double while the next size still fits the time box, up to a size that keeps the
# fast units busy (a GPU needs thousands; a CPU is near peak by 1024).
_START_N = {"cpu": 128, "cuda": 256, "mps": 256}
_MAX_N = {"cpu": 1024, "cuda": 8192, "mps": 4096}


def bench_matmul(device: str | torch.device, dtypes: Sequence[torch.dtype] = BENCH_DTYPES,
                 seconds: float = 2.0) -> dict[str, Any]:
    """Time n×n matmuls per dtype on `device`; `seconds` is the budget for all dtypes together.

    Each dtype gets an equal share: a short search for the matrix size (doubling while one matmul of
    the next size would take under a quarter of the share), then as many matmuls as fit in what is
    left, so a dtype that is 100x slower here gets a smaller matrix but the same time.
    Throughput is 2n³ flops per matmul over the wall time. A dtype that fails records its error
    instead of a number. Returns the `bench` object of `INFO_SCHEMA`.
    """
    dev = hardware.resolve_device(device)
    if not (isinstance(seconds, (int, float)) and seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"seconds={seconds!r} must be a positive number of seconds")
    unknown = [d for d in dtypes if d not in _SHORT]
    if unknown:
        raise ValueError(f"dtypes={list(dtypes)!r}: ampkit benchmarks only {', '.join(map(str, _SHORT))}")
    facts = hardware.device_capabilities(dev)
    share = seconds / len(dtypes) if dtypes else 0.0
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


def _bench_one(device: torch.device, dtype: torch.dtype, budget: float) -> dict[str, Any]:
    result: dict[str, Any] = {"dtype": _SHORT[dtype], "size": None, "iterations": 0, "seconds": 0.0,
                              "flops_per_s": None, "ratio_to_fp32": None, "table": None, "fast_here": None,
                              "error": None}
    try:
        n = _START_N.get(device.type, 256)
        a, b = _operands(n, dtype, device)
        a @ b
        _sync(device)  # warm-up: library init and kernel choice stay out of the time box
        deadline = time.perf_counter() + budget
        per_call = min(_time_one(a, b, device), _time_one(a, b, device))
        # Double n while the next size (8x the work) would take under a quarter of the budget per call.
        # The min of two timings: the first call of a new size may pay for setup, and on a busy CPU a
        # call can wait a whole scheduler tick for a descheduled thread.
        while n < _MAX_N.get(device.type, 1024) and 8 * per_call <= budget / 4:
            n *= 2
            a, b = _operands(n, dtype, device)
            per_call = min(_time_one(a, b, device), _time_one(a, b, device))
        # Queue about a tenth of the budget between syncs, so a GPU never idles waiting for the host.
        chunk = max(1, int(budget / 10 / max(per_call, 1e-9)))
        iterations, start = 0, time.perf_counter()
        while True:
            for _ in range(chunk):
                a @ b
            _sync(device)  # sync point: the clock may only be read once the queued matmuls finished
            iterations += chunk
            now = time.perf_counter()
            if now >= deadline:
                break
        elapsed = now - start
    except Exception as exc:  # a dtype this device cannot run is a result ("error"), not a crash
        result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return result
    result.update(size=n, iterations=iterations, seconds=elapsed)
    if elapsed > 0:
        result["flops_per_s"] = 2 * n**3 * iterations / elapsed
    return result


def _operands(n: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Made on the device: filling 8192² on the host and copying would eat the time box.
    return torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)


def _time_one(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
    start = time.perf_counter()
    a @ b
    _sync(device)  # sync point: time the matmul, not its launch
    return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


# --------------------------------------------------------------------------------------------------
# Presenting
# --------------------------------------------------------------------------------------------------


def _flops(x: float) -> str:
    """TFLOP/s, or GFLOP/s below one TFLOP/s, to three significant figures."""
    return f"{x / 1e12:.3g} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.3g} GFLOP/s"


def _times(x: float) -> str:
    """A ratio to two significant figures: "1.0×", "0.082×", "14×"."""
    text = f"{x:.2g}" if x < 100 else f"{x:.0f}"
    if x < 10 and "." not in text and "e" not in text:
        text += ".0"
    return text + "×"


def _yes_no(value: bool | None) -> str:
    return {True: "yes", False: "no", None: "unknown"}[value]


def _bytes(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _versions(info: Info) -> str:
    parts = [f"ampkit {info['ampkit_version']}", f"torch {info['torch']}", f"CUDA {info['cuda'] or 'none'}",
             f"cuDNN {info['cudnn'] or 'none'}"]
    if info["hip"]:
        parts.append(f"ROCm {info['hip']}")
    return " · ".join(parts)


def _cpu_line(info: Info) -> str:
    cpu = info["cpu"]
    head = f"CPU: {cpu['name']}, {cpu['threads']} torch threads; flags"
    if cpu["flags"] is None:
        return f"{head}: unknown ({cpu['flags_source']})"
    return f"{head} ({cpu['flags_source']}): " + ", ".join(f"{f} {_yes_no(on)}" for f, on in cpu["flags"].items())


def _selected_capabilities(info: Info) -> dict[str, dict[str, Any]]:
    device = info["device"]
    if device.startswith("cuda"):
        return next(g["capabilities"] for g in info["gpus"] if g["device"] == device)
    if device == "mps":
        return info["mps"]["capabilities"]
    return info["cpu"]["capabilities"]


def _gpu_table(info: Info) -> tuple[list[str], list[list[str]]]:
    header = ["device", "name", "compute capability", "memory", "SMs"]
    return header, [[g["device"], g["name"], g["compute_capability"], _bytes(g["memory_bytes"]), str(g["sm_count"])]
                    for g in info["gpus"]]


def _capability_table(info: Info) -> tuple[list[str], list[list[str]]]:
    facts = _selected_capabilities(info)
    return ["dtype", "fast", "source"], [[c, _yes_no(f["supported"]), f["source"]] for c, f in facts.items()]


def _bench_table(info: Info) -> tuple[list[str], list[list[str]]]:
    header = ["dtype", "matmul", "× fp32", "n", "table says", "measured"]
    rows = []
    for r in info["bench"]["results"]:
        if r["error"]:
            rows.append([r["dtype"], "failed", "", "", _yes_no(r["table"]) if r["dtype"] != "fp32" else "", r["error"]])
            continue
        ratio = _times(r["ratio_to_fp32"]) if r["ratio_to_fp32"] else ""
        if r["dtype"] == "fp32":
            table, measured = "", "baseline"
        else:
            table = "fast" if r["table"] else ("slow" if r["table"] is False else "unknown")
            measured = "fast" if r["fast_here"] else ("slow" if r["fast_here"] is False else "unknown")
            if r["table"] is not None and r["fast_here"] is not None:
                measured += " (agrees)" if r["table"] == r["fast_here"] else " (DISAGREES)"
        rows.append([r["dtype"], _flops(r["flops_per_s"]), ratio, str(r["size"]), table, measured])
    return header, rows


def _bench_caption(info: Info) -> str:
    b = info["bench"]
    return (f"n×n @ n×n, {b['seconds']:g} s in all, {b['threads']} threads, "
            f"float32_matmul_precision={b['float32_matmul_precision']}; fast: ≥ {FAST_RATIO:g}× fp32")


def _recommended(info: Info) -> str:
    rec = info["recommended"]
    return f"Recommended on {info['device']}: {rec['preset']} — {rec['reason']}"


def _blocks(info: Info) -> list[tuple[str, Any]]:
    """The report as ("line", text), ("recommended", text) and ("table", (title, header, rows,
    caption)) blocks, so the rich and the plain renderer show the same things in the same order."""
    blocks: list[tuple[str, Any]] = [("line", _versions(info)),
                                     ("line", f"Python {info['python']} · {info['platform']}"),
                                     ("line", _cpu_line(info))]
    if info["gpus"]:
        blocks.append(("table", ("GPUs", *_gpu_table(info), None)))
    else:
        blocks.append(("line", "GPUs: none" + ("" if info["cuda"] or info["hip"] else " (this torch has no CUDA)")))
    blocks.append(("table", (f"What {info['device']} runs fast", *_capability_table(info), None)))
    blocks.append(("recommended", _recommended(info)))
    if info["bench"] is not None:
        blocks.append(("table", (f"Matmul benchmark on {info['bench']['device']}", *_bench_table(info),
                                 _bench_caption(info))))
    return blocks


def format_info_text(info: Info) -> str:
    """The report as plain text: for logs, and the terminal without rich."""
    out: list[str] = []
    for kind, block in _blocks(info):
        if kind != "table":
            out.append(block)
            continue
        title, header, rows, caption = block
        widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
        out += ["", title]
        for cells in (header, ["-" * w for w in widths], *rows):
            out.append("  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
        out += [f"  ({caption})"] if caption else []
        out.append("")
    return "\n".join(out).replace("\n\n\n", "\n\n").strip("\n") + "\n"


def render_info(info: Info, console: Any = None) -> None:
    """Print the report: rich tables where rich is installed, else `format_info_text(info)`.

    Strings from the info dict go in as `Text`, never markup, so a device name with "[...]" prints
    as written.
    """
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        print(format_info_text(info), end="")
        return
    if console is None:
        console = Console()
        if not console.is_terminal:  # a log file has no width: keep lines whole, not squeezed to 80
            console = Console(width=max(console.width, 160))
    for kind, block in _blocks(info):
        if kind == "line":
            console.print(Text(block))
        elif kind == "recommended":
            console.print(Text(block, style="bold"))
        else:
            title, header, rows, caption = block
            table = Table(title=Text(title, style="bold"), title_justify="left", box=box.SIMPLE_HEAD,
                          collapse_padding=True)
            for name in header:
                table.add_column(Text(name))
            for row in rows:
                table.add_row(*(Text(cell) for cell in row))
            console.print(table)
            if caption:  # a line of its own: as a rich caption it would wrap to the table's width
                console.print(Text(f"  {caption}", style="dim"))
