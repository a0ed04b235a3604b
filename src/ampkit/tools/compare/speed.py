"""A run's speed-up over the baseline with its 95% interval, what that lets a reader conclude, and its words.

The speed-up is the geometric mean of paired per-round ratios (baseline round time / run round time: in an
interleaved comparison the rounds took turns, so a slow moment of the machine lands on both sides of a pair),
and its interval a seeded bootstrap of those ratios: the same figures give the same interval on every run
(`ampkit.tools.timing.paired_speedup`, the estimator every timing of ampkit uses).
Four outcomes, three of them conclusions: faster, slower, the same (the whole interval within ±5%), or
"can't tell", which never counts as "no faster": a busy machine or disagreeing rounds are said as such.

The baseline's own rerun (the noise run, "fp32 (seed 1)") is the check on every interval: two runs of one
precision should come out the same, so where they came out further apart than `SAME` allows (`rerun_band`: the
far end of that rerun's interval), every interval is widened by that factor before it is read.
"""

from __future__ import annotations

from typing import Any, Literal

from ampkit.tools.timing import CONFIDENCE, describe_load
from ampkit.util.present import times

Outcome = Literal["faster", "slower", "same", "unclear"]

#: An interval wholly inside this band is "same speed" (reruns of one preset differ about this much).
SAME = (0.95, 1.05)


def outcome(
    speedup: float,
    low: float | None,
    high: float | None,
    *,
    busy: bool = False,
    interleaved: bool = True,
    band: float = 1.0,
) -> Outcome:
    """What the figures let a reader conclude. Without an interval (no rounds) the point alone decides, unless
    the machine was busy; one-after-another runs on a busy machine cannot tell drift from speed; `band` (>= 1) is
    how far apart two runs of one precision came out here where that was beyond `SAME` (`rerun_band`): the
    interval, widened by it on both sides, must clear 1.0 to be told, or lie within `SAME` to be the same."""
    if low is None or high is None:
        if busy:
            return "unclear"
        return "same" if SAME[0] <= speedup < SAME[1] else "faster" if speedup >= 1 else "slower"
    if busy and not interleaved:
        return "unclear"
    low, high = low / band, high * band
    if SAME[0] <= low and high <= SAME[1]:
        return "same"
    return "faster" if low > 1 else "slower" if high < 1 else "unclear"


def rerun_band(rerun: Any) -> float:
    """How far apart two runs of one precision came out: the far end of the baseline's rerun's interval against
    the baseline (1.11 for 1.07x, 95% CI 1.03x-1.11x; 1.25 for 0.9x, 0.8x-0.95x); 1.0 where that is within `SAME`
    (reruns agree) or there is no interval."""
    if rerun.speedup_low is None or rerun.speedup_high is None:
        return 1.0
    far = max(rerun.speedup_high, 1 / rerun.speedup_low)
    return far if far > SAME[1] else 1.0


def run_outcome(run: Any, load: dict[str, Any] | None) -> Outcome:
    """`outcome` of a report's `Run` (its `speedup_*` fields) on a machine whose check was `load`."""
    return outcome(
        run.speedup_vs_baseline or 1.0,
        run.speedup_low,
        run.speedup_high,
        busy=bool(load and load.get("busy")),
        interleaved=run.rounds_interleaved is not False,
        band=(load or {}).get("rerun_band") or 1.0,
    )


def interval(run: Any) -> str:
    """ "95% CI 1.7×–2.2×", or "" without one."""
    if run.speedup_low is None or run.speedup_high is None:
        return ""
    return f"{100 * CONFIDENCE:.0f}% CI {times(run.speedup_low)}\u2013{times(run.speedup_high)}"


SEQUENTIAL = "the runs ran one after another, so drift of the machine between them could not be separated"


def qualifiers(run: Any) -> str:
    """ "95% CI 1.7×–2.2×", and where the runs ran one after another, that drift could not be separated."""
    ci = interval(run)
    return f"{ci}; {SEQUENTIAL}" if ci and run.rounds_interleaved is False else ci


def speed_words(run: Any, load: dict[str, Any] | None) -> str:
    """The speed part of a verdict: "1.9× faster (95% CI 1.7×–2.2×)", "0.44× (2.3× slower; 95% CI ...)",
    "same speed (1.01×; 95% CI ...)", or "speed: can't tell on this machine (...): it was busy (...); rerun ..."."""
    speedup = run.speedup_vs_baseline or 1.0
    extra = qualifiers(run)
    result = run_outcome(run, load)
    if result == "same":
        return f"same speed ({times(speedup)}{'; ' + extra if extra else ''})"
    if result == "faster":
        return f"{times(speedup)} faster" + (f" ({extra})" if extra else "")
    if result == "slower":
        return f"{times(speedup)} ({times(1 / speedup)} slower{'; ' + extra if extra else ''})"
    return f"speed: {cant_tell(run, load)}"


RERUN = "rerun on an idle machine or with `--steps`"


def measured(run: Any) -> str:
    """ "1.9× measured, 95% CI 0.6×–5×": the figures an inconclusive speed-up still has."""
    return ", ".join(p for p in (f"{times(run.speedup_vs_baseline or 1.0)} measured", interval(run)) if p)


def unclear_reason(run: Any, load: dict[str, Any] | None) -> str:
    """Why a speed-up is inconclusive: where its interval alone would have decided, the baseline's rerun that
    widened it (`machine.load.drift`); "it was busy (load 12 on 2 cores; ops ran ~3× slower than this CPU can)";
    or "the rounds disagree"; and where the runs ran one after another, that too."""
    sequential = f" and {SEQUENTIAL}" if run.rounds_interleaved is False else ""
    low, high = run.speedup_low, run.speedup_high
    decided = low is not None and high is not None and outcome(1.0, low, high) != "unclear"  # the interval alone
    busy = ""
    if load and load.get("busy"):
        figures = describe_load(load)
        busy = f"it was busy{f' ({figures})' if figures else ''}"
    if load and load.get("drift") and decided:  # the rerun's band, not the interval, left it unclear
        return f"{load['drift']}{f'; {busy}' if busy else ''}{sequential}"
    return f"{busy or 'the rounds disagree'}{sequential}"


def cant_tell(run: Any, load: dict[str, Any] | None) -> str:
    """ "can't tell on this machine (1.9× measured, 95% CI 0.6×–5×): it was busy (load 12 on 2 cores; ops ran
    ~3× slower than this CPU can); rerun on an idle machine or with `--steps`"."""
    return f"can't tell on this machine ({measured(run)}): {unclear_reason(run, load)}; {RERUN}"
