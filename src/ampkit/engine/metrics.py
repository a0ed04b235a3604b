"""Training metrics summed on the device and read all at once, every N steps.

`loss.item()` every step makes the host wait for the device every step. `MetricTracker.track` only
adds to device tensors; `read()` fetches every metric with one transfer and starts a new window.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class MetricTracker:
    """Running means of named values, kept on the device until read."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}

    def track(self, name: str, value: torch.Tensor | float) -> None:
        """Add `value` (a tensor of any shape, or a number) to the running mean `name`. No sync."""
        if isinstance(value, torch.Tensor):
            total = value.detach().float().sum()
            count = value.numel()
        elif isinstance(value, (int, float)):
            total, count = torch.tensor(float(value)), 1
        else:
            raise TypeError(
                f"track({name!r}, {type(value).__name__}): expected a tensor or a number as the value, "
                f"e.g. acc.track('loss', loss)"
            )
        if name in self._sums:
            self._sums[name] = self._sums[name] + total.to(self._sums[name].device)
            self._counts[name] += count
        else:
            self._sums[name], self._counts[name] = total, count

    def read(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
        """The mean of each tracked name since the last read, as floats; then reset. One sync. `reduce`
        (a sum across ranks) gets the sums and counts together: the global means from one collective."""
        if not self._sums:
            return {}
        names = list(self._sums)
        device = self._sums[names[0]].device
        sums = torch.stack([self._sums[n].to(device) for n in names])
        counts = torch.tensor([float(self._counts[n]) for n in names], device=device)
        both = torch.cat([sums, counts])
        if reduce is not None:
            both = reduce(both)
        # An explicit copy to the host, so a dispatch mode counting host reads sees it on any device (CPU too).
        values = both.to("cpu", copy=True).tolist()  # sync: the one read per logging window, by design
        result = {n: s / c for n, s, c in zip(names, values[: len(names)], values[len(names) :])}
        self._sums.clear()
        self._counts.clear()
        return result
