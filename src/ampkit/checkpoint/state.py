"""What a checkpoint holds, gathered from the objects that own it, and put back only if all of it fits:
their `state_dict()`s plus the models, the random generators and the per-parameter fp32 values (so a
checkpoint converts between presets); a loaded one is checked *before anything changes*.
"""

from __future__ import annotations

import json
import random
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from torch.utils._pytree import tree_map_only

from ampkit.checkpoint import fields
from ampkit.engine.distributed import gather_objects, local_tensor
from ampkit.engine.optim import Stage
from ampkit.errors import CheckpointError
from ampkit.util.version import ampkit_version

if TYPE_CHECKING:
    from ampkit.checkpoint.training import Training


def _cpu(obj: Any) -> Any:
    """A copy of nested state with every tensor on the CPU (a checkpoint must load anywhere)."""
    return tree_map_only(torch.Tensor, lambda t: t.detach().to("cpu", copy=True), obj)


def _without_weights(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state whose "ampkit" entry leaves out the weight store (not saved, or not applicable)."""
    return dict(state, ampkit=dict(state["ampkit"], weights=None))


def rng_state() -> dict[str, Any]:
    legacy = cast("tuple[Any, ...]", np.random.get_state(legacy=True))  # the legacy form is a tuple
    name, keys, pos, has_gauss, cached_gaussian = legacy[:5]
    numpy = {
        "name": name,
        "keys": torch.from_numpy(keys.copy()),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }
    return {
        "python": _lists(random.getstate()),
        "numpy": numpy,
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def _lists(o: Any) -> Any:
    return [_lists(v) for v in o] if isinstance(o, (tuple, list)) else o


def _tuples(o: Any) -> Any:
    return tuple(_tuples(v) for v in o) if isinstance(o, list) else o


def _names(acc: Training) -> dict[int, str]:
    """id(parameter) -> "<model index>/<parameter name>", to key per-parameter values by name."""
    return {id(p): f"{i}/{n}" for i, m in enumerate(acc.models) for n, p in m.named_parameters()}


def _non_finite(named: Iterable[tuple[str, Any]]) -> set[str]:
    """The names of the floating-point tensors among `named` that hold NaN or inf."""
    return {
        n
        for n, t in named
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())
    }  # sync: once per save or load, outside the step


def _first(names: list[str]) -> str:
    return f"{', '.join(names[:10])}{' ...' if len(names) > 10 else ''}"


def _check_finite(acc: Training) -> None:
    several = len(acc.models) > 1
    local = _non_finite(
        (f"model {i}: {n}" if several else n, local_tensor(p.detach()))
        for i, model in enumerate(acc.models)
        for n, p in model.named_parameters()
    )
    bad = sorted({name for names in gather_objects(sorted(local)) for name in names})  # all refuse together
    if bad:
        raise CheckpointError(
            f"refusing to save non-finite weights: {_first(bad)} contain NaN or inf{_first_fault(acc)}; the "
            f"previous checkpoint is kept. The run has diverged: resume from the last good checkpoint with a lower "
            f"learning rate, or find the layer with `ampkit doctor --numerics`"
        )


def _first_fault(acc: Training) -> str:
    """Where the run first went non-finite, as far as the optimizers saw it (presets without a scaler)."""
    for opt in acc.optimizers:
        if opt.non_finite is not None and (first := opt.non_finite.first_seen()) is not None:
            step, what, value = first
            return f" (the {what} was first {value} at optimizer step {step})"
    return ""


def collect(acc: Training, weights: bool = True) -> dict[str, Any]:
    """Everything that decides the next training step, as tensors and plain data; `weights=False`
    leaves out models and optimizer state (FSDP checkpoints store them sharded)."""
    _check_finite(acc)
    if any(o.stage is Stage.UNSCALED for o in acc.optimizers):
        raise CheckpointError(
            "cannot save between acc.clip_grad_norm_() and optimizer.step(): the gradients are half-way through "
            "the update; save after optimizer.step()"
        )
    pending = any(o.stage is Stage.BACKWARD for o in acc.optimizers)  # mid-accumulation: keep the gradients
    names = _names(acc)
    optimizers = [o.state_dict() for o in acc.optimizers]
    if not weights:  # keep ampkit's own entry only: the optimizer state itself is in the shards
        optimizers = [{"ampkit": _without_weights(sd)["ampkit"]} for sd in optimizers]
    meta = {
        "ampkit_version": ampkit_version(),
        "torch_version": torch.__version__,
        "precision": acc.policy.as_dict(),
        "world_size": acc.world_size,
        "config": acc.config.as_dict(),  # the settings the run was made with (ampkit.AcceleratorConfig)
    }
    return {
        "meta": json.dumps(meta, sort_keys=True),
        "accelerator": acc.state_dict(),
        "models": [_cpu(m.state_dict()) for m in acc.models] if weights else [],
        "optimizers": _cpu(optimizers),
        "fp32_weights": _cpu({names[id(p)]: v for o in acc.optimizers for p, v in o.fp32_values() if id(p) in names})
        if weights
        else {},
        "grads": [_cpu([p.grad for p in m.parameters()]) for m in acc.models] if pending and weights else [],
        "schedulers": _cpu([s.state_dict() for s in acc.schedulers]),
        # Random state and data position differ per rank: keep every rank's (rank order).
        "ranks": gather_objects(_cpu({"rng": rng_state(), "loaders": [loader.state_dict() for loader in acc.loaders]})),
    }


def _model_problems(acc: Training, saved_models: list[dict[str, Any]]) -> list[str]:
    problems = []
    for i, (model, saved) in enumerate(zip(acc.models, saved_models)):
        mine = model.state_dict()
        prefix = f"model {i}: " if len(acc.models) > 1 else ""
        shapes = [
            f"{k} {tuple(saved[k].shape)} in the checkpoint vs {tuple(v.shape)} in the model"
            for k, v in mine.items()
            if k in saved and isinstance(v, torch.Tensor) and tuple(saved[k].shape) != tuple(v.shape)
        ]
        for what, items, sep in (
            ("missing keys", [k for k in mine if k not in saved], ", "),
            ("unexpected keys", [k for k in saved if k not in mine], ", "),
            ("shape mismatches", shapes, "; "),
        ):
            if items:
                problems.append(f"{prefix}{what}: {sep.join(items)}")
    return problems


def same_preset(acc: Training, payload: dict[str, Any]) -> bool:
    """The checkpoint was saved under this Accelerator's preset: it loads bit for bit, no conversion."""
    return json.loads(payload["meta"])["precision"]["name"] == acc.policy.name


def validate(acc: Training, payload: dict[str, Any], path: Path, sharded: bool = False) -> None:
    """One `CheckpointError` naming every way `payload` does not fit `acc`'s setup; changes nothing."""
    problems = fields.problems(payload)  # first: the counts below read these records
    if problems:
        raise CheckpointError(
            f"checkpoint {path} holds values no run writes — " + " | ".join(problems) + " (nothing was loaded: "
            "every object is as it was); resume from an earlier checkpoint"
        )
    problems = [] if sharded else _model_problems(acc, payload["models"])
    counts = [
        ("models", len(acc.models), len(payload["models"])),
        ("optimizers", len(acc.optimizers), len(payload["optimizers"])),
        ("schedulers", len(acc.schedulers), len(payload["schedulers"])),
        ("data loaders", len(acc.loaders), len(payload["ranks"][0]["loaders"])),
    ]
    for what, have, saved in counts:
        if have != saved and not (sharded and what == "models"):
            problems.append(f"it holds {saved} {what} but this Accelerator prepared {have}")
    exact = same_preset(acc, payload)
    for i, (opt, state) in enumerate(zip(acc.optimizers, [] if sharded else payload["optimizers"])):
        state = state if exact else _without_weights(state)  # converted from the fp32 truth instead
        problems += [f"optimizer {i}: {p}" for p in opt.check_state_dict(state)]
    for i, (sched, state) in enumerate(zip(acc.schedulers, payload["schedulers"])):
        problems += [f"scheduler {i}: {p}" for p in sched.check_state_dict(state)]
    problems += acc.check_state_dict(payload["accelerator"])
    found = _non_finite((f"{i}/{k}", v) for i, sd in enumerate(payload["models"]) for k, v in sd.items())
    if bad := sorted(found | _non_finite(payload["fp32_weights"].items())):
        problems.append(f"non-finite weights (NaN or inf): {_first(bad)}")
    if problems:
        raise CheckpointError(
            f"checkpoint {path} does not fit this model — "
            + " | ".join(problems)
            + " (nothing was loaded: every object is as it was)"
        )


def apply(acc: Training, payload: dict[str, Any], path: Path, load_shards: Any = None) -> None:
    """Put a checkpoint into `acc` and everything it prepared, once `validate` passes: exactly under
    the same preset, else the weights from the fp32 truth it holds (fp32 → bf16-master, ...)."""
    validate(acc, payload, path, sharded=load_shards is not None)
    exact = same_preset(acc, payload)
    for model, state in zip(acc.models, payload["models"]):
        model.load_state_dict(state)
    if load_shards is not None:
        load_shards()
    elif not exact:
        _convert_weights(acc, payload)
    if not exact:
        saved = json.loads(payload["meta"])["precision"]["name"]
        warnings.warn(
            f"checkpoint {path} was saved under precision={saved!r} and is loaded under {acc.policy.name!r}: the "
            f"weights were set from the fp32 values it holds and the optimizer state carries over, so training goes "
            f"on in another precision; to continue the saved run as it was, use precision={saved!r}",
            stacklevel=4,
        )
    for opt, state in zip(acc.optimizers, payload["optimizers"]):
        if load_shards is not None:  # the optimizer state itself came from the shards
            state = dict(opt.optimizer.state_dict(), ampkit=state["ampkit"])
        opt.load_state_dict(state if exact else _without_weights(state))
    saved_grads = payload["grads"] or [[None] * len(list(m.parameters())) for m in acc.models]
    for model, grads in zip(acc.models, saved_grads):
        for p, g in zip(model.parameters(), grads):
            p.grad = None if g is None else g.to(p.device, p.dtype)
    for sched, state in zip(acc.schedulers, payload["schedulers"]):
        sched.load_state_dict(state)
    acc.load_state_dict(payload["accelerator"])
    ranks = payload["ranks"]
    if len(ranks) != acc.world_size:
        warnings.warn(
            f"checkpoint {path} was saved by {len(ranks)} rank(s) and is resumed by {acc.world_size}: weights, "
            "optimizer and schedule continue exactly, but the data order and random streams of the new ranks differ",
            stacklevel=4,
        )
    mine = ranks[acc.rank % len(ranks)]
    for loader, state in zip(acc.loaders, mine["loaders"]):
        loader.load_state_dict(state)
    set_rng_state(mine["rng"])


def _convert_weights(acc: Training, payload: dict[str, Any]) -> None:
    """Set every weight from the best fp32 value the checkpoint has; rebuild masters or Kahan buffers."""
    truth = payload["fp32_weights"]
    names = _names(acc)

    def best(p: torch.Tensor) -> torch.Tensor:
        i, n = names[id(p)].split("/", 1)
        return truth.get(names[id(p)], payload["models"][int(i)][n]).to(p.device, torch.float32)

    with torch.no_grad():
        for model in acc.models:
            for p in model.parameters():
                if names[id(p)] in truth:
                    p.copy_(best(p))
        for opt in acc.optimizers:
            if opt.weights is not None:
                opt.weights.set_fp32_values({p: best(p) for p, _ in opt.fp32_values()})
