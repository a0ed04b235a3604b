"""`DoctorSession`: watch an Accelerator for a few steps, then say where the step time goes.

Three windows: **warm-up** (nothing measured while caches settle); **profiled** (a few steps:
`torch.profiler` records ops with FLOPs and shapes — only counts and ratios are taken from these slowed
steps); **timed** (the rest: step and phase times, host times from `PhaseClock`: on CUDA they say where
the Python thread spends the step). The sync watcher names the tensor reads in both measured windows, so
that a read every k-th step is seen; `PhaseClock` takes its cost off every phase. Then
`analysis.Analysis` builds the result (`DOCTOR_SCHEMA`).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ampkit.accelerator import Accelerator
from ampkit.engine.data import DeviceLoader
from ampkit.engine.events import Listener
from ampkit.engine.optim import AmpOptimizer
from ampkit.tools.doctor.perf import advisor
from ampkit.tools.doctor.perf.analysis import Analysis
from ampkit.tools.doctor.perf.schema import PHASES
from ampkit.tools.doctor.perf.sync import SyncWatcher
from ampkit.tools.doctor.watch import DoctorError, Result, Watch, check_counts
from ampkit.tools.timing import sync_device

#: Most steps the profiler records (it slows each; op counts repeat from step to step).
MAX_PROFILED_STEPS = 5

#: A line of kineto's log ("USDT:2026-01-01 10:00:00 71:71 SyncActivityProfilerHandler.cpp:52] ..."),
#: written to fd 2 at every profiler start and stop whatever KINETO_LOG_LEVEL says: filtered out.
KINETO_NOISE = re.compile(r"^(USDT|STAGE|INFO):\d{4}-\d\d-\d\d [\d:.]+ \d+:\d+ \S+\.cpp:\d+\] ")


@contextlib.contextmanager
def quiet_kineto() -> Iterator[None]:
    """Run the block with fd 2 going to a temporary file, then write back all but kineto's noise."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 to redirect
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not KINETO_NOISE.match(line))
            if kept:
                os.write(2, kept.encode())


def _cuda_mark() -> torch.cuda.Event:
    mark = torch.cuda.Event(enable_timing=True)
    mark.record()
    return mark


class PhaseClock(Listener):
    """Host seconds per phase (`PHASES`) in the current step, while `active`, and the samples and batch
    bytes it loaded; `take()` returns them and starts the next step; `hook(stack)` adds module hooks.

    The loader's batch wait is *data*, its copy *h2d*; from the first model call after a batch (torch's
    global module hooks) to `acc.backward` *forward*; `acc.backward` *backward*; the optimizers' `step`
    and `zero_grad` *optimizer*; the rest *other*. Its clock (`now()`) is `time.perf_counter()` less `charge()`:
    the seconds a watcher of the step has cost so far, so that no phase counts the watching."""

    def __init__(self, charge: Callable[[], float] = lambda: 0.0) -> None:
        self.charge = charge
        self.active = False
        self.in_data = False  # inside the data loader: tensor reads there are host-side
        self._started: dict[str, float] = {}  # phase -> when its current span started
        self._module_depth = 0
        self._reset()

    def _reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.samples: int | None = None
        self.batch_bytes = 0
        self._forward_start: float | None = None  # a model call not followed by backward: "other"
        self._forward_excluded = 0.0  # data/h2d time that fell inside the forward span

    def now(self) -> float:
        """Seconds on the clock: `time.perf_counter()` less what watching the step has cost so far."""
        return time.perf_counter() - self.charge()

    def take(self) -> tuple[dict[str, float], int | None, int]:
        """This step's (seconds per phase, samples, batch bytes); the clock starts the next step."""
        out = (self.seconds, self.samples, self.batch_bytes)
        self._reset()
        return out

    def hook(self, stack: contextlib.ExitStack) -> None:
        for handle in (
            nn.modules.module.register_module_forward_pre_hook(self._forward_pre),
            nn.modules.module.register_module_forward_hook(self._forward_post, always_call=True),
        ):
            stack.callback(handle.remove)

    def add(self, phase: str, seconds: float) -> None:
        if self.active:
            self.seconds[phase] += seconds
            if phase in ("data", "h2d") and self._forward_start is not None:
                self._forward_excluded += seconds

    def start(self, phase: str) -> None:
        self._started[phase] = self.now()
        if phase != "data":  # a loader that ran out sends no batch-wait end: this is past it
            self.in_data = False

    def end(self, phase: str, now: float | None = None) -> None:
        start = self._started.pop(phase, None)
        if start is not None:
            self.add(phase, max(0.0, (now or self.now()) - start))

    # --- the events -----------------------------------------------------------------------------
    def on_batch_wait_start(self, loader: DeviceLoader) -> None:
        self.in_data = True
        self.start("data")

    def on_batch_wait_end(self, loader: DeviceLoader, batch: Any) -> None:
        self.end("data")
        self.in_data = False
        if not self.active:
            return
        tensors = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]  # a nested batch's
        if tensors and tensors[0].dim() > 0:
            self.samples = (self.samples or 0) + int(tensors[0].shape[0])
        self.batch_bytes += sum(t.numel() * t.element_size() for t in tensors)

    def on_h2d_start(self, loader: DeviceLoader, batch: Any) -> None:
        self.start("h2d")

    def on_h2d_end(self, loader: DeviceLoader, batch: Any) -> None:
        self.end("h2d")

    def on_backward_start(self, acc: Any, loss: torch.Tensor) -> None:
        if self._forward_start is not None:
            self.add("forward", max(0.0, self.now() - self._forward_start - self._forward_excluded))
            self._forward_start = None
        self.start("backward")

    def on_backward_end(self, acc: Any) -> None:
        self.end("backward")

    def on_step_start(self, optimizer: AmpOptimizer) -> None:
        self.start("optimizer")

    def on_step_end(self, optimizer: AmpOptimizer, stepped: bool = True) -> None:
        self.end("optimizer")

    on_zero_grad_start, on_zero_grad_end = on_step_start, on_step_end  # both are the optimizer's phase

    # --- torch's module hooks -----------------------------------------------------------------
    def _forward_pre(self, module: nn.Module, args: Any) -> None:
        self._module_depth += 1
        if self._module_depth == 1 and self._forward_start is None and self.active:
            self._forward_start = self.now()
            self._forward_excluded = 0.0

    def _forward_post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._module_depth = max(0, self._module_depth - 1)


class DoctorSession(Watch):
    """Measures `steps` optimizer steps of `acc` after `warmup` (a quarter of them, at most
    `MAX_PROFILED_STEPS`, profiled). `gpu`: the GPU findings quote (`advisor.GPUS`); `bench`: measure
    this device's matmul peak and bandwidth (else the figures that need them are "unknown")."""

    def __init__(
        self,
        acc: Accelerator,
        *,
        steps: int = 20,
        warmup: int = 5,
        gpu: str = "A100",
        stop: bool = False,
        subject: Result | None = None,
        on_done: Callable[[Result], None] | None = None,
        bench: bool = True,
    ) -> None:
        super().__init__(acc, steps=steps, warmup=warmup, stop=stop, subject=subject, on_done=on_done)
        check_counts(steps, warmup)
        self.gpu = advisor.find_gpu(gpu)
        self.profiled_target = max(1, min(MAX_PROFILED_STEPS, steps // 4))
        self.bench = bench
        self.syncs = SyncWatcher(acc.device, ignore=lambda: self.clock.in_data, host_born=True)
        self.clock = PhaseClock(charge=self.syncs.cost)
        self.profiled_events: list[Any] | None = None  # torch.profiler's, of the profiled steps
        self.rows: dict[str, list[Result]] = {"profiled": [], "timed": []}  # per measured step
        self.cuda_marks: list[torch.cuda.Event] = []  # CUDA events at the timed steps' ends
        self._profiler: torch.profiler.profile | None = None
        self._window = "warmup"
        self._step_start = 0.0
        self.attach()

    def started(self) -> None:
        self.acc.events.add(self.clock)
        self.hooks.callback(self.acc.events.remove, self.clock)
        self.clock.hook(self.hooks)
        self.hooks.callback(self._stop_watching)
        self.hooks.callback(self._stop_profiler, keep=False)
        if self.warmup == 0:
            self._open("profiled")

    def step_ended(self) -> None:
        """End of an optimizer step: close the step's figures, move between windows."""
        now = self.clock.now()
        self.clock.end("optimizer", now)
        if self._window in self.rows:
            seconds, samples, batch_bytes = self.clock.take()
            self.syncs.step += 1  # the reads from here on belong to the next step
            self.rows[self._window].append(
                {"host_s": now - self._step_start, "phases": seconds, "samples": samples, "batch_bytes": batch_bytes}
            )
            if self.acc.device.type == "cuda" and self._window == "timed":
                self.cuda_marks.append(_cuda_mark())
        if self._window == "warmup" and self.seen_steps >= self.warmup:
            self._open("profiled")
        elif self._window == "profiled" and len(self.rows["profiled"]) >= self.profiled_target:
            self._stop_profiler()
            self._open("timed" if self.steps > self.profiled_target else "done")
        elif self._window == "timed" and len(self.rows["timed"]) >= self.steps - self.profiled_target:
            self._window = "done"
        if self._window == "done":
            self._stop_watching()
            self.done()
        self._step_start = self.clock.now()  # the doctor's own bookkeeping is in no step

    def _open(self, window: str) -> None:
        self._window = window
        if window == "done":
            return
        sync_device(self.acc.device)
        if window == "profiled":
            self.syncs.install()
            self.syncs.start_cuda_debug()
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.acc.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with warnings.catch_warnings(), quiet_kineto():
                warnings.simplefilter("ignore")  # kineto's start-up chatter is not the user's business
                self._profiler = torch.profiler.profile(activities=activities, record_shapes=True, with_flops=True)
                self._profiler.start()
            self.syncs.active = True
        elif window == "timed" and self.acc.device.type == "cuda":
            self.cuda_marks = [_cuda_mark()]
        self.clock.take()
        self.clock.active = True
        self._step_start = self.clock.now()

    def _stop_profiler(self, keep: bool = True) -> None:
        """End the profiled window: the profiler's events (`keep`). The sync watcher goes on to the last step."""
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            with warnings.catch_warnings(), quiet_kineto():
                warnings.simplefilter("ignore")
                sync_device(self.acc.device)
                profiler.stop()
                if keep:
                    self.profiled_events = list(profiler.events())

    def _stop_watching(self) -> None:
        """The sync watcher's end (idempotent): it watched every measured step, profiled and timed."""
        self.syncs.active = False
        self.syncs.uninstall()

    # --- finishing ----------------------------------------------------------------------------
    def measured(self) -> int:
        return len(self.rows["profiled"]) + len(self.rows["timed"])

    def wrap_up(self) -> None:
        self.clock.active = False
        try:
            self._stop_profiler()
        finally:
            self._stop_watching()

    def build(self) -> Result:
        if not self.rows["profiled"]:
            raise DoctorError(
                f"no step was measured: the loop ran {self.seen_steps} optimizer step(s) and the doctor "
                f"skips the first {self.warmup} as warm-up; run more steps or lower warmup"
            )
        return Analysis(self).result()
