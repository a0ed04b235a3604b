"""Complete, atomic, safe training checkpoints: a crash never loses the last good state.

One digest-sealed file of tensors and plain data (`payload.py`), or under strategy="fsdp" a folder of
DCP shards plus that file (`sharded.py`), holding everything that decides the next step (`state.py`):
checked against the setup before anything changes, restored bit for bit under the same preset or
converted from the fp32 truth under another. Folders of checkpoints: `folder.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ampkit.checkpoint import folder, payload, sharded, state
from ampkit.engine.distributed import barrier
from ampkit.engine.launch import checkpoint_place
from ampkit.errors import CheckpointError

if TYPE_CHECKING:
    from ampkit.checkpoint.training import Training

__all__ = ["save", "load", "read", "save_checkpoint", "resume"]


def save(acc: Training, path: str | Path, overwrite: bool = False) -> Path:
    """Write a checkpoint of `acc`'s whole training state to `path`, atomically. Under torchrun every
    rank calls it (their random states are gathered); rank 0 writes; all return once it is durable.
    What is at `path` is replaced only if ampkit wrote it (a checkpoint), or with `overwrite=True`."""
    if not isinstance(overwrite, bool):
        raise TypeError(f"acc.save(path, overwrite={overwrite!r}): expected True or False")
    path = checkpoint_place(Path(path))
    if acc.strategy == "fsdp":
        path = path.with_suffix("") if path.suffix == ".pt" else path
        if not overwrite and (path.exists() or path.is_symlink()) and not sharded.is_own_folder(path):
            raise CheckpointError(
                f"cannot save to {path}: it holds files a sharded save did not write; ampkit does not replace "
                "them. Choose another path, or pass overwrite=True to replace it"
            )
        path = sharded.save(acc, path, dict(state.collect(acc, weights=False), sharded=True), payload.write)
    elif path.is_dir():
        raise CheckpointError(
            f"cannot save a checkpoint to {path}: it is a folder (use acc.save_checkpoint(folder) for folders)"
        )
    else:
        if not overwrite:
            payload.check_replaceable(path)
        data = state.collect(acc)
        if acc.is_main:
            payload.write(path, data)
    barrier()
    return path


def read(path: str | Path) -> dict:
    """Load and verify the checkpoint at `path`: a file, or the folder of a sharded checkpoint
    (whose shards are read later, without running code, by `sharded.loader`)."""
    path = Path(path)
    data = payload.read(path / sharded.META if path.is_dir() else path)
    if path.is_dir() and not data.get("sharded"):
        raise CheckpointError(f"checkpoint {path} holds a {sharded.META} that is not a sharded checkpoint's")
    if not path.is_dir() and data.get("sharded"):
        raise CheckpointError(f"checkpoint {path} is the metadata of a sharded checkpoint: load its folder")
    return data


def load(acc: Training, path: str | Path) -> None:
    """Restore `acc` from the checkpoint at `path` (a sharded one into any number of ranks);
    `CheckpointError`, and nothing changed, if it does not fit."""
    path = checkpoint_place(Path(path), reading=True)
    data = read(path)
    state.apply(
        acc, data, path, load_shards=sharded.loader(acc, path, data.get("shards")) if data.get("sharded") else None
    )


def save_checkpoint(acc: Training, directory: str | Path, keep: int = 3) -> Path:
    """Save `step-<applied steps>.pt` in `directory`, record it in the manifest, keep the newest `keep`."""
    path = folder.save_checkpoint(acc, checkpoint_place(Path(directory)), keep, save)
    barrier()  # no rank goes on (or reads the folder) before the checkpoint is durable
    return path


def resume(acc: Training, directory: str | Path) -> Path | None:
    """Load the newest loadable checkpoint in `directory` (a checkpoint file is loaded as it is); None on a fresh
    start."""
    return folder.resume(acc, checkpoint_place(Path(directory)), load)
