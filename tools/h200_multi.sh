#!/usr/bin/env bash
# One device call on a machine with several H200s (kinds nvidia-h200-x2 / -x4):
# the multidevice tests on all GPUs and on 2, the q_offset kernel tests, and the
# scaling benchmark (tools/multi_gpu_scaling.py). Logs go to $OUT.
# Env: TESTS (pytest targets, default the multidevice folder), SKIP_TESTS,
# SKIP_2GPU_TESTS, SKIP_KERNEL_TESTS, TEST_TIMEOUT, BENCH_TIMEOUT, SCALING_ARGS.
set -uo pipefail
OUT=${OUT:-h200_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on these shared hosts
export XLA_PYTHON_CLIENT_PREALLOCATE=false
source tools/h200_install.sh
nvidia-smi -L | tee "$OUT/gpus.txt"
n=$(nvidia-smi -L | wc -l)
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:randomly -n 4 \
    ${TESTS:-packages/core/tests/multidevice} 2>&1 | tee "$OUT/tests_all.txt" | tail -8
  if [ "$n" -gt 2 ] && [ "${SKIP_2GPU_TESTS:-0}" != 1 ]; then
    CUDA_VISIBLE_DEVICES=0,1 timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -n 4 \
      -p no:randomly ${TESTS:-packages/core/tests/multidevice} 2>&1 | tee "$OUT/tests_2.txt" | tail -4
  fi
  [ "${SKIP_KERNEL_TESTS:-0}" = 1 ] || CUDA_VISIBLE_DEVICES=0 timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -n 4 \
    -p no:randomly packages/gpu-triton/tests/test_attention.py \
    integration_tests/test_conformance_installed.py -k q_offset 2>&1 \
    | tee "$OUT/tests_q_offset.txt" | tail -4
fi
gpus="1 2"; [ "$n" -ge 4 ] && gpus="1 2 4"
timeout "${BENCH_TIMEOUT:-360}" python3 tools/multi_gpu_scaling.py --gpus $gpus \
  --out "$OUT/scaling.json" ${SCALING_ARGS:-} 2>&1 | tee "$OUT/scaling.txt" | tail -30
