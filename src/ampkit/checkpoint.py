"""Complete, atomic, safe training checkpoints: a crash never loses the last good state.

One checkpoint is one file written by `torch.save` holding only tensors and plain data (so it loads
with `torch.load(weights_only=True)`: nothing in it can run code), plus a SHA-256 digest of its
content, because a flipped byte inside a tensor still unzips. It is written to a temporary file in
the same folder, fsynced, renamed over the final name and the folder fsynced; the `latest` marker is
updated the same way, and old checkpoints are pruned only after the new one is durable.

What is saved is everything that decides the next step: models (and the fp32 truth behind
low-precision weights: master copies or Kahan buffers), optimizers with their state in its exact
dtype, schedulers, the loss scaler, step counters and the position inside an accumulation cycle,
every RNG (python, numpy, torch CPU and CUDA), each prepared loader's epoch, batch index and the
random state its shuffle started from, the precision policy and the versions.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import torch

from ampkit.distributed import barrier, gather_objects, local_tensor
from ampkit.errors import CheckpointError
from ampkit.optim import Stage

if TYPE_CHECKING:
    from ampkit.accelerator import Accelerator

FORMAT = "ampkit-checkpoint"
VERSION = 1
LATEST = "latest"
_NAME = re.compile(r"^step-(\d+)(\.pt)?$")  # a file, or a folder of shards (strategy="fsdp")


# --- writing files so that a crash leaves the old file or the new one, never half of one --------
def _fsync_dir(folder: Path) -> None:
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
    _fsync_dir(path.parent)


# --- digest -------------------------------------------------------------------------------------
def _digest(obj: Any) -> str:
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


# --- what a checkpoint holds --------------------------------------------------------------------
def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "python": _tuples_to_lists(random.getstate()),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].copy()), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_lists_to_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def _tuples_to_lists(o: Any) -> Any:
    return [_tuples_to_lists(v) for v in o] if isinstance(o, (tuple, list)) else o


def _lists_to_tuples(o: Any) -> Any:
    return tuple(_lists_to_tuples(v) for v in o) if isinstance(o, list) else o


def _cpu(obj: Any) -> Any:
    """A copy of nested state with every tensor on the CPU (a checkpoint must load anywhere)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def _param_names(acc: Accelerator) -> dict[int, tuple[int, str]]:
    """id(parameter) -> (model index, parameter name), to key per-parameter state by name."""
    return {id(p): (i, n) for i, m in enumerate(acc.models) for n, p in m.named_parameters()}


def _fp32_truth(acc: Accelerator) -> dict[str, torch.Tensor]:
    """The fp32 value each low-precision weight stands for (its master, or weight + Kahan buffer)."""
    names = _param_names(acc)
    truth: dict[str, torch.Tensor] = {}
    for opt in acc.optimizers:
        for p, value in opt.fp32_values():
            if id(p) in names:
                i, n = names[id(p)]
                truth[f"{i}/{n}"] = value
    return truth


def _check_finite(acc: Accelerator) -> None:
    bad = []
    for i, model in enumerate(acc.models):
        for name, p in model.named_parameters():
            shard = local_tensor(p.detach())
            if shard.is_floating_point() and not bool(torch.isfinite(shard).all()):  # sync: once per save, outside the step
                bad.append(f"model {i}: {name}" if len(acc.models) > 1 else name)
    bad = sorted({name for names in gather_objects(bad) for name in names})  # every rank refuses together
    if bad:
        raise CheckpointError(
            f"refusing to save non-finite weights: {', '.join(bad[:10])}{' ...' if len(bad) > 10 else ''} "
            f"contain NaN or inf; the previous checkpoint is kept. The run has diverged: resume from the last good checkpoint "
            f"with a lower learning rate, or find the layer with `ampkit doctor --numerics`"
        )


def collect(acc: Accelerator, weights: bool = True) -> dict[str, Any]:
    """Everything that decides the next training step, as tensors and plain data.

    `weights=False` leaves out models and optimizers (FSDP checkpoints store them sharded, via DCP).
    """
    from ampkit import __version__

    _check_finite(acc)
    if any(o.stage is Stage.UNSCALED for o in acc.optimizers):
        raise CheckpointError(
            "cannot save between acc.clip_grad_norm_() and optimizer.step(): the gradients are half-way through "
            "the update; save after optimizer.step()"
        )
    pending = any(o.stage is Stage.BACKWARD for o in acc.optimizers)  # mid-accumulation: keep the gradients
    for opt in acc.optimizers:
        opt.reconcile(block=True)
    acc.cycle.flush_scale_update()
    policy = acc.policy
    meta = {
        "ampkit_version": __version__,
        "torch_version": torch.__version__,
        "precision": {"name": policy.name, "reason": policy.reason, "compute_dtype": str(policy.compute_dtype),
                      "param_dtype": str(policy.param_dtype), "master_weights": policy.master_weights,
                      "compensated": policy.compensated, "loss_scaling": policy.loss_scaling},
        "grad_accum_steps": acc.grad_accum_steps,
        "cycle_pos": acc.cycle.position,
        "epoch": acc.epoch,
        "scaler": acc.scaler.state_dict() if acc.scaler is not None else None,
        "optimizers": [
            {"attempted": o.attempted_steps, "applied": o.applied_steps, "skipped": o.skipped_steps,
             "stage": o.stage.value, "overflows_at_min": 0}
            for o in acc.optimizers
        ],
        "schedulers": [s.state_dict()["ampkit"] for s in acc.schedulers],
    }
    return {
        "format": FORMAT,
        "version": VERSION,
        "meta": json.dumps(meta, sort_keys=True),
        "models": [_cpu(m.state_dict()) for m in acc.models] if weights else [],
        "optimizers": [_cpu(o.optimizer.state_dict()) for o in acc.optimizers] if weights else [],
        "fp32_weights": _cpu(_fp32_truth(acc)) if weights else {},
        "grads": [_cpu([p.grad for p in m.parameters()]) for m in acc.models] if pending and weights else [],
        "schedulers": [_cpu(s.scheduler.state_dict()) for s in acc.schedulers],
        # Random state and data position differ per rank: keep every rank's (rank order).
        "ranks": gather_objects(_cpu({"rng": _rng_state(), "loaders": [l.state_dict() for l in acc.loaders]})),
    }


def save(acc: Accelerator, path: str | Path) -> Path:
    """Write a checkpoint of `acc`'s whole training state to `path`, atomically.

    Under torchrun every rank must call it (the ranks' random states are gathered); rank 0 writes.
    """
    path = Path(path)
    if acc.strategy == "fsdp":
        return _save_sharded(acc, path.with_suffix("") if path.suffix == ".pt" else path)
    payload = collect(acc)
    if acc.is_main:
        payload["digest"] = _digest({k: v for k, v in payload.items() if k != "digest"})
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: torch.save(payload, f))
    return path


# --- sharded checkpoints (strategy="fsdp"): a folder written by torch.distributed.checkpoint -----
_META = "ampkit.pt"


def _save_sharded(acc: Accelerator, path: Path) -> Path:
    """Every rank writes its shards (DCP) into a temporary folder; rank 0 adds the rest of the state
    and renames the folder into place once all shards are durable."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if len(acc.models) != 1:
        raise CheckpointError(f"strategy='fsdp' checkpoints one model; this Accelerator prepared {len(acc.models)}")
    payload = collect(acc, weights=False)
    payload["sharded"] = True
    model_sd, optim_sd = get_state_dict(acc.models[0], [o.optimizer for o in acc.optimizers])
    tmp = path.with_name(f".{path.name}.tmp")
    if acc.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        path.parent.mkdir(parents=True, exist_ok=True)
    barrier()
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    except OSError as exc:
        raise CheckpointError(f"could not write {path}: {exc.strerror or exc}; the previous checkpoint is intact") from exc
    if acc.is_main:
        payload["digest"] = _digest({k: v for k, v in payload.items() if k != "digest"})
        atomic_write(tmp / _META, lambda f: torch.save(payload, f))
    barrier()
    if acc.is_main:
        old = path.with_name(f".{path.name}.old")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    barrier()
    return path


def _load_sharded(acc: Accelerator, path: Path) -> None:
    """Load DCP shards into the prepared model and optimizers (resharding to this job's ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if len(acc.models) != 1:
        raise CheckpointError(f"checkpoint {path} is sharded (one model); this Accelerator prepared {len(acc.models)}")
    model, optimizers = acc.models[0], [o.optimizer for o in acc.optimizers]
    model_sd, optim_sd = get_state_dict(model, optimizers)
    try:
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    except Exception as exc:  # DCP reports missing keys and bad shards in many shapes
        raise CheckpointError(f"checkpoint {path} does not fit this model or is damaged: {str(exc).splitlines()[0]}") from None
    set_state_dict(model, optimizers, model_state_dict=model_sd, optim_state_dict=optim_sd)


def read(path: str | Path) -> dict[str, Any]:
    """Load and verify a checkpoint file; `CheckpointError` naming the file and the fault otherwise."""
    path = Path(path)
    if path.is_dir():
        if not (path / _META).is_file() or not (path / ".metadata").is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: a sharded checkpoint needs {_META} and .metadata")
        payload = read(path / _META)
        payload["dcp_path"] = str(path)
        return payload
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        text = str(exc)
        if "Weights only load failed" in text or "Unsupported global" in text or type(exc).__name__ == "UnpicklingError":
            raise CheckpointError(
                f"checkpoint {path} holds pickled objects other than tensors and plain data (it could run code); "
                f"ampkit refuses to load it. Only load such a file with torch.load(weights_only=False) if you trust its source"
            ) from None
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt: {text.splitlines()[0] if text else type(exc).__name__}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an ampkit checkpoint (no '{FORMAT}' header); it may be a plain torch.save file")
    if payload.get("version") != VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {payload.get('version')!r}; this ampkit reads version {VERSION}")
    digest = payload.get("digest")
    if digest != _digest({k: v for k, v in payload.items() if k not in ("digest", "dcp_path")}):
        raise CheckpointError(f"checkpoint {path} is corrupt: its content does not match its SHA-256 digest")
    return payload


def apply(acc: Accelerator, payload: dict[str, Any], path: Path) -> None:
    """Put a verified checkpoint's state into `acc` and everything it prepared."""
    meta = json.loads(payload["meta"])
    sharded = payload.get("sharded", False)
    if sharded:
        if "dcp_path" not in payload:
            raise CheckpointError(f"checkpoint {path} is the metadata of a sharded checkpoint: load its folder")
    else:
        _check_shapes(acc, payload, path)
    counts = [(len(acc.models), len(payload["models"]), "models"), (len(acc.optimizers), len(payload["optimizers"]), "optimizers"),
              (len(acc.schedulers), len(payload["schedulers"]), "schedulers"),
              (len(acc.loaders), len(payload["ranks"][0]["loaders"]), "data loaders")]
    for have, saved, what in counts:
        if have != saved and not (sharded and what in ("models", "optimizers")):
            raise CheckpointError(f"checkpoint {path} holds {saved} {what} but this Accelerator prepared {have}; prepare the same objects before loading")
    if meta["grad_accum_steps"] != acc.grad_accum_steps and meta["cycle_pos"] not in (0, meta["grad_accum_steps"]):
        raise CheckpointError(
            f"checkpoint {path} was saved mid-way through an accumulation cycle of {meta['grad_accum_steps']} micro-steps; "
            f"resume it with grad_accum_steps={meta['grad_accum_steps']} (now {acc.grad_accum_steps})"
        )
    for model, state in zip(acc.models, payload["models"]):
        model.load_state_dict(state)
    if sharded:
        _load_sharded(acc, Path(payload["dcp_path"]))
    else:
        _restore_weights(acc, payload)
    for i, (opt, info) in enumerate(zip(acc.optimizers, meta["optimizers"])):
        sd = opt.optimizer.state_dict() if sharded else payload["optimizers"][i]
        sd = dict(sd, ampkit={"optimizer": type(opt.optimizer).__name__, "attempted": info["attempted"], "applied": info["applied"],
                              "skipped": info["skipped"], "stage": info["stage"], "overflows_at_min": info["overflows_at_min"], "weights": None})
        opt.load_state_dict(sd)
    saved_grads = payload["grads"] or [[None] * len(list(m.parameters())) for m in acc.models]
    for model, grads in zip(acc.models, saved_grads):
        for p, g in zip(model.parameters(), grads):
            p.grad = None if g is None else g.to(p.device, p.dtype)
    for sched, state, info in zip(acc.schedulers, payload["schedulers"], meta["schedulers"]):
        sched.load_state_dict(dict(state, ampkit=dict(info, scheduler=type(sched.scheduler).__name__)))
    ranks = payload["ranks"]
    if len(ranks) != acc.world_size:
        warnings.warn(
            f"checkpoint {path} was saved by {len(ranks)} rank(s) and is resumed by {acc.world_size}: weights, optimizer "
            f"and schedule continue exactly, but the data order and random streams of the new ranks differ",
            stacklevel=3,
        )
    mine = ranks[acc.rank % len(ranks)]
    for loader, state in zip(acc.loaders, mine["loaders"]):
        loader.load_state_dict(state)
    acc.load_state_dict({"epoch": meta["epoch"], "scaler": meta["scaler"],
                         "cycle": {"steps": meta["grad_accum_steps"], "position": meta["cycle_pos"]}})
    _set_rng_state(mine["rng"])


def _restore_weights(acc: Accelerator, payload: dict[str, Any]) -> None:
    """Set every weight from the best fp32 value the checkpoint has, then rebuild master copies or
    Kahan buffers from it — so a checkpoint converts exactly between presets (fp32 → bf16-master,
    bf16-true → fp32, ...)."""
    truth = payload["fp32_weights"]
    names = _param_names(acc)

    def best(p: torch.Tensor) -> torch.Tensor:
        i, n = names[id(p)]
        value = truth.get(f"{i}/{n}", payload["models"][i][n])
        return value.to(p.device, torch.float32)

    with torch.no_grad():
        for model in acc.models:
            for p in model.parameters():
                i, n = names[id(p)]
                if f"{i}/{n}" in truth:
                    p.copy_(best(p))
        for opt in acc.optimizers:
            if opt.weights is not None:
                opt.weights.set_fp32_values({p: best(p) for p, _ in opt.fp32_values()})


def _check_shapes(acc: Accelerator, payload: dict[str, Any], path: Path) -> None:
    """One error listing every missing / unexpected key and shape mismatch, for every model."""
    problems = []
    for i, (model, saved) in enumerate(zip(acc.models, payload["models"])):
        mine = model.state_dict()
        prefix = f"model {i}: " if len(acc.models) > 1 else ""
        missing = [k for k in mine if k not in saved]
        unexpected = [k for k in saved if k not in mine]
        shapes = [f"{k} {tuple(saved[k].shape)} in the checkpoint vs {tuple(v.shape)} in the model"
                  for k, v in mine.items() if k in saved and isinstance(v, torch.Tensor) and tuple(saved[k].shape) != tuple(v.shape)]
        if missing:
            problems.append(f"{prefix}missing keys: {', '.join(missing)}")
        if unexpected:
            problems.append(f"{prefix}unexpected keys: {', '.join(unexpected)}")
        if shapes:
            problems.append(f"{prefix}shape mismatches: {'; '.join(shapes)}")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not fit this model — " + " | ".join(problems))


def load(acc: Accelerator, path: str | Path) -> None:
    """Restore `acc` from the checkpoint at `path` (an explicit load: any fault raises)."""
    path = Path(path)
    apply(acc, read(path), path)


# --- folders of checkpoints ---------------------------------------------------------------------
def _candidates(folder: Path) -> Iterator[Path]:
    """Checkpoints in `folder`, the `latest` marker's first, then newest step first."""
    steps = sorted(((int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))), reverse=True)
    ordered = [p for _, p in steps]
    marker = folder / LATEST
    with contextlib.suppress(OSError):
        named = folder / marker.read_text().strip()
        if named in ordered:
            ordered.remove(named)
            ordered.insert(0, named)
    yield from ordered


def save_checkpoint(acc: Accelerator, folder: str | Path, keep: int = 3) -> Path:
    """Save `step-<applied steps>.pt` in `folder`, point `latest` at it, then prune to `keep` files."""
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep={keep!r}: expected an integer >= 1 (how many checkpoints to keep)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    suffix = "" if acc.strategy == "fsdp" else ".pt"
    path = save(acc, folder / f"step-{acc.state.applied_steps:08d}{suffix}")
    if acc.is_main:
        atomic_write(folder / LATEST, lambda f: f.write(path.name.encode() + b"\n"))
        for old in list(_candidates(folder))[keep:]:  # only now: the new checkpoint is durable
            with contextlib.suppress(OSError):
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        for stale in folder.glob(".*.tmp-*"):  # temp files of writers that were killed mid-write
            with contextlib.suppress(OSError):
                if not _pid_alive(stale.name.rsplit("-", 1)[-1]):
                    stale.unlink()
    barrier()  # no rank goes on (or reads the folder) before the checkpoint is durable
    return path


def _pid_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def resume(acc: Accelerator, folder: str | Path) -> Path | None:
    """Load the newest valid checkpoint in `folder`; skip broken ones with a warning; None on a fresh start."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    for path in _candidates(folder):
        try:
            payload = read(path)
        except CheckpointError as exc:
            warnings.warn(f"skipping {exc}; trying the previous checkpoint", stacklevel=3)
            continue
        apply(acc, payload, path)
        return path
    return None

