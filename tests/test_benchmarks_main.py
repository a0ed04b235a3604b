"""`python -m benchmarks` (issue 44): the one command that measures the headline figures and keeps one row per
hardware in RESULTS.md's headline table. The row writer is checked here on a copy of the table; the whole
command at `--quick` sizes (about a minute) is behind `-m slow`."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("benchmarks_main", ROOT / "benchmarks" / "__main__.py")
assert spec is not None and spec.loader is not None
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

TABLE = [
    "# Benchmark results",
    "",
    bench.START,
    *bench.HEADER,
    "| Old CPU (flags a) (2026-12-01, ampkit aaaa) | 1× | 1× | 1× | old |",
    "| Other CPU (no bf16/fp16 flags) (2026-12-02, ampkit bbbb) | 2× | 2× | 2× | other |",
    "| NVIDIA H200 | **pending**: the command | pending | pending | pending |",
    bench.END,
    "",
    "1. a footnote the writer leaves alone",
]


@pytest.fixture
def results(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "RESULTS.md"
    path.write_text("\n".join(TABLE) + "\n")
    monkeypatch.setattr(bench, "RESULTS", path)
    return path


def rows(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    return lines[lines.index(bench.START) + 1 + len(bench.HEADER) : lines.index(bench.END)]


def test_a_rerun_replaces_its_hardware_row_only(results):
    bench.write_row("Old CPU (flags a)", "| Old CPU (flags a) (2026-12-05, ampkit cccc) | 3× | 3× | 3× | new |")
    got = rows(results)
    assert got == [TABLE[6], "| Old CPU (flags a) (2026-12-05, ampkit cccc) | 3× | 3× | 3× | new |", TABLE[7]]
    assert results.read_text().endswith("1. a footnote the writer leaves alone\n")


def test_new_hardware_goes_above_the_pending_rows(results):
    bench.write_row("New CPU (amx)", "| New CPU (amx) (2026-12-05, ampkit dddd) | 4× | 4× | 4× | fresh |")
    got = rows(results)
    assert got[:2] == TABLE[5:7] and got[2].startswith("| New CPU (amx) (") and "pending" in got[3]


def test_a_file_without_the_markers_is_refused_untouched(results):
    results.write_text("# no table here\n")
    with pytest.raises(SystemExit, match="headline:start"):
        bench.write_row("X", "| X () | 1 | 1 | 1 | 1 |")
    assert results.read_text() == "# no table here\n"


def test_the_hardware_label_names_the_flags_not_the_threads():
    label = bench.hardware()
    assert "threads" not in label and label.endswith(")")


def test_quick_and_write_together_are_refused(results):
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--write"])
    assert rows(results) == TABLE[5:8]


@pytest.mark.slow
def test_the_quick_command_prints_a_whole_row():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick"], capture_output=True, text=True, timeout=900, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    row = done.stdout.strip().splitlines()[-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 5, row
    assert "bf16-mixed" in cells[1] and "fp32" in cells[2] and "MiB fp32" in cells[3], row
    assert "failed" not in row and "timed out" not in row, row
