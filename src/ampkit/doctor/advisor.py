"""The device advisor: from what one step measured here, how long would it take on a given GPU?

The model is deliberately simple, so every number in the answer can be explained:

- **host** (the Python thread): what the step spent here outside kernel ops (Python, autograd,
  data loading) carries over unchanged — it is the same code on the same kind of CPU — and every
  kernel op now costs its dispatch (the cheapest op measured here) plus a kernel launch.
- **device**: each kernel op takes the longest of its FLOPs at the GPU's peak, its bytes at the
  GPU's memory bandwidth, and the shortest time any kernel takes; plus the batch's copy over PCIe.
- **step**: without syncs the host runs ahead and the step costs the larger of the two; each sync
  makes the host wait for the device, so with one or more per step it costs their sum.

Peaks are datasheet figures, so the device time is a lower bound: where the answer is "the GPU is
slower", it holds with room to spare. Where a GPU is not in the table, the answer is "unknown".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ampkit.doctor.ops import OpStats

#: Host cost of one kernel launch from eager PyTorch (cudaLaunchKernel), µs. NVIDIA's "Getting
#: Started with CUDA Graphs" (developer.nvidia.com/blog/cuda-graphs/) measures ~3.8 µs per
#: back-to-back launch of a 2.9 µs kernel; the same order on every recent GPU (it is a host cost).
LAUNCH_US = 4.0

#: The shortest a kernel takes on the device, µs (same source: a near-empty kernel runs ~2-3 µs).
MIN_KERNEL_US = 2.0

#: Host→device bandwidth of a pinned copy over PCIe 4.0 x16, GB/s (32 GB/s theoretical per
#: direction, PCI-SIG; ~25 GB/s reached in practice).
PCIE_GBPS = 25.0


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    """Datasheet peaks of one GPU (dense, no sparsity); None where the GPU lacks the unit."""

    name: str
    fp32_tflops: float  # CUDA cores, no Tensor Cores
    tf32_tflops: float | None  # Tensor Cores, used for fp32 matmuls only if torch allows tf32
    bf16_tflops: float | None  # Tensor Cores
    fp16_tflops: float  # Tensor Cores (fp32 accumulate)
    memory_gbps: float
    launch_us: float
    source: str


#: Known GPUs by name (the `--gpu` choices).
GPUS: dict[str, GPUSpec] = {g.name: g for g in (
    # NVIDIA T4 datasheet (nvidia.com/en-us/data-center/tesla-t4/): FP32 8.1 TFLOPS, mixed
    # FP16/FP32 65 TFLOPS, 320 GB/s GDDR6. Turing (7.5) has no bf16 or tf32.
    GPUSpec(name="T4", fp32_tflops=8.1, tf32_tflops=None, bf16_tflops=None, fp16_tflops=65.0,
            memory_gbps=320.0, launch_us=LAUNCH_US, source="NVIDIA T4 datasheet"),
    # NVIDIA L4 datasheet (nvidia.com/en-us/data-center/l4/): FP32 30.3, TF32 60, BF16/FP16 121
    # TFLOPS dense (the datasheet's 120/242/485 are with sparsity), 300 GB/s.
    GPUSpec(name="L4", fp32_tflops=30.3, tf32_tflops=60.0, bf16_tflops=121.0, fp16_tflops=121.0,
            memory_gbps=300.0, launch_us=LAUNCH_US, source="NVIDIA L4 datasheet (dense = sparse / 2)"),
    # NVIDIA A100 datasheet, SXM4 80 GB (nvidia.com/en-us/data-center/a100/): FP32 19.5, TF32 156,
    # BF16/FP16 312 TFLOPS dense, 2,039 GB/s HBM2e.
    GPUSpec(name="A100", fp32_tflops=19.5, tf32_tflops=156.0, bf16_tflops=312.0, fp16_tflops=312.0,
            memory_gbps=2039.0, launch_us=LAUNCH_US, source="NVIDIA A100 datasheet (SXM4 80GB)"),
    # NVIDIA Ada Lovelace architecture whitepaper, appendix table for the GeForce RTX 4090: FP32
    # 82.6 TFLOPS, FP16/BF16 Tensor with FP32 accumulate 165.2 TFLOPS dense, TF32 82.6, 1,008 GB/s.
    GPUSpec(name="RTX 4090", fp32_tflops=82.6, tf32_tflops=82.6, bf16_tflops=165.2, fp16_tflops=165.2,
            memory_gbps=1008.0, launch_us=LAUNCH_US, source="NVIDIA Ada Lovelace whitepaper (RTX 4090)"),
    # NVIDIA H100 datasheet, SXM5 (nvidia.com/en-us/data-center/h100/): FP32 67, TF32 494.5,
    # BF16/FP16 989.5 TFLOPS dense (half the datasheet's sparsity figures), 3.35 TB/s HBM3.
    GPUSpec(name="H100", fp32_tflops=67.0, tf32_tflops=494.5, bf16_tflops=989.5, fp16_tflops=989.5,
            memory_gbps=3350.0, launch_us=LAUNCH_US, source="NVIDIA H100 datasheet (SXM, dense = sparse / 2)"),
)}


def find_gpu(name: str) -> GPUSpec:
    """The table row for `name` (case and spaces ignored: "rtx4090", "a100"), else a ValueError."""
    key = name.replace(" ", "").lower()
    for gpu in GPUS.values():
        if gpu.name.replace(" ", "").lower() == key:
            return gpu
    raise ValueError(f"gpu={name!r} is not in the doctor's table; choose one of: {', '.join(GPUS)}")


def gpu_for_device(device: torch.device) -> GPUSpec | None:
    """The table row for a CUDA device by its name ("NVIDIA A100-SXM4-80GB" -> A100), or None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).replace(" ", "").lower()
    return next((g for g in GPUS.values() if g.name.replace(" ", "").lower() in name), None)


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
    return "bf16" if gpu.bf16_tflops else "fp16"


def estimate(work: Workload, gpu: GPUSpec, dtype: str = "fp32") -> Estimate:
    """The step time of `work` on `gpu` with matmuls in `dtype` (see the module docstring)."""
    ops = work.ops
    matmul_peak = _matmul_peak(gpu, dtype) * 1e12
    vector_peak = gpu.fp32_tflops * 1e12
    bandwidth = gpu.memory_gbps * 1e9
    half = dtype in ("bf16", "fp16")
    device = 0.0
    for k in ops.kernels:
        moved = k.bytes / 2 if (half and k.matmul) else k.bytes  # half-precision operands
        compute = k.flops / (matmul_peak if k.matmul else vector_peak)
        device += max(compute, moved / bandwidth, MIN_KERNEL_US * 1e-6)
    device = device / ops.steps + work.batch_bytes / (PCIE_GBPS * 1e9)
    host = work.host_outside_s + ops.per_step * (work.dispatch_us + gpu.launch_us) * 1e-6
    overlap = min(1.0, work.syncs_per_step)  # a sync per step serialises host and device
    step = max(host, device) + overlap * min(host, device)
    return Estimate(gpu=gpu.name, dtype=dtype, step_s=step, host_s=host, device_s=device,
                    bound="host" if host >= device else "device")


def sync_cost(work: Workload, gpu: GPUSpec, dtype: str = "fp32") -> float:
    """Seconds per step the syncs cost on `gpu`: the step with them minus the step without."""
    with_syncs = estimate(work, gpu, dtype)
    return with_syncs.step_s - max(with_syncs.host_s, with_syncs.device_s)
