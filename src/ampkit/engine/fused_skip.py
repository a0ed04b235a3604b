"""Where loss scaling meets torch's fused optimizers: on CUDA an overflowing step is skipped on the device by
the fused Adam/AdamW/SGD/Adagrad kernels, which take found_inf and grad_scale as tensors (no host read)."""

from __future__ import annotations

import warnings

import torch

#: torch's optimizers with a fused kernel that takes found_inf and grad_scale as tensors (skips on the device).
FUSED_SKIP = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def fuse_for_device_skips(optimizer: torch.optim.Optimizer, device: torch.device, scaled: bool) -> bool:
    """On CUDA, under loss scaling, step torch's Adam/AdamW/SGD/Adagrad through their fused kernels where the user
    chose no implementation: an overflowing step is then skipped on the GPU, without the host read of found_inf
    that the foreach and for-loop implementations need. True if it did (the user's choice is never overridden)."""
    groups = optimizer.param_groups
    if device.type != "cuda" or not scaled or type(optimizer) not in FUSED_SKIP or optimizer.state:
        return False
    chosen = any(g.get(k) is not None for g in groups for k in ("foreach", "fused"))
    if chosen or any(g.get(k) for g in groups for k in ("differentiable", "capturable")):
        return False
    if not all(p.is_floating_point() and p.device.type == "cuda" for g in groups for p in g["params"]):
        return False
    for g in groups:
        g["fused"] = True
    optimizer.defaults["fused"] = True
    warnings.warn(
        f"{type(optimizer).__name__} on CUDA with loss scaling: ampkit steps it through torch's fused kernel "
        f"(fused=True), which skips an overflowing step on the GPU without a host sync; pass foreach=True or "
        f"fused=False to keep another implementation (then ampkit reads found_inf once per step)",
        stacklevel=4,
    )
    return True
