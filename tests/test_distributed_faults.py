"""A faulty rank ends a torchrun job within seconds (issue 45): a raising rank, a stalled one (with
Accelerator(timeout=)), ranks with different numbers of batches. Before, the first two hung until an
outside timeout (an atexit barrier waited for a peer stuck in DDP's all-reduce) and uneven data hung 60 s
at exit. Each case runs `tests/dist_fault_run.py` under torchrun with 2 gloo ranks on the CPU."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ampkit

SCRIPT = Path(__file__).with_name("dist_fault_run.py")
SRC = Path(__file__).resolve().parents[1] / "src"
BOUND_S = 60  # torchrun's start and two interpreters importing torch take ~8 s here; a hang takes for ever


def torchrun(mode: str) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(SCRIPT), mode]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=4 * BOUND_S, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun {mode}: still running after {4 * BOUND_S} s (the job hangs)")
    return done, time.perf_counter() - start


def test_a_raising_rank_ends_the_job_with_its_error():
    done, took = torchrun("raise")
    assert done.returncode != 0
    assert "rank 1 fails at step 3 (planted)" in done.stderr
    assert took < BOUND_S, f"the job took {took:.0f} s to end"


@pytest.mark.slow
def test_a_stalled_rank_ends_the_job_after_the_timeout():
    done, took = torchrun("stall")  # Accelerator(timeout=5) there
    assert done.returncode != 0
    assert "Timed out" in done.stderr or "timeout" in done.stderr.lower()
    assert took < BOUND_S, f"the job took {took:.0f} s to end"


@pytest.mark.slow
def test_uneven_batches_fail_fast_naming_each_ranks_count():
    done, took = torchrun("uneven")
    assert done.returncode != 0
    assert "different number of batches on each rank (rank 0: 8, rank 1: 12)" in done.stderr
    assert took < BOUND_S, f"the job took {took:.0f} s to end"


def test_timeout_is_checked_and_kept_in_seconds():
    assert ampkit.AcceleratorConfig(timeout=datetime.timedelta(minutes=2)).timeout_s == 120.0
    assert ampkit.AcceleratorConfig(timeout=30).timeout_s == 30.0
    assert ampkit.AcceleratorConfig().timeout_s is None
    with pytest.raises(ValueError, match="timeout=0: expected a number of seconds > 0"):
        ampkit.Accelerator(precision="fp32", device="cpu", timeout=0)
    with pytest.raises(TypeError, match="timeout='5'"):
        ampkit.Accelerator(precision="fp32", device="cpu", timeout="5")
