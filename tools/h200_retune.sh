#!/usr/bin/env bash
# One device call: autotune ragged_dot and gated_linear_unit over every installed
# GPU backend into gpu-mosaic's tuned-data folder (copied to $OUT/tuned, to be
# committed), run the Mosaic GPU tests, then benchmark with that data in place.
set -uo pipefail
OUT=${OUT:-h200_out}; mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
source tools/h200_install.sh
dest=$(python3 -c "import os, tokamax_gpu_mosaic.tuned as t; print(os.path.dirname(t.__file__))")
# Three problems (ragged_dot G16, G256, the GLU): keep TUNE_TIMEOUT above 3 x
# PROBLEM_TIMEOUT plus about 40 s of start-up, or nothing is written.
timeout "${TUNE_TIMEOUT:-260}" python3 -m tokamax autotune --op ragged_dot \
  --op gated_linear_unit --out "$dest" --iterations 5 \
  --timeout "${PROBLEM_TIMEOUT:-70}" 2>&1 | tail -5
mkdir -p "$OUT/tuned" && cp "$dest"/*/*.json "$OUT/tuned/"
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -n 4 -p no:randomly \
  packages/gpu-mosaic/tests packages/gpu-triton/tests/test_determinism.py 2>&1 | tail -3
timeout "${BENCH_TIMEOUT:-240}" python3 -m tokamax bench --op ragged_dot \
  --op gated_linear_unit --iterations 5 --out "$OUT" 2>&1 | grep "^| "
