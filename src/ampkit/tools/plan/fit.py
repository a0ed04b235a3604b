"""How `Accelerator(micro_batch="auto")` is sized: the largest micro-batch whose planned resident peak fits.

Registered with `ampkit.engine.micro` on import (the engine does not import the planner, which runs the engine). The
plan is made once, at the first `acc.split(batch)`, from the prepared model's structure (on the meta device:
nothing allocated), the prepared optimizer's class and hyperparameters and that batch; the budget left for it is
`memory / (1 + MARGIN)` less the whole batch's own bytes (the loader holds it while its micro-batches run) and, on a
CPU, what the planner itself loads; with glibc's dynamic thresholds the margin is wider (the heap it keeps moves by
±15 MiB between identical runs). Both are the platform's row of `ampkit.tools.plan.runtime.FITTED`.
"""

from __future__ import annotations

import math
from typing import Any

from ampkit.engine.events import Run
from ampkit.engine.micro import MARGIN, BatchDoesNotFitError, rows_of, tensor_bytes, use_sizer
from ampkit.precision.policy import PRESETS
from ampkit.tools.plan.planner import plan
from ampkit.tools.plan.runtime import fitted, glibc_keeps_freed, split_kept_bytes
from ampkit.tools.plan.script import meta_copy, model_fn, optimizer_fn, script_loss
from ampkit.tools.plan.step import resized
from ampkit.util.present import size as size_of


def largest_micro_batch(acc: Run, batch: Any, budget: int) -> tuple[int, str]:
    """(rows per micro-batch, what the plan said) for `batch` within `budget` bytes."""
    name = acc.policy.name
    if name not in PRESETS or len(acc.models) != 1 or len(acc.optimizers) != 1:
        raise ValueError(
            f"micro_batch='auto' plans one prepared model with one optimizer in a preset (here: {len(acc.models)} "
            f"model(s), {len(acc.optimizers)} optimizer(s), precision {name!r}); pass micro_batch=N rows instead"
        )
    meta = meta_copy(acc.models[0])
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs, targets = batch
    else:
        inputs, targets = batch, None  # the model's own loss (a dict of keyword inputs, say)
    rows, whole = rows_of(batch), tensor_bytes(batch)
    constants = fitted(acc.device)
    margin = MARGIN + (constants.glibc_margin if glibc_keeps_freed() else 0.0)
    room = int(budget / (1 + margin)) - whole - constants.planner_bytes

    def planned(size: int | None) -> Any:
        """The plan's row at `size` rows (None: the whole batch, with the search for the largest that fits)."""
        return plan(
            lambda: model_fn(meta),
            lambda: (inputs, targets) if size is None else resized((inputs, targets), size),
            optimizer_fn(acc.optimizers[0].optimizer),
            [name],
            acc.device,
            max(1, room),
            loss_fn=script_loss,
            search=size is None,
        ).rows[0]

    row = planned(None)
    said = (
        f"ampkit.plan: {name} at batch {rows} peaks at {size_of(row.resident_bytes)} resident; memory "
        f"{size_of(budget)} less a {margin:.0%} margin and the batch itself ({size_of(whole)}) leaves "
        f"{size_of(max(0, room))}"
    )
    if row.fits:
        return rows, said
    fit = min(row.max_batch_size, rows)
    full_need = row.resident_bytes + split_kept_bytes(row.components(), acc.device)
    for _ in range(6):  # several micro-batches need more than one (split_kept_bytes): shrink until it fits
        if fit < 1:
            raise BatchDoesNotFitError(
                f"micro_batch='auto': not even a micro-batch of 1 row fits ({said}). Raise memory=, or choose a "
                f"precision that needs less (ampkit plan compares them)"
            )
        at = planned(fit)
        need = at.resident_bytes + split_kept_bytes(at.components(), acc.device)
        if need <= room:
            return fit, f"{said}: {fit} rows fit ({size_of(need)} with what several micro-batches keep)"
        slope = (full_need - need) / max(1, rows - fit)  # the need grows linearly with the rows
        fit = min(fit - 1, fit - math.ceil((need - room) / slope) if slope > 0 else fit // 2)
    raise BatchDoesNotFitError(f"micro_batch='auto': the plan found no micro-batch that fits ({said})")


use_sizer(largest_micro_batch)
