"""The `Task` contract: what a built-in task hands to `ampkit compare` and to tests.

A task is data, not a class hierarchy: a frozen record of defaults plus five plain
callables. That keeps each task a short module that reads top to bottom, and lets
`compare` run fp32 and mixed precision through exactly the same functions.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

if TYPE_CHECKING:
    from ampkit.accelerator import Accelerator
    from ampkit.engine.optim import AmpOptimizer

_METRIC_DIRECTION = {"accuracy": True, "perplexity": False}  # each supported metric: is higher better?


@dataclass(frozen=True, kw_only=True)
class TaskData:
    """One seeded instance of a task's data: a training stream and a held-out split.

    `train_loader` is shuffled with a generator seeded from the task seed, `drop_last=True` so every
    step has the same batch shape (a changing shape would skew timing and recompile under
    `torch.compile`). Re-iterable: each pass is a new epoch in a new order. The generator is consumed
    as epochs pass, so build a fresh `TaskData` per run when two runs must see the same order.
    """

    train_loader: DataLoader
    eval_inputs: Tensor  # held-out inputs on the CPU, never trained on; `evaluate` moves them itself
    eval_targets: Tensor  # targets matching `eval_inputs` row for row
    info: Mapping[str, object] = field(default_factory=dict)  # provenance for reports (split sizes, sources)


@dataclass(frozen=True, kw_only=True)
class Task:
    """A built-in training task whose data ships with the install (no downloads).

    `make_optimizer` passes no fused/foreach flags, so the precision engine stays free to choose the
    implementation; `evaluate` runs in eval mode under `no_grad`, restoring the model's previous
    train/eval mode afterwards.
    """

    name: str  # registry key, used on the command line (`ampkit compare --task NAME`)
    description: str  # one line for `--help` and reports: the model, the data and the regime it probes
    metric: str  # headline metric `evaluate` returns: "accuracy" or "perplexity"
    higher_is_better: bool  # direction of `metric`, so a report can say which run won
    default_steps: int  # enough that fp32 clearly learns, few enough for a short CPU compare
    default_batch_size: int  # what the defaults were measured with; `make_data` accepts others
    default_lr: float  # converges at the default steps and batch size
    make_model: Callable[[int], nn.Module]  # (seed): a fresh fp32 CPU model, bitwise the same per seed
    make_data: Callable[[int, int], TaskData]  # (seed, batch_size): the data, in an order fixed by the seed
    make_optimizer: Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer]  # (params, lr)
    loss_fn: Callable[[Tensor, Tensor], Tensor]  # (output, target): a scalar loss, computed in fp32
    evaluate: Callable[[nn.Module, TaskData, torch.device | str], dict[str, float]]  # held-out metrics

    def __post_init__(self) -> None:
        if self.metric not in _METRIC_DIRECTION:
            raise ValueError(
                f"task {self.name!r}: unknown metric {self.metric!r}; "
                f"choose one of: {', '.join(sorted(_METRIC_DIRECTION))}"
            )
        if self.higher_is_better != _METRIC_DIRECTION[self.metric]:
            raise ValueError(
                f"task {self.name!r}: higher_is_better={self.higher_is_better} contradicts metric {self.metric!r}"
            )
        for key in ("default_steps", "default_batch_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"task {self.name!r}: {key} must be a positive int, got {value!r}")
        if not self.default_lr > 0:
            raise ValueError(f"task {self.name!r}: default_lr must be > 0, got {self.default_lr!r}")

    def training(
        self, acc: Accelerator, model: nn.Module, optimizer: AmpOptimizer, loader: Iterable[tuple[Tensor, Tensor]]
    ) -> Iterator[None]:
        """The task's plain loop with ampkit's four-line conversion (`model`, `optimizer` and `loader` as
        `acc.prepare` returned them): one item per optimizer step, epoch after epoch, for as long as the
        caller iterates (or until a listener raises from inside the step)."""
        for _ in acc.epochs(sys.maxsize):
            for x, y in loader:
                acc.backward(self.loss_fn(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                yield


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch's global CPU generator for a block, then put the caller's state back: module init
    becomes a function of `seed` alone without disturbing the caller's random stream."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def seeded_generator(seed: int) -> torch.Generator:
    """A private CPU generator for data order, independent of the global one."""
    return torch.Generator().manual_seed(seed)


def check_batch_size(task: str, batch_size: int, n_train: int) -> None:
    """Refuse a batch size that would give no full batch (drop_last would yield nothing)."""
    if not isinstance(batch_size, int) or not 1 <= batch_size <= n_train:
        raise ValueError(
            f"task {task!r}: batch_size={batch_size!r} must be an int in [1, {n_train}] "
            f"(the training split has {n_train} examples)"
        )


def input_dtype(model: nn.Module) -> torch.dtype | None:
    """The floating dtype the model's parameters are stored in, or None without any: evaluation casts
    float inputs to it, so a model kept in bf16/fp16 runs without autocast (fp32 changes nothing)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
