#!/usr/bin/env bash
# One device call: measure (part of) the implementation grid of `python -m tokamax
# autotune --grid` on this machine's device kind, merged into the grid data the
# packages already ship for it, and leave the files it changed in
# $OUT/tuned/<device slug>/ to be committed (gpu-mosaic's tuned folder;
# layer_norm_grid.json goes to gpu-triton's). Each part has its own time limit and every shape is written as
# soon as it is measured, so a part cut short keeps what it measured.
#
#   bash tools/grid_tune.sh [part ...]    parts: attn-short attn-long attn-8k attn-unaligned
#                                         attn-unaligned-8k
#                                         norms glu ragged,
#                                         or shapes:<seconds>:<op>:<name>[,<name>...][:<impl>]
#                                         (only grid shapes whose name contains one;
#                                         with <impl>, only that implementation is
#                                         measured again and the others' entries kept:
#                                         after a kernel change)
#
# attn-long skips the dense XLA attentions (out of memory or 8-30x slower than the
# kernels at T >= 4096 on the H200 and H100: notes/MEASUREMENTS.md, session 13);
# attn-8k (the grid's 8192-token calls at aligned lengths: B8 T1024, B2 T4096),
# attn-unaligned (its lengths no multiple of 128 at 32768 tokens: T1000, T4000,
# T15000) and attn-unaligned-8k (at 8192: B8 T1000, B2 T4000; about 340 s on the
# H200, session 59) skip them for time.
set -uo pipefail
OUT=${OUT:-grid_out}; mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
source tools/h200_install.sh
slug=$(python3 -c "import jax; from tokamax._src.tuning import shipped; print(shipped.device_slug(jax.devices()[0].device_kind))")
dest="$OUT/tuned/$slug"; mkdir -p "$dest"
for pkg in packages/gpu-mosaic/src/tokamax_gpu_mosaic packages/gpu-triton/src/tokamax_gpu_triton; do
  cp "$pkg/tuned/$slug/"*_grid.json "$dest/" 2>/dev/null || true
done
G="python3 -m tokamax autotune --grid --out $OUT/tuned --iterations 5 --skip example_rms"
declare -A PART=(
  [attn-short]="300|$G --op dot_product_attention --shape 'B32 T1024'"
  [attn-long]="560|$G --op dot_product_attention --shape 'B8 T4096' --shape T8192 --shape T16384 --skip xla --skip xla_chunked"
  [attn-8k]="400|$G --op dot_product_attention --shape 'B8 T1024' --shape 'B2 T4096' --skip xla --skip xla_chunked"
  [attn-unaligned]="560|$G --op dot_product_attention --shape 'B32 T1000 ' --shape 'B8 T4000 ' --shape 'B2 T15000 ' --skip xla --skip xla_chunked"
  [attn-unaligned-8k]="400|$G --op dot_product_attention --shape 'B8 T1000 ' --shape 'B2 T4000 ' --skip xla --skip xla_chunked"
  [norms]="200|$G --op layer_norm"  # 24 shapes
  [glu]="200|$G --op gated_linear_unit"
  [ragged]="420|$G --op ragged_dot --skip xla"
)
for part in "${@:-attn-short}"; do
  if [[ $part == shapes:* ]]; then
    IFS=':' read -r _ seconds op names only <<< "$part"
    skips=""; [[ $op == dot_product_attention ]] && skips="--skip xla --skip xla_chunked"
    [[ $op == ragged_dot ]] && skips="--skip xla"
    if [[ -n $only ]]; then
      # Every other implementation of the op skipped (their entries stay).
      skips=$(python3 - "$op" "$only" <<'PY'
import sys
from tokamax._src import introspection
op, only = sys.argv[1:]
names = [s.name for s in introspection.implementations(op)]
if only not in names:
  sys.exit(f"grid_tune.sh: {only!r} is not an implementation of {op}: {names}")
print(" ".join(f"--skip {name}" for name in names if name != only))
PY
) || exit 1
    fi
    command="$G --op $op $skips"
    IFS=',' read -ra each <<< "$names"
    for name in "${each[@]}"; do command+=" --shape '$name'"; done
  else
    IFS='|' read -r seconds command <<< "${PART[$part]}"
  fi
  echo "=== $part ($seconds s): $command"
  timeout "$seconds" bash -c "$command" 2>&1 | grep -E "^(autotuning|wrote)" | tee "$OUT/grid_${part//[^A-Za-z0-9_-]/_}.txt"
done
# Only the files the parts changed stay: a device call returns at most 8 files
# from $OUT (session 77 lost a part's data to that), and an unchanged copy of a
# package's data would take a slot.
for pkg in packages/gpu-mosaic/src/tokamax_gpu_mosaic packages/gpu-triton/src/tokamax_gpu_triton; do
  for shipped in "$pkg/tuned/$slug/"*_grid.json; do
    copy="$dest/$(basename "$shipped")"
    [[ -f $shipped ]] && cmp -s "$shipped" "$copy" && rm "$copy"
  done
done
ls -l "$dest"
