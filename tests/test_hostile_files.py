"""Hostile or odd files in a checkpoint folder (a FIFO, a device, a link to /dev/zero, a sparse huge file, a
stride-0 tensor, deep JSON, edited names): each is one clear CheckpointError (or a warning) and a fallback to
the good checkpoint beside it, within a time limit, with memory bounded and no user file touched."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import ampkit
from ampkit.checkpoint import folder as ckfolder

LIMIT_S = 20  # every case ends well within this, or fails instead of hanging
RSS_BOUND = 300 << 20  # bytes a case may add to the process's peak memory


@contextlib.contextmanager
def bounded():
    """Fail (instead of hanging) past LIMIT_S seconds; fail if peak memory grows by more than RSS_BOUND."""

    def expire(*_):
        raise TimeoutError(f"took longer than {LIMIT_S} s: ampkit blocked on a file")

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grown < RSS_BOUND, f"peak memory grew by {grown >> 20} MiB"


def _acc(steps: int = 0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = ampkit.Accelerator(precision="fp32", device="cpu")
    model, opt = acc.prepare(model, opt)
    for _ in range(steps):
        acc.backward(model(torch.randn(5, 4)).square().mean())
        opt.step()
        opt.zero_grad()
    return acc, model, opt


@pytest.fixture
def run(tmp_path):
    """A checkpoint folder with step-2 and step-4 of one run, the weights at step 4, and a user file beside."""
    acc, model, opt = _acc(steps=2)
    ck = tmp_path / "ck"
    acc.save_checkpoint(ck)
    for _ in range(2):
        acc.backward(model(torch.randn(5, 4)).square().mean())
        opt.step()
        opt.zero_grad()
    acc.save_checkpoint(ck)
    mine = tmp_path / "mine.txt"
    mine.write_text("the user's")
    return ck, {k: v.clone() for k, v in model.state_dict().items()}, mine


def _resumes_step_4(ck: Path, weights: dict, warns: str | None) -> None:
    acc, model, _ = _acc()
    with bounded(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert acc.resume(ck) == ck / "step-00000004.pt"
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    if warns is not None:
        assert any(warns in str(w.message) for w in caught), [str(w.message) for w in caught]


def _replace(path: Path, make) -> None:
    path.unlink()
    make(path)


def _sparse(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(2 << 30)


MANIFEST_CASES = {
    "fifo": (os.mkfifo, "is not a regular file"),
    "dev-zero-link": (lambda p: p.symlink_to("/dev/zero"), "is a link out of"),
    "dev-null-link": (lambda p: p.symlink_to("/dev/null"), "is a link out of"),
    "sparse-2GiB": (_sparse, "more than the"),
    "deep-json": (lambda p: p.write_text("[" * 100_000 + "]" * 100_000), "nested too deeply"),
}


@pytest.mark.parametrize("case", list(MANIFEST_CASES))
def test_a_hostile_manifest_is_refused_and_resume_takes_the_newest(run, case):
    ck, weights, mine = run
    make, says = MANIFEST_CASES[case]
    _replace(ck / ckfolder.MANIFEST, make)
    _resumes_step_4(ck, weights, says)
    acc, _, _ = _acc(steps=1)
    with bounded(), pytest.raises(ampkit.CheckpointError, match=says):
        acc.save_checkpoint(ck)  # it neither guesses nor deletes through such a manifest
    assert mine.read_text() == "the user's" and (ck / "step-00000002.pt").is_file()


@pytest.mark.parametrize("case", ["fifo", "dev-zero-link", "sparse-2GiB"])
def test_a_hostile_latest_is_ignored_with_a_warning(run, case):
    ck, weights, _ = run
    (ck / ckfolder.MANIFEST).unlink()  # a folder without a manifest reads `latest`
    make = MANIFEST_CASES[case][0]
    _replace(ck / ckfolder.LATEST, make)
    _resumes_step_4(ck, weights, f"ignoring {ck / ckfolder.LATEST}")


@pytest.mark.parametrize("case", ["fifo", "dev-zero-link", "sparse-2GiB"])
def test_a_hostile_lock_is_one_clear_error_not_a_hang(run, case):
    ck, weights, _ = run
    make = MANIFEST_CASES[case][0]
    ckfolder._unlock(ck / ckfolder.LOCK)  # as if this run had ended: the next process finds the odd file
    make(ck / ckfolder.LOCK)
    acc, _, _ = _acc(steps=1)
    with bounded(), pytest.raises(ampkit.CheckpointError, match=r"ampkit-checkpoints.lock.*remove it"):
        acc.save_checkpoint(ck)
    _resumes_step_4(ck, weights, None)


def _crafted_step_6(ck: Path, extra) -> Path:
    good = torch.load(ck / "step-00000004.pt", weights_only=True)
    bad = ck / "step-00000006.pt"
    torch.save(dict(good, extra=extra), bad)  # the digest is left as it was: the check before it must refuse
    manifest = json.loads((ck / ckfolder.MANIFEST).read_text())
    manifest["checkpoints"].append(bad.name)
    (ck / ckfolder.MANIFEST).write_text(json.dumps(manifest))
    return bad


def test_a_stride_0_tensor_is_refused_before_it_is_expanded(run):
    ck, weights, _ = run
    _crafted_step_6(ck, torch.zeros(1).expand(1 << 27))  # 4 bytes on disk, 512 MiB if expanded
    assert (ck / "step-00000006.pt").stat().st_size < 100_000
    _resumes_step_4(ck, weights, "is a view larger than the bytes it is stored in")


def test_an_overlapping_view_is_refused(run):
    ck, weights, _ = run
    _crafted_step_6(ck, torch.zeros(1 << 16).as_strided(((1 << 16) - 1023, 1024), (1, 1)))  # 256 KiB -> 256 MiB
    _resumes_step_4(ck, weights, "is a view larger than the bytes it is stored in")


def test_a_checkpoint_that_is_a_fifo_or_a_link_out_is_skipped(run, tmp_path):
    ck, weights, _ = run
    manifest = json.loads((ck / ckfolder.MANIFEST).read_text())
    os.mkfifo(ck / "step-00000006.pt")
    (tmp_path / "elsewhere.pt").write_bytes((ck / "step-00000004.pt").read_bytes())
    (ck / "step-00000008.pt").symlink_to(tmp_path / "elsewhere.pt")
    manifest["checkpoints"] += ["step-00000006.pt", "step-00000008.pt"]
    (ck / ckfolder.MANIFEST).write_text(json.dumps(manifest))
    _resumes_step_4(ck, weights, "is not a regular file")
