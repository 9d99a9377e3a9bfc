"""Grouped matmul kernels (ragged_dot's forward and dlhs) in Pallas Mosaic GPU.

``out[i] = lhs[i] @ op(rhs[g(i)])`` on Hopper (sm_90), ``op`` the identity (the
forward) or the transpose (dlhs, reading rhs tiles as ``[n, k]``: wgmma takes
the transposed shared-memory operand).

A persistent grid (one block per SM) walks work items (a row tile x ``2 *
block_n`` columns) in a planar-snake or the group order, dealt round robin or
claimed by the blocks in index order (``claim_items``, the heuristics'). Each
block has a memory warpgroup that streams the lhs and rhs tiles through a
``num_stages``-deep ring of swizzled shared memory (TMA), and two compute
warpgroups that issue wgmma into float32 accumulators
(`plgpu.emit_pipeline_warp_specialized`).

Groups (``row_tiling="group"``, `_GroupTiles`): row tiles follow the groups. A
table computed with jnp outside the kernel (`work_items`) cuts each held group's
rows into tiles of ``block_m`` rows from the group's first row rounded down to 8
(swizzled TMA reads rows in 8-row units), so a group wastes less than a tile.
The two compute warpgroups own 64 rows each (128 in two wgmma halves for
``block_m=256``); one whose rows all lie outside the group skips its wgmma. Each
writes only the rows it owns: a whole aligned tile with one TMA store from
swizzled shared memory, a partial one in power-of-two row chunks from swizzled
column strips or unswizzled shared memory (`_store_rows`, `uses_strips`). Rows
no held group owns get zero-only items, so every output row is written exactly
once: no atomics.
``item_order="group"`` writes the (row tile, column tile) order into the table
(`ordered_items`): a group's row tiles of one column tile run on neighbouring
SMs together (L2 sharing of the weights). The output tile is staged whole or in
two column pieces (``out_pieces``, room for one more stage).

``row_tiling="fixed"`` (`_fixed_tiles`) keeps fixed 128-row tiles and runs one K
pipeline per group meeting the tile, merging rows in shared memory (1.5x the
work at 256 random groups; kept for comparison).

Reads past the array edges are zero-filled by TMA; the arrays are zero-padded
only where shapes are not multiples of the swizzle (8 rows, 64 columns).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import tokamax
from tokamax_gpu_mosaic import _common
from tokamax_gpu_mosaic import _pipeline


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
  ``chain_items`` (``row_tiling="group"``): one shared-memory ring runs a
  block's work items back to back (`_pipeline.ChainedPipeline`: the next
  item's first tiles load while the current one finishes), where the K steps
  are a multiple of ``num_stages`` (or fewer); otherwise each item fills the
  ring anew. The "ws" drhs kernel chains its items at any chunk count (its ring
  is hand-rolled, `ragged_dot_kernel_drhs._DrhsChained`). (The fp8 kernel
  fills its ring per item: its one chained A/B on the H200 measured no
  difference, notes/MEASUREMENTS.md, session 19.)

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
  ``sync_sharers`` (group order): before each item's loads, the memory
  warpgroup meets the other SMs whose items read the same weight tile (the
  band's row tiles of one column tile) through device-memory semaphores, so
  that their reads of each k-slice stay close enough in time to hit in L2.
  Without it the blocks, dealt their items round robin, drift apart over the
  waves of items (`tools/l2_model.py`; notes/MEASUREMENTS.md, session 39).
  Needs every block of the grid resident at once (`_GroupTiles.meet_sharers`);
  not run by the JAX interpreter.
  ``claim_items`` (``row_tiling="group"``): the blocks claim the table's items
  in index order from a device-memory counter (`_GroupTiles.claimed_loop`)
  instead of taking every ``num_sms``-th one, so that neighbouring indices
  start together however far the blocks' clocks have drifted apart: a group's
  row tiles then read each weight k-slice within a fraction of an item of
  each other (L2 hits), and a block that finishes early takes the next item
  (no tail of one block's leftover items). Each output tile is still computed
  by one block from the same operands: results do not depend on who claims
  what. In the interpreter the claims follow the round-robin deal.
  ``strip_staging`` (``row_tiling="group"``): a partial tile (rows of other
  items, a group's first or last row tile) is staged in swizzled column
  strips 128 bytes wide that TMA stores row chunks of (`_store_rows`), True,
  or in plain shared memory, where its stmatrix conflicts 8 ways, False.
  None (the default) takes the strips where a staged piece is at most two
  strips wide (`uses_strips`).
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
  chain_items: bool = True
  sync_sharers: bool = False
  claim_items: bool = False
  strip_staging: bool | None = None

  def __post_init__(self):
    if self.block_m % WGMMA_M or self.block_m > 256:
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
    if self.sync_sharers and self.item_order != "group":
      raise ValueError("sync_sharers=True needs item_order='group' (the order "
                       "that puts a weight tile's readers on neighbouring SMs)")
    if self.claim_items and self.row_tiling != "group":
      raise ValueError("claim_items=True needs row_tiling='group'")
    if self.claim_items and self.sync_sharers:
      # The sharer blocks are found by index modulo the SMs: the static deal.
      raise ValueError("claim_items=True and sync_sharers=True exclude each "
                       "other (sync_sharers meets the blocks of the round-robin "
                       "deal)")
    if self.out_pieces not in (1, 2):
      raise ValueError(f"out_pieces must be 1 or 2; got {self.out_pieces}")
    if self.out_pieces == 2 and self.row_tiling != "group":
      raise ValueError("out_pieces=2 needs row_tiling='group'")
    tile_n = cta_n(self)
    if self.out_pieces == 2 and tile_n // 2 < 64:
      # A piece narrower than the 128-byte swizzle: the H200 run of such a
      # config (256 x 64 items) failed with a misaligned address.
      raise ValueError(f"out_pieces=2 needs output pieces of >= 64 columns; "
                       f"items of {tile_n} columns make {tile_n // 2}")
    if self.drhs_kernel not in ("ring", "ws"):
      raise ValueError(f"drhs_kernel must be 'ring' or 'ws'; got {self.drhs_kernel}")
    if self.drhs_kernel == "ws":
      # Each compute warpgroup of the "ws" drhs kernel holds a [64, 2 block_n]
      # float32 tile (block_n registers per thread) and stages it in
      # `out_pieces` column pieces of 2 block_n / out_pieces. Pieces of 64
      # columns (block_n 64 in two) have not run on a GPU in this kernel:
      # refused until they have.
      if self.block_n > 128:
        raise ValueError(f"drhs_kernel='ws' takes block_n <= 128 (its float32 tile "
                         f"needs block_n registers per thread); got {self.block_n}")
      if self.block_n // self.out_pieces < 64:
        raise ValueError(f"drhs_kernel='ws' with out_pieces={self.out_pieces} needs "
                         f"block_n >= {64 * self.out_pieces}; got {self.block_n}")

WGMMA_M = 64  # wgmma's row granularity per warpgroup.
COLS = 64  # Minor dimensions are padded to this (the 128-byte swizzle's width).


def cta_n(config: RaggedDotConfig) -> int:
  """Output columns of one block: ``2 * block_n``, or ``block_n`` for tall
  (``block_m=256``) group items, whose warpgroups split rows, not columns."""
  if config.row_tiling == "group" and config.block_m == 256:
    return config.block_n
  return 2 * config.block_n


def smem_bytes(config: RaggedDotConfig, itemsize: int, out_itemsize: int) -> int:
  """Shared memory of the warp-specialized kernels (the forward/dlhs kernel, and
  the ``drhs_kernel="ws"`` contraction, whose stage holds 128 lhs columns where
  the forward holds 128 lhs rows: the same bytes)."""
  n = cta_n(config)
  stage = (config.block_m * config.block_k + config.block_k * n) * itemsize
  out = config.block_m * n * out_itemsize // config.out_pieces
  return config.num_stages * stage + out + 1024  # + barriers, alignment


def check_fits(config: RaggedDotConfig, itemsize: int, out_itemsize: int,
               what: str) -> None:
  need = smem_bytes(config, itemsize, out_itemsize)
  if need > _common.SMEM_LIMIT:
    raise ValueError(
        f"{what}: {config} needs {need} bytes of shared memory with "
        f"{itemsize}-byte operands and {out_itemsize}-byte outputs; the limit is "
        f"{_common.SMEM_LIMIT} (fewer num_stages, out_pieces=2, or a smaller "
        "block_n)")


def pad_to_multiple(x, axis: int, multiple: int, minimum: int):
  """Zero-pads `x` along `axis` to a multiple of `multiple`, at least `minimum`.

  Swizzled TMA needs the array's tiled dimensions to be multiples of the SMEM
  tiling (8 rows, 64 columns of 16-bit elements); aligned shapes (the usual MoE
  case) are not copied.
  """
  return _common.pad_axis(x, axis, _common.round_up(x.shape[axis], multiple, minimum))


# ----------------------------------------------------------------------------
# Group tables (plain jnp, outside the kernel).


def tile_groups(starts, ends, m: int, block_m: int):
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


def work_items(starts, ends, m: int, block_m: int):
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


_NI = 4  # Column of `ordered_items`: the item's column tile.
# Columns of `ordered_items(..., sharers=True)`: the first linear index of the
# item's sharer block (the band's row tiles of its column tile) and their count.
_FIRST, _SHARERS = 5, 6


def item_table(items, n_tiles: int, config: RaggedDotConfig):
  """The work-item table a kernel reads for `config`: `work_items` as they are
  (the snake order computes its order), or `ordered_items`."""
  if config.item_order != "group":
    return items
  return ordered_items(items, n_tiles, config.grid_tile_width,
                       sharers=config.sync_sharers)


def ordered_items(items, n_tiles: int, width: int, sharers: bool = False):
  """`work_items` x column tiles in "group" order, int32 ``[items * n_tiles, 5]``
  (``7`` with `sharers`: each row's sharer block, `_FIRST` and `_SHARERS`).

  Row ``L`` of the result is the work item the kernel's linear index ``L`` runs
  (the `work_items` columns, then the column tile). A run is the row tiles of
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
  columns = [jnp.broadcast_to(items[:, None, :], (num, n_tiles, 4)), ni[..., None]]
  if sharers:
    # The band's row tiles of column position j: indices [first, first + len).
    first = band_start[:, None] * n_tiles + j * band_len[:, None]
    columns += [first[..., None],
                jnp.broadcast_to(band_len[:, None, None], (num, n_tiles, 1))]
  rows = jnp.concatenate(columns, axis=2)
  table = jnp.zeros((num * n_tiles, rows.shape[2]), jnp.int32)
  return table.at[linear.reshape(-1)].set(rows.reshape(num * n_tiles, -1),
                                          unique_indices=True)


# ----------------------------------------------------------------------------
# The kernels.


def grouped_matmul(lhs, rhs, starts, ends, *, transpose_rhs: bool, out_dtype,
                   config: RaggedDotConfig) -> jax.Array:
  """``out[i] = lhs[i] @ op(rhs[g])`` for rows ``[starts[g], ends[g])``, else 0.

  ``op`` is the transpose when `transpose_rhs` (rhs is then ``[G, N, K]``).
  """
  if config.row_tiling == "fixed":
    return _fixed_tiles(lhs, rhs, starts, ends, transpose_rhs=transpose_rhs,
                        out_dtype=out_dtype, config=config)
  return _group_tiles(lhs, rhs, starts, ends, transpose_rhs=transpose_rhs,
                      out_dtype=out_dtype, config=config)


def _pad_operands(lhs, rhs, transpose_rhs: bool, config: RaggedDotConfig):
  """Pads M to 8 rows, K and N to 64 columns (and tiny ones to a block).

  K gets at least two pipeline steps: a one-step warp-specialized pipeline
  crashed on the H200 (CUDA_ERROR_LAUNCH_FAILED at K=64, notes/MOSAIC_GPU.md).
  """
  bm, bk, n = config.block_m, config.block_k, cta_n(config)
  lhs = pad_to_multiple(pad_to_multiple(lhs, 0, 8, bm), 1, COLS, 2 * bk)
  k = lhs.shape[1]
  k_axis, n_axis = (2, 1) if transpose_rhs else (1, 2)
  rhs = pad_to_multiple(pad_to_multiple(rhs, k_axis, k, k), n_axis, COLS, n)
  return lhs, rhs


def _operand_pipeline(dtype, block_m: int, block_k: int, n: int,
                      transpose_rhs: bool, stages: int, chained: bool = False):
  """The K loop over an lhs row tile and an rhs column tile of `n` columns
  (`chained`: a `_pipeline.ChainedPipeline` across work items)."""
  delay = 0 if chained else 1
  lhs_spec = _pipeline.tma_spec((block_m, block_k), lambda ki: (0, ki), dtype, block_k,
                                delay)
  if transpose_rhs:
    rhs_spec = _pipeline.tma_spec((n, block_k), lambda ki: (0, ki), dtype, block_k,
                                  delay)
  else:
    rhs_spec = _pipeline.tma_spec((block_k, n), lambda ki: (ki, 0), dtype, block_k,
                                  delay)
  cls = _pipeline.ChainedPipeline if chained else _pipeline.WarpSpecializedPipeline
  return cls((lhs_spec, rhs_spec), stages)


_STRIP_BYTES = 128  # a partial tile's staging strips: the widest swizzle


def uses_strips(config: RaggedDotConfig, piece_n: int, out_itemsize: int) -> bool:
  """Whether partial tiles go through the strips (``config.strip_staging``).

  Each strip of a partial tile is its own TMA store per row chunk, so the
  strips trade the plain staging's bank conflicts for more stores. H200 bf16
  forward, strips / plain (notes/MEASUREMENTS.md, session 46): pieces of two
  strips (128 columns) 0.974-0.994 at M65536 G128 random (K768 N2048, K2048
  N768, K4096 N1536), 1.002 at M16384 K2048 N16384 G16 (equal groups, few
  partial tiles); of one (the tall items' 64-column pieces) 0.976 at M32768
  K2048 N1408 G64 random; of four (256 columns) 1.014-1.018 at M65536 and
  M8192 K7168 N2048 G256 random and M16384 K4096 N4096 G64 random. A piece
  that is not whole strips (under 128 bytes a row) is staged plainly."""
  row_bytes = piece_n * out_itemsize
  whole_strips = row_bytes >= _STRIP_BYTES and row_bytes % _STRIP_BYTES == 0
  if config.strip_staging and not whole_strips:
    raise ValueError(f"strip_staging=True needs output pieces of whole "
                     f"{_STRIP_BYTES}-byte strips; got {piece_n} columns of "
                     f"{out_itemsize} bytes")
  if config.strip_staging is not None:
    return config.strip_staging
  return whole_strips and row_bytes <= 2 * _STRIP_BYTES


class _Staging(NamedTuple):
  """A compute warpgroup's output staging, views of the same bytes
  (`_GroupTiles.out_smem_types`)."""

  tile: Any  # [rows, piece] swizzled: whole tiles
  plain: Any  # [rows, piece] unswizzled: partial tiles (``strip_staging=False``)
  strips: Any  # [piece / w, rows, w] swizzled, tiled by single rows: w
  # columns of 128 bytes (the swizzle's width), partial tiles


def _store_rows(y, lo, hi, dst_row, staging: _Staging, out_ref, cols,
                strips: bool):
  """Writes rows ``[lo, hi)`` of a warpgroup's ``[64 or 128, n]`` tile to ``out_ref``.

  A whole 8-row-aligned tile goes out in one TMA store from `staging.tile`. A
  partial one goes out in power-of-two row chunks (TMA boxes have static
  shapes), so rows other items own are never touched. With `strips` it is
  staged in column strips 128 bytes wide, each swizzled with rows 128 bytes
  apart (stmatrix writes them without bank conflicts) and tiled by single
  rows, so that a chunk's box may start at any row. Otherwise it is staged
  unswizzled, where at rows 256 bytes apart each stmatrix took 32
  shared-memory wavefronts instead of 4 (notes/MEASUREMENTS.md, session 45,
  item 8).
  """
  rows, _ = y.shape
  full = (lo == 0) & (hi == rows) & (dst_row % 8 == 0)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  @pl.when(full)
  def _full():
    _pipeline.store_tile(staging.tile, y, out_ref.at[pl.ds(dst_row, rows), cols])

  @pl.when(~full & (hi > lo))
  def _partial():
    if not strips:
      _common.store_unswizzled(staging.plain, y)
      plgpu.commit_smem()
      _store_chunks(staging.plain, lo, hi, dst_row, out_ref, cols)
      return
    num_strips, _, width = staging.strips.shape
    for q in range(num_strips):
      staging.strips.at[q][...] = y[:, q * width:(q + 1) * width]
    plgpu.commit_smem()
    for q in range(num_strips):
      _store_chunks(staging.strips.at[q], lo, hi, dst_row, out_ref,
                    pl.ds(cols.start + q * width, width))


def _store_chunks(smem, lo, hi, dst_row, out_ref, cols):
  """TMA stores of rows ``[lo, hi)`` of `smem` in power-of-two row chunks."""
  rows = smem.shape[0]
  count = hi - lo
  size = rows  # A whole tile at an unaligned row also goes this way.
  while size >= 1:
    offset = lo + (count & ~(2 * size - 1))

    @pl.when((count & size) != 0)
    def _chunk():
      plgpu.copy_smem_to_gmem(smem.at[pl.ds(offset, size)],
                              out_ref.at[pl.ds(dst_row + offset, size), cols])
    size //= 2


# `claimed_loop`'s shared memory: two claimed indices, a barrier per slot that
# the memory warpgroup arrives on once it wrote the slot, and one per slot that
# all three warpgroups arrive on once they read it.
_CLAIM_TYPES = (plgpu.SMEM((2,), jnp.int32),
                plgpu.Barrier(num_arrivals=1, num_barriers=2),
                plgpu.Barrier(num_arrivals=3, num_barriers=2))


def _thread_0_of_warpgroup():
  """Mosaic GPU IR (inside `plgpu.inline_mgpu`): an i1, whether this thread is
  thread 0 of its warpgroup. Used as a predicate of single PTX instructions,
  never as a branch: a branch around the claim's store (``mgpu.utils.when``)
  made ptxas serialize the compute warpgroups' wgmma ("compiler-inserted WG.AR
  in divergent path"), and the forward took 13-21% longer than without
  claims on the H200 (notes/MEASUREMENTS.md, session 41)."""
  # Lazy: Mosaic GPU's MLIR helpers, needed only when a kernel lowers.
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith
  i32 = ir.IntegerType.get_signless(32)
  lane = arith.remui(mgpu_utils.thread_idx(), mgpu_utils.c(mgpu_utils.WARPGROUP_SIZE, i32))
  return arith.cmpi(arith.CmpIPredicate.eq, lane, mgpu_utils.c(0, i32))


_SCALAR = plgpu.Layout.WG_SPLAT(())


def _claim_index(counter, is_memory, j):
  """Thread 0 of the memory warpgroup (`is_memory`): ``counter[0]++``, the old
  value (an atomic add that returns it: Pallas has none, so it is inlined
  PTX); 0 on every other thread. So the result is not uniform over the
  warpgroup: it must go to `_store_claim` only, never into control flow. The
  value lands in a register later: only `_store_claim` reads it, so the
  thread goes on issuing loads meanwhile.

  The interpreter has no device-memory counter (`counter` None): there claim
  `j` of block ``sm`` is `_interpreted_claim`'s, so the protocol around the
  claims still runs there."""
  if counter is None:
    return _interpreted_claim(j, lax.axis_index("sm"), _common.num_sms())

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), _SCALAR),
                     return_type=plgpu.ShapeDtypeStruct((), jnp.int32,
                                                        layout=_SCALAR))
  def fetch_add(ctx, counter_ref, is_memory):
    del ctx
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    i1 = ir.IntegerType.get_signless(1)
    claims = arith.andi(_thread_0_of_warpgroup(),
                        arith.trunci(i1, is_memory.registers.flat[0]))
    old = llvm.inline_asm(
        ir.IntegerType.get_signless(32),
        [mgpu_utils.memref_ptr(counter_ref), claims],
        "mov.u32 $0, 0;\n@$2 atom.global.add.u32 $0, [$1], 1;", "=r,l,b",
        has_side_effects=True)
    return mgpu.FragmentedArray.splat(old, (), is_signed=True)

  return fetch_add(counter, is_memory.astype(jnp.int32))


def _interpreted_claim(j, sm, num_sms):
  """What the interpreter's block `sm` claims as its `j`-th item: the
  round-robin deal, ``j * num_sms + sm`` (every index once). Tests replace it
  with other orders (all to one block, say): results must not change."""
  return j * num_sms + sm


def _store_claim(claimed_index, ticket) -> None:
  """``ticket[0] = claimed_index`` from thread 0 of the memory warpgroup, the
  thread whose register holds the claim (`_claim_index`). Its arrival on the
  slot's barrier, with the warpgroup's other threads, releases the store."""
  if _common.interpreting():
    ticket[0] = claimed_index
    return

  @plgpu.inline_mgpu(arg_types=(_SCALAR, plgpu.RefType()))
  def store(ctx, value, ticket_ref):
    del ctx
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    llvm.inline_asm(
        ir.Type.parse("!llvm.void"),
        [mgpu_utils.memref_ptr(ticket_ref), value.registers.flat[0],
         _thread_0_of_warpgroup()],
        "@$2 st.shared.u32 [$0], $1;", "r,r,b", has_side_effects=True)

  store(claimed_index, ticket)


class _Item(NamedTuple):
  """One work item as a compute warpgroup sees it."""

  wg: Any
  cwg: Any  # compute warpgroup (0 or 1; the memory warpgroup counts as 1)
  row0: Any  # first row of the tile
  group: Any  # rhs group (-1: zeros)
  lo: Any  # rows [lo, hi) of the tile belong to the item
  hi: Any
  n0: Any  # first column
  wlo: Any  # this warpgroup's rows [wlo, whi) of its `half`
  whi: Any
  dst_row: Any  # its first output row
  matmul: Any  # whether the item runs a K loop
  index: Any = None  # the linear index (with ``sync_sharers``)
  first: Any = None  # its sharer block: indices [first, first + sharers)
  sharers: Any = None


@dataclasses.dataclass(frozen=True)
class _GroupTiles:
  """`grouped_matmul` on row tiles that follow the groups (`work_items`).

  The two compute warpgroups split the tile's rows (64 each, or 128 for
  ``block_m=256`` in two wgmma halves) and share the rhs tile. With a
  `_pipeline.ChainedPipeline` the block's items share one ring: the item loop
  carries whether this block has run a K loop yet (its first one starts the
  ring).
  """

  config: Any
  transpose_rhs: bool
  out_dtype: Any
  num_items: int
  n_tiles: int
  k_steps: int
  pipeline: _pipeline.WarpSpecializedPipeline

  # The kernel's outputs after the streamed operands (a subclass may write more).
  num_outputs = 1

  @property
  def bm(self):
    return self.config.block_m

  @property
  def chained(self):
    return isinstance(self.pipeline, _pipeline.ChainedPipeline)

  @property
  def half(self):  # a compute warpgroup's rows: 64, or 128 in two wgmma halves
    return self.bm // 2

  @property
  def subs(self):
    return self.half // WGMMA_M

  @property
  def cta_n(self):
    return cta_n(self.config)

  @property
  def pieces(self):
    return self.config.out_pieces

  @property
  def piece_n(self):
    return self.cta_n // self.pieces

  @property
  def strips(self):
    return uses_strips(self.config, self.piece_n, jnp.dtype(self.out_dtype).itemsize)

  def out_smem_types(self):
    """Per compute warpgroup, its `_Staging`: the output tile (or one column
    piece) swizzled, and over the same bytes the same unswizzled and its
    column strips of 128 bytes swizzled and tiled by single rows (partial
    tiles, `_store_rows`). One union per warpgroup: with
    one union of [2, ...] views, one warpgroup's writes corrupted the other's
    tile on the H200 (notes/MOSAIC_GPU.md)."""
    width = _STRIP_BYTES // jnp.dtype(self.out_dtype).itemsize
    row_tiled = (plgpu.TilingTransform((1, width)),
                 plgpu.SwizzleTransform(_STRIP_BYTES))
    return [
        plgpu.RefUnion(
            plgpu.SMEM((self.half, self.piece_n), self.out_dtype,
                       transforms=_common.swizzled(self.out_dtype, self.piece_n)),
            plgpu.SMEM((self.half, self.piece_n), self.out_dtype),
            plgpu.SMEM((self.piece_n // width, self.half, width), self.out_dtype,
                       transforms=row_tiled))
        for _ in range(2)]

  def kernel(self, items_ref, *refs):
    """`refs`: the operands the pipeline streams (lhs, rhs), then the output
    (the `num_outputs` outputs, as a tuple, where there are more)."""
    operands, outs = refs[:-self.num_outputs], refs[-self.num_outputs:]
    out_ref = outs[0] if self.num_outputs == 1 else outs
    allocs = self.pipeline.allocations(*operands, steps=self.k_steps)

    claims = _CLAIM_TYPES if self.config.claim_items else None

    @functools.partial(pl.run_scoped, allocs=allocs, out_smem=self.out_smem_types(),
                       claims=claims, collective_axes="wg")
    def _scope(allocs, out_smem, claims):
      wg = lax.axis_index("wg")
      cwg = jnp.minimum(wg, 1)

      def run(index, started):
        """Runs item `index`; `started`: whether this block ran a K loop."""
        item = self.item(items_ref, wg, cwg, index)
        self.run_item(item, operands, out_ref, out_smem, allocs, started=started)
        return started | self.has_matmul(item).astype(jnp.int32)

      if claims is not None:
        self.claimed_loop(run, wg, *claims)
      else:
        @plgpu.nd_loop((self.num_items * self.n_tiles,), collective_axes="sm",
                       init_carry=jnp.int32(0))
        def _item_loop(info, carry):
          return run(info.index[0], carry)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  def persistent_call(self, body, out_type):
    """The persistent kernel of ``body(tiles)`` (the kernel body with `tiles`
    bound), as a function of the kernel's arrays.

    With claims, a batched call (``jax.vmap``) runs the round-robin deal
    instead: Pallas batches a kernel into one launch whose batch instances
    would share the one counter of `claimed_loop`, so each instance would run
    only the items its own blocks happened to claim."""
    call = _pipeline.persistent_kernel(body(self), out_type=out_type)
    if not self.config.claim_items:
      return call
    dealt = dataclasses.replace(
        self, config=dataclasses.replace(self.config, claim_items=False))
    return tokamax.plugin.vmap_fallback(
        call, _pipeline.persistent_kernel(body(dealt), out_type=out_type))

  def claimed_loop(self, run, wg, tickets, claimed, read):
    """The block's items as it claims them (`RaggedDotConfig.claim_items`).

    Thread 0 of the memory warpgroup claims the index of the block's next item
    from a counter in device memory (zeroed by each launch) as the warpgroup
    starts streaming the current item, and writes it to one of two
    shared-memory `tickets` once that item's loads are issued, so that the
    claim's round trip overlaps the loads (nothing reads the claimed value
    before the store). The memory warpgroup then arrives on the slot's
    `claimed` barrier; all three warpgroups wait there, read the index and
    arrive on `read` (the memory warpgroup refills a slot after all three
    have read it, two claims later). The compute warpgroups thus run exactly
    the indices the memory warpgroup streams. A block stops at its first
    index past the table: every block claims one such, and then the counter
    is never touched again."""
    total = self.num_items * self.n_tiles
    counter = (None if _common.interpreting()
               else pl.get_global(plgpu.SemaphoreType.REGULAR((1,))))
    is_memory = wg == 2

    def publish(j, claimed_index):
      """Memory warpgroup: ``tickets[j % 2] = claimed_index``, then arrive."""
      slot = lax.rem(j, 2)

      @pl.when(is_memory)
      def _publish():
        _pipeline.wait_when(j >= 2, read.at[slot])
        for s in range(2):  # static slots: one memref store each
          @pl.when(slot == s)
          def _store():
            _store_claim(claimed_index, tickets.at[pl.ds(s, 1)])
        plgpu.barrier_arrive(claimed.at[slot])

    def take(j):
      """All warpgroups: the index claimed for the block's item `j`."""
      slot = lax.rem(j, 2)
      plgpu.barrier_wait(claimed.at[slot])
      index = tickets[slot]
      plgpu.barrier_arrive(read.at[slot])
      return index

    def body(carry):
      j, index, started = carry
      claimed_index = _claim_index(counter, is_memory, j + 1)
      started = run(index, started)
      publish(j + 1, claimed_index)
      return j + 1, take(j + 1), started

    first = jnp.int32(0)
    publish(first, _claim_index(counter, is_memory, first))
    lax.while_loop(lambda carry: carry[1] < total, body,
                   (first, take(first), jnp.int32(0)))

  def item(self, items_ref, wg, cwg, index) -> _Item:
    """Work item `index` (the table's row, and its column tile)."""
    if self.config.item_order == "group":
      ii = index
      ni = items_ref[ii, _NI]
    else:
      ii, ni = _pipeline.static_snake(index, self.num_items, self.n_tiles,
                                      self.config.grid_tile_width)
    row0 = items_ref[ii, _ROW0]
    group = items_ref[ii, _GROUP]
    lo = items_ref[ii, _LO]
    hi = items_ref[ii, _HI]
    matmul = (group >= 0) & (hi > lo)
    n0 = ni * self.cta_n
    half = self.half
    wlo = jnp.clip(lo - cwg * half, 0, half)
    whi = jnp.clip(hi - cwg * half, 0, half)
    dst_row = row0 + cwg * half
    sync = {}
    if self.config.sync_sharers:
      sync = dict(index=index, first=items_ref[ii, _FIRST],
                  sharers=items_ref[ii, _SHARERS])
    return _Item(wg, cwg, row0, group, lo, hi, n0, wlo, whi, dst_row, matmul,
                 **sync)

  def operand_blocks(self, item: _Item, operands):
    """The item's views of the streamed operands: its lhs rows and rhs columns."""
    lhs_ref, rhs_ref = operands
    cols = pl.ds(item.n0, self.cta_n)
    if self.transpose_rhs:
      b_ref = rhs_ref.at[item.group, cols, :]
    else:
      b_ref = rhs_ref.at[item.group, :, cols]
    return lhs_ref.at[pl.ds(item.row0, self.bm), :], b_ref

  @staticmethod
  def has_matmul(item: _Item):
    return item.matmul

  def run_item(self, item: _Item, operands, out_ref, out_smem, allocs, started):
    """The item's K pipeline and store, or its zeros (rows no group owns).
    `started`: whether this block ran a K pipeline before (int32)."""
    if self.config.sync_sharers:
      self.meet_sharers(item)
    context = functools.partial(self.context, item, out_ref, out_smem, allocs)
    if not self.chained:
      @pl.when(self.has_matmul(item))
      def _matmul():
        mma = functools.partial(self.mma, item)
        self.pipeline(mma, context, self.k_steps)(
            *self.operand_blocks(item, operands), allocations=allocs)
    else:
      mma = self.pipeline.releasing(functools.partial(self.mma, item), allocs)
      first = started == 0
      # Two copies of the pipeline (code size and compile time): its START
      # state (the ring's prologue) is static in
      # emit_pipeline_warp_specialized's memory warpgroup. No item runs the
      # STOP state: its quiesce (the memory warpgroup waiting for the last
      # slots' releases) guards a reuse of the ring, and the ring's scope
      # ends with the kernel, every fetch consumed by the compute warpgroups.
      for first_item, when in ((True, first), (False, ~first)):
        @pl.when(self.has_matmul(item) & when)
        def _matmul():
          self.pipeline(mma, context, self.k_steps, first_item=first_item)(
              *self.operand_blocks(item, operands), allocations=allocs)

    @pl.when((item.group < 0) & (item.hi > item.lo) & (item.wg < 2))
    def _zeros():
      self.store_zeros(item, out_ref, out_smem)

  def meet_sharers(self, item: _Item):
    """Memory warpgroup, before the item's loads: signal each other block of
    the item's sharer block, then wait for as many signals (`sync_sharers`).

    One semaphore a block, in device memory (zeroed by each launch: Pallas
    allocates it with the call): every block signals before it waits, and
    the signals and waits of a block balance over the call. A block whose
    sharers run a wave later (a band across the deal's wrap-around) waits for
    them; the counts are anonymous, so a signal that arrives early for a later
    item ends an earlier wait sooner (timing, never results).

    It needs every block of the grid on an SM at once (one a SM, as the
    persistent grid is sized): a block waiting for a sharer that cannot be
    scheduled until it exits would hang (an MPS limit on SMs, green
    contexts, or kernels of other streams holding SMs). That is why it is
    opt-in and in no heuristic."""
    if _common.interpreting():
      raise NotImplementedError(
          "sync_sharers: the JAX interpreter cannot run device-memory "
          "semaphores (pl.get_global); use a config without it")
    num_sms = _common.num_sms()
    if self.config.grid_tile_width >= num_sms:
      # Two row tiles of one band on one block: the earlier would wait for
      # the later, which that block runs after it.
      raise ValueError(f"sync_sharers needs grid_tile_width < the {num_sms} "
                       f"SMs; got {self.config.grid_tile_width}")
    sems = pl.get_global(plgpu.SemaphoreType.REGULAR((num_sms,)))

    @pl.when((item.wg == 2) & item.matmul & (item.sharers > 1))
    def _meet():
      # A band holds grid_tile_width row tiles at most. (One fence for all
      # the signals, `plgpu.semaphore_signal_parallel`, refused these
      # data-dependent increments when lowered with JAX 0.10.2.)
      for j in range(self.config.grid_tile_width):
        other = item.first + j

        @pl.when((j < item.sharers) & (other != item.index))
        def _signal():
          plgpu.semaphore_signal(sems.at[lax.rem(other, num_sms)], 1,
                                 memory_scope="gpu")
      plgpu.semaphore_wait(sems.at[lax.rem(item.index, num_sms)],
                           item.sharers - 1, memory_scope="gpu")

  def store_zeros(self, item: _Item, out_ref, out_smem):
    """A zero item's rows (no held group owns them)."""
    zeros = _pipeline.zeros_tile((self.half, self.piece_n), self.out_dtype)
    self.store_tile(item, out_ref, out_smem, lambda p: zeros)

  def finish_loop(self, allocs):
    """After the item's K loop (compute warpgroups): a chained ring's last slot."""
    if self.chained:
      self.pipeline.finish_loop(allocs, self.k_steps)

  def mma(self, item: _Item, _, a_smem, b_smem, acc_ref):
    """One K step: this warpgroup's rows of the lhs tile times the rhs tile."""
    if self.transpose_rhs:
      b = b_smem.transpose((1, 0))
    else:
      b = b_smem
    if self.subs == 1:
      @pl.when(item.whi > item.wlo)
      def _issue():
        plgpu.wgmma(acc_ref, a_smem.at[pl.ds(item.cwg * self.half, self.half)], b)
      plgpu.wgmma_wait(1)
      return acc_ref
    self.issue_halves(item, a_smem, b, acc_ref)
    return acc_ref

  def issue_halves(self, item: _Item, a_smem, b, acc_ref):
    """Tall items: the wgmma of each 64-row half of this warpgroup's 128 rows
    that holds rows of the group."""
    wlo, whi = item.wlo, item.whi
    active = [(jnp.minimum(whi, (h + 1) * WGMMA_M) > jnp.maximum(wlo, h * WGMMA_M))
              for h in range(self.subs)]
    for h in range(self.subs):
      @pl.when(active[h])
      def _issue():
        rows = pl.ds(h * WGMMA_M, WGMMA_M)
        plgpu.wgmma(acc_ref.at[rows],
                    a_smem.at[pl.ds(item.cwg * self.half + h * WGMMA_M, WGMMA_M)], b)
    # Each wgmma call is one commit group. At the end of step s step s-1's
    # buffers are freed (by the pipeline's delay_release=1, or by
    # `ChainedPipeline.releasing`), so all of s-1's groups must be done: leave
    # pending only this step's.
    both = active[0] & active[1]

    @pl.when(both)
    def _wait_two():
      plgpu.wgmma_wait(2)

    @pl.when(~both)
    def _wait_one():
      plgpu.wgmma_wait(1)

  def context(self, item: _Item, out_ref, out_smem, allocs, eval_pipeline):
    """The accumulator around the K loop, then the store of this warpgroup's
    rows."""

    @functools.partial(pl.run_scoped,
                       acc_ref=plgpu.ACC((self.half, self.cta_n), jnp.float32))
    def _acc_scope(acc_ref):
      eval_pipeline(acc_ref)
      self.finish_loop(allocs)
      self.store_acc(item, out_ref, out_smem, acc_ref[...])

  def store_acc(self, item: _Item, out_ref, out_smem, acc):
    """Stores this warpgroup's rows of the float32 tile `acc`."""
    if self.pieces == 1:
      self.store_rows(item, out_ref, out_smem, acc.astype(self.out_dtype),
                      pl.ds(item.n0, self.cta_n))
    else:
      # Converted piece by piece: only one piece's outputs live in registers
      # next to the accumulator. (Static column slices of the value; a pl.ds
      # slice becomes a dynamic_slice, which does not lower.)
      piece_n = self.piece_n
      self.store_tile(item, out_ref, out_smem,
                      lambda p: acc[:, p * piece_n:(p + 1) * piece_n].astype(
                          self.out_dtype))

  def store_rows(self, item: _Item, out_ref, out_smem, y, cols):
    for w, views in enumerate(out_smem):
      @pl.when(item.wg == w)
      def _store():
        _store_rows(y, item.wlo, item.whi, item.dst_row, _Staging(*views), out_ref,
                    cols, self.strips)

  def store_tile(self, item: _Item, out_ref, out_smem, piece_of):
    """Stores the warpgroup's ``[half, cta_n]`` tile, `pieces` column pieces one
    after the other through the same shared memory: `_store_rows` first waits
    until the previous piece's TMA store has read it."""
    for p in range(self.pieces):
      self.store_rows(item, out_ref, out_smem, piece_of(p),
                      pl.ds(item.n0 + p * self.piece_n, self.piece_n))


def _group_tiles(lhs, rhs, starts, ends, *, transpose_rhs: bool, out_dtype,
                 config: RaggedDotConfig) -> jax.Array:
  m_orig = lhs.shape[0]
  n_orig = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  check_fits(config, lhs.dtype.itemsize, jnp.dtype(out_dtype).itemsize,
             "ragged_dot grouped_matmul")
  lhs, rhs = _pad_operands(lhs, rhs, transpose_rhs, config)
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  items = work_items(starts, ends, m, config.block_m)
  num_items = items.shape[0]
  n_tiles = pl.cdiv(n, cta_n(config))
  items = item_table(items, n_tiles, config)
  k_steps = pl.cdiv(k, config.block_k)
  depth = (_pipeline.ChainedPipeline.ring_depth(k_steps, config.num_stages)
           if config.chain_items else None)
  chained = depth is not None
  tiles = _GroupTiles(
      config=config, transpose_rhs=transpose_rhs, out_dtype=out_dtype,
      num_items=num_items, n_tiles=n_tiles, k_steps=k_steps,
      pipeline=_operand_pipeline(lhs.dtype, config.block_m, config.block_k,
                                 cta_n(config), transpose_rhs,
                                 depth if chained else config.num_stages, chained))

  # The output gets whole column tiles: a TMA store from plain (unswizzled)
  # shared memory whose box crossed the last column did not clip there on the
  # H200 but wrapped into the next row's first columns (notes/MOSAIC_GPU.md).
  n_out = n_tiles * cta_n(config)
  call = tiles.persistent_call(
      lambda t: t.kernel, out_type=jax.ShapeDtypeStruct((m, n_out), out_dtype))
  out = call(items, lhs, rhs)
  if (m, n_out) != (m_orig, n_orig):
    out = out[:m_orig, :n_orig]
  return out


@dataclasses.dataclass(frozen=True)
class _FixedTiles:
  """`grouped_matmul` on fixed m-tiles, one K pipeline per group meeting a tile;
  each group's rows are merged into the tile staged in shared memory."""

  config: Any
  transpose_rhs: bool
  out_dtype: Any
  m_tiles: int
  n_tiles: int
  k_steps: int
  pipeline: _pipeline.WarpSpecializedPipeline

  def kernel(self, tiles_ref, bounds_ref, lhs_ref, rhs_ref, out_ref):
    bm, bn = self.config.block_m, self.config.block_n
    allocs = self.pipeline.allocations(lhs_ref, rhs_ref, steps=self.k_steps)

    @functools.partial(
        pl.run_scoped, allocs=allocs,
        out_smem=plgpu.SMEM((2, bm, bn), self.out_dtype,
                            transforms=_common.swizzled(self.out_dtype, bn)),
        collective_axes="wg")
    def _scope(allocs, out_smem):
      wg = lax.axis_index("wg")
      o_smem = out_smem.at[jnp.minimum(wg, 1)]

      @plgpu.nd_loop((self.m_tiles * self.n_tiles,), collective_axes="sm")
      def _tile_loop(info):
        mi, m0, n0 = _pipeline.snake_tile(info.index[0], self.m_tiles, self.n_tiles,
                                          self.config.grid_tile_width, bm, 2 * bn)
        first = tiles_ref[mi, 0]
        last = tiles_ref[mi, 1]
        visit = functools.partial(self.visit_group, wg, o_smem, bounds_ref, lhs_ref,
                                  rhs_ref, allocs, m0, n0, first)
        lax.fori_loop(first, last + 1, visit, None)
        self.store(wg, o_smem, out_ref, m0, n0, first, last)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  def visit_group(self, wg, o_smem, bounds_ref, lhs_ref, rhs_ref, allocs, m0, n0,
                  first, g, carry):
    """Group `g`'s K pipeline over the tile, merged into `o_smem`."""
    bm, bn = self.config.block_m, self.config.block_n
    start = bounds_ref[g, 0]
    end = bounds_ref[g, 1]

    def mma(_, a_smem, b_smem, acc_ref):
      cols = pl.ds(wg * bn, bn)
      if self.transpose_rhs:
        b = b_smem.at[cols].transpose((1, 0))
      else:
        b = b_smem.at[:, cols]
      plgpu.wgmma(acc_ref, a_smem, b)
      plgpu.wgmma_wait(1)
      return acc_ref

    def context(eval_pipeline):
      @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
      def _acc_scope(acc_ref):
        eval_pipeline(acc_ref)
        acc = acc_ref[...]
        rows = m0 + _pipeline.wgmma_iota((bm, bn), 0)
        mine = (rows >= start) & (rows < end)
        # The previous tile's TMA store must have read the buffer.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(g == first)
        def _first():
          o_smem[...] = jnp.where(mine, acc, 0.0).astype(self.out_dtype)

        @pl.when(g != first)
        def _later():
          prev = o_smem[...].astype(jnp.float32)
          o_smem[...] = jnp.where(mine, acc, prev).astype(self.out_dtype)

    @pl.when(end > start)
    def _run():
      cols = pl.ds(n0, 2 * bn)
      if self.transpose_rhs:
        b_ref = rhs_ref.at[g, cols, :]
      else:
        b_ref = rhs_ref.at[g, :, cols]
      self.pipeline(mma, context, self.k_steps)(lhs_ref.at[pl.ds(m0, bm), :], b_ref,
                                                allocations=allocs)
    return carry

  def store(self, wg, o_smem, out_ref, m0, n0, first, last):
    """Each compute warpgroup stores its columns (zeros where no group met the
    tile)."""
    bm, bn = self.config.block_m, self.config.block_n

    @pl.when(wg < 2)
    def _store():
      @pl.when(first > last)
      def _zeros():
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        o_smem[...] = _pipeline.zeros_tile((bm, bn), self.out_dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(
          o_smem, out_ref.at[pl.ds(m0, bm), pl.ds(n0 + wg * bn, bn)])


def _fixed_tiles(lhs, rhs, starts, ends, *, transpose_rhs: bool, out_dtype,
                 config: RaggedDotConfig) -> jax.Array:
  m_orig = lhs.shape[0]
  n_orig = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  bm, bk, n_cta = config.block_m, config.block_k, 2 * config.block_n
  lhs, rhs = _pad_operands(lhs, rhs, transpose_rhs, config)
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  tiles = tile_groups(starts, ends, m, bm)
  bounds = jnp.stack([starts, ends], axis=1)
  fixed = _FixedTiles(
      config=config, transpose_rhs=transpose_rhs, out_dtype=out_dtype,
      m_tiles=pl.cdiv(m, bm), n_tiles=pl.cdiv(n, n_cta), k_steps=pl.cdiv(k, bk),
      pipeline=_operand_pipeline(lhs.dtype, bm, bk, n_cta, transpose_rhs,
                                 config.num_stages))

  def kernel(tiles_ref, bounds_ref, lhs_ref, rhs_ref, out_ref):
    fixed.kernel(tiles_ref, bounds_ref, lhs_ref, rhs_ref, out_ref)

  call = _pipeline.persistent_kernel(
      kernel, out_type=jax.ShapeDtypeStruct((m, n), out_dtype))
  out = call(tiles, bounds, lhs, rhs)
  if (m, n) != (m_orig, n_orig):
    out = out[:m_orig, :n_orig]
  return out
