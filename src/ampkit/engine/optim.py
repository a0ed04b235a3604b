"""The wrapped optimizer: loss-scale unscaling, sync-free skips, accumulation boundaries, and the
fp32 update of low-precision weights (`ampkit.precision.weights`).

The user's optimizer object, algorithm and flags are never changed (parity with a hand-written loop
depends on it). `AmpOptimizer` never holds its Accelerator: it steps through a `StepContext` (the cycle,
the scaler, events, item counts, the device) and owns its own state (`state_dict()`).
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampkit.engine.distributed import agree_on_overflow
from ampkit.engine.events import Listener
from ampkit.engine.faults import NonFiniteWatch, collapse_message
from ampkit.engine.optim_state import state_problems
from ampkit.engine.step_context import StepContext
from ampkit.engine.step_order import why_count_blocks, why_grad_scaler, why_no_backward
from ampkit.errors import LossScaleCollapse, StepOrderError
from ampkit.precision.outcomes import StepOutcomes
from ampkit.precision.scaler import coalesce_fp16_sparse
from ampkit.precision.weights import WeightStore


class Stage(enum.Enum):
    """Where an optimizer is inside one training step (torch's GradScaler has the same idea)."""

    READY = "ready"  # gradients zeroed or stepped; waiting for acc.backward
    BACKWARD = "backward"  # acc.backward ran: gradients are (possibly scaled) low-precision grads
    UNSCALED = "unscaled"  # gradients unscaled and in the optimizer's fp32 parameters; found_inf set
    STEPPED = "stepped"  # the optimizer step ran (or was skipped on the device)


#: Module constants: an enum member read on its class costs ~80 ns, and a step reads about ten.
READY, BACKWARD, UNSCALED, STEPPED = Stage.READY, Stage.BACKWARD, Stage.UNSCALED, Stage.STEPPED


class AmpOptimizer(torch.optim.Optimizer):
    """The optimizer `Accelerator.prepare` returns: the user's optimizer plus ampkit's step logic.

    `step()` acts only on accumulation boundaries, unscales gradients, skips overflowing steps on
    the device and lands fp32 updates in low-precision weights; `zero_grad()` acts only at the
    start of an accumulation cycle. Everything else (`param_groups`, `state`, any attribute) is the
    wrapped optimizer's. `state_dict()` is the wrapped optimizer's plus an `"ampkit"` entry (step
    counters, stage, and the fp32 truth of low-precision weights); a plain torch optimizer loading
    it ignores that entry.
    """

    #: For `torch.amp.GradScaler.step(self)`: it then sets `found_inf` and calls `step()`, which names the scaler.
    _step_supports_amp_scaling = True

    def __init__(
        self, optimizer: torch.optim.Optimizer, ctx: StepContext, weights: WeightStore | None, index: int = 0
    ) -> None:
        # No super().__init__: param_groups and state are the wrapped optimizer's own objects.
        self.optimizer = optimizer
        self.weights = weights  # master copies / Kahan buffers (None for presets that keep fp32 weights)
        self._ctx = ctx
        self._index = index  # its place among the prepared optimizers (they share one loss-scale update)
        self._stage = READY
        self._items: torch.Tensor | None = None  # items of this cycle's backwards (acc.backward(num_items=))
        self._backwards = 0  # backwards since the gradients were last zeroed or stepped
        self._since_step = 0  # backwards since the last step() call (boundary or not)
        self._told_blocks = False
        self._found_inf: torch.Tensor | None = None
        self._last_loss: torch.Tensor | None = None  # the latest loss before scaling (explains a collapse)
        # fused Adam/AdamW/SGD take found_inf and skip on the device; others need one host read.
        self._skips_on_device = bool(getattr(optimizer, "_step_supports_amp_scaling", False)) or all(
            g.get("fused") for g in optimizer.param_groups
        )
        self._plain_zero_grad = type(optimizer).zero_grad is torch.optim.Optimizer.zero_grad  # not overridden
        self._outcomes = StepOutcomes(ctx.device) if ctx.scaler is not None else None
        # without a scaler nothing skips a NaN step: it is named instead (clipping hands it the gradient norm)
        self.non_finite = NonFiniteWatch(ctx.device, ctx.precision) if ctx.scaler is None else None
        self._model_params = [p for p, _ in weights.pairs] if weights is not None else []
        self.attempted_steps = 0  # optimizer steps run or skipped (host count, exact)
        self.applied_steps = 0  # reconciled outcomes (exact after reconcile(block=True))
        self.skipped_steps = 0
        self._overflows_at_min = 0
        self._last_good_scale: float | None = None
        self._latest_applied = True
        self._outcome_watchers: list[Callable[[int, bool], None]] = []

    # --- the wrapped optimizer's surface ------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
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

    @property
    def item_weighted(self) -> bool:
        """This cycle's gradients are divided by its items (`acc.backward(loss_sum, num_items=n)`)."""
        return self._items is not None

    @property
    def stage(self) -> Stage:
        """Where this optimizer is inside the current step."""
        return self._stage

    # --- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state_dict plus ampkit's own state under "ampkit"."""
        if self._stage is UNSCALED:
            raise StepOrderError(
                "optimizer.state_dict() between acc.clip_grad_norm_() and optimizer.step(): the gradients are "
                "half-way through the update; save after optimizer.step()"
            )
        self.reconcile(block=True)
        state = dict(self.optimizer.state_dict())
        state["ampkit"] = {
            "optimizer": type(self.optimizer).__name__,
            "attempted": self.attempted_steps,
            "applied": self.applied_steps,
            "skipped": self.skipped_steps,
            "stage": self._stage.value,
            "overflows_at_min": self._overflows_at_min,
            "weights": self.weights.state_dict() if self.weights is not None else None,
            # sync: a checkpoint reads once; the items of a cycle saved mid-way, with its gradients
            "items": None if self._items is None else float(self._items),
            "backwards": self._backwards,
        }
        return state

    def check_state_dict(self, state: dict[str, Any]) -> list[str]:
        """Every reason `state` cannot be loaded into this optimizer (empty: it fits). Changes nothing."""
        return state_problems(self.optimizer, self.weights, state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict from `state_dict()` (or a plain torch optimizer's: then counters stay as they are)."""
        amp = state_dict.get("ampkit")
        self.optimizer.load_state_dict({k: v for k, v in state_dict.items() if k != "ampkit"})
        if self.weights is not None:
            self.weights.state_loaded()  # which weights have state, their step counters; bf16-true stores it in bf16
        if amp is None:
            return
        self.attempted_steps, self.applied_steps, self.skipped_steps = amp["attempted"], amp["applied"], amp["skipped"]
        self._overflows_at_min = amp["overflows_at_min"]
        items, device = amp.get("items"), self._ctx.device
        self._items = None if items is None else torch.full((), items, dtype=torch.float32, device=device)
        self._backwards = int(amp.get("backwards", 0))
        self._stage = Stage(amp["stage"])
        if self._outcomes is not None:
            self._outcomes.clear()
        if self.non_finite is not None:
            self.non_finite.clear()
        if self.weights is not None and amp.get("weights") is not None:
            self.weights.load_state_dict(amp["weights"])

    def fp32_values(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(model parameter, the fp32 value it stands for) for each low-precision weight this optimizer updates."""
        return self.weights.fp32_values() if self.weights is not None else []

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self.weights is not None:
            raise StepOrderError(
                "add_param_group() on an optimizer prepared with a low-precision-weight preset "
                f"({self._ctx.precision!r}) is not supported: add the group before acc.prepare()"
            )
        self.optimizer.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"AmpOptimizer({self.optimizer.__class__.__name__}, precision={self._ctx.precision!r})"

    # --- the step -----------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero gradients, but only at the start of an accumulation cycle."""
        events = self._ctx.events
        if events.listeners:
            events.emit(Listener.on_zero_grad_start, self)
        if self._ctx.cycle.at_start:
            if not (set_to_none and self._plain_zero_grad) or torch._C._autograd._profiler_enabled():
                self.optimizer.zero_grad(set_to_none=set_to_none)
            else:
                # torch's own zero_grad(set_to_none=True) minus its profiler label (~6 µs a call, profiler on or off)
                for p in (p for group in self.optimizer.param_groups for p in group["params"]):
                    p.grad = None
            if self.weights is not None:
                self.weights.release()
                for p in self._model_params:
                    p.grad = None
            self._stage = READY
            self._items, self._backwards = None, 0
        if events.listeners:
            events.emit(Listener.on_zero_grad_end, self)

    def step(self, closure: Any = None) -> Any:
        """Apply the update on accumulation boundaries; skip it on the device if gradients overflowed."""
        if closure is not None:
            raise StepOrderError(
                "optimizer.step(closure) is not supported by ampkit: compute the loss in the loop and call "
                "acc.backward(loss)"
            )
        if "found_inf" in self.__dict__:  # set by torch.amp.GradScaler.step(optimizer) for this call
            for name in ("found_inf", "grad_scale"):  # the scaler removes them only after a step that returns
                self.__dict__.pop(name, None)
            raise StepOrderError(why_grad_scaler(self._ctx.precision))
        if self._stage is READY or self._stage is STEPPED:
            params = [p for group in self.optimizer.param_groups for p in group["params"]] + self._model_params
            raise StepOrderError(why_no_backward(self._stage is STEPPED, params))
        events = self._ctx.events
        if events.listeners:
            events.emit(Listener.on_step_start, self)
        uncounted, self._since_step = self._since_step, 0
        if not self._ctx.cycle.at_end:
            if uncounted > 1 and not self._told_blocks and not self._ctx.cycle.blocks_used:
                self._told_blocks = True
                warnings.warn(why_count_blocks(uncounted, self._ctx.cycle.steps), stacklevel=2)
            if events.listeners:
                events.emit(Listener.on_step_end, self, False)
            return None  # a non-boundary micro-step: gradients keep accumulating
        if self.non_finite is not None:
            self.non_finite.stepped(self.attempted_steps + 1)
        result = self._update()
        if events.listeners:
            events.emit(Listener.on_step_end, self, True)
        if self._outcomes is None:
            self.applied_steps += 1
        else:
            self.reconcile()
        return result

    def _update(self) -> Any:
        ctx, weights = self._ctx, self.weights
        # fp32 weights and no loss scaling: the user's step as it is (nothing to unscale: step() checked the stage)
        if weights is None and ctx.scaler is None:
            if self._items is not None or self._ctx.cycle.rescale is not None:
                self.unscale_()  # divides the gradients by the cycle's items (or its real length)
            result = self.optimizer.step()
        else:
            result = self._lowp_or_scaled_update()
        self._stage = STEPPED
        self._items, self._backwards = None, 0
        self.attempted_steps += 1
        if ctx.cuda_graphs:
            # The step is over: the next forward may reuse the graphs' output memory (CUDA graph trees).
            torch.compiler.cudagraph_mark_step_begin()
        return result

    def _lowp_or_scaled_update(self) -> Any:
        weights = self.weights
        # bf16-true reads the model's gradients itself (unless clipping brought them in already); the
        # -master presets' gradients come in whole (one foreach copy), their masters stepped in one call
        reads_own = weights is not None and weights.reads_own_grads
        if not reads_own or self._stage is not BACKWARD or self._items is not None or self._ctx.cycle.rescale:
            self.unscale_()
        update = self.optimizer.step if self._ctx.scaler is None else self._scaled_step
        return weights.step(update) if weights is not None else update()

    def _scaled_step(self) -> Any:
        """The user's step, skipped for inf/NaN gradients: on the device where the optimizer can, else after
        one read of the flag; the outcome is queued for the host, the scale update owed to the scaler."""
        scaler, found_inf = self._ctx.scaler, self._found_inf
        assert scaler is not None and found_inf is not None
        result = None
        if self._skips_on_device:
            self.optimizer.found_inf = found_inf  # type: ignore[attr-defined]
            self.optimizer.grad_scale = None  # type: ignore[attr-defined]  # grads already unscaled
            try:
                result = self.optimizer.step()
            finally:
                del self.optimizer.found_inf, self.optimizer.grad_scale  # type: ignore[attr-defined]
        elif not found_inf.item():  # sync: this optimizer cannot skip on the device (use fused=True)
            result = self.optimizer.step()
        assert self._outcomes is not None
        self._outcomes.record(found_inf, scaler.scale_tensor)  # the scale this step used
        scaler.owe_update(self._index, found_inf)
        return result

    def unscale_(self) -> None:
        """Bring gradients into the optimizer's parameters, unscaled, and set the overflow flag.

        Idempotent within a step: `acc.clip_grad_norm_` calls it before clipping, `step` after.
        """
        if self._stage is UNSCALED:
            return
        if self._stage is not BACKWARD:
            raise StepOrderError(
                f"gradients cannot be unscaled in stage {self._stage.value!r}: call acc.backward(loss) first"
            )
        grads = self.weights.grads_in() if self.weights is not None else None
        scaler = self._ctx.scaler
        factor = self._ctx.items.factor(self._items) if self._items is not None else None
        if self._items is None and (rescale := self._ctx.cycle.rescale) is not None:  # closed by acc.end_cycle()
            factor = torch.full((), rescale, dtype=torch.float32, device=self._ctx.device)
        if grads is None and (scaler is not None or factor is not None):
            grads = [
                coalesce_fp16_sparse(p) for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None
            ]
        if scaler is not None:
            self._found_inf = torch.zeros((), dtype=torch.float32, device=scaler.scale_tensor.device)
            scaler.unscale_(grads or [], self._found_inf, factor)
            if self._ctx.distributed:
                agree_on_overflow(self._found_inf)  # every rank skips the same steps, decided on the device
        elif factor is not None and grads:
            torch._foreach_mul_(grads, factor)
        self._stage = UNSCALED

    def check_backward(self, counted: bool = False) -> None:
        """Raise if a backward now would break this optimizer's step (called before the backward runs);
        `counted`: it has `num_items=`."""
        if self._backwards and counted != (self._items is not None):
            raise StepOrderError(
                f"acc.backward(loss{', num_items=...' if counted else ''}) after {self._backwards} backward(s) "
                f"{'without' if counted else 'with'} num_items= since the last optimizer step: one cycle's gradients "
                f"are either divided by its items (every backward with num_items=, summed losses) or by "
                f"grad_accum_steps (none with it, mean losses)"
            )
        if self._stage is UNSCALED:
            raise StepOrderError(
                "acc.backward(loss) ran after the gradients were unscaled (acc.clip_grad_norm_) in the same "
                "optimizer step: clip once, after the last backward and right before optimizer.step()"
            )

    def on_backward(self, loss: torch.Tensor | None = None, items: torch.Tensor | None = None) -> None:
        """A backward completed: the gradients are ready for this step (`loss`: it, detached, unscaled;
        `items`: the items its summed loss adds up, with `num_items=`)."""
        self._stage = BACKWARD
        if self.non_finite is None:
            self._last_loss = loss
        elif loss is not None:
            self.non_finite.saw_loss(loss)  # held until the step sends it to the host, then let go
        self._backwards += 1
        self._since_step += 1
        if items is not None:
            self._items = items if self._items is None else self._items + items

    # --- outcomes -----------------------------------------------------------------------------
    def watch_outcomes(self, callback: Callable[[int, bool], None]) -> None:
        """Call `callback(step_index, skipped)` as each step's outcome reaches the host (schedulers use it)."""
        self._outcome_watchers.append(callback)

    def reconcile(self, block: bool = False) -> None:
        """Count the step outcomes that have landed on the host (all of them if `block`)."""
        if self.non_finite is not None:
            self.non_finite.poll(block)
        if self._outcomes is None:
            return
        scaler = self._ctx.scaler
        assert scaler is not None
        events = self._ctx.events
        for outcome in self._outcomes.poll(block=block):
            index = self.applied_steps + self.skipped_steps + 1
            for watcher in self._outcome_watchers:
                watcher(index, outcome.skipped)
            self._latest_applied = not outcome.skipped
            if events.listeners:
                events.emit(Listener.on_outcome, self, outcome)
            if not outcome.skipped:
                self.applied_steps += 1
                self._overflows_at_min = 0
                self._last_good_scale = outcome.scale
                continue
            self.skipped_steps += 1
            if outcome.scale <= scaler.floor:
                self._overflows_at_min += 1
                if self._overflows_at_min >= scaler.collapse_after:
                    raise LossScaleCollapse(
                        collapse_message(
                            self._overflows_at_min,
                            self.skipped_steps,
                            self.attempted_steps,
                            outcome.scale,
                            self._last_loss,
                            self._last_good_scale,
                            self._ctx.bf16_runs,
                        )
                    )

    def latest_outcome(self) -> bool | None:
        """Whether the latest step was applied (True), skipped (False), or is not known yet (None)."""
        if self._outcomes is None:
            return True
        if self.applied_steps + self.skipped_steps < self.attempted_steps:
            return None
        return self._latest_applied
