"""gated_linear_unit's benchmark shapes, the plain-JAX peer, and a typical call
to ask implementations about."""

from __future__ import annotations

import jax

from tokamax._src.ops.gated_linear_unit import api
from tokamax._src.ops.gated_linear_unit.api import GatedLinearUnitArgs
from tokamax._src.problem import BF16, Problem, rand


def plain_glu(x, w):
  """SwiGLU as plain JAX writes it with a fused gate/up weight ``[K, 2, N]``: one
  matmul ``x @ [wg | wu]`` in x's dtype (a free reshape, no slicing copies), then
  ``silu(gate) * up``; the strongest of the plain forms we measured."""
  k, _, n = w.shape
  h = x @ w.reshape(k, 2 * n)
  return jax.nn.silu(h[..., :n]) * h[..., n:]


def problem(m, k, n) -> Problem:
  def make():
    ks = jax.random.split(jax.random.key(0), 2)
    return (rand(ks[0], (m, k)), rand(ks[1], (k, 2, n), scale=k**-0.5))

  def xla(a):
    return plain_glu(*a)
  return Problem("gated_linear_unit", f"silu x{m}x{k} w{k}x2x{n}", make,
                 lambda a, i: api.gated_linear_unit(*a, activation=jax.nn.silu,
                                                        implementation=i),
                 {"XLA (jnp)": xla}, flops=2 * 2 * m * k * n, backward_factor=3.0,
                 reference=("XLA (jnp)",))


def reference_problems() -> list[Problem]:
  """The shapes of shared/BENCHMARKS.md."""
  return [problem(16384, 4096, 14336)]


def grid_problems() -> list[Problem]:
  """The shapes tuned data is measured on (`autotune --grid`): the reference
  shape, small M (2048 and 1024), large M with small N, and a wide K. (M 1024
  was added in session 72 after the composed forward won at M 1073 K5120
  N13824 on the H200; at M 1024 K4096 N14336 mosaic_gpu still wins, 0.315 ms
  against 0.322: M 1024 alone does not lose; what makes M 1073 K5120 N13824
  lose is not known yet: notes/MEASUREMENTS.md.)"""
  return [problem(*s) for s in ((16384, 4096, 14336), (2048, 4096, 14336),
                                (1024, 4096, 14336), (65536, 2048, 5632),
                                (8192, 8192, 28672))]


def quick_problems() -> list[Problem]:
  """Small shapes of the same kinds, for CPUs (seconds each)."""
  return [problem(256, 256, 512)]


def probe_args() -> GatedLinearUnitArgs:
  """A typical bf16 call, as shapes only, to ask `check_supported` about."""
  s = jax.ShapeDtypeStruct
  return GatedLinearUnitArgs(x=s((4096, 1024), BF16), weights=s((1024, 2, 4096), BF16),
                             activation=jax.nn.silu)
