"""`ampkit.plan`: the peak training memory of each precision preset, and the largest batch that fits.

Each figure comes from two training steps of the real preset on fake tensors (`ampkit.tools.plan.step`), so a
model far larger than this machine is planned in seconds; a forward fake tensors cannot run is measured
instead (real steps at batch sizes 1 and 2 on the CPU, scaled linearly to the batch), and the row says so.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, cast

import torch
from torch import nn

from ampkit.engine.distributed import FSDP_PRESETS, fsdp_units
from ampkit.hardware.capability import capability, resolve_device
from ampkit.precision.policy import PRESETS, fp8_problem, resolve_precision
from ampkit.tools.plan.runtime import allocator_bytes, runtime_bytes
from ampkit.tools.plan.step import FAKE_FAILURES, Measured, batch_size_of, measure
from ampkit.tools.plan.tracker import COMPONENTS
from ampkit.tools.records import field, schema_of, validate
from ampkit.tools.tasks import default_size, get_task
from ampkit.util.present import size as size_of
from ampkit.util.validate import parse_memory

SCHEMA_VERSION: Literal[1] = 1
SEARCH_LIMIT = 1 << 16  # the largest batch size the search tries


@dataclass
class PlanRow:
    """One preset's predicted peak over a training step, what holds it, and the batch sizes that fit."""

    precision: str = field("the preset")
    batch_size: int = field("the batch size the figures are for", minimum=1)
    peak_bytes: int = field("peak of live tensor bytes over two training steps", minimum=0)
    peak_phase: str = field("where the peak is: forward, backward or optimizer")
    parameters: int = field("bytes of the model's parameters and buffers at the peak", minimum=0)
    gradients: int = field("bytes of the model parameters' gradients at the peak", minimum=0)
    optimizer_state: int = field("bytes of the optimizer's state (moments, momentum) at the peak", minimum=0)
    ampkit_buffers: int = field("bytes of ampkit's fp32 master weights, Kahan buffers and step buffers", minimum=0)
    activations: int = field("bytes saved for backward (and the batch) at the peak", minimum=0)
    autocast_cache: int = field("bytes of autocast's low-precision copies of fp32 weights at the peak", minimum=0)
    temporaries: int = field("every other live byte at the peak", minimum=0)
    fits: bool = field("whether the measured peak (resident_bytes) fits in the memory planned for")
    max_batch_size: int = field(
        "the largest batch size whose peak fits (0: none; not searched: the planned batch if it fits, else 0)",
        minimum=0,
    )
    method: Literal["fake", "real-scaled"] = field(
        "fake: two steps on fake tensors; real-scaled: real steps at batch 1 and 2 on this CPU, scaled to the batch"
    )
    note: str = field("why the row was measured rather than predicted")
    runtime: int = field(
        "bytes the process holds besides tensors: torch's libraries and threads, the compiler where the preset "
        "compiles its update (measured constants; 0 on CUDA)",
        0,
        optional=True,
        minimum=0,
    )
    allocator: int = field(
        "freed memory the allocator keeps mapped: glibc's heap on a Linux CPU, estimated from the peak; 0 on CUDA",
        0,
        optional=True,
        minimum=0,
    )
    resident_bytes: int = field(
        "what a user measures: peak_bytes + runtime + allocator (a CPU step's resident memory above the "
        "pre-model baseline; on CUDA max_memory_allocated)",
        0,
        optional=True,
        minimum=0,
    )

    def components(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in COMPONENTS}


@dataclass
class Plan:
    """`ampkit plan`'s result: per preset, the predicted peak training memory and the batch sizes that fit."""

    schema_version: Literal[1] = field("version of this format")
    device: str = field("the device planned for")
    memory_bytes: int = field("the memory the rows are checked against", minimum=1)
    parameter_count: int = field("the model's parameters", minimum=0)
    rows: list[PlanRow] = field("one row per preset")
    recommendation: str = field("the fastest preset that fits, or what to change")
    strategy: Literal["none", "fsdp"] = field("fsdp: each row is one rank's share under FSDP2", "none", optional=True)
    nproc: int = field("processes the model is sharded across (the rows are per rank)", 1, optional=True, minimum=1)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


PLAN_SCHEMA = schema_of(Plan)


def device_memory(device: torch.device) -> int:
    """The device's total memory, as `ampkit info` reads it (the machine's RAM for a CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan(
    model_fn: Callable[[], nn.Module],
    batch_fn: Callable[[], Any],
    optimizer_fn: Callable[[Any], torch.optim.Optimizer],
    precisions: Sequence[str] | None = None,
    device: str | torch.device | None = None,
    memory: str | int | None = None,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    search: bool = True,
    strategy: str = "none",
    nproc: int = 1,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Predict each preset's peak training memory without allocating it, and the largest batch that fits.

    `model_fn()` builds the model (it is built on the meta device), `batch_fn()` returns one batch
    `(inputs, targets)` (inputs a tensor, a tuple of positional or a dict of keyword arguments),
    `optimizer_fn(params)` the optimizer. The loss is `loss_fn(output, targets)`, or the model's own
    (a scalar output, `output.loss`), or cross-entropy / mean squared error. `memory` ("24GiB", bytes;
    default: the device's total memory) decides `fits` and `max_batch_size` (`search=False`: no search).
    `strategy="fsdp"` with `nproc=N`: each row is one rank's share under FSDP2 (`fsdp_share`). `progress(line)`
    hears each preset as its measurement starts.
    """
    if (
        strategy not in ("none", "fsdp")
        or not isinstance(nproc, int)
        or nproc < 1
        or (strategy == "none" and nproc > 1)
    ):
        raise ValueError(
            f"strategy={strategy!r}, nproc={nproc!r}: expected strategy 'none' (one process) or 'fsdp' "
            f"with nproc an integer >= 1 (the ranks the model is sharded across)"
        )
    dev = resolve_device(device or "auto")
    budget = parse_memory(memory) if memory is not None else device_memory(dev)
    allowed = FSDP_PRESETS if strategy == "fsdp" else tuple(PRESETS)
    names = list(precisions) if precisions is not None else [n for n in allowed if _runs(n, dev)]
    for name in names:
        if name not in allowed:
            raise ValueError(
                f"precisions: {name!r} is not a preset{' FSDP shards' * (strategy == 'fsdp')}; choose "
                f"from {', '.join(allowed)}"
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # slow here is fine: nothing is timed
            resolve_precision(name, dev)  # PrecisionError, before anything runs, for one the device cannot run
    batch = batch_fn()
    size = batch_size_of(batch)
    with torch.device("meta"):
        meta = model_fn()
    count = sum(p.numel() for p in meta.parameters())
    unit = max((sum(p.numel() for p in u.parameters()) for u in fsdp_units(meta)), default=count)
    rows = []
    for name in names:
        if progress is not None:
            progress(f"{name}: the peak at batch {size}{', then the largest batch that fits' * search}")
        shard = (lambda m, name=name: fsdp_share(m, nproc, unit, PRESETS[name])) if strategy == "fsdp" else None
        peak_at = _Peaks(model_fn, batch, optimizer_fn, name, dev, loss_fn, shard)
        first = peak_at.measured(size)
        resident = peak_at(size)
        runtime, allocator = peak_at.overhead(first)
        limit = _largest_batch(peak_at, size, resident, budget) if search else (size if resident <= budget else 0)
        rows.append(
            PlanRow(
                precision=name,
                batch_size=size,
                peak_bytes=first.peak,
                peak_phase=first.phase,
                **first.components,
                fits=resident <= budget,
                max_batch_size=limit,
                method="real-scaled" if peak_at.fallback else "fake",
                note=peak_at.note,
                runtime=runtime,
                allocator=allocator,
                resident_bytes=resident,
            )
        )
    result = Plan(
        schema_version=SCHEMA_VERSION,
        device=str(dev),
        memory_bytes=budget,
        parameter_count=count,
        rows=rows,
        recommendation=recommend(rows, dev, budget, count, search),
        strategy=cast(Literal["none", "fsdp"], strategy),  # checked above
        nproc=nproc,
    )
    validate(result.as_dict(), PLAN_SCHEMA)
    return result


def plan_task(
    name: str,
    precisions: Sequence[str] | None = None,
    *,
    size: str | None = None,
    seed: int = 0,
    batch_size: int | None = None,
    device: str | torch.device | None = None,
    memory: str | int | None = None,
    search: bool = True,
    strategy: str = "none",
    nproc: int = 1,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """`plan` for a built-in task (`ampkit.tools.tasks`) at its default batch size and learning rate; `size`: the
    model size (default: the one `ampkit compare` runs on the device)."""
    task = get_task(name, size or default_size(name, resolve_device(device or "auto")))
    batch = next(iter(task.make_data(seed, batch_size or task.default_batch_size).train_loader))
    return plan(
        lambda: task.make_model(seed),
        lambda: batch,
        lambda params: task.make_optimizer(params, task.default_lr),
        precisions,
        device,
        memory,
        loss_fn=task.loss_fn,
        search=search,
        strategy=strategy,
        nproc=nproc,
        progress=progress,
    )


def _runs(name: str, device: torch.device) -> bool:
    preset, support = PRESETS[name], capability(device)
    runs = {torch.float32: True, torch.bfloat16: support.bf16_runs, torch.float16: support.fp16_runs}
    return runs[preset.compute_dtype] and not (preset.fp8 and fp8_problem(device))


class _Peaks:
    """One preset's peak at any batch size: fake steps, or (where the forward cannot run on fake
    tensors) real steps at batch sizes 1 and 2 extrapolated linearly, per component."""

    fallback: list[Measured] | None  # the real steps at batch sizes 1 and 2, once fake tensors failed

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        batch: Any,
        optimizer_fn: Callable[[Any], Any],
        name: str,
        device: torch.device,
        loss_fn: Any,
        shard: Callable[[Measured], Measured] | None = None,
    ) -> None:
        self.run = functools.partial(measure, model_fn, batch, optimizer_fn, name, loss_fn=loss_fn)
        self.name, self.device, self.shard, self.fallback, self.note = name, device, shard, None, ""
        self.cache: dict[int, Measured] = {}

    def measured(self, size: int) -> Measured:
        if size not in self.cache:
            whole = self._scaled(size) if self.fallback else self._fake(size)
            self.cache[size] = self.shard(whole) if self.shard is not None else whole
        return self.cache[size]

    def __call__(self, size: int) -> int:
        """What a user would measure at `size`: the tensor peak with the runtime and the allocator's part."""
        at = self.measured(size)
        return at.peak + sum(self.overhead(at))

    def overhead(self, at: Measured) -> tuple[int, int]:
        """(runtime, allocator): what the process holds beside the tensors of `at` (`ampkit.tools.plan.runtime`)."""
        buffers = at.components["ampkit_buffers"]
        return runtime_bytes(self.name, self.device), allocator_bytes(at.peak, self.device, buffers)

    def _fake(self, size: int) -> Measured:
        try:
            return self.run(self.device, fake=True, batch_size=size)
        except FAKE_FAILURES as exc:
            op = getattr(exc, "func", None) or exc
            self.note = (
                f"the step cannot run on fake tensors ({op}: a data-dependent shape, a tensor read as a Python "
                "number in the forward or an op without a fake kernel); measured instead: real steps at batch 1 "
                "and 2 on the CPU, scaled to the batch"
            )
            self.fallback = [self.run(torch.device("cpu"), fake=False, batch_size=b) for b in (1, 2)]
            return self._scaled(size)

    def _scaled(self, size: int) -> Measured:
        assert self.fallback is not None  # set before the first scaled figure
        one, two = self.fallback
        parts = {
            k: max(0, one.components[k] + (size - 1) * (two.components[k] - one.components[k])) for k in COMPONENTS
        }
        return Measured(max(0, one.peak + (size - 1) * (two.peak - one.peak)), parts, two.phase)


def fsdp_share(whole: Measured, nproc: int, unit: int, policy: Any) -> Measured:
    """One rank's share of a one-process step under FSDP2 across `nproc` ranks (an estimate: collectives'
    buffers are not traced): parameters, gradients, optimizer state and ampkit's buffers at 1/nproc, plus the
    largest unit (`unit` parameters) all-gathered in the compute dtype twice (running and prefetched) and its
    gradients unsharded in fp32 for the reduce-scatter; activations and temporaries as one process's."""
    parts = dict(whole.components)
    sharded = ("parameters", "gradients", "optimizer_state", "ampkit_buffers")
    before = sum(parts[k] for k in sharded)
    for key in sharded:
        parts[key] = -(-parts[key] // nproc)
    if nproc > 1:
        parts["parameters"] += 2 * unit * policy.compute_dtype.itemsize
        parts["gradients"] += 4 * unit
    peak = whole.peak - before + sum(parts[k] for k in sharded)
    return Measured(peak, parts, whole.phase, whole.after_step)


def _largest_batch(peak_at: Callable[[int], int], size: int, peak: int, budget: int) -> int:
    """The largest batch size whose peak fits in `budget` (0: none). Peaks grow piecewise linearly with the
    batch, so each guess is on the line through the largest size known to fit and the smallest known not to
    (doubling while none is known not to), and after two results on the same side the bracket is halved."""
    known = {0: 0, size: peak}
    fit, over = (size, None) if peak <= budget else (0, size)
    sides: list[bool] = []
    for _ in range(24):
        top = SEARCH_LIMIT if over is None else over - 1
        if fit >= top:
            break
        if over is None:
            a, b = sorted(known)[-2:]
            slope = (known[b] - known[a]) / (b - a)
            guess = max(2 * fit, b + math.floor((budget - known[b]) / slope) if slope > 0 else 0)
        elif len(sides) >= 2 and sides[-1] == sides[-2]:
            guess = (fit + over) // 2
        else:
            guess = fit + math.floor((budget - known[fit]) * (over - fit) / max(1, known[over] - known[fit]))
        guess = min(max(guess, fit + 1), top)
        known[guess] = peak_at(guess)
        sides.append(known[guess] <= budget)
        fit, over = (guess, over) if sides[-1] else (fit, guess)
    return fit


def recommend(rows: list[PlanRow], device: torch.device, budget: int, count: int, searched: bool = True) -> str:
    """The fastest preset that fits at the planned batch size, or what to change."""
    if not rows:
        return "no preset was planned"
    support = capability(device)
    fast = {torch.float32: False, torch.bfloat16: support.bf16_fast, torch.float16: support.fp16_fast}
    order = ["fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-true", "fp8-mixed"]
    ranked = sorted(order, key=lambda n: not fast[PRESETS[n].compute_dtype])  # fast ones, fp32, the rest
    rows = sorted(rows, key=lambda r: ranked.index(r.precision))
    size = rows[0].batch_size
    fitting = [r for r in rows if r.fits]
    if fitting:
        best = fitting[0]
        return (
            f"{best.precision}: the fastest preset here that fits at batch {size} (peak {size_of(best.resident_bytes)} "
            f"of {size_of(budget)}; up to batch {best.max_batch_size})"
        )
    at_rest = min(r.parameters + r.optimizer_state + r.ampkit_buffers + r.gradients for r in rows)
    if not searched and at_rest <= budget:  # a smaller batch may fit: that is what the search finds
        return (
            f"nothing fits at batch {size} in {size_of(budget)}; the batch sizes that would were not searched "
            f"(search=False, --no-search): plan again with the search"
        )
    smaller = max(rows, key=lambda r: (r.max_batch_size, -ranked.index(r.precision)))
    if smaller.max_batch_size > 0:
        steps = math.ceil(size / smaller.max_batch_size)
        return (
            f"nothing fits at batch {size}: use {smaller.precision} at batch {smaller.max_batch_size} with "
            f"grad_accum_steps={steps} (effective batch {smaller.max_batch_size * steps}); activation checkpointing "
            f"would cut the activations ({size_of(smaller.activations)} at batch {size})"
        )
    gpus = max(2, math.ceil(at_rest / (0.8 * budget)))
    return (
        f"nothing fits even at batch 1: the {count / 1e9:.2f} B parameters with their gradients and optimizer state "
        f"need {size_of(at_rest)} in the smallest preset planned (bf16-true keeps 8 B/param at rest with AdamW); shard "
        f"them with strategy='fsdp' across at least {gpus} devices of {size_of(budget)}"
    )
