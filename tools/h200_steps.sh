#!/usr/bin/env bash
# One device call running several steps, each under its own time limit, so that a
# hang in one (a barrier mismatch in a new kernel) still leaves the others' logs.
# Usage: bash tools/h200_steps.sh "name|seconds|command" ...   (logs: $OUT/name.txt)
set -uo pipefail
OUT=${OUT:-h200_out}; mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
source tools/h200_install.sh
for step in "$@"; do
  IFS='|' read -r name seconds command <<< "$step"
  echo "=== $name ($seconds s): $command"
  start=$SECONDS
  timeout "$seconds" bash -c "$command" > "$OUT/$name.txt" 2>&1
  # The elapsed time sizes the next call's limits (124: the limit cut it).
  echo "exit $? after $((SECONDS - start)) s"; grep -E "passed|failed|error" "$OUT/$name.txt" | tail -3
  grep "^| " "$OUT/$name.txt" | grep -v "^|---" | tail -40
done
