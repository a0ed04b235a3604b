"""Two training steps through a real ampkit preset, on fake tensors (predicted) or real ones (measured).

Two, because the first creates the optimizer's state and a step's backward with the state already there
is where most runs peak. The model is built on the meta device and moved to the planning device under
`FakeTensorMode` (no parameter gets real memory); preparing, the forward, backward and step are ampkit's own.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._pytree import tree_leaves, tree_map

from ampkit.accelerator import Accelerator
from ampkit.tools.plan.tracker import LiveBytes

#: What a forward that fake tensors cannot run raises (data-dependent shapes, .item(), ops without a fake kernel).
FAKE_FAILURES = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
    NotImplementedError,
)


@dataclass(frozen=True)
class Measured:
    """One step pair's peak of live tensor bytes, what held them at that moment, and where it was."""

    peak: int
    components: dict[str, int]
    phase: str
    after_step: dict[str, int] | None = None  # live bytes by component right after the second optimizer step


def batch_size_of(batch: Any) -> int:
    """The batch size: the first dimension of the batch's first tensor with one."""
    sizes = [t.shape[0] for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not sizes:
        raise ValueError(
            "batch_fn() returned no tensor with a batch dimension: expected (inputs, targets) of tensors "
            "(or dicts/tuples of them) whose first dimension is the batch"
        )
    return int(sizes[0])


def resized(batch: Any, size: int) -> Any:
    """`batch` with every tensor whose first dimension is the batch size repeated or cut to `size` rows."""
    old = batch_size_of(batch)
    rows = torch.arange(size) % old

    def one(t: Any) -> Any:
        return t[rows.to(t.device)] if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == old else t

    return tree_map(one, batch)


def default_loss(output: Any, targets: Any) -> torch.Tensor:
    """The loss when none is given: the model's own (a scalar output, or `.loss` / `["loss"]` of it), else
    cross-entropy for integer targets and mean squared error for float ones."""
    if isinstance(output, Mapping) and "loss" in output:
        output = output["loss"]
    elif getattr(output, "loss", None) is not None:
        output = output.loss
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    if isinstance(output, (tuple, list)):
        output = output[0]
    if not isinstance(targets, torch.Tensor):
        raise ValueError(
            "the model's output is not a scalar loss and batch_fn() gave no target tensor: pass "
            "loss_fn=(output, targets) -> loss, or return (inputs, targets)"
        )
    if targets.is_floating_point():
        return F.mse_loss(output.float(), targets.float())
    return F.cross_entropy(output.float().reshape(-1, output.shape[-1]), targets.reshape(-1))


def call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def measure(
    model_fn: Callable[[], nn.Module],
    batch: Any,
    optimizer_fn: Callable[[Any], torch.optim.Optimizer],
    precision: str,
    device: torch.device,
    *,
    fake: bool,
    batch_size: int,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    steps: int = 2,
    last_only: bool = False,
) -> Measured:
    """Peak live bytes over `steps` training steps of `precision` at `batch_size` (fake or real tensors);
    `last_only`: the last step's peak alone (a steady-state step, when `steps` > 2)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with torch.device("meta") if fake else contextlib.nullcontext():  # fake: its parameters never get memory
        model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_fn() returned a {type(model).__name__}; expected an nn.Module")
    with warnings.catch_warnings(), mode:
        warnings.simplefilter("ignore")  # bf16 on a CPU without bf16 instructions: planned, not timed
        acc = Accelerator(precision=precision, device=device, grad_accum_steps=1, compile=False)  # not AMPKIT_*
        ties = _ties(model)
        model = acc.prepare(model)
        for (module, name), *others in ties:  # moving meta parameters makes one per module: tie them again
            for other, other_name in others:
                other.register_parameter(other_name, getattr(module, name))
        opt = acc.prepare(optimizer_fn(model.parameters()))
        if fake:
            as_on_the_device(opt.param_groups, device)
        convert = mode.from_tensor if isinstance(mode, FakeTensorMode) else (lambda t: t)
        inputs, targets = resized(
            tree_map(lambda t: convert(t).to(device) if isinstance(t, torch.Tensor) else t, batch), batch_size
        )
        tracker = LiveBytes(device.type, lambda: _owners(model, opt, (inputs, targets)), fake)
        tracker.params = {id(p.untyped_storage()) for p in model.parameters()}
        with tracker:
            tracker.see([*model.parameters(), *model.buffers(), *tree_leaves((inputs, targets))])
            tracker.see([t for _, ts in _owners(model, opt, ()) for t in ts])
            tracker.peak = 0
            for step in range(steps):
                if last_only and step == steps - 1:
                    tracker.peak = 0
                tracker.phase = "forward"
                with torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
                    output = call(model, inputs)
                    loss = (loss_fn or default_loss)(output, targets)
                del output
                tracker.phase = "backward"
                acc.backward(loss)
                del loss
                tracker.resync()
                tracker.phase = "optimizer"
                opt.step()
                after = tracker.components()
                opt.zero_grad()
                tracker.phase = "setup"
                tracker.resync()
        return Measured(tracker.peak, tracker.at_peak, tracker.peak_phase, after)


def as_on_the_device(groups: list[dict[str, Any]], device: torch.device) -> None:
    """Resolve torch's default optimizer implementation as the real device would. torch picks foreach for
    CUDA tensors of type Tensor or Parameter only, so on fake tensors (type FakeTensor) it would trace the
    per-tensor loop; foreach holds whole-list temporaries at the step (AdamW: about one more fp32 copy of the
    parameters), so the plan sets foreach=True where the user chose no implementation, as CUDA would run."""
    if device.type != "cuda":  # torch's CPU default is the per-tensor loop, which fake tensors trace as it is
        return
    for g in groups:
        if "foreach" in g and g["foreach"] is None and not g.get("fused") and not g.get("differentiable"):
            g["foreach"] = True


def _ties(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute name) of each parameter that more than one module holds (tied embeddings)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((module, name))
    return [h for h in holders.values() if len(h) > 1]


def _owners(model: nn.Module, opt: Any, batch: Any) -> Iterator[tuple[str, list[torch.Tensor]]]:
    """The tensors of each component now (`LiveBytes.owners`), in the order a shared storage is counted."""
    params = list(model.parameters())
    yield "parameters", [*params, *model.buffers()]
    yield "gradients", [p.grad for p in params if p.grad is not None]
    mine = {id(p) for p in params}
    stand_ins = [p for g in opt.param_groups for p in g["params"] if id(p) not in mine]
    exact = opt.weights.exact_state() if opt.weights is not None else []
    yield "ampkit_buffers", [*stand_ins, *(p.grad for p in stand_ins if p.grad is not None), *exact]
    yield "optimizer_state", [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    yield "activations", tree_leaves(batch)
