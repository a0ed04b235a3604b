"""`ampkit.plan`: will it fit, in which precision, at what batch size, predicted before the run.

result = ampkit.plan(model_fn, batch_fn, optimizer_fn, memory="24GiB")
for row in result.rows: print(row.precision, row.resident_bytes, row.fits, row.max_batch_size)

`resident_bytes` is what a user measures (`ampkit.tools.plan.resident.steady_peak`): the live tensors at their peak
(`peak_bytes`, by component) + `runtime` + `allocator` (`ampkit.tools.plan.runtime`).
"""

from ampkit.tools.plan import fit  # noqa: F401  (registers micro_batch='auto''s sizer with ampkit.engine.micro)
from ampkit.tools.plan.planner import PLAN_SCHEMA, Plan, PlanRow, device_memory, parse_memory, plan, plan_task
from ampkit.tools.plan.show import check_out, plot_png, render_plan, write_plan
from ampkit.tools.plan.tracker import COMPONENTS

__all__ = [
    "COMPONENTS",
    "PLAN_SCHEMA",
    "Plan",
    "PlanRow",
    "device_memory",
    "parse_memory",
    "plan",
    "plot_png",
    "render_plan",
    "check_out",
    "write_plan",
    "plan_task",
]
