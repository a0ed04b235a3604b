"""Data parallelism on PyTorch's own engine: torchrun's environment, the process group (NCCL on CUDA,
Gloo on a CPU, torn down at exit), DDP and FSDP2 wrapping, sharded DataLoaders, and the few things ranks
must agree on (the overflow flag, tracked metrics), reduced on the device.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import inspect
import io
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from ampkit.errors import PrecisionError, StepOrderError
from ampkit.util import validate as check

#: The longest ampkit waits at exit for the other ranks (shorter where Accelerator(timeout=) is).
EXIT_WAIT_S = 60.0


@dataclass(frozen=True)
class DistributedContext:
    """This process's place in the job, read from torchrun's environment variables."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @classmethod
    def from_env(cls) -> DistributedContext:
        """RANK / LOCAL_RANK / WORLD_SIZE as torchrun sets them; a single process without them."""
        try:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            rank = int(os.environ.get("RANK", "0"))
            local = int(os.environ.get("LOCAL_RANK", str(rank)))
        except ValueError as exc:
            raise ValueError(f"RANK/LOCAL_RANK/WORLD_SIZE must be integers (as torchrun sets them): {exc}") from None
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"RANK={rank} and WORLD_SIZE={world} are inconsistent: expected 0 <= RANK < WORLD_SIZE")
        return cls(rank=rank, local_rank=local, world_size=world)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def device_for(self, device: str | torch.device) -> str | torch.device:
        """The device this rank trains on: under torchrun, "auto" or "cuda" means its own GPU (local rank modulo
        the GPUs); anything else, and a single process, as given."""
        if self.enabled and str(device) in ("auto", "cuda") and torch.cuda.is_available():
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return device

    def init(self, device: torch.device, backend: str | None, timeout: float | None = None) -> None:
        """Create the default process group (if torchrun did not; collectives wait `timeout` seconds, None:
        torch's default) and destroy it at exit."""
        if not self.enabled or dist.is_initialized():
            return
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # torchrun's store outlives a worker restart; keys of the failed attempt (a dead rank's
        # address) would be read again, so each attempt gets its own namespace in the store.
        store, _, _ = next(dist.rendezvous("env://", self.rank, self.world_size))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"ampkit/attempt-{attempt}", store)
        wait = None if timeout is None else datetime.timedelta(seconds=timeout)  # None: torch's default
        dist.init_process_group(backend=backend, store=store, rank=self.rank, world_size=self.world_size, timeout=wait)
        atexit.register(_destroy, min(timeout or EXIT_WAIT_S, EXIT_WAIT_S))


class RankMethods:
    """The rank queries and helpers of an object holding a `distributed` context (the Accelerator's)."""

    distributed: DistributedContext

    @property
    def rank(self) -> int:
        """This process's rank (0 without torchrun)."""
        return self.distributed.rank

    @property
    def world_size(self) -> int:
        """The number of processes training together (1 without torchrun)."""
        return self.distributed.world_size

    @property
    def local_rank(self) -> int:
        return self.distributed.local_rank

    @property
    def is_main(self) -> bool:
        """True on rank 0: the process that prints, writes reports and writes checkpoints."""
        return self.distributed.rank == 0

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on rank 0 only."""
        if self.is_main:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """A barrier across ranks (a no-op in a single process)."""
        barrier()


def choose_strategy(ctx: DistributedContext, strategy: str, precision: str, keep_fp32: Any) -> str:
    """What `Accelerator(strategy=...)` means here: "none" in one process, else "ddp" or "fsdp"."""
    if not ctx.enabled or strategy == "none":
        return "none"
    if strategy == "fsdp" and (precision not in FSDP_PRESETS or keep_fp32):
        raise PrecisionError(
            f"strategy='fsdp' runs the presets {', '.join(FSDP_PRESETS)} (FSDP's sharded fp32 parameters are the "
            f"master weights) without keep_fp32; got precision={precision!r}"
            + (f", keep_fp32={list(keep_fp32)!r}" if keep_fp32 else "")
        )
    return "fsdp" if strategy == "fsdp" else "ddp"


def check_backend(backend: Any) -> None:
    """`Accelerator(backend=)`: None, or a process-group backend torch knows ("gloo", "nccl", ..., or
    torch's per-device form "cpu:gloo,cuda:nccl"), refused before any process group is made."""
    if backend is None:
        return
    known = [b for b in dist.Backend.backend_list if b != "undefined"] if dist.is_available() else []
    expected = f"None (nccl on CUDA, gloo on a CPU) or one of {', '.join(known)}"
    if not isinstance(backend, str):
        raise TypeError(f"backend={backend!r}: expected {expected}")
    parts = [part.split(":")[-1].strip().lower() for part in backend.split(",")]
    if unknown := [p for p in parts if p not in known]:
        raise ValueError(
            f"backend={backend!r}: unknown backend {unknown[0]!r}; expected {expected}"
            f"{check.suggest(unknown[0], known)}"
        )


def _destroy(wait_s: float) -> None:
    """At exit: leave the process group, waiting for the other ranks only where that cannot hang."""
    if not _active():
        return
    # An uncaught exception ended this rank (Python sets sys.last_value before the atexit handlers run): its
    # peers are inside a collective this rank will never join, so waiting for them would hang the whole job.
    # Leaving at once makes this process exit non-zero, and torchrun then stops the other ranks.
    failed = getattr(sys, "last_value", None) is not None
    if not failed and dist.get_backend() == "gloo":
        # Leave together: a rank tearing down its connections while a peer still uses them makes gloo
        # abort that peer ("terminate called without an active exception"). Bounded: a peer that never
        # comes (it called sys.exit, or still trains on more batches) costs at most `wait_s`.
        with contextlib.suppress(Exception):  # a peer is already gone, or late: nothing left to wait for
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=wait_s))
    dist.destroy_process_group()


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def wrap_ddp(model: nn.Module, device: torch.device) -> nn.parallel.DistributedDataParallel:
    """DDP over `model` on this rank's device. A script converted from its own DDP code may still wrap
    the result in a DDP of its own (both would all-reduce): the first forward looks for one and raises."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise StepOrderError(_NESTED.format(where="prepare() got a model already wrapped in DistributedDataParallel"))
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    NestedDDPCheck(ddp)
    return ddp


_NESTED = (
    "{where}: under torchrun ampkit wraps the model in DDP itself, so two DDPs would all-reduce every "
    "gradient. Drop the script's own DDP(model) line (acc.unwrap(model) is the plain module, as "
    "model.module was), or pass strategy='none' to keep the script's DDP"
)


class NestedDDPCheck:
    """A one-time forward pre-hook on ampkit's DDP: raise if the script's own DDP encloses it."""

    def __init__(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        self.ddp, self.handle = ddp, ddp.register_forward_pre_hook(self)

    def __call__(self, module: nn.Module, _inputs: Any) -> None:
        self.handle.remove()  # the wrapping is fixed once the loop runs: one look is enough
        ours = {id(p) for p in self.ddp.parameters()}
        frame = inspect.currentframe()
        while frame is not None:  # the callers' frames: an enclosing DDP's forward is one of them
            outer = frame.f_locals.get("self")
            if (
                isinstance(outer, nn.parallel.DistributedDataParallel)
                and outer is not self.ddp
                and any(id(p) in ours for p in outer.parameters())
            ):
                raise StepOrderError(
                    _NESTED.format(where="the prepared model runs inside another DistributedDataParallel")
                )
            frame = frame.f_back


def shard_loader(loader: DataLoader, ctx: DistributedContext) -> DataLoader:
    """A copy of `loader` whose sampler gives this rank its share of every epoch. Sequential stays
    sequential (rank r takes samples r, r+W, ...); a random sampler becomes a shuffling DistributedSampler
    seeded from the loader's generator, so every rank agrees on the epoch's permutation."""
    if isinstance(loader.dataset, IterableDataset):
        warnings.warn(
            "an IterableDataset cannot be sharded by ampkit: make it yield this rank's share "
            "(acc.rank, acc.world_size)",
            stacklevel=3,
        )
    if isinstance(loader.sampler, DistributedSampler) or isinstance(loader.dataset, IterableDataset):
        return loader
    sampler = loader.sampler
    if not isinstance(sampler, (RandomSampler, SequentialSampler)) or loader.batch_sampler is None:
        raise ValueError(
            f"prepare() cannot shard a DataLoader with a {type(sampler).__name__} across {ctx.world_size} ranks; "
            f"give it a DistributedSampler yourself (it is then left as it is)"
        )
    shuffle = isinstance(sampler, RandomSampler)
    generator = getattr(sampler, "generator", None) or loader.generator
    seed = generator.initial_seed() if shuffle and generator is not None else 0
    dist_sampler: DistributedSampler[Any] = DistributedSampler(
        loader.dataset,
        num_replicas=ctx.world_size,
        rank=ctx.rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=loader.drop_last,
    )
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=dist_sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        persistent_workers=loader.persistent_workers,
        prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
    )


def agree_on_overflow(found_inf: torch.Tensor) -> None:
    """Make `found_inf` the max over all ranks, on the device: every rank skips the same steps."""
    if _active():
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)


def sum_across_ranks(t: torch.Tensor) -> torch.Tensor:
    if _active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (tensors and plain data), in rank order; a list of one without a group. They
    travel as `torch.save` bytes (all_gather_object cannot carry tensors' storages on every backend)
    and come back through `torch.load(weights_only=True)`."""
    if not _active():
        return [obj]
    buf = io.BytesIO()
    torch.save(obj, buf)
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, buf.getvalue())
    return [torch.load(io.BytesIO(b), weights_only=True) for b in out]


def barrier() -> None:
    if _active():
        dist.barrier()


#: Presets FSDP2 can carry: its sharded fp32 parameters are the master weights, and its
#: MixedPrecisionPolicy casts them to the compute dtype for forward and backward.
FSDP_PRESETS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "fp8-mixed")


def wrap_fsdp(model: nn.Module, compute_dtype: torch.dtype) -> tuple[nn.Module, dict[int, nn.Parameter]]:
    """Shard `model` with FSDP2 `fully_shard` (each of `fsdp_units` a unit, then the root); return it (the
    same object) and a map from each old parameter's id to its sharded replacement (re-points optimizers)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    old = dict(model.named_parameters())
    low = compute_dtype != torch.float32  # gradients are averaged in fp32: no precision lost across ranks
    mp = MixedPrecisionPolicy(
        param_dtype=compute_dtype if low else None,
        reduce_dtype=torch.float32,
        output_dtype=torch.float32 if low else None,
    )
    for unit in fsdp_units(model):
        fully_shard(unit, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    new = dict(model.named_parameters())
    return model, {id(p): new[name] for name, p in old.items() if name in new}


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules `wrap_fsdp` shards as units of their own (each all-gathered whole while it runs): every
    top-level block, a ModuleList's or ModuleDict's items one by one, that has trainable parameters."""
    units: list[nn.Module] = []
    for child in model.children():
        units.extend(child.children() if isinstance(child, (nn.ModuleList, nn.ModuleDict)) else [child])
    return [u for u in units if any(p.requires_grad for p in u.parameters())]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t
