"""The fastest matmul this device runs, per dtype: the peak that "the batch fills X%" is measured against.

`ampkit info --bench` reports sustained throughput over a time box. The doctor wants a *peak*, and
it runs on machines that are busy with other work, where one descheduled thread can stall a whole
parallel matmul. So it takes the fastest of a few repeats of one size: a stall makes a repeat
slower, never faster.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

#: Matrix size per device type: big enough to reach the arithmetic units' speed, small enough that
#: a dtype without fast units (bf16 on an AVX2 CPU: ~50× slower) still takes well under a second.
SIZE = {"cpu": 256, "cuda": 4096, "mps": 2048}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # sync: time the matmul, not its launch
    elif device.type == "mps":
        torch.mps.synchronize()


def _fastest(run: Callable[[], object], device: torch.device, seconds: float, repeats: int) -> float:
    """Seconds of the fastest of up to `repeats` calls of `run` (within ~`seconds`), after a warm-up call:
    library init, kernel choice and the first touch of the pages stay out of the timing."""
    run()
    _sync(device)
    best = float("inf")
    deadline = time.perf_counter() + seconds
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        _sync(device)
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return best


def matmul_peak(device: torch.device, dtype: torch.dtype, seconds: float = 0.3, repeats: int = 5) -> float:
    """FLOP/s of the fastest of up to `repeats` n×n matmuls in `dtype` on `device` (within ~`seconds`)."""
    n = SIZE.get(device.type, 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _fastest(lambda: a @ b, device, seconds, repeats)


def copy_bandwidth(device: torch.device, seconds: float = 0.1, repeats: int = 5, mib: int = 64) -> float:
    """Bytes/s of the fastest of up to `repeats` copies of a `mib` MiB fp32 tensor (read + write)."""
    n = mib * 2**20 // 4
    src = torch.empty(n, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * n * 4 / _fastest(lambda: dst.copy_(src), device, seconds, repeats)


def matmul_peaks(device: torch.device, dtype: torch.dtype, seconds: float = 0.3) -> dict[int, float]:
    """`matmul_peak` at torch's thread count and, on a CPU using several threads, at one thread.

    On a busy machine a multi-threaded matmul waits for its slowest thread to get a core, and can run
    far slower than on one thread: the two figures side by side show it. Returns {threads: FLOP/s}.
    """
    threads = torch.get_num_threads()
    counts = [threads, 1] if device.type == "cpu" and threads > 1 else [threads]
    peaks = {}
    for n in counts:
        torch.set_num_threads(n)
        try:
            peaks[n] = matmul_peak(device, dtype, seconds=seconds / len(counts))
        finally:
            torch.set_num_threads(threads)
    return peaks
