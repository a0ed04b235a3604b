"""The fp32 truth behind low-precision weights: master copies, or Kahan-compensated bf16 weights.

For the presets that store weights in bf16/fp16, the user's optimizer is pointed at fp32 parameters
that ampkit keeps in step with the model:

* `MasterWeights` (`*-master`, apex O2, in `ampkit.master_weights`): persistent fp32 copies; the
  update lands on them and is copied into the model's low-precision weights.
* `CompensatedWeights` (`bf16-true`): no persistent fp32 copy; the update works chunk by chunk on
  fp32 values made from the bf16 weight plus a bf16 Kahan buffer holding what rounding lost.

Both own their state (`state_dict()`, exact, bit for bit) and say what each weight stands for
(`fp32_values()`), which is how checkpoints convert between presets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ampkit.flat_buffer import EMPTY_FP32, Chunk, ChunkPlan, FlatBuffer
from ampkit.master_weights import MasterWeights
from ampkit.weight_state import ELEMENTWISE, ExactState, ScalarClasses, fp32_grads, per_element


class CompensatedWeights(ExactState):
    """bf16 weights updated in fp32 with a bf16 Kahan buffer (the `bf16-true` preset).

    Between steps: the bf16 weight, its bf16 compensation and the optimizer's per-element state in
    bf16 (AdamW: 8 bytes per parameter). The update runs chunk by chunk in one fixed workspace, so
    no full-size fp32 buffer ever exists: fp32 copies of a chunk's weights (+ compensation),
    gradients and state are made, the user's optimizer steps them (its groups narrowed to the
    chunk's stand-ins; per-step scalars such as Adam's `step` advance once per step), and the
    results are rounded back, the new rounding error kept. Optimizers outside `ELEMENTWISE`, and a
    weight's first step (the optimizer creates its state), step everything in one call and a
    full-size workspace for that step; clipping (`grads_in`) makes full-size fp32 gradients.
    """

    def __init__(self, pairs: list[tuple[nn.Parameter, nn.Parameter]], optimizer: torch.optim.Optimizer,
                 free_step_buffers: bool = True, chunk: int = 1 << 18) -> None:
        self.pairs = pairs  # (model parameter in bf16, fp32 stand-in the optimizer steps; empty between steps)
        self.optimizer = optimizer
        self.chunk = chunk  # elements per chunk of the update
        self._free = free_step_buffers
        self._params = [p for p, _ in pairs]
        self._shadows = [s for _, s in pairs]
        self._comp = FlatBuffer(self._params, self._params[0].dtype if pairs else torch.bfloat16, releasable=False)
        self.compensation = self._comp.views  # what rounding each weight lost, in its own dtype
        with torch.no_grad():
            for (param, initial), comp in zip(pairs, self.compensation):
                torch.sub(initial, param, out=comp)  # in fp32 (type promotion), no full-size temporaries
        self._grad = FlatBuffer(self._params, torch.float32, self._free, allocate=False)  # fp32 gradients, only when clipping
        self._grads_in = False
        self._stepped = [False] * len(pairs)  # stepped once: the optimizer's state exists (chunking needs it)
        self._state: dict[str, FlatBuffer] = {}  # per-element optimizer state in bf16, by key (indexed by weight)
        self._state_count = -1  # len(optimizer.state) when the state buffers were last built
        self._classes = ScalarClasses(len(pairs))  # weights with equal step counters etc.: stepped as one flat tensor
        self._seen = (optimizer.state, len(optimizer.state))  # the optimizer's state as ampkit's last step left it
        self._plan: ChunkPlan | None = None
        self._pointed = list(self._shadows)  # stand-ins pointed at fp32 tensors since the last release()
        self.release()

    @property
    def optimizer_params(self) -> Iterator[nn.Parameter]:
        return iter(self._shadows)

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the fp32/bf16 workspace the chunked update keeps between steps (fixed: a few MB)."""
        return self._plan.nbytes if self._plan is not None and self._plan.split else 0

    def grads_in(self) -> list[torch.Tensor]:
        """Give the stand-ins fp32 gradients (for clipping); the step then uses them. Return them."""
        kept, views = fp32_grads(self._params, self._grad)
        for i, view in zip(kept, views):
            self._shadows[i].data = self._shadows[i].grad = view  # the stand-in carries only its gradient
            self._pointed.append(self._shadows[i])
        self._grads_in = True
        return views

    def step(self, step_fn: Callable[[], Any]) -> Any:
        """Run the user's optimizer step over every weight with a gradient, chunk by chunk."""
        kept = [i for i, p in enumerate(self._params) if p.grad is not None]
        if not kept:
            return step_fn()
        if self._seen[0] is not self.optimizer.state or self._seen[1] != len(self.optimizer.state):
            self.state_loaded()  # loaded, replaced or cleared outside ampkit (the wrapped optimizer's load_state_dict)
        # A weight's first step goes in whole tensors: the optimizer creates its state in their shapes.
        single = type(self.optimizer) not in ELEMENTWISE
        split = not single and all(self._stepped[i] for i in kept)
        capacity = sum(self._comp.sizes[i] for i in kept) if single else self.chunk
        classes = self._classes.advance(kept, self._stepped)
        key = (kept, split, capacity, self._classes.version)
        if self._plan is None or self._plan_key != key or self._plan.entries is not self.optimizer.state:
            self._plan_key = key
            self._plan = ChunkPlan(self._params, self._shadows, self.optimizer.param_groups, kept, capacity, split,
                                   self._comp, self._state, self.optimizer.state, classes if split else None)
        plan, state = self._plan, self.optimizer.state
        scalars = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state[self._shadows[i]].items()
                       if not per_element(k, v, self._params[i])} for i in ([] if plan.flat else plan.cut)}
        load, store = (self._load_flat, self._store_flat) if plan.flat else (self._load, self._store)
        try:
            with torch.no_grad():
                result = plan.run(step_fn, lambda chunk: load(chunk, plan, scalars), lambda chunk: store(chunk, plan))
                if plan.flat:
                    plan.write_scalars()
        finally:
            self.release()
        for i in kept:
            self._stepped[i] = True
        if not plan.split and (self._free or type(self.optimizer) in ELEMENTWISE):
            self._plan = None  # its workspace may be as large as a tensor, or all of them
        if len(state) != self._state_count:
            self._build_state()  # the optimizer created state (its first step, or a new parameter's)
        self._seen = (state, len(state))
        return result

    def _load(self, chunk: Chunk, plan: ChunkPlan, scalars: dict[int, dict[str, Any]]) -> None:
        """fp32 working copies of the chunk's weights (+ compensation), gradients and state; point the stand-ins at them."""
        state = self.optimizer.state
        for i in chunk.resume:  # a weight stepped in pieces: its step counter etc. advance once
            entry = state[self._shadows[i]]
            entry.update({k: entry[k].copy_(v) if isinstance(v, torch.Tensor) else v for k, v in scalars[i].items()})
        self._fill(chunk, plan)
        grads = chunk.grad
        if self._grads_in:
            grads = [self._grad.views[i] if whole else self._grad.buffer[self._comp.offsets[i] + s:self._comp.offsets[i] + e]
                     for (i, s, e), whole in zip(chunk.pieces, chunk.whole)]
        for shadow, data, grad in zip(chunk.shadows, chunk.work, grads):
            shadow.data, shadow.grad = data, grad
        self._pointed += chunk.shadows
        for entry, key, view, _ in chunk.swaps:
            entry[key] = view

    def _fill(self, chunk: Chunk, plan: ChunkPlan) -> None:
        """The chunk's weights (+ compensation), gradients (unless clipped ones are in use) and state, in fp32."""
        torch._foreach_copy_(chunk.work, chunk.targets)
        for work, _, comp in chunk.comp_runs:
            work.add_(comp)
        if not self._grads_in:
            torch._foreach_copy_(chunk.grad, [p.grad if whole else p.grad.reshape(-1)[s:e]
                                              for p, (_, s, e), whole in zip(chunk.owners, chunk.pieces, chunk.whole)])
        for work, store in chunk.state_runs:
            work.copy_(store)

    def _load_flat(self, chunk: Chunk, plan: ChunkPlan, _: Any) -> None:
        """`_load` for a flat plan: the chunk's runs, their per-step scalars as the step found them."""
        self._fill(chunk, plan)
        if self._grads_in:  # the clipped fp32 gradients lie in the compensation's layout
            for at, flat, n in chunk.spans:
                plan.grad[at:at + n].copy_(self._grad.buffer[flat:flat + n])
        plan.enter(chunk)

    def _store_flat(self, chunk: Chunk, plan: ChunkPlan) -> None:
        plan.leave(chunk)
        self._round(chunk)

    def _round(self, chunk: Chunk) -> None:
        """The state into bf16; the weights rounded into bf16 (one flat rounding into the gradients' area, free
        now) and what rounding lost kept (computed in fp32, stored in bf16)."""
        for work, store in chunk.state_runs:
            store.copy_(work)
        for work, rounded, _ in chunk.comp_runs:
            rounded.copy_(work)
        torch._foreach_copy_(chunk.targets, chunk.low)
        for work, rounded, comp in chunk.comp_runs:
            comp.copy_(work.sub_(rounded))

    def _store(self, chunk: Chunk, plan: ChunkPlan) -> None:
        """Round the chunk's updated weights into bf16, keep the rounding error, store the state in bf16."""
        for entry, key, view, rest in chunk.swaps:
            if entry[key] is not view:  # the optimizer replaced the tensor, not updated it
                view.copy_(entry[key])
            entry[key] = rest
        self._round(chunk)
        if not plan.split:  # state the optimizer just created: into bf16 now, not after the last chunk
            for i, _, _ in chunk.pieces:
                entry = self.optimizer.state[self._shadows[i]]
                for key, value in entry.items():
                    if per_element(key, value, self._params[i]) and value.dtype != self._comp.buffer.dtype:
                        if key not in self._state:
                            self._state[key] = FlatBuffer([self._params[j] for j in plan.kept], self._comp.buffer.dtype,
                                                          releasable=False, indices=plan.kept)
                        at_rest = self._state[key].by_index.get(i)
                        if at_rest is not None:
                            entry[key] = at_rest.copy_(value)

    def release(self) -> None:
        """Between steps bf16-true holds no fp32 copy of anything (the stand-ins are empty)."""
        for shadow in self._pointed:
            shadow.grad, shadow.data = None, EMPTY_FP32
        self._pointed = []
        if self._grads_in:
            self._grads_in = False
            self._grad.free()

    def state_loaded(self) -> None:
        """Store per-element optimizer state in bf16 (after loading a state_dict, which casts it to fp32)."""
        self._state_count, state = -1, self.optimizer.state
        self._stepped = self._classes.reset(state, self._shadows, self._params, type(self.optimizer) in ELEMENTWISE)
        self._build_state()
        self._seen = (state, len(state))

    def _build_state(self) -> None:
        """(Re)build the bf16 stores of the optimizer's per-element state from its current tensors."""
        state = self.optimizer.state
        low = self._params[0].dtype if self._params else torch.bfloat16
        holders: dict[str, list[int]] = {}  # state key -> indices of the parameters that have it
        for i, (shadow, param) in enumerate(zip(self._shadows, self._params)):
            for key, value in state.get(shadow, {}).items():
                if per_element(key, value, param):
                    holders.setdefault(key, []).append(i)
        kept, self._state = self._state, {}
        for key, indices in holders.items():
            store = kept.get(key)
            if store is not None and store.indices == indices and all(state[self._shadows[i]][key] is v for i, v in zip(indices, store.views)):
                self._state[key] = store  # already there (state moved into bf16 chunk by chunk)
                continue
            buffers = FlatBuffer([self._params[i] for i in indices], low, releasable=False, indices=indices)
            with torch.no_grad():
                torch._foreach_copy_(buffers.views, [state[self._shadows[i]][key] for i in indices])
            for i, view in zip(indices, buffers.views):
                state[self._shadows[i]][key] = view
            self._state[key] = buffers
        self._state_count = len(state)
        self._plan = None

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

    def exact_state(self) -> list[torch.Tensor]:
        """The Kahan buffers: with the model's bf16 weights, the whole state (`ExactState`)."""
        return self.compensation


#: What the prepared optimizer keeps for a low-precision-weight preset.
LowPrecisionWeights = MasterWeights | CompensatedWeights
