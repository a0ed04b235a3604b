"""Moving batches to the training device: nested structures, pinned memory, copies ahead of use.

`DeviceLoader` wraps a user's DataLoader so that every batch arrives on the device. On CUDA it
pins host memory and copies the next batch without blocking while the current one trains.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader


def move_to_device(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Return `obj` with every tensor inside it (tuples, lists, dicts, dataclasses, namedtuples) on `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, Mapping):
        return type(obj)({k: move_to_device(v, device, non_blocking) for k, v in obj.items()})  # type: ignore[call-arg]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(move_to_device(v, device, non_blocking) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_to_device(v, device, non_blocking) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: move_to_device(getattr(obj, f.name), device, non_blocking)
            for f in dataclasses.fields(obj)
            if f.init
        }
        return dataclasses.replace(obj, **changes)
    return obj


class DeviceLoader:
    """A DataLoader whose batches arrive on `device`; everything else is the wrapped loader's.

    Iterating yields the same batches in the same order as the wrapped loader. Attribute access
    (`dataset`, `batch_size`, `sampler`, ...) goes to the wrapped loader.
    """

    def __init__(self, loader: DataLoader, device: torch.device) -> None:
        self.loader = loader
        self.device = device
        self._cuda = device.type == "cuda"
        if self._cuda and not loader.pin_memory and loader.num_workers == 0:
            # Pinned host memory lets the host→device copy run without blocking the host.
            loader.pin_memory = True

    def __iter__(self) -> Iterator[Any]:
        if not self._cuda:
            for batch in self.loader:
                yield move_to_device(batch, self.device)
            return
        # One batch ahead: its copy overlaps the current step's compute.
        it = iter(self.loader)
        try:
            ahead = move_to_device(next(it), self.device, non_blocking=True)
        except StopIteration:
            return
        for batch in it:
            current, ahead = ahead, move_to_device(batch, self.device, non_blocking=True)
            yield current
        yield ahead

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (during unpickling): avoid infinite recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __repr__(self) -> str:
        return f"DeviceLoader({self.loader!r}, device={self.device})"
