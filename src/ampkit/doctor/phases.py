"""Where a training step's host time goes: data, host→device copy, forward, backward, optimizer.

ampkit's core has no timing hooks of its own (the step path stays free of them), so while the
doctor watches, `instrument` wraps the few places every converted loop passes through and restores
them afterwards, even on an exception:

- `DeviceLoader` (a prepared DataLoader): the wait for the next batch is *data*; moving it to the
  device (`ampkit.data.move_to_device`) is *h2d*.
- `nn.Module` calls (global forward hooks): from the first model call after a batch until
  `acc.backward` is *forward* — the model and the loss computed from its output.
- `Accelerator.backward` is *backward*; the prepared optimizer's `step` and `zero_grad` are
  *optimizer*.

Everything else in the step (logging, Python between the calls, a loss computed long before
backward) is *other*. These are host times: on CUDA the device runs behind the host, so they say
where the Python thread spends the step, and the step time itself is measured on the device.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import ampkit.data
from ampkit.accelerator import Accelerator
from ampkit.optim import AmpOptimizer

#: The measured phases, in step order ("other" is the step time not covered by them).
PHASES: tuple[str, ...] = ("data", "h2d", "forward", "backward", "optimizer")


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _nbytes(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if isinstance(batch, dict):
        return sum(_nbytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(_nbytes(v) for v in batch)
    return 0


class PhaseClock:
    """Host seconds per phase in the current step, plus the samples and batch bytes it loaded.

    `active` is switched on by the doctor for the measured steps only; `take()` returns the
    current step's figures and starts the next.
    """

    def __init__(self, acc: Accelerator) -> None:
        self.acc = acc
        self.active = False
        self.in_data = False  # inside the data loader: tensor reads there are host-side
        self._reset()
        self._forward_start: float | None = None
        self._forward_excluded = 0.0  # data/h2d time that fell inside the forward span
        self._optimizer_start: float | None = None
        self._module_depth = 0
        self._h2d_depth = 0

    def _reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.samples: int | None = None
        self.batch_bytes = 0

    def add(self, phase: str, seconds: float) -> None:
        if self.active:
            self.seconds[phase] += seconds
            if phase in ("data", "h2d") and self._forward_start is not None:
                self._forward_excluded += seconds

    def count_batch(self, batch: Any) -> None:
        if not self.active:
            return
        first = _first_tensor(batch)
        if first is not None and first.dim() > 0:
            self.samples = (self.samples or 0) + int(first.shape[0])
        self.batch_bytes += _nbytes(batch)

    def end_forward(self, now: float) -> None:
        if self._forward_start is not None:
            self.add("forward", max(0.0, now - self._forward_start - self._forward_excluded))
            self._forward_start = None

    def end_optimizer(self, now: float) -> None:
        if self._optimizer_start is not None:
            self.add("optimizer", now - self._optimizer_start)
            self._optimizer_start = None

    def take(self) -> tuple[dict[str, float], int | None, int]:
        """This step's (seconds per phase, samples, batch bytes); the clock starts the next step."""
        out = (dict(self.seconds), self.samples, self.batch_bytes)
        self._reset()
        self._forward_start = None  # a model call not followed by backward (evaluation) is "other"
        self._forward_excluded = 0.0
        return out

    # --- the hooks ----------------------------------------------------------------------------
    def _forward_pre(self, module: nn.Module, args: Any) -> None:
        self._module_depth += 1
        if self._module_depth == 1 and self._forward_start is None and self.active:
            self._forward_start = time.perf_counter()
            self._forward_excluded = 0.0

    def _forward_post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._module_depth = max(0, self._module_depth - 1)


class _TimedBatches:
    """Wraps the iterator of the user's DataLoader: time spent in `next()` is waiting for data."""

    def __init__(self, it: Iterator[Any], clock: PhaseClock) -> None:
        self._it = it
        self._clock = clock

    def __iter__(self) -> _TimedBatches:
        return self

    def __next__(self) -> Any:
        self._clock.in_data = True
        start = time.perf_counter()
        try:
            batch = next(self._it)
        finally:
            self._clock.add("data", time.perf_counter() - start)
            self._clock.in_data = False
        self._clock.count_batch(batch)
        return batch


@contextlib.contextmanager
def instrument(clock: PhaseClock) -> Iterator[PhaseClock]:
    """Time the phases of `clock.acc`'s steps for the duration of the block (see the module doc)."""
    acc = clock.acc
    saved = {
        (ampkit.data.DeviceLoader, "_on_device"): ampkit.data.DeviceLoader._on_device,
        (ampkit.data, "move_to_device"): ampkit.data.move_to_device,
        (Accelerator, "backward"): Accelerator.backward,
        (AmpOptimizer, "step"): AmpOptimizer.step,
        (AmpOptimizer, "zero_grad"): AmpOptimizer.zero_grad,
    }
    on_device, move, backward, step, zero_grad = saved.values()

    def timed_on_device(self: Any, it: Iterator[Any]) -> Iterator[Any]:
        if any(self is loader for loader in acc._loaders):
            it = _TimedBatches(it, clock)
        return on_device(self, it)

    def timed_move(obj: Any, device: torch.device, *args: Any, **kwargs: Any) -> Any:
        if clock._h2d_depth:  # the recursive calls for nested batches: timed by the outermost
            return move(obj, device, *args, **kwargs)
        clock._h2d_depth += 1
        start = time.perf_counter()
        try:
            return move(obj, device, *args, **kwargs)
        finally:
            clock._h2d_depth -= 1
            clock.add("h2d", time.perf_counter() - start)

    def timed_backward(self: Accelerator, loss: torch.Tensor, **kwargs: Any) -> None:
        if self is not acc:
            return backward(self, loss, **kwargs)
        start = time.perf_counter()
        clock.end_forward(start)
        try:
            return backward(self, loss, **kwargs)
        finally:
            clock.add("backward", time.perf_counter() - start)

    def timed_step(self: AmpOptimizer, *args: Any, **kwargs: Any) -> Any:
        if self._acc is not acc or clock._optimizer_start is not None:
            return step(self, *args, **kwargs)
        clock._optimizer_start = time.perf_counter()
        try:
            return step(self, *args, **kwargs)
        finally:  # the doctor ends the step (and this phase) inside step(); other optimizers end here
            clock.end_optimizer(time.perf_counter())

    def timed_zero_grad(self: AmpOptimizer, *args: Any, **kwargs: Any) -> None:
        if self._acc is not acc:
            return zero_grad(self, *args, **kwargs)
        start = time.perf_counter()
        try:
            return zero_grad(self, *args, **kwargs)
        finally:
            clock.add("optimizer", time.perf_counter() - start)

    ampkit.data.DeviceLoader._on_device = timed_on_device  # type: ignore[method-assign]
    ampkit.data.move_to_device = timed_move
    Accelerator.backward = timed_backward  # type: ignore[method-assign]
    AmpOptimizer.step = timed_step  # type: ignore[method-assign]
    AmpOptimizer.zero_grad = timed_zero_grad  # type: ignore[method-assign]
    handles = [
        nn.modules.module.register_module_forward_pre_hook(clock._forward_pre),
        nn.modules.module.register_module_forward_hook(clock._forward_post, always_call=True),
    ]
    try:
        yield clock
    finally:
        for handle in handles:
            handle.remove()
        for (owner, name), original in saved.items():
            setattr(owner, name, original)
