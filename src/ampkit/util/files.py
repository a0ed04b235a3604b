"""Writing files so that a crash leaves the old content or the new one, never half of one."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

from ampkit.errors import CheckpointError, first_line

#: The temporary name `atomic_write` uses: `.<name>.tmp-<pid>` beside the final file.
TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")


#: Size limits for the small files ampkit reads back: `latest`, the lock, a manifest, an ownership record.
SMALL_FILE = 4096
RECORD_FILE = 16 << 20


def open_regular(path: Path, limit: int | None = None, inside: Path | None = None) -> BinaryIO:
    """`path` opened for reading only if it is a regular file (at most `limit` bytes; a link only to a file
    inside `inside`), else `CheckpointError`. Opening never blocks: a FIFO or a device is refused, not read."""
    path = Path(path)
    try:
        if inside is not None and path.is_symlink() and path.resolve().parent != Path(inside).resolve():
            raise CheckpointError(f"{path} is a link out of {inside}: ampkit reads only its own files there")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read: {exc.strerror or exc}") from None
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = "is not a regular file (a FIFO, device or folder), so ampkit did not write it"
    elif limit is not None and info.st_size > limit:
        problem = f"holds {info.st_size} bytes, more than the {limit} such a file ever holds"
    if problem:
        os.close(fd)
        raise CheckpointError(f"{path} {problem}: ampkit will not read it; move it away")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_regular(path: Path, limit: int, inside: Path | None = None) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them (see `open_regular`)."""
    with open_regular(path, limit, inside) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{path} grew past {limit} bytes while being read: ampkit will not read it")
    return data


def read_json(path: Path, limit: int = RECORD_FILE, inside: Path | None = None) -> object:
    """A small JSON file read with `read_regular`; damage, or nesting too deep to parse, is `CheckpointError`."""
    data = read_regular(path, limit, inside)
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise CheckpointError(f"{path} is nested too deeply to be a file ampkit wrote") from None
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {first_line(exc)}") from None


def fsync_dir(folder: Path) -> None:
    """Make a rename inside `folder` durable (where the filesystem can fsync a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
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
    if pid <= 0:  # os.kill(0 or -1) would signal a whole group: no writer has such a pid
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


#: The record, inside an output folder, of the files ampkit wrote there (relative names, JSON).
OWNED_RECORD = ".ampkit-owned.json"
#: Every part of a name ampkit writes there (`report.json`, `.compare/bf16-mixed.json`, `logs/fp32.log`):
#: matched whole, so a record edited to list `report.json\n`, ` x` or `..` names nothing.
OWNED_PART = re.compile(r"\.?[A-Za-z0-9][A-Za-z0-9_.+-]*")


class OwnedFiles:
    """The files ampkit wrote into a folder the user named (`compare --out`), so that a later run there
    overwrites and deletes only those. A name is relative, inside the folder, never through a link:
    anything else in the record (a tampered one) is ignored, so it can never make ampkit touch it.

        owned = OwnedFiles(out)
        owned.check(["report.json", "report.html"])   # before any work: refuses what it did not write
        owned.claim(["report.json"])                    # just before writing: records it first
        owned.remove(".compare/fp32.json")              # deletes only a recorded name
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.names: set[str] = set()
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError, CheckpointError):
            record = read_json(self.folder / OWNED_RECORD, inside=self.folder)
            names = record.get("files", []) if isinstance(record, dict) else []
            self.names = {n for n in names if isinstance(n, str) and self._inside(n)}

    def _inside(self, name: str) -> bool:
        parts = name.split("/")
        if not all(OWNED_PART.fullmatch(p) for p in parts):  # also refuses "", ".", "..", "/x" and "x\n"
            return False
        path = self.folder
        for part in parts[:-1]:  # no link on the way: a linked folder leads outside
            path = path / part
            if path.is_symlink():
                return False
        return True

    def owns(self, name: str) -> bool:
        return name in self.names and not (self.folder / name).is_symlink()

    def check(self, names: Iterable[str]) -> None:
        """`ValueError` naming the first of `names` that exists in the folder and ampkit did not write."""
        for name in names:
            path = self.folder / name
            if (path.exists() or path.is_symlink()) and not self.owns(name):
                raise ValueError(
                    f"{path} exists and ampkit did not write it (no earlier ampkit report in {self.folder} records "
                    f"it in {OWNED_RECORD}): ampkit never overwrites or deletes it; move it or choose another --out"
                )

    def claim(self, names: Iterable[str]) -> None:
        """`check(names)`, then record them as ampkit's before they are written (a crash leaves a record of
        a file not yet there, never a file of ampkit's that the record does not name)."""
        names = list(names)
        self.check(names)
        if not set(names) <= self.names:
            self.names |= set(names)
            self.folder.mkdir(parents=True, exist_ok=True)
            blob = json.dumps({"format": "ampkit-owned", "files": sorted(self.names)}, indent=1).encode()
            atomic_write(self.folder / OWNED_RECORD, lambda f: f.write(blob))

    def remove(self, name: str) -> None:
        """Delete `name` if ampkit wrote it: a file, or a folder holding only recorded files and folders."""
        path = self.folder / name
        if not self.owns(name) or not path.exists():
            return
        with contextlib.suppress(OSError):
            if path.is_file():
                path.unlink()
            elif path.is_dir():
                for inner in list(path.iterdir()):
                    self.remove(f"{name}/{inner.name}")
                path.rmdir()  # fails, and keeps the folder, where anything of the user's is left
