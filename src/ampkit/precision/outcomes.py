"""The host learns whether each optimizer step was applied or skipped, without waiting for it: each
step's (overflow flag, scale) is copied into a pinned host ring without blocking, an event marking when
it landed. `poll()` returns the landed outcomes oldest first; `poll(block=True)` waits for all. The ring carries any
pair of 0-dim values (`poll_pairs`): presets without a scaler send each step's loss and gradient norm through it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import unset_fake_temporarily

_RING = 64  # outcomes in flight before recording one waits for the oldest (the host 64 steps ahead)


@dataclass(frozen=True)
class Outcome:
    """What happened at one optimizer step."""

    skipped: bool
    scale: float


class StepOutcomes:
    """A ring of pinned host slots receiving per-step (found_inf, scale) pairs from the device."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._device = device  # its stream runs the copies; their events are recorded there
        # Prepared on fake tensors (`ampkit plan`; the CUDA path traced on a CPU-only torch, tests/test_fake_cuda.py)
        # no outcome is real: record() copies into a fake ring, and no pinned memory or CUDA event (real CUDA calls).
        fake = active_fake_mode() is not None
        self._events = self._cuda and not fake
        with unset_fake_temporarily():  # host memory, real even while `ampkit.plan` steps fake tensors
            self._host = torch.zeros((_RING, 2), dtype=torch.float32, pin_memory=self._events)
        self._view = self._host.numpy()  # reads of landed slots: plain memory, no tensor op
        self._slots = torch.zeros((_RING, 2), dtype=torch.float32) if fake else self._host  # what record() copies into
        self._pending: deque[tuple[int, torch.cuda.Event | None]] = deque()
        self._next = 0
        self._landed: list[tuple[float, float]] = []  # read out of slots that had to be reused before a poll

    def record(self, found_inf: torch.Tensor, scale: torch.Tensor | None) -> None:
        """Queue the outcome of the step that just ran (0-dim device tensors; `scale` None: a lone value, read
        back with 0.0 beside it, one copy and no stack); blocks only at `_RING`."""
        if len(self._pending) == _RING:  # the oldest slot is reused: read it first, never lose an outcome
            slot, event = self._pending.popleft()
            if event is not None:
                event.synchronize()  # sync: only when the host runs _RING steps ahead of the device
            self._landed.append(self._read(slot))
        slot = self._next
        self._next = (self._next + 1) % _RING
        if scale is None:
            self._view[slot, 1] = 0.0  # plain host memory (no tensor op); the slot was read before its reuse
            self._slots[slot, :1].copy_(found_inf.reshape(1), non_blocking=self._cuda)
        else:
            pair = torch.stack((found_inf.float(), scale.float()))
            self._slots[slot].copy_(pair, non_blocking=self._cuda)
        event = torch.cuda.Event() if self._events else None
        if event is not None:  # on the copy's stream: the current device may be another GPU
            event.record(torch.cuda.current_stream(self._device))
        self._pending.append((slot, event))

    def poll(self, block: bool = False) -> list[Outcome]:
        """Outcomes that have landed since the last poll, oldest first; all of them if `block`."""
        return [Outcome(skipped=found > 0, scale=scale) for found, scale in self.poll_pairs(block)]

    def poll_pairs(self, block: bool = False) -> list[tuple[float, float]]:
        """The recorded pairs that have landed since the last poll, as floats, oldest first; all of them if `block`."""
        landed, self._landed = self._landed, []
        while self._pending:
            slot, event = self._pending[0]
            if event is not None:
                if block:
                    event.synchronize()  # sync: the caller asked for exact figures, outside the step
                elif not event.query():
                    break
            landed.append(self._read(slot))
            self._pending.popleft()
        return landed

    def _read(self, slot: int) -> tuple[float, float]:
        first, second = self._view[slot]
        return float(first), float(second)

    def clear(self) -> None:
        """Forget the outcomes in flight (a checkpoint was loaded: its counters are the truth)."""
        self._pending.clear()
        self._landed = []
