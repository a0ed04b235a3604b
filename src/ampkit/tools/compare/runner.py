"""`ampkit compare`: plan the runs (each precision in its own process; a built-in task's runs
taking turns, `turns.py`), keep finished runs for `--resume` (their records: `state.py`), compute the
ratios against the baseline (`baseline.py`) and hand the `Report` to the table and the writer.
"""

from __future__ import annotations

import datetime
import inspect
import json
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ampkit.accelerator import Accelerator
from ampkit.errors import AmpkitError, PrecisionError
from ampkit.hardware.capability import auto_precision, capability, describe, resolve_device
from ampkit.precision.policy import PRESETS, fp8_problem
from ampkit.tools.compare.baseline import compare_to_baseline
from ampkit.tools.compare.html import write_report
from ampkit.tools.compare.measure import NUMERICS_STEPS, RunSpec, TrainFn
from ampkit.tools.compare.records import Report, Task
from ampkit.tools.compare.stages import describe_task, open_out, run_all, specs_for
from ampkit.tools.compare.summary import render_table
from ampkit.tools.compare.turns import RunProgress
from ampkit.tools.export import format_text as format_inference
from ampkit.tools.export import measure as measure_inference
from ampkit.tools.export import render_html_section
from ampkit.tools.plan import plan_task, plot_png
from ampkit.tools.timing import check_load, worst
from ampkit.util.files import OwnedFiles
from ampkit.util.held_back import held_back
from ampkit.util.version import ampkit_version


def default_precisions(device: torch.device) -> tuple[list[str], list[str]]:
    """(full runs, timing-only probes) for `device` when the user names no precisions.

    Full: fp32, the `auto` choice and, on a GPU, every preset whose compute dtype is fast there. Probe:
    bf16-mixed where bf16 runs but slowly, so the report shows that cost instead of hiding it.
    """
    support = capability(device)
    fast = {torch.float32: True, torch.bfloat16: support.bf16_fast, torch.float16: support.fp16_fast}
    full = ["fp32", auto_precision(device)[0]]
    if device.type != "cpu":  # a CPU's bf16 presets compute alike: the auto choice stands for them
        full += [name for name, p in PRESETS.items() if fast[p.compute_dtype] and not (p.fp8 and fp8_problem(device))]
    full = list(dict.fromkeys(full))
    probes = [] if support.bf16_fast or not support.bf16_runs else ["bf16-mixed"]
    return full, probes


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
    accelerator_kwargs: dict[str, Any] | None = None,
    metric_direction: str | None = None,
    size: str | None = None,
    inference: bool = False,
    verbose: bool = False,
) -> dict[str, Any]:
    """Run `train_fn` (or a built-in `task`) once per precision and return the report dict.

    Args:
        train_fn: `train_fn(acc) -> dict` runs your loop with the given Accelerator (use `acc.prepare`
            and `acc.backward`) and returns its metrics, e.g. {"accuracy": 0.97}. With `isolate=True` it
            must be a module-level function (it is pickled into a fresh process, and your script needs
            an `if __name__ == "__main__":` guard).
        precisions: presets to run; the first is the baseline. Default: fp32, the `auto` choice and every
            preset fast on this hardware, plus a timing-only probe of bf16 where it is slow.
        task: a built-in task name (see `ampkit.tools.tasks.TASKS`) instead of `train_fn`.
        size: the task's model size (tiny-lm: small, medium, large); default: the one sized for the
            device (`tasks.default_size`: large on a GPU, medium on a CPU with fast bf16, else small).
        steps, batch_size: override the task's defaults; without `steps` the full runs' steps are cut,
            if need be, so that the comparison's training fits `BUDGET_S`.
        out: folder for report.json, the PNG plots and report.html (None: write nothing). Checked before
            any training: a comparison is never lost to a folder it cannot write.
        metric: which key of `train_fn`'s dict is the headline metric (default: the first key).
        metric_direction: "higher" or "lower": which way the metric is better (val_loss: "lower").
        samples_per_step: for `train_fn`, to report samples/s.
        isolate: run each precision in its own process (clean memory figures). False runs in-process.
        resume: continue an interrupted comparison in `out`: finished runs are kept, an unfinished
            built-in-task run resumes from its last checkpoint (they are written to `out` as it trains).
        nproc: run each precision data-parallel under `torchrun --nproc-per-node=nproc` (batch_size is
            per process); figures are rank 0's.
        numerics: after each run (not probes, not with nproc > 1), `NUMERICS_STEPS` steps of the same
            training on a fresh model with the same seed under the numerics doctor (layers at risk, lost
            updates, loss-scale health): `runs[i].numerics`; a separate pass, in none of the run's figures.
        accelerator_kwargs: more `Accelerator` arguments for every run (`grad_accum_steps`, `keep_fp32`,
            `compile`, ...); a key that names a preset holds that preset's own, e.g.
            {"grad_accum_steps": 4, "fp16-mixed": {"keep_fp32": ["head"]}}.
        inference: afterwards (a task, with `out`), export the task's fp32-trained model in each precision
            and backend and measure it (`ampkit export`): out/inference.json and a page section.
        verbose: with `inference`, let the export's other libraries' warnings through (torchao, onnxruntime);
            by default one line counts them.

    With a task and `out`, the page also shows the peak memory `ampkit plan` predicted per precision.
    """
    _check_args(train_fn, task, steps, batch_size, nproc, isolate, resume, out, inference)
    kwargs_of = _accelerator_kwargs(accelerator_kwargs)
    if metric_direction not in (None, "higher", "lower"):
        raise ValueError(f"metric_direction={metric_direction!r}: expected 'higher' or 'lower'")
    if size is not None and task is None:
        raise ValueError(f"size={size!r} sizes a built-in task; a train_fn builds its own model")
    dev = resolve_device(device)
    task_info, size, samples_per_step = describe_task(
        train_fn, task, size, steps, batch_size, seed, metric, metric_direction, samples_per_step, dev
    )
    metric = task_info.metric
    plan = plan_runs(precisions, dev)
    if precisions is None and task is not None:  # the default experiment also measures its own noise
        plan.insert(1, (f"{plan[0][0]} (seed {seed + 1})", False))
    state_dir, owned, kept = open_out(out, resume, plan)
    report = new_report(command or "ampkit.compare(...)", task_info, dev, plan[0][0])
    base = RunSpec(
        precision="",
        device=str(dev),
        seed=seed,
        task=task,
        steps=task_info.steps or None,
        size=size,
        batch_size=batch_size,
        train_fn=train_fn,
        samples_per_step=samples_per_step,
        nproc=nproc,
        numerics_steps=NUMERICS_STEPS if numerics else 0,
    )
    specs = specs_for(plan, base, kept, kwargs_of, state_dir, owned)
    progress = RunProgress(show)
    turns = isolate and task is not None and nproc == 1
    before = check_load(dev)  # the machine as the runs found it; again after them, and the busier look is kept
    run_all(plan, specs, kept, report, metric, dev, isolate, progress, turns, steps is None, (state_dir, owned))
    report.machine["load"] = worst(before, check_load(dev, own=torch.get_num_threads() * nproc)).as_dict()
    compare_to_baseline(report)
    extra_plots, sections = {}, []
    if out is not None and task is not None and not report.interrupted:
        progress.say("sizing each precision's largest batch (ampkit plan)...")
        extra_plots = _planned(report, task, size, seed, batch_size, dev, Path(out), progress.say)
        sections = _exported(task, Path(out), seed, progress, verbose) if inference else []
    if out is not None:
        try:
            write_report(report, out, extra_plots, sections)
        except ValueError as exc:  # never lose a finished comparison to a report bug
            raw = Path(out) / "report.unvalidated.json"
            assert owned is not None
            owned.claim([raw.name])
            raw.write_text(json.dumps(report.to_dict(), indent=2, default=str))
            warnings.warn(f"{exc}; the raw figures are in {raw}", stacklevel=2)
    if show:
        render_table(report)
    if report.interrupted:
        raise KeyboardInterrupt
    return report.to_dict()


def _check_args(
    train_fn: TrainFn | None,
    task: str | None,
    steps: int | None,
    batch_size: int | None,
    nproc: int,
    isolate: bool,
    resume: bool,
    out: str | Path | None,
    inference: bool = False,
) -> None:
    """The arguments a comparison can reject before it starts anything."""
    if (train_fn is None) == (task is None):
        raise ValueError("compare() needs exactly one of train_fn=... or task='...'")
    for name, value in (("steps", steps), ("batch_size", batch_size), ("nproc", nproc)):
        if (value is not None or name == "nproc") and (not isinstance(value, int) or value < 1):
            what = " (processes per precision)" if name == "nproc" else ""
            raise ValueError(f"{name}={value!r}: expected an integer >= 1{what}")
    if resume and out is None:
        raise ValueError("resume=True needs out=: the folder of the comparison to continue")
    if inference and (task is None or out is None):
        raise ValueError("inference=True needs task= and out=: a built-in task's model is exported into out/")
    if isolate and train_fn is not None:
        try:
            pickle.dumps(train_fn)
        except Exception as exc:
            raise TypeError(
                f"train_fn={train_fn!r} cannot be sent to a fresh process ({exc}); define it at module level "
                f"(not a lambda or a nested function), or pass isolate=False to run every precision in this process"
            ) from None


def _accelerator_kwargs(given: dict[str, Any] | None) -> Any:
    """`compare(accelerator_kwargs=)` checked up front, as a function: preset name -> its Accelerator kwargs."""
    given = dict(given or {})
    allowed = set(inspect.signature(Accelerator).parameters) - {"precision", "device"}
    common = {k: v for k, v in given.items() if k not in PRESETS}
    for name, value in [("", common), *((k, v) for k, v in given.items() if k in PRESETS)]:
        if not isinstance(value, dict) or set(value) - allowed:
            where = f"[{name!r}]" if name else ""
            raise ValueError(
                f"accelerator_kwargs{where}={value!r}: expected Accelerator arguments "
                f"({', '.join(sorted(allowed))}); precision and device are compare()'s own"
            )
    return lambda name: {**common, **given.get(name, {})}


def plan_runs(precisions: list[str] | tuple[str, ...] | None, dev: torch.device) -> list[tuple[str, bool]]:
    """(preset, probe?) in the order they run; the first is the baseline."""
    if precisions is None:
        full, probes = default_precisions(dev)
        return [(p, False) for p in full] + [(p, True) for p in probes if p not in full]
    unknown = [p for p in precisions if p not in PRESETS and p != "auto"]
    if unknown or not precisions:
        raise PrecisionError(f"unknown precision(s) {unknown!r}; choose from: {', '.join([*PRESETS, 'auto'])}")
    return [(p, False) for p in dict.fromkeys(auto_precision(dev)[0] if p == "auto" else p for p in precisions)]


def new_report(command: str, task: Task, dev: torch.device, baseline: str) -> Report:
    """A comparison's report before its runs, stamped now."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return Report(
        ampkit_version=ampkit_version(),
        command=command,
        task=task,
        created=now,
        machine=describe(dev),
        baseline=baseline,
    )


def _planned(
    report: Report,
    task: str,
    size: str | None,
    seed: int,
    batch_size: int | None,
    dev: torch.device,
    out: Path,
    say: Callable[[str], None],
) -> dict[str, Path]:
    """{"plan": out/plan.png}: the peak `ampkit plan` predicted for each precision that ran, by part, and each
    run's `largest_batch` (the plan's search within the device's memory); {} where planning or plotting fails
    (a warning says why: the comparison itself stands)."""
    ran = (r.precision.split(" ")[0] for r in report.runs if r.status in ("ok", "probe"))
    precisions = list(dict.fromkeys(ran))
    if not precisions:
        return {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the runs already said what is slow here
            result = plan_task(
                task,
                precisions,
                size=size,
                seed=seed,
                batch_size=batch_size,
                device=dev,
                progress=lambda line: say(f"  {line}"),
            )
        largest = {row.precision: row.max_batch_size for row in result.rows}
        for run in report.runs:
            run.largest_batch = largest.get(run.precision.split(" ")[0])
        report.plan_memory_bytes = result.memory_bytes
        OwnedFiles(out).claim(["plan.png"])
        return {"plan": plot_png(result, out / "plan.png")}
    except (ImportError, ValueError, RuntimeError, AmpkitError) as exc:
        warnings.warn(f"no predicted-memory plot in the report: ampkit plan failed: {exc}", stacklevel=3)
        return {}


def _exported(task: str, out: Path, seed: int, progress: RunProgress, verbose: bool) -> list[str]:
    """`ampkit export` after the runs: the task's fp32-trained model in each precision and backend, measured,
    as the page's section ([] where it fails: a warning says why, the comparison stands)."""
    progress.say("exporting the fp32-trained model in each precision and timing it (ampkit export)...")
    try:
        with held_back(show=verbose) as held:
            result = measure_inference(task, out=out, seed=seed, progress=lambda line: progress.say(f"  {line}"))
    except (ImportError, ValueError, RuntimeError, OSError) as exc:
        warnings.warn(f"no inference section in the report: ampkit export failed: {exc}", stacklevel=3)
        return []
    if summary := held.summary():
        progress.say(summary)
    if progress.show:
        print(format_inference(result), end="")
    return [render_html_section(result)]
