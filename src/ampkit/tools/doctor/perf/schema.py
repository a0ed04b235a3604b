"""The contract of `ampkit doctor --json` (and of what `DoctorSession` returns) as typed records:
`DOCTOR_SCHEMA` is generated from `DoctorResult`, and `validate_result` checks a result against it with
the standard library alone (`ampkit.tools.records`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from ampkit.tools.records import build, contract, field, validate

#: The measured phases of a step, in step order ("other" is the step time not covered by them).
Phase = Literal["data", "h2d", "forward", "backward", "optimizer"]
PHASES: tuple[str, ...] = get_args(Phase)
FindingId = Literal["data-wait", "busy-threads", "overhead-bound", "small-batch", "micro-batch", "precision", "sync"]
Dtype = Literal["fp32", "bf16", "fp16"]


@dataclass(kw_only=True)
class Subject:
    """What ran under the doctor: a script (its argv), a built-in task, or a training loop in this process."""

    kind: Literal["script", "task", "loop"] = field()
    name: str = field()
    argv: list[str] = field()


@dataclass(kw_only=True)
class Device:
    """Where the step ran, and the precision it ran in."""

    device: str = field()
    name: str = field()
    threads: int = field(minimum=1)
    precision: str = field()
    precision_reason: str = field()
    bf16_fast: bool = field()


@dataclass(kw_only=True)
class Steps:
    """How many optimizer steps were warm-up, profiled and timed."""

    warmup: int = field(minimum=0)
    profiled: int = field(minimum=1)
    timed: int = field(minimum=0)
    requested: int = field(minimum=1)
    complete: bool = field()


@dataclass(kw_only=True)
class Step:
    """One step's time and samples."""

    time_s: float = field("Median step time (on CUDA from device events; else the host clock).", minimum=0)
    host_s: float = field("Median host time per step; the phases (medians too) add up to it.", minimum=0)
    samples: float | None = field("Samples per step from the prepared DataLoader's batches; null: unknown.", minimum=0)
    samples_per_s: float | None = field(minimum=0)


@dataclass(kw_only=True)
class PhaseTime:
    """One phase's share of the step."""

    name: Literal[Phase, "other"] = field()
    seconds: float = field(minimum=0)
    share: float = field(minimum=0)


@dataclass(kw_only=True)
class TopOp:
    """One of the kernel ops that took the most time."""

    name: str = field()
    per_step: float = field(minimum=0)
    us_per_step: float = field(minimum=0)
    median_us: float = field(minimum=0)
    share: float = field(minimum=0)
    matmul: bool = field()


@dataclass(kw_only=True)
class Ops:
    """The profiled kernel ops."""

    per_step: float = field(
        "Kernel ops per step: the outermost ops that do work on a backend (about one GPU kernel each).", minimum=0
    )
    mean_us: float = field(minimum=0)
    floor_us: float = field(minimum=0)
    seconds_per_step: float = field(minimum=0)
    work_s_per_step: float | None = field(
        "Seconds the kernels' FLOPs and bytes need at this device's measured matmul peak and copy bandwidth; "
        "null: not measured.",
        minimum=0,
    )
    kernel_share: float = field("Share of the compute time (data wait excluded) spent inside kernels.", minimum=0)
    flops_per_step: float = field(minimum=0)
    bytes_per_step: float = field(minimum=0)
    matmul_share: float = field(minimum=0)
    profiler_scale: float = field("Factor applied to profiled op times to match the unprofiled step.", minimum=0)
    cuda_kernels_per_step: float | None = field(minimum=0)
    cuda_kernel_mean_us: float | None = field(minimum=0)
    top: list[TopOp] = field()


@dataclass(kw_only=True)
class SyncSite:
    """One line of the user's program that read a device value on the host."""

    file: str = field("The user's file that caused the sync.")
    line: int = field(minimum=0)
    code: str = field("The source line there.")
    call: str = field("The Tensor method that read the value (item, __float__, __format__, ...) or 'cuda-sync'.")
    via: str | None = field(
        "The library line that made the read on the user's behalf (e.g. ampkit/engine/optim.py:245); null: the user's."
    )
    per_step: float = field("Its reads over the watched steps, per step.", minimum=0)
    reads: int = field("Its reads in the watched steps.", minimum=1)
    steps_seen: int = field("In how many of the watched steps it read.", minimum=0)
    every_step: bool = field(
        "It read in (about) every watched step: the training step's own; false: evaluation or logging "
        "that runs every few steps."
    )


@dataclass(kw_only=True)
class Syncs:
    """Host reads of device values (syncs on a GPU)."""

    per_step: float = field("Syncs per training step, of the sites that read in every watched step.", minimum=0)
    method: Literal["tensor-reads", "cuda-sync-debug"] = field()
    real: bool = field("True on a GPU (the syncs happened); false on a CPU (they would happen on a GPU).")
    watched_steps: int = field(minimum=1)
    sites: list[SyncSite] = field()
    cuda_debug: str | None = field()


@dataclass(kw_only=True)
class Utilisation:
    """The FLOPs achieved against the device's peak."""

    achieved_flops_per_s: float = field(minimum=0)
    peak_flops_per_s: float | None = field(minimum=0)
    fraction: float | None = field(minimum=0)
    peak_source: str = field()


@dataclass(kw_only=True)
class Bound:
    """What bounds the step, and why."""

    kind: Literal["overhead", "compute", "data"] = field()
    reason: str = field()


@dataclass(kw_only=True)
class Here:
    """The step as measured on this device."""

    device: str = field()
    name: str = field()
    step_s: float = field(minimum=0)
    steady_s: float = field(
        "step_s less the time its threads waited for cores (a busy machine); else step_s.", minimum=0
    )


@dataclass(kw_only=True)
class Estimate:
    """The step estimated on one GPU in one dtype."""

    gpu: str = field()
    dtype: Dtype = field()
    step_s: float = field(minimum=0)
    host_s: float = field(minimum=0)
    device_s: float = field(minimum=0)
    bound: Literal["host", "device"] = field()
    speedup: float = field(
        "here.steady_s over the estimate (> 1: the GPU is faster): the figure the verdict judges by.", minimum=0
    )


@dataclass(kw_only=True)
class Gpu:
    """One datasheet row of the advisor's GPU table."""

    name: str = field()
    fp32_tflops: float = field(minimum=0)
    bf16_tflops: float | None = field(minimum=0)
    fp16_tflops: float = field(minimum=0)
    memory_gbps: float = field(minimum=0)
    launch_us: float = field(minimum=0)
    source: str = field()


@dataclass(kw_only=True)
class Advisor:
    """Would this step run faster on a GPU?"""

    here: Here = field()
    reference_gpu: str = field()
    estimates: list[Estimate] = field()
    verdict: str = field(minLength=1)
    assumptions: str = field()
    gpus: list[Gpu] = field()


@dataclass(kw_only=True)
class Finding:
    """One thing to change, with the time it would save."""

    id: FindingId = field()
    title: str = field(minLength=1)
    evidence: str = field(minLength=1)
    fix: str = field(minLength=1)
    saved_s: float = field(
        "Estimated seconds saved per step on this device (0: the issue costs nothing here).", minimum=0
    )
    saved_share: float = field(minimum=0)
    saved_on_gpu_s: float | None = field(
        "Estimated seconds saved per step on the reference GPU, where that differs.", minimum=0
    )


@dataclass(kw_only=True)
class DoctorResult:
    """`ampkit doctor --json`: where a training step's time goes, and what to change."""

    schema_version: Literal[1] = field()
    ampkit_version: str = field()
    torch: str = field()
    subject: Subject = field()
    device: Device = field()
    steps: Steps = field()
    step: Step = field()
    phases: list[PhaseTime] = field(minItems=len(PHASES) + 1, maxItems=len(PHASES) + 1)
    ops: Ops = field()
    syncs: Syncs = field()
    utilisation: Utilisation = field()
    bound: Bound = field()
    advisor: Advisor = field()
    findings: list[Finding] = field("Ranked: most time saved on this device first, then most saved on the GPU.")
    notes: list[str] = field()


DOCTOR_SCHEMA: dict[str, Any] = contract(DoctorResult, "doctor-v1", "ampkit doctor")


def validate_result(result: dict[str, Any], schema: dict[str, Any] = DOCTOR_SCHEMA) -> None:
    """Raise `ampkit.tools.records.Invalid` (a ValueError naming the field) if `result` breaks `schema`."""
    validate(result, schema, noun="result")


def read_result(result: dict[str, Any]) -> DoctorResult:
    """`result` (checked) as typed records."""
    validate_result(result)
    return build(DoctorResult, result)
