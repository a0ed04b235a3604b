"""What a training process holds besides its tensors: the part of a measured peak the tensor tracker cannot see.

A user measures a CPU run's memory as the resident set (RSS) of a steady-state step above the process's
pre-model baseline, and a CUDA run's as `torch.cuda.max_memory_allocated`. On a CPU that figure holds, beside the
live tensors `ampkit.tools.plan.tracker` counts:

- **runtime**: what the first training steps load and never give back: libtorch's code pages, the thread pools,
  oneDNN's primitive cache, and, where a preset compiles its update (bf16-true's fused Kahan step), torch.compile's
  modules and kernel. Measured constants per device and kind of CPU (`CPU_RUNTIME`;
  `benchmarks/plan_vs_measured.py --runtime`).
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
class Runtime:
    """The runtime part on one kind of CPU, and where it was measured."""

    fp32: int  # fp32 compute
    low_precision: int  # bf16 or fp16 compute (autocast or true)
    compiler: int  # added by torch.compile's modules and one compiled kernel (bf16-true's fused update)
    measured_on: str


#: RSS high-water mark of a steady-state step above the pre-model baseline, in a fresh process, for a one-layer
#: tiny-lm of a few thousand parameters (a transformer's kernels, no tensor of note; AdamW), Linux (glibc):
#: `benchmarks/plan_vs_measured.py --runtime`. Keyed by whether the CPU has bf16 instructions: oneDNN's bf16
#: kernels (AMX, AVX512-BF16) load more than the conversions a CPU without them runs its bf16 ops through.
CPU_RUNTIME = {
    "bf16 instructions": Runtime(91 * _MIB, 100 * _MIB, 61 * _MIB, "Intel Xeon (AMX), torch 2.13"),
    "no bf16 instructions": Runtime(90 * _MIB, 87 * _MIB, 62 * _MIB, "AMD EPYC (AVX2 only), torch 2.13"),
}


def cpu_kind() -> str:
    """This CPU's key in `CPU_RUNTIME`; a CPU whose flags cannot be read takes the larger, bf16 row."""
    if cpu_flags() is None:
        return "bf16 instructions"
    return "bf16 instructions" if capability(torch.device("cpu")).bf16_fast else "no bf16 instructions"


#: Where the runtime part is most of a plan's peak, the line that says how far it can be off: the constants are a
#: transformer's, and a model of fewer kinds of kernel loads less (benchmarks/RESULTS.md, plan_vs_measured.py).
RUNTIME_CAVEAT = (
    "runtime is most of this peak, and it is a constant measured for a small transformer (per CPU kind,",
    "  torch 2.13): a model of fewer kinds of kernel loads less (iris-mlp 12-17 MiB less, so its plan came",
    "  out 12-19% high; digits-cnn within 3-8%), and other machines and torch versions differ",
)

#: glibc's kept heap as a fraction of the tensors at the peak that live in its heap: all but ampkit's buffers
#: (masters, Kahan buffers), allocated once at prepare, before a freed block raises the mmap threshold, so
#: mapped. Fitted: the measured part was 13-34% of them (MLP-stack LM of 34 M parameters at batch 512, tiny-lm
#: medium and small; fp32, bf16-mixed, bf16-master, bf16-true; benchmarks/RESULTS.md).
GLIBC_KEPT = 0.22
#: micro_batch="auto" on a CPU: the planner's own modules, resident once it has run (measured: 10 MiB), and the
#: wider margin glibc's kept heap needs (an MLP split into 1,039-row micro-batches: 252-312 MiB over identical runs).
PLANNER_BYTES = 16 * 2**20
GLIBC_MARGIN = 0.05


def runtime_bytes(precision: str, device: torch.device) -> int:
    """The runtime part of `precision`'s measured peak on `device` (0 on CUDA: host memory is not counted)."""
    if device.type != "cpu":
        return 0
    preset, row = PRESETS[precision], CPU_RUNTIME[cpu_kind()]
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
    if device.type != "cpu" or not glibc_keeps_freed():
        return 0
    return round(max(0, peak - buffers) * GLIBC_KEPT)


def split_kept_bytes(components: dict[str, int], device: torch.device) -> int:
    """What running a batch as several micro-batches adds to one micro-batch's measured peak: the gradients, which
    exist through every backward after the first, and on a CPU with glibc's dynamic thresholds one micro-batch's
    activations and temporaries, which glibc keeps mapped after they are freed (measured: a 4.3 M-parameter MLP
    at 2,475 rows, 4 micro-batches, +98 MiB with glibc as it comes, -4 MiB with its thresholds fixed)."""
    grads = max(0, components["parameters"] - components["gradients"])
    if device.type != "cpu" or not glibc_keeps_freed():
        return grads
    return grads + components["activations"] + components["temporaries"] + components["autocast_cache"]
