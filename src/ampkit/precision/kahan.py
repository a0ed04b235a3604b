"""bf16-true's fused update: one kernel reads a flat range of bf16 weights, their bf16 Kahan compensation,
the gradients and the optimizer's bf16 state once, and writes them once (AdamW, Adam, SGD).

The arithmetic is torch's for each optimizer (`torch.optim.AdamW`'s single-tensor step, ...), done in fp32
on the value `weight + compensation` and rounded back: the new weight is the fp32 result rounded to bf16,
the compensation what that rounding lost, the state rounded to bf16. It is compiled (`torch.compile`,
shapes dynamic, so every range shares one compilation per optimizer and dtype) where the compiler works,
and run as the same eager code elsewhere; either way a step makes one launch per range, never per element.

The contract (tests/test_kahan.py): over 100 steps every weight stays within one bf16 ulp of an fp32
reference that keeps the same Kahan pair and bf16 state with torch's own optimizer step in eager fp32.
It is not bitwise that reference (the compiler may fuse and reorder fp32 arithmetic); a run is bitwise
reproducible, and so is a resumed one.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch


def _kahan_store(p: torch.Tensor, c: torch.Tensor, w: torch.Tensor) -> None:
    rounded = w.to(p.dtype)
    c.copy_(w - rounded.float())
    p.copy_(rounded)


def adam_range(
    p: torch.Tensor,
    c: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    sign: float,
    decay: float,
    l2: float,
    one_minus_beta1: float,
    beta2: float,
    one_minus_beta2: float,
    bias2_sqrt: float,
    eps: float,
    step_size: float,
) -> None:
    """One Adam/AdamW step of a flat range, torch's arithmetic in fp32 (`adam_args` makes the scalars as torch
    does, in Python; a scalar that switches a term off makes it exact: `w * 1.0`, `g + 0.0 * w`)."""
    w, grad = p.float() + c.float(), g.float() * sign
    w = w * decay
    grad = grad + l2 * w
    m32 = torch.lerp(m.float(), grad, one_minus_beta1)
    v32 = v.float() * beta2 + grad * grad * one_minus_beta2
    denom = v32.sqrt() / bias2_sqrt + eps
    w = w - step_size * (m32 / denom)
    m.copy_(m32)
    v.copy_(v32)
    _kahan_store(p, c, w)


def sgd_range(
    p: torch.Tensor,
    c: torch.Tensor,
    g: torch.Tensor,
    buf: torch.Tensor,
    sign: float,
    l2: float,
    keep: float,
    take: float,
    nesterov: bool,
    momentum: float,
    lr: float,
) -> None:
    """One SGD step of a flat range: the momentum buffer `buf * keep + grad * take` (`sgd_args`: on the first
    step, or without momentum, keep 0 and take 1: the gradient itself), then Nesterov's lookahead or the buffer."""
    w, grad = p.float() + c.float(), g.float() * sign
    grad = grad + l2 * w
    b32 = buf.float() * keep + grad * take
    buf.copy_(b32)
    grad = grad + momentum * b32 if nesterov else b32
    _kahan_store(p, c, w - lr * grad)


def adam_args(group: dict[str, Any], step: float, decoupled: bool) -> tuple[float, ...]:
    """`adam_range`'s scalars for one group at `step` (after its increment), computed on the host as torch does."""
    lr, (beta1, beta2), wd = float(group["lr"]), group["betas"], group["weight_decay"]
    bias1, bias2 = 1 - beta1**step, 1 - beta2**step
    return (
        -1.0 if group["maximize"] else 1.0,
        1 - lr * wd if decoupled else 1.0,
        0.0 if decoupled else wd,
        1 - beta1,
        beta2,
        1 - beta2,
        math.sqrt(bias2),
        group["eps"],
        lr / bias1,
    )


def sgd_args(group: dict[str, Any], first: bool) -> tuple[float, ...]:
    """`sgd_range`'s scalars for one group (`first`: the weights' momentum buffers do not exist yet)."""
    momentum = group["momentum"]
    fresh = first or momentum == 0
    return (
        -1.0 if group["maximize"] else 1.0,
        group["weight_decay"],
        0.0 if fresh else momentum,
        1.0 if fresh else 1 - group["dampening"],
        bool(group["nesterov"]),
        momentum,
        float(group["lr"]),
    )


_EAGER: dict[str, Callable[..., None]] = {"adam": adam_range, "sgd": sgd_range}
_KERNELS: dict[str, Callable[..., None]] = {}  # name -> its compiled kernel, or the eager one where compiling failed


def run(name: str, *args: Any) -> None:
    """Run kernel `name` ("adam" or "sgd"), compiled; where compiling fails, warn once and run it eager."""
    eager = _EAGER[name]
    if _shapes_only(args[0]):  # fake tensors (`ampkit plan`): the fused kernel makes no temporary, so neither does this
        return None
    if torch.compiler.is_compiling():  # inside the user's compiled step: traced into its graph
        return eager(*args)
    args = tuple(_steady(a) for a in args)
    tensors = [t for t in args if isinstance(t, torch.Tensor)]
    STATS.calls += 1
    STATS.bytes += 2 * sum(t.nbytes for t in tensors) - tensors[2].nbytes  # each read and written, the gradient read
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():  # a dispatch mode watching (a profiler, a memory tracker) sees the kernel whole,
        return _call(name, eager, *args)  # not the eager ops it would otherwise run with other rounding


def _steady(arg: Any) -> Any:
    """One argument as the compiled kernel's guards see it the same way every call: a tensor detached (a weight
    that requires grad and a buffer's view that does not share one compilation), a scalar a float (`1 - 0`
    is an int), a switch a bool. Else every new combination recompiles, and dynamo's recompile limit (8 per
    kernel, per process) ends compiling for every optimizer after that."""
    if isinstance(arg, torch.Tensor):
        return arg.detach()
    return arg if isinstance(arg, bool) else float(arg)


def _call(name: str, eager: Callable[..., None], *args: Any) -> None:
    fn = _KERNELS.get(name)
    if fn is None:
        # emulate_precision_casts: round where the code rounds (else inductor drops the bf16 round trip that
        # the compensation is made of)
        fn = _KERNELS[name] = torch.compile(
            eager, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True}
        )
    if fn is eager:
        return eager(*args)
    try:
        return fn(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # a machine without a working compiler (no C++ toolchain, an old triton)
        _KERNELS[name] = eager
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        warnings.warn(
            f"bf16-true's fused {name} update could not be compiled ({type(exc).__name__}: {first}); it "
            f"runs as eager torch ops from now on (the same arithmetic, more memory traffic)",
            stacklevel=3,
        )
        return eager(*args)


def compiled(name: str) -> bool:
    """Whether kernel `name` has run compiled in this process (False before its first call, or where it failed)."""
    fn = _KERNELS.get(name)
    return fn is not None and fn is not _EAGER[name]


def _shapes_only(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t) or t.device.type == "meta"


class Stats:
    """Fused kernel calls and the bytes they read and wrote (weights and compensation read and written, the
    gradient read, the state read and written), for counters that watch aten ops and cannot see inside one."""

    calls = 0
    bytes = 0


STATS = Stats()
