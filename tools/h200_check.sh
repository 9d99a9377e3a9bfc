#!/usr/bin/env bash
# One device call: install the packages, run the GPU tests natively, benchmark.
# Usage (on the lent H200, repo root): bash tools/h200_check.sh [pytest-args...]
# Logs go to $OUT (or ./h200_out).
set -uo pipefail
OUT=${OUT:-h200_out}; mkdir -p "$OUT"
# Several pytest workers share one GPU: no worker may take 75% of its memory.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
source tools/h200_install.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -m tokamax info 2>&1 | tee "$OUT/info.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  [ $# -gt 0 ] || set -- packages/gpu-triton/tests integration_tests/test_conformance_installed.py
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:randomly -n 4 "$@" 2>&1 | tee "$OUT/tests.txt" | tail -25
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout "${BENCH_TIMEOUT:-300}" python3 -m tokamax bench --out "$OUT" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench.txt" | grep -v "^|---" | tail -60
fi
