"""Helpers shared by the Triton kernels of this package (one place, not copied)."""

from __future__ import annotations


import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tokamax import DeviceInfo
from tokamax import plugin


def check_triton_device(device: DeviceInfo) -> None:
  """Raises NotImplementedError unless Pallas Triton kernels can run on `device`."""
  if device.interpret:
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
