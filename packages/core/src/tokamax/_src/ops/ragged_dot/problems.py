"""ragged_dot's benchmark shapes, and a typical call to ask implementations about."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tokamax._src import quantization
from tokamax._src.ops.ragged_dot import api
from tokamax._src.ops.ragged_dot.api import RaggedDotArgs
from tokamax._src.problem import BF16, Problem, rand


def problem(m, k, n, g, random_sizes) -> Problem:
  def make():
    ks = jax.random.split(jax.random.key(0), 3)
    if random_sizes:
      cuts = np.sort(np.random.default_rng(0).integers(0, m, g - 1))
      sizes = np.diff(np.concatenate([[0], cuts, [m]]))
    else:
      sizes = np.full(g, m // g)
    return (rand(ks[0], (m, k)), rand(ks[1], (g, k, n), scale=k**-0.5),
            jnp.asarray(sizes, jnp.int32))

  def dense(a):  # the same FLOPs as one batched matmul: the bound to reach
    lhs, rhs, _ = a
    # bf16 in and out (cuBLAS accumulates in float32): a float32 output would
    # make the backward's matmuls take a float32 cotangent.
    return jnp.einsum("gmk,gkn->gmn", lhs.reshape(g, m // g, k), rhs)
  peers = {"lax.ragged_dot": lambda a: jax.lax.ragged_dot(*a)}
  if m % g == 0:
    peers["dense batched matmul"] = dense
  return Problem("ragged_dot", f"M{m} K{k} N{n} G{g}" + (" random" if random_sizes else ""),
                 make, lambda a, i: api.ragged_dot(*a, implementation=i), peers,
                 flops=2 * m * k * n, backward_factor=3.0,
                 reference=("lax.ragged_dot", "tokamax xla"),
                 integer_inputs=lambda a: {"group_sizes": a[2]})


def fp8_problem(m, k, n, g, random_sizes, k_major=False) -> Problem:
  """The forward on float8_e4m3fn operands with DeepSeek-V3's block scales (1x128
  lhs tiles, 128x128 rhs blocks), against the bf16 ragged_dot at the same shape
  (the speed-up fp8 is for); numbers against the XLA reference on the same
  quantized inputs. Forward only: operands quantized ahead carry no gradient (the
  training step is `fp8_training_problem`).

  `k_major`: the weights stored ``[G, N, K]`` (``minor_axis=1``), as Hopper's fp8
  matmul reads them; else ``[G, K, N]``, which the kernel transposes per call."""
  bf16 = problem(m, k, n, g, random_sizes)
  minor_axis = 1 if k_major else None

  def make():
    lhs, rhs, sizes = bf16.make_inputs()
    lq = quantization.quantize(lhs, (1, 128))
    rq = quantization.quantize(rhs, (1, 128, 128), minor_axis=minor_axis)
    return lq.values, lq.scales, rq.values, rq.scales, sizes, lhs, rhs

  def call(a, implementation):
    lv, ls, rv, rs, sizes = a[:5]
    return api.ragged_dot(quantization.QuantizedArray(lv, ls, BF16),
                          quantization.QuantizedArray(rv, rs, BF16, minor_axis),
                          sizes, implementation=implementation)

  peers = {"bf16 ragged_dot (tokamax auto)":
           lambda a: api.ragged_dot(a[5], a[6], a[4])}
  name = bf16.name + " fp8 1x128/128x128" + (" K-major" if k_major else "")
  return Problem("ragged_dot", name, make, call, peers,
                 flops=bf16.flops, reference=("tokamax xla",), dtype="bfloat16",
                 directions=("forward",), untimed=("tokamax xla",),
                 integer_inputs=lambda a: {"group_sizes": a[4]})


def fp8_training_problem(m, k, n, g, random_sizes) -> Problem:
  """fp8 in a training step: bf16 activations and weights quantized inside the
  step (1x128 / 128x128 K-major, DeepSeek-V3's recipe), the fp8 ragged_dot, and
  its straight-through backward (the plain ragged_dot's backward on the
  dequantized operands); forward and forward+backward against the bf16
  ragged_dot, quantization included."""
  bf16 = problem(m, k, n, g, random_sizes)

  def call(a, implementation):
    lhs, rhs, sizes = a
    return api.ragged_dot(quantization.quantize(lhs, (1, 128)),
                          quantization.quantize(rhs, (1, 128, 128), minor_axis=1),
                          sizes, implementation=implementation)

  peers = {"bf16 ragged_dot (tokamax auto)": lambda a: api.ragged_dot(*a)}
  return Problem("ragged_dot", bf16.name + " fp8 training", bf16.make_inputs, call,
                 peers, flops=bf16.flops, backward_factor=3.0,
                 reference=("tokamax xla",), dtype="bfloat16", untimed=("tokamax xla",),
                 integer_inputs=bf16.integer_inputs)


def reference_problems() -> list[Problem]:
  """The shapes of shared/BENCHMARKS.md, in bf16 and in fp8."""
  shapes = [(16384, 2048, 16384, 16, False), (65536, 7168, 2048, 256, True)]
  return ([problem(*s) for s in shapes] + [fp8_problem(*s) for s in shapes]
          + [fp8_problem(*s, k_major=True) for s in shapes]
          + [fp8_training_problem(*s) for s in shapes])


def grid_problems() -> list[Problem]:
  """The shapes tuned data is measured on (`autotune --grid`): MoE-like K/N at
  8-256 groups, up projections (K = model width) and down projections (N = model
  width), whose rankings differ (session 13: the backward's flips between N 1408
  and N >= 2048). Each is tuned at its bench inputs' group sizes (`Problem.
  integer_inputs`): equal at 8 and 16 groups, a random split at 64-256 groups,
  as a router leaves them. A call's key does not say how its rows are split, so
  the data tells `None` what wins at those splits (session 21: at G128 K4096
  N1536, mosaic_gpu's tall items win at equal sizes and lose 10% to triton at
  random ones)."""
  return [problem(*s) for s in (
      (16384, 2048, 16384, 16, False), (16384, 4096, 14336, 8, False),
      (32768, 2048, 1408, 64, True), (16384, 4096, 4096, 64, True),
      (65536, 7168, 2048, 256, True), (8192, 7168, 2048, 256, True),
      # Qwen3-MoE-like, 128 experts: up (K 2048 N 768, K 4096 N 1536) and down
      # (K 768 N 2048).
      (65536, 2048, 768, 128, True), (65536, 4096, 1536, 128, True),
      (65536, 768, 2048, 128, True))]


def quick_problems() -> list[Problem]:
  """Small shapes of the same kinds, for CPUs (seconds each)."""
  return [problem(512, 256, 512, 4, False), problem(512, 256, 256, 8, True),
          fp8_problem(512, 256, 512, 4, False),
          fp8_problem(512, 256, 512, 4, False, k_major=True),
          fp8_training_problem(512, 256, 512, 4, False)]


def probe_args() -> RaggedDotArgs:
  """A typical bf16 call, as shapes only, to ask `check_supported` about."""
  s = jax.ShapeDtypeStruct
  return RaggedDotArgs(lhs=s((4096, 1024), BF16), rhs=s((8, 1024, 1024), BF16),
                       group_sizes=s((8,), jnp.int32))
