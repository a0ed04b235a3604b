"""How ampkit times, in one module: compare, `info --bench`, the doctor, export and the benchmarks use it.

- **Rounds side by side** (`interleaved`): every candidate runs in turn each round (A B C A B C ...), warm-up
  rounds dropped, so a slow moment of a shared machine lands on all of them.
- **The paired speed-up with its interval** (`paired_speedup`): the geometric mean of the per-round ratios and
  a seeded bootstrap interval of them.
- **One probe of the device** (`matmul_rate`, `copy_bandwidth`): the fastest of timed calls, the device synced
  around each.
- **The load check**: whether the machine was busy while something was timed, below.

Two signs, each measured, neither guessed: the load beyond what ampkit's own training adds (`own`: its threads),
against the cores -- the 1-minute load average, or where the OS says so (Linux's /proc/stat) the cores busy in a
quarter second's look if fewer: the average still carries for a minute a job that has ended, ampkit's own
comparison run just before included; and a short burst of small fp32 matmuls on torch's threads, whose
average time against its fastest says how much longer ops ran than this device can run them (threads waiting
for cores wait in whole scheduler slices, so a busy CPU shows a slow average beside a fast best).
A timing from a busy machine is marked as such: a reader is told before any figure is trusted.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar, overload

import numpy as np
import torch

K = TypeVar("K", bound=Hashable)


# --- rounds side by side, and the paired speed-up -------------------------------------------------------
def interleaved(
    calls: Mapping[K, Callable[[], object]],
    rounds: int,
    *,
    steps: int = 1,
    warmup: int = 0,
    sync: Callable[[], None] = lambda: None,
    on_error: Callable[[K, BaseException], None] | None = None,
    on_round: Callable[[int], None] | None = None,
) -> dict[K, list[float]]:
    """Seconds per call of each of `calls` in every measured round (the first `warmup` rounds dropped).

    Each round runs `steps` calls of every candidate in turn, timed between `sync()` calls (a CUDA device runs
    ahead of the host: without the sync the host would time only the kernel launches). With `on_error`, a
    candidate that raises is reported there and left out of the later rounds; without it, the error propagates.
    `on_round(r)` is told before round `r` (0-based, warm-up rounds included) starts.
    """
    times: dict[K, list[float]] = {key: [] for key in calls}
    live = dict(calls)
    for r in range(rounds + warmup):
        if on_round is not None:
            on_round(r)
        for key, call in list(live.items()):
            sync()
            start = time.perf_counter()
            try:
                for _ in range(steps):
                    call()
                sync()
            except Exception as exc:  # noqa: BLE001 - one broken candidate must not end the others' run
                if on_error is None:
                    raise
                on_error(key, exc)
                del live[key]
                continue
            if r >= warmup:
                times[key].append((time.perf_counter() - start) / steps)
    return times


CONFIDENCE = 0.95
RESAMPLES = 4000
SEED = 0


def paired_speedup(
    base_s: Sequence[float | None], run_s: Sequence[float | None], *, seed: int = SEED, resamples: int = RESAMPLES
) -> tuple[float, float, float] | None:
    """(speed-up, low, high): the geometric mean of the paired ratios base/run and its `CONFIDENCE` bootstrap
    interval (percentile, `resamples` resamples of the pairs from `seed`); None with fewer than two pairs."""
    ratios = [
        b / r
        for b, r in zip(base_s, run_s)
        if b is not None and r is not None and b > 0 and r > 0 and math.isfinite(b / r)
    ]
    if len(ratios) < 2:
        return None
    logs = np.log(np.asarray(ratios, dtype=np.float64))
    picks = np.random.default_rng(seed).integers(0, len(logs), size=(resamples, len(logs)))
    means = logs[picks].mean(axis=1)
    tail = (1 - CONFIDENCE) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(np.exp(logs.mean())), float(np.exp(low)), float(np.exp(high))


# --- the probe: matmul FLOP/s and copy bandwidth ----------------------------------------------------------------
def sync_device(device: torch.device) -> None:
    """Wait for `device`'s queued work (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # sync: a timing tool's own, around what it times
    elif device.type == "mps":
        torch.mps.synchronize()


def fastest(
    run: Callable[[], object], device: torch.device, seconds: float, repeats: int | None = None
) -> tuple[float, int, float]:
    """(fastest, calls, total) seconds of timed calls of `run` after a warm-up call: as many as fit in about
    `seconds` (at least one, at most `repeats`), each timed with the device synced around it."""
    run()
    sync_device(device)
    best, calls, total = float("inf"), 0, 0.0
    deadline = time.perf_counter() + seconds
    while calls == 0 or (time.perf_counter() < deadline and (repeats is None or calls < repeats)):
        start = time.perf_counter()
        run()
        sync_device(device)
        took = time.perf_counter() - start
        best, calls, total = min(best, took), calls + 1, total + took
    return best, calls, total


@dataclass(frozen=True)
class Rate:
    """What the probe measured: an n×n matmul's FLOP/s (or a copy's bytes/s) at its fastest call."""

    size: int  # n of the n×n @ n×n matmul (MiB of the copy)
    calls: int  # timed calls
    seconds: float  # their time
    per_s: float  # FLOP/s (bytes/s) of the fastest


#: Matmul sizes per device type (first, largest): start small (a dtype without fast units, bf16 on an AVX2 CPU,
#: runs ~50× slower than fp32 and must still fit its time) and double while a call of the next size would take
#: under a quarter of the time, up to a size that keeps the fast units busy (a GPU needs thousands).
MATMUL_N = {"cpu": (128, 1024), "cuda": (256, 8192), "mps": (256, 4096)}


def matmul_rate(
    device: torch.device,
    dtype: torch.dtype,
    seconds: float,
    *,
    sizes: tuple[int, int] | None = None,
    repeats: int | None = None,
) -> Rate:
    """FLOP/s of the fastest n×n matmul in `dtype` on `device` within about `seconds` (at most `repeats` timed
    calls), at torch's threads; `sizes` = (first, largest) n (`MATMUL_N`; equal: a fixed size)."""
    n, largest = sizes or MATMUL_N.get(device.type, (256, 1024))
    start, matmul = time.perf_counter(), _matmul(n, device, dtype)
    while n < largest and 8 * fastest(matmul, device, 0.0)[0] <= seconds / 4:  # the next size is 8× the work
        n *= 2
        matmul = _matmul(n, device, dtype)
    left = max(0.0, seconds - (time.perf_counter() - start))
    best, calls, total = fastest(matmul, device, left, repeats)
    return Rate(size=n, calls=calls, seconds=total, per_s=2 * n**3 / max(best, 1e-12))


def _matmul(n: int, device: torch.device, dtype: torch.dtype) -> Callable[[], object]:
    # Operands made on the device: filling 8192² on the host and copying would eat the time.
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return lambda: a @ b


def copy_bandwidth(device: torch.device, seconds: float = 0.1, repeats: int = 5, mib: int = 64) -> float:
    """Bytes/s of the fastest of up to `repeats` copies of a `mib` MiB fp32 tensor (read + write)."""
    src = torch.ones(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * mib * 2**20 / fastest(lambda: dst.copy_(src), device, seconds, repeats)[0]


# --- the load check ------------------------------------------------------------------------------------------
#: Other work using more than this share of the cores makes the machine busy.
BUSY_SHARE = 0.5

#: The matmul burst's average this many times its fastest makes the machine busy (idle: ~1.0-1.3).
SLOWDOWN_BUSY = 2.0

#: The burst: this many seconds of n×n fp32 matmuls (a few ms each on a CPU core).
BURST_S, BURST_N = 0.25, 128

#: How the OS keeps its 1-minute load average: a sample of the runnable threads every 5 s, averaged with a
#: 60 s time constant (Linux's kernel/sched/loadavg.c).
LOAD_SAMPLE_S, LOAD_WINDOW_S = 5.0, 60.0


@dataclass(frozen=True, kw_only=True)
class MachineLoad:
    """One look at the machine: `report.machine["load"]` of a comparison (its `as_dict()`)."""

    load_average: float | None  # 1-minute, less ampkit's own threads; None where the OS does not say
    cores: int
    threads: int  # torch's intra-op threads
    matmul_slowdown: float | None  # mean / fastest of the burst; None: not measured (a GPU, or measure=False)
    busy: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def matmul_slowdown(device: torch.device | None = None, seconds: float = BURST_S, n: int = BURST_N) -> float | None:
    """How many times longer small fp32 matmuls took on average than their fastest run, here and now: the
    time ops lost waiting for cores (None on anything but a CPU: a GPU's kernels do not wait for host cores)."""
    if device is not None and device.type != "cpu":
        return None
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # the first call chooses its kernel: not timed
    took: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(took) < 5:
        start = time.perf_counter()
        torch.mm(a, b)
        took.append(time.perf_counter() - start)
    best = min(took)
    return statistics.fmean(took) / best if best > 0 else None


def load_average() -> float | None:
    """The 1-minute load average, or None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):  # Windows has no getloadavg
        return None


#: How long the look at the cores busy now lasts (`busy_cores`).
LOOK_S = 0.25


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores since boot, from Linux's /proc/stat; None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 5:
        return None
    idle = fields[3] + fields[4]  # idle and iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is counted in user)
    return total - idle, total


def busy_cores(seconds: float = LOOK_S) -> float | None:
    """How many cores' worth of work ran in the next `seconds` (this process sleeps meanwhile), or None where the
    OS does not say: the load now, where the 1-minute average lags a minute behind."""
    first = _cpu_times()
    if first is None:
        return None
    time.sleep(seconds)
    second = _cpu_times()
    if second is None or second[1] <= first[1]:
        return None
    return (second[0] - first[0]) / (second[1] - first[1]) * (os.cpu_count() or 1)


def own_load(threads: int, seconds: float) -> float:
    """The most `threads` threads kept busy for `seconds` can have added to the 1-minute load average: each
    sample moves it 1 - e^(-5/60) of the way towards them, and `seconds` span at most ceil(seconds / 5) + 1
    samples. After minutes of training that is nearly all of `threads`; after a 2-second benchmark a sixth of
    it, so the look after a short timing still sees others' load instead of taking it for ampkit's own."""
    samples = math.ceil(max(0.0, seconds) / LOAD_SAMPLE_S) + 1
    return threads * (1.0 - math.exp(-samples * LOAD_SAMPLE_S / LOAD_WINDOW_S))


def judge(load: float | None, cores: int, threads: int, slowdown: float | None) -> MachineLoad:
    """The check from its figures (`load`: others' load, ampkit's own already taken out)."""
    busy = (load is not None and load > BUSY_SHARE * cores) or (slowdown is not None and slowdown >= SLOWDOWN_BUSY)
    return MachineLoad(
        load_average=None if load is None else round(load, 2),
        cores=cores,
        threads=threads,
        matmul_slowdown=None if slowdown is None else round(slowdown, 2),
        busy=busy,
    )


def check_load(device: torch.device | None = None, *, own: float = 0.0, measure: bool = True) -> MachineLoad:
    """This machine now: its load average less `own` (the load ampkit's own work adds, e.g. the threads of
    a run that just ended), or the cores busy now where fewer (`busy_cores`: the average still carries a job
    that ended in the last minute), and with `measure`, the matmul burst (taken twice where the first says busy,
    the calmer kept: one slow moment of a quarter second is not a busy machine)."""
    avg = load_average()
    others = None if avg is None else max(0.0, avg - own)
    now = busy_cores() if others is not None and others > BUSY_SHARE * (os.cpu_count() or 1) else None
    if now is not None:  # looked at only where the average alone would call the machine busy
        assert others is not None  # `now` is only looked at where `others` is known
        others = min(others, now)
    slowdown = matmul_slowdown(device) if measure else None
    if slowdown is not None and slowdown >= SLOWDOWN_BUSY:  # a moment's hiccup, or busy: a second burst says which
        again = matmul_slowdown(device)
        slowdown = min(slowdown, again) if again is not None else slowdown
    return judge(others, os.cpu_count() or 1, torch.get_num_threads(), slowdown)


@overload
def worst(first: MachineLoad, /, *looks: MachineLoad | None) -> MachineLoad: ...
@overload
def worst(*looks: MachineLoad | None) -> MachineLoad | None: ...
def worst(*looks: MachineLoad | None) -> MachineLoad | None:
    """The busier of several looks (before and after a timing): the figures of the busiest moment seen."""
    seen = [look for look in looks if look is not None]
    if not seen:
        return None
    load = max((s.load_average for s in seen if s.load_average is not None), default=None)
    slowdown = max((s.matmul_slowdown for s in seen if s.matmul_slowdown is not None), default=None)
    return judge(load, seen[0].cores, seen[0].threads, slowdown)


def describe_load(load: dict[str, Any] | MachineLoad | None) -> str | None:
    """ "load 12 on 2 cores; ops ran ~3.1× slower than this CPU can" (what was measured), or None."""
    if load is None:
        return None
    load = load.as_dict() if isinstance(load, MachineLoad) else load
    parts = []
    if load.get("load_average") is not None:
        parts.append(f"load {load['load_average']:.3g} on {load['cores']} core{'s' if load['cores'] != 1 else ''}")
    if (slow := load.get("matmul_slowdown")) is not None and slow >= 1.2:
        parts.append(f"ops ran ~{slow:.2g}\u00d7 slower than this CPU can")
    return "; ".join(parts) or None
