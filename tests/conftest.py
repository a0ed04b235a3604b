"""Shared tiny models and data for the CPU test suite."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

# The processes the tests start (a fresh interpreter each: torchrun ranks, a resumed run, a comparison's runs)
# import ampkit from source: with PYTHONDONTWRITEBYTECODE set, as some images do, each compiles every module
# again (~0.3 s a process here). Here the first writes the bytecode (into the ignored __pycache__ folders)
# and the rest read it; nothing they test depends on it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def make_model(seed: int = 0, width: int = 16, norm: bool = False) -> nn.Module:
    """A small MLP classifier; `norm` adds a LayerNorm (the -master presets keep it in fp32)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(8, width)]
    if norm:
        layers.append(nn.LayerNorm(width))
    layers += [nn.GELU(), nn.Linear(width, 4)]
    return nn.Sequential(*layers)


class HostReads(TorchDispatchMode):
    """Reads of a value by the host: `.item()` and the like (aten._local_scalar_dense), and a copy to the host
    (`.tolist()` of a device tensor copies it first)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        to_host = func is torch.ops.aten._to_copy.default and str((kwargs or {}).get("device")) == "cpu"
        self.reads += func is torch.ops.aten._local_scalar_dense.default or to_host
        return func(*args, **(kwargs or {}))


def make_loader(seed: int = 0, n: int = 256, batch_size: int = 16, shuffle: bool = True) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :4].argmax(dim=1) + (x[:, 4] > 1).long()) % 4
    return DataLoader(
        TensorDataset(x, y),
        batch_size=batch_size,
        shuffle=shuffle,
        generator=torch.Generator().manual_seed(seed + 1),
    )


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype, f"tensor {i}: {x.dtype} != {y.dtype}"
        assert torch.equal(x, y), f"tensor {i} differs: max |diff| {(x.float() - y.float()).abs().max()}"


@pytest.fixture(autouse=True)
def _quiet_slow_dtype_warning():
    """bf16/fp16 on a CPU without those instructions warns that it is slow; tests run it on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*runs far slower than fp32.*")
        yield


@pytest.fixture
def one_thread():
    """One torch thread: the cores are shared with other processes, and one thread keeps the tiny
    matmuls steady where a test measures (the doctors' timing and classification tests)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
