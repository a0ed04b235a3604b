"""What a user measures of a training step's memory: the figure `ampkit plan`'s peak is judged against.

On a CPU, the peak resident memory (RSS) of a steady-state step above the process's pre-model baseline (Linux:
the kernel's high-water mark, reset through /proc/self/clear_refs before the last step); on CUDA,
`max_memory_allocated` over the last step above what was allocated before the model. Call it in a fresh process
(`python -c`, a subprocess): the baseline is the process before its first model, as a user's script has it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ampkit.accelerator import Accelerator
from ampkit.tools.plan.step import call, default_loss

_STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def _status(key: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{_STATUS} has no {key}")


def steady_peak(
    model_fn: Callable[[], nn.Module],
    batch: Any,
    optimizer_fn: Callable[[Any], torch.optim.Optimizer],
    precision: str,
    device: str | torch.device = "cpu",
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    steps: int = 4,
) -> int:
    """Bytes of the last of `steps` real training steps of `precision`, measured as a user would (module doc)."""
    dev = torch.device(device)
    if dev.type == "cpu" and not (_STATUS.exists() and _CLEAR.exists()):
        raise RuntimeError(
            "steady_peak on a CPU reads the resident high-water mark from /proc/self (Linux); this system has none"
        )
    if steps < 2:
        raise ValueError(f"steps={steps!r}: expected at least 2 (the first step makes the optimizer's state)")
    cuda = dev.type == "cuda"
    base = torch.cuda.memory_allocated(dev) if cuda else _status("VmRSS")
    acc = Accelerator(precision=precision, device=dev, grad_accum_steps=1, compile=False)
    model = acc.prepare(model_fn())
    opt = acc.prepare(optimizer_fn(model.parameters()))
    inputs, targets = tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, batch)
    for step in range(steps):
        if step == steps - 1:
            if cuda:
                torch.cuda.synchronize(dev)  # sync: the measurement's boundary, outside any training run
                torch.cuda.reset_peak_memory_stats(dev)
            else:
                _CLEAR.write_text("5")  # the high-water mark restarts from the resident set now
        loss = (loss_fn or default_loss)(call(model, inputs), targets)
        acc.backward(loss)
        del loss
        opt.step()
        opt.zero_grad()
    if cuda:
        torch.cuda.synchronize(dev)  # sync: the figure is read after the step
        return torch.cuda.max_memory_allocated(dev) - base
    return _status("VmHWM") - base


def resident_now() -> int:
    """This process's resident memory now, in bytes (Linux /proc/self/status)."""
    return _status("VmRSS")


def high_water(reset: bool = False) -> int:
    """This process's resident high-water mark in bytes; `reset`: restart it from the resident set now."""
    if reset:
        _CLEAR.write_text("5")
    return _status("VmHWM")
