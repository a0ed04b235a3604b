"""`ampkit doctor`: where a training step's time goes and what to change (`ampkit doctor train.py`,
`profile(acc, steps=20)`), or its numerical trouble (`--numerics`, `numerics(acc, steps=20)`).

Entry points: `run`; both sessions listen on one base (`watch`). Performance: the session
(`session`, its phase clock), profiler ops (`ops`), syncs (`sync`), the device advisor
(`advisor`), analysis and findings (`analysis`, `findings`; per sync site `sync_findings`; their
record `finding`), report and contract (`report`; `schema`: the typed records of `--json`).
Numerics (`numerics/`): `census`, `localizer`, `lost_updates`, `accumulation`, the session (`session`), its verdicts
(`findings`), report (`report`) and contract (`schema`). Performance modules are in `perf/`.
"""

from ampkit.tools.doctor.numerics.findings import summarize
from ampkit.tools.doctor.numerics.schema import NUMERICS_SCHEMA, NumericsResult, read_numerics, validate_numerics
from ampkit.tools.doctor.numerics.session import NumericsSession
from ampkit.tools.doctor.perf.advisor import GPUS, GPUSpec, estimate, find_gpu
from ampkit.tools.doctor.perf.report import format_text, render_html_section, render_report
from ampkit.tools.doctor.perf.schema import DOCTOR_SCHEMA, DoctorResult, read_result, validate_result
from ampkit.tools.doctor.perf.session import DoctorSession
from ampkit.tools.doctor.run import (
    diagnose_script,
    diagnose_task,
    numerics,
    numerics_script,
    numerics_task,
    numerics_train_fn,
    profile,
    script_traceback,
)
from ampkit.tools.doctor.watch import DoctorError, StopTraining

__all__ = [
    "DOCTOR_SCHEMA",
    "DoctorError",
    "DoctorResult",
    "DoctorSession",
    "GPUS",
    "GPUSpec",
    "NUMERICS_SCHEMA",
    "NumericsResult",
    "NumericsSession",
    "StopTraining",
    "diagnose_script",
    "diagnose_task",
    "estimate",
    "find_gpu",
    "format_text",
    "numerics",
    "numerics_script",
    "numerics_task",
    "numerics_train_fn",
    "profile",
    "read_numerics",
    "read_result",
    "render_html_section",
    "render_report",
    "script_traceback",
    "summarize",
    "validate_numerics",
    "validate_result",
]
