"""The doctor's findings: what to change, ranked by the time it should save, each with its evidence.

Each rule reads the result under construction and returns a `Finding` or nothing: what was seen, what
to do, and the saving per step here and, where it differs, on the reference GPU (a `loss.item()` costs
nothing on a CPU and a step's overlap on a GPU). The sync rule, one finding per reading line, is in
`sync_findings`; the `Finding` record in `finding`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ampkit.tools.doctor.perf import advisor
from ampkit.tools.doctor.perf.finding import Finding
from ampkit.tools.doctor.perf.sync_findings import syncs
from ampkit.tools.timing import check_load, describe_load
from ampkit.util.present import article, count, flops, percent, seconds, size, times

if TYPE_CHECKING:  # the rules read its figures: `gpu` (the reference GPU), `device_gpu`, `loaders`, ...
    from ampkit.tools.doctor.perf.analysis import Analysis

#: Data wait worth a finding, as a share of the step.
DATA_SHARE = 0.10

#: Below this share of the device's measured matmul peak, the batch is too small for the device.
LOW_UTILISATION = 0.10

#: The least one eager op costs beyond its arithmetic, µs (Python and dispatch on a CPU, the launch on
#: a GPU): a step whose work needs less than its ops' count times this is overhead-bound.
OP_FIXED_US = 5.0

#: Share of per-op overhead that fusing or a bigger batch is assumed to remove: an estimate to rank by.
OVERHEAD_REMOVED = 0.5


def diagnose(result: dict[str, Any], ctx: Analysis) -> list[dict[str, Any]]:
    """All findings for `result` as dicts (`DOCTOR_SCHEMA`), ranked: most time saved here first, then on a GPU."""
    found = [
        rule(result, ctx) for rule in (data_wait, busy_threads, overhead_bound, small_batch, micro_batches, precision)
    ]
    ranked = [f for f in found if f is not None] + syncs(result, ctx)
    ranked.sort(key=lambda f: (-f.saved_s, -(f.saved_on_gpu_s or 0.0)))
    return [f.as_dict(result["step"]["host_s"]) for f in ranked]


def _on_cpu(result: dict[str, Any]) -> bool:
    return result["device"]["device"] == "cpu"


# --- data -------------------------------------------------------------------------------------------
def data_wait(result: dict[str, Any], ctx: Analysis) -> Finding | None:
    data = next(p for p in result["phases"] if p["name"] == "data")
    if data["share"] < DATA_SHARE:
        return None
    workers = max((w for w, _ in ctx.loaders), default=0)
    pinned = bool(ctx.loaders) and all(p for _, p in ctx.loaders)
    suggest = max(2, min(8, (os.cpu_count() or 2)))
    if workers == 0:
        fix = (
            f"load batches in background processes: DataLoader(..., num_workers={suggest}, "
            f"persistent_workers=True) — the workers run __getitem__ while the step trains"
        )
        k = suggest
    else:
        fix = (
            f"raise num_workers above {workers} (or prefetch_factor), or make __getitem__ cheaper: cache "
            f"decoded samples, batch the work (a BatchSampler), move augmentation to the device"
        )
        k = 2 * workers
    if not _on_cpu(result) and not pinned:
        fix += "; pin_memory=True lets the host→device copy overlap compute"
    # k workers hide loading as long as each batch is ready before the step needs it.
    saved = data["seconds"] - max(0.0, data["seconds"] / k - ctx.compute_s)
    return Finding(
        id="data-wait",
        title=f"{data['share']:.0%} of the step waiting for data",
        evidence=(
            f"the DataLoader's next() took {seconds(data['seconds'])} of a {seconds(result['step']['host_s'])} "
            f"step (num_workers={workers}, pin_memory={pinned}); the model waits for every batch"
        ),
        fix=fix,
        saved_s=max(0.0, saved),
    )


# --- threads ------------------------------------------------------------------------------------
#: Kernel ops taking this many times longer than their work and fixed cost explain is not slowness
#: of the arithmetic: the threads of parallel ops are waiting for a core.
STALLED_RATIO = 10.0

#: One thread doing a matmul this many times faster than torch's thread count: the extra threads
#: wait for cores more than they help.
THREADS_SLOWER = 1.5


def stall_time(
    kernel_s: float, work_s: float | None, ops_per_step: float, thread_peaks: dict[int, float], *, on_cpu: bool
) -> float:
    """Seconds per step a CPU's kernel ops spend with threads waiting for cores (0 where nothing says so):
    kernel ops `STALLED_RATIO` times slower than their work and dispatch need, or one thread running a
    matmul `THREADS_SLOWER` times faster than all of them."""
    if not on_cpu:
        return 0.0
    stalls = [0.0]
    if work_s is not None:
        expected = max(work_s, ops_per_step * OP_FIXED_US * 1e-6)
        if kernel_s >= STALLED_RATIO * expected:
            stalls.append(kernel_s - expected)
    one, many = thread_peaks.get(1), thread_peaks.get(max(thread_peaks, default=1))
    if one and many and len(thread_peaks) > 1 and one >= THREADS_SLOWER * many:
        stalls.append(kernel_s * (1 - many / one))
    return max(stalls)


def busy_threads(result: dict[str, Any], ctx: Analysis) -> Finding | None:
    if ctx.stall_s <= 0:
        return None
    ops = result["ops"]
    threads = result["device"]["threads"]
    look = check_load(measure=False)  # the one load rule compare and info --bench use
    cores = look.cores
    load = describe_load(look) or f"{cores} cores"
    evidence = [f"kernel ops take {seconds(ctx.kernel_s)} per step"]
    if ctx.work_s is not None:
        evidence.append(
            f"their FLOPs and bytes need ~{seconds(ctx.work_s)} at this CPU's best measured speed and "
            f"their dispatch ~{seconds(ops['per_step'] * OP_FIXED_US * 1e-6)}"
        )
    if len(ctx.thread_peaks) > 1:
        evidence.append(
            "fp32 matmul "
            + " vs ".join(
                f"{flops(v)} on {n} thread{'s' if n > 1 else ''}"
                for n, v in sorted(ctx.thread_peaks.items(), reverse=True)
            )
        )
    evidence.append(f"torch uses {threads} threads, {load}")
    free = max(1, min(threads - 1, cores - 1))
    expected = ctx.kernel_s - ctx.stall_s
    return Finding(
        id="busy-threads",
        title=(
            f"ops run ~{times(ctx.kernel_s / expected)} slower than they can here: threads waiting for cores"
            if expected > 0
            else "ops spend their time with threads waiting for cores"
        ),
        evidence="; ".join(evidence),
        fix=(
            f"torch.set_num_threads({free}) (or OMP_NUM_THREADS={free}) so parallel ops never wait for a "
            f"descheduled thread, or run on an idle machine; then run the doctor again — the other findings "
            f"measure this busy state"
        ),
        saved_s=ctx.stall_s,
    )


# --- overhead -----------------------------------------------------------------------------------
def overhead_bound(result: dict[str, Any], ctx: Analysis) -> Finding | None:
    if result["bound"]["kind"] != "overhead":
        return None
    ops, adv = result["ops"], result["advisor"]
    # Time the work does not explain: outside kernels, or inside them beyond their FLOPs and bytes.
    overhead = max(0.0, ctx.compute_s - max(ctx.work_s or 0.0, min(ctx.kernel_s, ctx.compute_s)))
    best_gpu = min((e for e in adv["estimates"] if e["gpu"] == ctx.gpu.name), key=lambda e: e["step_s"])
    no_gpu = best_gpu["speedup"] < 1.2 and _on_cpu(result)
    bigger = _split_fix(ctx) or "raise the batch size (the same ops then do more work each)"
    fix = (
        f"{bigger}; or cut the per-op overhead: torch.compile(model) fuses ops into fewer kernels; on a GPU, CUDA "
        "graphs replay a step with one launch"
    )
    if no_gpu:
        fix += (
            f" — a GPU will not beat this CPU here (device advisor: {article(ctx.gpu.name)} {ctx.gpu.name} "
            f"~{seconds(best_gpu['step_s'])} per step)"
        )
    return Finding(
        id="overhead-bound",
        title=f"overhead-bound: {count(ops['per_step'])} kernels/step at {seconds(ops['mean_us'] * 1e-6)}",
        evidence=result["bound"]["reason"]
        + (
            f"; {seconds(overhead)} of the {seconds(ctx.compute_s)} compute time is outside kernels" if overhead else ""
        ),
        fix=fix,
        saved_s=OVERHEAD_REMOVED * overhead,
    )


def small_batch(result: dict[str, Any], ctx: Analysis) -> Finding | None:
    util = result["utilisation"]
    if util["fraction"] is None or util["fraction"] >= LOW_UTILISATION:
        return None
    samples = result["step"]["samples"]
    per = f"{count(samples)} samples per step, " if samples else ""
    overhead = max(0.0, ctx.compute_s - ctx.kernel_s)
    return Finding(
        id="small-batch",
        title=f"the batch fills {percent(util['fraction'])} of the device",
        evidence=(
            f"{per}{flops(util['achieved_flops_per_s'])} achieved vs {flops(util['peak_flops_per_s'])} "
            f"measured matmul peak here ({util['peak_source']})"
        ),
        fix=_split_fix(ctx)
        or (
            "raise the batch size (and the learning rate with it) until the step time starts to grow with it: "
            "per-step overhead is then spread over more samples (the saving is per sample)"
        ),
        saved_s=OVERHEAD_REMOVED * overhead,
    )


def _split_fix(ctx: Analysis) -> str | None:
    """Where `acc.split` runs the batch as smaller micro-batches, the size the device sees is the micro-batch's."""
    micro = ctx.acc.micro
    if not micro.enabled or micro.size is None or micro.size >= micro.rows:
        return None
    sees = f"each batch of {count(micro.rows)} rows runs as micro-batches of {count(micro.size)}"
    if micro.setting == "auto":
        within = f"memory={size(micro.memory)}" if micro.memory else "the device's free memory"
        return (
            f"{sees} (micro_batch='auto' within {within}): larger ones need more memory: raise memory=, or use a "
            f"precision that needs less (ampkit plan shows each one's largest batch)"
        )
    halved = ", halved after out-of-memory errors" if micro.halvings else ""
    return (
        f"{sees} (micro_batch={micro.setting}{halved}): raise micro_batch= while it fits (ampkit plan shows each "
        f"precision's largest batch)"
    )


def micro_batches(result: dict[str, Any], ctx: Analysis) -> Finding | None:
    """Out-of-memory errors that halved `acc.split`'s micro-batch: each reran a whole batch."""
    micro = ctx.acc.micro
    if not micro.enabled or not micro.halvings or micro.size is None:
        return None
    planned = f"; micro_batch='auto' had planned: {micro.planned}" if micro.planned else ""
    why = (
        "the plan's budget was more than the device had free while training (another process, a cache): pass a "
        "lower memory= or "
        if micro.setting == "auto"
        else ""
    )
    return Finding(
        id="micro-batch",
        title=f"{count(micro.halvings)} out-of-memory error(s) halved the micro-batch to {count(micro.size)} rows",
        evidence=f"{count(micro.halvings)} of {count(micro.batches)} batches split so far were rerun from their "
        f"start at half the size{planned}",
        fix=f"{why}start at the size that fits: Accelerator(micro_batch={micro.size}) (a checkpoint keeps it)",
        saved_s=result["step"]["host_s"] * min(1.0, micro.halvings / max(1, micro.batches)),
    )


# --- precision ----------------------------------------------------------------------------------
def _ratio(ctx: Analysis, dtype: str) -> float | None:
    """Measured matmul throughput of `dtype` over fp32 here, or None."""
    return ctx.peaks[dtype] / ctx.peaks["fp32"] if dtype in ctx.peaks and ctx.peaks.get("fp32") else None


def precision(result: dict[str, Any], ctx: Analysis) -> Finding | None:
    ops, dev = result["ops"], result["device"]
    step = result["step"]["host_s"]
    matmul_s = ops["matmul_share"] * ctx.kernel_s
    share = matmul_s / step if step > 0 else 0.0
    where_ = "this CPU" if _on_cpu(result) else "this GPU"
    gpu_fp32 = advisor.estimate(ctx.work, ctx.gpu, "fp32")
    gpu_mixed = advisor.estimate(ctx.work, ctx.gpu, advisor.mixed_dtype(ctx.gpu))
    on_gpu = (
        f"on {article(ctx.gpu.name)} {ctx.gpu.name}, {advisor.mixed_dtype(ctx.gpu)}-mixed would take the step from "
        f"~{seconds(gpu_fp32.step_s)} to ~{seconds(gpu_mixed.step_s)} (est.)"
    )
    r = _ratio(ctx, "bf16")
    if dev["precision"] == "fp32":
        if dev["bf16_fast"] and r and r > 1:
            speedup = 1 / ((1 - share) + share / r)
            return Finding(
                id="precision",
                title=f"matmul/conv share {share:.0%} → bf16-mixed should give ~{speedup:.2g}× here",
                evidence=f"bf16 matmuls measured {r:.2g}× fp32 on {where_}; matmul/conv/attention kernels take "
                f"{seconds(matmul_s)} of the {seconds(step)} step",
                fix="Accelerator(precision='bf16-mixed'), or 'auto' which picks it on this hardware",
                saved_s=step * (1 - 1 / speedup),
            )
        slower = f"~{1 / r:.0f}× slower than fp32" if r and r < 1 else "slower than fp32 (no fast bf16 unit)"
        # a ratio above 1 on a device without bf16 units is a busy machine, not a fact
        measured = (
            ""
            if r is None
            else (
                f"; bf16 matmuls measured {r:.2g}× fp32 here"
                if r < 1
                else f"; the matmul benchmark was inconclusive here (bf16 {r:.2g}× fp32: a busy machine?)"
            )
        )
        return Finding(
            id="precision",
            title=f"matmul/conv share {share:.0%}, but bf16 is {slower} on {where_}: stay on fp32",
            evidence=f"{where_} has no fast bf16 ({dev['name']}){measured}; {on_gpu}",
            fix=(
                "keep precision='auto' (fp32 here); bf16-mixed pays on a GPU with bf16 (compute capability 8.0+) "
                "or a CPU with AMX/AVX512-BF16"
            ),
            saved_s=0.0,
            saved_on_gpu_s=max(0.0, gpu_fp32.step_s - gpu_mixed.step_s),
        )
    dtype = "bf16" if "bf16" in dev["precision"] else "fp16"
    r_low = _ratio(ctx, dtype)
    if (dtype == "bf16" and dev["bf16_fast"] is False) or (r_low is not None and r_low < 1):
        saved = matmul_s * (1 - r_low) if r_low is not None and r_low < 1 else 0.0
        return Finding(
            id="precision",
            title=f"{dev['precision']} runs matmuls ~{1 / r_low:.0f}× slower than fp32 on {where_}"
            if r_low
            else f"{dev['precision']} has no fast unit on {where_}",
            evidence=(
                f"{dtype} matmuls measured {r_low:.2g}× fp32 here; matmul/conv/attention kernels take "
                f"{seconds(matmul_s)} of the {seconds(step)} step"
                if r_low
                else f"{where_} has no fast {dtype} ({dev['name']})"
            ),
            fix="Accelerator(precision='auto') picks fp32 here; keep the low precision for a device that runs it fast",
            saved_s=saved,
        )
    return None
