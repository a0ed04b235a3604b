"""`held_back()`: other libraries' warnings and log lines are counted, not printed, and said in one line;
ampkit's own pass through; every logger's handlers are as they were after the block."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from ampkit.util.held_back import held_back

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _noise() -> None:
    """What an export's imports say: a library's logger with its own handler (torch's), one without (torchao's,
    printed by logging's last resort), the root logger (onnxruntime's `logging.warning`), a deprecation."""
    logging.getLogger("fakelib.sub").warning("Failed to load fakelib/_C.so")
    logging.getLogger("quietlib").warning("no handler of its own")
    logging.warning("Please consider to run pre-processing")
    warnings.warn("`LeafSpec` is deprecated", FutureWarning, stacklevel=1)


def test_other_libraries_are_counted_and_ampkits_own_pass_through(capsys):
    own = io.StringIO()
    fakelib = logging.getLogger("fakelib")
    fakelib.addHandler(logging.StreamHandler(own))
    root_handlers = list(logging.root.handlers)
    try:
        with warnings.catch_warnings(record=True) as outside:
            warnings.simplefilter("always")
            with held_back() as held:
                _noise()
                logging.getLogger("ampkit.tools.export").warning("ampkit's own line")
                import ampkit.util.present as inside_ampkit

                warnings.warn_explicit("ampkit's own warning", UserWarning, inside_ampkit.__file__, 1)
        assert own.getvalue() == ""  # the library's own handler saw nothing
        assert capsys.readouterr().err == ""  # nor did stderr (root, last resort)
        assert held.sources == {"fakelib": 1, "quietlib": 1, "root": 1, "FutureWarning": 1}
        assert held.summary() == (
            "held back 4 messages from other libraries (FutureWarning 1, fakelib 1, quietlib 1, root 1); -v shows them"
        )
        assert [str(w.message) for w in outside] == ["ampkit's own warning"]
        assert fakelib.handlers and isinstance(fakelib.handlers[0], logging.StreamHandler)
        assert logging.root.handlers == root_handlers  # not configured by the library's logging.warning
    finally:
        fakelib.handlers.clear()


def test_show_lets_everything_through():
    own = io.StringIO()
    fakelib = logging.getLogger("fakelib")
    fakelib.addHandler(logging.StreamHandler(own))
    try:
        with warnings.catch_warnings(record=True) as outside:
            warnings.simplefilter("always")
            with held_back(show=True) as held:
                logging.getLogger("fakelib.sub").warning("Failed to load fakelib/_C.so")
                warnings.warn("deprecated", FutureWarning, stacklevel=1)
        assert own.getvalue() == "Failed to load fakelib/_C.so\n"
        assert len(outside) == 1 and held.summary() is None
    finally:
        fakelib.handlers.clear()


@pytest.mark.slow
def test_ampkit_export_says_one_line_for_other_libraries_and_all_with_v(tmp_path):
    """The command as a user runs it: progress lines with seconds, one line for the held-back messages."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("torchao")

    def export(*extra: str) -> str:
        cmd = [sys.executable, "-m", "ampkit.cli.main", "export", "--task", "iris-mlp", "--steps", "20", "--rounds"]
        cmd += ["1", "--precisions", "fp32,int8", "--out", str(tmp_path / str(len(extra))), *extra]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={"PYTHONPATH": SRC, "PATH": ""})
        assert done.returncode == 0, done.stderr
        return done.stderr

    quiet = export()
    assert "ampkit export [   " in quiet and "] exporting int8 with onnxruntime (4 of 4)" in quiet
    assert "ampkit export: held back " in quiet and "-v shows them" in quiet
    assert "Failed to load" not in quiet and "Skipping torchvision" not in quiet
    loud = export("-v")
    assert "held back" not in loud


@pytest.mark.slow
def test_ampkit_compare_inference_holds_the_exports_messages_back_and_says_its_phases(tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("torchao")
    cmd = [sys.executable, "-m", "ampkit.cli.main", "compare", "--task", "iris-mlp", "--steps", "20"]
    cmd += ["--precisions", "fp32,bf16-mixed", "--no-numerics", "--inference", "--out", str(tmp_path / "r")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={"PYTHONPATH": SRC, "PATH": ""})
    assert done.returncode == 0, done.stderr
    printed = done.stdout + done.stderr
    assert "exporting the fp32-trained model in each precision" in printed and "  timing " in printed
    assert "held back " in printed and "-v shows them" in printed
    assert "Failed to load" not in printed and "Skipping torchvision" not in printed


def test_ampkits_own_warnings_pass_on_when_the_block_raises():
    import ampkit.util.present as inside_ampkit

    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="the export failed"), held_back():
            warnings.warn_explicit("ampkit's own warning", UserWarning, inside_ampkit.__file__, 1)
            warnings.warn("a library's", FutureWarning, stacklevel=1)
            raise RuntimeError("the export failed")
    assert [str(w.message) for w in outside] == ["ampkit's own warning"]
