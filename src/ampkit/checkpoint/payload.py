"""One checkpoint file: tensors and plain data written by `torch.save`, with a SHA-256 digest over
every tensor's bytes and every value (a flipped byte inside a tensor still unzips), read with
`torch.load(weights_only=True)`: nothing in it can run code.
"""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path
from typing import Any

import torch

from ampkit.errors import CheckpointError, first_line
from ampkit.util import files

FORMAT = "ampkit-checkpoint"
VERSION = 2
_ZIP = b"PK\x03\x04"  # every file torch.save writes is a zip archive


def digest(obj: Any) -> str:
    """SHA-256 over every tensor's bytes and every plain value, in a fixed order."""
    h = hashlib.sha256()

    def visit(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            t = o.detach().to("cpu").contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(o, dict):
            h.update(b"{")
            for k in sorted(o, key=repr):
                h.update(repr(k).encode())
                visit(o[k])
            h.update(b"}")
        elif isinstance(o, (list, tuple)):
            h.update(b"[")
            for v in o:
                visit(v)
            h.update(b"]")
        else:
            h.update(repr(o).encode())

    visit(obj)
    return h.hexdigest()


def _overlapping(obj: Any, where: str = "") -> str | None:
    """The place of the first tensor in `obj` whose elements need more bytes than its storage holds (a
    stride-0 or overlapping view, whose copy would be that much larger than the file), else None."""
    if isinstance(obj, torch.Tensor):
        size = obj.untyped_storage().nbytes() // max(obj.element_size(), 1)
        extent = obj.storage_offset() + sum((n - 1) * abs(s) for n, s in zip(obj.shape, obj.stride())) + 1
        too_big = obj.numel() > size or (obj.numel() > 0 and extent > size)
        return (where or "?") if too_big else None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        if (bad := _overlapping(value, f"{where}/{key}")) is not None:
            return bad
    return None


def write(path: Path, payload: dict[str, Any]) -> None:
    """Seal `payload` with its digest and write it to `path` atomically."""
    payload = dict(payload, format=FORMAT, version=VERSION)
    payload["digest"] = digest({k: v for k, v in payload.items() if k != "digest"})
    path.parent.mkdir(parents=True, exist_ok=True)
    files.atomic_write(path, lambda f: torch.save(payload, f))


def check_replaceable(path: Path) -> None:
    """`CheckpointError` unless `path` is free or a regular file holding an ampkit checkpoint (read lazily,
    with mmap, without the digest: only its header decides), so that a save never replaces a user's file."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or not stat.S_ISREG(path.lstat().st_mode):
        what = "a link" if path.is_symlink() else "not a regular file (a FIFO, device or socket)"
    else:
        try:
            with files.open_regular(path) as f:
                ours = f.read(4) == _ZIP
            ours = ours and torch.load(path, mmap=True, weights_only=True).get("format") == FORMAT
        except Exception:  # unreadable, or not torch.save's: not a checkpoint ampkit wrote
            ours = False
        if ours:
            return
        what = "a file that is not an ampkit checkpoint"
    raise CheckpointError(
        f"cannot save to {path}: it is {what}, and ampkit replaces only checkpoints it wrote. Choose another "
        "path, or pass overwrite=True to replace it"
    )


def read(path: Path, inside: Path | None = None) -> dict[str, Any]:
    """Load and verify one checkpoint file (a link only to a file in `inside`); `CheckpointError` naming
    the file and the fault otherwise. Only a regular file is opened: a FIFO or device is refused, not read."""
    if not path.exists() and not path.is_symlink():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a file")
    try:
        with files.open_regular(path, inside=inside) as f:
            if f.read(4) != _ZIP:
                raise CheckpointError(
                    f"checkpoint {path} is truncated or corrupt: it does not start like a file torch.save writes"
                )
            f.seek(0)
            payload = torch.load(f, map_location="cpu", weights_only=True)
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {exc}" if str(exc).startswith(str(path)) else str(exc)) from None
    except Exception as exc:
        text = str(exc)
        if "Unsupported global" in text or "Weights only load failed" in text and "GLOBAL" in text:
            raise CheckpointError(
                f"checkpoint {path} holds pickled objects other than tensors and plain data (it could run code); "
                "ampkit refuses to load it. Only load such a file with torch.load(weights_only=False) "
                "if you trust its source"
            ) from None
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt: {first_line(exc)}") from None
    if bad := _overlapping(payload):
        raise CheckpointError(
            f"checkpoint {path} is crafted or corrupt: tensor {bad} is a view larger than the bytes it is "
            "stored in (ampkit never writes one; expanding it could exhaust memory)"
        )
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not an ampkit checkpoint (no '{FORMAT}' header); it may be a plain torch.save file"
        )
    if payload.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {payload.get('version')!r}; this ampkit reads version {VERSION}"
        )
    if payload.get("digest") != digest({k: v for k, v in payload.items() if k != "digest"}):
        raise CheckpointError(f"checkpoint {path} is corrupt: its content does not match its SHA-256 digest")
    return payload
