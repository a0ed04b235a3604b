"""How a comparison's runs are scheduled: taking turns in gated processes, or one after another.

Taking turns (a built-in task, a process per run): each trains a few timed warm-up steps (the plan line's
estimate; a default comparison fits its steps to `BUDGET_S`), then `ROUNDS` chunks in turn, so that a slow
moment of a shared machine lands on every run and each speed-up comes with its spread over the rounds.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import warnings
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ampkit.compare.measure import PROBE_STEPS, RunSpec, run_one
from ampkit.compare.records import Report, Run
from ampkit.compare.spawn import RunFailed, Worker, run_isolated, run_torchrun
from ampkit.errors import PrecisionError
from ampkit.precision import PRESETS, dtype_name, resolve_precision
from ampkit.present import console, seconds

#: Rounds an interleaved comparison's timed steps are split into, after the warm-up chunk.
ROUNDS = 4

#: Timed warm-up steps of each full run (a probe: 2) before the plan line; the fastest gives the estimate.
WARMUP_STEPS = 5

#: Seconds a default comparison's training, evaluation and numerics passes should take (about three
#: minutes with startup); its full runs' steps are cut to fit, to half the task's at the least.
BUDGET_S = 140.0

#: A numerics pass (hooks on every module, a census of every tensor) costs about this many plain steps.
NUMERICS_COST_STEPS = 40


def blank_run(precision: str, status: str, reason: str, device: torch.device) -> Run:
    kind = "cuda_max_allocated" if device.type == "cuda" else "cpu_peak_rss_delta"
    return Run(precision=precision, status=status, reason=reason, memory_kind=kind)


def run_planned(spec: RunSpec, dev: torch.device, isolate: bool, progress: RunProgress, total: int | None) -> Run:
    """One planned run: skipped if the device cannot run it, else run (isolated, torchrun or in-process)."""
    name, probe = spec.precision, spec.probe
    if (why := unrunnable(name, dev)) is not None:
        return blank_run(name, "skipped", why, dev)
    progress.start(f"{name} (probe: timing only)" if probe else name, total)
    try:
        how = run_torchrun if spec.nproc > 1 else run_isolated if isolate else run_one
        run = how(spec, progress.update)
        progress.update(run.steps)
    except RunFailed as exc:
        return blank_run(name, "failed", str(exc).strip() or "failed", dev)
    except Exception as exc:  # in-process runs: a failure is a reported status, not a crash of the comparison
        return blank_run(name, "failed", f"{type(exc).__name__}: {exc}", dev)
    finally:
        progress.stop()
    return _probed(run, dev) if probe else run


def unrunnable(name: str, dev: torch.device) -> str | None:
    """Why the device cannot run preset `name`, or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the run itself records the warning as a note
            resolve_precision(name, dev)
    except PrecisionError as exc:
        return str(exc)
    return None


def _probed(run: Run, dev: torch.device) -> Run:
    run.reason = (f"timing only: {dev.type} runs {dtype_name(PRESETS[run.precision].compute_dtype)} slowly here, "
                  f"so a full run was left out; name it in --precisions to run it fully")
    return run


def interleaved(specs: dict[str, RunSpec], report: Report, dev: torch.device, progress: RunProgress,
                fit: bool) -> dict[str, Run]:
    """Every run (by name) in its own gated process at once, taking turns: warm-up steps, the plan line, `ROUNDS`."""
    runs: dict[str, Run] = {}
    workers: dict[str, Worker] = {}
    total = {n: PROBE_STEPS if s.probe else s.steps or 0 for n, s in specs.items()}
    label = {n: f"{n} (probe: timing only)" if s.probe else n for n, s in specs.items()}

    def each(call: Any, bar: bool = True) -> None:  # call(name, worker) for each live worker; a failed one leaves
        for name, worker in list(workers.items()):
            try:
                if bar:
                    progress.start(label[name], total[name])
                call(name, worker)
            except RunFailed as exc:
                runs[name] = blank_run(name, "failed", str(exc).strip() or "failed", dev)
                workers.pop(name).close()

    try:
        for name, spec in specs.items():
            if (why := unrunnable(spec.precision, dev)) is not None:
                runs[name] = blank_run(name, "skipped", why, dev)
            else:
                workers[name] = Worker(spec, gated=True)
        each(lambda name, w: w.ready(), bar=False)
        warm = {n: min(2 if s.probe else WARMUP_STEPS, total[n]) for n, s in specs.items()}
        each(lambda name, w: w.advance(warm[name], progress.update), bar=False)
        step_s = {n: min(w.chunks[-1] or [0.0]) for n, w in workers.items()}  # the first steps are slow
        full = [n for n, s in specs.items() if not s.probe and n in workers]
        extra = sum(NUMERICS_COST_STEPS * step_s[n] for n, s in specs.items() if s.numerics_steps and n in workers)
        left = {n: max(0, total[n] - w.done) * step_s[n] for n, w in workers.items()}
        cut = ""
        if fit and full and sum(left.values()) + extra > BUDGET_S:
            room = BUDGET_S - extra - sum(left[n] for n in workers if n not in full)
            steps = max(total[full[0]] // 2, int(room / max(1e-9, sum(step_s[n] for n in full))))
            if steps < total[full[0]]:
                cut = f", cut from {total[full[0]]} to fit ~{seconds(BUDGET_S)}"
                total.update(dict.fromkeys(full, steps))
                if report.task is not None:
                    report.task.steps = steps
                left = {n: max(0, total[n] - w.done) * step_s[n] for n, w in workers.items()}
        what = ", ".join(f"{n} ({'probe, ' * (n not in full)}{total[n]} steps)" for n in workers)
        report.plan = (f"{what}{cut}: {ROUNDS} rounds taking turns, about {seconds(sum(left.values()) + extra)} "
                       "(from the fastest of the timed warm-up steps)")
        progress.say(report.plan)
        for r in range(1, ROUNDS + 1):
            each(lambda n, w, r=r: w.advance(warm[n] + math.ceil(r * (total[n] - warm[n]) / ROUNDS),
                                             progress.update))

        def finish(name: str, worker: Worker) -> None:
            runs[name] = dataclasses.replace(worker.finish(progress.update), precision=name, round_step_times_s=[
                statistics.median(c) if c else None for c in worker.chunks[1:]])
            progress.update(runs[name].steps)

        each(finish)
    finally:
        for worker in workers.values():
            worker.close()
        progress.stop()
    return {n: _probed(run, dev) if run.status == "probe" else run for n, run in runs.items()}


class RunProgress:
    """One progress bar per run, all on one live display until `stop`."""

    def __init__(self, show: bool) -> None:
        self.show = show
        self.bar: Progress | None = None
        self.tasks: dict[str, Any] = {}
        self.label = ""

    def say(self, line: str) -> None:
        if self.show:
            (self.bar.console if self.bar is not None else console()).print(line, highlight=False)

    def start(self, label: str, total: int | None) -> None:
        self.label = label
        if self.show:
            if self.bar is None:
                self.bar = Progress(TextColumn("{task.description:<32}"), BarColumn(), MofNCompleteColumn(),
                                    TimeElapsedColumn(), transient=False)
                self.bar.start()
                self.tasks = {}
            if label not in self.tasks:
                self.tasks[label] = self.bar.add_task(label, total=total)
            self.bar.update(self.tasks[label], total=total)

    def update(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(self.tasks[self.label], completed=step)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
