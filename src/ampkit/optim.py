"""The wrapped optimizer: loss-scale unscaling, sync-free skips, accumulation boundaries, and the
fp32 update of low-precision weights (master copies or Kahan compensation).

The user's optimizer object, algorithm and flags are never changed (parity with a hand-written loop
depends on it). For the presets that store weights in bf16/fp16, the optimizer is pointed at fp32
parameters that ampkit keeps in step with the model:

* `MasterWeights` (`*-master`, apex O2): persistent fp32 copies; the update lands on them and is
  copied into the model's low-precision weights.
* `CompensatedWeights` (`bf16-true`): no persistent fp32 copy. For the update only, an fp32 view of
  each weight is made from the bf16 weight plus a bf16 Kahan buffer holding what rounding lost; the
  optimizer steps it, the result is rounded back into the weight and the new rounding error into the
  buffer. Optimizer state tensors are stored in bf16 between steps.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ampkit.distributed import agree_on_overflow
from ampkit.errors import LossScaleCollapse, StepOrderError
from ampkit.outcomes import StepOutcomes

if TYPE_CHECKING:
    from ampkit.accelerator import Accelerator


class Stage(enum.Enum):
    """Where an optimizer is inside one training step (torch's GradScaler has the same idea)."""

    READY = "ready"  # gradients zeroed or stepped; waiting for acc.backward
    BACKWARD = "backward"  # acc.backward ran: gradients are (possibly scaled) low-precision grads
    UNSCALED = "unscaled"  # gradients unscaled and in the optimizer's fp32 parameters; found_inf set
    STEPPED = "stepped"  # the optimizer step ran (or was skipped on the device)


class MasterWeights:
    """Persistent fp32 master copies of low-precision parameters (the `*-master` presets)."""

    def __init__(self, pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
        self.pairs = pairs  # (model parameter in bf16/fp16, its fp32 master)

    @property
    def optimizer_params(self) -> Iterator[nn.Parameter]:
        return (master for _, master in self.pairs)

    def grads_in(self) -> list[torch.Tensor]:
        """Give each master the fp32 copy of its model parameter's gradient; return those grads."""
        grads = []
        for param, master in self.pairs:
            if param.grad is None:
                master.grad = None
            else:
                master.grad = param.grad.to(torch.float32)
                grads.append(master.grad)
        return grads

    def weights_out(self) -> None:
        """Round the (possibly updated) masters into the model's parameters."""
        if self.pairs:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in self.pairs], [m for _, m in self.pairs])

    def release(self) -> None:
        """Drop the fp32 gradient copies (after the step, or when gradients are zeroed)."""
        for _, master in self.pairs:
            master.grad = None


class CompensatedWeights:
    """bf16 weights updated in fp32 with a bf16 Kahan buffer (the `bf16-true` preset)."""

    def __init__(
        self,
        pairs: list[tuple[nn.Parameter, nn.Parameter]],
        compensation: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
    ) -> None:
        self.pairs = pairs  # (model parameter in bf16, fp32 stand-in the optimizer steps; empty between steps)
        self.compensation = compensation  # bf16: what rounding the weight lost, per parameter
        self.optimizer = optimizer

    @property
    def optimizer_params(self) -> Iterator[nn.Parameter]:
        return (shadow for _, shadow in self.pairs)

    def grads_in(self) -> list[torch.Tensor]:
        """Materialise fp32 weights (bf16 weight + compensation) and gradients for the update."""
        grads = []
        with torch.no_grad():
            for (param, shadow), comp in zip(self.pairs, self.compensation):
                if param.grad is None:
                    shadow.grad = None
                    continue
                shadow.data = param.to(torch.float32).add_(comp)
                shadow.grad = param.grad.to(torch.float32)
                grads.append(shadow.grad)
                self._cast_state(param, shadow, torch.float32)
        return grads

    def weights_out(self) -> None:
        """Round the updated fp32 weights into bf16 and keep the rounding error (Kahan)."""
        with torch.no_grad():
            for (param, shadow), comp in zip(self.pairs, self.compensation):
                if shadow.grad is None:
                    continue
                param.copy_(shadow)
                comp.copy_(shadow.sub_(param))
                self._cast_state(param, shadow, torch.bfloat16)

    def release(self) -> None:
        """Free the fp32 stand-ins: between steps bf16-true holds no fp32 copy of anything."""
        for _, shadow in self.pairs:
            shadow.grad = None
            shadow.data = _EMPTY_FP32

    def store_state_low(self) -> None:
        """Store per-element optimizer state in bf16 (after loading a state_dict, which casts it to fp32)."""
        for param, shadow in self.pairs:
            self._cast_state(param, shadow, torch.bfloat16)

    def _cast_state(self, param: nn.Parameter, shadow: nn.Parameter, dtype: torch.dtype) -> None:
        state = self.optimizer.state.get(shadow)
        if not state:
            return
        for key, value in state.items():
            # Per-element state (moments, momentum buffers) only; scalar step counters stay exact.
            if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == param.shape:
                state[key] = value.to(dtype)


_EMPTY_FP32 = torch.empty(0, dtype=torch.float32)


class AmpOptimizer(torch.optim.Optimizer):
    """The optimizer `Accelerator.prepare` returns: the user's optimizer plus ampkit's step logic.

    `step()` acts only on accumulation boundaries, unscales gradients, skips overflowing steps on
    the device and lands fp32 updates in low-precision weights; `zero_grad()` acts only at the
    start of an accumulation cycle. Everything else (`param_groups`, `state`, `state_dict`, any
    attribute) is the wrapped optimizer's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, acc: Accelerator, weights: MasterWeights | CompensatedWeights | None) -> None:
        # No super().__init__: param_groups and state are the wrapped optimizer's own objects.
        self.optimizer = optimizer
        self._acc = acc
        self._weights = weights
        self._stage = Stage.READY
        self._found_inf: torch.Tensor | None = None
        # fused Adam/AdamW/SGD take found_inf and skip on the device; others need one host read.
        self._skips_on_device = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self._outcomes = StepOutcomes(acc.device) if acc.scaler is not None else None
        self._model_params = [p for p, _ in weights.pairs] if weights is not None else []
        self.attempted_steps = 0  # optimizer steps run or skipped (host count, exact)
        self.applied_steps = 0  # reconciled outcomes (exact after reconcile(block=True))
        self.skipped_steps = 0
        self._overflows_at_min = 0
        self._last_good_scale: float | None = None
        self._latest_applied = True
        self._schedulers: list[Any] = []

    # --- the wrapped optimizer's surface ------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._weights is not None:
            raise StepOrderError(
                "add_param_group() on an optimizer prepared with a low-precision-weight preset "
                f"({self._acc.policy.name!r}) is not supported: add the group before acc.prepare()"
            )
        self.optimizer.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"AmpOptimizer({self.optimizer.__class__.__name__}, precision={self._acc.policy.name!r})"

    # --- the step -----------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero gradients, but only at the start of an accumulation cycle."""
        if not self._acc._cycle_start():
            return
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if self._weights is not None:
            self._weights.release()
            for p in self._model_params:
                p.grad = None
        self._stage = Stage.READY

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Apply the update on accumulation boundaries; skip it on the device if gradients overflowed."""
        if closure is not None:
            raise StepOrderError("optimizer.step(closure) is not supported by ampkit: compute the loss in the loop and call acc.backward(loss)")
        if self._stage in (Stage.READY, Stage.STEPPED):
            raise StepOrderError(
                "optimizer.step() was called but acc.backward(loss) has not run since the last "
                "optimizer step: replace loss.backward() with acc.backward(loss)"
            )
        if not self._acc._cycle_end():
            return None  # a non-boundary micro-step: gradients keep accumulating
        self.unscale_()
        result = None
        scaler = self._acc.scaler
        if scaler is None:
            result = self.optimizer.step()
        else:
            found_inf = self._found_inf
            assert found_inf is not None
            if self._skips_on_device:
                self.optimizer.found_inf = found_inf  # type: ignore[attr-defined]
                self.optimizer.grad_scale = None  # type: ignore[attr-defined]  # grads already unscaled
                try:
                    result = self.optimizer.step()
                finally:
                    del self.optimizer.found_inf, self.optimizer.grad_scale  # type: ignore[attr-defined]
            elif not found_inf.item():  # sync: this optimizer cannot skip on the device (use fused=True)
                result = self.optimizer.step()
            self._acc._pending_found_infs.append(found_inf)
            assert self._outcomes is not None
            self._outcomes.record(found_inf, scaler.scale_tensor)
        if self._weights is not None:
            self._weights.weights_out()
            self._weights.release()
        self._stage = Stage.STEPPED
        self.attempted_steps += 1
        recorder = self._acc._recorder
        if recorder is not None and self is self._acc._optimizers[0]:
            recorder.step()
        if self._outcomes is None:
            self.applied_steps += 1
        else:
            self.reconcile()
        return result

    def unscale_(self) -> None:
        """Bring gradients into the optimizer's parameters, unscaled, and set the overflow flag.

        Idempotent within a step: `acc.clip_grad_norm_` calls it before clipping, `step` after.
        """
        if self._stage is Stage.UNSCALED:
            return
        if self._stage is not Stage.BACKWARD:
            raise StepOrderError(
                f"gradients cannot be unscaled in stage {self._stage.value!r}: call acc.backward(loss) first"
            )
        grads = self._weights.grads_in() if self._weights is not None else None
        scaler = self._acc.scaler
        if scaler is not None:
            if grads is None:
                grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
            self._found_inf = torch.zeros((), dtype=torch.float32, device=scaler.scale_tensor.device)
            scaler.unscale_(grads, self._found_inf)
            if self._acc.distributed.enabled:
                agree_on_overflow(self._found_inf)  # every rank skips the same steps, decided on the device
        self._stage = Stage.UNSCALED

    def _on_backward(self) -> None:
        if self._stage is Stage.UNSCALED:
            raise StepOrderError(
                "acc.backward(loss) ran after the gradients were unscaled (acc.clip_grad_norm_) in the same "
                "optimizer step: clip once, after the last backward and right before optimizer.step()"
            )
        self._stage = Stage.BACKWARD

    # --- outcomes -----------------------------------------------------------------------------
    def reconcile(self, block: bool = False) -> None:
        """Count the step outcomes that have landed on the host (all of them if `block`)."""
        if self._outcomes is None:
            return
        scaler = self._acc.scaler
        assert scaler is not None
        for outcome in self._outcomes.poll(block=block):
            index = self.applied_steps + self.skipped_steps + 1
            for scheduler in self._schedulers:
                scheduler._on_outcome(index, outcome.skipped)
            self._latest_applied = not outcome.skipped
            recorder = self._acc._recorder
            if recorder is not None and self is self._acc._optimizers[0]:
                recorder.outcomes.append(outcome)
            if not outcome.skipped:
                self.applied_steps += 1
                self._overflows_at_min = 0
                self._last_good_scale = outcome.scale
                continue
            self.skipped_steps += 1
            if scaler.min_scale is not None and outcome.scale <= scaler.min_scale:
                self._overflows_at_min += 1
                if self._overflows_at_min >= scaler.collapse_after:
                    raise LossScaleCollapse(self._collapse_message(scaler.min_scale))

    def latest_outcome(self) -> bool | None:
        """Whether the latest step was applied (True), skipped (False), or is not known yet (None)."""
        if self._outcomes is None:
            return True
        if self.applied_steps + self.skipped_steps < self.attempted_steps:
            return None
        return self._latest_applied

    def _collapse_message(self, min_scale: float) -> str:
        good = f"{self._last_good_scale:g}" if self._last_good_scale is not None else "none (no step was ever applied)"
        bf16 = "bf16-mixed (this device runs bf16)" if self._acc._bf16_runs() else "fp32 or a device with bf16"
        return (
            f"loss scale collapsed: {self._overflows_at_min} optimizer steps in a row overflowed at the "
            f"minimum scale {min_scale:g} ({self.skipped_steps} of {self.attempted_steps} steps skipped in all; "
            f"last applied step used scale {good}). fp16 cannot represent this model's activations or "
            f"gradients: try precision={bf16}, keep the overflowing layers in fp32 with keep_fp32=[...] "
            f"(`ampkit doctor --numerics` names them), or a lower learning rate"
        )
