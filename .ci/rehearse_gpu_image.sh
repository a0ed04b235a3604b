#!/usr/bin/env bash
# Rehearse the GPU machine's first contact on a CPU: a clean venv with the image's torch (2.11.0, CPU build
# here), numpy, and nothing of ampkit installed; then the exact device command with --smoke (tiny sizes, CPU).
# It fails when that command would not import, run or write its files there. Not wired into .ci/run (the lead
# decides); the install is large: time it (`time .ci/rehearse_gpu_image.sh`).
#
#   .ci/rehearse_gpu_image.sh [TORCH_VERSION]     # default 2.11.0; VENV=... to reuse a venv folder
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${1:-2.11.0}"
VENV="${VENV:-.ci/.venv-torch-$TORCH_VERSION}"
if [ ! -x "$VENV/bin/python3" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/python3" -m pip install -q --upgrade pip
    # ampkit's declared runtime dependencies (numpy, rich; rich only for the tools' tables) and pytest, not ampkit.
    # TORCH_INDEX=https://download.pytorch.org/whl/cpu: the ~200 MB CPU build; else the configured index's
    # (PyPI's Linux wheel is the CUDA build with its nvidia-* wheels: gigabytes, and it runs on a CPU too)
    PIP_CONSTRAINT=/dev/null "$VENV/bin/python3" -m pip install -q "torch==$TORCH_VERSION" numpy rich pytest \
        ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
fi
if "$VENV/bin/python3" -c "import ampkit" 2>/dev/null; then
    echo "rehearsal: ampkit is importable without PYTHONPATH in $VENV; the device image has no ampkit installed" >&2
    exit 1
fi
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
# The device command, as benchmarks/gpu_check.py's docstring writes it, with --smoke; python3 is the venv's.
status=0
PATH="$VENV/bin:$PATH" PYTHONPATH=$PWD/src python3 benchmarks/gpu_check.py --out "$OUT" --deadline-s 420 --smoke \
    || status=$?
for f in gpu_check.txt gpu_check.json info.json pytest.txt; do
    [ -s "$OUT/$f" ] || { echo "rehearsal: $f was not written" >&2; exit 1; }
done
if [ "$status" -ne 0 ]; then
    echo "rehearsal: torch $TORCH_VERSION: a phase failed (exit $status; the phase lines above say which)" >&2
    exit "$status"
fi
echo "rehearsal: torch $TORCH_VERSION: the device command ran and wrote its files"
