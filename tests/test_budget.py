"""The default comparison's budget: steps cut from the measured warm-up step times, one consistent estimate,
and progress lines when stdout is not a terminal (pure functions: no run needed)."""

from __future__ import annotations

import re

from ampkit.tools.compare.budget import BUDGET_S, FIT_FLOOR, ROUNDS, fit_steps, plan_line
from ampkit.tools.compare.turns import RunProgress
from ampkit.util.present import duration


def test_a_run_that_fits_keeps_its_steps_and_its_estimate_is_what_is_left() -> None:
    fit = fit_steps(
        {"fp32": 300, "bf16-mixed": 300},
        {"fp32": 5, "bf16-mixed": 5},
        {"fp32": 0.1, "bf16-mixed": 0.05},
        ["fp32", "bf16-mixed"],
        extra=4.0,
    )
    assert fit.steps == {"fp32": 300, "bf16-mixed": 300} and fit.cut_from is None
    assert abs(fit.estimate_s - (295 * 0.15 + 4.0)) < 1e-9
    line = plan_line(fit.steps, ["fp32", "bf16-mixed"], fit)
    assert line.startswith("fp32 (300 steps), bf16-mixed (300 steps): 8 rounds taking turns, about 48 s ")
    assert "cut" not in line


def test_a_slow_machine_gets_fewer_steps_that_fit_the_budget() -> None:
    total, done, step_s = (
        {"fp32": 300, "bf16-mixed": 300},
        {"fp32": 5, "bf16-mixed": 5},
        {"fp32": 0.5, "bf16-mixed": 0.3},
    )
    fit = fit_steps(total, done, step_s, ["fp32", "bf16-mixed"], extra=10.0)
    steps = fit.steps["fp32"]
    assert fit.steps["bf16-mixed"] == steps and FIT_FLOOR * 300 <= steps < 300 and fit.cut_from == 300
    assert fit.estimate_s <= BUDGET_S and not fit.over_budget
    assert fit.estimate_s > 0.9 * BUDGET_S  # the cut uses the budget, not a fixed share
    line = plan_line(fit.steps, ["fp32", "bf16-mixed"], fit)
    assert f"(cut from 300 to fit ~{duration(BUDGET_S)})" in line and f"about {duration(fit.estimate_s)}" in line


def test_a_machine_too_slow_even_at_the_floor_says_so_with_one_estimate_in_minutes() -> None:
    # the case: 5.4 s and 2.8 s a step: the floor still takes minutes, and the line must say so plainly
    fit = fit_steps(
        {"fp32": 300, "bf16-mixed": 300},
        {"fp32": 5, "bf16-mixed": 5},
        {"fp32": 5.4, "bf16-mixed": 2.8},
        ["fp32", "bf16-mixed"],
        extra=0.0,
    )
    assert fit.steps == {"fp32": 75, "bf16-mixed": 75} and fit.over_budget
    assert abs(fit.estimate_s - 70 * 8.2) < 1e-6
    line = plan_line(fit.steps, ["fp32", "bf16-mixed"], fit)
    assert (
        "about 9 min 34 s" in line and f"still more than the ~{duration(BUDGET_S)} budget" in line and "--steps" in line
    )
    assert "e+" not in line and len(re.findall(r"about ", line)) == 1  # one estimate, readable


def test_a_probe_keeps_its_steps_and_its_time_counts_against_the_budget() -> None:
    total, done = {"fp32": 100, "fp8-mixed": 2}, {"fp32": 5, "fp8-mixed": 2}
    fit = fit_steps(total, done, {"fp32": 2.0, "fp8-mixed": 9.0}, ["fp32"], extra=0.0)
    # fp32's 95 steps left take 190 s: cut to what fits the budget after its 5 warm-up steps
    assert fit.steps["fp8-mixed"] == 2 and fit.steps["fp32"] == int(BUDGET_S / 2.0 + 5) < 100
    assert plan_line(fit.steps, ["fp32"], fit).startswith(
        f"fp32 ({fit.steps['fp32']} steps), fp8-mixed (probe, 2 steps)"
    )


def test_durations_read_as_people_plan() -> None:
    assert [duration(x) for x in (0.04, 3.2, 45.4, 59.6, 140, 1600, 3700)] == [
        "0.04 s",
        "3.2 s",
        "45 s",
        "1 min 00 s",
        "2 min 20 s",
        "27 min",
        "1 h 02 min",
    ]


def test_off_a_terminal_each_round_prints_elapsed_and_left(capsys) -> None:
    progress = RunProgress(show=True)
    for r in range(1, ROUNDS + 1):
        progress.round_done(r, elapsed_s=30.0 * r, after_s=12.0)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "round 1/8 done: 30 s elapsed, about 3 min 42 s left"
    assert lines[-1] == "round 8/8 done: 4 min 00 s elapsed, about 12 s left" and len(lines) == ROUNDS
    RunProgress(show=False).round_done(1, 1.0, 0.0)  # --quiet: nothing
    assert capsys.readouterr().out == ""
