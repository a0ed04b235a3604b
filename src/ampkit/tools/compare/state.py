"""The comparison's folder between runs: each finished run's record under `STATE_DIR` (what `--resume`
keeps), forgetting an earlier comparison's records, and the check that the folder can be written at all.

Apart from the run loop (`runner`) because it is all about files: what a comparison leaves behind and
reads back, checked before any training is spent.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

from ampkit.checkpoint.folder import remove_folder
from ampkit.tools.compare.records import Run, validate_run
from ampkit.util.files import OwnedFiles

STATE_DIR = ".compare"  # in `out`: each finished run's record and each running one's checkpoints


def file_stem(run: str) -> str:
    """A run's name as its files in `STATE_DIR` are named: "fp32 (seed 1)" -> "fp32-seed-1". Only letters,
    digits and `_.+-`, the names `OwnedFiles` records (a space or a bracket is a name it refuses)."""
    return re.sub(r"[^A-Za-z0-9_.+-]+", "-", run).strip("-")


def forget_runs(owned: OwnedFiles) -> None:
    """Delete what an earlier comparison in `owned`'s folder recorded under `STATE_DIR`, and nothing else."""
    for name in sorted(n for n in owned.names if n.startswith(f"{STATE_DIR}/")):
        path = owned.folder / name
        if name.endswith(".ckpt") and owned.owns(name):
            remove_folder(path)  # the checkpoint folder's own manifest says what is ampkit's in it
        else:
            owned.remove(name)
    owned.remove(STATE_DIR)


def check_writable(out: Path) -> None:
    """Refuse an output folder that cannot be written, before a comparison's training is spent."""
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"cannot write the report into {str(out)!r}: it is a file; name a folder (it is created if missing)"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise ValueError(
            f"cannot write the report into {str(out)!r} ({exc.strerror or exc}); name a folder you can write to"
        ) from None


def finished_runs(state_dir: Path, names: list[str]) -> dict[str, Run]:
    """The runs an interrupted comparison finished, read before any training so a bad file stops it first."""
    kept = {}
    for name in names:
        path = state_dir / f"{file_stem(name)}.json"
        if path.exists():
            try:
                kept[name] = validate_run(json.loads(path.read_bytes()))
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors too
                raise ValueError(
                    f"cannot resume: {path} is not a finished run's record ({exc}); delete it to run {name} again"
                ) from None
    return kept
