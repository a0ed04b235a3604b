"""`AcceleratorConfig`: an Accelerator's settings, checked once, frozen, and recorded with every checkpoint.

`Accelerator(...)` takes the same keywords and builds one (after the launcher's AMPKIT_* variables filled what
the script did not pass); `acc.config` is it, and `acc.config.as_dict()` the JSON record checkpoints keep.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampkit.engine.cycle import EPOCH_END
from ampkit.engine.distributed import check_backend
from ampkit.engine.micro import parse_micro_batch
from ampkit.engine.tracking import check_tracking
from ampkit.engine.wiring import Settings
from ampkit.precision.fp8 import MIN_WEIGHT
from ampkit.precision.policy import Precision
from ampkit.util import validate as check

STRATEGIES = ("auto", "ddp", "fsdp", "none")
_FLAGS = ("fp8_emulate", "channels_last", "cuda_graphs", "cast_outputs", "step_scheduler_with_optimizer")


@dataclass(frozen=True, kw_only=True)
class AcceleratorConfig:
    """The settings of one `Accelerator`, keyword-only, checked in `__post_init__`.

    Args:
        precision: "auto" (the launcher's AMPKIT_PRECISION if set, else chosen from the hardware;
            `acc.policy.reason` says why), a preset name ("fp32", "bf16-mixed", "fp16-mixed",
            "fp16-master", "bf16-master", "bf16-true", "fp8-mixed") or an `ampkit.Precision`.
        grad_accum_steps: micro-batches per optimizer step (None: AMPKIT_GRAD_ACCUM_STEPS, else 1); the loss
            is divided by it (see divide_loss), the prepared optimizer and scheduler act on every k-th call.
            A micro-batch is one `acc.backward`, or all of them inside one `with acc.accumulate():`.
        divide_loss: whether acc.backward divides the loss by grad_accum_steps. None (default) divides
            and says so once; True divides silently; False leaves the division to the loop.
        epoch_end: what the last, partial accumulation cycle of a prepared loader's pass does (when
            len(loader) % grad_accum_steps != 0): "step" (default) steps on it with its loss divided by its
            real length (timm's rule, the mean of its micro-batches); "step_as_accelerate" steps on it with
            each loss still divided by grad_accum_steps (Accelerate and the HF Trainer); "carry" carries it
            into the next pass. Without a prepared loader `acc.end_cycle()` closes a cycle by hand.
        device: "auto" (cuda, then mps, then cpu), or e.g. "cpu", "cuda:1".
        keep_fp32: module types or name patterns (fnmatch, e.g. "head", "blocks.*.attn") that run and
            are stored in fp32. Norm layers are kept in fp32 by the -master presets anyway.
        step_scheduler_with_optimizer: True (default) for schedulers stepped once per optimizer step: they
            advance only on applied steps. False passes every scheduler.step() through (per-epoch ones).
        strategy: under torchrun (WORLD_SIZE > 1), "auto" or "ddp" wraps models in DistributedDataParallel
            and shards DataLoaders; "fsdp" shards the model with FSDP2 (`fully_shard`) instead; "none"
            leaves both to you. Ignored in a single process.
        backend: the process group's backend (default: nccl on CUDA, gloo on CPU).
        timeout: under torchrun, how long a collective waits for a rank that does not come (seconds, or a
            `datetime.timedelta`; None: torch's default, 30 minutes for gloo, 10 for nccl): a stalled rank then
            ends the run with an error instead of holding it. ampkit's own wait at exit is at most 60 s.
        compile: torch.compile each prepared model's forward, precision policy inside (True, or a dict of
            torch.compile arguments such as {"mode": "max-autotune"}; None: AMPKIT_COMPILE, else False); eager
            with a warning where it fails. `acc.compile_stats` keeps the first step's compile time apart.
            Then the next training steps alternate eager and compiled (3 each) and the faster by median runs
            the rest of the run (`acc.compile_stats.chosen`/`reason`; a warning if eager); the dict key
            "trial": False keeps it compiled without timing (cuda_graphs=True runs no trial either).
        channels_last: store 4-D weights and batches in channels-last layout (NHWC), which the
            convolution kernels of GPUs (tensor cores) and of oneDNN on CPUs run fastest.
        cuda_graphs: replay each step's forward and backward kernels as CUDA graphs (torch.compile's
            "reduce-overhead" mode), for small launch-bound models. CUDA only; static input shapes.
        free_step_buffers: free between steps the full-size buffers of the updates (the `-master` presets'
            fp32 gradients; bf16-true's flat bf16 gradients, and its fp32 ones after `clip_grad_norm_`).
            None: free them, except the `-master` presets' on a CPU, where memory freed goes back to the OS
            and is faulted in again at the next step (benchmarks/RESULTS.md); on a GPU freeing costs nothing.
        cast_outputs: cast a prepared model's bf16/fp16 outputs to fp32, so that a loss computed outside
            the model runs in fp32. False: as the model made them (for a model that computes its loss).
        fp8_recipe: for precision="fp8-mixed" only (see `ampkit.precision.fp8`), as the next two: torchao's
            scaling, "tensorwise" (default) or "rowwise".
        fp8_emulate: True runs torchao's emulation on any device (tests; no speed-up).
        fp8_min_weight: the smallest in·out features of a Linear run in fp8.
        micro_batch: how many rows of each batch `acc.split(batch)` runs at once (`ampkit.engine.micro`): "auto", the
            largest that fits `memory` by `ampkit.plan`; an int; None (default), the batch whole. An
            out-of-memory error inside a split halves it and reruns the batch. The micro-batches of one batch
            are one step's gradient, so grad_accum_steps stays 1 (make the loader's batch larger instead).
        memory: the budget micro_batch="auto" fits ("2GiB", "512MB" or bytes; default: the device's free memory).
        log_to: trackers that log the run's precision health every `log_every` optimizer steps on rank 0
            (`ampkit.engine.tracking`): "jsonl" (`log_dir/metrics.jsonl`), "tensorboard" (event files in
            `log_dir`), "wandb", "mlflow" (`ampkit.engine.writers`), or a list of them; None (default): none.
            Loss, learning rate, loss scale, skipped steps, lost-update share, steps/s, samples/s, tokens/s and
            `acc.track`'s values; one host read per record, none per step. A tuple once checked.
        log_every: optimizer steps between the trackers' records (default 50).
        log_dir: the trackers' folder (default "runs/ampkit").
    """

    precision: str | Precision = "auto"
    grad_accum_steps: int = 1
    device: str | torch.device = "auto"
    keep_fp32: Sequence[str | type[nn.Module]] = ()  # a tuple once checked
    step_scheduler_with_optimizer: bool = True
    strategy: str = "auto"
    backend: str | None = None
    timeout: float | datetime.timedelta | None = None  # seconds once checked
    compile: bool | Mapping[str, Any] | None = None
    channels_last: bool = False
    cuda_graphs: bool = False
    free_step_buffers: bool | None = None
    cast_outputs: bool = True
    divide_loss: bool | None = None
    epoch_end: str = "step"
    fp8_recipe: str | None = None
    fp8_emulate: bool = False
    fp8_min_weight: int = MIN_WEIGHT
    micro_batch: int | str | None = None
    memory: str | int | None = None
    log_to: str | Sequence[str] | None = None  # a tuple once checked
    log_every: int = 50
    log_dir: str | Path = "runs/ampkit"

    def __post_init__(self) -> None:
        object.__setattr__(self, "log_to", tuple(check_tracking(self.log_to, self.log_every)))
        log_dir = check.path("Accelerator", "log_dir", self.log_dir, "the trackers' folder", "runs/ampkit")
        if log_dir.exists() and not log_dir.is_dir():
            raise ValueError(f"log_dir={str(log_dir)!r} is a file: expected a folder for the trackers' records")
        steps = self.grad_accum_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"grad_accum_steps={steps!r}: expected an integer >= 1")
        for name in _FLAGS:
            check.flag("", name, getattr(self, name))
        check.flag("", "free_step_buffers", self.free_step_buffers, "chosen by device and preset")
        check.flag("", "divide_loss", self.divide_loss, "divide and say so once")
        keep = self.keep_fp32
        entries = check.entries(
            "",
            "keep_fp32",
            [keep] if isinstance(keep, (str, type)) else keep,
            lambda s: isinstance(s, str) or (isinstance(s, type) and issubclass(s, nn.Module)),
            "a list of nn.Module subclasses or module-name patterns, e.g. ['head', nn.LayerNorm]",
        )
        object.__setattr__(self, "keep_fp32", tuple(entries))
        check_backend(self.backend)
        if self.timeout is not None:
            given = self.timeout.total_seconds() if isinstance(self.timeout, datetime.timedelta) else self.timeout
            expected = "a number of seconds > 0 (or a datetime.timedelta), e.g. 600, or None for torch's default"
            seconds = check.number("", "timeout", given, expected, lambda v: v > 0)
            object.__setattr__(self, "timeout", seconds)
        parse_micro_batch(self.micro_batch)
        if self.memory is not None:
            check.parse_memory(self.memory)
        if self.micro_batch is not None and steps > 1:
            raise ValueError(
                f"micro_batch={self.micro_batch!r} with grad_accum_steps={steps}: acc.split already accumulates "
                f"the micro-batches of each batch into one step; drop grad_accum_steps and make the loader's "
                f"batch {steps}x larger (the same update)"
            )
        if self.epoch_end not in EPOCH_END:
            raise ValueError(f"epoch_end={self.epoch_end!r}: expected one of {', '.join(map(repr, EPOCH_END))}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r}: expected 'auto', 'ddp', 'fsdp' or 'none'")

    @property
    def timeout_s(self) -> float | None:
        """`timeout` in seconds (None: torch's default)."""
        t = self.timeout
        return t.total_seconds() if isinstance(t, datetime.timedelta) else t

    @property
    def memory_bytes(self) -> int | None:
        """`memory` in bytes (None: not given)."""
        return None if self.memory is None else check.parse_memory(self.memory)

    def prepare_settings(self, free_step_buffers: bool, max_steps: int | None) -> Settings:
        """What `acc.prepare` reads of these settings (`free_step_buffers` resolved for the device; `max_steps`
        from AMPKIT_MAX_STEPS)."""
        return Settings(
            keep_fp32=self.keep_fp32,
            cast_outputs=self.cast_outputs,
            channels_last=self.channels_last,
            grad_accum_steps=self.grad_accum_steps,
            step_scheduler_with_optimizer=self.step_scheduler_with_optimizer,
            free_step_buffers=free_step_buffers,
            max_steps=max_steps,
        )

    def as_dict(self) -> dict[str, Any]:
        """The settings as JSON-able values (a Precision by its name, a module type by its qualified name)."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Precision):
                value = value.name
            elif isinstance(value, torch.device):
                value = str(value)
            elif field.name == "keep_fp32":
                value = [v if isinstance(v, str) else f"{v.__module__}.{v.__qualname__}" for v in value]
            elif field.name == "log_to":
                value = list(value)
            elif isinstance(value, Path):
                value = str(value)
            elif isinstance(value, Mapping):
                value = {
                    str(k): v if isinstance(v, (bool, int, float, str, type(None))) else repr(v)
                    for k, v in value.items()
                }
            out[field.name] = value
        return out


#: The settings' names: every keyword of `Accelerator(...)` but `scaler` (an object, not a setting).
CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(AcceleratorConfig))
