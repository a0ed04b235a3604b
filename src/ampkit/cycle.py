"""Where the loop is inside one gradient-accumulation cycle, and the loss-scale updates it owes:
the overflow flags of optimizer steps whose scale update runs on the device at the next backward (so
several optimizers on one scale agree), or when a checkpoint or `acc.state.scale` needs the scale.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ampkit.scaler import LossScaler


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
        self._owed: list[torch.Tensor] = []  # found_inf flags of steps whose scale update is owed

    def advance(self) -> None:
        """One more backward ran."""
        self.position = self.position % self.steps + 1

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
                f"grad_accum_steps={self.steps}: acc.backward(loss) divides each micro-batch's loss by {self.steps}, so "
                f"the accumulated gradient is the mean over the cycle. If the loop divides its loss by its accumulation "
                f"steps too (loss = loss / gradient_accumulation_steps), remove that line: divided twice, every gradient "
                f"is {self.steps}x too small. Accelerator(divide_loss=True) says this is intended (no notice); "
                f"divide_loss=False keeps the loop's own division",
                stacklevel=3,
            )
        return loss / self.steps

    def owe_scale_update(self, found_inf: torch.Tensor) -> None:
        """An optimizer step with this overflow flag ran; the scale update follows later."""
        self._owed.append(found_inf)

    def flush_scale_update(self) -> None:
        """Apply the owed scale update now (on the device: no sync)."""
        if self._owed and self.scaler is not None:
            self.scaler.update(sum(self._owed[1:], self._owed[0]))
        self._owed.clear()

    def state_dict(self) -> dict[str, Any]:
        """The position (owed updates are flushed first: the scaler's state then holds them)."""
        self.flush_scale_update()
        return {"steps": self.steps, "position": self.position}

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
