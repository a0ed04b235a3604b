"""`MasterWeights`: persistent fp32 master copies behind low-precision weights (the `*-master` presets;
see `ampkit.lowp_weights`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ampkit.flat_buffer import Chunk, ChunkPlan, FlatBuffer, Homes
from ampkit.weight_state import ELEMENTWISE, ExactState, ScalarClasses, fp32_grads, per_element


class MasterWeights(ExactState):
    """Persistent fp32 master copies of low-precision parameters (the `*-master` presets).

    Without loss scaling or clipping (`step`), the masters' fp32 gradients are made chunk by chunk
    (`chunk` elements: in the last-level cache) in a fixed workspace, each chunk stepped as it is made
    (a tensor cut in pieces is stepped as views of its master and state, its per-step scalars advanced
    once). Otherwise (`grads_in`) they live in one flat buffer. The masters lie end to end in one buffer,
    and so does the optimizer's per-element state once it exists: a steady-state chunked step hands the
    optimizer flat views of them (`ChunkPlan`'s runs, of at most `run` elements: in cache), not one per weight.
    """

    def __init__(self, pairs: list[tuple[nn.Parameter, nn.Parameter]], optimizer: torch.optim.Optimizer,
                 free_step_buffers: bool = True, chunk: int = 1 << 20, run: int = 1 << 17) -> None:
        self.pairs = pairs  # (model parameter in bf16/fp16, its fp32 master)
        self.optimizer, self.chunk, self.run = optimizer, chunk, run
        self._plan: ChunkPlan | None = None
        self._stepped = [False] * len(pairs)  # stepped once: the optimizer's state exists (pieces need it)
        self._params = [p for p, _ in pairs]
        self._masters = [m for _, m in pairs]
        self._grad = FlatBuffer(self._masters, torch.float32, free_step_buffers, allocate=False)  # for clipping
        self._data = FlatBuffer(self._masters, torch.float32, releasable=False)  # the masters, end to end
        with torch.no_grad():
            for master, view in zip(self._masters, self._data.views):
                master.data = view.copy_(master)
        self._homes: Homes = {"data": {i: (self._data.buffer, at, v) for (i, at), v in zip(self._data.offsets.items(), self._data.views)}}
        self._classes = ScalarClasses(len(pairs))  # weights with equal step counters etc.
        self._outs: dict[Chunk, list[torch.Tensor]] = {}  # per chunk of a flat plan: its masters' pieces
        self._rest, self._written = ([], []), False  # (params, masters) a flat plan leaves out; it rounded the rest
        self._seen = (optimizer.state, len(optimizer.state))  # the optimizer's state as ampkit's last step left it

    @property
    def optimizer_params(self) -> Iterator[nn.Parameter]:
        return iter(self._masters)

    def grads_in(self) -> list[torch.Tensor]:
        """Give each master the fp32 copy of its model parameter's gradient; return those grads."""
        kept, views = fp32_grads(self._params, self._grad)
        for i, view in zip(kept, views):
            self._masters[i].grad = view
        return views

    def step(self, step_fn: Callable[[], Any]) -> Any:
        """Run the user's optimizer step, the masters' fp32 gradients made one chunk at a time."""
        kept = [i for i, p in enumerate(self._params) if p.grad is not None]
        if not kept or type(self.optimizer) not in ELEMENTWISE:
            self.grads_in()
            return step_fn()
        state = self.optimizer.state
        if self._seen[0] is not state or self._seen[1] != len(state):  # loaded, replaced or cleared outside ampkit
            self.state_loaded()
        split = all(self._stepped[i] for i in kept)  # first steps: whole tensors
        fresh = not any(self._stepped[i] for i in kept)  # the optimizer makes every kept weight's state now
        classes = self._classes.advance(kept, self._stepped)
        key = (kept, split, self.chunk, self.run, self._classes.version)
        if self._plan is None or self._plan_key != key:
            self._plan_key = key
            self._find_homes(kept)
            self._plan = ChunkPlan(self._params, self._masters, self.optimizer.param_groups, kept, self.chunk, split,
                                   entries=state, classes=classes if split or fresh else None, inplace=self._homes, run_cap=self.run)
            buffer, offsets, inside = self._data.buffer, self._data.offsets, set(kept)
            self._outs = {chunk: [buffer[offsets[i] + s:offsets[i] + e].view(t.shape) for (i, s, e), t in zip(chunk.pieces, chunk.targets)]
                          for chunk in self._plan.chunks}
            self._rest = ([p for i, p in enumerate(self._params) if i not in inside], [m for i, m in enumerate(self._masters) if i not in inside])
        plan = self._plan
        if plan.flat:
            try:
                with torch.no_grad():
                    result = plan.run(step_fn, self._load_flat, self._store_flat)
                    plan.write_scalars()
                self._written = True
                return result
            finally:
                for i in kept:
                    self._stepped[i] = True
                self._seen = (state, len(state))
        full = {i: (self._masters[i].data, dict(state[self._masters[i]])) for i in plan.cut}
        scalars = {i: {k: v.clone() for k, v in entries.items() if isinstance(v, torch.Tensor) and not per_element(k, v, data)}
                   for i, (data, entries) in full.items()}
        try:
            with torch.no_grad():
                return plan.run(step_fn, lambda chunk: self._load(chunk, full, scalars), lambda chunk: self._store(chunk, full))
        finally:
            for i, (data, entries) in full.items():  # the weights stepped in pieces get their whole tensors back
                self._masters[i].grad, self._masters[i].data = None, data
                state[self._masters[i]].update({k: v for k, v in entries.items() if per_element(k, v, data)})
            for i in kept:
                self._stepped[i] = True
            self._seen = (state, len(state))

    def stepped_directly(self) -> None:
        """The optimizer stepped the masters itself (clipped or loss-scaled gradients): note which weights."""
        state = self.optimizer.state
        self._classes.advance([i for i, m in enumerate(self._masters) if m.grad is not None], self._stepped)
        self._stepped, self._seen = [bool(state.get(m)) for m in self._masters], (state, len(state))

    def state_loaded(self) -> None:
        """After the optimizer loaded a state_dict: which weights have state, with which step counters; the
        per-element state moved into one flat buffer per key (one key at a time), so that steps stay flat."""
        state = self.optimizer.state
        self._stepped = self._classes.reset(state, self._masters, self._masters, type(self.optimizer) in ELEMENTWISE)
        self._plan, self._seen = None, (state, len(state))
        holders: dict[str, list[int]] = {}
        for i, master in enumerate(self._masters):
            for key, value in state.get(master, {}).items():
                if per_element(key, value, master):
                    holders.setdefault(key, []).append(i)
        self._homes = {"data": self._homes["data"]}
        with torch.no_grad():
            for key, indices in holders.items():
                store = FlatBuffer([self._masters[i] for i in indices], torch.float32, releasable=False, indices=indices)
                for i, view in zip(indices, store.views):
                    state[self._masters[i]][key] = view.copy_(state[self._masters[i]][key])
                self._homes[key] = {i: (store.buffer, store.offsets[i], view) for i, view in zip(indices, store.views)}

    def _find_homes(self, kept: list[int]) -> None:
        """Where the kept weights' per-element state lives (state the optimizer made per weight: its own tensor)."""
        state = self.optimizer.state
        for i in kept:
            for key, value in state.get(self._masters[i], {}).items():
                home = self._homes.get(key, {}).get(i)
                if per_element(key, value, self._masters[i]) and value.is_contiguous() and (home is None or home[2] is not value):
                    self._homes.setdefault(key, {})[i] = (value.view(-1), 0, value)

    def _load_flat(self, chunk: Chunk) -> None:
        self._load_grads(chunk)
        self._plan.enter(chunk)

    def _store_flat(self, chunk: Chunk) -> None:
        state = self.optimizer.state
        self._plan.leave(chunk)
        # the chunk's masters into the model's weights while they are in cache (weights_out skips them)
        torch._foreach_copy_(chunk.targets, self._outs[chunk])
        for run in chunk.flat:
            entry = run.entry
            if not run.views:  # the optimizer made this run's state: each weight's is a view of it
                for i, at, n in run.pieces:
                    master, own = self._masters[i], state[self._masters[i]]
                    for key, value in entry.items():
                        if per_element(key, value, run.param):
                            own[key] = value[at:at + n].view(master.shape)
                            self._homes.setdefault(key, {})[i] = (value, at, own[key])
                        else:
                            own[key] = value.clone() if isinstance(value, torch.Tensor) else value
                run.entry = {}

    def _load_grads(self, chunk: Chunk) -> None:
        torch._foreach_copy_(chunk.grad, [p.grad if whole else p.grad.reshape(-1)[s:e]
                                          for p, (_, s, e), whole in zip(chunk.owners, chunk.pieces, chunk.whole)])

    def _load(self, chunk: Chunk, full: dict[int, Any], scalars: dict[int, dict[str, torch.Tensor]]) -> None:
        self._load_grads(chunk)
        for master, (i, s, e), whole, grad in zip(chunk.shadows, chunk.pieces, chunk.whole, chunk.grad):
            if not whole:  # a piece: the master and its per-element state are views of the whole tensors
                data, entries = full[i]
                master.grad, master.data = None, data.view(-1)[s:e]
                entry = self.optimizer.state[master]
                entry.update({k: v.view(-1)[s:e] for k, v in entries.items() if per_element(k, v, data)})
                for key, value in scalars[i].items() if s > 0 else ():  # step counters etc. advance once per step
                    entry[key].copy_(value)
            master.grad = grad

    def _store(self, chunk: Chunk, full: dict[int, Any]) -> None:
        for (i, s, e), whole in zip(chunk.pieces, chunk.whole):
            if not whole:
                entry, (data, entries) = self.optimizer.state[self._masters[i]], full[i]
                for key, value in entries.items():
                    if per_element(key, value, data) and entry[key].data_ptr() != value.view(-1)[s:e].data_ptr():
                        value.view(-1)[s:e].copy_(entry[key])  # the optimizer replaced the tensor, not updated it

    def weights_out(self) -> None:
        """Round the (possibly updated) masters into the model's parameters (those a flat step has not)."""
        params, masters = self._rest if self._written else (self._params, self._masters)
        self._written = False
        if params:
            with torch.no_grad():
                torch._foreach_copy_(params, masters)

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

    def exact_state(self) -> list[torch.Tensor]:
        """The fp32 masters: with the model's weights, the whole state (`ExactState`)."""
        return self._masters
