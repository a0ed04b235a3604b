"""`acc.state`: step counters and the loss scale, read when asked (each read may wait for the device)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ampkit.engine.optim import AmpOptimizer
    from ampkit.precision.scaler import LossScaler


class TrainingState:
    """Step counters and the loss scale, read lazily (each read may wait for the device).

    `optimizers`: the prepared optimizers as they are prepared (the Accelerator's list, which grows);
    `scaler`: its loss scaler, None for presets without loss scaling."""

    def __init__(self, optimizers: Sequence[AmpOptimizer], scaler: LossScaler | None) -> None:
        self._optimizers, self._scaler = optimizers, scaler

    def _optimizer(self) -> AmpOptimizer | None:
        opts = self._optimizers
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
        if self._scaler is None:
            return None
        return self._scaler.get_scale()  # the scale the next backward uses (see ampkit.engine.cycle)

    def __repr__(self) -> str:
        return (
            f"TrainingState(applied_steps={self.applied_steps}, skipped_steps={self.skipped_steps}, scale={self.scale})"
        )
