"""Per-step figures of a training run — loss, step time, loss scale — gathered without syncs.

`ampkit compare` attaches a `Recorder` to the Accelerator it hands to the training code. The
Accelerator feeds it every loss passed to `acc.backward` (kept on the device), a timestamp at every
optimizer step (a CUDA event on a GPU, so the host never waits) and every step outcome as it lands.
`summary()` reads it all back once, at the end.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ampkit.events import Listener
from ampkit.outcomes import Outcome


class Recorder:
    """Collects a run's per-step losses, step times and loss-scale outcomes."""

    def __init__(self, device: torch.device, on_step: Callable[[int], None] | None = None) -> None:
        self._cuda = device.type == "cuda"
        # One slot per acc.backward in one preallocated device buffer (doubled when full): keeping
        # thousands of tiny tensors alive instead fragments the host heap (RSS grew ~1.6 MB/step).
        self._losses = torch.empty(1024, dtype=torch.float32, device=device)
        self._count = 0
        self._bounds: list[int] = []  # len(_losses) at each optimizer step
        self._stamps: list[Any] = [self._stamp()]  # perf_counter floats, or CUDA events
        self.outcomes: list[Outcome] = []
        self._on_step = on_step

    def _stamp(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def loss(self, loss: torch.Tensor) -> None:
        """Keep one micro-step's loss (a device-to-device copy: no sync)."""
        if self._count == len(self._losses):
            self._losses = torch.cat([self._losses, torch.empty_like(self._losses)])
        self._losses[self._count] = loss.detach().reshape(())
        self._count += 1

    def step(self) -> None:
        """Mark an optimizer step: the micro-step losses since the last mark belong to it."""
        self._bounds.append(self._count)
        self._stamps.append(self._stamp())
        if self._on_step is not None:
            self._on_step(len(self._bounds))

    @property
    def steps(self) -> int:
        return len(self._bounds)

    def loss_curve(self) -> list[float]:
        """Mean loss of each optimizer step's micro-steps (NaN where non-finite). One sync."""
        if not self._count:
            return []
        values = self._losses[: self._count].tolist()  # sync: once, after the run
        curve, start = [], 0
        for end in self._bounds:
            chunk = values[start:end]
            curve.append(sum(chunk) / len(chunk) if chunk else math.nan)
            start = end
        return curve

    def step_times(self) -> list[float]:
        """Seconds between consecutive optimizer steps (the whole iteration: data, forward, backward, update)."""
        if self._cuda:
            self._stamps[-1].synchronize()  # sync: once, after the run
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self._stamps, self._stamps[1:])]
        return [b - a for a, b in zip(self._stamps, self._stamps[1:])]

    def summary(self, warmup: int) -> dict[str, Any]:
        """Median step time (warm-up dropped), loss curve, skipped steps and the scale history."""
        times = self.step_times()
        kept = times[warmup:] or times
        return {
            "steps": self.steps,
            "warmup_steps": min(warmup, len(times)),
            "step_time_median_s": statistics.median(kept) if kept else None,
            "loss_curve": self.loss_curve(),
            "skipped_steps": sum(o.skipped for o in self.outcomes),
            "scale_history": [o.scale for o in self.outcomes] or None,
        }


class StepListener(Listener):
    """Feeds a recorder-like `target` (`loss(t)`, `step()`, `outcomes` list) from `acc`'s events:
    every loss passed to `acc.backward`, each optimizer step and outcome of the first prepared optimizer."""

    def __init__(self, acc: Any, target: Any) -> None:
        self.acc = acc
        self.target = target

    def on_backward_start(self, acc: Any, loss: torch.Tensor) -> None:
        self.target.loss(loss)

    def on_step_end(self, optimizer: Any, stepped: bool) -> None:
        if stepped and optimizer is self.acc.optimizers[0]:
            self.target.step()

    def on_outcome(self, optimizer: Any, outcome: Outcome) -> None:
        if optimizer is self.acc.optimizers[0]:
            self.target.outcomes.append(outcome)
