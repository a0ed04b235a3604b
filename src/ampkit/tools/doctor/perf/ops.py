"""What the profiler saw in the profiled steps: the ops that are device kernels, their time, FLOPs, bytes.

The profiler records ops nested (`aten::linear` → `aten::addmm` → `aten::copy_`). A *kernel op* is
the outermost op that does work on a backend — not a decomposition (CompositeImplicitAutograd), a
view or an allocation — about one GPU kernel launch each; the DataLoader's ops are left out. FLOPs
are the profiler's; bytes are estimated from the input shapes (every input read once, plus an
output the size of the largest): enough for a roofline, not a memory budget.
"""

from __future__ import annotations

import functools
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

#: A kernel op whose name matches is matrix-multiply work: what Tensor Cores / AMX speed up.
MATMUL_OPS = re.compile(
    r"(^|::)_?(addmm|mm|bmm|baddbmm|addbmm|addmv|mv|dot|vdot|matmul|linear|int_mm|scaled_mm)"
    r"(_|$)|conv|attention"
)

_ELEMENT_BYTES = {
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "long int": 8,
    "long": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
    "c10::complex<float>": 8,
    "c10::complex<double>": 16,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1,
}

_DATA_RANGE = "enumerate(DataLoader)"
_DATA_OPS = {"aten::pin_memory", "aten::_pin_memory", "aten::is_pinned"}


@functools.cache
def is_kernel(name: str, overload: str = "") -> bool:
    """Whether the op `name.overload` does work on a backend itself (see the module docstring)."""
    if "::" not in name or "empty" in name or name.endswith(("::resize_", "::set_")):
        return False
    try:
        schema = torch._C._get_schema(name, overload)
    except RuntimeError:  # not an operator: a record_function range, an autograd node, ...
        return False
    full = f"{name}.{overload}" if overload else name
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    try:
        if has(full, "CompositeImplicitAutograd") and not any(
            has(full, key) for key in ("CPU", "CUDA", "CompositeExplicitAutograd")
        ):
            return False  # a decomposition into other ops: those are the kernels
    except RuntimeError:
        return False
    return not any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)  # a view


def _input_bytes(event: Any) -> list[int]:
    """The bytes of each input the profiler recorded for `event` (0 for one that is not a tensor)."""
    return [
        math.prod(shape) * _ELEMENT_BYTES.get(str(dtype), 4)
        if isinstance(shape, list) and shape and all(isinstance(s, int) for s in shape)
        else 0
        for shape, dtype in zip(event.input_shapes or (), getattr(event, "input_dtypes", None) or ())
    ]


@dataclass(frozen=True)
class KernelOp:
    """One kernel op as it ran here: host time (µs, inclusive), FLOPs, estimated bytes moved."""

    name: str
    us: float
    flops: int
    bytes: int
    matmul: bool


@dataclass(frozen=True)
class OpStats:
    """Kernel ops of the profiled steps, and (on CUDA) the device kernels the profiler saw."""

    steps: int
    kernels: tuple[KernelOp, ...]
    total_flops: int
    cuda_kernels: int | None = None  # device kernels launched in the window; None off CUDA
    cuda_kernel_us: float | None = None  # their summed device time

    @property
    def per_step(self) -> float:
        return len(self.kernels) / self.steps

    def _by_name(self) -> dict[str, list[KernelOp]]:
        by_name: dict[str, list[KernelOp]] = defaultdict(list)
        for k in self.kernels:
            by_name[k.name].append(k)
        return by_name

    def _typical_us(self) -> dict[str, float]:
        """Each op's median duration: one op descheduled by a busy machine must not set the figure."""
        return {name: statistics.median(k.us for k in ks) for name, ks in self._by_name().items()}

    @property
    def kernel_us_per_step(self) -> float:
        """Time per step inside kernel ops, as it was (compare with the profiled steps' own time)."""
        return sum(k.us for k in self.kernels) / self.steps

    @property
    def typical_us_per_step(self) -> float:
        """Time per step inside kernel ops with each op at its median duration (robust to stalls)."""
        typical = self._typical_us()
        return sum(typical[k.name] for k in self.kernels) / self.steps

    @property
    def mean_us(self) -> float:
        """The duration of an average kernel op (from the medians, as `typical_us_per_step`)."""
        return self.typical_us_per_step / self.per_step if self.kernels else 0.0

    @property
    def floor_us(self) -> float:
        """The cost of an op that does almost nothing here: the 10th percentile of kernel-op times."""
        return sorted(k.us for k in self.kernels)[len(self.kernels) // 10] if self.kernels else 0.0

    @property
    def flops_per_step(self) -> float:
        return self.total_flops / self.steps

    @property
    def bytes_per_step(self) -> float:
        return sum(k.bytes for k in self.kernels) / self.steps

    @property
    def matmul_share(self) -> float:
        """Share of kernel time spent in matmul/conv/attention kernels."""
        typical = self._typical_us()
        total = sum(typical[k.name] for k in self.kernels)
        return sum(typical[k.name] for k in self.kernels if k.matmul) / total if total else 0.0

    def top(self, n: int = 8) -> list[dict[str, Any]]:
        """The `n` kernel ops with the most time per step, aggregated by name (median durations)."""
        total = self.typical_us_per_step or 1.0
        rows: list[dict[str, Any]] = []
        for name, ks in self._by_name().items():
            median = statistics.median(k.us for k in ks)
            per_step = len(ks) / self.steps
            rows.append(
                {
                    "name": name,
                    "per_step": per_step,
                    "us_per_step": per_step * median,
                    "median_us": median,
                    "share": per_step * median / total,
                    "matmul": ks[0].matmul,
                }
            )
        return sorted(rows, key=lambda r: r["us_per_step"], reverse=True)[:n]


def _ancestors(event: Any) -> Iterator[Any]:
    """`event` and the ops it runs inside, innermost first."""
    while event is not None:
        yield event
        event = event.cpu_parent


def _descendants(event: Any) -> Iterator[Any]:
    for child in event.cpu_children:
        yield child
        yield from _descendants(child)


def analyse(events: list[Any], steps: int) -> OpStats:
    """Reduce `torch.profiler.profile(...).events()` of `steps` training steps to `OpStats`."""
    if steps < 1:
        raise ValueError(f"steps={steps!r}: the profile must cover at least one step")
    from torch.autograd import DeviceType

    cpu = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    cuda = [e for e in events if e.device_type == DeviceType.CUDA]

    def kernel(e: Any) -> bool:
        return is_kernel(e.name, getattr(e, "overload_name", "") or "")

    def outer(e: Any) -> bool:  # a kernel op inside no other
        return kernel(e) and not any(kernel(p) for p in _ancestors(e.cpu_parent))

    def is_data(e: Any) -> bool:
        return any(a.name.startswith(_DATA_RANGE) or a.name in _DATA_OPS for a in _ancestors(e))

    flops: dict[int, int] = defaultdict(int)
    total_flops = 0
    for e in cpu:
        f = int(e.flops or 0)
        if not f or is_data(e):
            continue
        total_flops += f
        # its kernel, or for a decomposition above its kernels (aten::conv2d) the first of them
        owner = next((a for a in _ancestors(e) if outer(a)), None)
        if owner is None:
            owner = next((d for d in sorted(_descendants(e), key=lambda d: d.time_range.start) if outer(d)), None)
        if owner is not None:
            flops[id(owner)] += f
    kernels = []
    for e in cpu:
        if not outer(e) or is_data(e):
            continue
        inputs = _input_bytes(e)
        # the inputs and an output; a TensorList op (foreach) records no shapes: what its inner ops touched
        moved = sum(inputs) + max(inputs) if any(inputs) else sum(sum(_input_bytes(d)) for d in _descendants(e))
        kernels.append(
            KernelOp(e.name, float(e.cpu_time_total), flops.get(id(e), 0), moved, bool(MATMUL_OPS.search(e.name)))
        )
    cuda_us = float(sum(e.time_range.elapsed_us() for e in cuda))  # each kernel's own span on the device
    return OpStats(steps, tuple(kernels), total_flops, len(cuda) if cuda else None, cuda_us if cuda else None)
