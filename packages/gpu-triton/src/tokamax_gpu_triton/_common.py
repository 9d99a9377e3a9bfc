"""Helpers shared by the Triton kernels of this package (one place, not copied)."""

from __future__ import annotations


from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tokamax import DeviceInfo


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
  """`pl.pallas_call` with this package's conventions (Triton params, interpret)."""
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
      compiler_params=None if interpret else compiler_params(num_warps, num_stages),
      interpret=interpret, name=name, **kwargs)


def next_power_of_2(x: int) -> int:
  return 1 if x <= 1 else 1 << (x - 1).bit_length()
