"""One contiguous buffer with a view per tensor: ampkit's per-step fp32 buffers for low-precision weights."""

from __future__ import annotations

import sys
from collections.abc import Callable
from itertools import accumulate
from typing import Any

import torch
from torch import nn


class FlatBuffer:
    """One contiguous buffer and, for each tensor in `like`, a view of it with that tensor's shape.

    ampkit's per-step fp32 buffers (gradients for masters, working weights and optimizer state for
    `bf16-true`) are flat so that filling, rounding and compensating them is one kernel, not one
    per parameter. A `releasable` buffer's memory is released by `free()` between steps and taken
    back by `alloc()`, the views kept (making views costs microseconds per tensor, every step).
    Releasing memory under a tensor someone still holds would leave it reading freed memory, so
    `free()` first checks that nothing outside holds the buffer (a gradient kept for logging, a
    view of it): if something does, the buffer is left to its holder and the next step makes a new one.
    """

    def __init__(self, like: list[torch.Tensor], dtype: torch.dtype, releasable: bool = True,
                 indices: list[int] | None = None, allocate: bool = True) -> None:
        self.device, self.dtype = like[0].device if like else torch.device("cpu"), dtype
        self.shapes = [t.shape for t in like]
        self.sizes = [t.numel() for t in like]
        self.indices = list(range(len(like))) if indices is None else indices  # what each tensor is called
        self.offsets = dict(zip(self.indices, accumulate([0] + self.sizes[:-1])))  # index -> start in the buffer
        self.releasable = releasable  # False: kept between steps (see Accelerator(free_step_buffers=))
        self.buffer: torch.Tensor = EMPTY_FP32
        self.views: list[torch.Tensor] = []
        self._nbytes, self._holders = 0, (0, 0)  # (storage users, Python references per view) when only ampkit holds it
        if allocate:  # else at the first alloc()
            self.alloc()

    def alloc(self) -> None:
        if not self.views:
            self.buffer = torch.empty(sum(self.sizes), dtype=self.dtype, device=self.device)
            self.views = [v.view(shape) for v, shape in zip(self.buffer.split(self.sizes), self.shapes)]
            self.by_index = dict(zip(self.indices, self.views))
            self._nbytes = self.buffer.untyped_storage().nbytes()
            self._holders = self._count_holders()
        elif self.buffer.untyped_storage().nbytes() != self._nbytes:
            self.buffer.untyped_storage().resize_(self._nbytes)

    def free(self) -> None:
        if not self.releasable or not self.views or not self.buffer.untyped_storage().nbytes():
            return
        if _storage_users is None or self._count_holders() != self._holders:
            self.buffer, self.views = EMPTY_FP32, []  # held outside (or cannot tell): theirs now
        else:
            self.buffer.untyped_storage().resize_(0)

    def _count_holders(self) -> tuple[int, int]:
        if _storage_users is None:
            return (0, 0)
        storage = _storage_users(self.buffer.untyped_storage()._cdata)  # a new view of it adds one
        refs = max((sys.getrefcount(v) for v in self.views), default=0)  # holding one of ours adds one
        return storage, refs


#: Users of a storage (torch-internal; without it `FlatBuffer` makes a new buffer every step, which is safe).
_storage_users = getattr(torch._C, "_storage_Use_Count", None)


EMPTY_FP32 = torch.empty(0, dtype=torch.float32)


def cut_chunks(sizes: list[int], kept: list[int], splittable: list[bool], capacity: int,
               align: int = 64) -> list[list[tuple[int, int, int]]]:
    """Cut the kept tensors, in order, into chunks of at most `capacity` elements.

    A chunk is a list of pieces `(tensor index, start, stop)` over the tensor's flattened elements.
    A splittable tensor that does not fit in what is left of a chunk is cut at a multiple of `align`
    elements from its start (so each piece's vectorised loops cover the same elements as the whole
    tensor's); any other tensor starts a new chunk (a chunk holding only it may exceed `capacity`).
    """
    chunks: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    room = capacity
    for i in kept:
        start, size = 0, sizes[i]
        while start < size:
            take = size - start
            if take > room:
                take = room // align * align if splittable[i] else 0
                if take == 0 and not current:  # alone in a chunk and still too big
                    take = (capacity // align * align or size - start) if splittable[i] else size - start
            if take == 0:
                chunks.append(current)
                current, room = [], capacity
                continue
            current.append((i, start, start + take))
            start += take
            room -= take
            if room == 0:
                chunks.append(current)
                current, room = [], capacity
    if current:
        chunks.append(current)
    return chunks


def runs(pieces: list[tuple[int, int, int]], offsets: dict[int, int]) -> list[tuple[int, int, int]]:
    """Merge consecutive pieces that lie end to end in a flat buffer (`offsets`: each tensor's start there,
    missing for tensors that buffer lacks) into `(position in the chunk, position in the buffer, length)`."""
    merged: list[list[int]] = []
    at = 0
    for i, start, stop in pieces:
        if i in offsets:
            flat = offsets[i] + start
            if merged and merged[-1][0] + merged[-1][2] == at and merged[-1][1] + merged[-1][2] == flat:
                merged[-1][2] += stop - start
            else:
                merged.append([at, flat, stop - start])
        at += stop - start
    return [(a, b, n) for a, b, n in merged]


class Chunk:
    """One chunk: its pieces of tensors, and the views of the plan's workspace that hold them."""

    def __init__(self, plan: ChunkPlan, pieces: list[tuple[int, int, int]], last: bool) -> None:
        self.pieces = pieces
        params = plan.params
        self.whole = [s == 0 and e == params[i].numel() for i, s, e in pieces]
        self.owners = [params[i] for i, _, _ in pieces]
        self.shadows = [plan.shadows[i] for i, _, _ in pieces]
        # the tensors' pieces (a whole tensor is itself; a piece of one is a view of its storage)
        self.targets = [params[i] if whole else params[i].detach().view(-1)[s:e] for (i, s, e), whole in zip(pieces, self.whole)]
        shapes = [params[i].shape if whole else (e - s,) for (i, s, e), whole in zip(pieces, self.whole)]
        self.work = _views(plan.work, pieces, shapes)
        self.grad = _views(plan.grad, pieces, shapes)
        # Views of the runs of pieces lying end to end in `low` (workspace, `low`'s dtype in the gradients' area, `low`)
        # and in each state store (workspace, store); each piece in `low`'s dtype in the gradients' area.
        scratch = plan.grad.view(plan.low.dtype)
        self.spans = runs(pieces, plan.offsets)
        self.comp_runs = [(plan.work[at:at + n], scratch[at:at + n], plan.low[flat:flat + n]) for at, flat, n in self.spans]
        self.state_runs = [(plan.state[key][at:at + n], store.buffer[flat:flat + n])
                           for key, store in plan.stores.items() for at, flat, n in runs(pieces, store.offsets)]
        self.low = _views(scratch, pieces, shapes) if plan.offsets else []
        # (the optimizer's state entry, key, workspace view, the store's view at rest)
        self.swaps = [(plan.entries[plan.shadows[i]], key, view, store.by_index[i]) for key, store in plan.stores.items()
                      for (i, _, _), view in zip(pieces, _views(plan.state[key], pieces, shapes)) if i in store.by_index]
        self.resume = [i for i, s, _ in pieces if s > 0]  # tensors whose earlier pieces came in earlier chunks
        mine = {id(plan.shadows[i]) for i, _, _ in pieces}
        shadows = {id(s) for s in plan.shadows}
        self.flat = _flat_runs(plan, pieces) if plan.flat else []
        self.groups = [[p for p in g["params"] if id(p) in mine or (last and id(p) not in shadows)] for g in plan.groups]
        if self.flat:  # the runs, and (in the last chunk) the parameters without stand-ins
            self.groups = [[run.param for run in self.flat if run.group == n] + [p for p in ps if id(p) not in shadows]
                           for n, ps in enumerate(self.groups)]


#: Where each tensor's elements live, per buffer name ("data", or a state key): index -> (1-D tensor, offset, the
#: tensor's own view). Tensors lying end to end in one 1-D tensor can be stepped as one flat view of it.
Homes = dict[str, dict[int, tuple[torch.Tensor, int, torch.Tensor]]]


class FlatRun:
    """Consecutive pieces of a chunk, of one parameter group, whose tensors have the same per-element state
    keys and per-step scalars: stepped as one flat stand-in. `param`, its gradient and its per-element state
    (`views`) are views of the workspace, or where the plan steps in place (`inplace`), of those buffers;
    `entry` is its optimizer state; its tensors are `first..last` in the plan's `kept` order (where
    `ChunkPlan.scalars` holds their per-step scalars); `pieces`: (tensor index, start in the run, length)."""

    def __init__(self, plan: ChunkPlan, sign: tuple[Any, ...], at: int, n: int, first: int, last: int,
                 starts: dict[str, tuple[torch.Tensor, int]], pieces: list[tuple[int, int, int]]) -> None:
        self.group, self.first, self.last, self.pieces = sign[0], first, last, pieces
        homes = starts or dict.fromkeys(("data", *plan.state), None)
        spans = {k: (plan.work if k == "data" else plan.state[k], at) if v is None else v for k, v in homes.items()}
        base, start = spans["data"]
        self.param = nn.Parameter(base[start:start + n])  # a view: stepped in place
        self.param.grad = plan.grad[at:at + n]
        self.views = {key: spans[key][0][spans[key][1]:spans[key][1] + n] for key in sign[1]}
        self.entry: dict[str, Any] = dict(self.views)


def _flat_runs(plan: ChunkPlan, pieces: list[tuple[int, int, int]]) -> list[FlatRun]:
    found: list[list[Any]] = []  # [signature, workspace start, length, first, last, start in each home, pieces]
    at, cap = 0, max(64, plan.run_cap // 64 * 64) if plan.split and plan.run_cap else 1 << 62
    for i, first, stop in pieces:
        sign, pos = plan.signatures[i], plan.positions[i]
        for s in range(first, stop, cap):  # runs of at most `cap` elements, cut at multiples of 64 from a piece's start
            e = min(s + cap, stop)
            starts = {k: (h[i][0], h[i][1] + s) for k, h in plan.inplace.items() if i in h}
            last = found[-1] if found else None
            if last and last[0] == sign and last[2] + e - s <= cap and all(b is last[5][k][0] and o == last[5][k][1] + last[2] for k, (b, o) in starts.items()):
                last[6].append((i, last[2], e - s))
                last[2], last[4] = last[2] + e - s, pos
            else:
                found.append([sign, at, e - s, pos, pos, starts, [(i, 0, e - s)]])
            at += e - s
    return [FlatRun(plan, *run) for run in found]


class ChunkPlan:
    """Tensors with stand-ins an optimizer steps, cut into chunks (`cut_chunks`, pieces of a tensor
    if `split`), and one workspace for all chunks: per element, fp32 for the tensor, its gradient
    and each state key (or, without `low`, only the gradient). `low`: a flat buffer of all the
    tensors (the compensation); `stores`: per state key, the flat buffer of the tensors that have
    it, in the optimizer's state `entries`. Each chunk narrows the optimizer's parameter `groups` to
    its stand-ins (the last also keeps the others).

    `classes` (every tensor's state exists, its per-step scalars are 0-dim tensors, and tensors of one
    class have equal ones — known on the host, never read from the device): the stand-ins a chunk
    gives the optimizer are `FlatRun`s, a few flat tensors instead of one per tensor. For an optimizer
    whose update is elementwise this is the same arithmetic on every element, bit for bit (tests check
    each class), in a few kernels instead of a few per tensor. Each tensor's per-step scalars become
    0-dim views of one tensor per key (`scalars`, in `kept` order): a run reads them before its step,
    and `write_scalars()` writes its new values into its tensors' after the last chunk. `inplace`: flat
    buffers the runs step in place instead of the workspace ("data": the tensors; per state key: its
    store), the workspace holding only gradients (master weights). `run_cap`: the most elements of a run
    in a split plan (0: no limit), so that the optimizer's passes over each run stay in cache."""

    def __init__(self, params: list[torch.Tensor], shadows: list[torch.Tensor], groups: list[dict[str, Any]],
                 kept: list[int], capacity: int, split: bool, low: FlatBuffer | None = None,
                 stores: dict[str, FlatBuffer] | None = None, entries: Any = None, classes: list[Any] | None = None,
                 inplace: Homes | None = None, run_cap: int = 0) -> None:
        self.kept, self.capacity, self.run_cap, self.split, self.stores = kept, capacity, run_cap, split, stores or {}
        self.offsets, self.low = (low.offsets, low.buffer) if low is not None else ({}, EMPTY_FP32)
        self.params, self.shadows, self.groups, self.entries, self.inplace = params, shadows, groups, entries, inplace or {}
        pieces = cut_chunks([p.numel() for p in params], kept, [split and p.is_contiguous() for p in params], capacity)
        size = max(sum(e - s for _, s, e in chunk) for chunk in pieces)
        work = torch.empty((1 if low is None else 2 + len(self.stores)) * size, dtype=torch.float32, device=params[0].device)
        self.work, self.grad = work[:size], work if low is None else work[size:2 * size]
        self.state = {key: work[(2 + k) * size:(3 + k) * size] for k, key in enumerate(self.stores)}
        self.nbytes = work.nbytes
        self.flat = classes is not None and (low is not None or bool(inplace)) and self._flat_scalars(classes)
        self.chunks = [Chunk(self, chunk, n == len(pieces) - 1) for n, chunk in enumerate(pieces)]
        self.cut = sorted({i for chunk in self.chunks for i in chunk.resume})  # tensors cut into pieces

    def _flat_scalars(self, classes: list[Any]) -> bool:
        """Make `scalars`, `signatures` and `positions` for flat runs; False where they cannot be made."""
        state = [self.entries.get(self.shadows[i]) or {} for i in self.kept]  # none yet: the optimizer makes it
        homes = {k: set(h) for k, h in self.inplace.items() if k != "data"} or {k: set(b.by_index) for k, b in self.stores.items()}
        keys = [tuple(k for k, holders in homes.items() if i in holders) for i in self.kept]
        scalars = [{k: v for k, v in entry.items() if k not in own} for entry, own in zip(state, keys)]
        names = set(scalars[0]) if scalars else set()
        if any(set(one) != names or not all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in one.values())
               for one in scalars) or any(len({(one[k].dtype, one[k].device) for one in scalars}) > 1 for k in names):
            return False
        self.scalars = {k: torch.stack([one[k] for one in scalars]) for k in sorted(names)}
        group_of = {id(p): n for n, g in enumerate(self.groups) for p in g["params"]}
        self.positions = {i: pos for pos, i in enumerate(self.kept)}
        self.signatures = {i: (group_of[id(self.shadows[i])], keys[pos], classes[i]) for pos, i in enumerate(self.kept)}
        for pos, entry in enumerate(state):
            if entry:
                entry.update({k: t[pos] for k, t in self.scalars.items()})
        return True

    def enter(self, chunk: Chunk) -> None:
        """Give the chunk's runs their optimizer state, per-step scalars as the step found them."""
        for run in chunk.flat:
            run.entry.update({key: values[run.first].clone() for key, values in self.scalars.items()})
            self.entries[run.param] = run.entry

    def leave(self, chunk: Chunk) -> None:
        """Take the runs' state back out of the optimizer's (a tensor it replaced is copied into its view)."""
        for run in chunk.flat:
            entry = run.entry = self.entries.pop(run.param)
            for key, view in run.views.items():
                if entry[key] is not view:  # the optimizer replaced the tensor, not updated it
                    entry[key] = view.copy_(entry[key])

    def write_scalars(self) -> None:
        """After a flat step: each run's new per-step scalars into its tensors' (`scalars`)."""
        for chunk in self.chunks:
            for run in chunk.flat:
                for key, values in self.scalars.items():
                    values[run.first:run.last + 1].copy_(run.entry[key])

    def run(self, step_fn: Callable[[], Any], load: Callable[[Chunk], None], store: Callable[[Chunk], None]) -> Any:
        """`load(chunk)`, `step_fn()` with the groups narrowed to the chunk, `store(chunk)`: chunk by chunk."""
        originals, result = [g["params"] for g in self.groups], None
        try:
            for chunk in self.chunks:
                load(chunk)
                if len(self.chunks) > 1 or self.flat:
                    for g, params in zip(self.groups, chunk.groups):
                        g["params"] = params
                result = step_fn()
                store(chunk)
        except BaseException:
            for chunk in self.chunks:  # the optimizer's state keeps no stand-in of a failed step
                for run in chunk.flat:
                    self.entries.pop(run.param, None)
            raise
        finally:
            for g, params in zip(self.groups, originals):
                g["params"] = params
        return result


def _views(flat: torch.Tensor, pieces: list[tuple[int, int, int]], shapes: list[Any]) -> list[torch.Tensor]:
    out, at = [], 0
    for (_, s, e), shape in zip(pieces, shapes):
        out.append(flat[at:at + e - s].view(shape))
        at += e - s
    return out
