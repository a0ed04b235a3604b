"""One contiguous buffer with a view per tensor: ampkit's per-step fp32 buffers for low-precision weights."""

from __future__ import annotations

import sys

import torch


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

    def __init__(self, like: list[torch.Tensor], dtype: torch.dtype, releasable: bool = True) -> None:
        self.device = like[0].device if like else torch.device("cpu")
        self.dtype = dtype
        self.shapes = [t.shape for t in like]
        self.sizes = [t.numel() for t in like]
        self.releasable = releasable  # False: kept between steps (see Accelerator(free_step_buffers=))
        self.buffer: torch.Tensor = EMPTY_FP32
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
