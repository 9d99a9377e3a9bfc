"""ragged_dot's Mosaic GPU drhs kernel: the installed one against another version.

    git show main:packages/gpu-mosaic/src/tokamax_gpu_mosaic/ragged_dot_kernel_drhs.py \
        > drhs_other.py   # on the CPU machine: the device's copy has no .git
    python tools/drhs_ab.py --other drhs_other.py [--shape moe] [--rounds 15]

Loads ``--other`` (a version of `tokamax_gpu_mosaic/ragged_dot_kernel_drhs.py`)
beside the installed module, runs both kernels' ``drhs[g] =
lhs[rows_g]^T @ dout[rows_g]`` alone at the backward heuristic's config, bf16,
interleaved (`benchmarking.time_interleaved`: one evaluation of each per round,
so both meet the same clock drift), and prints each shape's median times, their
ratio and the largest difference between the two outputs. Group sizes as the
benchmark suite's (`np.random.default_rng(0)` cuts) or equal. Shapes: the MoE
step's two drhs contractions, G16 and G64-G256 random (``--shape`` keeps the
names that contain it). Needs an NVIDIA Hopper GPU; for a kernel change's A/B
before it is merged (notes/MEASUREMENTS.md, session 70).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys

import jax
import jax.numpy as jnp
import numpy as np
from tokamax._src import benchmarking
from tokamax._src.groups import held_row_ranges
from tokamax_gpu_mosaic import ragged_dot as mosaic_ragged_dot
from tokamax_gpu_mosaic import ragged_dot_kernel_drhs as current

# name: (M, K, N, G, random sizes)
SHAPES = {
    "moe up M16384 K4096 N28672 G8": (16384, 4096, 28672, 8, True),
    "moe down M16384 K14336 N4096 G8": (16384, 14336, 4096, 8, True),
    "M16384 K2048 N16384 G16": (16384, 2048, 16384, 16, False),
    "M16384 K4096 N4096 G64 random": (16384, 4096, 4096, 64, True),
    "M65536 K2048 N768 G128 random": (65536, 2048, 768, 128, True),
    "M65536 K7168 N2048 G256 random": (65536, 7168, 2048, 256, True),
    "M8192 K7168 N2048 G256 random": (8192, 7168, 2048, 256, True),
}


def load_other(path: str):
  """The drhs module in file `path`, imported under another name."""
  spec = importlib.util.spec_from_file_location("drhs_other", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def group_sizes(m: int, g: int, random: bool) -> np.ndarray:
  if not random:
    return np.full(g, m // g)
  cuts = np.sort(np.random.default_rng(0).integers(0, m, g - 1))
  return np.diff(np.concatenate([[0], cuts, [m]]))


def contender(module, lhs, dout, sizes, config):
  g, m = sizes.shape[0], lhs.shape[0]

  def drhs(lhs, dout, sizes):
    starts, ends = held_row_ranges(sizes, None, g, m)
    return module.grouped_transposed_matmul(lhs, dout, starts, ends,
                                            out_dtype=jnp.bfloat16, config=config)
  return benchmarking.prepare(jax.jit(drhs), lhs, dout, sizes)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--other", required=True,
                      help="a file holding the other version of ragged_dot_kernel_drhs.py")
  parser.add_argument("--shape", action="append", default=[],
                      help="only shapes whose name contains this (repeatable)")
  parser.add_argument("--rounds", type=int, default=15)
  opts = parser.parse_args()
  other = load_other(opts.other)
  names = [n for n in SHAPES if not opts.shape or any(s in n for s in opts.shape)]
  if not names:
    sys.exit(f"no shape matches {opts.shape}; shapes: {list(SHAPES)}")
  print("| shape | other ms | installed ms | other / installed | max abs diff |")
  print("|---|---|---|---|---|")
  for name in names:
    m, k, n, g, random = SHAPES[name]
    keys = jax.random.split(jax.random.key(0), 2)
    lhs = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    dout = jax.random.normal(keys[1], (m, n), jnp.bfloat16)
    sizes = jnp.asarray(group_sizes(m, g, random), jnp.int32)
    # The backward's heuristic config (dlhs's), as the VJP turns it into drhs's.
    base = mosaic_ragged_dot.heuristic(m, n, k, g, 2, 2, pieces=True)
    base = dataclasses.replace(base, drhs_kernel="ws", claim_items=True)
    config = mosaic_ragged_dot.drhs_ws_config(base, 2, 2)
    contenders = {"other": contender(other, lhs, dout, sizes, config),
                  "installed": contender(current, lhs, dout, sizes, config)}
    diff = float(jnp.max(jnp.abs(contenders["other"].output.astype(jnp.float32)
                                 - contenders["installed"].output.astype(jnp.float32))))
    times = benchmarking.time_interleaved(contenders, iterations=opts.rounds)
    other_ms, ms = (times[label].median_evaluation_time_ms
                    for label in ("other", "installed"))
    print(f"| {name} | {other_ms:.3f} | {ms:.3f} | {other_ms / ms:.3f} | {diff:.3g} |",
          flush=True)
    del contenders


if __name__ == "__main__":
  main()
