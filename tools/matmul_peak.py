"""How fast the device's plain matmuls run, and what that allows a GLU.

A gated linear unit's forward is one matmul (x @ [w_gate | w_up]) and an
elementwise product; its backward two matmuls (dx, dw) and the activation's
derivative. Its time cannot go below its matmuls' FLOPs at the best rate the
device's matmuls reach. This times, by CUPTI kernel time, `jnp.dot` (cuBLAS
through XLA) in bf16 at square sizes and at the GLU's three matmul shapes
(M x K @ K x 2F, its dx and dw), and prints each rate; then, for the GLU of
`--glu` (the jnp program's forward and forward+backward times given), the rate
a given speed-up over it would need. Run on an NVIDIA GPU:

    python tools/matmul_peak.py --glu 16384,4096,14336 --jnp-ms 4.996,15.538
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from tokamax._src import benchmarking


def _rate(m, k, n, iterations):
  """Median CUPTI time (ms) and TFLOP/s of an [m, k] @ [k, n] bf16 matmul."""
  a, b = (jax.random.normal(key, shape, jnp.bfloat16)
          for key, shape in zip(jax.random.split(jax.random.key(0)), ((m, k), (k, n))))
  data = benchmarking.benchmark(jnp.dot, [a, b], iterations=iterations)
  ms = data.median_evaluation_time_ms
  return ms, 2 * m * k * n / (ms * 1e-3) / 1e12


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--glu", default="16384,4096,14336", help="M,D,F: x [M, D], w [D, 2, F]")
  parser.add_argument("--jnp-ms", default=None,
                      help="the jnp GLU's forward,forward+backward ms (from the bench)")
  parser.add_argument("--iterations", type=int, default=20)
  opts = parser.parse_args()
  m, d, f = map(int, opts.glu.split(","))
  print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}, bf16 jnp.dot, CUPTI")
  print("| matmul | ms | TFLOP/s |\n|---|---|---|")
  shapes = {f"square {s}": (s, s, s) for s in (4096, 8192, 16384)}
  shapes.update({"GLU forward x @ w": (m, d, 2 * f), "GLU dx = dh @ w^T": (m, 2 * f, d),
                 "GLU dw = x^T @ dh": (d, m, 2 * f)})
  rates = {}
  for name, (mm, kk, nn) in shapes.items():
    ms, rate = rates[name] = _rate(mm, kk, nn, opts.iterations)
    print(f"| {name} [{mm}x{kk}] @ [{kk}x{nn}] | {ms:.3f} | {rate:.0f} |")
  best = max(rate for _, rate in rates.values())
  flops = 2 * m * d * 2 * f
  print(f"\nbest rate {best:.0f} TFLOP/s; the GLU's matmuls: forward {flops / 1e12:.2f} "
        f"TFLOP, forward+backward {3 * flops / 1e12:.2f} TFLOP")
  if opts.jnp_ms:
    for label, ms, work in zip(("forward", "forward+backward"),
                               map(float, opts.jnp_ms.split(",")), (flops, 3 * flops)):
      for speedup in (1.05, 1.10):
        need = work * speedup / (ms * 1e-3) / 1e12
        print(f"{label}: {speedup:.2f}x the jnp GLU's {ms:.3f} ms needs its matmuls alone at "
              f"{need:.0f} TFLOP/s ({need / best:.2f}x the best rate measured here)")


if __name__ == "__main__":
  main()
