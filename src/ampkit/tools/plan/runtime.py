"""What a training process holds besides its tensors: the part of a measured peak the tensor tracker cannot see.

A user measures a CPU run's memory as the resident set (RSS) of a steady-state step above the process's
pre-model baseline, and a CUDA run's as `torch.cuda.max_memory_allocated`. On a CPU that figure holds, beside the
live tensors `ampkit.tools.plan.tracker` counts:

- **runtime**: what the first training steps load and never give back: libtorch's code pages, the thread pools,
  oneDNN's primitive cache, and, where a preset compiles its update (bf16-true's fused Kahan step), torch.compile's
  modules and kernel. Measured constants per device and kind of CPU (`FITTED`, the one table of the planner's
  constants; `benchmarks/plan_vs_measured.py --runtime`).
- **allocator**: freed memory the allocator keeps mapped. glibc serves blocks under its dynamic mmap threshold
  (up to 32 MiB once a step has freed one that large) from its heaps and keeps their freed pages, so a steady
  step's RSS stands above its live bytes by an amount that depends on the order of allocations. Estimated as a
  fraction of the tensors at the peak that live in the heap, fitted to measurements (an estimate); 0 where
  glibc's thresholds are fixed (`MALLOC_TRIM_THRESHOLD_=131072` or another of `FIXED_BY` set: freed blocks go
  back to the system) and on CUDA, whose `max_memory_allocated` counts live blocks only.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch

from ampkit.hardware.capability import capability, cpu_flags
from ampkit.precision.policy import PRESETS

_MIB = 2**20


@dataclass(frozen=True)
class Fitted:
    """The planner's measured and fitted constants on one platform, each part with where it came from."""

    fp32: int  # runtime part, fp32 compute
    low_precision: int  # runtime part, bf16 or fp16 compute (autocast or true)
    compiler: int  # runtime part added by torch.compile's modules and one compiled kernel (bf16-true's fused update)
    runtime_measured_on: str
    glibc_kept: float  # allocator part: glibc's kept heap as a fraction of the tensors at the peak in its heap
    planner_bytes: int  # micro_batch="auto": the planner's own modules, resident once it has run
    glibc_margin: float  # micro_batch="auto": the margin glibc's kept heap adds to the sizer's
    allocator_fitted_on: str


#: The runtime part: RSS high-water mark of a steady-state step above the pre-model baseline, in a fresh process,
#: for a one-layer tiny-lm of a few thousand parameters (a transformer's kernels, no tensor of note; AdamW), Linux
#: (glibc): `benchmarks/plan_vs_measured.py --runtime`. A CPU is keyed by whether it has bf16 instructions: oneDNN's
#: bf16 kernels (AMX, AVX512-BF16) load more than the conversions a CPU without them runs its bf16 ops through.
#: The allocator part: the measured part was 13-34% of the heap's tensors (MLP-stack LM of 34 M parameters at batch
#: 512, tiny-lm medium and small; fp32, bf16-mixed, bf16-master, bf16-true; benchmarks/RESULTS.md). All but ampkit's
#: buffers (masters, Kahan buffers) live in the heap: those are allocated once at prepare, before a freed block
#: raises the mmap threshold, so mapped. The planner's own modules measured 10 MiB; an MLP split into 1,039-row
#: micro-batches moved by 252-312 MiB over identical runs, hence the wider margin.
#: CUDA (and any device but the CPU): a peak is `torch.cuda.max_memory_allocated`, live blocks only, so host memory
#: (runtime, planner) and freed blocks (allocator) are no part of it.
_XEON_GLIBC = "Intel Xeon (AMX), glibc 2.36, torch 2.13"
FITTED = {
    "cpu, bf16 instructions": Fitted(
        91 * _MIB,
        100 * _MIB,
        61 * _MIB,
        "Intel Xeon (AMX), torch 2.13; AMD EPYC (AVX512-BF16, no AMX): 89 / 98 / 161-171 MiB",
        0.22,
        16 * _MIB,
        0.05,
        _XEON_GLIBC,
    ),
    "cpu, no bf16 instructions": Fitted(
        90 * _MIB,
        87 * _MIB,
        62 * _MIB,
        "AMD EPYC (AVX2 only), torch 2.13",
        0.22,
        16 * _MIB,
        0.05,
        f"{_XEON_GLIBC} (not refitted on this kind: glibc's policy does not depend on the CPU)",
    ),
    "cuda": Fitted(0, 0, 0, "none: host memory is not counted", 0.0, 0, 0.0, "none: live blocks only"),
}


def platform_key(device: torch.device) -> str:
    """`device`'s key in `FITTED`; a CPU whose flags cannot be read takes the larger, bf16 row."""
    if device.type != "cpu":
        return "cuda"
    if cpu_flags() is None:
        return "cpu, bf16 instructions"
    return "cpu, bf16 instructions" if capability(device).bf16_fast else "cpu, no bf16 instructions"


def fitted(device: torch.device) -> Fitted:
    """The planner's constants for `device` (`FITTED`)."""
    return FITTED[platform_key(device)]


#: Where the runtime part is most of a plan's peak, the line that says how far it can be off: the constants are a
#: transformer's, and a model of fewer kinds of kernel loads less (benchmarks/RESULTS.md, plan_vs_measured.py).
RUNTIME_CAVEAT = (
    "runtime is most of this peak, and it is a constant measured for a small transformer (per CPU kind,",
    "  torch 2.13): a model of fewer kinds of kernel loads less (iris-mlp 12-17 MiB less, so its plan came",
    "  out 12-19% high; digits-cnn within 3-8%), and other machines and torch versions differ",
)


def runtime_bytes(precision: str, device: torch.device) -> int:
    """The runtime part of `precision`'s measured peak on `device` (0 on CUDA: host memory is not counted)."""
    preset, row = PRESETS[precision], fitted(device)
    framework = row.fp32 if preset.compute_dtype == torch.float32 else row.low_precision
    return framework + (row.compiler if preset.compensated else 0)


#: Setting any of these fixes glibc's thresholds (no dynamic rise): freed blocks of 128 KiB or more go back.
FIXED_BY = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def glibc_keeps_freed() -> bool:
    """Whether freed heap memory stays mapped in this process: glibc's malloc with its dynamic thresholds."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    fixed = any(k in os.environ for k in FIXED_BY) or any(
        f"glibc.malloc.{t}" in tunables for t in ("mmap_threshold", "trim_threshold", "top_pad", "mmap_max")
    )
    return platform.libc_ver()[0] == "glibc" and not fixed


def allocator_bytes(peak: int, device: torch.device, buffers: int = 0) -> int:
    """The allocator part of a measured peak whose live tensors peak at `peak` bytes on `device`, `buffers` of
    them ampkit's long-lived buffers (outside glibc's heap)."""
    if not glibc_keeps_freed():
        return 0
    return round(max(0, peak - buffers) * fitted(device).glibc_kept)


def split_kept_bytes(components: dict[str, int], device: torch.device) -> int:
    """What running a batch as several micro-batches adds to one micro-batch's measured peak: the gradients, which
    exist through every backward after the first, and on a CPU with glibc's dynamic thresholds one micro-batch's
    activations and temporaries, which glibc keeps mapped after they are freed (measured: a 4.3 M-parameter MLP
    at 2,475 rows, 4 micro-batches, +98 MiB with glibc as it comes, -4 MiB with its thresholds fixed)."""
    grads = max(0, components["parameters"] - components["gradients"])
    if device.type != "cpu" or not glibc_keeps_freed():
        return grads
    return grads + components["activations"] + components["temporaries"] + components["autocast_cache"]
