"""Where the loop is inside one gradient-accumulation cycle, and the loss-scale update it owes.

A micro-batch is one `acc.backward`, or every backward inside one `with acc.accumulate():` block (a micro-batch
with several losses: two models, `retain_graph=True`). Several optimizers sharing the scaler owe one scale update
per iteration, as `scaler.step(opt0); scaler.step(opt1); scaler.update()`: it runs on the device once every
prepared optimizer has stepped since the last one (or one steps a second time first), so the scale the next
backward uses is always the scaler's current one (`get_scale()` is never stale).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ampkit.errors import StepOrderError
from ampkit.precision.scaler import LossScaler


class AccumulationCycle:
    """The position in a cycle of `steps` micro-steps (0 before the first backward, then 1..steps)."""

    def __init__(self, steps: int, scaler: LossScaler | None, divide_loss: bool | None = None) -> None:
        if divide_loss not in (None, True, False):
            raise TypeError(f"divide_loss={divide_loss!r}: expected True, False or None")
        self.steps = steps
        self.scaler = scaler
        self.divide_loss = divide_loss is not False
        self._tell = divide_loss is None and steps > 1  # say once that the loss is divided
        self.position = 0
        self.sharing = 0  # prepared optimizers stepping on this scale (each owes one update per iteration)
        self._owed: dict[int, torch.Tensor] = {}  # optimizer index -> found_inf of its step since the last update
        self._in_block = False  # inside acc.accumulate()
        self._counted = False  # that block's first backward has advanced the position
        self.blocks_used = False  # the loop marks its micro-batches with acc.accumulate()
        self.holding = False  # acc.split has more micro-batches of this batch to come: the next backward ends nothing

    def advance(self) -> None:
        """One more backward ran: a new micro-batch, unless an earlier backward of this block counted it."""
        if self._in_block:
            if self._counted:
                return
            self._counted = True
        self.position = self.position % self.steps + 1

    @contextlib.contextmanager
    def micro_batch(self) -> Iterator[None]:
        """Every backward inside the block is one micro-batch (`acc.accumulate()`)."""
        if self._in_block:
            raise StepOrderError("acc.accumulate() blocks do not nest: one block is one micro-batch")
        self._in_block, self._counted, self.blocks_used = True, False, True
        try:
            yield
        finally:
            self._in_block = self._counted = False

    def restart_block(self, position: int) -> None:
        """Back to `position`, with the current block's micro-batch not counted yet (acc.split reruns a batch)."""
        self.position, self._counted = position, False

    @property
    def started(self) -> bool:
        """A backward has run since the Accelerator was made (or the checkpoint it loaded)."""
        return self.position != 0

    @property
    def at_start(self) -> bool:
        """No micro-step of a new cycle has run yet: gradients may be zeroed."""
        return self.position in (0, self.steps)

    @property
    def at_end(self) -> bool:
        """The latest backward completed the cycle: the optimizer steps now."""
        return self.position == self.steps

    @property
    def next_is_last(self) -> bool:
        """The next backward will complete the cycle (DDP all-reduces in that one only)."""
        if self.holding:
            return False
        if self._counted:  # a later backward of a block whose micro-batch is already counted
            return self.at_end
        return self.position % self.steps + 1 == self.steps

    def micro_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The share of `loss` one micro-step contributes: `loss / steps` unless `divide_loss=False`. A
        converted script may still divide its loss itself (gradients k times too small, nothing fails): unless
        the choice was made explicitly, the first division says so once."""
        if self.steps == 1 or not self.divide_loss:
            return loss
        if self._tell:
            self._tell = False
            warnings.warn(
                f"grad_accum_steps={self.steps}: acc.backward(loss) divides each micro-batch's loss by {self.steps}, "
                f"so the accumulated gradient is the mean over the cycle. If the loop divides its loss by its "
                f"accumulation steps too (loss = loss / gradient_accumulation_steps), remove that line: divided twice, "
                f"every gradient is {self.steps}x too small. Accelerator(divide_loss=True) says this is intended "
                f"(no notice); divide_loss=False keeps the loop's own division",
                stacklevel=3,
            )
        return loss / self.steps

    def owe_scale_update(self, index: int, found_inf: torch.Tensor) -> None:
        """Optimizer `index` (of the `sharing` prepared ones) stepped with this overflow flag: update the scale
        once each has (torch's `scaler.update()` after the last `scaler.step`), or first if this one had."""
        if index in self._owed:
            self.flush_scale_update()
        self._owed[index] = found_inf
        if len(self._owed) >= self.sharing:
            self.flush_scale_update()

    def flush_scale_update(self) -> None:
        """Apply the owed scale update now (on the device: no sync): one backoff if any step overflowed."""
        if self._owed and self.scaler is not None:
            flags = list(self._owed.values())
            self.scaler.update(sum(flags[1:], flags[0]))
        self._owed.clear()

    def state_dict(self) -> dict[str, Any]:
        """The position and the overflow flags of steps whose scale update is still owed."""
        owed = {i: float(flag) for i, flag in self._owed.items()}  # sync: a checkpoint reads once, outside the step
        return {"steps": self.steps, "position": self.position, "owed": owed}

    def check_state_dict(self, state: dict[str, Any]) -> str | None:
        """Why `state` cannot be loaded into this cycle, or None."""
        if state["steps"] != self.steps and state["position"] not in (0, state["steps"]):
            return (
                f"it was saved mid-way through an accumulation cycle of {state['steps']} micro-steps; "
                f"resume it with grad_accum_steps={state['steps']} (now {self.steps})"
            )
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if problem := self.check_state_dict(state):
            raise ValueError(problem)
        self.position = int(state["position"]) if state["steps"] == self.steps else 0
        self._owed.clear()
        if self.scaler is not None:
            device = self.scaler.scale_tensor.device
            for index, flag in state.get("owed", {}).items():
                self._owed[int(index)] = torch.full((), float(flag), dtype=torch.float32, device=device)
