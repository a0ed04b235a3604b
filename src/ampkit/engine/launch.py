"""Launch-time settings: what a launcher chooses for a script without editing it.

`ampkit run`, `ampkit compare train.py`, plain `torchrun` or a cluster scheduler set environment
variables; every `Accelerator` reads them for the arguments its script did not pass:

| variable                  | Accelerator argument | values                                                  |
|---------------------------|----------------------|---------------------------------------------------------|
| `AMPKIT_PRECISION`        | `precision`          | a preset name or "auto"                                 |
| `AMPKIT_GRAD_ACCUM_STEPS` | `grad_accum_steps`   | an integer >= 1                                         |
| `AMPKIT_COMPILE`          | `compile`            | 1/true/on, 0/false/off, or a torch.compile mode         |
| `AMPKIT_MAX_STEPS`        | (`acc.max_steps`)    | an integer >= 1: training passes end after that many    |
|                           |                      | optimizer steps (evaluation still runs)                 |

`AMPKIT_CHECKPOINT_ROOT` (a folder) places every checkpoint path of `acc.save`, `acc.save_checkpoint` and
`acc.resume`, and the trackers' `log_dir`, under it (`/home/u/run/ckpt` → `<root>/home/u/run/ckpt`; `acc.load`
reads there first): the tools that run a script several times (`ampkit compare`, `doctor`, `plan`) give each run
its own (`own_checkpoints`), so no run resumes another's checkpoints or writes into the user's logs.

An argument the script passes wins (`precision="auto"` counts as not passed: "auto" asks ampkit to
choose, and the launcher's choice is ampkit's). Where a variable is set, one warning per
Accelerator (on rank 0) says which value came from where. A bad value raises `ValueError` naming
the variable, before anything is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ampkit.errors import PrecisionError
from ampkit.precision.policy import PRESET_NAMES
from ampkit.util.processes import end, popen_owned
from ampkit.util.validate import missing_script

ENV = {
    "precision": "AMPKIT_PRECISION",
    "grad_accum_steps": "AMPKIT_GRAD_ACCUM_STEPS",
    "compile": "AMPKIT_COMPILE",
    "max_steps": "AMPKIT_MAX_STEPS",
}
CHECKPOINT_ROOT = "AMPKIT_CHECKPOINT_ROOT"
DEFAULTS: dict[str, Any] = {"precision": "auto", "grad_accum_steps": 1, "compile": False, "max_steps": None}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def read_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The AMPKIT_* settings set in `environ` (default: `os.environ`), parsed, by Accelerator argument name."""
    environ = os.environ if environ is None else environ
    found: dict[str, Any] = {}
    for key, var in ENV.items():
        text = environ.get(var, "").strip()
        if not text:
            continue
        if key == "precision":
            if text not in PRESET_NAMES:
                raise PrecisionError(f"{var}={text!r}: unknown precision; choose one of: {', '.join(PRESET_NAMES)}")
            found[key] = text
        elif key == "compile":
            low = text.lower()
            if low not in (*_TRUE, *_FALSE, *COMPILE_MODES):
                raise ValueError(
                    f"{var}={text!r}: expected 1/true/on, 0/false/off or a torch.compile mode "
                    f"({', '.join(COMPILE_MODES)}); fix or unset {var}"
                )
            found[key] = low in _TRUE or ({"mode": low} if low in COMPILE_MODES else False)
        else:
            with contextlib.suppress(ValueError):
                found[key] = int(text)
            if found.get(key, 0) < 1:
                raise ValueError(f"{var}={text!r}: expected an integer >= 1; fix or unset {var}")
    return found


def launch_settings(given: dict[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Merge an Accelerator's arguments (`given`; None or precision "auto": not passed) with the
    environment's settings; return every key of `ENV` with its value, defaults filled in."""
    environ = os.environ if environ is None else environ
    env = read_env(environ)
    chosen, notes = {}, []
    for key, var in ENV.items():
        value = given.get(key)
        passed = value is not None and not (key == "precision" and value == "auto")
        if key in env and not passed:
            notes.append(f"{key}={env[key]!r} from {var}")
        elif key in env and env[key] != value:
            notes.append(
                f"{key}={getattr(value, 'name', value)!r} from the script ({var}={environ[var]} ignored: "
                "arguments passed to Accelerator win)"
            )
        chosen[key] = value if passed else env.get(key, DEFAULTS[key] if value is None else value)
    if notes and environ.get("RANK", "0") == "0":
        warnings.warn("ampkit launch settings: " + "; ".join(notes), stacklevel=3)
    return chosen


def max_steps_reached(acc: Any) -> bool:
    """Whether `acc.max_steps` (AMPKIT_MAX_STEPS) is spent: its first prepared optimizer has run that
    many steps. Its prepared loaders then end their training passes (those iterated with autograd on:
    evaluation under torch.no_grad runs whole) and `acc.epochs()` ends; a loop that counts its own
    steps (`while step < n:`) needs its own limit."""
    return steps_spent(acc.optimizers, acc.max_steps)


def steps_spent(optimizers: Sequence[Any], max_steps: int | None) -> bool:
    """Whether the first of the prepared `optimizers` has run `max_steps` steps (`max_steps_reached`)."""
    return max_steps is not None and bool(optimizers) and optimizers[0].attempted_steps >= max_steps


def check_metric(name: Any, higher_is_better: Any) -> None:
    """`acc.report_metric`'s arguments: a non-empty name, and a direction that is True, False or None."""
    if not isinstance(name, str) or not name or not isinstance(higher_is_better, (bool, type(None))):
        raise TypeError(
            f"report_metric({name!r}, value, higher_is_better={higher_is_better!r}): expected a "
            f"non-empty name and higher_is_better True, False or None"
        )


def launch(
    script: str,
    args: Sequence[str] = (),
    *,
    nproc: int = 1,
    settings: Mapping[str, Any] | None = None,
    torchrun_args: Sequence[str] = (),
) -> int:
    """Run `script` with `args` as `python script args...` (nproc 1) or under torchrun (nproc > 1,
    `torchrun_args` passed to it: --nnodes, --node-rank, --rdzv-endpoint, ...), with `settings`
    (Accelerator argument name -> value, as `ENV` names them) set as AMPKIT_* variables. Returns the
    script's (or torchrun's) exit code; the script's output and traceback are its own."""
    if problem := missing_script(script):
        raise FileNotFoundError(problem)
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc {nproc!r}: expected an integer >= 1 (processes on this node)")
    env = dict(os.environ)
    for key, value in (settings or {}).items():
        if value is not None and value is not False:
            env[ENV[key]] = "1" if value is True else str(value)
    read_env(env)  # a bad value fails here, naming its variable, before anything starts
    cmd = [sys.executable, script, *args]
    if nproc > 1 or torchrun_args:
        rendezvous = (
            [] if any(a.startswith(("--nnodes", "--rdzv", "--master")) for a in torchrun_args) else ["--standalone"]
        )
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *rendezvous,
            f"--nproc-per-node={nproc}",
            *torchrun_args,
            script,
            *args,
        ]
    proc = popen_owned(cmd, env=env)  # SIGTERM'd if this process dies; torchrun then ends its ranks
    try:
        return proc.wait()
    except KeyboardInterrupt:  # the child got the Ctrl-C too: let it finish on its own terms
        return proc.wait()
    finally:
        end(proc)  # stopped otherwise (SIGTERM: SystemExit): the script or torchrun ends with us


def run_as_main(script: str | Path, args: Sequence[str] = ()) -> None:
    """Run `script` in this process as `python script args...` would (`__main__`, its `sys.argv`, its
    folder first on `sys.path`), both restored after; its exceptions, SystemExit included, propagate."""
    import runpy

    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *map(str, args)]
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def checkpoint_place(path: Path, reading: bool = False) -> Path:
    """Where a checkpoint path of the script goes: itself, or under AMPKIT_CHECKPOINT_ROOT where that is set
    (its parent folders made there; `reading`: the placed path only if it exists, e.g. a pretrained file)."""
    root = os.environ.get(CHECKPOINT_ROOT, "").strip()
    if not root:
        return path
    full, base = path.resolve(), Path(root).resolve()
    if full.is_relative_to(base):  # placed already (a checkpoint of a placed folder)
        return path
    placed = base / full.relative_to(full.anchor)
    if reading:
        return placed if placed.exists() else path
    placed.parent.mkdir(parents=True, exist_ok=True)
    return placed


@dataclasses.dataclass
class OwnCheckpoints:
    """The checkpoint folder a tool's run of a script had to itself (`own_checkpoints`)."""

    root: Path
    used: bool = False  # the script wrote a checkpoint (known once the run ended)


@contextlib.contextmanager
def own_checkpoints(label: str) -> Iterator[OwnCheckpoints]:
    """Run a script with its checkpoints placed in a new temporary folder, removed afterwards: a run that
    resumes (`acc.resume(folder)`) starts fresh instead of loading an earlier run's, whatever its precision."""
    own = OwnCheckpoints(Path(tempfile.mkdtemp(prefix=f"ampkit-{label}-checkpoints-")))
    saved = os.environ.get(CHECKPOINT_ROOT)
    os.environ[CHECKPOINT_ROOT] = str(own.root)
    try:
        yield own
    finally:
        own.used = any(p.is_file() for p in own.root.rglob("*"))  # not only the folders placing made
        os.environ.pop(CHECKPOINT_ROOT, None)
        if saved is not None:
            os.environ[CHECKPOINT_ROOT] = saved
        shutil.rmtree(own.root, ignore_errors=True)  # made above: nothing in it is the user's
