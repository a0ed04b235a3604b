"""Micro-batching: a batch larger than the device holds, split into micro-batches that fit, with the same update.

```python
acc = ampkit.Accelerator(precision="bf16-mixed", micro_batch="auto", memory="2GiB")
model, optimizer, loader = acc.prepare(model, optimizer, loader)
for x, y in loader:
    for mx, my in acc.split((x, y)):        # the one added line: the loop body moves under it
        acc.backward(loss_fn(model(mx), my))
    optimizer.step()
    optimizer.zero_grad()
```

Each micro-batch's mean loss is weighted by its share of the batch (`rows / batch rows`; a summed loss with
`num_items=` needs no weight), and all the micro-batches of one batch are one micro-step of the accumulation
cycle, so the optimizer steps on the whole batch's gradient, within fp32 rounding. Under DDP/FSDP only the last
micro-batch's backward all-reduces.

`micro_batch="auto"` takes the largest micro-batch whose planned resident peak (`ampkit.plan`, sized at the first
batch, with `MARGIN` for the plan's error) fits `memory` (default: the device's free memory); an int fixes it.
A `torch.OutOfMemoryError` in a prepared model's forward or in `acc.backward` during a split halves the size and
reruns the batch from its start: gradients of the attempt dropped, the RNG and norm layers' running statistics as
they were, the cycle and item counts reset. A forward that ran out is finished without autograd, so the loop's
own lines run on a normal output, and its backward does nothing. Under DDP/FSDP the ranks agree on the size before
the micro-batch that all-reduces (one host read per batch). At most log2(batch) + 1 halvings.
"""

from __future__ import annotations

import gc
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ampkit.errors import AmpkitError

if TYPE_CHECKING:
    from ampkit.engine.events import Run

MARGIN = 0.10  # the planned peak may be this much under the measured one (benchmarks/notes/plan.md: within 6.2%)

# How micro_batch="auto" is sized: ampkit.plan registers its planner here on import
# (`ampkit.tools.plan.fit`); the engine does not import the tool layer, which runs the engine to trace a step.
Sizer = Callable[["Run", Any, int], tuple[int, str]]
_sizers: list[Sizer] = []


def use_sizer(sizer: Sizer) -> None:
    """Make `sizer(acc, batch, budget) -> (micro-batch size, what the plan said)` size micro_batch="auto"."""
    _sizers[:] = [sizer]


class BatchDoesNotFitError(AmpkitError, RuntimeError):
    """Not even a micro-batch of one fits the memory (or the out-of-memory errors did not stop)."""


def parse_micro_batch(value: Any) -> int | str | None:
    """The `micro_batch=` setting checked: None, "auto" or an int >= 1."""
    if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(
        f"micro_batch={value!r}: expected 'auto' (the largest that fits memory=, from ampkit.tools.plan), an integer "
        f">= 1 (rows per micro-batch), or None (no split)"
    )


def rows_of(batch: Any) -> int:
    """The batch size: the first dimension of the batch's first tensor with one."""
    leaves, _ = tree_flatten(batch)
    sizes = [t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not sizes:
        raise ValueError(
            f"acc.split(batch): the batch ({type(batch).__name__}) holds no tensor with a batch dimension; expected "
            f"tensors (in tuples, lists or dicts) whose first dimension is the batch"
        )
    return int(sizes[0])


def sliced(batch: Any, start: int, stop: int, rows: int) -> Any:
    """Rows `start:stop` of every tensor in `batch` whose first dimension is the batch (views, no copy)."""
    leaves, spec = tree_flatten(batch)
    cut = [t[start:stop] if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == rows else t for t in leaves]
    return tree_unflatten(cut, spec)


def tensor_bytes(batch: Any) -> int:
    leaves, _ = tree_flatten(batch)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


@dataclass
class _Attempt:
    """The micro-batch being run: its index, its rows' share of the batch, and whether it ran out of memory."""

    index: int
    share: float
    syncs: bool  # its backward all-reduces (the last of the batch, under DDP/FSDP)
    failed: bool = False


class _Start:
    """What a rerun of the batch restores: the RNG, the norm layers' running statistics, the cycle's position."""

    def __init__(self, acc: Run) -> None:
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(acc.device) if acc.device.type == "cuda" else None
        self.norms = [
            (buf, buf.clone())
            for model in acc.models
            for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats and m.training
            for buf in m.buffers(recurse=False)
        ]
        self.position = acc.cycle.mark()
        self.divisor_unset = acc.items.divisor is None

    def restore(self, acc: Run) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, acc.device)
        with torch.no_grad():
            for buf, saved in self.norms:
                buf.copy_(saved)
        acc.cycle.restart_block(self.position)
        for opt in acc.optimizers:
            opt.zero_grad(set_to_none=True)  # the attempt's gradients and item counts go
        for model in acc.models:
            model.zero_grad(set_to_none=True)
        if self.divisor_unset:
            acc.items.divisor = None


class MicroBatcher:
    """`acc.split(batch)` and the out-of-memory recovery around it (module doc)."""

    def __init__(self, acc: Run, micro_batch: int | str | None, memory: int | None) -> None:
        self.acc = acc
        self.setting = micro_batch
        self.memory = memory  # the budget in bytes, or None: the device's free memory when sized
        self.size: int | None = micro_batch if isinstance(micro_batch, int) else None
        self.halvings = 0  # after out-of-memory errors, over the run
        self.planned = ""  # what the plan said when it sized micro_batch="auto"
        self.batches = 0  # batches split so far
        self.attempt: _Attempt | None = None  # the micro-batch being run, inside a split
        self.rows = self.retries = 0  # the batch being split, and its reruns so far

    @property
    def enabled(self) -> bool:
        return self.setting is not None

    @property
    def discarding(self) -> bool:
        """The current micro-batch ran out of memory: its backward does nothing, the batch reruns."""
        return self.attempt is not None and self.attempt.failed

    def split(self, batch: Any) -> Iterator[Any]:
        """Yield `batch`'s micro-batches (module doc); one micro-step of the accumulation cycle in all."""
        if not self.enabled:  # micro_batch=None: the batch whole, as without the split
            yield batch
            return
        rows = rows_of(batch)
        self.rows, self.retries = rows, 0
        if self.size is None:
            self.size = self._sized(batch, rows)
        start = _Start(self.acc)
        cycle = self.acc.cycle
        try:
            while True:
                size = min(self.size, rows)
                count = -(-rows // size)
                with cycle.micro_batch():
                    for index in range(count):
                        last = index == count - 1
                        if last and self._distributed and not self.agreed():
                            break  # another rank ran out of memory: rerun with its size
                        lo, hi = index * size, min(rows, (index + 1) * size)
                        cycle.holding = not last  # only the last backward ends the cycle (DDP's no_sync before it)
                        self.attempt = _Attempt(index, (hi - lo) / rows, syncs=last and self._distributed)
                        try:
                            yield sliced(batch, lo, hi, rows)
                        finally:
                            cycle.holding = False
                        if self.attempt.failed:
                            break
                    else:
                        self.attempt = None
                        self.batches += 1
                        return
                self.attempt = None
                start.restore(self.acc)
        finally:  # a loop that leaves the split early (an exception, a break) leaves no attempt behind
            self.attempt = None

    def weight(self, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's mean loss as its share of the batch's mean."""
        if self.attempt is None or self.attempt.share == 1.0:
            return loss
        return loss * self.attempt.share

    def failed(self, exc: torch.OutOfMemoryError, phase: str) -> None:
        """The current micro-batch ran out of memory: halve the size for a rerun of the batch, or raise."""
        attempt, size = self.attempt, self.size
        assert attempt is not None and size is not None
        if attempt.syncs:
            raise BatchDoesNotFitError(
                f"out of memory in the {phase} of the micro-batch that all-reduces the gradients (micro-batch "
                f"{attempt.index} of {size} rows): the other ranks are in (or bound for) the all-reduce, so the batch "
                f"cannot be rerun. Start smaller: micro_batch={max(1, size // 2)}"
            ) from exc
        if size == 1 or self.retries >= max(1, math.ceil(math.log2(max(2, self.rows)))):
            raise BatchDoesNotFitError(
                f"out of memory with a micro-batch of {size} row(s) after {self.retries} halving(s) of this "
                f"batch ({self.said()}): free memory, use a smaller model or a lower-memory precision "
                f"(ampkit plan shows each one's peak)"
            ) from exc
        self.size = size // 2
        self.halvings += 1
        self.retries += 1
        attempt.failed = True
        warnings.warn(
            f"out of memory in the {phase} of micro-batch {attempt.index} (of {size} rows) of batch {self.batches}: "
            f"rerunning the batch with micro-batches of {self.size} rows ({exc.__class__.__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})",
            RuntimeWarning,
            stacklevel=4,
        )

    @staticmethod
    def release() -> None:
        """Give back what a failed attempt held, once its frames are gone."""
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def backward(self, loss: torch.Tensor, kwargs: dict[str, Any]) -> bool:
        """Run the micro-batch's backward; False if it ran out of memory (the batch reruns)."""
        try:
            loss.backward(**kwargs)
            return True
        except torch.OutOfMemoryError as exc:
            self.failed(exc, "backward")
        self.release()
        return False

    def agreed(self) -> bool:
        """Before the all-reducing micro-batch under DDP/FSDP, agree with the other ranks on the size: False when
        this rank must rerun the batch with a smaller one (another rank ran out with it); a rank already at the
        smallest waits for the others' reruns (their micro-batches before the last make no collective)."""
        assert self.size is not None
        while True:
            sizes = torch.tensor([-self.size, self.size], dtype=torch.int64, device=self.acc.device)
            dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
            low, high = (abs(int(v)) for v in sizes.tolist())  # sync: the ranks agree, once per batch
            if low == high:
                return True
            if self.size > low:
                self.size, self.halvings = low, self.halvings + 1
                return False

    @property
    def _distributed(self) -> bool:
        return self.acc.strategy != "none" and self.acc.world_size > 1

    def _sized(self, batch: Any, rows: int) -> int:
        if not _sizers:
            raise RuntimeError(
                "micro_batch='auto' is sized by ampkit.plan, which is not imported: `import ampkit.tools.plan` first "
                "(ampkit.Accelerator does it), or pass micro_batch=N"
            )
        budget = self.memory if self.memory is not None else free_memory(self.acc)
        size, self.planned = _sizers[0](self.acc, batch, budget)
        return min(size, rows)

    def said(self) -> str:
        return self.planned or f"micro_batch={self.setting!r}"

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "halvings": self.halvings, "batches": self.batches}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        if state.get("size") is not None:
            self.size = int(state["size"])
        self.halvings, self.batches = int(state.get("halvings", 0)), int(state.get("batches", 0))


def free_memory(acc: Run) -> int:
    """The default budget: the device's free memory plus what this process already holds of it (the plan counts
    the parameters and the optimizer's state it finds in place)."""
    held = sum(t.numel() * t.element_size() for m in acc.models for t in [*m.parameters(), *m.buffers()])
    if acc.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(acc.device)
        return int(free + torch.cuda.memory_reserved(acc.device))
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024 + held


class RecoveringForward:
    """A prepared model's forward that, inside `acc.split`, turns an out-of-memory error into a rerun of the batch:
    the failed micro-batch is finished without autograd, so the loop's own lines run on a normal output."""

    def __init__(self, forward: Any, micro: MicroBatcher) -> None:
        self.forward, self.micro = forward, micro

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        micro = self.micro
        if micro.attempt is None:
            return self.forward(*args, **kwargs)
        if micro.attempt.failed:  # a second forward of the failed micro-batch (two models, say)
            return self.stand_in(args, kwargs)
        try:
            return self.forward(*args, **kwargs)
        except torch.OutOfMemoryError as exc:
            micro.failed(exc, "forward")
        micro.release()  # the attempt's frames went with the exception
        try:
            return self.stand_in(args, kwargs)
        except torch.OutOfMemoryError:
            pass
        raise BatchDoesNotFitError(
            f"out of memory again running micro-batch {micro.attempt.index} without autograd in micro-batches of "
            f"{micro.size} rows after a halving: the model's weights and its activations do not fit ({micro.said()})"
        )

    def stand_in(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The failed micro-batch's output without autograd, computed in pieces of the halved size (the loop's
        loss and logging run on it; the batch reruns): batch tensors concatenated, scalars averaged by rows."""
        rows, size = rows_of((args, kwargs)), max(1, self.micro.size or 1)
        with torch.no_grad():
            parts = [
                self.forward(*a, **k)
                for a, k in (sliced((args, kwargs), i, i + size, rows) for i in range(0, rows, size))
            ]
        if len(parts) == 1:
            return parts[0]
        flat = [tree_flatten(p)[0] for p in parts]
        weights = [min(size, rows - i) / rows for i in range(0, rows, size)]
        leaves = []
        for column in zip(*flat):
            first = column[0]
            if isinstance(first, torch.Tensor) and first.dim() > 0:
                leaves.append(torch.cat(column))
            elif isinstance(first, torch.Tensor) and first.is_floating_point():
                leaves.append(sum(w * t for w, t in zip(weights, column)))
            else:
                leaves.append(first)
        return tree_unflatten(leaves, tree_flatten(parts[0])[1])

    def __reduce__(self) -> Any:
        return self.forward.__reduce__()  # torch.save(model) writes the plain module, as PolicyForward does

    def __deepcopy__(self, memo: dict[int, Any]) -> RecoveringForward:
        import copy

        return RecoveringForward(copy.deepcopy(self.forward, memo), self.micro)
