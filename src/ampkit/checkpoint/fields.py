"""The plain fields of a loaded checkpoint, checked before anything is copied into the run: random states,
data loader positions, counters and the loss scale. A value that passes the digest but could not have been
written by a run (a NaN loss scale, epoch -5, a random state of the wrong size) is a problem named here, so a
failed load leaves the model, optimizer, scaler and random streams exactly as they were.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch


def _count(value: Any, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _tuples(o: Any) -> Any:
    return tuple(_tuples(v) for v in o) if isinstance(o, list) else o


def _generator_problem(state: Any) -> str | None:
    """Why `state` is not a torch generator state (tried on a scratch generator), else None."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
        return "not a uint8 tensor"
    try:
        torch.Generator().set_state(state)
    except Exception as exc:  # whatever set_state raises, tried on a scratch generator
        return str(exc).splitlines()[0]
    return None


def rng_problems(rng: Any) -> list[str]:
    """Why `rng` (what `state.rng_state` returns) cannot be restored; each part tried on a scratch copy."""
    if not isinstance(rng, dict) or not {"python", "numpy", "torch"} <= set(rng):
        return ["random state: not the python/numpy/torch record ampkit writes"]
    problems = []
    try:
        random.Random().setstate(_tuples(rng["python"]))
    except Exception as exc:  # as above
        problems.append(f"python random state: {exc}")
    n = rng["numpy"]
    try:
        keys = n["keys"].numpy().astype(np.uint32)
        np.random.RandomState().set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    except Exception as exc:  # as above
        problems.append(f"numpy random state: {exc}")
    if (why := _generator_problem(rng["torch"])) is not None:
        problems.append(f"torch random state: {why}")
    cuda = rng.get("cuda", [])
    if not isinstance(cuda, list) or any(_generator_problem(s) is not None for s in cuda):
        problems.append("cuda random state: not a list of generator states")
    return problems


def loader_problems(state: Any) -> list[str]:
    """Why a data loader position cannot be resumed."""
    if not isinstance(state, dict):
        return ["not a data loader position"]
    problems = [f"{key} = {state.get(key)!r}, expected an integer >= 0" for key in ("epoch", "batch_index")]
    problems = [p for p, key in zip(problems, ("epoch", "batch_index")) if not _count(state.get(key))]
    for key in ("started", "finished"):
        if not isinstance(state.get(key), bool):
            problems.append(f"{key} = {state.get(key)!r}, expected True or False")
    if not isinstance(state.get("epoch_rng", {}), dict):
        problems.append("epoch_rng is not a record of random states")
    generators = state.get("generators", {})
    if not isinstance(generators, dict) or any(_generator_problem(s) is not None for s in generators.values()):
        problems.append("generators: not a record of torch generator states")
    return problems


def scaler_problems(state: Any) -> list[str]:
    """Why a loss scaler state is impossible: a scale that is not finite and > 0, negative counters."""
    if state is None:
        return []
    if not isinstance(state, dict):
        return ["loss scaler: not a scaler state"]
    problems = []
    for key in ("scale", "init_scale", "growth_factor", "backoff_factor"):
        if key in state and state[key] is not None and not _positive(state[key]):
            problems.append(f"loss scaler: {key} = {state[key]!r}, expected a finite number > 0")
    for key, least in (("growth_tracker", 0), ("hysteresis_left", 0), ("growth_interval", 1), ("hysteresis", 1)):
        if key in state and not _count(state[key], least):
            problems.append(f"loss scaler: {key} = {state[key]!r}, expected an integer >= {least}")
    return problems


def problems(payload: dict[str, Any]) -> list[str]:
    """Every impossible plain field of `payload` (empty: all can be restored). Changes nothing."""
    found = []
    acc = payload.get("accelerator")
    if not isinstance(acc, dict):
        return ["its accelerator state is missing"]
    if not _count(acc.get("epoch")):
        found.append(f"epoch = {acc.get('epoch')!r}, expected an integer >= 0")
    if not isinstance(acc.get("run_id"), str):
        found.append(f"run_id = {acc.get('run_id')!r}, expected a string")
    found += scaler_problems(acc.get("scaler"))
    ranks = payload.get("ranks")
    if not isinstance(ranks, list) or not ranks or not all(isinstance(r, dict) for r in ranks):
        return [*found, "it holds no per-rank random state and data position"]
    for i, rank in enumerate(ranks):
        where = f"rank {i}: " if len(ranks) > 1 else ""
        found += [f"{where}{p}" for p in rng_problems(rank.get("rng"))]
        loaders = rank.get("loaders")
        if not isinstance(loaders, list):
            found.append(f"{where}data loaders: not a list of positions")
            continue
        for j, loader in enumerate(loaders):
            found += [f"{where}data loader {j}: {p}" for p in loader_problems(loader)]
    return found
