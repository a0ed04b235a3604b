"""Per-step figures of a training run — loss, step time, loss scale — gathered without syncs.

`ampkit compare` registers a `Recorder` on the Accelerator it hands to the training code. The
events give it every loss passed to `acc.backward` (kept on the device), a timestamp at every
optimizer step of the first prepared optimizer (a CUDA event on a GPU, so the host never waits)
and every step outcome as it lands. `summary()` reads it all back once, at the end.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ampkit.events import Listener
from ampkit.outcomes import Outcome

if TYPE_CHECKING:
    from ampkit.accelerator import Accelerator


class Recorder(Listener):
    """Collects a run's per-step losses, step times and loss-scale outcomes from `acc`'s events."""

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
        """Training resumes after a pause (an interleaved comparison ran another precision meanwhile):
        the time since the last step is no step's."""
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
        curve, start = [], 0
        for end in self.bounds:
            chunk = values[start:end]
            curve.append(sum(chunk) / len(chunk) if chunk else math.nan)
            start = end
        return curve

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
