"""`DeviceLoader`: a user's DataLoader whose batches (nested structures) arrive on the training device;
on CUDA from pinned memory, the next batch copied without blocking while the current one trains.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

from ampkit.engine.distributed import gather_objects
from ampkit.engine.events import Events, Listener


def move_to_device(
    obj: Any, device: torch.device, non_blocking: bool = False, memory_format: torch.memory_format | None = None
) -> Any:
    """Return `obj` with every tensor inside it (tuples, lists, dicts, dataclasses, namedtuples) on `device`;
    with `memory_format` (channels_last), 4-D floating tensors (image batches) laid out in it by the copy."""
    if isinstance(obj, torch.Tensor):
        if memory_format is not None and obj.dim() == 4 and obj.is_floating_point():
            return obj.to(device, non_blocking=non_blocking, memory_format=memory_format)
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, Mapping):
        moved = {k: move_to_device(v, device, non_blocking, memory_format) for k, v in obj.items()}
        return type(obj)(moved)  # type: ignore[call-arg]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(move_to_device(v, device, non_blocking, memory_format) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_to_device(v, device, non_blocking, memory_format) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = [f.name for f in dataclasses.fields(obj) if f.init]
        return dataclasses.replace(
            obj, **{n: move_to_device(getattr(obj, n), device, non_blocking, memory_format) for n in names}
        )
    return obj


class DeviceLoader:
    """A DataLoader whose batches arrive on `device`: the wrapped loader's batches in its order; attribute
    access (`dataset`, `batch_size`, ...) goes to it. It keeps its place (the epoch, the batches handed out
    in it, the random state its shuffle started from): a checkpoint resumes mid-epoch at the next batch."""

    def __init__(
        self,
        loader: DataLoader,
        device: torch.device,
        memory_format: torch.memory_format | None = None,
        events: Events | None = None,
        stop: Callable[[], bool] | None = None,
        ranks_step_together: bool = False,
        before_batch: Callable[[int], None] | None = None,
    ) -> None:
        self.loader = loader
        # told the batches left in a training pass (this one included) before each is handed out: the
        # accumulation cycle then ends the pass's last, short cycle with its last batch (epoch_end)
        self.before_batch = before_batch
        self._length: int | None = None  # the current pass's batches, where the loader has a length
        # under DDP/FSDP: every training pass first checks that each rank has as many batches
        self.ranks_step_together = ranks_step_together
        self.stop = stop  # true once a training pass (autograd on) should end: the launcher's AMPKIT_MAX_STEPS
        self.events = events if events is not None else Events()
        self.device = device
        self.memory_format = memory_format  # channels_last for image batches, or None
        self._cuda = device.type == "cuda"
        if self._cuda and not loader.pin_memory and loader.num_workers == 0:
            loader.pin_memory = True  # the host→device copy then runs without blocking the host
        self.epoch = 0  # passes started before the current one
        self.batch_index = 0  # batches handed out in the current pass
        self._finished = False  # the current pass ran to its end
        self._started = False
        self._epoch_rng: dict[str, torch.Tensor] = {}  # random state at the start of the current pass
        self._resume: tuple[int, dict[str, torch.Tensor]] | None = None  # (batches to skip, rng to replay)

    def _generators(self) -> dict[str, torch.Generator]:
        found: dict[str, torch.Generator] = {}
        for name, owner in (
            ("loader", self.loader),
            ("sampler", getattr(self.loader, "sampler", None)),
            ("batch_sampler", getattr(getattr(self.loader, "batch_sampler", None), "sampler", None)),
        ):
            gen = getattr(owner, "generator", None)
            if isinstance(gen, torch.Generator) and all(gen is not g for g in found.values()):
                found[name] = gen
        return found

    def _capture_rng(self) -> dict[str, torch.Tensor]:
        generators = {name: gen.get_state() for name, gen in self._generators().items()}
        return {"global": torch.get_rng_state(), **generators}

    def _restore_rng(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["global"])
        for name, gen in self._generators().items():
            if name in state:
                gen.set_state(state[name])

    def __iter__(self) -> Iterator[Any]:
        resume, self._resume = self._resume, None
        if resume is None and self._started:
            self.epoch += 1
        # A resumed pass replays its start's random state, pulling the batches it had handed out under it
        # (a sampler without a generator draws its seed at the first batch; the pass's generators must end
        # where they did); everything after continues from the checkpoint's state (fork_rng restores it).
        with torch.random.fork_rng(devices=[]) if resume else contextlib.nullcontext():
            if resume:
                self._restore_rng(resume[1])
            self._epoch_rng = resume[1] if resume else self._capture_rng()
            self._set_sampler_epoch()
            if self.ranks_step_together and torch.is_grad_enabled():
                self._check_even()
            it = iter(self.loader)
            self._length = _length_of(self.loader) if self.before_batch is not None else None
            self._started, self._finished, self.batch_index = True, False, 0
            for _ in range(resume[0] if resume else 0):
                if next(it, _END) is _END:
                    break
                self.batch_index += 1
        yield from self._on_device(it)
        self._finished = True

    def _check_even(self) -> None:
        """Refuse a training pass whose ranks have different numbers of batches, on every rank at once: the
        rank that ran out would leave while the others wait in the gradient all-reduce, for ever."""
        mine = _length_of(self.loader)  # None: an iterable dataset without a length, nothing to compare
        # sync: one gather of a host int per training pass, before its first batch (every rank joins it,
        # also one whose loader has no length, so no rank waits alone)
        counts = gather_objects(mine)
        if None not in counts and len(set(counts)) > 1:
            per_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
            raise ValueError(
                f"the prepared DataLoader has a different number of batches on each rank ({per_rank}); under "
                f"DDP/FSDP every rank must take the same steps, or the ranks wait for each other for ever. Let "
                f"prepare() shard the loader (each rank then gets the same count), or give your "
                f"DistributedSampler the same num_replicas as the world size ({len(counts)})"
            )

    def _next(self, it: Iterator[Any]) -> Any:
        """The user's loader's next batch (`_END` at the end of the pass), with the batch-wait events."""
        if self.stop is not None and torch.is_grad_enabled() and self.stop():
            return _END
        events = self.events
        if not events.listeners:
            return next(it, _END)
        events.emit(Listener.on_batch_wait_start, self)
        batch = next(it, _END)
        if batch is not _END:
            events.emit(Listener.on_batch_wait_end, self, batch)
        return batch

    def _move(self, batch: Any, non_blocking: bool) -> Any:
        events = self.events
        if not events.listeners:
            return move_to_device(batch, self.device, non_blocking, self.memory_format)
        events.emit(Listener.on_h2d_start, self, batch)
        moved = move_to_device(batch, self.device, non_blocking, self.memory_format)
        events.emit(Listener.on_h2d_end, self, moved)
        return moved

    def _tell_left(self) -> None:
        """Before a batch is handed out (batch_index counts it): tell `before_batch` how many are left."""
        if self._length is not None and self.before_batch is not None and torch.is_grad_enabled():
            self.before_batch(self._length - self.batch_index + 1)

    def _on_device(self, it: Iterator[Any]) -> Iterator[Any]:
        if not self._cuda:
            while (batch := self._next(it)) is not _END:
                self.batch_index += 1
                self._tell_left()
                yield self._move(batch, False)
            return
        # One batch ahead: its copy overlaps the current step's compute.
        batch = self._next(it)
        if batch is _END:
            return
        ahead = self._move(batch, True)
        while (batch := self._next(it)) is not _END:
            current, ahead = ahead, self._move(batch, True)
            self.batch_index += 1
            self._tell_left()
            yield current
        self.batch_index += 1
        self._tell_left()
        yield ahead

    def set_epoch(self, epoch: int) -> None:
        """Declare the pass about to start (`acc.epochs` calls it); forwarded to the sampler."""
        self.epoch = epoch
        self._started = False
        self._set_sampler_epoch()

    @property
    def epoch_done(self) -> bool:
        """The current pass ran to its end."""
        return self._started and self._finished

    @property
    def resuming(self) -> bool:
        """The next pass continues an interrupted one (a checkpoint was loaded)."""
        return self._resume is not None

    def _set_sampler_epoch(self) -> None:
        set_epoch = getattr(getattr(self.loader, "sampler", None), "set_epoch", None)
        if set_epoch is not None:
            set_epoch(self.epoch)  # DistributedSampler: a new shuffle per epoch

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is: epoch, batches handed out, the pass's starting random state, and its
        generators' state now (a finished pass is not replayed: the next one starts from that)."""
        return {
            "epoch": self.epoch,
            "batch_index": self.batch_index,
            "finished": self._finished,
            "started": self._started,
            "epoch_rng": dict(self._epoch_rng),
            "generators": {name: gen.get_state() for name, gen in self._generators().items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Arrange for the next pass to resume exactly where `state` was taken."""
        self.epoch, self.batch_index = int(state["epoch"]), int(state["batch_index"])
        self._started, self._finished = bool(state["started"]), bool(state["finished"])
        if self._started and not self._finished and state["epoch_rng"]:
            self._resume = (self.batch_index, dict(state["epoch_rng"]))
        elif self._started and self._finished:
            self._resume = None  # the pass ended: the next one starts fresh, from the generators' end state
            for name, gen in self._generators().items():
                if name in state.get("generators", {}):
                    gen.set_state(state["generators"][name])

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (during unpickling): avoid infinite recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __repr__(self) -> str:
        return f"DeviceLoader({self.loader!r}, device={self.device})"


_END = object()


def _length_of(loader: DataLoader) -> int | None:
    """`len(loader)`, or None for an iterable dataset without a length."""
    try:
        return len(loader)
    except TypeError:
        return None


class EpochCounter:
    """The epoch `acc.epochs()` is in (saved with checkpoints), over the prepared loaders it sets each epoch."""

    def __init__(self, loaders: list[DeviceLoader]) -> None:
        self.loaders, self.current = loaders, 0

    def run(self, n: int, spent: Callable[[], bool]) -> Iterator[int]:
        """`acc.epochs(n)`: the epochs still to run; `spent()` is true once the launcher's step limit is."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"epochs({n!r}): expected an integer >= 0")
        start = self.current
        if self.loaders and all(loader.epoch_done and loader.epoch == start for loader in self.loaders):
            start += 1  # the checkpoint was taken after the saved epoch's last batch
        for epoch in range(start, n):
            if spent():  # AMPKIT_MAX_STEPS: the launcher's limit is spent
                return
            self.current = epoch
            for loader in self.loaders:
                if not loader.resuming or loader.epoch != epoch:
                    loader.set_epoch(epoch)
            yield epoch
        self.current = max(n, start)
