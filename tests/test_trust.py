"""`compare --out DIR` writes into a folder the user named: it overwrites and deletes only what an earlier
ampkit report there recorded as its own (`.ampkit-owned.json`), and refuses anything else in one line
before any training."""

from __future__ import annotations

import json

import pytest

from ampkit.cli.main import main
from ampkit.tools.compare import compare
from ampkit.tools.compare.state import forget_runs
from ampkit.util.files import OWNED_RECORD, OwnedFiles

ARGS = dict(task="iris-mlp", precisions=["fp32"], steps=4, device="cpu", show=False, numerics=False, isolate=False)


def _tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", [".compare/notes.txt", "loss_curves.png", "report.html", "report.json", "plan.png"])
def test_a_folder_holding_files_ampkit_did_not_write_is_refused_before_training(tmp_path, name, capsys):
    out = tmp_path / "r"
    (out / name).parent.mkdir(parents=True, exist_ok=True)
    (out / name).write_bytes(b"the user's")
    before = _tree(out)
    first = name.split("/")[0]
    code = main(
        [
            "compare",
            "--task",
            "iris-mlp",
            "--steps",
            "4",
            "--precisions",
            "fp32",
            "--out",
            str(out),
            "--device",
            "cpu",
            "--no-numerics",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{out / first} exists and ampkit did not write it" in err
    assert _tree(out) == before and not (out / OWNED_RECORD).exists()


def test_a_second_comparison_replaces_only_its_own_files(tmp_path):
    out = tmp_path / "r"
    compare(out=out, **ARGS)
    owned = json.loads((out / OWNED_RECORD).read_text())["files"]
    assert {"report.json", "report.html", ".compare", ".compare/fp32.json"} <= set(owned)
    (out / "notes.txt").write_text("mine")
    (out / ".compare" / "mine.txt").write_text("mine too")  # the user's file inside ampkit's folder
    compare(out=out, **ARGS)  # a new comparison forgets the old runs: only what ampkit recorded
    assert (out / "notes.txt").read_text() == "mine" and (out / ".compare" / "mine.txt").read_text() == "mine too"
    assert (out / ".compare" / "fp32.json").exists() and (out / "report.json").exists()


def test_a_tampered_record_never_makes_ampkit_touch_other_files(tmp_path):
    out, victim = tmp_path / "r", tmp_path / "victim.png"
    victim.write_text("precious")
    (tmp_path / "elsewhere").mkdir()
    out.mkdir()
    (out / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere" / "x").write_text("precious too")
    record = {"format": "ampkit-owned", "files": ["../victim.png", str(victim), "link/x", ".compare/../../victim.png"]}
    (out / OWNED_RECORD).write_text(json.dumps(record))
    owned = OwnedFiles(out)
    assert owned.names == set()
    for name in record["files"]:
        owned.remove(name)
    assert victim.read_text() == "precious" and (tmp_path / "elsewhere" / "x").read_text() == "precious too"
    (out / "loss_curves.png").symlink_to(victim)  # a link in place of a recorded plot is not ampkit's
    owned.claim(["report.json"])
    (out / OWNED_RECORD).write_text(json.dumps({"format": "ampkit-owned", "files": ["loss_curves.png"]}))
    with pytest.raises(ValueError, match="loss_curves.png exists and ampkit did not write it"):
        OwnedFiles(out).check(["loss_curves.png"])
    OwnedFiles(out).remove("loss_curves.png")
    assert victim.read_text() == "precious"


def test_compare_script_refuses_a_log_it_did_not_write(tmp_path):
    from ampkit.tools.compare.script import compare_script

    out = tmp_path / "r"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "fp32.log").write_text("the user's log")
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('never run')\n")
    with pytest.raises(ValueError, match=r"logs/fp32.log exists and ampkit did not write it"):
        compare_script(script, ["fp32"], out=out, show=False)
    assert (out / "logs" / "fp32.log").read_text() == "the user's log"


def test_a_record_edited_with_near_miss_names_makes_ampkit_delete_nothing(tmp_path):
    out = tmp_path / "r"
    (out / ".compare").mkdir(parents=True)
    near = ["report.json\n", " report.json", ".compare/fp32.json\n", ".compare/x\x00", ".compare/", "..", "a//b"]
    for name in ["report.json\n", " report.json", ".compare/fp32.json\n", ".compare/notes txt"]:
        (out / name).write_text("the user's")
    record = {"format": "ampkit-owned", "files": [*near, ".compare/notes txt"]}
    (out / OWNED_RECORD).write_text(json.dumps(record))
    owned = OwnedFiles(out)
    assert owned.names == set()
    forget_runs(owned)
    for name in record["files"]:
        owned.remove(name)
    assert sorted(p.name for p in (out / ".compare").iterdir()) == ["fp32.json\n", "notes txt"]
    assert (out / "report.json\n").read_text() == (out / " report.json").read_text() == "the user's"
    with pytest.raises(ValueError, match=r"\.compare exists and ampkit did not write it"):
        OwnedFiles(out).claim([".compare"])  # the folder is the user's: not recorded, so never claimed
    OwnedFiles(tmp_path / "new").claim([".compare", ".compare/fp32.json", "logs/bf16-mixed.log"])
    assert OwnedFiles(tmp_path / "new").names == {".compare", ".compare/fp32.json", "logs/bf16-mixed.log"}
