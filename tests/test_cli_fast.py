"""The `ampkit` command answers `--help` and a bad command line before it imports torch (issue 35):
importing torch takes seconds on a cold start, a typo's answer should not. Each case runs in a fresh
interpreter, since this test process has imported torch long ago.

The package's lazy public API (PEP 562, `ampkit/__init__.py`) is checked here too: it is what lets
`import ampkit.cli.main` skip torch, and every name must still come out as it did when imported eagerly.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ENV = {**os.environ, "PYTHONPATH": str(SRC)}

# Runs ampkit.cli.main.main on each argv of argv[1] (JSON) and prints what each did, and whether torch was imported.
RUN_MAIN = """
import contextlib, io, json, sys
from ampkit.cli.main import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    results.append({"argv": argv, "code": code, "out": out.getvalue(), "err": err.getvalue()})
print(json.dumps({"results": results, "torch": "torch" in sys.modules}))
"""

SUBCOMMANDS = ("compare", "run", "export", "info", "doctor", "plan")

# A bad command line, and what its one line on stderr must name.
BAD = [
    ([], "the following arguments are required"),
    (["nope"], "'nope'"),
    (["compare", "--no-such-flag"], "--no-such-flag"),
    (["compare", "--stpes", "3"], "did you mean '--steps'"),
    (["compare", "--steps", "-3"], "--steps -3"),
    (["compare", "--steps", "x"], "--steps"),
    (["compare", "--size", "huge"], "--size"),
    (["compare", "--precisions", "fp32,fp32"], "--precisions"),
    (["compare", "--precisions", "fp32,bf16-mixd"], "did you mean 'bf16-mixed'"),
    (["compare", "train.py", "--precisions", "fp32,bf16-mixd"], "'bf16-mixd'"),
    (["compare", "train.py", "--steps", "0"], "--steps 0"),
    (["compare", "--device", "cpu", "train.py"], "--device is for the built-in tasks"),
    (["run"], "give a script to run"),
    (["run", "--precision", "bf17", "train.py"], "--precision 'bf17'"),
    (["run", "--nproc", "0", "train.py"], "--nproc 0"),
    (["run", "--nnodes", "2", "train.py"], "--nnodes"),
    (["run", "--master-port", "99999", "train.py"], "--master-port"),
    (["export", "--out", ""], "--out"),
    (["export", "--rounds", "0"], "--rounds 0"),
    (["export", "--backends", ""], "--backends"),
    (["info", "--bench", "--bench-seconds", "0"], "--bench-seconds"),
    (["doctor"], "give a script to run"),
    (["doctor", "--task", "iris-mlp", "--wramup", "1"], "did you mean '--warmup'"),
    (["doctor", "--task", "iris-mlp", "--precision", "fp17"], "--precision 'fp17'"),
    (["doctor", "--task", "iris-mlp", "--numerics", "--gpu", "T4"], "--gpu"),
    (["plan", "--batch-size", "0"], "--batch-size 0"),
    (["plan", "--precisions", "fp32,foo"], "'foo'"),
    # a bad task name or a missing script, before torch is imported (issue 46)
    (
        ["compare", "--task", "tiny-ml"],
        "unknown task; choose one of: digits-cnn, iris-mlp, tiny-lm (did you mean 'tiny-lm'?)",
    ),
    (["compare", "missing.py"], "script 'missing.py' not found"),
    (["export", "--task", "nope"], "--task 'nope': unknown task"),
    (["doctor", "--task", "iris"], "--task 'iris': unknown task"),
    (["doctor", "missing.py"], "script 'missing.py' not found"),
    (["plan", "--task", "lm"], "--task 'lm': unknown task"),
    (["plan", "missing.py"], "script 'missing.py' not found"),
]


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict:
    """Every case of this file in one interpreter (in an empty folder): none of them may import torch."""
    argvs = [["--help"], *([sub, "--help"] for sub in SUBCOMMANDS), *(argv for argv, _ in BAD), ["--version"]]
    folder = tmp_path_factory.mktemp("cli")
    done = subprocess.run(
        [sys.executable, "-c", RUN_MAIN, json.dumps(argvs)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        cwd=folder,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert not any(folder.iterdir()), "a bad command line wrote files"
    return json.loads(done.stdout)


def test_no_case_imports_torch(answers):
    assert answers["torch"] is False


def test_help_answers(answers):
    helps = answers["results"][: 1 + len(SUBCOMMANDS)]
    for answer, prog in zip(helps, ("ampkit", *(f"ampkit {sub}" for sub in SUBCOMMANDS))):
        assert answer["code"] == 0 and answer["out"].startswith(f"usage: {prog}"), answer
    assert all(sub in helps[0]["out"] for sub in SUBCOMMANDS)


@pytest.mark.parametrize("index", range(len(BAD)), ids=[" ".join(argv) or "(nothing)" for argv, _ in BAD])
def test_bad_command_line_answers_in_one_line(answers, index):
    argv, named = BAD[index]
    answer = answers["results"][1 + len(SUBCOMMANDS) + index]
    assert answer["argv"] == argv
    assert answer["code"] == 2, answer
    assert named in answer["err"] and answer["err"].count("\n") == 1, answer
    assert answer["err"].startswith("ampkit") and answer["out"] == "", answer


def test_version_names_ampkit_torch_and_python(answers):
    answer = answers["results"][-1]
    assert answer["argv"] == ["--version"] and answer["code"] == 0, answer
    ampkit, torch = (importlib.metadata.version(package) for package in ("ampkit", "torch"))
    assert answer["out"] == f"ampkit {ampkit} (torch {torch}, Python {platform.python_version()})\n"


def test_the_module_entry_point_answers_help():
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ampkit.cli.main", "compare", "--help"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.startswith("usage: ampkit compare"), done.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line]
    assert "ampkit.cli.compare" in imported and not any(m.split(".")[0] == "torch" for m in imported)


# Records, on the first write to stderr, whether torch was imported yet; then runs the command of argv[1] (JSON),
# one that fails after torch is imported, before any training.
FIRST_WRITE = """
import io, json, sys
from ampkit.cli.main import main

class First(io.StringIO):
    torch_at_first_write = None
    def write(self, text):
        if self.torch_at_first_write is None:
            self.torch_at_first_write = "torch" in sys.modules
        return super().write(text)

sys.stderr = err = First()
code = main(json.loads(sys.argv[1]))
sys.stderr = sys.__stderr__
print(code, err.torch_at_first_write)
print(err.getvalue(), end="")
"""

# Each command that trains, failing once torch is loaded; its first line on stderr, and what its last names.
FIRST_LINES = [
    (["export", "--precisions", "fp33"], "ampkit export: training iris-mlp in fp32", "'fp33'"),
    (["doctor", "--device", "cuda:7"], "ampkit doctor: running iris-mlp to measure its speed", "cuda:7"),
    (["plan", "--device", "cuda:7"], "ampkit plan: measuring a step of iris-mlp in each precision", "cuda:7"),
]


@pytest.mark.parametrize("argv, first_line, named", FIRST_LINES, ids=[a[0] for a, _, _ in FIRST_LINES])
def test_a_command_that_trains_says_what_it_does_before_it_imports_torch(tmp_path, argv, first_line, named):
    out = ["--out", str(tmp_path / "out")] if argv[0] in ("export", "compare") else []
    command = [argv[0], "--task", "iris-mlp", *argv[1:], *out]
    done = subprocess.run(
        [sys.executable, "-c", FIRST_WRITE, json.dumps(command)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    status, first, *rest = done.stdout.splitlines()
    assert status == "2 False", done.stdout + done.stderr[-2000:]
    assert first.startswith(first_line) and named in rest[-1], done.stdout


# ---------------------------------------------------------------------------------------------
# The lazy public API


LAZY_API = """
import sys
import ampkit
assert "torch" not in sys.modules, "import ampkit imported torch"
assert set(ampkit.__all__) <= set(dir(ampkit)) and "__version__" in dir(ampkit)
import ampkit.tools.plan  # the subpackage, imported before the name: ampkit.plan stays the function
from ampkit import Accelerator, compare, export, plan
import ampkit.tools.compare.runner, ampkit.tools.export.measure
assert ampkit.Accelerator is Accelerator and Accelerator.__module__ == "ampkit.accelerator"
homes = {"compare": "ampkit.tools.compare", "export": "ampkit.inference", "plan": "ampkit.tools.plan"}
for name, function in (("compare", compare), ("export", export), ("plan", plan)):
    assert callable(function) and type(function).__name__ == "function", (name, function)
    assert getattr(ampkit, name) is function and function.__module__.startswith(homes[name]), name
assert callable(ampkit.doctor.profile) and ampkit.doctor.__name__ == "ampkit.tools.doctor"
assert isinstance(ampkit.__version__, str) and ampkit.__version__
try:
    ampkit.no_such_name
except AttributeError as exc:
    assert "no_such_name" in str(exc)
else:
    raise AssertionError("ampkit.no_such_name did not raise")
print("ok")
"""


def test_the_public_api_loads_on_first_use():
    done = subprocess.run([sys.executable, "-c", LAZY_API], capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr[-2000:]


def type_checking_imports() -> dict[str, str]:
    """name -> module of the imports under `if TYPE_CHECKING:` in ampkit/__init__.py (what type checkers see)."""
    tree = ast.parse((SRC / "ampkit" / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    return {a.asname or a.name: n.module for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}


def test_type_checkers_see_what_runs():
    import ampkit

    seen = type_checking_imports()
    assert sorted(seen) == sorted(ampkit.__all__)
    for name, module in seen.items():
        assert getattr(ampkit, name) is getattr(importlib.import_module(module), name), name


def test_the_torch_free_preset_names_are_the_presets():
    from ampkit.precision.names import PRESET_NAMES as TORCH_FREE
    from ampkit.precision.policy import PRESET_NAMES, PRESETS

    assert TORCH_FREE == PRESET_NAMES == (*PRESETS, "auto")


def test_the_torch_free_task_names_are_the_tasks():
    from ampkit.cli.args import TASK_NAMES
    from ampkit.tools.tasks import TASKS

    assert TASK_NAMES == tuple(sorted(TASKS))


def test_the_torch_free_compare_state_folder_is_the_runners():
    from ampkit.cli.args import COMPARE_STATE_DIR
    from ampkit.tools.compare.state import STATE_DIR

    assert COMPARE_STATE_DIR == STATE_DIR
