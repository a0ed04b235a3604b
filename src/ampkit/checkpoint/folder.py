"""A folder of checkpoints: save every N steps, keep the newest few, resume from the newest good one.
Its manifest (`ampkit-checkpoints.json`) names the writing run and its checkpoints, oldest first; ampkit
deletes only what it says ampkit wrote (and dead writers' temporary files), and never mixes two runs.
A manifest entry must be an ampkit checkpoint name (`step-NNNNNNNN[.pt]`) directly inside the folder:
anything else (`../x`, an absolute path, `sub/x`) is a tampered manifest and a clear error, never a
deletion. One process writes a folder at a time (`ampkit-checkpoints.lock`, holding its pid and host).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import socket
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ampkit.checkpoint import payload, sharded
from ampkit.errors import CheckpointError
from ampkit.util import files

if TYPE_CHECKING:
    from ampkit.checkpoint.training import Training

MANIFEST = "ampkit-checkpoints.json"
LATEST = "latest"  # the newest checkpoint's name, for people and older tools
LOCK = "ampkit-checkpoints.lock"  # "<pid> <host>" of the process writing the folder
_NAME = re.compile(r"step-\d{8,}(\.pt)?")  # (fullmatch) a file, or a folder of shards (strategy="fsdp")


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest, or None where there is none; `CheckpointError` if it is unreadable."""
    path = folder / MANIFEST
    if not path.exists() and not path.is_symlink():
        return None
    try:
        manifest = files.read_json(path, inside=folder)
        if not isinstance(manifest, dict) or manifest.get("format") != "ampkit-checkpoints":
            raise CheckpointError("not an ampkit manifest")
        if not isinstance(manifest.get("checkpoints"), list) or not isinstance(manifest.get("run_id"), str):
            raise CheckpointError("not an ampkit manifest")
    except CheckpointError as exc:
        raise CheckpointError(
            f"{path} cannot be read ({exc}): ampkit will not guess which files in {folder} are its own; "
            f"move the folder's checkpoints elsewhere or delete the damaged manifest"
        ) from None
    bad = [name for name in manifest["checkpoints"] if not is_name(name)]
    if bad:
        raise CheckpointError(
            f"{path} lists {bad[0]!r}, which is not an ampkit checkpoint (step-NNNNNNNN or step-NNNNNNNN.pt directly "
            f"in {folder}): the manifest was edited or damaged, so ampkit neither loads nor deletes through it; "
            f"restore the manifest or move the checkpoints you want into a new folder"
        )
    return manifest


def is_name(name: object) -> bool:
    """Whether `name` is exactly a checkpoint name ampkit writes (no trailing newline, space or other char)."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def _step(path: Path) -> int:
    return int(path.name.removeprefix("step-").removesuffix(".pt"))


def candidates(folder: Path) -> list[Path]:
    """The checkpoints resume may load, newest first. Without a manifest (or with a damaged one, with a
    warning) nothing says which files are one run's, so there is no fallback: `latest`'s checkpoint, else
    the newest."""
    try:
        manifest = read_manifest(folder)
    except CheckpointError as exc:
        warnings.warn(f"{exc}; resuming from the newest checkpoint instead", stacklevel=4)
        manifest = None
    else:
        if manifest is not None:
            return [folder / name for name in reversed(manifest["checkpoints"])]
    found = sorted((p for p in folder.iterdir() if is_name(p.name)), key=_step, reverse=True)
    try:
        named = folder / files.read_regular(folder / LATEST, files.SMALL_FILE, inside=folder).decode().strip()
    except UnicodeDecodeError:
        warnings.warn(f"{folder / LATEST} is not text; ignoring it and taking the newest checkpoint", stacklevel=3)
        return found[:1]
    except CheckpointError as exc:
        if (folder / LATEST).exists() or (folder / LATEST).is_symlink():
            warnings.warn(f"ignoring {exc}; taking the newest checkpoint", stacklevel=3)
        return found[:1]
    return [named] if named in found else found[:1]


def save_checkpoint(acc: Training, folder: Path, keep: int, save: Any) -> Path:
    """Save `step-<applied steps>` in `folder` with `save(acc, path)`, record it, then prune to `keep`."""
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ValueError(f"keep={keep!r}: expected an integer >= 1 (how many checkpoints to keep)")
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"cannot save checkpoints in {folder}: it is a file, not a folder; pass a folder path")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create the checkpoint folder {folder}: {exc.strerror or exc}") from None
    if acc.is_main:
        _lock(folder)
    manifest = read_manifest(folder) or {"format": "ampkit-checkpoints", "run_id": acc.run_id, "checkpoints": []}
    if manifest["run_id"] != acc.run_id:
        newest = manifest["checkpoints"][-1] if manifest["checkpoints"] else "none left"
        raise CheckpointError(
            f"{folder} holds the checkpoints of another run (newest: {newest}); this run did not resume from "
            f"it. Call acc.resume({str(folder)!r}) before training to continue that run, or save into "
            f"another folder"
        )
    name = f"step-{acc.state.applied_steps:08d}{'' if acc.strategy == 'fsdp' else '.pt'}"
    path = folder / name
    if path.exists() and name not in manifest["checkpoints"] and not _this_runs(path, acc.run_id):
        raise CheckpointError(
            f"{path} exists and was not written by this run: ampkit does not overwrite it; move it or save elsewhere"
        )
    save(acc, path, overwrite=True)  # checked above: free, listed, or this run's
    if acc.is_main:
        manifest["checkpoints"] = [n for n in manifest["checkpoints"] if n != name] + [name]
        _write_manifest(folder, manifest)
        files.atomic_write(folder / LATEST, lambda f: f.write(name.encode() + b"\n"))
        _prune(folder, manifest, keep)  # only now: the new checkpoint is durable
        _remove_stale_temp_files(folder)
    return path


_HELD: set[Path] = set()


def _lock(folder: Path) -> None:
    """Make this process the folder's one writer, or raise `CheckpointError` naming the live one. Two
    writers would overwrite each other's `step-N` files and leave checkpoints no manifest lists."""
    path, me = folder / LOCK, (os.getpid(), socket.gethostname())
    if path.resolve() in _HELD:
        if _holder(path, folder) == me:
            return
        # deleted (the folder removed mid-run) or replaced since: take it again, or be told who holds it now
        _HELD.discard(path.resolve())
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        try:
            pid_text, host = files.read_regular(path, files.SMALL_FILE, inside=folder).decode().split()
            pid = int(pid_text)
        except CheckpointError as exc:  # a FIFO, a device, a link out or a huge file: not a lock ampkit wrote
            raise CheckpointError(f"{exc}; it is not a lock ampkit wrote: remove it") from None
        except ValueError:
            pid, host = -1, me[1]  # a lock cut short by a kill mid-write: its writer is gone
        if (pid, host) != me and (host != me[1] or files.pid_alive(pid)):
            raise CheckpointError(
                f"{folder} is being written by another process (pid {pid} on {host}, per {path}): two writers "
                f"would overwrite each other's checkpoints. Save into another folder, or delete {path} if that "
                f"process is gone"
            ) from None
        files.atomic_write(path, lambda f: f.write(f"{me[0]} {me[1]}\n".encode()))  # its writer is gone
    else:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"{me[0]} {me[1]}\n")
    _HELD.add(path.resolve())
    atexit.register(_unlock, path)


def _holder(path: Path, folder: Path) -> tuple[int, str] | None:
    """(pid, host) the lock at `path` names; None where it is missing or not a lock ampkit wrote."""
    try:
        pid_text, host = files.read_regular(path, files.SMALL_FILE, inside=folder).decode().split()
        return int(pid_text), host
    except (OSError, ValueError, CheckpointError):
        return None


def _unlock(path: Path) -> None:
    holder = _holder(path, path.parent)
    with contextlib.suppress(OSError):
        if holder is not None and holder[0] == os.getpid():
            path.unlink()
    _HELD.discard(path.resolve())


def _this_runs(path: Path, run_id: str) -> bool:
    """Whether `path` is a checkpoint this run wrote (a kill can land between writing it and recording it)."""
    try:
        data = payload.read(path / sharded.META if path.is_dir() else path)
    except CheckpointError:
        return False
    return data["accelerator"].get("run_id") == run_id


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    files.atomic_write(folder / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))


def _prune(folder: Path, manifest: dict[str, Any], keep: int) -> None:
    old, kept = manifest["checkpoints"][:-keep], manifest["checkpoints"][-keep:]
    if not old:
        return
    manifest["checkpoints"] = kept
    _write_manifest(folder, manifest)  # forget them first: a crash now leaves files, never a dangling entry
    for name in old:
        _remove_own(folder, name)


def _remove_own(folder: Path, name: str) -> None:
    """Delete checkpoint `name` (a name `read_manifest` checked) inside `folder`; never through a link."""
    path = folder / name
    with contextlib.suppress(OSError):
        if path.is_symlink() or path.resolve().parent != folder.resolve():
            warnings.warn(f"not removing {path}: it is a link, and ampkit deletes only its own files", stacklevel=5)
        elif path.is_file():
            path.unlink()
        elif path.is_dir() and sharded.is_own_folder(path):
            shutil.rmtree(path)
        elif path.exists():
            warnings.warn(f"not removing {path}: it holds files ampkit did not write", stacklevel=5)


def remove_folder(folder: Path) -> None:
    """Delete a checkpoint folder ampkit wrote: the checkpoints its manifest lists, the manifest, `latest`,
    dead writers' temporary files, then the folder if nothing else is left (what else is there stays)."""
    if folder.is_symlink() or not folder.is_dir():
        return
    manifest = read_manifest(folder)
    for name in manifest["checkpoints"] if manifest is not None else []:
        _remove_own(folder, name)
    _remove_stale_temp_files(folder)
    for name in (LATEST, MANIFEST, LOCK):
        with contextlib.suppress(OSError):
            if (folder / name).is_file() and not (folder / name).is_symlink():
                (folder / name).unlink()
    _HELD.discard((folder / LOCK).resolve())
    with contextlib.suppress(OSError):
        folder.rmdir()  # fails, and keeps the folder, where anything of the user's is left in it


def _remove_stale_temp_files(folder: Path) -> None:
    """Temporary files of ampkit writers killed mid-write (their process is gone)."""
    own = {MANIFEST, LATEST}
    for path in folder.iterdir():
        m = files.TEMP_NAME.match(path.name)
        if m and (m["name"] in own or is_name(m["name"])) and path.is_file() and not files.pid_alive(int(m["pid"])):
            with contextlib.suppress(OSError):
                path.unlink()


def resume(acc: Training, folder: Path, load: Any) -> Path | None:
    """Load the newest checkpoint of `folder` that loads, with `load(acc, path)`; None on a fresh start.
    A broken one is skipped with a warning; if all fail, a `CheckpointError` lists each and why."""
    if folder.is_file():
        load(acc, folder)
        return folder
    if not folder.is_dir():
        return None
    tried: list[str] = []
    for path in candidates(folder):
        if not path.exists():
            tried.append(f"{path.name}: listed in the manifest but missing")
            continue
        if path.is_symlink() and path.resolve().parent != folder.resolve():
            tried.append(f"{path.name}: a link out of {folder}; ampkit loads only checkpoints inside it")
            warnings.warn(f"skipping {path}: it is a link out of {folder}", stacklevel=3)
            continue
        try:
            load(acc, path)
            return path
        except CheckpointError as exc:
            tried.append(f"{path.name}: {exc}")
            warnings.warn(f"skipping {exc}; trying the previous checkpoint", stacklevel=3)
    if tried:
        raise CheckpointError(f"no checkpoint in {folder} could be loaded (nothing was changed): " + " | ".join(tried))
    return None
