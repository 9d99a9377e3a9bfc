"""Helpers shared by this package's Mosaic TPU kernels (one place, not copied).

Also the compatibility shims between the JAX versions we run on (0.10.2 on the
CPU machines, 0.11.x elsewhere): the Pallas TPU API moved a little between them.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

import tokamax
from tokamax import DeviceInfo

# Default scoped-VMEM limit per generation (bytes). Our heuristic block sizes keep
# every kernel's double-buffered working set under the smallest of these (v5e) so
# no kernel needs to raise `vmem_limit_bytes`.
SCOPED_VMEM_BYTES = {"v5e": 16 << 20, "v5p": 16 << 20, "v6e": 32 << 20}
VMEM_BUDGET_BYTES = 12 << 20  # what our block-size heuristics aim under (v5e safe)

LANES = 128


def check_tpu_device(device: DeviceInfo) -> None:
  """Raises NotImplementedError unless Mosaic TPU kernels can run on `device`."""
  if device.interpret:
    return
  if device.platform != "tpu":
    raise NotImplementedError(
        f"Pallas Mosaic TPU kernels need a TPU; this device is {device.device_kind} "
        f"({device.platform}); set TOKAMAX_INTERPRET=1 to run them in Pallas "
        "interpret mode")


def interpret_params():
  """The `interpret=` argument for `pl.pallas_call`: TPU interpret params or False.

  Read at trace time, so `tokamax.interpret()` around the traced call decides.
  """
  if tokamax.interpret_mode():
    return pltpu.InterpretParams()
  return False


_CompilerParams = getattr(pltpu, "CompilerParams", None) or pltpu.TPUCompilerParams


def compiler_params(dimension_semantics: Sequence[str], **kwargs):
  """`pltpu.CompilerParams` (named `TPUCompilerParams` in older JAX).

  Args:
    dimension_semantics: one of "parallel" / "arbitrary" per grid dimension.
    **kwargs: passed through (e.g. `vmem_limit_bytes`).
  """
  return _CompilerParams(dimension_semantics=tuple(dimension_semantics), **kwargs)


def sublane_multiple(dtype) -> int:
  """Rows per native tile for `dtype`: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
  return {4: 8, 2: 16, 1: 32}.get(jnp.dtype(dtype).itemsize, 8)


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def check_dtypes(*dtypes, what: str = "inputs") -> None:
  """Refuses dtypes other than float32 and bfloat16 (NotImplementedError)."""
  for d in dtypes:
    if d is None:
      continue
    if jnp.dtype(d) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
      raise NotImplementedError(
          f"mosaic_tpu supports float32 and bfloat16 {what}, not {jnp.dtype(d)}")


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
  """Pads `x` along `axis` at the end up to `size` (no-op when already that size)."""
  axis = axis % x.ndim
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def check_precision(precision) -> None:
  """Refuses dot-algorithm presets (the kernels take a `jax.lax.Precision`)."""
  if (isinstance(precision, jax.lax.DotAlgorithmPreset)
      and precision != jax.lax.DotAlgorithmPreset.DEFAULT):
    raise NotImplementedError(f"dot algorithm {precision} is not supported")


def dot_precision(precision):
  """The `precision=` for in-kernel dots (None: Mosaic's default for the dtype)."""
  if isinstance(precision, jax.lax.DotAlgorithmPreset):
    return None
  return precision


def device_generation() -> str | None:
  """"v5e", "v5p", "v6e"... of the first TPU device, or None (CPU, interpret)."""
  try:
    device = jax.devices()[0]
  except RuntimeError:
    return None
  if device.platform != "tpu":
    return None
  kind = device.device_kind.lower().replace(" ", "")
  for gen in ("v6e", "v6", "v5p", "v5e", "v5lite", "v5", "v4"):
    if gen in kind:
      return {"v6": "v6e", "v5lite": "v5e", "v5": "v5p"}.get(gen, gen)
  return None
