"""`ampkit compare` on the built-in tasks, recorded in benchmarks/notes/compare.md (verdicts: RESULTS.md).

    python benchmarks/compare_tasks.py --write
    python benchmarks/compare_tasks.py --tasks digits-cnn --precisions fp32,bf16-mixed,bf16-true --write

Runs the default comparison on tiny-lm (what `ampkit compare` does with no arguments) and, for each
task given, the named precisions in full; writes each table (speed-up, memory, accuracy or
perplexity and their change from fp32) with the machine and the command.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from pathlib import Path

import ampkit
from ampkit.hardware.capability import describe, resolve_device
from ampkit.tools.compare import compare

RESULTS = Path(__file__).parent / "notes" / "compare.md"  # the full tables; RESULTS.md keeps the verdicts
START, END = "<!-- compare:start -->", "<!-- compare:end -->"


def table(report: dict) -> list[str]:
    task = report["task"]
    metric = task["metric"]
    rows = [
        f"#### `{report['command']}` — {task['name']}, {task['steps']} steps, batch {task['batch_size']}",
        "",
        "| precision | status | ms/step | speed-up | peak memory (MiB) | memory ratio | final loss "
        f"| {metric} | Δ {metric} |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["runs"]:

        def f(v, fmt):  # noqa: ANN001
            return "—" if v is None else format(v, fmt)

        delta = r["metric_delta_vs_baseline"]
        if delta is not None and metric == "accuracy":
            delta_s = f"{delta * 100:+.2f} pp"
        elif delta is not None and r["metric"] and report["runs"][0]["metric"]:
            delta_s = f"{delta / report['runs'][0]['metric'] * 100:+.2f}%"
        else:
            delta_s = "—"
        value = f(r["metric"] * 100 if metric == "accuracy" and r["metric"] is not None else r["metric"], ".2f")
        rows.append(
            f"| {r['precision']} | {r['status']} | "
            f"{f(r['step_time_median_s'] and r['step_time_median_s'] * 1e3, '.2f')} | "
            f"{f(r['speedup_vs_baseline'], '.2f')}× | "
            f"{f(r['peak_memory_bytes'] and r['peak_memory_bytes'] / 2**20, '.1f')} | "
            f"{f(r['memory_ratio_vs_baseline'], '.2f')} | {f(r['final_train_loss'], '.4f')} | {value} | {delta_s} |"
        )
    notes = [f"- {r['precision']}: {r['reason']}" for r in report["runs"] if r.get("reason")]
    return rows + ([""] + notes if notes else []) + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="iris-mlp,digits-cnn", help="tasks to run with --precisions in full")
    parser.add_argument("--precisions", default="fp32,bf16-mixed,bf16-true")
    parser.add_argument("--skip-default", action="store_true", help="leave out the default tiny-lm comparison")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    machine = describe(resolve_device("auto"))
    lines = [
        START,
        "## `ampkit compare` on the built-in tasks (`benchmarks/compare_tasks.py`)",
        "",
        f"- date: {datetime.date.today()}; ampkit {ampkit.__version__}; torch {machine['torch']}; "
        f"device {machine['device_name']}, {machine['threads']} threads",
        f"- command: `python {' '.join(sys.argv)}`",
        "",
    ]
    reports = []
    if not args.skip_default:
        reports.append(compare(task="tiny-lm", command="ampkit compare"))
    for task in filter(None, args.tasks.split(",")):
        precisions = args.precisions.split(",")
        reports.append(
            compare(
                task=task,
                precisions=precisions,
                command=f"ampkit compare --task {task} --precisions {','.join(precisions)}",
            )
        )
    for report in reports:
        lines += table(report)
    lines.append(END)
    block = "\n".join(lines)
    print(block)
    if args.write:
        text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n\n"
        text = (
            re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S)
            if START in text
            else text.rstrip() + "\n\n" + block + "\n"
        )
        RESULTS.write_text(text)


if __name__ == "__main__":
    main()
