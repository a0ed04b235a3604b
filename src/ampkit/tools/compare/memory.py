"""Peak memory of the training alone: CUDA's max allocated, or the peak RSS above a baseline."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

from ampkit.hardware.capability import proc_field


def proc_status(key: str) -> int | None:
    """A byte figure from /proc/self/status ("VmRSS", "VmHWM"), or None where there is no /proc."""
    try:
        value = proc_field(Path("/proc/self/status").read_text(), key)
    except OSError:
        return None
    return int(value.split()[0]) * 1024 if value else None


def reset_peak_rss() -> bool:
    """Reset the kernel's resident-memory high-water mark to the current RSS (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """The process's resident-memory high-water mark (VmHWM; ru_maxrss where /proc is missing)."""
    hwm = proc_status("VmHWM")
    if hwm is not None:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


class Memory:
    """Peak memory between `mark()` and `freeze()`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.frozen: tuple[int, int | None, str] | None = None
        self.mark()

    def mark(self) -> None:
        """Start measuring here: after imports and data, before the model exists."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        # With the high-water mark reset, the peak above the current RSS is what training added;
        # without it (no /proc), the peak so far is the best baseline there is.
        self.rss_before = proc_status("VmRSS") if reset_peak_rss() else peak_rss_bytes()

    def freeze(self) -> None:
        """Take the reading now: training is over, and evaluation's memory is not training's."""
        self.frozen = self.read()

    def read(self) -> tuple[int, int | None, str]:
        """(figure ratios use, raw peak RSS or None, kind)."""
        if self.frozen is not None:
            return self.frozen
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device), None, "cuda_max_allocated"
        raw = peak_rss_bytes()
        return raw - (self.rss_before or 0), raw, "cpu_peak_rss_delta"
