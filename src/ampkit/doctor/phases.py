"""Where a training step's host time goes: data, host→device copy, forward, backward, optimizer.

`PhaseClock` listens to the Accelerator's events: the loader's batch wait is *data*, its copy *h2d*;
from the first model call after a batch (torch's global module hooks) to `acc.backward` is
*forward*; `acc.backward` *backward*; the optimizers' `step` and `zero_grad` *optimizer*; the rest
*other*. Host times: on CUDA they say where the Python thread spends the step.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ampkit.data import DeviceLoader
from ampkit.events import Listener
from ampkit.optim import AmpOptimizer

#: The measured phases, in step order ("other" is the step time not covered by them).
PHASES: tuple[str, ...] = ("data", "h2d", "forward", "backward", "optimizer")


class PhaseClock(Listener):
    """Host seconds per phase in the current step (while `active`), plus the samples and batch bytes it
    loaded; `take()` returns them and starts the next step; `hook(stack)` adds the module hooks."""

    def __init__(self) -> None:
        self.active = False
        self.in_data = False  # inside the data loader: tensor reads there are host-side
        self._reset()
        self._forward_start: float | None = None
        self._forward_excluded = 0.0  # data/h2d time that fell inside the forward span
        self._started: dict[str, float] = {}  # phase -> when its current span started
        self._module_depth = 0

    def _reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.samples: int | None = None
        self.batch_bytes = 0

    def hook(self, stack: contextlib.ExitStack) -> None:
        for handle in (nn.modules.module.register_module_forward_pre_hook(self._forward_pre),
                       nn.modules.module.register_module_forward_hook(self._forward_post, always_call=True)):
            stack.callback(handle.remove)

    def add(self, phase: str, seconds: float) -> None:
        if self.active:
            self.seconds[phase] += seconds
            if phase in ("data", "h2d") and self._forward_start is not None:
                self._forward_excluded += seconds

    def _start(self, phase: str) -> None:
        self._started[phase] = time.perf_counter()
        if phase != "data":  # a loader that ran out sends no batch-wait end: this is past it
            self.in_data = False

    def _end(self, phase: str, now: float | None = None) -> None:
        start = self._started.pop(phase, None)
        if start is not None:
            self.add(phase, (now or time.perf_counter()) - start)

    def count_batch(self, batch: Any) -> None:
        if not self.active:
            return
        tensors = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]  # a nested batch's
        if tensors and tensors[0].dim() > 0:
            self.samples = (self.samples or 0) + int(tensors[0].shape[0])
        self.batch_bytes += sum(t.numel() * t.element_size() for t in tensors)

    def end_forward(self, now: float) -> None:
        if self._forward_start is not None:
            self.add("forward", max(0.0, now - self._forward_start - self._forward_excluded))
            self._forward_start = None

    def end_optimizer(self, now: float) -> None:
        self._end("optimizer", now)

    def take(self) -> tuple[dict[str, float], int | None, int]:
        """This step's (seconds per phase, samples, batch bytes); the clock starts the next step."""
        out = (dict(self.seconds), self.samples, self.batch_bytes)
        self._reset()
        self._forward_start = None  # a model call not followed by backward (evaluation) is "other"
        self._forward_excluded = 0.0
        return out

    # --- the events -----------------------------------------------------------------------------
    def on_batch_wait_start(self, loader: DeviceLoader) -> None:
        self.in_data = True
        self._start("data")

    def on_batch_wait_end(self, loader: DeviceLoader, batch: Any) -> None:
        self._end("data")
        self.in_data = False
        self.count_batch(batch)

    def on_h2d_start(self, loader: DeviceLoader, batch: Any) -> None:
        self._start("h2d")

    def on_h2d_end(self, loader: DeviceLoader, batch: Any) -> None:
        self._end("h2d")

    def on_backward_start(self, acc: Any, loss: torch.Tensor) -> None:
        self.end_forward(time.perf_counter())
        self._start("backward")

    def on_backward_end(self, acc: Any) -> None:
        self._end("backward")

    def on_step_start(self, optimizer: AmpOptimizer) -> None:
        self._start("optimizer")

    def on_step_end(self, optimizer: AmpOptimizer, stepped: bool = True) -> None:
        self._end("optimizer")

    on_zero_grad_start, on_zero_grad_end = on_step_start, on_step_end  # both are the optimizer's phase

    # --- torch's module hooks -----------------------------------------------------------------
    def _forward_pre(self, module: nn.Module, args: Any) -> None:
        self._module_depth += 1
        if self._module_depth == 1 and self._forward_start is None and self.active:
            self._forward_start = time.perf_counter()
            self._forward_excluded = 0.0

    def _forward_post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._module_depth = max(0, self._module_depth - 1)
