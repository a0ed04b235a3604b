"""What a GPU would launch for one optimizer step, counted on the CPU (benchmarks/launch_count.py).

A step whose launches grow with the number of elements is launch-bound on a GPU however fast its
kernels are: the launches of every preset's steady-state step (with and without `acc.clip_grad_norm_`)
depend on the number of tensors, never on their size (100 weights: 1M and 20M elements), and stay
within 3x the same step written by hand (bf16-true: the bf16-mixed step, whose weights are fp32).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "launch_count.py"


def _load():
    if "launch_count" not in sys.modules:
        spec = importlib.util.spec_from_file_location("launch_count", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["launch_count"] = module
        spec.loader.exec_module(module)
    return sys.modules["launch_count"]


def check(preset: str, clip: bool) -> None:
    lc = _load()
    small, large = (lc.count_ampkit(preset, lc.SIZES[s], clip) for s in ("1M", "20M"))
    hand_small, hand_large = (lc.count_hand_written(preset, lc.SIZES[s], clip) for s in ("1M", "20M"))
    assert hand_large.launches == hand_small.launches, (hand_small, hand_large)  # the counter itself: no elements
    assert large.launches <= 1.25 * small.launches, (small, large)
    assert large.launches <= 3 * hand_large.launches and small.launches <= 3 * hand_small.launches, (large, hand_large)
    assert large.host_reads <= hand_large.host_reads, (large, hand_large)  # no host read the hand-written step lacks


@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
@pytest.mark.parametrize("preset", ["fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-true"])
def test_step_launches_depend_on_tensors_not_elements_and_stay_near_the_hand_written_step(preset, clip):
    check(preset, clip)


def test_the_counter_counts_lists_by_64_views_as_nothing_and_host_reads_apart():
    import torch

    lc = _load()
    xs = [torch.ones(3) for _ in range(130)]
    with lc.LaunchCounter() as counter:
        torch._foreach_mul_(xs, 2.0)  # 130 tensors: 3 launches
        xs[0].view(-1)[1:].t()  # views: none
        torch.empty(4)  # an allocation: none
        xs[0].sum().item()  # one launch, one host read
    assert (counter.launches, counter.host_reads) == (4, 1)
