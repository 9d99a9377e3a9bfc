"""H200 timing of the mosaic_gpu ragged_dot forward against its peers (CUPTI).

Usage (on the GPU machine): python3 packages/gpu-mosaic/benchmarks/bench_ragged_dot.py
  [--sweep] [--shapes 0,1]
Prints one line per (shape, candidate): median ms, TFLOP/s, ratio to the dense
batched matmul of the same FLOPs (the bound a grouped matmul should reach).
"""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import tokamax
from tokamax_gpu_mosaic import ragged_dot as rd

SHAPES = [(16384, 2048, 16384, 16, False), (65536, 7168, 2048, 256, True)]


def _inputs(m, k, n, g, random_sizes):
  ks = jax.random.split(jax.random.key(0), 2)
  if random_sizes:
    cuts = np.sort(np.random.default_rng(0).integers(0, m, g - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [m]]))
  else:
    sizes = np.full(g, m // g)
  lhs = jax.random.normal(ks[0], (m, k), jnp.float32).astype(jnp.bfloat16)
  rhs = (jax.random.normal(ks[1], (g, k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
  return lhs, rhs, jnp.asarray(sizes, jnp.int32)


def _time(f, args):
  data = tokamax.benchmark(jax.jit(f), args, iterations=10)
  return data.median_evaluation_time_ms


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--sweep", action="store_true")
  parser.add_argument("--shapes", default="0,1")
  parser.add_argument("--triton", action="store_true")
  parser.add_argument("--bwd", action="store_true", help="time forward+backward")
  flags = parser.parse_args()
  for idx in map(int, flags.shapes.split(",")):
    m, k, n, g, random_sizes = SHAPES[idx]
    lhs, rhs, sizes = _inputs(m, k, n, g, random_sizes)
    flops = 2 * m * k * n
    name = f"M{m} K{k} N{n} G{g}" + (" random" if random_sizes else "")

    def dense(lhs, rhs, sizes):
      del sizes
      return jnp.einsum("gmk,gkn->gmn", lhs.reshape(g, m // g, k), rhs,
                        preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    candidates = {"dense batched matmul": dense}
    impls = ["mosaic_gpu"] + (["triton"] if flags.triton else [])
    for impl in impls:
      candidates[impl] = lambda a, b, c, impl=impl: tokamax.ragged_dot(
          a, b, c, implementation=impl)
    if flags.sweep:
      base = rd.MosaicGpuRaggedDot().heuristic_config(
          _args(lhs, rhs, sizes))
      for c in _sweep(base):
        candidates[str(dataclasses.astuple(c))] = (
            lambda a, b, cc, c=c: tokamax.ragged_dot(
                a, b, cc, implementation=rd.MosaicGpuRaggedDot(c)))
    if flags.bwd:
      dy = jax.random.normal(jax.random.key(7), (m, n), jnp.float32).astype(
          jnp.bfloat16)
      candidates = {label: _fwd_bwd(f, dy) for label, f in candidates.items()
                    if "(" not in label}
      flops *= 3
      name += " fwd+bwd"
    times = {}
    for label, f in candidates.items():
      try:
        ms = _time(f, (lhs, rhs, sizes))
      except Exception as e:  # pylint: disable=broad-except
        print(f"{name} | {label} | failed: {type(e).__name__}: {str(e)[:300]}",
              flush=True)
        continue
      times[label] = ms
      if label == "mosaic_gpu" and not flags.bwd:
        out = jax.jit(f)(lhs, rhs, sizes)
        ref = jax.jit(lambda a, b, c: tokamax.ragged_dot(
            a, b, c, implementation="triton"))(lhs, rhs, sizes)
        err = float(jnp.linalg.norm((out - ref).astype(jnp.float32))
                    / jnp.linalg.norm(ref.astype(jnp.float32)))
        print(f"{name} | mosaic_gpu vs triton rel L2 {err:.2e}", flush=True)
      dense_ms = times.get("dense batched matmul")
      ratio = f"{dense_ms / ms:.3f}x dense" if dense_ms else ""
      print(f"{name} | {label} | {ms:.3f} ms | {flops / ms / 1e9:.0f} TFLOP/s | "
            f"{ratio}", flush=True)


def _fwd_bwd(f, dy):
  def loss(lhs, rhs, sizes):
    out = f(lhs, rhs, sizes).reshape(dy.shape)
    return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1))


def _args(lhs, rhs, sizes):
  from tokamax._src.ops.ragged_dot import RaggedDotArgs  # pylint: disable=g-import-not-at-top
  return RaggedDotArgs(lhs=lhs, rhs=rhs, group_sizes=sizes)


def _sweep(base):
  out = []
  for tiling, bm, bn, bk, stages, width in [
      ("group", 128, 128, 64, 3, 8), ("group", 128, 128, 64, 3, 4),
      ("group", 128, 128, 64, 3, 16), ("group", 128, 128, 64, 3, 2),
      ("group", 128, 64, 64, 5, 8), ("fixed", 128, 128, 64, 3, 8)]:
    out.append(dataclasses.replace(base, block_m=bm, block_n=bn, block_k=bk,
                                   num_stages=stages, grid_tile_width=width,
                                   row_tiling=tiling))
  return out


if __name__ == "__main__":
  main()
