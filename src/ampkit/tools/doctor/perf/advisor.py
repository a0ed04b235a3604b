"""The device advisor: from what one step measured here, how long would it take on a given GPU?

A simple model, so that every number can be explained. **Host**: the time outside kernel ops
carries over, and each op costs its dispatch (the cheapest op here) plus a launch. **Device**: per
op the longest of FLOPs at peak, bytes at bandwidth and the shortest kernel, plus the batch's PCIe
copy. **Step**: the larger of the two, their sum with a sync per step. Peaks are datasheet figures,
so the device time is a lower bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ampkit.hardware.capability import GPU_MODELS, LAUNCH_US, GPUModel, gpu_for_device
from ampkit.tools.doctor.perf.ops import OpStats

#: The shortest a kernel takes on the device, µs (NVIDIA's "Getting Started with CUDA Graphs",
#: developer.nvidia.com/blog/cuda-graphs/: a near-empty kernel runs ~2-3 µs).
MIN_KERNEL_US = 2.0

#: Host→device bandwidth of a pinned copy over PCIe 4.0 x16, GB/s (32 GB/s theoretical per
#: direction, PCI-SIG; ~25 GB/s reached in practice).
PCIE_GBPS = 25.0

#: One GPU's datasheet peaks: a row of the hardware table (`ampkit.hardware.capability.GPU_MODELS`).
GPUSpec = GPUModel

#: Known GPUs by name (the `--gpu` choices).
GPUS: dict[str, GPUSpec] = GPU_MODELS

__all__ = [
    "GPUS",
    "LAUNCH_US",
    "MIN_KERNEL_US",
    "PCIE_GBPS",
    "Estimate",
    "GPUSpec",
    "Workload",
    "estimate",
    "find_gpu",
    "gpu_for_device",
    "mixed_dtype",
    "sync_cost",
]


def datasheets() -> list[dict[str, Any]]:
    """Each GPU's figures the estimates use, with their source (a result's `advisor.gpus`)."""
    fields = ("name", "fp32_tflops", "bf16_tflops", "fp16_tflops", "memory_gbps", "launch_us", "source")
    return [{f: getattr(g, f) for f in fields} for g in GPUS.values()]


def _key(name: str) -> str:
    return name.replace(" ", "").lower()


def find_gpu(name: str) -> GPUSpec:
    """The table row for `name` (case and spaces ignored: "rtx4090", "a100"), else a ValueError."""
    gpu = next((g for g in GPUS.values() if _key(g.name) == _key(name)), None)
    if gpu is None:
        raise ValueError(f"gpu={name!r} is not in the doctor's table; choose one of: {', '.join(GPUS)}")
    return gpu


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One training step as measured here, in the figures the estimate needs."""

    host_outside_s: float  # host time per step outside kernel ops: Python, autograd, data loading
    dispatch_us: float  # what the cheapest op costs here: the per-op dispatch overhead
    ops: OpStats
    batch_bytes: float  # bytes per step copied host -> device
    syncs_per_step: float


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """Estimated step on one GPU in one compute dtype."""

    gpu: str
    dtype: str  # "fp32" or the mixed dtype ("bf16", "fp16")
    step_s: float
    host_s: float
    device_s: float
    bound: str  # "host" (launch/Python-bound) or "device"


def _matmul_peak(gpu: GPUSpec, dtype: str) -> float:
    if dtype == "bf16" and gpu.bf16_tflops:
        return gpu.bf16_tflops
    if dtype in ("bf16", "fp16"):
        return gpu.fp16_tflops
    if torch.get_float32_matmul_precision() != "highest" and gpu.tf32_tflops:
        return gpu.tf32_tflops  # torch was allowed to run fp32 matmuls in tf32
    return gpu.fp32_tflops


def mixed_dtype(gpu: GPUSpec) -> str:
    """The half dtype `precision="auto"` would pick on this GPU: bf16 where it has it, else fp16."""
    return "bf16" if gpu.capabilities["bf16"].supported else "fp16"


def estimate(work: Workload, gpu: GPUSpec, dtype: str = "fp32") -> Estimate:
    """The step time of `work` on `gpu` with matmuls in `dtype` (see the module docstring)."""
    matmul_peak, vector_peak = _matmul_peak(gpu, dtype) * 1e12, gpu.fp32_tflops * 1e12
    half = dtype in ("bf16", "fp16")
    device = 0.0
    for k in work.ops.kernels:
        moved = k.bytes / 2 if (half and k.matmul) else k.bytes  # half-precision operands
        compute = k.flops / (matmul_peak if k.matmul else vector_peak)
        device += max(compute, moved / (gpu.memory_gbps * 1e9), MIN_KERNEL_US * 1e-6)
    device = device / work.ops.steps + work.batch_bytes / (PCIE_GBPS * 1e9)
    host = work.host_outside_s + work.ops.per_step * (work.dispatch_us + gpu.launch_us) * 1e-6
    overlap = min(1.0, work.syncs_per_step)  # a sync per step serialises host and device
    step = max(host, device) + overlap * min(host, device)
    return Estimate(
        gpu=gpu.name,
        dtype=dtype,
        step_s=step,
        host_s=host,
        device_s=device,
        bound="host" if host >= device else "device",
    )


def sync_cost(work: Workload, gpu: GPUSpec, dtype: str = "fp32") -> float:
    """Seconds per step the syncs cost on `gpu`: the step with them minus the step without."""
    with_syncs = estimate(work, gpu, dtype)
    return with_syncs.step_s - max(with_syncs.host_s, with_syncs.device_s)
