"""What this machine's devices can do, and the `auto` precision choice with its reason.

The choice is made from the hardware alone (compute capability on CUDA, CPU flags read from the
OS): it must be explainable in one sentence and the same on every run. Whether a *model* gains from
it is a different question, which `ampkit compare` and the doctor answer by measuring.

Facts come with their source, and a fact ampkit does not know is "unknown" (`Fact.supported` is
None), never a guess: a compute capability missing from `CUDA_ARCHITECTURES`, unreadable CPU flags.
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


def read_cpu_flags(path: str | Path = "/proc/cpuinfo") -> dict[str, bool] | None:
    """`CPU_FLAGS` read from `path`, or None where it does not say: no such file (not Linux), or no
    "flags" line (not x86: an ARM CPU lists "Features", and its bf16 is not among these flags).
    """
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    if not any(line.partition(":")[0].strip() == "flags" for line in text.splitlines()):
        return None  # reading "no flags line" as "no bf16" would be a guess, not a fact
    return parse_cpu_flags(text)


@functools.cache
def cpu_flags() -> dict[str, bool] | None:
    """This CPU's low-precision flags, or None where the OS does not say (not Linux, not x86)."""
    return read_cpu_flags()


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


# --------------------------------------------------------------------------------------------------
# The capability table: which low-precision matmul units a device has, each fact with its source
# --------------------------------------------------------------------------------------------------

#: The facts `ampkit info` reports per device, by the dtype they concern: hardware that runs matmuls
#: in that dtype faster than fp32 (on NVIDIA GPUs, Tensor Cores for it; on CPUs, instructions for it).
CAPABILITIES: tuple[str, ...] = ("fp16", "bf16", "tf32", "fp8")


@dataclass(frozen=True)
class Fact:
    """One capability of one device: whether it has it (None: unknown), and where that comes from."""

    supported: bool | None
    source: str


# What each generation added: Volta fp16 Tensor Cores, Ampere bf16 and tf32, Ada/Hopper fp8.
_VOLTA = frozenset({"fp16"})
_AMPERE = frozenset({"fp16", "bf16", "tf32"})
_ADA = frozenset(CAPABILITIES)

#: NVIDIA compute capability -> (architecture, the `CAPABILITIES` it has Tensor Cores for). Exact rows
#: only: 8.7 (Orin) has no fp8 although 8.6 < 8.7 < 8.9, so nothing is inferred between or past rows.
#: Source: https://developer.nvidia.com/cuda-gpus and NVIDIA's architecture whitepapers.
CUDA_ARCHITECTURES: dict[tuple[int, int], tuple[str, frozenset[str]]] = {
    (7, 0): ("Volta", _VOLTA),
    (7, 2): ("Volta, Jetson Xavier", _VOLTA),
    (7, 5): ("Turing", _VOLTA),
    (8, 0): ("Ampere", _AMPERE),
    (8, 6): ("Ampere", _AMPERE),
    (8, 7): ("Ampere, Jetson Orin", _AMPERE),
    (8, 9): ("Ada Lovelace", _ADA),
    (9, 0): ("Hopper", _ADA),
    (10, 0): ("Blackwell", _ADA),
    (10, 3): ("Blackwell Ultra", _ADA),
    (11, 0): ("Blackwell, Jetson Thor", _ADA),
    (12, 0): ("Blackwell", _ADA),
    (12, 1): ("Blackwell, DGX Spark", _ADA),
}

#: Where each capability first appeared, for the source of a "no".
_FIRST_IN = {"fp16": "Volta, 7.0", "bf16": "Ampere, 8.0", "tf32": "Ampere, 8.0", "fp8": "Ada Lovelace, 8.9"}


def gpu_capabilities(major: int, minor: int) -> dict[str, Fact]:
    """`CAPABILITIES` of an NVIDIA GPU of compute capability `major.minor`, from `CUDA_ARCHITECTURES`.

    Before 7.0 there are no Tensor Cores at all, so every fact is a "no". A capability that is not a
    row of the table (newer than it, or between rows) gives "unknown" for every fact.
    """
    cc = f"{major}.{minor}"
    if major < 7:
        return {c: Fact(False, f"NVIDIA compute capability {cc} (before Volta 7.0): no Tensor Cores")
                for c in CAPABILITIES}
    row = CUDA_ARCHITECTURES.get((major, minor))
    if row is None:
        known = ", ".join(f"{a}.{b}" for a, b in CUDA_ARCHITECTURES)
        return {c: Fact(None, f"NVIDIA compute capability {cc} is not in ampkit's table ({known}): unknown")
                for c in CAPABILITIES}
    arch, has = row
    return {
        c: Fact(True, f"NVIDIA compute capability {cc} ({arch}): {c} Tensor Cores") if c in has
        else Fact(False, f"NVIDIA compute capability {cc} ({arch}): no {c} Tensor Cores (first in {_FIRST_IN[c]})")
        for c in CAPABILITIES
    }


def cpu_capabilities(flags: dict[str, bool] | None) -> dict[str, Fact]:
    """`CAPABILITIES` of a CPU from its `CPU_FLAGS` (as `parse_cpu_flags` returns them; None: unread).

    bf16 <- avx512_bf16 or amx_bf16; fp16 <- avx512_fp16 or amx_fp16. No flag ampkit reads speaks
    for tf32 or fp8, so those are "unknown" on every CPU.
    """
    facts = {c: Fact(None, f"no CPU flag ampkit reads covers {c}: unknown") for c in ("tf32", "fp8")}
    for c in ("bf16", "fp16"):
        names = (f"avx512_{c}", f"amx_{c}")
        if flags is None:
            facts[c] = Fact(None, "CPU flags could not be read (no x86 flags line in /proc/cpuinfo): unknown")
            continue
        have = [n for n in names if flags[n]]
        facts[c] = (Fact(True, f"/proc/cpuinfo flags: {' and '.join(have)}") if have
                    else Fact(False, f"/proc/cpuinfo flags: neither {names[0]} nor {names[1]}"))
    return {c: facts[c] for c in CAPABILITIES}


def device_capabilities(device: torch.device) -> dict[str, Fact]:
    """`CAPABILITIES` of `device` (as `resolve_device` returns it), each fact with its source."""
    if device.type == "cuda":
        if torch.version.hip is not None:  # ROCm reports AMD gfx numbers as "compute capability"
            name = torch.cuda.get_device_properties(device).name
            return {c: Fact(None, f"AMD GPU {name} (ROCm): ampkit's table covers NVIDIA GPUs only: unknown")
                    for c in CAPABILITIES}
        return gpu_capabilities(*torch.cuda.get_device_capability(device))
    if device.type == "mps":
        facts = {c: Fact(None, f"Apple GPU (MPS): ampkit has no table for {c}: unknown") for c in CAPABILITIES}
        facts["fp16"] = Fact(True, "Apple GPU (MPS): fp16 is native")
        return facts
    return cpu_capabilities(cpu_flags())
