#!/usr/bin/env bash
# Device call: GPU-only tests (benchmarking methods, determinism, export, jax-triton
# example), then autotune the reference shapes into the installed gpu-triton tuned-data
# folder, then benchmark every usable implementation with the tuned data in place.
# Results land in $OUT (tuned JSON files under $OUT/tuned).
set -uo pipefail
OUT=${OUT:-h200_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
SKIP_TESTS=1 SKIP_BENCH=1 bash tools/h200_check.sh > "$OUT/setup.txt" 2>&1 || exit 1
export PYTHONPATH=/tmp/site
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:randomly -n 4 -rs \
    packages/core/tests/test_benchmarking.py packages/gpu-triton/tests/test_determinism.py \
    packages/gpu-triton/tests/test_jax_triton_example.py integration_tests/test_export_kernels.py \
    2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
fi
TUNED=$(python3 -c "import tokamax_gpu_triton.tuned as t; print(t.__path__[0])")
if [ "${SKIP_TUNE:-0}" != 1 ]; then
  timeout "${TUNE_TIMEOUT:-300}" python3 -m tokamax autotune --out "$TUNED" --iterations 5 \
    --timeout "${TUNE_PER_PROBLEM:-30}" ${TUNE_ARGS:-} 2>&1 | tee "$OUT/autotune.txt" | tail -12
  tar -C "$TUNED" -czf "$OUT/tuned.tgz" . 2>/dev/null
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout "${BENCH_TIMEOUT:-240}" python3 -m tokamax bench --iterations 5 ${BENCH_ARGS:-} \
    --out "$OUT" 2>&1 | grep "^| " | grep -v "^| op" | tee "$OUT/bench_all.txt"
fi
