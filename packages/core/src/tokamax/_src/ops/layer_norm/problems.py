"""layer_norm's benchmark shapes, and a typical call to ask implementations about."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tokamax._src.ops.layer_norm import api
from tokamax._src.ops.layer_norm.api import LayerNormArgs
from tokamax._src.problem import BF16, Problem, rand


def problem(rows, d, rms) -> Problem:
  def make():
    ks = jax.random.split(jax.random.key(0), 3)
    return (rand(ks[0], (rows, d)), rand(ks[1], (d,)), rand(ks[2], (d,)))

  def xla(a):
    x, s, o = a
    xf = x.astype(jnp.float32)
    if rms:
      y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * s
    else:
      mu = jnp.mean(xf, -1, keepdims=True)
      y = (xf - mu) * jax.lax.rsqrt(jnp.var(xf, -1, keepdims=True) + 1e-6) * s + o
    return y.astype(x.dtype)
  op = "rms_norm" if rms else "layer_norm"
  call = ((lambda a, i: api.rms_norm(a[0], a[1], implementation=i)) if rms else
          (lambda a, i: api.layer_norm(*a, implementation=i)))
  fwd_bytes, fwd_bwd_bytes = traffic_bytes(rows, d, num_params=1 if rms else 2)
  return Problem("layer_norm", f"{op} {rows}x{d}", make, call, {"XLA (jnp)": xla},
                 bytes=fwd_bytes, backward_factor=fwd_bwd_bytes / fwd_bytes,
                 reference=("XLA (jnp)",))


def traffic_bytes(rows: int, d: int, num_params: int, itemsize: int = 2) -> tuple[int, int]:
  """(forward, forward+backward) bytes a norm must move, as its rate counts them.

  Forward: x read, y written, the params (scale, offset) read. Backward: x read
  again (the forward ran long before, with other ops between: any implementation,
  jnp's included, reads x or a residual of its size once more), dy read, dx
  written, scale read, the params' gradients written. The per-row statistics the
  forward may save (8 bytes a row) are left out.
  """
  array, param = rows * d * itemsize, d * itemsize
  forward = 2 * array + num_params * param
  backward = 3 * array + param + num_params * param
  return forward, forward + backward


def reference_problems() -> list[Problem]:
  """The shapes of shared/BENCHMARKS.md."""
  return [problem(32768, 8192, False), problem(32768, 8192, True)]


def grid_problems() -> list[Problem]:
  """The shapes tuned data is measured on (`autotune --grid`): widths 1024, 4096,
  8192 and 16384 at 2048, 4096 and 32768 rows, layer and RMS norm.

  No width past whole 1024-column pieces (1536, 2304, 3584, ...): tuned data
  keeps those to their own kind (`tuning.nearest.TILE_ALIGNED`), so without
  points of that kind they run in the registry's order: on the H100, at eight
  such calls, 15 of 16 (call, direction) rows within 3% of the fastest, the
  other a 0.026 ms forward at 3.3%. Points at 1536 and 3584 alone were measured
  and left out: the nearer of the two sent RMSNorm 8192 x 4608's backward to
  Triton, about 9% slower there by the same run's times (notes/MEASUREMENTS.md,
  session 104 items 2-3)."""
  return [problem(rows, d, rms) for rms in (False, True) for rows in (2048, 4096, 32768)
          for d in (1024, 4096, 8192, 16384)]


def quick_problems() -> list[Problem]:
  """Small shapes of the same kinds, for CPUs (seconds each)."""
  return [problem(1024, 1024, False), problem(1024, 1024, True)]


def probe_args() -> LayerNormArgs:
  """A typical bf16 call, as shapes only, to ask `check_supported` about."""
  s = jax.ShapeDtypeStruct
  return LayerNormArgs(x=s((4096, 4096), BF16), scale=s((4096,), BF16),
                       offset=s((4096,), BF16))
