"""Where loss scaling meets torch's fused optimizers: on CUDA an overflowing step is skipped on the device by
the fused Adam/AdamW/SGD/Adagrad kernels, which take found_inf and grad_scale as tensors (no host read).

Whether the installed torch has that fused kernel for the device is asked of torch itself, never read from a
version table: a throwaway optimizer of the same class takes one fused step on a one-element tensor of that
device (torch checks the device at the first step, not at construction: Adagrad has a CPU kernel since 2.4 but
a CUDA one only in later releases). The answer is cached per (optimizer class, device type, tensor type)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

#: torch's optimizers with a fused kernel that takes found_inf and grad_scale as tensors (skips on the device).
FUSED_SKIP = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)

_PROBED: dict[tuple[type, str, type], str | None] = {}


def fused_kernel_missing(cls: type[torch.optim.Optimizer], device: torch.device) -> str | None:
    """None if torch can step `cls(fused=True)` on `device`; else why not (torch's error, one line).

    Runs one fused step of a throwaway `cls` on a one-element zero tensor of `device` (no host read). Fake
    tensors (`ampkit plan`) are probed as themselves and cached apart from real ones."""
    try:
        probe = torch.zeros(1, device=device, requires_grad=True)
    except Exception as exc:  # noqa: BLE001 - no tensor on that device at all: no kernel either
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    key = (cls, device.type, type(probe))
    if key not in _PROBED:
        try:
            probe.grad = torch.zeros_like(probe)
            make: Callable[..., torch.optim.Optimizer] = cls  # a torch optimizer class taking lr= and fused=
            make([probe], lr=1e-3, fused=True).step()
            _PROBED[key] = None
        except Exception as exc:  # noqa: BLE001 - any failure of the fused step means: do not switch to it
            first = str(exc).splitlines()[0] if str(exc) else ""
            _PROBED[key] = f"{type(exc).__name__}: {first}"
    return _PROBED[key]


def _untouched(optimizer: torch.optim.Optimizer) -> bool:
    """No step taken yet: no state, or only what Adagrad's constructor makes (step 0 on the host, the sums)."""
    if not optimizer.state:
        return True
    if type(optimizer) is not torch.optim.Adagrad:
        return False
    steps = [s.get("step") for s in optimizer.state.values()]
    # sync: none, these are host tensors (a non-fused Adagrad keeps its step on the CPU); read once at prepare
    return all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and float(t) == 0.0 for t in steps)


def fuse_for_device_skips(optimizer: torch.optim.Optimizer, device: torch.device, scaled: bool) -> bool:
    """On CUDA, under loss scaling, step torch's Adam/AdamW/SGD/Adagrad through their fused kernels where the user
    chose no implementation and the installed torch has that kernel for the device: an overflowing step is then
    skipped on the GPU, without the host read of found_inf that the foreach and for-loop implementations need.
    Where the kernel is missing, the optimizer keeps torch's default (foreach) and one warning says so. True if
    it switched (the user's choice is never overridden)."""
    groups = optimizer.param_groups
    if device.type != "cuda" or not scaled or type(optimizer) not in FUSED_SKIP or not _untouched(optimizer):
        return False
    chosen = any(g.get(k) is not None for g in groups for k in ("foreach", "fused"))
    if chosen or any(g.get(k) for g in groups for k in ("differentiable", "capturable")):
        return False
    if not all(p.is_floating_point() and p.device.type == "cuda" for g in groups for p in g["params"]):
        return False
    name = type(optimizer).__name__
    missing = fused_kernel_missing(type(optimizer), device)
    if missing is not None:
        warnings.warn(
            f"{name} on CUDA with loss scaling: this torch ({torch.__version__}) cannot step {name}(fused=True) "
            f"on {device.type} ({missing}), so ampkit keeps torch's default implementation (foreach) and reads "
            f"found_inf once per step; AdamW, Adam and SGD have the fused kernel and skip on the device",
            stacklevel=4,
        )
        return False
    for g in groups:
        g["fused"] = True
        for p in g["params"]:
            state = optimizer.state.get(p)
            if state and "step" in state:  # Adagrad's, made at construction: a fused step counts on the device
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
    optimizer.defaults["fused"] = True
    warnings.warn(
        f"{name} on CUDA with loss scaling: ampkit steps it through torch's fused kernel "
        f"(fused=True), which skips an overflowing step on the GPU without a host sync; pass foreach=True or "
        f"fused=False to keep another implementation (then ampkit reads found_inf once per step)",
        stacklevel=4,
    )
    return True
