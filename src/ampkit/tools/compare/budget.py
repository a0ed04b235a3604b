"""How many steps a default comparison's runs take to fit its time budget, and the one sentence announcing it.

The budget is met from what this machine measured (the fastest of each run's timed warm-up steps), not from a
table: a busy or slow machine gets fewer steps, down to a floor that still trains the task, and a run still over
budget at the floor says so, and how to shorten it, in the same sentence as its one estimate.
"""

from __future__ import annotations

import dataclasses
import math

from ampkit.util.present import duration

#: Rounds an interleaved comparison's timed steps are split into, after the warm-up chunk.
ROUNDS = 8

#: Seconds a default comparison's timed rounds should take, by the warm-up's step times; its full runs' steps
#: are cut to fit, to `FIT_FLOOR` of the task's at the least. Start-up, warm-up, evaluation, the plan (with its
#: search for each precision's largest batch, ~5 s a precision for tiny-lm on a CPU) and the report add about
#: a minute and a quarter: about three minutes in all.
BUDGET_S = 95.0

#: The least share of a task's steps a cut leaves: fewer would not train the model far enough for the
#: metric to compare precisions (a run still over budget at that says so, and how to shorten it).
FIT_FLOOR = 0.25


@dataclasses.dataclass(frozen=True)
class Fit:
    """Each run's steps after fitting the budget, the time they are expected to take, and how they were cut."""

    steps: dict[str, int]
    estimate_s: float
    cut_from: int | None = None  # the full runs' steps before the cut
    over_budget: bool = False  # still over BUDGET_S at the floor


def steps_left(total: dict[str, int], done: dict[str, int], step_s: dict[str, float]) -> float:
    """Seconds the steps still to run take, at each run's measured warm-up step time."""
    return sum(max(0, total[n] - done[n]) * step_s[n] for n in done)


def fit_steps(
    total: dict[str, int],
    done: dict[str, int],
    step_s: dict[str, float],
    full: list[str],
    extra: float,
    budget: float = BUDGET_S,
) -> Fit:
    """Cut the full runs' steps (all alike) so the rest of the runs, at their measured warm-up step times, and
    `extra` seconds of numerics fit `budget`; never below `FIT_FLOOR` of them (nor 4 steps a round)."""
    if steps_left(total, done, step_s) + extra <= budget:
        return Fit(dict(total), steps_left(total, done, step_s) + extra)
    was = total[full[0]]
    probes = {n: t for n, t in total.items() if n not in full}
    room = budget - extra - steps_left(probes, {n: done[n] for n in probes if n in done}, step_s)
    per_step = max(1e-9, sum(step_s[n] for n in full))
    floor = min(was, max(math.ceil(FIT_FLOOR * was), 4 * ROUNDS))
    steps = max(floor, int(room / per_step + sum(done[n] * step_s[n] for n in full) / per_step))
    if steps >= was:
        return Fit(dict(total), steps_left(total, done, step_s) + extra)
    cut = {**total, **dict.fromkeys(full, steps)}
    estimate = steps_left(cut, done, step_s) + extra
    return Fit(cut, estimate, cut_from=was, over_budget=estimate > budget * 1.1)


def plan_line(total: dict[str, int], full: list[str], fit: Fit) -> str:
    """The one sentence announcing the runs: their steps, how they were cut, and one estimate of the time."""
    what = ", ".join(f"{n} ({'probe, ' * (n not in full)}{total[n]} steps)" for n in total)
    cut = ""
    if fit.cut_from is not None:
        cut = f" (cut from {fit.cut_from} to fit ~{duration(BUDGET_S)})"
        if fit.over_budget:
            cut = (
                f" (cut from {fit.cut_from}, to {FIT_FLOOR:.0%} of the task's steps: fewer would not train it; "
                f"still more than the ~{duration(BUDGET_S)} budget on this machine: pass --steps or a smaller "
                "--size for a shorter run)"
            )
    return (
        f"{what}{cut}: {ROUNDS} rounds taking turns, about {duration(fit.estimate_s)} "
        "(from the fastest of the timed warm-up steps)"
    )
