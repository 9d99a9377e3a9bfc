"""The fp8 grouped matmul with block scales (ragged_dot's forward on quantized
operands) in Pallas Mosaic GPU.

``out[i] = sum_s (lhs[i, s] @ rhs[g(i)][s, :]) * lhs_scale[i, s] * rhs_scale[g, s, :]``
over K steps ``s`` of 128: one lhs scale per row and one rhs scale per column
cover a step (DeepSeek-V3's 1x128 activation tiles and 128x128 weight blocks;
any tiles whose K extent is a multiple of 128 are expanded to that).

The schedule is `ragged_dot_kernel`'s (row tiles that follow the groups, a
persistent grid, a memory warpgroup streaming the tiles by TMA, two compute
warpgroups of 64 rows each), with two changes that fp8 imposes:

- wgmma takes 8-bit operands only K-major, so rhs is streamed as ``[N, K]``
  tiles, as the dlhs kernel reads them: `grouped_matmul_fp8` transposes the
  weights to ``[G, N, K]``. Weights stored that way (``tokamax.quantize(...,
  minor_axis=1)``) arrive as the transpose of their stored values, which XLA
  cancels against this one: no pass over the weights. Other weights pay a
  transpose per call (0.35 ms of 1.73 at M16384 K2048 N16384 G16 on the H200,
  notes/MEASUREMENTS.md);
- Hopper's fp8 wgmma accumulates with reduced precision, so each 128-deep step
  is accumulated alone (a fresh wgmma accumulator) and promoted: multiplied by
  its row and column scales and added to a float32 total in registers. The
  scales travel with the operand tiles in the same pipeline (lhs scales as
  ``[K/128, M]`` rows, rhs scales as rows of ``[G, K/128, N]`` or of one
  scale per 128-column block) and are read while the step's wgmma runs.

A block's tile is ``128 x 2 block_n``: 128 output columns (``block_n=64``)
or 256 (``block_n=128``, wide). A compute warpgroup's wgmma covers at most
`HALF_N` columns: a wide tile runs two per step, one per 128-column half, each
into a fresh ``64 x 128`` float32 accumulator, promoted into its half of the
total before the next is issued (`_ScaledGroupTiles.wgmma_after`). So a warpgroup holds the total (128
registers a thread at 256 columns) and one accumulator (64), within the 232
that ptxas gives a compute warpgroup between instructions
(notes/MOSAIC_GPU.md, session 45). (Session 12's wide tiles, one accumulator
of all 256 columns next to the total, spilled and ran 2.3-3.0x slower on the
H200.) A wide tile reads 48 KiB from L2 per 8.4 MFLOP step against the narrow
tile's 32 KiB per 4.2.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tokamax_gpu_mosaic import _common
from tokamax_gpu_mosaic import _pipeline
from tokamax_gpu_mosaic import ragged_dot_kernel as rdk

SCALE_K = 128  # K per pipeline step: one scale per row and per column covers it
HALF_N = 128  # columns of one wgmma (and of one streamed column-block scale)
# A step's rhs scale of a 128-column block, streamed repeated to 128 bytes: a
# pipeline copy moves a multiple of the warpgroup's 128 threads in bytes.
BLOCK_SCALE_WIDTH = 32
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def check_config(config: rdk.RaggedDotConfig) -> None:
  """The tilings the fp8 kernel runs (ValueError naming what is not)."""
  if config.block_k != SCALE_K:
    # Two scale steps per pipeline step (block_k 256) measured 1.8x slower on the
    # H200 (notes/MEASUREMENTS.md, session 11).
    raise ValueError(f"the fp8 kernel takes block_k={SCALE_K} (one scale step); got "
                     f"{config.block_k}")
  if config.row_tiling != "group" or config.block_m != 128:
    raise ValueError("the fp8 kernel takes row_tiling='group' and block_m=128; got "
                     f"{config.row_tiling!r}, {config.block_m}")
  if config.block_n not in (64, 128):
    raise ValueError("the fp8 kernel takes block_n 64 or 128 (tiles of 128 or 256 "
                     f"columns); got {config.block_n}")
  if config.block_n == 128 and config.out_pieces != 2:
    raise ValueError("the fp8 kernel's 256-column tiles take out_pieces=2 (each "
                     "128-column half stored from its own total); got "
                     f"out_pieces={config.out_pieces}")


def smem_bytes(config: rdk.RaggedDotConfig, out_itemsize: int) -> int:
  """Shared memory: the operand ring (1-byte values), the scales' ring (per
  column, the most it streams), the staged output."""
  n = rdk.cta_n(config)
  scales = config.num_stages * (config.block_m + n) * 4
  return rdk.smem_bytes(config, 1, out_itemsize) + scales


def fits(config: rdk.RaggedDotConfig, out_itemsize: int) -> bool:
  return smem_bytes(config, out_itemsize) <= _common.SMEM_LIMIT


def scales_per_step(scales, shape, k_axis: int, what: str, keep_axis=None):
  """Block scales of an operand of `shape` (one per tile, ``tile = shape //
  scales.shape``) as one per 128-deep K step along K and one per element along
  every other axis but `keep_axis` (left at its tiles).

  Raises NotImplementedError where a K tile is not a multiple of 128 (a step
  would need two scales).
  """
  tile = [d // s for d, s in zip(shape, scales.shape)]
  if tile[k_axis] % SCALE_K:
    raise NotImplementedError(
        f"mosaic_gpu's fp8 kernel applies one scale per {SCALE_K}-deep K step; the "
        f"{what} scales cover K in tiles of {tile[k_axis]}")
  for axis, t in enumerate(tile):
    repeat = t // SCALE_K if axis == k_axis else (1 if axis == keep_axis else t)
    if repeat > 1:
      scales = jnp.repeat(scales, repeat, axis=axis)
  return scales.astype(jnp.float32)


def _column_scales(rhs_scales, n: int, block: int):
  """rhs scales ``[G, steps, N / tile_n]`` as the kernel streams them, and
  whether one covers each `block` columns a wgmma computes (``col_block``):
  per `block`-column block, repeated to `BLOCK_SCALE_WIDTH`, where ``tile_n``
  is a multiple of `block`; else per column."""
  tile_n = n // rhs_scales.shape[2]
  if tile_n % block == 0:
    per_block = jnp.repeat(rhs_scales, tile_n // block, axis=2)
    return jnp.repeat(per_block, BLOCK_SCALE_WIDTH, axis=2), True
  return jnp.repeat(rhs_scales, tile_n, axis=2), False


@dataclasses.dataclass(frozen=True)
class _ScaledGroupTiles(rdk._GroupTiles):  # pylint: disable=protected-access
  """`rdk._GroupTiles` streaming the step's scales with the operand tiles and
  promoting every K step's wgmma results into float32 totals.

  Each step issues, for each 128-column half of the tile (`halves`: one or
  two), its wgmma into a fresh accumulator, reads the scales while it runs,
  waits for it and adds the product times the scales to the half's total (a
  warpgroup without rows in the item skips the second half's wgmma and adds
  a stand-in: it stores nothing, `wgmma_after`).
  ``col_block``: one rhs scale per step covers a half's 128 columns (rhs
  scales over blocks of a multiple of 128 columns, DeepSeek-V3's 128x128), so
  a row's scale is the product of two scalars; otherwise (narrower rhs blocks,
  e.g. per channel) each column has its own.

  (Promoting the previous step's product under this step's wgmma instead needs
  a third float32 tile and a copy of the accumulator per step: 1.17x slower at
  G16 on the H200, notes/MEASUREMENTS.md, session 12.)
  """

  col_block: bool

  @property
  def halves(self):
    return self.cta_n // HALF_N

  def operand_blocks(self, item, operands):
    lhs_ref, rhs_ref, lhs_scales_ref, rhs_scales_ref = operands
    a, b = super().operand_blocks(item, (lhs_ref, rhs_ref))
    if self.col_block:
      cols = pl.ds(item.n0 // HALF_N * BLOCK_SCALE_WIDTH,
                   self.halves * BLOCK_SCALE_WIDTH)
    else:
      cols = pl.ds(item.n0, self.cta_n)
    return (a, b, lhs_scales_ref.at[:, pl.ds(item.row0, self.bm)],
            rhs_scales_ref.at[item.group, :, cols])

  def wgmma_step(self, item, a_smem, b_smem, while_running):
    """The product of this warpgroup's rows and the ``[128, K step]`` rhs
    half `b_smem` in a fresh accumulator, and `while_running()` traced between
    the wgmma's issue and the wait for it.

    The wgmma is issued whether or not the warpgroup has rows in the item
    (one without multiplies rows it never stores): with the accumulator's
    zeros reaching the wgmma on every path, ptxas issues its first MMA without
    reading the accumulator (``RZ, !UPT``) and writes no zeros a step (31
    register-pair zeroings a warp fewer: 1.8-2.6% faster on the H200,
    notes/MEASUREMENTS.md, session 47)."""
    rows = self.half

    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((rows, HALF_N), jnp.float32))
    def step(acc_ref):
      plgpu.wgmma(acc_ref, a_smem.at[pl.ds(item.cwg * rows, rows)],
                  b_smem.transpose((1, 0)))
      overlapped = while_running()
      return overlapped, acc_ref[...]  # the load waits for the wgmma
    return step

  def wgmma_after(self, item, a_smem, b_smem, after, stand_in):
    """`wgmma_step`'s product, issued only once `after` is computed; a
    warpgroup without rows takes `stand_in` instead (it stores nothing).

    The second half passes the first half's new total and its product as the
    stand-in. Otherwise the compiler sinks that promotion below the second
    wgmma, four 64 x 128 float32 tiles are live at once (256 registers a
    thread) and ptxas spills (388-400 bytes; 20 with the order kept, in the
    group and the snake order alike: tools/sm90_compile.py,
    notes/MEASUREMENTS.md, sessions 46-47). The order is a branch: whether the
    warpgroup has rows leaves an optimization barrier together with `after`,
    so LLVM computes `after` before branching, and ptxas does not hoist a
    wgmma out of a conditional block. The stand-in, registers already
    written, gives the other path nothing to compute: with zeros there, ptxas
    wrote them before the branch on both paths. (Before: zeros made opaque by
    a select on a run-time value, 64 selects a step, 2.4-3.6% slower on the
    H200 than by an optimization barrier, 32 register-pair zeroings, which
    was 3.2-5.2% slower than this branch; session 47.) (The interpreter has no
    order to keep.)"""
    if _common.interpreting():
      return self.wgmma_step(item, a_smem, b_smem, lambda: None)[1]
    _, has_rows = lax.optimization_barrier(
        (after, (item.whi > item.wlo).astype(jnp.int32)))
    return lax.cond(has_rows > 0,
                    lambda: self.wgmma_step(item, a_smem, b_smem, lambda: None)[1],
                    lambda: stand_in)

  def row_scales(self, item, a_scales):
    """This warpgroup's 64 row scales of the step, read with static offsets (one
    load per warpgroup, the other's discarded)."""
    rows, layout = self.half, plgpu.Layout.WGMMA.reduce(1)
    return jnp.where(
        item.cwg == 0,
        _common.load(a_scales.at[0, pl.ds(0, rows)], layout=layout),
        _common.load(a_scales.at[0, pl.ds(rows, rows)], layout=layout))

  def column_scales(self, b_scales, h):
    """Half `h`'s rhs scales of the step: its column block's (a scalar,
    ``col_block``) or one per column."""
    if self.col_block:
      return b_scales[0, h * BLOCK_SCALE_WIDTH]
    return _common.load(b_scales.at[0, pl.ds(h * HALF_N, HALF_N)],
                        layout=plgpu.Layout.WGMMA.reduce(0))

  def mma(self, item, _, a_smem, b_smem, a_scales, b_scales, totals):
    """One K step: `totals` (one per half) plus the step's scaled products.
    The row scales and the first half's column scales are read while the
    first wgmma runs; the second half's before its wgmma (`wgmma_after`)."""
    shape = (self.half, HALF_N)
    (rows, cols), acc = self.wgmma_step(
        item, a_smem, b_smem.at[pl.ds(0, HALF_N)],
        lambda: (self.row_scales(item, a_scales), self.column_scales(b_scales, 0)))
    new_totals = []
    for h in range(self.halves):
      if h:
        cols = self.column_scales(b_scales, h)
        acc = self.wgmma_after(item, a_smem, b_smem.at[pl.ds(h * HALF_N, HALF_N)],
                               after=new_totals[-1], stand_in=acc)
      if self.col_block:
        product = acc * lax.broadcast_in_dim(rows * cols, shape, [0])
      else:
        product = (acc * lax.broadcast_in_dim(rows, shape, [0])
                   * lax.broadcast_in_dim(cols, shape, [1]))
      new_totals.append(totals[h] + product)
    return tuple(new_totals)

  def context(self, item, out_ref, out_smem, allocs, eval_pipeline):
    zeros = _pipeline.zeros_tile((self.half, HALF_N), jnp.float32)
    totals = eval_pipeline((zeros,) * self.halves)
    self.finish_loop(allocs)  # nothing while this kernel's ring is unchained
    if self.halves == 1:
      self.store_acc(item, out_ref, out_smem, totals[0])
    else:
      # One piece per half (`check_config`): each converted from its total.
      self.store_tile(item, out_ref, out_smem,
                      lambda p: totals[p].astype(self.out_dtype))


def _pipeline_of(config: rdk.RaggedDotConfig, dtype, col_block: bool):
  """The K loop: lhs ``[block_m, 128]`` and rhs ``[cta_n, 128]`` fp8 tiles
  (swizzled), and the step's lhs scales and rhs scales (one per column, or
  the column block's, repeated)."""
  bm, n = config.block_m, rdk.cta_n(config)
  n_scales = n // HALF_N * BLOCK_SCALE_WIDTH if col_block else n
  step = lambda ki: (0, ki)
  # Every step waits for its wgmmas (to promote them) and reads its scales, so
  # its slot is free when the step ends: released then (no delay_release), the
  # ring holds one more step ahead. 7.5-10.6% faster than releasing one step
  # late as the bf16 kernel must (notes/MEASUREMENTS.md, session 47).
  specs = (
      _pipeline.tma_spec((bm, SCALE_K), step, dtype, SCALE_K, delay_release=0),
      _pipeline.tma_spec((n, SCALE_K), step, dtype, SCALE_K, delay_release=0),
      plgpu.BlockSpec((1, bm), lambda ki: (ki, 0)),
      plgpu.BlockSpec((1, n_scales), lambda ki: (ki, 0)),
  )
  return _pipeline.WarpSpecializedPipeline(specs, config.num_stages)


def grouped_matmul_fp8(lhs, lhs_scales, rhs, rhs_scales, starts, ends, *, out_dtype,
                       config: rdk.RaggedDotConfig) -> jax.Array:
  """``out[i] = (lhs * scales)[i] @ (rhs * scales)[g]`` for rows ``[starts[g],
  ends[g])``, else 0, applying the scales per 128-deep K step in float32.

  Args:
    lhs: ``[M, K]`` float8 values.
    lhs_scales: float32 ``[M, K / 128]``: one scale per row and K step.
    rhs: ``[G, K, N]`` float8 values (the same float8 type as lhs).
    rhs_scales: float32 ``[G, K / 128, N / tile_n]``: one scale per K step and
      block of ``tile_n`` columns (a multiple of 128 is the fast case).
  """
  check_config(config)
  if not fits(config, jnp.dtype(out_dtype).itemsize):
    raise ValueError(f"ragged_dot fp8: {config} needs "
                     f"{smem_bytes(config, jnp.dtype(out_dtype).itemsize)} bytes of "
                     f"shared memory; the limit is {_common.SMEM_LIMIT}")
  m_orig, k = lhs.shape
  n_orig = rhs.shape[2]
  if k % SCALE_K:
    raise ValueError(f"K={k} must be a multiple of {SCALE_K} (scales per K step)")
  n_cta = rdk.cta_n(config)
  # wgmma reads 8-bit operands only K-major: the weights as [G, N, K].
  rhs_t = jnp.swapaxes(rhs, 1, 2)
  # At least two K steps (a one-step pipeline crashed, `rdk._pad_operands`);
  # the padded steps hold zero values and zero scales.
  k_pad = max(k, 2 * SCALE_K)
  lhs = rdk.pad_to_multiple(_common.pad_axis(lhs, 1, k_pad), 0, 8, config.block_m)
  rhs_t = rdk.pad_to_multiple(_common.pad_axis(rhs_t, 2, k_pad), 1, rdk.COLS, n_cta)
  m = lhs.shape[0]
  n = rhs_t.shape[1]
  steps = k_pad // SCALE_K
  lhs_scales_t = _common.pad_axis(
      _common.pad_axis(lhs_scales.T, 0, steps), 1, m)  # [steps, M]
  n_tiles = pl.cdiv(n, n_cta)
  rhs_scales, col_block = _column_scales(rhs_scales, n_orig, HALF_N)
  rhs_scales = _common.pad_axis(rhs_scales, 1, steps)
  # Whole column tiles of scales (the last tile's columns may pass N).
  per_tile = n_cta // HALF_N * BLOCK_SCALE_WIDTH if col_block else n_cta
  rhs_scales = _common.pad_axis(rhs_scales, 2, n_tiles * per_tile)
  items = rdk.work_items(starts, ends, m, config.block_m)
  num_items = items.shape[0]
  items = rdk.item_table(items, n_tiles, config)
  tiles = _ScaledGroupTiles(
      config=config, transpose_rhs=True, out_dtype=out_dtype, num_items=num_items,
      n_tiles=n_tiles, k_steps=steps, col_block=col_block,
      pipeline=_pipeline_of(config, lhs.dtype, col_block))
  n_out = n_tiles * n_cta  # whole column tiles (see `rdk._group_tiles`)
  call = tiles.persistent_call(
      lambda t: t.kernel, out_type=jax.ShapeDtypeStruct((m, n_out), out_dtype))
  out = call(items, lhs, rhs_t, lhs_scales_t, rhs_scales)
  return out[:m_orig, :n_orig]
