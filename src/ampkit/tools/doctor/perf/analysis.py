"""From a finished session's measurements to the result (`DOCTOR_SCHEMA`): figures, bound, advice.

The profiled steps give the ops, the share of the step inside them (both slowed alike) and the syncs;
the timed steps the step and phase times (medians). This device's matmul peaks and copy bandwidth say
how long the step's work *needs* here, which separates slow arithmetic from overhead and from threads
waiting for cores; a *peak* is the fastest of a few repeats (a stall only makes a repeat slower).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ampkit.hardware.capability import capability, describe
from ampkit.precision.policy import short_dtype_name
from ampkit.tools.doctor.perf import advisor, findings
from ampkit.tools.doctor.perf.ops import OpStats, analyse
from ampkit.tools.doctor.perf.schema import PHASES
from ampkit.tools.timing import copy_bandwidth, matmul_rate
from ampkit.util.present import article, seconds, times
from ampkit.util.version import ampkit_version

if TYPE_CHECKING:
    from ampkit.tools.doctor.perf.session import DoctorSession

#: A step is overhead-bound when its kernels fill less than this share of its compute time.
OVERHEAD_BOUND_SHARE = 0.5

#: A step is data-bound when waiting for the loader takes at least this share of it.
DATA_BOUND_SHARE = 0.5

#: Seconds the doctor spends measuring this device's matmul peaks (all dtypes and thread counts).
BENCH_SECONDS = 0.8

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: Matrix size per device type: big enough to reach the arithmetic units' speed, small enough that
#: a dtype without fast units (bf16 on an AVX2 CPU: ~50× slower) still takes well under a second.
SIZE = {"cpu": 256, "cuda": 4096, "mps": 2048}


def matmul_peaks(device: torch.device, dtype: torch.dtype, seconds: float = 0.3, repeats: int = 5) -> dict[int, float]:
    """{threads: FLOP/s} of the fastest of up to `repeats` n×n matmuls in `dtype` (within ~`seconds`), at
    torch's thread count and, on a CPU using several, at one: on a busy machine a multi-threaded matmul
    waits for its slowest thread to get a core, and the two figures side by side show it."""
    n = SIZE.get(device.type, 1024)
    threads = torch.get_num_threads()
    counts = [threads, 1] if device.type == "cpu" and threads > 1 else [threads]
    peaks = {}
    for k in counts:
        torch.set_num_threads(k)
        try:
            peaks[k] = matmul_rate(device, dtype, seconds / len(counts), sizes=(n, n), repeats=repeats).per_s
        finally:
            torch.set_num_threads(threads)
    return peaks


class Analysis:
    """The figures of one finished session (which the findings read), and the result built from them."""

    def __init__(self, session: DoctorSession) -> None:
        self.s = session
        self.acc = session.acc
        self.device = session.acc.device
        self.gpu = session.gpu  # the reference GPU; this device's row of the table, when it is a known GPU:
        self.device_gpu = advisor.gpu_for_device(self.device)
        # (num_workers, pin_memory) of each prepared DataLoader
        self.loaders = [(int(dl.loader.num_workers), bool(dl.loader.pin_memory)) for dl in self.acc.loaders]
        self.notes: list[str] = []
        profiled, timed = session.rows["profiled"], session.rows["timed"]
        self.rows = timed or profiled
        if not timed:
            self.notes.append("no unprofiled step ran: times include the profiler's overhead")
        self.measured = len(profiled) + len(timed)
        self.ops: OpStats = analyse(session.profiled_events or [], len(profiled))

        # Step and phases: medians of the timed steps.
        self.host_s = statistics.median(r["host_s"] for r in self.rows)
        self.step_s = self.host_s
        marks = session.cuda_marks
        if self.device.type == "cuda" and len(marks) > 1:
            marks[-1].synchronize()  # sync: once, after the run
            self.step_s = statistics.median(a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:]))
        self.phases = {p: statistics.median(r["phases"][p] for r in self.rows) for p in PHASES}
        self.phases["other"] = max(0.0, self.host_s - sum(self.phases.values()))
        self.compute_s = max(1e-9, self.host_s - self.phases["data"] - self.phases["h2d"])

        # Kernel share: kernel-op time over step time, both from the profiled steps.
        # (every row's times are without the sync watcher's own cost: `PhaseClock.now`)
        prof_compute = statistics.fmean(r["host_s"] - r["phases"]["data"] - r["phases"]["h2d"] for r in profiled)
        self.scale = min(1.0, self.compute_s / prof_compute) if prof_compute > 0 else 1.0  # profiler -> timed
        ops = self.ops
        if ops.cuda_kernels is not None and ops.cuda_kernel_us is not None:  # the device's own account
            device_s = ops.cuda_kernel_us * 1e-6 / ops.steps
            self.kernel_share = min(1.0, device_s / max(1e-9, self.step_s - self.phases["data"]))
        else:
            inside = ops.kernel_us_per_step * 1e-6
            self.kernel_share = min(1.0, inside / prof_compute) if prof_compute > 0 else 0.0
        self.kernel_s = self.kernel_share * self.compute_s

        samples = [r["samples"] for r in self.rows if r["samples"] is not None]
        self.samples = statistics.median(samples) if len(samples) == len(self.rows) else None
        self.batch_bytes = statistics.median(r["batch_bytes"] for r in self.rows)

        syncs = session.syncs
        self.sync_sites = syncs.sites + syncs.cuda_sites
        self.synced_steps = len(profiled) + len(timed)  # the sync watcher watches every measured step
        # A site that read in every watched step (one's slack: a read after a step's end lands in the next)
        # is the training step's; one that read in fewer is evaluation or logging, reported apart.
        self.site_steps = {site: len(syncs.site_steps.get(site, ())) for site in self.sync_sites}
        self.every_step = {site for site, seen in self.site_steps.items() if seen >= max(1, self.synced_steps - 1)}
        every = sum(n for site, n in self.sync_sites.items() if site in self.every_step)
        self.syncs_per_step = every / self.synced_steps

        self.compute_dtype = short_dtype_name(self.acc.policy.compute_dtype)
        self.thread_peaks: dict[int, float] = {}  # fp32 matmul FLOP/s by thread count
        self.peaks: dict[str, float] = {}  # best matmul FLOP/s here by dtype, over thread counts
        self.bandwidth = None
        if session.bench:
            half = self.device.type == "cuda" or self.compute_dtype == "fp16"  # fp16 where it matters
            names = ["fp32", "bf16", "fp16"] if half else ["fp32", "bf16"]
            for name in names:
                by_threads = self._try(
                    f"{name} matmul peak", matmul_peaks, self.device, _DTYPES[name], seconds=BENCH_SECONDS / len(names)
                )
                if by_threads is not None:
                    self.peaks[name] = max(by_threads.values())
                if name == "fp32":
                    self.thread_peaks = by_threads or {}
            self.bandwidth = self._try("memory bandwidth", copy_bandwidth, self.device)
        peak = self.peaks.get(self.compute_dtype)
        # Seconds per step the kernels' arithmetic and memory traffic need at this device's measured speed.
        self.work_s = (
            sum(max(k.flops / peak, k.bytes / self.bandwidth) for k in ops.kernels) / ops.steps
            if peak and self.bandwidth
            else None
        )
        self.stall_s = findings.stall_time(
            self.kernel_s, self.work_s, ops.per_step, self.thread_peaks, on_cpu=self.device.type == "cpu"
        )
        self.work = advisor.Workload(
            host_outside_s=max(0.0, self.host_s - self.kernel_s),
            dispatch_us=min(ops.floor_us * self.scale, advisor.LAUNCH_US),
            ops=ops,
            batch_bytes=self.batch_bytes,
            syncs_per_step=self.syncs_per_step,
        )

    def _try(self, what: str, measure: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return measure(*args, **kwargs)
        except Exception as exc:  # a dtype this device cannot run, no memory for the buffers: "unknown"
            self.notes.append(f"{what} not measured ({type(exc).__name__}: {exc})")
            return None

    # --- the result ---------------------------------------------------------------------------
    def result(self) -> dict[str, Any]:
        s, acc = self.s, self.acc
        share = {p: (v / self.host_s if self.host_s > 0 else 0.0) for p, v in self.phases.items()}
        if self.measured < s.steps:
            self.notes.append(f"the loop ended after {self.measured} of the {s.steps} steps asked for")
        if not acc.loaders:
            self.notes.append("no prepared DataLoader: time spent loading batches is counted in 'other'")
        result: dict[str, Any] = {
            "schema_version": 1,
            "ampkit_version": ampkit_version(),
            "torch": torch.__version__,
            "subject": s.subject,
            "device": {
                "device": str(self.device),
                "name": describe(self.device)["device_name"],
                "threads": torch.get_num_threads(),
                "precision": acc.policy.name,
                "precision_reason": acc.policy.reason,
                "bf16_fast": capability(self.device).bf16_fast,
            },
            "steps": {
                "warmup": s.warmup,
                "profiled": len(s.rows["profiled"]),
                "timed": len(s.rows["timed"]),
                "requested": s.steps,
                "complete": self.measured >= s.steps,
            },
            "step": {
                "time_s": self.step_s,
                "host_s": self.host_s,
                "samples": self.samples,
                "samples_per_s": self.samples / self.step_s if self.samples and self.step_s > 0 else None,
            },
            "phases": [{"name": p, "seconds": self.phases[p], "share": share[p]} for p in (*PHASES, "other")],
            "ops": self._ops(),
            "syncs": self._syncs(),
            "utilisation": self._utilisation(),
            "bound": self._bound(share),
            "advisor": self._advisor(),
            "findings": [],
            "notes": self.notes,
        }
        result["findings"] = findings.diagnose(result, self)
        return result

    def _ops(self) -> dict[str, Any]:
        ops = self.ops
        per_step_cuda = ops.cuda_kernels / ops.steps if ops.cuda_kernels is not None else None
        mean_cuda = (
            ops.cuda_kernel_us / ops.cuda_kernels if ops.cuda_kernels and ops.cuda_kernel_us is not None else None
        )
        return {
            "per_step": ops.per_step,
            "mean_us": ops.mean_us * self.scale,
            "floor_us": ops.floor_us * self.scale,
            "seconds_per_step": self.kernel_s,
            "work_s_per_step": self.work_s,
            "kernel_share": self.kernel_share,
            "flops_per_step": ops.flops_per_step,
            "bytes_per_step": ops.bytes_per_step,
            "matmul_share": ops.matmul_share,
            "profiler_scale": self.scale,
            "cuda_kernels_per_step": per_step_cuda,
            "cuda_kernel_mean_us": mean_cuda,
            "top": [
                dict(row, median_us=row["median_us"] * self.scale, us_per_step=row["us_per_step"] * self.scale)
                for row in ops.top()
            ],
        }

    def _syncs(self) -> dict[str, Any]:
        sites = sorted(self.sync_sites.items(), key=lambda kv: -kv[1])
        debugged = self.device.type == "cuda" and self.s.syncs.cuda_debug is None
        return {
            # reads of device tensors by their method, plus (CUDA) every other op the sync debugger caught
            "per_step": self.syncs_per_step,
            "method": "cuda-sync-debug" if debugged else "tensor-reads",
            "real": self.device.type != "cpu",
            "watched_steps": self.synced_steps,
            "sites": [
                {
                    **dataclasses.asdict(site),
                    "per_step": n / self.synced_steps,
                    "reads": n,
                    "steps_seen": self.site_steps[site],
                    "every_step": site in self.every_step,
                }
                for site, n in sites
            ],
            "cuda_debug": self.s.syncs.cuda_debug,
        }

    def _utilisation(self) -> dict[str, Any]:
        dtype = self.compute_dtype
        achieved = self.ops.flops_per_step / self.compute_s
        peak = self.peaks.get(dtype)
        return {
            "achieved_flops_per_s": achieved,
            "peak_flops_per_s": peak,
            "fraction": min(1.0, achieved / peak) if peak else None,
            "peak_source": (
                f"fastest {dtype} {SIZE.get(self.device.type, 1024)}² matmul measured on {self.device}"
                if peak
                else "unknown (no matmul benchmark)"
            ),
        }

    def _bound(self, share: dict[str, float]) -> dict[str, Any]:
        """data, overhead or compute, with the measured reason (`OVERHEAD_BOUND_SHARE`, `findings.OP_FIXED_US`)."""
        n, mean = self.ops.per_step, self.ops.mean_us * self.scale
        if share["data"] >= DATA_BOUND_SHARE:
            return {"kind": "data", "reason": f"{share['data']:.0%} of the step waits for the data loader"}
        what = "the device's kernels" if self.ops.cuda_kernels is not None else "kernel ops"
        fixed = n * findings.OP_FIXED_US * 1e-6
        if self.stall_s > 0 and self.work_s is not None:
            # Threads waiting for cores make every clock-based share unreliable: judge by the work.
            kind = "overhead" if self.work_s < fixed else "compute"
            return {
                "kind": kind,
                "reason": (
                    f"judged by the work, as this machine is busy (threads waiting for cores): the step's arithmetic "
                    f"and memory traffic need ~{seconds(self.work_s)} at this device's best measured speed, "
                    f"{'less' if kind == 'overhead' else 'more'} than the ~{seconds(fixed)} its {n:.0f} ops cost just "
                    f"to run ({findings.OP_FIXED_US:g} µs each)"
                ),
            }
        if self.kernel_share < OVERHEAD_BOUND_SHARE:
            return {
                "kind": "overhead",
                "reason": (
                    f"{what} fill only {self.kernel_share:.0%} of the compute time ({n:.0f} per step at "
                    f"{seconds(mean * 1e-6)}): the rest is Python, autograd and per-op dispatch"
                ),
            }
        if self.work_s is not None and self.work_s < fixed:
            return {
                "kind": "overhead",
                "reason": (
                    f"the step's arithmetic and memory traffic need ~{seconds(self.work_s)} at this device's measured "
                    f"speed, less than the ~{seconds(fixed)} its {n:.0f} ops cost just to run "
                    f"({findings.OP_FIXED_US:g} µs each); {what} measured {seconds(mean * 1e-6)} each"
                ),
            }
        return {
            "kind": "compute",
            "reason": (
                f"{what} fill {self.kernel_share:.0%} of the compute time ({n:.0f} per step at {seconds(mean * 1e-6)})"
            ),
        }

    def _advisor(self) -> dict[str, Any]:
        here = self.step_s
        estimates = [
            advisor.estimate(self.work, gpu, dtype)
            for gpu in advisor.GPUS.values()
            for dtype in ("fp32", advisor.mixed_dtype(gpu))
        ]
        # Judge against what this CPU does once its threads stop waiting for cores, not against the stall: the
        # table's speed-ups too, so that the verdict is one of its figures.
        steady = max(1e-9, here - self.stall_s)
        rows = [
            {**dataclasses.asdict(e), "speedup": steady / e.step_s if e.step_s > 0 else math.inf} for e in estimates
        ]
        ref = self.s.gpu
        best = min((r for r in rows if r["gpu"] == ref.name), key=lambda r: r["step_s"])
        here_name = "this GPU" if self.device.type == "cuda" else "this CPU"
        ratio = best["speedup"]
        judged = (
            f"should be ~{times(ratio)} faster"
            if ratio >= 1.2
            else ("would be no faster" if ratio > 1 / 1.2 else "would be slower")
        )
        verdict = (
            f"{article(ref.name)} {ref.name} {judged}: ~{seconds(best['step_s'])} per step "
            f"({best['dtype']}, {best['bound']}-bound) vs {seconds(here)} measured on {here_name}"
        )
        if self.stall_s > 0:
            verdict += (
                f" (~{seconds(steady)} once its threads stop waiting for cores; this machine is busy, so "
                f"the host times behind every estimate are too: rerun on an idle machine to trust this)"
            )
        if best["bound"] == "host":
            data = self.phases["data"] > best["host_s"] / 2
            launches = f"{self.ops.per_step:.0f} kernel launches and the Python around them keep"
            verdict += f" — {'the data loader keeps' if data else launches} the device waiting"
        return {
            "here": {
                "device": here_name,
                "name": describe(self.device)["device_name"],
                "step_s": here,
                "steady_s": steady,
            },
            "reference_gpu": ref.name,
            "estimates": rows,
            "verdict": verdict,
            "assumptions": (
                f"host time outside kernels carries over; each kernel costs dispatch + {advisor.LAUNCH_US:g} µs launch"
                f" on the host, and on the device max(FLOPs/peak, bytes/bandwidth, {advisor.MIN_KERNEL_US:g} µs) at"
                f" datasheet peaks (a lower bound); a sync per step adds host and device instead of overlapping them"
            ),
            "gpus": advisor.datasheets(),
        }
