"""Writing files so that a crash leaves the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ampkit.errors import CheckpointError


def fsync_dir(folder: Path) -> None:
    """Make a rename inside `folder` durable (where the filesystem can fsync a directory)."""
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write `path` through `write(file)` so that readers see the old content or the new, whole.

    On any failure (disk full included) the temporary file is removed, the old `path` is left as
    it was, and `CheckpointError` says what went wrong.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError):
            raise CheckpointError(f"could not write {path}: {exc.strerror or exc}; the previous checkpoint is intact") from exc
        raise
    fsync_dir(path.parent)
