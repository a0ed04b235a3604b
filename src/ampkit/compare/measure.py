"""One precision's run, measured: train, then read the recorder and the memory probe into a `Run`.

This is what each spawned process (or, with `isolate=False`, the comparison itself) does once.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ampkit.accelerator import Accelerator
from ampkit.compare.memory import Memory
from ampkit.compare.records import Numerics, Policy, Run
from ampkit.compare.recorder import Recorder
from ampkit.hardware import resolve_device
from ampkit.schema import build
from ampkit.tasks import get_task

TrainFn = Callable[[Accelerator], dict[str, float]]
Gate = Callable[[int, list[float]], "int | None"]
"""An interleaved run's pause: (steps done, the chunk's step times) -> the step to train up to, None: stop."""

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
    size: str | None = None  # the task's model size (`tasks.get_task`); None: its default
    steps: int | None = None
    batch_size: int | None = None
    train_fn: TrainFn | None = None
    probe: bool = False
    samples_per_step: int | None = None
    checkpoints: str | None = None  # folder to checkpoint into and resume from (built-in tasks)
    nproc: int = 1  # > 1: run under torchrun with this many processes (data parallel)
    numerics_steps: int = 0  # > 0: after the timed run, a pass of this many steps under the numerics doctor
    accelerator_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # this precision's, resolved


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train_task(acc: Accelerator, spec: RunSpec, steps: int, memory: Memory,
               pause: Callable[[int], int | None]) -> tuple[dict[str, float], dict[str, int]]:
    """The built-in task's loop (`Task.training`) up to the step `pause(steps done)` names, again and again
    until it names none it has not reached (`steps` without interleaving); its metrics and memory parts."""
    task = get_task(spec.task or "", spec.size)
    data = task.make_data(spec.seed, spec.batch_size or task.default_batch_size)
    memory.mark()
    model = task.make_model(spec.seed)
    optimizer = task.make_optimizer(model.parameters(), task.default_lr)
    model, optimizer, loader = acc.prepare(model, optimizer, data.train_loader)
    every = max(1, steps // 10)
    if spec.checkpoints is not None:
        acc.resume(spec.checkpoints)
    done = optimizer.attempted_steps  # from the step a resumed run reached
    target, training = pause(done), task.training(acc, model, optimizer, loader)
    while target is not None and done < target:
        next(training)
        done += 1
        if spec.checkpoints is not None and done % every == 0 and done < steps:
            acc.save_checkpoint(spec.checkpoints, keep=2)
        if done == target:
            target = pause(done)
    memory.freeze()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    tensors = torch.utils._pytree.tree_leaves(optimizer.state_dict())
    parts = {"weights": weights, "gradients": weights,  # a gradient per weight, in its dtype
             "optimizer state": sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))}
    return ({} if spec.probe else task.evaluate(model, data, acc.device)), parts


def run_one(spec: RunSpec, progress: Callable[[int], None] | None = None, gate: Gate | None = None) -> Run:
    """Train one precision and return its run record (a `runs[i]` of report.json, before ratios).

    With `gate` (a built-in task only), training pauses at each step `gate` names and reports that
    chunk's step times: how a comparison interleaves its runs. The pauses are in no step time.
    """
    device = resolve_device(spec.device)
    seed_everything(spec.seed)
    memory = Memory(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = Accelerator(precision=spec.precision, device=device,  # the comparison's settings, not AMPKIT_*
                          **{"grad_accum_steps": 1, "compile": False, **spec.accelerator_kwargs})
    notes = [str(w.message) for w in caught]
    recorder = Recorder(acc, on_step=progress)
    acc.events.add(recorder)
    steps = PROBE_STEPS if spec.probe else spec.steps or (get_task(spec.task, spec.size).default_steps if spec.task else 0)
    seen = [0]

    def pause(done: int) -> int | None:
        if gate is None:
            return steps
        times = recorder.step_times()
        if device.type == "cuda":  # the runs share the GPU while they take turns: hand back the cached blocks
            torch.cuda.empty_cache()
        target = gate(done, times[seen[0]:])
        seen[0] = len(times)
        recorder.restart()
        return target

    start = time.perf_counter()
    parts = None
    if spec.train_fn is not None:
        metrics = dict(spec.train_fn(acc))
    else:
        metrics, parts = train_task(acc, spec, steps, memory, pause)
    skipped = acc.state.skipped_steps  # waits for the outcomes still in flight: the run is over
    wall = time.perf_counter() - start
    summary = recorder.summary(2 if spec.probe else min(10, recorder.steps // 10))
    peak, raw, kind = memory.read()
    # After every figure above is taken: the pass's hooks, copies and reads are in none of them.
    numerics = numerics_pass(spec, device) if spec.numerics_steps and spec.nproc == 1 else None
    resumed_at = acc.optimizers[0].attempted_steps - recorder.steps if acc.optimizers else 0
    if resumed_at > 0:
        notes.append(f"resumed from a checkpoint at step {resumed_at}: the loss curve and timings cover the steps after it")
    median = summary["step_time_median_s"]
    return Run(
        precision=spec.precision, status="probe" if spec.probe else "ok", reason="; ".join(notes) or None,
        policy=build(Policy, acc.policy.as_dict()),
        **summary, skipped_steps=skipped,
        # every process trains a batch per step: the job's throughput is nproc times one rank's
        samples_per_s=spec.samples_per_step * spec.nproc / median if spec.samples_per_step and median else None,
        memory_kind=kind, peak_memory_bytes=peak, peak_rss_bytes=raw,
        eval={k: float(v) for k, v in metrics.items()}, wall_time_s=wall, numerics=numerics, memory_parts=parts,
    )


def numerics_pass(spec: RunSpec, device: torch.device) -> Numerics:
    """`spec.numerics_steps` steps of the same training under the numerics doctor, on a fresh model.

    A pass of its own after the timed run, so that the run's step times, peak memory and wall time
    stay those of plain training; the same seed, so it watches the run's first batches. A failed
    diagnosis is its `error`, never a failed run.
    """
    from ampkit.doctor import numerics_train_fn, summarize

    seed_everything(spec.seed)
    steps = spec.numerics_steps
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the run has recorded the Accelerator's warnings already
            result = numerics_train_fn(spec.train_fn or functools.partial(_train_forever, spec), steps=steps,
                                       precision=spec.precision, device=device, accelerator_kwargs=spec.accelerator_kwargs)
    except Exception as exc:  # noqa: BLE001 - a failed diagnosis is reported beside the run
        return Numerics(steps=0, at_risk=[], keep_fp32=[], lost_update_share=None, loss_scale=None,
                        top_finding=None, problem=None, error=f"{type(exc).__name__}: {exc}", detail=None)
    return Numerics(**summarize(result))



def _train_forever(spec: RunSpec, acc: Accelerator) -> dict[str, float]:
    """The task's loop for the numerics pass, which stops it after the steps it watches."""
    task = get_task(spec.task or "", spec.size)
    data = task.make_data(spec.seed, spec.batch_size or task.default_batch_size)
    model = task.make_model(spec.seed)
    model, optimizer, loader = acc.prepare(model, task.make_optimizer(model.parameters(), task.default_lr),
                                           data.train_loader)
    for _ in task.training(acc, model, optimizer, loader):
        pass
    return {}
