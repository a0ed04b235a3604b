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
import sys
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


class _Flat:
    """One contiguous buffer and, for each tensor in `like`, a view of it with that tensor's shape.

    ampkit's per-step fp32 buffers (gradients for masters, working weights and optimizer state for
    `bf16-true`) are flat so that filling, rounding and compensating them is one kernel, not one
    per parameter. A `releasable` buffer's memory is released by `free()` between steps and taken
    back by `alloc()`, the views kept (making views costs microseconds per tensor, every step).
    Releasing memory under a tensor someone still holds would leave it reading freed memory, so
    `free()` first checks that nothing outside holds the buffer (a gradient kept for logging, a
    view of it): if something does, the buffer is left to its holder and the next step makes a new one.
    """

    def __init__(self, like: list[torch.Tensor], dtype: torch.dtype, releasable: bool = True) -> None:
        self.device = like[0].device if like else torch.device("cpu")
        self.dtype = dtype
        self.shapes = [t.shape for t in like]
        self.sizes = [t.numel() for t in like]
        self.releasable = releasable  # False: kept between steps (see Accelerator(free_step_buffers=))
        self.buffer: torch.Tensor = _EMPTY_FP32
        self.views: list[torch.Tensor] = []
        self._nbytes = 0
        self._holders = (0, 0)  # (storage users, Python references per view) when only ampkit holds it
        self.alloc()

    def alloc(self) -> None:
        if not self.views:
            self.buffer = torch.empty(sum(self.sizes), dtype=self.dtype, device=self.device)
            self.views = [v.view(shape) for v, shape in zip(self.buffer.split(self.sizes), self.shapes)]
            self._nbytes = self.buffer.untyped_storage().nbytes()
            self._holders = self._count_holders()
        elif self.buffer.untyped_storage().nbytes() != self._nbytes:
            self.buffer.untyped_storage().resize_(self._nbytes)

    def free(self) -> None:
        if not self.releasable or not self.views:
            return
        if _storage_users is None or self._count_holders() != self._holders:
            self.buffer, self.views = _EMPTY_FP32, []  # held outside (or cannot tell): theirs now
        else:
            self.buffer.untyped_storage().resize_(0)

    def _count_holders(self) -> tuple[int, int]:
        if _storage_users is None:
            return (0, 0)
        storage = _storage_users(self.buffer.untyped_storage()._cdata)  # a new view of it adds one
        refs = max((sys.getrefcount(v) for v in self.views), default=0)  # holding one of ours adds one
        return storage, refs


#: Users of a storage (torch-internal; without it `_Flat` makes a new buffer every step, which is safe).
_storage_users = getattr(torch._C, "_storage_Use_Count", None)


def _grads(params: list[nn.Parameter]) -> tuple[list[int], list[torch.Tensor]]:
    """Indices and gradients of the parameters that have one (an unused layer has none)."""
    grads = [p.grad for p in params]
    if all(g is not None for g in grads):
        return list(range(len(params))), grads  # type: ignore[return-value]
    kept = [i for i, g in enumerate(grads) if g is not None]
    return kept, [grads[i] for i in kept]  # type: ignore[misc]


class MasterWeights:
    """Persistent fp32 master copies of low-precision parameters (the `*-master` presets).

    The fp32 gradients the masters receive live in one flat buffer that exists only during the
    step; copying gradients in and weights out are single foreach kernels.
    """

    def __init__(self, pairs: list[tuple[nn.Parameter, nn.Parameter]], free_step_buffers: bool = True) -> None:
        self.pairs = pairs  # (model parameter in bf16/fp16, its fp32 master)
        self._params = [p for p, _ in pairs]
        self._masters = [m for _, m in pairs]
        self._grad = _Flat(self._masters, torch.float32, free_step_buffers)
        self._grad.free()

    @property
    def optimizer_params(self) -> Iterator[nn.Parameter]:
        return iter(self._masters)

    def grads_in(self) -> list[torch.Tensor]:
        """Give each master the fp32 copy of its model parameter's gradient; return those grads."""
        kept, grads = _grads(self._params)
        self._grad.alloc()
        views = [self._grad.views[i] for i in kept] if len(kept) != len(self._params) else self._grad.views
        if grads:
            torch._foreach_copy_(views, grads)
        present = set(kept) if len(kept) != len(self._params) else None
        for i, master in enumerate(self._masters):
            master.grad = self._grad.views[i] if present is None or i in present else None
        return views

    def weights_out(self) -> None:
        """Round the (possibly updated) masters into the model's parameters."""
        if self.pairs:
            with torch.no_grad():
                torch._foreach_copy_(self._params, self._masters)

    def release(self) -> None:
        """Drop the fp32 gradients (after the step, or when gradients are zeroed)."""
        for master in self._masters:
            master.grad = None
        self._grad.free()


class CompensatedWeights:
    """bf16 weights updated in fp32 with a bf16 Kahan buffer (the `bf16-true` preset).

    Between steps this preset holds, per parameter, the bf16 weight, its bf16 compensation and the
    optimizer's per-element state in bf16 (AdamW: 2 + 2 + 2 + 2 = 8 bytes). For the update only,
    fp32 working copies of weights, gradients and state are made in flat buffers (a few kernels in
    all), the user's optimizer steps them, and the results are rounded back.
    """

    def __init__(self, pairs: list[tuple[nn.Parameter, nn.Parameter]], optimizer: torch.optim.Optimizer,
                 free_step_buffers: bool = True) -> None:
        self.pairs = pairs  # (model parameter in bf16, fp32 stand-in the optimizer steps; empty between steps)
        self.optimizer = optimizer
        self._free = free_step_buffers
        self._params = [p for p, _ in pairs]
        self._shadows = [s for _, s in pairs]
        self._comp = _Flat(self._params, self._params[0].dtype if pairs else torch.bfloat16, releasable=False)
        self.compensation = self._comp.views  # what rounding each weight lost, in its own dtype
        with torch.no_grad():
            for (param, initial), comp in zip(pairs, self.compensation):
                comp.copy_(initial - param.to(torch.float32))
        self._work = _Flat(self._params, torch.float32, self._free)  # fp32 weights during the step
        self._grad = _Flat(self._params, torch.float32, self._free)  # fp32 gradients during the step
        self._round = _Flat(self._params, self._comp.buffer.dtype, self._free)  # the updated weights, rounded
        self._state: dict[str, _StateBuffers] = {}  # per-element optimizer state, by key
        self._state_count = -1  # len(optimizer.state) when the state buffers were last built
        self._kept: list[int] = []
        self.release()

    @property
    def optimizer_params(self) -> Iterator[nn.Parameter]:
        return iter(self._shadows)

    def grads_in(self) -> list[torch.Tensor]:
        """Materialise fp32 weights (bf16 weight + compensation), gradients and state for the update."""
        kept, grads = _grads(self._params)
        self._kept = kept
        every = len(kept) == len(self._params)
        self._work.alloc()
        self._grad.alloc()
        work = self._work.views if every else [self._work.views[i] for i in kept]
        grad_views = self._grad.views if every else [self._grad.views[i] for i in kept]
        params = self._params if every else [self._params[i] for i in kept]
        if grads:
            with torch.no_grad():
                torch._foreach_copy_(work, params)
                self._work.buffer.add_(self._comp.buffer)  # flat: unfilled entries are unused garbage
                torch._foreach_copy_(grad_views, grads)
        for i in kept:
            shadow = self._shadows[i]
            shadow.data = self._work.views[i]
            shadow.grad = self._grad.views[i]
        for buffers in self._state.values():
            buffers.to_fp32(self.optimizer.state)
        return grad_views

    def weights_out(self) -> None:
        """Round the updated fp32 weights into bf16 and keep the rounding error (Kahan)."""
        kept = self._kept
        if not kept:
            return
        every = len(kept) == len(self._params)
        self._round.alloc()
        with torch.no_grad():
            # Round flat, copy same-dtype per tensor, and keep what rounding lost (flat again): the
            # mixed-dtype arithmetic runs on whole buffers, never tensor by tensor.
            self._round.buffer.copy_(self._work.buffer)
            rounded = self._round.views if every else [self._round.views[i] for i in kept]
            torch._foreach_copy_(self._params if every else [self._params[i] for i in kept], rounded)
            self._work.buffer.sub_(self._round.buffer)
            if every:
                self._comp.buffer.copy_(self._work.buffer)
            else:
                torch._foreach_copy_([self.compensation[i] for i in kept], [self._work.views[i] for i in kept])
        del rounded  # a list of the round buffer's views: it must not count as a holder in free()
        self._round.free()
        if len(self.optimizer.state) != self._state_count:
            self._build_state()  # the optimizer created state (its first step, or a new parameter's)
        else:
            for buffers in self._state.values():
                buffers.to_low(self.optimizer.state)

    def release(self) -> None:
        """Free the fp32 working copies: between steps bf16-true holds no fp32 copy of anything."""
        for shadow in self._shadows:
            shadow.grad = None
            shadow.data = _EMPTY_FP32
        self._kept = []
        self._work.free()
        self._grad.free()
        self._round.free()
        for buffers in self._state.values():
            if buffers.active:  # a step unscaled the gradients but did not run: the state is unchanged
                buffers.to_low(self.optimizer.state, copy=False)

    def store_state_low(self) -> None:
        """Store per-element optimizer state in bf16 (after loading a state_dict, which casts it to fp32)."""
        self._state_count = -1
        self._build_state()

    def _build_state(self) -> None:
        """(Re)build the bf16 stores of the optimizer's per-element state from its current tensors."""
        state = self.optimizer.state
        low = self._params[0].dtype if self._params else torch.bfloat16
        holders: dict[str, list[int]] = {}  # state key -> indices of the parameters that have it
        for i, (shadow, param) in enumerate(zip(self._shadows, self._params)):
            for key, value in state.get(shadow, {}).items():
                if _per_element(key, value, param):
                    holders.setdefault(key, []).append(i)
        self._state = {}
        for key, indices in holders.items():
            shadows = [self._shadows[i] for i in indices]
            buffers = _StateBuffers(key, shadows, [self._params[i] for i in indices], low, self._free)
            with torch.no_grad():
                torch._foreach_copy_(buffers.store.views, [state[s][key] for s in shadows])
            buffers.to_low(state, copy=False)
            self._state[key] = buffers
        self._state_count = len(state)


def _per_element(key: str, value: Any, param: torch.Tensor) -> bool:
    # Per-element state (moments, momentum buffers) only; scalar step counters stay exact.
    return key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == param.shape


class _StateBuffers:
    """One per-element optimizer state key (e.g. AdamW's exp_avg) of the bf16-true parameters that
    have it: stored flat in bf16 between steps, worked on flat in fp32 during the step."""

    def __init__(self, key: str, shadows: list[nn.Parameter], like: list[torch.Tensor], low: torch.dtype,
                 free_step_buffers: bool) -> None:
        self.key = key
        self.shadows = shadows
        self.store = _Flat(like, low, releasable=False)
        self.work = _Flat(like, torch.float32, free_step_buffers)
        self.active = False  # True while the optimizer's state points at the fp32 work buffer

    def to_fp32(self, state: Any) -> None:
        self.active = True
        self.work.alloc()
        self.work.buffer.copy_(self.store.buffer)
        for shadow, view in zip(self.shadows, self.work.views):
            state[shadow][self.key] = view

    def to_low(self, state: Any, copy: bool = True) -> None:
        if copy:
            for shadow, view in zip(self.shadows, self.work.views):
                if state[shadow][self.key] is not view:  # the optimizer replaced the tensor, not updated it
                    view.copy_(state[shadow][self.key])
            self.store.buffer.copy_(self.work.buffer)
        for shadow, view in zip(self.shadows, self.store.views):
            state[shadow][self.key] = view
        del view  # the loop variable must not count as a holder of the work buffer in free()
        self.work.free()
        self.active = False


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
        if isinstance(self._weights, CompensatedWeights):
            self._weights.store_state_low()  # the loaded (fp32) state becomes bf16-true's stored state

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
        if self._acc._cuda_graphs:
            # The step is over: the next forward may reuse the graphs' output memory (CUDA graph trees).
            torch.compiler.cudagraph_mark_step_begin()
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
