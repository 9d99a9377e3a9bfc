"""Example: your own `triton.language` kernel, called through jax-triton, as a
tokamax implementation.

The kernel below is a one-row-per-program RMSNorm forward. Wrapping it in a
`tokamax.Op` makes it a first-class implementation: tokamax validates the call,
asks `check_supported` whether the kernel can take it (falling back otherwise),
chooses a backward for it (here the registered ones, which accept the `rstd`
residual this forward returns), and it can be autotuned over its configs.

    import tokamax
    from jax_triton_rms_norm import JaxTritonRmsNorm
    y = tokamax.rms_norm(x, scale, implementation=JaxTritonRmsNorm())

To make it available by name to everyone, register the class in a backend
package's `tokamax.plugin.Backend` (see the README, "Writing your own kernel").
"""

import dataclasses

import jax
import jax.numpy as jnp
import jax_triton as jt
import numpy as np
import triton
import triton.language as tl

import tokamax


@triton.jit
def _rms_norm_kernel(x_ptr, scale_ptr, eps, y_ptr, rstd_ptr,
                     n_cols: tl.constexpr, block: tl.constexpr):
  # jax-triton passes inputs (scalars included) first, outputs last.
  row = tl.program_id(0)
  cols = tl.arange(0, block)
  valid = cols < n_cols
  x = tl.load(x_ptr + row * n_cols + cols, mask=valid, other=0.0).to(tl.float32)
  rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
  scale = tl.load(scale_ptr + cols, mask=valid, other=0.0).to(tl.float32)
  y = x * rstd * scale
  tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=valid)
  tl.store(rstd_ptr + row, rstd)


@dataclasses.dataclass(frozen=True)
class RmsNormConfig:
  num_warps: int = 8


@dataclasses.dataclass(frozen=True)
class JaxTritonRmsNorm(tokamax.Op):
  """RMSNorm forward as a raw Triton kernel (scale required, no offset)."""

  op_name = "layer_norm"
  name = "jax_triton_rms_norm"
  config_cls = RmsNormConfig

  def check_supported(self, args, device):
    if not device.is_nvidia_gpu or device.interpret:
      raise NotImplementedError("jax-triton kernels run only natively on NVIDIA GPUs")
    if args.subtract_mean or args.offset is not None or args.scale is None:
      raise NotImplementedError("only RMSNorm with a scale and no offset")
    if args.x.shape[-1] > 16384:
      raise NotImplementedError(f"rows up to 16384 wide, got {args.x.shape[-1]}")

  def heuristic_config(self, args):
    return RmsNormConfig(num_warps=4 if args.x.shape[-1] <= 2048 else 8)

  def search_space(self, args):
    return tuple(RmsNormConfig(w) for w in (4, 8, 16))

  def forward(self, args, config):
    rows, cols = args.x.shape
    y, rstd = jt.triton_call(
        args.x, args.scale, np.float32(args.epsilon),  # a scalar, not a pointer
        kernel=_rms_norm_kernel,
        out_shape=(jax.ShapeDtypeStruct(args.x.shape, args.x.dtype),
                   jax.ShapeDtypeStruct((rows,), jnp.float32)),
        grid=(rows,), num_warps=config.num_warps,
        n_cols=cols, block=triton.next_power_of_2(cols))
    return y, {"mean": jnp.zeros_like(rstd), "rstd": rstd}
