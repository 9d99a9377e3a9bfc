"""ragged_dot's drhs kernels in Pallas Mosaic GPU: the ragged contraction.

``drhs[g] = lhs[rows_g]^T @ dout[rows_g]``, ``[G_rhs, K, N]``: a per-group
contraction over the group's rows, whose length differs per group. A persistent
grid walks (held group, K tile, N tile) items in bands of K tiles (`_drhs_item`).
A group's rows are read in chunks from its start rounded down to 8 rows
(swizzled TMA reads rows in 8-row units); in a chunk that reaches outside the
group those rows are zeroed in shared memory before the wgmma (`_zero_outside`),
in lhs always and in dout too where the chunk reaches outside the held groups'
rows (`_outside_held`): rows past the groups, or of groups another shard holds,
may hold anything, inf and NaN included, and must add nothing. Rows of a
neighbouring held group are zeroed in lhs only, so they must be finite in dout
(inf or NaN there makes that group's own gradient non-finite anyway). An empty
group's tiles are zeros. Every output tile is written once, by one block: no atomics,
deterministic. Two kernels (``RaggedDotConfig.drhs_kernel``):

- "ring" (`_drhs_ring`): one warpgroup per block with a hand-rolled
  `num_stages`-deep TMA ring;
- "ws": the forward's kernel shape (a producer and two consumer warpgroups):
  with ``chain_items`` (the default) `_DrhsChained`, one hand-rolled ring for
  all of a block's items; else `_DrhsWarpSpecialized`, a pipeline of the
  item's length per item.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tokamax_gpu_mosaic import _common
from tokamax_gpu_mosaic import _pipeline
from tokamax_gpu_mosaic.ragged_dot_kernel import COLS
from tokamax_gpu_mosaic.ragged_dot_kernel import RaggedDotConfig
from tokamax_gpu_mosaic.ragged_dot_kernel import WGMMA_M
from tokamax_gpu_mosaic.ragged_dot_kernel import check_fits
from tokamax_gpu_mosaic.ragged_dot_kernel import pad_to_multiple

_TG_K = 64  # "ring" tile rows (of K): one wgmma M.
WS_K = 2 * WGMMA_M  # K rows of a "ws" tile: 64 for each compute warpgroup.
_WS_HALF = WGMMA_M  # K rows of a "ws" compute warpgroup's share of a tile.


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


# K tiles per band of `_drhs_item`'s order.
K_BAND = 16


def _drhs_item(idx, bounds_ref, k_tiles: int, n_tiles: int):
  """A drhs work item: (held group, K tile, N tile) for linear index `idx`, and
  the group's rows ``[start, end)`` read from ``first`` (the start rounded down
  to 8: swizzled TMA reads rows in 8-row units).

  A group's items go in bands of `K_BAND` K tiles; within a band K is fastest,
  then N. So the items the SMs run at once (~132) cover a rectangle of about
  16 K tiles by 8 N tiles (where the group has that many), for which each chunk
  of the group's lhs and dout rows is fetched into L2 once and read there by ~8
  and ~16 items: with the "ws" kernel's tiles (128 K by 256 N columns) that
  rectangle minimizes what a wave reads from DRAM (an lhs chunk is half a dout
  chunk's width). The "ring" kernel (64 K columns a tile) takes the same order;
  it was measured with the "ws" kernel only. With N fastest a wave spans one or two K tiles of every N
  tile, rereading all of the group's dout columns per K tile; with K fastest
  and many K tiles (a down projection, K 14336) it spans one N tile and
  rereads the group's lhs per N tile.
  """
  per_group = k_tiles * n_tiles
  g, i = idx // per_group, idx % per_group
  # Bands of K_BAND K tiles (the last holds the rest), N tile by N tile with the
  # band's K tiles fastest. With static divisors: a run-time band width made
  # ptxas serialize this kernel's wgmmas under JAX 0.12 at K7168 (56 K tiles);
  # H100, JAX 0.11.2: M65536 K7168 N2048 G256 random forward+backward 12.517 ms
  # against 12.664 with it (notes/MEASUREMENTS.md, session 101).
  _, ni, ki = _pipeline.static_bands(i, n_tiles, k_tiles, K_BAND)
  start = bounds_ref[g, 0]
  end = bounds_ref[g, 1]
  return g, ki, ni, start, end, start - start % 8


def _held_rows(bounds_ref, num_held: int):
  """Rows ``[first, end)`` that the held groups own, together (they are
  contiguous)."""
  return bounds_ref[0, 0], bounds_ref[num_held - 1, 1]


def _outside_held(row0, rows, held) -> Any:
  """Whether the `rows` rows from `row0` reach outside the held groups' rows
  `held` (`_held_rows`): only there may dout hold non-finite values that must be
  zeroed (edge chunks of the first and last held groups)."""
  return (row0 < held[0]) | (row0 + rows > held[1])


def _zero_outside(ref, row0, start: Any, end: Any, dtype):
  """Zeroes the rows of the chunk `ref` (its first row is `row0`) outside the
  group's rows ``[start, end)``, in shared memory."""
  rows = row0 + _pipeline.wgmma_iota(ref.shape, 0)
  keep = (rows >= start) & (rows < end)
  ref[...] = jnp.where(keep, ref[...], 0).astype(dtype)
  plgpu.commit_smem()


# ----------------------------------------------------------------------------
# "ring": one warpgroup, a hand-rolled TMA ring.


def _drhs_ring(lhs, dout, starts, ends, *, out_dtype,
               config: RaggedDotConfig) -> jax.Array:
  """One warpgroup per block, persistent over (group, K-tile, N-tile) items,
  with a `num_stages`-deep TMA ring of `block_k`-row chunks (the contraction
  length differs per group, which the fixed-grid pipeline helpers cannot
  express)."""
  num_held = starts.shape[0]
  m_orig, k_orig = lhs.shape
  n_orig = dout.shape[1]
  bk, stages = config.block_k, config.num_stages
  tn = 2 * config.block_n
  m = _common.round_up(m_orig, 8, bk)
  k = _common.round_up(k_orig, _TG_K, _TG_K)
  n = _common.round_up(n_orig, tn, tn)
  lhs = jnp.pad(lhs, ((0, m - m_orig), (0, k - k_orig)))
  dout = jnp.pad(dout, ((0, m - m_orig), (0, n - n_orig)))
  k_tiles, n_tiles = k // _TG_K, n // tn
  bounds = jnp.stack([starts, ends], axis=1)
  dtype = lhs.dtype

  def kernel(bounds_ref, lhs_ref, dout_ref, out_ref, lhs_smem, dout_smem,
             out_smem, barriers):
    held = _held_rows(bounds_ref, num_held)

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
          _zero_outside(lhs_smem.at[slot], row0, start, end, dtype)

        @pl.when(_outside_held(row0, bk, held))
        def _mask_dout():  # zero times zero, even for inf or NaN there
          _zero_outside(dout_smem.at[slot], row0, start, end, dtype)

        plgpu.wgmma(acc_ref, lhs_smem.at[slot].transpose((1, 0)),
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
      _pipeline.store_tile(out_smem, acc.astype(out_dtype),
                           out_ref.at[g, k_cols, n_cols])

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  call = _pipeline.persistent_kernel(
      kernel, out_type=jax.ShapeDtypeStruct((num_held, k, n), out_dtype),
      scratch_types=[
          plgpu.SMEM((stages, bk, _TG_K), dtype,
                     transforms=_common.swizzled(dtype, _TG_K)),
          plgpu.SMEM((stages, bk, tn), dtype, transforms=_common.swizzled(dtype, tn)),
          plgpu.SMEM((_TG_K, tn), out_dtype,
                     transforms=_common.swizzled(out_dtype, tn)),
          # Two copies (lhs, dout) arrive on each stage's barrier.
          plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      ],
      warp_specialized=False)
  out = call(bounds, lhs, dout)
  return out[:, :k_orig, :n_orig]


# ----------------------------------------------------------------------------
# "ws": the forward's warp-specialized shape.


@dataclasses.dataclass(frozen=True)
class _DrhsWs:
  """What the two "ws" kernels share: a memory warpgroup streams the group's lhs
  rows ``[block_k, 128]`` and dout rows ``[block_k, 2 * block_n]``, and two
  compute warpgroups split the tile's 128 K rows: each accumulates a
  ``[64, 2 * block_n]`` float32 tile ``lhs_chunk[:, own 64 columns]^T @
  dout_chunk``, stored through `out_pieces` column pieces of shared memory.

  Splitting K rather than N makes each wgmma ``m64n(2 block_n)``: one wide
  instruction where the N split ran two ``m64n(block_n)`` ones (each warpgroup
  reading the whole lhs chunk), and at block_n 128 a boundary chunk's mask
  half as large. H200 bf16, drhs alone, CUPTI, 15 interleaved rounds
  (notes/MEASUREMENTS.md, session 70), N split -> K split: MoE up M16384
  K4096 N28672 G8 random 4.875 -> 4.779 ms, down K14336 N4096 2.488 -> 2.435,
  M16384 K2048 N16384 G16 1.401 -> 1.379, M65536 K7168 N2048 G256 random
  4.211 -> 3.901, M16384 K4096 N4096 G64 random 1.121 -> 1.030, M65536 K2048
  N768 G128 random 0.408 -> 0.385; M8192 K7168 N2048 G256 random (32 rows a
  group) 2.212 -> 2.268. Outputs bitwise equal there.

  In a chunk that reaches outside the group each compute warpgroup zeroes those
  rows of its own lhs columns (disjoint: no barrier). Where the chunk also
  reaches outside the held groups' rows (`_outside_held`: rows past the groups,
  or of groups not held, which may hold inf or NaN in dout too), each zeroes
  them in its own half of dout's columns as well, then waits for the other at
  the `masked` barrier (each reads all of dout): zero times zero there. Only
  items whose rows reach outside the held rows (`edge_item`) run that code, a
  second copy of the chunk loop (``edge`` given to `mma`): the dout mask and
  barrier in every boundary chunk cost 3.5% at the MoE shapes and 13-16% at
  G64-G256, and even a branch on the edge chunk in every chunk cost 1-2.5%
  (H200, interleaved A/Bs, notes/MEASUREMENTS.md session 71).
  """

  config: Any
  out_dtype: Any
  dtype: Any
  num_held: int
  k_tiles: int
  n_tiles: int
  m: int

  @property
  def bk(self):
    return self.config.block_k

  @property
  def bn(self):
    return self.config.block_n

  @property
  def piece_n(self):
    return 2 * self.bn // self.config.out_pieces

  def out_staging(self):
    """Each compute warpgroup's shared memory for one piece of its tile."""
    return plgpu.SMEM((2, _WS_HALF, self.piece_n), self.out_dtype,
                      transforms=_common.swizzled(self.out_dtype, self.piece_n))

  def acc_type(self):
    """A compute warpgroup's float32 accumulator."""
    return plgpu.ACC((_WS_HALF, 2 * self.bn), jnp.float32)

  def store(self, cwg, o_smem, out_ref, g, k0, n0, piece_of):
    """Writes this warpgroup's ``[64, 2 * block_n]`` tile of ``out[g]`` at (k0 +
    its rows, n0), piece ``p`` being ``piece_of(p)``, through `o_smem`."""
    rows = pl.ds(k0 + cwg * _WS_HALF, _WS_HALF)
    for p in range(self.config.out_pieces):
      # The previous piece's (or tile's) store must have read o_smem.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      o_smem[...] = piece_of(p)
      plgpu.commit_smem()
      cols = pl.ds(n0 + p * self.piece_n, self.piece_n)
      plgpu.copy_smem_to_gmem(o_smem, out_ref.at[g, rows, cols])

  def store_acc(self, store, acc):
    """Stores the float32 accumulator `acc` through `store` (`store` with the
    tile's place bound)."""
    piece_n = self.piece_n
    store(lambda p: acc[:, p * piece_n:(p + 1) * piece_n].astype(self.out_dtype))

  def store_zeros(self, store):
    """`store` of zeros: the tile of a group with no rows."""
    zeros = _pipeline.zeros_tile((_WS_HALF, self.piece_n), self.out_dtype)
    store(lambda p: zeros)

  def edge_item(self, first, chunks, held):
    """Whether an item's `chunks` chunks from row `first` reach outside the
    held rows `held`: then it runs `mma` with ``edge``."""
    return _outside_held(first, chunks * self.bk, held)

  def mma(self, wg, cwg, edge, first, start, end, indices, a_smem, b_smem,
          acc_ref):
    """Chunk ``indices[0]`` of the item (rows from ``first``) into `acc_ref`,
    rows outside ``[start, end)`` zeroed first; waits for the previous chunk's
    wgmma. ``edge``, for items that reach outside the held rows, is (the
    `masked` barrier, the held rows): there dout's rows are zeroed too in chunks
    outside the held rows."""
    bk, half, bn = self.bk, _WS_HALF, self.bn
    row0 = first + indices[0] * bk

    # Rows outside the group: zero them in this warpgroup's lhs columns.
    for w in range(2):
      @pl.when((wg == w) & ((row0 < start) | (row0 + bk > end)))
      def _mask():
        _zero_outside(a_smem.at[:, w * half:(w + 1) * half], row0, start, end,
                      self.dtype)

    if edge is not None:
      masked, held = edge
      outside_held = _outside_held(row0, bk, held)
      for w in range(2):  # this warpgroup's half of dout's columns
        @pl.when((wg == w) & outside_held)
        def _mask_dout():
          _zero_outside(b_smem.at[:, w * bn:(w + 1) * bn], row0, start, end,
                        self.dtype)

      @pl.when(outside_held)
      def _both_masked():  # each warpgroup's wgmma reads both halves of dout
        plgpu.barrier_arrive(masked)
        plgpu.barrier_wait(masked)

    plgpu.wgmma(acc_ref, a_smem.at[:, pl.ds(cwg * half, half)].transpose((1, 0)),
                b_smem)
    plgpu.wgmma_wait(1)
    return acc_ref


@dataclasses.dataclass(frozen=True)
class _DrhsWarpSpecialized(_DrhsWs):
  """Per item, `plgpu.emit_pipeline_warp_specialized` with a dynamic grid of
  ``chunks`` steps (`_DrhsWs` says what each warpgroup does). A group with rows
  runs at least two steps (a one-step warp-specialized pipeline crashed the
  H200; the extra chunk is all masked).
  """

  pipeline: _pipeline.WarpSpecializedPipeline

  def kernel(self, bounds_ref, lhs_ref, dout_ref, out_ref):
    # The allocations depend on the specs and the stage count, not the grid.
    allocs = self.pipeline.allocations(
        lhs_ref.at[:, pl.ds(0, WS_K)], dout_ref.at[:, pl.ds(0, 2 * self.bn)],
        steps=self.config.num_stages)

    @functools.partial(pl.run_scoped, allocs=allocs, out_smem=self.out_staging(),
                       masked=plgpu.Barrier(num_arrivals=2), collective_axes="wg")
    def _scope(allocs, out_smem, masked):
      wg = lax.axis_index("wg")
      cwg = jnp.minimum(wg, 1)
      o_smem = out_smem.at[cwg]

      @plgpu.nd_loop((self.num_held * self.k_tiles * self.n_tiles,),
                     collective_axes="sm")
      def _item_loop(info):
        self.item(info.index[0], wg, cwg, o_smem, masked, bounds_ref, lhs_ref,
                  dout_ref, out_ref, allocs)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  def item(self, index, wg, cwg, o_smem, masked, bounds_ref, lhs_ref, dout_ref,
           out_ref, allocs):
    """One (group, K tile, N tile) item: its contraction, or zeros."""
    bk, cta_n = self.bk, 2 * self.bn
    g, ki, ni, start, end, first = _drhs_item(index, bounds_ref, self.k_tiles,
                                              self.n_tiles)
    chunks = jnp.where(end > start, jnp.maximum((end - first + bk - 1) // bk, 2), 0)
    k0, n0 = ki * WS_K, ni * cta_n
    store = functools.partial(self.store, cwg, o_smem, out_ref, g, k0, n0)

    held = _held_rows(bounds_ref, self.num_held)
    edge_item = self.edge_item(first, chunks, held)

    def contract(edge):
      # A window from the group's first row; its steps past the array end read
      # zeros (TMA), and rows past `end` are masked anyway.
      rows = pl.ds(first, self.m)
      mma = functools.partial(self.mma, wg, cwg, edge, first, start, end)
      context = functools.partial(self.context, store)
      self.pipeline(mma, context, chunks)(
          lhs_ref.at[rows, pl.ds(k0, WS_K)], dout_ref.at[rows, pl.ds(n0, cta_n)],
          allocations=allocs)

    pl.when((chunks > 0) & ~edge_item)(lambda: contract(None))
    pl.when((chunks > 0) & edge_item)(lambda: contract((masked, held)))

    @pl.when((chunks == 0) & (wg < 2))
    def _empty_group():
      self.store_zeros(store)

  def context(self, store, eval_pipeline):
    @functools.partial(pl.run_scoped, acc_ref=self.acc_type())
    def _acc_scope(acc_ref):
      eval_pipeline(acc_ref)
      self.store_acc(store, acc_ref[...])  # acc_ref[...] waits for the last wgmma.


@dataclasses.dataclass(frozen=True)
class _DrhsChained(_DrhsWs):
  """The "ws" kernel with one ring for all of a block's items (``chain_items``).

  The ring is hand-rolled, since `emit_pipeline_warp_specialized` chains items
  only at a fixed step count and a group's chunk count is known at run time:
  the producer and both consumers count the block's chunks across its items
  (``step``), and chunk ``step`` uses slot ``step % num_stages`` of the ring. So
  the producer loads the next item's first chunks while the consumers finish
  the current item (its last wgmmas and its store), instead of every item
  starting with an empty ring. Each slot has a "full" barrier (the two TMA
  copies arrive) and a "free" one (each consumer arrives once its wgmma of the
  chunk is done; the producer waits on it before refilling the slot).
  """

  def kernel(self, bounds_ref, lhs_ref, dout_ref, out_ref):
    stages, bk, cta_n = self.config.num_stages, self.bk, 2 * self.bn
    swizzled = _common.swizzled
    scratch = dict(
        lhs_smem=plgpu.SMEM((stages, bk, WS_K), self.dtype,
                            transforms=swizzled(self.dtype, WS_K)),
        dout_smem=plgpu.SMEM((stages, bk, cta_n), self.dtype,
                             transforms=swizzled(self.dtype, WS_K)),
        out_smem=self.out_staging(),
        full=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        masked=plgpu.Barrier(num_arrivals=2))

    @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
    def _scope(lhs_smem, dout_smem, out_smem, full, free, masked):
      ring = _pipeline.Ring(stages)
      items = (self.num_held * self.k_tiles * self.n_tiles,)
      wg = lax.axis_index("wg")

      def chunks_of(start, end, first):
        return jnp.where(end > start, (end - first + bk - 1) // bk, 0)

      def producer():
        @plgpu.nd_loop(items, collective_axes="sm", init_carry=jnp.int32(0))
        def _items(info, carry):
          step = carry  # the chunks of the block's earlier items
          g, ki, ni, start, end, first = _drhs_item(
              info.index[0], bounds_ref, self.k_tiles, self.n_tiles)
          del g
          chunks = chunks_of(start, end, first)
          k_cols, n_cols = pl.ds(ki * WS_K, WS_K), pl.ds(ni * cta_n, cta_n)

          @pl.loop(0, chunks)
          def _chunk(c):
            slot = ring.slot(step + c)
            rows = pl.ds(first + c * bk, bk)
            _pipeline.wait_when(ring.reuse(step + c), free.at[slot])
            plgpu.copy_gmem_to_smem(lhs_ref.at[rows, k_cols], lhs_smem.at[slot],
                                    full.at[slot])
            plgpu.copy_gmem_to_smem(dout_ref.at[rows, n_cols], dout_smem.at[slot],
                                    full.at[slot])
          return step + chunks

      def consumer():
        cwg = jnp.minimum(wg, 1)
        o_smem = out_smem.at[cwg]
        held = _held_rows(bounds_ref, self.num_held)

        @plgpu.nd_loop(items, collective_axes="sm", init_carry=jnp.int32(0))
        def _items(info, carry):
          step = carry  # the same count as the producer's
          g, ki, ni, start, end, first = _drhs_item(
              info.index[0], bounds_ref, self.k_tiles, self.n_tiles)
          chunks = chunks_of(start, end, first)
          store = functools.partial(self.store, cwg, o_smem, out_ref, g, ki * WS_K,
                                    ni * cta_n)

          edge_item = self.edge_item(first, chunks, held)

          def contract_item(edge):
            def chunk(c, acc_ref):
              slot = ring.slot(step + c)
              plgpu.barrier_wait(full.at[slot])
              self.mma(wg, cwg, edge, first, start, end, (c,), lhs_smem.at[slot],
                       dout_smem.at[slot], acc_ref)

              # mma waited for the previous chunk's wgmma: its slot is free.
              @pl.when(c > 0)
              def _release_previous():
                plgpu.barrier_arrive(free.at[ring.slot(step + c - 1)])
              return acc_ref

            def contract(acc_ref):
              lax.fori_loop(0, chunks, chunk, acc_ref)
              plgpu.wgmma_wait(0)
              plgpu.barrier_arrive(free.at[ring.slot(step + chunks - 1)])
              return acc_ref[...]
            acc = pl.run_scoped(contract, self.acc_type())
            self.store_acc(store, acc)

          pl.when((chunks > 0) & ~edge_item)(lambda: contract_item(None))
          pl.when((chunks > 0) & edge_item)(lambda: contract_item((masked, held)))

          @pl.when(chunks == 0)
          def _empty_group():
            self.store_zeros(store)
          return step + chunks

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      _pipeline.split_warpgroups(wg, consumer, producer)


def _drhs_warp_specialized(lhs, dout, starts, ends, *, out_dtype,
                           config: RaggedDotConfig) -> jax.Array:
  """``drhs[g] = lhs[rows_g]^T @ dout[rows_g]`` as the forward's kernel shape
  (`_DrhsWarpSpecialized`): items (held group, 128-row K tile, ``2 * block_n``
  N tile), in `_drhs_item`'s order."""
  itemsize = jnp.dtype(lhs.dtype).itemsize
  out_itemsize = jnp.dtype(out_dtype).itemsize
  if config.block_k != 64:
    raise ValueError(f"the 'ws' drhs kernel takes block_k=64; got {config}")
  check_fits(dataclasses.replace(config, block_m=WS_K), itemsize, out_itemsize,
             "ragged_dot drhs (ws)")
  num_held = starts.shape[0]
  m_orig, k_orig = lhs.shape
  n_orig = dout.shape[1]
  bk, cta_n = config.block_k, 2 * config.block_n
  # Whole swizzle widths and at least one tile per operand; reads past the
  # edges within that are zero-filled by TMA, so aligned shapes are not copied.
  lhs = pad_to_multiple(pad_to_multiple(lhs, 0, 8, bk), 1, COLS, WS_K)
  dout = pad_to_multiple(pad_to_multiple(dout, 0, 8, bk), 1, COLS, cta_n)
  m, k = lhs.shape
  n = dout.shape[1]
  k_tiles, n_tiles = pl.cdiv(k, WS_K), pl.cdiv(n, cta_n)
  bounds = jnp.stack([starts, ends], axis=1)
  dtype = lhs.dtype
  fields = dict(config=config, out_dtype=out_dtype, dtype=dtype,
                num_held=num_held, k_tiles=k_tiles, n_tiles=n_tiles, m=m)
  if config.chain_items:
    ws = _DrhsChained(**fields)
  else:
    lhs_spec = _pipeline.tma_spec((bk, WS_K), lambda c: (c, 0), dtype, WS_K)
    dout_spec = _pipeline.tma_spec((bk, cta_n), lambda c: (c, 0), dtype, WS_K)
    ws = _DrhsWarpSpecialized(**fields, pipeline=_pipeline.WarpSpecializedPipeline(
        (lhs_spec, dout_spec), config.num_stages))

  def kernel(bounds_ref, lhs_ref, dout_ref, out_ref):
    ws.kernel(bounds_ref, lhs_ref, dout_ref, out_ref)

  # Whole tiles in the output (sliced after only where K or N is not a tile
  # multiple): every TMA store is a whole swizzled box inside the array.
  k_out, n_out = k_tiles * WS_K, n_tiles * cta_n
  call = _pipeline.persistent_kernel(
      kernel, out_type=jax.ShapeDtypeStruct((num_held, k_out, n_out), out_dtype))
  out = call(bounds, lhs, dout)
  if (k_out, n_out) != (k_orig, n_orig):
    out = out[:, :k_orig, :n_orig]
  return out
