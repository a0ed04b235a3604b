"""`ampkit plan`'s step pair on fake CUDA tensors as a GPU's plan runs it: `python fake_cuda_plan.py SHIM OUT`,
run by tests/test_fake_cuda.py (SHIM as for fake_cuda_run.py). Unlike fake_cuda_run.py's trace, torch's own
choice of optimizer implementation is left as it is on fake tensors (FakeTensor is not a type its foreach
kernels take), which is what `ampkit plan` meets on a GPU. Writes {optimizer: Measured fields} as JSON."""

from __future__ import annotations

import ctypes
import sys

if __name__ == "__main__" and sys.argv[1] != "-":
    SHIM = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # before torch (fake_cuda_shim.cpp)

import dataclasses  # noqa: E402
import json  # noqa: E402
from unittest import mock  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from fake_cuda_run import CUDA, OPTIMIZERS, TORCH_OPTIMIZER, fake_cuda_device  # noqa: E402

TORCH_FOREACH_TYPES = list(TORCH_OPTIMIZER._foreach_supported_types)  # torch's own, before any seam
WIDTH, DEPTH, ROWS = 256, 8, 2  # many equal layers at a small batch: the optimizer step is the peak


def model_fn() -> nn.Module:
    return nn.Sequential(*(m for _ in range(DEPTH) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())))


def main(out: str) -> None:
    from ampkit.tools.plan.step import measure

    batch = (torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH))
    sizes = [4 * p.numel() for p in model_fn().parameters()]
    results = {"param_bytes": sum(sizes), "largest_param_bytes": max(sizes)}
    for precision in ("fp32", "bf16-mixed"):
        for name, kwargs in {**OPTIMIZERS, "loop": {"foreach": False}}.items():
            with (
                fake_cuda_device(),
                mock.patch.object(TORCH_OPTIMIZER, "_foreach_supported_types", TORCH_FOREACH_TYPES),
            ):
                measured = measure(
                    model_fn,
                    batch,
                    lambda params, kw=kwargs: torch.optim.AdamW(params, lr=1e-3, **kw),
                    precision,
                    CUDA,
                    fake=True,
                    batch_size=ROWS,
                )
            results[f"{precision}/{name}"] = dataclasses.asdict(measured)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1] != "-" and not SHIM.fake_cuda_install():
        sys.exit("the fake CUDA shim did not take: torch asked for its CUDA hooks before it loaded")
    main(sys.argv[2])
