"""One precision's run, measured (in each run's own process, or with `isolate=False` in the comparison): train,
then read the `Recorder` (per-step figures, gathered without syncs) and the memory probe into a `Run`."""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from ampkit.accelerator import Accelerator
from ampkit.engine.events import Listener
from ampkit.hardware.capability import resolve_device
from ampkit.precision.outcomes import Outcome
from ampkit.precision.policy import PRESETS, dtype_name
from ampkit.tools.compare.memory import Memory
from ampkit.tools.compare.records import MemoryKind, Numerics, Policy, Run
from ampkit.tools.records import build
from ampkit.tools.tasks import get_task

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


def _prepared(acc: Accelerator, spec: RunSpec, memory: Memory | None = None) -> tuple[Any, ...]:
    """The built-in task, its data, and its model, optimizer and loader prepared (`memory` from the model)."""
    task = get_task(spec.task or "", spec.size)
    data = task.make_data(spec.seed, spec.batch_size or task.default_batch_size)
    if memory is not None:
        memory.mark()
    model = task.make_model(spec.seed)
    optimizer = task.make_optimizer(model.parameters(), task.default_lr)
    return task, data, *acc.prepare(model, optimizer, data.train_loader)


def train_task(
    acc: Accelerator, spec: RunSpec, steps: int, memory: Memory, pause: Callable[[int], int | None]
) -> tuple[dict[str, float], dict[str, int]]:
    """The built-in task's loop (`Task.training`) up to the step `pause(steps done)` names, again and again
    until it names none it has not reached (`steps` without interleaving); its metrics and memory parts."""
    task, data, model, optimizer, loader = _prepared(acc, spec, memory)
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
    parts = {
        "weights": weights,
        "gradients": weights,  # a gradient per weight, in its dtype
        "optimizer state": sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)),
    }
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
        acc = Accelerator(
            precision=spec.precision,
            device=device,  # the comparison's settings, not AMPKIT_*
            **{"grad_accum_steps": 1, "compile": False, **spec.accelerator_kwargs},
        )
    notes = [str(w.message) for w in caught]
    recorder = Recorder(acc, on_step=progress)
    acc.events.add(recorder)
    steps = (
        PROBE_STEPS if spec.probe else spec.steps or (get_task(spec.task, spec.size).default_steps if spec.task else 0)
    )
    seen = [0]

    def pause(done: int) -> int | None:
        if gate is None:
            return steps
        times = recorder.step_times()
        if device.type == "cuda":  # the runs share the GPU while they take turns: hand back the cached blocks
            torch.cuda.empty_cache()
        target = gate(done, times[seen[0] :])
        seen[0] = len(times)
        recorder.restart()
        return target

    start = time.perf_counter()
    if spec.train_fn is not None:
        metrics, parts = dict(spec.train_fn(acc)), None
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
        notes.append(
            f"resumed from a checkpoint at step {resumed_at}: the loss curve and timings cover the steps after it"
        )
    if spec.probe:  # why its figures are timing only, in place of any notes
        dtype = dtype_name(PRESETS[spec.precision].compute_dtype)
        notes = [
            f"timing only: {device.type} runs {dtype} slowly here, so a full run was left out; name it "
            f"in --precisions to run it fully"
        ]
    median = summary["step_time_median_s"]
    return Run(
        precision=spec.precision,
        status="probe" if spec.probe else "ok",
        reason="; ".join(notes) or None,
        policy=build(Policy, acc.policy.as_dict()),
        **summary,
        skipped_steps=skipped,
        # every process trains a batch per step: the job's throughput is nproc times one rank's
        samples_per_s=spec.samples_per_step * spec.nproc / median if spec.samples_per_step and median else None,
        memory_kind=cast(MemoryKind, kind),  # Memory.read() names one of MEMORY_KINDS
        peak_memory_bytes=peak,
        peak_rss_bytes=raw,
        memory_parts=parts,
        eval={k: float(v) for k, v in metrics.items()},
        wall_time_s=wall,
        numerics=numerics,
    )


def numerics_pass(spec: RunSpec, device: torch.device) -> Numerics:
    """The same training's first `spec.numerics_steps` steps on a fresh model under the numerics doctor, after
    the timed run (in none of its figures); a failed diagnosis is its `error`."""
    from ampkit.tools.doctor import numerics_train_fn, summarize

    seed_everything(spec.seed)
    steps = spec.numerics_steps
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the run has recorded the Accelerator's warnings already
            result = numerics_train_fn(
                spec.train_fn or functools.partial(_train_forever, spec),
                steps=steps,
                precision=spec.precision,
                device=device,
                accelerator_kwargs=spec.accelerator_kwargs,
            )
    except Exception as exc:  # noqa: BLE001 - a failed diagnosis is reported beside the run
        return Numerics(
            steps=0,
            at_risk=[],
            keep_fp32=[],
            lost_update_share=None,
            loss_scale=None,
            top_finding=None,
            problem=None,
            error=f"{type(exc).__name__}: {exc}",
            detail=None,
        )
    return Numerics(**summarize(result))


def _train_forever(spec: RunSpec, acc: Accelerator) -> dict[str, float]:
    """The task's loop for the numerics pass, which stops it after the steps it watches."""
    task, _, model, optimizer, loader = _prepared(acc, spec)
    for _ in task.training(acc, model, optimizer, loader):
        pass
    return {}


class Recorder(Listener):
    """A run's per-step losses, step times and loss-scale outcomes, from the events of `acc` (the Accelerator
    the training code gets): each loss passed to `acc.backward` (kept on the device), a timestamp at each step
    of the first prepared optimizer (a CUDA event on a GPU: the host never waits) and each step's outcome.
    `summary()` reads it all back once, at the end."""

    def __init__(self, acc: Accelerator, on_step: Callable[[int], None] | None = None) -> None:
        self.acc = acc
        self.cuda = acc.device.type == "cuda"
        # One slot per acc.backward in one preallocated device buffer (doubled when full): keeping
        # thousands of tiny tensors alive instead fragments the host heap and RSS creeps up.
        self.losses = torch.empty(1024, dtype=torch.float32, device=acc.device)
        self.count = 0
        self.bounds: list[int] = []  # self.count at each optimizer step
        self.stamps: list[Any] = [self._stamp()]  # perf_counter floats, or CUDA events
        self.outcomes: list[Outcome] = []
        self.on_step = on_step
        self.paused: set[int] = set()  # indexes of the stamp intervals that were pauses, not steps

    def _stamp(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def on_backward_start(self, acc: Any, loss: torch.Tensor) -> None:
        """Keep one micro-step's loss (a device-to-device copy: no sync)."""
        if self.count == len(self.losses):
            self.losses = torch.cat([self.losses, torch.empty_like(self.losses)])
        self.losses[self.count] = loss.detach().reshape(())
        self.count += 1

    def on_step_end(self, optimizer: Any, stepped: bool) -> None:
        """Mark an optimizer step: the micro-step losses since the last mark belong to it."""
        if not stepped or optimizer is not self.acc.optimizers[0]:
            return
        self.bounds.append(self.count)
        self.stamps.append(self._stamp())
        if self.on_step is not None:
            self.on_step(len(self.bounds))

    def on_outcome(self, optimizer: Any, outcome: Outcome) -> None:
        if optimizer is self.acc.optimizers[0]:
            self.outcomes.append(outcome)

    def restart(self) -> None:
        """Training resumes after a pause (another run's turn): the time since the last step is no step's."""
        self.paused.add(len(self.stamps) - 1)
        self.stamps.append(self._stamp())

    @property
    def steps(self) -> int:
        return len(self.bounds)

    def loss_curve(self) -> list[float]:
        """Mean loss of each optimizer step's micro-steps (NaN where non-finite). One sync."""
        if not self.count:
            return []
        values = self.losses[: self.count].tolist()  # sync: once, after the run
        chunks = [values[start:end] for start, end in zip([0, *self.bounds], self.bounds)]
        return [sum(chunk) / len(chunk) if chunk else math.nan for chunk in chunks]

    def step_times(self) -> list[float]:
        """Seconds between consecutive optimizer steps (the whole iteration: data, forward, backward, update)."""
        if self.cuda:
            self.stamps[-1].synchronize()  # sync: after the run, or at a pause between rounds
        pairs = [p for i, p in enumerate(zip(self.stamps, self.stamps[1:])) if i not in self.paused]
        return [a.elapsed_time(b) / 1e3 if self.cuda else b - a for a, b in pairs]

    def summary(self, warmup: int) -> dict[str, Any]:
        """Median step time (warm-up dropped), loss curve and the scale history: `Run` fields."""
        times = self.step_times()
        kept = times[warmup:] or times
        return {
            "steps": self.steps,
            "warmup_steps": min(warmup, len(times)),
            "step_time_median_s": statistics.median(kept) if kept else None,
            "loss_curve": self.loss_curve(),
            "scale_history": [o.scale for o in self.outcomes] or None,
        }
