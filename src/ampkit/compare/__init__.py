"""`ampkit compare`: the same training once per precision, and what each one buys.

- `runner`: `compare()`, the plan, progress, resume and ratios; `spawn`: a run in a process of its
  own (or under torchrun); `measure`: one run, measured (`RunSpec`, `run_one`), with `recorder`
  (the event listener that gathers losses, step times and scales) and `memory` (peak memory).
- `records`: the report as typed records, `REPORT_SCHEMA` generated from them, `validate_report`.
- `summary` (verdicts in words), `text` (the terminal), `plots`, `html`, `write` (the files).
"""

from ampkit.compare.measure import RunSpec, run_one
from ampkit.compare.plots import PLOT_FILES
from ampkit.compare.records import MEMORY_KINDS, REPORT_SCHEMA, STATUSES, Report, Run, validate_report
from ampkit.compare.runner import compare, default_precisions
from ampkit.compare.summary import verdict
from ampkit.compare.text import format_text, render_table
from ampkit.compare.write import write_report

__all__ = ["MEMORY_KINDS", "PLOT_FILES", "REPORT_SCHEMA", "STATUSES", "Report", "Run", "RunSpec", "compare",
           "default_precisions", "format_text", "render_table", "run_one", "validate_report", "verdict",
           "write_report"]
