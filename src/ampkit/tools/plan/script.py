"""`ampkit plan script.py`: plan the first model a training script prepares, with its optimizer and batch.

The script runs in this process until its first `acc.backward` (nothing is trained); the plan takes the
model's structure as a meta-device copy, the optimizer's class and defaults, and the batch (its prepared
loader's, else the model's first forward arguments).
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._pytree import tree_leaves

from ampkit.engine.events import Listener, watch_created
from ampkit.engine.launch import own_checkpoints, run_as_main
from ampkit.tools.plan.step import default_loss
from ampkit.util.validate import missing_script


class _Seen(BaseException):
    """Ends the script at its first backward (a BaseException: a loop's `except Exception` lets it by)."""


class ScriptPlanError(ValueError):
    """The script did not get as far as the plan needs."""


class _Catch(Listener):
    def __init__(self) -> None:
        self.acc: Any = None
        self.loader_batch: Any = None
        self.forward_batch: Any = None

    def created(self, acc: Any) -> None:
        if self.acc is None:
            self.acc = acc
            acc.events.add(self)

    def on_batch_wait_end(self, loader: Any, batch: Any) -> None:
        if self.loader_batch is None:
            self.loader_batch = batch

    def on_backward_start(self, acc: Any, loss: torch.Tensor) -> None:
        raise _Seen

    def forward_pre(self, module: nn.Module, args: tuple) -> None:
        if self.forward_batch is None and self.acc is not None and any(module is m for m in self.acc.models):
            self.forward_batch = args[0] if len(args) == 1 else args


def meta_copy(model: nn.Module) -> nn.Module:
    """`model`'s structure with fp32 (floating) parameters and buffers on the meta device, without
    copying its values; ampkit's forward wrapper is left off (the plan prepares each preset anew)."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        dtype = torch.float32 if t.is_floating_point() else t.dtype
        empty = torch.empty_like(t, device="meta", dtype=dtype)
        memo[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
    # ampkit's policy / compile wrappers are not copied: the class's forward runs
    memo.update({id(m.__dict__["forward"]): None for m in model.modules() if "forward" in m.__dict__})
    meta = copy.deepcopy(model, memo)
    for module in meta.modules():
        if module.__dict__.get("forward", 0) is None:
            del module.__dict__["forward"]
    return meta


def model_fn(meta: nn.Module) -> nn.Module:
    """A fresh copy of `meta`: on the meta device when built there (fake steps), else with real memory
    (the plan's real-step fallback) filled with small random values."""
    model = copy.deepcopy(meta)
    if torch.empty(0).device.type == "meta":
        return model
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.normal_(0, 0.02) if t.is_floating_point() else t.zero_()
    return model


def script_loss(output: Any, targets: Any) -> torch.Tensor:
    """The script's loss is not known: the model's own (or cross-entropy against the loader's targets),
    else the mean of its first output — which leaves out what computing a loss would allocate."""
    try:
        return default_loss(output, targets)
    except ValueError:
        leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
        scalar = next((t for t in leaves if t.dim() == 0), None)  # (logits, loss), as nanoGPT returns
        return scalar if scalar is not None else leaves[0].float().mean()


def capture(script: str | Path, args: list[str]) -> tuple[Any, Any, Any, Any, str]:
    """Run `script` to its first backward: (model_fn, batch, optimizer_fn, loss_fn, note) for `plan`."""
    path = Path(script)
    if problem := missing_script(path):
        raise ScriptPlanError(problem)
    catch = _Catch()
    hook = register_module_forward_pre_hook(catch.forward_pre)
    try:
        with own_checkpoints("plan"), watch_created(catch.created):  # it never resumes a training run's checkpoints
            run_as_main(path, args)
    except _Seen:
        pass
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise ScriptPlanError(f"{script} exited with status {exc.code!r} before its first acc.backward") from None
    finally:
        hook.remove()
    acc = catch.acc
    if acc is None or not acc.models or not acc.optimizers:
        raise ScriptPlanError(
            f"{script} ended without preparing a model and an optimizer with an ampkit.Accelerator "
            f"before its first acc.backward: convert it with the README's four lines"
        )
    loader = catch.loader_batch
    if isinstance(loader, (tuple, list)) and len(loader) == 2:
        batch, note = tuple(loader), "batch: the script's first from its prepared loader"
    elif isinstance(loader, dict):
        batch, note = (loader, None), "batch: the script's first from its prepared loader (keyword inputs)"
    elif catch.forward_batch is not None:
        batch, note = (
            (catch.forward_batch, None),
            (
                "batch: the model's first forward inputs (no targets seen: the loss is the model's own scalar output, "
                "else the mean of its output)"
            ),
        )
    else:
        raise ScriptPlanError(
            f"{script}: no batch seen before the first acc.backward (neither a prepared loader's nor "
            f"a forward of the prepared model)"
        )
    meta = meta_copy(acc.models[0])
    return (lambda: model_fn(meta)), batch, optimizer_fn(acc.optimizers[0].optimizer), script_loss, note


def optimizer_fn(inner: torch.optim.Optimizer) -> Any:
    """`params -> an optimizer` of `inner`'s class with its hyperparameters (for `plan`'s fresh models)."""
    kind = type(inner)
    accepted = inspect.signature(kind).parameters  # defaults may hold keys the constructor does not take
    defaults = {k: v for k, v in inner.defaults.items() if k in accepted}
    return lambda params: kind(params, **defaults)
