#!/usr/bin/env bash
# The GPU-only checks, as short scripts for a lent GPU machine:
#   bash benchmarks/gpu_checks.sh tests   # correctness: info, doctor, the GPU-only tests (a few minutes)
#   bash benchmarks/gpu_checks.sh perf    # speed: benchmarks/peers.py --device cuda, eager then compiled
#   bash benchmarks/gpu_checks.sh         # both, tests first (may need more than one 600 s call: split it there)
# Everything goes to $OUT (or ./gpu-checks); a summary is printed.
# - tests: `ampkit info --bench --json` (the capability table against a measured matmul per dtype);
#   `ampkit doctor --task tiny-lm --json` on cuda; tests/test_cuda.py (zero blocking syncs per step
#   under torch.cuda.set_sync_debug_mode("error"), parity with the hand-written loop, compile=True
#   and cuda_graphs=True training like the eager step) and the GPU tests of test_info/test_doctor.
# - perf: peers.py at its GPU sizes (a transformer encoder, 8 layers, d_model 1024, seq 512, batch
#   64, and the launch-bound iris MLP): the hand-written fp32 / TF32 / bf16 / fp16 loops and every
#   ampkit preset; then the compiled rows (compile=True, cuda_graphs=True) of bf16-mixed and bf16-true.
#   Writes peers-cuda*.json (every figure) and .txt (the tables).
# A failing step is reported and the others still run.
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
  step "pytest (GPU tests)" bash -c 'set -o pipefail; python -m pytest -q -rs tests/test_cuda.py tests/test_info.py tests/test_doctor.py | tee "$OUT/pytest.txt"'
fi
if [[ "$mode" != tests ]]; then
  step "peers.py --device cuda (eager)" bash -c 'set -o pipefail; python benchmarks/peers.py --device cuda --models transformer,iris \
    --variants "hand-written*,ampkit*" --no-compile --json "$OUT/peers-cuda.json" | tee "$OUT/peers-cuda.txt"'
  step "peers.py --device cuda (compiled)" bash -c 'set -o pipefail; python benchmarks/peers.py --device cuda --models transformer,iris \
    --variants "ampkit bf16-mixed*,ampkit bf16-true*" --json "$OUT/peers-cuda-compiled.json" | tee "$OUT/peers-cuda-compiled.txt"'
fi

if ((${#failed[@]})); then
  echo "gpu_checks.sh $mode: FAILED: ${failed[*]} (outputs in $out)" >&2
  exit 1
fi
echo "gpu_checks.sh $mode: all steps passed (outputs in $out)" >&2
