"""How a comparison's runs are scheduled: taking turns in gated processes, or one after another.

Each run has a process of its own (clean memory figures, nothing leaks into the next run): forked from a server
that imported torch once (`run_context`), it streams its steps and then its `Run`; or N processes under torchrun
run `python -m ampkit.tools.compare SPEC OUT PROGRESS`.
Taking turns (a built-in task, a gated `Worker` per run): each trains a few timed warm-up steps (the plan
line's estimate; a default comparison fits its steps to `budget.BUDGET_S`), then `ROUNDS` chunks in turn, so that a
slow moment of a shared machine lands on every run and each speed-up comes from paired rounds, with its interval.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import multiprocessing
import os
import pickle
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ampkit.errors import PrecisionError
from ampkit.precision.policy import resolve_precision
from ampkit.tools.compare.budget import ROUNDS, Fit, fit_steps, plan_line, steps_left
from ampkit.tools.compare.measure import PROBE_STEPS, RunSpec, run_one
from ampkit.tools.compare.records import MemoryKind, Report, Run, Status
from ampkit.util.present import console, duration
from ampkit.util.processes import die_with_parent, end, popen_owned

#: Timed warm-up steps of each full run (a probe: 2) before the plan line; the fastest gives the estimate.
WARMUP_STEPS = 5

#: A numerics pass (hooks on every module, a census of every tensor) costs about this many plain steps.
NUMERICS_COST_STEPS = 40


class RunFailed(Exception):
    """A run's process failed or died; the message is what the report says of it."""


def throttled(send: Callable[[int], object], last_step: int | None = None) -> Callable[[int], None]:
    """`send` at most five times a second (and at `last_step`): progress is for people, pipes cost."""
    last = [0.0]

    def progress(step: int) -> None:
        if step == last_step or time.monotonic() - last[0] > 0.2:
            last[0] = time.monotonic()
            send(step)

    return progress


def _child(spec: RunSpec, conn: Any, gated: bool) -> None:
    """Entry point of a run's process: stream progress (and pauses, when gated), then send the record or the error."""

    def gate(done: int, times: list[float]) -> int | None:
        conn.send(("paused", done, times))
        kind, target = conn.recv()
        return target if kind == "go" else None

    try:
        progress = throttled(lambda step: conn.send(("progress", step)))
        conn.send(("done", run_one(spec, progress, gate if gated else None)))
    except KeyboardInterrupt:
        conn.send(("error", "interrupted"))
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a reported status
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}"))
    finally:
        conn.close()


#: What the server that runs are forked from imports before the first one (`run_context`): without it each run
#: would import torch, then torch._dynamo (at the first optimizer torch builds), then ampkit: seconds a run.
PRELOAD = ["torch", "torch._dynamo", "ampkit.tools.compare.measure"]


def run_context(fresh: bool = False) -> Any:
    """Where a run's process comes from: forked from multiprocessing's forkserver (a fresh interpreter started
    once, from this process's environment, that imported `PRELOAD`: nothing of this process's state, its
    modules' changes or torch's settings, reaches a run, as with spawn), or spawned when `fresh` (a user's
    script, which may set its environment before it imports torch) or where forkserver is missing (Windows)."""
    if fresh or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # used when the server starts: once per process
    return ctx


def _owned(target: Callable[[Any, Any, bool], None], *args: Any) -> None:
    """A run's process: ended by the kernel when its parent (this command, or the forkserver that exits with
    it) dies, even by SIGKILL; then `target(*args)`."""
    die_with_parent()
    target(*args)


class Worker:
    """One run in a process of its own (`run_context`). Gated, it trains only when told: `advance(target)` trains
    up to step `target`, keeping that chunk's step times in `chunks`; `finish()` ends training and returns the
    `Run`."""

    chunks: list[list[float] | None]

    def __init__(
        self, spec: Any, gated: bool, target: Callable[[Any, Any, bool], None] = _child, fresh: bool = False
    ) -> None:
        ctx = run_context(fresh)
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_owned, args=(target, spec, child, gated), daemon=True)
        self.proc.start()
        child.close()
        self.gated, self.done, self.chunks = gated, 0, []  # steps done; each chunk's step times (None: none ran)

    def _wait(self, on_progress: Callable[[int], None]) -> Any:
        while True:
            if self.conn.poll(0.1):
                try:
                    kind, *payload = self.conn.recv()
                except EOFError:
                    break
                if kind == "progress":
                    on_progress(payload[0])
                elif kind == "paused":
                    self.done = payload[0]
                    return payload[1]
                elif kind == "done":
                    return payload[0]
                else:
                    raise RunFailed(payload[0])
            elif not self.proc.is_alive() and not self.conn.poll():
                break
        raise RunFailed(f"the run's process died (exit code {self.proc.exitcode}) before reporting")

    def ready(self) -> None:
        """Wait until the run has built its model and data and paused before its first step."""
        self._wait(lambda step: None)

    def advance(self, target: int, on_progress: Callable[[int], None]) -> None:
        if target <= self.done:  # there already: a chunk of no steps
            self.chunks.append(None)
        else:
            self.conn.send(("go", target))
            self.chunks.append(self._wait(on_progress))

    def finish(self, on_progress: Callable[[int], None]) -> Run:
        if self.gated:
            self.conn.send(("stop", None))
        return self._wait(on_progress)

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(timeout=10)


def run_isolated(
    spec: Any,
    on_progress: Callable[[int], None],
    target: Callable[[Any, Any, bool], None] = _child,
    fresh: bool = False,
) -> Any:
    """`run_one(spec)` in a process of its own (or another `target(spec, conn, gated)` sending the same messages;
    `fresh`: a spawned interpreter, see `run_context`)."""
    worker = Worker(spec, gated=False, target=target, fresh=fresh)
    try:
        return worker.finish(on_progress)
    finally:
        worker.close()


#: The line a Python traceback ends with, as torchrun prefixes a rank's output: "[rank0]: ValueError: ...".
_RAISED = re.compile(r"(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt): .*)")


def run_torchrun(spec: RunSpec, on_progress: Callable[[int], None]) -> Run:
    """`run_one(spec)` as `torchrun --nproc-per-node=N -m ampkit.tools.compare`; rank 0 reports."""
    with tempfile.TemporaryDirectory(prefix="ampkit-compare-") as tmp:
        spec_file, out_file, progress_file = Path(tmp, "spec.pkl"), Path(tmp, "run.pkl"), Path(tmp, "progress")
        spec_file.write_bytes(pickle.dumps(spec))  # our own files, read back by our own code
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={spec.nproc}",
            "-m",
            "ampkit.tools.compare",
            str(spec_file),
            str(out_file),
            str(progress_file),
        ]
        log = Path(tmp, "torchrun.log")  # a file, not a pipe: a pipe read only at the end fills and blocks torchrun
        with log.open("w") as sink:
            proc = popen_owned(cmd, stdout=sink, stderr=subprocess.STDOUT, text=True)  # SIGTERM'd if we die
            try:
                while proc.poll() is None:
                    time.sleep(0.2)
                    with contextlib.suppress(OSError, ValueError):
                        on_progress(int(progress_file.read_text() or 0))
            finally:
                end(proc)
        output = log.read_text(errors="replace")
        if proc.returncode != 0 or not out_file.exists():
            lines = output.splitlines()
            # a worker's own exception ("ValueError: ..."), not torchrun's ChildFailedError around it
            raised = [m.group(1) for m in map(_RAISED.match, lines) if m and "ChildFailedError" not in m.group(1)]
            tail = raised[:1] or [ln for ln in lines if "Error" in ln][-1:] or lines[-1:]
            raise RunFailed(f"torchrun exited with code {proc.returncode}: {tail[0] if tail else 'no output'}")
        return pickle.loads(out_file.read_bytes())


def torchrun_worker(spec_file: str, out_file: str, progress_file: str) -> None:
    """Entry point of each torchrun process: train; rank 0 writes the run record and progress."""
    die_with_parent()  # torchrun SIGKILLed: its ranks end too
    spec = pickle.loads(Path(spec_file).read_bytes())
    rank = int(os.environ.get("RANK", "0"))
    run = run_one(spec, throttled(lambda step: rank == 0 and Path(progress_file).write_text(str(step))))
    if rank == 0:
        Path(out_file).write_bytes(pickle.dumps(run))


def blank_run(precision: str, status: Status, reason: str, device: torch.device) -> Run:
    kind: MemoryKind = "cuda_max_allocated" if device.type == "cuda" else "cpu_peak_rss_delta"
    return Run(precision=precision, status=status, reason=reason, memory_kind=kind)


def run_planned(spec: RunSpec, dev: torch.device, isolate: bool, progress: RunProgress, total: int | None) -> Run:
    """One planned run: skipped if the device cannot run it, else run (isolated, torchrun or in-process)."""
    name = spec.precision
    if (why := unrunnable(name, dev)) is not None:
        return blank_run(name, "skipped", why, dev)
    progress.start(f"{name} (probe: timing only)" if spec.probe else name, total)
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
    return run


def unrunnable(name: str, dev: torch.device) -> str | None:
    """Why the device cannot run preset `name`, or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the run itself records the warning as a note
            resolve_precision(name, dev)
    except PrecisionError as exc:
        return str(exc)
    return None


def interleaved(
    specs: dict[str, RunSpec], report: Report, dev: torch.device, progress: RunProgress, fit: bool
) -> dict[str, Run]:
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

    if specs:  # none where --resume found every run finished
        progress.say(f"starting {len(specs)} runs, each in its own process; their warm-up steps time the plan...")
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
        done = {n: w.done for n, w in workers.items()}
        fitted = (
            fit_steps(total, done, step_s, full, extra)
            if fit and full
            else Fit(total, extra + steps_left(total, done, step_s))
        )
        if fitted.steps != total and report.task is not None:
            report.task.steps = fitted.steps[full[0]]
        total = fitted.steps
        report.plan = plan_line({n: total[n] for n in workers}, full, fitted)
        progress.say(report.plan)
        started = time.monotonic()
        for r in range(1, ROUNDS + 1):
            each(lambda n, w, r=r: w.advance(warm[n] + math.ceil(r * (total[n] - warm[n]) / ROUNDS), progress.update))
            progress.round_done(r, time.monotonic() - started, extra)

        def finish(name: str, worker: Worker) -> None:
            runs[name] = dataclasses.replace(
                worker.finish(progress.update),
                precision=name,
                rounds_interleaved=True,
                round_step_times_s=[statistics.median(c) if c else None for c in worker.chunks[1:]],
            )
            progress.update(runs[name].steps)

        if extra:
            progress.say("numerics pass: a few more steps of each full run, not timed...")
        each(finish)
    finally:
        for worker in workers.values():
            worker.close()
        progress.stop()
    return runs


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

    def round_done(self, r: int, elapsed_s: float, after_s: float) -> None:
        """Off a terminal (a log file, a pipe) no bar moves: one line per round instead, with the time elapsed
        and left (the rounds to go at the pace of those done, and `after_s` of numerics passes after them)."""
        if not self.show or console().is_terminal:
            return
        left = elapsed_s / r * (ROUNDS - r) + after_s
        print(f"round {r}/{ROUNDS} done: {duration(elapsed_s)} elapsed, about {duration(left)} left", flush=True)

    def start(self, label: str, total: int | None) -> None:
        self.label = label
        if self.show:
            if self.bar is None:
                self.bar = Progress(
                    TextColumn("{task.description:<32}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeElapsedColumn(),
                    transient=False,
                )
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
