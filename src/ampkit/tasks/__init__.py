"""Built-in training tasks whose data ships with the install (nothing is downloaded).

They feed `ampkit compare`: each task gives a seeded model, seeded data, an optimizer,
a loss and an evaluation, so fp32 and mixed-precision runs differ only in precision.

    task = get_task("digits-cnn")
    model = task.make_model(seed=0)
    data = task.make_data(seed=0, batch_size=task.default_batch_size)
"""

from __future__ import annotations

from . import digits, iris, tiny_lm
from .task import Task, TaskData

TASKS: dict[str, Task] = {t.name: t for t in (iris.TASK, digits.TASK, tiny_lm.TASK)}
"""Every built-in task by name. Building one is lazy: nothing loads until make_data."""


def get_task(name: str) -> Task:
    """The task called `name`; a ValueError naming the valid choices otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(sorted(TASKS))}") from None


__all__ = ["TASKS", "Task", "TaskData", "get_task"]
