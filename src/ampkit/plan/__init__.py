"""`ampkit.plan`: will it fit, in which precision, at what batch size, predicted before the run.

result = ampkit.plan(model_fn, batch_fn, optimizer_fn, memory="24GiB")
for row in result.rows: print(row.precision, row.peak_bytes, row.fits, row.max_batch_size)
"""

from ampkit.plan.planner import PLAN_SCHEMA, Plan, PlanRow, device_memory, parse_memory, plan, plan_task
from ampkit.plan.show import check_out, plot_png, render_plan, write_plan
from ampkit.plan.tracker import COMPONENTS

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
