"""Layer / RMS normalization as Pallas Mosaic TPU kernels, forward and backward.

Layout: a block is ``block_rows`` whole rows, ``[block_rows, D]``. Its last dim is
the full D (legal for any D under the TPU tiling rules: a block dim equal to the
array dim needs no (8, 128) alignment, Mosaic pads the lanes inside VMEM), its row
count a multiple of 8 (f32) / 16 (bf16) or all of R. The last row block may run
past R: Pallas pads the read and clips the write; the backward masks those rows
out of the dscale / doffset sums.

Block sizes: ``block_rows`` is the largest power of two (<= 1024) whose kernel
plan fits 3/4 of v5e's 16 MiB scoped VMEM by `_common.vmem_bytes` (blocks
double-buffered + ~3 forward / ~5 backward float32 block temporaries): 64 rows
forward and 32 backward at D=8192 bf16. The same blocks run on v5p / v6e
(normalization is HBM-bound everywhere; larger blocks only shorten the pipeline
prologue). Rows too wide for 16 MiB at 16 rows per block are refused (with scale
and offset: D > 23808 in bf16, D > 18688 in f32; the estimate counts the f32
temporaries, which earlier versions of this check ignored).

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
from tokamax import plugin
from tokamax_tpu_mosaic import _common

_MAX_BLOCK_ROWS = 1024
_MIN_BLOCK_ROWS = 16  # the bf16 sublane tile; also fine for f32
_FWD_TEMPS = 3  # float32 block-sized temporaries the forward body holds (x, xc, y)
_BWD_TEMPS = 5  # ... and the backward (x, dy, xhat, g, dxhat)


@dataclasses.dataclass(frozen=True)
class LayerNormConfig:
  """Rows per block (a multiple of 16, or >= R meaning all rows in one block)."""

  block_rows: int = 256

  def __post_init__(self):
    if self.block_rows < 1:
      raise ValueError(f"block_rows must be >= 1; got {self.block_rows}")


def _plan_for(args, block_rows: int, backward: bool):
  """The kernel plan of `args` at `block_rows` (shapes only; nothing runs)."""
  make = _bwd_plan if backward else _fwd_plan
  return make(args, LayerNormConfig(block_rows))


def _heuristic(args, backward: bool) -> LayerNormConfig:
  """The largest power-of-two row block whose plan fits the v5e VMEM budget.

  Normalization is HBM-bound on every generation, so one table serves v5e, v5p
  and v6e: larger blocks would only shorten the pipeline's prologue.
  """
  rows = _MAX_BLOCK_ROWS
  budget = _common.vmem_budget(None)
  while rows > _MIN_BLOCK_ROWS and _plan_for(args, rows, backward).vmem_bytes() > budget:
    rows //= 2
  return LayerNormConfig(block_rows=rows)


def _search_space(args, backward: bool):
  limit = _common.SCOPED_VMEM_BYTES[_common.DEFAULT_GENERATION]
  configs = [_heuristic(args, backward)] + [
      LayerNormConfig(b) for b in (64, 128, 256, 512)
      if _plan_for(args, b, backward).vmem_bytes() <= limit]
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


def _params(args, names):
  """(array, Operand) of the present scale / offset, as [1, D] rows."""
  d = args.x.shape[1]
  out = []
  for name in names:
    p = getattr(args, name)
    if p is not None:
      out.append((p, _common.Operand((1, d), p.dtype, _param_spec(d))))
  return out


def _fwd_plan(args, config) -> _common.KernelPlan:
  r, d = args.x.shape
  br = _block_rows(r, config)
  row = _common.Operand((r, d), args.x.dtype, pl.BlockSpec((br, d), lambda i: (i, 0)))
  stat = _common.Operand((r, 1), jnp.float32, pl.BlockSpec((br, 1), lambda i: (i, 0)))
  params = tuple(o for _, o in _params(args, ("scale", "offset")))
  return _common.KernelPlan(
      name="tokamax_tpu_layer_norm_fwd", grid=(_common.cdiv(r, br),),
      inputs=(row,) + params, outputs=(row, stat, stat), semantics=("parallel",),
      temp_bytes=_FWD_TEMPS * _common.tile_bytes((br, d), jnp.float32))


def _bwd_plan(args, config) -> _common.KernelPlan:
  r, d = args.x.shape
  br = _block_rows(r, config)
  nb = _common.cdiv(r, br)
  row = _common.Operand((r, d), args.x.dtype, pl.BlockSpec((br, d), lambda i: (i, 0)))
  part = _common.Operand((nb, 1, d), jnp.float32,
                         pl.BlockSpec((1, 1, d), lambda i: (i, 0, 0)))
  params = tuple(o for _, o in _params(args, ("scale",)))
  want = (args.scale is not None) + (args.offset is not None)
  return _common.KernelPlan(
      name="tokamax_tpu_layer_norm_bwd", grid=(nb,), inputs=(row, row) + params,
      outputs=(row,) + (part,) * want, semantics=("parallel",),
      temp_bytes=_BWD_TEMPS * _common.tile_bytes((br, d), jnp.float32))


def _forward(args, config):
  plan = _fwd_plan(args, config)
  inputs = [args.x] + [p.reshape(1, -1) for p, _ in _params(args, ("scale", "offset"))]
  kernel = functools.partial(
      _fwd_kernel, has_scale=args.scale is not None,
      has_offset=args.offset is not None, subtract_mean=args.subtract_mean,
      eps=args.epsilon)
  y, mean, rstd = plan.call(kernel, *inputs)
  return y, mean[:, 0], rstd[:, 0]


def _backward(args, dy, config):
  r, _ = args.x.shape
  plan = _bwd_plan(args, config)
  br = plan.inputs[0].spec.block_shape[0]
  has_scale = args.scale is not None
  want = [has_scale, args.offset is not None]
  inputs = [args.x, dy.astype(args.x.dtype)]
  inputs += [p.reshape(1, -1) for p, _ in _params(args, ("scale",))]
  kernel = functools.partial(
      _bwd_kernel, has_scale=has_scale, want_dscale=want[0], want_doffset=want[1],
      subtract_mean=args.subtract_mean, eps=args.epsilon, rows=r, block_rows=br,
      ragged=r % br != 0)
  dx, *partials = plan.call(kernel, *inputs)
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
    # The rows as dispatch hands them over (the leading dims merged into R, the
    # normalized axis last), not the caller's shape.
    raise NotImplementedError(f"x must be non-empty [R, D] rows (the caller's leading "
                              f"dims merged into R); got {args.x.shape}")
  d = args.x.shape[1]
  limit = _common.SCOPED_VMEM_BYTES[_common.DEFAULT_GENERATION]
  need = _plan_for(args, _MIN_BLOCK_ROWS, backward=True).vmem_bytes()
  if need > limit:
    raise NotImplementedError(
        f"rows of D={d} do not fit the VMEM budget at {_MIN_BLOCK_ROWS} rows per block "
        f"({need / 2**20:.1f} MiB > {limit / 2**20:.0f} MiB scoped VMEM on v5e)")


class _LayerNormFunctions(plugin.OpFunctions):
  """What the forward and backward ops share."""

  op_name = "layer_norm"
  name = "mosaic_tpu"
  config_cls = LayerNormConfig
  check_args = staticmethod(_check_args)
  heuristic = staticmethod(_heuristic)
  configs = staticmethod(_search_space)


@dataclasses.dataclass(frozen=True)
class MosaicTpuLayerNorm(_LayerNormFunctions, tokamax.Op):
  """Layer / RMS normalization forward as a Pallas Mosaic TPU kernel."""

  def forward(self, args, config):
    y, mean, rstd = _forward(args, config)
    return y, {"mean": mean, "rstd": rstd}


@dataclasses.dataclass(frozen=True)
class MosaicTpuLayerNormVjp(_LayerNormFunctions, tokamax.VjpOp):
  """Layer / RMS normalization backward as a Pallas Mosaic TPU kernel."""

  def backward(self, args, residuals, out, dout, config):
    del residuals, out  # statistics are recomputed in the kernel
    return _backward(args, dout, config)


MosaicTpuLayerNorm.vjp = MosaicTpuLayerNormVjp


def heuristic_plans(args, generation: str | None = None, with_prefetch: bool = False):
  """[(plan, ())] of the forward and backward kernels (one table for all generations)."""
  del generation, with_prefetch
  return [(_plan_for(args, _heuristic(args, b).block_rows, b), ()) for b in (False, True)]
