"""`ampkit compare`: train the same thing once per precision and report what each one buys.

Each precision runs in its own process (spawned, so memory figures start clean and nothing leaks
from one run into the next) with the same seed and data order. The child trains with an
Accelerator carrying a `Recorder`, so the loss curve and step times are gathered without a sync
per step, and sends back one run record. The parent shows progress, computes the ratios against
the fp32 baseline and hands the report to `ampkit.report` for the table, JSON, plots and HTML.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import multiprocessing
import pickle
import random
import resource
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ampkit import __version__
from ampkit.accelerator import Accelerator
from ampkit.files import atomic_write
from ampkit.errors import PrecisionError
from ampkit.hardware import auto_precision, capability, describe, resolve_device
from ampkit.precision import PRESETS, resolve_precision
from ampkit.recorder import Recorder, StepListener

TrainFn = Callable[[Accelerator], dict[str, float]]

#: Steps a "probe" run times a preset this hardware runs slowly (no accuracy: it would take too long).
PROBE_STEPS = 8

#: Steps each run's numerics pass watches (`ampkit doctor --numerics` on the same task and seed).
NUMERICS_STEPS = 5


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
    """Everything a child process needs to run one precision (picklable)."""

    precision: str
    device: str
    seed: int
    task: str | None = None
    steps: int | None = None
    batch_size: int | None = None
    train_fn: TrainFn | None = None
    probe: bool = False
    samples_per_step: int | None = None
    checkpoints: str | None = None  # folder to checkpoint into and resume from (built-in tasks)
    nproc: int = 1  # > 1: run under torchrun with this many processes (data parallel)
    numerics_steps: int = 0  # > 0: after the timed run, a pass of this many steps under the numerics doctor


def default_precisions(device: torch.device) -> tuple[list[str], list[str]]:
    """(full runs, timing-only probes) for `device` when the user names no precisions.

    Full: fp32, the `auto` choice and every preset whose compute dtype is fast here. Probe:
    bf16-mixed where bf16 runs but slowly, so the report shows that cost instead of hiding it.
    """
    support = capability(device)
    fast = {torch.float32: True, torch.bfloat16: support.bf16_fast, torch.float16: support.fp16_fast}
    full = ["fp32", auto_precision(device)[0]]
    full += [name for name, p in PRESETS.items() if fast[p.compute_dtype]]
    full = list(dict.fromkeys(full))
    probes = [] if support.bf16_fast or not support.bf16_runs else ["bf16-mixed"]
    return full, probes


def _proc_status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's resident-memory high-water mark to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    """The process's resident-memory high-water mark (VmHWM; ru_maxrss where /proc is missing)."""
    hwm = _proc_status("VmHWM")
    if hwm is not None:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class _Memory:
    """Peak memory of the training alone: CUDA's max allocated, or the peak RSS above a baseline."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.mark()

    def mark(self) -> None:
        """Start measuring here: after imports and data, before the model exists."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        # With the high-water mark reset, the peak above the current RSS is what training added;
        # without it (no /proc), the peak so far is the best baseline there is.
        self._rss_before = _proc_status("VmRSS") if _reset_peak_rss() else _peak_rss_bytes()

    def freeze(self) -> None:
        """Take the reading now: training is over, and evaluation's memory is not training's."""
        self._frozen = self.read()

    def read(self) -> tuple[int, int | None, str]:
        """(figure ratios use, raw peak RSS or None, kind)."""
        if getattr(self, "_frozen", None) is not None:
            return self._frozen
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device), None, "cuda_max_allocated"
        raw = _peak_rss_bytes()
        return raw - self._rss_before, raw, "cpu_peak_rss_delta"


def _train_task(acc: Accelerator, spec: RunSpec, steps: int, memory: _Memory) -> dict[str, float]:
    """The built-in loop: the four-line conversion of a plain loop, run for `steps` optimizer steps."""
    from ampkit.tasks import get_task

    task = get_task(spec.task or "")
    data = task.make_data(spec.seed, spec.batch_size or task.default_batch_size)
    memory.mark()
    model = task.make_model(spec.seed)
    optimizer = task.make_optimizer(model.parameters(), task.default_lr)
    model, optimizer, loader = acc.prepare(model, optimizer, data.train_loader)
    every = max(1, steps // 10)
    if spec.checkpoints is not None:
        acc.resume(spec.checkpoints)
    done = optimizer.attempted_steps  # > 0 when resumed
    for _ in acc.epochs(sys.maxsize):
        if done >= steps:
            break
        for x, y in loader:
            loss = task.loss_fn(model(x), y)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if spec.checkpoints is not None and done % every == 0 and done < steps:
                acc.save_checkpoint(spec.checkpoints, keep=2)
            if done == steps:
                break
    memory.freeze()
    if spec.probe:
        return {}
    return task.evaluate(model, data, acc.device)


def run_one(spec: RunSpec, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Train one precision and return its run record (the `runs[i]` of report.json, before ratios)."""
    device = resolve_device(spec.device)
    _seed_everything(spec.seed)
    memory = _Memory(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = Accelerator(precision=spec.precision, device=device)
    notes = [str(w.message) for w in caught]
    recorder = Recorder(device, on_step=progress)
    acc.events.add(StepListener(acc, recorder))
    steps = spec.steps or 0
    if spec.task is not None and not spec.steps:
        from ampkit.tasks import get_task

        steps = get_task(spec.task).default_steps
    if spec.probe:
        steps = PROBE_STEPS
    start = time.perf_counter()
    if spec.train_fn is not None:
        metrics = dict(spec.train_fn(acc))
    else:
        metrics = _train_task(acc, spec, steps, memory)
    state = acc.state  # waits for the outcomes still in flight: the run is over
    skipped = state.skipped_steps
    wall = time.perf_counter() - start
    warmup = 2 if spec.probe else min(10, recorder.steps // 10)
    summary = recorder.summary(warmup)
    peak, raw, kind = memory.read()
    # After every figure above is taken: the pass's hooks, copies and reads are in none of them.
    numerics = _numerics_pass(spec, device) if spec.numerics_steps and spec.nproc == 1 else None
    resumed_at = acc.optimizers[0].attempted_steps - recorder.steps if acc.optimizers else 0
    if resumed_at > 0:
        notes.append(f"resumed from a checkpoint at step {resumed_at}: the loss curve and timings cover the steps after it")
    policy = acc.policy
    median = summary["step_time_median_s"]
    return {
        "precision": spec.precision,
        "status": "probe" if spec.probe else "ok",
        "reason": "; ".join(notes) or None,
        "policy": {
            "name": policy.name,
            "reason": policy.reason,
            "compute_dtype": str(policy.compute_dtype).removeprefix("torch."),
            "param_dtype": str(policy.param_dtype).removeprefix("torch."),
            "master_weights": policy.master_weights,
            "compensated": policy.compensated,
            "loss_scaling": policy.loss_scaling,
        },
        **summary,
        "skipped_steps": skipped,
        # every process trains a batch per step: the job's throughput is nproc times one rank's
        "samples_per_s": spec.samples_per_step * spec.nproc / median if spec.samples_per_step and median else None,
        "memory_kind": kind,
        "peak_memory_bytes": peak,
        "peak_rss_bytes": raw,
        "eval": {k: float(v) for k, v in metrics.items()},
        "wall_time_s": wall,
        "numerics": numerics,
    }


def _numerics_pass(spec: RunSpec, device: torch.device) -> dict[str, Any]:
    """`spec.numerics_steps` steps of the same training under the numerics doctor, on a fresh model.

    A pass of its own after the timed run, so that the run's step times, peak memory and wall time
    stay those of plain training; the same seed, so it watches the run's first batches. Returns
    `numerics.summarize`'s dict; a failed diagnosis is its `error`, never a failed run.
    """
    from ampkit.doctor import numerics_task, numerics_train_fn, summarize

    _seed_everything(spec.seed)
    steps = spec.numerics_steps
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the run has recorded the Accelerator's warnings already
            if spec.train_fn is not None:
                result = numerics_train_fn(spec.train_fn, steps=steps, precision=spec.precision, device=device)
            else:
                result = numerics_task(spec.task or "", steps=steps, precision=spec.precision, device=str(device),
                                       batch_size=spec.batch_size, seed=spec.seed)
    except Exception as exc:  # noqa: BLE001 - a failed diagnosis is reported beside the run
        return {"steps": 0, "at_risk": [], "keep_fp32": [], "lost_update_share": None, "loss_scale": None,
                "top_finding": None, "problem": None, "error": f"{type(exc).__name__}: {exc}", "detail": None}
    return summarize(result)


def _child(spec: RunSpec, conn: Any) -> None:
    """Entry point of a run's process: stream progress, then send the record or the error."""
    last = [0.0]

    def progress(step: int) -> None:
        now = time.monotonic()
        if now - last[0] > 0.2:
            last[0] = now
            conn.send(("progress", step))

    try:
        conn.send(("done", run_one(spec, progress)))
    except KeyboardInterrupt:
        conn.send(("error", "interrupted"))
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a reported status
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}"))
    finally:
        conn.close()


def _run_isolated(spec: RunSpec, on_progress: Callable[[int], None]) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(spec, child), daemon=True)
    proc.start()
    child.close()
    try:
        while True:
            if parent.poll(0.1):
                try:
                    kind, payload = parent.recv()
                except EOFError:
                    break
                if kind == "progress":
                    on_progress(payload)
                elif kind == "done":
                    return payload
                else:
                    raise _RunFailed(payload)
            elif not proc.is_alive() and not parent.poll():
                break
        raise _RunFailed(f"the run's process died (exit code {proc.exitcode}) before reporting")
    finally:
        if proc.is_alive():
            proc.terminate()
        proc.join(timeout=10)


class _RunFailed(Exception):
    pass


def _run_torchrun(spec: RunSpec, on_progress: Callable[[int], None]) -> dict[str, Any]:
    """Run one precision as `torchrun --nproc-per-node=N -m ampkit._torchrun_compare`; rank 0 reports."""
    with tempfile.TemporaryDirectory(prefix="ampkit-compare-") as tmp:
        spec_file, out_file, progress_file = Path(tmp, "spec.pkl"), Path(tmp, "run.json"), Path(tmp, "progress")
        spec_file.write_bytes(pickle.dumps(spec))  # our own file, read back by our own worker
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={spec.nproc}",
               "-m", "ampkit._torchrun_compare", str(spec_file), str(out_file), str(progress_file)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            while proc.poll() is None:
                time.sleep(0.2)
                with contextlib.suppress(OSError, ValueError):
                    on_progress(int(progress_file.read_text() or 0))
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
        output = proc.stdout.read() if proc.stdout else ""
        if proc.returncode != 0 or not out_file.exists():
            tail = [line for line in output.splitlines() if "Error" in line][-1:] or output.splitlines()[-1:]
            raise _RunFailed(f"torchrun exited with code {proc.returncode}: {tail[0] if tail else 'no output'}")
        return json.loads(out_file.read_text())


def _torchrun_worker(spec_file: str, out_file: str, progress_file: str) -> None:
    """Entry point of each torchrun process: train; rank 0 writes the run record and progress."""
    spec = pickle.loads(Path(spec_file).read_bytes())
    rank = int(os.environ.get("RANK", "0"))
    last = [0.0]

    def progress(step: int) -> None:
        now = time.monotonic()
        if rank == 0 and now - last[0] > 0.2:
            last[0] = now
            Path(progress_file).write_text(str(step))

    run = run_one(spec, progress)
    if rank == 0:
        Path(out_file).write_text(json.dumps(run))


def _blank_run(precision: str, status: str, reason: str, device: torch.device | None = None) -> dict[str, Any]:
    kind = "cuda_max_allocated" if device is not None and device.type == "cuda" else "cpu_peak_rss_delta"
    return {
        "precision": precision, "status": status, "reason": reason, "policy": None,
        "steps": 0, "warmup_steps": 0, "step_time_median_s": None, "samples_per_s": None,
        "speedup_vs_baseline": None, "memory_kind": kind, "peak_memory_bytes": None,
        "peak_rss_bytes": None, "memory_ratio_vs_baseline": None, "loss_curve": [],
        "final_train_loss": None, "eval": {}, "metric": None, "metric_delta_vs_baseline": None,
        "skipped_steps": 0, "scale_history": None, "last_finite_step": None, "wall_time_s": None,
    }


def _finish_run(run: dict[str, Any], metric: str | None) -> None:
    """Derive final loss, headline metric and divergence from a child's raw record."""
    curve = [v if v is not None and math.isfinite(v) else None for v in run["loss_curve"]]
    run["loss_curve"] = curve
    finite = [i for i, v in enumerate(curve) if v is not None]
    run["last_finite_step"] = finite[-1] if finite else None
    tail = [v for v in curve[-max(1, min(20, len(curve) // 10)):] if v is not None]
    run["final_train_loss"] = sum(tail) / len(tail) if tail else None
    value = run["eval"].get(metric) if metric else (next(iter(run["eval"].values()), None))
    run["metric"] = value if value is not None and math.isfinite(value) else None
    run.setdefault("speedup_vs_baseline", None)
    run.setdefault("memory_ratio_vs_baseline", None)
    run.setdefault("metric_delta_vs_baseline", None)
    if run["status"] == "ok" and (not curve or curve[-1] is None or (run["eval"] and run["metric"] is None)):
        run["status"] = "diverged"
        run["reason"] = "the loss became non-finite" + (f" after step {finite[-1]}" if finite else " from the first step")


def _ratios(report: dict[str, Any]) -> None:
    base = next((r for r in report["runs"] if r["precision"] == report["baseline"] and r["status"] == "ok"), None)
    if base is None:
        report["baseline"] = None
        return
    for run in report["runs"]:
        if run["step_time_median_s"] and base["step_time_median_s"]:
            run["speedup_vs_baseline"] = base["step_time_median_s"] / run["step_time_median_s"]
        if run["peak_memory_bytes"] and base["peak_memory_bytes"]:
            run["memory_ratio_vs_baseline"] = run["peak_memory_bytes"] / base["peak_memory_bytes"]
        if run["metric"] is not None and base["metric"] is not None:
            run["metric_delta_vs_baseline"] = run["metric"] - base["metric"]


def compare(
    train_fn: TrainFn | None = None,
    precisions: list[str] | tuple[str, ...] | None = None,
    *,
    task: str | None = None,
    steps: int | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    device: str = "auto",
    out: str | Path | None = None,
    metric: str | None = None,
    samples_per_step: int | None = None,
    isolate: bool = True,
    show: bool = True,
    command: str | None = None,
    resume: bool = False,
    nproc: int = 1,
    numerics: bool = True,
) -> dict[str, Any]:
    """Run `train_fn` (or a built-in `task`) once per precision and return the report dict.

    Args:
        train_fn: `train_fn(acc) -> dict` runs your loop with the given Accelerator (use
            `acc.prepare` and `acc.backward`) and returns its metrics, e.g. {"accuracy": 0.97}.
            With `isolate=True` it must be a module-level function (it is pickled into a fresh
            process, and your script needs an `if __name__ == "__main__":` guard).
        precisions: presets to run; the first is the baseline. Default: fp32, the `auto` choice and
            every preset fast on this hardware, plus a timing-only probe of bf16 where it is slow.
        task: a built-in task name (see `ampkit.tasks.TASKS`) instead of `train_fn`.
        steps, batch_size: override the task's defaults.
        out: folder for report.json, the PNG plots and report.html (None: write nothing).
        metric: which key of `train_fn`'s dict is the headline metric (default: the first key).
        samples_per_step: for `train_fn`, to report samples/s.
        isolate: run each precision in its own process (clean memory figures). False runs in-process.
        resume: continue an interrupted comparison in `out`: finished runs are kept, an unfinished
            built-in-task run resumes from its last checkpoint (they are written to `out` as it trains).
        nproc: run each precision data-parallel under `torchrun --nproc-per-node=nproc` (batch_size
            is per process); figures are rank 0's.
        numerics: after each run (not probes, not with nproc > 1), watch `NUMERICS_STEPS` steps of the
            same training, on a fresh model with the same seed, under the numerics doctor (layers at
            risk, lost updates, loss-scale health): `runs[i].numerics`. A separate pass: the run's
            time and memory figures do not include it.
    """
    if (train_fn is None) == (task is None):
        raise ValueError("compare() needs exactly one of train_fn=... or task='...'")
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps={steps!r}: expected an integer >= 1")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size={batch_size!r}: expected an integer >= 1")
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc={nproc!r}: expected an integer >= 1 (processes per precision)")
    if resume and out is None:
        raise ValueError("resume=True needs out=: the folder of the comparison to continue")
    state_dir = Path(out) / ".compare" if out is not None else None
    if state_dir is not None and not resume:
        shutil.rmtree(state_dir, ignore_errors=True)  # a new comparison: forget an old one's runs
    task_info = None
    if task is not None:
        from ampkit.tasks import get_task

        t = get_task(task)
        metric = t.metric
        batch = batch_size or t.default_batch_size
        samples_per_step = batch
        task_info = {"name": t.name, "metric": t.metric, "higher_is_better": t.higher_is_better,
                     "steps": steps or t.default_steps, "batch_size": batch, "seed": seed}
    if isolate and train_fn is not None:
        try:
            pickle.dumps(train_fn)
        except Exception as exc:
            raise TypeError(
                f"train_fn={train_fn!r} cannot be sent to a fresh process ({exc}); define it at module level "
                f"(not a lambda or a nested function), or pass isolate=False to run every precision in this process"
            ) from None
    dev = resolve_device(device)
    probes: list[str] = []
    if precisions is None:
        precisions, probes = default_precisions(dev)
    else:
        precisions = list(precisions)
        unknown = [p for p in precisions if p not in PRESETS and p != "auto"]
        if unknown or not precisions:
            raise PrecisionError(f"unknown precision(s) {unknown!r}; choose from: {', '.join([*PRESETS, 'auto'])}")
        precisions = list(dict.fromkeys(auto_precision(dev)[0] if p == "auto" else p for p in precisions))

    report: dict[str, Any] = {
        "schema_version": 1,
        "ampkit_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command or "ampkit.compare(...)",
        "task": task_info,
        "machine": describe(dev),
        "baseline": precisions[0],
        "interrupted": False,
        "runs": [],
    }
    plan = [(p, False) for p in precisions] + [(p, True) for p in probes if p not in precisions]
    base = RunSpec(precision="", device=str(dev), seed=seed, task=task, steps=steps, batch_size=batch_size,
                   train_fn=train_fn, samples_per_step=samples_per_step, nproc=nproc,
                   numerics_steps=NUMERICS_STEPS if numerics else 0)
    progress = _Progress(show)
    try:
        for name, probe in plan:
            finished = state_dir / f"{name}.json" if state_dir is not None else None
            if resume and finished is not None and finished.exists():
                report["runs"].append(json.loads(finished.read_text()))
                continue
            ckpt = str(state_dir / f"{name}.ckpt") if state_dir is not None and task is not None and not probe else None
            spec = dataclasses.replace(base, precision=name, probe=probe, checkpoints=ckpt,
                                       numerics_steps=0 if probe else base.numerics_steps)
            total = PROBE_STEPS if probe else (task_info["steps"] if task_info else None)
            run = _run_planned(spec, dev, isolate, progress, total)
            _finish_run(run, metric)
            report["runs"].append(run)
            if finished is not None and run["status"] != "failed":
                finished.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(finished, lambda f, run=run: f.write(json.dumps(run).encode()))
                if ckpt is not None:
                    shutil.rmtree(ckpt, ignore_errors=True)
    except KeyboardInterrupt:
        report["interrupted"] = True
        done = {r["precision"] for r in report["runs"]}
        report["runs"] += [_blank_run(p, "interrupted", "interrupted (Ctrl-C) before this run finished", dev) for p, _ in plan if p not in done]
    finally:
        progress.close()
    _ratios(report)
    if out is not None or show:
        from ampkit import report as reporting

        if out is not None:
            try:
                reporting.write_report(report, Path(out))
            except ValueError as exc:  # never lose a finished comparison to a report bug
                Path(out).mkdir(parents=True, exist_ok=True)
                raw = Path(out) / "report.unvalidated.json"
                raw.write_text(json.dumps(report, indent=2, default=str))
                warnings.warn(f"{exc}; the raw figures are in {raw}", stacklevel=2)
        if show:
            reporting.render_table(report)
    if report["interrupted"]:
        raise KeyboardInterrupt
    return report


def _run_planned(spec: RunSpec, dev: torch.device, isolate: bool, progress: _Progress, total: int | None) -> dict[str, Any]:
    """One planned run: skipped if the device cannot run it, else run (isolated, torchrun or in-process)."""
    name, probe = spec.precision, spec.probe
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the run itself records the warning as a note
            resolve_precision(name, dev)
    except PrecisionError as exc:
        return _blank_run(name, "skipped", str(exc), dev)
    label = f"{name} (probe: timing only)" if probe else name
    progress.start(label, total)
    try:
        if spec.nproc > 1:
            run = _run_torchrun(spec, progress.update)
        else:
            run = _run_isolated(spec, progress.update) if isolate else run_one(spec, progress.update)
    except _RunFailed as exc:
        progress.stop()
        return _blank_run(name, "failed", str(exc).strip() or "failed", dev)
    except Exception as exc:  # in-process runs: a failure is a reported status, not a crash of the comparison
        progress.stop()
        return _blank_run(name, "failed", f"{type(exc).__name__}: {exc}", dev)
    progress.update(run["steps"])
    progress.stop()
    if probe:
        run["reason"] = (
            f"timing only: {dev.type} runs {str(PRESETS[name].compute_dtype).removeprefix('torch.')} slowly here, "
            f"so a full run was left out; name it in --precisions to run it fully"
        )
    return run


class _Progress:
    """One progress bar per run (rich when installed, else a line per run)."""

    def __init__(self, show: bool) -> None:
        self._show = show
        self._bar: Any = None
        self._task: Any = None
        self._label = ""

    def start(self, label: str, total: int | None) -> None:
        self._label = label
        if not self._show:
            return
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:
            print(f"running {label} ...", flush=True)
            return
        self._bar = Progress(TextColumn("{task.description:<32}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=False)
        self._bar.start()
        self._task = self._bar.add_task(label, total=total)

    def update(self, step: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def close(self) -> None:
        self.stop()

