"""`ampkit compare`: the same training once per precision, and what each one buys.

- `runner`: `compare()`, the plan and the run loop; `state`: finished runs' records for resume; `baseline`:
  the ratios; `script`: the same on a user's script; `turns`: the runs in processes of their own, taking
  turns; `measure`: one run, measured (`RunSpec`, `run_one`, the `Recorder` of its events), with `memory`
  (peak memory).
- `records`: the report as typed records, `REPORT_SCHEMA` generated from them, `validate_report`.
- `wording` (verdicts in words), `summary` (the table, the terminal), `plots`, `html` (the page; `write_report`,
  the files).
"""

from ampkit.tools.compare.html import write_report
from ampkit.tools.compare.measure import RunSpec, run_one
from ampkit.tools.compare.plots import PLOT_FILES
from ampkit.tools.compare.records import MEMORY_KINDS, REPORT_SCHEMA, STATUSES, Report, Run, validate_report
from ampkit.tools.compare.runner import compare, default_precisions
from ampkit.tools.compare.summary import format_text, render_table
from ampkit.tools.compare.wording import verdict

__all__ = [
    "MEMORY_KINDS",
    "PLOT_FILES",
    "REPORT_SCHEMA",
    "STATUSES",
    "Report",
    "Run",
    "RunSpec",
    "compare",
    "default_precisions",
    "format_text",
    "render_table",
    "run_one",
    "validate_report",
    "verdict",
    "write_report",
]
