"""`DoctorSession`: watch an Accelerator for a few steps, then say where the step time goes.

Three windows: **warm-up** (nothing measured while caches settle); **profiled** (a few steps:
`torch.profiler` records ops with FLOPs and shapes, the sync watcher names the tensor reads — only
counts and ratios are taken from these slowed steps); **timed** (the rest: step and phase times).
Then `analysis.Analysis` builds the result (`DOCTOR_SCHEMA`).
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

from ampkit.accelerator import Accelerator
from ampkit.doctor import advisor
from ampkit.doctor.analysis import Analysis, sync_device
from ampkit.doctor.phases import PhaseClock
from ampkit.doctor.sync import SyncWatcher
from ampkit.doctor.watch import DoctorError, Result, Watch, check_counts

#: Most steps the profiler records: op counts repeat from step to step, so a few are enough, and
#: the profiler slows each step it records.
MAX_PROFILED_STEPS = 5


#: A line of kineto's log ("USDT:2026-01-01 10:00:00 71:71 SyncActivityProfilerHandler.cpp:52]
#: profiler_start"): its C++ writes these to fd 2 at every profiler start and stop, whatever
#: KINETO_LOG_LEVEL says, so the doctor filters them out of its own profiling.
KINETO_NOISE = re.compile(r"^(USDT|STAGE|INFO):\d{4}-\d\d-\d\d [\d:.]+ \d+:\d+ \S+\.cpp:\d+\] ")


def without_kineto_noise(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if not KINETO_NOISE.match(line))


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
            kept = without_kineto_noise(captured.read().decode(errors="replace"))
            if kept:
                os.write(2, kept.encode())


def _cuda_mark() -> torch.cuda.Event:
    mark = torch.cuda.Event(enable_timing=True)
    mark.record()
    return mark


class DoctorSession(Watch):
    """Measures `steps` optimizer steps of `acc` after `warmup` (a quarter of them, at most
    `MAX_PROFILED_STEPS`, profiled). `gpu`: the GPU findings quote (`advisor.GPUS`); `bench`: measure
    this device's matmul peak and bandwidth (else the figures that need them are "unknown")."""

    def __init__(self, acc: Accelerator, *, steps: int = 20, warmup: int = 5, gpu: str = "A100",
                 stop: bool = False, subject: Result | None = None,
                 on_done: Callable[[Result], None] | None = None, bench: bool = True) -> None:
        super().__init__(acc, steps=steps, warmup=warmup, stop=stop, subject=subject, on_done=on_done)
        check_counts(steps, warmup)
        self.gpu = advisor.find_gpu(gpu)
        self.profiled_target = max(1, min(MAX_PROFILED_STEPS, steps // 4))
        self.bench = bench
        self.clock = PhaseClock()
        self.syncs = SyncWatcher(acc.device, ignore=lambda: self.clock.in_data, host_born=True)
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
        self.hooks.callback(self._stop_profiler, keep=False)
        if self.warmup == 0:
            self._open("profiled")

    def step_ended(self) -> None:
        """End of an optimizer step: close the step's figures, move between windows."""
        now = time.perf_counter()
        self.clock.end_optimizer(now)
        if self._window in self.rows:
            self._close_step(now)
        if self._window == "warmup" and self.seen_steps >= self.warmup:
            self._open("profiled")
        elif self._window == "profiled" and len(self.rows["profiled"]) >= self.profiled_target:
            self._stop_profiler()
            self._open("timed" if self.steps > self.profiled_target else "done")
        elif self._window == "timed" and len(self.rows["timed"]) >= self.steps - self.profiled_target:
            self._window = "done"
        if self._window == "done":
            self.done()
        self._step_start = time.perf_counter()  # the doctor's own bookkeeping is in no step

    def _close_step(self, now: float) -> None:
        seconds, samples, batch_bytes = self.clock.take()
        if self._window == "profiled":
            self.syncs.step += 1  # the reads from here on belong to the next step
        self.rows[self._window].append({"host_s": now - self._step_start, "phases": seconds,
                                         "samples": samples, "batch_bytes": batch_bytes})
        if self.acc.device.type == "cuda" and self._window == "timed":
            self.cuda_marks.append(_cuda_mark())

    def _open(self, window: str) -> None:
        self._window = window
        if window == "done":
            return
        sync_device(self.acc.device)
        if window == "profiled":
            self.syncs.install()
            self.syncs.start_cuda_debug()
            self._start_profiler()
            self.syncs.active = True
        elif window == "timed" and self.acc.device.type == "cuda":
            self.cuda_marks = [_cuda_mark()]
        self.clock.take()
        self.clock.active = True
        self._step_start = time.perf_counter()

    def _start_profiler(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.acc.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with warnings.catch_warnings(), quiet_kineto():
            warnings.simplefilter("ignore")  # kineto's start-up chatter is not the user's business
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True, with_flops=True)
            self._profiler.start()

    def _stop_profiler(self, keep: bool = True) -> None:
        """End the profiled window: the profiler's events (`keep`) and the sync watcher."""
        self.syncs.active = False
        try:
            if self._profiler is not None:
                profiler, self._profiler = self._profiler, None
                with warnings.catch_warnings(), quiet_kineto():
                    warnings.simplefilter("ignore")
                    sync_device(self.acc.device)
                    profiler.stop()
                    if keep:
                        self.profiled_events = list(profiler.events())
        finally:
            self.syncs.uninstall()

    # --- finishing ----------------------------------------------------------------------------
    def measured(self) -> int:
        return len(self.rows["profiled"]) + len(self.rows["timed"])

    def wrap_up(self) -> None:
        self.clock.active = False
        self._stop_profiler()

    def build(self) -> Result:
        if not self.rows["profiled"]:
            raise DoctorError(f"no step was measured: the loop ran {self.seen_steps} optimizer step(s) and the doctor "
                              f"skips the first {self.warmup} as warm-up; run more steps or lower warmup")
        return Analysis(self).result()
