"""Whether a saved optimizer state fits a prepared optimizer: the checks `AmpOptimizer.check_state_dict` runs
before a checkpoint changes anything."""

from __future__ import annotations

from typing import Any

import torch


def state_problems(optimizer: torch.optim.Optimizer, weights: Any, state: dict[str, Any]) -> list[str]:
    """Every reason `state` (an `AmpOptimizer.state_dict()`, or a plain torch optimizer's) cannot be loaded
    into the prepared `optimizer` and its low-precision `weights` (None: fp32 weights). Changes nothing."""
    problems = []
    mine = optimizer.state_dict()
    amp = state.get("ampkit") if isinstance(state, dict) else None
    if not isinstance(state, dict) or "param_groups" not in state or "state" not in state:
        return ["it is not an optimizer state_dict"]
    same_class = amp is None or amp.get("optimizer") == type(optimizer).__name__
    if amp is not None and not same_class:
        problems.append(
            f"it was saved from a {amp.get('optimizer')} optimizer, this one is a {type(optimizer).__name__}"
        )
    saved_groups, groups = state["param_groups"], mine["param_groups"]
    if len(saved_groups) != len(groups):
        problems.append(f"it has {len(saved_groups)} parameter group(s), this optimizer has {len(groups)}")
    else:
        for i, (a, b) in enumerate(zip(saved_groups, groups)):
            if len(a["params"]) != len(b["params"]):
                problems.append(
                    f"parameter group {i} has {len(a['params'])} parameters in the checkpoint, {len(b['params'])} here"
                )
    if same_class and not problems:
        problems += _state_keys(state, mine)
    if amp is not None and weights is not None and amp.get("weights") is not None:
        problem = weights.check_state_dict(amp["weights"])
        if problem:
            problems.append(problem)
    return problems


def _state_keys(state: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """Per-parameter state of the same keys as this optimizer makes (e.g. Adam's 'step', 'exp_avg')."""
    if not mine["state"]:
        return []
    expected = set(next(iter(mine["state"].values())))
    for index, values in state["state"].items():
        if set(values) != expected:
            return [f"parameter {index} has state {sorted(values)}, this optimizer keeps {sorted(expected)}"]
    return []


def fp32_state_dict(model: torch.nn.Module, optimizers: Any) -> dict[str, torch.Tensor]:
    """`model`'s state_dict in fp32, each low-precision weight replaced by the fp32 value it stands for in one of
    the prepared `optimizers` (`fp32_values()`: its master copy, or bf16 weight plus Kahan compensation)."""
    truth = {id(p): v for opt in optimizers for p, v in opt.fp32_values()}
    return {
        k: (truth.get(id(t), t).detach().float() if t.is_floating_point() else t.detach()).clone()
        for k, t in model.state_dict(keep_vars=True).items()
    }
