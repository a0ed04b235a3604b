"""`ampkit doctor`: where a training step's time goes, and what to change, ranked by time saved.

    ampkit doctor train.py --epochs 1          # run a script that uses ampkit, under the doctor
    ampkit doctor --task iris-mlp --gpu T4     # a built-in task
    ampkit doctor --numerics --task iris-mlp   # numerics: overflows, underflows, lost updates

From Python, on a loop you already have (training continues; the report prints when done):

    session = ampkit.doctor.profile(acc, steps=20)
    session = ampkit.doctor.numerics(acc, steps=20)   # the numerics half (`numerics`)

Every entry point is in `run`; both sessions are event listeners on one base (`watch`).

The numerics half: the range census (`census`), the overflow localizer (`localizer`), the
lost-update detector (`lost_updates`), the session that runs them (`numerics`), its verdicts
(`numerics_findings`) and its report (`numerics_report`).

The performance half: the session (`session`), phase times (`phases`), kernel ops from
`torch.profiler` (`ops`), host↔device syncs by file:line (`sync`), the device advisor
(`advisor`), the analysis and ranked findings (`analysis`, `findings`), and the report in three
forms (`report`, `schema`).
"""

from ampkit.doctor.advisor import GPUS, GPUSpec, estimate, find_gpu
from ampkit.doctor.report import format_text, render_html_section, render_report
from ampkit.doctor.numerics import NumericsSession
from ampkit.doctor.numerics_findings import summarize
from ampkit.doctor.numerics_report import NUMERICS_SCHEMA, validate_numerics
from ampkit.doctor.run import (diagnose_script, diagnose_task, numerics, numerics_script, numerics_task,
                               numerics_train_fn, profile, script_traceback)
from ampkit.doctor.schema import DOCTOR_SCHEMA, validate_result
from ampkit.doctor.session import DoctorSession
from ampkit.doctor.watch import DoctorError, StopTraining

__all__ = [
    "DOCTOR_SCHEMA", "DoctorError", "DoctorSession", "GPUS", "GPUSpec", "NUMERICS_SCHEMA", "NumericsSession",
    "StopTraining", "diagnose_script", "diagnose_task", "estimate", "find_gpu", "format_text", "numerics",
    "numerics_script", "numerics_task", "numerics_train_fn", "profile", "render_html_section", "render_report",
    "script_traceback", "summarize", "validate_numerics", "validate_result"]
