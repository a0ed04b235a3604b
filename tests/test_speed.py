"""The speed verdict follows its own numbers: paired per-round ratios with a seeded bootstrap interval, three
outcomes worded as such, and a recommendation that never makes the baseline the choice from an unclear speed."""

from __future__ import annotations

import copy
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ampkit.tools import timing
from ampkit.tools.compare.records import validate_report
from ampkit.tools.compare.runner import compare_to_baseline
from ampkit.tools.compare.speed import interval, outcome, run_outcome
from ampkit.tools.compare.summary import format_text, recommendation, verdict
from ampkit.tools.timing import check_load, describe_load, judge, own_load, paired_speedup, worst
from ampkit.util.present import times

CPU = torch.device("cpu")

SAMPLE = json.loads((Path(__file__).parent / "fixtures" / "sample_report.json").read_text())
BUSY = {"load_average": 12.3, "cores": 2, "threads": 2, "matmul_slowdown": 3.1, "busy": True}
IDLE = {"load_average": 0.2, "cores": 2, "threads": 2, "matmul_slowdown": 1.1, "busy": False}


# --- the statistics ------------------------------------------------------------------------------
def test_paired_speedup_is_the_geometric_mean_with_a_seeded_interval_around_it():
    base, run = [2.0, 2.2, 1.9, 2.1, 2.0, 2.05], [1.0, 1.05, 1.0, 1.1, 0.98, 1.02]
    point, low, high = paired_speedup(base, run)
    ratios = np.array(base) / np.array(run)
    assert point == pytest.approx(math.exp(np.log(ratios).mean()))
    assert ratios.min() <= low < point < high <= ratios.max()
    assert paired_speedup(base, run) == (point, low, high)  # seeded: the same figures, the same interval
    assert paired_speedup(base, run, seed=1) != (point, low, high)


def test_paired_speedup_pairs_round_by_round_and_skips_empty_rounds():
    # a slow moment of the machine (round 2) lands on both runs: the pairs still agree on 2x
    point, low, high = paired_speedup([2.0, 20.0, 2.0, None], [1.0, 10.0, 1.0, 0.5])
    assert (point, low, high) == pytest.approx((2.0, 2.0, 2.0))
    assert paired_speedup([2.0], [1.0]) is None and paired_speedup([], []) is None
    assert paired_speedup([2.0, 0.0, 3.0], [1.0, 1.0, None]) is None  # one usable pair: no interval


def test_outcome_has_four_cases_and_a_busy_machine_only_blurs_unpaired_runs():
    assert outcome(1.9, 1.7, 2.2) == "faster"
    assert outcome(0.4, 0.3, 0.5) == "slower"
    assert outcome(1.01, 0.97, 1.04) == "same"
    assert outcome(1.9, 0.6, 5.0) == "unclear"
    assert outcome(1.9, 1.7, 2.2, busy=True) == "faster"  # interleaved: each pair saw the same machine
    assert outcome(0.44, 0.11, 0.71, busy=True, interleaved=False) == "unclear"  # sequential: drift or speed?
    assert outcome(1.6, None, None) == "faster" and outcome(0.98, None, None) == "same"
    assert outcome(1.6, None, None, busy=True) == "unclear"


# --- the verdict, from synthetic paired timings ----------------------------------------------------
def report_with(
    base_rounds, run_rounds, load=None, *, interleaved=True, memory=0.82, metric_delta=0.05, control_rounds=None
):
    """A report of fp32 and bf16-mixed timed in `base_rounds` / `run_rounds` (and, with `control_rounds`, fp32's
    rerun from the next seed, the noise run), compared as compare() does."""
    report = copy.deepcopy(SAMPLE)
    fp32 = next(r for r in report["runs"] if r["precision"] == "fp32")
    run = next(r for r in report["runs"] if r["precision"] == "bf16-mixed")
    run.update(
        status="ok",
        reason=None,
        metric=fp32["metric"] + metric_delta,
        skipped_steps=0,
        step_time_median_s=fp32["step_time_median_s"] / (sum(base_rounds) / sum(run_rounds)),
        peak_memory_bytes=int(fp32["peak_memory_bytes"] * memory),
        policy=fp32["policy"] | {"name": "bf16-mixed"},
        eval={"perplexity": fp32["metric"] + metric_delta},
        loss_curve=fp32["loss_curve"],
    )
    fp32["metric_band"] = 0.2
    for r, rounds in ((fp32, base_rounds), (run, run_rounds)):
        r.update(round_step_times_s=rounds, rounds_interleaved=interleaved)
    report["runs"] = [fp32, run]
    if control_rounds is not None:
        control = copy.deepcopy(fp32) | {"precision": "fp32 (seed 1)", "round_step_times_s": control_rounds}
        report["runs"].append(control)
    if load is not None:
        report["machine"]["load"] = load
    records = validate_report(report)
    compare_to_baseline(records)
    validate_report(records.to_dict())  # the new fields are the schema's
    return records


def flat(text):
    return " ".join(text.split())  # the terminal wraps long lines


def line(records):
    return verdict(records.runs[1], records.runs[0], records.task, records.machine.get("load"))


def test_a_clear_gain_is_faster_with_its_interval():
    records = report_with([5.4, 5.5, 5.3, 5.6, 5.4], [2.8, 2.9, 2.8, 2.8, 2.85], IDLE)
    assert line(records) == (
        "bf16-mixed: 1.92× faster (95% CI 1.89×–1.96×), 0.82× memory, perplexity +1.2% (within the noise, ±4.9%)"
    )
    assert recommendation(records) == (
        "Use bf16-mixed: 1.92× faster (95% CI 1.89×–1.96×), 0.82× memory, "
        "perplexity within the noise of fp32 — speed decided"
    )


def test_a_clear_loss_is_slower_with_its_interval():
    records = report_with([2.8, 2.9, 2.8, 2.8], [5.4, 5.5, 5.3, 5.6], IDLE, memory=1.0)
    assert line(records).startswith("bf16-mixed: 0.52× (1.93× slower; 95% CI 0.51×–0.53×), 1× memory")
    assert recommendation(records) == (
        "Use fp32: bf16-mixed costs 1.93× the time on Tesla T4 (95% CI 1.89×–1.97× the time) — speed decided"
    )


def test_noise_on_a_busy_machine_cannot_tell_and_names_the_load():
    # the run: 1.93x overall, but four rounds from 0.51x to 10x on a machine at load 12 on 2 cores
    records = report_with([5.0, 30.0, 2.0, 5.4], [9.8, 3.0, 1.2, 2.8], BUSY)
    said = line(records)
    assert said == (
        "bf16-mixed: 0.82× memory, perplexity +1.2% (within the noise, ±4.9%); speed: can't tell on "
        "this machine (2.01× measured, 95% CI 0.71×–6.39×): it was busy (load 12.3 on 2 cores; ops ran "
        "~3.1× slower than this CPU can); rerun on an idle machine or with `--steps`"
    )
    banner = recommendation(records)
    assert banner.startswith("Can't tell on this machine whether bf16-mixed is faster than fp32 (")
    assert banner == (
        "Can't tell on this machine whether bf16-mixed is faster than fp32 (2.01× measured, 95% CI "
        "0.71×–6.39×, 0.82× memory, perplexity within the noise of fp32): it was busy (load 12.3 on 2 "
        "cores; ops ran ~3.1× slower than this CPU can); rerun on an idle machine or with `--steps`"
    )
    assert not banner.startswith("Use")  # never "Use fp32" from an inconclusive speed
    assert flat(format_text(records).split("\n", 1)[1]).startswith(flat(banner))  # the terminal's first line
    idle = report_with([5.0, 30.0, 2.0, 5.4], [9.8, 3.0, 1.2, 2.8], IDLE)
    assert ": the rounds disagree; rerun on an idle machine or with `--steps`" in line(idle)
    assert not recommendation(idle).startswith("Use")


def test_the_baseline_against_its_own_rerun_is_the_band_a_speed_up_must_clear():
    # under load that came and went (a CI run on the same 2 cores): fp32's own rerun 1.23x "faster" with a tight
    # interval: two runs of one precision came out that far apart, so only a speed-up beyond it is told
    base = [5.0, 5.2, 4.9, 5.1]
    drifted_rerun = [4.1, 4.2, 4.0, 4.1]
    drifted = report_with(base, [3.3, 3.5, 3.2, 3.4], dict(IDLE), control_rounds=drifted_rerun)
    control = drifted.runs[2]
    assert control.speedup_low > 1.05  # the drift the check looks for
    band = drifted.machine["load"]["rerun_band"]
    assert band == pytest.approx(control.speedup_high)
    said = flat(verdict(control, drifted.runs[0], drifted.task, drifted.machine["load"]))
    assert said.startswith(
        f"fp32 (seed 1): fp32 again: 1.23× ({interval(control)}), how far apart two runs of one precision came out "
        "here, 1× memory"
    )  # never "1.23x faster": it is the same precision
    assert recommendation(drifted).startswith("Use bf16-mixed: 1.51× faster (95% CI")  # 1.51x clears 1.24x
    small = report_with(base, [b / 1.15 for b in base], dict(IDLE), control_rounds=drifted_rerun)
    small_run = small.runs[1]
    assert small_run.speedup_low > 1.1  # clears 1.0 by far, but not what two runs of fp32 differ by here
    reason = (
        f"fp32 against its own rerun (fp32 (seed 1)) measured 1.23× ({interval(control)}): two runs of one precision "
        f"came out up to {times(band)} apart here, and this interval widened by that does not decide; rerun on an "
        "idle machine or with `--steps`"
    )
    assert flat(line(small)).endswith(
        f"speed: can't tell on this machine (1.15× measured, {interval(small_run)}): {reason}"
    )
    banner = recommendation(small)
    assert banner.startswith("Can't tell on this machine whether bf16-mixed is faster than fp32 (1.15× measured")
    assert banner.endswith(reason)
    assert f"fp32 against its own rerun came out up to {times(band)} apart, so each interval is widened by" in flat(
        format_text(small)
    )
    assert validate_report(small.to_dict()).machine["load"]["drift"].startswith("fp32 against its own rerun")
    # a quiet control changes nothing: the band stays 0.95x-1.05x
    quiet = report_with(base, [b / 1.15 for b in base], dict(IDLE), control_rounds=[5.1, 5.1, 5.0, 5.0])
    assert quiet.machine["load"].get("drift") is None and quiet.machine["load"].get("rerun_band") is None
    assert recommendation(quiet).startswith("Use bf16-mixed: 1.15× faster (95% CI")


def test_a_rerun_further_apart_than_5_percent_leaves_no_same_speed_and_never_makes_fp32_the_choice():
    # a quiet AMD EPYC: fp32's rerun measured 1.07x (95% CI 1.03x-1.11x); bf16-mixed's 1.46x is told, a 1.08x or a
    # 1.0x is not: either could be what two runs of fp32 differ by here
    base = [0.287, 0.290, 0.285, 0.288]
    rerun = [0.276, 0.262, 0.268, 0.265]
    clear = report_with(base, [b / 1.46 for b in base], dict(IDLE), control_rounds=rerun)
    assert line(clear).startswith("bf16-mixed: 1.46× faster (95% CI 1.46×–1.46×)")
    for speedup in (1.08, 1.0):
        unsure = report_with(base, [b / speedup for b in base], dict(IDLE), control_rounds=rerun, memory=1.0)
        assert f"speed: can't tell on this machine ({times(speedup)} measured" in line(unsure)
        assert "fp32 against its own rerun (fp32 (seed 1)) measured 1.07×" in line(unsure)
        assert not recommendation(unsure).startswith("Use"), recommendation(unsure)
    alone = report_with(base, [b / 1.0 for b in base], dict(IDLE), memory=1.0)  # no rerun: 1.0x is the same speed
    assert line(alone).startswith("bf16-mixed: same speed (1×; 95% CI 1×–1×)")


def test_never_fp32_on_speed_from_an_inconclusive_comparison():
    rng = np.random.default_rng(7)
    for _ in range(40):
        base = list(rng.uniform(1.0, 6.0, size=4))
        run = list(b * rng.uniform(0.3, 3.0) for b in base)
        rerun = list(b * rng.uniform(0.8, 1.25) for b in base)
        for load, control in ((BUSY, None), (IDLE, None), (None, None), (IDLE, rerun)):
            records = report_with(base, run, dict(load) if load else None, control_rounds=control)
            rec = recommendation(records)
            fate = run_outcome(records.runs[1], records.machine.get("load"))
            if fate == "unclear":
                assert not rec.startswith("Use"), (base, run, rec)
                assert "can't tell" in line(records)
            if rec.startswith("Use fp32"):
                assert fate in ("slower", "same"), (base, run, rec)


def test_same_speed_with_less_memory_lets_memory_decide():
    records = report_with([2.0, 2.02, 1.99, 2.01], [2.0, 2.01, 2.0, 2.0], IDLE)
    assert line(records).startswith("bf16-mixed: same speed (1×; 95% CI 1×–1×), 0.82× memory")
    assert recommendation(records).endswith("— memory decided")
    heavy = report_with([2.0, 2.02, 1.99, 2.01], [2.0, 2.01, 2.0, 2.0], IDLE, memory=1.0)
    assert recommendation(heavy) == (
        "Use fp32: bf16-mixed is no faster on Tesla T4 (same speed (1×; 95% CI "
        "1×–1×)) and saves no memory — speed and memory decided"
    )


def test_runs_one_after_another_say_so_and_cannot_tell_on_a_busy_machine():
    # `ampkit compare train.py` on the busy machine: quarters 0.11x-0.71x, one run after the other
    records = report_with([1.0, 1.1, 0.9, 1.0], [9.0, 1.6, 2.2, 1.5], BUSY, interleaved=False)
    said = line(records)
    assert "can't tell on this machine" in said and "it was busy (load 12.3 on 2 cores" in said
    assert "the runs ran one after another, so drift of the machine between them could not be separated" in said
    assert not recommendation(records).startswith("Use")
    idle = report_with([1.0, 1.1, 0.9, 1.0], [2.2, 2.3, 2.1, 2.2], IDLE, interleaved=False)
    assert line(idle).startswith("bf16-mixed: 0.45× (2.2× slower; 95% CI 0.43×–0.47×; ")
    assert "; the runs ran one after another, so drift of the machine between them could not be separated)" in line(
        idle
    )
    assert "drift between them is not separated" in flat(format_text(idle))
    assert recommendation(idle) == (
        "Use fp32: bf16-mixed costs 2.2× the time on Tesla T4 (95% CI 2.12×–2.3× the time; "
        "the runs ran one after another, so drift of the machine between them could "
        "not be separated) — speed decided"
    )


# --- the timing module: rounds side by side, the probe ---------------------------------------------------
def test_interleaved_runs_every_candidate_in_turn_drops_warmup_and_a_failing_one():
    order: list[str] = []
    rounds: list[int] = []

    def call(name: str, fail_in: int | None = None):
        def run() -> None:
            order.append(name)
            if fail_in is not None and len(rounds) == fail_in:
                raise RuntimeError(f"{name} broke")

        return run

    failed: list[tuple[str, str]] = []
    times = timing.interleaved(
        {"a": call("a"), "b": call("b", fail_in=3), "c": call("c")},
        3,
        steps=2,
        warmup=1,
        on_error=lambda key, exc: failed.append((key, str(exc))),
        on_round=rounds.append,
    )
    assert rounds == [0, 1, 2, 3]
    assert order == ["a", "a", "b", "b", "c", "c"] * 2 + ["a", "a", "b", "c", "c"] + ["a", "a", "c", "c"]
    assert failed == [("b", "b broke")]
    assert [len(times[k]) for k in "abc"] == [3, 1, 3]  # warm-up round dropped; b left after its failure
    assert all(t >= 0 for ts in times.values() for t in ts)
    with pytest.raises(RuntimeError, match="b broke"):  # without on_error the error propagates
        rounds.clear()
        timing.interleaved({"b": call("b", fail_in=1)}, 2, on_round=rounds.append)


def test_fastest_times_at_least_one_call_and_at_most_repeats():
    calls: list[int] = []
    best, n, total = timing.fastest(lambda: calls.append(1), CPU, 0.0)
    assert n == 1 and len(calls) == 2 and 0 <= best <= total  # a warm-up call, then one timed
    best, n, total = timing.fastest(lambda: time.sleep(0.001), CPU, 10.0, repeats=3)
    assert n == 3 and 0.001 <= best <= total / 3 + 1e-9


def test_matmul_rate_sizes_to_its_time_within_its_bounds():
    fixed = timing.matmul_rate(CPU, torch.float32, 0.05, sizes=(64, 64), repeats=4)
    assert fixed.size == 64 and fixed.calls == 4 and fixed.per_s > 0
    none = timing.matmul_rate(CPU, torch.float32, 0.0, sizes=(32, 1024))  # no time: stays at the first size
    assert none.size == 32 and none.calls == 1
    grown = timing.matmul_rate(CPU, torch.float32, 0.4, sizes=(32, 256))
    assert grown.size in (64, 128, 256) and grown.calls >= 1  # 32² takes microseconds: it doubles, up to 256
    assert timing.copy_bandwidth(CPU, seconds=0.05, mib=4) > 0


def test_the_benchmarks_time_ratio_is_the_reciprocal_of_compares_paired_speedup():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from _timing import paired_ratio, time_ratio
    finally:
        sys.path.pop(0)
    slow, fast = [2.0, 2.2, 1.9, 2.1], [1.0, 1.0, 1.05, 0.95]
    point, low, high = timing.paired_speedup(fast, slow)  # slow's speed-up over fast: < 1
    assert time_ratio(fast, slow) == pytest.approx((point, low, high))
    assert time_ratio(slow, fast) == pytest.approx((1 / point, 1 / high, 1 / low))
    assert paired_ratio(slow, fast) == pytest.approx(1 / point) and math.isnan(paired_ratio([1.0], [2.0]))


# --- the load check --------------------------------------------------------------------------------
def test_the_load_check_marks_a_busy_machine_and_says_what_it_measured():
    assert judge(12.3, 2, 2, 1.1).busy and judge(0.3, 2, 2, 3.5).busy and not judge(0.3, 2, 2, 1.2).busy
    assert not judge(None, 2, 2, None).busy
    assert describe_load(judge(12.3, 2, 2, 3.1)) == "load 12.3 on 2 cores; ops ran ~3.1× slower than this CPU can"
    assert describe_load(IDLE) == "load 0.2 on 2 cores"  # an idle burst is not worth a word
    assert worst(judge(0.3, 2, 2, 1.1), judge(4.0, 2, 2, 1.5), None) == judge(4.0, 2, 2, 1.5)
    now = check_load(own=1000.0)  # all of it ours: no other load
    assert now.load_average in (0.0, None) and now.cores >= 1 and now.matmul_slowdown >= 1.0


def test_a_load_average_that_still_carries_an_ended_job_is_checked_against_the_cores_busy_now(monkeypatch):
    # `ampkit compare` run twice in a row: the second's look before its runs still sees the first's 2 threads in
    # the 1-minute average; the cores busy now say the machine is idle
    import os

    import ampkit.tools.timing as timing

    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # the 2-core machine: 2.8 is busy by the average alone
    monkeypatch.setattr(timing, "load_average", lambda: 2.8)
    monkeypatch.setattr(timing, "busy_cores", lambda seconds=timing.LOOK_S: 0.1)
    ended = timing.check_load(measure=False)
    assert not ended.busy and ended.load_average == 0.1
    monkeypatch.setattr(timing, "busy_cores", lambda seconds=timing.LOOK_S: 1.9)  # still going: busy
    assert timing.check_load(measure=False).busy and timing.check_load(measure=False).load_average == 1.9
    monkeypatch.setattr(timing, "busy_cores", lambda seconds=timing.LOOK_S: None)  # the OS does not say: the average
    assert timing.check_load(measure=False).load_average == 2.8


def test_one_slow_matmul_burst_is_looked_at_twice_and_the_calmer_kept(monkeypatch):
    import ampkit.tools.timing as timing

    monkeypatch.setattr(timing, "load_average", lambda: 0.2)
    bursts = iter([4.9, 1.2])  # a hiccup, then the machine as it is
    monkeypatch.setattr(timing, "matmul_slowdown", lambda device=None: next(bursts))
    look = timing.check_load()
    assert not look.busy and look.matmul_slowdown == 1.2
    bursts = iter([3.5, 3.1])  # busy both times: busy
    assert timing.check_load().busy
    calm = iter([1.1])  # a calm first burst is not taken again
    monkeypatch.setattr(timing, "matmul_slowdown", lambda device=None: next(calm))
    assert timing.check_load().matmul_slowdown == 1.1


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="the cores busy now are read from Linux's /proc/stat")
def test_the_cores_busy_now_see_a_spinning_process():
    import subprocess
    import sys

    from ampkit.tools.timing import busy_cores

    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started
        assert busy_cores() >= 0.5  # one core's worth, less what a shared machine's scheduler takes away
    finally:
        spin.kill()
        spin.wait()


def test_own_load_is_what_a_timing_can_add_to_the_load_average_not_all_its_threads():
    # a 2-second bench on 2 threads spans at most two 5 s samples of the 60 s average: ~0.31, not 2
    assert own_load(2, 2.0) == pytest.approx(2 * (1 - math.exp(-10 / 60)))
    assert own_load(2, 2.0) < 0.5 * 2  # the look after a short bench still sees others' load
    assert own_load(2, 600.0) == pytest.approx(2.0, abs=1e-3)  # after minutes of training: all of it
    assert own_load(4, 0.0) == own_load(4, -1.0) > 0  # even an instant may land on a sample
    assert own_load(2, 30.0) < own_load(2, 60.0) < own_load(4, 60.0)
