"""Built-in training tasks whose data ships with the install (nothing is downloaded).

They feed `ampkit compare`: each task gives a seeded model, seeded data, an optimizer,
a loss and an evaluation, so fp32 and mixed-precision runs differ only in precision.

    task = get_task("digits-cnn")
    model = task.make_model(seed=0)
    data = task.make_data(seed=0, batch_size=task.default_batch_size)
"""

from __future__ import annotations

import torch

from . import classification, tiny_lm
from .task import Task, TaskData

TASKS: dict[str, Task] = {t.name: t for t in (classification.IRIS, classification.DIGITS, tiny_lm.TASK)}
"""Every built-in task by name. Building one is lazy: nothing loads until make_data."""


def get_task(name: str, size: str | None = None) -> Task:
    """The task called `name` (at model `size`: tiny-lm only, see `tiny_lm.SIZES`); a ValueError
    naming the valid choices otherwise."""
    try:
        task = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(sorted(TASKS))}") from None
    if size is not None and name != tiny_lm.NAME:
        raise ValueError(f"size={size!r}: only {tiny_lm.NAME} comes in sizes; leave it out for {name}")
    return task if size is None else tiny_lm.sized(size)


def default_size(name: str, device: torch.device) -> str | None:
    """The model size a comparison on `device` uses for task `name` (None: the task has one size)."""
    return tiny_lm.size_for(device) if name == tiny_lm.NAME else None


__all__ = ["TASKS", "Task", "TaskData", "default_size", "get_task"]
