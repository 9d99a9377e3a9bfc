"""Helpers shared by the Triton kernels of this package (one place, not copied)."""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tokamax import DeviceInfo
from tokamax import plugin


def check_triton_device(device: DeviceInfo) -> None:
  """Raises NotImplementedError unless Pallas Triton kernels can run on `device`."""
  if device.interpret:
    if plugin.checks_varying_axes():
      # JAX's Triton interpreter pads and slices varying operands with constants
      # that are not ("Primitive pad requires varying manual axes to match").
      raise NotImplementedError(
          "Pallas' Triton interpreter cannot run inside jax.shard_map with "
          "check_vma=True (it mis-types the values' varying mesh axes); pass "
          "check_vma=False to shard_map or choose another implementation")
    return
  if device.platform != "gpu" or device.compute_capability is None:
    raise NotImplementedError(
        f"Pallas Triton kernels need an NVIDIA GPU; this device is "
        f"{device.device_kind} ({device.platform}); set TOKAMAX_INTERPRET=1 to run "
        "them in Pallas interpret mode")


def compiler_params(num_warps: int, num_stages: int):
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pallas_call(kernel, *, out_shape, grid, in_specs, out_specs, num_warps: int,
                num_stages: int, interpret: bool, name: str, **kwargs):
  """`pl.pallas_call` with this package's conventions (Triton params, interpret,
  outputs typed for `shard_map`)."""
  def call(*args):
    return pl.pallas_call(
        kernel, out_shape=plugin.varying_out_shape(out_shape, args), grid=grid,
        in_specs=in_specs, out_specs=out_specs,
        compiler_params=None if interpret else compiler_params(num_warps, num_stages),
        interpret=interpret, name=name, **kwargs)(*args)
  return call


def _static_slices_bounds_checked() -> bool:
  return jax.__version_info__ >= (0, 12)


def _static_int(x) -> int | None:
  """`x` as a Python int where it is known at trace time (an int, a NumPy or
  concrete JAX integer), else None (a traced value)."""
  try:
    return operator.index(x)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None


def _runs_past(index, dim: int) -> bool:
  """Whether `index` is a slice whose start is static and that ends past `dim`
  (what JAX 0.12 refuses at trace time)."""
  if not isinstance(index, pl.Slice):
    return False
  start = _static_int(index.start)
  return start is not None and start + (index.size - 1) * index.stride >= dim


def at(ref, *indices):
  """``ref.at[indices]`` for a block that may run past the array's end.

  Blocks are powers of two, so the block over a short dimension can run past it
  statically (``pl.ds(0, 64)`` over 40 columns; its loads and stores are
  masked). JAX 0.12 refuses such a slice when it is traced ("Out of bound
  slice"); there every slice of the access becomes an index array, one axis
  each, in order (index arrays, unlike slices, are not bound-checked, and the
  Triton lowering computes a slice's offsets as start + iota as well). Older
  JAX, and accesses whose slices all fit or have traced starts, keep the slices.
  """
  if not (_static_slices_bounds_checked()
          and any(_runs_past(i, d) for i, d in zip(indices, ref.shape))):
    return ref.at[indices]
  num_slices = sum(isinstance(i, pl.Slice) for i in indices)
  arrays, axis = [], 0
  for index in indices:
    if isinstance(index, pl.Slice):
      shape = [1] * num_slices
      shape[axis] = index.size
      positions = index.start + index.stride * jnp.arange(index.size)
      arrays.append(positions.reshape(shape))
      axis += 1
    else:
      arrays.append(index)
  return ref.at[tuple(arrays)]


def next_power_of_2(x: int) -> int:
  return 1 if x <= 1 else 1 << (x - 1).bit_length()


def and_masks(*masks):
  """Logical and of the non-None masks (None: nothing to mask)."""
  out = None
  for m in masks:
    if m is not None:
      out = m if out is None else out & m
  return out


def block_mask(rows_ok, cols_ok):
  """A block's 2-D mask from optional row and column masks; None when all valid."""
  if rows_ok is None:
    return None if cols_ok is None else cols_ok[None, :]
  if cols_ok is None:
    return rows_ok[:, None]
  return rows_ok[:, None] & cols_ok[None, :]


def tile_mask(rows_ok, cols_ok, shape):
  """`block_mask` broadcast to the full `shape` (None when all valid)."""
  m = block_mask(rows_ok, cols_ok)
  return None if m is None else jnp.broadcast_to(m, shape)


def load(ref, mask=None, other=0, *, eviction_policy=None):
  """`plgpu.load` that is unpredicated when `mask` is None (aligned blocks)."""
  if mask is None:
    return plgpu.load(ref, eviction_policy=eviction_policy)
  return plgpu.load(ref, mask=jnp.broadcast_to(mask, ref.shape), other=other,
                    eviction_policy=eviction_policy)


def store(ref, value, mask=None):
  """`plgpu.store` that is unpredicated when `mask` is None (aligned blocks)."""
  if mask is None:
    plgpu.store(ref, value)
  else:
    plgpu.store(ref, value, mask=jnp.broadcast_to(mask, ref.shape))
