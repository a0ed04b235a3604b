"""`measure(task)`: train a built-in task in fp32, export it in each precision and backend, and measure
what each buys (latency, file size, peak memory) and costs (the held-out metric), side by side.

Latency is the median over interleaved rounds (every export timed once per round, in turn), so that
a machine whose speed drifts (other work, frequency scaling) drifts for all of them alike.
"""

from __future__ import annotations

import functools
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal, cast

import torch

from ampkit.accelerator import Accelerator
from ampkit.hardware.capability import capability, describe, proc_field
from ampkit.inference import PRECISIONS, RUNTIME, SUFFIX, Exported, export, load
from ampkit.tools.export.report import InferenceReport, InferenceRow, Precision, check_out, verdict, write
from ampkit.tools.tasks import get_task
from ampkit.tools.timing import interleaved
from ampkit.util.processes import die_with_parent

#: CPU flags of int8 dot-product instructions (VNNI, AMX), as Linux names them in /proc/cpuinfo.
INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
TOLERANCE = 1.0  # metric change (pp of accuracy, % of perplexity) within which an export counts as lossless
PROGRESS_EVERY_S = 10.0  # the longest a phase (training, the timing rounds) goes without a progress line
_Key = tuple[str, str, str]  # (backend, precision, "1" or "n"): a timed call


def _quiet(message: str) -> None:
    """`measure`'s default `progress`: say nothing."""


class _Ticker:
    """`progress(message)` at most every `PROGRESS_EVERY_S` seconds (the first call waits that long too)."""

    def __init__(self, progress: Callable[[str], None]) -> None:
        self.progress = progress
        self.last = time.monotonic()

    def __call__(self, message: str) -> None:
        if time.monotonic() - self.last >= PROGRESS_EVERY_S:
            self.progress(message)
            self.last = time.monotonic()


def int8_flags(cpuinfo: str | None = None) -> list[str] | None:
    """The `INT8_FLAGS` this CPU has, or None where /proc/cpuinfo has no x86 flags line."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags = proc_field(cpuinfo, "flags")
    return None if flags is None else [f for f in INT8_FLAGS if f in flags.split()]


def auto_choice(device: torch.device | str = "cpu") -> tuple[Precision, str]:
    """The precision to serve in on `device`, and why, from the capability table: int8 on CPUs with
    VNNI/AMX int8 instructions, else bf16 where bf16 is fast, else fp16/bf16 on GPUs, else fp32."""
    device = torch.device(device)
    support = capability(device)
    if device.type != "cpu":
        if support.bf16_fast:
            return (
                "bf16",
                f"{support.device} runs bf16 in hardware ({support.source}): no overflow risk, half the bytes",
            )
        if support.fp16_fast:
            return "fp16", f"{support.device} runs fp16 in hardware ({support.source})"
        return "fp32", f"{support.device} has no fast bf16 or fp16 ({support.source})"
    have = int8_flags()
    if have is None:
        return "fp32", "CPU flags could not be read (no x86 flags line in /proc/cpuinfo): fp32"
    if have:
        return "int8", f"CPU has {' and '.join(have)}: int8 dot-product instructions for int8 linear layers"
    if support.bf16_fast:
        return "bf16", f"{support.device}: bf16 matmul instructions, but no VNNI/AMX int8 ones"
    return "fp32", (
        "CPU has neither VNNI/AMX int8 instructions nor avx512_bf16/amx_bf16: int8 and bf16 gain little or lose here"
    )


def _median_times(
    calls: Mapping[_Key, tuple[Callable[[], object], int]], rounds: int, progress: Callable[[str], None] = _quiet
) -> dict[_Key, float]:
    """Median seconds per call of each `(call, repeats)`, timed `repeats` times per round, in turn
    (`ampkit.tools.timing.interleaved`)."""
    for call, _ in calls.values():
        call()  # warm-up
    tick = _Ticker(progress)
    repeated = {key: functools.partial(_repeat, call, repeats) for key, (call, repeats) in calls.items()}
    times = interleaved(repeated, rounds, on_round=lambda r: tick(f"timing: round {r + 1} of {rounds}"))
    return {key: statistics.median(v) / calls[key][1] for key, v in times.items()}


def _repeat(call: Callable[[], object], times: int) -> None:
    for _ in range(times):
        call()


MEMORY_METHOD = (
    "peak RSS of a fresh process (Linux VmHWM) while it loads the file and runs one throughput batch, "
    "minus its RSS just before (after a warm-up with the same runtime's fp32 export on 2 rows, so that "
    "the runtime's own lazy imports are not counted)"
)


def peak_child(path: str, shape: str, dtype: str, warm: str) -> None:
    """In a fresh process: print the RSS growth (bytes) of loading `path` and running a zero batch."""
    die_with_parent()
    x = torch.zeros([int(n) for n in shape.split(",")], dtype=getattr(torch, dtype))
    load(warm).run(x[:2])

    def status(key: str) -> int:
        value = proc_field(Path("/proc/self/status").read_text(), key)
        assert value is not None  # Linux's /proc/self/status has VmRSS and VmHWM
        return int(value.split()[0]) * 1024

    before = status("VmRSS")
    load(path).run(x)
    print(status("VmHWM") - before)


def _peak_rss(path: Path, batch: torch.Tensor, warm: Path) -> int | None:
    """`peak_child` for `path` in a subprocess (None where /proc is missing or it fails)."""
    if not Path("/proc/self/status").exists():
        return None
    code = "import sys; from ampkit.tools.export.measure import peak_child; peak_child(*sys.argv[1:])"
    shape = ",".join(map(str, batch.shape))
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(path), shape, str(batch.dtype).split(".")[1], str(warm)],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split()
    return int(lines[-1]) if done.returncode == 0 and lines and lines[-1].isdigit() else None


@torch.no_grad()
def _predictions(run: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
    return torch.cat([run(x).argmax(-1).flatten() for x in inputs.split(256)])


def measure(
    task: str = "digits-cnn",
    precisions: Sequence[str] = PRECISIONS,
    backends: Sequence[str] = ("torch", "onnx"),
    out: str | Path | None = None,
    *,
    steps: int | None = None,
    seed: int = 0,
    rounds: int = 7,
    throughput_batch: int | None = None,
    threads: int | None = None,
    progress: Callable[[str], None] = _quiet,
) -> InferenceReport:
    """Train `task` in fp32 (`steps`, default the task's), export it in each of `precisions` with each of
    `backends` and measure every export against the same runtime's fp32 export and the fp32 PyTorch model.

    With `out`, writes `out/inference.json` and `out/inference.txt` (and the exports, in `out/exports/`).
    An export that cannot be made (a precision a backend does not run, a missing extra) is a row that
    says why; the others are measured anyway. `threads`: intra-op threads of both runtimes (default:
    torch's current setting), set for the measurement only. `progress(message)` hears each phase as it starts
    (training, each export, the timing, each memory probe), and a long one every `PROGRESS_EVERY_S` seconds.
    """
    for name, value in (("rounds", rounds), ("throughput_batch", throughput_batch), ("threads", threads)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r}: expected an integer >= 1")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        return _measure(task, precisions, backends, out, steps, seed, rounds, throughput_batch, progress)
    finally:
        torch.set_num_threads(previous)


def _measure(
    task: str,
    precisions: Sequence[str],
    backends: Sequence[str],
    out: str | Path | None,
    steps: int | None,
    seed: int,
    rounds: int,
    throughput_batch: int | None,
    progress: Callable[[str], None],
) -> InferenceReport:
    if not precisions or any(p not in PRECISIONS for p in precisions):
        raise ValueError(f"precisions={list(precisions)!r}: expected some of {', '.join(PRECISIONS)}")
    if not backends or any(b not in RUNTIME for b in backends):
        raise ValueError(f"backends={list(backends)!r}: expected some of {', '.join(RUNTIME)}")
    the_task = get_task(task)  # an unknown task fails before training
    if steps is not None and (not isinstance(steps, int) or steps < 0):
        raise ValueError(f"steps={steps!r}: expected an integer >= 0 (fp32 training steps before the export)")
    check_out(out)  # a folder with someone else's inference.json fails before training too
    order = ["fp32"] + [p for p in precisions if p != "fp32"]  # fp32 is every runtime's reference
    steps = the_task.default_steps if steps is None else steps
    # The model trained `steps` optimizer steps in fp32 on the CPU (an Accelerator that reads no AMPKIT_*).
    acc = Accelerator(precision="fp32", device="cpu", grad_accum_steps=1, compile=False)
    model = the_task.make_model(seed)
    data = the_task.make_data(seed, the_task.default_batch_size)
    optimizer = the_task.make_optimizer(model.parameters(), the_task.default_lr)
    model, optimizer, loader = acc.prepare(model, optimizer, data.train_loader)
    progress(f"training {task} in fp32: {steps} steps")
    tick = _Ticker(progress)
    for done, _ in zip(range(steps), the_task.training(acc, model, optimizer, loader)):
        tick(f"training: step {done + 1} of {steps}")
    folder = Path(out) / "exports" if out is not None else Path(tempfile.mkdtemp(prefix="ampkit-inference-"))
    inputs = data.eval_inputs
    batch_n = min(throughput_batch or 256, len(inputs))
    reference = fp32_metric = the_task.evaluate(model, data, "cpu")[the_task.metric]
    with torch.no_grad():
        eager = _predictions(lambda x: model(x).float(), inputs)
    exports: dict[tuple[str, str], Exported] = {}
    rows: dict[tuple[str, str], InferenceRow] = {}
    planned = [(backend, precision) for backend in backends for precision in order]
    for n, (backend, precision) in enumerate(planned, 1):
        progress(
            f"exporting {precision} with {RUNTIME[backend]} ({n} of {len(planned)}) and checking its {the_task.metric}"
        )
        rows[backend, precision] = row = InferenceRow(
            precision=cast(Precision, precision),  # checked against PRECISIONS and RUNTIME above
            backend=cast(Literal["torch", "onnx"], backend),
            runtime=RUNTIME[backend],
        )
        try:
            exported = export(
                model,
                inputs[:batch_n],
                precision,
                backend,
                folder / f"{task}-{precision}{SUFFIX[backend]}",
                acc=acc,
            )
        except (ValueError, ImportError) as err:
            row.error = re.sub(r"\s+", " ", str(err))
            continue
        exports[backend, precision] = exported
        row.size_bytes = exported.size_bytes
        row.metric = the_task.evaluate(exported.as_module(), data, "cpu")[the_task.metric]
        ratio = row.metric - reference if the_task.metric == "accuracy" else row.metric / reference - 1
        row.metric_change = ratio * 100
        one_output = cast(Callable[[torch.Tensor], torch.Tensor], exported.run)  # a task's model returns one tensor
        row.agreement = (_predictions(one_output, inputs) == eager).float().mean().item()  # sync: a report figure
    one, many = inputs[:1], inputs[:batch_n]
    calls = {
        (*k, b): ((lambda e=e, x=x: e.run(x)), n)
        for k, e in exports.items()
        for b, x, n in (("1", one, 10), ("n", many, 1))
    }
    progress(f"timing {len(exports)} exports at batch 1 and {batch_n}: {rounds} interleaved rounds")
    medians = _median_times(calls, rounds, progress)
    for (backend, precision), row in rows.items():
        if (backend, precision) not in exports:
            continue
        row.latency_b1_s, row.latency_batch_s = medians[backend, precision, "1"], medians[backend, precision, "n"]
        progress(f"peak memory of {precision} ({RUNTIME[backend]}): a fresh process loads it and runs a batch")
        row.peak_rss_bytes = _peak_rss(
            exports[backend, precision].path, many, exports.get((backend, "fp32"), exports[backend, precision]).path
        )
        base = rows[backend, "fp32"]
        if base.latency_b1_s is not None and precision != "fp32":
            assert base.latency_batch_s is not None and base.size_bytes is not None and row.size_bytes is not None
            row.speedup_b1 = base.latency_b1_s / row.latency_b1_s
            row.speedup_batch = base.latency_batch_s / row.latency_batch_s
            row.smaller = base.size_bytes / row.size_bytes
    tolerable = [
        r
        for r in rows.values()
        if r.latency_batch_s is not None
        and r.metric_change is not None  # a timed row was exported and evaluated
        and math.isfinite(r.metric_change)
        and (-r.metric_change if the_task.higher_is_better else r.metric_change) <= TOLERANCE
    ]
    best = min(tolerable, key=lambda r: cast(float, r.latency_batch_s), default=None)  # tolerable rows were timed
    auto, reason = auto_choice("cpu")
    report = InferenceReport(
        task=task,
        metric=the_task.metric,
        higher_is_better=the_task.higher_is_better,
        device="cpu",
        device_name=describe(torch.device("cpu"))["device_name"],
        threads=torch.get_num_threads(),
        steps=steps,
        throughput_batch=batch_n,
        rounds=rounds,
        memory_method=MEMORY_METHOD,
        fp32_metric=fp32_metric,
        auto_precision=auto,
        auto_reason=reason,
        measured_best=f"{best.precision} ({best.runtime})" if best else None,
        rows=list(rows.values()),
    )
    for row in report.rows:
        row.verdict = verdict(report, row)
    if out is not None:
        write(report, Path(out))
    return report
