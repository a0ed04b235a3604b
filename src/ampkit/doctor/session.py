"""`DoctorSession`: watch an Accelerator for a few steps, then say where the step time goes.

The session attaches to an Accelerator as its recorder (`acc._recorder`): the Accelerator calls
`loss()` at every `acc.backward` and `step()` at the end of every optimizer step (the first
prepared optimizer's, on accumulation boundaries only), so the session knows where each step ends
without a change to the training loop. It then runs three windows:

1. **warm-up** (`warmup` steps): nothing is measured — allocator, caches and lazy init settle.
2. **profiled** (a few steps): `torch.profiler` records every op with FLOPs and shapes.
3. **timed** (the rest of `steps`): step and phase times without the profiler's overhead.

Tensor reads that would sync a GPU are counted in both measured windows. After the last step the
session restores everything it patched, analyses, and builds the result (`DOCTOR_SCHEMA`); with
`stop=True` it then ends the training by raising `StopTraining` from inside `optimizer.step()`.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ampkit.recorder import StepListener

from ampkit.accelerator import Accelerator
from ampkit.doctor import advisor
from ampkit.doctor.analysis import Analysis
from ampkit.doctor.phases import PhaseClock, instrument
from ampkit.doctor.sync import SyncWatcher

#: Most steps the profiler records: op counts repeat from step to step, so a few are enough, and
#: the profiler slows each step it records.
MAX_PROFILED_STEPS = 5

_active: DoctorSession | None = None  # at most one session patches the process at a time


class StopTraining(BaseException):
    """Raised from `optimizer.step()` once a `stop=True` session has measured enough.

    A BaseException, like KeyboardInterrupt, so that a training loop's `except Exception:` does not
    swallow it; `diagnose_script` and `diagnose_task` catch it.
    """


class DoctorError(RuntimeError):
    """The doctor could not measure what was asked (too few steps, no Accelerator, ...)."""


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # sync: the doctor's own, at window edges, never inside a step


class DoctorSession:
    """Measures `steps` optimizer steps of `acc` after `warmup` steps (see the module docstring).

    Args:
        acc: the Accelerator whose loop to watch. The session becomes its `_recorder` (an existing
            recorder keeps receiving every call).
        steps: measured steps: a few profiled (up to `MAX_PROFILED_STEPS`, a quarter of them),
            the rest timed.
        warmup: steps to skip before measuring; 0 starts measuring at once.
        gpu: the GPU whose costs findings quote (a name in `advisor.GPUS`); default A100.
        stop: raise `StopTraining` after the last measured step (`ampkit doctor` ends the script).
        subject: what is being diagnosed, for the report: {"kind", "name", "argv"}.
        on_done: called with the result when the session finishes by itself.
        bench: measure this device's matmul peak and copy bandwidth (`analysis.BENCH_SECONDS`) for
            the utilisation, precision and thread findings; without it those figures are "unknown".
    """

    def __init__(self, acc: Accelerator, *, steps: int = 20, warmup: int = 5, gpu: str = "A100",
                 stop: bool = False, subject: dict[str, Any] | None = None,
                 on_done: Callable[[dict[str, Any]], None] | None = None, bench: bool = True) -> None:
        if not isinstance(acc, Accelerator):
            raise TypeError(f"the doctor watches an ampkit.Accelerator; got {type(acc).__name__}")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"steps={steps!r}: expected an integer >= 1 (the steps to measure)")
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
            raise ValueError(f"warmup={warmup!r}: expected an integer >= 0")
        self.gpu = advisor.find_gpu(gpu)
        self.acc = acc
        self.steps, self.warmup, self.stop = steps, warmup, stop
        self.profiled_target = max(1, min(MAX_PROFILED_STEPS, steps // 4))
        self.subject = subject or {"kind": "loop", "name": "training loop", "argv": []}
        self.on_done = on_done
        self.bench = bench
        self.result: dict[str, Any] | None = None
        self.seen_steps = 0  # optimizer steps since attach (warm-up included)
        self._inner = None
        self._listener = StepListener(acc, self)
        self._outcomes: list[Any] = []
        self._clock = PhaseClock(acc)
        self._syncs = SyncWatcher(acc.device, ignore=lambda: self._clock.in_data)
        self._stack = contextlib.ExitStack()
        self._profiler: torch.profiler.profile | None = None
        self._events: list[Any] | None = None
        self._window = "warmup"
        self._step_start = 0.0
        self._cuda_marks: list[torch.cuda.Event] = []
        self._rows: dict[str, list[dict[str, Any]]] = {"profiled": [], "timed": []}
        self._attach()

    # --- attaching ----------------------------------------------------------------------------
    def _attach(self) -> None:
        global _active
        if _active is not None:
            raise DoctorError("another doctor session is already watching this process; finish it first")
        _active = self
        try:
            self._stack.callback(self._detach_recorder)
            self._stack.enter_context(instrument(self._clock))
            self._syncs.install()
            self._stack.callback(self._syncs.uninstall)
        except BaseException:
            self._stack.close()
            _active = None
            raise
        self.acc.events.add(self._listener)
        if self.warmup == 0:
            self._open("profiled")

    def _detach_recorder(self) -> None:
        global _active
        self.acc.events.remove(self._listener)
        _active = None

    # --- the recorder interface (called by the Accelerator) -----------------------------------
    @property
    def outcomes(self) -> list[Any]:
        """Step outcomes (fp16): the optimizer appends here; kept with an inner recorder if any."""
        return self._inner.outcomes if self._inner is not None else self._outcomes

    def loss(self, loss: torch.Tensor) -> None:
        if self._inner is not None:
            self._inner.loss(loss)

    def step(self) -> None:
        """End of an optimizer step: close the step's figures, move between windows."""
        now = time.perf_counter()
        self._clock.end_optimizer(now)
        self.seen_steps += 1
        if self._window in self._rows:
            self._close_step(now)
        if self._window == "warmup" and self.seen_steps >= self.warmup:
            self._open("profiled")
        elif self._window == "profiled" and len(self._rows["profiled"]) >= self.profiled_target:
            self._stop_profiler()
            self._open("timed" if self.steps > self.profiled_target else "done")
        elif self._window == "timed" and len(self._rows["timed"]) >= self.steps - self.profiled_target:
            self._window = "done"
        if self._window == "done" and self.result is None:
            try:
                result = self.finish()
            except Exception as exc:
                if self.stop:
                    raise
                # Watching a live run: a failed diagnosis must not end the training (the patches are back).
                warnings.warn(f"ampkit doctor: the diagnosis failed ({type(exc).__name__}: {exc}); training goes on",
                              RuntimeWarning, stacklevel=2)
            else:
                if self.on_done is not None:
                    self.on_done(result)
                if self.stop:
                    raise StopTraining
        if self._inner is not None:
            self._inner.step()
        self._step_start = time.perf_counter()  # the doctor's own bookkeeping is in no step

    def _close_step(self, now: float) -> None:
        seconds, samples, batch_bytes = self._clock.take()
        self._rows[self._window].append({"host_s": now - self._step_start, "phases": seconds,
                                         "samples": samples, "batch_bytes": batch_bytes})
        if self.acc.device.type == "cuda" and self._window == "timed":
            mark = torch.cuda.Event(enable_timing=True)
            mark.record()
            self._cuda_marks.append(mark)

    def _open(self, window: str) -> None:
        self._window = window
        if window == "done":
            return
        with self._syncs.muted():
            _sync_device(self.acc.device)
            if window == "profiled":
                self._syncs.start_cuda_debug()
                self._start_profiler()
            elif window == "timed" and self.acc.device.type == "cuda":
                mark = torch.cuda.Event(enable_timing=True)
                mark.record()
                self._cuda_marks = [mark]
        self._syncs.active = True
        self._clock.take()
        self._clock.active = True
        self._step_start = time.perf_counter()

    def _start_profiler(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.acc.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # kineto's start-up chatter is not the user's business
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True, with_flops=True)
            self._profiler.start()

    def _stop_profiler(self) -> None:
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        with self._syncs.muted(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _sync_device(self.acc.device)
            profiler.stop()
            self._events = list(profiler.events())

    # --- finishing ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop watching and restore everything patched, without a result (the loop failed)."""
        self._clock.active = False
        self._syncs.active = False
        try:
            if self._profiler is not None:
                profiler, self._profiler = self._profiler, None
                profiler.stop()
        finally:
            self._stack.close()

    def finish(self) -> dict[str, Any]:
        """Stop watching, restore everything patched, and return the result (idempotent).

        Called by the session itself after the last measured step; call it yourself when the loop
        ends early (the result then covers the steps that ran). Raises `DoctorError` when not even
        one step was measured.
        """
        if self.result is not None:
            return self.result
        self._clock.active = False
        self._syncs.active = False
        try:
            self._stop_profiler()
        finally:
            self._stack.close()
        if not self._rows["profiled"]:
            raise DoctorError(
                f"no step was measured: the loop ran {self.seen_steps} optimizer step(s) and the doctor skips "
                f"the first {self.warmup} as warm-up; run more steps or lower warmup"
            )
        self.result = Analysis(self).result()
        return self.result


def profile(acc: Accelerator, steps: int = 20, *, warmup: int = 5, gpu: str = "A100", report: bool = True,
            on_done: Callable[[dict[str, Any]], None] | None = None) -> DoctorSession:
    """Diagnose the next `steps` optimizer steps of `acc` (after `warmup`), while training goes on.

    The loop does not change: the session observes it through the Accelerator and, after the last
    measured step, prints the report (`report=True`) and leaves `session.result`. Call
    `session.finish()` if the loop may end before that.
    """
    def done(result: dict[str, Any]) -> None:
        if report:
            from ampkit.doctor.report import render_report

            render_report(result)
        if on_done is not None:
            on_done(result)

    return DoctorSession(acc, steps=steps, warmup=warmup, gpu=gpu, on_done=done)
