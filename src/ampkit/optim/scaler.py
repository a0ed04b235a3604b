"""`GradScaler`: torch's `torch.amp.GradScaler`, bit for bit, that also tells the host what each step did.

    scaler = ampkit.optim.GradScaler("cuda")
    scaler.watch_outcomes(lambda index, skipped: None if skipped else scheduler.step())
    ...
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()

It is a subclass, so every place that takes a GradScaler takes it (Lightning's `MixedPrecision(scaler=...)`, a
hand-written loop), and `scale`, `unscale_`, `step`, `update` and `state_dict` are torch's own: the same scale
trajectory, the same skipped steps, checkpoints either class loads. What torch's cannot say without waiting for
the device, this one learns as it lands (`ampkit.precision.outcomes`: a non-blocking copy into pinned memory):

- whether each `step()` was applied or skipped (`last_step_applied`, `applied_steps`, `skipped_steps`, and
  `watch_outcomes(callback)`, for a scheduler that should follow the applied steps only), and the scale it used
  (`landed_scale`: the latest landed step's; what `ampkit.Tracker` logs);
- a collapse: `collapse_after` skipped steps in a row (of one optimizer) raise `ampkit.LossScaleCollapse` with
  what to try, where torch's scale halves towards 0 and the run trains nothing, silently;
- optional bounds: `min_scale` / `max_scale` clamp the scale on the device after each update (None: none, as torch).

No read of the overflow flag is added on a CPU or a CUDA GPU: an optimizer with a fused kernel (`fused=True` Adam,
AdamW, SGD, Adagrad) is skipped on the device by torch's own path; any other optimizer costs the one host read
torch's GradScaler makes. (On other devices, MPS or XPU, the outcome's copy to the host waits for the device.)
A disabled scaler (`enabled=False`, or torch's own disabling where CUDA is missing) reports every step applied.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ampkit.errors import LossScaleCollapse
from ampkit.precision.outcomes import StepOutcomes
from ampkit.util import validate as check


class GradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)`, plus:

    Args:
        min_scale: the bound below which `update()` never lets the scale fall, on the device (None: none, as torch).
        max_scale: the bound above which it never lets the scale grow (None: none, as torch).
        collapse_after: raise `ampkit.LossScaleCollapse` once this many `step()` calls in a row were skipped
            (None: never, as torch). It is raised by the `update()` after the host learns of the last of them.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        min_scale: float | None = None,
        max_scale: float | None = None,
        collapse_after: int | None = 50,
    ) -> None:
        call, bound = "GradScaler", "a finite number > 0, or None (no bound)"
        if min_scale is not None:
            min_scale = check.number(call, "min_scale", min_scale, bound, lambda v: v > 0)
        if max_scale is not None:
            max_scale = check.number(call, "max_scale", max_scale, bound, lambda v: v > 0)
        if min_scale is not None and max_scale is not None and min_scale > max_scale:
            raise ValueError(f"GradScaler: min_scale={min_scale!r}: expected <= max_scale ({max_scale!r})")
        if collapse_after is not None:
            collapse_after = check.integer(call, "collapse_after", collapse_after, 1, "skipped steps in a row")
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self.min_scale, self.max_scale, self.collapse_after = min_scale, max_scale, collapse_after
        self._outcomes: StepOutcomes | None = None
        self._watchers: list[Callable[[int, bool], None]] = []
        self._forget()

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """torch's `step` (unscale if not yet, skip on inf/NaN); its outcome is queued for the host, no wait."""
        retval = super().step(optimizer, *args, **kwargs)
        if not self.is_enabled():  # nothing is scaled, nothing skipped: the step was applied (known on the host)
            self.attempted_steps += 1
            self._landed(id(optimizer), skipped=False, scale=None)
            return retval
        flags = list(self._found_inf_per_device(optimizer).values())
        if flags:  # torch's own per-device flags of this step (none: an optimizer that took the scaler itself)
            scale = self._scale
            assert scale is not None, "torch's step() made the scale"
            moved = [f.to(scale.device, non_blocking=True) for f in flags]
            found = moved[0] if len(moved) == 1 else torch.stack(moved).sum()  # one device: no stack, no sum
            if self._outcomes is None:
                self._outcomes = StepOutcomes(scale.device)
            self._outcomes.record(found, scale)
            self._order.append(id(optimizer))  # outcomes land in the order they were recorded
            self.attempted_steps += 1
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """torch's `update`, then the bounds (on the device; an explicit `new_scale` too), then the outcomes that
        have landed."""
        super().update(new_scale)
        if self.is_enabled() and (self.min_scale is not None or self.max_scale is not None):
            assert self._scale is not None, "torch's update() needs the scale"
            self._scale.clamp_(min=self.min_scale, max=self.max_scale)
        self._take(block=False)

    def watch_outcomes(self, callback: Callable[[int, bool], None]) -> None:
        """Call `callback(step_index, skipped)` as each outcome reaches the host: `step_index` counts `step()`
        calls from 1 (with several optimizers, each one's calls, in the order they were made)."""
        self._watchers.append(callback)

    @property
    def last_step_applied(self) -> bool | None:
        """Whether the latest `step()` was applied (True), skipped (False), or is not known yet (None: its
        outcome is still on its way from the device). Never waits."""
        self._take(block=False)
        return self._latest if self.applied_steps + self.skipped_steps == self.attempted_steps else None

    def outcomes(self) -> dict[str, int]:
        """Steps attempted, applied and skipped, exact: waits for the outcomes in flight (not per step)."""
        self._take(block=True)
        return {"attempted": self.attempted_steps, "applied": self.applied_steps, "skipped": self.skipped_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's `load_state_dict`. torch's state holds no step counts: the outcomes in flight and the counts
        belong to the run before it and start again from 0."""
        super().load_state_dict(state_dict)
        if self._outcomes is not None:
            self._outcomes.clear()
        self._forget()

    def __getstate__(self) -> dict[str, Any]:
        """torch's pickled state (between iterations, as torch allows), without what lives in host memory and
        events (the outcomes in flight) and the callbacks: a copy starts with none and counts from 0."""
        state = super().__getstate__()
        state.update(_outcomes=None, _watchers=[])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._forget()

    def _forget(self) -> None:
        self.attempted_steps = 0  # step() calls (host count, exact)
        self.applied_steps = 0  # of those, the outcomes landed so far: applied ...
        self.skipped_steps = 0  # ... and skipped
        self.landed_scale: float | None = None  # the scale of the latest step whose outcome has landed
        self._latest: bool | None = None
        self._last_good_scale: float | None = None
        self._order: deque[int] = deque()
        self._in_a_row: dict[int, int] = {}  # per optimizer: its skipped steps in a row

    def _take(self, block: bool) -> None:
        """Count the outcomes that have landed (all of them, `block`), then raise on a collapse among them."""
        if self._outcomes is None:
            return
        collapsed = None
        for outcome in self._outcomes.poll(block):
            key = self._order.popleft()
            if self._landed(key, outcome.skipped, outcome.scale) and collapsed is None:
                collapsed = (self._in_a_row[key], outcome.scale)
        if collapsed is not None:
            raise LossScaleCollapse(self._collapse(*collapsed))

    def _landed(self, key: int, skipped: bool, scale: float | None) -> bool:
        """One step's outcome on the host; True where its optimizer has now skipped `collapse_after` in a row."""
        self._latest = not skipped
        self.landed_scale = scale if scale is not None else self.landed_scale
        if skipped:
            self.skipped_steps += 1
            self._in_a_row[key] = self._in_a_row.get(key, 0) + 1
        else:
            self.applied_steps += 1
            self._in_a_row[key] = 0
            self._last_good_scale = scale if scale is not None else self._last_good_scale
        for watcher in self._watchers:
            watcher(self.applied_steps + self.skipped_steps, skipped)
        return self.collapse_after is not None and self._in_a_row[key] >= self.collapse_after

    def _collapse(self, in_a_row: int, scale: float) -> str:
        good = f"{self._last_good_scale:g}" if self._last_good_scale is not None else "none (no step was applied)"
        return (
            f"loss scale collapsed: {in_a_row} optimizer steps in a row were skipped for inf/NaN gradients, the "
            f"last of them at scale {scale:g} ({self.skipped_steps} of "
            f"{self.applied_steps + self.skipped_steps} steps skipped in all; the last applied step used scale "
            f"{good}). Either the loss itself is NaN/inf before scaling (check the data and the loss: no scale "
            f"helps), or fp16 cannot hold this model's activations or gradients: try bf16 autocast, keep the "
            f"overflowing layers in fp32 (`ampkit doctor --numerics` names them), or a lower learning rate; "
            f"collapse_after=None turns this check off"
        )
