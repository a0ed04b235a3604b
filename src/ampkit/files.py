"""Writing files so that a crash leaves the old content or the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ampkit.errors import CheckpointError, first_line

#: The temporary name `atomic_write` uses: `.<name>.tmp-<pid>` beside the final file.
TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")


def fsync_dir(folder: Path) -> None:
    """Make a rename inside `folder` durable (where the filesystem can fsync a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write `path` through `write(file)` so that readers see the old content or the new, whole.

    The content goes to a temporary file in the same folder, is fsynced and renamed over `path`.
    On any failure (a full disk included) the temporary file is removed, the old `path` is left as
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
    except Exception as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise CheckpointError(f"could not write {path}: {_why(exc, path)}; the previous checkpoint is intact") from exc
    except BaseException:  # KeyboardInterrupt: clean up, then let it go on
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def _why(exc: Exception, path: Path) -> str:
    """Why a write failed, in words (a full disk reaches torch.save's writer as a RuntimeError)."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    with contextlib.suppress(OSError):
        if shutil.disk_usage(path.parent).free < 1 << 20:
            return "No space left on device"
    return f"the write failed ({first_line(exc)}): the disk may be full or a file size limit reached"


def pid_alive(pid: int) -> bool:
    """Whether process `pid` still runs (a temporary file of a live writer must not be removed)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True
