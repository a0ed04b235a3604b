"""`Accelerator`: the four-line conversion of an ordinary PyTorch training loop.

```python
acc = ampkit.Accelerator(precision="auto")
model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
for x, y in loader:
    loss = loss_fn(model(x), y)
    acc.backward(loss)          # was: loss.backward()
    optimizer.step(); scheduler.step(); optimizer.zero_grad()
```
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampkit import checkpoint
from ampkit.config import CONFIG_FIELDS, AcceleratorConfig
from ampkit.engine.compiler import CompileStats, CompileTrial, compile_setup
from ampkit.engine.cycle import AccumulationCycle, warn_pending_at_exit
from ampkit.engine.data import DeviceLoader, EpochCounter
from ampkit.engine.distributed import DistributedContext, RankMethods, choose_strategy, gather_objects, sum_across_ranks
from ampkit.engine.events import Events, Listener, created
from ampkit.engine.items import ItemWeights
from ampkit.engine.launch import check_metric, launch_settings, max_steps_reached
from ampkit.engine.loss_check import loss_problem, needs_check
from ampkit.engine.metrics import MetricTracker
from ampkit.engine.micro import MicroBatcher
from ampkit.engine.optim import AmpOptimizer
from ampkit.engine.optim_state import fp32_state_dict
from ampkit.engine.prepare import Prepared
from ampkit.engine.scheduler import AmpScheduler
from ampkit.engine.tracking import start_tracking
from ampkit.engine.training_state import TrainingState
from ampkit.engine.wiring import Wiring, unwrap
from ampkit.errors import LossError
from ampkit.hardware.capability import resolve_device
from ampkit.inference import export
from ampkit.precision.fp8 import MIN_WEIGHT, fp8_training
from ampkit.precision.keep import KeepSpec
from ampkit.precision.policy import Precision, resolve_precision
from ampkit.precision.scaler import LossScaler, scaler_for
from ampkit.util import validate as check


class Accelerator(RankMethods):
    """Mixed-precision training on the right device, with gradient accumulation. Launch-time settings
    (`ampkit.engine.launch`: AMPKIT_* variables) fill what is not passed.

    The keywords (and `scaler=`, a custom `LossScaler` for the fp16 presets) are documented on
    `ampkit.AcceleratorConfig`, which holds them checked and frozen as `acc.config`.
    """

    def __init__(
        self,
        precision: str | Precision = "auto",
        grad_accum_steps: int | None = None,
        device: str | torch.device = "auto",
        *,
        scaler: LossScaler | None = None,
        keep_fp32: KeepSpec = (),
        step_scheduler_with_optimizer: bool = True,
        strategy: str = "auto",
        backend: str | None = None,
        timeout: float | datetime.timedelta | None = None,
        compile: bool | Mapping[str, Any] | None = None,
        channels_last: bool = False,
        cuda_graphs: bool = False,
        free_step_buffers: bool | None = None,
        cast_outputs: bool = True,
        divide_loss: bool | None = None,
        epoch_end: str = "step",
        fp8_recipe: str | None = None,
        fp8_emulate: bool = False,
        fp8_min_weight: int = MIN_WEIGHT,
        micro_batch: int | str | None = None,
        memory: str | int | None = None,
        log_to: str | Sequence[str] | None = None,
        log_every: int = 50,
        log_dir: str | Path = "runs/ampkit",
    ) -> None:
        settings = {name: value for name, value in locals().items() if name in CONFIG_FIELDS}  # all but scaler
        # What the script did not pass comes from the launcher (AMPKIT_* variables, `ampkit.engine.launch`).
        given = {"precision": precision, "grad_accum_steps": grad_accum_steps, "compile": compile}
        chosen = launch_settings(given)
        self.max_steps = chosen["max_steps"]
        if scaler is not None and not isinstance(scaler, LossScaler):
            raise TypeError(f"scaler={scaler!r}: expected an ampkit.LossScaler")
        self.config = config = AcceleratorConfig(**{**settings, **{name: chosen[name] for name in given}})
        self.distributed = DistributedContext.from_env()
        self.device = resolve_device(self.distributed.device_for(device))  # under torchrun: this rank's GPU
        rank0 = self.distributed.rank == 0
        self.policy = resolve_precision(config.precision, self.device, fp8_emulate=fp8_emulate, announce=rank0)
        self.fp8 = fp8_training(self.policy, fp8_recipe, fp8_emulate, fp8_min_weight)  # None unless fp8-mixed
        self.distributed.init(self.device, backend, config.timeout_s)
        self.strategy = choose_strategy(self.distributed, strategy, self.policy.name, config.keep_fp32)
        self.scaler = scaler_for(self.policy, scaler, self.device)  # None unless the preset scales the loss
        self.cycle = AccumulationCycle(config.grad_accum_steps, self.scaler, divide_loss, epoch_end)
        warn_pending_at_exit(self.cycle)
        # acc.backward(loss_sum, num_items=n): ampkit's DDP/FSDP average gradients over the ranks, a count sums them
        self.items = ItemWeights(self.device, self.world_size if self.strategy != "none" else 1)
        self.events = Events()  # listeners: ampkit.engine.events.Listener
        self.compile_options = compile_setup(self.device, config.compile, cuda_graphs)  # torch.compile kwargs
        self.cuda_graphs = cuda_graphs and self.compile_options is not None
        self.compile_stats = CompileStats()
        # eager or compiled? A listener of the events from the first compiled forward
        self.compile_trial = CompileTrial(
            self.compile_stats, self.device, self.events, config.compile, self.cuda_graphs
        )
        start_tracking(self.events, config.log_to, config.log_every, config.log_dir, self.distributed.rank)
        self.micro = MicroBatcher(self, config.micro_batch, config.memory_bytes)  # acc.split(batch)
        if free_step_buffers is None:  # measured: benchmarks/RESULTS.md, "free_step_buffers"
            free_step_buffers = not (self.device.type == "cpu" and self.policy.master_weights)
        self.free_step_buffers = free_step_buffers  # resolved here; the other settings: acc.config.x only
        self._prepared = Prepared(
            Wiring(
                policy=self.policy,
                device=self.device,
                cycle=self.cycle,
                scaler=self.scaler,
                events=self.events,
                items=self.items,
                strategy=self.strategy,
                distributed=self.distributed,
                micro=self.micro,
                fp8=self.fp8,
                compile_options=self.compile_options,
                compile_trial=self.compile_trial,
                cuda_graphs=self.cuda_graphs,
                settings=config.prepare_settings(free_step_buffers, self.max_steps),
            )
        )
        self.state = TrainingState(self._prepared.optimizers, self.scaler)
        self._epochs = EpochCounter(self._prepared.loaders)  # acc.epochs(), acc.epoch
        # One training run, across resumes and ranks (rank 0's id): a checkpoint folder belongs to one run.
        self.run_id = gather_objects(uuid.uuid4().hex)[0] if self.distributed.enabled else uuid.uuid4().hex
        self._metrics = MetricTracker()
        created(self)

    def prepare(self, *objs: Any) -> Any:
        """Prepare models, optimizers, DataLoaders and LR schedulers; return them in the same order.
        Models first (whatever the order given), so an optimizer finds its model's parameters
        already in their training dtype. One object in, one object out; several in, a tuple out."""
        out = self._prepared.prepare(*objs)
        if self.fp8 is not None:  # how many layers fp8 converts is known once its models are prepared
            self.policy = dataclasses.replace(self.policy, reason=self.fp8.reason)
        return out

    def backward(self, loss: torch.Tensor, *, num_items: int | torch.Tensor | None = None, **kwargs: Any) -> None:
        """`loss.backward()` with loss scaling and gradient accumulation (the loop's one changed line).

        With `grad_accum_steps=k` the loss is divided by k (a mean over the cycle's micro-batches). For batches of
        different sizes (padded or packed sequences) pass the *summed* loss and the items it sums over,
        `acc.backward(loss_sum, num_items=n_tokens)`: the optimizer then divides the accumulated gradient by the
        items of the whole cycle, across ranks, on the device (`ampkit.engine.items`). Each backward is one micro-batch,
        or all of them inside one `with acc.accumulate():` block (a micro-batch with several losses).
        A backward that raises (a loss without grad, say) does not count as a micro-step."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"acc.backward(loss) expects the loss tensor the model's output produced; "
                f"got a {type(loss).__name__} ({loss!r})"
            )
        micro = self.micro
        if micro.discarding:  # inside acc.split, this micro-batch ran out of memory: the batch reruns
            return
        if needs_check(loss, kwargs):  # metadata only: autograd would raise, without saying which mistake
            raise LossError(loss_problem(loss, self._prepared.models))
        self._prepared.check_backward(num_items is not None)
        if self.events.listeners:
            self.events.emit(Listener.on_backward_start, self, loss)
        items = None
        if num_items is None:
            loss = self.cycle.micro_loss(micro.weight(loss))
        else:
            items = self.items.count(num_items, prepared=bool(self._prepared.optimizers))
            loss = self.items.divide(loss, items)
        unscaled = loss.detach()  # kept by the optimizers: it explains a collapse or names a NaN step
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        if micro.attempt is not None:
            if not micro.backward(loss, kwargs):  # out of memory: the batch reruns with smaller micro-batches
                return
        else:
            loss.backward(**kwargs) if kwargs else loss.backward()  # a call through an empty **{} costs ~0.5 µs
        self._prepared.backward_done(unscaled, items)  # the first checks that the loss reached a prepared weight
        if self.events.listeners:
            self.events.emit(Listener.on_backward_end, self)

    def accumulate(self) -> contextlib.AbstractContextManager[None]:
        """One micro-batch, however many `acc.backward` calls it makes (several losses or models):
        ```python
        with acc.accumulate():
            acc.backward(loss0, retain_graph=True)
            acc.backward(loss1)
            opt0.step(); opt1.step()
        ```
        Without it each `acc.backward` is one micro-batch of `grad_accum_steps`."""
        return self.cycle.micro_batch()

    def split(self, batch: Any) -> Iterator[Any]:
        """`batch`'s micro-batches, `micro_batch=` rows each (`ampkit.engine.micro`): the optimizer steps on the whole
        batch's gradient, and an out-of-memory error halves the size and reruns the batch.
        ```python
        for mx, my in acc.split((x, y)):
            acc.backward(loss_fn(model(mx), my))
        optimizer.step()
        ```"""
        self._prepared.require("split")
        return self.micro.split(batch)

    @property
    def micro_batch_size(self) -> int | None:
        """The rows per micro-batch `acc.split` uses (None before `micro_batch="auto"` sized the first batch)."""
        return self.micro.size

    @property
    def sync_gradients(self) -> bool:
        """Whether the latest backward completed an accumulation cycle (the optimizer will step)."""
        return self.cycle.at_end

    def end_cycle(self) -> bool:
        """Close the accumulation cycle now, short, for a loop without a prepared loader (which closes its
        passes' last cycles itself): True if micro-batches were pending, so `optimizer.step()` applies them
        (divided by their real number, unless `epoch_end="step_as_accelerate"`). Single process only."""
        return self.cycle.close(synced_per_cycle=self.strategy != "none")

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        parameters: Any = None,
    ) -> torch.Tensor | None:
        """Clip the unscaled gradients of the prepared optimizers (or models, with none); return the total
        norm (on the device), summed in model-parameter order as `clip_grad_norm_(model.parameters())`.
        `optimizer=opt` unscales and clips only that optimizer's gradients (`scaler.unscale_(opt)` and a clip of
        its parameters); `parameters=model.parameters()` only those parameters (and unscales their optimizers).
        On an overflowing step it is inf/NaN and the step is skipped; on a micro-step that does not end
        an accumulation cycle it does nothing and returns None, so the loop needs no `if` around it."""
        return self._prepared.clip(max_norm, norm_type, optimizer, parameters)

    def unscaled_grads(
        self, optimizer: torch.optim.Optimizer | None = None
    ) -> contextlib.AbstractContextManager[list[nn.Parameter]]:
        """`with acc.unscaled_grads() as params:` what the optimizers (or `optimizer`) update, each `.grad` the
        unscaled gradient this step applies, in the update's dtype: the model's parameters, the -master presets'
        fp32 masters, or fp32 copies of bf16-true's weights. For any clip (timm's `adaptive_clip_grad(params)`,
        `clip_grad_value_`) where `clip_grad_norm_` goes; change `.grad` in place. Mid-cycle: an empty list."""
        return self._prepared.clip.unscaled_grads(optimizer)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """The policy's autocast, for computation outside the prepared model (e.g. a loss)."""
        return self.policy.autocast_region(self.device)

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write the whole training state to one file, atomically (replacing only a checkpoint ampkit wrote,
        unless `overwrite=True`). Under torchrun call it on every rank: rank 0 writes, all return once durable."""
        return checkpoint.save(self, check.path("acc.save", "path", path, "the checkpoint file", "ckpt.pt"), overwrite)

    def load(self, path: str | Path) -> None:
        """Restore the whole training state from `path`; `CheckpointError` if it is missing or broken."""
        path = check.path("acc.load", "path", path, "a checkpoint file", "ckpt.pt")
        self._prepared.require("load")
        checkpoint.load(self, path)

    def save_checkpoint(self, folder: str | Path, keep: int = 3) -> Path:
        """Save `folder/step-<applied steps>.pt`, point `folder/latest` at it, keep the newest `keep`."""
        folder = check.path("acc.save_checkpoint", "folder", folder, "the checkpoint folder", "checkpoints")
        return checkpoint.save_checkpoint(self, folder, keep)

    def resume(self, folder: str | Path) -> Path | None:
        """Load the newest valid checkpoint in `folder` (skipping broken ones with a warning); return its
        path, or None on a fresh start: call it unconditionally before the loop. A folder whose
        checkpoints all fail raises `CheckpointError`; a checkpoint file instead of a folder is loaded."""
        folder = check.path("acc.resume", "folder", folder, "a checkpoint folder (or file)", "checkpoints")
        self._prepared.require("resume")
        return checkpoint.resume(self, folder)

    def epochs(self, n: int) -> Iterator[int]:
        """Yield the epochs still to run, 0..n-1 on a fresh start, from the saved epoch on a resume.
        Prepared loaders follow it: each epoch gets its own shuffle (`set_epoch` on a DistributedSampler),
        and an epoch interrupted by a crash resumes at its next batch."""
        return self._epochs.run(n, lambda: max_steps_reached(self))

    @property
    def models(self) -> tuple[nn.Module, ...]:
        """The prepared models, in the order prepared (the user's modules, without DDP)."""
        return tuple(self._prepared.models)

    @property
    def optimizers(self) -> tuple[AmpOptimizer, ...]:
        return tuple(self._prepared.optimizers)

    @property
    def schedulers(self) -> tuple[AmpScheduler, ...]:
        return tuple(self._prepared.schedulers)

    @property
    def loaders(self) -> tuple[DeviceLoader, ...]:
        return tuple(self._prepared.loaders)

    @property
    def epoch(self) -> int:
        """The epoch `acc.epochs()` is in."""
        return self._epochs.current

    def state_dict(self) -> dict[str, Any]:
        """The Accelerator's own state: epoch, accumulation position, loss scaler (not what it prepared)."""
        return {
            "run_id": self.run_id,
            "epoch": self._epochs.current,
            "cycle": self.cycle.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "items": self.items.state_dict(),
            "micro": self.micro.state_dict(),
        }

    def check_state_dict(self, state: dict[str, Any]) -> list[str]:
        """Every reason `state` cannot be loaded here (empty: it fits). Changes nothing."""
        problem = self.cycle.check_state_dict(state["cycle"])
        return [problem] if problem else []

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cycle.load_state_dict(state["cycle"])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
            self.scaler.to(self.device)
        self.items.load_state_dict(state.get("items", {}))
        self.micro.load_state_dict(state.get("micro"))
        self._epochs.current = int(state["epoch"])
        self.run_id = str(state["run_id"])  # the loaded run goes on: its checkpoint folder is this run's

    def track(self, name: str, value: torch.Tensor | float) -> None:
        """Accumulate `value` into the running mean `name` on the device (no sync)."""
        check.name_of("acc.track", "name", name, "acc.track('loss', loss)")
        self._metrics.track(name, value)
        if self.events.listeners:
            self.events.emit(Listener.on_track, self, name, value)

    def metrics(self) -> dict[str, float]:
        """Means of everything tracked since the last call (over all ranks), as floats; then reset.
        One sync (and, under torchrun, one all-reduce)."""
        return self._metrics.read(reduce=sum_across_ranks if self.distributed.enabled else None)

    def report_metric(self, name: str, value: torch.Tensor | float, higher_is_better: bool | None = None) -> None:
        """Report a result of the run, e.g. `acc.report_metric("val_loss", loss, higher_is_better=False)`, to
        listeners (`Listener.on_metric`; `ampkit compare train.py` sets it beside fp32's). No sync here."""
        check_metric(name, higher_is_better)
        check.tensor_or_number("acc.report_metric", "value", value)
        if self.events.listeners:
            self.events.emit(Listener.on_metric, self, name, value, higher_is_better)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module without DDP (ampkit's own changes are made in place, on the module)."""
        return unwrap(model)

    def fp32_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """`model`'s state_dict in fp32, each low-precision weight replaced by the fp32 value it stands
        for (its master copy, or bf16 weight plus Kahan compensation): the truth to export or serve."""
        return fp32_state_dict(self.unwrap(model), self.optimizers)

    def export(
        self,
        model: nn.Module,
        example_inputs: Any,
        precision: str = "int8",
        backend: str = "torch",
        out: str | None = None,
    ) -> Any:
        """`ampkit.export(model, ...)` of a prepared model from its fp32 truth (see `fp32_state_dict`)."""
        return export(model, example_inputs, precision, backend, out, acc=self)

    def __repr__(self) -> str:
        return (
            f"Accelerator(precision={self.policy.name!r}, device={str(self.device)!r}, "
            f"grad_accum_steps={self.config.grad_accum_steps}, rank={self.rank}/{self.world_size})"
        )
