"""report.json as typed records (the runner fills them; the table, plots and page read them), `REPORT_SCHEMA`
generated from them, and `validate_report`, which checks a report against it (with the standard library
alone) before any file is written or after one is read back."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

from ampkit.tools.doctor.numerics.schema import NumericsResult
from ampkit.tools.records import Invalid, build, contract, field, schema_of, validate

Status = Literal["ok", "diverged", "skipped", "failed", "interrupted", "probe"]
STATUSES: tuple[str, ...] = get_args(Status)
"""What became of one preset's run. Only "ok" runs have a metric; "probe" runs have timing only."""

MemoryKind = Literal["cuda_max_allocated", "cpu_peak_rss_delta"]
MEMORY_KINDS: dict[str, str] = {
    "cuda_max_allocated": "peak memory is torch.cuda.max_memory_allocated(): tensors only, not the "
    "allocator's cached reserve",
    "cpu_peak_rss_delta": "peak memory is the process's peak RSS minus its RSS before the model was "
    "built: it includes allocator and framework overhead, so small models show mostly noise",
}
"""How `peak_memory_bytes` was measured, and the caveat a reader needs for each."""

DtypeName = Literal["float32", "bfloat16", "float16"]


@dataclass(kw_only=True)
class Policy:
    """The resolved ampkit.Precision (`Precision.as_dict()`), or null when the run never built one (skipped)."""

    OPEN: ClassVar[bool] = True
    name: str = field()
    reason: str = field('Why this policy: "requested" or the auto reason.')
    compute_dtype: DtypeName = field()
    param_dtype: DtypeName = field()
    master_weights: bool = field()
    compensated: bool = field()
    loss_scaling: bool = field()
    norms_fp32: bool = field("Normalisation layers kept in fp32 (the -master presets).", False, optional=True)


@dataclass(kw_only=True)
class Numerics:
    """A short pass of the same training under `ampkit doctor --numerics`, after the timed run (its time
    and memory are in no other figure); null or absent: not run (--no-numerics, probes, --nproc > 1)."""

    steps: int = field("Optimizer steps watched.", minimum=0)
    at_risk: list[str] = field("Layers at risk, worst first.")
    keep_fp32: list[str] = field("The suggested keep_fp32.")
    lost_update_share: float | None = field(
        "Largest share of updates lost to rounding, over the parameter groups.", minimum=0, maximum=1
    )
    loss_scale: str | None = field("Loss-scale health in one line (loss-scaled presets only).")
    top_finding: str | None = field("The first finding's title.")
    problem: str | None = field("One line when something needs changing in this run's precision.")
    error: str | None = field("Why the numerics pass failed (the run itself is unaffected).")
    detail: dict[str, Any] | None = field(
        "The whole `ampkit doctor --numerics --json` result.",
        schema={"anyOf": [schema_of(NumericsResult), {"type": "null"}]},
    )


@dataclass(kw_only=True)
class Run:
    """One precision preset's run, in its own subprocess."""

    precision: str = field(
        'Preset name, e.g. "bf16-mixed"; "fp32 (seed 1)": the baseline again from the next seed, '
        "the noise yardstick of a default comparison.",
        minLength=1,
    )
    status: Status = field()
    reason: str | None = field("Why the run was skipped, failed, diverged or only probed.", None)
    policy: Policy | None = field(default=None)
    steps: int = field("Optimizer steps run (0 if skipped).", 0, minimum=0)
    warmup_steps: int = field("Steps left out of the timing.", 0, minimum=0)
    step_time_median_s: float | None = field(
        "Median seconds per optimizer step after warm-up.", None, exclusiveMinimum=0
    )
    samples_per_s: float | None = field("Training throughput after warm-up.", None, exclusiveMinimum=0)
    speedup_vs_baseline: float | None = field(
        "Baseline step time / this step time; with rounds, the geometric mean of the paired per-round ratios.",
        None,
        exclusiveMinimum=0,
    )
    memory_kind: MemoryKind = field()
    peak_memory_bytes: int | None = field("The peak that memory ratios use (see memory_kind).", None, minimum=0)
    peak_rss_bytes: int | None = field("CPU only: the process's raw peak RSS.", None, minimum=0)
    memory_ratio_vs_baseline: float | None = field("peak_memory_bytes / the baseline's.", None, minimum=0)
    loss_curve: list[float | None] | None = field("Training loss per optimizer step; null where it was non-finite.", [])
    final_train_loss: float | None = field("Last training loss, if finite.", None)
    eval: dict[str, float | None] = field("Held-out metrics by name.", {})
    metric: float | None = field("The task's headline metric (task.metric) for this run.", None)
    metric_delta_vs_baseline: float | None = field(
        "metric - the baseline's metric; accuracy in fraction units (-0.001 = -0.1 pp).", None
    )
    skipped_steps: int = field("Steps skipped on overflow.", 0, minimum=0)
    scale_history: list[float] | None = field(
        "Loss scale per optimizer step (loss-scaled presets only).", None, items={"exclusiveMinimum": 0}
    )
    last_finite_step: int | None = field("Index of the last step with a finite loss.", None, minimum=0)
    wall_time_s: float | None = field("Wall-clock seconds of the whole run.", None, minimum=0)
    numerics: Numerics | None = field(default=None, optional=True)
    round_step_times_s: list[float | None] | None = field(
        "Median step time in each round of an interleaved comparison (rounds alternate between the runs' "
        "processes, so a slow moment of the machine lands on every run); for a script, in each quarter of "
        "its timed steps.",
        None,
        optional=True,
    )
    speedup_low: float | None = field(
        "Lower end of the speed-up's 95% interval: a seeded bootstrap of the paired per-round ratios (baseline "
        "round time / this run's); older reports held the smallest per-round ratio.",
        None,
        optional=True,
    )
    speedup_high: float | None = field(
        "Upper end of that interval (before: the largest per-round ratio).", None, optional=True
    )
    rounds_interleaved: bool | None = field(
        "True: the rounds took turns with the baseline's (each ratio is paired in time); False: the runs ran one "
        "after another (a script's quarters), so a drift of the machine between them is not separated; null: no "
        "rounds.",
        None,
        optional=True,
    )
    metric_band: float | None = field(
        "Half-width of the metric's noise band: two standard errors of the held-out mean (tiny-lm), and for the "
        "baseline of a default comparison at least its difference from its run from the next seed.",
        None,
        optional=True,
        minimum=0,
    )
    memory_parts: dict[str, int] | None = field(
        "Parts of the peak counted from the tensors: weights, gradients, optimizer state (bytes).", None, optional=True
    )
    largest_batch: int | None = field(
        "The largest batch whose planned peak fits the report's plan_memory_bytes (ampkit plan's search, which "
        "stops at 65536): what acc.split's micro-batches could be in this precision. Null: not planned.",
        None,
        optional=True,
        minimum=0,
    )

    def finish(self, metric: str | None) -> None:
        """Derive final loss, headline metric and divergence from the raw measurements."""
        curve = [v if v is not None and math.isfinite(v) else None for v in self.loss_curve or []]
        self.loss_curve = curve
        finite = [i for i, v in enumerate(curve) if v is not None]
        self.last_finite_step = finite[-1] if finite else None
        tail = [v for v in curve[-max(1, min(20, len(curve) // 10)) :] if v is not None]
        self.final_train_loss = sum(tail) / len(tail) if tail else None
        value = self.eval.get(metric) if metric else next(iter(self.eval.values()), None)
        self.metric = value if value is not None and math.isfinite(value) else None
        self.metric_band = self.eval.get(f"{metric}_band") if metric else None
        if self.status == "ok" and (not curve or curve[-1] is None or (self.eval and self.metric is None)):
            self.status = "diverged"
            self.reason = "the loss became non-finite" + (
                f" after step {finite[-1]}" if finite else " from the first step"
            )


@dataclass(kw_only=True)
class Task:
    """The built-in task, or the user's train_fn (its function's name; steps 0: the loop decides)."""

    OPEN: ClassVar[bool] = True
    name: str = field()
    metric: str | None = field()
    higher_is_better: bool | None = field()
    steps: int = field(minimum=0)
    batch_size: int | None = field(minimum=1)
    seed: int | None = field()
    size: str | None = field("The model size (tiny-lm: small, medium, large).", None, optional=True)


@dataclass(kw_only=True)
class Gpu:
    """The GPU, or null on a CPU."""

    OPEN: ClassVar[bool] = True
    name: str = field()
    capability: str = field()
    memory_bytes: int = field(minimum=0)


@dataclass(kw_only=True)
class Load:
    """How busy the machine was while the runs were timed (`ampkit.tools.timing.check_load`, the busiest look of those
    before and after); absent in reports written before the check existed."""

    load_average: float | None = field(
        "1-minute load average less ampkit's own threads, or the cores busy in a quarter second's look where fewer "
        "(ampkit.tools.timing.busy_cores: the average lags a minute behind); null where the OS has none.",
        minimum=0,
    )
    cores: int = field(minimum=1)
    threads: int = field("torch's threads.", minimum=1)
    matmul_slowdown: float | None = field(
        "Mean time of a burst of small fp32 matmuls / their fastest (idle: ~1-1.3); null where not measured (a GPU).",
        minimum=0,
    )
    busy: bool = field("Other work held over half the cores, or the matmuls ran 2x slower than they can.")
    drift: str | None = field(
        "Set when the baseline's own rerun (the noise run) came out more than 5% faster or slower than the baseline "
        "at its interval's far end: what was measured (every interval is then widened by rerun_band).",
        None,
        optional=True,
    )
    rerun_band: float | None = field(
        "How far apart two runs of one precision came out (the far end of the baseline's rerun's interval, > 1.05): "
        "every speed-up's interval is widened by it on both sides before it is read; null: within 5%, or no rerun.",
        None,
        optional=True,
        minimum=1,
    )


@dataclass(kw_only=True)
class Machine:
    """What the comparison ran on (`ampkit.hardware.capability.describe`)."""

    OPEN: ClassVar[bool] = True
    device: str = field()
    device_name: str = field()
    torch: str = field()
    cuda: str | None = field()
    python: str = field()
    platform: str = field()
    threads: int = field(minimum=1)
    cpu_flags: dict[str, bool] | None = field()
    gpu: Gpu | None = field()
    load: Load | None = field(default=None, optional=True)


@dataclass(kw_only=True)
class Report:
    """report.json: one task trained once per precision preset, with time, memory, loss curve and metric
    side by side. Ratios and deltas are relative to `baseline`."""

    schema_version: Literal[1] = field(default=1)
    ampkit_version: str = field()
    created: str = field(
        "ISO 8601 with a UTC offset.", pattern=r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$"
    )
    command: str = field('The command line, or "ampkit.compare(...)".')
    task: Task | None = field()
    # a dict, not a Machine: hardware.describe() may say more than the schema requires, and all of it is kept
    machine: dict[str, Any] = field(schema=schema_of(Machine))
    baseline: str | None = field("Precision every ratio is relative to; null if it did not finish.")
    interrupted: bool = field("Ctrl-C: unfinished runs are 'interrupted'.", False)
    plan: str | None = field("What ran, steps each and the time estimated before it started.", None, optional=True)
    plan_memory_bytes: int | None = field(
        "The memory each run's largest_batch was planned for (the device's), or null.", None, optional=True, minimum=0
    )
    runs: list[Run] = field(default=[])

    def baseline_run(self) -> Run | None:
        return next((r for r in self.runs if r.precision == self.baseline), None)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


REPORT_SCHEMA: dict[str, Any] = contract(Report, "compare-report-v1", "ampkit compare report")


def validate_report(report: dict[str, Any]) -> Report:
    """Check `report` against `REPORT_SCHEMA` and return it as records; raise `ValueError` naming the
    first bad field (e.g. ``runs[2].speedup_vs_baseline``). Beyond the schema: every number is finite
    (JSON has no NaN), precisions are unique and `baseline` names a run."""
    if not isinstance(report, dict):
        raise ValueError(f"invalid ampkit report: expected a dict, got {type(report).__name__}")
    try:
        validate(report, REPORT_SCHEMA, noun="report")
    except Invalid as exc:
        raise ValueError(f"invalid ampkit report: {exc}") from None
    seen: set[str] = set()
    for i, run in enumerate(report["runs"]):
        if run["precision"] in seen:
            raise ValueError(f"invalid ampkit report: runs[{i}].precision: {run['precision']!r} appears twice")
        seen.add(run["precision"])
    if report["baseline"] is not None and report["baseline"] not in seen:
        raise ValueError(
            f"invalid ampkit report: baseline: {report['baseline']!r} is not the precision of any run "
            f"({', '.join(sorted(seen)) or 'no runs'})"
        )
    return build(Report, report)


def validate_run(run: dict[str, Any]) -> Run:
    """One run record (a finished run kept for `--resume`) checked and returned as a `Run`."""
    try:
        validate(run, schema_of(Run), noun="run")
    except Invalid as exc:
        raise ValueError(f"invalid run record: {exc}") from None
    return build(Run, run)


def as_report(report: Report | dict[str, Any]) -> Report:
    """A report dict (a report.json, a test's fixture) as records, unchecked: for the renderers."""
    return report if isinstance(report, Report) else build(Report, report)


def json_safe(value: Any) -> Any:
    """A deep copy fit for strict JSON: NaN/inf become null, numpy scalars become Python numbers."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (bool, str)) or value is None:
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else None
    return value
