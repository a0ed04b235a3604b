"""The stages of `compare()` (`runner.py`) between its checks and its report: what is compared (`describe_task`), where
its records go (`open_out`), the runs it plans (`specs_for`), running them and keeping each finished run's record
as it lands (`run_all`, `persist`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ampkit.checkpoint.folder import remove_folder
from ampkit.tools.compare.html import REPORT_FILES
from ampkit.tools.compare.measure import PROBE_STEPS, RunSpec, TrainFn
from ampkit.tools.compare.records import Report, Task, json_safe
from ampkit.tools.compare.state import STATE_DIR, check_writable, file_stem, finished_runs, forget_runs
from ampkit.tools.compare.turns import RunProgress, blank_run, interleaved, run_planned
from ampkit.tools.tasks import default_size, get_task
from ampkit.util.files import OwnedFiles, atomic_write

Plan = list[tuple[str, bool]]  # (run name, probe?) in the order they run; the first is the baseline


def describe_task(
    train_fn: TrainFn | None,
    task: str | None,
    size: str | None,
    steps: int | None,
    batch_size: int | None,
    seed: int,
    metric: str | None,
    metric_direction: str | None,
    samples_per_step: int | None,
    dev: torch.device,
) -> tuple[Task, str | None, int | None]:
    """(what the report says is compared, the task's size, samples per step): a built-in task's own figures,
    or the train_fn's name, metric and direction (steps 0: its loop decides how many it runs)."""
    if task is None:
        direction = None if metric_direction is None else metric_direction == "higher"
        name = getattr(train_fn, "__name__", "train_fn")
        info = Task(
            name=name,
            metric=metric,
            higher_is_better=direction,
            steps=steps or 0,
            batch_size=samples_per_step,
            seed=seed,
        )
        return info, size, samples_per_step
    size = size or default_size(task, dev)
    t = get_task(task, size)
    per_step = batch_size or t.default_batch_size
    info = Task(
        name=t.name,
        metric=t.metric,
        higher_is_better=t.higher_is_better,
        steps=steps or t.default_steps,
        batch_size=per_step,
        seed=seed,
        size=size,
    )
    return info, size, per_step


def open_out(out: str | Path | None, resume: bool, plan: Plan) -> tuple[Path | None, OwnedFiles | None, dict]:
    """(the state folder, what ampkit owns in `out`, the finished runs `resume` keeps), all checked before any
    training: a comparison is never lost to a folder it cannot write, and never writes over what it did not."""
    if out is None:
        return None, None, {}
    state_dir, owned = Path(out) / STATE_DIR, OwnedFiles(out)
    check_writable(state_dir.parent)
    owned.check([*REPORT_FILES, "plan.png", "report.unvalidated.json", STATE_DIR])
    if not resume:
        forget_runs(owned)  # a new comparison: forget an old one's runs (only what ampkit wrote)
    return state_dir, owned, finished_runs(state_dir, [p for p, _ in plan]) if resume else {}


def specs_for(
    plan: Plan,
    base: RunSpec,
    kept: dict,
    kwargs_of: Any,
    state_dir: Path | None,
    owned: OwnedFiles | None,
) -> dict[str, RunSpec]:
    """Each run still to do: its preset, seed ("fp32 (seed 1)": the noise run, fp32 again from the next seed),
    its Accelerator arguments and, for a task's full run with `out`, the checkpoint folder it trains into
    (claimed before it starts)."""
    specs = {
        name: dataclasses.replace(
            base,
            precision=name.split(" ")[0],
            seed=base.seed + (" " in name),
            probe=probe,
            numerics_steps=0 if probe or " " in name else base.numerics_steps,
            accelerator_kwargs=kwargs_of(name.split(" ")[0]),
            checkpoints=str(state_dir / f"{file_stem(name)}.ckpt")
            if state_dir is not None and base.task is not None and not probe
            else None,
        )
        for name, probe in plan
        if name not in kept
    }
    if owned is not None:
        owned.claim([STATE_DIR, *(f"{STATE_DIR}/{Path(s.checkpoints).name}" for s in specs.values() if s.checkpoints)])
    return specs


def persist(run: Any, name: str, spec: RunSpec, state_dir: Path, owned: OwnedFiles) -> None:
    """A finished run's record, written atomically (what `--resume` keeps); its checkpoints are then removed."""
    owned.claim([STATE_DIR, f"{STATE_DIR}/{file_stem(name)}.json"])
    state_dir.mkdir(parents=True, exist_ok=True)
    record = json.dumps(json_safe(dataclasses.asdict(run))).encode()

    def write_record(f: BinaryIO, record: bytes = record) -> None:
        f.write(record)

    atomic_write(state_dir / f"{file_stem(name)}.json", write_record)
    if spec.checkpoints is not None:
        remove_folder(Path(spec.checkpoints))


def run_all(
    plan: Plan,
    specs: dict[str, RunSpec],
    kept: dict,
    report: Report,
    metric: str | None,
    dev: torch.device,
    isolate: bool,
    progress: RunProgress,
    turns: bool,
    fit: bool,
    out: tuple[Path | None, OwnedFiles | None],
) -> None:
    """Run the plan into `report.runs` in its order (`turns`: a task's runs taking turns, each in its own
    process, `fit` cutting their steps to the budget; else one after another), each kept run as it was, each
    new one persisted as it finishes; Ctrl-C marks the rest interrupted."""
    state_dir, owned = out
    task_info = report.task
    assert task_info is not None, "new_report() stamps the task"
    try:
        taken = interleaved(specs, report, dev, progress, fit=fit) if turns else {}
        if not turns:
            report.plan = "; ".join(
                f"{n} ({'probe, ' * s.probe}{s.steps or 'its own'} steps)" for n, s in specs.items()
            )
            progress.say(f"{report.plan}: one after another")
        for name, _ in plan:
            if name in kept:
                report.runs.append(kept[name])
                continue
            spec = specs[name]
            # a train_fn's step count is known once one run has finished: every run trains the same loop
            known = task_info.steps or next((r.steps for r in report.runs if r.status == "ok" and r.steps), None)
            run = (
                taken[name]
                if turns
                else run_planned(spec, dev, isolate, progress, PROBE_STEPS if spec.probe else known)
            )
            run.precision = name
            run.finish(metric)
            if task_info.metric is None and run.eval:
                task_info.metric = metric = next(iter(run.eval))
            report.runs.append(run)
            if state_dir is not None and owned is not None and run.status != "failed":
                persist(run, name, spec, state_dir, owned)
    except KeyboardInterrupt:
        report.interrupted = True
        done = {r.precision for r in report.runs}
        report.runs += [
            blank_run(p, "interrupted", "interrupted (Ctrl-C) before this run finished", dev)
            for p, _ in plan
            if p not in done
        ]
    finally:
        progress.stop()
