"""`ampkit plan`'s prediction (two steps on fake tensors) against the same live-bytes tracker over two real
steps on this CPU, per preset, for the built-in tasks at their default batch sizes. Prints a markdown table.

    PYTHONPATH=src python benchmarks/plan_accuracy.py [task ...]
"""

from __future__ import annotations

import sys
import time

import torch

from ampkit.precision.policy import PRESETS
from ampkit.tools.plan.step import measure
from ampkit.tools.tasks import get_task
from ampkit.util.present import size

print("| task | preset | batch | predicted peak | measured peak | error | peak in | plan time |")
print("|---|---|---|---|---|---|---|---|")
for name in sys.argv[1:] or ["tiny-lm", "digits-cnn", "iris-mlp"]:
    task = get_task(name)
    batch = next(iter(task.make_data(0, task.default_batch_size).train_loader))
    for preset in PRESETS:
        args = (
            lambda task=task: task.make_model(0),
            batch,
            lambda p, task=task: task.make_optimizer(p, task.default_lr),
            preset,
            torch.device("cpu"),
        )
        start = time.perf_counter()
        fake = measure(*args, fake=True, batch_size=task.default_batch_size, loss_fn=task.loss_fn)
        took = time.perf_counter() - start
        real = measure(*args, fake=False, batch_size=task.default_batch_size, loss_fn=task.loss_fn)
        print(
            f"| {name} | {preset} | {task.default_batch_size} | {size(fake.peak)} | {size(real.peak)} | "
            f"{(fake.peak - real.peak) / real.peak:+.2%} | {fake.phase} | {took:.1f} s |",
            flush=True,
        )
