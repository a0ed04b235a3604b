"""Hostile or odd files in a checkpoint folder (a FIFO, a device, a link to /dev/zero, a sparse huge file, a
stride-0 tensor, deep JSON, edited names): each is one clear CheckpointError (or a warning) and a fallback to
the good checkpoint beside it, within a time limit, with memory bounded and no user file touched."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import re
import resource
import signal
import stat
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import ampkit
from ampkit.checkpoint import folder as ckfolder
from ampkit.checkpoint import payload as payload_file

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


def _device_node(path: Path) -> None:
    """A character device with /dev/null's numbers (needs root or CAP_MKNOD: skipped without)."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")


MANIFEST_CASES = {
    "fifo": (os.mkfifo, "is not a regular file"),
    "device-node": (_device_node, "is not a regular file"),
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


@pytest.mark.parametrize("case", ["fifo", "device-node", "dev-zero-link", "sparse-2GiB"])
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


# --- a failed load changes nothing ----------------------------------------------------------------------
def _everything(acc, model, opt) -> list:
    """Weights, optimizer, scaler, epoch and every random stream, as values to compare bit for bit."""
    return [
        {k: v.clone() for k, v in model.state_dict().items()},
        repr(opt.optimizer.state_dict()),
        repr(acc.scaler.state_dict()),
        acc.epoch,
        torch.get_rng_state(),
        repr(np.random.get_state()),
        random.getstate(),
    ]


def _same(a: list, b: list) -> bool:
    return all(
        (all(torch.equal(x[k], y[k]) for k in x) if isinstance(x, dict) else torch.equal(x, y))
        if isinstance(x, (dict, torch.Tensor))
        else x == y
        for x, y in zip(a, b)
    )


def _set(key_path: tuple, value):
    def edit(payload):
        target = payload
        for key in key_path[:-1]:
            target = target[key]
        target[key_path[-1]] = value

    return edit


IMPOSSIBLE = {
    "python-rng": (_set(("ranks", 0, "rng", "python"), [3, [1, 2], None]), "python random state"),
    "numpy-rng": (_set(("ranks", 0, "rng", "numpy", "keys"), torch.zeros(10, dtype=torch.int64)), "numpy random state"),
    "torch-rng": (_set(("ranks", 0, "rng", "torch"), torch.zeros(7, dtype=torch.uint8)), "torch random state"),
    "loader-position": (_set(("ranks", 0, "loaders", 0, "batch_index"), -3), "batch_index = -3"),
    "nan-loss-scale": (_set(("accelerator", "scaler", "scale"), float("nan")), "scale = nan"),
    "zero-loss-scale": (_set(("accelerator", "scaler", "scale"), 0.0), "scale = 0.0"),
    "negative-epoch": (_set(("accelerator", "epoch"), -5), "epoch = -5"),
    "negative-growth-tracker": (_set(("accelerator", "scaler", "growth_tracker"), -1), "growth_tracker = -1"),
}


@pytest.mark.parametrize("case", list(IMPOSSIBLE))
def test_an_impossible_field_fails_the_load_and_changes_nothing(tmp_path, case):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = ampkit.Accelerator(precision="fp16-mixed", device="cpu")
    data = torch.utils.data.DataLoader(torch.randn(12, 4), batch_size=3, shuffle=True)
    model, opt, data = acc.prepare(model, opt, data)
    for x in data:
        acc.backward(model(x).float().square().mean())
        opt.step()
        opt.zero_grad()
    good = acc.save(tmp_path / "good.pt")
    payload = torch.load(good, weights_only=True)
    payload.pop("digest")
    edit, says = IMPOSSIBLE[case]
    edit(payload)
    payload_file.write(tmp_path / "bad.pt", payload)  # sealed again: it passes the digest
    acc.backward(model(torch.randn(3, 4)).float().square().mean())
    opt.step()  # the live run moves on, away from what the checkpoint holds
    before = _everything(acc, model, opt)
    with pytest.raises(ampkit.CheckpointError, match=rf"holds values no run writes — .*{re.escape(says)}"):
        acc.load(tmp_path / "bad.pt")
    assert _same(before, _everything(acc, model, opt))
    acc.load(good)  # the untouched checkpoint still loads


# --- sharded checkpoints: every shard verified, every path inside the folder --------------------------
@pytest.fixture
def sharded_run(run):
    """`run`'s folder plus step-6 as a sharded (DCP) checkpoint, written the way strategy="fsdp" writes it."""
    from ampkit.checkpoint import sharded, state

    ck, weights, mine = run
    acc, model, opt = _acc()
    acc.resume(ck)
    for _ in range(2):
        acc.backward(model(torch.randn(5, 4)).square().mean())
        opt.step()
        opt.zero_grad()
    path = sharded.save(
        acc, ck / "step-00000006", dict(state.collect(acc, weights=False), sharded=True), payload_file.write
    )
    manifest = json.loads((ck / ckfolder.MANIFEST).read_text())
    manifest["checkpoints"].append(path.name)
    (ck / ckfolder.MANIFEST).write_text(json.dumps(manifest))
    fresh, fmodel, _ = _acc()
    assert fresh.resume(ck) == path  # the untouched sharded checkpoint loads, exactly
    assert all(torch.equal(v, fmodel.state_dict()[k]) for k, v in model.state_dict().items())
    return ck, weights, mine, path


def test_a_flipped_byte_in_a_shard_is_refused_and_resume_falls_back(sharded_run):
    ck, weights, _, path = sharded_run
    shard = next(path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    _resumes_step_4(ck, weights, f"shard {shard.name} does not match the SHA-256 digest")


@pytest.mark.parametrize("target", ["../elsewhere.distcp", "ABS", "ampkit.pt"])
def test_a_shard_path_edited_out_of_the_folder_is_refused(sharded_run, tmp_path, target):
    from ampkit.checkpoint import sharded

    ck, weights, _, path = sharded_run
    shard = next(path.glob("*.distcp"))
    (ck / "elsewhere.distcp").write_bytes(shard.read_bytes())  # another run's weights, byte for byte valid
    metadata = sharded.read_metadata(path)
    for info in metadata.storage_data.values():
        info.relative_path = str(ck / "elsewhere.distcp") if target == "ABS" else target
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    _resumes_step_4(ck, weights, "which is not one of the shards ampkit wrote")


def test_a_fifo_as_a_shard_is_refused_not_read(sharded_run):
    ck, weights, _, path = sharded_run
    shard = next(path.glob("*.distcp"))
    _replace(shard, os.mkfifo)
    _resumes_step_4(ck, weights, "is not a regular file")


# --- own files only ---------------------------------------------------------------------------------------
SAVE_TARGETS = {
    "user-file": (lambda p: p.write_text("the user's notes"), "not an ampkit checkpoint"),
    "torch-file": (lambda p: torch.save({"w": torch.ones(2)}, p), "not an ampkit checkpoint"),
    "fifo": (os.mkfifo, "not a regular file"),
    "dev-null-link": (lambda p: p.symlink_to("/dev/null"), "it is a link"),
}


@pytest.mark.parametrize("case", list(SAVE_TARGETS))
def test_save_refuses_to_replace_what_ampkit_did_not_write(tmp_path, case):
    acc, _, _ = _acc(steps=1)
    target = tmp_path / "ckpt.pt"
    make, says = SAVE_TARGETS[case]
    make(target)
    before = os.lstat(target)
    with bounded(), pytest.raises(ampkit.CheckpointError, match=rf"cannot save to .*{says}.*overwrite=True"):
        acc.save(target)
    after = os.lstat(target)
    assert (after.st_ino, after.st_mode, after.st_size) == (before.st_ino, before.st_mode, before.st_size)
    if case == "user-file":
        acc.save(target, overwrite=True)  # told to: replaced by a checkpoint that loads
        acc.load(target)
    with pytest.raises(TypeError, match=r"overwrite='yes'"):
        acc.save(tmp_path / "other.pt", overwrite="yes")


def test_save_replaces_its_own_checkpoint(tmp_path):
    acc, model, opt = _acc(steps=1)
    first = acc.save(tmp_path / "ckpt.pt")
    acc.backward(model(torch.randn(5, 4)).square().mean())
    opt.step()
    acc.save(first)  # the common loop: the same path every N steps
    fresh, _, fopt = _acc()
    fresh.load(first)
    assert fopt.applied_steps == 2


def test_a_trailing_newline_in_a_manifest_name_deletes_nothing(run):
    ck, weights, mine = run
    user = ck / "step-00000001.pt\n"  # a file of the user's whose name the edited manifest lists
    user.write_text("precious")
    manifest = json.loads((ck / ckfolder.MANIFEST).read_text())
    manifest["checkpoints"].insert(0, user.name)
    (ck / ckfolder.MANIFEST).write_text(json.dumps(manifest))
    acc, _, _ = _acc(steps=5)
    with pytest.raises(ampkit.CheckpointError, match=r"lists 'step-00000001.pt\\n', which is not an ampkit"):
        acc.save_checkpoint(ck, keep=1)
    assert user.read_text() == "precious" and mine.read_text() == "the user's"
    _resumes_step_4(ck, weights, "the manifest was edited or damaged")


def test_step_numbers_past_eight_digits_save_and_resume(run):
    ck, weights, _ = run
    for step in (99_999_999, 100_000_000):  # a long run's checkpoints, copied from step 4's bytes
        (ck / f"step-{step}.pt").write_bytes((ck / "step-00000004.pt").read_bytes())
    manifest = json.loads((ck / ckfolder.MANIFEST).read_text())
    manifest["checkpoints"] += ["step-99999999.pt", "step-100000000.pt"]
    (ck / ckfolder.MANIFEST).write_text(json.dumps(manifest))
    acc, _, _ = _acc()
    assert acc.resume(ck) == ck / "step-100000000.pt"
    acc.save_checkpoint(ck, keep=2)  # its own manifest still reads: it saves and prunes
    assert json.loads((ck / ckfolder.MANIFEST).read_text())["checkpoints"] == ["step-100000000.pt", "step-00000004.pt"]
    (ck / ckfolder.MANIFEST).unlink()  # without a manifest the newest is the largest number, not the last name
    (ck / ckfolder.LATEST).unlink()
    (ck / "step-99999999.pt").write_bytes((ck / "step-00000004.pt").read_bytes())
    fresh, _, _ = _acc()
    assert fresh.resume(ck) == ck / "step-100000000.pt"
