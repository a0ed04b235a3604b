"""`ampkit info`: what this machine can do in low precision, what `auto` picks here, and (optionally)
a matmul micro-benchmark that checks the capability table against measured speed.

`collect_info` gathers one dict (`INFO_SCHEMA`, what `--json` prints) from `ampkit.hardware.capability`'s facts;
`render_info` and `format_info_text` (`ampkit.tools.info.text`) only present it; the benchmark is
`ampkit.tools.info.bench`, the contract (typed records) `ampkit.tools.info.schema`.
"""

from __future__ import annotations

import dataclasses
import platform
from typing import Any

import torch

from ampkit.hardware import capability as hardware
from ampkit.tools.info.bench import BENCH_DTYPES, FAST_RATIO, bench_matmul
from ampkit.tools.info.schema import INFO_SCHEMA, Info, InfoReport, read_info, validate_info
from ampkit.tools.info.text import format_info_text, render_info
from ampkit.util.version import versions

__all__ = [
    "BENCH_DTYPES",
    "FAST_RATIO",
    "INFO_SCHEMA",
    "Info",
    "InfoReport",
    "bench_matmul",
    "collect_info",
    "format_info_text",
    "read_info",
    "render_info",
    "validate_info",
]


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
