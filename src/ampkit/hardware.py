"""What this machine's devices can do, and the `auto` precision choice with its reason.

The choice is made from the hardware alone (compute capability on CUDA, CPU flags read from the
OS): it must be explainable in one sentence and the same on every run. Whether a *model* gains from
it is a different question, which `ampkit compare` and the doctor answer by measuring.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: CPU flags that decide low-precision speed on x86, exactly as Linux names them in /proc/cpuinfo.
CPU_FLAGS: tuple[str, ...] = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")


def parse_cpu_flags(cpuinfo_text: str) -> dict[str, bool]:
    """Return {flag: present} for `CPU_FLAGS` from the text of /proc/cpuinfo.

    Only the first "flags" line is read: every core of one machine reports the same set.
    """
    for line in cpuinfo_text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            present = set(value.split())
            return {flag: flag in present for flag in CPU_FLAGS}
    return {flag: False for flag in CPU_FLAGS}


@functools.cache
def cpu_flags() -> dict[str, bool] | None:
    """This CPU's low-precision flags, or None where the OS does not say (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return parse_cpu_flags(text)


def resolve_device(device: str | torch.device) -> torch.device:
    """Turn "auto", "cpu", "cuda:1", ... into a usable `torch.device`, or raise ValueError.

    "auto" prefers CUDA, then Apple's MPS, then the CPU: the fastest device that is present.
    """
    if isinstance(device, str) and device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device={device!r} is not a device name; expected 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"
        ) from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available here; use device='auto' or 'cpu'")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"device={device!r} but this machine has {torch.cuda.device_count()} CUDA device(s) "
                f"(cuda:0..cuda:{torch.cuda.device_count() - 1})"
            )
        return torch.device("cuda", index)
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={device!r} but MPS is not available here; use device='auto' or 'cpu'")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device={device!r}: ampkit supports 'cpu', 'cuda' and 'mps' devices")
    return dev


@dataclass(frozen=True)
class Support:
    """Which low-precision modes a device runs, and runs *fast*; each fact with its source."""

    device: str
    bf16_runs: bool
    bf16_fast: bool
    fp16_runs: bool
    fp16_fast: bool
    source: str


def capability(device: torch.device) -> Support:
    """Low-precision support of `device`, from compute capability (CUDA) or CPU flags."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
        return Support(
            device=name,
            bf16_runs=major >= 8,  # bf16 arithmetic arrived with Ampere (8.0)
            bf16_fast=major >= 8,
            fp16_runs=True,
            fp16_fast=major >= 7,  # fp16 Tensor Cores arrived with Volta (7.0)
            source="CUDA compute capability",
        )
    if device.type == "mps":
        return Support("Apple MPS", True, True, True, True, source="MPS backend")
    flags = cpu_flags()
    if flags is None:
        return Support("CPU (flags unknown)", True, False, True, False, source="CPU flags unavailable")
    bf16_fast = flags["avx512_bf16"] or flags["amx_bf16"]
    fp16_fast = flags["avx512_fp16"] or flags["amx_fp16"]
    have = [f for f, on in flags.items() if on]
    return Support(
        device=f"CPU ({', '.join(have) if have else 'no bf16/fp16 instructions'})",
        bf16_runs=True,
        bf16_fast=bf16_fast,
        fp16_runs=True,
        fp16_fast=fp16_fast,
        source="/proc/cpuinfo flags",
    )


def auto_precision(device: torch.device) -> tuple[str, str]:
    """The preset `precision="auto"` picks on `device`, and the one-sentence reason why."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        cc = f"{major}.{minor}"
        if major >= 8:
            return "bf16-mixed", f"CUDA compute capability {cc} >= 8.0 has native bf16: bf16 autocast, no loss scaling"
        if major == 7:
            return "fp16-mixed", f"CUDA compute capability {cc} has fp16 Tensor Cores but no bf16: fp16 autocast with loss scaling"
        return "fp32", f"CUDA compute capability {cc} < 7.0 has no fast fp16 or bf16: fp32"
    if device.type == "mps":
        return "fp16-mixed", "Apple MPS runs fp16 natively: fp16 autocast with loss scaling"
    flags = cpu_flags()
    if flags is None:
        return "fp32", "CPU flags could not be read, so bf16 speed is unknown: fp32"
    for flag in ("amx_bf16", "avx512_bf16"):
        if flags[flag]:
            return "bf16-mixed", f"CPU has {flag}: bf16 matmul is faster than fp32 here"
    return "fp32", "CPU has neither avx512_bf16 nor amx_bf16: bf16 and fp16 would be slower than fp32 here"


def cpu_name() -> str:
    """The CPU's model name as the OS reports it, or the platform's guess."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def describe(device: torch.device) -> dict[str, Any]:
    """The facts a report needs to be reproducible: device, versions, CPU flags, GPU."""
    flags = cpu_flags()
    gpu = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = {"name": props.name, "capability": f"{props.major}.{props.minor}", "memory_bytes": int(props.total_memory)}
    have = [f for f, on in (flags or {}).items() if on]
    name = gpu["name"] if gpu else f"{cpu_name()} ({', '.join(have) if have else 'no avx512_bf16/amx'})"
    return {
        "device": str(device),
        "device_name": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "cpu_flags": flags,
        "gpu": gpu,
    }
