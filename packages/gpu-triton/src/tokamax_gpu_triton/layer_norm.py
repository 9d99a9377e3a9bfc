"""Layer / RMS normalization as Pallas Triton kernels.

Forward (grid over blocks of ``block_rows`` rows): each program loads a
``[block_rows, block_d]`` tile and computes float32 statistics per row.

- ``block_d >= D`` (the usual case): the row lives in registers, so x is read from
  HBM exactly once; mean and variance are exact two-pass sums over the registers.
- ``block_d < D`` (very wide rows): a first loop over column blocks merges
  per-block (mean, M2) pairs with Chan's parallel formula (stable, one read of x),
  a second loop normalizes and stores. The first loop asks the cache to keep x
  (``evict_last``) so the second loop mostly reads it from L2.

Backward: with ``xhat = (x - mean) * rstd`` and ``g = dy * scale``,
``dx = rstd * (g - xhat * mean(g * xhat) - mean(g))`` (no ``mean(g)`` term for
RMSNorm). The kernel is persistent over rows: a grid of ``num_programs`` programs
walks the row blocks (program ``p`` takes blocks ``p, p + G, p + 2G, ...``) and
keeps its share of ``dscale = sum(dy * xhat)`` and ``doffset = sum(dy)`` in
registers, writing one float32 row of a ``[num_programs, D]`` partial array at
the end; jnp then sums the partials (a few MB, deterministic, no atomics).

- Rows that fit one block (the usual case): one kernel moves x, dy in and dx
  out. With ``saved_stats`` it reads the forward's mean / rstd (8 bytes a row),
  so its row sums are independent of each other (one round of cross-warp
  reductions); without, it recomputes them from the x tile in registers, which
  lets XLA drop the forward kernel when only gradients are used. The loads of
  the next row block are issued before the current block's reductions
  (``prefetch``), keeping HBM busy across them.
- Wider rows: a small first kernel computes ``mean(g * xhat)`` and ``mean(g)``
  per row from the saved mean / rstd, and the main kernel's grid gets a second axis over column blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import tokamax
from tokamax import plugin
from tokamax_gpu_triton import _common

# Largest row tile kept in registers: the forward holds one f32 copy of the tile,
# the backward several (x, dy, g, the prefetched next tiles and the dscale /
# doffset accumulators), so its limit is lower to stay in registers at 16 warps.
_MAX_BLOCK_D_FWD = 16384
_MAX_BLOCK_D_BWD = 8192
# Elements per program the heuristics aim for: enough bytes in flight per SM to
# cover HBM latency, small enough for several programs per SM.
_TARGET_TILE = 8192
_NUM_SMS = 132  # H100 / H200.
_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class LayerNormConfig:
  """Forward tiling: ``block_rows`` x ``block_d`` elements per program (powers of 2)."""

  block_rows: int = 1
  block_d: int = 1024
  num_warps: int = 4


@dataclasses.dataclass(frozen=True)
class LayerNormVjpConfig:
  """Backward tiling.

  ``num_programs`` is the target size of the persistent grid (row direction); the
  grid is shrunk to the fewest programs with the same number of trips.
  ``prefetch`` (rows that fit one block only): load the next row block while
  reducing the current one. ``saved_stats`` (rows that fit one block only): read
  the forward's mean and rstd (8 bytes a row) when it saved them, instead of
  recomputing them from x: the row sums then need one round of cross-warp
  reductions, not two (LayerNorm's centred sums wait for its mean), and none
  waits for the other.
  """

  block_rows: int = 1
  block_d: int = 1024
  num_warps: int = 4
  num_programs: int = 264
  num_stages: int = 1
  prefetch: bool = True
  saved_stats: bool = True


def _pow2_at_most(x: int) -> int:
  return 1 << (max(x, 1).bit_length() - 1)


def _warps_for(tile: int, elems_per_thread: int, most: int = 16) -> int:
  return max(1, min(most, _pow2_at_most(tile // (32 * elems_per_thread))))


def _row_block(r: int, block_d: int, tile: int = _TARGET_TILE) -> int:
  return max(1, min(_common.next_power_of_2(r), tile // block_d))


def _per_thread(tile: int, num_warps: int) -> int:
  return tile // (32 * num_warps)


def _block_d_choices(d: int, wide_choices) -> list[int]:
  """The whole row in one block if it fits, else the given sizes below it."""
  d_p2 = _common.next_power_of_2(d)
  if d_p2 <= wide_choices[-1]:
    return [d_p2]
  return list(wide_choices)


def _check_config(config) -> None:
  for name in ("block_rows", "block_d", "num_warps"):
    v = getattr(config, name)
    if v < 1 or v & (v - 1):
      raise ValueError(f"{type(config).__name__}.{name} must be a power of 2; got {v}")
  for name in ("num_programs", "num_stages"):
    if getattr(config, name, 1) < 1:
      raise ValueError(f"{type(config).__name__}.{name} must be >= 1; got {config}")
  if config.num_warps > 32:
    raise ValueError(f"{type(config).__name__}.num_warps must be <= 32; got {config}")


# ----------------------------------------------------------------------------
# Masking. Masks are built only for dimensions that are not block multiples
# (known statically), so aligned shapes run plain vectorized loads and stores.
# ----------------------------------------------------------------------------


def _range_mask(start, size: int, bound: int, ragged: bool):
  return start + jnp.arange(size) < bound if ragged else None


def _load(ref, mask, policy=None):
  return _common.load(ref, mask, 0.0, eviction_policy=policy).astype(jnp.float32)


def _store(ref, value, mask):
  _common.store(ref, value.astype(ref.dtype), mask)


def _load_param(ref, cols, col_mask):
  return None if ref is None else _load(_common.at(ref, cols), col_mask)


def _affine(y, scale, offset):
  if scale is not None:
    y = y * scale[None, :]
  if offset is not None:
    y = y + offset[None, :]
  return y


# ----------------------------------------------------------------------------
# Forward.
# ----------------------------------------------------------------------------


def _fwd_kernel(*refs, has_scale, has_offset, subtract_mean, eps, block_rows,
                block_d):
  refs = list(refs)
  x_ref = refs.pop(0)
  scale_ref = refs.pop(0) if has_scale else None
  offset_ref = refs.pop(0) if has_offset else None
  y_ref, mean_ref, rstd_ref = refs
  r, d = x_ref.shape
  r0 = pl.program_id(0) * block_rows
  row_mask = _range_mask(r0, block_rows, r, r % block_rows != 0)
  rows = pl.ds(r0, block_rows)
  cols_ragged = d % block_d != 0

  if block_d >= d:
    cols = pl.ds(0, block_d)
    col_mask = _range_mask(0, block_d, d, cols_ragged)
    mask = _common.block_mask(row_mask, col_mask)
    x = _load(_common.at(x_ref, rows, cols), mask)
    if subtract_mean:
      mean = jnp.sum(x, axis=1) / d
      x = x - mean[:, None]
      if col_mask is not None:
        x = jnp.where(col_mask[None, :], x, 0.0)
    else:
      mean = jnp.zeros((block_rows,), jnp.float32)
    rstd = jax.lax.rsqrt(jnp.sum(x * x, axis=1) / d + eps)
    y = _affine(x * rstd[:, None], _load_param(scale_ref, cols, col_mask),
                _load_param(offset_ref, cols, col_mask))
    _store(_common.at(y_ref, rows, cols), y, mask)
  else:
    num_col_blocks = pl.cdiv(d, block_d)

    def stats_body(j, carry):
      mean, m2 = carry
      c0 = pl.multiple_of(j * block_d, block_d)
      col_mask = _range_mask(c0, block_d, d, cols_ragged)
      x = _load(x_ref.at[rows, pl.ds(c0, block_d)],
                _common.block_mask(row_mask, col_mask), "evict_last")
      if not subtract_mean:
        return mean, m2 + jnp.sum(x * x, axis=1)
      # Chan et al.: merge this block's (count, mean, M2) into the running one.
      n_a = (j * block_d).astype(jnp.float32)
      n_b = jnp.minimum(block_d, d - j * block_d).astype(jnp.float32)
      block_mean = jnp.sum(x, axis=1) / n_b
      xc = x - block_mean[:, None]
      if col_mask is not None:
        xc = jnp.where(col_mask[None, :], xc, 0.0)
      delta = block_mean - mean
      n = n_a + n_b
      mean = mean + delta * (n_b / n)
      m2 = m2 + jnp.sum(xc * xc, axis=1) + delta * delta * (n_a * n_b / n)
      return mean, m2

    zeros = jnp.zeros((block_rows,), jnp.float32)
    mean, m2 = jax.lax.fori_loop(0, num_col_blocks, stats_body, (zeros, zeros))
    rstd = jax.lax.rsqrt(m2 / d + eps)

    def norm_body(j, _):
      c0 = pl.multiple_of(j * block_d, block_d)
      cols = pl.ds(c0, block_d)
      col_mask = _range_mask(c0, block_d, d, cols_ragged)
      mask = _common.block_mask(row_mask, col_mask)
      x = _load(_common.at(x_ref, rows, cols), mask, "evict_first")
      y = _affine((x - mean[:, None]) * rstd[:, None],
                  _load_param(scale_ref, cols, col_mask),
                  _load_param(offset_ref, cols, col_mask))
      _store(_common.at(y_ref, rows, cols), y, mask)
      return ()

    jax.lax.fori_loop(0, num_col_blocks, norm_body, ())

  _store(mean_ref.at[rows], mean, row_mask)
  _store(rstd_ref.at[rows], rstd, row_mask)


def _forward(args: tokamax.LayerNormArgs, config: LayerNormConfig):
  x = args.x
  r, d = x.shape
  params = [p for p in (args.scale, args.offset) if p is not None]
  kernel = functools.partial(
      _fwd_kernel, has_scale=args.scale is not None,
      has_offset=args.offset is not None, subtract_mean=args.subtract_mean,
      eps=args.epsilon, block_rows=config.block_rows, block_d=config.block_d)
  n_in = 1 + len(params)
  y, mean, rstd = _common.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((r, d), x.dtype),
                 jax.ShapeDtypeStruct((r,), jnp.float32),
                 jax.ShapeDtypeStruct((r,), jnp.float32)),
      grid=(pl.cdiv(r, config.block_rows),),
      in_specs=[pl.no_block_spec] * n_in,
      out_specs=[pl.no_block_spec] * 3,
      num_warps=config.num_warps, num_stages=1,
      interpret=tokamax.interpret_mode(), name="tokamax_layer_norm_fwd",
  )(x, *params)
  return y, mean, rstd


# ----------------------------------------------------------------------------
# Backward.
# ----------------------------------------------------------------------------


def _xhat(x, mean, rstd):
  # Padding rows load mean = rstd = 0, so xhat (and every sum below) is 0 there;
  # padding columns load dy = 0, so they add nothing either.
  if mean is not None:
    x = x - mean[:, None]
  return x * rstd[:, None]


def _g(dy, scale):
  return dy if scale is None else dy * scale[None, :]


def _rows_grads_from_stats(x, dy, scale, mean, rstd, col_mask, *, d):
  """(dx, xhat) for a tile of whole rows, from the forward's mean (None for
  RMSNorm) and rstd; padding rows load rstd = 0, so xhat and dx are 0 there."""
  xhat = _xhat(x, mean, rstd)
  if mean is not None and col_mask is not None:
    xhat = jnp.where(col_mask[None, :], xhat, 0.0)
  g = _g(dy, scale)
  # Independent row sums: one round of cross-warp reductions.
  dx = g - xhat * (jnp.sum(g * xhat, axis=1) / d)[:, None]
  if mean is not None:
    dx = dx - (jnp.sum(g, axis=1) / d)[:, None]
  return dx * rstd[:, None], xhat


def _rows_grads(x, dy, scale, row_mask, col_mask, *, subtract_mean, eps, d):
  """(dx, xhat) for a tile of whole rows, recomputing the statistics from x."""
  if subtract_mean:
    mean = jnp.sum(x, axis=1) / d
    x = x - mean[:, None]
    if col_mask is not None:
      x = jnp.where(col_mask[None, :], x, 0.0)
  g = _g(dy, scale)
  # After LayerNorm's mean, its three row sums (two for RMSNorm) are independent
  # of each other, so their cross-warp reductions overlap.
  rstd = jax.lax.rsqrt(jnp.sum(x * x, axis=1) / d + eps)
  if row_mask is not None:
    # Padding rows are all zeros: rsqrt(eps) with eps = 0 would be inf, and
    # 0 * inf would put NaNs into the dscale sums.
    rstd = jnp.where(row_mask, rstd, 0.0)
  c1 = jnp.sum(g * x, axis=1) * (rstd * rstd / d)
  dx = g - x * c1[:, None]
  if subtract_mean:
    dx = dx - (jnp.sum(g, axis=1) / d)[:, None]
  return dx * rstd[:, None], x * rstd[:, None]


def _bwd_rows_kernel(*refs, has_scale, want_dscale, want_doffset, subtract_mean,
                     eps, prefetch, saved_stats, rows_ragged, trips, block_rows,
                     block_d):
  """Backward for rows that fit one block: one read of x and dy, and of the
  forward's mean / rstd with `saved_stats` (else recomputed from x).

  Program ``p`` walks row blocks ``p, p + G, ...`` (``trips`` of them, the last
  ones padding when G does not divide the row blocks) and keeps its share of
  dscale / doffset in registers. With ``prefetch`` the loads of the next row
  block are issued before the current one is reduced and stored, so HBM stays
  busy during the cross-warp reductions (Triton does not pipeline loads that feed
  no dot); the loop carries the prefetched tiles in their own (16-bit) dtype.
  """
  refs = list(refs)
  x_ref = refs.pop(0)
  scale_ref = refs.pop(0) if has_scale else None
  dy_ref = refs.pop(0)
  mean_ref = refs.pop(0) if saved_stats and subtract_mean else None
  rstd_ref = refs.pop(0) if saved_stats else None
  dx_ref = refs.pop(0)
  dscale_ref = refs.pop(0) if want_dscale else None
  doffset_ref = refs.pop(0) if want_doffset else None
  r, d = x_ref.shape
  num_programs = pl.num_programs(0)
  pid = pl.program_id(0)
  cols = pl.ds(0, block_d)
  col_mask = _range_mask(0, block_d, d, d % block_d != 0)
  scale = _load_param(scale_ref, cols, col_mask)

  def block(it):
    r0 = (pid + it * num_programs) * block_rows
    row_mask = _range_mask(r0, block_rows, r, rows_ragged)
    return pl.ds(r0, block_rows), row_mask, _common.block_mask(row_mask, col_mask)

  stats_refs = [ref for ref in (mean_ref, rstd_ref) if ref is not None]

  def load(it):
    """The block's x and dy tiles, then its saved statistics (prefetched alike:
    a statistic loaded in the body would put HBM latency before the sums)."""
    rows, row_mask, mask = block(it)
    return (_common.load(_common.at(x_ref, rows, cols), mask),
            _common.load(_common.at(dy_ref, rows, cols), mask),
            *(_load(ref.at[rows], row_mask) for ref in stats_refs))

  def body(it, carry):
    accs, tiles = carry
    if prefetch:
      # The last trip re-loads its own block (cached) instead of masking.
      next_tiles = load(jnp.minimum(it + 1, trips - 1))
    else:
      tiles = load(it)
    rows, row_mask, mask = block(it)
    x, dy = (t.astype(jnp.float32) for t in tiles[:2])
    if saved_stats:
      *mean, rstd = tiles[2:]
      dx, xhat = _rows_grads_from_stats(x, dy, scale, mean[0] if mean else None,
                                        rstd, col_mask, d=d)
    else:
      dx, xhat = _rows_grads(x, dy, scale, row_mask, col_mask,
                             subtract_mean=subtract_mean, eps=eps, d=d)
    _store(_common.at(dx_ref, rows, cols), dx, mask)
    new_accs = []
    if want_dscale:
      new_accs.append(accs[len(new_accs)] + dy * xhat)
    if want_doffset:
      new_accs.append(accs[len(new_accs)] + dy)
    return tuple(new_accs), (next_tiles if prefetch else tiles)

  # The dscale / doffset accumulators have the tile's shape and are summed over
  # its rows once, after the loop: a sum over rows in every trip costs a round
  # of cross-warp reductions whenever a tile holds more than one row. Measured on
  # the H200 (tools/tune.py --grid --ab, forward+backward): LayerNorm 32768x1024
  # 0.129 -> 0.104 ms, RMSNorm 0.104 -> 0.095; within 1% at one or two rows a tile.
  zeros = jnp.zeros((block_rows, block_d), jnp.float32)
  accs = (zeros,) * (int(want_dscale) + int(want_doffset))
  if prefetch:
    tiles = load(0)
  else:
    tiles = (jnp.zeros((block_rows, block_d), x_ref.dtype),
             jnp.zeros((block_rows, block_d), dy_ref.dtype),
             *(jnp.zeros((block_rows,), jnp.float32) for _ in stats_refs))
  accs, _ = jax.lax.fori_loop(0, trips, body, (accs, tiles))
  accs = [jnp.sum(acc, axis=0) for acc in accs]
  for ref, acc in zip((r for r in (dscale_ref, doffset_ref) if r is not None), accs):
    _store(_common.at(ref, pid, cols), acc, col_mask)


def _bwd_row_sums_kernel(*refs, has_scale, subtract_mean, block_rows, block_d):
  """Per-row ``mean(g * xhat)`` and ``mean(g)`` for rows wider than one block."""
  refs = list(refs)
  x_ref = refs.pop(0)
  scale_ref = refs.pop(0) if has_scale else None
  dy_ref, mean_ref, rstd_ref, c1_ref, c2_ref = refs
  r, d = x_ref.shape
  r0 = pl.program_id(0) * block_rows
  row_mask = _range_mask(r0, block_rows, r, r % block_rows != 0)
  rows = pl.ds(r0, block_rows)
  mean = _load(mean_ref.at[rows], row_mask) if subtract_mean else None
  rstd = _load(rstd_ref.at[rows], row_mask)

  def body(j, carry):
    s1, s2 = carry
    c0 = pl.multiple_of(j * block_d, block_d)
    cols = pl.ds(c0, block_d)
    col_mask = _range_mask(c0, block_d, d, d % block_d != 0)
    mask = _common.block_mask(row_mask, col_mask)
    xhat = _xhat(_load(_common.at(x_ref, rows, cols), mask, "evict_last"), mean, rstd)
    g = _g(_load(_common.at(dy_ref, rows, cols), mask, "evict_last"),
           _load_param(scale_ref, cols, col_mask))
    return s1 + jnp.sum(g * xhat, axis=1), s2 + jnp.sum(g, axis=1)

  zeros = jnp.zeros((block_rows,), jnp.float32)
  s1, s2 = jax.lax.fori_loop(0, pl.cdiv(d, block_d), body, (zeros, zeros))
  _store(c1_ref.at[rows], s1 / d, row_mask)
  _store(c2_ref.at[rows], s2 / d, row_mask)


def _bwd_wide_kernel(*refs, has_scale, want_dscale, want_doffset, subtract_mean,
                     rows_ragged, trips, block_rows, block_d):
  """Backward for a column block of wide rows, with precomputed row sums."""
  refs = list(refs)
  x_ref = refs.pop(0)
  scale_ref = refs.pop(0) if has_scale else None
  dy_ref, mean_ref, rstd_ref, c1_ref, c2_ref, dx_ref = refs[:6]
  refs = refs[6:]
  dscale_ref = refs.pop(0) if want_dscale else None
  doffset_ref = refs.pop(0) if want_doffset else None
  r, d = x_ref.shape
  num_programs = pl.num_programs(0)
  pid = pl.program_id(0)
  c0 = pl.multiple_of(pl.program_id(1) * block_d, block_d)
  cols = pl.ds(c0, block_d)
  col_mask = _range_mask(c0, block_d, d, d % block_d != 0)
  scale = _load_param(scale_ref, cols, col_mask)

  def body(it, carry):
    acc_scale, acc_offset = carry
    r0 = (pid + it * num_programs) * block_rows
    row_mask = _range_mask(r0, block_rows, r, rows_ragged)
    rows = pl.ds(r0, block_rows)
    mask = _common.block_mask(row_mask, col_mask)
    mean = _load(mean_ref.at[rows], row_mask) if subtract_mean else None
    rstd = _load(rstd_ref.at[rows], row_mask)
    dy = _load(_common.at(dy_ref, rows, cols), mask, "evict_first")
    xhat = _xhat(_load(_common.at(x_ref, rows, cols), mask, "evict_first"), mean, rstd)
    g = _g(dy, scale)
    c1 = _load(c1_ref.at[rows], row_mask)
    dx = g - xhat * c1[:, None]
    if subtract_mean:
      dx = dx - _load(c2_ref.at[rows], row_mask)[:, None]
    _store(_common.at(dx_ref, rows, cols), dx * rstd[:, None], mask)
    if want_dscale:
      acc_scale = acc_scale + jnp.sum(dy * xhat, axis=0)
    if want_doffset:
      acc_offset = acc_offset + jnp.sum(dy, axis=0)
    return acc_scale, acc_offset

  zeros = jnp.zeros((block_d,), jnp.float32)
  acc_scale, acc_offset = jax.lax.fori_loop(0, trips, body, (zeros, zeros))
  for ref, acc in ((dscale_ref, acc_scale), (doffset_ref, acc_offset)):
    if ref is not None:
      _store(_common.at(ref, pid, cols), acc, col_mask)


def _grid_rows(num_row_blocks: int, target: int) -> tuple[int, int]:
  """(programs, trips): the fewest programs that keep `target`'s trip count.

  E.g. 32768 row blocks over a target of 132 programs: 249 trips each, and 132
  programs (not 128 that divide evenly, which would leave 4 SMs idle).
  """
  target = max(1, min(target, num_row_blocks))
  trips = pl.cdiv(num_row_blocks, target)
  return pl.cdiv(num_row_blocks, trips), trips


def _stats(args: tokamax.LayerNormArgs):
  """mean / rstd as the forward would save them (when the forward saved none)."""
  xf = args.x.astype(jnp.float32)
  if args.subtract_mean:
    mean = jnp.mean(xf, axis=-1)
    xf = xf - mean[:, None]
  else:
    mean = jnp.zeros(xf.shape[:1], jnp.float32)
  return mean, jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1) + args.epsilon)


def _partials_to_grads(args, dx, partials):
  grads = {"x": dx}
  partials = list(partials)
  if args.scale is not None:
    grads["scale"] = jnp.sum(partials.pop(0), axis=0)
  if args.offset is not None:
    grads["offset"] = jnp.sum(partials.pop(0), axis=0)
  return grads


@dataclasses.dataclass(frozen=True)
class _BwdGrid:
  """The persistent backward grid of one call and the outputs of its main kernel."""

  num_row_blocks: int
  num_programs: int
  trips: int
  rows_ragged: bool  # a partial last row block, or padding trips
  out_shape: tuple[jax.ShapeDtypeStruct, ...]  # dx, then the dscale / doffset partials


def _bwd_grid(args: tokamax.LayerNormArgs, config: LayerNormVjpConfig) -> _BwdGrid:
  r, d = args.x.shape
  num_row_blocks = pl.cdiv(r, config.block_rows)
  num_programs, trips = _grid_rows(num_row_blocks, config.num_programs)
  rows_ragged = r % config.block_rows != 0 or num_row_blocks != num_programs * trips
  partial = jax.ShapeDtypeStruct((num_programs, d), jnp.float32)
  out_shape = [jax.ShapeDtypeStruct((r, d), args.x.dtype)]
  out_shape += [partial] * (int(args.scale is not None) + int(args.offset is not None))
  return _BwdGrid(num_row_blocks, num_programs, trips, rows_ragged, tuple(out_shape))


def _backward_rows(args: tokamax.LayerNormArgs, dy, config: LayerNormVjpConfig,
                   stats):
  """Rows that fit one block: a single kernel. `stats`: the forward's (mean,
  rstd), or None to recompute them in registers (which also lets XLA drop the
  forward kernel when only gradients are wanted: its output is then dead)."""
  x = args.x
  block_rows, block_d = config.block_rows, config.block_d
  grid = _bwd_grid(args, config)
  has_scale = args.scale is not None
  scale_in = [args.scale] if has_scale else []
  stats_in = []
  if stats is not None:
    mean, rstd = (a.astype(jnp.float32) for a in stats)
    stats_in = [mean, rstd] if args.subtract_mean else [rstd]
  outs = _common.pallas_call(
      functools.partial(
          _bwd_rows_kernel, has_scale=has_scale, want_dscale=has_scale,
          want_doffset=args.offset is not None, subtract_mean=args.subtract_mean,
          eps=args.epsilon, prefetch=config.prefetch and grid.trips > 1,
          saved_stats=stats is not None, rows_ragged=grid.rows_ragged,
          trips=grid.trips, block_rows=block_rows, block_d=block_d),
      out_shape=grid.out_shape,
      grid=(grid.num_programs,),
      in_specs=[pl.no_block_spec] * (2 + len(scale_in) + len(stats_in)),
      out_specs=[pl.no_block_spec] * len(grid.out_shape),
      num_warps=config.num_warps, num_stages=config.num_stages,
      interpret=tokamax.interpret_mode(), name="tokamax_layer_norm_bwd",
  )(x, *scale_in, dy.astype(x.dtype), *stats_in)
  return _partials_to_grads(args, outs[0], outs[1:])


def _backward_wide(args: tokamax.LayerNormArgs, mean, rstd, dy,
                   config: LayerNormVjpConfig):
  """Rows wider than one block: a row-sums kernel, then a 2-D grid over columns."""
  x = args.x
  r, d = x.shape
  block_rows, block_d = config.block_rows, config.block_d
  grid = _bwd_grid(args, config)
  has_scale = args.scale is not None
  interpret = tokamax.interpret_mode()
  scale_in = [args.scale] if has_scale else []
  dy = dy.astype(x.dtype)

  row_sums = _common.pallas_call(
      functools.partial(_bwd_row_sums_kernel, has_scale=has_scale,
                        subtract_mean=args.subtract_mean, block_rows=block_rows,
                        block_d=block_d),
      out_shape=(jax.ShapeDtypeStruct((r,), jnp.float32),) * 2,
      grid=(grid.num_row_blocks,),
      in_specs=[pl.no_block_spec] * (4 + len(scale_in)),
      out_specs=[pl.no_block_spec] * 2,
      num_warps=config.num_warps, num_stages=1, interpret=interpret,
      name="tokamax_layer_norm_bwd_row_sums",
  )(x, *scale_in, dy, mean, rstd)

  outs = _common.pallas_call(
      functools.partial(_bwd_wide_kernel, has_scale=has_scale,
                        want_dscale=has_scale, want_doffset=args.offset is not None,
                        subtract_mean=args.subtract_mean, rows_ragged=grid.rows_ragged,
                        trips=grid.trips, block_rows=block_rows, block_d=block_d),
      out_shape=grid.out_shape,
      grid=(grid.num_programs, pl.cdiv(d, block_d)),
      in_specs=[pl.no_block_spec] * (6 + len(scale_in)),
      out_specs=[pl.no_block_spec] * len(grid.out_shape),
      num_warps=config.num_warps, num_stages=config.num_stages,
      interpret=interpret, name="tokamax_layer_norm_bwd",
  )(x, *scale_in, dy, mean, rstd, *row_sums)
  return _partials_to_grads(args, outs[0], outs[1:])


# ----------------------------------------------------------------------------
# Ops.
# ----------------------------------------------------------------------------


def _check_args(args: tokamax.LayerNormArgs, device: tokamax.DeviceInfo) -> None:
  _common.check_triton_device(device)
  for name in ("x", "scale", "offset"):
    a = getattr(args, name)
    if a is not None and a.dtype not in _SUPPORTED_DTYPES:
      raise NotImplementedError(f"{name} dtype {a.dtype} is not supported "
                                "(float32, bfloat16, float16 are)")
  if args.x.ndim != 2 or 0 in args.x.shape:
    # The rows as dispatch hands them over (the leading dims merged into R, the
    # normalized axis last), not the caller's shape.
    raise NotImplementedError(f"x must be non-empty [R, D] rows (the caller's leading "
                              f"dims merged into R); got {args.x.shape}")
  if args.x.shape[0] >= 2**31 // max(args.x.shape[1], 1):
    raise NotImplementedError("x has 2**31 elements or more (int32 offsets)")


class _LayerNormFunctions(plugin.OpFunctions):
  """What the forward and backward ops share."""

  op_name = "layer_norm"
  name = "triton"
  check_args = staticmethod(_check_args)


@dataclasses.dataclass(frozen=True)
class TritonLayerNorm(_LayerNormFunctions, tokamax.Op):
  """Layer / RMS normalization forward as a Pallas Triton kernel."""

  config_cls = LayerNormConfig

  def heuristic_config(self, args):
    r, d = args.x.shape
    block_d = min(_common.next_power_of_2(d), _MAX_BLOCK_D_FWD)
    block_rows = _row_block(r, block_d)
    # ~32 elements per thread: four 16-byte loads of bf16 in flight each.
    return LayerNormConfig(block_rows=block_rows, block_d=block_d,
                           num_warps=_warps_for(block_rows * block_d, 32))

  def search_space(self, args):
    r, d = args.x.shape
    configs = [self.heuristic_config(args)]
    for block_d in _block_d_choices(d, (4096, 8192, _MAX_BLOCK_D_FWD)):
      for tile in (2048, 4096, 8192, 16384):
        block_rows = _row_block(r, block_d, tile)
        for num_warps in (2, 4, 8, 16):
          if _per_thread(block_rows * block_d, num_warps) in range(4, 65):
            configs.append(LayerNormConfig(block_rows, block_d, num_warps))
    return list(dict.fromkeys(configs))

  def forward(self, args, config):
    _check_config(config)
    y, mean, rstd = _forward(args, config)
    return y, {"mean": mean, "rstd": rstd}


@dataclasses.dataclass(frozen=True)
class TritonLayerNormVjp(_LayerNormFunctions, tokamax.VjpOp):
  """Layer / RMS normalization backward as Pallas Triton kernels."""

  config_cls = LayerNormVjpConfig

  def declines(self, args):
    d = args.x.shape[1]
    if not args.subtract_mean and d > _MAX_BLOCK_D_BWD:
      # XLA fuses the RMS backward well; our rows do not fit one block here, and
      # the two-pass path reads x and dy twice. Measured on the H200
      # (tools/shape_sweep.py --op norms, bf16, rows x D = 2^27): forward+backward
      # 0.537 ms against XLA's 0.394 at D 12288, 0.508 against 0.437 at 16384;
      # the one-block path at block_d 16384 was no better (0.469 / 0.564).
      return (f"the RMS backward at D={d} > {_MAX_BLOCK_D_BWD} (two passes over x "
              "and dy) is slower than XLA's (0.73x at D 12288 on the H200)")
    return None

  def heuristic_config(self, args):
    r, d = args.x.shape
    block_d = min(_common.next_power_of_2(d), _MAX_BLOCK_D_BWD)
    block_rows = _row_block(r, block_d)
    # Half the forward's elements per thread: x, dy, the prefetched next tiles and
    # the dscale / doffset accumulators all live in registers. At 16 warps that
    # is about one program per SM; two per SM (when they fit) overlap each
    # other's reductions, and when they do not, 2 * 132 programs run as two
    # waves of equal length.
    num_warps = _warps_for(block_rows * block_d, 16)
    # The forward's statistics, prefetched with the tiles: LayerNorm's row sums
    # then take one round of reductions instead of two. Measured on the H200
    # (tools/tune.py --grid, 32768 rows, forward+backward, recomputing ->
    # reading): LayerNorm 0.154 -> 0.131 ms at D 1024, 0.492 -> 0.373 at 4096,
    # 0.820 -> 0.744 at 8192; RMSNorm 0.108 -> 0.105, 0.362 -> 0.352, 0.703 ->
    # 0.695 (notes/MEASUREMENTS.md, session 14).
    return LayerNormVjpConfig(block_rows=block_rows, block_d=block_d,
                              num_warps=num_warps,
                              num_programs=_bwd_programs(num_warps, 1),
                              num_stages=1, prefetch=True, saved_stats=True)

  def search_space(self, args):
    r, d = args.x.shape
    base = self.heuristic_config(args)
    configs = [base]
    if base.block_d >= d:
      configs.append(dataclasses.replace(base, saved_stats=not base.saved_stats))
      # (rows x, warps x, waves, prefetch, num_stages) around the heuristic.
      # num_stages=2 tells whether Triton pipelines these dot-free loops itself.
      for rows_x, warps_x, waves, prefetch, stages in (
          (1, 1, 0.5, True, 1), (1, 1, 1, False, 1), (1, 1, 2, False, 1),
          (1, 2, 1, True, 1), (1, 2, 2, False, 1), (1, 0.5, 1, True, 1),
          (2, 1, 1, False, 1), (2, 2, 1, True, 1), (2, 2, 2, False, 1),
          (1, 1, 1, True, 2), (1, 1, 1, False, 2)):
        block_rows = min(base.block_rows * rows_x,
                         max(base.block_rows, _common.next_power_of_2(r)))
        num_warps = max(1, min(32, int(base.num_warps * warps_x)))
        configs.append(LayerNormVjpConfig(
            block_rows, base.block_d, num_warps, _bwd_programs(num_warps, waves),
            stages, prefetch, base.saved_stats))
    else:
      for block_d in (2048, 4096, _MAX_BLOCK_D_BWD):
        block_rows = _row_block(r, block_d)
        for num_warps in (8, 16):
          for waves in (1, 2):
            configs.append(LayerNormVjpConfig(block_rows, block_d, num_warps,
                                              _bwd_programs(num_warps, waves), 1,
                                              False))
    return list(dict.fromkeys(configs))[:13]

  def backward(self, args, residuals, out, dout, config):
    del out
    _check_config(config)
    residuals = residuals or {}
    saved = "mean" in residuals and "rstd" in residuals
    if config.block_d >= args.x.shape[1]:
      stats = ((residuals["mean"], residuals["rstd"])
               if saved and config.saved_stats else None)
      return _backward_rows(args, dout, config, stats)
    if saved:
      mean, rstd = residuals["mean"], residuals["rstd"]
    else:
      mean, rstd = _stats(args)
    return _backward_wide(args, mean.astype(jnp.float32), rstd.astype(jnp.float32),
                          dout, config)


def _bwd_programs(num_warps: int, waves: float) -> int:
  """`waves` times the programs resident at once, if registers allow two per SM.

  The dscale accumulator alone is block_d floats per program, so registers, not
  warps, bound residency: two 16-warp programs per SM at most, one at 32 warps.
  """
  return int(_NUM_SMS * waves * (1 if num_warps >= 32 else 2))
