"""Every process a command starts dies with it (issue 46).

A comparison killed outright (a timeout's SIGKILL) once left its torchrun and ranks running for good. Each case
starts a command with a marker in its environment (inherited by every process under it, torchrun's ranks
included), SIGKILLs it mid-run, and then finds, within seconds, no process with the marker left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

AMPKIT = [sys.executable, "-m", "ampkit.cli.main"]
MARK = "AMPKIT_TEST_MARK"


def marked(mark: str) -> dict[int, str]:
    """pid -> command line of every live process whose environment carries `mark`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"{MARK}={mark}".encode() in (entry / "environ").read_bytes():
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def kill_mid_run(cmd: list[str], running: int, cwd: Path, settle_s: float = 3.0) -> dict[int, str]:
    """Start `cmd`, wait until `running` processes under it exist (then `settle_s`), SIGKILL it; returns what
    is left of it 15 s later (everything left is killed before returning, so that a failing test leaves no
    orphans of its own)."""
    mark = uuid.uuid4().hex
    env = {**os.environ, MARK: mark, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while len(marked(mark).keys() - {proc.pid}) < running:
            assert proc.poll() is None, f"{cmd} ended (code {proc.returncode}) before {running} processes ran"
            assert time.monotonic() < deadline, f"{cmd}: {running} processes never ran: {marked(mark)}"
            time.sleep(0.2)
        time.sleep(settle_s)
        before = marked(mark).keys() - {proc.pid}
        assert len(before) >= running, f"the processes of {cmd} ended on their own: {marked(mark)}"
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 15
    while (left := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return left


def test_a_killed_comparison_under_torchrun_leaves_neither_torchrun_nor_its_ranks(tmp_path):
    cmd = [*AMPKIT, "compare", "--task", "tiny-lm", "--steps", "100000", "--nproc", "2"]
    cmd += ["--precisions", "fp32,bf16-mixed", "--no-numerics", "--out", str(tmp_path / "report")]
    assert kill_mid_run(cmd, running=3, cwd=tmp_path) == {}  # torchrun and 2 ranks


def test_a_started_command_is_signalled_when_its_starter_is_killed(tmp_path):
    starter = textwrap.dedent(
        """
        import sys, time
        from ampkit.util.processes import popen_owned
        popen_owned([sys.executable, "-c", "import time; time.sleep(300)"])
        time.sleep(300)
        """
    )
    assert kill_mid_run([sys.executable, "-c", starter], running=1, cwd=tmp_path, settle_s=0.5) == {}


def test_sigterm_ends_the_command_through_its_cleanup(tmp_path):
    code = textwrap.dedent(
        """
        import os, signal, time
        from ampkit.util.processes import end_on_sigterm
        end_on_sigterm()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        finally:
            print("cleanup ran")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM
    assert "cleanup ran" in done.stdout


@pytest.mark.slow
def test_a_killed_comparison_of_a_task_leaves_no_run(tmp_path):
    cmd = [*AMPKIT, "compare", "--task", "tiny-lm", "--steps", "100000", "--precisions", "fp32,bf16-mixed"]
    cmd += ["--no-numerics", "--out", str(tmp_path / "report")]
    assert kill_mid_run(cmd, running=4, cwd=tmp_path) == {}  # resource tracker, forkserver, 2 runs


@pytest.mark.slow
def test_a_killed_comparison_of_a_script_leaves_no_run(tmp_path):
    script = Path(__file__).parents[1] / "examples" / "four_lines.py"
    cmd = [*AMPKIT, "compare", str(script), "--precisions", "fp32,bf16-mixed", "--steps", "100000"]
    cmd += ["--out", str(tmp_path / "report")]
    assert kill_mid_run(cmd, running=2, cwd=tmp_path, settle_s=8) == {}  # resource tracker, the run


@pytest.mark.slow
def test_a_killed_run_under_torchrun_leaves_no_rank(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import time\nimport torch.distributed as dist\ndist.init_process_group('gloo')\ntime.sleep(300)\n"
    )
    cmd = [*AMPKIT, "run", "--nproc", "2", str(script)]
    assert kill_mid_run(cmd, running=3, cwd=tmp_path) == {}  # torchrun and 2 ranks
