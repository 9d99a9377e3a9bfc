"""Layer / RMS normalization forward (`tokamax.layer_norm`) in Pallas Mosaic GPU.

Memory-bound: each block (one warpgroup) reads ``rows_per_block`` whole rows of
x from device memory straight into registers, 1024 columns a piece (16-byte
vector loads in the warpgroup's strided layout), issuing every row's loads
before the first reduction so that a block keeps its rows' bytes in flight.
The statistics are exact two-pass float32 sums over the registers (the mean,
then the centred squares), as the reference computes them; each row sum is one
warpgroup reduction of the pieces' element-wise sum. y goes back piece by piece,
with the scale and offset pieces loaded where they are used (a whole row of
them would double the registers of a wide row). No shared memory but the
reductions' scratch: the blocks resident on an SM hide each other's latency.

Only the forward: the backward is chosen among the other implementations
(`tokamax.layer_norm`'s residuals, mean and rstd per row, are written here
when a backward will read them).
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import tokamax
from tokamax import Op
from tokamax_gpu_mosaic import _common

__all__ = ["LayerNormConfig", "MosaicGpuLayerNorm", "layer_norm_forward"]

# Columns of one piece of a row: 128 threads x 8 elements (one 16-byte vector of
# a 2-byte dtype each). Rows must be a multiple of it.
PIECE = 1024
# Elements of x a block holds in registers: 128 float32 a thread. Wider rows
# would spill.
MAX_BLOCK_ELEMENTS = 16384
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class LayerNormConfig:
  """``rows_per_block`` rows of x per block (a power of 2)."""

  rows_per_block: int = 1


def _row_sum(pieces) -> jax.Array:
  """Sum of one row held as pieces: element-wise first, then one reduction."""
  return jnp.sum(functools.reduce(operator.add, pieces))


def _load_piece(ref, vector: int) -> jax.Array:
  """One ``[PIECE]`` piece in float32, in the strided layout of `vector`
  elements a thread (x's 16 bytes): the layout every piece shares, whatever
  the dtype it was loaded from (a float32 scale for a bfloat16 x)."""
  layout = plgpu.Layout.WG_STRIDED((PIECE,), vec_size=vector)
  return _common.load(ref, layout=layout).astype(jnp.float32)


def _kernel(*refs, rows_per_block: int, d: int, epsilon: float,
            subtract_mean: bool, has_scale: bool, has_offset: bool,
            with_stats: bool):
  refs = list(refs)
  x_ref = refs.pop(0)
  scale_ref = refs.pop(0) if has_scale else None
  offset_ref = refs.pop(0) if has_offset else None
  y_ref = refs.pop(0)
  first_row = lax.axis_index("rows") * rows_per_block
  pieces = [pl.ds(p * PIECE, PIECE) for p in range(d // PIECE)]
  vector = 16 // jnp.dtype(x_ref.dtype).itemsize
  rows = [[_load_piece(x_ref.at[first_row + r, cols], vector) for cols in pieces]
          for r in range(rows_per_block)]
  for r, x in enumerate(rows):
    if subtract_mean:
      mean = _row_sum(x) * (1.0 / d)
      x = [xp - mean for xp in x]
    else:
      mean = jnp.float32(0.0)
    rstd = lax.rsqrt(_row_sum([xp * xp for xp in x]) * (1.0 / d) + epsilon)
    for cols, xp in zip(pieces, x):
      y = xp * rstd
      if has_scale:
        y = y * _load_piece(scale_ref.at[cols], vector)
      if has_offset:
        y = y + _load_piece(offset_ref.at[cols], vector)
      y_ref[first_row + r, cols] = y.astype(y_ref.dtype)
    if with_stats:
      mean_ref, rstd_ref = refs
      mean_ref[first_row + r] = mean
      rstd_ref[first_row + r] = rstd


def layer_norm_forward(args: tokamax.LayerNormArgs, config: LayerNormConfig,
                       with_stats: bool):
  """``(y, {"mean", "rstd"} or {})`` for a supported call (`check_args`)."""
  x = args.x
  r, d = x.shape
  rows_per_block = config.rows_per_block
  if r % rows_per_block:
    raise ValueError(f"rows_per_block {rows_per_block} does not divide the "
                     f"{r} rows")
  params = [p for p in (args.scale, args.offset) if p is not None]
  out_type = [jax.ShapeDtypeStruct((r, d), x.dtype)]
  if with_stats:
    out_type += [jax.ShapeDtypeStruct((r,), jnp.float32)] * 2
  kernel = functools.partial(
      _kernel, rows_per_block=rows_per_block, d=d, epsilon=args.epsilon,
      subtract_mean=args.subtract_mean, has_scale=args.scale is not None,
      has_offset=args.offset is not None, with_stats=with_stats)
  call = _common.kernel(kernel, out_type=tuple(out_type),
                        grid=(r // rows_per_block,), grid_names=("rows",),
                        compiler_params=_common.compiler_params())
  y, *stats = call(x, *params)
  return y, (dict(zip(("mean", "rstd"), stats)) if with_stats else {})


def check_args(args: tokamax.LayerNormArgs) -> None:
  """NotImplementedError for what the kernel does not take."""
  for name in ("x", "scale", "offset"):
    a = getattr(args, name)
    if a is not None and jnp.dtype(a.dtype) not in _DTYPES:
      raise NotImplementedError(
          f"{name} dtype {a.dtype} is not supported (float32, bfloat16, float16 are)")
  if args.x.ndim != 2 or 0 in args.x.shape:
    raise NotImplementedError(f"x must be a non-empty [R, D] array; got shape "
                              f"{args.x.shape}")
  r, d = args.x.shape
  if d % PIECE or d > MAX_BLOCK_ELEMENTS:
    raise NotImplementedError(
        f"the normalized dim must be a multiple of {PIECE} up to "
        f"{MAX_BLOCK_ELEMENTS} (whole rows in 1024-column pieces in registers); "
        f"got {d}")
  if r * d >= 2**31:
    raise NotImplementedError(f"x has 2**31 elements or more ({r} x {d})")


def heuristic_config(args: tokamax.LayerNormArgs) -> LayerNormConfig:
  r, d = args.x.shape
  # Measured on the H200 (bf16, notes/MEASUREMENTS.md session 26, items 1-2),
  # 65536 rows: at widths 1024 and 2048 four rows a block were the best at 3
  # of the 4 (norm, width) pairs of the final kernel and at most 3.4% under the
  # best in either run; two rows fell up to 12% under it (LayerNorm 2048).
  # From 4096 on, one row a block was the best or within 1.2%.
  rows_per_block = 4 if d <= 2048 else 1
  while r % rows_per_block:
    rows_per_block //= 2
  return LayerNormConfig(rows_per_block)


def search_space(args: tokamax.LayerNormArgs) -> tuple[LayerNormConfig, ...]:
  r, d = args.x.shape
  return tuple(LayerNormConfig(b) for b in (1, 2, 4, 8)
               if r % b == 0 and b * d <= MAX_BLOCK_ELEMENTS)


@dataclasses.dataclass(frozen=True)
class MosaicGpuLayerNorm(Op):
  """Layer / RMS normalization forward: whole rows in registers, one pass over x."""

  op_name = "layer_norm"
  name = "mosaic_gpu"
  config_cls = LayerNormConfig

  def check_supported(self, args, device):
    _common.check_hopper_device(device)
    check_args(args)

  def declines(self, args):
    r, d = args.x.shape
    if not args.subtract_mean and r <= 4096 and d >= 8192:
      # Measured on the H200 (bf16, notes/MEASUREMENTS.md session 26, items 3
      # and 7): RMSNorm on 4096 rows, this kernel against Triton's: 3.63-3.65
      # TB/s against 3.77 at 8192 columns (twice), 3.64-3.65 against 3.64-3.66
      # at 16384; at 4096 columns it was ahead (3.65-3.70 against 3.64-3.67).
      # A grid of one or two waves, where Triton's wider blocks finish sooner.
      return (f"RMSNorm on {r} <= 4096 rows of {d} >= 8192 columns: Triton's "
              "kernel is as fast or faster (0.96x at 4096 x 8192 on the H200)")
    return None

  def heuristic_config(self, args):
    return heuristic_config(args)

  def search_space(self, args):
    return search_space(args)

  def forward(self, args, config):
    if config.rows_per_block < 1 or config.rows_per_block & (config.rows_per_block - 1):
      raise ValueError(f"LayerNormConfig.rows_per_block must be a power of 2; got "
                       f"{config.rows_per_block}")
    if config.rows_per_block * args.x.shape[1] > MAX_BLOCK_ELEMENTS:
      raise ValueError(f"{config} holds {config.rows_per_block} x {args.x.shape[1]} "
                       f"elements a block; at most {MAX_BLOCK_ELEMENTS} fit registers")
    return layer_norm_forward(args, config, with_stats=self.residuals_wanted())
