"""Where the loop is inside one gradient-accumulation cycle.

A micro-batch is one `acc.backward`, or every backward inside one `with acc.accumulate():` block (a micro-batch
with several losses: two models, `retain_graph=True`). The scale update that optimizers sharing the scaler owe is
the scaler's (`LossScaler.owe_update`); a checkpoint keeps its owed flags with the cycle's position.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ampkit.errors import StepOrderError
from ampkit.precision.scaler import LossScaler

#: `Accelerator(epoch_end=)`: what the last, partial cycle of a prepared loader's pass does.
EPOCH_END = ("step", "step_as_accelerate", "carry")


class AccumulationCycle:
    """The position in a cycle of `length` micro-steps (0 before the first backward, then 1..length): `steps`,
    or fewer for the last cycle of a prepared loader's pass (`batches_left`) or one closed by hand (`close`)."""

    def __init__(
        self, steps: int, scaler: LossScaler | None, divide_loss: bool | None = None, epoch_end: str = "step"
    ) -> None:
        if divide_loss not in (None, True, False):
            raise TypeError(f"divide_loss={divide_loss!r}: expected True, False or None")
        self.steps = steps
        self.epoch_end = epoch_end
        self.length = steps  # micro-steps of the current cycle
        self._next_length: int | None = None  # a shorter next cycle, told by the loader before its first batch
        self.rescale: float | None = None  # a cycle closed by hand: its gradients times steps / length
        self.scaler = scaler
        self.divide_loss = divide_loss is not False
        self._tell = divide_loss is None and steps > 1  # say once that the loss is divided
        self.position = 0
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
        if self.at_start:
            self.length, self._next_length, self.rescale = self._next_length or self.steps, None, None
            self.position = 1
        else:
            self.position += 1

    def batches_left(self, left: int) -> None:
        """The prepared loader is about to hand out a batch with `left` batches to go in its pass (this one
        included): where a new cycle starts with fewer than `steps` left, it is that short (`epoch_end`)."""
        if self.epoch_end != "carry" and self.at_start and not self._in_block:
            self._next_length = left if left < self.steps else None

    def close(self, synced_per_cycle: bool = False) -> bool:
        """Close a cycle short by hand (`acc.end_cycle()`): True if micro-batches were pending, so a step is due.
        `synced_per_cycle`: DDP/FSDP, where only a cycle's last micro-batch all-reduces (refused)."""
        if not self.started or self.at_end:
            return False
        if synced_per_cycle:
            raise StepOrderError(
                "acc.end_cycle() under DDP/FSDP: the pending micro-batches' gradients were not all-reduced (only "
                "a cycle's last micro-batch syncs, and it was not known to be last); let a prepared DataLoader "
                "with a length end its pass's last cycle, or make len(loader) a multiple of grad_accum_steps"
            )
        if self.epoch_end != "step_as_accelerate" and self.divide_loss:
            self.rescale = self.steps / self.position  # each micro-batch was divided by steps, not by its length
        self.length = self.position
        return True

    def mark(self) -> tuple[int, int, int | None]:
        """Where the cycle is (acc.split saves it before a batch, to rerun the batch from there)."""
        return self.position, self.length, self._next_length

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

    def restart_block(self, mark: tuple[int, int, int | None]) -> None:
        """Back to `mark`, with the current block's micro-batch not counted yet (acc.split reruns a batch)."""
        (self.position, self.length, self._next_length), self._counted = mark, False

    @property
    def started(self) -> bool:
        """A backward has run since the Accelerator was made (or the checkpoint it loaded)."""
        return self.position != 0

    @property
    def at_start(self) -> bool:
        """No micro-step of a new cycle has run yet: gradients may be zeroed."""
        return self.position in (0, self.length)

    @property
    def at_end(self) -> bool:
        """The latest backward completed the cycle: the optimizer steps now."""
        return self.position == self.length

    @property
    def next_is_last(self) -> bool:
        """The next backward will complete the cycle (DDP all-reduces in that one only)."""
        if self.holding:
            return False
        if self._counted:  # a later backward of a block whose micro-batch is already counted
            return self.at_end
        if self.at_start:
            return (self._next_length or self.steps) == 1
        return self.position + 1 == self.length

    def micro_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The share of `loss` one micro-step contributes: `loss / steps` unless `divide_loss=False`. A
        converted script may still divide its loss itself (gradients k times too small, nothing fails): unless
        the choice was made explicitly, the first division says so once."""
        # The cycle this backward belongs to: a new one (its length told by the loader) or the current one.
        length = (self._next_length or self.steps) if self.at_start and not self._counted else self.length
        if self.epoch_end == "step_as_accelerate":
            length = self.steps  # Accelerate and the HF Trainer divide by steps in a short cycle too
        if length == 1 or not self.divide_loss:
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
        return loss / length

    def state_dict(self) -> dict[str, Any]:
        """The position and the overflow flags of steps whose scale update is still owed."""
        return {
            "steps": self.steps,
            "position": self.position,
            "owed": self.scaler.owed_state() if self.scaler is not None else {},
            "length": self.length,
            "next_length": self._next_length,
            "rescale": self.rescale,
        }

    def check_state_dict(self, state: dict[str, Any]) -> str | None:
        """Why `state` cannot be loaded into this cycle, or None."""
        if state["steps"] != self.steps and state["position"] not in (0, state.get("length", state["steps"])):
            return (
                f"it was saved mid-way through an accumulation cycle of {state['steps']} micro-steps; "
                f"resume it with grad_accum_steps={state['steps']} (now {self.steps})"
            )
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if problem := self.check_state_dict(state):
            raise ValueError(problem)
        same = state["steps"] == self.steps
        self.position = int(state["position"]) if same else 0
        self.length = int(state.get("length", self.steps)) if same else self.steps
        self._next_length = state.get("next_length") if same else None
        self.rescale = state.get("rescale") if same else None
        if self.scaler is not None:
            self.scaler.load_owed(state.get("owed", {}))


def warn_pending_at_exit(cycle: AccumulationCycle) -> None:
    """At a normal interpreter exit, warn if `cycle` still holds micro-batches no optimizer step applied."""
    atexit.register(_warn_if_pending, weakref.ref(cycle))


def _warn_if_pending(ref: weakref.ref[AccumulationCycle]) -> None:
    cycle = ref()
    if cycle is None or not cycle.started or cycle.at_start or getattr(sys, "last_value", None) is not None:
        return  # gone, nothing pending, or the run ended with an uncaught exception (that is the news)
    warnings.warn(
        f"the run ended with {cycle.position} of {cycle.length} micro-batches of an accumulation cycle whose "
        f"gradients no optimizer step applied: their data did not train the model. Use a prepared DataLoader "
        f"with epoch_end='step' (its pass's last micro-batch ends the cycle; now {cycle.epoch_end!r}), or "
        f"`if acc.end_cycle(): optimizer.step()` after the loop",
        stacklevel=1,
    )
