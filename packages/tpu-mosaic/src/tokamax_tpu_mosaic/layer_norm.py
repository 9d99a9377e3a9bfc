"""Layer / RMS normalization as Pallas Mosaic TPU kernels, forward and backward.

Layout: a block is ``block_rows`` whole rows, ``[block_rows, D]``. Its last dim is
the full D (legal for any D under the TPU tiling rules: a block dim equal to the
array dim needs no (8, 128) alignment, Mosaic pads the lanes inside VMEM), its row
count a multiple of 8 (f32) / 16 (bf16) or all of R. The last row block may run
past R: Pallas pads the read and clips the write; the backward masks those rows
out of the dscale / doffset sums.

Block sizes: ``block_rows`` is chosen so that one float32 copy of a block is at
most 2 MiB in the forward (x, y double-buffered + ~3 float32 temporaries, about
10 MiB at bf16) and 1 MiB in the backward (x, dy, dx double-buffered + ~5
float32 temporaries, about 8 MiB): inside v5e's 16 MiB scoped-VMEM default, and the
same blocks run on v5p / v6e (normalization is HBM-bound everywhere; larger
blocks only shorten the pipeline prologue). Rows wider than the budget allows
at the minimum block height (D > 32768) are refused.

Backward: statistics are recomputed from x in the kernel (no residual reads; the
forward's residuals are not needed, so a backward after any forward works).
dscale / doffset are summed per row block into ``[num_blocks, 1, D]`` float32
partials (keeps the grid "parallel", so both v5p TensorCores work) and reduced
in XLA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import tokamax
from tokamax_tpu_mosaic import _common

_F32_TILE_BYTES = 1 << 20  # backward: x, dy, dx in flight + ~5 f32 temporaries
_F32_TILE_BYTES_FWD = 2 << 20  # forward: x, y in flight + ~3 f32 temporaries
_MAX_BLOCK_ROWS = 1024


@dataclasses.dataclass(frozen=True)
class LayerNormConfig:
  """Rows per block (a multiple of 16, or >= R meaning all rows in one block)."""

  block_rows: int = 256

  def __post_init__(self):
    if self.block_rows < 1:
      raise ValueError(f"block_rows must be >= 1; got {self.block_rows}")


def _heuristic(args, tile_bytes: int = _F32_TILE_BYTES) -> LayerNormConfig:
  r, d = args.x.shape
  rows = tile_bytes // (4 * _common.round_up(d, _common.LANES))
  rows = max(16, min(_MAX_BLOCK_ROWS, rows // 16 * 16))
  return LayerNormConfig(block_rows=rows)


def _search_space(args):
  r, d = args.x.shape
  base = _heuristic(args)
  configs = [base] + [LayerNormConfig(b) for b in (64, 128, 256, 512)
                      if b * d * 4 <= 2 * _F32_TILE_BYTES]
  return list(dict.fromkeys(configs))


def _block_rows(r: int, config: LayerNormConfig) -> int:
  if config.block_rows >= r:
    return r  # one block of all rows: equal to the array dim, always legal
  if config.block_rows % 16:
    raise ValueError(f"block_rows must be a multiple of 16 (or >= R); got "
                     f"{config.block_rows}")
  return config.block_rows


def _stats(x, subtract_mean: bool, eps: float):
  """mean, rstd (float32, [rows, 1]) of a float32 block."""
  if subtract_mean:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    xc = x - mean
  else:
    mean = jnp.zeros((x.shape[0], 1), jnp.float32)
    xc = x
  var = jnp.mean(xc * xc, axis=-1, keepdims=True)
  return mean, xc, jax.lax.rsqrt(var + eps)


def _fwd_kernel(*refs, has_scale, has_offset, subtract_mean, eps):
  x_ref, *refs = refs
  scale_ref = refs.pop(0) if has_scale else None
  offset_ref = refs.pop(0) if has_offset else None
  y_ref, mean_ref, rstd_ref = refs
  x = x_ref[...].astype(jnp.float32)
  mean, xc, rstd = _stats(x, subtract_mean, eps)
  y = xc * rstd
  if has_scale:
    y = y * scale_ref[...].astype(jnp.float32)
  if has_offset:
    y = y + offset_ref[...].astype(jnp.float32)
  y_ref[...] = y.astype(y_ref.dtype)
  mean_ref[...] = mean
  rstd_ref[...] = rstd


def _bwd_kernel(*refs, has_scale, want_dscale, want_doffset, subtract_mean, eps,
                rows, block_rows, ragged):
  x_ref, dy_ref, *refs = refs
  scale_ref = refs.pop(0) if has_scale else None
  dx_ref, *refs = refs
  dscale_ref = refs.pop(0) if want_dscale else None
  doffset_ref = refs.pop(0) if want_doffset else None
  x = x_ref[...].astype(jnp.float32)
  dy = dy_ref[...].astype(jnp.float32)
  if ragged:
    # Rows past R in the last block hold garbage (possibly NaN): zero them so
    # they add nothing to the dscale / doffset sums.
    row = pl.program_id(0) * block_rows + jax.lax.broadcasted_iota(
        jnp.int32, (x.shape[0], 1), 0)
    valid = row < rows
    x = jnp.where(valid, x, 0.0)
    dy = jnp.where(valid, dy, 0.0)
  _, xc, rstd = _stats(x, subtract_mean, eps)
  xhat = xc * rstd
  g = dy * scale_ref[...].astype(jnp.float32) if has_scale else dy
  c2 = jnp.mean(g * xhat, axis=-1, keepdims=True)
  dxhat = g - xhat * c2
  if subtract_mean:
    dxhat = dxhat - jnp.mean(g, axis=-1, keepdims=True)
  dx_ref[...] = (dxhat * rstd).astype(dx_ref.dtype)
  if want_dscale:
    dscale_ref[...] = jnp.sum(dy * xhat, axis=0, keepdims=True)[None]
  if want_doffset:
    doffset_ref[...] = jnp.sum(dy, axis=0, keepdims=True)[None]


def _param_spec(d):
  return pl.BlockSpec((1, d), lambda i: (0, 0))


def _forward(args, config):
  r, d = args.x.shape
  br = _block_rows(r, config)
  grid = (_common.cdiv(r, br),)
  row_spec = pl.BlockSpec((br, d), lambda i: (i, 0))
  stat_spec = pl.BlockSpec((br, 1), lambda i: (i, 0))
  inputs, specs = [args.x], [row_spec]
  for p in (args.scale, args.offset):
    if p is not None:
      inputs.append(p.reshape(1, d))
      specs.append(_param_spec(d))
  kernel = functools.partial(
      _fwd_kernel, has_scale=args.scale is not None,
      has_offset=args.offset is not None, subtract_mean=args.subtract_mean,
      eps=args.epsilon)
  y, mean, rstd = pl.pallas_call(
      kernel, grid=grid, in_specs=specs,
      out_specs=[row_spec, stat_spec, stat_spec],
      out_shape=[jax.ShapeDtypeStruct((r, d), args.x.dtype),
                 jax.ShapeDtypeStruct((r, 1), jnp.float32),
                 jax.ShapeDtypeStruct((r, 1), jnp.float32)],
      compiler_params=_common.compiler_params(("parallel",)),
      interpret=_common.interpret_params(), name="tokamax_tpu_layer_norm_fwd",
  )(*inputs)
  return y, mean[:, 0], rstd[:, 0]


def _backward(args, dy, config):
  r, d = args.x.shape
  br = _block_rows(r, config)
  nb = _common.cdiv(r, br)
  row_spec = pl.BlockSpec((br, d), lambda i: (i, 0))
  part_spec = pl.BlockSpec((1, 1, d), lambda i: (i, 0, 0))
  has_scale = args.scale is not None
  inputs, specs = [args.x, dy.astype(args.x.dtype)], [row_spec, row_spec]
  if has_scale:
    inputs.append(args.scale.reshape(1, d))
    specs.append(_param_spec(d))
  out_shape = [jax.ShapeDtypeStruct((r, d), args.x.dtype)]
  out_specs = [row_spec]
  want = [has_scale, args.offset is not None]
  for w in want:
    if w:
      out_shape.append(jax.ShapeDtypeStruct((nb, 1, d), jnp.float32))
      out_specs.append(part_spec)
  kernel = functools.partial(
      _bwd_kernel, has_scale=has_scale, want_dscale=want[0], want_doffset=want[1],
      subtract_mean=args.subtract_mean, eps=args.epsilon, rows=r, block_rows=br,
      ragged=r % br != 0)
  dx, *partials = pl.pallas_call(
      kernel, grid=(nb,), in_specs=specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=_common.compiler_params(("parallel",)),
      interpret=_common.interpret_params(), name="tokamax_tpu_layer_norm_bwd",
  )(*inputs)
  grads = {"x": dx}
  if want[0]:
    grads["scale"] = jnp.sum(partials.pop(0)[:, 0], axis=0).astype(args.scale.dtype)
  if want[1]:
    grads["offset"] = jnp.sum(partials.pop(0)[:, 0], axis=0).astype(args.offset.dtype)
  return grads


def _check_args(args, device) -> None:
  _common.check_tpu_device(device)
  _common.check_dtypes(args.x.dtype, *(None if p is None else p.dtype
                                       for p in (args.scale, args.offset)))
  if args.x.ndim != 2 or 0 in args.x.shape:
    raise NotImplementedError(f"x must be a non-empty [R, D] array; got shape "
                              f"{args.x.shape}")
  d = args.x.shape[1]
  if 16 * _common.round_up(d, _common.LANES) * 4 > 2 * _F32_TILE_BYTES:
    raise NotImplementedError(
        f"rows of D={d} do not fit the VMEM budget at 16 rows per block (D <= "
        f"{2 * _F32_TILE_BYTES // 64} is supported)")


@dataclasses.dataclass(frozen=True)
class MosaicTpuLayerNorm(tokamax.Op):
  """Layer / RMS normalization forward as a Pallas Mosaic TPU kernel."""

  op_name = "layer_norm"
  name = "mosaic_tpu"
  config_cls = LayerNormConfig

  def check_supported(self, args, device):
    _check_args(args, device)

  def heuristic_config(self, args):
    return _heuristic(args, _F32_TILE_BYTES_FWD)

  def search_space(self, args):
    return list(dict.fromkeys([self.heuristic_config(args), *_search_space(args)]))

  def forward(self, args, config):
    y, mean, rstd = _forward(args, config)
    return y, {"mean": mean, "rstd": rstd}


@dataclasses.dataclass(frozen=True)
class MosaicTpuLayerNormVjp(tokamax.VjpOp):
  """Layer / RMS normalization backward as a Pallas Mosaic TPU kernel."""

  op_name = "layer_norm"
  name = "mosaic_tpu"
  config_cls = LayerNormConfig

  def check_supported(self, args, device, residuals=None):
    _check_args(args, device)

  def heuristic_config(self, args):
    return _heuristic(args)

  def search_space(self, args):
    return _search_space(args)

  def backward(self, args, residuals, out, dout, config):
    del residuals, out  # statistics are recomputed in the kernel
    return _backward(args, dout, config)


MosaicTpuLayerNorm.vjp = MosaicTpuLayerNormVjp
