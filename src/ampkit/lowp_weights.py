"""The fp32 truth behind low-precision weights: master copies, or Kahan-compensated bf16 weights.

For the presets that store weights in bf16/fp16, the user's optimizer is pointed at fp32 parameters
that ampkit keeps in step with the model:

* `MasterWeights` (`*-master`, apex O2): persistent fp32 copies; the update lands on them and is
  copied into the model's low-precision weights.
* `CompensatedWeights` (`bf16-true`): no persistent fp32 copy. For the update only, an fp32 view of
  each weight is made from the bf16 weight plus a bf16 Kahan buffer holding what rounding lost; the
  optimizer steps it, the result is rounded back into the weight and the new rounding error into the
  buffer. Optimizer state tensors are stored in bf16 between steps.

Both own their state (`state_dict()`, exact, bit for bit) and say what each weight stands for
(`fp32_values()`), which is how checkpoints convert between presets.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ampkit.errors import PrecisionError, StepOrderError
from ampkit.flat_buffer import EMPTY_FP32, FlatBuffer
from ampkit.precision import Precision


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
        self._grad = FlatBuffer(self._masters, torch.float32, free_step_buffers)
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


    # --- state ----------------------------------------------------------------------------------
    kind = "master"

    def fp32_value(self, i: int) -> torch.Tensor:
        """The fp32 value the i-th low-precision weight stands for: its master copy."""
        return self._masters[i].detach()

    def fp32_values(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(model parameter, the fp32 value it stands for) for every weight."""
        return [(p, self.fp32_value(i)) for i, p in enumerate(self._params)]

    def set_fp32_values(self, values: dict[nn.Parameter, torch.Tensor]) -> None:
        """Set parameters and masters from fp32 values (a checkpoint of another preset)."""
        with torch.no_grad():
            for p, master in self.pairs:
                if p in values:
                    master.copy_(values[p].to(master.device, torch.float32))
                    p.copy_(master)

    def state_dict(self) -> dict[str, Any]:
        """The fp32 masters, exactly (by position)."""
        return {"kind": "master", "values": [m.detach() for m in self._masters]}

    def check_state_dict(self, state: dict[str, Any]) -> str | None:
        return _check_values(state, "master", self._masters)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        problem = self.check_state_dict(state)
        if problem is not None:
            raise ValueError(problem)
        with torch.no_grad():
            torch._foreach_copy_(self._masters, [v.to(m.device) for v, m in zip(state["values"], self._masters)])


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
        self._comp = FlatBuffer(self._params, self._params[0].dtype if pairs else torch.bfloat16, releasable=False)
        self.compensation = self._comp.views  # what rounding each weight lost, in its own dtype
        with torch.no_grad():
            for (param, initial), comp in zip(pairs, self.compensation):
                comp.copy_(initial - param.to(torch.float32))
        self._work = FlatBuffer(self._params, torch.float32, self._free)  # fp32 weights during the step
        self._grad = FlatBuffer(self._params, torch.float32, self._free)  # fp32 gradients during the step
        self._round = FlatBuffer(self._params, self._comp.buffer.dtype, self._free)  # the updated weights, rounded
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
            shadow.data = EMPTY_FP32
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

    # --- state ----------------------------------------------------------------------------------
    kind = "compensated"

    def fp32_value(self, i: int) -> torch.Tensor:
        """The fp32 value the i-th weight stands for: the bf16 weight plus its compensation."""
        return self._params[i].detach().float() + self.compensation[i].float()

    def fp32_values(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(model parameter, the fp32 value it stands for) for every weight."""
        return [(p, self.fp32_value(i)) for i, p in enumerate(self._params)]

    def set_fp32_values(self, values: dict[nn.Parameter, torch.Tensor]) -> None:
        """Round fp32 values into the weights and keep what rounding lost (a checkpoint of another preset)."""
        with torch.no_grad():
            for p, comp in zip(self._params, self.compensation):
                if p in values:
                    value = values[p].to(p.device, torch.float32)
                    p.copy_(value)
                    comp.copy_(value - p.float())

    def state_dict(self) -> dict[str, Any]:
        """The Kahan compensation buffers, exactly (the weights themselves are the model's)."""
        return {"kind": "compensated", "values": [c.detach() for c in self.compensation]}

    def check_state_dict(self, state: dict[str, Any]) -> str | None:
        return _check_values(state, "compensated", self.compensation)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load the buffers bit for bit (call after the model's own weights are loaded)."""
        problem = self.check_state_dict(state)
        if problem is not None:
            raise ValueError(problem)
        with torch.no_grad():
            torch._foreach_copy_(self.compensation, [v.to(c.device) for v, c in zip(state["values"], self.compensation)])


def _check_values(state: Any, kind: str, like: list[torch.Tensor]) -> str | None:
    if not isinstance(state, dict) or state.get("kind") != kind:
        got = state.get("kind") if isinstance(state, dict) else type(state).__name__
        return f"it holds {got!r} low-precision-weight state, this optimizer keeps {kind!r}"
    values = state.get("values")
    if not isinstance(values, list) or len(values) != len(like):
        return f"it holds {len(values) if isinstance(values, list) else '?'} {kind} tensors, this optimizer has {len(like)}"
    for i, (v, t) in enumerate(zip(values, like)):
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(t.shape) or v.dtype != t.dtype:
            return f"{kind} tensor {i} is {getattr(v, 'dtype', '?')} {tuple(getattr(v, 'shape', ()))}, expected {t.dtype} {tuple(t.shape)}"
    return None


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
        self.store = FlatBuffer(like, low, releasable=False)
        self.work = FlatBuffer(like, torch.float32, free_step_buffers)
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



#: What the prepared optimizer keeps for a low-precision-weight preset.
LowPrecisionWeights = MasterWeights | CompensatedWeights


def stand_in_weights(optimizer: torch.optim.Optimizer, policy: Precision, prepared: set[int],
                     originals: dict[nn.Parameter, torch.Tensor], free_step_buffers: bool,
                     ) -> tuple[LowPrecisionWeights | None, list[nn.Parameter]]:
    """Point `optimizer` at fp32 parameters standing in for the model's low-precision ones.

    `prepared`: ids of the prepared models' parameters; `originals`: their exact fp32 initial values
    (taken, not copied). Returns the weight store and the parameters whose original was taken.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    low = [p for p in params if p.is_floating_point() and p.dtype != torch.float32]
    if any(id(p) not in prepared for p in low):
        raise StepOrderError(
            f"precision {policy.name!r}: prepare the model together with (or before) its optimizer, "
            f"e.g. model, optimizer = acc.prepare(model, optimizer)"
        )
    if optimizer.state:
        raise StepOrderError(
            f"precision {policy.name!r}: the optimizer already has state; prepare it before its first step "
            f"(load its state_dict after prepare)"
        )
    devices = sorted({str(p.device) for p in low})
    if len(devices) > 1:  # the update's flat fp32 buffers live on one device
        raise PrecisionError(
            f"precision {policy.name!r} keeps its fp32 update buffers on one device, but this optimizer's "
            f"parameters are on {', '.join(devices)}: use one optimizer per device, or precision='bf16-mixed'"
        )
    pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
    stand_in: dict[int, nn.Parameter] = {}
    taken = []
    for p in low:
        init = originals.get(p)
        if init is None:  # a weight already low-precision before prepare: its value is all there is
            init = p.detach().to(torch.float32)
        else:
            taken.append(p)
        fp32 = nn.Parameter(init, requires_grad=p.requires_grad)
        pairs.append((p, fp32))
        stand_in[id(p)] = fp32
    for group in optimizer.param_groups:
        group["params"] = [stand_in.get(id(p), p) for p in group["params"]]
    if policy.master_weights:
        return MasterWeights(pairs, free_step_buffers), taken
    return CompensatedWeights(pairs, optimizer, free_step_buffers), taken
