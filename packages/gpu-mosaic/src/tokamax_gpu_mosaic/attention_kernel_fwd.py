"""Attention forward kernel in Pallas Mosaic GPU (Hopper, sm_90), FA3 style.

Grid: query tiles of 128 rows x query heads x batch, launched head by head
where every block does the same work (`akc.head_major`: a head's K and V then
come from HBM once), else one tile of every head at a time, the longest causal
tiles first. Or a block runs several query tiles in turn (`tiles_per_block`, or
`persistent`: one block per SM dealing out every tile): the key ring runs on
from tile to tile, so the producer streams the next tile's keys while the
consumers finish one, and each consumer's next Q tile loads into a second
buffer. Three warpgroups a block:

- a producer (few registers) streams the key and value tiles of ``block_kv`` rows
  by TMA into a ``num_stages``-deep ring of swizzled shared memory; K and V have
  separate "full" barriers (V is needed later) and "free" barriers that both
  consumers arrive on;
- two consumers own 64 query rows each (Q stays in shared memory). Per key tile:
  ``S = Q K^T`` (wgmma, float32), an online softmax in the base-2 domain
  (``p = exp2(s * c - m)`` with ``c = log2(e) * scale``), then ``O += P V``.

Schedules (`AttentionConfig`):

- ping-pong (plain): the consumers share a two-arrival "turn" barrier and
  warpgroup 1 starts one phase later, so one warpgroup's softmax runs while the
  other's matmuls occupy the tensor cores; each passes the turn twice per tile
  (after issuing ``Q K^T``, before issuing ``P V``);
- ``overlap_qk`` (FA3's intra-warpgroup pipelining): a turn issues ``Q K_i^T``
  and ``P_{i-1} V_{i-1}`` together and the softmax of tile i runs while that
  ``P V`` is in flight; the turn is a token (one single-arrival barrier per
  warpgroup), so a warpgroup is never held back after issuing. K slots are
  freed before the older V slots: every release follows this warpgroup's wait
  on the slot's "full" barrier, so no warpgroup arrives twice on one phase of a
  "free" barrier.

Causal (top-left): a warpgroup visits only key tiles that can hold a visible key;
tiles wholly below the diagonal run unmasked. A warpgroup that finishes first
keeps releasing ring slots and passing the turn until its partner is done. Query
tiles run in reverse order (the longest first).

Dynamic features (lengths, window, q_offset, segment ids; plain schedule only):
``[B, 3]`` int32 scalars (valid queries, valid keys, offset); every warpgroup
computes both consumers' key tile ranges ``[lo, fl, fh, hi)`` (`key_range`:
``[fl, fh)`` unmasked) and the producer streams their union; a consumer
releases the union's tiles outside its own range. Segment ids narrow the ranges
by a table XLA computes (`segment_tile_range`); query ids are loaded once, key
ids stream in a small ring next to V. Rows that see no key output 0, lse +inf.
Soft cap: base-2 logits ``cap * log2(e) * tanh(scale * s / cap)``. Sinks join
each row's denominator in the epilogue.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tokamax_gpu_mosaic import _common
from tokamax_gpu_mosaic import _pipeline
from tokamax_gpu_mosaic import attention_kernel_common as akc


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Key rows per pipeline step (``block_kv``) and steps in flight
  (``num_stages``); each block covers 128 query rows (2 warpgroups x 64)."""

  block_kv: int = 128
  num_stages: int = 2
  # Materialize the softmax results before the ping-pong barrier (an
  # optimization barrier), so that the compiler cannot sink the rescaling of O
  # and the row-sum update past it into the partner's turn. With `overlap_qk`:
  # before waiting for ``P V``, so that the softmax really overlaps it.
  fence_softmax: bool = True
  # Intra-warpgroup pipelining (FA3): each turn on the tensor cores issues
  # ``Q K_{j+1}^T`` and ``P_j V_j`` together, and the softmax of tile j+1 runs
  # while ``P_j V_j`` is in flight (same register budget: _fits_registers).
  # False: the plain ping-pong schedule.
  overlap_qk: bool = False
  # Blocks head by head (every query tile of a head, then the next head), so a
  # head's K and V are read from HBM once; False: one query tile of every head at
  # a time (`akc.block_grid`). None: by the measured rule (`akc.head_major`).
  head_major: bool | None = None
  # > 0: blocks in groups of this many (batch row, head) pairs, the longest
  # tiles of the group's heads first (`akc.block_position`): the blocks running
  # at once read a few heads' K and V from L2 where the tile-major order (causal)
  # has every head's in flight. 0: `head_major` decides. With `persistent`: the
  # tiles in that order, dealt as a work queue would (`_Forward.deal`). Not with
  # tiles_per_block.
  head_group: int = 0
  # Query tiles a block runs one after the other (its producer streams the next
  # tile's keys while the consumers finish a tile, and each consumer loads its
  # next Q tile into a second buffer under the current one). 1: a block a tile.
  tiles_per_block: int = 1
  # One block per SM, walking the query tiles of every head and batch row in
  # turn (as `tiles_per_block`, with as many tiles a block as it takes): no
  # partial last wave of blocks. `head_major` does not apply (the tiles go
  # head by head). Which SM runs which tiles: `_Forward.deal`.
  persistent: bool = False

  def __post_init__(self):
    if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
      raise ValueError(f"block_kv must be 64, 128, 192 or 256; got {self.block_kv}")
    if self.num_stages < 2:
      raise ValueError(f"num_stages must be >= 2; got {self.num_stages}")
    if self.tiles_per_block < 1:
      raise ValueError(f"tiles_per_block must be >= 1; got {self.tiles_per_block}")
    if self.persistent and self.tiles_per_block != 1:
      raise ValueError("a persistent block takes as many query tiles as it needs: "
                       f"leave tiles_per_block at 1 (got {self.tiles_per_block})")
    akc.check_head_group(self.head_group, self.head_major)
    if self.head_group and self.tiles_per_block != 1:
      raise ValueError(f"head_group={self.head_group} orders blocks of one query "
                       "tile each, or persistent blocks: not with tiles_per_block "
                       f"> 1 (got {self.tiles_per_block})")

  @property
  def q_buffers(self) -> int:
    """Q tiles in shared memory per consumer: two where a block runs several."""
    return 2 if self.persistent or self.tiles_per_block > 1 else 1


# ----------------------------------------------------------------------------
# The online softmax.


def online_softmax(s, m, l, c: float, visible, soft_cap: float | None = None,
                   guard: bool = False):
  """One online-softmax step on raw scores ``s``; returns (p, m, l, alpha).

  ``m`` is the running row max of the base-2 logits ``s * c``; ``alpha`` moves
  what was accumulated so far onto the new max. Without a soft cap, with
  ``c > 0`` and unmasked or under a dynamic mask (``guard``), the mask and the
  max are taken on ``s`` and the scale is applied in the exp2 argument (one
  FMA per element). A static mask (the causal diagonal, padded keys) keeps the
  scaled logits: there the FMA form ran 0.7-0.8% slower (H100, B2 T8192 N16
  H64 causal forward, two runs; notes/MEASUREMENTS.md session 83), while
  under windows it ran 2-2.4% faster.

  ``guard``: a row may have seen no visible key yet (window, segments, lengths,
  q_offset), so its max may still be -inf; exponentiate against 0 then, which
  keeps p = 0 and alpha finite instead of exp2(-inf + inf) = NaN.
  """
  scale_in_exp2 = soft_cap is None and c > 0 and (visible is None or guard)
  if soft_cap is not None:
    z, _ = akc.soft_capped(s, c, soft_cap)
    if visible is not None:
      z = jnp.where(visible, z, -jnp.inf)
    m_new = jnp.maximum(m, z.max(axis=1))
  elif scale_in_exp2:
    # The scale goes into the exp2's argument (one FMA an entry), the mask
    # onto the raw scores: -inf * c is -inf, and with c > 0 the max of the
    # scaled scores is the scaled max (rounding keeps the order).
    if visible is not None:
      s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1) * c)
  else:
    z = s * c
    if visible is not None:
      z = jnp.where(visible, z, -jnp.inf)
    m_new = jnp.maximum(m, z.max(axis=1))
  if guard:
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  else:
    # Without the dynamic features every visited tile has a visible key in every
    # row, or the row saw key 0 already (causal), so m_new is finite and alpha is
    # exp2(-inf) = 0 only on the first tile.
    m_safe = m_new
  if scale_in_exp2:
    p = jnp.exp2(s * c - akc.bcast_rows(m_safe, s.shape))
  else:
    p = jnp.exp2(z - akc.bcast_rows(m_safe, s.shape))
  alpha = jnp.exp2(m - m_safe)
  l = l * alpha + p.sum(axis=1)
  return p, m_new, l, alpha


def _softmax_update(s, m, l, acc, c: float, visible, soft_cap=None, guard=False):
  """`online_softmax` and the rescaling of ``acc``; returns (p, m, l, acc)."""
  p, m, l, alpha = online_softmax(s, m, l, c, visible, soft_cap, guard)
  return p, m, l, acc * akc.bcast_rows(alpha, acc.shape)


@functools.lru_cache(maxsize=32)
def _list_schedule(work: tuple[int, ...], sms: int) -> np.ndarray:
  """Which positions each of `sms` workers runs, int32 ``[sms, rounds]``, -1
  past a worker's last: list scheduling, the positions in order, each to the
  worker with the least `work` so far (ties: the lowest). That is what a work
  queue would hand out if the work were exact (Pallas has no fetch-and-add to
  build the queue in the kernel), and it keeps the workers' order: the blocks
  running at once stay near each other in it (L2 locality). Equal work: plain
  round-robin."""
  total = len(work)
  rounds = -(-total // sms)
  if len(set(work)) <= 1:
    table = np.arange(rounds * sms, dtype=np.int32).reshape(rounds, sms).T
    table = np.where(table < total, table, -1).astype(np.int32)
    table.setflags(write=False)
    return table
  load = [(0, worker) for worker in range(sms)]
  dealt = [[] for _ in range(sms)]
  for position, cost in enumerate(work):
    done, worker = heapq.heappop(load)
    dealt[worker].append(position)
    heapq.heappush(load, (done + cost, worker))
  table = np.full((sms, max(map(len, dealt))), -1, np.int32)
  for worker, positions in enumerate(dealt):
    table[worker, :len(positions)] = positions
  table.setflags(write=False)  # cached: shared by every call of this shape
  return table


# ----------------------------------------------------------------------------
# Refs and per-block state.


class _Refs(NamedTuple):
  """The kernel's refs in call order: inputs, outputs, scratch (None: absent)."""

  q: Any  # [B, Tp, N, H]
  k: Any  # [B, Sp, K, H]
  v: Any
  lims: Any  # [B, 3] int32 (dynamic features): valid queries, valid keys, offset
  seg_range: Any  # [B, Tp // 64, 2] int32 (segments): key tiles per 64 rows
  q_seg: Any  # [B, Tp] int32
  kv_seg: Any  # [B, Sp] int32
  sinks: Any  # [N] float32
  deal: Any  # [SMs, rounds] int32 (persistent): `_Forward.deal`
  o: Any  # [B, Tp, N, H]
  lse: Any  # [B, N, Tp] float32
  q_smem: Any  # [buffers x 2, 64, H]: each consumer's Q tiles, then output tiles
  k_smem: Any  # [stages, block_kv, H]
  v_smem: Any
  lse_smem: Any  # [2, 64] float32
  q_full: Any  # per buffer and consumer
  k_full: Any  # per slot: the TMA's arrival
  v_full: Any
  k_free: Any  # per slot: both consumers arrive
  v_free: Any
  turn: Any  # ping-pong: a two-party barrier, or a token per warpgroup
  qseg_smem: Any  # [2, 64] int32: each consumer's query ids
  kvseg_smem: Any  # [stages, block_kv] int32: key ids, a ring next to V
  qseg_full: Any
  seg_full: Any


# `_Forward.late_refill`: the most key steps a tile may take for the late refill.
_LATE_REFILL_MAX_STEPS = 12
_SEGMENT_FIELDS = ("seg_range", "q_seg", "kv_seg", "qseg_smem", "kvseg_smem",
                   "qseg_full", "seg_full")


class _Block(NamedTuple):
  """One block's grid position and the key tiles its producer streams."""

  wg: Any
  j: Any  # which of the block's query tiles (0 to `_Forward.rounds` - 1)
  valid: Any  # whether the block has a j-th tile (blocks with fewer skip it)
  qbuf: Any  # Q's shared-memory buffer of this tile
  qi: Any  # query tile (reversed where the longest tiles go first)
  batch: Any
  head: Any
  tile0: Any  # first query row
  ring: _pipeline.Ring  # slots counted from the first streamed tile
  n_block: Any  # streamed tiles: [ring.start, n_block)
  ranges: Any  # dynamic: both consumers' (lo, fl, fh, hi); else None
  limits: Any  # dynamic: (q_limit, kv_limit, offset); else Nones
  pass_turn: Any  # the ping-pong pass (one object: its traced branch is shared)


class _Tiles(NamedTuple):
  """One consumer warpgroup's rows and key tiles."""

  r0: Any  # first query row
  q_tile: Any  # its Q tile in shared memory
  lo: Any  # dynamic: [lo, fl) masked, [fl, fh) unmasked, [fh, n_own) masked
  fl: Any
  fh: Any
  n_own: Any  # key tiles it needs: [lo or 0, n_own)
  n_clear: Any  # static: tiles before it need no mask
  q_ids: Any  # segments: its query ids (registers)


# ----------------------------------------------------------------------------
# The kernel.


@dataclasses.dataclass(frozen=True)
class _Forward:
  """The static shape of one forward call; its methods are the kernel's stages."""

  b: int
  tp: int
  n: int
  h: int
  group: int  # query heads per key/value head
  sp: int
  config: Any
  causal: bool
  s_true: int
  feat: akc.Features
  dtype: Any
  has_sinks: bool
  scale: float

  @property
  def c(self):
    """Scores to base-2 logits."""
    return float(self.scale) * akc.LOG2E

  @property
  def bq(self):
    return akc.WG_ROWS

  @property
  def bkv(self):
    return self.config.block_kv

  @property
  def stages(self):
    return self.config.num_stages

  @property
  def nq(self):
    return self.tp // akc.CTA_ROWS

  @property
  def n_kv(self):
    return self.sp // self.bkv

  @property
  def q_blocks(self):
    """Blocks along the query tiles (the grid's "q" axis; not persistent)."""
    return _common.cdiv(self.nq, self.config.tiles_per_block)

  @property
  def rounds(self):
    """Query tiles a block runs in turn (a block's last ones may be absent)."""
    if self.config.persistent:
      return self.deal.shape[1]
    return self.config.tiles_per_block

  @functools.cached_property
  def deal(self) -> np.ndarray:
    """Persistent: which tiles each SM runs, int32 ``[SMs, rounds]``: positions
    in the run order (`tile_of`), -1 past an SM's last (`_list_schedule`, with
    a tile's work its key steps by position plus one for its Q load and output
    store).

    Head groups restart the longest causal tiles every group; a fixed
    round-robin deal (or a snake) then gave the same SMs a long tile every
    round where a group spans about two rounds (H200, B4 T4096 N16 H128 causal
    forward 0.688 ms against 0.439 for a block a tile; notes/MEASUREMENTS.md
    session 33).
    """
    work = self.tile_steps()[self.run_tile(self.position_tiles())] + 1
    return _list_schedule(tuple(work.tolist()), _common.num_sms())

  @functools.cached_property
  def late_refill(self) -> bool:
    """Under `overlap_qk` with two Q buffers: whether the previous tile's
    output-copy wait and the next tile's Q prefetch run once the tile's first
    Q K^T is issued (`overlapped`), not before the schedule.

    H100, bf16, forward, CUPTI, 10 interleaved rounds (notes/MEASUREMENTS.md
    session 95, items 1-2), late / early: faster where every tile is short (W512
    1.015x, W1024 1.015x MHA and 1.021x GQA, B8 T1024 causal 1.018x: at most 9
    key steps a tile), slower at long windowed tiles (W2048 0.990x, W4096
    0.983x and 0.992x: 17 and 33 steps), even at full-length tiles (T4096 causal,
    T8192 and T16384). This rule against its other side, again: 1.014x W1024,
    1.026x T1024 causal, 1.008x W2048, 1.013x W4096. The bound sits between the
    measured 9 and 17 steps.
    """
    return int(self.tile_steps().max()) <= _LATE_REFILL_MAX_STEPS

  def position_tiles(self) -> np.ndarray:
    """The tile along its head's run order at each position of the persistent
    blocks' order: `akc.grouped_position`'s first result with `head_group`,
    else the position modulo the tiles of a head (NumPy, at trace time)."""
    total, tiles = self.nq * self.n * self.b, self.nq
    flat = np.arange(total)
    g = self.config.head_group
    if not g:
      return flat % tiles
    pairs = self.n * self.b
    g = min(g, pairs)
    group = flat // (g * tiles)
    size = np.minimum(g, pairs - group * g)  # a short last group
    return (flat - group * g * tiles) // size

  def tile_steps(self) -> np.ndarray:
    """Key tiles each query tile visits by position alone (lengths, segment ids
    and q_offset aside, which only the kernel knows), int ``[nq]``: the
    bounds of `akc.key_range` (dynamic) or `kv_end` (static), in NumPy."""
    r0 = np.arange(self.nq) * akc.CTA_ROWS
    cdiv = lambda x, d: -(-x // d)
    if not self.feat.dynamic:
      return (np.minimum(cdiv(r0 + akc.CTA_ROWS, self.bkv), self.n_kv) if self.causal
              else np.full(self.nq, self.n_kv))
    left, right = self.feat.left, self.feat.right
    lo = 0 if left is None else np.maximum(r0 - left, 0)
    hi = (np.full(self.nq, self.s_true) if right is None
          else np.minimum(self.s_true, r0 + akc.CTA_ROWS + right))
    lo_t = lo // self.bkv
    return np.maximum(cdiv(np.maximum(hi, 0), self.bkv), lo_t) - lo_t

  def run_tile(self, pos):
    """The query tile at `pos` along a head's run order: the longest first
    where the tiles shorten (causal, or a window's right side)."""
    if self.causal or self.feat.right is not None:
      return self.nq - 1 - pos
    return pos

  def grid(self) -> dict:
    if self.config.persistent:
      return dict(grid=(self.deal.shape[0],), grid_names=("sm",))
    return akc.block_grid(self.q_blocks, self.n, self.b, "q",
                          akc.head_major(self.config.head_major, self.causal,
                                         self.feat), self.config.head_group)

  @property
  def pad_keys(self):
    return self.s_true % self.bkv != 0

  @property
  def needs_mask(self):
    return self.causal or self.pad_keys

  @property
  def mask_keys(self):
    # Keys past the valid ones can sit in a visited tile: mask them there.
    return self.pad_keys or self.feat.kv_len

  def kv_end(self, row_end):
    return akc.kv_end(row_end, self.causal, self.bkv, self.n_kv)

  def bind(self, refs) -> _Refs:
    absent = set()
    if not self.feat.dynamic:
      absent.add("lims")
    if not self.feat.segments:
      absent.update(_SEGMENT_FIELDS)
    if not self.has_sinks:
      absent.add("sinks")
    if not self.config.persistent:
      absent.add("deal")
    return _pipeline.bind_refs(_Refs, refs, absent)

  def tile_of(self, r: _Refs, j):
    """The block's `j`-th query tile: (tile, batch row, head, whether the block
    has one).

    Persistent: the tiles in the order query tile, head, batch row (with
    `head_group`: that group order), as `deal` gives them to this SM (the
    blocks running at once share the heads' K and V in L2). Otherwise block
    ``q`` runs the tiles at positions ``j * q_blocks + q``
    of its head's run order, every other round from the other end
    (``q_blocks - 1 - q``): where the tiles shorten along the run order
    (causal, the longest first), the blocks' totals stay close to each other.
    """
    if self.config.persistent:
      group = self.config.head_group
      # j may be one past the last round (`prefetch_next_q`): no tile there.
      flat = r.deal[lax.axis_index("sm"), jnp.minimum(j, self.rounds - 1)]
      valid = (j < self.rounds) & (flat >= 0)
      flat = jnp.maximum(flat, 0)  # a tile that exists, never run
      if group:
        pos, hi, bi = akc.grouped_position(flat, self.nq, self.n, self.b, group)
      else:
        pos, rest = lax.rem(flat, self.nq), lax.div(flat, self.nq)
        hi, bi = lax.rem(rest, self.n), lax.div(rest, self.n)
    else:
      q, hi, bi = akc.block_position(self.q_blocks, self.n, self.b, "q",
                                     self.config.head_group)
      if self.config.tiles_per_block == 1:
        pos, valid = q, True
      else:
        back = self.q_blocks - 1 - q
        pos = j * self.q_blocks + jnp.where(lax.rem(j, 2) == 0, q, back)
        valid = pos < self.nq
        pos = jnp.minimum(pos, self.nq - 1)  # a tile that exists, never run
    return self.run_tile(pos), bi, hi, valid

  def block(self, r: _Refs, j=0, streamed=0) -> _Block:
    """The block's `j`-th tile; its ring continues after `streamed` key tiles.
    With dynamic features, the union of both consumers' key tiles, which every
    warpgroup computes from the same scalars so that all three agree."""
    wg = lax.axis_index("wg")
    qi, bi, hi, valid = self.tile_of(r, j)
    tile0 = qi * akc.CTA_ROWS
    ranges, limits = None, (None, None, None)
    if self.feat.dynamic:
      limits = akc.batch_limits(r.lims, bi)
      ranges = akc.consumer_ranges(akc.key_range, tile0, qi, bi, limits, self.feat,
                                   self.bkv, r.seg_range)
      base, n_block = akc.union(*((x[0], x[3]) for x in ranges))
    else:
      base = None
      n_block = self.kv_end(tile0 + akc.CTA_ROWS)  # steps the producer streams
    qbuf = 0 if self.config.q_buffers == 1 else lax.rem(j, 2)
    return _Block(wg, j, valid, qbuf, qi, bi, hi, tile0,
                  _pipeline.Ring(self.stages, base, streamed), n_block, ranges, limits,
                  functools.partial(_pipeline.pass_turn, r.turn))

  def run_tiles(self, r: _Refs, role) -> None:
    """`role(r, block)` (a consumer's or the producer's work) for each of the
    block's query tiles, the ring's slots counted on from tile to tile."""
    if self.rounds == 1 and not self.config.persistent:
      role(r, self.block(r))
      return

    def tile(j, streamed):
      blk = self.block(r, j, streamed)
      pl.when(blk.valid)(lambda: role(r, blk))
      return streamed + jnp.where(blk.valid, blk.n_block - blk.ring.start, 0)
    lax.fori_loop(0, self.rounds, tile, jnp.int32(0))

  # -- Consumers ---------------------------------------------------------------

  def consumer(self, r: _Refs, blk: _Block) -> None:
    """Load Q, run the schedule over this warpgroup's key tiles, store O, lse."""
    wg, bq = blk.wg, self.bq
    r0 = blk.tile0 + wg * bq
    q_tile, q_full = self.q_buffer(r, blk.qbuf, wg)
    refill = None
    if self.config.q_buffers == 1:
      self.load_q(r, blk.batch, blk.head, r0, q_tile, q_full)
    else:
      pl.when(blk.j == 0)(
          lambda: self.load_q(r, blk.batch, blk.head, r0, q_tile, q_full))

      def refill():
        # The previous tile's output copies read the buffer the prefetch fills:
        # waited for in this tile (after its scalars; under overlap_qk with short
        # tiles after its first Q K^T's issue), not at that epilogue's end.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        self.prefetch_next_q(r, blk)
      if not (self.config.overlap_qk and self.late_refill):
        refill()
        refill = None
    if self.feat.segments:
      plgpu.copy_gmem_to_smem(r.q_seg.at[blk.batch, pl.ds(r0, bq)],
                              r.qseg_smem.at[wg], r.qseg_full.at[wg])
    tiles = self.own_tiles(blk, r0, q_tile)
    if self.feat.segments:
      plgpu.barrier_wait(r.qseg_full.at[wg])
      tiles = tiles._replace(q_ids=_common.load(r.qseg_smem.at[wg],
                                                layout=plgpu.Layout.WGMMA.reduce(1)))
    carry = (plgpu.layout_cast(jnp.zeros((bq, self.h), jnp.float32),
                               plgpu.Layout.WGMMA),
             akc.row_vector(-jnp.inf), akc.row_vector(0.0))
    plgpu.barrier_wait(q_full)
    if self.config.overlap_qk:
      carry = self.overlapped(r, blk, tiles, carry, refill)
    else:
      carry = self.pingpong(r, blk, tiles, carry)
    self.epilogue(r, blk, tiles, carry)

  def q_buffer(self, r: _Refs, qbuf, wg):
    """A consumer's Q tile in buffer `qbuf` and the barrier its load arrives on."""
    return r.q_smem.at[qbuf * 2 + wg], r.q_full.at[qbuf * 2 + wg]

  def load_q(self, r: _Refs, batch, head, r0, q_tile, q_full) -> None:
    plgpu.copy_gmem_to_smem(r.q.at[batch, pl.ds(r0, self.bq), head], q_tile, q_full)

  def prefetch_next_q(self, r: _Refs, blk: _Block) -> None:
    """Start loading this warpgroup's Q rows of the block's next tile into the
    other buffer (its previous tile's output has been stored from it)."""
    nxt = blk.j + 1
    qi, bi, hi, valid = self.tile_of(r, nxt)
    q_tile, q_full = self.q_buffer(r, 1 - blk.qbuf, blk.wg)
    r0 = qi * akc.CTA_ROWS + blk.wg * self.bq

    @pl.when(jnp.logical_and(nxt < self.rounds, valid))
    def _():
      self.load_q(r, bi, hi, r0, q_tile, q_full)

  def own_tiles(self, blk: _Block, r0, q_tile) -> _Tiles:
    """This warpgroup's key tiles (dynamic: an empty range becomes [base, base),
    so that every streamed tile is released after the empty loops; under
    `overlap_qk`, whose first turn computes a tile, the masked tile [base,
    base + 1): only a warpgroup of padded rows has none there, see
    `akc.overlap_takes`)."""
    lo = fl = fh = n_clear = None
    if self.feat.dynamic:
      own = [jnp.where(blk.wg == 0, x0, x1) for x0, x1 in zip(*blk.ranges)]
      empty = own[3] <= own[0]
      base = blk.ring.base
      instead = (base,) * 4
      if self.config.overlap_qk:
        instead = (base, base + 1, base + 1, base + 1)
      lo, fl, fh, n_own = [jnp.where(empty, y, x) for x, y in zip(own, instead)]
    elif self.causal:
      n_own = self.kv_end(r0 + self.bq)
      # Tiles whose every key is <= the first row (and < S) need no mask.
      n_clear = jnp.minimum(lax.div(r0 + 1, self.bkv), self.s_true // self.bkv)
    else:
      n_own = self.kv_end(r0 + self.bq)
      n_clear = self.s_true // self.bkv
    return _Tiles(r0, q_tile, lo, fl, fh, n_own, n_clear, None)

  def visibility(self, r: _Refs, blk: _Block, tiles: _Tiles, i):
    """Which scores of key tile `i` are kept (None: all)."""
    shape = (self.bq, self.bkv)

    def segment_match():
      slot = blk.ring.slot(i)
      plgpu.barrier_wait(r.seg_full.at[slot])
      return akc.same_segment(tiles.q_ids, r.kvseg_smem.at[slot], shape)
    if self.feat.dynamic:
      _, kv_limit, off = blk.limits
      return akc.visible_by_rows(
          tiles.r0, i * self.bkv, shape, self.feat,
          kv_limit=kv_limit if self.mask_keys else None, off=off,
          segment_match=segment_match)
    rows = _pipeline.wgmma_iota(shape, 0) + tiles.r0
    cols = _pipeline.wgmma_iota(shape, 1) + i * self.bkv
    return akc.visible(rows, cols, self.feat, dynamic=False, causal=self.causal,
                       s_true=self.s_true if self.pad_keys else None)

  def pingpong(self, r: _Refs, blk: _Block, tiles: _Tiles, carry):
    """The plain schedule: S, softmax, then O += P V, two turns per tile."""
    wg, pass_turn = blk.wg, blk.pass_turn
    step = functools.partial(self.pingpong_step, r, blk, tiles)
    if self.feat.dynamic:
      # [base, lo) released, [lo, fl) masked, [fl, fh) unmasked, [fh, hi)
      # masked, [hi, n_block) released; the ping-pong count stays two passes
      # per streamed tile for each warpgroup.
      pl.when(wg == 1)(pass_turn)
      if self.feat.left is not None or self.feat.segments:
        lax.fori_loop(blk.ring.base, tiles.lo,
                      functools.partial(self.release_unused, r, blk), None)

      @pl.when(tiles.lo < tiles.n_own)
      def _():
        plgpu.barrier_wait(r.k_full.at[blk.ring.slot(tiles.lo)])
      masked = functools.partial(step, masked=True)
      carry = lax.fori_loop(tiles.lo, tiles.fl, masked, carry)
      carry = lax.fori_loop(tiles.fl, tiles.fh, functools.partial(step, masked=False),
                            carry)
      carry = lax.fori_loop(tiles.fh, tiles.n_own, masked, carry)
      lax.fori_loop(tiles.n_own, blk.n_block,
                    functools.partial(self.release_pingpong, r, blk), None)
      pl.when(wg == 0)(pass_turn)
      return carry

    plgpu.barrier_wait(r.k_full.at[blk.ring.slot(0)])  # n_own >= 1 always
    pl.when(wg == 1)(pass_turn)  # warpgroup 1 runs one phase behind
    if self.needs_mask:
      carry = lax.fori_loop(0, tiles.n_clear, functools.partial(step, masked=False),
                            carry)
      carry = lax.fori_loop(tiles.n_clear, tiles.n_own,
                            functools.partial(step, masked=True), carry)
    else:
      carry = lax.fori_loop(0, self.n_kv, functools.partial(step, masked=False),
                            carry)
    if self.causal:
      lax.fori_loop(tiles.n_own, blk.n_block,
                    functools.partial(self.release_pingpong, r, blk), None)
    pl.when(wg == 0)(pass_turn)
    return carry

  def pingpong_step(self, r: _Refs, blk: _Block, tiles: _Tiles, i, carry,
                    masked: bool):
    """Key tile `i`: S = Q K^T (then pass the turn), softmax, O += P V."""
    acc, m, l = carry
    slot = blk.ring.slot(i)

    def scores(s_acc):
      plgpu.wgmma(s_acc, tiles.q_tile, r.k_smem.at[slot].T)
      blk.pass_turn()  # partner's softmax done: the tensor cores are ours next
      return s_acc[...]
    s = pl.run_scoped(scores, plgpu.ACC((self.bq, self.bkv), jnp.float32))
    plgpu.barrier_arrive(r.k_free.at[slot])

    visible = self.visibility(r, blk, tiles, i) if masked else None
    p, m, l, acc = _softmax_update(s, m, l, acc, self.c, visible, self.feat.soft_cap,
                                   guard=self.feat.dynamic and masked)
    p = p.astype(self.dtype)
    if self.config.fence_softmax:
      p, m, l, acc = lax.optimization_barrier((p, m, l, acc))

    plgpu.barrier_arrive(r.turn)
    plgpu.barrier_wait(r.v_full.at[slot])
    plgpu.barrier_wait(r.turn)

    def wait_next_k():
      nxt = i + 1

      @pl.when(nxt < tiles.n_own)
      def _():  # overlaps the wait for the next K with this matmul
        plgpu.barrier_wait(r.k_full.at[blk.ring.slot(nxt)])
    (acc,) = _common.accumulate((acc,), ((p, r.v_smem.at[slot]),),
                                after_issue=wait_next_k)
    plgpu.barrier_arrive(r.v_free.at[slot])
    return acc, m, l

  def release_pingpong(self, r: _Refs, blk: _Block, i, _):
    """A tile after this warpgroup's range (causal, window, lengths): free the
    slot for the producer and keep the ping-pong barrier's count in step with
    the partner. Where the block runs more query tiles, the slot is waited on
    first (`release_unused`): the ring's later laps wait on its barriers again."""
    if self.rounds > 1:
      self.release_unused(r, blk, i, _)
      return
    slot = blk.ring.slot(i)
    _pipeline.release(r.k_free.at[slot], r.v_free.at[slot])
    blk.pass_turn()
    blk.pass_turn()

  def release_unused(self, r: _Refs, blk: _Block, i, _):
    """A streamed tile outside this warpgroup's range (before it: left window,
    segments; after it, where the block runs more query tiles). Its "full"
    barriers are waited on although unused: barrier phases are tracked per
    warpgroup by counting waits, and it waits on the same slots again later."""
    slot = blk.ring.slot(i)
    plgpu.barrier_wait(r.k_full.at[slot])
    plgpu.barrier_arrive(r.k_free.at[slot])
    if self.feat.segments:
      plgpu.barrier_wait(r.seg_full.at[slot])
    plgpu.barrier_wait(r.v_full.at[slot])
    plgpu.barrier_arrive(r.v_free.at[slot])
    blk.pass_turn()
    blk.pass_turn()

  def overlapped(self, r: _Refs, blk: _Block, tiles: _Tiles, carry, refill=None):
    """`overlap_qk`: a turn issues Q K_i^T and P_{i-1} V_{i-1} together; the
    softmax of tile i runs while P_{i-1} V_{i-1} is in flight. `refill` (two Q
    buffers: the previous tile's output-copy wait and the next tile's Q
    prefetch) runs once the first Q K^T is issued.

    The turn is a token: `turn` holds one single-arrival barrier per warpgroup;
    a warpgroup waits on its own before issuing and arrives on its partner's
    right after; warpgroup 1 hands warpgroup 0 the first token.
    """
    acc, m, l = carry
    wg = blk.wg
    mine, theirs = r.turn.at[wg], r.turn.at[1 - wg]
    release = functools.partial(self.release_overlapped, r, blk, mine, theirs)
    # Warpgroup 1 hands warpgroup 0 the first token of the block only: after
    # each tile, warpgroup 1's last turn has left warpgroup 0 the next one.
    # Each warpgroup takes one turn per streamed tile, its own or released.
    pl.when(jnp.logical_and(wg == 1, blk.j == 0))(
        lambda: plgpu.barrier_arrive(r.turn.at[0]))
    start = 0
    if self.feat.dynamic:  # a window (`akc.overlap_takes`): [lo, n_own) is not empty
      lax.fori_loop(blk.ring.base, tiles.lo, release, None)  # the partner's only
      start = tiles.lo
    # The first tile: its Q K^T is this warpgroup's whole first turn. The mask
    # is built whenever any tile may need one (cheaper than a dynamic branch).
    first = blk.ring.slot(start)
    plgpu.barrier_wait(r.k_full.at[first])
    plgpu.barrier_wait(mine)

    def first_scores(s_acc):
      plgpu.wgmma(s_acc, tiles.q_tile, r.k_smem.at[first].T)
      plgpu.barrier_arrive(theirs)
      if refill is not None:
        # Under the matmul, which this warpgroup waits for next anyway (where
        # the tiles are short: `late_refill`).
        refill()
      return s_acc[...]
    s = pl.run_scoped(first_scores, plgpu.ACC((self.bq, self.bkv), jnp.float32))
    plgpu.barrier_arrive(r.k_free.at[first])
    p, m, l, _ = self.overlap_softmax(
        r, blk, tiles, s, m, l, start,
        self.needs_mask or self.feat.dynamic)  # alpha = 0 and O = 0
    p = p.astype(self.dtype)

    step = functools.partial(self.overlap_step, r, blk, tiles, mine, theirs)
    masked, unmasked = (functools.partial(step, masked=x) for x in (True, False))
    carry = (acc, m, l, p)
    if self.feat.dynamic:
      # [start + 1, fl) masked (the window's left edge), [fl, fh) unmasked,
      # [fh, n_own) masked (the diagonal, padded keys).
      fl = jnp.maximum(tiles.fl, start + 1)
      fh = jnp.maximum(tiles.fh, fl)
      carry = lax.fori_loop(start + 1, fl, masked, carry)
      carry = lax.fori_loop(fl, fh, unmasked, carry)
      carry = lax.fori_loop(fh, tiles.n_own, masked, carry)
    elif self.needs_mask:
      split = jnp.maximum(tiles.n_clear, 1)
      carry = lax.fori_loop(1, split, unmasked, carry)
      carry = lax.fori_loop(split, tiles.n_own, masked, carry)
    else:
      carry = lax.fori_loop(1, self.n_kv, unmasked, carry)
    acc, m, l, p = carry

    # The last P V, outside the turns (as in FA3).
    last = blk.ring.slot(tiles.n_own - 1)
    plgpu.barrier_wait(r.v_full.at[last])
    (acc,) = _common.accumulate((acc,), ((p, r.v_smem.at[last]),))
    plgpu.barrier_arrive(r.v_free.at[last])
    if self.causal or self.feat.dynamic:
      lax.fori_loop(tiles.n_own, blk.n_block, release, None)
    return acc, m, l

  def overlap_softmax(self, r, blk, tiles, s, m, l, i, masked: bool):
    """The softmax of tile `i` (fenced: computed before waiting for P V)."""
    p, m, l, alpha = online_softmax(
        s, m, l, self.c, self.visibility(r, blk, tiles, i) if masked else None,
        self.feat.soft_cap, guard=self.feat.dynamic and masked)
    if self.config.fence_softmax:
      p, m, l, alpha = lax.optimization_barrier((p, m, l, alpha))
    return p, m, l, alpha

  def overlap_step(self, r: _Refs, blk: _Block, tiles: _Tiles, mine, theirs, i,
                   carry, masked: bool):
    """Key tile i >= 1: one turn issues S_i = Q K_i^T and O += P_{i-1} V_{i-1};
    the softmax of S_i runs while that P V is in flight."""
    acc, m, l, p = carry  # acc is already on the running max m
    slot, prev = blk.ring.slot(i), blk.ring.slot(i - 1)
    plgpu.barrier_wait(r.k_full.at[slot])
    plgpu.barrier_wait(mine)

    def turn_then_softmax(s_acc, o_acc):
      o_acc[...] = acc
      plgpu.wgmma(s_acc, tiles.q_tile, r.k_smem.at[slot].T)
      plgpu.barrier_wait(r.v_full.at[prev])
      plgpu.wgmma(o_acc, p, r.v_smem.at[prev])
      plgpu.barrier_arrive(theirs)
      # Matmul groups complete in order: this waits for Q K^T only.
      s = plgpu.wgmma_accumulator_load(s_acc, wait_n=1)
      plgpu.barrier_arrive(r.k_free.at[slot])
      p_new, m_new, l_new, alpha = self.overlap_softmax(r, blk, tiles, s, m, l, i,
                                                        masked)
      o = plgpu.wgmma_accumulator_load(o_acc, wait_n=0)
      # Only now (as FA3): O is rescaled and P_i takes the 16-bit form it is
      # carried in. Converted earlier, P_i could be given the registers of the
      # loop-carried P_{i-1} that the in-flight P V still reads.
      return (o * akc.bcast_rows(alpha, o.shape), m_new, l_new,
              p_new.astype(self.dtype))
    carry = pl.run_scoped(turn_then_softmax,
                          plgpu.ACC((self.bq, self.bkv), jnp.float32),
                          plgpu.ACC((self.bq, self.h), jnp.float32))
    plgpu.barrier_arrive(r.v_free.at[prev])
    return carry

  def release_overlapped(self, r: _Refs, blk: _Block, mine, theirs, i, _):
    """A tile this warpgroup does not need (causal, window; segments, whose key
    ids would need their own wait, never take this schedule): pass the
    partner's turn on, and free the slot only once it is full. Being ahead, this warpgroup could
    otherwise arrive on a slot's "free" barrier twice before the partner's
    arrival for the older tile (2 stages), which would release it early."""
    slot = blk.ring.slot(i)
    plgpu.barrier_wait(mine)
    plgpu.barrier_arrive(theirs)
    plgpu.barrier_wait(r.k_full.at[slot])
    plgpu.barrier_arrive(r.k_free.at[slot])
    plgpu.barrier_wait(r.v_full.at[slot])
    plgpu.barrier_arrive(r.v_free.at[slot])

  def epilogue(self, r: _Refs, blk: _Block, tiles: _Tiles, carry) -> None:
    """O / l and the natural lse (sinks joined), staged in Q's shared memory."""
    acc, m, l = carry
    bq, r0 = self.bq, tiles.r0
    lse_tile = r.lse_smem.at[blk.wg]
    valid = None
    if self.feat.dynamic:
      # Rows that saw no key (l = 0) or lie past the valid queries: output 0
      # and lse +inf (the contract), never NaN (the guarded softmax kept every
      # value finite).
      valid = l > 0
      if self.feat.q_len:
        rows = plgpu.broadcasted_iota(jnp.int32, (bq,), 0,
                                      layout=plgpu.Layout.WGMMA.reduce(1)) + r0
        valid = valid & (rows < blk.limits[0])
      l = jnp.where(valid, l, 1.0)
    inv = 1.0 / l
    lse = m * akc.LN2 + jnp.log(l)
    if self.has_sinks:
      # The sink joins the denominator: rows scale by sum / (sum + e^sink) =
      # e^(lse - lse_with_sink) <= 1, and the lse takes it in (a stable
      # logaddexp).
      sink = r.sinks[blk.head]
      top = jnp.maximum(lse, sink)
      with_sink = top + jnp.log(jnp.exp(lse - top) + jnp.exp(sink - top))
      inv = inv * jnp.exp(lse - with_sink)
      lse = with_sink
    if valid is not None:
      inv = jnp.where(valid, inv, 0.0)
      lse = jnp.where(valid, lse, jnp.inf)
    out = acc * akc.bcast_rows(inv, acc.shape)
    tiles.q_tile[...] = out.astype(self.dtype)  # Q is no longer read: stage O
    lse_tile[...] = lse
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tiles.q_tile, r.o.at[blk.batch, pl.ds(r0, bq), blk.head])
    plgpu.copy_smem_to_gmem(lse_tile, r.lse.at[blk.batch, blk.head, pl.ds(r0, bq)])
    # Until the copies have read the tiles, not until O and lse land: nothing in
    # the kernel reads them back, and the launch's end makes them visible. 1.5-2.2%
    # off the W1024 and T1024 forward on the H100 (notes/MEASUREMENTS.md session 88).
    # With two Q buffers the next tile waits, before its Q prefetch refills this
    # buffer (`consumer`): 0.3-1.5% off the windowed forward on the H100 (session 93).
    if self.config.q_buffers == 1:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  def consumer_tiles(self, r: _Refs) -> None:
    """Every query tile of a consumer warpgroup; with two Q buffers, then the
    wait for its last output copies to have read shared memory."""
    self.run_tiles(r, self.consumer)
    if self.config.q_buffers == 2:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  # -- Producer ----------------------------------------------------------------

  def producer(self, r: _Refs, blk: _Block) -> None:
    """Stream the block's key tiles (K, V and key ids) into the ring."""
    kv_head = lax.div(blk.head, self.group)
    bkv, ring = self.bkv, blk.ring

    def issue(i, _):
      slot = ring.slot(i)
      rows = (blk.batch, pl.ds(i * bkv, bkv), kv_head)
      reuse = ring.reuse(i)
      _pipeline.refill(reuse, r.k_free.at[slot], r.k.at[rows], r.k_smem.at[slot],
                       r.k_full.at[slot])
      _pipeline.refill(reuse, r.v_free.at[slot], r.v.at[rows], r.v_smem.at[slot],
                       r.v_full.at[slot])
      if self.feat.segments:
        # The key ids are read in the softmax, after K's slot is freed: they
        # share V's slot lifetime.
        plgpu.copy_gmem_to_smem(r.kv_seg.at[blk.batch, pl.ds(i * bkv, bkv)],
                                r.kvseg_smem.at[slot], r.seg_full.at[slot])
    lax.fori_loop(ring.start, blk.n_block, issue, None)

  # -- The call ----------------------------------------------------------------

  def scratch(self):
    bq, bkv, h, stages = self.bq, self.bkv, self.h, self.stages
    transforms = _common.swizzled(self.dtype, h)
    segments = self.feat.segments
    kv_ring = lambda: plgpu.SMEM((stages, bkv, h), self.dtype, transforms=transforms)
    return _pipeline.in_field_order(
        _Refs,
        q_smem=plgpu.SMEM((2 * self.config.q_buffers, bq, h), self.dtype,
                          transforms=transforms),
        k_smem=kv_ring(), v_smem=kv_ring(),
        lse_smem=plgpu.SMEM((2, bq), jnp.float32),
        q_full=plgpu.Barrier(num_barriers=2 * self.config.q_buffers),
        k_full=plgpu.Barrier(num_barriers=stages),
        v_full=plgpu.Barrier(num_barriers=stages),
        k_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        v_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        turn=(plgpu.Barrier(num_barriers=2) if self.config.overlap_qk
              else plgpu.Barrier(num_arrivals=2)),
        qseg_smem=plgpu.SMEM((2, bq), jnp.int32) if segments else None,
        kvseg_smem=plgpu.SMEM((stages, bkv), jnp.int32) if segments else None,
        qseg_full=plgpu.Barrier(num_barriers=2) if segments else None,
        seg_full=plgpu.Barrier(num_barriers=stages) if segments else None)


def flash_forward(q, k, v, *extras, scale: float, causal: bool, s_true: int,
                  config: AttentionConfig, feat: akc.Features = akc.PLAIN, sinks=None):
  """The kernel on q [B, T, N, H], k/v [B, S, K, H] as `_common.pad_rows_for_tma`
  leaves them; it runs ``Tp`` = T rounded up to 128 query rows and ``Sp`` = S to
  ``block_kv`` keys; keys at or past `s_true` are masked.

  `extras` (int32): with `feat.dynamic`, ``lims [B, 3]`` = (valid queries,
  valid keys, q_offset) per batch element; with `feat.segments` also the
  segment tile ranges ``[B, Tp // 64, 2]``, q ids ``[B, Tp]`` and kv ids
  ``[B, Sp]``. `sinks`: None or float32 ``[N]``, one logit per head joining
  each row's denominator in the epilogue (it takes no value).

  Returns (out [B, T, N, H] in q's dtype, lse [B, N, Tp] float32, natural log).
  """
  b, t, n, h = q.shape
  tp = _common.cdiv(t, akc.CTA_ROWS) * akc.CTA_ROWS
  sp = _common.cdiv(k.shape[1], config.block_kv) * config.block_kv
  if config.overlap_qk and _common.interpreting():
    raise NotImplementedError(
        "overlap_qk in the Mosaic GPU interpreter: it has no rule for a store "
        "into a WGMMA accumulator; use the plain schedule (overlap_qk=False)")
  fwd = _Forward(b=b, tp=tp, n=n, h=h, group=n // k.shape[2], sp=sp,
                 config=config, causal=causal, s_true=s_true, feat=feat,
                 dtype=q.dtype, has_sinks=sinks is not None, scale=scale)

  def body(*refs):
    r = fwd.bind(refs)
    _pipeline.split_warpgroups(lax.axis_index("wg"),
                               lambda: fwd.consumer_tiles(r),
                               lambda: fwd.run_tiles(r, fwd.producer))

  call = _pipeline.warpgroup_kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((b, t, n, h), q.dtype),
                jax.ShapeDtypeStruct((b, n, tp), jnp.float32)),
      scratch_types=fwd.scratch(),
      **fwd.grid())
  deal = (jnp.asarray(fwd.deal),) if config.persistent else ()
  return call(q, k, v, *extras, *(() if sinks is None else (sinks,)), *deal)


def mosaic_attention(q, k, v, *, scale: float, causal: bool,
                     config: AttentionConfig, local_window=None,
                     logits_soft_cap: float | None = None,
                     query_seq_lengths=None, key_value_seq_lengths=None,
                     q_segment_ids=None, kv_segment_ids=None, q_offset=None,
                     sinks=None):
  """Attention forward on [B, T, N, H] / [B, S, K, H] inputs (pads odd lengths).

  The optional arguments mean what `AttentionArgs`' fields of the same names
  mean (lengths int32 [B], segment ids int32 [B, T] / [B, S], q_offset an int32
  scalar, sinks float [N]); each one off costs nothing (static switches).
  The kernel runs T rounded up to 128 rows and S to ``block_kv``; the rows past
  the ends are zeros that TMA reads (a padding copy only where
  `_common.pad_rows_for_tma` needs one): such keys are masked in the last key
  tile, such query rows are neither stored nor returned.

  Returns (out [B, T, N, H], lse [B, N, T] float32).
  """
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  tp = _common.cdiv(t, akc.CTA_ROWS) * akc.CTA_ROWS
  sp = _common.cdiv(s, config.block_kv) * config.block_kv
  segments = q_segment_ids is not None
  feat = akc.features(causal, local_window, logits_soft_cap,
                      query_seq_lengths is not None,
                      key_value_seq_lengths is not None, segments,
                      q_offset is not None)
  if config.overlap_qk and not akc.overlap_takes(feat, t, s):
    raise NotImplementedError(
        "overlap_qk with sequence lengths, segment ids, q_offset, T > S or a "
        "window that excludes a row's own position: its first turn needs a key "
        f"tile for every block's first warpgroup (T={t}, S={s}, window "
        f"{local_window}); use the plain schedule (overlap_qk=False)")
  extras = ()
  if feat.dynamic:
    extras = (akc.limits(b, t, s, feat, query_seq_lengths, key_value_seq_lengths,
                         q_offset),)
    if segments:
      q_ids = q_segment_ids.astype(jnp.int32)
      kv_ids = kv_segment_ids.astype(jnp.int32)
      extras += (akc.segment_tile_range(q_ids, kv_ids, t, s, tp, sp, config.block_kv),
                 _common.pad_axis(q_ids, 1, tp), _common.pad_axis(kv_ids, 1, sp))
  q_rows = _common.pad_rows_for_tma(q, 1, akc.CTA_ROWS)
  k_rows, v_rows = (_common.pad_rows_for_tma(x, 1, config.block_kv) for x in (k, v))
  out, lse = flash_forward(q_rows, k_rows, v_rows, *extras,
                           scale=scale, causal=causal, s_true=s, config=config,
                           feat=feat,
                           sinks=None if sinks is None else sinks.astype(jnp.float32))
  return out[:, :t], lse[:, :, :t]
