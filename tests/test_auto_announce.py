"""`precision="auto"` says what it chose, once, through `logging` (the "ampkit" logger, rank 0): one line on
stderr where the program configured no logging, a record at INFO where it did; an explicit preset says nothing."""

from __future__ import annotations

import logging
import subprocess
import sys

import ampkit


def _stderr(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return done.stderr.splitlines()


def test_auto_says_its_choice_once_on_stderr_and_an_explicit_preset_says_nothing():
    lines = _stderr(
        "import ampkit\n"
        "acc = ampkit.Accelerator(device='cpu')\n"
        "ampkit.Accelerator(device='cpu', precision='fp32')\n"
        "print(acc.policy.name, acc.policy.reason)"
    )
    chosen = [line for line in lines if line.startswith("ampkit: precision='auto' chose")]
    assert len(chosen) == 1 and " on cpu: " in chosen[0], lines


def test_a_program_that_configured_logging_gets_a_record_at_info(caplog):
    with caplog.at_level(logging.INFO, logger="ampkit"):
        acc = ampkit.Accelerator(device="cpu")
    (record,) = [r for r in caplog.records if r.name == "ampkit"]
    assert record.levelno == logging.INFO
    assert record.getMessage() == f"precision='auto' chose {acc.policy.name!r} on cpu: {acc.policy.reason[6:]}"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ampkit"):  # the program's levels decide, as for any library
        ampkit.Accelerator(device="cpu")
    assert not [r for r in caplog.records if r.name == "ampkit"]
