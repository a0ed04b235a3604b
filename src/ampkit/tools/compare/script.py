"""`ampkit compare train.py`: the precision comparison on the user's own script, unchanged.

Each precision runs the script in a fresh process (`runpy`) with AMPKIT_PRECISION and, with `steps`,
AMPKIT_MAX_STEPS set (`ampkit.engine.launch`: training ends after that many steps, evaluation still runs). The
first Accelerator it creates is recorded: the `Recorder`'s figures, peak memory up to the last step and
its `acc.report_metric` values. A run ends at the script's end, its first metric after the limit, or `GRACE`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import statistics
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_leaves

from ampkit.engine.events import watch_created
from ampkit.engine.launch import own_checkpoints, run_as_main
from ampkit.hardware.capability import resolve_device
from ampkit.tools.compare.baseline import compare_to_baseline
from ampkit.tools.compare.html import REPORT_FILES, write_report
from ampkit.tools.compare.measure import Recorder, seed_everything
from ampkit.tools.compare.memory import Memory
from ampkit.tools.compare.records import MemoryKind, Policy, Report, Run, Task
from ampkit.tools.compare.runner import default_precisions, new_report, plan_runs
from ampkit.tools.compare.summary import render_table
from ampkit.tools.compare.turns import RunFailed, RunProgress, blank_run, run_isolated, throttled, unrunnable
from ampkit.tools.doctor.run import check_script, script_traceback
from ampkit.tools.records import build
from ampkit.tools.timing import check_load, worst
from ampkit.util.files import OwnedFiles

GRACE = (60.0, 3.0)
"""After the step limit: (at least seconds, times the time the steps took) the script gets to end or report."""


class ScriptStop(BaseException):
    """Ends a script's run from inside it (like KeyboardInterrupt, past a loop's `except Exception:`)."""


class ScriptProblem(BaseException):
    """The script cannot be compared as it is; the message says why and what to change."""


@dataclasses.dataclass(frozen=True)
class ScriptSpec:
    script: str
    args: tuple[str, ...]
    precision: str
    steps: int | None
    seed: int
    log: str  # the script's stdout and stderr go here


class ScriptRecorder(Recorder):
    """The comparison's `Recorder` plus what a script run needs: its metrics, batch size and the stop."""

    def __init__(self, acc: Any, spec: ScriptSpec, progress: Callable[[int], None]) -> None:
        super().__init__(acc, on_step=self._stepped)
        self.spec, self.memory, self.progress = spec, Memory(acc.device), progress
        self.metrics: dict[str, tuple[Any, bool | None]] = {}
        self.batch_size: int | None = None
        self.stopped: str | None = None
        self.began = time.perf_counter()
        self.timer: threading.Timer | None = None

    def _stepped(self, step: int) -> None:
        self.progress(step)
        limit = self.spec.steps
        if limit is not None and step == limit:
            self.memory.freeze()  # the training's peak: evaluation's memory is not training's
            grace = max(GRACE[0], GRACE[1] * (time.perf_counter() - self.began))
            # The script gets `grace` to end or report a metric; then the signal ends it where it is.
            self.timer = threading.Timer(grace, os.kill, (os.getpid(), signal.SIGUSR1))
            self.timer.daemon = True
            self.timer.start()
        elif limit is not None and step > limit:  # its loop is its own (a step counter, an unprepared loader)
            self.stopped = (
                f"stopped at step {limit}: the script's training loop does not iterate a DataLoader "
                f"passed through acc.prepare (it counts its own steps or slices its own tensors), so "
                f"the step limit could not end it and the run was stopped there; an evaluation after "
                f"the loop did not run"
            )
            raise ScriptStop

    def on_batch_wait_end(self, loader: Any, batch: Any) -> None:
        if self.batch_size is None:
            self.batch_size = next(
                (t.shape[0] for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim()), None
            )

    def on_metric(self, acc: Any, name: str, value: Any, higher_is_better: bool | None) -> None:
        """Keep each metric's latest value (a tensor copied on the device: no sync); after the step limit,
        the first one ends the run: the script's evaluation has run."""
        self.metrics[name] = (value.detach().clone() if isinstance(value, torch.Tensor) else value, higher_is_better)
        if self.spec.steps is not None and self.steps >= self.spec.steps:
            raise ScriptStop


def measure_script(spec: ScriptSpec, progress: Callable[[int], None]) -> tuple[Run, dict[str, bool | None]]:
    """Run the script once at `spec.precision` in this process: its run record, and the direction
    (higher is better?) of each metric it reported."""
    saved_env = {name: os.environ.pop(name, None) for name in ("AMPKIT_PRECISION", "AMPKIT_MAX_STEPS")}
    os.environ["AMPKIT_PRECISION"] = spec.precision
    if spec.steps is not None:
        os.environ["AMPKIT_MAX_STEPS"] = str(spec.steps)
    process_seed = (spec.seed * 0x9E3779B9 + 0x5EED) % 2**32  # a seed no script picks: its own seeding shows
    seed_everything(process_seed)
    found: list[ScriptRecorder] = []

    def created(acc: Any) -> None:
        if found:
            return
        if acc.policy.name != spec.precision:
            raise ScriptProblem(
                f"{spec.script} passes precision={acc.policy.name!r} to ampkit.Accelerator, so the "
                f"comparison cannot choose it: drop precision= (or pass 'auto') and AMPKIT_PRECISION applies"
            )
        found.append(ScriptRecorder(acc, spec, progress))
        acc.events.add(found[0])

    def plain_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        if not found:
            raise ScriptProblem(
                f"{spec.script} stepped a {type(optimizer).__name__} before creating an "
                f"ampkit.Accelerator: convert it with the README's four lines (Accelerator, prepare, backward)"
            )

    def grace_spent(signum: int, frame: Any) -> None:  # the recorder's timer: GRACE after the step limit
        if found:
            found[0].stopped = (
                f"stopped after step {spec.steps}: the script neither ended nor reported a metric "
                f"in the grace time after it"
            )
        raise ScriptStop

    hook = register_optimizer_step_pre_hook(plain_step)
    previous = signal.signal(signal.SIGUSR1, grace_spent)
    start = time.perf_counter()
    try:
        try:
            with own_checkpoints(spec.precision) as own, watch_created(created):
                run_as_main(spec.script, spec.args)
        finally:
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # first: a late timer must not stop the cleanup below
    except ScriptStop:
        pass
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise ScriptProblem(f"{spec.script} exited with status {exc.code!r}") from None
    finally:
        hook.remove()
        if found and found[0].timer is not None:
            found[0].timer.cancel()
            found[0].timer.join()
        signal.signal(signal.SIGUSR1, previous)
        for name, value in saved_env.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
    if not found:
        raise ScriptProblem(
            f"{spec.script} ended without creating an ampkit.Accelerator: convert it with the "
            f"README's four lines (Accelerator, prepare, backward)"
        )
    rec = found[0]
    acc, wall = rec.acc, time.perf_counter() - start
    skipped = acc.state.skipped_steps  # waits for the outcomes still in flight: the run is over
    summary = rec.summary(min(10, rec.steps // 10))
    timed = rec.step_times()[summary["warmup_steps"] :]  # the speed-up's pairs: the median of each quarter
    summary["round_step_times_s"] = (
        [statistics.median(timed[i * len(timed) // 4 : (i + 1) * len(timed) // 4]) for i in range(4)]
        if len(timed) >= 4
        else None
    )
    summary["rounds_interleaved"] = False if summary["round_step_times_s"] else None  # one run after another
    peak, raw, kind = rec.memory.read()
    notes = [rec.stopped] if rec.stopped else []
    if own.used:
        notes.append(
            "the script's checkpoints went to a folder of this run's own, removed after it: no run resumed "
            "another's (its own checkpoint folder was left as it was)"
        )
    metrics: dict[str, float | None]  # Run.eval's type
    metrics = {name: float(value) for name, (value, _) in rec.metrics.items()}  # sync: once, after the run
    if torch.initial_seed() == process_seed:
        notes.append(
            f"the script does not seed torch itself: every run started from the same seed, set by ampkit "
            f"(--seed {spec.seed}) before the script ran"
        )
    median, per_step = summary["step_time_median_s"], (rec.batch_size or 0) * acc.config.grad_accum_steps
    return Run(
        precision=spec.precision,
        status="ok",
        reason="; ".join(notes) or None,
        policy=build(Policy, acc.policy.as_dict()),
        **summary,
        skipped_steps=skipped,
        samples_per_s=per_step / median if per_step and median else None,
        memory_kind=cast(MemoryKind, kind),  # Memory.read() names one of MEMORY_KINDS
        peak_memory_bytes=peak,
        peak_rss_bytes=raw,
        eval=metrics,
        wall_time_s=wall,
    ), {name: direction for name, (_, direction) in rec.metrics.items()}


def _child(spec: ScriptSpec, conn: Any, gated: bool = False) -> None:
    """A run's process: the script's output to the log, progress and the record to the parent (never gated)."""
    fd = os.open(spec.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    progress = throttled(lambda step: conn.send(("progress", step)), spec.steps)
    try:
        conn.send(("done", measure_script(spec, progress)))
    except ScriptProblem as exc:
        conn.send(("error", str(exc)))
    except BaseException as exc:  # noqa: BLE001 - the script's own failure, with its own frames
        shown = script_traceback(exc, spec.script)
        who = f"{spec.script} raised" if shown else "ampkit failed running the script:"
        conn.send(("error", f"{who} {type(exc).__name__}: {exc}\n{shown or traceback.format_exc()}"))
    finally:
        conn.close()


def compare_script(
    script: str | Path,
    args: Sequence[str] = (),
    precisions: Sequence[str] | None = None,
    *,
    steps: int | None = None,
    seed: int = 0,
    out: str | Path | None = None,
    show: bool = True,
    command: str | None = None,
) -> dict[str, Any]:
    """Run `script` with `args` once per precision, each in a fresh process, and return the report dict.

    The script needs no change beyond the four-line conversion: it must not pass `precision=` to its
    Accelerator (the comparison sets AMPKIT_PRECISION), and it may report its headline result with
    `acc.report_metric(name, value, higher_is_better=...)`. `steps` ends each run's training after that
    many optimizer steps (AMPKIT_MAX_STEPS; its evaluation still runs); None runs the script to its end.
    Each process is seeded with `seed` before the script runs, so a script that does not seed itself
    still starts every run from the same weights. The script's output goes to `out/logs/<precision>.log`
    (a temporary folder without `out`). The first precision is the baseline.
    """
    check_script(script)
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise ValueError(
            f"steps={steps!r}: expected an integer >= 1 (optimizer steps per run), or None for the whole script"
        )
    dev = resolve_device("auto")
    given = list(precisions) if precisions else default_precisions(dev)[0]
    names = [name for name, _ in plan_runs(given, dev)]
    logs = Path(out) / "logs" if out is not None else Path(tempfile.mkdtemp(prefix="ampkit-compare-"))
    if out is not None:  # refuse a folder holding files of these names that ampkit did not write, before any run
        owned = OwnedFiles(out)
        owned.check(REPORT_FILES)
        owned.claim(f"logs/{name}.log" for name in names)
    try:
        logs.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"cannot write the report into {str(out)!r} ({exc.strerror or exc}); name a folder you can write to"
        ) from None
    task = Task(name=str(script), metric=None, higher_is_better=None, steps=steps or 0, batch_size=None, seed=seed)
    report = new_report(command or "ampkit.compare_script(...)", task, dev, names[0])
    progress = RunProgress(show)
    before = check_load(dev)  # the machine as the runs found it and left it: the busier look is kept
    for name in names:
        report.runs.append(
            _one(
                ScriptSpec(str(script), tuple(map(str, args)), name, steps, seed, str(logs / f"{name}.log")),
                dev,
                progress,
                task,
            )
        )
    report.machine["load"] = worst(before, check_load(dev, own=torch.get_num_threads())).as_dict()
    _compared(report)
    if out is not None:
        write_report(report, out)
    if show:
        render_table(report)
    return report.to_dict()


def _one(spec: ScriptSpec, dev: torch.device, progress: RunProgress, task: Task) -> Run:
    if (why := unrunnable(spec.precision, dev)) is not None:
        return blank_run(spec.precision, "skipped", why, dev)
    progress.start(spec.precision, spec.steps)
    try:
        run, directions = run_isolated(spec, progress.update, target=_child, fresh=True)
    except RunFailed as exc:
        return blank_run(spec.precision, "failed", str(exc).strip(), dev)
    finally:
        progress.stop()
    if task.metric is None and directions:
        task.metric, task.higher_is_better = next(iter(directions.items()))
    run.finish(task.metric)
    return run


def _compared(report: Report) -> None:
    """Ratios and deltas against the baseline, and a note where a run did not start where it did."""
    base = compare_to_baseline(report)
    for run in report.runs if base is not None else ():
        assert base is not None
        first, first_base = (r.loss_curve[0] if r.loss_curve else None for r in (run, base))
        if (
            first is not None
            and first_base is not None
            and not math.isclose(first, first_base, rel_tol=0.05, abs_tol=1e-3)
        ):
            note = (
                f"its first loss ({first:.4g}) is not {report.baseline}'s ({first_base:.4g}): the runs did not "
                f"start from the same weights and data (does the script seed every random source?)"
            )
            run.reason = f"{run.reason}; {note}" if run.reason else note
