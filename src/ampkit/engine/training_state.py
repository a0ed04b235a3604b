"""`acc.state`: step counters and the loss scale, read when asked (each read may wait for the device)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ampkit.accelerator import Accelerator
    from ampkit.engine.optim import AmpOptimizer


class TrainingState:
    """Step counters and the loss scale, read lazily (each read may wait for the device)."""

    def __init__(self, acc: Accelerator) -> None:
        self._acc = acc

    def _optimizer(self) -> AmpOptimizer | None:
        opts = self._acc.optimizers
        if opts:
            opts[0].reconcile(block=True)
        return opts[0] if opts else None

    @property
    def applied_steps(self) -> int:
        """Optimizer steps applied (of the first prepared optimizer)."""
        opt = self._optimizer()
        return opt.applied_steps if opt else 0

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because gradients overflowed."""
        opt = self._optimizer()
        return opt.skipped_steps if opt else 0

    @property
    def scale(self) -> float | None:
        """The current loss scale, or None for presets without loss scaling."""
        if self._acc.scaler is None:
            return None
        return self._acc.scaler.get_scale()  # the scale the next backward uses (see ampkit.engine.cycle)

    def __repr__(self) -> str:
        return (
            f"TrainingState(applied_steps={self.applied_steps}, skipped_steps={self.skipped_steps}, scale={self.scale})"
        )
