"""`--nproc` beyond the machine's devices is refused before anything starts (issue 46): `ampkit compare
--nproc 100000` once launched torchrun with 100,000 workers on 2 cores. `--oversubscribe` allows it on purpose."""

from __future__ import annotations

import os

import pytest

from ampkit.cli import args as flags
from ampkit.cli.main import main

CORES = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    "argv",
    [
        ["compare", "--task", "iris-mlp", "--nproc", "100000", "--out", "{out}"],
        ["run", "--nproc", "100000", "{script}"],
    ],
    ids=["compare", "run"],
)
def test_nproc_beyond_the_cores_is_refused_before_anything_starts(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "fork", lambda: pytest.fail("a process was started"))
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script ran')\n")
    out = tmp_path / "report"
    code = main([a.format(out=out, script=script) for a in argv])
    err = capsys.readouterr().err
    assert code == 2
    assert f"--nproc 100000: this machine has {CORES} CPU core" in err and "--oversubscribe" in err
    assert err.count("\n") == 1 and not out.exists()


def test_the_bound_is_the_cores_without_a_gpu_and_oversubscribe_lifts_it():
    assert flags.nproc(None) is None and flags.nproc(1) is None
    assert flags.nproc(CORES, device="cpu") is None
    assert f"at most --nproc {CORES}" in (flags.nproc(CORES + 1, device="cpu") or "")
    assert flags.nproc(CORES + 1, device="cpu", oversubscribe=True) is None
