"""One contiguous buffer with a view per tensor: ampkit's per-step fp32 buffers for low-precision weights."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from itertools import accumulate

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

    def __init__(
        self,
        like: Sequence[torch.Tensor],
        dtype: torch.dtype,
        releasable: bool = True,
        indices: list[int] | None = None,
        allocate: bool = True,
    ) -> None:
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
