"""What this machine's devices can do, and the `auto` precision choice with its reason.

Every device fact is a row of a table with its source: the GPU architectures and models in
`ampkit.hardware.device_table`, the CPU flags in `ampkit.hardware.cpu_features`. This module reads the device at
hand and derives from them `device_capabilities`, `capability`, `auto_precision` and `describe` (the doctor's
advisor reads the GPU models). What ampkit does not know is "unknown" (`Fact.supported` is None), never
a guess. Whether a *model* gains, compare and the doctor measure. The tables' and flags' names are
importable from here as well, where the rest of ampkit has always found them.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Any

import torch

from ampkit.hardware.cpu_features import (
    CPU_FLAGS,
    cpu_capabilities,
    cpu_flags,
    cpu_has,
    cpu_name,
    parse_cpu_flags,
    proc_field,
    read_cpu_flags,
)
from ampkit.hardware.device_table import (
    CAPABILITIES,
    CUDA_ARCHITECTURES,
    FIRST_IN,
    GPU_MODELS,
    LAUNCH_US,
    ROCM_ARCHITECTURES,
    Fact,
    GPUModel,
    gpu_capabilities,
    rocm_capabilities,
)

__all__ = [
    "CAPABILITIES",
    "CPU_FLAGS",
    "CUDA_ARCHITECTURES",
    "FIRST_IN",
    "GPU_MODELS",
    "LAUNCH_US",
    "ROCM_ARCHITECTURES",
    "Fact",
    "GPUModel",
    "Support",
    "auto_precision",
    "capability",
    "cpu_capabilities",
    "cpu_flags",
    "cpu_has",
    "cpu_name",
    "describe",
    "device_capabilities",
    "gpu_for_device",
    "peak_tflops",
    "gpu_capabilities",
    "parse_cpu_flags",
    "proc_field",
    "read_cpu_flags",
    "resolve_device",
    "rocm_arch",
    "rocm_capabilities",
]


def resolve_device(device: str | torch.device) -> torch.device:
    """Turn "auto" (CUDA, else MPS, else the CPU), "cpu", "cuda:1", ... into a usable `torch.device`,
    or raise ValueError."""
    if isinstance(device, str) and device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        expected = "expected 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"
        raise ValueError(f"device={device!r} is not a device name; {expected}") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available here; use device='auto' or 'cpu'")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= (count := torch.cuda.device_count()):
            raise ValueError(
                f"device={device!r} but this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})"
            )
        return torch.device("cuda", index)
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={device!r} but MPS is not available here; use device='auto' or 'cpu'")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device={device!r}: ampkit supports 'cpu', 'cuda' and 'mps' devices")
    return dev


def rocm_arch(device: torch.device) -> str | None:
    """The gfx architecture of a CUDA-API device on ROCm ("gfx942"), or None on NVIDIA's CUDA (ROCm's
    "compute capability" 9.4 is gfx942, never NVIDIA's 9.4)."""
    if torch.version.hip is None:
        return None
    return torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]  # "gfx942:sramecc+:xnack-"


def device_capabilities(device: torch.device) -> dict[str, Fact]:
    """`CAPABILITIES` of `device` (as `resolve_device` returns it), each fact with its source."""
    if device.type == "cuda":
        arch = rocm_arch(device)
        return rocm_capabilities(arch) if arch else gpu_capabilities(*torch.cuda.get_device_capability(device))
    if device.type == "mps":
        facts = {c: Fact(None, f"Apple GPU (MPS): ampkit has no table for {c}: unknown") for c in CAPABILITIES}
        facts["fp16"] = Fact(True, "Apple GPU (MPS): fp16 is native")
        return facts
    return cpu_capabilities(cpu_flags())


# --- What runs, what is fast, and what `auto` picks: derived from the facts above ---


@dataclass(frozen=True)
class Support:
    """Which low-precision modes a device runs, and runs *fast*; each fact with its source."""

    device: str
    bf16_runs: bool
    bf16_fast: bool
    fp16_runs: bool
    fp16_fast: bool
    source: str


def _bf16_runs(device: torch.device) -> bool:
    """Whether `device` runs bf16 at all, fast or not: every CPU, MPS and ROCm device does, and an NVIDIA
    GPU from the architecture that added it on (`FIRST_IN`; later ones keep it), in the table or not."""
    if device.type != "cuda" or rocm_arch(device):
        return True
    return torch.cuda.get_device_capability(device) >= FIRST_IN["bf16"][0]


def _gpu_named(device: torch.device) -> tuple[str, str]:
    """A GPU as reasons name it ("CUDA compute capability 9.0", "AMD gfx942 on ROCm"), and its facts' source."""
    if device.type == "mps":
        return "Apple MPS", "MPS backend"
    if arch := rocm_arch(device):
        return f"AMD {arch} on ROCm", "ROCm gfx architecture"
    return "CUDA compute capability {}.{}".format(*torch.cuda.get_device_capability(device)), "CUDA compute capability"


def capability(device: torch.device) -> Support:
    """Low-precision support of `device`, from `device_capabilities`: a dtype is fast where it runs and
    the table says so; where it does not know, fast on a GPU (it runs it in hardware), slow on a CPU."""
    facts = device_capabilities(device)
    gpu = device.type != "cpu"
    bf16_runs = _bf16_runs(device)
    fast = {c: gpu if (known := facts[c].supported) is None else known for c in ("bf16", "fp16")}
    if gpu:
        name, source = _gpu_named(device)
        name = f"{torch.cuda.get_device_name(device)} ({name})" if device.type == "cuda" else name
    elif (flags := cpu_flags()) is None:
        name, source = "CPU (flags unknown)", "CPU flags unavailable"
    else:
        have = [f for f, on in flags.items() if on]
        name, source = f"CPU ({', '.join(have) if have else 'no bf16/fp16 instructions'})", "/proc/cpuinfo flags"
    return Support(
        device=name,
        bf16_runs=bf16_runs,
        bf16_fast=bf16_runs and fast["bf16"],
        fp16_runs=True,
        fp16_fast=fast["fp16"],
        source=source,
    )


def auto_precision(device: torch.device) -> tuple[str, str]:
    """The preset `precision="auto"` picks on `device`, and the one-sentence reason why: bf16 where the
    table confirms it, else fp16 where it confirms it on a GPU, else bf16 on a GPU it does not know
    that runs it, else fp32 (on a CPU only bf16 counts: autocast's CPU fp16 is rarely faster)."""
    facts = device_capabilities(device)
    bf16, fp16 = facts["bf16"].supported, facts["fp16"].supported
    if device.type == "cpu":
        flags = cpu_flags()
        if flags is None:
            return "fp32", "CPU flags could not be read, so bf16 speed is unknown: fp32"
        if bf16:
            return (
                "bf16-mixed",
                f"CPU has {' and '.join(cpu_has(flags, 'bf16'))}: bf16 matmul is faster than fp32 here",
            )
        return "fp32", "CPU has neither avx512_bf16 nor amx_bf16: bf16 and fp16 would be slower than fp32 here"
    who = _gpu_named(device)[0]
    if bf16:
        return "bf16-mixed", f"{who} has native bf16: bf16 autocast, no loss scaling"
    if fp16:
        but = " but no bf16" if bf16 is False else ""
        return "fp16-mixed", f"{who} has native fp16{but}: fp16 autocast with loss scaling"
    if bf16 is None and _bf16_runs(device):
        return "bf16-mixed", f"{who} is not in ampkit's table but runs bf16: bf16 autocast, no loss scaling"
    return "fp32", f"{who} has no fast fp16 or bf16: fp32"


def describe(device: torch.device) -> dict[str, Any]:
    """The facts a report needs to be reproducible: device, versions, CPU flags, GPU."""
    flags = cpu_flags()
    gpu = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = {
            "name": props.name,
            "capability": rocm_arch(device) or f"{props.major}.{props.minor}",
            "memory_bytes": int(props.total_memory),
        }
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


def gpu_for_device(device: torch.device) -> GPUModel | None:
    """The table row for a CUDA device by its name ("NVIDIA A100-SXM4-80GB" -> A100), or None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).replace(" ", "").lower()
    return next((g for g in GPU_MODELS.values() if g.name.replace(" ", "").lower() in name), None)


def peak_tflops(gpu: GPUModel, compute_dtype: torch.dtype) -> float | None:
    """The datasheet's dense peak for matmuls in `compute_dtype` (fp32 on Tensor Cores where torch allows tf32;
    fp8's matmuls against the bf16 peak, the table having no fp8 column), None where the GPU lacks the unit."""
    if compute_dtype == torch.bfloat16:
        return gpu.bf16_tflops
    if compute_dtype == torch.float16:
        return gpu.fp16_tflops
    tf32 = torch.backends.cuda.matmul.allow_tf32 and gpu.tf32_tflops is not None
    return gpu.tf32_tflops if tf32 else gpu.fp32_tflops
