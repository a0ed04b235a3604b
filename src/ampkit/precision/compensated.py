"""`CompensatedWeights`: bf16 weights kept exact by a bf16 Kahan buffer (the `bf16-true` preset; see
`ampkit.precision.weights`).

The weights, their compensation and the optimizer's per-element state each lie end to end in one flat
bf16 buffer, in the optimizer's group order, so that a group's weights are one range of each. For
AdamW, Adam and SGD a step is one fused kernel per range (`ampkit.precision.kahan`: weights, compensation,
gradients and state read once and written once; a range is a group's weights that have gradients and
equal step counters, normally the whole group): the launches per step depend on the groups, never on
the number of elements, and no fp32 copy of the model exists at any time. Any other optimizer is
stepped as it is on fp32 stand-ins of the whole model (`weight + compensation`), its state its own, and
the result rounded back with the new rounding error kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ampkit.precision import kahan
from ampkit.precision.flat_buffer import EMPTY_FP32, FlatBuffer
from ampkit.precision.weight_state import ExactState, fp32_grads, grads_of, per_element

#: The optimizers bf16-true steps with its own fused kernel (these classes exactly: a subclass may differ).
FUSED = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)
_ADAM_KEYS, _SGD_KEYS = ("exp_avg", "exp_avg_sq"), ("momentum_buffer",)


def fusable(optimizer: torch.optim.Optimizer) -> str | None:
    """ "adam" or "sgd" where bf16-true's fused kernel does exactly this optimizer's update; else None."""
    if type(optimizer) not in FUSED:
        return None
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("differentiable") or callable(group.get("lr")):
            return None
    return "sgd" if type(optimizer) is torch.optim.SGD else "adam"


class CompensatedWeights(ExactState):
    """bf16 weights updated in fp32 with a bf16 Kahan buffer (the `bf16-true` preset).

    Between steps: the bf16 weight, its bf16 compensation and, for the fused optimizers, their per-element
    state in bf16 (AdamW: 8 bytes per parameter). A step adds the bf16 gradients (a flat copy, freed after
    the step), or with clipping the fp32 ones `grads_in` made (4 bytes per parameter during the step).
    """

    kind = "compensated"
    reads_own_grads = True  # the fused kernel reads the bf16 gradients (fp32 ones only where clipping made them)
    stand_ins_hold_values = False  # the stand-ins are empty between steps: the value is weight + compensation

    def __init__(
        self,
        pairs: list[tuple[nn.Parameter, nn.Parameter]],
        optimizer: torch.optim.Optimizer,
        free_step_buffers: bool = True,
    ) -> None:
        self.pairs, self.optimizer = (
            pairs,
            optimizer,
        )  # (model parameter in bf16, its fp32 stand-in: empty between steps)
        self._params = [p for p, _ in pairs]
        self._shadows = [s for _, s in pairs]
        where = {id(s): i for i, s in enumerate(self._shadows)}
        self._order = [where[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in where]
        self._order += [i for i in range(len(pairs)) if i not in set(self._order)]
        self._group = {
            where[id(p)]: n for n, g in enumerate(optimizer.param_groups) for p in g["params"] if id(p) in where
        }
        self._position = {i: n for n, i in enumerate(self._order)}
        like = [self._params[i] for i in self._order]
        low = like[0].dtype if like else torch.bfloat16
        self._low = low
        data = self._flat(low)
        self._comp = self._flat(low)
        with torch.no_grad():
            for i, (param, initial) in enumerate(pairs):
                param.data = data.by_index[i].copy_(param)  # the weights end to end: one range per group
                torch.sub(initial, param, out=self._comp.by_index[i])  # in fp32 (type promotion), stored in bf16
        self._data = data
        self.compensation = [self._comp.by_index[i] for i in range(len(pairs))]  # what rounding each weight lost
        self._grad = self._flat(torch.float32, releasable=free_step_buffers, allocate=False)  # fp32, when clipping
        self._low_grad = self._flat(low, releasable=free_step_buffers, allocate=False)  # the bf16 gradients, flat
        self._state: dict[str, FlatBuffer] = {}  # the fused optimizers' per-element state in bf16, by key
        self._kernel = fusable(optimizer)
        self._steps: dict[int, float] = {}  # Adam's step counter per weight, kept on the host beside the state's
        self._grads_in = False
        self._pointed = list(self._shadows)  # stand-ins pointed at fp32 tensors since the last release()
        self._seen = (optimizer.state, len(optimizer.state))
        self.release()

    def _flat(self, dtype: torch.dtype, releasable: bool = False, allocate: bool = True) -> FlatBuffer:
        return FlatBuffer([self._params[i] for i in self._order], dtype, releasable, self._order, allocate)

    @property
    def optimizer_params(self) -> Iterator[nn.Parameter]:
        return iter(self._shadows)

    def grads_in(self) -> list[torch.Tensor]:
        """Give the stand-ins fp32 gradients (for clipping); the step then uses them. Return them."""
        order = [self._params[i] for i in self._order]
        kept, views = fp32_grads(order, self._grad)
        for n, view in zip(kept, views):
            shadow = self._shadows[self._order[n]]
            shadow.data = shadow.grad = view  # the stand-in carries only its gradient
            self._pointed.append(shadow)
        self._grads_in = True
        return views

    def step(self, step_fn: Callable[[], Any]) -> Any:
        """Update every weight that has a gradient: one fused kernel per range, or the user's step on stand-ins."""
        kept = [i for i in self._order if self._params[i].grad is not None]
        state = self.optimizer.state
        if self._seen[0] is not state or self._seen[1] != len(state):
            self.state_loaded()  # loaded, replaced or cleared outside ampkit (the wrapped optimizer's load_state_dict)
        try:
            if not kept:
                return step_fn()
            with torch.no_grad():
                if self._kernel is None:
                    return self._whole(kept, step_fn)
                result = self._hooks_only(step_fn)
                self._fused(kept)
                return result
        finally:
            self.release()
            self._seen = (state, len(state))

    # --- the fused update ---------------------------------------------------------------------------
    def _hooks_only(self, step_fn: Callable[[], Any]) -> Any:
        """The user's `optimizer.step()` over no parameters: its hooks run and a scheduler sees the step, as
        with any optimizer; the update itself is the fused kernel's."""
        groups = self.optimizer.param_groups
        originals = [g["params"] for g in groups]
        try:
            for g in groups:
                g["params"] = []
            return step_fn()
        finally:
            for g, params in zip(groups, originals):
                g["params"] = params

    def _fused(self, kept: list[int]) -> None:
        grads = self._grad if self._grads_in else self._low_grad
        if not self._grads_in:
            grads.alloc()
            torch._foreach_copy_([grads.by_index[i] for i in kept], grads_of(self._params, kept))
        keys = _ADAM_KEYS if self._kernel == "adam" else _SGD_KEYS
        entries = [self._entry(i, keys) for i in kept]
        if self._kernel == "adam":
            marks = [self._steps.get(i, 0.0) for i in kept]  # the counters as the host knows them: nothing is read
            torch._foreach_add_([e["step"] for e in entries], 1.0)
            self._steps.update((i, mark + 1) for i, mark in zip(kept, marks))
        else:
            marks = [e.get("momentum_buffer") is None for e in entries]
        for first, last, mark in self._ranges(kept, marks):
            group = self.optimizer.param_groups[self._group[first]]
            start = self._data.offsets[first]
            stop = self._data.offsets[last] + self._params[last].numel()
            views = [b.buffer[start:stop] for b in (self._data, self._comp, grads)]
            if self._kernel == "adam":
                decoupled = group.get("decoupled_weight_decay", type(self.optimizer) is torch.optim.AdamW)
                states = [self._state[k].buffer[start:stop] for k in keys]
                kahan.run("adam", *views, *states, *kahan.adam_args(group, mark + 1, bool(decoupled)))
            else:
                kahan.run(
                    "sgd", *views, self._state["momentum_buffer"].buffer[start:stop], *kahan.sgd_args(group, mark)
                )
        if self._kernel == "sgd":
            for i, entry in zip(kept, entries):
                if self.optimizer.param_groups[self._group[i]]["momentum"] != 0:
                    entry["momentum_buffer"] = self._state["momentum_buffer"].by_index[i]

    def _entry(self, i: int, keys: tuple[str, ...]) -> dict[str, Any]:
        """Weight i's optimizer state in torch's own format (its per-element tensors views of the bf16 stores)."""
        entry = self.optimizer.state[self._shadows[i]]
        if not entry:
            for key in keys:
                if key not in self._state:
                    self._state[key] = self._flat(self._low)
                    self._state[key].buffer.zero_()
            if self._kernel == "adam":  # (torch's SGD makes each momentum buffer from the first gradient)
                entry.update(
                    {
                        "step": torch.tensor(0.0, dtype=torch.float32),
                        **{k: self._state[k].by_index[i].zero_() for k in keys},
                    }
                )
        return entry

    def _ranges(self, kept: list[int], marks: list[Any]) -> Iterator[tuple[int, int, Any]]:
        """(first, last, mark): runs of weights lying end to end, of one group, with the same step counter."""
        runs: list[list[Any]] = []
        for i, mark in zip(kept, marks):
            last = runs[-1] if runs else None
            if (
                last
                and self._position[i] == self._position[last[1]] + 1
                and self._group[i] == self._group[last[1]]
                and mark == last[2]
            ):
                last[1] = i
            else:
                runs.append([i, i, mark])
        return iter([tuple(r) for r in runs])

    # --- any other optimizer ------------------------------------------------------------------------
    def _whole(self, kept: list[int], step_fn: Callable[[], Any]) -> Any:
        """The user's own step on fp32 stand-ins (`weight + compensation`) of the weights it updates."""
        low = {} if self._grads_in else dict(zip(kept, grads_of(self._params, kept)))
        for i in kept:
            shadow = self._shadows[i]
            grad = shadow.grad if self._grads_in else low[i].float()
            shadow.data = self._params[i].float().add_(self.compensation[i])
            shadow.grad = grad
            self._pointed.append(shadow)
        result = step_fn()
        for i in kept:
            work = self._shadows[i].data
            self._params[i].copy_(work)
            self.compensation[i].copy_(work.sub_(self._params[i]))
        return result

    def release(self) -> None:
        """Between steps bf16-true holds no fp32 copy of anything (the stand-ins are empty)."""
        for shadow in self._pointed:
            shadow.grad, shadow.data = None, EMPTY_FP32
        self._pointed = []
        self._grads_in = False
        self._grad.free()
        self._low_grad.free()

    def state_loaded(self) -> None:
        """After the optimizer loaded a state_dict (which makes fp32 tensors): the fused optimizers' per-element
        state back into the bf16 stores, their step counters on the CPU (read there without a device sync)."""
        state = self.optimizer.state
        self._steps = {}
        if self._kernel is not None:
            for i in self._order:
                entry = state.get(self._shadows[i]) or {}
                for key, value in entry.items():
                    if key == "step" and isinstance(value, torch.Tensor):
                        entry[key] = value.detach().to("cpu", torch.float32)
                        self._steps[i] = float(entry[key])  # sync: once per load (the counter's host copy)
                    elif isinstance(value, torch.Tensor) and per_element(key, value, self._params[i]):
                        if key not in self._state:
                            self._state[key] = self._flat(self._low)
                            self._state[key].buffer.zero_()
                        with torch.no_grad():
                            entry[key] = self._state[key].by_index[i].copy_(value)
        self._seen = (state, len(state))

    # --- state ----------------------------------------------------------------------------------
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

    def exact_state(self) -> list[torch.Tensor]:
        """The Kahan buffers: with the model's bf16 weights, the whole state (`ExactState`)."""
        return self.compensation
