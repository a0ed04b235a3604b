"""Checkpoint folders a user or an attacker may hand to ampkit: no code runs, no user file is
deleted, a failed load changes nothing, and every failure is one clear CheckpointError."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import ampkit
from ampkit.checkpoint import payload as payload_file


def _tiny(precision: str = "fp32", optimizer: str = "adamw", groups: int = 1, steps: int = 2):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    if groups == 1:
        params = model.parameters()
    else:
        params = [
            {"params": model[0].parameters()},
            {"params": list(model[1].parameters()) + list(model[2].parameters())},
        ]
    opt = torch.optim.AdamW(params, lr=1e-2) if optimizer == "adamw" else torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    acc = ampkit.Accelerator(precision=precision, device="cpu")
    model, opt = acc.prepare(model, opt)
    for _ in range(steps):
        acc.backward(model(torch.randn(5, 4)).square().mean())
        opt.step()
        opt.zero_grad()
    return acc, model, opt


def _snapshot(model: nn.Module, opt) -> dict:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": repr(opt.optimizer.state_dict()),
        "applied": opt.applied_steps,
    }


def _unchanged(before: dict, model: nn.Module, opt) -> bool:
    after = model.state_dict()
    return (
        all(torch.equal(before["model"][k], after[k]) for k in after)
        and before["opt"] == repr(opt.optimizer.state_dict())
        and before["applied"] == opt.applied_steps
    )


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _crafted_sharded_folder(ck: Path, marker: Path, metadata: bytes | None = None) -> Path:
    """`ck/step-00000099/`: an ampkit.pt that says sharded (digest recomputed) and a pickled .metadata."""
    good = torch.load(next(ck.glob("step-*.pt")), weights_only=True)
    good.pop("digest")
    folder = ck / "step-00000099"
    folder.mkdir()
    payload_file.write(folder / "ampkit.pt", dict(good, sharded=True))
    (folder / ".metadata").write_bytes(metadata if metadata is not None else pickle.dumps(_RunsCode(marker)))
    (ck / "latest").write_text("step-00000099\n")
    return folder


# --- 1. nothing in a checkpoint folder runs code -------------------------------------------------
def test_a_crafted_sharded_folder_runs_no_code_on_load_or_resume(tmp_path):
    acc, model, opt = _tiny()
    ck = tmp_path / "ck"
    acc.save_checkpoint(ck)
    marker = tmp_path / "pwned"
    folder = _crafted_sharded_folder(ck, marker)
    fresh, fmodel, fopt = _tiny(steps=0)
    before = _snapshot(fmodel, fopt)
    with pytest.raises(
        ampkit.CheckpointError, match=r"\.metadata is damaged or holds objects other than DCP's metadata"
    ):
        fresh.load(folder)
    assert _unchanged(before, fmodel, fopt)
    assert fresh.resume(ck) == ck / "step-00000002.pt"  # the manifest lists only what this run wrote
    assert not marker.exists()


def test_the_sharded_metadata_reader_refuses_code_and_garbage(tmp_path):
    from ampkit.checkpoint import sharded

    marker = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(
        ampkit.CheckpointError, match=r"\.metadata is damaged or holds objects other than DCP's metadata"
    ):
        sharded.read_metadata(tmp_path)
    assert not marker.exists()
    (tmp_path / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(ampkit.CheckpointError, match="damaged"):
        sharded.read_metadata(tmp_path)


def test_the_sharded_metadata_reader_reads_real_dcp_metadata(tmp_path):
    import torch.distributed.checkpoint as dcp

    from ampkit.checkpoint import sharded

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(
            {"model": {"w": torch.ones(3, 2)}, "optim": {"lr": 0.1, "step": torch.tensor(3.0)}},
            checkpoint_id=str(tmp_path),
        )
    metadata = sharded.read_metadata(tmp_path)
    assert "model.w" in metadata.state_dict_metadata


def _global_call(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle calling `module`'s `name` (dotted names resolve attribute by attribute) on `arg`."""

    def text(t: str) -> bytes:
        return b"\x8c" + bytes([len(t.encode())]) + t.encode()

    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(arg) + b"\x85R."


_DCP = "torch.distributed.checkpoint.metadata"


@pytest.mark.parametrize(
    "module, name",
    [
        (_DCP, "torch.os.system"),
        (_DCP, "os.system"),
        ("torch", "os.system"),
        ("torch.serialization", "os.system"),
        ("torch.distributed.checkpoint.filesystem", "os.system"),
        ("collections", "OrderedDict.fromkeys"),
        (_DCP, "os"),
        (_DCP, "field"),
        ("torch", "load"),
        ("os", "system"),
        ("builtins", "eval"),
    ],
)
def test_a_dotted_or_unlisted_global_in_the_metadata_runs_nothing(tmp_path, module, name):
    marker = tmp_path / "pwned"
    acc, model, opt = _tiny()
    ck = tmp_path / "ck"
    acc.save_checkpoint(ck)
    folder = _crafted_sharded_folder(ck, marker, _global_call(module, name, f"touch {marker}"))
    fresh, fmodel, fopt = _tiny(steps=0)
    before = _snapshot(fmodel, fopt)
    with pytest.raises(ampkit.CheckpointError, match=r"\.metadata is damaged or holds objects other than DCP's") as err:
        fresh.load(folder)
    assert "\n" not in str(err.value) and _unchanged(before, fmodel, fopt) and not marker.exists()
    fresh.resume(ck)  # the manifest does not list the crafted folder: resume takes this run's own
    assert not marker.exists()


@pytest.mark.parametrize("entry", ["../userdata/x", "ABS", "link/step-00000001.pt", "step-1.pt", "notes.txt", 7])
def test_a_tampered_manifest_deletes_nothing_and_is_one_clear_error(tmp_path, entry):
    user = tmp_path / "userdata"
    user.mkdir()
    (user / "x").write_text("precious")
    (user / "step-00000001.pt").write_text("precious too")
    ck = tmp_path / "ck"
    (ck / "link").parent.mkdir()
    (ck / "link").symlink_to(user, target_is_directory=True)
    (ck / "notes.txt").write_text("mine")
    acc, model, opt = _tiny()
    acc.save_checkpoint(ck, keep=1)
    manifest_path = ck / "ampkit-checkpoints.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["checkpoints"].insert(0, str(user / "x") if entry == "ABS" else entry)
    manifest_path.write_text(json.dumps(manifest))
    before = {p: p.read_bytes() for p in [user / "x", user / "step-00000001.pt", ck / "notes.txt"]}
    acc.backward(model(torch.randn(5, 4)).square().mean())
    opt.step()
    with pytest.raises(
        ampkit.CheckpointError, match=r"ampkit-checkpoints.json lists .* which is not an ampkit checkpoint"
    ):
        acc.save_checkpoint(ck, keep=1)
    fresh, _, _ = _tiny(steps=0)
    with pytest.warns(UserWarning, match="the manifest was edited or damaged") as caught:
        assert fresh.resume(ck) == ck / "step-00000002.pt"  # not a silent fresh start: the newest, said
    assert "\n" not in str(caught[0].message)
    assert {p: p.read_bytes() for p in before} == before


def test_pruning_never_deletes_through_a_link_the_user_put_in_place(tmp_path):
    user = tmp_path / "userdata.pt"
    user.write_text("precious")
    ck = tmp_path / "ck"
    acc, model, opt = _tiny(steps=0)
    for _ in range(3):
        acc.backward(model(torch.randn(5, 4)).square().mean())
        opt.step()
        opt.zero_grad()
        first = acc.save_checkpoint(ck, keep=3) if _ == 0 else acc.save_checkpoint(ck, keep=3)
        if _ == 0:
            first.unlink()
            first.symlink_to(user)  # the oldest checkpoint's name now leads to a file of the user's
    with pytest.warns(UserWarning, match="it is a link"):
        acc.backward(model(torch.randn(5, 4)).square().mean())
        opt.step()
        acc.save_checkpoint(ck, keep=1)
    assert user.read_text() == "precious"


def test_a_second_live_writer_of_a_folder_is_refused(tmp_path):
    import subprocess
    import sys

    acc, model, opt = _tiny()
    ck = tmp_path / "ck"
    acc.save_checkpoint(ck)
    # One other process tries twice: while this (live) process holds the folder, then after a dead writer's
    # lock replaced it (taken over, and the folder is still another run's).
    code = (
        "import socket, sys, torch, ampkit; from pathlib import Path; from torch import nn; m = nn.Linear(2, 2); "
        "o = torch.optim.SGD(m.parameters(), lr=0.1); a = ampkit.Accelerator(precision='fp32', device='cpu'); "
        "m, o = a.prepare(m, o)\n"
        "for attempt in ('live', 'dead'):\n"
        " if attempt == 'dead':\n"
        "  (Path(sys.argv[1]) / 'ampkit-checkpoints.lock').write_text('99999999 ' + socket.gethostname())\n"
        " try:\n  a.save_checkpoint(sys.argv[1])\n except ampkit.CheckpointError as e:\n  print(attempt, e)\n"
        " else:\n  sys.exit(4)"
    )
    done = subprocess.run([sys.executable, "-c", code, str(ck)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    live, dead = done.stdout.split("\ndead ")
    assert live.startswith("live ") and f"is being written by another process (pid {os.getpid()}" in live
    assert "holds the checkpoints of another run" in dead  # the dead writer's lock was taken over
    assert sorted(json.loads((ck / "ampkit-checkpoints.json").read_text())["checkpoints"]) == ["step-00000002.pt"]


def test_the_writer_lock_is_taken_again_when_the_folder_is_deleted_mid_run(tmp_path):
    """Issue 45: a folder deleted mid-run lost its lock for good (the process thought it still held it), so a
    second writer got in. Each save checks that the lock is still this process's: gone, it is taken again; taken
    by another live process, the save is refused."""
    import shutil
    import socket
    import subprocess
    import sys

    acc, model, opt = _tiny()
    ck = tmp_path / "ck"
    acc.save_checkpoint(ck)
    lock = ck / "ampkit-checkpoints.lock"
    shutil.rmtree(ck)  # the user (or a cleanup job) removes the folder while the run goes on
    acc.backward(model(torch.randn(5, 4)).square().mean())
    opt.step()
    acc.save_checkpoint(ck)
    assert lock.read_text().split() == [str(os.getpid()), socket.gethostname()]  # this run's again

    shutil.rmtree(ck)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ck.mkdir()
        lock.write_text(f"{other.pid} {socket.gethostname()}\n")  # a second writer got in meanwhile
        before = _snapshot(model, opt)
        with pytest.raises(ampkit.CheckpointError, match=f"being written by another process \\(pid {other.pid}"):
            acc.save_checkpoint(ck)
        assert _unchanged(before, model, opt) and sorted(p.name for p in ck.iterdir()) == [lock.name]
    finally:
        other.kill()
        other.wait()


# --- 2. ampkit deletes only what it wrote ----------------------------------------------------------
def test_pruning_deletes_only_ampkits_own_checkpoints(tmp_path):
    user_files = {
        "step-00000009.pt": b"mine",
        "step-7": b"mine too",
        ".draft.tmp-old": b"draft",
        ".report.tmp-999999": b"report",
        "notes.txt": b"notes",
    }
    for name, data in user_files.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "step-00000003").mkdir()
    (tmp_path / "step-00000003" / "results.csv").write_text("a,b\n")
    acc, model, opt = _tiny(steps=0)
    saved = []
    for _ in range(4):
        acc.backward(model(torch.randn(5, 4)).square().mean())
        opt.step()
        opt.zero_grad()
        saved.append(acc.save_checkpoint(tmp_path, keep=2).name)
    for name, data in user_files.items():
        assert (tmp_path / name).read_bytes() == data, name
    assert (tmp_path / "step-00000003" / "results.csv").read_text() == "a,b\n"
    assert not (tmp_path / saved[0]).exists() and not (tmp_path / saved[1]).exists()
    assert (tmp_path / saved[2]).exists() and (tmp_path / saved[3]).exists()
    assert json.loads((tmp_path / "ampkit-checkpoints.json").read_text())["checkpoints"] == saved[2:]


def test_a_fresh_run_refuses_to_save_into_another_runs_folder(tmp_path):
    first, _, _ = _tiny(steps=3)
    for _ in range(3):
        first.save_checkpoint(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    second, _, _ = _tiny(steps=1)
    with pytest.raises(ampkit.CheckpointError, match=r"holds the checkpoints of another run .*acc.resume\("):
        second.save_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    third, _, _ = _tiny(steps=0)
    assert third.resume(tmp_path) is not None
    third.save_checkpoint(tmp_path)  # a resumed run continues the run it resumed


def test_resume_never_falls_back_into_another_run(tmp_path):
    old = tmp_path / "old"
    other, _, _ = _tiny(steps=3)
    other.save_checkpoint(old)  # step-00000003.pt of another run, copied in by hand
    acc, model, opt = _tiny(steps=2)
    newest = acc.save_checkpoint(tmp_path)
    (tmp_path / "step-00000003.pt").write_bytes((old / "step-00000003.pt").read_bytes())
    newest.write_bytes(newest.read_bytes()[:100])  # this run's only checkpoint breaks
    fresh, _, _ = _tiny(steps=0)
    with pytest.raises(
        ampkit.CheckpointError, match=r"no checkpoint in .* could be loaded .*step-00000002.pt: .*truncated or corrupt"
    ):
        with pytest.warns(UserWarning):
            fresh.resume(tmp_path)


# --- 5. a failed load changes nothing ----------------------------------------------------------------
@pytest.mark.parametrize(
    "saved,loading,expected",
    [
        (
            dict(optimizer="sgd"),
            dict(optimizer="adamw"),
            r"optimizer 0: it was saved from a SGD optimizer, this one is a AdamW",
        ),
        (dict(groups=2), dict(groups=1), r"optimizer 0: it has 2 parameter group\(s\), this optimizer has 1"),
        (
            dict(precision="bf16-true"),
            dict(precision="bf16-true", optimizer="sgd"),
            r"SGD optimizer, this one is a AdamW|AdamW optimizer, this one is a SGD",
        ),
    ],
)
def test_a_checkpoint_that_does_not_fit_changes_nothing(tmp_path, saved, loading, expected):
    acc, _, _ = _tiny(**saved)
    path = acc.save(tmp_path / "c.pt")
    target, model, opt = _tiny(steps=1, **loading)
    before = _snapshot(model, opt)
    with pytest.raises(ampkit.CheckpointError, match=expected):
        target.load(path)
    assert _unchanged(before, model, opt)
    acc.save_checkpoint(tmp_path / "ck")
    with pytest.raises(ampkit.CheckpointError, match=r"no checkpoint in .* could be loaded"):
        with pytest.warns(UserWarning):
            target.resume(tmp_path / "ck")
    assert _unchanged(before, model, opt)


def test_non_finite_weights_in_a_crafted_checkpoint_are_refused_on_load(tmp_path):
    acc, _, _ = _tiny()
    path = acc.save(tmp_path / "c.pt")
    data = torch.load(path, weights_only=True)
    data.pop("digest")
    data["models"][0]["0.weight"][0, 0] = float("nan")
    payload_file.write(path, data)
    target, model, opt = _tiny(steps=1)
    before = _snapshot(model, opt)
    with pytest.raises(ampkit.CheckpointError, match=r"non-finite weights \(NaN or inf\): 0/0.weight"):
        target.load(path)
    assert _unchanged(before, model, opt)


# --- 6. resume that silently starts over ---------------------------------------------------------------
def test_resume_with_only_broken_checkpoints_is_an_error_naming_each(tmp_path):
    acc, model, opt = _tiny()
    a = acc.save_checkpoint(tmp_path)
    acc.backward(model(torch.randn(5, 4)).square().mean())
    opt.step()
    b = acc.save_checkpoint(tmp_path)
    a.write_bytes(b"garbage")
    b.write_bytes(b.read_bytes()[:-1])
    fresh, _, _ = _tiny(steps=0)
    with pytest.warns(UserWarning), pytest.raises(ampkit.CheckpointError) as info:
        fresh.resume(tmp_path)
    assert a.name in str(info.value) and b.name in str(info.value)


def test_resume_given_a_file_loads_it_and_a_binary_marker_is_ignored(tmp_path):
    acc, _, _ = _tiny(steps=3)
    path = acc.save(tmp_path / "one.pt")
    fresh, _, fopt = _tiny(steps=0)
    assert fresh.resume(path) == path and fopt.applied_steps == 3
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "step-00000003.pt").write_bytes(path.read_bytes())
    (legacy / "latest").write_bytes(b"\xff\xfe\x00")
    other, _, oopt = _tiny(steps=0)
    with pytest.warns(UserWarning, match="is not text; ignoring it"):
        assert other.resume(legacy) == legacy / "step-00000003.pt"
    assert oopt.applied_steps == 3


# --- 8. errors that were raw tracebacks ------------------------------------------------------------------
def test_saving_under_a_file_or_into_a_full_disk_is_a_checkpoint_error(tmp_path, monkeypatch):
    acc, _, _ = _tiny()
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ampkit.CheckpointError, match=r"a_file: it is a file, not a folder"):
        acc.save_checkpoint(tmp_path / "a_file")
    with pytest.raises(ampkit.CheckpointError, match=r"cannot create the checkpoint folder .*a_file/sub"):
        acc.save_checkpoint(tmp_path / "a_file" / "sub")
    first = acc.save_checkpoint(tmp_path / "ck")
    real_save = torch.save

    def torn(obj, f, *a, **k):  # what torch's zip writer raises when the disk fills up mid-file
        f.write(b"PK\x03\x04 partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", torn)
    acc.backward(torch.ones((), requires_grad=True) * 1.0)
    with pytest.raises(
        ampkit.CheckpointError, match=r"could not write .*step-00000002.pt: .*the previous checkpoint is intact"
    ):
        acc.save_checkpoint(tmp_path / "ck")
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "ampkit-checkpoints.json",
        "ampkit-checkpoints.lock",
        "latest",
        first.name,
    ]


def test_a_truncated_or_flipped_first_byte_file_is_called_corrupt_not_pickled(tmp_path):
    acc, _, _ = _tiny()
    data = acc.save(tmp_path / "good.pt").read_bytes()
    (tmp_path / "short.pt").write_bytes(data[:-1])
    (tmp_path / "flipped.pt").write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])
    for name in ("short.pt", "flipped.pt"):
        with pytest.raises(ampkit.CheckpointError, match=rf"{name} is truncated or corrupt") as info:
            acc.load(tmp_path / name)
        assert "could run code" not in str(info.value)
