#!/usr/bin/env bash
# The GPU-only checks, as one short script for a lent GPU machine (they skip on a CPU):
#   bash benchmarks/gpu_checks.sh        # writes to $OUT (or ./gpu-checks) and prints a summary
# - `ampkit info --bench --json`: the capability table against a measured matmul per dtype
# - `ampkit doctor --task tiny-lm --json` on cuda: kernel launches and syncs from the profiler
# - the GPU-only tests of the suite (sync counts under torch.cuda.set_sync_debug_mode, the
#   bench confirming the table, ...)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-checks}"
mkdir -p "$out"
ampkit info --bench --json > "$out/info.json"
ampkit info --bench | tee "$out/info.txt"
ampkit doctor --task tiny-lm --device cuda --json > "$out/doctor-tiny-lm.json"
ampkit doctor --task tiny-lm --device cuda | tee "$out/doctor-tiny-lm.txt"
python -m pytest -q -rs tests/test_cuda.py tests/test_info.py tests/test_doctor.py \
  | tee "$out/pytest.txt"
