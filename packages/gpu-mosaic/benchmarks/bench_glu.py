"""H200 timing of the mosaic_gpu gated_linear_unit forward against XLA (CUPTI).

Usage (GPU machine): python3 packages/gpu-mosaic/benchmarks/bench_glu.py [--sweep]
"""

import argparse
import dataclasses

import jax
import jax.numpy as jnp

import tokamax
from tokamax_gpu_mosaic import gated_linear_unit as glu


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--sweep", action="store_true")
  parser.add_argument("--triton", action="store_true")
  flags = parser.parse_args()
  m, k, n = 16384, 4096, 14336
  ks = jax.random.split(jax.random.key(0), 2)
  x = jax.random.normal(ks[0], (m, k), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(ks[1], (k, 2, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
  flops = 2 * 2 * m * k * n

  def xla(x, w):
    gate = jnp.dot(x, w[:, 0], preferred_element_type=jnp.float32)
    up = jnp.dot(x, w[:, 1], preferred_element_type=jnp.float32)
    return (jax.nn.silu(gate) * up).astype(x.dtype)
  candidates = {"XLA": xla}
  impls = ["mosaic_gpu"] + (["triton"] if flags.triton else [])
  for impl in impls:
    candidates[impl] = lambda x, w, impl=impl: tokamax.gated_linear_unit(
        x, w, activation=jax.nn.silu, implementation=impl)
  if flags.sweep:
    for bm, bn, bk, stages, width in [(128, 128, 64, 3, 8), (128, 128, 64, 4, 4),
                                      (128, 128, 64, 4, 16), (256, 64, 64, 4, 8),
                                      (128, 64, 64, 5, 8), (128, 128, 32, 6, 8)]:
      c = glu.GatedLinearUnitConfig(block_m=bm, block_n=bn, block_k=bk,
                                    num_stages=stages, grid_tile_width=width)
      candidates[str(dataclasses.astuple(c))] = (
          lambda x, w, c=c: tokamax.gated_linear_unit(
              x, w, activation=jax.nn.silu,
              implementation=glu.MosaicGpuGatedLinearUnit(c)))
  times = {}
  for label, f in candidates.items():
    try:
      ms = tokamax.benchmark(jax.jit(f), (x, w), iterations=10).median_evaluation_time_ms
    except Exception as e:  # pylint: disable=broad-except
      print(f"GLU | {label} | failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    times[label] = ms
    if label == "mosaic_gpu":
      out = jax.jit(f)(x, w).astype(jnp.float32)
      ref = jax.jit(xla)(x, w).astype(jnp.float32)
      err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
      print(f"GLU | mosaic_gpu vs XLA rel L2 {err:.2e}", flush=True)
    base = times.get("XLA")
    ratio = f"{base / ms:.3f}x XLA" if base else ""
    print(f"GLU x{m}x{k} w{k}x2x{n} | {label} | {ms:.3f} ms | "
          f"{flops / ms / 1e9:.0f} TFLOP/s | {ratio}", flush=True)


if __name__ == "__main__":
  main()
