"""Grouped matmul (`tokamax.ragged_dot`, the MoE expert matmul) in Pallas Mosaic GPU.

Forward: ``out[i] = lhs[i] @ rhs[g(i) - group_offset]`` on Hopper (sm_90).

Kernel shape: a persistent grid (one block per SM) whose blocks walk work items
(a row tile x ``2 * block_n`` columns) in a planar-snake order. Each block has
three warpgroups: a memory warpgroup that streams the lhs tile and the rhs tile
through a ``num_stages``-deep ring of swizzled shared-memory buffers with TMA,
and two compute warpgroups that issue wgmma with float32 accumulators in
registers (`plgpu.emit_pipeline_warp_specialized`).

Groups (``row_tiling="group"``, the default): row tiles follow the groups. A
table computed with jnp outside the kernel (`_work_items`) cuts each held group's
rows into tiles of ``block_m = 128`` rows starting at the group's first row
rounded down to 8 (swizzled TMA reads rows in 8-row units), so every tile
multiplies by one group's weights and a group wastes less than a tile. The two
compute warpgroups own 64 rows each; one whose rows all lie outside the group
skips its wgmma. Each warpgroup writes only the rows it owns: a whole aligned
64-row tile with one TMA store from swizzled shared memory, a partial one from
unswizzled shared memory in power-of-two row chunks. Rows no held group owns
(past ``sum(group_sizes)``, or of groups rhs does not hold) get zero-only items,
so every output row is written exactly once, and no atomics are needed.
``row_tiling="fixed"`` keeps fixed 128-row tiles and runs one K pipeline per
group meeting the tile, merging rows in shared memory (1.5x the work at 256
random groups; kept for comparison).

Output staging (``out_pieces``): each compute warpgroup stages its ``[64,
2 * block_n]`` tile in shared memory for the TMA store, whole (1) or in two
column pieces (2) that reuse one half-size buffer, the second written once the
first's store has read it. Two pieces free 32 KiB at ``block_n=128``: room for
a 4th pipeline stage (4 x 48 + 2 x 16 KiB + barriers = 225 KiB of 227).

Weight reuse (the forward's default for groups of >= 512 rows on average; in the
search space otherwise): ``block_m=256`` items are 256
rows x ``block_n`` columns, each compute warpgroup 128 rows in two 64-row wgmma
halves (one accumulator), so a group of up to ~256 rows streams each weight tile
once; ``item_order="group"`` writes the (row tile, column tile) order into the
work-item table (`_ordered_items`) so a group's row tiles of one column tile run
at neighbouring linear indices, i.e. together on neighbouring SMs (L2 sharing).

Reads past the array edges are zero-filled by TMA; the arrays are zero-padded
only where shapes are not multiples of the swizzle (8 rows, 64 columns).

Backward: ``dlhs = ragged_dot(dout, rhs^T)`` is the same kernel reading rhs
tiles as ``[n, k]`` (wgmma takes the transposed shared-memory operand).
``drhs[g] = lhs[rows_g]^T @ dout[rows_g]`` is `grouped_transposed_matmul`: a
per-group contraction over the group's rows, either the forward's
warp-specialized shape with a per-item dynamic pipeline length (``"ws"``, the
default, `_drhs_warp_specialized`) or a hand-rolled TMA ring in one warpgroup
(``drhs_kernel="ring"``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import tokamax
from tokamax import Op, VjpOp
from tokamax_gpu_mosaic import _common

_WGMMA_M = 64  # wgmma's row granularity per warpgroup.
_COLS = 64  # Minor dimensions are padded to this (the 128-byte swizzle's width).


@dataclasses.dataclass(frozen=True)
class RaggedDotConfig:
  """Tiling of the grouped matmul.

  A block computes ``block_m x (2 * block_n)`` of the output (two compute
  warpgroups, ``block_n`` columns each), ``block_k`` of the contraction per
  pipeline step, with ``num_stages`` steps in flight. ``grid_tile_width``: how
  many column tiles a band of the snake order spans (L2 reuse of lhs rows).
  ``out_pieces``: the output tile is staged in shared memory whole (1) or in
  two column pieces (2, half the staging memory; ``row_tiling="group"``).
  ``drhs_kernel`` (backward only): "ring" or "ws", see
  `grouped_transposed_matmul`; "ws" runs ``block_k=64`` and the stages that fit
  (`drhs_ws_config`).

  ``row_tiling="group"`` with ``block_m=256`` ("tall" items): a block computes
  ``256 x block_n`` (not ``128 x 2 block_n``), each compute warpgroup 128 rows
  in two 64-row wgmma halves into one ``[128, block_n]`` accumulator, a half
  skipped when its rows lie outside the group; a group of up to ~256 rows then
  streams each weight tile once instead of 2-3 times.
  ``item_order``: "snake" walks (row tile, column tile) with `plgpu.planar_snake`;
  "group" writes the order into the work-item table: per group, bands of
  ``grid_tile_width`` row tiles, and within a band the row tiles of one column
  tile are consecutive linear indices (neighbouring SMs run them together and
  share the weight tile's k-slices through L2), column tiles snaking between
  bands.
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  num_stages: int = 3
  grid_tile_width: int = 8
  row_tiling: str = "group"
  out_pieces: int = 1
  drhs_kernel: str = "ring"
  item_order: str = "snake"

  def __post_init__(self):
    if self.block_m % _WGMMA_M or self.block_m > 256:
      raise ValueError(f"block_m must be 64, 128, 192 or 256; got {self.block_m}")
    if self.block_n % 64 or self.block_n > 256:
      raise ValueError(f"block_n must be a multiple of 64 up to 256; got {self.block_n}")
    if self.block_k not in (32, 64, 128):
      raise ValueError(f"block_k must be 32, 64 or 128; got {self.block_k}")
    if self.num_stages < 2 or self.grid_tile_width < 1:
      raise ValueError(f"num_stages >= 2 and grid_tile_width >= 1: {self}")
    if self.row_tiling not in ("group", "fixed"):
      raise ValueError(f"row_tiling must be 'group' or 'fixed'; got {self.row_tiling}")
    if self.row_tiling == "group" and self.block_m not in (128, 256):
      raise ValueError("row_tiling='group' takes block_m=128 (64 rows per "
                       "compute warpgroup) or 256 (128 rows per warpgroup); "
                       f"got {self.block_m}")
    if self.row_tiling == "group" and self.block_m == 256 and self.block_n > 128:
      # Each warpgroup's [128, block_n] f32 accumulator: block_n registers per
      # thread (of 232 for the compute warpgroups).
      raise ValueError(f"block_m=256 takes block_n <= 128; got {self.block_n}")
    if self.item_order not in ("snake", "group"):
      raise ValueError(f"item_order must be 'snake' or 'group'; got {self.item_order}")
    if self.item_order == "group" and self.row_tiling != "group":
      raise ValueError("item_order='group' needs row_tiling='group'")
    if self.out_pieces not in (1, 2):
      raise ValueError(f"out_pieces must be 1 or 2; got {self.out_pieces}")
    if self.out_pieces == 2 and self.row_tiling != "group":
      raise ValueError("out_pieces=2 needs row_tiling='group'")
    cta_n = _cta_n(self)
    if self.out_pieces == 2 and cta_n // 2 < 64:
      # A piece narrower than the 128-byte swizzle: the H200 run of such a
      # config (256 x 64 items) failed with a misaligned address.
      raise ValueError(f"out_pieces=2 needs output pieces of >= 64 columns; "
                       f"items of {cta_n} columns make {cta_n // 2}")
    if self.drhs_kernel not in ("ring", "ws"):
      raise ValueError(f"drhs_kernel must be 'ring' or 'ws'; got {self.drhs_kernel}")
    if self.drhs_kernel == "ws":
      # Each compute warpgroup of the "ws" drhs kernel holds a [128, block_n]
      # float32 tile (block_n registers per thread) and stages it in
      # `out_pieces` column pieces of block_n / out_pieces.
      if self.block_n > 128:
        raise ValueError(f"drhs_kernel='ws' takes block_n <= 128 (its float32 tile "
                         f"needs block_n registers per thread); got {self.block_n}")
      if self.block_n // self.out_pieces < 64:
        raise ValueError(f"drhs_kernel='ws' with out_pieces={self.out_pieces} needs "
                         f"block_n >= {64 * self.out_pieces}; got {self.block_n}")


def smem_bytes(config: RaggedDotConfig, itemsize: int, out_itemsize: int) -> int:
  """Shared memory of the warp-specialized kernels (the forward/dlhs kernel, and
  the ``drhs_kernel="ws"`` contraction, whose stage holds 128 lhs columns where
  the forward holds 128 lhs rows: the same bytes)."""
  cta_n = _cta_n(config)
  stage = (config.block_m * config.block_k + config.block_k * cta_n) * itemsize
  out = config.block_m * cta_n * out_itemsize // config.out_pieces
  return config.num_stages * stage + out + 1024  # + barriers, alignment


def _cta_n(config: RaggedDotConfig) -> int:
  """Output columns of one block: ``2 * block_n``, or ``block_n`` for tall
  (``block_m=256``) group items, whose warpgroups split rows, not columns."""
  if config.row_tiling == "group" and config.block_m == 256:
    return config.block_n
  return 2 * config.block_n


def _check_fits(config: RaggedDotConfig, itemsize: int, out_itemsize: int,
                what: str) -> None:
  need = smem_bytes(config, itemsize, out_itemsize)
  if need > _common.SMEM_LIMIT:
    raise ValueError(
        f"{what}: {config} needs {need} bytes of shared memory with "
        f"{itemsize}-byte operands and {out_itemsize}-byte outputs; the limit is "
        f"{_common.SMEM_LIMIT} (fewer num_stages, out_pieces=2, or a smaller "
        "block_n)")


# ----------------------------------------------------------------------------
# Group tables (plain jnp, outside the kernel).


def _tile_groups(starts, ends, m: int, block_m: int):
  """Per m-tile, the first and last held group meeting it, int32 ``[tiles, 2]``.

  ``first > last`` when none does. The first group is never empty: the kernel's
  first visit of a tile is the one that zeroes the rows no group owns, so an empty
  group (which it skips) must not take that role. Empty groups can sit at a
  tile's start when the held groups begin mid-sequence (``group_offset``).
  """
  num_tiles = pl.cdiv(m, block_m)
  num_held = starts.shape[0]
  lo = jnp.arange(num_tiles, dtype=jnp.int32) * block_m
  hi = lo + block_m
  first = jnp.searchsorted(ends, lo, side="right").astype(jnp.int32)
  # Move past empty groups: the next non-empty group at or after `first`.
  index = jnp.arange(num_held, dtype=jnp.int32)
  nonempty_at = jnp.where(ends > starts, index, num_held)
  next_nonempty = lax.cummin(nonempty_at, reverse=True)
  first = jnp.where(first < num_held,
                    next_nonempty[jnp.minimum(first, num_held - 1)], num_held)
  last = (jnp.searchsorted(starts, hi, side="left") - 1).astype(jnp.int32)
  none = (first > last) | (first >= starts.shape[0])
  first = jnp.where(none, 1, first)
  last = jnp.where(none, 0, last)
  return jnp.stack([first, last], axis=1)


_ROW0, _GROUP, _LO, _HI = range(4)  # Columns of the work-item table.


def _work_items(starts, ends, m: int, block_m: int):
  """Row tiles that follow the groups, int32 ``[cdiv(m, block_m) + G + 2, 4]``.

  Each held group's rows ``[s, e)`` are cut into tiles of `block_m` rows starting
  at ``s`` rounded down to 8 (TMA reads swizzled tiles at 8-row granularity), so a
  group wastes less than one tile of work, not one tile per boundary it shares.
  Rows no held group owns (before the first, after the last held group) get
  zero-only items. Per item: the first row, the rhs group (-1: zeros), and the
  rows ``[lo, hi)`` of the tile it owns; items past the end own nothing.
  """
  num_held = starts.shape[0]
  num = pl.cdiv(m, block_m) + num_held + 2
  first = starts - starts % 8
  tiles = jnp.where(ends > starts, (ends - first + block_m - 1) // block_m, 0)
  cum = jnp.cumsum(tiles)
  num_group_items = cum[-1]
  i = jnp.arange(num, dtype=jnp.int32)
  g = jnp.minimum(jnp.searchsorted(cum, i, side="right"), num_held - 1)
  g = g.astype(jnp.int32)
  row_g = first[g] + (i - (cum[g] - tiles[g])) * block_m
  lo_g = jnp.maximum(starts[g] - row_g, 0)
  hi_g = jnp.minimum(ends[g] - row_g, block_m)
  # Zero items: [0, held_lo) then [held_hi, m) in tiles of block_m rows.
  held_lo, held_hi = starts[0], ends[-1]
  held_hi = jnp.maximum(held_hi, held_lo)
  below = (held_lo + block_m - 1) // block_m
  above = (m - held_hi + block_m - 1) // block_m
  z = i - num_group_items
  row_z = jnp.where(z < below, z * block_m, held_hi + (z - below) * block_m)
  end_z = jnp.where(z < below, held_lo, m)
  is_z = (z >= 0) & (z < below + above)
  is_g = i < num_group_items
  row = jnp.where(is_g, row_g, jnp.where(is_z, row_z, 0))
  group = jnp.where(is_g, g, -1)
  lo = jnp.where(is_g, lo_g, 0)
  hi = jnp.where(is_g, hi_g, jnp.where(is_z, jnp.minimum(end_z - row_z, block_m), 0))
  return jnp.stack([row, group, lo, hi], axis=1).astype(jnp.int32)


_NI = 4  # Column of `_ordered_items`: the item's column tile.


def _ordered_items(items, n_tiles: int, width: int):
  """`_work_items` x column tiles in "group" order, int32 ``[items * n_tiles, 5]``.

  Row ``L`` of the result is the work item the kernel's linear index ``L`` runs
  (the `_work_items` columns, then the column tile). A run is the row tiles of
  one group (a zero or past-the-end item is a run of its own); each run is cut
  into bands of at most `width` row tiles; a band of ``b`` row tiles takes the
  ``b * n_tiles`` consecutive indices from ``band_start * n_tiles``, column
  tile by column tile with the band's row tiles fastest. Neighbouring indices
  run at the same time on neighbouring SMs (the persistent grid deals them out
  round robin), so a column tile's weights are read by the group's row tiles
  together (L2 hits) and the group's lhs rows stay hot across column tiles.
  Odd bands walk the column tiles backwards (their first column tile is the one
  the previous band ended on).
  """
  num = items.shape[0]
  i = jnp.arange(num, dtype=jnp.int32)
  group = items[:, _GROUP]
  prev = jnp.concatenate([jnp.full((1,), -2, jnp.int32), group[:-1]])
  new_run = (group != prev) | (group < 0)
  run_start = lax.cummax(jnp.where(new_run, i, 0))
  next_start = lax.cummin(jnp.where(new_run, i, num), reverse=True)
  run_end = jnp.concatenate([next_start[1:], jnp.full((1,), num, jnp.int32)])
  band = (i - run_start) // width
  band_start = run_start + band * width
  band_len = jnp.minimum(width, run_end - band_start)
  j = jnp.arange(n_tiles, dtype=jnp.int32)[None, :]  # position in the band
  linear = (band_start[:, None] * n_tiles + j * band_len[:, None]
            + (i - band_start)[:, None])
  ni = jnp.where(band[:, None] % 2 == 1, n_tiles - 1 - j, j)
  rows = jnp.concatenate(
      [jnp.broadcast_to(items[:, None, :], (num, n_tiles, 4)), ni[..., None]],
      axis=2)
  table = jnp.zeros((num * n_tiles, 5), jnp.int32)
  return table.at[linear.reshape(-1)].set(rows.reshape(-1, 5),
                                          unique_indices=True)


# ----------------------------------------------------------------------------
# Kernel.


def grouped_matmul(lhs, rhs, starts, ends, *, transpose_rhs: bool, out_dtype,
                   config: RaggedDotConfig) -> jax.Array:
  """``out[i] = lhs[i] @ op(rhs[g])`` for rows ``[starts[g], ends[g])``, else 0.

  ``op`` is the transpose when `transpose_rhs` (rhs is then ``[G, N, K]``).
  """
  if config.row_tiling == "fixed":
    return _grouped_matmul_fixed_tiles(lhs, rhs, starts, ends,
                                       transpose_rhs=transpose_rhs,
                                       out_dtype=out_dtype, config=config)
  return _grouped_matmul_group_tiles(lhs, rhs, starts, ends,
                                     transpose_rhs=transpose_rhs,
                                     out_dtype=out_dtype, config=config)


def _store_rows(y, lo, hi, dst_row, swizzled_smem, linear_smem, out_ref, cols):
  """Writes rows ``[lo, hi)`` of a warpgroup's ``[64 or 128, n]`` tile to ``out_ref``.

  A whole 8-row-aligned tile goes out in one TMA store from swizzled shared
  memory; a partial one through unswizzled shared memory in power-of-two row
  chunks (TMA boxes have static shapes; unswizzled, any row offset works), so
  rows other items own are never touched.
  """
  rows = y.shape[0]
  full = (lo == 0) & (hi == rows) & (dst_row % 8 == 0)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  @pl.when(full)
  def _full():
    swizzled_smem[...] = y
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(swizzled_smem,
                            out_ref.at[pl.ds(dst_row, rows), cols])

  @pl.when(~full & (hi > lo))
  def _partial():
    linear_smem[...] = y
    plgpu.commit_smem()
    count = hi - lo
    size = rows  # A whole tile at an unaligned row also goes this way.
    while size >= 1:
      offset = lo + (count & ~(2 * size - 1))

      @pl.when((count & size) != 0)
      def _chunk():
        plgpu.copy_smem_to_gmem(
            linear_smem.at[pl.ds(offset, size)],
            out_ref.at[pl.ds(dst_row + offset, size), cols])
      size //= 2


def _grouped_matmul_group_tiles(lhs, rhs, starts, ends, *, transpose_rhs: bool,
                                out_dtype, config: RaggedDotConfig) -> jax.Array:
  """`grouped_matmul` on row tiles that follow the groups (`_work_items`).

  The two compute warpgroups split the tile's rows (64 each, or 128 for
  ``block_m=256``) and share the rhs tile; a warpgroup skips the wgmma of each
  64-row half whose rows all lie outside the item's group.
  """
  m_orig = lhs.shape[0]
  n_orig = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  _check_fits(config, lhs.dtype.itemsize, jnp.dtype(out_dtype).itemsize,
              "ragged_dot grouped_matmul")
  bm, bk = config.block_m, config.block_k
  half = bm // 2  # A compute warpgroup's rows: 64, or 128 in two wgmma halves.
  subs = half // _WGMMA_M
  cta_n = _cta_n(config)
  pieces = config.out_pieces
  piece_n = cta_n // pieces
  lhs, rhs = _pad_operands(lhs, rhs, transpose_rhs, config)
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  items = _work_items(starts, ends, m, bm)
  num_items = items.shape[0]
  n_tiles, k_steps = pl.cdiv(n, cta_n), pl.cdiv(k, bk)
  dtype = lhs.dtype
  ordered = config.item_order == "group"
  if ordered:
    items = _ordered_items(items, n_tiles, config.grid_tile_width)

  lhs_spec = plgpu.BlockSpec((bm, bk), lambda ki: (0, ki),
                             transforms=_common.swizzled(dtype, bk),
                             delay_release=1)
  if transpose_rhs:
    rhs_spec = plgpu.BlockSpec((cta_n, bk), lambda ki: (0, ki),
                               transforms=_common.swizzled(dtype, bk),
                               delay_release=1)
  else:
    rhs_spec = plgpu.BlockSpec((bk, cta_n), lambda ki: (ki, 0),
                               transforms=_common.swizzled(dtype, bk),
                               delay_release=1)

  def make_pipeline(body, context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_steps,), memory_registers=40, in_specs=[lhs_spec, rhs_spec],
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=config.num_stages,
        compute_context=context)

  # Per compute warpgroup, its output tile (or one column piece of it, see
  # `store_tile`) as swizzled (whole tiles) or plain (partial tiles) shared
  # memory over the same bytes. One union per warpgroup: with one union of
  # [2, ...] views, one warpgroup's plain writes corrupted the other's swizzled
  # tile on the H200 (notes/MOSAIC_GPU.md).
  out_smem_types = [
      plgpu.RefUnion(
          plgpu.SMEM((half, piece_n), out_dtype,
                     transforms=_common.swizzled(out_dtype, piece_n)),
          plgpu.SMEM((half, piece_n), out_dtype))
      for _ in range(2)]

  def kernel(items_ref, lhs_ref, rhs_ref, out_ref):
    ignore = lambda *_, **__: None
    allocs = make_pipeline(ignore, ignore).get_allocations(lhs_ref, rhs_ref)

    @functools.partial(pl.run_scoped, allocs=allocs, out_smem=out_smem_types,
                       collective_axes="wg")
    def _scope(allocs, out_smem):
      wg = lax.axis_index("wg")
      cwg = jnp.minimum(wg, 1)

      def store_rows(y, lo, hi, dst_row, cols):
        for w, (swizzled_smem, linear_smem) in enumerate(out_smem):
          @pl.when(wg == w)
          def _store():
            _store_rows(y, lo, hi, dst_row, swizzled_smem, linear_smem, out_ref,
                        cols)

      def store_tile(piece_of, lo, hi, dst_row, n0):
        """Stores the warpgroup's ``[half, cta_n]`` tile, `pieces` column pieces
        one after the other through the same shared memory: `_store_rows` first
        waits until the previous piece's TMA store has read it. Two pieces
        halve the staging memory (room for one more pipeline stage)."""
        for p in range(pieces):
          store_rows(piece_of(p), lo, hi, dst_row,
                     pl.ds(n0 + p * piece_n, piece_n))

      @plgpu.nd_loop((num_items * n_tiles,), collective_axes="sm")
      def _item_loop(info):
        if ordered:
          ii = info.index[0]
          ni = items_ref[ii, _NI]
        else:
          ii, ni = plgpu.planar_snake(info.index[0], (num_items, n_tiles), 1,
                                      config.grid_tile_width)
        row0 = items_ref[ii, _ROW0]
        group = items_ref[ii, _GROUP]
        lo = items_ref[ii, _LO]
        hi = items_ref[ii, _HI]
        n0 = ni * cta_n
        cols = pl.ds(n0, cta_n)
        # This warpgroup's rows of the tile: [wlo, whi) of its `half`.
        wlo = jnp.clip(lo - cwg * half, 0, half)
        whi = jnp.clip(hi - cwg * half, 0, half)
        dst_row = row0 + cwg * half

        def mma(_, a_smem, b_smem, acc_ref):
          if transpose_rhs:
            b = plgpu.transpose_ref(b_smem, (1, 0))
          else:
            b = b_smem

          if subs == 1:
            @pl.when(whi > wlo)
            def _issue():
              plgpu.wgmma(acc_ref, a_smem.at[pl.ds(cwg * half, half)], b)
            plgpu.wgmma_wait(1)
            return acc_ref
          issue_halves(a_smem, b, acc_ref)
          return acc_ref

        def issue_halves(a_smem, b, acc_ref):
          """Tall items: the wgmma of each 64-row half of this warpgroup's
          128 rows that holds rows of the group."""
          active = [(jnp.minimum(whi, (h + 1) * _WGMMA_M)
                     > jnp.maximum(wlo, h * _WGMMA_M)) for h in range(subs)]
          for h in range(subs):
            @pl.when(active[h])
            def _issue():
              rows = pl.ds(h * _WGMMA_M, _WGMMA_M)
              plgpu.wgmma(acc_ref.at[rows],
                          a_smem.at[pl.ds(cwg * half + h * _WGMMA_M, _WGMMA_M)],
                          b)
          # Each wgmma call is one commit group. At the end of step s the
          # pipeline frees step s-1's buffers (delay_release=1), so all of
          # s-1's groups must be done: leave pending only this step's.
          both = active[0] & active[1]

          @pl.when(both)
          def _wait_two():
            plgpu.wgmma_wait(2)

          @pl.when(~both)
          def _wait_one():
            plgpu.wgmma_wait(1)

        def context(eval_pipeline):
          @functools.partial(pl.run_scoped,
                             acc_ref=plgpu.ACC((half, cta_n), jnp.float32))
          def _acc_scope(acc_ref):
            eval_pipeline(acc_ref)
            if pieces == 1:
              store_rows(acc_ref[...].astype(out_dtype), wlo, whi, dst_row, cols)
            else:
              # Converted piece by piece: only one piece's outputs live in
              # registers next to the accumulator. (Static column slices: the
              # load is the whole accumulator, sliced as a value; a pl.ds
              # slice becomes a dynamic_slice, which does not lower.)
              acc = acc_ref[...]
              store_tile(
                  lambda p: acc[:, p * piece_n:(p + 1) * piece_n].astype(
                      out_dtype), wlo, whi, dst_row, n0)

        @pl.when((group >= 0) & (hi > lo))
        def _matmul():
          if transpose_rhs:
            b_ref = rhs_ref.at[group, cols, :]
          else:
            b_ref = rhs_ref.at[group, :, cols]
          make_pipeline(mma, context)(lhs_ref.at[pl.ds(row0, bm), :], b_ref,
                                      allocations=allocs)

        @pl.when((group < 0) & (hi > lo) & (wg < 2))
        def _zeros():
          zeros = plgpu.broadcasted_iota(jnp.int32, (half, piece_n), 0,
                                         layout=plgpu.Layout.WGMMA)
          zeros = (zeros * 0).astype(out_dtype)
          store_tile(lambda p: zeros, wlo, whi, dst_row, n0)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  # The output gets whole column tiles: a TMA store from plain (unswizzled)
  # shared memory whose box crossed the last column did not clip there on the
  # H200 but wrapped into the next row's first columns (notes/MOSAIC_GPU.md).
  n_out = n_tiles * cta_n
  call = _common.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((m, n_out), out_dtype),
      grid=(_common.num_sms(),), grid_names=("sm",), num_threads=3,
      thread_name="wg", compiler_params=_common.compiler_params())
  out = call(items, lhs, rhs)
  if (m, n_out) != (m_orig, n_orig):
    out = out[:m_orig, :n_orig]
  return out


def _pad_axis(x, axis: int, multiple: int, minimum: int):
  """Zero-pads `x` along `axis` to a multiple of `multiple`, at least `minimum`.

  Swizzled TMA needs the array's tiled dimensions to be multiples of the SMEM
  tiling (8 rows, 64 columns of 16-bit elements); aligned shapes (the usual MoE
  case) are not copied.
  """
  size = max(-(-x.shape[axis] // multiple) * multiple, minimum)
  if x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad)


def _pad_operands(lhs, rhs, transpose_rhs: bool, config: RaggedDotConfig):
  """Pads M to 8 rows, K and N to 64 columns (and tiny ones to a block).

  K gets at least two pipeline steps: a one-step warp-specialized pipeline
  crashed on the H200 (CUDA_ERROR_LAUNCH_FAILED at K=64, notes/MOSAIC_GPU.md).
  """
  bm, bk, cta_n = config.block_m, config.block_k, _cta_n(config)
  lhs = _pad_axis(_pad_axis(lhs, 0, 8, bm), 1, _COLS, 2 * bk)
  k = lhs.shape[1]
  k_axis, n_axis = (2, 1) if transpose_rhs else (1, 2)
  rhs = _pad_axis(_pad_axis(rhs, k_axis, k, k), n_axis, _COLS, cta_n)
  return lhs, rhs


def _grouped_matmul_fixed_tiles(lhs, rhs, starts, ends, *, transpose_rhs: bool,
                                out_dtype, config: RaggedDotConfig) -> jax.Array:
  """`grouped_matmul` on fixed m-tiles, one K pipeline per group meeting a tile."""
  m_orig = lhs.shape[0]
  n_orig = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  cta_n = 2 * bn
  lhs, rhs = _pad_operands(lhs, rhs, transpose_rhs, config)
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  tiles = _tile_groups(starts, ends, m, bm)
  bounds = jnp.stack([starts, ends], axis=1)
  m_tiles, n_tiles, k_steps = pl.cdiv(m, bm), pl.cdiv(n, cta_n), pl.cdiv(k, bk)
  dtype = lhs.dtype

  lhs_spec = plgpu.BlockSpec((bm, bk), lambda ki: (0, ki),
                             transforms=_common.swizzled(dtype, bk),
                             delay_release=1)
  if transpose_rhs:
    rhs_spec = plgpu.BlockSpec((cta_n, bk), lambda ki: (0, ki),
                               transforms=_common.swizzled(dtype, bk),
                               delay_release=1)
  else:
    rhs_spec = plgpu.BlockSpec((bk, cta_n), lambda ki: (ki, 0),
                               transforms=_common.swizzled(dtype, bk),
                               delay_release=1)

  def make_pipeline(body, context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_steps,), memory_registers=40, in_specs=[lhs_spec, rhs_spec],
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=config.num_stages,
        compute_context=context)

  def kernel(tiles_ref, bounds_ref, lhs_ref, rhs_ref, out_ref):
    ignore = lambda *_, **__: None
    allocs = make_pipeline(ignore, ignore).get_allocations(lhs_ref, rhs_ref)

    @functools.partial(
        pl.run_scoped, allocs=allocs,
        out_smem=plgpu.SMEM((2, bm, bn), out_dtype,
                            transforms=_common.swizzled(out_dtype, bn)),
        collective_axes="wg")
    def _scope(allocs, out_smem):
      wg = lax.axis_index("wg")
      o_smem = out_smem.at[jnp.minimum(wg, 1)]

      @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
      def _tile_loop(info):
        mi, ni = plgpu.planar_snake(info.index[0], (m_tiles, n_tiles), 1,
                                    config.grid_tile_width)
        m0 = mi * bm
        n0 = ni * cta_n
        first = tiles_ref[mi, 0]
        last = tiles_ref[mi, 1]

        def visit(g, carry):
          start = bounds_ref[g, 0]
          end = bounds_ref[g, 1]

          def mma(_, a_smem, b_smem, acc_ref):
            cols = pl.ds(wg * bn, bn)
            if transpose_rhs:
              b = plgpu.transpose_ref(b_smem.at[cols], (1, 0))
            else:
              b = b_smem.at[:, cols]
            plgpu.wgmma(acc_ref, a_smem, b)
            plgpu.wgmma_wait(1)
            return acc_ref

          def context(eval_pipeline):
            @functools.partial(pl.run_scoped,
                               acc_ref=plgpu.ACC((bm, bn), jnp.float32))
            def _acc_scope(acc_ref):
              eval_pipeline(acc_ref)
              acc = acc_ref[...]
              rows = m0 + plgpu.broadcasted_iota(jnp.int32, (bm, bn), 0,
                                                 layout=plgpu.Layout.WGMMA)
              mine = (rows >= start) & (rows < end)
              # The previous tile's TMA store must have read the buffer.
              plgpu.wait_smem_to_gmem(0, wait_read_only=True)

              @pl.when(g == first)
              def _first():
                o_smem[...] = jnp.where(mine, acc, 0.0).astype(out_dtype)

              @pl.when(g != first)
              def _later():
                prev = o_smem[...].astype(jnp.float32)
                o_smem[...] = jnp.where(mine, acc, prev).astype(out_dtype)

          @pl.when(end > start)
          def _run():
            if transpose_rhs:
              b_ref = rhs_ref.at[g, pl.ds(n0, cta_n), :]
            else:
              b_ref = rhs_ref.at[g, :, pl.ds(n0, cta_n)]
            make_pipeline(mma, context)(lhs_ref.at[pl.ds(m0, bm), :], b_ref,
                                        allocations=allocs)
          return carry

        lax.fori_loop(first, last + 1, visit, None)

        @pl.when(wg < 2)
        def _store():
          @pl.when(first > last)
          def _zeros():
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            zeros = plgpu.broadcasted_iota(jnp.int32, (bm, bn), 0,
                                           layout=plgpu.Layout.WGMMA)
            o_smem[...] = (zeros * 0).astype(out_dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(
              o_smem, out_ref.at[pl.ds(m0, bm), pl.ds(n0 + wg * bn, bn)])

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  call = _common.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(_common.num_sms(),), grid_names=("sm",), num_threads=3,
      thread_name="wg", compiler_params=_common.compiler_params())
  out = call(tiles, bounds, lhs, rhs)
  if (m, n) != (m_orig, n_orig):
    out = out[:m_orig, :n_orig]
  return out


# ----------------------------------------------------------------------------
# drhs: the ragged contraction.

_TG_K = 64  # drhs tile rows (of K): one wgmma M.


def _drhs_item(idx, bounds_ref, k_tiles: int, n_tiles: int):
  """A drhs work item: (held group, K tile, N tile) for linear index `idx`, N
  fastest, and the group's rows ``[start, end)`` read from ``first`` (the start
  rounded down to 8: swizzled TMA reads rows in 8-row units)."""
  g = idx // (k_tiles * n_tiles)
  ki = (idx // n_tiles) % k_tiles
  ni = idx % n_tiles
  start = bounds_ref[g, 0]
  end = bounds_ref[g, 1]
  return g, ki, ni, start, end, start - start % 8


def grouped_transposed_matmul(lhs, dout, starts, ends, *, out_dtype,
                              config: RaggedDotConfig) -> jax.Array:
  """``drhs[g] = lhs[rows_g]^T @ dout[rows_g]``, ``[G_rhs, K, N]``.

  ``config.drhs_kernel`` picks the kernel: "ring" (`_drhs_ring`, one warpgroup)
  or "ws" (`_drhs_warp_specialized`).
  """
  if config.drhs_kernel == "ws":
    return _drhs_warp_specialized(lhs, dout, starts, ends, out_dtype=out_dtype,
                                  config=config)
  return _drhs_ring(lhs, dout, starts, ends, out_dtype=out_dtype, config=config)


def _drhs_ring(lhs, dout, starts, ends, *, out_dtype,
               config: RaggedDotConfig) -> jax.Array:
  """``drhs[g] = lhs[rows_g]^T @ dout[rows_g]``, ``[G_rhs, K, N]``.

  One warpgroup per block, persistent over (group, K-tile, N-tile) items, with a
  hand-rolled `num_stages`-deep TMA ring (the contraction length differs per
  group, which the fixed-grid pipeline helpers cannot express). A group's rows
  are read in chunks of `block_k` from its start rounded down to 8 rows; chunks
  that reach outside the group get those lhs rows zeroed in shared memory before
  the wgmma. Empty groups give zeros. Every output tile is written once, by one
  block: no atomics, deterministic.
  """
  num_held = starts.shape[0]
  m_orig, k_orig = lhs.shape
  n_orig = dout.shape[1]
  bk, stages = config.block_k, config.num_stages
  tn = 2 * config.block_n
  m = max(-(-m_orig // 8) * 8, bk)
  k = max(-(-k_orig // _TG_K) * _TG_K, _TG_K)
  n = max(-(-n_orig // tn) * tn, tn)
  lhs = jnp.pad(lhs, ((0, m - m_orig), (0, k - k_orig)))
  dout = jnp.pad(dout, ((0, m - m_orig), (0, n - n_orig)))
  k_tiles, n_tiles = k // _TG_K, n // tn
  bounds = jnp.stack([starts, ends], axis=1)
  dtype = lhs.dtype
  lhs_t = _common.swizzled(dtype, _TG_K)
  dout_t = _common.swizzled(dtype, tn)

  def kernel(bounds_ref, lhs_ref, dout_ref, out_ref, lhs_smem, dout_smem,
             out_smem, barriers):
    @plgpu.nd_loop((num_held * k_tiles * n_tiles,), collective_axes="sm")
    def _item_loop(info):
      g, ki, ni, start, end, first = _drhs_item(info.index[0], bounds_ref,
                                                k_tiles, n_tiles)
      chunks = jnp.where(end > start, (end - first + bk - 1) // bk, 0)
      k_cols = pl.ds(ki * _TG_K, _TG_K)
      n_cols = pl.ds(ni * tn, tn)

      def issue(c):
        slot = c % stages
        rows = pl.ds(first + c * bk, bk)
        plgpu.copy_gmem_to_smem(lhs_ref.at[rows, k_cols], lhs_smem.at[slot],
                                barriers.at[slot])
        plgpu.copy_gmem_to_smem(dout_ref.at[rows, n_cols], dout_smem.at[slot],
                                barriers.at[slot])

      for c in range(stages - 1):
        @pl.when(c < chunks)
        def _prologue():
          issue(c)

      def step(c, acc_ref):
        slot = c % stages
        plgpu.barrier_wait(barriers.at[slot])
        row0 = first + c * bk

        @pl.when((row0 < start) | (row0 + bk > end))
        def _mask():
          a = lhs_smem.at[slot]
          rows = row0 + plgpu.broadcasted_iota(jnp.int32, (bk, _TG_K), 0,
                                               layout=plgpu.Layout.WGMMA)
          keep = (rows >= start) & (rows < end)
          a[...] = jnp.where(keep, a[...], 0).astype(dtype)
          plgpu.commit_smem()

        plgpu.wgmma(acc_ref, plgpu.transpose_ref(lhs_smem.at[slot], (1, 0)),
                    dout_smem.at[slot])
        plgpu.wgmma_wait(1)  # Chunk c-1 is done: its slot may be refilled.

        @pl.when(c + stages - 1 < chunks)
        def _refill():
          issue(c + stages - 1)
        return acc_ref

      def acc_scope(acc_ref):
        lax.fori_loop(0, chunks, step, acc_ref)
        plgpu.wgmma_wait(0)
        return acc_ref[...]
      acc = pl.run_scoped(acc_scope, plgpu.ACC((_TG_K, tn), jnp.float32))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      out_smem[...] = acc.astype(out_dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem, out_ref.at[g, k_cols, n_cols])

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  call = _common.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((num_held, k, n), out_dtype),
      scratch_types=[
          plgpu.SMEM((stages, bk, _TG_K), dtype, transforms=lhs_t),
          plgpu.SMEM((stages, bk, tn), dtype, transforms=dout_t),
          plgpu.SMEM((_TG_K, tn), out_dtype,
                     transforms=_common.swizzled(out_dtype, tn)),
          # Two copies (lhs, dout) arrive on each stage's barrier.
          plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      ],
      grid=(_common.num_sms(),), grid_names=("sm",),
      compiler_params=_common.compiler_params())
  out = call(bounds, lhs, dout)
  return out[:, :k_orig, :n_orig]


_WS_K = 2 * _WGMMA_M  # K rows of a "ws" drhs tile (one wgmma M of 128).


def drhs_ws_config(config: RaggedDotConfig, itemsize: int,
                   out_itemsize: int) -> RaggedDotConfig:
  """The config `_drhs_warp_specialized` runs for a backward `config`.

  Row chunks are 64 deep (the boundary mask loads a chunk in the wgmma
  register layout: 64-row units); stages are dropped until the ring fits.
  """
  c = dataclasses.replace(config, block_m=_WS_K, block_k=64, row_tiling="group")
  while c.num_stages > 2 and not _fits(c, itemsize, out_itemsize):
    c = dataclasses.replace(c, num_stages=c.num_stages - 1)
  return c


def _drhs_warp_specialized(lhs, dout, starts, ends, *, out_dtype,
                           config: RaggedDotConfig) -> jax.Array:
  """``drhs[g] = lhs[rows_g]^T @ dout[rows_g]`` as the forward's kernel shape.

  A persistent grid walks items (held group, 128-row K tile, ``2 * block_n``
  N tile), consecutive items sharing the group and K tile (L2 reuse of the
  group's lhs columns). Per item, `plgpu.emit_pipeline_warp_specialized` with a
  dynamic grid of ``chunks`` steps: a memory warpgroup streams the group's lhs
  rows ``[bk, 128]`` and dout rows ``[bk, 2 * block_n]`` through a
  `num_stages`-deep TMA ring, and two compute warpgroups each accumulate a
  ``[128, block_n]`` float32 tile ``lhs_chunk^T @ dout_chunk[:, own columns]``.

  Rows are read from the group's start rounded down to 8 (swizzled TMA takes
  row starts in 8-row units); in a chunk that reaches outside the group each
  compute warpgroup zeroes those rows of its own dout columns in shared memory
  before its wgmma (disjoint columns: no barrier between the two). A group with
  rows runs at least two steps (a one-step warp-specialized pipeline crashed
  the H200; the extra chunk is all masked). An empty group's tiles are stored
  as zeros without a pipeline. Every output tile is written once by one block:
  no atomics, deterministic. The output is staged in `out_pieces` column pieces
  per warpgroup, each stored after the previous piece's TMA store has read
  shared memory.
  """
  itemsize = jnp.dtype(lhs.dtype).itemsize
  out_itemsize = jnp.dtype(out_dtype).itemsize
  if config.block_k != 64:
    raise ValueError(f"the 'ws' drhs kernel takes block_k=64; got {config}")
  _check_fits(dataclasses.replace(config, block_m=_WS_K), itemsize, out_itemsize,
              "ragged_dot drhs (ws)")
  num_held = starts.shape[0]
  m_orig, k_orig = lhs.shape
  n_orig = dout.shape[1]
  bk, bn, stages = config.block_k, config.block_n, config.num_stages
  cta_n = 2 * bn
  piece_n = bn // config.out_pieces
  # Whole swizzle widths and at least one tile per operand; reads past the
  # edges within that are zero-filled by TMA, so aligned shapes are not copied.
  lhs = _pad_axis(_pad_axis(lhs, 0, 8, bk), 1, _COLS, _WS_K)
  dout = _pad_axis(_pad_axis(dout, 0, 8, bk), 1, _COLS, cta_n)
  m, k = lhs.shape
  n = dout.shape[1]
  k_tiles, n_tiles = pl.cdiv(k, _WS_K), pl.cdiv(n, cta_n)
  bounds = jnp.stack([starts, ends], axis=1)
  dtype = lhs.dtype

  lhs_spec = plgpu.BlockSpec((bk, _WS_K), lambda c: (c, 0),
                             transforms=_common.swizzled(dtype, _WS_K),
                             delay_release=1)
  dout_spec = plgpu.BlockSpec((bk, cta_n), lambda c: (c, 0),
                              transforms=_common.swizzled(dtype, _WS_K),
                              delay_release=1)

  def make_pipeline(body, context, steps):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(steps,), memory_registers=40,
        in_specs=[lhs_spec, dout_spec], wg_axis="wg", num_compute_wgs=2,
        max_concurrent_steps=stages, compute_context=context)

  out_smem_type = plgpu.SMEM((2, _WS_K, piece_n), out_dtype,
                             transforms=_common.swizzled(out_dtype, piece_n))

  def kernel(bounds_ref, lhs_ref, dout_ref, out_ref):
    ignore = lambda *_, **__: None
    # The allocations depend on the specs and the stage count, not the grid.
    allocs = make_pipeline(ignore, ignore, stages).get_allocations(
        lhs_ref.at[:, pl.ds(0, _WS_K)], dout_ref.at[:, pl.ds(0, cta_n)])

    @functools.partial(pl.run_scoped, allocs=allocs, out_smem=out_smem_type,
                       collective_axes="wg")
    def _scope(allocs, out_smem):
      wg = lax.axis_index("wg")
      cwg = jnp.minimum(wg, 1)
      o_smem = out_smem.at[cwg]

      @plgpu.nd_loop((num_held * k_tiles * n_tiles,), collective_axes="sm")
      def _item_loop(info):
        g, ki, ni, start, end, first = _drhs_item(info.index[0], bounds_ref,
                                                  k_tiles, n_tiles)
        chunks = jnp.where(end > start,
                           jnp.maximum((end - first + bk - 1) // bk, 2), 0)
        k0, n0 = ki * _WS_K, ni * cta_n

        def store(piece_of):
          for p in range(config.out_pieces):
            # The previous piece's (or tile's) store must have read o_smem.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_smem[...] = piece_of(p)
            plgpu.commit_smem()
            cols = pl.ds(n0 + cwg * bn + p * piece_n, piece_n)
            plgpu.copy_smem_to_gmem(o_smem,
                                    out_ref.at[g, pl.ds(k0, _WS_K), cols])

        def mma(indices, a_smem, b_smem, acc_ref):
          row0 = first + indices[0] * bk

          # Rows outside the group: zero them in this warpgroup's columns.
          for w in range(2):
            @pl.when((wg == w) & ((row0 < start) | (row0 + bk > end)))
            def _mask():
              own = b_smem.at[:, w * bn:(w + 1) * bn]
              rows = row0 + plgpu.broadcasted_iota(
                  jnp.int32, (bk, bn), 0, layout=plgpu.Layout.WGMMA)
              keep = (rows >= start) & (rows < end)
              own[...] = jnp.where(keep, own[...], 0).astype(dtype)
              plgpu.commit_smem()

          plgpu.wgmma(acc_ref, plgpu.transpose_ref(a_smem, (1, 0)),
                      b_smem.at[:, pl.ds(cwg * bn, bn)])
          plgpu.wgmma_wait(1)
          return acc_ref

        def context(eval_pipeline):
          @functools.partial(pl.run_scoped,
                             acc_ref=plgpu.ACC((_WS_K, bn), jnp.float32))
          def _acc_scope(acc_ref):
            eval_pipeline(acc_ref)
            acc = acc_ref[...]  # Waits for the last wgmma.
            store(lambda p: acc[:, p * piece_n:(p + 1) * piece_n].astype(
                out_dtype))

        @pl.when(chunks > 0)
        def _contract():
          # A window from the group's first row; its steps past the array end
          # read zeros (TMA), and rows past `end` are masked anyway.
          rows = pl.ds(first, m)
          make_pipeline(mma, context, chunks)(
              lhs_ref.at[rows, pl.ds(k0, _WS_K)],
              dout_ref.at[rows, pl.ds(n0, cta_n)], allocations=allocs)

        @pl.when((chunks == 0) & (wg < 2))
        def _empty_group():
          zeros = plgpu.broadcasted_iota(jnp.int32, (_WS_K, piece_n), 0,
                                         layout=plgpu.Layout.WGMMA)
          zeros = (zeros * 0).astype(out_dtype)
          store(lambda p: zeros)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  # Whole tiles in the output (sliced after only where K or N is not a tile
  # multiple): every TMA store is a whole swizzled box inside the array.
  k_out, n_out = k_tiles * _WS_K, n_tiles * cta_n
  call = _common.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((num_held, k_out, n_out), out_dtype),
      grid=(_common.num_sms(),), grid_names=("sm",), num_threads=3,
      thread_name="wg", compiler_params=_common.compiler_params())
  out = call(bounds, lhs, dout)
  if (k_out, n_out) != (k_orig, n_orig):
    out = out[:, :k_orig, :n_orig]
  return out


# ----------------------------------------------------------------------------
# Configs and checks.


def _few_rows_per_group(m: int, num_groups: int) -> bool:
  """Groups of fewer than 512 rows on average (4 row tiles): the heuristics keep
  3 stages and 128-row items there (G256 random measured slower with more)."""
  return m < 512 * max(num_groups, 1)


def _heuristic(m: int, k: int, n: int, num_groups: int, itemsize: int,
               out_itemsize: int, *, pieces: bool = False) -> RaggedDotConfig:
  """The default tiling. ``pieces=False`` keeps the whole-tile output staging
  (the configs gated_linear_unit builds from ``block_n``/``num_stages`` alone
  rely on it); this module's ops pass True."""
  del k, n
  # Row tiles follow the groups (row_tiling="group"), so small groups waste
  # little and 128-row tiles (64 per warpgroup) suit every group size. With
  # delay_release=1 one stage is held by the wgmma in flight, so 4 stages give
  # 3 of prefetch; 16-bit outputs need the output staged in two column pieces
  # for the 4th stage to fit (225 KiB). H200 bf16 forward (tools/tune.py,
  # CUPTI): M16384 K2048 N16384 G16 1.558 ms at 3 stages -> 1.544 at 4 + pieces,
  # but M65536 K7168 N2048 G256 random 3.573 -> 4.369: 4 stages only for groups
  # of many row tiles (only where this module's ops ask, `pieces`).
  few_stages = pieces and _few_rows_per_group(m, num_groups)
  candidates = ((128, 4, 1), (128, 4, 2), (128, 3, 1), (128, 3, 2), (64, 4, 1),
                (64, 3, 1))
  for block_n, stages, out_pieces in candidates:
    if (out_pieces == 2 and not pieces) or (stages == 4 and few_stages):
      continue
    config = RaggedDotConfig(block_m=128, block_n=block_n, block_k=64,
                             num_stages=stages, out_pieces=out_pieces)
    if smem_bytes(config, itemsize, out_itemsize) <= _common.SMEM_LIMIT:
      return config
  return RaggedDotConfig(block_m=128, block_n=64, block_k=32, num_stages=2)


def _forward_heuristic(m, k, n, num_groups, itemsize, out_itemsize):
  """The forward's default: `_heuristic`, with 256-row items in the group order
  where groups span many row tiles (its 4-stage, two-piece choice). H200 bf16
  (tools/tune.py, CUPTI) at M16384 K2048 N16384 G16: 1.549 ms -> 1.472 (256-row
  items in the snake order 1.572, with 3 stages 1.85; 128-row items in the group
  order were not measured); at M65536 K7168 N2048 G256 random 256-row items are
  slower (4.0-5.9 ms against 3.73), so smaller groups keep 128-row items."""
  config = _heuristic(m, k, n, num_groups, itemsize, out_itemsize, pieces=True)
  if not _few_rows_per_group(m, num_groups) and (
      config.num_stages, config.out_pieces, config.block_n) == (4, 2, 128):
    config = dataclasses.replace(config, block_m=256, item_order="group")
  return config


def _fits(config, itemsize, out_itemsize) -> bool:
  return smem_bytes(config, itemsize, out_itemsize) <= _common.SMEM_LIMIT


def _search_space(m, k, n, num_groups, itemsize, out_itemsize):
  del m, k, n, num_groups
  configs = []
  for tiling, bm in (("group", 128), ("fixed", 64), ("fixed", 128)):
    for bn in (64, 128):
      for bk in (32, 64):
        for stages in (2, 3, 4, 5, 6):
          for width in (4, 8, 16):
            c = RaggedDotConfig(block_m=bm, block_n=bn, block_k=bk,
                                num_stages=stages, grid_tile_width=width,
                                row_tiling=tiling)
            if _fits(c, itemsize, out_itemsize):
              configs.append(c)
            elif tiling == "group":
              # Output staged in two column pieces: the stage count that
              # does not fit next to a whole staged tile.
              c = dataclasses.replace(c, out_pieces=2)
              if _fits(c, itemsize, out_itemsize):
                configs.append(c)
  # The cost of the second piece's wait where one piece fits as well.
  for width in (4, 8):
    c = RaggedDotConfig(num_stages=3, grid_tile_width=width, out_pieces=2)
    if _fits(c, itemsize, out_itemsize):
      configs.append(c)
  configs.extend(_weight_reuse_configs(itemsize, out_itemsize))
  return tuple(configs)


def _weight_reuse_configs(itemsize, out_itemsize):
  """The weight-reuse variants (session 5): "group" item order for the wide
  (128 x 256) items, and tall (256 x 128) items in both orders. Select with
  ``--match item_order=group`` / ``--match block_m=256``."""
  configs = []
  for bk, stages, pieces in ((64, 3, 1), (64, 4, 2), (64, 3, 2)):
    for width in (4, 8, 16):
      configs.append(RaggedDotConfig(block_k=bk, num_stages=stages,
                                     out_pieces=pieces, grid_tile_width=width,
                                     item_order="group"))
  # Tall items with block_k 32 are left out: the one such config run on the
  # H200 (256 x 64 items, block_k 32, 2 stages, 2 pieces) failed with a
  # misaligned address, and a crash would end an autotuning run.
  for bk, stages, pieces in ((64, 3, 1), (64, 4, 2), (64, 3, 2)):
    for order in ("snake", "group"):
      # Snake: 16 bands all 16 column tiles at N=2048, so a row tile's lhs
      # is read by its column tiles together (tall items read lhs twice as
      # often as wide ones).
      for width in (4, 8, 16):
        configs.append(RaggedDotConfig(block_m=256, block_n=128, block_k=bk,
                                       num_stages=stages, out_pieces=pieces,
                                       grid_tile_width=width, item_order=order))
  return [c for c in configs if _fits(c, itemsize, out_itemsize)]


# The drhs kernel the backward's heuristic picks: the warp-specialized
# contraction. H200 bf16 forward+backward (tools/tune.py, CUPTI) with the ring
# kernel -> "ws": G16 4.996 -> 4.611 ms, G256 random 15.401 -> 13.432.
_HEURISTIC_DRHS_KERNEL = "ws"


def _vjp_search_space(m, k, n, num_groups, itemsize, out_itemsize):
  """The forward's space (it tiles dlhs) with the ring drhs, then the "ws" drhs
  at the dlhs heuristic's tiling with its own stage/piece/width variants (the
  config tiles both kernels; `drhs_ws_config` fits the stages)."""
  configs = list(_search_space(m, k, n, num_groups, itemsize, out_itemsize))
  base = _heuristic(m, k, n, num_groups, itemsize, out_itemsize, pieces=True)
  for block_n, stages, pieces in ((128, 4, 2), (128, 3, 1), (128, 3, 2),
                                  (64, 4, 1), (64, 6, 1)):
    c = dataclasses.replace(base, block_n=block_n, num_stages=stages,
                            out_pieces=pieces, drhs_kernel="ws")
    if _fits(c, itemsize, out_itemsize) and c not in configs:
      configs.append(c)
  return tuple(configs)


def _check_args(args) -> None:
  _common.check_dtype("lhs/rhs", args.lhs.dtype)
  out_dtype = jnp.dtype(args.preferred_element_type or args.lhs.dtype)
  if out_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                       jnp.dtype(jnp.float32)):
    raise NotImplementedError(f"preferred_element_type {out_dtype} (supported: "
                              "bfloat16, float16, float32)")
  _common.check_default_dot_algorithm(args.precision)
  if 0 in args.lhs.shape or 0 in args.rhs.shape:
    raise NotImplementedError(
        f"empty operands (lhs {args.lhs.shape}, rhs {args.rhs.shape})")
  if args.group_sizes.shape[0] == 0:
    raise NotImplementedError("no groups")


def _problem(args):
  m, k = args.lhs.shape
  n = args.rhs.shape[2]
  itemsize = jnp.dtype(args.lhs.dtype).itemsize
  out_itemsize = jnp.dtype(args.preferred_element_type or args.lhs.dtype).itemsize
  return m, k, n, args.num_groups, itemsize, out_itemsize


# ----------------------------------------------------------------------------
# Ops.


@dataclasses.dataclass(frozen=True)
class MosaicGpuRaggedDot(Op):
  """Grouped matmul forward: warp-specialized TMA + wgmma, persistent grid."""

  op_name = "ragged_dot"
  name = "mosaic_gpu"
  config_cls = RaggedDotConfig

  def check_supported(self, args, device):
    _common.check_hopper_device(device)
    _check_args(args)

  def heuristic_config(self, args):
    return _forward_heuristic(*_problem(args))

  def search_space(self, args):
    return _search_space(*_problem(args))

  def forward(self, args, config):
    out_dtype = jnp.dtype(args.preferred_element_type or args.lhs.dtype)
    starts, ends = tokamax.plugin.held_row_ranges(args.group_sizes, args.group_offset,
                               args.rhs.shape[0], args.lhs.shape[0])
    out = grouped_matmul(args.lhs, args.rhs, starts, ends, transpose_rhs=False,
                         out_dtype=out_dtype, config=config)
    return out, {}


@dataclasses.dataclass(frozen=True)
class MosaicGpuRaggedDotVjp(VjpOp):
  """Backward: dlhs by the forward kernel on rhs^T, drhs by the ragged contraction.

  The config tiles both: dlhs as the forward (``block_m x 2 block_n`` over K
  columns); drhs with ``drhs_kernel="ws"`` (the default) as ``128 x 2 block_n``
  tiles of each group's ``[K, N]`` over 64-row chunks of the group's rows, with
  `num_stages` lowered until the ring fits (`drhs_ws_config`), or with "ring" as
  ``64 x 2 block_n`` tiles over 64-row steps, 4 in flight.
  """

  op_name = "ragged_dot"
  name = "mosaic_gpu"
  config_cls = RaggedDotConfig

  def check_supported(self, args, device, residuals=None):
    del residuals  # The backward needs none.
    _common.check_hopper_device(device)
    _check_args(args)

  def heuristic_config(self, args):
    m, k, n, g, itemsize, _ = _problem(args)
    config = _heuristic(m, n, k, g, itemsize, itemsize, pieces=True)
    return dataclasses.replace(config, drhs_kernel=_HEURISTIC_DRHS_KERNEL)

  def search_space(self, args):
    m, k, n, g, itemsize, _ = _problem(args)
    return _vjp_search_space(m, n, k, g, itemsize, itemsize)

  def backward(self, args, residuals, out, dout, config):
    del residuals, out
    # dout is float32 when preferred_element_type was: the backward matmuls
    # take it rounded to the operands' dtype, as their wgmma inputs must be.
    dout = dout.astype(args.lhs.dtype)
    starts, ends = tokamax.plugin.held_row_ranges(args.group_sizes, args.group_offset,
                               args.rhs.shape[0], args.lhs.shape[0])
    dlhs = grouped_matmul(dout, args.rhs, starts, ends, transpose_rhs=True,
                          out_dtype=args.lhs.dtype, config=config)
    if config.drhs_kernel == "ws":
      itemsize = jnp.dtype(args.lhs.dtype).itemsize
      drhs_config = drhs_ws_config(config, itemsize,
                                   jnp.dtype(args.rhs.dtype).itemsize)
    else:
      drhs_config = dataclasses.replace(config, block_k=64, num_stages=4)
    drhs = grouped_transposed_matmul(args.lhs, dout, starts, ends,
                                     out_dtype=args.rhs.dtype, config=drhs_config)
    return {"lhs": dlhs, "rhs": drhs}
