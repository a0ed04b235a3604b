"""Sharded checkpoints (strategy="fsdp"): a folder written by torch.distributed.checkpoint (DCP), renamed
into place once every rank's shards and rank 0's `ampkit.pt` are durable. Reading runs no code: DCP's
`.metadata` pickle goes through an unpickler admitting only DCP's records, other entries through
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ampkit.engine.distributed import barrier
from ampkit.errors import CheckpointError, first_line
from ampkit.util import files

if TYPE_CHECKING:
    from ampkit.checkpoint.training import Training

META = "ampkit.pt"
DCP_META = ".metadata"
#: What a folder this module wrote may hold (anything else means it is not only ampkit's).
OWN_FILE_SUFFIXES = (".distcp",)
OWN_FILES = (META, DCP_META)

_DCP = "torch.distributed.checkpoint.metadata"
#: Every global a DCP `.metadata` pickle may name, as exact (module, name) pairs: a closed list. A dotted
#: name is refused outright, since pickle would resolve `torch.os.system` inside an admitted module.
_ALLOWED = frozenset(
    {
        (_DCP, "Metadata"),
        (_DCP, "MetadataIndex"),
        (_DCP, "StorageMeta"),
        (_DCP, "TensorProperties"),
        (_DCP, "TensorStorageMetadata"),
        (_DCP, "BytesStorageMetadata"),
        (_DCP, "ChunkStorageMetadata"),
        (_DCP, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata records, torch dtypes/sizes/layouts and paths; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in _ALLOWED:
                return super().find_class(module, name)
            kinds = (torch.dtype, torch.layout, torch.memory_format)
            if module == "torch" and isinstance(value := getattr(torch, name, None), kinds):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def read_metadata(path: Path) -> Any:
    """DCP's metadata of the sharded checkpoint at `path`, read without running code."""
    try:
        with open(path / DCP_META, "rb") as f:
            return _MetadataUnpickler(f).load()
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {path}: its {DCP_META} is damaged or holds objects other than DCP's "
            f"metadata (it could run code): {exc}"
        ) from None


def _reader_and_planner(path: Path) -> tuple[Any, Any]:
    """DCP's file reader and load planner, made to read without running code."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata(path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            loaded = torch.load(value, weights_only=True)  # DCP's own planner passes weights_only=False
            if self.flatten_state_dict:
                target: Any = self.original_state_dict  # nested dicts and lists, by the path in `key`
                key = self.mappings[read_item.dest_index.fqn]
                for part in key[:-1]:
                    target = target[part]
                target[key[-1]] = loaded
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeReader(str(path)), SafePlanner()


def save(acc: Training, path: Path, payload: dict[str, Any], write_meta: Any) -> Path:
    """Write the shards of `acc`'s one model and its optimizers, then `write_meta(tmp / META)`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if len(acc.models) != 1:
        raise CheckpointError(f"strategy='fsdp' checkpoints one model; this Accelerator prepared {len(acc.models)}")
    model_sd, optim_sd = get_state_dict(acc.models[0], [o.optimizer for o in acc.optimizers])
    tmp = path.with_name(f".{path.name}.tmp")
    if acc.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # ampkit's own temporary folder of a killed save
        path.parent.mkdir(parents=True, exist_ok=True)
    barrier()
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    except OSError as exc:
        raise CheckpointError(
            f"could not write {path}: {exc.strerror or exc}; the previous checkpoint is intact"
        ) from exc
    if acc.is_main:  # every rank's shards are durable: seal each with its digest, in ampkit's own file
        write_meta(tmp / META, dict(payload, shards={p.name: _file_digest(p) for p in _shard_files(tmp)}))
    barrier()
    if acc.is_main:
        old = path.with_name(f".{path.name}.old")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        files.fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    barrier()
    return path


def _shard_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name not in OWN_FILES)


def _file_digest(path: Path, inside: Path | None = None) -> str:
    h = hashlib.sha256()
    with files.open_regular(path, inside=inside) as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def verify(path: Path, shards: Any) -> None:
    """`CheckpointError` unless every file `.metadata` reads from is a shard in `path` whose bytes match the
    digest ampkit recorded at save (in `ampkit.pt`, itself sealed): DCP's own files carry none."""
    metadata = read_metadata(path)
    if not isinstance(shards, dict) or not shards:
        raise CheckpointError(
            f"checkpoint {path} records no digests of its shards (an older ampkit wrote it, or it was edited): "
            "ampkit loads only shards it can verify; load it with the ampkit that wrote it and save it again"
        )
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise CheckpointError(f"checkpoint {path}: its {DCP_META} lists no shard files")
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name not in shards or Path(name).name != name or name in OWN_FILES:
            raise CheckpointError(
                f"checkpoint {path}: its {DCP_META} reads from {name!r}, which is not one of the shards ampkit "
                "wrote into that folder (edited to point elsewhere?): nothing was loaded"
            )
    for name, recorded in shards.items():
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"checkpoint {path} records a shard named {name!r}: not a file in the folder")
        if (path / name).is_symlink() or _file_digest(path / name, inside=path) != recorded:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: shard {name} does not match the SHA-256 digest recorded at save"
            )


def loader(acc: Training, path: Path, shards: Any = None) -> Any:
    """A function that loads the shards at `path` into `acc`'s model and optimizers (resharding), once
    every shard is verified against `shards`, the digests recorded at save."""
    verify(path, shards)  # refuse a damaged, edited or code-carrying checkpoint before anything changes

    def load() -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model, optimizers = acc.models[0], [o.optimizer for o in acc.optimizers]
        model_sd, optim_sd = get_state_dict(model, optimizers)
        try:
            reader, planner = _reader_and_planner(path)
            dcp.load({"model": model_sd, "optim": optim_sd}, storage_reader=reader, planner=planner)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise CheckpointError(
                f"checkpoint {path} does not fit this model or is damaged: {first_line(exc)}"
            ) from None
        set_state_dict(model, optimizers, model_state_dict=model_sd, optim_state_dict=optim_sd)

    if len(acc.models) != 1:
        raise CheckpointError(f"checkpoint {path} is sharded (one model); this Accelerator prepared {len(acc.models)}")
    return load


def is_own_folder(path: Path) -> bool:
    """Whether `path` holds only what a sharded save writes (so removing it deletes nothing of the user's)."""
    try:
        return path.is_dir() and all(
            p.is_file() and (p.name in OWN_FILES or p.name.endswith(OWN_FILE_SUFFIXES)) for p in path.iterdir()
        )
    except OSError:
        return False
