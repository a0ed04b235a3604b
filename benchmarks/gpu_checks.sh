#!/usr/bin/env bash
# The GPU-only checks, as short scripts for a lent GPU machine (they skip on a CPU):
#   bash benchmarks/gpu_checks.sh tests   # correctness: info, doctor, the GPU-only tests (a few minutes)
#   bash benchmarks/gpu_checks.sh perf    # performance: benchmarks/gpu_check.py, at most $GPU_CHECK_BUDGET s (420)
#   bash benchmarks/gpu_checks.sh         # both, tests first (longer than one 600 s call: split it there)
# Everything goes to $OUT (or ./gpu-checks); a summary is printed.
# - tests: `ampkit info --bench --json` (the capability table against a measured matmul per dtype);
#   `ampkit doctor --task tiny-lm --json` on cuda (kernel launches and syncs from the profiler); the
#   GPU-only tests of the suite (sync counts under torch.cuda.set_sync_debug_mode, the bench
#   confirming the table, ...). A failing step is reported and the others still run.
# - perf: fp32 / TF32 / bf16 / fp16 / ampkit presets (with and without compile=True) on a transformer
#   that fills the GPU, zero blocking syncs per step under set_sync_debug_mode("error"), and a
#   launch-bound MLP with cuda_graphs=True; writes gpu_check.json and gpu_check.md (see its --help).
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:-all}"
case "$mode" in tests|perf|all) ;; *) echo "usage: $0 [tests|perf|all]" >&2; exit 2 ;; esac
out="${OUT:-gpu-checks}"
mkdir -p "$out"
export OUT="$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's ampkit, installed or not
failed=()
step() {  # step NAME COMMAND...: run it, remember a failure, go on
  local name="$1"; shift
  echo "== $name" >&2
  "$@" || failed+=("$name")
}

if [[ "$mode" != perf ]]; then
  step "info --bench --json" bash -c 'python -m ampkit.cli info --bench --json > "$OUT/info.json"'
  step "info --bench" bash -c 'python -m ampkit.cli info --bench | tee "$OUT/info.txt"'
  step "doctor --json" bash -c 'python -m ampkit.cli doctor --task tiny-lm --device cuda --json > "$OUT/doctor-tiny-lm.json"'
  step "doctor" bash -c 'python -m ampkit.cli doctor --task tiny-lm --device cuda | tee "$OUT/doctor-tiny-lm.txt"'
  step "pytest (GPU tests)" bash -c 'python -m pytest -q -rs tests/test_cuda.py tests/test_info.py tests/test_doctor.py | tee "$OUT/pytest.txt"'
fi
if [[ "$mode" != tests ]]; then
  step "gpu_check.py" bash -c 'python benchmarks/gpu_check.py --budget "${GPU_CHECK_BUDGET:-420}" | tee "$OUT/gpu_check.txt"'
fi

if ((${#failed[@]})); then
  echo "gpu_checks.sh $mode: FAILED: ${failed[*]} (outputs in $out)" >&2
  exit 1
fi
echo "gpu_checks.sh $mode: all steps passed (outputs in $out)" >&2
