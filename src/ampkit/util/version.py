"""Which ampkit, torch, CUDA, cuDNN, ROCm and Python this process runs: what every report records."""

from __future__ import annotations

import functools
import importlib.metadata
import platform

import torch


@functools.cache
def ampkit_version() -> str:
    """ampkit's version from the installed package's metadata ("0+unknown": a source tree never installed)."""
    try:
        return importlib.metadata.version("ampkit")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def cudnn_version() -> str | None:
    """cuDNN's version as "9.1.0", or None where torch has no cuDNN."""
    v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if v is None:
        return None
    # cuDNN 9 encodes MAJOR*10000 + MINOR*100 + PATCH; cuDNN 8 and older MAJOR*1000 + MINOR*100 + PATCH.
    major, rest = divmod(v, 10000) if v >= 90000 else divmod(v, 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def versions() -> dict[str, str | None]:
    """The software this process runs on: ampkit, torch, CUDA, cuDNN, ROCm (HIP), Python; None: absent."""
    return {
        "ampkit": ampkit_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn_version(),
        "hip": torch.version.hip,
        "python": platform.python_version(),
    }
